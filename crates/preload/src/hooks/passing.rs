//! SMC-D connections passed to another process with `SCM_RIGHTS`, as a
//! dispatcher hands connections to its workers: the receiving process goes
//! on with the connection through shared memory, as an exec'd image does
//! ([`super::adopt`]).
//!
//! The program's descriptor of a connection is its channel, which the
//! kernel passes like any other. What else the receiver needs travels in
//! the same message as one more descriptor after the program's, a
//! *parcel*: a UNIX datagram socket whose one queued datagram starts with
//! [`MAGIC`] and describes the connections ([`Passed`] lines: the
//! program's descriptors by their positions in the message, ours by
//! their positions in the datagram) and carries, for each, its TCP socket
//! and the memfds of both DMBs. The kernel delivers every `SCM_RIGHTS`
//! descriptor of a message in one array, in order, so the parcel is the
//! array's last. A receiver that does not know parcels gets one
//! descriptor more, and closing it frees what the parcel holds.
//!
//! - Sending ([`sendmsg`]): the message goes with a control buffer that is
//!   the program's plus one `SCM_RIGHTS` header for the parcel. From then
//!   on the receiver ends the connection ([`Conn::pass_export`]); if the
//!   message is not sent, nothing changed.
//! - Receiving ([`recvmsg`]): the kernel writes into a control buffer with
//!   room for every descriptor a message can carry. The program's control
//!   buffer gets what the kernel would have written there (truncated as
//!   the kernel truncates, `MSG_CTRUNC`); then the parcel's connections
//!   whose descriptors the program got are adopted at those numbers, and
//!   the parcel is closed. A connection that cannot be adopted is reset
//!   and the program's descriptor becomes its TCP socket. [`recvmmsg`]
//!   does the same for each of its messages with a control buffer, in
//!   one system call.
//!
//! A receiver without this library gets the channels: the peer sees the
//! connection reset once the receiver closes them. A connection passed to
//! two processes (or twice) ends when the first of them closes it.

use super::adopt::{self, hex, unhex, Passed};
use super::cmsg::{
    cmsgs, control_len, fd_bytes, hdr_len, one_buffer, passed_fds, pidfds, program_control,
    push_cmsg, room, MAX_FDS,
};
use super::LIVE;
use crate::real;
use crate::table::{self, Sock};
use libc::{c_int, msghdr, ssize_t};
use smclo::adapter::conn::{Conn, ExecParts};
use smclo::adapter::errno;
use smclo::adapter::fdnum;
use smclo::adapter::sockaddr;
use smclo::debug;
use std::cell::RefCell;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The start of a parcel's datagram, with its layout's version.
const MAGIC: &[u8] = b"smclo-passed 2 ";
/// Descriptors a parcel carries per connection: TCP socket, local and
/// peer memfd.
const PER_CONN: usize = 3;
/// The largest parcel datagram read.
const PARCEL_MAX: usize = 1 << 16;

fn close(fd: RawFd) {
    // SAFETY: a descriptor the kernel gave this call, which nobody else
    // knows of.
    unsafe { real::close(fd) };
}

// ---- Sending ----------------------------------------------------------

/// What a message adds for the connections it passes.
struct Parcel {
    /// The program's control messages and the parcel's.
    control: Vec<u8>,
    /// The parcel's descriptor in it, closed here once the message is
    /// sent.
    _parcel: OwnedFd,
    /// The connections passed, each with whether it had been passed
    /// before ([`Conn::unpass`] if the message is not sent).
    socks: Vec<(Arc<Sock>, bool)>,
}

/// Interposed `sendmsg(2)` on a descriptor that is not an SMC-D
/// connection: connections among the descriptors passed go with a parcel
/// (see the module documentation).
pub(super) unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let parcel = if msg.is_null() || !live() {
        None
    } else {
        // SAFETY: the application's msghdr, which the kernel reads next.
        prepare(unsafe { &*msg })
    };
    let Some(mut p) = parcel else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendmsg(fd, msg, flags) };
    };
    // SAFETY: the application's msghdr (checked non-null above), copied.
    let mut m = unsafe { std::ptr::read(msg) };
    m.msg_control = p.control.as_mut_ptr().cast();
    m.msg_controllen = p.control.len() as _;
    // SAFETY: the application's message with our control buffer, which
    // lives until the call returns.
    let n = unsafe { real::sendmsg(fd, &m, flags) };
    // A stream socket sends no descriptor with no byte.
    if n < 0 || (n == 0 && payload_len(&m) == 0) {
        errno::kept(|| {
            for (s, before) in &p.socks {
                s.conn.unpass(*before);
            }
        });
    } else {
        for (s, _) in &p.socks {
            debug!(
                "SCM_RIGHTS: SMC-D connection (channel fd {}) passed to another process, which ends it",
                s.conn.fd()
            );
        }
    }
    n
}

