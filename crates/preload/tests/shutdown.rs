//! `shutdown(2)` on a connection as TCP's (`tests/c/shutdown.c`):
//! `SHUT_RDWR` wakes the `recv`, `poll`, `epoll_wait` (level- and
//! edge-triggered) and `send` that other threads are blocked in (they
//! waited for the peer's close), reading after `SHUT_RD` returns what is
//! queued, then end of stream (it returned 0 at once), the peer writing
//! after it is read, and
//! a connection shut both ways reports `POLLHUP`, and the first write to a
//! peer that closed succeeds, the next one failing. The peer stays connected
//! and idle meanwhile; the device's counters prove the connection was
//! SMC-D.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod common;
use common::{compile, run_smc};

fn exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("shutdown", &["-pthread"]))
}

fn check(mode: &str, read: &str) {
    let out = run_smc(exe(), &[mode], None, None);
    assert!(out.contains(&format!("OK {read}")), "{out}");
}

#[test]
fn shutdown_wakes_a_blocked_recv() {
    check("recv-rdwr", "0");
}

#[test]
fn shutdown_wakes_a_blocked_poll() {
    check("poll-rdwr", "0");
}

#[test]
fn shutdown_wakes_a_blocked_epoll_wait() {
    check("epoll-rdwr", "0");
}

#[test]
fn shutdown_wakes_a_blocked_send() {
    check("send-rdwr", "0");
}

/// An edge-triggered wait whose last edge was taken: the shutdown is the
/// next edge.
#[test]
fn shutdown_wakes_an_edge_triggered_epoll_wait() {
    check("epoll-et-rdwr", "0");
}

/// The channel's own SHUT_RD made the peer's doorbells fail, which both
/// ends read as the other's death: the peer's answer was lost.
#[test]
fn after_shutdown_of_reading_the_peer_goes_on_writing_and_reading() {
    check("rd-peer-writes", "4");
}

#[test]
fn reading_after_shutdown_of_reading_returns_the_queued_bytes() {
    check("queued-rd", "6");
}

#[test]
fn a_connection_shut_both_ways_hangs_up() {
    check("hup", "0");
}

/// TCP's first write to a peer that closed goes out (the peer answers it
/// with a reset); smclo failed it with `EPIPE`, which turned a keep-alive
/// client's `RemoteDisconnected` (python's http.client, after a server's
/// idle timeout) into a `BrokenPipeError` at its request.
#[test]
fn the_first_write_after_the_peers_close_succeeds_as_tcps() {
    check("closed-write", "0");
}
