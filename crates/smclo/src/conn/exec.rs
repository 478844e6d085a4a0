//! A connection end carried through exec: what the new image of the same
//! process needs to go on where the old one stopped. The rings, the
//! cursors and the flags live in the DMBs already; the new image gets the
//! two memfds (mappings do not survive exec), the channel, and the few
//! words of state that are private to the process.

use super::{Conn, Mode};
use crate::device::{Device, Registration, Role};
use crate::dmb::Dmb;
use crate::doorbell;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;

/// The process-private state of a connection end, besides its DMBs and
/// channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecState {
    /// Token of this end's DMB and its DMB table entry.
    pub local_token: u64,
    /// The entry of this end's DMB in the device's DMB table.
    pub entry: usize,
    /// Whether this end connected (else it accepted).
    pub client: bool,
    /// Token of the peer's DMB.
    pub peer_token: u64,
    /// Our attach record in the peer's DMB.
    pub peer_attach: u64,
    /// Copy mode's send buffer size; 0 for no-copy.
    pub sndbuf_len: u32,
    /// Bytes this process sent and received.
    pub sent: u64,
    /// See `sent`.
    pub received: u64,
    /// Doorbells owed to the reader ([`Conn::take_owed`]).
    pub rx_owed: u32,
    /// `SO_RCVTIMEO`, microseconds (0: none).
    pub rcv_timeo_us: u64,
    /// `SO_SNDTIMEO`, microseconds (0: none).
    pub snd_timeo_us: u64,
    /// `TCP_CORK` is on.
    pub cork: bool,
    /// `shutdown_write` was called.
    pub shut_wr: bool,
    /// Sticky errno after an abort (0: none).
    pub err: i32,
    /// The image before exec had forked since the DMBs were set up: other
    /// processes may use them too ([`Dmb::forked_since`]).
    pub forked: bool,
}

/// What exec passes of one connection end: the memfds of both DMBs
/// (close-on-exec; the caller clears that) and the state.
#[derive(Debug)]
pub struct ExecParts {
    /// This end's DMB (its receive ring).
    pub local: OwnedFd,
    /// The peer's DMB.
    pub peer: OwnedFd,
    /// The rest.
    pub state: ExecState,
}

/// Why a connection cannot be passed through exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecRefusal {
    /// A DMB's memfd is neither kept nor parked ([`crate::vault`] was full).
    NoMemfd,
    /// The connection has no table entry of this process.
    NoEntry,
}

impl std::fmt::Display for ExecRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExecRefusal::NoMemfd => "a DMB's memfd could not be kept",
            ExecRefusal::NoEntry => "its DMB table entry is not this process's",
        })
    }
}

impl Conn {
    /// Prepares this end for a new image of the process and returns what
    /// it needs. Bytes held by corking are published first (the new image
    /// has no deadline for them), and the reader flags that let the peer
    /// skip doorbells are cleared (no thread of this image will spin or
    /// poll the ring after exec). Nothing else changes: if exec fails, the
    /// connection goes on in this image.
    pub fn exec_export(&self, reg: &Registration) -> Result<ExecParts, ExecRefusal> {
        let (entry, client) = reg.exec_entry().ok_or(ExecRefusal::NoEntry)?;
        let _ = self.flush();
        let len = self.local.ring_len();
        let _ = doorbell::spin_end(self.local.prod(), len);
        let _ = doorbell::poll_cancel(self.local.prod(), len);
        let local = self.local.exec_file().ok_or(ExecRefusal::NoMemfd)?;
        let peer = self.peer.exec_file().ok_or(ExecRefusal::NoMemfd)?;
        let state = ExecState {
            local_token: self.local.token(),
            entry,
            client,
            peer_token: self.peer.token(),
            peer_attach: self.peer.attach_record().unwrap_or(0),
            sndbuf_len: match self.mode {
                Mode::NoCopy => 0,
                Mode::Copy { sndbuf_len } => sndbuf_len,
            },
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            rx_owed: self.rx_owed.load(Ordering::Relaxed),
            rcv_timeo_us: self.rcv_timeo_us.load(Ordering::Relaxed),
            snd_timeo_us: self.snd_timeo_us.load(Ordering::Relaxed),
            cork: self.cork.load(Ordering::Relaxed),
            shut_wr: self.shut_wr.load(Ordering::Relaxed),
            err: self.err.load(Ordering::Relaxed),
            forked: self.local.forked_since() || self.peer.forked_since(),
        };
        Ok(ExecParts { local, peer, state })
    }

