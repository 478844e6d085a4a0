"""A throwaway PostgreSQL cluster for the postgres workload.

Made once per suite (initdb, then ``pgbench -i -s 1`` against a plain
server), started for every measurement under that transport's prefix,
and removed with its device directories at the end. PostgreSQL refuses
to run as root: a suite run by root runs the server as the user
``postgres`` (else ``nobody``), and its smclo runs use group devices of
that user's group (``smclo dev init --group``) that root, the client's
user, owns; a suite run by another user runs everything as that user.
"""

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

from .procs import BenchError, Server, as_user, find_program, free_port
from .transports import Transport, init_device

#: the cluster's superuser, whom pgbench connects as (trust authentication).
ROLE = "postgres"
#: the database pgbench -i fills and pgbench -S reads (initdb makes it).
DATABASE = "postgres"
#: a throwaway benchmark server: nothing is made durable, no background
#: vacuum runs into a measurement, and the pgbench -s 1 tables (16 MB) fit
#: the small shared buffers; TCP only on 127.0.0.1.
SETTINGS = ("listen_addresses=127.0.0.1", "fsync=off", "synchronous_commit=off", "full_page_writes=off",
            "autovacuum=off", "shared_buffers=32MB", "max_connections=40")
#: what postmaster.pid says (8th line) once connections are accepted.
READY = "ready"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
INIT_TIMEOUT = 300.0


def server_user():
    """The password entry of the user the server runs as; None: ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    raise BenchError("postgres refuses to run as root, and there is neither a user postgres nor nobody to run it")


def program(name):
    """`name` from the directory of the server found, through symlinks
    (the pgbench on Debian's PATH is a wrapper that picks a version), else
    from PATH."""
    server = find_program("postgres")
    here = os.path.join(os.path.dirname(os.path.realpath(server)), name) if server else None
    return here if here and os.access(here, os.X_OK) else find_program(name)


class PgServer(Server):
    """A postmaster; stopped with a fast shutdown (SIGINT), so that the
    next start needs no crash recovery, and killed only if that fails."""

    def __init__(self, argv, env, log_path, user, data):
        Server.__init__(self, argv, env, log_path, user=user, cwd=data)
        self.data = data

    def _pidfile(self):
        """postmaster.pid's lines once our postmaster wrote it, else None
        (a stale file of a killed one names a pid not in our session)."""
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        return lines if lines and lines[0].strip().isdigit() and int(lines[0]) in self.pids() else None

    def wait_ready(self, what):
        """Waits until the postmaster accepts connections: reads its pid
        file, since a connection to ask would be one more (uncounted) in
        the device's counters."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            lines = self._pidfile()
            if lines and len(lines) >= 8 and lines[7].strip() == READY:
                return
            if self.proc.poll() is not None:
                raise BenchError("%s exited with status %s before it was ready" % (what, self.proc.returncode))
            time.sleep(0.02)
        raise BenchError("%s is not ready after %.0f s" % (what, START_TIMEOUT))

    def stop(self):
        lines = self._pidfile()
        if lines:
            os.kill(int(lines[0]), signal.SIGINT)
            deadline = time.monotonic() + STOP_TIMEOUT
            while self._pidfile() and time.monotonic() < deadline:
                time.sleep(0.02)
        Server.stop(self)


class Cluster:
    """The data directory, its server's user and the device directories
    made for that user (`devices`: directory -> made); `close` removes
    them all."""

    def __init__(self):
        self.dir = None
        self.user = None
        self.devices = {}
        self.failure = None

    @property
    def data(self):
        return os.path.join(self.dir, "data")

    def prepare(self, ctx):
        """Once: initdb and pgbench -i, on a plain server. A failure is kept
        and raised again by every later call."""
        if self.failure:
            raise BenchError(self.failure)
        if self.dir:
            return
        try:
            self.user = server_user()
            self.dir = tempfile.mkdtemp(prefix="smclo-suite-pg-")
            if self.user:
                os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
            self._init(ctx, Transport("init", "pgbench -i", "tcp"))
        except (BenchError, OSError, subprocess.SubprocessError) as e:
            self.failure = "the cluster could not be made: %s" % e
            raise BenchError(self.failure)

    def _init(self, ctx, plain):
        log = os.path.join(ctx.work, "postgres-initdb.log")
        with open(log, "wb") as f:
            r = subprocess.run([program("initdb"), "-D", self.data, "-A", "trust", "-U", ROLE, "-N", "--locale=C"],
                               env=plain.env(), stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=self.dir,
                               timeout=INIT_TIMEOUT, **as_user(self.user))
        if r.returncode != 0:
            raise BenchError("initdb exited with status %d (see %s)" % (r.returncode, log))
        srv, port = self.start(ctx, plain)
        try:
            r = subprocess.run([program("pgbench"), "-i", "-s", "1", "-q", "-h", self.dir, "-p", str(port), "-U", ROLE,
                                DATABASE], env=plain.env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=INIT_TIMEOUT)
        finally:
            srv.stop()
        if r.returncode != 0:
            raise BenchError("pgbench -i exited with status %d: %s" % (r.returncode, r.stderr.strip()[-400:]))

    def transport(self, ctx, t):
        """`t`, or for a server of another user `t` on a group device of
        that user's group with the same settings."""
        if not self.user or not t.device_dir:
            return t
        d = t.device_dir + "-postgres"
        if not self.devices.get(d):
            # Known before it is made, so that close() removes a half-made one.
            self.devices[d] = False
            init_device(t.smclo, d, t.device_settings, group=self.user.pw_gid)
            self.devices[d] = True
        return t.on_device(d)

    def start(self, ctx, t):
        """The server over transport `t`, placed by the suite's layout, once it
        accepts connections; returns (server, port)."""
        port = free_port()
        argv = [program("postgres"), "-D", self.data, "-p", str(port), "-k", self.dir]
        for s in SETTINGS:
            argv += ["-c", s]
        srv = PgServer(ctx.layout.server(argv, t.prefix), t.env(), ctx.log("postgres", t), self.user, self.data)
        try:
            srv.wait_ready("postgres (see %s)" % ctx.log("postgres", t))
        except BenchError:
            srv.stop()
            raise
        return srv, port

    def close(self):
        """Removes the cluster and the device directories; a server that
        had to be killed leaves its System V segment, removed here too."""
        if self.dir:
            _remove_shm_of(os.path.join(self.data, "postmaster.pid"))
            shutil.rmtree(self.dir, ignore_errors=True)
        for d in self.devices:
            shutil.rmtree(d, ignore_errors=True)
        self.dir, self.devices = None, {}


def _remove_shm_of(pidfile):
    """postmaster.pid's 7th line is "KEY ID" of the server's System V
    shared memory segment; after a clean shutdown there is no file."""
    try:
        with open(pidfile) as f:
            lines = f.read().splitlines()
        shm_id = lines[6].split()[1]
    except (OSError, IndexError):
        return
    subprocess.run(["ipcrm", "-m", shm_id], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
