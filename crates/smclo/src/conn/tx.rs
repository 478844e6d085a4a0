//! Sending: `send(2)` and `write` into the peer's ring, and corking
//! (`MSG_MORE`, `TCP_CORK`).
//!
//! A write copies from the caller's buffer straight into the peer's ring
//! at the producer position and publishes ([`doorbell::publish`]). In
//! [`Mode::Copy`] it first copies into a private send buffer, like the
//! kernel's copy mode; nothing stays in that buffer between calls.

use super::wait::Sleep;
use super::{errno, lock, partial, Conn, Mode, SendFlags};
use crate::clock::now_ns;
use crate::doorbell::{self, BellChannel, Block};
use crate::ring;
use smclo_wire::cursor::{self, conn_state_flags, PEER_CONN_ABORT, PEER_CONN_CLOSED};
use smclo_wire::device_layout::end_flags;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::MutexGuard;
use std::time::Duration;

impl Conn {
    /// Checks that writing is still allowed.
    pub(super) fn tx_allowed(&self) -> io::Result<()> {
        self.sticky()?;
        if self.shut_wr.load(Ordering::Relaxed) || self.closed.load(Ordering::Relaxed) {
            return Err(errno(libc::EPIPE));
        }
        // The peer's own flags (about its writing side) are in our local
        // `prod` word; closed or aborted means it reads no more.
        let w = self.local.prod().load(Ordering::SeqCst);
        if conn_state_flags(w) & PEER_CONN_ABORT != 0 {
            self.record_flags(end_flags::PEER_ABORTED);
        }
        if conn_state_flags(w) & (PEER_CONN_CLOSED | PEER_CONN_ABORT) != 0
            || self.peer_gone.load(Ordering::Relaxed)
        {
            return Err(errno(libc::EPIPE));
        }
        Ok(())
    }

    /// Whether this write, refused, is the first since the peer closed
    /// without an abort: TCP sends it, and the peer's answer is a reset, so
    /// it succeeds and only the writes after it fail (`EPIPE`, the
    /// descriptor then reporting `HUP`, and `ERR` until a call reports the
    /// reset's error). Its bytes are not written: nobody reads them, and the
    /// peer's ring may serve another connection already. A peer that died
    /// is a reset already ([`Conn::take_error`]).
    fn taken_as_reset(&self) -> bool {
        if self.sticky().is_err()
            || self.shut_wr.load(Ordering::Relaxed)
            || self.closed.load(Ordering::Relaxed)
            || self.peer_gone.load(Ordering::Relaxed)
        {
            return false;
        }
        let f = conn_state_flags(self.local.prod().load(Ordering::SeqCst));
        f & PEER_CONN_CLOSED != 0
            && f & PEER_CONN_ABORT == 0
            && !self.reset_by_peer.swap(true, Ordering::Relaxed)
    }

    /// Whether a write was taken as TCP's last before the peer's reset
    /// ([`taken_as_reset`](Self::taken_as_reset)).
    pub(super) fn reset_by_peer(&self) -> bool {
        self.reset_by_peer.load(Ordering::Relaxed)
    }

    /// Bytes written and held (corked, `MSG_MORE`), not yet published: what
    /// TCP counts as unsent (`SIOCOUTQNSD`) and, on loopback, where the
    /// peer's receive buffer acknowledges the rest at once, as unacknowledged
    /// (`SIOCOUTQ`): bytes in the peer's ring are in its receive buffer.
    pub fn unsent_len(&self) -> usize {
        self.held.load(Ordering::Relaxed) as usize
    }

