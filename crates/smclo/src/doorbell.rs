//! Readiness: the doorbell protocol over a UNIX stream pair.
//!
//! Each connection end holds one end of a UNIX stream connection to the
//! peer; that descriptor is what applications poll. With `SO_SNDBUF` at its
//! minimum, the number of one-byte doorbells queued from writer W to reader
//! R decides both readinesses (asserted by `tests/conn_readiness.rs`):
//!
//! | doorbells queued W→R | R readable | W writable | ring |
//! | --- | --- | --- | --- |
//! | 0 | no | yes | empty |
//! | 1 | yes | yes | data and room |
//! | 2 | yes | no | full, W wants to write |
//!
//! `BELLS` in the `prod` word counts the doorbells sent and not yet taken.
//! Only the writer raises it (and then sends exactly as many bytes, one
//! `send` each, so that each is its own queued buffer); only the reader
//! lowers it (and then receives exactly as many). Every change is one CAS on
//! the word that also holds the producer cursor, so a decision taken on a
//! stale view fails and is retaken.
//!
//! - **Publish** (writer, [`publish`]): advance the cursor; if `BELLS` is 0
//!   raise it to 1 (ring non-empty now), unless the reader is spinning (see
//!   below). A stale `WRITE_BLOCKED` is cleared unless two bells are queued
//!   (then the reader owns it).
//! - **Full** (writer, [`writer_block`]): Dekker with `WRITE_BLOCKED`. CAS
//!   the flag on, then load `cons` (both SeqCst). Still full: CAS `BELLS` to
//!   2 (only if the flag is still set and the word unchanged) and send the
//!   difference, which makes W's descriptor unwritable.
//! - **Settle** (reader, [`reader_settle`], after storing `cons` SeqCst):
//!   load `prod`; if `WRITE_BLOCKED` is set and there is room, clear it and
//!   lower `BELLS` 2→1 (W becomes writable); if the ring is empty and no
//!   closing flag is set, lower `BELLS` 1→0 (R stops being readable). Either
//!   the writer's `cons` load sees the room, or the reader's `prod` load sees
//!   the flag: no lost wake-up.
//!
//! Edge-triggered pollers are woken by a doorbell *send*, and data written
//! while a bell is queued sends none. So a read returns fewer bytes than
//! asked only after a settle that found the ring empty and took the bell
//! (the next write rings again): data published while it copied is taken
//! by the same call. Otherwise a caller that waits for the next edge after
//! a short read (nginx does) sleeps on a readable descriptor for good.
//!
//! FIONREAD ([`reader_report`]) is an edge promise too: nginx, told N
//! bytes, reads N and then waits for an edge, which TCP would raise for
//! anything that arrived since. So if a bell is queued the report sets
//! `EDGE_WANTED`, and the next publish, finding a bell queued, sends one
//! *loose* byte beyond the count (`LOOSE_BELL`) as that edge; any settle
//! or report takes it. While it is queued the writer's descriptor may say
//! unwritable with room in the ring (two bytes queued) until the reader's
//! next call; writes themselves go by the ring, not by the descriptor.
//!
//! The queue can briefly hold more bytes than it counts: the reader lowers
//! the count by CAS before it receives, and the writer may raise it again
//! meanwhile. At most 6 bytes are ever queued (`BELLS` 2 and a loose bell
//! counted, as many being taken); the minimum send buffer holds 6 one-byte
//! sends, so a doorbell send does not block.
//!
//! A doorbell the reader un-counted may not be sent yet: the writer is
//! between its CAS and its send. [`BellChannel::take_bells`] never waits
//! for it; it stays *owed*. Its late arrival would make the reader's
//! descriptor readable with nothing to read, so `Conn` waits for it while
//! the writer can still run, and leaves it owed (a later call takes it)
//! only for a writer that is stopped there.
//!
//! # Spinning readers
//!
//! A reader about to sleep in a consuming read may busy-poll the `prod`
//! word for a few microseconds first ([`spin_begin`], [`spin_end`]). While
//! it does, it sets `READER_SPINNING` in `prod` and publishes in the flag
//! bits of `cons` its *spin capacity*: how many bytes this read will
//! consume at once (its buffer length). A writer may skip the doorbell
//! syscall only if the flag is set and all unread data fits that capacity;
//! after such a skip it re-checks ([`publish`]'s post-check) and rings after
//! all if the reader stopped spinning or the data outgrew the capacity.
//!
//! Why the capacity: a reader that stops spinning takes whatever is in the
//! ring. If it could leave part of it there (a small buffer) while the bell
//! was skipped, the descriptor would stay unreadable with data in the ring
//! and a poller would sleep forever; only the writer can create a bell. With
//! the capacity, everything published without a bell is consumed by the
//! spinning read itself. A reader starts spinning only on an empty ring
//! with no bells, so data published in one spin session never outlives it.
//!
//! # Pollers
//!
//! An event loop's wait ([`crate::poller`]) looks at many rings from user
//! space for a while before it sleeps in the kernel. While it does, its
//! connections carry `POLLED` ([`poll_begin`], [`poll_end`], counted per
//! process so that several pollers of one ring can overlap), and a writer
//! that would raise `BELLS` from 0 skips the doorbell instead. Ending the
//! session clears the flag and looks at every ring again, so what was
//! published without a bell is seen (and reported) by the poller.
//!
//! A session may stay open while its event loop works between waits (the
//! loop looks at the rings at its next wait). Any other waiter of the
//! process that sleeps in the kernel on the ring first clears the flag
//! ([`poll_cancel`]) and looks at the ring itself.
//!
//! Unlike the spinning reader, a poller does not consume: after a skip the
//! ring may hold data with no bell until it is read empty, so the channel
//! alone no longer tells readability. Every wait that can see such a ring
//! looks at the ring first (the preload's `epoll_wait`, `poll`, `select`,
//! blocking reads); the doorbell stays the truth for everything else,
//! because a ring that was never polled always has its bell.
//!
//! # Checking the protocol
//!
//! The decisions are pure functions of the two words, generic over [`Word`]
//! (std atomics in shared memory; loom atomics in the model) and the bell
//! channel is a trait ([`BellChannel`]). The loom model runs with a plain
//! command (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_doorbell
//! ```
//!
//! and `tests/conn_doorbell_stress.rs` runs the same logic with std threads
//! and random timing.

