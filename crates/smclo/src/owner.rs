//! Process identity that survives pid reuse and pid namespaces:
//! (pid, start time, pid namespace).
//!
//! Everything a process owns in shared memory (DMB table entries, listener
//! registrations, rendezvous slots) records its [`Owner`]. Any process can
//! then tell whether the owner still exists and reclaim what a dead one
//! (even one killed with SIGKILL) left behind. The start time (field 22 of
//! `/proc/<pid>/stat`, clock ticks since boot) makes a recycled pid look
//! like a different process.
//!
//! A pid means something only in its own pid namespace: processes sharing
//! one device directory from several containers see each other's pids as
//! unrelated numbers. So an owner is judged by pid only by a process of the
//! same pid namespace ([`PidNs`]); for an owner of another namespace
//! [`Owner::verdict`] says [`Verdict::OtherNamespace`], and only the
//! namespace lock of [`crate::table`] can tell that such an owner is gone.
//! The `/proc` a process sees may belong to another pid namespace (a child
//! namespace without its own `/proc` mount): then `/proc/<pid>` names other
//! processes, and liveness falls back to "the pid exists" (`kill(pid, 0)`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A pid namespace: the inode number of its `/proc/<pid>/ns/pid` (nsfs
/// inode numbers are 32-bit). 0 when it cannot be read (no `/proc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PidNs(pub u32);

impl PidNs {
    /// The calling process's pid namespace.
    pub fn current() -> PidNs {
        Owner::current().pidns
    }
}

