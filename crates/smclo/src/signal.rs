//! Signal handlers that ran in this thread, for the waits that spin.
//!
//! A wait that may sleep in the kernel first busy-polls the rings. Had it
//! slept, a signal handler running meanwhile would have ended the sleep
//! (`EINTR`, or a restart, signal(7)); a spin cannot see the handler run,
//! and a sleep begun after it is not interrupted by it. So every handler
//! says it ran ([`handler_ran`]: the preload wraps each handler the
//! program installs in a trampoline that calls it; a program of the native
//! or C API calls it from its own handlers), and each wait keeps a
//! [`Watch`] from its start: a spin ends as soon as the watch sees a
//! handler, and the wait then does not sleep but fails with `EINTR`
//! ([`Watch::check`]) as the kernel would have. The look is one atomic
//! load of thread-local memory: no system call per spin.
//!
//! A wait begins when the program's call does, not when the spin does: a
//! handler that runs between the two (an adapter's own work comes first,
//! and the preload delays a signal that comes in one of its sections to
//! the section's end) came during the call, and the kernel would have
//! ended the call for it. So an adapter wraps each call that may wait in
//! a [`Call`], from the call's first instruction; the watches inside it
//! count from there.

use std::cell::Cell;
use std::io;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

/// What this thread's calls and waits know of its signal handlers: one
/// thread-local (a preloaded library reaches each through
/// `__tls_get_addr`, so a call's start and end touch it once each).
/// Constant-initialised and without a destructor: a plain TLS slot, there
/// from the thread's start, which a signal handler may touch.
struct Thread {
    /// Signals (bit `n - 1` for signal `n`) whose handler ran in this
    /// thread, since the innermost [`Call`] began (or [`Watch`], outside
    /// a call).
    ran: AtomicU64,
    /// Whether the thread is in a [`Call`] (and not in a handler that
    /// interrupted it): its watches count from the call's start.
    in_call: Cell<bool>,
}

thread_local! {
    static THREAD: Thread = const {
        Thread {
            ran: AtomicU64::new(0),
            in_call: Cell::new(false),
        }
    };
}

/// This thread's [`Thread`], reached again without a lookup by a value
/// that stays on the thread ([`Call`], [`Watch`]): a preloaded library
/// looks each thread-local up through `__tls_get_addr`.
#[derive(Debug, Clone, Copy)]
struct Here(*const Thread);

impl Here {
    fn now() -> Here {
        THREAD.with(|t| Here(t))
    }

    fn get(&self) -> &Thread {
        // SAFETY: `THREAD` is constant-initialised and has no destructor,
        // so its storage is valid for the whole life of the thread that
        // took this pointer; a raw pointer makes `Here`, and every value
        // that holds one, neither `Send` nor `Sync`, so only that thread,
        // while it runs, reads through it.
        unsafe { &*self.0 }
    }
}

/// The bit of signal `sig` (signals above 64, which Linux does not have,
/// share the last one).
fn bit(sig: libc::c_int) -> u64 {
    1 << (sig.clamp(1, 64) - 1)
}

/// Notes that a handler for `sig` runs in this thread: a wait of this
/// thread that is spinning stops and fails with `EINTR`. Async-signal-safe
/// (one atomic operation on this thread's memory); call it from every
/// signal handler a program of the native or C API installs, before or
/// after its own work.
pub fn handler_ran(sig: libc::c_int) {
    THREAD.with(|t| t.ran.fetch_or(bit(sig), Ordering::Relaxed));
}

/// A call of the program that may wait, from its start: the handlers that
/// run in this thread from here on interrupt the call's waits
/// ([`Watch`]s begun inside it count from here). Not `Send`: it is the
/// thread's.
#[derive(Debug)]
pub struct Call {
    /// What `ran` ([`Thread`]) held when the call began, given back at its end (as
    /// [`Watch::before`]).
    before: u64,
    /// Whether the thread was in a call already (given back at the end;
    /// a call a handler interrupted does not count: [`Handler`]).
    outer: bool,
    here: Here,
}

