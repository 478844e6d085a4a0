/* connect_rtt HOST PORT N: N connections to a redis server, one after the
 * other, each a blocking connect, PING, +PONG, close. Prints the median
 * and 90th percentile of connect()'s time and of the whole connection
 * (connect to close) in microseconds: "connect P50 P90 conn P50 P90". */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: connect_rtt HOST PORT N\n");
        return 2;
    }
    int n = atoi(argv[3]);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &sa.sin_addr) != 1 || n <= 0)
        return 2;
    double *conn = calloc(n, sizeof *conn), *whole = calloc(n, sizeof *whole);
    for (int i = 0; i < n; i++) {
        double t0 = now_us();
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
            perror("connect");
            return 1;
        }
        double t1 = now_us();
        if (write(fd, "PING\r\n", 6) != 6) {
            perror("write");
            return 1;
        }
        char buf[16];
        size_t got = 0;
        while (got < 7) {
            ssize_t r = read(fd, buf + got, sizeof buf - got);
            if (r <= 0) {
                perror("read");
                return 1;
            }
            got += r;
        }
        if (got != 7 || memcmp(buf, "+PONG\r\n", 7) != 0) {
            fprintf(stderr, "unexpected reply\n");
            return 1;
        }
        close(fd);
        conn[i] = t1 - t0;
        whole[i] = now_us() - t0;
    }
    qsort(conn, n, sizeof *conn, cmp);
    qsort(whole, n, sizeof *whole, cmp);
    printf("connect %.1f %.1f conn %.1f %.1f\n", conn[n / 2], conn[n * 9 / 10], whole[n / 2],
           whole[n * 9 / 10]);
    return 0;
}
