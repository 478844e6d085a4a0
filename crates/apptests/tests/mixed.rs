//! Mixed: an smclo client against a plain server and a plain client against
//! an smclo server, for redis, nginx and a server-speaks-first program. Each
//! case is compared with a plain/plain control run in the same test: the
//! results must be identical, the plain side must have received exactly the
//! bytes it receives from a plain peer (counted by the plain program
//! itself), and the device must show no SMC-D traffic, only PEERNOSMC
//! fallbacks on the smclo side.

use smclo_apptests::*;
use std::fs;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- redis

struct RedisRun {
    outputs: Vec<Vec<u8>>,
    server_in: u64,
    server_out: u64,
    conns: u64,
}

/// A fixed redis session: SET of a 256 KiB value from stdin, GET of it,
/// then a batch of commands on one connection. Server counters are read by
/// a plain client afterwards (same bytes in every run).
fn redis_session(env: &mut Env, server_mode: Mode, client_mode: Mode) -> (RedisRun, Delta) {
    let (server, port) = start_redis(env, server_mode);
    let ps = port.to_string();
    let value = pseudo_random(256 << 10, 77);
    let s0 = env.stats();
    let mut outputs = Vec::new();
    let set = env.run_stdin(
        client_mode,
        "cli-set",
        "redis-cli",
        &["-p", &ps, "-x", "SET", "big"],
        &value,
        T,
    );
    outputs.push(set.stdout());
    let get = env.run(
        client_mode,
        "cli-get",
        "redis-cli",
        &["-p", &ps, "--raw", "GET", "big"],
        T,
    );
    let mut g = get.stdout();
    g.pop();
    assert!(
        g == value,
        "GET returned a different value ({} bytes)",
        g.len()
    );
    outputs.push(get.stdout());
    let batch = b"INCRBY counter 5\nRPUSH list a b c d\nLRANGE list 0 -1\nSTRLEN big\nGETRANGE big 1000 1031\nDEL list\n".to_vec();
    let b = env.run_stdin(
        client_mode,
        "cli-batch",
        "redis-cli",
        &["-p", &ps],
        &batch,
        T,
    );
    outputs.push(b.stdout());
    let d = delta(&s0, &env.stats());
    let info = env
        .run(
            Mode::Plain,
            "cli-info",
            "redis-cli",
            &["-p", &ps, "INFO", "stats"],
            T,
        )
        .stdout_str();
    let server_in = info_field(&info, "total_net_input_bytes")
        .unwrap()
        .parse()
        .unwrap();
    let server_out = info_field(&info, "total_net_output_bytes")
        .unwrap()
        .parse()
        .unwrap();
    drop(server);
    (
        RedisRun {
            outputs,
            server_in,
            server_out,
            conns: 3,
        },
        d,
    )
}

#[test]
fn redis_smclo_client_plain_server() {
    let mut env = Env::new("mixed-redis-c");
    let (ctl, _) = redis_session(&mut env, Mode::Plain, Mode::Plain);
    let (run, d) = redis_session(&mut env, Mode::Plain, Mode::Smclo);
    assert!(
        run.outputs == ctl.outputs,
        "client output differs from the plain control"
    );
    assert_eq!(
        run.server_in, ctl.server_in,
        "plain redis-server read a different number of bytes than from a plain client"
    );
    assert_eq!(
        run.server_out, ctl.server_out,
        "plain redis-server wrote a different number of bytes"
    );
    assert_plain(
        "smclo redis-cli -> plain redis-server",
        &d,
        run.conns,
        "client",
        "",
    );
}

#[test]
fn redis_plain_client_smclo_server() {
    let mut env = Env::new("mixed-redis-s");
    let (ctl, _) = redis_session(&mut env, Mode::Plain, Mode::Plain);
    let (run, d) = redis_session(&mut env, Mode::Smclo, Mode::Plain);
    assert!(
        run.outputs == ctl.outputs,
        "plain client's output differs from the plain control"
    );
    assert_eq!(
        run.server_in, ctl.server_in,
        "smclo redis-server read a different number of bytes than plain"
    );
    assert_eq!(
        run.server_out, ctl.server_out,
        "smclo redis-server wrote a different number of bytes than plain"
    );
    assert_plain(
        "plain redis-cli -> smclo redis-server",
        &d,
        run.conns,
        "server",
        "",
    );
}

