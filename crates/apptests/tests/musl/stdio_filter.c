/* The exec tests' filter through C stdio: every byte read from stdin
 * (fread) is written to stdout (fwrite) complemented, then the trailer
 * "stdio N\n" (printf). fileno must still name 0 and 1.
 *
 * usage: stdio_filter */
#include <stdio.h>

int main(void) {
    if (fileno(stdin) != 0 || fileno(stdout) != 1) {
        fprintf(stderr, "fileno: %d %d\n", fileno(stdin), fileno(stdout));
        return 3;
    }
    char buf[4096];
    long total = 0;
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) {
        for (size_t i = 0; i < n; i++)
            buf[i] = (char)~buf[i];
        if (fwrite(buf, 1, n, stdout) != n) {
            perror("fwrite");
            return 3;
        }
        total += (long)n;
    }
    if (ferror(stdin)) {
        perror("fread");
        return 3;
    }
    printf("stdio %ld\n", total);
    return fflush(stdout) == 0 ? 0 : 3;
}
