//! Setting connections up: `socket` marks TCP sockets as candidates,
//! `listen` registers TCP listeners in the device, and `accept`/`accept4`
//! and `connect` run the SMC-D handshake and, when both sides agree, swap
//! the descriptor in. Anything that is not a TCP stream, or a peer that is
//! not smclo, stays plain TCP.

use super::pending;
use super::state::list_fallback;
use super::swap::{clear_stale, learn, swap_in, Holder};
use super::{ctx, disabled, fail, in_table_range, is_listening, is_tcp_stream, Ctx};
use crate::hints::{self, Hint};
use crate::holders;
use crate::real;
use crate::table::{self, Kind, LOCK};
use libc::{c_int, sockaddr, socklen_t};
use smclo::adapter::accept_spin::{self, Spun};
use smclo::adapter::errno;
use smclo::adapter::fallbacks::{self, Known};
use smclo::adapter::handshake::{self, Decision, Polled, Until};
use smclo::adapter::registry;
use smclo::adapter::signal::{Call, Watch};
use smclo::config::Short;
use smclo::debug;
use smclo::device::Role;
use smclo_wire::reason::Reason;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::Instant;

/// Interposed `socket(2)`: marks TCP sockets as candidates (their epoll
/// registrations are recorded until they are connected) and records that
/// they are TCP streams ([`Hint::Tcp`]), so `connect` and `listen` need not ask.
#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: forwarded unchanged.
    let fd = super::limits::app_fd(unsafe { real::socket(domain, ty, proto) });
    if fd >= 0 && in_table_range(fd) && !disabled() {
        let tcp = matches!(domain, libc::AF_INET | libc::AF_INET6)
            && ty & 0xf == libc::SOCK_STREAM
            && (proto == 0 || proto == libc::IPPROTO_TCP);
        clear_stale(fd);
        super::state::made(fd, tcp);
    }
    fd
}

/// Interposed `listen(2)`: TCP listeners save SYNs and are registered in
/// the device, so smclo clients propose to them.
#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // As for bind: the port as free as over TCP.
    smclo::adapter::deferred::close_deferred();
    if disabled()
        || !in_table_range(fd)
        || matches!(table::kind(fd), Kind::Listener | Kind::Smc)
        || !is_tcp_stream(fd)
    {
        // SAFETY: forwarded unchanged.
        return unsafe { real::listen(fd, backlog) };
    }
    let Some(c) = ctx() else {
        hints::hint(fd, Hint::Plain);
        // SAFETY: forwarded unchanged.
        return unsafe { real::listen(fd, backlog) };
    };
    // Before the real listen: no SYN may arrive unsaved.
    let saved = smclo::adapter::tcp_syn::save_syns(fd);
    // SAFETY: forwarded unchanged.
    let r = unsafe { real::listen(fd, backlog) };
    if r != 0 {
        return r;
    }
    errno::kept(|| register(c, fd, saved));
    0
}

/// Registers the listening TCP socket `fd` in the device once its SYNs are
/// saved (`saved`), so that no client proposes before its SYN can be read
/// back; on failure its connections stay TCP ([`Hint::Plain`]).
fn register(c: &Ctx, fd: RawFd, saved: std::io::Result<()>) {
    if super::uring::in_use() {
        record_registration(fd, Err("this process uses io_uring".into()));
        if let Ok(a) = smclo::adapter::sockaddr::local(fd) {
            // Another process may register the same socket.
            super::uring::decline(fd, a);
        }
        return;
    }
    let registered = saved
        .map_err(|err| format!("TCP_SAVE_SYN failed ({err})"))
        .and_then(|()| {
            smclo::adapter::sockaddr::local(fd)
                .map_err(smclo::Error::from)
                .and_then(|a| registry::register_listener(&c.dev, a))
                .map_err(|err| format!("listener not registered ({err})"))
        });
    record_registration(fd, registered);
}

/// Keeps `fd`'s registration, or, when there is none, lets its
/// connections stay TCP ([`Hint::Plain`]), saying why.
fn record_registration(fd: RawFd, registered: Result<registry::ListenerGuard, String>) {
    match registered {
        Ok(guard) => {
            let g = LOCK.write();
            // Seen using io_uring since `register` asked: its unlisting
            // may have run before this listener was in the table.
            if super::uring::seen() {
                drop(g);
                drop(guard);
                hints::hint(fd, Hint::Plain);
                debug!("fd {fd}: not registered; its connections stay TCP (this process uses io_uring)");
                return;
            }
            super::state::listening_locked(fd, guard);
            debug!("fd {fd}: listening, registered for SMC-D");
        }
        Err(why) => {
            hints::hint(fd, Hint::Plain);
            debug!("fd {fd}: {why}; its connections stay TCP");
        }
    }
}

