//! One SMC-D connection end: a receive DMB the peer writes, the peer's DMB
//! we write, and the UNIX stream end that carries doorbells and is what
//! applications poll.
//!
//! # Data path
//!
//! - **Write** copies from the caller's buffer straight into the peer's ring
//!   at the producer position and publishes ([`doorbell::publish`]). In
//!   [`Mode::Copy`] it first copies into a private send buffer, like the
//!   kernel's copy mode; nothing stays in that buffer between calls.
//! - **Read** copies out of the local ring at the consumer position, stores
//!   the new consumer cursor and settles the doorbells.
//! - Zero copy: [`Conn::reserve`] / [`WriteRegion::commit`] and
//!   [`Conn::peek_region`] / [`ReadRegion::release`] hand out one region
//!   inside the ring (contiguous thanks to the double mapping), reached by
//!   copies or raw pointers only, never as a slice ([`crate::ring`]).
//!
//! Every cursor word is loaded from shared memory and validated
//! ([`smclo_wire::cursor`]) at each use; nothing about the rings is cached
//! in process memory, so a forked child that inherits the `Conn` keeps
//! working. An invalid word aborts the connection (`PEER_CONN_ABORT`,
//! channel shut down) and the call fails with `EPROTO`.
//!
//! # Waiting
//!
//! Blocking calls first busy-poll the cursor word (`SMCLO_SPIN_US`
//! microseconds at most, adaptive; the reader sets `READER_SPINNING` so the
//! writer can skip the doorbell syscall), then sleep in `poll(2)` on the
//! UNIX end. Whether a call blocks follows the descriptor's `O_NONBLOCK`
//! and `MSG_DONTWAIT`. The flag lives in the open file description, which
//! other processes may share; the `Conn` keeps it as last set through
//! [`Conn::set_nonblocking`] and trusts that copy while the description is
//! known to be this process's alone: made here, no `fork` since, not
//! passed on ([`Conn::share_file`]). Otherwise a call that cannot proceed
//! asks the descriptor (`F_GETFL`) before it sleeps or fails with `EAGAIN`.
//!
//! A peer that died without setting its closing flag (`kill -9`) shows only
//! as the channel's end of file. A non-blocking read that finds nothing
//! looks for it (`MSG_PEEK`) only when a wait saw the channel ready in the
//! kernel with no doorbell counted ([`Conn::kernel_ready`], which also
//! takes a hang-up as the death itself), or when neither data nor a look
//! came for [`EOF_LOOK_EVERY`]: a loop that reads until `EAGAIN` makes no
//! system call for it.
//!
//! A sleep ends, as a socket's does in the kernel, when a signal handler
//! runs (`EINTR`, [`io::ErrorKind::Interrupted`]; a handler that ran
//! during the call's spin ends the spin, and the call then fails the same
//! way instead of sleeping, see [`crate::signal`]) or when the direction's
//! timeout ([`Conn::set_read_timeout`], [`Conn::set_write_timeout`]: the
//! `SO_RCVTIMEO`/`SO_SNDTIMEO` of the socket, counted from the call's first
//! sleep) has passed (`EAGAIN`); a call that already moved bytes returns
//! their count instead. No lock is held while a call sleeps, so another
//! thread's non-blocking call on the same direction never waits behind it.
//!
//! # Closing (SMC semantics)
//!
//! - [`Conn::shutdown_write`]: `PEER_DONE_WRITING` in the peer's `prod`
//!   word, then `shutdown(SHUT_WR)`: the peer reads what was written, then 0.
//! - [`Conn::close`] (and drop): `PEER_CONN_CLOSED`, or `PEER_CONN_ABORT`
//!   when unread data remains in the local ring (the peer gets
//!   `ECONNRESET`, like a TCP RST), then the UNIX end is shut down and
//!   closed.
//! - Reading: data first; then 0 after done-writing/closed, `ECONNRESET`
//!   after abort or when the UNIX end hit end of file with no flag (the
//!   peer died). Writing after the peer closed, aborted or died: `EPIPE`
//!   (never a SIGPIPE: every send uses `MSG_NOSIGNAL`).
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
use crate::doorbell::{self, BellChannel, Block, Snap};
use crate::owner::Owner;
use crate::ring;
use crate::signal::Watch;
use crate::wait::{Budget, Ready};
use smclo_wire::cursor::{
    self, conn_state_flags, CursorError, PEER_CONN_ABORT, PEER_CONN_CLOSED, PEER_DONE_WRITING,
};
use smclo_wire::device_layout::end_flags;
use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod exec;
mod poll;

pub use exec::{ExecParts, ExecRefusal, ExecState};

pub use crate::device::Mode;
pub use crate::wait::spin_budget;

/// The longest a reader waits for doorbells of data it took that the
/// writer has not sent yet ([`Conn::take_owed`]), while the writer can run.
const OWED_WAIT: Duration = Duration::from_secs(1);

/// How often, in milliseconds, that wait looks whether the writer can
/// still run.
const OWED_RECHECK_MS: i32 = 5;

/// How long after the last data read (or the last look) a read that finds
/// nothing looks for the channel's end of file (a peer that died): as often
/// as a busy wait asks the kernel about its other descriptors.
pub const EOF_LOOK_EVERY: Duration = crate::wait::KERNEL_EVERY;

/// One call's sleeping: interruptible by signal handlers (those that run
/// in the sleep, and those that ran since the call began, in a spin:
/// [`crate::signal`]) and bounded by its direction's timeout, counted from
/// the first sleep.
struct Sleep {
    timeout: Option<Duration>,
    end: Option<Instant>,
    signals: Watch<'static>,
}

impl Sleep {
    /// The timeout in `us` (microseconds, 0 = none).
    fn new(us: &AtomicU64) -> Sleep {
        Sleep {
            timeout: match us.load(Ordering::Relaxed) {
                0 => None,
                us => Some(Duration::from_micros(us)),
            },
            end: None,
            signals: Watch::begin(None),
        }
    }