// ---------------------------------------------------------------- nginx

fn nginx_session(
    env: &mut Env,
    tag: &str,
    server_mode: Mode,
    client_mode: Mode,
) -> (Vec<Vec<u8>>, u64, Vec<String>, Delta) {
    let (root, _) = web_root(env, b"mixed small file\n", 99);
    let port = free_port();
    let nginx = start_nginx(
        env,
        server_mode,
        None,
        &format!("127.0.0.1:{port}"),
        &root,
        tag,
    );
    let s0 = env.stats();
    let base = format!("http://127.0.0.1:{port}");
    let (bodies, curl_bytes) = curl(
        env,
        client_mode,
        None,
        &format!("curl-{tag}"),
        &[format!("{base}/small.txt"), format!("{base}/big.bin")],
    );
    let d = delta(&s0, &env.stats());
    drop(nginx);
    let (_, _, lines) = nginx_log_bytes(env, tag);
    assert_eq!(bodies[0], fs::read(root.join("small.txt")).unwrap());
    assert_eq!(bodies[1], fs::read(root.join("big.bin")).unwrap());
    (bodies, curl_bytes, lines, d)
}

#[test]
fn nginx_smclo_client_plain_server() {
    let mut env = Env::new("mixed-nginx-c");
    let (cb, cbytes, clog, _) = nginx_session(&mut env, "ctl", Mode::Plain, Mode::Plain);
    let (b, bytes, log, d) = nginx_session(&mut env, "run", Mode::Plain, Mode::Smclo);
    assert!(b == cb, "bodies differ from the plain control");
    assert_eq!(
        bytes, cbytes,
        "curl moved a different number of bytes than plain"
    );
    assert_eq!(
        log, clog,
        "plain nginx logged different request/response sizes than with a plain client"
    );
    assert_plain("smclo curl -> plain nginx", &d, 1, "client", "");
}

#[test]
fn nginx_plain_client_smclo_server() {
    let mut env = Env::new("mixed-nginx-s");
    let (cb, cbytes, clog, _) = nginx_session(&mut env, "ctl", Mode::Plain, Mode::Plain);
    let (b, bytes, log, d) = nginx_session(&mut env, "run", Mode::Smclo, Mode::Plain);
    assert!(b == cb, "bodies differ from the plain control");
    assert_eq!(
        bytes, cbytes,
        "plain curl sent/received a different number of bytes than from a plain nginx"
    );
    assert_eq!(log, clog, "smclo nginx logged different sizes than plain");
    assert_plain("plain curl -> smclo nginx", &d, 1, "server", "");
}

// ---------------------------------------------------- server speaks first

const BANNER_SERVER: &str = r#"
import hashlib, socket, sys
port, n, blen = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
banner = bytes((i * 7 + 3) % 251 for i in range(blen))
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(16)
for _ in range(n):
    c, _ = ls.accept()
    c.sendall(banner)
    total, h = 0, hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b:
            break
        total += len(b)
        h.update(b)
    c.sendall(("got %d %s\n" % (total, h.hexdigest())).encode())
    c.close()
    print("server received %d %s" % (total, h.hexdigest()), flush=True)
"#;

const BANNER_CLIENT: &str = r#"
import hashlib, socket, sys
port, blen, plen = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection(("127.0.0.1", port), timeout=20)
got = b""
while len(got) < blen:
    b = c.recv(blen - len(got))
    if not b:
        sys.exit("banner cut short at %d" % len(got))
    got += b
payload = bytes((i * 13 + 1) % 256 for i in range(plen))
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
rest = b""
while True:
    b = c.recv(65536)
    if not b:
        break
    rest += b
print("client received %d banner %s reply %r" % (len(got) + len(rest), hashlib.sha256(got).hexdigest(), rest.decode()))
"#;

const BLEN: usize = 300_000;
const PLEN: usize = 200_000;
const CONNS: u64 = 3;

