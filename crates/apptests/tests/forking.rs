//! Programs whose connections outlive the process that accepted them, and
//! server pushes to idle connections: python's ForkingTCPServer (the parent
//! closes its copy right after fork, the child serves), redis pub/sub, and
//! redis-cli --pipe (writes and reads at once).

use smclo_apptests::*;
use std::fs;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

const FORKING_SERVER: &str = r#"
import hashlib, socketserver, sys
port = int(sys.argv[1])
class H(socketserver.BaseRequestHandler):
    def handle(self):
        c = self.request
        c.sendall(b"hello from pid\n")
        total, h = 0, hashlib.sha256()
        while True:
            b = c.recv(65536)
            if not b:
                break
            total += len(b)
            h.update(b)
            c.sendall(b)            # echo everything back
        c.sendall(("done %d %s\n" % (total, h.hexdigest())).encode())
class S(socketserver.ForkingTCPServer):
    allow_reuse_address = True
S(("127.0.0.1", port), H).serve_forever()
"#;

const ECHO_CLIENT: &str = r#"
import hashlib, socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
payload = bytes((i * 31 + 7) % 256 for i in range(n))
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
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
t.join()
data = b"".join(got)
hello = b"hello from pid\n"
assert data.startswith(hello), data[:40]
echo = data[len(hello):len(hello) + n]
tail = data[len(hello) + n:].decode()
assert echo == payload, "echo differs"
want = "done %d %s\n" % (n, hashlib.sha256(payload).hexdigest())
assert tail == want, (tail, want)
print("ok", len(data))
"#;

