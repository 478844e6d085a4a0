//! Non-blocking reads on an empty ring return `EAGAIN` without a system
//! call while the descriptor's open file is the process's alone, and keep
//! the kernel's semantics where it is not: `tests/c/nbread.c` runs an
//! edge-triggered epoll echo server that reads until `EAGAIN` (system calls
//! counted by `perf stat`), in a prefork worker too, a fork child and an `SCM_RIGHTS` receiver that
//! change `O_NONBLOCK` of the shared open file, and a peer killed with
//! SIGKILL during an edge-triggered wait and during a busy read loop. The
//! device's counters prove the connection was SMC-D.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod common;
use common::{compile, run_smc};

fn nbread() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("nbread", &[]))
}

/// What [`run`] counts under `perf`: every system call, `fcntl`, the
/// kernel's `select` (either call), and last `recvfrom` with `MSG_PEEK |
/// MSG_DONTWAIT` (the look for a dead peer's end of file; taking a
/// doorbell does not peek).
const EVENTS: [&str; 12] = [
    "-e",
    "raw_syscalls:sys_enter",
    "-e",
    "syscalls:sys_enter_fcntl",
    "-e",
    "syscalls:sys_enter_select",
    "-e",
    "syscalls:sys_enter_pselect6",
    "-e",
    "syscalls:sys_enter_recvfrom",
    "--filter",
    "flags == 0x42",
];
/// How many counts [`EVENTS`] gives.
const COUNTS: usize = 5;

/// Runs `nbread args` under the preload on a device of its own.
fn run(args: &[&str]) -> String {
    run_smc(nbread(), args, None, None)
}

/// [`EVENTS`] per request of `nbread mode N` ([`per_request`]), and the
/// line that tells them.
fn per_request(mode: &str) -> (Vec<f64>, String) {
    let r = common::per_request(nbread(), mode, &EVENTS);
    assert_eq!(r.per.len(), COUNTS, "counts of {EVENTS:?}: {:?}", r.many);
    let per = r.per;
    let msg = format!(
        "per request: {:.3} system calls, {:.3} fcntl, {:.3} select, {:.3} recvfrom(MSG_PEEK) ({:?} for 2000, {:?} for 20000)",
        per[0], per[1], per[2] + per[3], per[4], r.few, r.many
    );
    (per, msg)
}

/// An edge-triggered epoll echo server that reads until `EAGAIN`, and a
/// client under the preload too that sends 64-byte requests and reads each
/// answer ([`per_request`]). The read that found the ring empty made an
/// `fcntl(F_GETFL)` (is the descriptor still non-blocking?) and a
/// `recvfrom(MSG_PEEK)` (has a dead peer's channel reached end of file?)
/// per request: about 1 of each.
#[test]
fn read_until_eagain_makes_no_system_call() {
    let (per, msg) = per_request("echo");
    eprintln!("{msg}");
    // Both were about 1 per request. The total depends on how often the
    // waits had to sleep (a loaded machine deschedules the spinners), so
    // it is only shown.
    assert!(per[1] < 0.05, "fcntl per request: {msg}");
    assert!(per[4] < 0.05, "peeks per request: {msg}");
}

/// The echo server in a prefork server's worker: a fork child whose
/// parent closes its copy of the connection at once (postgres's backends,
/// Apache's prefork workers). Its reads that found the ring empty asked
/// `fcntl(F_GETFL)` every time, since the fork had shared the open file:
/// about 1 per request. The fork family's holders (the close rule) show
/// when the child holds the connection alone.
#[test]
fn a_prefork_workers_reads_make_no_fcntl() {
    let (per, msg) = per_request("prefork");
    eprintln!("{msg}");
    assert!(per[1] < 0.05, "fcntl per request: {msg}");
}

/// A fork child that shares the open file turns it blocking, then
/// non-blocking: the parent's reads block, then fail with `EAGAIN`, as
/// over TCP, though the parent's own copy of the flag never changed.
#[test]
fn fork_child_changes_the_shared_flag() {
    run(&["fork"]);
}

/// The same by a process that got the descriptor with `SCM_RIGHTS`.
#[test]
fn scm_rights_receiver_changes_the_shared_flag() {
    run(&["scm"]);
}

/// The peer dies (SIGKILL, no closing flag) while the server waits in an
/// edge-triggered `epoll_wait` with the ring empty: the wait reports it and
/// the read gets `ECONNRESET` within 3 s (measured: milliseconds).
#[test]
fn peer_killed_during_edge_triggered_wait() {
    let out = run(&["kill-et"]);
    eprintln!("{out}");
}

/// The same while the server busy-loops on non-blocking reads.
#[test]
fn peer_killed_during_busy_read_loop() {
    let out = run(&["kill-busy"]);
    eprintln!("{out}");
}

/// The same while the server waits in `poll` (the core's wait, which
/// tells the connection what the kernel reported).
#[test]
fn peer_killed_during_poll() {
    let out = run(&["kill-poll"]);
    eprintln!("{out}");
}

/// `select` with a set larger than `FD_SETSIZE` (2048 bits, the connection
/// at descriptor 1500) is served as a smaller one: the rings answer for
/// the connection. It went to the real `select`, where only the channel
/// answered: a system call per wait, and a doorbell per message.
#[test]
fn select_above_fd_setsize_is_served() {
    let (per, msg) = per_request("select-high");
    eprintln!("{msg}");
    // About 1 per request before (and the rest as for a smaller set).
    assert!(per[2] + per[3] < 0.05, "kernel selects per request: {msg}");
    run(&["shutrd-high"]);
}

/// `EAGAIN` itself: non-blocking reads on an empty ring in a busy loop,
/// and non-blocking writes into a full ring (the first one arms the
/// doorbells; the rest find them armed). Each made an `fcntl(F_GETFL)`,
/// and each read a `recvfrom(MSG_PEEK)` too; the reads now look for end
/// of file every 200 us only ([`peer_killed_during_busy_read_loop`]).
#[test]
fn eagain_in_a_busy_loop_makes_no_system_call() {
    for mode in ["eagain-read", "eagain-write"] {
        let (per, msg) = per_request(mode);
        eprintln!("{mode}: {msg}");
        assert!(per[0] < 0.05, "{mode}: system calls per call: {msg}");
    }
}

/// `fcntl(F_SETFL)` and `ioctl(FIONBIO)` on an SMC-D descriptor cost one
/// system call each, as on a TCP socket: the flag is set on the channel's
/// open file and the connection's copy follows. Each asked the descriptor
/// again (`F_GETFL`), and `FIONBIO` set it with `F_GETFL` and `F_SETFL`:
/// 4 per pair, now 2. The reads after them block or not as the flag says.
#[test]
fn setting_o_nonblock_costs_one_system_call() {
    let (per, msg) = per_request("toggle");
    eprintln!("{msg}");
    assert!(per[0] < 2.2, "system calls per fcntl + ioctl pair: {msg}");
}
