/* Two connections to an echo server on 127.0.0.1:PORT, SIZE bytes each
 * way, checked; between them, every descriptor from 3 up is closed with
 * close_range: a raw syscall(SYS_close_range), as programs without the
 * libc wrapper do, or with WRAPPER set libc's close_range. Prints "ok" or
 * what failed. Usage: raw_close_range PORT SIZE */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static int one(int port, size_t size) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        perror("connect");
        return 1;
    }
    char *out = malloc(size), *in = malloc(size);
    for (size_t i = 0; i < size; i++)
        out[i] = (char)(i % 251);
    for (size_t n = 0; n < size;) {
        ssize_t w = write(s, out + n, size - n);
        if (w <= 0) {
            perror("write");
            return 1;
        }
        n += (size_t)w;
    }
    shutdown(s, SHUT_WR);
    size_t got = 0;
    for (;;) {
        ssize_t r = read(s, in + got, size - got);
        if (r < 0) {
            perror("read");
            return 1;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    if (got != size || memcmp(in, out, size) != 0) {
        printf("echo: %zu bytes back, want %zu\n", got, size);
        return 1;
    }
    close(s);
    free(out);
    free(in);
    return 0;
}

int main(int argc, char **argv) {
    int port = atoi(argv[1]);
    size_t size = (size_t)atol(argv[2]);
    if (one(port, size) != 0)
        return 1;
    int r = getenv("WRAPPER") ? close_range(3U, ~0U, 0) : (int)syscall(SYS_close_range, 3U, ~0U, 0);
    if (r != 0) {
        perror("close_range");
        return 1;
    }
    if (one(port, size) != 0)
        return 1;
    printf("ok\n");
    return 0;
}