use smclo_wire::cursor::{
    self, advance, bells, conn_state_flags, distance, prod_flags, spin_cap, spin_cap_encode,
    with_bells, with_prod_flags, without_prod_flags, CursorError, CLOSING, EDGE_WANTED, LOOSE_BELL,
    POLLED, READER_SPINNING, WRITE_BLOCKED,
};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// One cursor word in shared memory, accessed only atomically and always
/// SeqCst (the Dekker handshake needs it; on x86 only stores cost more).
pub trait Word {
    /// Atomic load.
    fn load(&self) -> u64;
    /// Atomic store.
    fn store(&self, v: u64);
    /// Compare-and-swap; `Err(actual)` when the word was not `cur`.
    fn cas(&self, cur: u64, new: u64) -> Result<u64, u64>;
}

impl Word for std::sync::atomic::AtomicU64 {
    #[inline]
    fn load(&self) -> u64 {
        self.load(std::sync::atomic::Ordering::SeqCst)
    }
    #[inline]
    fn store(&self, v: u64) {
        self.store(v, std::sync::atomic::Ordering::SeqCst)
    }
    #[inline]
    fn cas(&self, cur: u64, new: u64) -> Result<u64, u64> {
        use std::sync::atomic::Ordering::SeqCst;
        self.compare_exchange(cur, new, SeqCst, SeqCst)
    }
}

#[cfg(loom)]
impl Word for loom::sync::atomic::AtomicU64 {
    fn load(&self) -> u64 {
        self.load(loom::sync::atomic::Ordering::SeqCst)
    }
    fn store(&self, v: u64) {
        self.store(v, loom::sync::atomic::Ordering::SeqCst)
    }
    fn cas(&self, cur: u64, new: u64) -> Result<u64, u64> {
        use loom::sync::atomic::Ordering::SeqCst;
        self.compare_exchange(cur, new, SeqCst, SeqCst)
    }
}

/// Where doorbells go: one byte each, in order.
pub trait BellChannel {
    /// Queues `n` doorbells at the peer, each as its own buffer. `EAGAIN`:
    /// the queue is full, which the protocol rules out (at most 6 queued):
    /// the peer is not taking the doorbells it counts.
    fn send_bells(&self, n: u32) -> io::Result<()>;
    /// Takes up to `n` doorbells that are queued now, without waiting:
    /// the peer may have counted some that it has not sent yet (it is
    /// between its CAS and its send, perhaps stopped there); the caller
    /// owes those and takes them later ([`BellChannel::take_bells`] again).
    /// Returns how many it took; `Ok(None)`: end of file (peer gone).
    fn take_bells(&self, n: u32) -> io::Result<Option<u32>>;
}

