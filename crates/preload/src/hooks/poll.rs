//! `poll`, `ppoll`, `select` and `pselect` over SMC-D descriptors: the
//! rings first, through the core's wait (`smclo::adapter::poller::poll`).
//!
//! A set without SMC-D descriptors or pending connects goes to the real
//! call unchanged. Otherwise the rings answer for the SMC-D descriptors
//! and the kernel for the others; a wait with nothing ready spins for an
//! adaptive budget (per thread) while the connections' writers skip their
//! doorbells, then makes them ring again and sleeps in `ppoll`. `select`
//! and `pselect` are translated to that `pollfd` wait and back, as the
//! kernel implements them.

use super::{fail, os_err};
use crate::real;
use crate::table;
use libc::{c_int, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};
use smclo::adapter::clock::{now_ns, ns, since_ns};
use smclo::adapter::poller::{Few, Member, Pace, Ready};
use std::io;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

thread_local! {
    /// This thread's spin budget and kernel pace across its waits.
    static PACE: Pace = const { Pace::new() };
}

/// The most descriptors a wait is served for; larger ones go to the
/// kernel as they are.
const MAX_FDS: nfds_t = 1 << 20;

/// A valid `timespec` as a duration (`None` for an invalid one, which the
/// kernel refuses with `EINVAL`).
fn duration_of(t: &timespec) -> Option<Duration> {
    (t.tv_sec >= 0 && (0..1_000_000_000).contains(&t.tv_nsec))
        .then(|| Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
}

/// The real `ppoll` over `fds` with `t` (`None`: for ever) and `sigmask`.
fn kernel(fds: &mut [pollfd], t: Option<Duration>, sigmask: *const sigset_t) -> io::Result<usize> {
    let ts = t.map(smclo::adapter::chan_sys::timespec);
    let tp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const timespec);
    // SAFETY: `fds` is writable for its length; the timespec lives across
    // the call; the mask is the caller's (or null).
    let r = unsafe { real::ppoll(fds.as_mut_ptr(), fds.len() as nfds_t, tp, sigmask) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// The wait over `fds` of at most `t` (`None`: for ever), the rings of
/// the SMC-D descriptors among them first; `poll`'s return value.
fn wait(fds: &mut [pollfd], t: Option<Duration>, sigmask: *const sigset_t) -> c_int {
    let socks: Few<(usize, super::swap::InCall)> = fds
        .iter()
        .enumerate()
        .filter_map(|(i, p)| super::swap::in_call(p.fd).map(|s| (i, s)))
        .collect();
    let r = if socks.is_empty() {
        kernel(fds, t, sigmask)
    } else {
        let members: Few<Member<'_>> = socks
            .iter()
            .map(|(i, s)| Member {
                index: *i,
                conn: &s.conn,
                also: Ready::EMPTY,
            })
            .collect();
        let k = |f: &mut [pollfd], t| kernel(f, t, sigmask);
        // SAFETY: the caller's signal set, when not null.
        let mask = unsafe { sigmask.as_ref() };
        PACE.with(|p| smclo::adapter::poller::poll(p, fds, &members, t, mask, k))
    };
    match r {
        Ok(n) => n as c_int,
        Err(e) => fail(os_err(&e)),
    }
}

/// Whether `fds` holds an SMC-D descriptor or a pending connect (a look
/// at each number's table word; [`wait`] takes the connections).
fn served(fds: &[pollfd]) -> bool {
    fds.iter().any(|p| !table::plain_io(p.fd))
}

/// [`wait`], also sleeping on the descriptors of the pending handshakes
/// among `fds` and driving them between kernel waits (`hooks::pending`).
fn wait_driving(fds: &mut [pollfd], t: Option<Duration>, sigmask: *const sigset_t) -> c_int {
    let once = |f: &mut [pollfd], t| wait(f, t, sigmask);
    super::pending::poll(fds, t, once).unwrap_or_else(|| wait(fds, t, sigmask))
}

/// The caller's `pollfd` array, when this wait is one to serve.
///
/// # Safety
/// `fds` points to `n` pollfds (as for the kernel), or is null.
unsafe fn served_slice<'a>(fds: *mut pollfd, n: nfds_t) -> Option<&'a mut [pollfd]> {
    if fds.is_null() || n == 0 || n > MAX_FDS {
        return None;
    }
    // SAFETY: the caller passes `n` pollfds; the program's own memory,
    // which no peer writes.
    let slice = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    served(slice).then_some(slice)
}

/// Interposed `poll(2)`.
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    super::before_wait(ms_timeout(timeout));
    // SAFETY: the caller's arguments.
    match unsafe { served_slice(fds, n) } {
        Some(s) => wait_driving(s, ms_timeout(timeout), std::ptr::null()),
        // SAFETY: forwarded unchanged.
        None => unsafe { real::poll(fds, n, timeout) },
    }
}

/// `poll`'s timeout: negative for ever.
fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// Interposed `ppoll(2)` (the mask applies to every kernel call of the
/// wait, so a signal it lets in is reported as the kernel would).
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    // SAFETY: the caller's timespec, when not null.
    let t = (!ts.is_null()).then(|| duration_of(unsafe { &*ts }));
    super::before_wait(t.map(|t| t.unwrap_or_default()));
    // SAFETY: the caller's arguments.
    match (unsafe { served_slice(fds, n) }, t) {
        (Some(s), None) => wait_driving(s, None, sigmask),
        (Some(s), Some(Some(t))) => wait_driving(s, Some(t), sigmask),
        // SAFETY: forwarded unchanged (an invalid timeout: the kernel's EINVAL).
        _ => unsafe { real::ppoll(fds, n, ts, sigmask) },
    }
}

