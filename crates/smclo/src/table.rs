//! The protocol of the device's shared tables: the DMB table
//! ([`crate::device`]), the listener registry ([`crate::registry`]), the
//! rendezvous slots ([`crate::rendezvous`]) and the fallback table
//! ([`crate::fallbacks`]) all keep their entries with it,
//! and add only their keys and payloads.
//!
//! # The entry head
//!
//! Every entry starts with a [`Head`] of three 64-bit atomics:
//!
//! - `word`: [`State`] (bits 0..8), the owner's pid (bits 8..40, in the
//!   owner's pid namespace) and a 24-bit [`Gen`]eration (bits 40..64);
//! - `start`: the owner's start time ([`Owner::start`]);
//! - `ident`: the generation the identity was written for (bits 32..56)
//!   and the owner's pid namespace ([`PidNs`], bits 0..32).
//!
//! # Moves
//!
//! - *Take* ([`Head::claim`] from FREE, [`Head::take`] from any exact word):
//!   CAS the word from what was seen to (generation + 1, my pid, WRITING),
//!   then write my start time and `ident` = (that generation, my pid
//!   namespace). Every move into WRITING bumps the generation, so each
//!   holding of an entry is a new *incarnation*.
//! - *Fill*: only the holder of a WRITING entry writes its payload.
//! - *Publish* ([`Head::publish`]): a Release store of (generation, pid,
//!   the table's state). *Free* ([`Head::free`]): a Release store of
//!   (generation, 0, FREE). Both are plain stores: while an entry is
//!   WRITING nobody but its holder changes it (below).
//! - State changes of a published entry ([`Head::cas`]) and the owner's own
//!   release ([`Head::release`]: take, then free) are CASes that name the
//!   incarnation: a [`Ticket`] (generation, pid).
//! - *Reclaim* ([`Judge`]): an entry whose owner is dead is taken (a CAS
//!   from exactly the word that was judged) and freed.
//!
//! # Why it is safe
//!
//! - *kill -9 at any instant leaves the tables consistent.* Every change is
//!   one atomic store or CAS, and at every instant the word names a holder:
//!   an entry is never held by nobody. A process killed at any point leaves
//!   entries that name it, which a later reclaimer finds dead. A reclaimer
//!   killed while it holds a taken entry is, in turn, the dead holder of a
//!   WRITING entry.
//! - *Two processes never hold one entry.* Taking is a CAS from the exact
//!   word seen; two takers of one word cannot both succeed, and a taker
//!   that saw an older word fails because every take changes the
//!   generation.
//! - *A stale reference changes nothing.* A [`Ticket`] or a judged word
//!   carries the generation; once the entry was freed or taken the
//!   generation differs and every CAS through it fails. (The generation
//!   wraps after 2^24 takes of one entry between a read and a CAS, which
//!   does not happen in practice.)
//! - *A reclaimer never frees a live entry.* It judges the incarnation of
//!   the word it read: pid from the word, start time and namespace from
//!   the head only if `ident` carries that word's generation (so they were
//!   written by that incarnation's holder) and the word is unchanged after
//!   reading them (seqlock: a Release fence after every take orders the
//!   new word before the holder's later stores, readers fence with Acquire
//!   before re-reading the word). It then takes the entry by CAS from that
//!   exact word, so a new incarnation, whose holder may be alive, is never
//!   the one freed.
//!
//! # Judging owners
//!
//! - Same pid namespace: by pid and start time ([`Owner::verdict`]).
//!   During WRITING the start time may belong to an earlier holder of the
//!   incarnation (a hand-over writes it after the pid), so WRITING entries
//!   are judged by pid only.
//! - Another pid namespace: never by pid. Every process holds its
//!   namespace's *membership lock*, a shared `flock` on
//!   `<device dir>/pidns-<inode>` ([`Membership`]), taken when it opens the
//!   device, before it can claim anything, and shared with its fork
//!   children; the kernel drops it when the process (and those children)
//!   exit, SIGKILL included. A reclaimer that can lock that file
//!   exclusively ([`Vacancy`]) knows that no process of that namespace that
//!   used the device is left, and keeps the lock while it reclaims, so no
//!   new process of that namespace (or of a new one that got the same
//!   inode number) can claim meanwhile.
//! - WRITING with no identity written yet (the holder died between its CAS
//!   and the next store): the namespace is unknown, so the pid is judged
//!   in the reclaimer's namespace only when no other namespace holds its
//!   membership lock.
//!
//! Limits: a program that closes descriptors it did not open (a daemon's
//! `closefrom`) drops its membership lock, and its entries may then be
//! reclaimed from another pid namespace while it lives (it falls back, or
//! its listener is no longer found); processes of one namespace are
//! judged among themselves by pid only when their `/proc` is not of their
//! namespace ([`crate::owner`]); processes of one pid namespace in
//! different time namespaces see each other's start times shifted by their
//! boot-time offsets, and must not share a device.

