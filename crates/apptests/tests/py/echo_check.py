"""An echo server and a client that checks every byte, for tests/inherited.rs
(a server that serves a listening socket it inherited as a descriptor
number, a supervisor that binds, listens and execs that server with the
socket) and tests/containers.rs.

  echo_check.py server FD MODE COUNT       serve COUNT connections on FD;
                                           MODE: block (blocking accept) or
                                           epoll (selectors, non-blocking)
  echo_check.py listen HOST PORT COUNT     listen on HOST:PORT, serve COUNT
                                           connections (block)
  echo_check.py supervise PORT MODE COUNT  bind 127.0.0.1:PORT, listen, exec
                                           the server with the socket
  echo_check.py client HOST PORT COUNT SIZE
                                           COUNT connections one after the
                                           other, SIZE bytes each way, echo
                                           checked; prints "ok SENT RECEIVED"
"""

import os
import random
import selectors
import socket
import sys


def read_to_end(c):
    data = bytearray()
    while True:
        b = c.recv(65536)
        if not b:
            return data
        data += b


def serve_one(c):
    # Read to end of stream, then echo everything back.
    c.sendall(read_to_end(c))
    c.close()


def server(fd, mode, count):
    lst = socket.socket(fileno=fd)
    print("ready", flush=True)
    serve(lst, mode, count)


def serve(lst, mode, count):
    done = 0
    if mode == "epoll":
        lst.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(lst, selectors.EVENT_READ)
        while done < count:
            for _ in sel.select():
                try:
                    c, _ = lst.accept()
                except BlockingIOError:
                    continue
                c.setblocking(True)
                serve_one(c)
                done += 1
    else:
        while done < count:
            c, _ = lst.accept()
            serve_one(c)
            done += 1


def bound(host, port):
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((host, port))
    lst.listen(64)
    return lst


def listen(host, port, count):
    lst = bound(host, port)
    print("ready", flush=True)
    serve(lst, "block", count)


def supervise(port, mode, count):
    lst = bound("127.0.0.1", port)
    fd = lst.fileno()
    os.set_inheritable(fd, True)
    py = sys.executable
    os.execv(py, [py, __file__, "server", str(fd), mode, str(count)])


def client(host, port, count, size):
    sent = received = 0
    for i in range(count):
        payload = random.Random(i).randbytes(size)
        s = socket.create_connection((host, port))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        back = read_to_end(s)
        s.close()
        if back != payload:
            sys.exit(f"connection {i}: {len(back)} bytes back, want {size}, differing")
        sent += size
        received += len(back)
    print("ok", sent, received, flush=True)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "server":
        server(int(args[0]), args[1], int(args[2]))
    elif what == "listen":
        listen(args[0], int(args[1]), int(args[2]))
    elif what == "supervise":
        supervise(int(args[0]), args[1], int(args[2]))
    else:
        client(args[0], int(args[1]), int(args[2]), int(args[3]))
