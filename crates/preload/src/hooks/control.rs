//! Everything about an SMC-D descriptor except its data: shutdown, close
//! and the dup family (which must keep the table in step with the kernel's
//! descriptors, and the connection's channel, which is the application's
//! own descriptor, open while the connection needs it), fcntl and ioctl (answered for the connection where they
//! concern it), socket names and options (answered by the hidden TCP
//! socket), and epoll_ctl (recording candidates' registrations for the
//! swap).

use super::state::{dup_shared, forget_fd_locked, forget_fresh_locked, share_records_locked};
use super::{fail, in_table_range, os_err};
use crate::hints::{self, Hint};
use crate::holders;
use crate::real;
use crate::table::{self, Kind, Sock, LOCK, MAX_FD};
use libc::{c_int, c_long, c_uint, c_ulong, c_void, sockaddr, socklen_t};
use smclo::adapter::chan_sys;
use smclo::adapter::errno;
use smclo::debug;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Interposed `shutdown(2)`: SHUT_WR half-closes (the peer reads what was
/// sent, then end of stream); SHUT_RD is local, as in SMC.
#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if super::pending::any() {
        if let Some(r) = super::pending::shutdown(fd, how) {
            return r;
        }
    }
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::shutdown(fd, how) };
    };
    match s.shutdown(how) {
        Ok(()) => 0,
        Err(e) => fail(os_err(&e)),
    }
}

/// Interposed `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !in_table_range(fd) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::close(fd) };
    }
    let hints = hints::hints(fd);
    if !table::known(fd) && forget_hints(fd, hints) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::close(fd) };
    }
    close_slow(fd)
}

/// Whether smclo knows something of number `fd`: a state or hints.
fn seen(fd: RawFd) -> bool {
    in_table_range(fd) && (table::known(fd) || hints::hints(fd) != 0)
}

