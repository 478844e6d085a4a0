#!/usr/bin/env bash
# Connections through a ClusterIP-style DNAT (docs/bench/address-translation.md):
# a client namespace and a server namespace on veths to a "node" namespace
# that forwards and translates 10.96.77.10:80 to the server. Measures, in
# ROUNDS rounds (default 7), alternating:
#   - connect latency and whole-connection latency (connect, PING, +PONG,
#     close; crates/apptests/tests/nat/connect_rtt.c, N connections, median)
#     to a plain redis-server: the client plain, under smclo run with no
#     listener on its device (no announcement), and under smclo run with a
#     listener on its device (every connection announced, UNANSWERED);
#   - redis-benchmark GET through the DNAT to a redis-server under smclo
#     run (SMC-D) and to a plain one (both ends plain).
# COUNT=1 counts instead of timing, for the same three clients: system
# calls per connection (strace -f -c) and user-space instructions per
# connection (valgrind --tool=callgrind), each the difference of a run of
# 2*N connections and one of N (default 200), so that start-up cancels out.
# Needs root (ip netns, iptables). Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-7}
N=${N:-1000}
smclo=$PWD/target/release/smclo
tag=natb$$
cli=$tag-cli node=$tag-node srv=$tag-srv
work=$(mktemp -d)
dev=/dev/shm/smclo-$tag dev0=/dev/shm/smclo-$tag-empty
cleanup() {
    for ns in $cli $node $srv; do
        for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$work" "$dev" "$dev0"
}
trap cleanup EXIT
for ns in $cli $node $srv; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip link add "${tag}a" netns "$node" type veth peer name "${tag}b" netns "$srv"
ip link add "${tag}c" netns "$node" type veth peer name "${tag}d" netns "$cli"
ip -n "$node" addr add 10.199.80.1/30 dev "${tag}a"; ip -n "$srv" addr add 10.199.80.2/30 dev "${tag}b"
ip -n "$node" addr add 10.199.81.1/30 dev "${tag}c"; ip -n "$cli" addr add 10.199.81.2/30 dev "${tag}d"
for l in "$node ${tag}a" "$node ${tag}c" "$srv ${tag}b" "$cli ${tag}d"; do set -- $l; ip -n "$1" link set "$2" up; done
ip -n "$cli" route add default via 10.199.81.1
ip -n "$srv" route add default via 10.199.80.1
ip netns exec "$node" sysctl -qw net.ipv4.ip_forward=1
# Tens of thousands of client-closed connections would fill the client's
# ports with TIME_WAIT (connects then take milliseconds, whatever the mode).
ip netns exec "$cli" sysctl -qw net.ipv4.tcp_tw_reuse=1
dnat() { ip netns exec "$node" iptables -t nat -A PREROUTING -p tcp -d "$1" --dport 80 -j DNAT --to-destination "10.199.80.2:$2"; }
dnat 10.96.77.10 6401   # plain redis
dnat 10.96.77.11 6402   # redis under smclo
mkdir -m 700 "$dev" "$dev0"
redis() { ip netns exec "$srv" "$@" redis-server --port "$port" --bind 0.0.0.0 --protected-mode no --save '' --appendonly no >/dev/null 2>&1 & }
port=6401 redis env
port=6402 redis env SMCLO_DEVICE_DIR="$dev" "$smclo" run --
cc -O2 -o "$work/connect_rtt" crates/apptests/tests/nat/connect_rtt.c
sleep 1
inc() { ip netns exec "$cli" "$@"; }
# client MODE PROG...: PROG in the client namespace as the client MODE is
# (tcp, no-listener, announced) runs.
client() {
    local mode=$1; shift
    case $mode in
        tcp) inc "$@" ;;
        no-listener) SMCLO_DEVICE_DIR=$dev0 inc "$smclo" run -- "$@" ;;
        announced) SMCLO_DEVICE_DIR=$dev inc "$smclo" run -- "$@" ;;
    esac
}
if [ -n "${COUNT:-}" ]; then
    N=${N:-200}
    rtt=("$work/connect_rtt" 10.96.77.10 80)
    echo "nat-bench: counts per connection (runs of $((2 * N)) less runs of $N)"
    for mode in tcp no-listener announced; do
        client "$mode" strace -f -c -o "$work/s1" "${rtt[@]}" "$N" >/dev/null
        client "$mode" strace -f -c -o "$work/s2" "${rtt[@]}" "$((2 * N))" >/dev/null
        client "$mode" valgrind --tool=callgrind --callgrind-out-file="$work/c1.%p" "${rtt[@]}" "$N" >/dev/null 2>&1
        client "$mode" valgrind --tool=callgrind --callgrind-out-file="$work/c2.%p" "${rtt[@]}" "$((2 * N))" >/dev/null 2>&1
        python3 - "$mode" "$N" "$work" <<'PY'
import glob, re, sys
mode, n, work = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def calls(path):
    d = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and re.match(r"^[0-9.]+$", f[0]) and f[-1] != "total":
            d[f[-1]] = int(f[3])
    return d
def instructions(prefix):
    # The program's own (its start-up, smclo run's exec, cancels out).
    for p in glob.glob(prefix + ".*"):
        for line in open(p):
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    return 0
a, b = calls(work + "/s1"), calls(work + "/s2")
per = {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b)}
per = {k: v for k, v in per.items() if abs(v) >= 0.01}
ins = (instructions(work + "/c2") - instructions(work + "/c1")) / n
print(f"  {mode:12} {sum(per.values()):5.2f} calls ({', '.join(f'{k} {v:.2f}' for k, v in sorted(per.items()))}); {ins:.0f} instructions:u")
PY
        rm -f "$work"/c1.* "$work"/c2.*
    done
    exit 0
fi
echo "nat-bench: $ROUNDS rounds, $N connections each, $(nproc) cores, kernel $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    echo "  tcp:         $(inc "$work/connect_rtt" 10.96.77.10 80 "$N")"
    echo "  no-listener: $(SMCLO_DEVICE_DIR=$dev0 inc "$smclo" run -- "$work/connect_rtt" 10.96.77.10 80 "$N")"
    echo "  announced:   $(SMCLO_DEVICE_DIR=$dev inc "$smclo" run -- "$work/connect_rtt" 10.96.77.10 80 "$N")"
    b="-h 10.96.77.10 -p 80 -n 100000 -c 50 -t get -q"
    echo "  get-tcp:     $(inc redis-benchmark $b | tr -d '\r' | grep -o '[0-9.]* requests per second')"
    b="-h 10.96.77.11 -p 80 -n 100000 -c 50 -t get -q"
    echo "  get-smcd:    $(SMCLO_DEVICE_DIR=$dev inc "$smclo" run -- redis-benchmark $b | tr -d '\r' | grep -o '[0-9.]* requests per second')"
done
SMCLO_DEVICE_DIR=$dev "$smclo" stats | sed -n '1,40p'
