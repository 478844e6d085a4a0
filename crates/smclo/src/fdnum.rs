//! Where smclo's own descriptors live: high numbers.
//!
//! A program's descriptor numbers must grow as they do over TCP, one per
//! connection: event loops sized by the number of connections (wrk sizes
//! its loop at 10 + 3 × connections), `select` (`FD_SETSIZE`) and programs
//! that expect small numbers depend on it. So every descriptor smclo keeps
//! open beside the application's own (a connection's UNIX channel, a DMB's
//! memfd, the preload's hidden TCP socket) is moved to a number at or above
//! [`floor`], leaving the low numbers to the application's `socket`,
//! `accept` and `open`.
//!
//! Where the hard `RLIMIT_NOFILE` is above the soft one, the preload raises
//! the process's soft limit ([`widen`]) and keeps the program's own soft
//! limit here ([`app_limit`]): smclo's descriptors then live at and above
//! the program's limit, in room the program cannot use, and the preload
//! shows the program its own limit and refuses it numbers at or above it
//! (`EMFILE`), as the kernel would.
//!
//! Descriptors below the program's limit count against it: each owner of
//! such a descriptor holds a [`Held`], and a new SMC-D connection is tried
//! only while smclo's descriptors stay within [`budget`]: the room above
//! the program's limit plus a fixed share of that limit
//! ([`room_for_conn`]); otherwise it falls back to TCP (reason MEM). So a
//! program that uses up to 15/16 of its limit never meets `EMFILE` earlier
//! than over TCP.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// Lowest and highest floor. The upper bound keeps the kernel's descriptor
/// table of a process with a huge `RLIMIT_NOFILE` small, and the numbers
/// inside the preload's table (65536 entries), which marks them internal.
const FLOOR_MIN: i32 = 64;
const FLOOR_MAX: i32 = 32768;

static FLOOR: AtomicI32 = AtomicI32::new(0);

/// The process's `RLIMIT_NOFILE` as the kernel has it (a system call: the
/// preload interposes `getrlimit` with the program's view).
fn nofile() -> std::io::Result<libc::rlimit> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit64 of this process writes one rlimit into `rl`, which
    // we own, and reads no new limit (null).
    let r = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            libc::RLIMIT_NOFILE,
            std::ptr::null::<libc::rlimit>(),
            &mut rl as *mut libc::rlimit,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rl)
}

