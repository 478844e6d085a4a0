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
use crate::debug;
use crate::device::{self as device, Device, Registration, Role};
use crate::owner::{self, Owner};
use crate::registry;
use crate::rendezvous::{OwnedSlot, Rendezvous, SlotKey, SlotRef, SlotState, REPLY_GRACE};
use crate::tcp_syn::{self, SavedMark};
use smclo_wire::clc::{self, Accept, ClcMsg, Confirm, Decline, Proposal};
use smclo_wire::reason::Reason;
use smclo_wire::syn::Mark;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
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
    /// Unlinked (once) when the proposal is withdrawn.
    rendezvous_path: Option<PathBuf>,
    saved_mark: Option<SavedMark>,
    /// The caller's socket, and the source address of the slot key (whose
    /// port position holds the mark, see [`key_for`]).
    fd: RawFd,
    src_ip: std::net::IpAddr,
    port_published: bool,
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
    SlotKey::new(
        SocketAddr::new(src_ip, (mark.ttl as u16) << 8 | mark.dscp as u16),
        dest,
    )
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
pub fn client_propose(
    dev: &Arc<Device>,
    cfg: &Config,
    fd: RawFd,
    dest: SocketAddr,
) -> Result<ClientProposal, Reason> {
    let dest = tcp_syn::canonical(dest);
    if !dev.active() {
        return Err(Reason::NoSmcdDev);
    }
    let listener = registry::find_listener(dev, dest).ok_or(Reason::PeerNoSmc)?;
    let me = Owner::current();
    if listener.is_self() {
        // The accept that would answer may run on this very thread; waiting
        // for it could deadlock, so decline up front.
        return Err(Reason::SelfConnect);
    }
    // The key needs the source address before the SYN: the bound one, or
    // the one routing will choose. The port stays the kernel's choice at
    // `connect` (see `key_for`).
    let src_ip = match local_addr(fd) {
        Ok(a) if !a.ip().is_unspecified() => tcp_syn::canonical(a).ip(),
        _ => tcp_syn::canonical(SocketAddr::new(
            tcp_syn::route_source_cached(dest).map_err(|_| Reason::IntErr)?,
            0,
        ))
        .ip(),
    };
    let dmb = dev.register_dmb(cfg.rmem, Role::Client).map_err(|e| {
        debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
        Reason::Mem
    })?;
    // In the listener's network namespace the rendezvous socket needs no
    // file (see `ABSTRACT_NONCE`); across namespaces only a path reaches it.
    let mut nonce = random_u64() | ABSTRACT_NONCE;
    if !listener.same_netns() {
        nonce &= !ABSTRACT_NONCE;
    }
    let (rendezvous, rendezvous_path) = match bind_rendezvous(dev, nonce) {
        Ok(r) => Ok(r),
        Err(e) if nonce & ABSTRACT_NONCE != 0 => {
            debug!("abstract rendezvous socket failed ({e}); using a path");
            nonce &= !ABSTRACT_NONCE;
            bind_rendezvous(dev, nonce)
        }
        Err(e) => Err(e),
    }
    .map_err(|e| {
        debug!(
            "cannot create the rendezvous socket {}: {e}",
            RendezvousAddr::new(dev, nonce)
        );
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
        fd,
        src_ip,
        port_published: false,
    };
    let key = key_for(src_ip, mark, dest);
    let slot =
        Rendezvous::propose(dev, key, &ClcMsg::Proposal(proposal).to_bytes()).map_err(|e| {
            debug!("no rendezvous slot for {src_ip} -> {dest}: {e}");
            Reason::MaxDmb
        })?;
    p.slot = Some(slot);
    p.saved_mark = Some(tcp_syn::apply_mark(fd, &dest, mark).map_err(|e| {
        debug!("cannot mark the SYN: {e}");
        Reason::IntErr
    })?);
    debug!(
        "proposed {src_ip} -> {dest} (mark ttl {} dscp {})",
        mark.ttl, mark.dscp
    );
    Ok(p)
}

impl ClientProposal {
    /// The token of the DMB offered in the Proposal.
    pub fn token(&self) -> u64 {
        self.dmb.as_ref().map_or(0, |d| d.token())
    }

    /// Puts the socket options back and publishes the source port the
    /// kernel chose in the rendezvous slot (the server matches it against
    /// the SYN); call right after `connect` returned (0 or `EINPROGRESS`):
    /// the SYN has left by then.
    pub fn syn_sent(&mut self) {
        if let Some(s) = self.saved_mark.take() {
            if let Err(e) = tcp_syn::restore_mark(s) {
                debug!("restoring TTL/TOS after the SYN failed: {e}");
            }
        }
        if self.port_published {
            return;
        }
        self.port_published = true;
        let Some(slot) = &self.slot else { return };
        match local_addr(self.fd).map(tcp_syn::canonical) {
            Ok(a) if a.port() != 0 && a.ip() == self.src_ip => slot.set_client_port(a.port()),
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
        if let Some(p) = self.rendezvous_path.take() {
            let _ = std::fs::remove_file(p);
        }
        self.slot = None;
    }

    fn run(&mut self) -> Decision {
        let deadline = Instant::now() + self.cfg.clc_wait;
        let slot: SlotRef = SlotRef::clone(self.slot.as_ref().expect("proposal without slot"));
        // The UNIX channel, once the server has connected, and the server's
        // message on it (its DMB descriptor), once received: `Some(None)`
        // when the channel closed or the message carried no descriptor.
        let mut chan: Option<UnixStream> = None;
        let mut server_dmb: Option<Option<File>> = None;
        loop {
            let seen = slot.state();
            match seen {
                // The server sends its DMB right after its CAS to ACCEPTED.
                SlotState::Accepted if server_dmb.is_some() => break,
                SlotState::Declined => {
                    let r = peer_decline(slot.reply());
                    drop(chan);
                    self.withdraw();
                    return Decision::Tcp(r);
                }
                SlotState::Proposed | SlotState::Replying | SlotState::Accepted => {}
                other => {
                    debug!("rendezvous slot in state {other:?} while waiting for the server");
                    drop(chan);
                    self.withdraw();
                    return Decision::Tcp(Reason::SyncErr);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                match slot.give_up() {
                    Ok(()) => {
                        drop(chan);
                        self.withdraw();
                        return Decision::Tcp(Reason::Timeout);
                    }
                    Err(_) => continue, // the server decided first: follow it
                }
            }
            // Sleep in poll: first until the server connects to our
            // rendezvous socket (it does so before it answers, also to wake
            // us when it declines), then until its message or end of file.
            match &chan {
                None => {
                    let listener = self.rendezvous.as_ref().expect("rendezvous socket");
                    if !wait_readable(listener.as_raw_fd(), deadline - now) {
                        continue;
                    }
                    let _ = listener.set_nonblocking(true);
                    match listener.accept() {
                        Ok((c, _)) if !same_uid(c.as_raw_fd()) => {
                            // Only possible for an abstract socket, which
                            // any uid in the namespace can reach: our DMB
                            // goes to no one but our own uid.
                            debug!("refused a rendezvous connection from another uid");
                        }
                        Ok((c, _)) => {
                            // The connection's channel if the handshake
                            // succeeds: out of the application's range of
                            // numbers (crate::fdnum).
                            let c = crate::fdnum::move_high(c);
                            // Our DMB goes to the server now: it checks it
                            // before it accepts. A failed send shows on the
                            // server's side (end of file, or no descriptor).
                            let fd = self.dmb.as_ref().map(|d| d.fd());
                            if let Err(e) = send_msg(c.as_raw_fd(), CLIENT_DMB_BYTE, fd) {
                                debug!("sending our DMB to the server failed: {e}");
                            }
                            chan = Some(c);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => debug!("accepting the server's connection failed: {e}"),
                    }
                }
                Some(c) if server_dmb.is_none() => {
                    if !wait_readable(c.as_raw_fd(), deadline - now) {
                        continue;
                    }
                    match recv_msg(c.as_raw_fd()) {
                        Ok(Some((SERVER_DMB_BYTE, fd))) => server_dmb = Some(fd),
                        Ok(Some((b, _))) => {
                            debug!("unexpected byte {b:#x} from the server during the handshake");
                            server_dmb = Some(None);
                        }
                        Ok(None) => server_dmb = Some(None),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => {
                            debug!("receiving the server's DMB failed: {e}");
                            server_dmb = Some(None);
                        }
                    }
                }
                // The channel has said all it will; the slot decides.
                Some(_) => {
                    slot.wait_while(seen, deadline);
                }
            }
        }
        let chan = chan.expect("a server message implies a channel");
        match self.confirm(&slot, chan, server_dmb.flatten()) {
            Ok(e) => Decision::Smc(e),
            Err(r) => {
                // The channel is closed by now (confirm consumed it): a
                // server that finds the slot gone sees end of file and knows
                // we declined.
                let _ = slot.confirm(
                    &ClcMsg::Decline(Decline::new(self.dev.gid(), r)).to_bytes(),
                    false,
                );
                self.withdraw();
                Decision::Tcp(r)
            }
        }
    }

    fn confirm(
        &mut self,
        slot: &SlotRef,
        chan: UnixStream,
        server_dmb: Option<File>,
    ) -> Result<Established, Reason> {
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
        let Some(fd) = server_dmb else {
            debug!(
                "the server accepted but passed no DMB for token {:016x}",
                accept.token
            );
            return Err(Reason::ErrRtok);
        };
        let peer = self
            .dev
            .attach_dmb(accept.token, fd)
            .map_err(|e| attach_reason(&e))?;
        let dmb = self.dmb.as_ref().ok_or(Reason::ErrRtok)?;
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
        let _ = send_msg(chan.as_raw_fd(), CONFIRM_BYTE, None);
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
    if dev.dmb_copy() {
        Mode::Copy {
            sndbuf_len: cfg.wmem,
        }
    } else {
        Mode::NoCopy
    }
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

/// Bit of the rendezvous nonce saying "abstract socket". The client's
/// rendezvous socket is a path in the device directory (`u-<nonce>`) when
/// the listener is in another network namespace: pathname sockets are
/// reachable from any namespace that sees the directory. In the listener's
/// own namespace it is an abstract socket (`\0smclo-<gid>-u-<nonce>`),
/// which costs no file creation and removal per connection. An abstract
/// socket, unlike the 0700 directory, is reachable by every uid in the
/// namespace, so both ends check the other's uid (`SO_PEERCRED`) before
/// passing a descriptor; its name is taken before the nonce is published.
const ABSTRACT_NONCE: u64 = 1 << 63;

/// Where the client's rendezvous socket is, from the nonce.
enum RendezvousAddr {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

impl RendezvousAddr {
    fn new(dev: &Device, nonce: u64) -> RendezvousAddr {
        if nonce & ABSTRACT_NONCE != 0 {
            RendezvousAddr::Abstract(
                format!("smclo-{:016x}-u-{nonce:016x}", dev.gid()).into_bytes(),
            )
        } else {
            RendezvousAddr::Path(dev.dir().join(format!("u-{nonce:016x}")))
        }
    }

    fn connect(&self) -> io::Result<UnixStream> {
        match self {
            RendezvousAddr::Path(p) => UnixStream::connect(p),
            RendezvousAddr::Abstract(n) => {
                use std::os::linux::net::SocketAddrExt;
                UnixStream::connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(n)?)
            }
        }
    }
}

impl std::fmt::Display for RendezvousAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RendezvousAddr::Path(p) => write!(f, "{}", p.display()),
            RendezvousAddr::Abstract(n) => write!(f, "@{}", String::from_utf8_lossy(n)),
        }
    }
}

/// The client's rendezvous socket for `nonce`, and its path if it has one
/// (to unlink).
fn bind_rendezvous(dev: &Device, nonce: u64) -> io::Result<(UnixListener, Option<PathBuf>)> {
    match RendezvousAddr::new(dev, nonce) {
        RendezvousAddr::Path(p) => Ok((UnixListener::bind(&p)?, Some(p))),
        RendezvousAddr::Abstract(n) => {
            use std::os::linux::net::SocketAddrExt;
            Ok((
                UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(n)?)?,
                None,
            ))
        }
    }
}

/// Whether the process at the other end of the UNIX socket `fd` (its
/// creator, for a listening peer) runs as our effective uid.
fn same_uid(fd: RawFd) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, which we
    // own; geteuid has no preconditions.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        ) == 0
            && len as usize == std::mem::size_of::<libc::ucred>()
            && cred.uid == libc::geteuid()
    }
}