/// A validated view of one ring: both words and the bytes between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snap {
    /// The `prod` word.
    pub prod: u64,
    /// The `cons` word.
    pub cons: u64,
    /// Unread bytes (`prod - cons`), `0..=ring_len`.
    pub used: u32,
}

/// `BELLS == 2` is only ever set together with `WRITE_BLOCKED`.
#[inline]
fn check_bells(w: u64) -> Result<(), CursorError> {
    if bells(w) == 2 && prod_flags(w) & WRITE_BLOCKED == 0 {
        return Err(CursorError::TooManyBells { word: w });
    }
    Ok(())
}

/// How many times [`snapshot`] looks again at a `cons` that moved.
const SNAP_LOOKS: u32 = 4;

/// Loads and validates both words. `cons` is loaded first (it only grows,
/// so the view can only underestimate the room or overestimate the data
/// already read) and again after `prod`. The writer's own thread (`prod`
/// is its) and the reader's (`cons` is its) need one look; another thread
/// (a poller) may load a `cons` that the reader then moves before the
/// writer publishes past it, which would read as a peer's lie. A `cons`
/// equal at both loads was the current one when `prod` was loaded, which
/// the writer could not have published beyond; one that moved is looked
/// at again, a few times (a peer that keeps moving it is judged on the
/// last look).
#[inline]
pub fn snapshot<W: Word + ?Sized>(prod: &W, cons: &W, ring_len: u32) -> Result<Snap, CursorError> {
    let mut c = cons.load();
    let mut p = prod.load();
    for _ in 0..SNAP_LOOKS {
        let again = cons.load();
        if again == c {
            break;
        }
        c = again;
        p = prod.load();
    }
    let used = distance(p, c, ring_len)?;
    check_bells(p)?;
    Ok(Snap {
        prod: p,
        cons: c,
        used,
    })
}

/// Writer: publishes `n` bytes already copied into the ring at the producer
/// position. Returns how many doorbells the caller must now send.
pub fn publish<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
    n: u32,
) -> Result<u32, CursorError> {
    let mut w = prod.load();
    loop {
        let c = cons.load();
        let used = distance(w, c, ring_len)?;
        check_bells(w)?;
        if used as u64 + n as u64 > ring_len as u64 {
            // The caller checked the room; only a peer moving `cons`
            // backwards gets here.
            return Err(CursorError::BadDistance {
                prod: w,
                cons: c,
                ring_len,
            });
        }
        let mut new = advance(w, n, ring_len);
        let b = bells(w);
        if prod_flags(w) & WRITE_BLOCKED != 0 && b < 2 {
            new = without_prod_flags(new, WRITE_BLOCKED);
        }
        let mut ring = 0;
        let mut skipped = false;
        // The edge the reader asked for is this publish's bell, or else
        // one loose byte beyond the count (a bell is queued already).
        new = without_prod_flags(new, EDGE_WANTED);
        let polled = prod_flags(w) & POLLED != 0;
        if b == 0 {
            if polled {
                // The poller clears POLLED by CAS on this word and then
                // loads it: it sees this publish (no post-check needed).
            } else if prod_flags(w) & READER_SPINNING != 0 && used + n <= spin_cap(c) {
                skipped = true;
            } else {
                new = with_bells(new, 1);
                ring = 1;
            }
        } else if prod_flags(w) & (EDGE_WANTED | LOOSE_BELL) == EDGE_WANTED {
            new = with_prod_flags(new, LOOSE_BELL);
            ring = 1;
        }
        match prod.cas(w, new) {
            Ok(_) if skipped => return post_check(prod, cons, ring_len),
            Ok(_) => return Ok(ring),
            Err(actual) => w = actual,
        }
    }
}

/// Writer: bytes were published into the ring on its behalf without a
/// doorbell (a client's early bytes, which its server copied from the TCP
/// stream before it accepted, see `handshake::early`). Rings now, as a
/// publish would have, if the reader has not taken them all and is neither
/// spinning for them nor polling the ring. Returns how many doorbells the
/// caller must send (0 or 1).
pub fn ring_for_unread<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
) -> Result<u32, CursorError> {
    post_check(prod, cons, ring_len)
}

/// After publishing without a bell for a spinning reader: still fine only
/// if it is still spinning and everything unread fits its capacity, or a
/// poller looks at the ring; otherwise ring now.
fn post_check<W: Word + ?Sized>(prod: &W, cons: &W, ring_len: u32) -> Result<u32, CursorError> {
    loop {
        let c = cons.load();
        let w = prod.load();
        let used = distance(w, c, ring_len)?;
        check_bells(w)?;
        if prod_flags(w) & READER_SPINNING != 0 && used <= spin_cap(c) {
            return Ok(0);
        }
        if bells(w) > 0 || used == 0 || prod_flags(w) & POLLED != 0 {
            return Ok(0);
        }
        if prod.cas(w, with_bells(w, 1)).is_ok() {
            return Ok(1);
        }
    }
}

