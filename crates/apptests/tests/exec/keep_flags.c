/* Socket state across exec. `keep_flags serve PORT` accepts one
 * connection, reads the request line, sets O_NONBLOCK, SO_RCVTIMEO
 * (300 ms), SO_SNDTIMEO (700 ms) and TCP_CORK on it and execs itself as
 * `keep_flags check FD`, which reports what it finds on that same
 * descriptor number, one line each, to the peer:
 *   nonblock 1 / rcvtimeo 300 / sndtimeo 700 / cork 1
 *   eagain      (a read with nothing to read, non-blocking)
 *   timeout     (a blocking read with nothing to read ends within 0.2..3 s)
 * then uncorks, which publishes the lines, and exits. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void say(int fd, const char *line) {
    size_t n = strlen(line);
    if (write(fd, line, n) != (ssize_t)n)
        die("write");
}

static int ms_of(int fd, int name) {
    struct timeval tv;
    socklen_t len = sizeof tv;
    if (getsockopt(fd, SOL_SOCKET, name, &tv, &len))
        die("getsockopt");
    return (int)(tv.tv_sec * 1000 + tv.tv_usec / 1000);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int check(int fd) {
    char line[64], b[16];
    snprintf(line, sizeof line, "nonblock %d\n", (fcntl(fd, F_GETFL) & O_NONBLOCK) != 0);
    say(fd, line);
    snprintf(line, sizeof line, "rcvtimeo %d\n", ms_of(fd, SO_RCVTIMEO));
    say(fd, line);
    snprintf(line, sizeof line, "sndtimeo %d\n", ms_of(fd, SO_SNDTIMEO));
    say(fd, line);
    int cork = 0;
    socklen_t len = sizeof cork;
    if (getsockopt(fd, IPPROTO_TCP, TCP_CORK, &cork, &len))
        die("TCP_CORK");
    snprintf(line, sizeof line, "cork %d\n", cork);
    say(fd, line);
    if (read(fd, b, sizeof b) < 0 && errno == EAGAIN)
        say(fd, "eagain\n");
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    double t0 = now();
    ssize_t r = read(fd, b, sizeof b);
    double took = now() - t0;
    if (r < 0 && errno == EAGAIN && took > 0.2 && took < 3)
        say(fd, "timeout\n");
    cork = 0;
    if (setsockopt(fd, IPPROTO_TCP, TCP_CORK, &cork, sizeof cork))
        die("uncork");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "check"))
        return check(atoi(argv[2]));
    if (argc != 3 || strcmp(argv[1], "serve"))
        return 2;
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4))
        die("listen");
    int c = accept(l, NULL, NULL);
    if (c < 0)
        die("accept");
    char ch;
    do {
        if (read(c, &ch, 1) != 1)
            die("request line");
    } while (ch != '\n');
    struct timeval rcv = {0, 300000}, snd = {0, 700000};
    if (setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &rcv, sizeof rcv) ||
        setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &snd, sizeof snd) ||
        setsockopt(c, IPPROTO_TCP, TCP_CORK, &one, sizeof one))
        die("setsockopt");
    fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK);
    close(l);
    char fd[16];
    snprintf(fd, sizeof fd, "%d", c);
    execl(argv[0], argv[0], "check", fd, (char *)NULL);
    die("execl");
}
