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
//! pool of threads blocked in `accept` keeps at most one CPU busy.
//! `SMCLO_SPIN_US=0` turns it off.
//!
//! A signal handler that runs during the spin ends it ([`Watch`]): the
//! caller then does what the kernel would have done had it been asleep
//! (restart the accept, or fail with `EINTR`, see [`Spun::Interrupted`]).

use crate::poller::Budget;
use crate::signal::Watch;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static BUDGET: Budget = Budget::new();
/// A thread of this process is spinning.
static SPINNER: AtomicBool = AtomicBool::new(false);

/// How a spin before `accept` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spun {
    /// A connection is pending: the `accept` takes it at once (unless
    /// another thread or process is quicker, and it then sleeps as usual).
    Pending,
    /// None came within the budget; the `accept` that follows sleeps,
    /// from this moment.
    Missed(Instant),
    /// A signal handler ran in this thread: had the `accept` been asleep,
    /// the signal would have interrupted it.
    Interrupted,
    /// No spin: the budget is zero, or another thread spins.
    Skipped,
}

/// Spins until the listening socket `fd` has a connection, the budget
/// runs out or a handler `signals` watches runs. For a blocking `accept`
/// only: a non-blocking one never waits.
pub fn before_accept(fd: RawFd, signals: &Watch) -> Spun {
    let time = BUDGET.next();
    if time.is_zero() || SPINNER.swap(true, Ordering::Acquire) {
        return Spun::Skipped;
    }
    let r = BUDGET.spin(time, signals, || Ok::<_, ()>(pending(fd).then_some(())));
    SPINNER.store(false, Ordering::Release);
    match r {
        Ok(Some(())) => Spun::Pending,
        _ if signals.interrupted() => Spun::Interrupted,
        _ => Spun::Missed(Instant::now()),
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
    crate::chan_sys::poll(&mut p, 0) != 0
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    // One test: the budget and the spinner flag are the process's.
    #[test]
    fn finds_a_pending_connection_and_misses_none() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = Watch::begin(None);
        if crate::conn::spin_budget().is_zero() {
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
    }
}
