# Accepts one connection and prints what its first read returns.
import socket, sys
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", int(sys.argv[1])))
ls.listen(8)
c, _ = ls.accept()
c.settimeout(10)
try:
    d = c.recv(100)
    print("EOF" if not d else "DATA %r" % d, flush=True)
except ConnectionResetError:
    print("RESET", flush=True)
except socket.timeout:
    print("TIMEOUT", flush=True)
