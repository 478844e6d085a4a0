//! Which application descriptors are SMC-D connections, and what they share.
//!
//! [`TABLE`] has one atomic pointer per descriptor below [`MAX_FD`]; a
//! non-null entry is a counted reference to the connection ([`Sock`]) that
//! the descriptor names (after the swap, the descriptor is the
//! connection's UNIX channel itself, or a `dup` of it). Bit 0 of the pointer is the
//! application's view of `FD_CLOEXEC` being *off* (the real descriptor
//! always has it on, see [`crate::hooks`] on exec).
//!
//! A descriptor that is not in the table costs one atomic load. Using an
//! entry takes [`LOCK`] for reading just long enough to count a reference;
//! removing or adding entries takes it for writing, so a reference is never
//! counted on a `Sock` that is being freed.

use smclo::adapter::conn::Conn;
use smclo::device::Registration;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU16, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Descriptors at or above this are never upgraded (they stay plain TCP).
pub const MAX_FD: usize = 65536;

/// Tag bit in a table pointer: the application asked for no `FD_CLOEXEC`.
pub const TAG_NO_CLOEXEC: usize = 1;

#[allow(clippy::declare_interior_mutable_const)]
const NULL_SOCK: AtomicPtr<Sock> = AtomicPtr::new(std::ptr::null_mut());
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU16 = AtomicU16::new(0);

/// Application descriptor → connection.
pub static TABLE: [AtomicPtr<Sock>; MAX_FD] = [NULL_SOCK; MAX_FD];

/// Per-descriptor flags that are not table entries (see the `F_*` bits).
pub static FLAGS: [AtomicU16; MAX_FD] = [ZERO; MAX_FD];
/// A listening TCP socket registered in the device.
pub const F_LISTENER: u16 = 1;
/// A descriptor the preload itself uses (a hidden TCP socket, or a
/// connection's channel at a number the application has let go of): the
/// application cannot close it by accident.
pub const F_INTERNAL: u16 = 2;
/// A TCP socket that may be swapped later (created, not yet connected):
/// its epoll registrations are recorded.
pub const F_CANDIDATE: u16 = 4;
/// Created by the interposed `socket()` as an `AF_INET`/`AF_INET6`
/// `SOCK_STREAM` TCP socket, or accepted on a listener that was: its
/// domain, type and protocol are known
/// without asking the kernel (three `getsockopt` calls). Like every flag it
/// is forgotten when the number is closed or reused through our functions;
/// a descriptor without it (inherited, dup'ed, made by a raw system call)
/// is asked with `getsockopt` instead.
pub const F_TCP: u16 = 8;
/// An epoll descriptor with SMC-D members: its waits are served by the
/// event-loop fast path (`hooks::epoll`).
pub const F_EPOLL: u16 = 16;
/// A TCP connection that fell back, listed in the device's fallback table
/// until this descriptor is closed (`smclo ss -a`).
pub const F_FALLBACK: u16 = 32;
/// The flags whose records a duplicate of the descriptor shares
/// (`hooks::state`): the record lasts until the last of them is closed.
pub const F_DUP_SHARED: u16 = F_LISTENER | F_FALLBACK;
/// Known not to need a listener registration: not a listening TCP socket
/// (asked once, or made by our `socket()` as something else), or one whose
/// registration failed. `accept` and `epoll_ctl` on a descriptor with no
/// flag and no table entry ask the kernel once whether it is a listener
/// inherited through exec (`hooks::setup`).
pub const F_PLAIN: u16 = 64;
/// The application set an IP option that the handshake's SYN mark changes
/// (TTL or TOS, hop limit or traffic class): the mark must read it first to
/// put it back. Without it, a socket with [`F_TCP`] has the defaults.
pub const F_IP_OPTS: u16 = 128;
/// A non-blocking `connect` whose handshake has not decided yet: the
/// descriptor is the TCP socket, not reported writable until it decides
/// (`hooks::pending`).
pub const F_PENDING: u16 = 256;
/// An internal descriptor that a connection is closing: see
/// [`settle`].
pub const F_CLOSING: u16 = 512;
/// The application set `SO_RCVTIMEO` or `SO_SNDTIMEO` (on the socket, or on
/// the listener that accepted it), which the swap must copy to the
/// connection. Without it, a socket with [`F_TCP`] has no timeouts, and the
/// swap asks nothing.
pub const F_TIMEO: u16 = 1024;
/// `bind` was called on it: its source address is not routing's choice,
/// so a proposal asks the socket (`getsockname`). Without it, a socket with
/// [`F_TCP`] is unbound.
pub const F_BOUND: u16 = 2048;

