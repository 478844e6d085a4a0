//! Signal handlers: each one the program installs runs through a
//! trampoline. While the thread holds the descriptor table's lock, the
//! trampoline defers the signal until it is let go ([`crate::critical`]):
//! the handler may call our hooks. Otherwise it first tells the core it runs
//! ([`smclo::adapter::signal::Handler`]), so that a wait spinning in user space
//! stops and fails with `EINTR` (or restarts, `hooks::data`) as the
//! kernel's sleep would have.
//!
//! `sigaction`, `signal`, `bsd_signal`, `sysv_signal`, `sigset` and
//! `siginterrupt` are interposed (glibc's `signal` family calls its own
//! `sigaction` directly, not ours). The wrapping is invisible: the kernel
//! gets the program's mask and flags (`SA_RESTART`, `SA_RESETHAND`,
//! `SA_NODEFER`, `SA_ONSTACK`, ...) with `SA_SIGINFO` added, and queries
//! answer with the program's handler and flags. `SIG_IGN`, `SIG_DFL` and
//! the handlers of fault signals ([`FAULTS`]: a thread that spins raises
//! none) are installed as given, except `SIGBUS`: the core's handler,
//! installed at load, keeps it, recovers from faults in smclo's shared
//! mappings and runs the program's action for every other
//! ([`smclo::adapter::fault`]); queries answer with the program's action. The trampoline calls the program's
//! handler with the kernel's arguments and leaves `errno` as the handler
//! does. Handlers installed with the raw system call are not wrapped; a
//! wait does not see them run until it sleeps.
//!
//! `sigprocmask` and `pthread_sigmask` are interposed too: a mask never
//! blocks `SIGBUS` in the kernel, where a fault in a shrunk shared file
//! would kill the thread ([`smclo::adapter::fault::program_mask`]); the
//! program sees the mask it set. Nor does a handler's mask (`sa_mask`):
//! the kernel gets it without `SIGBUS`, queries answer with the program's,
//! and while the handler runs the thread's view blocks `SIGBUS` as the
//! program asked (`fault::with_handler_view`).

use crate::real;
use libc::{c_int, c_void, sighandler_t, siginfo_t};
use smclo::adapter::errno;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::critical::FAULTS;

/// Linux's signals are 1..=64.
const NSIG: usize = 65;

/// `sigset`'s disposition that blocks the signal instead.
const SIG_HOLD: sighandler_t = 2;

/// The program's handler of each signal: in `INFO` when it was installed
/// with `SA_SIGINFO` (three arguments), in `PLAIN` otherwise; the other
/// entry is 0. Atomics, as the trampoline reads them in a signal handler.
static PLAIN: [AtomicUsize; NSIG] = [const { AtomicUsize::new(0) }; NSIG];
static INFO: [AtomicUsize; NSIG] = [const { AtomicUsize::new(0) }; NSIG];

/// Signals whose handler's mask (`sa_mask`) the program gave with
/// `SIGBUS`, which the kernel got without it
/// ([`smclo::adapter::fault::kernel_handler_mask`]); bit `sig - 1`.
static MASK_BUS: AtomicU64 = AtomicU64::new(0);

/// Signals `siginterrupt` made interrupting: `signal` installs their
/// handlers without `SA_RESTART`, as glibc's does.
static INTERRUPTING: AtomicU64 = AtomicU64::new(0);

/// What the kernel runs for a wrapped signal.
extern "C" fn trampoline(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
    // SAFETY: the kernel's arguments to this running SA_SIGINFO handler.
    if unsafe { crate::critical::defer(sig, info, ctx) } {
        keep_reset_handler(sig);
        return;
    }
    let _running = smclo::adapter::signal::Handler::runs(sig);
    let Some(i) = slot(sig) else { return };
    let f = INFO[i].load(Ordering::Acquire);
    if f != 0 {
        // SAFETY: `f` is the program's SA_SIGINFO handler, of this type.
        let f: extern "C" fn(c_int, *mut siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(f) };
        return with_view(i, || f(sig, info, ctx));
    }
    let f = PLAIN[i].load(Ordering::Acquire);
    if f != 0 {
        // SAFETY: `f` is the program's one-argument handler.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(f) };
        with_view(i, || f(sig));
    }
}

