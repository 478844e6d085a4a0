/* One end of a byte-exact exchange over TCP on 127.0.0.1, built for glibc
 * (cc) and for musl (musl-gcc) from this one source. The client sends
 * BYTES bytes of one pattern and shuts down writing; the server checks
 * every byte, answers BYTES bytes of another pattern and closes; the
 * client checks every byte. Each end prints "ok N" (N: the bytes it read,
 * for every connection); a wrong byte, a short stream or an error exits 1.
 *
 * usage: pair server PORT COUNT BYTES | pair client PORT BYTES */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static unsigned char pattern(long i, int seed) { return (unsigned char)((i * 131 + seed) % 256); }

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void send_pattern(int fd, long n, int seed) {
    unsigned char buf[65536];
    long sent = 0;
    while (sent < n) {
        size_t k = 0;
        while (k < sizeof buf && sent + (long)k < n) {
            buf[k] = pattern(sent + (long)k, seed);
            k++;
        }
        size_t off = 0;
        while (off < k) {
            ssize_t w = write(fd, buf + off, k - off);
            if (w <= 0)
                die("write");
            off += (size_t)w;
        }
        sent += (long)k;
    }
}

/* Reads to the end of the stream, checking each byte; returns the count. */
static long check_pattern(int fd, long n, int seed) {
    unsigned char buf[65536];
    long got = 0;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0)
            die("read");
        if (r == 0)
            break;
        for (ssize_t k = 0; k < r; k++) {
            if (got + k >= n || buf[k] != pattern(got + k, seed)) {
                fprintf(stderr, "wrong byte at %ld\n", got + k);
                exit(1);
            }
        }
        got += r;
    }
    if (got != n) {
        fprintf(stderr, "short stream: %ld of %ld bytes\n", got, n);
        exit(1);
    }
    return got;
}

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((unsigned short)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static int serve(int port, int count, long n) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = loopback(port);
    if (l < 0 || setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 16) < 0)
        die("listen");
    long total = 0;
    for (int i = 0; i < count; i++) {
        int c = accept(l, NULL, NULL);
        if (c < 0)
            die("accept");
        total += check_pattern(c, n, 17);
        send_pattern(c, n, 29);
        close(c);
    }
    printf("ok %ld\n", total);
    return 0;
}

static int client(int port, long n) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a) < 0)
        die("connect");
    send_pattern(c, n, 17);
    if (shutdown(c, SHUT_WR) < 0)
        die("shutdown");
    printf("ok %ld\n", check_pattern(c, n, 29));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "server") == 0)
        return serve(atoi(argv[2]), atoi(argv[3]), atol(argv[4]));
    if (argc == 4 && strcmp(argv[1], "client") == 0)
        return client(atoi(argv[2]), atol(argv[3]));
    fprintf(stderr, "usage: pair server PORT COUNT BYTES | pair client PORT BYTES\n");
    return 2;
}
