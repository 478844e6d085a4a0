//! `smclo ss -a` under `smclo run`: a python server and client with one
//! SMC-D connection (known bytes each way, half-closed by the client), a
//! plain client's connection to the server (a fallback, PEERNOSMC, listed
//! until the server has closed it and a duplicate of it) and the client's
//! connection to a plain server (not listed: it costs no system call).
//! Every field of the JSON output is checked.

use smclo_apptests::*;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

/// Accepts two connections on port argv[1]: the first (SMC-D) reads 1111
/// bytes and writes 2222, the second (a plain client) nothing; prints
/// `served N` after each. Once the file `dup` exists it duplicates the
/// second and closes the original (`dupped`), once `close` exists it
/// closes the duplicate (`closed`), and it exits once `stop` exists.
const SERVER: &str = r#"
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(8)
print("listening", flush=True)
held = []
for i, (r, w) in enumerate([(1111, 2222), (0, 0)]):
    c, _ = s.accept()
    got = 0
    while got < r:
        got += len(c.recv(r - got))
    c.sendall(b"s" * w)
    held.append(c)
    print("served", i + 1, flush=True)
while not os.path.exists("dup"):
    time.sleep(0.01)
d = os.dup(held[1].fileno())
held[1].close()
print("dupped", flush=True)
while not os.path.exists("close"):
    time.sleep(0.01)
os.close(d)
print("closed", flush=True)
while not os.path.exists("stop"):
    time.sleep(0.01)
"#;

/// Connects to the smclo server (argv[1]) and to a plain one (argv[2]);
/// writes 1111 bytes and reads 2222 on the first, then shuts down writing;
/// prints both local addresses and exits once the file `stop` exists.
const CLIENT: &str = r#"
import os, socket, sys, time
a = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
b = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
a.sendall(b"c" * 1111)
got = 0
while got < 2222:
    got += len(a.recv(2222 - got))
a.shutdown(socket.SHUT_WR)
print("smc %s:%d" % a.getsockname(), flush=True)
print("tcp %s:%d" % b.getsockname(), flush=True)
while not os.path.exists("stop"):
    time.sleep(0.01)
"#;

