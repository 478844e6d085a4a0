/* Test peer for the preload library: plain POSIX socket code, as an
 * unmodified program would write it. Usage:
 *   peer server MODE [v6]      listens on an ephemeral port, prints "READY <port>"
 *   peer client MODE PORT [v6]
 *   peer client churn PORT N   N plain connects (socket, connect, close)
 *   peer unixchurn N           N accepts on a UNIX listener the preload did not
 *                              make (as one inherited through exec)
 *   peer smcchurn N            N connections to itself from a fork child:
 *                              connect, accept, 1 byte each way, close
 *   peer execchild             (the program an inetd-style server execs)
 * Exit status 0 and a last line "OK <bytes>" mean success; anything wrong
 * prints "FAIL ..." and exits 1. Every stream carries a known pattern, so
 * each byte is checked. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static int v6 = 0;

static void fill(unsigned char *b, size_t n, uint64_t off) {
    for (size_t i = 0; i < n; i++) b[i] = pat(off + i);
}

static void check(const unsigned char *b, size_t n, uint64_t off) {
    for (size_t i = 0; i < n; i++)
        if (b[i] != pat(off + i)) fail("byte %llu is %u, expected %u", (unsigned long long)(off + i), b[i], pat(off + i));
}

static void write_all(int fd, const unsigned char *b, size_t n) {
    while (n) {
        ssize_t k = write(fd, b, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fail("write");
        b += k;
        n -= k;
    }
}

/* Sends `total` pattern bytes starting at offset `off` in chunks of varying size. */
static void send_pattern(int fd, uint64_t total, uint64_t off) {
    static unsigned char buf[200000];
    uint64_t done = 0;
    size_t sizes[] = {1, 7, 1000, 4096, 65536, 199999, 13};
    int k = 0;
    while (done < total) {
        size_t n = sizes[k++ % 7];
        if (n > total - done) n = total - done;
        fill(buf, n, off + done);
        write_all(fd, buf, n);
        done += n;
    }
}

/* Reads exactly `total` pattern bytes; then, if `eof`, expects end of stream. */
static void recv_pattern(int fd, uint64_t total, uint64_t off, int eof) {
    static __thread unsigned char buf[150001];
    uint64_t done = 0;
    while (done < total) {
        size_t want = sizeof buf;
        if (want > total - done) want = total - done;
        ssize_t k = read(fd, buf, want);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) fail("read at %llu", (unsigned long long)done);
        if (k == 0) fail("early EOF at %llu of %llu", (unsigned long long)done, (unsigned long long)total);
        check(buf, k, off + done);
        done += k;
    }
    if (eof) {
        ssize_t k = read(fd, buf, 1);
        if (k != 0) fail("expected EOF, got %zd", k);
    }
}

static int mk_listener(void) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
    if (fd < 0) fail("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_storage ss;
    socklen_t len;
    memset(&ss, 0, sizeof ss);
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_addr = in6addr_loopback;
        len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        len = sizeof *a;
    }
    if (bind(fd, (struct sockaddr *)&ss, len) < 0) fail("bind");
    if (listen(fd, 64) < 0) fail("listen");
    len = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &len);
    int port = v6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port) : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    printf("READY %d\n", port);
    fflush(stdout);
    return fd;
}

static void fill_addr(struct sockaddr_storage *ss, socklen_t *len, int port) {
    memset(ss, 0, sizeof *ss);
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_addr = in6addr_loopback;
        a->sin6_port = htons(port);
        *len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a->sin_port = htons(port);
        *len = sizeof *a;
    }
}

static int dial(int port) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
    if (fd < 0) fail("socket");
    struct sockaddr_storage ss;
    socklen_t len;
    fill_addr(&ss, &len, port);
    if (connect(fd, (struct sockaddr *)&ss, len) < 0) fail("connect");
    return fd;
}

static int accept1(int lfd) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) fail("accept");
    return fd;
}

static void set_nb(int fd, int on) {
    int fl = fcntl(fd, F_GETFL);
    if (fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK) < 0) fail("F_SETFL");
}

#define BIG (3u << 20)

/* ---- echo: the client sends BIG bytes, the server echoes them back ---- */

/* Blocking echo: read what comes, write it back, until EOF. */
static uint64_t echo_blocking(int fd) {
    static unsigned char buf[100000];
    uint64_t total = 0;
    for (;;) {
        ssize_t k = read(fd, buf, sizeof buf);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) fail("echo read");
        if (k == 0) break;
        check(buf, k, total);
        write_all(fd, buf, k);
        total += k;
    }
    return total;
}

/* Client side of an echo: a writer thread and the reader (this thread), so
 * a ring smaller than BIG never deadlocks. */
struct wr { int fd; uint64_t n; int shut; };
static void *writer(void *p) {
    struct wr *w = p;
    send_pattern(w->fd, w->n, 0);
    if (w->shut && shutdown(w->fd, SHUT_WR) < 0) fail("shutdown");
    return NULL;
}

