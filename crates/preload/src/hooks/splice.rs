//! `sendfile(2)` into an SMC-D connection (file bytes read straight into
//! the peer's ring), and `splice(2)` and `sendfile(2)` between a
//! connection and a pipe, as TCP's: the bytes move between the ring and
//! the pipe with one copy by the kernel (`write` from the received region,
//! `read` into the reserved one), and only what the pipe took or gave is
//! consumed or sent, so nothing is lost when the pipe is full or empty. Proxies splice
//! (haproxy's `option splice-*`): a refusal the kernel never gives would
//! end their connections.
//!
//! In the kernel's order: the pipe first (room or bytes; not waited for
//! with `SPLICE_F_NONBLOCK` or a non-blocking pipe), then the connection
//! (per its own mode and timeouts), then what the pipe takes or gives
//! without waiting (`RWF_NOWAIT`); no lock of the connection is held
//! while the pipe is waited on. Anything else (a connection and a file,
//! two connections, an offset, an unknown flag) gets the kernel's answer
//! for a TCP socket there. `SPLICE_F_MORE` into a connection is
//! `MSG_MORE`, as TCP takes it: the bytes are held until a write without it.
//! `tee` and `vmsplice` take pipes only, so they are not interposed: the
//! kernel answers for the connection's socket as it does for TCP's.

use super::data::restarting;
use super::{fail, fail_write, os_err};
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
    if let Err(e) = decided(fd_in, fd_out) {
        return fail(e);
    }
    let (sin, sout) = (super::swap::in_call(fd_in), super::swap::in_call(fd_out));
    if sin.is_none() && sout.is_none() {
        // SAFETY: forwarded unchanged.
        return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    }
    // The kernel's checks, in its order, for a TCP socket there.
    if len == 0 {
        return 0;
    }
    if flags & !SPLICE_FLAGS != 0 {
        return fail(libc::EINVAL);
    }
    let nowait = flags & libc::SPLICE_F_NONBLOCK != 0;
    match (sin, sout) {
        (Some(s), None) => {
            match pipe_end(fd_out, Dir::Write, !off_out.is_null(), !off_in.is_null()) {
                Ok(pipe) => to_pipe(&call, &s, pipe.nowait(nowait), len),
                Err(e) => fail(e),
            }
        }
        (None, Some(s)) => {
            match pipe_end(fd_in, Dir::Read, !off_in.is_null(), !off_out.is_null()) {
                Ok(pipe) => from_pipe(
                    &call,
                    pipe.nowait(nowait),
                    &s,
                    len,
                    flags & libc::SPLICE_F_MORE != 0,
                ),
                Err(e) => fail(e),
            }
        }
        // Neither end is a pipe.
        _ => fail(libc::EINVAL),
    }
}

/// Moving bytes from `inp` to `out`: a pending connection among them
/// decides first, as for a read of `inp` and a write to `out`.
fn decided(inp: RawFd, out: RawFd) -> Result<(), c_int> {
    super::pending::before_read(inp, false)?;
    super::pending::before_write(out, false)
}

/// The flags `splice(2)` knows (`SPLICE_F_ALL`); others are `EINVAL`.
const SPLICE_FLAGS: c_uint =
    libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK | libc::SPLICE_F_MORE | libc::SPLICE_F_GIFT;

