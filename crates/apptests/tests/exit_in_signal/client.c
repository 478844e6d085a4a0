/* Threads open, use and close SMC-D connections in a loop, or duplicate
 * and close one (the preload's table lock, malloc), while a SIGTERM
 * handler calls _exit: the exit must never wait for a lock that the
 * interrupted thread holds. Prints READY once every thread has completed
 * a round trip. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define THREADS 4

static int port;
static atomic_int ready;

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static int echo_connection(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        perror("connect");
        exit(1);
    }
    char c = 'x';
    if (send(fd, &c, 1, 0) != 1 || recv(fd, &c, 1, 0) != 1) {
        perror("echo");
        exit(1);
    }
    return fd;
}

static void block_sigterm(void) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &s, NULL);
}

/* New connections: the handshake, the swap, the last close. They keep
 * connections alive for the exit to close. */
static void *churn(void *arg) {
    (void)arg;
    block_sigterm();
    for (int round = 0;; round++) {
        close(echo_connection());
        if (round == 0)
            atomic_fetch_add(&ready, 1);
    }
    return NULL;
}

/* One connection, duplicated and closed: the table lock, held for writing
 * across each system call. SIGTERM goes to these threads. */
static void *dups(void *arg) {
    (void)arg;
    int fd = echo_connection();
    atomic_fetch_add(&ready, 1);
    for (;;) {
        int d = dup(fd);
        if (d < 0) {
            perror("dup");
            exit(1);
        }
        close(d);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: client PORT\n");
        return 2;
    }
    port = atoi(argv[1]);
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, i % 2 ? dups : churn, NULL);
    block_sigterm();
    while (atomic_load(&ready) < THREADS)
        usleep(1000);
    printf("READY\n");
    fflush(stdout);
    for (;;)
        pause();
}
