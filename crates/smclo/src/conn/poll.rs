//! What an event loop asks of a connection ([`crate::poller`]): its
//! readiness as the rings tell it, and the `POLLED` session that lets the
//! peer's writes skip their doorbell while someone looks at the ring.

use super::Conn;
use crate::doorbell;
use crate::wait::Ready;
use smclo_wire::cursor::{
    self, conn_state_flags, PEER_CONN_ABORT, PEER_CONN_CLOSED, PEER_DONE_WRITING,
};
use std::io;
use std::sync::atomic::Ordering;

impl Conn {
    /// Readiness from the rings, as `poll(2)` reports a TCP socket: `IN`
    /// with unread data or after the peer's end of stream (with `RDHUP`),
    /// `HUP` too after a reset or the peer's death, with `ERR` until a call
    /// reported the reset's error ([`Conn::take_error`]; always after an
    /// error of this end); `OUT` when a write would not wait (room in the peer's
    /// ring beyond what corking holds, or a write would fail at once).
    pub fn ready(&self) -> Ready {
        self.ready_for(Ready::OUT)
    }

    /// [`ready`](Self::ready) for a caller that asks about writing only
    /// if `asked` has `OUT`: without it the peer's ring, whose consumer
    /// cursor the peer writes at every read, is not looked at (a client
    /// waiting for its answers on many connections paid a cache miss per
    /// connection per wait for it). `IN`, `RDHUP`, `HUP` and `ERR` are
    /// what `ready` reports; an error that only the peer's ring shows is
    /// reported when writing is asked about, or by the write.
    pub fn ready_for(&self, asked: Ready) -> Ready {
        if self.sticky().is_err() {
            return Ready::IN | Ready::OUT | Ready::RDHUP | Ready::HUP | Ready::ERR;
        }
        let mut r = Ready::EMPTY;
        match self.rx_snap() {
            Ok(s) => {
                let flags = conn_state_flags(s.prod);
                if s.used > 0 {
                    r = r | Ready::IN;
                }
                // Both directions shut (the peer's end of stream or our
                // SHUT_RD, and our SHUT_WR) is TCP's POLLHUP.
                let read_end =
                    flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 || self.read_shut();
                if read_end {
                    r = r | Ready::IN | Ready::RDHUP;
                }
                if read_end && self.shut_wr.load(Ordering::Relaxed) {
                    r = r | Ready::HUP;
                }
                if flags & PEER_CONN_ABORT != 0
                    || self.peer_gone.load(Ordering::Relaxed)
                    || self.reset_by_peer()
                {
                    r = r | Ready::IN | Ready::RDHUP | Ready::HUP;
                    // `ERR` is TCP's socket error: gone once a call
                    // reported it.
                    if self.error_pending() {
                        r = r | Ready::ERR;
                    }
                }
            }
            Err(_) => return Ready::IN | Ready::OUT | Ready::RDHUP | Ready::HUP | Ready::ERR,
        }
        if !asked.intersects(Ready::OUT) {
            return r;
        }
        if self.tx_allowed().is_err() {
            return r | Ready::OUT;
        }
        // Not `tx_room`: the writer may hold bytes it wrote into room that
        // this thread's older look does not see yet, which is no violation.
        let held = u64::from(self.held.load(Ordering::Relaxed));
        match self.tx_snap() {
            Ok(s) if u64::from(s.used) + held < u64::from(self.peer.ring_len()) => r | Ready::OUT,
            Ok(_) => r,
            Err(_) => r | Ready::OUT | Ready::HUP | Ready::ERR,
        }
    }

    /// Changes whenever data or a closing flag arrives, or the peer is
    /// found dead (position and flags of the local `prod` word, without
    /// the doorbell state, and `peer_gone`): an
    /// edge-triggered poller reports `IN` again only after it changed.
    pub fn rx_mark(&self) -> u64 {
        let w = self.local.prod().load(Ordering::SeqCst);
        // The peer's death is a change too; bit 48 is a doorbell flag,
        // never part of the mark otherwise.
        let gone = self.peer_gone.load(Ordering::Relaxed) as u64;
        // So are this end's shutdowns (bits 49 and 50, doorbell flags too).
        let shut = self.read_shut() as u64 | (self.shut_wr.load(Ordering::Relaxed) as u64) << 1;
        w & (cursor::POSITION_MASK | 0xFF << 56) | gone << 48 | shut << 49
    }

    /// Changes whenever the peer makes room (its consumer position): an
    /// edge-triggered poller reports `OUT` again only after it changed.
    pub fn tx_mark(&self) -> u64 {
        self.peer.cons().load(Ordering::SeqCst) & cursor::POSITION_MASK
    }

    /// Starts a poll session on the receive ring ([`doorbell::poll_begin`]):
    /// until [`Conn::poll_end`], the peer's writes may skip the doorbell.
    pub fn poll_begin(&self) -> io::Result<()> {
        let l = &self.local;
        doorbell::poll_begin(l.prod(), &self.pollers, l.ring_len())
            .map_err(|e| self.violation("receive ring", e))
    }

    /// Before this process sleeps in the kernel on the receive ring other
    /// than through its own poll session: writers ring again
    /// ([`doorbell::poll_cancel`]); the caller looks at the ring after.
    pub fn poll_cancel(&self) -> io::Result<()> {
        let l = &self.local;
        if cursor::prod_flags(l.prod().load(Ordering::SeqCst)) & cursor::POLLED == 0 {
            return Ok(());
        }
        doorbell::poll_cancel(l.prod(), l.ring_len()).map_err(|e| self.violation("receive ring", e))
    }

    /// Ends a poll session ([`doorbell::poll_end`]); the caller must then
    /// look at [`Conn::ready`] once more before it sleeps.
    pub fn poll_end(&self) -> io::Result<()> {
        let l = &self.local;
        doorbell::poll_end(l.prod(), &self.pollers, l.ring_len())
            .map_err(|e| self.violation("receive ring", e))
    }
}
