//! One SMC-D connection as this process sees it ([`Sock`]): what the
//! `Smc` state of its descriptors carries (`crate::table`), and what epoll
//! shadows and the corking thread hold. Its drop is in `crate::table`,
//! which owns the state of the numbers it closes.

use smclo::adapter::conn::Conn;
use smclo::device::Registration;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// One SMC-D connection as this process sees it.
// Aligned so that a pointer to it leaves four low bits for the kind of
// state it is the data of (`crate::table`).
#[repr(align(16))]
pub struct Sock {
    /// The data path. Its channel's descriptor is the application's own
    /// (the number the connection was made on) while the application
    /// keeps that number; see `crate::hooks` (`close`, `dup2`, exec).
    pub conn: Conn,
    /// This end's DMB registration (stats: bytes sent).
    pub reg: Registration,
    /// The TCP socket, hidden at a high descriptor (`FD_CLOEXEC`): identity
    /// for getsockname/getpeername/options. Its close, which ends the TCP
    /// connection and nothing else, waits for the process's next wait
    /// ([`smclo::adapter::deferred`]); the number stays internal until then.
    pub tcp: RawFd,
    /// The SYN mark still on `tcp`, put back before the program sees its
    /// IP options (`getsockopt`, `setsockopt`, exec).
    pub syn_mark: smclo::adapter::tcp_syn::LeftMark,
    /// Application descriptors naming this connection in this process.
    pub fds: AtomicUsize,
    /// `SO_LINGER` with a zero timeout is set: the last close aborts.
    pub linger0: AtomicBool,
    /// `TCP_INQ` is set: `recvmsg` reports the bytes left to read
    /// (`TCP_CM_INQ`), as TCP's.
    pub inq: AtomicBool,
    /// Index of this connection's holder slot ([`crate::holders`]).
    pub slot: usize,
    /// A corking deadline is queued for this connection ([`crate::cork`]).
    pub cork_armed: AtomicBool,
    /// `tcp` counts against the descriptor budget (`smclo::adapter::fdnum`).
    pub _held: smclo::adapter::fdnum::Held,
    /// The destination this process connected to, when its short
    /// connections are learnt (`SMCLO_SHORT`): told how the connection
    /// went when it ends here ([`smclo::adapter::short`]).
    pub learn: std::sync::OnceLock<std::net::SocketAddr>,
    /// The interposed calls of this process that use the connection now
    /// (`hooks::swap::in_call`).
    pub calls: Calls,
}

/// How many interposed calls of this process use a connection now, and
/// whether its last descriptor was closed while they did: Linux keeps a
/// socket whose descriptor a call in progress holds (a `recv` blocked in
/// another thread) until that call returns, so the connection's end waits
/// for the last of them (`hooks::swap`). One word, so that the last call
/// and the close agree on who ends it.
#[derive(Default)]
pub struct Calls(AtomicU32);

/// The bit of [`Calls`] that says the last descriptor is closed.
const ENDING: u32 = 1 << 31;

impl Calls {
    /// A call begins to use the connection; with the table's lock held,
    /// so that a close that takes the connection out of the table after
    /// it sees it.
    pub fn begin(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// A call is done with the connection. True for the last call after
    /// its last descriptor was closed ([`Calls::end_after`]): the caller
    /// ends the connection. A count already 0 stays (a fork child's,
    /// [`Calls::forked_child`]).
    pub fn end(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & !ENDING != 0).then(|| v - 1)
            })
            .is_ok_and(|v| v == ENDING | 1)
    }

    /// In a fork child, whose only thread is the one that forked: the
    /// calls of the parent's other threads are not the child's. Returns
    /// how many calls were counted.
    pub fn forked_child(&self) -> u32 {
        self.0.swap(0, Ordering::Relaxed) & !ENDING
    }

    /// Whether calls use the connection now.
    pub fn in_use(&self) -> bool {
        self.0.load(Ordering::Relaxed) & !ENDING != 0
    }

    /// The connection's last descriptor is closed: true when calls still
    /// use it (the last to end ends it), false when none does any more
    /// (the caller ends it now).
    pub fn end_after(&self) -> bool {
        self.0.fetch_or(ENDING, Ordering::AcqRel) & !ENDING != 0
    }
}

impl Sock {
    /// `shutdown(how)` of the connection: SHUT_WR half-closes (the peer
    /// reads what was sent, then end of stream); SHUT_RD is local, as
    /// TCP's (reads return what is queued, then end of stream).
    pub fn shutdown(&self, how: libc::c_int) -> std::io::Result<()> {
        match how {
            libc::SHUT_RD => self.conn.shutdown_read(),
            libc::SHUT_WR => self.conn.shutdown_write(),
            libc::SHUT_RDWR => self.conn.shutdown_both(),
            _ => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}
