/*
 * smoke.c - exercises include/smclo.h from C; driven by tests/c_api.rs.
 *
 *   smoke smc PORT        connect to an echo server that runs smclo
 *                         (smclo-testpeer serve ... echo): must be SMC-D
 *   smoke tcp PORT        connect to a plain TCP echo server: must fall back
 *                         with PEERNOSMC, data still exact
 *   smoke listen TESTPEER listen, let `TESTPEER connect ADDR sink` connect,
 *                         send 1 MiB, check the count and hash it returns
 *   smoke poller PORTA,PORTB  connect to two smclo echo servers and run a
 *                         request/response loop over both with a poller
 *                         (and a pipe beside them)
 *   smoke nbaccept TESTPEER  a non-blocking listener beside `TESTPEER stopper
 *                         ADDR`, stopped before it answers the handshake:
 *                         smclo_accept returns EAGAIN at once and the
 *                         listener's descriptor stays quiet; continued, the
 *                         client's handshake decides, the descriptor becomes
 *                         readable and the connection is SMC-D, then as listen
 *   smoke shrink PORT     as smc, then with its own SIGBUS handler (which asks
 *                         smclo_fault_recover first) truncates the device
 *                         file: the stream is reset, the process lives, and
 *                         a fault in its own mapping reaches its own handler
 *
 * Every failed check prints its line and exits with status 1.
 */
