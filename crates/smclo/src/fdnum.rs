//! Where smclo's own descriptors live: high numbers.
//!
//! A program's descriptor numbers must grow as they do over TCP, one per
//! connection: event loops sized by the number of connections (wrk sizes
//! its loop at 10 + 3 × connections), `select` (`FD_SETSIZE`) and programs
//! that expect small numbers depend on it. So every descriptor smclo keeps
//! open beside the application's own (a connection's UNIX channel, a DMB's
//! memfd, the preload's hidden TCP socket) is moved to a number at or above
//! [`floor`], leaving the low numbers to the application's `socket`,
//! `accept` and `open`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// Lowest and highest floor. The upper bound keeps the kernel's descriptor
/// table of a process with a huge `RLIMIT_NOFILE` small, and the numbers
/// inside the preload's table (65536 entries), which marks them internal.
const FLOOR_MIN: i32 = 64;
const FLOOR_MAX: i32 = 32768;

static FLOOR: AtomicI32 = AtomicI32::new(0);

/// The number from which smclo's own descriptors are allocated: half of
/// the soft `RLIMIT_NOFILE` when the process starts using smclo, at least
/// 64 and at most 32768.
pub fn floor() -> i32 {
    let f = FLOOR.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, which we own.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_cur
    } else {
        0
    };
    let f = (soft / 2).clamp(FLOOR_MIN as u64, FLOOR_MAX as u64) as i32;
    FLOOR.store(f, Ordering::Relaxed);
    f
}

/// A close-on-exec duplicate of `fd` at or above [`floor`], or at any free
/// number when there is none up there (a lowered `RLIMIT_NOFILE`, all taken).
pub fn dup_high(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only reads `fd` and returns a new descriptor,
    // which we own.
    let mut n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor() as libc::c_long) };
    if n < 0 {
        // SAFETY: as above.
        n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0 as libc::c_long) };
    }
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` was just returned to us and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// `x` moved to a high number (see [`dup_high`]): the low descriptor is
/// closed. Unchanged if it already is high or cannot be moved.
pub fn move_high<T: Into<OwnedFd> + From<OwnedFd> + AsRawFd>(x: T) -> T {
    if x.as_raw_fd() >= floor() {
        return x;
    }
    match dup_high(x.as_raw_fd()) {
        Ok(high) => T::from(high), // `x` drops (closes) here
        Err(_) => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moved_descriptors_are_high_and_work() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = move_high(a);
        assert!(a.as_raw_fd() >= floor(), "{} < {}", a.as_raw_fd(), floor());
        use std::io::{Read, Write};
        (&a).write_all(b"x").unwrap();
        let mut c = [0u8];
        (&b).read_exact(&mut c).unwrap();
        assert_eq!(&c, b"x");
        assert_eq!(
            // SAFETY: F_GETFD on our own descriptor.
            unsafe { libc::fcntl(a.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC,
            libc::FD_CLOEXEC
        );
    }
}
