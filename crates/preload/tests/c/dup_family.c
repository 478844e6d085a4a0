/* Duplicates of a connection across fork and during a connect.
 *
 * Mode `fork-close` (a fork-per-connection server, inetd style): the
 * server accepts, forks a child that takes the connection at a dup and
 * closes the accepted number, then the parent closes its copy; the
 * child's reply must reach the client. Two rounds. Mode `fork-dup2`:
 * the same, but the child puts /dev/null at the accepted number with
 * `dup2` instead of closing it.
 *
 * Mode `fork-dup`: a thread is in a blocking connect (its server accepts
 * after 0.6 s) when the main thread forks; the child dups the socket,
 * which must return at once, as over TCP (within 2 s here): the connect
 * is the parent's, and the child has no thread to wait for.
 *
 * Mode `dup-pending`: a thread's blocking connect to a server met before
 * waits for a SYN retransmit (the server's accept queue is full), and
 * returns before the handshake decided; another thread dups the socket
 * meanwhile. The dup must name the connection: what is written through
 * either number reaches the server.
 *
 * Mode `fork-in-call`: a thread is in a blocking read of a connection
 * through a dup when the main thread closes the connection's own number
 * and forks. The number stays open in the parent until the read returns
 * (the read may use it), but in the child, which has no such read, it
 * must be closed.
 *
 * Mode `fork-handlers`: the program's fork handlers (`pthread_atfork`),
 * which glibc runs inside `fork` while the preload holds its descriptor
 * table's lock for the fork, send on the connection: "p" before the fork
 * (with MSG_MORE, so held for a moment),
 * "P" in the parent, "c" in the child; then the child sends "k" and
 * exits, the parent "x" and closes. The server reads all five. Before,
 * the first send aborted the process (the lock taken again).
 *
 * Mode `fork-held`: a write held back with MSG_MORE when the process
 * forks; the child then sends "c" and exits, the parent "P" and closes.
 * The server must read "pcP". Before, parent and child each published
 * their own copy of the held byte, and the server read "pc".
 *
 * Mode `fork-moved-first`: the child takes the connection at a dup,
 * closes the connection's own number (the channel moves), sends "k",
 * closes and exits, all before fork has returned in the parent (a parent
 * fork handler waits for it); then the parent sends "x" and closes. The
 * server reads "kx".
 *
 * Mode `exec-sibling-moved`: a fork child B keeps a copy and waits; the
 * parent execs itself (the connection goes with it; the new image lists
 * B "at the reader's own number"), forks C, which takes the connection at
 * a dup, closes the original number, sends "k" and closes; the new image
 * closes its copy; then B sends "x" and closes. The server reads "kx".
 *
 * Mode `fork-handler-epoll`: the program's fork handlers wait on an
 * epoll set that holds the connection (before the fork, in the parent,
 * in the child), and the child's handler also closes the set and takes
 * the connection at a dup, through which the child then sends "k"; the
 * parent sends "x". The server reads "k" and "x". Before, the first wait
 * aborted the process (the table's lock taken again).
 *
 * Prints `OK`. */
#include "check.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

static struct sockaddr_in a = {.sin_family = AF_INET};

/* Reads until end of stream (at most `cap - 1` bytes); NUL-terminated. */
static size_t read_all(int fd, char *b, size_t cap) {
    size_t got = 0;
    ssize_t r;
    while (got < cap - 1 && (r = read(fd, b + got, cap - 1 - got)) > 0)
        got += r;
    b[got] = 0;
    return got;
}

static void wait_ok(pid_t pid, const char *who) {
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail("%s: status %d", who, st);
}

static void fork_close(int by_dup2) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, sizeof a) || listen(l, 8) || getsockname(l, (void *)&a, &al))
        fail("listen");
    for (int round = 0; round < 2; round++) {
        pid_t cl = fork();
        if (cl == 0) {
            close(l);
            int c = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(c, (void *)&a, sizeof a) || write(c, "req", 3) != 3)
                fail("client");
            char b[64];
            read_all(c, b, sizeof b);
            if (strcmp(b, "reply-from-child"))
                fail("round %d: the client got \"%s\"", round, b);
            _exit(0);
        }
        int s = accept(l, NULL, NULL);
        char q[3];
        if (s < 0 || read(s, q, 3) != 3)
            fail("accept");
        int closed[2], go[2];
        if (pipe(closed) || pipe(go))
            fail("pipe");
        pid_t k = fork();
        if (k == 0) {
            int d = dup(s);
            char x = 1;
            int gone = by_dup2 ? dup2(open("/dev/null", O_RDONLY), s) != s : close(s);
            if (d < 0 || gone || write(closed[1], &x, 1) != 1 || read(go[0], &x, 1) != 1)
                fail("child");
            if (write(d, "reply-from-child", 16) != 16)
                fail("child write");
            _exit(close(d) ? 1 : 0);
        }
        char x;
        if (read(closed[0], &x, 1) != 1 || close(s) || write(go[1], &x, 1) != 1)
            fail("parent");
        wait_ok(k, "child");
        wait_ok(cl, "client");
        close(closed[0]), close(closed[1]), close(go[0]), close(go[1]);
    }
}

