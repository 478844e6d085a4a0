//! Rendezvous slots: where a client and a server agree, out of band, whether
//! one TCP connection becomes SMC-D.
//!
//! A slot (1024 of them in the device file, 2048 bytes each) is keyed by the
//! client's source address, its SYN's mark and the server's address and
//! port ([`SlotKey`]) and holds three
//! message areas of [`MSG_LEN`] bytes: the client's Proposal, the server's
//! reply (Accept or Decline) and the client's Confirm (or Decline). What the
//! messages contain is the handshake's business; this module only moves
//! bytes and decides, by compare-and-swap, who won.
//!
//! # States and who moves them
//!
//! ```text
//!            client                 server                   client
//! FREE ──propose──▶ PROPOSED ──answer: CAS──▶ REPLYING ──CAS──▶ ACCEPTED ──confirm──▶ CONFIRMED
//!                      │                         │        └──▶ DECLINED       └──────▶ DECLINED
//!                      └─ give_up (client) ──────┴──────────▶ DECLINED
//!                                              ACCEPTED ── cas (unused by the handshake) ─▶ DECLINED
//! any ──release (client, OwnedSlot drop)──▶ FREE
//! ```
//!
//! - The client [`propose`](Rendezvous::propose)s, gets an [`OwnedSlot`],
//!   waits ([`SlotRef::wait_while`]) for the server, and on timeout calls
//!   [`SlotRef::give_up`]: if that fails, the server decided first and the
//!   client must follow that decision.
//! - The server [`find`](Rendezvous::find)s the slot by 4-tuple, validates
//!   the [`proposal`](SlotRef::proposal) and [`answer`](SlotRef::answer)s.
//!   `answer` claims the reply area (PROPOSED → REPLYING) before writing it,
//!   so a client that gives up meanwhile waits at most [`REPLY_GRACE`] for
//!   the copy to finish instead of reading a half-written reply.
//! - After ACCEPTED the client [`confirm`](SlotRef::confirm)s (ACCEPTED →
//!   CONFIRMED). The handshake takes ACCEPTED as the decision (docs/handshake.md
//!   "Handshake waits"): its server does not wait for the Confirm, and
//!   neither side moves the slot from ACCEPTED to DECLINED, which
//!   `confirm` with a Decline and `cas(Accepted, Declined)` still allow.
//! - The client frees the slot by dropping its [`OwnedSlot`].
//!
//! Slots are kept with the protocol of [`crate::table`]: a [`SlotRef`] is
//! bound to one incarnation (generation and client pid), so one taken
//! before the slot was freed and reused can never change the new
//! incarnation: all its CASes fail and [`SlotRef::state`] reports
//! [`SlotState::Stale`].
//!
//! A slot whose client died is taken over by the next
//! [`propose`](Rendezvous::propose) that needs it (one of another pid
//! namespace once that namespace has no process left on the device).
//!
//! Message bytes come from another process: callers must validate them
//! (lengths are clamped to [`MSG_LEN`] here, nothing more).

use crate::device::Device;
use crate::error::{Error, Result};
use crate::owner::Owner;
use crate::registry::canonical_addr;
use crate::table::{Claim, Head, Holder, Judge, State, Ticket, Word};
use smclo_wire::device_layout as layout;
use smclo_wire::syn::{Mark, TsWindow};
use std::net::{IpAddr, SocketAddr};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes per message area.
pub const MSG_LEN: usize = layout::MSG_AREA_LEN as usize;

/// Slots examined per lookup or claim, from the key's hash on.
pub const PROBE: usize = 128;

const _: () = assert!(PROBE == 64 * layout::ANNOUNCED_WORDS);

/// How long [`SlotRef::give_up`] and the release of an [`OwnedSlot`] wait
/// for a server that is copying its reply (REPLYING) before overriding it.
pub const REPLY_GRACE: Duration = Duration::from_millis(200);

/// The state of a slot, as seen through a [`SlotRef`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotState {
    /// Unused.
    Free,
    /// A client is writing its Proposal.
    Writing,
    /// The Proposal is published; waiting for the server.
    Proposed,
    /// The server is writing its reply.
    Replying,
    /// The server accepted; waiting for the client's Confirm.
    Accepted,
    /// Both agreed: the connection is SMC-D.
    Confirmed,
    /// One side declined: the connection stays TCP.
    Declined,
    /// The slot was freed or reused since the [`SlotRef`] was taken: the
    /// handshake it belonged to is over.
    Stale,
    /// A value this version does not know (garbage in shared memory).
    Invalid,
}

impl SlotState {
    fn from_state(s: State) -> SlotState {
        match s.0 {
            0 => SlotState::Free,
            1 => SlotState::Writing,
            2 => SlotState::Proposed,
            3 => SlotState::Replying,
            4 => SlotState::Accepted,
            5 => SlotState::Confirmed,
            6 => SlotState::Declined,
            _ => SlotState::Invalid,
        }
    }

