//! The descriptor state: what the hooks remember about descriptors
//! besides the table. One record per number ([`FdState`]: whether the
//! device lists it as a listener or a fallback, shared by its `dup`s, and
//! a not-yet-connected TCP socket's epoll registrations, which the swap
//! moves to the channel), and the undecided handshakes (`hooks::pending`
//! drives them, out of their map while it looks). The records and the
//! handshakes' ids are only touched with the table's lock held for
//! writing, so a closed or reused descriptor number is forgotten here
//! ([`forget_fd_locked`]) in the same step as in the table. The flags
//! that mirror the state for the lock-free checks ([`F_CANDIDATE`],
//! [`F_PENDING`], [`F_EARLY`], [`F_LISTENER`], [`F_FALLBACK`]) are set and
//! cleared here only (and by the table, whose entry replaces a candidate).
//! This file calls no interposed function's code: the entry points use
//! it, never the other way round.

use super::{errno, in_table_range, lock, set_errno, Ctx};
use crate::holders;
use crate::real;
use crate::table::{
    self, F_ANNOUNCED, F_CANDIDATE, F_EARLY, F_FALLBACK, F_LISTENER, F_PENDING, F_PLAIN, F_TCP,
    LOCK,
};
use libc::c_int;
use smclo::adapter::fallbacks::{self, FallbackRecord};
use smclo::adapter::handshake;
use smclo::adapter::registry::ListenerGuard;
use smclo::debug;
use smclo::device::Role;
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What the hooks keep for one descriptor number beside its table entry
/// and its flags, which mirror it for the lock-free checks: a listing
/// with [`F_LISTENER`] or [`F_FALLBACK`], registrations with
/// [`F_CANDIDATE`] (dropped when the candidacy ends: [`end_candidacy`],
/// [`take_epoll_locked`], [`listening_locked`]), so that a number with a
/// record closes through [`forget_fd_locked`], which drops it whole. Only
/// touched with [`LOCK`] held for writing (so never held across fork).
#[derive(Default)]
pub(super) struct FdState {
    /// What the device lists it as, shared by its `dup`s.
    listed: Option<Listed>,
    /// Its epoll registrations as a candidate (the set, the program's
    /// event), in the order made: the swap moves them to the channel.
    epoll: Vec<(RawFd, libc::epoll_event)>,
    /// The undecided handshake it holds, by id ([`Undecided::id`]). A
    /// handshake being driven is out of [`PENDING`]; meanwhile another
    /// thread may close its number and connect a new socket at it, so the
    /// driver finishes (or puts back) only the one whose id is still
    /// here.
    pending_id: Option<u64>,
}

impl FdState {
    /// Whether nothing is kept: the record can go.
    fn is_empty(&self) -> bool {
        self.listed.is_none() && self.epoll.is_empty() && self.pending_id.is_none()
    }
}

/// A descriptor the device lists: the listing lasts until the last of its
/// `dup`s is closed (each holds a reference, dropped with its record; the
/// last drop unregisters or unlists).
#[derive(Clone)]
#[allow(dead_code)]
enum Listed {
    /// A listening TCP socket registered in the device.
    Listener(Arc<ListenerGuard>),
    /// A TCP connection that fell back, in the fallback table (`smclo ss
    /// -a`).
    Fallback(Arc<FallbackRecord>),
}

impl Listed {
    /// The flag that mirrors it.
    fn flag(&self) -> u16 {
        match self {
            Listed::Listener(_) => F_LISTENER,
            Listed::Fallback(_) => F_FALLBACK,
        }
    }
}

/// The records by descriptor number (see [`FdState`]).
static STATES: Mutex<Option<HashMap<RawFd, FdState>>> = Mutex::new(None);

/// `f` applied to the record of `fd`, made if there is none. With the
/// table's lock held for writing.
fn with_state_locked<R>(fd: RawFd, f: impl FnOnce(&mut FdState) -> R) -> R {
    f(lock(&STATES)
        .get_or_insert_with(HashMap::new)
        .entry(fd)
        .or_default())
}

/// `fd` listens, registered in the device by `guard` (until its last
/// `dup` is closed): it is no candidate any more. With the table's lock
/// held for writing.
pub(super) fn listening_locked(fd: RawFd, guard: ListenerGuard) {
    with_state_locked(fd, |s| {
        s.listed = Some(Listed::Listener(Arc::new(guard)));
        s.epoll.clear();
    });
    table::set_flag(fd, F_CANDIDATE, false);
    table::set_flag(fd, F_LISTENER, true);
}

