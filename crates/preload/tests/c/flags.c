/* send and recv flags that TCP ignores or answers without the data, over
 * one connection between two processes under the preload (the same
 * program over plain TCP passes too). Usage: flags MODE. "OK <bytes
 * read>" and status 0 mean every check held; "FAIL ..." otherwise.
 * Modes:
 *   send  writes with MSG_CONFIRM, MSG_DONTROUTE, MSG_BATCH, MSG_PROBE and
 *         MSG_ZEROCOPY (SO_ZEROCOPY unset) arrive as plain writes;
 *         MSG_FASTOPEN on the connected socket is EISCONN
 *   recv  MSG_OOB is EINVAL (no urgent data) and MSG_ERRQUEUE EAGAIN (no
 *         queued error) on a blocking socket, the data left in place;
 *         MSG_TRUNC drops bytes without a buffer (with MSG_PEEK it counts
 *         them), recvmsg too; MSG_CONFIRM and MSG_DONTROUTE are ignored */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

#ifndef MSG_PROBE
#define MSG_PROBE 0x10
#endif

static size_t got;

/* Reads exactly `n` bytes and checks they are `want`. */
static void expect(int s, const char *want, size_t n) {
    char b[64];
    size_t done = 0;
    while (done < n) {
        ssize_t k = recv(s, b + done, n - done, 0);
        if (k <= 0) fail("recv");
        done += k;
    }
    if (memcmp(b, want, n)) fail("read %.*s, not %.*s", (int)n, b, (int)n, want);
    got += n;
}

static void send_side(int c) {
    int fl[] = {MSG_CONFIRM, MSG_DONTROUTE, MSG_BATCH, MSG_PROBE, MSG_ZEROCOPY};
    for (size_t i = 0; i < sizeof fl / sizeof fl[0]; i++)
        if (send(c, "abcd", 4, fl[i]) != 4) fail("send with flag %#x", fl[i]);
    if (send(c, "x", 1, MSG_FASTOPEN) != -1 || errno != EISCONN) fail("MSG_FASTOPEN: not EISCONN");
    if (send(c, "end!", 4, 0) != 4) fail("send");
}

static void recv_side(int s) {
    char b[8];
    /* The peer wrote "abcdefghijklmnop". */
    expect(s, "ab", 2);
    if (recv(s, b, 1, MSG_OOB) != -1 || errno != EINVAL) fail("MSG_OOB: not EINVAL");
    if (recv(s, b, 1, MSG_ERRQUEUE) != -1 || errno != EAGAIN) fail("MSG_ERRQUEUE: not EAGAIN");
    if (recv(s, NULL, 2, MSG_TRUNC | MSG_PEEK) != 2) fail("MSG_TRUNC|MSG_PEEK: not 2");
    if (recv(s, NULL, 2, MSG_TRUNC) != 2) fail("MSG_TRUNC: not 2");
    got += 2;
    expect(s, "ef", 2);
    struct iovec v = {NULL, 3};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1};
    if (recvmsg(s, &m, MSG_TRUNC) != 3) fail("recvmsg MSG_TRUNC: not 3");
    got += 3;
    ssize_t k = recv(s, b, 3, MSG_CONFIRM | MSG_DONTROUTE | MSG_WAITALL);
    if (k != 3 || memcmp(b, "jkl", 3)) fail("recv with ignored flags: %zd", k);
    got += 3;
    expect(s, "mnop", 4);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: flags MODE");
    mode = argv[1];
    struct sockaddr_in a;
    int l = listen_lo(&a);
    pid_t pid = fork();
    if (pid == 0) {
        int c = connect_lo(&a);
        if (!strcmp(mode, "send")) {
            send_side(c);
        } else {
            /* One write: every read below finds all the bytes it asks for. */
            if (send(c, "abcdefghijklmnop", 16, 0) != 16) fail("send");
        }
        char b;
        if (read(c, &b, 1) != 0) fail("the end of the stream");
        _exit(0);
    }
    int s = accept(l, NULL, NULL);
    if (s < 0) fail("accept");
    if (!strcmp(mode, "send")) {
        for (int i = 0; i < 5; i++) expect(s, "abcd", 4);
        expect(s, "end!", 4);
    } else {
        recv_side(s);
    }
    close(s);
    wait_peer(pid);
    printf("OK %zu\n", got);
    return 0;
}
