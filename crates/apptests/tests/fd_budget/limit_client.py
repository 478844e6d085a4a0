# What a program sees of its descriptor limit: RLIMIT_NOFILE (getrlimit,
# sysconf, /proc/self/limits, a child's), then connections opened until
# EMFILE, each checked with an echo, and the other calls that make a
# descriptor (open, dup, pipe) failing there too; then a raised limit.
import os, resource, socket, subprocess, sys
port = int(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print("GETRLIMIT", soft, hard)
print("SYSCONF", os.sysconf("SC_OPEN_MAX"))
with open("/proc/self/limits") as f:
    line = next(l for l in f if l.startswith("Max open files"))
print("PROC", line.split()[3])
plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
for name, env in (("CHILD", None), ("PLAINCHILD", plain)):
    out = subprocess.run(["sh", "-c", "ulimit -Sn"], env=env, capture_output=True, text=True)
    print(name, out.stdout.strip())
# posix_spawn and system start their child without the exec hooks.
for name, start in (("SPAWN", lambda cmd: os.waitpid(os.posix_spawn("/bin/sh", ["sh", "-c", cmd], plain), 0)),
                    ("SYSTEM", os.system)):
    start("ulimit -Sn > limit.out")
    with open("limit.out") as f:
        print(name, f.read().strip())
    os.unlink("limit.out")


def connect_until_emfile():
    conns = []
    while True:
        try:
            conns.append(socket.create_connection(("127.0.0.1", port)))
        except OSError as e:
            return conns, e.errno


def errno_of(f):
    try:
        f()
    except OSError as e:
        return e.errno
    return 0


def echo(conns, tag):
    bad = 0
    for i, c in enumerate(conns):
        p = ("%s %d;" % (tag, i)).encode() * (5 + i % 40)
        c.sendall(p)
        got = b""
        while len(got) < len(p):
            d = c.recv(len(p) - len(got))
            if not d:
                break
            got += d
        bad += got != p
    return bad


conns, err = connect_until_emfile()
top = max(c.fileno() for c in conns)
others = [errno_of(lambda: os.open("/dev/null", os.O_RDONLY)), errno_of(lambda: os.dup(0)),
          errno_of(os.pipe)]
print("CONNS", len(conns), "MAXFD", top, "ERR", err, "OTHERS", *others)
print("BAD", echo(conns, "a"))
# The program raises its own limit: the room it gave itself is its own.
resource.setrlimit(resource.RLIMIT_NOFILE, (soft + 16, hard))
print("RAISED", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
more, err = connect_until_emfile()
print("MORE", len(more), "ERR", err, "BAD", echo(more, "b"))
sys.stdout.flush()
