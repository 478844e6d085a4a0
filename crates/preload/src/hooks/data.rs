//! The data path: read, write, recv, send and their fortified, vectored,
//! message and multi-message forms, all on an SMC-D
//! connection's rings through the core's connection. Flags get TCP's
//! answers (ignored where TCP ignores them); urgent data, zero-copy
//! completions and ancillary data, which the rings cannot carry, fail
//! loudly instead of being ignored.
//!
//! # Signals
//!
//! A blocking call whose sleep a signal handler interrupted, before it
//! moved any byte, is restarted or fails with `EINTR` as the kernel decides
//! for sockets (signal(7)): `EINTR` when the direction has a timeout
//! (`SO_RCVTIMEO`/`SO_SNDTIMEO`), otherwise a restart if the handler was
//! installed with `SA_RESTART`. Which signal interrupted the sleep is not
//! known, so the call is restarted only if every handler that could have
//! run (a signal not blocked in this thread, with a handler, not a fault
//! signal such as SIGSEGV) has `SA_RESTART` ([`handlers_restart`]). That is exact whenever the
//! program's handlers agree (C programs that use `SA_RESTART` throughout;
//! Python, which never sets it); a program that mixes both sees `EINTR`
//! also after a restarting handler.

use super::{fail, fail_write, os_err, unsupported};
use crate::critical::FAULTS;
use crate::real;
use crate::table::{self, Sock};
use libc::{c_int, c_uint, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};
use smclo::adapter::conn::{Conn, RecvFlags, SendFlags};
use smclo::adapter::signal::Call;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

/// The recv flags a connection's reads honour; TCP ignores the others
/// (`MSG_CONFIRM`, `MSG_DONTROUTE`, ...) but for those [`recv_refused`]
/// answers and `MSG_TRUNC` ([`recv_discard`]).
const RECV_OK: c_int = libc::MSG_PEEK | libc::MSG_WAITALL | libc::MSG_DONTWAIT;
/// The send flags a connection's writes honour; TCP ignores the others but
/// for those [`send_refused`] answers.
const SEND_OK: c_int = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | libc::MSG_MORE | libc::MSG_EOR;

/// TCP's answer to a read with `flags` on a connection without urgent
/// data or queued errors, where it is not the data: `MSG_OOB` is `EINVAL`
/// (no urgent byte, which a connection never carries: its writes refuse
/// them), `MSG_ERRQUEUE` is `EAGAIN` (nothing queued, whatever the socket's
/// mode).
fn recv_refused(flags: c_int) -> Option<c_int> {
    if flags & libc::MSG_OOB != 0 {
        return Some(libc::EINVAL);
    }
    if flags & libc::MSG_ERRQUEUE != 0 {
        return Some(libc::EAGAIN);
    }
    None
}

/// A send with `flags` that the rings cannot carry as TCP would: urgent
/// data (`MSG_OOB`) and zero-copy sends whose completions the program
/// asked for (`MSG_ZEROCOPY` with `SO_ZEROCOPY` set; without it TCP
/// ignores the flag) fail loudly (`EOPNOTSUPP`); `MSG_FASTOPEN` on a
/// connected socket is TCP's `EISCONN`.
fn send_refused(fd: RawFd, s: &Sock, flags: c_int) -> Option<ssize_t> {
    if flags & libc::MSG_OOB != 0 {
        return Some(unsupported(fd, format_args!("send(MSG_OOB)")));
    }
    if flags & libc::MSG_FASTOPEN != 0 {
        return Some(fail(libc::EISCONN));
    }
    if flags & libc::MSG_ZEROCOPY != 0
        && super::sockopt_int(s.tcp, libc::SO_ZEROCOPY).is_some_and(|v| v != 0)
    {
        return Some(unsupported(
            fd,
            format_args!("send(MSG_ZEROCOPY) with SO_ZEROCOPY set"),
        ));
    }
    None
}

/// A read of `n` bytes with `MSG_TRUNC`, which TCP takes out of the stream
/// (or, with `MSG_PEEK`, counts) without writing them anywhere: read into
/// a buffer of ours and dropped.
fn recv_discard(call: &Call, s: &Sock, n: usize, flags: c_int) -> ssize_t {
    let mut scratch = vec![0u8; n.min(1 << 20)];
    let flags = flags & !libc::MSG_TRUNC;
    let mut done = 0usize;
    loop {
        let want = (n - done).min(scratch.len());
        let r = do_recv(call, s, &mut scratch[..want], flags);
        if r <= 0 {
            return if done > 0 { done as ssize_t } else { r };
        }
        done += r as usize;
        // Only MSG_WAITALL asks for more than one buffer's worth.
        if done == n || flags & libc::MSG_WAITALL == 0 || flags & libc::MSG_PEEK != 0 {
            return done as ssize_t;
        }
    }
}