/// Runs the handler of slot `i` with the program's view of its mask.
fn with_view(i: usize, f: impl FnOnce()) {
    smclo::adapter::fault::with_handler_view(mask_bus(i), f)
}

/// Whether slot `i`'s handler mask has `SIGBUS` in the program's view.
fn mask_bus(i: usize) -> bool {
    MASK_BUS.load(Ordering::Relaxed) & (1 << (i - 1)) != 0
}

/// `act` with the mask the kernel gets (without `SIGBUS`), and whether
/// the program's had it.
fn kernel_act(act: &libc::sigaction) -> (libc::sigaction, bool) {
    let mut k = *act;
    let bus = smclo::adapter::fault::kernel_handler_mask(&mut k.sa_mask);
    (k, bus)
}

/// Notes whether slot `i`'s handler mask has `SIGBUS` in the program's
/// view; returns what it had before.
fn set_mask_bus(i: usize, bus: bool) -> bool {
    let bit = 1u64 << (i - 1);
    let before = if bus {
        MASK_BUS.fetch_or(bit, Ordering::Relaxed)
    } else {
        MASK_BUS.fetch_and(!bit, Ordering::Relaxed)
    };
    before & bit != 0
}

/// A deferred signal of a handler installed with `SA_RESETHAND`: the
/// kernel has reset the action to `SIG_DFL` on this delivery, and the
/// program's handler is still to run once. The trampoline goes back in,
/// with the program's flags and mask (which the reset kept), for the
/// delivery that runs it, which resets it again.
fn keep_reset_handler(sig: c_int) {
    if slot(sig).is_none_or(|i| entry(i).0 == 0) {
        return;
    }
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query, then the same action with the trampoline.
    errno::kept(|| unsafe {
        if real::sigaction(sig, std::ptr::null(), &mut cur) == 0
            && cur.sa_sigaction == libc::SIG_DFL
            && cur.sa_flags & libc::SA_RESETHAND != 0
        {
            cur.sa_sigaction = trampoline_addr();
            real::sigaction(sig, &cur, std::ptr::null_mut());
        }
    });
}

fn trampoline_addr() -> sighandler_t {
    trampoline as extern "C" fn(c_int, *mut siginfo_t, *mut c_void) as sighandler_t
}

/// The table index of `sig`, if it is a signal.
fn slot(sig: c_int) -> Option<usize> {
    usize::try_from(sig)
        .ok()
        .filter(|&i| (1..NSIG).contains(&i))
}

/// The program's handler of slot `i`, as the table has it: (handler,
/// installed with `SA_SIGINFO`).
fn entry(i: usize) -> (sighandler_t, bool) {
    match INFO[i].load(Ordering::Acquire) {
        0 => (PLAIN[i].load(Ordering::Acquire), false),
        f => (f, true),
    }
}

fn set_entry(i: usize, (f, info): (sighandler_t, bool)) {
    let (set, clear) = if info {
        (&INFO, &PLAIN)
    } else {
        (&PLAIN, &INFO)
    };
    set[i].store(f, Ordering::Release);
    clear[i].store(0, Ordering::Release);
}

/// A program's action the kernel gets with the trampoline in its place.
struct Wrapped {
    /// What the kernel gets.
    act: libc::sigaction,
    /// The table slot and entry of the program's handler.
    slot: usize,
    entry: (sighandler_t, bool),
}

/// `act` wrapped, when it is one to wrap.
fn wrapped(sig: c_int, act: &libc::sigaction) -> Option<Wrapped> {
    let h = act.sa_sigaction;
    let i = slot(sig)?;
    if h == libc::SIG_DFL || h == libc::SIG_IGN || h == trampoline_addr() || FAULTS.contains(&sig) {
        return None;
    }
    let mut w = *act;
    w.sa_sigaction = trampoline_addr();
    w.sa_flags |= libc::SA_SIGINFO;
    Some(Wrapped {
        act: w,
        slot: i,
        entry: (h, act.sa_flags & libc::SA_SIGINFO != 0),
    })
}

/// A kernel answer made the program's: the trampoline becomes the handler
/// of `prev` (the table entry at the time), with the program's flags. A
/// `SIG_DFL` with an entry is a wrapped handler the kernel reset on
/// delivery (`SA_RESETHAND`): its flags are the program's too.
fn unwrap(old: &mut libc::sigaction, prev: (sighandler_t, bool)) {
    let h = old.sa_sigaction;
    if h == trampoline_addr() {
        old.sa_sigaction = prev.0;
    } else if h != libc::SIG_DFL || prev.0 == 0 {
        return;
    }
    if !prev.1 {
        old.sa_flags &= !libc::SA_SIGINFO;
    }
}