/// What the client sends on the channel after its Confirm (and before any
/// doorbell).
const CONFIRM_BYTE: u8 = 0xC5;
/// The client's first message on the channel, carrying its DMB descriptor.
const CLIENT_DMB_BYTE: u8 = 0xD1;
/// The server's message on the channel after its Accept, carrying its DMB
/// descriptor.
const SERVER_DMB_BYTE: u8 = 0xD2;

/// Sends `byte`, and `fd` (if any) as `SCM_RIGHTS`, on the UNIX stream
/// socket `sock`, without blocking and without SIGPIPE.
fn send_msg(sock: RawFd, byte: u8, fd: Option<RawFd>) -> io::Result<()> {
    let mut data = [byte];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // u64 elements: aligned for cmsghdr.
    let mut cbuf = [0u64; 4];
    // SAFETY: zeroed msghdr is a valid "no name, no control" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&cbuf));
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to `space` zeroed, aligned bytes, enough
        // for one cmsghdr with one descriptor, so CMSG_FIRSTHDR is non-null
        // and CMSG_DATA has room for the descriptor.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
        }
    }
    // SAFETY: msg points to live buffers (data, cbuf) for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Receives one byte and at most one descriptor (close-on-exec) from the
/// UNIX stream socket `sock` without blocking. `Ok(None)` is end of file.
/// Extra descriptors are closed; a truncated control message is an error.
fn recv_msg(sock: RawFd) -> io::Result<Option<(u8, Option<File>)>> {
    let mut data = [0u8];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: zeroed msghdr is a valid "no name, no control" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: msg points to live buffers (data, cbuf) for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds: Vec<File> = Vec::new();
    // SAFETY: the kernel filled msg_control up to msg_controllen; the CMSG
    // macros stay inside it, and every SCM_RIGHTS payload is whole
    // descriptors that are now ours (wrapped in File, closed if unused).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    fds.push(File::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "truncated control message",
        ));
    }
    if n == 0 {
        return Ok(None);
    }
    if fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more than one descriptor",
        ));
    }
    Ok(Some((data[0], fds.pop())))
}

