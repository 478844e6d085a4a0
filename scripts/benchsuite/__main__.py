"""scripts/bench-suite: see __init__.py and --help."""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import chart, report
from .procs import BenchError, BusyLoops, find_program
from .transports import BASELINE, DeviceCounters, make_transports, smclo_knobs
from .layout import DEPLOYED_THREADS, NAMES as LAYOUTS, Layout, describe
from .workloads import all_workloads, redis_requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Context:
    """What every measurement needs: programs, placement, durations, logs."""

    def __init__(self, args, layout, work):
        self.smclo = os.path.abspath(args.smclo)
        self.seconds = args.seconds
        self.layout = layout
        self.work = work
        self.nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self._counters = {}

    def counters(self, t):
        return self._counters.setdefault(t.device_dir, DeviceCounters(t.smclo, t.device_dir))

    def log(self, name, t):
        return os.path.join(self.work, "%s-%s.log" % (name, t.name))



# Soft RLIMIT_NOFILE one idle smclo connection needs for all of them to be in
# shared memory (3 descriptors each within 1/16 of the limit, and margin).
FDS_PER_IDLE_CONN = 50


def default_idle_conns():
    """1000, or as many as the hard RLIMIT_NOFILE lets smclo hold in shared
    memory (its programs raise their soft limit to the hard one)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return 1000
    return max(1, min(1000, hard // FDS_PER_IDLE_CONN))

def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "memory_gib": round(mem_kib / 2**20, 1),
            "loadavg_before": open("/proc/loadavg").read().split()[:3]}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="scripts/bench-suite",
        description="The seeds' benchmarks (ipc-bench message rate, sockperf, iperf3, nginx + wrk, redis-benchmark), memcached + memcslap, "
                    "postgres + pgbench -S, "
                    "connection setup and idle-connection memory, over TCP, a UNIX socket, smclo (no-copy and copy) "
                    "and the kernel's SMC-D loopback when the kernel offers it; transports alternate in every round; "
                    "medians, ratios to TCP, the kernel's published ratios, CPU time. Writes suite.md, suite.json "
                    "and suite.png to --out.")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3); the median is reported")
    p.add_argument("--seconds", type=float, default=2.0, help="length of each timed run (default 2)")
    p.add_argument("--out", default=os.path.join(ROOT, "target", "bench-suite"), help="output directory")
    p.add_argument("--only", help="comma-separated workloads: " + ",".join(w.name for w in all_workloads()))
    p.add_argument("--idle-conns", type=int, default=default_idle_conns(),
                   help="idle connections for the memory row (default 1000, or fewer where the hard RLIMIT_NOFILE "
                        "is under %d: smclo keeps its descriptors, 3 per connection, within 1/16 of the "
                        "limit, and a connection past that stays TCP; here %d)" % (1000 * FDS_PER_IDLE_CONN,
                                                                                 default_idle_conns()))
    p.add_argument("--redis-requests", type=int,
                   help="redis-benchmark -n (default: 100000 pinned; as deployed, where redis-benchmark --threads "
                        "ends its tests on a 250 ms timer, enough for 5 s or --seconds at 400000 requests/s)")
    p.add_argument("--dmb-size", default="1m",
                   help="smclo's DMB and copy-mode send buffer size (SMCLO_RMEM/SMCLO_WMEM) unless the environment "
                        "sets them; default 1m, the seeds' 'SMC sndbuf/DMB size 1MB'; 'default' for smclo's own 256k")
    p.add_argument("--layout", choices=LAYOUTS, default="pinned",
                   help="pinned (default): the servers on --server-cpu, the clients on --client-cpu, one thread or "
                        "worker each, as the seeds ran them; deployed: no pinning and the programs' usual thread "
                        "counts (%s), as users run them" % DEPLOYED_THREADS)
    p.add_argument("--busy-loops", action="store_true",
                   help="run one busy loop per CPU (pinned to it) beside every run, as on a host with batch jobs")
    p.add_argument("--server-cpu", type=int, default=1, help="CPU the servers are pinned to (default 1)")
    p.add_argument("--client-cpu", type=int, default=0, help="CPU the clients are pinned to (default 0)")
    p.add_argument("--smclo", default=os.path.join(ROOT, "target", "release", "smclo"), help="the smclo binary")
    p.add_argument("--baseline", metavar="SMCLO",
                   help="another build's smclo binary (its preload library beside it), run as one more transport, "
                        "'smclo baseline', in every round beside this build: the tables add this build against it")
    p.add_argument("--transports",
                   help="comma-separated transports to run (default all): tcp,unix,smclo,smclo-copy,kernel-smc,"
                        "smclo-base; tcp is always run, as every ratio's reference")
    p.add_argument("--readme", action="store_true",
                   help="also write the tables into README.md (between the SUITE markers) and the chart and JSON to docs/bench/")
    p.add_argument("--render", metavar="JSON", help="do not measure: redraw the outputs from a suite.json")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check that every workload runs over every transport (1 round, short runs)")
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.seconds, a.idle_conns, a.redis_requests = 1, 0.5, 50, 2000
    if a.rounds < 1 or not 0 < a.seconds <= 60 or a.idle_conns < 1 or (a.redis_requests is not None and a.redis_requests < 1):
        p.error("--rounds, --idle-conns and --redis-requests must be positive and --seconds in (0, 60]")
    cores = os.cpu_count() or 1
    if max(a.server_cpu, a.client_cpu) >= cores or a.server_cpu == a.client_cpu:
        p.error("--server-cpu and --client-cpu must be two different CPUs below %d" % cores)
    return a


def check_programs(workloads, smclo):
    missing = sorted({n for w in workloads for n in w.needs if not find_program(n)})
    if not os.access(smclo, os.X_OK):
        sys.exit("bench-suite: %s is missing: build first (cargo build --release --workspace, or ./demo.sh)" % smclo)
    if missing:
        sys.exit("bench-suite: missing programs: %s. On Debian: sudo scripts/install-packages.sh "
                 "(or apt-get install sockperf iperf3 nginx-light wrk redis-server redis-tools memcached libmemcached-tools postgresql)" % " ".join(missing))
    if not shutil.which("taskset"):
        sys.exit("bench-suite: taskset is missing (util-linux)")


def transports_of(w, run):
    """The transports of the run (names `run`) that workload `w` can use;
    the baseline build's wherever smclo's."""
    mine = list(w.transports) + ([BASELINE] if "smclo" in w.transports else [])
    return [n for n in mine if n in run]


def measure(args):
    layout = Layout(args.layout, args.server_cpu, args.client_cpu)
    workloads = all_workloads(args.idle_conns, args.redis_requests, layout)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in [w.name for w in workloads]]
        if unknown:
            sys.exit("bench-suite: unknown workload(s) %s; known: %s" % (",".join(unknown), ",".join(w.name for w in workloads)))
        workloads = [w for w in workloads if w.name in names]
    check_programs(workloads, args.smclo)
    if args.baseline and not os.access(args.baseline, os.X_OK):
        sys.exit("bench-suite: --baseline %s is not an executable smclo binary" % args.baseline)
    work = tempfile.mkdtemp(prefix="smclo-suite-")
    knobs = smclo_knobs(args.dmb_size)
    transports, device_dirs = make_transports(os.path.abspath(args.smclo), work, knobs,
                                              os.path.abspath(args.baseline) if args.baseline else None)
    if args.transports:
        wanted = set(args.transports.split(",")) | {"tcp"}
        unknown = wanted - {t.name for t in transports}
        if unknown:
            for d in device_dirs:
                shutil.rmtree(d, ignore_errors=True)
            sys.exit("bench-suite: unknown transport(s) %s (smclo-base needs --baseline)" % ",".join(sorted(unknown)))
        transports = [t for t in transports if t.name in wanted]
    ctx = Context(args, layout, work)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "config": {"rounds": args.rounds, "seconds": args.seconds, **layout.config(),
                   "busy_loops": args.busy_loops,
                   "idle_conns": args.idle_conns,
                   "redis_requests": redis_requests(layout, args.seconds, args.redis_requests),
                   "baseline": os.path.abspath(args.baseline) if args.baseline else None,
                   "pinning": describe({**layout.config(), "busy_loops": args.busy_loops}),
                   # Knobs such as SMCLO_RMEM change the results: a run says
                   # which were set.
                   "smclo_env": dict(sorted(knobs.items()))},
        "transports": [{"name": t.name, "label": t.label, "available": t.available,
                        "why_unavailable": t.why_unavailable, "prefix": t.prefix} for t in transports],
        "workloads": [{"name": w.name, "transports": transports_of(w, {t.name for t in transports}), "third_party": w.third_party,
                       "cpu_unit": w.cpu_unit[0] if w.cpu_unit else None,
                       "rows": [vars(r) for r in w.rows()]} for w in workloads],
        "runs": [],
    }
    busy = BusyLoops() if args.busy_loops else contextlib.nullcontext()
    try:
        with busy:
            run_rounds(args, ctx, workloads, transports, doc)
    finally:
        for w in workloads:
            w.close()
        shutil.rmtree(work, ignore_errors=True)
        for d in device_dirs:
            shutil.rmtree(d, ignore_errors=True)
    doc["machine"]["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    return doc


def run_rounds(args, ctx, workloads, transports, doc):
    """Every round: every workload over every transport it can use, in
    turn, into doc["runs"]."""
    for rnd in range(1, args.rounds + 1):
        for w, wd in zip(workloads, doc["workloads"]):
            usable = [t for t, td in zip(transports, doc["transports"]) if report.usable(wd, td)]
            # Alternate who goes first, so that drift hits all alike.
            k = (rnd - 1) % len(usable)
            for t in usable[k:] + usable[:k]:
                run = {"round": rnd, "workload": w.name, "transport": t.name}
                try:
                    run.update(w.run(ctx, t))
                except (BenchError, OSError, subprocess.SubprocessError) as e:
                    # One failed measurement is reported, not fatal.
                    run["error"] = str(e)
                doc["runs"].append(run)
                shown = "error: " + run["error"] if "error" in run else " ".join(
                    "%s=%s" % (k2, report.fmt(v)) for k2, v in run["values"].items())
                print("round %d/%d %-12s %-11s %s" % (rnd, args.rounds, w.name, t.name, shown), file=sys.stderr)
                time.sleep(0.2)


def write_outputs(doc, out, readme, draw_chart=True):
    os.makedirs(out, exist_ok=True)
    report.summarize(doc)
    md = report.markdown(doc)
    with open(os.path.join(out, "suite.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "suite.md"), "w") as f:
        f.write(md)
    if draw_chart:
        chart.draw(doc, os.path.join(out, "suite.png"))
    print(md)
    if readme:
        write_readme(doc, md, out)


def write_readme(doc, md, out):
    """Puts the tables `md` into README.md between the markers of the run's
    layout, and the chart and JSON into docs/bench/."""
    deployed = doc["config"].get("layout") == "deployed"
    marker, stem = ("SUITE-DEPLOYED", "suite-deployed") if deployed else ("SUITE", "suite")
    docs = os.path.join(ROOT, "docs", "bench")
    os.makedirs(docs, exist_ok=True)
    shutil.copy(os.path.join(out, "suite.json"), os.path.join(docs, stem + ".json"))
    shutil.copy(os.path.join(out, "suite.png"), os.path.join(docs, stem + ".png"))
    block = ("<!-- %(m)s:BEGIN (generated by scripts/bench-suite --readme; do not edit) -->\n"
             "```\n$ scripts/bench-suite %(cmd)s\n```\n\n%(md)s\n![smclo against TCP, per workload](docs/bench/%(s)s.png)\n\n"
             "Raw runs, machine and placement: [docs/bench/%(s)s.json](docs/bench/%(s)s.json).\n"
             "<!-- %(m)s:END -->\n" % {"m": marker, "s": stem, "cmd": doc["config"].get("command_line", ""),
                                      "md": md})
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    new, n = re.subn(r"<!-- %s:BEGIN.*?<!-- %s:END -->\n?" % (marker, marker), lambda m: block, text, flags=re.S)
    if n != 1:
        sys.exit("bench-suite: README.md must contain exactly one %s:BEGIN/%s:END block" % (marker, marker))
    with open(path, "w") as f:
        f.write(new)
    print("bench-suite: README.md, docs/bench/%s.png and docs/bench/%s.json updated" % (stem, stem), file=sys.stderr)


def main(argv):
    args = parse_args(argv)
    # Stopped with SIGTERM, the suite still stops its servers and removes
    # its directories and devices (the `finally` of measure()).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        import matplotlib  # noqa: F401  (fail before a long run, not after)
    except ImportError:
        sys.exit("bench-suite: the chart needs matplotlib: apt-get install python3-matplotlib (or pip install matplotlib)")
    if args.render:
        try:
            with open(args.render) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit("bench-suite: cannot read %s: %s" % (args.render, e))
    else:
        doc = measure(args)
        doc["config"]["command_line"] = " ".join(argv)
    write_outputs(doc, args.out, args.readme)
    failed = [r for r in doc["runs"] if r.get("error")]
    if failed:
        print("bench-suite: %d run(s) failed (listed under the tables)" % len(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
