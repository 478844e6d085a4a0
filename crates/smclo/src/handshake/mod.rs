//! Deciding SMC-D or TCP for one TCP connection (docs/handshake.md).
//!
//! The CLC runs through a rendezvous slot in the device, never through the TCP
//! stream: a peer that does not run smclo cannot see a single byte of it. The
//! client proposes before its SYN leaves; the server answers from `accept`,
//! after proving with the saved SYN that the TCP peer is the proposer; the two
//! agree by compare-and-swap on the slot, so a client that gives up and a
//! server that answers late always reach the same decision.
//!
//! `client` and `server` are the two state machines, which every driver
//! reaches through `pending` (one undecided handshake); `listener` is the
//! client process's rendezvous UNIX socket, which hands each server's
//! connection to the proposal it answers; `channel` is the plumbing: the
//! rendezvous addresses, the descriptors passed on a connection
//! (`SCM_RIGHTS`) and the bounded waits.

mod channel;
mod client;
mod early;
mod listener;
mod pending;
mod server;

pub use client::{client_propose, client_propose_with, ClientProposal, SocketFacts};
pub use pending::{Looker, Pending, Polled, TcpNews, Until};
use server::ServerHandshake;

use crate::access::PeerRefused;
use crate::config::Config;
use crate::conn::{Conn, Mode};
use crate::debug;
use crate::device::{Device, DmbHandle, Registration, LOOPBACK_CHID};
use crate::dmb::Dmb;
use crate::error::AttachError;
use crate::rendezvous::SlotKey;
use smclo_wire::clc::ClcMsg;
use smclo_wire::reason::Reason;
use smclo_wire::syn::Mark;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;

/// What a handshake needs of the [`Config`] it was made with, copied: a
/// clone of the whole would allocate on every connection (its device
/// path), a plain client's too.
#[derive(Clone, Copy)]
struct Settings {
    rmem: u32,
    wmem: u32,
    ueid: Option<[u8; 32]>,
    channel_placed_by_caller: bool,
}

impl Settings {
    fn of(cfg: &Config) -> Settings {
        Settings {
            rmem: cfg.rmem,
            wmem: cfg.wmem,
            ueid: cfg.ueid,
            channel_placed_by_caller: cfg.channel_placed_by_caller,
        }
    }
}

/// A connection that the handshake upgraded.
pub struct Established {
    /// The data path.
    pub conn: Conn,
    /// This end's DMB registration: its table entry carries the stats.
    pub registration: Registration,
    /// The client's SYN mark, still on its TCP socket: put it back before
    /// the program sees that socket's IP options.
    pub syn_mark: crate::tcp_syn::LeftMark,
}

/// What the handshake decided for one TCP connection.
// Made once per connection and moved once: boxing `Established` would cost
// an allocation per connection for nothing.
#[allow(clippy::large_enum_variant)]
pub enum Decision {
    /// Both ends run smclo on the same device: use shared memory.
    Smc(Established),
    /// Use the TCP connection as it is, and why.
    Tcp(Reason),
}

impl Decision {
    /// The reason, when the decision was TCP.
    pub fn fallback_reason(&self) -> Option<Reason> {
        match self {
            Decision::Smc(_) => None,
            Decision::Tcp(r) => Some(*r),
        }
    }

    /// Whether the client did not propose (PEERNOSMC): it found no live
    /// registration of the listener, which may have been lost while this
    /// process listens on it
    /// ([`ListenerGuard::renewed`](crate::registry::ListenerGuard::renewed)).
    pub fn peer_did_not_propose(&self) -> bool {
        matches!(self, Decision::Tcp(Reason::PeerNoSmc))
    }
}

/// What a program that waits for a handshake in steps
/// ([`Pending::poll`]) sleeps on in the kernel between two looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wake {
    /// Readable when the peer took its next step (a kernel wait may
    /// include it), if a descriptor tells.
    pub fd: Option<RawFd>,
    /// Readable too when the step may have come (a kernel wait includes
    /// it as well): set by another thread that took the step for us.
    pub also: Option<RawFd>,
    /// Look again after this long at the latest, whatever `fd` says
    /// (zero: at once); `None`: `fd` tells.
    pub within: Option<std::time::Duration>,
}

