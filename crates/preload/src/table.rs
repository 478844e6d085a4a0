//! Descriptor number → its state: one [`FdState`] per number, in one place,
//! changed by one function ([`transition_locked`]).
//!
//! Each number below [`MAX_FD`] has one atomic word that mirrors its state
//! for the lock-free checks: the variant in its low four bits ([`Kind`]),
//! and for `Smc` and `Epoll` the address of the data the fast paths use
//! (the [`Sock`], the [`Shadow`]). A number smclo knows nothing about has
//! the word 0, so the fast path of every interposed call is one atomic
//! load. The state itself (the enum with its data) lives in [`STATES`];
//! the variants without data (`Internal`, `Closing`) are the word alone,
//! so that a connection's drop can change them without any lock, and so
//! is a `Candidate` with nothing recorded yet (`socket()`'s), so that a
//! connection to a plain peer touches no map.
//!
//! Using a state's data takes [`LOCK`] for reading just long enough to
//! count a reference; changing a state takes it for writing, so a
//! reference is never counted on data that is being freed. Forgetting a
//! number (it was closed) is replacing its state by `Unknown`: the old
//! state is returned, to be dropped once the lock is released.
//!
//! Beside the state, `crate::hints` records facts about the kernel's
//! socket behind a number that only spare system calls.

use crate::critical;
pub use crate::shadow::Shadow;
pub use crate::sock::Sock;
use smclo::adapter::backoff::Backoff;
use smclo::adapter::fallbacks::FallbackRecord;
use smclo::adapter::handshake;
use smclo::adapter::numhash::NumMap;
use smclo::adapter::registry::ListenerGuard;
use std::cell::Cell;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Descriptors at or above this are never upgraded (they stay plain TCP).
pub const MAX_FD: usize = 65536;

/// An epoll registration of a descriptor that is not (yet) a connection:
/// the set and the program's event.
pub type Reg = (RawFd, libc::epoll_event);

/// What smclo knows of one descriptor number. Transitions (all through
/// [`transition_locked`], with [`LOCK`] held for writing, except the two
/// of `Internal` and `Closing`, see [`close_internal`]):
///
/// | from | event | to |
/// | --- | --- | --- |
/// | `Unknown` | `socket()` of a TCP stream | `Candidate` |
/// | `Candidate` | `epoll_ctl` on it | `Candidate` (registrations recorded) |
/// | `Candidate`, `Unknown` | `listen` registered (or an inherited listener met) | `Listener` |
/// | `Candidate` | `connect` proposed, undecided when it returns | `Pending` |
/// | `Unknown` | `accept` returned before its handshake decided | `Pending` |
/// | `Pending` (early) | a non-blocking call cannot go on undecided | `Pending` (writability hidden) |
/// | `Candidate`, `Pending` | the handshake decided SMC-D: the swap | `Smc` |
/// | `Candidate`, `Pending` | it decided TCP | `Fallback` (listed) or `Unknown` |
/// | `Candidate` | `connect` not proposed | `Unknown` (or `Fallback`) |
/// | `Candidate` | `dup`, `dup2`, `F_DUPFD` of it (its connect stays TCP; one under way in another thread decides first) | `Unknown` |
/// | `Unknown` | `dup` of a `Smc`, `Listener`, `Fallback` | the same, sharing its data |
/// | `Smc` | `fcntl(F_SETFD)` | `Smc` (the program's `FD_CLOEXEC`) |
/// | `Unknown` | an SMC-D member joins the set (`epoll_ctl`) | `Epoll` |
/// | `Smc` | `close` of the channel's own number | `Internal` |
/// | `Unknown` | smclo's own descriptor (hidden TCP socket, moved channel) | `Internal` |
/// | `Internal`, `Unknown` | the connection closes it ([`close_internal`]) | `Closing`, then `Unknown` |
/// | `Listener`, `Fallback` | `exec` | `Unknown` (the listing stays with this image) |
/// | any but `Internal`, `Closing` | `close`, `dup2` onto it, met fresh from the kernel | `Unknown` (forgotten) |
pub enum FdState {
    /// Nothing: a number smclo does not know (word 0).
    Unknown,
    /// A TCP socket made by the program's `socket()`, not connected yet:
    /// its epoll registrations, which a swap moves to the channel.
    Candidate {
        /// In the order made.
        epoll: Vec<Reg>,
        /// The thread in its blocking connect, whose decision a `dup` by
        /// another thread waits for (`hooks::state::duplicated`).
        connecting: Option<ThreadMark>,
    },
    /// A connect (or accept) returned before its handshake decided: the
    /// descriptor is the TCP socket (`hooks::pending`).
    Pending {
        /// The handshake.
        connecting: Arc<Connecting>,
        /// Its epoll registrations, given to the kernel without
        /// writability unless `writable`.
        epoll: Vec<Reg>,
        /// Reported writable as the TCP socket is: a blocking connect
        /// that returned connected, whose writes go early.
        writable: bool,
    },
    /// An SMC-D connection: after the swap the descriptor is its channel
    /// (or a `dup` of it).
    Smc {
        /// The connection.
        sock: Arc<Sock>,
        /// The program's view of `FD_CLOEXEC` (the real descriptor always
        /// has it, see `crate::hooks` on exec).
        cloexec: bool,
    },
    /// A listening TCP socket registered in the device, until the last of
    /// its `dup`s is closed.
    Listener(Arc<ListenerGuard>),
    /// A TCP connection that fell back, listed in the device's fallback
    /// table (`smclo ss -a`) until the last of its `dup`s is closed.
    Fallback(Arc<FallbackRecord>),
    /// An epoll set with SMC-D members, served by its shadow
    /// (`hooks::epoll`).
    Epoll(Arc<Shadow>),
    /// A descriptor smclo itself uses (a hidden TCP socket, or a
    /// connection's channel at a number the program has let go of): the
    /// program cannot close it by accident.
    Internal,
    /// An internal descriptor that its connection is closing: `close` and
    /// `dup2` of the number wait until it is `Unknown` ([`settle`]).
    Closing,
}

