//! `fork` while another thread waits for an undecided handshake waits for
//! that decision too, so that the child inherits no undecided handshake
//! without the thread that drives it (its calls on the descriptor would
//! wait for ever): `tests/c/fork_pending.c`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

mod common;
use common::{compile, lib};

#[test]
fn fork_waits_for_a_handshake_another_thread_drives() {
    let exe = compile("fork_pending", &[]);
    let dev = PathBuf::from(format!(
        "/dev/shm/smclo-fork-pending-test-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dev);
    let out = Command::new("timeout")
        .arg("60")
        .arg(&exe)
        .arg("dup")
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev)
        // The server never accepts: the handshake decides (TCP) at this
        // deadline, well within the child's alarm (5 s).
        .env("SMCLO_CLC_WAIT_MS", "1500")
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE")
        .stdin(Stdio::null())
        .output()
        .expect("run fork_pending");
    let _ = std::fs::remove_dir_all(&dev);
    let _ = std::fs::remove_file(&exe);
    let report = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "fork_pending failed\n{report}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("OK 0"),
        "{report}"
    );
}
