"""Pure parsers of the benchmark programs' outputs (tested in tests/).

Each returns a dict of numbers, or raises ValueError naming what is missing,
so that a program's changed output format fails loudly instead of being
read as zero.
"""

import json
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _need(m, what, text):
    if not m:
        tail = text.strip().splitlines()[-5:]
        raise ValueError("no %s in output: %s" % (what, " | ".join(tail) or "(empty)"))
    return m


def own_client(text):
    """``smclo bench __client``: the metric on the first line, then
    ``name value`` lines."""
    lines = [l for l in text.strip().splitlines() if l.strip()]
    _need(lines, "metric", text)
    out = {"value": float(lines[0])}
    for l in lines[1:]:
        k, v = l.split()
        out[k] = float(v)
    return out


def sockperf_pp(text):
    """``sockperf pp``: average one-way latency and percentiles, µs."""
    t = _ANSI.sub("", text)
    out = {"value": float(_need(re.search(r"avg-latency=([0-9.]+)", t), "avg-latency", t).group(1))}
    for name, pct in (("p50", "50.000"), ("p99", "99.000"), ("p999", "99.900")):
        out[name] = float(_need(re.search(r"percentile %s =\s*([0-9.]+)" % re.escape(pct), t), "percentile " + pct, t).group(1))
    m = _need(re.search(r"\[Valid Duration\].*?ReceivedMessages=(\d+)", t), "valid-duration message count", t)
    out["ops"] = float(m.group(1))
    # CPU time covers the whole run, warm-up included.
    m = _need(re.search(r"\[Total Run\].*?ReceivedMessages=(\d+)", t), "total message count", t)
    out["cpu_ops"] = float(m.group(1))
    return out


def sockperf_tp(text):
    """``sockperf tp``: bandwidth in MB/s (sockperf's MBps, 10^6 bytes), and
    the bytes sent."""
    t = _ANSI.sub("", text)
    bw = float(_need(re.search(r"BandWidth is ([0-9.]+) MBps", t), "BandWidth", t).group(1))
    m = _need(re.search(r"Total of (\d+) messages sent", t), "message count", t)
    return {"value": bw, "ops": float(m.group(1))}


def iperf3(text):
    """``iperf3 -c --json``: received Gbit/s and bytes."""
    try:
        j = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError("iperf3 output is not JSON: %s" % e)
    if "error" in j:
        raise ValueError("iperf3: %s" % j["error"])
    r = j["end"]["sum_received"]
    return {"value": r["bits_per_second"] / 1e9, "ops": float(r["bytes"])}


def wrk(text):
    """``wrk``: requests/s and requests; errors fail (a server that resets
    or answers non-2xx must not be measured as fast)."""
    if re.search(r"Socket errors|Non-2xx", text):
        raise ValueError("wrk reports errors: %s" % " | ".join(l for l in text.splitlines() if "errors" in l or "Non-2xx" in l))
    rate = float(_need(re.search(r"Requests/sec:\s*([0-9.]+)", text), "Requests/sec", text).group(1))
    n = float(_need(re.search(r"(\d+) requests in", text), "request count", text).group(1))
    if n <= 0:
        raise ValueError("wrk completed no request")
    return {"value": rate, "ops": n}


def redis_benchmark(text):
    """``redis-benchmark -q -t set,get``: requests/s of SET and GET."""
    t = text.replace("\r", "\n")
    out = {}
    for test in ("SET", "GET"):
        m = re.findall(r"^\s*%s: ([0-9.]+) requests per second" % test, t, re.M)
        out[test] = float(_need(m, test + " result", t)[-1])
    return out


def memcslap(text):
    """Two ``memcslap --test=set`` then ``--test=get`` runs: operations/s of
    each, from "Time to set|get N keys by C threads: T seconds" (the get
    run's unthreaded "Time to set N keys" preload is not a result)."""
    out = {}
    for test in ("set", "get"):
        m = re.findall(r"^Time to %s\s+(\d+) keys by\s+\d+ threads:\s+([0-9.]+) seconds" % test, text, re.M)
        n, secs = _need(m, test + " result", text)[-1]
        if float(secs) <= 0:
            raise ValueError("memcslap %s took %s seconds: too short to measure" % (test, secs))
        out[test.upper()] = int(n) / float(secs)
    return out


def pgbench(text):
    """``pgbench -T``: transactions per second without connection setup
    ("without initial connection time", before PostgreSQL 14 "excluding
    connections establishing") and the transactions done; a failed
    transaction fails the run."""
    m = re.search(r"^number of failed transactions: (\d+)", text, re.M)
    if m and int(m.group(1)):
        raise ValueError("pgbench: %s failed transactions" % m.group(1))
    tps = _need(re.search(r"^tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)",
                          text, re.M), "tps without connection setup", text)
    n = int(_need(re.search(r"^number of transactions actually processed: (\d+)", text, re.M),
                  "transaction count", text).group(1))
    if n <= 0:
        raise ValueError("pgbench processed no transaction")
    return {"value": float(tps.group(1)), "ops": float(n)}
