/* An inetd-style program on liburing: reads 4 bytes from its standard
 * input and writes them to its standard output, both through io_uring (a
 * server that execs it with the connection as both, as socat's
 * EXEC:...,nofork does). Exits 0 after the echo, 1 when a read or write
 * fails. */
#include <stdio.h>
#include <string.h>

#include "ring_op.h"

int main(void) {
    struct io_uring r;
    char b[4];
    int got = 0;
    if (io_uring_queue_init(4, &r, 0)) return 1;
    while (got < 4) {
        io_uring_prep_read(io_uring_get_sqe(&r), 0, b + got, 4 - got, 0);
        int k = ring_op(&r);
        if (k <= 0) {
            fprintf(stderr, "liburing_echo: read: %s\n", k < 0 ? strerror(-k) : "end of stream");
            return 1;
        }
        got += k;
    }
    io_uring_prep_write(io_uring_get_sqe(&r), 1, b, 4, 0);
    return ring_op(&r) == 4 ? 0 : 1;
}
