/* Signal handlers that run while a wait spins in user space (before it
 * would sleep in the kernel) interrupt it as they would the kernel's sleep
 * (signal(7)). Usage: spin_signals MODE, one of
 *   eintr    each wait on an idle SMC-D connection (epoll_wait, epoll_pwait
 *            with an empty mask, epoll_pwait2, poll, ppoll, select, pselect,
 *            all with 5 s;
 *            a blocking recv; a blocking send on a full ring; a blocking
 *            accept on a listening socket no client connects to) with a SIGUSR1
 *            handler without SA_RESTART, signalled once 20 ms after the
 *            wait began: -1 EINTR. A second signal 3 s later rescues a wait
 *            the first did not end, so that a failure says how long it took
 *   masked   epoll_pwait and ppoll of 300 ms whose mask blocks SIGUSR1: the
 *            handler runs (the thread's own mask lets it in) but the wait is
 *            not interrupted and times out, as the kernel's would; and a
 *            poll of 300 ms while the handler runs in another thread
 *   restart  the handler with SA_RESTART: poll still fails with EINTR, a
 *            blocking recv is restarted and returns the byte the peer sends
 *            after 500 ms, a blocking accept is restarted and fails with
 *            EINVAL when the listening socket is shut down after 500 ms
 *            (also with SO_SNDTIMEO set on it), but one on a socket with
 *            SO_RCVTIMEO fails with EINTR
 *   actions  the preload's wrapping of handlers is invisible to sigaction,
 *            signal, sysv_signal, sigset and siginterrupt (no connection)
 * Each wait runs in a thread of its own (fresh spin budgets). Run with
 * SMCLO_SPIN_US raised (the test uses 200000) so that the first signal
 * comes while the wait spins. Prints "WAIT name rc errno ms handled" per
 * wait and "OK done", or "FAIL ..." and exits 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* siginterrupt and sigset are deprecated, but programs still call them. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

/* glibc reports the kernel's flags, which include the restorer it sets. */
#ifndef SA_RESTORER
#define SA_RESTORER 0x04000000
#endif

static volatile sig_atomic_t handled;

static void on_usr1(int sig) {
    (void)sig;
    handled++;
}

static void fail(const char *what) {
    printf("FAIL %s (errno %d %s)\n", what, errno, strerror(errno));
    fflush(stdout);
    exit(1);
}

static long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000L + t.tv_nsec / 1000000;
}

static void handler(int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL)) fail("sigaction");
}

/* ----- the waits ---------------------------------------------------------- */

static int fd;

static sigset_t mask_of(int blocked) {
    sigset_t m;
    sigemptyset(&m);
    if (blocked) sigaddset(&m, SIGUSR1);
    return m;
}

static int w_epoll(int ms, int masked) {
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll");
    int r;
    if (masked < 0) {
        r = epoll_wait(ep, &ev, 1, ms);
    } else {
        sigset_t m = mask_of(masked);
        r = epoll_pwait(ep, &ev, 1, ms, &m);
    }
    int e = errno;
    close(ep);
    errno = e;
    return r;
}

/* epoll_pwait2 without a mask (a timespec timeout). */
static int w_epoll2(int ms, int masked) {
    (void)masked;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll");
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    int r = epoll_pwait2(ep, &ev, 1, &ts, NULL);
    int e = errno;
    close(ep);
    errno = e;
    return r;
}

static int w_poll(int ms, int masked) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (masked < 0) return poll(&p, 1, ms);
    sigset_t m = mask_of(masked);
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    return ppoll(&p, 1, &ts, &m);
}

static int w_select(int ms, int masked) {
    fd_set r;
    FD_ZERO(&r);
    FD_SET(fd, &r);
    if (masked < 0) {
        struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
        return select(fd + 1, &r, NULL, NULL, &tv);
    }
    sigset_t m = mask_of(masked);
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    return pselect(fd + 1, &r, NULL, NULL, &ts, &m);
}

static int w_recv(int ms, int masked) {
    (void)ms, (void)masked;
    char b;
    return recv(fd, &b, 1, 0);
}

