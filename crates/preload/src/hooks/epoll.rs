//! The event-loop fast path for epoll (see `smclo::adapter::poller` and
//! docs/ARCHITECTURE.md "Event loops").
//!
//! `epoll_ctl` keeps, next to each kernel epoll set that holds SMC-D
//! connections, a *shadow* of those members (descriptor, events, data,
//! connection: `crate::shadow`), which the set's descriptor state
//! (`Epoll`) carries. `epoll_wait` on such a set looks at the members' rings
//! first, polls the kernel for the set's other descriptors only every
//! [`KERNEL_EVERY`](smclo::adapter::poller::KERNEL_EVERY) (so that under
//! load a request costs no system call, yet a timer, listener or pipe in
//! the set waits at most that long),
//! spins for an adaptive budget while the members' writers skip their
//! doorbells (`POLLED`), ends that session and looks again, and only then
//! sleeps in the real `epoll_wait` with what is left of the timeout.
//!
//! What is reported is what the kernel would report: level-triggered
//! members while their ring is ready; `EPOLLET` members once per change of
//! the ring (new data, a closing flag, room made by the peer);
//! `EPOLLONESHOT` members once until `EPOLL_CTL_MOD`; only the events asked
//! for, plus `EPOLLHUP` and `EPOLLERR`; each registration at most once per
//! call, whether the ring or the kernel (its doorbell) said so first.
//!
//! Sets the shadow cannot follow fall back to the real calls: a set with
//! no SMC-D member, a set nested in another one (the outer set's kernel
//! wait cannot see the rings, so its members never let writers skip), a
//! number that is not the one the set was made under (a `dup` of an epoll
//! descriptor).

use crate::critical::{lock, Locked};
use crate::real;
use crate::shadow::{Member, Session, Set, ALWAYS, ET, EXCLUSIVE, ONESHOT};
use crate::table::{self, FdState, Shadow, Sock};
use libc::{c_int, epoll_event, sigset_t, timespec};
use smclo::adapter::clock::now_ns;
use smclo::adapter::errno;
use smclo::adapter::poller::{Few, Ready};
use smclo::adapter::signal::Watch;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

thread_local! {
    /// Descriptors this thread's wait sleeps on beside the set
    /// ([`with_also`]), with what the sleep found.
    static ALSO: std::cell::RefCell<Vec<libc::pollfd>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `wait` (an `epoll_wait` on a set, see [`wait`]) so that its
/// kernel sleep also ends when one of `also` becomes readable (then it
/// returns 0 early); `also`'s `revents` say which did. The pending
/// handshakes' descriptors (`hooks::pending`): only the set's own wait
/// knows when the members' writers ring again, so the sleep beside them
/// must be that wait's.
pub(super) fn with_also<R>(also: &mut [libc::pollfd], wait: impl FnOnce() -> R) -> R {
    ALSO.with(|a| *a.borrow_mut() = also.to_vec());
    let r = wait();
    ALSO.with(|a| {
        let found = std::mem::take(&mut *a.borrow_mut());
        if found.len() == also.len() {
            also.copy_from_slice(&found);
        }
    });
    r
}

/// A kernel sleep on `ep` of at most `ms` (-1: for ever) beside this
/// thread's [`ALSO`] descriptors: whether `ep` is ready (`Ok(false)`: one
/// of those woke it, or the time is up).
fn sleep_also(ep: RawFd, ms: c_int, sigmask: *const sigset_t) -> Result<bool, c_int> {
    let mut fds = ALSO.with(|a| a.borrow().clone());
    fds.insert(
        0,
        libc::pollfd {
            fd: ep,
            events: libc::POLLIN,
            revents: 0,
        },
    );
    let ts =
        (ms >= 0).then(|| smclo::adapter::chan_sys::timespec(Duration::from_millis(ms as u64)));
    let tp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const timespec);
    // SAFETY: `fds` is writable for its length; the timespec lives across
    // the call; the mask is the caller's (or null).
    let r = unsafe { real::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tp, sigmask) };
    if r < 0 {
        return Err(errno::get());
    }
    ALSO.with(|a| *a.borrow_mut() = fds[1..].to_vec());
    Ok(fds[0].revents != 0)
}

/// Whether this thread's wait sleeps beside other descriptors.
fn also_any() -> bool {
    ALSO.with(|a| !a.borrow().is_empty())
}

