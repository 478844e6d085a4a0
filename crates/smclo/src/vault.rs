//! DMB memfds this process no longer keeps as descriptors but still maps.
//!
//! To save descriptors a connection closes the peer's memfd once it is
//! mapped, and its own once the peer has it when the pool could not take
//! the DMB back (docs/descriptors.md "What a connection holds"). A mapping does not
//! survive exec, a descriptor does: a program that passes a connection to
//! a new image needs the two memfds again. So each closed memfd is parked
//! here first, as `SCM_RIGHTS` in flight to a private datagram socket
//! that is connected to itself: a file in flight takes no descriptor of
//! the process. The socket costs one descriptor per process, whatever the
//! number of connections.
//!
//! A parked memfd is wanted while a [`Kept`] of its identity (device,
//! inode) lives (the [`crate::dmb::Dmb`] that maps it holds one). Removing
//! one message from the queue would mean reading them all, so a memfd no
//! longer wanted stays queued until the queue holds [`SLACK`] more than
//! twice the wanted ones; then the whole queue is read and the wanted ones
//! are queued again.
//!
//! Its calls are system calls, never libc's functions: the preload
//! interposes those, and the fork handlers run where its lock is held.
//!
//! `fork`: the queue is one open file shared by parent and child, so the
//! prepare handler reads it out (holding the lock across the fork) and
//! both sides queue the memfds again, the child into a socket of its own.

use std::cell::UnsafeCell;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// A memfd's identity: (device, inode).
pub type Id = (u64, u64);

/// How many unwanted memfds may stay queued beyond the wanted ones (see the
/// module documentation).
const SLACK: usize = 32;

/// Asked for the socket's send buffer: it bounds how many memfds can be
/// parked (one datagram each). The kernel caps it (`wmem_max`) unless
/// `SO_SNDBUFFORCE` is allowed.
const SNDBUF: libc::c_int = 64 << 20;

struct State {
    /// The socket whose queue holds the memfds, made at the first use.
    sock: Option<OwnedFd>,
    /// Wanted identities and how many [`Kept`]s want each.
    wanted: HashMap<Id, u32>,
    /// Identities with a memfd in the queue.
    queued: HashSet<Id>,
    /// The queue's contents while a fork is under way.
    forking: Vec<(Id, OwnedFd)>,
    /// The socket counts against the descriptor budget, and its number is
    /// the core's.
    _held: Option<(crate::fdnum::Held, crate::fdnum::Mark)>,
}

struct Cell(UnsafeCell<Option<State>>);
// SAFETY: the state is only reached through `with`, under `LOCKED`.
unsafe impl Sync for Cell {}

static STATE: Cell = Cell(UnsafeCell::new(None));
/// A spin lock rather than a `Mutex`: the fork handlers hold it across the
/// fork and the child resets it.
static LOCKED: AtomicBool = AtomicBool::new(false);
static FORK_HOOK: AtomicBool = AtomicBool::new(false);

fn lock() {
    // Held across system calls: a real-time waiter must let its holder run.
    let mut b = crate::backoff::Backoff::new();
    while LOCKED
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        b.snooze();
    }
}

fn unlock() {
    LOCKED.store(false, Ordering::Release);
}

/// The state, with the lock held by the caller.
fn state() -> &'static mut State {
    // SAFETY: the caller holds `LOCKED`, so no other reference to the state
    // exists; the static lives for the process.
    let s = unsafe { &mut *STATE.0.get() };
    s.get_or_insert_with(|| State {
        sock: None,
        wanted: HashMap::new(),
        queued: HashSet::new(),
        forking: Vec::new(),
        _held: None,
    })
}

/// Registers the fork handlers below once per process (and its
/// children, which inherit the registration).
pub(crate) fn ensure_fork_hook() {
    if !FORK_HOOK.swap(true, Ordering::AcqRel) {
        // SAFETY: registers the three handlers below, which take and
        // release the vault's lock around the fork.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
    }
}

fn with<R>(f: impl FnOnce(&mut State) -> R) -> R {
    ensure_fork_hook();
    lock();
    let r = f(state());
    unlock();
    r
}

/// A parked memfd that is wanted: while it lives, [`withdraw`] can give
/// the memfd back.
#[derive(Debug)]
pub struct Kept(Id);

