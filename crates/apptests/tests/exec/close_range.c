/* close_range as the kernel's: an empty range (first > last) is EINVAL,
 * the program's own descriptors in a range are closed, those outside it
 * stay open; with CLOSE_RANGE_CLOEXEC every descriptor of the range gets
 * close-on-exec, a TCP socket smclo knows of too. Prints "ok" or what
 * differed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

int main(void) {
    if (close_range(5, 3, 0) != -1 || errno != EINVAL) {
        printf("empty range: not EINVAL\n");
        return 1;
    }
    int a = open("/dev/null", O_RDONLY), b = open("/dev/null", O_RDONLY);
    int c = open("/dev/null", O_RDONLY);
    if (close_range((unsigned)a, (unsigned)b, 0) != 0) {
        perror("close_range");
        return 1;
    }
    if (fcntl(a, F_GETFD) != -1 || fcntl(b, F_GETFD) != -1 || fcntl(c, F_GETFD) == -1) {
        printf("wrong descriptors closed\n");
        return 1;
    }
    int s = socket(AF_INET, SOCK_STREAM, 0), d = open("/dev/null", O_RDONLY);
    if (s < 0 || d < 0 || close_range((unsigned)(s < d ? s : d), (unsigned)(s < d ? d : s),
                                      CLOSE_RANGE_CLOEXEC) != 0) {
        perror("close_range CLOSE_RANGE_CLOEXEC");
        return 1;
    }
    if (!(fcntl(s, F_GETFD) & FD_CLOEXEC) || !(fcntl(d, F_GETFD) & FD_CLOEXEC)) {
        printf("CLOSE_RANGE_CLOEXEC: socket %d, file %d without close-on-exec\n",
               !(fcntl(s, F_GETFD) & FD_CLOEXEC), !(fcntl(d, F_GETFD) & FD_CLOEXEC));
        return 1;
    }
    printf("ok\n");
    return 0;
}
