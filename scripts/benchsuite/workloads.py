"""The workloads: the seeds' commands, scaled to a 2-core machine.

A workload starts its server, runs its client once, and parses what the
client printed. Each yields one or more table rows (redis-benchmark gives
SET and GET from one run; ping-pong gives an average and percentiles).
"""

import os
import select
import subprocess

from . import parse, pgcluster, transports
from .layout import Layout
from .procs import BenchError, Server, free_port, meminfo_kib, process_rss_kib, run_client, wait_listening


class Row:
    """One line of the table.

    `published` is the kernel's ratio to TCP from the seeds' cover letters
    (a (low, high) range), measured on an 8-vCPU VM; None where they did
    not measure this.
    """

    def __init__(self, key, label, unit, field="value", higher_better=True, published=None, chart=True):
        self.key = key
        # Memory is not a speed: the chart of speed-ups leaves it out.
        self.chart = chart
        self.label = label
        self.unit = unit
        self.field = field
        self.higher_better = higher_better
        self.published = published


class Workload:
    """Base: a timed client against a server, both placed by the layout,
    both behind the transport's prefix. Subclasses say what to run and how
    to read it."""

    name = ""
    #: where the programs run and their thread counts (set by all_workloads)
    layout = Layout("pinned")
    #: transports this workload can use (the tool's limits: wrk, sockperf
    #: and iperf3 have no UNIX-socket mode).
    transports = ("tcp", "smclo", "smclo-copy", "kernel-smc")
    #: True for third-party programs, which need smc-tools' smc_run to use
    #: the kernel's SMC; smclo's own programs open AF_SMC sockets themselves.
    third_party = True
    #: programs that must be installed
    needs = ()
    #: how CPU time is shown: (unit, scale), CPU seconds × scale ÷ ops:
    #: ("µs per request", 1e6) with ops in requests, ("s per GB", 1e9)
    #: with ops in bytes.
    cpu_unit = ("µs per request", 1e6)

    def rows(self):
        raise NotImplementedError

    def cpu_per_op(self, cpu_s, parsed):
        ops = parsed.get("cpu_ops", parsed.get("ops"))
        return cpu_s * self.cpu_unit[1] / ops if ops else None

    def client_timeout(self, ctx):
        """Seconds a client may take before the run fails."""
        return ctx.seconds * 10 + 60

    # A run: start(ctx, t) -> (Server, address), client(ctx, t, address) ->
    # argv, read(text) -> dict.
    def run(self, ctx, t):
        srv, addr = self.start(ctx, t)
        try:
            before = ctx.counters(t).read() if t.device_dir else None
            s0 = srv.cpu_seconds()
            argv = self.layout.client(self.client(ctx, t, addr), t.prefix)
            pids = srv.pids() if self.forks_per_connection else None
            rc, out, err, ccpu, wall = run_client(argv, t.env(), timeout=self.client_timeout(ctx))
            if pids is not None:
                srv.settle(pids)
            scpu = srv.cpu_seconds() - s0
            if srv.proc.poll() is not None and self.server_stays:
                raise BenchError("server exited with status %s during the run" % srv.proc.returncode)
            if rc != 0:
                raise BenchError("client exited with status %d: %s" % (rc, (err.strip() or out.strip())[-400:]))
            try:
                parsed = self.read(out)
            except ValueError as e:
                raise BenchError(str(e))
            proof = self.prove(ctx.counters(t), before) if t.device_dir else None
        finally:
            srv.stop()
        return {"values": {r.key: parsed[r.field] for r in self.rows()},
                "cpu_s": {"client": ccpu, "server": scpu}, "wall_s": wall,
                "cpu_per_op": self.cpu_per_op(ccpu + scpu, parsed),
                "parsed": parsed, "device": proof}

    def prove(self, counters, before):
        """The device's proof that the run went through shared memory."""
        return counters.proof(before, counters.read())

    server_stays = True
    #: the server serves each connection in a process of its own that
    #: exits with it (postgres): the run waits for them to be reaped, so
    #: that their CPU time is counted.
    forks_per_connection = False

    def close(self):
        """Removes what the workload keeps across runs (called once, at the
        end of the suite, also after a failure)."""


