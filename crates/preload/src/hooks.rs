//! The interposed libc functions.
//!
//! Every function first asks the table whether the descriptor is an SMC-D
//! connection (one atomic load); if not, it calls the real function. The
//! core itself calls libc (poll, recv, fcntl, close, ...) on its own
//! descriptors, which are never table descriptors, so those calls pass
//! straight through and nothing recurses.

use crate::holders;
use crate::real;
use crate::table::{self, Sock, F_CANDIDATE, F_INTERNAL, F_LISTENER, LOCK, MAX_FD};
use libc::{c_char, c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, pid_t, size_t, sockaddr, socklen_t, ssize_t};
use smclo::config::Config;
use smclo::debug;
use smclo::device::{Device, Role};
use smclo::handshake::{self, Decision, Established};
use smclo::registry::{self, ListenerGuard};
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

// ----- context ------------------------------------------------------------

struct Ctx {
    dev: Arc<Device>,
    cfg: Config,
}

/// `SMCLO_DISABLE=1`: every function passes through.
fn disabled() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("SMCLO_DISABLE").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// The configuration and the device, once per process. A bad configuration
/// or an unusable device is reported once and leaves every connection
/// plain TCP; the program never fails because of smclo.
fn ctx() -> Option<&'static Ctx> {
    static C: OnceLock<Option<Ctx>> = OnceLock::new();
    C.get_or_init(|| {
        if disabled() {
            return None;
        }
        let cfg = match Config::from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("smclo[{}]: {e}; connections stay plain TCP", std::process::id());
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
    })
    .as_ref()
}

/// Live SMC-D connections in this process (fork and exec skip work at 0).
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

fn errno() -> c_int {
    // SAFETY: as in set_errno.
    unsafe { *libc::__errno_location() }
}

fn os_err(e: &io::Error) -> c_int {
    e.raw_os_error().unwrap_or(match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Interrupted => libc::EINTR,
        _ => libc::EIO,
    })
}

fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}

/// Something an SMC-D descriptor cannot do faithfully: fail loudly.
fn unsupported<T: From<i8>>(fd: RawFd, what: std::fmt::Arguments<'_>) -> T {
    debug!("fd {fd}: {what} is not supported on an SMC-D connection: EOPNOTSUPP");
    fail(libc::EOPNOTSUPP)
}

fn in_table_range(fd: RawFd) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD
}

// ----- listeners and epoll records ----------------------------------------

/// Registered listeners: descriptor → its registration, shared by `dup`s.
/// Only touched with [`LOCK`] held for writing (so never held across fork).
static LISTENERS: Mutex<Option<HashMap<RawFd, Arc<ListenerGuard>>>> = Mutex::new(None);

/// epoll registrations of candidate descriptors: (fd, epfd, event).
/// Same locking as [`LISTENERS`].
static EPOLL: Mutex<Vec<(RawFd, RawFd, libc::epoll_event)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forgets what we knew about descriptor number `fd` (it was closed).
fn forget_fd_locked(fd: RawFd) {
    if !in_table_range(fd) {
        return;
    }
    let f = table::FLAGS[fd as usize].swap(0, Ordering::Relaxed);
    if f & F_LISTENER != 0 {
        if let Some(m) = lock(&LISTENERS).as_mut() {
            m.remove(&fd);
        }
    }
    if f & F_CANDIDATE != 0 {
        lock(&EPOLL).retain(|(x, _, _)| *x != fd);
    }
}

