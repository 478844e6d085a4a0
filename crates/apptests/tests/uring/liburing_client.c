/* A client that connects with the C library and then sends and receives
 * through io_uring (liburing, linked dynamically): what a program built
 * on liburing does. Usage: liburing_client PORT; sends a message to
 * 127.0.0.1:PORT, expects it echoed, prints "ok <bytes>". The ring is made
 * after the connection, as a program that sets one up lazily does. */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ring_op.h"

static int fail(const char *what, int e) {
    fprintf(stderr, "liburing_client: %s: %s\n", what, strerror(e));
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) return fail("usage: liburing_client PORT", EINVAL);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || connect(s, (void *)&a, sizeof a)) return fail("connect", errno);
    struct io_uring r;
    int e = io_uring_queue_init(4, &r, 0);
    if (e) return fail("io_uring_queue_init", -e);
    char out[] = "a message through io_uring", in[64] = {0};
    size_t n = sizeof out - 1, got = 0;
    io_uring_prep_send(io_uring_get_sqe(&r), s, out, n, 0);
    int sent = ring_op(&r);
    if (sent != (int)n) return fail("send", sent < 0 ? -sent : EIO);
    while (got < n) {
        io_uring_prep_recv(io_uring_get_sqe(&r), s, in + got, n - got, 0);
        int k = ring_op(&r);
        if (k <= 0) return fail("recv", k < 0 ? -k : EPIPE);
        got += k;
    }
    if (memcmp(in, out, n)) return fail("the echo differs", EIO);
    printf("ok %zu\n", got);
    return 0;
}
