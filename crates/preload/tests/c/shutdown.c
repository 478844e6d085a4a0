/* shutdown(2) on a connection as TCP's: it wakes the calls other threads
 * are blocked in, and reading after it returns what is queued, over one
 * connection between two processes under the preload (the same program
 * over plain TCP passes too). Usage: shutdown MODE. The peer keeps the
 * connection open and idle for 3 s after its part, so a wait that only
 * the peer's close ends fails. "OK <bytes read>" and status 0 mean every
 * check held. Modes:
 *   recv-rdwr, poll-rdwr, epoll-rdwr, send-rdwr  a thread blocks in that
 *       call (send: the peer does not read, the ring is full); the main
 *       thread shuts the connection down (SHUT_RDWR) 200 ms later: recv
 *       returns 0, poll POLLIN|POLLHUP, epoll_wait EPOLLIN|EPOLLRDHUP|
 *       EPOLLHUP, send EPIPE, each within a second
 *   epoll-et-rdwr  the same for an edge-triggered epoll_wait whose last
 *               edge (a byte from the peer) was reported and read
 *   rd-peer-writes  SHUT_RD, then the peer writes: the read returns its
 *               bytes, as TCP's, and the answer written after reaches it
 *   queued-rd   SHUT_RD with 6 bytes queued: recv returns them, then 0 at
 *               once
 *   hup         SHUT_WR here, then the peer closes: poll and epoll report
 *               the hang-up (POLLHUP) beside POLLIN
 *   closed-write  the peer closes without reading: the first write still
 *               succeeds (TCP sends it, the peer answers with a reset),
 *               then poll reports POLLERR|POLLHUP, a read 0 and the next
 *               write EPIPE */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

static int conn;
static long result;
static double ended_at;

static void *blocked(void *arg) {
    (void)arg;
    char b[65536];
    if (!strcmp(mode, "recv-rdwr") || !strcmp(mode, "recv-rd")) {
        result = recv(conn, b, sizeof b, 0);
    } else if (!strcmp(mode, "poll-rdwr")) {
        struct pollfd p = {conn, POLLIN, 0};
        if (poll(&p, 1, 10000) != 1) fail("poll");
        result = p.revents;
    } else if (!strcmp(mode, "epoll-rdwr")) {
        int ep = epoll_create1(0);
        struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = conn};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conn, &e)) fail("epoll_ctl");
        if (epoll_wait(ep, &e, 1, 10000) != 1) fail("epoll_wait");
        result = e.events;
    } else if (!strcmp(mode, "epoll-et-rdwr")) {
        int ep = epoll_create1(0);
        struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = conn};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conn, &e)) fail("epoll_ctl");
        if (epoll_wait(ep, &e, 1, 10000) != 1 || recv(conn, b, 1, 0) != 1) fail("the peer's byte");
        if (epoll_wait(ep, &e, 1, 10000) != 1) fail("epoll_wait");
        result = e.events;
    } else {
        memset(b, 'x', sizeof b);
        for (;;) {
            ssize_t k = send(conn, b, sizeof b, MSG_NOSIGNAL);
            if (k < 0) {
                result = -errno;
                break;
            }
        }
    }
    ended_at = now_ms();
    return NULL;
}

static void woken(int how, long want, const char *what) {
    pthread_t t;
    pthread_create(&t, NULL, blocked, NULL);
    usleep(200000);
    double at = now_ms();
    if (shutdown(conn, how)) fail("shutdown");
    pthread_join(t, NULL);
    if (result != want) fail("%s returned %ld, not %ld", what, result, want);
    if (ended_at - at > 1000) fail("%s returned %.0f ms after the shutdown", what, ended_at - at);
}