static void echo_client(int fd, uint64_t n) {
    struct wr w = {fd, n, 1};
    pthread_t t;
    pthread_create(&t, NULL, writer, &w);
    recv_pattern(fd, n, 0, 1);
    pthread_join(t, NULL);
}

/* ---- poll: non-blocking echo driven by poll(2) ---- */
static uint64_t echo_poll(int fd) {
    static unsigned char buf[300000];
    size_t have = 0, sent = 0;
    uint64_t total = 0;
    int eof = 0;
    set_nb(fd, 1);
    while (!eof || sent < have) {
        struct pollfd p = {fd, 0, 0};
        if (!eof && have < sizeof buf) p.events |= POLLIN;
        if (sent < have) p.events |= POLLOUT;
        if (poll(&p, 1, 10000) <= 0) fail("poll timeout/error");
        if (p.revents & POLLIN) {
            ssize_t k = read(fd, buf + have, sizeof buf - have);
            if (k > 0) { check(buf + have, k, total); total += k; have += k; }
            else if (k == 0) eof = 1;
            else if (errno != EAGAIN) fail("poll read");
        }
        if (sent < have && (p.revents & POLLOUT)) {
            ssize_t k = write(fd, buf + sent, have - sent);
            if (k > 0) sent += k;
            else if (k < 0 && errno != EAGAIN) fail("poll write");
        }
        if (sent == have) sent = have = 0;
        if (!(p.revents & (POLLIN | POLLOUT)) && (p.revents & (POLLERR | POLLHUP)) && !eof) fail("poll revents %x", p.revents);
    }
    return total;
}

/* ---- epoll level-triggered server: accept and echo in one loop ---- */
static uint64_t serve_epoll(int lfd, int et) {
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    static unsigned char buf[300000];
    size_t have = 0, sent = 0;
    uint64_t total = 0;
    int fd = -1, rdhup = 0, eof = 0;
    while (!(eof && sent == have)) {
        struct epoll_event out[4];
        int n = epoll_wait(ep, out, 4, 10000);
        if (n <= 0) fail("epoll_wait timeout/error");
        for (int i = 0; i < n; i++) {
            if (out[i].data.fd == lfd) {
                fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                if (fd < 0) fail("accept4");
                struct epoll_event e2 = {.events = EPOLLIN | EPOLLOUT, .data.fd = fd};
                if (et) e2.events |= EPOLLET | EPOLLONESHOT | EPOLLRDHUP;
                if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e2) < 0) fail("epoll_ctl add");
                continue;
            }
            uint32_t r = out[i].events;
            if (r & EPOLLRDHUP) rdhup = 1;
            /* Edge-triggered: drain until EAGAIN. Level: one step is enough. */
            for (;;) {
                int progress = 0;
                if (!eof && have < sizeof buf) {
                    ssize_t k = read(fd, buf + have, sizeof buf - have);
                    if (k > 0) { check(buf + have, k, total); total += k; have += k; progress = 1; }
                    else if (k == 0) eof = 1;
                    else if (errno != EAGAIN) fail("epoll read");
                }
                if (sent < have) {
                    ssize_t k = write(fd, buf + sent, have - sent);
                    if (k > 0) { sent += k; progress = 1; }
                    else if (k < 0 && errno != EAGAIN) fail("epoll write");
                }
                if (sent == have) sent = have = 0;
                if (!et || !progress || (eof && sent == have)) break;
            }
            if (et) {
                struct epoll_event e2 = {.events = EPOLLIN | EPOLLOUT | EPOLLET | EPOLLONESHOT | EPOLLRDHUP, .data.fd = fd};
                if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e2) < 0) fail("epoll_ctl mod");
            }
        }
    }
    if (et && !rdhup) {
        /* EOF was read in the same drain as the last data: re-arm and ask
         * the (level) state once more. */
        struct epoll_event e2 = {.events = EPOLLIN | EPOLLET | EPOLLONESHOT | EPOLLRDHUP, .data.fd = fd}, o;
        epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e2);
        if (epoll_wait(ep, &o, 1, 2000) == 1 && (o.events & EPOLLRDHUP)) rdhup = 1;
    }
    if (et && !rdhup) fail("no EPOLLRDHUP after the peer's shutdown");
    close(ep);
    close(fd);
    return total;
}

/* ---- two threads on one socket, both directions at once ---- */
static void client_threads(int port) {
    int fd = dial(port);
    echo_client(fd, BIG + 12345);
    close(fd);
}

