/* Signals and timeouts on a blocking socket, as the kernel defines them for
 * TCP (socket(7), signal(7)). Usage: intr MODE, one of
 *   eintr     recv on an idle connection, SIGALRM handler without SA_RESTART:
 *             -1 EINTR after the alarm (1 s)
 *   restart   the same with SA_RESTART (and a SIGSEGV handler without it):
 *             the recv is restarted and returns the byte the peer sends
 *             after 2 s
 *   rcvtimeo  SO_RCVTIMEO 1 s (set before connect): -1 EAGAIN after 1 s; then
 *             SO_RCVTIMEO 3 s and an SA_RESTART handler: EINTR after the
 *             1 s alarm all the same
 *   lrcvtimeo SO_RCVTIMEO 1 s on the peer's listener, inherited by the
 *             connection it accepts: the peer's recv is -1 EAGAIN after 1 s
 *   sndtimeo  SO_SNDTIMEO 1 s, a peer that never reads: a large write returns
 *             its partial count after 1 s, the next write -1 EAGAIN after 1 s
 *   dontwait  while a second thread sleeps in a blocking recv, a recv with
 *             MSG_DONTWAIT fails with EAGAIN at once; the peer's byte (after
 *             2 s) then ends the sleeping recv
 * The process forks: the child accepts and plays the peer. Prints one
 * "OK ..." line per check and exits 0, or "FAIL ..." and exits 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t alarms;

static void on_alarm(int sig) {
    (void)sig;
    alarms++;
}

static void on_fault(int sig) {
    (void)sig;
    _exit(3);
}

static void fail(const char *what) {
    printf("FAIL %s (errno %d %s)\n", what, errno, strerror(errno));
    fflush(stdout);
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void handler(int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL)) fail("sigaction");
}

static void timeo(int fd, int opt, int sec) {
    struct timeval tv = {sec, 0};
    if (setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv)) fail("setsockopt");
}

/* Checks that a call took [lo, hi] seconds and reports it. */
static void took(const char *what, double t0, double lo, double hi) {
    double t = now() - t0;
    if (t < lo || t > hi) {
        printf("FAIL %s took %.2f s, expected %.1f..%.1f\n", what, t, lo, hi);
        exit(1);
    }
    printf("OK %s %.2f s\n", what, t);
}

static void expect_fail(const char *what, ssize_t r, int err) {
    if (r != -1 || errno != err) {
        printf("FAIL %s returned %zd (errno %d %s), expected errno %d\n", what, r, errno,
               strerror(errno), err);
        exit(1);
    }
}

/* The peer, in a process of its own (a connection to a listener in the
 * same process stays TCP): listens, writes its port to `port`, accepts,
 * sends one byte after 2 s in "restart" mode, never reads, and exits when
 * the parent closes `done`. */
static void peer(int port, int done, const char *mode) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (lfd < 0 || bind(lfd, (void *)&a, sizeof a) || listen(lfd, 1) ||
        getsockname(lfd, (void *)&a, &al))
        fail("listen");
    if (!strcmp(mode, "lrcvtimeo")) timeo(lfd, SO_RCVTIMEO, 1);
    if (write(port, &a, sizeof a) != sizeof a) fail("port");
    int c = accept(lfd, NULL, NULL);
    if (c < 0) fail("accept");
    if (!strcmp(mode, "lrcvtimeo")) {
        char x;
        double t0 = now();
        expect_fail("peer recv", recv(c, &x, 1, 0), EAGAIN);
        took("peer recv timed out as its listener said (EAGAIN)", t0, 0.9, 3.5);
    }
    if (!strcmp(mode, "restart") || !strcmp(mode, "dontwait")) {
        sleep(2);
        if (write(c, "x", 1) != 1) fail("peer write");
    }
    char b;
    while (read(done, &b, 1) < 0 && errno == EINTR) {}
    _exit(0);
}

static void *blocking_recv(void *arg) {
    char b;
    return (void *)(intptr_t)recv(*(int *)arg, &b, 1, 0);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: intr MODE");
    const char *mode = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    int port[2], done[2];
    if (pipe(port) || pipe(done)) fail("pipe");
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        close(done[1]);
        peer(port[1], done[0], mode);
    }
    close(done[0]);
    struct sockaddr_in a;
    if (read(port[0], &a, sizeof a) != sizeof a) fail("port");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (!strcmp(mode, "rcvtimeo")) timeo(fd, SO_RCVTIMEO, 1);
    if (fd < 0 || connect(fd, (void *)&a, sizeof a)) fail("connect");
    char buf[64];
    double t0 = now();
    if (!strcmp(mode, "eintr")) {
        handler(0);
        alarm(1);
        expect_fail("recv", recv(fd, buf, sizeof buf, 0), EINTR);
        took("recv interrupted (EINTR)", t0, 0.8, 3.0);
        if (alarms != 1) fail("the handler did not run");
    } else if (!strcmp(mode, "restart")) {
        handler(SA_RESTART);
        /* A fault handler without SA_RESTART, as language runtimes and
         * crash reporters install: it cannot be what interrupted a sleep. */
        struct sigaction segv;
        memset(&segv, 0, sizeof segv);
        segv.sa_handler = on_fault;
        sigemptyset(&segv.sa_mask);
        if (sigaction(SIGSEGV, &segv, NULL)) fail("sigaction SIGSEGV");
        alarm(1);
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n != 1 || buf[0] != 'x') fail("restarted recv did not return the byte");
        took("recv restarted after the handler", t0, 1.8, 6.0);
        if (alarms != 1) fail("the handler did not run");
    } else if (!strcmp(mode, "rcvtimeo")) {
        expect_fail("recv", recv(fd, buf, sizeof buf, 0), EAGAIN);
        took("recv timed out (EAGAIN)", t0, 0.9, 3.5);
        timeo(fd, SO_RCVTIMEO, 3);
        handler(SA_RESTART);
        t0 = now();
        alarm(1);
        expect_fail("recv", read(fd, buf, sizeof buf), EINTR);
        took("read with a timeout interrupted (EINTR despite SA_RESTART)", t0, 0.8, 2.9);
    } else if (!strcmp(mode, "lrcvtimeo")) {
        /* Holds the connection open while the peer's recv times out. */
        sleep(4);
    } else if (!strcmp(mode, "sndtimeo")) {
        timeo(fd, SO_SNDTIMEO, 1);
        size_t big = 64 << 20;
        char *p = calloc(big, 1);
        if (!p) fail("calloc");
        ssize_t n = write(fd, p, big);
        if (n <= 0 || (size_t)n >= big) fail("the write did not return a partial count");
        took("write timed out with a partial count", t0, 0.9, 4.0);
        printf("OK wrote %zd\n", n);
        t0 = now();
        expect_fail("write", write(fd, p, 1), EAGAIN);
        took("write timed out (EAGAIN)", t0, 0.9, 4.0);
    } else if (!strcmp(mode, "dontwait")) {
        pthread_t t;
        if (pthread_create(&t, NULL, blocking_recv, &fd)) fail("pthread_create");
        usleep(300000);
        t0 = now();
        expect_fail("recv(MSG_DONTWAIT)", recv(fd, buf, sizeof buf, MSG_DONTWAIT), EAGAIN);
        took("recv(MSG_DONTWAIT) beside a blocking recv (EAGAIN)", t0, 0.0, 0.5);
        void *r;
        pthread_join(t, &r);
        if ((intptr_t)r != 1) fail("the blocking recv did not get the byte");
    } else {
        fail("unknown mode");
    }
    close(done[1]);
    close(fd);
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("peer");
    printf("OK done\n");
    return 0;
}