/// A read of `n` bytes at `buf` with recv(2) `flags` on the connection.
///
/// # Safety
/// `buf` is the application's buffer of `n` writable bytes, or anything
/// with `MSG_TRUNC` (TCP does not write it then).
unsafe fn recv_into(call: &Call, s: &Sock, buf: *mut c_void, n: usize, flags: c_int) -> ssize_t {
    if let Some(e) = recv_refused(flags) {
        return fail(e);
    }
    if n == 0 {
        // TCP's answers to a zero-length read (the connection's).
        return do_recv(call, s, &mut [], flags);
    }
    if flags & libc::MSG_TRUNC != 0 {
        return recv_discard(call, s, n, flags);
    }
    // SAFETY: the caller's writable buffer of `n` bytes.
    do_recv(
        call,
        s,
        unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) },
        flags,
    )
}

/// Whether every signal handler that can run in this thread now was
/// installed with `SA_RESTART` (see the module docs).
pub(super) fn handlers_restart() -> bool {
    // SAFETY: an all-zero sigset_t is valid storage for the query.
    let mut blocked: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: queries this thread's mask (no new set).
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut blocked) };
    (1..=libc::SIGRTMAX()).all(|sig| {
        // A thread asleep in poll raises no fault: their handlers (Rust's
        // and the JVM's stack guards, crash reporters) do not count.
        if FAULTS.contains(&sig) {
            return true;
        }
        // SAFETY: `blocked` is an initialised set.
        if unsafe { libc::sigismember(&blocked, sig) } == 1 {
            return true;
        }
        // SAFETY: an all-zero sigaction is valid storage for the query.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: queries the disposition only (no new action); signals
        // that cannot be queried (SIGKILL, libc's own) have no handler.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut sa) } != 0 {
            return true;
        }
        sa.sa_sigaction == libc::SIG_DFL
            || sa.sa_sigaction == libc::SIG_IGN
            || sa.sa_flags & libc::SA_RESTART != 0
    })
}

/// Runs a data call on `conn`, restarting it after a signal handler
/// interrupted it where the kernel would (see the module docs); `timeout`:
/// the direction's timeout. A handler that closed the connection ends it:
/// the kernel's restarted call finds the number closed (`EBADF`).
pub(super) fn restarting<T>(
    call: &Call,
    conn: &Conn,
    timeout: Option<Duration>,
    mut op: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    loop {
        match op() {
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    && timeout.is_none()
                    && handlers_restart() =>
            {
                if conn.is_closed() {
                    return Err(io::Error::from_raw_os_error(libc::EBADF));
                }
                call.restart()
            }
            r => return r,
        }
    }
}

/// Receive into `buf` with recv(2) flags; -1 with errno on error.
fn do_recv(call: &Call, s: &Sock, buf: &mut [u8], flags: c_int) -> ssize_t {
    if let Some(e) = recv_refused(flags) {
        return fail(e);
    }
    let flags = flags & RECV_OK;
    let msg = RecvFlags::from_msg(flags);
    let r = restarting(call, &s.conn, s.conn.read_timeout(), || {
        s.conn.recv(buf, msg)
    });
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            super::swap::after_would_block(s, &e);
            fail(os_err(&e))
        }
    }
}

/// Send `buf` with send(2) flags; -1 with errno on error (SIGPIPE on
/// EPIPE unless MSG_NOSIGNAL, as TCP).
fn do_send(call: &Call, fd: RawFd, s: &Arc<Sock>, buf: &[u8], flags: c_int) -> ssize_t {
    if let Some(r) = send_refused(fd, s, flags) {
        return r;
    }
    let flags = flags & SEND_OK;
    let msg = SendFlags::from_msg(flags);
    match restarting(call, &s.conn, s.conn.write_timeout(), || {
        s.conn.send(buf, msg)
    }) {
        Ok(n) => {
            crate::cork::arm(s);
            n as ssize_t
        }
        Err(e) => {
            super::swap::after_would_block(s, &e);
            fail_write(os_err(&e), flags & libc::MSG_NOSIGNAL == 0)
        }
    }
}

