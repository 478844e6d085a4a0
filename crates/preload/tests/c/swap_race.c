/* A number replaced while its non-blocking connect's handshake decides.
 * Each round: a non-blocking connect to a server (a child process),
 * thread A polls the socket for writability (which drives the handshake
 * to its decision and the swap), and thread B `dup2`s a pipe onto the
 * socket's number once the swap has begun: when a second descriptor of
 * the socket appears among smclo's high numbers (the swap hides the TCP
 * socket there before it puts the channel at the program's number). The
 * test runs it under `strace`, which holds each `fcntl` a while after it
 * returned, so that B finds A there. Once B's `dup2` has returned, the
 * number is the pipe's: nothing the program does not ask for may replace
 * it, as over TCP. A swap that does not look again, under the table's
 * lock, whether the number still names the socket it decided for puts
 * the connection's channel there.
 *
 * Usage: swap_race ROUNDS. Prints "OK <rounds> (<n> raced)", n the
 * rounds whose dup2 came once the swap had begun, or "FAIL ..." and
 * exits 1 when a round's number is no longer the pipe. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "check.h"

/* Above the program's descriptors. */
#define HIGH_FROM 256
/* Numbers looked at around where the calibrating round's hidden socket
 * was. */
#define SCAN 2
/* Rounds without a race first: the first connection makes smclo's own
 * descriptors, the second finds where its hidden socket goes. */
#define CALIBRATE 2

static int lfd;
static int pipe_r;
/* The client socket of the round, and its local port. */
static int cfd;
static int cport;
/* Where the calibrating round's hidden socket was. */
static int high_from = HIGH_FROM;
static _Atomic int poll_done;
static pthread_t poller_thread;
static _Atomic int b_running;
/* Rounds whose dup2 came once the swap had begun. */
static long raced;

/* Accepts `rounds` connections, one at a time, each read until its end. */
static void server(long rounds) {
    for (long r = 0; r < rounds; r++) {
        int s = accept(lfd, NULL, NULL);
        if (s < 0)
            fail("accept");
        char b[64];
        while (read(s, b, sizeof b) > 0)
            ;
        close(s);
    }
    exit(0);
}

static void *poller(void *arg) {
    (void)arg;
    struct pollfd p = {.fd = cfd, .events = POLLOUT};
    /* The number may be the pipe's by the time poll looks: any answer. */
    poll(&p, 1, 3000);
    atomic_store(&poll_done, 1);
    return NULL;
}

/* Whether `fd` (any number) is a TCP socket bound to local port `port`,
 * asked of the kernel (the system call, not the interposed function). */
static int same_port(int fd, int port) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    if (syscall(SYS_getsockname, fd, &a, &len) != 0)
        return 0;
    return a.sin_family == AF_INET && ntohs(a.sin_port) == port;
}

/* The high descriptor that is another of the round's socket, or -1. */
static int hidden_socket(void) {
    for (int n = high_from - SCAN; n <= high_from + SCAN; n++)
        if (n != cfd && same_port(n, cport))
            return n;
    return -1;
}

static void *replacer(void *arg) {
    (void)arg;
    atomic_store(&b_running, 1);
    while (!atomic_load(&poll_done)) {
        if (hidden_socket() >= 0) {
            raced++;
            break;
        }
        sched_yield();
    }
    if (dup2(pipe_r, cfd) != cfd)
        fail("dup2 of the pipe onto the socket's number");
    return NULL;
}

/* Where the round's socket is hidden (found once the swap is done). */
static int find_hidden(void) {
    for (int n = HIGH_FROM; n < 65536; n++)
        if (n != cfd && same_port(n, cport))
            return n;
    fail("no hidden TCP socket: the first connection is not SMC-D");
    return -1;
}

int main(int argc, char **argv) {
    mode = "swap_race";
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    int p[2];
    if (pipe(p) < 0)
        fail("pipe");
    pipe_r = p[0];
    /* The server makes its own listener: a connection to a listener of
     * this process stays TCP. */
    int ready[2];
    if (pipe(ready) < 0)
        fail("pipe");
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    pid_t child = fork();
    if (child < 0)
        fail("fork");
    if (child == 0) {
        /* A client that failed never connects again. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        socklen_t alen = sizeof a;
        lfd = socket(AF_INET, SOCK_STREAM, 0);
        if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 16) < 0 ||
            getsockname(lfd, (struct sockaddr *)&a, &alen) < 0)
            fail("listener");
        if (write(ready[1], &a.sin_port, sizeof a.sin_port) != sizeof a.sin_port)
            fail("write the port");
        server(rounds);
    }
    if (read(ready[0], &a.sin_port, sizeof a.sin_port) != sizeof a.sin_port)
        fail("read the port");
    for (long r = 0; r < rounds; r++) {
        atomic_store(&poll_done, 0);
        atomic_store(&b_running, 0);
        /* A wait: the last round's hidden socket is closed now, so that
         * this round's goes where the calibrating round's went. */
        poll(NULL, 0, 1);
        cfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (cfd < 0)
            fail("socket");
        if (connect(cfd, (struct sockaddr *)&a, sizeof a) < 0 && errno != EINPROGRESS)
            fail("connect");
        struct sockaddr_in me;
        socklen_t mlen = sizeof me;
        if (getsockname(cfd, (struct sockaddr *)&me, &mlen) < 0)
            fail("getsockname");
        cport = ntohs(me.sin_port);
        pthread_t tb;
        int race = r >= CALIBRATE;
        if (race) {
            pthread_create(&tb, NULL, replacer, NULL);
            while (!atomic_load(&b_running))
                ;
        }
        pthread_create(&poller_thread, NULL, poller, NULL);
        pthread_join(poller_thread, NULL);
        if (race) {
            pthread_join(tb, NULL);
            struct stat sb;
            if (fstat(cfd, &sb) < 0)
                fail("fstat round %ld", r);
            if (!S_ISFIFO(sb.st_mode))
                fail("round %ld: the number the pipe was dup2'd onto is no longer the pipe "
                     "(mode %o)",
                     r, sb.st_mode & S_IFMT);
        } else {
            high_from = find_hidden();
        }
        close(cfd);
    }
    int status;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("server");
    printf("OK %ld (%ld raced)\n", rounds, raced);
    return 0;
}
