/* splice(2) and sendfile(2) between a connection and a pipe, as a proxy
 * uses them, over one connection between two processes under the
 * preload. Usage: splice MODE [BYTES]. The process listens on loopback
 * and forks a peer that connects. "OK <bytes read>" and status 0 mean
 * every check held; "FAIL ..." and status 1 otherwise. Modes:
 *   relay N     the peer splices N bytes from a pipe (a thread fills it)
 *               into the connection; the server splices them from the
 *               connection into a pipe of one page, which it reads and
 *               checks, until the end of the stream (splice returns 0)
 *   nonblock N  the same with non-blocking sockets and SPLICE_F_NONBLOCK:
 *               the server splices again into its full pipe and must get
 *               EAGAIN, then finds every byte once it drains the pipe
 *   errors      the kernel's answers for a TCP socket where one end is not
 *               a pipe (or not open for that direction, or no descriptor),
 *               an offset or an unknown flag is given, or len is 0;
 *               sendfile into a pipe moves the bytes, into a file it is
 *               EINVAL (ESPIPE with an offset); tee and vmsplice on the
 *               connection are refused as on a socket; the pipe is looked
 *               at before the connection: a full pipe with
 *               SPLICE_F_NONBLOCK is EAGAIN, one without readers EPIPE,
 *               an empty one without writers 0, with no data waiting
 *   locks       a thread splices from an empty pipe into the connection
 *               (blocking); meanwhile the main thread sends on the
 *               connection, then fills the pipe: the peer reads both, in
 *               that order (no lock of the connection is held while the
 *               pipe is waited on) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

static size_t total;
static int nonblocking;

struct filler {
    int fd;
    size_t n;
};

/* Writes the pattern's first `n` bytes into pipe `fd`, then closes it. */
static void *fill(void *arg) {
    struct filler *f = arg;
    unsigned char b[10000];
    size_t done = 0;
    while (done < f->n) {
        size_t k = f->n - done < sizeof b ? f->n - done : sizeof b;
        for (size_t i = 0; i < k; i++) b[i] = pat(done + i);
        ssize_t w = write(f->fd, b, k);
        if (w < 0 && errno == EAGAIN) {
            struct pollfd p = {f->fd, POLLOUT, 0};
            poll(&p, 1, -1);
            continue;
        }
        if (w <= 0) fail("write into the pipe");
        done += w;
    }
    close(f->fd);
    return NULL;
}

static void wait_for(int fd, short ev) {
    struct pollfd p = {fd, ev, 0};
    if (poll(&p, 1, 10000) != 1) fail("poll %d for %d", fd, ev);
}

/* The peer: the pattern through a pipe into the connection, by splice. */
static void send_by_splice(int s) {
    int p[2];
    if (pipe2(p, nonblocking ? O_NONBLOCK : 0)) fail("pipe");
    struct filler f = {p[1], total};
    pthread_t t;
    pthread_create(&t, NULL, fill, &f);
    unsigned flags = SPLICE_F_MOVE | SPLICE_F_MORE | (nonblocking ? SPLICE_F_NONBLOCK : 0);
    size_t sent = 0;
    for (;;) {
        ssize_t k = splice(p[0], NULL, s, NULL, 65536, flags);
        if (k == 0) break; /* the filler closed the pipe */
        if (k < 0 && errno == EAGAIN && nonblocking) {
            struct pollfd w[2] = {{p[0], POLLIN, 0}, {s, POLLOUT, 0}};
            poll(w, 2, 10000);
            continue;
        }
        if (k < 0) fail("splice from the pipe into the connection");
        sent += k;
    }
    pthread_join(t, NULL);
    if (sent != total) fail("spliced %zu of %zu bytes", sent, total);
}

/* Reads the `n` bytes in pipe `fd` and checks them at stream offset `at`. */
static void drain(int fd, size_t n, size_t at) {
    unsigned char b[4096];
    while (n > 0) {
        ssize_t k = read(fd, b, n < sizeof b ? n : sizeof b);
        if (k <= 0) fail("read the pipe");
        for (ssize_t i = 0; i < k; i++)
            if (b[i] != pat(at + i)) fail("byte %zu is %d, not %d", at + i, b[i], pat(at + i));
        at += k;
        n -= k;
    }
}