/// What a writer that needs room should do next ([`writer_block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// There is room for what it needs now.
    Room,
    /// Send `send` doorbells (possibly 0), then wait until the descriptor
    /// is writable (or hung up) and check again.
    Wait {
        /// Doorbells to send before waiting.
        send: u32,
    },
}

/// Writer: needs `need` free bytes (`1..=ring_len`) and found too few.
/// Arms `WRITE_BLOCKED` and the second doorbell so that the descriptor is
/// unwritable until the reader makes room.
pub fn writer_block<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
    need: u32,
) -> Result<Block, CursorError> {
    loop {
        let s = snapshot(prod, cons, ring_len)?;
        if ring_len - s.used >= need {
            return Ok(Block::Room);
        }
        let mut w = s.prod;
        if prod_flags(w) & WRITE_BLOCKED == 0 {
            let set = with_prod_flags(w, WRITE_BLOCKED);
            if prod.cas(w, set).is_err() {
                continue;
            }
            w = set;
        } else if bells(w) == 2 {
            // Armed earlier; the flag was set before this `cons` load.
            return Ok(Block::Wait { send: 0 });
        }
        // Dekker: the flag is set (SeqCst) before this SeqCst load.
        let c = cons.load();
        let used = distance(w, c, ring_len)?;
        if ring_len - used >= need {
            return Ok(Block::Room);
        }
        let b = bells(w);
        if prod.cas(w, with_bells(w, 2)).is_ok() {
            return Ok(Block::Wait { send: 2 - b as u32 });
        }
    }
}

/// Reader: after storing `cons` (or on finding the ring empty), takes the
/// doorbells that no longer match the ring. Returns how many the caller
/// must now receive.
pub fn reader_settle<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
) -> Result<u32, CursorError> {
    loop {
        let s = snapshot(prod, cons, ring_len)?;
        let w = s.prod;
        let mut b = bells(w);
        let mut new = w;
        let mut take = 0;
        if prod_flags(w) & LOOSE_BELL != 0 {
            new = without_prod_flags(new, LOOSE_BELL);
            take += 1;
        }
        if prod_flags(w) & WRITE_BLOCKED != 0 && s.used < ring_len {
            new = without_prod_flags(new, WRITE_BLOCKED);
            if b == 2 {
                b = 1;
                take += 1;
            }
        }
        if s.used == 0 && b == 1 && conn_state_flags(w) & CLOSING == 0 {
            b = 0;
            take += 1;
            // The next write rings anyway.
            new = without_prod_flags(new, EDGE_WANTED);
        }
        new = with_bells(new, b);
        if new == w {
            return Ok(0);
        }
        if prod.cas(w, new).is_ok() {
            return Ok(take);
        }
    }
}

/// Reader: the application is about to be told how many bytes are unread
/// (FIONREAD). Returns that count and how many doorbells the caller must
/// now receive. If a bell is queued, the next write will wake an
/// edge-triggered poller again ([`EDGE_WANTED`]): nginx, told N bytes,
/// reads N and then waits for an edge, as TCP wakes it for every arrival.
/// A loose bell queued earlier woke it before this report; it is taken.
pub fn reader_report<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
) -> Result<(u32, u32), CursorError> {
    loop {
        let s = snapshot(prod, cons, ring_len)?;
        let w = s.prod;
        let mut new = w;
        let mut take = 0;
        if prod_flags(w) & LOOSE_BELL != 0 {
            new = without_prod_flags(new, LOOSE_BELL);
            take = 1;
        }
        if bells(w) > 0 {
            new = with_prod_flags(new, EDGE_WANTED);
        }
        if new == w || prod.cas(w, new).is_ok() {
            return Ok((s.used, take));
        }
    }
}

/// Reader: consumes `n` bytes (already copied out) by storing the new
/// consumer position (spin capacity 0), then settles. Returns the
/// doorbells to receive.
pub fn reader_consume<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
    n: u32,
) -> Result<u32, CursorError> {
    let c = cons.load();
    cursor::validate_cons(c, ring_len)?;
    cons.store(cursor::cons_with_cap(advance(c, n, ring_len), 0));
    reader_settle(prod, cons, ring_len)
}

