/* A listener made by a process that forks a child to accept on it, then
 * closes its own copy (as a program that daemonizes after it listens
 * lets go of it): the child's listener still serves SMC-D. The parent
 * then connects as a client twice, each time sending 100 pattern bytes
 * and reading them back. The first connection finds no registration (the
 * parent's went with its copy) and stays TCP; the child, accepting a
 * client that did not propose, registers the listener again, so the
 * second is SMC-D.
 *
 * MODE "exit": the process that listens forks the server and exits
 * without closing (a daemon's first process); its registration's owner is
 * gone, and the test's main process (a subreaper, so that the server
 * becomes its child) connects twice the same way.
 *
 * Usage: listener_fork MODE, MODE "close" or "exit". Prints
 * "OK <bytes read>". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <string.h>
#include <sys/wait.h>

#include "check.h"

#define N 100

#define CONNS 2

/* Reads N bytes from `fd` into `b`, failing with `what` short of them. */
static void read_full(int fd, char *b, const char *what) {
    ssize_t got = 0;
    while (got < N) {
        ssize_t r = read(fd, b + got, N - got);
        if (r <= 0)
            fail(what);
        got += r;
    }
}

static void serve(int l) {
    for (int k = 0; k < CONNS; k++) {
        int s = accept(l, NULL, NULL);
        if (s < 0)
            fail("accept");
        char b[N];
        read_full(s, b, "server read");
        if (write(s, b, N) != N)
            fail("server write");
        close(s);
    }
    exit(0);
}

/* One connection to `a`: N pattern bytes there and back. */
static void echo(struct sockaddr_in *a) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)a, sizeof *a) < 0)
        fail("connect");
    char b[N];
    for (int i = 0; i < N; i++)
        b[i] = pat(i);
    if (write(c, b, N) != N)
        fail("client write");
    read_full(c, b, "client read");
    for (int i = 0; i < N; i++)
        if ((unsigned char)b[i] != pat(i))
            fail("byte %d", i);
    close(c);
}

/* Listens on a loopback port (written to `a`). */
static int listener(struct sockaddr_in *a) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    *a = (struct sockaddr_in){.sin_family = AF_INET};
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof *a;
    if (l < 0 || bind(l, (struct sockaddr *)a, sizeof *a) < 0 || listen(l, 4) < 0 ||
        getsockname(l, (struct sockaddr *)a, &alen) < 0)
        fail("listener");
    return l;
}

/* Forks the server on `l`; returns its pid. It dies with its parent
 * where that is the test's main process, and is bounded in time anyway
 * (in mode "exit" its parent is meant to go first). */
static pid_t fork_server(int l, int die_with_parent) {
    pid_t child = fork();
    if (child < 0)
        fail("fork");
    if (child == 0) {
        if (die_with_parent)
            prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(30);
        serve(l);
    }
    return child;
}

int main(int argc, char **argv) {
    mode = argc > 1 ? argv[1] : "close";
    struct sockaddr_in a;
    if (strcmp(mode, "exit") == 0) {
        if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
            fail("subreaper");
        int p[2];
        if (pipe(p) < 0)
            fail("pipe");
        pid_t first = fork();
        if (first < 0)
            fail("fork");
        if (first == 0) {
            int l = listener(&a);
            fork_server(l, 0);
            if (write(p[1], &a, sizeof a) != sizeof a)
                fail("pipe write");
            _exit(0);
        }
        if (read(p[0], &a, sizeof a) != sizeof a)
            fail("pipe read");
        int st;
        if (waitpid(first, &st, 0) != first)
            fail("the listening process");
    } else {
        int l = listener(&a);
        fork_server(l, 1);
        close(l);
    }
    for (int k = 0; k < CONNS; k++)
        echo(&a);
    int st;
    if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail("server");
    printf("OK %d\n", CONNS * N);
    return 0;
}