fn is_tcp_stream(fd: RawFd) -> bool {
    let get = |name| {
        let mut v: c_int = 0;
        let mut l = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: the kernel writes at most `l` bytes into `v`.
        let r = unsafe { real::getsockopt(fd, libc::SOL_SOCKET, name, (&mut v as *mut c_int).cast(), &mut l) };
        (r == 0).then_some(v)
    };
    matches!(get(libc::SO_DOMAIN), Some(libc::AF_INET | libc::AF_INET6))
        && get(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && get(libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

// ----- the swap -----------------------------------------------------------

/// Makes `fd` a second descriptor of the connection's channel (DESIGN §4):
/// the TCP socket moves to a hidden descriptor, epoll registrations move
/// with the number. On failure the SMC-D connection is closed (the peer
/// reads end of stream) and `fd` stays the TCP socket.
fn swap_in(fd: RawFd, est: Established, slot: usize, nonblock: bool, cloexec: bool) -> bool {
    let Established { conn, registration } = est;
    // High numbers keep the hidden socket out of the application's way
    // (select's FD_SETSIZE, programs that expect small numbers); under a
    // low RLIMIT_NOFILE any free number will do (it is F_INTERNAL).
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor the caller owns.
    let mut tcp = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 1000) };
    if tcp < 0 {
        // SAFETY: as above.
        tcp = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    }
    if tcp < 0 {
        debug!("fd {fd}: cannot hide the TCP socket ({}); SMC-D connection dropped", io::Error::last_os_error());
        holders::forget(slot);
        return false;
    }
    if let Err(e) = conn.set_nonblocking(nonblock) {
        debug!("fd {fd}: O_NONBLOCK on the channel failed ({e}); SMC-D connection dropped");
        // SAFETY: our own duplicate.
        unsafe { real::close(tcp) };
        holders::forget(slot);
        return false;
    }
    let chan = conn.fd();
    let sock = Arc::new(Sock {
        conn,
        reg: registration,
        tcp,
        fds: AtomicUsize::new(0),
        shut_rd: Default::default(),
        linger0: Default::default(),
        rcv_timeo_ms: Default::default(),
        snd_timeo_ms: Default::default(),
        slot,
    });
    table::set_flag(tcp, F_INTERNAL, true);
    table::set_flag(chan, F_INTERNAL, true);
    let g = LOCK.write();
    let recs: Vec<_> = {
        let mut e = lock(&EPOLL);
        let (mine, rest): (Vec<_>, Vec<_>) = e.drain(..).partition(|(x, _, _)| *x == fd);
        *e = rest;
        mine
    };
    // Remove the registrations while `fd` still names the TCP file: after
    // dup3 they could no longer be named, and the hidden duplicate keeps
    // that file (and so its registrations) alive.
    for (_, ep, _) in &recs {
        // SAFETY: plain epoll_ctl DEL with valid descriptors.
        unsafe { real::epoll_ctl(*ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    // The real descriptor is always close-on-exec; the application's view
    // is kept in the table (see exec below).
    // SAFETY: both descriptors are open; dup3 atomically replaces `fd`.
    let r = unsafe { real::dup3(chan, fd, libc::O_CLOEXEC) };
    if r < 0 {
        let e = io::Error::last_os_error();
        drop(g);
        for (_, ep, mut ev) in recs {
            // SAFETY: re-adds the registration we removed.
            unsafe { real::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        }
        debug!("fd {fd}: dup3 failed ({e}); SMC-D connection dropped");
        holders::forget(slot);
        return false; // dropping `sock` closes the connection and `tcp`
    }
    table::install_locked(fd, &sock, cloexec);
    table::set_flag(fd, F_CANDIDATE, false);
    drop(g);
    LIVE.fetch_add(1, Ordering::Relaxed);
    for (_, ep, mut ev) in recs {
        // SAFETY: `fd` is now the channel duplicate; same events and data.
        if unsafe { real::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            debug!("fd {fd}: moving an epoll registration failed: {}", io::Error::last_os_error());
        } else {
            debug!("fd {fd}: epoll registration in epfd {ep} moved to the SMC-D channel");
        }
    }
    debug!("fd {fd}: SMC-D (channel fd {chan}, hidden TCP fd {tcp}, {})", if nonblock { "non-blocking" } else { "blocking" });
    true
}

/// The last descriptor of a connection in this process is gone.
pub(crate) fn last_close(s: &Sock) {
    LIVE.fetch_sub(1, Ordering::Relaxed);
    if holders::leave(s.slot, s.conn.fd()) {
        debug!("SMC-D connection (channel fd {}) stays open: another process still holds it", s.conn.fd());
        s.conn.disown();
    } else if s.linger0.load(Ordering::Relaxed) {
        debug!("SMC-D connection (channel fd {}) aborted (SO_LINGER 0)", s.conn.fd());
        s.conn.abort();
    } else {
        s.conn.close_shared();
    }
}

// ----- socket, listen, accept, connect --------------------------------------

/// Interposed `socket(2)`: marks TCP sockets as candidates (their epoll
/// registrations are recorded until they are connected).
#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real::socket(domain, ty, proto) };
    if fd >= 0 && in_table_range(fd) && !disabled() {
        let tcp = matches!(domain, libc::AF_INET | libc::AF_INET6)
            && ty & 0xf == libc::SOCK_STREAM
            && (proto == 0 || proto == libc::IPPROTO_TCP);
        clear_stale(fd);
        if tcp {
            table::set_flag(fd, F_CANDIDATE, true);
        }
    }
    fd
}

/// A fresh descriptor number from the kernel: whatever we remembered about
/// that number belongs to a descriptor closed behind our back.
fn clear_stale(fd: RawFd) {
    if !in_table_range(fd) {
        return;
    }
    if table::FLAGS[fd as usize].load(Ordering::Relaxed) == 0 && table::TABLE[fd as usize].load(Ordering::Relaxed).is_null() {
        return;
    }
    let g = LOCK.write();
    let old = table::take_locked(fd);
    forget_fd_locked(fd);
    drop(g);
    if let Some(s) = old {
        debug!("fd {fd}: was closed without close(); forgetting its SMC-D connection");
        table::release(s);
    }
}

/// Interposed `listen(2)`: TCP listeners save SYNs and are registered in
/// the device, so smclo clients propose to them.
#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    if disabled() || !in_table_range(fd) || table::has_flag(fd, F_LISTENER) || table::get(fd).is_some() || !is_tcp_stream(fd) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::listen(fd, backlog) };
    }
    let Some(c) = ctx() else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::listen(fd, backlog) };
    };
    let saved = smclo::tcp_syn::save_syns(fd);
    // SAFETY: forwarded unchanged.
    let r = unsafe { real::listen(fd, backlog) };
    if r != 0 {
        return r;
    }
    let e = errno();
    if let Err(err) = saved {
        debug!("fd {fd}: TCP_SAVE_SYN failed ({err}); its connections stay TCP");
        return 0;
    }
    match smclo::sockaddr::local(fd).map_err(smclo::Error::from).and_then(|a| registry::register_listener(&c.dev, a)) {
        Ok(guard) => {
            let _g = LOCK.write();
            lock(&LISTENERS).get_or_insert_with(HashMap::new).insert(fd, Arc::new(guard));
            table::set_flag(fd, F_CANDIDATE, false);
            table::set_flag(fd, F_LISTENER, true);
            debug!("fd {fd}: listening, registered for SMC-D");
        }
        Err(err) => debug!("fd {fd}: listener not registered ({err}); its connections stay TCP"),
    }
    set_errno(e);
    0
}

/// Interposed `accept(2)`.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if !table::has_flag(fd, F_LISTENER) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::accept(fd, addr, len) };
    }
    // SAFETY: same arguments, flags 0 is what accept means.
    unsafe { accept_smc(fd, addr, len, 0) }
}

/// Interposed `accept4(2)`.
#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    if !table::has_flag(fd, F_LISTENER) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::accept4(fd, addr, len, flags) };
    }
    // SAFETY: forwarded.
    unsafe { accept_smc(fd, addr, len, flags) }
}

unsafe fn accept_smc(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: the caller's arguments, forwarded.
    let nfd = unsafe { real::accept4(fd, addr, len, flags) };
    if nfd < 0 {
        return nfd;
    }
    let e = errno();
    clear_stale(nfd);
    let Some(c) = ctx() else { return nfd };
    if !in_table_range(nfd) {
        // Not upgradable: the client falls back after its bounded wait.
        debug!("fd {nfd}: above the table, stays TCP");
        return nfd;
    }
    let Some(slot) = holders::claim() else {
        debug!("fd {nfd}: no holder slot, stays TCP");
        return nfd;
    };
    match handshake::server_accept(&c.dev, &c.cfg, nfd) {
        Decision::Smc(est) => {
            swap_in(nfd, est, slot, flags & libc::SOCK_NONBLOCK != 0, flags & libc::SOCK_CLOEXEC != 0);
        }
        Decision::Tcp(r) => {
            holders::forget(slot);
            debug!("fd {nfd}: accepted as TCP ({r})");
        }
    }
    set_errno(e);
    nfd
}

