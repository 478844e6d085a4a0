# An echo server that outlives its clients' deaths (resets, broken pipes).
import selectors, socket, sys
sel = selectors.DefaultSelector()
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", int(sys.argv[1])))
ls.listen(128)
ls.setblocking(False)
sel.register(ls, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is ls:
            try:
                c, _ = ls.accept()
            except BlockingIOError:
                continue
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ)
            continue
        c = key.fileobj
        try:
            d = c.recv(4096)
            if d:
                c.setblocking(True)
                c.sendall(d)
                c.setblocking(False)
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        sel.unregister(c)
        c.close()
