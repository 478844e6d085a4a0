/* io_uring made without liburing: with syscall(2) (as Rust's io-uring
 * crate does), or with the instruction itself (as a liburing linked in
 * statically does). Usage: raw_ring MODE PORT, each connection to
 * 127.0.0.1:PORT sending "ping" and reading its echo (the C library's
 * calls: the point is which connections smclo makes, not io_uring's I/O):
 *   syscall-between  a connection, then io_uring_setup through syscall(2),
 *                    then a second connection
 *   instruction-first  io_uring_setup with the syscall instruction, then a
 *                    connection
 *   dlopen-between   a connection, then dlopen of liburing (as a plugin or
 *                    an extension module that links it brings it in),
 *                    then a second connection
 *   listen-then-setup  listens on PORT, then sets a ring up through
 *                    syscall(2), prints "listening", and echoes the 4
 *                    bytes of one connection
 *   in-fork-handler  a listener (on a port of the kernel's choice) and a
 *                    connection, then a fork whose parent handler
 *                    (pthread_atfork) sets a ring up through syscall(2),
 *                    then a second connection; prints "listening" and
 *                    keeps the listener for 2 s
 *   prefork          listens on PORT and forks a worker, which sets a ring
 *                    up through syscall(2), prints "listening", and echoes
 *                    the 4 bytes of one connection
 *   prefork-ring-accept  as prefork, but the worker accepts the connection
 *                    through its ring (IORING_OP_ACCEPT), where smclo
 *                    never sees the accept
 * Prints "ok <connections>". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void fail(const char *what) {
    fprintf(stderr, "raw_ring: %s: %s\n", what, strerror(errno));
    exit(1);
}

static struct sockaddr_in addr(int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

/* A connection to PORT: "ping", its echo, close. */
static void ping(int port) {
    struct sockaddr_in a = addr(port);
    char b[4];
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (void *)&a, sizeof a)) fail("connect");
    if (write(s, "ping", 4) != 4) fail("write");
    if (recv(s, b, 4, MSG_WAITALL) != 4 || memcmp(b, "ping", 4)) fail("the echo");
    close(s);
}

/* Echoes the 4 bytes of one connection to listener l. */
static void echo_one(int l) {
    char b[4];
    int c = accept(l, NULL, NULL);
    if (c < 0 || recv(c, b, 4, MSG_WAITALL) != 4 || write(c, b, 4) != 4) fail("serve");
    close(c);
}

static int listener(int port) {
    struct sockaddr_in a = addr(port);
    int one = 1, l = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 8)) fail("listen");
    return l;
}

static int setup_with(struct io_uring_params *p) {
    memset(p, 0, sizeof *p);
    int fd = (int)syscall(SYS_io_uring_setup, 4, p);
    if (fd < 0) fail("io_uring_setup");
    return fd;
}

static int setup_by_syscall(void) {
    struct io_uring_params p;
    return setup_with(&p);
}

static void *ring_map(int ring, size_t len, off_t what) {
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, what);
    if (m == MAP_FAILED) fail("mmap of the ring");
    return m;
}

/* Accepts a connection on listener l through ring (set up with p): one
 * IORING_OP_ACCEPT submitted and waited for, without liburing. */
