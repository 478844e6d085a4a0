//! One SMC-D connection end: a receive DMB the peer writes, the peer's DMB
//! we write, and the UNIX stream end that carries doorbells and is what
//! applications poll.
//!
//! Split by job as the kernel's SMC splits it: receiving (`rx`, with
//! `eof`, the end of file of a peer that died), sending (`tx`, with
//! corking), closing (`close`: orderly, abort, the sticky error), and the
//! calls' flags (`flags`); then how a call waits (`wait`: blocking mode,
//! timeouts, the spin), zero copy (`zcopy`), what an event loop asks
//! (`poll`) and what exec carries (`exec`). This file has the connection
//! itself: its state, its channel, its counters, its ring snapshots.
//!
//! Every cursor word is loaded from shared memory and validated
//! ([`smclo_wire::cursor`]) at each use; nothing about the rings is cached
//! in process memory, so a forked child that inherits the `Conn` keeps
//! working. An invalid word aborts the connection (`PEER_CONN_ABORT`,
//! channel shut down) and the call fails with `EPROTO`.
//!
//! # Threads
//!
//! One thread may read while another writes. Concurrent readers (or
//! concurrent writers) of one `Conn` in one process are serialised by a
//! mutex per direction. Concurrent readers or writers in *different*
//! processes (after `fork`) on the same direction are not supported: each
//! direction is single-producer, single-consumer.

use crate::chan_sys;
use crate::device::ConnRecord;
use crate::dmb::Dmb;
use crate::doorbell::{self, Snap};
use crate::wait::Budget;
use smclo_wire::cursor::CursorError;
use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

mod close;
mod eof;
mod exec;
mod flags;
mod poll;
mod rx;
mod tx;
mod wait;
mod zcopy;

pub use eof::EOF_LOOK_EVERY;
pub use exec::{ExecParts, ExecRefusal, ExecState};
pub use flags::{RecvFlags, SendFlags};
pub use tx::{allow_holding, forbid_holding};
pub use zcopy::{ReadRegion, WriteRegion};

pub use crate::device::Mode;
pub use crate::wait::spin_budget;

