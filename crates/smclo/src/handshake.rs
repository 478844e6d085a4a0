//! Deciding SMC-D or TCP for one TCP connection (ARCHITECTURE.md, "Handshake").
//!
//! The CLC runs through a rendezvous slot in the device, never through the TCP
//! stream: a peer that does not run smclo cannot see a single byte of it. The
//! client proposes before its SYN leaves; the server answers from `accept`,
//! after proving with the saved SYN that the TCP peer is the proposer; the two
//! agree by compare-and-swap on the slot, so a client that gives up and a
//! server that answers late always reach the same decision.

use crate::config::Config;
use crate::conn::{Conn, Mode};
use crate::device::{self as device, Device, Registration, Role};
use crate::owner::{self, Owner};
use crate::registry;
use crate::rendezvous::{OwnedSlot, Rendezvous, SlotKey, SlotRef, SlotState, REPLY_GRACE};
use crate::tcp_syn::{self, SavedMark};
use crate::debug;
use smclo_wire::clc::{self, Accept, ClcMsg, Confirm, Decline, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::Mark;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CHID of an emulated loopback-ism device.
pub const LOOPBACK_CHID: u16 = 0xFFFF;

/// A connection that the handshake upgraded.
pub struct Established {
    /// The data path.
    pub conn: Conn,
    /// This end's DMB registration: its table entry carries the stats.
    pub registration: Registration,
}

/// What the handshake decided for one TCP connection.
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
}

/// A client's published proposal, between the moment it is written into the
/// device and the moment the server answers.
pub struct ClientProposal {
    // Drop order matters: the rendezvous socket closes before the slot is
    // freed, so a server that sees the slot vanish can tell a withdrawn
    // proposal (its channel is closed) from a confirmed one.
    rendezvous: Option<UnixListener>,
    slot: Option<OwnedSlot>,
    dmb: Option<device::DmbHandle>,
    dev: Arc<Device>,
    cfg: Config,
    rendezvous_path: PathBuf,
    saved_mark: Option<SavedMark>,
}

fn random_u64() -> u64 {
    crate::rng::next_u64()
}

fn local_addr(fd: RawFd) -> io::Result<SocketAddr> {
    crate::sockaddr::local(fd)
}

/// Client, before `connect`: decides whether to try SMC-D at all, and if so
/// binds the socket's source port, publishes the Proposal and marks the SYN.
///
/// `Err(reason)` means "plain TCP, nothing was changed on the socket" (except
/// an implicit bind, which `connect` would have done anyway).
pub fn client_propose(dev: &Arc<Device>, cfg: &Config, fd: RawFd, dest: SocketAddr) -> Result<ClientProposal, Reason> {
    let dest = tcp_syn::canonical(dest);
    if !dev.active() {
        return Err(Reason::NoSmcdDev);
    }
    let listener = registry::find_listener(dev, dest).ok_or(Reason::PeerNoSmc)?;
    let me = Owner::current();
    if listener.is_self() {
        // The accept that would answer may run on this very thread; waiting
        // for it could deadlock, so decline up front (DESIGN §3).
        return Err(Reason::SelfConnect);
    }
    // The key needs the source address before the SYN: bind it now, to the
    // address routing would choose anyway.
    let src = match local_addr(fd) {
        Ok(a) if a.port() != 0 => a,
        _ => {
            let ip = tcp_syn::route_source_cached(dest).map_err(|_| Reason::IntErr)?;
            crate::sockaddr::bind(fd, SocketAddr::new(ip, 0)).map_err(|e| {
                debug!("bind before proposal failed: {e}");
                Reason::IntErr
            })?;
            local_addr(fd).map_err(|_| Reason::IntErr)?
        }
    };
    let src = tcp_syn::canonical(src);
    let dmb = dev.register_dmb(cfg.rmem, Role::Client).map_err(|e| {
        debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
        Reason::Mem
    })?;
    let nonce = random_u64();
    let rendezvous_path = dev.dir().join(format!("u-{nonce:016x}"));
    let rendezvous = UnixListener::bind(&rendezvous_path).map_err(|e| {
        debug!("cannot create {}: {e}", rendezvous_path.display());
        Reason::IntErr
    })?;
    let mark = Mark::from_random(random_u64() as u32);
    let proposal = Proposal {
        gid: dev.gid(),
        chid: LOOPBACK_CHID,
        seid: dev.seid(),
        ueids: cfg.ueid.into_iter().collect(),
        mark_ttl: mark.ttl,
        mark_tos: mark.tos(),
        token: dmb.token(),
        dmbe_size_comp: clc::size_comp(dmb.dmb().ring_len()),
        nonce,
        pid: me.pid,
        start_time: me.start,
        netns: owner::netns_inode(),
    };
    let mut p = ClientProposal {
        rendezvous: Some(rendezvous),
        slot: None,
        dmb: Some(dmb),
        dev: dev.clone(),
        cfg: cfg.clone(),
        rendezvous_path,
        saved_mark: None,
    };
    let key = SlotKey::new(src, dest);
    let slot = Rendezvous::propose(dev, key, &ClcMsg::Proposal(proposal).to_bytes()).map_err(|e| {
        debug!("no rendezvous slot for {src} -> {dest}: {e}");
        Reason::MaxDmb
    })?;
    p.slot = Some(slot);
    p.saved_mark = Some(tcp_syn::apply_mark(fd, &dest, mark).map_err(|e| {
        debug!("cannot mark the SYN: {e}");
        Reason::IntErr
    })?);
    debug!("proposed {src} -> {dest} (mark ttl {} dscp {})", mark.ttl, mark.dscp);
    Ok(p)
}

