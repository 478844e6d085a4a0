//! Closes nobody waits for, done when the process would wait anyway.
//!
//! When an SMC-D connection ends, its TCP connection (kept for identity
//! and options, see `docs/handshake.md` "Connection setup cost") has
//! nothing left to carry: the end of the connection reached the peer
//! through the ring's flags and the channel. Its `close` is still the
//! costliest call of a connection's end (a FIN, its processing at the peer
//! socket on loopback, a TIME_WAIT socket), and it sat on the path of the
//! program's next step: a client's next `connect`, a server's next
//! `accept`. [`close_later`] takes such a descriptor; the process's next
//! wait, a spin or a sleep of smclo's (the reader's spin, an interposed
//! `epoll_wait` or `accept` that may block, a handshake's wait), closes it
//! first ([`close_deferred`]), in time the process would otherwise spend
//! waiting for its peer.
//!
//! A `bind` or `listen` closes them first too (under `smclo run`), so that
//! a port or a 4-tuple they hold is as free as over TCP (one bound to the
//! port a TCP socket's `bind` names with an abort, [`close_deferred_freeing`]). A connection that
//! ended in an abort does not wait: its TCP peer may be a program that
//! reads the TCP socket itself (a connection that could not follow an
//! `exec` falls back to it) and waits for that end of stream.
//!
//! Bounds: at most [`SLOTS`] descriptors wait; one more is closed at once
//! by its caller. A descriptor waiting here counts against the descriptor
//! budget as it did before ([`crate::fdnum`]), and a connection attempt
//! short of room closes them all first. `fork` closes them before the
//! child could inherit them ([`crate::owner`]'s prepare handler), so a
//! child does not hold a closed connection's TCP socket open (one another
//! thread hands over while the fork is under way excepted: the child
//! closes its copy at its own next wait). A process that
//! never waits again in smclo keeps at most [`SLOTS`] of them until it
//! does, or exits: only their FINs are late, which nothing of the
//! connections depends on.
//!
//! Lock-free and async-signal-safe (atomics and `close`): a connection may
//! end anywhere, also in a signal handler or under a lock.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// Descriptors that may wait at once.
pub const SLOTS: usize = 8;

/// The descriptors waiting, -1 in a free slot (one cache line: a wait
/// with none to close reads it and nothing else).
static WAITING: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
/// How a descriptor is closed; `close(2)` unless [`set_closer`] said
/// otherwise.
static CLOSER: OnceLock<fn(RawFd)> = OnceLock::new();

/// Closes descriptors with `f` instead of `close(2)`: the preload unmarks
/// the number after the close. Set once; later calls change nothing.
pub fn set_closer(f: fn(RawFd)) {
    let _ = CLOSER.set(f);
}

/// Closes `fd` now with the closer ([`set_closer`]): for a descriptor the
/// caller owns and gives up.
pub(crate) fn close_now(fd: RawFd) {
    close(fd);
}

fn close(fd: RawFd) {
    match CLOSER.get() {
        Some(f) => f(fd),
        // SAFETY: `fd` was handed over to be closed (`close_later`) and is
        // owned by nothing else.
        None => unsafe {
            libc::close(fd);
        },
    }
}

/// Takes `fd` to close at the process's next wait; `false` when all slots
/// are taken (the caller closes it now). The caller gives up `fd`: nothing
/// else may close or use it. It counts as one of smclo's descriptors
/// ([`crate::fdnum::held`]) until closed.
pub fn close_later(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    for s in &WAITING {
        if s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            crate::fdnum::hold_one();
            return true;
        }
    }
    false
}

/// Closes every descriptor waiting ([`close_later`]). Called where the
/// process is about to wait; a look at one cache line when there is none.
pub fn close_deferred() {
    close_waiting(|_| {});
}

/// Closes every descriptor waiting, as [`close_deferred`], those bound to
/// local port `port` with an abort (an RST, `SO_LINGER` of zero) instead
/// of a FIN. Called by a TCP socket's `bind` to that port (a UDP port of
/// the same number is another port): closed with a FIN first,
/// such a socket would hold the port's 4-tuple in TIME_WAIT, and the
/// program's next `connect` from it would fail (`EADDRNOTAVAIL`), where
/// over TCP its own socket, closed when its peer's was, usually leaves
/// none on its side. The connection ended through its ring: nothing reads
/// that socket at either end. Sockets bound to other ports close with a
/// FIN, so no other 4-tuple comes free sooner than over TCP.
pub fn close_deferred_freeing(port: u16) {
    close_waiting(|fd| {
        if crate::sockaddr::local(fd).is_ok_and(|a| a.port() == port) {
            crate::chan_sys::set_linger_zero(fd);
        }
    });
}

/// Closes every descriptor waiting, calling `before` on each first.
fn close_waiting(before: impl Fn(RawFd)) {
    for s in &WAITING {
        if s.load(Ordering::Relaxed) < 0 {
            continue;
        }
        let fd = s.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            before(fd);
            close(fd);
            crate::fdnum::release_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many descriptors wait to be closed.
    fn waiting() -> usize {
        WAITING
            .iter()
            .filter(|s| s.load(Ordering::Acquire) >= 0)
            .count()
    }

    /// Whether the write end of the pipe whose read end is `r` is closed.
    fn hung_up(r: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd: r,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd of ours.
        unsafe { libc::poll(&mut p, 1, 0) };
        p.revents & libc::POLLHUP != 0
    }

    fn pipe() -> (RawFd, RawFd) {
        let mut p = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `p`.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        (p[0], p[1])
    }

    // One test: the slots are the process's.
    #[test]
    fn waits_until_the_next_wait_and_never_beyond_its_slots() {
        let pipes: Vec<(RawFd, RawFd)> = (0..SLOTS + 1).map(|_| pipe()).collect();
        let taken: Vec<bool> = pipes.iter().map(|&(_, w)| close_later(w)).collect();
        assert!(taken[..SLOTS].iter().all(|&t| t), "{taken:?}");
        assert!(!taken[SLOTS], "a descriptor beyond the slots was taken");
        assert_eq!(waiting(), SLOTS);
        assert!(
            pipes[..SLOTS].iter().all(|&(r, _)| !hung_up(r)),
            "closed before a wait"
        );
        close_deferred();
        assert!(
            pipes[..SLOTS].iter().all(|&(r, _)| hung_up(r)),
            "still open after a wait"
        );
        assert_eq!(waiting(), 0);
        for &(r, _) in &pipes {
            // SAFETY: our read ends.
            unsafe { libc::close(r) };
        }
        // SAFETY: the write end the slots refused is still ours.
        unsafe { libc::close(pipes[SLOTS].1) };
    }
}
