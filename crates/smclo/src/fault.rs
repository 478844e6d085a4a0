//! Shared files shrunk under our mappings: recovered, never a crash.
//!
//! Every shared file smclo maps (the device file, the DMBs' memfds) may be
//! written by other processes of its trust domain (the uid of a private
//! device, every member of a group device). A store or load in a page of
//! a shared mapping that is past the file's end (`truncate`), or in a hole
//! (`fallocate --punch-hole`) the filesystem has no room to fill, is a
//! `SIGBUS`, whose default action kills the process. DMBs are sealed
//! against shrinking ([`crate::dmb::REQUIRED_SEALS`]), and a hole punched
//! in a memfd refills with zeros (memfds live on a filesystem without a
//! size limit); the device file, a plain file in a directory, cannot be
//! sealed. So each mapping is registered here ([`Region`]) and the process
//! gets a `SIGBUS` handler ([`install`]): a fault inside a registered
//! region maps anonymous zero memory over the whole region (`MAP_FIXED`,
//! one system call, async-signal-safe) and marks it lost, and the faulting
//! access runs again harmlessly. The code that uses the region then sees
//! the mark: a lost device reads as switched off (its knobs are zero, new
//! connections fall back with `NO_SMCD_DEV`), and a connection on a lost
//! device or DMB is reset at its next call (`ECONNRESET`, as a TCP RST).
//!
//! Faults elsewhere, and `SIGBUS` sent by a process, go to the program's
//! own action ([`program_action`]), which the handler runs as the kernel
//! would have (its handler with its mask, or the default: death). The
//! preload hands every `sigaction`/`signal` of the program for `SIGBUS` to
//! [`program_action`], so the program's handler never displaces this one;
//! a program of the native or C API that installs a `SIGBUS` handler after
//! smclo mapped a file calls [`recover`] first from it.
//!
//! The regions are a list of fixed slots, each one word (start page and
//! page count), read by the handler with plain atomic loads: no lock, no
//! allocation.
//! A region is unregistered before it is unmapped, and the faulting thread
//! is using it, so the handler never maps over memory given to anyone else.
//!
//! A lost device makes `Device::open` map the file anew rather than return
//! the lost mapping (a truncated file then fails validation; the preload
//! opens its device once, so a program under `smclo run` stays on TCP until
//! it exits). Each connection looks at one process-wide count of lost
//! regions at every call and, once it is not zero, at its DMBs and device:
//! one of them lost resets it (the peer sees the abort flag, or its own
//! loss). A lost DMB is never
//! pooled. The loom-checked protocols are unchanged: private zeros read as
//! free table entries and empty rings.
//!
//! The program's action runs with its `SA_SIGINFO`, mask, `SA_NODEFER` and
//! `SA_RESETHAND`; a sent `SIGBUS` it ignores stays ignored, and its default
//! is reset to `SIG_DFL`, after which the access faults again or the signal
//! is raised again. The preload answers `sigaction` queries with the
//! program's action; only its `SA_RESTART` reaches the kernel, and
//! [`around_exec`] puts an ignored disposition in the kernel for an exec,
//! which carries only that one.
//!
//! The kernel kills a thread whose fault raises a `SIGBUS` it blocks, and
//! never runs the handler: worker threads commonly block every signal. So
//! once the handler is installed, a program's mask never blocks `SIGBUS` in
//! the kernel: the preload hands `sigprocmask` and `pthread_sigmask` to
//! [`program_mask`], which keeps `SIGBUS` out of the kernel's mask and in
//! the thread's view (queries answer with it), and a fault outside
//! smclo's mappings in a thread whose view blocks it is the death the
//! kernel would have dealt. A `SIGBUS` sent by a process to such a thread
//! runs the program's action at once instead of waiting until unblocked;
//! a thread starts with the view unblocked whatever its creator's was,
//! but the thread that installs the handler moves a `SIGBUS` its mask
//! blocks (inherited through exec) to its view. The masks of the
//! program's handlers (`sa_mask`) reach the kernel without `SIGBUS`
//! ([`kernel_handler_mask`]); while such a handler runs, the view has it.

