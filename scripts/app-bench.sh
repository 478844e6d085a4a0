#!/usr/bin/env bash
# app-bench.sh: unmodified programs under `smclo run` vs plain TCP, side by
# side in one run. Not a test: it prints a markdown table.
#
# Every measurement is a client/server pair, the server pinned to CPU $SRV_CPU
# and the client to CPU $CLI_CPU (taskset -c; default server on CPU 1, client
# on CPU 0). In each round the variants run back to back (interleaved), so
# drift hits all of them alike (which variant goes first alternates); the table
# shows the median of $ROUNDS rounds (default 3) for each side, their ratio,
# and the median of the per-round ratios (robust against a noisy machine). The seeds' kernel workloads, scaled
# to a 2-core machine (seeds: redis-benchmark -n 400000 -c 200, wrk -t 8 -c 500
# -d 30):
#
#   redis:  taskset -c 1 [smclo run --] redis-server <conf: port, no persistence>
#           taskset -c 0 [smclo run --] redis-benchmark -h 127.0.0.1 -p PORT -q -t set,get -n $REDIS_N -c 50 -d 1024
#   nginx:  taskset -c 1 [smclo run --] nginx <conf: 1 worker, sendfile on, keepalive, 612-byte index.html>
#           taskset -c 0 [smclo run --] wrk -t 1 -c 50 -d ${SECS}s http://127.0.0.1:PORT/index.html
#   cost for plain peers (server always plain, only the client changes):
#     connection rate: taskset -c 1 nginx (plain), taskset -c 0 [smclo run --] wrk -t 1 -c 10 -d ${SECS}s -H 'Connection: close' URL
#     throughput:      taskset -c 1 iperf3 -s (plain), taskset -c 0 [smclo run --] iperf3 -c 127.0.0.1 -t $SECS --json
#     and the client's CPU time (getrusage) per connection and per GB sent in
#     those two runs, which load from other processes on the machine moves
#     much less than rates do.
#
# Environment: ROUNDS (3), SECS (5), REDIS_N (100000), SRV_CPU (1), CLI_CPU (0),
# SMCLO (path of the smclo binary; default target/release/smclo).
# Needs: redis-server redis-tools nginx-light wrk iperf3 python3 util-linux.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
REDIS_N=${REDIS_N:-100000}
SRV_CPU=${SRV_CPU:-1}
CLI_CPU=${CLI_CPU:-0}
SMCLO=${SMCLO:-$PWD/${CARGO_TARGET_DIR:-target}/release/smclo}
[ -x "$SMCLO" ] || { echo "app-bench: $SMCLO missing; run cargo build --release --workspace" >&2; exit 1; }
for p in redis-server redis-benchmark redis-cli nginx wrk iperf3 taskset python3; do
    command -v "$p" >/dev/null || [ -x "/usr/sbin/$p" ] || { echo "app-bench: $p is not installed" >&2; exit 1; }
done
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

WORK=$(mktemp -d /tmp/smclo-app-bench.XXXXXX)
export SMCLO_DEVICE_DIR=/dev/shm/smclo-app-bench-$$
unset LD_PRELOAD SMCLO_DEBUG
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
    rm -rf "$WORK" "$SMCLO_DEVICE_DIR"
}
trap cleanup EXIT

# A free port below the ephemeral range, found without bind(port 0), which
# fails once the connection-rate run leaves the ephemeral range in TIME_WAIT.
free_port() {
    python3 -c '
import random, socket
for _ in range(2000):
    p = random.randrange(20000, 32000)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", p)); s.listen(1); print(p); break
    except OSError:
        pass
    finally:
        s.close()
else:
    raise SystemExit("no free port")'
}
listening() { grep -q "^ *[0-9]*: [0-9A-F]*:$(printf '%04X' "$1") [0-9A-F:]* 0A" /proc/net/tcp; }
wait_listen() { for _ in $(seq 200); do listening "$1" && return 0; sleep 0.05; done; echo "app-bench: nothing listens on $1" >&2; exit 1; }
# start NAME MODE CMD...: a server in its own process group, pinned to SRV_CPU.
start() {
    local name=$1 mode=$2; shift 2
    local pre=(); [ "$mode" = smclo ] && pre=("$SMCLO" run --)
    setsid taskset -c "$SRV_CPU" "${pre[@]}" "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=($!)
    disown $!
}
# client MODE CMD...: pinned to CLI_CPU, under smclo run or not.
# client MODE CMD...: pinned to CLI_CPU, under smclo run or not; the client's
# CPU time (user + sys, seconds, from getrusage of its children) goes to
# $WORK/cpu, a measure that other load on the machine barely moves.
client() {
    local mode=$1; shift
    local pre=(); [ "$mode" = smclo ] && pre=("$SMCLO" run --)
    taskset -c "$CLI_CPU" python3 -c '
import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%f\n" % (r.ru_utime + r.ru_stime))
sys.exit(rc)' "$WORK/cpu" "${pre[@]}" "$@"
}
stat() { "$SMCLO" stats --json | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['conns_opened'], s['xfer_bytes'], sum(v['client']+v['server'] for v in s['fallbacks'].values()))"; }
median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.6g\n", (a[NR/2]+a[NR/2+1])/2}'; }

