"""From the raw runs to medians, ratios and markdown tables (pure: reads
only the suite's JSON document, so a table can be redrawn from any run)."""

import statistics

from . import layout
from .transports import BASELINE

NA = "—"


def usable(w, t):
    """Whether workload `w` runs over transport `t` (both in the suite's JSON
    form): the tool can use it, and it is available here. Third-party
    programs reach the kernel's SMC only through smc-tools' smc_run."""
    return (t["name"] in w["transports"] and t["available"]
            and not (w["third_party"] and t["name"] == "kernel-smc" and not t["prefix"]))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def round_ratios(runs, workload, key, transport, reference):
    """Row `key`'s value over `transport` divided by its value over
    `reference` in the same round, for every round that has both."""
    ref = {r["round"]: r["values"][key] for r in runs
           if r["workload"] == workload and r["transport"] == reference and r.get("values")}
    return [r["values"][key] / ref[r["round"]] for r in runs
            if r["workload"] == workload and r["transport"] == transport and r.get("values")
            and ref.get(r["round"])]


def summarize(doc):
    """Adds doc["summary"]: for every row and transport the samples, their
    median, the ratio to TCP's median, and the median CPU cost."""
    runs = doc["runs"]
    summary = {"rows": {}, "cpu": {}}
    for w in doc["workloads"]:
        for row in w["rows"]:
            cells = {}
            for t in doc["transports"]:
                mine = [r for r in runs if r["workload"] == w["name"] and r["transport"] == t["name"]]
                samples = [r["values"][row["key"]] for r in mine if r.get("values")]
                errors = [r["error"] for r in mine if r.get("error")]
                cells[t["name"]] = {"samples": samples, "median": _median(samples), "errors": errors}
            tcp = cells.get("tcp", {}).get("median")
            for c in cells.values():
                c["vs_tcp"] = c["median"] / tcp if c["median"] is not None and tcp else None
            # Transports run back to back within a round, so the ratio of
            # one round is less moved by a noisy neighbour than the ratio
            # of medians; the JSON keeps both.
            for name, c in cells.items():
                ratios = round_ratios(runs, w["name"], row["key"], name, "tcp")
                c["round_ratios"] = ratios
                c["median_round_ratio"] = _median(ratios)
            summary["rows"][row["key"]] = cells
        cpu = {}
        for t in doc["transports"]:
            mine = [r for r in runs if r["workload"] == w["name"] and r["transport"] == t["name"] and r.get("values")]
            per_op = _median([r.get("cpu_per_op") for r in mine])
            cores = _median([(r["cpu_s"]["client"] + r["cpu_s"]["server"]) / r["wall_s"]
                             for r in mine if r.get("cpu_s") and r.get("wall_s")])
            cpu[t["name"]] = {"per_op": per_op, "cores": cores}
        tcp = cpu.get("tcp", {}).get("per_op")
        for c in cpu.values():
            c["vs_tcp"] = c["per_op"] / tcp if c["per_op"] is not None and tcp else None
        summary["cpu"][w["name"]] = cpu
    doc["summary"] = summary
    return doc


def fmt(v):
    if v is None:
        return NA
    a = abs(v)
    if a >= 1000:
        return "%.0f" % v
    if a >= 100:
        return "%.1f" % v
    if a >= 10:
        return "%.2f" % v
    return "%.3g" % v


def pct(ratio):
    """A ratio to TCP the way the seeds write it: +66.68% → +67%."""
    d = (ratio - 1) * 100
    if abs(d) >= 1000:
        return "%+.0f%%, %.0f×" % (d, ratio)
    return "%+.0f%%" % d


def verdict(row, ratio):
    """smclo against the kernel's published ratio for this row."""
    lo, hi = row["published"]
    better = (lambda a, b: a > b) if row["higher_better"] else (lambda a, b: a < b)
    best, worst = (hi, lo) if row["higher_better"] else (lo, hi)
    if ratio is None:
        return NA
    # Equal at the precision shown is a draw, not a win.
    if round(ratio, 2) == round(best, 2):
        return "level (%.2f× vs %s)" % (ratio, _published(row))
    if better(ratio, best):
        return "**ahead** (%.2f× vs %s)" % (ratio, _published(row))
    if better(ratio, worst) or ratio == worst:
        return "within (%.2f× vs %s)" % (ratio, _published(row))
    return "**behind** (%.2f× vs %s)" % (ratio, _published(row))


def _published(row):
    lo, hi = row["published"]
    return "%.2f×" % lo if lo == hi else "%.2f–%.2f×" % (lo, hi)


def _cell(doc, w, t, cell, is_tcp):
    if t["name"] not in w["transports"]:
        return NA
    if not usable(w, t):
        return "unavailable"
    if cell["median"] is None:
        return "failed" if cell["errors"] else NA
    s = fmt(cell["median"])
    if not is_tcp and cell["vs_tcp"] is not None:
        s += " (%s)" % pct(cell["vs_tcp"])
    if cell["errors"]:
        s += " ¹"
    return s


