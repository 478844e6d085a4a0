/* A new image under the preload that gets a SMCLO_EXEC_CONNS it cannot
 * adopt (another smclo version's layout) carries out the moves the value
 * starts with: its descriptor that was an SMC-D channel becomes the TCP
 * socket passed for it, smclo's own descriptors are closed, and the
 * variable is gone.
 *
 * `exec_conns LAYOUT LIB` (run without the preload) makes a loopback TCP
 * connection with bytes waiting at the accepted end, a UNIX socket pair
 * standing for the channel, and a memfd standing for a DMB: the program's
 * descriptor 5 is one end of the pair, the accepted TCP socket is at 9,
 * the memfd at 7 (and at 10, for layout 1), the pair's other end at 6;
 * the connecting end stays open, at a number of its own.
 * It then execs itself as `exec_conns child LAYOUT` with LD_PRELOAD=LIB and
 * SMCLO_EXEC_CONNS in LAYOUT: "future" (the moves, then a layout no
 * version knows) or "v1" (the layout before the moves: one connection's
 * fields). The child checks what it got and prints "OK <bytes read>".
 *
 * LAYOUT "stale": the same value as "future", passed by a program that
 * runs under the preload itself (it wrote no such value: the exec must
 * not pass it on). The child must find no variable and its descriptors
 * as they were: 5 the pair's end, 9 the TCP socket. */
#define _GNU_SOURCE
#include "check.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define PROG_FD 5
#define PAIR_FD 6
#define OWN_FD 7
#define TCP_FD 9
#define OWN2_FD 10

static const char greeting[] = "bytes over tcp\n";

/* `fd` moved above the numbers the test uses. */
static int high(int fd) {
    int h = fcntl(fd, F_DUPFD, 20);
    if (h < 0)
        fail("F_DUPFD %d", fd);
    close(fd);
    return h;
}

/* `fd` (a high one) moved to `at`. */
static void put_at(int fd, int at) {
    if (dup2(fd, at) != at)
        fail("dup2 %d to %d", fd, at);
    close(fd);
}

/* A loopback TCP connection: its accepted end, with the greeting
 * waiting, returned; the connecting end in `*keep`. All high. */
static int tcp_pair(int *keep) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) ||
        getsockname(l, (struct sockaddr *)&a, &n))
        fail("listen");
    int c = high(socket(AF_INET, SOCK_STREAM, 0));
    if (connect(c, (struct sockaddr *)&a, sizeof a))
        fail("connect");
    int s = high(accept(l, NULL, NULL));
    close(l);
    if (write(c, greeting, sizeof greeting - 1) != sizeof greeting - 1)
        fail("write");
    *keep = c; /* open until the child exits */
    return s;
}

static int parent(const char *layout, const char *lib) {
    int keep, sv[2];
    int tcp = tcp_pair(&keep);
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        fail("socketpair");
    int prog = high(sv[0]), pair = high(sv[1]);
    int m = high(memfd_create("dmb", 0));
    if (!strcmp(layout, "v1") && dup2(m, OWN2_FD) != OWN2_FD)
        fail("dup2 memfd");
    put_at(tcp, TCP_FD);
    put_at(prog, PROG_FD);
    put_at(pair, PAIR_FD);
    put_at(m, OWN_FD);
    (void)keep;
    char var[512];
    if (strcmp(layout, "v1"))
        snprintf(var, sizeof var, "SMCLO_EXEC_CONNS=%d=%d,%d= 99:a layout no version knows",
                 PROG_FD, TCP_FD, OWN_FD);
    else
        /* Layout 1: version, device directory (hex), then one connection:
         * fds, channel, tcp, local memfd, peer memfd, 18 numbers. */
        snprintf(var, sizeof var,
                 "SMCLO_EXEC_CONNS=1:2f:%d,%d,%d,%d,%d,0,0,,1,0,0,2,3,4,0,0,0,0,0,0,0,0,0",
                 PROG_FD, PROG_FD, TCP_FD, OWN_FD, OWN2_FD);
    char pre[1024];
    snprintf(pre, sizeof pre, "LD_PRELOAD=%s", lib);
    char *env[] = {var, pre, "SMCLO_DEBUG=1", NULL};
    char *argv[] = {"exec_conns", "child", (char *)layout, NULL};
    execve("/proc/self/exe", argv, env);
    fail("execve");
    return 1;
}

/* The "stale" child: nothing was moved. */
static int untouched(void) {
    int d5 = -1, d9 = -1;
    socklen_t n = sizeof d5;
    if (getsockopt(PROG_FD, SOL_SOCKET, SO_DOMAIN, &d5, &n) ||
        getsockopt(TCP_FD, SOL_SOCKET, SO_DOMAIN, &d9, &n))
        fail("SO_DOMAIN");
    if (d5 != AF_UNIX || d9 != AF_INET)
        fail("fds %d and %d are of domains %d and %d", PROG_FD, TCP_FD, d5, d9);
    printf("OK 0\n");
    return 0;
}

static int child(const char *layout) {
    if (getenv("SMCLO_EXEC_CONNS"))
        fail("SMCLO_EXEC_CONNS is still set");
    if (!strcmp(layout, "stale"))
        return untouched();
    int dom = -1;
    socklen_t n = sizeof dom;
    if (getsockopt(PROG_FD, SOL_SOCKET, SO_DOMAIN, &dom, &n))
        fail("SO_DOMAIN of fd %d", PROG_FD);
    if (dom != AF_INET)
        fail("fd %d is of domain %d, not the TCP socket", PROG_FD, dom);
    int own[] = {OWN_FD, TCP_FD, strcmp(layout, "v1") ? OWN_FD : OWN2_FD};
    for (int i = 0; i < 3; i++)
        if (fcntl(own[i], F_GETFD) != -1)
            fail("smclo's fd %d is still open", own[i]);
    char b[64];
    ssize_t r = read(PROG_FD, b, sizeof b);
    if (r != sizeof greeting - 1 || memcmp(b, greeting, (size_t)r))
        fail("read %zd bytes, not the greeting", r);
    /* The pair's other end: every copy of this end is closed. */
    int other = -1;
    n = sizeof other;
    if (getsockopt(PAIR_FD, SOL_SOCKET, SO_DOMAIN, &other, &n) || other != AF_UNIX)
        fail("fd %d is not the pair's other end", PAIR_FD);
    if (read(PAIR_FD, b, sizeof b) != 0)
        fail("the channel is still open");
    printf("OK %zd\n", r);
    return 0;
}

int main(int argc, char **argv) {
    mode = argc > 1 ? argv[1] : "";
    if (argc == 3 && !strcmp(argv[1], "child"))
        return child(argv[2]);
    if (argc == 3)
        return parent(argv[1], argv[2]);
    fprintf(stderr, "usage: exec_conns future|v1 LIB\n");
    return 2;
}
