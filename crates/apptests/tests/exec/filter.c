/* A filter on stdin and stdout: every byte read is written back
 * complemented, then a trailer "filter N\n" with the byte count once stdin
 * ends. With an argument, it execs that program (with the remaining
 * arguments) first after copying that many bytes, so that a chain of execs
 * carries the stream on.
 *
 * usage: filter [BYTES PROGRAM [ARGS...]] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void put(const char *b, size_t n) {
    while (n > 0) {
        ssize_t w = write(1, b, n);
        if (w <= 0) {
            perror("write");
            exit(3);
        }
        b += w;
        n -= (size_t)w;
    }
}

int main(int argc, char **argv) {
    long limit = argc > 2 ? atol(argv[1]) : -1;
    char buf[65536];
    long total = 0;
    for (;;) {
        size_t want = sizeof buf;
        if (limit >= 0 && (long)want > limit - total)
            want = (size_t)(limit - total);
        if (want == 0)
            break;
        ssize_t n = read(0, buf, want);
        if (n < 0) {
            perror("read");
            return 3;
        }
        if (n == 0)
            break;
        for (ssize_t i = 0; i < n; i++)
            buf[i] = (char)~buf[i];
        put(buf, (size_t)n);
        total += n;
    }
    if (limit >= 0) {
        execv(argv[2], argv + 2);
        perror("execv");
        return 3;
    }
    char t[64];
    int k = snprintf(t, sizeof t, "filter %ld\n", total);
    put(t, (size_t)k);
    return 0;
}
