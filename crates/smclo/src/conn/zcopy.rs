//! Zero copy: [`Conn::reserve`] / [`WriteRegion::commit`] and
//! [`Conn::peek_region`] / [`ReadRegion::release`] hand out one region
//! inside the ring (contiguous thanks to the double mapping), reached by
//! copies or raw pointers only, never as a slice ([`crate::ring`]).

use super::rx::RxNext;
use super::wait::Sleep;
use super::{errno, lock, Conn, Room};
use crate::doorbell;
use crate::ring;
use smclo_wire::cursor::{
    self, conn_state_flags, PEER_CONN_ABORT, PEER_CONN_CLOSED, PEER_DONE_WRITING,
};
use smclo_wire::device_layout::end_flags;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

impl Conn {
    /// Received bytes in place (contiguous thanks to the double mapping);
    /// waits per blocking mode for at least one byte. An empty region means
    /// end of stream. [`ReadRegion::release`] consumes.
    pub fn peek_region(&self) -> io::Result<ReadRegion<'_>> {
        let mut g = lock(&self.rx);
        let mut sleep = Sleep::new(&self.rcv_timeo_us);
        let l = &self.local;
        loop {
            self.sticky()?;
            let s = self.rx_snap()?;
            let flags = conn_state_flags(s.prod);
            let pos = cursor::Cursor::from_word(s.cons).position(l.ring_len());
            let eof = (flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 || self.read_shut())
                && flags & PEER_CONN_ABORT == 0;
            if s.used > 0 || eof {
                return Ok(ReadRegion {
                    conn: self,
                    _g: g,
                    ptr: ring::ptr_at(l, pos),
                    len: s.used as usize,
                });
            }
            if flags & PEER_CONN_ABORT != 0 {
                self.record_flags(end_flags::PEER_ABORTED);
            }
            if flags & PEER_CONN_ABORT != 0 || self.peer_gone.load(Ordering::Relaxed) {
                return Err(errno(libc::ECONNRESET));
            }
            let take = doorbell::reader_settle(l.prod(), l.cons(), l.ring_len())
                .map_err(|e| self.violation("receive ring", e))?;
            self.recv_bells(take)?;
            match self.rx_next(None, false, &sleep.signals)? {
                RxNext::Retry => continue,
                RxNext::Sleep => {
                    g = self.rx_sleep(g, &mut sleep)?;
                    continue;
                }
                RxNext::NoWait => {}
            }
            if self.eof_look_due() && self.chan_eof() {
                continue;
            }
            return Err(io::ErrorKind::WouldBlock.into());
        }
    }

    /// A contiguous writable region inside the PEER's ring of at least
    /// `min` bytes (all the free space; `min` at most the ring length).
    /// Waits per blocking mode, or WouldBlock. Nothing is sent until
    /// [`WriteRegion::commit`].
    pub fn reserve(&self, min: usize) -> io::Result<WriteRegion<'_>> {
        let p = &self.peer;
        let len = p.ring_len();
        if min > len as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("reserve({min}) exceeds the {len}-byte ring"),
            ));
        }
        let need = min.max(1) as u32;
        let mut g = lock(&self.tx);
        let mut sleep = Sleep::new(&self.snd_timeo_us);
        loop {
            self.tx_allowed()?;
            let Room {
                snap: s,
                held,
                free,
            } = self.tx_room()?;
            if free >= need {
                let pos = cursor::Cursor::from_word(s.prod).position(len) + held as u64;
                p.prepare_write(pos, need as usize);
                return Ok(WriteRegion {
                    conn: self,
                    _g: g,
                    ptr: ring::ptr_at(p, pos),
                    len: free as usize,
                    used: s.used,
                });
            }
            self.publish_held(0)?;
            g = self.wait_room(g, need, false, &mut sleep)?;
        }
    }
}

/// Free space in the peer's ring, writable in place. Holds the writer lock.
///
/// The bytes are memory the peer maps, so the region is never a `&mut [u8]`
/// (see [`crate::ring`]): fill it with [`copy_from_slice`](Self::copy_from_slice),
/// or through [`as_mut_ptr`](Self::as_mut_ptr) under its contract.
///
/// ```compile_fail
/// fn fill(c: &smclo::testing::conn::Conn) {
///     let mut w = c.reserve(1).unwrap();
///     let bytes: &mut [u8] = &mut w; // no slice of the peer's memory
///     bytes[0] = 1;
/// }
/// ```
pub struct WriteRegion<'a> {
    conn: &'a Conn,
    _g: MutexGuard<'a, Vec<u8>>,
    ptr: *mut u8,
    len: usize,
    /// Published unread bytes when reserved (for corking).
    used: u32,
}