static int s;
static int connect_r = -2;

static void *connector(void *x) {
    (void)x;
    connect_r = connect(s, (void *)&a, sizeof a);
    return NULL;
}

/* The read end of the server child's "go" pipe. */
static int server_go;

/* A server child listening with `backlog` that does `run`; `a` is its
 * address. */
static pid_t serve(int backlog, void (*run)(int l, int go)) {
    int addr[2], go[2];
    if (pipe(addr) || pipe(go))
        fail("pipe");
    pid_t srv = fork();
    if (srv == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t al = sizeof a;
        if (bind(l, (void *)&a, sizeof a) || listen(l, backlog) ||
            getsockname(l, (void *)&a, &al) || write(addr[1], &a, sizeof a) != sizeof a)
            fail("listen");
        run(l, go[1]);
        _exit(0);
    }
    if (read(addr[0], &a, sizeof a) != sizeof a)
        fail("the server's address");
    server_go = go[0];
    return srv;
}

/* Waits for the server child's "go". */
static void wait_go(void) {
    char g;
    if (read(server_go, &g, 1) != 1)
        fail("the server's go");
}

static void accept_late(int l, int go) {
    if (write(go, "g", 1) != 1)
        fail("go");
    usleep(600000);
    int c = accept(l, NULL, NULL);
    char b;
    if (c < 0 || read(c, &b, 1) != 1)
        fail("server");
}

static void fork_dup(void) {
    pid_t srv = serve(8, accept_late);
    wait_go();
    s = socket(AF_INET, SOCK_STREAM, 0);
    pthread_t t;
    pthread_create(&t, NULL, connector, NULL);
    usleep(200000);
    pid_t k = fork();
    if (k == 0) {
        alarm(5);
        double t0 = now_ms();
        if (dup(s) < 0)
            fail("dup");
        _exit(now_ms() - t0 < 2000 ? 0 : 1);
    }
    pthread_join(t, NULL);
    if (connect_r != 0 || write(s, "x", 1) != 1)
        fail("connect %d", connect_r);
    wait_ok(k, "the child's dup (status 14: it never returned)");
    wait_ok(srv, "server");
}

/* The first contact, then the accept queue filled (listen backlog 0)
 * by two connections of its own that stay TCP, then three accepts:
 * the third is the client's, which must carry "helloWORLD". */
static void queue_full(int l, int go) {
    int c1 = accept(l, NULL, NULL);
    char b[64];
    if (c1 < 0)
        fail("accept");
    read_all(c1, b, sizeof b);
    close(c1);
    for (int i = 0; i < 2; i++) {
        int f = socket(AF_INET, SOCK_STREAM, 0);
        fcntl(f, F_SETFL, O_NONBLOCK);
        connect(f, (void *)&a, sizeof a);
    }
    usleep(100000);
    if (write(go, "g", 1) != 1)
        fail("go");
    usleep(600000);
    int c[3];
    for (int i = 0; i < 3; i++)
        if ((c[i] = accept(l, NULL, NULL)) < 0)
            fail("accept %d", i);
    fcntl(c[2], F_SETFL, 0);
    struct timeval tv = {5, 0};
    setsockopt(c[2], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    size_t got = 0;
    ssize_t r;
    while (got < 10 && (r = read(c[2], b + got, sizeof b - 1 - got)) > 0)
        got += r;
    b[got] = 0;
    if (strcmp(b, "helloWORLD"))
        fail("the server got \"%s\"", b);
}

static int d = -1;

static void *dupper(void *x) {
    (void)x;
    usleep(200000);
    d = dup(s);
    return NULL;
}

static void dup_pending(void) {
    pid_t srv = serve(0, queue_full);
    /* Met first, the server's next connection from this process returns
     * from connect before its handshake decided. */
    int c1 = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c1, (void *)&a, sizeof a) || write(c1, "x", 1) != 1)
        fail("first contact");
    close(c1);
    wait_go();
    s = socket(AF_INET, SOCK_STREAM, 0);
    pthread_t t;
    pthread_create(&t, NULL, dupper, NULL);
    if (connect(s, (void *)&a, sizeof a))
        fail("connect");
    pthread_join(t, NULL);
    if (d < 0 || write(s, "hello", 5) != 5 || write(d, "WORLD", 5) != 5)
        fail("write");
    struct stat ss, sd;
    if (fstat(s, &ss) || fstat(d, &sd) || ss.st_ino != sd.st_ino)
        fail("the dup names another file than the connection");
    wait_ok(srv, "server");
}

