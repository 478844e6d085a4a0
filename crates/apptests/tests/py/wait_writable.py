"""A client that connects as curl does: a non-blocking connect, then a
wait until the socket is writable, and only then its request line; it
prints how long the wait for writability took and the answer.

usage: wait_writable.py HOST PORT"""
import select
import socket
import sys
import time

s = socket.socket()
s.setblocking(False)
t0 = time.monotonic()
s.connect_ex((sys.argv[1], int(sys.argv[2])))
_, w, _ = select.select([], [s], [], 30)
waited = time.monotonic() - t0
if not w:
    sys.exit("not writable within 30 s")
s.setblocking(True)
s.sendall(b"request\n")
answer = b""
while not answer.endswith(b"\n"):
    b = s.recv(100)
    if not b:
        break
    answer += b
print("waited %.3f answer %r" % (waited, answer.decode()))
