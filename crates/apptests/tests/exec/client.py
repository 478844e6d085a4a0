# Sends a request line and a payload, shuts down writing, reads everything
# and checks it byte for byte: the greeting, the payload transformed by the
# filter chain (each filter complements its bytes, or `upper` for tr), the
# trailer.
# usage: client.py PORT BYTES GREETING TRAILER [not|upper|same [raw]]
import socket, sys, threading
port, n, greeting, trailer = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
mode = sys.argv[5] if len(sys.argv) > 5 else "not"
# "raw": the server consumes no request line; it reaches the filter too.
raw = len(sys.argv) > 6 and sys.argv[6] == "raw"
payload = bytes((i * 131 + 17) % 256 for i in range(n))
c = socket.create_connection(("127.0.0.1", port), timeout=30)
got = []
def reader():
    while True:
        b = c.recv(65536)
        if not b:
            break
        got.append(b)
t = threading.Thread(target=reader)
t.start()
c.sendall(b"GET\n" + payload)
c.shutdown(socket.SHUT_WR)
t.join()
data = b"".join(got)
g = greeting.encode().decode("unicode_escape").encode()
tail = trailer.encode().decode("unicode_escape").encode()
assert data.startswith(g), data[:80]
body = data[len(g):len(data) - len(tail)]
sent = (b"GET\n" if raw else b"") + payload
n = len(sent)
if mode == "not":
    want = bytes(255 - b for b in sent)
elif mode == "upper":
    want = sent.upper()
else:
    want = sent
assert len(body) == n, (len(body), n, data[-80:])
assert body == want, "body differs"
assert data.endswith(tail), data[-80:]
print("ok", len(data))
