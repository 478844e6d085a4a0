//! `smclo run` hands the program SIGPIPE's disposition as smclo got it.
//! The Rust runtime ignores SIGPIPE before `main`, and an ignored signal
//! stays ignored across `exec`: every program under `smclo run` (and every
//! process it started) ignored SIGPIPE, so a write to a closed pipe or
//! connection returned `EPIPE` where the program would have died.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Whether SIGPIPE is ignored in a program run by `smclo run`, started
/// with SIGPIPE ignored (`ignored`) or default.
fn ignored_in_program(ignored: bool) -> bool {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smclo"));
    c.args(["run", "--", "grep", "SigIgn", "/proc/self/status"]);
    c.env("SMCLO_DISABLE", "1");
    let h = if ignored {
        libc::SIG_IGN
    } else {
        libc::SIG_DFL
    };
    // SAFETY: sets one signal's disposition in the child before exec
    // (async-signal-safe).
    unsafe {
        c.pre_exec(move || {
            libc::signal(libc::SIGPIPE, h);
            Ok(())
        })
    };
    let o = c.output().expect("run smclo");
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    let mask = out
        .split_whitespace()
        .nth(1)
        .and_then(|m| u64::from_str_radix(m, 16).ok())
        .unwrap_or_else(|| panic!("no SigIgn line: {out}"));
    mask & (1 << (libc::SIGPIPE - 1)) != 0
}

#[test]
fn a_program_gets_sigpipe_default_when_smclo_had_it() {
    assert!(
        !ignored_in_program(false),
        "SIGPIPE is ignored in the program"
    );
}

#[test]
fn a_program_gets_sigpipe_ignored_when_smclo_had_it_ignored() {
    assert!(
        ignored_in_program(true),
        "SIGPIPE is not ignored in the program"
    );
}
