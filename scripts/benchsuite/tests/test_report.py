"""Medians, ratios, verdicts against the kernel's published figures, the
markdown cells, the device-counter proof and the chart."""

import os
import tempfile
import unittest

from benchsuite import chart, report
from benchsuite.procs import BenchError
from benchsuite.transports import DeviceCounters


def doc(runs, published=(1.35, 1.40), higher_better=True):
    ts = [{"name": "tcp", "label": "TCP", "available": True, "why_unavailable": None, "prefix": []},
          {"name": "unix", "label": "UNIX", "available": True, "why_unavailable": None, "prefix": []},
          {"name": "smclo", "label": "smclo", "available": True, "why_unavailable": None, "prefix": ["smclo", "run", "--"]},
          {"name": "kernel-smc", "label": "kernel SMC-D lo", "available": False,
           "why_unavailable": "no AF_SMC here", "prefix": []}]
    return {
        "date": "2026-01-01", "machine": {"cpu": "cpu", "cores": 2, "kernel": "6.1"},
        "config": {"rounds": 3, "seconds": 1, "server_cpu": 1, "client_cpu": 0},
        "transports": ts,
        "workloads": [{"name": "w", "transports": ["tcp", "smclo", "kernel-smc"], "third_party": True,
                       "cpu_unit": "µs per request",
                       "rows": [{"key": "r", "label": "a row", "unit": "req/s", "field": "value",
                                 "higher_better": higher_better, "published": published}]}],
        "runs": runs,
    }


def run(t, v, rnd, cpu=(1.0, 1.0), per_op=None):
    return {"round": rnd, "workload": "w", "transport": t, "values": {"r": v},
            "cpu_s": {"client": cpu[0], "server": cpu[1]}, "wall_s": 2.0, "cpu_per_op": per_op}


class SummaryTest(unittest.TestCase):
    def test_median_and_ratio(self):
        d = report.summarize(doc([run("tcp", 100, 1), run("tcp", 300, 2), run("tcp", 200, 3),
                                  run("smclo", 150, 1), run("smclo", 900, 2), run("smclo", 300, 3)]))
        cells = d["summary"]["rows"]["r"]
        self.assertEqual(cells["tcp"]["median"], 200)
        self.assertEqual(cells["smclo"]["median"], 300)
        self.assertEqual(cells["smclo"]["vs_tcp"], 1.5)
        self.assertEqual(cells["smclo"]["round_ratios"], [1.5, 3.0, 1.5])
        self.assertEqual(cells["smclo"]["median_round_ratio"], 1.5)
        self.assertEqual(report.verdict(d["workloads"][0]["rows"][0], 1.5), "**ahead** (1.50× vs 1.35–1.40×)")

    def test_failed_runs_left_out_and_listed(self):
        d = report.summarize(doc([run("tcp", 100, 1), run("smclo", 120, 1),
                                  {"round": 2, "workload": "w", "transport": "smclo", "error": "not accelerated: x"}]))
        self.assertEqual(d["summary"]["rows"]["r"]["smclo"]["median"], 120)
        md = report.markdown(d)
        self.assertIn("120.0 (+20%) ¹", md)
        self.assertIn("w/smclo round 2: not accelerated: x", md)
        self.assertIn("**behind** (1.20× vs 1.35–1.40×)", md)

    def test_cells(self):
        md = report.markdown(report.summarize(doc([run("tcp", 100, 1), run("smclo", 139, 1)])))
        row = [l for l in md.splitlines() if l.startswith("| a row")][0].split(" | ")
        # tcp, unix (tool cannot), smclo, kernel (unavailable), published, verdict
        self.assertEqual(row[2:7], ["100.0", "—", "139.0 (+39%)", "unavailable", "1.35–1.40×"])
        self.assertIn("within (1.39×", row[7])
        self.assertIn("kernel SMC-D lo unavailable: no AF_SMC here.", md)

    def test_unavailable_for_own_programs_too(self):
        # smclo's own programs open AF_SMC themselves: no smc_run needed, but
        # a kernel without SMC still makes the cell unavailable.
        d = doc([run("tcp", 100, 1), run("smclo", 139, 1)])
        d["workloads"][0]["third_party"] = False
        self.assertFalse(report.usable(d["workloads"][0], d["transports"][3]))
        d["transports"][3].update(available=True, why_unavailable=None)
        self.assertTrue(report.usable(d["workloads"][0], d["transports"][3]))

    def test_smclo_settings_named(self):
        d = doc([run("tcp", 100, 1), run("smclo", 139, 1)])
        self.assertIn("smclo settings: defaults", report.markdown(report.summarize(d)))
        d["config"]["smclo_env"] = {"SMCLO_RMEM": "1m"}
        self.assertIn("smclo settings: `SMCLO_RMEM=1m`.", report.markdown(d))

    def test_kernel_without_smc_run(self):
        d = doc([run("tcp", 100, 1), run("smclo", 139, 1)])
        d["transports"][3].update(available=True, why_unavailable=None)
        md = report.markdown(report.summarize(d))
        row = [l for l in md.splitlines() if l.startswith("| a row")][0].split(" | ")
        self.assertEqual(row[5], "unavailable")
        self.assertIn("third-party programs need smc-tools' smc_run", md)

    def test_lower_is_better(self):
        d = doc([run("tcp", 10.0, 1), run("smclo", 6.0, 1)], published=(0.56, 0.56), higher_better=False)
        d = report.summarize(d)
        row = d["workloads"][0]["rows"][0]
        self.assertIn("-40%", report.markdown(d))
        self.assertTrue(report.verdict(row, 0.6).startswith("**behind**"))
        self.assertTrue(report.verdict(row, 0.5).startswith("**ahead**"))
        self.assertEqual(report.verdict(row, 0.5649), "level (0.56× vs 0.56×)")

    def test_cpu_table(self):
        d = report.summarize(doc([run("tcp", 100, 1, (1.0, 1.0), 20.0), run("smclo", 200, 1, (2.0, 1.6), 18.0)]))
        self.assertEqual(d["summary"]["cpu"]["w"]["smclo"]["cores"], 1.8)
        self.assertIn("18.00 (-10%), 1.80 cores", report.markdown(d))


