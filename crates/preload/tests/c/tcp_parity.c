/* Answers a program gets from TCP in the corners of the socket API, over
 * one connection between two processes: the test runs each mode plainly
 * (which proves the expectation is TCP's) and under the preload. Usage:
 * tcp_parity MODE. "OK <bytes read>" and status 0 mean every check held.
 * Modes:
 *   zero-recv     a zero-length recv: EAGAIN with nothing queued and
 *                 MSG_DONTWAIT, 0 with bytes queued, waits for bytes when
 *                 blocking; read of 0 bytes is 0 at once
 *   reset-sockopt the peer closes with bytes unread (a reset): poll shows
 *                 POLLERR, SO_ERROR reads ECONNRESET once, then 0, and
 *                 POLLERR is gone; recv then reads 0, send fails EPIPE
 *   reset-recv    the same reset: recv fails ECONNRESET once, then reads
 *                 0; SO_ERROR is 0; send fails EPIPE
 *   reset-send    the same reset: send fails ECONNRESET once, then EPIPE;
 *                 SO_ERROR is 0; recv reads 0
 *   reset-data    the peer writes 3 bytes, then closes with bytes unread:
 *                 recv returns the 3 bytes, then ECONNRESET, then 0
 *   reset-fin     the peer shuts its writing, then closes with bytes unread
 *                 (an end of stream, then a reset): SO_ERROR reads EPIPE
 *                 once, recv reads 0, send fails EPIPE
 *   closed-write  the peer closes having read everything; the first write
 *                 succeeds (the peer answers with a reset), SO_ERROR then
 *                 reads EPIPE once, and POLLERR goes with it
 *   inq           TCP_INQ on the accepted socket (and on the peer's before
 *                 its connect): recvmsg reports the bytes left to read in
 *                 a TCP_CM_INQ message, 1 at the end of the stream, and
 *                 MSG_CTRUNC without a control buffer
 *   outq          SIOCOUTQ and SIOCOUTQNSD count the bytes TCP_CORK and
 *                 MSG_MORE hold, 0 once they went
 *   splice-more   2 bytes spliced from a pipe with SPLICE_F_MORE are held
 *                 (the peer sees nothing for 100 ms) until a send without
 *                 MSG_MORE; the peer reads the 3 bytes
 *   close-blocked a thread blocks in recv; another closes the descriptor;
 *                 the recv goes on and gets the 5 bytes the peer sends
 *                 then, and the peer reads the end of stream after it; a
 *                 child forked after the close does not have the number
 *   close-in-handler  a SIGALRM handler (SA_RESTART) closes the descriptor
 *                 a recv of the same thread waits on: the peer reads the
 *                 end of stream, and the restarted recv fails EBADF
 *   close-after-longjmp  a SIGALRM handler leaves a blocked recv with
 *                 siglongjmp; the thread then closes the descriptor: the
 *                 peer reads the end of stream
 *   fork-blocked  as close-blocked, but a fork child (made while the recv
 *                 blocks) closes its copy first and lives on: its number
 *                 is free at once, and the peer reads the end of stream
 *                 once the recv returned
 *   fork-closed-first  fork-blocked, where the child closes its copy
 *                 before fork has returned in the parent (a parent
 *                 pthread_atfork handler waits for that close), and
 *                 kcmp(2) fails EPERM, as under Docker's default seccomp
 *                 profile
 *   fork-late-children  two fork children start late (a fork handler
 *                 that runs before the preload's in the child waits): the
 *                 first only while the second is being forked; the
 *                 parent and the first close their copies, then the
 *                 second starts, sends "late" and closes: the peer reads
 *                 "late", then the end of stream
 *   exit-blocked  the peer exits (exit, not _exit) while a thread of its
 *                 blocks in recv: the server reads the end of stream */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <sys/wait.h>
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <linux/filter.h>
#include <linux/seccomp.h>

#include "check.h"

/* Tells the other process a step is done, and waits for its step. */
static int to_peer[2], to_server[2];

static void tell(int fd) {
    if (write(fd, "s", 1) != 1) fail("tell");
}

static void await(int fd) {
    char b;
    if (read(fd, &b, 1) != 1) fail("await");
}

static int so_error(int c) {
    int e = -1;
    socklen_t l = sizeof e;
    if (getsockopt(c, SOL_SOCKET, SO_ERROR, &e, &l)) fail("getsockopt(SO_ERROR)");
    return e;
}

