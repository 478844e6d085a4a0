//! Sections in which the program's signal handlers do not run (never
//! across a wait that handlers must interrupt): while a
//! thread holds (or is taking) the descriptor table's lock
//! ([`crate::table::LOCK`]), which is not re-entrant, one of the
//! preload's mutexes ([`lock`]), or a closing descriptor's number
//! (`table::close_internal`), which a `close` or `dup2` of that number
//! waits for. POSIX lets a handler
//! call `socket`, `bind`, `listen`, `close` and more; run in the middle of
//! one of our hooks, such a handler would wait for the lock its own thread
//! holds, for ever (and one that `siglongjmp`s out would never release it).
//!
//! A signal whose handler is the program's arrives through the trampoline
//! (`hooks::signal`), which asks [`defer`] first. Inside a section, the
//! signal is queued to the same thread again with the same `siginfo`
//! (`rt_tgsigqueueinfo`, which the kernel allows for any code sent to
//! oneself), blocked in the thread's mask, including the one the kernel
//! restores when the handler returns (`uc_sigmask`), and the trampoline
//! returns. When the thread's outermost section ends, [`Section`]'s drop
//! unblocks what it deferred and the kernel delivers it then, with a
//! context of its own, the program's mask and flags: to the program the
//! signal came a few microseconds later. Nothing is stored per signal but a
//! bit, so everything here is async-signal-safe (raw system calls and
//! thread-local cells without destructors). Fault signals never come
//! through the trampoline; a signal the kernel cannot queue again (the
//! real-time queue is full) runs its handler at once, as before.

use libc::{c_int, c_void, siginfo_t};
use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{compiler_fence, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Signals the kernel raises for a fault of the running thread.
pub const FAULTS: [c_int; 5] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGTRAP,
];

/// The thread's sections: one thread-local, so that entering and leaving
/// one look it up once.
struct Sections {
    /// How many sections the thread is in.
    depth: Cell<u32>,
    /// Signals deferred (bit `sig - 1`): queued again and blocked until
    /// the outermost section ends.
    deferred: Cell<u64>,
    /// Whether one of the sections is the table lock's ([`enter_table`]).
    table: Cell<bool>,
}

thread_local! {
    static SECTIONS: Sections = const {
        Sections {
            depth: Cell::new(0),
            deferred: Cell::new(0),
            table: Cell::new(false),
        }
    };
}

/// This thread's [`Sections`], reached again at a section's end without
/// a lookup (a preloaded library looks each thread-local up through
/// `__tls_get_addr`, and every lock of the preload's is a section).
#[derive(Clone, Copy)]
struct Here(*const Sections);

impl Here {
    #[inline]
    fn now() -> Here {
        SECTIONS.with(|s| Here(s))
    }

    #[inline]
    fn get(&self) -> &Sections {
        // SAFETY: `SECTIONS` is constant-initialised and has no destructor,
        // so its storage is valid for the whole life of the thread that
        // took this pointer; a raw pointer makes `Here`, and the sections
        // that hold one, neither `Send` nor `Sync`, so only that thread,
        // while it runs, reads through it.
        unsafe { &*self.0 }
    }
}

/// The calling thread is in a section until this is dropped. Not `Send`:
/// the count is the thread's.
pub struct Section(Here);

/// Enters a section.
#[inline]
pub fn enter() -> Section {
    let here = Here::now();
    let s = here.get();
    s.depth.set(s.depth.get() + 1);
    // In the section before anything after it (a lock taken) happens.
    compiler_fence(Ordering::SeqCst);
    Section(here)
}

impl Drop for Section {
    #[inline]
    fn drop(&mut self) {
        leave(self.0.get(), false);
    }
}

/// The section of the table lock (`crate::table::LOCK`), which holds or
/// takes it: `None` when the thread holds it already (the lock is not
/// re-entrant). One thread-local look each way, as the lock is on the
/// paths of every call on a connection.
#[inline]
pub fn enter_table() -> Option<TableSection> {
    // In the section before the flag is set, and out of it after the flag
    // is cleared ([`leave`]): a handler that ran in between would find the
    // flag without the section, and take the lock again.
    let here = Here::now();
    let s = here.get();
    s.depth.set(s.depth.get() + 1);
    let again = s.table.replace(true);
    compiler_fence(Ordering::SeqCst);
    if again {
        leave(s, false);
        return None;
    }
    Some(TableSection(here))
}

/// See [`enter_table`].
pub struct TableSection(Here);

impl Drop for TableSection {
    #[inline]
    fn drop(&mut self) {
        leave(self.0.get(), true);
    }
}