use libc::{c_int, c_void, siginfo_t, sigset_t};
use std::cell::Cell;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize};
use std::sync::Mutex;

/// Slots per chunk of the region list.
const CHUNK: usize = 256;

/// Page size the region words count in (regions are page aligned), and
/// the granule of a DMB's population ([`crate::dmb::Dmb::prepare_write`]).
pub(crate) const PAGE: usize = 4096;

/// Bits of a region word for its page count; the rest hold the start page.
const COUNT_BITS: u32 = 28;

/// One registered region: `start_page << COUNT_BITS | pages`, 0 when free.
struct Slot {
    word: AtomicU64,
    /// The handler replaced the region's memory by anonymous zeros.
    lost: AtomicBool,
}

struct Chunk {
    slots: [Slot; CHUNK],
    next: AtomicPtr<Chunk>,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: Slot = Slot {
    word: AtomicU64::new(0),
    lost: AtomicBool::new(false),
};

static FIRST: Chunk = Chunk {
    slots: [FREE_SLOT; CHUNK],
    next: AtomicPtr::new(std::ptr::null_mut()),
};

/// Serialises the growth of the list (registration only; never the handler).
static GROW: Mutex<()> = Mutex::new(());

/// How many regions were lost in this process: one load tells the data
/// path that nothing was.
static LOST: AtomicU64 = AtomicU64::new(0);

fn chunks() -> impl Iterator<Item = &'static Chunk> {
    std::iter::successors(Some(&FIRST), |c| {
        // SAFETY: chunks are leaked boxes, never freed.
        unsafe { c.next.load(Acquire).as_ref() }
    })
}

fn pack(start: usize, len: usize) -> Option<u64> {
    let (page, pages) = (start / PAGE, len.div_ceil(PAGE));
    let fits = start.is_multiple_of(PAGE) && pages > 0 && pages < (1 << COUNT_BITS);
    let word = (page as u64).checked_shl(COUNT_BITS)? | pages as u64;
    (fits && word >> COUNT_BITS == page as u64).then_some(word)
}

fn unpack(word: u64) -> (usize, usize) {
    let pages = (word & ((1 << COUNT_BITS) - 1)) as usize;
    ((word >> COUNT_BITS) as usize * PAGE, pages * PAGE)
}

/// A shared mapping registered for recovery; dropping it (before the
/// mapping is unmapped) unregisters it.
#[derive(Debug)]
pub struct Region {
    slot: Option<&'static Slot>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slot({:#x})", self.word.load(Relaxed))
    }
}

impl Region {
    /// Registers `len` bytes of shared mapping at `start` (page aligned)
    /// and makes sure the handler is installed. A region that cannot be
    /// described (an address beyond 2^48) stays unregistered: the kernel's
    /// default then applies to it, as without this module.
    pub fn register(start: *mut u8, len: usize) -> Region {
        install();
        let Some(word) = pack(start as usize, len) else {
            return Region { slot: None };
        };
        Region {
            slot: Some(claim(word)),
        }
    }

    /// Whether the handler replaced this region's memory (the file under
    /// it was shrunk): what it reads now is zeros of our own.
    pub fn lost(&self) -> bool {
        LOST.load(Relaxed) != 0 && self.slot.is_some_and(|s| s.lost.load(Acquire))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            s.word.store(0, Release);
        }
    }
}

fn claim(word: u64) -> &'static Slot {
    loop {
        for s in chunks().flat_map(|c| c.slots.iter()) {
            if s.word.load(Relaxed) != 0 {
                continue;
            }
            if s.word.compare_exchange(0, word, AcqRel, Relaxed).is_ok() {
                // Not yet in use: no fault can mark it before this store.
                s.lost.store(false, Release);
                return s;
            }
        }
        grow();
    }
}