/// Makes `new`, a duplicate of `old`, share `old`'s listener registration
/// or fallback listing.
pub(super) fn share_records_locked(old: RawFd, new: RawFd) {
    if !in_table_range(new) || !table::has_flag(old, F_LISTENER | F_FALLBACK) {
        return;
    }
    let listed = lock(&STATES)
        .as_ref()
        .and_then(|m| m.get(&old)?.listed.clone())
        .filter(|l| table::has_flag(old, l.flag()));
    if let Some(l) = listed {
        let flag = l.flag();
        with_state_locked(new, |s| s.listed = Some(l));
        table::set_flag(new, flag, true);
    }
}

/// Before an exec: listener registrations and fallback listings stay with
/// this image (the new one registers the listeners it inherits again,
/// `hooks::setup`, and could not unlist the fallbacks when it closes
/// them).
pub(super) fn unlist_all() {
    let _g = LOCK.write();
    if let Some(m) = lock(&STATES).as_mut() {
        m.values_mut().for_each(|s| s.listed = None);
    }
}

/// Records the program's epoll registration of candidate `fd` in set `ep`
/// (`event`; `None`: deleted), made with the kernel just now, unless `fd`
/// stopped being a candidate meanwhile. With the table's lock held for
/// writing.
pub(super) fn record_epoll_locked(fd: RawFd, ep: RawFd, event: Option<libc::epoll_event>) {
    if !table::has_flag(fd, F_CANDIDATE) {
        return;
    }
    with_state_locked(fd, |s| {
        s.epoll.retain(|(p, _)| *p != ep);
        s.epoll.extend(event.map(|e| (ep, e)));
    });
}

/// Takes the epoll registrations recorded for `fd` (the swap moves them;
/// a connection that stays TCP drops them). With the table's lock held
/// for writing.
pub(super) fn take_epoll_locked(fd: RawFd) -> Vec<(RawFd, libc::epoll_event)> {
    let mut states = lock(&STATES);
    let Some(m) = states.as_mut() else {
        return Vec::new();
    };
    let Some(s) = m.get_mut(&fd) else {
        return Vec::new();
    };
    let regs = std::mem::take(&mut s.epoll);
    if s.is_empty() {
        m.remove(&fd);
    }
    regs
}

/// `fd` is no candidate any more, and no swap took its registrations (its
/// connect stays TCP): they go, so that none of them moves to a later
/// connection at its number.
pub(super) fn end_candidacy(fd: RawFd) {
    let _g = LOCK.write();
    table::set_flag(fd, F_CANDIDATE, false);
    drop(take_epoll_locked(fd));
}

/// `fd` was made by the program's `socket()` just now: a TCP stream is a
/// candidate (its registrations are recorded until it connects) known to
/// be TCP ([`F_TCP`]); anything else is known to be no listener
/// ([`F_PLAIN`]).
pub(super) fn made(fd: RawFd, tcp: bool) {
    let f = if tcp { F_CANDIDATE | F_TCP } else { F_PLAIN };
    table::set_flag(fd, f, true);
}

/// `fd` is now its connection's channel (the swap installed it): no
/// candidate, no pending handshake. With the table's lock held for
/// writing, in the same step as the table entry, so that a registration
/// made after it is not taken for a pending connect's ([`kernel_event`]).
pub(super) fn swapped_locked(fd: RawFd) {
    table::set_flag(fd, F_CANDIDATE | F_PENDING | F_EARLY | F_ANNOUNCED, false);
}

/// The swap of `fd` failed (both ends reset): it stays the TCP socket, no
/// longer pending. With the table's lock held for writing.
pub(super) fn swap_failed_locked(fd: RawFd) {
    table::set_flag(fd, F_PENDING | F_EARLY | F_ANNOUNCED, false);
}

/// The handshake of `fd` decided TCP (or its TCP connection failed): its
/// registrations report writability again (an edge-triggered one too: the
/// kernel looks again at a MOD, also where writability was not hidden, an
/// early connect's) and are no longer recorded; no candidate, nothing
/// pending. With the table's lock held for writing.
pub(super) fn stays_tcp_locked(fd: RawFd) {
    hide_out_locked(fd, false);
    drop(take_epoll_locked(fd));
    table::set_flag(fd, F_CANDIDATE | F_PENDING | F_EARLY | F_ANNOUNCED, false);
}

/// A non-blocking call on `fd`, an early connect's socket, cannot go on
/// before the decision: from now on its writability is hidden as a
/// non-blocking connect's, so that a poller waits for the decision (which
/// gives it back, with an edge) instead of finding the socket writable
/// and failing again.
pub(super) fn hide_early_out(fd: RawFd) {
    if !table::has_flag(fd, F_EARLY) || table::has_flag(fd, F_ANNOUNCED) {
        return;
    }
    let _g = LOCK.write();
    if table::has_flag(fd, F_PENDING) && table::has_flag(fd, F_EARLY) {
        table::set_flag(fd, F_EARLY, false);
        hide_out_locked(fd, true);
    }
}