/* Accepts one connection, waits for a byte on `go`, then sends one. */
static void reply_on_go(int l, int go) {
    (void)go;
    int c = accept(l, NULL, NULL);
    char b;
    if (c < 0 || read(c, &b, 1) != 1 || write(c, "r", 1) != 1)
        fail("server");
}

static void *reader(void *x) {
    char b;
    if (read(*(int *)x, &b, 1) != 1)
        fail("reader");
    return NULL;
}

static void fork_in_call(void) {
    pid_t srv = serve(8, reply_on_go);
    s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a))
        fail("connect");
    int d = dup(s);
    pthread_t t;
    pthread_create(&t, NULL, reader, &d);
    usleep(100000);
    if (close(s))
        fail("close");
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", s);
    pid_t k = fork();
    if (k == 0)
        _exit(access(path, F_OK) == 0 ? 1 : 0);
    wait_ok(k, "child (status 256: the closed number was open in it)");
    if (write(d, "x", 1) != 1)
        fail("write");
    pthread_join(t, NULL);
    wait_ok(srv, "server");
}

/* Accepts one connection on `l` and reads it to its end into `b` (at
 * most `cap - 1` bytes, NUL-terminated); returns how many. */
static size_t accept_all(int l, char *b, size_t cap) {
    int c = accept(l, NULL, NULL);
    if (c < 0)
        fail("accept");
    return read_all(c, b, cap);
}

/* Connects `s` to the server at `a`. */
static void connect_s(void) {
    s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a))
        fail("connect");
}

/* Forks: the child sends `c` on `*child_fd` (read after the fork, as the
 * fork handlers left it), closes it and exits; then the parent sends `p`
 * on `s` and closes it, and the server `srv` must succeed. */
static void child_then_parent(pid_t srv, const int *child_fd, char c, char p) {
    pid_t k = fork();
    if (k == 0)
        _exit(send(*child_fd, &c, 1, 0) == 1 && close(*child_fd) == 0 ? 0 : 1);
    if (k < 0)
        fail("fork");
    wait_ok(k, "child");
    if (send(s, &p, 1, 0) != 1 || close(s))
        fail("parent");
    wait_ok(srv, "server");
}

/* Reads the connection to its end: "p", then "P", "c", "k" and "x", the
 * parent's and the child's in either order. */
static void read_handlers(int l, int go) {
    (void)go;
    char b[64];
    size_t n = accept_all(l, b, sizeof b);
    const char *p = strchr(b, 'P'), *ch = strchr(b, 'c'), *k = strchr(b, 'k'), *x = strchr(b, 'x');
    if (n != 5 || b[0] != 'p' || !p || !ch || !k || !x || ch > k || p > x)
        fail("the server got \"%s\"", b);
}

static void say(char c, int flags) {
    if (send(s, &c, 1, flags) != 1)
        fail("send %c in a fork handler", c);
}

static void on_prepare(void) { say('p', MSG_MORE); }
static void on_parent(void) { say('P', 0); }
static void on_child(void) { say('c', 0); }

static void fork_handlers(void) {
    pid_t srv = serve(8, read_handlers);
    connect_s();
    if (pthread_atfork(on_prepare, on_parent, on_child))
        fail("pthread_atfork");
    child_then_parent(srv, &s, 'k', 'x');
}

/* Reads the connection to its end: "pcP". */
static void read_held(int l, int go) {
    (void)go;
    char b[64];
    accept_all(l, b, sizeof b);
    if (strcmp(b, "pcP"))
        fail("the server got \"%s\"", b);
}

static void fork_held(void) {
    pid_t srv = serve(8, read_held);
    connect_s();
    if (send(s, "p", 1, MSG_MORE) != 1)
        fail("send with MSG_MORE");
    child_then_parent(srv, &s, 'c', 'P');
}

static int ep = -1, kept = -1;

static void wait_set(const char *who) {
    struct epoll_event ev;
    if (epoll_wait(ep, &ev, 1, 0) < 0)
        fail("epoll_wait in the %s handler", who);
}

static void on_prepare_epoll(void) { wait_set("prepare"); }
static void on_parent_epoll(void) { wait_set("parent"); }

static void on_child_epoll(void) {
    wait_set("child");
    if (close(ep) || (kept = dup(s)) < 0 || close(s))
        fail("the child handler's close and dup");
}

