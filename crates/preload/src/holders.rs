//! Which processes hold a connection after `fork` (the close rule).
//!
//! A forked child inherits the application's descriptors and the table. The
//! connection must end (close flags to the peer) only when the *last*
//! process holding it lets go, as with a kernel socket. Each connection has
//! a slot in a `MAP_SHARED` anonymous region created before the first fork
//! and therefore shared by the whole process family: up to [`PER_SLOT`] pids
//! that may hold it. `fork` (interposed) lists the child before any thread
//! of the parent can close the connection: its prepare handler puts a
//! placeholder ([`before_fork`]) that the child takes over when it runs
//! ([`join`]) and the parent turns into the child's pid once `fork` returns
//! ([`adopt_child`]), unless the child took it first; so a child that ran,
//! closed its copy and left before its parent saw its pid is not listed
//! again. Each fork's placeholder is an entry of its own ([`Placeholder`]).
//! A closing process counts a placeholder as a holder while the parent it
//! names holds the connection ([`leave`]); [`alone`] counts it as another
//! process, and [`others`] leaves it out.
//!
//! A listed pid is only a candidate: at close time each is verified with
//! `kcmp(KCMP_FILE)` on the channel descriptor, at the number the slot
//! lists for that process: the family's number, which a fork child
//! inherits, until the process moves its channel to another one (a close
//! or `dup2` of the number while `dup`s of it remain), which it writes in
//! its entry ([`renumber`]). So a child that exited (even with `_exit`, or
//! unreaped), exec'd (the channel is close-on-exec) or closed its copy
//! does not count, and a recycled pid never matches. Where `kcmp` is
//! unavailable (no CONFIG_CHECKPOINT_RESTORE, or refused by ptrace
//! policy) a live non-zombie pid counts as a holder: the connection then
//! closes without a flag when the last of them exits, which the peer
//! reads as a reset.
//!
//! Limits: more than [`PER_SLOT`]` - 1` simultaneous forked holders of one
//! connection are not tracked (logged); the extra ones are invisible to the
//! close rule. The holders an exec'd image lists are the ones of its old
//! image's slot, at the image's own number (the new image's region is not
//! the family's).

use smclo::adapter::chan_sys::syscall as sys;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// Holders per slot.
pub const PER_SLOT: usize = 16;
const SLOTS: usize = 1 << 16;

#[repr(C, align(64))]
struct Slot {
    holders: [AtomicU64; PER_SLOT],
    /// Non-zero once a holder could not be listed (more than
    /// [`PER_SLOT`]): [`alone`] can no longer tell.
    untracked: AtomicU64,
}

/// One entry of a slot: a process and the number its channel is at. One
/// word, so that it is written and read whole; 0 is a free entry.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Entry(u64);

impl Entry {
    const FREE: Entry = Entry(0);
    /// The number is the one the process that reads it uses itself.
    const SAME_NUMBER: u32 = u32::MAX;
    /// In the pid half: the entry is a placeholder for a fork child of
    /// that pid, not yet known (pids stay below 2^22, `PID_MAX_LIMIT`).
    const CHILD_OF: u32 = 1 << 31;

    fn new(pid: u32, chan: Option<RawFd>) -> Entry {
        let n = chan.map_or(Self::SAME_NUMBER, |c| c as u32);
        Entry(u64::from(pid) << 32 | u64::from(n))
    }

    /// The placeholder for a child of `parent` being forked, whose
    /// channel is at `chan`, as its parent's.
    fn child_of(parent: u32, chan: RawFd) -> Entry {
        Entry::new(parent | Self::CHILD_OF, Some(chan))
    }

    /// The pid half: a process, or a placeholder ([`Entry::child_of`]),
    /// which matches no process.
    fn pid(self) -> u32 {
        (self.0 >> 32) as u32
    }

    /// The forking parent, for a placeholder.
    fn parent(self) -> Option<u32> {
        let p = self.pid();
        (p & Self::CHILD_OF != 0).then_some(p & !Self::CHILD_OF)
    }

    /// The process's channel number; `mine` when not known apart.
    fn chan_or(self, mine: RawFd) -> RawFd {
        match self.0 as u32 {
            Self::SAME_NUMBER => mine,
            n => n as RawFd,
        }
    }