/// The value after `prefix` on a line of `p`'s output, waiting for it.
fn wait_line(p: &Proc, prefix: &str) -> String {
    let end = Instant::now() + T;
    loop {
        if let Some(l) = p.stdout_str().lines().find_map(|l| l.strip_prefix(prefix)) {
            return l.to_string();
        }
        assert!(
            Instant::now() < end,
            "no {prefix:?} from {}:\n{}",
            p.name,
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ss(env: &Env, args: &[&str]) -> String {
    let o = std::process::Command::new(smclo_bin())
        .arg("ss")
        .args(args)
        .env("SMCLO_DEVICE_DIR", &env.dev_dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "smclo ss {args:?}: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// The JSON objects of array `key` (flat objects, as `smclo ss` prints).
fn objects<'a>(json: &'a str, key: &str) -> Vec<&'a str> {
    let pat = format!("\"{key}\":[");
    let start = json
        .find(&pat)
        .unwrap_or_else(|| panic!("no {key} in {json}"))
        + pat.len();
    let body = &json[start..start + json[start..].find(']').unwrap()];
    if body.is_empty() {
        return Vec::new();
    }
    body.trim_start_matches('{')
        .trim_end_matches('}')
        .split("},{")
        .collect()
}

/// `"k":v` pairs of a flat JSON object, in order.
fn pairs(obj: &str) -> Vec<(String, String)> {
    obj.split(",\"")
        .map(|kv| {
            let (k, v) = kv.split_once("\":").unwrap();
            (
                k.trim_matches('"').to_string(),
                v.trim_matches('"').to_string(),
            )
        })
        .collect()
}

fn pidns(pid: u32) -> String {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .unwrap()
        .ino()
        .to_string()
}

/// Checks every field of `obj` except the tokens, which only pair.
fn check(obj: &str, want: &[(&str, String)]) {
    let got: Vec<(String, String)> = pairs(obj)
        .into_iter()
        .filter(|(k, _)| k != "token" && k != "peer_token")
        .collect();
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    assert_eq!(got, want, "in {obj}");
}

#[test]
fn ss_all_lists_smc_and_fallback_connections_of_programs() {
    let mut env = Env::new("ss");
    env.run_opts = vec!["-r".into(), "64k".into()];
    let port = free_port();
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let plain_port = plain.local_addr().unwrap().port();
    let (ps, pps) = (port.to_string(), plain_port.to_string());
    let mut server = env.spawn(Mode::Smclo, "server", "python3", &["-c", SERVER, &ps]);
    wait_line(&server, "listening");
    let client = env.spawn(Mode::Smclo, "client", "python3", &["-c", CLIENT, &ps, &pps]);
    let (_plain_conn, _) = plain.accept().unwrap();
    let smc_local: SocketAddr = wait_line(&client, "smc ").parse().unwrap();
    let tcp_local: SocketAddr = wait_line(&client, "tcp ").parse().unwrap();
    wait_line(&server, "served 1");
    let plain_client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    wait_line(&server, "served 2");
    let server_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let plain_client_addr = plain_client.local_addr().unwrap();
    let (sp, cp) = (server.pid(), client.pid());
    let proc_fields = |pid: u32| {
        [
            ("pid", pid.to_string()),
            ("pidns", pidns(pid)),
            ("program", "python3".to_string()),
        ]
    };

    let json = ss(&env, &["-a", "--json"]);
    let conns = objects(&json, "connections");
    assert_eq!(conns.len(), 2, "{json}");
    let by_local = |objs: &[&str], local: SocketAddr| -> String {
        objs.iter()
            .find(|o| o.contains(&format!("\"local\":\"{local}\"")))
            .unwrap_or_else(|| panic!("no {local} in {json}"))
            .to_string()
    };
    let smc_end = |state: &str,
                   pid,
                   role: &str,
                   local: SocketAddr,
                   peer: SocketAddr,
                   sent: u64,
                   recv: u64| {
        let mut v: Vec<(&str, String)> = vec![("state", state.to_string())];
        v.extend(proc_fields(pid));
        v.extend([
            ("role", role.to_string()),
            ("local", local.to_string()),
            ("peer", peer.to_string()),
            ("mode", "smcd".to_string()),
            ("bytes_sent", sent.to_string()),
            ("bytes_received", recv.to_string()),
            ("ring_len", "65536".to_string()),
            ("ring_fill", "0".to_string()),
        ]);
        v
    };
    check(
        &by_local(&conns, smc_local),
        &smc_end(
            "PEERCLOSEWAIT1",
            cp,
            "client",
            smc_local,
            server_addr,
            1111,
            2222,
        ),
    );
    check(
        &by_local(&conns, server_addr),
        &smc_end(
            "APPCLOSEWAIT1",
            sp,
            "server",
            server_addr,
            smc_local,
            2222,
            1111,
        ),
    );
    let fbs = objects(&json, "fallbacks");
    assert_eq!(fbs.len(), 1, "only the server's fallback: {json}");
    assert!(!json.contains(&tcp_local.to_string()), "{json}");
    let mut want: Vec<(&str, String)> = vec![("state", "ACTIVE".to_string())];
    want.extend(proc_fields(sp));
    want.extend([
        ("role", "server".to_string()),
        ("local", server_addr.to_string()),
        ("peer", plain_client_addr.to_string()),
        ("mode", "tcp".to_string()),
        ("reason", "PEERNOSMC".to_string()),
        ("reason_code", "0x03010000".to_string()),
    ]);
    check(fbs[0], &want);

    // Without -a: no fallbacks; the text table has the same rows.
    assert!(!ss(&env, &["--json"]).contains("fallbacks"));
    let text = ss(&env, &["-a"]);
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(
        text.lines().any(|l| l.split_whitespace().eq([
            "ACTIVE",
            &format!("{sp}/python3"),
            "server",
            &server_addr.to_string(),
            &plain_client_addr.to_string(),
            "TCP/PEERNOSMC",
            "-",
            "-",
            "-",
            "-"
        ])),
        "{text}"
    );

    // Listed while a duplicate of its descriptor is open, and no longer
    // once that is closed too.
    std::fs::write(env.path("dup"), b"").unwrap();
    wait_line(&server, "dupped");
    let json = ss(&env, &["-a", "--json"]);
    let fbs = objects(&json, "fallbacks");
    assert_eq!(fbs.len(), 1, "listed through the duplicate: {json}");
    check(fbs[0], &want);
    std::fs::write(env.path("close"), b"").unwrap();
    wait_line(&server, "closed");
    let json = ss(&env, &["-a", "--json"]);
    assert!(objects(&json, "fallbacks").is_empty(), "{json}");
    drop(plain_client);

    std::fs::write(env.path("stop"), b"").unwrap();
    server.wait_ok(T);
    let mut client = client;
    client.wait_ok(T);
}
