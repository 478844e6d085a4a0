//! Listening sockets a program inherits through exec are accelerated like
//! the ones it makes itself: systemd-socket-activate (a plain parent, as
//! systemd) passes its listener to a server under `smclo run`
//! (`LISTEN_FDS`); a supervisor under `smclo run` binds, listens and execs
//! the server with the socket; inetd's wait mode gives the server the
//! listener as standard input. A supervisor under `smclo run` that execs a
//! program without the preload leaves no client waiting. A python client under `smclo run` checks
//! every byte; the device's counters say which connections went through
//! shared memory.

use smclo::device::Device;
use smclo::testing::registry;
use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SIZE: usize = 300_000;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/echo_check.py")
}

/// Waits (at most 10 s) until a listener on `port` is registered in the
/// device; false if none is.
fn registered(env: &Env, port: u16) -> bool {
    let dev = Device::open(&env.dev_dir).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if registry::listeners(&dev)
            .iter()
            .any(|l| l.addr.port() == port)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Runs the checking client for `count` connections; returns the bytes it
/// moved (both ways).
fn client(env: &mut Env, port: u16, count: u64, logs: &str) -> u64 {
    let s = script();
    let p = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &[
            s.to_str().unwrap(),
            "client",
            "127.0.0.1",
            &port.to_string(),
            &count.to_string(),
            &SIZE.to_string(),
        ],
        T,
    );
    let [sent, received] = ok_numbers(&p, logs)[..] else {
        panic!("echo_check.py client printed no byte counts")
    };
    sent + received
}

/// systemd-socket-activate listens and, at the first connection, execs the
/// server with the listener as descriptor 3 (`LISTEN_FDS=1`). The first
/// connection was queued before the server ran: its client found no
/// listener and it stays TCP (PEERNOSMC at the client, NO_SAVED_SYN at the
/// server: the SYN came before SYNs were saved). Every later one is SMC-D,
/// byte-exact.
#[test]
fn systemd_socket_activate_listener_is_accelerated() {
    let mut env = Env::new("socket-activate");
    let ssa = require("systemd-socket-activate");
    let port = free_port();
    let (s, smclo, py) = (script(), smclo_bin(), require("python3"));
    let count = 4u64;
    let listen = format!("127.0.0.1:{port}");
    let mut cmd = env.command(
        Mode::Plain,
        None,
        ssa.to_str().unwrap(),
        &[
            "-l",
            &listen,
            // systemd-socket-activate passes only what -E names.
            "-E",
            "SMCLO_DEVICE_DIR",
            "-E",
            "SMCLO_DEBUG=1",
            smclo.to_str().unwrap(),
            "run",
            "--",
            py.to_str().unwrap(),
            s.to_str().unwrap(),
            "server",
            "3",
            "block",
            &count.to_string(),
        ],
    );
    cmd.env("SMCLO_DEBUG", "1");
    let mut server = env.spawn_cmd("socket-activate", cmd);
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let moved = client(&mut env, port, count, &server.logs());
    server.wait_ok(T);
    let d = delta(&s0, &env.stats());
    let logs = server.logs();
    eprintln!(
        "socket activation: {} SMC-D connections, xfer_bytes {}, fallbacks: {}",
        d.conns_opened,
        d.xfer_bytes,
        d.fallbacks_desc()
    );
    assert_eq!(d.conns_opened, count - 1, "{}\n{logs}", d.fallbacks_desc());
    let per_conn = moved / count;
    assert_eq!(d.xfer_bytes, per_conn * (count - 1), "{d:?}\n{logs}");
    let (peernosmc, nosyn) = (Reason::PeerNoSmc.index(), Reason::NoSavedSyn.index());
    assert_eq!(d.fallback_client[peernosmc], 1, "{d:?}\n{logs}");
    assert_eq!(d.fallback_server[nosyn], 1, "{d:?}\n{logs}");
    assert_eq!(d.fallbacks(), 2, "{}\n{logs}", d.fallbacks_desc());
    assert!(
        logs.contains("inherited") && logs.contains("NO_SAVED_SYN"),
        "the debug log names the inherited listener and the first connection's reason\n{logs}"
    );
    assert_clean(&env, true);
}

