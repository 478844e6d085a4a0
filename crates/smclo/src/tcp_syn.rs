//! What the handshake does to a TCP socket's SYN, and reads back from it.
//!
//! The client marks its SYN (IP TTL / hop limit and DSCP), the listener keeps
//! SYNs (`TCP_SAVE_SYN`), and the accepting side reads the one that opened
//! the connection (`TCP_SAVED_SYN`). Both options work unprivileged.

use smclo_wire::syn::{self, Mark, Syn};
use std::io;
use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::RawFd;

fn setsockopt_int(fd: RawFd, level: i32, name: i32, v: i32) -> io::Result<()> {
    // SAFETY: we pass a pointer to a live i32 and its exact size; the kernel
    // only reads it. An invalid fd is reported as EBADF, not UB.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const i32).cast(),
            size_of::<i32>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn getsockopt_int(fd: RawFd, level: i32, name: i32) -> io::Result<i32> {
    let mut v: i32 = 0;
    let mut len = size_of::<i32>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `v`, which we own.
    let rc = unsafe { libc::getsockopt(fd, level, name, (&mut v as *mut i32).cast(), &mut len) };
    if rc == 0 {
        Ok(v)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The socket's address family (`SO_DOMAIN`).
pub fn domain(fd: RawFd) -> io::Result<i32> {
    getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN)
}

/// Resets the TCP connection of `fd` (`connect(AF_UNSPEC)` sends a RST and
/// leaves the socket open, unconnected): its program's next call fails with
/// `ECONNRESET`. For an end that cannot follow its peer into SMC-D, where a
/// clean close would let the peer read a clean end of stream.
pub fn reset(fd: RawFd) -> io::Result<()> {
    let unspec = libc::sockaddr {
        sa_family: libc::AF_UNSPEC as libc::sa_family_t,
        sa_data: [0; 14],
    };
    let len = std::mem::size_of::<libc::sockaddr>() as libc::socklen_t;
    // SAFETY: a valid sockaddr of the length given; `fd` stays open.
    if unsafe { libc::connect(fd, &unspec, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Asks the kernel to keep the SYN of every connection accepted on this
/// listening socket, so `accept` can read the client's mark.
pub fn save_syns(listener: RawFd) -> io::Result<()> {
    setsockopt_int(listener, libc::IPPROTO_TCP, libc::TCP_SAVE_SYN, 1)
}

/// The SYN of an accepted connection. `Ok(None)` when the listener did not
/// save it (it was not set up by smclo) or it was read already.
pub fn saved_syn(conn: RawFd) -> io::Result<Option<Result<Syn, syn::SynError>>> {
    let mut buf = [0u8; 512];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `buf`, which we own.
    let rc = unsafe {
        libc::getsockopt(
            conn,
            libc::IPPROTO_TCP,
            libc::TCP_SAVED_SYN,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            _ => Err(e),
        };
    }
    // Nothing saved is reported as an empty option, not as an error.
    let n = (len as usize).min(buf.len());
    if n == 0 {
        return Ok(None);
    }
    Ok(Some(syn::parse(&buf[..n])))
}

/// The values a socket had before [`apply_mark`], to put back after `connect`.
#[derive(Clone, Copy, Debug)]
pub struct SavedMark {
    v6: bool,
    ttl: i32,
    tos: i32,
}

/// Puts `mark` into the SYN the next `connect` on `fd` sends. `dest` is
/// the address as `connect` is given it, whose family is the socket's (a
/// connect with another family fails). IPv4-mapped destinations on an IPv6
/// socket leave as IPv4, so both families' options are set there.
/// `defaults`: the socket's TTL and TOS (hop limit and traffic class) were
/// never set, so they are put back to the defaults without being read.
pub fn apply_mark(
    fd: RawFd,
    dest: &SocketAddr,
    mark: Mark,
    defaults: bool,
) -> io::Result<SavedMark> {
    let v6 = dest.is_ipv6();
    let (lvl, ttl_opt, tos_opt) = if v6 {
        (
            libc::IPPROTO_IPV6,
            libc::IPV6_UNICAST_HOPS,
            libc::IPV6_TCLASS,
        )
    } else {
        (libc::IPPROTO_IP, libc::IP_TTL, libc::IP_TOS)
    };
    let saved = if defaults {
        // -1: the route's default TTL or hop limit, as on a new socket.
        SavedMark {
            v6,
            ttl: -1,
            tos: 0,
        }
    } else {
        SavedMark {
            v6,
            ttl: getsockopt_int(fd, lvl, ttl_opt)?,
            tos: getsockopt_int(fd, lvl, tos_opt)?,
        }
    };
    setsockopt_int(fd, lvl, ttl_opt, mark.ttl as i32)?;
    setsockopt_int(fd, lvl, tos_opt, mark.tos() as i32)?;
    if v6 && is_v4_mapped(dest) {
        setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TTL, mark.ttl as i32)?;
        setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, mark.tos() as i32)?;
    }
    Ok(saved)
}

/// Restores on `fd` what [`apply_mark`] changed, once the SYN has left.
pub fn restore_mark(fd: RawFd, s: SavedMark) -> io::Result<()> {
    if s.v6 {
        // -1 restores the route's default hop limit.
        setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, s.ttl)?;
        setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, s.tos)?;
        // A mapped connection uses the IPv4 options; -1 is not valid for
        // IP_TTL, so fall back to the kernel default explicitly.
        let _ = setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, s.tos.max(0));
        let _ = setsockopt_int(
            fd,
            libc::IPPROTO_IP,
            libc::IP_TTL,
            if s.ttl > 0 { s.ttl } else { 64 },
        );
    } else {
        setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TTL, s.ttl)?;
        setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, s.tos)?;
    }
    Ok(())
}