impl ClientProposal {
    /// The token of the DMB offered in the Proposal.
    pub fn token(&self) -> u64 {
        self.dmb.as_ref().map_or(0, |d| d.token())
    }

    /// Puts the socket options back; call right after `connect` returned
    /// (0 or `EINPROGRESS`): the SYN has left by then.
    pub fn syn_sent(&mut self) {
        if let Some(s) = self.saved_mark.take() {
            if let Err(e) = tcp_syn::restore_mark(s) {
                debug!("restoring TTL/TOS after the SYN failed: {e}");
            }
        }
    }

    /// Waits (bounded by `SMCLO_CLC_WAIT_MS`) for the server's answer and
    /// completes the handshake. Call after the TCP connection is established.
    pub fn finish(mut self) -> Decision {
        self.syn_sent();
        let d = self.run();
        match &d {
            Decision::Tcp(r) => {
                self.dev.count_fallback(*r, Role::Client);
                debug!("client falls back to TCP: {r}");
            }
            Decision::Smc(_) => self.dev.count_conn_opened(),
        }
        d
    }

    /// Closes the rendezvous socket, then frees the slot (see the field
    /// order note on [`ClientProposal`]).
    fn withdraw(&mut self) {
        self.rendezvous = None;
        let _ = std::fs::remove_file(&self.rendezvous_path);
        self.slot = None;
    }

