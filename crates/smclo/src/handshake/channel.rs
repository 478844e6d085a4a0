//! The handshake's plumbing: the address of the client's rendezvous UNIX
//! socket (by path or abstract name) and the server's named connection to
//! it, the one-byte messages with a descriptor (`SCM_RIGHTS`) exchanged on
//! that channel, and the bounded waits for it to become readable.

use super::{HandshakeError, PeerMisbehaved};
use crate::access::Shape;
use crate::device::Device;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Bit of the rendezvous nonce saying "abstract socket". The client's
/// rendezvous socket is a path in the device directory (`u-<nonce>`) when
/// the listener is in another network namespace: pathname sockets are
/// reachable from any namespace that sees the directory. In the listener's
/// own namespace it is an abstract socket (`\0smclo-<gid>-u-<nonce>`), one
/// per process (see [`super::listener`]). An abstract
/// socket, unlike the device directory, is reachable by every uid in the
/// namespace, so both ends check the other's credentials
/// ([`crate::access::check_peer`]) before passing a descriptor; its name is
/// taken before the nonce is published.
pub(super) const ABSTRACT_NONCE: u64 = 1 << 63;

/// How long the server waits for room in a client's rendezvous backlog
/// ([`RendezvousAddr::connect_within`]).
pub(super) const CONNECT_BOUND: Duration = Duration::from_millis(100);

/// Where the client's rendezvous socket is, from the nonce.
pub(super) enum RendezvousAddr {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

impl RendezvousAddr {
    pub(super) fn new(dev: &Device, nonce: u64) -> RendezvousAddr {
        if nonce & ABSTRACT_NONCE != 0 {
            RendezvousAddr::Abstract(
                format!("smclo-{:016x}-u-{nonce:016x}", dev.gid()).into_bytes(),
            )
        } else {
            RendezvousAddr::Path(dev.dir().join(format!("u-{nonce:016x}")))
        }
    }

    /// The socket address, and its length as `connect` takes it.
    fn sockaddr(&self) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: all-zero bytes are a valid sockaddr_un.
        let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        // An abstract name follows a NUL byte and has none at its end; a
        // path has one at its end (the zeroed tail).
        let (lead, name, tail): (usize, &[u8], usize) = match self {
            RendezvousAddr::Path(p) => (0, p.as_os_str().as_bytes(), 1),
            RendezvousAddr::Abstract(n) => (1, n, 0),
        };
        if lead + name.len() + tail > sa.sun_path.len() {
            return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        }
        for (d, s) in sa.sun_path[lead..].iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + lead + name.len() + tail;
        Ok((sa, len as libc::socklen_t))
    }

    /// Connects to the client's rendezvous socket from a socket named for
    /// the proposal named `token` ([`server_name`]), waiting at most
    /// `bound` for room in its backlog, and checks that its owner may share
    /// the device of shape `shape` with us.
    ///
    /// The backlog is full only when others flood the socket (its one
    /// legitimate caller is the client's server), and a flooded client must
    /// not stall its server's `accept`: it gets `Timeout` instead.
    pub(super) fn connect_within(
        &self,
        bound: Duration,
        shape: &Shape,
        gid: u64,
        token: u64,
    ) -> Result<UnixStream, HandshakeError> {
        let (sa, len) = self.sockaddr().map_err(HandshakeError::Io)?;
        let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        let fd = crate::fdnum::internal(|| crate::chan_sys::socket(libc::AF_UNIX, flags, 0));
        if fd < 0 {
            return Err(HandshakeError::Io(io::Error::last_os_error()));
        }
        // SAFETY: `fd` is the fresh socket above, owned by nothing else.
        let s = unsafe { UnixStream::from_raw_fd(fd) };
        bind_abstract(fd, &server_name(gid, token)).map_err(HandshakeError::Io)?;
        // Non-blocking, a connect with room in the backlog completes at
        // once; only a full backlog needs the bounded blocking connect.
        match connect_raw(fd, &sa, len) {
            Ok(()) => blocking(fd)?,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                blocking(fd)?;
                connect_bounded(&s, &sa, len, bound)?;
            }
            Err(e) => return Err(connect_error(e)),
        }
        check_peer(fd, shape)?;
        Ok(s)
    }
}