/// Appends a chunk to the list, unless another thread did meanwhile.
fn grow() {
    let _g = GROW.lock().unwrap_or_else(|p| p.into_inner());
    let last = chunks().last().expect("the first chunk");
    if last.slots.iter().any(|s| s.word.load(Relaxed) == 0) {
        return;
    }
    let c = Box::leak(Box::new(Chunk {
        slots: [FREE_SLOT; CHUNK],
        next: AtomicPtr::new(std::ptr::null_mut()),
    }));
    last.next.store(c, Release);
}

/// Recovers from `SIGBUS` `info` if it is a fault inside a registered
/// region: anonymous zero memory over the region, marked lost. Returns
/// whether it did (then the handler returns and the access runs again).
/// Async-signal-safe: atomic loads and stores and one `mmap`. For a
/// program of the native or C API whose own `SIGBUS` handler displaced
/// smclo's: call it first, and return when it says true.
pub fn recover(info: &siginfo_t) -> bool {
    if info.si_code <= 0 {
        // Sent by a process (kill, sigqueue): no fault to recover.
        return false;
    }
    // SAFETY: si_addr is valid for a kernel-generated SIGBUS.
    let addr = unsafe { info.si_addr() } as usize;
    for s in chunks().flat_map(|c| c.slots.iter()) {
        let w = s.word.load(Acquire);
        let (start, len) = unpack(w);
        if w == 0 || !(start..start + len).contains(&addr) {
            continue;
        }
        // SAFETY: the region is a mapping of ours that its owner keeps
        // mapped while registered, and the faulting thread is using it, so
        // it cannot be unregistered and unmapped meanwhile; MAP_FIXED
        // replaces exactly its pages with private zeros.
        let m = unsafe {
            libc::mmap(
                start as *mut c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return false;
        }
        s.lost.store(true, Release);
        LOST.fetch_add(1, Relaxed);
        return true;
    }
    false
}

/// Whether any region of this process was lost (one load).
pub fn any_lost() -> bool {
    LOST.load(Relaxed) != 0
}

// ---------------------------------------------------------------------------
// The handler and the program's action behind it.

/// `sigaction` as the core calls it: the preload gives the real one
/// ([`use_sigaction`]), since its own interposes the program's.
type SigactionFn =
    unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;

static SIGACTION: AtomicUsize = AtomicUsize::new(0);

/// The program's `SIGBUS` action: handler (`SIG_DFL`, `SIG_IGN` or a
/// function), flags, and mask (signals 1..=64).
static PROG_HANDLER: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PROG_FLAGS: AtomicI32 = AtomicI32::new(0);
static PROG_MASK: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether the program blocked `SIGBUS` in this thread (its view: the
    /// kernel's mask does not have it, see [`program_mask`]).
    static VIEW_BLOCKED: Cell<bool> = const { Cell::new(false) };
}

/// [`install`]'s progress: not yet, under way, done.
static STATE: AtomicU8 = AtomicU8::new(0);
const NOT_INSTALLED: u8 = 0;
const INSTALLING: u8 = 1;
const INSTALLED: u8 = 2;

/// Makes the core call `f` for its own `sigaction` calls (the preload
/// passes the real libc function: its interposed one hands `SIGBUS`
/// actions to [`program_action`]). Before [`install`].
pub fn use_sigaction(f: SigactionFn) {
    SIGACTION.store(f as usize, Release);
}

fn real_sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    let f = SIGACTION.load(Acquire);
    if f == 0 {
        // SAFETY: libc's sigaction with the caller's valid arguments.
        return unsafe { libc::sigaction(sig, act, old) };
    }
    // SAFETY: `f` was stored from a `SigactionFn`.
    let f: SigactionFn = unsafe { std::mem::transmute(f) };
    // SAFETY: as above.
    unsafe { f(sig, act, old) }
}

