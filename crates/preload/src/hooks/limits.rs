//! `RLIMIT_NOFILE` as the program sees it. Where the hard limit is above
//! the soft one, the process runs with a raised soft limit and smclo keeps
//! its own descriptors at and above the program's (`smclo::adapter::fdnum`). Here
//! the program sees and sets its own limit (`getrlimit`, `setrlimit`,
//! `prlimit` of itself, `sysconf(_SC_OPEN_MAX)`, `getdtablesize`), never
//! gets a descriptor number at or above it (`EMFILE` instead, as from the
//! kernel), and a program it starts (exec and `posix_spawn` in their
//! hooks, `system` and `popen` here) inherits its limit, not the raised
//! one.

use super::{disabled, fail, os_err};
use crate::real;
use libc::{c_char, c_int, c_long, c_uint, c_void, pid_t, rlimit};
use smclo::adapter::fdnum::{self, ForExec};
use std::sync::atomic::{AtomicI32, Ordering};

/// Whether `pid` names this process for `prlimit`.
fn is_self(pid: pid_t) -> bool {
    // SAFETY: getpid has no preconditions.
    pid == 0 || pid == unsafe { libc::getpid() }
}

/// The program's view of `RLIMIT_NOFILE` into `out`.
///
/// # Safety
/// `out` is null or points to a writable `rlimit`.
unsafe fn get_nofile(out: *mut rlimit) -> c_int {
    if out.is_null() {
        return fail(libc::EFAULT);
    }
    match fdnum::app_nofile() {
        Ok(rl) => {
            // SAFETY: a non-null `out` is writable (the caller's contract).
            unsafe { *out = rl };
            0
        }
        Err(e) => fail(os_err(&e)),
    }
}

/// The program sets its `RLIMIT_NOFILE` to `*new`.
///
/// # Safety
/// `new` is null or points to a readable `rlimit`.
unsafe fn set_nofile(new: *const rlimit) -> c_int {
    if new.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: a non-null `new` is readable (the caller's contract).
    let rl = unsafe { *new };
    match fdnum::set_app_nofile(rl.rlim_cur, rl.rlim_max) {
        Ok(()) => 0,
        Err(e) => fail(os_err(&e)),
    }
}

/// Whether the call is about this process's `RLIMIT_NOFILE`, which the
/// program sees as its own.
fn ours(resource: c_int) -> bool {
    resource == libc::RLIMIT_NOFILE as c_int && !disabled()
}

/// Interposed `getrlimit(2)`.
#[no_mangle]
pub unsafe extern "C" fn getrlimit(resource: c_int, rl: *mut rlimit) -> c_int {
    if !ours(resource) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::getrlimit(resource, rl) };
    }
    // SAFETY: the caller's pointer.
    unsafe { get_nofile(rl) }
}

/// Interposed `getrlimit64` (the same structure on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn getrlimit64(resource: c_int, rl: *mut rlimit) -> c_int {
    // SAFETY: as getrlimit.
    unsafe { getrlimit(resource, rl) }
}

/// Interposed `setrlimit(2)`.
#[no_mangle]
pub unsafe extern "C" fn setrlimit(resource: c_int, rl: *const rlimit) -> c_int {
    if !ours(resource) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::setrlimit(resource, rl) };
    }
    // SAFETY: the caller's pointer.
    unsafe { set_nofile(rl) }
}

/// Interposed `setrlimit64`.
#[no_mangle]
pub unsafe extern "C" fn setrlimit64(resource: c_int, rl: *const rlimit) -> c_int {
    // SAFETY: as setrlimit.
    unsafe { setrlimit(resource, rl) }
}