/// A supervisor under `smclo run` binds and listens (registered), then
/// execs the server, which waits for the listener with epoll: the
/// supervisor's registration ends at exec, the server's begins when it adds
/// the listener to its epoll set, before any client connects. Every
/// connection is SMC-D, byte-exact.
#[test]
fn supervisor_exec_listener_is_accelerated() {
    let mut env = Env::new("supervisor-exec");
    let port = free_port();
    let s = script();
    let count = 4u64;
    let mut server = env.spawn(
        Mode::Smclo,
        "supervisor",
        "python3",
        &[
            s.to_str().unwrap(),
            "supervise",
            &port.to_string(),
            "epoll",
            &count.to_string(),
        ],
    );
    // "ready" comes from the server, after the exec.
    server.wait_stdout("ready", Duration::from_secs(10), &[]);
    let seen = registered(&env, port);
    let s0 = env.stats();
    let moved = client(&mut env, port, count, &server.logs());
    server.wait_ok(T);
    let d = delta(&s0, &env.stats());
    assert!(seen, "the server's inherited listener was never registered");
    assert_smc(
        "listener inherited from a supervisor",
        &d,
        count,
        moved,
        moved,
        &server.logs(),
    );
    assert_eq!(d.conns_opened, count, "{d:?}");
    assert_clean(&env, true);
}

/// inetd's wait mode: the server gets the listening socket as its standard
/// input (descriptor 0) and accepts on it. Registered at its first
/// `accept`, before any client connects here: every connection is SMC-D,
/// byte-exact.
#[test]
fn inetd_wait_mode_listener_on_stdin_is_accelerated() {
    let mut env = Env::new("inetd-wait");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let s = script();
    let count = 3u64;
    let mut cmd = env.command(
        Mode::Smclo,
        None,
        "python3",
        &[
            s.to_str().unwrap(),
            "server",
            "0",
            "block",
            &count.to_string(),
        ],
    );
    cmd.stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
        listener,
    )));
    let mut server = env.spawn_cmd("inetd-wait-server", cmd);
    let seen = registered(&env, port);
    let s0 = env.stats();
    let moved = client(&mut env, port, count, &server.logs());
    server.wait_ok(T);
    let d = delta(&s0, &env.stats());
    assert!(seen, "the listener on descriptor 0 was never registered");
    assert_smc("inetd wait mode", &d, count, moved, moved, &server.logs());
    assert_eq!(d.conns_opened, count, "{d:?}");
    assert_clean(&env, true);
}

/// systemd-socket-activate itself under `smclo run` registers the listener
/// it makes, and a client connects (and proposes) before it execs the
/// server, here a static program that will never answer a proposal. The
/// client, which waits for its connection to become writable before it
/// writes (as curl does), learns at its first look that the listener is no
/// longer registered and goes on as TCP (PEERNOSMC), not after
/// `SMCLO_CLC_WAIT_MS` (set to 5 s here; TIMEOUT before).
#[test]
fn a_proposal_to_a_listener_handed_to_a_static_program_does_not_wait() {
    let mut env = Env::new("activate-static");
    let ssa = require("systemd-socket-activate");
    let server = compile_c(
        &env,
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/static_answer.c"),
        &["-static"],
    );
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut srv = env.spawn(
        Mode::Smclo,
        "socket-activate",
        ssa.to_str().unwrap(),
        &["-l", &listen, server.to_str().unwrap(), "2"],
    );
    wait_listen(&mut srv, port);
    assert!(
        registered(&env, port),
        "systemd-socket-activate's listener was never registered\n{}",
        srv.logs()
    );
    let s0 = env.stats();
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/wait_writable.py");
    for _ in 0..2 {
        let mut c = env.command(
            Mode::Smclo,
            None,
            "python3",
            &[py.to_str().unwrap(), "127.0.0.1", &port.to_string()],
        );
        c.env("SMCLO_CLC_WAIT_MS", "5000").env("SMCLO_DEBUG", "1");
        let mut p = env.spawn_cmd("client", c);
        let st = p.wait(T);
        let out = p.stdout_str();
        assert!(
            st.success() && out.contains("answer 'answer\\n'"),
            "{out}\n{}",
            p.logs()
        );
        let waited: f64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(
            waited < 2.5,
            "the client waited {waited} s for its connection\n{}",
            p.logs()
        );
    }
    srv.wait_ok(T);
    let d = delta(&s0, &env.stats());
    let logs = srv.logs();
    assert_eq!(d.conns_opened, 0, "{d:?}\n{logs}");
    assert_eq!(
        d.fallback(Reason::Timeout),
        (0, 0),
        "{}\n{logs}",
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallback(Reason::PeerNoSmc).0,
        2,
        "{}\n{logs}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallbacks(), 2, "{}\n{logs}", d.fallbacks_desc());
    assert_clean(&env, true);
}