/* ---- flags and vectors ---- */
static void serve_flags(int lfd) {
    int fd = accept1(lfd);
    unsigned char b[4096], c[4096];
    /* 1. MSG_WAITALL of 3000 bytes that arrive in three writes. */
    ssize_t k = recv(fd, b, 3000, MSG_WAITALL);
    if (k != 3000) fail("MSG_WAITALL got %zd", k);
    check(b, 3000, 0);
    /* 2. MSG_PEEK sees bytes that a later read takes again; FIONREAD counts them. */
    write_all(fd, (const unsigned char *)"1", 1); /* go-ahead */
    int avail = 0;
    for (int i = 0; i < 1000 && avail < 100; i++) { ioctl(fd, FIONREAD, &avail); if (avail < 100) usleep(1000); }
    if (avail != 100) fail("FIONREAD %d, expected 100", avail);
    k = recv(fd, b, 100, MSG_PEEK);
    if (k != 100) fail("MSG_PEEK got %zd", k);
    check(b, 100, 3000);
    ioctl(fd, FIONREAD, &avail);
    if (avail != 100) fail("FIONREAD after peek %d", avail);
    k = read(fd, c, 100);
    if (k != 100 || memcmp(b, c, 100)) fail("read after peek");
    /* 3. readv into three buffers. */
    struct iovec iv[3] = {{b, 10}, {b + 10, 20}, {b + 30, 70}};
    size_t got = 0;
    while (got < 100) {
        struct iovec jv[3];
        memcpy(jv, iv, sizeof jv);
        /* adjust for what we already have */
        size_t skip = got;
        int i = 0;
        while (skip >= jv[i].iov_len) { skip -= jv[i].iov_len; i++; }
        jv[i].iov_base = (char *)jv[i].iov_base + skip;
        jv[i].iov_len -= skip;
        k = readv(fd, jv + i, 3 - i);
        if (k <= 0) fail("readv");
        got += k;
    }
    check(b, 100, 3100);
    /* 4. recvmsg with two iovecs. */
    struct msghdr m;
    memset(&m, 0, sizeof m);
    struct iovec rv[2] = {{b, 50}, {b + 50, 50}};
    m.msg_iov = rv;
    m.msg_iovlen = 2;
    k = recvmsg(fd, &m, MSG_WAITALL);
    if (k != 100) fail("recvmsg got %zd", k);
    check(b, 100, 3200);
    /* 5. MSG_DONTWAIT on an empty ring. Before the answer: the client waits
     * for it, so it cannot have closed yet (after, EOF would be right). */
    k = recv(fd, b, 10, MSG_DONTWAIT);
    if (k != -1 || (errno != EAGAIN && errno != EWOULDBLOCK)) fail("MSG_DONTWAIT on empty: %zd", k);
    /* 6. answer with writev and sendmsg, then sendto with an address (ignored). */
    fill(b, 300, 0);
    struct iovec wv[3] = {{b, 1}, {b + 1, 99}, {b + 100, 100}};
    if (writev(fd, wv, 3) != 200) fail("writev");
    memset(&m, 0, sizeof m);
    struct iovec sv[1] = {{b + 200, 50}};
    m.msg_iov = sv;
    m.msg_iovlen = 1;
    if (sendmsg(fd, &m, MSG_NOSIGNAL) != 50) fail("sendmsg");
    struct sockaddr_in bogus = {.sin_family = AF_INET};
    if (sendto(fd, b + 250, 50, 0, (struct sockaddr *)&bogus, sizeof bogus) != 50) fail("sendto");
    /* 7. getpeername/getsockname/SO_TYPE/SO_ERROR answer like TCP. */
    struct sockaddr_storage ss;
    socklen_t l = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &l) < 0 || ss.ss_family != (v6 ? AF_INET6 : AF_INET)) fail("getpeername");
    int t = 0, e = 1;
    l = sizeof t;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &t, &l) < 0 || t != SOCK_STREAM) fail("SO_TYPE");
    l = sizeof e;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l) < 0 || e != 0) fail("SO_ERROR");
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) fail("TCP_NODELAY");
    recv_pattern(fd, 0, 0, 1);
    close(fd);
}

static void client_flags(int port) {
    int fd = dial(port);
    unsigned char b[4096];
    fill(b, 3300, 0);
    write_all(fd, b, 1000);
    usleep(20000);
    write_all(fd, b + 1000, 1000);
    usleep(20000);
    write_all(fd, b + 2000, 1000);
    unsigned char go;
    if (read(fd, &go, 1) != 1 || go != '1') fail("go-ahead");
    write_all(fd, b + 3000, 100);
    usleep(20000);
    write_all(fd, b + 3100, 100);
    write_all(fd, b + 3200, 100);
    recv_pattern(fd, 300, 0, 0);
    shutdown(fd, SHUT_WR);
    close(fd);
}

/* ---- shutdown(SHUT_WR): half-close, then the server answers ---- */
static void serve_shut(int lfd) {
    int fd = accept1(lfd);
    recv_pattern(fd, 100000, 0, 1);
    send_pattern(fd, 777777, 5);
    close(fd);
}

static void client_shut(int port) {
    int fd = dial(port);
    send_pattern(fd, 100000, 0);
    if (shutdown(fd, SHUT_WR) < 0) fail("shutdown");
    unsigned char b[1];
    if (send(fd, b, 1, MSG_NOSIGNAL) != -1 || errno != EPIPE) fail("send after SHUT_WR should be EPIPE");
    recv_pattern(fd, 777777, 5, 1);
    close(fd);
}

