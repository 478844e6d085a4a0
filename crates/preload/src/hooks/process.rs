//! The process around the connections: `fork` records the child as a
//! holder of every connection, exec (all nine forms) passes them to a new
//! program that loads this library (`hooks::adopt`) and keeps a channel
//! from reaching one that does not, and exit (`_exit`, `_Exit` and
//! the end of the program) closes each connection as the kernel closes a
//! socket, unless another process of the family still holds it.

use super::target::{self, Program, Target};
use super::{adopt, fail, swap, variant, LIVE};
use crate::holders;
use crate::real;
use crate::table::{self, Sock, LOCK};
use libc::{c_char, c_int, pid_t};
use smclo::debug;
use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a fork holds from its prepare handler ([`before_fork`]) to its
/// child handler, or in the parent to the interposed `fork`'s return: the
/// table's lock, the epoll shadows' locks, and the connections the child
/// inherits, each once.
struct Forking {
    /// Whether the fork is the interposed `fork`'s, which put a
    /// placeholder for the child in each connection's holders and lists
    /// the child there once it knows its pid.
    hooked: bool,
    /// The forking process (in the child: its parent).
    parent: u32,
    lock: table::ForkGuard<'static>,
    /// Let go as soon as the process is copied (`None` after).
    shadows: Option<super::epoll::ForkGuard>,
    /// As `shadows`.
    declines: Option<super::uring::HeldDeclines>,
    socks: Vec<Inherited>,
}

/// A connection the child inherits, and where its holders have the
/// child's placeholder (an interposed fork's).
struct Inherited {
    sock: Arc<Sock>,
    placeholder: Option<holders::Placeholder>,
}

thread_local! {
    static FORKING: RefCell<Option<Forking>> = const { RefCell::new(None) };
    /// Whether this thread is in the interposed `fork`, before its
    /// prepare handler ran (which takes the flag into [`Forking`]).
    static HOOKED: Cell<bool> = const { Cell::new(false) };
}

/// Registers the fork handlers, after the core's and the cork queue's
/// (see `smclo::adapter::register_fork_handlers`): at load, before the
/// program registers any, so that the program's prepare and child
/// handlers run outside the table's lock. (Its parent handlers run inside
/// it: the child's placeholders become its pid only once `fork` returns
/// it. They may use connections, not change the table: `table::Lock`.)
fn register_fork_handlers() {
    smclo::adapter::register_fork_handlers();
    crate::cork::register_fork_handlers();
    // SAFETY: registers plain extern "C" functions, run by the forking
    // thread (the prepare and parent ones) and the child's only thread.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
}

/// The last of the program's prepare handlers has run: no table change
/// may be half done when the process is copied.
extern "C" fn before_fork() {
    // Parent and child could not both drive one handshake.
    super::pending::settle_all();
    // Bytes held back for corking go first, and none are held until the
    // fork is done: parent and child would each publish their own copy of
    // them, over each other's writes. Without the table's lock, which the
    // handler of a signal that interrupted a write may wait for.
    smclo::adapter::conn::forbid_holding();
    let live = || LIVE.load(Ordering::Relaxed) > 0;
    if live() {
        let all = {
            let _g = LOCK.read();
            table::all_locked()
        };
        for s in each_once(&all) {
            let _ = s.conn.flush_waiting();
        }
    }
    let lock = LOCK.write_for_fork();
    let shadows = super::epoll::before_fork_locked();
    let declines = super::uring::hold_declines_for_fork();
    let socks = match live() {
        true => each_once(&table::all_locked()),
        false => Vec::new(),
    };
    let hooked = HOOKED.with(|h| h.replace(false));
    let socks = socks
        .into_iter()
        .map(|sock| Inherited {
            placeholder: holders::before_fork(sock.slot, sock.conn.fd(), hooked),
            sock,
        })
        .collect();
    FORKING.with(|f| {
        *f.borrow_mut() = Some(Forking {
            hooked,
            parent: smclo::adapter::owner::current_pid(),
            lock,
            shadows: Some(shadows),
            declines: Some(declines),
            socks,
        })
    });
}

/// Each connection of `all` once (a connection's descriptors share its
/// slot).
fn each_once(all: &[(RawFd, Arc<Sock>)]) -> Vec<Arc<Sock>> {
    let mut socks: Vec<Arc<Sock>> = Vec::new();
    for (_, s) in all {
        if !socks.iter().any(|x| x.slot == s.slot) {
            socks.push(s.clone());
        }
    }
    socks
}

