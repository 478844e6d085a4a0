//! The real libc functions behind the interposed ones, found with
//! `dlsym(RTLD_NEXT, ..)` on first use and cached in an atomic.
//!
//! Variadic libc functions (`fcntl`, `ioctl`) are declared with one
//! `c_ulong` argument: on the Linux ABIs we build for (x86_64, aarch64) a
//! variadic integer or pointer argument travels exactly like a fixed one.

use libc::{
    c_char, c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, pid_t, size_t, sockaddr,
    socklen_t, ssize_t,
};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Resolves `name` (NUL-terminated) in the libraries after this one. A
/// missing symbol is fatal: without it the call cannot be made at all.
fn resolve(name: &'static str) -> usize {
    // SAFETY: `name` is a NUL-terminated literal; RTLD_NEXT is a valid handle.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) };
    if p.is_null() {
        let msg = b"smclo preload: a libc function is missing (dlsym RTLD_NEXT failed)\n";
        // SAFETY: writes a static buffer to stderr; then abort, as there is
        // no way to perform the call the program asked for.
        unsafe {
            libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len());
            libc::abort();
        }
    }
    p as usize
}

macro_rules! real {
    ($(fn $name:ident($($arg:ident: $t:ty),*) -> $ret:ty;)*) => {$(
        /// The real function (see the module docs).
        ///
        /// # Safety
        /// Same contract as the libc function of that name.
        #[allow(clippy::missing_safety_doc, non_snake_case)]
        pub unsafe fn $name($($arg: $t),*) -> $ret {
            static P: AtomicUsize = AtomicUsize::new(0);
            let mut p = P.load(Ordering::Relaxed);
            if p == 0 {
                p = resolve(concat!(stringify!($name), "\0"));
                P.store(p, Ordering::Relaxed);
            }
            // SAFETY: `p` is the address of the libc function `$name`, whose
            // C prototype is the one spelled here.
            let f: unsafe extern "C" fn($($t),*) -> $ret = unsafe { std::mem::transmute(p) };
            // SAFETY: the caller upholds the function's contract.
            unsafe { f($($arg),*) }
        }
    )*};
}

real! {
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int, t: *mut libc::timespec) -> c_int;
    fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int) -> c_int;
    fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    fn splice(a: c_int, ao: *mut libc::loff_t, b: c_int, bo: *mut libc::loff_t, n: size_t, f: c_uint) -> ssize_t;
    fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fn ioctl(fd: c_int, req: libc::Ioctl, arg: c_ulong) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(fd: c_int, new: c_int) -> c_int;
    fn dup3(fd: c_int, new: c_int, flags: c_int) -> c_int;
    fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    fn epoll_wait(ep: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(ep: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int, mask: *const libc::sigset_t) -> c_int;
    fn fork() -> pid_t;
    fn pthread_create(
        thread: *mut libc::pthread_t,
        attr: *const libc::pthread_attr_t,
        start: Option<extern "C" fn(*mut c_void) -> *mut c_void>,
        arg: *mut c_void
    ) -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn execv(path: *const c_char, argv: *const *const c_char) -> c_int;
    fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int;
    fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn execveat(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int;
    fn posix_spawn(pid: *mut pid_t, path: *const c_char, acts: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    fn posix_spawnp(pid: *mut pid_t, file: *const c_char, acts: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    fn ppoll(fds: *mut libc::pollfd, n: libc::nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    fn pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int;
    fn sigprocmask(how: c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> c_int;
    fn pthread_sigmask(how: c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> c_int;
    fn getrlimit(resource: c_int, rl: *mut libc::rlimit) -> c_int;
    fn setrlimit(resource: c_int, rl: *const libc::rlimit) -> c_int;
    fn prlimit(pid: pid_t, resource: c_int, new: *const libc::rlimit, old: *mut libc::rlimit) -> c_int;
    fn prlimit64(pid: pid_t, resource: c_int, new: *const libc::rlimit, old: *mut libc::rlimit) -> c_int;
    fn sysconf(name: c_int) -> libc::c_long;
    fn getdtablesize() -> c_int;
    fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int;
    fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int;
    fn openat(dir: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int;
    fn openat64(dir: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int;
    fn creat(path: *const c_char, mode: c_uint) -> c_int;
    fn pipe(fds: *mut c_int) -> c_int;
    fn pipe2(fds: *mut c_int, flags: c_int) -> c_int;
    fn socketpair(domain: c_int, ty: c_int, proto: c_int, fds: *mut c_int) -> c_int;
    fn epoll_create(size: c_int) -> c_int;
    fn epoll_create1(flags: c_int) -> c_int;
    fn system(cmd: *const c_char) -> c_int;
    fn popen(cmd: *const c_char, mode: *const c_char) -> *mut c_void;
}

/// Finds, ahead of time, the real functions that `_exit` reaches (the
/// core's `Conn` calls `shutdown`, which is interposed): `_exit` may run in
/// a signal handler, where `dlsym` (locks, allocation) must not be called.
pub fn resolve_exit_path() {
    // SAFETY: shutdown of descriptor -1 only fails (EBADF, which `kept`
    // takes back) and resolves the pointer on the way.
    smclo::adapter::errno::kept(|| unsafe {
        shutdown(-1, libc::SHUT_RDWR);
    });
}
