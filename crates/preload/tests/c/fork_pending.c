/* fork while another thread waits for an undecided handshake: a thread
 * makes a non-blocking connect to a server that never accepts (its
 * handshake stays undecided until SMCLO_CLC_WAIT_MS) and `dup`s the
 * socket, which waits for the decision; meanwhile the main thread forks.
 * fork waits for every undecided handshake, so that the child inherits
 * none; the child's own `dup` of the socket then returns at once. A child
 * that inherited the handshake while the other thread drove it finds it
 * undecided for ever: its `dup` never returns (the child's alarm ends it).
 *
 * Usage: fork_pending dup. Prints "OK 0". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "check.h"

static int fd;

static void *dupper(void *arg) {
    (void)arg;
    int d = dup(fd);
    if (d < 0)
        fail("dup in the thread");
    close(d);
    return NULL;
}

int main(int argc, char **argv) {
    mode = argc > 1 ? argv[1] : "dup";
    int sp[2];
    if (pipe(sp) < 0)
        fail("pipe");
    pid_t server = fork();
    if (server < 0)
        fail("fork the server");
    if (server == 0) {
        /* Listens, never accepts. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int l = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t alen = sizeof a;
        if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 4) < 0 ||
            getsockname(l, (struct sockaddr *)&a, &alen) < 0)
            fail("listener");
        if (write(sp[1], &a, sizeof a) != sizeof a)
            fail("write the address");
        pause();
        exit(0);
    }
    struct sockaddr_in a;
    if (read(sp[0], &a, sizeof a) != sizeof a)
        fail("read the address");
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0 || (connect(fd, (struct sockaddr *)&a, sizeof a) < 0 && errno != EINPROGRESS))
        fail("connect");
    pthread_t t;
    pthread_create(&t, NULL, dupper, NULL);
    /* The thread waits for the decision by now. */
    usleep(300000);
    pid_t child = fork();
    if (child < 0)
        fail("fork");
    if (child == 0) {
        alarm(5);
        int d = dup(fd);
        if (d < 0)
            fail("dup in the child");
        _exit(0);
    }
    int st;
    if (waitpid(child, &st, 0) != child)
        fail("waitpid");
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail("the child's dup did not return (status %#x)", st);
    pthread_join(t, NULL);
    kill(server, SIGKILL);
    waitpid(server, NULL, 0);
    printf("OK 0\n");
    return 0;
}
