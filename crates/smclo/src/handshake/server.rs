//! The server's state machine: from `accept`, find the proposal behind the
//! saved SYN and answer it.

use super::channel::{
    recv_expected, send_msg, spin_readable, wait_readable, Received, RendezvousAddr,
    CLIENT_DMB_BYTE, CONNECT_BOUND, SERVER_DMB_BYTE,
};
use super::{
    abort_tcp, attach_error, establish, expect_clc, key_for, mode, random_u64, Decision,
    HandshakeError, LOOPBACK_CHID,
};
use crate::access::Shape;
use crate::config::Config;
use crate::debug;
use crate::device::{Device, Role};
use crate::dmb::Dmb;
use crate::owner::Owner;
use crate::rendezvous::{Progress, Rendezvous, SlotRef, SlotState};
use crate::tcp_syn;
use smclo_wire::clc::{self, Accept, ClcMsg, Decline, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::Mark;
use std::cell::Cell;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the listening socket blocks, which decides how long `accept` may
/// wait on the client (ARCHITECTURE.md, "Handshake waits").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listening {
    /// `accept` may block: all its waits on the client together last at
    /// most `SMCLO_CLC_WAIT_MS`, sleeping in `poll` after the spin budget.
    Blocking,
    /// An event loop's listener: `accept` never sleeps on the client. It
    /// busy-polls at most `SMCLO_NB_ACCEPT_WAIT_MS` in all (more for a
    /// client that is runnable then), then declines (TIMEOUT) and
    /// returns the TCP connection.
    NonBlocking,
}

/// How long a runnable client past the budget is given before its state is
/// looked at again.
const RUNNABLE_RECHECK: Duration = Duration::from_millis(5);

/// How often the wait for the client's DMB looks whether the client
/// withdrew its proposal or died.
const WITHDRAWN_CHECK: Duration = Duration::from_millis(10);

/// What is left of the time `accept` may spend waiting on the client.
///
/// A non-blocking listener's budget is short, but a client that is runnable
/// when it runs out (it waits for a CPU: it will answer as soon as it is
/// scheduled) is given more, a few milliseconds at a time, up to
/// `SMCLO_CLC_WAIT_MS`; a stopped or sleeping client is not: it is not
/// servicing the handshake.
struct ClientWait {
    deadline: Cell<Instant>,
    limit: Instant,
    sleep: bool,
    client: Cell<Option<Owner>>,
}

impl ClientWait {
    fn new(cfg: &Config, listening: Listening) -> ClientWait {
        let now = Instant::now();
        let (budget, sleep) = match listening {
            Listening::Blocking => (cfg.clc_wait, true),
            Listening::NonBlocking => (cfg.nb_accept_wait, false),
        };
        ClientWait {
            deadline: Cell::new(now + budget),
            limit: now + budget.max(cfg.clc_wait),
            sleep,
            client: Cell::new(None),
        }
    }

    /// The client, once known: its state decides whether it gets more time.
    fn watch(&self, client: Owner) {
        self.client.set(Some(client));
    }

    /// What is left of the budget.
    fn left(&self) -> Duration {
        let now = Instant::now();
        if now >= self.deadline.get()
            && now < self.limit
            && self.client.get().is_some_and(|c| c.has_runnable_thread())
        {
            self.deadline.set((now + RUNNABLE_RECHECK).min(self.limit));
        }
        self.deadline.get().saturating_duration_since(now)
    }

    /// Whether `fd` becomes readable within the budget; `hint` is the
    /// client's note that it sent (see [`wait_readable`]). False as soon as
    /// the client `withdrew`, asked every [`WITHDRAWN_CHECK`]: a withdrawn
    /// client may never take our connection off its listener, so the
    /// channel would not tell.
    fn readable(&self, fd: RawFd, hint: impl Fn() -> bool, withdrew: impl Fn() -> bool) -> bool {
        let mut first = true;
        loop {
            let left = self.left();
            if left.is_zero() || (!first && withdrew()) {
                return false;
            }
            first = false;
            let slice = left.min(WITHDRAWN_CHECK);
            let ready = if self.sleep {
                wait_readable(fd, slice, &hint)
            } else {
                spin_readable(fd, Instant::now() + slice, &hint)
            };
            if ready {
                return true;
            }
        }
    }

    /// One pause between two looks at what the client writes in shared
    /// memory, `since` the wait began; false when the budget is spent. Spins
    /// for the spin budget, then sleeps 50 µs or, never sleeping, yields.
    fn pause(&self, since: Instant) -> bool {
        if self.left().is_zero() {
            return false;
        }
        if since.elapsed() < crate::conn::spin_budget() {
            std::hint::spin_loop();
        } else if self.sleep {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::thread::yield_now();
        }
        true
    }
}

