"""The seeds' benchmark suite, side by side over every transport.

Runs the benchmarks of the SMC-D loopback patch series' cover letters
(ipc-bench message rate, sockperf, iperf3, nginx + wrk, redis-benchmark),
plus memcached + memcslap, postgres + pgbench -S, connection setup rate
and the memory of idle connections, over TCP loopback, a UNIX domain
socket, smclo (no-copy and copy) and the kernel's own SMC-D loopback when
the running kernel offers it. Transports alternate within every round;
medians of the rounds are reported with their ratio to TCP, beside the
kernel's published ratios.

Entry point: ``scripts/bench-suite`` (``python3 -m benchsuite --help``).
"""
