//! The fallback table: TCP connections that fell back, while the
//! descriptor they were connected or accepted on is open, for `smclo ss -a`.
//!
//! A connection that stays TCP costs a claim in shared memory, and a
//! system call or two for the addresses its caller does not know
//! ([`Known`]; a server that decides as it accepts knows both from the
//! saved SYN): the caller keeps the [`FallbackRecord`] with the
//! descriptor, and dropping it frees the entry. A client lists only
//! connections to smclo listeners ([`client_lists`]): a connection to a
//! plain server or another host costs nothing. A full table (or a full
//! window of it) only leaves the connection unlisted. Entries are kept with
//! the protocol of [`crate::table`], so a dead owner's are reclaimed
//! ([`crate::device::Device::sweep`], `smclo ss`).

use crate::device::{Device, Role};
use crate::owner::Owner;
use crate::table::{Head, Holder, Judge, State, Ticket};
use smclo_wire::device_layout as layout;
use smclo_wire::ends;
use smclo_wire::reason::Reason;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Entries examined from the start [`record`] picks before giving up on
/// recording.
pub const PROBE: usize = 64;

const OPEN: State = State(2);
/// Where the reason index and the role sit in the packed ends' last word.
const REASON_SHIFT: u32 = ends::TABLE_BITS_SHIFT;
const ROLE_SHIFT: u32 = ends::TABLE_BITS_SHIFT + 8;

/// One fallback entry (one cache line).
#[repr(C)]
pub(crate) struct FallbackEntry {
    head: Head,
    /// Packed ends; the table bits hold the reason index and the role.
    ends: [AtomicU64; ends::WORDS],
}

const _: () = assert!(std::mem::size_of::<FallbackEntry>() == layout::FALLBACK_ENTRY_LEN as usize);

fn entry(dev: &Device, i: usize) -> &FallbackEntry {
    let i = i % layout::FALLBACK_ENTRIES as usize;
    dev.at(layout::FALLBACK_OFF as usize + i * layout::FALLBACK_ENTRY_LEN as usize)
}

/// A recorded fallback connection; dropping it (in the process that owns
/// the entry) removes it from the table. A copy inherited through `fork`
/// does nothing when dropped in the child.
#[derive(Debug)]
pub struct FallbackRecord {
    dev: Arc<Device>,
    idx: usize,
    ticket: Ticket,
}

impl Drop for FallbackRecord {
    fn drop(&mut self) {
        let e = entry(&self.dev, self.idx);
        if let Some(c) = e.head.release(self.ticket, &Owner::current()) {
            e.head.free(c);
        }
    }
}

/// What the caller knows of a connection's addresses; [`record`] asks
/// the socket for the others.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Known {
    /// The connection's local address.
    pub local: Option<SocketAddr>,
    /// Its peer's address.
    pub peer: Option<SocketAddr>,
}

impl Known {
    /// Only the peer is known (a client's destination, `accept`'s address).
    pub fn peer(peer: Option<SocketAddr>) -> Known {
        Known { local: None, peer }
    }
}

/// Records the TCP connection on `fd`, which fell back for `reason` on
/// `side`: its addresses as `known`, the others asked of the socket
/// (`getsockname`, `getpeername`). `None` when the socket has no addresses
/// (not connected) or no entry is free in the window probed.
pub fn record(
    dev: &Device,
    fd: RawFd,
    side: Role,
    reason: Reason,
    known: Known,
) -> Option<FallbackRecord> {
    let local = match known.local {
        Some(l) => l,
        None => crate::sockaddr::local(fd).ok()?,
    };
    let peer = match known.peer {
        Some(p) => p,
        None => crate::sockaddr::peer(fd).ok()?,
    };
    let mut words = ends::pack(local, peer);
    words[4] |= (reason.index() as u64) << REASON_SHIFT | (side as u64) << ROLE_SHIFT;
    let me = Owner::current();
    let start = start_of(me, fd);
    let (idx, claim) = (0..PROBE).find_map(|k| {
        let i = (start + k) % layout::FALLBACK_ENTRIES as usize;
        entry(dev, i).head.claim(&me).map(|c| (i, c))
    })?;
    let e = entry(dev, idx);
    for (cell, w) in e.ends.iter().zip(words) {
        cell.store(w, Ordering::Relaxed);
    }
    let ticket = e.head.publish(claim, OPEN);
    Some(FallbackRecord {
        dev: dev.arc(),
        idx,
        ticket,
    })
}