/// Whether this process has connections to pass (one load, or two).
fn live() -> bool {
    LIVE.load(Ordering::Relaxed) > 0 || super::pending::any()
}

/// The bytes `m` sends.
fn payload_len(m: &msghdr) -> usize {
    if m.msg_iov.is_null() {
        return 0;
    }
    // SAFETY: the application's iovec array of `msg_iovlen` entries, which
    // the kernel accepted.
    let v =
        unsafe { std::slice::from_raw_parts(m.msg_iov, (m.msg_iovlen as c_int).max(0) as usize) };
    v.iter().map(|i| i.iov_len).sum()
}

/// The application's control buffer of `m`, if any.
fn app_control(m: &msghdr) -> Option<&[u8]> {
    if m.msg_control.is_null() || control_len(m) < hdr_len() {
        return None;
    }
    // SAFETY: the application's control buffer of `msg_controllen` bytes,
    // which the program does not change during its own call.
    Some(unsafe { std::slice::from_raw_parts(m.msg_control.cast::<u8>(), control_len(m)) })
}

/// Whether one of the `n` messages of `v` (`sendmmsg`) passes a
/// descriptor that is, or may become, an SMC-D connection (no system
/// call).
pub(super) fn may_pass(v: *const libc::mmsghdr, n: libc::c_uint) -> bool {
    if v.is_null() || !live() {
        return false;
    }
    (0..n as usize).any(|i| {
        // SAFETY: the application passes `n` mmsghdrs.
        let m = unsafe { &(*v.add(i)).msg_hdr };
        app_control(m).is_some_and(|c| {
            passed_fds(c)
                .into_iter()
                .any(|fd| table::get(fd).is_some() || table::is_pending(fd))
        })
    })
}

/// The parcel for the connections `m` passes; `None` when it passes none
/// (an accepted connection whose handshake is undecided is decided first,
/// or stays TCP: [`super::pending::pass`]).
fn prepare(m: &msghdr) -> Option<Parcel> {
    let control = app_control(m)?;
    let fds = passed_fds(control);
    let mut conns: Vec<(Arc<Sock>, Vec<usize>)> = Vec::new();
    for (i, &fd) in fds.iter().enumerate() {
        if table::get(fd).is_none() {
            super::pending::pass(fd);
        }
        let Some(s) = table::get(fd) else { continue };
        match conns.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &s)) {
            Some((_, at)) => at.push(i),
            None => conns.push((s, vec![i])),
        }
    }
    if conns.is_empty() {
        return None;
    }
    let ctx = super::ctx()?;
    if fds.len() + 1 > MAX_FDS || conns.len() * PER_CONN > MAX_FDS {
        debug!("SCM_RIGHTS: too many descriptors in one message to pass SMC-D connections; the receiver cannot use them");
        return None;
    }
    let mut lines = Vec::new();
    let mut theirs: Vec<OwnedFd> = Vec::new();
    let mut socks = Vec::new();
    for (s, at) in conns {
        match export(&s, &at, theirs.len()) {
            Ok((line, fds, before)) => {
                lines.push(line);
                theirs.extend(fds);
                socks.push((s, before));
            }
            Err(why) => debug!(
                "SCM_RIGHTS: SMC-D connection on fd {} cannot go with its descriptor ({why}); the receiver cannot use it",
                fds[at[0]]
            ),
        }
    }
    if lines.is_empty() {
        return None;
    }
    let dir = hex(ctx.dev.dir().as_os_str().as_encoded_bytes());
    let text = format!("{dir} {}", lines.join("\n"));
    match parcel_socket(&text, &theirs) {
        Ok(parcel) => {
            let mut control = control.to_vec();
            let one = [parcel.as_raw_fd()];
            push_cmsg(
                &mut control,
                libc::SOL_SOCKET,
                libc::SCM_RIGHTS,
                &fd_bytes(&one),
            );
            Some(Parcel {
                control,
                _parcel: parcel,
                socks,
            })
        }
        Err(e) => {
            debug!("SCM_RIGHTS: no parcel for the SMC-D connections passed ({e}); the receiver cannot use them");
            for (s, before) in &socks {
                s.conn.unpass(*before);
            }
            None
        }
    }
}