def baseline_table(doc):
    """Lines comparing smclo with the baseline build, when the suite ran one:
    the ratio of medians and the median of the per-round ratios (the two
    builds run back to back in every round), and the CPU per operation."""
    names = [t["name"] for t in doc["transports"]]
    if BASELINE not in names or "smclo" not in names:
        return []
    out = ["", "This build (smclo) against the baseline build (%s), no-copy, same settings, run back to back in "
           "every round:" % doc["config"].get("baseline", "smclo-base"), "",
           "| row | unit | baseline | this build | ratio of medians | median of round ratios | CPU per op, ratio |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for w in doc["workloads"]:
        cpu = doc["summary"]["cpu"][w["name"]]
        for row in w["rows"]:
            cells = doc["summary"]["rows"][row["key"]]
            base, mine = cells.get(BASELINE, {}), cells.get("smclo", {})
            if base.get("median") is None or mine.get("median") is None:
                continue
            ratios = round_ratios(doc["runs"], w["name"], row["key"], "smclo", BASELINE)
            c_base, c_mine = cpu.get(BASELINE, {}).get("per_op"), cpu.get("smclo", {}).get("per_op")
            out.append("| %s | %s | %s | %s | %.3f× | %s | %s |" % (
                row["label"], row["unit"], fmt(base["median"]), fmt(mine["median"]), mine["median"] / base["median"],
                "%.3f×" % _median(ratios) if ratios else NA,
                "%.3f×" % (c_mine / c_base) if c_mine and c_base else NA))
    out.append("")
    out.append("For rows where lower is better (latency, memory), a ratio under 1 means this build is better.")
    return out


def markdown(doc):
    """The suite's tables: results in the seeds' layout (value, ±% against
    TCP) with the kernel's published ratios beside, then CPU cost."""
    ts = doc["transports"]
    m = doc["machine"]
    c = doc["config"]
    out = []
    out.append("Median of %d rounds (%g s per timed run); %s; transports alternate within every round. "
               "%s, %d cores, kernel %s, %s."
               % (c["rounds"], c["seconds"], layout.describe(c), m["cpu"], m["cores"], m["kernel"], doc["date"]))
    env = c.get("smclo_env") or {}
    out.append("")
    seeds = env.get("SMCLO_RMEM") == env.get("SMCLO_WMEM") == "1m"
    out.append("smclo settings: %s%s." % (
        ", ".join("`%s=%s`" % kv for kv in sorted(env.items())) if env
        else "defaults (256 KiB DMBs and copy-mode send buffers)",
        " (1 MiB DMBs and send buffers, as the seeds' runs had: “SMC sndbuf/DMB size 1MB”; "
        "smclo's default is 256 KiB)" if seeds else ""))
    out.append("")
    out.append("smclo runs the programs unchanged under `smclo run` (no-copy, and copy with `dmb_copy=1`); "
               "every smclo run is checked against the device's counters (new SMC-D connections, bytes moved, "
               "no fallback). “kernel, published” is the kernel's own SMC-D loopback against TCP as published "
               "in the patch series' cover letters, measured on an 8-vCPU VM, not on this machine.")
    out.append("")
    head = ["workload (seeds' command, scaled to 2 cores)", "unit"] + [t["label"] for t in ts] + \
        ["kernel, published (8-vCPU VM)", "smclo vs published"]
    out.append("| " + " | ".join(head) + " |")
    out.append("| --- | --- |" + " ---: |" * len(ts) + " ---: | --- |")
    for w in doc["workloads"]:
        for row in w["rows"]:
            cells = doc["summary"]["rows"][row["key"]]
            line = [row["label"], row["unit"]]
            for t in ts:
                line.append(_cell(doc, w, t, cells[t["name"]], t["name"] == "tcp"))
            if row["published"]:
                lo, hi = row["published"]
                line.append(_published(row) + (" (%s)" % pct(lo) if lo == hi else ""))
                line.append(verdict(row, cells.get("smclo", {}).get("vs_tcp")))
            else:
                line += [NA, NA]
            out.append("| " + " | ".join(line) + " |")
    out.append("")
    out.append("CPU time of client and server together (user + system), per unit of work, with ±% against TCP, "
               "and how many of the 2 cores the pair kept busy: a gain bought by spinning shows here.")
    out.append("")
    out.append("| workload | CPU per | " + " | ".join(t["label"] for t in ts) + " |")
    out.append("| --- | --- |" + " ---: |" * len(ts))
    for w in doc["workloads"]:
        if not w["cpu_unit"]:
            continue
        cpu = doc["summary"]["cpu"][w["name"]]
        line = [w["name"], w["cpu_unit"]]
        for t in ts:
            cc = cpu[t["name"]]
            if t["name"] not in w["transports"] or cc["per_op"] is None:
                line.append(_cell(doc, w, t, {"median": None, "errors": []}, True))
                continue
            s = fmt(cc["per_op"])
            if t["name"] != "tcp" and cc["vs_tcp"] is not None:
                s += " (%s)" % pct(cc["vs_tcp"])
            s += ", %.2f cores" % cc["cores"] if cc["cores"] is not None else ""
            line.append(s)
        out.append("| " + " | ".join(line) + " |")
    out += baseline_table(doc)
    notes = []
    for t in ts:
        if not t["available"]:
            notes.append("%s unavailable: %s." % (t["label"], t["why_unavailable"]))
        elif t["name"] == "kernel-smc":
            # The kernel does not say per socket whether SMC fell back to
            # TCP (smc-tools' smcss and smcd stats do, via netlink).
            notes.append("%s: measured with socket(AF_SMC)%s; not checked for fallback to TCP."
                         % (t["label"], " and smc-tools' smc_run" if t["prefix"] else
                            "; third-party programs need smc-tools' smc_run, which is not installed"))
    failures = [r for r in doc["runs"] if r.get("error")]
    if failures:
        notes.append("¹ %d run(s) failed and are left out of the medians: %s" % (
            len(failures), "; ".join("%s/%s round %d: %s" % (r["workload"], r["transport"], r["round"], r["error"])
                                     for r in failures[:5])))
    notes.append("— : the tool has no such mode (wrk, sockperf and iperf3 cannot use a UNIX socket), "
                 "or the seeds have no published figure for the row.")
    out.append("")
    out += notes
    return "\n".join(out) + "\n"
