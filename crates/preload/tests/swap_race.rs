//! A number the program replaces (`dup2`) while its non-blocking
//! connect's handshake decides stays what the program put there: the
//! swap, which puts the connection's channel at the number, looks under
//! the table's lock whether the number still holds the handshake it
//! decided, and ends the connection instead when it does not
//! (`tests/c/swap_race.c` says how the replacement is timed). `strace`
//! holds every `fcntl` 20 ms after it returned, which gives the other
//! thread time to come in between the swap's start (a `fcntl` hides the
//! TCP socket) and its lock.

use std::path::PathBuf;
use std::process::{Command, Stdio};

mod common;
use common::{compile, lib};

/// Rounds that race (after the two that find where the swap hides its
/// TCP socket): each one found the swap under way and failed before the
/// swap looked again.
const ROUNDS: u32 = 8;

#[test]
fn a_number_replaced_during_the_swap_keeps_what_the_program_put_there() {
    let exe = compile("swap_race", &[]);
    let dev = PathBuf::from(format!(
        "/dev/shm/smclo-swap-race-test-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dev);
    let out = Command::new("timeout")
        .args([
            "120",
            "strace",
            "-f",
            "-o",
            "/dev/null",
            "-e",
            "trace=fcntl",
        ])
        .args(["-e", "inject=fcntl:delay_exit=20000"])
        .arg(&exe)
        .arg((ROUNDS + 2).to_string())
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev)
        // Every fcntl takes 20 ms: the server waits for the client's
        // answer longer than that.
        .env("SMCLO_CLC_WAIT_MS", "10000")
        .env_remove("SMCLO_DEBUG")
        .env_remove("SMCLO_DISABLE")
        .stdin(Stdio::null())
        .output()
        .expect("run strace (./test.sh runs as root with strace installed)");
    let _ = std::fs::remove_dir_all(&dev);
    let _ = std::fs::remove_file(&exe);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = format!(
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "swap_race failed\n{report}");
    let raced: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("OK {} (", ROUNDS + 2)))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no OK line\n{report}"));
    assert!(
        raced >= ROUNDS / 2,
        "the replacement came during the swap in {raced} of {ROUNDS} rounds only\n{report}"
    );
}