class Own(Workload):
    """smclo's own benchmark programs (``smclo bench __peer``/``__client``),
    which also speak UNIX sockets and the kernel's AF_SMC."""

    transports = ("tcp", "unix", "smclo", "smclo-copy", "kernel-smc")
    third_party = False
    program = ""

    def start(self, ctx, t):
        argv = self.layout.server([ctx.smclo, "bench", "__peer", t.code, self.program, "-1"], t.prefix)
        srv = Server(argv, t.env(), ctx.log(self.name, t), stdout=subprocess.PIPE)
        ready, _, _ = select.select([srv.proc.stdout], [], [], 10)
        addr = srv.proc.stdout.readline().decode().strip() if ready else ""
        if not addr:
            srv.stop()
            raise BenchError("smclo bench __peer did not start (see %s)" % ctx.log(self.name, t))
        return srv, addr

    def client(self, ctx, t, addr):
        return [ctx.smclo, "bench", "__client", t.code, self.program, addr, str(ctx.seconds), "-1"]

    def read(self, text):
        return parse.own_client(text)

    # The ping-pong servers exit when their one client is done.
    server_stays = False


class MsgRate(Own):
    name = program = "msgrate"
    cpu_unit = ("µs per message", 1e6)

    def rows(self):
        return [Row("msgrate", "message rate (ipc-bench -s 100: 100 B ping-pong)", "msg/s", published=(1.86, 1.86))]


class PingPong(Own):
    name = program = "pingpong"
    cpu_unit = ("µs per round trip", 1e6)

    def read(self, text):
        p = parse.own_client(text)
        # One-way latency, half the round trip, as sockperf reports it.
        return dict(p, value=p["value"] / 2, p50=p["rtt_p50_us"] / 2, p99=p["rtt_p99_us"] / 2, p999=p["rtt_p999_us"] / 2)

    def rows(self):
        return [Row("pingpong", "own ping-pong latency, average (14 B, RTT/2)", "µs", higher_better=False),
                Row("pingpong_p99", "own ping-pong latency, p99", "µs", "p99", higher_better=False)]


class Stream(Own):
    name = program = "stream"
    cpu_unit = ("s per GB", 1e9)

    def rows(self):
        return [Row("stream", "own stream throughput (64000 B writes)", "Gbit/s")]


class Setup(Own):
    name = program = "setup"
    cpu_unit = ("µs per connection", 1e6)
    server_stays = True

    def rows(self):
        return [Row("setup", "connection setup (connect, accept, 1 B each way, close)", "conn/s")]

    def client(self, ctx, t, addr):
        # The handshake's cost on every connection: a client that learns
        # short connections (SMCLO_SHORT's default) makes most of these
        # plain TCP after the first 16.
        return ["env", "SMCLO_SHORT=smc", *super().client(ctx, t, addr)]


class SetupLearnt(Setup):
    """The setup row as users get it: the client learns that its
    connections carry one byte each way and close, and connects as TCP
    after its first 16 (SMCLO_SHORT's default, docs/handshake.md "Short
    connections")."""

    name = "setup-learnt"
    transports = ("tcp", "smclo")

    def rows(self):
        return [Row("setup_learnt", "… with short connections learnt (smclo's default)", "conn/s")]

    def client(self, ctx, t, addr):
        return Own.client(self, ctx, t, addr)

    def prove(self, counters, before):
        return transports.proof_learnt(before, counters.read())


class Idle(Own):
    """Memory of idle connections: the client opens one connection, the
    suite reads memory, the client opens N more and holds them."""

    name = program = "idle"
    cpu_unit = None

    def rows(self):
        return [Row("idle_rss", "memory at %d idle connections: RSS of both processes" % self.conns,
                    "KiB/conn", "rss", higher_better=False, chart=False),
                Row("idle_shm", "… shared memory (system Shmem)", "KiB/conn", "shm", higher_better=False, chart=False),
                Row("idle_kernel", "… kernel memory (slab)", "KiB/conn", "slab", higher_better=False, chart=False)]

    def __init__(self, conns):
        self.conns = conns

    def run(self, ctx, t):
        srv, addr = self.start(ctx, t)
        cli = None
        try:
            argv = self.layout.client([ctx.smclo, "bench", "__client", t.code, "idle", addr, str(self.conns), "-1"],
                                      t.prefix)
            with open(ctx.log("idle-client", t), "wb") as log:
                cli = subprocess.Popen(argv, env=t.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)

            def expect(word):
                ready, _, _ = select.select([cli.stdout], [], [], 60)
                line = cli.stdout.readline().decode().strip() if ready else ""
                if not line.startswith(word):
                    raise BenchError("idle client said %r instead of %r (see %s)" % (line, word, ctx.log("idle-client", t)))

            def memory():
                crss = process_rss_kib(cli.pid)
                srss = srv.rss_kib()
                shmem, slab = meminfo_kib("Shmem", "Slab")
                return crss + srss, shmem, slab

            expect("base")
            before = ctx.counters(t).read() if t.device_dir else None
            m0 = memory()
            cli.stdin.write(b"go\n")
            cli.stdin.flush()
            expect("ready")
            m1 = memory()
            proof = ctx.counters(t).proof(before, ctx.counters(t).read(), self.conns) if t.device_dir else None
        finally:
            if cli is not None:
                cli.kill()
                cli.wait()
            srv.stop()
        n = self.conns
        parsed = {"rss": (m1[0] - m0[0]) / n, "shm": (m1[1] - m0[1]) / n, "slab": (m1[2] - m0[2]) / n}
        return {"values": {r.key: parsed[r.field] for r in self.rows()}, "cpu_s": None, "wall_s": None,
                "cpu_per_op": None, "parsed": parsed, "device": proof}