"$SMCLO" stats >/dev/null   # creates the device
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

# --- servers -------------------------------------------------------------
declare -A RPORT NPORT
for mode in plain smclo; do
    RPORT[$mode]=$(free_port)
    printf 'port %s\nbind 127.0.0.1\nsave ""\nappendonly no\nprotected-mode no\ndir %s\nlogfile %s\n' \
        "${RPORT[$mode]}" "$WORK" "$WORK/redis-$mode.log" >"$WORK/redis-$mode.conf"
    start "redis-$mode" "$mode" redis-server "$WORK/redis-$mode.conf"
    NPORT[$mode]=$(free_port)
    mkdir -p "$WORK/nginx-$mode" "$WORK/www"
    head -c 612 /dev/zero | tr '\0' 'x' >"$WORK/www/index.html"
    cat >"$WORK/nginx-$mode/nginx.conf" <<EOF
$( [ "$(id -u)" = 0 ] && echo "user root;" )
worker_processes 1;
daemon off;
pid $WORK/nginx-$mode/nginx.pid;
error_log $WORK/nginx-$mode/error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx-$mode/body;
  proxy_temp_path $WORK/nginx-$mode/proxy;
  sendfile on; tcp_nopush on; keepalive_timeout 65; keepalive_requests 1000000;
  default_type text/html;
  server { listen 127.0.0.1:${NPORT[$mode]}; root $WORK/www; }
}
EOF
    start "nginx-$mode" "$mode" "$NGINX" -c "$WORK/nginx-$mode/nginx.conf" -p "$WORK/nginx-$mode" -e "$WORK/nginx-$mode/error.log"
done
IPORT=$(free_port)
start iperf3 plain iperf3 -s -B 127.0.0.1 -p "$IPORT"
for mode in plain smclo; do wait_listen "${RPORT[$mode]}"; wait_listen "${NPORT[$mode]}"; done
wait_listen "$IPORT"

