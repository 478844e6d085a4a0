/* A UDP socket bound to the port of a TCP listener (a server that answers
 * on both, as DNS servers do) leaves the TCP connections that ended on
 * that port as TCP leaves them: the server closed one first, its client
 * still holds its end, whose TCP connection saw an orderly close (a FIN),
 * not an abort. The client's getpeername, answered by its TCP socket,
 * still names the server, as after a FIN over TCP; after an RST it fails
 * with ENOTCONN.
 *
 * Usage: deferred_bind udp. Prints "OK <bytes read>". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "check.h"

/* Server: accepts one connection, writes one byte, closes it, binds a
 * UDP socket to the listener's port, then says so on `done`. */
static void server(int l, struct sockaddr_in a, int done) {
    int c = accept(l, NULL, NULL);
    if (c < 0)
        fail("accept");
    if (write(c, "x", 1) != 1)
        fail("server write");
    close(c);
    int u = socket(AF_INET, SOCK_DGRAM, 0);
    if (u < 0 || bind(u, (struct sockaddr *)&a, sizeof a) < 0)
        fail("bind a UDP socket to the listener's port");
    if (write(done, "d", 1) != 1)
        fail("write done");
    char b;
    /* Until the client is done. */
    if (read(done, &b, 1) < 0)
        fail("read");
    exit(0);
}

int main(int argc, char **argv) {
    mode = argc > 1 ? argv[1] : "udp";
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp) < 0)
        fail("socketpair");
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 ||
        getsockname(l, (struct sockaddr *)&a, &alen) < 0)
        fail("bind the listener");
    pid_t child = fork();
    if (child < 0)
        fail("fork");
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(sp[0]);
        if (listen(l, 4) < 0)
            fail("listen");
        if (write(sp[1], "r", 1) != 1)
            fail("write ready");
        server(l, a, sp[1]);
    }
    close(l);
    close(sp[1]);
    char b;
    if (read(sp[0], &b, 1) != 1)
        fail("read ready");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a) < 0)
        fail("connect");
    if (read(c, &b, 1) != 1 || b != 'x')
        fail("read the byte");
    if (read(c, &b, 1) != 0)
        fail("the end of the stream");
    if (read(sp[0], &b, 1) != 1)
        fail("read done");
    /* Time for an RST, had there been one, to reach this end. */
    usleep(50000);
    struct sockaddr_in p;
    socklen_t plen = sizeof p;
    if (getpeername(c, (struct sockaddr *)&p, &plen) < 0)
        fail("getpeername after the server closed and bound a UDP socket to its port");
    if (p.sin_port != a.sin_port)
        fail("getpeername names port %d, not %d", ntohs(p.sin_port), ntohs(a.sin_port));
    close(c);
    close(sp[0]);
    int st;
    if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail("server");
    printf("OK 1\n");
    return 0;
}