use crate::owner::{Owner, PidNs, Verdict};
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// A 64-bit atomic cell: std's in shared memory, loom's in the model
/// (`crates/smclo/tests/loom_table.rs`).
pub trait Atom {
    /// `load`.
    fn load(&self, o: Ordering) -> u64;
    /// `store`.
    fn store(&self, v: u64, o: Ordering);
    /// `compare_exchange`.
    fn compare_exchange(
        &self,
        cur: u64,
        new: u64,
        ok: Ordering,
        fail: Ordering,
    ) -> Result<u64, u64>;
    /// A fence of the same world (std or loom).
    fn fence(o: Ordering);
}

/// `Atom` for an atomic type whose methods and fence already have this
/// shape (std's, and loom's under `--cfg loom`).
macro_rules! impl_atom {
    ($t:ty, $fence:path) => {
        impl Atom for $t {
            fn load(&self, o: Ordering) -> u64 {
                self.load(o)
            }
            fn store(&self, v: u64, o: Ordering) {
                self.store(v, o)
            }
            fn compare_exchange(
                &self,
                cur: u64,
                new: u64,
                ok: Ordering,
                fail: Ordering,
            ) -> Result<u64, u64> {
                self.compare_exchange(cur, new, ok, fail)
            }
            fn fence(o: Ordering) {
                $fence(o)
            }
        }
    };
}

impl_atom!(std::sync::atomic::AtomicU64, std::sync::atomic::fence);
#[cfg(loom)]
impl_atom!(loom::sync::atomic::AtomicU64, loom::sync::atomic::fence);

/// An entry's generation (24 bits), bumped by every take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gen(u32);

impl Gen {
    const MASK: u32 = 0xFF_FFFF;

    fn next(self) -> Gen {
        Gen(self.0.wrapping_add(1) & Gen::MASK)
    }

    /// The number (for diagnostics).
    pub fn get(self) -> u32 {
        self.0
    }
}

/// The state byte of an entry. [`State::FREE`] and [`State::WRITING`] are
/// the protocol's; each table defines its published states from 2 on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct State(pub u8);

impl State {
    /// Unused.
    pub const FREE: State = State(0);
    /// Held by the pid in the word, which is filling, handing over or
    /// freeing it.
    pub const WRITING: State = State(1);
}

/// The word that starts every entry: generation, owner pid, state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Word(u64);

impl Word {
    /// Packs a word.
    pub const fn new(gen: Gen, pid: u32, state: State) -> Word {
        Word(((gen.0 as u64 & Gen::MASK as u64) << 40) | ((pid as u64) << 8) | state.0 as u64)
    }
    /// The generation.
    pub const fn gen(self) -> Gen {
        Gen((self.0 >> 40) as u32)
    }
    /// The owner's pid (in the owner's pid namespace); 0 when FREE.
    pub const fn pid(self) -> u32 {
        (self.0 >> 8) as u32
    }
    /// The state.
    pub const fn state(self) -> State {
        State(self.0 as u8)
    }
    /// Whether the entry is unused.
    pub fn is_free(self) -> bool {
        self.state() == State::FREE
    }
}

/// `ident`: which incarnation's identity the head holds, and its namespace.
fn ident(gen: Gen, ns: PidNs) -> u64 {
    (gen.0 as u64) << 32 | ns.0 as u64
}

/// The first 24 bytes of every shared table entry.
#[repr(C)]
pub struct Head<A = std::sync::atomic::AtomicU64> {
    word: A,
    start: A,
    ident: A,
}

/// Bytes of a [`Head`] in shared memory.
pub const HEAD_LEN: usize = 24;
const _: () = assert!(std::mem::size_of::<Head>() == HEAD_LEN);

