#!/usr/bin/env bash
# A thread-per-connection Java server as deployed (no pinning): Echo.java's
# ServerSocket server (a thread per connection) and its load mode (THREADS
# connections, a thread each, 100-byte requests and echoes), over TCP, under
# smclo run, and under smclo run with SMCLO_SPIN_US=0, alternating, ROUNDS
# rounds (default 4) of SECS (default 3) per run and THREADS (default
# 8). Prints requests/s and the client JVM's CPU seconds (user, system; its
# start-up included) per run.
# Needs javac and the release build (target/release/smclo).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-4} SECS=${SECS:-3} THREADS=${THREADS:-8}
smclo=$PWD/target/release/smclo
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
javac -d "$work" crates/apptests/tests/java/Echo.java
run() { # run LABEL PREFIX...
    local label=$1; shift
    local port=$((20000 + RANDOM % 20000)) dev
    dev=$(mktemp -d "$work/dev.XXXX")
    SMCLO_DEVICE_DIR=$dev "$@" java -cp "$work" Echo server "$port" >/dev/null 2>&1 &
    local srv=$!
    for _ in $(seq 100); do ss -ltn "sport = :$port" | grep -q LISTEN && break; sleep 0.05; done
    local out
    out=$( { SMCLO_DEVICE_DIR=$dev /usr/bin/time -f "%U %S" "$@" java -cp "$work" Echo load "$port" "$THREADS" "$SECS"; } 2>&1 | tr '\n' ' ')
    kill "$srv"; wait "$srv" 2>/dev/null || true
    echo "$label threads=$THREADS $out"
}
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    run tcp env
    run smclo "$smclo" run --
    run smclo-nospin env SMCLO_SPIN_US=0 "$smclo" run --
done