static int ring_accept(int ring, const struct io_uring_params *p, int l) {
    size_t sq_len = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    size_t cq_len = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    int single = p->features & IORING_FEAT_SINGLE_MMAP;
    if (single && cq_len > sq_len) sq_len = cq_len;
    char *sq = ring_map(ring, sq_len, IORING_OFF_SQ_RING);
    char *cq = single ? sq : ring_map(ring, cq_len, IORING_OFF_CQ_RING);
    struct io_uring_sqe *sqes =
        ring_map(ring, p->sq_entries * sizeof(struct io_uring_sqe), IORING_OFF_SQES);
    unsigned *tail = (unsigned *)(sq + p->sq_off.tail);
    unsigned t = *tail, i = t & *(unsigned *)(sq + p->sq_off.ring_mask);
    memset(&sqes[i], 0, sizeof sqes[i]);
    sqes[i].opcode = IORING_OP_ACCEPT;
    sqes[i].fd = l;
    ((unsigned *)(sq + p->sq_off.array))[i] = i;
    __atomic_store_n(tail, t + 1, __ATOMIC_RELEASE);
    if (syscall(SYS_io_uring_enter, ring, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
        fail("io_uring_enter");
    unsigned *head = (unsigned *)(cq + p->cq_off.head);
    unsigned h = *head;
    if (__atomic_load_n((unsigned *)(cq + p->cq_off.tail), __ATOMIC_ACQUIRE) == h) {
        errno = EAGAIN;
        fail("no completion");
    }
    struct io_uring_cqe *c = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    int res = c[h & *(unsigned *)(cq + p->cq_off.ring_mask)].res;
    __atomic_store_n(head, h + 1, __ATOMIC_RELEASE);
    if (res < 0) {
        errno = -res;
        fail("IORING_OP_ACCEPT");
    }
    return res;
}

static int setup_by_instruction(void) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    long r;
#if defined(__x86_64__)
    __asm__ volatile("syscall"
                     : "=a"(r)
                     : "0"((long)SYS_io_uring_setup), "D"(4L), "S"(&p)
                     : "rcx", "r11", "memory");
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = SYS_io_uring_setup;
    register long x0 __asm__("x0") = 4;
    register long x1 __asm__("x1") = (long)&p;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1) : "memory");
    r = x0;
#else
#error "the system call instruction of this machine"
#endif
    if (r < 0) {
        errno = (int)-r;
        fail("io_uring_setup");
    }
    return (int)r;
}

static void setup_in_handler(void) { setup_by_syscall(); }

int main(int argc, char **argv) {
    if (argc != 3) {
        errno = EINVAL;
        fail("usage: raw_ring MODE PORT");
    }
    const char *mode = argv[1];
    int port = atoi(argv[2]);
    if (!strcmp(mode, "syscall-between")) {
        ping(port);
        setup_by_syscall();
        ping(port);
        puts("ok 2");
    } else if (!strcmp(mode, "in-fork-handler")) {
        int l = listener(0);
        ping(port);
        if (pthread_atfork(NULL, setup_in_handler, NULL)) fail("pthread_atfork");
        pid_t child = fork();
        if (child < 0) fail("fork");
        if (child == 0) _exit(0);
        int st;
        if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the child");
        ping(port);
        puts("listening");
        fflush(stdout);
        sleep(2);
        close(l);
        puts("ok 2");
    } else if (!strcmp(mode, "dlopen-between")) {
        ping(port);
        if (!dlopen("liburing.so.2", RTLD_NOW)) {
            fprintf(stderr, "raw_ring: dlopen: %s\n", dlerror());
            exit(1);
        }
        ping(port);
        puts("ok 2");
    } else if (!strcmp(mode, "instruction-first")) {
        setup_by_instruction();
        ping(port);
        puts("ok 1");
    } else if (!strcmp(mode, "listen-then-setup")) {
        int l = listener(port);
        setup_by_syscall();
        puts("listening");
        fflush(stdout);
        echo_one(l);
        puts("ok 1");
    } else if (!strcmp(mode, "prefork") || !strcmp(mode, "prefork-ring-accept")) {
        int l = listener(port);
        fflush(stdout);
        pid_t worker = fork();
        if (worker < 0) fail("fork");
        if (worker == 0) {
            struct io_uring_params p;
            int ring = setup_with(&p);
            puts("listening");
            fflush(stdout);
            if (!strcmp(mode, "prefork")) {
                echo_one(l);
            } else {
                char b[4];
                int c = ring_accept(ring, &p, l);
                if (recv(c, b, 4, MSG_WAITALL) != 4 || write(c, b, 4) != 4) fail("serve");
                close(c);
            }
            _exit(0);
        }
        int st;
        if (waitpid(worker, &st, 0) != worker || !WIFEXITED(st) || WEXITSTATUS(st)) fail("the worker");
        puts("ok 1");
    } else {
        errno = EINVAL;
        fail("unknown mode");
    }
    return 0;
}