#[test]
fn python_forking_server_echo() {
    let mut env = Env::new("forking");
    fs::write(env.path("server.py"), FORKING_SERVER).unwrap();
    fs::write(env.path("client.py"), ECHO_CLIENT).unwrap();
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "forking-server",
        "python3",
        &["server.py", &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let n = 3_000_000usize;
    // 4 clients at once, each served by its own forked child.
    let mut clients: Vec<Proc> = (0..4)
        .map(|i| {
            let c = env.command(
                Mode::Smclo,
                None,
                "python3",
                &["client.py", &ps, &n.to_string()],
            );
            env.spawn_cmd(&format!("client{i}"), c)
        })
        .collect();
    let mut total = 0u64;
    for c in clients.iter_mut() {
        let st = c.wait(T);
        assert!(st.success(), "{}\n{}", c.logs(), server.logs());
        let out = c.stdout_str();
        total += out
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap();
    }
    let d = delta(&s0, &env.stats());
    // Exact: the payloads (n each) plus everything the clients received,
    // which the forked children sent after their parent closed its copy.
    let want = total + 4 * n as u64;
    assert_smc("ForkingTCPServer echo", &d, 4, want, want, &server.logs());
}

#[test]
fn redis_pubsub_push_to_idle_subscriber() {
    let mut env = Env::new("pubsub");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let ps = port.to_string();
    let s0 = env.stats();
    let sub_cmd = env.command(
        Mode::Smclo,
        None,
        "redis-cli",
        &["-p", &ps, "--raw", "SUBSCRIBE", "news"],
    );
    let sub = env.spawn_cmd("subscriber", sub_cmd);
    // Wait until the subscription is live.
    let t0 = Instant::now();
    loop {
        let o = env
            .run(
                Mode::Smclo,
                "numsub",
                "redis-cli",
                &["-p", &ps, "--raw", "PUBSUB", "NUMSUB", "news"],
                T,
            )
            .stdout_str();
        if o.lines().nth(1) == Some("1") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "subscriber not seen: {o}\n{}",
            sub.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Messages with pauses, so that the subscriber sleeps between them.
    let mut want = String::from("subscribe\nnews\n1\n");
    for i in 0..20 {
        let msg = format!("message-{i}-{}", "x".repeat(i * 500));
        let o = env
            .run(
                Mode::Smclo,
                "publish",
                "redis-cli",
                &["-p", &ps, "PUBLISH", "news", &msg],
                T,
            )
            .stdout_str();
        assert_eq!(o.trim(), "1", "PUBLISH reached {o} subscribers");
        want.push_str(&format!("message\nnews\n{msg}\n"));
        if i % 5 == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let t0 = Instant::now();
    while sub.stdout_str().len() < want.len() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(sub.stdout_str(), want, "subscriber output\n{}", sub.logs());
    let d = delta(&s0, &env.stats());
    assert_eq!(d.fallbacks(), 0, "{}", d.fallbacks_desc());
    assert!(d.conns_opened >= 21, "{d:?}");
    drop(sub);
    drop(server);
}

#[test]
fn redis_cli_pipe_mass_insert() {
    let mut env = Env::new("redis-pipe");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let ps = port.to_string();
    let n = 50_000;
    let mut input = Vec::new();
    for i in 0..n {
        let k = format!("key:{i}");
        let v = format!("value-{i}-{}", i * 7919 % 100_003);
        input.extend_from_slice(
            format!(
                "*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n${}\r\n{v}\r\n",
                k.len(),
                v.len()
            )
            .as_bytes(),
        );
    }
    let s0 = env.stats();
    let p = env.run_stdin(
        Mode::Smclo,
        "redis-pipe",
        "redis-cli",
        &["-p", &ps, "--pipe"],
        &input,
        T,
    );
    let out = p.stdout_str();
    assert!(
        out.contains(&format!("errors: 0, replies: {n}")),
        "redis-cli --pipe: {out}\n{}",
        server.logs()
    );
    let d = delta(&s0, &env.stats());
    // The input, n "+OK\r\n" replies, and --pipe's closing ECHO of a
    // 20-byte random marker: "\r\n*2\r\n$4\r\nECHO\r\n$20\r\n<20>\r\n"
    // (43 bytes) and its reply "$20\r\n<20>\r\n" (27).
    let want = (input.len() + 5 * n + 43 + 27) as u64;
    assert_smc("redis-cli --pipe", &d, 1, want, want, &server.logs());
    let o = env
        .run(
            Mode::Smclo,
            "dbsize",
            "redis-cli",
            &["-p", &ps, "DBSIZE"],
            T,
        )
        .stdout_str();
    assert_eq!(o.trim(), n.to_string());
    let o = env
        .run(
            Mode::Smclo,
            "get",
            "redis-cli",
            &["-p", &ps, "GET", "key:12345"],
            T,
        )
        .stdout_str();
    assert_eq!(o.trim(), format!("value-12345-{}", 12345 * 7919 % 100_003));
}

const HANDOFF_SERVER: &str = r#"
import os, socket, sys
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", int(sys.argv[1])))
ls.listen(4)
c, _ = ls.accept()
if os.fork() != 0:
    c.close()
    ls.close()
    os._exit(0)          # the accepting process is gone; the child serves
ls.close()
c.sendall(b"hello from pid\n")
import hashlib
total, h = 0, hashlib.sha256()
while True:
    b = c.recv(65536)
    if not b:
        break
    total += len(b)
    h.update(b)
    c.sendall(b)
c.sendall(("done %d %s\n" % (total, h.hexdigest())).encode())
c.close()
"#;

/// The accepting process forks and exits at once; its child serves the
/// connection to the end. The client must not see the connection die with
/// the process that set it up.
#[test]
fn accepting_process_exits_child_serves() {
    let mut env = Env::new("handoff");
    fs::write(env.path("server.py"), HANDOFF_SERVER).unwrap();
    fs::write(env.path("client.py"), ECHO_CLIENT).unwrap();
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "handoff-server",
        "python3",
        &["server.py", &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let c = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &["client.py", &ps, "2000000"],
        T,
    );
    assert!(c.stdout_str().starts_with("ok "), "{}", c.logs());
    let d = delta(&s0, &env.stats());
    assert_eq!(d.fallbacks(), 0, "{}", d.fallbacks_desc());
    assert_eq!(d.conns_opened, 1, "{d:?}");
}