/// `sendfile(2)` into the SMC-D connection `s`: file bytes read straight
/// into the peer's ring (`reserve`/`commit`), offset semantics kept.
fn do_sendfile(call: &Call, s: &Arc<Sock>, inp: RawFd, off: *mut off_t, count: size_t) -> ssize_t {
    if table::get(inp).is_some() {
        // From a socket, as TCP's: no offset (ESPIPE), not into a socket.
        return fail(if off.is_null() {
            libc::EINVAL
        } else {
            libc::ESPIPE
        });
    }
    let mut done = 0usize;
    while done < count {
        let mut region =
            match restarting(call, &s.conn, s.conn.write_timeout(), || s.conn.reserve(1)) {
                Ok(r) => r,
                Err(_) if done > 0 => break,
                Err(e) => return fail_write(os_err(&e), true),
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
    // SAFETY: the caller's arguments, and the real function of that name.
    unsafe { sendfile_via(out, inp, off, count, real::sendfile) }
}

/// Interposed `sendfile64` (the same call on 64-bit).
#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: the caller's arguments, and the real function of that name.
    unsafe { sendfile_via(out, inp, off, count, real::sendfile64) }
}

/// `sendfile` or `sendfile64`, whose real function is `real_fn`: into a
/// connection, from one into a pipe, else the real call.
///
/// # Safety
/// As for `sendfile(2)`; `real_fn` is the real function.
unsafe fn sendfile_via(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
    real_fn: unsafe fn(c_int, c_int, *mut off_t, size_t) -> ssize_t,
) -> ssize_t {
    let call = Call::begin();
    if let Err(e) = decided(inp, out) {
        return fail(e);
    }
    match (super::swap::in_call(out), super::swap::in_call(inp)) {
        (Some(s), _) => do_sendfile(&call, &s, inp, off, count),
        (None, Some(s)) => sendfile_from(&call, &s, out, off, count),
        // SAFETY: forwarded unchanged.
        (None, None) => unsafe { real_fn(out, inp, off, count) },
    }
}

/// `sendfile(2)` from the SMC-D connection `s`: into a pipe as the
/// kernel's (which splices), `ESPIPE` with an offset (a socket has none),
/// `EINVAL` into anything else.
fn sendfile_from(
    call: &Call,
    s: &Arc<Sock>,
    out: RawFd,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    if !off.is_null() {
        return fail(libc::ESPIPE);
    }
    if count == 0 {
        return 0;
    }
    match pipe_end(out, Dir::Write, false, false) {
        Ok(pipe) => to_pipe(call, s, pipe, count),
        Err(libc::EBADF) => fail(libc::EBADF),
        Err(_) => {
            debug!("sendfile from an SMC-D connection into fd {out}, not a pipe: EINVAL, as TCP's");
            fail(libc::EINVAL)
        }
    }
}

/// The pipe end of a splice with a connection, and whether its waits are
/// skipped: `SPLICE_F_NONBLOCK` or the pipe's own `O_NONBLOCK` (the
/// kernel's splice reads both).
#[derive(Clone, Copy)]
struct Pipe {
    fd: RawFd,
    dir: Dir,
    nowait: bool,
}

impl Pipe {
    fn nowait(mut self, flag: bool) -> Pipe {
        self.nowait |= flag;
        self
    }
}

/// `fd` as the kernel checks the other end of a splice with a TCP socket:
/// a descriptor (`EBADF`) open for `dir` (`EBADF`), a pipe (`EINVAL`)
/// given no offset (`ESPIPE`), the socket given none either (`EINVAL`).
fn pipe_end(fd: RawFd, dir: Dir, pipe_off: bool, sock_off: bool) -> Result<Pipe, c_int> {
    // SAFETY: F_GETFL on the caller's descriptor.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(libc::EBADF);
    }
    let want = match dir {
        Dir::Write => libc::O_WRONLY,
        Dir::Read => libc::O_RDONLY,
    };
    let acc = fl & libc::O_ACCMODE;
    if acc != want && acc != libc::O_RDWR {
        return Err(libc::EBADF);
    }
    // SAFETY: an all-zero stat is valid storage for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat into `st`.
    let r = unsafe { libc::fstat(fd, &mut st) };
    if r != 0 || st.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return Err(libc::EINVAL);
    }
    if pipe_off {
        return Err(libc::ESPIPE);
    }
    if sock_off {
        return Err(libc::EINVAL);
    }
    let nowait = fl & libc::O_NONBLOCK != 0;
    Ok(Pipe { fd, dir, nowait })
}