    /// Prepares this end for another process that receives its descriptor
    /// (`SCM_RIGHTS`) and returns what that process needs to go on with it
    /// ([`Conn::pass_adopt`]), as [`Conn::exec_export`] does for a new
    /// image. From now on the receiving process ends the connection: this
    /// process's close sets no flag, and its mappings are neither pooled
    /// nor detached from, since the receiver writes through its own
    /// ([`Conn::unpass`] undoes that if the descriptor does not leave).
    /// Also returns whether it had been passed before (for
    /// [`Conn::unpass`]).
    pub fn pass_export(&self, reg: &Registration) -> Result<(ExecParts, bool), ExecRefusal> {
        let mut parts = self.exec_export(reg)?;
        // The receiver does not know who else maps the DMBs: it treats
        // them as a fork child does.
        parts.state.forked = true;
        let before = self.passed.swap(true, Ordering::Relaxed);
        Ok((parts, before))
    }

    /// The descriptor did not leave after [`Conn::pass_export`] (the
    /// message was not sent): the connection is again as it was then
    /// (`before`: passed earlier, to a process that ends it).
    pub fn unpass(&self, before: bool) {
        self.passed.store(before, Ordering::Relaxed);
    }

    /// Whether this end's descriptor went to another process
    /// ([`Conn::pass_export`]).
    pub fn is_passed(&self) -> bool {
        self.passed.load(Ordering::Relaxed)
    }

    /// The connection end that another process passed with
    /// [`Conn::pass_export`], on device `dev`, with its channel `chan`,
    /// between TCP addresses `local` and `peer`. Its DMB's table entry
    /// becomes this process's ([`Device::take_passed`]).
    pub fn pass_adopt(
        dev: &Device,
        parts: ExecParts,
        chan: OwnedFd,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> crate::Result<(Conn, Registration)> {
        let st = parts.state;
        let gid = dev.gid();
        let ok = |uid| dev.may_own_dmb(uid);
        let own = Dmb::adopt_own(parts.local.into(), st.local_token, gid, true, ok)?;
        let theirs = Dmb::adopt_peer(
            parts.peer.into(),
            st.peer_token,
            gid,
            st.peer_attach,
            true,
            ok,
        )?;
        let role = if st.client {
            Role::Client
        } else {
            Role::Server
        };
        let reg = dev.take_passed(st.entry, st.local_token, own.ring_len(), role)?;
        let c = Conn::resume(own, theirs, chan, &st, &reg)?;
        reg.set_connected(st.peer_token, local, peer, c.mode);
        Ok((c, reg))
    }

    /// The connection end that the image before exec passed with
    /// [`Conn::exec_export`], on device `dev`, with its channel `chan`,
    /// and its DMB table entry.
    pub fn exec_adopt(
        dev: &Device,
        parts: ExecParts,
        chan: OwnedFd,
    ) -> crate::Result<(Conn, Registration)> {
        let st = parts.state;
        let reg = dev
            .adopt_registration(st.entry, st.local_token, st.client)
            .ok_or(crate::error::AttachError::NotOurs)?;
        let gid = dev.gid();
        let ok = |uid| dev.may_own_dmb(uid);
        let local = Dmb::adopt_own(parts.local.into(), st.local_token, gid, st.forked, ok)?;
        let peer = Dmb::adopt_peer(
            parts.peer.into(),
            st.peer_token,
            gid,
            st.peer_attach,
            st.forked,
            ok,
        )?;
        let c = Conn::resume(local, peer, chan, &st, &reg)?;
        Ok((c, reg))
    }

    /// A connection end made again from its DMBs, channel and the state
    /// another image or process exported.
    fn resume(
        local: Dmb,
        peer: Dmb,
        chan: OwnedFd,
        st: &ExecState,
        reg: &Registration,
    ) -> crate::Result<Conn> {
        let mode = match st.sndbuf_len {
            0 => Mode::NoCopy,
            n => Mode::Copy { sndbuf_len: n },
        };
        let mut c = Conn::new(local, peer, UnixStream::from(chan), mode)?;
        // The exporting image or process may have shared the channel's
        // open file.
        c.share_file();
        c.set_record(reg.record());
        c.sent.store(st.sent, Ordering::Relaxed);
        c.received.store(st.received, Ordering::Relaxed);
        c.rx_owed.store(st.rx_owed, Ordering::Relaxed);
        c.rcv_timeo_us.store(st.rcv_timeo_us, Ordering::Relaxed);
        c.snd_timeo_us.store(st.snd_timeo_us, Ordering::Relaxed);
        c.cork.store(st.cork, Ordering::Relaxed);
        c.shut_wr.store(st.shut_wr, Ordering::Relaxed);
        c.err.store(st.err, Ordering::Relaxed);
        Ok(c)
    }
}