    /// Sleeps in `poll(2)` until `events` (or a hang-up) on `fd`; returns
    /// `revents` (0 when the timeout ran out, then the next call reports
    /// it). `EINTR` when a signal handler ran, `EAGAIN` after the timeout.
    fn poll(&mut self, fd: RawFd, events: i16) -> io::Result<i16> {
        self.signals.check()?;
        let ms = match self.timeout {
            None => -1,
            Some(t) => {
                let end = *self.end.get_or_insert_with(|| Instant::now() + t);
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(errno(libc::EAGAIN));
                }
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        if chan_sys::poll(std::slice::from_mut(&mut p), ms) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(p.revents)
    }
}

/// A timeout as stored: microseconds, 0 = none (so is a zero duration, as
/// for `SO_RCVTIMEO`).
fn timeout_us(t: Option<Duration>) -> u64 {
    t.map_or(0, |t| t.as_micros().min(u64::MAX as u128) as u64)
}

fn timeout_of(us: &AtomicU64) -> Option<Duration> {
    match us.load(Ordering::Relaxed) {
        0 => None,
        us => Some(Duration::from_micros(us)),
    }
}

/// Takes a per-direction lock; a panic elsewhere does not poison the
/// connection (the lock guards no invariant of its own).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a reader that found nothing to read does next.
enum RxNext {
    /// Something changed: look again.
    Retry,
    /// Sleep until the descriptor is readable.
    Sleep,
    /// The call must not wait.
    NoWait,
}

/// The result of a call that may have moved `done` bytes before `e`.
fn partial(done: usize, e: io::Error) -> io::Result<usize> {
    if done > 0 {
        Ok(done)
    } else {
        Err(e)
    }
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
    /// Held while `chan` counts against the descriptor budget
    /// ([`crate::fdnum`]): not while it is the application's descriptor.
    chan_held: Mutex<Option<crate::fdnum::Held>>,
    mode: Mode,
    /// Serialises readers; held across a [`ReadRegion`].
    rx: Mutex<()>,
    /// Serialises writers; holds the copy-mode send buffer.
    tx: Mutex<Vec<u8>>,
    /// Sticky errno after this end aborted (EPROTO, ECONNABORTED).
    err: AtomicI32,
    /// The peer's UNIX end is gone (EOF or EPIPE seen): it died or closed.
    peer_gone: AtomicBool,
    /// `shutdown_write` was called here.
    shut_wr: AtomicBool,
    /// close/abort ran (so drop does not close again).
    closed: AtomicBool,
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
    /// ([`mono_ns`]), 0 for never.
    looked_at: AtomicU64,
    /// Stats, counted by this process.
    sent: AtomicU64,
    received: AtomicU64,
    /// This end's DMB table entry, when it has one: byte counts and close
    /// steps for `xfer_bytes` and `smclo ss`.
    record: Option<ConnRecord>,
    /// Adaptive spin budgets, per direction.
    rx_spin: Budget,
    tx_spin: Budget,
    /// Doorbells the reader un-counted that were not queued yet (the writer
    /// had counted them and not sent them): taken by a later call.
    rx_owed: AtomicU32,
    /// Read and write timeouts, microseconds (0 = none).
    rcv_timeo_us: AtomicU64,
    snd_timeo_us: AtomicU64,
    /// `TCP_CORK`: writes are held (see [`Conn::send_more`]).
    cork: AtomicBool,
    /// Bytes written into the peer's ring past its published producer
    /// cursor and not published yet (corked). Changed only under `tx`.
    held: AtomicU32,
    /// When the first held byte was written ([`mono_ns`]), 0 with none.
    held_at: AtomicU64,
    /// This process's pollers of the receive ring ([`doorbell::poll_begin`]).
    pollers: AtomicU64,
}

/// Nanoseconds of a monotonic clock since the first call (never 0 after it).
fn mono_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
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
        let sndbuf = match mode {
            Mode::NoCopy => Vec::new(),
            Mode::Copy { sndbuf_len } => {
                if sndbuf_len == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "copy mode needs a send buffer",
                    ));
                }
                vec![0u8; sndbuf_len as usize]
            }
        };
        Ok(Conn {
            nb_hint: AtomicBool::new(nonblocking),
            nb_own_gen: AtomicU64::new(crate::owner::fork_gen()),
            eof_due: AtomicBool::new(false),
            looked_at: AtomicU64::new(0),
            local,
            peer,
            chan: AtomicI32::new(chan.into_raw_fd()),
            chan_held: Mutex::new(Some(crate::fdnum::Held::new())),
            mode,
            rx: Mutex::new(()),
            tx: Mutex::new(sndbuf),
            err: AtomicI32::new(0),
            peer_gone: AtomicBool::new(false),
            shut_wr: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            record: None,
            rx_spin: Budget::new(),
            tx_spin: Budget::new(),
            rx_owed: AtomicU32::new(0),
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
        if let Some(r) = &self.record {
            r.add_tx(n as u64);
        }
    }

    fn count_received(&self, n: usize) {
        self.received.fetch_add(n as u64, Ordering::Relaxed);
        self.looked_at.store(mono_ns(), Ordering::Relaxed);
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

    /// The channel, for one call; `EBADF` once taken.
    fn chan(&self) -> io::Result<BorrowedFd<'_>> {
        let fd = self.fd();
        if fd < 0 {
            return Err(errno(libc::EBADF));
        }
        // SAFETY: `fd` is not -1 and is open while the Conn owns it; a
        // caller that renumbers it ([`Conn::replace_channel`]) or takes it
        // ([`Conn::take_channel`]) guarantees that no call runs meanwhile.
        Ok(unsafe { BorrowedFd::borrow_raw(fd) })
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

    /// Sets `O_NONBLOCK` on the UNIX end, which decides whether calls block.
    /// The only way to change it while the descriptor is this process's
    /// alone: an `fcntl` on [`Conn::fd`] is not seen (the preload turns the
    /// application's `fcntl` and `ioctl(FIONBIO)` into this call).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        if self.nb_own_gen.load(Ordering::Relaxed) == crate::owner::fork_gen()
            && self.nb_hint.load(Ordering::Relaxed) == on
        {
            // The kept flag is the descriptor's, and already as asked (the
            // preload's swap of a blocking connection).
            return Ok(());
        }
        let fl = chan_sys::fcntl(self.fd(), libc::F_GETFL, 0);
        let nfl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        if fl < 0
            || (nfl != fl && chan_sys::fcntl(self.fd(), libc::F_SETFL, nfl as libc::c_long) < 0)
        {
            return Err(io::Error::last_os_error());
        }
        self.nb_hint.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Bounds how long a blocking read sleeps (`SO_RCVTIMEO`): after `t`
    /// it returns what it has, or `EAGAIN`. `None` or zero: no bound.
    pub fn set_read_timeout(&self, t: Option<Duration>) {
        self.rcv_timeo_us.store(timeout_us(t), Ordering::Relaxed);
    }

    /// Bounds how long a blocking write sleeps for room (`SO_SNDTIMEO`),
    /// as [`Conn::set_read_timeout`] does for reads.
    pub fn set_write_timeout(&self, t: Option<Duration>) {
        self.snd_timeo_us.store(timeout_us(t), Ordering::Relaxed);
    }

    /// The read timeout (`None`: reads may sleep for good).
    pub fn read_timeout(&self) -> Option<Duration> {
        timeout_of(&self.rcv_timeo_us)
    }

    /// The write timeout.
    pub fn write_timeout(&self) -> Option<Duration> {
        timeout_of(&self.snd_timeo_us)
    }

    /// The caller set `O_NONBLOCK` to `on` on the channel's open file
    /// itself (the preload forwards the application's `fcntl(F_SETFL)` and
    /// `ioctl(FIONBIO)`): the connection's copy follows, without asking.
    pub fn nonblocking_set(&self, on: bool) {
        self.nb_hint.store(on, Ordering::Relaxed);
    }

    /// The channel's open file description may be shared with another
    /// process from now on (its descriptor is sent with `SCM_RIGHTS`, or
    /// was inherited through exec), which may change its `O_NONBLOCK`
    /// unseen: calls that cannot proceed ask the descriptor from now on.
    /// (`fork` needs no call: it starts a new fork generation.)
    pub fn share_file(&self) {
        self.nb_own_gen.store(0, Ordering::Relaxed);
    }

    /// The descriptor's `O_NONBLOCK`: the kept flag while the open file
    /// description is this process's alone, else asked.
    fn nonblocking(&self) -> io::Result<bool> {
        if self.nb_own_gen.load(Ordering::Relaxed) == crate::owner::fork_gen() {
            return Ok(self.nb_hint.load(Ordering::Relaxed));
        }
        self.nonblocking_now()
    }

    /// The descriptor's `O_NONBLOCK` now (a syscall; refreshes the hint).
    fn nonblocking_now(&self) -> io::Result<bool> {
        let fl = chan_sys::fcntl(self.fd(), libc::F_GETFL, 0);
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        let nb = fl & libc::O_NONBLOCK != 0;
        self.nb_hint.store(nb, Ordering::Relaxed);
        Ok(nb)
    }

    /// Whether a call that cannot proceed must not wait: `MSG_DONTWAIT`,
    /// or the descriptor is non-blocking (a syscall only if the hint says
    /// so and the flag may be shared).
    fn must_not_wait(&self, dontwait: bool) -> io::Result<bool> {
        Ok(dontwait || (self.nb_hint.load(Ordering::Relaxed) && self.nonblocking()?))
    }

    /// Bytes written by this process into the peer's ring.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes read by this process from the local ring.
    pub fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    // ----- errors ---------------------------------------------------------

    fn sticky(&self) -> io::Result<()> {
        if crate::fault::any_lost() {
            self.reset_if_lost();
        }
        match self.err.load(Ordering::Relaxed) {
            0 => Ok(()),
            e => Err(errno(e)),
        }
    }

    /// Resets the connection (`ECONNRESET`, as a TCP RST) if this process
    /// lost the mapping of one of its DMBs or of its device: another
    /// process shrank the file under it ([`crate::fault`]).
    fn reset_if_lost(&self) {
        let what = if self.local.lost() {
            "its receive DMB"
        } else if self.peer.lost() {
            "the peer's DMB"
        } else if self.record.as_ref().is_some_and(|r| r.device_lost()) {
            "the device file"
        } else {
            return;
        };
        if self.err.load(Ordering::Relaxed) == 0 {
            crate::debug!(
                "connection reset: {what} was truncated or could not be paged in (another process of the device's users shrank it or punched a hole in it on a full filesystem)"
            );
            self.abort_with(libc::ECONNRESET);
        }
    }

    /// The peer broke the protocol: abort and report EPROTO.
    fn violation(&self, what: &str, e: CursorError) -> io::Error {
        crate::debug!("connection aborted: peer protocol violation ({what}): {e}");
        self.abort_with(libc::EPROTO);
        errno(libc::EPROTO)
    }

    fn abort_with(&self, err: i32) {
        let _ = self
            .err
            .compare_exchange(0, err, Ordering::Relaxed, Ordering::Relaxed);
        self.record_flags(end_flags::ABORTED);
        doorbell::set_state_flags(self.peer.prod(), PEER_CONN_ABORT);
        // The peer's end becomes readable and hung up, our blocked callers
        // wake.
        chan_sys::shutdown(self.fd(), libc::SHUT_RDWR);
        self.closed.store(true, Ordering::Relaxed);
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

    fn send_bells(&self, n: u32) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        match self.chan().and_then(|c| c.send_bells(n)) {
            Ok(()) => Ok(()),
            // The peer's end is gone: the data is in its ring, but nobody
            // will read it; the next write reports EPIPE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                Ok(())
            }
            // The data is in the peer's ring but its doorbell cannot be
            // queued: the peer broke the protocol, and no return value
            // would be true (the bytes were written, their bell is lost).
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                crate::debug!("connection aborted: peer does not take its doorbells");
                self.abort_with(libc::EPROTO);
                Err(errno(libc::EPROTO))
            }
            Err(e) => Err(e),
        }
    }

    /// Receives `n` doorbells the reader un-counted, and any owed before.
    fn recv_bells(&self, n: u32) -> io::Result<()> {
        if n > 0 {
            self.rx_owed.fetch_add(n, Ordering::Relaxed);
        }
        self.take_owed()
    }

    /// Takes the owed doorbells. One that the writer counted and has not
    /// sent yet (it is between its CAS and its send, perhaps preempted
    /// there) is waited for while the writer can still send it: sent after
    /// this call returned, it would make the descriptor readable with
    /// nothing to read, which a TCP socket never is (a level-triggered
    /// poller then reads and gets EAGAIN, which wrk counts as an error and
    /// answers by closing the connection). A writer that is neither
    /// running nor waiting for a CPU (stopped, frozen, asleep) may stay so
    /// for good: what it sent before it stopped running is taken, the rest
    /// stays owed and a later call takes it.
    fn take_owed(&self) -> io::Result<()> {
        let mut since = None;
        while self.take_queued_owed()? > 0 {
            let t0 = *since.get_or_insert_with(Instant::now);
            if t0.elapsed() >= OWED_WAIT {
                break;
            }
            if !self.writer_runnable() {
                // It may have sent the doorbell and gone to sleep since
                // the look at the queue.
                self.take_queued_owed()?;
                break;
            }
            doorbell::poll_fd(self.fd(), libc::POLLIN, OWED_RECHECK_MS)?;
        }
        Ok(())
    }

    /// Takes the owed doorbells that are queued by now; returns how many
    /// stay owed.
    fn take_queued_owed(&self) -> io::Result<u32> {
        if self.rx_owed.load(Ordering::Relaxed) == 0 {
            return Ok(0);
        }
        // Claimed whole, so two threads never take the same doorbell.
        let n = self.rx_owed.swap(0, Ordering::Relaxed);
        let got = match self.chan().and_then(|c| c.take_bells(n)) {
            Ok(Some(k)) => k,
            Ok(None) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                n
            }
            Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
                self.peer_gone.store(true, Ordering::Relaxed);
                n
            }
            Err(e) => {
                self.rx_owed.fetch_add(n, Ordering::Relaxed);
                return Err(e);
            }
        };
        self.rx_owed.fetch_add(n - got, Ordering::Relaxed);
        Ok(n - got)
    }

    /// Whether the process that writes into our ring (the owner of the
    /// peer's DMB) has a thread running or waiting for a CPU. Our own
    /// process is not judged: the calling thread is running whether or not
    /// another of ours is the writer (outside tests a peer is never this
    /// process: self-connects stay TCP). Nor is a peer of another pid
    /// namespace: its pid names another process here, whose start time
    /// differs.
    fn writer_runnable(&self) -> bool {
        let w = Owner::local(self.peer.owner_pid(), self.peer.owner_start());
        w.pid != Owner::current().pid && w.has_runnable_thread()
    }

    /// Whether a read that found nothing and must not wait looks for the
    /// channel's end of file now ([`Conn::chan_eof`], a system call): once
    /// after a wait saw the channel ready in the kernel, and when neither
    /// data nor a look came for [`EOF_LOOK_EVERY`]. A loop that reads until
    /// `EAGAIN` right after its data never looks while requests keep
    /// coming; a busy loop looks every [`EOF_LOOK_EVERY`].
    fn eof_look_due(&self) -> bool {
        let now = mono_ns();
        let at = self.looked_at.load(Ordering::Relaxed);
        let due = self.eof_due.load(Ordering::Relaxed)
            || at == 0
            || now.saturating_sub(at) >= EOF_LOOK_EVERY.as_nanos() as u64;
        if due {
            self.eof_due.store(false, Ordering::Relaxed);
            self.looked_at.store(now, Ordering::Relaxed);
        }
        due
    }

    /// A wait saw the channel ready in the kernel (`r`, as `poll(2)`
    /// reports it). A hang-up with no closing flag set is the peer's death
    /// (an honest peer sets its flag before it shuts its end down). Being
    /// readable with no doorbell counted (nothing in the ring explains it)
    /// makes the next read that finds nothing look for end of file.
    pub fn kernel_ready(&self, r: Ready) {
        let w = self.local.prod().load(Ordering::SeqCst);
        if r.intersects(Ready::HUP) && conn_state_flags(w) == 0 {
            self.peer_gone.store(true, Ordering::Relaxed);
        }
        let rung = cursor::bells(w) > 0 || cursor::prod_flags(w) & cursor::LOOSE_BELL != 0;
        if r.intersects(Ready::IN | Ready::HUP | Ready::ERR)
            && !rung
            && !self.eof_due.load(Ordering::Relaxed)
        {
            self.eof_due.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the UNIX end has reached end of file with nothing queued;
    /// then, if the peer set no closing flag before its end went away, it
    /// died: remember that.
    fn chan_eof(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: peeks at most one byte into `b`.
        let r = unsafe {
            chan_sys::recv(
                self.fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if r == 0 || (r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECONNRESET))
        {
            // An honest peer sets its flag before shutting its end down, so
            // the flag is visible now if there is one.
            if conn_state_flags(self.local.prod().load(Ordering::SeqCst)) == 0 {
                self.peer_gone.store(true, Ordering::Relaxed);
            }
            return true;
        }
        false
    }

    // ----- spinning -------------------------------------------------------

    /// Busy-polls `word` until it differs from `from`, the budget runs
    /// out or a signal handler runs (the sleep that follows then fails).
    /// The clock is read once per 32 loads.
    fn spin_on(word: &AtomicU64, from: u64, budget: Duration, signals: &Watch) -> bool {
        let moved = || {
            (0..32).any(|_| {
                let m = word.load(Ordering::Acquire) != from;
                if !m {
                    std::hint::spin_loop();
                }
                m
            })
        };
        crate::spin::until(budget, Some(signals), || moved().then_some(())).is_some()
    }

    /// Reader: spin until the local `prod` word changes. With `cap`, sets
    /// `READER_SPINNING` so small writes skip their doorbell; the caller
    /// must then consume up to `cap` bytes of whatever is there.
    fn rx_spin(&self, cap: Option<usize>, signals: &Watch) -> io::Result<()> {
        let budget = self.rx_spin.next();
        if budget.is_zero() {
            return Ok(());
        }
        let l = &self.local;
        let rs = match cap {
            Some(cap) => doorbell::spin_begin(l.prod(), l.cons(), l.ring_len(), cap)
                .map_err(|e| self.violation("receive ring", e))?,
            None => false,
        };
        let from = l.prod().load(Ordering::SeqCst);
        let hit = Self::spin_on(l.prod(), from, budget, signals);
        if rs {
            doorbell::spin_end(l.prod(), l.ring_len())
                .map_err(|e| self.violation("receive ring", e))?;
        }
        self.rx_spin.note(hit);
        Ok(())
    }

    /// Writer: spin until the peer's `cons` word moves (room appears).
    fn tx_spin(&self, signals: &Watch) -> bool {
        let budget = self.tx_spin.next();
        if budget.is_zero() {
            return false;
        }
        let c = self.peer.cons();
        let hit = Self::spin_on(c, c.load(Ordering::SeqCst), budget, signals);
        self.tx_spin.note(hit);
        hit
    }

    // ----- reading --------------------------------------------------------

    /// How long the next blocking read would spin before it sleeps (the
    /// adaptive budget; for tests and diagnostics).
    pub fn read_spin_budget(&self) -> Duration {
        self.rx_spin.next()
    }

    /// Reads into `buf`; honours blocking mode; 0 = end of stream.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf, false, false, false)
    }

    /// `recv(2)` with `MSG_PEEK`, `MSG_WAITALL` and `MSG_DONTWAIT`.
    pub fn recv(
        &self,
        buf: &mut [u8],
        peek: bool,
        waitall: bool,
        dontwait: bool,
    ) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut g = lock(&self.rx);
        let mut sleep = Sleep::new(&self.rcv_timeo_us);
        let l = &self.local;
        let len = l.ring_len();
        let mut done = 0usize;
        loop {
            if let Err(e) = self.sticky() {
                return partial(done, e);
            }
            let s = match self.rx_snap() {
                Ok(s) => s,
                Err(e) => return partial(done, e),
            };
            let flags = conn_state_flags(s.prod);
            // MSG_PEEK|MSG_WAITALL waits for the whole request (at most a
            // ring) to be there, like TCP.
            let enough = if peek && waitall {
                s.used as usize >= buf.len().min(len as usize)
            } else {
                s.used > 0
            };
            if enough || (s.used > 0 && (flags != 0 || self.peer_gone.load(Ordering::Relaxed))) {
                let n = (s.used as usize).min(buf.len() - done);
                let pos = cursor::Cursor::from_word(s.cons).position(len);
                ring::copy_out(l, pos, &mut buf[done..done + n]);
                if peek {
                    return Ok(n);
                }
                let take = doorbell::reader_consume(l.prod(), l.cons(), len, n as u32)
                    .map_err(|e| self.violation("receive ring", e))?;
                self.recv_bells(take)?;
                self.count_received(n);
                done += n;
                if done == buf.len() {
                    return Ok(done);
                }
                // Short so far: take whatever arrived meanwhile (see below).
                continue;
            }
            // Nothing (more) to read.
            if flags & PEER_CONN_ABORT != 0 {
                self.record_flags(end_flags::PEER_ABORTED);
                return if done > 0 {
                    Ok(done)
                } else {
                    Err(errno(libc::ECONNRESET))
                };
            }
            if flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 {
                return Ok(done);
            }
            if self.peer_gone.load(Ordering::Relaxed) {
                return if done > 0 {
                    Ok(done)
                } else {
                    Err(errno(libc::ECONNRESET))
                };
            }
            if done > 0 && !waitall {
                // A short read returns only here, with the ring empty: the
                // settle after the last copy found it empty too (only we
                // consume) and took the bell, so any later data rings anew
                // and wakes an edge-triggered poller. Data published while
                // we copied brings no bell of its own (one is queued); had
                // we returned short with it unread, a caller that waits for
                // the next edge after a short read (nginx does) would sleep
                // on a readable descriptor that never changes.
                return Ok(done);
            }
            if s.used == 0 {
                // A bell left over (e.g. the writer's post-check rang for
                // data we already took): take it so readiness is right.
                let take = doorbell::reader_settle(l.prod(), l.cons(), len)
                    .map_err(|e| self.violation("receive ring", e))?;
                self.recv_bells(take)?;
            }
            let cap = if peek { None } else { Some(buf.len() - done) };
            match self.rx_next(cap, dontwait, &sleep.signals)? {
                RxNext::Retry => continue,
                RxNext::Sleep => {
                    g = match self.rx_sleep(g, &mut sleep) {
                        Ok(g) => g,
                        Err(e) => return partial(done, e),
                    };
                    continue;
                }
                RxNext::NoWait => {}
            }
            if done == 0 && self.eof_look_due() && self.chan_eof() {
                // The peer's end is gone (or just closed): decide above.
                continue;
            }
            return if done > 0 {
                Ok(done)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
    }

    /// Reader, nothing to read: whether it must not wait (`MSG_DONTWAIT`
    /// or non-blocking), or, after spinning (up to `cap` bytes, see
    /// [`Conn::rx_spin`]), whether something changed or it must sleep.
    fn rx_next(&self, cap: Option<usize>, dontwait: bool, signals: &Watch) -> io::Result<RxNext> {
        if self.must_not_wait(dontwait)? {
            return Ok(RxNext::NoWait);
        }
        // Owed doorbells arriving must not make the sleep below end at once
        // and for ever: take what is there (the rest wakes it once).
        self.take_owed()?;
        self.rx_spin(cap, signals)?;
        // An event loop of this process may have the ring in its poll
        // session: the sleep below needs the writer's doorbell.
        self.poll_cancel()?;
        let s = self.rx_snap()?;
        if s.used > 0 || conn_state_flags(s.prod) != 0 {
            return Ok(RxNext::Retry);
        }
        if self.nonblocking()? {
            return Ok(RxNext::NoWait);
        }
        Ok(RxNext::Sleep)
    }

    /// Reader: sleeps until the descriptor is readable, with the reader
    /// lock released; returns it taken again.
    fn rx_sleep<'a>(
        &'a self,
        g: MutexGuard<'a, ()>,
        sleep: &mut Sleep,
    ) -> io::Result<MutexGuard<'a, ()>> {
        drop(g);
        let slept = Instant::now();
        let rev = sleep.poll(self.fd(), libc::POLLIN)?;
        let g = lock(&self.rx);
        if rev & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            let s = self.rx_snap()?;
            self.rx_spin.woken(s.used > 0, slept);
            if s.used == 0 && cursor::bells(s.prod) == 0 && conn_state_flags(s.prod) == 0 {
                // Readable with no bell counted: end of file (peer gone),
                // an owed bell that arrived (the next look takes it), or a
                // bell the writer is just now counting.
                if !self.chan_eof() {
                    std::thread::yield_now();
                }
            }
        }
        Ok(g)
    }

    /// Unread bytes in the local ring (`FIONREAD`). Like TCP, data that
    /// arrives after this wakes an edge-triggered poller even though the
    /// descriptor was readable already ([`doorbell::reader_report`]).
    pub fn readable_len(&self) -> io::Result<usize> {
        self.sticky()?;
        let l = &self.local;
        let (used, take) = doorbell::reader_report(l.prod(), l.cons(), l.ring_len())
            .map_err(|e| self.violation("receive ring", e))?;
        self.recv_bells(take)?;
        Ok(used as usize)
    }

    /// Received bytes in place (contiguous thanks to the double mapping);
    /// waits per blocking mode for at least one byte. An empty region means
    /// end of stream. [`ReadRegion::release`] consumes.
    pub fn peek_region(&self) -> io::Result<ReadRegion<'_>> {
        let mut g = lock(&self.rx);
        let mut sleep = Sleep::new(&self.rcv_timeo_us);
        let l = &self.local;
        loop {
            self.sticky()?;
            let s = self.rx_snap()?;
            let flags = conn_state_flags(s.prod);
            let pos = cursor::Cursor::from_word(s.cons).position(l.ring_len());
            let eof =
                flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED) != 0 && flags & PEER_CONN_ABORT == 0;
            if s.used > 0 || eof {
                return Ok(ReadRegion {
                    conn: self,
                    _g: g,
                    ptr: ring::ptr_at(l, pos),
                    len: s.used as usize,
                });
            }
            if flags & PEER_CONN_ABORT != 0 {
                self.record_flags(end_flags::PEER_ABORTED);
            }
            if flags & PEER_CONN_ABORT != 0 || self.peer_gone.load(Ordering::Relaxed) {
                return Err(errno(libc::ECONNRESET));
            }
            let take = doorbell::reader_settle(l.prod(), l.cons(), l.ring_len())
                .map_err(|e| self.violation("receive ring", e))?;
            self.recv_bells(take)?;
            match self.rx_next(None, false, &sleep.signals)? {
                RxNext::Retry => continue,
                RxNext::Sleep => {
                    g = self.rx_sleep(g, &mut sleep)?;
                    continue;
                }
                RxNext::NoWait => {}
            }
            if self.eof_look_due() && self.chan_eof() {
                continue;
            }
            return Err(io::ErrorKind::WouldBlock.into());
        }
    }

    // ----- writing --------------------------------------------------------

    /// Checks that writing is still allowed.
    fn tx_allowed(&self) -> io::Result<()> {
        self.sticky()?;
        if self.shut_wr.load(Ordering::Relaxed) || self.closed.load(Ordering::Relaxed) {
            return Err(errno(libc::EPIPE));
        }
        // The peer's own flags (about its writing side) are in our local
        // `prod` word; closed or aborted means it reads no more.
        let w = self.local.prod().load(Ordering::SeqCst);
        if conn_state_flags(w) & PEER_CONN_ABORT != 0 {
            self.record_flags(end_flags::PEER_ABORTED);
        }
        if conn_state_flags(w) & (PEER_CONN_CLOSED | PEER_CONN_ABORT) != 0
            || self.peer_gone.load(Ordering::Relaxed)
        {
            return Err(errno(libc::EPIPE));
        }
        Ok(())
    }

    /// Writes `buf`; a blocking write returns when all of it is in the
    /// peer's ring, a non-blocking one writes what fits.
    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf, false)
    }

    /// `send(2)` with `MSG_DONTWAIT`.
    pub fn send(&self, buf: &[u8], dontwait: bool) -> io::Result<usize> {
        self.send_more(buf, dontwait, false)
    }

    /// `send(2)` with `MSG_DONTWAIT` and `MSG_MORE`: with `more`, or while
    /// corked ([`Conn::set_cork`]), the bytes go into the peer's ring but
    /// are published (and rung) only when a later write is not held, on
    /// [`Conn::flush`], when held and unread bytes reach half the ring, or
    /// when the ring is full, as the kernel's SMC corks: one wake-up and
    /// one read for a response written in pieces.
    pub fn send_more(&self, buf: &[u8], dontwait: bool, more: bool) -> io::Result<usize> {
        if buf.is_empty() {
            if !more && !self.cork.load(Ordering::Relaxed) {
                self.flush()?;
            }
            return Ok(0);
        }
        let mut g = lock(&self.tx);
        let mut sleep = Sleep::new(&self.snd_timeo_us);
        let p = &self.peer;
        let len = p.ring_len();
        let mut done = 0usize;
        loop {
            let s = match self.tx_allowed().and_then(|()| self.tx_snap()) {
                Ok(s) => s,
                Err(e) => return partial(done, e),
            };
            let held = self.held.load(Ordering::Relaxed);
            let free = (len - s.used - held) as usize;
            if free > 0 {
                let src = &buf[done..];
                let mut n = free.min(src.len());
                let pos = cursor::Cursor::from_word(s.prod).position(len) + held as u64;
                match self.mode {
                    Mode::NoCopy => ring::copy_in(p, pos, &src[..n]),
                    Mode::Copy { .. } => {
                        n = n.min(g.len());
                        g[..n].copy_from_slice(&src[..n]);
                        ring::copy_in(p, pos, &g[..n]);
                    }
                }
                self.add_written(s.used, n as u32, more)?;
                done += n;
                if done == buf.len() {
                    return Ok(done);
                }
                continue;
            }
            // Full: what is held must reach the reader, or it never frees room.
            if let Err(e) = self.publish_held(0) {
                return partial(done, e);
            }
            g = match self.wait_room(g, 1, dontwait, &mut sleep) {
                Ok(g) => g,
                Err(e) => return partial(done, e),
            };
        }
    }

    /// Accounts `n` bytes just written after the held ones (the caller holds
    /// `tx`; `used` is the published unread count): held while corked and
    /// the ring is less than half full, else published with what was held.
    fn add_written(&self, used: u32, n: u32, more: bool) -> io::Result<()> {
        self.count_sent(n);
        let held = self.held.load(Ordering::Relaxed);
        let hold = more || self.cork.load(Ordering::Relaxed);
        if hold && used + held + n < self.peer.ring_len() / 2 {
            if held == 0 {
                self.held_at.store(mono_ns(), Ordering::Relaxed);
            }
            self.held.store(held + n, Ordering::Relaxed);
            return Ok(());
        }
        self.publish_held(n)
    }

    /// Publishes the held bytes and `n` more written after them, and rings
    /// the doorbell the protocol asks for. The caller holds `tx`.
    fn publish_held(&self, n: u32) -> io::Result<()> {
        let total = self.held.swap(0, Ordering::Relaxed) + n;
        self.held_at.store(0, Ordering::Relaxed);
        if total == 0 {
            return Ok(());
        }
        let p = &self.peer;
        let bells = doorbell::publish(p.prod(), p.cons(), p.ring_len(), total)
            .map_err(|e| self.violation("send ring", e))?;
        self.send_bells(bells)
    }

    /// Publishes whatever corking holds (`MSG_MORE` then nothing more, or
    /// `TCP_NODELAY` set as TCP pushes then).
    pub fn flush(&self) -> io::Result<()> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let _g = lock(&self.tx);
        self.publish_held(0)
    }

    /// `TCP_CORK`: while on, writes are held as with `MSG_MORE`; turning it
    /// off publishes them.
    pub fn set_cork(&self, on: bool) -> io::Result<()> {
        self.cork.store(on, Ordering::Relaxed);
        if on {
            return Ok(());
        }
        self.flush()
    }

    /// Whether `TCP_CORK` is on.
    pub fn corked(&self) -> bool {
        self.cork.load(Ordering::Relaxed)
    }

    /// Publishes held bytes written at least `age` ago; returns how long
    /// until the oldest held byte is that old, if some are held and younger
    /// (TCP's ceiling on corking: a caller that never uncorks still gets
    /// its bytes delivered, by whoever calls this on a timer).
    pub fn flush_older(&self, age: Duration) -> io::Result<Option<Duration>> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return Ok(None);
        }
        let _g = lock(&self.tx);
        let at = self.held_at.load(Ordering::Relaxed);
        if at == 0 {
            return Ok(None);
        }
        let waited = Duration::from_nanos(mono_ns().saturating_sub(at));
        if waited < age {
            return Ok(Some(age - waited));
        }
        self.publish_held(0).map(|()| None)
    }

    /// Whether written bytes are held (corked) now.
    pub fn holding(&self) -> bool {
        self.held.load(Ordering::Relaxed) > 0
    }

    /// Waits per blocking mode until `need` bytes are free in the peer's
    /// ring (or something changed), sleeping with the writer lock `g`
    /// released; returns it taken again. Non-blocking: arms the doorbells
    /// so the descriptor is unwritable, then WouldBlock.
    fn wait_room<'a>(
        &'a self,
        g: MutexGuard<'a, Vec<u8>>,
        need: u32,
        dontwait: bool,
        sleep: &mut Sleep,
    ) -> io::Result<MutexGuard<'a, Vec<u8>>> {
        let p = &self.peer;
        let mut nonblocking = self.must_not_wait(dontwait)?;
        if !nonblocking && self.tx_spin(&sleep.signals) {
            return Ok(g);
        }
        // About to arm the doorbells and sleep: check the flag.
        nonblocking = nonblocking || self.nonblocking()?;
        match doorbell::writer_block(p.prod(), p.cons(), p.ring_len(), need)
            .map_err(|e| self.violation("send ring", e))?
        {
            Block::Room => Ok(g),
            Block::Wait { send } => {
                self.send_bells(send)?;
                if nonblocking {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                drop(g);
                let slept = Instant::now();
                let rev = sleep.poll(self.fd(), libc::POLLOUT)?;
                let g = lock(&self.tx);
                if rev & libc::POLLOUT != 0 {
                    let room = self.tx_snap()?.used < p.ring_len();
                    self.tx_spin.woken(room, slept);
                }
                if rev & (libc::POLLHUP | libc::POLLERR) != 0 {
                    // Our end is hung up: the peer closed or died (or we
                    // shut down both ways); tx_allowed decides.
                    let s = self.tx_snap()?;
                    if s.used == p.ring_len() {
                        self.peer_gone.store(true, Ordering::Relaxed);
                    }
                }
                Ok(g)
            }
        }
    }

    /// A contiguous writable region inside the PEER's ring of at least
    /// `min` bytes (all the free space; `min` at most the ring length).
    /// Waits per blocking mode, or WouldBlock. Nothing is sent until
    /// [`WriteRegion::commit`].
    pub fn reserve(&self, min: usize) -> io::Result<WriteRegion<'_>> {
        let p = &self.peer;
        let len = p.ring_len();
        if min > len as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("reserve({min}) exceeds the {len}-byte ring"),
            ));
        }
        let need = min.max(1) as u32;
        let mut g = lock(&self.tx);
        let mut sleep = Sleep::new(&self.snd_timeo_us);
        loop {
            self.tx_allowed()?;
            let s = self.tx_snap()?;
            let held = self.held.load(Ordering::Relaxed);
            let free = len - s.used - held;
            if free >= need {
                let pos = cursor::Cursor::from_word(s.prod).position(len) + held as u64;
                return Ok(WriteRegion {
                    conn: self,
                    _g: g,
                    ptr: ring::ptr_at(p, pos),
                    len: free as usize,
                    used: s.used,
                });
            }
            self.publish_held(0)?;
            g = self.wait_room(g, need, false, &mut sleep)?;
        }
    }

    // ----- closing --------------------------------------------------------

    /// SHUT_WR: the peer reads what was written, then end of stream.
    pub fn shutdown_write(&self) -> io::Result<()> {
        self.sticky()?;
        if self.shut_wr.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        // Held bytes come before the end of stream.
        self.flush()?;
        // Recorded before the peer can see it, so that `smclo ss` never
        // shows the peer's reaction without our step.
        let peer_closing = conn_state_flags(self.local.prod().load(Ordering::Acquire)) != 0;
        self.record_flags(if peer_closing {
            end_flags::SHUT_WR | end_flags::SHUT_WR_PASSIVE
        } else {
            end_flags::SHUT_WR
        });
        doorbell::set_state_flags(self.peer.prod(), PEER_DONE_WRITING);
        // The peer's descriptor becomes readable for good (end of file on
        // the channel), so it wakes and finds the flag.
        if chan_sys::shutdown(self.fd(), libc::SHUT_WR) < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Closes: `PEER_CONN_CLOSED`, or `PEER_CONN_ABORT` if unread data
    /// remains in the local ring (the peer then sees ECONNRESET).
    pub fn close(self) -> io::Result<()> {
        self.close_inner();
        Ok(())
    }

    fn close_inner(&self) {
        if self.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        // An orderly close delivers what corking held; an error here means
        // the connection is broken already and the flag below tells so.
        let _ = self.flush();
        let l = &self.local;
        let unread = match doorbell::snapshot(l.prod(), l.cons(), l.ring_len()) {
            Ok(s) => s.used > 0,
            Err(_) => true,
        };
        let (flag, record) = if unread {
            (PEER_CONN_ABORT, end_flags::ABORTED)
        } else {
            (PEER_CONN_CLOSED, end_flags::CLOSED)
        };
        self.record_flags(record);
        doorbell::set_state_flags(self.peer.prod(), flag);
        // The peer's end hangs up even if a forked child still holds a copy
        // of ours.
        chan_sys::shutdown(self.fd(), libc::SHUT_RDWR);
    }

    /// [`Conn::close`] through a shared reference, for a caller that cannot
    /// take the `Conn` back while other threads may still hold it (the
    /// preload closes the last descriptor of a connection this way): sets
    /// `PEER_CONN_CLOSED` (or `PEER_CONN_ABORT`) and shuts the channel down
    /// now; drop later only unmaps and closes the descriptor.
    pub fn close_shared(&self) {
        self.close_inner();
    }

    /// Gives up this process's share of the connection without telling the
    /// peer: another process that inherited it through `fork` still uses it.
    /// Drop then unmaps and closes the descriptor and sets no flag.
    pub fn disown(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Immediate abort (like `SO_LINGER` 0): the peer sees ECONNRESET; this
    /// end's later calls fail with ECONNABORTED.
    pub fn abort(&self) {
        crate::debug!("connection aborted locally");
        self.abort_silently();
    }

    /// [`Conn::abort`] without the debug line: async-signal-safe (atomics
    /// and `shutdown`), for a process that exits from a signal handler.
    pub fn abort_silently(&self) {
        self.abort_with(libc::ECONNABORTED);
    }
}

impl Drop for Conn {
    /// Dropping without `close` closes; then the channel's descriptor goes.
    fn drop(&mut self) {
        self.close_inner();
        self.close_channel();
    }
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

/// Free space in the peer's ring, writable in place. Holds the writer lock.
///
/// The bytes are memory the peer maps, so the region is never a `&mut [u8]`
/// (see [`crate::ring`]): fill it with [`copy_from_slice`](Self::copy_from_slice),
/// or through [`as_mut_ptr`](Self::as_mut_ptr) under its contract.
///
/// ```compile_fail
/// fn fill(c: &smclo::testing::conn::Conn) {
///     let mut w = c.reserve(1).unwrap();
///     let bytes: &mut [u8] = &mut w; // no slice of the peer's memory
///     bytes[0] = 1;
/// }
/// ```
pub struct WriteRegion<'a> {
    conn: &'a Conn,
    _g: MutexGuard<'a, Vec<u8>>,
    ptr: *mut u8,
    len: usize,
    /// Published unread bytes when reserved (for corking).
    used: u32,
}

impl WriteRegion<'_> {
    /// Size of the region in bytes (all the free space).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no room (never, for a reserved region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into the region at `offset`. Panics if it does not fit
    /// (`offset + src.len() > len()`), like slice indexing.
    pub fn copy_from_slice(&mut self, offset: usize, src: &[u8]) {
        check_span(offset, src.len(), self.len);
        // SAFETY: `offset + src.len() <= len` (checked), and the region's
        // `len` bytes from `ptr` are mapped ring memory that no reference
        // covers (`ring` module docs).
        unsafe { ring::copy_to_shared(self.ptr.add(offset), src) };
    }

    /// The start of the region, for writing in place (e.g. handing it to
    /// `read(2)`), valid for [`len`](Self::len) bytes until the region is
    /// committed or dropped.
    ///
    /// Contract: the bytes are shared with the peer. Write them through raw
    /// pointers or system calls only, never through a `&mut [u8]` made from
    /// this pointer; do not read them back expecting what you wrote (a
    /// misbehaving peer may change them before [`commit`](Self::commit)).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Publishes the first `n` bytes of the region (`n <= len`).
    pub fn commit(self, n: usize) -> io::Result<()> {
        if n > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "commit beyond the reserved region",
            ));
        }
        if n == 0 {
            return Ok(());
        }
        // Held while corked, like a write (the region starts after them).
        self.conn.add_written(self.used, n as u32, false)
    }
}