/// Leaves a section (the table lock's: `table`); the outermost lets the
/// deferred signals in.
#[inline]
fn leave(s: &Sections, table: bool) {
    // Out of the section only after what it guarded (a lock let go).
    compiler_fence(Ordering::SeqCst);
    if table {
        s.table.set(false);
    }
    let n = s.depth.get() - 1;
    s.depth.set(n);
    let deferred = if n == 0 { s.deferred.replace(0) } else { 0 };
    if deferred != 0 {
        // The handlers run as this returns; the caller's errno is its own.
        smclo::adapter::errno::kept(|| sigmask(libc::SIG_UNBLOCK, deferred));
    }
}

/// A mutex of the preload's held in a section: for the mutexes whose
/// holders never wait while they hold them (a handler that needs one
/// would otherwise wait for its own thread). A panic elsewhere does not
/// poison them.
pub fn lock<T>(m: &Mutex<T>) -> Locked<'_, T> {
    let section = enter();
    Locked {
        guard: m.lock().unwrap_or_else(|p| p.into_inner()),
        _section: section,
    }
}

/// See [`lock`]. Fields drop in order: the mutex is let go before the
/// section ends and deferred handlers run.
pub struct Locked<'a, T> {
    guard: MutexGuard<'a, T>,
    _section: Section,
}

impl<T> Deref for Locked<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Locked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// Runs `f` (which starts a thread of the preload's) with every signal
/// blocked but the faults a thread raises itself: a thread started there
/// inherits that mask and never runs the program's handlers, nor takes a
/// signal the program blocks in its own threads (to wait for it on a
/// `signalfd` or in `sigwait`), whose default action would end the
/// process. The caller's mask is back when this returns.
pub fn without_signals<R>(f: impl FnOnce() -> R) -> R {
    // SIGSYS too: seccomp raises it for the thread's own call.
    let faults = FAULTS
        .iter()
        .chain(&[libc::SIGSYS])
        .fold(0u64, |m, &sig| m | 1 << (sig - 1));
    let before = sigmask(libc::SIG_BLOCK, !faults);
    let r = f();
    sigmask(libc::SIG_SETMASK, before);
    r
}

/// Whether the calling thread is in a section.
pub fn inside() -> bool {
    SECTIONS.with(|s| s.depth.get()) > 0
}

/// In a fork child: the forking thread held the table lock across the
/// fork and is the child's only thread. Its sections are over, and the
/// signals it had deferred are the parent's (pending signals are not
/// inherited): the child's mask gets them back.
pub fn reset_in_child() {
    let deferred = SECTIONS.with(|s| {
        s.depth.set(0);
        s.table.set(false);
        s.deferred.replace(0)
    });
    if deferred != 0 {
        sigmask(libc::SIG_UNBLOCK, deferred);
    }
}

/// For the trampoline, before it runs the program's handler of `sig`
/// (1..=64) with `info` and `ctx`: true when the thread is in a section
/// and the signal was deferred (the handler must not run now).
///
/// # Safety
///
/// `info` and `ctx` are the kernel's arguments to an `SA_SIGINFO` handler
/// of `sig`, which is running.
pub unsafe fn defer(sig: c_int, info: *const siginfo_t, ctx: *mut c_void) -> bool {
    if !inside() || !(1..=64).contains(&sig) || ctx.is_null() {
        return false;
    }
    smclo::adapter::errno::kept(|| {
        let bit = 1u64 << (sig - 1);
        // Blocked now, for a handler that does not block its own signal
        // (SA_NODEFER): the signal queued below would interrupt it at once.
        let before = sigmask(libc::SIG_BLOCK, bit);
        // SAFETY: the running handler's own siginfo, sent to this thread.
        let queued = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::syscall(libc::SYS_gettid),
                sig,
                info,
            )
        } == 0;
        if !queued {
            if before & bit == 0 {
                sigmask(libc::SIG_UNBLOCK, bit);
            }
            return false;
        }
        // SAFETY: `ctx` is the kernel's ucontext of this handler, which
        // `rt_sigreturn` reads the mask to restore from.
        unsafe { libc::sigaddset(&mut (*ctx.cast::<libc::ucontext_t>()).uc_sigmask, sig) };
        SECTIONS.with(|s| s.deferred.set(s.deferred.get() | bit));
        true
    })
}

/// `rt_sigprocmask(how, set)` on the kernel's 64-bit mask, past the
/// interposed functions: the mask before.
fn sigmask(how: c_int, set: u64) -> u64 {
    let mut old = 0u64;
    // SAFETY: two valid 8-byte masks, the size the kernel takes.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            how,
            &set as *const u64,
            &mut old as *mut u64,
            8usize,
        )
    };
    old
}