/// `prlimit` of this process's `RLIMIT_NOFILE`: the old value is the
/// program's view before the change, written only if the change succeeds,
/// as the kernel does.
///
/// # Safety
/// `new` and `old` are null or point to an `rlimit`.
unsafe fn prlimit_nofile(new: *const rlimit, old: *mut rlimit) -> c_int {
    let before = match fdnum::app_nofile() {
        Ok(rl) => rl,
        Err(e) => return fail(os_err(&e)),
    };
    // SAFETY: the caller's pointer.
    if !new.is_null() && unsafe { set_nofile(new) } != 0 {
        return -1;
    }
    if !old.is_null() {
        // SAFETY: a non-null `old` is writable (the caller's contract).
        unsafe { *old = before };
    }
    0
}

/// Interposed `prlimit(2)`: of another process, the kernel's values.
#[no_mangle]
pub unsafe extern "C" fn prlimit(
    pid: pid_t,
    resource: c_int,
    new: *const rlimit,
    old: *mut rlimit,
) -> c_int {
    if !ours(resource) || !is_self(pid) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::prlimit(pid, resource, new, old) };
    }
    // SAFETY: the caller's pointers.
    unsafe { prlimit_nofile(new, old) }
}

/// Interposed `prlimit64`.
#[no_mangle]
pub unsafe extern "C" fn prlimit64(
    pid: pid_t,
    resource: c_int,
    new: *const rlimit,
    old: *mut rlimit,
) -> c_int {
    if !ours(resource) || !is_self(pid) {
        // SAFETY: forwarded unchanged.
        return unsafe { real::prlimit64(pid, resource, new, old) };
    }
    // SAFETY: the caller's pointers.
    unsafe { prlimit_nofile(new, old) }
}