/// Interposed `__poll_chk`, which `_FORTIFY_SOURCE` programs call
/// (memcached, haproxy): the bound check, then `poll`.
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    len: usize,
) -> c_int {
    check_len(n, len);
    // SAFETY: the caller's arguments, checked as glibc does.
    unsafe { poll(fds, n, timeout) }
}

/// Interposed `__ppoll_chk`: the bound check, then `ppoll`.
#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sigmask: *const sigset_t,
    len: usize,
) -> c_int {
    check_len(n, len);
    // SAFETY: the caller's arguments, checked as glibc does.
    unsafe { ppoll(fds, n, ts, sigmask) }
}

/// glibc's fortify check: `n` pollfds must fit in the `len` bytes the
/// compiler knows of, or the program is aborted.
fn check_len(n: nfds_t, len: usize) {
    if (len / std::mem::size_of::<pollfd>()) < n as usize {
        chk_fail()
    }
}

/// glibc's own failure report; it does not return.
#[cfg(target_env = "gnu")]
fn chk_fail() -> ! {
    extern "C" {
        fn __chk_fail() -> !;
    }
    // SAFETY: takes no arguments and ends the process.
    unsafe { __chk_fail() }
}

/// Other C libraries have no fortify report (nor callers of the `_chk`
/// functions): the abort alone.
#[cfg(not(target_env = "gnu"))]
fn chk_fail() -> ! {
    std::process::abort()
}

/// What `select` asks of a descriptor in each of its sets, and what
/// `revents` put it back in them (the kernel's `POLLIN_SET`, `POLLOUT_SET`
/// and `POLLEX_SET`).
const SELECT_SETS: [(i16, i16); 3] = [
    (
        libc::POLLIN,
        libc::POLLIN | libc::POLLRDNORM | libc::POLLRDBAND | libc::POLLHUP | libc::POLLERR,
    ),
    (
        libc::POLLOUT,
        libc::POLLOUT | libc::POLLWRNORM | libc::POLLWRBAND | libc::POLLERR,
    ),
    (libc::POLLPRI, libc::POLLPRI),
];

/// The three sets of a `select` call. A set holds as many bits as the
/// call's `nfds` names, which may be more than `fd_set`'s `FD_SETSIZE`
/// (programs that allocate larger sets), so its bits are reached as an
/// array of words, never through `fd_set`'s fixed-size type.
struct FdSets([*mut fd_set; 3]);

/// Bits per word of an `fd_set`.
const SET_WORD_BITS: usize = libc::c_ulong::BITS as usize;

impl FdSets {
    /// The word of set `k` that holds `fd`'s bit, and the bit.
    fn word(&self, k: usize, fd: c_int) -> (*mut libc::c_ulong, libc::c_ulong) {
        let fd = fd as usize;
        let w = self.0[k]
            .cast::<libc::c_ulong>()
            .wrapping_add(fd / SET_WORD_BITS);
        (w, 1 << (fd % SET_WORD_BITS))
    }

    /// Whether `fd` is in set `k`.
    ///
    /// # Safety
    /// Set `k` is null or holds at least `fd + 1` bits.
    unsafe fn has(&self, k: usize, fd: c_int) -> bool {
        let (w, bit) = self.word(k, fd);
        // SAFETY: as the caller guarantees; the program's own memory.
        !self.0[k].is_null() && unsafe { w.read_unaligned() } & bit != 0
    }