#include "smclo.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(c)                                                               \
    do {                                                                       \
        if (!(c)) {                                                            \
            fprintf(stderr, "smoke.c:%d: check failed: %s (errno %d: %s)\n",   \
                    __LINE__, #c, errno, strerror(errno));                     \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define TOTAL (1024 * 1024)
#define CHUNK (16 * 1024)

static uint64_t fnv(uint64_t h, const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static void fill(unsigned char *p, size_t n, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        p[i] = (unsigned char)*seed;
    }
}

static void write_all(smclo_stream *s, const unsigned char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = smclo_write(s, p, n);
        CHECK(k > 0);
        p += k;
        n -= (size_t)k;
    }
}

/* Waits (at most 10 s) until smclo_fd reports readable. */
static void wait_readable(smclo_stream *s)
{
    struct pollfd pfd = { .fd = smclo_fd(s), .events = POLLIN };
    CHECK(pfd.fd >= 0);
    int r;
    do {
        r = poll(&pfd, 1, 10000);
    } while (r < 0 && errno == EINTR);
    CHECK(r == 1);
    CHECK(pfd.revents & (POLLIN | POLLHUP));
}

static void read_exact(smclo_stream *s, unsigned char *p, size_t n)
{
    while (n > 0) {
        wait_readable(s);
        ssize_t k = smclo_read(s, p, n);
        CHECK(k > 0);
        p += k;
        n -= (size_t)k;
    }
}

/* 1 MiB through the echo in chunks, checksummed both ways; one zero-copy
 * round; poll; half-close, then end of stream. */
static void echo_workload(smclo_stream *s)
{
    static unsigned char out[CHUNK], in[CHUNK];
    uint64_t seed = 88172645463325252ull;
    uint64_t h_out = 0xcbf29ce484222325ull, h_in = h_out;

    for (size_t done = 0; done < TOTAL; done += CHUNK) {
        fill(out, CHUNK, &seed);
        h_out = fnv(h_out, out, CHUNK);
        write_all(s, out, CHUNK);
        read_exact(s, in, CHUNK);
        h_in = fnv(h_in, in, CHUNK);
        CHECK(memcmp(in, out, CHUNK) == 0);
    }
    CHECK(h_in == h_out);

    /* Zero copy: reserve/commit 100 bytes, the echo returns them, peek/release. */
    size_t len = 0;
    unsigned char *w = smclo_reserve(s, 100, &len);
    CHECK(w != NULL);
    CHECK(len >= 100);
    errno = 0;
    CHECK(smclo_reserve(s, 1, &len) == NULL && errno == EBUSY);
    errno = 0;
    CHECK(smclo_write(s, "x", 1) == -1 && errno == EBUSY);
    for (int i = 0; i < 100; i++)
        w[i] = (unsigned char)(i * 7 + 1);
    CHECK(smclo_commit(s, 100) == 0);
    errno = 0;
    CHECK(smclo_commit(s, 0) == -1 && errno == EINVAL);

    size_t got = 0;
    while (got < 100) {
        /* Poll only before the first peek: on a TCP connection the bytes a
         * peek fetched but did not consume sit in a local buffer, which the
         * socket's readiness does not reflect (peek itself blocks as needed). */
        if (got == 0)
            wait_readable(s);
        const unsigned char *r = smclo_peek(s, &len);
        CHECK(r != NULL);
        CHECK(len > 0 && got + len <= 100);
        errno = 0;
        CHECK(smclo_read(s, in, 1) == -1 && errno == EBUSY);
        for (size_t i = 0; i < len; i++)
            CHECK(r[i] == (unsigned char)((got + i) * 7 + 1));
        /* Release in two steps: the rest is seen again by the next peek. */
        if (len > 1) {
            CHECK(smclo_release(s, 1) == 0);
            got += 1;
            continue;
        }
        CHECK(smclo_release(s, len) == 0);
        got += len;
    }
    errno = 0;
    CHECK(smclo_release(s, 0) == -1 && errno == EINVAL);

    /* Non-blocking: nothing is pending now. */
    CHECK(smclo_set_nonblocking(s, 1) == 0);
    errno = 0;
    CHECK(smclo_read(s, in, sizeof in) == -1 && errno == EAGAIN);
    CHECK(smclo_set_nonblocking(s, 0) == 0);

    /* Half-close: the echo sees end of stream, finishes, and so do we. */
    write_all(s, (const unsigned char *)"tail", 4);
    CHECK(smclo_shutdown_write(s) == 0);
    read_exact(s, in, 4);
    CHECK(memcmp(in, "tail", 4) == 0);
    wait_readable(s);
    CHECK(smclo_read(s, in, sizeof in) == 0);
    const void *eof = smclo_peek(s, &len);
    CHECK(eof != NULL && len == 0);
    CHECK(smclo_release(s, 0) == 0);
}

static void null_checks(void)
{
    size_t len;
    errno = 0;
    CHECK(smclo_connect(NULL, 1) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(smclo_listen(NULL, 0) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(smclo_read(NULL, &len, 1) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(smclo_is_smc(NULL) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(smclo_reserve(NULL, 1, &len) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(smclo_peek(NULL, &len) == NULL && errno == EINVAL);
    smclo_close(NULL);
    smclo_listener_close(NULL);
    CHECK(strcmp(smclo_reason_name(0), "-") == 0);
    CHECK(strcmp(smclo_reason_name(SMCLO_REASON_PEERNOSMC), "PEERNOSMC") == 0);
    CHECK(strcmp(smclo_reason_name(0x7fffffffu), "UNKNOWN") == 0);
}

/* Starts `testpeer ARGS... 127.0.0.1:<l's port> [last]`. */
static pid_t spawn_peer(const char *testpeer, smclo_listener *l, const char *mode,
                        const char *last)
{
    uint16_t port = smclo_listener_port(l);
    CHECK(port != 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)port);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* A failed check exits: the client must not outlive it (stopped,
         * it would hold the test's output pipe open). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execl(testpeer, testpeer, mode, addr, last, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Sends 1 MiB on s to a sink client and checks its count and hash, then
 * closes s and l and waits for the client (pid) to succeed. */
static void serve_sink(smclo_stream *s, smclo_listener *l, pid_t pid)
{

    static unsigned char buf[CHUNK];
    uint64_t seed = 12345, h = 0xcbf29ce484222325ull;
    for (size_t done = 0; done < TOTAL; done += CHUNK) {
        fill(buf, CHUNK, &seed);
        h = fnv(h, buf, CHUNK);
        write_all(s, buf, CHUNK);
    }
    CHECK(smclo_shutdown_write(s) == 0);
    unsigned char res[16];
    read_exact(s, res, 16);
    uint64_t n = 0, h2 = 0;
    for (int i = 7; i >= 0; i--) {
        n = (n << 8) | res[i];
        h2 = (h2 << 8) | res[8 + i];
    }
    CHECK(n == TOTAL);
    CHECK(h2 == h);
    smclo_close(s);
    smclo_listener_close(l);

    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* The C side listens; smclo-testpeer connects with the sink workload. */
static void listen_workload(const char *testpeer)
{
    smclo_listener *l = smclo_listen("127.0.0.1", 0);
    CHECK(l != NULL);
    CHECK(smclo_listener_fd(l) >= 0);
    pid_t pid = spawn_peer(testpeer, l, "connect", "sink");

    struct pollfd pfd = { .fd = smclo_listener_fd(l), .events = POLLIN };
    CHECK(poll(&pfd, 1, 10000) == 1);
    smclo_stream *s = smclo_accept(l);
    CHECK(s != NULL);
    CHECK(smclo_is_smc(s) == 1);
    CHECK(smclo_fallback_reason(s) == 0);
    serve_sink(s, l, pid);
}

static int64_t ms_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* A non-blocking listener never waits on a stopped client (see the usage
 * at the top). */
static void nbaccept_workload(const char *testpeer)
{
    smclo_listener *l = smclo_listen("127.0.0.1", 0);
    CHECK(l != NULL);
    CHECK(smclo_listener_set_nonblocking(l, 1) == 0);
    pid_t pid = spawn_peer(testpeer, l, "stopper", NULL);
    int st;
    CHECK(waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st));

    struct pollfd pfd = { .fd = smclo_listener_fd(l), .events = POLLIN };
    CHECK(poll(&pfd, 1, 10000) == 1);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    errno = 0;
    CHECK(smclo_accept(l) == NULL && errno == EAGAIN);
    int64_t took = ms_since(&t0);
    printf("accept took %lld ms\n", (long long)took);
    CHECK(took < 25);
    CHECK(poll(&pfd, 1, 300) == 0);

    CHECK(kill(pid, SIGCONT) == 0);
    CHECK(poll(&pfd, 1, 10000) == 1);
    smclo_stream *s = smclo_accept(l);
    CHECK(s != NULL);
    CHECK(smclo_is_smc(s) == 1);
    CHECK(smclo_fallback_reason(s) == 0);
    serve_sink(s, l, pid);
}

/* A handler as the header asks for: it tells smclo it ran. */
static void on_usr1(int sig)
{
    smclo_signal_handler_ran(sig);
}

/* Two SMC-D streams and a pipe in one poller: the timeout, writability,
 * 2000 rounds of 64 bytes each way over both streams (byte-checked), the
 * pipe, removal. */
static void poller_workload(const char *ports)
{
    uint16_t pa = (uint16_t)atoi(ports), pb = (uint16_t)atoi(strchr(ports, ',') + 1);
    smclo_stream *s[2] = { smclo_connect("127.0.0.1", pa), smclo_connect("127.0.0.1", pb) };
    CHECK(s[0] != NULL && s[1] != NULL);
    CHECK(smclo_is_smc(s[0]) == 1 && smclo_is_smc(s[1]) == 1);
    int pp[2];
    CHECK(pipe(pp) == 0);
    smclo_poller *p = smclo_poller_new();
    CHECK(p != NULL);
    CHECK(smclo_poller_add(p, s[0], POLLIN, 0) == 0);
    CHECK(smclo_poller_add(p, s[1], POLLIN, 1) == 0);
    CHECK(smclo_poller_add_fd(p, pp[0], POLLIN, 2) == 0);
    errno = 0;
    CHECK(smclo_poller_add(p, NULL, POLLIN, 3) == -1 && errno == EINVAL);

    smclo_event ev[4];
    struct timespec t0;
    /* A handler that ran before the wait began does not end it. */
    CHECK(signal(SIGUSR1, on_usr1) != SIG_ERR);
    CHECK(raise(SIGUSR1) == 0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK(smclo_poller_wait(p, ev, 4, 100) == 0);
    int64_t dt = ms_since(&t0);
    CHECK(dt >= 100 && dt < 1000);

    CHECK(smclo_poller_add(p, s[1], POLLIN | POLLOUT, 1) == 0);
    CHECK(smclo_poller_wait(p, ev, 4, 0) == 1);
    CHECK(ev[0].token == 1 && ev[0].events == POLLOUT);
    CHECK(smclo_poller_add(p, s[1], POLLIN, 1) == 0);

    CHECK(smclo_set_nonblocking(s[0], 1) == 0 && smclo_set_nonblocking(s[1], 1) == 0);
    uint64_t got[2] = { 0, 0 };
    for (uint64_t r = 0; r < 2000; r++) {
        unsigned char msg[64];
        for (int i = 0; i < 64; i++)
            msg[i] = (unsigned char)((r * 64 + i) * 131 + 7);
        write_all(s[0], msg, 64);
        write_all(s[1], msg, 64);
        while (got[0] < (r + 1) * 64 || got[1] < (r + 1) * 64) {
            int n = smclo_poller_wait(p, ev, 4, 5000);
            CHECK(n > 0);
            for (int i = 0; i < n; i++) {
                CHECK(ev[i].token < 2 && ev[i].events == POLLIN);
                uint64_t *g = &got[ev[i].token];
                /* One read per report, as a level-triggered loop does. */
                unsigned char in[256];
                ssize_t k = smclo_read(s[ev[i].token], in, sizeof in);
                CHECK(k > 0);
                for (ssize_t j = 0; j < k; j++)
                    CHECK(in[j] == (unsigned char)((*g + j) * 131 + 7));
                *g += k;
            }
        }
    }

    CHECK(write(pp[1], "x", 1) == 1);
    CHECK(smclo_poller_wait(p, ev, 4, 2000) == 1);
    CHECK(ev[0].token == 2 && ev[0].events == POLLIN);

    CHECK(smclo_poller_remove(p, s[1]) == 0);
    errno = 0;
    CHECK(smclo_poller_remove(p, s[1]) == -1 && errno == ENOENT);
    CHECK(smclo_poller_remove(p, s[0]) == 0);
    CHECK(smclo_poller_remove_fd(p, pp[0]) == 0);
    smclo_poller_free(p);
    smclo_poller_free(NULL);
    smclo_close(s[0]);
    smclo_close(s[1]);
    close(pp[0]);
    close(pp[1]);
}

static sigjmp_buf own_jb;
static volatile sig_atomic_t recovered, own;

/* A handler installed after smclo's, as the header asks: smclo first. */
static void on_bus(int sig, siginfo_t *si, void *ctx)
{
    (void)sig;
    (void)ctx;
    if (smclo_fault_recover(si)) {
        recovered++;
        return;
    }
    own++;
    siglongjmp(own_jb, 1);
}

static void shrink_workload(uint16_t port)
{
    smclo_stream *s = smclo_connect("127.0.0.1", port);
    CHECK(s != NULL);
    CHECK(smclo_is_smc(s) == 1);
    unsigned char b[100] = { 7 }, back[100];
    write_all(s, b, sizeof b);
    read_exact(s, back, sizeof back);
    CHECK(memcmp(b, back, sizeof b) == 0);
    struct sigaction sa = { .sa_sigaction = on_bus, .sa_flags = SA_SIGINFO };
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGBUS, &sa, NULL) == 0);
    char dev[4096];
    snprintf(dev, sizeof dev, "%s/device", getenv("SMCLO_DEVICE_DIR"));
    CHECK(truncate(dev, 0) == 0);
    /* The write's byte count lands in the device: a fault, recovered. */
    ssize_t w = smclo_write(s, b, sizeof b);
    ssize_t r = smclo_read(s, b, sizeof b);
    printf("write %zd read %zd errno %d recovered %d\n", w, r, errno, (int)recovered);
    CHECK(recovered >= 1);
    CHECK(r == -1 && errno == ECONNRESET);
    smclo_close(s);
    /* A fault of the program's own: its handler gets it. */
    char path[] = "/dev/shm/smclo-capi-own-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0 && unlink(path) == 0 && ftruncate(fd, 4096) == 0);
    volatile char *p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED && ftruncate(fd, 0) == 0);
    if (sigsetjmp(own_jb, 1) == 0) {
        (void)p[0];
        CHECK(!"no fault");
    }
    CHECK(own == 1);
    close(fd);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc != 3) {
        fprintf(stderr, "usage: smoke smc|tcp PORT | smoke listen|nbaccept TESTPEER\n");
        return 2;
    }
    null_checks();
    if (strcmp(argv[1], "poller") == 0) {
        poller_workload(argv[2]);
        printf("ok poller\n");
        return 0;
    }
    if (strcmp(argv[1], "listen") == 0) {
        listen_workload(argv[2]);
        printf("ok listen\n");
        return 0;
    }
    if (strcmp(argv[1], "nbaccept") == 0) {
        nbaccept_workload(argv[2]);
        printf("ok nbaccept\n");
        return 0;
    }
    if (strcmp(argv[1], "shrink") == 0) {
        shrink_workload((uint16_t)atoi(argv[2]));
        printf("ok shrink\n");
        return 0;
    }
    int want_smc = strcmp(argv[1], "smc") == 0;
    CHECK(want_smc || strcmp(argv[1], "tcp") == 0);
    uint16_t port = (uint16_t)atoi(argv[2]);

    smclo_stream *s = smclo_connect("127.0.0.1", port);
    CHECK(s != NULL);
    CHECK(smclo_is_smc(s) == want_smc);
    if (want_smc) {
        CHECK(smclo_fallback_reason(s) == 0);
    } else {
        CHECK(smclo_fallback_reason(s) == SMCLO_REASON_PEERNOSMC);
        CHECK(strcmp(smclo_reason_name(smclo_fallback_reason(s)), "PEERNOSMC") == 0);
    }
    echo_workload(s);
    smclo_close(s);
    printf("ok %s\n", argv[1]);
    return 0;
}
