# An event loop that never sleeps: it waits with a zero timeout, as a
# server that always finds work does (nginx under wrk). It echoes and
# closes each connection when the client has closed, without unregistering
# it (close does that), and prints how many descriptors it had open after
# the first and after the last of N connections closed, and how many
# closed descriptors epoll still reported.
import os, select, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(64)
ls.setblocking(False)
ep = select.epoll()
ep.register(ls.fileno(), select.EPOLLIN)
conns = {}
closed = 0
first = None
stale = set()
print("READY", flush=True)
while closed < n:
    for fd, _ in ep.poll(0):
        if fd == ls.fileno():
            try:
                c, _ = ls.accept()
            except BlockingIOError:
                continue
            c.setblocking(False)
            conns[c.fileno()] = c
            ep.register(c.fileno(), select.EPOLLIN)
            continue
        c = conns.get(fd)
        if c is None:
            stale.add(fd)
            continue
        try:
            d = c.recv(4096)
        except BlockingIOError:
            continue
        if d:
            c.send(d)
            continue
        del conns[fd]
        c.close()
        closed += 1
        if closed == 1:
            first = len(os.listdir("/proc/self/fd"))
print("FDS %d %d STALE %d" % (first, len(os.listdir("/proc/self/fd")), len(stale)), flush=True)
