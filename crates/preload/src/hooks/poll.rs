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

/// Interposed `poll(2)`.
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    if fds.is_null() || n == 0 || n > 1 << 20 {
        // SAFETY: forwarded unchanged.
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: the caller passes `n` pollfds (as for the kernel).
    let slice = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let smc = smc_members(slice);
    if !smc.is_empty() {
        // SAFETY: the caller's pollfds.
        let now = |f: &mut [pollfd]| unsafe { real::poll(f.as_mut_ptr(), n, 0) };
        if let Some(r) = rings_first(slice, &smc, now) {
            return r;
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::poll(fds, n, timeout) }
}

/// Interposed `ppoll(2)` (the mask applies to the zero-timeout call too,
/// so a signal it lets in is reported as the kernel would).
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    if !fds.is_null() && n > 0 && n <= 1 << 20 {
        // SAFETY: the caller passes `n` pollfds (as for the kernel).
        let slice = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
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
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::ppoll(fds, n, ts, sigmask) }
}