fn iovs<'a>(iov: *const iovec, cnt: c_int) -> &'a [iovec] {
    if iov.is_null() || cnt <= 0 {
        return &[];
    }
    // SAFETY: the caller (the application) passes `cnt` iovecs.
    unsafe { std::slice::from_raw_parts(iov, cnt as usize) }
}

/// Gathers small vectors into one send (one doorbell); large ones go one by
/// one, all but the last with `MSG_MORE` (published together, as one write).
fn do_sendv(call: &Call, fd: RawFd, s: &Arc<Sock>, v: &[iovec], flags: c_int) -> ssize_t {
    const GATHER: usize = 64 * 1024;
    let total: usize = v.iter().map(|i| i.iov_len).sum();
    if v.len() == 1 || total <= GATHER {
        if v.len() == 1 {
            // SAFETY: the application's buffer of iov_len bytes.
            let b = unsafe { std::slice::from_raw_parts(v[0].iov_base as *const u8, v[0].iov_len) };
            return do_send(call, fd, s, b, flags);
        }
        let mut buf = Vec::with_capacity(total);
        for i in v {
            if i.iov_len > 0 {
                // SAFETY: as above.
                buf.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(i.iov_base as *const u8, i.iov_len)
                });
            }
        }
        return do_send(call, fd, s, &buf, flags);
    }
    let mut done = 0usize;
    let last = v.iter().rposition(|i| i.iov_len > 0).unwrap_or(0);
    for (k, i) in v.iter().enumerate() {
        if i.iov_len == 0 {
            continue;
        }
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts(i.iov_base as *const u8, i.iov_len) };
        let mut f = flags;
        if done > 0 {
            f |= libc::MSG_NOSIGNAL;
        }
        if k < last {
            f |= libc::MSG_MORE;
        }
        let n = do_send(call, fd, s, b, f);
        if n < 0 {
            if done == 0 {
                return n;
            }
            break;
        }
        done += n as usize;
        if (n as usize) < b.len() {
            break;
        }
    }
    // A vector written short ends the call: what it held goes out now,
    // unless the caller itself asked for more.
    if flags & libc::MSG_MORE == 0 && !s.conn.corked() {
        let _ = s.conn.flush();
    }
    done as ssize_t
}

/// Scatters into vectors: the first waits per mode, the rest take only what
/// is there (unless MSG_WAITALL).
fn do_recvv(call: &Call, s: &Sock, v: &[iovec], flags: c_int) -> ssize_t {
    if v.iter().all(|i| i.iov_len == 0) {
        // `recvmsg` reads zero bytes as `recv` does (`readv` never comes
        // here with them).
        return do_recv(call, s, &mut [], flags);
    }
    if v.len() == 1 {
        // SAFETY: the application's writable buffer of iov_len bytes.
        let b = unsafe { std::slice::from_raw_parts_mut(v[0].iov_base as *mut u8, v[0].iov_len) };
        return do_recv(call, s, b, flags);
    }
    if flags & libc::MSG_PEEK != 0 {
        let total: usize = v.iter().map(|i| i.iov_len).sum();
        let mut tmp = vec![0u8; total.min(4 << 20)];
        let n = do_recv(call, s, &mut tmp, flags);
        if n <= 0 {
            return n;
        }
        let mut off = 0usize;
        for i in v {
            let k = i.iov_len.min(n as usize - off);
            // SAFETY: k <= iov_len bytes into the application's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(tmp.as_ptr().add(off), i.iov_base as *mut u8, k)
            };
            off += k;
            if off == n as usize {
                break;
            }
        }
        return n;
    }
    let mut done = 0usize;
    for i in v {
        if i.iov_len == 0 {
            continue;
        }
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts_mut(i.iov_base as *mut u8, i.iov_len) };
        let f = if done > 0 && flags & libc::MSG_WAITALL == 0 {
            flags | libc::MSG_DONTWAIT
        } else {
            flags
        };
        let n = do_recv(call, s, b, f);
        if n < 0 {
            return if done > 0 { done as ssize_t } else { n };
        }
        done += n as usize;
        if n == 0 || (n as usize) < b.len() {
            break;
        }
    }
    done as ssize_t
}

/// Interposed `read(2)`.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::read(fd, buf, n) };
    }
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd, false) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::read(fd, buf, n) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's writable buffer of `n` bytes.
    do_recv(
        &call,
        &s,
        unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) },
        0,
    )
}

