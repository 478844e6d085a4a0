//! The descriptor state's named transitions: each event of a descriptor's
//! life (made, listening, connecting, swapped, stayed TCP, duplicated,
//! closed) as one change of its [`FdState`] (the transition table is on
//! [`FdState`]), made through `table::transition_locked` with the table's
//! lock held for writing, so that a closed or reused number is forgotten
//! in one step. This file calls no interposed function's code: the entry
//! points and the transitions (`hooks::pending`, `hooks::swap`) use it,
//! never the other way round.

use super::{in_table_range, Ctx};
use crate::critical::lock;
use crate::hints::{self, Hint};
use crate::holders;
use crate::real;
use crate::table::{
    self, Connecting, FdState, Kind, Reg, Shadow, Shut, Sock, ThreadMark, Undecided, LOCK,
};
use smclo::adapter::errno;
use smclo::adapter::fallbacks::{self, FallbackRecord, Known};
use smclo::adapter::handshake;
use smclo::adapter::registry::ListenerGuard;
use smclo::debug;
use smclo::device::Role;
use smclo_wire::reason::Reason;
use std::net::SocketAddr;
use std::os::fd::{IntoRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Whether smclo knows nothing of `fd`: no state, no hint.
#[inline]
pub(super) fn unknown(fd: RawFd) -> bool {
    in_table_range(fd) && !table::known(fd) && hints::hints(fd) == 0
}

/// `fd` listens, registered in the device by `guard` (until its last
/// `dup` is closed). With the table's lock held for writing.
pub(super) fn listening_locked(fd: RawFd, guard: ListenerGuard) {
    let old = table::replace_locked(fd, FdState::Listener(Arc::new(guard)));
    drop(old); // a candidate's registrations, or an earlier registration
}

/// The registration of listener `fd`, if it is one.
pub(super) fn listener_guard(fd: RawFd) -> Option<Arc<ListenerGuard>> {
    if !in_table_range(fd) {
        return None;
    }
    let _g = LOCK.read();
    table::with_state_locked(fd, |s| match s {
        FdState::Listener(g) => Some(g.clone()),
        _ => None,
    })
}

/// Whether `fd` shares its state with its `dup`s (a listener, a
/// fallback): one load.
pub(super) fn dup_shared(fd: RawFd) -> bool {
    matches!(table::kind(fd), Kind::Listener | Kind::Fallback)
}

/// Makes `new`, a duplicate of `old` (forgotten just now), share `old`'s
/// listener registration or fallback listing.
pub(super) fn share_records_locked(old: RawFd, new: RawFd) {
    if !in_table_range(new) || !dup_shared(old) {
        return;
    }
    let shared = table::with_state_locked(old, |s| match s {
        FdState::Listener(g) => Some(FdState::Listener(g.clone())),
        FdState::Fallback(r) => Some(FdState::Fallback(r.clone())),
        _ => None,
    });
    if let Some(s) = shared {
        drop(table::replace_locked(new, s)); // `Unknown`
    }
}

/// Before an exec: listener registrations and fallback listings stay with
/// this image (the new one registers the listeners it inherits again,
/// `hooks::setup`, and could not unlist the fallbacks when it closes
/// them): those numbers become `Unknown`.
pub(super) fn unlist_all() {
    let _g = LOCK.write();
    let mut listed = Vec::new();
    table::for_each_state_locked(|fd, s| {
        if matches!(s, FdState::Listener(_) | FdState::Fallback(_)) {
            listed.push(fd);
        }
    });
    for fd in listed {
        drop(table::replace_locked(fd, FdState::Unknown));
    }
}

/// This process passes the connections it accepts on `port` to other
/// processes (`SCM_RIGHTS`) before their handshakes end, and may not wait
/// for them (`SMCLO_PASS_WAIT_MS` 0): its listeners on that port leave
/// the registry and their later connections stay TCP ([`Hint::Plain`]),
/// so that no client proposes to them again, and none pays for a
/// handshake that ends in TCP. Its other listeners stay.
pub(super) fn unlist_listeners_passing(port: u16) {
    unlist_listeners(
        |fd, _| smclo::adapter::sockaddr::local(fd).is_ok_and(|a| a.port() == port),
        "its accepted connections go to other processes",
    );
}

/// The process uses io_uring (`hooks::uring`): the listeners it
/// registered leave the registry, and their later connections stay TCP
/// ([`Hint::Plain`]). One a fork child inherited stays registered by its
/// parent (`hooks::uring` declines that registration).
pub(super) fn unlist_own_listeners() {
    unlist_listeners(|_, g| g.is_own(), "this process uses io_uring");
}

/// The listeners for which `which` holds (their number, their
/// registration) leave the registry, and their later connections stay
/// TCP ([`Hint::Plain`]), for reason `why`.
fn unlist_listeners(which: impl Fn(RawFd, &ListenerGuard) -> bool, why: &str) {
    let _g = LOCK.write();
    let mut listed = Vec::new();
    table::for_each_state_locked(|fd, s| {
        if matches!(s, FdState::Listener(g) if which(fd, g)) {
            listed.push(fd);
        }
    });
    for fd in listed {
        drop(table::replace_locked(fd, FdState::Unknown));
        hints::hint(fd, Hint::Plain);
        debug!("fd {fd}: unregistered, its connections stay TCP ({why})");
    }
}

/// Records the program's epoll registration of candidate (or pending)
/// `fd` in set `ep` (`event`; `None`: deleted), made with the kernel just
/// now. With the table's lock held for writing.
pub(super) fn record_epoll_locked(fd: RawFd, ep: RawFd, event: Option<libc::epoll_event>) {
    table::transition_locked(fd, |mut s| {
        if let FdState::Candidate { epoll, .. } | FdState::Pending { epoll, .. } = &mut s {
            epoll.retain(|(p, _)| *p != ep);
            epoll.extend(event.map(|e| (ep, e)));
        }
        (s, ())
    })
}

/// Takes the epoll registrations recorded for `fd` (the swap moves them),
/// leaving its state as it is otherwise. With the table's lock held for
/// writing.
pub(super) fn take_epoll_locked(fd: RawFd) -> Vec<Reg> {
    table::transition_locked(fd, |mut s| {
        let regs = match &mut s {
            FdState::Candidate { epoll, .. } | FdState::Pending { epoll, .. } => {
                std::mem::take(epoll)
            }
            _ => Vec::new(),
        };
        (s, regs)
    })
}

/// `fd`'s connect is not proposed or has decided without a swap: a
/// candidate's registrations go (no later connection at its number takes
/// them), and it is `Unknown`; a listed fallback stays listed.
pub(super) fn end_candidacy(fd: RawFd) {
    if table::kind(fd) != Kind::Candidate {
        return;
    }
    let _g = LOCK.write();
    table::transition_locked(fd, |s| match s {
        FdState::Candidate { .. } => (FdState::Unknown, ()),
        other => (other, ()),
    });
}

/// `fd` is duplicated (`dup`, `dup2`, `dup3`, `F_DUPFD`): if its connect
/// is still to come, it stays TCP. A swap replaces one number only, and
/// what the program wrote through the other would go to the TCP socket
/// nobody reads. A blocking connect under way in another thread has
/// committed its handshake: the `dup` waits for its decision, as for a
/// pending one's (`pending::settle`), and then duplicates what it made.
pub(super) fn duplicated(fd: RawFd) {
    if table::kind(fd) != Kind::Candidate {
        return;
    }
    while connecting_other(fd) {
        std::thread::sleep(CONNECT_LOOK);
    }
    if table::kind(fd) == Kind::Candidate {
        debug!("fd {fd}: duplicated before its connect: its connection stays TCP");
        end_candidacy(fd);
    }
}

/// How often a `dup` looks whether the blocking connect it waits for has
/// decided (as a pending handshake's waits look again).
const CONNECT_LOOK: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether another thread of this process is in a blocking connect of
/// `fd`: not the caller (one of its own, interrupted by the handler that
/// duplicates it, cannot decide meanwhile), nor a thread of the parent
/// that forked this process (its connect decides in the parent only).
fn connecting_other(fd: RawFd) -> bool {
    let _g = LOCK.read();
    table::with_state_locked(
        fd,
        |s| matches!(s, FdState::Candidate { connecting: Some(t), .. } if t.is_other_thread()),
    )
}

/// Notes that the calling thread begins (`on`), or ends without a
/// decision, a blocking connect of candidate `fd`.
pub(super) fn connecting(fd: RawFd, on: bool) {
    let me = ThreadMark::current();
    let _g = LOCK.write();
    table::transition_locked(fd, |s| match s {
        // Ended: only the mark of this thread (the number may be another
        // socket's by now).
        FdState::Candidate { epoll, connecting } if on || connecting == Some(me) => (
            FdState::Candidate {
                epoll,
                connecting: on.then_some(me),
            },
            (),
        ),
        other => (other, ()),
    });
}

/// `fd` was made by the program's `socket()` just now: a TCP stream is a
/// candidate known to be TCP ([`Hint::Tcp`]); anything else is known to
/// be no listener ([`Hint::Plain`]).
pub(super) fn made(fd: RawFd, tcp: bool) {
    if !tcp {
        hints::hint(fd, Hint::Plain);
        return;
    }
    hints::hint(fd, Hint::Tcp);
    let _g = LOCK.write();
    drop(table::replace_locked(fd, FdState::candidate()));
}

/// `fd` is now a descriptor of connection `sock` (the swap, a `dup`, an
/// adoption after exec), with the program's `FD_CLOEXEC` view `cloexec`.
/// Its state was `Unknown` (forgotten), a candidate's or a pending one's
/// whose registrations and handshake the caller took. With the table's
/// lock held for writing.
pub(super) fn install_locked(fd: RawFd, sock: &Arc<Sock>, cloexec: bool) {
    sock.fds.fetch_add(1, Ordering::AcqRel);
    let new = FdState::Smc {
        sock: sock.clone(),
        cloexec,
    };
    drop(table::replace_locked(fd, new));
}

/// Records the program's `FD_CLOEXEC` view of `Smc` number `fd`.
pub(super) fn set_app_cloexec(fd: RawFd, on: bool) {
    let _g = LOCK.write();
    table::transition_locked(fd, |s| match s {
        FdState::Smc { sock, .. } => (FdState::Smc { sock, cloexec: on }, ()),
        other => (other, ()),
    });
}

/// `fd`'s connection, its state made `Unknown` (exit and exec end it),
/// if it is `Smc`. With the table's lock held for writing.
pub(super) fn take_smc_locked(fd: RawFd) -> Option<Arc<Sock>> {
    table::transition_locked(fd, |s| match s {
        FdState::Smc { sock, .. } => (FdState::Unknown, Some(sock)),
        other => (other, None),
    })
}

/// `fd` is smclo's own descriptor (a hidden TCP socket, a channel moved
/// away from the program's number, or left at a number the program
/// closed): `Internal`. With the table's lock held for writing.
pub(super) fn internal_locked(fd: RawFd) {
    // A fresh number, or one forgotten just now: nothing to keep.
    drop(table::mark_internal_locked(fd));
}

/// The swap of `fd` for handshake `c` failed (both ends reset): it stays
/// the TCP socket, no longer pending, a candidate with the registrations
/// the swap left it. Nothing changes if `fd` holds another state by now.
/// With the table's lock held for writing.
pub(super) fn swap_failed_locked(fd: RawFd, c: &Arc<Connecting>) {
    table::transition_locked(fd, |s| match s {
        FdState::Pending {
            connecting, epoll, ..
        } if Arc::ptr_eq(&connecting, c) => (
            FdState::Candidate {
                epoll,
                connecting: None,
            },
            (),
        ),
        other => (other, ()),
    });
}

/// The handshake `c` of `fd` decided TCP (or its TCP connection failed):
/// its registrations report writability again (an edge-triggered one too:
/// the kernel looks again at a MOD, also where writability was not
/// hidden, an early connect's) and go; `fd` is listed as a fallback
/// (`listed`) or `Unknown`. Nothing changes if `fd` holds another state
/// by now (closed, its number reused). With the table's lock held for
/// writing.
pub(super) fn stays_tcp_locked(fd: RawFd, c: &Arc<Connecting>, listed: Option<FallbackRecord>) {
    table::transition_locked(fd, |s| match s {
        FdState::Pending {
            connecting, epoll, ..
        } if Arc::ptr_eq(&connecting, c) => {
            give_out(fd, &epoll, false);
            let new = listed.map_or(FdState::Unknown, |r| FdState::Fallback(Arc::new(r)));
            (new, ())
        }
        other => (other, ()),
    });
}

/// Whether `fd` still holds handshake `c`. With the table's lock held.
pub(super) fn is_current_locked(fd: RawFd, c: &Arc<Connecting>) -> bool {
    table::with_state_locked(
        fd,
        |s| matches!(s, FdState::Pending { connecting, .. } if Arc::ptr_eq(connecting, c)),
    )
}

/// A non-blocking call on `fd`, an early connect's socket, cannot go on
/// before the decision: from now on its writability is hidden as a
/// non-blocking connect's, so that a poller waits for the decision (which
/// gives it back, with an edge) instead of finding the socket writable
/// and failing again.
pub(super) fn hide_early_out(fd: RawFd) {
    if table::kind(fd) != (Kind::Pending { writable: true })
        || table::connecting(fd).is_some_and(|c| c.announced)
    {
        return;
    }
    let _g = LOCK.write();
    table::transition_locked(fd, |s| match s {
        FdState::Pending {
            connecting,
            epoll,
            writable: true,
        } => {
            give_out(fd, &epoll, true);
            let new = FdState::Pending {
                connecting,
                epoll,
                writable: false,
            };
            (new, ())
        }
        other => (other, ()),
    });
}

/// The descriptors with a pending handshake registered in epoll set `ep`.
pub(super) fn pending_in_epoll(ep: RawFd) -> Vec<RawFd> {
    let _g = LOCK.read();
    let mut v = Vec::new();
    table::for_each_state_locked(|fd, s| {
        if let FdState::Pending { epoll, .. } = s {
            if epoll.iter().any(|(p, _)| *p == ep) {
                v.push(fd);
            }
        }
    });
    v
}

/// The pending handshakes, with their descriptors.
pub(super) fn pendings() -> Vec<(RawFd, Arc<Connecting>)> {
    if table::pending_count() == 0 {
        return Vec::new();
    }
    let _g = LOCK.read();
    let mut v = Vec::new();
    table::for_each_state_locked(|fd, s| {
        if let FdState::Pending { connecting, .. } = s {
            v.push((fd, connecting.clone()));
        }
    });
    v
}

/// What a number's state was when it was forgotten: its connection, for
/// the caller to release (`hooks::swap::release`), and the rest, which
/// may hold a handshake whose drop withdraws the proposal (or declines)
/// and closes descriptors of its own (a server's connection filed for it
/// on the rendezvous socket) through the interposed `close`, which takes
/// the table's lock: so it is dropped after that lock is released.
#[must_use = "drop it after the table's lock is released"]
pub(super) struct Forgotten {
    pub(super) sock: Option<Arc<Sock>>,
    _rest: FdState,
    _undecided: Option<Undecided>,
}

/// Forgets descriptor number `fd` (it was closed, or is reused): its state
/// becomes `Unknown`, its hints go, and it is no member of an epoll set
/// any more (a closed number cannot be deleted); a set it was loses its
/// poll session. With the table's lock held for writing.
pub(super) fn forget_fd_locked(fd: RawFd) -> Forgotten {
    let mut out = Forgotten {
        sock: None,
        _rest: FdState::Unknown,
        _undecided: None,
    };
    if !in_table_range(fd) {
        return out;
    }
    hints::forget_hints(fd);
    if table::epoll_count() != 0 {
        forget_member_locked(fd);
    }
    if !table::known(fd) {
        return out;
    }
    match table::replace_locked(fd, FdState::Unknown) {
        FdState::Smc { sock, .. } => out.sock = Some(sock),
        FdState::Pending { connecting, .. } => {
            out._undecided = withdraw(fd, &connecting);
        }
        FdState::Epoll(sh) => sh.close_session(),
        other => out._rest = other,
    }
    out
}

/// [`forget_fd_locked`] of a number the kernel handed out again (it was
/// closed behind smclo's back): a connection's channel that was this
/// number is gone, and the number is not the connection's to close any
/// more.
pub(super) fn forget_fresh_locked(fd: RawFd) -> Forgotten {
    let f = forget_fd_locked(fd);
    if let Some(s) = f.sock.as_ref().filter(|s| s.conn.fd() == fd) {
        let _ = s.conn.take_channel().map(IntoRawFd::into_raw_fd);
    }
    f
}

/// `fd` is no member of any epoll set's shadow any more.
fn forget_member_locked(fd: RawFd) {
    table::for_each_state_locked(|ep, s| {
        if let FdState::Epoll(sh) = s {
            sh.forget_member(ep, fd);
        }
    });
}

/// The handshake `c` of `fd`, whose number was closed: its proposal is
/// to be withdrawn (by dropping what this returns, see [`Forgotten`]); if
/// a thread drives it, that thread finds it no longer current.
fn withdraw(fd: RawFd, c: &Connecting) -> Option<Undecided> {
    let mut pd = lock(&c.undecided).take()?;
    if let Some(p) = pd.hs.proposal_mut() {
        p.socket_closed();
    }
    holders::forget(pd.slot);
    debug!(
        "fd {fd}: closed before the handshake with {} decided",
        pd.dest
    );
    Some(pd)
}

/// The fallback record of the TCP connection on `fd`, which fell back
/// for `reason` on `side`, for the device's fallback table (`smclo ss
/// -a`). Keeps errno.
pub(super) fn fallback_record(
    c: &Ctx,
    fd: RawFd,
    side: Role,
    reason: Reason,
    known: Known,
) -> Option<FallbackRecord> {
    if !in_table_range(fd) {
        return None;
    }
    errno::kept(|| fallbacks::record(&c.dev, fd, side, reason, known))
}

/// Lists the TCP connection on `fd` (see [`fallback_record`]) until `fd`
/// is closed: `Fallback`. Keeps errno.
pub(super) fn list_fallback(c: &Ctx, fd: RawFd, side: Role, reason: Reason, known: Known) {
    if let Some(rec) = fallback_record(c, fd, side, reason, known) {
        let _g = LOCK.write();
        drop(table::replace_locked(fd, FdState::Fallback(Arc::new(rec))));
    }
}

/// The writability a pending connect does not report (epoll).
const OUT_EPOLL: u32 = (libc::EPOLLOUT | libc::EPOLLWRNORM | libc::EPOLLWRBAND) as u32;

/// `connect` (`accept`) returned `fd` before its handshake `hs` with
/// `dest` decided: `Pending`, its registrations (a candidate's) given to
/// the kernel without writability unless its writes go `early`.
pub(super) fn start(fd: RawFd, hs: handshake::Pending, slot: usize, dest: SocketAddr, early: bool) {
    // An announcement's writes go early too, connected or not
    // (`pending::early_send` asks the socket unless it is `early`).
    let announced = hs.announced();
    let writable = early || announced;
    let connecting = Arc::new(Connecting {
        undecided: Mutex::new(Some(Undecided {
            hs,
            slot,
            dest,
            shut: Shut::default(),
        })),
        early,
        announced,
    });
    let _g = LOCK.write();
    table::transition_locked(fd, |s| {
        let epoll = match s {
            FdState::Candidate { epoll, .. } => epoll,
            _ => Vec::new(),
        };
        give_out(fd, &epoll, !writable);
        let new = FdState::Pending {
            connecting,
            epoll,
            writable,
        };
        (new, ())
    });
}

/// Whether `fd`'s writability is hidden: its connect is pending and its
/// writes could not go early.
pub(super) fn out_hidden(fd: RawFd) -> bool {
    table::kind(fd) == (Kind::Pending { writable: false })
}

/// The epoll registrations `regs` of `fd`, given to the kernel without
/// (`hide`) or with their writability.
fn give_out(fd: RawFd, regs: &[Reg], hide: bool) {
    for (ep, ev) in regs {
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

/// The early connects whose handshake is pending and not being driven:
/// the process's exit ends them as a close would (`hooks::process`), so
/// that a server that accepted one, and may hold its request, is followed
/// and reads the end of the stream, as from a TCP client that exited.
/// Other pending connects are left to the rules of a process that dies
/// (their server finds the client gone: PEER_DEAD). With the table's lock
/// held.
pub(super) fn early_fds_locked() -> Vec<RawFd> {
    let mut v = Vec::new();
    if table::pending_count() == 0 {
        return v;
    }
    table::for_each_state_locked(|fd, s| {
        if let FdState::Pending { connecting, .. } = s {
            if connecting.early && lock(&connecting.undecided).is_some() {
                v.push(fd);
            }
        }
    });
    v
}

/// The shadow of epoll set `ep`, made if it has none (an SMC-D member
/// joins it): `Epoll`. Nothing else is remembered about an epoll
/// descriptor, so its state was `Unknown`.
pub(super) fn epoll_set(ep: RawFd) -> Arc<Shadow> {
    if let Some(sh) = table::shadow(ep) {
        return sh;
    }
    let _g = LOCK.write();
    epoll_set_locked(ep)
}

/// [`epoll_set`] with the table's lock held for writing.
pub(super) fn epoll_set_locked(ep: RawFd) -> Arc<Shadow> {
    table::transition_locked(ep, |s| match s {
        FdState::Epoll(sh) => {
            let r = sh.clone();
            (FdState::Epoll(sh), r)
        }
        other => {
            drop(other);
            let sh = Arc::<Shadow>::default();
            (FdState::Epoll(sh.clone()), sh)
        }
    })
}
