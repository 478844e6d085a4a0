//! The system calls a connection makes on its channel, made directly
//! instead of through libc's functions of the same names. A library that
//! interposes those functions (the preload behind `smclo run`) makes the
//! channel's descriptor the application's own, so a libc call on it would
//! come back into the interposed function (a doorbell `recv` into the
//! connection's own `recv`). Each does what libc's function does, without
//! being a thread cancellation point. They return what the system call
//! returns (-1 with `errno` set on failure), as libc's functions do.

use libc::{c_int, c_long, c_void};
use std::os::fd::RawFd;

/// `send(2)`.
///
/// # Safety
/// `buf` must be valid for reading `len` bytes.
pub unsafe fn send(fd: RawFd, buf: *const c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: sendto without an address is send; the caller vouches for
    // `buf`.
    unsafe { libc::syscall(libc::SYS_sendto, fd, buf, len, flags, 0usize, 0usize) as isize }
}

/// `recv(2)`.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes.
pub unsafe fn recv(fd: RawFd, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: recvfrom without an address is recv; the caller vouches for
    // `buf`.
    unsafe { libc::syscall(libc::SYS_recvfrom, fd, buf, len, flags, 0usize, 0usize) as isize }
}

/// `poll(2)` (as `ppoll` without a signal mask, which every architecture
/// has); a negative `timeout_ms` waits for good.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: c_int) -> c_int {
    let ts = libc::timespec {
        tv_sec: (timeout_ms / 1000) as libc::time_t,
        tv_nsec: (timeout_ms % 1000) as c_long * 1_000_000,
    };
    let tsp: *const libc::timespec = if timeout_ms < 0 {
        std::ptr::null()
    } else {
        &ts
    };
    // SAFETY: `fds` is valid for its length and `tsp` is null or points to
    // `ts`, both alive across the call; no signal mask is passed.
    unsafe {
        libc::syscall(
            libc::SYS_ppoll,
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            tsp,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        ) as c_int
    }
}

/// `fcntl(2)` with an integer argument.
pub fn fcntl(fd: RawFd, cmd: c_int, arg: c_long) -> c_int {
    // SAFETY: the commands used here (F_GETFL, F_SETFL, F_DUPFD_CLOEXEC)
    // take an integer, no pointer.
    unsafe { libc::syscall(libc::SYS_fcntl, fd, cmd, arg) as c_int }
}

/// `shutdown(2)`.
pub fn shutdown(fd: RawFd, how: c_int) -> c_int {
    // SAFETY: integer arguments only.
    unsafe { libc::syscall(libc::SYS_shutdown, fd, how) as c_int }
}

/// `setsockopt(SO_LINGER)` of zero: the socket's `close` then aborts the
/// connection (an RST) and leaves no TIME_WAIT. Best effort: a socket
/// that is no TCP socket (or gone) stays as it was.
pub fn set_linger_zero(fd: RawFd) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `l` is a valid linger of the size given, read during the
    // call only.
    unsafe {
        libc::syscall(
            libc::SYS_setsockopt,
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const libc::linger,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

/// `close(2)`.
pub fn close(fd: RawFd) -> c_int {
    // SAFETY: integer argument only; the caller owns `fd`.
    unsafe { libc::syscall(libc::SYS_close, fd) as c_int }
}