/* ---- SO_LINGER 0: the peer sees a reset ---- */
static void serve_linger(int lfd) {
    int fd = accept1(lfd);
    recv_pattern(fd, 1000, 0, 0);
    struct linger l = {1, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l) < 0) fail("SO_LINGER");
    close(fd);
}

static void client_linger(int port) {
    int fd = dial(port);
    send_pattern(fd, 1000, 0);
    unsigned char b[16];
    ssize_t k = read(fd, b, sizeof b);
    if (!(k < 0 && errno == ECONNRESET)) fail("expected ECONNRESET after SO_LINGER 0, got %zd", k);
    close(fd);
}

/* ---- non-blocking connect, registered with epoll before connect ---- */
static void client_nbconnect(int port) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLOUT, .data.u64 = 42};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0) fail("epoll_ctl");
    struct sockaddr_storage ss;
    socklen_t len;
    fill_addr(&ss, &len, port);
    int r = connect(fd, (struct sockaddr *)&ss, len);
    if (r < 0 && errno != EINPROGRESS) fail("connect");
    struct epoll_event out;
    if (epoll_wait(ep, &out, 1, 5000) != 1 || out.data.u64 != 42 || !(out.events & EPOLLOUT)) fail("EPOLLOUT after connect");
    int e = -1;
    socklen_t l = sizeof e;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l);
    if (e != 0) fail("SO_ERROR %d", e);
    /* The registration must now report readability of the data path. */
    ev.events = EPOLLIN;
    if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev) < 0) fail("epoll_ctl mod");
    unsigned char b[100];
    fill(b, 100, 0);
    if (write(fd, b, 100) != 100) fail("nb write");
    uint64_t got = 0;
    while (got < 100) {
        if (epoll_wait(ep, &out, 1, 5000) != 1 || out.data.u64 != 42) fail("EPOLLIN");
        ssize_t k = read(fd, b, sizeof b - got);
        if (k < 0 && errno == EAGAIN) continue;
        if (k <= 0) fail("nb read");
        check(b, k, got);
        got += k;
    }
    shutdown(fd, SHUT_WR);
    set_nb(fd, 0);
    recv_pattern(fd, 0, 0, 1);
    close(fd);
    close(ep);
}

/* ---- non-blocking connect to a server that accepts 2 s late: connect
 * must not wait for the server's accept. Prints how long it took. ---- */
static void client_lateaccept(int port) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_storage ss;
    socklen_t len;
    fill_addr(&ss, &len, port);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int r = connect(fd, (struct sockaddr *)&ss, len);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (r < 0 && errno != EINPROGRESS) fail("connect");
    printf("CONNECT_MS %.3f\n", (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
    fflush(stdout);
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (poll(&p, 1, 5000) != 1) fail("POLLOUT after connect");
    int e = -1;
    socklen_t l = sizeof e;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l);
    if (e != 0) fail("SO_ERROR %d", e);
    set_nb(fd, 0);
    echo_client(fd, BIG);
    close(fd);
}

/* ---- non-blocking connect to a server that accepts 300 ms late: connect
 * returns at once and the handshake goes on, driven by what the client
 * does next (how): "epoll" or "poll" for writability, "write" at once
 * without polling (EAGAIN until connected, then 100 bytes), "blockwrite"
 * (blocking writes after clearing O_NONBLOCK). Returns the bytes echoed. */
static uint64_t client_late(int port, const char *how) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_storage ss;
    socklen_t len;
    fill_addr(&ss, &len, port);
    int r = connect(fd, (struct sockaddr *)&ss, len);
    if (r < 0 && errno != EINPROGRESS) fail("connect");
    if (!strcmp(how, "write")) {
        unsigned char b[100];
        fill(b, 100, 0);
        ssize_t k;
        int eagain = 0;
        while ((k = write(fd, b, 100)) < 0 && errno == EAGAIN) {
            eagain++;
            usleep(1000);
        }
        if (k != 100) fail("write after EINPROGRESS: %zd", k);
        printf("EAGAIN %d\n", eagain);
        if (shutdown(fd, SHUT_WR) < 0) fail("shutdown");
        set_nb(fd, 0);
        recv_pattern(fd, 100, 0, 1);
        close(fd);
        return 100;
    }
    if (!strcmp(how, "epoll")) {
        int ep = epoll_create1(0);
        struct epoll_event ev = {.events = EPOLLOUT, .data.u64 = 7}, out;
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0) fail("epoll_ctl");
        if (epoll_wait(ep, &out, 1, 5000) != 1 || out.data.u64 != 7 || !(out.events & EPOLLOUT)) fail("EPOLLOUT after connect");
        close(ep);
    } else if (!strcmp(how, "poll")) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        if (poll(&p, 1, 5000) != 1 || !(p.revents & POLLOUT)) fail("POLLOUT after connect");
    } else if (strcmp(how, "blockwrite")) fail("unknown late mode");
    if (strcmp(how, "blockwrite")) {
        int e = -1;
        socklen_t l = sizeof e;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l);
        if (e != 0) fail("SO_ERROR %d", e);
    }
    set_nb(fd, 0);
    echo_client(fd, BIG);
    close(fd);
    return BIG;
}

