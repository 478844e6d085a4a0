//! The DMB table: its entries, what `smclo ss` reads of them, and
//! attaching a peer's DMB.
//!
//! A DMB is a sealed memfd (never named in the directory: its descriptor
//! goes to the peer over the handshake's UNIX channel, see
//! [`crate::handshake`]) plus an entry in the DMB table, found by token.
//! The table is what the stats are computed from: `dmbs_cnt`,
//! `conns_active` and `xfer_bytes` remain right after kill -9 because dead
//! owners' entries are reclaimed (and their byte counts folded into
//! `xfer_bytes_retired`).

use super::{euid, Device, Role};
use crate::access::Shape;
use crate::dmb::Dmb;
use crate::error::Result;
use crate::owner::Owner;
use crate::table::{Gen, Head, Holder, State};
use smclo_wire::device_layout as layout;
use smclo_wire::ends;
use std::fs::File;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// One DMB table entry: two cache lines, the first changed by the sending
/// side of the data path (`tx_bytes`), the second by the receiving side
/// (`rx_bytes`), so that a reader and a writer thread of one connection do
/// not share a line; the rest is written when the connection is set up,
/// shut down or closed, and read by `smclo ss` ([`crate::ss`]).
#[repr(C)]
pub(crate) struct DmbEntry {
    pub(super) head: Head,
    pub(super) token: AtomicU64,
    pub(super) peer_token: AtomicU64,
    pub(super) ring_len: AtomicU32,
    pub(super) role: AtomicU32,
    /// Bytes this end wrote into the peer's ring.
    pub(super) tx_bytes: AtomicU64,
    _pad: AtomicU64,
    /// Bytes this end's application consumed from its own ring.
    pub(super) rx_bytes: AtomicU64,
    /// The TCP connection's local and peer addresses ([`ends`]).
    pub(super) ends: [AtomicU64; ends::WORDS],
    /// [`end_flags`](smclo_wire::device_layout::end_flags).
    pub(super) flags: AtomicU64,
    _reserved: AtomicU64,
}

const _: () = assert!(std::mem::offset_of!(DmbEntry, rx_bytes) == 64);

/// A published DMB table entry as [`Device::published_ends`] read it.
pub(crate) struct RawEnd {
    /// Part of an established connection (otherwise registered for a
    /// handshake that has not finished here).
    pub connected: bool,
    pub owner: Owner,
    pub role: Role,
    pub token: u64,
    pub peer_token: u64,
    pub ring_len: u32,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    /// [`ends`]-packed addresses.
    pub ends: [u64; ends::WORDS],
    /// [`end_flags`](smclo_wire::device_layout::end_flags).
    pub flags: u64,
}

/// DMB entry states (published; [`crate::table`] has FREE and WRITING).
pub(super) const DMB_REGISTERED: State = State(2);
pub(super) const DMB_CONNECTED: State = State(3);
/// Both published states, for moves that accept either.
pub(super) const DMB_STATES: [State; 2] = [DMB_REGISTERED, DMB_CONNECTED];

const _: () = assert!(std::mem::size_of::<DmbEntry>() == layout::DMB_ENTRY_LEN as usize);

impl Device {
    pub(crate) fn dmb_entry(&self, i: usize) -> &DmbEntry {
        debug_assert!(i < layout::DMB_ENTRIES as usize);
        self.at(layout::DMB_TABLE_OFF as usize
            + (i % layout::DMB_ENTRIES as usize) * layout::DMB_ENTRY_LEN as usize)
    }

    /// DMB table entry `i` if it holds incarnation `gen` (not freed since).
    pub(super) fn live_entry(&self, i: usize, gen: Gen) -> Option<&DmbEntry> {
        let e = self.dmb_entry(i);
        let w = e.head.word();
        (w.gen() == gen && !w.is_free()).then_some(e)
    }

    /// Every published DMB table entry (connected: one per SMC-D connection
    /// end; registered: a handshake under way), each read consistently
    /// with its word; dead owners' entries are reclaimed first, as for
    /// [`Device::stats`].
    pub(crate) fn published_ends(&self) -> Vec<RawEnd> {
        self.reclaim_dead_dmbs();
        (0..layout::DMB_ENTRIES as usize)
            .filter_map(|i| {
                let e = self.dmb_entry(i);
                let w = e.head.word();
                if !DMB_STATES.contains(&w.state()) {
                    return None;
                }
                let Holder::Known(owner) = e.head.holder(w)? else {
                    return None;
                };
                let role = match e.role.load(Ordering::Relaxed) {
                    r if r == Role::Server as u32 => Role::Server,
                    _ => Role::Client,
                };
                // Read while the word (the incarnation judged) is unchanged.
                let (_, end) = e.head.read(
                    |now| now == w,
                    || RawEnd {
                        connected: w.state() == DMB_CONNECTED,
                        owner,
                        role,
                        token: e.token.load(Ordering::Relaxed),
                        peer_token: e.peer_token.load(Ordering::Relaxed),
                        ring_len: e.ring_len.load(Ordering::Relaxed),
                        tx_bytes: e.tx_bytes.load(Ordering::Relaxed),
                        rx_bytes: e.rx_bytes.load(Ordering::Relaxed),
                        ends: e.ends.each_ref().map(|a| a.load(Ordering::Relaxed)),
                        flags: e.flags.load(Ordering::Acquire),
                    },
                )?;
                Some(end)
            })
            .collect()
    }

    /// Number of DMB table entries not FREE, whatever their owner's state:
    /// after a sweep this equals `stats().dmbs_cnt` (diagnostics and tests
    /// use it to see that dead owners' entries were really reclaimed).
    pub fn dmb_entries_in_use(&self) -> usize {
        (0..layout::DMB_ENTRIES as usize)
            .filter(|&i| !self.dmb_entry(i).head.word().is_free())
            .count()
    }

    /// Maps the peer's DMB `token` from the memfd `fd` it passed over the
    /// handshake channel ([`Dmb::attach_peer`] checks seals, owner, size,
    /// header, token and GID); a refusal is an [`Error::Attach`](crate::Error::Attach).
    pub fn attach_dmb(&self, token: u64, fd: File) -> Result<Dmb> {
        Dmb::attach_peer(fd, token, self.gid, |uid| self.may_own_dmb(uid))
    }

    /// Maps the peer's DMB `token` whose memfd is `id`, owned by `owner`,
    /// from a mapping this process keeps of it since the peer last passed
    /// it ([`crate::dmb::pool`]); `None` when it keeps none (the peer must pass
    /// the descriptor).
    pub fn attach_cached_dmb(&self, id: (u64, u64), token: u64, owner: Owner) -> Option<Dmb> {
        Dmb::attach_cached(id, token, self.gid, (owner.pid, owner.start))
    }

    /// Whether a peer's DMB (a memfd, owned by the uid that created it) may
    /// belong to `uid`: ours on a private device; on a group device any
    /// uid, as the handshake channel's credential check
    /// ([`crate::access::check_peer`]) already vouched for the peer that passed it.
    pub(crate) fn may_own_dmb(&self, uid: u32) -> bool {
        uid == euid() || matches!(self.shape, Shape::Group { .. })
    }
}
