/* Event-loop semantics over one connection, for the preload's epoll and
 * poll fast path. Usage: evloop MODE. The process listens on loopback and
 * forks a peer that connects; the parent checks what epoll (or poll) reports
 * while it tells the peer, over a pipe, what to do next (write 10 bytes,
 * read, shut down, stream). Exit status 0 and "OK" mean every check held;
 * "FAIL ..." and status 1 otherwise. Bytes carry a known pattern. */
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
#include <sched.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/time.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static int cmd_w, ack_r; /* parent: commands to the peer, acks back */

/* ---- the peer ---------------------------------------------------------- */

static uint64_t sent_off, read_off;
static long rr_n = 1000;  /* round trips of the "select" and "pselect" modes */
static long selects;      /* select or pselect calls this process made */

/* Waits until `fd` is readable (or writable), with select or, in mode
 * "pselect", pselect. */
static void sel_wait(int fd, int for_write) {
    fd_set s;
    FD_ZERO(&s);
    FD_SET(fd, &s);
    int n;
    selects++;
    if (!strcmp(mode, "pselect")) {
        struct timespec ts = {.tv_sec = 5};
        n = pselect(fd + 1, for_write ? NULL : &s, for_write ? &s : NULL, NULL, &ts, NULL);
    } else {
        struct timeval tv = {.tv_sec = 5};
        n = select(fd + 1, for_write ? NULL : &s, for_write ? &s : NULL, NULL, &tv);
    }
    if (n < 0 && errno == EINTR) return;
    if (n != 1 || !FD_ISSET(fd, &s)) fail("select for %s returned %d", for_write ? "writing" : "reading", n);
}

/* Moves exactly `n` bytes of the pattern at `*off` over non-blocking
 * `fd`, as a select loop does: it reads what select says is readable,
 * and writes until a write would block, then waits for writability. */
static void move_sel(int fd, int out, uint64_t *off, size_t n) {
    unsigned char b[256];
    if (out)
        for (size_t i = 0; i < n; i++) b[i] = pat(*off + i);
    size_t done = 0;
    while (done < n) {
        if (!out) sel_wait(fd, 0);
        ssize_t k = out ? write(fd, b + done, n - done) : read(fd, b + done, n - done);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
            if (out) sel_wait(fd, 1);
            continue;
        }
        if (k <= 0) fail(out ? "write" : "read");
        done += k;
    }
    if (!out)
        for (size_t i = 0; i < n; i++)
            if (b[i] != pat(*off + i)) fail("byte %llu wrong", (unsigned long long)(*off + i));
    *off += n;
}

/* This process on CPU `cpu`, when there is one: the two ends of a
 * request/response loop then run side by side. */
static void pin(int cpu) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) || CPU_COUNT(&set) < 2) return;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* The peer's half of a request/response loop: a 64-byte request, then
 * the 64-byte answer, `rr_n` times, over select. */
static void peer_rr(int fd) {
    pin(0);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    for (long i = 0; i < rr_n; i++) {
        move_sel(fd, 1, &sent_off, 64);
        move_sel(fd, 0, &read_off, 64);
    }
    fcntl(fd, F_SETFL, 0);
    fprintf(stderr, "peer: %ld selects for %ld round trips\n", selects, rr_n);
}

static void peer_write(int fd, size_t n) {
    unsigned char b[4096];
    while (n) {
        size_t k = n < sizeof b ? n : sizeof b;
        for (size_t i = 0; i < k; i++) b[i] = pat(sent_off + i);
        ssize_t r = write(fd, b, k);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fail("peer write");
        sent_off += r;
        n -= r;
    }
}

static void peer(int fd, int cmd_r, int ack_w) {
    for (;;) {
        char c;
        ssize_t r = read(cmd_r, &c, 1);
        if (r < 0 && errno == EINTR) continue;
        if (r != 1) exit(0);
        if (c == 'w') peer_write(fd, 10);
        else if (c == 'B') { for (int i = 0; i < 1000; i++) peer_write(fd, 100); }
        else if (c == 'r') {
            unsigned char b[4096];
            ssize_t k = read(fd, b, sizeof b);
            if (k <= 0) fail("peer read");
        }
        else if (c == 's') { if (shutdown(fd, SHUT_WR)) fail("peer shutdown"); }
        else if (c == 'S') {
            /* Stream small messages for a second. */
            double end = now_ms() + 1000;
            while (now_ms() < end) peer_write(fd, 64);
        }
        else if (c == 'P') peer_rr(fd);
        else if (c == 'q') exit(0);
        if (write(ack_w, "k", 1) != 1) fail("ack");
    }
}