/// Connection `s`, the program's descriptors at positions `at` of the
/// message: its parcel line (its own descriptors from position `base` of
/// the parcel's), those descriptors, and whether it had been passed
/// before.
fn export(
    s: &Arc<Sock>,
    at: &[usize],
    base: usize,
) -> Result<(String, [OwnedFd; 3], bool), String> {
    s.syn_mark.put_back(s.tcp);
    let tcp = fdnum::dup_high(s.tcp).map_err(|e| e.to_string())?;
    let (ExecParts { local, peer, state }, before) =
        s.conn.pass_export(&s.reg).map_err(|e| e.to_string())?;
    s.conn.share_file();
    let line = Passed {
        fds: at.iter().map(|&i| i as RawFd).collect(),
        chan: at[0] as RawFd,
        tcp: base as RawFd,
        local: (base + 1) as RawFd,
        peer: (base + 2) as RawFd,
        shut_rd: s.conn.read_shut(),
        linger0: s.linger0.load(Ordering::Relaxed),
        holders: Vec::new(),
        st: state,
    };
    Ok((line.encode(), [tcp, local, peer], before))
}

/// A UNIX datagram socket holding one datagram, [`MAGIC`] and `text`,
/// with descriptors `fds`.
fn parcel_socket(text: &str, fds: &[OwnedFd]) -> std::io::Result<OwnedFd> {
    let mut sv = [-1; 2];
    // SAFETY: socketpair writes two descriptors into `sv`.
    let r = unsafe {
        real::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both just created, owned by nobody else.
    let (tx, rx) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    let rx = fdnum::dup_high(rx.as_raw_fd())?;
    let mut data = MAGIC.to_vec();
    data.extend_from_slice(text.as_bytes());
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut control = Vec::new();
    push_cmsg(
        &mut control,
        libc::SOL_SOCKET,
        libc::SCM_RIGHTS,
        &fd_bytes(&raw),
    );
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let m = one_buffer(&mut iov, control.as_mut_ptr().cast(), control.len());
    // SAFETY: a message of our own buffers, which live across the call.
    if unsafe { real::sendmsg(tx.as_raw_fd(), &m, libc::MSG_DONTWAIT) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rx)
}

// ---- Receiving --------------------------------------------------------

thread_local! {
    /// Control buffers for programs whose own are larger than the stack's.
    static LARGE: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Whether `m` has a control buffer, into which the kernel may put
/// descriptors.
fn has_control(m: &msghdr) -> bool {
    !m.msg_control.is_null() && control_len(m) > 0
}

/// The words of our control buffer for `m`: the program's bytes and room
/// for every descriptor a message can carry; none without a control
/// buffer.
fn words_for(m: &msghdr) -> usize {
    if has_control(m) {
        (control_len(m) + room()).div_ceil(8)
    } else {
        0
    }
}

/// Runs `f` with a buffer of `words` words, zeroed (the kernel leaves the
/// padding between control messages unwritten): on the stack if it fits,
/// else the thread's.
fn with_words<R>(words: usize, f: impl FnOnce(&mut [u64]) -> R) -> R {
    let mut stack = [0u64; 512];
    if words <= stack.len() {
        return f(&mut stack[..words]);
    }
    LARGE.with(|l| match l.try_borrow_mut() {
        Ok(mut v) => {
            v.clear();
            v.resize(words, 0);
            f(&mut v)
        }
        // A signal handler's receive within ours: a buffer of its own.
        Err(_) => f(&mut vec![0u64; words]),
    })
}

/// Interposed `recvmsg(2)` on a descriptor that is not an SMC-D
/// connection: see the module documentation.
pub(super) unsafe fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the application's msghdr, if any.
    let Some(m) = (unsafe { msg.as_mut() }).filter(|m| has_control(m)) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmsg(fd, msg, flags) };
    };
    with_words(words_for(m), |buf| {
        let mut mine = ours(m, buf);
        // SAFETY: the application's message with our control buffer.
        let n = unsafe { real::recvmsg(fd, &mut mine, flags) };
        if n >= 0 {
            // SAFETY: the kernel received into `mine`, whose control
            // buffer is `buf`.
            unsafe { finish(m, &mine, buf.len() * 8, flags) };
        }
        n
    })
}

