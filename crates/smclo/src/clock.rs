//! The one clock every timed decision of the core and the preload reads:
//! `CLOCK_MONOTONIC` in nanoseconds, as a `u64` that fits in an atomic and
//! that all processes of the host share. No epoch is kept, so nothing is
//! made on first use (a signal handler may read it at any time), and
//! reading it is the vDSO call and one multiplication, where
//! `Instant::elapsed` since an epoch also normalises two `timespec`s.

/// `CLOCK_MONOTONIC` in nanoseconds; never 0, so that 0 can mean "never".
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into; CLOCK_MONOTONIC
    // exists on every Linux, so the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64).max(1)
}

/// Nanoseconds from `since` (a [`now_ns`] reading) to now.
#[inline]
pub fn since_ns(since: u64) -> u64 {
    now_ns().saturating_sub(since)
}

/// A `Duration` in nanoseconds, saturating.
#[inline]
pub fn ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_moves_forward_and_measures_a_sleep() {
        let a = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let waited = since_ns(a);
        assert!(a > 0);
        assert!((2_000_000..2_000_000_000).contains(&waited), "{waited} ns");
    }
}
