"""The programs of tests/shrink.rs: a server and clients whose shared files
another process of the device's users shrinks, and a client that attacks
the DMBs it is handed.

  shrink_peer.py server PORT        threaded echo server on 127.0.0.1:PORT
                                    (each connection: echo what arrives
                                    until end of stream); prints "ready",
                                    and one line per connection error
  shrink_peer.py client PORT GO     one connection, echo checked; prints
                                    "live ok", waits for the file GO, then
                                    sends on it and prints "live " and the
                                    errno name it gets (or "ok"); then a new
                                    connection, echo checked: "later ok"
  shrink_peer.py attack PORT        one connection, echo checked, then on
                                    each DMB memfd it holds ("dmbs N"):
                                    ftruncate (prints "truncate " and the
                                    errno name, or "done") and a hole
                                    punched over the whole file ("punch
                                    done"); then a hole through each DMB
                                    mapping (MADV_REMOVE: "holed N", N
                                    DMBs); then sends and prints what it
                                    got ("after ...")

With SHRINK_MASKED=1 in the environment, the server's and the client's
threads block every signal but SIGTERM and SIGINT (as worker threads that
leave signals to one thread do), and check that they see SIGBUS blocked.
"""

import ctypes
import errno
import os
import signal
import socket
import sys
import threading
import time

MSG = bytes(range(256)) * 64
MASKED = os.environ.get("SHRINK_MASKED") == "1"


def mask_signals():
    """With SHRINK_MASKED=1: this thread blocks its signals, SIGBUS too."""
    if not MASKED:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGTERM, signal.SIGINT})
    if signal.SIGBUS not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        raise SystemExit("this thread does not see SIGBUS blocked")


def echo_once(s, data):
    s.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        b = s.recv(len(data) - len(got))
        if not b:
            raise ConnectionError(errno.ECONNRESET, "end of stream in the echo")
        got += b
    if bytes(got) != data:
        raise SystemExit("echo differs")


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=20)


def name(e):
    return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__


def serve(c):
    mask_signals()
    try:
        while True:
            b = c.recv(65536)
            if not b:
                break
            c.sendall(b)
    except OSError as e:
        print("server conn", name(e), flush=True)
    finally:
        c.close()


def server(port):
    mask_signals()
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(64)
    print("ready", flush=True)
    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def client(port, go):
    mask_signals()
    s = connect(port)
    echo_once(s, MSG)
    print("live ok", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    try:
        # Two rounds: the first may still be taken before the loss is seen.
        for _ in range(2):
            echo_once(s, MSG)
        print("live ok", flush=True)
    except OSError as e:
        print("live", name(e), flush=True)
    s.close()
    t = connect(port)
    echo_once(t, MSG)
    print("later ok", flush=True)
    t.close()


FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2


def dmb_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "smclo-dmb" in os.readlink("/proc/self/fd/" + fd):
                out.append(int(fd))
        except OSError:
            pass
    return out


MADV_REMOVE = 9


def dmb_mappings():
    """(start, end, inode) of each shared mapping of a DMB memfd."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "smclo-dmb" not in line:
                continue
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if fields[1][3] == "s":
                out.append((start, end, fields[4]))
    return out


def attack(port):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    s = connect(port)
    echo_once(s, MSG)
    fds = dmb_fds()
    print("dmbs", len(fds), flush=True)
    for fd in fds:
        try:
            os.ftruncate(fd, 0)
            print("truncate done", flush=True)
        except OSError as e:
            print("truncate", name(e), flush=True)
        size = os.fstat(fd).st_size
        if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
            print("punch", errno.errorcode[ctypes.get_errno()], flush=True)
        else:
            print("punch done", flush=True)
    # The peer's DMB has no descriptor here, only the mapping: a hole
    # through it (MADV_REMOVE).
    holed = set()
    for start, end, inode in dmb_mappings():
        if libc.madvise(start, end - start, MADV_REMOVE) == 0:
            holed.add(inode)
        else:
            print("madvise", errno.errorcode[ctypes.get_errno()], flush=True)
    print("holed", len(holed), flush=True)
    try:
        echo_once(s, MSG)
        print("after ok", flush=True)
    except (OSError, SystemExit) as e:
        print("after", name(e) if isinstance(e, OSError) else e, flush=True)


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "server":
        server(port)
    elif mode == "client":
        client(port, sys.argv[3])
    elif mode == "attack":
        attack(port)
    else:
        raise SystemExit("unknown mode " + mode)


main()