impl FdState {
    /// A fresh candidate: no registrations, no connect under way.
    pub fn candidate() -> FdState {
        FdState::Candidate {
            epoll: Vec::new(),
            connecting: None,
        }
    }
}

/// A thread, as long as it runs: its process (a fork child inherits
/// marks made by its parent's threads, which it does not have) and the
/// address of one of its thread-locals (no system call, unlike `gettid`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ThreadMark {
    pid: u32,
    thread: usize,
}

impl ThreadMark {
    /// The calling thread's.
    pub fn current() -> Self {
        thread_local! {
            static ME: u8 = const { 0 };
        }
        ThreadMark {
            pid: smclo::adapter::owner::current_pid(),
            thread: ME.with(|m| m as *const u8 as usize),
        }
    }

    /// Whether this is another thread of the caller's process.
    pub fn is_other_thread(self) -> bool {
        let me = Self::current();
        self.pid == me.pid && self != me
    }
}

/// A handshake that has not decided, shared by its `Pending` state and the
/// thread that drives it. Its mutex may be taken with [`LOCK`] held, never
/// the other way round: nobody waits for the table's lock while holding
/// it.
pub struct Connecting {
    /// The handshake, `None` while a thread drives it (it takes it out,
    /// so that no lock is held across its system calls).
    pub undecided: Mutex<Option<Undecided>>,
    /// A blocking connect, or an announcement's, that returned connected
    /// (its writes may go early): the process's exit ends it as a close
    /// would.
    pub early: bool,
    /// The handshake is an announcement (a destination without a
    /// registered listener): the connection is TCP's until a server
    /// answers, and no call waits for that answer (`hooks::pending`).
    pub announced: bool,
}

/// The handshake of a `Pending` descriptor and what goes with it.
pub struct Undecided {
    pub hs: handshake::Pending,
    /// The holder slot claimed for the connection.
    pub slot: usize,
    /// The other end's address.
    pub dest: SocketAddr,
    /// A non-blocking `shutdown` made while it was undecided, carried out
    /// when it decides.
    pub shut: Shut,
}

/// The directions a `shutdown` of an undecided connection closed.
#[derive(Clone, Copy, Default)]
pub struct Shut {
    rd: bool,
    wr: bool,
}

impl Shut {
    pub fn add(&mut self, how: libc::c_int) {
        self.rd |= how != libc::SHUT_WR;
        self.wr |= how != libc::SHUT_RD;
    }

    pub fn how(self) -> Option<libc::c_int> {
        match (self.rd, self.wr) {
            (true, true) => Some(libc::SHUT_RDWR),
            (true, false) => Some(libc::SHUT_RD),
            (false, true) => Some(libc::SHUT_WR),
            (false, false) => None,
        }
    }
}

/// The variant of a state, as its word says it (one atomic load).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Unknown,
    Candidate,
    /// `writable`: see [`FdState::Pending`].
    Pending {
        writable: bool,
    },
    Smc,
    Listener,
    Fallback,
    Epoll,
    Internal,
    Closing,
}

// The word's low four bits. The two kinds of `Pending` and of `Smc` differ
// in bit 0 only, so that the fast paths test either with one mask.
const K_UNKNOWN: usize = 0;
const K_CANDIDATE: usize = 1;
const K_PENDING: usize = 2;
const K_PENDING_WRITABLE: usize = 3;
const K_SMC: usize = 4;
/// `Smc` without the program's `FD_CLOEXEC`.
const K_SMC_KEPT: usize = 5;
const K_LISTENER: usize = 6;
const K_FALLBACK: usize = 7;
const K_EPOLL: usize = 8;
const K_INTERNAL: usize = 9;
const K_CLOSING: usize = 10;
/// `Candidate` without registrations or a connecting thread (as `socket()`
/// makes it): the word alone, so that a plain connection's socket and
/// connect touch no map.
const K_CANDIDATE_BARE: usize = 11;
const KIND_BITS: usize = 15;
/// The kind's bits but bit 0.
const PAIR_BITS: usize = KIND_BITS & !1;