/// `accept`, `accept4` and `epoll_ctl` meet `fd`: if nothing is known
/// about it, it may be a listening TCP socket that this process did not
/// make listen, inherited through exec (systemd socket activation with
/// `LISTEN_FDS`, inetd's wait mode, a supervisor that binds and then execs
/// the server). Such a listener is registered now, as `listen` would have;
/// anything else gets [`Hint::Plain`], so each descriptor is asked once
/// and a known one costs one atomic load. Connections queued before the
/// registration were made by clients that found no listener, so they never
/// proposed: they stay TCP without waiting (the server's debug line says
/// `NO_SAVED_SYN` for those the kernel queued before SYNs were saved).
///
/// Threads that meet the same listener at once may both register it; the
/// later registration replaces the earlier in its `hooks::state` record, whose guard
/// then unregisters it. No lock is taken that a `fork` could leave held.
fn adopt_if_unknown(fd: RawFd) {
    // Our `socket`, `listen` and `accept` leave a state or a hint on
    // every descriptor they return.
    if !super::state::unknown(fd) || disabled() {
        return;
    }
    errno::kept(
        || match ctx().filter(|_| is_listening(fd) && is_tcp_stream(fd)) {
            Some(c) => {
                debug!("fd {fd}: a TCP listener inherited from another program; registering it");
                register(c, fd, smclo::adapter::tcp_syn::save_syns(fd));
            }
            None => hints::hint(fd, Hint::Plain),
        },
    );
}

/// `epoll_ctl(EPOLL_CTL_ADD)` of `fd`: an event loop adds its listener
/// before its first `accept`; registering it then accelerates the
/// connections that arrive meanwhile too.
pub(super) fn epoll_add(fd: RawFd) {
    adopt_if_unknown(fd);
}

/// A descriptor returned by `accept`: a connected socket, never a listener.
fn accepted(nfd: c_int) -> c_int {
    if nfd >= 0 {
        hints::hint(nfd, Hint::Plain);
    }
    nfd
}

/// What the accepted `nfd` is known to share with its listener `fd`: a TCP
/// stream of the same family ([`Hint::Tcp`]) and the listener's timeouts and
/// `TCP_INQ`, which the kernel copies to it ([`Hint::Timeo`], [`Hint::Inq`]):
/// the swap then asks for them only if the program set some on the listener.
fn inherit_flags(fd: c_int, nfd: c_int) {
    for h in [Hint::Tcp, Hint::Timeo, Hint::Inq] {
        if hints::hinted(fd, h) {
            hints::hint(nfd, h);
        }
    }
}

/// Interposed `accept(2)`.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let call = Call::begin();
    adopt_if_unknown(fd);
    if table::kind(fd) != Kind::Listener {
        if let Err(e) = before_sleep(&call, fd, None) {
            return fail(e);
        }
        if !super::limits::accept_has_room(fd) {
            return fail(libc::EMFILE);
        }
        // SAFETY: forwarded unchanged.
        return accepted(super::limits::app_fd(unsafe {
            real::accept(fd, addr, len)
        }));
    }
    // SAFETY: same arguments, flags 0 is what accept means.
    unsafe { accept_smc(&call, fd, addr, len, 0) }
}

/// Interposed `accept4(2)`.
#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let call = Call::begin();
    adopt_if_unknown(fd);
    if table::kind(fd) != Kind::Listener {
        if let Err(e) = before_sleep(&call, fd, None) {
            return fail(e);
        }
        if !super::limits::accept_has_room(fd) {
            return fail(libc::EMFILE);
        }
        // SAFETY: forwarded unchanged.
        return accepted(super::limits::app_fd(unsafe {
            real::accept4(fd, addr, len, flags)
        }));
    }
    // SAFETY: forwarded.
    unsafe { accept_smc(&call, fd, addr, len, flags) }
}

/// Whether the listening socket `fd` blocks: an event loop's non-blocking
/// listener must not sleep in `accept` on one client.
fn listener_blocks(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on the caller's listening socket.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl < 0 || fl & libc::O_NONBLOCK == 0
}

