/* An event-loop server and its clients, for handshakes that go on after
 * accept and connect returned. Usage:
 *   accept_steps server N      non-blocking listener and epoll: greets each
 *                              connection with GREETING pattern bytes, echoes
 *                              what it reads, and exits after N connections
 *                              closed; prints "READY <port>", "ACCEPTED <k>"
 *                              per connection, "MAXACCEPT <us>" (the longest
 *                              accept4 call) and "OK"
 *   accept_steps client PORT   blocking connect, writes PAYLOAD bytes at once,
 *                              reads the greeting and the echo
 *   accept_steps stopper PORT  non-blocking connect, stops itself (SIGSTOP)
 *                              right after it, then as client once continued
 *   accept_steps listen        listens and never accepts: "READY <port>"
 *   accept_steps idle PORT MS  non-blocking connect, then epoll_wait and poll
 *                              for writability for MS ms each while the
 *                              handshake is unanswered: "WAKEUPS <epoll> <poll>"
 *                              (voluntary context switches of each wait)
 *   accept_steps idlemixed LIVE PORT MS
 *                              as idle, epoll only, with a connection to the
 *                              server at LIVE (its greeting read) in the set
 *                              too; then that connection's payload and echo
 * Anything wrong prints "FAIL ..." and exits 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define GREETING 3000
#define PAYLOAD 60000
#define MAXCONN 64

static void fail(const char *what) {
    printf("FAIL [%d] %s (errno %d %s)\n", (int)getpid(), what, errno, strerror(errno));
    fflush(stdout);
    exit(1);
}

static unsigned char pat(uint64_t i) { return (unsigned char)(i * 131 + (i >> 11) + 7); }

static uint64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static int listener(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t n = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 64)) fail("listen");
    if (getsockname(l, (struct sockaddr *)&a, &n)) fail("getsockname");
    printf("READY %d\n", ntohs(a.sin_port));
    fflush(stdout);
    return l;
}

/* One accepted connection: what is left to send (the greeting, then the echo). */
struct conn {
    int fd;
    unsigned char out[GREETING + PAYLOAD];
    size_t head, tail;
};

static struct conn conns[MAXCONN];

static void arm(int ep, struct conn *c) {
    struct epoll_event ev = {.events = EPOLLIN | (c->head < c->tail ? EPOLLOUT : 0), .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev)) fail("epoll_ctl MOD");
}

/* Sends what it can; EAGAIN (a full buffer, or a handshake not decided yet)
 * leaves the rest for EPOLLOUT. */
static void flush_out(int ep, struct conn *c) {
    while (c->head < c->tail) {
        ssize_t k = write(c->fd, c->out + c->head, c->tail - c->head);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == EAGAIN) break;
        if (k <= 0) fail("server write");
        c->head += k;
    }
    arm(ep, c);
}

static void accept_all(int ep, int l, int *accepted, uint64_t *max_us) {
    for (;;) {
        uint64_t t = now_us();
        int fd = accept4(l, NULL, NULL, SOCK_NONBLOCK);
        uint64_t took = now_us() - t;
        if (took > *max_us) *max_us = took;
        if (fd < 0 && (errno == EAGAIN || errno == EINTR)) return;
        if (fd < 0) fail("accept4");
        if (*accepted >= MAXCONN) fail("too many connections");
        struct conn *c = &conns[(*accepted)++];
        c->fd = fd;
        c->head = 0;
        c->tail = GREETING;
        for (size_t i = 0; i < GREETING; i++) c->out[i] = pat(i);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll_ctl ADD");
        printf("ACCEPTED %d\n", *accepted);
        fflush(stdout);
        flush_out(ep, c);
    }
}

/* Echoes what is readable; whether the client closed. */
static int echo(int ep, struct conn *c) {
    for (;;) {
        /* Past the payload, one byte more is read only to see the end. */
        unsigned char extra;
        size_t room = sizeof c->out - c->tail;
        unsigned char *to = room ? c->out + c->tail : &extra;
        ssize_t k = read(c->fd, to, room ? room : 1);
        if (k > 0 && !room) fail("client sent more than the payload");
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == EAGAIN) break;
        if (k < 0) fail("server read");
        if (k == 0) return 1;
        c->tail += k;
    }
    flush_out(ep, c);
    return 0;
}