/// Sets the process's `RLIMIT_NOFILE` (a system call, as [`nofile`]).
fn set_nofile(soft: u64, hard: u64) -> std::io::Result<()> {
    let rl = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: prlimit64 of this process reads one rlimit from `rl` and
    // writes no old one (null).
    let r = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            libc::RLIMIT_NOFILE,
            &rl as *const libc::rlimit,
            std::ptr::null_mut::<libc::rlimit>(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The program's own soft `RLIMIT_NOFILE` while the process's is raised
/// above it ([`widen`]); 0 while it is not.
static APP_SOFT: AtomicU64 = AtomicU64::new(0);

/// The highest soft limit [`widen`] sets: smclo's descriptors stay numbers
/// of the preload's table ([`MARKED_MAX`]).
const RAISE_TOP: u64 = MARKED_MAX as u64;

/// What smclo may need above the program's limit `app_soft`: each of its
/// connections may hold a hidden TCP socket and a memfd there, and the
/// process a few fixed ones.
fn room_wanted(app_soft: u64) -> u64 {
    app_soft.saturating_mul(2).saturating_add(64)
}

/// The soft limit the process gets for a program's `app_soft`: room for
/// [`room_wanted`] and, below it, as much again as the program's limit
/// (room for the program to raise its own limit), within `hard` and
/// [`RAISE_TOP`].
fn raised_soft(app_soft: u64, hard: u64) -> u64 {
    let want = app_soft
        .saturating_mul(2)
        .saturating_add(room_wanted(app_soft));
    want.min(hard).min(RAISE_TOP).max(app_soft)
}

/// Where smclo's descriptors begin when the process's soft limit `real` is
/// raised above the program's `app`: the top [`room_wanted`] numbers,
/// leaving the numbers just above the program's limit free for it to
/// raise its limit into.
fn raised_floor(app: u64, real: u64) -> i32 {
    real.saturating_sub(room_wanted(app)).max(app) as i32
}

/// The program's soft `RLIMIT_NOFILE` while smclo uses room above it,
/// `None` while it does not (the process's limit is the program's).
pub fn app_limit() -> Option<u64> {
    match APP_SOFT.load(Ordering::Relaxed) {
        0 => None,
        v => Some(v),
    }
}

/// The process's `RLIMIT_NOFILE` as the program sees it: its own soft
/// limit (see [`app_limit`]), the real hard one.
pub fn app_nofile() -> std::io::Result<libc::rlimit> {
    let mut rl = nofile()?;
    if let Some(v) = app_limit() {
        rl.rlim_cur = v;
    }
    Ok(rl)
}

/// Raises the process's soft `RLIMIT_NOFILE` above the program's where the
/// hard limit allows (see [`set_app_nofile`]). Called once, before the
/// program runs.
pub fn widen() {
    if let Ok(rl) = nofile() {
        // A limit the kernel refuses to raise stays the program's own.
        let _ = set_app_nofile(rl.rlim_cur, rl.rlim_max);
    }
}

/// The program sets its `RLIMIT_NOFILE` to `soft` and `hard`: the process
/// gets `hard` and a soft limit raised above `soft` where `hard` leaves
/// room, and `soft` is what the program sees. Errors are the kernel's for
/// the program's request (`EINVAL` for `soft` above `hard`, `EPERM`).
pub fn set_app_nofile(soft: u64, hard: u64) -> std::io::Result<()> {
    let real_soft = if soft <= hard && soft < RAISE_TOP {
        raised_soft(soft, hard)
    } else {
        soft
    };
    set_nofile(real_soft, hard)?;
    BUDGET_AT.store(0, Ordering::Relaxed);
    let raised = real_soft > soft;
    APP_SOFT.store(if raised { soft } else { 0 }, Ordering::Relaxed);
    if raised {
        FLOOR.store(raised_floor(soft, real_soft), Ordering::Relaxed);
    } else if FLOOR.load(Ordering::Relaxed) != 0 {
        FLOOR.store(floor_within(real_soft), Ordering::Relaxed);
    }
    Ok(())
}

/// The program's limit restored for a new program (exec, spawn), which
/// must inherit what this one set; raised again when this value drops (the
/// exec failed, or the spawn is done).
#[derive(Debug)]
pub struct ForExec(Option<libc::rlimit>);

impl ForExec {
    /// Lowers the process's soft limit to the program's, if raised.
    pub fn begin() -> ForExec {
        let Some(v) = app_limit() else {
            return ForExec(None);
        };
        let Ok(rl) = nofile() else {
            return ForExec(None);
        };
        if set_nofile(v, rl.rlim_max).is_err() {
            return ForExec(None);
        }
        ForExec(Some(rl))
    }
}

impl Drop for ForExec {
    fn drop(&mut self) {
        if let Some(rl) = self.0 {
            // The caller reports the exec's or spawn's errno.
            let _ = crate::errno::kept(|| set_nofile(rl.rlim_cur, rl.rlim_max));
        }
    }
}

/// The floor where the soft limit is the program's: half of it, at least
/// 64 and at most 32768.
fn floor_within(soft: u64) -> i32 {
    (soft / 2).clamp(FLOOR_MIN as u64, FLOOR_MAX as u64) as i32
}

/// The number from which smclo's own descriptors are allocated: the top of
/// the room above the program's soft limit while smclo uses it
/// ([`app_limit`], [`raised_floor`]); otherwise half of the soft `RLIMIT_NOFILE` when the process starts
/// using smclo, at least 64 and at most 32768.
pub fn floor() -> i32 {
    let f = FLOOR.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    let soft = nofile().map_or(0, |rl| rl.rlim_cur);
    let f = match app_limit() {
        Some(v) => raised_floor(v, soft),
        None => floor_within(soft),
    };
    FLOOR.store(f, Ordering::Relaxed);
    f
}

/// A close-on-exec duplicate of `fd` at or above [`floor`]; when there is
/// none free up there, above the program's limit ([`app_limit`]), and
/// failing that at any free number (a lowered `RLIMIT_NOFILE`, all taken).
pub fn dup_high(fd: RawFd) -> std::io::Result<OwnedFd> {
    let lows = [floor() as u64, app_limit().unwrap_or(0), 0];
    let mut n = -1;
    for low in lows {
        // The system call itself: `fd` may be a connection's channel that
        // is the application's descriptor (see crate::chan_sys).
        n = crate::chan_sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, low as libc::c_long);
        if n >= 0 {
            break;
        }
    }
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` was just returned to us and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// `x` moved to a high number (see [`dup_high`]): the low descriptor is
/// closed. Unchanged if it already is high or cannot be moved.
pub fn move_high<T: Into<OwnedFd> + From<OwnedFd> + AsRawFd>(x: T) -> T {
    if x.as_raw_fd() >= floor() {
        return x;
    }
    match dup_high(x.as_raw_fd()) {
        Ok(high) => {
            close_own(x.into());
            T::from(high)
        }
        Err(_) => x,
    }
}

/// Closes a descriptor smclo made itself (one it accepted or created, never
/// the program's) with the system call, not through `close`: under the
/// preload, `close` is the interposed one, which takes the descriptor
/// table's lock, and a caller inside a handshake may hold locks that a
/// thread holding that lock waits for. Nothing the preload remembers can
/// be about this number (it learns of a reused number afresh).
pub fn close_own(fd: OwnedFd) {
    crate::chan_sys::close(fd.into_raw_fd());
}

/// smclo's descriptors may take 1/`BUDGET_SHARE` of the soft
/// `RLIMIT_NOFILE`; the application keeps the rest.
const BUDGET_SHARE: u64 = 16;

/// What one more connection may need at once: its channel, its DMB's
/// memfd, the preload's hidden TCP socket, and during the handshake a
/// rendezvous socket and the peer's memfd.
pub const PER_CONN: usize = 5;

static HELD: AtomicUsize = AtomicUsize::new(0);

/// One descriptor smclo keeps open beside the application's (a channel, a
/// DMB memfd, a hidden TCP socket): counted while this value lives, so the
/// owner holds it next to the descriptor.
#[derive(Debug)]
pub struct Held(());

impl Held {
    /// Counts one more descriptor.
    pub fn new() -> Held {
        HELD.fetch_add(1, Ordering::Relaxed);
        Held(())
    }
}

impl Default for Held {
    fn default() -> Held {
        Held::new()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one descriptor with no [`Held`] beside it: one handed over to
/// [`crate::deferred`], which calls [`release_one`] when it closes it.
pub(crate) fn hold_one() {
    HELD.fetch_add(1, Ordering::Relaxed);
}

/// Uncounts one descriptor counted by [`hold_one`].
pub(crate) fn release_one() {
    HELD.fetch_sub(1, Ordering::Relaxed);
}

thread_local! {
    /// Depth of [`internal`] calls on this thread.
    static INTERNAL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f`, which makes descriptors of smclo's own (moved high at once):
/// the preload's hooks let them have numbers at or above the program's
/// limit ([`in_internal`]), which they refuse the program.
pub fn internal<T>(f: impl FnOnce() -> T) -> T {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            INTERNAL.with(|d| d.set(d.get() - 1));
        }
    }
    INTERNAL.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    f()
}

