//! The calling thread's `errno`: set where a raw system call failed, and
//! kept across work whose own failures are not the caller's (a signal
//! handler, a clean-up after a failed `exec`, a hint to the kernel under a
//! `write` that succeeds on its own). `get` and `set` are
//! async-signal-safe, and `kept` is as safe as the work it runs.

use libc::c_int;

/// This thread's `errno`.
#[inline]
pub fn get() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot, valid for
    // the thread's life.
    unsafe { *libc::__errno_location() }
}

/// Sets this thread's `errno`.
#[inline]
pub fn set(e: c_int) {
    // SAFETY: as in `get`.
    unsafe { *libc::__errno_location() = e };
}

/// Runs `f` and leaves `errno` as it was before.
#[inline]
pub fn kept<T>(f: impl FnOnce() -> T) -> T {
    let e = get();
    let r = f();
    set(e);
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn kept_restores_what_the_work_changed() {
        super::set(libc::EAGAIN);
        let r = super::kept(|| {
            super::set(libc::EBADF);
            7
        });
        assert_eq!(r, 7);
        assert_eq!(super::get(), libc::EAGAIN);
    }
}