    fn to_state(self) -> Option<State> {
        Some(State(match self {
            SlotState::Free => 0,
            SlotState::Writing => 1,
            SlotState::Proposed => 2,
            SlotState::Replying => 3,
            SlotState::Accepted => 4,
            SlotState::Confirmed => 5,
            SlotState::Declined => 6,
            SlotState::Stale | SlotState::Invalid => return None,
        }))
    }
}

/// The key of a slot: the client's source address, the DSCP of its SYN's
/// mark and the server's address and port. The client's port is not part
/// of it (the kernel picks it only at `connect`, after the Proposal is
/// published), nor is the mark's TTL, which each routing hop on the way
/// decrements: the server compares it with the Proposal's
/// ([`Mark::fits`]). IPv4-mapped IPv6 addresses are made IPv4, so that a
/// dual-stack server (which sees `::ffff:a.b.c.d`) and an IPv4 client
/// build the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotKey {
    /// The client's source address.
    pub client: IpAddr,
    /// The DSCP of the client's SYN mark: it spreads one client's
    /// proposals to one server over the table.
    pub dscp: u8,
    /// The server's address and port.
    pub server: SocketAddr,
}

impl std::fmt::Display for SlotKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (mark dscp {}) -> {}",
            self.client, self.dscp, self.server
        )
    }
}

/// The bits of an encoded key's last word that hold the DSCP.
const KEY_DSCP_BITS: u64 = 0xff;

/// The server half of an announcement's key ([`SlotKey::announcement`]).
const ANNOUNCED_SERVER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::UNSPECIFIED,
    0,
));

/// The bits of an encoded key's last word that hold the client's family.
const KEY_CLIENT_FAMILY_BITS: u64 = 0xff << 32;

/// The masks of [`Rendezvous::find_announcements`]: the client's address and
/// family ignored.
const KEY_ANY_CLIENT: [u64; 5] = [0, 0, u64::MAX, u64::MAX, !KEY_CLIENT_FAMILY_BITS];

impl SlotKey {
    /// A key from the client's source address and SYN mark and the
    /// server's address (the server builds it from the SYN), made
    /// canonical.
    pub fn new(client: IpAddr, mark: Mark, server: SocketAddr) -> SlotKey {
        SlotKey {
            client: canonical_addr(SocketAddr::new(client, 0)).ip(),
            dscp: mark.dscp,
            server: canonical_addr(server),
        }
    }

    fn encode(&self) -> [u64; 5] {
        fn half(ip: IpAddr) -> (u64, u64, u64) {
            let (fam, b) = match ip {
                IpAddr::V4(v4) => {
                    let mut b = [0u8; 16];
                    b[..4].copy_from_slice(&v4.octets());
                    (4u64, b)
                }
                IpAddr::V6(v6) => (6u64, v6.octets()),
            };
            (
                u64::from_ne_bytes(b[..8].try_into().unwrap()),
                u64::from_ne_bytes(b[8..].try_into().unwrap()),
                fam,
            )
        }
        let (c0, c1, cf) = half(self.client);
        let (s0, s1, sf) = half(self.server.ip());
        let meta = self.dscp as u64 & KEY_DSCP_BITS
            | (self.server.port() as u64) << 16
            | cf << 32
            | sf << 40;
        [c0, c1, s0, s1, meta]
    }

    /// The key of a client's announcement from `client` (a proposal with
    /// no mark, for a destination without a registered listener): its
    /// server finds it by what it sees, which address translation may
    /// have changed, so neither the destination nor (for its home) the
    /// client's address is in what places it: every announcement of the
    /// device shares one window ([`Rendezvous::find_announcements`]).
    pub fn announcement(client: IpAddr) -> SlotKey {
        SlotKey::new(client, Mark::NONE, ANNOUNCED_SERVER)
    }

    fn is_announcement(&self) -> bool {
        self.dscp == 0 && self.server == ANNOUNCED_SERVER
    }

    fn home(&self) -> usize {
        let k = if self.is_announcement() {
            SlotKey::announcement(IpAddr::from([0u8; 4]))
        } else {
            *self
        };
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for w in k.encode() {
            h = (h ^ w).wrapping_mul(0x0100_0000_01b3);
            h ^= h >> 29;
        }
        (h % layout::RENDEZVOUS_ENTRIES as u64) as usize
    }
}