/* ---- the checking side ------------------------------------------------- */

static void tell(char c) {
    if (write(cmd_w, &c, 1) != 1) fail("command");
    char k;
    if (read(ack_r, &k, 1) != 1) fail("no ack for %c", c);
}

static int wait1(int ep, struct epoll_event *ev, int timeout) {
    int n;
    do n = epoll_wait(ep, ev, 8, timeout); while (n < 0 && errno == EINTR);
    if (n < 0) fail("epoll_wait");
    return n;
}

static void expect(int ep, int fd, uint32_t events, int timeout) {
    struct epoll_event ev[8];
    int n = wait1(ep, ev, timeout);
    if (n != 1) fail("epoll_wait returned %d events, expected 1", n);
    if (ev[0].data.fd != fd) fail("event for data %d, expected %d", ev[0].data.fd, fd);
    if (ev[0].events != events) fail("events %#x, expected %#x", ev[0].events, events);
}

/* Nothing within `ms`, and the wait lasted about `ms`. */
static void expect_none(int ep, int ms) {
    struct epoll_event ev[8];
    double t0 = now_ms();
    int n = wait1(ep, ev, ms);
    double dt = now_ms() - t0;
    if (n != 0) fail("epoll_wait returned %d events (%#x), expected none", n, ev[0].events);
    if (dt < ms - 1 || dt > ms + 900) fail("a %d ms wait took %.1f ms", ms, dt);
}

static void read_pattern(int fd, size_t n) {
    unsigned char b[4096];
    while (n) {
        ssize_t k = read(fd, b, n < sizeof b ? n : sizeof b);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("read");
        for (ssize_t i = 0; i < k; i++)
            if (b[i] != pat(read_off + i)) fail("byte %llu wrong", (unsigned long long)(read_off + i));
        read_off += k;
        n -= k;
    }
}

static int add(int ep, int fd, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.fd = fd};
    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

static void mod(int ep, int fd, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.fd = fd};
    if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev)) fail("EPOLL_CTL_MOD");
}

static void check_lt(int fd, int ep) {
    if (add(ep, fd, EPOLLIN)) fail("add");
    expect_none(ep, 100);
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    expect(ep, fd, EPOLLIN, 0);
    read_pattern(fd, 4);
    expect(ep, fd, EPOLLIN, 2000);
    read_pattern(fd, 6);
    expect_none(ep, 100);
    /* The same registration twice is refused; DEL then ADD works. */
    if (add(ep, fd, EPOLLIN) == 0 || errno != EEXIST) fail("a second ADD was not EEXIST");
    if (epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL)) fail("DEL");
    tell('w');
    expect_none(ep, 100);
    /* No event: EFAULT, and nothing registered. */
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, NULL) == 0 || errno != EFAULT) fail("ADD without an event was not EFAULT");
    if (add(ep, fd, EPOLLIN)) fail("add after DEL");
    expect(ep, fd, EPOLLIN, 2000);
    read_pattern(fd, 10);
}

static void check_et(int fd, int ep) {
    if (add(ep, fd, EPOLLIN | EPOLLET)) fail("add");
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    /* Unread data, no new edge. */
    expect_none(ep, 100);
    read_pattern(fd, 5);
    expect_none(ep, 100);
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    read_pattern(fd, 15);
    expect_none(ep, 100);
}

static void check_oneshot(int fd, int ep) {
    if (add(ep, fd, EPOLLIN | EPOLLONESHOT)) fail("add");
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    tell('w');
    expect_none(ep, 100);
    mod(ep, fd, EPOLLIN | EPOLLONESHOT);
    expect(ep, fd, EPOLLIN, 2000);
    expect_none(ep, 100);
    read_pattern(fd, 20);
}

static void check_rdhup(int fd, int ep) {
    if (add(ep, fd, EPOLLIN | EPOLLRDHUP)) fail("add");
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    read_pattern(fd, 10);
    tell('s');
    struct epoll_event ev[8];
    int n = wait1(ep, ev, 2000);
    if (n != 1 || !(ev[0].events & EPOLLIN) || !(ev[0].events & EPOLLRDHUP))
        fail("after the peer's SHUT_WR: %d events %#x", n, n > 0 ? ev[0].events : 0);
    char c;
    if (read(fd, &c, 1) != 0) fail("no end of stream");
}