class ProofTest(unittest.TestCase):
    before = {"conns_opened": 5, "xfer_bytes": 1000, "fallbacks": {}}

    def test_accelerated(self):
        p = DeviceCounters.proof(self.before, {"conns_opened": 6, "xfer_bytes": 5000, "fallbacks": {}})
        self.assertEqual(p, {"conns_opened": 1, "xfer_bytes": 4000, "fallbacks": {}})

    def test_fallback_or_nothing_refused(self):
        with self.assertRaisesRegex(BenchError, "PEERNOSMC"):
            DeviceCounters.proof(self.before, {"conns_opened": 6, "xfer_bytes": 5000, "fallbacks": {"PEERNOSMC": 1}})
        with self.assertRaisesRegex(BenchError, "0 new connections"):
            DeviceCounters.proof(self.before, {"conns_opened": 5, "xfer_bytes": 5000, "fallbacks": {}})
        with self.assertRaisesRegex(BenchError, "wanted 1000"):
            DeviceCounters.proof(self.before, {"conns_opened": 50, "xfer_bytes": 5000, "fallbacks": {}}, 1000)


class BaselineTest(unittest.TestCase):
    def doc(self):
        d = doc([run("tcp", 100, 1), run("smclo", 300, 1, per_op=2.0), run("smclo-base", 200, 1, per_op=4.0),
                 run("tcp", 100, 2), run("smclo", 330, 2, per_op=2.0), run("smclo-base", 300, 2, per_op=4.0)])
        d["transports"].append({"name": "smclo-base", "label": "smclo baseline", "available": True,
                                "why_unavailable": None, "prefix": ["old/smclo", "run", "--"]})
        d["workloads"][0]["transports"].append("smclo-base")
        d["config"]["baseline"] = "old/smclo"
        return report.summarize(d)

    def test_this_build_against_the_baseline(self):
        md = report.markdown(self.doc())
        self.assertIn("against the baseline build (old/smclo)", md)
        # medians 315 vs 250; round ratios 1.5 and 1.1; CPU 2.0 vs 4.0
        self.assertIn("| a row | req/s | 250.0 | 315.0 | 1.260× | 1.300× | 0.500× |", md)

    def test_no_baseline_no_table(self):
        d = report.summarize(doc([run("tcp", 100, 1), run("smclo", 150, 1)]))
        self.assertNotIn("baseline", report.markdown(d))


class ChartTest(unittest.TestCase):
    def test_png(self):
        d = report.summarize(doc([run("tcp", 100, 1), run("smclo", 150, 1)]))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.png")
            chart.draw(d, path)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_png_and_table_of_a_deployed_run(self):
        d = doc([run("tcp", 100, 1), run("smclo", 150, 1)])
        d["config"].update(layout="deployed", server_cpu=None, client_cpu=None)
        d = report.summarize(d)
        self.assertIn("no pinning", report.markdown(d))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.png")
            chart.draw(d, path)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
    unittest.main()