static short revents(int c) {
    struct pollfd p = {c, POLLIN | POLLOUT, 0};
    if (poll(&p, 1, 1000) != 1) fail("poll: nothing ready");
    return p.revents;
}

/* `call` returned `r`: it must be `want` (>= 0), or -1 with errno -want. */
static void expect(const char *call, ssize_t r, ssize_t want) {
    if (want >= 0 && r != want) fail("%s returned %zd, not %zd", call, r, want);
    if (want < 0 && (r != -1 || errno != -want)) fail("%s returned %zd, not -1 with errno %zd", call, r, -want);
}

static void expect_revents(int c, short want) {
    short r = revents(c);
    if (r != want) fail("poll: revents %#x, not %#x", r, want);
}

static long zero_recv(int c) {
    char b[8];
    expect("recv(0, MSG_DONTWAIT) with nothing queued", recv(c, b, 0, MSG_DONTWAIT), -EAGAIN);
    expect("read(0) with nothing queued", read(c, b, 0), 0);
    tell(to_peer[1]); /* the peer writes "abc" 200 ms later */
    double at = now_ms();
    expect("blocking recv(0)", recv(c, b, 0, 0), 0);
    if (now_ms() - at < 100) fail("a blocking recv(0) did not wait for the bytes");
    expect("recv(0, MSG_DONTWAIT) with bytes queued", recv(c, b, 0, MSG_DONTWAIT), 0);
    expect("the queued bytes", recv(c, b, sizeof b, 0), 3);
    if (memcmp(b, "abc", 3)) fail("the bytes are not the peer's");
    return 3;
}

/* The peer reset the connection (see main). */
static long after_reset(int c) {
    char b[8];
    expect_revents(c, POLLIN | POLLOUT | POLLERR | POLLHUP);
    if (!strcmp(mode, "reset-sockopt")) {
        { int e = so_error(c); if (e != ECONNRESET) fail("SO_ERROR: %d, not ECONNRESET", e); }
        if (so_error(c) != 0) fail("SO_ERROR read twice: not 0");
        expect_revents(c, POLLIN | POLLOUT | POLLHUP);
        expect("recv after SO_ERROR", recv(c, b, sizeof b, 0), 0);
        expect("send after SO_ERROR", send(c, "x", 1, MSG_NOSIGNAL), -EPIPE);
        return 0;
    }
    if (!strcmp(mode, "reset-fin")) {
        { int e = so_error(c); if (e != EPIPE) fail("SO_ERROR: %d, not EPIPE", e); }
        if (so_error(c) != 0) fail("SO_ERROR read twice: not 0");
        expect("recv", recv(c, b, sizeof b, 0), 0);
        expect("recv again", recv(c, b, sizeof b, 0), 0);
        expect("send", send(c, "x", 1, MSG_NOSIGNAL), -EPIPE);
        return 0;
    }
    if (!strcmp(mode, "reset-recv") || !strcmp(mode, "reset-data")) {
        long got = 0;
        if (!strcmp(mode, "reset-data")) {
            expect("recv of the peer's bytes", recv(c, b, sizeof b, 0), 3);
            if (memcmp(b, "abc", 3)) fail("the bytes are not the peer's");
            got = 3;
        }
        expect("the first recv", recv(c, b, sizeof b, 0), -ECONNRESET);
        expect("the second recv", recv(c, b, sizeof b, 0), 0);
        { int e = so_error(c); if (e != 0) fail("SO_ERROR after the recv: %d, not 0", e); }
        expect("send", send(c, "x", 1, MSG_NOSIGNAL), -EPIPE);
        return got;
    }
    expect("the first send", send(c, "x", 1, MSG_NOSIGNAL), -ECONNRESET);
    expect("the second send", send(c, "x", 1, MSG_NOSIGNAL), -EPIPE);
    { int e = so_error(c); if (e != 0) fail("SO_ERROR after the send: %d, not 0", e); }
    expect("recv", recv(c, b, sizeof b, 0), 0);
    return 0;
}