/// Interposed `syscall(2)`: libuv (node) closes its descriptors with
/// `syscall(SYS_close, fd)`, which for a descriptor smclo knows is
/// [`close`] (an SMC-D connection ends as over TCP, the peer reads end of
/// stream, and the number's state goes), with `close`'s locks; so are
/// `SYS_close_range` ([`close_range`]: smclo's own descriptors stay open)
/// and `SYS_dup2`/`SYS_dup3` onto or from such a descriptor.
/// A `SYS_io_uring_setup` that succeeded tells `hooks::uring` that the
/// process uses io_uring (Rust's io-uring crate sets its rings up this
/// way; a probe that the kernel or a seccomp filter refuses does not
/// count). Every
/// other call is made as libc's `syscall` makes it
/// ([`chan_sys::syscall`]: no lock, async-signal-safe as libc's).
///
/// `syscall` is variadic; on the Linux ABIs we build for (x86_64,
/// aarch64) its integer and pointer arguments travel as fixed ones do, so
/// it is declared with the six a system call can take (a call with fewer
/// leaves registers whose values are passed on unread).
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a: c_long,
    b: c_long,
    c: c_long,
    d: c_long,
    e: c_long,
    f: c_long,
) -> c_long {
    let (fd, other) = (a as c_int, b as c_int);
    // The interposed function of the same system call, with the caller's
    // arguments.
    let r = match n {
        // SAFETY: close(2) of the caller's descriptor.
        libc::SYS_close if seen(fd) => unsafe { close(fd) },
        // SAFETY: close_range(2) with the caller's arguments.
        libc::SYS_close_range => unsafe { close_range(a as c_uint, b as c_uint, c as c_int) },
        // SAFETY: dup3(2) with the caller's arguments.
        libc::SYS_dup3 if seen(fd) || seen(other) => unsafe { dup3(fd, other, c as c_int) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: dup2(2) with the caller's arguments.
        libc::SYS_dup2 if seen(fd) || seen(other) => unsafe { dup2(fd, other) },
        _ => {
            // SAFETY: the caller's arguments, passed on as libc would.
            let r = unsafe { chan_sys::syscall(n, &[a, b, c, d, e, f]) };
            if n == libc::SYS_io_uring_setup && r >= 0 {
                super::uring::set_up();
            }
            return r;
        }
    };
    r as c_long
}

/// Forgets the hints `hints` of `fd`, a number without a state, before
/// its close: a plain TCP socket (one connected to a server without
/// smclo, say) closes without the table's lock. False when the slow close
/// must do it: the hints changed meanwhile, or an epoll shadow may hold
/// the descriptor.
fn forget_hints(fd: RawFd, hints: u8) -> bool {
    hints == 0 || table::epoll_count() == 0 && hints::forget_hints_if(fd, hints)
}

/// Interposed `close_range(2)`: the program's descriptors in the range
/// close as with [`close`] (an SMC-D one ends its share of the
/// connection; with `CLOSE_RANGE_CLOEXEC` an SMC-D one gets it in the
/// program's view, any other the kernel's flag), smclo's own (hidden TCP sockets, channels at hidden
/// numbers, DMB memfds) stay open, as the kernel's own files behind a
/// socket would. Python's `subprocess` closes every descriptor but those
/// it passes this way before exec; the connections it passes need them.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if first > last {
        // SAFETY: forwarded unchanged (the kernel answers EINVAL).
        return unsafe { sys_close_range(first, last, flags) };
    }
    let mut from = first;
    let top = last.min(MAX_FD as c_uint - 1);
    let mut fd = first;
    while fd <= top {
        let n = fd as RawFd;
        let known = seen(n);
        let ours = matches!(table::kind(n), Kind::Internal | Kind::Closing)
            || smclo::adapter::fdnum::is_ours(n);
        if known || ours {
            if from < fd {
                // SAFETY: the program's own descriptors, as it asked.
                let r = unsafe { sys_close_range(from, fd - 1, flags) };
                if r != 0 {
                    return r;
                }
            }
            if known && !ours {
                if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
                    // SAFETY: as close(2), which the program asked for.
                    unsafe { close(n) };
                } else if table::kind(n) == Kind::Smc {
                    super::state::set_app_cloexec(n, true);
                } else {
                    // Any other known number is the program's socket itself.
                    // SAFETY: the program's own descriptor, as it asked.
                    let r = unsafe { sys_close_range(fd, fd, flags) };
                    if r != 0 {
                        return r;
                    }
                }
            }
            from = fd + 1;
        }
        fd += 1;
    }
    if from > last {
        return 0;
    }
    // SAFETY: the rest of the program's range.
    unsafe { sys_close_range(from, last, flags) }
}

/// The close_range(2) system call itself: libc's wrapper (glibc 2.34)
/// may be missing where the call comes through [`syscall`].
///
/// # Safety
/// As close_range(2): closes descriptors the caller owns.
unsafe fn sys_close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    let args = [first as c_long, last as c_long, flags as c_long];
    // SAFETY: integer arguments; the caller owns the range.
    unsafe { chan_sys::syscall(libc::SYS_close_range, &args) as c_int }
}

/// Interposed `closefrom(3)`: [`close_range`] up to the last number.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: forwarded to our close_range.
    unsafe { close_range(low.max(0) as c_uint, c_uint::MAX, 0) };
}

#[cold]
fn close_slow(fd: RawFd) -> c_int {
    // A connection may have just closed an internal number that the
    // application got back from the kernel: wait until it is unmarked.
    table::settle(fd);
    let g = LOCK.write();
    if table::kind(fd) == Kind::Internal {
        drop(g);
        debug!("close({fd}) ignored: the descriptor belongs to an SMC-D connection");
        return 0;
    }
    let mut forgotten = forget_fd_locked(fd);
    let s = forgotten.sock.take();
    let r = match &s {
        Some(s) if s.conn.fd() == fd => {
            keep_channel_locked(s, fd);
            0
        }
        // SAFETY: closing the application's descriptor, as it asked.
        _ => unsafe { real::close(fd) },
    };
    let e = errno::get();
    drop(g);
    drop(forgotten);
    if let Some(s) = s {
        super::swap::release(s);
    }
    errno::set(e);
    r
}

