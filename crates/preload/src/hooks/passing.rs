//! SMC-D connections passed to another process with `SCM_RIGHTS`, as a
//! dispatcher hands connections to its workers: the receiving process goes
//! on with the connection through shared memory, as an exec'd image does
//! ([`super::adopt`]).
//!
//! The program's descriptor of a connection is its channel, which the
//! kernel passes like any other. What else the receiver needs travels in
//! the same message, after the program's descriptors: for each connection
//! its TCP socket and the memfds of both DMBs, then a *parcel*, a sealed
//! memfd that starts with [`MAGIC`] and describes them ([`Passed`] lines
//! whose numbers are positions in the message's descriptors). The kernel
//! delivers every `SCM_RIGHTS` descriptor of a message in one array, in
//! order, so the parcel is the array's last.
//!
//! - Sending ([`sendmsg`]): the message goes with a control buffer that is
//!   the program's plus one `SCM_RIGHTS` header for ours. From then on the
//!   receiver ends the connection ([`Conn::pass_export`]); if the message
//!   is not sent, nothing changed.
//! - Receiving ([`recvmsg`]): the kernel writes into a control buffer with
//!   room for ours; a parcel's connections are adopted at the numbers the
//!   program got, our descriptors are closed, and the program's control
//!   buffer gets what the kernel would have written there (truncated as
//!   the kernel truncates, `MSG_CTRUNC`). A connection that cannot be
//!   adopted is reset and the program's descriptor becomes its TCP socket.
//!
//! A receiver without this library gets the channels and our descriptors:
//! the peer sees the connection reset once the receiver closes them.

use super::adopt::{self, hex, unhex, Passed};
use super::{errno, set_errno, LIVE};
use crate::real;
use crate::table::{self, Sock};
use libc::{c_int, msghdr, ssize_t};
use smclo::adapter::chan_sys;
use smclo::adapter::conn::{Conn, ExecParts};
use smclo::adapter::fdnum;
use smclo::adapter::sockaddr;
use smclo::debug;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The start of a parcel, with its layout's version.
const MAGIC: &[u8] = b"smclo-passed 1 ";
/// The seals of a parcel: all of them, which a program's own memfd with
/// our magic is not expected to have.
const SEALS: c_int =
    libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
/// Descriptors per message (the kernel's `SCM_MAX_FD`).
const MAX_FDS: usize = 253;
/// Descriptors we add per connection: TCP socket, local and peer memfd.
const PER_CONN: usize = 3;
/// A parcel larger than this is not ours.
const PARCEL_MAX: u64 = 1 << 20;

/// The size of a control message header.
fn hdr_len() -> usize {
    std::mem::size_of::<libc::cmsghdr>()
}

/// `CMSG_ALIGN`: control messages are aligned to `size_t`.
fn align(n: usize) -> usize {
    let a = std::mem::size_of::<usize>();
    (n + a - 1) & !(a - 1)
}

/// One control message of a buffer.
struct Cmsg<'a> {
    level: c_int,
    kind: c_int,
    data: &'a [u8],
}

impl Cmsg<'_> {
    fn is_rights(&self) -> bool {
        self.level == libc::SOL_SOCKET && self.kind == libc::SCM_RIGHTS
    }

    fn fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        self.data
            .chunks_exact(4)
            .map(|c| RawFd::from_ne_bytes([c[0], c[1], c[2], c[3]]))
    }
}

/// The control messages of `buf`, as `CMSG_NXTHDR` walks them.
fn cmsgs(buf: &[u8]) -> impl Iterator<Item = Cmsg<'_>> {
    let mut off = 0;
    std::iter::from_fn(move || {
        let rest = buf.get(off..)?;
        if rest.len() < hdr_len() {
            return None;
        }
        // SAFETY: `rest` holds at least a header's bytes; read unaligned,
        // as a copy.
        let h = unsafe { std::ptr::read_unaligned(rest.as_ptr().cast::<libc::cmsghdr>()) };
        let len = h.cmsg_len as usize;
        if len < hdr_len() {
            return None;
        }
        let data = &rest[hdr_len()..len.min(rest.len())];
        off += align(len);
        Some(Cmsg {
            level: h.cmsg_level,
            kind: h.cmsg_type,
            data,
        })
    })
}