/* The server: the connection into a one-page pipe, by splice, until the
 * end of the stream. Returns the bytes read. */
static size_t receive_by_splice(int s) {
    int q[2];
    if (pipe2(q, nonblocking ? O_NONBLOCK : 0)) fail("pipe");
    if (fcntl(q[1], F_SETPIPE_SZ, 4096) < 0) fail("F_SETPIPE_SZ");
    unsigned flags = nonblocking ? SPLICE_F_NONBLOCK : 0;
    size_t got = 0, full = 0;
    for (;;) {
        ssize_t k = splice(s, NULL, q[1], NULL, 1 << 20, flags);
        if (k < 0 && errno == EAGAIN && nonblocking) {
            wait_for(s, POLLIN);
            continue;
        }
        if (k < 0) fail("splice from the connection into the pipe");
        if (k == 0) break;
        if (k > 4096) fail("%zd bytes into a one-page pipe", k);
        if (nonblocking) {
            /* Into the pipe again before draining it: full, or at most the
             * room one page leaves. */
            int queued = 0;
            if (ioctl(q[0], FIONREAD, &queued)) fail("FIONREAD");
            ssize_t again = splice(s, NULL, q[1], NULL, 1 << 20, flags);
            if (again < 0 && errno == EAGAIN && queued == 4096) full++;
            else if (again > 0) k += again;
            else if (again < 0 && errno != EAGAIN) fail("splice into the full pipe");
        }
        drain(q[0], k, got);
        got += k;
    }
    if (nonblocking && full == 0) fail("no splice found the pipe full");
    return got;
}

struct spliced {
    int pipe, sock;
    ssize_t r;
};

static void *splice_in(void *arg) {
    struct spliced *sp = arg;
    sp->r = splice(sp->pipe, NULL, sp->sock, NULL, 64, 0);
    return NULL;
}

/* The server's side of "locks": see the usage. */
static void locks(int s) {
    int p[2];
    if (pipe(p)) fail("pipe");
    struct spliced sp = {p[0], s, 0};
    pthread_t t;
    pthread_create(&t, NULL, splice_in, &sp);
    usleep(200000);
    alarm(5); /* a lock held across the pipe's wait would hang here */
    if (send(s, "hdr,", 4, 0) != 4) fail("send");
    if (write(p[1], "body", 4) != 4) fail("write into the pipe");
    pthread_join(t, NULL);
    alarm(0);
    if (sp.r != 4) fail("splice moved %zd bytes, not 4", sp.r);
    shutdown(s, SHUT_WR);
    char b[8];
    if (read(s, b, 1) != 0) fail("the peer's end of stream");
    printf("OK 0\n");
}