fn handler_addr() -> libc::sighandler_t {
    on_sigbus as extern "C" fn(c_int, *mut siginfo_t, *mut c_void) as libc::sighandler_t
}

/// Installs the `SIGBUS` handler once per process, keeping the action it
/// replaces as the program's. Done when a shared file is first mapped, or
/// by the preload at load, before the program can install its own.
pub fn install() {
    if STATE.load(Acquire) == INSTALLED
        || STATE
            .compare_exchange(NOT_INSTALLED, INSTALLING, Acquire, Acquire)
            .is_err()
    {
        return;
    }
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    if real_sigaction(libc::SIGBUS, std::ptr::null(), &mut old) == 0
        && old.sa_sigaction != handler_addr()
    {
        keep_program_action(&old);
    }
    if kernel_action() == 0 {
        unblock_inherited();
        STATE.store(INSTALLED, Release);
    } else {
        STATE.store(NOT_INSTALLED, Release);
    }
}

/// A mask inherited through exec (or set before the handler) may block
/// `SIGBUS` in the installing thread, whose threads would inherit it:
/// it moves to the thread's view ([`program_mask`]). The raw system call,
/// as libc's may be the preload's own.
fn unblock_inherited() {
    // SAFETY: all-zero sigsets are valid storage, initialised below.
    let (mut bus, mut old): (sigset_t, sigset_t) = unsafe { std::mem::zeroed() };
    // SAFETY: a local set.
    unsafe {
        libc::sigemptyset(&mut bus);
        libc::sigaddset(&mut bus, libc::SIGBUS);
    }
    let args = [
        libc::SIG_UNBLOCK as libc::c_long,
        &bus as *const sigset_t as libc::c_long,
        &mut old as *mut sigset_t as libc::c_long,
        8, // the kernel's sigset size
    ];
    // SAFETY: rt_sigprocmask with valid sets that outlive the call.
    let r = unsafe { crate::chan_sys::syscall(libc::SYS_rt_sigprocmask, &args) };
    // SAFETY: `old` was filled by the call when it succeeded.
    if r == 0 && unsafe { libc::sigismember(&old, libc::SIGBUS) } == 1 {
        VIEW_BLOCKED.with(|v| v.set(true));
    }
}

/// Gives the kernel our handler, with the program's `SA_RESTART` (it
/// decides what a sent `SIGBUS` does to the program's system calls).
fn kernel_action() -> c_int {
    // SAFETY: an all-zero sigaction is a valid start; the mask is emptied.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler_addr();
    act.sa_flags =
        libc::SA_SIGINFO | libc::SA_ONSTACK | (PROG_FLAGS.load(Relaxed) & libc::SA_RESTART);
    // SAFETY: initialises the action's own mask.
    unsafe { libc::sigemptyset(&mut act.sa_mask) };
    real_sigaction(libc::SIGBUS, &act, std::ptr::null_mut())
}

fn keep_program_action(a: &libc::sigaction) {
    let mut mask = 0u64;
    for sig in 1..=64 {
        // SAFETY: a valid sigset of the caller's action.
        if unsafe { libc::sigismember(&a.sa_mask, sig) } == 1 {
            mask |= 1 << (sig - 1);
        }
    }
    PROG_MASK.store(mask, Relaxed);
    PROG_FLAGS.store(a.sa_flags, Relaxed);
    PROG_HANDLER.store(a.sa_sigaction, Release);
}

fn program_sigaction(old: &mut libc::sigaction) {
    // SAFETY: an all-zero sigaction is a valid start; the mask is emptied.
    *old = unsafe { std::mem::zeroed() };
    old.sa_sigaction = PROG_HANDLER.load(Acquire);
    old.sa_flags = PROG_FLAGS.load(Relaxed);
    let mask = PROG_MASK.load(Relaxed);
    // SAFETY: initialises and fills the action's own mask.
    unsafe {
        libc::sigemptyset(&mut old.sa_mask);
        for sig in 1..=64 {
            if mask & (1 << (sig - 1)) != 0 {
                libc::sigaddset(&mut old.sa_mask, sig);
            }
        }
    }
}

