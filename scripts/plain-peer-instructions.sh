#!/usr/bin/env bash
# plain-peer-instructions.sh: what the preload adds, in user-space
# instructions, to each connection whose peer is plain TCP: a client
# under it whose server is plain, and a server under it whose clients are.
# Not a test: it prints two lines. Counted by valgrind's callgrind, so the
# figures do not move with the machine's load, where timed runs scatter
# far more than the cost (docs/bench/plain-peers.md).
#
# A C client makes N and 3N connections (connect, 5 bytes each way,
# close) to a plain python echo server on loopback; then a C server
# accepts N and 3N such connections from the plain C client. The
# difference of the two runs, per connection, cancels start-up. Each once
# plain, once with LIB (default target/release/libsmclo_preload.so)
# preloaded on a device of its own. Environment: N (1000), LIB. Needs:
# gcc, valgrind, python3, ss (iproute2).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-1000}
LIB=${LIB:-$PWD/${CARGO_TARGET_DIR:-target}/release/libsmclo_preload.so}
[ -f "$LIB" ] || { echo "plain-peer-instructions: $LIB missing; run cargo build --release --workspace" >&2; exit 1; }
for p in gcc valgrind python3; do
    command -v "$p" >/dev/null || { echo "plain-peer-instructions: $p is not installed" >&2; exit 1; }
done
WORK=$(mktemp -d /tmp/smclo-plain-instr.XXXXXX)
SERVER=
cleanup() {
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

cat > "$WORK/client.c" <<'C'
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1])),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    char b[8];
    for (int i = 0, n = atoi(argv[2]); i < n; i++) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0 || connect(c, (void *)&a, sizeof a) || write(c, "ping\n", 5) != 5 || read(c, b, sizeof b) <= 0)
            return perror("client"), 1;
        close(c);
    }
    return 0;
}
C
cat > "$WORK/server.c" <<'C'
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1])),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    char b[64];
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (void *)&a, sizeof a) || listen(l, 128)) return perror("server"), 1;
    for (int i = 0, n = atoi(argv[2]); i < n; i++) {
        int c = accept(l, NULL, NULL);
        ssize_t k = read(c, b, sizeof b);
        if (c < 0 || k <= 0 || write(c, b, k) != k) return perror("server"), 1;
        close(c);
    }
    return 0;
}
C
gcc -O2 -o "$WORK/client" "$WORK/client.c"
gcc -O2 -o "$WORK/server" "$WORK/server.c"
python3 -c '
import socket, sys
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(128)
print(l.getsockname()[1], flush=True)
while True:
    c, _ = l.accept(); c.sendall(c.recv(64)); c.close()
' > "$WORK/port" &
SERVER=$!
while [ ! -s "$WORK/port" ]; do sleep 0.05; done
PORT=$(cat "$WORK/port")

# Instructions (callgrind's total) of `client PORT n`, with the
# environment given.
client() {
    local n=$1; shift
    env "$@" valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" "$WORK/client" "$PORT" "$n" 2>&1 |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
# The same of `server PORT n` (a free port), which the plain client drives.
server() {
    local n=$1 port
    shift
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    env "$@" valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" "$WORK/server" "$port" "$n" \
        > "$WORK/server.out" 2>&1 &
    local pid=$!
    until ss -ltn "sport = :$port" | grep -q LISTEN; do sleep 0.1; done
    "$WORK/client" "$port" "$n"
    wait "$pid"
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$WORK/server.out"
}
per_conn() {
    local side=$1 few many
    shift
    few=$("$side" "$N" "$@")
    many=$("$side" $((3 * N)) "$@")
    echo $(((many - few) / (2 * N)))
}
mkdir -m 700 "$WORK/dev"
for side in client server; do
    plain=$(per_conn $side LD_PRELOAD=)
    smclo=$(per_conn $side LD_PRELOAD="$LIB" SMCLO_DEVICE_DIR="$WORK/dev")
    echo "user-space instructions per connection whose peer is plain, $side: plain $plain, under the preload $smclo ($LIB)"
done
