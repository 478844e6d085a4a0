# Listens on PORT, then leaves N connections to it in TIME_WAIT (the
# client closes first), prints READY and sleeps until killed.
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(512)
for i in range(n):
    c = socket.create_connection(("127.0.0.1", port))
    a, _ = ls.accept()
    c.close()
    a.close()
print("READY", flush=True)
time.sleep(3600)
