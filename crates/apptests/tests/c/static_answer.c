/* A server that never loads the preload (the test links it statically):
 * it accepts on the listener it inherits as descriptor 3 (LISTEN_FDS, as
 * systemd-socket-activate passes it), reads a request line from each of
 * `count` clients and answers "answer\n", then exits. It never speaks
 * first, as an HTTP server does not.
 *
 * usage: static_answer COUNT */
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 1;
    for (int i = 0; i < count; i++) {
        int c = accept(3, NULL, NULL);
        if (c < 0) {
            perror("accept");
            return 1;
        }
        char b[256];
        ssize_t n, got = 0;
        while (got < (ssize_t)sizeof b && (n = read(c, b + got, sizeof b - got)) > 0) {
            got += n;
            if (b[got - 1] == '\n')
                break;
        }
        if (write(c, "answer\n", 7) != 7)
            perror("write");
        close(c);
    }
    return 0;
}