/// The application closed `fd`, the number of `s`'s channel itself. It is
/// `Internal` until closed: its connection's calls may be using it. Where
/// other descriptors of the application (`dup`s) still name the
/// connection, the channel moves to a high duplicate, counted against the
/// budget, and `fd` is closed as soon as no call of the connection uses it
/// ([`Conn::retire_number`](smclo::adapter::conn::Conn::retire_number)):
/// the number is free for the program's next `open` as over TCP. The last
/// descriptor's stays until the connection goes (Sock's drop closes it).
/// The other processes of the fork family find the channel at its new
/// number ([`holders::renumber`]), listed before the old one goes.
fn keep_channel_locked(s: &Sock, fd: RawFd) {
    super::state::internal_locked(fd);
    if s.fds.load(Ordering::Acquire) <= 1 {
        return;
    }
    let why = match smclo::adapter::fdnum::dup_high(fd) {
        Err(e) => e.to_string(),
        Ok(high) => {
            let n = std::os::fd::AsRawFd::as_raw_fd(&high);
            super::state::internal_locked(n);
            holders::renumber(s.slot, fd, n);
            match s.conn.retire_number(high) {
                Ok(()) => {
                    debug!(
                        "fd {fd}: closed; its SMC-D connection goes on at its other descriptors"
                    );
                    return;
                }
                Err(high) => {
                    holders::renumber(s.slot, n, fd);
                    drop(table::replace_locked(n, table::FdState::Unknown));
                    // Not through the interposed close, under the lock.
                    smclo::adapter::fdnum::close_own(high);
                    "a number given up earlier is still in use".to_string()
                }
            }
        }
    };
    debug!("fd {fd}: closed, kept open for its SMC-D connection ({why})");
    s.conn.count_channel(true);
}

fn dup_into(s: Option<&Arc<Sock>>, old: RawFd, new: RawFd, cloexec: bool) {
    if let Some(s) = s {
        if in_table_range(new) {
            super::state::install_locked(new, s, cloexec);
        }
    } else {
        share_records_locked(old, new);
    }
}

/// Before `fd` is duplicated: a blocking connect another thread is in
/// decides first, and then a handshake left pending (by that connect, or
/// earlier), so that the copy names what the connection became.
fn decided_for_dup(fd: RawFd) {
    super::state::duplicated(fd);
    super::pending::settle(fd);
}

/// Interposed `dup(2)`: the new descriptor names the same connection.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    decided_for_dup(fd);
    let s = table::get(fd);
    if s.is_none() && !dup_shared(fd) {
        // SAFETY: forwarded unchanged.
        return super::limits::app_fd(unsafe { real::dup(fd) });
    }
    // SAFETY: F_DUPFD(_CLOEXEC) from 0 is dup(2) (plus close-on-exec for a
    // connection, whose application view is kept in the table).
    unsafe { fcntl_dup(fd, s, libc::F_DUPFD, 0, false) }
}

unsafe fn fcntl_dup(
    fd: RawFd,
    s: Option<Arc<Sock>>,
    cmd: c_int,
    min: c_ulong,
    cloexec: bool,
) -> c_int {
    let g = LOCK.write();
    if s.as_ref().is_some_and(|s| !table::names_locked(fd, s)) {
        drop(g);
        return fail(libc::EBADF); // closed by another thread meanwhile
    }
    let real_cmd = if s.is_some() {
        libc::F_DUPFD_CLOEXEC
    } else {
        cmd
    };
    // SAFETY: duplicating the application's descriptor.
    let n = super::limits::app_fd(unsafe { real::fcntl(fd, real_cmd, min) });
    let e = errno::get();
    let mut forgotten = None;
    if n >= 0 {
        if s.is_some() && !in_table_range(n) {
            // A duplicate the table cannot name would read doorbells.
            // SAFETY: our fresh duplicate.
            unsafe { real::close(n) };
            drop(g);
            debug!("dup of fd {fd} above the table: EMFILE");
            return fail(libc::EMFILE);
        }
        forgotten = Some(forget_fresh_locked(n));
        dup_into(s.as_ref(), fd, n, cloexec);
    }
    drop(g);
    release_forgotten(forgotten);
    errno::set(e);
    n
}