impl Kept {
    /// The parked memfd's identity.
    pub fn id(&self) -> Id {
        self.0
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        with(|s| {
            if let Some(n) = s.wanted.get_mut(&self.0) {
                *n -= 1;
                if *n == 0 {
                    s.wanted.remove(&self.0);
                }
            }
        });
    }
}

/// Parks memfd `fd` (identity `id`) before its descriptor is closed.
/// `None` when it cannot be parked (the queue is full, the user has too
/// many files in flight): the connection then cannot follow an exec.
pub(crate) fn keep(id: Id, fd: BorrowedFd<'_>) -> Option<Kept> {
    with(|s| {
        if !s.queued.contains(&id) {
            if s.queued.len() >= 2 * s.wanted.len() + SLACK {
                collect(s);
            }
            if let Err(e) = park(s, id, fd) {
                crate::debug!(
                    "cannot park DMB memfd {id:?} ({e}); its connection cannot follow an exec"
                );
                return None;
            }
        }
        *s.wanted.entry(id).or_insert(0) += 1;
        Some(Kept(id))
    })
}

/// A close-on-exec descriptor of the parked memfd `id`, which stays parked.
pub(crate) fn withdraw(id: Id) -> Option<OwnedFd> {
    with(|s| {
        let all = drain(s);
        let found = all
            .iter()
            .find(|(i, _)| *i == id)
            .and_then(|(_, f)| crate::fdnum::internal(|| f.try_clone()).ok());
        report(requeue(s, all));
        found
    })
}

/// Reads the queue out and queues the wanted memfds again.
fn collect(s: &mut State) {
    let all = drain(s);
    report(requeue(s, all));
}

/// Queues the wanted memfds of `all` again; returns how many could not
/// be (their connections cannot follow an exec). No logging: the fork
/// handlers use it.
fn requeue(s: &mut State, all: Vec<(Id, OwnedFd)>) -> usize {
    let mut lost = 0;
    for (id, f) in all {
        if s.wanted.contains_key(&id) && !s.queued.contains(&id) && park(s, id, f.as_fd()).is_err()
        {
            lost += 1;
        }
    }
    lost
}

fn report(lost: usize) {
    if lost > 0 {
        crate::debug!("{lost} DMB memfd(s) could not be parked again; their connections cannot follow an exec");
    }
}

/// The vault's socket, made on first use: a datagram socket connected to
/// itself (an autobound abstract name), so that what it sends waits in
/// its own receive queue. A connected datagram socket takes datagrams
/// from its peer only: no other socket can add to the queue.
fn sock(s: &mut State) -> std::io::Result<RawFd> {
    if s.sock.is_none() {
        // SAFETY: plain socket creation.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_socket,
                libc::AF_UNIX,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                0,
            )
        } as RawFd;
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned to us.
        let f = crate::fdnum::move_high(unsafe { OwnedFd::from_raw_fd(fd) });
        connect_to_self(f.as_raw_fd())?;
        let v = SNDBUF;
        for opt in [libc::SO_SNDBUFFORCE, libc::SO_SNDBUF] {
            // SAFETY: setsockopt reads one int.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_setsockopt,
                    f.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &v as *const libc::c_int,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
        }
        s._held = Some((
            crate::fdnum::Held::new(),
            crate::fdnum::Mark::new(f.as_raw_fd()),
        ));
        s.sock = Some(f);
    }
    Ok(s.sock.as_ref().expect("made above").as_raw_fd())
}

