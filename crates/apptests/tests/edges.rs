//! Edges with real programs: IPv6 ::1, iperf3 with parallel streams,
//! sendfile (-Z) and both directions at once, a client or server killed
//! in the middle of a transfer, and policies that make every connection fall
//! back (device switched off, UEIDs that differ): then the programs must
//! behave exactly as over plain TCP.

use smclo::device::Device;
use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::fs;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

fn www(env: &Env) -> (std::path::PathBuf, Vec<u8>) {
    web_root(env, b"edge\n", 0x1234_5678)
}

#[test]
fn nginx_curl_ipv6() {
    let mut env = Env::new("edge-ipv6");
    let (root, big) = www(&env);
    let port = free_port();
    let nginx = start_nginx(
        &mut env,
        Mode::Smclo,
        None,
        &format!("[::1]:{port}"),
        &root,
        "a",
    );
    let s0 = env.stats();
    let url = format!("http://[::1]:{port}/big.bin");
    let (b, bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl6",
        std::slice::from_ref(&url),
    );
    assert_eq!(
        sha256_bytes(&env, "b", &b[0]),
        sha256_bytes(&env, "b0", &big),
        "1 MiB body over ::1 differs"
    );
    let d = delta(&s0, &env.stats());
    assert_smc("nginx + curl over ::1", &d, 1, bytes, bytes, &nginx.logs());
}

