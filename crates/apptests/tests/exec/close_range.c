/* close_range as the kernel's: an empty range (first > last) is EINVAL,
 * the program's own descriptors in a range are closed, those outside it
 * stay open. Prints "ok" or what differed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
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
    printf("ok\n");
    return 0;
}