/// The kernel wait on `ep` of at most `ms`, beside this thread's [`ALSO`]
/// descriptors if any: the real `epoll_pwait` into `room`, `Ok(0)` when
/// one of those woke it.
pub(super) fn pwait(
    ep: RawFd,
    room: &mut [epoll_event],
    ms: c_int,
    sigmask: *const sigset_t,
) -> Result<usize, c_int> {
    let ms = if ms != 0 && also_any() {
        if !sleep_also(ep, ms, sigmask)? {
            return Ok(0);
        }
        0
    } else {
        ms
    };
    // SAFETY: `room` is writable for its length; the mask is the caller's.
    let r = unsafe { real::epoll_pwait(ep, room.as_mut_ptr(), room.len() as c_int, ms, sigmask) };
    if r < 0 {
        return Err(errno::get());
    }
    Ok(r as usize)
}

/// The real `epoll_ctl`; `Err(errno)`.
fn real_ctl(ep: RawFd, op: c_int, fd: RawFd, ev: Option<epoll_event>) -> Result<(), c_int> {
    let mut e = ev.unwrap_or(epoll_event { events: 0, u64: 0 });
    // SAFETY: a valid event for the call's duration.
    if unsafe { real::epoll_ctl(ep, op, fd, &mut e) } < 0 {
        return Err(errno::get());
    }
    Ok(())
}

/// `epoll_ctl` on SMC-D descriptor `fd` (`sock`). A registration joins
/// the set's shadow; changes of it (`MOD`, `DEL`) stay in the shadow and
/// reach the kernel only before the set sleeps there ([`sync`]): event
/// loops that change their interest per request (redis-benchmark, libevent)
/// make no system call for it while they do not sleep.
pub(super) fn ctl(
    ep: RawFd,
    op: c_int,
    fd: RawFd,
    ev: Option<epoll_event>,
    sock: &Arc<Sock>,
) -> c_int {
    refuse_in_fork("epoll_ctl on an SMC-D connection");
    let r = match op {
        // No event where one is needed: the kernel's answer (EFAULT).
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD if ev.is_none() => {
            // SAFETY: forwarded unchanged (a null event).
            return unsafe { real::epoll_ctl(ep, op, fd, std::ptr::null_mut()) };
        }
        libc::EPOLL_CTL_ADD => add(ep, fd, ev, sock),
        libc::EPOLL_CTL_MOD | libc::EPOLL_CTL_DEL => change(ep, op, fd, ev),
        _ => real_ctl(ep, op, fd, ev),
    };
    match r {
        Ok(()) => 0,
        Err(e) => super::fail(e),
    }
}

fn add(ep: RawFd, fd: RawFd, ev: Option<epoll_event>, sock: &Arc<Sock>) -> Result<(), c_int> {
    let sh = table::shadow(ep);
    if let (Some(sh), Some(e)) = (&sh, ev) {
        let mut set = lock(&sh.set);
        if let Some(m) = set.members.iter_mut().find(|m| m.fd == fd) {
            if !m.gone {
                return Err(libc::EEXIST);
            }
            // Deleted, and the kernel's registration not yet: take it back.
            m.set(e);
            return Ok(());
        }
    }
    real_ctl(ep, libc::EPOLL_CTL_ADD, fd, ev)?;
    adopt(ep, fd, ev, sock);
    Ok(())
}

/// A registration the kernel has now (`fd` added to `ep` with `ev`).
pub(super) fn adopt(ep: RawFd, fd: RawFd, ev: Option<epoll_event>, sock: &Arc<Sock>) {
    if let Some(ev) = ev {
        join_set(&super::state::epoll_set(ep), fd, ev, sock);
    }
}

/// [`adopt`] with the table's lock held for writing.
pub(super) fn adopt_locked(ep: RawFd, fd: RawFd, ev: epoll_event, sock: &Arc<Sock>) {
    join_set(&super::state::epoll_set_locked(ep), fd, ev, sock);
}

fn join_set(sh: &Shadow, fd: RawFd, ev: epoll_event, sock: &Arc<Sock>) {
    join(sh, sock);
    let mut set = lock(&sh.set);
    set.members.retain(|m| m.fd != fd);
    set.members.push(Member {
        fd,
        events: ev.events,
        data: ev.u64,
        kdata: ev.u64,
        gone: false,
        dirty: false,
        sock: sock.clone(),
        disabled: false,
        last_in: None,
        last_out: None,
    });
}

