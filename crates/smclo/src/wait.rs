//! What every wait of smclo's is made of: readiness bits ([`Ready`]), the
//! spin budget (`SMCLO_SPIN_US`, [`spin_budget`]) and its adaptive share
//! per waiter ([`Budget`]), and how often a busy wait asks the kernel
//! about its other descriptors ([`KERNEL_EVERY`]). The connections, the
//! event loops, the handshake and the accept spin take them from here;
//! the spin itself is [`crate::spin`]'s.

use crate::signal::Watch;
use std::ops::BitOr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `SMCLO_SPIN_US` ([`crate::config::Config::spin`]), read once: the
/// longest a blocking call busy-polls the ring before sleeping in
/// `poll(2)`. 0 disables spinning. A malformed value is reported by
/// [`crate::config::Config::from_env`]; here it means the default.
pub fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| crate::config::spin_from_env().unwrap_or(crate::config::DEFAULT_SPIN))
}

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

    /// Readiness of these bits (`poll(2)`'s values; a `pollfd`'s
    /// `revents` as `u16`).
    pub const fn from_bits(bits: u32) -> Ready {
        Ready(bits)
    }

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
        spin_budget() / (1 << self.misses.load(Ordering::Relaxed).min(MAX_HALVINGS))
    }

    /// How long a spin may last now: the budget, within `deadline`
    /// (zero: do not spin).
    pub fn spin_time(&self, deadline: Option<Instant>) -> Duration {
        let b = self.next();
        deadline.map_or(b, |d| b.min(d.saturating_duration_since(Instant::now())))
    }

    /// Spins for `time` ([`Budget::spin_time`], [`crate::spin::run`]),
    /// calling `look` until it finds something (`Some`), fails, or
    /// `signals` sees a handler run, and records whether it found
    /// something: the spin of the waits that keep a budget (the preload's
    /// epoll, the event loops' `poller::poll`, a blocking `accept`).
    pub fn spin<T, E>(
        &self,
        time: Duration,
        signals: &Watch,
        look: impl FnMut() -> Result<Option<T>, E>,
    ) -> Result<Option<T>, E> {
        let r = crate::spin::run(time, Some(signals), look);
        self.note(matches!(r, Ok(Some(_))));
        r
    }

    /// After a spin that found nothing and a sleep begun at `slept`:
    /// when what it waited for (`arrived`) came within a full budget of
    /// the sleep, a full spin would have caught it, so the next spin is
    /// full again. Without this, two peers that both once missed (one was
    /// descheduled) would answer each other only after a wake-up, longer
    /// than their halved budgets, and stay asleep for good. Not while this
    /// thread's spins are preempted ([`crate::spin::contended`]): where
    /// runnable threads outnumber CPUs, what comes soon came because
    /// others ran, and a full spin would have kept them from running.
    /// `slept`: when the sleep began ([`crate::clock::now_ns`]).
    pub fn woken(&self, arrived: bool, slept: u64) {
        if arrived
            && crate::clock::since_ns(slept) < crate::clock::ns(spin_budget())
            && !crate::spin::contended()
        {
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

/// How often a wait whose rings keep it busy asks the kernel about its
/// other descriptors (and, with a signal mask, lets a signal in): under
/// load a request costs no system call, and no other descriptor waits
/// longer than this.
pub const KERNEL_EVERY: Duration = Duration::from_micros(200);
