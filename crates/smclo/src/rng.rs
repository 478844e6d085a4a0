//! Per-process unique random numbers for tokens, nonces, marks and link ids,
//! with one `getrandom(2)` per process instead of several per connection.
//!
//! A 64-bit counter, seeded from `getrandom` and advanced by an odd constant
//! (a full-period Weyl sequence), goes through the SplitMix64 finaliser, a
//! bijection: values never repeat within a process (until 2^64 draws), and
//! processes start from independent random points. The values are
//! identifiers, not secrets: every process of the user can list the device
//! directory anyway. A fork child reseeds (see [`crate::owner`]'s fork
//! hook), so parent and child never draw the same sequence.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static STATE: AtomicU64 = AtomicU64::new(0);
static SEEDED: AtomicBool = AtomicBool::new(false);
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// Forgets the seed (called in a fork child; async-signal safe).
pub(crate) fn forget_seed() {
    SEEDED.store(false, Ordering::Relaxed);
}

fn seed() {
    crate::owner::ensure_fork_hook();
    let mut v = 0u64;
    // SAFETY: the buffer is the 8 bytes of `v`, valid for writes.
    let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut libc::c_void, 8, 0) };
    if n != 8 {
        // Only without a working getrandom: clock and pid still differ
        // between processes.
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: ts is a valid timespec to write into.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        v = (ts.tv_sec as u64).wrapping_mul(1_000_000_007)
            ^ ts.tv_nsec as u64
            ^ (std::process::id() as u64) << 40;
    }
    STATE.store(v, Ordering::Relaxed);
    SEEDED.store(true, Ordering::Release);
}

/// The next value; never 0.
pub(crate) fn next_u64() -> u64 {
    loop {
        if !SEEDED.load(Ordering::Acquire) {
            seed();
        }
        let mut z = STATE
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        if z != 0 {
            return z;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn distinct_and_nonzero() {
        let mut v: Vec<u64> = (0..10_000).map(|_| super::next_u64()).collect();
        assert!(v.iter().all(|&x| x != 0));
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), 10_000);
    }
}
