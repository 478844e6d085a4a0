"""Sets KEYS values of pseudo-random sizes through memcached's text protocol
on one connection, reads every one back with `get` on a second connection and
prints `ok SENT RECEIVED` (bytes on the wire), or exits non-zero on any
difference. Usage: memcache_check.py PORT KEYS SEED"""
import random
import socket
import sys


def read_until(s, buf, marker):
    while marker not in buf:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise SystemExit("connection closed early")
        buf += chunk
    i = buf.index(marker) + len(marker)
    return buf[:i], buf[i:]


def main(port, keys, seed):
    rng = random.Random(seed)
    values = {b"k%d" % i: rng.randbytes(rng.choice([10, 1000, rng.randrange(1, 500_000)])) for i in range(keys)}
    sent = received = 0
    w = socket.create_connection(("127.0.0.1", port))
    buf = b""
    for k, v in values.items():
        req = b"set %s 0 0 %d\r\n%s\r\n" % (k, len(v), v)
        w.sendall(req)
        sent += len(req)
        line, buf = read_until(w, buf, b"\r\n")
        received += len(line)
        if line != b"STORED\r\n":
            raise SystemExit("set %r: %r" % (k, line))
    r = socket.create_connection(("127.0.0.1", port))
    buf = b""
    for k, v in values.items():
        req = b"get %s\r\n" % k
        r.sendall(req)
        sent += len(req)
        want = b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (k, len(v), v)
        while len(buf) < len(want):
            chunk = r.recv(1 << 16)
            if not chunk:
                raise SystemExit("connection closed early")
            buf += chunk
        got, buf = buf[: len(want)], buf[len(want):]
        received += len(got)
        if got != want:
            raise SystemExit("get %r: %d bytes differ" % (k, len(want)))
    w.close()
    r.close()
    print("ok %d %d" % (sent, received), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