fn banner_session(
    env: &mut Env,
    server_mode: Mode,
    client_mode: Mode,
) -> (Vec<String>, String, Delta) {
    fs::write(env.path("banner_server.py"), BANNER_SERVER).unwrap();
    fs::write(env.path("banner_client.py"), BANNER_CLIENT).unwrap();
    let port = free_port();
    let (ps, bl, pl) = (port.to_string(), BLEN.to_string(), PLEN.to_string());
    let mut server = env.spawn(
        server_mode,
        "banner-server",
        "python3",
        &["banner_server.py", &ps, &CONNS.to_string(), &bl],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let mut outs = Vec::new();
    for i in 0..CONNS {
        let c = env.run(
            client_mode,
            &format!("banner-client{i}"),
            "python3",
            &["banner_client.py", &ps, &bl, &pl],
            T,
        );
        outs.push(c.stdout_str());
    }
    server.wait_ok(T);
    let d = delta(&s0, &env.stats());
    (outs, server.stdout_str(), d)
}

fn check_banner_counts(client_out: &[String], server_out: &str) {
    // Each side received exactly what the other sent: the client the banner
    // and the one-line reply, the server the payload.
    for o in client_out {
        let n: usize = o.split_whitespace().nth(2).unwrap().parse().unwrap();
        let reply = o.split("reply '").nth(1).unwrap();
        let reply_len = reply.len() - "\\n'\n".len() + 1;
        assert_eq!(n, BLEN + reply_len, "client received {n} bytes: {o}");
    }
    for l in server_out.lines() {
        let n: usize = l.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert_eq!(n, PLEN, "server received {n} bytes: {l}");
    }
    assert_eq!(server_out.lines().count() as u64, CONNS);
}

#[test]
fn server_first_smclo_client_plain_server() {
    let mut env = Env::new("mixed-banner-c");
    let (cc, cs, _) = banner_session(&mut env, Mode::Plain, Mode::Plain);
    check_banner_counts(&cc, &cs);
    let (c, s, d) = banner_session(&mut env, Mode::Plain, Mode::Smclo);
    check_banner_counts(&c, &s);
    assert_eq!(
        c, cc,
        "smclo client's results differ from the plain control"
    );
    assert_eq!(
        s, cs,
        "plain server's results differ from the plain control"
    );
    assert_plain(
        "smclo client -> plain banner server",
        &d,
        CONNS,
        "client",
        "",
    );
}

#[test]
fn server_first_plain_client_smclo_server() {
    let mut env = Env::new("mixed-banner-s");
    let (cc, cs, _) = banner_session(&mut env, Mode::Plain, Mode::Plain);
    check_banner_counts(&cc, &cs);
    let (c, s, d) = banner_session(&mut env, Mode::Smclo, Mode::Plain);
    check_banner_counts(&c, &s);
    assert_eq!(
        c, cc,
        "plain client's results differ from the plain control"
    );
    assert_eq!(
        s, cs,
        "smclo server's results differ from the plain control"
    );
    assert_plain(
        "plain client -> smclo banner server",
        &d,
        CONNS,
        "server",
        "",
    );
}

/// Both ends under smclo, server speaking first: accelerated, same results.
#[test]
fn server_first_both_smclo() {
    let mut env = Env::new("mixed-banner-both");
    let (cc, cs, _) = banner_session(&mut env, Mode::Plain, Mode::Plain);
    let (c, s, d) = banner_session(&mut env, Mode::Smclo, Mode::Smclo);
    check_banner_counts(&c, &s);
    assert_eq!(c, cc, "results differ from the plain control");
    assert_eq!(s, cs, "results differ from the plain control");
    // Exact: banner + payload + reply line per connection.
    let reply = cc[0].split("reply '").nth(1).unwrap().len() - "\\n'\n".len() + 1;
    let want = CONNS * (BLEN + PLEN + reply) as u64;
    assert_smc(
        "smclo client -> smclo banner server",
        &d,
        CONNS,
        want,
        want,
        "",
    );
    assert_clean(&env, true);
}