/// 4 parallel streams, sendfile from a file (-Z), both directions at once.
#[test]
fn iperf3_parallel_zerocopy_bidir() {
    let mut env = Env::new("edge-iperf3");
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "iperf3-server",
        "iperf3",
        &["-s", "-B", "127.0.0.1", "-p", &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let c = env.run(
        Mode::Smclo,
        "iperf3",
        "iperf3",
        &[
            "-c",
            "127.0.0.1",
            "-p",
            &ps,
            "-t",
            "2",
            "-P",
            "4",
            "-Z",
            "--bidir",
            "--json",
        ],
        T,
    );
    let json = c.stdout_str();
    assert!(
        !json.contains("\"error\""),
        "iperf3 error:\n{json}\n{}",
        server.logs()
    );
    let sent = iperf3_json(
        &env,
        &json,
        "d['end']['sum_sent']['bytes'] + d['end']['sum_sent_bidir_reverse']['bytes']",
    ) as u64;
    let received = iperf3_json(
        &env,
        &json,
        "d['end']['sum_received']['bytes'] + d['end']['sum_received_bidir_reverse']['bytes']",
    ) as u64;
    let streams = iperf3_json(&env, &json, "len(d['end']['streams'])") as u64;
    assert_eq!(streams, 8, "4 streams each way");
    assert!(
        received <= sent && sent - received <= 8 * (4 << 20),
        "sent {sent}, received {received}"
    );
    let d = delta(&s0, &env.stats());
    // 8 data connections + control; as in iperf3_both_directions.
    assert_smc(
        "iperf3 -P 4 -Z --bidir",
        &d,
        9,
        sent,
        sent + (256 << 10),
        &server.logs(),
    );
    server.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

/// curl killed (SIGKILL) in the middle of 1 MiB bodies with 16 KiB rings,
/// so nginx is blocked on a full ring: nginx must notice, and serve the
/// next client normally.
#[test]
fn nginx_client_killed_mid_transfer() {
    let mut env = Env::new("edge-kill-client");
    env.run_opts = ["-r", "16k"].map(String::from).to_vec();
    let (root, big) = www(&env);
    let (mut nginx, port) = start_local_nginx(&mut env, &root);
    let url = format!("http://127.0.0.1:{port}/big.bin");
    // --limit-rate keeps curl reading slowly, the ring full.
    // On a busy machine a curl can be descheduled past the 300 ms and find
    // the whole body already there; it then exits 0 and was not killed mid-
    // transfer, so it is tried again. A curl that fails fails the test.
    let mut killed = 0;
    let mut tries = 0;
    while killed < 3 {
        tries += 1;
        assert!(
            tries <= 15,
            "no curl could be caught in the middle of a 1 MiB body at 64 KiB/s"
        );
        let cmd = env.command(
            Mode::Smclo,
            None,
            "curl",
            &["-sS", "--limit-rate", "64k", "-o", "/dev/null", &url],
        );
        let mut c = env.spawn_cmd(&format!("slow-curl{tries}"), cmd);
        std::thread::sleep(Duration::from_millis(300));
        if c.alive() {
            drop(c); // SIGKILL
            killed += 1;
        } else {
            let st = c.wait(Duration::from_secs(1));
            assert!(st.success(), "slow curl failed: {st}\n{}", c.logs());
        }
    }
    let s0 = env.stats();
    let (b, bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl-after",
        std::slice::from_ref(&url),
    );
    assert_eq!(b[0], big, "body after killed clients differs");
    let d = delta(&s0, &env.stats());
    assert_smc(
        "nginx after killed clients",
        &d,
        1,
        bytes,
        bytes,
        &nginx.logs(),
    );
    // nginx logged the aborted transfers (status 200, fewer bytes than the file).
    let t0 = Instant::now();
    loop {
        let (_, n, lines) = nginx_log_bytes(&env, "a");
        // Every curl started (killed or not) plus the one after them.
        if n > tries {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "nginx did not finish the killed clients' requests: {lines:?}\n{}",
            nginx.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    nginx.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

/// The server (nginx) killed with SIGKILL while curl downloads: curl must
/// fail (not hang, not report success with a short body).
#[test]
fn nginx_server_killed_mid_transfer() {
    let mut env = Env::new("edge-kill-server");
    env.run_opts = ["-r", "16k"].map(String::from).to_vec();
    let (root, _) = www(&env);
    let (nginx, port) = start_local_nginx(&mut env, &root);
    let url = format!("http://127.0.0.1:{port}/big.bin");
    let cmd = env.command(
        Mode::Smclo,
        None,
        "curl",
        &["-sS", "--limit-rate", "64k", "-o", "/dev/null", &url],
    );
    let mut c = env.spawn_cmd("slow-curl", cmd);
    std::thread::sleep(Duration::from_millis(500));
    assert!(c.alive(), "slow curl finished too early");
    drop(nginx); // SIGKILL to master and workers
    let st = c.wait(Duration::from_secs(20));
    assert!(
        !st.success(),
        "curl reported success although the server died mid-body\n{}",
        c.logs()
    );
    let e = c.stderr_str();
    assert!(
        e.contains("(18)")
            || e.contains("(56)")
            || e.contains("transfer closed")
            || e.contains("Recv failure"),
        "curl's error: {e}"
    );
    assert_clean(&env, false);
}

/// `smclo dev set active=0`: every connection falls back (NOSMCDDEV) and
/// the programs work as over TCP.
#[test]
fn device_inactive_redis_and_nginx_fall_back() {
    let mut env = Env::new("edge-inactive");
    Device::open(&env.dev_dir).unwrap().set_active(false);
    let (root, big) = www(&env);
    let (_redis, rport) = start_redis(&mut env, Mode::Smclo);
    let port = free_port();
    let _nginx = start_nginx(
        &mut env,
        Mode::Smclo,
        None,
        &format!("127.0.0.1:{port}"),
        &root,
        "a",
    );
    let s0 = env.stats();
    let (b, _) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl",
        &[format!("http://127.0.0.1:{port}/big.bin")],
    );
    assert_eq!(b[0], big);
    let v = pseudo_random(100_000, 5);
    env.run_stdin(
        Mode::Smclo,
        "cli-set",
        "redis-cli",
        &["-p", &rport.to_string(), "-x", "SET", "k"],
        &v,
        T,
    );
    let mut g = env
        .run(
            Mode::Smclo,
            "cli-get",
            "redis-cli",
            &["-p", &rport.to_string(), "--raw", "GET", "k"],
            T,
        )
        .stdout();
    g.pop();
    assert!(g == v, "redis value differs over the fallback");
    let d = delta(&s0, &env.stats());
    assert_eq!((d.conns_opened, d.xfer_bytes), (0, 0), "{d:?}");
    // The 3 clients do not propose (NOSMCDDEV); so their servers see no
    // proposal (PEERNOSMC).
    eprintln!("device inactive: {}", d.fallbacks_desc());
    assert_eq!(
        d.fallback_client[Reason::NoSmcdDev.index()],
        3,
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallback_server[Reason::PeerNoSmc.index()],
        3,
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallbacks(), 6, "nothing else: {}", d.fallbacks_desc());
}

/// Client and server with different SMCLO_UEIDs: the handshake declines
/// (NOUEID); the 1 MiB body is still exact.
#[test]
fn ueid_mismatch_falls_back() {
    let mut env = Env::new("edge-ueid");
    let (root, big) = www(&env);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // nginx with UEID A, curl with UEID B.
    env.extra_env = vec![("SMCLO_UEID".into(), "SMCLO-TEST-UEID-A".into())];
    let nginx = start_nginx(&mut env, Mode::Smclo, None, &listen, &root, "a");
    env.extra_env = vec![("SMCLO_UEID".into(), "SMCLO-TEST-UEID-B".into())];
    let s0 = env.stats();
    let (b, _) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl",
        &[format!("http://{listen}/big.bin")],
    );
    assert_eq!(b[0], big, "body differs after a declined handshake");
    let d = delta(&s0, &env.stats());
    assert_eq!(
        (d.conns_opened, d.xfer_bytes),
        (0, 0),
        "{d:?}\n{}",
        nginx.logs()
    );
    eprintln!("UEID mismatch: {}", d.fallbacks_desc());
    assert_eq!(
        d.fallbacks(),
        2,
        "one fallback on each side: {}",
        d.fallbacks_desc()
    );
    let i = Reason::NoUeid.index();
    assert_eq!(
        (d.fallback_client[i], d.fallback_server[i]),
        (1, 1),
        "NOUEID on both sides (the server declines, the client counts the Decline's reason): {}",
        d.fallbacks_desc()
    );
}

const FD_CLIENT: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /small.txt HTTP/1.1\r\nHost: x\r\n\r\n")
    socks.append(s)
for s in socks:
    b = b""
    while not b.endswith(b"edge\n"):
        d = s.recv(4096)
        if not d:
            sys.exit("EOF")
        b += d
print(max(s.fileno() for s in socks))
"#;

/// A program's descriptor numbers must grow as with TCP: one per
/// connection. Event loops sized by the number of connections (wrk:
/// 10 + 3 x connections; redis: maxclients + 128) and select()'s
/// FD_SETSIZE depend on it. 64 connections held open at once by python,
/// plain and under smclo run; the highest descriptor may differ by a few
/// (the preload's own descriptors), not by one per connection.
#[test]
fn descriptor_numbers_stay_dense() {
    let mut env = Env::new("edge-fds");
    let (root, _) = www(&env);
    fs::write(env.path("fdclient.py"), FD_CLIENT).unwrap();
    let (nginx, port) = start_local_nginx(&mut env, &root);
    let n = 64;
    let mut max = Vec::new();
    for mode in [Mode::Plain, Mode::Smclo] {
        let p = env.run(
            mode,
            "fdclient",
            "python3",
            &["fdclient.py", &port.to_string(), &n.to_string()],
            T,
        );
        max.push(
            p.stdout_str()
                .trim()
                .parse::<i64>()
                .unwrap_or_else(|_| panic!("{}\n{}", p.logs(), nginx.logs())),
        );
    }
    eprintln!(
        "highest descriptor with {n} connections: plain {}, smclo {}",
        max[0], max[1]
    );
    assert!(
        max[1] <= max[0] + 8,
        "with {n} connections the highest descriptor is {} under smclo run but {} over TCP: the preload keeps descriptors of its own at low numbers for every connection",
        max[1],
        max[0]
    );
}

/// A blocking connect that the kernel refuses makes no connection, so it
/// is no fallback (the kernel's SMC counts none either); it counted one
/// (PEERNOSMC at the client). A connect that succeeds to a plain server
/// still counts.
#[test]
fn a_refused_connect_is_no_fallback() {
    let mut env = Env::new("edge-refused");
    let plain = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let open = plain.local_addr().unwrap().port();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    fs::write(
        env.path("refused.py"),
        "import socket, sys\n\
         for port in sys.argv[1:]:\n\
         \x20   s = socket.socket()\n\
         \x20   try:\n\
         \x20       s.connect(('127.0.0.1', int(port)))\n\
         \x20       print(port, 'connected')\n\
         \x20   except ConnectionRefusedError:\n\
         \x20       print(port, 'refused')\n\
         \x20   s.close()\n",
    )
    .unwrap();
    let s0 = env.stats();
    let p = env.run(
        Mode::Smclo,
        "refused",
        "python3",
        &[
            "refused.py",
            &closed.to_string(),
            &closed.to_string(),
            &open.to_string(),
        ],
        T,
    );
    let out = p.stdout_str();
    assert_eq!(
        out,
        format!("{closed} refused\n{closed} refused\n{open} connected\n"),
        "{}",
        p.logs()
    );
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.fallback_client[Reason::PeerNoSmc.index()],
        1,
        "only the connect that made a connection counts: {}",
        d.fallbacks_desc()
    );
    drop(plain);
}
