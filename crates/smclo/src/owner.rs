//! Process identity that survives pid reuse: (pid, start time).
//!
//! Everything a process owns in shared memory (DMB table entries, listener
//! registrations, rendezvous slots, DMB files) records its [`Owner`]. Any
//! process can then tell whether the owner still exists and reclaim what a
//! dead one (even one killed with SIGKILL) left behind. The start time
//! (field 22 of `/proc/<pid>/stat`, clock ticks since boot) makes a recycled
//! pid look like a different process.
//!
//! Liveness is judged in the caller's pid namespace: processes sharing one
//! device directory must share a pid namespace (and `/proc`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A process: its pid and its start time in clock ticks since boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// Process id.
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`.
    pub start: u64,
}

// Per-process cache of our own identity. Atomics rather than a lock: a child
// of fork() must never find a lock held by a thread that does not exist in it.
// A pid of 0 means "not cached"; the fork hook resets it in the child, so the
// hot path needs no getpid(2).
static CACHED_PID: AtomicU32 = AtomicU32::new(0);
static CACHED_START: AtomicU64 = AtomicU64::new(0);
static FORK_HOOK: AtomicBool = AtomicBool::new(false);

fn getpid() -> u32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() as u32 }
}

/// Incremented in the parent just before every `fork` (so parent and child
/// both see a new value): a DMB mapping made under an older generation may
/// be shared with a fork child and must never be reused ([`crate::pool`]).
static FORK_GEN: AtomicU64 = AtomicU64::new(1);

/// The current fork generation (see [`FORK_GEN`]). Only meaningful once
/// the fork hook is registered, which [`Owner::current`] does.
pub(crate) fn fork_gen() -> u64 {
    ensure_fork_hook();
    FORK_GEN.load(Ordering::Acquire)
}

/// Runs in the parent before `fork`: a new fork generation.
extern "C" fn before_fork() {
    FORK_GEN.fetch_add(1, Ordering::AcqRel);
}

/// Runs in the child after `fork`: forget everything cached per process.
extern "C" fn after_fork_in_child() {
    CACHED_PID.store(0, Ordering::Relaxed);
    CACHED_NS_PID.store(0, Ordering::Relaxed);
    crate::rng::forget_seed();
}

/// Registers [`after_fork_in_child`] once per process (and its children,
/// which inherit the registration).
pub(crate) fn ensure_fork_hook() {
    if FORK_HOOK.load(Ordering::Acquire) || FORK_HOOK.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: registers handlers that only touch atomics (async-signal safe,
    // as a fork child handler must be); no parent handler.
    unsafe { libc::pthread_atfork(Some(before_fork), None, Some(after_fork_in_child)) };
}

/// How long a positive full liveness check (with the start time) is trusted:
/// within it, `kill(pid, 0)` alone decides. A zombie passes `kill(pid, 0)`,
/// so a process that died unreaped may look alive for at most this long.
pub const VERIFIED_TTL: Duration = Duration::from_secs(1);

/// Owners recently verified alive by a full check, with when.
static VERIFIED: Mutex<Vec<(Owner, Instant)>> = Mutex::new(Vec::new());
const VERIFIED_MAX: usize = 64;

fn recently_verified(o: &Owner) -> bool {
    // try_lock: a child of fork must never wait for a lock held by a thread
    // that does not exist in it; contention only costs a full check.
    let Ok(v) = VERIFIED.try_lock() else {
        return false;
    };
    v.iter()
        .any(|(x, at)| x == o && at.elapsed() < VERIFIED_TTL)
}

fn note_verified(o: Owner) {
    let Ok(mut v) = VERIFIED.try_lock() else {
        return;
    };
    let now = Instant::now();
    v.retain(|(x, at)| x.pid != o.pid && now.duration_since(*at) < VERIFIED_TTL);
    if v.len() >= VERIFIED_MAX {
        v.remove(0);
    }
    v.push((o, now));
}

impl Owner {
    /// The calling process. Cached, and re-read after `fork` (a
    /// `pthread_atfork` child handler clears the cache).
    pub fn current() -> Owner {
        let pid = CACHED_PID.load(Ordering::Acquire);
        if pid != 0 {
            return Owner {
                pid,
                start: CACHED_START.load(Ordering::Relaxed),
            };
        }
        ensure_fork_hook();
        let pid = getpid();
        // Our own stat file always exists; 0 only if /proc is not mounted, in
        // which case liveness checks degrade to "pid exists".
        let start = read_stat(pid).map(|s| s.start).unwrap_or(0);
        CACHED_START.store(start, Ordering::Relaxed);
        CACHED_PID.store(pid, Ordering::Release);
        Owner { pid, start }
    }

    /// Process `pid` with its start time read from `/proc` (0 if `/proc`
    /// is not mounted); `None` if it does not exist.
    pub fn of(pid: u32) -> Option<Owner> {
        if pid == Owner::current().pid {
            return Some(Owner::current());
        }
        match read_stat(pid) {
            Some(s) => Some(Owner {
                pid,
                start: s.start,
            }),
            None if !proc_mounted() && (Owner { pid, start: 0 }).pid_exists() => {
                Some(Owner { pid, start: 0 })
            }
            None => None,
        }
    }

    /// Whether this process still exists (and is not a zombie).
    ///
    /// A pid of 0 is never alive. When the recorded start time is 0 (unknown)
    /// only the pid is checked. Reads `/proc/<pid>/stat`.
    pub fn is_alive(&self) -> bool {
        self.check_alive(false)
    }

    /// [`is_alive`](Self::is_alive) for the connection hot path: once a full
    /// check has found this owner alive, checks within [`VERIFIED_TTL`] use
    /// `kill(pid, 0)` only, so an owner that died unreaped (a zombie) may
    /// look alive that long. Use it only where a wrong "alive" costs a
    /// fallback, never where it would keep garbage (sweeps use `is_alive`).
    pub fn is_alive_fast(&self) -> bool {
        self.check_alive(true)
    }

    fn check_alive(&self, fast: bool) -> bool {
        if self.pid == 0 || self.pid > i32::MAX as u32 {
            return false;
        }
        let me = Owner::current();
        if self.pid == me.pid {
            return self.start == me.start;
        }
        if fast && self.start != 0 && recently_verified(self) {
            return pid_exists(self.pid);
        }
        let alive = match read_stat(self.pid) {
            Some(s) => !s.zombie && (self.start == 0 || s.start == self.start),
            None => pid_exists(self.pid) && !proc_mounted(),
        };
        if alive && self.start != 0 {
            note_verified(*self);
        }
        alive
    }

    /// Only the pid, without reading `/proc`: `false` means certainly dead,
    /// `true` means "maybe alive". Cheap pre-check for sweeps.
    pub fn pid_exists(&self) -> bool {
        self.pid != 0 && self.pid <= i32::MAX as u32 && pid_exists(self.pid)
    }
}

fn pid_exists(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission; it
    // sends nothing. pid is positive (checked by callers), so it never
    // addresses a process group.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn proc_mounted() -> bool {
    std::path::Path::new("/proc/self/stat").exists()
}

struct Stat {
    start: u64,
    zombie: bool,
}

/// Reads state (field 3) and start time (field 22) of `/proc/<pid>/stat`.
fn read_stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// `pid (comm) S f4 f5 ...`: comm may hold spaces and parentheses, so the
/// fields are counted from the last `)`.
fn parse_stat(text: &[u8]) -> Option<Stat> {
    let close = text.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&text[close + 1..]).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?; // field 3
    let start = fields.nth(18)?.parse().ok()?; // field 22 = 3 + 19
    Some(Stat {
        start,
        zombie: state == "Z" || state == "X" || state == "x",
    })
}

/// Inode number of the calling process's network namespace
/// (`/proc/self/ns/net`); 0 if it cannot be read. Cached per process.
pub fn netns_inode() -> u64 {
    let pid = Owner::current().pid;
    if CACHED_NS_PID.load(Ordering::Acquire) == pid {
        return CACHED_NS.load(Ordering::Relaxed);
    }
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata("/proc/self/ns/net")
        .map(|m| m.ino())
        .unwrap_or(0);
    CACHED_NS.store(ino, Ordering::Relaxed);
    CACHED_NS_PID.store(pid, Ordering::Release);
    ino
}

static CACHED_NS_PID: AtomicU32 = AtomicU32::new(0);
static CACHED_NS: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let line = b"42 (a) b (c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 19 20\n";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.start, 777);
        assert!(!s.zombie);
        let z = b"42 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 5 19";
        assert!(parse_stat(z).unwrap().zombie);
        assert!(parse_stat(b"garbage").is_none());
    }

    #[test]
    fn current_is_alive_and_others_are_not() {
        let me = Owner::current();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start > 0);
        assert!(me.is_alive());
        assert!(!Owner {
            pid: me.pid,
            start: me.start + 1
        }
        .is_alive());
        assert!(!Owner { pid: 0, start: 0 }.is_alive());
        // pid 1 exists, but not with this start time (unless we are init).
        if me.pid != 1 {
            assert!(!Owner {
                pid: 1,
                start: u64::MAX
            }
            .is_alive());
        }
        assert_ne!(netns_inode(), 0);
    }

    #[test]
    fn exited_child_is_dead() {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        let start = read_stat(pid).map(|s| s.start).unwrap_or(1);
        c.wait().unwrap();
        assert!(!Owner { pid, start }.is_alive());
    }
}