/// The flags that only spare system calls (what the kernel would say of
/// the descriptor): no record, lock or connection goes with them, so a
/// descriptor with no others closes without the table's lock.
pub const F_HINTS: u16 = F_TCP | F_PLAIN | F_IP_OPTS | F_TIMEO | F_BOUND;

/// With [`F_PENDING`]: a blocking connect that returned connected, whose
/// writes go into the stream as early bytes (`hooks::pending`): reported
/// writable, as the TCP socket is.
pub const F_EARLY: u16 = 4096;

/// With [`F_PENDING`] and [`F_EARLY`]: the connect's handshake is an
/// announcement (a destination without a registered listener): the
/// connection is TCP's until a server answers, and no call waits for that
/// answer (`hooks::pending`).
pub const F_ANNOUNCED: u16 = 8192;

/// Sets or clears flag bits of `fd` (ignored beyond the table).
pub fn set_flag(fd: RawFd, f: u16, on: bool) {
    if let Some(a) = FLAGS.get(fd as usize) {
        if on {
            a.fetch_or(f, Ordering::Relaxed);
        } else {
            a.fetch_and(!f, Ordering::Relaxed);
        }
    }
}

/// Marks `fd`, a number smclo just got from the kernel, internal ([`F_INTERNAL`])
/// once any close of that number's former file is done unmarking it
/// ([`settle`]): a connection's close (in whichever thread waits next, for
/// a hidden TCP socket, `smclo::adapter::deferred`) unmarks the number after the
/// kernel freed it, and would otherwise clear the new mark.
pub fn mark_internal(fd: RawFd) {
    settle(fd);
    set_flag(fd, F_INTERNAL, true);
}

/// Whether `fd` has any of the flag bits `f`.
#[inline]
pub fn has_flag(fd: RawFd, f: u16) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD && FLAGS[fd as usize].load(Ordering::Relaxed) & f != 0
}

/// A reader/writer lock made of one atomic word, so that a `fork` child can
/// reset it (no thread of the parent exists there to release it) and so
/// readers pay one atomic add each way.
pub struct Lock(AtomicU32);

const WRITER: u32 = 1 << 31;

/// Guards [`TABLE`] updates against reference counting in progress.
pub static LOCK: Lock = Lock(AtomicU32::new(0));

