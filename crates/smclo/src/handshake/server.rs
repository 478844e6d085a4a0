//! The server's state machine: from `accept`, find the proposal behind the
//! saved SYN and answer it. [`ServerHandshake`] runs it, within a blocking
//! `accept` or after `accept` returned (`super::Pending::accept`).

use super::channel::{
    recv_expected, send_msg, spin_readable, wait_readable, Received, RendezvousAddr,
    CLIENT_DMB_BYTE, CONNECT_BOUND, SERVER_DMB_BYTE,
};
use super::{
    abort_tcp, attach_error, early, establish, expect_clc, key_for, mode, random_u64, Decision,
    HandshakeError, Settings, Wake, LOOPBACK_CHID,
};
use crate::access::Shape;
use crate::config::Config;
use crate::debug;
use crate::device::{Device, DmbHandle, Role};
use crate::dmb::Dmb;
use crate::owner::Owner;
use crate::rendezvous::{Progress, Rendezvous, SlotRef, SlotState};
use crate::tcp_syn;
use smclo_wire::clc::{self, Accept, ClcMsg, Decline, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::{Mark, Syn};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the wait for the client's DMB looks whether the client
/// withdrew its proposal or died.
const WITHDRAWN_CHECK: Duration = Duration::from_millis(10);

/// How often a program waiting in steps looks at the client's source
/// port.
const PORT_LOOK: Duration = Duration::from_millis(1);

/// How long a server looks at announcements from other source addresses
/// whose clients have not published their TSvals yet (their `connect`
/// has not returned): one may be this connection's through source NAT,
/// whose client is then told at once (SOURCE_NAT). Past it, such a client
/// finds out by itself (UNANSWERED).
const FOREIGN_WAIT: Duration = Duration::from_millis(2);

/// A sleeping wait's pause between two looks at the client's source port,
/// which it writes in shared memory only.
const PORT_NAP: Duration = Duration::from_micros(50);

/// The server's half of one handshake, from `accept` on, in steps
/// (driven through [`Pending`](super::Pending)): an event loop's `accept`
/// can return before the client has answered, and the handshake goes on
/// from the application's next calls, as a non-blocking connect's does.
///
/// Dropped undecided, it declines (TIMEOUT) if it had answered, so the
/// client does not wait for it; its slot is left alone otherwise, and by
/// the copy a fork child inherited.
pub(super) struct ServerHandshake {
    dev: Arc<Device>,
    cfg: Settings,
    conn_fd: RawFd,
    /// The SYN's source port: the proposal whose client published it is
    /// the one to answer.
    syn_port: u16,
    /// This end's and the client's TCP addresses.
    ends: (SocketAddr, SocketAddr),
    /// When the wait on the client began (it spins first).
    since: Instant,
    /// Some candidate's mark did not match the SYN's, or its port differs.
    mismatched: bool,
    /// An unmarked SYN's TSval, which proves an announcement ours.
    tsval: Option<u32>,
    stage: Stage,
    /// The process that accepted the connection: a copy a fork child
    /// inherited is not its to decline.
    pid: u32,
    /// The caller waits for the decision (see `decide_within`): the
    /// client's early bytes may be waited for longer than an event loop's
    /// step may take ([`early::arrival_wait`]).
    may_wait: bool,
    /// The client's proposal is declined with this reason, not answered
    /// ([`Self::refuse`]): the descriptor goes to another process, or this
    /// process cannot carry a connection.
    refused: Option<Reason>,
}

enum Stage {
    /// Proposals for the SYN's addresses and mark whose client has not
    /// published its source port yet.
    Matching(Vec<Candidate>),
    /// Connected to the client's rendezvous socket: waiting for its DMB.
    Answering(Box<Answering>),
    /// TCP, decided at once (no proposal, no saved SYN, ...), not yet
    /// reported.
    Decided(Reason),
    /// Reported.
    Done,
}

struct Answering {
    slot: SlotRef,
    proposal: Proposal,
    dmb: DmbHandle,
    chan: UnixStream,
    /// `dmb` is the one the client keeps a mapping of: it is not passed.
    reused: bool,
    /// The client's DMB, attached, while its early bytes are on their way
    /// ([`ServerHandshake::try_finish`]), and since when.
    peer: Option<(Dmb, Instant)>,
}

impl Answering {
    /// The token of the client's DMB: the one its Proposal names, or the
    /// one it named in the slot when it registered its DMB on our
    /// connection (an announcement, whose Proposal's token only names the
    /// proposal).
    fn client_token(&self) -> u64 {
        self.slot.client_token().unwrap_or(self.proposal.token)
    }
}

/// A proposal that may be this connection's, while its client's port is
/// not known yet.
struct Candidate {
    slot: SlotRef,
    proposal: Proposal,
    /// Its mark fits the SYN's ([`Mark::fits`]).
    fits: bool,
    /// An announcement from another source address than the SYN's:
    /// ours only through source NAT, which its TSval window tells.
    foreign: bool,
}

impl ServerHandshake {
    /// The handshake of the freshly accepted TCP connection `conn_fd`:
    /// reads its saved SYN and finds the proposals it may answer, without
    /// waiting.
    pub(super) fn new(dev: &Arc<Device>, cfg: &Config, conn_fd: RawFd) -> ServerHandshake {
        let mut h = ServerHandshake {
            dev: dev.clone(),
            cfg: Settings::of(cfg),
            conn_fd,
            syn_port: 0,
            ends: (
                SocketAddr::from(([0, 0, 0, 0], 0)),
                SocketAddr::from(([0, 0, 0, 0], 0)),
            ),
            since: Instant::now(),
            mismatched: false,
            tsval: None,
            stage: Stage::Done,
            pid: crate::owner::current_pid(),
            may_wait: false,
            refused: None,
        };
        h.stage = match h.candidates() {
            Ok(c) => Stage::Matching(c),
            Err(d) => Stage::Decided(d),
        };
        h
    }

    /// The TCP decision reached when the SYN was read (no proposal, no
    /// saved SYN, ...), reported; `None` while there is a client to look
    /// for.
    pub(super) fn settled(&mut self) -> Option<Reason> {
        match self.stage {
            Stage::Decided(r) => {
                self.counted(Decision::Tcp(r));
                Some(r)
            }
            _ => None,
        }
    }

    /// This end's and the client's TCP addresses, as the saved SYN showed
    /// them (the socket's own, address translation included); `None`
    /// without one.
    pub(super) fn seen_ends(&self) -> Option<(SocketAddr, SocketAddr)> {
        (self.syn_port != 0).then_some(self.ends)
    }

    /// The proposals with the SYN's addresses and mark, or the decision
    /// when there can be none.
    fn candidates(&mut self) -> Result<Vec<Candidate>, Reason> {
        let syn = match tcp_syn::saved_syn(self.conn_fd) {
            Ok(Some(Ok(s))) => s,
            Ok(Some(Err(e))) => {
                debug!("unreadable saved SYN: {e}");
                return Err(Reason::NoSavedSyn);
            }
            Ok(None) => return Err(Reason::NoSavedSyn),
            Err(e) => {
                debug!("TCP_SAVED_SYN failed: {e}");
                return Err(Reason::NoSavedSyn);
            }
        };
        self.syn_port = syn.src.port();
        self.ends = (tcp_syn::canonical(syn.dst), tcp_syn::canonical(syn.src));
        if !Mark::may_be_marked(syn.mark) {
            return self.announcements(&syn);
        }
        let key = key_for(tcp_syn::canonical(syn.src).ip(), syn.mark, syn.dst);
        // Proposals for this 4-tuple; more than one only when clients in
        // other network namespaces use the same addresses. The mark picks
        // ours.
        // The scan stops at a proposal that is surely ours; one that only
        // has our port may be another namespace's with our addresses.
        let port = self.syn_port;
        let ours = |s: &SlotRef| {
            s.client_port() == Some(port) && proposal_mark(s).is_some_and(|m| m.fits(syn.mark))
        };
        let found = Rendezvous::find_until(&self.dev, key, ours);
        let mut out = self.judge(found, syn.mark)?;
        if out.is_empty() && Mark::ttl_looks_marked(syn.mark.ttl) {
            // A marked SYN whose DSCP may have been rewritten on the way:
            // find its client to decline at once.
            let found =
                Rendezvous::find_any_dscp(&self.dev, key, |s| s.client_port() == Some(port));
            out = self.judge(found, syn.mark)?;
        }
        if out.is_empty() {
            return Err(self.unmatched());
        }
        Ok(out)
    }

    /// The announcements ([`super::client`]'s `announce`) that may be the
    /// connection of an unmarked SYN: those from its source address, among
    /// the one window all announcements share; its client's port and TSval
    /// window pick ours ([`Self::look_ports`]). One whose TSval window fits
    /// but whose address is another is this connection seen through
    /// source NAT ([`Self::source_translated`]). A SYN without a timestamp
    /// cannot be proven; a plain client's costs one window's look, as
    /// before announcements.
    fn announcements(&mut self, syn: &Syn) -> Result<Vec<Candidate>, Reason> {
        let Some(tsval) = syn.tsval else {
            return Err(Reason::PeerNoSmc);
        };
        self.tsval = Some(tsval);
        let (peer, port) = (self.ends.1.ip(), self.syn_port);
        let proven = |s: &SlotRef| s.client_port() == Some(port) && ts_fits(s, tsval);
        let found = Rendezvous::find_announcements(&self.dev, proven);
        let (mine, others): (Vec<SlotRef>, Vec<SlotRef>) =
            found.into_iter().partition(|s| s.client_ip() == Some(peer));
        let mut out = self.judge_announced(mine, false)?;
        if out.is_empty() {
            if let Some(s) = others.iter().find(|s| ts_fits(s, tsval)) {
                return Err(self.source_translated(s));
            }
        }
        // Those whose client has not published its TSvals yet (its connect
        // has not returned) may be ours through source NAT: looked at
        // again for a short while (FOREIGN_WAIT).
        let unknown = others.into_iter().filter(|s| s.client_ts().is_none());
        out.extend(self.judge_announced(unknown.collect(), true)?);
        if out.is_empty() {
            return Err(Reason::PeerNoSmc);
        }
        Ok(out)
    }

    /// The readable announcements among `found`; `foreign`: from another
    /// source address than the one we see.
    fn judge_announced(
        &self,
        found: Vec<SlotRef>,
        foreign: bool,
    ) -> Result<Vec<Candidate>, Reason> {
        let mut out = Vec::new();
        for slot in found {
            let Some(bytes) = slot.proposal() else {
                continue; // withdrawn meanwhile
            };
            match expect_clc(&bytes, |m| match m {
                ClcMsg::Proposal(p) => Some(p),
                _ => None,
            }) {
                Ok(proposal) if mark_of(&proposal) == Mark::NONE => out.push(Candidate {
                    slot,
                    proposal,
                    fits: true,
                    foreign,
                }),
                Ok(_) => {}
                Err(m) => {
                    let r = HandshakeError::from(m).reason();
                    return Err(decline(&self.dev, &slot, r, None));
                }
            }
        }
        Ok(out)
    }

    /// The announcement in `slot`, whose TSval window our SYN's fits but
    /// whose client's address is not the one we see: this connection,
    /// through source NAT (a random 32-bit clock offset makes another
    /// connection's fitting by chance about one in two billion). Declined
    /// (SOURCE_NAT) and its client woken, which then goes on over TCP at
    /// once and counts why.
    fn source_translated(&self, slot: &SlotRef) -> Reason {
        debug!(
            "the connection from {} is an announcement from {:?}: source NAT on the way",
            self.ends.1,
            slot.client_ip()
        );
        let Some(Ok(ClcMsg::Proposal(p))) = slot.proposal().map(|b| ClcMsg::parse(&b)) else {
            return Reason::PeerNoSmc;
        };
        decline_waking(&self.dev, slot, Reason::SourceNat, &p)
    }

    /// The proposals among `found` that may be this connection's: those
    /// whose mark fits the SYN's `seen`, and, when `seen` looks marked at
    /// all, those it does not fit, which are declined if they turn out to
    /// be ours (a mark changed on the way).
    fn judge(&mut self, found: Vec<SlotRef>, seen: Mark) -> Result<Vec<Candidate>, Reason> {
        let mut out = Vec::new();
        for slot in found {
            let Some(bytes) = slot.proposal() else {
                continue; // withdrawn meanwhile
            };
            let proposal = match expect_clc(&bytes, |m| match m {
                ClcMsg::Proposal(p) => Some(p),
                _ => None,
            }) {
                Ok(p) => p,
                Err(m) => {
                    let r = HandshakeError::from(m).reason();
                    return Err(decline(&self.dev, &slot, r, None));
                }
            };
            let fits = mark_of(&proposal).fits(seen);
            if fits || Mark::may_be_marked(seen) {
                out.push(Candidate {
                    slot,
                    proposal,
                    fits,
                    foreign: false,
                });
            }
        }
        Ok(out)
    }

    /// No proposal is this connection's.
    fn unmatched(&self) -> Reason {
        if self.mismatched {
            debug!(
                "the SYN from {} matches no proposal to {}",
                self.ends.1, self.ends.0
            );
            Reason::MarkMismatch
        } else {
            // The client does not run smclo: plain TCP, not one byte
            // exchanged.
            Reason::PeerNoSmc
        }
    }

    /// The descriptor that becomes readable when the client takes its
    /// next step (its DMB on the channel), if there is one. `None` while
    /// matching its source port, which it writes in shared memory only.
    fn wake_fd(&self) -> Option<RawFd> {
        match &self.stage {
            // Waiting for its early bytes, which make our socket readable.
            Stage::Answering(a) if a.peer.is_some() => Some(self.conn_fd),
            Stage::Answering(a) => Some(a.chan.as_raw_fd()),
            _ => None,
        }
    }

    /// What a program waiting for the client sleeps on (see
    /// [`wake_fd`](Self::wake_fd)).
    pub(super) fn wake(&self) -> Wake {
        match &self.stage {
            // Waiting for early bytes: the program's wait on its socket
            // sees them arrive; look again when the wait for them ends.
            Stage::Answering(a) if a.peer.is_some() => Wake {
                fd: Some(self.conn_fd),
                also: None,
                within: a
                    .peer
                    .as_ref()
                    .map(|(_, t)| early::ARRIVAL_WAIT.saturating_sub(t.elapsed())),
            },
            Stage::Answering(a) => Wake {
                fd: Some(a.chan.as_raw_fd()),
                also: None,
                within: None,
            },
            Stage::Matching(_) => Wake {
                fd: None,
                also: None,
                within: Some(PORT_LOOK),
            },
            _ => Wake::now(),
        }
    }

    /// Whether the client says in shared memory that it took its next step
    /// (see [`wait_readable`]).
    fn hint(&self) -> bool {
        match &self.stage {
            Stage::Matching(c) => c.iter().any(|c| c.slot.client_port().is_some()),
            Stage::Answering(a) if a.peer.is_some() => {
                early::counted_arrived(self.conn_fd, a.slot.early_counted())
            }
            Stage::Answering(a) => a.slot.noted(Progress::ClientDmbSent),
            _ => true,
        }
    }

    /// Advances the handshake without waiting past `until` (`None`: until
    /// it decides): `Some` once it has decided (fallbacks counted), `None`
    /// while the client has not answered and `until` has passed.
    /// `deadline` is when the server gives up (TIMEOUT). Up to the spin
    /// budget before `until` it busy-polls; a longer wait sleeps on
    /// [`wake_fd`](Self::wake_fd). `may_wait`: the caller waits for the
    /// decision all the same (without `until`, or a blocking call that
    /// looks again after each step): the client's early bytes are then
    /// waited for as by a blocking `accept`.
    pub(super) fn decide_within(
        &mut self,
        deadline: Instant,
        until: Option<Instant>,
        may_wait: bool,
    ) -> Option<Decision> {
        self.may_wait = may_wait;
        loop {
            let now = Instant::now();
            let stop = until.map_or(deadline, |u| u.min(deadline));
            let bound = CONNECT_BOUND.min(stop.saturating_duration_since(now));
            if let Some(d) = self.look(bound) {
                return Some(self.counted(d));
            }
            let now = Instant::now();
            if now >= deadline {
                let d = self.give_up();
                return Some(self.counted(d));
            }
            if now >= stop {
                return None;
            }
            self.wait_client(stop.min(now + WITHDRAWN_CHECK));
        }
    }

    /// The connection cannot go through shared memory (`why`): its
    /// descriptor goes to another process (`SCM_RIGHTS`, PASSED) before
    /// the handshake ended, or this process uses io_uring (IO_URING).
    /// Decides TCP, and declines the client's proposal as soon as it is
    /// found, waking its client, so that the client goes on over TCP at
    /// once instead of waiting for an answer no process will give. Waits
    /// for the client's port at most until `deadline`.
    pub(super) fn refuse(&mut self, why: Reason, deadline: Instant) -> Decision {
        self.refused = Some(why);
        self.decide_within(deadline, None, false)
            .unwrap_or(Decision::Tcp(why))
    }

    /// Waits at most until `stop` for the client's next step: spins for
    /// the spin budget, then sleeps.
    fn wait_client(&self, stop: Instant) {
        let now = Instant::now();
        let left = stop.saturating_duration_since(now);
        let sleep = left > crate::wait::spin_budget();
        match self.wake_fd() {
            Some(fd) if sleep => {
                wait_readable(fd, left, || self.hint());
            }
            Some(fd) => {
                spin_readable(fd, stop, || self.hint());
            }
            None if self.since.elapsed() < crate::wait::spin_budget()
                && !crate::spin::quiet_now() =>
            {
                let spin = crate::wait::spin_budget().saturating_sub(self.since.elapsed());
                crate::spin::until(spin.min(left), None, || self.hint().then_some(()));
            }
            None if sleep => std::thread::sleep(PORT_NAP.min(left)),
            None => std::thread::yield_now(),
        }
    }

    /// One look at the client, never waiting but for room in its
    /// rendezvous backlog (at most `bound`).
    fn look(&mut self, bound: Duration) -> Option<Decision> {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Matching(c) => self.look_ports(c, bound),
            Stage::Answering(a) => self.look_dmb(a),
            Stage::Decided(r) => Some(Decision::Tcp(r)),
            Stage::Done => Some(Decision::Tcp(Reason::IntErr)),
        }
    }

    /// Same source address and server: a proposal is ours only if its
    /// client's port (published right after its `connect`) is the SYN's,
    /// and answered only if its mark fits the SYN's. A client that died before publishing it is the dead
    /// proposer; one that has not published it yet may be someone
    /// else's (its slot is left alone).
    fn look_ports(&mut self, candidates: Vec<Candidate>, bound: Duration) -> Option<Decision> {
        let spun = self.since.elapsed() >= crate::wait::spin_budget();
        let mut waiting = Vec::new();
        let mut changed = None;
        for c in candidates {
            let slot = &c.slot;
            if c.foreign {
                match slot.client_ts() {
                    Some(w) if self.tsval.is_some_and(|t| w.fits(t)) => {
                        return Some(Decision::Tcp(self.source_translated(slot)));
                    }
                    None if self.since.elapsed() < FOREIGN_WAIT
                        && slot.state() == SlotState::Proposed =>
                    {
                        waiting.push(c)
                    }
                    _ => {}
                }
                continue;
            }
            let announced = mark_of(&c.proposal) == Mark::NONE;
            match slot.client_port() {
                Some(p) if p == self.syn_port && announced => {
                    if self.tsval.is_some_and(|t| ts_fits(slot, t)) {
                        return self.matched(c.slot, c.proposal, bound);
                    }
                    // Another connection from our source port (to another
                    // destination): not ours.
                    debug!(
                        "an announcement from port {p} whose TSvals {:?} do not hold the SYN's {:?}",
                        slot.client_ts(),
                        self.tsval
                    );
                }
                Some(p) if p == self.syn_port && c.fits => {
                    return self.matched(c.slot, c.proposal, bound)
                }
                // Ours with its mark changed on the way, unless one that
                // fits turns out to be ours.
                Some(p) if p == self.syn_port => changed = Some(c),
                // Someone else's connection with the same addresses and
                // mark: not ours to answer; its own server will.
                Some(_) => self.mismatched |= c.fits && !announced,
                None if !c.fits => waiting.push(c),
                None if slot.state() != SlotState::Proposed => {
                    if !slot.client().is_alive_fast() {
                        return Some(Decision::Tcp(decline(
                            &self.dev,
                            slot,
                            Reason::PeerDead,
                            None,
                        )));
                    }
                    // A withdrawn announcement says nothing of our SYN's
                    // mark: its client closed before it published.
                    self.mismatched |= !announced;
                }
                None if spun && !slot.client().is_alive_fast() => {
                    return Some(Decision::Tcp(decline(
                        &self.dev,
                        slot,
                        Reason::PeerDead,
                        None,
                    )));
                }
                None => waiting.push(c),
            }
        }
        if let Some(c) = changed {
            if !waiting.iter().any(|w| w.fits) {
                return Some(self.changed_mark(&c));
            }
            waiting.push(c);
        }
        if waiting.is_empty() {
            return Some(Decision::Tcp(self.unmatched()));
        }
        self.stage = Stage::Matching(waiting);
        None
    }

    /// The proposal of `c` is this connection's (its port is the SYN's)
    /// but its mark does not fit the SYN's: something on the way changed
    /// the mark. Declined, and its client woken, so that it goes on over
    /// TCP at once instead of waiting for an answer.
    fn changed_mark(&self, c: &Candidate) -> Decision {
        debug!(
            "the SYN from {} carries a mark other than its proposal's (changed on the way?): TCP",
            self.ends.1
        );
        Decision::Tcp(decline_waking(
            &self.dev,
            &c.slot,
            Reason::MarkMismatch,
            &c.proposal,
        ))
    }

    /// The proposal in `slot` is this connection's: answer it.
    fn matched(&mut self, slot: SlotRef, proposal: Proposal, bound: Duration) -> Option<Decision> {
        if slot.client() == Owner::current() {
            // This process proposed (a worker connecting to a listener it
            // shares with its siblings): its handshake continues in this
            // process, perhaps on this very thread once `accept` returns,
            // so waiting for it here could only run out of time.
            return Some(Decision::Tcp(decline(
                &self.dev,
                &slot,
                Reason::SelfConnect,
                None,
            )));
        }
        if let Some(why) = self.refused {
            return Some(Decision::Tcp(decline_waking(
                &self.dev, &slot, why, &proposal,
            )));
        }
        match self.connect_client(slot, proposal, bound) {
            Ok(Connected::Waiting(a)) => {
                self.stage = Stage::Answering(a);
                None
            }
            Ok(Connected::Cached(a, peer)) => self.try_finish(a, peer, Instant::now()),
            Err(r) => Some(Decision::Tcp(r)),
        }
    }
    /// Checks the proposal, registers our DMB and connects to the client's
    /// rendezvous socket (waiting at most `bound` for room in its backlog).
    fn connect_client(
        &self,
        slot: SlotRef,
        proposal: Proposal,
        bound: Duration,
    ) -> Result<Connected, Reason> {
        let dev = &self.dev;
        let client = RendezvousAddr::new(dev, proposal.nonce);
        // Our end of the channel is named for the proposal it answers.
        let wake = (&client, proposal.token);
        let checks = [
            (dev.active(), Reason::NoSmcdDev),
            (dev.check_caller().is_ok(), Reason::UidChanged),
            (
                proposal.gid == dev.gid() && proposal.chid == LOOPBACK_CHID,
                Reason::NoSmcd2Dev,
            ),
            (ueid_match(&proposal, &self.cfg), Reason::NoUeid),
        ];
        if let Some((_, r)) = checks.iter().find(|(ok, _)| !ok) {
            return Err(decline(dev, &slot, *r, Some(wake)));
        }
        if !crate::fdnum::room_for_conn(super::relieve_descriptors) {
            return Err(decline(dev, &slot, Reason::Mem, Some(wake)));
        }
        // The DMB the client keeps a mapping of, if we still pool it: the
        // client then needs no descriptor. Only on a private device, as
        // below.
        let private = matches!(dev.shape(), Shape::Private { .. });
        let hint = slot.server_dmb_hint().filter(|_| private);
        let prefer = crate::dmb::pool::Prefer {
            memfd: hint,
            last_peer: None,
        };
        let dmb = match dev.register_dmb_preferring(self.cfg.rmem, Role::Server, prefer) {
            Ok(d) => d,
            Err(e) => {
                debug!("registering a {} byte DMB failed: {e}", self.cfg.rmem);
                return Err(decline(dev, &slot, Reason::Mem, Some(wake)));
            }
        };
        // The client's DMB from a mapping we keep of it, if we do: it then
        // passes no descriptor, which it learns before it accepts our
        // connection. Only on a private device, where every process that
        // can map a DMB runs as one uid: a mapping is kept per memfd, not
        // per peer.
        let cached = match slot.client_dmb().filter(|_| private) {
            Some(id) => dev.attach_cached_dmb(id, proposal.token, slot.client()),
            None => None,
        };
        if cached.is_some() {
            slot.note(Progress::ServerHasClientDmb);
        }
        // A dead client's socket refuses the connection (PEER_DEAD).
        let chan = match client.connect_within(bound, &dev.shape(), dev.gid(), proposal.token) {
            // The connection's channel if the handshake succeeds: out of
            // the application's range of numbers (crate::fdnum), unless
            // the caller puts it elsewhere as soon as we decide, which is
            // now when we have the client's DMB already.
            Ok(c) if self.cfg.channel_placed_by_caller && cached.is_some() => c,
            Ok(c) => crate::fdnum::move_high(c),
            Err(e) => {
                debug!("cannot reach the client's rendezvous socket {client}: {e}");
                return Err(decline(dev, &slot, e.reason(), None));
            }
        };
        slot.note(Progress::ServerConnected);
        let reused = hint.is_some_and(|h| dmb.id() == h);
        let a = Box::new(Answering {
            slot,
            proposal,
            dmb,
            chan,
            reused,
            peer: None,
        });
        Ok(match cached {
            Some(peer) => Connected::Cached(a, peer),
            None => Connected::Waiting(a),
        })
    }

    /// One look at the channel for the client's DMB, passed as soon as the
    /// client has accepted our connection; checked before we accept.
    fn look_dmb(&mut self, mut a: Box<Answering>) -> Option<Decision> {
        if let Some(why) = self.refused {
            // Our channel's end closes with `a`: the client wakes.
            return Some(Decision::Tcp(decline(&self.dev, &a.slot, why, None)));
        }
        if let Some((peer, since)) = a.peer.take() {
            return self.try_finish(a, peer, since);
        }
        let failed =
            |a: &Answering, r: Reason| Some(Decision::Tcp(decline(&self.dev, &a.slot, r, None)));
        let fd = match recv_expected(a.chan.as_raw_fd(), CLIENT_DMB_BYTE) {
            Ok(Received::Msg(fd)) => fd,
            Ok(Received::Pending) => {
                // A withdrawn client may never take our connection off its
                // listener, so the channel would not tell. A running client
                // answers within the spin budget: no liveness check then.
                let spun = self.since.elapsed() >= crate::wait::spin_budget();
                if a.slot.state() != SlotState::Proposed
                    || (spun && !a.slot.client().is_alive_fast())
                {
                    return failed(&a, client_silent(&a.slot, false));
                }
                self.stage = Stage::Answering(a);
                return None;
            }
            Ok(Received::Closed) => return failed(&a, client_silent(&a.slot, true)),
            Err(e) => {
                debug!("receiving the client's DMB failed: {e}");
                return failed(&a, e.reason());
            }
        };
        let Some(fd) = fd else {
            debug!(
                "the client passed no DMB for token {:016x}",
                a.client_token()
            );
            return failed(&a, Reason::ErrRtok);
        };
        match self.dev.attach_dmb(a.client_token(), fd) {
            Ok(peer) => self.try_finish(a, peer, Instant::now()),
            Err(e) => failed(&a, attach_error(e).reason()),
        }
    }

    /// [`finish`](Self::finish), unless the early bytes the client has
    /// counted so far are not all in our socket yet and our caller does
    /// not wait (an event loop's step): then the handshake stays where it
    /// is for up to [`early::ARRIVAL_WAIT`] from `since`, and the bytes'
    /// arrival (which makes the socket readable for the program's wait)
    /// brings the next look. A client that counts and then is descheduled
    /// before it sends would otherwise find the count sealed by a server
    /// that cannot wait, and fall back (SYNCERR); one that never sends
    /// still does, that much later.
    fn try_finish(&mut self, mut a: Box<Answering>, peer: Dmb, since: Instant) -> Option<Decision> {
        let missing = || !early::counted_arrived(self.conn_fd, a.slot.early_counted());
        if !self.may_wait && since.elapsed() < early::ARRIVAL_WAIT && missing() {
            a.peer = Some((peer, since));
            self.stage = Stage::Answering(a);
            return None;
        }
        Some(self.finish(*a, peer))
    }

    /// Accepts the proposal, the client's DMB `peer` checked and attached.
    fn finish(&self, a: Answering, peer: Dmb) -> Decision {
        let peer_token = a.client_token();
        let Answering {
            slot,
            dmb,
            chan,
            reused,
            ..
        } = a;
        if reused {
            slot.note(Progress::ClientHasServerDmb);
        }
        let accept = Accept {
            gid: self.dev.gid(),
            token: dmb.token(),
            dmbe_size_comp: clc::size_comp(dmb.dmb().ring_len()),
            linkid: random_u64() as u32,
            chid: LOOPBACK_CHID,
        };
        // The client's early bytes must all be in our socket before we
        // accept: they are copied into our ring now, while the client
        // cannot write there, and leave the stream once our message is
        // out (below). A client stopped between counting and sending them
        // gets a Decline, and its stream carries them as TCP.
        let fd = self.conn_fd;
        let gid = self.dev.gid();
        // The client may attach our DMB only after we closed (it follows
        // the Accept at its next call): it must still hold this token then.
        if slot.noted(Progress::ClientClaimsReserved) {
            dmb.dmb().reserve_for_peer();
        }
        // TCP before the client could attach our DMB: no reservation left.
        let tcp = |r| {
            dmb.dmb().unreserve();
            Decision::Tcp(r)
        };
        let early = slot.accept_early(&ClcMsg::Accept(accept).to_bytes(), |n| {
            if n == 0
                || (n < dmb.dmb().ring_len()
                    && early::copy_arrived(fd, dmb.dmb(), n, early::arrival_wait(self.may_wait)))
            {
                return Ok(());
            }
            debug!("the client's {n} early bytes are not in the TCP stream");
            Err(ClcMsg::Decline(Decline::new(gid, Reason::SyncErr)).to_bytes())
        });
        let early = match early {
            Ok(Some(n)) => n,
            Ok(None) => return tcp(Reason::SyncErr),
            Err(st) => {
                // The client gave up first (timeout): its decision is TCP.
                debug!("client withdrew before our Accept (slot {st:?})");
                return tcp(Reason::Timeout);
            }
        };
        // ACCEPTED decides: SMC-D for both ends. The client follows once it
        // has our DMB (or our message that it has it already), which also
        // wakes it; the server does not wait for its Confirm. An end that
        // cannot follow aborts the connection (here: closing the channel
        // tells the client, which then aborts too).
        let dmb_fd = (!reused).then(|| dmb.fd());
        if let Err(e) = send_msg(chan.as_raw_fd(), SERVER_DMB_BYTE, dmb_fd) {
            if client_ended(fd) {
                // Nobody will read the rings, and the stream holds what the
                // client sent (its early bytes too) and its end: TCP's.
                debug!("the client ended before our message ({e}): stays TCP");
                return tcp(Reason::PeerDead);
            }
            debug!("sending our DMB to the client failed ({e}): connection aborted");
            return abort_tcp(fd, Reason::IntErr);
        }
        if early > 0 {
            if let Err(e) = early::consume(fd, early) {
                debug!("dropping the client's {early} early bytes from the stream failed ({e}): connection aborted");
                drop(chan);
                return abort_tcp(fd, Reason::IntErr);
            }
        }
        let mode = mode(&self.dev, self.cfg.wmem);
        match establish(dmb, peer, chan, peer_token, self.ends, mode) {
            Ok(e) => Decision::Smc(e),
            Err(e) => {
                debug!("building the connection failed ({e}): connection aborted");
                abort_tcp(self.conn_fd, Reason::IntErr)
            }
        }
    }

    /// The server's wait ran out: TIMEOUT. A client that has not published
    /// its port may be another connection's proposer, so its slot is left
    /// alone (it falls back after its own wait); one that was answered is
    /// declined.
    fn give_up(&mut self) -> Decision {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Matching(_) => debug!("the client published no source port in time"),
            Stage::Answering(a) => {
                let r = client_silent(&a.slot, false);
                return Decision::Tcp(decline(&self.dev, &a.slot, r, None));
            }
            Stage::Decided(r) => return Decision::Tcp(r),
            Stage::Done => {}
        }
        Decision::Tcp(Reason::Timeout)
    }

    /// `d`, reported: a fallback is counted and logged.
    fn counted(&mut self, d: Decision) -> Decision {
        self.stage = Stage::Done;
        if let Decision::Tcp(r) = &d {
            self.dev.count_fallback(*r, Role::Server);
            debug!("server keeps TCP: {r}");
        }
        d
    }
}

