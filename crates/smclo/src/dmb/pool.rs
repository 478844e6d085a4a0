//! Per-process reuse of our own DMBs (docs/handshake.md, "Connection
//! setup cost"), like the kernel's reuse of DMBs within a link group.
//!
//! Creating a DMB (memfd, size, header, seals, three `mmap`s, page faults)
//! and destroying it (`munmap`, freeing the pages) was half the cost of a
//! connection. So when one of our DMBs is dropped (its connection closed, or
//! a handshake failed), the mapping and its memfd come here instead:
//!
//! - *pending* while a peer still maps it (its attach record, written by
//!   the attacher into the header, is non-zero);
//! - *free* once the record is 0 (the peer dropped its mapping): the next
//!   registration of the same ring size and device takes it, with a fresh
//!   token and empty cursor words ([`Dmb::renew`]).
//!
//! A peer that dies without clearing its record (kill -9), or that forked
//! while it mapped the DMB (a child may still write into it), leaves the
//! DMB pending for good; such DMBs are unmapped when the pending list is
//! full or they have been idle too long (below). A dead attacher is deliberately not taken as detached: its fork
//! children may still map the DMB.
//!
//! The other side of the same reuse: the peer's DMBs that we mapped. When a
//! connection ends, the attacher clears its attach record but keeps the
//! idle mapping, keyed by the memfd's identity (device, inode), for the next
//! time the peer passes the same memfd (its pool hands it out again): then
//! attaching costs no `mmap`, no header read and no page faults. The cached
//! mapping keeps the file alive, so the identity cannot be reused by another
//! file meanwhile. At most [`PEER_MAX`] are kept; when full, mappings of
//! owners that are gone are dropped first, then the oldest.
//!
//! Bounds: [`FREE_MAX`] free DMBs per ring size, [`PENDING_MAX`] pending
//! ones, [`PEER_MAX`] peer mappings, and, over all three, the bytes of
//! [`PoolLimits::bytes`] (`SMCLO_POOL_BYTES`): beyond them, the oldest is
//! unmapped. Whatever stayed unused for [`PoolLimits::idle`]
//! (`SMCLO_POOL_IDLE_MS`) is unmapped at the next pool operation; there is
//! no background thread (it would run in every program smclo is loaded
//! into, and across `fork`), so a process that stops making connections
//! keeps at most the byte bound. A `fork` empties the pool in both
//! processes (the fork generation changes; mappings from before a fork are
//! shared with the child and are never reused). The lock is only ever
//! tried: a fork child never waits for a lock held by a thread that does
//! not exist in it; contention only costs a fresh DMB or an unmap. Unmaps
//! happen after the lock is released.

use crate::config::PoolLimits;
use crate::dmb::Dmb;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Free DMBs kept per ring size.
pub const FREE_MAX: usize = 64;
/// DMBs kept while their peer still maps them.
pub const PENDING_MAX: usize = 128;
/// Idle mappings of peers' DMBs kept.
pub const PEER_MAX: usize = 64;

/// What a kept DMB is waiting for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Ours, nobody maps it: ready for reuse.
    Free,
    /// Ours, a peer still maps it.
    Pending,
    /// An idle mapping of a peer's DMB, by its memfd's (device, inode).
    Peer((u64, u64)),
}

/// A DMB the pool keeps, and since when it is unused.
struct Kept {
    kind: Kind,
    dmb: Dmb,
    since: Instant,
}

impl Kept {
    /// The memory it holds: header page and ring (mapped twice, stored once).
    fn bytes(&self) -> u64 {
        smclo_wire::dmb_header::HEADER_LEN as u64 + self.dmb.ring_len() as u64
    }
}

struct Pool {
    fork_gen: u64,
    /// In the order they came in.
    kept: Vec<Kept>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    fork_gen: 0,
    kept: Vec::new(),
});

/// The limits, read from the environment once per process (a malformed
/// value is reported by [`crate::config::Config::from_env`]; here it means
/// the default).
pub(crate) fn limits() -> PoolLimits {
    static L: OnceLock<PoolLimits> = OnceLock::new();
    *L.get_or_init(|| PoolLimits::from_env().unwrap_or_default())
}

fn detached(d: &Dmb) -> bool {
    crate::dmb::attach_record::reusable(d.attach_word())
}

/// Unmapped when dropped, after the pool's lock is released.
type Out = Vec<Kept>;