/// Whether `(level, name)` is an option the SYN mark sets.
pub fn is_mark_option(level: i32, name: i32) -> bool {
    matches!(
        (level, name),
        (libc::IPPROTO_IP, libc::IP_TTL | libc::IP_TOS)
            | (
                libc::IPPROTO_IPV6,
                libc::IPV6_UNICAST_HOPS | libc::IPV6_TCLASS
            )
    )
}

/// The SYN mark left on the TCP socket of an SMC-D connection. That socket
/// carries no data, and its few packets (ACKs, FIN) go where the marked
/// SYN went, to a listener on this host, so putting the options back
/// after every SYN (two `setsockopt`s per connection) is left until the
/// program reads or sets one of them ([`LeftMark::put_back`]). One atomic
/// word (lock-free: also taken in a fork child before exec): 0 when no
/// mark is left, else [`LeftMark::PRESENT`], [`LeftMark::V6`], the TTL to
/// put back (as `u16`, -1 included) in bits 16..32 and the TOS in 0..16.
#[derive(Debug, Default)]
pub struct LeftMark(std::sync::atomic::AtomicU64);

impl LeftMark {
    const PRESENT: u64 = 1 << 63;
    const V6: u64 = 1 << 62;

    /// The mark `m` left on a socket, if any.
    pub fn new(m: Option<SavedMark>) -> LeftMark {
        let word = m.map_or(0, |m| {
            Self::PRESENT
                | if m.v6 { Self::V6 } else { 0 }
                | (m.ttl as u16 as u64) << 16
                | m.tos as u16 as u64
        });
        LeftMark(word.into())
    }

    /// Puts the options of the socket `fd` back, if the mark is still on it.
    pub fn put_back(&self, fd: RawFd) {
        let w = self.0.swap(0, std::sync::atomic::Ordering::AcqRel);
        if w & Self::PRESENT == 0 {
            return;
        }
        let m = SavedMark {
            v6: w & Self::V6 != 0,
            ttl: (w >> 16) as u16 as i16 as i32,
            tos: w as u16 as i16 as i32,
        };
        if let Err(e) = restore_mark(fd, m) {
            crate::debug!("restoring TTL/TOS after the SYN failed: {e}");
        }
    }
}