/// Whether word `w` is a `Smc` state's.
#[inline]
fn is_smc(w: usize) -> bool {
    w & PAIR_BITS == K_SMC
}

const _: () = assert!(std::mem::align_of::<Sock>() > KIND_BITS);
const _: () = assert!(std::mem::align_of::<Shadow>() > KIND_BITS);

impl Kind {
    fn of(word: usize) -> Kind {
        match word & KIND_BITS {
            K_UNKNOWN => Kind::Unknown,
            K_CANDIDATE | K_CANDIDATE_BARE => Kind::Candidate,
            K_PENDING => Kind::Pending { writable: false },
            K_PENDING_WRITABLE => Kind::Pending { writable: true },
            K_SMC | K_SMC_KEPT => Kind::Smc,
            K_LISTENER => Kind::Listener,
            K_FALLBACK => Kind::Fallback,
            K_EPOLL => Kind::Epoll,
            K_INTERNAL => Kind::Internal,
            _ => Kind::Closing,
        }
    }

    /// A pending handshake's, writable or not.
    pub fn is_pending(self) -> bool {
        matches!(self, Kind::Pending { .. })
    }
}

impl FdState {
    /// The word that mirrors it.
    fn word(&self) -> usize {
        match self {
            FdState::Unknown => K_UNKNOWN,
            FdState::Candidate { epoll, connecting } => {
                if epoll.is_empty() && connecting.is_none() {
                    K_CANDIDATE_BARE
                } else {
                    K_CANDIDATE
                }
            }
            FdState::Pending { writable, .. } => {
                if *writable {
                    K_PENDING_WRITABLE
                } else {
                    K_PENDING
                }
            }
            FdState::Smc { sock, cloexec } => {
                Arc::as_ptr(sock) as usize | if *cloexec { K_SMC } else { K_SMC_KEPT }
            }
            FdState::Listener(_) => K_LISTENER,
            FdState::Fallback(_) => K_FALLBACK,
            FdState::Epoll(sh) => Arc::as_ptr(sh) as usize | K_EPOLL,
            FdState::Internal => K_INTERNAL,
            FdState::Closing => K_CLOSING,
        }
    }

    /// Whether the state is its word alone (no entry in [`STATES`]).
    fn word_only(&self) -> bool {
        word_state(self.word()).is_some()
    }
}

/// The state that word `w` is alone (`Unknown`, `Internal`, `Closing`, a
/// bare `Candidate`); `None` for a word whose state is in [`STATES`].
fn word_state(w: usize) -> Option<FdState> {
    match w {
        K_UNKNOWN => Some(FdState::Unknown),
        K_INTERNAL => Some(FdState::Internal),
        K_CLOSING => Some(FdState::Closing),
        K_CANDIDATE_BARE => Some(FdState::candidate()),
        _ => None,
    }
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO_WORD: AtomicUsize = AtomicUsize::new(0);

/// The words: each number's state, mirrored (see the module's doc).
static WORDS: [AtomicUsize; MAX_FD] = [ZERO_WORD; MAX_FD];

/// The states with data, by number. Only touched with [`LOCK`] held (for
/// writing to change one), so never held across `fork`.
static STATES: Mutex<Option<NumMap<RawFd, FdState>>> = Mutex::new(None);

/// How many times each number's state was forgotten (closed, replaced,
/// met fresh from the kernel), wrapping: a call that holds a number across
/// a wait (a blocking connect, an accept) sees by a change that another
/// thread let the number go meanwhile, and perhaps got it back for
/// another file.
static FORGOTTEN: [AtomicU32; MAX_FD] = [const { AtomicU32::new(0) }; MAX_FD];

/// How many numbers are `Pending` (the waits skip all of it at 0).
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);
/// How many numbers are `Epoll` (closes skip the shadows at 0).
static EPOLL_COUNT: AtomicUsize = AtomicUsize::new(0);

fn in_range(fd: RawFd) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD
}

fn states() -> std::sync::MutexGuard<'static, Option<NumMap<RawFd, FdState>>> {
    STATES.lock().unwrap_or_else(|p| p.into_inner())
}

/// The kind of state of `fd` (`Unknown` beyond the table): one load.
#[inline]
pub fn kind(fd: RawFd) -> Kind {
    if !in_range(fd) {
        return Kind::Unknown;
    }
    Kind::of(WORDS[fd as usize].load(Ordering::Relaxed))
}

/// Whether `fd`'s state is `Pending` (one load).
#[inline]
pub fn is_pending(fd: RawFd) -> bool {
    in_range(fd) && WORDS[fd as usize].load(Ordering::Relaxed) & PAIR_BITS == K_PENDING
}

/// Whether `fd` has a state (not `Unknown`).
#[inline]
pub fn known(fd: RawFd) -> bool {
    in_range(fd) && WORDS[fd as usize].load(Ordering::Relaxed) != 0
}