# --- rounds ------------------------------------------------------------------
: >"$WORK/results"
check() {  # check LABEL MODE WANT(smc|plain) BEFORE: the device agrees with the mode
    local label=$1 mode=$2 want=$3 before=$4 after; after=$(stat)
    read -r c0 x0 f0 <<<"$before"; read -r c1 x1 f1 <<<"$after"
    if [ "$want" = smc ] && { [ "$c1" -le "$c0" ] || [ "$f1" -ne "$f0" ]; }; then
        echo "app-bench: $label ($mode) was NOT accelerated: conns $c0->$c1, fallbacks $f0->$f1" >&2; exit 1; fi
    if [ "$want" = plain ] && [ "$c1" -ne "$c0" ]; then
        echo "app-bench: $label ($mode) opened SMC-D connections to a plain server" >&2; exit 1; fi
}
order() { if [ $(($1 % 2)) -eq 1 ]; then echo plain smclo; else echo smclo plain; fi; }
for r in $(seq "$ROUNDS"); do
    for mode in $(order "$r"); do
        b=$(stat)
        out=$(client "$mode" redis-benchmark -h 127.0.0.1 -p "${RPORT[$mode]}" -q -t set,get -n "$REDIS_N" -c 50 -d 1024 2>&1 | tr '\r' '\n')
        [ "$mode" = smclo ] && check redis "$mode" smc "$b"
        for t in SET GET; do
            v=$(grep -E "^ *$t: [0-9.]+ requests per second" <<<"$out" | tail -1 | awk '{print $2}')
            [ -n "$v" ] || { echo "app-bench: no $t result: $out" >&2; exit 1; }
            echo "redis_$t $mode $v $r" >>"$WORK/results"
        done
        b=$(stat)
        out=$(client "$mode" wrk -t 1 -c 50 -d "${SECS}s" "http://127.0.0.1:${NPORT[$mode]}/index.html")
        [ "$mode" = smclo ] && check nginx "$mode" smc "$b"
        grep -q "Socket errors\|Non-2xx" <<<"$out" && { echo "app-bench: wrk errors: $out" >&2; exit 1; }
        echo "nginx $mode $(awk '/Requests\/sec/ {print $2}' <<<"$out") $r" >>"$WORK/results"
    done
    for mode in $(order "$r"); do
        b=$(stat)
        out=$(client "$mode" wrk -t 1 -c 10 -d "${SECS}s" -H 'Connection: close' "http://127.0.0.1:${NPORT[plain]}/index.html")
        check conn-rate "$mode" plain "$b"
        echo "connrate $mode $(awk '/Requests\/sec/ {print $2}' <<<"$out") $r" >>"$WORK/results"
        n=$(awk '/ requests in / {print $1}' <<<"$out")
        echo "conncpu $mode $(python3 -c "print($(cat "$WORK/cpu") / $n * 1e6)") $r" >>"$WORK/results"
        out=$(client "$mode" iperf3 -c 127.0.0.1 -p "$IPORT" -t "$SECS" --json)
        check iperf3 "$mode" plain "$b"
        echo "iperf3 $mode $(python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)' <<<"$out") $r" >>"$WORK/results"
        echo "iperf3cpu $mode $(python3 -c 'import json,sys; print(float(sys.argv[1]) / (json.load(sys.stdin)["end"]["sum_sent"]["bytes"] / 1e9))' "$(cat "$WORK/cpu")" <<<"$out") $r" >>"$WORK/results"
    done
    echo "app-bench: round $r of $ROUNDS done" >&2
done

# --- table -------------------------------------------------------------------
med() { awk -v k="$1" -v m="$2" '$1==k && $2==m {print $3}' "$WORK/results" | median; }
row() {  # row KEY LABEL UNIT: medians of each side, and the median of the per-round ratios
    local p s q; p=$(med "$1" plain); s=$(med "$1" smclo)
    q=$(awk -v k="$1" '$1==k && $2=="plain" {p[$4]=$3} $1==k && $2=="smclo" {s[$4]=$3} END {for (r in p) if (r in s) print s[r]/p[r]}' "$WORK/results" | median)
    python3 -c 'import sys; l,u,p,s,q = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]); f = "%.4g" if p < 1000 else "%.0f"; print("| %s | %s | %s | %s | %.3f× | %.3f× |" % (l, u, f % p, f % s, s / p, q))' "$2" "$3" "$p" "$s" "$q"
}
echo
echo "app-bench: median of $ROUNDS rounds; server on CPU $SRV_CPU, client on CPU $CLI_CPU (taskset); plain and smclo back to back in each round, alternating which goes first; $(nproc) cores, kernel $(uname -r); load average before: $LOAD0"
echo
echo "| workload | unit | plain TCP | smclo run | ratio of medians | median of per-round ratios |"
echo "| --- | --- | --- | --- | --- | --- |"
row redis_SET "redis-benchmark SET (-n $REDIS_N -c 50 -d 1024)" "requests/s"
row redis_GET "redis-benchmark GET (-n $REDIS_N -c 50 -d 1024)" "requests/s"
row nginx "nginx + wrk (-t 1 -c 50, 612 B)" "requests/s"
echo
echo "Cost for plain peers (server plain; only the client runs under smclo run, so every connection falls back):"
echo
echo "| workload | unit | client plain | client under smclo run | ratio of medians | median of per-round ratios |"
echo "| --- | --- | --- | --- | --- | --- |"
row connrate "connection rate: wrk -c 10 'Connection: close' to plain nginx" "connections/s"
row iperf3 "throughput: iperf3 -c to plain iperf3 -s" "Gbit/s"
row conncpu "client CPU per connection (the wrk run above)" "µs (lower is better)"
row iperf3cpu "client CPU per GB sent (the iperf3 run above)" "s/GB (lower is better)"
echo
echo "Every round (in order):"
echo
for k in redis_SET redis_GET nginx connrate iperf3 conncpu iperf3cpu; do
    for m in plain smclo; do
        printf -- '- %s %s: %s\n' "$k" "$m" "$(awk -v k="$k" -v m="$m" '$1==k && $2==m {printf "%s ", $3}' "$WORK/results")"
    done
done