/// Received bytes of `s` into `pipe`, at most `len`, in the kernel's
/// order: room in the pipe first (`EPIPE` without readers, `EAGAIN` when
/// full and not waited on), then the connection's bytes (waited for per
/// its mode), then what the pipe takes without waiting. No lock of the
/// connection is held while the pipe is waited on.
fn to_pipe(call: &Call, s: &Arc<Sock>, pipe: Pipe, len: size_t) -> ssize_t {
    loop {
        if let Err(e) = pipe_ready(call, pipe) {
            // A pipe without readers: SIGPIPE, as the kernel's splice.
            return fail_write(e, true);
        }
        let region = match restarting(call, &s.conn, s.conn.read_timeout(), || {
            s.conn.peek_region()
        }) {
            Ok(r) => r,
            Err(e) => return fail(os_err(&e)),
        };
        if region.is_empty() {
            return 0; // end of stream
        }
        let n = region.len().min(len);
        // SAFETY: the region's first `n` bytes are ring memory the kernel
        // reads (a copy); a fault there (the file shrunk by another
        // process) is the call's EFAULT, not a signal.
        match unsafe { nowait_io(pipe, region.as_ptr().cast_mut().cast(), n) } {
            Ok(k) => {
                return match region.release(k) {
                    Ok(()) => k as ssize_t,
                    Err(e) => fail(os_err(&e)),
                }
            }
            // Filled by another writer since it had room: wait again.
            Err(libc::EAGAIN) if !pipe.nowait => continue,
            Err(e) => return fail(e),
        }
    }
}

/// Bytes from `pipe` into `s`'s peer's ring, at most `len`, in the
/// kernel's order: bytes in the pipe first (0 without writers, `EAGAIN`
/// when empty and not waited on), then room in the ring (waited for per
/// the connection's mode), then what the pipe has. No lock of the
/// connection is held while the pipe is waited on. With `more`
/// (`SPLICE_F_MORE`) the bytes are held as with `MSG_MORE`.
fn from_pipe(call: &Call, pipe: Pipe, s: &Arc<Sock>, len: size_t, more: bool) -> ssize_t {
    loop {
        match pipe_ready(call, pipe) {
            Ok(true) => {}
            Ok(false) => return 0, // no writer left
            Err(e) => return fail(e),
        }
        let mut region =
            match restarting(call, &s.conn, s.conn.write_timeout(), || s.conn.reserve(1)) {
                Ok(r) => r,
                Err(e) => return fail_write(os_err(&e), true),
            };
        let want = region.len().min(len);
        // SAFETY: the region has `want` writable bytes; the kernel writes
        // them (a copy).
        match unsafe { nowait_io(pipe, region.as_mut_ptr().cast(), want) } {
            Ok(0) => return 0,
            Ok(k) => {
                let committed = if more {
                    region.commit_more(k)
                } else {
                    region.commit(k)
                };
                return match committed {
                    Ok(()) => {
                        crate::cork::arm(s);
                        k as ssize_t
                    }
                    Err(e) => fail(os_err(&e)),
                };
            }
            // Emptied by another reader since it had bytes: wait again.
            Err(libc::EAGAIN) if !pipe.nowait => continue,
            Err(e) => return fail(e),
        }
    }
}

#[derive(Clone, Copy)]
enum Dir {
    /// Ring to pipe.
    Write,
    /// Pipe to ring.
    Read,
}