/// Whether the data path's hooks have nothing to do for `fd` but the
/// kernel's call: no connection is behind it and no handshake pending on
/// it (neither `Smc` nor `Pending`; a listed fallback, a candidate, a
/// number smclo knows nothing of). They forward such a number before
/// anything else: a program's files, pipes and plain peers pay one load
/// per call.
#[inline]
pub fn plain_io(fd: RawFd) -> bool {
    if !in_range(fd) {
        return true;
    }
    let k = WORDS[fd as usize].load(Ordering::Relaxed) & PAIR_BITS;
    k != K_SMC && k != K_PENDING
}

/// The one function that changes the state of `fd` (with [`LOCK`] held
/// for writing): `f` gets the state and returns the new one with what the
/// caller keeps; the word and the counts follow here. What `f` lets go of
/// is dropped under the lock: a state whose drop closes descriptors
/// through the interposed `close` (an undecided handshake) must be handed
/// back in `R` instead, to be dropped after the lock is released.
pub fn transition_locked<R>(fd: RawFd, f: impl FnOnce(FdState) -> (FdState, R)) -> R {
    let Some(w) = WORDS.get(fd as usize).filter(|_| fd >= 0) else {
        // Beyond the table: nothing is remembered (callers do not ask).
        return f(FdState::Unknown).1;
    };
    let old_word = w.load(Ordering::Acquire);
    let old = word_state(old_word).unwrap_or_else(|| {
        states()
            .as_mut()
            .and_then(|m| m.remove(&fd))
            .unwrap_or(FdState::Unknown)
    });
    let was = Kind::of(old_word);
    let (new, r) = f(old);
    let new_word = new.word();
    if new_word == K_UNKNOWN && old_word != K_UNKNOWN {
        FORGOTTEN[fd as usize].fetch_add(1, Ordering::Relaxed);
    }
    // The new kind counted before the old one is let go: lock-free
    // readers of a count (`pending_count`, `epoll_count`) never see a
    // number that stays in its kind drop out for a moment.
    count(Kind::of(new_word), 1);
    count(was, -1);
    if !new.word_only() {
        states().get_or_insert_with(NumMap::default).insert(fd, new);
    }
    if new_word != old_word {
        w.store(new_word, Ordering::Release);
    }
    r
}

/// [`transition_locked`] to `new` whatever the state was; the old state
/// is returned, to be dropped after the lock is released.
#[must_use = "drop it after the table's lock is released"]
pub fn replace_locked(fd: RawFd, new: FdState) -> FdState {
    transition_locked(fd, |old| (new, old))
}

