"""The parsers read the numbers the tools print, and refuse output that
lacks them (a changed or failed tool must not be read as a result)."""

import os
import unittest

from benchsuite import parse

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def fixture(name):
    with open(os.path.join(FIX, name)) as f:
        return f.read()


class SockperfTest(unittest.TestCase):
    def test_ping_pong(self):
        p = parse.sockperf_pp(fixture("sockperf-pp.txt"))
        self.assertEqual(p["value"], 41.646)
        self.assertEqual((p["p50"], p["p99"], p["p999"]), (41.621, 57.319, 68.280))
        self.assertEqual(p["ops"], 6601)
        self.assertEqual(p["cpu_ops"], 15103)

    def test_ping_pong_that_failed_midway(self):
        text = fixture("sockperf-pp.txt").split("========= Printing statistics")[0]
        text += "sockperf: ERROR: _seqN > m_maxSequenceNo (errno=11 Resource temporarily unavailable)\n"
        with self.assertRaisesRegex(ValueError, "avg-latency.*_seqN"):
            parse.sockperf_pp(text)

    def test_throughput(self):
        p = parse.sockperf_tp(fixture("sockperf-tp.txt"))
        self.assertEqual(p["value"], 3049.744)
        self.assertEqual(p["ops"], 49992)


class Iperf3Test(unittest.TestCase):
    def test_received_rate(self):
        p = parse.iperf3(fixture("iperf3.json"))
        self.assertGreater(p["value"], 1.0)
        self.assertGreater(p["ops"], 1e8)

    def test_error(self):
        with self.assertRaisesRegex(ValueError, "unable to connect"):
            parse.iperf3('{"start": {}, "error": "unable to connect to server: Connection refused"}')
        with self.assertRaisesRegex(ValueError, "not JSON"):
            parse.iperf3("iperf3: error - unable to connect")


class WrkTest(unittest.TestCase):
    def test_rate(self):
        p = parse.wrk(fixture("wrk.txt"))
        self.assertEqual(p, {"value": 1337.27, "ops": 1339})

    def test_errors_are_not_results(self):
        text = fixture("wrk.txt").replace("Requests/sec", "  Socket errors: connect 0, read 3, write 0, timeout 0\nRequests/sec")
        with self.assertRaisesRegex(ValueError, "read 3"):
            parse.wrk(text)
        with self.assertRaisesRegex(ValueError, "Non-2xx"):
            parse.wrk(fixture("wrk.txt") + "  Non-2xx or 3xx responses: 12\n")


class RedisTest(unittest.TestCase):
    def test_final_lines_not_progress(self):
        # The progress line (rps=0.0) comes first, behind a carriage return.
        self.assertEqual(parse.redis_benchmark(fixture("redis-benchmark.txt")), {"SET": 44444.44, "GET": 51282.05})

    def test_missing_test(self):
        with self.assertRaisesRegex(ValueError, "GET"):
            parse.redis_benchmark("SET: 100.00 requests per second, p50=0.1 msec\n")


class MemcslapTest(unittest.TestCase):
    def test_set_and_get(self):
        r = parse.memcslap(fixture("memcslap.txt"))
        self.assertAlmostEqual(r["SET"], 800 / 0.094)
        self.assertAlmostEqual(r["GET"], 800 / 0.041)

    def test_missing_get(self):
        with self.assertRaisesRegex(ValueError, "get result"):
            parse.memcslap("Time to set             800 keys by    4 threads:     0.094 seconds.\n")

    def test_preload_is_not_a_result(self):
        with self.assertRaisesRegex(ValueError, "get result"):
            parse.memcslap("Time to set 800 keys by 4 threads: 0.1 seconds.\nTime to set 200 keys: 0.046 seconds.\n")


class PgbenchTest(unittest.TestCase):
    def test_rate_without_connection_setup(self):
        self.assertEqual(parse.pgbench(fixture("pgbench.txt")), {"value": 10370.339775, "ops": 20086})

    def test_before_postgresql_14(self):
        text = ("number of transactions actually processed: 500\n"
                "tps = 240.5 (including connections establishing)\ntps = 250.25 (excluding connections establishing)\n")
        self.assertEqual(parse.pgbench(text), {"value": 250.25, "ops": 500})

    def test_failed_transactions_fail(self):
        text = fixture("pgbench.txt").replace("failed transactions: 0 (0.000%)", "failed transactions: 7 (0.035%)")
        with self.assertRaisesRegex(ValueError, "7 failed"):
            parse.pgbench(text)

    def test_aborted_run(self):
        text = fixture("pgbench.txt").split("latency average")[0] + "pgbench: error: Run was aborted; the above results are incomplete.\n"
        with self.assertRaisesRegex(ValueError, "tps.*aborted"):
            parse.pgbench(text)


class OwnClientTest(unittest.TestCase):
    def test_metric_and_extras(self):
        self.assertEqual(parse.own_client("12.5\nops 100\nrtt_p99_us 3.25\n"), {"value": 12.5, "ops": 100, "rtt_p99_us": 3.25})

    def test_empty(self):
        with self.assertRaises(ValueError):
            parse.own_client("")


if __name__ == "__main__":
    unittest.main()