static long closed_write(int c) {
    char b[8];
    expect("the first write", send(c, "abc", 3, MSG_NOSIGNAL), 3);
    usleep(100000); /* the peer's reset is in */
    expect_revents(c, POLLIN | POLLOUT | POLLERR | POLLHUP);
    { int e = so_error(c); if (e != EPIPE) fail("SO_ERROR: %d, not EPIPE", e); }
    if (so_error(c) != 0) fail("SO_ERROR read twice: not 0");
    expect_revents(c, POLLIN | POLLOUT | POLLHUP);
    expect("recv", recv(c, b, sizeof b, 0), 0);
    expect("the second write", send(c, "abc", 3, MSG_NOSIGNAL), -EPIPE);
    return 0;
}

/* recvmsg of up to `n` bytes into `b`: the count, which must be `want`,
 * and the TCP_CM_INQ value, which must be `inq`. */
static void recv_inq(int c, char *b, size_t n, ssize_t want, int inq) {
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct iovec v = {b, n};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    expect("recvmsg", recvmsg(c, &m, 0), want);
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    if (!h || h->cmsg_level != SOL_TCP || h->cmsg_type != TCP_CM_INQ || h->cmsg_len != CMSG_LEN(sizeof(int)))
        fail("no TCP_CM_INQ message (controllen %zu)", (size_t)m.msg_controllen);
    int got;
    memcpy(&got, CMSG_DATA(h), sizeof got);
    if (got != inq) fail("TCP_CM_INQ: %d, not %d", got, inq);
}

static long inq(int c) {
    int one = 1;
    char b[8];
    if (setsockopt(c, SOL_TCP, TCP_INQ, &one, sizeof one)) fail("setsockopt(TCP_INQ)");
    await(to_server[0]); /* the peer's 6 bytes are in */
    recv_inq(c, b, 2, 2, 4);
    struct iovec v = {b, 1};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1};
    expect("recvmsg without a control buffer", recvmsg(c, &m, 0), 1);
    if (!(m.msg_flags & MSG_CTRUNC)) fail("no MSG_CTRUNC without a control buffer");
    recv_inq(c, b, 8, 3, 0);
    if (send(c, "resp", 4, 0) != 4) fail("send");
    await(to_server[0]); /* the peer shut its writing */
    recv_inq(c, b, 8, 0, 1);
    return 6;
}

static void expect_outq(int c, int want) {
    int q = -1, nsd = -1;
    if (ioctl(c, SIOCOUTQ, &q) || ioctl(c, SIOCOUTQNSD, &nsd)) fail("ioctl");
    if (q != want || nsd != want) fail("SIOCOUTQ %d, SIOCOUTQNSD %d, not %d", q, nsd, want);
}

static long outq(int c) {
    int on = 1, off = 0;
    expect_outq(c, 0);
    if (setsockopt(c, SOL_TCP, TCP_CORK, &on, sizeof on)) fail("TCP_CORK");
    expect("send", send(c, "abc", 3, 0), 3);
    expect_outq(c, 3);
    if (setsockopt(c, SOL_TCP, TCP_CORK, &off, sizeof off)) fail("TCP_CORK off");
    usleep(50000);
    expect_outq(c, 0);
    expect("send with MSG_MORE", send(c, "def", 3, MSG_MORE), 3);
    expect_outq(c, 3);
    expect("send", send(c, "g", 1, 0), 1);
    usleep(50000);
    expect_outq(c, 0);
    await(to_server[0]); /* the peer read the 7 bytes */
    return 0;
}

static long splice_more(int c) {
    int p[2];
    if (pipe(p) || write(p[1], "ab", 2) != 2) fail("pipe");
    expect("splice with SPLICE_F_MORE", splice(p[0], NULL, c, NULL, 2, SPLICE_F_MORE), 2);
    tell(to_peer[1]);
    await(to_server[0]); /* the peer saw nothing for 100 ms */
    expect("send", send(c, "c", 1, 0), 1);
    return 0;
}

/* close-blocked: what the blocked recv returned, and its errno. */
static int blocked_fd, blocked_errno;
static ssize_t blocked_got;

static void *blocked_reader(void *arg) {
    char b[16];
    blocked_got = recv(blocked_fd, b, sizeof b, 0);
    blocked_errno = errno;
    if (blocked_got == 5 && memcmp(b, "hello", 5)) blocked_got = -2;
    return arg;
}

/* fork-blocked: the child's close is done (its parent waits in
 * closed_first before fork returns, for fork-closed-first). */
