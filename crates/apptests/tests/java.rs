//! Java under `smclo run` (crates/apptests/tests/java/Echo.java): a
//! thread-per-connection `ServerSocket` server and a `Selector` (NIO)
//! server, each with a pool of client threads whose every echo is checked;
//! and the JDK's asynchronous close (another thread closes a socket or
//! channel a reader is blocked in, or interrupts it), which swaps a dead
//! descriptor onto the socket's number under the reader.

use smclo_apptests::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Compiles Echo.java into the test's directory; returns the class path.
fn compile(env: &Env) -> PathBuf {
    let javac = require("javac");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/java/Echo.java");
    let out = env.path("classes");
    let st = std::process::Command::new(javac)
        .arg("-d")
        .arg(&out)
        .arg(&src)
        .status()
        .expect("javac");
    assert!(st.success(), "javac {} failed", src.display());
    out
}

/// Runs `client_mode` of Echo against Echo's `server_mode`, both under
/// `smclo run`; returns the client's numbers (connections, bytes echoed)
/// and the device's counters over the client's run.
fn pair(name: &str, server_mode: &str, client_args: &[&str]) -> (u64, u64, Delta, String) {
    let mut env = Env::new(name);
    let cp = compile(&env);
    let cp = cp.to_str().unwrap();
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "java-server",
        "java",
        &["-cp", cp, "Echo", server_mode, &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let mut args = vec!["-cp", cp, "Echo"];
    args.extend_from_slice(&client_args[..1]);
    args.push(&ps);
    args.extend_from_slice(&client_args[1..]);
    let client = env.run(
        Mode::Smclo,
        "java-client",
        "java",
        &args,
        Duration::from_secs(120),
    );
    let logs = server.logs();
    let [conns, bytes] = ok_numbers(&client, &logs)[..] else {
        panic!("Echo.java printed no connection and byte counts\n{logs}")
    };
    let d = delta(&s0, &env.stats());
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
    (conns, bytes, d, logs)
}

#[test]
fn java_thread_per_connection_server() {
    let (conns, bytes, d, logs) = pair("java-threads", "server", &["client", "40"]);
    assert_eq!(conns, 40);
    // Every byte once each way, through the rings and nowhere else.
    assert_smc(
        "java ServerSocket echo",
        &d,
        conns,
        2 * bytes,
        2 * bytes,
        &logs,
    );
}

#[test]
fn java_nio_selector_server() {
    let (conns, bytes, d, logs) = pair("java-nio", "nioserver", &["client", "40"]);
    assert_eq!(conns, 40);
    assert_smc("java Selector echo", &d, conns, 2 * bytes, 2 * bytes, &logs);
}

#[test]
fn java_asynchronous_close_wakes_a_blocked_reader() {
    let (conns, bytes, d, logs) = pair("java-close", "server", &["asyncclose"]);
    // Echo.java checked that each blocked reader woke with the exception
    // the JDK documents; these are the connections it blocked on.
    assert_eq!((conns, bytes), (7, 3));
    assert_smc(
        "java asynchronous close",
        &d,
        conns,
        2 * bytes,
        2 * bytes,
        &logs,
    );
}
