//! The wait for another thread of the process to get through a few
//! instructions without a futex to sleep on: a lock word held across a
//! handful of calls (the preload's descriptor table, [`crate::vault`]),
//! a descriptor number between its `close` and its unmarking.
//!
//! `sched_yield` alone would not do: a real-time (`SCHED_FIFO`,
//! `SCHED_RR`) waiter yields only to threads of its own priority or
//! higher, so an ordinary thread preempted on the waiter's CPU halfway
//! through runs again only when the kernel throttles real-time threads
//! (after 950 ms of each second by default; never when throttling is
//! off), and the waiter spins that long. So [`Backoff`] yields a few times
//! (the usual wait, a preemption on another CPU) and then sleeps in
//! growing naps, which lets any thread run. Async-signal-safe
//! (`sched_yield`, `nanosleep`), and neither call is one the preload
//! interposes.

use std::time::Duration;

/// Yields this many times before the first nap.
const YIELDS: u32 = 64;

/// The first nap; each next one is twice as long, up to [`NAP_MAX`].
const NAP_MIN: Duration = Duration::from_micros(16);

/// The longest nap.
const NAP_MAX: Duration = Duration::from_millis(1);

/// One wait's steps (see the module documentation).
#[derive(Debug, Default)]
pub struct Backoff(u32);

impl Backoff {
    /// A wait that has not waited yet.
    pub const fn new() -> Backoff {
        Backoff(0)
    }

    /// One step of the wait: a yield, or once [`YIELDS`] of them passed,
    /// a nap.
    pub fn snooze(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 <= YIELDS {
            std::thread::yield_now();
            return;
        }
        let doublings = (self.0 - YIELDS - 1).min(16);
        std::thread::sleep((NAP_MIN * (1 << doublings)).min(NAP_MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::Backoff;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Pins the calling thread to CPU 0.
    fn pin_cpu0() {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and
        // sched_setaffinity only touch it and this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set),
                0
            );
        }
    }

    /// A `SCHED_FIFO` waiter and the ordinary thread it waits for, on one
    /// CPU: the holder runs, and the wait ends soon after the holder's
    /// 50 ms. A waiter that only yielded kept the CPU until the kernel
    /// throttled real-time threads (about 950 ms).
    #[test]
    fn a_real_time_waiter_lets_an_ordinary_holder_run() {
        let held = Arc::new(AtomicBool::new(true));
        let h = held.clone();
        let holder = std::thread::spawn(move || {
            pin_cpu0();
            std::thread::sleep(Duration::from_millis(50));
            h.store(false, Ordering::Release);
        });
        let waited = std::thread::spawn(move || {
            pin_cpu0();
            let p = libc::sched_param { sched_priority: 1 };
            // SAFETY: sets this thread's policy; `p` is a valid parameter.
            let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) };
            assert_eq!(r, 0, "SCHED_FIFO (the tests run as root)");
            let t0 = Instant::now();
            let mut b = Backoff::new();
            while held.load(Ordering::Acquire) {
                b.snooze();
            }
            t0.elapsed()
        })
        .join()
        .unwrap();
        holder.join().unwrap();
        assert!(
            waited < Duration::from_millis(400),
            "the holder ran after {waited:?}"
        );
    }
}