    fn load(a: &AtomicU64) -> Entry {
        Entry(a.load(Ordering::Acquire))
    }

    /// `a` from `self` to `new`; false if it was not `self` any more.
    fn replace(self, a: &AtomicU64, new: Entry) -> bool {
        a.compare_exchange(self.0, new.0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }
}

static REGION: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());
static HINT: AtomicUsize = AtomicUsize::new(0);

fn region() -> Option<&'static [Slot]> {
    let mut p = REGION.load(Ordering::Acquire);
    if p.is_null() {
        let len = SLOTS * std::mem::size_of::<Slot>();
        // SAFETY: a fresh anonymous shared mapping; no existing memory is
        // touched. NORESERVE: pages are only committed when used.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return None;
        }
        match REGION.compare_exchange(
            std::ptr::null_mut(),
            m.cast(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => p = m.cast(),
            Err(other) => {
                // SAFETY: our own mapping, unused by anyone.
                unsafe { libc::munmap(m, len) };
                p = other;
            }
        }
    }
    // SAFETY: the region is SLOTS slots of atomics, mapped for the life of
    // the process (never unmapped), zero-initialised (a valid value).
    Some(unsafe { std::slice::from_raw_parts(p, SLOTS) })
}

/// This process, without a system call once the core has cached it (a
/// `getpid` per claim and per close was two of a connection's calls).
fn me() -> u32 {
    smclo::adapter::owner::current_pid()
}

/// Claims a slot with this process as its only holder; `None` if the
/// region cannot be mapped or is full (the connection then stays TCP).
pub fn claim() -> Option<usize> {
    let r = region()?;
    let me = Entry::new(me(), None);
    let start = HINT.load(Ordering::Relaxed);
    for k in 0..SLOTS {
        let i = (start + k) % SLOTS;
        let s = &r[i];
        if s.holders.iter().any(|h| Entry::load(h) != Entry::FREE) {
            continue;
        }
        // Only members add to a slot that has members, so an empty slot can
        // only race with another claimer: the CAS decides.
        if Entry::FREE.replace(&s.holders[0], me) {
            s.untracked.store(0, Ordering::Relaxed);
            HINT.store(i + 1, Ordering::Relaxed);
            return Some(i);
        }
    }
    None
}

/// Sets this process's entry of `slot` to `e`, if it has one.
fn set_mine(slot: &Slot, e: Entry) {
    let me = me();
    for h in &slot.holders {
        let old = Entry::load(h);
        if old.pid() == me {
            old.replace(h, e);
            return;
        }
    }
}

/// Adds `pid`, a holder its old image listed ([`others`]), to `slot` of
/// an exec'd image, at the number of whoever reads the entry.
pub fn add(slot: usize, pid: u32) {
    if let Some(r) = region() {
        insert(&r[slot], Entry::new(pid, None));
    }
}

/// Where [`before_fork`] put one fork's placeholder in a slot: its
/// entry, which only that fork's child and parent fill in (a child of an
/// earlier fork that starts late finds its own entry filled, and never
/// takes this one).
#[derive(Clone, Copy)]
pub struct Placeholder(usize);

/// Before a fork copies the process (its prepare handler, with the
/// table's lock held): this process's entry in `slot` names its channel's
/// number `chan`, which the child may move away from before this process
/// runs again (a child that reads "at my own number" would look for the
/// parent at its moved one), and so do the entries of others listed at
/// the reader's own number; and for the interposed `fork` (`hooked`), a
/// placeholder for the child, which the child or this process fills in
/// ([`adopt_child`]). `None`: no placeholder (not hooked, or the slot is
/// full: the child then goes untracked, as [`insert`] says).
pub fn before_fork(slot: usize, chan: RawFd, hooked: bool) -> Option<Placeholder> {
    let r = region()?;
    let s = &r[slot];
    list_own_number(s, chan, chan);
    if !hooked {
        return None;
    }
    insert(s, Entry::child_of(me(), chan)).map(Placeholder)
}