/// Before `accept`'s system call on `fd` (`blocks`: whether it blocks,
/// if asked already): a handler that ran in `call` (in the preload's own
/// work, or the spin) ends it as it would the kernel's sleep, `EINTR`, or
/// the call starts over. The listener is asked only then: rarely.
fn before_sleep(call: &Call, fd: RawFd, blocks: Option<bool>) -> Result<(), c_int> {
    if !call.interrupted() || !blocks.unwrap_or_else(|| listener_blocks(fd)) {
        return Ok(());
    }
    if !accept_restarts(fd) {
        return Err(libc::EINTR);
    }
    call.restart();
    Ok(())
}

/// Whether a blocking `accept` on `fd` that a signal handler interrupted
/// is restarted, as the kernel decides for sockets (signal(7)): not when
/// the socket has a receive timeout (`SO_RCVTIMEO`, asked now: it may have
/// been set before this process), otherwise when the handlers have
/// `SA_RESTART` (see `hooks::data`).
fn accept_restarts(fd: RawFd) -> bool {
    let timeout = super::swap::socket_timeout(fd, libc::SO_RCVTIMEO)
        .flatten()
        .is_some_and(|t| !t.is_zero());
    !timeout && super::data::handlers_restart()
}

unsafe fn accept_smc(
    call: &Call,
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // The size of the caller's address buffer: `accept` reports the
    // address's full length, which may be more than it wrote.
    // SAFETY: a non-null `len` is the caller's readable socklen_t.
    let cap = if len.is_null() { 0 } else { unsafe { *len } };
    // An accept may wait for the next client: ended connections' TCP
    // sockets are closed first.
    smclo::adapter::deferred::close_deferred();
    // The spin comes first: asking whether the listener blocks costs a
    // system call that a plain client's accept need not pay.
    let blocks = accept_spin::may_spin().then(|| listener_blocks(fd));
    let spun = if blocks == Some(true) {
        let watch = Watch::begin(None);
        match accept_spin::before_accept(fd, &watch) {
            Spun::Interrupted if !accept_restarts(fd) => return fail(libc::EINTR),
            s => s,
        }
    } else {
        Spun::Skipped
    };
    if let Err(e) = before_sleep(call, fd, blocks) {
        return fail(e);
    }
    if !super::limits::accept_has_room(fd) {
        return fail(libc::EMFILE);
    }
    // SAFETY: the caller's arguments, forwarded.
    let nfd = super::limits::app_fd(unsafe { real::accept4(fd, addr, len, flags) });
    if nfd < 0 {
        return nfd;
    }
    accept_spin::accepted(spun);
    let e = errno::get();
    clear_stale(nfd);
    accepted(nfd);
    inherit_flags(fd, nfd);
    let Some(c) = ctx() else { return nfd };
    if !in_table_range(nfd) {
        // Not upgradable: the client falls back after its bounded wait.
        debug!("fd {nfd}: above the table, stays TCP");
        return nfd;
    }
    // SAFETY: `addr`, `len` and `cap` as `accept` left them.
    let peer = unsafe { accepted_peer(addr, len, cap) };
    let plain = accept_handshake(c, fd, blocks, nfd, flags, peer);
    if plain {
        renew_if_lost(fd);
    }
    errno::set(e);
    nfd
}

/// The handshake of `nfd`, just accepted on listener `fd` with `flags`
/// from `peer` (if `accept` reported it); `blocks`: whether the listener
/// blocks, if asked already. Returns whether the client did not propose
/// ([`accepted_tcp`]).
fn accept_handshake(
    c: &Ctx,
    fd: RawFd,
    blocks: Option<bool>,
    nfd: RawFd,
    flags: c_int,
    peer: Option<SocketAddr>,
) -> bool {
    let now = Instant::now();
    let mut h = handshake::Pending::accept(&c.dev, &c.cfg, nfd, now + c.cfg.clc_wait);
    // The saved SYN's addresses are the socket's: a fallback is listed
    // without asking for them.
    let known = match h.seen_ends() {
        Some((local, peer)) => Known {
            local: Some(local),
            peer: Some(peer),
        },
        None => Known::peer(peer),
    };
    if let Some(r) = h.settled() {
        return accepted_tcp(c, nfd, r, known);
    }
    if super::uring::in_use() {
        // Declined at once: its client goes on over TCP without waiting.
        let r = match h.refuse(Reason::IoUring) {
            Some(Decision::Tcp(r)) => r,
            _ => Reason::IoUring,
        };
        return accepted_tcp(c, nfd, r, known);
    }
    let Some(slot) = holders::claim() else {
        debug!("fd {nfd}: no holder slot, stays TCP");
        return false;
    };
    if blocks.unwrap_or_else(|| listener_blocks(fd)) && flags & libc::SOCK_NONBLOCK == 0 {
        accept_decided(c, nfd, h.finish(), slot, flags, known)
    } else {
        accept_in_steps(c, nfd, h, slot, flags, known)
    }
}

