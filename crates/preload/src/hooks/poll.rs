//! `poll` and `ppoll` over SMC-D descriptors: the rings first.
//!
//! An event loop's poll session (`hooks::epoll`) lets writers skip their
//! doorbells, so a ring may hold data its descriptor does not show to the
//! kernel (see `smclo::doorbell` "Pollers"). These calls therefore clear
//! `POLLED` on the connections they wait for (writers ring again), look at
//! their rings, and report what is ready there together with what the
//! kernel says at once; only with nothing ready do they sleep in the real
//! call.

use crate::real;
use crate::table::{self, Sock};
use libc::{c_int, nfds_t, pollfd, sigset_t, timespec};
use std::sync::Arc;
use std::time::Duration;

/// The SMC-D connections among `fds`, by index.
fn smc_members(fds: &[pollfd]) -> Vec<(usize, Arc<Sock>)> {
    fds.iter()
        .enumerate()
        .filter_map(|(i, p)| table::get(p.fd).map(|s| (i, s)))
        .collect()
}

/// What the ring of `s` says for a `pollfd` asking for `events`.
fn ring_revents(s: &Sock, events: i16) -> i16 {
    let mut r = s.conn.ready().bits() as i16;
    if s.shut_rd.load(std::sync::atomic::Ordering::Relaxed) {
        r |= libc::POLLIN | libc::POLLRDHUP;
    }
    r & (events | libc::POLLHUP | libc::POLLERR)
}

/// The rings' answer merged into `fds` after a zero-timeout kernel call,
/// or `None` when no ring is ready (then the caller sleeps in the kernel).
fn rings_first(
    fds: &mut [pollfd],
    smc: &[(usize, Arc<Sock>)],
    kernel_now: impl FnOnce(&mut [pollfd]) -> c_int,
) -> Option<c_int> {
    for (_, s) in smc {
        // An error aborted the connection; its readiness says so.
        let _ = s.conn.poll_cancel();
    }
    let ready: Vec<(usize, i16)> = smc
        .iter()
        .map(|(i, s)| (*i, ring_revents(s, fds[*i].events)))
        .filter(|&(_, r)| r != 0)
        .collect();
    if ready.is_empty() {
        return None;
    }
    let r = kernel_now(fds);
    if r < 0 {
        return Some(r);
    }
    for (i, rev) in ready {
        fds[i].revents |= rev;
    }
    Some(fds.iter().filter(|p| p.revents != 0).count() as c_int)
}

/// Milliseconds of `t` (rounded up), -1 for none.
fn millis(t: Option<Duration>) -> c_int {
    t.map_or(-1, |t| {
        t.as_micros().div_ceil(1000).min(c_int::MAX as u128) as c_int
    })
}

/// Interposed `poll(2)`; one over a pending connect is cut into slices
/// that look at its handshake (`hooks::pending`).
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    if fds.is_null() || n == 0 || n > 1 << 20 {
        // SAFETY: forwarded unchanged.
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: the caller passes `n` pollfds (as for the kernel).
    let slice = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: the caller's pollfds, with a shorter timeout.
    let once = |f: &mut [pollfd], t| unsafe { poll_set(f, millis(t)) };
    if let Some(r) = super::pending::poll(slice, t, once) {
        return r;
    }
    // SAFETY: as above.
    unsafe { poll_set(slice, timeout) }
}

/// `poll` over `slice`: the rings first.
unsafe fn poll_set(slice: &mut [pollfd], timeout: c_int) -> c_int {
    let n = slice.len() as nfds_t;
    let smc = smc_members(slice);
    if !smc.is_empty() {
        // SAFETY: the caller's pollfds.
        let now = |f: &mut [pollfd]| unsafe { real::poll(f.as_mut_ptr(), n, 0) };
        if let Some(r) = rings_first(slice, &smc, now) {
            return r;
        }
    }
    // SAFETY: the caller's pollfds and timeout.
    unsafe { real::poll(slice.as_mut_ptr(), n, timeout) }
}

/// Interposed `ppoll(2)` (the mask applies to the zero-timeout call too,
/// so a signal it lets in is reported as the kernel would); one over a
/// pending connect is cut into slices as `poll` is.
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    if fds.is_null() || n == 0 || n > 1 << 20 {
        // SAFETY: forwarded unchanged.
        return unsafe { real::ppoll(fds, n, ts, sigmask) };
    }
    // SAFETY: the caller passes `n` pollfds (as for the kernel).
    let slice = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    // SAFETY: the caller's timespec, when not null.
    let t = (!ts.is_null()).then(|| unsafe { *ts });
    let t = t.map(|t| {
        Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        )
    });
    let once = |f: &mut [pollfd], t: Option<Duration>| {
        let ts = t.map(|t| timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const timespec);
        // SAFETY: the caller's pollfds and mask, with a shorter timeout.
        unsafe { ppoll_set(f, tp, sigmask) }
    };
    if let Some(r) = super::pending::poll(slice, t, once) {
        return r;
    }
    // SAFETY: as above.
    unsafe { ppoll_set(slice, ts, sigmask) }
}

/// `ppoll` over `slice`: the rings first.
unsafe fn ppoll_set(slice: &mut [pollfd], ts: *const timespec, sigmask: *const sigset_t) -> c_int {
    let n = slice.len() as nfds_t;
    let smc = smc_members(slice);
    if !smc.is_empty() {
        let zero = timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: the caller's pollfds and mask.
        let now = |f: &mut [pollfd]| unsafe { real::ppoll(f.as_mut_ptr(), n, &zero, sigmask) };
        if let Some(r) = rings_first(slice, &smc, now) {
            return r;
        }
    }
    // SAFETY: the caller's pollfds, mask and timeout.
    unsafe { real::ppoll(slice.as_mut_ptr(), n, ts, sigmask) }
}
