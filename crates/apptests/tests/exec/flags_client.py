# Sends a request line and prints everything the server sends back, until
# the end of the stream.
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30)
c.sendall(b"GET\n")
got = []
while True:
    b = c.recv(65536)
    if not b:
        break
    got.append(b)
sys.stdout.write(b"".join(got).decode())
