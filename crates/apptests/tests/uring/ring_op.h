/* One io_uring operation, already prepared in the ring's next entry:
 * submitted and waited for. Its result: a count, or -errno. */
#include <liburing.h>

static int ring_op(struct io_uring *r) {
    struct io_uring_cqe *c;
    io_uring_submit(r);
    int e = io_uring_wait_cqe(r, &c);
    if (e) return e;
    int res = c->res;
    io_uring_cqe_seen(r, c);
    return res;
}