impl Call {
    /// The program's call begins. One call of the adapter's own inside
    /// it is a call of its own too (its watches count from its start):
    /// the adapter passes the outer one down where that matters.
    pub fn begin() -> Call {
        let here = Here::now();
        let t = here.get();
        Call {
            before: t.ran.swap(0, Ordering::Relaxed),
            outer: t.in_call.replace(true),
            here,
        }
    }

    /// Whether a handler ran in this thread since the call began (or
    /// last started over): before a sleep the call does not watch with a
    /// [`Watch`].
    pub fn interrupted(&self) -> bool {
        self.here.get().ran.load(Ordering::Relaxed) != 0
    }

    /// The call starts over (a handler that does not interrupt it ran,
    /// `SA_RESTART`): the handlers that ran so far no longer end it, as
    /// for the kernel's restarted call.
    pub fn restart(&self) {
        self.here.get().ran.store(0, Ordering::Relaxed);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let t = self.here.get();
        t.in_call.set(self.outer);
        t.ran.fetch_or(self.before, Ordering::Relaxed);
    }
}

/// A handler the program installed runs in this thread (an adapter's
/// wrapper holds this across it): it counts for the waits in progress
/// ([`handler_ran`]), and the calls the handler makes are its own, not
/// part of the call it interrupted. A handler that never returns
/// (`siglongjmp`) leaves the thread outside any call, as it is.
#[derive(Debug)]
pub struct Handler {
    in_call: bool,
    _thread: PhantomData<*const ()>,
}

impl Handler {
    /// The handler for `sig` starts.
    pub fn runs(sig: libc::c_int) -> Handler {
        handler_ran(sig);
        Handler {
            in_call: THREAD.with(|t| t.in_call.replace(false)),
            _thread: PhantomData,
        }
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        THREAD.with(|t| t.in_call.set(self.in_call));
    }
}

/// The signals that end a wait: what handlers ran in this thread since it
/// began ([`Watch::begin`]), leaving out those the wait's signal mask
/// blocks.
#[derive(Debug)]
pub struct Watch<'m> {
    /// What `ran` ([`Thread`]) held when the watch began: given back at its end, so
    /// that a wait inside a signal handler does not hide the handler from
    /// the wait it interrupted.
    before: u64,
    /// The wait's signal mask: the kernel would not have let the signals
    /// it blocks interrupt the wait, so their handlers (which ran now, and
    /// not after the wait, only because the spin runs with the thread's
    /// own mask) do not.
    mask: Option<&'m libc::sigset_t>,
    here: Here,
}

