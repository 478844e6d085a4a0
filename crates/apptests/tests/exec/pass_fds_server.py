# Accepts connections; for each, reads the request line, answers a
# greeting and hands the connection to a new python program with
# subprocess's pass_fds (the child gets it at the same number), then
# closes its own copy. Bytes after the request line are still unread, and
# the greeting may be unread by the client, when the child starts.
import socket, subprocess, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
child = sys.argv[3]
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", port))
l.listen(16)
kids = []
for _ in range(count):
    c, _ = l.accept()
    line = b""
    while not line.endswith(b"\n"):
        line += c.recv(1)
    c.sendall(b"hello from python\n")
    kids.append(subprocess.Popen([sys.executable, child, str(c.fileno())], pass_fds=[c.fileno()]))
    c.close()
sys.exit(max(k.wait() for k in kids))