impl Pool {
    /// Locks the pool (tried only, see the module doc) for an operation:
    /// forgets everything from an older fork generation (the memory lives
    /// on in the other process if it still uses it) and what stayed unused
    /// too long, into `out`.
    fn lock(out: &mut Out) -> Option<std::sync::MutexGuard<'static, Pool>> {
        let mut p = POOL.try_lock().ok()?;
        let gen = crate::owner::fork_gen();
        if p.fork_gen != gen {
            out.append(&mut p.kept);
            p.fork_gen = gen;
        }
        let (idle, now) = (limits().idle, Instant::now());
        out.extend(
            p.kept
                .extract_if(.., |k| now.duration_since(k.since) >= idle),
        );
        Some(p)
    }

    fn count(&self, f: impl Fn(&Kept) -> bool) -> usize {
        self.kept.iter().filter(|k| f(k)).count()
    }

    /// Adds `k`, then unmaps the longest unused entries until the pool
    /// holds at most [`PoolLimits::bytes`].
    fn keep(&mut self, k: Kept, out: &mut Out) {
        self.kept.push(k);
        let mut held: u64 = self.kept.iter().map(Kept::bytes).sum();
        while held > limits().bytes {
            let Some(i) = (0..self.kept.len()).min_by_key(|&i| self.kept[i].since) else {
                return;
            };
            held -= self.kept[i].bytes();
            out.push(self.kept.remove(i));
        }
    }

    /// Turns pending DMBs whose peer has detached into free ones, within
    /// [`FREE_MAX`] per ring size.
    fn promote(&mut self, out: &mut Out) {
        let mut i = 0;
        while i < self.kept.len() {
            let k = &self.kept[i];
            if k.kind != Kind::Pending || !detached(&k.dmb) {
                i += 1;
                continue;
            }
            let len = k.dmb.ring_len();
            if self.count(|x| x.kind == Kind::Free && x.dmb.ring_len() == len) >= FREE_MAX {
                out.push(self.kept.remove(i));
            } else {
                self.kept[i].kind = Kind::Free;
                i += 1;
            }
        }
    }
}

/// Which free DMB [`take`] prefers: one the peer keeps a mapping of.
#[derive(Clone, Copy, Debug, Default)]
pub struct Prefer {
    /// The one whose memfd has this identity (the client named it).
    pub memfd: Option<(u64, u64)>,
    /// Else the most recently used of those whose last connection was
    /// with this process ([`crate::dmb::Own::last_peer`]).
    pub last_peer: Option<u32>,
}

/// Takes a free DMB of `ring_len` bytes on device `gid`, renewed with
/// `token`, ready to be registered: the one `prefer` names if one is free,
/// else the most recently used.
pub(crate) fn take(ring_len: u32, gid: u64, token: u64, prefer: Prefer) -> Option<Dmb> {
    let mut out = Out::new();
    let mut p = Pool::lock(&mut out)?;
    p.promote(&mut out);
    let fits =
        |k: &Kept| k.kind == Kind::Free && k.dmb.ring_len() == ring_len && k.dmb.gid() == gid;
    let preferred = prefer
        .memfd
        .and_then(|id| {
            p.kept
                .iter()
                .position(|k| fits(k) && k.dmb.own_id() == Some(id))
        })
        .or_else(|| {
            let pid = prefer.last_peer.filter(|&pid| pid != 0)?;
            p.kept
                .iter()
                .rposition(|k| fits(k) && k.dmb.last_peer() == pid)
        });
    // The most recently used one: its pages are the likeliest to be warm,
    // and the others age towards the idle trim.
    let i = preferred.or_else(|| p.kept.iter().rposition(fits));
    let mut d = p.kept.remove(i?).dmb;
    drop(p);
    if !d.header_intact() {
        // A peer zeroed it (a hole punched in its memfd): not reused; the
        // caller registers a new one.
        crate::debug!("a pooled DMB's header was overwritten: not reused");
        return None;
    }
    d.renew(token);
    let own = d.own_mut().expect("pooled DMBs are our own");
    own.reuse = true;
    own.fork_gen = crate::owner::fork_gen();
    Some(d)
}

/// Keeps one of our DMBs that was just dropped (called by `Dmb`'s drop,
/// with a copy that really unmaps when dropped).
pub(crate) fn put(d: Dmb) {
    let mut out = Out::new();
    let Some(mut p) = Pool::lock(&mut out) else {
        return;
    };
    let kind = if detached(&d) {
        Kind::Free
    } else {
        Kind::Pending
    };
    let pending = |k: &Kept| k.kind == Kind::Pending;
    if kind == Kind::Free {
        let len = d.ring_len();
        if p.count(|k| k.kind == Kind::Free && k.dmb.ring_len() == len) >= FREE_MAX {
            return; // `d` is unmapped, after the lock is released
        }
    } else if p.count(pending) >= PENDING_MAX {
        p.promote(&mut out);
        if p.count(pending) >= PENDING_MAX {
            let oldest = p.kept.iter().position(pending);
            out.extend(oldest.map(|i| p.kept.remove(i)));
        }
    }
    let since = Instant::now();
    p.keep(
        Kept {
            kind,
            dmb: d,
            since,
        },
        &mut out,
    );
}

