//! What `smclo ss` lists, like smc-tools' `smcss`: every SMC-D connection
//! end of the device and every listener, read from the device file.
//!
//! Each connection end is one connected DMB table entry
//! ([`crate::device`]): its owner, role, the TCP connection's addresses,
//! the transfer mode, the bytes it wrote into the peer's ring and consumed
//! from its own, and its close flags. The two ends of a connection are
//! paired by token. The SMC socket state of an end is derived from both
//! ends' flags ([`SmcState::of`]); an end whose peer's entry is gone sees
//! the peer as closed, one whose peer's entry is not connected yet (the
//! peer's end of the handshake finishes a moment later) sees it active.
//! The fill of an end's ring is what the peer wrote into it minus what it
//! consumed, known while the peer's entry exists.
//!
//! With `-a`, the fallback connections still open are listed too, from the
//! device's fallback table ([`crate::fallbacks`]): each stays there while
//! the descriptor it was connected or accepted on, or a duplicate of it, is
//! open in the process that made it (not after an `exec`).
//!
//! [`Device::stats`], the counters `smclo stats` shows, is here too: it
//! reads the device's counters and DMB table ([`crate::device`]) and its
//! listener table ([`crate::registry`]).
//!
//! Nothing here is more than the device file holds: who may read the device
//! may read this.

use crate::device::{Device, Role, Stats};
use crate::fallbacks;
use crate::owner::{Owner, PidNs};
use crate::registry;
use smclo_wire::device_layout::end_flags;
use smclo_wire::ends;
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::net::SocketAddr;

impl Device {
    /// The counters ([`Stats`]). Also reclaims the DMB and listener table
    /// entries of dead owners first, so that the gauges are right after
    /// kill -9.
    pub fn stats(&self) -> Stats {
        let mut s = self.counters();
        s.listeners = registry::live_listeners(self);
        s.declines = registry::declines(self).len() as u64;
        s
    }
}

/// SMC's socket states (the kernel's `enum smc_state`, as `smcss` names
/// them) that an smclo connection end passes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmcState {
    /// Both directions open.
    Active,
    /// This end shut down writing; the peer has not.
    PeerCloseWait1,
    /// Both shut down writing, this end first; the peer has not closed.
    PeerCloseWait2,
    /// The peer shut down writing or closed; this end has not shut down.
    AppCloseWait1,
    /// The peer shut down writing or closed first, then this end shut down
    /// writing; this end has not closed.
    AppCloseWait2,
    /// This end shut down writing first, and the peer has closed.
    AppFinCloseWait,
    /// This end closed or aborted, or its peer aborted (and this end has
    /// seen it, or the peer's entry still says so); the application may
    /// still hold the descriptor.
    Closed,
}

impl SmcState {
    /// The name `smcss` prints.
    pub fn name(self) -> &'static str {
        match self {
            SmcState::Active => "ACTIVE",
            SmcState::PeerCloseWait1 => "PEERCLOSEWAIT1",
            SmcState::PeerCloseWait2 => "PEERCLOSEWAIT2",
            SmcState::AppCloseWait1 => "APPCLOSEWAIT1",
            SmcState::AppCloseWait2 => "APPCLOSEWAIT2",
            SmcState::AppFinCloseWait => "APPFINCLOSEWAIT",
            SmcState::Closed => "CLOSED",
        }
    }

    /// The state of an end with [`end_flags`] `me` whose peer's flags are
    /// `peer` (`None`: the peer's entry is gone, it closed or died), as the
    /// kernel's close state machine (`smc_close.c`) would have it.
    pub fn of(me: u64, peer: Option<u64>) -> SmcState {
        let ended = end_flags::CLOSED | end_flags::ABORTED | end_flags::PEER_ABORTED;
        if me & ended != 0 || peer.is_some_and(|p| p & end_flags::ABORTED != 0) {
            return SmcState::Closed;
        }
        let peer_closed = peer.is_none_or(|p| p & end_flags::CLOSED != 0);
        let peer_done = peer_closed || peer.is_some_and(|p| p & end_flags::SHUT_WR != 0);
        match (me & end_flags::SHUT_WR != 0, peer_done) {
            (false, false) => SmcState::Active,
            (false, true) => SmcState::AppCloseWait1,
            (true, _) if me & end_flags::SHUT_WR_PASSIVE != 0 => SmcState::AppCloseWait2,
            (true, false) => SmcState::PeerCloseWait1,
            (true, true) if peer_closed => SmcState::AppFinCloseWait,
            (true, true) => SmcState::PeerCloseWait2,
        }
    }
}