/// The program's `sigaction(SIGBUS, act, old)` once the handler is
/// installed: `act` becomes the program's action behind the handler and
/// `old` gets the previous one, as the kernel would; `None` when the
/// handler is not installed (the caller then makes the real call).
/// Async-signal-safe.
pub fn program_action(
    act: Option<&libc::sigaction>,
    old: Option<&mut libc::sigaction>,
) -> Option<c_int> {
    if STATE.load(Acquire) != INSTALLED {
        return None;
    }
    if let Some(old) = old {
        program_sigaction(old);
    }
    if let Some(a) = act {
        let restart = (a.sa_flags ^ PROG_FLAGS.load(Relaxed)) & libc::SA_RESTART != 0;
        keep_program_action(a);
        if restart {
            return Some(kernel_action());
        }
    }
    Some(0)
}

/// The program's `sigprocmask`/`pthread_sigmask(how, set, old)`, made by
/// `real` (the libc function): once the handler is installed, `SIGBUS`
/// is kept out of the set the kernel gets when it would block it, and in
/// the thread's view instead, which `old` reports. Returns what `real`
/// does. Async-signal-safe, as `real`.
///
/// # Safety
/// `set` and `old` are null or valid, as for `sigprocmask(2)`.
pub unsafe fn program_mask(
    how: c_int,
    set: *const sigset_t,
    old: *mut sigset_t,
    real: impl FnOnce(c_int, *const sigset_t, *mut sigset_t) -> c_int,
) -> c_int {
    let was = VIEW_BLOCKED.with(Cell::get);
    // SAFETY: the caller's set, when not null.
    let r = match (unsafe { set.as_ref() }).filter(|_| STATE.load(Acquire) == INSTALLED) {
        None => real(how, set, old),
        Some(s) => {
            // SAFETY: an initialised set.
            let bus = unsafe { libc::sigismember(s, libc::SIGBUS) } == 1;
            let mut kernel = *s;
            if how != libc::SIG_UNBLOCK {
                // SAFETY: a copy of an initialised set.
                unsafe { libc::sigdelset(&mut kernel, libc::SIGBUS) };
            }
            let r = real(how, &kernel, old);
            if r == 0 {
                let now = match how {
                    libc::SIG_BLOCK => was || bus,
                    libc::SIG_UNBLOCK => was && !bus,
                    _ => bus,
                };
                VIEW_BLOCKED.with(|v| v.set(now));
            }
            r
        }
    };
    // SAFETY: the caller's storage, filled by the call.
    if let (0, true, Some(o)) = (r, was, unsafe { old.as_mut() }) {
        // SAFETY: a set the call initialised.
        unsafe { libc::sigaddset(o, libc::SIGBUS) };
    }
    r
}

/// The mask of a program's handler (`sa_mask`) as the kernel gets it: once
/// the handler is installed, without `SIGBUS`, which would kill the
/// thread on a fault in a shrunk shared file while the handler runs.
/// Returns whether the program's mask had it: the thread's view has it
/// while the handler runs ([`with_handler_view`]) and queries answer with
/// it. Async-signal-safe.
pub fn kernel_handler_mask(mask: &mut sigset_t) -> bool {
    // SAFETY: the caller's initialised set.
    let bus = unsafe { libc::sigismember(mask, libc::SIGBUS) } == 1;
    if bus && STATE.load(Acquire) == INSTALLED {
        // SAFETY: as above.
        unsafe { libc::sigdelset(mask, libc::SIGBUS) };
        return true;
    }
    false
}

