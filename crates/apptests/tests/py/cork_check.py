"""Corking on one connection: `cork_check.py PORT`. The parent accepts, a
forked child connects (both under the preload) and writes; a pipe orders the
steps. Prints `ok BYTES CEILING_MS` (bytes moved both ways, and how long a
last MSG_MORE write waited before it arrived) or exits non-zero."""
import hashlib
import os
import select
import socket
import sys
import time

port = int(sys.argv[1])
to_parent_r, to_parent_w = os.pipe()
to_child_r, to_child_w = os.pipe()


def say(fd, b):
    os.write(fd, b)


def hear(fd, want):
    got = os.read(fd, 1)
    if got != want:
        raise SystemExit("step %r, heard %r" % (want, got))


def readable(s, ms):
    return bool(select.select([s], [], [], ms / 1000)[0])


def recv_exact(s, n):
    out = b""
    while len(out) < n:
        c = s.recv(n - len(out))
        if not c:
            raise SystemExit("end of stream after %d of %d bytes" % (len(out), n))
        out += c
    return out


big = os.urandom(3 << 20)
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen()
pid = os.fork()
if pid == 0:
    ls.close()
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 1
    c.sendall(b"A" * 100)
    say(to_parent_w, b"1")  # 1: corked bytes written
    hear(to_child_r, b"2")  # 2: parent saw nothing
    c.sendall(b"B" * 100)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
    hear(to_child_r, b"3")  # 3: parent has all 200
    c.send(b"C" * 10, socket.MSG_MORE)  # never followed by a plain write
    hear(to_child_r, b"4")  # 4: it arrived (TCP's ceiling)
    # Corked all the way, more than the ring holds, never uncorked: the full
    # ring and the end of stream publish everything.
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    c.sendall(big)
    c.shutdown(socket.SHUT_WR)
    hear(to_child_r, b"5")
    c.close()
    os._exit(0)

s, _ = ls.accept()
hear(to_parent_r, b"1")
if readable(s, 100):
    raise SystemExit("corked bytes arrived before the cork was pulled")
say(to_child_w, b"2")
got = recv_exact(s, 200)
if got != b"A" * 100 + b"B" * 100:
    raise SystemExit("corked bytes differ")
say(to_child_w, b"3")
t0 = time.monotonic()
if not readable(s, 5000):
    raise SystemExit("a MSG_MORE write never arrived")
waited = time.monotonic() - t0
if recv_exact(s, 10) != b"C" * 10:
    raise SystemExit("MSG_MORE bytes differ")
say(to_child_w, b"4")
h = hashlib.sha256()
n = 0
while True:
    c = s.recv(1 << 16)
    if not c:
        break
    h.update(c)
    n += len(c)
if n != len(big) or h.digest() != hashlib.sha256(big).digest():
    raise SystemExit("corked stream differs: %d of %d bytes" % (n, len(big)))
say(to_child_w, b"5")
_, st = os.waitpid(pid, 0)
if st != 0:
    raise SystemExit("child failed: %d" % st)
print("ok %d %d" % (210 + len(big), waited * 1000), flush=True)
