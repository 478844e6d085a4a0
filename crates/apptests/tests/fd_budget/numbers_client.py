# The program's own descriptor is an SMC-D connection's channel: what the
# program does with its numbers (dup, close, dup2 onto it, reuse after
# close) behaves as with TCP sockets. Prints "OK <connections>".
import os, socket, sys, threading, time
port = int(sys.argv[1])

def echo(s, msg):
    s.sendall(msg)
    got = b""
    while len(got) < len(msg):
        d = s.recv(len(msg) - len(got))
        if not d:
            sys.exit("end of stream on %r" % msg)
        got += d
    if got != msg:
        sys.exit("got %r for %r" % (got, msg))

def conn():
    return socket.create_connection(("127.0.0.1", port))

# A duplicate carries the connection after the original number is closed.
a = conn()
echo(a, b"one")
b = a.dup()
a.close()
echo(b, b"two" * 1000)
b.close()

# dup2 onto the connection's own number: the number names the new file,
# the connection lives on in its duplicate.
c = conn()
echo(c, b"three")
d = c.dup()
n = c.detach()
r, w = os.pipe()
os.dup2(r, n)
os.write(w, b"pipe")
if os.read(n, 4) != b"pipe":
    sys.exit("dup2 did not replace the number")
echo(d, b"four" * 1000)
for x in (n, r, w):
    os.close(x)
d.close()

# A closed number is free at once, as over TCP.
e = conn()
echo(e, b"five")
f = e.fileno()
e.close()
g = socket.socket()
if g.fileno() != f:
    sys.exit("number %d not reused after close (got %d)" % (f, g.fileno()))
g.close()

# close from another thread while one is blocked in recv: as over TCP,
# the close returns at once and the recv goes on waiting (the connection
# ends when it returns; here, at exit). The number stays taken meanwhile,
# where Linux frees it at once (README).
h = conn()
echo(h, b"six")
t = threading.Thread(target=lambda: h.recv(10), daemon=True)
t.start()
time.sleep(0.3)
os.close(h.fileno())
h.detach()
t.join(0.5)
if not t.is_alive():
    sys.exit("the blocked recv returned after another thread's close")
print("OK 4", flush=True)