/// The descriptors with a pending handshake registered in epoll set `ep`.
pub(super) fn pending_in_epoll(ep: RawFd) -> Vec<RawFd> {
    let _g = LOCK.write();
    lock(&STATES)
        .as_ref()
        .map(|m| {
            m.iter()
                .filter(|(fd, s)| {
                    table::has_flag(**fd, F_PENDING) && s.epoll.iter().any(|(p, _)| *p == ep)
                })
                .map(|(fd, _)| *fd)
                .collect()
        })
        .unwrap_or_default()
}

/// Forgets what we knew about descriptor number `fd` (it was closed): its
/// flags and its record go. A handshake still pending on it comes back,
/// to be dropped once the table's lock is released ([`Forgotten`]).
#[must_use = "drop it after the table's lock is released"]
pub(super) fn forget_fd_locked(fd: RawFd) -> Option<Forgotten> {
    if !in_table_range(fd) {
        return None;
    }
    let f = table::FLAGS[fd as usize].swap(0, Ordering::Relaxed);
    if f & (F_LISTENER | F_CANDIDATE | F_FALLBACK | F_PENDING) != 0 {
        if let Some(m) = lock(&STATES).as_mut() {
            m.remove(&fd);
        }
    }
    let pending = if f & F_PENDING != 0 {
        forget_pending_locked(fd)
    } else {
        None
    };
    super::epoll::forget_fd(fd);
    pending
}

/// Lists the TCP connection on `fd`, which fell back for `reason` on
/// `side`, in the device's fallback table until `fd` is closed (`smclo ss
/// -a`). Keeps errno.
pub(super) fn list_fallback(
    c: &Ctx,
    fd: RawFd,
    side: Role,
    reason: Reason,
    peer: Option<SocketAddr>,
) {
    if !in_table_range(fd) {
        return;
    }
    let e = errno();
    if let Some(rec) = fallbacks::record(&c.dev, fd, side, reason, peer) {
        let _g = LOCK.write();
        with_state_locked(fd, |s| s.listed = Some(Listed::Fallback(Arc::new(rec))));
        table::set_flag(fd, F_FALLBACK, true);
    }
    set_errno(e);
}

/// The writability a pending connect does not report (epoll).
const OUT_EPOLL: u32 = (libc::EPOLLOUT | libc::EPOLLWRNORM | libc::EPOLLWRBAND) as u32;

/// A descriptor whose handshake is undecided.
pub(super) struct Undecided {
    pub(super) hs: handshake::Pending,
    /// The holder slot claimed for the connection.
    pub(super) slot: usize,
    /// The other end's address.
    pub(super) dest: SocketAddr,
    /// Which connect of `fd` this is (see [`FdState::pending_id`]).
    pub(super) id: u64,
    /// A non-blocking `shutdown` made while it was undecided, carried out
    /// when it decides (see [`shutdown`]).
    pub(super) shut: Shut,
    /// A blocking connect that returned connected (its writes may go
    /// early): the process's exit ends it as a close would.
    pub(super) early: bool,
}

/// The directions a [`shutdown`] of an undecided connection closed.
#[derive(Clone, Copy, Default)]
pub(super) struct Shut {
    rd: bool,
    wr: bool,
}

impl Shut {
    pub(super) fn add(&mut self, how: c_int) {
        self.rd |= how != libc::SHUT_WR;
        self.wr |= how != libc::SHUT_RD;
    }

    pub(super) fn how(self) -> Option<c_int> {
        match (self.rd, self.wr) {
            (true, true) => Some(libc::SHUT_RDWR),
            (true, false) => Some(libc::SHUT_RD),
            (false, true) => Some(libc::SHUT_WR),
            (false, false) => None,
        }
    }
}

/// Pending connects by descriptor; one being driven is out of the map.
pub(super) static PENDING: Mutex<Option<HashMap<RawFd, Undecided>>> = Mutex::new(None);
/// Descriptors with [`F_PENDING`] (the waits skip all this at 0).
pub(super) static COUNT: AtomicUsize = AtomicUsize::new(0);
/// The next connect's id.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// `connect` (`accept`) returned `fd` before its handshake `hs` with
/// `dest` decided.
pub(super) fn start(fd: RawFd, hs: handshake::Pending, slot: usize, dest: SocketAddr, early: bool) {
    let _g = LOCK.write();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    with_state_locked(fd, |s| s.pending_id = Some(id));
    let pd_announced = hs.announced();
    let pd = Undecided {
        hs,
        slot,
        dest,
        id,
        shut: Shut::default(),
        early,
    };
    lock(&PENDING)
        .get_or_insert_with(HashMap::new)
        .insert(fd, pd);
    COUNT.fetch_add(1, Ordering::Relaxed);
    // Registrations are recorded (the swap moves them) and given to the
    // kernel without writability until the handshake decides.
    table::set_flag(fd, F_PENDING | F_CANDIDATE, true);
    let announced = pd_announced;
    table::set_flag(fd, F_EARLY, early || announced);
    table::set_flag(fd, F_ANNOUNCED, announced);
    hide_out_locked(fd, !(early || announced));
}