/// The child, before the program's child handlers: its table is its own,
/// and it lists itself as a holder of each connection.
extern "C" fn in_child() {
    smclo::adapter::conn::allow_holding();
    let Some(mut f) = FORKING.with(|f| f.borrow_mut().take()) else {
        return;
    };
    drop(f.shadows.take());
    if let Some(d) = f.declines.take() {
        super::uring::declines_in_child(d);
    }
    f.lock.forget_in_child();
    super::poll::forget_fd_table();
    swap::forget_deferred_in_child();
    for Inherited {
        sock: s,
        placeholder,
    } in &f.socks
    {
        swap::forget_calls_in_child(s);
        s.conn.forked_child();
        holders::join(s.slot, s.conn.fd(), f.parent, *placeholder);
    }
}

/// The parent, before the program's parent handlers: the shadows' locks
/// go (the child has its copy), so that those handlers may wait on epoll
/// sets. The table's lock stays until the interposed `fork` added the
/// child as a holder; a fork inside the C library (as in `forkpty(3)`) has
/// no pid to add, so it goes now, and the child lists itself
/// ([`in_child`]): a thread of the parent that closes its last descriptor
/// of a connection before the child did may end it for both.
extern "C" fn in_parent() {
    smclo::adapter::conn::allow_holding();
    FORKING.with(|f| {
        let mut f = f.borrow_mut();
        if let Some(forking) = f.as_mut() {
            drop(forking.shadows.take());
            drop(forking.declines.take());
            if !forking.hooked {
                drop(f.take());
            }
        }
    });
}

/// Interposed `fork(2)`: the child is recorded as a holder of every
/// connection before any thread of the parent can close one (the lock the
/// prepare handler took is held until then).
#[no_mangle]
pub unsafe extern "C" fn fork() -> pid_t {
    // Settled before the program's prepare handlers too (again in ours).
    super::pending::settle_all();
    let outer = HOOKED.with(|h| h.replace(true));
    // SAFETY: plain fork; the prepare handler holds the lock, so no table
    // change is half done.
    let pid = unsafe { real::fork() };
    HOOKED.with(|h| h.set(outer));
    if pid == 0 {
        return 0;
    }
    let e = smclo::adapter::errno::get();
    let Some(f) = FORKING.with(|f| f.borrow_mut().take_if(|f| f.hooked)) else {
        return pid;
    };
    let child = u32::try_from(pid).ok();
    for Inherited {
        sock: s,
        placeholder,
    } in &f.socks
    {
        holders::adopt_child(s.slot, *placeholder, child, s.conn.fd());
    }
    if pid > 0 && !f.socks.is_empty() {
        debug!(
            "fork: child {pid} shares {} SMC-D connection(s)",
            f.socks.len()
        );
    }
    drop(f);
    // A failed fork's errno, past the drops' closes.
    smclo::adapter::errno::set(e);
    pid
}

/// Interposed `vfork(2)`: a full fork, so that the child's exec handling
/// cannot touch the parent's memory.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> pid_t {
    // SAFETY: fork is a valid implementation of vfork.
    unsafe { fork() }
}

/// Listener registrations, declines and fallback records stay with this
/// image: the new one registers the listeners it inherits again
/// (`hooks::setup`), or declines them (`hooks::uring`), and a program
/// without this library must not be proposed to.
fn forget_records() {
    super::state::unlist_all();
    super::uring::forget_declines();
}

/// The connections (all, or those in `only`) cannot follow into the new
/// program: their table entries go, and a descriptor the application
/// wanted to pass (no FD_CLOEXEC in its view) is replaced by the hidden TCP
/// socket, the SMC-D connection reset if no other process holds it (the
/// peer sees a reset; the new program sees end of stream once the peer
/// closes). Never does a new program read doorbell bytes as data.
fn fall_back(only: Option<&[Arc<Sock>]>) {
    let g = LOCK.write();
    let all = table::all_locked();
    let mut taken = Vec::new();
    for (fd, s) in &all {
        if only.is_some_and(|o| !o.iter().any(|x| Arc::ptr_eq(x, s))) {
            continue;
        }
        let keep = !table::app_cloexec(*fd);
        if let Some(t) = super::state::take_smc_locked(*fd) {
            taken.push(t);
        }
        if keep {
            s.linger0.store(true, Ordering::Relaxed);
            if s.conn.fd() == *fd {
                swap::move_channel_away(s, *fd);
            }
            // SAFETY: replaces the channel (or a dup of it) with the TCP
            // socket.
            unsafe { real::dup3(s.tcp, *fd, 0) };
            debug!("exec: fd {fd} (SMC-D) cannot follow into the new program; it gets the TCP socket and the connection is reset");
        }
    }
    drop(g);
    drop(all);
    for t in taken {
        super::swap::release(t);
    }
}

