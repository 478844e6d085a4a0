//! The interposed epoll waits: each is served through the set's shadow
//! (`hooks::epoll`) and, while the set holds a pending handshake, drives
//! that handshake between kernel waits (`hooks::pending`).

use super::epoll::{ms_left, pwait, wait_set};
use crate::real;
use libc::{c_int, epoll_event, sigset_t, timespec};
use smclo::adapter::errno;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// The interposed waits, shadowed set or not; one that holds a pending
/// handshake also sleeps on the handshake's descriptor and looks at it
/// between kernel waits (`hooks::pending`).
unsafe fn wait_entry(
    ep: RawFd,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    sigmask: *const sigset_t,
    fallback: impl FnOnce() -> c_int,
) -> c_int {
    super::before_wait(timeout);
    let slice = |t: Option<Duration>| {
        // SAFETY: the caller's arguments, with a shorter timeout.
        unsafe {
            wait_set(ep, events, max, t, sigmask, || {
                let ms = ms_left(t.map(|t| Instant::now() + t));
                if events.is_null() || max <= 0 {
                    // The kernel's EFAULT or EINVAL.
                    return real::epoll_pwait(ep, events, max, ms, sigmask);
                }
                // SAFETY: the caller passes `max` writable events; the
                // program's own memory, which no peer writes.
                let room = std::slice::from_raw_parts_mut(events, max as usize);
                match pwait(ep, room, ms, sigmask) {
                    Ok(n) => n as c_int,
                    Err(e) => {
                        errno::set(e);
                        -1
                    }
                }
            })
        }
    };
    if let Some(r) = super::pending::epoll_wait(ep, timeout, slice) {
        return r;
    }
    // SAFETY: forwarded.
    unsafe { wait_set(ep, events, max, timeout, sigmask, fallback) }
}

fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// Interposed `epoll_wait(2)`.
#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    ep: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    // SAFETY: forwarded (or served over the caller's buffer).
    unsafe {
        wait_entry(
            ep,
            events,
            max,
            ms_timeout(timeout),
            std::ptr::null(),
            || real::epoll_wait(ep, events, max, timeout),
        )
    }
}

/// Interposed `epoll_pwait(2)`: the mask is in force for every kernel
/// call of the wait, so a signal it lets in ends the spin too (`EINTR`).
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    ep: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const sigset_t,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    // SAFETY: as for epoll_wait.
    unsafe {
        wait_entry(ep, events, max, ms_timeout(timeout), sigmask, || {
            real::epoll_pwait(ep, events, max, timeout, sigmask)
        })
    }
}

/// Interposed `epoll_pwait2(2)` (a `timespec` timeout; the fast path's
/// sleep is in whole milliseconds, rounded up).
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    ep: c_int,
    events: *mut epoll_event,
    max: c_int,
    ts: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    let timeout = if ts.is_null() {
        None
    } else {
        // SAFETY: the caller's timespec.
        let t = unsafe { *ts };
        if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
            return super::fail(libc::EINVAL);
        }
        Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
    };
    // SAFETY: as for epoll_wait; the fallback is the system call itself
    // (not every libc has the wrapper).
    unsafe {
        wait_entry(ep, events, max, timeout, sigmask, || {
            libc::syscall(libc::SYS_epoll_pwait2, ep, events, max, ts, sigmask, 8) as c_int
        })
    }
}