class Tool(Workload):
    """A third-party server on a port of our choosing."""

    def server(self, ctx, t, port):
        raise NotImplementedError

    def start(self, ctx, t):
        port = free_port()
        srv = Server(self.layout.server(self.server(ctx, t, port), t.prefix), t.env(), ctx.log(self.name, t))
        try:
            wait_listening(port=port, proc=srv.proc, what=self.name)
        except BenchError:
            srv.stop()
            raise
        return srv, port


class SockperfPingPong(Tool):
    name = "sockperf-pp"
    needs = ("sockperf",)
    cpu_unit = ("µs per message", 1e6)

    def server(self, ctx, t, port):
        return ["sockperf", "sr", "--tcp", "-i", "127.0.0.1", "-p", str(port)]

    def client(self, ctx, t, port):
        # sockperf spends its first 0.4 s warming up; give it time to measure.
        # Without --mps, sockperf sizes its table of send times for 600000
        # messages/s and aborts ("_seqN > m_maxSequenceNo") when a faster
        # transport sends more; smclo does.
        return ["sockperf", "pp", "--tcp", "-i", "127.0.0.1", "-p", str(port), "--msg-size=14", "--mps=5000000",
                "-t", str(max(2, round(ctx.seconds)))]

    def read(self, text):
        return parse.sockperf_pp(text)

    def rows(self):
        return [Row("sockperf_lat", "sockperf pp --msg-size=14: latency, average", "µs", higher_better=False,
                    published=(0.56, 0.56)),
                Row("sockperf_p50", "… p50", "µs", "p50", higher_better=False),
                Row("sockperf_p99", "… p99", "µs", "p99", higher_better=False),
                Row("sockperf_p999", "… p99.9", "µs", "p999", higher_better=False)]


class SockperfThroughput(SockperfPingPong):
    name = "sockperf-tp"
    cpu_unit = ("s per GB", 1e9)

    def client(self, ctx, t, port):
        return ["sockperf", "tp", "--tcp", "-i", "127.0.0.1", "-p", str(port), "--msg-size=64000",
                "-t", str(max(1, round(ctx.seconds)))]

    def read(self, text):
        p = parse.sockperf_tp(text)
        return dict(p, ops=p["ops"] * 64000)

    def rows(self):
        return [Row("sockperf_tp", "sockperf tp --msg-size=64000: throughput", "MB/s", published=(1.67, 1.67))]


class Iperf3(Tool):
    name = "iperf3"
    needs = ("iperf3",)
    cpu_unit = ("s per GB", 1e9)

    def server(self, ctx, t, port):
        return ["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)]

    def client(self, ctx, t, port):
        return ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(max(1, round(ctx.seconds))), "--json"]

    def read(self, text):
        return parse.iperf3(text)

    def rows(self):
        return [Row("iperf3", "iperf3 -c 127.0.0.1: throughput", "Gbit/s", published=(1.78, 1.89))]