/// Where [`record`] starts looking for a free entry for descriptor `fd`
/// of `me`: spread over the table by process and descriptor (a hash, two
/// multiplications), so that processes rarely probe the same entries, and
/// a descriptor number reused for the next connection finds the entry
/// its last one freed.
fn start_of(me: Owner, fd: RawFd) -> usize {
    const BITS: u32 = layout::FALLBACK_ENTRIES.trailing_zeros();
    const _: () = assert!(layout::FALLBACK_ENTRIES.is_power_of_two());
    // The pid is mixed over all bits before the descriptor joins it, and
    // the index is the product's top bits, which every bit reaches: one
    // multiplication of `pid << 32 | fd` placed pids 1024 apart at the
    // same entries and neighbouring pids 21 entries apart.
    let fib = crate::numhash::fib;
    (fib(fib(u64::from(me.pid)) ^ u64::from(fd as u32)) >> (64 - BITS)) as usize
}

/// Whether a client that declined with `r` before proposing lists its
/// connection: not when its destination has no smclo listener (PEERNOSMC),
/// the device is off (NOSMCDDEV), its last connections there were short
/// (SHORT) or its process uses io_uring (IO_URING), all decided before the
/// listener lookup, so that such a connection costs no system call; a
/// client that proposed lists whatever the outcome.
pub fn client_lists(r: Reason) -> bool {
    !matches!(
        r,
        Reason::PeerNoSmc | Reason::NoSmcdDev | Reason::Short | Reason::IoUring
    )
}

/// A recorded fallback connection, as [`open`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FallbackInfo {
    /// The process that connected or accepted it.
    pub owner: Owner,
    /// Which end it is.
    pub role: Role,
    /// The TCP connection's local address.
    pub local: SocketAddr,
    /// The TCP connection's peer address.
    pub peer: SocketAddr,
    /// Why it stayed TCP.
    pub reason: Reason,
}

/// Every recorded fallback connection of a live owner, in table order;
/// frees dead owners' entries.
pub fn open(dev: &Device) -> Vec<FallbackInfo> {
    let mut judge = Judge::new(dev.dir());
    (0..layout::FALLBACK_ENTRIES as usize)
        .filter_map(|i| {
            let e = entry(dev, i);
            let (w, words) = e.head.read(
                |w| w.state() == OPEN,
                || e.ends.each_ref().map(|a| a.load(Ordering::Relaxed)),
            )?;
            if let Some(c) = judge.reclaim(&e.head, w) {
                e.head.free(c);
                return None;
            }
            let Some(Holder::Known(owner)) = e.head.holder(w) else {
                return None;
            };
            let (local, peer) = ends::unpack(&words)?;
            let reason = *Reason::ALL.get((words[4] >> REASON_SHIFT) as u8 as usize)?;
            let role = match (words[4] >> ROLE_SHIFT) as u8 {
                r if r == Role::Server as u8 => Role::Server,
                _ => Role::Client,
            };
            Some(FallbackInfo {
                owner,
                role,
                local,
                peer,
                reason,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Processes whose pids are 1024 apart, or next to each other (forked
    /// workers), start their search at different entries for the same
    /// descriptor numbers. The middle bits of the hash placed pids 1024
    /// apart at the same entry for every descriptor, and neighbours 21
    /// entries apart.
    #[test]
    fn neighbouring_and_distant_pids_start_apart() {
        let at = |pid, fd| start_of(Owner::local(pid, 0), fd);
        for fd in 3..9 {
            assert_ne!(at(1000, fd), at(2024, fd), "fd {fd}");
        }
        let windows: std::collections::BTreeSet<usize> =
            (4000..4032).map(|pid| at(pid, 10) / PROBE).collect();
        assert!(
            windows.len() >= 12,
            "32 neighbouring pids start in {} of {} windows",
            windows.len(),
            layout::FALLBACK_ENTRIES as usize / PROBE
        );
    }
}