    /// Writes `buf`; a blocking write returns when all of it is in the
    /// peer's ring, a non-blocking one writes what fits.
    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf, SendFlags::EMPTY)
    }

    /// `send(2)` with `MSG_DONTWAIT` and `MSG_MORE`: with `MORE`, or while
    /// corked ([`Conn::set_cork`]), the bytes go into the peer's ring but
    /// are published (and rung) only when a later write is not held, on
    /// [`Conn::flush`], when held and unread bytes reach half the ring, or
    /// when the ring is full, as the kernel's SMC corks: one wake-up and
    /// one read for a response written in pieces.
    pub fn send(&self, buf: &[u8], flags: SendFlags) -> io::Result<usize> {
        let dontwait = flags.contains(SendFlags::DONTWAIT);
        let more = flags.contains(SendFlags::MORE);
        if buf.is_empty() {
            if !more && !self.cork.load(Ordering::Relaxed) {
                self.flush()?;
            }
            return Ok(0);
        }
        let mut g = lock(&self.tx);
        let mut sleep = Sleep::new(&self.snd_timeo_us);
        let p = &self.peer;
        let len = p.ring_len();
        let mut done = 0usize;
        loop {
            let room = match self.tx_allowed().and_then(|()| self.tx_room()) {
                Ok(room) => room,
                // As much as an empty send buffer takes.
                Err(_) if done == 0 && self.taken_as_reset() => {
                    return Ok(buf.len().min(len as usize))
                }
                // A reset's error goes to the first call that asks.
                Err(e) if done == 0 && e.raw_os_error() == Some(libc::EPIPE) => {
                    return Err(self.take_error().map_or(e, errno))
                }
                Err(e) => return partial(done, e),
            };
            if room.free > 0 {
                let src = &buf[done..];
                let mut n = (room.free as usize).min(src.len());
                let pos =
                    cursor::Cursor::from_word(room.snap.prod).position(len) + room.held as u64;
                match self.mode {
                    Mode::NoCopy => ring::copy_in(p, pos, &src[..n]),
                    Mode::Copy { sndbuf_len } => {
                        n = n.min(sndbuf_len as usize);
                        let staged = staging(&mut g, n, sndbuf_len as usize);
                        staged.copy_from_slice(&src[..n]);
                        ring::copy_in(p, pos, staged);
                    }
                }
                self.add_written(room.snap.used, n as u32, more)?;
                done += n;
                if done == buf.len() {
                    return Ok(done);
                }
                continue;
            }
            // Full: what is held must reach the reader, or it never frees room.
            if let Err(e) = self.publish_held(0) {
                return partial(done, e);
            }
            g = match self.wait_room(g, 1, dontwait, &mut sleep) {
                Ok(g) => g,
                Err(e) => return partial(done, e),
            };
        }
    }

    /// Publishes what is held, once a write in progress is done (it takes
    /// the lock that write holds): with holding forbidden
    /// ([`forbid_holding`]), nothing is held after it.
    pub fn flush_waiting(&self) -> io::Result<()> {
        let _g = lock(&self.tx);
        self.publish_held(0)
    }

    /// Accounts `n` bytes just written after the held ones (the caller holds
    /// `tx`; `used` is the published unread count): held while corked and
    /// the ring is less than half full, else published with what was held.
    pub(super) fn add_written(&self, used: u32, n: u32, more: bool) -> io::Result<()> {
        self.count_sent(n);
        let held = self.held.load(Ordering::Relaxed);
        let hold = (more || self.cork.load(Ordering::Relaxed)) && HOLDING.load(Ordering::Relaxed);
        if hold && used + held + n < self.peer.ring_len() / 2 {
            if held == 0 {
                self.held_at.store(now_ns(), Ordering::Relaxed);
            }
            self.held.store(held + n, Ordering::Relaxed);
            return Ok(());
        }
        self.publish_held(n)
    }

    /// Publishes the held bytes and `n` more written after them, and rings
    /// the doorbell the protocol asks for. The caller holds `tx`.
    pub(super) fn publish_held(&self, n: u32) -> io::Result<()> {
        let total = self.held.swap(0, Ordering::Relaxed) + n;
        self.held_at.store(0, Ordering::Relaxed);
        if total == 0 {
            return Ok(());
        }
        let p = &self.peer;
        let bells = doorbell::publish(p.prod(), p.cons(), p.ring_len(), total)
            .map_err(|e| self.violation("send ring", e))?;
        self.send_bells(bells)
    }

    pub(super) fn send_bells(&self, n: u32) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        match self.chan().and_then(|c| c.borrowed().send_bells(n)) {
            Ok(()) => Ok(()),
            // The peer's end is gone: the data is in its ring, but nobody
            // will read it; the next write reports EPIPE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                Ok(())
            }
            // The data is in the peer's ring but its doorbell cannot be
            // queued: the peer broke the protocol, and no return value
            // would be true (the bytes were written, their bell is lost).
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                crate::debug!("connection aborted: peer does not take its doorbells");
                self.abort_with(libc::EPROTO);
                Err(errno(libc::EPROTO))
            }
            Err(e) => Err(e),
        }
    }

    /// Waits per blocking mode until `need` bytes are free in the peer's
    /// ring (or something changed), sleeping with the writer lock `g`
    /// released; returns it taken again. Non-blocking: arms the doorbells
    /// so the descriptor is unwritable, then WouldBlock.
    pub(super) fn wait_room<'a>(
        &'a self,
        g: MutexGuard<'a, Vec<u8>>,
        need: u32,
        dontwait: bool,
        sleep: &mut Sleep,
    ) -> io::Result<MutexGuard<'a, Vec<u8>>> {
        let p = &self.peer;
        let mut nonblocking = self.must_not_wait(dontwait)?;
        if !nonblocking && self.tx_spin(&sleep.signals) {
            return Ok(g);
        }
        // About to arm the doorbells and sleep: check the flag.
        nonblocking = nonblocking || self.nonblocking()?;
        match doorbell::writer_block(p.prod(), p.cons(), p.ring_len(), need)
            .map_err(|e| self.violation("send ring", e))?
        {
            Block::Room => Ok(g),
            Block::Wait { send } => {
                self.send_bells(send)?;
                if nonblocking {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                drop(g);
                let slept = now_ns();
                let rev = sleep.poll(self.chan()?.raw(), libc::POLLOUT)?;
                let g = lock(&self.tx);
                if rev & libc::POLLOUT != 0 {
                    let room = self.tx_snap()?.used < p.ring_len();
                    self.tx_spin.woken(room, slept);
                }
                // Our end is hung up: the peer closed or died, unless we
                // shut down both ways; tx_allowed decides.
                if rev & (libc::POLLHUP | libc::POLLERR) != 0 && !self.chan_read_shut() {
                    let s = self.tx_snap()?;
                    if s.used == p.ring_len() {
                        self.peer_gone.store(true, Ordering::Relaxed);
                    }
                }
                Ok(g)
            }
        }
    }

    /// Publishes whatever corking holds (`MSG_MORE` then nothing more, or
    /// `TCP_NODELAY` set as TCP pushes then).
    pub fn flush(&self) -> io::Result<()> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        self.flush_waiting()
    }

    /// `TCP_CORK`: while on, writes are held as with `MSG_MORE`; turning it
    /// off publishes them.
    pub fn set_cork(&self, on: bool) -> io::Result<()> {
        self.cork.store(on, Ordering::Relaxed);
        if on {
            return Ok(());
        }
        self.flush()
    }

    /// Whether `TCP_CORK` is on.
    pub fn corked(&self) -> bool {
        self.cork.load(Ordering::Relaxed)
    }

    /// Publishes held bytes written at least `age` ago; returns how long
    /// until the oldest held byte is that old, if some are held and younger
    /// (TCP's ceiling on corking: a caller that never uncorks still gets
    /// its bytes delivered, by whoever calls this on a timer).
    pub fn flush_older(&self, age: Duration) -> io::Result<Option<Duration>> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return Ok(None);
        }
        let _g = lock(&self.tx);
        let at = self.held_at.load(Ordering::Relaxed);
        if at == 0 {
            return Ok(None);
        }
        let waited = Duration::from_nanos(crate::clock::since_ns(at));
        if waited < age {
            return Ok(Some(age - waited));
        }
        self.publish_held(0).map(|()| None)
    }

    /// Whether written bytes are held (corked) now.
    pub fn holding(&self) -> bool {
        self.held.load(Ordering::Relaxed) > 0
    }
}

