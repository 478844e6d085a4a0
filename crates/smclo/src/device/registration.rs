//! Registering a DMB in the DMB table, and what a process then holds of
//! the table: a registered DMB with its mapping ([`DmbHandle`]), the entry
//! it owns ([`Registration`]), and what a connection's data path updates
//! in it ([`ConnRecord`]).

use super::dmb_table::{DmbEntry, DMB_CONNECTED, DMB_REGISTERED, DMB_STATES};
use super::{errno_err, random_u64, Device, Mode, Role};
use crate::access::Shape;
use crate::dmb::Dmb;
use crate::error::Result;
use crate::owner::Owner;
use crate::table::{Claim, Gen, State, Ticket};
use smclo_wire::device_layout as layout;
use smclo_wire::device_layout::end_flags;
use smclo_wire::ends;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Device {
    /// Registers a DMB with a ring of `ring_len` bytes for this process.
    ///
    /// Claims a DMB table entry (`ENOSPC` when all are in use by live
    /// processes: the handshake reports `MAX_DMB`) under a fresh token, and
    /// fills it with a DMB from this process's pool ([`crate::dmb::pool`])
    /// or a new sealed memfd ([`Dmb::create_own`]). Reclaims the table
    /// entries of dead processes first (at most every
    /// [`SWEEP_INTERVAL_MS`](super::SWEEP_INTERVAL_MS), and always when the
    /// table is full).
    pub fn register_dmb(&self, ring_len: u32, role: Role) -> Result<DmbHandle> {
        self.register_dmb_preferring(ring_len, role, crate::dmb::pool::Prefer::default())
    }

    /// [`register_dmb`](Self::register_dmb), reusing the pooled DMB that
    /// `prefer` names if it is free: the peer keeps a mapping of it.
    pub fn register_dmb_preferring(
        &self,
        ring_len: u32,
        role: Role,
        prefer: crate::dmb::pool::Prefer,
    ) -> Result<DmbHandle> {
        let me = Owner::current();
        let (idx, claim) = self.claim_entry(&me)?;
        let e = self.dmb_entry(idx);
        let token = random_u64()?;
        let dmb = match crate::dmb::pool::take(ring_len, self.gid, token, prefer) {
            // The last peer's bytes stay in a pooled ring: on a group
            // device the next peer may be another user, who must not see
            // them.
            Some(d) if matches!(self.shape, Shape::Group { .. }) => match d.forget_ring() {
                Ok(()) => d,
                Err(err) => {
                    e.head.free(claim);
                    return Err(err.into());
                }
            },
            Some(d) => d,
            None => match Dmb::create_own(token, ring_len, self.gid, me.pid, me.start) {
                Ok(d) => d,
                Err(err) => {
                    e.head.free(claim);
                    return Err(err);
                }
            },
        };
        let reg = self.publish_entry(idx, claim, token, ring_len, role);
        Ok(DmbHandle { reg, dmb })
    }

    /// Fills claimed entry `idx` for the DMB `token` and publishes it.
    fn publish_entry(
        &self,
        idx: usize,
        claim: Claim,
        token: u64,
        ring_len: u32,
        role: Role,
    ) -> Registration {
        let e = self.dmb_entry(idx);
        e.token.store(token, Ordering::Relaxed);
        e.peer_token.store(0, Ordering::Relaxed);
        e.ring_len.store(ring_len, Ordering::Relaxed);
        e.role.store(role as u32, Ordering::Relaxed);
        e.tx_bytes.store(0, Ordering::Relaxed);
        e.rx_bytes.store(0, Ordering::Relaxed);
        for w in &e.ends {
            w.store(0, Ordering::Relaxed);
        }
        e.flags.store(0, Ordering::Relaxed);
        let ticket = e.head.publish(claim, DMB_REGISTERED);
        self.u64_at(layout::off::DMBS_REGISTERED)
            .fetch_add(1, Ordering::Relaxed);
        crate::debug!("registered DMB {token:016x} ({ring_len} bytes, {role:?}) in entry {idx}");
        Registration {
            dev: self.arc(),
            idx,
            ticket,
            token,
            role,
        }
    }

    /// The DMB table entry of a connection end that another process passed
    /// to this one (`SCM_RIGHTS`), with its byte counts and state: entry
    /// `idx` if it still holds `token` (its owner passed it along with the
    /// connection and has not let go yet) and this process could take it
    /// over ([`crate::table::Head::hand_over`], from exactly the word
    /// seen); else a new entry ([`Device::register_passed`]).
    pub(crate) fn take_passed(
        &self,
        idx: usize,
        token: u64,
        ring_len: u32,
        role: Role,
    ) -> Result<Registration> {
        let taken = (idx < layout::DMB_ENTRIES as usize)
            .then(|| self.dmb_entry(idx))
            .filter(|e| e.token.load(Ordering::Relaxed) == token)
            .and_then(|e| {
                let w = e.head.word();
                let me = Owner::current();
                // This process's own entry (it passed the connection to
                // itself) stays with the registration that holds it, which
                // frees it when that end lets go.
                if w.is_free() || w.pid() == me.pid {
                    return None;
                }
                e.head.hand_over(Ticket::of(w), &DMB_STATES, &me)
            });
        // The token is checked again: the entry may have been freed and
        // taken for another DMB between the two loads.
        match taken {
            Some(ticket) if self.dmb_entry(idx).token.load(Ordering::Relaxed) == token => {
                Ok(Registration {
                    dev: self.arc(),
                    idx,
                    ticket,
                    token,
                    role,
                })
            }
            _ => self.register_passed(token, ring_len, role),
        }
    }

    /// Registers, in an entry of its own, the DMB `token` of a connection
    /// end that another process passed to this one, whose entry went with
    /// the process that passed it.
    fn register_passed(&self, token: u64, ring_len: u32, role: Role) -> Result<Registration> {
        let (idx, claim) = self.claim_entry(&Owner::current())?;
        Ok(self.publish_entry(idx, claim, token, ring_len, role))
    }

    /// Claims a DMB table entry for `me`, reclaiming the entries of dead
    /// processes first (at most every
    /// [`SWEEP_INTERVAL_MS`](super::SWEEP_INTERVAL_MS), and always when the
    /// table is full).
    fn claim_entry(&self, me: &Owner) -> Result<(usize, Claim)> {
        self.maybe_sweep();
        if let Some(c) = self.claim_dmb_entry(me) {
            return Ok(c);
        }
        self.sweep();
        self.claim_dmb_entry(me)
            .ok_or_else(|| errno_err(libc::ENOSPC))
    }

    /// Claims a FREE DMB table entry, starting at a random index so that
    /// processes do not contend on the first ones.
    fn claim_dmb_entry(&self, me: &Owner) -> Option<(usize, Claim)> {
        let n = layout::DMB_ENTRIES as usize;
        let start = (random_u64().ok()? % n as u64) as usize;
        (0..n).find_map(|k| {
            let i = (start + k) % n;
            self.dmb_entry(i).head.claim(me).map(|c| (i, c))
        })
    }

    /// The registration of DMB table entry `idx` holding `token` (an
    /// accepting end's, or with `client` a connecting end's) that the image
    /// of this process before an exec had: its owner is this process (same
    /// pid and start time) or another of its fork family, which hands it
    /// over when it lets go. `None` if the entry is no longer that.
    pub fn adopt_registration(&self, idx: usize, token: u64, client: bool) -> Option<Registration> {
        if idx >= layout::DMB_ENTRIES as usize {
            return None;
        }
        let e = self.dmb_entry(idx);
        let w = e.head.word();
        if w.is_free() || e.token.load(Ordering::Relaxed) != token {
            return None;
        }
        Some(Registration {
            dev: self.arc(),
            idx,
            ticket: Ticket::of(w),
            token,
            role: if client { Role::Client } else { Role::Server },
        })
    }
}

