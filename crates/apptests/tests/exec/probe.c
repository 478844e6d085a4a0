/* What an exec'd program got on its standard input and output: the
 * domain of descriptors 0 and 1 (inet, unix, or the error) and whether
 * SMCLO_EXEC_CONNS is in its environment, as one line on stderr:
 * "probe fd0=inet fd1=inet env=absent". Then it reads its standard input
 * to the end (or an error) and exits 0.
 *
 * usage: probe */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char *domain(int fd) {
    int d = -1;
    socklen_t n = sizeof d;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &d, &n))
        return "none";
    return d == AF_INET ? "inet" : d == AF_INET6 ? "inet6" : d == AF_UNIX ? "unix" : "other";
}

int main(void) {
    fprintf(stderr, "probe fd0=%s fd1=%s env=%s\n", domain(0), domain(1),
            getenv("SMCLO_EXEC_CONNS") ? "present" : "absent");
    char buf[65536];
    while (read(0, buf, sizeof buf) > 0)
        ;
    return 0;
}