impl Wake {
    /// Look again at once.
    pub fn now() -> Wake {
        Wake {
            fd: None,
            also: None,
            within: Some(std::time::Duration::ZERO),
        }
    }
}

/// How a peer broke the handshake's protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerMisbehaved {
    /// A channel message whose byte is not the one this step expects.
    UnexpectedByte(u8),
    /// A channel message carrying more than one descriptor.
    ExtraDescriptors,
    /// A channel message whose control data did not fit (descriptors lost).
    TruncatedControl,
    /// A CLC message of another type than this step expects.
    UnexpectedClc,
    /// A CLC message that does not parse.
    InvalidClc,
}

/// Why a step of the handshake failed. Callers decide on the variant;
/// [`HandshakeError::reason`] is the one place that names the SMC decline
/// reason for each.
#[derive(Debug)]
pub enum HandshakeError {
    /// The peer broke the protocol.
    PeerMisbehaved(PeerMisbehaved),
    /// The peer at the other end of the channel may not share the device
    /// (its credentials, [`crate::access::check_peer`]).
    PeerRefused(PeerRefused),
    /// The peer is gone: its rendezvous socket no longer exists, or it
    /// refuses connections.
    PeerGone,
    /// The peer did not answer within the bound.
    Timeout,
    /// The DMB the peer passed cannot be attached.
    PeerDmb(AttachError),
    /// A system call on our side failed.
    Io(io::Error),
}

impl HandshakeError {
    /// The SMC decline reason this failure is reported with.
    pub fn reason(&self) -> Reason {
        match self {
            HandshakeError::PeerMisbehaved(_) => Reason::Protocol,
            HandshakeError::PeerRefused(PeerRefused::NotPermitted { .. }) => Reason::PeerCred,
            HandshakeError::PeerRefused(PeerRefused::Unknown(_)) => Reason::IntErr,
            HandshakeError::PeerGone => Reason::PeerDead,
            HandshakeError::Timeout => Reason::Timeout,
            // The token names no DMB (any more): the peer's DMB is gone.
            HandshakeError::PeerDmb(AttachError::TokenGone { .. }) => Reason::ErrRtok,
            HandshakeError::PeerDmb(_) => Reason::Protocol,
            HandshakeError::Io(_) => Reason::IntErr,
        }
    }
}