/// Every connection's TCP socket goes to the new program, either as its
/// hidden socket or as the descriptor it falls back to: none keeps a SYN
/// mark, since the new image does not know about it.
fn put_back_marks() {
    let _g = LOCK.write();
    table::for_each_locked(|s| s.syn_mark.put_back(s.tcp));
}

/// The environment exec passes when it is given none.
fn environ() -> *const *const c_char {
    extern "C" {
        static environ: *const *const c_char;
    }
    // SAFETY: libc's environ, read once.
    unsafe { environ }
}

/// Every exec form: `LD_PRELOAD` names the build of this library for the
/// new program's loader, or none (`hooks::variant`); the SMC-D connections
/// go to the new program when it loads a build (`runs_preload`, and
/// `LD_PRELOAD` in `envp`, the environment exec passes), with everything
/// in flight (`hooks::adopt`); otherwise they fall back, unless there is
/// no program file to run. `run` performs the exec with the environment it
/// is given, never with a `SMCLO_EXEC_CONNS` this image did not write; if
/// it returns, exec failed and the connections that went along stay here.
fn exec_with(
    program: impl FnOnce() -> Program,
    envp: *const *const c_char,
    run: impl FnOnce(*const *const c_char) -> c_int,
) -> c_int {
    // An ignored SIGBUS stays ignored in the new image, and the new
    // program inherits the limit this one set, not the raised one.
    let run = |env| {
        let limit = smclo::adapter::fdnum::ForExec::begin();
        let r = smclo::adapter::fault::around_exec(|| run(env));
        drop(limit); // the exec failed
        swap::end_all_undone();
        super::uring::exec_failed();
        r
    };
    // The new image could not finish a handshake.
    super::pending::settle_all();
    let program = program();
    let preload_env = variant::exec_env(&program, envp);
    let envp = preload_env.as_ref().map_or(envp, |e| e.as_ptr());
    let plain_env = adopt::PlainEnv::new(envp);
    if LIVE.load(Ordering::Relaxed) == 0 {
        forget_records();
        return run(plain_env.as_ptr());
    }
    let target = target::runs_preload(&program);
    if target == Target::Missing {
        // The exec fails: everything stays as it is.
        return run(plain_env.as_ptr());
    }
    forget_records();
    put_back_marks();
    swap::end_all();
    match target {
        Target::Missing => {}
        Target::Plain(why) => {
            debug!("exec: the new program will not load LD_PRELOAD libraries ({why}); its SMC-D connections fall back");
            fall_back(None);
            return run(plain_env.as_ptr());
        }
        Target::Preloads if !super::variant::preload_in(envp) => {
            debug!("exec: LD_PRELOAD of the new program does not name smclo; its SMC-D connections fall back");
            fall_back(None);
            return run(plain_env.as_ptr());
        }
        Target::Preloads => {}
    }
    let (handoff, refused) = adopt::prepare();
    if !refused.is_empty() {
        fall_back(Some(&refused));
    }
    let Some(h) = handoff else {
        fall_back(None);
        return run(plain_env.as_ptr());
    };
    let env = h.envp(plain_env);
    let r = run(env.as_ptr());
    h.undo();
    r
}

