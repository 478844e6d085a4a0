/* An inetd-style server: accept, fork, and in the child read the request
 * line, answer a greeting, put the connection on stdin and stdout (dup2)
 * and exec the filter program given on the command line. Bytes the client
 * sent after the request line are still in flight at the exec, and so is
 * the greeting. The parent closes its copy at once and serves the next
 * client; it exits after `count` clients. With INETD_PLAIN set in its
 * environment, the program is started without LD_PRELOAD (execve with an
 * environment that lacks it). INETD_EXEC=execveat or fexecve starts it with
 * that function instead of execv. With INETD_SERVE_ON_FAIL set, a failed exec
 * is not fatal: the child serves the connection itself as the filter would
 * (complemented bytes, then "inline N\n"). INETD_USER=UID:GID makes the
 * child that user before the exec (real, effective and saved ids);
 * INETD_EUSER=UID:GID sets only its effective ids.
 *
 * usage: inetd PORT COUNT PROGRAM [ARGS...] */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* The environment without LD_PRELOAD. */
static char **plain_env(void) {
    size_t n = 0, k = 0;
    while (environ[n])
        n++;
    char **e = calloc(n + 1, sizeof *e);
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0)
            e[k++] = environ[i];
    return e;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* The user and group of INETD_USER or INETD_EUSER, if set. */
static void become(void) {
    unsigned uid, gid;
    const char *all = getenv("INETD_USER"), *eff = getenv("INETD_EUSER");
    if (all && sscanf(all, "%u:%u", &uid, &gid) == 2) {
        if (setgroups(0, NULL) || setresgid(gid, gid, gid) || setresuid(uid, uid, uid))
            die("INETD_USER");
    } else if (eff && sscanf(eff, "%u:%u", &uid, &gid) == 2) {
        if (setegid(gid) || seteuid(uid))
            die("INETD_EUSER");
    }
}

/* The request line, byte by byte: nothing after it is consumed. */
static void read_line(int fd) {
    char ch;
    do {
        if (read(fd, &ch, 1) != 1)
            die("request line");
    } while (ch != '\n');
}

/* The filter's work, on stdin and stdout, after a failed exec. */
static int serve_inline(void) {
    char buf[65536];
    long total = 0;
    ssize_t n;
    while ((n = read(0, buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < n; i++)
            buf[i] = (char)~buf[i];
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(1, buf + off, (size_t)(n - off));
            if (w <= 0)
                die("write");
            off += w;
        }
        total += n;
    }
    if (n < 0)
        die("read");
    char t[64];
    int k = snprintf(t, sizeof t, "inline %ld\n", total);
    if (write(1, t, (size_t)k) != k)
        die("trailer");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: inetd PORT COUNT PROGRAM [ARGS...]\n");
        return 2;
    }
    int count = atoi(argv[2]);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 16))
        die("listen");
    for (int i = 0; i < count; i++) {
        int c = accept(l, NULL, NULL);
        if (c < 0)
            die("accept");
        pid_t pid = fork();
        if (pid < 0)
            die("fork");
        if (pid == 0) {
            close(l);
            read_line(c);
            static const char hello[] = "hello from inetd\n";
            if (write(c, hello, sizeof hello - 1) != sizeof hello - 1)
                die("greeting");
            if (dup2(c, 0) < 0 || dup2(c, 1) < 0)
                die("dup2");
            close(c);
            become();
            const char *how = getenv("INETD_EXEC");
            if (getenv("INETD_PLAIN"))
                execve(argv[3], argv + 3, plain_env());
            else if (how && !strcmp(how, "execveat"))
                execveat(AT_FDCWD, argv[3], argv + 3, environ, 0);
            else if (how && !strcmp(how, "fexecve")) {
                int prog = open(argv[3], O_RDONLY | O_CLOEXEC);
                if (prog >= 0)
                    fexecve(prog, argv + 3, environ);
            } else
                execv(argv[3], argv + 3);
            if (getenv("INETD_SERVE_ON_FAIL"))
                return serve_inline();
            die("execv");
        }
        close(c);
    }
    int failed = 0, st;
    while (wait(&st) > 0)
        failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    return failed;
}
