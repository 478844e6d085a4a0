//! Processes that use io_uring: their connections stay TCP.
//!
//! io_uring's reads and writes go to the kernel without the C library, so
//! the preload never sees them: on an SMC-D connection, whose descriptor
//! is smclo's channel, they would read its doorbells and write into it,
//! and the program would hang or read garbage. So a process that uses
//! io_uring makes no SMC-D connection, as if `SMCLO_DISABLE` were set for
//! its new connections: its clients do not propose (`IO_URING` in `smclo
//! stats`); the listeners it registered leave the device's registry, and
//! it declines every listening TCP socket it holds or makes (`registry`'s
//! declines: until it exits or execs, clients do not propose to any
//! registration of such a socket, a parent's inherited by fork or exec,
//! or one made later), since it may accept from them through its ring, where smclo
//! never sees the accept and the client would wait for an answer; and its
//! C library `accept` declines the proposals that still come (sent before
//! the decline), so that their clients go on over TCP at once.
//! Connections made before the process was seen to use io_uring stay
//! SMC-D. Three windows remain, where a client that proposed waits for
//! TIMEOUT if the ring accepts its connection: a proposal sent between
//! the look at the registry and the decline; one to a listener whose
//! registration outlives the process's decline (its fork child that uses
//! the ring after the process exits); and one to a listener the process
//! got otherwise after it was seen (`pidfd_getfd`, or a `recvmsg` through
//! its ring) and accepts from through its ring only.
//!
//! A connection an exec or `SCM_RIGHTS` hands such a process is reset at
//! both ends, as for any program that cannot follow one (`hooks::adopt`,
//! `hooks::passing`). `SMCLO_IO_URING=files` says the program's io_uring
//! touches files only (PostgreSQL's `io_method=io_uring`, MariaDB's
//! InnoDB): its connections then go through shared memory as others'.
//!
//! A process is seen to use io_uring when it sets a ring up through
//! `syscall(SYS_io_uring_setup)` (as Rust's io-uring crate does), at its
//! start ([`at_load`]) when liburing is loaded, at its first look
//! ([`in_use`]: its first connection, listener, or adopted connection)
//! when liburing is loaded or an io_uring descriptor is open (a ring made
//! with the system call instruction, as liburing itself does), and at a
//! later look when liburing was loaded since (`dlopen`, of it or of a
//! module that links it). A ring made with the instruction after the
//! first look by a liburing linked in statically is not seen, and a
//! liburing loaded later is seen only at the next look: the connections
//! such a ring reads break.