/// Takes a per-direction lock; a panic elsewhere does not poison the
/// connection (the lock guards no invariant of its own).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The result of a call that may have moved `done` bytes before `e`.
fn partial(done: usize, e: io::Error) -> io::Result<usize> {
    if done > 0 {
        Ok(done)
    } else {
        Err(e)
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// One end of an SMC-D connection.
pub struct Conn {
    local: Dmb,
    peer: Dmb,
    /// The descriptor of my end of the UNIX stream pair, owned (closed on
    /// drop), -1 once taken. Its number may change while the connection
    /// lives ([`Conn::replace_channel`]): the preload makes the
    /// application's own descriptor the channel.
    chan: AtomicI32,
    /// Calls using the channel's descriptor now ([`ChanUse`]).
    chan_users: AtomicU32,
    /// A number the Conn gave up while calls used it
    /// ([`Conn::retire_number`]), -1 for none: the last of them closes it.
    retired: AtomicI32,
    /// Held while `chan` counts against the descriptor budget
    /// ([`crate::fdnum`]): not while it is the application's descriptor.
    chan_held: Mutex<Option<crate::fdnum::Held>>,
    mode: Mode,
    /// Serialises readers; held across a [`ReadRegion`].
    rx: Mutex<()>,
    /// Serialises writers; holds the copy-mode send buffer, empty until a
    /// write needs it (`tx::staging`).
    tx: Mutex<Vec<u8>>,
    /// Sticky errno after this end aborted (EPROTO, ECONNABORTED).
    err: AtomicI32,
    /// The peer's UNIX end is gone (EOF or EPIPE seen): it died or closed.
    peer_gone: AtomicBool,
    /// `shutdown_write` was called here.
    shut_wr: AtomicBool,
    /// A write found the peer closed and was taken as TCP takes it (the
    /// peer's answer is a reset): the writes after it fail.
    reset_by_peer: AtomicBool,
    /// A call reported the error a reset left ([`Conn::take_error`]): as
    /// TCP clears its socket error, the calls after it do not see it.
    reset_reported: AtomicBool,
    /// `shutdown_read` was called here: reads return what is queued,
    /// then end of stream, and never wait.
    shut_rd: AtomicBool,
    /// `shutdown_both` shut the channel's reading too: its end of file and
    /// failed doorbells say nothing of the peer from then on.
    chan_rd_shut: AtomicBool,
    /// close/abort ran (so drop does not close again).
    closed: AtomicBool,
    /// The descriptor went to another process ([`Conn::pass_export`]),
    /// whose close ends the connection: this process's close sets no
    /// flag, and its mappings are neither pooled nor detached from.
    passed: AtomicBool,
    /// `O_NONBLOCK` of the descriptor as last set or read: the flag itself
    /// while `nb_own_gen` holds, else a hint checked against the
    /// descriptor before a call sleeps or returns WouldBlock.
    nb_hint: AtomicBool,
    /// The fork generation ([`crate::owner::fork_gen`]) in which the
    /// channel's open file description is this process's alone, so that
    /// no other process can change its `O_NONBLOCK`; 0 (no generation)
    /// once it may be shared ([`Conn::share_file`]).
    nb_own_gen: AtomicU64,
    /// A wait saw the channel ready in the kernel: the next read that finds
    /// nothing looks for end of file ([`Conn::kernel_ready`]).
    eof_due: AtomicBool,
    /// When data was last read or end of file last looked for
    /// ([`crate::clock::now_ns`]), 0 for never.
    looked_at: AtomicU64,
    /// Stats, counted by this process.
    sent: AtomicU64,
    received: AtomicU64,
    /// Sends, and reads that returned data, in this process, counted up to
    /// one past what a short connection makes ([`tally`]): whether the
    /// connection was short ([`Conn::was_short`]).
    sends: AtomicU32,
    reads: AtomicU32,
    /// This end's DMB table entry, when it has one: byte counts and close
    /// steps for `xfer_bytes` and `smclo ss`.
    record: Option<ConnRecord>,
    /// Adaptive spin budgets, per direction.
    rx_spin: Budget,
    tx_spin: Budget,
    /// Doorbells the reader un-counted that were not queued yet (the writer
    /// had counted them and not sent them): taken by a later call.
    rx_owed: AtomicU32,
    /// How long this connection's calls have waited, in all, for owed
    /// doorbells that did not come (nanoseconds): at most
    /// [`rx::OWED_WAIT`] over its life.
    owed_waited_ns: AtomicU64,
    /// Read and write timeouts, microseconds (0 = none).
    rcv_timeo_us: AtomicU64,
    snd_timeo_us: AtomicU64,
    /// `TCP_CORK`: writes are held (see [`Conn::send`]).
    cork: AtomicBool,
    /// Bytes written into the peer's ring past its published producer
    /// cursor and not published yet (corked). Changed only under `tx`.
    held: AtomicU32,
    /// When the first held byte was written ([`crate::clock::now_ns`]), 0 with none.
    held_at: AtomicU64,
    /// This process's pollers of the receive ring ([`doorbell::poll_begin`]).
    pollers: AtomicU64,
}

impl Conn {
    /// One end of an SMC-D connection: `local` = my receive DMB (the peer
    /// writes it), `peer` = the peer's DMB (I write into it), `chan` = my
    /// end of the UNIX stream pair with the peer (the readiness channel; its
    /// fd is what applications poll).
    pub fn new(local: Dmb, peer: Dmb, chan: UnixStream, mode: Mode) -> io::Result<Conn> {
        let fl = chan_sys::fcntl(chan.as_raw_fd(), libc::F_GETFL, 0);
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        Self::with_flags(local, peer, chan, mode, fl & libc::O_NONBLOCK != 0)
    }

    /// [`Conn::new`] on a channel known to block (the handshake's own: it
    /// made it so), which spares asking the descriptor.
    pub(crate) fn new_blocking(
        local: Dmb,
        peer: Dmb,
        chan: UnixStream,
        mode: Mode,
    ) -> io::Result<Conn> {
        Self::with_flags(local, peer, chan, mode, false)
    }

    fn with_flags(
        local: Dmb,
        peer: Dmb,
        chan: UnixStream,
        mode: Mode,
        nonblocking: bool,
    ) -> io::Result<Conn> {
        doorbell::set_min_sndbuf(chan.as_raw_fd())?;
        if mode == (Mode::Copy { sndbuf_len: 0 }) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "copy mode needs a send buffer",
            ));
        }
        Ok(Conn {
            nb_hint: AtomicBool::new(nonblocking),
            nb_own_gen: AtomicU64::new(crate::owner::fork_gen()),
            eof_due: AtomicBool::new(false),
            looked_at: AtomicU64::new(0),
            local,
            peer,
            chan: AtomicI32::new(chan.into_raw_fd()),
            chan_users: AtomicU32::new(0),
            retired: AtomicI32::new(-1),
            chan_held: Mutex::new(Some(crate::fdnum::Held::new())),
            mode,
            rx: Mutex::new(()),
            tx: Mutex::new(Vec::new()),
            err: AtomicI32::new(0),
            peer_gone: AtomicBool::new(false),
            shut_wr: AtomicBool::new(false),
            reset_by_peer: AtomicBool::new(false),
            reset_reported: AtomicBool::new(false),
            shut_rd: AtomicBool::new(false),
            chan_rd_shut: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            passed: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            sends: AtomicU32::new(0),
            reads: AtomicU32::new(0),
            record: None,
            rx_spin: Budget::new(),
            tx_spin: Budget::new(),
            rx_owed: AtomicU32::new(0),
            owed_waited_ns: AtomicU64::new(0),
            rcv_timeo_us: AtomicU64::new(0),
            snd_timeo_us: AtomicU64::new(0),
            cork: AtomicBool::new(false),
            held: AtomicU32::new(0),
            held_at: AtomicU64::new(0),
            pollers: AtomicU64::new(0),
        })
    }

    /// Counts this end's bytes and close steps into its DMB table entry
    /// (the handshake does, for every connection it establishes).
    pub fn set_record(&mut self, r: ConnRecord) {
        self.record = Some(r);
    }

    /// The client's `n` early bytes, which its server copied into its ring
    /// from the TCP stream (`handshake::early`) without a doorbell: counted
    /// as sent, and rung for if the server has not read them yet, so that
    /// its descriptor is readable as after any write.
    pub(crate) fn early_published(&self, n: u32) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.count_sent(n);
        let p = &self.peer;
        let bells = doorbell::ring_for_unread(p.prod(), p.cons(), p.ring_len())
            .map_err(|e| self.violation("send ring", e))?;
        self.send_bells(bells)
    }

    fn count_sent(&self, n: u32) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
        tally(&self.sends);
        if let Some(r) = &self.record {
            r.add_tx(n as u64);
        }
    }

    fn count_received(&self, n: usize) {
        self.received.fetch_add(n as u64, Ordering::Relaxed);
        tally(&self.reads);
        self.looked_at
            .store(crate::clock::now_ns(), Ordering::Relaxed);
        if let Some(r) = &self.record {
            r.add_rx(n as u64);
        }
    }

    fn record_flags(&self, f: u64) {
        if let Some(r) = &self.record {
            r.set_flags(f);
        }
    }

    /// The UNIX end: poll/epoll it (readable iff data or end of stream,
    /// writable iff the peer's ring has room).
    pub fn fd(&self) -> RawFd {
        self.chan.load(Ordering::Relaxed)
    }

    /// The channel, for one call; `EBADF` once taken. Every system call of
    /// the Conn on its channel goes through one: a number given up while it
    /// lives ([`Conn::retire_number`]) stays open until it ends.
    fn chan(&self) -> io::Result<ChanUse<'_>> {
        // SeqCst, with `retire_number`: a use counted after the retiring
        // thread looked at the count loads the new number.
        self.chan_users.fetch_add(1, Ordering::SeqCst);
        let u = ChanUse {
            conn: self,
            fd: self.chan.load(Ordering::SeqCst),
        };
        if u.fd < 0 {
            return Err(errno(libc::EBADF));
        }
        Ok(u)
    }

    /// Gives up the channel's number for `new`, another descriptor of it
    /// (counted against the descriptor budget), and closes the old number
    /// as soon as no call of this Conn uses it (now, or when the last of
    /// them ends: [`ChanUse`]'s drop), with [`crate::deferred`]'s closer.
    /// For the preload, when the application closes the number while other
    /// descriptors of it still name the connection: the number is free
    /// for the application's next `open`, and no call of this Conn ever
    /// reaches whatever the number names next. Returns `new` back when a
    /// number given up earlier is still open (the caller keeps the old
    /// one).
    pub fn retire_number(&self, new: OwnedFd) -> Result<(), OwnedFd> {
        if self.retired.load(Ordering::SeqCst) >= 0 {
            return Err(new);
        }
        self.count_channel(true);
        let old = self.chan.swap(new.into_raw_fd(), Ordering::SeqCst);
        self.retired.store(old, Ordering::SeqCst);
        if self.chan_users.load(Ordering::SeqCst) == 0 {
            self.close_retired();
        }
        Ok(())
    }

    /// In a fork child, before it returns from `fork`: the calls that used
    /// the channel at the fork were its parent's threads', which the child
    /// does not have, so a number given up meanwhile closes now instead of
    /// never.
    pub fn forked_child(&self) {
        self.chan_users.store(0, Ordering::SeqCst);
        self.close_retired();
    }

    /// Closes the number given up, if any and not closed yet.
    fn close_retired(&self) {
        let fd = self.retired.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // At the end of a call's use, which may read errno after it.
            crate::errno::kept(|| crate::deferred::close_now(fd));
        }
    }

    /// Makes `new`, another descriptor of the same channel (a `dup`), the
    /// one this Conn uses and owns, and returns the one it replaces. For a
    /// caller that moves the channel to another number (the preload moves
    /// it onto the application's descriptor, and away from a number the
    /// application reuses): it must make sure that no other thread is in a
    /// call on this Conn meanwhile, or that call may use the old number.
    /// `counted`: whether `new` counts against the descriptor budget
    /// ([`crate::fdnum`]); the application's own descriptor does not.
    pub fn replace_channel(&self, new: OwnedFd, counted: bool) -> OwnedFd {
        self.count_channel(counted);
        let old = self.chan.swap(new.into_raw_fd(), Ordering::AcqRel);
        // SAFETY: the Conn owned `old`; ownership passes to the caller.
        unsafe { OwnedFd::from_raw_fd(old) }
    }

    /// Whether the channel counts against the descriptor budget (see
    /// [`Conn::replace_channel`]): it does again once the application has
    /// let go of its number while the Conn still needs it.
    pub fn count_channel(&self, counted: bool) {
        let mut h = lock(&self.chan_held);
        if counted != h.is_some() {
            *h = counted.then(crate::fdnum::Held::new);
        }
    }

    /// Closes the channel's descriptor now (later calls fail with `EBADF`),
    /// with the system call itself: its number may be the application's,
    /// whose libc `close` an interposing library handles.
    pub fn close_channel(&self) {
        if let Some(fd) = self.take_channel() {
            chan_sys::close(fd.into_raw_fd());
        }
    }

    /// Takes the channel's descriptor out of the Conn (which no longer
    /// closes it), for a caller that closes it itself or finds it closed
    /// behind its back; later calls fail with `EBADF`. `None` if taken.
    pub fn take_channel(&self) -> Option<OwnedFd> {
        self.count_channel(false);
        let fd = self.chan.swap(-1, Ordering::AcqRel);
        // SAFETY: the Conn owned `fd`; ownership passes to the caller.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The transfer mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Bytes written by this process into the peer's ring.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes read by this process from the local ring.
    pub fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Whether what this process did on the connection makes it short
    /// ([`crate::short::is_short`]): a request or two, then closed.
    pub fn was_short(&self) -> bool {
        crate::short::is_short(
            self.sends.load(Ordering::Relaxed),
            self.reads.load(Ordering::Relaxed),
            self.bytes_sent() + self.bytes_received(),
        )
    }

    fn rx_snap(&self) -> io::Result<Snap> {
        let l = &self.local;
        doorbell::snapshot(l.prod(), l.cons(), l.ring_len())
            .map_err(|e| self.violation("receive ring", e))
    }

    fn tx_snap(&self) -> io::Result<Snap> {
        let p = &self.peer;
        doorbell::snapshot(p.prod(), p.cons(), p.ring_len())
            .map_err(|e| self.violation("send ring", e))
    }

    /// The send ring's snapshot and the room after what is written but
    /// held (corked), for the writer (the caller holds `tx`). The held
    /// bytes went into room the peer's `cons` had left, so together with
    /// the unread ones they fit the ring unless the peer moved `cons`
    /// back: a violation, not room of 4 GiB.
    fn tx_room(&self) -> io::Result<Room> {
        let snap = self.tx_snap()?;
        let held = self.held.load(Ordering::Relaxed);
        let ring_len = self.peer.ring_len();
        match ring_len
            .checked_sub(snap.used)
            .and_then(|f| f.checked_sub(held))
        {
            Some(free) => Ok(Room { snap, held, free }),
            None => Err(self.violation(
                "send ring",
                CursorError::HeldOverrun {
                    used: snap.used,
                    held,
                    ring_len,
                },
            )),
        }
    }
}

