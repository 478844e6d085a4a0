# For a server whose connection cannot follow its exec: sends a request
# line and a payload, then reads until the connection is reset or ends.
# Prints "reset" or "eof BYTES"; a hang fails on the socket timeout.
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
payload = bytes((i * 131 + 17) % 256 for i in range(n))
c = socket.create_connection(("127.0.0.1", port), timeout=10)
try:
    c.sendall(b"GET\n" + payload)
    c.shutdown(socket.SHUT_WR)
    total = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        total += len(b)
    print("eof", total)
except (ConnectionResetError, BrokenPipeError):
    print("reset")
