# Opens N concurrent connections, sends each a distinct payload, checks the echo.
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = []
for i in range(n):
    conns.append(socket.create_connection(("127.0.0.1", port)))
payloads = [(("conn %d;" % i) * (10 + i % 50)).encode() for i in range(n)]
for c, p in zip(conns, payloads):
    c.sendall(p)
bad = 0
for i, (c, p) in enumerate(zip(conns, payloads)):
    got = b""
    while len(got) < len(p):
        d = c.recv(len(p) - len(got))
        if not d:
            break
        got += d
    if got != p:
        bad += 1
        print("conn %d: got %d bytes, want %d" % (i, len(got), len(p)), file=sys.stderr)
for c in conns:
    c.close()
print("SERVED %d BAD %d" % (n, bad), flush=True)
sys.exit(1 if bad else 0)