/// One slot, 2048 bytes.
#[repr(C)]
pub(crate) struct SlotEntry {
    head: Head,
    key: [AtomicU64; 5],
    lens: [AtomicU64; 3],
    /// The client's TCP source port once known (`PORT_KNOWN | port`), 0
    /// before: see [`SlotRef::set_client_port`].
    client_port: AtomicU64,
    /// [`Progress`] flags of this incarnation, 0 when proposed.
    progress: AtomicU64,
    /// The identity (device, inode) of the client's DMB memfd, (0, 0) until
    /// published: see [`SlotRef::set_client_dmb`].
    client_dmb: [AtomicU64; 2],
    /// The client's early bytes: how many it wrote into the TCP stream
    /// before the server answered, and whether the server took the count
    /// (see [`crate::early_count`]).
    early: AtomicU64,
    msgs: [[AtomicU64; MSG_LEN / 8]; 3],
    /// The identity of a DMB memfd of the server's that the client keeps a
    /// mapping of, (0, 0) if none: see [`SlotRef::set_server_dmb_hint`].
    server_dmb_hint: [AtomicU64; 2],
    /// An unmarked client's TSval window (`TS_KNOWN | span << 32 | lo`), 0
    /// before: see [`SlotRef::set_client_ts`].
    client_ts: AtomicU64,
    /// The token of a DMB the client registered after its Proposal (an
    /// announcement's), valid once [`Progress::ClientDmbNamed`] is noted:
    /// see [`SlotRef::set_client_token`].
    client_token: AtomicU64,
    _r1: [AtomicU64; 44],
}

const _: () = assert!(std::mem::size_of::<SlotEntry>() == layout::RENDEZVOUS_ENTRY_LEN as usize);
// head + key + lens + client_port + progress + client_dmb + reserved = 128
// bytes before the message areas.
const _: () = assert!(
    crate::table::HEAD_LEN + 5 * 8 + 3 * 8 + 8 + 8 + 2 * 8 + 8 == layout::MSG_AREA_OFF[0] as usize
);

/// Flag in `client_port`: the port is known.
const PORT_KNOWN: u64 = 1 << 16;

/// Flag in `client_ts`: the window is known.
const TS_KNOWN: u64 = 1 << 63;

/// A step of the handshake taken on the UNIX channel, noted in the slot so
/// that the side waiting for it can busy-poll shared memory instead of the
/// socket (a system call per look). A hint only: the channel itself says
/// what arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The server connected to the client's rendezvous socket.
    ServerConnected = 1,
    /// The client sent its DMB on the channel.
    ClientDmbSent = 2,
    /// The server attached the client's DMB from a mapping it keeps
    /// ([`SlotRef::client_dmb`]): the client does not send it. Noted before
    /// the server connects, so the client knows when it accepts.
    ServerHasClientDmb = 4,
    /// The server's DMB is the one the client keeps a mapping of
    /// ([`SlotRef::server_dmb_hint`]): the server passes no descriptor.
    /// Noted before its CAS to ACCEPTED.
    ClientHasServerDmb = 8,
    /// The client registered its DMB only once the server connected (an
    /// announcement, whose Proposal names no DMB) and published its token
    /// ([`SlotRef::client_token`]), before it passes the DMB.
    ClientDmbNamed = 16,
    /// The client claims a DMB its server reserved for it
    /// (`dmb::attach_record`), noted before its SYN leaves: the server
    /// reserves its DMB only then, since a client of an older build claims
    /// from 0 alone and would find the DMB taken.
    ClientClaimsReserved = 32,
}

const PROPOSAL: usize = 0;
const REPLY: usize = 1;
const CONFIRM: usize = 2;

fn slot(dev: &Device, i: usize) -> &SlotEntry {
    let i = i % layout::RENDEZVOUS_ENTRIES as usize;
    dev.at(layout::RENDEZVOUS_OFF as usize + i * layout::RENDEZVOUS_ENTRY_LEN as usize)
}

/// The announcement map's words (`crate::announced`).
fn announced_map(dev: &Device) -> &[AtomicU64; layout::ANNOUNCED_WORDS] {
    dev.at(layout::off::ANNOUNCED)
}

/// The home of every announcement ([`SlotKey::announcement`]), which
/// places none by its client's address.
pub(crate) fn announcements_home() -> usize {
    static HOME: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *HOME.get_or_init(|| SlotKey::announcement(IpAddr::from([0u8; 4])).home())
}

/// Slot `i`'s position in the announcements' window, if it is in it.
fn announced_pos(i: usize) -> Option<usize> {
    let n = layout::RENDEZVOUS_ENTRIES as usize;
    let pos = (i + n - announcements_home()) % n;
    (pos < PROBE).then_some(pos)
}

/// Slot `i`'s bit in the announcement map: whether its new owner's
/// proposal is an announcement (after the claim, before the proposal is
/// published), or cleared before the slot is freed.
fn mark_announced(dev: &Device, i: usize, on: bool) {
    if let Some(pos) = announced_pos(i) {
        crate::announced::mark(announced_map(dev), pos, on);
    }
}

