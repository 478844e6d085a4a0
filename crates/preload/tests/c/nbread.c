/* Non-blocking reads on an empty ring, over one connection between two
 * processes under the preload. Usage: nbread MODE [ROUND-TRIPS]. The
 * process listens on loopback and forks a peer that connects (and, in
 * mode "scm", a helper first, which gets the connection's descriptor with
 * SCM_RIGHTS). "OK <bytes read>" and status 0 mean every check held;
 * "FAIL ..." and status 1 otherwise. Modes:
 *   echo N     an edge-triggered epoll echo server that reads until EAGAIN;
 *              the peer sends N 64-byte requests and reads each answer
 *   fork       a fork child turns the shared descriptor blocking, then
 *              non-blocking: the parent's reads follow, as the kernel's
 *   scm        the same by a process that got the descriptor with
 *              SCM_RIGHTS
 *   kill-et    the peer is killed (SIGKILL) while the server waits in an
 *              edge-triggered epoll_wait: it is told, and reads the end
 *   kill-busy  the same while the server busy-loops on non-blocking reads
 *   kill-poll  the same while the server waits in poll
 *   select-high N  "echo" over select on a descriptor above FD_SETSIZE (a
 *              set of 2048 bits, as programs that allocate larger sets)
 *   shutrd-high  select reports that descriptor readable after a local
 *              shutdown(SHUT_RD), which only the preload knows
 *   eagain-read N   N non-blocking reads on the empty ring, each EAGAIN
 *   eagain-write N  the ring filled, then N non-blocking writes, each EAGAIN
 *   toggle N   N times O_NONBLOCK off and on, with fcntl and ioctl(FIONBIO)
 *   prefork N  "echo" in a fork child of the server, whose parent closes
 *              its copy of the connection (a prefork server's worker) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static uint64_t read_off;

static void set_nb(int fd, int on) {
    if (fcntl(fd, F_SETFL, on ? O_NONBLOCK : 0)) fail("F_SETFL");
}

/* Reads or writes exactly `n` bytes on blocking `fd`. */
static void full(int fd, int out, unsigned char *b, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t k = out ? write(fd, b + done, n - done) : read(fd, b + done, n - done);
        if (k <= 0) fail(out ? "write" : "read");
        done += k;
    }
}

/* The peer of "echo": `n` requests of 64 bytes of the pattern, each
 * answer checked. */
static void echo_client(int fd, long n) {
    unsigned char b[64], r[64];
    uint64_t off = 0;
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < 64; j++) b[j] = pat(off + j);
        full(fd, 1, b, 64);
        full(fd, 0, r, 64);
        if (memcmp(b, r, 64)) fail("answer %ld differs", i);
        off += 64;
    }
    close(fd);
}

/* Reads until EAGAIN (each chunk checked and echoed); 1 at end of stream. */
static int drain_echo(int fd) {
    unsigned char b[4096];
    for (;;) {
        ssize_t k = read(fd, b, sizeof b);
        if (k == 0) return 1;
        if (k < 0 && errno == EAGAIN) return 0;
        if (k < 0) fail("read");
        for (ssize_t j = 0; j < k; j++)
            if (b[j] != pat(read_off + j)) fail("byte %llu wrong", (unsigned long long)(read_off + j));
        read_off += k;
        full(fd, 1, b, k);
    }
}

static void echo_server(int fd) {
    set_nb(fd, 1);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = fd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll_ctl");
    for (;;) {
        int n = epoll_wait(ep, &ev, 1, 10000);
        if (n != 1) fail("epoll_wait returned %d", n);
        if (drain_echo(fd)) break;
    }
    close(fd);
}

