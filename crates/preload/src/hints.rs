//! Hints: facts about the kernel's socket behind a descriptor number,
//! beside its state (`crate::table`), that only spare system calls (a TCP
//! stream, bound, IP options or timeouts set, known to be no listener).
//! They are not smclo's state: nothing is held for them, a hint that is
//! missing costs a question to the kernel, and one that is wrong (a number
//! closed behind smclo's back) is forgotten when the number comes back
//! from the kernel. So they stay separate bits, set by whoever learns the
//! fact, and the close of a number with hints only takes no lock.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::table::MAX_FD;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO_HINTS: AtomicU8 = AtomicU8::new(0);

fn in_range(fd: RawFd) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD
}

/// A fact about the kernel's socket behind a number (see the module's
/// doc), one bit of its hints.
#[derive(Clone, Copy)]
#[repr(u8)]
pub enum Hint {
    /// Created by the interposed `socket()` as an `AF_INET`/`AF_INET6`
    /// `SOCK_STREAM` TCP socket, or accepted on a listener that was: its
    /// domain, type and protocol are known without asking the kernel
    /// (three `getsockopt` calls).
    Tcp = 1,
    /// Known not to need a listener registration: not a listening TCP
    /// socket (asked once, or made by our `socket()` as something else),
    /// or one whose registration failed. `accept` and `epoll_ctl` on an
    /// unknown descriptor ask the kernel once whether it is a listener
    /// inherited through exec (`hooks::setup`).
    Plain = 2,
    /// The program set an IP option that the handshake's SYN mark changes
    /// (TTL or TOS, hop limit or traffic class): the mark must read it
    /// first to put it back. Without it, a [`Hint::Tcp`] socket has the
    /// defaults.
    IpOpts = 4,
    /// The program set `SO_RCVTIMEO` or `SO_SNDTIMEO` (on the socket, or
    /// on the listener that accepted it), which the swap must copy to the
    /// connection. Without it, a [`Hint::Tcp`] socket has no timeouts.
    Timeo = 8,
    /// `bind` was called on it: its source address is not routing's
    /// choice, so a proposal asks the socket (`getsockname`). Without it,
    /// a [`Hint::Tcp`] socket is unbound.
    Bound = 16,
    /// The program set `TCP_INQ` on it (or on the listener that accepted
    /// it, which the kernel copies): the swap asks whether it is on.
    /// Without it, a [`Hint::Tcp`] socket has it off.
    Inq = 32,
}

/// The hints by number.
static HINTS: [AtomicU8; MAX_FD] = [ZERO_HINTS; MAX_FD];

/// Notes `h` of `fd` (ignored beyond the table).
pub fn hint(fd: RawFd, h: Hint) {
    if in_range(fd) {
        HINTS[fd as usize].fetch_or(h as u8, Ordering::Relaxed);
    }
}

/// Whether `fd` has hint `h`.
#[inline]
pub fn hinted(fd: RawFd, h: Hint) -> bool {
    in_range(fd) && HINTS[fd as usize].load(Ordering::Relaxed) & h as u8 != 0
}

/// The hints of `fd`, all bits (0 beyond the table).
#[inline]
pub fn hints(fd: RawFd) -> u8 {
    if in_range(fd) {
        HINTS[fd as usize].load(Ordering::Relaxed)
    } else {
        0
    }
}

/// Forgets the hints of `fd` if they are still `seen`: whether they were.
pub fn forget_hints_if(fd: RawFd, seen: u8) -> bool {
    seen == 0
        || HINTS[fd as usize]
            .compare_exchange(seen, 0, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Forgets the hints of `fd` (closed, or met fresh from the kernel).
pub fn forget_hints(fd: RawFd) {
    if in_range(fd) {
        HINTS[fd as usize].store(0, Ordering::Relaxed);
    }
}