impl From<PeerMisbehaved> for HandshakeError {
    fn from(m: PeerMisbehaved) -> Self {
        HandshakeError::PeerMisbehaved(m)
    }
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::PeerMisbehaved(m) => write!(f, "peer misbehaved: {m:?}"),
            HandshakeError::PeerRefused(r) => write!(f, "{r}"),
            HandshakeError::PeerGone => write!(f, "peer gone"),
            HandshakeError::Timeout => write!(f, "timed out"),
            HandshakeError::PeerDmb(e) => write!(f, "peer's DMB: {e}"),
            HandshakeError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for HandshakeError {}

/// The CLC message in `bytes` (a slot's proposal or reply), which must be
/// of the type `pick` accepts.
fn expect_clc<T>(
    bytes: &[u8],
    pick: impl FnOnce(ClcMsg) -> Option<T>,
) -> Result<T, PeerMisbehaved> {
    match ClcMsg::parse(bytes) {
        Ok(m) => {
            let ty = m.msg_type();
            pick(m).ok_or_else(|| {
                debug!("unexpected CLC message {ty:?}");
                PeerMisbehaved::UnexpectedClc
            })
        }
        Err(e) => {
            debug!("invalid CLC message: {e}");
            Err(PeerMisbehaved::InvalidClc)
        }
    }
}

/// The rendezvous key for a connection from `src_ip` to `dest` whose SYN
/// carries `mark`. The client's port is not known before `connect` (the
/// kernel picks it then, which on loopback may reuse a port whose earlier
/// connection is in TIME_WAIT; an explicit `bind` to port 0 may not, and
/// ran out of ports at high connection rates). So the key carries the mark
/// where the client's port would be, and the client publishes its real port
/// in the slot right after `connect` ([`ClientProposal::syn_sent`]); the
/// server compares it with the SYN's.
fn key_for(src_ip: std::net::IpAddr, mark: Mark, dest: SocketAddr) -> SlotKey {
    SlotKey::new(src_ip, mark, dest)
}

/// How many times the data path's spin budget a handshake wait busy-polls
/// before it sleeps (see [`spin_budget`]).
const SPIN_FACTOR: u32 = 4;

/// How long a handshake wait that may sleep busy-polls first: [`SPIN_FACTOR`]
/// times the data path's budget (`SMCLO_SPIN_US`, whose 0 turns it off
/// here too). The peer of a handshake step was woken by the step before
/// and answers as soon as it runs, which on a busy machine takes longer
/// than a data-path reply; a sleep adds a wake-up on the other CPU per
/// step, and two cost more CPU time than the spin they save. A wait that
/// never sleeps (an event loop's `accept`) keeps the data path's budget
/// before it yields.
pub(crate) fn spin_budget() -> std::time::Duration {
    crate::wait::spin_budget() * SPIN_FACTOR
}

fn random_u64() -> u64 {
    crate::rng::next_u64()
}

/// The data path's mode on `dev`, with send buffers of `wmem` bytes if it
/// copies.
fn mode(dev: &Device, wmem: u32) -> Mode {
    if dev.dmb_copy() {
        Mode::Copy { sndbuf_len: wmem }
    } else {
        Mode::NoCopy
    }
}

/// The end of a handshake that upgraded: this end's DMB is marked connected
/// to the peer's `peer_token`, with the TCP connection's `local` and `peer`
/// addresses (what `smclo ss` shows), and the data path is built, counting
/// into the DMB's table entry.
fn establish(
    dmb: DmbHandle,
    peer_dmb: Dmb,
    chan: UnixStream,
    peer_token: u64,
    (local, peer): (SocketAddr, SocketAddr),
    mode: Mode,
) -> io::Result<Established> {
    let (mut local_dmb, registration) = dmb.into_parts();
    if let Some(own) = local_dmb.own_mut() {
        own.last_peer = peer_dmb.owner_pid();
    }
    registration.set_connected(peer_token, local, peer, mode);
    // The handshake's channels block: the client accepts them without
    // O_NONBLOCK, the server clears it after its bounded connect.
    let mut conn = Conn::new_blocking(local_dmb, peer_dmb, chan, mode)?;
    conn.set_record(registration.record());
    Ok(Established {
        conn,
        registration,
        syn_mark: Default::default(),
    })
}

/// The failure of attaching the peer's DMB.
fn attach_error(e: crate::Error) -> HandshakeError {
    debug!("attaching the peer's DMB failed: {e}");
    match e {
        crate::Error::Attach(a) => HandshakeError::PeerDmb(a),
        e => HandshakeError::Io(e.into()),
    }
}

/// Resets the TCP connection `fd` and reports `r`.
///
/// After ACCEPTED both ends are committed to SMC-D. An end that cannot
/// follow (no valid DMB from the peer, no connection built) must not carry
/// the stream over TCP instead, where its peer would never read it: it
/// resets the connection (`connect(AF_UNSPEC)` sends a RST), so its
/// application's next call fails with ECONNRESET; the peer's SMC-D
/// connection, whose channel closes without a close flag, reports a reset
/// too.
fn abort_tcp(fd: RawFd, r: Reason) -> Decision {
    if let Err(e) = crate::tcp_syn::reset(fd) {
        debug!("resetting the TCP connection failed: {e}");
    }
    Decision::Tcp(r)
}

/// The reason in the peer's Decline. The peer's own code is reported (the
/// stats then show, on both sides, why the pair fell back); an unreadable
/// one becomes PEERDECL.
fn peer_decline(bytes: Option<Vec<u8>>) -> Reason {
    match bytes.map(|b| ClcMsg::parse(&b)) {
        Some(Ok(ClcMsg::Decline(d))) => d.reason().unwrap_or(Reason::PeerDecl),
        _ => Reason::PeerDecl,
    }
}

/// Closes the descriptors smclo keeps without needing them, for a
/// connection attempt short of room in the descriptor budget
/// ([`crate::fdnum::room_for_conn`]): ended connections' TCP sockets
/// waiting to be closed, and pooled DMBs' memfds (DMBs are then created
/// anew rather than kept).
pub(crate) fn relieve_descriptors() {
    crate::deferred::close_deferred();
    crate::dmb::pool::shed();
}