    /// Adds `fd` to set `k` (not null).
    ///
    /// # Safety
    /// As for [`FdSets::has`].
    unsafe fn set(&self, k: usize, fd: c_int) {
        let (w, bit) = self.word(k, fd);
        // SAFETY: as the caller guarantees; the program's own memory.
        unsafe { w.write_unaligned(w.read_unaligned() | bit) };
    }

    /// The `pollfd` array `select` waits on (`nfds` bits of each set).
    ///
    /// # Safety
    /// As for [`FdSets::has`], for every `fd < nfds`.
    unsafe fn pollfds(&self, nfds: c_int) -> Vec<pollfd> {
        let mut v = Vec::new();
        let mut fd = 0;
        while fd < nfds {
            let empty = |k: usize| {
                // SAFETY: fd < nfds; a set's word is whole (sets are arrays
                // of words).
                self.0[k].is_null() || unsafe { self.word(k, fd).0.read_unaligned() } == 0
            };
            if (0..3).all(empty) {
                // A word with no bit in any set (most of a large set).
                fd += SET_WORD_BITS as c_int;
                continue;
            }
            // SAFETY: fd < nfds.
            let events = (0..3)
                .filter(|&k| unsafe { self.has(k, fd) })
                .fold(0, |e, k| e | SELECT_SETS[k].0);
            if events != 0 {
                v.push(pollfd {
                    fd,
                    events,
                    revents: 0,
                });
            }
            fd += 1;
        }
        v
    }

    /// Writes the result back as the kernel does (whole words up to
    /// `nfds` cleared, then the ready bits set); the count of bits set.
    ///
    /// # Safety
    /// Each set is null or holds at least `nfds` bits, rounded up to words.
    unsafe fn write_back(&self, nfds: c_int, fds: &[pollfd]) -> c_int {
        let words = (nfds as usize).div_ceil(SET_WORD_BITS);
        let mut count = 0;
        for (k, &(asked, back)) in SELECT_SETS.iter().enumerate() {
            let set = self.0[k];
            if set.is_null() {
                continue;
            }
            // SAFETY: the set holds `words` words (fd_set is an array of
            // longs); the program's own memory.
            unsafe { std::ptr::write_bytes(set.cast::<libc::c_ulong>(), 0, words) };
            for p in fds
                .iter()
                .filter(|p| p.events & asked != 0 && p.revents & back != 0)
            {
                // SAFETY: p.fd < nfds.
                unsafe { self.set(k, p.fd) };
                count += 1;
            }
        }
        count
    }
}

/// `select` over `nfds` bits of `sets` when a descriptor in them is served
/// here (`None`: the caller makes the real call): the translation to
/// [`wait_driving`] and back.
///
/// # Safety
/// As for `select(2)`.
unsafe fn select_served(
    nfds: c_int,
    sets: &FdSets,
    t: Option<Duration>,
    sigmask: *const sigset_t,
) -> Option<c_int> {
    if nfds < 0 || !select_readable(nfds) {
        return None;
    }
    // SAFETY: the sets hold `nfds` bits (the caller's contract).
    let mut fds = unsafe { sets.pollfds(nfds) };
    if !served(&fds) {
        return None;
    }
    let deadline = t.map(|t| Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let r = wait_driving(&mut fds, left, sigmask);
        if r < 0 {
            return Some(r);
        }
        if fds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
            return Some(fail(libc::EBADF));
        }
        if r == 0 || ignore_uncounted(&mut fds) == 0 {
            // SAFETY: as above.
            return Some(unsafe { sets.write_back(nfds, &fds) });
        }
    }
}

/// This process's descriptor table size (`FDSize` of /proc/self/status)
/// as last read, 0 before; the table never shrinks while the process
/// lives (a fork child's may be smaller: [`forget_fd_table`]).
static FD_TABLE: AtomicI32 = AtomicI32::new(0);
/// When [`FD_TABLE`] was last read ([`now_ns`]).
static FD_TABLE_AT: AtomicU64 = AtomicU64::new(0);
/// How often a `select` with more bits than the known table reads it
/// again (in between such calls go to the kernel as they are).
const FD_TABLE_EVERY: Duration = Duration::from_secs(1);

