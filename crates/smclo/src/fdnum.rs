//! Where smclo's own descriptors live: high numbers.
//!
//! A program's descriptor numbers must grow as they do over TCP, one per
//! connection: event loops sized by the number of connections (wrk sizes
//! its loop at 10 + 3 × connections), `select` (`FD_SETSIZE`) and programs
//! that expect small numbers depend on it. So every descriptor smclo keeps
//! open beside the application's own (a connection's UNIX channel, a DMB's
//! memfd, the preload's hidden TCP socket) is moved to a number at or above
//! [`floor`], leaving the low numbers to the application's `socket`,
//! `accept` and `open`.
//!
//! They also count against the application's `RLIMIT_NOFILE`: each owner of
//! such a descriptor holds a [`Held`], and a new SMC-D connection is tried
//! only while smclo's descriptors stay within [`budget`], a fixed share of
//! the soft limit ([`room_for_conn`]); otherwise it falls back to TCP
//! (reason MEM). So a program that uses up to 15/16 of its limit never
//! meets `EMFILE` earlier than over TCP.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Lowest and highest floor. The upper bound keeps the kernel's descriptor
/// table of a process with a huge `RLIMIT_NOFILE` small, and the numbers
/// inside the preload's table (65536 entries), which marks them internal.
const FLOOR_MIN: i32 = 64;
const FLOOR_MAX: i32 = 32768;

static FLOOR: AtomicI32 = AtomicI32::new(0);

/// The number from which smclo's own descriptors are allocated: half of
/// the soft `RLIMIT_NOFILE` when the process starts using smclo, at least
/// 64 and at most 32768.
pub fn floor() -> i32 {
    let f = FLOOR.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, which we own.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_cur
    } else {
        0
    };
    let f = (soft / 2).clamp(FLOOR_MIN as u64, FLOOR_MAX as u64) as i32;
    FLOOR.store(f, Ordering::Relaxed);
    f
}