impl SlotEntry {
    /// Copies `bytes` (at most MSG_LEN, checked by callers) into area `a`.
    /// Word-wise atomic stores: another process may read concurrently, and
    /// a torn message is caught by the reader's validation, never UB.
    fn write_msg(&self, a: usize, bytes: &[u8]) {
        // Whole words as they are (a copy of a slice of unknown length per
        // word would be a call each), the tail padded with zeros.
        let words = bytes.chunks_exact(8);
        let tail = words.remainder();
        let mut i = 0;
        for chunk in words {
            let w: [u8; 8] = chunk.try_into().expect("8 bytes");
            self.msgs[a][i].store(u64::from_ne_bytes(w), Ordering::Relaxed);
            i += 1;
        }
        if !tail.is_empty() {
            let mut w = [0u8; 8];
            w[..tail.len()].copy_from_slice(tail);
            self.msgs[a][i].store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        self.lens[a].store(bytes.len() as u64, Ordering::Relaxed);
    }

    /// Copies area `a` out; the length is clamped to MSG_LEN because a peer
    /// may have written anything there.
    fn read_msg(&self, a: usize) -> Vec<u8> {
        let len = (self.lens[a].load(Ordering::Relaxed) as usize).min(MSG_LEN);
        let mut out = Vec::with_capacity(len.next_multiple_of(8));
        for w in self.msgs[a].iter().take(len.div_ceil(8)) {
            out.extend_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
        }
        out.truncate(len);
        out
    }

    /// Writes key and proposal into a claimed slot and publishes it.
    fn fill(&self, c: Claim, k: &[u64; 5], proposal: &[u8]) -> Ticket {
        for (dst, v) in self.key.iter().zip(k) {
            dst.store(*v, Ordering::Relaxed);
        }
        self.lens[REPLY].store(0, Ordering::Relaxed);
        self.lens[CONFIRM].store(0, Ordering::Relaxed);
        self.client_port.store(0, Ordering::Relaxed);
        self.progress.store(0, Ordering::Relaxed);
        self.early.store(0, Ordering::Relaxed);
        self.client_ts.store(0, Ordering::Relaxed);
        self.client_token.store(0, Ordering::Relaxed);
        for w in self.client_dmb.iter().chain(&self.server_dmb_hint) {
            w.store(0, Ordering::Relaxed);
        }
        self.write_msg(PROPOSAL, proposal);
        self.head.publish(c, STATE_PROPOSED)
    }

    /// Whether the slot's key is `k`, each word compared on the bits of
    /// its `mask`.
    fn key_matches(&self, k: &[u64; 5], mask: &[u64; 5]) -> bool {
        self.key
            .iter()
            .zip(k)
            .zip(mask)
            .all(|((a, b), m)| a.load(Ordering::Relaxed) & m == *b & m)
    }
}

/// Entry points of the rendezvous table.
pub struct Rendezvous;

impl Rendezvous {
    /// Client: publishes `proposal` in a slot for `key` and returns the slot,
    /// which is freed when the returned [`OwnedSlot`] is dropped.
    ///
    /// Claims a FREE slot (or one whose client is dead) in the key's window by
    /// CAS, writes key and message, then publishes PROPOSED with Release.
    /// Errors: `EMSGSIZE` if the proposal exceeds [`MSG_LEN`]; `ENOSPC` when
    /// every slot of the window belongs to a live client (the handshake
    /// reports `MAX_DMB`).
    pub fn propose(dev: &Device, key: SlotKey, proposal: &[u8]) -> Result<OwnedSlot> {
        if proposal.len() > MSG_LEN {
            return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EMSGSIZE)));
        }
        let me = Owner::current();
        let k = key.encode();
        let home = key.home();
        // Made only for the second pass: a free slot is the rule.
        let mut judge = None;
        for pass in 0..2 {
            for p in 0..PROBE {
                let i = (home + p) % layout::RENDEZVOUS_ENTRIES as usize;
                let s = slot(dev, i);
                let claim = match pass {
                    0 => s.head.claim(&me),
                    // Second pass: slots whose client is gone.
                    _ => judge
                        .get_or_insert_with(|| Judge::new(dev.dir()))
                        .reclaim(&s.head, s.head.word()),
                };
                let Some(claim) = claim else {
                    continue;
                };
                mark_announced(dev, i, key.is_announcement());
                let ticket = s.fill(claim, &k, proposal);
                crate::debug!("proposed in rendezvous slot {i} for {key}");
                return Ok(OwnedSlot(SlotRef {
                    dev: dev.arc(),
                    idx: i,
                    ticket,
                    client: me,
                }));
            }
        }
        Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSPC)))
    }

    /// Server: the PROPOSED slot for exactly `key`, if any. The returned
    /// reference is bound to the slot's current generation.
    pub fn find(dev: &Device, key: SlotKey) -> Option<SlotRef> {
        Rendezvous::find_all(dev, key).into_iter().next()
    }

    /// Server: every PROPOSED slot for `key`. More than one exists when
    /// clients in different network namespaces use identical addresses, or
    /// concurrent connections' random marks collide; the published client
    /// port tells them apart.
    pub fn find_all(dev: &Device, key: SlotKey) -> Vec<SlotRef> {
        Rendezvous::scan(dev, key, |_| false)
    }

    /// Server: [`find_all`](Self::find_all) for a SYN from source port
    /// `port`, which stops at the first slot whose client published that
    /// port: the server answers that one (or an earlier one) and never
    /// looks further, and a scan of all [`PROBE`] slots (each on a page of
    /// its own) was a few percent of `accept`'s time.
    pub fn find_for_syn(dev: &Device, key: SlotKey, port: u16) -> Vec<SlotRef> {
        Rendezvous::find_until(dev, key, |s| s.client_port() == Some(port))
    }

    /// Server: [`find_all`](Self::find_all) up to the first slot for which
    /// `ours` holds.
    pub fn find_until(dev: &Device, key: SlotKey, ours: impl Fn(&SlotRef) -> bool) -> Vec<SlotRef> {
        Rendezvous::scan(dev, key, ours)
    }

    /// Server: the PROPOSED slots whose key is `key` but for the DSCP, up
    /// to the first for which `ours` holds: where a mark may have been
    /// changed on the way (its DSCP rewritten), the proposal to decline.
    /// Scans the whole table, not one key's window: only for a SYN that
    /// looks marked yet matched nothing.
    pub fn find_any_dscp(
        dev: &Device,
        key: SlotKey,
        ours: impl Fn(&SlotRef) -> bool,
    ) -> Vec<SlotRef> {
        let all = layout::RENDEZVOUS_ENTRIES as usize;
        Rendezvous::scan_from(dev, key, !KEY_DSCP_BITS, 0, all, ours)
    }

    /// Server: the PROPOSED announcements ([`SlotKey::announcement`]),
    /// whatever their client's address, up to the first for which `ours`
    /// holds: one window's look.
    /// Reads the announcement map, and only the slots it names.
    pub fn find_announcements(dev: &Device, ours: impl Fn(&SlotRef) -> bool) -> Vec<SlotRef> {
        let key = SlotKey::announcement(IpAddr::from([0u8; 4]));
        let home = announcements_home();
        let map = announced_map(dev);
        let slots = crate::announced::positions(map).map(|p| home + p);
        Rendezvous::scan_masked(dev, key, KEY_ANY_CLIENT, slots, ours)
    }

    /// The PROPOSED slots for `key` in probe order, up to the first for
    /// which `last` holds.
    fn scan(dev: &Device, key: SlotKey, last: impl Fn(&SlotRef) -> bool) -> Vec<SlotRef> {
        Rendezvous::scan_from(dev, key, u64::MAX, key.home(), PROBE, last)
    }

    /// The PROPOSED slots whose key is `key` on the bits of `mask` (see
    /// [`SlotEntry::key_matches`]) among `count` slots from `home` on, up to the
    /// first for which `last` holds.
    fn scan_from(
        dev: &Device,
        key: SlotKey,
        mask: u64,
        home: usize,
        count: usize,
        last: impl Fn(&SlotRef) -> bool,
    ) -> Vec<SlotRef> {
        let mut masks = [u64::MAX; 5];
        masks[4] = mask;
        Rendezvous::scan_masked(dev, key, masks, (0..count).map(|p| home + p), last)
    }

    /// The PROPOSED slots among `slots` (indices, taken modulo the table's
    /// size) whose key is `key` on the bits of `mask`, each word on its
    /// own, up to the first for which `last` holds.
    fn scan_masked(
        dev: &Device,
        key: SlotKey,
        mask: [u64; 5],
        slots: impl Iterator<Item = usize>,
        last: impl Fn(&SlotRef) -> bool,
    ) -> Vec<SlotRef> {
        let k = key.encode();
        let mut out = Vec::new();
        for i in slots {
            let i = i % layout::RENDEZVOUS_ENTRIES as usize;
            let s = slot(dev, i);
            let Some((w, true)) = s
                .head
                .read(|w| w.state() == STATE_PROPOSED, || s.key_matches(&k, &mask))
            else {
                continue;
            };
            if let Some(Holder::Known(client)) = s.head.holder(w) {
                let r = SlotRef {
                    dev: dev.arc(),
                    idx: i,
                    ticket: Ticket::of(w),
                    client,
                };
                let done = last(&r);
                out.push(r);
                if done {
                    break;
                }
            }
        }
        out
    }
}

