/* A fork handler that a library registered before the preload's runs
 * inside the preload's part of `fork`, which holds its descriptor table's
 * lock and its epoll sets' locks. Linked with late_atfork.so. Mode `send`:
 * the handler sends "h" on an SMC-D connection (reading the table is
 * allowed), then the parent "p"; the server reads "hp" and the program
 * prints `OK`. Mode `epoll`: the handler waits on an epoll set holding the
 * connection: the process must end with the reason (abort) rather than
 * wait for itself for ever. */
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>

void late_atfork_call(void (*fn)(void));

static int s = -1, ep = -1;

static void on_send(void) {
    if (send(s, "h", 1, 0) != 1)
        fail("send in the library's fork handler");
}

static void on_epoll(void) {
    struct epoll_event ev;
    epoll_wait(ep, &ev, 1, 0);
}

int main(int argc, char **argv) {
    if (argc != 2)
        fail("usage: late_fork send | epoll");
    mode = argv[1];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int port[2];
    if (pipe(port))
        fail("pipe");
    pid_t srv = fork();
    if (srv == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        socklen_t al = sizeof a;
        if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 4) ||
            getsockname(l, (void *)&a, &al) || write(port[1], &a, sizeof a) != sizeof a)
            fail("listen");
        int c = accept(l, NULL, NULL);
        char b[8] = {0};
        size_t got = 0;
        ssize_t r;
        while (got < sizeof b - 1 && (r = read(c, b + got, sizeof b - 1 - got)) > 0)
            got += r;
        _exit(strcmp(b, "hp") == 0 ? 0 : 1);
    }
    if (read(port[0], &a, sizeof a) != sizeof a)
        fail("the server's address");
    s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (void *)&a, sizeof a))
        fail("connect");
    if (strcmp(argv[1], "epoll") == 0) {
        ep = epoll_create1(0);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = s};
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev) || epoll_wait(ep, &ev, 1, 0) < 0)
            fail("epoll");
        late_atfork_call(on_epoll);
        kill(srv, SIGKILL);
    } else {
        late_atfork_call(on_send);
    }
    pid_t k = fork();
    if (k == 0)
        _exit(0);
    if (k < 0 || waitpid(k, NULL, 0) != k)
        fail("fork");
    if (send(s, "p", 1, 0) != 1 || close(s))
        fail("parent");
    int st;
    if (waitpid(srv, &st, 0) != srv || !WIFEXITED(st) || WEXITSTATUS(st))
        fail("the server did not read \"hp\"");
    printf("OK\n");
    return 0;
}