/// Whether the sets of a `select` over `nfds` are read here: the kernel
/// reads no bit beyond its descriptor table, so a program may pass a
/// larger `nfds` than its sets hold (`getdtablesize()` with `fd_set`s).
/// Up to `FD_SETSIZE` (an `fd_set`'s size) or the table's size the sets
/// hold `nfds` bits; beyond, the kernel answers.
fn select_readable(nfds: c_int) -> bool {
    if nfds <= libc::FD_SETSIZE as c_int || nfds <= FD_TABLE.load(Ordering::Relaxed) {
        return true;
    }
    let at = FD_TABLE_AT.load(Ordering::Relaxed);
    if at != 0 && since_ns(at) < ns(FD_TABLE_EVERY) {
        return false;
    }
    FD_TABLE_AT.store(now_ns().max(1), Ordering::Relaxed);
    let size = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|st| {
            st.lines()
                .find_map(|l| l.strip_prefix("FDSize:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0);
    FD_TABLE.store(size, Ordering::Relaxed);
    nfds <= size
}

/// In a fork child, whose descriptor table may be smaller than the
/// parent's: [`FD_TABLE`] is read again when needed.
pub(super) fn forget_fd_table() {
    FD_TABLE.store(0, Ordering::Relaxed);
    FD_TABLE_AT.store(0, Ordering::Relaxed);
}

/// `poll` reports `POLLHUP` whatever was asked, which `select` counts only
/// in the read set: a descriptor whose report no set counts (a hung-up
/// pipe in the except set) is left out of the wait from now on, as the
/// kernel's `select` keeps sleeping over it. How many were left out.
fn ignore_uncounted(fds: &mut [pollfd]) -> usize {
    let counted = |p: &pollfd| {
        SELECT_SETS
            .iter()
            .any(|&(asked, back)| p.events & asked != 0 && p.revents & back != 0)
    };
    if fds.iter().any(|p| p.revents != 0 && counted(p)) {
        return 0;
    }
    let mut n = 0;
    for p in fds.iter_mut().filter(|p| p.revents != 0) {
        p.fd = -1;
        n += 1;
    }
    n
}

/// Interposed `select(2)`. As Linux's, it leaves the time not slept in
/// `*tv` (on success and on `EINTR`).
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    // SAFETY: the caller's timeval, when not null.
    let t = (!tv.is_null()).then(|| unsafe { *tv });
    let timeout = match t {
        None => None,
        Some(t) if t.tv_sec >= 0 && t.tv_usec >= 0 => {
            Some(Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64))
        }
        // SAFETY: forwarded unchanged (the kernel's EINVAL).
        Some(_) => return unsafe { real::select(nfds, r, w, e, tv) },
    };
    super::before_wait(timeout);
    let start = Instant::now();
    // SAFETY: the caller's sets, as for select(2).
    let Some(n) = (unsafe { select_served(nfds, &FdSets([r, w, e]), timeout, std::ptr::null()) })
    else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::select(nfds, r, w, e, tv) };
    };
    if let Some(t) = timeout {
        let left = t.saturating_sub(start.elapsed());
        // SAFETY: the caller's timeval (not null, since there is a timeout).
        unsafe {
            *tv = timeval {
                tv_sec: left.as_secs().min(i64::MAX as u64) as _,
                tv_usec: left.subsec_micros() as _,
            }
        };
    }
    n
}

/// glibc's other name of `select`.
#[no_mangle]
pub unsafe extern "C" fn __select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // SAFETY: the same function.
    unsafe { select(nfds, r, w, e, tv) }
}

/// Interposed `pselect(2)`: the mask applies to every kernel call of the
/// wait; the timeout is not written back (glibc's does not either).
#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // Handlers count from here (`smclo::adapter::signal::Call`).
    let _call = smclo::adapter::signal::Call::begin();
    // SAFETY: the caller's timespec, when not null.
    let t = (!ts.is_null()).then(|| duration_of(unsafe { &*ts }));
    super::before_wait(t.map(|t| t.unwrap_or_default()));
    let served = match t {
        // SAFETY: the caller's sets, as for pselect(2).
        None => unsafe { select_served(nfds, &FdSets([r, w, e]), None, sigmask) },
        // SAFETY: as above.
        Some(Some(t)) => unsafe { select_served(nfds, &FdSets([r, w, e]), Some(t), sigmask) },
        Some(None) => None,
    };
    // SAFETY: forwarded unchanged (including an invalid timeout: EINVAL).
    served.unwrap_or_else(|| unsafe { real::pselect(nfds, r, w, e, ts, sigmask) })
}
