//! The interposed libc functions.
//!
//! Every function first asks the table what the descriptor's state is
//! (one atomic load); for a descriptor smclo does not know, it calls the
//! real function. The
//! core itself calls libc (poll, recv, fcntl, close, ...) on its own
//! descriptors, which are never table descriptors, so those calls pass
//! straight through and nothing recurses.
//!
//! One file per concept, in layers (docs/ARCHITECTURE.md, the preload's
//! map): the entry points (`setup` makes connections: socket, listen,
//! accept, connect; `data` moves bytes; `control` covers the rest of a
//! descriptor's life: close, dup, fcntl, ioctl, options, epoll_ctl;
//! `epoll_calls` and `poll` the waits; `process` fork, exec and exit;
//! `splice` moves bytes between a connection and a pipe) use the
//! transitions (`pending` drives a handshake that has not decided yet,
//! `swap` turns a TCP descriptor into an SMC-D one), which use the
//! descriptor state (`state`: each change of a descriptor's state, named;
//! `epoll`: the waits over the sets' shadows), over the table
//! (`crate::table`: the states themselves). This file keeps only the
//! small functions they all share.

mod adopt;
mod cmsg;
mod control;
mod data;
mod epoll;
mod epoll_calls;
mod limits;
mod passing;
mod pending;
mod poll;
mod process;
mod setup;
mod signal;
mod splice;
mod state;
mod swap;
mod target;
mod uring;
mod variant;

pub use control::*;
pub use data::*;
pub use epoll_calls::{epoll_pwait, epoll_pwait2, epoll_wait};
pub use limits::*;
pub use poll::{__poll_chk, __ppoll_chk, __select, poll, ppoll, pselect, select};
pub use process::*;
pub use setup::*;
pub use signal::{__sysv_signal, bsd_signal, sigaction, siginterrupt, signal, sigset, sysv_signal};
pub use splice::splice;
pub use variant::{posix_spawn, posix_spawnp};

use crate::table::MAX_FD;
use libc::c_int;
use smclo::adapter::errno;
use smclo::config::Config;
use smclo::debug;
use smclo::device::Device;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};

struct Ctx {
    dev: Arc<Device>,
    cfg: Config,
}

/// `SMCLO_DISABLE=1`: every function passes through.
fn disabled() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("SMCLO_DISABLE").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// A wait that may block is beginning (`timeout` None: for ever): ended
/// connections' TCP sockets are closed first ([`smclo::adapter::deferred`]), in
/// time the program spends waiting anyway.
fn before_wait(timeout: Option<std::time::Duration>) {
    if timeout != Some(std::time::Duration::ZERO) {
        smclo::adapter::deferred::close_deferred();
    }
}

/// The configuration and the device, once per process. A bad configuration
/// or an unusable device is reported once and leaves every connection
/// plain TCP; the program never fails because of smclo.
fn ctx() -> Option<&'static Ctx> {
    static C: OnceLock<Option<Ctx>> = OnceLock::new();
    if let Some(c) = C.get() {
        return c.as_ref();
    }
    thread_local! {
        static SETTING_UP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    // A signal handler that interrupts this thread's first use would wait
    // for it for ever: its calls stay plain TCP. (No section here: opening
    // the device may wait in `flock`, which handlers must interrupt.)
    if SETTING_UP.with(|s| s.replace(true)) {
        return None;
    }
    let c = C.get_or_init(|| {
        if disabled() {
            return None;
        }
        let cfg = match Config::from_env() {
            // The swap puts each new channel at the application's number.
            Ok(c) => Config {
                channel_placed_by_caller: true,
                ..c
            },
            Err(e) => {
                eprintln!(
                    "smclo[{}]: {e}; connections stay plain TCP",
                    std::process::id()
                );
                return None;
            }
        };
        match Device::open(&cfg.device_dir) {
            Ok(dev) => Some(Ctx { dev, cfg }),
            Err(e) => {
                eprintln!(
                    "smclo[{}]: device {} unusable ({e}); connections stay plain TCP",
                    std::process::id(),
                    cfg.device_dir.display()
                );
                None
            }
        }
    });
    SETTING_UP.with(|s| s.set(false));
    c.as_ref()
}

/// Live SMC-D connections in this process (fork and exec skip work at 0).
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn os_err(e: &io::Error) -> c_int {
    e.raw_os_error().unwrap_or(match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Interrupted => libc::EINTR,
        _ => libc::EIO,
    })
}

fn fail<T: From<i8>>(e: c_int) -> T {
    errno::set(e);
    T::from(-1)
}

/// A write's failure `e`, with the SIGPIPE that TCP's raises for `EPIPE`
/// (unless `MSG_NOSIGNAL`: `signal` false).
fn fail_write<T: From<i8>>(e: c_int, signal: bool) -> T {
    if e == libc::EPIPE && signal {
        // SAFETY: raising SIGPIPE in this thread, as the kernel would.
        unsafe { libc::raise(libc::SIGPIPE) };
    }
    fail(e)
}

/// Something an SMC-D descriptor cannot do faithfully: fail loudly.
fn unsupported<T: From<i8>>(fd: RawFd, what: std::fmt::Arguments<'_>) -> T {
    debug!("fd {fd}: {what} is not supported on an SMC-D connection: EOPNOTSUPP");
    fail(libc::EOPNOTSUPP)
}

fn in_table_range(fd: RawFd) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD
}

/// Whether `fd` is an `AF_INET`/`AF_INET6` TCP stream: known without a
/// system call for sockets made by our `socket()` ([`crate::hints::Hint::Tcp`]), asked with
/// `getsockopt` for any other descriptor (inherited, duplicated, ...).
pub(super) fn is_tcp_stream(fd: RawFd) -> bool {
    crate::hints::hinted(fd, crate::hints::Hint::Tcp) || kernel_says_tcp_stream(fd)
}

fn kernel_says_tcp_stream(fd: RawFd) -> bool {
    let get = |name| sockopt_int(fd, name);
    matches!(get(libc::SO_DOMAIN), Some(libc::AF_INET | libc::AF_INET6))
        && get(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && get(libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Whether `fd` is a listening socket (`SO_ACCEPTCONN`).
pub(super) fn is_listening(fd: RawFd) -> bool {
    sockopt_int(fd, libc::SO_ACCEPTCONN) == Some(1)
}

/// An `int` socket option of level `SOL_SOCKET`, or `None` if it cannot be
/// read (not a socket).
pub(super) fn sockopt_int(fd: RawFd, name: c_int) -> Option<c_int> {
    sockopt_int_at(fd, libc::SOL_SOCKET, name)
}

/// An `int` socket option of `level`, or `None` if it cannot be read.
pub(super) fn sockopt_int_at(fd: RawFd, level: c_int, name: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut l = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `l` bytes into `v`.
    let r =
        unsafe { crate::real::getsockopt(fd, level, name, (&mut v as *mut c_int).cast(), &mut l) };
    (r == 0).then_some(v)
}