impl Lock {
    /// Shared access for a few instructions.
    #[inline]
    pub fn read(&self) -> ReadGuard<'_> {
        loop {
            if self.0.fetch_add(1, Ordering::Acquire) & WRITER == 0 {
                return ReadGuard(self);
            }
            self.0.fetch_sub(1, Ordering::Relaxed);
            while self.0.load(Ordering::Relaxed) & WRITER != 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Exclusive access (table changes, fork).
    pub fn write(&self) -> WriteGuard<'_> {
        loop {
            let v = self.0.load(Ordering::Relaxed);
            if v & WRITER == 0
                && self
                    .0
                    .compare_exchange_weak(v, v | WRITER, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
            std::thread::yield_now();
        }
        while self.0.load(Ordering::Acquire) & !WRITER != 0 {
            std::hint::spin_loop();
        }
        WriteGuard(self)
    }

    /// Exclusive access if it can be had within `wait`, else `None`. For
    /// `_exit`, which a signal handler may call while its own thread holds
    /// the lock (which would then never be released). Async-signal-safe:
    /// atomics, `clock_gettime` and `sched_yield`.
    pub fn try_write_for(&self, wait: std::time::Duration) -> Option<WriteGuard<'_>> {
        let start = std::time::Instant::now();
        let timed_out = || {
            std::thread::yield_now();
            start.elapsed() > wait
        };
        loop {
            let v = self.0.load(Ordering::Relaxed);
            if v & WRITER == 0
                && self
                    .0
                    .compare_exchange_weak(v, v | WRITER, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
            if timed_out() {
                return None;
            }
        }
        let guard = WriteGuard(self);
        while self.0.load(Ordering::Acquire) & !WRITER != 0 {
            if timed_out() {
                return None; // the guard lets go
            }
        }
        Some(guard)
    }

    /// In a `fork` child: only the forking thread exists, and it held the
    /// lock for writing across the fork; start from a clean word.
    pub fn reset_in_child(&self) {
        self.0.store(0, Ordering::Release);
    }
}

/// See [`Lock::read`].
pub struct ReadGuard<'a>(&'a Lock);
impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::Release);
    }
}

/// See [`Lock::write`].
pub struct WriteGuard<'a>(&'a Lock);
impl WriteGuard<'_> {
    /// Leaves the lock held (the fork child resets it instead).
    pub fn forget(self) {
        std::mem::forget(self);
    }
}
impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_and(!WRITER, Ordering::Release);
    }
}

/// One SMC-D connection as this process sees it.
pub struct Sock {
    /// The data path. Its channel's descriptor is the application's own
    /// (the number the connection was made on) while the application
    /// keeps that number; see `crate::hooks` (`close`, `dup2`, exec).
    pub conn: Conn,
    /// This end's DMB registration (stats: bytes sent).
    pub reg: Registration,
    /// The TCP socket, hidden at a high descriptor (`FD_CLOEXEC`): identity
    /// for getsockname/getpeername/options. Its close, which ends the TCP
    /// connection and nothing else, waits for the process's next wait
    /// ([`smclo::adapter::deferred`]); the number stays internal until then.
    pub tcp: RawFd,
    /// The SYN mark still on `tcp`, put back before the program sees its
    /// IP options (`getsockopt`, `setsockopt`, exec).
    pub syn_mark: smclo::adapter::tcp_syn::LeftMark,
    /// Application descriptors naming this connection in this process.
    pub fds: AtomicUsize,
    /// `shutdown(SHUT_RD)` was called: reads return end of stream.
    pub shut_rd: AtomicBool,
    /// `SO_LINGER` with a zero timeout is set: the last close aborts.
    pub linger0: AtomicBool,
    /// Index of this connection's holder slot ([`crate::holders`]).
    pub slot: usize,
    /// A corking deadline is queued for this connection ([`crate::cork`]).
    pub cork_armed: AtomicBool,
    /// `tcp` counts against the descriptor budget (`smclo::adapter::fdnum`).
    pub _held: smclo::adapter::fdnum::Held,
}