/// Appends a control message (aligned) to `out`.
fn push_cmsg(out: &mut Vec<u8>, level: c_int, kind: c_int, data: &[u8]) {
    out.resize(align(out.len()), 0);
    // SAFETY: an all-zero cmsghdr is valid; its fields are set below.
    let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
    h.cmsg_len = (hdr_len() + data.len()) as _;
    h.cmsg_level = level;
    h.cmsg_type = kind;
    // SAFETY: a plain struct viewed as its bytes.
    let hb = unsafe { std::slice::from_raw_parts(std::ptr::addr_of!(h).cast::<u8>(), hdr_len()) };
    out.extend_from_slice(hb);
    out.extend_from_slice(data);
}

fn fd_bytes(fds: &[RawFd]) -> Vec<u8> {
    fds.iter().flat_map(|f| f.to_ne_bytes()).collect()
}

/// `msg_controllen` (`size_t` in glibc, `socklen_t` in musl).
fn control_len(m: &msghdr) -> usize {
    m.msg_controllen as _
}

// ---- Sending ----------------------------------------------------------

/// What a message adds for the connections it passes.
struct Parcel {
    /// The program's control messages and ours.
    control: Vec<u8>,
    /// Our descriptors in it, closed here once the message is sent.
    _extras: Vec<OwnedFd>,
    /// The connections passed, given back if the message is not sent.
    socks: Vec<Arc<Sock>>,
}

/// Interposed `sendmsg(2)` on a descriptor that is not an SMC-D
/// connection: connections among the descriptors passed go with what the
/// receiver needs to adopt them (see the module documentation).
pub(super) unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let parcel = if msg.is_null() || (LIVE.load(Ordering::Relaxed) == 0 && !super::pending::any()) {
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
    if n < 0 {
        let e = errno();
        for s in &p.socks {
            s.conn.unpass();
        }
        set_errno(e);
    } else {
        for s in &p.socks {
            debug!(
                "SCM_RIGHTS: SMC-D connection (channel fd {}) passed to another process, which ends it",
                s.conn.fd()
            );
        }
    }
    n
}

/// Whether one of the `n` messages of `v` (`sendmmsg`) may pass an SMC-D
/// connection: it has ancillary data and this process has connections.
pub(super) fn may_pass(v: *const libc::mmsghdr, n: libc::c_uint) -> bool {
    if v.is_null() || (LIVE.load(Ordering::Relaxed) == 0 && !super::pending::any()) {
        return false;
    }
    (0..n as usize).any(|i| {
        // SAFETY: the application passes `n` mmsghdrs.
        let m = unsafe { &(*v.add(i)).msg_hdr };
        !m.msg_control.is_null() && control_len(m) > 0
    })
}

/// The descriptors the program passes in `control`, in order.
fn passed_fds(control: &[u8]) -> Vec<RawFd> {
    cmsgs(control)
        .filter(|c| c.is_rights())
        .flat_map(|c| c.fds().collect::<Vec<_>>())
        .collect()
}

/// The parcel for the connections `m` passes; `None` when it passes none
/// (an accepted connection whose handshake is undecided stays TCP, a
/// connecting one is decided first: [`super::pending::pass`]).
fn prepare(m: &msghdr) -> Option<Parcel> {
    if m.msg_control.is_null() || control_len(m) < hdr_len() {
        return None;
    }
    // SAFETY: the application's control buffer of `msg_controllen` bytes,
    // which the program does not change during its own call.
    let control = unsafe { std::slice::from_raw_parts(m.msg_control.cast::<u8>(), control_len(m)) };
    let fds = passed_fds(control);
    let mut conns = Vec::new();
    for (i, &fd) in fds.iter().enumerate() {
        if table::get(fd).is_none() {
            super::pending::pass(fd);
        }
        if let Some(s) = table::get(fd) {
            conns.push((i, s));
        }
    }
    if conns.is_empty() {
        return None;
    }
    let ctx = super::ctx()?;
    if fds.len() + conns.len() * PER_CONN + 1 > MAX_FDS {
        debug!("SCM_RIGHTS: too many descriptors in one message to pass SMC-D connections; the receiver cannot use them");
        return None;
    }
    let mut p = Parcel {
        control: control.to_vec(),
        _extras: Vec::new(),
        socks: Vec::new(),
    };
    let mut lines = Vec::new();
    for (i, s) in conns {
        match export(&mut p, fds.len(), i, &s) {
            Ok(line) => lines.push(line),
            Err(why) => debug!(
                "SCM_RIGHTS: SMC-D connection on fd {} cannot go with its descriptor ({why}); the receiver cannot use it",
                fds[i]
            ),
        }
    }
    if lines.is_empty() {
        return None;
    }
    let dir = hex(ctx.dev.dir().as_os_str().as_encoded_bytes());
    let text = format!("{dir} {}\n", lines.join("\n"));
    match parcel_file(&text) {
        Ok(f) => {
            let mut ours: Vec<RawFd> = p._extras.iter().map(|f| f.as_raw_fd()).collect();
            ours.push(f.as_raw_fd());
            p._extras.push(f);
            push_cmsg(
                &mut p.control,
                libc::SOL_SOCKET,
                libc::SCM_RIGHTS,
                &fd_bytes(&ours),
            );
            Some(p)
        }
        Err(e) => {
            debug!("SCM_RIGHTS: no parcel for the SMC-D connections passed ({e}); the receiver cannot use them");
            for s in &p.socks {
                s.conn.unpass();
            }
            None
        }
    }
}

