/* A thread that changes a socket's epoll registration (EPOLL_CTL_MOD)
 * while another's epoll_wait drives the socket's non-blocking connect to
 * its decision and the swap, which moves the registration to the
 * connection's channel. Each round: a non-blocking connect to a server (a
 * child process) registered for EPOLLIN|EPOLLOUT, thread B modifying the
 * registration in a loop until the main thread's epoll_wait reports it
 * writable, then one byte each way. Over TCP every modification succeeds;
 * so must it under the preload: the registration is the program's all
 * along, also while the swap moves it (B's calls come every microsecond
 * or so, and a few hundred rounds find the swap under way).
 *
 * Usage: epoll_swap ROUNDS [SLICE_MS]: its waits last at most SLICE_MS
 * (default 10000), repeated until 10 s are up. Prints "OK <rounds> <modifications>", or
 * "FAIL ..." and exits 1 when a modification failed. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>

#include "check.h"

static int ep, sock;
static atomic_int stop;
static atomic_long mods;
static atomic_int failed_errno;

static void *modify(void *arg) {
    (void)arg;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.fd = sock};
    while (!atomic_load(&stop)) {
        if (epoll_ctl(ep, EPOLL_CTL_MOD, sock, &ev) < 0) {
            atomic_store(&failed_errno, errno);
            break;
        }
        atomic_fetch_add(&mods, 1);
    }
    return NULL;
}

/* A child that echoes one byte of each connection and waits for its end;
 * it makes the listener, so that its registration is its own. */
static struct sockaddr_in serve(void) {
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int p[2];
    if (pipe(p) < 0)
        fail("pipe");
    pid_t pid = fork();
    if (pid < 0)
        fail("fork");
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        socklen_t len = sizeof a;
        int l = socket(AF_INET, SOCK_STREAM, 0);
        if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 16) < 0 ||
            getsockname(l, (struct sockaddr *)&a, &len) < 0)
            fail("listener");
        if (write(p[1], &a, sizeof a) != sizeof a)
            fail("write the address");
        for (;;) {
            int c = accept(l, NULL, NULL);
            char b;
            if (c < 0)
                continue;
            if (read(c, &b, 1) == 1)
                (void)!write(c, &b, 1);
            while (read(c, &b, 1) > 0)
                ;
            close(c);
        }
    }
    if (read(p[0], &a, sizeof a) != sizeof a)
        fail("read the address");
    close(p[0]);
    close(p[1]);
    return a;
}

/* Waits until `sock` is reported with `events`, in waits of `slice_ms`,
 * for at most 10 s. */
static int slice_ms = 10000;
static void wait_for(uint32_t events, int round) {
    struct epoll_event got;
    double end = now_ms() + 10000;
    while (now_ms() < end) {
        int n = epoll_wait(ep, &got, 1, slice_ms);
        if (n < 0 && errno != EINTR)
            fail("round %d: epoll_wait", round);
        if (n > 0 && got.events & events)
            return;
    }
    fail("round %d: not reported in 10 s", round);
}

int main(int argc, char **argv) {
    mode = "epoll_swap";
    int rounds = argc > 1 ? atoi(argv[1]) : 10;
    if (argc > 2)
        slice_ms = atoi(argv[2]);
    struct sockaddr_in server = serve();
    ep = epoll_create1(0);
    if (ep < 0)
        fail("epoll_create1");
    for (int r = 0; r < rounds; r++) {
        sock = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (sock < 0)
            fail("socket");
        if (connect(sock, (struct sockaddr *)&server, sizeof server) < 0 && errno != EINPROGRESS)
            fail("round %d: connect", r);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.fd = sock};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, sock, &ev) < 0)
            fail("round %d: epoll_ctl ADD", r);
        atomic_store(&stop, 0);
        pthread_t b;
        if (pthread_create(&b, NULL, modify, NULL) != 0)
            fail("pthread_create");
        wait_for(EPOLLOUT, r);
        atomic_store(&stop, 1);
        pthread_join(b, NULL);
        if (atomic_load(&failed_errno)) {
            errno = atomic_load(&failed_errno);
            fail("round %d: epoll_ctl MOD of the connecting socket", r);
        }
        char c = 'x';
        while (write(sock, &c, 1) != 1)
            if (errno != EAGAIN)
                fail("round %d: write", r);
        wait_for(EPOLLIN, r);
        if (read(sock, &c, 1) != 1 || c != 'x')
            fail("round %d: read", r);
        if (epoll_ctl(ep, EPOLL_CTL_DEL, sock, NULL) < 0)
            fail("round %d: epoll_ctl DEL", r);
        close(sock);
    }
    printf("OK %d %ld\n", rounds, atomic_load(&mods));
    return 0;
}
