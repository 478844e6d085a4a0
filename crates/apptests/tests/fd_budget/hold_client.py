# Opens N connections, checks one echo on each, then keeps them all open.
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
for i, c in enumerate(conns):
    p = ("conn %d;" % i).encode() * 10
    c.sendall(p)
    got = b""
    while len(got) < len(p):
        d = c.recv(len(p) - len(got))
        if not d:
            break
        got += d
    if got != p:
        print("conn %d: got %r" % (i, got), file=sys.stderr, flush=True)
        sys.exit(1)
print("HELD %d" % n, flush=True)
time.sleep(120)