/// A process: its pid and start time, in its pid namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// Process id, in `pidns`.
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`; 0 if unknown (only the pid is
    /// checked then).
    pub start: u64,
    /// The pid namespace the pid belongs to.
    pub pidns: PidNs,
}

/// What a process can tell about an [`Owner`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The owner exists (or, on the fast path, existed very recently).
    Alive,
    /// The owner is gone: what it owns may be reclaimed.
    Dead,
    /// The owner is in another pid namespace: its pid cannot be judged here.
    OtherNamespace,
}

// Per-process cache of our own identity. Atomics rather than a lock: a child
// of fork() must never find a lock held by a thread that does not exist in it.
// A pid of 0 means "not cached"; the fork hook resets it in the child, so the
// hot path needs no getpid(2).
static CACHED_PID: AtomicU32 = AtomicU32::new(0);
static CACHED_START: AtomicU64 = AtomicU64::new(0);
/// Pid namespace inode, plus [`PROC_OURS`] when `/proc` is of that namespace.
static CACHED_PIDNS: AtomicU64 = AtomicU64::new(0);
const PROC_OURS: u64 = 1 << 32;
static FORK_HOOK: AtomicBool = AtomicBool::new(false);

fn getpid() -> u32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() as u32 }
}

/// Incremented in the parent just before every `fork` (so parent and child
/// both see a new value): a DMB mapping made under an older generation may
/// be shared with a fork child and must never be reused ([`crate::dmb::pool`]).
static FORK_GEN: AtomicU64 = AtomicU64::new(1);

/// The current fork generation (see [`FORK_GEN`]). Only meaningful once
/// the fork hook is registered, which [`Owner::current`] does.
pub(crate) fn fork_gen() -> u64 {
    ensure_fork_hook();
    FORK_GEN.load(Ordering::Acquire)
}

/// Runs in the parent before `fork`: a new fork generation, and the
/// descriptors waiting to be closed closed ([`crate::deferred`]), so that
/// the child does not hold an ended connection's TCP socket open.
extern "C" fn before_fork() {
    FORK_GEN.fetch_add(1, Ordering::AcqRel);
    crate::deferred::close_deferred();
}

/// Runs in the child after `fork`: forget everything cached per process.
extern "C" fn after_fork_in_child() {
    CACHED_PID.store(0, Ordering::Relaxed);
    CACHED_NS_PID.store(0, Ordering::Relaxed);
}

/// Registers [`after_fork_in_child`] once per process (and its children,
/// which inherit the registration).
pub(crate) fn ensure_fork_hook() {
    if FORK_HOOK.load(Ordering::Acquire) || FORK_HOOK.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: registers handlers that only touch atomics and close
    // descriptors (async-signal safe, as a fork child handler must be); no
    // parent handler.
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

/// The calling process's pid: the cached one ([`Owner::current`]) or, before
/// it is cached, `getpid`. Touches only atomics then (async-signal safe, for
/// callers in `_exit` or a fork child); it fills no cache.
pub fn current_pid() -> u32 {
    match CACHED_PID.load(Ordering::Acquire) {
        0 => getpid(),
        pid => pid,
    }
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
                pidns: PidNs(CACHED_PIDNS.load(Ordering::Relaxed) as u32),
            };
        }
        ensure_fork_hook();
        let pid = getpid();
        // /proc/self is always the caller, whichever namespace /proc is of.
        // 0 only if /proc is not mounted: liveness checks then degrade to
        // "pid exists".
        let start = read_stat_path("/proc/self/stat").map_or(0, |s| s.start);
        let pidns = own_pidns();
        let ours = if proc_is_ours(pid) { PROC_OURS } else { 0 };
        CACHED_START.store(start, Ordering::Relaxed);
        CACHED_PIDNS.store(pidns.0 as u64 | ours, Ordering::Relaxed);
        CACHED_PID.store(pid, Ordering::Release);
        Owner { pid, start, pidns }
    }

    /// Process `pid` of the caller's pid namespace, with its start time
    /// read from `/proc` (0 if `/proc` cannot tell); `None` if it does not
    /// exist.
    pub fn of(pid: u32) -> Option<Owner> {
        let me = Owner::current();
        if pid == me.pid {
            return Some(me);
        }
        let local = Owner::local(pid, 0);
        if !proc_usable() {
            return local.pid_exists().then_some(local);
        }
        read_stat(pid).map(|s| Owner::local(pid, s.start))
    }

    /// Process `pid` with start time `start` (0: unknown) in the caller's
    /// pid namespace.
    pub fn local(pid: u32, start: u64) -> Owner {
        Owner {
            pid,
            start,
            pidns: PidNs::current(),
        }
    }

    /// Whether this process may still exist: `false` only when it is
    /// certainly gone (an owner in another pid namespace counts as alive).
    ///
    /// A pid of 0 is never alive. When the recorded start time is 0 (unknown)
    /// only the pid is checked. Reads `/proc/<pid>/stat`.
    pub fn is_alive(&self) -> bool {
        self.verdict(false) != Verdict::Dead
    }

    /// [`is_alive`](Self::is_alive) for the connection hot path: once a full
    /// check has found this owner alive, checks within [`VERIFIED_TTL`] use
    /// `kill(pid, 0)` only, so an owner that died unreaped (a zombie) may
    /// look alive that long. Use it only where a wrong "alive" costs a
    /// fallback, never where it would keep garbage (sweeps use `is_alive`).
    pub fn is_alive_fast(&self) -> bool {
        self.verdict(true) != Verdict::Dead
    }

    /// What the caller can tell about this owner; `fast` as in
    /// [`is_alive_fast`](Self::is_alive_fast).
    pub fn verdict(&self, fast: bool) -> Verdict {
        let me = Owner::current();
        if self.pidns != me.pidns {
            return Verdict::OtherNamespace;
        }
        if self.check_alive(me, fast) {
            Verdict::Alive
        } else {
            Verdict::Dead
        }
    }

    fn check_alive(&self, me: Owner, fast: bool) -> bool {
        if self.pid == 0 || self.pid > i32::MAX as u32 {
            return false;
        }
        if self.pid == me.pid {
            return self.start == 0 || self.start == me.start;
        }
        if !proc_usable() {
            return pid_exists(self.pid);
        }
        if fast && self.start != 0 && recently_verified(self) {
            return pid_exists(self.pid);
        }
        let alive = match read_stat(self.pid) {
            Some(s) => !s.zombie && (self.start == 0 || s.start == self.start),
            None => false,
        };
        if alive && self.start != 0 {
            note_verified(*self);
        }
        alive
    }

    /// Whether one of this process's threads is running or waiting for a
    /// CPU (state R in `/proc/<pid>/task/*/stat`, at most
    /// [`RUNNABLE_SCAN`] threads looked at): it makes progress as soon as
    /// it is scheduled, unlike a stopped or sleeping one. `false` when
    /// `/proc` cannot tell (another pid namespace, the process is gone).
    pub fn has_runnable_thread(&self) -> bool {
        if self.pidns != Owner::current().pidns || !proc_usable() {
            return false;
        }
        // A thread's start time is its own: the process's is checked once.
        let same = read_stat(self.pid).is_some_and(|s| self.start == 0 || s.start == self.start);
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return false;
        };
        same && tasks.flatten().take(RUNNABLE_SCAN).any(|t| {
            read_stat_path(&format!("{}/stat", t.path().display())).is_some_and(|s| s.runnable)
        })
    }

    /// Only the pid, without reading `/proc`: `false` means certainly dead,
    /// `true` means "maybe alive". Cheap pre-check for sweeps; meaningful
    /// only for a pid of the caller's namespace.
    pub fn pid_exists(&self) -> bool {
        self.pid != 0 && self.pid <= i32::MAX as u32 && pid_exists(self.pid)
    }
}

/// Threads [`Owner::has_runnable_thread`] looks at, at most.
pub const RUNNABLE_SCAN: usize = 64;

/// Whether `/proc/<pid>` names processes of our pid namespace (cached).
fn proc_usable() -> bool {
    Owner::current();
    CACHED_PIDNS.load(Ordering::Relaxed) & PROC_OURS != 0
}

/// Inode of `/proc/self/ns/pid`, 0 if it cannot be read.
fn own_pidns() -> PidNs {
    use std::os::unix::fs::MetadataExt;
    PidNs(
        std::fs::metadata("/proc/self/ns/pid")
            .map(|m| m.ino() as u32)
            .unwrap_or(0),
    )
}

/// Whether the mounted `/proc` is of our pid namespace: then the `NSpid`
/// line of our status lists one pid (procfs shows pids from its own
/// namespace down to ours), and it is ours. Kernels without `NSpid`
/// (before 4.1) are judged by the pid in our stat file.
fn proc_is_ours(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    match status.lines().find_map(|l| l.strip_prefix("NSpid:")) {
        Some(list) => list.split_ascii_whitespace().eq([pid.to_string().as_str()]),
        None => std::fs::read_to_string("/proc/self/stat")
            .is_ok_and(|s| s.split(' ').next() == Some(pid.to_string().as_str())),
    }
}

fn pid_exists(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission; it
    // sends nothing. pid is positive (checked by callers), so it never
    // addresses a process group.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

struct Stat {
    start: u64,
    zombie: bool,
    runnable: bool,
}

/// Reads state (field 3) and start time (field 22) of `/proc/<pid>/stat`.
fn read_stat(pid: u32) -> Option<Stat> {
    read_stat_path(&format!("/proc/{pid}/stat"))
}

fn read_stat_path(path: &str) -> Option<Stat> {
    parse_stat(&std::fs::read(path).ok()?)
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
        runnable: state == "R",
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
    fn runnable_threads_are_told_from_sleeping_and_stopped_ones() {
        // This thread is running while it asks.
        assert!(Owner::current().has_runnable_thread());
        let mut child = std::process::Command::new("sleep")
            .arg("120")
            .spawn()
            .unwrap();
        let c = Owner::of(child.id()).unwrap();
        // Runnable for moments (exec, the signal's delivery), then not: a
        // first look that finds it not runnable may come before such a
        // moment, so it must stay so for several looks. The bound only
        // limits a failing run.
        let settles = || {
            let t = std::time::Instant::now();
            let mut quiet = 0;
            while quiet < 5 && t.elapsed() < std::time::Duration::from_secs(60) {
                quiet = if c.has_runnable_thread() {
                    0
                } else {
                    quiet + 1
                };
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            quiet == 5
        };
        assert!(settles(), "a sleeping process");
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
        let mut st = 0;
        // SAFETY: waitpid on our own child; reports it once stopped.
        unsafe { libc::waitpid(child.id() as i32, &mut st, libc::WUNTRACED) };
        assert!(settles(), "a stopped process");
        assert!(!Owner::local(c.pid, c.start + 1).has_runnable_thread());
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn current_is_alive_and_others_are_not() {
        let me = Owner::current();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start > 0);
        assert!(me.is_alive());
        assert!(!Owner::local(me.pid, me.start + 1).is_alive());
        assert!(!Owner::local(0, 0).is_alive());
        // pid 1 exists, but not with this start time (unless we are init).
        if me.pid != 1 {
            assert!(!Owner::local(1, u64::MAX).is_alive());
        }
        assert_ne!(netns_inode(), 0);
        assert_ne!(me.pidns, PidNs(0));
        // Another namespace's pid is never judged here, even one that
        // exists in ours.
        let other = Owner {
            pidns: PidNs(me.pidns.0 ^ 1),
            ..me
        };
        assert_eq!(other.verdict(false), Verdict::OtherNamespace);
        assert!(other.is_alive());
    }

    #[test]
    fn exited_child_is_dead() {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        let start = read_stat(pid).map(|s| s.start).unwrap_or(1);
        c.wait().unwrap();
        assert!(!Owner::local(pid, start).is_alive());
    }
}
