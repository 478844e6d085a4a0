/* A wrapper on liburing that execs its arguments (a supervisor linked
 * with it, or a tool run in front of a server): sets a ring up and takes
 * it down, then execs ARGS. Usage: liburing_exec PROGRAM [ARGS...].
 * Exits 1 when the ring or the exec fails. */
#include <stdio.h>
#include <unistd.h>

#include <liburing.h>

int main(int argc, char **argv) {
    struct io_uring r;
    if (argc < 2 || io_uring_queue_init(4, &r, 0)) return 1;
    io_uring_queue_exit(&r);
    execvp(argv[1], argv + 1);
    perror("liburing_exec: exec");
    return 1;
}