/// Reader: starts a spin session for a consuming read of up to `cap`
/// bytes, if the ring is empty with no doorbell and no closing flag.
/// Returns whether `READER_SPINNING` is now set (then call [`spin_end`]).
pub fn spin_begin<W: Word + ?Sized>(
    prod: &W,
    cons: &W,
    ring_len: u32,
    cap: usize,
) -> Result<bool, CursorError> {
    let c = cons.load();
    cursor::validate_cons(c, ring_len)?;
    let code = spin_cap_encode(cap);
    if code == 0 {
        return Ok(false);
    }
    // The capacity is visible before the flag that makes writers read it.
    cons.store(cursor::cons_with_cap(c, code));
    loop {
        let w = prod.load();
        let used = distance(w, c, ring_len)?;
        check_bells(w)?;
        if used != 0 || bells(w) != 0 || conn_state_flags(w) & CLOSING != 0 {
            return Ok(false);
        }
        if prod.cas(w, with_prod_flags(w, READER_SPINNING)).is_ok() {
            return Ok(true);
        }
    }
}

/// Reader: ends a spin session. After this no writer skips a doorbell; data
/// published during the session (without one) is consumed by the read that
/// follows, which the capacity guarantees fits.
pub fn spin_end<W: Word + ?Sized>(prod: &W, ring_len: u32) -> Result<(), CursorError> {
    loop {
        let w = prod.load();
        cursor::validate_prod(w, ring_len)?;
        if prod_flags(w) & READER_SPINNING == 0 {
            return Ok(());
        }
        if prod.cas(w, without_prod_flags(w, READER_SPINNING)).is_ok() {
            return Ok(());
        }
    }
}

/// Adds `delta` (wrapping) to a counter word; returns the old value.
fn count_add<W: Word + ?Sized>(count: &W, delta: u64) -> u64 {
    let mut v = count.load();
    loop {
        match count.cas(v, v.wrapping_add(delta)) {
            Ok(_) => return v,
            Err(a) => v = a,
        }
    }
}

/// Sets (`on`) or clears `POLLED` in a valid `prod` word.
fn set_polled<W: Word + ?Sized>(prod: &W, ring_len: u32, on: bool) -> Result<(), CursorError> {
    loop {
        let w = prod.load();
        cursor::validate_prod(w, ring_len)?;
        let new = if on {
            with_prod_flags(w, POLLED)
        } else {
            without_prod_flags(w, POLLED)
        };
        if new == w || prod.cas(w, new).is_ok() {
            return Ok(());
        }
    }
}

/// Poller (the reader's process): starts looking at the ring from user
/// space, so writers may skip the doorbell. `pollers` counts this
/// process's pollers of this ring; the first sets `POLLED`. The caller
/// must end with [`poll_end`] and then look at the ring once more.
pub fn poll_begin<W: Word + ?Sized>(
    prod: &W,
    pollers: &W,
    ring_len: u32,
) -> Result<(), CursorError> {
    if count_add(pollers, 1) == 0 {
        return set_polled(prod, ring_len, true);
    }
    Ok(())
}

/// Poller: stops looking. The last poller clears `POLLED`; then the caller
/// must look at the ring again (Dekker, as for [`spin_end`]): a publish
/// that skipped its doorbell did so by a CAS that saw the flag, so it
/// precedes the clearing CAS and that look sees it. A poller that is not
/// the last relies on the last one's look (and looks itself).
///
/// The clear may come after another poller counted itself in (it then
/// polls without the flag, so writers ring: only the saving is lost); a
/// set never comes after the last clear, since each poller sets before
/// it counts itself out.
pub fn poll_end<W: Word + ?Sized>(prod: &W, pollers: &W, ring_len: u32) -> Result<(), CursorError> {
    if count_add(pollers, u64::MAX) == 1 {
        return set_polled(prod, ring_len, false);
    }
    Ok(())
}

/// A waiter of the reader's process that will sleep in the kernel on this
/// ring (a blocking read, `poll`, another epoll set) while a poll session
/// may be open: clears `POLLED` so that writers ring again; the caller
/// then looks at the ring before it sleeps, as [`poll_end`]'s caller does.
/// The open session polls on without the saving until it ends.
pub fn poll_cancel<W: Word + ?Sized>(prod: &W, ring_len: u32) -> Result<(), CursorError> {
    set_polled(prod, ring_len, false)
}

