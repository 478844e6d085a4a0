#!/usr/bin/env bash
# request-instructions.sh: user-space instructions per request and
# response on each end of one SMC-D connection, the way an event loop
# waits (read only, poll, epoll). Not a test: it prints one line per way
# of waiting. Counted by valgrind's callgrind with SMCLO_SPIN_US=0 (every
# wait sleeps, so no spin's length enters the count), which does not move
# with the machine's load.
#
# A C program forks: the child connects and makes N, then 3N round trips
# of 4 bytes each way, the parent echoes; the difference of the two runs,
# per round trip, cancels start-up. Once plain, once with LIB (default
# target/release/libsmclo_preload.so) preloaded on a device of its own
# (the device's counters are checked: the connection must be SMC-D).
# Environment: N (2000), LIB, SMCLO (the smclo binary, for the counters).
# Needs: gcc, valgrind, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-2000}
LIB=${LIB:-$PWD/${CARGO_TARGET_DIR:-target}/release/libsmclo_preload.so}
SMCLO=${SMCLO:-$PWD/${CARGO_TARGET_DIR:-target}/release/smclo}
[ -f "$LIB" ] && [ -x "$SMCLO" ] || { echo "request-instructions: $LIB or $SMCLO missing; run cargo build --release --workspace" >&2; exit 1; }
for p in gcc valgrind; do
    command -v "$p" >/dev/null || { echo "request-instructions: $p is not installed" >&2; exit 1; }
done
WORK=$(mktemp -d /tmp/smclo-request-instr.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

cat > "$WORK/pingpong.c" <<'C'
#include <arpa/inet.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
/* Waits for `fd` to be readable the way `how` says ("read": not at all). */
static void await_in(const char *how, int fd, int ep) {
    if (!strcmp(how, "poll")) {
        struct pollfd p = {fd, POLLIN, 0};
        poll(&p, 1, -1);
    } else if (!strcmp(how, "epoll")) {
        struct epoll_event e;
        epoll_wait(ep, &e, 1, -1);
    }
}
static int epoll_of(int fd) {
    int ep = epoll_create1(0);
    struct epoll_event e = {.events = EPOLLIN, .data.fd = fd};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
    return ep;
}
int main(int argc, char **argv) {
    const char *how = argv[1];
    int n = atoi(argv[2]), st;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    char b[64];
    if (bind(l, (void *)&a, sizeof a) || listen(l, 4) || getsockname(l, (void *)&a, &al)) return 1;
    if (fork() == 0) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (void *)&a, sizeof a)) return 1;
        int ep = epoll_of(c);
        for (int i = 0; i < n; i++) {
            if (write(c, "ping", 4) != 4) return 2;
            await_in(how, c, ep);
            if (read(c, b, sizeof b) != 4) return 3;
        }
        return 0;
    }
    int s = accept(l, NULL, NULL), ep = epoll_of(s);
    for (;;) {
        await_in(how, s, ep);
        ssize_t k = read(s, b, sizeof b);
        if (k <= 0) break;
        if (write(s, b, k) != k) return 4;
    }
    wait(&st);
    return !WIFEXITED(st) || WEXITSTATUS(st);
}
C
gcc -O2 -o "$WORK/pingpong" "$WORK/pingpong.c"

# Instructions of each process of `pingpong HOW n`, "server client" (the
# parent's, the child's), with the environment given.
count() {
    local how=$1 n=$2
    shift 2
    rm -f "$WORK"/cg.*
    env "$@" valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$WORK/cg.%p" \
        "$WORK/pingpong" "$how" "$n" 2>"$WORK/vg.err" || { cat "$WORK/vg.err" >&2; exit 1; }
    local pids
    pids=$(sed -n 's/^==\([0-9]*\)== Collected : \([0-9]*\)$/\1 \2/p' "$WORK/vg.err" | sort -n)
    echo "$pids" | awk '{printf "%s ", $2}'
}
per_rt() {
    local how=$1 few many
    shift
    read -r -a few <<< "$(count "$how" "$N" "$@")"
    read -r -a many <<< "$(count "$how" $((3 * N)) "$@")"
    echo "server $(((many[0] - few[0]) / (2 * N))), client $(((many[1] - few[1]) / (2 * N)))"
}
for how in read poll epoll; do
    rm -rf "$WORK/dev"
    mkdir -m 700 "$WORK/dev"
    plain=$(per_rt $how LD_PRELOAD=)
    smclo=$(per_rt $how LD_PRELOAD="$LIB" SMCLO_DEVICE_DIR="$WORK/dev" SMCLO_SPIN_US=0)
    opened=$(SMCLO_DEVICE_DIR="$WORK/dev" "$SMCLO" stats --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["conns_opened"])')
    [ "$opened" = 2 ] || { echo "request-instructions: $opened SMC-D connections, not 2" >&2; exit 1; }
    echo "user-space instructions per round trip, waiting with $how: plain $plain; under the preload $smclo ($LIB)"
done
