#!/usr/bin/env bash
# plain-peer-instructions.sh: what the preload adds, in user-space
# instructions, to each connection of a client whose server is plain TCP.
# Not a test: it prints one line per client. Counted by valgrind's
# callgrind, so the figure does not move with the machine's load, where
# timed runs scatter far more than the cost (docs/bench/plain-peers.md).
#
# A C client makes N and 3N connections (connect, 5 bytes each way,
# close) to a plain python echo server on loopback; the difference of the
# two runs, per connection, cancels start-up. Once plain, once with
# LIB (default target/release/libsmclo_preload.so) preloaded on a device of
# its own. Environment: N (1000), LIB. Needs: gcc, valgrind, python3.
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
gcc -O2 -o "$WORK/client" "$WORK/client.c"
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

# Instructions of `client PORT n` (callgrind's total), with the environment given.
count() {
    local n=$1; shift
    env "$@" valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" "$WORK/client" "$PORT" "$n" 2>&1 |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
per_conn() {
    local few many
    few=$(count "$N" "$@")
    many=$(count $((3 * N)) "$@")
    echo $(((many - few) / (2 * N)))
}
mkdir -m 700 "$WORK/dev"
plain=$(per_conn LD_PRELOAD=)
smclo=$(per_conn LD_PRELOAD="$LIB" SMCLO_DEVICE_DIR="$WORK/dev")
echo "user-space instructions per connection to a plain server: plain client $plain, under the preload $smclo ($LIB)"