/// Adds connection `s` (the program's descriptor at position `at` of
/// `base` passed) to `p`: its line for the parcel.
fn export(p: &mut Parcel, base: usize, at: usize, s: &Arc<Sock>) -> Result<String, String> {
    s.syn_mark.put_back(s.tcp);
    let tcp = fdnum::dup_high(s.tcp).map_err(|e| e.to_string())?;
    let ExecParts { local, peer, state } = s.conn.pass_export(&s.reg).map_err(|e| e.to_string())?;
    s.conn.share_file();
    let n = base + p._extras.len();
    p._extras.extend([tcp, local, peer]);
    p.socks.push(s.clone());
    let line = Passed {
        fds: vec![at as RawFd],
        chan: at as RawFd,
        tcp: n as RawFd,
        local: (n + 1) as RawFd,
        peer: (n + 2) as RawFd,
        shut_rd: s.shut_rd.load(Ordering::Relaxed),
        linger0: s.linger0.load(Ordering::Relaxed),
        holders: Vec::new(),
        st: state,
    };
    Ok(line.encode())
}

/// A sealed memfd holding [`MAGIC`] and `text`.
fn parcel_file(text: &str) -> std::io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor.
    let fd = unsafe {
        libc::memfd_create(
            c"smclo-passed".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created, owned by nobody else.
    let low = unsafe { OwnedFd::from_raw_fd(fd) };
    let f = fdnum::dup_high(low.as_raw_fd())?;
    drop(low);
    let mut file = std::fs::File::from(f);
    file.write_all(MAGIC)?;
    file.write_all(text.as_bytes())?;
    if chan_sys::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS as libc::c_long) < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file.into())
}

// ---- Receiving --------------------------------------------------------

/// Room for our descriptors beyond the program's control buffer.
fn room() -> usize {
    align(hdr_len() + 4 * MAX_FDS)
}

/// Interposed `recvmsg(2)` on a descriptor that is not an SMC-D
/// connection: see the module documentation.
pub(super) unsafe fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the application's msghdr, if any.
    let Some(m) = (unsafe { msg.as_mut() }) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmsg(fd, msg, flags) };
    };
    let want = control_len(m);
    if m.msg_control.is_null() || want == 0 {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmsg(fd, msg, flags) };
    }
    // Most control buffers fit on the stack (a receive with a few
    // descriptors, a datagram's packet information).
    let words = (want + room()).div_ceil(8);
    let mut stack = [0u64; 256];
    let mut heap = Vec::new();
    let buf: &mut [u64] = if words <= stack.len() {
        &mut stack[..words]
    } else {
        heap.resize(words, 0);
        &mut heap
    };
    let mut mine = *m;
    mine.msg_control = buf.as_mut_ptr().cast();
    mine.msg_controllen = (buf.len() * 8) as _;
    // SAFETY: the application's message with our control buffer.
    let n = unsafe { real::recvmsg(fd, &mut mine, flags) };
    if n < 0 {
        return n;
    }
    // SAFETY: our buffer, of which the kernel wrote `msg_controllen` bytes.
    let got = unsafe {
        std::slice::from_raw_parts(
            buf.as_ptr().cast::<u8>(),
            control_len(&mine).min(buf.len() * 8),
        )
    };
    let (out, trunc) = deliver(got, want, flags);
    // SAFETY: the application's control buffer holds `want` bytes and
    // `out` is at most that long.
    unsafe {
        std::ptr::copy_nonoverlapping(out.as_ptr(), m.msg_control.cast::<u8>(), out.len());
    }
    m.msg_namelen = mine.msg_namelen;
    m.msg_controllen = out.len() as _;
    m.msg_flags = mine.msg_flags | if trunc { libc::MSG_CTRUNC } else { 0 };
    n
}

