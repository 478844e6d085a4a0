# Starts N non-blocking connects at once (as redis-benchmark and other
# load generators do), waits until every one is connected, then checks an
# echo on each.
import selectors, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    socks.append(s)
sel = selectors.DefaultSelector()
for s in socks:
    sel.register(s, selectors.EVENT_WRITE)
left = n
while left:
    ready = sel.select(30)
    if not ready:
        print("connects still pending: %d" % left, file=sys.stderr)
        sys.exit(1)
    for key, _ in ready:
        sel.unregister(key.fileobj)
        left -= 1
        err = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            print("connect failed: errno %d" % err, file=sys.stderr)
            sys.exit(1)
bad = 0
for i, s in enumerate(socks):
    s.setblocking(True)
    p = ("burst %d;" % i).encode() * (5 + i % 40)
    s.sendall(p)
    got = b""
    while len(got) < len(p):
        d = s.recv(len(p) - len(got))
        if not d:
            break
        got += d
    bad += got != p
print("SERVED %d BAD %d" % (n, bad), flush=True)