/// Binds `fd` to an autobound abstract name and connects it to that name.
fn connect_to_self(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let family_len = std::mem::size_of::<libc::sa_family_t>() as libc::socklen_t;
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    let ap = &mut a as *mut libc::sockaddr_un;
    // SAFETY: bind with only the family autobinds; getsockname and connect
    // read and write `a`, which is large enough, up to `len`.
    let ok = unsafe {
        libc::syscall(libc::SYS_bind, fd, ap, family_len) == 0
            && libc::syscall(libc::SYS_getsockname, fd, ap, &mut len) == 0
            && libc::syscall(libc::SYS_connect, fd, ap, len) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Room for the control message of one descriptor.
const CMSG_SPACE: usize = 64;

#[repr(C, align(8))]
struct Cmsg([u8; CMSG_SPACE]);

fn park(s: &mut State, id: Id, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let tx = sock(s)?;
    let mut body = [0u8; 16];
    body[..8].copy_from_slice(&id.0.to_ne_bytes());
    body[8..].copy_from_slice(&id.1.to_ne_bytes());
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    let mut cbuf = Cmsg([0; CMSG_SPACE]);
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as _;
    // SAFETY: the control buffer holds CMSG_SPACE(4) bytes (checked by the
    // assert), so CMSG_FIRSTHDR is non-null and its data has room for one
    // int.
    unsafe {
        assert!(libc::CMSG_SPACE(4) as usize <= CMSG_SPACE);
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    // SAFETY: msg points at live buffers for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sendmsg,
            tx,
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    s.queued.insert(id);
    Ok(())
}

/// Everything queued, read out (the queue is then empty).
fn drain(s: &mut State) -> Vec<(Id, OwnedFd)> {
    let mut out = Vec::new();
    let Some(rx) = s.sock.as_ref().map(AsRawFd::as_raw_fd) else {
        return out;
    };
    s.queued.clear();
    loop {
        let mut body = [0u8; 16];
        let mut iov = libc::iovec {
            iov_base: body.as_mut_ptr().cast(),
            iov_len: body.len(),
        };
        let mut cbuf = Cmsg([0; CMSG_SPACE]);
        // SAFETY: an all-zero msghdr is valid; the fields are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = CMSG_SPACE as _;
        // SAFETY: msg points at live buffers for the call.
        let n = unsafe {
            libc::syscall(
                libc::SYS_recvmsg,
                rx,
                &mut msg,
                libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            break;
        }
        // SAFETY: the kernel filled msg's control buffer; the walk stays
        // inside msg_controllen.
        let fd = unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            if c.is_null() || (*c).cmsg_type != libc::SCM_RIGHTS {
                None
            } else {
                Some(std::ptr::read_unaligned(
                    libc::CMSG_DATA(c).cast::<libc::c_int>(),
                ))
            }
        };
        let Some(fd) = fd else {
            // A descriptor the kernel could not install (no free number):
            // that memfd is lost to exec.
            continue;
        };
        // SAFETY: the kernel installed `fd` for us.
        let f = unsafe { OwnedFd::from_raw_fd(fd) };
        if n as usize == body.len() {
            let id = (
                u64::from_ne_bytes(body[..8].try_into().expect("8 bytes")),
                u64::from_ne_bytes(body[8..].try_into().expect("8 bytes")),
            );
            out.push((id, f));
        }
    }
    out
}

extern "C" fn fork_prepare() {
    lock();
    let s = state();
    s.forking = drain(s);
}

extern "C" fn fork_parent() {
    let s = state();
    let all = std::mem::take(&mut s.forking);
    requeue(s, all);
    unlock();
}

extern "C" fn fork_child() {
    let s = state();
    // The inherited socket is the parent's queue: the child makes its own.
    s.sock = None;
    s._held = None;
    let all = std::mem::take(&mut s.forking);
    requeue(s, all);
    LOCKED.store(false, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn id_of(f: &std::fs::File) -> Id {
        let m = f.metadata().unwrap();
        (m.dev(), m.ino())
    }

    #[test]
    fn parked_memfds_come_back_while_wanted() {
        let a = crate::dmb::memfd("vault-a").unwrap();
        let b = crate::dmb::memfd("vault-b").unwrap();
        a.set_len(4096).unwrap();
        let (ia, ib) = (id_of(&a), id_of(&b));
        let ka = keep(ia, a.as_fd()).expect("parked");
        let kb = keep(ib, b.as_fd()).expect("parked");
        drop((a, b));
        let back = withdraw(ia).expect("a comes back");
        let f = std::fs::File::from(back);
        assert_eq!(id_of(&f), ia);
        assert_eq!(f.metadata().unwrap().len(), 4096);
        assert!(
            withdraw(ib).is_some(),
            "withdrawing leaves the others parked"
        );
        assert!(withdraw(ia).is_some(), "and the withdrawn one too");
        drop(kb);
        for i in 0..(2 * SLACK + 8) {
            let m = crate::dmb::memfd("vault-x").unwrap();
            drop(keep(id_of(&m), m.as_fd()));
            let _ = i;
        }
        assert!(withdraw(ia).is_some(), "collection keeps what is wanted");
        assert!(
            with(|s| s.queued.len()) <= 2 * with(|s| s.wanted.len()) + SLACK + 1,
            "collection drops what is not"
        );
        drop(ka);
    }
}
