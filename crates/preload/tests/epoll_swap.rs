//! Another thread's `epoll_ctl(EPOLL_CTL_MOD)` of a socket whose
//! non-blocking connect the swap is turning into an SMC-D connection
//! (`tests/c/epoll_swap.c`). Before, such a call could wait for the
//! table's lock and then take it again in the same thread (a hang), or
//! find the number already the connection's while the swap had not yet
//! given its registrations back (`ENOENT`, or a registration the shadow
//! did not know, and a wait that never ended). The swap now moves the
//! registrations, kernel's and shadow's, before the number names the
//! connection, under the lock. And the main thread's `epoll_wait` (10 s)
//! could sleep in the kernel without driving its pending handshake, when
//! it read the count of pending numbers while the other thread's call
//! recorded its registration (the count dropped to 0 for a moment).

use std::process::Command;

mod common;
use common::{compile, lib};

/// Rounds of the program: each one a connection whose swap races with the
/// modifications (the first failures came within 200 rounds).
const ROUNDS: &str = "300";

#[test]
fn modifying_a_registration_while_the_swap_moves_it_never_fails() {
    let exe = compile("epoll_swap", &["-pthread"]);
    let dev = smclo_testsupport::DevDir::new("epoll-swap");
    let out = Command::new("timeout")
        .args(["-s", "KILL", "120"])
        .arg(&exe)
        .arg(ROUNDS)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev.0)
        // Every connection proposes, though each carries one byte.
        .env("SMCLO_SHORT", "smc")
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run epoll_swap");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stats = smclo::device::Device::open(&dev.0)
        .expect("open the test device")
        .stats();
    let report = format!(
        "{:?}\nstdout: {stdout}\nstderr: {}\nstats: {stats:?}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{report}");
    assert!(stdout.starts_with(&format!("OK {ROUNDS} ")), "{report}");
    assert_eq!(
        stats.conns_opened.to_string(),
        ROUNDS,
        "every connection SMC-D\n{report}"
    );
    assert_eq!(stats.fallbacks_total(), 0, "{report}");
}