/// Interposed `connect(2)`: proposes SMC-D to registered smclo listeners
/// and completes the handshake before returning (also for a non-blocking
/// socket, which then returns 0 at once, as DESIGN §3 allows).
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if disabled() || !table::has_flag(fd, F_CANDIDATE) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    // SAFETY: the caller passes `len` readable bytes at `addr`.
    let dest = unsafe { smclo::sockaddr::from_raw(addr, len) };
    let (Some(dest), Some(c)) = (dest, ctx()) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    };
    if !is_tcp_stream(fd) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    // SAFETY: F_GETFL / F_GETFD on the caller's descriptor.
    let (fl, fdfl) = unsafe { (real::fcntl(fd, libc::F_GETFL, 0), real::fcntl(fd, libc::F_GETFD, 0)) };
    let nonblock = fl >= 0 && fl & libc::O_NONBLOCK != 0;
    let cloexec = fdfl >= 0 && fdfl & libc::FD_CLOEXEC != 0;
    let mut p = match handshake::client_propose(&c.dev, &c.cfg, fd, dest) {
        Ok(p) => p,
        Err(r) => {
            c.dev.count_fallback(r, Role::Client);
            debug!("fd {fd}: connect to {dest} stays TCP ({r})");
            table::set_flag(fd, F_CANDIDATE, false);
            // SAFETY: forwarded unchanged.
            return unsafe { real::connect(fd, addr, len) };
        }
    };
    let Some(slot) = holders::claim() else {
        drop(p);
        c.dev.count_fallback(Reason::Mem, Role::Client);
        debug!("fd {fd}: no holder slot; connect to {dest} stays TCP");
        table::set_flag(fd, F_CANDIDATE, false);
        // SAFETY: forwarded unchanged.
        return unsafe { real::connect(fd, addr, len) };
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { real::connect(fd, addr, len) };
    let e = errno();
    p.syn_sent();
    if r != 0 {
        if e != libc::EINPROGRESS {
            // The TCP connect failed: report exactly its error.
            holders::forget(slot);
            drop(p);
            set_errno(e);
            return -1;
        }
        // Non-blocking: wait (bounded) for the TCP connection, leaving any
        // error pending for the application to read.
        let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        let ms = c.cfg.clc_wait.as_millis().clamp(1, i32::MAX as u128) as c_int;
        let deadline = Instant::now() + Duration::from_millis(ms as u64);
        loop {
            let left = deadline.saturating_duration_since(Instant::now()).as_millis() as c_int;
            // SAFETY: one valid pollfd.
            let n = unsafe { real::poll(&mut pfd, 1, left) };
            if n < 0 && errno() == libc::EINTR && left > 0 {
                continue;
            }
            break;
        }
        let connected = pfd.revents & libc::POLLOUT != 0
            && pfd.revents & (libc::POLLERR | libc::POLLHUP) == 0
            && smclo::sockaddr::peer(fd).is_ok();
        if !connected {
            holders::forget(slot);
            drop(p);
            c.dev.count_fallback(Reason::Timeout, Role::Client);
            debug!("fd {fd}: non-blocking connect to {dest} not done in time; stays TCP");
            table::set_flag(fd, F_CANDIDATE, false);
            set_errno(libc::EINPROGRESS);
            return -1;
        }
    }
    match p.finish() {
        Decision::Smc(est) => {
            swap_in(fd, est, slot, nonblock, cloexec);
        }
        Decision::Tcp(r) => {
            holders::forget(slot);
            debug!("fd {fd}: connected to {dest} as TCP ({r})");
        }
    }
    table::set_flag(fd, F_CANDIDATE, false);
    0
}

// ----- data -----------------------------------------------------------------

const RECV_OK: c_int = libc::MSG_PEEK | libc::MSG_WAITALL | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | libc::MSG_CMSG_CLOEXEC;
const SEND_OK: c_int = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | libc::MSG_MORE | libc::MSG_EOR;

fn fd_nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on an open descriptor.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Receive into `buf` with recv(2) flags; -1 with errno on error.
fn do_recv(fd: RawFd, s: &Sock, buf: &mut [u8], flags: c_int) -> ssize_t {
    if flags & !RECV_OK != 0 {
        return unsupported(fd, format_args!("recv flags {:#x}", flags & !RECV_OK));
    }
    if s.shut_rd.load(Ordering::Relaxed) {
        return 0;
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let waitall = flags & libc::MSG_WAITALL != 0;
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let timeo = s.rcv_timeo_ms.load(Ordering::Relaxed);
    let r = if timeo == 0 || dontwait {
        s.conn.recv(buf, peek, waitall, dontwait)
    } else {
        // SO_RCVTIMEO: wait ourselves, bounded.
        let deadline = Instant::now() + Duration::from_millis(timeo as u64);
        loop {
            match s.conn.recv(buf, peek, false, true) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !fd_nonblocking(fd) => {
                    let left = deadline.saturating_duration_since(Instant::now()).as_millis() as c_int;
                    if left == 0 {
                        break Err(e);
                    }
                    let mut p = libc::pollfd { fd: s.conn.fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd.
                    unsafe { real::poll(&mut p, 1, left) };
                }
                other => break other,
            }
        }
    };
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => fail(os_err(&e)),
    }
}

/// Send `buf` with send(2) flags; -1 with errno on error (SIGPIPE on
/// EPIPE unless MSG_NOSIGNAL, as TCP).
fn do_send(fd: RawFd, s: &Sock, buf: &[u8], flags: c_int) -> ssize_t {
    if flags & !SEND_OK != 0 {
        return unsupported(fd, format_args!("send flags {:#x}", flags & !SEND_OK));
    }
    match s.conn.send(buf, flags & libc::MSG_DONTWAIT != 0) {
        Ok(n) => {
            s.reg.add_tx(n as u64);
            n as ssize_t
        }
        Err(e) => {
            let en = os_err(&e);
            if en == libc::EPIPE && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: raising SIGPIPE in this thread, as the kernel would.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            fail(en)
        }
    }
}

fn iovs<'a>(iov: *const iovec, cnt: c_int) -> &'a [iovec] {
    if iov.is_null() || cnt <= 0 {
        return &[];
    }
    // SAFETY: the caller (the application) passes `cnt` iovecs.
    unsafe { std::slice::from_raw_parts(iov, cnt as usize) }
}

/// Gathers small vectors into one send (one doorbell); large ones go one by
/// one.
fn do_sendv(fd: RawFd, s: &Sock, v: &[iovec], flags: c_int) -> ssize_t {
    const GATHER: usize = 64 * 1024;
    let total: usize = v.iter().map(|i| i.iov_len).sum();
    if v.len() == 1 || total <= GATHER {
        if v.len() == 1 {
            // SAFETY: the application's buffer of iov_len bytes.
            let b = unsafe { std::slice::from_raw_parts(v[0].iov_base as *const u8, v[0].iov_len) };
            return do_send(fd, s, b, flags);
        }
        let mut buf = Vec::with_capacity(total);
        for i in v {
            if i.iov_len > 0 {
                // SAFETY: as above.
                buf.extend_from_slice(unsafe { std::slice::from_raw_parts(i.iov_base as *const u8, i.iov_len) });
            }
        }
        return do_send(fd, s, &buf, flags);
    }
    let mut done = 0usize;
    for i in v {
        if i.iov_len == 0 {
            continue;
        }
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts(i.iov_base as *const u8, i.iov_len) };
        let n = do_send(fd, s, b, if done > 0 { flags | libc::MSG_NOSIGNAL } else { flags });
        if n < 0 {
            return if done > 0 { done as ssize_t } else { n };
        }
        done += n as usize;
        if (n as usize) < b.len() {
            break;
        }
    }
    done as ssize_t
}

