"""A server's CPU time counts the processes it ran for the clients and
reaped (postgres's backends), once they are gone."""

import os
import shutil
import sys
import tempfile
import time
import unittest

from benchsuite.procs import Server

BURN_S = 0.3


class ReapedChildrenTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="benchsuite-test-")
        self.addCleanup(shutil.rmtree, self.dir)

    def test_cpu_of_an_exited_child_is_counted(self):
        done = os.path.join(self.dir, "done")
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < %g: pass\n" % BURN_S
        # The shell forks the burner, waits for it (reaps it), then sleeps.
        argv = ["sh", "-c", '"$0" -c "$1" && touch "$2" && exec sleep 30', sys.executable, burn, done]
        srv = Server(argv, dict(os.environ), os.path.join(self.dir, "log"))
        self.addCleanup(srv.stop)
        deadline = time.monotonic() + 20
        while not os.path.exists(done):
            self.assertLess(time.monotonic(), deadline, "the burner did not finish")
            time.sleep(0.01)
        # The shell alone, as before it forked.
        srv.settle({srv.proc.pid})
        self.assertEqual(srv.pids(), {srv.proc.pid})
        # The 10 ms ticks of cutime, and the sleeping shell's own time.
        self.assertGreaterEqual(srv.cpu_seconds(), BURN_S - 0.02)


if __name__ == "__main__":
    unittest.main()
