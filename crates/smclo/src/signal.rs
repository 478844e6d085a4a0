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

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    /// Signals (bit `n - 1` for signal `n`) whose handler ran in this
    /// thread, since the innermost [`Watch`] began. Constant-initialised
    /// and without a destructor: a plain TLS slot, there from the thread's
    /// start, which a signal handler may touch.
    static RAN: AtomicU64 = const { AtomicU64::new(0) };
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
    RAN.with(|r| r.fetch_or(bit(sig), Ordering::Relaxed));
}

/// The signals that end a wait: what handlers ran in this thread since it
/// began ([`Watch::begin`]), leaving out those the wait's signal mask
/// blocks.
#[derive(Debug)]
pub struct Watch<'m> {
    /// What [`RAN`] held when the watch began: given back at its end, so
    /// that a wait inside a signal handler does not hide the handler from
    /// the wait it interrupted.
    before: u64,
    /// The wait's signal mask: the kernel would not have let the signals
    /// it blocks interrupt the wait, so their handlers (which ran now, and
    /// not after the wait, only because the spin runs with the thread's
    /// own mask) do not.
    mask: Option<&'m libc::sigset_t>,
}

impl<'m> Watch<'m> {
    /// Begins watching for handlers in this thread; `mask`: the wait's
    /// signal mask, if it has one (`ppoll`, `pselect`, `epoll_pwait`).
    pub fn begin(mask: Option<&'m libc::sigset_t>) -> Watch<'m> {
        Watch {
            before: RAN.with(|r| r.swap(0, Ordering::Relaxed)),
            mask,
        }
    }

    /// Whether a handler that interrupts this wait ran since it began.
    pub fn interrupted(&self) -> bool {
        let ran = RAN.with(|r| r.load(Ordering::Relaxed));
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
        RAN.with(|r| r.fetch_or(self.before, Ordering::Relaxed));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{handler_ran, Watch};

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
}
