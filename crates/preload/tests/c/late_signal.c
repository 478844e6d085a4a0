/* A signal that comes once a wait was called but before it began to wait
 * ends it: the preload's own work comes first, and a signal that arrives
 * in one of its sections (here: while the wait takes the descriptor
 * table's lock, which another thread's fork holds for 400 ms) runs its
 * handler when the section ends. The kernel would have ended the call for
 * it; so must the wait that follows (EINTR), and not spin and then sleep
 * as if nothing came. Each of poll, select, epoll_wait and a blocking recv
 * on an idle SMC-D connection, 5 s, and a blocking accept on a listening
 * socket no client connects to, with a SIGUSR1 handler without
 * SA_RESTART sent 30 ms into the call (a second one 3 s later rescues a
 * wait the first did not end). Linked with late_atfork.so. Prints "WAIT
 * name rc errno ms handled" per wait and "OK done". */
#define _GNU_SOURCE
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/wait.h>

void late_atfork_arm(int fd, int ms);

static volatile sig_atomic_t handled;
static int fd;

static void on_usr1(int sig) {
    (void)sig;
    handled++;
}

static int w_poll(void) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 5000);
}

static int w_select(void) {
    fd_set r;
    FD_ZERO(&r);
    FD_SET(fd, &r);
    struct timeval tv = {5, 0};
    return select(fd + 1, &r, NULL, NULL, &tv);
}

static int ep = -1;

static int w_epoll(void) {
    struct epoll_event ev;
    return epoll_wait(ep, &ev, 1, 5000);
}

static int w_recv(void) {
    char b;
    return recv(fd, &b, 1, 0);
}

static int lfd = -1;

static int w_accept(void) {
    return accept(lfd, NULL, NULL);
}

/* Forks; the child leaves at once. */
static void *forker(void *arg) {
    (void)arg;
    pid_t p = fork();
    if (p == 0) _exit(0);
    if (p < 0 || waitpid(p, NULL, 0) != p) fail("fork");
    return NULL;
}

struct shot {
    pthread_t to;
    volatile int done;
};

static void *shooter(void *arg) {
    struct shot *s = arg;
    usleep(30000);
    pthread_kill(s->to, SIGUSR1);
    for (int i = 0; i < 300 && !s->done; i++) usleep(10000);
    if (!s->done) pthread_kill(s->to, SIGUSR1);
    return NULL;
}

static void run(const char *name, int (*wait)(void)) {
    int n[2];
    if (pipe(n)) fail("pipe");
    late_atfork_arm(n[1], 400);
    pthread_t f, s;
    if (pthread_create(&f, NULL, forker, NULL)) fail("pthread_create");
    char c;
    if (read(n[0], &c, 1) != 1) fail("the prepare handler's byte");
    /* The fork's thread holds the table's lock for 400 ms from now. */
    struct shot shot = {.to = pthread_self()};
    handled = 0;
    if (pthread_create(&s, NULL, shooter, &shot)) fail("pthread_create");
    double t0 = now_ms();
    errno = 0;
    int r = wait();
    int e = errno;
    double t = now_ms() - t0;
    shot.done = 1;
    pthread_join(s, NULL);
    pthread_join(f, NULL);
    close(n[0]);
    close(n[1]);
    printf("WAIT %s %d %d %.0f %d\n", name, r, r < 0 ? e : 0, t, (int)handled);
}

/* The peer, in a process of its own: accepts, never writes, and exits
 * when the parent closes `done`. */
static void peer(int port, int done) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &al))
        fail("listen");
    if (write(port, &a, sizeof a) != sizeof a) fail("port");
    if (accept(l, NULL, NULL) < 0) fail("accept");
    char b;
    while (read(done, &b, 1) < 0 && errno == EINTR) {}
    _exit(0);
}

int main(void) {
    mode = "late_signal";
    setvbuf(stdout, NULL, _IOLBF, 0);
    int port[2], done[2];
    if (pipe(port) || pipe(done)) fail("pipe");
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        close(done[1]);
        peer(port[1], done[0]);
    }
    close(done[0]);
    struct sockaddr_in a;
    if (read(port[0], &a, sizeof a) != sizeof a) fail("port");
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (void *)&a, sizeof a)) fail("connect");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL)) fail("sigaction");
    ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) fail("epoll");
    run("poll", w_poll);
    run("select", w_select);
    run("epoll_wait", w_epoll);
    run("recv", w_recv);
    struct sockaddr_in la = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (void *)&la, sizeof la) || listen(lfd, 4)) fail("listener");
    run("accept", w_accept);
    close(done[1]);
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st)) fail("peer");
    printf("OK done\n");
    return 0;
}
