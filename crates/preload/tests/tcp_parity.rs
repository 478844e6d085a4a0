//! Corners of the socket API where a program can tell TCP's answers from
//! others (`tests/c/tcp_parity.c`): a zero-length `recv`, and the error a
//! reset leaves, which TCP reports once (to `SO_ERROR`, a `recv` or a
//! `send`, whichever asks first) and then clears, `TCP_INQ`'s control
//! message, `SPLICE_F_MORE`, which TCP takes as `MSG_MORE`, and
//! `SIOCOUTQ`, and a `close` beside a blocked `recv`. Each mode runs over
//! plain TCP first, which proves the expectation is TCP's, then under the
//! preload, where the device's counters prove the connection was SMC-D.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod common;
use common::{compile_with_late_atfork, run_plain, run_smc};

/// Linked with `late_atfork.c`, whose fork handlers run before the
/// preload's in a child (fork-late-children).
fn exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile_with_late_atfork("tcp_parity").0)
}

fn check(mode: &str, read: &str) {
    let plain = run_plain(exe(), &[mode]);
    assert!(plain.contains(&format!("OK {read}")), "plain TCP: {plain}");
    let out = run_smc(exe(), &[mode], None, None);
    assert!(out.contains(&format!("OK {read}")), "{out}");
}

/// smclo answered 0 at once where TCP says `EAGAIN` (nothing queued,
/// non-blocking) or waits for bytes (blocking).
#[test]
fn a_zero_length_recv_waits_or_fails_as_tcps() {
    check("zero-recv", "3");
}

/// `SO_ERROR` always read 0 on a connection.
#[test]
fn so_error_reports_a_reset_once() {
    check("reset-sockopt", "0");
}

/// Every `recv` after a reset failed with `ECONNRESET`; TCP's second reads 0.
#[test]
fn recv_reports_a_reset_once() {
    check("reset-recv", "0");
}

/// A `send` after a reset failed with `EPIPE`; TCP's first fails with
/// `ECONNRESET`.
#[test]
fn send_reports_a_reset_once() {
    check("reset-send", "0");
}

/// A reset after the peer's end of stream (its `SHUT_WR`, then a close
/// with bytes unread): reads see the end of stream, and the error is
/// `EPIPE` (TCP's CLOSE_WAIT); it was `ECONNRESET`, at every read.
#[test]
fn a_reset_after_the_end_of_stream_reads_as_the_end() {
    check("reset-fin", "0");
}

#[test]
fn the_bytes_before_a_reset_are_read_first() {
    check("reset-data", "3");
}

/// The reset that answers the first write to a closed peer leaves
/// `EPIPE` for `SO_ERROR`, as TCP's (the peer's end had ended first).
#[test]
fn so_error_reports_the_reset_after_a_write_to_a_closed_peer() {
    check("closed-write", "0");
}

/// A `close` beside a `recv` blocked in another thread ended the
/// connection (the `recv` failed `ECONNRESET`, the peer read a reset);
/// Linux keeps the socket until the `recv` returns.
#[test]
fn a_close_beside_a_blocked_recv_waits_for_it() {
    check("close-blocked", "5");
}

/// The same with a fork child, made while the `recv` blocks, that closes
/// its copy first and lives on: the connection ends when the `recv`
/// returns, not when the child exits (the child had inherited the count
/// of a call its parent's thread was making).
#[test]
fn a_fork_child_does_not_inherit_its_parents_blocked_calls() {
    check("fork-blocked", "5");
}

/// A fork child that closed its copy before `fork` returned in its parent
/// was listed again as a holder by the parent (which lists the child once
/// it knows its pid). Where `kcmp` is refused (Docker's default seccomp
/// profile), a listed live process counts as a holder: the peer read a
/// reset when the child exited, not the end of stream at the parent's
/// close. In both fork modes, the child's close left its number open
/// (the parent's blocked call's count of the connection, copied).
#[test]
fn a_fork_child_that_closed_first_is_not_listed_again() {
    check("fork-closed-first", "5");
}

/// Two fork children that start late, the first while its parent is
/// inside the second fork: the first took the second's placeholder in the
/// holders (the placeholders of one parent looked alike), so the second
/// child was never listed; the first child's close then ended the
/// connection while the second still held it, and the peer read the end
/// of stream instead of the second child's bytes.
#[test]
fn a_late_fork_child_does_not_take_the_next_forks_place() {
    check("fork-late-children", "4");
}

/// A signal handler's `close` of the descriptor its own thread's `recv`
/// waits on ends the connection at once, as Linux's; the `recv`,
/// restarted (`SA_RESTART`), fails `EBADF`. (The calls a thread has in
/// progress never hold up its own close.)
#[test]
fn a_close_in_a_handler_beside_its_own_threads_recv_ends_the_connection() {
    check("close-in-handler", "0");
}

/// A handler that leaves a blocked `recv` with `siglongjmp` does not keep
/// the connection from ending at the thread's later `close`.
#[test]
fn a_close_after_a_siglongjmp_out_of_recv_ends_the_connection() {
    check("close-after-longjmp", "0");
}

/// A process that exits while a thread of its blocks in `recv` closes
/// the connection as the kernel closes its socket: the peer reads the end
/// of stream, not a reset.
#[test]
fn an_exit_beside_a_blocked_recv_closes_the_connection() {
    check("exit-blocked", "0");
}

/// `SPLICE_F_MORE` held nothing back; TCP takes it as `MSG_MORE`.
#[test]
fn splice_f_more_holds_the_bytes_as_msg_more() {
    check("splice-more", "0");
}

/// `recvmsg` wrote no control message with `TCP_INQ` set (gRPC's reads
/// size themselves by it), on a socket that set it after the connection
/// or before its connect.
#[test]
fn tcp_inq_reports_the_bytes_left_in_recvmsg() {
    check("inq", "6");
}

/// `SIOCOUTQ` and `SIOCOUTQNSD` read 0 while corking held bytes.
#[test]
fn siocoutq_counts_the_bytes_corking_holds() {
    check("outq", "0");
}