/// An entry this process holds in WRITING: only it fills the entry, then
/// publishes or frees it.
#[must_use = "a claimed entry stays held until it is published or freed"]
#[derive(Debug)]
pub struct Claim {
    gen: Gen,
    pid: u32,
}

impl Claim {
    /// The generation of this incarnation.
    pub fn gen(&self) -> Gen {
        self.gen
    }
}

/// One incarnation of an entry: generation and owner pid. Every move made
/// through it fails once the entry was freed or taken since.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    gen: Gen,
    pid: u32,
}

impl Ticket {
    /// The incarnation in word `w`.
    pub fn of(w: Word) -> Ticket {
        Ticket {
            gen: w.gen(),
            pid: w.pid(),
        }
    }
    /// The word of this incarnation in state `s`.
    pub fn word(self, s: State) -> Word {
        Word::new(self.gen, self.pid, s)
    }
    /// Whether `w` is of this incarnation (any state).
    pub fn matches(self, w: Word) -> bool {
        w.gen() == self.gen && w.pid() == self.pid
    }
    /// The generation.
    pub fn gen(self) -> Gen {
        self.gen
    }
    /// The same incarnation owned by `pid`: what a fork child that may
    /// have received the entry ([`Head::hand_over`]) acts through.
    pub fn with_pid(self, pid: u32) -> Ticket {
        Ticket { gen: self.gen, pid }
    }
    /// The owner's pid.
    pub fn pid(self) -> u32 {
        self.pid
    }
}

/// Who holds an incarnation, as far as its head tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// The identity written for this incarnation (start time 0 while
    /// WRITING: see the module doc).
    Known(Owner),
    /// WRITING, and the holder died (or is about to write) before its
    /// identity: only the pid, of an unknown namespace.
    Unrecorded(u32),
}

impl<A: Atom> Head<A> {
    /// A head made of three cells (for the model; shared entries are
    /// mapped, never built).
    pub fn from_cells(word: A, start: A, ident: A) -> Head<A> {
        Head { word, start, ident }
    }

    /// The word (Acquire: a published entry's payload is visible after).
    pub fn word(&self) -> Word {
        Word(self.word.load(Ordering::Acquire))
    }

    /// Claims the entry if it is FREE.
    pub fn claim(&self, me: &Owner) -> Option<Claim> {
        let w = Word(self.word.load(Ordering::Relaxed));
        if !w.is_free() {
            return None;
        }
        self.take(w, me)
    }