/* ---- fork: the child talks, the parent closes its copy at once ---- */
static void serve_fork(int lfd) {
    int fd = accept1(lfd);
    pid_t c = fork();
    if (c < 0) fail("fork");
    if (c == 0) {
        close(lfd);
        uint64_t n = echo_blocking(fd);
        printf("CHILD %llu\n", (unsigned long long)n);
        fflush(stdout);
        _exit(0);
    }
    close(fd); /* must not end the child's connection */
    int st;
    waitpid(c, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("child failed");
}

/* ---- exec: inetd style, the socket becomes stdin/stdout of a new program ---- */
/* `form`: which of the variadic exec functions runs the new program. */
static void serve_exec(int lfd, const char *self, const char *form) {
    int fd = accept1(lfd);
    pid_t c = fork();
    if (c == 0) {
        extern char **environ;
        close(lfd);
        dup2(fd, 0);
        dup2(fd, 1);
        close(fd);
        if (!strcmp(form, "execle"))
            execle(self, self, "execchild", (char *)NULL, environ);
        else if (!strcmp(form, "execlp"))
            execlp(self, self, "execchild", (char *)NULL);
        else
            execl(self, self, "execchild", (char *)NULL);
        _exit(127);
    }
    close(fd);
    int st;
    waitpid(c, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("exec child failed (%d)", st);
}

/* The exec'd program: echoes stdin to stdout; every byte it sees must be
 * pattern (never a doorbell). */
static int execchild(void) {
    mode = "execchild";
    static unsigned char buf[65536];
    uint64_t total = 0;
    for (;;) {
        ssize_t k = read(0, buf, sizeof buf);
        if (k <= 0) break;
        check(buf, k, total);
        if (write(1, buf, k) != k) break;
        total += k;
    }
    fprintf(stderr, "execchild echoed %llu\n", (unsigned long long)total);
    return 0;
}

static void client_exec(int port) {
    int fd = dial(port);
    /* Either the whole echo comes back, or a correct prefix and then EOF or
     * ECONNRESET: never a wrong byte. */
    unsigned char b[4096];
    fill(b, 4096, 0);
    /* The server may exec (and reset the connection) before we write: a
     * reset here is the clean fallback too. */
    size_t sent = 0;
    while (sent < sizeof b) {
        ssize_t k = send(fd, b + sent, sizeof b - sent, MSG_NOSIGNAL);
        if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) {
            printf("EXEC reset before writing %zu\n", sent);
            close(fd);
            return;
        }
        if (k <= 0) fail("exec write");
        sent += (size_t)k;
    }
    shutdown(fd, SHUT_WR);
    uint64_t got = 0;
    for (;;) {
        ssize_t k = read(fd, b, sizeof b);
        if (k < 0 && errno == ECONNRESET) { printf("EXEC reset after %llu\n", (unsigned long long)got); break; }
        if (k < 0) fail("exec read");
        if (k == 0) { printf("EXEC eof after %llu\n", (unsigned long long)got); break; }
        check(b, k, got);
        got += k;
    }
    if (got != 0 && got != 4096) fail("partial echo %llu", (unsigned long long)got);
    close(fd);
}

/* ---- an unsupported call fails loudly ---- */
static void client_oob(int port) {
    int fd = dial(port);
    char c = 'x';
    ssize_t k = send(fd, &c, 1, MSG_OOB);
    if (k != -1 || errno != EOPNOTSUPP) fail("MSG_OOB: %zd", k);
    send_pattern(fd, 10, 0);
    close(fd);
}

/* An upper layer protocol (kernel TLS) and a peek offset are refused as
 * the kernel's SMC refuses them: they would act on a socket that carries
 * none of the bytes. */
static void client_ulp(int port) {
    int fd = dial(port);
    int r = setsockopt(fd, IPPROTO_TCP, TCP_ULP, "tls", sizeof "tls");
    if (r != -1 || errno != EOPNOTSUPP) fail("TCP_ULP: %d (%s)", r, strerror(errno));
    int off = 0;
    r = setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof off);
    if (r != -1 || errno != EOPNOTSUPP) fail("SO_PEEK_OFF: %d (%s)", r, strerror(errno));
    send_pattern(fd, 10, 0);
    close(fd);
}

/* The same before the handshake's decision: a non-blocking connect in
 * progress, whose connection may still become SMC-D. */
static void client_ulp_pending(int port) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) fail("socket");
    struct sockaddr_storage ss;
    socklen_t len;
    fill_addr(&ss, &len, port);
    if (connect(fd, (struct sockaddr *)&ss, len) == 0 || errno != EINPROGRESS) fail("connect: not in progress");
    int r = setsockopt(fd, IPPROTO_TCP, TCP_ULP, "tls", sizeof "tls");
    if (r != -1 || errno != EOPNOTSUPP) fail("TCP_ULP: %d (%s)", r, strerror(errno));
    int off = 0;
    r = setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof off);
    if (r != -1 || errno != EOPNOTSUPP) fail("SO_PEEK_OFF: %d (%s)", r, strerror(errno));
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (poll(&p, 1, 10000) != 1) fail("poll: not writable");
    set_nb(fd, 0);
    send_pattern(fd, 10, 0);
    close(fd);
}