/// Whether this thread is inside [`internal`].
pub fn in_internal() -> bool {
    INTERNAL.with(|d| d.get() > 0)
}

/// Numbers below this are marked in [`OURS`].
const MARKED_MAX: usize = 65536;
#[allow(clippy::declare_interior_mutable_const)]
const NO_MARKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// One bit per descriptor number that the core keeps open beside the
/// program's (see [`Mark`]).
static OURS: [std::sync::atomic::AtomicU64; MARKED_MAX / 64] = [NO_MARKS; MARKED_MAX / 64];

/// Marks descriptor number `fd` as the core's while this value lives (a
/// DMB's memfd, the vault's pair): a program's `close_range` must leave
/// it open (the preload asks [`is_ours`]), as it leaves the kernel's own
/// files of a socket alone.
#[derive(Debug)]
pub struct Mark(RawFd);

impl Mark {
    /// Marks `fd`.
    pub fn new(fd: RawFd) -> Mark {
        if let Some(w) = OURS.get(fd as usize / 64) {
            w.fetch_or(1 << (fd % 64), Ordering::Relaxed);
        }
        Mark(fd)
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(w) = OURS.get(self.0 as usize / 64) {
            w.fetch_and(!(1 << (self.0 % 64)), Ordering::Relaxed);
        }
    }
}

/// Whether descriptor number `fd` is marked as the core's ([`Mark`]).
pub fn is_ours(fd: RawFd) -> bool {
    fd >= 0
        && OURS
            .get(fd as usize / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (fd % 64)) != 0)
}

/// Descriptors smclo holds now in this process.
pub fn held() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// The [`budget`] as [`room_for_conn`] last read it; 0 before.
static BUDGET: AtomicUsize = AtomicUsize::new(0);

/// When [`BUDGET`] was read ([`now_ms`] + 1); 0: read it anew
/// (never read, or the program changed its limit since).
static BUDGET_AT: AtomicU64 = AtomicU64::new(0);

/// How long [`room_for_announcement`] trusts a reading of the budget.
pub const BUDGET_TRUSTED: std::time::Duration = std::time::Duration::from_millis(100);

/// Milliseconds of [`crate::clock`] (no system call: the vDSO).
fn now_ms() -> u64 {
    crate::clock::now_ns() / 1_000_000
}