/// What a number's state was, forgotten under the table's lock, dropped
/// after it: its connection's share of a descriptor ends.
fn release_forgotten(f: Option<super::state::Forgotten>) {
    let Some(mut f) = f else { return };
    let s = f.sock.take();
    drop(f);
    if let Some(s) = s {
        super::swap::release(s);
    }
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
    if super::limits::beyond_limit(new) {
        return fail(libc::EBADF); // as the kernel for a number past the limit
    }
    if old != new {
        decided_for_dup(old);
    }
    let s = table::get(old);
    let interesting = s.is_some() || dup_shared(old) || seen(new);
    if !interesting || old == new {
        // SAFETY: forwarded unchanged.
        return unsafe {
            if is_dup2 {
                real::dup2(old, new)
            } else {
                real::dup3(old, new, flags)
            }
        };
    }
    if s.is_some() && !in_table_range(new) {
        debug!("dup2 of an SMC-D connection onto fd {new} (above the table) refused");
        return fail(libc::EBADF);
    }
    table::settle(new); // as in close
    let g = LOCK.write();
    if table::kind(new) == Kind::Internal {
        drop(g);
        debug!("dup2 onto fd {new} refused: it belongs to an SMC-D connection");
        return fail(libc::EBUSY);
    }
    if s.as_ref().is_some_and(|s| !table::names_locked(old, s)) {
        drop(g);
        return fail(libc::EBADF); // closed by another thread meanwhile
    }
    // A connection's channel at `new` moves away before `new` is replaced.
    table::with_entry_locked(new, |p| {
        if p.conn.fd() == new {
            super::swap::move_channel_away(p, new);
        }
    });
    let real_flags = if s.is_some() { libc::O_CLOEXEC } else { flags };
    // SAFETY: the application's descriptors.
    let r = unsafe { real::dup3(old, new, real_flags) };
    let e = errno::get();
    let mut prev = None;
    if r >= 0 {
        prev = Some(forget_fd_locked(new));
        dup_into(s.as_ref(), old, new, flags & libc::O_CLOEXEC != 0);
    }
    drop(g);
    release_forgotten(prev);
    errno::set(e);
    r
}

