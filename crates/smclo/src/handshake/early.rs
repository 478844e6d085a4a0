//! A client's early bytes: what a blocking client writes between its
//! `connect` and the server's answer (its first request, typically) goes
//! into the TCP stream, counted in the rendezvous slot
//! ([`SlotRef::add_early`](crate::rendezvous::SlotRef::add_early)). A
//! server that accepts moves them from its TCP socket into its own ring,
//! where its application finds them with the answer: the request costs
//! neither side a wait, as on TCP, where it travels with the connection.
//! A connection that stays TCP keeps them in its stream, where its server
//! reads them as from any TCP client; so does one whose client is killed
//! after its write returned. Nothing is lost or reordered either way: the
//! client counts before it sends, the server takes the count (no more is
//! counted after) before it decides, accepts only when that many bytes
//! are in its socket, copies them into its ring before its Accept (so the
//! client cannot have written there yet), and drops them from the stream
//! only after its message to the client went out: a client that died
//! before leaves a TCP connection whose stream still holds them.

use crate::dmb::Dmb;
use crate::ring;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a server that may wait (a blocking `accept`) waits for counted
/// early bytes to reach its socket: the client sends them right after
/// counting, and loopback delivers a send before it returns, unless the
/// client was descheduled in between (or is traced) or the kernel defers
/// the delivery. Past it, the server declines and the bytes stay TCP's.
/// An event loop's handshake step, which never waits on one client, gives
/// them the data path's spin budget instead ([`arrival_wait`]).
pub(super) const ARRIVAL_WAIT: Duration = Duration::from_millis(50);

/// How long [`arrived`] waits: [`ARRIVAL_WAIT`] if the caller `may_wait`,
/// else the data path's spin budget.
pub(super) fn arrival_wait(may_wait: bool) -> Duration {
    if may_wait {
        ARRIVAL_WAIT
    } else {
        crate::wait::spin_budget()
    }
}

/// How long the wait yields between looks before it sleeps between them.
const ARRIVAL_SPIN: Duration = Duration::from_micros(200);

/// Looks [`arrived`] takes at least, yielding between them, whatever the
/// wait (`SMCLO_SPIN_US=0` gives an event loop none): a client that has
/// just counted is about to send.
const MIN_LOOKS: u32 = 3;

/// The pause between two looks after [`ARRIVAL_SPIN`].
const ARRIVAL_NAP: Duration = Duration::from_micros(100);

/// Bytes waiting in the receive queue of TCP socket `fd` (`SIOCINQ`).
fn unread(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCINQ writes one c_int through the valid pointer.
    if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Whether the `n` early bytes a client has counted so far (not sealed)
/// are all in the receive queue of TCP socket `fd`: one look.
pub(super) fn counted_arrived(fd: RawFd, n: u32) -> bool {
    n == 0 || unread(fd).is_ok_and(|have| have >= n as usize)
}

/// Whether the `n` early bytes the client counted are in the receive queue
/// of TCP socket `fd`, waiting up to `wait` for them ([`arrival_wait`]).
pub(super) fn arrived(fd: RawFd, n: u32, wait: Duration) -> bool {
    let start = Instant::now();
    let mut looks = 0;
    loop {
        looks += 1;
        match unread(fd) {
            Ok(have) if have >= n as usize => return true,
            Ok(_) if looks < MIN_LOOKS || start.elapsed() < ARRIVAL_SPIN.min(wait) => {
                std::thread::yield_now()
            }
            Ok(_) if start.elapsed() < wait => std::thread::sleep(ARRIVAL_NAP),
            _ => return false,
        }
    }
}

/// Copies the `n` early bytes from TCP socket `fd` into the ring of our
/// DMB `local` at its start once they have all arrived (waiting up to
/// `wait`, as [`arrived`]), and publishes them, as if the client had
/// written them there: its writes follow them (the writer reads the
/// producer word), and our reader finds them at once. Whether they were
/// copied. The first look is the copy's own peek, so bytes that are there
/// already (the usual case) cost one system call. They stay in the socket
/// (`MSG_PEEK`) until [`consume`]: called while the slot is REPLYING,
/// before the client can write into the ring, and a handshake that then
/// ends in TCP leaves them in the stream.
///
/// No doorbell is counted: the client rings for what is still unread once
/// it follows our Accept (`Conn::early_published`), as a writer does when it
/// publishes. Until then only waits that look at the ring see the bytes.
pub(super) fn copy_arrived(fd: RawFd, local: &Dmb, n: u32, wait: Duration) -> bool {
    let mut buf = vec![0u8; n as usize];
    let peek_all = |buf: &mut [u8]| {
        let flags = libc::MSG_PEEK | libc::MSG_DONTWAIT;
        // SAFETY: peeks into the private buffer's `buf.len()` writable bytes.
        unsafe { recv_once(fd, buf.as_mut_ptr().cast(), buf.len(), flags) }
            .is_ok_and(|got| got == buf.len())
    };
    let peeked = peek_all(&mut buf) || (arrived(fd, n, wait) && peek_all(&mut buf));
    if !peeked {
        return false;
    }
    ring::copy_in(local, 0, &buf);
    // The ring is fresh (registration zeroes both words), so the producer
    // word is the count alone; Release orders the bytes before it.
    local.prod().store(u64::from(n), Ordering::Release);
    true
}

/// Drops from TCP socket `fd`'s stream the `n` early bytes that
/// [`copy_arrived`] put into our ring, once the connection is SMC-D: they now
/// travel through the ring. They are queued (peeked before), so this does
/// not wait; `MSG_TRUNC` discards them without a copy.
pub(super) fn consume(fd: RawFd, n: u32) -> io::Result<()> {
    let mut left = n as usize;
    while left > 0 {
        let flags = libc::MSG_TRUNC | libc::MSG_DONTWAIT;
        // SAFETY: MSG_TRUNC on a TCP socket discards without writing to the
        // (null) buffer.
        match unsafe { recv_once(fd, std::ptr::null_mut(), left, flags) }? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            r => left -= r.min(left),
        }
    }
    Ok(())
}

/// One `recv(2)` on TCP socket `fd`, made again if a signal interrupted it.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes, or `flags` must make the
/// kernel write none (`MSG_TRUNC`).
unsafe fn recv_once(
    fd: RawFd,
    buf: *mut libc::c_void,
    len: usize,
    flags: libc::c_int,
) -> io::Result<usize> {
    loop {
        // SAFETY: the caller vouches for `buf`.
        let r = unsafe { libc::recv(fd, buf, len, flags) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