/// Server, in `accept`: answers the proposal (if any) of the client behind
/// the freshly accepted TCP connection `conn_fd`.
pub fn server_accept(
    dev: &Arc<Device>,
    cfg: &Config,
    conn_fd: RawFd,
    listening: Listening,
) -> Decision {
    let wait = ClientWait::new(cfg, listening);
    let d = server_run(dev, cfg, conn_fd, &wait);
    if let Decision::Tcp(r) = &d {
        dev.count_fallback(*r, Role::Server);
        debug!("server keeps TCP: {r}");
    }
    d
}

fn server_run(dev: &Arc<Device>, cfg: &Config, conn_fd: RawFd, wait: &ClientWait) -> Decision {
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
    let key = key_for(tcp_syn::canonical(syn.src).ip(), syn.mark, syn.dst);
    // Proposals for this 4-tuple; more than one only when clients in other
    // network namespaces use the same addresses. The mark picks ours.
    let candidates = Rendezvous::find_for_syn(dev, key, syn.src.port());
    if candidates.is_empty() {
        // The client does not run smclo: plain TCP, not one byte exchanged.
        return Decision::Tcp(Reason::PeerNoSmc);
    }
    let mut mismatched = false;
    for slot in candidates {
        let Some(bytes) = slot.proposal() else {
            continue; // withdrawn meanwhile
        };
        let proposal = match expect_clc(&bytes, |m| match m {
            ClcMsg::Proposal(p) => Some(p),
            _ => None,
        }) {
            Ok(p) => p,
            Err(m) => return decline(dev, &slot, HandshakeError::from(m).reason(), None),
        };
        if syn.mark
            != (Mark {
                ttl: proposal.mark_ttl,
                dscp: proposal.mark_tos >> 2,
            })
        {
            // Someone else's connection with the same 4-tuple: not ours to
            // answer; its own server will.
            mismatched = true;
            continue;
        }
        // Same source address, server and mark: ours only if the client's
        // port (published right after its connect) is the SYN's. A client
        // that died before publishing it is the dead proposer; one that
        // has not published it in time may be someone else's (the slot is
        // left alone).
        let proposer = slot.client();
        wait.watch(proposer);
        match wait_client_port(&slot, wait, proposer) {
            Port::Published(p) if p == syn.src.port() => {}
            Port::Gone if !proposer.is_alive_fast() => {
                return decline(dev, &slot, Reason::PeerDead, None)
            }
            Port::Late => {
                debug!("the client published no source port in time");
                return Decision::Tcp(Reason::Timeout);
            }
            _ => {
                mismatched = true;
                continue;
            }
        }
        if proposer == Owner::current() {
            // This process proposed (a worker connecting to a listener it
            // shares with its siblings): its handshake continues in this
            // process, perhaps on this very thread once `accept` returns,
            // so waiting for it here could only run out of time.
            return decline(dev, &slot, Reason::SelfConnect, None);
        }
        let ends = (tcp_syn::canonical(syn.dst), tcp_syn::canonical(syn.src));
        return server_answer(dev, cfg, &slot, &proposal, wait, conn_fd, ends);
    }
    if mismatched {
        debug!(
            "SYN mark {:?} matches no proposal for {} -> {}",
            syn.mark, key.client, key.server
        );
    }
    Decision::Tcp(if mismatched {
        Reason::MarkMismatch
    } else {
        Reason::PeerNoSmc
    })
}

