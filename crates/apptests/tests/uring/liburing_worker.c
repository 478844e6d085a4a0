/* A worker on liburing that a dispatcher hands a connection with
 * SCM_RIGHTS: receives one descriptor on the UNIX socket FD, then reads 4
 * bytes from it and writes them back, both through io_uring. Usage:
 * liburing_worker FD. Exits 0 after the echo, 2 when the read or write
 * fails, 1 when no descriptor came. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "recv_fd.h"
#include "ring_op.h"

int main(int argc, char **argv) {
    if (argc != 2) return 1;
    struct io_uring r;
    if (io_uring_queue_init(4, &r, 0)) return 1;
    int fd = recv_fd(atoi(argv[1]));
    if (fd < 0) return 1;
    char b[4];
    io_uring_prep_recv(io_uring_get_sqe(&r), fd, b, 4, MSG_WAITALL);
    int k = ring_op(&r);
    if (k != 4) {
        fprintf(stderr, "liburing_worker: read: %s\n", k < 0 ? strerror(-k) : "short");
        return 2;
    }
    io_uring_prep_send(io_uring_get_sqe(&r), fd, b, 4, 0);
    return ring_op(&r) == 4 ? 0 : 2;
}