impl WriteRegion<'_> {
    /// Size of the region in bytes (all the free space).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no room (never, for a reserved region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into the region at `offset`. Panics if it does not fit
    /// (`offset + src.len() > len()`), like slice indexing.
    pub fn copy_from_slice(&mut self, offset: usize, src: &[u8]) {
        check_span(offset, src.len(), self.len);
        // SAFETY: `offset + src.len() <= len` (checked), and the region's
        // `len` bytes from `ptr` are mapped ring memory that no reference
        // covers (`ring` module docs).
        unsafe { ring::copy_to_shared(self.ptr.add(offset), src) };
    }

    /// The start of the region, for writing in place (e.g. handing it to
    /// `read(2)`), valid for [`len`](Self::len) bytes until the region is
    /// committed or dropped.
    ///
    /// Contract: the bytes are shared with the peer. Write them through raw
    /// pointers or system calls only, never through a `&mut [u8]` made from
    /// this pointer; do not read them back expecting what you wrote (a
    /// misbehaving peer may change them before [`commit`](Self::commit)).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Publishes the first `n` bytes of the region (`n <= len`).
    pub fn commit(self, n: usize) -> io::Result<()> {
        self.commit_with(n, false)
    }

    /// Commits the first `n` bytes of the region as a write with
    /// `MSG_MORE`: held until a write that is not (`splice(2)` with
    /// `SPLICE_F_MORE`, which TCP takes as `MSG_MORE`).
    pub fn commit_more(self, n: usize) -> io::Result<()> {
        self.commit_with(n, true)
    }

    fn commit_with(self, n: usize, more: bool) -> io::Result<()> {
        if n > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "commit beyond the reserved region",
            ));
        }
        if n == 0 {
            return Ok(());
        }
        // Held while corked, like a write (the region starts after them).
        self.conn.add_written(self.used, n as u32, more)
    }
}

/// Received bytes in place. Holds the reader lock.
///
/// The bytes are in the local ring below the producer cursor, which an
/// honest peer does not write until we release them; a misbehaving one can.
/// So the region is never a `&[u8]` (see [`crate::ring`]): copy out of it
/// with [`copy_to_slice`](Self::copy_to_slice), or read through
/// [`as_ptr`](Self::as_ptr) under its contract.
///
/// ```compile_fail
/// fn first(c: &smclo::testing::conn::Conn) -> u8 {
///     let r = c.peek_region().unwrap();
///     let bytes: &[u8] = &r; // no slice of memory the peer can write
///     bytes[0]
/// }
/// ```
pub struct ReadRegion<'a> {
    conn: &'a Conn,
    _g: MutexGuard<'a, ()>,
    ptr: *const u8,
    len: usize,
}

impl ReadRegion<'_> {
    /// Number of received bytes in the region (0 at end of stream).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty: end of stream.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    /// Panics if they are not all in it (`offset + dst.len() > len()`).
    pub fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) {
        check_span(offset, dst.len(), self.len);
        // SAFETY: `offset + dst.len() <= len` (checked), and the region's
        // `len` bytes from `ptr` are mapped ring memory that no reference
        // covers (`ring` module docs).
        unsafe { ring::copy_from_shared(self.ptr.add(offset), dst) };
    }

    /// The start of the received bytes, for reading in place, valid for
    /// [`len`](Self::len) bytes until the region is released or dropped.
    ///
    /// Contract: the bytes are shared with the peer. Read them through raw
    /// pointers or system calls only, never through a `&[u8]` made from
    /// this pointer, and read each byte once: a misbehaving peer can change
    /// them between two reads, so copy what you check before checking it.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Consumes the first `n` bytes (`n <= len`).
    pub fn release(self, n: usize) -> io::Result<()> {
        if n > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "release beyond the received region",
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let c = self.conn;
        let l = &c.local;
        let take = doorbell::reader_consume(l.prod(), l.cons(), l.ring_len(), n as u32)
            .map_err(|e| c.violation("receive ring", e))?;
        c.recv_bells(take)?;
        c.count_received(n);
        Ok(())
    }
}

/// Panics unless `offset .. offset + n` lies within a region of `len` bytes.
fn check_span(offset: usize, n: usize, len: usize) {
    assert!(
        offset.checked_add(n).is_some_and(|end| end <= len),
        "bytes {offset}..{offset}+{n} are outside the {len}-byte region"
    );
}
