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
use std::time::Duration;

/// A system call made with the instruction itself, as libc's `syscall`
/// makes it (-1 with `errno` set on failure), without calling libc's
/// `syscall`: the preload interposes that too (libuv closes descriptors
/// with `syscall(SYS_close, ..)`), and smclo's own system calls must not
/// come back into it. Async-signal-safe.
///
/// # Safety
/// The arguments must be valid for system call `n`, as for `syscall(2)`.
/// `args`: up to six, as integers (pointers cast); the rest are 0.
#[inline]
pub unsafe fn syscall(n: c_long, args: &[c_long]) -> c_long {
    let mut a = [0; 6];
    a[..args.len().min(6)].copy_from_slice(&args[..args.len().min(6)]);
    // SAFETY: the caller vouches for the arguments; the instruction
    // clobbers only what is declared.
    let r = unsafe { instruction(n, a) };
    if (-4095..0).contains(&r) {
        crate::errno::set(-r as c_int);
        return -1;
    }
    r
}

#[cfg(target_arch = "x86_64")]
unsafe fn instruction(n: c_long, a: [c_long; 6]) -> c_long {
    let r: c_long;
    // SAFETY: the Linux x86_64 system call convention: number in rax,
    // arguments in rdi, rsi, rdx, r10, r8, r9; rcx and r11 are clobbered.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => r,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            in("r8") a[4],
            in("r9") a[5],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    r
}

#[cfg(target_arch = "aarch64")]
unsafe fn instruction(n: c_long, a: [c_long; 6]) -> c_long {
    let r: c_long;
    // SAFETY: the Linux aarch64 system call convention: number in x8,
    // arguments in x0..x5, the result in x0.
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") n,
            inlateout("x0") a[0] => r,
            in("x1") a[1],
            in("x2") a[2],
            in("x3") a[3],
            in("x4") a[4],
            in("x5") a[5],
            options(nostack),
        );
    }
    r
}

/// `send(2)`.
///
/// # Safety
/// `buf` must be valid for reading `len` bytes.
pub unsafe fn send(fd: RawFd, buf: *const c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: sendto without an address is send; the caller vouches for
    // `buf`.
    unsafe {
        syscall(
            libc::SYS_sendto,
            &[fd as c_long, buf as c_long, len as c_long, flags as c_long],
        ) as isize
    }
}

/// `recv(2)`.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes.
pub unsafe fn recv(fd: RawFd, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    // SAFETY: recvfrom without an address is recv; the caller vouches for
    // `buf`.
    unsafe {
        syscall(
            libc::SYS_recvfrom,
            &[fd as c_long, buf as c_long, len as c_long, flags as c_long],
        ) as isize
    }
}

/// `sendmsg(2)`.
///
/// # Safety
/// `msg` must point to a valid `msghdr` whose buffers live across the call.
pub unsafe fn sendmsg(fd: RawFd, msg: *const libc::msghdr, flags: c_int) -> isize {
    // SAFETY: the caller vouches for `msg`.
    unsafe { msg_call(libc::SYS_sendmsg, fd, msg as c_long, flags) }
}

/// `recvmsg(2)`.
///
/// # Safety
/// `msg` must point to a valid `msghdr` whose buffers live across the call.
pub unsafe fn recvmsg(fd: RawFd, msg: *mut libc::msghdr, flags: c_int) -> isize {
    // SAFETY: the caller vouches for `msg`.
    unsafe { msg_call(libc::SYS_recvmsg, fd, msg as c_long, flags) }
}

/// System call `n` (`sendmsg` or `recvmsg`) with a message header.
///
/// # Safety
/// `msg` is a valid `msghdr` for the call, as for `n`.
unsafe fn msg_call(n: c_long, fd: RawFd, msg: c_long, flags: c_int) -> isize {
    // SAFETY: the caller vouches for `msg`.
    unsafe { syscall(n, &[fd as c_long, msg, flags as c_long]) as isize }
}

/// `socket(2)`.
pub fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    // SAFETY: integer arguments only.
    unsafe {
        syscall(
            libc::SYS_socket,
            &[domain as c_long, ty as c_long, protocol as c_long],
        ) as c_int
    }
}

/// `connect(2)` of `fd` to the first `len` bytes of the UNIX address `sa`.
pub fn connect_unix(fd: RawFd, sa: &libc::sockaddr_un, len: libc::socklen_t) -> c_int {
    with_unix_addr(libc::SYS_connect, fd, sa, len)
}