/* ---- connection churn to a server that is not smclo: N times socket,
 * connect, close and nothing else, so a tracer can count what the preload
 * adds per connect ---- */
static void client_churn(int port, int n) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) fail("socket: %s", strerror(errno));
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) fail("connect %d: %s", i, strerror(errno));
        close(fd);
    }
}

/* ---- accept churn on a UNIX listener made by a raw system call (the
 * preload knows nothing about it, as about a listener inherited through
 * exec): a forked child connects N times, the parent accepts and closes,
 * so a tracer can count what the preload adds per accept ---- */
static int unix_churn(int n) {
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    int len = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "smclo-unixchurn-%d", (int)getpid()) + 1;
    socklen_t alen = offsetof(struct sockaddr_un, sun_path) + len;
    int lfd = (int)syscall(SYS_socket, AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, alen) != 0 || listen(lfd, 64) != 0)
        fail("unix listener: %s", strerror(errno));
    pid_t child = fork();
    if (child < 0) fail("fork: %s", strerror(errno));
    if (child == 0) {
        for (int i = 0; i < n; i++) {
            int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (fd < 0 || connect(fd, (struct sockaddr *)&a, alen) != 0) _exit(1);
            close(fd);
        }
        _exit(0);
    }
    for (int i = 0; i < n; i++) {
        int c = accept(lfd, NULL, NULL);
        if (c < 0) fail("accept %d: %s", i, strerror(errno));
        close(c);
    }
    int st = 0;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st) != 0) fail("connecting child failed");
    printf("OK 0\n");
    return 0;
}

/* ---- connection setup churn: `smcchurn`, between two processes that both
 * run the preload (the setup benchmark's workload); `plainchurn`, a client
 * that makes raw system calls (the preload it inherited never sees its
 * sockets: it proposes nothing, as a program without smclo), so a tracer
 * can count what the preload adds to a server's plain connection ---- */

/* One echo of connection `i` from the client's side, through libc
 * (`raw` = 0: the preload sees the socket) or raw system calls (the preload
 * never does); nonzero when it failed. */
static int churn_one(const struct sockaddr_in *a, socklen_t alen, int i, int raw) {
    char c = (char)i;
    int fd = raw ? (int)syscall(SYS_socket, AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)
                 : socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 1;
    int ok = raw ? syscall(SYS_connect, fd, (const struct sockaddr *)a, alen) == 0 &&
                       syscall(SYS_write, fd, &c, 1) == 1 && syscall(SYS_read, fd, &c, 1) == 1
                 : connect(fd, (const struct sockaddr *)a, alen) == 0 && write(fd, &c, 1) == 1 &&
                       read(fd, &c, 1) == 1;
    if (raw) syscall(SYS_close, fd); else close(fd);
    return !ok || c != (char)i;
}

/* A listener, and a fork child that connects to it N times, writes a
 * byte and reads it back (`raw`: see churn_one); the parent accepts,
 * echoes and closes, so a tracer can count what a connection costs. */
static int churn(int n, int raw) {
    int lfd = mk_listener();
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    if (getsockname(lfd, (struct sockaddr *)&a, &alen) != 0) fail("getsockname");
    pid_t child = fork();
    if (child < 0) fail("fork: %s", strerror(errno));
    if (child == 0) {
        for (int i = 0; i < n; i++)
            if (churn_one(&a, alen, i, raw)) _exit(1);
        _exit(0);
    }
    for (int i = 0; i < n; i++) {
        int c = accept(lfd, NULL, NULL);
        char b;
        if (c < 0) fail("accept %d: %s", i, strerror(errno));
        if (read(c, &b, 1) != 1 || write(c, &b, 1) != 1) fail("echo %d", i);
        close(c);
    }
    int st = 0;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st) != 0) fail("connecting child failed");
    printf("OK %d\n", 2 * n);
    return 0;
}

/* A listener in this process and a forked child to be its client: the
 * child's pid in the parent, 0 in the child (where `lfd` is closed); `a`
 * and `alen` get the listener's address. */
static pid_t listen_and_fork(int *lfd, struct sockaddr_in *a, socklen_t *alen) {
    *lfd = mk_listener();
    *alen = sizeof *a;
    if (getsockname(*lfd, (struct sockaddr *)a, alen) != 0) fail("getsockname");
    pid_t child = fork();
    if (child < 0) fail("fork: %s", strerror(errno));
    if (child == 0) close(*lfd);
    return child;
}

/* Waits for the client child of listen_and_fork, which must succeed. */
static void wait_client(pid_t child) {
    int st = 0;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st) != 0) fail("client failed");
}