/// The interposed `fork` returned `child` (a pid, or `None` when it
/// failed): the placeholder `at` of [`before_fork`] becomes the child,
/// with its channel at `chan` as this process's is, unless the child took
/// it over already ([`join`]; it may have left since, and must not be
/// listed again).
pub fn adopt_child(slot: usize, at: Option<Placeholder>, child: Option<u32>, chan: RawFd) {
    let Some(r) = region() else { return };
    let s = &r[slot];
    let to = child.map_or(Entry::FREE, |pid| Entry::new(pid, Some(chan)));
    if let Some(Placeholder(i)) = at {
        Entry::child_of(me(), chan).replace(&s.holders[i], to);
    }
}

/// A fork child of `parent` lists itself in `slot`, with its channel at
/// `chan` (its parent's number), before it returns from `fork`: in the
/// placeholder `at` its parent put ([`before_fork`]) if it is still
/// there, else (the parent filled it in already, or the fork was one the
/// library did not interpose, inside the C library as in `forkpty(3)`)
/// in a free entry. The child may move its channel before its parent
/// runs again ([`renumber`]).
pub fn join(slot: usize, chan: RawFd, parent: u32, at: Option<Placeholder>) {
    let Some(r) = region() else { return };
    let s = &r[slot];
    let me = Entry::new(me(), Some(chan));
    if let Some(Placeholder(i)) = at {
        if Entry::child_of(parent, chan).replace(&s.holders[i], me) {
            return;
        }
    }
    insert(s, me);
}

/// Puts `e` in a free entry of `slot`, unless its process has one;
/// returns the entry it took.
fn insert(s: &Slot, e: Entry) -> Option<usize> {
    if s.holders.iter().any(|h| Entry::load(h).pid() == e.pid()) {
        return None;
    }
    if let Some(i) = (0..PER_SLOT).find(|&i| Entry::FREE.replace(&s.holders[i], e)) {
        return Some(i);
    }
    s.untracked.store(1, Ordering::Release);
    match e.parent() {
        Some(p) => smclo::debug!(
            "more than {PER_SLOT} processes share a connection; the child that process {p} is forking is not tracked"
        ),
        None => smclo::debug!(
            "more than {PER_SLOT} processes share a connection; process {} is not tracked",
            e.pid()
        ),
    }
    None
}

/// Whether this process is the only one of its family listed in `slot`:
/// no other has the connection's channel open, so the open file's flags
/// are this process's to know (`Conn::own_file_again`). False where the
/// region is unknown or a holder went untracked. A listed process that
/// closed its copy without leaving (killed) keeps this false: the answer
/// errs towards asking.
pub fn alone(slot: usize) -> bool {
    let Some(r) = region() else { return false };
    let s = &r[slot];
    let me = me();
    s.untracked.load(Ordering::Acquire) == 0
        && s.holders.iter().all(|h| {
            let pid = Entry::load(h).pid();
            pid == 0 || pid == me
        })
}

/// This process's channel of `slot` moves from number `from` to `to`:
/// the others of the family look for it there. The holders listed "at
/// the reader's own number" (an exec'd image's, [`add`]) are pinned at
/// `from` first: this process's own number no longer says where they are.
pub fn renumber(slot: usize, from: RawFd, to: RawFd) {
    if let Some(r) = region() {
        list_own_number(&r[slot], from, to);
    }
}

/// This process's entry in `s` says its channel is at `to`; first, the
/// entries of others listed "at the reader's own number" are written out
/// at `from`, this process's number until now, so that a reader whose
/// number is another (a fork child that moved its channel, this process
/// after it moved its own) looks for them there.
fn list_own_number(s: &Slot, from: RawFd, to: RawFd) {
    let me = me();
    for h in &s.holders {
        let e = Entry::load(h);
        if e != Entry::FREE && e.0 as u32 == Entry::SAME_NUMBER && e.pid() != me {
            e.replace(h, Entry::new(e.pid(), Some(from)));
        }
    }
    set_mine(s, Entry::new(me, Some(to)));
}