unsafe fn fcntl_impl(
    fd: c_int,
    cmd: c_int,
    arg: c_ulong,
    f: unsafe fn(c_int, c_int, c_ulong) -> c_int,
) -> c_int {
    if matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) {
        if super::limits::beyond_limit(arg.min(c_int::MAX as c_ulong) as c_int) {
            return fail(libc::EINVAL); // as the kernel for a minimum past the limit
        }
        decided_for_dup(fd);
    }
    let s = table::get(fd);
    if s.is_none() {
        if matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) && dup_shared(fd) {
            // SAFETY: forwarded.
            return unsafe { fcntl_dup(fd, None, cmd, arg, cmd == libc::F_DUPFD_CLOEXEC) };
        }
        // SAFETY: forwarded unchanged.
        let r = unsafe { f(fd, cmd, arg) };
        if matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) {
            return super::limits::app_fd(r);
        }
        return r;
    }
    match cmd {
        // SAFETY: forwarded.
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => unsafe {
            fcntl_dup(fd, s, cmd, arg, cmd == libc::F_DUPFD_CLOEXEC)
        },
        libc::F_GETFD => {
            if table::app_cloexec(fd) {
                libc::FD_CLOEXEC
            } else {
                0
            }
        }
        libc::F_SETFD => {
            super::state::set_app_cloexec(fd, arg as c_int & libc::FD_CLOEXEC != 0);
            0
        }
        libc::F_SETFL => {
            // SAFETY: the flags live in the shared open file; set them there.
            let r = unsafe { f(fd, cmd, arg) };
            if r == 0 {
                let s = s.expect("table entry");
                s.conn.nonblocking_set(arg as c_int & libc::O_NONBLOCK != 0);
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

/// `SIOCOUTQ` (= `TIOCOUTQ`), `SIOCOUTQNSD` and `SIOCATMARK` from
/// <linux/sockios.h>.
const SIOCOUTQ: libc::Ioctl = 0x5411;
const SIOCOUTQNSD: libc::Ioctl = 0x894B;
const SIOCATMARK: libc::Ioctl = 0x8905;

/// Interposed `ioctl(2)`: FIONREAD counts ring bytes, FIONBIO sets the
/// mode, SIOCOUTQ and SIOCOUTQNSD count the bytes corking holds.
/// The request is the C library's type (`unsigned long` in glibc, `int`
/// in musl, whose callers leave the register's upper half undefined).
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::Ioctl, arg: c_ulong) -> c_int {
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
            // SAFETY: the flag lives in the channel's open file; set it
            // there (the kernel reads the int pointer).
            let r = unsafe { real::ioctl(fd, req, arg) };
            if r == 0 {
                // SAFETY: FIONBIO's argument is an int pointer, which the
                // kernel has just read.
                s.conn
                    .nonblocking_set(unsafe { *(arg as *const c_int) } != 0);
            }
            r
        }
        // The program's view of FD_CLOEXEC, as F_SETFD (the real
        // descriptor keeps it; exec passes what the view says).
        libc::FIOCLEX | libc::FIONCLEX => {
            super::state::set_app_cloexec(fd, req == libc::FIOCLEX);
            0
        }
        SIOCOUTQ | SIOCOUTQNSD => {
            let n = s.conn.unsent_len().min(c_int::MAX as usize) as c_int;
            // SAFETY: both take an int pointer.
            unsafe { *(arg as *mut c_int) = n };
            0
        }
        SIOCATMARK => {
            // SAFETY: an int pointer; a connection carries no urgent byte.
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
/// SO_ERROR is the connection's (a reset's error, once: [`Conn::take_error`]).
///
/// [`Conn::take_error`]: smclo::adapter::conn::Conn::take_error
#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    // SO_ERROR after a non-blocking connect: is it done?
    super::pending::look(fd);
    let Some(s) = table::get(fd) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real::getsockopt(fd, level, name, val, len) };
    };
    if level == libc::IPPROTO_TCP && name == libc::TCP_CORK && !val.is_null() && !len.is_null() {
        // Corking is the connection's (see setsockopt), not the hidden socket's.
        return put_int(val, len, s.conn.corked() as c_int);
    }
    if level == libc::SOL_SOCKET && name == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        // SAFETY: the application's buffer of *len bytes.
        unsafe {
            if (*len as usize) >= std::mem::size_of::<c_int>() {
                *(val as *mut c_int) = s.conn.take_error().unwrap_or(0);
                *len = std::mem::size_of::<c_int>() as socklen_t;
            }
        }
        return 0;
    }
    if smclo::adapter::tcp_syn::is_mark_option(level, name) {
        s.syn_mark.put_back(s.tcp);
    }
    // SAFETY: forwarded to the hidden socket.
    unsafe { real::getsockopt(s.tcp, level, name, val, len) }
}