/// Interposed `sigaction(2)` (see the module docs). Async-signal-safe, as
/// the real one: atomics and the real call.
#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    if sig == libc::SIGBUS {
        // SAFETY: the caller's action and storage, when not null.
        let (a, o) = unsafe { (act.as_ref(), old.as_mut()) };
        if let Some(r) = smclo::adapter::fault::program_action(a, o) {
            return r;
        }
    }
    // SAFETY: the caller's action, when not null.
    let given = unsafe { act.as_ref() }.map(kernel_act);
    let wrap = given.and_then(|(a, _)| wrapped(sig, &a));
    let prev = slot(sig).map(entry);
    // The program's mask: in the view at once, as the trampoline may run.
    let bus_before = match (slot(sig), given) {
        (Some(i), Some((_, bus))) => set_mask_bus(i, bus),
        (Some(i), None) => mask_bus(i),
        (None, _) => false,
    };
    let r = match &wrap {
        Some(w) => {
            // The trampoline may run as soon as the kernel has it.
            set_entry(w.slot, w.entry);
            // SAFETY: a valid action and the caller's `old`.
            let r = unsafe { real::sigaction(sig, &w.act, old) };
            if let (true, Some(p)) = (r != 0, prev) {
                set_entry(w.slot, p);
            }
            r
        }
        None => {
            let kernel = given
                .as_ref()
                .map_or(std::ptr::null(), |(a, _)| a as *const _);
            // SAFETY: the caller's action (its mask as the kernel gets it),
            // or none, and the caller's `old`.
            let r = unsafe { real::sigaction(sig, kernel, old) };
            if let (0, false, Some(i)) = (r, act.is_null(), slot(sig)) {
                // Not wrapped any more: no entry (see `unwrap`).
                set_entry(i, (0, false));
            }
            r
        }
    };
    if let (true, Some(i)) = (r != 0 && given.is_some(), slot(sig)) {
        set_mask_bus(i, bus_before);
    }
    // SAFETY: the caller's `old`, filled by the real call.
    if let (0, Some(old)) = (r, unsafe { old.as_mut() }) {
        if let Some(p) = prev {
            unwrap(old, p);
        }
        if bus_before {
            // SAFETY: the mask the call filled.
            unsafe { libc::sigaddset(&mut old.sa_mask, libc::SIGBUS) };
        }
    }
    r
}

/// Interposed `pthread_sigmask(3)` (see the module docs).
/// Async-signal-safe, as the real one.
#[no_mangle]
pub unsafe extern "C" fn pthread_sigmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's sets, as the real function takes them.
    unsafe {
        smclo::adapter::fault::program_mask(how, set, old, |h, s, o| real::pthread_sigmask(h, s, o))
    }
}

/// Interposed `sigprocmask(2)` (see the module docs). Async-signal-safe,
/// as the real one.
#[no_mangle]
pub unsafe extern "C" fn sigprocmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's sets, as the real function takes them.
    unsafe {
        smclo::adapter::fault::program_mask(how, set, old, |h, s, o| real::sigprocmask(h, s, o))
    }
}

/// `sigaction` with `handler`, `flags` and a mask of `mask` (or none):
/// the previous handler, or `SIG_ERR`.
fn install(sig: c_int, handler: sighandler_t, flags: c_int, mask: Option<c_int>) -> sighandler_t {
    if handler == libc::SIG_ERR {
        errno::set(libc::EINVAL);
        return libc::SIG_ERR;
    }
    // SAFETY: an all-zero sigaction is a valid start (empty mask below).
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    act.sa_flags = flags;
    // SAFETY: initialises the action's own mask.
    unsafe {
        libc::sigemptyset(&mut act.sa_mask);
        if let Some(m) = mask {
            libc::sigaddset(&mut act.sa_mask, m);
        }
    }
    // SAFETY: as the zeroed action above.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid action and storage.
    if unsafe { sigaction(sig, &act, &mut old) } < 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}

fn interrupting(sig: c_int) -> bool {
    slot(sig).is_some_and(|i| INTERRUPTING.load(Ordering::Relaxed) & (1 << (i - 1)) != 0)
}

