//! Receiving: `recv(2)` and `read` out of the local ring, `FIONREAD`, and
//! the doorbells the reader takes.
//!
//! A read copies out of the local ring at the consumer position, stores
//! the new consumer cursor and settles the doorbells.

use super::wait::Sleep;
use super::{errno, lock, partial, Conn, RecvFlags};
use crate::doorbell::{self, BellChannel};
use crate::owner::Owner;
use crate::ring;
use crate::signal::Watch;
use smclo_wire::cursor::{
    self, conn_state_flags, PEER_CONN_ABORT, PEER_CONN_CLOSED, PEER_DONE_WRITING,
};
use smclo_wire::device_layout::end_flags;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// The longest a connection's reads wait, in all, for doorbells of data
/// they took that the writer has not sent yet ([`Conn::take_owed`]), while
/// the writer can run.
pub(super) const OWED_WAIT: Duration = Duration::from_secs(1);

/// How often, in milliseconds, that wait looks whether the writer can
/// still run.
const OWED_RECHECK_MS: i32 = 5;

/// What a reader that found nothing to read does next.
pub(super) enum RxNext {
    /// Something changed: look again.
    Retry,
    /// Sleep until the descriptor is readable.
    Sleep,
    /// The call must not wait.
    NoWait,
}

impl Conn {
    /// Reads into `buf`; honours blocking mode; 0 = end of stream (or an
    /// empty `buf`, at once, as `read(2)` of 0 bytes from a socket).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.recv(buf, RecvFlags::EMPTY)
    }

    /// `recv(2)` with `MSG_PEEK`, `MSG_WAITALL` and `MSG_DONTWAIT`. An
    /// empty `buf` gets TCP's answers: 0 once bytes are queued (or the
    /// stream ended), `WouldBlock` before that if the call must not wait,
    /// else a wait for them.
    pub fn recv(&self, buf: &mut [u8], flags: RecvFlags) -> io::Result<usize> {
        let peek = flags.contains(RecvFlags::PEEK);
        let waitall = flags.contains(RecvFlags::WAITALL);
        let dontwait = flags.contains(RecvFlags::DONTWAIT);
        let mut g = lock(&self.rx);
        let mut sleep = Sleep::new(&self.rcv_timeo_us);
        let l = &self.local;
        let len = l.ring_len();
        let mut done = 0usize;
        loop {
            if let Err(e) = self.sticky() {
                return partial(done, e);
            }
            let s = match self.rx_snap() {
                Ok(s) => s,
                Err(e) => return partial(done, e),
            };
            let flags = conn_state_flags(s.prod);
            // MSG_PEEK|MSG_WAITALL waits for the whole request (at most a
            // ring) to be there, like TCP.
            let enough = if peek && waitall {
                s.used as usize >= buf.len().clamp(1, len as usize)
            } else {
                s.used > 0
            };
            if enough || (s.used > 0 && (flags != 0 || self.peer_gone.load(Ordering::Relaxed))) {
                if buf.is_empty() {
                    return Ok(0);
                }
                let n = (s.used as usize).min(buf.len() - done);
                let pos = cursor::Cursor::from_word(s.cons).position(len);
                ring::copy_out(l, pos, &mut buf[done..done + n]);
                if peek {
                    return Ok(n);
                }
                let take = doorbell::reader_consume(l.prod(), l.cons(), len, n as u32)
                    .map_err(|e| self.violation("receive ring", e))?;
                self.recv_bells(take)?;
                self.count_received(n);
                done += n;
                if done == buf.len() {
                    return Ok(done);
                }
                // Short so far: take whatever arrived meanwhile (see below).
                continue;
            }
            // Nothing (more) to read. The peer's end of stream, if it came
            // before its reset (TCP's FIN before its RST), is what a read
            // sees; then the reset's error; then our own SHUT_RD's end.
            if flags & PEER_CONN_ABORT != 0 {
                self.record_flags(end_flags::PEER_ABORTED);
            }
            if flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 {
                return Ok(done);
            }
            if flags & PEER_CONN_ABORT != 0 || self.peer_gone.load(Ordering::Relaxed) {
                return self.after_reset(done);
            }
            if self.read_shut() {
                return Ok(done);
            }
            if done > 0 && !waitall {
                // A short read returns only here, with the ring empty: the
                // settle after the last copy found it empty too (only we
                // consume) and took the bell, so any later data rings anew
                // and wakes an edge-triggered poller. Data published while
                // we copied brings no bell of its own (one is queued); had
                // we returned short with it unread, a caller that waits for
                // the next edge after a short read (nginx does) would sleep
                // on a readable descriptor that never changes.
                return Ok(done);
            }
            if s.used == 0 {
                // A bell left over (e.g. the writer's post-check rang for
                // data we already took): take it so readiness is right.
                let take = doorbell::reader_settle(l.prod(), l.cons(), len)
                    .map_err(|e| self.violation("receive ring", e))?;
                self.recv_bells(take)?;
            }
            let cap = if peek { None } else { Some(buf.len() - done) };
            match self.rx_next(cap, dontwait, &sleep.signals)? {
                RxNext::Retry => continue,
                RxNext::Sleep => {
                    g = match self.rx_sleep(g, &mut sleep) {
                        Ok(g) => g,
                        Err(e) => return partial(done, e),
                    };
                    continue;
                }
                RxNext::NoWait => {}
            }
            if done == 0 && self.eof_look_due() && self.chan_eof() {
                // The peer's end is gone (or just closed): decide above.
                continue;
            }
            return if done > 0 {
                Ok(done)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
    }

    /// A read that found the connection reset after `done` bytes: those,
    /// else the reset's error if no call reported it yet, else end of
    /// stream (TCP's second read after a reset).
    fn after_reset(&self, done: usize) -> io::Result<usize> {
        if done > 0 {
            return Ok(done);
        }
        match self.take_error() {
            Some(e) => Err(errno(e)),
            None => Ok(0),
        }
    }

    /// Reader, nothing to read: whether it must not wait (`MSG_DONTWAIT`
    /// or non-blocking), or, after spinning (up to `cap` bytes, see
    /// [`Conn::rx_spin`]), whether something changed or it must sleep.
    pub(super) fn rx_next(
        &self,
        cap: Option<usize>,
        dontwait: bool,
        signals: &Watch,
    ) -> io::Result<RxNext> {
        if self.must_not_wait(dontwait)? {
            return Ok(RxNext::NoWait);
        }
        // Owed doorbells arriving must not make the sleep below end at once
        // and for ever: take what is there (the rest wakes it once).
        self.take_owed()?;
        self.rx_spin(cap, signals)?;
        // An event loop of this process may have the ring in its poll
        // session: the sleep below needs the writer's doorbell.
        self.poll_cancel()?;
        let s = self.rx_snap()?;
        if s.used > 0 || conn_state_flags(s.prod) != 0 {
            return Ok(RxNext::Retry);
        }
        if self.nonblocking()? {
            return Ok(RxNext::NoWait);
        }
        Ok(RxNext::Sleep)
    }

    /// Reader: sleeps until the descriptor is readable, with the reader
    /// lock released; returns it taken again.
    pub(super) fn rx_sleep<'a>(
        &'a self,
        g: MutexGuard<'a, ()>,
        sleep: &mut Sleep,
    ) -> io::Result<MutexGuard<'a, ()>> {
        drop(g);
        let slept = crate::clock::now_ns();
        let rev = sleep.poll(self.chan()?.raw(), libc::POLLIN)?;
        let g = lock(&self.rx);
        if rev & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            let s = self.rx_snap()?;
            self.rx_spin.woken(s.used > 0, slept);
            if s.used == 0 && cursor::bells(s.prod) == 0 && conn_state_flags(s.prod) == 0 {
                // Readable with no bell counted: end of file (peer gone),
                // an owed bell that arrived (the next look takes it), or a
                // bell the writer is just now counting.
                if !self.chan_eof() {
                    std::thread::yield_now();
                }
            }
        }
        Ok(g)
    }

    /// Unread bytes in the local ring (`FIONREAD`). Like TCP, data that
    /// arrives after this wakes an edge-triggered poller even though the
    /// descriptor was readable already ([`doorbell::reader_report`]).
    pub fn readable_len(&self) -> io::Result<usize> {
        self.sticky()?;
        let l = &self.local;
        let (used, take) = doorbell::reader_report(l.prod(), l.cons(), l.ring_len())
            .map_err(|e| self.violation("receive ring", e))?;
        self.recv_bells(take)?;
        Ok(used as usize)
    }

    /// Receives `n` doorbells the reader un-counted, and any owed before.
    pub(super) fn recv_bells(&self, n: u32) -> io::Result<()> {
        if n > 0 {
            self.rx_owed.fetch_add(n, Ordering::Relaxed);
        }
        self.take_owed()
    }

    /// Takes the owed doorbells. One that the writer counted and has not
    /// sent yet (it is between its CAS and its send, perhaps preempted
    /// there) is waited for while the writer can still send it: sent after
    /// this call returned, it would make the descriptor readable with
    /// nothing to read, which a TCP socket never is (a level-triggered
    /// poller then reads and gets EAGAIN, which wrk counts as an error and
    /// answers by closing the connection). A writer that is neither
    /// running nor waiting for a CPU (stopped, frozen, asleep) may stay so
    /// for good: what it sent before it stopped running is taken, the rest
    /// stays owed and a later call takes it.
    ///
    /// The waits that end without the doorbell add up to [`OWED_WAIT`] at
    /// most over the connection's life: a writer that counts doorbells and
    /// never sends them (a broken or hostile peer, which keeps a thread
    /// runnable) holds up the connection's calls, a non-blocking one too,
    /// for that long once, not at every call. A wait that got its doorbell
    /// (an honest writer, preempted between its count and its send) costs
    /// the budget nothing.
    fn take_owed(&self) -> io::Result<()> {
        if self.rx_owed.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let waited = Duration::from_nanos(self.owed_waited_ns.load(Ordering::Relaxed));
        let Some(budget) = OWED_WAIT.checked_sub(waited).filter(|b| !b.is_zero()) else {
            return self.take_queued_owed().map(drop);
        };
        let mut since = None;
        let r = self.wait_owed(budget, &mut since);
        let missed = self.rx_owed.load(Ordering::Relaxed) > 0;
        if let (Some(t0), true) = (since, missed) {
            let ns = t0.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            self.owed_waited_ns.fetch_add(ns, Ordering::Relaxed);
        }
        r
    }

    /// [`take_owed`](Self::take_owed)'s wait, for at most `budget`; `since`
    /// is when it started waiting, if it did.
    fn wait_owed(&self, budget: Duration, since: &mut Option<Instant>) -> io::Result<()> {
        while self.take_queued_owed()? > 0 {
            let t0 = *since.get_or_insert_with(Instant::now);
            if t0.elapsed() >= budget {
                break;
            }
            if !self.writer_runnable() {
                // It may have sent the doorbell and gone to sleep since
                // the look at the queue.
                self.take_queued_owed()?;
                break;
            }
            doorbell::poll_fd(self.chan()?.raw(), libc::POLLIN, OWED_RECHECK_MS)?;
        }
        Ok(())
    }

    /// Takes the owed doorbells that are queued by now; returns how many
    /// stay owed.
    fn take_queued_owed(&self) -> io::Result<u32> {
        if self.rx_owed.load(Ordering::Relaxed) == 0 {
            return Ok(0);
        }
        // Claimed whole, so two threads never take the same doorbell.
        let n = self.rx_owed.swap(0, Ordering::Relaxed);
        let got = match self.chan().and_then(|c| c.borrowed().take_bells(n)) {
            Ok(Some(k)) => k,
            // Our own SHUT_RDWR ended the channel's reading: no bell comes.
            Ok(None) if self.chan_read_shut() => n,
            Ok(None) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                n
            }
            Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                n
            }
            Err(e) => {
                self.rx_owed.fetch_add(n, Ordering::Relaxed);
                return Err(e);
            }
        };
        self.rx_owed.fetch_add(n - got, Ordering::Relaxed);
        Ok(n - got)
    }

    /// Whether the process that writes into our ring (the owner of the
    /// peer's DMB) has a thread running or waiting for a CPU. Our own
    /// process is not judged: the calling thread is running whether or not
    /// another of ours is the writer (outside tests a peer is never this
    /// process: self-connects stay TCP). Nor is a peer of another pid
    /// namespace: its pid names another process here, whose start time
    /// differs.
    fn writer_runnable(&self) -> bool {
        let w = Owner::local(self.peer.owner_pid(), self.peer.owner_start());
        w.pid != Owner::current().pid && w.has_runnable_thread()
    }
}