fn count(k: Kind, by: isize) {
    let c = match k {
        Kind::Pending { .. } => &PENDING_COUNT,
        Kind::Epoll => &EPOLL_COUNT,
        _ => return,
    };
    if by > 0 {
        c.fetch_add(1, Ordering::Relaxed);
    } else {
        c.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How many times `fd`'s state was forgotten so far (see [`FORGOTTEN`]);
/// compare under [`LOCK`].
pub fn forgotten(fd: RawFd) -> u32 {
    if !in_range(fd) {
        return 0;
    }
    FORGOTTEN[fd as usize].load(Ordering::Relaxed)
}

/// How many numbers are `Pending`.
pub fn pending_count() -> usize {
    PENDING_COUNT.load(Ordering::Relaxed)
}

/// How many numbers are `Epoll`.
pub fn epoll_count() -> usize {
    EPOLL_COUNT.load(Ordering::Relaxed)
}

/// `f` applied to the state of `fd`, which it reads. With [`LOCK`] held.
pub fn with_state_locked<R>(fd: RawFd, f: impl FnOnce(&FdState) -> R) -> R {
    match word_state(WORDS[fd as usize].load(Ordering::Acquire)) {
        Some(s) => f(&s),
        None => {
            let m = states();
            f(m.as_ref()
                .and_then(|m| m.get(&fd))
                .unwrap_or(&FdState::Unknown))
        }
    }
}

/// `f` applied to every state with data, with its number. With [`LOCK`]
/// held (for writing if `f` may drop what it clones).
pub fn for_each_state_locked(mut f: impl FnMut(RawFd, &FdState)) {
    if let Some(m) = states().as_ref() {
        m.iter().for_each(|(fd, s)| f(*fd, s));
    }
}

/// The handshake of `fd` if it is `Pending`, counted (a short read lock).
pub fn connecting(fd: RawFd) -> Option<Arc<Connecting>> {
    if !is_pending(fd) {
        return None;
    }
    let _g = LOCK.read();
    with_state_locked(fd, |s| match s {
        FdState::Pending { connecting, .. } => Some(connecting.clone()),
        _ => None,
    })
}

/// The connection of `fd`, counted, or `None` (the common case: one load).
#[inline]
pub fn get(fd: RawFd) -> Option<Arc<Sock>> {
    get_for(fd, false)
}

/// [`get`]; `call`: for a call that uses the connection until it returns,
/// counted in [`Sock::calls`](crate::sock::Calls) under the lock, so that
/// a close that takes the number out of the table afterwards sees the
/// call (`hooks::swap::in_call`, which ends the count).
#[inline]
pub fn get_for(fd: RawFd, call: bool) -> Option<Arc<Sock>> {
    if !in_range(fd) || !is_smc(WORDS[fd as usize].load(Ordering::Relaxed)) {
        return None;
    }
    get_slow(fd, call)
}

#[cold]
fn get_slow(fd: RawFd, call: bool) -> Option<Arc<Sock>> {
    let _g = LOCK.read();
    let s = get_locked(fd)?;
    if call {
        s.calls.begin();
    }
    Some(s)
}

/// [`get`] with [`LOCK`] held (for reading or writing), which is not
/// re-entrant.
pub fn get_locked(fd: RawFd) -> Option<Arc<Sock>> {
    if !in_range(fd) {
        return None;
    }
    let w = WORDS[fd as usize].load(Ordering::Acquire);
    if !is_smc(w) {
        return None;
    }
    let p = (w & !KIND_BITS) as *const Sock;
    // SAFETY: the word of a `Smc` state is the address of its Arc<Sock>,
    // which its entry in STATES counts; the lock keeps writers (who
    // change the state, and so drop that count) out until we hold our own.
    unsafe {
        Arc::increment_strong_count(p);
        Some(Arc::from_raw(p))
    }
}

/// The shadow of epoll set `ep`, counted, or `None` (one load).
#[inline]
pub fn shadow(ep: RawFd) -> Option<Arc<Shadow>> {
    if kind(ep) != Kind::Epoll {
        return None;
    }
    let _g = LOCK.read();
    let w = WORDS[ep as usize].load(Ordering::Acquire);
    if w & KIND_BITS != K_EPOLL {
        return None;
    }
    let p = (w & !KIND_BITS) as *const Shadow;
    // SAFETY: as in get_slow, for the Arc<Shadow> of an `Epoll` state.
    unsafe {
        Arc::increment_strong_count(p);
        Some(Arc::from_raw(p))
    }
}

/// Whether the program asked for `FD_CLOEXEC` on `fd` (a `Smc` number).
pub fn app_cloexec(fd: RawFd) -> bool {
    WORDS[fd as usize].load(Ordering::Acquire) & KIND_BITS != K_SMC_KEPT
}

/// The connection of `fd` if its state is `Smc`, without counting a
/// reference: call with the write lock held, which keeps it alive.
pub fn with_entry_locked<R>(fd: RawFd, f: impl FnOnce(&Sock) -> R) -> Option<R> {
    if !in_range(fd) {
        return None;
    }
    let w = WORDS[fd as usize].load(Ordering::Acquire);
    if !is_smc(w) {
        return None;
    }
    // SAFETY: as in get_slow; the write lock keeps the state as it is.
    Some(f(unsafe { &*((w & !KIND_BITS) as *const Sock) }))
}

/// Whether `fd` still names `sock` (write lock held): a `dup` of a
/// descriptor that another thread closed meanwhile must fail as the
/// kernel's would, not name a closed connection.
pub fn names_locked(fd: RawFd, sock: &Arc<Sock>) -> bool {
    with_entry_locked(fd, |s| std::ptr::eq(s, &**sock)).unwrap_or(false)
}

/// Calls `f` with every connection of a `Smc` number, once per number (a
/// connection with several descriptors comes several times), without
/// counting references, locking or allocating: async-signal-safe. Call
/// with the write lock held, which keeps every state alive.
pub fn for_each_locked(mut f: impl FnMut(&Sock)) {
    for a in WORDS.iter() {
        let w = a.load(Ordering::Acquire);
        if is_smc(w) {
            // SAFETY: as in with_entry_locked.
            f(unsafe { &*((w & !KIND_BITS) as *const Sock) });
        }
    }
}

/// Every `Smc` number with its connection, counted (for fork and exec).
/// Call with the write lock held.
pub fn all_locked() -> Vec<(RawFd, Arc<Sock>)> {
    let mut v = Vec::new();
    for (fd, a) in WORDS.iter().enumerate() {
        let w = a.load(Ordering::Acquire);
        if !is_smc(w) {
            continue;
        }
        let p = (w & !KIND_BITS) as *const Sock;
        // SAFETY: as in get_slow; the write lock keeps every state alive.
        unsafe {
            Arc::increment_strong_count(p);
            v.push((fd as RawFd, Arc::from_raw(p)));
        }
    }
    v
}

/// Makes `fd`, a number smclo just got from the kernel (or the channel's
/// number the program closed), `Internal`, once any close of that
/// number's former file is done with it ([`settle`]). With the write lock
/// held; what the number was is forgotten (returned).
#[must_use = "drop it after the table's lock is released"]
pub fn mark_internal_locked(fd: RawFd) -> FdState {
    if !in_range(fd) {
        return FdState::Unknown;
    }
    settle(fd);
    replace_locked(fd, FdState::Internal)
}

/// Closes internal descriptor `fd` with `close`: `Closing` across the
/// call, `Unknown` after it. The number is free for the program's next
/// `open` or `socket` as soon as it is closed; `Closing` tells `close` and
/// `dup2` of the new file there to wait ([`settle`]) instead of ignoring
/// it or refusing. These are the transitions made without the lock (a
/// Sock may be dropped anywhere, also where the lock is held): between
/// states that are their word alone, by compare-and-swap, so that a state
/// another thread gave the number meanwhile (under the lock) stays. In a
/// [`critical`] section: a handler's `close` or `dup2` of the number would
/// wait for its own thread.
pub(crate) fn close_internal(fd: RawFd, close: impl FnOnce()) {
    let _section = critical::enter();
    let Some(w) = WORDS.get(fd as usize).filter(|_| fd >= 0) else {
        close();
        return;
    };
    let marked = w
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            matches!(v, K_UNKNOWN | K_INTERNAL).then_some(K_CLOSING)
        })
        .is_ok();
    close();
    if marked {
        let _ = w.compare_exchange(K_CLOSING, K_UNKNOWN, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Waits until no connection is between closing `fd` and unmarking it
/// ([`close_internal`]: a few instructions and a `close`).
pub fn settle(fd: RawFd) {
    let mut b = Backoff::new();
    while kind(fd) == Kind::Closing {
        b.snooze();
    }
}

impl Drop for Sock {
    /// Closes the channel, whose number may be one the application closed
    /// while the connection still needed it (`Internal` since), and
    /// hands the hidden TCP socket over to be closed at the next wait
    /// ([`close_hidden`]). A connection that ended in an abort (ours:
    /// `SO_LINGER` 0; the peer's, or the peer gone) closes it now: its TCP
    /// peer may be a program that reads the TCP socket itself (a
    /// connection that could not follow its peer's exec falls back to it)
    /// and waits for this end of stream.
    fn drop(&mut self) {
        let aborted = self.linger0.load(Ordering::Relaxed) || self.conn.ended_in_reset();
        if let Some(&dest) = self.learn.get() {
            if !self.conn.is_passed() {
                smclo::adapter::short::ended(dest, self.conn.was_short());
            }
        }
        close_internal(self.conn.fd(), || self.conn.close_channel());
        if aborted || !smclo::adapter::deferred::close_later(self.tcp) {
            close_hidden(self.tcp);
        }
    }
}

/// Closes a hidden TCP socket and unmarks its number: how
/// [`smclo::adapter::deferred`] closes those a [`Sock`] handed over.
pub fn close_hidden(fd: RawFd) {
    close_internal(fd, || {
        // SAFETY: the hidden socket is ours alone (nobody else has its
        // number: it is internal until unmarked here).
        unsafe { crate::real::close(fd) };
    });
}

/// A reader/writer lock made of one atomic word, so that a `fork` child can
/// reset it (no thread of the parent exists there to release it) and so
/// readers pay one atomic add each way. Not re-entrant: a thread is in a
/// [`critical`] section from the moment it starts taking it, so that the
/// program's signal handlers, which may call our hooks, wait until it is
/// let go.
pub struct Lock(AtomicU32);

const WRITER: u32 = 1 << 31;

/// Guards state changes against reference counting in progress.
pub static LOCK: Lock = Lock(AtomicU32::new(0));

impl Lock {
    /// Shared access for a few instructions.
    #[inline]
    pub fn read(&self) -> ReadGuard<'_> {
        let Some(section) = Self::read_section() else {
            return ReadGuard(self, None);
        };
        let section = Some(section);
        loop {
            if self.0.fetch_add(1, Ordering::Acquire) & WRITER == 0 {
                return ReadGuard(self, section);
            }
            self.0.fetch_sub(1, Ordering::Relaxed);
            let mut b = Backoff::new();
            while self.0.load(Ordering::Relaxed) & WRITER != 0 {
                b.snooze();
            }
        }
    }

    /// Exclusive access (table changes, fork).
    pub fn write(&self) -> WriteGuard<'_> {
        let section = Some(Self::write_section());
        let mut b = Backoff::new();
        loop {
            let v = self.0.load(Ordering::Relaxed);
            if v & WRITER == 0
                && self
                    .0
                    .compare_exchange_weak(v, v | WRITER, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
            b.snooze();
        }
        // Readers hold it for a few instructions: spin first.
        let mut spins = 0u32;
        let mut b = Backoff::new();
        while self.0.load(Ordering::Acquire) & !WRITER != 0 {
            if spins < 128 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                b.snooze();
            }
        }
        WriteGuard(self, section)
    }

    /// Exclusive access if it can be had within `wait`, else `None`. For
    /// `_exit`, which a signal handler may call while its own thread holds
    /// the lock (which would then never be released): `None` at once
    /// then. Async-signal-safe: atomics, `clock_gettime` and `sched_yield`.
    pub fn try_write_for(&self, wait: std::time::Duration) -> Option<WriteGuard<'_>> {
        let section = critical::enter_table()?;
        let start = std::time::Instant::now();
        let timed_out = || {
            std::thread::yield_now();
            start.elapsed() > wait
        };
        loop {
            let v = self.0.load(Ordering::Relaxed);
            if v & WRITER == 0
                && self
                    .0
                    .compare_exchange_weak(v, v | WRITER, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
            if timed_out() {
                return None;
            }
        }
        let guard = WriteGuard(self, Some(section));
        while self.0.load(Ordering::Acquire) & !WRITER != 0 {
            if timed_out() {
                return None; // the guard lets go
            }
        }
        Some(guard)
    }

    /// A reader's section of the lock ([`critical::enter_table`]), or
    /// `None` for a reader in the thread that holds the lock for a `fork`
    /// ([`Lock::write_for_fork`]): the program's fork handlers run in that
    /// thread while it holds it, and their calls on connections read the
    /// table as the lock's holder. Otherwise the lock is not re-entrant:
    /// taking it again in the thread that holds it would wait for ever (a
    /// reader waits for the writer it is, a writer for its own read), so
    /// that is a defect of ours, or a fork handler that changes the table
    /// (closes, duplicates or makes a connection), which the fork's
    /// bookkeeping cannot follow; either aborts the process with its
    /// reason instead of hanging it. The program's signal handlers cannot
    /// cause it ([`critical`] defers them).
    #[inline]
    fn read_section() -> Option<critical::TableSection> {
        match critical::enter_table() {
            Some(s) => Some(s),
            None if FORKING.with(Cell::get) => None,
            None => Self::taken_again(
                "the descriptor table's lock taken again by the thread that holds it",
            ),
        }
    }

    /// See [`Lock::read_section`].
    #[inline]
    fn write_section() -> critical::TableSection {
        critical::enter_table().unwrap_or_else(|| match FORKING.with(Cell::get) {
            true => Self::taken_again(
                "a fork handler (pthread_atfork) changed smclo's descriptor table during fork (closed, duplicated or made a connection, or an epoll set smclo serves), which the fork's bookkeeping does not follow",
            ),
            false => Self::taken_again("the descriptor table's lock taken again by the thread that holds it"),
        })
    }

    #[cold]
    fn taken_again(why: &str) -> ! {
        eprintln!(
            "smclo[{}]: {why}; aborting instead of hanging",
            std::process::id()
        );
        std::process::abort()
    }

    /// Exclusive access across a `fork` (from the preload's prepare
    /// handler to its child handler, or in the parent to the interposed
    /// `fork`'s return, `hooks::process`): the calls the fork handlers that
    /// run meanwhile make in this thread read the table as the lock's
    /// holder ([`Lock::read_section`]).
    pub fn write_for_fork(&self) -> ForkGuard<'_> {
        if FORKING.with(Cell::get) {
            Self::taken_again("a fork handler (pthread_atfork) forked again during fork");
        }
        let g = self.write();
        FORKING.with(|f| f.set(true));
        ForkGuard(Some(g))
    }

    /// Whether this thread holds the lock across a `fork`
    /// ([`Lock::write_for_fork`]): the fork handlers run meanwhile, and
    /// may not change the table.
    pub fn forking() -> bool {
        FORKING.with(Cell::get)
    }

    /// In a `fork` child: only the forking thread exists, and it held the
    /// lock for writing across the fork; start from a clean word, out of
    /// every section.
    pub fn reset_in_child(&self) {
        self.0.store(0, Ordering::Release);
        critical::reset_in_child();
    }
}