/// Whether writes may be held back for corking: not while the process
/// forks, where a parent and a child would each publish their own copy of
/// them ([`forbid_holding`]).
static HOLDING: AtomicBool = AtomicBool::new(true);

/// Writes are not held back for corking (`MSG_MORE`, `TCP_CORK`) until
/// [`allow_holding`]: before a fork, followed by [`Conn::flush_waiting`]
/// of each connection, so that none holds bytes when the process is
/// copied. A write that decides under its connection's lock after that
/// lock was taken for the flush sees this.
pub fn forbid_holding() {
    HOLDING.store(false, Ordering::SeqCst);
}

/// See [`forbid_holding`]: after the fork, in parent and child.
pub fn allow_holding() {
    HOLDING.store(true, Ordering::SeqCst);
}

/// The first `n` bytes of the copy-mode send buffer `buf`, grown first if
/// it is shorter: to `n` or twice its length, at most `cap` (`n <= cap`).
/// The buffer starts empty, so a connection that writes little holds
/// little and its set-up allocates nothing.
fn staging(buf: &mut Vec<u8>, n: usize, cap: usize) -> &mut [u8] {
    debug_assert!(n <= cap);
    if buf.len() < n {
        let want = n.max(2 * buf.len()).min(cap);
        buf.resize(want, 0);
    }
    &mut buf[..n]
}

#[cfg(test)]
mod tests {
    use super::staging;

    #[test]
    fn the_send_buffer_grows_with_the_writes_up_to_its_size() {
        let mut buf = Vec::new();
        assert_eq!(staging(&mut buf, 1, 1 << 18).len(), 1);
        assert_eq!(buf.len(), 1, "one byte written stages one byte");
        staging(&mut buf, 100, 1 << 18);
        assert_eq!(buf.len(), 100);
        staging(&mut buf, 150, 1 << 18);
        assert_eq!(buf.len(), 200, "doubles rather than creeping up");
        staging(&mut buf, 10, 1 << 18);
        assert_eq!(buf.len(), 200, "never shrinks");
        staging(&mut buf, 1 << 18, 1 << 18);
        assert_eq!(buf.len(), 1 << 18);
        let mut big = vec![0; 1 << 17];
        staging(&mut big, (1 << 17) + 1, 200_000);
        assert_eq!(big.len(), 200_000, "never past the send buffer's size");
    }
}