/// The program's control buffer (at most `want` bytes) from what the
/// kernel wrote into ours, `got`, with a parcel's connections adopted and
/// our descriptors closed; and whether it was truncated.
fn deliver(got: &[u8], want: usize, flags: c_int) -> (Vec<u8>, bool) {
    let mut fds = passed_fds(got);
    // Fresh numbers: what the table knew of them is stale.
    fds.iter().for_each(|&f| super::setup::clear_stale(f));
    let keep = fds
        .last()
        .and_then(|&f| parcel(f))
        .map(|text| take_parcel(&text, &fds, flags))
        .unwrap_or(fds.len());
    for &f in &fds[keep..] {
        close(f);
    }
    fds.truncate(keep);
    let mut out = Vec::new();
    let mut trunc = false;
    let mut rights_done = false;
    for c in cmsgs(got) {
        let start = align(out.len());
        if c.is_rights() {
            if rights_done {
                continue;
            }
            rights_done = true;
            let fit = want.saturating_sub(start + hdr_len()) / 4;
            let n = fit.min(fds.len());
            if want < start + hdr_len() + 4 && !fds.is_empty() {
                trunc = true;
                fds.iter().for_each(|&f| close(f));
                break;
            }
            for &f in &fds[n..] {
                close(f);
                trunc = true;
            }
            if n > 0 {
                push_cmsg(&mut out, c.level, c.kind, &fd_bytes(&fds[..n]));
                pad(&mut out, want);
            }
        } else {
            if want < start + hdr_len() {
                trunc = true;
                break;
            }
            push_cmsg(&mut out, c.level, c.kind, c.data);
            if out.len() > want {
                out.truncate(want);
                trunc = true;
                break;
            }
            pad(&mut out, want);
        }
    }
    out.truncate(want);
    (out, trunc)
}

/// As the kernel does after each control message: its alignment padding,
/// as far as the buffer has room.
fn pad(out: &mut Vec<u8>, want: usize) {
    let end = align(out.len()).min(want);
    if end > out.len() {
        out.resize(end, 0);
    }
}

fn close(fd: RawFd) {
    // SAFETY: a descriptor the kernel gave this call, which nobody else
    // knows of.
    unsafe { real::close(fd) };
}

/// The text of `fd` after [`MAGIC`], if it is a parcel.
fn parcel(fd: RawFd) -> Option<String> {
    if chan_sys::fcntl(fd, libc::F_GET_SEALS, 0) != SEALS {
        return None;
    }
    // SAFETY: borrowed for the reads only; the caller closes it.
    let f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    let len = f.metadata().ok()?.len();
    if len > PARCEL_MAX || len < MAGIC.len() as u64 {
        return None;
    }
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, 0).ok()?;
    let text = buf.strip_prefix(MAGIC)?;
    String::from_utf8(text.to_vec()).ok()
}

/// Adopts the connections of parcel `text` among `fds` (the message's
/// descriptors, the parcel last); returns how many of `fds` are the
/// program's. Under `MSG_PEEK` nothing is adopted: the descriptors are
/// copies, and the message comes again.
fn take_parcel(text: &str, fds: &[RawFd], flags: c_int) -> usize {
    let Some((dir, list)) = text.trim_end().split_once(' ') else {
        return fds.len();
    };
    let passed: Option<Vec<Passed>> = list.split('\n').map(Passed::decode).collect();
    let Some(passed) = passed.filter(|v| !v.is_empty()) else {
        debug!("SCM_RIGHTS: a parcel of another smclo version; its connections are unusable here");
        return fds.len() - 1;
    };
    let Some(keep) = (fds.len() - 1).checked_sub(passed.len() * PER_CONN) else {
        debug!("SCM_RIGHTS: a parcel names more descriptors than the message has");
        return fds.len();
    };
    if flags & libc::MSG_PEEK != 0 {
        return keep;
    }
    let cloexec = flags & libc::MSG_CMSG_CLOEXEC != 0;
    for p in passed {
        match at_numbers(p, fds, keep) {
            Some(p) => adopt_one(p, dir, cloexec),
            None => debug!("SCM_RIGHTS: a parcel names descriptors the message does not have"),
        }
    }
    keep
}

