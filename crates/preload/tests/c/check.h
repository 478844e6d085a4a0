/* What the preload's C test programs share: failing loudly with the
 * program's mode and pid (the Rust side shows stdout), the byte pattern
 * the data is checked against, and a monotonic clock. Each program sets
 * `mode` from its arguments. */
#ifndef SMCLO_TEST_CHECK_H
#define SMCLO_TEST_CHECK_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *mode = "";

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "FAIL [%s %d] ", mode, (int)getpid());
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, " (errno %d %s)\n", errno, strerror(errno));
    fflush(stdout);
    va_end(ap);
    exit(1);
}

/* The byte at offset `i` of a checked stream. */
static inline unsigned char pat(uint64_t i) { return (unsigned char)(i * 131 + (i >> 11) + 7); }

static inline double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A TCP socket listening on a loopback port the kernel picks, into `a`. */
static inline int listen_lo(struct sockaddr_in *a) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    *a = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof *a;
    if (l < 0 || bind(l, (void *)a, sizeof *a) || listen(l, 4) || getsockname(l, (void *)a, &al)) fail("listen");
    return l;
}

/* A TCP socket connected to `a`. */
static inline int connect_lo(const struct sockaddr_in *a) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (const void *)a, sizeof *a)) fail("connect");
    return c;
}

/* Waits for process `pid`, which must exit with status 0. */
static inline void wait_peer(pid_t pid) {
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("the peer failed (status %d)", st);
}

#endif