/* A blocking send of one byte once non-blocking sends filled the ring. */
static int w_send(int ms, int masked) {
    (void)ms, (void)masked;
    return send(fd, "s", 1, 0);
}

/* A listening socket no client connects to. */
static int lfd = -1;

static int w_accept(int ms, int masked) {
    (void)ms;
    (void)masked;
    return accept(lfd, NULL, NULL);
}

/* Shuts the listening socket down after 500 ms: a blocked accept fails
 * with EINVAL. */
static void *shut_listener(void *arg) {
    (void)arg;
    usleep(500000);
    shutdown(lfd, SHUT_RD);
    return NULL;
}

/* A new listening socket, with `timeo` (SO_RCVTIMEO or SO_SNDTIMEO) of
 * 5 s set on it unless 0. */
static void listener_with(int timeo) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_sec = 5};
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || (timeo && setsockopt(lfd, SOL_SOCKET, timeo, &tv, sizeof tv)) ||
        bind(lfd, (void *)&a, sizeof a) || listen(lfd, 4))
        fail("listener");
}

static void listener(void) {
    listener_with(0);
}


static void fill(void) {
    static char buf[65536];
    int fl = fcntl(fd, F_GETFL);
    if (fcntl(fd, F_SETFL, fl | O_NONBLOCK)) fail("O_NONBLOCK");
    long total = 0;
    for (;;) {
        ssize_t n = send(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EAGAIN) break;
        if (n < 0) fail("filling send");
        total += n;
    }
    if (fcntl(fd, F_SETFL, fl)) fail("blocking again");
    printf("FILLED %ld\n", total);
}

/* ----- one wait, signalled while it spins -------------------------------- */

struct wait {
    const char *name;
    int (*fn)(int ms, int masked);
    int ms, masked;
    pthread_t thread;
    /* Signal this thread instead of the waiting one, when set. */
    pthread_t other;
    int has_other;
    volatile int done;
};

static void *shooter(void *arg) {
    struct wait *w = arg;
    pthread_t to = w->has_other ? w->other : w->thread;
    usleep(20000);
    pthread_kill(to, SIGUSR1);
    for (int i = 0; i < 300 && !w->done; i++) usleep(10000);
    if (!w->done) pthread_kill(to, SIGUSR1);
    return NULL;
}

/* A thread that only takes signals, until the process ends. */
static void *bystander(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

static void *waiter(void *arg) {
    struct wait *w = arg;
    w->thread = pthread_self();
    handled = 0;
    pthread_t s;
    if (pthread_create(&s, NULL, shooter, w)) fail("pthread_create");
    long t0 = now_ms();
    errno = 0;
    int r = w->fn(w->ms, w->masked);
    int e = errno;
    long t = now_ms() - t0;
    w->done = 1;
    pthread_join(s, NULL);
    printf("WAIT %s %d %d %ld %d\n", w->name, r, r < 0 ? e : 0, t, (int)handled);
    return NULL;
}

static void run_to(const char *name, int (*fn)(int, int), int ms, int masked,
                   const pthread_t *other) {
    struct wait w = {.name = name, .fn = fn, .ms = ms, .masked = masked};
    if (other) {
        w.other = *other;
        w.has_other = 1;
    }
    pthread_t t;
    if (pthread_create(&t, NULL, waiter, &w)) fail("pthread_create");
    pthread_join(t, NULL);
}

static void run(const char *name, int (*fn)(int, int), int ms, int masked) {
    run_to(name, fn, ms, masked, NULL);
}

/* A blocking accept on a new listening socket with `timeo` set, which
 * another thread shuts down after 500 ms. */
static void run_accept(const char *name, int timeo) {
    listener_with(timeo);
    pthread_t s;
    if (pthread_create(&s, NULL, shut_listener, NULL)) fail("pthread_create");
    run(name, w_accept, 0, -1);
    pthread_join(s, NULL);
}

/* ----- the peer ----------------------------------------------------------- */

/* The peer, in a process of its own (a connection to a listener in the
 * same process stays TCP): accepts, never reads but in "restart" mode
 * (one byte, answered 500 ms later), and exits when the parent closes
 * `done`. */
static void peer(int port, int done, const char *mode) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (lfd < 0 || bind(lfd, (void *)&a, sizeof a) || listen(lfd, 1) ||
        getsockname(lfd, (void *)&a, &al))
        fail("listen");
    if (write(port, &a, sizeof a) != sizeof a) fail("port");
    int c = accept(lfd, NULL, NULL);
    if (c < 0) fail("accept");
    if (!strcmp(mode, "restart")) {
        char b;
        if (read(c, &b, 1) != 1) fail("peer read");
        usleep(500000);
        if (write(c, "r", 1) != 1) fail("peer write");
    }
    char b;
    while (read(done, &b, 1) < 0 && errno == EINTR) {}
    _exit(0);
}