    /// Takes the entry from exactly `seen` into WRITING under `me`, with a
    /// new generation, and records `me` as its holder.
    pub fn take(&self, seen: Word, me: &Owner) -> Option<Claim> {
        let gen = seen.gen().next();
        let mine = Word::new(gen, me.pid, State::WRITING);
        self.word
            .compare_exchange(seen.0, mine.0, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // Orders the new word before every later store of the holder, for
        // the readers' seqlock check (module doc).
        A::fence(Ordering::Release);
        self.start.store(me.start, Ordering::Relaxed);
        self.ident.store(ident(gen, me.pidns), Ordering::Release);
        Some(Claim { gen, pid: me.pid })
    }

    /// Publishes a claimed entry in `state` (a table's own, not FREE or
    /// WRITING).
    pub fn publish(&self, c: Claim, state: State) -> Ticket {
        debug_assert!(state != State::FREE && state != State::WRITING);
        self.word
            .store(Word::new(c.gen, c.pid, state).0, Ordering::Release);
        Ticket {
            gen: c.gen,
            pid: c.pid,
        }
    }

    /// Frees a claimed entry.
    pub fn free(&self, c: Claim) {
        self.word
            .store(Word::new(c.gen, 0, State::FREE).0, Ordering::Release);
    }

    /// Moves incarnation `t` from `from` to `to` (published states). On
    /// failure returns the word found.
    pub fn cas(&self, t: Ticket, from: State, to: State) -> Result<(), Word> {
        self.word
            .compare_exchange(
                t.word(from).0,
                t.word(to).0,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .map(|_| ())
            .map_err(Word)
    }

    /// The owner's release: takes incarnation `t`, whatever its published
    /// state (retrying while others move it), if `me` is its owner. The
    /// caller retires the payload, then [`free`](Self::free)s it. `None`
    /// when `me` is not the owner, the entry is WRITING (being handed
    /// over), or `t` is stale.
    pub fn release(&self, t: Ticket, me: &Owner) -> Option<Claim> {
        if me.pid != t.pid {
            return None;
        }
        loop {
            let w = self.word();
            if !t.matches(w) || w.state() == State::WRITING || w.is_free() {
                return None;
            }
            if let Some(c) = self.take(w, me) {
                return Some(c);
            }
        }
    }

    /// Makes `to` (a process of the same pid namespace: a fork child) the
    /// owner of incarnation `t`, in whichever of `states` it is. The
    /// generation stays, so the new owner's tickets (copies of `t`'s
    /// generation) hold; the word is WRITING under `to` while the start
    /// time changes, and WRITING entries are judged by pid only.
    pub fn hand_over(&self, t: Ticket, states: &[State], to: &Owner) -> Option<Ticket> {
        let mid = Word::new(t.gen, to.pid, State::WRITING);
        for &st in states {
            if self
                .word
                .compare_exchange(t.word(st).0, mid.0, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                A::fence(Ordering::Release);
                self.start.store(to.start, Ordering::Relaxed);
                self.ident.store(ident(t.gen, to.pidns), Ordering::Release);
                let new = Ticket {
                    gen: t.gen,
                    pid: to.pid,
                };
                self.word.store(new.word(st).0, Ordering::Release);
                return Some(new);
            }
        }
        None
    }

    /// Reads `f` (payload loads) consistently with a word in a state that
    /// `want` accepts: `None` if the state is not wanted or the word changed
    /// while `f` ran (seqlock).
    pub fn read<T>(&self, want: impl Fn(Word) -> bool, f: impl FnOnce() -> T) -> Option<(Word, T)> {
        let w = self.word();
        if !want(w) {
            return None;
        }
        let v = f();
        A::fence(Ordering::Acquire);
        (self.word.load(Ordering::Relaxed) == w.0).then_some((w, v))
    }

    /// The holder of the incarnation in word `w` (not FREE); `None` if the
    /// word changed meanwhile.
    pub fn holder(&self, w: Word) -> Option<Holder> {
        let (_, (id, start)) = self.read(
            |now| now == w,
            || {
                (
                    self.ident.load(Ordering::Acquire),
                    self.start.load(Ordering::Relaxed),
                )
            },
        )?;
        if (id >> 32) as u32 != w.gen().0 {
            return Some(Holder::Unrecorded(w.pid()));
        }
        let writing = w.state() == State::WRITING;
        Some(Holder::Known(Owner {
            pid: w.pid(),
            start: if writing { 0 } else { start },
            pidns: PidNs(id as u32),
        }))
    }
}

/// Judges the owners of entries for one pass over a table: memoised (many
/// entries share an owner, and each check reads `/proc`), and holding, until
/// dropped, the membership lock of every other pid namespace it found empty.
pub struct Judge<'d> {
    dir: &'d Path,
    fast: bool,
    me: Owner,
    owners: HashMap<Owner, bool>,
    /// Other namespaces: `Some` (the lock, held) when found empty.
    spaces: HashMap<PidNs, Option<Vacancy>>,
    others_live: Option<bool>,
}

impl<'d> Judge<'d> {
    /// A judge for sweeps and stats: full liveness checks.
    pub fn new(dir: &'d Path) -> Judge<'d> {
        Judge {
            dir,
            fast: false,
            me: Owner::current(),
            owners: HashMap::new(),
            spaces: HashMap::new(),
            others_live: None,
        }
    }

    /// A judge for a lookup on the connection hot path:
    /// [`Owner::is_alive_fast`] (a wrong "alive" only costs a fallback).
    pub fn fast(dir: &'d Path) -> Judge<'d> {
        Judge {
            fast: true,
            ..Judge::new(dir)
        }
    }

    /// Whether the holder of word `w` of `head` is certainly gone.
    pub fn dead<A: Atom>(&mut self, head: &Head<A>, w: Word) -> bool {
        if w.is_free() {
            return false;
        }
        match head.holder(w) {
            None => false,
            Some(Holder::Known(o)) => self.owner_dead(o),
            Some(Holder::Unrecorded(pid)) => {
                !self.other_namespaces_live() && self.owner_dead(Owner::local(pid, 0))
            }
        }
    }

    /// Takes `w`'s incarnation of `head` if its holder is dead; the caller
    /// retires the payload and frees the entry.
    pub fn reclaim<A: Atom>(&mut self, head: &Head<A>, w: Word) -> Option<Claim> {
        if !self.dead(head, w) {
            return None;
        }
        let c = head.take(w, &self.me)?;
        crate::debug!("reclaiming a table entry of dead pid {}", w.pid());
        Some(c)
    }

    /// Whether `o` is certainly gone.
    pub fn owner_dead(&mut self, o: Owner) -> bool {
        // The caller itself, as a listener's check on every plain accept
        // finds its own registration: no look, and nothing memoised.
        if o == self.me {
            return false;
        }
        if let Some(d) = self.owners.get(&o) {
            return *d;
        }
        let dead = match o.verdict(self.fast) {
            Verdict::Alive => false,
            Verdict::Dead => true,
            Verdict::OtherNamespace => self.namespace_empty(o.pidns),
        };
        self.owners.insert(o, dead);
        dead
    }

    fn namespace_empty(&mut self, ns: PidNs) -> bool {
        let dir = self.dir;
        self.spaces
            .entry(ns)
            .or_insert_with(|| Vacancy::probe(dir, ns))
            .is_some()
    }

    /// Whether a pid namespace other than ours has members on the device.
    fn other_namespaces_live(&mut self) -> bool {
        if let Some(v) = self.others_live {
            return v;
        }
        let mine = self.me.pidns;
        // An unreadable directory proves nothing: count it as live.
        let live = match std::fs::read_dir(self.dir) {
            Err(_) => true,
            Ok(rd) => {
                let others: Vec<PidNs> = rd
                    .flatten()
                    .filter_map(|e| parse_lock_name(e.file_name().as_encoded_bytes()))
                    .filter(|ns| *ns != mine)
                    .collect();
                others.into_iter().any(|ns| !self.namespace_empty(ns))
            }
        };
        self.others_live = Some(live);
        live
    }
}

const LOCK_PREFIX: &str = "pidns-";

fn lock_path(dir: &Path, ns: PidNs) -> PathBuf {
    dir.join(format!("{LOCK_PREFIX}{}", ns.0))
}

fn parse_lock_name(name: &[u8]) -> Option<PidNs> {
    let digits = name.strip_prefix(LOCK_PREFIX.as_bytes())?;
    std::str::from_utf8(digits).ok()?.parse().ok().map(PidNs)
}

/// Opens (creating it if needed) a lock file. Its `mode` is the device
/// directory's file mode ([`crate::access`]): in a group device every
/// member must be able to open the locks the others created.
fn open_lock(path: &Path, mode: u32) -> io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .create(true)
        .truncate(false)
        .write(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    // The umask may have taken bits away from a file we just created.
    let md = f.metadata()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if md.uid() == unsafe { libc::geteuid() } && md.mode() & 0o777 != mode {
        crate::access::set_mode(f.as_raw_fd(), mode)?;
    }
    // Held as long as the process uses the device: not among the program's
    // numbers.
    Ok(crate::fdnum::move_high(f))
}

fn flock(f: &File, op: i32) -> io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether `f` is still the file at `path` (a lock holder may remove the
/// file of an empty namespace: a lock on the removed file means nothing).
fn still_linked(f: &File, path: &Path) -> bool {
    match (f.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    }
}

/// This process's membership of its pid namespace on one device: a shared
/// lock on `<dir>/pidns-<inode>`, held for the life of the process (and of
/// its fork children, which share it).
#[derive(Debug)]
pub struct Membership {
    _file: File,
}

impl Membership {
    /// Joins the caller's pid namespace's lock in `dir`. Waits while a
    /// process of another namespace holds it to reclaim (a sweep, brief).
    pub fn join(dir: &Path, mode: u32) -> io::Result<Membership> {
        let path = lock_path(dir, PidNs::current());
        for _ in 0..100 {
            let f = open_lock(&path, mode)?;
            flock(&f, libc::LOCK_SH)?;
            if still_linked(&f, &path) {
                return Ok(Membership { _file: f });
            }
        }
        Err(io::Error::from_raw_os_error(libc::EAGAIN))
    }
}

/// The exclusive lock of a pid namespace that has no members: while held,
/// no process of that namespace can claim an entry. Dropping it removes the
/// lock file (then releases it).
#[derive(Debug)]
pub struct Vacancy {
    _file: File,
    path: PathBuf,
}

impl Vacancy {
    /// `Some` when no process of `ns` holds its membership lock in `dir`.
    pub fn probe(dir: &Path, ns: PidNs) -> Option<Vacancy> {
        let path = lock_path(dir, ns);
        let file = open_lock(&path, crate::access::file_mode_in(dir)).ok()?;
        flock(&file, libc::LOCK_EX | libc::LOCK_NB).ok()?;
        still_linked(&file, &path).then_some(Vacancy { _file: file, path })
    }
}

impl Drop for Vacancy {
    fn drop(&mut self) {
        // Removed while still locked: a process that opened it meanwhile
        // finds it unlinked after locking and opens the new one.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!("smclo-table-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn head() -> Head<AtomicU64> {
        Head::from_cells(AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0))
    }

    /// A pid that existed and is gone now.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    #[test]
    fn another_namespace_is_judged_by_its_lock_only() {
        let d = Dir::new("ns");
        let me = Owner::current();
        // An owner of another namespace whose pid exists here (ours): its
        // pid must not matter, only whether the namespace has members.
        let other = Owner {
            pidns: PidNs(me.pidns.0 ^ 0x5a5a),
            start: me.start + 1,
            ..me
        };
        let h = head();
        let c = h.claim(&other).unwrap();
        let w = h.publish(c, State(2)).word(State(2));
        let member = open_lock(&lock_path(&d.0, other.pidns), 0o600).unwrap();
        flock(&member, libc::LOCK_SH).unwrap();
        assert!(!Judge::new(&d.0).dead(&h, w), "a live namespace's entry");
        drop(member);
        {
            let mut j = Judge::new(&d.0);
            let c = j.reclaim(&h, w).expect("an empty namespace's entry");
            // While the judge holds the namespace's lock, nobody joins it.
            let joiner = open_lock(&lock_path(&d.0, other.pidns), 0o600).unwrap();
            assert!(flock(&joiner, libc::LOCK_SH | libc::LOCK_NB).is_err());
            h.free(c);
        }
        assert!(h.word().is_free());
        assert!(!lock_path(&d.0, other.pidns).exists(), "lock file removed");
    }

    #[test]
    fn a_holder_that_died_before_its_identity_is_judged_only_alone() {
        let d = Dir::new("unrec");
        let me = Owner::current();
        let dead = Owner::local(dead_pid(), 0);
        let h = head();
        // Claimed by the dead pid, identity never written.
        let w = Word::new(Gen(1), dead.pid, State::WRITING);
        h.word.store(w.0, Ordering::Relaxed);
        assert_eq!(h.holder(w), Some(Holder::Unrecorded(dead.pid)));
        // Another namespace has a member: the pid could be one of its.
        let other = lock_path(&d.0, PidNs(me.pidns.0 ^ 0x5a5a));
        let member = open_lock(&other, 0o600).unwrap();
        flock(&member, libc::LOCK_SH).unwrap();
        assert!(!Judge::new(&d.0).dead(&h, w));
        drop(member);
        // Ours is the only namespace with members: judged here by pid.
        let c = Judge::new(&d.0).reclaim(&h, w).expect("reclaimed");
        h.free(c);
        assert!(h.word().is_free());
    }

    #[test]
    fn stale_tickets_and_words_change_nothing() {
        let me = Owner::current();
        let h = head();
        let t = h.publish(h.claim(&me).unwrap(), State(2));
        let c = h.release(t, &me).unwrap();
        h.free(c);
        let t2 = h.publish(h.claim(&me).unwrap(), State(2));
        assert_ne!(t.gen(), t2.gen());
        assert!(h.cas(t, State(2), State(3)).is_err());
        assert!(h.release(t, &me).is_none());
        assert!(h.take(t.word(State(2)), &me).is_none());
        assert_eq!(h.word(), t2.word(State(2)));
        // Only the owner releases.
        let stranger = Owner {
            pid: me.pid + 1,
            ..me
        };
        assert!(h.release(t2, &stranger).is_none());
        assert_eq!(
            h.holder(h.word()),
            Some(Holder::Known(me)),
            "the published identity is the claimer's"
        );
    }
}
