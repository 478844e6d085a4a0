#!/usr/bin/env bash
# node's cluster module as PM2's cluster mode runs it, as deployed (no
# pinning): tests/js/cluster.js (a primary that accepts every connection
# and passes it to one of two workers with SCM_RIGHTS) and wrk -t2 -c32
# against it for SECS (default 5) seconds, over TCP and with both under
# smclo run (the primary with SMCLO_PASS_WAIT_MS=$PASS_WAIT_MS, default 5;
# 0 is smclo's default), alternating, ROUNDS rounds (default 4).
# CLOSE=1: every request on a new connection (wrk -c8, "Connection:
# close"). Prints per run:
# requests/s, cores busy (all CPUs, from /proc/stat) and CPU microseconds
# per request (busy time over requests: node, wrk and the kernel), then the
# median of the per-round ratios smclo/TCP.
# Needs node, wrk and the release build (target/release/smclo).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-4} SECS=${SECS:-5} PASS_WAIT_MS=${PASS_WAIT_MS:-5} CLOSE=${CLOSE:-0}
wrk_args=(-t2 -c32)
if [ "$CLOSE" = 1 ]; then wrk_args=(-t2 -c8 -H "Connection: close"); fi
smclo=$PWD/target/release/smclo
script=$PWD/crates/apptests/tests/js/cluster.js
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
busy() { awk '/^cpu / {print $2+$3+$4+$7+$8}' /proc/stat; }
run() { # run LABEL PREFIX...
    local label=$1; shift
    local port=$((20000 + RANDOM % 20000)) dev
    dev=$(mktemp -d "$work/dev.XXXX")
    SMCLO_DEVICE_DIR=$dev SMCLO_PASS_WAIT_MS=$PASS_WAIT_MS "$@" node "$script" "$port" >"$work/out" 2>/dev/null &
    local srv=$!
    for _ in $(seq 100); do grep -q ready "$work/out" && break; sleep 0.05; done
    local b0 t0 out b1 t1
    b0=$(busy) t0=$(date +%s.%N)
    out=$(SMCLO_DEVICE_DIR=$dev "$@" wrk "${wrk_args[@]}" -d"${SECS}s" "http://127.0.0.1:$port/")
    b1=$(busy) t1=$(date +%s.%N)
    kill "$srv"; wait "$srv" 2>/dev/null || true
    pkill -f "cluster.js $port" || true
    local dev_says=""
    if [ "$label" != tcp ]; then
        dev_says=$(SMCLO_DEVICE_DIR=$dev "$smclo" stats | awk '/opened/ {o=$NF} /^Fallbacks/ {f=$NF} END {printf " (device: %s SMC-D connections, %s fallbacks)", o, f}')
    fi
    local n rps
    n=$(awk '/requests in/ {print $1}' <<<"$out")
    rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
    awk -v l="$label" -v rps="$rps" -v n="$n" -v b=$((b1 - b0)) -v t0="$t0" -v t1="$t1" \
        -v d="$dev_says" 'BEGIN { printf "%s %.0f req/s, %.2f cores busy, %.1f us CPU/request%s\n", l, rps, b / 100 / (t1 - t0), b / 100 / n * 1e6, d }'
}
ratios=()
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    a=$(run tcp env); echo "$a"
    b=$(run smclo "$smclo" run --); echo "$b"
    ratios+=("$(awk -v a="${a#tcp }" -v b="${b#smclo }" 'BEGIN { split(a, x, " "); split(b, y, " "); printf "%.3f", y[1] / x[1] }')")
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "median smclo/TCP requests/s: %.2fx\n", m }'
