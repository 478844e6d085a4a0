//! Per-process reuse of our own DMBs (ARCHITECTURE.md, "Connection setup
//! cost"), like the kernel's reuse of DMBs within a link group.
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
//! full. A dead attacher is deliberately not taken as detached: its fork
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
//! ones; beyond them, the oldest is unmapped. A `fork` empties the pool in
//! both processes (the fork generation changes; mappings from before a
//! fork are shared with the child and are never reused). The lock is only
//! ever tried: a fork child never waits for a lock held by a thread that does
//! not exist in it; contention only costs a fresh DMB or an unmap.

use crate::dmb::Dmb;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Free DMBs kept per ring size.
pub const FREE_MAX: usize = 64;
/// DMBs kept while their peer still maps them.
pub const PENDING_MAX: usize = 128;
/// Idle mappings of peers' DMBs kept.
pub const PEER_MAX: usize = 64;

struct Pool {
    fork_gen: u64,
    free: Vec<Dmb>,
    pending: Vec<Dmb>,
    /// Idle mappings of peers' DMBs by (device, inode), oldest first.
    peers: Vec<((u64, u64), Dmb)>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    fork_gen: 0,
    free: Vec::new(),
    pending: Vec::new(),
    peers: Vec::new(),
});

fn detached(d: &Dmb) -> bool {
    d.attach_word().load(Ordering::SeqCst) == 0
}

impl Pool {
    /// Forgets everything from an older fork generation (unmapped here; the
    /// memory lives on in the other process if it still uses it).
    fn check_gen(&mut self, gen: u64) {
        if self.fork_gen != gen {
            self.free.clear();
            self.pending.clear();
            self.peers.clear();
            self.fork_gen = gen;
        }
    }

    /// Moves pending DMBs whose peer has detached to the free list.
    fn promote(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            if detached(&self.pending[i]) {
                let d = self.pending.swap_remove(i);
                self.add_free(d);
            } else {
                i += 1;
            }
        }
    }

    fn add_free(&mut self, d: Dmb) {
        let same = self
            .free
            .iter()
            .filter(|x| x.ring_len() == d.ring_len())
            .count();
        if same >= FREE_MAX {
            return; // dropped: unmapped
        }
        self.free.push(d);
    }
}

/// Takes a free DMB of `ring_len` bytes on device `gid`, renewed with
/// `token`, ready to be registered.
pub(crate) fn take(ring_len: u32, gid: u64, token: u64) -> Option<Dmb> {
    let gen = crate::owner::fork_gen();
    let mut p = POOL.try_lock().ok()?;
    p.check_gen(gen);
    p.promote();
    let i = p
        .free
        .iter()
        .rposition(|d| d.ring_len() == ring_len && d.gid() == gid)?;
    let mut d = p.free.swap_remove(i);
    drop(p);
    d.renew(token);
    let own = d.own_mut().expect("pooled DMBs are our own");
    own.reuse = true;
    own.fork_gen = gen;
    Some(d)
}

/// Keeps one of our DMBs that was just dropped (called by `Dmb`'s drop,
/// with a copy that really unmaps when dropped).
pub(crate) fn put(d: Dmb) {
    let gen = crate::owner::fork_gen();
    let Ok(mut p) = POOL.try_lock() else { return };
    p.check_gen(gen);
    if detached(&d) {
        p.add_free(d);
    } else {
        if p.pending.len() >= PENDING_MAX {
            p.promote();
        }
        if p.pending.len() >= PENDING_MAX {
            p.pending.remove(0);
        }
        p.pending.push(d);
    }
}

/// Unmaps every free and pending DMB, closing their memfds: for a process
/// short of descriptors ([`crate::fdnum`]).
pub(crate) fn shed() {
    let shed = match POOL.try_lock() {
        Ok(mut p) => {
            let mut v = std::mem::take(&mut p.free);
            v.append(&mut p.pending);
            v
        }
        Err(_) => return,
    };
    drop(shed); // outside the lock: the copies unmap
}

/// Takes the idle mapping of the peer DMB whose memfd is `id` (device,
/// inode), if we keep one.
pub(crate) fn take_peer(id: (u64, u64)) -> Option<Dmb> {
    let gen = crate::owner::fork_gen();
    let mut p = POOL.try_lock().ok()?;
    p.check_gen(gen);
    let i = p.peers.iter().position(|(x, _)| *x == id)?;
    Some(p.peers.remove(i).1)
}

/// Keeps an idle mapping of a peer's DMB (called by `Dmb`'s drop, with a
/// copy that really unmaps when dropped).
pub(crate) fn put_peer(id: (u64, u64), d: Dmb) {
    let gen = crate::owner::fork_gen();
    let Ok(mut p) = POOL.try_lock() else { return };
    p.check_gen(gen);
    if p.peers.len() >= PEER_MAX {
        p.peers
            .retain(|(_, d)| crate::owner::Owner::local(d.owner_pid(), 0).pid_exists());
    }
    if p.peers.len() >= PEER_MAX {
        p.peers.remove(0);
    }
    p.peers.push((id, d));
}

/// How many DMBs the pool holds (free, pending, idle peer mappings): for
/// tests and diagnostics.
pub fn held() -> (usize, usize, usize) {
    match POOL.try_lock() {
        Ok(p) => (p.free.len(), p.pending.len(), p.peers.len()),
        Err(_) => (0, 0, 0),
    }
}