/// Interposed `recvmmsg(2)` on a descriptor that is not an SMC-D
/// connection: one system call, in which each message with a control
/// buffer receives into one of ours; each is then given what
/// [`recvmsg`] gives. The kernel applies `MSG_WAITFORONE`, the timeout
/// and a later message's error as to the program's own call.
pub(super) unsafe fn recvmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    t: *mut libc::timespec,
) -> c_int {
    let app: &mut [libc::mmsghdr] = if v.is_null() {
        &mut []
    } else {
        // SAFETY: the application passes `n` mmsghdrs, which the kernel
        // does not see (it gets our copies).
        unsafe { std::slice::from_raw_parts_mut(v, n as usize) }
    };
    if !app.iter().any(|h| has_control(&h.msg_hdr)) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmmsg(fd, v, n, flags, t) };
    }
    let words = app.iter().map(|h| words_for(&h.msg_hdr)).sum();
    with_words(words, |buf| {
        let mut mine = ours_all(app, buf);
        // SAFETY: copies of the application's messages, with our control
        // buffers where they have one; `buf` outlives the call.
        let got = unsafe { real::recvmmsg(fd, mine.as_mut_ptr(), n, flags, t) };
        for (a, m) in app.iter_mut().zip(&mine).take(got.max(0) as usize) {
            // SAFETY: the kernel received into `m`, a copy of `a`.
            unsafe { finish_one(a, m, flags) };
        }
        got
    })
}

/// The program's message `m` with `buf` for the kernel's control
/// messages.
fn ours(m: &msghdr, buf: &mut [u64]) -> msghdr {
    let mut mine = *m;
    mine.msg_control = buf.as_mut_ptr().cast();
    mine.msg_controllen = (buf.len() * 8) as _;
    mine
}

/// Copies of the program's messages `app`, those with a control buffer
/// given theirs from `buf`, in order ([`words_for`] each).
fn ours_all(app: &[libc::mmsghdr], mut buf: &mut [u64]) -> Vec<libc::mmsghdr> {
    let mut mine = app.to_vec();
    for h in &mut mine {
        let (b, rest) = std::mem::take(&mut buf).split_at_mut(words_for(&h.msg_hdr));
        buf = rest;
        if !b.is_empty() {
            h.msg_hdr = ours(&h.msg_hdr, b);
        }
    }
    mine
}

/// The program's message `a` of a `recvmmsg` after the kernel received
/// into our copy `m`.
///
/// # Safety
/// As [`finish`]'s, `m` having been made by [`ours_all`] from `a`.
unsafe fn finish_one(a: &mut libc::mmsghdr, m: &libc::mmsghdr, flags: c_int) {
    a.msg_len = m.msg_len;
    if has_control(&a.msg_hdr) {
        let cap = words_for(&a.msg_hdr) * 8;
        // SAFETY: the caller's.
        unsafe { finish(&mut a.msg_hdr, &m.msg_hdr, cap, flags) };
    } else {
        // Its own pointers, with the kernel's lengths and flags.
        a.msg_hdr = m.msg_hdr;
    }
}

/// The program's message `m` after the kernel received into `mine`, a
/// copy with our control buffer of `cap` bytes: its control buffer gets
/// what the kernel would have written there, and a parcel's connections
/// are adopted ([`deliver`]).
///
/// # Safety
/// `m` is the application's message, its control buffer valid for its
/// `msg_controllen` bytes; `mine`'s control buffer holds `cap` bytes,
/// which the kernel wrote.
unsafe fn finish(m: &mut msghdr, mine: &msghdr, cap: usize, flags: c_int) {
    let want = control_len(m);
    let len = control_len(mine).min(cap);
    // SAFETY: the kernel wrote `len` bytes of our buffer.
    let got = unsafe { std::slice::from_raw_parts(mine.msg_control.cast::<u8>(), len) };
    let (out, trunc) = if got.len() <= want && !cmsgs(got).any(|c| c.is_rights()) {
        // What the kernel wrote, as it would have into the program's.
        (std::borrow::Cow::Borrowed(got), false)
    } else {
        let (v, t) = deliver(got, want, flags);
        (std::borrow::Cow::Owned(v), t)
    };
    // SAFETY: the application's control buffer holds `want` bytes and
    // `out` is at most that long.
    unsafe {
        std::ptr::copy_nonoverlapping(out.as_ptr(), m.msg_control.cast::<u8>(), out.len());
    }
    m.msg_namelen = mine.msg_namelen;
    m.msg_controllen = out.len() as _;
    m.msg_flags = mine.msg_flags | if trunc { libc::MSG_CTRUNC } else { 0 };
}