/// Scatters into vectors: the first waits per mode, the rest take only what
/// is there (unless MSG_WAITALL).
fn do_recvv(fd: RawFd, s: &Sock, v: &[iovec], flags: c_int) -> ssize_t {
    if v.len() == 1 {
        // SAFETY: the application's writable buffer of iov_len bytes.
        let b = unsafe { std::slice::from_raw_parts_mut(v[0].iov_base as *mut u8, v[0].iov_len) };
        return do_recv(fd, s, b, flags);
    }
    if flags & libc::MSG_PEEK != 0 {
        let total: usize = v.iter().map(|i| i.iov_len).sum();
        let mut tmp = vec![0u8; total.min(4 << 20)];
        let n = do_recv(fd, s, &mut tmp, flags);
        if n <= 0 {
            return n;
        }
        let mut off = 0usize;
        for i in v {
            let k = i.iov_len.min(n as usize - off);
            // SAFETY: k <= iov_len bytes into the application's buffer.
            unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr().add(off), i.iov_base as *mut u8, k) };
            off += k;
            if off == n as usize {
                break;
            }
        }
        return n;
    }
    let mut done = 0usize;
    for i in v {
        if i.iov_len == 0 {
            continue;
        }
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts_mut(i.iov_base as *mut u8, i.iov_len) };
        let f = if done > 0 && flags & libc::MSG_WAITALL == 0 { flags | libc::MSG_DONTWAIT } else { flags };
        let n = do_recv(fd, s, b, f);
        if n < 0 {
            return if done > 0 { done as ssize_t } else { n };
        }
        done += n as usize;
        if n == 0 || (n as usize) < b.len() {
            break;
        }
    }
    done as ssize_t
}

/// Interposed `read(2)`.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::read(fd, buf, n) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's writable buffer of `n` bytes.
    do_recv(fd, &s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }, 0)
}

/// Fortified `read` (`_FORTIFY_SOURCE`).
#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { read(fd, buf, n) }
}

/// Interposed `write(2)`.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::write(fd, buf, n) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(fd, &s, unsafe { std::slice::from_raw_parts(buf.cast(), n) }, 0)
}

/// Interposed `recv(2)`.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recv(fd, buf, n, flags) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's writable buffer of `n` bytes.
    do_recv(fd, &s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }, flags)
}

/// Fortified `recv`.
#[no_mangle]
pub unsafe extern "C" fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recv(fd, buf, n, flags) }
}

/// Interposed `send(2)`.
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::send(fd, buf, n, flags) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(fd, &s, unsafe { std::slice::from_raw_parts(buf.cast(), n) }, flags)
}

/// Interposed `recvfrom(2)`: a connected stream reports no address.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvfrom(fd, buf, n, flags, addr, len) };
    };
    if !addr.is_null() && !len.is_null() {
        // SAFETY: the application passed a valid length pointer.
        unsafe { *len = 0 };
    }
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's writable buffer of `n` bytes.
    do_recv(fd, &s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }, flags)
}

/// Fortified `recvfrom`.
#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t {
    if n > buflen {
        // SAFETY: what glibc does on a detected overflow.
        unsafe { libc::abort() };
    }
    // SAFETY: forwarded.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

/// Interposed `sendto(2)`: on a connected stream the address is ignored,
/// as TCP does.
#[no_mangle]
pub unsafe extern "C" fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendto(fd, buf, n, flags, addr, len) };
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: the application's buffer of `n` bytes.
    do_send(fd, &s, unsafe { std::slice::from_raw_parts(buf.cast(), n) }, flags)
}

/// Interposed `readv(2)`.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::readv(fd, iov, cnt) };
    };
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return fail(libc::EINVAL);
    }
    do_recvv(fd, &s, iovs(iov, cnt), 0)
}

/// Interposed `writev(2)`.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::writev(fd, iov, cnt) };
    };
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return fail(libc::EINVAL);
    }
    do_sendv(fd, &s, iovs(iov, cnt), 0)
}

/// Interposed `recvmsg(2)`: no ancillary data, no address.
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmsg(fd, msg, flags) };
    };
    if msg.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the application's msghdr.
    let m = unsafe { &mut *msg };
    if flags & libc::MSG_ERRQUEUE != 0 {
        return unsupported(fd, format_args!("recvmsg(MSG_ERRQUEUE)"));
    }
    let n = do_recvv(fd, &s, iovs(m.msg_iov, m.msg_iovlen as c_int), flags);
    if n >= 0 {
        m.msg_namelen = 0;
        m.msg_controllen = 0;
        m.msg_flags = 0;
    }
    n
}

/// Interposed `sendmsg(2)`: ancillary data (SCM_RIGHTS and the like)
/// cannot travel through shared memory and fails loudly.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendmsg(fd, msg, flags) };
    };
    if msg.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the application's msghdr.
    let m = unsafe { &*msg };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        return unsupported(fd, format_args!("sendmsg with ancillary data ({} bytes)", m.msg_controllen));
    }
    do_sendv(fd, &s, iovs(m.msg_iov, m.msg_iovlen as c_int), flags)
}

/// Interposed `recvmmsg(2)`: one message after another; only the first may
/// wait.
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int, t: *mut libc::timespec) -> c_int {
    if table::get(fd).is_none() {
        // SAFETY: forwarded unchanged.
        return unsafe { real::recvmmsg(fd, v, n, flags, t) };
    }
    let mut done = 0;
    for i in 0..n as usize {
        let f = if done > 0 { flags | libc::MSG_DONTWAIT } else { flags & !libc::MSG_WAITFORONE };
        // SAFETY: the application passes `n` mmsghdrs.
        let h = unsafe { &mut *v.add(i) };
        // SAFETY: forwarded to our recvmsg with the application's msghdr.
        let r = unsafe { recvmsg(fd, &mut h.msg_hdr, f & !libc::MSG_WAITFORONE) };
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        h.msg_len = r as c_uint;
        done += 1;
        if r == 0 {
            break;
        }
    }
    done
}

/// Interposed `sendmmsg(2)`.
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int) -> c_int {
    if table::get(fd).is_none() {
        // SAFETY: forwarded unchanged.
        return unsafe { real::sendmmsg(fd, v, n, flags) };
    }
    let mut done = 0;
    for i in 0..n as usize {
        // SAFETY: the application passes `n` mmsghdrs.
        let h = unsafe { &mut *v.add(i) };
        // SAFETY: forwarded to our sendmsg.
        let r = unsafe { sendmsg(fd, &h.msg_hdr, flags) };
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        h.msg_len = r as c_uint;
        done += 1;
    }
    done
}

