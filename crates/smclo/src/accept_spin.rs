//! A blocking `accept`'s spin: a server that waits for its next client
//! looks at its listening socket for an adaptive budget before it sleeps.
//!
//! A server blocked in `accept` is woken by the client's `connect` (the
//! handshake's last ACK), a wake-up on another CPU; in a virtual machine
//! the halted vCPU must be run again first. That wake-up was the largest
//! single wait of a connection's setup: the client's request, which its
//! `connect` lets it send at once (early bytes, `crate::handshake::early`),
//! and its wait for the answer all came after it. So, as a blocking read
//! spins on its ring (`crate::conn`) and an event loop's wait on its set
//! (`crate::poller`), a blocking `accept` first polls the socket
//! (`poll` with no timeout, which takes no lock the client's SYN needs) for
//! the [`Budget`] of the process's accepts: full while connections keep
//! coming within it, halved after each spin that found none (down to 1/64
//! of `SMCLO_SPIN_US`), so an idle server soon sleeps at once, as over
//! TCP. One thread of a process spins at a time; the others sleep, so a
//! pool of threads blocked in `accept` keeps at most one CPU busy (a spin
//! that never ended, left by a handler that jumped out of it, is taken
//! over after [`STALE`]).
//! `SMCLO_SPIN_US=0` turns it off.
//!
//! A signal handler that runs during the spin ends it ([`Watch`]): the
//! caller then does what the kernel would have done had it been asleep
//! (restart the accept, or fail with `EINTR`, see [`Spun::Interrupted`]).

use crate::signal::Watch;
use crate::wait::Budget;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

static BUDGET: Budget = Budget::new();
/// When the thread of this process that spins began (microseconds of
/// [`crate::clock`]), 0 when none does. A spin that never ended (a
/// handler that `siglongjmp`ed out of it, a thread that did not follow a
/// `fork`) is taken over once it is older than [`STALE`].
static SPINNING_SINCE: AtomicU64 = AtomicU64::new(0);

/// Whether the client of the process's last accepted connection proposed
/// (or none was accepted yet). A server whose clients do not (plain ones,
/// or clients that learnt their connections short) sleeps in `accept` as
/// over TCP: the spin shortens a handshake, and a plain connection has
/// none, so it would only take a CPU its clients may need.
static PEER_PROPOSED: AtomicBool = AtomicBool::new(true);

/// A spin is over after one budget; older marks are left over.
const STALE: Duration = Duration::from_millis(100);

/// Microseconds of [`crate::clock`], never 0 or 1 (the marks of "none"
/// and "long ago").
fn now_mark() -> u64 {
    crate::clock::now_ns() / 1000 + 2
}

/// Becomes the process's spinning thread, unless a live one is.
fn claim_spinner() -> bool {
    let now = now_mark();
    let cur = SPINNING_SINCE.load(Ordering::Acquire);
    let free = cur == 0 || now.saturating_sub(cur) > STALE.as_micros() as u64;
    free && SPINNING_SINCE
        .compare_exchange(cur, now, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// How a spin before `accept` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spun {
    /// A connection is pending: the `accept` takes it at once (unless
    /// another thread or process is quicker, and it then sleeps as usual).
    Pending,
    /// None came within the budget; the `accept` that follows sleeps,
    /// from this moment.
    Missed(u64),
    /// A signal handler ran in this thread: had the `accept` been asleep,
    /// the signal would have interrupted it.
    Interrupted,
    /// No spin: the budget is zero, or another thread spins.
    Skipped,
}

/// Whether [`before_accept`] may spin: not after a client that did not
/// propose ([`peer_proposed`]).
pub fn may_spin() -> bool {
    PEER_PROPOSED.load(Ordering::Relaxed)
}

/// Spins until the listening socket `fd` has a connection, the budget
/// runs out or a handler `signals` watches runs. For a blocking `accept`
/// only: a non-blocking one never waits.
pub fn before_accept(fd: RawFd, signals: &Watch) -> Spun {
    if !may_spin() {
        return Spun::Skipped;
    }
    let time = BUDGET.next().min(STALE);
    if time.is_zero() || !claim_spinner() {
        return Spun::Skipped;
    }
    let r = BUDGET.spin(time, signals, || Ok::<_, ()>(pending(fd).then_some(())));
    SPINNING_SINCE.store(0, Ordering::Release);
    match r {
        Ok(Some(())) => Spun::Pending,
        _ if signals.interrupted() => Spun::Interrupted,
        _ => Spun::Missed(crate::clock::now_ns()),
    }
}

/// Whether the listening socket `fd` has a connection (or an error) to
/// report: a `poll` with no timeout, the system call itself (no
/// interposed `poll` in between).
fn pending(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    reports(crate::chan_sys::poll(&mut p, 0))
}

/// Whether a `poll` that returned `rc` reported the socket. A failed one
/// did not: it fails with `EINTR` when a handler's signal arrives during
/// the call (the kernel looks for pending signals even with no timeout),
/// and the spin must then end as interrupted, not take it for a
/// connection and sleep in `accept` past the handler.
fn reports(rc: libc::c_int) -> bool {
    rc > 0
}

/// After the `accept` that followed [`before_accept`] returned a
/// connection: one that came within a budget of the sleep makes the next
/// spin full again (a server whose clients come just too late for a
/// halved budget would otherwise never spin again).
pub fn accepted(spun: Spun) {
    if let Spun::Missed(at) = spun {
        BUDGET.woken(true, at);
    }
}

/// Whether the client of the connection just accepted proposed: the next
/// blocking `accept` spins only if it did.
pub fn peer_proposed(proposed: bool) {
    PEER_PROPOSED.store(proposed, Ordering::Relaxed);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn a_failed_poll_reports_no_connection() {
        assert!(!reports(-1), "EINTR taken for a connection");
        assert!(!reports(0));
        assert!(reports(1));
    }

    // One test: the budget and the spinner mark are the process's.
    #[test]
    fn finds_a_pending_connection_and_misses_none() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = Watch::begin(None);
        if crate::wait::spin_budget().is_zero() {
            assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Skipped);
            return;
        }
        assert!(matches!(before_accept(l.as_raw_fd(), &w), Spun::Missed(_)));
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        // Halved by the miss, but not to zero: a pending connection is
        // found at the first look.
        assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Pending);
        crate::signal::handler_ran(libc::SIGUSR1);
        l.accept().unwrap();
        assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Interrupted);
        drop(w);
        // A spinner that never came back (a handler that jumped out of
        // its spin) is taken over once its mark is stale.
        SPINNING_SINCE.store(1, Ordering::Release);
        std::thread::sleep(STALE + Duration::from_millis(10));
        let w = Watch::begin(None);
        assert_ne!(before_accept(l.as_raw_fd(), &w), Spun::Skipped);
        // A live one is not.
        SPINNING_SINCE.store(now_mark(), Ordering::Release);
        assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Skipped);
        SPINNING_SINCE.store(0, Ordering::Release);
        // After a client that did not propose, no spin; after one that
        // did, the spin again (a pending connection is found).
        let _c2 = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        peer_proposed(false);
        assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Skipped);
        peer_proposed(true);
        assert_eq!(before_accept(l.as_raw_fd(), &w), Spun::Pending);
    }
}