/// How many descriptors smclo may hold: the room above the program's soft
/// `RLIMIT_NOFILE` ([`app_limit`]) and 1/[`BUDGET_SHARE`] of the program's
/// limit, read now (the program may change its limit at any time;
/// [`room_for_conn`] reads it once per connection attempt, and the rest of
/// that connection's life uses that reading).
pub fn budget() -> usize {
    let b = match nofile() {
        Err(_) => 0,
        Ok(rl) => {
            let app = app_limit().unwrap_or(rl.rlim_cur).min(rl.rlim_cur);
            let above = rl.rlim_cur - app;
            usize::try_from(above + app / BUDGET_SHARE).unwrap_or(usize::MAX)
        }
    };
    BUDGET.store(b, Ordering::Relaxed);
    BUDGET_AT.store(now_ms() + 1, Ordering::Relaxed);
    b
}

/// The budget as the latest connection attempt read it (read now if none
/// did): a connection's later checks ([`pressed`]) need no system call of
/// their own.
fn budget_last_read() -> usize {
    match BUDGET.load(Ordering::Relaxed) {
        0 => budget(),
        b => b,
    }
}

/// Whether one more SMC-D connection fits in the [`budget`]; when it does
/// not, the connection stays TCP. Short of room, `relieve` first closes
/// the descriptors smclo keeps without needing them (the layers above
/// this one own them: ended connections' TCP sockets waiting to be
/// closed, pooled DMBs' memfds).
pub fn room_for_conn(relieve: fn()) -> bool {
    room_within(budget(), relieve)
}

/// [`room_for_conn`] for an announcement, with a reading of the budget
/// less than [`BUDGET_TRUSTED`] old (the program's own changes of its
/// limit drop the reading): an announcement to a plain server asks the
/// kernel nothing beyond its proof (docs/handshake.md), and a limit
/// changed from outside the process is seen that much later.
pub fn room_for_announcement(relieve: fn()) -> bool {
    let at = BUDGET_AT.load(Ordering::Relaxed);
    let fresh = at != 0 && now_ms() < at - 1 + BUDGET_TRUSTED.as_millis() as u64;
    let budget = match BUDGET.load(Ordering::Relaxed) {
        b if fresh && b != 0 => b,
        _ => budget(),
    };
    room_within(budget, relieve)
}

/// Whether one more connection fits in `budget`.
fn room_within(budget: usize, relieve: fn()) -> bool {
    if held() + PER_CONN > budget {
        relieve();
    }
    let held = held();
    let room = held + PER_CONN <= budget;
    if !room {
        crate::debug!(
            "descriptor budget: smclo holds {held} descriptors of the {budget} it may use \
             (the room above the program's RLIMIT_NOFILE and 1/{BUDGET_SHARE} of it); \
             this connection stays TCP (MEM)"
        );
    }
    room
}

/// Whether smclo holds more than half its [`budget`]: DMB memfds are then
/// closed as soon as they are passed, and dropped DMBs are not pooled, at
/// the cost of creating the next DMB anew.
pub fn pressed() -> bool {
    held() * 2 > budget_last_read()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An announcement trusts a reading of the budget younger than
    /// [`BUDGET_TRUSTED`] (a value no reading gives stands for it here),
    /// and reads anew once it is older or the program set its limit.
    #[test]
    fn an_announcement_trusts_a_recent_budget_until_it_ages_or_the_limit_is_set() {
        const UNREAD: usize = usize::MAX - 7;
        let real = budget();
        BUDGET.store(UNREAD, Ordering::Relaxed);
        assert!(room_for_announcement(|| {}));
        assert_eq!(
            BUDGET.load(Ordering::Relaxed),
            UNREAD,
            "a fresh reading was read again"
        );
        let app = app_nofile().unwrap();
        set_app_nofile(app.rlim_cur, app.rlim_max).unwrap();
        assert!(room_for_announcement(|| {}));
        assert_eq!(
            BUDGET.load(Ordering::Relaxed),
            real,
            "a set limit kept the reading"
        );
        std::thread::sleep(BUDGET_TRUSTED);
        BUDGET.store(UNREAD, Ordering::Relaxed);
        assert!(room_for_announcement(|| {}));
        assert_eq!(
            BUDGET.load(Ordering::Relaxed),
            real,
            "an aged reading was trusted"
        );
    }

    #[test]
    fn moved_descriptors_are_high_and_work() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = move_high(a);
        assert!(a.as_raw_fd() >= floor(), "{} < {}", a.as_raw_fd(), floor());
        use std::io::{Read, Write};
        (&a).write_all(b"x").unwrap();
        let mut c = [0u8];
        (&b).read_exact(&mut c).unwrap();
        assert_eq!(&c, b"x");
        assert_eq!(
            // SAFETY: F_GETFD on our own descriptor.
            unsafe { libc::fcntl(a.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC,
            libc::FD_CLOEXEC
        );
    }
}