/* Sockets this process holds open (entries of /proc/self/fd). */
static int count_sockets(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) fail("opendir: %s", strerror(errno));
    int n = 0;
    struct dirent *e;
    char path[300], link[64];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(path, link, sizeof link - 1);
        if (k > 0) { link[k] = 0; if (!strncmp(link, "socket:", 7)) n++; }
    }
    closedir(d);
    return n;
}

/* One connection to `a`: a byte there and back, then close. */
static void one_exchange(struct sockaddr_in *a, socklen_t alen, char c) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)a, alen) != 0) _exit(1);
    char b = c;
    if (write(fd, &b, 1) != 1 || read(fd, &b, 1) != 1 || b != c) _exit(2);
    close(fd);
}

/* An ended SMC-D connection's TCP socket is closed at the process's next
 * wait, and never inherited by a fork child: prints the socket counts. */
static int defer_close(void) {
    int lfd;
    struct sockaddr_in a;
    socklen_t alen;
    pid_t child = listen_and_fork(&lfd, &a, &alen);
    if (child == 0) {
        one_exchange(&a, alen, 1); /* makes the rendezvous socket */
        poll(NULL, 0, 1);
        int base = count_sockets();
        one_exchange(&a, alen, 2);
        int after_close = count_sockets();
        poll(NULL, 0, 1);
        int after_wait = count_sockets();
        one_exchange(&a, alen, 3);
        int before_fork = count_sockets();
        int pipefd[2];
        if (pipe(pipefd) != 0) _exit(4);
        pid_t g = fork();
        if (g == 0) {
            int n = count_sockets();
            (void)!write(pipefd[1], &n, sizeof n);
            _exit(0);
        }
        int in_child = -1;
        if (g < 0 || read(pipefd[0], &in_child, sizeof in_child) != sizeof in_child) _exit(5);
        waitpid(g, NULL, 0);
        printf("base %d after_close %d after_wait %d before_fork %d in_child %d\n",
               base, after_close, after_wait, before_fork, in_child);
        fflush(stdout);
        _exit(0);
    }
    for (int i = 0; i < 3; i++) {
        int c = accept(lfd, NULL, NULL);
        char b;
        if (c < 0) fail("accept %d: %s", i, strerror(errno));
        if (read(c, &b, 1) != 1 || write(c, &b, 1) != 1) fail("echo %d", i);
        close(c);
    }
    wait_client(child);
    return 0;
}

/* A connection its server aborts (SO_LINGER 0): the client's close of it
 * closes its TCP socket at once, not at its next wait. Prints the client's
 * socket counts before and after its close. */
static int abort_close(void) {
    int lfd;
    struct sockaddr_in a;
    socklen_t alen;
    pid_t child = listen_and_fork(&lfd, &a, &alen);
    if (child == 0) {
        one_exchange(&a, alen, 1); /* makes the rendezvous socket */
        poll(NULL, 0, 1);
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, alen) != 0) _exit(1);
        char b = 2;
        if (write(fd, &b, 1) != 1) _exit(2);
        ssize_t r = read(fd, &b, 1);
        int e = errno;
        int before = count_sockets();
        close(fd);
        int after = count_sockets();
        printf("read %zd errno %d before_close %d after_close %d\n", r, r < 0 ? e : 0, before, after);
        fflush(stdout);
        _exit(0);
    }
    for (int i = 0; i < 2; i++) {
        int c = accept(lfd, NULL, NULL);
        char b;
        if (c < 0) fail("accept %d: %s", i, strerror(errno));
        if (read(c, &b, 1) != 1) fail("read %d", i);
        if (i == 0) {
            if (write(c, &b, 1) != 1) fail("echo");
        } else {
            struct linger l = {.l_onoff = 1, .l_linger = 0};
            if (setsockopt(c, SOL_SOCKET, SO_LINGER, &l, sizeof l) != 0) fail("SO_LINGER");
        }
        close(c);
    }
    wait_client(child);
    return 0;
}

/* Connections from one fixed source port (SO_REUSEADDR, bind, connect),
 * one after the other, as over TCP on loopback: the port and the 4-tuple
 * of the connection before are free for the next (its TCP socket in
 * TIME_WAIT at most). Prints "fixedport N" with how many connected. */