/// Unmaps every free and pending DMB, closing their memfds: for a process
/// short of descriptors ([`crate::fdnum`]).
pub(crate) fn shed() {
    let mut out = Out::new();
    if let Some(mut p) = Pool::lock(&mut out) {
        out.extend(p.kept.extract_if(.., |k| !matches!(k.kind, Kind::Peer(_))));
    }
}

/// Takes the idle mapping of the peer DMB whose memfd is `id` (device,
/// inode), if we keep one.
pub(crate) fn take_peer(id: (u64, u64)) -> Option<Dmb> {
    let mut out = Out::new();
    let mut p = Pool::lock(&mut out)?;
    let i = p.kept.iter().position(|k| k.kind == Kind::Peer(id))?;
    Some(p.kept.remove(i).dmb)
}

/// Takes the idle mapping of a peer DMB owned by process `pid` that was
/// used last, with its memfd's identity: for a client to name in its
/// proposal (the server may reuse that DMB, passing no descriptor). Put it
/// back with [`put_peer`] if it is not used.
pub(crate) fn take_peer_of(pid: u32) -> Option<((u64, u64), Dmb)> {
    let mut out = Out::new();
    let mut p = Pool::lock(&mut out)?;
    let i = p
        .kept
        .iter()
        .rposition(|k| matches!(k.kind, Kind::Peer(_)) && k.dmb.owner_pid() == pid)?;
    let k = p.kept.remove(i);
    match k.kind {
        Kind::Peer(id) => Some((id, k.dmb)),
        _ => None,
    }
}

/// Keeps an idle mapping of a peer's DMB (called by `Dmb`'s drop, with a
/// copy that really unmaps when dropped).
pub(crate) fn put_peer(id: (u64, u64), d: Dmb) {
    let mut out = Out::new();
    let Some(mut p) = Pool::lock(&mut out) else {
        return;
    };
    let is_peer = |k: &Kept| matches!(k.kind, Kind::Peer(_));
    if p.count(is_peer) >= PEER_MAX {
        // Mappings of owners that are gone first.
        let gone = |k: &mut Kept| {
            is_peer(k) && !crate::owner::Owner::local(k.dmb.owner_pid(), 0).pid_exists()
        };
        out.extend(p.kept.extract_if(.., gone));
    }
    if p.count(is_peer) >= PEER_MAX {
        let oldest = p.kept.iter().position(is_peer);
        out.extend(oldest.map(|i| p.kept.remove(i)));
    }
    let since = Instant::now();
    p.keep(
        Kept {
            kind: Kind::Peer(id),
            dmb: d,
            since,
        },
        &mut out,
    );
}

/// Our own DMBs that keep their memfd, in use or pooled: how many, and
/// their bytes.
static KEPT: Mutex<(usize, u64)> = Mutex::new((0, 0));

fn kept() -> std::sync::MutexGuard<'static, (usize, u64)> {
    KEPT.lock().unwrap_or_else(|p| p.into_inner())
}

/// One of our own DMBs that keeps its memfd (held next to it): the memfd is
/// what passes the DMB to its next peer when the pool reuses it, and a
/// descriptor of the program's while it is kept.
#[derive(Debug)]
pub(crate) struct KeptMemfd(u64);

impl KeptMemfd {
    /// Counts a DMB of `ring_len` bytes.
    pub(crate) fn new(ring_len: u32) -> KeptMemfd {
        let bytes = smclo_wire::dmb_header::HEADER_LEN as u64 + ring_len as u64;
        let mut k = kept();
        k.0 += 1;
        k.1 += bytes;
        KeptMemfd(bytes)
    }
}

impl Drop for KeptMemfd {
    fn drop(&mut self) {
        let mut k = kept();
        k.0 -= 1;
        k.1 -= self.0;
    }
}

/// Whether the pool could take back all of our DMBs that keep their memfd
/// (the one asking included): at most [`FREE_MAX`] of them and
/// [`PoolLimits::bytes`] in all. A DMB beyond that is not going back to
/// the pool, so its memfd is closed once the peer has it.
pub(crate) fn may_keep_memfd() -> bool {
    let (n, bytes) = *kept();
    n <= FREE_MAX && bytes <= limits().bytes
}

/// How many DMBs the pool holds (free, pending, idle peer mappings): for
/// tests and diagnostics.
pub fn held() -> (usize, usize, usize) {
    match POOL.try_lock() {
        Ok(p) => (
            p.count(|k| k.kind == Kind::Free),
            p.count(|k| k.kind == Kind::Pending),
            p.count(|k| matches!(k.kind, Kind::Peer(_))),
        ),
        Err(_) => (0, 0, 0),
    }
}