/// A client that did not propose connected to listener `fd`: if the
/// listener's registration was lost while this process listens on it (a
/// fork child whose parent, which registered it, closed its copy or
/// exited), it is registered again
/// ([`ListenerGuard::renewed`](registry::ListenerGuard::renewed)), so that
/// the next clients propose.
fn renew_if_lost(fd: RawFd) {
    if super::uring::seen() {
        // Its accepts decline: no registration to renew.
        return;
    }
    let Some(renewed) = super::state::listener_guard(fd).and_then(|g| g.renewed(fd)) else {
        return;
    };
    let renewed = renewed.map_err(|err| format!("listener not registered again ({err})"));
    record_registration(fd, renewed);
}

/// The handshake of `nfd`, accepted by an event loop (a non-blocking
/// listener, or a non-blocking connection asked for): whatever the
/// client's answer takes beyond the spin budget, `accept` returns without
/// it, and the handshake goes on from the program's next calls on `nfd`
/// (`hooks::pending`). Returns whether the client did not propose
/// ([`accept_decided`]).
fn accept_in_steps(
    c: &Ctx,
    nfd: RawFd,
    mut h: handshake::Pending,
    slot: usize,
    flags: c_int,
    known: Known,
) -> bool {
    let spin = Until::Step(Instant::now() + smclo::adapter::conn::spin_budget());
    if let Polled::Decided(d) = h.poll(spin) {
        return accept_decided(c, nfd, d, slot, flags, known);
    }
    let Some(from) = known
        .peer
        .or_else(|| smclo::adapter::sockaddr::peer(nfd).ok())
    else {
        // Without the peer's address the connection cannot be listed; it
        // is decided here instead (bounded by SMCLO_CLC_WAIT_MS).
        return accept_decided(c, nfd, h.finish(), slot, flags, known);
    };
    debug!("fd {nfd}: accepted from {from}; the handshake goes on after accept");
    super::state::start(nfd, h, slot, from, false);
    false
}

/// The handshake of the accepted `nfd`, holding holder slot `slot`,
/// decided `d`. Returns whether the client did not propose
/// ([`accepted_tcp`]).
fn accept_decided(
    c: &Ctx,
    nfd: RawFd,
    d: Decision,
    slot: usize,
    flags: c_int,
    known: Known,
) -> bool {
    match d {
        Decision::Smc(est) => {
            accept_spin::peer_proposed(true);
            swap_in(
                nfd,
                est,
                slot,
                flags & libc::SOCK_NONBLOCK != 0,
                flags & libc::SOCK_CLOEXEC != 0,
                Holder::Fresh,
            );
            false
        }
        Decision::Tcp(r) => {
            holders::forget(slot);
            accepted_tcp(c, nfd, r, known)
        }
    }
}

/// The accepted `nfd` stays TCP for `r`: listed as a fallback. Returns
/// whether the client did not propose (`PEERNOSMC`).
fn accepted_tcp(c: &Ctx, nfd: RawFd, r: Reason, known: Known) -> bool {
    let plain = r == Reason::PeerNoSmc;
    accept_spin::peer_proposed(!plain);
    debug!("fd {nfd}: accepted as TCP ({r})");
    list_fallback(c, nfd, Role::Server, r, known);
    plain
}

/// The peer address `accept` wrote for the application, if it asked for
/// it (saves a `getpeername`).
///
/// # Safety
/// `addr` and `len` as `accept` left them (null, or a buffer of `cap`
/// bytes whose first `min(cap, *len)` the kernel wrote).
unsafe fn accepted_peer(
    addr: *mut sockaddr,
    len: *mut socklen_t,
    cap: socklen_t,
) -> Option<SocketAddr> {
    if addr.is_null() || len.is_null() {
        return None;
    }
    // SAFETY: a non-null `len` is readable (the caller's contract).
    let n = cap.min(unsafe { *len });
    // `from_raw` reads a whole `sockaddr` before it looks at the family.
    if (n as usize) < std::mem::size_of::<sockaddr>() {
        return None;
    }
    // SAFETY: `n` bytes, at least a `sockaddr`, were written at `addr`.
    unsafe { smclo::adapter::sockaddr::from_raw(addr, n) }
}

/// The real `connect` of a socket that stays TCP for `reason`: once it
/// is connected or in progress, counted as a fallback (a connect that
/// failed, refused or unreachable, made no connection, as the kernel's SMC
/// counts none) and listed in the fallback table if
/// [`fallbacks::client_lists`] says so. A non-blocking connect is counted
/// when it starts: one the server then refuses still counts.
///
/// # Safety
/// As `connect(2)`: `addr` points to `len` readable bytes.
unsafe fn connect_listed(
    c: &Ctx,
    fd: RawFd,
    addr: *const sockaddr,
    len: socklen_t,
    reason: Reason,
    dest: SocketAddr,
) -> c_int {
    // SAFETY: forwarded unchanged (the caller's contract).
    let r = unsafe { real::connect(fd, addr, len) };
    let e = errno::get();
    if r == 0 || e == libc::EINPROGRESS {
        c.dev.count_fallback(reason, Role::Client);
        if fallbacks::client_lists(reason) {
            list_fallback(c, fd, Role::Client, reason, Known::peer(Some(dest)));
        }
        errno::set(e);
    }
    r
}

/// `connect` again on a socket whose connect is in progress or done (an
/// event loop asking whether it is done, as hiredis does): `EALREADY`
/// while the handshake is undecided (a blocking socket waits for it), then
/// `EISCONN` for an SMC-D connection; `None` for the real call.
fn connect_again(fd: RawFd) -> Option<c_int> {
    if pending::before_io(fd, false).is_err() {
        return Some(super::fail(libc::EALREADY));
    }
    table::get(fd).map(|_| super::fail(libc::EISCONN))
}

/// Interposed `bind(2)`: notes that the socket's source address is set, so
/// that a proposal asks for it (see [`Hint::Bound`]); an unbound socket of our
/// `socket()` needs no `getsockname` before its SYN.
#[no_mangle]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // Before the call: a failed bind costs only the question.
    hints::hint(fd, Hint::Bound);
    // The port may be one an ended connection's TCP socket still holds
    // (smclo::adapter::deferred): it is as free as over TCP. Only a TCP
    // socket's: a UDP port of the same number is another port.
    // SAFETY: the caller passes `len` readable bytes at `addr`, as bind
    // requires.
    match unsafe { smclo::adapter::sockaddr::from_raw(addr, len) }.map_or(0, |a| a.port()) {
        port if port != 0 && is_tcp_stream(fd) => {
            smclo::adapter::deferred::close_deferred_freeing(port)
        }
        _ => smclo::adapter::deferred::close_deferred(),
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::bind(fd, addr, len) }
}

/// Interposed `connect(2)`: proposes SMC-D to registered smclo listeners.
/// A non-blocking connect returns what the TCP connect returned
/// (`EINPROGRESS`) and leaves the handshake pending (`hooks::pending`): an
/// event loop never waits on the server's `accept`. So does a blocking
/// one whose server can answer without it (an earlier connection joined
/// the two processes), so that the program's first request travels with
/// the handshake (early bytes); otherwise a blocking connect completes
/// the handshake before it returns (bounded by `SMCLO_CLC_WAIT_MS`).
///
/// A destination without a live smclo listener costs no system call
/// besides the real `connect`: the candidate was recorded as a TCP stream
/// by `socket()`, and the proposal first looks the destination up in the
/// device's listener registry (shared memory); the descriptor flags are
/// read only when the connection is about to be swapped. (The process's
/// first connect or listen also looks once for io_uring, `hooks::uring`:
/// its open descriptors, a `readlink` each.)
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if pending::announced(fd) {
        // Connecting again while announced: TCP's own answer (EALREADY,
        // EISCONN), as nothing waits for the announcement.
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    if let Some(r) = connect_again(fd) {
        return r;
    }
    if disabled() || !matches!(table::kind(fd), Kind::Candidate | Kind::Pending { .. }) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    // SAFETY: the caller passes `len` readable bytes at `addr`.
    let dest = unsafe { smclo::adapter::sockaddr::from_raw(addr, len) };
    let (Some(dest), Some(c)) = (dest, ctx()) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    };
    if !is_tcp_stream(fd) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    // A socket of our socket() whose IP options the application left alone
    // needs no reading of them for the SYN mark.
    let facts = handshake::SocketFacts {
        unbound: hints::hinted(fd, Hint::Tcp) && !hints::hinted(fd, Hint::Bound),
        default_ip_options: hints::hinted(fd, Hint::Tcp) && !hints::hinted(fd, Hint::IpOpts),
        announce: true,
    };
    if super::uring::as_looked() {
        debug!("fd {fd}: connect to {dest} stays TCP (this process uses io_uring)");
        super::state::end_candidacy(fd);
        // SAFETY: forwarded unchanged.
        return unsafe { connect_listed(c, fd, addr, len, Reason::IoUring, dest) };
    }
    if c.cfg.short == Short::Learn && !smclo::adapter::short::propose(dest) {
        debug!("fd {fd}: connect to {dest} stays TCP (its last connections there were short)");
        super::state::end_candidacy(fd);
        // SAFETY: forwarded unchanged.
        return unsafe { connect_listed(c, fd, addr, len, Reason::Short, dest) };
    }
    let mut p = match handshake::client_propose_with(&c.dev, &c.cfg, fd, dest, facts) {
        Ok(p) => p,
        Err(r) => {
            debug!("fd {fd}: connect to {dest} stays TCP ({r})");
            super::state::end_candidacy(fd);
            // SAFETY: forwarded unchanged.
            return unsafe { connect_listed(c, fd, addr, len, r, dest) };
        }
    };
    if super::uring::loaded_since() {
        drop(p);
        debug!("fd {fd}: connect to {dest} stays TCP (this process uses io_uring)");
        super::state::end_candidacy(fd);
        // SAFETY: forwarded unchanged.
        return unsafe { connect_listed(c, fd, addr, len, Reason::IoUring, dest) };
    }
    let Some(slot) = holders::claim() else {
        drop(p);
        debug!("fd {fd}: no holder slot; connect to {dest} stays TCP");
        super::state::end_candidacy(fd);
        // SAFETY: forwarded unchanged.
        return unsafe { connect_listed(c, fd, addr, len, Reason::Mem, dest) };
    };
    let start = Instant::now();
    // Another thread may close the number while this one waits below, or
    // duplicate it, which then waits for the decision.
    let holder = Holder::held(fd);
    super::state::connecting(fd, true);
    // SAFETY: forwarded unchanged.
    let r = unsafe { real::connect(fd, addr, len) };
    let e = errno::get();
    p.syn_sent();
    if r != 0 && e != libc::EINPROGRESS {
        // The TCP connect failed: report exactly its error.
        super::state::connecting(fd, false);
        holders::forget(slot);
        drop(p);
        errno::set(e);
        return -1;
    }
    // EINPROGRESS: a non-blocking socket, or a blocking one whose
    // SO_SNDTIMEO ran out; TCP's connect goes on either way (the pending
    // handshake asks the socket's mode when it matters). A non-blocking
    // connect may also complete at once on loopback (0). An announcement
    // never waits for its server: its handshake goes on after connect, and
    // its writes go early, whether it is connected yet or not; connected
    // (0), its socket's mode does not matter, and is not asked.
    let announced = p.announced();
    let connecting = r != 0 || (!announced && pending::nonblocking(fd));
    if connecting || p.answer_expected_unaided() || announced {
        // The handshake goes on after connect returns, as TCP's does: the
        // program's next wait or call on `fd` drives it. A blocking
        // program's first request, written before the server answered,
        // goes into the TCP stream as early bytes (`pending::early_send`),
        // so that the server finds it with the connection instead of
        // waiting for it. Only when the server can answer without us: a
        // program that idles after connect would keep a first contact's
        // server waiting for our DMB until it gives up.
        let hs = handshake::Pending::connect(p, start + c.cfg.clc_wait);
        super::state::start(fd, hs, slot, dest, !connecting);
        errno::set(e);
        return r;
    }
    let deadline = Instant::now() + c.cfg.clc_wait;
    match handshake::Pending::connect(p, deadline).finish() {
        Decision::Smc(est) => {
            // SAFETY: F_GETFD on the caller's descriptor.
            let fdfl = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
            let cloexec = fdfl >= 0 && fdfl & libc::FD_CLOEXEC != 0;
            if let Some(s) = swap_in(fd, est, slot, false, cloexec, holder) {
                learn(&s, c, dest);
            }
        }
        Decision::Tcp(r) => {
            holders::forget(slot);
            debug!("fd {fd}: connected to {dest} as TCP ({r})");
            list_fallback(c, fd, Role::Client, r, Known::peer(Some(dest)));
        }
    }
    super::state::end_candidacy(fd);
    0
}