fn is_v4_mapped(a: &SocketAddr) -> bool {
    matches!(a.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some())
}

/// Canonical form of an address for keys: IPv4-mapped IPv6 becomes IPv4, so
/// both ends of a dual-stack connection name it the same way.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, v6.port())),
            None => a,
        },
        v4 => v4,
    }
}

/// The source address the kernel's routing would pick to reach `dest`
/// (a connected UDP socket sends nothing and tells us).
pub fn route_source(dest: SocketAddr) -> io::Result<IpAddr> {
    let any: SocketAddr = match dest {
        SocketAddr::V4(_) => SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0)),
    };
    let probe = UdpSocket::bind(any)?;
    probe.connect(dest)?;
    Ok(probe.local_addr()?.ip())
}

/// Whether a connection to `dest` stays in this network namespace, so that
/// its SYN never leaves the host: loopback (and unspecified) destinations
/// always do; any other does when routing picks the destination itself as
/// the source, which the kernel does for destinations of `local` routes
/// (the preferred source of an address's local route is that address; IPv6
/// source selection prefers the destination when it is ours). Asked afresh
/// each time, not from [`route_source_cached`]: an address that was local
/// a moment ago may be routed off the host now.
pub fn is_local(dest: SocketAddr) -> bool {
    let dest = canonical(dest);
    let ip = dest.ip();
    ip.is_loopback() || ip.is_unspecified() || route_source(dest).is_ok_and(|src| src == ip)
}

/// How long [`route_source_cached`] trusts a looked-up source address.
pub const ROUTE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// [`route_source`], remembered per destination address for [`ROUTE_TTL`]:
/// the probe costs four syscalls, and a client connects to the same few
/// addresses again and again. A stale answer (routes changed within the TTL)
/// only makes the bind fail or the key differ, which falls back to TCP.
pub fn route_source_cached(dest: SocketAddr) -> io::Result<IpAddr> {
    use std::sync::Mutex;
    use std::time::Instant;
    static CACHE: Mutex<Vec<(IpAddr, IpAddr, Instant)>> = Mutex::new(Vec::new());
    // try_lock: never wait for a lock that a thread lost in fork holds.
    if let Ok(c) = CACHE.try_lock() {
        if let Some((_, src, _)) = c
            .iter()
            .find(|(d, _, at)| *d == dest.ip() && at.elapsed() < ROUTE_TTL)
        {
            return Ok(*src);
        }
    }
    let src = route_source(dest)?;
    if let Ok(mut c) = CACHE.try_lock() {
        let now = Instant::now();
        c.retain(|(d, _, at)| *d != dest.ip() && now.duration_since(*at) < ROUTE_TTL);
        if c.len() < 64 {
            c.push((dest.ip(), src, now));
        }
    }
    Ok(src)
}

/// `TCP_TIMESTAMP` (linux/tcp.h): read, the connection's TCP timestamp
/// clock now (milliseconds plus the connection's random offset).
const TCP_TIMESTAMP: i32 = 24;

