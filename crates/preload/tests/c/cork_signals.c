/* Signals beside the preload's cork flusher, the thread that publishes
 * bytes corked for 200 ms (`MSG_MORE`, `TCP_CORK`) on SMC-D connections.
 *
 * Mode `signalfd`: the program corks a connection (the flusher starts),
 * then blocks SIGTERM in its thread and waits for it on a signalfd, the
 * usual way to take SIGTERM in an event loop, and sends itself SIGTERM
 * 20 times.
 * The signal must stay pending for the signalfd: delivered to the
 * flusher, which the program never made and cannot block it in, its
 * default action would end the process.
 *
 * Mode `spawn`: `rounds` children each make two connections, then cork
 * one while a 20 µs interval timer runs. The first corked write of a
 * process starts its flusher, which takes tens of microseconds with the
 * preload's cork queue locked; the SIGALRM handler corks the other
 * connection, which queues it too. A handler run inside the first must
 * not wait for its own thread. A child not done in 5 s is hung.
 *
 * Prints `OK <children or 1>`. */
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>

static struct sockaddr_in server;

/* A child that listens, accepts connections, echoes one byte on each
 * and keeps them until killed; `server` is its address. */
static void serve(void) {
    int p[2];
    if (pipe(p) < 0)
        fail("pipe");
    pid_t pid = fork();
    if (pid < 0)
        fail("fork");
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int l = socket(AF_INET, SOCK_STREAM, 0);
        server.sin_family = AF_INET;
        server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof server;
        if (l < 0 || bind(l, (struct sockaddr *)&server, sizeof server) < 0 ||
            listen(l, 128) < 0 || getsockname(l, (struct sockaddr *)&server, &len) < 0 ||
            write(p[1], &server, sizeof server) != sizeof server)
            fail("listener");
        for (;;) {
            int c = accept(l, NULL, NULL);
            char b;
            if (c >= 0 && read(c, &b, 1) == 1)
                (void)!write(c, &b, 1);
        }
    }
    if (read(p[0], &server, sizeof server) != sizeof server)
        fail("the server's address");
    close(p[0]);
    close(p[1]);
}

/* A connection to the server, used once each way: decided, SMC-D or
 * TCP, before it is corked. */
static int dial(void) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    char b = 'x';
    if (c < 0 || connect(c, (struct sockaddr *)&server, sizeof server) < 0)
        fail("connect");
    if (write(c, &b, 1) != 1 || read(c, &b, 1) != 1)
        fail("echo");
    return c;
}

static void cork(int c) {
    while (send(c, "x", 1, MSG_MORE) < 0)
        if (errno != EINTR)
            fail("send");
}

static void by_signalfd(void) {
    cork(dial());
    /* The flusher, started, waits for its deadline. */
    usleep(20000);
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    if (sigprocmask(SIG_BLOCK, &term, NULL) < 0)
        fail("sigprocmask");
    int sfd = signalfd(-1, &term, 0);
    if (sfd < 0)
        fail("signalfd");
    for (int i = 0; i < 20; i++) {
        if (kill(getpid(), SIGTERM) < 0)
            fail("kill");
        struct pollfd p = {.fd = sfd, .events = POLLIN};
        if (poll(&p, 1, 5000) != 1)
            fail("SIGTERM %d never reached the signalfd", i);
        struct signalfd_siginfo si;
        if (read(sfd, &si, sizeof si) != sizeof si || si.ssi_signo != SIGTERM)
            fail("signalfd read");
    }
    printf("OK 1\n");
}

static volatile sig_atomic_t go;
static int other = -1;

static void on_alarm(int sig) {
    (void)sig;
    if (!go)
        return;
    go = 0;
    int saved = errno;
    cork(other);
    errno = saved;
}

static void child(void) {
    int first = dial();
    other = dial();
    struct sigaction sa = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) < 0)
        fail("sigaction");
    struct itimerval it = {{0, 20}, {0, 20}};
    if (setitimer(ITIMER_REAL, &it, NULL) < 0)
        fail("setitimer");
    go = 1;
    cork(first);
    while (go)
        ;
    _exit(0);
}

static void spawn(int rounds) {
    int hung = 0;
    for (int i = 0; i < rounds; i++) {
        pid_t pid = fork();
        if (pid < 0)
            fail("fork");
        if (pid == 0)
            child();
        int status = 0;
        double end = now_ms() + 5000;
        pid_t w;
        while ((w = waitpid(pid, &status, WNOHANG)) == 0 && now_ms() < end)
            usleep(1000);
        if (w == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            hung++;
        } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fail("child %d: status %d", i, status);
        }
    }
    if (hung)
        fail("%d of %d children hung", hung, rounds);
    printf("OK %d\n", rounds);
}

int main(int argc, char **argv) {
    if (argc < 2)
        fail("usage: cork_signals signalfd | spawn ROUNDS");
    mode = argv[1];
    serve();
    if (strcmp(mode, "signalfd") == 0)
        by_signalfd();
    else if (strcmp(mode, "spawn") == 0 && argc == 3)
        spawn(atoi(argv[2]));
    else
        fail("unknown mode");
    return 0;
}
