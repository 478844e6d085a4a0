/* A SIGALRM handler due 1 s into the program's first listen, whose device
 * setup waits for a lock another process holds (the caller holds
 * <device>/pidns-* exclusively for a few seconds): the handler runs on
 * time, as the program's handlers run during any wait. Prints
 * `OK <ms at which the handler ran>`. */
#include "check.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

static double start, ran = -1;

static void on_alarm(int sig) {
    (void)sig;
    ran = now_ms() - start;
}

int main(void) {
    mode = "setup_signal";
    struct sigaction sa = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) < 0)
        fail("sigaction");
    start = now_ms();
    alarm(1);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) < 0 || listen(s, 1) < 0)
        fail("listen");
    printf("OK %.0f\n", ran);
    return 0;
}