/// At exit: every connection this process holds is closed as the kernel
/// closes a socket at exit (orderly, or a reset if unread data remains),
/// unless another process of the family still holds it; so is an early
/// connect's undecided handshake, as its `close` would
/// (`pending::early_fds`). Without this the
/// peer would see the channel vanish with no flag and report a reset.
pub(crate) fn close_all() {
    swap::end_all();
    if LIVE.load(Ordering::Relaxed) == 0 && !super::pending::any() {
        return;
    }
    let g = LOCK.write();
    // Early connects end as closed (their numbers are forgotten).
    let undecided: Vec<_> = super::state::early_fds_locked()
        .into_iter()
        .map(super::state::forget_fd_locked)
        .collect();
    let all = table::all_locked();
    let mut taken = Vec::new();
    for (fd, _) in &all {
        if let Some(t) = super::state::take_smc_locked(*fd) {
            taken.push(t);
        }
    }
    drop(g);
    drop(all);
    // Their drops close descriptors of their own, through our `close`,
    // which takes the lock.
    drop(undecided);
    for t in taken {
        super::swap::release(t);
    }
}

/// Interposed `pthread_create(3)`: from the process's second thread on,
/// calls on a connection are counted, so that another thread's close
/// waits for them (`swap::InCall`); a process with one thread does not
/// pay for that.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Option<extern "C" fn(*mut libc::c_void) -> *mut libc::c_void>,
    arg: *mut libc::c_void,
) -> c_int {
    swap::threads_started();
    // SAFETY: forwarded unchanged (the caller's contract).
    unsafe { real::pthread_create(thread, attr, start, arg) }
}

extern "C" fn at_exit() {
    if LIVE.load(Ordering::Relaxed) > 0 {
        // libc flushes its streams after this runs; bytes a stdio stream
        // holds for a connection must reach it before it closes.
        crate::stdio::flush_all();
    }
    close_all();
}

/// Runs after the program's own exit handlers (this library is initialised
/// first, so it is finalised last).
#[used]
#[link_section = ".fini_array"]
static AT_EXIT: extern "C" fn() = at_exit;

/// How long `_exit` tries to take the table lock (see [`close_all_at_exit`]).
const EXIT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// At `_exit` and `_Exit`, which signal handlers call (a SIGTERM handler
/// that exits is common): the closes of [`close_all`] with only
/// async-signal-safe work (atomics and raw system calls: no allocation, no
/// `/proc`, no lock the interrupted thread may hold). The table lock is
/// only tried, for [`EXIT_LOCK_WAIT`]: the interrupted thread itself may
/// hold it. If it cannot be had, the connections are left to the kernel
/// and the peers read a reset, as when the process is killed. Nothing is
/// freed, and the stats entry of a connection another process still holds
/// is not handed over to it (that needs `/proc`).
fn close_all_at_exit() {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    swap::end_deferred_at_exit();
    let Some(_g) = LOCK.try_write_for(EXIT_LOCK_WAIT) else {
        return;
    };
    table::for_each_locked(|s| {
        swap::end_share(s);
    });
}

extern "C" fn at_load() {
    smclo::adapter::prime();
    register_fork_handlers();
    if !super::disabled() {
        smclo::adapter::fdnum::widen();
    }
    smclo::adapter::deferred::set_closer(table::close_hidden);
    real::resolve_exit_path();
    variant::at_load();
    super::signal::at_load();
    adopt::at_load();
    super::uring::at_load();
}

/// Runs when the library is loaded.
#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

/// `_exit` after [`close_all_at_exit`]: the `exit_group` system call, which
/// is all libc's `_exit` and `_Exit` do (no `dlsym` needed in a signal
/// handler).
fn exit_now(status: c_int) -> ! {
    close_all_at_exit();
    // SAFETY: exit_group ends the process; it has no memory effects here.
    unsafe { libc::syscall(libc::SYS_exit_group, status) };
    std::process::abort()
}

/// Interposed `_exit(2)`: closes connections as [`close_all_at_exit`], then
/// exits.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    exit_now(status)
}

/// Interposed `_Exit(2)`.
#[allow(non_snake_case)]
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    exit_now(status)
}

/// Interposed `execve(2)`.
#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    exec_with(
        || target::open_path(path),
        envp,
        // SAFETY: the caller's arguments, with our environment.
        |env| unsafe { real::execve(path, argv, env) },
    )
}

/// Interposed `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    exec_with(
        || target::open_path(path),
        environ(),
        // SAFETY: as execv, with the environment made explicit.
        |env| unsafe { real::execve(path, argv, env) },
    )
}

/// Interposed `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    exec_with(
        || target::open_file(file),
        environ(),
        // SAFETY: as execvp, with the environment made explicit.
        |env| unsafe { real::execvpe(file, argv, env) },
    )
}