/// `p` with its positions turned into the descriptors received, ours
/// moved to high numbers.
fn at_numbers(mut p: Passed, fds: &[RawFd], keep: usize) -> Option<Passed> {
    let prog = |i: RawFd| {
        usize::try_from(i)
            .ok()
            .filter(|&i| i < keep)
            .map(|i| fds[i])
    };
    let ours = |i: RawFd| {
        let i = usize::try_from(i)
            .ok()
            .filter(|&i| i >= keep && i + 1 < fds.len())?;
        let high = fdnum::dup_high(fds[i]).ok()?;
        Some(std::os::fd::IntoRawFd::into_raw_fd(high))
    };
    let chan = prog(p.chan)?;
    p.fds = vec![chan];
    p.chan = chan;
    p.tcp = ours(p.tcp)?;
    p.local = ours(p.local)?;
    p.peer = ours(p.peer)?;
    Some(p)
}

/// Adopts one passed connection at the program's descriptor, or resets it.
fn adopt_one(p: Passed, dir: &str, cloexec: bool) {
    let why = match adopt_in(&p, dir, cloexec) {
        Ok(()) => {
            debug!(
                "SCM_RIGHTS: adopted SMC-D connection on fd {} (hidden TCP fd {})",
                p.chan, p.tcp
            );
            return;
        }
        Err(why) => why,
    };
    adopt::reset(&p, &why.0, why.1);
}

/// [`adopt_one`]'s work; the error says why, and whether the memfds and
/// the channel were consumed.
fn adopt_in(p: &Passed, dir: &str, cloexec: bool) -> Result<(), (String, bool)> {
    let ctx = super::ctx().ok_or(("this process has no device".to_string(), false))?;
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
        // SAFETY: an all-zero msghdr is valid; its pointers are set below.
        let mut m: msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = control.as_mut_ptr().cast();
        m.msg_controllen = control.len() as _;
        // SAFETY: a valid message of our own buffers.
        assert_eq!(unsafe { real::sendmsg(fd, &m, 0) }, 1);
        fds.into_iter().for_each(close);
    }

    /// What a receive with a control buffer of `want` bytes gives: the
    /// buffer's length used, whether `MSG_CTRUNC` is set, the headers'
    /// levels, types and lengths, and how many descriptors came.
    fn receive(
        fd: RawFd,
        want: usize,
        ours: bool,
    ) -> (usize, bool, Vec<(c_int, c_int, usize)>, usize) {
        let mut buf = vec![0u64; want.div_ceil(8) + 1];
        let mut byte = [0u8];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        // SAFETY: as in send_fds.
        let mut m: msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = buf.as_mut_ptr().cast();
        m.msg_controllen = want as _;
        // SAFETY: a valid message of our own buffers.
        let n = unsafe {
            if ours {
                recvmsg(fd, &mut m, 0)
            } else {
                // libc's own: the test binary interposes `recvmsg` too.
                real::recvmsg(fd, &mut m, 0)
            }
        };
        assert_eq!(n, 1);
        // SAFETY: the kernel (or deliver) wrote msg_controllen bytes.
        let got = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), control_len(&m)) };
        let heads = cmsgs(got)
            .map(|c| (c.level, c.kind, c.data.len()))
            .collect();
        let fds = passed_fds(got);
        fds.iter().for_each(|&f| close(f));
        (
            control_len(&m),
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
        for want in sizes {
            for n in [1, 2, 3] {
                send_fds(a.as_raw_fd(), n);
                let kernel = receive(b.as_raw_fd(), want, false);
                send_fds(a.as_raw_fd(), n);
                let ours = receive(b.as_raw_fd(), want, true);
                assert_eq!(ours, kernel, "{n} descriptors into {want} bytes");
            }
        }
    }

    /// A parcel that is not ours (unsealed, or sealed without the magic)
    /// is the program's descriptor.
    #[test]
    fn only_a_sealed_memfd_with_the_magic_is_a_parcel() {
        let p = parcel_file("x 1,2").unwrap();
        assert_eq!(parcel(p.as_raw_fd()).as_deref(), Some("x 1,2"));
        let plain = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(parcel(plain.as_raw_fd()), None);
        // SAFETY: a NUL-terminated name; returns a new descriptor.
        let fd = unsafe { libc::memfd_create(c"other".as_ptr(), libc::MFD_ALLOW_SEALING) };
        // SAFETY: just created, ours.
        let mut other = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        other.write_all(b"smclo-passed 2 x").unwrap();
        assert_eq!(parcel(other.as_raw_fd()), None, "unsealed");
        chan_sys::fcntl(other.as_raw_fd(), libc::F_ADD_SEALS, SEALS as libc::c_long);
        assert_eq!(parcel(other.as_raw_fd()), None, "another layout");
    }
}