/// `bind(2)` of `fd` to the first `len` bytes of the UNIX address `sa`.
pub fn bind_unix(fd: RawFd, sa: &libc::sockaddr_un, len: libc::socklen_t) -> c_int {
    with_unix_addr(libc::SYS_bind, fd, sa, len)
}

/// System call `n` (`connect` or `bind`) of `fd` with an address.
fn with_unix_addr(n: c_long, fd: RawFd, sa: &libc::sockaddr_un, len: libc::socklen_t) -> c_int {
    let len = len.min(std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t);
    // SAFETY: `sa` is a valid address for the call's duration and `len`
    // is at most its size.
    unsafe {
        syscall(
            n,
            &[
                fd as c_long,
                sa as *const libc::sockaddr_un as c_long,
                len as c_long,
            ],
        ) as c_int
    }
}

/// `accept4(2)` on the UNIX listening socket `fd`, the peer's address into
/// `sa` (its length returned beside the descriptor).
pub fn accept_unix(
    fd: RawFd,
    sa: &mut libc::sockaddr_un,
    flags: c_int,
) -> (c_int, libc::socklen_t) {
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `sa` and `len` are valid for writing across the call, `len`
    // holding the size of `sa`.
    let r = unsafe {
        syscall(
            libc::SYS_accept4,
            &[
                fd as c_long,
                sa as *mut libc::sockaddr_un as c_long,
                &mut len as *mut libc::socklen_t as c_long,
                flags as c_long,
            ],
        ) as c_int
    };
    (r, len)
}

/// `d` as the kernel's `timespec` (seconds beyond its range are its
/// largest), for the calls that take a timeout or a timer's time.
pub fn timespec(d: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: d.subsec_nanos() as _,
    }
}

/// `poll(2)` (as `ppoll` without a signal mask, which every architecture
/// has); a negative `timeout_ms` waits for good.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: c_int) -> c_int {
    let ts = timespec(Duration::from_millis(timeout_ms.max(0) as u64));
    let tsp: *const libc::timespec = if timeout_ms < 0 {
        std::ptr::null()
    } else {
        &ts
    };
    // SAFETY: `fds` is valid for its length and `tsp` is null or points to
    // `ts`, both alive across the call; no signal mask is passed.
    unsafe {
        syscall(
            libc::SYS_ppoll,
            &[
                fds.as_mut_ptr() as c_long,
                fds.len() as c_long,
                tsp as c_long,
            ],
        ) as c_int
    }
}

/// `fcntl(2)` with an integer argument.
pub fn fcntl(fd: RawFd, cmd: c_int, arg: c_long) -> c_int {
    // SAFETY: the commands used here (F_GETFL, F_SETFL, F_DUPFD_CLOEXEC)
    // take an integer, no pointer.
    unsafe { syscall(libc::SYS_fcntl, &[fd as c_long, cmd as c_long, arg]) as c_int }
}

/// `ioctl(FIONBIO)`: `fd`'s `O_NONBLOCK` set or cleared in one call.
pub fn set_nonblocking(fd: RawFd, nonblocking: bool) -> c_int {
    let on: c_int = nonblocking.into();
    // SAFETY: FIONBIO reads one int, `on`, alive across the call.
    unsafe {
        syscall(
            libc::SYS_ioctl,
            &[
                fd as c_long,
                libc::FIONBIO as c_long,
                &on as *const c_int as c_long,
            ],
        ) as c_int
    }
}

/// `shutdown(2)`.
pub fn shutdown(fd: RawFd, how: c_int) -> c_int {
    // SAFETY: integer arguments only.
    unsafe { syscall(libc::SYS_shutdown, &[fd as c_long, how as c_long]) as c_int }
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
        syscall(
            libc::SYS_setsockopt,
            &[
                fd as c_long,
                libc::SOL_SOCKET as c_long,
                libc::SO_LINGER as c_long,
                &l as *const libc::linger as c_long,
                std::mem::size_of::<libc::linger>() as c_long,
            ],
        )
    };
}

/// `close(2)`.
pub fn close(fd: RawFd) -> c_int {
    // SAFETY: integer argument only; the caller owns `fd`.
    unsafe { syscall(libc::SYS_close, &[fd as c_long]) as c_int }
}

#[cfg(test)]
mod tests {
    use super::timespec;
    use std::time::Duration;

    #[test]
    fn a_timespec_holds_the_duration_and_clamps_what_it_cannot() {
        let t = timespec(Duration::new(3, 250_000_000));
        assert_eq!((t.tv_sec, t.tv_nsec), (3, 250_000_000));
        let t = timespec(Duration::MAX);
        assert_eq!((t.tv_sec, t.tv_nsec), (i64::MAX, 999_999_999));
    }
}
