"""A dispatcher that hands established connections to a worker process
with SCM_RIGHTS, for tests/passing.rs.

  pass_conn.py dispatch PORT COUNT HOLD
      listen on 127.0.0.1:PORT and start a worker (this script, "worker");
      for each of COUNT connections: accept it, wait until the client has
      written (the handshake is over), pass it to the worker, close it.
      HOLD=hold: pass every connection first and let the worker start
      reading only once the dispatcher has closed them all (the
      descriptors are in flight when the dispatcher lets go);
      HOLD=exit: the same, and the dispatcher exits before the worker
      reads. HOLD=self: no worker, the dispatcher passes each connection
      to itself and serves what it receives (HOLD=self-late: it closes
      its own copy only once it has received the other). HOLD=linger: SO_LINGER 0 is
      set on each connection before it is passed (the worker sets it off
      again). HOLD=dup: each is
      passed twice in one message; the worker closes the second copy at
      once. HOLD=two: connections are passed two per message and the
      worker takes one descriptor per message (the rest is truncated);
      it serves the one it got, then checks that files it opens read as
      the file. HOLD=plain: the worker runs without smclo (LD_PRELOAD
      removed); it reports how many descriptors each message brought
      ("fds N" on standard error) and closes them without serving.
      HOLD=mmsg: the worker receives with recvmmsg, two messages at most
      per call (MSG_WAITFORONE). HOLD=mmsg2: as HOLD=hold, and the worker
      receives two messages, each with a connection, in every recvmmsg.
      HOLD=early: each connection is passed as soon as a non-blocking
      accept returns it (its handshake undecided); the dispatcher also listens on a second,
      ephemeral port, named on its "ready" line, and serves one
      connection there itself after the others. Prints "ready", then
      "ok N" when N connections were served.
  pass_conn.py connect PORT SIZE
      start a non-blocking connect to 127.0.0.1:PORT and pass the socket
      at once to a child (this script, "use"), which sends SIZE bytes,
      reads the echo and prints "ok SENT RECEIVED" if it is exact.
  pass_conn.py worker FD GO COUNT HOLD
      once a byte arrives on the UNIX socket GO, receive COUNT descriptors
      on the UNIX socket FD; serve each: read to end of stream, echo
      everything back, close.
"""

import ctypes
import os
import select
import socket
import struct
import subprocess
import sys

from echo_check import read_to_end, serve_one