fn do_sendfile( s: &Sock, inp: RawFd, off: *mut off_t, count: size_t) -> ssize_t {
    if table::get(inp).is_some() {
        return unsupported(inp, format_args!("sendfile from an SMC-D connection"));
    }
    let mut done = 0usize;
    while done < count {
        let mut region = match s.conn.reserve(1) {
            Ok(r) => r,
            Err(e) => {
                if done > 0 {
                    break;
                }
                let en = os_err(&e);
                if en == libc::EPIPE {
                    // SAFETY: SIGPIPE as TCP's sendfile raises it.
                    unsafe { libc::raise(libc::SIGPIPE) };
                }
                return fail(en);
            }
        };
        let want = region.len().min(count - done);
        let dst = region.as_mut_ptr().cast::<c_void>();
        // SAFETY: `dst` has `want` writable bytes (inside the reserved ring
        // region); `off` is the application's offset pointer or null.
        let n = unsafe {
            if off.is_null() {
                real::read(inp, dst, want)
            } else {
                libc::pread(inp, dst, want, *off)
            }
        };
        if n <= 0 {
            let e = errno();
            drop(region);
            if n < 0 && done == 0 {
                return fail(e);
            }
            break;
        }
        if let Err(e) = region.commit(n as usize) {
            if done == 0 {
                return fail(os_err(&e));
            }
            break;
        }
        s.reg.add_tx(n as u64);
        if !off.is_null() {
            // SAFETY: the application's offset.
            unsafe { *off += n as off_t };
        }
        done += n as usize;
        if (n as usize) < want {
            break; // end of the input file (or a short read)
        }
    }
    done as ssize_t
}

/// Interposed `sendfile(2)`: file bytes go straight into the peer's ring.
#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    match table::get(out) {
        Some(s) => do_sendfile(&s, inp, off, count),
        None if table::get(inp).is_some() => unsupported(inp, format_args!("sendfile from an SMC-D connection")),
        // SAFETY: forwarded unchanged.
        None => unsafe { real::sendfile(out, inp, off, count) },
    }
}

/// Interposed `sendfile64` (the same call on 64-bit).
#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    match table::get(out) {
        Some(s) => do_sendfile(&s, inp, off, count),
        None if table::get(inp).is_some() => unsupported(inp, format_args!("sendfile from an SMC-D connection")),
        // SAFETY: forwarded unchanged.
        None => unsafe { real::sendfile64(out, inp, off, count) },
    }
}

/// Interposed `splice(2)`: not to or from an SMC-D connection.
#[no_mangle]
pub unsafe extern "C" fn splice(a: c_int, ao: *mut libc::loff_t, b: c_int, bo: *mut libc::loff_t, n: size_t, f: c_uint) -> ssize_t {
    for fd in [a, b] {
        if table::get(fd).is_some() {
            return unsupported(fd, format_args!("splice"));
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::splice(a, ao, b, bo, n, f) }
}

/// Interposed `tee(2)`.
#[no_mangle]
pub unsafe extern "C" fn tee(a: c_int, b: c_int, n: size_t, f: c_uint) -> ssize_t {
    for fd in [a, b] {
        if table::get(fd).is_some() {
            return unsupported(fd, format_args!("tee"));
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::tee(a, b, n, f) }
}

/// Interposed `vmsplice(2)`.
#[no_mangle]
pub unsafe extern "C" fn vmsplice(fd: c_int, iov: *const iovec, n: size_t, f: c_uint) -> ssize_t {
    if table::get(fd).is_some() {
        return unsupported(fd, format_args!("vmsplice"));
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::vmsplice(fd, iov, n, f) }
}

// ----- control ----------------------------------------------------------------

/// Interposed `shutdown(2)`: SHUT_WR half-closes (the peer reads what was
/// sent, then end of stream); SHUT_RD is local, as in SMC.
#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::shutdown(fd, how) };
    };
    match how {
        libc::SHUT_RD => {
            s.shut_rd.store(true, Ordering::Relaxed);
            0
        }
        libc::SHUT_WR | libc::SHUT_RDWR => {
            if how == libc::SHUT_RDWR {
                s.shut_rd.store(true, Ordering::Relaxed);
            }
            match s.conn.shutdown_write() {
                Ok(()) => 0,
                Err(e) => fail(os_err(&e)),
            }
        }
        _ => fail(libc::EINVAL),
    }
}

/// Interposed `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !in_table_range(fd) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::close(fd) };
    }
    let flags = table::FLAGS[fd as usize].load(Ordering::Relaxed);
    if flags == 0 && table::TABLE[fd as usize].load(Ordering::Relaxed).is_null() {
        // SAFETY: forwarded unchanged.
        return unsafe { real::close(fd) };
    }
    if flags & F_INTERNAL != 0 {
        debug!("close({fd}) ignored: the descriptor belongs to an SMC-D connection");
        return 0;
    }
    close_slow(fd)
}

#[cold]
fn close_slow(fd: RawFd) -> c_int {
    let g = LOCK.write();
    let s = table::take_locked(fd);
    forget_fd_locked(fd);
    // SAFETY: closing the application's descriptor, as it asked.
    let r = unsafe { real::close(fd) };
    let e = errno();
    drop(g);
    if let Some(s) = s {
        table::release(s);
    }
    set_errno(e);
    r
}

fn dup_into(s: Option<Arc<Sock>>, old: RawFd, new: RawFd, cloexec: bool) {
    if let Some(s) = s {
        if in_table_range(new) {
            table::install_locked(new, &s, cloexec);
        }
    } else if table::has_flag(old, F_LISTENER) && in_table_range(new) {
        if let Some(m) = lock(&LISTENERS).as_mut() {
            if let Some(gd) = m.get(&old).cloned() {
                m.insert(new, gd);
                table::set_flag(new, F_LISTENER, true);
            }
        }
    }
}

/// Interposed `dup(2)`: the new descriptor names the same connection.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let s = table::get(fd);
    if s.is_none() && !table::has_flag(fd, F_LISTENER) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::dup(fd) };
    }
    // SAFETY: F_DUPFD(_CLOEXEC) from 0 is dup(2) (plus close-on-exec for a
    // connection, whose application view is kept in the table).
    unsafe { fcntl_dup(fd, s, libc::F_DUPFD, 0, false) }
}

unsafe fn fcntl_dup(fd: RawFd, s: Option<Arc<Sock>>, cmd: c_int, min: c_ulong, cloexec: bool) -> c_int {
    let g = LOCK.write();
    let real_cmd = if s.is_some() { libc::F_DUPFD_CLOEXEC } else { cmd };
    // SAFETY: duplicating the application's descriptor.
    let n = unsafe { real::fcntl(fd, real_cmd, min) };
    let e = errno();
    if n >= 0 {
        if s.is_some() && !in_table_range(n) {
            // A duplicate the table cannot name would read doorbells.
            // SAFETY: our fresh duplicate.
            unsafe { real::close(n) };
            drop(g);
            debug!("dup of fd {fd} above the table: EMFILE");
            return fail(libc::EMFILE);
        }
        forget_fd_locked(n);
        dup_into(s, fd, n, cloexec);
    }
    drop(g);
    set_errno(e);
    n
}