/// Blocks until `fd` is readable or `timeout` passes; true if readable.
///
/// Busy-polls first, for the data path's spin budget (`SMCLO_SPIN_US`): each
/// step of the handshake answers the previous one within microseconds, and
/// sleeping for it would add a wake-up (a scheduler round trip on another
/// CPU) per step.
fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let spin = crate::conn::spin_budget().min(timeout);
    let start = Instant::now();
    if !spin.is_zero() {
        loop {
            // SAFETY: one valid pollfd, count 1, no waiting.
            if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
                return true;
            }
            if start.elapsed() >= spin {
                break;
            }
            std::hint::spin_loop();
        }
    }
    let left = timeout.saturating_sub(start.elapsed());
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
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
        let proposer = Owner {
            pid: proposal.pid,
            start: proposal.start_time,
        };
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
        (
            Owner {
                pid: proposal.pid,
                start: proposal.start_time,
            }
            .is_alive_fast(),
            Reason::PeerDead,
        ),
    ];
    if let Some((_, r)) = checks.iter().find(|(ok, _)| !ok) {
        return decline(dev, slot, *r, Some(&wake));
    }
    let dmb = match dev.register_dmb(cfg.rmem, Role::Server) {
        Ok(d) => d,
        Err(e) => {
            debug!("registering a {} byte DMB failed: {e}", cfg.rmem);
            return decline(dev, slot, Reason::Mem, Some(&wake));
        }
    };
    let chan = match wake.connect() {
        Ok(c) if !same_uid(c.as_raw_fd()) => {
            debug!("the rendezvous socket {wake} belongs to another uid");
            return decline(dev, slot, Reason::PeerDead, None);
        }
        // The connection's channel if the handshake succeeds: out of the
        // application's range of numbers (crate::fdnum).
        Ok(c) => crate::fdnum::move_high(c),
        Err(e) => {
            debug!("cannot reach the client's rendezvous socket: {e}");
            return decline(dev, slot, Reason::PeerDead, None);
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
        match recv_msg(chan.as_raw_fd()) {
            Ok(Some((CLIENT_DMB_BYTE, fd))) => break fd,
            Ok(Some((b, _))) => {
                debug!("unexpected byte {b:#x} from the client during the handshake");
                return decline(dev, slot, Reason::Protocol, None);
            }
            // Closed: the client withdrew (or died) before we answered.
            Ok(None) => return decline(dev, slot, Reason::Timeout, None),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                debug!("receiving the client's DMB failed: {e}");
                return decline(dev, slot, Reason::Protocol, None);
            }
        }
    };
    let Some(client_dmb) = client_dmb else {
        debug!("the client passed no DMB for token {:016x}", proposal.token);
        return decline(dev, slot, Reason::ErrRtok, None);
    };
    let peer = match dev.attach_dmb(proposal.token, client_dmb) {
        Ok(p) => p,
        Err(e) => return decline(dev, slot, attach_reason(&e), None),
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
            let mut b = [0u8; 1];
            // SAFETY: recv of at most one byte into a buffer we own.
            let n = unsafe {
                libc::recv(
                    chan.as_raw_fd(),
                    b.as_mut_ptr().cast(),
                    1,
                    libc::MSG_DONTWAIT,
                )
            };
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
            let _ = w.connect();
        }
    }
    Decision::Tcp(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_sockets_by_path_and_abstract() {
        let dir = std::env::temp_dir().join(format!("smclo-hs-{}", std::process::id()));
        let dev = Device::open(&dir).unwrap();
        for nonce in [0x1234u64, 0x1234 | ABSTRACT_NONCE] {
            let (l, path) = bind_rendezvous(&dev, nonce).unwrap();
            assert_eq!(path.is_some(), nonce & ABSTRACT_NONCE == 0);
            if let Some(p) = &path {
                assert!(p.exists());
            }
            let c = RendezvousAddr::new(&dev, nonce).connect().unwrap();
            let (a, _) = l.accept().unwrap();
            assert!(same_uid(c.as_raw_fd()) && same_uid(a.as_raw_fd()));
            // A descriptor goes through, with its byte.
            let f = crate::dmb::memfd("t").unwrap();
            send_msg(c.as_raw_fd(), CLIENT_DMB_BYTE, Some(f.as_raw_fd())).unwrap();
            let (b, got) = recv_msg(a.as_raw_fd()).unwrap().unwrap();
            assert_eq!(b, CLIENT_DMB_BYTE);
            assert!(got.is_some());
            drop(c);
            assert!(recv_msg(a.as_raw_fd()).unwrap().is_none(), "end of file");
            if let Some(p) = path {
                std::fs::remove_file(p).unwrap();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
