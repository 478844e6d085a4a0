"""Where the suite's programs run, and with how many threads.

"pinned" is the seeds' way: the server on one CPU, the client on another
(taskset), each program with one thread or worker, so that runs repeat.
"deployed" is how users run the same programs: no pinning (the
scheduler's placement) and each program's usual thread count, so that
threads may outnumber cores and a transport that spins competes with
the programs it serves.
"""

from .procs import pinned

NAMES = ("pinned", "deployed")


class Layout:
    def __init__(self, name, server_cpu=1, client_cpu=0):
        if name not in NAMES:
            raise ValueError("unknown layout %r; known: %s" % (name, ", ".join(NAMES)))
        self.name = name
        self.server_cpu = server_cpu
        self.client_cpu = client_cpu
        deployed = name == "deployed"
        #: memcached -t (its default is 4)
        self.memcached_threads = 4 if deployed else 1
        #: nginx worker_processes ("auto": one per CPU)
        self.nginx_workers = "auto" if deployed else "1"
        #: wrk -t
        self.wrk_threads = 2 if deployed else 1
        #: redis-benchmark --threads (None: its single-threaded default)
        self.redis_threads = 2 if deployed else None
        #: pgbench -j
        self.pgbench_jobs = 2 if deployed else 1

    @property
    def is_pinned(self):
        return self.name == "pinned"

    def server(self, argv, prefix=()):
        """argv of a server behind `prefix` (e.g. smclo run --), placed."""
        return pinned(self.server_cpu, argv, prefix) if self.is_pinned else [*prefix, *argv]

    def client(self, argv, prefix=()):
        """argv of a client behind `prefix`, placed."""
        return pinned(self.client_cpu, argv, prefix) if self.is_pinned else [*prefix, *argv]

    def config(self):
        """What suite.json records of the layout."""
        return {"layout": self.name, "server_cpu": self.server_cpu if self.is_pinned else None,
                "client_cpu": self.client_cpu if self.is_pinned else None}


#: the programs' usual thread counts, as the deployed layout runs them
DEPLOYED_THREADS = "memcached -t 4, nginx worker_processes auto, wrk -t 2, redis-benchmark --threads 2, pgbench -j 2"


def describe(config):
    """How the runs of a suite.json were placed (older files have only the
    CPUs: those runs were pinned), and what ran beside them."""
    if config.get("layout", "pinned") == "pinned":
        where = "server pinned to CPU %d, client to CPU %d (taskset)" % (config["server_cpu"], config["client_cpu"])
    else:
        where = "as deployed: no pinning (the scheduler's placement), the programs' usual thread counts (%s)" % (
            DEPLOYED_THREADS)
    if config.get("busy_loops"):
        where += "; beside every run, one busy loop per CPU (`sh -c 'while :; do :; done'`, pinned to it)"
    return where
