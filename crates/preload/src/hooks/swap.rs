//! The swap: once the handshake says SMC-D, the application's descriptor
//! becomes the connection's UNIX channel itself (the handshake's
//! descriptor of it is closed), so poll, epoll and select work natively,
//! while the TCP socket stays open at a hidden descriptor for identity and
//! options. Also the other end of that life: what happens when the
//! application's number stops being the channel, and when the last
//! descriptor of a connection in this process is gone.

use super::LIVE;
use crate::hints::{self, Hint};
use crate::holders;
use crate::real;
use crate::table::{Connecting, Sock, LOCK};
use libc::{c_int, c_void, socklen_t};
use smclo::adapter::conn::Conn;
use smclo::adapter::handshake::Established;
use smclo::debug;
use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Makes `fd` the connection's channel (its readiness is the connection's,
/// see docs/ARCHITECTURE.md "Readiness"): the TCP socket moves to a hidden
/// descriptor, epoll registrations move with the number, and the Conn
/// owns `fd` from then on (the application's `close` of it goes through
/// [`crate::table::Sock`]'s drop). On failure both sides had already committed to SMC-D,
/// so the connection is reset at both ends ([`abort_both`]). A swap puts
/// nothing at `fd` if, under the table's lock, the number no longer holds
/// what the handshake began on (`holder`: closed or replaced meanwhile,
/// perhaps given out again): the connection ends instead. Returns the
/// connection installed at `fd`.
pub(super) fn swap_in(
    fd: RawFd,
    est: Established,
    slot: usize,
    nonblock: bool,
    cloexec: bool,
    holder: Holder<'_>,
) -> Option<Arc<Sock>> {
    let Established {
        conn,
        registration,
        syn_mark,
    } = est;
    // A high number keeps the hidden socket out of the application's way
    // (smclo::adapter::fdnum, like the channel and the DMB memfd); where there is
    // none, any free number will do (it is `Internal`).
    let tcp = match smclo::adapter::fdnum::dup_high(fd) {
        Ok(t) => t.into_raw_fd(),
        Err(e) => {
            abort_both(
                fd,
                &conn,
                slot,
                format_args!("cannot hide the TCP socket ({e})"),
            );
            return None;
        }
    };
    if let Err(e) = conn.set_nonblocking(nonblock) {
        abort_both(
            fd,
            &conn,
            slot,
            format_args!("O_NONBLOCK on the channel failed ({e})"),
        );
        // SAFETY: our own duplicate.
        unsafe { real::close(tcp) };
        return None;
    }
    // SO_RCVTIMEO/SO_SNDTIMEO set before the connection (or inherited
    // from the listener) apply to it; a socket of our socket() has none
    // unless the application set them.
    if !hints::hinted(fd, Hint::Tcp) || hints::hinted(fd, Hint::Timeo) {
        copy_timeouts(tcp, &conn);
    }
    let inq = (!hints::hinted(fd, Hint::Tcp) || hints::hinted(fd, Hint::Inq)) && inq_set(tcp);
    let chan = conn.fd();
    let sock = Arc::new(Sock {
        conn,
        reg: registration,
        tcp,
        syn_mark,
        fds: AtomicUsize::new(0),
        linger0: Default::default(),
        inq: AtomicBool::new(inq),
        slot,
        cork_armed: Default::default(),
        _held: smclo::adapter::fdnum::Held::new(),
        learn: Default::default(),
        calls: Default::default(),
    });
    let g = LOCK.write();
    if !holder.holds_locked(fd) {
        drop(g);
        holders::forget(slot);
        debug!("fd {fd}: closed while its SMC-D connection was swapped in; the connection ends");
        // Dropping `sock` closes the channel and `tcp`, a duplicate of
        // whatever the number named when it was made.
        return None;
    }
    super::state::internal_locked(tcp);
    let recs = super::state::take_epoll_locked(fd);
    // Remove the registrations while `fd` still names the TCP file: after
    // dup3 they could no longer be named, and the hidden duplicate keeps
    // that file (and so its registrations) alive.
    for (ep, _) in &recs {
        // SAFETY: plain epoll_ctl DEL with valid descriptors.
        unsafe { real::epoll_ctl(*ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    // The real descriptor is always close-on-exec; the application's view
    // is kept in the table (see exec below).
    // SAFETY: both descriptors are open; dup3 atomically replaces `fd`.
    let r = unsafe { real::dup3(chan, fd, libc::O_CLOEXEC) };
    if r < 0 {
        let e = io::Error::last_os_error();
        for (ep, mut ev) in recs {
            // SAFETY: re-adds the registration we removed.
            unsafe { real::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        }
        drop(g);
        abort_both(fd, &sock.conn, slot, format_args!("dup3 failed ({e})"));
        return None; // dropping `sock` closes `tcp`
    }
    // SAFETY: dup3 made `fd` a descriptor of the channel; the application
    // reaches it only through our hooks, which leave its closing to the
    // Conn from now on.
    let at_fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let handshake_chan = sock.conn.replace_channel(at_fd, false);
    // The registrations are the channel's and in the sets' shadows before
    // the number names the connection: another thread's epoll_ctl of it
    // then finds them where the connection's registrations are.
    for (ep, mut ev) in recs {
        // SAFETY: `fd` is now the channel; same events and data.
        if unsafe { real::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            debug!(
                "fd {fd}: moving an epoll registration failed: {}",
                io::Error::last_os_error()
            );
        } else {
            super::epoll::adopt_locked(ep, fd, ev, &sock);
            debug!("fd {fd}: epoll registration in epfd {ep} moved to the SMC-D channel");
        }
    }
    // Not pending any more, in the same step as it names the connection:
    // a registration made after it is not taken for a pending connect's.
    super::state::install_locked(fd, &sock, cloexec);
    drop(g);
    drop(handshake_chan);
    LIVE.fetch_add(1, Ordering::Relaxed);
    debug!(
        "fd {fd}: SMC-D (the descriptor is the channel, hidden TCP fd {tcp}, {}, {})",
        if nonblock { "non-blocking" } else { "blocking" },
        match sock.conn.mode() {
            smclo::adapter::conn::Mode::NoCopy => "no-copy",
            smclo::adapter::conn::Mode::Copy { .. } => "copy mode",
        }
    );
    Some(sock)
}

/// The swap of `fd` failed after both sides committed to SMC-D: the peer
/// already reads and writes the shared rings, and nobody reads the TCP
/// stream behind `fd`. A clean close would show the peer a clean end of
/// stream and let the local program write into that void, so both ends
/// see a reset instead: `PEER_CONN_ABORT` on the connection (the peer gets
/// `ECONNRESET`), and the TCP connection is disconnected with a RST
/// (`connect(AF_UNSPEC)`): the local program's next call on `fd` fails
/// with `ECONNRESET`, its pollers see an error.
fn abort_both(
    fd: RawFd,
    conn: &smclo::adapter::conn::Conn,
    slot: usize,
    why: std::fmt::Arguments<'_>,
) {
    debug!("fd {fd}: {why} after the handshake; connection reset at both ends");
    conn.abort();
    holders::forget(slot);
    // (Our own connect hook passes an AF_UNSPEC connect straight through.)
    if let Err(e) = smclo::adapter::tcp_syn::reset(fd) {
        debug!("fd {fd}: resetting the TCP connection failed: {e}");
    }
}

/// What a swap's number must still hold when the connection is swapped in.
pub(super) enum Holder<'a> {
    /// A pending handshake's number: still `Pending` with this handshake.
    Pending(&'a Arc<Connecting>),
    /// A number a call held across its handshake (a blocking connect):
    /// not forgotten since [`crate::table::forgotten`] said this count.
    Held(u32),
    /// A number just accepted, not the program's yet: nobody else has it.
    Fresh,
}

impl Holder<'_> {
    /// A number the calling thread holds from now on.
    pub(super) fn held(fd: RawFd) -> Holder<'static> {
        Holder::Held(crate::table::forgotten(fd))
    }

    /// Whether `fd` still holds it (with the table's lock).
    fn holds_locked(&self, fd: RawFd) -> bool {
        match self {
            Holder::Pending(c) => super::state::is_current_locked(fd, c),
            Holder::Held(n) => crate::table::forgotten(fd) == *n,
            Holder::Fresh => true,
        }
    }
}

/// `n`, the number of `s`'s channel, is about to name something else (a
/// `dup2` onto it, the TCP socket at exec): the channel moves to a high
/// duplicate, `Internal` and counted against the budget, and the
/// number is left to the caller, whose `dup3` replaces it atomically.
/// Call with the write lock held. Another thread in a call on `s` may
/// still use `n` for a moment, as it would after a close of the number it
/// passed. Without a free descriptor the Conn gives its channel up instead
/// (its calls fail, and the peer sees the channel hang up once `n` is
/// replaced).
pub(super) fn move_channel_away(s: &Sock, n: RawFd) {
    match smclo::adapter::fdnum::dup_high(n) {
        Ok(high) => {
            super::state::internal_locked(high.as_raw_fd());
            // Listed while both numbers are the channel's.
            holders::renumber(s.slot, n, high.as_raw_fd());
            let _ = s.conn.replace_channel(high, true).into_raw_fd();
        }
        Err(e) => {
            debug!("fd {n}: no descriptor to keep the SMC-D channel in ({e}); it is given up");
            let _ = s.conn.take_channel().map(IntoRawFd::into_raw_fd);
        }
    }
}

/// A fresh descriptor number from the kernel: whatever we remembered about
/// that number belongs to a descriptor closed behind our back (libuv, for
/// one, closes with a raw system call).
pub(super) fn clear_stale(fd: RawFd) {
    if !super::in_table_range(fd) || super::state::unknown(fd) {
        return;
    }
    let g = LOCK.write();
    let mut forgotten = super::state::forget_fresh_locked(fd);
    let old = forgotten.sock.take();
    drop(g);
    drop(forgotten);
    if let Some(s) = old {
        debug!("fd {fd}: was closed without close(); forgetting its SMC-D connection");
        release(s);
    }
}

/// One application descriptor of `sock` is gone: when it was the last one
/// in this process, this process's share of the connection ends, at once
/// or, while calls of other threads use it, when the last of them returns
/// ([`InCall`]).
pub(super) fn release(sock: Arc<Sock>) {
    if sock.fds.fetch_sub(1, Ordering::AcqRel) == 1 {
        end_when_unused(sock);
    }
}

/// The connection of a call in progress on descriptor `fd` (a read, a
/// write, a poll), counted in [`Sock::calls`] until the call returns. A
/// `close` of the connection's last descriptor meanwhile (by another
/// thread) does not end it under the call: as Linux keeps a socket that a
/// call in progress holds, a `recv` blocked on it goes on, gets what the
/// peer sends, and the peer sees the end of stream when it returns.
pub(super) struct InCall {
    sock: Arc<Sock>,
    /// For a call counted in [`Sock::calls`] ([`THREADS`]), this thread's
    /// count of calls in progress ([`OWN_CALLS`]); `None` for one not
    /// counted (a close by another thread can only wait for those).
    own: Option<OwnCalls>,
}

thread_local! {
    /// How many calls of this thread use a connection now ([`InCall`]),
    /// so that a `close` by the thread itself never waits for them: one
    /// made by a signal handler that interrupted a `recv` of the thread
    /// (Linux ends the socket; the `recv`, restarted, finds the number
    /// closed), or after a handler left such a call with `siglongjmp`
    /// (whose count is never given back: the thread's closes then end
    /// their connections at once, as before calls were counted).
    /// Constant-initialised, without destructor.
    static OWN_CALLS: Cell<u32> = const { Cell::new(0) };
}

/// This thread's [`OWN_CALLS`], reached again at a call's end without a
/// second thread-local lookup.
struct OwnCalls(*const Cell<u32>);

impl OwnCalls {
    fn begin() -> OwnCalls {
        OWN_CALLS.with(|c| {
            c.set(c.get() + 1);
            OwnCalls(c)
        })
    }
}

impl Drop for OwnCalls {
    fn drop(&mut self) {
        // SAFETY: `OWN_CALLS` is constant-initialised and has no
        // destructor, so its storage lives as long as the thread that took
        // this pointer; the raw pointer makes `OwnCalls` (and `InCall`)
        // neither `Send` nor `Sync`, so only that thread uses it.
        let c = unsafe { &*self.0 };
        c.set(c.get().saturating_sub(1));
    }
}

/// A call on `s` could not proceed (`e`, `EAGAIN`), which asked the
/// descriptor for `O_NONBLOCK` if the open file may be shared. After a
/// `fork`, once the rest of the family let go of the connection (a
/// prefork server's parent closes its copy), the flag is this process's
/// to know again: the next read that finds nothing asks no `fcntl`.
pub(super) fn after_would_block(s: &Sock, e: &io::Error) {
    // Only with one thread: another's `F_SETFL` between this look and the
    // ownership would be lost for good.
    if e.kind() == io::ErrorKind::WouldBlock
        && !THREADS.load(Ordering::Relaxed)
        && s.conn.file_shared_in_family()
        && holders::alone(s.slot)
    {
        let _ = s.conn.own_file_again();
    }
}

/// The connection of descriptor `fd` for the call now beginning.
#[inline]
pub(super) fn in_call(fd: RawFd) -> Option<InCall> {
    let counted = THREADS.load(Ordering::Relaxed);
    // Before the lookup: a signal handler that runs when the lookup lets
    // the program's signals in again, and closes the connection, finds the
    // thread's call its own (and ends the connection at once).
    let own = counted.then(OwnCalls::begin);
    let sock = crate::table::get_for(fd, counted)?;
    Some(InCall { sock, own })
}

impl std::ops::Deref for InCall {
    type Target = Arc<Sock>;
    fn deref(&self) -> &Arc<Sock> {
        &self.sock
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        if self.own.is_some() && self.sock.calls.end() {
            if let Some(s) = deferred::take(&self.sock) {
                // The call's own errno is what the program reads.
                smclo::adapter::errno::kept(|| last_close(&s));
            }
        }
    }
}

/// Whether the process may have more than one thread (it called
/// `pthread_create`): only then can a close come while another thread's
/// call uses the connection, so only then are calls counted (two atomic
/// operations each). A thread the process made without `pthread_create`
/// (a raw `clone`) goes unseen: a close beside its calls ends the
/// connection at once.
static THREADS: AtomicBool = AtomicBool::new(false);

/// A thread is being made: calls are counted from now on.
pub(super) fn threads_started() {
    THREADS.store(true, Ordering::Relaxed);
}

/// Set while the process ends every connection (exit, exec): a close
/// then ends its connection at once, as the calls' threads do not
/// outlive the process image.
static ENDING_ALL: AtomicBool = AtomicBool::new(false);

/// The last descriptor of `sock` is gone: its end now, or, while calls
/// of other threads use it and there is room to remember it, when the
/// last one returns. Not while the closing thread has calls of its own
/// in progress ([`OWN_CALLS`]).
fn end_when_unused(sock: Arc<Sock>) {
    let own = OWN_CALLS.with(Cell::get) > 0;
    if !own && !ENDING_ALL.load(Ordering::Acquire) && sock.calls.in_use() && deferred::put(&sock) {
        if sock.calls.end_after() && !ENDING_ALL.load(Ordering::SeqCst) {
            debug!(
                "SMC-D connection (channel fd {}): its last descriptor closed while calls of other threads use it; it ends when they return",
                sock.conn.fd()
            );
            return;
        }
        // Exit or exec began meanwhile (its `take_all` may have missed the
        // entry), or the calls returned, each before the flag.
        if deferred::take(&sock).is_none() {
            return; // exit or exec ended it
        }
    }
    last_close(&sock);
}

/// Exit and exec: the connections whose end waited for calls in progress
/// end now, as their sockets would (those calls' threads do not outlive
/// the process image), and so do those closed from now on, until
/// [`end_all_undone`].
pub(super) fn end_all() {
    ENDING_ALL.store(true, Ordering::SeqCst);
    deferred::take_all(|s| last_close(&s));
}

/// The exec failed: closes wait for calls in progress again.
pub(super) fn end_all_undone() {
    ENDING_ALL.store(false, Ordering::Release);
}

/// [`end_all`]'s end of the deferred connections, at `_exit`, perhaps in
/// a signal handler: only async-signal-safe work, nothing freed.
pub(super) fn end_deferred_at_exit() {
    deferred::take_all(|s| {
        end_share(&s);
        std::mem::forget(s);
    });
}

/// A fork child: the connections closed before the fork are not its own
/// (none of its descriptors names them, and its parent ends them), so its
/// copies go without a word to the peer.
pub(super) fn forget_deferred_in_child() {
    deferred::take_all(|s| {
        forget_calls_in_child(&s);
        s.conn.disown();
    });
    // The child's one thread is the one that forked.
    THREADS.store(false, Ordering::Relaxed);
}

/// A fork child's copy of `s`: the calls counted on it are the parent's
/// other threads', which do not run in the child, and the counted
/// pointers their [`InCall`]s held are given back, so that the child's
/// copy of the connection (its channel's descriptor) goes when the child
/// lets go of it, not at its exit. If this thread had calls of its own in
/// progress (a fork from a signal handler), which of the counted calls
/// are its own is not known: the pointers stay, as its calls end them.
pub(super) fn forget_calls_in_child(s: &Arc<Sock>) {
    let counted = s.calls.forked_child();
    if OWN_CALLS.with(Cell::get) != 0 {
        return;
    }
    for _ in 0..counted {
        // SAFETY: each counted call is an `InCall` holding a count of `s`,
        // taken with the call's count under the table's lock and dropped
        // only after it (`InCall::drop` ends the call first). The fork's
        // prepare handler held that lock, so the copied memory has at
        // least `counted` such counts, all of other threads (this one has
        // no call in progress), which no thread of the child drops. `s` is
        // one more count, so the value outlives the loop.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(s)) };
    }
}

/// The connections whose end waits for calls in progress
/// ([`end_when_unused`]): a fixed table of counted pointers, so that exit,
/// exec and `_exit` (in a signal handler) can end them without a lock or
/// an allocation. Each entry is taken by exactly one swap to null.
pub(super) mod deferred {
    use crate::table::Sock;
    use std::sync::atomic::{AtomicPtr, Ordering};
    use std::sync::Arc;

    /// More than this many connections closed under calls at once end at
    /// their close, as before (the calls then fail with the reset).
    const ROOM: usize = 16;

    static WAITING: [AtomicPtr<Sock>; ROOM] =
        [const { AtomicPtr::new(std::ptr::null_mut()) }; ROOM];

    /// Remembers `s`; false when there is no room.
    pub(in crate::hooks) fn put(s: &Arc<Sock>) -> bool {
        let p = Arc::into_raw(s.clone()) as *mut Sock;
        for w in &WAITING {
            if w.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return true;
            }
        }
        // SAFETY: the count `into_raw` made above, which no entry took.
        drop(unsafe { Arc::from_raw(p) });
        false
    }

    /// Takes `s` back, if it is still remembered (not taken by exit).
    pub(in crate::hooks) fn take(s: &Arc<Sock>) -> Option<Arc<Sock>> {
        let p = Arc::as_ptr(s) as *mut Sock;
        let w = WAITING.iter().find(|w| w.load(Ordering::Acquire) == p)?;
        w.compare_exchange(p, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            // SAFETY: the entry held the count `put` made; the swap to null
            // gave it to us alone.
            .map(|p| unsafe { Arc::from_raw(p) })
    }

    /// Takes every remembered connection, for `each` (exit and exec end
    /// them; a fork child forgets them). Async-signal-safe: atomics only,
    /// and the counts taken are leaked, not dropped, unless `each` drops
    /// them.
    pub(in crate::hooks) fn take_all(mut each: impl FnMut(Arc<Sock>)) {
        for w in &WAITING {
            let p = w.swap(std::ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: as in `take`.
                each(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

/// The last descriptor of a connection in this process is gone.
fn last_close(s: &Sock) {
    LIVE.fetch_sub(1, Ordering::Relaxed);
    match end_share(s) {
        Ending::Disowned(pid) => {
            debug!(
                "SMC-D connection (channel fd {}) stays open: process {pid} still holds it",
                s.conn.fd()
            );
            // The DMB's table entry (and so the stats: dmbs_cnt, the bytes
            // this end sends) goes with the connection to the holder that
            // stays, if it is ours to give.
            if let Some(to) = smclo::adapter::owner::Owner::of(pid) {
                s.reg.hand_over(to);
            }
        }
        Ending::Aborted => debug!(
            "SMC-D connection (channel fd {}) aborted (SO_LINGER 0)",
            s.conn.fd()
        ),
        Ending::Passed => debug!(
            "SMC-D connection (channel fd {}) let go: the process it was passed to ends it",
            s.conn.fd()
        ),
        Ending::Closed => {}
    }
}

/// How [`end_share`] ended this process's share of a connection.
pub(crate) enum Ending {
    /// Another process of the family (this pid) still holds it.
    Disowned(u32),
    /// Reset (`SO_LINGER` 0): the peer reads `ECONNRESET`.
    Aborted,
    /// Its descriptor went to another process (`SCM_RIGHTS`), which ends
    /// it: nothing is said to the peer, whatever `SO_LINGER` says (it
    /// applies to the last close, as a socket's).
    Passed,
    /// Closed as the kernel closes a socket (a reset if unread data remains).
    Closed,
}

/// Ends this process's share of `s`: the close flags to the peer, unless
/// another process still holds the connection. Async-signal-safe (atomics
/// and raw system calls, no allocation, no lock), so that `_exit` can use
/// it from a signal handler.
pub(crate) fn end_share(s: &Sock) -> Ending {
    if s.conn.is_passed() {
        s.conn.disown();
        Ending::Passed
    } else if let Some(pid) = holders::leave(s.slot, s.conn.fd()) {
        s.conn.disown();
        Ending::Disowned(pid)
    } else if s.linger0.load(Ordering::Relaxed) {
        s.conn.abort_silently();
        Ending::Aborted
    } else {
        s.conn.close_shared();
        Ending::Closed
    }
}

/// A `SO_RCVTIMEO`/`SO_SNDTIMEO` value (the kernel validated it already).
pub(super) fn timeval_dur(val: *const c_void, len: socklen_t) -> Option<Duration> {
    if val.is_null() || (len as usize) < std::mem::size_of::<libc::timeval>() {
        return None;
    }
    // SAFETY: checked length; read_unaligned for application buffers.
    let tv = unsafe { std::ptr::read_unaligned(val as *const libc::timeval) };
    Some(Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec as u64))
}

/// Socket `fd`'s timeout option `name` (`SO_RCVTIMEO`, `SO_SNDTIMEO`;
/// zero when none is set), `None` if it cannot be read.
pub(super) fn socket_timeout(fd: RawFd, name: c_int) -> Option<Option<Duration>> {
    // SAFETY: an all-zero timeval is valid.
    let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
    let p: *mut libc::timeval = &mut tv;
    // SAFETY: getsockopt writes at most `len` bytes into `tv`.
    let rc = unsafe { real::getsockopt(fd, libc::SOL_SOCKET, name, p.cast(), &mut len) };
    (rc == 0).then(|| timeval_dur(p.cast(), len))
}

/// Whether `TCP_INQ` is on for the TCP socket `tcp`.
pub(super) fn inq_set(tcp: RawFd) -> bool {
    super::sockopt_int_at(tcp, libc::IPPROTO_TCP, libc::TCP_INQ).is_some_and(|v| v != 0)
}

/// Gives `conn` the timeouts of the TCP socket `tcp`.
pub(super) fn copy_timeouts(tcp: RawFd, conn: &Conn) {
    for (name, set) in [
        (libc::SO_RCVTIMEO, Conn::set_read_timeout as fn(&Conn, _)),
        (libc::SO_SNDTIMEO, Conn::set_write_timeout),
    ] {
        if let Some(t) = socket_timeout(tcp, name) {
            set(conn, t);
        }
    }
}

/// Tells the ledger of short connections ([`smclo::adapter::short`]) how
/// the client connection `s` to `dest` went, when it ends.
pub(super) fn learn(s: &Sock, c: &super::Ctx, dest: std::net::SocketAddr) {
    if c.cfg.short == smclo::config::Short::Learn {
        let _ = s.learn.set(dest);
    }
}