/// Answers an int option into the application's buffer, as the kernel does
/// (a shorter buffer gets the low bytes).
fn put_int(val: *mut c_void, len: *mut socklen_t, v: c_int) -> c_int {
    // SAFETY: the application's buffer of *len bytes and its length word
    // (both non-null, checked by the caller).
    unsafe {
        let n = (*len as usize).min(std::mem::size_of::<c_int>());
        std::ptr::copy_nonoverlapping((&v as *const c_int).cast::<u8>(), val.cast::<u8>(), n);
        *len = n as socklen_t;
    }
    0
}

/// An int option's value, or EINVAL as the kernel answers a short one.
fn get_int(val: *const c_void, len: socklen_t) -> Result<c_int, c_int> {
    if val.is_null() {
        return Err(libc::EFAULT);
    }
    if (len as usize) < std::mem::size_of::<c_int>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: checked length; read_unaligned for application buffers.
    Ok(unsafe { std::ptr::read_unaligned(val as *const c_int) })
}

/// `TCP_CORK` on an SMC-D connection: kept by the connection, which holds
/// writes while it is on (the hidden TCP socket carries no data, so it is
/// not told: one system call less per response for nginx's `tcp_nopush`).
fn set_cork(s: &Sock, val: *const c_void, len: socklen_t) -> c_int {
    match get_int(val, len) {
        Ok(v) => match s.conn.set_cork(v != 0) {
            Ok(()) => 0,
            Err(e) => super::fail::<c_int>(super::os_err(&e)),
        },
        Err(e) => super::fail::<c_int>(e),
    }
}

/// The options a connection refuses (`EOPNOTSUPP`), as the kernel's SMC
/// does, since they would act on the hidden socket, which carries none of
/// the connection's bytes: an upper layer protocol (`TCP_ULP`: kernel TLS,
/// with which the program would write plaintext where its peer reads TLS
/// records; refused, OpenSSL keeps TLS in user space), and a peek offset
/// (`SO_PEEK_OFF`, which the ring's peeks would ignore).
fn refused_option(level: c_int, name: c_int) -> Option<&'static str> {
    match (level, name) {
        (libc::IPPROTO_TCP, libc::TCP_ULP) => Some("TCP_ULP"),
        (libc::SOL_SOCKET, libc::SO_PEEK_OFF) => Some("SO_PEEK_OFF"),
        _ => None,
    }
}

/// Interposed `setsockopt(2)`: options go to the hidden TCP socket; the
/// ones that change the data path (SO_LINGER 0, SO_RCVTIMEO, SO_SNDTIMEO)
/// are also applied to the connection, and the two that would act on the
/// hidden socket alone ([`refused_option`]) fail with `EOPNOTSUPP`.
#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let refused = refused_option(level, name);
    let Some(s) = table::get(fd) else {
        if let Some(what) =
            refused.filter(|_| matches!(table::kind(fd), table::Kind::Pending { .. }))
        {
            // Its decision may still be SMC-D, where the option would not
            // apply.
            return super::unsupported(fd, format_args!("setsockopt({what}) before its decision"));
        }
        if smclo::adapter::tcp_syn::is_mark_option(level, name) {
            hints::hint(fd, Hint::IpOpts);
        }
        if timeout_option(level, name) {
            hints::hint(fd, Hint::Timeo);
        }
        if level == libc::IPPROTO_TCP && name == libc::TCP_INQ {
            hints::hint(fd, Hint::Inq);
        }
        // SAFETY: forwarded unchanged.
        return unsafe { real::setsockopt(fd, level, name, val, len) };
    };
    if level == libc::IPPROTO_TCP && name == libc::TCP_CORK {
        return set_cork(&s, val, len);
    }
    if let Some(what) = refused {
        return super::unsupported(fd, format_args!("setsockopt({what})"));
    }
    if smclo::adapter::tcp_syn::is_mark_option(level, name) {
        // The other option of the pair must not keep the mark either.
        s.syn_mark.put_back(s.tcp);
    }
    // SAFETY: forwarded to the hidden socket (which validates the arguments).
    let r = unsafe { real::setsockopt(s.tcp, level, name, val, len) };
    if r == 0 && level == libc::IPPROTO_TCP && name == libc::TCP_INQ {
        s.inq
            .store(get_int(val, len).is_ok_and(|v| v != 0), Ordering::Relaxed);
        return 0;
    }
    if r == 0 && level == libc::IPPROTO_TCP && name == libc::TCP_NODELAY {
        // As TCP pushes what it held when TCP_NODELAY is set.
        if get_int(val, len).is_ok_and(|v| v != 0) {
            if let Err(e) = s.conn.flush() {
                return super::fail::<c_int>(super::os_err(&e));
            }
        }
        return 0;
    }
    if r != 0 || level != libc::SOL_SOCKET {
        return r;
    }
    match name {
        libc::SO_LINGER
            if !val.is_null() && (len as usize) >= std::mem::size_of::<libc::linger>() =>
        {
            // SAFETY: checked length.
            let l = unsafe { std::ptr::read_unaligned(val as *const libc::linger) };
            s.linger0
                .store(l.l_onoff != 0 && l.l_linger == 0, Ordering::Relaxed);
        }
        libc::SO_RCVTIMEO => s.conn.set_read_timeout(super::swap::timeval_dur(val, len)),
        libc::SO_SNDTIMEO => s.conn.set_write_timeout(super::swap::timeval_dur(val, len)),
        _ => {}
    }
    0
}