/// Interposed `dup2(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwarded.
    unsafe { dup_over(old, new, 0, true) }
}

/// Interposed `dup3(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarded.
    unsafe { dup_over(old, new, flags, false) }
}

unsafe fn dup_over(old: RawFd, new: RawFd, flags: c_int, is_dup2: bool) -> c_int {
    let s = table::get(old);
    let interesting = s.is_some()
        || table::has_flag(old, F_LISTENER)
        || (in_table_range(new)
            && (table::FLAGS[new as usize].load(Ordering::Relaxed) != 0 || !table::TABLE[new as usize].load(Ordering::Relaxed).is_null()));
    if !interesting || old == new {
        // SAFETY: forwarded unchanged.
        return unsafe { if is_dup2 { real::dup2(old, new) } else { real::dup3(old, new, flags) } };
    }
    if table::has_flag(new, F_INTERNAL) {
        debug!("dup2 onto fd {new} refused: it belongs to an SMC-D connection");
        return fail(libc::EBUSY);
    }
    if s.is_some() && !in_table_range(new) {
        debug!("dup2 of an SMC-D connection onto fd {new} (above the table) refused");
        return fail(libc::EBADF);
    }
    let g = LOCK.write();
    let real_flags = if s.is_some() { libc::O_CLOEXEC } else { flags };
    // SAFETY: the application's descriptors.
    let r = unsafe { real::dup3(old, new, real_flags) };
    let e = errno();
    let mut prev = None;
    if r >= 0 {
        prev = table::take_locked(new);
        forget_fd_locked(new);
        dup_into(s, old, new, flags & libc::O_CLOEXEC != 0);
    }
    drop(g);
    if let Some(p) = prev {
        table::release(p);
    }
    set_errno(e);
    r
}

unsafe fn fcntl_impl(fd: c_int, cmd: c_int, arg: c_ulong, f: unsafe fn(c_int, c_int, c_ulong) -> c_int) -> c_int {
    let s = table::get(fd);
    if s.is_none() {
        if matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) && table::has_flag(fd, F_LISTENER) {
            // SAFETY: forwarded.
            return unsafe { fcntl_dup(fd, None, cmd, arg, cmd == libc::F_DUPFD_CLOEXEC) };
        }
        // SAFETY: forwarded unchanged.
        return unsafe { f(fd, cmd, arg) };
    }
    match cmd {
        // SAFETY: forwarded.
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => unsafe { fcntl_dup(fd, s, cmd, arg, cmd == libc::F_DUPFD_CLOEXEC) },
        libc::F_GETFD => {
            if table::app_cloexec(fd) {
                libc::FD_CLOEXEC
            } else {
                0
            }
        }
        libc::F_SETFD => {
            table::set_app_cloexec(fd, arg as c_int & libc::FD_CLOEXEC != 0);
            0
        }
        libc::F_SETFL => {
            // SAFETY: the flags live in the shared open file; set them there.
            let r = unsafe { f(fd, cmd, arg) };
            if r == 0 {
                let s = s.expect("table entry");
                let _ = s.conn.set_nonblocking(arg as c_int & libc::O_NONBLOCK != 0);
            }
            r
        }
        // SAFETY: forwarded unchanged (F_GETFL, F_SETOWN, ... work on the
        // channel descriptor natively).
        _ => unsafe { f(fd, cmd, arg) },
    }
}

/// Interposed `fcntl(2)` (the variadic argument read as one word).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarded.
    unsafe { fcntl_impl(fd, cmd, arg, real::fcntl) }
}

/// Interposed `fcntl64` (what glibc ≥ 2.28 headers may call).
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarded.
    unsafe { fcntl_impl(fd, cmd, arg, real::fcntl64) }
}

/// `SIOCOUTQ` (= `TIOCOUTQ`) and `SIOCATMARK` from <linux/sockios.h>.
const SIOCOUTQ: c_ulong = 0x5411;
const SIOCATMARK: c_ulong = 0x8905;

/// Interposed `ioctl(2)`: FIONREAD counts ring bytes, FIONBIO sets the mode.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::ioctl(fd, req, arg) };
    };
    match req {
        libc::FIONREAD => match s.conn.readable_len() {
            Ok(n) => {
                // SAFETY: FIONREAD's argument is an int pointer.
                unsafe { *(arg as *mut c_int) = n.min(c_int::MAX as usize) as c_int };
                0
            }
            Err(e) => fail(os_err(&e)),
        },
        libc::FIONBIO => {
            // SAFETY: FIONBIO's argument is an int pointer.
            let on = unsafe { *(arg as *const c_int) } != 0;
            match s.conn.set_nonblocking(on) {
                Ok(()) => 0,
                Err(e) => fail(os_err(&e)),
            }
        }
        SIOCOUTQ | SIOCATMARK => {
            // SAFETY: both take an int pointer.
            unsafe { *(arg as *mut c_int) = 0 };
            0
        }
        // SAFETY: other requests go to the hidden TCP socket.
        _ => unsafe { real::ioctl(s.tcp, req, arg) },
    }
}

/// Interposed `getsockname(2)`: answered by the hidden TCP socket.
#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let fd = table::get(fd).map_or(fd, |s| s.tcp);
    // SAFETY: forwarded.
    unsafe { real::getsockname(fd, addr, len) }
}

/// Interposed `getpeername(2)`: answered by the hidden TCP socket.
#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let fd = table::get(fd).map_or(fd, |s| s.tcp);
    // SAFETY: forwarded.
    unsafe { real::getpeername(fd, addr, len) }
}

/// Interposed `getsockopt(2)`: options of the hidden TCP socket;
/// SO_ERROR is 0 (errors of the SMC-D connection surface on the calls).
#[no_mangle]
pub unsafe extern "C" fn getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::getsockopt(fd, level, name, val, len) };
    };
    if level == libc::SOL_SOCKET && name == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        // SAFETY: the application's buffer of *len bytes.
        unsafe {
            if (*len as usize) >= std::mem::size_of::<c_int>() {
                *(val as *mut c_int) = 0;
                *len = std::mem::size_of::<c_int>() as socklen_t;
            }
        }
        return 0;
    }
    // SAFETY: forwarded to the hidden socket.
    unsafe { real::getsockopt(s.tcp, level, name, val, len) }
}

fn timeval_ms(val: *const c_void, len: socklen_t) -> Option<u32> {
    if val.is_null() || (len as usize) < std::mem::size_of::<libc::timeval>() {
        return None;
    }
    // SAFETY: checked length; read_unaligned for application buffers.
    let tv = unsafe { std::ptr::read_unaligned(val as *const libc::timeval) };
    let ms = tv.tv_sec as u64 * 1000 + (tv.tv_usec as u64).div_ceil(1000);
    Some(ms.min(u32::MAX as u64) as u32)
}