/// Clears `O_NONBLOCK` of our socket `fd`.
fn blocking(fd: RawFd) -> Result<(), HandshakeError> {
    if crate::chan_sys::set_nonblocking(fd, false) == 0 {
        Ok(())
    } else {
        Err(HandshakeError::Io(io::Error::last_os_error()))
    }
}

/// `connect(2)` of `fd` to the first `len` bytes of `sa`.
fn connect_raw(fd: RawFd, sa: &libc::sockaddr_un, len: libc::socklen_t) -> io::Result<()> {
    let rc = crate::chan_sys::connect_unix(fd, sa, len);
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What a failed connect to the client's rendezvous socket means.
fn connect_error(e: io::Error) -> HandshakeError {
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EINTR) => HandshakeError::Timeout,
        Some(libc::ENOENT | libc::ECONNREFUSED) => HandshakeError::PeerGone,
        _ => HandshakeError::Io(e),
    }
}

/// A blocking connect of `s` that waits at most `bound` for room in the
/// listener's backlog (`SO_SNDTIMEO`; the kernel then fails it with EAGAIN).
fn connect_bounded(
    s: &UnixStream,
    sa: &libc::sockaddr_un,
    len: libc::socklen_t,
    bound: Duration,
) -> Result<(), HandshakeError> {
    let deadline = Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_write_timeout(Some(left.max(Duration::from_micros(1))))
            .map_err(HandshakeError::Io)?;
        match connect_raw(s.as_raw_fd(), sa, len) {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) && !left.is_zero() => {}
            Err(e) => return Err(connect_error(e)),
        }
    }
    s.set_write_timeout(None).map_err(HandshakeError::Io)
}

/// The abstract name the server binds its end of the channel to before it
/// connects: it tells the client's listener which of its proposals (the one
/// named `token`: its DMB's, or an announcement's id) the connection
/// answers.
pub(super) fn server_name(gid: u64, token: u64) -> Vec<u8> {
    format!("smclo-{gid:016x}-s-{token:016x}").into_bytes()
}

/// The token a connection's [`server_name`] names, if it is one for the
/// device with `gid`.
pub(super) fn token_of(gid: u64, name: &[u8]) -> Option<u64> {
    let prefix = format!("smclo-{gid:016x}-s-");
    let hex = name.strip_prefix(prefix.as_bytes())?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
}

