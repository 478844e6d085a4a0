//! The end of file of a peer that died.
//!
//! A peer that died without setting its closing flag (`kill -9`) shows only
//! as the channel's end of file. A non-blocking read that finds nothing
//! looks for it (`MSG_PEEK`) only when a wait saw the channel ready in the
//! kernel with no doorbell counted ([`Conn::kernel_ready`], which also
//! takes a hang-up as the death itself), or when neither data nor a look
//! came for [`EOF_LOOK_EVERY`]: a loop that reads until `EAGAIN` makes no
//! system call for it.

use super::Conn;
use crate::chan_sys;
use crate::clock::now_ns;
use crate::wait::Ready;
use smclo_wire::cursor::{self, conn_state_flags};
use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long after the last data read (or the last look) a read that finds
/// nothing looks for the channel's end of file (a peer that died): as often
/// as a busy wait asks the kernel about its other descriptors.
pub const EOF_LOOK_EVERY: Duration = crate::wait::KERNEL_EVERY;

impl Conn {
    /// Whether a read that found nothing and must not wait looks for the
    /// channel's end of file now ([`Conn::chan_eof`], a system call): once
    /// after a wait saw the channel ready in the kernel, and when neither
    /// data nor a look came for [`EOF_LOOK_EVERY`]. A loop that reads until
    /// `EAGAIN` right after its data never looks while requests keep
    /// coming; a busy loop looks every [`EOF_LOOK_EVERY`].
    pub(super) fn eof_look_due(&self) -> bool {
        let now = now_ns();
        let at = self.looked_at.load(Ordering::Relaxed);
        let due = self.eof_due.load(Ordering::Relaxed)
            || at == 0
            || now.saturating_sub(at) >= EOF_LOOK_EVERY.as_nanos() as u64;
        if due {
            self.eof_due.store(false, Ordering::Relaxed);
            self.looked_at.store(now, Ordering::Relaxed);
        }
        due
    }

    /// A wait saw the channel ready in the kernel (`r`, as `poll(2)`
    /// reports it). A hang-up with no closing flag set is the peer's death
    /// (an honest peer sets its flag before it shuts its end down). Being
    /// readable with no doorbell counted (nothing in the ring explains it)
    /// makes the next read that finds nothing look for end of file.
    pub fn kernel_ready(&self, r: Ready) {
        let w = self.local.prod().load(Ordering::SeqCst);
        // After our own SHUT_RDWR the UNIX end hangs up: that says
        // nothing of the peer.
        if r.intersects(Ready::HUP) && conn_state_flags(w) == 0 && !self.chan_read_shut() {
            self.peer_gone.store(true, Ordering::Relaxed);
        }
        let rung = cursor::bells(w) > 0 || cursor::prod_flags(w) & cursor::LOOSE_BELL != 0;
        if r.intersects(Ready::IN | Ready::HUP | Ready::ERR)
            && !rung
            && !self.eof_due.load(Ordering::Relaxed)
        {
            self.eof_due.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the UNIX end has reached end of file with nothing queued;
    /// then, if the peer set no closing flag before its end went away, it
    /// died: remember that.
    pub(super) fn chan_eof(&self) -> bool {
        // Our own SHUT_RDWR ended the UNIX end's reading: its end of file
        // says nothing of the peer.
        if self.chan_read_shut() {
            return false;
        }
        let mut b = [0u8; 1];
        let Ok(c) = self.chan() else {
            return false;
        };
        // SAFETY: peeks at most one byte into `b`.
        let r = unsafe {
            chan_sys::recv(
                c.raw(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if r == 0 || (r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECONNRESET))
        {
            // An honest peer sets its flag before shutting its end down, so
            // the flag is visible now if there is one.
            if conn_state_flags(self.local.prod().load(Ordering::SeqCst)) == 0 {
                self.peer_gone.store(true, Ordering::Relaxed);
            }
            return true;
        }
        false
    }
}
