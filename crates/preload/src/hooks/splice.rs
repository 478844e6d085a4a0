//! `sendfile(2)` into an SMC-D connection (file bytes read straight into
//! the peer's ring), and `splice(2)` and `sendfile(2)` between a
//! connection and a pipe, as TCP's: the bytes move between the ring and the pipe with one copy
//! by the kernel (`write` from the received region, `read` into the
//! reserved one), and only what the pipe took or gave is consumed or
//! sent, so nothing is lost when the pipe is full or empty. Proxies splice
//! (haproxy's `option splice-*`): a refusal the kernel never gives would
//! end their connections.
//!
//! The pipe waits as the kernel's splice waits on it: not at all with
//! `SPLICE_F_NONBLOCK` or a non-blocking pipe (`RWF_NOWAIT`), otherwise
//! until it has room or bytes; the connection waits per its own mode and
//! timeouts. Anything else (a connection and a file, two connections, an
//! offset) gets the kernel's answer for a TCP socket there.
//! `tee` and `vmsplice` take pipes only, so they are not interposed: the
//! kernel answers for the connection's socket as it does for TCP's.

use super::data::restarting;
use super::{fail, os_err};
use crate::real;
use crate::table::{self, Sock};
use libc::{c_int, c_uint, c_void, loff_t, off_t, size_t, ssize_t};
use smclo::adapter::errno;
use smclo::adapter::signal::Call;
use smclo::debug;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

/// Interposed `splice(2)`.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut loff_t,
    fd_out: c_int,
    off_out: *mut loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let call = Call::begin();
    if let Err(e) = super::pending::before_read(fd_in, false) {
        return fail(e);
    }
    if let Err(e) = super::pending::before_write(fd_out, false) {
        return fail(e);
    }
    let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
    match (table::get(fd_in), table::get(fd_out)) {
        // SAFETY: forwarded unchanged.
        (None, None) => unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) },
        // Neither end is a pipe.
        (Some(_), Some(_)) => fail(libc::EINVAL),
        (Some(s), None) => match pipe_end(fd_out, !off_in.is_null(), !off_out.is_null()) {
            Ok(()) => to_pipe(&call, &s, fd_out, len, nonblock),
            Err(e) => fail(e),
        },
        (None, Some(s)) => match pipe_end(fd_in, !off_out.is_null(), !off_in.is_null()) {
            Ok(()) => from_pipe(&call, fd_in, &s, len, nonblock),
            Err(e) => fail(e),
        },
    }
}

/// `sendfile(2)` into the SMC-D connection `s`: file bytes read straight
/// into the peer's ring (`reserve`/`commit`), offset semantics kept.
fn do_sendfile(call: &Call, s: &Arc<Sock>, inp: RawFd, off: *mut off_t, count: size_t) -> ssize_t {
    if table::get(inp).is_some() {
        return fail(libc::EINVAL); // from a socket into a socket, as TCP's
    }
    let mut done = 0usize;
    while done < count {
        let mut region = match restarting(call, s.conn.write_timeout(), || s.conn.reserve(1)) {
            Ok(r) => r,
            Err(e) => {
                if done > 0 {
                    break;
                }
                let en = os_err(&e);
                if en == libc::EPIPE {
                    // SAFETY: SIGPIPE as TCP's sendfile raises it.
                    unsafe { libc::raise(libc::SIGPIPE) };
                }
                return fail(en);
            }
        };
        let want = region.len().min(count - done);
        let dst = region.as_mut_ptr().cast::<c_void>();
        // SAFETY: `dst` has `want` writable bytes (inside the reserved ring
        // region); `off` is the application's offset pointer or null.
        let n = unsafe {
            if off.is_null() {
                real::read(inp, dst, want)
            } else {
                libc::pread(inp, dst, want, *off)
            }
        };
        if n <= 0 {
            let e = errno::get();
            drop(region);
            if n < 0 && done == 0 {
                return fail(e);
            }
            break;
        }
        if let Err(e) = region.commit(n as usize) {
            if done == 0 {
                return fail(os_err(&e));
            }
            break;
        }
        if !off.is_null() {
            // SAFETY: the application's offset.
            unsafe { *off += n as off_t };
        }
        done += n as usize;
        if (n as usize) < want {
            break; // end of the input file (or a short read)
        }
    }
    crate::cork::arm(s);
    done as ssize_t
}

/// Interposed `sendfile(2)`: file bytes go straight into the peer's ring.
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    let call = Call::begin();
    if let Err(e) = super::pending::before_write(out, false) {
        return fail(e);
    }
    if let Err(e) = super::pending::before_read(inp, false) {
        return fail(e);
    }
    match (table::get(out), table::get(inp)) {
        (Some(s), _) => do_sendfile(&call, &s, inp, off, count),
        (None, Some(s)) => sendfile_from(&call, &s, out, off, count),
        // SAFETY: forwarded unchanged.
        (None, None) => unsafe { real::sendfile(out, inp, off, count) },
    }
}

