/* Signal handlers that call socket functions while the thread they
 * interrupt is inside the same functions: POSIX lists socket, bind,
 * listen, connect and close as async-signal-safe, so a program may.
 * A 100 µs interval timer's SIGALRM handler makes a TCP socket and closes
 * it (mode `socket`), or makes a listener and closes it (mode `listen`),
 * while the main thread does the same for `seconds`. In mode `close`, the
 * main thread connects to a server of a forked child, which echoes a
 * byte, and hands the connection to the handler, which closes it (the old way to bound a
 * call with `alarm`), and makes and closes sockets while it waits. Prints
 * `OK <loops> <handler runs>`; a hang is the failure (the caller's
 * timeout). */
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>

static int listen_mode, close_mode;
static struct sockaddr_in server;
/* A connection for the handler to close, or -1. */
static volatile sig_atomic_t handed = -1;
static volatile sig_atomic_t handled;
static volatile sig_atomic_t failed_errno;

/* One socket made and closed; a listener on 127.0.0.1 in mode `listen`.
 * Returns 0, or the errno of the call that failed. */
static int cycle(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        return errno;
    if (listen_mode) {
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(s, (struct sockaddr *)&a, sizeof a) < 0 || listen(s, 4) < 0) {
            int e = errno;
            close(s);
            return e;
        }
    }
    if (close(s) < 0)
        return errno;
    return 0;
}

/* A child that accepts and closes connections until killed; `server`
 * is its address. */
static void serve(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    server.sin_family = AF_INET;
    server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof server;
    if (l < 0 || bind(l, (struct sockaddr *)&server, sizeof server) < 0 || listen(l, 128) < 0 ||
        getsockname(l, (struct sockaddr *)&server, &len) < 0)
        fail("listener");
    pid_t pid = fork();
    if (pid < 0)
        fail("fork");
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (;;) {
            int c = accept(l, NULL, NULL);
            char b;
            if (c >= 0 && read(c, &b, 1) == 1)
                (void)!write(c, &b, 1);
            if (c >= 0)
                close(c);
        }
    }
    close(l);
}

static void on_alarm(int sig) {
    (void)sig;
    int saved = errno;
    int e = 0;
    if (!close_mode)
        e = cycle();
    else if (handed >= 0 && close(handed) < 0)
        e = errno;
    else if (handed >= 0)
        handed = -1;
    else
        return;
    if (e && !failed_errno)
        failed_errno = e;
    handled++;
    errno = saved;
}

int main(int argc, char **argv) {
    if (argc != 3)
        fail("usage: handler_calls socket|listen|close SECONDS");
    mode = argv[1];
    listen_mode = strcmp(mode, "listen") == 0;
    close_mode = strcmp(mode, "close") == 0;
    double seconds = atof(argv[2]);
    if (close_mode)
        serve();
    struct sigaction sa = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) < 0)
        fail("sigaction");
    struct itimerval it = {{0, 100}, {0, 100}};
    if (setitimer(ITIMER_REAL, &it, NULL) < 0)
        fail("setitimer");
    double end = now_ms() + seconds * 1e3;
    long loops = 0;
    while (now_ms() < end) {
        if (close_mode && handed < 0) {
            int c = socket(AF_INET, SOCK_STREAM, 0);
            char b = 'x';
            if (c < 0 || connect(c, (struct sockaddr *)&server, sizeof server) < 0)
                fail("connect %ld", loops);
            /* One byte each way: the connection is in use, SMC-D or not. */
            while (write(c, &b, 1) < 0)
                if (errno != EINTR)
                    fail("write %ld", loops);
            ssize_t n;
            while ((n = read(c, &b, 1)) < 0 && errno == EINTR)
                ;
            if (n != 1)
                fail("read %ld", loops);
            handed = c;
        }
        int e = cycle();
        if (e) {
            errno = e;
            fail("cycle %ld", loops);
        }
        loops++;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    if (failed_errno) {
        errno = failed_errno;
        fail("the handler's cycle");
    }
    printf("OK %ld %d\n", loops, (int)handled);
    return 0;
}