/// Interposed `sysconf(3)`: `_SC_OPEN_MAX` is the program's soft limit.
#[no_mangle]
pub unsafe extern "C" fn sysconf(name: c_int) -> c_long {
    if name == libc::_SC_OPEN_MAX && !disabled() {
        if let Some(v) = fdnum::app_limit() {
            return v as c_long;
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::sysconf(name) }
}

/// Interposed `getdtablesize(3)`: the program's soft limit.
#[no_mangle]
pub unsafe extern "C" fn getdtablesize() -> c_int {
    match fdnum::app_limit() {
        Some(v) if !disabled() => v.min(c_int::MAX as u64) as c_int,
        // SAFETY: no arguments.
        _ => unsafe { real::getdtablesize() },
    }
}

// ----- descriptors the program gets -----------------------------------------

/// The highest descriptor number [`app_fd`] last passed: an `accept` asks
/// the kernel for its lowest free number first only near the limit.
static LAST_FD: AtomicI32 = AtomicI32::new(0);

/// How close to the program's limit a descriptor [`app_fd`] passed must be
/// for `accept` to look before it takes a connection off the queue.
const NEAR_LIMIT: i32 = 256;

/// Whether number `fd` is one the program may not have: at or above its
/// own soft limit while smclo uses the room above it, and not one of
/// smclo's own (`fdnum::internal`).
pub(crate) fn beyond_limit(fd: c_int) -> bool {
    fdnum::app_limit().is_some_and(|v| fd as u64 >= v) && !fdnum::in_internal()
}

/// A descriptor the kernel just gave the program: one at or above its own
/// soft limit is closed and the call fails with `EMFILE`, as the kernel
/// fails it when the program's range is full.
pub(crate) fn app_fd(fd: c_int) -> c_int {
    if fd < 0 {
        return fd;
    }
    if !beyond_limit(fd) {
        LAST_FD.store(fd, Ordering::Relaxed);
        return fd;
    }
    // SAFETY: the fresh descriptor the caller was about to return.
    unsafe { real::close(fd) };
    fail(libc::EMFILE)
}

/// Two descriptors (`pipe`, `socketpair`) after a call that returned `r`:
/// both close if either is beyond the program's limit.
///
/// # Safety
/// After a successful call `fds` points to the two descriptors.
unsafe fn app_fd_pair(r: c_int, fds: *const c_int) -> c_int {
    if r != 0 {
        return r;
    }
    // SAFETY: the call filled both (the caller's contract).
    let (a, b) = unsafe { (*fds, *fds.add(1)) };
    if !beyond_limit(a) && !beyond_limit(b) {
        LAST_FD.store(a.max(b), Ordering::Relaxed);
        return 0;
    }
    // SAFETY: the fresh descriptors the caller was about to return.
    unsafe {
        real::close(a);
        real::close(b);
    }
    fail(libc::EMFILE)
}

/// Whether `accept` on `listener` may take a connection off its queue: the
/// kernel fails with `EMFILE` before it dequeues one when the caller's
/// range is full, so near the program's limit the lowest free number is
/// looked at first (a duplicate of the listener, closed at once).
pub(crate) fn accept_has_room(listener: c_int) -> bool {
    let Some(v) = fdnum::app_limit() else {
        return true;
    };
    if fdnum::in_internal()
        || (LAST_FD.load(Ordering::Relaxed) as i64) < v as i64 - NEAR_LIMIT as i64
    {
        return true;
    }
    // SAFETY: duplicating the caller's listener, closed below.
    let n = unsafe { real::fcntl(listener, libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return true; // the accept reports the error itself
    }
    // SAFETY: the duplicate made above.
    unsafe { real::close(n) };
    (n as u64) < v
}

/// Whether `path` names this process's limits file in /proc, which shows
/// the raised soft limit, while the program's is another.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn own_limits_file(path: *const c_char, flags: c_int) -> bool {
    if path.is_null()
        || flags & libc::O_ACCMODE != libc::O_RDONLY
        || fdnum::app_limit().is_none()
        || fdnum::in_internal()
    {
        return false;
    }
    // SAFETY: a NUL-terminated string (the caller's contract).
    let p = unsafe { std::ffi::CStr::from_ptr(path) }.to_bytes();
    let Some(who) = p
        .strip_prefix(b"/proc/")
        .and_then(|r| r.strip_suffix(b"/limits"))
    else {
        return false;
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() }.to_string();
    who == b"self" || who == b"thread-self" || who == pid.as_bytes()
}

/// The limits file's text with the program's soft `RLIMIT_NOFILE` in the
/// "Max open files" line, column widths kept.
fn program_limits(text: &str, soft: u64) -> String {
    const NAME: &str = "Max open files";
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let Some(rest) = line.strip_prefix(NAME) else {
            out.push_str(line);
            continue;
        };
        let start = rest.len() - rest.trim_start().len();
        let field = &rest[start..];
        let end = field.find(' ').unwrap_or(field.len());
        let width = field[end..].len() - field[end..].trim_start().len() + end;
        out.push_str(NAME);
        out.push_str(&rest[..start]);
        out.push_str(&format!("{soft:<width$}"));
        out.push_str(&field[width.min(field.len())..]);
    }
    out
}

/// A memfd holding this process's limits file as the program sees it
/// ([`program_limits`]), read from its start; `None` if it cannot be made
/// (the real file is opened then).
fn limits_memfd(flags: c_int) -> Option<c_int> {
    let soft = fdnum::app_limit()?;
    let text = fdnum::internal(|| std::fs::read_to_string("/proc/self/limits")).ok()?;
    let body = program_limits(&text, soft);
    let mfd_flags = if flags & libc::O_CLOEXEC != 0 {
        libc::MFD_CLOEXEC
    } else {
        0
    };
    // SAFETY: a NUL-terminated literal name.
    let fd = unsafe { libc::memfd_create(c"limits".as_ptr(), mfd_flags) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours; writes `body`, then rewinds.
    let ok = unsafe {
        libc::write(fd, body.as_ptr().cast(), body.len()) == body.len() as isize
            && libc::lseek(fd, 0, libc::SEEK_SET) == 0
    };
    if !ok {
        // SAFETY: our descriptor.
        unsafe { real::close(fd) };
        return None;
    }
    Some(fd)
}

/// An `open` of `path`: the program's view of its own limits file, or the
/// real call `open`, its result limited as [`app_fd`].
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn open_with(path: *const c_char, flags: c_int, open: impl FnOnce() -> c_int) -> c_int {
    // SAFETY: the caller's contract.
    if unsafe { own_limits_file(path, flags) } {
        if let Some(fd) = limits_memfd(flags) {
            return app_fd(fd);
        }
    }
    app_fd(open())
}

/// Interposed `open(2)` (the mode is read only with `O_CREAT` or
/// `O_TMPFILE`; see `real` for variadic arguments).
#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { open_with(path, flags, || real::open(path, flags, mode)) }
}