impl<'m> Watch<'m> {
    /// Begins watching for handlers in this thread: from now, or from the
    /// start of the [`Call`] the thread is in; `mask`: the wait's signal
    /// mask, if it has one (`ppoll`, `pselect`, `epoll_pwait`).
    pub fn begin(mask: Option<&'m libc::sigset_t>) -> Watch<'m> {
        let here = Here::now();
        let t = here.get();
        let before = match t.in_call.get() {
            true => 0,
            false => t.ran.swap(0, Ordering::Relaxed),
        };
        Watch { before, mask, here }
    }

    /// Whether a handler that interrupts this wait ran since it began.
    pub fn interrupted(&self) -> bool {
        let ran = self.here.get().ran.load(Ordering::Relaxed);
        // The mask is looked at only once a handler ran: rarely.
        ran != 0 && ran & !self.mask.map_or(0, blocked) != 0
    }

    /// Before a sleep: `EINTR` if a handler that interrupts this wait ran
    /// since it began.
    pub fn check(&self) -> io::Result<()> {
        if self.interrupted() {
            return Err(io::Error::from_raw_os_error(libc::EINTR));
        }
        Ok(())
    }
}

/// The signals `mask` blocks, as bits.
fn blocked(mask: &libc::sigset_t) -> u64 {
    (1..=64).fold(0, |b, sig| {
        // SAFETY: `mask` is an initialised signal set.
        match unsafe { libc::sigismember(mask, sig) } {
            1 => b | bit(sig),
            _ => b,
        }
    })
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        self.here.get().ran.fetch_or(self.before, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{handler_ran, Call, Handler, Watch, THREAD};
    use std::sync::atomic::Ordering;

    #[test]
    fn a_handler_since_the_start_interrupts() {
        handler_ran(libc::SIGUSR1);
        let w = Watch::begin(None);
        assert!(!w.interrupted(), "a handler before the wait does not count");
        handler_ran(libc::SIGUSR1);
        assert!(w.interrupted());
        assert!(w.check().is_err());
    }

    #[test]
    fn signals_the_mask_blocks_do_not_interrupt() {
        // SAFETY: an all-zero sigset_t is valid storage for sigemptyset.
        let mut m: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: initialises and fills a local set.
        unsafe {
            libc::sigemptyset(&mut m);
            libc::sigaddset(&mut m, libc::SIGALRM);
        }
        let w = Watch::begin(Some(&m));
        handler_ran(libc::SIGALRM);
        assert!(!w.interrupted());
        handler_ran(libc::SIGUSR2);
        assert!(w.interrupted());
    }

    /// A wait inside a handler (which begins and ends its own watch) does
    /// not hide that handler from the wait it interrupted.
    #[test]
    fn a_nested_wait_leaves_the_outer_one_interrupted() {
        let outer = Watch::begin(None);
        handler_ran(libc::SIGINT);
        {
            let inner = Watch::begin(None);
            assert!(!inner.interrupted());
        }
        assert!(outer.interrupted());
    }

    /// A handler that ran in the call before its wait began (in the
    /// adapter's own work) interrupts the wait; one before the call does
    /// not, and a restarted call forgets those that ran so far.
    #[test]
    fn a_watch_in_a_call_counts_from_the_call() {
        handler_ran(libc::SIGUSR1);
        let call = Call::begin();
        handler_ran(libc::SIGALRM);
        let w = Watch::begin(None);
        assert!(w.interrupted(), "the handler came during the call");
        drop(w);
        call.restart();
        let w = Watch::begin(None);
        assert!(!w.interrupted(), "the restarted call starts afresh");
        drop(w);
        drop(call);
        let w = Watch::begin(None);
        assert!(
            !w.interrupted(),
            "outside a call, a watch counts from its start"
        );
    }

    /// A call begun inside another counts from its own start; the outer
    /// one still sees what ran before, and a handler that ran in the inner.
    #[test]
    fn a_call_inside_a_call_counts_from_its_start() {
        let call = Call::begin();
        handler_ran(libc::SIGALRM);
        let inner = Call::begin();
        assert!(!Watch::begin(None).interrupted());
        assert!(!inner.interrupted());
        handler_ran(libc::SIGUSR1);
        assert!(inner.interrupted());
        drop(inner);
        assert!(Watch::begin(None).interrupted());
        assert!(call.interrupted());
        drop(call);
    }

    /// A call that a handler left without ending it (`siglongjmp`) does
    /// not make the thread's later calls see old handlers.
    #[test]
    fn a_call_left_by_a_jump_does_not_stick() {
        let left = Call::begin();
        handler_ran(libc::SIGUSR2);
        std::mem::forget(left);
        let next = Call::begin();
        assert!(!Watch::begin(None).interrupted());
        drop(next);
        THREAD.with(|t| {
            t.in_call.set(false);
            t.ran.store(0, Ordering::Relaxed);
        });
    }

    /// A handler's own calls are not part of the call it interrupted: a
    /// wait it makes outside a call of its own counts from its start, and
    /// the interrupted call's wait still sees the handler.
    #[test]
    fn a_handler_in_a_call_waits_on_its_own() {
        let call = Call::begin();
        let outer = Watch::begin(None);
        {
            let _h = Handler::runs(libc::SIGINT);
            let inner = Watch::begin(None);
            assert!(
                !inner.interrupted(),
                "the handler's wait counts from its start"
            );
            let nested = Call::begin();
            let w = Watch::begin(None);
            assert!(!w.interrupted());
            drop(w);
            drop(nested);
        }
        assert!(outer.interrupted());
        drop(outer);
        drop(call);
    }
}