static void check_out(int fd, int ep) {
    tell('w');
    if (add(ep, fd, EPOLLOUT)) fail("add");
    /* Readable too, but only EPOLLOUT was asked for. */
    expect(ep, fd, EPOLLOUT, 2000);
    read_pattern(fd, 10);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    unsigned char b[4096];
    memset(b, 1, sizeof b);
    size_t total = 0;
    for (;;) {
        ssize_t k = write(fd, b, sizeof b);
        if (k < 0 && errno == EAGAIN) break;
        if (k <= 0) fail("write");
        total += k;
        if (total > (1u << 30)) fail("the ring never filled");
    }
    expect_none(ep, 100);
    tell('r');
    expect(ep, fd, EPOLLOUT, 2000);
    printf("filled %zu bytes\n", total);
}

static int ev_fd, pipe_w;

static void *poke(void *arg) {
    (void)arg;
    usleep(100 * 1000);
    uint64_t one = 1;
    if (write(ev_fd, &one, 8) != 8) fail("eventfd write");
    usleep(50 * 1000);
    if (write(pipe_w, "x", 1) != 1) fail("pipe write");
    return NULL;
}

/* A busy connection must not starve the set's other descriptors. */
static void check_mixed(int fd, int ep) {
    int pp[2];
    if (pipe(pp)) fail("pipe");
    pipe_w = pp[1];
    ev_fd = eventfd(0, EFD_NONBLOCK);
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct itimerspec its = {.it_value = {.tv_nsec = 50 * 1000 * 1000}};
    if (add(ep, fd, EPOLLIN) || add(ep, pp[0], EPOLLIN) || add(ep, ev_fd, EPOLLIN) || add(ep, tfd, EPOLLIN))
        fail("add");
    if (write(cmd_w, "S", 1) != 1) fail("command");
    double t0 = now_ms();
    if (timerfd_settime(tfd, 0, &its, NULL)) fail("timerfd_settime");
    pthread_t th;
    pthread_create(&th, NULL, poke, NULL);
    double seen_t = 0, seen_e = 0, seen_p = 0;
    uint64_t conn_events = 0;
    while (!(seen_t && seen_e && seen_p)) {
        struct epoll_event ev[8];
        int n = wait1(ep, ev, 3000);
        if (n == 0) fail("nothing for 3 s");
        for (int i = 0; i < n; i++) {
            int x = ev[i].data.fd;
            uint64_t v;
            if (x == fd) {
                unsigned char b[4096];
                ssize_t k = read(fd, b, sizeof b);
                if (k <= 0) fail("read");
                for (ssize_t j = 0; j < k; j++)
                    if (b[j] != pat(read_off + j)) fail("byte wrong");
                read_off += k;
                conn_events++;
            } else if (x == tfd) {
                if (read(tfd, &v, 8) == 8 && !seen_t) seen_t = now_ms() - t0;
            } else if (x == ev_fd) {
                if (read(ev_fd, &v, 8) == 8 && !seen_e) seen_e = now_ms() - t0;
            } else if (x == pp[0]) {
                char c;
                if (read(pp[0], &c, 1) == 1 && !seen_p) seen_p = now_ms() - t0;
            }
        }
    }
    pthread_join(th, NULL);
    printf("timerfd %.1f ms (due 50), eventfd %.1f ms (due 100), pipe %.1f ms (due 150), %llu connection events\n",
           seen_t, seen_e, seen_p, (unsigned long long)conn_events);
    if (seen_t < 49 || seen_t > 50 + 100) fail("timerfd reported at %.1f ms", seen_t);
    if (seen_e < 99 || seen_e > 100 + 100) fail("eventfd reported at %.1f ms", seen_e);
    if (seen_p < 149 || seen_p > 150 + 100) fail("pipe reported at %.1f ms", seen_p);
    /* Drain the rest of the stream until the peer's ack. */
    fcntl(fd, F_SETFL, O_NONBLOCK);
    fcntl(ack_r, F_SETFL, O_NONBLOCK);
    for (;;) {
        unsigned char b[4096];
        ssize_t r = read(fd, b, sizeof b);
        if (r > 0) read_off += r;
        char k;
        if (read(ack_r, &k, 1) == 1) break;
    }
    fcntl(ack_r, F_SETFL, 0);
    for (;;) {
        unsigned char b[4096];
        ssize_t r = read(fd, b, sizeof b);
        if (r <= 0) break;
        read_off += r;
    }
}