/// Sets `conn_state_flags` bits (closing flags) in a `prod` word; works on
/// any value, even one a peer corrupted.
pub fn set_state_flags<W: Word + ?Sized>(prod: &W, flags: u8) {
    let mut w = prod.load();
    loop {
        match prod.cas(w, cursor::with_conn_state_flags(w, flags)) {
            Ok(_) => return,
            Err(a) => w = a,
        }
    }
}

// ---------------------------------------------------------------------------
// The real channel: a UNIX stream socket.

/// Sets `SO_SNDBUF` to its minimum (the kernel rounds 0 up to 4608), on
/// which the readiness table above relies.
pub fn set_min_sndbuf(fd: RawFd) -> io::Result<()> {
    let v: libc::c_int = 0;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `&v`, which
    // lives across the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `poll(2)` on one descriptor, retrying on EINTR; returns `revents`.
pub fn poll_fd(fd: RawFd, events: i16, timeout_ms: i32) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r >= 0 {
            return Ok(p.revents);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// How many times [`BellChannel::take_bells`] on a UNIX stream looks again
/// for a doorbell that is counted but not queued yet before it leaves it
/// owed.
const BELL_SPINS: u32 = 100;

/// How many times a doorbell send that found the queue full is retried
/// (with a yield) before it reports `EAGAIN`. An honest peer never fills
/// the queue, so this only keeps a broken one from making the writer spin.
const BELL_SEND_TRIES: u32 = 64;

impl BellChannel for UnixStream {
    fn send_bells(&self, n: u32) -> io::Result<()> {
        self.as_fd().send_bells(n)
    }

    fn take_bells(&self, n: u32) -> io::Result<Option<u32>> {
        self.as_fd().take_bells(n)
    }
}

/// A UNIX stream end by its descriptor (the connection's channel, whose
/// number may change).
impl BellChannel for BorrowedFd<'_> {
    fn send_bells(&self, n: u32) -> io::Result<()> {
        let fd = self.as_raw_fd();
        let mut left = n;
        let mut tries = 0;
        while left > 0 {
            // SAFETY: sends one byte from a valid static buffer.
            let r = unsafe {
                crate::chan_sys::send(
                    fd,
                    b"!".as_ptr().cast(),
                    1,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if r == 1 {
                left -= 1;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) if tries < BELL_SEND_TRIES => {
                    tries += 1;
                    std::thread::yield_now();
                }
                _ => return Err(e),
            }
        }
        Ok(())
    }

    fn take_bells(&self, n: u32) -> io::Result<Option<u32>> {
        let fd = self.as_raw_fd();
        let mut buf = [0u8; 8];
        let mut got = 0;
        let mut spins = 0;
        while got < n {
            let want = ((n - got) as usize).min(buf.len());
            // SAFETY: receives at most `want <= 8` bytes into `buf`.
            let r = unsafe {
                crate::chan_sys::recv(fd, buf.as_mut_ptr().cast(), want, libc::MSG_DONTWAIT)
            };
            if r > 0 {
                got += r as u32;
                continue;
            }
            if r == 0 {
                return Ok(None);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                // Counted, not sent yet: an honest writer sends within
                // microseconds (unless it is stopped): a short spin saves
                // the caller a spurious wake-up.
                Some(libc::EAGAIN) if spins < BELL_SPINS => {
                    spins += 1;
                    std::hint::spin_loop();
                }
                Some(libc::EAGAIN) => break,
                _ => return Err(e),
            }
        }
        Ok(Some(got))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smclo_wire::cursor::{cons_with_cap, Cursor, PEER_DONE_WRITING};
    use std::sync::atomic::AtomicU64;

    const L: u32 = smclo_wire::dmb_header::MIN_RING_LEN;

    fn words() -> (AtomicU64, AtomicU64) {
        (AtomicU64::new(0), AtomicU64::new(0))
    }

    /// A word whose loads return the values given, in turn (the last one
    /// again once they run out): another thread's stores between loads.
    struct Moving(std::cell::Cell<usize>, Vec<u64>);

    impl Word for Moving {
        fn load(&self) -> u64 {
            let i = self.0.get();
            self.0.set(i + 1);
            self.1[i.min(self.1.len() - 1)]
        }
        fn store(&self, _: u64) {}
        fn cas(&self, cur: u64, _: u64) -> Result<u64, u64> {
            Err(cur)
        }
    }

    /// A poller's snapshot of a ring whose reader moves `cons` from 0 to
    /// 100 after the poller loaded it, and whose writer then fills the ring
    /// up to 100 + L: a valid ring, full. Before, the poller judged the
    /// first `cons` against the new `prod` (`BadDistance`), and the
    /// connection was aborted as if the peer had lied.
    #[test]
    fn a_snapshot_beside_both_ends_moving_is_valid() {
        let at = |n: u32| Cursor::default().advanced(n, L).to_word();
        let cons = Moving(Default::default(), vec![at(0), at(100)]);
        let prod = Moving(Default::default(), vec![at(100 + L)]);
        let s = snapshot(&prod, &cons, L).unwrap();
        assert_eq!((s.cons, s.prod, s.used), (at(100), at(100 + L), L));
    }

    #[test]
    fn publish_rings_once_then_settle_takes_it() {
        let (p, c) = words();
        assert_eq!(publish(&p, &c, L, 10).unwrap(), 1);
        assert_eq!(publish(&p, &c, L, 10).unwrap(), 0);
        assert_eq!(bells(Word::load(&p)), 1);
        // Partial read: data left, the bell stays.
        assert_eq!(reader_consume(&p, &c, L, 5).unwrap(), 0);
        assert_eq!(reader_consume(&p, &c, L, 15).unwrap(), 1);
        assert_eq!(bells(Word::load(&p)), 0);
    }

    #[test]
    fn full_ring_arms_and_reader_disarms() {
        let (p, c) = words();
        assert_eq!(publish(&p, &c, L, L).unwrap(), 1);
        assert_eq!(writer_block(&p, &c, L, 1).unwrap(), Block::Wait { send: 1 });
        let w = Word::load(&p);
        assert_eq!(
            (bells(w), prod_flags(w) & WRITE_BLOCKED),
            (2, WRITE_BLOCKED)
        );
        assert_eq!(writer_block(&p, &c, L, 1).unwrap(), Block::Wait { send: 0 });
        assert_eq!(reader_consume(&p, &c, L, 1).unwrap(), 1);
        let w = Word::load(&p);
        assert_eq!((bells(w), prod_flags(w) & WRITE_BLOCKED), (1, 0));
        assert_eq!(writer_block(&p, &c, L, 1).unwrap(), Block::Room);
        // Needing more than there is arms again.
        assert_eq!(writer_block(&p, &c, L, 2).unwrap(), Block::Wait { send: 1 });
        // Emptying the ring takes both bells.
        assert_eq!(reader_consume(&p, &c, L, L - 1).unwrap(), 2);
        assert_eq!(bells(Word::load(&p)), 0);
    }

    #[test]
    fn spinning_reader_lets_small_writes_skip_the_bell() {
        let (p, c) = words();
        assert!(spin_begin(&p, &c, L, 100).unwrap());
        assert_eq!(publish(&p, &c, L, 60).unwrap(), 0);
        assert_eq!(publish(&p, &c, L, 40).unwrap(), 0);
        // Beyond the capacity: ring.
        assert_eq!(publish(&p, &c, L, 1).unwrap(), 1);
        spin_end(&p, L).unwrap();
        assert_eq!(reader_consume(&p, &c, L, 101).unwrap(), 1);
    }

    #[test]
    fn skip_is_repaired_when_the_reader_stopped_spinning() {
        let (p, c) = words();
        assert!(spin_begin(&p, &c, L, 100).unwrap());
        spin_end(&p, L).unwrap();
        // Stale capacity in cons, flag clear: ring.
        assert_eq!(publish(&p, &c, L, 10).unwrap(), 1);
        // post_check alone: flag set but capacity too small.
        let (p, c) = words();
        Word::store(&p, with_prod_flags(advance(0, 50, L), READER_SPINNING));
        Word::store(&c, cons_with_cap(0, 10));
        assert_eq!(post_check(&p, &c, L).unwrap(), 1);
    }

    #[test]
    fn a_report_makes_the_next_write_ring_a_loose_bell() {
        let (p, c) = words();
        // Nothing queued: no promise needed, the next write rings anyway.
        assert_eq!(reader_report(&p, &c, L).unwrap(), (0, 0));
        assert_eq!(prod_flags(Word::load(&p)) & EDGE_WANTED, 0);
        assert_eq!(publish(&p, &c, L, 10).unwrap(), 1);
        assert_eq!(reader_report(&p, &c, L).unwrap(), (10, 0));
        // One loose bell for the first write after the report, not more.
        assert_eq!(publish(&p, &c, L, 5).unwrap(), 1);
        assert_eq!(publish(&p, &c, L, 5).unwrap(), 0);
        let w = Word::load(&p);
        assert_eq!(
            (bells(w), prod_flags(w) & (EDGE_WANTED | LOOSE_BELL)),
            (1, LOOSE_BELL)
        );
        // The next report takes it and asks again.
        assert_eq!(reader_report(&p, &c, L).unwrap(), (20, 1));
        assert_eq!(
            prod_flags(Word::load(&p)) & (EDGE_WANTED | LOOSE_BELL),
            EDGE_WANTED
        );
        assert_eq!(publish(&p, &c, L, 1).unwrap(), 1);
        // A partial read takes the loose bell, keeps the counted one.
        assert_eq!(reader_consume(&p, &c, L, 1).unwrap(), 1);
        assert_eq!(bells(Word::load(&p)), 1);
        // Draining takes the bell and drops a pending request.
        assert_eq!(reader_report(&p, &c, L).unwrap(), (20, 0));
        assert_eq!(reader_consume(&p, &c, L, 20).unwrap(), 1);
        assert_eq!(prod_flags(Word::load(&p)), 0);
        // With a full ring: the loose bell next to two counted ones.
        assert_eq!(publish(&p, &c, L, L).unwrap(), 1);
        assert_eq!(reader_report(&p, &c, L).unwrap(), (L, 0));
        assert_eq!(writer_block(&p, &c, L, 1).unwrap(), Block::Wait { send: 1 });
        assert_eq!(reader_consume(&p, &c, L, 1).unwrap(), 1);
        assert_eq!(publish(&p, &c, L, 1).unwrap(), 1);
        assert_eq!(reader_consume(&p, &c, L, L).unwrap(), 2);
        assert_eq!(prod_flags(Word::load(&p)), 0);
    }

    #[test]
    fn polled_rings_skip_the_bell_until_the_last_poller_ends() {
        let (p, c) = words();
        let n = AtomicU64::new(0);
        poll_begin(&p, &n, L).unwrap();
        poll_begin(&p, &n, L).unwrap();
        // Any amount, even a full ring: the poller looks, it need not fit.
        assert_eq!(publish(&p, &c, L, L / 2).unwrap(), 0);
        poll_end(&p, &n, L).unwrap();
        assert_ne!(prod_flags(Word::load(&p)) & POLLED, 0);
        assert_eq!(publish(&p, &c, L, L / 2).unwrap(), 0);
        poll_end(&p, &n, L).unwrap();
        assert_eq!(prod_flags(Word::load(&p)) & POLLED, 0);
        assert_eq!(Word::load(&n), 0);
        // Unread data with no bell: reading some keeps none, reading all
        // takes none, and the next write rings.
        assert_eq!(reader_consume(&p, &c, L, 10).unwrap(), 0);
        assert_eq!(reader_consume(&p, &c, L, L - 10).unwrap(), 0);
        assert_eq!(bells(Word::load(&p)), 0);
        assert_eq!(publish(&p, &c, L, 1).unwrap(), 1);
        // A spinning reader's skip stays good while a poller looks, even
        // beyond the reader's capacity.
        let (p, c) = words();
        assert!(spin_begin(&p, &c, L, 4).unwrap());
        poll_begin(&p, &n, L).unwrap();
        assert_eq!(publish(&p, &c, L, 100).unwrap(), 0);
        poll_end(&p, &n, L).unwrap();
        spin_end(&p, L).unwrap();
        assert_eq!(bells(Word::load(&p)), 0);
    }

    #[test]
    fn no_spinning_on_data_bells_or_closing() {
        let (p, c) = words();
        publish(&p, &c, L, 1).unwrap();
        assert!(!spin_begin(&p, &c, L, 100).unwrap());
        let (p, c) = words();
        set_state_flags(&p, PEER_DONE_WRITING);
        assert!(!spin_begin(&p, &c, L, 100).unwrap());
        // Closing flags keep the bell: the descriptor stays readable.
        let (p, c) = words();
        publish(&p, &c, L, 1).unwrap();
        set_state_flags(&p, PEER_DONE_WRITING);
        assert_eq!(reader_consume(&p, &c, L, 1).unwrap(), 0);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let (p, c) = words();
        Word::store(
            &p,
            Cursor {
                count: L,
                ..Default::default()
            }
            .to_word(),
        );
        assert!(publish(&p, &c, L, 1).is_err());
        assert!(reader_settle(&p, &c, L).is_err());
        Word::store(&p, with_bells(0, 2)); // two bells without WRITE_BLOCKED
        assert!(snapshot(&p, &c, L).is_err());
        Word::store(&p, 0);
        Word::store(&c, advance(0, 5, L)); // consumer ahead of producer
        assert!(writer_block(&p, &c, L, 1).is_err());
        assert!(spin_begin(&p, &c, L, 9).is_err());
    }
}
