# An event-loop echo server that, like most, dies when accept fails.
import selectors, socket, sys
port = int(sys.argv[1])
sel = selectors.DefaultSelector()
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(1024)
ls.setblocking(False)
sel.register(ls, selectors.EVENT_READ, None)
served = 0
print("READY", flush=True)
while True:
    for key, _ in sel.select():
        if key.data is None:
            c, _ = ls.accept()  # EMFILE here kills the server
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ, b"")
            served += 1
            continue
        c = key.fileobj
        try:
            d = c.recv(65536)
        except BlockingIOError:
            continue
        if not d:
            sel.unregister(c)
            c.close()
            continue
        c.setblocking(True)
        c.sendall(d)
        c.setblocking(False)