/// Received bytes in place. Holds the reader lock.
///
/// The bytes are in the local ring below the producer cursor, which an
/// honest peer does not write until we release them; a misbehaving one can.
/// So the region is never a `&[u8]` (see [`crate::ring`]): copy out of it
/// with [`copy_to_slice`](Self::copy_to_slice), or read through
/// [`as_ptr`](Self::as_ptr) under its contract.
///
/// ```compile_fail
/// fn first(c: &smclo::testing::conn::Conn) -> u8 {
///     let r = c.peek_region().unwrap();
///     let bytes: &[u8] = &r; // no slice of memory the peer can write
///     bytes[0]
/// }
/// ```
pub struct ReadRegion<'a> {
    conn: &'a Conn,
    _g: MutexGuard<'a, ()>,
    ptr: *const u8,
    len: usize,
}

impl ReadRegion<'_> {
    /// Number of received bytes in the region (0 at end of stream).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty: end of stream.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    /// Panics if they are not all in it (`offset + dst.len() > len()`).
    pub fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) {
        check_span(offset, dst.len(), self.len);
        // SAFETY: `offset + dst.len() <= len` (checked), and the region's
        // `len` bytes from `ptr` are mapped ring memory that no reference
        // covers (`ring` module docs).
        unsafe { ring::copy_from_shared(self.ptr.add(offset), dst) };
    }

    /// The start of the received bytes, for reading in place, valid for
    /// [`len`](Self::len) bytes until the region is released or dropped.
    ///
    /// Contract: the bytes are shared with the peer. Read them through raw
    /// pointers or system calls only, never through a `&[u8]` made from
    /// this pointer, and read each byte once: a misbehaving peer can change
    /// them between two reads, so copy what you check before checking it.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Consumes the first `n` bytes (`n <= len`).
    pub fn release(self, n: usize) -> io::Result<()> {
        if n > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "release beyond the received region",
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let c = self.conn;
        let l = &c.local;
        let take = doorbell::reader_consume(l.prod(), l.cons(), l.ring_len(), n as u32)
            .map_err(|e| c.violation("receive ring", e))?;
        c.recv_bells(take)?;
        c.count_received(n);
        Ok(())
    }
}

/// Panics unless `offset .. offset + n` lies within a region of `len` bytes.
fn check_span(offset: usize, n: usize, len: usize) {
    assert!(
        offset.checked_add(n).is_some_and(|end| end <= len),
        "bytes {offset}..{offset}+{n} are outside the {len}-byte region"
    );
}