/// A registered DMB owned by this process: the mapping of its own receive
/// ring plus its [`Registration`] in the DMB table. Dropping it unregisters
/// the DMB (the mapping goes back to the process's pool, [`crate::dmb::pool`]). A connection takes the two apart ([`DmbHandle::into_parts`]):
/// the mapping goes to the data path, the registration stays with the
/// connection for stats and unregistration.
pub struct DmbHandle {
    pub(super) reg: Registration,
    pub(super) dmb: Dmb,
}

impl std::fmt::Debug for DmbHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.reg.fmt(f)
    }
}

impl DmbHandle {
    /// The DMB's token.
    pub fn token(&self) -> u64 {
        self.reg.token
    }

    /// Which end registered it.
    pub fn role(&self) -> Role {
        self.reg.role
    }

    /// The mapping of the DMB (this end's receive ring).
    pub fn dmb(&self) -> &Dmb {
        &self.dmb
    }

    /// The device it is registered on.
    pub fn device(&self) -> &Arc<Device> {
        &self.reg.dev
    }

    /// Counts `n` bytes sent, as a connection's data path does through
    /// its [`ConnRecord`].
    pub fn add_tx(&self, n: u64) {
        self.reg.record().add_tx(n)
    }

    /// See [`Registration::set_connected`].
    pub fn set_connected(&self, peer_token: u64, local: SocketAddr, peer: SocketAddr, mode: Mode) {
        self.reg.set_connected(peer_token, local, peer, mode)
    }