static volatile sig_atomic_t got_usr1;
static void on_usr1(int s) { (void)s; got_usr1 = 1; }

static void *send_usr1(void *arg) {
    usleep(100 * 1000);
    kill(getpid(), SIGUSR1);
    return arg;
}

/* epoll_pwait's mask lets SIGUSR1 in (blocked otherwise): EINTR. */
static void check_sigmask(int fd, int ep) {
    struct sigaction sa = {.sa_handler = on_usr1};
    sigaction(SIGUSR1, &sa, NULL);
    sigset_t block, during;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &block, &during);
    sigdelset(&during, SIGUSR1);
    if (add(ep, fd, EPOLLIN)) fail("add");
    pthread_t th;
    pthread_create(&th, NULL, send_usr1, NULL);
    struct epoll_event ev[8];
    double t0 = now_ms();
    int n = epoll_pwait(ep, ev, 8, 5000, &during);
    double dt = now_ms() - t0;
    pthread_join(th, NULL);
    if (n != -1 || errno != EINTR) fail("epoll_pwait returned %d, expected EINTR", n);
    if (!got_usr1) fail("the handler did not run");
    if (dt > 2000) fail("EINTR after %.1f ms", dt);
    /* Without a signal, data still wakes it. */
    tell('w');
    n = epoll_pwait(ep, ev, 8, 2000, &during);
    if (n != 1 || ev[0].events != EPOLLIN) fail("epoll_pwait after data: %d", n);
    read_pattern(fd, 10);
}

static int th_ep, th_fd;
static pthread_mutex_t th_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t th_events[2];

static void *loop_thread(void *arg) {
    int me = (int)(intptr_t)arg;
    double idle_since = now_ms();
    for (;;) {
        struct epoll_event ev[8];
        int n = epoll_wait(th_ep, ev, 8, 100);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("thread %d: epoll_wait", me);
        pthread_mutex_lock(&th_mu);
        int finished = read_off >= 100000;
        pthread_mutex_unlock(&th_mu);
        if (finished) return NULL;
        if (n == 0) {
            if (now_ms() - idle_since > 3000) fail("thread %d: nothing for 3 s", me);
            continue;
        }
        idle_since = now_ms();
        pthread_mutex_lock(&th_mu);
        int done = read_off >= 100000;
        if (!done) {
            unsigned char b[4096];
            ssize_t k = read(th_fd, b, sizeof b);
            if (k > 0) {
                for (ssize_t j = 0; j < k; j++)
                    if (b[j] != pat(read_off + j)) fail("byte wrong");
                read_off += k;
            } else if (!(k < 0 && errno == EAGAIN)) fail("read");
            done = read_off >= 100000;
            th_events[me]++;
        }
        pthread_mutex_unlock(&th_mu);
        mod(th_ep, th_fd, EPOLLIN | EPOLLONESHOT);
        if (done) return NULL;
    }
}

/* Two threads on one set, one-shot: each event goes to one of them. */
static void check_threads(int fd, int ep) {
    fcntl(fd, F_SETFL, O_NONBLOCK);
    th_ep = ep;
    th_fd = fd;
    if (add(ep, fd, EPOLLIN | EPOLLONESHOT)) fail("add");
    pthread_t a, b;
    pthread_create(&a, NULL, loop_thread, (void *)0);
    pthread_create(&b, NULL, loop_thread, (void *)1);
    tell('B');
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    printf("thread events %llu and %llu\n", (unsigned long long)th_events[0], (unsigned long long)th_events[1]);
}

/* A set inherited across fork: the child waits on it and reads. */
static void check_fork(int fd, int ep) {
    if (add(ep, fd, EPOLLIN)) fail("add");
    expect_none(ep, 50);
    pid_t c = fork();
    if (c == 0) {
        mode = "fork-child";
        expect_none(ep, 50);
        tell('w');
        expect(ep, fd, EPOLLIN, 2000);
        read_pattern(fd, 10);
        exit(0);
    }
    int st;
    if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the fork child failed");
    read_off += 10;
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    read_pattern(fd, 10);
}