impl Sock {
    /// `shutdown(how)` of the connection: SHUT_WR half-closes (the peer
    /// reads what was sent, then end of stream); SHUT_RD is local, as in
    /// SMC.
    pub fn shutdown(&self, how: libc::c_int) -> std::io::Result<()> {
        match how {
            libc::SHUT_RD => {
                self.shut_rd.store(true, Ordering::Relaxed);
                Ok(())
            }
            libc::SHUT_WR | libc::SHUT_RDWR => {
                if how == libc::SHUT_RDWR {
                    self.shut_rd.store(true, Ordering::Relaxed);
                }
                self.conn.shutdown_write()
            }
            _ => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

impl Drop for Sock {
    /// Closes the channel, whose number may be one the application closed
    /// while the connection still needed it (marked internal since), and
    /// hands the hidden TCP socket over to be closed at the next wait
    /// ([`close_hidden`]). A connection that ended in an abort (ours:
    /// `SO_LINGER` 0; the peer's, or the peer gone) closes it now: its TCP
    /// peer may be a program that reads the TCP socket itself (a
    /// connection that could not follow its peer's exec falls back to it)
    /// and waits for this end of stream.
    fn drop(&mut self) {
        let aborted = self.linger0.load(Ordering::Relaxed)
            || self
                .conn
                .ready()
                .intersects(smclo::adapter::poller::Ready::ERR);
        close_internal(self.conn.fd(), || self.conn.close_channel());
        if aborted || !smclo::adapter::deferred::close_later(self.tcp) {
            close_hidden(self.tcp);
        }
    }
}

/// Closes a hidden TCP socket and unmarks its number: how
/// [`smclo::adapter::deferred`] closes those a [`Sock`] handed over.
pub fn close_hidden(fd: RawFd) {
    close_internal(fd, || {
        // SAFETY: the hidden socket is ours alone (nobody else has its
        // number: it is internal until unmarked here).
        unsafe { crate::real::close(fd) };
    });
}

/// Closes internal descriptor `fd` with `close` and unmarks it. The number
/// is free for the application's next `open` or `socket` as soon as it is
/// closed, but marked until unmarked: [`F_CLOSING`] across the two tells
/// `close` and `dup2` of the new file there to wait ([`settle`]) instead of
/// ignoring it or refusing. No lock: a Sock may be dropped anywhere, also
/// where the table lock is held.
fn close_internal(fd: RawFd, close: impl FnOnce()) {
    set_flag(fd, F_CLOSING, true);
    close();
    set_flag(fd, F_INTERNAL | F_CLOSING, false);
}

/// Waits until no connection is between closing `fd` and unmarking it
/// ([`close_internal`]: a few instructions).
pub fn settle(fd: RawFd) {
    while has_flag(fd, F_CLOSING) {
        std::thread::yield_now();
    }
}

/// The entry of `fd`, counted, or `None` (the common case: one load).
#[inline]
pub fn get(fd: RawFd) -> Option<Arc<Sock>> {
    if fd < 0 || fd as usize >= MAX_FD {
        return None;
    }
    if TABLE[fd as usize].load(Ordering::Relaxed).is_null() {
        return None;
    }
    get_slow(fd)
}

#[cold]
fn get_slow(fd: RawFd) -> Option<Arc<Sock>> {
    let _g = LOCK.read();
    let p = TABLE[fd as usize].load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    let p = (p as usize & !TAG_NO_CLOEXEC) as *const Sock;
    // SAFETY: a non-null entry owns one strong count of an Arc<Sock>; the
    // read lock keeps writers (who release that count) out until we hold
    // our own count.
    unsafe {
        Arc::increment_strong_count(p);
        Some(Arc::from_raw(p))
    }
}

/// Whether the application asked for `FD_CLOEXEC` on `fd` (a table fd).
pub fn app_cloexec(fd: RawFd) -> bool {
    TABLE[fd as usize].load(Ordering::Acquire) as usize & TAG_NO_CLOEXEC == 0
}

/// Records the application's `FD_CLOEXEC` view of table fd `fd`.
pub fn set_app_cloexec(fd: RawFd, on: bool) {
    let _g = LOCK.write();
    let a = &TABLE[fd as usize];
    let p = a.load(Ordering::Acquire) as usize;
    if p == 0 {
        return;
    }
    let np = if on {
        p & !TAG_NO_CLOEXEC
    } else {
        p | TAG_NO_CLOEXEC
    };
    a.store(np as *mut Sock, Ordering::Release);
}

/// Installs `sock` as the entry of `fd` (which must be free). Call with the
/// write lock held.
pub fn install_locked(fd: RawFd, sock: &Arc<Sock>, cloexec: bool) {
    sock.fds.fetch_add(1, Ordering::AcqRel);
    let p = Arc::into_raw(sock.clone()) as usize | if cloexec { 0 } else { TAG_NO_CLOEXEC };
    // The descriptor now names the connection's channel, not a TCP socket.
    set_flag(fd, F_CANDIDATE | F_TCP, false);
    TABLE[fd as usize].store(p as *mut Sock, Ordering::Release);
}

/// `f` applied to the entry of `fd`, if any, without counting a
/// reference: call with the write lock held, which keeps the entry alive.
pub fn with_entry_locked<R>(fd: RawFd, f: impl FnOnce(&Sock) -> R) -> Option<R> {
    if fd < 0 || fd as usize >= MAX_FD {
        return None;
    }
    let p = TABLE[fd as usize].load(Ordering::Acquire) as usize & !TAG_NO_CLOEXEC;
    // SAFETY: a non-null entry owns a strong count of its Sock, and the
    // write lock keeps anyone from taking it out meanwhile.
    (p != 0).then(|| f(unsafe { &*(p as *const Sock) }))
}

/// Whether `fd` still names `sock` (write lock held): a `dup` of a
/// descriptor that another thread closed meanwhile must fail as the
/// kernel's would, not name a closed connection.
pub fn names_locked(fd: RawFd, sock: &Arc<Sock>) -> bool {
    with_entry_locked(fd, |s| std::ptr::eq(s, &**sock)).unwrap_or(false)
}

/// Removes the entry of `fd` (write lock held) and returns its reference;
/// the caller must pass it to [`release`] after unlocking.
pub fn take_locked(fd: RawFd) -> Option<Arc<Sock>> {
    if fd < 0 || fd as usize >= MAX_FD {
        return None;
    }
    let p = TABLE[fd as usize].swap(std::ptr::null_mut(), Ordering::AcqRel);
    if p.is_null() {
        return None;
    }
    // SAFETY: the entry owned this strong count; it is now ours.
    Some(unsafe { Arc::from_raw((p as usize & !TAG_NO_CLOEXEC) as *const Sock) })
}

/// Calls `f` with every connection in the table, once per entry (a
/// connection with several descriptors comes several times), without
/// counting references or allocating: async-signal-safe. Call with the
/// write lock held, which keeps every entry (and its `Sock`) alive.
pub fn for_each_locked(mut f: impl FnMut(&Sock)) {
    for a in TABLE.iter() {
        let p = a.load(Ordering::Acquire) as usize & !TAG_NO_CLOEXEC;
        if p != 0 {
            // SAFETY: a non-null entry owns a strong count of its Sock, and
            // the write lock keeps anyone from taking it out meanwhile.
            f(unsafe { &*(p as *const Sock) });
        }
    }
}

/// Every table entry with its descriptor, counted (for fork and exec).
/// Call with the write lock held.
pub fn all_locked() -> Vec<(RawFd, Arc<Sock>)> {
    let mut v = Vec::new();
    for (fd, a) in TABLE.iter().enumerate() {
        let p = a.load(Ordering::Acquire);
        if p.is_null() {
            continue;
        }
        let p = (p as usize & !TAG_NO_CLOEXEC) as *const Sock;
        // SAFETY: as in get_slow; the write lock keeps every entry alive.
        unsafe {
            Arc::increment_strong_count(p);
            v.push((fd as RawFd, Arc::from_raw(p)));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// `_exit` in a signal handler may interrupt a thread that holds the
    /// lock, for reading or writing: trying must give up, in bounded time.
    #[test]
    fn try_write_for_gives_up_on_a_held_lock() {
        let l = Lock(AtomicU32::new(0));
        let wait = Duration::from_millis(20);
        {
            let _w = l.write();
            let t0 = Instant::now();
            assert!(l.try_write_for(wait).is_none());
            assert!(t0.elapsed() < Duration::from_secs(2));
        }
        {
            let _r = l.read();
            assert!(l.try_write_for(wait).is_none());
            // Giving up left the reader's lock as it was: readers still enter.
            drop(l.read());
        }
        let g = l.try_write_for(wait).expect("a free lock is taken");
        drop(g);
        assert_eq!(l.0.load(Ordering::Relaxed), 0);
    }
}