/// See [`Lock::read`]. The section ends after the lock is let go (fields
/// drop after `drop`): deferred handlers run without it.
/// No section (`None`): the thread holds the lock for a fork, and this
/// guard stands for nothing.
pub struct ReadGuard<'a>(&'a Lock, Option<critical::TableSection>);
impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        if self.1.is_none() {
            return;
        }
        self.0 .0.fetch_sub(1, Ordering::Release);
    }
}

/// See [`Lock::write`]; its section as [`ReadGuard`]'s.
pub struct WriteGuard<'a>(&'a Lock, Option<critical::TableSection>);
impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if self.1.is_none() {
            return;
        }
        self.0 .0.fetch_and(!WRITER, Ordering::Release);
    }
}

/// See [`Lock::write_for_fork`].
pub struct ForkGuard<'a>(Option<WriteGuard<'a>>);
impl ForkGuard<'_> {
    /// In the fork child: the lock's word and the thread's sections start
    /// clean ([`Lock::reset_in_child`]); nothing is let go.
    pub fn forget_in_child(mut self) {
        FORKING.with(|f| f.set(false));
        if let Some(g) = self.0.take() {
            let lock = g.0;
            std::mem::forget(g);
            lock.reset_in_child();
        }
    }
}
impl Drop for ForkGuard<'_> {
    fn drop(&mut self) {
        FORKING.with(|f| f.set(false));
    }
}