/// Interposed `setsockopt(2)`: options go to the hidden TCP socket; the
/// ones that change the data path (SO_LINGER 0, SO_RCVTIMEO) are also
/// noted for the connection.
#[no_mangle]
pub unsafe extern "C" fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int {
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::setsockopt(fd, level, name, val, len) };
    };
    // SAFETY: forwarded to the hidden socket (which validates the arguments).
    let r = unsafe { real::setsockopt(s.tcp, level, name, val, len) };
    if r != 0 || level != libc::SOL_SOCKET {
        return r;
    }
    match name {
        libc::SO_LINGER if !val.is_null() && (len as usize) >= std::mem::size_of::<libc::linger>() => {
            // SAFETY: checked length.
            let l = unsafe { std::ptr::read_unaligned(val as *const libc::linger) };
            s.linger0.store(l.l_onoff != 0 && l.l_linger == 0, Ordering::Relaxed);
        }
        libc::SO_RCVTIMEO => {
            if let Some(ms) = timeval_ms(val, len) {
                s.rcv_timeo_ms.store(ms, Ordering::Relaxed);
            }
        }
        libc::SO_SNDTIMEO => {
            if let Some(ms) = timeval_ms(val, len) {
                s.snd_timeo_ms.store(ms, Ordering::Relaxed);
                if ms != 0 {
                    debug!("fd {fd}: SO_SNDTIMEO is not applied to SMC-D writes (a full ring blocks)");
                }
            }
        }
        _ => {}
    }
    0
}

/// Interposed `epoll_ctl(2)`: registrations of not-yet-connected TCP
/// sockets are recorded, so the swap in `connect` can move them.
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int {
    // SAFETY: forwarded unchanged.
    let r = unsafe { real::epoll_ctl(ep, op, fd, ev) };
    if r == 0 && table::has_flag(fd, F_CANDIDATE) {
        let _g = LOCK.write();
        let mut e = lock(&EPOLL);
        e.retain(|(x, p, _)| !(*x == fd && *p == ep));
        if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
            // SAFETY: the application's event, valid for ADD and MOD.
            e.push((fd, ep, unsafe { *ev }));
        }
    }
    r
}

// ----- fork and exec --------------------------------------------------------------

/// Interposed `fork(2)`: the child is recorded as a holder of every
/// connection before any thread of the parent can close one.
#[no_mangle]
pub unsafe extern "C" fn fork() -> pid_t {
    let g = LOCK.write();
    let socks = if LIVE.load(Ordering::Relaxed) > 0 { table::all_locked() } else { Vec::new() };
    // SAFETY: plain fork; the lock is held so no table change is half done.
    let pid = unsafe { real::fork() };
    if pid == 0 {
        g.forget();
        LOCK.reset_in_child();
        drop(socks);
        return 0;
    }
    if pid > 0 {
        let mut seen = Vec::new();
        for (_, s) in &socks {
            if !seen.contains(&s.slot) {
                seen.push(s.slot);
                holders::add(s.slot, pid as u32);
            }
        }
        if !seen.is_empty() {
            debug!("fork: child {pid} shares {} SMC-D connection(s)", seen.len());
        }
    }
    drop(g);
    drop(socks);
    pid
}

/// Interposed `vfork(2)`: a full fork, so that the child's exec handling
/// cannot touch the parent's memory.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> pid_t {
    // SAFETY: fork is a valid implementation of vfork.
    unsafe { fork() }
}

/// Before exec: the new image has no table, so it must not inherit a
/// channel. Every real table descriptor is close-on-exec; one the
/// application wanted to pass (no FD_CLOEXEC in its view) is replaced by the
/// hidden TCP socket, and the SMC-D connection is aborted if no other
/// process holds it (the peer sees a reset; the new program sees end of
/// stream once the peer closes). Never does the new program read doorbell
/// bytes as data.
fn before_exec() {
    {
        let g = LOCK.write();
        if let Some(m) = lock(&LISTENERS).as_mut() {
            // The new image does not know these listeners; unregister them
            // so clients do not wait for an answer that never comes.
            m.clear();
        }
        drop(g);
    }
    if LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let g = LOCK.write();
    let all = table::all_locked();
    let mut taken = Vec::new();
    for (fd, s) in &all {
        let keep = !table::app_cloexec(*fd);
        if let Some(t) = table::take_locked(*fd) {
            taken.push(t);
        }
        if keep {
            s.linger0.store(true, Ordering::Relaxed);
            // SAFETY: replaces the channel duplicate with the TCP socket.
            unsafe { real::dup3(s.tcp, *fd, 0) };
            debug!("exec: fd {fd} (SMC-D) cannot follow into the new program; it gets the TCP socket and the connection is reset");
        }
    }
    drop(g);
    drop(all);
    for t in taken {
        table::release(t);
    }
}

/// At exit: every connection this process holds is closed as the kernel
/// closes a socket at exit (orderly, or a reset if unread data remains),
/// unless another process of the family still holds it. Without this the
/// peer would see the channel vanish with no flag and report a reset.
pub(crate) fn close_all() {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let g = LOCK.write();
    let all = table::all_locked();
    let mut taken = Vec::new();
    for (fd, _) in &all {
        if let Some(t) = table::take_locked(*fd) {
            taken.push(t);
        }
    }
    drop(g);
    drop(all);
    for t in taken {
        table::release(t);
    }
}

extern "C" fn at_exit() {
    close_all();
}

/// Runs after the program's own exit handlers (this library is initialised
/// first, so it is finalised last).
#[used]
#[link_section = ".fini_array"]
static AT_EXIT: extern "C" fn() = at_exit;

/// Interposed `_exit(2)`: closes connections as [`close_all`], then exits.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    close_all();
    // SAFETY: forwarded; it does not return.
    unsafe { real::_exit(status) };
    std::process::abort()
}

/// Interposed `_Exit(2)`.
#[allow(non_snake_case)]
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    close_all();
    // SAFETY: forwarded; it does not return.
    unsafe { real::_Exit(status) };
    std::process::abort()
}

/// Interposed `execve(2)`.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    before_exec();
    // SAFETY: forwarded unchanged.
    unsafe { real::execve(path, argv, envp) }
}

/// Interposed `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    before_exec();
    // SAFETY: forwarded unchanged.
    unsafe { real::execv(path, argv) }
}

/// Interposed `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    before_exec();
    // SAFETY: forwarded unchanged.
    unsafe { real::execvp(file, argv) }
}

/// Interposed `execvpe(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    before_exec();
    // SAFETY: forwarded unchanged.
    unsafe { real::execvpe(file, argv, envp) }
}

