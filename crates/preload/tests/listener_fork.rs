//! A listener whose registration's process lets go of it while a fork
//! child still listens on it (the parent closes its copy, or exits
//! without closing it, as a program that daemonizes after it listens
//! does) serves SMC-D again from the
//! child's first accept of a client that did not propose:
//! `tests/c/listener_fork.c`. The device's counters prove which
//! connection was SMC-D.

mod common;
use common::{compile, run_counted};
use smclo_wire::reason::Reason;

/// The two connections of `mode`: the first finds no live registration
/// and stays TCP on both sides; the child, accepting it, registers the
/// listener again, so the second is SMC-D.
fn second_connection_is_smc_d(mode: &str) {
    let exe = compile("listener_fork", &[]);
    let (stdout, stats, report) = run_counted(&exe, &[mode], None, None);
    let _ = std::fs::remove_file(&exe);
    assert!(stdout.contains("OK 200"), "{report}");
    assert_eq!(stats.fallback(Reason::PeerNoSmc), (1, 1), "{report}");
    assert_eq!(stats.fallbacks_total(), 2, "{report}");
    assert_eq!(stats.conns_opened, 1, "{report}");
    assert!(stats.xfer_bytes >= 100, "{report}");
}

#[test]
fn a_listener_the_parent_closed_serves_its_fork_child_over_smc_d() {
    second_connection_is_smc_d("close");
}

#[test]
fn a_listener_whose_registering_process_exited_serves_its_fork_child_over_smc_d() {
    second_connection_is_smc_d("exit");
}