/// Fortified `read` (`_FORTIFY_SOURCE`).
#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { read(fd, buf, n) }
}

/// Interposed `write(2)`.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::write(fd, buf, n) };
    }
    let call = Call::begin();
    if let Some(r) = super::pending::early_send(fd, buf, n, 0) {
        return r;
    }
    if let Err(e) = super::pending::before_write(fd, false) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::write(fd, buf, n) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(
        &call,
        fd,
        &s,
        unsafe { std::slice::from_raw_parts(buf.cast(), n) },
        0,
    )
}

/// Interposed `recv(2)`.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::recv(fd, buf, n, flags) };
    }
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recv(fd, buf, n, flags) };
    };
    // SAFETY: the application's buffer of `n` bytes.
    unsafe { recv_into(&call, &s, buf, n, flags) }
}

/// Fortified `recv`.
#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recv(fd, buf, n, flags) }
}

/// Interposed `send(2)`.
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::send(fd, buf, n, flags) };
    }
    let call = Call::begin();
    if let Some(r) = super::pending::early_send(fd, buf, n, flags) {
        return r;
    }
    if let Err(e) = super::pending::before_write(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::send(fd, buf, n, flags) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(
        &call,
        fd,
        &s,
        unsafe { std::slice::from_raw_parts(buf.cast(), n) },
        flags,
    )
}

/// Interposed `recvfrom(2)`: a connected stream reports no address.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::recvfrom(fd, buf, n, flags, addr, len) };
    }
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvfrom(fd, buf, n, flags, addr, len) };
    };
    if !addr.is_null() && !len.is_null() {
        // SAFETY: the application passed a valid length pointer.
        unsafe { *len = 0 };
    }
    // SAFETY: the application's buffer of `n` bytes.
    unsafe { recv_into(&call, &s, buf, n, flags) }
}

/// Fortified `recvfrom`.
#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

/// Interposed `sendto(2)`: on a connected stream the address is ignored,
/// as TCP does.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::sendto(fd, buf, n, flags, addr, len) };
    }
    let call = Call::begin();
    if let Some(r) = super::pending::early_send(fd, buf, n, flags) {
        return r;
    }
    if let Err(e) = super::pending::before_write(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendto(fd, buf, n, flags, addr, len) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(
        &call,
        fd,
        &s,
        unsafe { std::slice::from_raw_parts(buf.cast(), n) },
        flags,
    )
}

/// Interposed `readv(2)`.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::readv(fd, iov, cnt) };
    }
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd, false) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::readv(fd, iov, cnt) };
    };
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return fail(libc::EINVAL);
    }
    let v = iovs(iov, cnt);
    if v.iter().all(|i| i.iov_len == 0) {
        // A socket's read of zero bytes is 0 at once, unlike its recv.
        return 0;
    }
    do_recvv(&call, &s, v, 0)
}

/// Interposed `writev(2)`.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if table::plain_io(fd) {
        // SAFETY: forwarded unchanged (see [`table::plain_io`]).
        return unsafe { real::writev(fd, iov, cnt) };
    }
    let call = Call::begin();
    if let Err(e) = super::pending::before_write(fd, false) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::writev(fd, iov, cnt) };
    };
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return fail(libc::EINVAL);
    }
    do_sendv(&call, fd, &s, iovs(iov, cnt), 0)
}

/// Interposed `recvmsg(2)`: no ancillary data, no address.
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let call = Call::begin();
    // SAFETY: the application's arguments.
    unsafe { recvmsg_in(&call, fd, msg, flags) }
}

/// `recvmsg` as a part of `call`.
///
/// # Safety
/// As for `recvmsg(2)`.
unsafe fn recvmsg_in(call: &Call, fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if let Err(e) = super::pending::before_read(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: the application's arguments.
        return unsafe { super::passing::recvmsg(fd, msg, flags) };
    };
    if msg.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the application's msghdr.
    let m = unsafe { &mut *msg };
    let v = iovs(m.msg_iov, m.msg_iovlen as c_int);
    let n = match recv_refused(flags) {
        Some(e) => return fail(e),
        None if flags & libc::MSG_TRUNC != 0 => {
            recv_discard(call, &s, v.iter().map(|i| i.iov_len).sum(), flags)
        }
        None => do_recvv(call, &s, v, flags),
    };
    if n >= 0 {
        m.msg_namelen = 0;
        m.msg_flags = 0;
        if s.inq.load(std::sync::atomic::Ordering::Relaxed) {
            put_inq(m, &s);
        } else {
            m.msg_controllen = 0;
        }
    }
    n
}