    /// The memfd holding the DMB, to pass to the peer (`SCM_RIGHTS`).
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.dmb.own_fd().expect("a registered DMB has its memfd")
    }

    /// The identity (device, inode) of the DMB's memfd.
    pub fn id(&self) -> (u64, u64) {
        self.dmb.own_id().expect("a registered DMB has its memfd")
    }

    /// The mapping and the registration, to be kept by different owners
    /// (the handshake is done: the peer has the memfd). The memfd is closed
    /// now ([`Dmb::close_own_file`]) unless the pool could take the DMB
    /// back when the connection ends, and in a process short of
    /// descriptors.
    pub fn into_parts(mut self) -> (Dmb, Registration) {
        if crate::fdnum::pressed() || !crate::dmb::pool::may_keep_memfd() {
            self.dmb.close_own_file();
        }
        (self.dmb, self.reg)
    }
}

/// A DMB's entry in the device's DMB table, owned by the process named in
/// the entry's word: the one that registered it, until it hands the entry
/// over ([`Registration::hand_over`]). Dropping it in the owning process
/// unregisters the DMB: the table entry is freed (its byte count folded
/// into `xfer_bytes_retired`). The memory is the mapping's business
/// ([`Dmb`], [`crate::dmb::pool`]); a pooled DMB has no table entry, so
/// `dmbs_cnt` counts DMBs registered for handshakes and connections, never
/// pooled ones.
///
/// Copies inherited through `fork` share the entry: each counts the bytes
/// its process moves ([`ConnRecord`]) while the entry exists.
/// [`set_connected`](Self::set_connected) and the drop act only in the
/// process that owns the entry at the time of the call (never a pid cached
/// at creation), so after a hand-over the new owner unregisters and every
/// other copy's drop does nothing.
pub struct Registration {
    pub(super) dev: Arc<Device>,
    pub(super) idx: usize,
    /// The incarnation registered, under the registering process (a fork
    /// child that receives the entry has the same generation).
    pub(super) ticket: Ticket,
    pub(super) token: u64,
    pub(super) role: Role,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("token", &format_args!("{:016x}", self.token))
            .field("role", &self.role)
            .field("entry", &self.idx)
            .finish()
    }
}

impl Registration {
    /// The DMB's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The entry, if it is still this registration's (same generation, not
    /// freed) and, with `own`, the calling process owns it.
    fn entry(&self, own: bool) -> Option<&DmbEntry> {
        let e = self.dev.live_entry(self.idx, self.ticket.gen())?;
        (!own || e.head.word().pid() == Owner::current().pid).then_some(e)
    }

    /// This registration's incarnation under the calling process.
    fn my_ticket(&self) -> Ticket {
        self.ticket.with_pid(Owner::current().pid)
    }