impl Drop for ServerHandshake {
    fn drop(&mut self) {
        if let Stage::Answering(a) = std::mem::replace(&mut self.stage, Stage::Done) {
            // The connection was closed undecided: the client must not
            // wait for us (it falls back; nothing is counted here).
            if self.pid == crate::owner::current_pid() {
                decline(&self.dev, &a.slot, Reason::Timeout, None);
            }
        }
    }
}

/// How the connection to the client's rendezvous socket went.
enum Connected {
    /// The client passes its DMB on the channel.
    Waiting(Box<Answering>),
    /// We attached the client's DMB from our own mapping of it.
    Cached(Box<Answering>, Dmb),
}

/// Why the client passed no DMB: PEER_DEAD when its process is gone (it
/// exited or was killed mid-handshake), TIMEOUT when it withdrew or took
/// too long. `closed`: its end of the channel closed. A live client that
/// gives up moves its slot out of PROPOSED before it closes its end, so a
/// slot still PROPOSED then was left by a dead client, even while its
/// process does not look dead yet (the kernel closes a dying process's
/// descriptors before it reaps it).
fn client_silent(slot: &SlotRef, closed: bool) -> Reason {
    if (closed && slot.state() == SlotState::Proposed) || !slot.client().is_alive() {
        debug!("the client's process is gone: it died before passing its DMB");
        Reason::PeerDead
    } else if closed {
        debug!("the client withdrew its proposal before passing its DMB");
        Reason::Timeout
    } else {
        debug!("the client passed no DMB in time");
        Reason::Timeout
    }
}