/// `TCP_CM_INQ` after a read, as TCP writes it with `TCP_INQ` set: the
/// bytes left to read, or 1 at the end of the stream with none (so that
/// a reader asks again and finds it), truncated as the kernel's
/// `put_cmsg` truncates into a short control buffer (`MSG_CTRUNC`).
fn put_inq(m: &mut msghdr, s: &Sock) {
    use smclo::adapter::poller::Ready;
    let mut inq = s.conn.readable_len().unwrap_or(0).min(c_int::MAX as usize) as c_int;
    if inq == 0 && s.conn.ready_for(Ready::IN).intersects(Ready::RDHUP) {
        inq = 1;
    }
    let mut msg = Vec::new();
    super::cmsg::push_cmsg(
        &mut msg,
        libc::SOL_TCP,
        libc::TCP_CM_INQ,
        &inq.to_ne_bytes(),
    );
    let want = if m.msg_control.is_null() {
        0
    } else {
        super::cmsg::control_len(m)
    };
    let (out, trunc, _, _) = super::cmsg::program_control(&msg, want, &[]);
    if !out.is_empty() {
        // SAFETY: `out` is at most `want` bytes, the program's control
        // buffer (not null: `want` is 0 then).
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), m.msg_control.cast::<u8>(), out.len())
        };
    }
    m.msg_controllen = out.len() as _;
    if trunc {
        m.msg_flags |= libc::MSG_CTRUNC;
    }
}

/// Interposed `sendmsg(2)`: ancillary data (SCM_RIGHTS and the like)
/// cannot travel through shared memory and fails loudly.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let call = Call::begin();
    // SAFETY: the application's arguments.
    unsafe { sendmsg_in(&call, fd, msg, flags) }
}

/// `sendmsg` as a part of `call`.
///
/// # Safety
/// As for `sendmsg(2)`.
unsafe fn sendmsg_in(call: &Call, fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if let Err(e) = super::pending::before_write(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    let Some(s) = super::swap::in_call(fd) else {
        // SAFETY: the application's arguments.
        return unsafe { super::passing::sendmsg(fd, msg, flags) };
    };
    if msg.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the application's msghdr.
    let m = unsafe { &*msg };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        return unsupported(
            fd,
            format_args!("sendmsg with ancillary data ({} bytes)", m.msg_controllen),
        );
    }
    do_sendv(call, fd, &s, iovs(m.msg_iov, m.msg_iovlen as c_int), flags)
}

/// Interposed `recvmmsg(2)`: on a connection, one message after another;
/// only the first may wait. On another socket, connections passed in the
/// messages are adopted (`passing::recvmmsg`).
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
    t: *mut libc::timespec,
) -> c_int {
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    if super::swap::in_call(fd).is_none() {
        // SAFETY: the application's arguments.
        return unsafe { super::passing::recvmmsg(fd, v, n, flags, t) };
    }
    let mut done = 0;
    for i in 0..n as usize {
        let f = if done > 0 {
            flags | libc::MSG_DONTWAIT
        } else {
            flags & !libc::MSG_WAITFORONE
        };
        // SAFETY: the application passes `n` mmsghdrs.
        let h = unsafe { &mut *v.add(i) };
        // SAFETY: our recvmsg with the application's msghdr.
        let r = unsafe { recvmsg_in(&call, fd, &mut h.msg_hdr, f & !libc::MSG_WAITFORONE) };
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        h.msg_len = r as c_uint;
        done += 1;
        if r == 0 {
            break;
        }
    }
    done
}

/// Interposed `sendmmsg(2)`.
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
) -> c_int {
    let call = Call::begin();
    if let Err(e) = super::pending::before_write(fd, flags & libc::MSG_DONTWAIT != 0) {
        return fail(e);
    }
    if super::swap::in_call(fd).is_none() && !super::passing::may_pass(v, n) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendmmsg(fd, v, n, flags) };
    }
    let mut done = 0;
    for i in 0..n as usize {
        // SAFETY: the application passes `n` mmsghdrs.
        let h = unsafe { &mut *v.add(i) };
        // SAFETY: our sendmsg with the application's msghdr.
        let r = unsafe { sendmsg_in(&call, fd, &h.msg_hdr, flags) };
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        h.msg_len = r as c_uint;
        done += 1;
    }
    done
}
