//! How a connection's calls wait: blocking mode, timeouts, the spin
//! before a sleep, and the sleep.
//!
//! Blocking calls first busy-poll the cursor word (`SMCLO_SPIN_US`
//! microseconds at most, adaptive; the reader sets `READER_SPINNING` so the
//! writer can skip the doorbell syscall), then sleep in `poll(2)` on the
//! UNIX end. Whether a call blocks follows the descriptor's `O_NONBLOCK`
//! and `MSG_DONTWAIT`. The flag lives in the open file description, which
//! other processes may share; the `Conn` keeps it as last set through
//! [`Conn::set_nonblocking`] and trusts that copy while the description is
//! known to be this process's alone: made here, no `fork` since, not
//! passed on ([`Conn::share_file`]). Otherwise a call that cannot proceed
//! asks the descriptor (`F_GETFL`) before it sleeps or fails with `EAGAIN`.
//!
//! A sleep ends, as a socket's does in the kernel, when a signal handler
//! runs (`EINTR`, [`io::ErrorKind::Interrupted`]; a handler that ran
//! during the call's spin ends the spin, and the call then fails the same
//! way instead of sleeping, see [`crate::signal`]) or when the direction's
//! timeout ([`Conn::set_read_timeout`], [`Conn::set_write_timeout`]: the
//! `SO_RCVTIMEO`/`SO_SNDTIMEO` of the socket, counted from the call's first
//! sleep) has passed (`EAGAIN`); a call that already moved bytes returns
//! their count instead. No lock is held while a call sleeps, so another
//! thread's non-blocking call on the same direction never waits behind it.

use super::{errno, Conn};
use crate::chan_sys;
use crate::doorbell;
use crate::signal::Watch;
use std::io;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One call's sleeping: interruptible by signal handlers (those that run
/// in the sleep, and those that ran since the call began, in a spin:
/// [`crate::signal`]) and bounded by its direction's timeout, counted from
/// the first sleep.
pub(super) struct Sleep {
    timeout: Option<Duration>,
    end: Option<Instant>,
    pub(super) signals: Watch<'static>,
}

impl Sleep {
    /// The timeout in `us` (microseconds, 0 = none).
    pub(super) fn new(us: &AtomicU64) -> Sleep {
        Sleep {
            timeout: match us.load(Ordering::Relaxed) {
                0 => None,
                us => Some(Duration::from_micros(us)),
            },
            end: None,
            signals: Watch::begin(None),
        }
    }

    /// Sleeps in `poll(2)` until `events` (or a hang-up) on `fd`; returns
    /// `revents` (0 when the timeout ran out, then the next call reports
    /// it). `EINTR` when a signal handler ran, `EAGAIN` after the timeout.
    pub(super) fn poll(&mut self, fd: RawFd, events: i16) -> io::Result<i16> {
        self.signals.check()?;
        let ms = match self.timeout {
            None => -1,
            Some(t) => {
                let end = *self.end.get_or_insert_with(|| Instant::now() + t);
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(errno(libc::EAGAIN));
                }
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        if chan_sys::poll(std::slice::from_mut(&mut p), ms) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(p.revents)
    }
}

/// A timeout as stored: microseconds, 0 = none (so is a zero duration, as
/// for `SO_RCVTIMEO`).
fn timeout_us(t: Option<Duration>) -> u64 {
    t.map_or(0, |t| t.as_micros().min(u64::MAX as u128) as u64)
}

fn timeout_of(us: &AtomicU64) -> Option<Duration> {
    match us.load(Ordering::Relaxed) {
        0 => None,
        us => Some(Duration::from_micros(us)),
    }
}

impl Conn {
    /// Sets `O_NONBLOCK` on the UNIX end, which decides whether calls block.
    /// The only way to change it while the descriptor is this process's
    /// alone: an `fcntl` on [`Conn::fd`] is not seen (the preload turns the
    /// application's `fcntl` and `ioctl(FIONBIO)` into this call).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        if self.nb_own_gen.load(Ordering::Relaxed) == crate::owner::fork_gen()
            && self.nb_hint.load(Ordering::Relaxed) == on
        {
            // The kept flag is the descriptor's, and already as asked (the
            // preload's swap of a blocking connection).
            return Ok(());
        }
        let c = self.chan()?;
        let fl = chan_sys::fcntl(c.raw(), libc::F_GETFL, 0);
        let nfl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        if fl < 0 || (nfl != fl && chan_sys::fcntl(c.raw(), libc::F_SETFL, nfl as libc::c_long) < 0)
        {
            return Err(io::Error::last_os_error());
        }
        self.nb_hint.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Bounds how long a blocking read sleeps (`SO_RCVTIMEO`): after `t`
    /// it returns what it has, or `EAGAIN`. `None` or zero: no bound.
    pub fn set_read_timeout(&self, t: Option<Duration>) {
        self.rcv_timeo_us.store(timeout_us(t), Ordering::Relaxed);
    }

    /// Bounds how long a blocking write sleeps for room (`SO_SNDTIMEO`),
    /// as [`Conn::set_read_timeout`] does for reads.
    pub fn set_write_timeout(&self, t: Option<Duration>) {
        self.snd_timeo_us.store(timeout_us(t), Ordering::Relaxed);
    }

    /// The read timeout (`None`: reads may sleep for good).
    pub fn read_timeout(&self) -> Option<Duration> {
        timeout_of(&self.rcv_timeo_us)
    }

    /// The write timeout.
    pub fn write_timeout(&self) -> Option<Duration> {
        timeout_of(&self.snd_timeo_us)
    }

