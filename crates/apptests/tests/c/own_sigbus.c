/* A program with its own SIGBUS handler, for tests/group.rs: under smclo
 * run, with an SMC-D connection open (the device and its DMBs mapped), its
 * handler still gets its own faults and sent SIGBUS, a query answers with
 * its handler, and the default action still kills.
 *
 *   own_sigbus PORT FILE   FILE: a scratch file it may create
 *
 * Prints one line per check ("own fault handled", "query answers", "sent
 * handled", "signal() fault handled", "default kills", "echo ok"), then
 * ignores SIGBUS and execs a shell that prints its "SigIgn:" line. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>

static sigjmp_buf jb;
static volatile sig_atomic_t hits;
static void *volatile fault_at;
static volatile int fault_code;

static void fail(const char *what) {
    perror(what);
    exit(1);
}

static void on_bus(int sig, siginfo_t *si, void *ctx) {
    (void)sig;
    (void)ctx;
    hits++;
    fault_at = si->si_addr;
    fault_code = si->si_code;
    siglongjmp(jb, 1);
}

static void on_bus_plain(int sig) {
    (void)sig;
    hits++;
    siglongjmp(jb, 1);
}

/* A page of FILE mapped shared, the file then truncated: any access faults. */
static volatile char *shrunk_page(const char *file) {
    int fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, 4096) != 0)
        fail("scratch file");
    char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        fail("mmap");
    p[0] = 1;
    if (ftruncate(fd, 0) != 0)
        fail("ftruncate");
    close(fd);
    return p;
}

static int echo_once(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0)
        fail("connect");
    char out[64] = "own handler", in[64];
    size_t n = strlen(out), got = 0;
    if (write(s, out, n) != (ssize_t)n)
        fail("write");
    while (got < n) {
        ssize_t r = read(s, in + got, n - got);
        if (r <= 0)
            fail("read");
        got += r;
    }
    if (memcmp(in, out, n) != 0)
        fail("echo differs");
    return s;
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    /* Stays open: the device and both DMBs stay mapped. */
    int conn = echo_once(atoi(argv[1]));
    printf("echo ok\n");

    struct sigaction sa = {0}, old = {0};
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0)
        fail("sigaction");
    if (sigaction(SIGBUS, NULL, &old) != 0)
        fail("sigaction query");
    if (old.sa_sigaction == on_bus && (old.sa_flags & SA_SIGINFO))
        printf("query answers\n");

    volatile char *p = shrunk_page(argv[2]);
    if (sigsetjmp(jb, 1) == 0) {
        (void)p[0];
        printf("no fault\n");
        return 1;
    }
    if (hits == 1 && fault_at == (void *)p && fault_code == BUS_ADRERR)
        printf("own fault handled\n");

    if (sigsetjmp(jb, 1) == 0) {
        kill(getpid(), SIGBUS);
        printf("sent not handled\n");
        return 1;
    }
    if (hits == 2 && fault_code == SI_USER)
        printf("sent handled\n");

    if (signal(SIGBUS, on_bus_plain) == SIG_ERR)
        fail("signal");
    if (sigsetjmp(jb, 1) == 0) {
        (void)p[0];
        return 1;
    }
    if (hits == 3)
        printf("signal() fault handled\n");

    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
        signal(SIGBUS, SIG_DFL);
        (void)p[0];
        _exit(0);
    }
    int st;
    if (c < 0 || waitpid(c, &st, 0) != c)
        fail("fork");
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS)
        printf("default kills\n");
    close(conn);
    /* An ignored SIGBUS stays ignored in the program it execs: the shell
     * (without the preload, which would put its handler in front again)
     * prints its SigIgn mask. */
    if (signal(SIGBUS, SIG_IGN) == SIG_ERR)
        fail("signal");
    fflush(stdout);
    char *env[] = {"PATH=/usr/bin:/bin", NULL};
    execle("/bin/sh", "sh", "-c", "grep SigIgn /proc/self/status", (char *)NULL, env);
    fail("exec");
}
