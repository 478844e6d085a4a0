/* What the preload's C test programs share: failing loudly with the
 * program's mode and pid (the Rust side shows stdout), the byte pattern
 * the data is checked against, and a monotonic clock. Each program sets
 * `mode` from its arguments. */
#ifndef SMCLO_TEST_CHECK_H
#define SMCLO_TEST_CHECK_H

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *mode = "";

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "FAIL [%s %d] ", mode, (int)getpid());
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, " (errno %d %s)\n", errno, strerror(errno));
    fflush(stdout);
    va_end(ap);
    exit(1);
}

/* The byte at offset `i` of a checked stream. */
static inline unsigned char pat(uint64_t i) { return (unsigned char)(i * 131 + (i >> 11) + 7); }

static inline double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

#endif
