//! Closing and aborting, with SMC's semantics, and the error an abort
//! leaves for the calls that follow.
//!
//! - [`Conn::shutdown_write`]: `PEER_DONE_WRITING` in the peer's `prod`
//!   word, then `shutdown(SHUT_WR)`: the peer reads what was written, then 0.
//! - [`Conn::shutdown_read`]: local, as TCP's: reads return what is
//!   queued, then 0, and never wait. [`Conn::shutdown_both`] also shuts
//!   the UNIX end's reading, which wakes every wait of this end.
//! - [`Conn::close`] (and drop): `PEER_CONN_CLOSED`, or `PEER_CONN_ABORT`
//!   when unread data remains in the local ring (the peer gets
//!   `ECONNRESET`, like a TCP RST), then the UNIX end is shut down and
//!   closed.
//! - Reading: data first; then 0 after done-writing/closed, `ECONNRESET`
//!   after abort or when the UNIX end hit end of file with no flag (the
//!   peer died). Writing after the peer closed or died: the first write
//!   succeeds, as TCP's that the peer answers with a reset, unless the
//!   peer aborted (or died with bytes unread), then `ECONNRESET`, then
//!   `EPIPE` (never a SIGPIPE: every send uses `MSG_NOSIGNAL`).
//! - The reset's error is TCP's socket error ([`Conn::take_error`]): the
//!   first call that asks (`SO_ERROR`, a read, a write) reports it, and it
//!   is gone for the calls after it (reads return 0, writes `EPIPE`, polls
//!   no longer show `ERR`). A peer that died is a reset whatever it had
//!   read: its held bytes (`MSG_MORE`, `TCP_CORK`) were never published,
//!   so an end of stream could hide their loss. An error of this end's own
//!   (`sticky`) stays.

use super::{errno, Conn};
use crate::chan_sys;
use crate::doorbell;
use smclo_wire::cursor::{
    conn_state_flags, CursorError, PEER_CONN_ABORT, PEER_CONN_CLOSED, PEER_DONE_WRITING,
};
use smclo_wire::device_layout::end_flags;
use std::io;
use std::sync::atomic::Ordering;