/* Reads the connection to its end: "k" and "x", in either order. */
static void read_kx(int l, int go) {
    (void)go;
    char b[64];
    accept_all(l, b, sizeof b);
    if (strcmp(b, "kx") && strcmp(b, "xk"))
        fail("the server got \"%s\"", b);
}

static int moved[2];

static void on_parent_moved(void) {
    char b;
    if (read(moved[0], &b, 1) != 1)
        fail("the child did not finish");
}

static void fork_moved_first(void) {
    pid_t srv = serve(8, read_kx);
    connect_s();
    if (pipe(moved) || pthread_atfork(NULL, on_parent_moved, NULL))
        fail("pipe, pthread_atfork");
    pid_t k = fork();
    if (k == 0) {
        int d = dup(s);
        int ok = d >= 0 && close(s) == 0 && send(d, "k", 1, 0) == 1 && close(d) == 0;
        _exit(ok && write(moved[1], "d", 1) == 1 ? 0 : 1);
    }
    if (k < 0)
        fail("fork");
    wait_ok(k, "child");
    if (send(s, "x", 1, 0) != 1 || close(s))
        fail("parent");
    wait_ok(srv, "server");
}

/* exec-sibling-moved, after the exec: fd S is the connection, B the
 * sibling (told to go on through pipe GO), SRV the server. */
static void exec_sibling_moved_2(int fd, pid_t b, int go, pid_t srv) {
    s = fd;
    pid_t c = fork();
    if (c == 0) {
        int d = dup(s);
        _exit(d >= 0 && close(s) == 0 && send(d, "k", 1, 0) == 1 && close(d) == 0 ? 0 : 1);
    }
    if (c < 0)
        fail("fork");
    wait_ok(c, "C");
    if (close(s))
        fail("close");
    /* Had the close ended the connection, the server reads its end of
     * stream now, before B's byte. */
    usleep(100000);
    if (write(go, "g", 1) != 1)
        fail("tell B");
    wait_ok(b, "B");
    wait_ok(srv, "server");
}

static void exec_sibling_moved(void) {
    pid_t srv = serve(8, read_kx);
    connect_s();
    int go[2];
    if (pipe(go))
        fail("pipe");
    pid_t b = fork();
    if (b == 0) {
        char g;
        close(go[1]);
        _exit(read(go[0], &g, 1) == 1 && send(s, "x", 1, 0) == 1 && close(s) == 0 ? 0 : 1);
    }
    if (b < 0)
        fail("fork");
    close(go[0]);
    char fd[16], bp[16], gp[16], sp[16];
    snprintf(fd, sizeof fd, "%d", s);
    snprintf(bp, sizeof bp, "%d", (int)b);
    snprintf(gp, sizeof gp, "%d", go[1]);
    snprintf(sp, sizeof sp, "%d", (int)srv);
    execl("/proc/self/exe", "dup_family", "exec-sibling-moved-2", fd, bp, gp, sp, (char *)NULL);
    fail("exec");
}

static void fork_handler_epoll(void) {
    pid_t srv = serve(8, read_kx);
    connect_s();
    ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = s};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev) || epoll_wait(ep, &ev, 1, 0) < 0)
        fail("epoll");
    if (pthread_atfork(on_prepare_epoll, on_parent_epoll, on_child_epoll))
        fail("pthread_atfork");
    child_then_parent(srv, &kept, 'k', 'x');
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "exec-sibling-moved-2") == 0) {
        mode = argv[1];
        exec_sibling_moved_2(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
        printf("OK\n");
        return 0;
    }
    if (argc != 2)
        fail("usage: dup_family fork-close | fork-dup2 | fork-dup | dup-pending | fork-in-call | "
             "fork-handlers | fork-held | fork-handler-epoll | fork-moved-first | exec-sibling-moved");
    mode = argv[1];
    if (strcmp(mode, "fork-close") == 0)
        fork_close(0);
    else if (strcmp(mode, "fork-dup2") == 0)
        fork_close(1);
    else if (strcmp(mode, "fork-dup") == 0)
        fork_dup();
    else if (strcmp(mode, "dup-pending") == 0)
        dup_pending();
    else if (strcmp(mode, "fork-in-call") == 0)
        fork_in_call();
    else if (strcmp(mode, "fork-handlers") == 0)
        fork_handlers();
    else if (strcmp(mode, "fork-held") == 0)
        fork_held();
    else if (strcmp(mode, "fork-handler-epoll") == 0)
        fork_handler_epoll();
    else if (strcmp(mode, "fork-moved-first") == 0)
        fork_moved_first();
    else if (strcmp(mode, "exec-sibling-moved") == 0)
        exec_sibling_moved();
    else
        fail("unknown mode");
    printf("OK\n");
    return 0;
}