/// Removes this process from `slot`; returns another process that still
/// holds the connection, if any (see the module docs). `chan` is this
/// process's channel descriptor.
pub fn leave(slot: usize, chan: RawFd) -> Option<u32> {
    let r = region()?;
    let s = &r[slot];
    remove_mine(s);
    let mut others = None;
    for h in &s.holders {
        let e = Entry::load(h);
        if e == Entry::FREE {
            continue;
        }
        // A placeholder: a child being forked, which holds the
        // connection as long as its parent, whose copy it is, does.
        let pid = e.parent().unwrap_or(e.pid());
        if holds(pid, chan, e.chan_or(chan)) {
            others = others.or(Some(pid));
        } else {
            e.replace(h, Entry::FREE);
        }
    }
    others
}

/// Removes this process from `slot` without asking about the others (exec).
pub fn forget(slot: usize) {
    if let Some(r) = region() {
        remove_mine(&r[slot]);
    }
}

/// Frees this process's entries of `slot`.
fn remove_mine(s: &Slot) {
    let me = me();
    for h in &s.holders {
        let e = Entry::load(h);
        if e.pid() == me {
            e.replace(h, Entry::FREE);
        }
    }
}

/// The other pids listed in `slot` (for exec: the new image's region
/// lists them again).
pub fn others(slot: usize) -> Vec<u32> {
    let Some(r) = region() else {
        return Vec::new();
    };
    let me = me();
    r[slot]
        .holders
        .iter()
        .map(Entry::load)
        .filter(|e| *e != Entry::FREE && e.parent().is_none() && e.pid() != me)
        .map(Entry::pid)
        .collect()
}

const KCMP_FILE: libc::c_long = 0;

/// Whether process `pid` still has our channel (`mine`) open, at its
/// descriptor `theirs`.
fn holds(pid: u32, mine: RawFd, theirs: RawFd) -> bool {
    // SAFETY: kcmp only compares kernel objects; all arguments are plain
    // integers.
    let r = unsafe {
        sys(
            libc::SYS_kcmp,
            &[
                me() as libc::c_long,
                pid as libc::c_long,
                KCMP_FILE,
                mine as libc::c_long,
                theirs as libc::c_long,
            ],
        )
    };
    if r == 0 {
        return true;
    }
    if r > 0 {
        return false; // a different file at that number
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ESRCH) | Some(libc::EBADF) => false,
        _ => alive_not_zombie(pid),
    }
}

/// Whether `pid` exists and is not a zombie, from `/proc/<pid>/stat` read
/// into stack buffers with raw system calls: `leave` runs in `_exit` too,
/// which must stay async-signal-safe (no allocation).
fn alive_not_zombie(pid: u32) -> bool {
    let mut path = [0u8; 32];
    let mut n = 0;
    let mut push = |b: &[u8]| {
        path[n..n + b.len()].copy_from_slice(b);
        n += b.len();
    };
    push(b"/proc/");
    let mut digits = [0u8; 10];
    let mut d = digits.len();
    let mut v = pid;
    loop {
        d -= 1;
        digits[d] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    push(&digits[d..]);
    push(b"/stat\0");
    // Raw system calls: `read` and `close` are interposed, and their real
    // functions are found with dlsym on first use.
    // SAFETY: `path` is NUL-terminated; openat reads it and returns a new
    // descriptor or -1.
    let fd = unsafe {
        sys(
            libc::SYS_openat,
            &[
                libc::AT_FDCWD as libc::c_long,
                path.as_ptr() as libc::c_long,
                (libc::O_RDONLY | libc::O_CLOEXEC) as libc::c_long,
            ],
        )
    };
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 1024];
    // SAFETY: reads at most buf.len() bytes into our buffer; then closes
    // the descriptor opened above, which nobody else has.
    let len = unsafe {
        let len = sys(
            libc::SYS_read,
            &[
                fd,
                buf.as_mut_ptr() as libc::c_long,
                buf.len() as libc::c_long,
            ],
        );
        sys(libc::SYS_close, &[fd]);
        len
    };
    let Ok(len) = usize::try_from(len) else {
        return false;
    };
    let text = &buf[..len];
    let Some(close) = text.iter().rposition(|&b| b == b')') else {
        return false;
    };
    !matches!(text.get(close + 2), Some(b'Z' | b'X' | b'x'))
}
