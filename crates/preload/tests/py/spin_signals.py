"""Python's signal handlers (installed without SA_RESTART) end a blocking
recv, a selectors wait and a recv with a timeout on an idle SMC-D
connection when SIGALRM comes 20 ms into the wait, while it spins. The
timer repeats every 3 s, so a wait the first alarm did not end says how
long it took. Prints "PY name result ms" per wait and "OK done"."""

import os
import selectors
import signal
import socket
import time


class Alarm(Exception):
    pass


def on_alarm(sig, frame):
    raise Alarm()


def timed(name, wait):
    signal.setitimer(signal.ITIMER_REAL, 0.02, 3.0)
    t0 = time.monotonic()
    try:
        wait()
        result = "returned"
    except Alarm:
        result = "alarm"
    ms = (time.monotonic() - t0) * 1000
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(f"PY {name} {result} {ms:.0f}", flush=True)


# The peer is a child process: a connection to a listener of the same
# process stays TCP.
port_r, port_w = os.pipe()
done_r, done_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(done_w)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    os.write(port_w, listener.getsockname()[1].to_bytes(2, "big"))
    conn, _ = listener.accept()
    os.read(done_r, 1)
    os._exit(0)
os.close(done_r)
port = int.from_bytes(os.read(port_r, 2), "big")
s = socket.create_connection(("127.0.0.1", port))
signal.signal(signal.SIGALRM, on_alarm)

timed("recv", lambda: s.recv(1))
sel = selectors.DefaultSelector()
sel.register(s, selectors.EVENT_READ)
timed("selectors", lambda: sel.select(5))
s.settimeout(5)
timed("recv_timeout", lambda: s.recv(1))

os.close(done_w)
os.waitpid(child, 0)
print("OK done", flush=True)
