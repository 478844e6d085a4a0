# N connections one after the other: connect, one byte each way, close.
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"x")
    if c.recv(1) != b"x":
        sys.exit("connection %d: no echo" % i)
    c.close()
print("DONE %d" % n, flush=True)
