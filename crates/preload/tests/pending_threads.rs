//! Two threads of one client process with non-blocking connects waited on
//! with `poll` (libpq's clients, pgbench -j 2): one thread's look takes the
//! other's server connection off the process's shared rendezvous socket
//! and files it while the other sleeps on in the kernel. The other must
//! still take it in time; it used to sleep until its deadline, and both
//! ends fell back with TIMEOUT (`tests/c/pending_threads.c` says how the
//! two threads are ordered). The device's counters prove every connection
//! was SMC-D.

use smclo::device::Device;
use std::path::PathBuf;
use std::process::Command;

/// Rounds of two connections each (about one in two fell back).
const ROUNDS: u32 = 10;

mod common;
use common::{compile, lib};

#[test]
fn a_connection_filed_by_another_thread_is_taken_in_time() {
    let exe = compile("pending_threads", &[]);
    let dev = PathBuf::from(format!(
        "/dev/shm/smclo-pending-threads-test-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dev);
    let out = Command::new("timeout")
        .arg("120")
        .arg(&exe)
        .arg(ROUNDS.to_string())
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev)
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE")
        .env_remove("SMCLO_CLC_WAIT_MS")
        // Every connection proposes (its handshakes are what is tested).
        .env("SMCLO_SHORT", "smc")
        .output()
        .expect("run pending_threads");
    let stats = Device::open(&dev).expect("open the test device").stats();
    let _ = std::fs::remove_dir_all(&dev);
    let _ = std::fs::remove_file(&exe);
    let report = format!(
        "stdout:\n{}\nstderr:\n{}\nstats: {stats:?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pending_threads failed\n{report}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("OK {}", 2 * ROUNDS)),
        "every connection carried its bytes\n{report}"
    );
    assert_eq!(stats.fallbacks_total(), 0, "no fallback\n{report}");
    assert_eq!(
        stats.conns_opened,
        u64::from(2 * ROUNDS),
        "every connection SMC-D\n{report}"
    );
    assert!(
        stats.xfer_bytes >= u64::from(4 * ROUNDS),
        "the bytes went through the rings\n{report}"
    );
}