impl Conn {
    /// SHUT_WR: the peer reads what was written, then end of stream.
    pub fn shutdown_write(&self) -> io::Result<()> {
        self.sticky()?;
        if self.shut_wr.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        // Held bytes come before the end of stream.
        self.flush()?;
        // Recorded before the peer can see it, so that `smclo ss` never
        // shows the peer's reaction without our step.
        let peer_closing = conn_state_flags(self.local.prod().load(Ordering::Acquire)) != 0;
        self.record_flags(if peer_closing {
            end_flags::SHUT_WR | end_flags::SHUT_WR_PASSIVE
        } else {
            end_flags::SHUT_WR
        });
        doorbell::set_state_flags(self.peer.prod(), PEER_DONE_WRITING);
        // The peer's descriptor becomes readable for good (end of file on
        // the channel), so it wakes and finds the flag.
        if chan_sys::shutdown(self.chan()?.raw(), libc::SHUT_WR) < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// SHUT_RD: reads return what is queued, then end of stream, without
    /// waiting; the descriptor is readable (`IN`, `RDHUP`) from now on. The
    /// peer may go on writing, as to TCP's. A thread already asleep in a
    /// read of this end is not woken: the channel's own `shutdown` would
    /// wake it, but would also make the peer's doorbells fail, which reads
    /// as its death on both ends ([`shutdown_both`](Self::shutdown_both)
    /// does it, where that is TCP's outcome).
    pub fn shutdown_read(&self) -> io::Result<()> {
        self.sticky()?;
        self.shut_rd.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// SHUT_RDWR: [`shutdown_write`](Self::shutdown_write) and
    /// [`shutdown_read`](Self::shutdown_read), then the channel's own
    /// `shutdown(SHUT_RD)`, which wakes every wait on this end, in every
    /// thread and process, as TCP's wakes its sleepers. The peer's
    /// doorbells fail from then on: its next write is its last, as TCP's
    /// that this end answers with a reset.
    pub fn shutdown_both(&self) -> io::Result<()> {
        self.shutdown_read()?;
        self.shutdown_write()?;
        if self.chan_rd_shut.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        if chan_sys::shutdown(self.chan()?.raw(), libc::SHUT_RD) < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether this end shut the channel's reading ([`shutdown_both`](Self::shutdown_both)):
    /// its end of file is ours then, not the peer's.
    pub(super) fn chan_read_shut(&self) -> bool {
        self.chan_rd_shut.load(Ordering::Relaxed)
    }

    /// Whether [`shutdown_read`](Self::shutdown_read) was called here.
    pub fn read_shut(&self) -> bool {
        self.shut_rd.load(Ordering::Relaxed)
    }

    /// Closes: `PEER_CONN_CLOSED`, or `PEER_CONN_ABORT` if unread data
    /// remains in the local ring (the peer then sees ECONNRESET).
    pub fn close(self) -> io::Result<()> {
        self.close_inner();
        Ok(())
    }

    fn close_inner(&self) {
        if self.closed.swap(true, Ordering::Relaxed) || self.passed.load(Ordering::Relaxed) {
            return;
        }
        // An orderly close delivers what corking held; an error here means
        // the connection is broken already and the flag below tells so.
        let _ = self.flush();
        let l = &self.local;
        let unread = match doorbell::snapshot(l.prod(), l.cons(), l.ring_len()) {
            Ok(s) => s.used > 0,
            Err(_) => true,
        };
        let (flag, record) = if unread {
            (PEER_CONN_ABORT, end_flags::ABORTED)
        } else {
            (PEER_CONN_CLOSED, end_flags::CLOSED)
        };
        self.record_flags(record);
        doorbell::set_state_flags(self.peer.prod(), flag);
        // The peer's end hangs up even if a forked child still holds a copy
        // of ours.
        if let Ok(c) = self.chan() {
            chan_sys::shutdown(c.raw(), libc::SHUT_RDWR);
        }
    }

    /// Whether this process closed the connection ([`Conn::close`],
    /// [`Conn::close_shared`]).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// [`Conn::close`] through a shared reference, for a caller that cannot
    /// take the `Conn` back while other threads may still hold it (the
    /// preload closes the last descriptor of a connection this way): sets
    /// `PEER_CONN_CLOSED` (or `PEER_CONN_ABORT`) and shuts the channel down
    /// now; drop later only unmaps and closes the descriptor.
    pub fn close_shared(&self) {
        self.close_inner();
    }

    /// Gives up this process's share of the connection without telling the
    /// peer: another process that inherited it through `fork` still uses it.
    /// Drop then unmaps and closes the descriptor and sets no flag.
    pub fn disown(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Immediate abort (like `SO_LINGER` 0): the peer sees ECONNRESET; this
    /// end's later calls fail with ECONNABORTED.
    pub fn abort(&self) {
        crate::debug!("connection aborted locally");
        self.abort_silently();
    }

    /// [`Conn::abort`] without the debug line: async-signal-safe (atomics
    /// and `shutdown`), for a process that exits from a signal handler.
    pub fn abort_silently(&self) {
        self.abort_with(libc::ECONNABORTED);
    }

    /// The error a reset left, if no call reported it yet, and reports it:
    /// `ECONNRESET` after the peer aborted or died, `EPIPE` after a reset
    /// that followed the peer's end of stream (its `SHUT_WR` or close, or
    /// the reset that answered the first write to a closed peer: TCP's
    /// error in CLOSE_WAIT). TCP reports its socket error once, to
    /// whichever call asks first (`SO_ERROR`, a read, a write), and clears
    /// it. An error of this end's own (a local abort, a protocol
    /// violation, a lost mapping) is not a reset's: it stays, every call
    /// and `SO_ERROR` report it, and polls show `ERR`.
    pub fn take_error(&self) -> Option<i32> {
        if let Err(e) = self.sticky() {
            return e.raw_os_error();
        }
        let e = self.reset_error()?;
        (!self.reset_reported.swap(true, Ordering::Relaxed)).then_some(e)
    }

    /// Whether the connection ended in an abort or a reset (this end's or
    /// the peer's), reported to a call yet or not.
    pub fn ended_in_reset(&self) -> bool {
        self.sticky().is_err() || self.reset_error().is_some()
    }

    /// Whether a reset left an error that no call reported yet.
    pub(super) fn error_pending(&self) -> bool {
        self.reset_error().is_some() && !self.reset_reported.load(Ordering::Relaxed)
    }

    fn reset_error(&self) -> Option<i32> {
        let f = conn_state_flags(self.local.prod().load(Ordering::SeqCst));
        if f & PEER_CONN_ABORT != 0 {
            // After the peer's end of stream (TCP's CLOSE_WAIT), a reset's
            // error is EPIPE.
            Some(if f & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 {
                libc::EPIPE
            } else {
                libc::ECONNRESET
            })
        } else if self.reset_by_peer() {
            // The peer's end of stream came first (TCP's CLOSE_WAIT).
            Some(libc::EPIPE)
        } else if self.peer_gone.load(Ordering::Relaxed) {
            Some(libc::ECONNRESET)
        } else {
            None
        }
    }

    pub(super) fn sticky(&self) -> io::Result<()> {
        if crate::fault::any_lost() {
            self.reset_if_lost();
        }
        match self.err.load(Ordering::Relaxed) {
            0 => Ok(()),
            e => Err(errno(e)),
        }
    }

    /// Resets the connection (`ECONNRESET`, as a TCP RST) if this process
    /// lost the mapping of one of its DMBs or of its device: another
    /// process shrank the file under it ([`crate::fault`]).
    fn reset_if_lost(&self) {
        let what = if self.local.lost() {
            "its receive DMB"
        } else if self.peer.lost() {
            "the peer's DMB"
        } else if self.record.as_ref().is_some_and(|r| r.device_lost()) {
            "the device file"
        } else {
            return;
        };
        if self.err.load(Ordering::Relaxed) == 0 {
            crate::debug!(
                "connection reset: {what} was truncated or could not be paged in (another process of the device's users shrank it or punched a hole in it on a full filesystem)"
            );
            self.abort_with(libc::ECONNRESET);
        }
    }

    /// The peer broke the protocol: abort and report EPROTO.
    pub(super) fn violation(&self, what: &str, e: CursorError) -> io::Error {
        crate::debug!("connection aborted: peer protocol violation ({what}): {e}");
        self.abort_with(libc::EPROTO);
        errno(libc::EPROTO)
    }

    pub(super) fn abort_with(&self, err: i32) {
        let _ = self
            .err
            .compare_exchange(0, err, Ordering::Relaxed, Ordering::Relaxed);
        self.record_flags(end_flags::ABORTED);
        doorbell::set_state_flags(self.peer.prod(), PEER_CONN_ABORT);
        // The peer's end becomes readable and hung up, our blocked callers
        // wake.
        if let Ok(c) = self.chan() {
            chan_sys::shutdown(c.raw(), libc::SHUT_RDWR);
        }
        self.closed.store(true, Ordering::Relaxed);
    }
}

impl Drop for Conn {
    /// Dropping without `close` closes; then the channel's descriptor goes.
    fn drop(&mut self) {
        self.close_inner();
        if *self.passed.get_mut() {
            self.local.mark_shared();
            self.peer.mark_shared();
        }
        self.close_channel();
        self.close_retired();
    }
}