/// The program's control buffer (at most `want` bytes) from what the
/// kernel wrote into ours, `got`, and whether it was truncated; a
/// parcel's connections among the descriptors the program got are
/// adopted, and the parcel is closed.
fn deliver(got: &[u8], want: usize, flags: c_int) -> (Vec<u8>, bool) {
    let mut fds = passed_fds(got);
    // Fresh numbers: what the table knew of them is stale.
    fds.iter().for_each(|&f| super::swap::clear_stale(f));
    // A parcel follows at least one descriptor of the program's: a lone
    // descriptor costs no look.
    let parcel = fds
        .last()
        .copied()
        .filter(|&f| fds.len() >= 2 && is_parcel(f));
    if parcel.is_some() {
        fds.pop();
    }
    let pidfds = pidfds(got);
    pidfds.iter().for_each(|&f| super::swap::clear_stale(f));
    let (out, trunc, fit, pidfd_kept) = program_control(got, want, &fds);
    fds[fit..].iter().for_each(|&f| close(f));
    if flags & libc::MSG_PEEK == 0 {
        super::uring::received(&fds[..fit]);
    }
    if !pidfd_kept {
        pidfds.iter().for_each(|&f| close(f));
    }
    if let Some(p) = parcel {
        if flags & libc::MSG_PEEK == 0 {
            take_parcel(p, &fds[..fit], flags & libc::MSG_CMSG_CLOEXEC != 0);
        }
        close(p);
    }
    (out, trunc)
}