fn server_answer(
    dev: &Arc<Device>,
    cfg: &Config,
    slot: &SlotRef,
    proposal: &Proposal,
    wait: &ClientWait,
    conn_fd: RawFd,
    ends: (SocketAddr, SocketAddr),
) -> Decision {
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
        (ueid_match(proposal, cfg), Reason::NoUeid),
    ];
    if let Some((_, r)) = checks.iter().find(|(ok, _)| !ok) {
        return decline(dev, slot, *r, Some(wake));
    }
    if !crate::fdnum::room_for_conn() {
        return decline(dev, slot, Reason::Mem, Some(wake));
    }
    // The DMB the client keeps a mapping of, if we still pool it: the
    // client then needs no descriptor. Only on a private device, as below.
    let private = matches!(dev.shape(), Shape::Private { .. });
    let hint = slot.server_dmb_hint().filter(|_| private);
    let dmb = match dev.register_dmb_preferring(cfg.rmem, Role::Server, hint) {
        Ok(d) => d,
        Err(e) => {
            debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
            return decline(dev, slot, Reason::Mem, Some(wake));
        }
    };
    // The client's DMB from a mapping we keep of it, if we do: it then
    // passes no descriptor, which it learns before it accepts our
    // connection. Only on a private device, where every process that can
    // map a DMB runs as one uid: a mapping is kept per memfd, not per peer.
    let cached = match slot.client_dmb().filter(|_| private) {
        Some(id) => dev.attach_cached_dmb(id, proposal.token, slot.client()),
        None => None,
    };
    if cached.is_some() {
        slot.note(Progress::ServerHasClientDmb);
    }
    // A full backlog is waited on within the budget too. A dead client's
    // socket refuses the connection (PEER_DEAD).
    let bound = CONNECT_BOUND.min(wait.left());
    let chan = match client.connect_within(bound, &dev.shape(), dev.gid(), proposal.token) {
        // The connection's channel if the handshake succeeds: out of the
        // application's range of numbers (crate::fdnum).
        Ok(c) => crate::fdnum::move_high(c),
        Err(e) => {
            debug!("cannot reach the client's rendezvous socket {client}: {e}");
            return decline(dev, slot, e.reason(), None);
        }
    };
    slot.note(Progress::ServerConnected);
    let peer = match cached {
        Some(p) => p,
        None => match receive_client_dmb(dev, slot, proposal, wait, &chan) {
            Ok(p) => p,
            Err(r) => return decline(dev, slot, r, None),
        },
    };
    let reused = hint.is_some_and(|h| dmb.id() == h);
    if reused {
        slot.note(Progress::ClientHasServerDmb);
    }
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
    // ACCEPTED decides: SMC-D for both ends. The client follows once it
    // has our DMB (or our message that it has it already), which also
    // wakes it; the server does not wait for its Confirm. An end that
    // cannot follow aborts the connection (here: closing the channel tells
    // the client, which then aborts too).
    let fd = (!reused).then(|| dmb.fd());
    if let Err(e) = send_msg(chan.as_raw_fd(), SERVER_DMB_BYTE, fd) {
        debug!("sending our DMB to the client failed ({e}): connection aborted");
        return abort_tcp(conn_fd, Reason::IntErr);
    }
    match establish(dmb, peer, chan, proposal.token, ends, mode(dev, cfg)) {
        Ok(e) => Decision::Smc(e),
        Err(e) => {
            debug!("building the connection failed ({e}): connection aborted");
            abort_tcp(conn_fd, Reason::IntErr)
        }
    }
}

/// The client's DMB, passed on `chan` as soon as the client has accepted
/// our connection; checked before we accept. `Err`: the reason to decline
/// with (declining closes the channel, which wakes the client).
fn receive_client_dmb(
    dev: &Device,
    slot: &SlotRef,
    proposal: &Proposal,
    wait: &ClientWait,
    chan: &UnixStream,
) -> Result<Dmb, Reason> {
    let sent = || slot.noted(Progress::ClientDmbSent);
    let withdrew = || slot.state() != SlotState::Proposed || !slot.client().is_alive_fast();
    let client_dmb = loop {
        if !wait.readable(chan.as_raw_fd(), sent, withdrew) {
            return Err(client_silent(slot, false));
        }
        match recv_expected(chan.as_raw_fd(), CLIENT_DMB_BYTE) {
            Ok(Received::Msg(fd)) => break fd,
            Ok(Received::Pending) => continue,
            Ok(Received::Closed) => return Err(client_silent(slot, true)),
            Err(e) => {
                debug!("receiving the client's DMB failed: {e}");
                return Err(e.reason());
            }
        }
    };
    let Some(client_dmb) = client_dmb else {
        debug!("the client passed no DMB for token {:016x}", proposal.token);
        return Err(Reason::ErrRtok);
    };
    dev.attach_dmb(proposal.token, client_dmb)
        .map_err(|e| attach_error(e).reason())
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

/// What became of the client's source port.
enum Port {
    /// Published (right after the client's `connect`).
    Published(u16),
    /// The proposal was withdrawn, or its client is gone.
    Gone,
    /// Not published within the budget.
    Late,
}

/// Waits for the client to publish its source port: right after its
/// `connect`, which on loopback may return a moment after our `accept`.
///
/// Busy-polls for the spin budget first: the client is running (its
/// `connect` is returning) and publishes within microseconds, while a sleep
/// costs at least the timer's 50 µs slack and a wake-up. Sleeping after a
/// fixed 256 polls put that cost on most connections (one `clock_nanosleep`
/// per accept under `strace`).
fn wait_client_port(slot: &SlotRef, wait: &ClientWait, proposer: Owner) -> Port {
    let start = Instant::now();
    loop {
        if let Some(p) = slot.client_port() {
            return Port::Published(p);
        }
        if slot.state() != SlotState::Proposed {
            return Port::Gone;
        }
        if start.elapsed() >= crate::conn::spin_budget() && !proposer.is_alive_fast() {
            return Port::Gone;
        }
        if !wait.pause(start) {
            return Port::Late;
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
/// connecting to its rendezvous socket, named for the proposal's token) so
/// it does not wait for the timeout.
fn decline(
    dev: &Device,
    slot: &SlotRef,
    r: Reason,
    wake: Option<(&RendezvousAddr, u64)>,
) -> Decision {
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
    Decision::Tcp(r)
}