use super::state;
use smclo::adapter::registry::{self, ListenerGuard};
use smclo::adapter::sockaddr;
use smclo::config::IoUring;
use smclo::debug;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The process uses io_uring (see the module's documentation).
static IN_USE: AtomicBool = AtomicBool::new(false);

/// The process was looked at (loaded libraries, open descriptors).
static LOOKED: AtomicBool = AtomicBool::new(false);

/// The loader's count of objects it loaded (`dlpi_adds`) when the
/// process's libraries were last looked at: a `dlopen` since (of liburing
/// itself, or of a plugin or extension module that links it) makes the
/// next look look again.
static LOADS: AtomicU64 = AtomicU64::new(0);

/// The process was seen to use io_uring during a fork (a fork handler's
/// ring), when its listeners could not leave the registry: they leave at
/// the next look ([`in_use`]).
static UNLIST_LATER: AtomicBool = AtomicBool::new(false);

/// Whether the process uses io_uring and its connections must stay TCP
/// (`SMCLO_IO_URING=tcp`, the default); looks at it the first time, and
/// at its loaded libraries again when the loader loaded some since
/// (threads that ask at once each look: none answers before a look is
/// done).
pub(super) fn in_use() -> bool {
    as_looked();
    loaded_since()
}

/// [`in_use`] without the look at libraries loaded since the first: for
/// a connect, which asks [`loaded_since`] only once it would propose (a
/// connection to a plain server stays TCP whatever the process uses, and
/// saves that look, about 160 instructions).
pub(super) fn as_looked() -> bool {
    if files_only() {
        return false;
    }
    if !LOOKED.load(Ordering::Acquire) {
        LOADS.store(loads(), Ordering::Relaxed);
        if let Some(how) = liburing_loaded().or_else(ring_open) {
            found(how);
        }
        LOOKED.store(true, Ordering::Release);
    }
    if UNLIST_LATER.load(Ordering::Relaxed)
        && !crate::table::Lock::forking()
        && UNLIST_LATER.swap(false, Ordering::AcqRel)
    {
        unlist_listeners();
    }
    IN_USE.load(Ordering::Acquire)
}

/// Whether the process uses io_uring, looking at its libraries again if
/// the loader loaded some since the last look (a `dlopen` of liburing, or
/// of a module that links it). The count is stored after the look, so
/// that a thread that asks meanwhile looks too.
pub(super) fn loaded_since() -> bool {
    if files_only() {
        return false;
    }
    if !IN_USE.load(Ordering::Relaxed) {
        let now = loads();
        if LOADS.load(Ordering::Relaxed) != now {
            if let Some(how) = liburing_loaded() {
                found(how);
            }
            LOADS.store(now, Ordering::Relaxed);
        }
    }
    IN_USE.load(Ordering::Acquire)
}

/// Whether the process was seen to use io_uring, without looking (for a
/// caller that holds the table's lock, which a look that finds a ring
/// takes).
pub(super) fn seen() -> bool {
    IN_USE.load(Ordering::Acquire)
}

/// `SMCLO_IO_URING=files`: the program's io_uring touches no connection.
/// Read here, not through the process's configuration, which a `syscall`
/// or the image's first moments must not set up; a malformed value makes
/// that configuration, and so every connection, plain TCP anyway.
fn files_only() -> bool {
    static FILES: OnceLock<bool> = OnceLock::new();
    *FILES.get_or_init(|| matches!(IoUring::from_env(), Ok(IoUring::Files)))
}

/// The program set an io_uring instance up through `syscall(2)`.
pub(super) fn set_up() {
    if !files_only() {
        found("it set a ring up with io_uring_setup");
    }
}

/// The process uses io_uring (`how` says how that was seen): no new
/// SMC-D connection, and its listeners take none ([`unlist_listeners`]).
fn found(how: &str) {
    if IN_USE.swap(true, Ordering::AcqRel) {
        return;
    }
    debug!("this process uses io_uring ({how}), whose calls smclo does not see: its new connections stay TCP (IO_URING)");
    if crate::table::Lock::forking() {
        // A fork handler: the table cannot change during the fork. The
        // listeners leave at the next look; their accepts decline
        // (IO_URING) meanwhile.
        UNLIST_LATER.store(true, Ordering::Release);
        return;
    }
    unlist_listeners();
}

/// An image starts: a program linked with liburing is seen before its
/// `main`, so that a listener it was handed (by the exec of a launcher
/// that listened, as a socket-passing supervisor does) is declined before
/// the program can accept from it through its ring.
pub(super) fn at_load() {
    if files_only() || super::disabled() {
        return;
    }
    if let Some(how) = liburing_loaded() {
        found(how);
    }
}

/// The declines this process published ([`decline`]), by address: kept
/// until it exits or execs (the new image declines again if it uses
/// io_uring, [`forget_declines`]).
static DECLINES: Mutex<Vec<(SocketAddr, ListenerGuard)>> = Mutex::new(Vec::new());

/// The process's listeners no longer take SMC-D connections: the ones it
/// registered leave the registry, and it declines every listening TCP
/// socket it holds ([`decline`]).
fn unlist_listeners() {
    state::unlist_own_listeners();
    for (fd, addr) in listening_sockets() {
        decline(fd, addr);
    }
}

/// Declines listener `fd`, bound to `addr`, in the registry (unless this
/// process did already): while the process lives, no client proposes to
/// a registration of the socket, one a parent registered before a fork,
/// an earlier image before an exec, or another process later, since the
/// program may accept from it through its ring, where smclo never sees
/// the accept and the client would wait for an answer.
pub(super) fn decline(fd: RawFd, addr: SocketAddr) {
    let Some(c) = super::ctx() else {
        return;
    };
    // In a section: a handler's `listen` may decline too.
    let mut declines = crate::critical::lock(&DECLINES);
    if declines.iter().any(|(a, _)| *a == addr) {
        return;
    }
    match registry::decline_listener(&c.dev, addr) {
        Ok(Some(g)) => {
            debug!("fd {fd}: listener {addr} declined: its clients connect over TCP while this process lives (it uses io_uring)");
            declines.push((addr, g));
        }
        Ok(None) => debug!("fd {fd}: listener {addr} is declined by other processes already"),
        Err(e) => debug!("fd {fd}: listener {addr} could not be declined ({e}): a client that proposes to it waits for TIMEOUT if this process accepts it through its ring"),
    }
}

/// Before an exec: the declines leave the registry (the new image
/// declines again if it uses io_uring). Skipped where a fork copied the
/// lock held by another thread: they then stay until the process exits.
pub(super) fn forget_declines() {
    let _s = crate::critical::enter();
    if let Ok(mut d) = DECLINES.try_lock() {
        d.clear();
    }
}

/// The declines' lock, taken by the fork's prepare handler so that no
/// other thread holds it as the process is copied.
pub(super) type HeldDeclines = MutexGuard<'static, Vec<(SocketAddr, ListenerGuard)>>;

/// See [`HeldDeclines`].
pub(super) fn hold_declines_for_fork() -> HeldDeclines {
    DECLINES.lock().unwrap_or_else(|p| p.into_inner())
}

/// In a fork child: the parent's declines are not the child's (they end
/// with the parent), so it starts with none and declines for itself.
/// Dropping them frees nothing: their entries are the parent's.
pub(super) fn declines_in_child(mut held: HeldDeclines) {
    held.clear();
}

/// The exec failed: the process declines its listeners again if it uses
/// io_uring.
pub(super) fn exec_failed() {
    if seen() && !crate::table::Lock::forking() {
        unlist_listeners();
    }
}

/// Descriptors the process received with `SCM_RIGHTS`: a listener among
/// them is declined if the process was seen to use io_uring (one it
/// receives before then is declined when it is seen, with the others it
/// holds).
pub(super) fn received(fds: &[RawFd]) {
    if seen() {
        for (fd, addr) in fds.iter().filter_map(|&fd| listening(fd)) {
            decline(fd, addr);
        }
    }
}

/// The listening TCP sockets this process holds, with their addresses.
fn listening_sockets() -> Vec<(RawFd, SocketAddr)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<RawFd>().ok())
        .filter_map(listening)
        .collect()
}