/// Whether the client's end of TCP connection `fd` has closed (its process
/// ended, or was killed, before it could follow our Accept): then nobody
/// will read the rings, and the stream is what it sent.
fn client_ended(fd: RawFd) -> bool {
    crate::doorbell::poll_fd(fd, libc::POLLRDHUP, 0)
        .is_ok_and(|r| r & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
}

fn ueid_match(p: &Proposal, cfg: &Settings) -> bool {
    match &cfg.ueid {
        None => p.ueids.is_empty(),
        Some(u) => p.ueids.iter().any(|x| x == u),
    }
}

/// The mark a Proposal says its client's SYN carries.
fn mark_of(p: &Proposal) -> Mark {
    Mark {
        ttl: p.mark_ttl,
        dscp: p.mark_tos >> 2,
    }
}

/// Whether the client of `slot` published a TSval window that `tsval` fits.
fn ts_fits(slot: &SlotRef, tsval: u32) -> bool {
    slot.client_ts().is_some_and(|w| w.fits(tsval))
}

/// The mark of the Proposal in `slot`, if it holds a readable one.
fn proposal_mark(slot: &SlotRef) -> Option<Mark> {
    let bytes = slot.proposal()?;
    match ClcMsg::parse(&bytes) {
        Ok(ClcMsg::Proposal(p)) => Some(mark_of(&p)),
        _ => None,
    }
}

/// [`decline`] of proposal `p` in `slot`, waking its client at the
/// rendezvous socket `p` names.
fn decline_waking(dev: &Device, slot: &SlotRef, r: Reason, p: &Proposal) -> Reason {
    let client = RendezvousAddr::new(dev, p.nonce);
    decline(dev, slot, r, Some((&client, p.token)))
}

/// Declines the proposal in `slot` with reason `r` and wakes the client (by
/// connecting to its rendezvous socket, named for the proposal's token) so
/// it does not wait for the timeout.
fn decline(
    dev: &Device,
    slot: &SlotRef,
    r: Reason,
    wake: Option<(&RendezvousAddr, u64)>,
) -> Reason {
    if slot
        .answer(
            &ClcMsg::Decline(Decline::new(dev.gid(), r)).to_bytes(),
            false,
        )
        .is_ok()
    {
        if let Some((client, token)) = wake {
            let _ = client.connect_within(CONNECT_BOUND, &dev.shape(), dev.gid(), token);
        }
    }
    r
}