fn change(ep: RawFd, op: c_int, fd: RawFd, ev: Option<epoll_event>) -> Result<(), c_int> {
    let exclusive = ev.is_some_and(|e| e.events & EXCLUSIVE != 0);
    let Some(sh) = table::shadow(ep) else {
        return real_ctl(ep, op, fd, ev);
    };
    let mut set = lock(&sh.set);
    let eager = set.eager;
    let Some(i) = set.members.iter().position(|m| m.fd == fd && !m.gone) else {
        drop(set);
        return real_ctl(ep, op, fd, ev);
    };
    let m = &mut set.members[i];
    if eager || exclusive || op == libc::EPOLL_CTL_MOD && m.events & EXCLUSIVE != 0 {
        // The kernel decides: it refuses EPOLLEXCLUSIVE in a MOD, and a
        // MOD of a registration made with it.
        real_ctl(ep, op, fd, ev)?;
    }
    if op == libc::EPOLL_CTL_DEL {
        if eager {
            set.members.remove(i);
        } else {
            m.gone = true;
            m.dirty = true;
        }
        return Ok(());
    }
    let Some(e) = ev else {
        return Err(libc::EFAULT);
    };
    m.set(e);
    if eager {
        m.dirty = false;
        m.kdata = e.u64;
    }
    Ok(())
}

/// Brings the kernel's registrations up to the shadow's (before a sleep
/// in the kernel, and before a close or a fork).
fn sync_locked(set: &mut Set, ep: RawFd) {
    for m in set.members.iter_mut().filter(|m| m.dirty) {
        m.dirty = false;
        if m.gone {
            let _ = real_ctl(ep, libc::EPOLL_CTL_DEL, m.fd, None);
            continue;
        }
        let ev = epoll_event {
            events: m.events,
            u64: m.data,
        };
        if real_ctl(ep, libc::EPOLL_CTL_MOD, m.fd, Some(ev)).is_ok() {
            m.kdata = m.data;
        }
    }
    set.members.retain(|m| !m.gone);
}

/// Whether `sh` has members left. When its last ones are gone, the
/// kernel's registrations are brought up to that first: the set then waits
/// in the kernel alone, with no spin over rings that are no more (an event
/// loop whose SMC-D connections ended, its others plain TCP).
fn live_members(sh: &Shadow, ep: RawFd) -> bool {
    let mut set = lock(&sh.set);
    if set.members.iter().any(|m| !m.gone) {
        return true;
    }
    if !set.members.is_empty() {
        sync_locked(&mut set, ep);
    }
    false
}

fn sync(sh: &Shadow, ep: RawFd) {
    sync_locked(&mut lock(&sh.set), ep);
}

/// An epoll descriptor `inner` was added to another set (or removed).
pub(super) fn nest(inner: RawFd) {
    if let Some(sh) = table::shadow(inner) {
        refuse_in_fork("epoll_ctl of an epoll set smclo serves");
        lock(&sh.set).nested = true;
    }
}

type SessionGuard = Locked<'static, Session>;

