//! Which TCP ports have a listening socket, asked of the kernel through
//! `sock_diag` (as `ss -tl` does), which walks the listening sockets only.
//! Reading `/proc/<pid>/net/tcp` walked and formatted every TCP socket of
//! the network namespace, TIME_WAIT included: after the connection-churn
//! tests (tens of thousands of TIME_WAIT sockets for a minute) one read
//! took seconds on the loaded test machine, and a server that listened at
//! once was not seen within `wait_listen`'s 10 s.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `TCP_LISTEN` (linux/tcp_states.h): the state bit the dump asks for.
const TCP_LISTEN: u32 = 10;
/// Every TCP state (`TCP_ESTABLISHED` 1 to `TCP_NEW_SYN_RECV` 12).
const ALL_STATES: u32 = 0x1ffe;
/// `struct nlmsghdr`.
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, and a
/// zeroed `inet_diag_sockid` (48 bytes).
const REQ_LEN: usize = 56;
/// Offset of `id.idiag_sport` (big-endian) in `struct inet_diag_msg`.
const SPORT: usize = 4;

/// The local ports of the TCP sockets listening in the calling thread's
/// network namespace.
pub fn listening_ports() -> io::Result<Vec<u16>> {
    ports_in_states(1 << TCP_LISTEN)
}

/// The local ports of every TCP socket of the calling thread's network
/// namespace, whatever its state (TIME_WAIT included).
pub fn ports_in_use() -> io::Result<Vec<u16>> {
    ports_in_states(ALL_STATES)
}

fn ports_in_states(states: u32) -> io::Result<Vec<u16>> {
    let mut ports = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        dump(family as u8, states, &mut ports)?;
    }
    Ok(ports)
}

/// Adds the ports of `family`'s TCP sockets in `states` to `ports`.
fn dump(family: u8, states: u32, ports: &mut Vec<u16>) -> io::Result<()> {
    let flags = libc::SOCK_DGRAM | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket(2); the descriptor is owned right below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, flags, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is the fresh socket above, owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = [0u8; NLMSG_HDR + REQ_LEN];
    req[0..4].copy_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let nl_flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&nl_flags.to_ne_bytes());
    req[NLMSG_HDR] = family;
    req[NLMSG_HDR + 1] = libc::IPPROTO_TCP as u8;
    req[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&states.to_ne_bytes());
    // SAFETY: all-zero bytes are a valid sockaddr_nl; pid 0 is the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `req` and `kernel` are valid for the lengths given.
    let n = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if parse(&buf[..n as usize], ports)? {
            return Ok(());
        }
    }
}

/// Reads one datagram of the dump into `ports`; true once it is done.
fn parse(mut msgs: &[u8], ports: &mut Vec<u16>) -> io::Result<bool> {
    while msgs.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes(msgs[0..4].try_into().unwrap()) as usize;
        let ty = u16::from_ne_bytes(msgs[4..6].try_into().unwrap());
        if len < NLMSG_HDR || len > msgs.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad netlink message",
            ));
        }
        let body = &msgs[NLMSG_HDR..len];
        match ty as i32 {
            libc::NLMSG_DONE => return Ok(true),
            libc::NLMSG_ERROR => {
                let e = body
                    .get(0..4)
                    .map_or(0, |b| i32::from_ne_bytes(b.try_into().unwrap()));
                if e != 0 {
                    return Err(io::Error::from_raw_os_error(-e));
                }
            }
            _ => {
                if let Some(p) = body.get(SPORT..SPORT + 2) {
                    ports.push(u16::from_be_bytes([p[0], p[1]]));
                }
            }
        }
        msgs = &msgs[(len + 3) & !3..];
    }
    Ok(false)
}

/// [`listening_ports`] in the network namespace of process `pid`: on a
/// thread of its own that enters it (`setns` changes the calling thread's
/// namespace only), unless it is ours.
pub fn listening_ports_of(pid: u32) -> io::Result<Vec<u16>> {
    let ns = fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let same = |a: &fs::Metadata, b: &fs::Metadata| {
        use std::os::unix::fs::MetadataExt;
        (a.dev(), a.ino()) == (b.dev(), b.ino())
    };
    if same(&ns.metadata()?, &fs::metadata("/proc/self/ns/net")?) {
        return listening_ports();
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns(2) with a descriptor we own; it moves only this
            // thread, which ends right after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            listening_ports()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the sock_diag thread panicked")))
    })
}
