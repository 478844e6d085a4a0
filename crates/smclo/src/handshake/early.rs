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
//! counted after) before it decides, and accepts only when that many bytes
//! are in its socket.

use crate::dmb::Dmb;
use crate::ring;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long the server waits for counted early bytes to reach its socket:
/// the client sends them right after counting, and loopback delivers a
/// send before it returns, unless the client was descheduled in between
/// (or is traced) or the kernel defers the delivery. Past it, the server
/// declines and the bytes stay TCP's.
const ARRIVAL_WAIT: Duration = Duration::from_millis(50);

/// How long the wait yields between looks before it sleeps between them.
const ARRIVAL_SPIN: Duration = Duration::from_micros(200);

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

/// Whether the `n` early bytes the client counted are in the receive queue
/// of TCP socket `fd`, waiting up to [`ARRIVAL_WAIT`] for them.
pub(super) fn arrived(fd: RawFd, n: u32) -> bool {
    let start = Instant::now();
    loop {
        match unread(fd) {
            Ok(have) if have >= n as usize => return true,
            Ok(_) if start.elapsed() < ARRIVAL_SPIN => std::thread::yield_now(),
            Ok(_) if start.elapsed() < ARRIVAL_WAIT => std::thread::sleep(ARRIVAL_NAP),
            _ => return false,
        }
    }
}

/// Moves the `n` early bytes ([`arrived`]) from TCP socket `fd` into the
/// ring of our DMB `local` at its start and publishes them, as if the
/// client had written them there: its writes follow them (the writer reads
/// the producer word), and our reader finds them at once.
pub(super) fn take_into(fd: RawFd, local: &Dmb, n: u32) -> io::Result<()> {
    let mut buf = vec![0u8; n as usize];
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: receives into the private buffer's `rest.len()` writable bytes.
        let r = unsafe { libc::recv(fd, rest.as_mut_ptr().cast(), rest.len(), libc::MSG_DONTWAIT) };
        match r {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            r if r > 0 => got += r as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    ring::copy_in(local, 0, &buf);
    // The ring is fresh (registration zeroes both words), so the producer
    // word is the count alone; Release orders the bytes before it.
    local.prod().store(u64::from(n), Ordering::Release);
    Ok(())
}
