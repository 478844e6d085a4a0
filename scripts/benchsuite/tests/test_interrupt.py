"""An interrupted suite leaves nothing behind: the client it was running
is killed, and SIGTERM runs the cleanup (servers, directories, devices)."""

import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from benchsuite.__main__ import ROOT
from benchsuite.procs import run_client


class Interrupted(Exception):
    pass


def alive(pid):
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class InterruptTest(unittest.TestCase):
    def test_an_interrupted_client_is_killed(self):
        def interrupt(*_):
            raise Interrupted()

        old = signal.signal(signal.SIGALRM, interrupt)
        self.addCleanup(signal.signal, signal.SIGALRM, old)
        self.addCleanup(signal.setitimer, signal.ITIMER_REAL, 0)
        marker = "benchsuite-test-client-%d" % os.getpid()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with self.assertRaises(Interrupted):
            run_client([sys.executable, "-c", "import time; time.sleep(30)", marker], dict(os.environ), timeout=60)
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        for pid in left:
            os.kill(int(pid), signal.SIGKILL)
        self.assertEqual(left, [], "the client outlived the interruption")

    def test_sigterm_removes_the_devices(self):
        smclo = os.path.join(ROOT, "target", "release", "smclo")
        self.assertTrue(os.access(smclo, os.X_OK), "build first: cargo build --release -p smclo-cli")
        out = tempfile.mkdtemp(prefix="benchsuite-test-")
        self.addCleanup(subprocess.run, ["rm", "-rf", out])
        # The script execs the Python that has matplotlib.
        p = subprocess.Popen([os.path.join(ROOT, "scripts", "bench-suite"), "--only", "msgrate", "--rounds", "50",
                              "--seconds", "1", "--out", out, "--smclo", smclo],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        device = "/dev/shm/smclo-suite-%d" % p.pid
        # Should the test fail, after the suite is killed.
        self.addCleanup(subprocess.run, ["rm", "-rf", device, device + "-copy"])
        self.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        deadline = time.monotonic() + 30
        # Until it measures (its devices exist and it runs a client).
        while not (os.path.isdir(device + "-copy") and subprocess.run(
                ["pgrep", "-P", str(p.pid)], capture_output=True).returncode == 0):
            self.assertLess(time.monotonic(), deadline, "the suite did not start")
            self.assertIsNone(p.poll(), "the suite exited")
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(timeout=30), 128 + signal.SIGTERM)
        self.assertFalse(os.path.exists(device) or os.path.exists(device + "-copy"),
                         "the suite's devices are left behind")


if __name__ == "__main__":
    unittest.main()