/// Runs a program's handler `f`, whose mask had `SIGBUS` when `bus`
/// ([`kernel_handler_mask`]), with the thread's view blocking it as the
/// kernel's mask would have; the view is as before when `f` returns.
/// Async-signal-safe.
pub fn with_handler_view<R>(bus: bool, f: impl FnOnce() -> R) -> R {
    if !bus {
        return f();
    }
    let was = VIEW_BLOCKED.with(|v| v.replace(true));
    let r = f();
    VIEW_BLOCKED.with(|v| v.set(was));
    r
}

/// Runs `exec` (an exec call, which returns only when it failed) with the
/// program's `SIGBUS` disposition in the kernel if it ignores the signal:
/// exec carries an ignored disposition into the new image, and a handled
/// one as the default. Ours is back when the exec failed.
pub fn around_exec(exec: impl FnOnce() -> c_int) -> c_int {
    if STATE.load(Acquire) != INSTALLED || PROG_HANDLER.load(Acquire) != libc::SIG_IGN {
        return exec();
    }
    // SAFETY: an all-zero sigaction is a valid start.
    let mut ign: libc::sigaction = unsafe { std::mem::zeroed() };
    ign.sa_sigaction = libc::SIG_IGN;
    real_sigaction(libc::SIGBUS, &ign, std::ptr::null_mut());
    let r = exec();
    // The caller reports exec's errno.
    crate::errno::kept(kernel_action);
    r
}

/// What the kernel runs for `SIGBUS`.
extern "C" fn on_sigbus(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
    crate::errno::kept(|| {
        // SAFETY: the kernel's siginfo for this signal, when not null.
        if !unsafe { info.as_ref() }.is_some_and(recover) {
            run_program_action(sig, info, ctx);
        }
    });
}