/// Binds the socket `fd` to the abstract `name`.
fn bind_abstract(fd: RawFd, name: &[u8]) -> io::Result<()> {
    let (sa, len) = RendezvousAddr::Abstract(name.to_vec()).sockaddr()?;
    let rc = crate::chan_sys::bind_unix(fd, &sa, len);
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
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

/// Checks that the process at the other end of the UNIX socket `fd` (its
/// creator, for a listening peer) may share the device of shape `shape`
/// with us ([`crate::access::check_peer`]).
pub(super) fn check_peer(fd: RawFd, shape: &Shape) -> Result<(), HandshakeError> {
    crate::access::check_peer(fd, shape).map_err(HandshakeError::PeerRefused)
}

/// The client's first message on the channel, carrying its DMB descriptor.
pub(super) const CLIENT_DMB_BYTE: u8 = 0xD1;
/// The server's message on the channel after its Accept, carrying its DMB
/// descriptor.
pub(super) const SERVER_DMB_BYTE: u8 = 0xD2;

/// Sends `byte`, and `fd` (if any) as `SCM_RIGHTS`, on the UNIX stream
/// socket `sock`, without blocking and without SIGPIPE.
pub(super) fn send_msg(sock: RawFd, byte: u8, fd: Option<RawFd>) -> io::Result<()> {
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
    let n =
        unsafe { crate::chan_sys::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What [`recv_expected`] found on the channel.
pub(super) enum Received {
    /// Nothing yet.
    Pending,
    /// End of file, or a reset: the peer closed the channel (a listener
    /// closed with our connection still in its backlog resets it).
    Closed,
    /// The expected message, with its descriptor if it carried one.
    Msg(Option<File>),
}

/// Receives the one-byte message `byte` with at most one descriptor
/// (close-on-exec) from the UNIX stream socket `sock`, without blocking.
/// Descriptors of a rejected message are closed.
pub(super) fn recv_expected(sock: RawFd, byte: u8) -> Result<Received, HandshakeError> {
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
    let n = unsafe {
        crate::chan_sys::recvmsg(sock, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC)
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EINTR) => Ok(Received::Pending),
            Some(libc::ECONNRESET) => Ok(Received::Closed),
            _ => Err(HandshakeError::Io(e)),
        };
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
        return Err(PeerMisbehaved::TruncatedControl.into());
    }
    if n == 0 {
        return Ok(Received::Closed);
    }
    if fds.len() > 1 {
        return Err(PeerMisbehaved::ExtraDescriptors.into());
    }
    if data[0] != byte {
        return Err(PeerMisbehaved::UnexpectedByte(data[0]).into());
    }
    Ok(Received::Msg(fds.pop()))
}

/// Blocks until `fd` is readable or `timeout` passes (a zero `timeout`
/// only looks); true if readable.
///
/// Busy-polls first, for the handshake's spin budget ([`super::spin_budget`]): each
/// step of the handshake answers the previous one within microseconds, and
/// sleeping for it would add a wake-up (a scheduler round trip on another
/// CPU) per step. The spin looks at `hint` (shared memory: the peer says it
/// sent) and asks the socket only once that says so.
pub(super) fn wait_readable(fd: RawFd, timeout: Duration, hint: impl Fn() -> bool) -> bool {
    if timeout.is_zero() {
        return readable_now(fd);
    }
    let start = Instant::now();
    let spin = super::spin_budget().min(timeout);
    if crate::spin::until(spin, None, || (hint() && readable_now(fd)).then_some(())).is_some() {
        return true;
    }
    let left = timeout.saturating_sub(start.elapsed());
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
    poll_in(fd, ms)
}

/// [`wait_readable`] and `take` in one: `take` reads what `fd` has
/// (`None`: nothing yet). The spin calls it as soon as `hint` holds, without
/// asking the socket's readiness first, which would cost a system call
/// more: once the peer says it sent, what it sent is there. After the spin
/// it sleeps until `fd` is readable, at most `timeout`.
pub(super) fn wait_take<T>(
    fd: RawFd,
    timeout: Duration,
    hint: impl Fn() -> bool,
    mut take: impl FnMut() -> Option<T>,
) -> Option<T> {
    let start = Instant::now();
    let spin = super::spin_budget().min(timeout);
    if let Some(v) = crate::spin::until(spin, None, || if hint() { take() } else { None }) {
        return Some(v);
    }
    let left = timeout.saturating_sub(start.elapsed());
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
    if timeout.is_zero() || poll_in(fd, ms) {
        take()
    } else {
        None
    }
}

/// Busy-polls until `fd` is readable or `deadline` passes, never sleeping;
/// true if readable. Looks at `hint` (see [`wait_readable`]) for the spin
/// budget, then asks the socket and yields the CPU between looks: the peer
/// it waits for may need that CPU.
pub(super) fn spin_readable(fd: RawFd, deadline: Instant, hint: impl Fn() -> bool) -> bool {
    // The data path's budget: this wait never sleeps, and spinning longer
    // would only keep others (the client, perhaps) off the CPU.
    let spin = crate::wait::spin_budget().min(deadline.saturating_duration_since(Instant::now()));
    if crate::spin::until(spin, None, || (hint() && readable_now(fd)).then_some(())).is_some() {
        return true;
    }
    loop {
        if readable_now(fd) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

fn readable_now(fd: RawFd) -> bool {
    poll_in(fd, 0)
}

/// `poll` for POLLIN on `fd` for at most `ms` milliseconds.
pub(super) fn poll_in(fd: RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    crate::chan_sys::poll(std::slice::from_mut(&mut p), ms) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_carry_the_token() {
        let name = server_name(0xab, 0x1234_5678_9abc_def0);
        assert_eq!(token_of(0xab, &name), Some(0x1234_5678_9abc_def0));
        // Another device's, a client's or a truncated name names no token.
        assert_eq!(token_of(0xac, &name), None);
        assert_eq!(
            token_of(0xab, b"smclo-00000000000000ab-u-0000000000000001"),
            None
        );
        assert_eq!(token_of(0xab, &name[..name.len() - 1]), None);
    }

    /// Whether the peer of `s` closes it (end of file) within 5 s.
    fn closed(s: &UnixStream) -> bool {
        poll_in(s.as_raw_fd(), 5000)
            && matches!(
                recv_expected(s.as_raw_fd(), CLIENT_DMB_BYTE),
                Ok(Received::Closed)
            )
    }

    /// A fork child that holds this process's descriptors for `d`, then
    /// exits.
    fn fork_holding(d: Duration) -> libc::pid_t {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: d.as_nanos() as libc::c_long,
        };
        // SAFETY: the child only sleeps and calls _exit, both
        // async-signal-safe.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                libc::nanosleep(&ts, std::ptr::null_mut());
                libc::_exit(0);
            }
        }
        assert!(pid > 0, "fork failed");
        pid
    }

    #[test]
    fn rendezvous_sockets_by_path_and_abstract() {
        use super::super::listener::RendezvousListener;
        let dir = std::env::temp_dir().join(format!("smclo-hs-{}", std::process::id()));
        let dev = Device::open(&dir).unwrap();
        for same_netns in [false, true] {
            let l = RendezvousListener::for_proposal(&dev, same_netns).unwrap();
            assert_eq!(l.nonce() & ABSTRACT_NONCE != 0, same_netns);
            let path = match RendezvousAddr::new(&dev, l.nonce()) {
                RendezvousAddr::Path(p) => Some(p),
                RendezvousAddr::Abstract(_) => None,
            };
            if let Some(p) = &path {
                assert!(p.exists());
            }
            let token = 0x1234 + same_netns as u64;
            // A connection for a token that was never proposed is refused.
            // Its own token per round: the name it binds lives on in any
            // fork child of the process's other tests meanwhile.
            let stray_token = 7 + same_netns as u64;
            let stray = RendezvousAddr::new(&dev, l.nonce())
                .connect_within(CONNECT_BOUND, &dev.shape(), dev.gid(), stray_token)
                .unwrap();
            l.expect(token);
            let c = RendezvousAddr::new(&dev, l.nonce())
                .connect_within(CONNECT_BOUND, &dev.shape(), dev.gid(), token)
                .unwrap();
            let a = l
                .take(token, Duration::from_secs(5), || true)
                .unwrap()
                .unwrap();
            assert!(check_peer(a.as_raw_fd(), &dev.shape()).is_ok());
            assert!(closed(&stray), "the stray connection is closed");
            // A descriptor goes through, with its byte.
            let f = crate::dmb::memfd("t").unwrap();
            send_msg(c.as_raw_fd(), CLIENT_DMB_BYTE, Some(f.as_raw_fd())).unwrap();
            let got = recv_expected(a.as_raw_fd(), CLIENT_DMB_BYTE).unwrap();
            assert!(matches!(got, Received::Msg(Some(_))));
            assert!(matches!(
                recv_expected(a.as_raw_fd(), CLIENT_DMB_BYTE),
                Ok(Received::Pending)
            ));
            // Another byte than the step expects is the peer misbehaving.
            send_msg(c.as_raw_fd(), SERVER_DMB_BYTE, None).unwrap();
            assert!(matches!(
                recv_expected(a.as_raw_fd(), CLIENT_DMB_BYTE),
                Err(HandshakeError::PeerMisbehaved(
                    PeerMisbehaved::UnexpectedByte(SERVER_DMB_BYTE)
                ))
            ));
            // A fork child holding copies of every descriptor for a while
            // (as other tests of this process fork meanwhile) delays the
            // end of file: the check waits for it.
            let holder = fork_holding(Duration::from_millis(300));
            drop(c);
            assert!(closed(&a), "end of file once the client closed");
            // SAFETY: waits for our own child.
            unsafe { libc::waitpid(holder, std::ptr::null_mut(), 0) };
            l.forget(token, true);
            drop(l);
            if let Some(p) = path {
                assert!(!p.exists(), "a per-proposal listener's path is unlinked");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
