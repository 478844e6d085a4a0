"""Accepts one connection on 127.0.0.1:PORT and reads it to its end, for
tests/node_http.rs. Prints "ready", then "eof N" (N bytes, then end of
stream) or "error E N" (E after N bytes).

  read_to_end.py PORT
"""

import socket
import sys

lst = socket.socket()
lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lst.bind(("127.0.0.1", int(sys.argv[1])))
lst.listen(8)
print("ready", flush=True)
c, _ = lst.accept()
n = 0
try:
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
    print("eof", n, flush=True)
except OSError as e:
    print("error", e.errno, n, flush=True)