/// Runs the program's action for a `SIGBUS` that is not ours to recover,
/// as the kernel would have: its handler with its mask (and reset first
/// with `SA_RESETHAND`), or the default (death: for a fault, by the access
/// that runs again; for a sent signal, by sending it again, delivered as
/// soon as this handler returns), or nothing for an ignored sent one.
fn run_program_action(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
    let h = PROG_HANDLER.load(Acquire);
    // SAFETY: the kernel's siginfo, when not null.
    let sent = unsafe { info.as_ref() }.is_none_or(|i| i.si_code <= 0);
    if h == libc::SIG_IGN && sent {
        return;
    }
    // A fault the thread blocks kills it, as the kernel's would have.
    let blocked_fault = !sent && VIEW_BLOCKED.with(Cell::get);
    if h == libc::SIG_DFL || h == libc::SIG_IGN || blocked_fault {
        // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        real_sigaction(sig, &dfl, std::ptr::null_mut());
        if sent {
            // SAFETY: raise is async-signal-safe.
            unsafe { libc::raise(sig) };
        }
        return;
    }
    let flags = PROG_FLAGS.load(Relaxed);
    if flags & libc::SA_RESETHAND != 0 {
        PROG_HANDLER.store(libc::SIG_DFL, Release);
    }
    let _running = crate::signal::Handler::runs(sig);
    let old = block_program_mask(sig, flags);
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the program installed `h` as an SA_SIGINFO handler.
        let f: extern "C" fn(c_int, *mut siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the program installed `h` as a one-argument handler.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
    // SAFETY: puts back the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
}

/// Blocks the program's action's mask (and `sig` itself, unless
/// `SA_NODEFER`) for its handler, as the kernel does; returns the mask to
/// put back.
fn block_program_mask(sig: c_int, flags: c_int) -> libc::sigset_t {
    let mask = PROG_MASK.load(Relaxed);
    // SAFETY: all-zero sigsets are valid storage, initialised below.
    let (mut set, mut old): (libc::sigset_t, libc::sigset_t) = unsafe { std::mem::zeroed() };
    // SAFETY: local sets and this thread's mask; all async-signal-safe.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in 1..=64 {
            if mask & (1 << (s - 1)) != 0 {
                libc::sigaddset(&mut set, s);
            }
        }
        if flags & libc::SA_NODEFER != 0 {
            libc::pthread_sigmask(
                libc::SIG_UNBLOCK,
                &{
                    let mut one: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut one);
                    libc::sigaddset(&mut one, sig);
                    one
                },
                std::ptr::null_mut(),
            );
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
    }
    old
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// `pages` pages of a new file in /dev/shm, mapped shared, and the file.
    fn shared_file(pages: usize) -> (*mut u8, std::fs::File) {
        let path = format!("/dev/shm/smclo-fault-test-{}-{}", std::process::id(), pages);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f.set_len((pages * PAGE) as u64).unwrap();
        // SAFETY: a fresh shared mapping of the whole file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (p.cast(), f)
    }

    #[test]
    fn a_fault_in_a_registered_region_reads_zeros_and_marks_it_lost() {
        let (p, f) = shared_file(3);
        let r = Region::register(p, 3 * PAGE);
        // SAFETY: inside the mapping; volatile, so the accesses happen.
        unsafe { p.add(PAGE).write_volatile(7) };
        assert!(!r.lost());
        f.set_len(0).unwrap();
        // SAFETY: as above; the page is past the file's end now (SIGBUS).
        let (a, b) = unsafe { (p.add(PAGE).read_volatile(), p.read_volatile()) };
        assert_eq!((a, b), (0, 0));
        assert!(r.lost() && any_lost());
        // SAFETY: the region's memory is private zeros now, still ours.
        unsafe { p.add(2 * PAGE).write_volatile(1) };
        drop(r);
        // SAFETY: the mapping (now anonymous) is ours.
        unsafe { libc::munmap(p.cast(), 3 * PAGE) };
    }

    static OWN_HITS: AtomicUsize = AtomicUsize::new(0);

    /// A program's handler that repairs its own fault: zeros over the page.
    extern "C" fn own_handler(_sig: c_int, info: *mut siginfo_t, _ctx: *mut c_void) {
        OWN_HITS.fetch_add(1, Relaxed);
        // SAFETY: the kernel's siginfo of a fault; the page is the test's.
        unsafe {
            let page = ((*info).si_addr() as usize) & !(PAGE - 1);
            libc::mmap(
                page as *mut c_void,
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            );
        }
    }

    #[test]
    fn a_fault_outside_the_regions_runs_the_programs_handler() {
        install();
        // SAFETY: an all-zero sigaction is a valid start.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction =
            own_handler as extern "C" fn(c_int, *mut siginfo_t, *mut c_void) as usize;
        act.sa_flags = libc::SA_SIGINFO;
        // SAFETY: as above.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        assert_eq!(program_action(Some(&act), Some(&mut old)), Some(0));
        let (p, f) = shared_file(1);
        f.set_len(0).unwrap();
        // SAFETY: the test's mapping, past the file's end: the program's
        // handler puts zeros there.
        assert_eq!(unsafe { p.read_volatile() }, 0);
        assert_eq!(OWN_HITS.load(Relaxed), 1);
        // SAFETY: as above.
        let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
        assert_eq!(program_action(None, Some(&mut now)), Some(0));
        assert_eq!(now.sa_sigaction, act.sa_sigaction);
        assert_eq!(program_action(Some(&old), None), Some(0));
        // SAFETY: the test's mapping.
        unsafe { libc::munmap(p.cast(), PAGE) };
    }

    #[test]
    fn region_words_hold_start_and_length() {
        let w = pack(0x7f12_3456_7000, 2 * 1024 * 1024 + PAGE).unwrap();
        assert_eq!(unpack(w), (0x7f12_3456_7000, 2 * 1024 * 1024 + PAGE));
        assert_eq!(pack(0x1001, PAGE), None);
        assert_eq!(pack(1 << 60, PAGE), None);
    }
}