/// Interposed `sendfile64` (the same call on 64-bit).
#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    let call = Call::begin();
    if let Err(e) = super::pending::before_write(out, false) {
        return fail(e);
    }
    if let Err(e) = super::pending::before_read(inp, false) {
        return fail(e);
    }
    match (table::get(out), table::get(inp)) {
        (Some(s), _) => do_sendfile(&call, &s, inp, off, count),
        (None, Some(s)) => sendfile_from(&call, &s, out, off, count),
        // SAFETY: forwarded unchanged.
        (None, None) => unsafe { real::sendfile64(out, inp, off, count) },
    }
}

/// `sendfile(2)` from the SMC-D connection `s`: into a pipe as the
/// kernel's (which splices), `EINVAL` into anything else, `ESPIPE` with an
/// offset (a socket has none).
fn sendfile_from(
    call: &Call,
    s: &Arc<Sock>,
    out: RawFd,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    if !is_pipe(out) {
        debug!("sendfile from an SMC-D connection into fd {out}, not a pipe: EINVAL, as TCP's");
        return fail(libc::EINVAL);
    }
    if !off.is_null() {
        return fail(libc::ESPIPE);
    }
    to_pipe(call, s, out, count, false)
}

/// Whether `pipe`, the other end of a splice with a connection, is one the
/// kernel would splice with, as for a TCP socket: it must be a pipe
/// (`EINVAL`), the socket has no offset (`EINVAL`) and the pipe takes none
/// (`ESPIPE`).
fn pipe_end(pipe: RawFd, sock_off: bool, pipe_off: bool) -> Result<(), c_int> {
    if sock_off || !is_pipe(pipe) {
        return Err(libc::EINVAL);
    }
    if pipe_off {
        return Err(libc::ESPIPE);
    }
    Ok(())
}

fn is_pipe(fd: RawFd) -> bool {
    // SAFETY: an all-zero stat is valid storage for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat into `st`.
    let r = unsafe { libc::fstat(fd, &mut st) };
    r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO
}

/// Whether the pipe `fd` is not waited on: the caller's `SPLICE_F_NONBLOCK`,
/// or the pipe's own `O_NONBLOCK` (the kernel's splice reads both).
fn pipe_nonblocking(fd: RawFd, nonblock: bool) -> bool {
    // SAFETY: F_GETFL on the caller's pipe.
    nonblock || (unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_NONBLOCK) != 0
}

/// Received bytes of `s` into `pipe`, at most `len`: waits for them per the
/// connection's mode, then moves what the pipe takes.
fn to_pipe(call: &Call, s: &Arc<Sock>, pipe: RawFd, len: size_t, nonblock: bool) -> ssize_t {
    if len == 0 || s.conn.read_shut() {
        return 0;
    }
    let nowait = pipe_nonblocking(pipe, nonblock);
    let region = match restarting(call, s.conn.read_timeout(), || s.conn.peek_region()) {
        Ok(r) => r,
        Err(e) => return fail(os_err(&e)),
    };
    if region.is_empty() {
        return 0; // end of stream
    }
    let n = region.len().min(len);
    // SAFETY: the region's first `n` bytes are mapped and stay so while it
    // is held; the kernel reads them (a copy, never a reference).
    let moved = unsafe {
        pipe_io(
            pipe,
            region.as_ptr().cast_mut().cast(),
            n,
            nowait,
            Dir::Write,
        )
    };
    match moved {
        Ok(k) => match region.release(k) {
            Ok(()) => k as ssize_t,
            Err(e) => fail(os_err(&e)),
        },
        Err(e) => fail(e),
    }
}