MSG_WAITFORONE = 0x10000


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(IoVec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", MsgHdr), ("len", ctypes.c_uint)]


def control_fds(raw):
    """The SCM_RIGHTS descriptors of the control messages RAW."""
    fds, off, head = [], 0, struct.calcsize("Nii")
    while off + head <= len(raw):
        length, level, kind = struct.unpack_from("Nii", raw, off)
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            data = raw[off + head:off + length]
            fds += struct.unpack("%di" % (len(data) // 4), data)
        off += (length + 7) & ~7
    return fds


def recv_fds_mmsg(sock, vlen, maxfds, flags):
    """socket.recv_fds for up to VLEN messages in one recvmmsg (Python's
    socket has none): [(data, fds, msg_flags)], one per message received."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(MMsgHdr),
                              ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    space = socket.CMSG_SPACE(4 * maxfds)
    datas = [ctypes.create_string_buffer(16) for _ in range(vlen)]
    controls = [ctypes.create_string_buffer(space) for _ in range(vlen)]
    iovs = (IoVec * vlen)(*[IoVec(ctypes.addressof(d), 16) for d in datas])
    v = (MMsgHdr * vlen)()
    for i in range(vlen):
        v[i].hdr.iov = ctypes.pointer(iovs[i])
        v[i].hdr.iovlen = 1
        v[i].hdr.control = ctypes.addressof(controls[i])
        v[i].hdr.controllen = space
    n = libc.recvmmsg(sock.fileno(), v, vlen, flags, None)
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return [(datas[i].raw[:v[i].len],
             control_fds(controls[i].raw[:v[i].hdr.controllen]),
             v[i].hdr.flags) for i in range(n)]


def receive(chan, hold):
    """The connections of the next recvmmsg call (HOLD=mmsg, mmsg2) or
    message (the others), as sockets."""
    if hold in ("mmsg", "mmsg2"):
        got = recv_fds_mmsg(chan, 2, 1, MSG_WAITFORONE if hold == "mmsg" else 0)
        assert hold == "mmsg" or len(got) == 2, got
    elif hold == "dup":
        msg, fds, flags, _ = socket.recv_fds(chan, 16, 2)
        assert len(fds) == 2, (msg, fds)
        os.close(fds.pop())
        got = [(msg, fds, flags)]
    else:
        got = [socket.recv_fds(chan, 16, 1)[:3]]
    for msg, fds, flags in got:
        assert msg == b"c" and len(fds) == 1, (msg, fds)
        assert bool(flags & socket.MSG_CTRUNC) == (hold == "two"), flags
    return [socket.socket(fileno=fds[0]) for _, fds, _ in got]


def worker(fd, go, count, hold):
    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
    go = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=go)
    assert go.recv(1) == b"g"
    served = 0
    if hold == "two":
        count //= 2
    while served < count:
        if hold == "plain":
            msg, fds, _, _ = socket.recv_fds(chan, 16, 8)
            print("fds %d" % len(fds), file=sys.stderr, flush=True)
            for f in fds:
                os.close(f)
            served += 1
            continue
        for c in receive(chan, hold):
            if hold == "linger":
                # The option is the socket's: the worker's close would
                # abort.
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                             struct.pack("ii", 0, 0))
            serve_one(c)
            served += 1
        if hold == "two":
            with open(__file__, "rb") as f, open(__file__, "rb") as g:
                assert f.read() == g.read()
    chan.sendall(b"d")
    print("worker served %d" % served, file=sys.stderr, flush=True)


def to_itself(lst, count, late):
    a, b = socket.socketpair()
    print("ready", flush=True)
    for _ in range(count):
        c, _ = lst.accept()
        select.select([c], [], [], 30)
        socket.send_fds(a, [b"c"], [c.fileno()])
        if not late:
            c.close()
        msg, fds, _, _ = socket.recv_fds(b, 16, 1)
        assert msg == b"c" and len(fds) == 1, (msg, fds)
        if late:
            c.close()
        serve_one(socket.socket(fileno=fds[0]))
    print("ok %d" % count, flush=True)


def dispatch(port, count, hold):
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", port))
    lst.listen(64)
    if hold in ("self", "self-late"):
        return to_itself(lst, count, hold == "self-late")
    mine, theirs = socket.socketpair()
    go, their_go = socket.socketpair()
    env = dict(os.environ)
    if hold == "plain":
        env.pop("LD_PRELOAD", None)
    w = subprocess.Popen(
        [sys.executable, __file__, "worker", str(theirs.fileno()),
         str(their_go.fileno()), str(count), hold],
        pass_fds=[theirs.fileno(), their_go.fileno()],
        env=env,
    )
    theirs.close()
    their_go.close()
    if hold in ("now", "linger", "dup", "two", "plain", "early", "mmsg"):
        go.sendall(b"g")
    other = None
    if hold == "early":
        other = socket.socket()
        other.bind(("127.0.0.1", 0))
        other.listen(8)
        print("ready", other.getsockname()[1], flush=True)
    else:
        print("ready", flush=True)
    if hold == "early":
        # As an event loop accepts (node's): the handshake goes on after
        # a non-blocking accept.
        lst.setblocking(False)
    held = []
    for _ in range(count):
        select.select([lst], [], [], 30)
        c, _ = lst.accept()
        # The client writes first: once readable, the handshake is over.
        if hold != "early":
            select.select([c], [], [], 30)
        if hold == "linger":
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                         struct.pack("ii", 1, 0))
        if hold == "two":
            held.append(c)
            if len(held) < 2:
                continue
            socket.send_fds(mine, [b"c"], [x.fileno() for x in held])
            for x in held:
                x.close()
            held = []
            continue
        fds = [c.fileno()] * (2 if hold == "dup" else 1)
        socket.send_fds(mine, [b"c"], fds)
        c.close()
    if hold == "exit":
        go.sendall(b"g")
        os._exit(0)
    if hold in ("hold", "mmsg2"):
        go.sendall(b"g")
    if other is not None:
        c, _ = other.accept()
        serve_one(c)
    done = mine.recv(1)
    w.wait(timeout=60)
    served = count // 2 if hold == "two" else count
    print("ok %d" % (served if done == b"d" else 0), flush=True)


def connect(port, size):
    mine, theirs = socket.socketpair()
    w = subprocess.Popen(
        [sys.executable, __file__, "use", str(theirs.fileno()), str(size)],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    socket.send_fds(mine, [b"c"], [s.fileno()])
    s.close()
    sys.exit(w.wait(timeout=60))


def use(fd, size):
    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
    msg, fds, _, _ = socket.recv_fds(chan, 16, 1)
    s = socket.socket(fileno=fds[0])
    s.setblocking(True)
    payload = bytes(i % 251 for i in range(size))
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    back = read_to_end(s)
    if back != payload:
        sys.exit("%d bytes back, want %d" % (len(back), size))
    print("ok", size, len(back), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "connect":
        connect(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "use":
        use(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        dispatch(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