static void server(void) {
    if (!strcmp(mode, "recv-rdwr")) {
        woken(SHUT_RDWR, 0, "recv");
    } else if (!strcmp(mode, "poll-rdwr")) {
        woken(SHUT_RDWR, POLLIN | POLLHUP, "poll");
    } else if (!strcmp(mode, "epoll-rdwr") || !strcmp(mode, "epoll-et-rdwr")) {
        woken(SHUT_RDWR, EPOLLIN | EPOLLRDHUP | EPOLLHUP, "epoll_wait");
    } else if (!strcmp(mode, "rd-peer-writes")) {
        char b[16];
        if (shutdown(conn, SHUT_RD)) fail("shutdown");
        usleep(300000); /* the peer wrote "late" */
        if (recv(conn, b, sizeof b, 0) != 4 || memcmp(b, "late", 4)) fail("the peer's bytes after SHUT_RD");
        if (send(conn, "resp", 4, 0) != 4) fail("the answer");
        result = 4;
    } else if (!strcmp(mode, "send-rdwr")) {
        woken(SHUT_RDWR, -EPIPE, "send");
    } else if (!strcmp(mode, "queued-rd")) {
        char b[16];
        usleep(200000); /* the peer's 6 bytes are in */
        if (shutdown(conn, SHUT_RD)) fail("shutdown");
        double at = now_ms();
        if (recv(conn, b, sizeof b, 0) != 6 || memcmp(b, "queued", 6)) fail("the queued bytes");
        if (recv(conn, b, sizeof b, 0) != 0) fail("then end of stream");
        if (now_ms() - at > 1000) fail("the reads waited");
        result = 6;
    } else if (!strcmp(mode, "hup")) {
        if (shutdown(conn, SHUT_WR)) fail("shutdown");
        char b;
        if (recv(conn, &b, 1, 0) != 0) fail("the peer's end of stream");
        usleep(100000);
        struct pollfd p = {conn, POLLIN, 0};
        if (poll(&p, 1, 1000) != 1 || p.revents != (POLLIN | POLLHUP))
            fail("poll: revents %#x, not POLLIN|POLLHUP", p.revents);
        int ep = epoll_create1(0);
        struct epoll_event e = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP, .data.fd = conn};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conn, &e)) fail("epoll_ctl");
        if (epoll_wait(ep, &e, 1, 1000) != 1 || !(e.events & EPOLLHUP) || !(e.events & EPOLLIN))
            fail("epoll_wait: events %#x without EPOLLIN|EPOLLHUP", e.events);
    } else if (!strcmp(mode, "closed-write")) {
        char b;
        usleep(300000); /* the peer has closed */
        struct pollfd p = {conn, POLLIN | POLLOUT, 0};
        if (poll(&p, 1, 1000) != 1 || p.revents != (POLLIN | POLLOUT))
            fail("poll before: revents %#x, not POLLIN|POLLOUT", p.revents);
        if (send(conn, "abc", 3, MSG_NOSIGNAL) != 3) fail("the first write");
        p.revents = 0;
        if (poll(&p, 1, 1000) != 1 || p.revents != (POLLIN | POLLOUT | POLLERR | POLLHUP))
            fail("poll after: revents %#x, not POLLIN|POLLOUT|POLLERR|POLLHUP", p.revents);
        if (recv(conn, &b, 1, 0) != 0) fail("read: not end of stream");
        if (send(conn, "abc", 3, MSG_NOSIGNAL) != -1 || errno != EPIPE) fail("the second write: not EPIPE");
    } else {
        fail("unknown mode");
    }
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: shutdown MODE");
    mode = argv[1];
    signal(SIGPIPE, SIG_IGN);
    struct sockaddr_in a;
    int l = listen_lo(&a);
    pid_t pid = fork();
    if (pid == 0) {
        int c = connect_lo(&a);
        if (!strcmp(mode, "queued-rd") && send(c, "queued", 6, 0) != 6) fail("send");
        if (!strcmp(mode, "epoll-et-rdwr") && send(c, "e", 1, 0) != 1) fail("send");
        if (!strcmp(mode, "rd-peer-writes")) {
            char b[8];
            usleep(100000);
            if (send(c, "late", 4, 0) != 4) fail("send after the server's SHUT_RD");
            if (recv(c, b, sizeof b, 0) != 4 || memcmp(b, "resp", 4)) fail("the server's answer");
            if (recv(c, b, sizeof b, 0) != 0) fail("the end of stream");
            _exit(0);
        }
        if (!strcmp(mode, "closed-write")) {
            close(c);
            _exit(0);
        }
        if (!strcmp(mode, "hup")) {
            char b;
            if (recv(c, &b, 1, 0) != 0) fail("the server's end of stream");
            close(c);
            _exit(0);
        }
        sleep(3);
        close(c);
        _exit(0);
    }
    conn = accept(l, NULL, NULL);
    if (conn < 0) fail("accept");
    server();
    close(conn);
    wait_peer(pid);
    printf("OK %ld\n", !strcmp(mode, "queued-rd") ? 6L : !strcmp(mode, "rd-peer-writes") ? 4L : 0L);
    return 0;
}