/// The timestamp clock of TCP connection `fd` now, which its segments'
/// TSvals carry: its SYN's is a little earlier. Unprivileged; valid once
/// `connect` has started (the offset is chosen then).
pub fn timestamp_clock(fd: RawFd) -> io::Result<u32> {
    getsockopt_int(fd, libc::IPPROTO_TCP, TCP_TIMESTAMP).map(|v| v as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn mark_reaches_the_saved_syn_and_is_restored() {
        mark_round_trip(false);
    }

    #[test]
    fn mark_on_a_new_socket_is_restored_to_the_defaults_unread() {
        mark_round_trip(true);
    }

    fn mark_round_trip(defaults: bool) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        save_syns(l.as_raw_fd()).unwrap();
        let addr = l.local_addr().unwrap();
        // SAFETY: plain socket(2); the fd is wrapped in a TcpStream right after connect.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        let mark = Mark {
            ttl: 201,
            dscp: 0x2a,
        };
        let saved = apply_mark(fd, &addr, mark, defaults).unwrap();
        let SocketAddr::V4(a4) = addr else {
            unreachable!()
        };
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: a4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: sin is a valid sockaddr_in of the size we pass.
        let rc = unsafe {
            libc::connect(
                fd,
                (&sin as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert_eq!(rc, 0);
        restore_mark(fd, saved).unwrap();
        assert_eq!(
            getsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TTL).unwrap(),
            64
        );
        assert_eq!(
            getsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS).unwrap(),
            0
        );
        // SAFETY: fd is ours and open; TcpStream takes ownership.
        let _c: TcpStream = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
        let (s, _) = l.accept().unwrap();
        let syn = saved_syn(s.as_raw_fd()).unwrap().unwrap().unwrap();
        assert_eq!(syn.mark, mark);
        assert_eq!(syn.dst, addr);
        // Read once: a second read finds nothing.
        assert!(saved_syn(s.as_raw_fd()).unwrap().is_none());
    }

    #[test]
    fn left_mark_is_put_back_once_as_it_was() {
        for (v6, ttl, tos) in [(false, 33, 0x10), (false, -1, 0), (true, 255, 0xfc)] {
            let m = SavedMark { v6, ttl, tos };
            let (l, fd) = if v6 {
                (TcpListener::bind("[::1]:0"), libc::AF_INET6)
            } else {
                (TcpListener::bind("127.0.0.1:0"), libc::AF_INET)
            };
            let l = l.unwrap();
            // SAFETY: plain socket(2), owned by a TcpStream right away.
            let s: TcpStream = unsafe {
                std::os::fd::FromRawFd::from_raw_fd(libc::socket(fd, libc::SOCK_STREAM, 0))
            };
            let fd = s.as_raw_fd();
            let (lvl, t, c) = if v6 {
                (
                    libc::IPPROTO_IPV6,
                    libc::IPV6_UNICAST_HOPS,
                    libc::IPV6_TCLASS,
                )
            } else {
                (libc::IPPROTO_IP, libc::IP_TTL, libc::IP_TOS)
            };
            let left = LeftMark::new(Some(m));
            setsockopt_int(fd, lvl, t, 7).unwrap();
            setsockopt_int(fd, lvl, c, 0x28).unwrap();
            left.put_back(fd);
            let want_ttl = if ttl < 0 { 64 } else { ttl };
            assert_eq!(getsockopt_int(fd, lvl, t).unwrap(), want_ttl);
            assert_eq!(getsockopt_int(fd, lvl, c).unwrap(), tos);
            // Taken: a second call leaves what the program set since.
            setsockopt_int(fd, lvl, t, 9).unwrap();
            left.put_back(fd);
            assert_eq!(getsockopt_int(fd, lvl, t).unwrap(), 9);
            drop(l);
        }
        let none = LeftMark::new(None);
        none.put_back(-1);
    }

    #[test]
    fn plain_listener_has_no_saved_syn() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        assert!(saved_syn(s.as_raw_fd()).unwrap().is_none());
    }

    #[test]
    fn local_destinations() {
        assert!(is_local("127.0.0.9:1".parse().unwrap()));
        assert!(is_local("[::ffff:127.0.0.1]:1".parse().unwrap()));
        // The source routing picks for a remote destination is one of ours.
        let Ok(src) = route_source("192.0.2.1:9".parse().unwrap()) else {
            return; // no route off the host at all: nothing more to check
        };
        assert!(is_local(SocketAddr::new(src, 9)), "{src} is ours");
        // TEST-NET-1 is never assigned to a host.
        assert!(!is_local("192.0.2.1:9".parse().unwrap()));
    }

    #[test]
    fn route_source_of_loopback() {
        assert_eq!(
            route_source("127.0.0.1:9".parse().unwrap()).unwrap(),
            "127.0.0.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            canonical("[::ffff:127.0.0.1]:5".parse().unwrap()),
            "127.0.0.1:5".parse().unwrap()
        );
    }
}
