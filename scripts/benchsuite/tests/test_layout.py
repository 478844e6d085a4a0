"""The two layouts: pinned runs every program under taskset with one
thread or worker; deployed runs them unpinned with their usual thread
counts; the tables say which."""

import types
import unittest

from benchsuite import report
from benchsuite.layout import Layout
from benchsuite.workloads import all_workloads

PREFIX = ["smclo", "run", "--"]


def workload(name, layout):
    return next(w for w in all_workloads(layout=layout) if w.name == name)


class PlacementTest(unittest.TestCase):
    def test_pinned_runs_under_taskset_on_two_cpus(self):
        lay = Layout("pinned", server_cpu=1, client_cpu=0)
        self.assertEqual(lay.server(["srv"], PREFIX), ["taskset", "-c", "1", *PREFIX, "srv"])
        self.assertEqual(lay.client(["cli"], PREFIX), ["taskset", "-c", "0", *PREFIX, "cli"])

    def test_deployed_is_not_pinned(self):
        lay = Layout("deployed")
        self.assertEqual(lay.server(["srv"], PREFIX), [*PREFIX, "srv"])
        self.assertEqual(lay.client(["cli"], PREFIX), [*PREFIX, "cli"])

    def test_unknown_layout_is_refused(self):
        with self.assertRaises(ValueError):
            Layout("spread")


class ThreadCountTest(unittest.TestCase):
    ctx = types.SimpleNamespace(work="/nonexistent", seconds=2)
    tcp = types.SimpleNamespace(name="tcp")

    def argv(self, name, layout):
        return workload(name, Layout(layout)).client(self.ctx, self.tcp, 7000)

    def test_clients_take_the_layouts_thread_counts(self):
        self.assertEqual(self.argv("nginx-small", "pinned")[:3], ["wrk", "-t", "1"])
        self.assertEqual(self.argv("nginx-small", "deployed")[:3], ["wrk", "-t", "2"])
        self.assertNotIn("--threads", self.argv("redis", "pinned"))
        self.assertEqual(self.argv("redis", "deployed")[-2:], ["--threads", "2"])
        pg = self.argv("postgres", "deployed")
        self.assertEqual(pg[pg.index("-j") + 1], "2")
        pg32 = self.argv("postgres-32", "pinned")
        self.assertEqual((pg32[pg32.index("-c") + 1], pg32[pg32.index("-j") + 1]), ("32", "1"))

    def test_threaded_redis_runs_are_long_against_its_quarter_second_timer(self):
        def n(layout, seconds, asked=None):
            w = workload("redis", Layout(layout))
            w.asked = asked
            argv = w.client(types.SimpleNamespace(work="/nonexistent", seconds=seconds), self.tcp, 7000)
            return int(argv[argv.index("-n") + 1])
        # 100000 requests at 400000/s end after one quarter second or two:
        # the rate read about 400k or 200k, nothing between.
        self.assertGreaterEqual(n("deployed", 2) / 400000, 5.0)
        self.assertGreaterEqual(n("deployed", 10) / 400000, 10.0)
        self.assertEqual(n("pinned", 2), 100000)
        self.assertEqual(n("deployed", 2, asked=2000), 2000)
        # The client may take as long as both tests at 10000 requests/s.
        w = workload("redis", Layout("deployed"))
        self.assertGreaterEqual(w.client_timeout(self.ctx), 2 * n("deployed", 2) / 10000)

    def test_a_request_count_below_one_is_refused(self):
        from benchsuite.__main__ import parse_args
        with self.assertRaises(SystemExit):
            parse_args(["--redis-requests", "0"])

    def test_memcslap_tests_last_the_runs_length_at_the_fastest_rate(self):
        for layout in ("pinned", "deployed"):
            w = workload("memcached", Layout(layout))
            argv = w.client(self.ctx, self.tcp, 7000)
            per_conn = int(argv[-1].split("--execute-number=")[1].split()[0])
            self.assertGreaterEqual(per_conn * w.conns / 200000, self.ctx.seconds)

    def test_memcached_runs_its_default_four_threads_as_deployed(self):
        srv = workload("memcached", Layout("deployed")).server(self.ctx, self.tcp, 7000)
        self.assertEqual(srv[srv.index("-t") + 1], "4")
        srv = workload("memcached", Layout("pinned")).server(self.ctx, self.tcp, 7000)
        self.assertEqual(srv[srv.index("-t") + 1], "1")

    def test_row_labels_say_the_thread_counts(self):
        labels = [r.label for w in all_workloads(layout=Layout("deployed")) for r in w.rows()]
        self.assertIn("redis-benchmark --threads 2 -d 1024 -c 50 -t get: GET", labels)
        self.assertIn("memcached -t 4 + memcslap -c 16 --binary: set", labels)
        self.assertTrue(any(lab.startswith("nginx (worker_processes auto) + wrk -t 2") for lab in labels))
        keys = [r.key for w in all_workloads() for r in w.rows()]
        self.assertEqual(len(keys), len(set(keys)), "row keys must be unique")


class TableHeaderTest(unittest.TestCase):
    def test_the_table_says_how_runs_were_placed(self):
        self.assertIn("server pinned to CPU 1, client to CPU 0",
                      report.layout.describe({"server_cpu": 1, "client_cpu": 0}))
        said = report.layout.describe(Layout("deployed").config())
        self.assertIn("no pinning", said)
        self.assertIn("pgbench -j 2", said)
        self.assertNotIn("busy loop", said)

    def test_the_table_says_busy_loops_ran_beside(self):
        said = report.layout.describe({**Layout("deployed").config(), "busy_loops": True})
        self.assertIn("no pinning", said)
        self.assertIn("one busy loop per CPU", said)


class BaselineTransportTest(unittest.TestCase):
    def test_the_baseline_runs_only_when_asked(self):
        from benchsuite.__main__ import transports_of
        w = workload("redis", Layout("pinned"))
        everything = {"tcp", "unix", "smclo", "smclo-copy", "kernel-smc"}
        self.assertEqual(transports_of(w, everything), list(w.transports))
        self.assertEqual(transports_of(w, everything | {"smclo-base"})[-1], "smclo-base")
        # --transports: only those the run has.
        self.assertEqual(transports_of(w, {"tcp", "smclo", "smclo-base"}), ["tcp", "smclo", "smclo-base"])


if __name__ == "__main__":
    unittest.main()