    /// Marks the DMB as part of an established connection with the DMB
    /// `peer_token`, between TCP addresses `local` and `peer`, moving data
    /// in `mode`; from now on the pair counts in `conns_active` and `smclo
    /// ss` lists it. The addresses are stored before the state changes, so
    /// a reader that sees the entry connected sees them.
    pub fn set_connected(&self, peer_token: u64, local: SocketAddr, peer: SocketAddr, mode: Mode) {
        let Some(e) = self.entry(true) else { return };
        e.peer_token.store(peer_token, Ordering::Relaxed);
        for (w, v) in e.ends.iter().zip(ends::pack(local, peer)) {
            w.store(v, Ordering::Relaxed);
        }
        let copy = matches!(mode, Mode::Copy { .. });
        e.flags
            .store(if copy { end_flags::COPY } else { 0 }, Ordering::Relaxed);
        let _ = e.head.cas(self.my_ticket(), DMB_REGISTERED, DMB_CONNECTED);
    }

    /// What the connection's data path updates in the entry (byte counts,
    /// close flags), for as long as the entry is this registration's.
    pub fn record(&self) -> ConnRecord {
        ConnRecord {
            dev: self.dev.clone(),
            idx: self.idx,
            gen: self.ticket.gen(),
        }
    }

    /// The DMB table entry and whether this end connected, for a new image
    /// of this process (exec); `None` once the entry is gone.
    pub fn exec_entry(&self) -> Option<(usize, bool)> {
        self.entry(false)?;
        Some((self.idx, self.role == Role::Client))
    }

    /// Makes process `to` (a fork child that still holds the connection)
    /// the owner of the table entry, when the calling process owns it and
    /// is letting the connection go: the entry, its byte count and its
    /// state stay, and from now on `to` unregisters it.
    /// Returns whether the entry was handed over (false when the calling
    /// process does not own it).
    ///
    /// The word goes through WRITING under `to`'s pid while the start time
    /// changes, so no sweep judges `to` by our start time; if `to` dies
    /// (even by SIGKILL) the entry is reclaimed as any dead owner's.
    pub fn hand_over(&self, to: Owner) -> bool {
        let me = Owner::current().pid;
        if to.pid == 0 || to.pid == me {
            return false;
        }
        let e = self.dev.dmb_entry(self.idx);
        let done = e
            .head
            .hand_over(self.my_ticket(), &DMB_STATES, &to)
            .is_some();
        if done {
            crate::debug!(
                "DMB {:016x} (entry {}) handed over to pid {}",
                self.token,
                self.idx,
                to.pid
            );
        }
        done
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let me = Owner::current();
        let e = self.dev.dmb_entry(self.idx);
        let mine = self.my_ticket();
        // A hand-over to us may be finishing (WRITING under our pid, two
        // stores long): wait for it, briefly.
        for _ in 0..10_000 {
            if e.head.word() != mine.word(State::WRITING) {
                break;
            }
            std::thread::yield_now();
        }
        // Only the current owner's copy unregisters (the release names it).
        if let Some(c) = e.head.release(mine, &me) {
            self.dev.retire_entry(e, c);
        }
    }
}

/// A connection end's DMB table entry as its data path sees it: the byte
/// counts and close flags that `smclo ss` shows. It does not own the entry
/// (the [`Registration`] does): every update first checks that the entry is
/// still that registration's incarnation, so a record that outlives it
/// (a fork child's copy, a late call) changes nothing. Updates are single
/// atomic operations on the entry, no system call.
#[derive(Clone)]
pub struct ConnRecord {
    dev: Arc<Device>,
    idx: usize,
    gen: Gen,
}

impl std::fmt::Debug for ConnRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnRecord(entry {})", self.idx)
    }
}

impl ConnRecord {
    /// Whether this process lost its mapping of the record's device
    /// ([`Device::lost`]).
    pub fn device_lost(&self) -> bool {
        self.dev.lost()
    }

    /// `n` bytes written into the peer's ring (summed into `xfer_bytes`).
    pub fn add_tx(&self, n: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.tx_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `n` bytes consumed from this end's ring.
    pub fn add_rx(&self, n: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.rx_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Sets [`end_flags`] bits (async-signal-safe: one load, one atomic or).
    pub fn set_flags(&self, f: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.flags.fetch_or(f, Ordering::Release);
        }
    }
}
