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
      to itself and serves what it receives. Prints "ready", then "ok N"
      when N connections were served.
  pass_conn.py connect PORT SIZE
      start a non-blocking connect to 127.0.0.1:PORT and pass the socket
      at once to a child (this script, "use"), which sends SIZE bytes,
      reads the echo and prints "ok SENT RECEIVED" if it is exact.
  pass_conn.py worker FD GO COUNT
      once a byte arrives on the UNIX socket GO, receive COUNT descriptors
      on the UNIX socket FD; serve each: read to end of stream, echo
      everything back, close.
"""

import os
import select
import socket
import subprocess
import sys


def serve_one(c):
    data = bytearray()
    while True:
        b = c.recv(65536)
        if not b:
            break
        data += b
    c.sendall(data)
    c.close()


def worker(fd, go, count):
    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
    go = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=go)
    assert go.recv(1) == b"g"
    served = 0
    while served < count:
        msg, fds, _, _ = socket.recv_fds(chan, 16, 1)
        assert msg == b"c" and len(fds) == 1, (msg, fds)
        c = socket.socket(fileno=fds[0])
        serve_one(c)
        served += 1
    chan.sendall(b"d")
    print("worker served %d" % served, file=sys.stderr, flush=True)


def to_itself(lst, count):
    a, b = socket.socketpair()
    print("ready", flush=True)
    for _ in range(count):
        c, _ = lst.accept()
        select.select([c], [], [], 30)
        socket.send_fds(a, [b"c"], [c.fileno()])
        c.close()
        msg, fds, _, _ = socket.recv_fds(b, 16, 1)
        assert msg == b"c" and len(fds) == 1, (msg, fds)
        serve_one(socket.socket(fileno=fds[0]))
    print("ok %d" % count, flush=True)


def dispatch(port, count, hold):
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", port))
    lst.listen(64)
    if hold == "self":
        return to_itself(lst, count)
    mine, theirs = socket.socketpair()
    go, their_go = socket.socketpair()
    w = subprocess.Popen(
        [sys.executable, __file__, "worker", str(theirs.fileno()),
         str(their_go.fileno()), str(count)],
        pass_fds=[theirs.fileno(), their_go.fileno()],
    )
    theirs.close()
    their_go.close()
    if hold == "now":
        go.sendall(b"g")
    print("ready", flush=True)
    for _ in range(count):
        c, _ = lst.accept()
        # The client writes first: once readable, the handshake is over.
        select.select([c], [], [], 30)
        socket.send_fds(mine, [b"c"], [c.fileno()])
        c.close()
    if hold == "exit":
        go.sendall(b"g")
        os._exit(0)
    if hold == "hold":
        go.sendall(b"g")
    done = mine.recv(1)
    w.wait(timeout=60)
    print("ok %d" % (count if done == b"d" else 0), flush=True)


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
    back = bytearray()
    while True:
        b = s.recv(65536)
        if not b:
            break
        back += b
    if back != payload:
        sys.exit("%d bytes back, want %d" % (len(back), size))
    print("ok", size, len(back), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "connect":
        connect(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "use":
        use(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        dispatch(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