const STATE_PROPOSED: State = State(2);

/// A reference to one incarnation (generation) of a slot. Cheap to clone;
/// when the slot is freed or reused, every operation reports
/// [`SlotState::Stale`] and changes nothing.
#[derive(Clone)]
pub struct SlotRef {
    dev: Arc<Device>,
    idx: usize,
    ticket: Ticket,
    /// The client, as recorded when the reference was taken.
    client: Owner,
}

impl std::fmt::Debug for SlotRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotRef")
            .field("idx", &self.idx)
            .field("gen", &self.ticket.gen().get())
            .field("client_pid", &self.ticket.pid())
            .finish()
    }
}

impl SlotRef {
    fn entry(&self) -> &SlotEntry {
        slot(&self.dev, self.idx)
    }

    fn mine(&self, w: Word) -> bool {
        self.ticket.matches(w)
    }

    /// Slot index (for diagnostics).
    pub fn index(&self) -> usize {
        self.idx
    }

    /// The generation this reference is bound to.
    pub fn generation(&self) -> u32 {
        self.ticket.gen().get()
    }

    /// The client that proposed (pid, start time and pid namespace), for
    /// liveness checks.
    pub fn client(&self) -> Owner {
        self.client
    }

    /// The client's source address in the slot's key; `None` once the
    /// slot has been reused, or for a key that holds none.
    pub fn client_ip(&self) -> Option<IpAddr> {
        let e = self.entry();
        let (w0, w1, meta) = e
            .head
            .read(
                |w| self.mine(w),
                || {
                    let k = |i: usize| e.key[i].load(Ordering::Relaxed);
                    (k(0), k(1), k(4))
                },
            )?
            .1;
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&w0.to_ne_bytes());
        b[8..].copy_from_slice(&w1.to_ne_bytes());
        match (meta & KEY_CLIENT_FAMILY_BITS) >> 32 {
            4 => Some(IpAddr::from([b[0], b[1], b[2], b[3]])),
            6 => Some(IpAddr::from(b)),
            _ => None,
        }
    }

    /// Client: publishes its TCP source port, known once `connect` has
    /// been called (the kernel picks it then). The key's client half may
    /// carry something else in its port position (the handshake puts the
    /// SYN mark there), so the server matches the SYN's source port against
    /// this. Changes nothing once the slot is reused.
    pub fn set_client_port(&self, port: u16) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            e.client_port
                .store(PORT_KNOWN | port as u64, Ordering::Release);
        }
    }

    /// Server: the client's TCP source port, once published
    /// ([`set_client_port`](Self::set_client_port)); `None` before, or when
    /// the slot has been reused.
    pub fn client_port(&self) -> Option<u16> {
        let e = self.entry();
        let v = e.client_port.load(Ordering::Acquire);
        // The word after the port: if this reference is still current, the
        // port belongs to this incarnation (it is reset while WRITING).
        if v & PORT_KNOWN == 0 || !self.mine(e.head.word()) {
            return None;
        }
        Some(v as u16)
    }

    /// Client of an unmarked proposal: publishes the TSvals its SYN may
    /// have carried, before its port ([`set_client_port`](Self::set_client_port),
    /// whose Release orders this store before it): the server's proof that
    /// the connection with that port is the proposer's.
    pub fn set_client_ts(&self, w: TsWindow) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            let v = TS_KNOWN | u64::from(w.span) << 32 | u64::from(w.lo);
            e.client_ts.store(v, Ordering::Relaxed);
        }
    }

    /// Server: the client's TSval window, if it published one (read after
    /// [`client_port`](Self::client_port) said the port is known).
    pub fn client_ts(&self) -> Option<TsWindow> {
        let e = self.entry();
        let v = e.client_ts.load(Ordering::Acquire);
        if v & TS_KNOWN == 0 || !self.mine(e.head.word()) {
            return None;
        }
        Some(TsWindow {
            lo: v as u32,
            span: (v >> 32) as u16,
        })
    }

    /// Notes that `step` was taken. Changes nothing once the slot is reused
    /// (a late note could only make the next client look once too often).
    pub fn note(&self, step: Progress) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            e.progress.fetch_or(step as u64, Ordering::Release);
        }
    }

    /// Client: publishes the identity (device, inode) of its DMB's memfd,
    /// before its SYN leaves: a server that keeps a mapping of that DMB
    /// (from an earlier connection) attaches it without the descriptor.
    pub fn set_client_dmb(&self, id: (u64, u64)) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            e.client_dmb[0].store(id.0, Ordering::Relaxed);
            e.client_dmb[1].store(id.1, Ordering::Release);
        }
    }

    /// Client of an announcement: publishes the token of the DMB it
    /// registered once the server connected, before it passes that DMB on
    /// the channel. The Proposal's token field then only named the
    /// proposal (the server's channel is named for it), since a DMB for
    /// every announcement would be taken and given back for nothing by
    /// every plain server's connection.
    pub fn set_client_token(&self, token: u64) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            e.client_token.store(token, Ordering::Relaxed);
            e.progress
                .fetch_or(Progress::ClientDmbNamed as u64, Ordering::Release);
        }
    }

    /// Server: the token the client published with
    /// [`set_client_token`](Self::set_client_token), if it did for this
    /// incarnation.
    pub fn client_token(&self) -> Option<u64> {
        let e = self.entry();
        if !self.noted(Progress::ClientDmbNamed) {
            return None;
        }
        let t = e.client_token.load(Ordering::Relaxed);
        self.mine(e.head.word()).then_some(t)
    }

    /// Client: publishes the identity (device, inode) of a DMB memfd of the
    /// server's that it keeps a mapping of (from an earlier connection),
    /// before its SYN leaves: a server that still pools that DMB reuses it
    /// and passes no descriptor.
    pub fn set_server_dmb_hint(&self, id: (u64, u64)) {
        let e = self.entry();
        if self.mine(e.head.word()) {
            e.server_dmb_hint[0].store(id.0, Ordering::Relaxed);
            e.server_dmb_hint[1].store(id.1, Ordering::Release);
        }
    }

    /// Server: the identity the client published with
    /// [`set_server_dmb_hint`](Self::set_server_dmb_hint), if any.
    pub fn server_dmb_hint(&self) -> Option<(u64, u64)> {
        let e = self.entry();
        let ino = e.server_dmb_hint[1].load(Ordering::Acquire);
        let dev = e.server_dmb_hint[0].load(Ordering::Relaxed);
        (ino != 0 && self.mine(e.head.word())).then_some((dev, ino))
    }

    /// Server: the identity of the client's DMB memfd, if published for
    /// this incarnation.
    pub fn client_dmb(&self) -> Option<(u64, u64)> {
        let e = self.entry();
        let ino = e.client_dmb[1].load(Ordering::Acquire);
        let dev = e.client_dmb[0].load(Ordering::Relaxed);
        (ino != 0 && self.mine(e.head.word())).then_some((dev, ino))
    }

    /// Whether `step` was noted for this incarnation.
    pub fn noted(&self, step: Progress) -> bool {
        self.entry().progress.load(Ordering::Acquire) & step as u64 != 0
    }

    /// Current state (Acquire: the message areas written before the state
    /// was published are visible after this returns).
    pub fn state(&self) -> SlotState {
        let w = self.entry().head.word();
        if !self.mine(w) {
            return SlotState::Stale;
        }
        SlotState::from_state(w.state())
    }

    /// Copies a message out, or `None` if the slot changed generation while
    /// (or before) it was read.
    fn read(&self, area: usize) -> Option<Vec<u8>> {
        let e = self.entry();
        e.head
            .read(|w| self.mine(w), || e.read_msg(area))
            .map(|(_, m)| m)
    }

    /// The client's Proposal (unvalidated bytes).
    pub fn proposal(&self) -> Option<Vec<u8>> {
        self.read(PROPOSAL)
    }

    /// The server's reply (unvalidated bytes); meaningful once the state is
    /// Accepted or Declined.
    pub fn reply(&self) -> Option<Vec<u8>> {
        self.read(REPLY)
    }

    /// The client's Confirm or Decline (unvalidated bytes); meaningful once
    /// the state is Confirmed or Declined.
    pub fn confirm_msg(&self) -> Option<Vec<u8>> {
        self.read(CONFIRM)
    }

    /// Compare-and-swap of the state, bound to this generation. Moves to or
    /// from Free, Writing, Stale or Invalid are refused. On failure returns
    /// the state found (Stale if the slot was reused).
    pub fn cas(&self, from: SlotState, to: SlotState) -> std::result::Result<(), SlotState> {
        let allowed = |s: SlotState| {
            !matches!(
                s,
                SlotState::Free | SlotState::Writing | SlotState::Stale | SlotState::Invalid
            )
        };
        let (Some(f), Some(t)) = (from.to_state(), to.to_state()) else {
            return Err(self.state());
        };
        if !allowed(from) || !allowed(to) {
            return Err(self.state());
        }
        match self.entry().head.cas(self.ticket, f, t) {
            Ok(()) => Ok(()),
            Err(w) if self.mine(w) => Err(SlotState::from_state(w.state())),
            Err(_) => Err(SlotState::Stale),
        }
    }

    /// Client: counts `n` more early bytes, which it writes into the TCP
    /// stream right after (before the server answered, a blocking client's
    /// first request: its server then finds it in its ring at once,
    /// instead of waiting for the client to learn the answer and write
    /// it). `false` once the server took the count ([`Self::accept_early`])
    /// or when the total would pass [`crate::early_count::EARLY_MAX`]: the bytes then wait for
    /// the decision. Counting first and sending second means the count
    /// never misses a byte in the stream; a server that finds fewer bytes
    /// than counted declines, and the stream carries them as plain TCP.
    pub fn add_early(&self, n: usize) -> bool {
        crate::early_count::add(&self.entry().early, n)
    }

    /// Server: the client's early bytes counted so far, without taking the
    /// count (more may follow).
    pub fn early_counted(&self) -> u32 {
        let v = self.entry().early.load(Ordering::Acquire) & !crate::early_count::SEALED;
        v.min(u64::from(u32::MAX)) as u32
    }

    /// Server: accepts with `reply` as [`answer`](Self::answer) does, but
    /// first, with the reply area claimed (REPLYING), takes the count of
    /// the client's early bytes, so that no more are counted, and asks
    /// `ready` whether that many are in the TCP stream: if not (a client
    /// stopped between counting and sending), it writes `ready`'s Decline
    /// instead. `Ok(Some(n))`: ACCEPTED with `n` early bytes, which the
    /// server must move into its ring; `Ok(None)`: DECLINED.
    pub fn accept_early(
        &self,
        reply: &[u8],
        ready: impl FnOnce(u32) -> std::result::Result<(), Vec<u8>>,
    ) -> std::result::Result<Option<u32>, SlotState> {
        if reply.len() > MSG_LEN {
            return Err(SlotState::Invalid);
        }
        self.cas(SlotState::Proposed, SlotState::Replying)?;
        let n = crate::early_count::seal(&self.entry().early);
        if let Err(decline) = ready(n) {
            self.entry()
                .write_msg(REPLY, &decline[..decline.len().min(MSG_LEN)]);
            return self
                .cas(SlotState::Replying, SlotState::Declined)
                .map(|()| None);
        }
        self.entry().write_msg(REPLY, reply);
        self.cas(SlotState::Replying, SlotState::Accepted)
            .map(|()| Some(n))
    }

    /// Server: answers the Proposal. Claims the reply area (PROPOSED →
    /// REPLYING), writes `reply`, then moves to Accepted (`accept`) or
    /// Declined. Fails with the state found if the client gave up or the
    /// slot is stale; then nothing was written, or (client overrode a stalled
    /// REPLYING after [`REPLY_GRACE`]) the reply must be considered lost.
    pub fn answer(&self, reply: &[u8], accept: bool) -> std::result::Result<(), SlotState> {
        if reply.len() > MSG_LEN {
            return Err(SlotState::Invalid);
        }
        self.cas(SlotState::Proposed, SlotState::Replying)?;
        self.entry().write_msg(REPLY, reply);
        let to = if accept {
            SlotState::Accepted
        } else {
            SlotState::Declined
        };
        self.cas(SlotState::Replying, to)
    }

    /// Client: writes its Confirm (`accept`) or Decline message and moves
    /// Accepted → Confirmed or Declined. Fails with the state found when the
    /// server gave up first (Declined) or the slot is stale.
    ///
    /// Only the client (the slot's owner) may call it: the confirm area is
    /// written before the CAS and nobody else writes it.
    pub fn confirm(&self, msg: &[u8], accept: bool) -> std::result::Result<(), SlotState> {
        if msg.len() > MSG_LEN {
            return Err(SlotState::Invalid);
        }
        let st = self.state();
        if st != SlotState::Accepted {
            return Err(st);
        }
        self.entry().write_msg(CONFIRM, msg);
        let to = if accept {
            SlotState::Confirmed
        } else {
            SlotState::Declined
        };
        self.cas(SlotState::Accepted, to)
    }

    /// Client: stops waiting for the server (timeout). Moves Proposed →
    /// Declined; if the server is Replying, waits for it up to
    /// [`REPLY_GRACE`] and then moves Replying → Declined. `Ok` means the
    /// client's decline won; `Err(state)` means the server decided first
    /// (Accepted or Declined) and the client must follow it.
    pub fn give_up(&self) -> std::result::Result<(), SlotState> {
        match self.cas(SlotState::Proposed, SlotState::Declined) {
            Err(SlotState::Replying) => {}
            other => return other,
        }
        let st = self.wait_while(SlotState::Replying, Instant::now() + REPLY_GRACE);
        if st != SlotState::Replying {
            return Err(st);
        }
        self.cas(SlotState::Replying, SlotState::Declined)
    }

    /// Waits until the state is no longer `state` or `deadline` passes, and
    /// returns the state then. Spins briefly, then yields, then sleeps with
    /// growing naps (up to 1 ms), so that a fast answer is seen within
    /// microseconds and a slow one costs little CPU.
    pub fn wait_while(&self, state: SlotState, deadline: Instant) -> SlotState {
        crate::deferred::close_deferred();
        let mut round = 0u32;
        let mut nap = Duration::from_micros(20);
        loop {
            let st = self.state();
            if st != state {
                return st;
            }
            let now = Instant::now();
            if now >= deadline {
                return st;
            }
            round += 1;
            if round < 64 {
                std::hint::spin_loop();
            } else if round < 128 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }
}

/// The client's ownership of a slot; dropping it frees the slot (after
/// waiting up to [`REPLY_GRACE`] for a server that is writing its reply).
/// Dereferences to the [`SlotRef`].
///
/// A copy inherited through `fork` does nothing when dropped in the child.
#[derive(Debug)]
pub struct OwnedSlot(SlotRef);

impl Deref for OwnedSlot {
    type Target = SlotRef;
    fn deref(&self) -> &SlotRef {
        &self.0
    }
}

impl OwnedSlot {
    /// Frees the slot now (same as dropping it).
    pub fn release(self) {}
}

impl Drop for OwnedSlot {
    fn drop(&mut self) {
        let r = &self.0;
        let me = Owner::current();
        if me.pid != r.ticket.pid() {
            return;
        }
        if r.state() == SlotState::Replying {
            r.wait_while(SlotState::Replying, Instant::now() + REPLY_GRACE);
        }
        let e = r.entry();
        if let Some(c) = e.head.release(r.ticket, &me) {
            mark_announced(&r.dev, r.idx, false);
            e.head.free(c);
        }
    }
}