/// The process behind an entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Process {
    /// Its pid, in its own pid namespace.
    pub pid: u32,
    /// Its pid namespace (inode of `/proc/<pid>/ns/pid`).
    pub pidns: PidNs,
    /// Its program name (`/proc/<pid>/comm`); `None` when it is in another
    /// pid namespace (its pid names another process here) or gone.
    pub program: Option<String>,
}

/// The processes of one listing: each owner's `/proc` files are read once,
/// however many entries it owns.
#[derive(Default)]
struct Processes(HashMap<Owner, Process>);

impl Processes {
    fn of(&mut self, o: Owner) -> Process {
        self.0
            .entry(o)
            .or_insert_with(|| Process {
                pid: o.pid,
                pidns: o.pidns,
                program: program(o),
            })
            .clone()
    }
}

/// `/proc/<pid>/comm` of `o`, if `o` is in our pid namespace and is still
/// the process with that pid (same start time).
fn program(o: Owner) -> Option<String> {
    if o.pidns != PidNs::current() {
        return None;
    }
    let now = Owner::of(o.pid)?;
    if o.start != 0 && now.start != 0 && now.start != o.start {
        return None;
    }
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", o.pid)).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

/// One SMC-D connection end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmcEnd {
    /// The process that owns the end's DMB.
    pub process: Process,
    /// Client (connected) or server (accepted).
    pub role: Role,
    /// The TCP connection's local address.
    pub local: SocketAddr,
    /// The TCP connection's peer address.
    pub peer: SocketAddr,
    /// Copy mode (through a private send buffer); otherwise no-copy.
    pub copy: bool,
    /// This end's DMB token.
    pub token: u64,
    /// The peer's DMB token.
    pub peer_token: u64,
    /// Bytes this end wrote into the peer's ring.
    pub bytes_sent: u64,
    /// Bytes this end's application consumed from its ring.
    pub bytes_received: u64,
    /// Size of this end's ring (its receive buffer).
    pub ring_len: u32,
    /// Bytes in this end's ring not consumed yet; `None` once the peer's
    /// entry is gone.
    pub ring_fill: Option<u64>,
    /// SMC socket state.
    pub state: SmcState,
}

/// Every SMC-D connection end of the device, ordered by local then peer
/// address.
pub fn smc_ends(dev: &Device) -> Vec<SmcEnd> {
    let raw = dev.published_ends();
    let mut procs = Processes::default();
    let by_token: HashMap<u64, usize> = raw.iter().enumerate().map(|(i, e)| (e.token, i)).collect();
    let mut out: Vec<SmcEnd> = raw
        .iter()
        .filter(|e| e.connected)
        .filter_map(|e| {
            let (local, peer) = ends::unpack(&e.ends)?;
            // A peer entry not connected yet (its end of the handshake
            // finishes after ours) is the peer, with nothing sent or done.
            let peer_end = by_token
                .get(&e.peer_token)
                .map(|&i| &raw[i])
                .filter(|p| !p.connected || p.peer_token == e.token);
            Some(SmcEnd {
                process: procs.of(e.owner),
                role: e.role,
                local,
                peer,
                copy: e.flags & end_flags::COPY != 0,
                token: e.token,
                peer_token: e.peer_token,
                bytes_sent: e.tx_bytes,
                bytes_received: e.rx_bytes,
                ring_len: e.ring_len,
                ring_fill: peer_end.map(|p| p.tx_bytes.saturating_sub(e.rx_bytes)),
                state: SmcState::of(e.flags, peer_end.map(|p| p.flags)),
            })
        })
        .collect();
    out.sort_by_key(|e| (e.local, e.peer));
    out
}