static int fixed_port(int late) {
    const int n = 3;
    int lfd;
    struct sockaddr_in a;
    socklen_t alen;
    pid_t child = listen_and_fork(&lfd, &a, &alen);
    if (child == 0) {
        struct sockaddr_in src = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int ok = 0;
        for (int i = 0; i < n; i++) {
            int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            int one = 1;
            if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) _exit(1);
            if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0) {
                printf("bind %d: %s\n", i, strerror(errno));
                break;
            }
            socklen_t sl = sizeof src;
            if (getsockname(fd, (struct sockaddr *)&src, &sl) != 0) _exit(3);
            if (connect(fd, (struct sockaddr *)&a, alen) != 0) {
                printf("connect %d: %s\n", i, strerror(errno));
                break;
            }
            char b = (char)i;
            if (write(fd, &b, 1) != 1 || read(fd, &b, 1) != 1 || b != (char)i) _exit(2);
            close(fd);
            ok++;
        }
        printf("fixedport %d\n", ok);
        fflush(stdout);
        _exit(ok == n ? 0 : 4);
    }
    for (int i = 0; i < n; i++) {
        int c = accept(lfd, NULL, NULL);
        char b;
        if (c < 0) break;
        if (read(c, &b, 1) != 1 || write(c, &b, 1) != 1) fail("echo %d", i);
        /* late: the client closes first, and binds again before this end
         * has closed. */
        if (late) usleep(100000);
        close(c);
        if (i + 1 < n) {
            /* The child's next connect may fail: do not wait for it then. */
            struct pollfd p = {.fd = lfd, .events = POLLIN};
            if (poll(&p, 1, 5000) != 1) break;
        }
    }
    wait_client(child);
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 2 && !strcmp(argv[1], "execchild")) return execchild();
    if (argc >= 3 && !strcmp(argv[1], "unixchurn")) return unix_churn(atoi(argv[2]));
    if (argc >= 3 && !strcmp(argv[1], "smcchurn")) return churn(atoi(argv[2]), 0);
    if (argc >= 3 && !strcmp(argv[1], "plainchurn")) return churn(atoi(argv[2]), 1);
    if (argc >= 2 && !strcmp(argv[1], "deferclose")) return defer_close();
    if (argc >= 2 && !strcmp(argv[1], "abortclose")) return abort_close();
    if (argc >= 2 && !strcmp(argv[1], "fixedport")) return fixed_port(0);
    if (argc >= 2 && !strcmp(argv[1], "fixedportlate")) return fixed_port(1);
    if (argc < 3) { fprintf(stderr, "usage\n"); return 2; }
    mode = argv[2];
    int server = !strcmp(argv[1], "server");
    for (int i = 3; i < argc; i++) if (!strcmp(argv[i], "v6")) v6 = 1;
    uint64_t moved = 0;
    if (server) {
        int lfd = mk_listener();
        if (!strcmp(mode, "echo") || !strcmp(mode, "threads")) { int fd = accept1(lfd); moved = echo_blocking(fd); close(fd); }
        else if (!strcmp(mode, "poll")) { int fd = accept1(lfd); moved = echo_poll(fd); close(fd); }
        else if (!strcmp(mode, "epoll")) moved = serve_epoll(lfd, 0);
        else if (!strcmp(mode, "epollet")) moved = serve_epoll(lfd, 1);
        else if (!strcmp(mode, "flags")) serve_flags(lfd);
        else if (!strcmp(mode, "shut")) serve_shut(lfd);
        else if (!strcmp(mode, "linger")) serve_linger(lfd);
        else if (!strcmp(mode, "nbconnect")) { int fd = accept1(lfd); moved = echo_blocking(fd); close(fd); }
        else if (!strcmp(mode, "lateaccept")) { sleep(2); int fd = accept1(lfd); moved = echo_blocking(fd); close(fd); }
        else if (!strncmp(mode, "late", 4)) { usleep(300000); int fd = accept1(lfd); moved = echo_blocking(fd); close(fd); }
        else if (!strcmp(mode, "fork")) serve_fork(lfd);
        else if (!strcmp(mode, "exec")) serve_exec(lfd, argv[0], argc > 3 ? argv[3] : "execl");
        else if (!strcmp(mode, "oob") || !strncmp(mode, "ulp", 3)) { int fd = accept1(lfd); recv_pattern(fd, 10, 0, 1); close(fd); }
        else fail("unknown mode");
        close(lfd);
    } else {
        if (argc < 4) return 2;
        int port = atoi(argv[3]);
        if (!strcmp(mode, "echo") || !strcmp(mode, "poll") || !strcmp(mode, "epoll") || !strcmp(mode, "epollet") || !strcmp(mode, "fork")) {
            int fd = dial(port);
            echo_client(fd, BIG);
            close(fd);
            moved = BIG;
        } else if (!strcmp(mode, "threads")) client_threads(port);
        else if (!strcmp(mode, "flags")) client_flags(port);
        else if (!strcmp(mode, "shut")) client_shut(port);
        else if (!strcmp(mode, "linger")) client_linger(port);
        else if (!strcmp(mode, "nbconnect")) client_nbconnect(port);
        else if (!strcmp(mode, "lateaccept")) { client_lateaccept(port); moved = BIG; }
        else if (!strncmp(mode, "late", 4)) moved = client_late(port, mode + 4);
        else if (!strcmp(mode, "exec")) client_exec(port);
        else if (!strcmp(mode, "oob")) client_oob(port);
        else if (!strcmp(mode, "ulp")) client_ulp(port);
        else if (!strcmp(mode, "ulp-pending")) client_ulp_pending(port);
        else if (!strcmp(mode, "churn")) client_churn(port, argc > 4 ? atoi(argv[4]) : 1);
        else fail("unknown mode");
    }
    printf("OK %llu\n", (unsigned long long)moved);
    return 0;
}