/* echo_server in a fork child; this process closes its copy at once. */
static void prefork_echo_server(int fd) {
    pid_t w = fork();
    if (w < 0) fail("fork");
    if (w == 0) {
        echo_server(fd);
        _exit(0);
    }
    close(fd);
    int st;
    if (waitpid(w, &st, 0) != w || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the worker ended with status %#x", st);
}

/* A descriptor above FD_SETSIZE for the connection `fd` (closed). */
#define HIGH_FD 1500
#define BIG_BITS 2048
static int move_high(int fd) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r)) fail("getrlimit");
    if (r.rlim_cur < BIG_BITS) {
        r.rlim_cur = BIG_BITS;
        if (r.rlim_max < BIG_BITS) r.rlim_max = BIG_BITS;
        if (setrlimit(RLIMIT_NOFILE, &r)) fail("setrlimit");
    }
    if (dup2(fd, HIGH_FD) != HIGH_FD) fail("dup2 to %d", HIGH_FD);
    close(fd);
    return HIGH_FD;
}

/* select for reading on `fd` with a set of BIG_BITS bits; its result. */
static int select_big(int fd, int timeout_ms) {
    unsigned long set[BIG_BITS / (8 * sizeof(unsigned long))];
    memset(set, 0, sizeof set);
    set[fd / (8 * sizeof(unsigned long))] |= 1UL << (fd % (8 * sizeof(unsigned long)));
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = timeout_ms % 1000 * 1000};
    int n = select(fd + 1, (fd_set *)set, NULL, NULL, &tv);
    if (n < 0) fail("select");
    int in = (set[fd / (8 * sizeof(unsigned long))] >> (fd % (8 * sizeof(unsigned long)))) & 1;
    if (n != in) fail("select returned %d with the bit %d", n, in);
    return n;
}

static void select_echo_server(int fd) {
    fd = move_high(fd);
    set_nb(fd, 1);
    for (;;) {
        if (select_big(fd, 10000) != 1) fail("select timed out");
        if (drain_echo(fd)) break;
    }
    close(fd);
}

static void check_shutrd_high(int fd) {
    fd = move_high(fd);
    set_nb(fd, 1);
    if (select_big(fd, 0) != 0) fail("readable before the shutdown");
    if (shutdown(fd, SHUT_RD)) fail("shutdown");
    double t0 = now_ms();
    int n = select_big(fd, 2000);
    double dt = now_ms() - t0;
    if (n != 1 || dt > 1000) fail("select after SHUT_RD returned %d after %.0f ms", n, dt);
    char c;
    if (read(fd, &c, 1) != 0) fail("read after SHUT_RD");
    close(fd);
}

static void check_eagain(int fd, int out, long n) {
    set_nb(fd, 1);
    static char b[65536];
    if (out)
        while (write(fd, b, sizeof b) > 0) {
        }
    for (long i = 0; i < n; i++) {
        ssize_t k = out ? write(fd, b, 1) : read(fd, b, 1);
        if (!(k < 0 && errno == EAGAIN)) fail("%s %ld returned %zd", out ? "write" : "read", i, k);
    }
    close(fd);
}

static void check_toggle(int fd, long n);

static volatile sig_atomic_t alarms;
static void on_alarm(int sig) {
    (void)sig;
    alarms++;
}

/* A read on the empty ring of `fd`: blocks (an alarm after 300 ms ends it
 * with EINTR) when `blocking`, else fails with EAGAIN at once. */
static void expect_read(int fd, int blocking) {
    struct sigaction sa = {.sa_handler = on_alarm}; /* no SA_RESTART */
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {.it_value = {.tv_usec = 300000}};
    setitimer(ITIMER_REAL, &it, NULL);
    char c;
    double t0 = now_ms();
    ssize_t k = read(fd, &c, 1);
    int e = errno;
    double dt = now_ms() - t0;
    struct itimerval off = {0};
    setitimer(ITIMER_REAL, &off, NULL);
    errno = e;
    if (blocking && !(k < 0 && e == EINTR && dt >= 250))
        fail("a read on a blocking descriptor returned %zd after %.0f ms", k, dt);
    if (!blocking && !(k < 0 && e == EAGAIN && dt < 250))
        fail("a read on a non-blocking descriptor returned %zd after %.0f ms", k, dt);
}