/// One end of a TCP connection that fell back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEnd {
    /// The process that connected or accepted it.
    pub process: Process,
    /// Client (connected) or server (accepted).
    pub role: Role,
    /// The TCP connection's local address.
    pub local: SocketAddr,
    /// The TCP connection's peer address.
    pub peer: SocketAddr,
    /// Why it stayed TCP (the side that decided).
    pub reason: Reason,
}

/// Every recorded fallback connection still open, ordered by local then
/// peer address.
pub fn tcp_ends(dev: &Device) -> Vec<TcpEnd> {
    let mut procs = Processes::default();
    let mut out: Vec<TcpEnd> = fallbacks::open(dev)
        .into_iter()
        .map(|f| TcpEnd {
            process: procs.of(f.owner),
            role: f.role,
            local: f.local,
            peer: f.peer,
            reason: f.reason,
        })
        .collect();
    out.sort_by_key(|e| (e.local, e.peer));
    out
}

/// What a row of [`listeners`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ListenState {
    /// A listener clients propose to.
    Listen,
    /// A listening socket whose process cannot serve SMC-D connections
    /// from it (it uses io_uring): clients of the registrations that may
    /// stand for it connect over TCP while the process lives.
    Declined,
}

impl ListenState {
    /// As `smclo ss -l` shows it.
    pub fn name(self) -> &'static str {
        match self {
            ListenState::Listen => "LISTEN",
            ListenState::Declined => "DECLINED",
        }
    }
}

/// One listener registered on the device, or a decline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    /// Which of the two.
    pub state: ListenState,
    /// The listening (or declining) process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Inode of its network namespace.
    pub netns: u64,
}

/// Every live listener clients propose to and every decline of the
/// device, ordered by address.
pub fn listeners(dev: &Device) -> Vec<Listener> {
    let mut procs = Processes::default();
    let listening = registry::listeners(dev)
        .into_iter()
        .map(|l| (ListenState::Listen, l));
    let declined = registry::declines(dev)
        .into_iter()
        .map(|l| (ListenState::Declined, l));
    let mut out: Vec<Listener> = listening
        .chain(declined)
        .map(|(state, l)| Listener {
            state,
            process: procs.of(l.owner),
            addr: l.addr,
            netns: l.netns,
        })
        .collect();
    out.sort_by_key(|l| (l.addr, l.state, l.process.pid));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use end_flags::{ABORTED, CLOSED, PEER_ABORTED, SHUT_WR, SHUT_WR_PASSIVE};
    use SmcState::*;

    #[test]
    fn states_follow_the_kernels_close_machine() {
        let cases: [(u64, Option<u64>, SmcState); 16] = [
            (0, Some(0), Active),
            (SHUT_WR, Some(0), PeerCloseWait1),
            (SHUT_WR, Some(SHUT_WR | SHUT_WR_PASSIVE), PeerCloseWait2),
            (SHUT_WR, None, AppFinCloseWait),
            (SHUT_WR, Some(SHUT_WR | CLOSED), AppFinCloseWait),
            (0, Some(SHUT_WR), AppCloseWait1),
            (0, None, AppCloseWait1),
            (SHUT_WR | SHUT_WR_PASSIVE, Some(SHUT_WR), AppCloseWait2),
            (SHUT_WR | SHUT_WR_PASSIVE, None, AppCloseWait2),
            // A closed peer whose entry is not freed yet counts as gone.
            (0, Some(CLOSED), AppCloseWait1),
            (CLOSED, Some(0), Closed),
            (ABORTED, Some(0), Closed),
            (0, Some(ABORTED), Closed),
            // This end saw the peer's abort; the peer's entry may be gone.
            (PEER_ABORTED, None, Closed),
            (SHUT_WR | PEER_ABORTED, None, Closed),
            (SHUT_WR, Some(ABORTED), Closed),
        ];
        for (me, peer, want) in cases {
            assert_eq!(SmcState::of(me, peer), want, "me {me:#x} peer {peer:?}");
        }
    }
}
