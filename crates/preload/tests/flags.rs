//! send and recv flags on a connection as TCP answers them: those it
//! ignores (`MSG_CONFIRM`, `MSG_DONTROUTE`, `MSG_BATCH`, `MSG_PROBE`,
//! `MSG_ZEROCOPY` without `SO_ZEROCOPY`) are ignored, `MSG_FASTOPEN` on a
//! connected socket is `EISCONN`, `MSG_OOB` and `MSG_ERRQUEUE` reads get
//! TCP's `EINVAL` and `EAGAIN`, and `MSG_TRUNC` drops (or counts) bytes
//! without a buffer (`tests/c/flags.c`). smclo refused them all with
//! `EOPNOTSUPP`. The device's counters prove the connection was SMC-D.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod common;
use common::{compile, run_smc};

fn exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("flags", &[]))
}

#[test]
fn send_flags_tcp_ignores_are_ignored() {
    let out = run_smc(exe(), &["send"], None, None);
    assert!(out.contains("OK 24"), "{out}");
}

#[test]
fn recv_flags_get_tcps_answers() {
    let out = run_smc(exe(), &["recv"], None, None);
    assert!(out.contains("OK 16"), "{out}");
}