/// The 64-bit `timeval` spellings of the timeout options
/// (<asm-generic/socket.h>; the libc crate names them for glibc only).
const SO_RCVTIMEO_NEW: c_int = 66;
const SO_SNDTIMEO_NEW: c_int = 67;

/// Whether the option is a socket timeout, in either `timeval` layout
/// (see [`Hint::Timeo`]).
fn timeout_option(level: c_int, name: c_int) -> bool {
    level == libc::SOL_SOCKET
        && matches!(
            name,
            libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | SO_RCVTIMEO_NEW | SO_SNDTIMEO_NEW
        )
}

/// Interposed `epoll_ctl(2)`: registrations of SMC-D connections join the
/// set's shadow (the fast path, `hooks::epoll`); those of not-yet-connected
/// TCP sockets are recorded, so the swap in `connect` can move them.
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    ep: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: the application's event, valid when not null.
    let event = (!ev.is_null()).then(|| unsafe { *ev });
    if let Some(s) = table::get(fd) {
        return super::epoll::ctl(ep, op, fd, event, &s);
    }
    if op == libc::EPOLL_CTL_ADD {
        super::setup::epoll_add(fd);
    }
    // A candidate's registration is recorded in the same step as the
    // kernel's, which gets no writability while its connect is pending.
    // `Smc`: a swap made `fd` the channel since the look above.
    let recorded = matches!(
        table::kind(fd),
        Kind::Candidate | Kind::Pending { .. } | Kind::Smc
    );
    let g = recorded.then(|| LOCK.write());
    if g.is_some() {
        // The swap may have made `fd` the channel while this call waited
        // for the lock: the registration is then the connection's.
        if let Some(s) = table::get_locked(fd) {
            drop(g);
            return super::epoll::ctl(ep, op, fd, event, &s);
        }
    }
    let mut kev = event.map(|e| super::state::kernel_event(fd, e));
    let kptr = match (&mut kev, g.is_some()) {
        (Some(k), true) => k as *mut libc::epoll_event,
        _ => ev,
    };
    // SAFETY: the application's arguments, or its event without EPOLLOUT.
    let r = unsafe { real::epoll_ctl(ep, op, fd, kptr) };
    if r != 0 {
        return r;
    }
    if table::kind(fd) == Kind::Epoll {
        super::epoll::nest(fd);
    }
    if g.is_some() {
        let kept = event.filter(|_| op != libc::EPOLL_CTL_DEL);
        super::state::record_epoll_locked(fd, ep, kept);
    }
    r
}