/// Whether `fd`'s writability is hidden: its connect is pending and its
/// writes could not go early.
pub(super) fn out_hidden(fd: RawFd) -> bool {
    table::has_flag(fd, F_PENDING) && !table::has_flag(fd, F_EARLY)
}

/// The epoll registrations of `fd` recorded so far, given to the kernel
/// without (`hide`) or with their writability. With the table's lock held
/// for writing.
fn hide_out_locked(fd: RawFd, hide: bool) {
    let states = lock(&STATES);
    let regs = states.as_ref().and_then(|m| m.get(&fd)).map(|s| &s.epoll);
    for (ep, ev) in regs.into_iter().flatten() {
        let mut e = *ev;
        if hide {
            e.events &= !OUT_EPOLL;
        }
        // SAFETY: a valid event for the call's duration.
        unsafe { real::epoll_ctl(*ep, libc::EPOLL_CTL_MOD, fd, &mut e) };
    }
}

/// The event the kernel gets for a registration of `fd` (epoll_ctl): no
/// writability while its connect is pending. Call with the table's lock
/// held for writing, so that the decision cannot come in between.
pub(super) fn kernel_event(fd: RawFd, ev: libc::epoll_event) -> libc::epoll_event {
    let mut e = ev;
    if out_hidden(fd) {
        e.events &= !OUT_EPOLL;
    }
    e
}

/// A handshake whose descriptor number was closed: dropping it withdraws
/// the proposal (or declines), which closes descriptors of its own (a
/// server's connection filed for it on the rendezvous socket). Their
/// interposed `close` takes the table's lock, so it must be dropped after
/// that lock is released, never under it.
#[must_use = "drop it after the table's lock is released"]
pub(super) struct Forgotten(#[allow(dead_code)] Undecided);

/// Descriptor number `fd` was closed: its proposal is to be withdrawn
/// (by dropping what this returns, see [`Forgotten`]). With the table's
/// lock held for writing.
fn forget_pending_locked(fd: RawFd) -> Option<Forgotten> {
    let mut pd = lock(&PENDING).as_mut().and_then(|m| m.remove(&fd))?;
    if let Some(p) = pd.hs.proposal_mut() {
        p.socket_closed();
    }
    COUNT.fetch_sub(1, Ordering::Relaxed);
    holders::forget(pd.slot);
    debug!(
        "fd {fd}: closed before the handshake with {} decided",
        pd.dest
    );
    Some(Forgotten(pd))
}

/// The early connects whose handshake is pending and not being driven:
/// the process's exit ends them as a close would (`hooks::process`), so
/// that a server that accepted one, and may hold its request, is followed
/// and reads the end of the stream, as from a TCP client that exited.
/// Other pending connects are left to the rules of a process that dies
/// (their server finds the client gone: PEER_DEAD).
pub(super) fn early_fds() -> Vec<RawFd> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    lock(&PENDING)
        .as_ref()
        .map(|m| {
            m.iter()
                .filter(|(_, pd)| pd.early)
                .map(|(fd, _)| *fd)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `id` is the connect that `fd` holds now. With the table's lock
/// held for writing.
pub(super) fn is_current(fd: RawFd, id: u64) -> bool {
    lock(&STATES).as_ref().and_then(|m| m.get(&fd)?.pending_id) == Some(id)
}

/// The handshake `id` of `fd` has decided: whether it was still the one
/// `fd` holds (its number not closed meanwhile), which it no longer is.
/// With the table's lock held for writing.
pub(super) fn end_current_locked(fd: RawFd, id: u64) -> bool {
    let mut states = lock(&STATES);
    let Some(s) = states.as_mut().and_then(|m| m.get_mut(&fd)) else {
        return false;
    };
    if s.pending_id != Some(id) {
        return false;
    }
    s.pending_id = None;
    true
}

/// The descriptors whose connect is pending and not being driven.
pub(super) fn pending_fds() -> Vec<RawFd> {
    lock(&PENDING)
        .as_ref()
        .map(|m| m.keys().copied().collect())
        .unwrap_or_default()
}