class Nginx(Tool):
    """nginx (sendfile, keep-alive) and wrk: one worker and one thread
    pinned; worker_processes auto and two threads as deployed."""

    needs = ("nginx", "wrk")

    def __init__(self, name, size, conns, published=None):
        self.name = name
        self.size = size
        self.conns = conns
        self.published = published

    def server(self, ctx, t, port):
        d = os.path.join(ctx.work, "%s-%s" % (self.name, t.name))
        os.makedirs(os.path.join(d, "www"), exist_ok=True)
        with open(os.path.join(d, "www", "f"), "wb") as f:
            f.write(b"x" * self.size)
        with open(os.path.join(d, "nginx.conf"), "w") as f:
            f.write(("user root;\n" if os.geteuid() == 0 else "") + """worker_processes %(workers)s;
daemon off;
pid %(d)s/nginx.pid;
error_log %(d)s/error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path %(d)s/body;
  proxy_temp_path %(d)s/proxy;
  sendfile on; tcp_nopush on; keepalive_timeout 65; keepalive_requests 1000000;
  default_type application/octet-stream;
  server { listen 127.0.0.1:%(port)d; root %(d)s/www; }
}
""" % {"d": d, "port": port, "workers": self.layout.nginx_workers})
        return [ctx.nginx, "-c", os.path.join(d, "nginx.conf"), "-p", d, "-e", os.path.join(d, "error.log")]

    def client(self, ctx, t, port):
        # wrk takes whole seconds.
        return ["wrk", "-t", str(self.layout.wrk_threads), "-c", str(self.conns), "-d", "%ds" % max(1, round(ctx.seconds)), "http://127.0.0.1:%d/f" % port]

    def read(self, text):
        return parse.wrk(text)

    def rows(self):
        workers = "" if self.layout.nginx_workers == "1" else " (worker_processes %s)" % self.layout.nginx_workers
        return [Row(self.name, "nginx%s + wrk -t %d -c %d, %s file: requests"
                    % (workers, self.layout.wrk_threads, self.conns, _size(self.size)),
                    "req/s", published=self.published)]


def _size(n):
    return "%d MiB" % (n >> 20) if n >= 1 << 20 else "%d B" % n


def redis_requests(layout, seconds, asked=None):
    """redis-benchmark -n: `asked` if given, else sized for the layout (see
    Redis)."""
    if asked is not None:
        return asked
    if layout.redis_threads:
        return int(Redis.FAST_RATE * max(seconds, Redis.MIN_RUN_S))
    return 100000


class Redis(Tool):
    """redis-server (no persistence) and redis-benchmark -t set,get -d 1024;
    over a UNIX socket too (redis-benchmark -s).

    redis-benchmark with --threads ends a test on a 250 ms timer, so its
    rate is the requests over a whole number of quarter seconds (plus a
    few ms): 100000 requests read about 400k, 200k, 133k or 100k
    requests/s. As deployed (threads), the requests are sized so that a
    test at FAST_RATE lasts at least MIN_RUN_S seconds, and --seconds if
    longer: a rate at most 5% low at that speed (6.25% at the 500k smclo
    reaches in some runs here), less at slower ones. Pinned (no threads,
    no such timer): the seeds' 100000, short runs at smclo's rate. A
    count given with --redis-requests is used as is."""

    FAST_RATE = 400000
    MIN_RUN_S = 5

    name = "redis"
    needs = ("redis-server", "redis-benchmark")
    transports = ("tcp", "unix", "smclo", "smclo-copy", "kernel-smc")

    def __init__(self, requests=None):
        self.asked = requests

    def requests(self, ctx):
        """redis-benchmark -n for a run of `ctx.seconds` (see the class)."""
        return redis_requests(self.layout, ctx.seconds, self.asked)

    def client_timeout(self, ctx):
        # Both tests at 10000 requests/s at least, beside the usual margin.
        return Tool.client_timeout(self, ctx) + 2 * self.requests(ctx) / 10000

    def _sock(self, ctx, t):
        return os.path.join(ctx.work, "redis-%s.sock" % t.name)

    def server(self, ctx, t, port):
        conf = os.path.join(ctx.work, "redis-%s.conf" % t.name)
        with open(conf, "w") as f:
            f.write('port %d\nbind 127.0.0.1\nsave ""\nappendonly no\nprotected-mode no\ndir %s\n' % (port, ctx.work))
            if t.name == "unix":
                f.write("unixsocket %s\nunixsocketperm 700\n" % self._sock(ctx, t))
        return ["redis-server", conf]

    def start(self, ctx, t):
        srv, port = Tool.start(self, ctx, t)
        if t.name == "unix":
            wait_listening(path=self._sock(ctx, t), proc=srv.proc, what="redis unix socket")
        return srv, port

    def client(self, ctx, t, port):
        where = ["-s", self._sock(ctx, t)] if t.name == "unix" else ["-h", "127.0.0.1", "-p", str(port)]
        n = self.requests(ctx)
        self.ops = 2.0 * n
        return ["redis-benchmark", *where, "-q", "-t", "set,get", "-n", str(n), "-c", "50", "-d", "1024",
                *self._threads()]

    def _threads(self):
        n = self.layout.redis_threads
        return ["--threads", str(n)] if n else []

    def read(self, text):
        p = parse.redis_benchmark(text)
        return dict(p, ops=self.ops)

    def rows(self):
        cmd = "redis-benchmark %s-d 1024 -c 50" % ("".join(a + " " for a in self._threads()))
        return [Row("redis_set", "%s -t set: SET" % cmd, "req/s", "SET", published=(1.35, 1.40)),
                Row("redis_get", "%s -t get: GET" % cmd, "req/s", "GET", published=(1.35, 1.40))]


