//! The harness itself, where its own answers decide whether a test passes.

use smclo_apptests::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// `listening` answers in well under a millisecond however many TIME_WAIT
/// sockets the network namespace holds. It read the whole of
/// /proc/<pid>/net/tcp: over 30 ms for these 25000 sockets, seconds on a
/// loaded machine after the churn tests (70000 of them), and `wait_listen`
/// on systemd-socket-activate once gave up after 10 s. The sockets are made
/// in a network namespace of the test's own.
#[test]
fn listening_is_fast_beside_many_time_wait_sockets() {
    const N: u32 = 25000;
    let mut env = Env::new("harness-time-wait");
    let ns = env.netns("tw");
    let up = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"])
        .status()
        .expect("ip link set lo up");
    assert!(up.success());
    let port = 20000;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness/time_wait.py");
    let cmd = env.command(
        Mode::Plain,
        Some(&ns.name),
        "python3",
        &[script.to_str().unwrap(), &port.to_string(), &N.to_string()],
    );
    let mut p = env.spawn_cmd("time-wait", cmd);
    let t0 = Instant::now();
    while !p.stdout_str().contains("READY") {
        assert!(p.alive(), "{}", p.logs());
        assert!(t0.elapsed() < Duration::from_secs(120), "{}", p.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut fastest = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        assert!(
            listening(port, Some(p.pid())),
            "the listener is not seen: {:?}",
            sockdiag::listening_ports_of(p.pid())
        );
        fastest = fastest.min(t.elapsed());
    }
    assert!(!listening(port + 1, Some(p.pid())), "nothing else listens");
    eprintln!("listening() beside {N} TIME_WAIT sockets: {fastest:?} at best");
    assert!(
        fastest < Duration::from_millis(5),
        "listening() took {fastest:?} at best beside {N} TIME_WAIT sockets"
    );
    p.stop(Duration::from_secs(2));
}
