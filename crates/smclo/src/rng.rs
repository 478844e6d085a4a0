//! Random numbers for tokens, nonces, marks, link ids and the GID.
//!
//! Every value comes from `getrandom(2)`, in batches: a thread fills a
//! buffer of [`BATCH`] values with one call and takes from it, so a
//! connection costs a fraction of a system call. No value is derived from
//! another: a rendezvous nonce that any uid can read in `/proc/net/unix`
//! (the name of an abstract socket) says nothing about the next one, so no
//! one can predict a name to flood before it exists. A fork child discards
//! the buffer it inherited (this module's own fork hook, registered at
//! the first draw), so parent and child never draw the same values.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Values per `getrandom` call.
const BATCH: usize = 32;

/// Forks this process has gone through as a child: a buffer filled in an
/// earlier generation was inherited from the parent and is discarded.
static FORKS: AtomicU64 = AtomicU64::new(0);

struct Pool {
    buf: [u64; BATCH],
    /// Index of the next unused value; `BATCH` when empty.
    next: usize,
    /// [`FORKS`] when the buffer was filled.
    forks: u64,
}

thread_local! {
    static POOL: RefCell<Pool> = const {
        RefCell::new(Pool {
            buf: [0; BATCH],
            next: BATCH,
            forks: 0,
        })
    };
}

/// Discards every buffered value (the fork child handler; async-signal
/// safe).
extern "C" fn forget_seed() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Registers [`forget_seed`] as a fork child handler once per process
/// (and its children, which inherit the registration).
pub(crate) fn ensure_fork_hook() {
    static FORK_HOOK: AtomicBool = AtomicBool::new(false);
    if FORK_HOOK.load(Ordering::Acquire) || FORK_HOOK.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: registers a child handler that only touches an atomic
    // (async-signal safe, as a fork child handler must be); no prepare or
    // parent handler.
    unsafe { libc::pthread_atfork(None, None, Some(forget_seed)) };
}

/// Fills `buf` from the kernel's random source: `getrandom`, or
/// `/dev/urandom` where a filter forbids the system call.
fn fill(buf: &mut [u64]) {
    let len = std::mem::size_of_val(buf);
    let p = buf.as_mut_ptr().cast::<u8>();
    let mut done = 0;
    while done < len {
        // SAFETY: `p + done .. p + len` lies inside `buf`, valid for writes.
        let n = unsafe { libc::getrandom(p.add(done).cast(), len - done, 0) };
        if n > 0 {
            done += n as usize;
        } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    if done < len {
        use std::io::Read;
        // SAFETY: `p + done .. p + len` lies inside `buf`, which nothing
        // else references during this call; any bytes are valid u64 parts.
        let rest = unsafe { std::slice::from_raw_parts_mut(p.add(done), len - done) };
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(rest))
            .expect("neither getrandom nor /dev/urandom is available");
    }
}

/// The next value; never 0.
pub(crate) fn next_u64() -> u64 {
    ensure_fork_hook();
    loop {
        let v = POOL
            .try_with(|p| {
                // Reentered (a signal handler drawing while this thread
                // draws) or torn down: draw alone.
                let Ok(mut p) = p.try_borrow_mut() else {
                    return one();
                };
                let forks = FORKS.load(Ordering::Relaxed);
                if p.next == BATCH || p.forks != forks {
                    fill(&mut p.buf);
                    p.next = 0;
                    p.forks = forks;
                }
                let i = p.next;
                p.next += 1;
                // Taken values are erased: nothing of them stays around.
                std::mem::take(&mut p.buf[i])
            })
            .unwrap_or_else(|_| one());
        if v != 0 {
            return v;
        }
    }
}

fn one() -> u64 {
    let mut v = [0u64];
    fill(&mut v);
    v[0]
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

    /// The SplitMix64 finaliser and its inverse: a generator that outputs
    /// `mix(state += GAMMA)` gives its state away with every value.
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    const M1: u64 = 0xbf58_476d_1ce4_e5b9;
    const M2: u64 = 0x94d0_49bb_1331_11eb;

    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(M1);
        z = (z ^ (z >> 27)).wrapping_mul(M2);
        z ^ (z >> 31)
    }

    fn inverse_mod_2_64(m: u64) -> u64 {
        // Newton's iteration doubles the correct low bits each step.
        let mut x = m;
        for _ in 0..6 {
            x = x.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(x)));
        }
        x
    }

    fn unshift(z: u64, s: u32) -> u64 {
        let mut x = z;
        for _ in 0..64 / s {
            x = z ^ (x >> s);
        }
        x
    }

    fn unmix(z: u64) -> u64 {
        let z = unshift(z, 31).wrapping_mul(inverse_mod_2_64(M2));
        let z = unshift(z, 27).wrapping_mul(inverse_mod_2_64(M1));
        unshift(z, 30)
    }

    #[test]
    fn next_value_is_not_predictable_from_one_observed() {
        let s = 0x0123_4567_89ab_cdef;
        assert_eq!(unmix(mix(s)), s, "the inverse is right");
        let hits = (0..1000)
            .filter(|_| {
                let seen = super::next_u64();
                mix(unmix(seen).wrapping_add(GAMMA)) == super::next_u64()
            })
            .count();
        assert_eq!(
            hits, 0,
            "{hits} of 1000 values predicted from the one before"
        );
    }

    #[test]
    fn fork_child_draws_other_values() {
        // Fill this thread's buffer, then fork: the child must not continue
        // the parent's buffered sequence.
        let _ = super::next_u64();
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into `fds`.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only draws (no locks taken: the buffer is this
        // thread's), writes to the pipe and calls _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let v = super::next_u64();
            // SAFETY: writes the 8 bytes of `v` to our pipe, then exits
            // without running the parent's destructors.
            unsafe {
                libc::write(fds[1], (&v as *const u64).cast(), 8);
                libc::_exit(0);
            }
        }
        let mine = super::next_u64();
        let mut theirs = 0u64;
        // SAFETY: reads at most 8 bytes into `theirs`; waits for the child.
        unsafe {
            libc::close(fds[1]);
            assert_eq!(libc::read(fds[0], (&mut theirs as *mut u64).cast(), 8), 8);
            libc::close(fds[0]);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert_ne!(mine, theirs);
    }
}