class Memcached(Tool):
    """memcached with one worker thread pinned (-t 1: one core, as redis)
    and its default four as deployed, and memcslap's set then get tests,
    16 connections, binary protocol."""

    name = "memcached"
    needs = ("memcached", "memcslap")
    conns = 16

    def server(self, ctx, t, port):
        user = ["-u", "root"] if os.geteuid() == 0 else []
        return ["memcached", *user, "-p", str(port), "-U", "0", "-l", "127.0.0.1", "-t", str(self.layout.memcached_threads),
                "-m", "256"]

    #: Operations per second of the fastest runs seen here (both layouts,
    #: either transport): memcslap runs a count, not a time, sized so that
    #: a test at this rate lasts ctx.seconds (slower ones longer), and the
    #: process's start and its connections' set-up weigh little in a rate.
    FAST_RATE = 200000

    def _per_conn(self, ctx):
        return max(100, int(self.FAST_RATE * ctx.seconds / self.conns))

    def client(self, ctx, t, port):
        n = self._per_conn(ctx)
        # Both tests, for the CPU per operation.
        self.ops = 2.0 * self.conns * n
        run = "memcslap --servers=127.0.0.1:%d --concurrency=%d --execute-number=%d --binary --test=" % (
            port, self.conns, n)
        return ["sh", "-c", "%sset && %sget" % (run, run)]

    def read(self, text):
        return dict(parse.memcslap(text), ops=self.ops)

    def rows(self):
        cmd = "memcached -t %d + memcslap -c 16 --binary" % self.layout.memcached_threads
        return [Row("memcached_set", cmd + ": set", "ops/s", "SET"),
                Row("memcached_get", cmd + ": get", "ops/s", "GET")]


class Postgres(Workload):
    """PostgreSQL (the postmaster forks a backend per connection, which
    waits in epoll) and pgbench -S (select-only: one indexed SELECT per
    transaction), 8 connections (32 in postgres-32: more backends than
    cores) on one pgbench thread pinned, two as deployed (poll or select);
    over a UNIX socket too (pgbench -h DIR). One throwaway cluster serves
    every run (pgcluster)."""

    name = "postgres"
    needs = ("postgres", "initdb", "pgbench")
    transports = ("tcp", "unix", "smclo", "smclo-copy", "kernel-smc")
    cpu_unit = ("µs per transaction", 1e6)
    forks_per_connection = True

    def __init__(self, name="postgres", conns=8, cluster=None):
        self.name = name
        self.conns = conns
        self.cluster = cluster or pgcluster.Cluster()

    def run(self, ctx, t):
        self.cluster.prepare(ctx)
        return Workload.run(self, ctx, self.cluster.transport(ctx, t))

    def start(self, ctx, t):
        return self.cluster.start(ctx, t)

    def client(self, ctx, t, port):
        host = self.cluster.dir if t.name == "unix" else "127.0.0.1"
        # -n: the tables need no vacuum (nothing writes to them); -T takes
        # whole seconds.
        return [pgcluster.program("pgbench"), "-S", "-n", "-c", str(self.conns), "-j", str(self.layout.pgbench_jobs),
                "-T", str(max(1, round(ctx.seconds))), "-h", host, "-p", str(port), "-U", pgcluster.ROLE,
                pgcluster.DATABASE]

    def read(self, text):
        return parse.pgbench(text)

    def rows(self):
        key = "pgbench_select" if self.conns == 8 else "pgbench_select_%d" % self.conns
        return [Row(key, "postgres + pgbench -S -c %d -j %d: transactions (without connection setup)"
                    % (self.conns, self.layout.pgbench_jobs), "tps")]

    def close(self):
        self.cluster.close()


def all_workloads(idle_conns=1000, redis_requests=None, layout=None):
    """The suite, in the seeds' order, then what the seeds did not measure,
    placed by `layout` (default: pinned)."""
    pg = Postgres()
    ws = [
        MsgRate(),
        SockperfPingPong(),
        PingPong(),
        SockperfThroughput(),
        Stream(),
        Iperf3(),
        Nginx("nginx-small", 612, 50, published=(1.34, 1.42)),
        Nginx("nginx-1mib", 1 << 20, 10),
        Redis(redis_requests),
        Memcached(),
        pg,
        Postgres("postgres-32", 32, pg.cluster),
        Setup(),
        SetupLearnt(),
        Idle(idle_conns),
    ]
    for w in ws:
        w.layout = layout or Layout("pinned")
    return ws
