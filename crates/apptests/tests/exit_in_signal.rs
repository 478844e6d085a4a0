//! `_exit` from a signal handler: the preload's exit hook closes the
//! process's SMC-D connections, and must do so with async-signal-safe work
//! only. A SIGTERM handler that calls `_exit` in a thread that holds the
//! preload's table lock (or malloc's) used to wait for that lock forever.

use smclo_apptests::*;
use std::path::Path;
use std::time::{Duration, Instant};

const RUNS: u32 = 25;

fn source(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/exit_in_signal")
        .join(name)
        .display()
        .to_string()
}

/// Waits up to `limit` for `p` to exit; whether it did.
fn exits_within(p: &mut Proc, limit: Duration) -> bool {
    let t0 = Instant::now();
    while p.alive() {
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[test]
fn sigterm_handler_calling_exit_never_hangs() {
    let mut env = Env::new("exit-in-signal");
    // A loaded machine must not turn a handshake into a TIMEOUT fallback.
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let exe = compile_c(&env, Path::new(&source("client.c")), &["-pthread"]);
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "server",
        "python3",
        &[&source("server.py"), &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let mut hung = Vec::new();
    for run in 0..RUNS {
        let mut client = env.spawn(Mode::Smclo, "client", exe.to_str().unwrap(), &[&ps]);
        let t0 = Instant::now();
        while !client.stdout_str().contains("READY") {
            assert!(
                client.alive() && t0.elapsed() < Duration::from_secs(20),
                "run {run}: the client did not get going\n{}\n{}",
                client.logs(),
                server.logs()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // Somewhere in the threads' loops.
        std::thread::sleep(Duration::from_millis(u64::from(run % 7) * 7));
        // SAFETY: kill has no memory-safety preconditions; our child.
        unsafe { libc::kill(client.pid() as i32, libc::SIGTERM) };
        // Exiting takes milliseconds; a hang is forever.
        if !exits_within(&mut client, Duration::from_secs(5)) {
            hung.push(run);
        }
    }
    let d = delta(&s0, &env.stats());
    eprintln!(
        "{RUNS} runs, hung: {hung:?}; {} SMC-D connections, fallbacks: {}",
        d.conns_opened,
        d.fallbacks_desc()
    );
    assert!(
        d.conns_opened >= u64::from(RUNS) * 2,
        "the clients' connections did not go through shared memory: {d:?}"
    );
    assert!(hung.is_empty(), "runs {hung:?} of {RUNS} hung in _exit");
    assert!(server.alive(), "the server died\n{}", server.logs());
}