/* The peer that only waits: it writes nothing until told to quit (end of
 * its input) and then closes. */
static void idle_client(int fd, int quit_r) {
    char c;
    (void)!read(quit_r, &c, 1);
    close(fd);
}

/* "fork": children change O_NONBLOCK of the shared open file. */
static void check_fork(int fd) {
    set_nb(fd, 1);
    expect_read(fd, 0);
    for (int on = 0; on <= 1; on++) {
        pid_t c = fork();
        if (c == 0) {
            /* Its own copy only: the parent keeps the connection. */
            set_nb(fd, on);
            _exit(0);
        }
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the child failed");
        expect_read(fd, !on);
    }
}

/* "scm": the helper at `unix_fd` gets the descriptor and changes the flag
 * on request; it answers each request with one byte. */
static void helper(int unix_fd) {
    int got = -1;
    for (;;) {
        char cmd;
        struct iovec iov = {.iov_base = &cmd, .iov_len = 1};
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } u;
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
        if (recvmsg(unix_fd, &m, 0) != 1) _exit(0);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&got, CMSG_DATA(c), sizeof got);
        if (cmd == 'b' || cmd == 'n') set_nb(got, cmd == 'n');
        if (write(unix_fd, "k", 1) != 1) _exit(1);
    }
}

static void ask_helper(int unix_fd, char cmd, int pass) {
    struct iovec iov = {.iov_base = &cmd, .iov_len = 1};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (pass >= 0) {
        m.msg_control = u.b;
        m.msg_controllen = sizeof u.b;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass, sizeof pass);
    }
    if (sendmsg(unix_fd, &m, 0) != 1) fail("sendmsg to the helper");
    char k;
    if (read(unix_fd, &k, 1) != 1) fail("the helper's answer");
}

static void check_scm(int fd, int unix_fd) {
    set_nb(fd, 1);
    expect_read(fd, 0);
    ask_helper(unix_fd, 'p', fd);
    expect_read(fd, 0);
    ask_helper(unix_fd, 'b', -1);
    expect_read(fd, 1);
    ask_helper(unix_fd, 'n', -1);
    expect_read(fd, 0);
    close(unix_fd);
}

static void check_toggle(int fd, long n) {
    for (long i = 0; i < n; i++) {
        int on = 0;
        set_nb(fd, 1);
        if (ioctl(fd, FIONBIO, &on)) fail("FIONBIO");
    }
    expect_read(fd, 1);
    set_nb(fd, 0);
    int on = 1;
    if (ioctl(fd, FIONBIO, &on)) fail("FIONBIO");
    expect_read(fd, 0);
    close(fd);
}

static pid_t victim;

static void *killer(void *arg) {
    (void)arg;
    usleep(200000);
    kill(victim, SIGKILL);
    return NULL;
}

/* The end of the connection after the peer's death: 0 or ECONNRESET, as
 * TCP gives; within 3 s of the kill. */
static void check_dead_end(ssize_t k, int e, double since_kill) {
    if (!(k == 0 || (k < 0 && e == ECONNRESET)))
        fail("after the peer's death a read returned %zd (errno %d)", k, e);
    if (since_kill > 3000) fail("the peer's death was seen after %.0f ms", since_kill);
    printf("death seen %.1f ms after the kill\n", since_kill);
}

/* How "kill-*" waits for the ring: 0 not at all, 1 epoll (edge-triggered),
 * 2 poll. */
