//! The shadow of an epoll set with SMC-D members ([`Shadow`]): what the
//! `Epoll` state of its descriptor carries (`crate::table`). The waits
//! over it are `crate::hooks::epoll`'s.

use crate::critical::lock;
use crate::sock::Sock;
use libc::epoll_event;
use smclo::adapter::poller::{Few, Pace, Ready};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

/// The events a registration can ask for that the rings can answer.
pub(crate) const RING_EVENTS: u32 = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
/// Reported whether asked for or not.
pub(crate) const ALWAYS: u32 = (libc::EPOLLHUP | libc::EPOLLERR) as u32;
pub(crate) const ET: u32 = libc::EPOLLET as u32;
pub(crate) const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
pub(crate) const EXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;

/// One SMC-D registration in a set.
pub struct Member {
    pub(crate) fd: RawFd,
    /// The application's view: what it asked for (0 once deleted).
    pub(crate) events: u32,
    pub(crate) data: u64,
    /// The data of the kernel's registration, which kernel results carry.
    pub(crate) kdata: u64,
    /// Deleted by the application; the kernel's registration goes at the
    /// next sync (`crate::hooks::epoll`).
    pub(crate) gone: bool,
    /// The kernel's registration differs from the application's view.
    pub(crate) dirty: bool,
    pub(crate) sock: Arc<Sock>,
    /// `EPOLLONESHOT` fired: nothing more until `EPOLL_CTL_MOD`.
    pub(crate) disabled: bool,
    /// `EPOLLET`: the ring marks at the last report of `IN` and `OUT`.
    pub(crate) last_in: Option<u64>,
    pub(crate) last_out: Option<u64>,
}

/// What a registration for `events` asks of a connection's rings: its
/// writability only with `EPOLLOUT` (`Conn::ready_for`).
fn asked(events: u32) -> Ready {
    if events & libc::EPOLLOUT as u32 != 0 {
        Ready::OUT
    } else {
        Ready::EMPTY
    }
}

impl Member {
    /// What to report now, updating the edge and one-shot state.
    pub(crate) fn take(&mut self) -> u32 {
        if self.disabled || self.gone {
            return 0;
        }
        let r = self.sock.conn.ready_for(asked(self.events)).bits();
        let mut ev = r & (self.events & RING_EVENTS | ALWAYS);
        if ev != 0 && self.events & ET != 0 {
            ev = self.edges(ev);
        }
        if ev != 0 {
            self.fired();
        }
        ev
    }

    /// The part of `ev` that is new since the last report.
    pub(crate) fn edges(&mut self, ev: u32) -> u32 {
        let mut out = 0;
        let out_bit = libc::EPOLLOUT as u32;
        if ev & !out_bit != 0 {
            let m = self.sock.conn.rx_mark();
            if self.last_in != Some(m) {
                self.last_in = Some(m);
                out |= ev & !out_bit;
            }
        }
        if ev & out_bit != 0 {
            let m = self.sock.conn.tx_mark();
            if self.last_out != Some(m) {
                self.last_out = Some(m);
                out |= out_bit;
            }
        }
        out
    }

    /// Re-registered (`EPOLL_CTL_MOD`, or `ADD` after a delete).
    pub(crate) fn set(&mut self, ev: epoll_event) {
        self.events = ev.events;
        self.data = ev.u64;
        self.gone = false;
        self.dirty = true;
        self.disabled = false;
        self.last_in = None;
        self.last_out = None;
    }

    /// The registration fired (from the ring or the kernel).
    pub(crate) fn fired(&mut self) {
        if self.events & ONESHOT != 0 {
            self.disabled = true;
        }
    }
}

#[derive(Default)]
pub struct Set {
    pub(crate) members: Vec<Member>,
    /// Where the next scan starts, so that a small `maxevents` does not
    /// starve the members after the first ones.
    pub(crate) next: usize,
    /// The set is itself in another epoll set: never let writers skip.
    pub(crate) nested: bool,
    /// Every change goes to the kernel at once: the set is shared with
    /// another process (`fork`), whose shadow would not know of it.
    pub(crate) eager: bool,
}

/// The connections of a set's open poll session, `None` while it is
/// closed. A session opens and closes around every sleep, so its few
/// members are kept without a heap allocation.
pub(crate) type Session = Option<Few<Arc<Sock>>>;

/// A set's shadow, shared by the threads that wait on it.
// Aligned so that a pointer to it leaves four low bits for the kind of
// state it is the data of (`crate::table`).
#[derive(Default)]
#[repr(align(16))]
pub struct Shadow {
    pub(crate) set: Mutex<Set>,
    /// The connections of the open poll session (`crate::hooks::epoll`).
    pub(crate) session: Mutex<Session>,
    /// The waits' spin budget and when they last asked the kernel.
    pub(crate) pace: Pace,
}

impl Shadow {
    /// Ends the set's poll session; the caller then looks at the rings
    /// once more before it sleeps (see the core's `doorbell` module,
    /// "Pollers").
    pub(crate) fn close_session(&self) {
        let Some(socks) = lock(&self.session).take() else {
            return;
        };
        for s in socks {
            let _ = s.conn.poll_end();
        }
    }

    /// Descriptor number `fd` was closed: it is no longer a member of this
    /// set, `ep` (a closed number cannot be deleted any more).
    pub(crate) fn forget_member(&self, ep: RawFd, fd: RawFd) {
        let mut session = lock(&self.session);
        let mut set = lock(&self.set);
        for m in set.members.iter().filter(|m| m.fd == fd) {
            // Still open: what the shadow deleted leaves the kernel too.
            if m.gone && m.dirty {
                let mut e = epoll_event { events: 0, u64: 0 };
                // SAFETY: a valid event for the call's duration.
                unsafe { crate::real::epoll_ctl(ep, libc::EPOLL_CTL_DEL, m.fd, &mut e) };
            }
            leave(&mut session, &m.sock);
        }
        set.members.retain(|x| x.fd != fd);
    }
}

/// `sock` leaves the poll session `session`, if it is in it.
fn leave(session: &mut Session, sock: &Arc<Sock>) {
    if let Some(v) = session.as_mut() {
        if let Some(i) = v.iter().position(|s| Arc::ptr_eq(s, sock)) {
            let s = v.swap_remove(i);
            let _ = s.conn.poll_end();
        }
    }
}