/* poll(2) on the connection, LT, with a timeout. */
static void check_poll(int fd, int ep) {
    (void)ep;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    double t0 = now_ms();
    if (poll(&p, 1, 100) != 0) fail("poll with nothing to read");
    if (now_ms() - t0 < 99) fail("poll returned early");
    tell('w');
    if (poll(&p, 1, 2000) != 1 || p.revents != POLLIN) fail("poll: revents %#x", p.revents);
    read_pattern(fd, 4);
    if (poll(&p, 1, 0) != 1 || p.revents != POLLIN) fail("poll after a partial read: %#x", p.revents);
    read_pattern(fd, 6);
}

static int ex_fd, ex_got[2];
static int ex_ep[2];

static void *ex_wait(void *arg) {
    int me = (int)(intptr_t)arg;
    struct epoll_event ev[8];
    int n;
    do n = epoll_wait(ex_ep[me], ev, 8, 1500); while (n < 0 && errno == EINTR);
    if (n < 0) fail("thread %d: epoll_wait", me);
    if (n == 1 && (ev[0].data.fd != ex_fd || ev[0].events != EPOLLIN)) fail("thread %d: event %#x", me, ev[0].events);
    ex_got[me] = n;
    return NULL;
}

/* EPOLLEXCLUSIVE on the connection in two sets, as the kernel has it:
 * accepted with ADD, refused (EINVAL) in a MOD and with EPOLLONESHOT; a
 * wake-up reaches at least one of two threads sleeping on the sets. */
static void check_exclusive(int fd, int ep) {
    int ep2 = epoll_create1(EPOLL_CLOEXEC), ep3 = epoll_create1(EPOLL_CLOEXEC);
    if (add(ep, fd, EPOLLIN | EPOLLEXCLUSIVE)) fail("ADD with EPOLLEXCLUSIVE");
    if (add(ep2, fd, EPOLLIN | EPOLLEXCLUSIVE)) fail("ADD with EPOLLEXCLUSIVE to a second set");
    if (add(ep3, fd, EPOLLIN | EPOLLEXCLUSIVE | EPOLLONESHOT) != -1 || errno != EINVAL)
        fail("ADD with EPOLLEXCLUSIVE | EPOLLONESHOT was not EINVAL");
    struct epoll_event e = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e) != -1 || errno != EINVAL)
        fail("MOD of an EPOLLEXCLUSIVE registration was not EINVAL");
    e.events = EPOLLIN | EPOLLEXCLUSIVE;
    if (epoll_ctl(ep2, EPOLL_CTL_MOD, fd, &e) != -1 || errno != EINVAL)
        fail("MOD with EPOLLEXCLUSIVE was not EINVAL");
    expect_none(ep, 100);
    tell('w');
    expect(ep, fd, EPOLLIN, 2000);
    expect(ep2, fd, EPOLLIN, 2000);
    read_pattern(fd, 10);
    /* Two threads asleep, one per set: the data wakes at least one. */
    ex_fd = fd;
    ex_ep[0] = ep;
    ex_ep[1] = ep2;
    pthread_t a, b;
    pthread_create(&a, NULL, ex_wait, (void *)0);
    pthread_create(&b, NULL, ex_wait, (void *)1);
    usleep(200 * 1000);
    tell('w');
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    printf("woken: set 1 %d, set 2 %d\n", ex_got[0], ex_got[1]);
    if (!ex_got[0] && !ex_got[1]) fail("no set woken");
    read_pattern(fd, 10);
    if (epoll_ctl(ep2, EPOLL_CTL_DEL, fd, NULL)) fail("DEL of an EPOLLEXCLUSIVE registration");
    close(ep3);
    close(ep2);
}

/* The answering half of the select request/response loop. */
static void check_select_rr(int fd, int ep) {
    (void)ep;
    if (write(cmd_w, "P", 1) != 1) fail("command");
    pin(1);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    for (long i = 0; i < rr_n; i++) {
        move_sel(fd, 0, &read_off, 64);
        move_sel(fd, 1, &sent_off, 64);
    }
    fcntl(fd, F_SETFL, 0);
    char k;
    if (read(ack_r, &k, 1) != 1) fail("no ack for the loop");
    printf("%ld selects for %ld round trips\n", selects, rr_n);
}

static volatile sig_atomic_t got_alrm;
static void on_alrm(int s) { (void)s; got_alrm = 1; }

/* select(2)'s semantics over the connection: exact timeouts and the time
 * left written back, level-triggered readability, writability, a set
 * mixed with a pipe, EINVAL and EBADF, a ring whose writer skipped the
 * doorbell for an epoll session, EINTR, and pselect's mask. */