static int closed[2], closed_first;

static void child_closed(void) {
    if (closed_first) await(closed[0]);
}

/* From now on kcmp(2) fails EPERM in this process and its children. */
static void refuse_kcmp(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_kcmp, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) fail("seccomp");
    if (syscall(SYS_kcmp, getpid(), getpid(), 0, 0, 0) != -1 || errno != EPERM) fail("kcmp still allowed");
}

/* late_atfork.c's: the children of the forks from now on wait for a byte
 * from fd before the preload's part of fork runs in them. */
void late_atfork_hold_children(int fd);

/* fork-late-children: the first child starts, and is then in the family's
 * holders, while its parent is inside the second fork (the second child
 * is forked, not yet listed). */
static int first_gate[2], first_started[2], in_second_fork;

static void start_first_child(void) {
    if (!in_second_fork) return;
    in_second_fork = 0;
    tell(first_gate[1]);
    await(first_started[0]);
}

static long fork_late_children(int c) {
    int second_gate[2], close_first[2], first_closed[2];
    if (pipe(first_gate) || pipe(first_started) || pipe(second_gate) || pipe(close_first) || pipe(first_closed))
        fail("pipe");
    if (pthread_atfork(NULL, start_first_child, NULL)) fail("pthread_atfork");
    late_atfork_hold_children(first_gate[0]);
    pid_t first = fork();
    if (first < 0) fail("fork");
    if (first == 0) {
        tell(first_started[1]);
        await(close_first[0]);
        expect("close", close(c), 0);
        tell(first_closed[1]);
        _exit(0);
    }
    late_atfork_hold_children(second_gate[0]);
    in_second_fork = 1;
    pid_t second = fork();
    if (second < 0) fail("fork");
    if (second == 0) {
        expect("send", send(c, "late", 4, 0), 4);
        expect("close", close(c), 0);
        _exit(0);
    }
    late_atfork_hold_children(-1);
    expect("close", close(c), 0);
    tell(close_first[1]);
    await(first_closed[0]);
    tell(second_gate[1]);
    pid_t children[] = {first, second};
    for (int i = 0; i < 2; i++) {
        int st;
        if (waitpid(children[i], &st, 0) != children[i] || !WIFEXITED(st) || WEXITSTATUS(st))
            fail("fork child %d ended with %#x", i + 1, st);
    }
    await(to_server[0]); /* the peer read "late" and the end of stream */
    return 4;
}

/* close-blocked with a fork child that closes its copy and lives on;
 * `first`: before fork has returned in the parent, without kcmp. */
static long fork_blocked(int c, int first) {
    pthread_t t;
    int hold[2], go[2];
    if (pipe(closed) || pipe(hold) || pipe(go)) fail("pipe");
    closed_first = first;
    if (first) refuse_kcmp();
    if (pthread_atfork(NULL, child_closed, NULL)) fail("pthread_atfork");
    blocked_fd = c;
    if (pthread_create(&t, NULL, blocked_reader, NULL)) fail("pthread_create");
    usleep(100000); /* the reader waits in recv */
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        char b;
        close(hold[1]);
        if (!first) await(go[0]);
        expect("close", close(c), 0);
        /* Closed, not only forgotten: the number is free. */
        expect("fcntl(F_GETFD) of the closed number", fcntl(c, F_GETFD), -EBADF);
        tell(closed[1]);
        if (read(hold[0], &b, 1) != 0) fail("hold");
        _exit(0);
    }
    close(hold[0]);
    if (!first) {
        tell(go[1]);
        await(closed[0]);
    }
    expect("close", close(c), 0);
    tell(to_peer[1]);
    pthread_join(t, NULL);
    if (blocked_got != 5) fail("the blocked recv returned %zd (errno %d), not the peer's 5 bytes", blocked_got, blocked_errno);
    await(to_server[0]); /* the peer read the end of stream, the child still alive */
    close(hold[1]);
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the fork child ended with %#x", st);
    return blocked_got;
}

