/* An inetd-style program on liburing: reads 4 bytes from its standard
 * input and writes them to its standard output, both through io_uring (a
 * server that execs it with the connection as both, as socat's
 * EXEC:...,nofork does). Exits 0 after the echo, 1 when a read or write
 * fails. */
#include <liburing.h>
#include <stdio.h>
#include <string.h>

static int op(struct io_uring *r) {
    struct io_uring_cqe *c;
    io_uring_submit(r);
    if (io_uring_wait_cqe(r, &c)) return -1;
    int res = c->res;
    io_uring_cqe_seen(r, c);
    return res;
}

int main(void) {
    struct io_uring r;
    char b[4];
    int got = 0;
    if (io_uring_queue_init(4, &r, 0)) return 1;
    while (got < 4) {
        io_uring_prep_read(io_uring_get_sqe(&r), 0, b + got, 4 - got, 0);
        int k = op(&r);
        if (k <= 0) {
            fprintf(stderr, "liburing_echo: read: %s\n", k < 0 ? strerror(-k) : "end of stream");
            return 1;
        }
        got += k;
    }
    io_uring_prep_write(io_uring_get_sqe(&r), 1, b, 4, 0);
    return op(&r) == 4 ? 0 : 1;
}