static void errors(int s) {
    int p[2];
    if (pipe(p)) fail("pipe");
    loff_t off = 0;
    struct { int in, out; loff_t *oin, *oout; int err; const char *what; } cases[] = {
        {s, s, NULL, NULL, EINVAL, "between two connections"},
        {s, p[1], &off, NULL, EINVAL, "with an offset on the connection"},
        {s, p[1], NULL, &off, ESPIPE, "with an offset on the pipe"},
        {p[0], s, NULL, &off, EINVAL, "into the connection with its offset"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        errno = 0;
        if (splice(cases[i].in, cases[i].oin, cases[i].out, cases[i].oout, 5, SPLICE_F_NONBLOCK) != -1 ||
            errno != cases[i].err)
            fail("splice %s: not errno %d", cases[i].what, cases[i].err);
    }
    char path[] = "/tmp/smclo-splice-XXXXXX";
    int f = mkstemp(path);
    if (f < 0) fail("mkstemp");
    unlink(path);
    errno = 0;
    if (splice(s, NULL, f, NULL, 5, 0) != -1 || errno != EINVAL) fail("splice into a file: not EINVAL");
    if (sendfile(f, s, NULL, 5) != -1 || errno != EINVAL) fail("sendfile into a file: not EINVAL");
    if (tee(s, p[1], 5, 0) != -1 || errno != EINVAL) fail("tee of the connection: not EINVAL");
    struct iovec v = {"x", 1};
    if (vmsplice(s, &v, 1, 0) != -1 || errno != EBADF) fail("vmsplice into the connection: not EBADF");
    if (splice(s, NULL, s, NULL, 0, 0) != 0) fail("len 0: not 0");
    if (splice(s, NULL, p[1], NULL, 5, 0x100) != -1 || errno != EINVAL) fail("an unknown flag: not EINVAL");
    if (splice(s, &off, p[1], &off, 5, 0) != -1 || errno != ESPIPE) fail("both offsets: not ESPIPE");
    if (splice(s, NULL, 1000, NULL, 5, 0) != -1 || errno != EBADF) fail("no descriptor: not EBADF");
    if (splice(s, NULL, p[0], NULL, 5, 0) != -1 || errno != EBADF) fail("into the read end: not EBADF");
    if (sendfile(f, s, &off, 5) != -1 || errno != ESPIPE) fail("sendfile with an offset: not ESPIPE");
    /* The pipe before the connection, which has no data yet. */
    int q[2];
    if (pipe(q) || fcntl(q[1], F_SETPIPE_SZ, 4096) < 0) fail("pipe");
    char page[4096] = {0};
    if (write(q[1], page, sizeof page) != (ssize_t)sizeof page) fail("fill the pipe");
    if (splice(s, NULL, q[1], NULL, 5, SPLICE_F_NONBLOCK) != -1 || errno != EAGAIN) fail("a full pipe: not EAGAIN");
    close(q[0]);
    signal(SIGPIPE, SIG_IGN);
    if (splice(s, NULL, q[1], NULL, 5, 0) != -1 || errno != EPIPE) fail("a pipe without readers: not EPIPE");
    close(q[1]);
    if (pipe(q)) fail("pipe");
    close(q[1]);
    if (splice(q[0], NULL, s, NULL, 5, 0) != 0) fail("an empty pipe without writers: not 0");
    close(q[0]);
    /* sendfile into a pipe splices, as the kernel's (the peer wrote
     * "hello"). */
    if (sendfile(p[1], s, NULL, 5) != 5) fail("sendfile from the connection into a pipe");
    char b[5];
    if (read(p[0], b, 5) != 5 || memcmp(b, "hello", 5)) fail("the pipe does not hold the bytes");
    printf("OK 5\n");
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: splice MODE [BYTES]");
    mode = argv[1];
    total = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    nonblocking = !strcmp(mode, "nonblock");
    struct sockaddr_in a;
    int l = listen_lo(&a);
    pid_t pid = fork();
    if (pid == 0) {
        int c = connect_lo(&a);
        if (!strcmp(mode, "locks")) {
            char b[16];
            size_t n = 0;
            for (;;) {
                ssize_t k = read(c, b + n, sizeof b - n);
                if (k < 0) fail("read");
                if (k == 0) break;
                n += k;
            }
            if (n != 8 || memcmp(b, "hdr,body", 8)) fail("the peer read %.*s", (int)n, b);
            close(c);
            _exit(0);
        }
        if (!strcmp(mode, "errors")) {
            char b;
            usleep(300000); /* after the server's looks with no data */
            if (write(c, "hello", 5) != 5) fail("write");
            if (read(c, &b, 1) != 0) fail("the end of the stream");
            _exit(0);
        }
        if (nonblocking && fcntl(c, F_SETFL, O_NONBLOCK)) fail("F_SETFL");
        send_by_splice(c);
        close(c);
        _exit(0);
    }
    int s = accept(l, NULL, NULL);
    if (s < 0) fail("accept");
    if (!strcmp(mode, "errors") || !strcmp(mode, "locks")) {
        if (!strcmp(mode, "errors")) errors(s);
        else locks(s);
        close(s);
        wait_peer(pid);
        return 0;
    }
    if (nonblocking && fcntl(s, F_SETFL, O_NONBLOCK)) fail("F_SETFL");
    size_t got = receive_by_splice(s);
    wait_peer(pid);
    if (got != total) fail("received %zu of %zu bytes", got, total);
    printf("OK %zu\n", got);
    return 0;
}