/// Holds every shadow's locks across `fork` (in the order everything else
/// takes them: the map, a session, its set), so that the child finds none
/// of them held by a thread it does not have. Dropped (unlocked) in the
/// parent and in the child.
pub(super) struct ForkGuard {
    // Fields drop in order: the guards before the shadows they borrow.
    _locks: Vec<(SessionGuard, Locked<'static, Set>)>,
    _shadows: Vec<Arc<Shadow>>,
}

thread_local! {
    /// Whether this thread holds the shadows' locks for a fork
    /// ([`ForkGuard`]).
    static HELD_FOR_FORK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for ForkGuard {
    fn drop(&mut self) {
        HELD_FOR_FORK.with(|h| h.set(false));
    }
}

/// Aborts with the reason if this thread holds the shadows' locks for a
/// fork: a fork handler that runs then (one a library registered before
/// smclo's) would wait for itself for ever in `what`.
fn refuse_in_fork(what: &str) {
    if HELD_FOR_FORK.with(std::cell::Cell::get) {
        table::abort_in_fork(&format!(
            "a fork handler (pthread_atfork) used {what} during fork, while smclo holds it locked"
        ));
    }
}

/// With the table's lock held for writing (which keeps the set of epoll
/// states as it is across the fork).
pub(super) fn before_fork_locked() -> ForkGuard {
    let mut all: Vec<(RawFd, Arc<Shadow>)> = Vec::new();
    table::for_each_state_locked(|ep, s| {
        if let FdState::Epoll(sh) = s {
            all.push((ep, sh.clone()));
        }
    });
    let mut locks = Vec::with_capacity(all.len());
    for (ep, sh) in &all {
        // SAFETY: `_shadows` keeps the shadow alive for as long as the
        // guards exist: fields drop in declaration order, `_locks` first.
        let sh: &'static Shadow = unsafe { &*Arc::as_ptr(sh) };
        let session = lock(&sh.session);
        let mut set = lock(&sh.set);
        // Parent and child share the kernel's set from now on: each change
        // must reach the kernel at once.
        sync_locked(&mut set, *ep);
        set.eager = true;
        locks.push((session, set));
    }
    HELD_FOR_FORK.with(|h| h.set(true));
    ForkGuard {
        _locks: locks,
        _shadows: all.into_iter().map(|(_, sh)| sh).collect(),
    }
}

/// Reports what the rings of `sh`'s members say into `out`; returns how
/// many entries it wrote.
fn scan(sh: &Shadow, out: &mut [epoll_event]) -> usize {
    let mut set = lock(&sh.set);
    let len = set.members.len();
    let start = set.next.min(len);
    let mut n = 0;
    for k in 0..len {
        let i = (start + k) % len;
        let m = &mut set.members[i];
        let ev = m.take();
        if ev == 0 {
            continue;
        }
        out[n] = epoll_event {
            events: ev,
            u64: m.data,
        };
        n += 1;
        if n == out.len() {
            set.next = i + 1;
            return n;
        }
    }
    n
}

/// Merges the kernel's entries `out[n..n + k]` into `out[..n]`: an SMC-D
/// member that fired already (one-shot) is dropped, one reported by the
/// rings in this call is merged into that entry. Returns the new count.
fn merge(sh: &Shadow, out: &mut [epoll_event], n: usize, k: usize) -> usize {
    let mut set = lock(&sh.set);
    let mut len = n;
    for j in n..n + k {
        let mut e = out[j];
        if let Some(m) = set.members.iter_mut().find(|m| m.kdata == e.u64) {
            // A dead peer's end of file (a hang-up) changes the ring's
            // mark, so that an edge-triggered member reports it.
            m.sock.conn.kernel_ready(Ready::from_bits(e.events));
            // The application's view decides (the kernel's may be behind),
            // and an edge the rings reported already is not a new one.
            e.events &= m.events & !(ET | ONESHOT) | ALWAYS;
            if m.events & ET != 0 && !m.disabled {
                e.events = m.edges(e.events);
            }
            if m.disabled || m.gone || e.events == 0 {
                continue;
            }
            e.u64 = m.data;
            if let Some(x) = out[..n].iter_mut().find(|x| x.u64 == e.u64) {
                x.events |= e.events;
                continue;
            }
            m.fired();
        }
        out[len] = e;
        len += 1;
    }
    len
}

/// The real `epoll_pwait` into `out[n..]` with `ms`, merged; `Err(errno)`.
fn kernel(
    sh: &Shadow,
    ep: RawFd,
    out: &mut [epoll_event],
    n: usize,
    ms: c_int,
    sigmask: *const sigset_t,
) -> Result<usize, c_int> {
    sh.pace.kernel_asked();
    let r = pwait(ep, &mut out[n..], ms, sigmask)?;
    Ok(merge(sh, out, n, r))
}

/// Opens the set's poll session, if none is open: its members get
/// `POLLED`, so their writers skip the doorbell. The session stays open
/// while the event loop runs (every wait looks at the rings first) and
/// ends only when the loop is about to sleep in the kernel ([`cancel`]).
/// Members that do not want `IN` now are in it too: loops that ask for
/// `IN` only after they wrote a request (redis-benchmark) would otherwise
/// have their replies rung; whatever arrives is seen by the first wait
/// after they ask.
fn open(sh: &Shadow) {
    let mut session = lock(&sh.session);
    if session.is_some() {
        return;
    }
    let set = lock(&sh.set);
    if set.nested {
        return;
    }
    let mut v = Few::new();
    for m in set.members.iter().filter(|m| !m.gone) {
        // An error aborted the connection; its readiness says so.
        if m.sock.conn.poll_begin().is_ok() {
            v.push(m.sock.clone());
        }
    }
    *session = Some(v);
}

/// A member added while the set's session is open joins it.
fn join(sh: &Shadow, sock: &Arc<Sock>) {
    if let Some(v) = lock(&sh.session).as_mut() {
        if sock.conn.poll_begin().is_ok() {
            v.push(sock.clone());
        }
    }
}

/// The set will sleep in the kernel: its members' writers must ring even
/// if another set's session (or another process of the family) polls
/// them (see `Conn::poll_cancel`).
fn cancel(sh: &Shadow) {
    for m in lock(&sh.set).members.iter().filter(|m| !m.gone) {
        let _ = m.sock.conn.poll_cancel();
    }
}

/// Milliseconds until `deadline` (rounded up), -1 for none.
pub(super) fn ms_left(deadline: Option<Instant>) -> c_int {
    match deadline {
        None => -1,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            left.as_micros().div_ceil(1000).min(c_int::MAX as u128) as c_int
        }
    }
}

/// Spins for the set's budget (within the deadline), looking at the
/// rings, and at the kernel every
/// [`KERNEL_EVERY`](smclo::adapter::poller::KERNEL_EVERY), until a signal
/// handler runs (`signals`).
fn spin(
    sh: &Shadow,
    ep: RawFd,
    out: &mut [epoll_event],
    deadline: Option<Instant>,
    sigmask: *const sigset_t,
    signals: &Watch,
) -> Result<usize, c_int> {
    let time = sh.pace.budget().spin_time(deadline);
    if time.is_zero() {
        return Ok(0);
    }
    let r = sh.pace.budget().spin(time, signals, || {
        let n = match scan(sh, out) {
            0 if sh.pace.kernel_due() => kernel(sh, ep, out, 0, 0, sigmask)?,
            n => n,
        };
        Ok::<_, c_int>((n > 0).then_some(n))
    })?;
    Ok(r.unwrap_or(0))
}

/// `epoll_pwait` over a shadowed set (`timeout` None: for ever). A signal
/// handler that runs in this thread during the wait (one `sigmask` would
/// not block) ends the spin, and the wait fails with `EINTR` instead of
/// sleeping (`smclo::adapter::signal`).
fn wait(
    sh: &Shadow,
    ep: RawFd,
    out: &mut [epoll_event],
    timeout: Option<Duration>,
    sigmask: *const sigset_t,
) -> Result<usize, c_int> {
    // SAFETY: the caller's signal set, when not null.
    let signals = Watch::begin(unsafe { sigmask.as_ref() });
    let deadline = timeout.map(|t| Instant::now() + t);
    open(sh);
    let n = scan(sh, out);
    if n > 0 {
        if n < out.len() && sh.pace.kernel_due() {
            return kernel(sh, ep, out, n, 0, sigmask);
        }
        return Ok(n);
    }
    if timeout == Some(Duration::ZERO) {
        return kernel(sh, ep, out, 0, 0, sigmask);
    }
    let n = spin(sh, ep, out, deadline, sigmask, &signals)?;
    if n > 0 {
        return Ok(n);
    }
    sh.close_session();
    cancel(sh);
    let n = scan(sh, out);
    if n > 0 {
        return Ok(n);
    }
    sync(sh, ep);
    let slept = now_ns();
    loop {
        if signals.interrupted() {
            return Err(libc::EINTR);
        }
        let n = kernel(sh, ep, out, 0, ms_left(deadline), sigmask)?;
        sh.pace.budget().woken(n > 0, slept);
        let also = ALSO.with(|a| a.borrow().iter().any(|p| p.revents != 0));
        if n > 0 || also || deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(n);
        }
        // Woken only for one-shot members that had fired: sleep again.
    }
}

/// A wait on `ep` through its shadow, if it has one (else `fallback`).
pub(super) unsafe fn wait_set(
    ep: RawFd,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    sigmask: *const sigset_t,
    fallback: impl FnOnce() -> c_int,
) -> c_int {
    let Some(sh) = table::shadow(ep) else {
        return fallback();
    };
    refuse_in_fork("a wait on an epoll set smclo serves");
    if events.is_null() || max <= 0 || max as usize > (c_int::MAX as usize) / 16 {
        return fallback();
    }
    if !live_members(&sh, ep) {
        sh.close_session();
        return fallback();
    }
    // SAFETY: the caller passes `max` writable events (as for the kernel);
    // this process's own memory, which no peer writes.
    let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
    match wait(&sh, ep, out, timeout, sigmask) {
        Ok(n) => n as c_int,
        Err(e) => {
            errno::set(e);
            -1
        }
    }
}