/// Interposed `fexecve(3)`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    before_exec();
    // SAFETY: forwarded unchanged.
    unsafe { real::fexecve(fd, argv, envp) }
}

// ----- the variadic exec functions ------------------------------------------------
//
// Stable Rust cannot define a C-variadic function. On the ABIs below a
// variadic pointer argument is passed exactly like a fixed one (registers,
// then the caller's stack), so these read up to 64 arguments as fixed
// parameters and stop at the terminating NULL; slots past it are never
// used. They build the vector and go through the wrappers above.

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const MAX_L_ARGS: usize = 64;

/// The NULL-terminated list `a0, a1, ...` as a vector (with its NULL), and
/// the argument after the NULL (execle's envp).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn l_args(list: &[*const c_char; MAX_L_ARGS]) -> Option<(Vec<*const c_char>, *const *const c_char)> {
    let end = list.iter().position(|p| p.is_null())?;
    let mut v = list[..end].to_vec();
    v.push(std::ptr::null());
    let env = list.get(end + 1).map_or(std::ptr::null(), |p| *p as *const *const c_char);
    Some((v, env))
}

/// Interposed `execl(3)` (see the section comment).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn execl(path: *const c_char, a0: *const c_char, a1: *const c_char, a2: *const c_char, a3: *const c_char, a4: *const c_char, a5: *const c_char, a6: *const c_char, a7: *const c_char, a8: *const c_char, a9: *const c_char, a10: *const c_char, a11: *const c_char, a12: *const c_char, a13: *const c_char, a14: *const c_char, a15: *const c_char, a16: *const c_char, a17: *const c_char, a18: *const c_char, a19: *const c_char, a20: *const c_char, a21: *const c_char, a22: *const c_char, a23: *const c_char, a24: *const c_char, a25: *const c_char, a26: *const c_char, a27: *const c_char, a28: *const c_char, a29: *const c_char, a30: *const c_char, a31: *const c_char, a32: *const c_char, a33: *const c_char, a34: *const c_char, a35: *const c_char, a36: *const c_char, a37: *const c_char, a38: *const c_char, a39: *const c_char, a40: *const c_char, a41: *const c_char, a42: *const c_char, a43: *const c_char, a44: *const c_char, a45: *const c_char, a46: *const c_char, a47: *const c_char, a48: *const c_char, a49: *const c_char, a50: *const c_char, a51: *const c_char, a52: *const c_char, a53: *const c_char, a54: *const c_char, a55: *const c_char, a56: *const c_char, a57: *const c_char, a58: *const c_char, a59: *const c_char, a60: *const c_char, a61: *const c_char, a62: *const c_char, a63: *const c_char) -> c_int {
    let Some((v, _)) = l_args(&[a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43, a44, a45, a46, a47, a48, a49, a50, a51, a52, a53, a54, a55, a56, a57, a58, a59, a60, a61, a62, a63]) else { return fail(libc::E2BIG) };
    // SAFETY: a NULL-terminated vector of the caller's strings.
    unsafe { execv(path, v.as_ptr()) }
}

/// Interposed `execlp(3)`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn execlp(file: *const c_char, a0: *const c_char, a1: *const c_char, a2: *const c_char, a3: *const c_char, a4: *const c_char, a5: *const c_char, a6: *const c_char, a7: *const c_char, a8: *const c_char, a9: *const c_char, a10: *const c_char, a11: *const c_char, a12: *const c_char, a13: *const c_char, a14: *const c_char, a15: *const c_char, a16: *const c_char, a17: *const c_char, a18: *const c_char, a19: *const c_char, a20: *const c_char, a21: *const c_char, a22: *const c_char, a23: *const c_char, a24: *const c_char, a25: *const c_char, a26: *const c_char, a27: *const c_char, a28: *const c_char, a29: *const c_char, a30: *const c_char, a31: *const c_char, a32: *const c_char, a33: *const c_char, a34: *const c_char, a35: *const c_char, a36: *const c_char, a37: *const c_char, a38: *const c_char, a39: *const c_char, a40: *const c_char, a41: *const c_char, a42: *const c_char, a43: *const c_char, a44: *const c_char, a45: *const c_char, a46: *const c_char, a47: *const c_char, a48: *const c_char, a49: *const c_char, a50: *const c_char, a51: *const c_char, a52: *const c_char, a53: *const c_char, a54: *const c_char, a55: *const c_char, a56: *const c_char, a57: *const c_char, a58: *const c_char, a59: *const c_char, a60: *const c_char, a61: *const c_char, a62: *const c_char, a63: *const c_char) -> c_int {
    let Some((v, _)) = l_args(&[a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43, a44, a45, a46, a47, a48, a49, a50, a51, a52, a53, a54, a55, a56, a57, a58, a59, a60, a61, a62, a63]) else { return fail(libc::E2BIG) };
    // SAFETY: a NULL-terminated vector of the caller's strings.
    unsafe { execvp(file, v.as_ptr()) }
}

/// Interposed `execle(3)`: the environment follows the NULL.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn execle(path: *const c_char, a0: *const c_char, a1: *const c_char, a2: *const c_char, a3: *const c_char, a4: *const c_char, a5: *const c_char, a6: *const c_char, a7: *const c_char, a8: *const c_char, a9: *const c_char, a10: *const c_char, a11: *const c_char, a12: *const c_char, a13: *const c_char, a14: *const c_char, a15: *const c_char, a16: *const c_char, a17: *const c_char, a18: *const c_char, a19: *const c_char, a20: *const c_char, a21: *const c_char, a22: *const c_char, a23: *const c_char, a24: *const c_char, a25: *const c_char, a26: *const c_char, a27: *const c_char, a28: *const c_char, a29: *const c_char, a30: *const c_char, a31: *const c_char, a32: *const c_char, a33: *const c_char, a34: *const c_char, a35: *const c_char, a36: *const c_char, a37: *const c_char, a38: *const c_char, a39: *const c_char, a40: *const c_char, a41: *const c_char, a42: *const c_char, a43: *const c_char, a44: *const c_char, a45: *const c_char, a46: *const c_char, a47: *const c_char, a48: *const c_char, a49: *const c_char, a50: *const c_char, a51: *const c_char, a52: *const c_char, a53: *const c_char, a54: *const c_char, a55: *const c_char, a56: *const c_char, a57: *const c_char, a58: *const c_char, a59: *const c_char, a60: *const c_char, a61: *const c_char, a62: *const c_char, a63: *const c_char) -> c_int {
    let Some((v, env)) = l_args(&[a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43, a44, a45, a46, a47, a48, a49, a50, a51, a52, a53, a54, a55, a56, a57, a58, a59, a60, a61, a62, a63]) else { return fail(libc::E2BIG) };
    // SAFETY: a NULL-terminated vector of the caller's strings and its envp.
    unsafe { execve(path, v.as_ptr(), env) }
}
