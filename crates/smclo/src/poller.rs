//! Event loops over SMC-D connections: readiness from the rings and a
//! spin that lets the peers' writers skip their doorbells.
//!
//! A wait over a set of connections first looks at each ring
//! ([`Conn::ready`]). When nothing is ready it polls the rings for an
//! adaptive budget ([`Budget`]) inside a session ([`Conn::poll_begin`] ..
//! [`Conn::poll_end`]) during which the peers' writes skip the doorbell
//! (`POLLED`, see [`crate::doorbell`] "Pollers"); it then ends the
//! session, looks at every ring once more, and only then sleeps in the
//! kernel, where each ring's doorbell wakes it. In steady state a request
//! and its response make no system call on either side.
//!
//! [`poll`] is that wait over a `pollfd` array, with a session per call:
//! the preload's `poll`, `ppoll`, `select` and `pselect` and the native
//! API's [`crate::api::Poller`] use it. The preload's epoll keeps a
//! session open across the waits of a set, which outlives them.

use crate::conn::Conn;
use crate::signal::Watch;
pub use crate::wait::{Budget, Ready, KERNEL_EVERY};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a waiter carries from one wait to the next: its spin [`Budget`]
/// and when it last asked the kernel ([`KERNEL_EVERY`]). One per thread
/// of the preload's `poll` and `select`, one per [`crate::api::Poller`].
#[derive(Debug, Default)]
pub struct Pace {
    budget: Budget,
    kernel_at: AtomicU64,
}

impl Pace {
    /// A fresh pace: the full budget, the kernel not asked yet.
    pub const fn new() -> Pace {
        Pace {
            budget: Budget::new(),
            kernel_at: AtomicU64::new(0),
        }
    }

    /// The spin budget of the waits.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Whether [`KERNEL_EVERY`] passed since the kernel was last asked.
    pub fn kernel_due(&self) -> bool {
        crate::clock::since_ns(self.kernel_at.load(Ordering::Relaxed))
            >= crate::clock::ns(KERNEL_EVERY)
    }

    /// The kernel is being asked now.
    pub fn kernel_asked(&self) {
        self.kernel_at
            .store(crate::clock::now_ns(), Ordering::Relaxed);
    }
}

/// An SMC-D connection among the descriptors of a [`poll`]: its ring
/// answers for `fds[index]`.
pub struct Member<'a> {
    /// Its entry in the `pollfd` array.
    pub index: usize,
    /// The connection.
    pub conn: &'a Conn,
    /// Reported besides the ring's readiness (the preload's
    /// `shutdown(SHUT_RD)`: readable, end of stream).
    pub also: Ready,
}

/// The real wait: `ppoll(2)` over the given descriptors with a timeout
/// (`None`: for ever; the signal mask, if any, is the closure's), giving
/// the number of ready entries.
pub trait Kernel: FnMut(&mut [libc::pollfd], Option<Duration>) -> io::Result<usize> {}
impl<F: FnMut(&mut [libc::pollfd], Option<Duration>) -> io::Result<usize>> Kernel for F {}

/// `ppoll(2)` over `fds`, of which `members` are SMC-D connections: their
/// rings answer for them, the kernel for the others.
///
/// The rings are looked at first; with nothing ready the wait spins for
/// the pace's budget in a poll session (the members' writers skip their
/// doorbells, [`Conn::poll_begin`]), looking at the rings and, every
/// [`KERNEL_EVERY`], at the other descriptors; then it ends the session,
/// makes every member's writer ring ([`Conn::poll_cancel`]), looks once
/// more and only then sleeps in `kernel` with every descriptor, where a
/// doorbell wakes it. `mask`: the signal mask the kernel calls carry, so
/// the kernel is asked every [`KERNEL_EVERY`] even with no other
/// descriptor, to let a signal in. A signal handler that runs in this
/// thread during the wait (and that `mask` would not block) ends the spin,
/// and the wait fails with `EINTR` instead of sleeping ([`crate::signal`]).
/// Returns the number of entries with `revents`, as `poll` does.
///
/// [`Conn::poll_begin`]: crate::conn::Conn::poll_begin
/// [`Conn::poll_cancel`]: crate::conn::Conn::poll_cancel
pub fn poll(
    pace: &Pace,
    fds: &mut [libc::pollfd],
    members: &[Member<'_>],
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    kernel: impl Kernel,
) -> io::Result<usize> {
    let signals = Watch::begin(mask);
    let others = mask.is_some()
        || fds
            .iter()
            .enumerate()
            .any(|(i, p)| p.fd >= 0 && !members.iter().any(|m| m.index == i));
    let mut w = Wait {
        pace,
        fds,
        members,
        ring: smallvec::smallvec![0; members.len()],
        others,
        kernel,
    };
    w.run(timeout, &signals)
}

/// A wait's per-member lists, on the stack for the few descriptors a
/// poll usually has: the wait allocates nothing (it runs per request).
pub type Few<T> = smallvec::SmallVec<[T; 16]>;

/// One [`poll`] in progress.
struct Wait<'a, 'm, K> {
    pace: &'a Pace,
    fds: &'a mut [libc::pollfd],
    members: &'a [Member<'m>],
    /// What the last look at the rings saw, by member.
    ring: Few<i16>,
    /// The kernel has something to say besides the doorbells.
    others: bool,
    kernel: K,
}