static long close_blocked(int c) {
    pthread_t t;
    blocked_fd = c;
    if (pthread_create(&t, NULL, blocked_reader, NULL)) fail("pthread_create");
    usleep(100000); /* the reader waits in recv */
    expect("close", close(c), 0);
    /* A fork child never had the closed number. */
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        expect("fcntl(F_GETFD) of a number closed before the fork", fcntl(c, F_GETFD), -EBADF);
        _exit(0);
    }
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the fork child ended with %#x", st);
    tell(to_peer[1]);
    pthread_join(t, NULL);
    if (blocked_got != 5)
        fail("the blocked recv returned %zd (errno %d), not the 5 bytes the peer sent after the close", blocked_got,
             blocked_errno);
    await(to_server[0]); /* the peer read the end of stream */
    return blocked_got;
}

static int handler_fd;
static sigjmp_buf jumped;

static void close_it(int sig) {
    (void)sig;
    close(handler_fd);
}

static void jump(int sig) {
    (void)sig;
    siglongjmp(jumped, 1);
}

static void on_alarm(void (*f)(int), int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = f;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL)) fail("sigaction");
}

static long close_in_handler(int c) {
    char b[8];
    on_alarm(close_it, SA_RESTART);
    handler_fd = c;
    ualarm(100000, 0);
    expect("recv restarted after the handler closed its descriptor", recv(c, b, sizeof b, 0), -EBADF);
    await(to_server[0]); /* the peer read the end of stream */
    return 0;
}

static long close_after_longjmp(int c) {
    char b[8];
    on_alarm(jump, 0);
    if (!sigsetjmp(jumped, 1)) {
        ualarm(100000, 0);
        ssize_t r = recv(c, b, sizeof b, 0);
        fail("recv returned %zd before the alarm", r);
    }
    expect("close", close(c), 0);
    await(to_server[0]); /* the peer read the end of stream */
    return 0;
}

/* exit-blocked's blocked thread. Whatever its recv returns while the
 * process exits (over TCP it never returns; under the preload the exit's
 * ending of the connection may wake it first) is not the test's: it only
 * must not keep the exit from closing the connection. */
static void *block_in_recv(void *arg) {
    char b[8];
    (void)recv(*(int *)arg, b, sizeof b, 0);
    for (;;) pause();
    return NULL;
}

/* The peer: the end of stream comes within 3 s (`after` says after what),
 * then the server is told, and the peer waits for its end. */
static void expect_end(int c, const char *after) {
    char b[8];
    struct pollfd p = {c, POLLIN, 0};
    if (poll(&p, 1, 3000) != 1) fail("no end of stream 3 s after %s", after);
    ssize_t r = recv(c, b, sizeof b, 0);
    if (r != 0) fail("recv after %s: %zd (errno %d), not the end of stream", after, r, r < 0 ? errno : 0);
    tell(to_server[1]);
    await(to_peer[0]);
}