/// One call's use of the channel's descriptor ([`Conn::chan`]). While any
/// lives, a number the Conn gave up ([`Conn::retire_number`]) stays open;
/// the last to end closes it.
pub(crate) struct ChanUse<'a> {
    conn: &'a Conn,
    fd: RawFd,
}

impl ChanUse<'_> {
    /// The number, for a system call made while this lives.
    pub(crate) fn raw(&self) -> RawFd {
        self.fd
    }

    /// The descriptor, open while this lives.
    pub(crate) fn borrowed(&self) -> BorrowedFd<'_> {
        // SAFETY: `fd` is not -1 (see `Conn::chan`) and stays open while
        // this use lives: the Conn closes it only after it took it back
        // or gave it up and every use ended.
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }
}

impl Drop for ChanUse<'_> {
    fn drop(&mut self) {
        if self.conn.chan_users.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.conn.close_retired();
        }
    }
}

/// The send ring as its writer sees it ([`Conn::tx_room`]).
struct Room {
    snap: Snap,
    /// Written after the unread bytes and held (corked).
    held: u32,
    /// Room after the held bytes.
    free: u32,
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("fd", &self.fd())
            .field("local", &self.local)
            .field("peer", &self.peer)
            .field("mode", &self.mode)
            .finish()
    }
}

/// Counts one call in `c` until the count says the connection is not short
/// ([`crate::short::SHORT_CALLS`] + 1): beyond that, a load and no write on
/// the data path. Not a read-modify-write: a call counted by two threads
/// at once may be counted once, which only errs towards short by one.
fn tally(c: &AtomicU32) {
    let v = c.load(Ordering::Relaxed);
    if v <= crate::short::SHORT_CALLS {
        c.store(v + 1, Ordering::Relaxed);
    }
}