    fn run(&mut self) -> Decision {
        let deadline = Instant::now() + self.cfg.clc_wait;
        let slot: SlotRef = SlotRef::clone(self.slot.as_ref().expect("proposal without slot"));
        loop {
            let seen = slot.state();
            match seen {
                SlotState::Accepted => break,
                SlotState::Declined => {
                    let r = peer_decline(slot.reply());
                    self.withdraw();
                    return Decision::Tcp(r);
                }
                SlotState::Proposed | SlotState::Replying => {}
                other => {
                    debug!("rendezvous slot in state {other:?} while waiting for the server");
                    self.withdraw();
                    return Decision::Tcp(Reason::SyncErr);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                match slot.give_up() {
                    Ok(()) => {
                        self.withdraw();
                        return Decision::Tcp(Reason::Timeout);
                    }
                    Err(_) => continue, // the server decided first: follow it
                }
            }
            // The server connects to our rendezvous socket just before it
            // answers; sleep in poll until then, and spin only after. Wait on
            // the state seen above: waiting on a fresh read could start after
            // the answer and sleep until the deadline.
            let listener = self.rendezvous.as_ref().expect("rendezvous socket").as_raw_fd();
            if wait_readable(listener, deadline - now) {
                slot.wait_while(seen, deadline);
            }
        }
        match self.confirm(&slot) {
            Ok(e) => Decision::Smc(e),
            Err(r) => {
                // Close the channel first: a server that finds the slot gone
                // then sees a closed channel and knows we declined.
                self.rendezvous = None;
                let _ = slot.confirm(&ClcMsg::Decline(Decline::new(self.dev.gid(), r)).to_bytes(), false);
                self.withdraw();
                Decision::Tcp(r)
            }
        }
    }

    fn confirm(&mut self, slot: &SlotRef) -> Result<Established, Reason> {
        let accept = match slot.reply().map(|b| ClcMsg::parse(&b)) {
            Some(Ok(ClcMsg::Accept(a))) => a,
            Some(Ok(other)) => {
                debug!("expected an Accept, got {:?}", other.msg_type());
                return Err(Reason::Protocol);
            }
            Some(Err(e)) => {
                debug!("invalid Accept: {e}");
                return Err(Reason::Protocol);
            }
            None => return Err(Reason::SyncErr),
        };
        if accept.gid != self.dev.gid() || accept.chid != LOOPBACK_CHID {
            return Err(Reason::NoSmcd2Dev);
        }
        let peer = self.dev.attach_dmb(accept.token).map_err(|e| attach_reason(&e))?;
        let listener = self.rendezvous.as_ref().expect("rendezvous socket");
        listener.set_nonblocking(true).map_err(|_| Reason::IntErr)?;
        let (chan, _) = listener.accept().map_err(|e| {
            debug!("server answered but did not connect to the rendezvous socket: {e}");
            Reason::SyncErr
        })?;
        let dmb = self.dmb.as_ref().expect("client DMB");
        let confirm = Confirm {
            gid: self.dev.gid(),
            token: dmb.token(),
            dmbe_size_comp: clc::size_comp(dmb.dmb().ring_len()),
            linkid: accept.linkid,
            chid: LOOPBACK_CHID,
        };
        if let Err(st) = slot.confirm(&ClcMsg::Confirm(confirm).to_bytes(), true) {
            // The server timed out waiting for us and declined.
            debug!("server gave up before our Confirm (slot {st:?})");
            return Err(Reason::Timeout);
        }
        // Wake the server, which sleeps on the channel: one byte, which it
        // takes before the channel starts carrying doorbells. A failure means
        // the server is gone, which the connection reports on first use.
        // SAFETY: send of one byte from a live buffer on our own socket.
        unsafe { libc::send(chan.as_raw_fd(), [CONFIRM_BYTE].as_ptr().cast(), 1, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        self.withdraw();
        let (local, registration) = self.dmb.take().expect("client DMB").into_parts();
        registration.set_connected(accept.token);
        // From here both sides are committed; a failure below leaves the
        // server with a channel that closes, which it reports as a reset.
        match Conn::new(local, peer, chan, mode(&self.dev, &self.cfg)) {
            Ok(conn) => Ok(Established { conn, registration }),
            Err(e) => {
                debug!("building the connection failed after CONFIRM: {e}");
                Err(Reason::IntErr)
            }
        }
    }
}

impl Drop for ClientProposal {
    fn drop(&mut self) {
        if let Some(s) = self.saved_mark.take() {
            let _ = tcp_syn::restore_mark(s);
        }
        if let Some(slot) = &self.slot {
            // Abandoned before finish (connect failed): withdraw the proposal.
            let _ = slot.give_up();
        }
        self.withdraw();
    }
}

fn mode(dev: &Device, cfg: &Config) -> Mode {
    if dev.dmb_copy() { Mode::Copy { sndbuf_len: cfg.wmem } } else { Mode::NoCopy }
}

fn attach_reason(e: &crate::Error) -> Reason {
    debug!("attaching the peer's DMB failed: {e}");
    if device::is_token_gone(e) {
        Reason::ErrRtok
    } else if matches!(e, crate::Error::InvalidDevice(_)) {
        Reason::Protocol
    } else {
        Reason::IntErr
    }
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

/// What the client sends on the channel after its Confirm (and before any
/// doorbell).
const CONFIRM_BYTE: u8 = 0xC5;

/// Blocks until `fd` is readable or `timeout` passes; true if readable.
fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd, count 1.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// Server, in `accept`: answers the proposal (if any) of the client behind
/// the freshly accepted TCP connection `conn_fd`.
pub fn server_accept(dev: &Arc<Device>, cfg: &Config, conn_fd: RawFd) -> Decision {
    let d = server_run(dev, cfg, conn_fd);
    if let Decision::Tcp(r) = &d {
        dev.count_fallback(*r, Role::Server);
        debug!("server keeps TCP: {r}");
    }
    d
}

fn server_run(dev: &Arc<Device>, cfg: &Config, conn_fd: RawFd) -> Decision {
    let syn = match tcp_syn::saved_syn(conn_fd) {
        Ok(Some(Ok(s))) => s,
        Ok(Some(Err(e))) => {
            debug!("unreadable saved SYN: {e}");
            return Decision::Tcp(Reason::NoSavedSyn);
        }
        Ok(None) => return Decision::Tcp(Reason::NoSavedSyn),
        Err(e) => {
            debug!("TCP_SAVED_SYN failed: {e}");
            return Decision::Tcp(Reason::NoSavedSyn);
        }
    };
    let key = SlotKey::new(syn.src, syn.dst);
    // Proposals for this 4-tuple; more than one only when clients in other
    // network namespaces use the same addresses. The mark picks ours.
    let candidates = Rendezvous::find_all(dev, key);
    if candidates.is_empty() {
        // The client does not run smclo: plain TCP, not one byte exchanged.
        return Decision::Tcp(Reason::PeerNoSmc);
    }
    let mut mismatched = false;
    for slot in candidates {
        let proposal = match slot.proposal().map(|b| ClcMsg::parse(&b)) {
            Some(Ok(ClcMsg::Proposal(p))) => p,
            Some(Ok(m)) => {
                debug!("expected a Proposal, got {:?}", m.msg_type());
                return decline(dev, &slot, Reason::Protocol, None);
            }
            Some(Err(e)) => {
                debug!("invalid Proposal: {e}");
                return decline(dev, &slot, Reason::Protocol, None);
            }
            None => continue, // withdrawn meanwhile
        };
        if syn.mark != (Mark { ttl: proposal.mark_ttl, dscp: proposal.mark_tos >> 2 }) {
            // Someone else's connection with the same 4-tuple: not ours to
            // answer; its own server will.
            mismatched = true;
            continue;
        }
        return server_answer(dev, cfg, &slot, &proposal);
    }
    if mismatched {
        debug!("SYN mark {:?} matches no proposal for {} -> {}", syn.mark, key.client, key.server);
    }
    Decision::Tcp(if mismatched { Reason::MarkMismatch } else { Reason::PeerNoSmc })
}

fn server_answer(dev: &Arc<Device>, cfg: &Config, slot: &SlotRef, proposal: &Proposal) -> Decision {
    let wake = dev.dir().join(format!("u-{:016x}", proposal.nonce));
    let checks = [
        (dev.active(), Reason::NoSmcdDev),
        (proposal.gid == dev.gid() && proposal.chid == LOOPBACK_CHID, Reason::NoSmcd2Dev),
        (ueid_match(proposal, cfg), Reason::NoUeid),
        (Owner { pid: proposal.pid, start: proposal.start_time }.is_alive_fast(), Reason::PeerDead),
    ];
    if let Some((_, r)) = checks.iter().find(|(ok, _)| !ok) {
        return decline(dev, slot, *r, Some(&wake));
    }
    let peer = match dev.attach_dmb(proposal.token) {
        Ok(p) => p,
        Err(e) => return decline(dev, slot, attach_reason(&e), Some(&wake)),
    };
    let dmb = match dev.register_dmb(cfg.rmem, Role::Server) {
        Ok(d) => d,
        Err(e) => {
            debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
            return decline(dev, slot, Reason::Mem, Some(&wake));
        }
    };
    let chan = match UnixStream::connect(&wake) {
        Ok(c) => c,
        Err(e) => {
            debug!("cannot reach the client's rendezvous socket: {e}");
            return decline(dev, slot, Reason::PeerDead, None);
        }
    };
    let accept = Accept {
        gid: dev.gid(),
        token: dmb.token(),
        dmbe_size_comp: clc::size_comp(dmb.dmb().ring_len()),
        linkid: random_u64() as u32,
        chid: LOOPBACK_CHID,
    };
    if let Err(st) = slot.answer(&ClcMsg::Accept(accept).to_bytes(), true) {
        // The client gave up first (timeout): its decision is TCP.
        debug!("client withdrew before our Accept (slot {st:?})");
        return Decision::Tcp(Reason::Timeout);
    }
    // Wait for the client's Confirm: it sends CONFIRM_BYTE on the channel
    // after its CAS to CONFIRMED, and closes the channel when it declines,
    // so the server sleeps in poll instead of spinning on the slot.
    let mut deadline = Instant::now() + cfg.clc_wait;
    let mut granted_grace = false;
    let confirmed = loop {
        let now = Instant::now();
        if now < deadline && wait_readable(chan.as_raw_fd(), deadline - now) {
            let mut b = [0u8; 1];
            // SAFETY: recv of at most one byte into a buffer we own.
            let n = unsafe { libc::recv(chan.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) };
            if n == 1 && b[0] == CONFIRM_BYTE {
                break true;
            }
            if n == 1 || n == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
                // Closed (the client declined or died) or garbage.
                if slot.state() == SlotState::Declined {
                    return Decision::Tcp(peer_decline(slot.confirm_msg()));
                }
                break false;
            }
            continue;
        }
        match slot.cas(SlotState::Accepted, SlotState::Declined) {
            Ok(()) => return Decision::Tcp(Reason::Timeout),
            Err(SlotState::Declined) => return Decision::Tcp(peer_decline(slot.confirm_msg())),
            // The client confirmed just now (and may have freed the slot
            // since): its byte is on the way.
            Err(SlotState::Confirmed | SlotState::Stale) if !granted_grace => {
                granted_grace = true;
                deadline = Instant::now() + REPLY_GRACE;
            }
            Err(other) => {
                debug!("rendezvous slot in state {other:?} after our Accept");
                return Decision::Tcp(Reason::SyncErr);
            }
        }
    };
    if !confirmed {
        return Decision::Tcp(Reason::PeerDecl);
    }
    let (local, registration) = dmb.into_parts();
    registration.set_connected(proposal.token);
    match Conn::new(local, peer, chan, mode(dev, cfg)) {
        Ok(conn) => Decision::Smc(Established { conn, registration }),
        Err(e) => {
            debug!("building the connection failed: {e}");
            Decision::Tcp(Reason::IntErr)
        }
    }
}

fn ueid_match(p: &Proposal, cfg: &Config) -> bool {
    match &cfg.ueid {
        None => p.ueids.is_empty(),
        Some(u) => p.ueids.iter().any(|x| x == u),
    }
}

/// Declines the proposal in `slot` with reason `r` and wakes the client (by
/// connecting to its rendezvous socket) so it does not wait for the timeout.
fn decline(dev: &Device, slot: &SlotRef, r: Reason, wake: Option<&std::path::Path>) -> Decision {
    if slot.answer(&ClcMsg::Decline(Decline::new(dev.gid(), r)).to_bytes(), false).is_ok() {
        if let Some(w) = wake {
            let _ = UnixStream::connect(w);
        }
    }
    Decision::Tcp(r)
}