thread_local! {
    /// Whether this thread holds [`LOCK`] for a fork ([`Lock::write_for_fork`]).
    static FORKING: Cell<bool> = const { Cell::new(false) };
}

/// Ends the process with `why`, a fork handler's use of smclo that it
/// cannot serve inside `fork` (instead of waiting for itself for ever).
pub fn abort_in_fork(why: &str) -> ! {
    Lock::taken_again(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    // Numbers far above what the test process opens, one per test: the
    // table is the process's, and tests run in parallel.

    /// The word follows every transition: its kind, the shadow's address
    /// the fast path reads, the count of epoll states; forgetting hands
    /// the old state back and leaves the word 0.
    #[test]
    fn the_word_mirrors_the_state() {
        let fd = 60_001;
        assert_eq!(kind(fd), Kind::Unknown);
        let epolls = epoll_count();
        {
            let _g = LOCK.write();
            drop(replace_locked(fd, FdState::candidate()));
        }
        assert_eq!(kind(fd), Kind::Candidate);
        assert!(known(fd) && get(fd).is_none() && shadow(fd).is_none());
        let sh = Arc::<Shadow>::default();
        {
            let _g = LOCK.write();
            drop(replace_locked(fd, FdState::Epoll(sh.clone())));
        }
        assert_eq!(kind(fd), Kind::Epoll);
        assert!(Arc::ptr_eq(&shadow(fd).expect("the set's shadow"), &sh));
        assert_eq!(epoll_count(), epolls + 1);
        let old = {
            let _g = LOCK.write();
            replace_locked(fd, FdState::Unknown)
        };
        assert!(matches!(old, FdState::Epoll(ref s) if Arc::ptr_eq(s, &sh)));
        assert_eq!(epoll_count(), epolls);
        assert!(!known(fd) && shadow(fd).is_none());
        drop(old);
        assert_eq!(Arc::strong_count(&sh), 1, "the table holds no count");
    }

    /// A number whose state changes within its kind (a pending connect's
    /// epoll registration recorded) never leaves that kind's count, which
    /// waits read without the lock: another thread's `epoll_wait` that
    /// saw no pending connect slept in the kernel without driving the
    /// handshake (`tests/epoll_swap.rs`).
    #[test]
    fn a_number_that_stays_pending_never_leaves_the_count() {
        use std::sync::atomic::AtomicBool;
        let fd = 60_003;
        let pending = || FdState::Pending {
            connecting: Arc::new(Connecting {
                undecided: Mutex::new(None),
                early: false,
                announced: false,
            }),
            epoll: Vec::new(),
            writable: false,
        };
        {
            let _g = LOCK.write();
            drop(replace_locked(fd, pending()));
        }
        let (stop, seen_zero) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    if pending_count() == 0 {
                        seen_zero.store(true, Ordering::Relaxed);
                    }
                }
            });
            for _ in 0..200_000 {
                let _g = LOCK.write();
                transition_locked(fd, |s| (s, ()));
            }
            stop.store(true, Ordering::Relaxed);
        });
        let _g = LOCK.write();
        drop(replace_locked(fd, FdState::Unknown));
        assert!(
            !seen_zero.load(Ordering::Relaxed),
            "the count read 0 while the number stayed pending"
        );
    }

    /// A connection's close of an internal number (no lock) ends it
    /// `Unknown`, unless the number got another state meanwhile (the
    /// kernel gave the freed number out, and it was made a candidate):
    /// that state stays.
    #[test]
    fn closing_an_internal_number_keeps_a_state_given_meanwhile() {
        let fd = 60_002;
        let _ = {
            let _g = LOCK.write();
            mark_internal_locked(fd)
        };
        assert_eq!(kind(fd), Kind::Internal);
        close_internal(fd, || assert_eq!(kind(fd), Kind::Closing));
        assert_eq!(kind(fd), Kind::Unknown);
        settle(fd);

        let _ = {
            let _g = LOCK.write();
            mark_internal_locked(fd)
        };
        close_internal(fd, || {
            let _g = LOCK.write();
            drop(replace_locked(fd, FdState::candidate()));
        });
        assert_eq!(kind(fd), Kind::Candidate);
        let _g = LOCK.write();
        drop(replace_locked(fd, FdState::Unknown));
    }

    /// `_exit` in a signal handler may interrupt a thread that holds the
    /// lock, for reading or writing: trying must give up, in bounded time.
    #[test]
    fn try_write_for_gives_up_on_a_held_lock() {
        let l = Lock(AtomicU32::new(0));
        let wait = Duration::from_millis(20);
        let in_other_thread = |f: &(dyn Fn() + Sync)| std::thread::scope(|s| drop(s.spawn(f)));
        {
            let _w = l.write();
            // This thread holds it: at once.
            assert!(l.try_write_for(Duration::from_secs(60)).is_none());
            in_other_thread(&|| {
                let t0 = Instant::now();
                assert!(l.try_write_for(wait).is_none());
                assert!(t0.elapsed() < Duration::from_secs(2));
            });
        }
        {
            let _r = l.read();
            in_other_thread(&|| assert!(l.try_write_for(wait).is_none()));
            // Giving up left the reader's lock as it was: readers still enter.
            std::thread::scope(|s| {
                s.spawn(|| drop(l.read()));
            });
        }
        let g = l.try_write_for(wait).expect("a free lock is taken");
        drop(g);
        assert_eq!(l.0.load(Ordering::Relaxed), 0);
    }
}
