//! A swap that fails after both sides committed to SMC-D (here: the kernel
//! refuses the client the descriptor for its hidden TCP socket) resets the
//! connection at both ends: the peer reads `ECONNRESET`, not a clean end of
//! stream, and the local program's socket reports `ECONNRESET` instead of
//! being a TCP connection nobody reads.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

fn source(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/failed_swap")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn failed_swap_resets_both_ends() {
    let mut env = Env::new("failed-swap");
    // A loaded machine must not turn a handshake into a TIMEOUT fallback.
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let exe = compile_c(&env, Path::new(&source("client.c")), &[]);
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "server",
        "python3",
        &[&source("server.py"), &ps],
    );
    wait_listen(&mut server, port);
    env.extra_env.push(("SMCLO_DEBUG".into(), "1".into()));
    let client = env.run(
        Mode::Smclo,
        "client",
        exe.to_str().unwrap(),
        &[&ps],
        Duration::from_secs(30),
    );
    server.wait_ok(Duration::from_secs(30));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    let s = env.stats();
    // The handshake completed: the server's end was swapped in.
    assert!(
        s.conns_opened >= 1,
        "no SMC-D connection was set up: {}\n{logs}",
        fallbacks_desc(&s)
    );
    assert!(
        client.stderr_str().contains("cannot hide the TCP socket"),
        "the client's swap did not fail as arranged\n{logs}"
    );
    assert_eq!(
        server.stdout_str().trim(),
        "RESET",
        "the server's read\n{logs}"
    );
    assert_eq!(
        client.stdout_str().trim(),
        "RESET",
        "the client's read\n{logs}"
    );
}
