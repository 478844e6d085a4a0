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
 *               a pipe or an offset is given; sendfile into a pipe moves
 *               the bytes, into a file it is EINVAL; tee and vmsplice on
 *               the connection are refused as on a socket */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
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
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, sizeof a) || listen(l, 4) || getsockname(l, (void *)&a, &al)) fail("listen");
    pid_t pid = fork();
    if (pid == 0) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (void *)&a, sizeof a)) fail("connect");
        if (!strcmp(mode, "errors")) {
            char b;
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
    if (!strcmp(mode, "errors")) {
        errors(s);
        close(s);
        int st;
        waitpid(pid, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("the peer failed (status %d)", st);
        return 0;
    }
    if (nonblocking && fcntl(s, F_SETFL, O_NONBLOCK)) fail("F_SETFL");
    size_t got = receive_by_splice(s);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) fail("the peer failed (status %d)", st);
    if (got != total) fail("received %zu of %zu bytes", got, total);
    printf("OK %zu\n", got);
    return 0;
}