/// Interposed `open64`.
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { open_with(path, flags, || real::open64(path, flags, mode)) }
}

/// Interposed `openat(2)` (an absolute path names the limits file).
#[no_mangle]
pub unsafe extern "C" fn openat(
    dir: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { open_with(path, flags, || real::openat(dir, path, flags, mode)) }
}

/// Interposed `openat64`.
#[no_mangle]
pub unsafe extern "C" fn openat64(
    dir: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: forwarded unchanged.
    unsafe { open_with(path, flags, || real::openat64(dir, path, flags, mode)) }
}

/// Interposed `creat(2)`.
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: c_uint) -> c_int {
    // SAFETY: forwarded unchanged.
    app_fd(unsafe { real::creat(path, mode) })
}

/// Interposed `pipe(2)`.
#[no_mangle]
pub unsafe extern "C" fn pipe(fds: *mut c_int) -> c_int {
    // SAFETY: forwarded unchanged; filled on success.
    unsafe { app_fd_pair(real::pipe(fds), fds) }
}

/// Interposed `pipe2(2)`.
#[no_mangle]
pub unsafe extern "C" fn pipe2(fds: *mut c_int, flags: c_int) -> c_int {
    // SAFETY: forwarded unchanged; filled on success.
    unsafe { app_fd_pair(real::pipe2(fds, flags), fds) }
}

/// Interposed `socketpair(2)`.
#[no_mangle]
pub unsafe extern "C" fn socketpair(
    domain: c_int,
    ty: c_int,
    proto: c_int,
    fds: *mut c_int,
) -> c_int {
    // SAFETY: forwarded unchanged; filled on success.
    unsafe { app_fd_pair(real::socketpair(domain, ty, proto, fds), fds) }
}

/// Interposed `epoll_create(2)`.
#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarded unchanged.
    app_fd(unsafe { real::epoll_create(size) })
}

/// Interposed `epoll_create1(2)`.
#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwarded unchanged.
    app_fd(unsafe { real::epoll_create1(flags) })
}

// ----- programs started without exec hooks --------------------------------------
//
// `posix_spawn` and `posix_spawnp` lower the limit in `hooks::variant`.

/// Interposed `system(3)`: the process runs with the program's limit until
/// the command ends (glibc starts it without the exec hooks).
#[no_mangle]
pub unsafe extern "C" fn system(cmd: *const c_char) -> c_int {
    let _limit = ForExec::begin();
    // SAFETY: forwarded unchanged.
    unsafe { real::system(cmd) }
}

/// Interposed `popen(3)`.
#[no_mangle]
pub unsafe extern "C" fn popen(cmd: *const c_char, mode: *const c_char) -> *mut c_void {
    let limit = ForExec::begin();
    // SAFETY: forwarded unchanged.
    let f = unsafe { real::popen(cmd, mode) };
    drop(limit);
    f
}

#[cfg(test)]
mod tests {
    use super::program_limits;

    #[test]
    fn the_limits_file_shows_the_programs_soft_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max open files            4160                 20000                files     \n\
                    Max locked memory         8388608              8388608              bytes     \n";
        let want = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max open files            1024                 20000                files     \n\
                    Max locked memory         8388608              8388608              bytes     \n";
        assert_eq!(program_limits(text, 1024), want);
    }
}