/* ----- sigaction round trips ---------------------------------------------- */

static volatile sig_atomic_t info_sig, info_val, plain_sig;

static void on_info(int sig, siginfo_t *si, void *ctx) {
    info_sig = sig;
    info_val = si && ctx ? si->si_value.sival_int : -1;
}

static void on_plain(int sig) {
    plain_sig = sig;
    errno = 77;
}

static void expect(int ok, const char *what) {
    if (!ok) {
        printf("FAIL %s\n", what);
        exit(1);
    }
    printf("OK %s\n", what);
}

/* The kernel's own view of the handler (the raw system call, which the
 * preload does not see). */
static void *kernel_handler(int sig) {
    struct {
        void *handler;
        unsigned long flags;
        void *restorer;
        unsigned long mask;
    } k;
    if (syscall(SYS_rt_sigaction, sig, NULL, &k, 8)) fail("rt_sigaction");
    return k.handler;
}

static void actions(void) {
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_info;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGUSR2);
    if (sigaction(SIGUSR1, &sa, &old)) fail("sigaction install");
    expect(old.sa_handler == SIG_DFL, "the first query of SIGUSR1 is SIG_DFL");
    if (sigaction(SIGUSR1, NULL, &old)) fail("sigaction query");
    expect(old.sa_sigaction == on_info, "a query returns the SA_SIGINFO handler");
    int want = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    expect((old.sa_flags & ~SA_RESTORER) == want, "a query returns the flags");
    expect(sigismember(&old.sa_mask, SIGUSR2) == 1 && sigismember(&old.sa_mask, SIGINT) == 0,
           "a query returns the mask");
    if (getenv("LD_PRELOAD"))
        expect(kernel_handler(SIGUSR1) != (void *)on_info, "the kernel runs the trampoline");
    union sigval v = {.sival_int = 42};
    if (sigqueue(getpid(), SIGUSR1, v)) fail("sigqueue");
    expect(info_sig == SIGUSR1 && info_val == 42, "the handler gets the signal, siginfo and context");

    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_plain;
    sa.sa_flags = SA_RESETHAND | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, &old)) fail("sigaction plain");
    expect(old.sa_sigaction == on_info && (old.sa_flags & SA_SIGINFO),
           "the old action is the program's SA_SIGINFO one");
    if (sigaction(SIGUSR1, NULL, &old)) fail("sigaction query");
    expect(old.sa_handler == on_plain && !(old.sa_flags & SA_SIGINFO) &&
               (old.sa_flags & ~SA_RESTORER) == (SA_RESETHAND | SA_NODEFER),
           "a plain handler reads back without SA_SIGINFO");
    errno = 0;
    raise(SIGUSR1);
    expect(plain_sig == SIGUSR1, "the plain handler ran");
    expect(errno == 77, "errno is as the handler left it");
    if (sigaction(SIGUSR1, NULL, &old)) fail("sigaction query");
    expect(old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO) &&
               (old.sa_flags & ~SA_RESTORER) == (SA_RESETHAND | SA_NODEFER),
           "SA_RESETHAND reset the handler, the flags kept");

    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    if (sigaction(SIGUSR1, &sa, NULL)) fail("sigaction SIG_IGN");
    if (sigaction(SIGUSR1, NULL, &old)) fail("sigaction query");
    expect(old.sa_handler == SIG_IGN, "SIG_IGN reads back");
    raise(SIGUSR1);
    expect(kernel_handler(SIGUSR1) == SIG_IGN, "SIG_IGN is the kernel's");

    plain_sig = 0;
    expect(signal(SIGUSR2, on_plain) == SIG_DFL, "signal returns the old handler");
    if (sigaction(SIGUSR2, NULL, &old)) fail("sigaction query");
    expect(old.sa_handler == on_plain && (old.sa_flags & SA_RESTART) &&
               sigismember(&old.sa_mask, SIGUSR2) == 1,
           "signal installs with SA_RESTART, the signal blocked in its handler");
    raise(SIGUSR2);
    expect(plain_sig == SIGUSR2, "signal's handler ran");
    expect(siginterrupt(SIGUSR2, 1) == 0, "siginterrupt");
    if (sigaction(SIGUSR2, NULL, &old)) fail("sigaction query");
    expect(old.sa_handler == on_plain && !(old.sa_flags & SA_RESTART),
           "siginterrupt clears SA_RESTART");
    expect(signal(SIGUSR2, on_plain) == on_plain, "signal returns the program's handler");
    if (sigaction(SIGUSR2, NULL, &old)) fail("sigaction query");
    expect(!(old.sa_flags & SA_RESTART), "signal after siginterrupt: no SA_RESTART");
    siginterrupt(SIGUSR2, 0);

    plain_sig = 0;
    expect(sysv_signal(SIGUSR2, on_plain) == on_plain, "sysv_signal returns the old handler");
    raise(SIGUSR2);
    expect(plain_sig == SIGUSR2, "sysv_signal's handler ran");
    expect(signal(SIGUSR2, SIG_DFL) == SIG_DFL, "sysv_signal's handler was reset");

    expect(sigset(SIGUSR2, on_plain) == SIG_DFL, "sigset returns the old disposition");
    expect(sigset(SIGUSR2, SIG_HOLD) == on_plain, "sigset SIG_HOLD returns the handler");
    plain_sig = 0;
    raise(SIGUSR2);
    expect(plain_sig == 0, "SIG_HOLD blocks the signal");
    expect(sigset(SIGUSR2, on_plain) == SIG_HOLD, "sigset returns SIG_HOLD while held");
    expect(plain_sig == SIGUSR2, "the held signal ran once unblocked");
    expect(signal(SIGUSR2, SIG_DFL) == on_plain, "the handler reads back");
    expect(signal(SIGKILL, on_plain) == SIG_ERR && errno == EINVAL, "SIGKILL is refused");
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: spin_signals MODE");
    const char *mode = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "actions")) {
        actions();
        printf("OK done\n");
        return 0;
    }
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
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (void *)&a, sizeof a)) fail("connect");
    if (!strcmp(mode, "eintr")) {
        handler(0);
        run("epoll_wait", w_epoll, 5000, -1);
        run("epoll_pwait", w_epoll, 5000, 0);
        run("epoll_pwait2", w_epoll2, 5000, -1);
        run("poll", w_poll, 5000, -1);
        run("ppoll", w_poll, 5000, 0);
        run("select", w_select, 5000, -1);
        run("pselect", w_select, 5000, 0);
        run("recv", w_recv, 0, -1);
        fill();
        run("send", w_send, 0, -1);
        listener();
        run("accept", w_accept, 0, -1);
    } else if (!strcmp(mode, "masked")) {
        handler(0);
        run("epoll_pwait", w_epoll, 300, 1);
        run("ppoll", w_poll, 300, 1);
        /* A handler in another thread does not interrupt this one's wait. */
        pthread_t b;
        if (pthread_create(&b, NULL, bystander, NULL)) fail("pthread_create");
        run_to("poll_other_thread", w_poll, 300, -1, &b);
    } else if (!strcmp(mode, "restart")) {
        handler(SA_RESTART);
        run("poll", w_poll, 5000, -1);
        if (send(fd, "w", 1, 0) != 1) fail("send w");
        run("recv", w_recv, 0, -1);
        run_accept("accept", 0);
        run_accept("accept_sndtimeo", SO_SNDTIMEO);
        run_accept("accept_rcvtimeo", SO_RCVTIMEO);
    } else {
        fail("unknown mode");
    }
    close(done[1]);
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("peer");
    printf("OK done\n");
    return 0;
}
