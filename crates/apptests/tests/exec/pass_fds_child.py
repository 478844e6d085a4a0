# The program a connection was passed to: complements every byte it
# reads until end of stream, then writes a trailer with the count.
import socket, sys
c = socket.socket(fileno=int(sys.argv[1]))
total = 0
while True:
    b = c.recv(65536)
    if not b:
        break
    total += len(b)
    c.sendall(bytes(255 - x for x in b))
c.sendall(b"child %d\n" % total)
c.close()