static void check_kill(int fd, int wait) {
    set_nb(fd, 1);
    char b[64];
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = fd};
    if (wait == 1 && epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll_ctl");
    /* The peer's 64 bytes (reported by the set: its edge is taken), then
     * nothing: the ring is empty. */
    size_t got = 0;
    while (got < 64) {
        if (wait == 1 && epoll_wait(ep, &ev, 1, 10000) != 1) fail("epoll_wait for the first bytes");
        for (;;) {
            ssize_t k = read(fd, b + got, 64 - got);
            if (k > 0) got += k;
            if (k < 0 && errno == EAGAIN) break;
            if (k <= 0 && errno != EAGAIN) fail("read the first bytes");
            if (got == 64) break;
        }
    }
    read_off += 64;
    if (read(fd, b, 1) != -1 || errno != EAGAIN) fail("the ring is not empty");
    pthread_t t;
    double t0 = now_ms();
    pthread_create(&t, NULL, killer, NULL);
    ssize_t k;
    int e;
    for (;;) {
        if (wait == 1) {
            int n = epoll_wait(ep, &ev, 1, 10000);
            if (n != 1) fail("epoll_wait returned %d %.0f ms after the start", n, now_ms() - t0);
        }
        if (wait == 2) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            int n = poll(&p, 1, 10000);
            if (n != 1) fail("poll returned %d %.0f ms after the start", n, now_ms() - t0);
        }
        k = read(fd, b, sizeof b);
        e = errno;
        if (!(k < 0 && e == EAGAIN)) break;
        if (now_ms() - t0 > 10000) fail("no end 10 s after the start");
    }
    double dt = now_ms() - t0 - 200;
    pthread_join(t, NULL);
    check_dead_end(k, e, dt);
    close(fd);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: nbread MODE [ROUND-TRIPS]");
    mode = argv[1];
    long n = argc > 2 ? atol(argv[2]) : 1000;
    setvbuf(stdout, NULL, _IOLBF, 0);
    int sv[2] = {-1, -1};
    if (!strcmp(mode, "scm")) {
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) fail("socketpair");
        if (fork() == 0) {
            close(sv[0]);
            helper(sv[1]);
            _exit(0);
        }
        close(sv[1]);
    }
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 4) || getsockname(lfd, (struct sockaddr *)&a, &al))
        fail("listen");
    int quit[2];
    if (pipe(quit)) fail("pipe");
    pid_t child = fork();
    if (child == 0) {
        close(lfd);
        close(quit[1]);
        if (sv[0] >= 0) close(sv[0]);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a)) fail("connect");
        if (!strcmp(mode, "echo") || !strcmp(mode, "select-high") || !strcmp(mode, "prefork")) {
            echo_client(fd, n);
        } else if (!strncmp(mode, "kill-", 5)) {
            unsigned char b[64];
            for (int j = 0; j < 64; j++) b[j] = pat(j);
            full(fd, 1, b, 64);
            pause();
        } else {
            idle_client(fd, quit[0]);
        }
        _exit(0);
    }
    close(quit[0]);
    victim = child;
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) fail("accept");
    if (!strcmp(mode, "echo")) echo_server(fd);
    else if (!strcmp(mode, "prefork")) prefork_echo_server(fd);
    else if (!strcmp(mode, "fork")) check_fork(fd);
    else if (!strcmp(mode, "scm")) check_scm(fd, sv[0]);
    else if (!strcmp(mode, "kill-et")) check_kill(fd, 1);
    else if (!strcmp(mode, "kill-busy")) check_kill(fd, 0);
    else if (!strcmp(mode, "kill-poll")) check_kill(fd, 2);
    else if (!strcmp(mode, "select-high")) select_echo_server(fd);
    else if (!strcmp(mode, "shutrd-high")) check_shutrd_high(fd);
    else if (!strcmp(mode, "eagain-read")) check_eagain(fd, 0, n);
    else if (!strcmp(mode, "eagain-write")) check_eagain(fd, 1, n);
    else if (!strcmp(mode, "toggle")) check_toggle(fd, n);
    else fail("unknown mode");
    close(quit[1]);
    int st;
    if (waitpid(child, &st, 0) != child) fail("waitpid");
    int killed = !strncmp(mode, "kill-", 5);
    if (killed ? !(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) : !(WIFEXITED(st) && !WEXITSTATUS(st)))
        fail("the peer ended with status %#x", st);
    printf("OK %llu\n", (unsigned long long)read_off);
    return 0;
}
