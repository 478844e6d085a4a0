"""Processes of one measurement: pinned servers and clients, their CPU time."""

import glob
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import time


class BenchError(Exception):
    """A measurement that could not be made; its message says why."""


def free_port():
    """A free TCP port on 127.0.0.1 in 20000..32000.

    Not bind(port 0): the setup-rate workload leaves much of the ephemeral
    range in TIME_WAIT, where the kernel then fails to find a port.
    """
    for _ in range(2000):
        p = random.randrange(20000, 32000)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            continue
        finally:
            s.close()
    raise BenchError("no free port in 20000..32000")


def _listening(port):
    want = ":%04X " % port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    # local_address ends with :PORT; state 0A is LISTEN.
                    if (fields[1] + " ").endswith(want) and fields[3] == "0A":
                        return True
        except FileNotFoundError:
            pass
    return False


def wait_listening(port=None, path=None, proc=None, what="server", timeout=10.0):
    """Waits until something listens on TCP `port` (read from /proc, so that
    no connection is made, which would count as a fallback) or UNIX `path`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port is not None and _listening(port):
            return
        if path is not None and os.path.exists(path):
            return
        if proc is not None and proc.poll() is not None:
            raise BenchError("%s exited with status %s before listening" % (what, proc.returncode))
        time.sleep(0.02)
    raise BenchError("%s does not listen after %.0f s" % (what, timeout))


def _server_stats(sid):
    """(pid, stat fields after the command) of every process of the server
    whose session is `sid`: the session's, and their descendants in other
    sessions (postgres makes every backend a session leader)."""
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command (which may contain spaces): the 4th and
        # 6th fields of the whole line are the parent and the session.
        procs[int(d)] = stat.rsplit(")", 1)[1].split()
    ours = {pid for pid, rest in procs.items() if int(rest[3]) == sid}
    children = {}
    for pid, rest in procs.items():
        children.setdefault(int(rest[1]), []).append(pid)
    todo = list(ours)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in ours:
                ours.add(c)
                todo.append(c)
    return [(pid, procs[pid]) for pid in ours]


def _server_pids(sid):
    return [pid for pid, _ in _server_stats(sid)]


def server_cpu_seconds(sid):
    """CPU time (user + system) of every thread of every process of the
    server whose session is `sid`, from schedstat (nanoseconds, unlike the
    10 ms ticks of stat), plus that of the children they reaped: a process
    that served one connection and exited (a postgres backend) counts only
    there, in its parent's cutime and cstime."""
    total = 0
    reaped_ticks = 0
    for pid, stat in _server_stats(sid):
        # stat fields 16 and 17, counted from the pid as 1.
        reaped_ticks += int(stat[13]) + int(stat[14])
        try:
            tasks = os.listdir("/proc/%d/task" % pid)
        except OSError:
            continue
        for t in tasks:
            try:
                with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9 + reaped_ticks / os.sysconf("SC_CLK_TCK")


def process_rss_kib(pid):
    """VmRSS of process `pid` in KiB; 0 if it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def meminfo_kib(*keys):
    """Values of /proc/meminfo in KiB."""
    vals = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0])
    return [vals.get(k, 0) for k in keys]


def pinned(cpu, argv, prefix=()):
    """argv run on CPU `cpu` (taskset) behind `prefix` (e.g. smclo run --)."""
    return ["taskset", "-c", str(cpu), *prefix, *argv]


def _version_key(bindir):
    """/usr/lib/postgresql/9.6/bin -> (9, 6), for sorting by version."""
    v = os.path.basename(os.path.dirname(bindir))
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def find_program(name):
    """The path of program `name`: on PATH, in /usr/sbin, or among the
    server programs of the newest PostgreSQL (Debian keeps them off PATH,
    in /usr/lib/postgresql/VERSION/bin); None if it is nowhere."""
    pg = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(["/usr/sbin", *pg]))


def as_user(pw):
    """Popen arguments that run a process as the user of password entry
    `pw` (None: as ourselves), with that user's groups and none of ours."""
    if pw is None:
        return {}
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}


class Server:
    """A server in a session of its own (so that all its processes, such as
    nginx's workers, and their descendants that start sessions of their
    own, such as postgres's backends, are found and killed together); as
    the user of
    password entry `user` when given."""

    def __init__(self, argv, env, log_path, stdout=None, user=None, cwd=None):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else self.log,
            stderr=self.log, start_new_session=True, cwd=cwd, **as_user(user))

    def cpu_seconds(self):
        return server_cpu_seconds(self.proc.pid)

    def pids(self):
        return set(_server_pids(self.proc.pid))

    def settle(self, pids, timeout=10.0):
        """Waits until the processes the server started after it had `pids`
        (per-connection ones) have exited and been reaped, so that their
        CPU time is in their parent's."""
        deadline = time.monotonic() + timeout
        while not self.pids() <= pids:
            if time.monotonic() > deadline:
                raise BenchError("server processes %s did not exit within %.0f s of the client"
                                 % (sorted(self.pids() - pids), timeout))
            time.sleep(0.01)

    def rss_kib(self):
        return sum(process_rss_kib(pid) for pid in _server_pids(self.proc.pid))

    def stop(self):
        # Listed first: a descendant in a session of its own is found only
        # through its parent, which dies too.
        strays = self.pids()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def _children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_client(argv, env, timeout):
    """Runs a client to its end; returns (exit status, stdout, stderr, CPU
    seconds, wall seconds).

    CPU time is the growth of RUSAGE_CHILDREN across the run: the client is
    the only child reaped meanwhile (servers are reaped after it), and the
    count includes the client's own children.
    """
    cpu0 = _children_cpu()
    start = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise BenchError("%s did not finish within %.0f s" % (" ".join(argv), timeout))
    except BaseException:
        # Interrupted: the client must not outlive the suite.
        p.kill()
        p.wait()
        raise
    wall = time.monotonic() - start
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), _children_cpu() - cpu0, wall


class BusyLoops:
    """One CPU-bound loop per CPU, each pinned to its CPU, beside every run
    while it lives (--busy-loops): the programs' threads then share every
    core with a thread that never sleeps, as on a host running batch jobs.
    A context manager; the loops are killed on leaving it."""

    def __init__(self):
        self.procs = []

    def __enter__(self):
        try:
            for c in range(os.cpu_count() or 1):
                self.procs.append(subprocess.Popen(["taskset", "-c", str(c), "sh", "-c", "while :; do :; done"],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except OSError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []

