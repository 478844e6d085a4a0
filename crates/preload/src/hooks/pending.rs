//! Handshakes that continue after `connect` or `accept` returned: a
//! non-blocking connect's, as a TCP connection's does, and an event loop's
//! accepted connection's (see docs/handshake.md "Handshake waits").
//!
//! Until the handshake decides, the descriptor is the TCP socket and is
//! not reported writable: its epoll registrations are given to the kernel
//! without `EPOLLOUT`, and `poll` does not ask for it. What the program
//! does next with the descriptor drives the handshake: the interposed
//! waits sleep in the kernel on the handshake's own descriptor too (the
//! peer's answer wakes them, see [`Wake`]) and look at it then; I/O and
//! `getsockopt` look once (a non-blocking call then fails with `EAGAIN`,
//! as on a TCP socket that is not connected yet) or wait for the decision
//! (a blocking call); `dup`, `fork` and `exec` wait for it, so that no
//! second descriptor or process inherits an undecided connection; `close`
//! withdraws the proposal (the server's declines it). SMC-D swaps the
//! descriptor then (its epoll registrations move to the channel); TCP
//! gives the registrations their `EPOLLOUT` back.

use super::ctx;
use super::state::{fallback_record, is_current_locked, out_hidden, pendings};
use super::swap::{swap_in, Holder};
use crate::critical::lock;
use crate::holders;
use crate::real;
use crate::table::{self, Connecting, Shut, Undecided, LOCK};
use libc::{c_int, pollfd};
use smclo::adapter::early_count::EARLY_MAX;
use smclo::adapter::errno;
use smclo::adapter::fallbacks::{FallbackRecord, Known};
use smclo::adapter::handshake::{self, Decision, Looker, Polled, TcpNews, Until, Wake};
use smclo::debug;
use smclo::device::Role;
use smclo_wire::reason::Reason;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a thread waits before it looks again at a handshake that
/// another thread drives.
const SLICE: Duration = Duration::from_millis(1);

/// How long a blocking call waits on the handshake before it looks at the
/// TCP connection again (a refused or reset connect ends the handshake).
const CHUNK: Duration = Duration::from_millis(5);

/// The writability a pending connect does not report.
const OUT_POLL: i16 = libc::POLLOUT | libc::POLLWRNORM | libc::POLLWRBAND;
thread_local! {
    /// This thread is driving a handshake: the swap's own calls on the
    /// descriptor (its `dup`) must not wait for that handshake.
    static DRIVING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether any connect of this process is pending (and this thread may
/// wait for one).
pub(super) fn any() -> bool {
    table::pending_count() > 0 && !DRIVING.with(|d| d.get())
}

/// Whether `fd`'s connect is pending (see [`any`]).
fn pending(fd: RawFd) -> bool {
    table::is_pending(fd) && !DRIVING.with(|d| d.get())
}

/// Whether `fd`'s connect is pending as an announcement (see
/// [`Connecting::announced`]): its calls are TCP's (`connect` again asks
/// the kernel).
pub(super) fn announced(fd: RawFd) -> bool {
    pending(fd) && table::connecting(fd).is_some_and(|c| c.announced)
}

/// Whether `fd` (a pending connect's socket) is non-blocking now. Asked
/// each time: the open file may be shared with descriptors and processes
/// made before the connect, whose `F_SETFL` no hook on `fd` sees.
pub(super) fn nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on the application's descriptor.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// How a pending connect ended.
enum Outcome {
    Decided(Box<Decision>),
    /// The TCP connect itself failed: its error is the application's.
    TcpFailed,
}

/// Whether the TCP connection of `fd` failed (refused, reset).
fn tcp_failed(fd: RawFd) -> bool {
    let mut p = pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { real::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLERR | libc::POLLHUP) != 0
}

/// Whether TCP socket `fd` is connected and its send buffer has room.
fn writable(fd: RawFd) -> bool {
    let mut p = pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { real::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLERR | libc::POLLHUP) == 0 && p.revents & libc::POLLOUT != 0
}

/// How a look at a pending handshake learns about its TCP socket.
#[derive(Clone, Copy)]
enum Look {
    /// It asks the socket (refused or reset, and, for a client, whether
    /// its server went on over TCP), sleeping at most until the instant
    /// (`None`: until the handshake ends).
    Asking(Option<Instant>),
    /// The caller's wait on the socket said this (see [`TcpNews`]); one
    /// step, no system call for the socket.
    Told(TcpNews),
}

/// Advances `pd` as `look` says.
fn step(fd: RawFd, pd: &mut Undecided, look: Look) -> Option<Outcome> {
    let until = match look {
        Look::Asking(until) => until,
        Look::Told(news) => {
            let now = Until::Step(Instant::now());
            return match pd.hs.poll_told(now, news) {
                Polled::Decided(d) => Some(Outcome::Decided(Box::new(d))),
                Polled::Waiting(_) => None,
            };
        }
    };
    loop {
        if tcp_failed(fd) {
            return Some(Outcome::TcpFailed);
        }
        let u = match until {
            Some(u) => Until::Step(u),
            None => Until::BlockingStep(Instant::now() + CHUNK),
        };
        if let Polled::Decided(d) = pd.hs.poll(u) {
            return Some(Outcome::Decided(Box::new(d)));
        }
        if until.is_some() {
            return None;
        }
    }
}

/// Looks at the handshake of `fd`, sleeping at most until `until`
/// (`None`: until it decides); whether it has decided. Keeps errno.
fn advance(fd: RawFd, until: Option<Instant>) -> bool {
    advance_as(fd, Look::Asking(until))
}

/// [`advance`] as `look` says.
fn advance_as(fd: RawFd, look: Look) -> bool {
    if !pending(fd) {
        return true;
    }
    let c = table::connecting(fd);
    let Some((c, pd)) = c.and_then(|c| {
        let pd = lock(&c.undecided).take()?;
        Some((c, pd))
    }) else {
        // Another thread drives it (or it was just decided).
        return !table::is_pending(fd);
    };
    errno::kept(|| {
        DRIVING.with(|d| d.set(true));
        let done = drive_one(fd, c, pd, look);
        DRIVING.with(|d| d.set(false));
        done
    })
}

/// Puts `pd`, undecided, back into `c` for the next look, unless `fd` was
/// closed meanwhile (and perhaps its number reused): then dropping `pd`,
/// after the lock, withdraws the proposal.
fn put_back(fd: RawFd, c: &Arc<Connecting>, pd: Undecided) {
    let g = LOCK.write();
    if is_current_locked(fd, c) {
        *lock(&c.undecided) = Some(pd);
    } else {
        holders::forget(pd.slot);
        drop(g);
        drop(pd);
    }
}

/// [`advance_as`] of `pd`, taken out of `c`.
fn drive_one(fd: RawFd, c: Arc<Connecting>, mut pd: Undecided, look: Look) -> bool {
    match step(fd, &mut pd, look) {
        None => {
            put_back(fd, &c, pd);
            false
        }
        Some(o) => {
            end(fd, &c, pd, o);
            true
        }
    }
}

/// The handshake `c` of `fd` ended with `o`.
fn end(fd: RawFd, c: &Arc<Connecting>, pd: Undecided, o: Outcome) {
    let Undecided {
        hs,
        slot,
        dest,
        shut,
    } = pd;
    let role = hs.role();
    drop(hs);
    let current = {
        let _g = LOCK.write();
        is_current_locked(fd, c)
    };
    if !current {
        // Closed while it was being decided: its number may name another
        // socket by now, which must not be touched. Dropping `o` closes
        // an SMC-D connection (the peer sees it closed).
        holders::forget(slot);
        debug!("fd {fd}: closed while its handshake with {dest} decided");
        return;
    }
    match o {
        Outcome::Decided(d) => match *d {
            Decision::Smc(est) => swap(
                fd,
                c,
                est,
                slot,
                shut,
                (role == Role::Client).then_some(dest),
            ),
            Decision::Tcp(r) => tcp(fd, c, slot, dest, role, r, shut),
        },
        Outcome::TcpFailed => {
            holders::forget(slot);
            debug!("fd {fd}: the TCP connection with {dest} failed; handshake abandoned");
            as_tcp(fd, c, shut, None);
        }
    }
}

/// The handshake of `fd` decided SMC-D: the swap.
/// A `shutdown` noted before the decision goes to the connection itself,
/// not to its number, which the program may have closed and reused since.
fn swap(
    fd: RawFd,
    c: &Arc<Connecting>,
    est: smclo::adapter::handshake::Established,
    slot: usize,
    shut: Shut,
    client_of: Option<SocketAddr>,
) {
    let nonblock = nonblocking(fd);
    // SAFETY: F_GETFD on the application's descriptor.
    let fdfl = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    let cloexec = fdfl >= 0 && fdfl & libc::FD_CLOEXEC != 0;
    let Some(s) = swap_in(fd, est, slot, nonblock, cloexec, Holder::Pending(c)) else {
        // The swap failed (both ends reset): `fd` stays the TCP socket,
        // no longer pending; or `fd` no longer holds `c`. A swap that
        // succeeded made it `Smc`.
        let _g = LOCK.write();
        super::state::swap_failed_locked(fd, c);
        return;
    };
    if let (Some(dest), Some(cx)) = (client_of, ctx()) {
        super::swap::learn(&s, cx, dest);
    }
    if let Some(how) = shut.how() {
        if let Err(e) = s.shutdown(how) {
            debug!("fd {fd}: the shutdown made before the decision failed: {e}");
        }
    }
}

/// The handshake of `fd` (this end `role`) decided TCP for `r`.
fn tcp(
    fd: RawFd,
    c: &Arc<Connecting>,
    slot: usize,
    dest: SocketAddr,
    role: Role,
    r: Reason,
    shut: Shut,
) {
    holders::forget(slot);
    let (what, peer) = match role {
        Role::Client => ("non-blocking connect to", "server"),
        Role::Server => ("connection accepted from", "client"),
    };
    if r == Reason::Timeout {
        debug!(
            "fd {fd}: {what} {dest}: the {peer} did not answer within SMCLO_CLC_WAIT_MS; \
             stays TCP (TIMEOUT)"
        );
    } else {
        debug!("fd {fd}: {what} {dest} stays TCP ({r})");
    }
    // An announcement no server took is not listed: a connection to a
    // plain server or another host takes no entry of the fallback table.
    let listed = ctx()
        .filter(|_| r != Reason::Unanswered)
        .and_then(|cx| fallback_record(cx, fd, role, r, Known::peer(Some(dest))));
    as_tcp(fd, c, shut, listed);
}

/// `fd` stays the TCP socket, listed as a fallback (`listed`): its
/// registrations report writability again (an edge-triggered one too:
/// the kernel looks again at a MOD).
fn as_tcp(fd: RawFd, c: &Arc<Connecting>, shut: Shut, listed: Option<FallbackRecord>) {
    let _g = LOCK.write();
    if let Some(how) = shut.how().filter(|_| is_current_locked(fd, c)) {
        // Under the lock, which `close` takes (it forgets the state):
        // `fd` is still the socket the shutdown was made on.
        // SAFETY: shutdown(2) on the application's TCP socket.
        if unsafe { real::shutdown(fd, how) } < 0 {
            debug!(
                "fd {fd}: the shutdown made before the decision failed: {}",
                io::Error::last_os_error()
            );
        }
    }
    super::state::stays_tcp_locked(fd, c, listed);
}

/// Looks once at the handshake of `fd`, if its connect is pending.
pub(super) fn look(fd: RawFd) {
    if pending(fd) {
        advance(fd, Some(Instant::now()));
    }
}

/// Ends the announcement of `fd` now, as TCP, unless a server has begun to
/// answer it: whether it was retracted. Keeps errno.
fn retract(fd: RawFd) -> bool {
    decide_now(fd, handshake::Pending::retract)
}

/// `fd` goes to another process (`SCM_RIGHTS`) with its handshake
/// undecided, which the receiver cannot finish. A client's is decided
/// here, as before `fork` and exec (bounded by its deadline), and an
/// SMC-D connection goes with the descriptor ([`super::passing`]). A
/// server's waits at most `SMCLO_PASS_WAIT_MS`, then ends as TCP, its
/// client told at once (PASSED, `Pending::pass`); without a wait (the
/// default) the process's listeners on its port also leave the registry
/// ([`super::state::unlist_listeners_passing`]): a connection made to be
/// passed pays the setup of two processes' mappings, which short
/// connections do not earn back. Keeps errno.
pub(super) fn pass(fd: RawFd) {
    let e = errno::get();
    let wait = ctx().map_or(std::time::Duration::ZERO, |c| c.cfg.pass_wait);
    let until = Instant::now() + wait;
    // Until it is decided: the descriptor must not leave undecided, also
    // while another thread drives its handshake.
    while pending(fd) {
        match role_now(fd) {
            Some(Role::Client) => settle(fd),
            Some(Role::Server) => {
                if Instant::now() < until {
                    advance(fd, Some(until));
                }
                if decide_now(fd, handshake::Pending::pass) {
                    debug!(
                        "fd {fd}: passed to another process before its handshake ended; stays TCP"
                    );
                    if let Some(port) = wait
                        .is_zero()
                        .then(|| smclo::adapter::sockaddr::local(fd).ok())
                        .flatten()
                    {
                        super::state::unlist_listeners_passing(port.port());
                    }
                }
            }
            None => {}
        }
        if pending(fd) {
            // Another thread drives it.
            std::thread::sleep(SLICE);
        }
    }
    errno::set(e);
}

/// Which end `fd`'s undecided handshake is; `None` while another thread
/// drives it (or once it is decided).
fn role_now(fd: RawFd) -> Option<Role> {
    let c = table::connecting(fd)?;
    let u = lock(&c.undecided);
    u.as_ref().map(|u| u.hs.role())
}

/// Decides the handshake of `fd` now as `how` does, if no other thread
/// drives it and `how` gives a decision (otherwise it stays undecided):
/// whether it was decided. Keeps errno.
fn decide_now(fd: RawFd, how: impl FnOnce(&mut handshake::Pending) -> Option<Decision>) -> bool {
    let Some(c) = table::connecting(fd) else {
        return false;
    };
    let Some(mut pd) = lock(&c.undecided).take() else {
        // Another thread drives it.
        return false;
    };
    let e = errno::get();
    let done = match how(&mut pd.hs) {
        Some(d) => {
            DRIVING.with(|x| x.set(true));
            end(fd, &c, pd, Outcome::Decided(Box::new(d)));
            DRIVING.with(|x| x.set(false));
            true
        }
        None => {
            put_back(fd, &c, pd);
            false
        }
    };
    errno::set(e);
    done
}

/// Waits for the decision on `fd` (bounded by its deadline). An
/// announcement is retracted first: only a server that has begun to
/// answer it is waited for.
pub(super) fn settle(fd: RawFd) {
    if announced(fd) {
        retract(fd);
    }
    while !advance(fd, None) {
        // Another thread drives it.
        std::thread::sleep(SLICE);
    }
}

/// Waits for every pending decision (before `fork` and `exec`), also
/// one another thread is waiting for: the child (the new image) would
/// inherit it undecided without the thread that drives it.
pub(super) fn settle_all() {
    if any() {
        pendings().into_iter().for_each(|(fd, _)| settle(fd));
    }
}

/// An I/O call on `fd` (`dontwait`: `MSG_DONTWAIT`): whether it may go on
/// (the connection has decided), or fails with this errno. A non-blocking
/// call gets `EAGAIN` while the handshake is undecided, as on a TCP socket
/// that is still connecting; a blocking call waits for the decision.
pub(super) fn before_io(fd: RawFd, dontwait: bool) -> Result<(), c_int> {
    if !pending(fd) {
        return Ok(());
    }
    if dontwait || nonblocking(fd) {
        if advance(fd, Some(Instant::now())) {
            return Ok(());
        }
        super::state::hide_early_out(fd);
        return Err(libc::EAGAIN);
    }
    settle(fd);
    Ok(())
}

/// A read on `fd` (`dontwait`: `MSG_DONTWAIT`), as [`before_io`]. An
/// announcement's read goes to the TCP socket as TCP's would: a
/// non-blocking one at once, a blocking one once the socket is readable
/// or the handshake decided. One `poll` of the socket with the
/// handshake's own descriptor (a server's connection to the rendezvous
/// socket, its answer on the channel), without waiting for a
/// non-blocking read, then one look at the handshake: the socket readable
/// says that the server went on over TCP (UNANSWERED, decided before the
/// read takes the bytes), refused or reset that the connection failed.
/// Nothing else is asked of the socket.
pub(super) fn before_read(fd: RawFd, dontwait: bool) -> Result<(), c_int> {
    if !announced(fd) {
        return before_io(fd, dontwait);
    }
    let wait = !dontwait && !nonblocking(fd);
    loop {
        let Some(sleep) = read_sleep(fd) else {
            if !announced(fd) {
                return before_io(fd, dontwait);
            }
            // Another thread drives it: its decision is at hand.
            std::thread::sleep(SLICE);
            continue;
        };
        let (mut all, n) = (sleep.fds, sleep.n);
        let ms = match sleep.within {
            _ if !wait => 0,
            None => -1,
            Some(d) => d.as_millis().clamp(1, i32::MAX as u128) as c_int,
        };
        // SAFETY: a valid array of `n` pollfds.
        let r = unsafe { real::poll(all.as_mut_ptr(), n as libc::nfds_t, ms) };
        let said = if r > 0 { all[0].revents } else { 0 };
        if said & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            // Refused or reset: what the look that asks finds.
            advance(fd, Some(Instant::now()));
            return Ok(());
        }
        if r > 0 && all[1..n].iter().any(|p| p.revents != 0) {
            let ready: Vec<RawFd> = all[1..n]
                .iter()
                .filter(|p| p.revents != 0)
                .map(|p| p.fd)
                .collect();
            woken(&ready, &[fd]);
        }
        let news = if said != 0 {
            TcpNews::Spoke
        } else {
            TcpNews::Nothing
        };
        if advance_as(fd, Look::Told(news)) || !wait {
            return Ok(());
        }
    }
}

/// What an announcement's read on `fd` sleeps on: the socket first, then
/// the handshake's descriptors (`n` in all), at most `within`.
struct ReadSleep {
    fds: [pollfd; 3],
    n: usize,
    within: Option<Duration>,
}

/// [`ReadSleep`] for the announcement of `fd`; `None` when it is no
/// longer announced or another thread drives it.
fn read_sleep(fd: RawFd) -> Option<ReadSleep> {
    let c = table::connecting(fd).filter(|c| c.announced)?;
    let (wake, deadline) = {
        let pd = lock(&c.undecided);
        let pd = pd.as_ref()?;
        (pd.hs.wake(), pd.hs.deadline())
    };
    let polled = |fd, events| pollfd {
        fd,
        events,
        revents: 0,
    };
    let mut out = ReadSleep {
        fds: [polled(fd, libc::POLLIN); 3],
        n: 1,
        within: None,
    };
    for w in [wake.fd, wake.also].into_iter().flatten() {
        out.fds[out.n] = polled(w, libc::POLLIN);
        out.n += 1;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    out.within = Some(wake.within.map_or(left, |w| w.min(left)));
    Some(out)
}

/// A write on `fd` that did not go early ([`early_send`]), as
/// [`before_io`]. An announcement is retracted (the write goes over TCP at
/// once), unless a server has begun to answer it, whose decision is then
/// waited for.
pub(super) fn before_write(fd: RawFd, dontwait: bool) -> Result<(), c_int> {
    if !announced(fd) {
        return before_io(fd, dontwait);
    }
    if advance(fd, Some(Instant::now())) || retract(fd) {
        return Ok(());
    }
    settle(fd);
    Ok(())
}

/// `shutdown(fd, how)` while `fd`'s connection may be undecided: `None`
/// when the caller goes on as for any descriptor (it was decided, or a
/// blocking socket waited for the decision, as its I/O does); `Some(0)`
/// when a non-blocking socket's undecided handshake has it noted, to be
/// carried out when it decides, so that an event loop never waits on the
/// peer. Said to the TCP socket now, an end of stream would not reach a
/// peer that reads the rings.
pub(super) fn shutdown(fd: RawFd, how: c_int) -> Option<c_int> {
    if !pending(fd) || !matches!(how, libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR) {
        return None;
    }
    if announced(fd) && retract(fd) {
        return None;
    }
    if !nonblocking(fd) {
        settle(fd);
        return None;
    }
    if advance(fd, Some(Instant::now())) {
        return None;
    }
    let noted = table::connecting(fd)
        .and_then(|c| lock(&c.undecided).as_mut().map(|pd| pd.shut.add(how)))
        .is_some();
    if noted {
        return Some(0);
    }
    // Another thread drives it: its decision is at hand.
    settle(fd);
    None
}

/// A send of `n` bytes at `buf` (`flags`: none but `MSG_NOSIGNAL` and
/// `MSG_DONTWAIT`) on `fd`, a blocking socket whose connect is pending: when its proposal
/// counts them as early bytes (the server has not taken the count, and
/// they fit [`EARLY_MAX`]), they go into the TCP stream now and `Some` is
/// the result, which the server moves into its ring if it accepts (see
/// `smclo::adapter::handshake::early`). `None`: the caller waits for the decision
/// ([`before_io`]).
pub(super) fn early_send(
    fd: RawFd,
    buf: *const libc::c_void,
    n: usize,
    flags: c_int,
) -> Option<libc::ssize_t> {
    let allowed = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
    if !pending(fd) || n == 0 || n > EARLY_MAX as usize || flags & !allowed != 0 {
        return None;
    }
    let c = table::connecting(fd)?;
    if c.announced {
        // A non-blocking socket too, once connected: a fresh connection's
        // send buffer takes EARLY_MAX bytes without waiting. One whose
        // connect returned connected (`early`) is not asked.
        if !c.early && !writable(fd) {
            return None;
        }
    } else if nonblocking(fd) {
        return None;
    }
    {
        let mut undecided = lock(&c.undecided);
        // Being driven by another thread (out of it): wait instead.
        let pd = undecided.as_mut()?;
        let p = pd.hs.proposal_mut()?;
        if !p.add_early(n) {
            return None;
        }
    }
    // Counted: every byte must now reach the stream, as a blocking TCP
    // send delivers all of them (a signal does not cut it short here).
    // Even with MSG_DONTWAIT: a fresh connection's send buffer holds
    // EARLY_MAX bytes, so the socket (a blocking one) does not wait.
    let flags = flags & !libc::MSG_DONTWAIT;
    let mut done = 0usize;
    while done < n {
        // SAFETY: the caller's `n` readable bytes at `buf`, from `done` on.
        let r = unsafe { real::send(fd, buf.cast::<u8>().add(done).cast(), n - done, flags) };
        match r {
            r if r >= 0 => done += r as usize,
            _ if errno::get() == libc::EINTR => {}
            _ if done == 0 => return Some(-1),
            _ => break,
        }
    }
    Some(done as libc::ssize_t)
}

/// What a wait over undecided handshakes sleeps on besides the program's
/// own descriptors.
struct Sleep {
    /// The handshakes' descriptors (see [`Wake`]), each once.
    fds: Vec<RawFd>,
    /// Look again after this long at the latest (a handshake that only
    /// shared memory tells about, or one's deadline).
    within: Option<Duration>,
}

/// Looks once at the handshakes pending among `fds`; what to sleep on if
/// one is still undecided (`None`: all have decided).
fn drive(fds: impl Iterator<Item = RawFd>) -> Option<Sleep> {
    let left: Vec<RawFd> = fds
        .filter(|&fd| pending(fd) && !advance(fd, Some(Instant::now())))
        .collect();
    (!left.is_empty()).then(|| sleep_for(&left))
}

/// What to sleep on for the handshakes of `fds` (those being driven by
/// another thread are looked at again after [`SLICE`]).
fn sleep_for(fds: &[RawFd]) -> Sleep {
    let now = Instant::now();
    let mut out = Sleep {
        fds: Vec::new(),
        within: None,
    };
    for fd in fds {
        let c = table::connecting(*fd);
        let looked = c.as_ref().and_then(|c| {
            let pd = lock(&c.undecided);
            pd.as_ref().map(|pd| (pd.hs.wake(), pd.hs.deadline()))
        });
        let (wake, deadline) = match looked {
            Some(l) => l,
            None => (
                Wake {
                    fd: None,
                    also: None,
                    within: Some(SLICE),
                },
                now + SLICE,
            ),
        };
        let by_deadline = Some(deadline.saturating_duration_since(now));
        out.within = min_timeout(out.within, min_timeout(wake.within, by_deadline));
        for w in [wake.fd, wake.also].into_iter().flatten() {
            if !out.fds.contains(&w) {
                out.fds.push(w);
            }
        }
    }
    out
}

/// The handshakes whose descriptor `ready` a wait over `mine` found
/// readable: a client takes the servers' connections off its rendezvous
/// socket (another thread's wait is told of one filed for it).
fn woken(ready: &[RawFd], mine: &[RawFd]) {
    if ready.is_empty() {
        return;
    }
    for (fd, c) in pendings() {
        if let Some(pd) = lock(&c.undecided).as_ref() {
            if pd.hs.wake().fd.is_some_and(|w| ready.contains(&w)) {
                pd.hs.readable(looker(mine, fd));
            }
        }
    }
}

/// Who looks next at the handshake of `fd`, found readable by a wait
/// over `mine`.
fn looker(mine: &[RawFd], fd: RawFd) -> Looker {
    if mine.contains(&fd) {
        Looker::Caller
    } else {
        Looker::Other
    }
}

/// The shorter of two optional timeouts (`None`: for ever).
fn min_timeout(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// A wait of at most `timeout` (`None`: for ever) made of calls of `once`
/// (one wait of at most the given timeout that also sleeps on the given
/// handshake descriptors, reporting in their `revents` which are
/// readable), driving the pending handshakes among `fds()` between them.
/// `None` if there is none: the caller waits as usual.
fn driving(
    timeout: Option<Duration>,
    fds: impl Fn() -> Vec<RawFd>,
    mut once: impl FnMut(Option<Duration>, &mut [pollfd]) -> c_int,
) -> Option<c_int> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut first = true;
    loop {
        let mine = fds();
        let sleep = drive(mine.iter().copied());
        if sleep.is_none() && first {
            return None;
        }
        first = false;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let Some(sleep) = sleep else {
            return Some(once(left, &mut []));
        };
        let t = min_timeout(sleep.within, left);
        let mut extra: Vec<pollfd> = sleep
            .fds
            .iter()
            .map(|&fd| pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let n = once(t, &mut extra);
        if n != 0 {
            return Some(n);
        }
        let ready: Vec<RawFd> = extra
            .iter()
            .filter(|p| p.revents != 0)
            .map(|p| p.fd)
            .collect();
        woken(&ready, &mine);
        let expired = deadline.is_some_and(|d| Instant::now() >= d);
        if expired || (ready.is_empty() && left.is_some_and(|l| t.is_some_and(|t| l <= t))) {
            return Some(0);
        }
    }
}

/// An epoll wait on `ep` while it holds pending handshakes (see
/// [`driving`]); `None` if it holds none. `once` is one wait on the set
/// (of at most the given timeout); its kernel sleep is also ended by the
/// handshakes' descriptors (`hooks::epoll::with_also`).
pub(super) fn epoll_wait(
    ep: RawFd,
    timeout: Option<Duration>,
    mut once: impl FnMut(Option<Duration>) -> c_int,
) -> Option<c_int> {
    if !any() {
        return None;
    }
    driving(
        timeout,
        || super::state::pending_in_epoll(ep),
        |t, extra| super::epoll::with_also(extra, || once(t)),
    )
}

/// A `poll` over `fds` while it holds pending handshakes (see
/// [`driving`]): they are asked for no writability until they decide, and
/// the handshakes' descriptors are polled after them; `None` if it holds
/// none.
pub(super) fn poll(
    fds: &mut [pollfd],
    timeout: Option<Duration>,
    mut once: impl FnMut(&mut [pollfd], Option<Duration>) -> c_int,
) -> Option<c_int> {
    if !any() || !fds.iter().any(|p| pending(p.fd)) {
        return None;
    }
    let list: Vec<RawFd> = fds.iter().map(|p| p.fd).collect();
    driving(
        timeout,
        || list.clone(),
        |t, extra| {
            let mut all: Vec<pollfd> = fds.iter().copied().chain(extra.iter().copied()).collect();
            for p in all.iter_mut().take(fds.len()) {
                if out_hidden(p.fd) {
                    p.events &= !OUT_POLL;
                }
            }
            let n = once(&mut all, t);
            if n < 0 {
                return n;
            }
            let (mine, theirs) = all.split_at(fds.len());
            for (p, q) in fds.iter_mut().zip(mine) {
                p.revents = q.revents;
            }
            extra.copy_from_slice(theirs);
            fds.iter().filter(|p| p.revents != 0).count() as c_int
        },
    )
}
