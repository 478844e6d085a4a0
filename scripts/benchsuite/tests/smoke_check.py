"""Checks a `scripts/bench-suite --smoke` run (called by test.sh):

every workload ran over every transport it can use, with a positive result,
no run failed, every smclo run is proven by the device's counters, the
kernel's SMC-D is reported unavailable exactly when socket(AF_SMC) fails,
and the markdown and PNG were written.

usage: python3 -m benchsuite.tests.smoke_check OUT_DIR
"""

import errno
import json
import math
import os
import socket
import sys

from benchsuite import report

# Rows measured as a change of the whole machine's memory, not of our processes.
SYSTEM_WIDE = {"idle_shm", "idle_kernel"}


def kernel_has_af_smc():
    try:
        socket.socket(43, socket.SOCK_STREAM, 0).close()
        return True
    except OSError as e:
        if e.errno == errno.EAFNOSUPPORT:
            return False
        raise


def check(out):
    problems = []
    with open(os.path.join(out, "suite.json")) as f:
        doc = json.load(f)
    ts = {t["name"]: t for t in doc["transports"]}
    if not kernel_has_af_smc() and ts.get("kernel-smc", {}).get("available"):
        problems.append("kernel-smc is reported available, but socket(AF_SMC) fails here")
    rounds = doc["config"]["rounds"]
    idle = doc["config"]["idle_conns"]
    for w in doc["workloads"]:
        for name in w["transports"]:
            t = ts[name]
            if not report.usable(w, t):
                continue
            runs = [r for r in doc["runs"] if r["workload"] == w["name"] and r["transport"] == name]
            if len(runs) != rounds:
                problems.append("%s/%s: %d runs, wanted %d" % (w["name"], name, len(runs), rounds))
            for r in runs:
                where = "%s/%s round %d" % (w["name"], name, r["round"])
                if r.get("error"):
                    problems.append("%s failed: %s" % (where, r["error"]))
                    continue
                for row in w["rows"]:
                    v = r["values"][row["key"]]
                    # The process's own memory may be 0 KiB for TCP. Shmem
                    # and slab are system-wide deltas: whatever else runs on
                    # the machine moves them too, so a small negative value
                    # is noise, not a failed run; they must only be numbers.
                    # Everything else is a rate, a time or a size that must
                    # be positive.
                    if row["key"] in SYSTEM_WIDE:
                        ok = isinstance(v, (int, float)) and math.isfinite(v)
                    else:
                        ok = v > 0 or (row["key"].startswith("idle_") and v >= 0)
                    if not ok:
                        problems.append("%s: %s = %r" % (where, row["key"], v))
                if name.startswith("smclo"):
                    d = r.get("device") or {}
                    if not proven(w["name"], d, idle):
                        problems.append("%s: device counters do not prove shared memory: %r" % (where, d))
    with open(os.path.join(out, "suite.md")) as f:
        md = f.read()
    for w in doc["workloads"]:
        for row in w["rows"]:
            if "| %s |" % row["label"] not in md:
                problems.append("suite.md lacks the row %r" % row["label"])
    with open(os.path.join(out, "suite.png"), "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            problems.append("suite.png is not a PNG")
    return problems


def proven(workload, d, idle):
    """Whether the device counters `d` of one smclo run prove what the
    workload's run must show: shared memory for every connection, or for
    setup-learnt the client learning its connections short."""
    if workload == "setup-learnt":
        others = set(d.get("fallbacks", {})) - {"SHORT", "PEERNOSMC"}
        return (d.get("conns_opened", 0) >= 16 and d.get("xfer_bytes", 0) > 0 and not others
                and "SHORT" in d.get("fallbacks", {}))
    want = idle if workload == "idle" else 1
    return d.get("conns_opened", 0) >= want and d.get("xfer_bytes", 0) > 0 and not d.get("fallbacks")


def main():
    problems = check(sys.argv[1])
    for p in problems:
        print("bench-suite smoke: " + p, file=sys.stderr)
    if problems:
        return 1
    print("bench-suite smoke: every workload ran over every usable transport; smclo runs proven by the device counters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
