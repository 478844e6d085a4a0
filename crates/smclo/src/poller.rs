//! Event loops over SMC-D connections: readiness from the rings and a
//! spin that lets the peers' writers skip their doorbells.
//!
//! A wait over a set of connections (the preload's `epoll_wait`, `poll`
//! and `select`) first looks at each ring ([`Conn::ready`]). When nothing
//! is ready it polls the rings for an adaptive budget ([`Budget`]) inside
//! a session ([`Conn::poll_begin`] .. [`Conn::poll_end`]) during which the
//! peers' writes skip the doorbell (`POLLED`, see
//! [`crate::doorbell`] "Pollers"); it then ends the session, looks at
//! every ring once more, and only then sleeps in the kernel, where each
//! ring's doorbell wakes it. In steady state a request and its response
//! make no system call on either side.
//!
//! [`Conn::ready`]: crate::conn::Conn::ready
//! [`Conn::poll_begin`]: crate::conn::Conn::poll_begin
//! [`Conn::poll_end`]: crate::conn::Conn::poll_end

use std::ops::BitOr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Readiness bits, with the values of `poll(2)`'s (which `epoll` shares).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ready(u32);

impl Ready {
    /// Nothing.
    pub const EMPTY: Ready = Ready(0);
    /// Readable (`POLLIN`).
    pub const IN: Ready = Ready(libc::POLLIN as u32);
    /// Writable (`POLLOUT`).
    pub const OUT: Ready = Ready(libc::POLLOUT as u32);
    /// Error (`POLLERR`).
    pub const ERR: Ready = Ready(libc::POLLERR as u32);
    /// Hung up (`POLLHUP`).
    pub const HUP: Ready = Ready(libc::POLLHUP as u32);
    /// The peer shut down its writing side (`POLLRDHUP`).
    pub const RDHUP: Ready = Ready(libc::POLLRDHUP as u32);

    /// The bits, as `poll(2)` and `epoll` spell them.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether any of `other`'s bits are set.
    pub const fn intersects(self, other: Ready) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl BitOr for Ready {
    type Output = Ready;
    fn bitor(self, o: Ready) -> Ready {
        Ready(self.0 | o.0)
    }
}

/// The longest a waiter spins before it halves its budget again: a spin
/// that found nothing halves the next one (down to 1/64 of
/// `SMCLO_SPIN_US`), one that found something restores it. Traffic that
/// keeps arriving within the budget is caught without a system call; an
/// idle loop soon spins for microseconds only, and sleeps.
#[derive(Debug, Default)]
pub struct Budget {
    misses: AtomicU32,
}

/// Halvings of the spin budget after consecutive misses, at most.
const MAX_HALVINGS: u32 = 6;

impl Budget {
    /// A fresh budget (the full `SMCLO_SPIN_US`).
    pub const fn new() -> Budget {
        Budget {
            misses: AtomicU32::new(0),
        }
    }

    /// How long the next spin may last (zero: do not spin).
    pub fn next(&self) -> Duration {
        crate::conn::spin_budget() / (1 << self.misses.load(Ordering::Relaxed).min(MAX_HALVINGS))
    }

    /// After a spin that found nothing and a sleep begun at `slept`:
    /// when what it waited for (`arrived`) came within a full budget of
    /// the sleep, a full spin would have caught it, so the next spin is
    /// full again. Without this, two peers that both once missed (one was
    /// descheduled) would answer each other only after a wake-up, longer
    /// than their halved budgets, and stay asleep for good.
    pub fn woken(&self, arrived: bool, slept: std::time::Instant) {
        if arrived && slept.elapsed() < crate::conn::spin_budget() {
            self.note(true);
        }
    }

    /// Records whether the spin found what it waited for.
    pub fn note(&self, hit: bool) {
        if hit {
            self.misses.store(0, Ordering::Relaxed);
        } else {
            let m = self.misses.load(Ordering::Relaxed);
            self.misses.store(m.saturating_add(1), Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Budget;
    use std::time::{Duration, Instant};

    #[test]
    fn misses_halve_the_budget_and_a_hit_restores_it() {
        let b = Budget::new();
        let full = b.next();
        b.note(false);
        assert_eq!(b.next(), full / 2);
        for _ in 0..20 {
            b.note(false);
        }
        assert_eq!(b.next(), full / 64);
        b.note(true);
        assert_eq!(b.next(), full);
    }

    /// A sleep that a full spin would have spared (the event came within
    /// the budget) restores it; a long sleep, or a wake-up without the
    /// event, leaves it halved. Before, a halved budget came back only
    /// from a spin that hit, so two peers that had both slept once kept
    /// answering each other after wake-ups and never spun again.
    #[test]
    fn an_event_soon_after_the_sleep_restores_the_budget() {
        let b = Budget::new();
        let full = b.next();
        for _ in 0..6 {
            b.note(false);
        }
        let low = b.next();
        assert!(low < full);
        b.woken(false, Instant::now());
        assert_eq!(b.next(), low, "woken without the event");
        b.woken(true, Instant::now() - full - Duration::from_micros(1));
        assert_eq!(b.next(), low, "the event came after a full budget");
        b.woken(true, Instant::now());
        assert_eq!(b.next(), full, "the event came within a full budget");
    }
}