/// A close-on-exec duplicate of `fd` at or above [`floor`], or at any free
/// number when there is none up there (a lowered `RLIMIT_NOFILE`, all taken).
pub fn dup_high(fd: RawFd) -> std::io::Result<OwnedFd> {
    // The system call itself: `fd` may be a connection's channel that is
    // the application's descriptor (see crate::chan_sys).
    let mut n = crate::chan_sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor() as libc::c_long);
    if n < 0 {
        n = crate::chan_sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
    }
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` was just returned to us and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// `x` moved to a high number (see [`dup_high`]): the low descriptor is
/// closed. Unchanged if it already is high or cannot be moved.
pub fn move_high<T: Into<OwnedFd> + From<OwnedFd> + AsRawFd>(x: T) -> T {
    if x.as_raw_fd() >= floor() {
        return x;
    }
    match dup_high(x.as_raw_fd()) {
        Ok(high) => T::from(high), // `x` drops (closes) here
        Err(_) => x,
    }
}

/// smclo's descriptors may take 1/`BUDGET_SHARE` of the soft
/// `RLIMIT_NOFILE`; the application keeps the rest.
const BUDGET_SHARE: u64 = 16;

/// What one more connection may need at once: its channel, its DMB's
/// memfd, the preload's hidden TCP socket, and during the handshake a
/// rendezvous socket and the peer's memfd.
pub const PER_CONN: usize = 5;

static HELD: AtomicUsize = AtomicUsize::new(0);

/// One descriptor smclo keeps open beside the application's (a channel, a
/// DMB memfd, a hidden TCP socket): counted while this value lives, so the
/// owner holds it next to the descriptor.
#[derive(Debug)]
pub struct Held(());

impl Held {
    /// Counts one more descriptor.
    pub fn new() -> Held {
        HELD.fetch_add(1, Ordering::Relaxed);
        Held(())
    }
}

impl Default for Held {
    fn default() -> Held {
        Held::new()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one descriptor with no [`Held`] beside it: one handed over to
/// [`crate::deferred`], which calls [`release_one`] when it closes it.
pub(crate) fn hold_one() {
    HELD.fetch_add(1, Ordering::Relaxed);
}

/// Uncounts one descriptor counted by [`hold_one`].
pub(crate) fn release_one() {
    HELD.fetch_sub(1, Ordering::Relaxed);
}

/// Numbers below this are marked in [`OURS`].
const MARKED_MAX: usize = 65536;
#[allow(clippy::declare_interior_mutable_const)]
const NO_MARKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// One bit per descriptor number that the core keeps open beside the
/// program's (see [`Mark`]).
static OURS: [std::sync::atomic::AtomicU64; MARKED_MAX / 64] = [NO_MARKS; MARKED_MAX / 64];

/// Marks descriptor number `fd` as the core's while this value lives (a
/// DMB's memfd, the vault's pair): a program's `close_range` must leave
/// it open (the preload asks [`is_ours`]), as it leaves the kernel's own
/// files of a socket alone.
#[derive(Debug)]
pub struct Mark(RawFd);

impl Mark {
    /// Marks `fd`.
    pub fn new(fd: RawFd) -> Mark {
        if let Some(w) = OURS.get(fd as usize / 64) {
            w.fetch_or(1 << (fd % 64), Ordering::Relaxed);
        }
        Mark(fd)
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(w) = OURS.get(self.0 as usize / 64) {
            w.fetch_and(!(1 << (self.0 % 64)), Ordering::Relaxed);
        }
    }
}

/// Whether descriptor number `fd` is marked as the core's ([`Mark`]).
pub fn is_ours(fd: RawFd) -> bool {
    fd >= 0
        && OURS
            .get(fd as usize / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (fd % 64)) != 0)
}

/// Descriptors smclo holds now in this process.
pub fn held() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// The [`budget`] as [`room_for_conn`] last read it; 0 before.
static BUDGET: AtomicUsize = AtomicUsize::new(0);

/// How many descriptors smclo may hold: 1/[`BUDGET_SHARE`] of the soft
/// `RLIMIT_NOFILE`, read now (the program may change its limit at any
/// time; [`room_for_conn`] reads it once per connection attempt, and the
/// rest of that connection's life uses that reading).
pub fn budget() -> usize {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, which we own.
    let b = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        0
    } else {
        usize::try_from(rl.rlim_cur / BUDGET_SHARE).unwrap_or(usize::MAX)
    };
    BUDGET.store(b, Ordering::Relaxed);
    b
}

/// The budget as the latest connection attempt read it (read now if none
/// did): a connection's later checks ([`pressed`]) need no system call of
/// their own.
fn budget_last_read() -> usize {
    match BUDGET.load(Ordering::Relaxed) {
        0 => budget(),
        b => b,
    }
}

/// Whether one more SMC-D connection fits in the [`budget`]; when it does
/// not, the connection stays TCP.
pub fn room_for_conn() -> bool {
    let budget = budget();
    if held() + PER_CONN > budget {
        // Ended connections' TCP sockets waiting to be closed, and pooled
        // DMBs' memfds: a process short of descriptors closes them now
        // (and creates DMBs anew rather than keep them).
        crate::deferred::close_deferred();
        crate::pool::shed();
    }
    let held = held();
    let room = held + PER_CONN <= budget;
    if !room {
        crate::debug!(
            "descriptor budget: smclo holds {held} descriptors of the {budget} it may use \
             (1/{BUDGET_SHARE} of RLIMIT_NOFILE); this connection stays TCP (MEM)"
        );
    }
    room
}

/// Whether smclo holds more than half its [`budget`]: DMB memfds are then
/// closed as soon as they are passed, and dropped DMBs are not pooled, at
/// the cost of creating the next DMB anew.
pub fn pressed() -> bool {
    held() * 2 > budget_last_read()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moved_descriptors_are_high_and_work() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = move_high(a);
        assert!(a.as_raw_fd() >= floor(), "{} < {}", a.as_raw_fd(), floor());
        use std::io::{Read, Write};
        (&a).write_all(b"x").unwrap();
        let mut c = [0u8];
        (&b).read_exact(&mut c).unwrap();
        assert_eq!(&c, b"x");
        assert_eq!(
            // SAFETY: F_GETFD on our own descriptor.
            unsafe { libc::fcntl(a.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC,
            libc::FD_CLOEXEC
        );
    }
}