static void check_select(int fd, int ep) {
    fd_set r, w;
    struct timeval tv = {.tv_usec = 100 * 1000};
    FD_ZERO(&r);
    FD_SET(fd, &r);
    double t0 = now_ms();
    int n = select(fd + 1, &r, NULL, NULL, &tv);
    double dt = now_ms() - t0;
    if (n != 0 || FD_ISSET(fd, &r)) fail("select with nothing to read: %d", n);
    if (dt < 99 || dt > 1000) fail("a 100 ms select took %.1f ms", dt);
    if (tv.tv_sec || tv.tv_usec) fail("select left %ld.%06ld s after its timeout", (long)tv.tv_sec, (long)tv.tv_usec);

    FD_ZERO(&w);
    FD_SET(fd, &w);
    tv = (struct timeval){.tv_sec = 2};
    if (select(fd + 1, NULL, &w, NULL, &tv) != 1 || !FD_ISSET(fd, &w)) fail("not writable");

    tell('w');
    FD_ZERO(&r);
    FD_SET(fd, &r);
    tv = (struct timeval){.tv_sec = 2};
    n = select(fd + 1, &r, NULL, NULL, &tv);
    if (n != 1 || !FD_ISSET(fd, &r)) fail("select after data: %d", n);
    if (tv.tv_sec != 1 || tv.tv_usec < 500000) fail("2 s select left %ld.%06ld s", (long)tv.tv_sec, (long)tv.tv_usec);
    read_pattern(fd, 4);
    FD_ZERO(&r);
    FD_SET(fd, &r);
    FD_ZERO(&w);
    FD_SET(fd, &w);
    tv = (struct timeval){0};
    n = select(fd + 1, &r, &w, NULL, &tv);
    if (n != 2 || !FD_ISSET(fd, &r) || !FD_ISSET(fd, &w)) fail("after a partial read: %d", n);
    read_pattern(fd, 6);

    /* A pipe beside the connection: only the pipe is ready. */
    int pp[2];
    if (pipe(pp)) fail("pipe");
    if (write(pp[1], "x", 1) != 1) fail("pipe write");
    int hi = (pp[0] > fd ? pp[0] : fd) + 1;
    FD_ZERO(&r);
    FD_SET(fd, &r);
    FD_SET(pp[0], &r);
    tv = (struct timeval){.tv_sec = 2};
    n = select(hi, &r, NULL, NULL, &tv);
    if (n != 1 || !FD_ISSET(pp[0], &r) || FD_ISSET(fd, &r)) fail("select with a ready pipe: %d", n);

    /* A hung-up pipe in the except set only: poll would report POLLHUP,
     * select keeps waiting (the timeout, then nothing set). */
    int hp[2];
    if (pipe(hp)) fail("pipe");
    close(hp[1]);
    fd_set x;
    FD_ZERO(&r);
    FD_SET(fd, &r);
    FD_ZERO(&x);
    FD_SET(hp[0], &x);
    tv = (struct timeval){.tv_usec = 100 * 1000};
    t0 = now_ms();
    n = select((hp[0] > fd ? hp[0] : fd) + 1, &r, NULL, &x, &tv);
    dt = now_ms() - t0;
    if (n != 0 || FD_ISSET(hp[0], &x) || FD_ISSET(fd, &r)) fail("select over a hung-up pipe's except bit: %d", n);
    if (dt < 99 || dt > 1000) fail("a 100 ms select over a hung-up pipe took %.1f ms", dt);
    close(hp[0]);

    /* The kernel's errors. */
    if (select(-1, &r, NULL, NULL, &tv) != -1 || errno != EINVAL) fail("select with nfds -1");
    close(pp[1]);
    hi = (pp[1] > hi - 1 ? pp[1] : hi - 1) + 1;
    FD_ZERO(&r);
    FD_SET(fd, &r);
    FD_SET(pp[1], &r);
    tv = (struct timeval){.tv_sec = 2};
    if (select(hi, &r, NULL, NULL, &tv) != -1 || errno != EBADF) fail("select with a closed descriptor");
    close(pp[0]);

    /* An epoll session lets the peer skip its doorbell; select must see
     * the ring all the same. */
    if (add(ep, fd, EPOLLIN)) fail("add");
    struct epoll_event ev[8];
    if (epoll_wait(ep, ev, 8, 0) != 0) fail("epoll_wait with nothing to read");
    tell('w');
    FD_ZERO(&r);
    FD_SET(fd, &r);
    tv = (struct timeval){.tv_sec = 2};
    t0 = now_ms();
    n = select(fd + 1, &r, NULL, NULL, &tv);
    if (n != 1 || !FD_ISSET(fd, &r)) fail("select after a skipped doorbell: %d after %.1f ms", n, now_ms() - t0);
    read_pattern(fd, 10);

    /* A signal handler ends select with EINTR; the time left is written. */
    struct sigaction sa = {.sa_handler = on_alrm};
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {.it_value = {.tv_usec = 100 * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
    FD_ZERO(&r);
    FD_SET(fd, &r);
    tv = (struct timeval){.tv_sec = 5};
    t0 = now_ms();
    n = select(fd + 1, &r, NULL, NULL, &tv);
    dt = now_ms() - t0;
    if (n != -1 || errno != EINTR || !got_alrm) fail("select under SIGALRM returned %d", n);
    if (dt > 2000) fail("EINTR after %.1f ms", dt);
    if (tv.tv_sec < 3 || tv.tv_sec > 4) fail("interrupted select left %ld.%06ld s", (long)tv.tv_sec, (long)tv.tv_usec);

    /* pselect's mask lets SIGUSR1 in (blocked otherwise): EINTR. */
    struct sigaction su = {.sa_handler = on_usr1};
    sigaction(SIGUSR1, &su, NULL);
    sigset_t block, during;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &block, &during);
    sigdelset(&during, SIGUSR1);
    pthread_t th;
    pthread_create(&th, NULL, send_usr1, NULL);
    FD_ZERO(&r);
    FD_SET(fd, &r);
    struct timespec ts = {.tv_sec = 5};
    t0 = now_ms();
    n = pselect(fd + 1, &r, NULL, NULL, &ts, &during);
    dt = now_ms() - t0;
    pthread_join(th, NULL);
    if (n != -1 || errno != EINTR || !got_usr1) fail("pselect returned %d, expected EINTR", n);
    if (dt > 2000) fail("EINTR after %.1f ms", dt);
    tell('w');
    FD_ZERO(&r);
    FD_SET(fd, &r);
    if (pselect(fd + 1, &r, NULL, NULL, &ts, &during) != 1 || !FD_ISSET(fd, &r)) fail("pselect after data");
    read_pattern(fd, 10);
}

/* Forks the server of a connection: another process, as a connect to a
 * listener of its own process stays TCP. It listens on a loopback port,
 * which `a` receives, runs `run` on its listener and exits. */
static pid_t fork_server(const char *name, void (*run)(int lfd), struct sockaddr_in *a) {
    int ready[2];
    if (pipe(ready)) fail("pipe");
    pid_t c = fork();
    if (c == 0) {
        mode = name;
        struct sockaddr_in l = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t ll = sizeof l;
        int lfd = socket(AF_INET, SOCK_STREAM, 0);
        if (bind(lfd, (struct sockaddr *)&l, sizeof l) || listen(lfd, 4) || getsockname(lfd, (struct sockaddr *)&l, &ll))
            fail("listen");
        if (write(ready[1], &l, sizeof l) != sizeof l) fail("port");
        run(lfd);
        exit(0);
    }
    if (read(ready[0], a, sizeof *a) != sizeof *a) fail("no port");
    close(ready[0]);
    close(ready[1]);
    return c;
}

/* Accepts one connection, reads ten bytes first if `echo`, writes ten and
 * waits for the end of the stream. */
static void serve(int lfd, int echo) {
    int s = accept(lfd, NULL, NULL);
    if (s < 0) fail("accept");
    if (echo) read_pattern(s, 10);
    peer_write(s, 10);
    char b;
    if (read(s, &b, 1) != 0) fail("no end of file");
}

/* Accepts after 300 ms, then answers ten bytes with ten. */
static void serve_late(int lfd) {
    usleep(300 * 1000);
    serve(lfd, 1);
}

/* Waits for the server `c` to succeed, then reports the bytes read. */
static void server_done(pid_t c) {
    int st;
    if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the server failed");
    printf("OK %llu\n", (unsigned long long)read_off);
    exit(0);
}

/* A non-blocking connect whose server accepts only after 300 ms: select
 * reports it writable once, when its handshake has decided, and the write
 * that follows succeeds (a selecting program must not spin on EAGAIN). */
static void check_select_connect(void) {
    struct sockaddr_in a;
    pid_t c = fork_server("select-connect-server", serve_late, &a);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) fail("the connect did not wait for the server");
    if (errno != EINPROGRESS) fail("connect");
    long eagain = 0;
    double t0 = now_ms();
    for (;;) {
        sel_wait(fd, 1);
        int err = 0;
        socklen_t el = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) || err) fail("SO_ERROR %d", err);
        unsigned char b[10];
        for (int i = 0; i < 10; i++) b[i] = pat(sent_off + i);
        ssize_t k = write(fd, b, 10);
        if (k == 10) break;
        if (k < 0 && errno == EAGAIN) {
            if (++eagain > 100) fail("select said writable, write said EAGAIN, %ld times", eagain);
            continue;
        }
        fail("write %zd", k);
    }
    sent_off += 10;
    double dt = now_ms() - t0;
    printf("connected after %.1f ms, %ld selects, %ld EAGAIN\n", dt, selects, eagain);
    if (eagain) fail("write after select failed with EAGAIN %ld times", eagain);
    if (dt < 250) fail("writable after %.1f ms, before the server accepted", dt);
    fcntl(fd, F_SETFL, 0);
    read_pattern(fd, 10);
    close(fd);
    server_done(c);
}