static void peer(int c) {
    char b[8];
    if (!strcmp(mode, "zero-recv")) {
        await(to_peer[0]);
        usleep(200000);
        if (send(c, "abc", 3, 0) != 3) fail("send");
        await(to_peer[0]);
    } else if (!strcmp(mode, "outq")) {
        if (recv(c, b, 7, MSG_WAITALL) != 7 || memcmp(b, "abcdefg", 7)) fail("the 7 bytes");
        tell(to_server[1]);
        await(to_peer[0]);
    } else if (!strcmp(mode, "inq")) {
        if (send(c, "abcdef", 6, 0) != 6) fail("send");
        usleep(50000);
        tell(to_server[1]);
        recv_inq(c, b, 8, 4, 0);
        if (memcmp(b, "resp", 4)) fail("the server's answer");
        if (shutdown(c, SHUT_WR)) fail("shutdown");
        usleep(50000);
        tell(to_server[1]);
        await(to_peer[0]);
    } else if (!strcmp(mode, "splice-more")) {
        struct pollfd p = {c, POLLIN, 0};
        await(to_peer[0]);
        if (poll(&p, 1, 100) != 0) fail("the bytes spliced with SPLICE_F_MORE came at once");
        tell(to_server[1]);
        if (recv(c, b, 3, MSG_WAITALL) != 3 || memcmp(b, "abc", 3)) fail("the 3 bytes");
        await(to_peer[0]);
    } else if (!strcmp(mode, "closed-write")) {
        close(c);
        tell(to_server[1]);
        await(to_peer[0]);
    } else if (!strcmp(mode, "close-in-handler") || !strcmp(mode, "close-after-longjmp")) {
        expect_end(c, "the server's close");
    } else if (!strcmp(mode, "exit-blocked")) {
        pthread_t t;
        if (pthread_create(&t, NULL, block_in_recv, &c)) fail("pthread_create");
        usleep(100000); /* the thread waits in recv */
        exit(0);
    } else if (!strcmp(mode, "fork-late-children")) {
        struct pollfd p = {c, POLLIN, 0};
        if (poll(&p, 1, 3000) != 1) fail("nothing from the last fork child in 3 s");
        ssize_t r = recv(c, b, 4, MSG_WAITALL);
        if (r != 4 || memcmp(b, "late", 4))
            fail("recv returned %zd (errno %d), not the last fork child's \"late\"", r, r < 0 ? errno : 0);
        expect_end(c, "the last fork child's bytes");
    } else if (!strcmp(mode, "close-blocked") || !strncmp(mode, "fork-", 5)) {
        await(to_peer[0]);
        usleep(100000); /* the server's reader still waits */
        if (send(c, "hello", 5, 0) != 5) fail("send");
        expect_end(c, "the blocked recv got its bytes");
    } else {
        /* The server's 3 bytes are in; closing without reading them resets. */
        if (!strcmp(mode, "reset-data") && send(c, "abc", 3, 0) != 3) fail("send");
        await(to_peer[0]);
        if (!strcmp(mode, "reset-fin")) {
            if (shutdown(c, SHUT_WR)) fail("shutdown");
            usleep(50000);
        }
        close(c);
        tell(to_server[1]);
        await(to_peer[0]);
    }
    (void)b;
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: tcp_parity MODE");
    mode = argv[1];
    signal(SIGPIPE, SIG_IGN);
    if (pipe(to_peer) || pipe(to_server)) fail("pipe");
    struct sockaddr_in a;
    int l = listen_lo(&a);
    pid_t pid = fork();
    if (pid == 0) {
        /* Only the server writes to_peer and reads to_server: a server
         * that failed ends the peer's next wait. */
        close(to_peer[1]);
        close(to_server[0]);
        close(l);
        int c = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (!strcmp(mode, "inq") && setsockopt(c, SOL_TCP, TCP_INQ, &one, sizeof one)) fail("setsockopt(TCP_INQ)");
        if (c < 0 || connect(c, (const void *)&a, sizeof a)) fail("connect");
        peer(c);
        _exit(0);
    }
    close(to_peer[0]);
    close(to_server[1]);
    int c = accept(l, NULL, NULL);
    if (c < 0) fail("accept");
    long got;
    if (!strcmp(mode, "zero-recv")) {
        got = zero_recv(c);
    } else if (!strcmp(mode, "splice-more")) {
        got = splice_more(c);
    } else if (!strcmp(mode, "inq")) {
        got = inq(c);
    } else if (!strcmp(mode, "outq")) {
        got = outq(c);
    } else if (!strcmp(mode, "closed-write")) {
        await(to_server[0]);
        got = closed_write(c);
    } else if (!strcmp(mode, "close-blocked")) {
        got = close_blocked(c);
        c = -1; /* closed */
    } else if (!strcmp(mode, "fork-late-children")) {
        got = fork_late_children(c);
        c = -1;
    } else if (!strcmp(mode, "fork-blocked") || !strcmp(mode, "fork-closed-first")) {
        got = fork_blocked(c, !strcmp(mode, "fork-closed-first"));
        c = -1;
    } else if (!strcmp(mode, "exit-blocked")) {
        char b[8];
        expect("recv after the peer exited", recv(c, b, sizeof b, 0), 0);
        got = 0;
    } else if (!strcmp(mode, "close-in-handler")) {
        got = close_in_handler(c);
        c = -1;
    } else if (!strcmp(mode, "close-after-longjmp")) {
        got = close_after_longjmp(c);
        c = -1;
    } else if (!strncmp(mode, "reset-", 6)) {
        if (send(c, "xyz", 3, 0) != 3) fail("send");
        usleep(50000); /* in the peer's queue (and its 3 bytes in ours) */
        tell(to_peer[1]);
        await(to_server[0]);
        usleep(50000);
        got = after_reset(c);
    } else {
        fail("unknown mode");
    }
    if (strcmp(mode, "exit-blocked")) tell(to_peer[1]); /* that peer is gone */
    close(c);
    wait_peer(pid);
    printf("OK %ld\n", got);
    return 0;
}