/// `fd` with its address if it is a listening TCP socket.
fn listening(fd: RawFd) -> Option<(RawFd, SocketAddr)> {
    if !(super::is_listening(fd) && super::is_tcp_stream(fd)) {
        return None;
    }
    sockaddr::local(fd).ok().map(|a| (fd, a))
}

/// How many objects the loader has loaded so far (`dlpi_adds`): a
/// dozen nanoseconds, the first object's entry only.
fn loads() -> u64 {
    unsafe extern "C" fn first(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        out: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid info, and `out` is the u64
        // that `loads` passed.
        unsafe { *out.cast::<u64>() = (*info).dlpi_adds };
        1
    }
    let mut n = 0u64;
    // The loader's lock is held during the walk: a program's handler that
    // connected or listened in it would wait for its own thread.
    let _s = crate::critical::enter();
    // SAFETY: `first` only reads the loader's entry and writes `n`, which
    // outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(first), (&mut n as *mut u64).cast()) };
    n
}

/// Whether a liburing shared library is loaded.
fn liburing_loaded() -> Option<&'static str> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        found: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid info whose name is null or a
        // NUL-terminated string, and our `found` flag.
        let name = unsafe { (*info).dlpi_name };
        if !name.is_null() {
            // SAFETY: as above.
            let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
            let base = name.rsplit(|&b| b == b'/').next().unwrap_or(name);
            if base.starts_with(b"liburing.so") {
                // SAFETY: `found` is the bool that `liburing_loaded` passed.
                unsafe { *found.cast::<bool>() = true };
                return 1;
            }
        }
        0
    }
    let mut seen = false;
    // As in `loads`.
    let _s = crate::critical::enter();
    // SAFETY: `each` only reads the loader's entries and writes `seen`,
    // which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut seen as *mut bool).cast()) };
    seen.then_some("liburing is loaded")
}

/// Whether an io_uring descriptor is open in the process.
fn ring_open() -> Option<&'static str> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    dir.flatten()
        .any(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.as_os_str().as_encoded_bytes() == b"anon_inode:[io_uring]")
        })
        .then_some("an io_uring descriptor is open")
}