/// Interposed `signal(3)`: BSD semantics (`SA_RESTART` unless
/// `siginterrupt` said otherwise, the signal blocked in its handler), as
/// glibc's.
#[no_mangle]
pub extern "C" fn signal(sig: c_int, handler: sighandler_t) -> sighandler_t {
    let flags = if interrupting(sig) {
        0
    } else {
        libc::SA_RESTART
    };
    install(sig, handler, flags, Some(sig))
}

/// Interposed `bsd_signal(3)`: `signal`.
#[no_mangle]
pub extern "C" fn bsd_signal(sig: c_int, handler: sighandler_t) -> sighandler_t {
    signal(sig, handler)
}

/// Interposed `sysv_signal(3)`: System V semantics (reset on delivery,
/// not blocked in its handler, no restart), as glibc's.
#[no_mangle]
pub extern "C" fn sysv_signal(sig: c_int, handler: sighandler_t) -> sighandler_t {
    install(sig, handler, libc::SA_RESETHAND | libc::SA_NODEFER, None)
}

/// glibc's other name of `sysv_signal`.
#[no_mangle]
pub extern "C" fn __sysv_signal(sig: c_int, handler: sighandler_t) -> sighandler_t {
    sysv_signal(sig, handler)
}

/// Blocks (`SIG_BLOCK`) or unblocks `sig` in this thread; whether it was
/// blocked before (`None`: failed).
fn mask_one(how: c_int, sig: c_int) -> Option<bool> {
    // SAFETY: all-zero sigsets are valid storage; sigemptyset initialises.
    let (mut set, mut old): (libc::sigset_t, libc::sigset_t) = unsafe { std::mem::zeroed() };
    // SAFETY: local sets; the thread's mask.
    unsafe {
        libc::sigemptyset(&mut set);
        if libc::sigaddset(&mut set, sig) < 0 || libc::sigprocmask(how, &set, &mut old) < 0 {
            return None;
        }
        Some(libc::sigismember(&old, sig) == 1)
    }
}

/// Interposed `sigset(3)`, as glibc's: `SIG_HOLD` blocks the signal;
/// another disposition is installed (no flags) and unblocks it. The
/// previous disposition, `SIG_HOLD` if the signal was blocked.
#[no_mangle]
pub extern "C" fn sigset(sig: c_int, disp: sighandler_t) -> sighandler_t {
    if disp == SIG_HOLD {
        return match mask_one(libc::SIG_BLOCK, sig) {
            None => libc::SIG_ERR,
            Some(true) => SIG_HOLD,
            Some(false) => install_query(sig),
        };
    }
    let old = install(sig, disp, 0, None);
    if old == libc::SIG_ERR {
        return old;
    }
    match mask_one(libc::SIG_UNBLOCK, sig) {
        None => libc::SIG_ERR,
        Some(true) => SIG_HOLD,
        Some(false) => old,
    }
}

/// The program's handler of `sig`, or `SIG_ERR`.
fn install_query(sig: c_int) -> sighandler_t {
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query (no new action).
    if unsafe { sigaction(sig, std::ptr::null(), &mut old) } < 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}

/// Interposed `siginterrupt(3)`, as glibc's: `SA_RESTART` off (`flag`
/// non-zero) or on for the handler of `sig`, and for those `signal`
/// installs later.
#[no_mangle]
pub extern "C" fn siginterrupt(sig: c_int, flag: c_int) -> c_int {
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query (no new action).
    if unsafe { sigaction(sig, std::ptr::null(), &mut act) } < 0 {
        return -1;
    }
    let bit = slot(sig).map_or(0, |i| 1u64 << (i - 1));
    if flag != 0 {
        INTERRUPTING.fetch_or(bit, Ordering::Relaxed);
        act.sa_flags &= !libc::SA_RESTART;
    } else {
        INTERRUPTING.fetch_and(!bit, Ordering::Relaxed);
        act.sa_flags |= libc::SA_RESTART;
    }
    // SAFETY: the program's own action, changed in one flag.
    unsafe { sigaction(sig, &act, std::ptr::null_mut()) }
}

/// The real `sigaction`, for the core's own `SIGBUS` handler.
unsafe extern "C" fn real_sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    // SAFETY: the core's valid arguments, forwarded.
    unsafe { real::sigaction(sig, act, old) }
}