impl<K: Kernel> Wait<'_, '_, K> {
    /// The wait; `signals`: the handlers run since it began.
    fn run(&mut self, timeout: Option<Duration>, signals: &Watch) -> io::Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        if self.look() {
            let due = self.pace.kernel_due();
            return self.report(due);
        }
        if let Some(n) = self.spin(deadline, signals)? {
            return Ok(n);
        }
        for m in self.members {
            // An error aborted the connection; its readiness says so.
            let _ = m.conn.poll_cancel();
        }
        if self.look() {
            return self.report(true);
        }
        signals.check()?;
        let slept = crate::clock::now_ns();
        self.pace.kernel_asked();
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let n = (self.kernel)(self.fds, left)?;
        self.pace.budget.woken(n > 0, slept);
        for m in self.members {
            let kr = Ready::from_bits(self.fds[m.index].revents as u16 as u32);
            if !kr.is_empty() {
                m.conn.kernel_ready(kr);
            }
        }
        Ok(n)
    }

    /// Looks at the members' rings; whether any is ready.
    fn look(&mut self) -> bool {
        let mut any = false;
        for (m, r) in self.members.iter().zip(self.ring.iter_mut()) {
            let asked = self.fds[m.index].events | libc::POLLHUP | libc::POLLERR;
            let want = Ready::from_bits(asked as u16 as u32);
            *r = (m.conn.ready_for(want) | m.also).bits() as i16 & asked;
            any |= *r != 0;
        }
        any
    }

    /// Reports what the last look saw, with (`kernel`) the kernel's answer
    /// for the other descriptors, asked without waiting; the count.
    fn report(&mut self, kernel: bool) -> io::Result<usize> {
        if kernel && self.others {
            self.now()?;
        } else {
            self.fds.iter_mut().for_each(|p| p.revents = 0);
        }
        for (m, r) in self.members.iter().zip(&self.ring) {
            self.fds[m.index].revents |= *r;
        }
        Ok(self.fds.iter().filter(|p| p.revents != 0).count())
    }

    /// Asks the kernel about the other descriptors without waiting: the
    /// members' descriptors are left out (negative), since their doorbells
    /// lag behind their rings.
    fn now(&mut self) -> io::Result<usize> {
        self.pace.kernel_asked();
        let mut saved: Few<(usize, i32)> = Few::new();
        for m in self.members {
            let p = &mut self.fds[m.index];
            if p.fd >= 0 {
                saved.push((m.index, p.fd));
                p.fd = -1;
            }
        }
        let r = (self.kernel)(self.fds, Some(Duration::ZERO));
        for (i, fd) in saved {
            self.fds[i].fd = fd;
        }
        r
    }

    /// Spins for the pace's budget (within the deadline) in a poll
    /// session, until a signal handler runs; what it found, if anything.
    fn spin(&mut self, deadline: Option<Instant>, signals: &Watch) -> io::Result<Option<usize>> {
        let time = self.pace.budget.spin_time(deadline);
        if time.is_zero() {
            return Ok(None);
        }
        let begun: Few<bool> = self
            .members
            .iter()
            .map(|m| m.conn.poll_begin().is_ok())
            .collect();
        let pace = self.pace;
        let r = pace.budget.spin(time, signals, || self.look_once());
        for (m, _) in self.members.iter().zip(begun).filter(|(_, b)| *b) {
            let _ = m.conn.poll_end();
        }
        r
    }

    /// One look of the spin: the rings, and the kernel when it is due.
    fn look_once(&mut self) -> io::Result<Option<usize>> {
        if self.look() {
            let due = self.pace.kernel_due();
            return self.report(due).map(Some);
        }
        if self.others && self.pace.kernel_due() {
            return self.report(true).map(|n| (n > 0).then_some(n));
        }
        Ok(None)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Budget;
    use std::time::Duration;

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
        let now = crate::clock::now_ns;
        b.woken(false, now());
        assert_eq!(b.next(), low, "woken without the event");
        b.woken(
            true,
            now() - crate::clock::ns(full + Duration::from_micros(1)),
        );
        assert_eq!(b.next(), low, "the event came after a full budget");
        b.woken(true, now());
        assert_eq!(b.next(), full, "the event came within a full budget");
    }
}