/// Interposed `execvpe(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    exec_with(
        || target::open_file(file),
        envp,
        // SAFETY: the caller's arguments, with our environment.
        |env| unsafe { real::execvpe(file, argv, env) },
    )
}

/// Interposed `fexecve(3)`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    exec_with(
        || target::open_fd(fd),
        envp,
        // SAFETY: the caller's arguments, with our environment.
        |env| unsafe { real::fexecve(fd, argv, env) },
    )
}

/// Interposed `execveat(2)`.
#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    exec_with(
        || target::open_at(dirfd, path, flags),
        envp,
        // SAFETY: the caller's arguments, with our environment.
        |env| unsafe { real::execveat(dirfd, path, argv, env, flags) },
    )
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
fn l_args(
    list: &[*const c_char; MAX_L_ARGS],
) -> Option<(Vec<*const c_char>, *const *const c_char)> {
    let end = list.iter().position(|p| p.is_null())?;
    let mut v = list[..end].to_vec();
    v.push(std::ptr::null());
    let env = list
        .get(end + 1)
        .map_or(std::ptr::null(), |p| *p as *const *const c_char);
    Some((v, env))
}

/// Defines a variadic exec function `$name(first, a0, a1, ..., NULL)`:
/// `$run` gets the list as a vector (`$v`) and the argument after its
/// NULL (`$env`, execle's envp).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! exec_l {
    ($(#[$doc:meta])* $name:ident($first:ident), |$v:ident, $env:pat_param| $run:expr) => {
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            $first: *const c_char,
            a0: *const c_char,
            a1: *const c_char,
            a2: *const c_char,
            a3: *const c_char,
            a4: *const c_char,
            a5: *const c_char,
            a6: *const c_char,
            a7: *const c_char,
            a8: *const c_char,
            a9: *const c_char,
            a10: *const c_char,
            a11: *const c_char,
            a12: *const c_char,
            a13: *const c_char,
            a14: *const c_char,
            a15: *const c_char,
            a16: *const c_char,
            a17: *const c_char,
            a18: *const c_char,
            a19: *const c_char,
            a20: *const c_char,
            a21: *const c_char,
            a22: *const c_char,
            a23: *const c_char,
            a24: *const c_char,
            a25: *const c_char,
            a26: *const c_char,
            a27: *const c_char,
            a28: *const c_char,
            a29: *const c_char,
            a30: *const c_char,
            a31: *const c_char,
            a32: *const c_char,
            a33: *const c_char,
            a34: *const c_char,
            a35: *const c_char,
            a36: *const c_char,
            a37: *const c_char,
            a38: *const c_char,
            a39: *const c_char,
            a40: *const c_char,
            a41: *const c_char,
            a42: *const c_char,
            a43: *const c_char,
            a44: *const c_char,
            a45: *const c_char,
            a46: *const c_char,
            a47: *const c_char,
            a48: *const c_char,
            a49: *const c_char,
            a50: *const c_char,
            a51: *const c_char,
            a52: *const c_char,
            a53: *const c_char,
            a54: *const c_char,
            a55: *const c_char,
            a56: *const c_char,
            a57: *const c_char,
            a58: *const c_char,
            a59: *const c_char,
            a60: *const c_char,
            a61: *const c_char,
            a62: *const c_char,
            a63: *const c_char,
        ) -> c_int {
            let Some(($v, $env)) = l_args(&[
                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43, a44, a45, a46, a47, a48, a49, a50, a51, a52, a53, a54, a55, a56, a57, a58, a59, a60, a61, a62, a63,
            ]) else {
                return fail(libc::E2BIG);
            };
            $run
        }
    };
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
exec_l!(
    /// Interposed `execl(3)` (see the section comment).
    execl(path),
    // SAFETY: a NULL-terminated vector of the caller's strings.
    |v, _| unsafe { execv(path, v.as_ptr()) }
);

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
exec_l!(
    /// Interposed `execlp(3)`.
    execlp(file),
    // SAFETY: a NULL-terminated vector of the caller's strings.
    |v, _| unsafe { execvp(file, v.as_ptr()) }
);

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
exec_l!(
    /// Interposed `execle(3)`: the environment follows the NULL.
    execle(path),
    // SAFETY: a NULL-terminated vector of the caller's strings and its envp.
    |v, env| unsafe { execve(path, v.as_ptr(), env) }
);
