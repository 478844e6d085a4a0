//! The client's state machine: propose before `connect`, then wait for the
//! server's answer and confirm it.

use super::channel::{
    recv_expected, send_msg, wait_take, Received, CLIENT_DMB_BYTE, SERVER_DMB_BYTE,
};
use super::listener::RendezvousListener;
use super::pending::TcpNews;
use super::{
    abort_tcp, attach_error, establish, expect_clc, key_for, mode, peer_decline, random_u64,
    Decision, Established, HandshakeError, Settings, Wake, LOOPBACK_CHID,
};
use crate::config::Config;
use crate::debug;
use crate::device::{self as device, Device, Role};
use crate::owner::{self, Owner};
use crate::registry;
use crate::rendezvous::{
    OwnedSlot, Progress, Rendezvous, SlotKey, SlotRef, SlotState, REPLY_GRACE,
};
use crate::tcp_syn::{self, SavedMark};
use smclo_wire::clc::{self, ClcMsg, Confirm, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::{Mark, TsWindow};
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting program looks at a slot that only shared memory
/// tells about (the channel closed or the server's DMB came before the
/// slot moved).
const SLOT_LOOK: Duration = Duration::from_millis(1);

/// How long a wait for the server's answer goes before it also looks at
/// the TCP socket: a server that went on over TCP without declining (one
/// that never saw our proposal: a plain server at an address an smclo
/// listener also has, a mark changed beyond recognition) may speak first,
/// and its first byte, its end of stream or its reset decides TCP at once
/// instead of `SMCLO_CLC_WAIT_MS` later. Each later look comes twice as
/// long after the one before, up to [`TCP_LOOK_MAX`]: a handshake that
/// waits long (a stopped server) wakes its thread a handful of times.
const TCP_LOOK: Duration = Duration::from_millis(5);

/// The longest time between two looks at the TCP socket.
const TCP_LOOK_MAX: Duration = Duration::from_millis(200);

/// A client's published proposal, between the moment it is written into the
/// device and the moment the server answers.
pub struct ClientProposal {
    /// The listener the server connects to, expecting a connection for
    /// `token` until the proposal is withdrawn (see [`Self::withdraw`]).
    rendezvous: Option<Arc<RendezvousListener>>,
    slot: Option<OwnedSlot>,
    /// Boxed, as `server_dmb`: a proposal is moved several times on its
    /// way to the program's descriptor, and an announcement has neither.
    dmb: Option<Box<device::DmbHandle>>,
    /// What names the proposal to its server (whose channel is named for
    /// it): the token of the DMB named in the Proposal, or an
    /// announcement's random id (its DMB is registered only when a server
    /// answers, [`Self::pass_dmb`]).
    token: u64,
    dev: Arc<Device>,
    cfg: Settings,
    saved_mark: Option<SavedMark>,
    /// The caller's socket, and the source address of the slot key (whose
    /// port position holds the mark, see [`key_for`]).
    fd: RawFd,
    src_ip: std::net::IpAddr,
    /// The socket's address once `connect` chose it, and the destination.
    src: Option<SocketAddr>,
    dest: SocketAddr,
    port_published: bool,
    wait: Wait,
    /// The mapping of a DMB of the server's named in the slot
    /// ([`SlotRef::set_server_dmb_hint`]), kept out of the pool until the
    /// server says whether it reused that DMB.
    server_dmb: Option<Box<KeptPeer>>,
    /// Early bytes counted in the slot ([`Self::add_early`]).
    early: u32,
    /// See [`Self::answer_expected_unaided`].
    unaided: bool,
    /// An unmarked announcement ([`Self::announced`]).
    announced: bool,
    /// The registered listener's process proposed to (none for an
    /// announcement): a wait ends when it no longer lists the destination
    /// ([`Self::listener_gone`]).
    listener: Option<Owner>,
    /// The DMB is still to be registered, when a server answers (an
    /// announcement's: most are never answered).
    dmb_on_answer: bool,
    /// When the proposal was made, just before `connect`: the SYN left
    /// after it (its TSval window, [`TsWindow::after`]).
    started: Instant,
}

/// An idle mapping of a peer's DMB taken from the pool; back to the pool
/// when dropped unused.
struct KeptPeer {
    id: (u64, u64),
    dmb: Option<crate::dmb::Dmb>,
}

impl KeptPeer {
    /// The peer's DMB, attached if it holds `token` of device `gid` now.
    fn attach(mut self, token: u64, gid: u64) -> Option<crate::dmb::Dmb> {
        crate::dmb::Dmb::attach_kept(self.dmb.take()?, self.id, token, gid)
    }
}

impl Drop for KeptPeer {
    fn drop(&mut self) {
        if let Some(d) = self.dmb.take() {
            crate::dmb::pool::put_peer(self.id, d);
        }
    }
}

/// How far the wait for the server's answer got, kept across polls of its
/// [`Pending`](super::Pending), so that a non-blocking `connect` can
/// return before the server answers and come back.
#[derive(Default)]
struct Wait {
    /// The UNIX channel, once the server has connected.
    chan: Option<UnixStream>,
    /// The server's message on it (its DMB descriptor), once received:
    /// `Some(None)` when the channel closed or the message carried no
    /// descriptor.
    server_dmb: Option<Option<File>>,
    /// The give-up failed: the server decided first, and we follow it.
    following: bool,
    /// Why we declined ourselves after the server connected (no DMB to
    /// pass it): the fallback's reason when the slot says DECLINED.
    declined: Option<Reason>,
    /// Why the last connection to our rendezvous socket was refused: a
    /// timeout after it is reported with that reason. Refusing does not
    /// end the wait: anyone in the namespace can connect to an abstract
    /// socket, and must not be able to make us fall back.
    refused: Option<Reason>,
    /// When the client gives up; `None` until the wait starts.
    deadline: Option<Instant>,
    /// When the TCP socket is looked at next ([`TCP_LOOK`]), and the time
    /// since the look before; `None` until the wait starts.
    tcp_look: Option<(Instant, Duration)>,
    /// What the caller of this look knows of the TCP socket.
    news: TcpNews,
}

fn local_addr(fd: RawFd) -> io::Result<SocketAddr> {
    crate::sockaddr::local(fd)
}

/// Client, before `connect`: decides whether to try SMC-D at all, and if so
/// binds the socket's source port, publishes the Proposal and marks the SYN.
///
/// `Err(reason)` means "plain TCP, nothing was changed on the socket" (except
/// an implicit bind, which `connect` would have done anyway).
pub fn client_propose(
    dev: &Arc<Device>,
    cfg: &Config,
    fd: RawFd,
    dest: SocketAddr,
) -> Result<ClientProposal, Reason> {
    client_propose_with(dev, cfg, fd, dest, SocketFacts::default())
}

/// What the caller knows of the socket it proposes for, which spares the
/// system calls that would ask.
#[derive(Clone, Copy, Debug, Default)]
pub struct SocketFacts {
    /// Not bound: the source address is the one routing picks.
    pub unbound: bool,
    /// IP TTL and TOS (hop limit and traffic class) never set: they are
    /// put back to the defaults after the SYN without being read first.
    pub default_ip_options: bool,
    /// The caller can carry an announcement ([`ClientProposal::announced`]):
    /// it goes on over TCP with the handshake pending, drives it from the
    /// program's calls and never waits for it, so a destination without a
    /// registered listener may be announced. A caller that waits for the
    /// decision (the native API's `connect`) leaves it false: it would
    /// wait on every plain server.
    pub announce: bool,
}

impl SocketFacts {
    /// A socket made just now for this connection.
    pub fn new_socket() -> SocketFacts {
        SocketFacts {
            unbound: true,
            default_ip_options: true,
            announce: false,
        }
    }
}

/// [`client_propose`] for a socket of which `facts` are known. `dest` is
/// the address as `connect` is given it.
pub fn client_propose_with(
    dev: &Arc<Device>,
    cfg: &Config,
    fd: RawFd,
    dest: SocketAddr,
    facts: SocketFacts,
) -> Result<ClientProposal, Reason> {
    let given = dest;
    let dest = tcp_syn::canonical(dest);
    if !dev.active() {
        if dev.lost() {
            crate::debug!(
                "the device file in {} was truncated under this process: its connections stay TCP",
                dev.dir().display()
            );
        }
        return Err(Reason::NoSmcdDev);
    }
    let Some(listener) = registry::find_listener(dev, dest) else {
        // A loopback destination is this namespace's own: translated only
        // by a rule of its own OUTPUT chain, rare enough that a plain local
        // server's connections are spared the announcement.
        // The operator may limit announcements to some networks
        // (SMCLO_ANNOUNCE).
        if !facts.announce
            || dest.ip().is_loopback()
            || !cfg.announce.covers(dest.ip())
            || !registry::any_port_listens(dev)
        {
            return Err(Reason::PeerNoSmc);
        }
        return announce(dev, cfg, fd, dest, facts);
    };
    // After the lookup: a connection to a plain server costs no system call.
    dev.check_caller()?;
    if listener.is_self() {
        // The accept that would answer may run on this very thread; waiting
        // for it could deadlock, so decline up front.
        return Err(Reason::SelfConnect);
    }
    if !crate::fdnum::room_for_conn(super::relieve_descriptors) {
        return Err(Reason::Mem);
    }
    let src_ip = source_ip(fd, dest, facts)?;
    // Preferably the DMB our last connection with the listener's process
    // used: that process likely keeps a mapping of it, and then needs
    // nothing from us to answer.
    let prefer = crate::dmb::pool::Prefer {
        memfd: None,
        last_peer: Some(listener.owner.pid),
    };
    let mark = Mark::from_random(random_u64() as u32);
    let dmb = register(dev, cfg.rmem, prefer)?;
    let (mut p, slot) = publish(
        dev,
        cfg,
        fd,
        (src_ip, dest),
        mark,
        Some(dmb),
        listener.same_netns(),
    )?;
    // A server that keeps a mapping of this DMB (it reused it from our pool)
    // needs no descriptor.
    if let Some(d) = &p.dmb {
        slot.set_client_dmb(d.id());
    }
    // And the other way round: a DMB of the listener's that we keep a
    // mapping of, which its server reuses if it still pools it. Private
    // devices only, as the server's side.
    if matches!(dev.shape(), crate::access::Shape::Private { .. }) {
        if let Some((id, d)) = crate::dmb::pool::take_peer_of(listener.owner.pid) {
            slot.set_server_dmb_hint(id);
            p.server_dmb = Some(Box::new(KeptPeer { id, dmb: Some(d) }));
            p.unaided = p
                .dmb
                .as_ref()
                .is_some_and(|d| d.dmb().last_peer() == listener.owner.pid);
        }
    }
    p.slot = Some(slot);
    p.listener = Some(listener.owner);
    p.saved_mark = Some(
        tcp_syn::apply_mark(fd, &given, mark, facts.default_ip_options).map_err(|e| {
            debug!("cannot mark the SYN: {e}");
            Reason::IntErr
        })?,
    );
    debug!(
        "proposed {src_ip} -> {dest} (mark ttl {} dscp {})",
        mark.ttl, mark.dscp
    );
    Ok(p)
}

/// The client's source address for `dest`, which the key needs before the
/// SYN: the bound one, or the one routing will choose. The port stays the
/// kernel's choice at `connect` (see `key_for`).
fn source_ip(fd: RawFd, dest: SocketAddr, facts: SocketFacts) -> Result<std::net::IpAddr, Reason> {
    let bound = if facts.unbound {
        None
    } else {
        local_addr(fd).ok()
    };
    Ok(match bound {
        Some(a) if !a.ip().is_unspecified() => tcp_syn::canonical(a).ip(),
        _ => tcp_syn::canonical(SocketAddr::new(
            tcp_syn::route_source_cached(dest).map_err(|_| Reason::IntErr)?,
            0,
        ))
        .ip(),
    })
}

/// Our DMB for a connection, from the pool preferably as `prefer` says.
fn register(
    dev: &Device,
    rmem: u32,
    prefer: crate::dmb::pool::Prefer,
) -> Result<Box<device::DmbHandle>, Reason> {
    match dev.register_dmb_preferring(rmem, Role::Client, prefer) {
        Ok(d) => Ok(Box::new(d)),
        Err(e) => {
            debug!("registering a {rmem} byte DMB failed: {e}");
            Err(Reason::Mem)
        }
    }
}

/// Publishes the Proposal for `(src_ip, dest)` with `mark` (an
/// announcement's is zero) in a slot, naming `dmb`; without one (an
/// announcement) it is named by a random id, and the DMB is registered
/// when a server answers. The rendezvous socket is abstract when the
/// server shares our network namespace (`same_netns`).
fn publish(
    dev: &Arc<Device>,
    cfg: &Config,
    fd: RawFd,
    (src_ip, dest): (std::net::IpAddr, SocketAddr),
    mark: Mark,
    dmb: Option<Box<device::DmbHandle>>,
    same_netns: bool,
) -> Result<(ClientProposal, OwnedSlot), Reason> {
    let me = Owner::current();
    let rendezvous = if mark == Mark::NONE {
        RendezvousListener::for_announcement(dev)
    } else {
        RendezvousListener::for_proposal(dev, same_netns)
    };
    let rendezvous = rendezvous.map_err(|e| {
        debug!("cannot create the rendezvous socket: {e}");
        Reason::IntErr
    })?;
    let token = dmb.as_ref().map_or_else(random_u64, |d| d.token());
    let ring_len = dmb.as_ref().map_or(cfg.rmem, |d| d.dmb().ring_len());
    rendezvous.expect(token);
    let nonce = rendezvous.nonce();
    let proposal = Proposal {
        gid: dev.gid(),
        chid: LOOPBACK_CHID,
        seid: dev.seid(),
        ueids: cfg.ueid.into_iter().collect(),
        mark_ttl: mark.ttl,
        mark_tos: mark.tos(),
        token,
        dmbe_size_comp: clc::size_comp(ring_len),
        nonce,
        pid: me.pid,
        start_time: me.start,
        netns: owner::netns_inode(),
    };
    let p = ClientProposal {
        rendezvous: Some(rendezvous),
        slot: None,
        dmb_on_answer: dmb.is_none(),
        dmb,
        token,
        dev: dev.clone(),
        cfg: Settings::of(cfg),
        saved_mark: None,
        fd,
        src_ip,
        src: None,
        dest,
        port_published: false,
        wait: Wait::default(),
        server_dmb: None,
        early: 0,
        unaided: false,
        announced: mark == Mark::NONE,
        listener: None,
        started: Instant::now(),
    };
    let key = if mark == Mark::NONE {
        SlotKey::announcement(src_ip)
    } else {
        key_for(src_ip, mark, dest)
    };
    // Encoded on the stack: the slot takes a copy.
    let mut buf = [0u8; clc::MAX_LEN];
    let len = proposal.encode(&mut buf);
    let slot = Rendezvous::propose(dev, key, &buf[..len]).map_err(|e| {
        debug!("no rendezvous slot for {src_ip} -> {dest}: {e}");
        Reason::MaxDmb
    })?;
    slot.note(Progress::ClientClaimsReserved);
    Ok((p, slot))
}

/// [`client_propose_with`] for a destination without a registered
/// listener while the device has listeners: address translation on this
/// host (DNAT, REDIRECT, IPVS) may take the connection to one of them.
/// The SYN stays unmarked (it may leave the host); the proposal is an
/// announcement ([`SlotKey::announcement`]): in the one window every
/// announcement shares, since the server knows neither the destination we
/// connected to (translated in another network namespace, the node's)
/// nor, through source NAT, our address. Right after `connect` we publish
/// our port and the TSvals our SYN may have carried ([`TsWindow`]): the
/// server's proof, with our address, that the connection it accepted is
/// ours. The connection goes on as TCP
/// meanwhile, never waiting for an answer ([`ClientProposal::announced`]).
fn announce(
    dev: &Arc<Device>,
    cfg: &Config,
    fd: RawFd,
    dest: SocketAddr,
    facts: SocketFacts,
) -> Result<ClientProposal, Reason> {
    // Checks that a proposal makes afresh, trusted a while: a plain
    // server's connection asks the kernel only for the proof.
    dev.check_caller_recent()?;
    if !crate::fdnum::room_for_announcement(super::relieve_descriptors) {
        return Err(Reason::Mem);
    }
    let src_ip = source_ip(fd, dest, facts)?;
    // The server may be in any network namespace: a path socket. No DMB
    // yet: the server that answers gets one ([`ClientProposal::pass_dmb`]).
    let (mut p, slot) = publish(dev, cfg, fd, (src_ip, dest), Mark::NONE, None, false)?;
    p.slot = Some(slot);
    debug!("announced {src_ip} -> {dest} (no listener registered there)");
    Ok(p)
}

impl ClientProposal {
    /// Whether this is an announcement ([`announce`]): the connection is
    /// TCP's until a server answers, and nothing waits for that answer;
    /// the program's I/O goes on over TCP, its first writes as early bytes
    /// ([`Self::add_early`]), and [`Self::retract`] ends it when the
    /// program needs a decision.
    pub fn announced(&self) -> bool {
        self.announced
    }

    /// An announcement the program needs decided now (its write does not
    /// fit the early bytes, it shuts the connection down, or it duplicates
    /// the descriptor): TCP (UNANSWERED) unless a server has begun to
    /// answer (it connected to our listener), whose decision is then
    /// waited for.
    /// `None` when that is the case, or this is no announcement.
    pub(super) fn retract(&mut self) -> Option<Decision> {
        if !self.announced {
            return None;
        }
        let slot = self.slot.as_ref()?;
        // A server that connected to our listener is answering: its
        // decision is near, and is waited for.
        if slot.noted(Progress::ServerConnected) {
            return None;
        }
        slot.cas(SlotState::Proposed, SlotState::Declined).ok()?;
        let drain = slot.noted(Progress::ServerConnected);
        self.restore_mark();
        self.wait.chan = None;
        self.withdraw(drain);
        self.dev.count_fallback(Reason::Unanswered, Role::Client);
        debug!("client retracts its announcement: stays TCP");
        Some(Decision::Tcp(Reason::Unanswered))
    }

    /// What names the proposal: the token of the DMB offered in the
    /// Proposal, or an announcement's id.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Publishes the source port the kernel chose in the rendezvous slot
    /// (the server matches it against the SYN); call right after `connect`
    /// returned (0 or `EINPROGRESS`): the SYN has left by then. The socket
    /// options stay marked until the handshake decides: TCP puts them back
    /// before the stream carries data, SMC-D leaves them
    /// ([`tcp_syn::LeftMark`]).
    pub fn syn_sent(&mut self) {
        self.publish_port();
    }

    /// Whether the server is likely to answer without this client's help
    /// (on a private device): we named a DMB of the listener's process
    /// that we keep a mapping of, and ours is the one our last connection
    /// with that process used, which it likely keeps a mapping of in turn
    /// (its cache of peers' DMBs). A blocking `connect` may then return
    /// before the answer, so that the program's first request goes out as
    /// early bytes ([`Self::add_early`]); otherwise (a first contact) the
    /// server waits for our DMB, and `connect` finishes the handshake.
    pub fn answer_expected_unaided(&self) -> bool {
        self.unaided
    }

    /// Counts `n` bytes that the caller then writes into the TCP stream,
    /// before the server answered (a blocking client's first request; see
    /// [`SlotRef::add_early`]): `false` when they must wait for the
    /// decision instead (the server took the count, or too many).
    pub fn add_early(&mut self, n: usize) -> bool {
        let counted = self.port_published && self.slot.as_ref().is_some_and(|s| s.add_early(n));
        if counted {
            self.early += n as u32;
            // The SYN's TTL and TOS told the server which proposal it
            // answers; the stream's data carries the program's own.
            self.restore_mark();
        }
        counted
    }

    /// The program closed the socket with the handshake pending: its number
    /// may name another descriptor by now, so nothing here touches it any
    /// more (the mark needs no putting back on a closed socket).
    pub fn socket_closed(&mut self) {
        self.saved_mark = None;
        self.fd = -1;
    }

    /// Dropped with the server's SMC-D answer standing (the program closed
    /// the socket before it looked): ends that connection as the program's
    /// close of it would have, so that the server's application reads end
    /// of file, as after a TCP client's close, not a reset.
    fn end_accepted(&mut self) {
        self.wait.following = true;
        self.wait.deadline = Some(Instant::now() + REPLY_GRACE);
        self.wait.news = TcpNews::Ask;
        if let Some(Decision::Smc(e)) = self.run(None) {
            self.dev.count_conn_opened();
            if let Err(err) = e.conn.close() {
                debug!("closing the connection the server accepted failed: {err}");
            }
        }
    }

    /// Puts the socket options back now, if they are still marked.
    fn restore_mark(&mut self) {
        if let Some(s) = self.saved_mark.take() {
            if let Err(e) = tcp_syn::restore_mark(self.fd, s) {
                debug!("restoring TTL/TOS after the SYN failed: {e}");
            }
        }
    }

    fn publish_port(&mut self) {
        if self.port_published {
            return;
        }
        self.port_published = true;
        let Some(slot) = &self.slot else { return };
        match local_addr(self.fd).map(tcp_syn::canonical) {
            Ok(a) if a.port() != 0 && a.ip() == self.src_ip => {
                self.src = Some(a);
                if self.announced {
                    // The proof comes before the port, which the server
                    // reads first.
                    match tcp_syn::timestamp_clock(self.fd) {
                        Ok(now) => {
                            let took = self.started.elapsed().as_millis();
                            let took = u32::try_from(took).unwrap_or(u32::MAX);
                            slot.set_client_ts(TsWindow::after(now, took));
                        }
                        Err(e) => {
                            debug!("no TCP timestamp clock ({e}); withdrawing");
                            let _ = slot.give_up();
                            return;
                        }
                    }
                }
                slot.set_client_port(a.port())
            }
            Ok(a) if a.port() != 0 => {
                // Routing chose another source than the key names: no
                // server can match it. Withdraw; the server keeps TCP.
                debug!(
                    "source {a} differs from the proposed {}; withdrawing",
                    self.src_ip
                );
                let _ = slot.give_up();
            }
            // connect failed before choosing a port: the caller drops us.
            _ => {}
        }
    }

    /// Advances the handshake without sleeping past `until` (`None`: until
    /// it decides): `Some` once it has decided, `None` while the server has
    /// not answered and `until` has passed. `deadline` is when the client
    /// gives up (TIMEOUT); the first call fixes it. Driven through
    /// [`Pending`](super::Pending).
    pub(super) fn decide_by(
        &mut self,
        deadline: Instant,
        until: Option<Instant>,
        news: TcpNews,
    ) -> Option<Decision> {
        self.syn_sent();
        self.wait.news = news;
        self.wait.deadline.get_or_insert(deadline);
        self.wait
            .tcp_look
            .get_or_insert((Instant::now() + TCP_LOOK, TCP_LOOK));
        let Some(d) = self.run(until) else {
            // Undecided: the program gets control back and may not look
            // again for a while. A channel left where the kernel put it
            // for the caller's swap, and the server's DMB as it was
            // received, move out of its range of numbers now (a program
            // that starts many connections at once would otherwise find
            // its range full of them).
            if self.cfg.channel_placed_by_caller {
                self.wait.chan = self.wait.chan.take().map(crate::fdnum::move_high);
                self.wait.server_dmb = self
                    .wait
                    .server_dmb
                    .take()
                    .map(|f| f.map(crate::fdnum::move_high));
            }
            return None;
        };
        match &d {
            Decision::Tcp(r) => {
                self.restore_mark();
                self.dev.count_fallback(*r, Role::Client);
                debug!("client falls back to TCP: {r}");
            }
            Decision::Smc(_) => self.dev.count_conn_opened(),
        }
        Some(d)
    }

    /// What a program waiting for the server's answer sleeps on: first our
    /// rendezvous socket (the server connects to it before it answers),
    /// then the channel (the server's DMB, or end of file when it
    /// declines); once the channel has said all, the slot decides, which
    /// only a look tells.
    pub(super) fn wake(&self) -> Wake {
        match (&self.wait.chan, &self.rendezvous) {
            // Also back for the next look at the TCP socket.
            // The program's own waits see the TCP socket.
            (None, Some(l)) if self.announced => l.wake_for(self.token),
            (None, Some(l)) => {
                let w = l.wake_for(self.token);
                let look = self.wait.tcp_look.map_or(TCP_LOOK, |(t, _)| {
                    t.saturating_duration_since(Instant::now())
                });
                let within = w.within.map_or(look, |d| d.min(look));
                Wake {
                    within: Some(within),
                    ..w
                }
            }
            (Some(c), _) if self.wait.server_dmb.is_none() => Wake {
                fd: Some(c.as_raw_fd()),
                also: None,
                within: None,
            },
            _ => Wake {
                fd: None,
                also: None,
                within: Some(SLOT_LOOK),
            },
        }
    }

    /// Where the wait for the server stands, for the debug log of a
    /// TIMEOUT.
    fn step(&self) -> &'static str {
        match (&self.wait.chan, &self.rendezvous) {
            (None, Some(l)) if l.filed(self.token) => {
                "the server's connection was filed for us but not taken"
            }
            (None, _) => "no server connection on our rendezvous socket",
            (Some(_), _) if self.wait.server_dmb.is_none() => {
                "our DMB passed, no answer on the channel"
            }
            _ => "the channel said all, the slot did not move",
        }
    }

    /// The descriptor of [`wake`](Self::wake) was reported readable: if it
    /// is our rendezvous socket, takes the connections waiting on it (each
    /// is filed for its proposal). `drives`: the caller looks at this
    /// handshake next; otherwise its waiter is woken when its connection
    /// is filed.
    pub(super) fn woken(&self, drives: bool) {
        if let (None, Some(l)) = (&self.wait.chan, &self.rendezvous) {
            l.collect_now(self.token, !drives);
        }
    }

    /// Stops expecting the server's connection, then frees the slot: a
    /// server waiting for our DMB then sees end of file on its channel, or
    /// (its connection not taken off the listener yet) a slot that is no
    /// longer PROPOSED. `drain` takes such connections off the listener
    /// now; it is not needed once ours was taken.
    fn withdraw(&mut self, drain: bool) {
        if let Some(l) = self.rendezvous.take() {
            l.forget(self.token, drain);
        }
        self.slot = None;
    }

    /// Ends the wait with `r` (TCP): the channel closes before the
    /// proposal is withdrawn.
    fn fall_back(&mut self, r: Reason) -> Option<Decision> {
        self.wait.chan = None;
        // An announcement no server connected for has nothing on the
        // listener to close: a plain server's costs no look at it.
        let drain = !self.announced
            || self
                .slot
                .as_ref()
                .is_none_or(|s| s.noted(Progress::ServerConnected));
        self.withdraw(drain);
        Some(Decision::Tcp(r))
    }

    fn run(&mut self, until: Option<Instant>) -> Option<Decision> {
        let slot: SlotRef = SlotRef::clone(self.slot.as_ref().expect("proposal without slot"));
        loop {
            let deadline = self.wait.deadline.expect("wait started");
            let seen = slot.state();
            match seen {
                // The server sends its DMB right after its CAS to ACCEPTED.
                SlotState::Accepted if self.wait.server_dmb.is_some() => break,
                SlotState::Declined => {
                    let r = self
                        .wait
                        .declined
                        .unwrap_or_else(|| peer_decline(slot.reply()));
                    return self.fall_back(r);
                }
                SlotState::Proposed | SlotState::Replying | SlotState::Accepted => {}
                other => {
                    debug!("rendezvous slot in state {other:?} while waiting for the server");
                    return self.fall_back(Reason::SyncErr);
                }
            }
            let now = Instant::now();
            let look = self.look_due(now);
            let went_tcp = self.server_went_tcp(look);
            let gone = look && !went_tcp && self.listener_gone();
            if now >= deadline || went_tcp || gone {
                match slot.give_up() {
                    Ok(()) if went_tcp => {
                        debug!("the server went on over TCP: {}", self.step());
                        return self.fall_back(self.no_answer(Reason::PeerNoSmc));
                    }
                    Ok(()) if gone => {
                        debug!(
                            "the listener proposed to is no longer registered (closed, or its process runs a program without smclo now): {}",
                            self.step()
                        );
                        return self.fall_back(Reason::PeerNoSmc);
                    }
                    Ok(()) => {
                        debug!("gave up waiting: {}", self.step());
                        let r = self.wait.refused.unwrap_or(self.no_answer(Reason::Timeout));
                        return self.fall_back(r);
                    }
                    // The server decided first: follow it. Its DMB follows
                    // its CAS to ACCEPTED at once, so it gets a grace, then
                    // counts as not sent.
                    Err(_) if !self.wait.following => {
                        self.wait.following = true;
                        self.wait.deadline = Some(now + REPLY_GRACE);
                        continue;
                    }
                    Err(SlotState::Accepted) => {
                        self.wait.server_dmb.get_or_insert(None);
                        break;
                    }
                    Err(_) => continue,
                }
            }
            let stop = until.map_or(deadline, |u| u.min(deadline));
            let stop = self
                .wait
                .tcp_look
                .map_or(stop, |(t, _)| stop.min(t.max(now)));
            let moved = self.wait_step(seen, stop.saturating_duration_since(now), &slot);
            if !moved && until.is_some_and(|u| u < deadline && Instant::now() >= u) {
                return None;
            }
        }
        let chan = self
            .wait
            .chan
            .take()
            .expect("a server message implies a channel");
        let server_dmb = self.wait.server_dmb.take().flatten();
        match self.confirm(&slot, chan, server_dmb) {
            Ok(e) => Some(Decision::Smc(e)),
            Err(r) => {
                // ACCEPTED decided SMC-D and the server is committed to it.
                // The channel is closed by now (confirm consumed it), so the
                // server's connection reports a reset; ours must not carry
                // the stream over TCP instead.
                debug!("cannot follow the server's Accept ({r}): connection aborted");
                self.withdraw(true);
                Some(abort_tcp(self.fd, r))
            }
        }
    }

    /// Why the client ends its wait with no answer: `r`, or UNANSWERED
    /// for an announcement no server connected for (a plain server, or
    /// one that sees another source).
    fn no_answer(&self, r: Reason) -> Reason {
        if self.announced && self.wait.chan.is_none() {
            Reason::Unanswered
        } else {
            r
        }
    }

    /// Whether a look at the TCP socket and the registry is due
    /// ([`TCP_LOOK`]; never before the first, so a server that answers at
    /// once costs no system call), and if so, when the next one is.
    fn look_due(&mut self, now: Instant) -> bool {
        match self.wait.tcp_look {
            // An announcement goes on as TCP: every look asks.
            _ if self.announced => true,
            Some((t, every)) if now >= t => {
                let every = (every * 2).min(TCP_LOOK_MAX);
                self.wait.tcp_look = Some((now + every, every));
                true
            }
            _ => false,
        }
    }

    /// Whether the listener proposed to is no longer registered for our
    /// destination: its process closed it, or ran a program that does not
    /// load smclo (a static or Go program after a supervisor's exec),
    /// which will never answer. The connection goes on as TCP now rather
    /// than after `SMCLO_CLC_WAIT_MS`; a server whose new image registers
    /// the listener again before this look still answers.
    fn listener_gone(&self) -> bool {
        self.listener.is_some_and(|o| {
            registry::find_listener(&self.dev, self.dest).is_none_or(|l| l.owner != o)
        })
    }

    /// Whether the server has gone on over TCP, asked of the TCP socket
    /// when a look is `due` ([`Self::look_due`]): bytes to read,
    /// the end of the stream or an error (a reset) all say that it decided
    /// TCP, since a server that takes the connection to shared memory
    /// never writes into its TCP stream. The bytes stay for the program.
    fn server_went_tcp(&mut self, due: bool) -> bool {
        match self.wait.news {
            TcpNews::Ask => {}
            TcpNews::Nothing => return false,
            TcpNews::Spoke => return true,
        }
        if !due {
            return false;
        }
        if self.fd < 0 {
            return false; // the program closed it (socket_closed)
        }
        let mut b = [0u8; 1];
        // SAFETY: a one-byte buffer we own; MSG_PEEK leaves the stream as
        // it is.
        let n = unsafe {
            libc::recv(
                self.fd,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        // The connection's own errors say the server ended it; any other
        // (a descriptor gone from under us) says nothing.
        n >= 0
            || matches!(
                io::Error::last_os_error().raw_os_error(),
                Some(libc::ECONNRESET | libc::ECONNREFUSED | libc::EPIPE | libc::ETIMEDOUT)
            )
    }

    /// One wait of at most `left` for the server's next step: first until
    /// it connects to our rendezvous socket (it does so before it answers,
    /// also to wake us when it declines), then until its message or end of
    /// file on the channel, then for the slot to leave `seen`. Whether
    /// anything moved.
    fn wait_step(&mut self, seen: SlotState, left: Duration, slot: &SlotRef) -> bool {
        match &self.wait.chan {
            None => {
                let listener = self.rendezvous.as_ref().expect("rendezvous socket");
                let connected = || slot.noted(Progress::ServerConnected);
                match listener.take(self.token, left, connected) {
                    Some(Ok(c)) => self.wait.chan = Some(self.pass_dmb(slot, c)),
                    Some(Err(r)) => self.wait.refused = Some(r),
                    None => return false,
                }
                true
            }
            Some(c) if self.wait.server_dmb.is_none() => {
                // The server sends its DMB right after its CAS to
                // ACCEPTED, and closes the channel when it declines.
                let decided = || matches!(slot.state(), SlotState::Accepted | SlotState::Declined);
                // Whatever the channel says but the server's DMB leaves
                // us without one: the slot then decides, or confirm
                // fails with ERR_RTOK and the connection is aborted.
                let take = || match recv_expected(c.as_raw_fd(), SERVER_DMB_BYTE) {
                    Ok(Received::Msg(fd)) => Some(fd),
                    Ok(Received::Pending) => None,
                    Ok(Received::Closed) => Some(None),
                    Err(e) => {
                        debug!("receiving the server's DMB failed: {e}");
                        Some(None)
                    }
                };
                self.wait.server_dmb = wait_take(c.as_raw_fd(), left, decided, take);
                self.wait.server_dmb.is_some()
            }
            // The channel has said all it will; the slot decides.
            Some(_) => slot.wait_while(seen, Instant::now() + left) != seen,
        }
    }

    /// Passes our DMB on the server's connection `c` unless the server
    /// noted that it has it: the server checks it before it accepts. An
    /// announcement registers its DMB now and names it in the slot first.
    /// A failed send shows on the server's side (end of file, or no
    /// descriptor).
    fn pass_dmb(&mut self, slot: &SlotRef, c: UnixStream) -> UnixStream {
        // The connection's channel if the handshake succeeds: out of the
        // application's range of numbers (crate::fdnum), unless the caller
        // puts it elsewhere at once.
        let c = if self.cfg.channel_placed_by_caller {
            c
        } else {
            crate::fdnum::move_high(c)
        };
        if slot.noted(Progress::ServerHasClientDmb) {
            // It attached our DMB from its own mapping: nothing to pass.
            return c;
        }
        if self.dmb_on_answer {
            self.register_on_answer(slot);
        }
        let fd = self.dmb.as_ref().map(|d| d.fd());
        match send_msg(c.as_raw_fd(), CLIENT_DMB_BYTE, fd) {
            Ok(()) => slot.note(Progress::ClientDmbSent),
            Err(e) => debug!("sending our DMB to the server failed: {e}"),
        }
        c
    }

    /// An announcement's DMB, registered now that a server answers, its
    /// token named in the slot. Without one we decline (MEM) rather than
    /// let the server wait for it.
    fn register_on_answer(&mut self, slot: &SlotRef) {
        self.dmb_on_answer = false;
        let prefer = crate::dmb::pool::Prefer {
            memfd: None,
            last_peer: None,
        };
        match register(&self.dev, self.cfg.rmem, prefer) {
            Ok(d) => {
                slot.set_client_token(d.token());
                self.dmb = Some(d);
            }
            Err(r) => {
                if slot.give_up().is_ok() {
                    self.wait.declined = Some(r);
                }
            }
        }
    }

    /// Waits (at most `timeout`) for the server's connection, passes our
    /// DMB on it and returns the channel without reading the server's
    /// answer: a client stopped right after passing its DMB. For exercising
    /// the server's side; a normal client never calls it.
    pub fn pass_dmb_and_stop(&mut self, timeout: Duration) -> Option<UnixStream> {
        let slot = SlotRef::clone(self.slot.as_ref()?);
        let c = self.take_channel_and_stop(timeout)?;
        Some(self.pass_dmb(&slot, c))
    }

    /// Waits (at most `timeout`) for the server's connection and returns
    /// it without passing our DMB: a client stopped right after it took
    /// the server's connection. For exercising the server's side; a normal
    /// client never calls it.
    pub fn take_channel_and_stop(&mut self, timeout: Duration) -> Option<UnixStream> {
        self.rendezvous
            .as_ref()?
            .take(self.token, timeout, || true)?
            .ok()
    }

    fn confirm(
        &mut self,
        slot: &SlotRef,
        chan: UnixStream,
        server_dmb: Option<File>,
    ) -> Result<Established, Reason> {
        let reply = slot.reply().ok_or(Reason::SyncErr)?;
        let accept = expect_clc(&reply, |m| match m {
            ClcMsg::Accept(a) => Some(a),
            _ => None,
        })
        .map_err(|m| HandshakeError::from(m).reason())?;
        if accept.gid != self.dev.gid() || accept.chid != LOOPBACK_CHID {
            return Err(Reason::NoSmcd2Dev);
        }
        let kept = self.server_dmb.take();
        let peer = match server_dmb {
            Some(fd) => self
                .dev
                .attach_dmb(accept.token, fd)
                .map_err(|e| attach_error(e).reason())?,
            // It reused the DMB we keep a mapping of.
            None if slot.noted(Progress::ClientHasServerDmb) => kept
                .and_then(|k| k.attach(accept.token, self.dev.gid()))
                .ok_or_else(|| {
                    debug!(
                        "the server's reused DMB does not hold token {:016x}",
                        accept.token
                    );
                    Reason::ErrRtok
                })?,
            None => {
                debug!(
                    "the server accepted but passed no DMB for token {:016x}",
                    accept.token
                );
                return Err(Reason::ErrRtok);
            }
        };
        let dmb = self.dmb.as_ref().ok_or(Reason::ErrRtok)?;
        let confirm = Confirm {
            gid: self.dev.gid(),
            token: dmb.token(),
            dmbe_size_comp: clc::size_comp(dmb.dmb().ring_len()),
            linkid: accept.linkid,
            chid: LOOPBACK_CHID,
        };
        // Only we move the slot from ACCEPTED: the server does not wait for
        // the Confirm. It is written for the record.
        if let Err(st) = slot.confirm(&ClcMsg::Confirm(confirm).to_bytes(), true) {
            debug!("rendezvous slot in state {st:?} at our Confirm");
            return Err(Reason::SyncErr);
        }
        self.withdraw(false);
        let dmb = *self.dmb.take().expect("client DMB");
        let local = self.src.unwrap_or(SocketAddr::new(self.src_ip, 0));
        let mode = mode(&self.dev, self.cfg.wmem);
        match establish(dmb, peer, chan, accept.token, (local, self.dest), mode) {
            Ok(mut e) => {
                e.syn_mark = tcp_syn::LeftMark::new(self.saved_mark.take());
                // The server moved them into its ring: sent through it.
                if let Err(err) = e.conn.early_published(self.early) {
                    debug!("ringing for our early bytes failed: {err}");
                    return Err(Reason::IntErr);
                }
                Ok(e)
            }
            Err(e) => {
                debug!("building the connection failed: {e}");
                Err(Reason::IntErr)
            }
        }
    }

    /// Unregisters the DMB offered in the Proposal while the Proposal
    /// stands, as if it had vanished: the client then passes no DMB, and the
    /// server declines with ERR_RTOK (the token names no DMB it was given).
    /// For exercising that path; a normal client never calls it.
    pub fn unregister_dmb(&mut self) {
        self.dmb = None;
    }
}

impl Drop for ClientProposal {
    fn drop(&mut self) {
        self.restore_mark();
        if let Some(slot) = &self.slot {
            // Abandoned before it decided (connect failed, or the program
            // closed the socket): withdraw the proposal, unless the server
            // accepted first.
            if slot.give_up() == Err(SlotState::Accepted) {
                self.end_accepted();
            }
        }
        self.withdraw(true);
    }
}