/// Finds the real `sigaction` ahead of time (the first call may come from
/// a signal handler, where `dlsym` must not run), and installs the core's
/// `SIGBUS` handler before the program can install its own: from then on
/// the program's `SIGBUS` actions live behind it ([`smclo::adapter::fault`]).
pub(super) fn at_load() {
    smclo::adapter::fault::use_sigaction(real_sigaction);
    if !super::disabled() {
        smclo::adapter::fault::install();
    }
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    // Resolved now: a handler may be the first to call them.
    // SAFETY: queries (no new action, no new mask), into valid storage.
    errno::kept(|| unsafe {
        real::sigaction(libc::SIGUSR1, std::ptr::null(), &mut a);
        let mut m: libc::sigset_t = std::mem::zeroed();
        real::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut m);
        real::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut m);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicI32, AtomicU32};

    static RAN: AtomicU32 = AtomicU32::new(0);
    static VALUE: AtomicI32 = AtomicI32::new(0);

    extern "C" fn count(_: c_int, info: *mut siginfo_t, _: *mut c_void) {
        RAN.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the kernel's siginfo of a queued signal.
        VALUE.store(
            unsafe { (*info).si_value().sival_ptr } as i32,
            Ordering::SeqCst,
        );
    }

    /// Queues `sig` with `value` to the calling thread, as `sigqueue` does
    /// to a process.
    fn queue_to_self(sig: c_int, value: i32) {
        // SAFETY: an all-zero siginfo, filled as sigqueue fills it.
        let mut info: siginfo_t = unsafe { std::mem::zeroed() };
        info.si_signo = sig;
        info.si_code = libc::SI_QUEUE;
        // SAFETY: the value word of a SI_QUEUE siginfo (after the pid and
        // uid words), as the kernel lays it out.
        unsafe {
            let words = (&mut info as *mut siginfo_t)
                .cast::<u8>()
                .add(16)
                .cast::<i32>();
            *words = libc::getpid();
            *words.add(1) = libc::getuid() as i32;
            *(words.add(2).cast::<usize>()) = value as usize;
        }
        // SAFETY: a valid siginfo for this thread.
        let r = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::syscall(libc::SYS_gettid),
                sig,
                &info,
            )
        };
        assert_eq!(
            r,
            0,
            "rt_tgsigqueueinfo: {}",
            std::io::Error::last_os_error()
        );
    }

    /// A signal that comes while its thread is in a section runs the
    /// program's handler once the section ends, with the siginfo it was
    /// sent with; one installed with `SA_RESETHAND` runs once and leaves
    /// the default action, as without the deferral.
    #[test]
    fn a_signal_in_a_section_runs_its_handler_when_the_section_ends() {
        let sig = libc::SIGUSR2;
        // SAFETY: an all-zero sigaction, given a handler and an empty mask.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = count as extern "C" fn(c_int, *mut siginfo_t, *mut c_void) as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESETHAND;
        // SAFETY: a valid action through the interposed sigaction.
        assert_eq!(unsafe { sigaction(sig, &act, std::ptr::null_mut()) }, 0);
        let section = crate::critical::enter();
        let inner = crate::critical::enter();
        queue_to_self(sig, 42);
        assert_eq!(RAN.load(Ordering::SeqCst), 0, "deferred while in a section");
        drop(inner);
        assert_eq!(
            RAN.load(Ordering::SeqCst),
            0,
            "deferred until the outermost ends"
        );
        drop(section);
        assert_eq!(RAN.load(Ordering::SeqCst), 1, "ran when the section ended");
        assert_eq!(
            VALUE.load(Ordering::SeqCst),
            42,
            "with the value it was sent with"
        );
        // SAFETY: an all-zero sigaction is valid storage for the query.
        let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a query of the kernel's action.
        unsafe { real::sigaction(sig, std::ptr::null(), &mut now) };
        assert_eq!(
            now.sa_sigaction,
            libc::SIG_DFL,
            "SA_RESETHAND reset it after its one run"
        );
        // The signal is not blocked any more.
        let mut mask = 0u64;
        // SAFETY: a query of the thread's mask into 8 bytes.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_BLOCK,
                0usize,
                &mut mask,
                8usize,
            )
        };
        assert_eq!(mask & (1 << (sig - 1)), 0, "unblocked");
    }
}