/// Waits until `pipe` has room (writing) or bytes (reading), unless it is
/// not waited on (`EAGAIN` then). Writing without readers is `EPIPE`
/// (the caller raises SIGPIPE, as the kernel's splice); reading without writers and
/// nothing left is `Ok(false)`. A signal handler that ran in `call` ends
/// the wait with `EINTR` unless the handlers restart calls (`SA_RESTART`).
fn pipe_ready(call: &Call, pipe: Pipe) -> Result<bool, c_int> {
    let events = match pipe.dir {
        Dir::Write => libc::POLLOUT,
        Dir::Read => libc::POLLIN,
    };
    loop {
        let mut p = libc::pollfd {
            fd: pipe.fd,
            events,
            revents: 0,
        };
        let timeout = if pipe.nowait { 0 } else { -1 };
        if call.interrupted() && !pipe.nowait {
            if !super::data::handlers_restart() {
                return Err(libc::EINTR);
            }
            call.restart();
        }
        // SAFETY: one pollfd.
        let r = unsafe { real::poll(&mut p, 1, timeout) };
        if r < 0 {
            match last_errno() {
                libc::EINTR if super::data::handlers_restart() => continue,
                e => return Err(e),
            }
        }
        let rev = p.revents;
        return match pipe.dir {
            Dir::Write if rev & libc::POLLERR != 0 => Err(libc::EPIPE),
            Dir::Write if rev & libc::POLLOUT != 0 => Ok(true),
            Dir::Read if rev & libc::POLLIN != 0 => Ok(true),
            Dir::Read if rev & libc::POLLHUP != 0 => Ok(false),
            _ if pipe.nowait => Err(libc::EAGAIN),
            _ => continue,
        };
    }
}

/// One read from or write to `pipe` of at most `n` bytes at `buf`,
/// without waiting (`EAGAIN`): what the pipe takes or has now, as the
/// kernel's splice moves. `RWF_NOWAIT` leaves the pipe's own mode alone;
/// kernels whose pipes refuse it get [`polled_io`]. An `EFAULT` is ring
/// memory gone from under us (a device file shrunk by another process):
/// the connection is broken, `ECONNRESET`.
///
/// # Safety
/// `buf` is valid for `n` bytes of the direction's access.
unsafe fn nowait_io(pipe: Pipe, buf: *mut c_void, n: usize) -> Result<usize, c_int> {
    let iov = libc::iovec {
        iov_base: buf,
        iov_len: n,
    };
    let nr = match pipe.dir {
        Dir::Write => libc::SYS_pwritev2,
        Dir::Read => libc::SYS_preadv2,
    };
    // The system call itself: musl has no `preadv2` and `pwritev2`.
    // Offset -1 (the pipe has none) is `pos_l` alone on a 64-bit kernel.
    let (pos_l, pos_h): (libc::c_long, libc::c_long) = (-1, 0);
    // SAFETY: one iovec over the caller's buffer.
    let mut r = unsafe {
        libc::syscall(
            nr,
            pipe.fd,
            &iov as *const libc::iovec,
            1,
            pos_l,
            pos_h,
            libc::RWF_NOWAIT,
        ) as ssize_t
    };
    if r < 0 && last_errno() == libc::EOPNOTSUPP {
        // SAFETY: as above.
        r = unsafe { polled_io(pipe, buf, n) };
    }
    match r {
        r if r >= 0 => Ok(r as usize),
        _ if last_errno() == libc::EFAULT => Err(libc::ECONNRESET),
        _ => Err(last_errno()),
    }
}

/// For kernels whose pipes refuse `RWF_NOWAIT`: a look, then at most what
/// cannot wait (a readable pipe has bytes; a writable one takes
/// `PIPE_BUF` at once). Another user of the pipe between the look and the
/// call can make it wait.
///
/// # Safety
/// `buf` is valid for `n` bytes of the direction's access.
unsafe fn polled_io(pipe: Pipe, buf: *mut c_void, n: usize) -> ssize_t {
    let events = match pipe.dir {
        Dir::Write => libc::POLLOUT,
        Dir::Read => libc::POLLIN,
    };
    let mut p = libc::pollfd {
        fd: pipe.fd,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd.
    if unsafe { real::poll(&mut p, 1, 0) } == 0 {
        errno::set(libc::EAGAIN);
        return -1;
    }
    // SAFETY: the caller's buffer, `n` bytes or fewer.
    unsafe {
        match pipe.dir {
            Dir::Write => real::write(pipe.fd, buf, n.min(libc::PIPE_BUF)),
            Dir::Read => real::read(pipe.fd, buf, n),
        }
    }
}

fn last_errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
