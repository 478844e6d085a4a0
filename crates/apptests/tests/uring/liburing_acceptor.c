/* A server on liburing handed its listener by the program that made it
 * (a socket-passing supervisor that listens, then forks and execs the
 * server, or sends it the listener with SCM_RIGHTS): accepts one
 * connection on the listener through io_uring, reads 4 bytes from it and
 * writes them back, all through the ring. Prints "ready" once it has its
 * ring and its listener. Usage: liburing_acceptor FD (the listener), or
 * liburing_acceptor recv FD (a UNIX socket on which the listener comes).
 * Exits 0 after the echo, 2 when an operation fails, 1 on bad use. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "recv_fd.h"
#include "ring_op.h"

int main(int argc, char **argv) {
    int received = argc == 3 && !strcmp(argv[1], "recv");
    if (argc != 2 && !received) return 1;
    struct io_uring r;
    if (io_uring_queue_init(4, &r, 0)) return 1;
    int l = received ? recv_fd(atoi(argv[2])) : atoi(argv[1]);
    if (l < 0) return 1;
    puts("ready");
    fflush(stdout);
    io_uring_prep_accept(io_uring_get_sqe(&r), l, NULL, NULL, 0);
    int c = ring_op(&r);
    if (c < 0) {
        fprintf(stderr, "liburing_acceptor: accept: %s\n", strerror(-c));
        return 2;
    }
    char b[4];
    io_uring_prep_recv(io_uring_get_sqe(&r), c, b, 4, MSG_WAITALL);
    int k = ring_op(&r);
    if (k != 4) {
        fprintf(stderr, "liburing_acceptor: read: %s\n", k < 0 ? strerror(-k) : "short");
        return 2;
    }
    io_uring_prep_send(io_uring_get_sqe(&r), c, b, 4, 0);
    return ring_op(&r) == 4 ? 0 : 2;
}