/// Bytes from `pipe` into `s`'s peer's ring, at most `len`: waits for room
/// per the connection's mode, then takes what the pipe has (0: the pipe
/// has no writer left).
fn from_pipe(call: &Call, pipe: RawFd, s: &Arc<Sock>, len: size_t, nonblock: bool) -> ssize_t {
    if len == 0 {
        return 0;
    }
    let nowait = pipe_nonblocking(pipe, nonblock);
    let mut region = match restarting(call, s.conn.write_timeout(), || s.conn.reserve(1)) {
        Ok(r) => r,
        Err(e) => {
            let en = os_err(&e);
            if en == libc::EPIPE {
                // SAFETY: SIGPIPE as TCP's splice raises it.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            return fail(en);
        }
    };
    let want = region.len().min(len);
    // SAFETY: the region has `want` writable bytes; the kernel writes them.
    let moved = unsafe { pipe_io(pipe, region.as_mut_ptr().cast(), want, nowait, Dir::Read) };
    match moved {
        Ok(0) => 0,
        Ok(k) => match region.commit(k) {
            Ok(()) => {
                crate::cork::arm(s);
                k as ssize_t
            }
            Err(e) => fail(os_err(&e)),
        },
        Err(e) => fail(e),
    }
}

#[derive(Clone, Copy)]
enum Dir {
    /// Ring to pipe.
    Write,
    /// Pipe to ring.
    Read,
}

/// One read from or write to `pipe` of at most `n` bytes at `buf`: what
/// the pipe takes or has now, as the kernel's splice moves; when it has no
/// room or no bytes, `EAGAIN` if `nowait`, otherwise a wait until it has.
/// An `EFAULT` is ring memory gone from under us (a device file shrunk by
/// another process): the connection is broken, `ECONNRESET`.
///
/// # Safety
/// `buf` is valid for `n` bytes of the direction's access.
unsafe fn pipe_io(
    pipe: RawFd,
    buf: *mut c_void,
    n: usize,
    nowait: bool,
    dir: Dir,
) -> Result<usize, c_int> {
    let iov = libc::iovec {
        iov_base: buf,
        iov_len: n,
    };
    loop {
        // SAFETY: one iovec over the caller's buffer.
        let mut r = unsafe { nowait_io(pipe, &iov, dir) };
        if r < 0 && last_errno() == libc::EOPNOTSUPP {
            // SAFETY: as above.
            r = unsafe { polled_io(pipe, buf, n, dir) };
        }
        if r >= 0 {
            return Ok(r as usize);
        }
        match last_errno() {
            libc::EAGAIN if !nowait => wait_pipe(pipe, dir)?,
            libc::EFAULT => return Err(libc::ECONNRESET),
            e => return Err(e),
        }
    }
}

/// Sleeps until `pipe` has room or bytes (or has lost its other end, which
/// the next I/O reports). A signal handler ends the wait with `EINTR`
/// unless the handlers restart calls (`SA_RESTART`), as the kernel's
/// splice.
fn wait_pipe(pipe: RawFd, dir: Dir) -> Result<(), c_int> {
    let events = match dir {
        Dir::Write => libc::POLLOUT,
        Dir::Read => libc::POLLIN,
    };
    let mut p = libc::pollfd {
        fd: pipe,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd.
    if unsafe { real::poll(&mut p, 1, -1) } >= 0 {
        return Ok(());
    }
    match last_errno() {
        libc::EINTR if super::data::handlers_restart() => Ok(()),
        e => Err(e),
    }
}

/// `RWF_NOWAIT` I/O on the pipe: its own blocking mode left alone. The
/// system call itself: musl has no `preadv2` and `pwritev2`. Offset -1
/// (the pipe has none) is `pos_l` alone on a 64-bit kernel.
///
/// # Safety
/// `iov` describes a buffer valid for the direction's access.
unsafe fn nowait_io(pipe: RawFd, iov: &libc::iovec, dir: Dir) -> ssize_t {
    let nr = match dir {
        Dir::Write => libc::SYS_pwritev2,
        Dir::Read => libc::SYS_preadv2,
    };
    let (pos_l, pos_h): (libc::c_long, libc::c_long) = (-1, 0);
    // SAFETY: one iovec over the caller's buffer.
    unsafe { libc::syscall(nr, pipe, iov as *const libc::iovec, 1, pos_l, pos_h, libc::RWF_NOWAIT) as ssize_t }
}

/// For kernels whose pipes refuse `RWF_NOWAIT`: a look, then at most what
/// cannot wait (a readable pipe has bytes; a writable one takes
/// `PIPE_BUF` at once).
///
/// # Safety
/// `buf` is valid for `n` bytes of the direction's access.
unsafe fn polled_io(pipe: RawFd, buf: *mut c_void, n: usize, dir: Dir) -> ssize_t {
    let events = match dir {
        Dir::Write => libc::POLLOUT,
        Dir::Read => libc::POLLIN,
    };
    let mut p = libc::pollfd {
        fd: pipe,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd.
    if unsafe { real::poll(&mut p, 1, 0) } == 0 {
        smclo::adapter::errno::set(libc::EAGAIN);
        return -1;
    }
    // SAFETY: the caller's buffer, `n` bytes or fewer.
    unsafe {
        match dir {
            Dir::Write => real::write(pipe, buf, n.min(libc::PIPE_BUF)),
            Dir::Read => real::read(pipe, buf, n),
        }
    }
}

fn last_errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
