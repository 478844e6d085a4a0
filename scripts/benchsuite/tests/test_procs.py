"""A server's CPU time counts the processes it ran for the clients and
reaped (postgres's backends, which start sessions of their own), once they
are gone."""

import os
import shutil
import signal
import sys
import tempfile
import time
import unittest

from benchsuite.procs import BusyLoops, Server

BURN_S = 0.3
# The burner says it started, then uses BURN_S of CPU, then says it is done.
BURN = """import sys, time
open(sys.argv[1], "w").close()
t = time.process_time()
while time.process_time() - t < %g:
    pass
open(sys.argv[2], "w").close()
""" % BURN_S


class ReapedChildrenTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="benchsuite-test-")
        self.addCleanup(shutil.rmtree, self.dir)
        self.started = os.path.join(self.dir, "started")
        self.done = os.path.join(self.dir, "done")

    def server(self, child):
        """A shell that runs `child` (the burner's argv, after a prefix),
        reaps it, then sleeps."""
        argv = ["sh", "-c", '"$@"; exec sleep 30', "sh", *child, sys.executable, "-c", BURN, self.started, self.done]
        srv = Server(argv, dict(os.environ), os.path.join(self.dir, "log"))
        self.addCleanup(srv.stop)
        return srv

    def wait_for(self, path):
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            self.assertLess(time.monotonic(), deadline, "the burner did not write %s" % path)
            time.sleep(0.01)

    def check_counted(self, srv):
        # The shell alone, as before it forked.
        srv.settle({srv.proc.pid})
        self.assertEqual(srv.pids(), {srv.proc.pid})
        # The 10 ms ticks of cutime, and the sleeping shell's own time.
        self.assertGreaterEqual(srv.cpu_seconds(), BURN_S - 0.02)

    def test_cpu_of_an_exited_child_is_counted(self):
        srv = self.server([])
        self.wait_for(self.done)
        self.check_counted(srv)

    def test_a_child_in_a_session_of_its_own_is_waited_for(self):
        srv = self.server(["setsid"])
        self.wait_for(self.started)
        # Seen while it runs, though it left the server's session.
        if not os.path.exists(self.done):
            self.assertEqual(len(srv.pids()), 2)
        self.check_counted(srv)

    def test_stop_kills_a_child_in_a_session_of_its_own(self):
        srv = Server(["sh", "-c", 'setsid sleep 30 & echo $! > "$0.new" && mv "$0.new" "$0"; wait', os.path.join(self.dir, "pid")],
                     dict(os.environ), os.path.join(self.dir, "log"))
        self.wait_for(os.path.join(self.dir, "pid"))
        with open(os.path.join(self.dir, "pid")) as f:
            child = int(f.read())
        self.addCleanup(kill, child)
        srv.stop()
        deadline = time.monotonic() + 5
        while alive(child):
            self.assertLess(time.monotonic(), deadline, "the child outlived the server")
            time.sleep(0.01)


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid):
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False



class BusyLoopsTest(unittest.TestCase):
    def test_one_loop_per_cpu_pinned_and_burning_then_gone(self):
        with BusyLoops() as b:
            pids = [p.pid for p in b.procs]
            self.assertEqual(len(pids), os.cpu_count())
            time.sleep(0.3)
            for cpu, pid in enumerate(pids):
                with open("/proc/%d/status" % pid) as f:
                    allowed = [l.split()[1] for l in f if l.startswith("Cpus_allowed_list")]
                self.assertEqual(allowed, [str(cpu)], "loop %d is not pinned to CPU %d" % (pid, cpu))
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                # utime + stime (fields 14 and 15 of stat, 12 and 13 after the name)
                self.assertGreater(int(fields[11]) + int(fields[12]), 0, "loop %d does not burn" % pid)
        for pid in pids:
            self.assertFalse(os.path.exists("/proc/%d" % pid), "loop %d outlived the suite" % pid)

if __name__ == "__main__":
    unittest.main()