/* Writes ten bytes and waits for the end of the stream. */
static void serve_ten(int lfd) { serve(lfd, 0); }

/* A socket registered in a set before it listened, then closed: the next
 * socket at its number, swapped to SMC-D, is not in that set (a
 * registration recorded for the candidate it was must not move to the
 * next connection there). */
static void check_stale_registration(void) {
    struct sockaddr_in a;
    pid_t c = fork_server("stale-registration-server", serve_ten, &a);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int old = socket(AF_INET, SOCK_STREAM, 0);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 111};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, old, &ev)) fail("epoll_ctl ADD of the first socket");
    struct sockaddr_in any = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(old, (struct sockaddr *)&any, sizeof any) || listen(old, 1)) fail("first listen");
    close(old);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd != old) fail("the new socket is %d, not the closed %d", fd, old);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) fail("connect");
    struct epoll_event mine = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &mine)) fail("the new connection was in the set already");
    expect(ep, fd, EPOLLIN, 5000);
    read_pattern(fd, 10);
    close(fd);
    server_done(c);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: evloop MODE [ROUND-TRIPS]");
    mode = argv[1];
    if (argc > 2) rr_n = atol(argv[2]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "select-connect")) check_select_connect();
    if (!strcmp(mode, "stale-registration")) check_stale_registration();
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 4) || getsockname(lfd, (struct sockaddr *)&a, &al))
        fail("listen");
    int c2p[2], p2c[2];
    if (pipe(c2p) || pipe(p2c)) fail("pipe");
    pid_t child = fork();
    if (child == 0) {
        /* Only the parent's ends: its exit is this side's end of file. */
        close(lfd);
        close(p2c[1]);
        close(c2p[0]);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a)) fail("connect");
        peer(fd, p2c[0], c2p[1]);
        exit(0);
    }
    close(p2c[0]);
    close(c2p[1]);
    cmd_w = p2c[1];
    ack_r = c2p[0];
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) fail("accept");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (!strcmp(mode, "lt")) check_lt(fd, ep);
    else if (!strcmp(mode, "et")) check_et(fd, ep);
    else if (!strcmp(mode, "oneshot")) check_oneshot(fd, ep);
    else if (!strcmp(mode, "rdhup")) check_rdhup(fd, ep);
    else if (!strcmp(mode, "out")) check_out(fd, ep);
    else if (!strcmp(mode, "mixed")) check_mixed(fd, ep);
    else if (!strcmp(mode, "sigmask")) check_sigmask(fd, ep);
    else if (!strcmp(mode, "threads")) check_threads(fd, ep);
    else if (!strcmp(mode, "fork")) check_fork(fd, ep);
    else if (!strcmp(mode, "poll")) check_poll(fd, ep);
    else if (!strcmp(mode, "select-semantics")) check_select(fd, ep);
    else if (!strcmp(mode, "exclusive")) check_exclusive(fd, ep);
    else if (!strcmp(mode, "select") || !strcmp(mode, "pselect")) check_select_rr(fd, ep);
    else fail("unknown mode");
    if (write(cmd_w, "q", 1) != 1) fail("quit");
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the peer failed");
    printf("OK %llu\n", (unsigned long long)read_off);
    return 0;
}