    /// The caller set `O_NONBLOCK` to `on` on the channel's open file
    /// itself (the preload forwards the application's `fcntl(F_SETFL)` and
    /// `ioctl(FIONBIO)`): the connection's copy follows, without asking.
    pub fn nonblocking_set(&self, on: bool) {
        self.nb_hint.store(on, Ordering::Relaxed);
    }

    /// The channel's open file description may be shared with another
    /// process from now on (its descriptor is sent with `SCM_RIGHTS`, or
    /// was inherited through exec), which may change its `O_NONBLOCK`
    /// unseen: calls that cannot proceed ask the descriptor from now on.
    /// (`fork` needs no call: it starts a new fork generation.)
    pub fn share_file(&self) {
        self.nb_own_gen.store(0, Ordering::Relaxed);
    }

    /// Whether the channel's open file may be shared with another process
    /// of the fork family (a `fork` since its flag was last known), so
    /// that an adapter that knows the family may find it is not
    /// ([`Conn::own_file_again`]).
    pub fn file_shared_in_family(&self) -> bool {
        let g = self.nb_own_gen.load(Ordering::Relaxed);
        g != 0 && g != crate::owner::fork_gen()
    }

    /// The adapter found that no other process of the fork family holds
    /// the channel's open file any more (the other holders closed their
    /// copies: a prefork server's parent after handing the connection to
    /// its worker): its `O_NONBLOCK` is read once, and kept from then on
    /// as for a connection that was never shared. Not after
    /// [`Conn::share_file`]: a process outside the family may hold it.
    pub fn own_file_again(&self) -> io::Result<()> {
        let g = crate::owner::fork_gen();
        let was = self.nb_own_gen.load(Ordering::Relaxed);
        if was == 0 || was == g {
            return Ok(());
        }
        self.nonblocking_now()?;
        // A fork since `g` was read leaves the flag to be asked again.
        let _ = self
            .nb_own_gen
            .compare_exchange(was, g, Ordering::Relaxed, Ordering::Relaxed);
        Ok(())
    }

    /// The descriptor's `O_NONBLOCK`: the kept flag while the open file
    /// description is this process's alone, else asked.
    pub(super) fn nonblocking(&self) -> io::Result<bool> {
        if self.nb_own_gen.load(Ordering::Relaxed) == crate::owner::fork_gen() {
            return Ok(self.nb_hint.load(Ordering::Relaxed));
        }
        self.nonblocking_now()
    }

    /// The descriptor's `O_NONBLOCK` now (a syscall; refreshes the hint).
    fn nonblocking_now(&self) -> io::Result<bool> {
        let fl = chan_sys::fcntl(self.chan()?.raw(), libc::F_GETFL, 0);
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        let nb = fl & libc::O_NONBLOCK != 0;
        self.nb_hint.store(nb, Ordering::Relaxed);
        Ok(nb)
    }

    /// Whether a call that cannot proceed must not wait: `MSG_DONTWAIT`,
    /// or the descriptor is non-blocking (a syscall only if the hint says
    /// so and the flag may be shared).
    pub(super) fn must_not_wait(&self, dontwait: bool) -> io::Result<bool> {
        Ok(dontwait || (self.nb_hint.load(Ordering::Relaxed) && self.nonblocking()?))
    }

    /// Busy-polls `word` until it differs from `from`, the budget runs
    /// out or a signal handler runs (the sleep that follows then fails).
    /// The clock is read once per 32 loads.
    fn spin_on(word: &AtomicU64, from: u64, budget: Duration, signals: &Watch) -> bool {
        let moved = || {
            (0..32).any(|_| {
                let m = word.load(Ordering::Acquire) != from;
                if !m {
                    std::hint::spin_loop();
                }
                m
            })
        };
        crate::spin::until(budget, Some(signals), || moved().then_some(())).is_some()
    }

    /// Reader: spin until the local `prod` word changes. With `cap`, sets
    /// `READER_SPINNING` so small writes skip their doorbell; the caller
    /// must then consume up to `cap` bytes of whatever is there.
    pub(super) fn rx_spin(&self, cap: Option<usize>, signals: &Watch) -> io::Result<()> {
        let budget = self.rx_spin.next();
        if budget.is_zero() {
            return Ok(());
        }
        let l = &self.local;
        let rs = match cap {
            Some(cap) => doorbell::spin_begin(l.prod(), l.cons(), l.ring_len(), cap)
                .map_err(|e| self.violation("receive ring", e))?,
            None => false,
        };
        let from = l.prod().load(Ordering::SeqCst);
        let hit = Self::spin_on(l.prod(), from, budget, signals);
        if rs {
            doorbell::spin_end(l.prod(), l.ring_len())
                .map_err(|e| self.violation("receive ring", e))?;
        }
        self.rx_spin.note(hit);
        Ok(())
    }

    /// Writer: spin until the peer's `cons` word moves (room appears).
    pub(super) fn tx_spin(&self, signals: &Watch) -> bool {
        let budget = self.tx_spin.next();
        if budget.is_zero() {
            return false;
        }
        let c = self.peer.cons();
        let hit = Self::spin_on(c, c.load(Ordering::SeqCst), budget, signals);
        self.tx_spin.note(hit);
        hit
    }

    /// How long the next blocking read would spin before it sleeps (the
    /// adaptive budget; for tests and diagnostics).
    pub fn read_spin_budget(&self) -> Duration {
        self.rx_spin.next()
    }
}