static void server(int n) {
    int l = listener();
    if (fcntl(l, F_SETFL, O_NONBLOCK)) fail("O_NONBLOCK");
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev)) fail("epoll");
    int accepted = 0, closed = 0;
    uint64_t max_us = 0;
    while (closed < n) {
        struct epoll_event evs[16];
        int k = epoll_wait(ep, evs, 16, 30000);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("epoll_wait (nothing for 30 s)");
        for (int i = 0; i < k; i++) {
            struct conn *c = evs[i].data.ptr;
            if (!c) {
                accept_all(ep, l, &accepted, &max_us);
                continue;
            }
            if (c->fd < 0) continue;
            if (evs[i].events & EPOLLOUT) flush_out(ep, c);
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR) && echo(ep, c)) {
                if (c->head < c->tail) fail("client closed before its echo");
                close(c->fd);
                c->fd = -1;
                closed++;
            }
        }
    }
    printf("MAXACCEPT %llu\nOK\n", (unsigned long long)max_us);
}

static void read_exact(int fd, unsigned char *b, size_t n) {
    while (n) {
        ssize_t k = read(fd, b, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("client read");
        b += k;
        n -= k;
    }
}

/* Writes the payload at once, then reads the greeting and the echo. */
static void talk(int fd) {
    static unsigned char b[PAYLOAD];
    for (size_t i = 0; i < PAYLOAD; i++) b[i] = pat(GREETING + i);
    for (size_t done = 0; done < PAYLOAD;) {
        ssize_t k = write(fd, b + done, PAYLOAD - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("client write");
        done += k;
    }
    static unsigned char got[GREETING + PAYLOAD];
    read_exact(fd, got, sizeof got);
    for (size_t i = 0; i < sizeof got; i++)
        if (got[i] != pat(i)) fail("wrong byte");
    close(fd);
    printf("OK\n");
}

static int connect_nb(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = loopback(port);
    if (fd < 0) fail("socket");
    if (connect(fd, (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS) fail("connect");
    return fd;
}

static void client(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) fail("connect");
    talk(fd);
}

static void stopper(int port) {
    int fd = connect_nb(port);
    raise(SIGSTOP);
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (poll(&p, 1, 30000) != 1) fail("poll for the connect");
    int err = 0;
    socklen_t n = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n) || err) fail("SO_ERROR");
    if (fcntl(fd, F_SETFL, 0)) fail("blocking");
    talk(fd);
}

static long nvcsw(void) {
    struct rusage u;
    if (getrusage(RUSAGE_THREAD, &u)) fail("getrusage");
    return u.ru_nvcsw;
}

static void idle(int port, int ms) {
    int fd = connect_nb(port);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLOUT};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll");
    long before = nvcsw();
    if (epoll_wait(ep, &ev, 1, ms) != 0) fail("epoll_wait reported an undecided connect");
    long by_epoll = nvcsw() - before;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    before = nvcsw();
    if (poll(&p, 1, ms) != 0) fail("poll reported an undecided connect");
    printf("WAKEUPS %ld %ld\n", by_epoll, nvcsw() - before);
}

static void idlemixed(int live_port, int port, int ms) {
    int live = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(live_port);
    if (live < 0 || connect(live, (struct sockaddr *)&a, sizeof a)) fail("connect");
    static unsigned char got[GREETING + PAYLOAD];
    read_exact(live, got, GREETING);
    int fd = connect_nb(port);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLOUT, .data.fd = fd};
    struct epoll_event lev = {.events = EPOLLIN, .data.fd = live};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, live, &lev) || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev))
        fail("epoll");
    long before = nvcsw();
    if (epoll_wait(ep, &ev, 1, ms) != 0) fail("epoll_wait reported an event");
    printf("WAKEUPS %ld\n", nvcsw() - before);
    static unsigned char b[PAYLOAD];
    for (size_t i = 0; i < PAYLOAD; i++) b[i] = pat(GREETING + i);
    for (size_t done = 0; done < PAYLOAD;) {
        ssize_t k = write(live, b + done, PAYLOAD - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("client write");
        done += k;
    }
    read_exact(live, got + GREETING, PAYLOAD);
    for (size_t i = 0; i < sizeof got; i++)
        if (got[i] != pat(i)) fail("wrong byte");
    close(live);
    printf("OK\n");
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 3 && !strcmp(argv[1], "server")) server(atoi(argv[2]));
    else if (argc >= 3 && !strcmp(argv[1], "client")) client(atoi(argv[2]));
    else if (argc >= 3 && !strcmp(argv[1], "stopper")) stopper(atoi(argv[2]));
    else if (argc >= 2 && !strcmp(argv[1], "listen")) {
        listener();
        pause();
    } else if (argc >= 4 && !strcmp(argv[1], "idle")) idle(atoi(argv[2]), atoi(argv[3]));
    else if (argc >= 5 && !strcmp(argv[1], "idlemixed"))
        idlemixed(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
    else {
        fprintf(stderr, "usage: see the source\n");
        return 2;
    }
    return 0;
}
