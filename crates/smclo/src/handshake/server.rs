//! The server's state machine: from `accept`, find the proposal behind the
//! saved SYN and answer it.

use super::channel::{
    recv_expected, send_msg, wait_readable, Received, RendezvousAddr, CLIENT_DMB_BYTE,
    CONFIRM_BYTE, CONNECT_BOUND, SERVER_DMB_BYTE,
};
use super::{
    attach_error, expect_clc, key_for, mode, peer_decline, random_u64, Decision, Established,
    HandshakeError, LOOPBACK_CHID,
};
use crate::config::Config;
use crate::conn::Conn;
use crate::debug;
use crate::device::{Device, Role};
use crate::owner::Owner;
use crate::rendezvous::{Rendezvous, SlotRef, SlotState, REPLY_GRACE};
use crate::tcp_syn;
use smclo_wire::clc::{self, Accept, ClcMsg, Decline, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::Mark;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let key = key_for(tcp_syn::canonical(syn.src).ip(), syn.mark, syn.dst);
    // Proposals for this 4-tuple; more than one only when clients in other
    // network namespaces use the same addresses. The mark picks ours.
    let candidates = Rendezvous::find_all(dev, key);
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
        // that died before publishing it is the dead proposer.
        let proposer = slot.client();
        match wait_client_port(&slot, Instant::now() + cfg.clc_wait, proposer) {
            Some(p) if p == syn.src.port() => {}
            None if !proposer.is_alive_fast() => {
                return decline(dev, &slot, Reason::PeerDead, None)
            }
            _ => {
                mismatched = true;
                continue;
            }
        }
        return server_answer(dev, cfg, &slot, &proposal);
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

fn server_answer(dev: &Arc<Device>, cfg: &Config, slot: &SlotRef, proposal: &Proposal) -> Decision {
    let wake = RendezvousAddr::new(dev, proposal.nonce);
    let checks = [
        (dev.active(), Reason::NoSmcdDev),
        (
            proposal.gid == dev.gid() && proposal.chid == LOOPBACK_CHID,
            Reason::NoSmcd2Dev,
        ),
        (ueid_match(proposal, cfg), Reason::NoUeid),
        (slot.client().is_alive_fast(), Reason::PeerDead),
    ];
    if let Some((_, r)) = checks.iter().find(|(ok, _)| !ok) {
        return decline(dev, slot, *r, Some(&wake));
    }
    if !crate::fdnum::room_for_conn() {
        return decline(dev, slot, Reason::Mem, Some(&wake));
    }
    let dmb = match dev.register_dmb(cfg.rmem, Role::Server) {
        Ok(d) => d,
        Err(e) => {
            debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
            return decline(dev, slot, Reason::Mem, Some(&wake));
        }
    };
    let chan = match wake.connect_within(CONNECT_BOUND) {
        // The connection's channel if the handshake succeeds: out of the
        // application's range of numbers (crate::fdnum).
        Ok(c) => crate::fdnum::move_high(c),
        Err(e) => {
            debug!("cannot reach the client's rendezvous socket {wake}: {e}");
            return decline(dev, slot, e.reason(), None);
        }
    };
    // The client passes its DMB as soon as it has accepted our connection;
    // check it before accepting. Declining closes the channel (drop), which
    // wakes the client.
    let deadline = Instant::now() + cfg.clc_wait;
    let client_dmb = loop {
        let now = Instant::now();
        if now >= deadline || !wait_readable(chan.as_raw_fd(), deadline - now) {
            debug!("the client passed no DMB in time");
            return decline(dev, slot, Reason::Timeout, None);
        }
        match recv_expected(chan.as_raw_fd(), CLIENT_DMB_BYTE) {
            Ok(Received::Msg(fd)) => break fd,
            Ok(Received::Pending) => continue,
            // Closed: the client withdrew (or died) before we answered.
            Ok(Received::Closed) => return decline(dev, slot, Reason::Timeout, None),
            Err(e) => {
                debug!("receiving the client's DMB failed: {e}");
                return decline(dev, slot, e.reason(), None);
            }
        }
    };
    let Some(client_dmb) = client_dmb else {
        debug!("the client passed no DMB for token {:016x}", proposal.token);
        return decline(dev, slot, Reason::ErrRtok, None);
    };
    let peer = match dev.attach_dmb(proposal.token, client_dmb) {
        Ok(p) => p,
        Err(e) => return decline(dev, slot, attach_error(e).reason(), None),
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
    // Our DMB, which also wakes the client. A failed send shows on the
    // client's side (no descriptor: it declines with ERR_RTOK).
    if let Err(e) = send_msg(chan.as_raw_fd(), SERVER_DMB_BYTE, Some(dmb.fd())) {
        debug!("sending our DMB to the client failed: {e}");
    }
    // Wait for the client's Confirm: it sends CONFIRM_BYTE on the channel
    // after its CAS to CONFIRMED, and closes the channel when it declines,
    // so the server sleeps in poll instead of spinning on the slot.
    let mut deadline = Instant::now() + cfg.clc_wait;
    let mut granted_grace = false;
    let confirmed = loop {
        let now = Instant::now();
        if now < deadline && wait_readable(chan.as_raw_fd(), deadline - now) {
            match recv_expected(chan.as_raw_fd(), CONFIRM_BYTE) {
                Ok(Received::Msg(_)) => break true,
                Ok(Received::Pending) => continue,
                // Closed (the client declined or died) or garbage.
                Ok(Received::Closed) | Err(_) => {
                    if slot.state() == SlotState::Declined {
                        return Decision::Tcp(peer_decline(slot.confirm_msg()));
                    }
                    break false;
                }
            }
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

/// The client's source port once it has published it (right after its
/// `connect`, which on loopback may return a moment after our `accept`);
/// `None` when the proposal is withdrawn, its client is gone, or `deadline`
/// passes first.
///
/// Busy-polls for the spin budget first, like [`wait_readable`]: the client
/// is running (its `connect` is returning) and publishes within
/// microseconds, while a sleep costs at least the timer's 50 µs slack and a
/// wake-up. Sleeping after a fixed 256 polls put that cost on most
/// connections (one `clock_nanosleep` per accept under `strace`).
fn wait_client_port(slot: &SlotRef, deadline: Instant, proposer: Owner) -> Option<u16> {
    let start = Instant::now();
    let spin = crate::conn::spin_budget();
    loop {
        if let Some(p) = slot.client_port() {
            return Some(p);
        }
        let now = Instant::now();
        if slot.state() != SlotState::Proposed || now >= deadline {
            return None;
        }
        if now.duration_since(start) < spin {
            std::hint::spin_loop();
        } else if !proposer.is_alive_fast() {
            return None;
        } else {
            std::thread::sleep(Duration::from_micros(50));
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
fn decline(dev: &Device, slot: &SlotRef, r: Reason, wake: Option<&RendezvousAddr>) -> Decision {
    if slot
        .answer(
            &ClcMsg::Decline(Decline::new(dev.gid(), r)).to_bytes(),
            false,
        )
        .is_ok()
    {
        if let Some(w) = wake {
            let _ = w.connect_within(CONNECT_BOUND);
        }
    }
    Decision::Tcp(r)
}
