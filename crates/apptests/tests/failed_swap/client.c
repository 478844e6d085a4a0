/* A client whose kernel refuses fcntl(F_DUPFD_CLOEXEC) with EMFILE (a
 * seccomp filter, installed after start-up): smclo's handshake still
 * completes (its descriptors may stay at low numbers), but the swap cannot
 * hide the TCP socket. Prints what the program then sees on its socket:
 * "RESET" (ECONNRESET), "EAGAIN" (an idle connection), or another result. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#else
#error "unsupported architecture"
#endif

static void refuse_dupfd_cloexec(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_fcntl, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, F_DUPFD_CLOEXEC, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EMFILE),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("seccomp");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: client PORT\n");
        return 2;
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    refuse_dupfd_cloexec();
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        printf("CONNECT %s\n", strerror(errno));
        return 1;
    }
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
    if (n < 0 && errno == ECONNRESET)
        printf("RESET\n");
    else if (n < 0 && errno == EAGAIN)
        printf("EAGAIN\n");
    else
        printf("RECV %zd %s\n", n, n < 0 ? strerror(errno) : "");
    fflush(stdout);
    /* Keep the connection until the server has seen what it sees. */
    sleep(3);
    return 0;
}