/// Whether `fd` is a parcel: a UNIX datagram socket whose next datagram
/// starts with [`MAGIC`] (peeked without its descriptors).
fn is_parcel(fd: RawFd) -> bool {
    let opt = |name| super::sockopt_int(fd, name);
    if opt(libc::SO_DOMAIN) != Some(libc::AF_UNIX) || opt(libc::SO_TYPE) != Some(libc::SOCK_DGRAM) {
        return false;
    }
    let mut head = [0u8; 16];
    // SAFETY: reads at most `head.len()` bytes into `head`; no control
    // buffer, so no descriptor is installed.
    let n = unsafe {
        real::recv(
            fd,
            head.as_mut_ptr().cast(),
            head.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).is_ok_and(|n| head[..n].starts_with(MAGIC))
}

/// Reads parcel `p` and adopts its connections whose descriptors the
/// program got (`delivered`, by position in the message); closes the
/// rest of what it carries.
fn take_parcel(p: RawFd, delivered: &[RawFd], cloexec: bool) {
    let Some((text, theirs)) = read_parcel(p) else {
        debug!("SCM_RIGHTS: an unreadable parcel; its connections are unusable here");
        return;
    };
    let lines = text.split_once(' ').map(|(dir, list)| {
        let passed: Option<Vec<Passed>> = list.split('\n').map(Passed::decode).collect();
        (dir, passed)
    });
    match lines {
        Some((dir, Some(passed))) => {
            for p in passed {
                match at_numbers(p, delivered, &theirs) {
                    Some(p) => adopt_one(p, dir, cloexec),
                    None => debug!("SCM_RIGHTS: an SMC-D connection passed whose descriptors the program did not get (truncated) is closed"),
                }
            }
        }
        _ => debug!(
            "SCM_RIGHTS: a parcel of another smclo version; its connections are unusable here"
        ),
    }
    theirs.iter().for_each(|&f| close(f));
}

/// The parcel's datagram: its text after [`MAGIC`] and its descriptors.
fn read_parcel(p: RawFd) -> Option<(String, Vec<RawFd>)> {
    let mut data = vec![0u8; PARCEL_MAX];
    let mut control = vec![0u64; room().div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut m = one_buffer(&mut iov, control.as_mut_ptr().cast(), control.len() * 8);
    // SAFETY: a message of our own buffers.
    let n = unsafe { real::recvmsg(p, &mut m, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    let n = usize::try_from(n).ok()?;
    // SAFETY: the kernel wrote `msg_controllen` bytes of `control`.
    let got = unsafe {
        std::slice::from_raw_parts(
            control.as_ptr().cast::<u8>(),
            control_len(&m).min(control.len() * 8),
        )
    };
    let fds = passed_fds(got);
    let text = data[..n]
        .strip_prefix(MAGIC)
        .and_then(|t| String::from_utf8(t.to_vec()).ok());
    match text {
        Some(t) if m.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) == 0 => Some((t, fds)),
        _ => {
            fds.iter().for_each(|&f| close(f));
            None
        }
    }
}

/// `p` with its positions turned into the descriptors the program got
/// and the parcel's (duplicated at high numbers); `None` if the program
/// got none of its descriptors or the parcel lacks one of its own.
fn at_numbers(mut p: Passed, delivered: &[RawFd], theirs: &[RawFd]) -> Option<Passed> {
    let fds: Vec<RawFd> = p
        .fds
        .iter()
        .filter_map(|&i| delivered.get(usize::try_from(i).ok()?).copied())
        .collect();
    let chan = usize::try_from(p.chan)
        .ok()
        .and_then(|i| delivered.get(i).copied())
        .or(fds.first().copied())?;
    let high = |i: RawFd| {
        let f = *theirs.get(usize::try_from(i).ok()?)?;
        fdnum::dup_high(f).ok()
    };
    // Owned until adoption takes them: dropped (closed) on the way out.
    let (tcp, local, peer) = (high(p.tcp)?, high(p.local)?, high(p.peer)?);
    p.fds = fds;
    p.chan = chan;
    p.tcp = tcp.into_raw_fd();
    p.local = local.into_raw_fd();
    p.peer = peer.into_raw_fd();
    // Parcels name no other holders; a forged one must not add any.
    p.holders.clear();
    Some(p)
}

/// Adopts one passed connection at the program's descriptors, or resets
/// it.
fn adopt_one(p: Passed, dir: &str, cloexec: bool) {
    match adopt_in(&p, dir, cloexec) {
        Ok(()) => debug!(
            "SCM_RIGHTS: adopted SMC-D connection on fd {} (hidden TCP fd {})",
            p.chan, p.tcp
        ),
        Err((why, consumed)) => adopt::reset(&p, &why, consumed),
    }
}

/// [`adopt_one`]'s work; the error says why, and whether the memfds and
/// the channel were consumed.
fn adopt_in(p: &Passed, dir: &str, cloexec: bool) -> Result<(), (String, bool)> {
    let ctx = super::ctx().ok_or(("this process has no device".to_string(), false))?;
    if super::uring::in_use() {
        // Its io_uring calls would go to the channel itself.
        return Err(("this process uses io_uring".to_string(), false));
    }
    let ours = hex(ctx.dev.dir().as_os_str().as_encoded_bytes());
    if ours != dir {
        let theirs = unhex(dir).map(|d| String::from_utf8_lossy(&d).into_owned());
        return Err((
            format!("it is on device {theirs:?}, this process uses another"),
            false,
        ));
    }
    let ends = sockaddr::local(p.tcp).and_then(|l| Ok((l, sockaddr::peer(p.tcp)?)));
    let (local, peer) = ends.map_err(|e| (format!("its TCP socket: {e}"), false))?;
    // SAFETY: the descriptors came with the message for this connection
    // and nothing else owns them.
    let (lo, pe, chan) = unsafe {
        (
            OwnedFd::from_raw_fd(p.local),
            OwnedFd::from_raw_fd(p.peer),
            OwnedFd::from_raw_fd(p.chan),
        )
    };
    let parts = ExecParts {
        local: lo,
        peer: pe,
        state: p.st,
    };
    let (conn, reg) =
        Conn::pass_adopt(&ctx.dev, parts, chan, local, peer).map_err(|e| (e.to_string(), true))?;
    adopt::install(p, conn, reg, cloexec).map_err(|e| (e, true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        (a.into(), b.into())
    }

    /// Sends one byte with `n` descriptors of /dev/null on `fd`.
    fn send_fds(fd: RawFd, n: usize) {
        let fds: Vec<RawFd> = (0..n)
            .map(|_| std::fs::File::open("/dev/null").unwrap().into_raw_fd())
            .collect();
        let mut control = Vec::new();
        push_cmsg(
            &mut control,
            libc::SOL_SOCKET,
            libc::SCM_RIGHTS,
            &fd_bytes(&fds),
        );
        let mut byte = [b'x'];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        let m = one_buffer(&mut iov, control.as_mut_ptr().cast(), control.len());
        // SAFETY: a valid message of our own buffers.
        assert_eq!(unsafe { real::sendmsg(fd, &m, 0) }, 1);
        fds.into_iter().for_each(close);
    }

    /// Which receive a test makes.
    #[derive(Clone, Copy, Debug)]
    enum Via {
        /// libc's own `recvmsg`, or `recvmmsg` (the test binary interposes
        /// both).
        Kernel,
        Recvmsg,
        Recvmmsg,
    }

    /// What a received message gives the program: the control buffer's
    /// length used, whether `MSG_CTRUNC` is set, the headers' levels,
    /// types and lengths, and how many descriptors came.
    type Seen = (usize, bool, Vec<(c_int, c_int, usize)>, usize);

    /// What a receive of one message with a control buffer of `want`
    /// bytes gives.
    fn receive(fd: RawFd, want: usize, via: Via) -> Seen {
        let mut buf = vec![0u64; want.div_ceil(8) + 1];
        let mut byte = [0u8];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        let m = one_buffer(&mut iov, buf.as_mut_ptr().cast(), want);
        // SAFETY: an all-zero mmsghdr is valid; its message is set below.
        let mut v: [libc::mmsghdr; 1] = unsafe { std::mem::zeroed() };
        v[0].msg_hdr = m;
        let n = receive_into(fd, &mut v, 0, std::ptr::null_mut(), via);
        assert_eq!((n, v[0].msg_len), (1, 1), "{via:?}");
        seen(&v[0].msg_hdr)
    }

    /// Receives into the messages `v` through `via` (one `recvmsg` when
    /// `v` has one message); how many came, or -1.
    fn receive_into(
        fd: RawFd,
        v: &mut [libc::mmsghdr],
        flags: c_int,
        t: *mut libc::timespec,
        via: Via,
    ) -> c_int {
        let (p, n) = (v.as_mut_ptr(), v.len() as libc::c_uint);
        // SAFETY: valid messages of the caller's buffers.
        unsafe {
            match via {
                Via::Kernel if n > 1 => real::recvmmsg(fd, p, n, flags, t),
                Via::Recvmmsg => recvmmsg(fd, p, n, flags, t),
                Via::Kernel | Via::Recvmsg => {
                    let m = &mut (*p).msg_hdr;
                    let r = match via {
                        Via::Kernel => real::recvmsg(fd, m, flags),
                        _ => recvmsg(fd, m, flags),
                    };
                    (*p).msg_len = r.max(0) as libc::c_uint;
                    r.min(1) as c_int
                }
            }
        }
    }

    /// What the program sees of the received message `m`; the
    /// descriptors it got are closed.
    fn seen(m: &msghdr) -> Seen {
        let got: &[u8] = if m.msg_control.is_null() {
            &[]
        } else {
            // SAFETY: the kernel (or deliver) wrote msg_controllen bytes.
            unsafe { std::slice::from_raw_parts(m.msg_control.cast::<u8>(), control_len(m)) }
        };
        let heads = cmsgs(got)
            .map(|c| {
                // The header's own length, as the program reads it.
                // SAFETY: `c.data` follows its header within `got`.
                let h = unsafe {
                    std::ptr::read_unaligned(c.data.as_ptr().sub(hdr_len()).cast::<libc::cmsghdr>())
                };
                (c.level, c.kind, h.cmsg_len as usize)
            })
            .collect();
        let fds = passed_fds(got);
        fds.iter().for_each(|&f| close(f));
        (
            control_len(m),
            m.msg_flags & libc::MSG_CTRUNC != 0,
            heads,
            fds.len(),
        )
    }

    /// The program's control buffer after our receive is what the kernel
    /// gives for every size, from none to more than enough, truncated
    /// included.
    #[test]
    fn a_received_control_buffer_is_the_kernels() {
        let (a, b) = pair();
        // SAFETY: CMSG_SPACE is arithmetic.
        let space = |n: u32| unsafe { libc::CMSG_SPACE(4 * n) } as usize;
        let sizes = [
            hdr_len(),
            hdr_len() + 3,
            hdr_len() + 4,
            space(1),
            space(2) - 1,
            space(2),
            space(3),
            200,
        ];
        same_as_the_kernel(&a, &b, "", &sizes, &[1, 2, 3]);
    }

    /// Each of `counts` descriptors, received into each of `sizes` bytes,
    /// by the kernel and by our `recvmsg` and `recvmmsg`: the same.
    fn same_as_the_kernel(a: &OwnedFd, b: &OwnedFd, what: &str, sizes: &[usize], counts: &[usize]) {
        for &want in sizes {
            for &n in counts {
                send_fds(a.as_raw_fd(), n);
                let kernel = receive(b.as_raw_fd(), want, Via::Kernel);
                for via in [Via::Recvmsg, Via::Recvmmsg] {
                    send_fds(a.as_raw_fd(), n);
                    let ours = receive(b.as_raw_fd(), want, via);
                    assert_eq!(
                        ours, kernel,
                        "{via:?}: {what}{n} descriptors into {want} bytes"
                    );
                }
            }
        }
    }

    /// Sets the `SOL_SOCKET` option `name` of `fd` to 1; whether it could.
    fn set_on(fd: &OwnedFd, name: c_int) -> bool {
        let one: c_int = 1;
        // SAFETY: setsockopt reads an int.
        let r = unsafe {
            real::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&one as *const c_int).cast(),
                4,
            )
        };
        r == 0
    }

    /// With credentials before the descriptors (`SO_PASSCRED`), each
    /// truncated as the kernel truncates it.
    #[test]
    fn a_received_control_buffer_with_credentials_is_the_kernels() {
        let (a, b) = pair();
        assert!(set_on(&b, libc::SO_PASSCRED));
        let sizes = [8, hdr_len(), 20, 24, 28, 32, 36, 40, 44, 48, 56, 200];
        same_as_the_kernel(&a, &b, "credentials, ", &sizes, &[1, 2]);
    }

    /// With the sender's pidfd (`SO_PASSPIDFD`, Linux 6.5) after the
    /// descriptors: installed only where the program's buffer has room
    /// for it, as the kernel does.
    #[test]
    fn a_received_control_buffer_with_a_pidfd_is_the_kernels() {
        const SO_PASSPIDFD: c_int = 76;
        let (a, b) = pair();
        if !set_on(&b, SO_PASSPIDFD) {
            // An older kernel: nothing to compare.
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::ENOPROTOOPT)
            );
            return;
        }
        let sizes = [hdr_len(), 20, 24, 32, 36, 40, 44, 48, 56, 200];
        same_as_the_kernel(&a, &b, "pidfd, ", &sizes, &[1, 2]);
    }

    /// Several messages in one `recvmmsg`: one without a control buffer,
    /// one whose buffer is too small for its descriptors, and one for
    /// which nothing came (`MSG_WAITFORONE`: the call does not wait for
    /// it): the count, each message and the timeout written back are what
    /// the kernel gives.
    #[test]
    fn messages_received_together_are_the_kernels() {
        let (a, b) = pair();
        // A receive that waits fails after 5 s instead of hanging.
        let limit = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        // SAFETY: setsockopt reads a timeval.
        let r = unsafe {
            real::setsockopt(
                b.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&limit as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as _,
            )
        };
        assert_eq!(r, 0);
        // SAFETY: CMSG_SPACE is arithmetic.
        let space = |n: u32| unsafe { libc::CMSG_SPACE(4 * n) } as usize;
        let wants = [space(1), 0, space(1), space(3), space(1)];
        let mut results = Vec::new();
        for via in [Via::Kernel, Via::Recvmmsg] {
            for n in [1, 2, 2, 3] {
                send_fds(a.as_raw_fd(), n);
            }
            results.push(receive_many(b.as_raw_fd(), &wants, via));
        }
        assert_eq!(results[1], results[0]);
        assert_eq!((results[0].0, results[0].2), (4, true));
    }

    /// One `recvmmsg` (`MSG_WAITFORONE`, a timeout of 10 s) into messages
    /// with control buffers of `wants` bytes (0: none): how many came, the
    /// length and what the program sees of each, and whether the timeout
    /// was written back and the call returned within `SO_RCVTIMEO`.
    fn receive_many(fd: RawFd, wants: &[usize], via: Via) -> (c_int, Vec<(u32, Seen)>, bool) {
        let mut bufs: Vec<Vec<u64>> = wants.iter().map(|w| vec![0; w.div_ceil(8) + 1]).collect();
        let mut bytes = vec![[0u8; 1]; wants.len()];
        let mut iovs: Vec<libc::iovec> = bytes
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 1,
            })
            .collect();
        let mut v: Vec<libc::mmsghdr> = iovs
            .iter_mut()
            .zip(&mut bufs)
            .zip(wants)
            .map(|((iov, buf), &want)| {
                let c = if want == 0 {
                    std::ptr::null_mut()
                } else {
                    buf.as_mut_ptr().cast()
                };
                // SAFETY: an all-zero mmsghdr is valid; its message is set
                // below.
                let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
                h.msg_hdr = one_buffer(iov, c, want);
                h
            })
            .collect();
        let mut t = libc::timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        let t0 = std::time::Instant::now();
        let n = receive_into(fd, &mut v, libc::MSG_WAITFORONE, &mut t, via);
        let quick = t0.elapsed() < std::time::Duration::from_secs(5);
        let each = v
            .iter()
            .take(n.max(0) as usize)
            .map(|h| (h.msg_len, seen(&h.msg_hdr)))
            .collect();
        (n, each, quick && t.tv_sec < 10)
    }

    /// A parcel is a UNIX datagram socket whose datagram starts with the
    /// magic; its text and descriptors are read back.
    #[test]
    fn only_a_datagram_socket_with_the_magic_is_a_parcel() {
        let devnull = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let p = parcel_socket("x 1,2", &[devnull]).unwrap();
        assert!(is_parcel(p.as_raw_fd()));
        let (text, fds) = read_parcel(p.as_raw_fd()).unwrap();
        assert_eq!((text.as_str(), fds.len()), ("x 1,2", 1));
        fds.into_iter().for_each(close);
        let plain = std::fs::File::open("/dev/null").unwrap();
        assert!(!is_parcel(plain.as_raw_fd()));
        let (x, y) = std::os::unix::net::UnixDatagram::pair().unwrap();
        x.send(b"smclo-passed 1 old").unwrap();
        assert!(!is_parcel(y.as_raw_fd()), "another layout");
        let (_s, t) = pair();
        assert!(!is_parcel(t.as_raw_fd()), "a stream socket");
    }
}
