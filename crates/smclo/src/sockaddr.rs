//! Socket addresses to and from the kernel's `sockaddr` layouts, and the few
//! address calls the core makes on raw descriptors (the preload works on
//! descriptors the application owns, so `std::net` types cannot be used).

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;

/// A `sockaddr_storage` holding `addr`, and the length to pass with it.
pub fn to_raw(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { MaybeUninit::zeroed().assume_init() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Reads an IPv4 or IPv6 address the kernel (or an application) wrote.
/// `None` for other families or a length too short for the family.
///
/// # Safety
/// `sa` must point to at least `len` readable bytes.
pub unsafe fn from_raw(sa: *const libc::sockaddr, len: libc::socklen_t) -> Option<SocketAddr> {
    if sa.is_null() || (len as usize) < size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: the caller guarantees `len` readable bytes and `len` covers
    // sa_family (checked above); read_unaligned because application buffers
    // need not be aligned. The reads below are sound for the same reasons,
    // each after `len` was checked against its family's struct size.
    // Only the family field: `len` may be shorter than a whole sockaddr.
    match unsafe { std::ptr::read_unaligned(std::ptr::addr_of!((*sa).sa_family)) } as i32 {
        libc::AF_INET if len as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: `len` covers a sockaddr_in (match guard); see above.
            let sin = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: `len` covers a sockaddr_in6 (match guard); see above.
            let s = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

type NameFn =
    unsafe extern "C" fn(libc::c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> libc::c_int;

fn name(fd: RawFd, f: NameFn) -> io::Result<SocketAddr> {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { MaybeUninit::zeroed().assume_init() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `ss`, which we own.
    if unsafe {
        f(
            fd,
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ss` holds `len` (<= its size) initialised bytes.
    unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) }
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EAFNOSUPPORT))
}

/// `getsockname(2)`.
pub fn local(fd: RawFd) -> io::Result<SocketAddr> {
    name(fd, libc::getsockname)
}

/// `getpeername(2)`.
pub fn peer(fd: RawFd) -> io::Result<SocketAddr> {
    name(fd, libc::getpeername)
}

/// `bind(2)`. An IPv4 address on an IPv6 socket is bound as IPv4-mapped.
pub fn bind(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let addr = match addr {
        SocketAddr::V4(a) if crate::tcp_syn::domain(fd)? == libc::AF_INET6 => {
            SocketAddr::V6(SocketAddrV6::new(a.ip().to_ipv6_mapped(), a.port(), 0, 0))
        }
        a => a,
    };
    let (ss, len) = to_raw(addr);
    // SAFETY: `ss` holds a valid address of length `len`.
    if unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `connect(2)` on a raw descriptor; `EINPROGRESS` is returned as an error
/// for the caller to interpret.
pub fn connect(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let (ss, len) = to_raw(addr);
    // SAFETY: `ss` holds a valid address of length `len`.
    if unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The addresses of the caller's network namespace by which a process in
/// another namespace of this host reaches it: every interface address
/// except loopback (each namespace has its own) and IPv6 link-local (which
/// names an address only together with an interface); IPv4 only unless
/// `v6`. In interface order, without repeats.
pub fn namespace_addrs(v6: bool) -> io::Result<Vec<std::net::IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs stores the head of a list it allocated, which is
    // freed below and not used after.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list, which is not freed yet.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points to a sockaddr, which begins
        // with its family.
        let len = match unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int {
            libc::AF_INET => size_of::<libc::sockaddr_in>(),
            libc::AF_INET6 => size_of::<libc::sockaddr_in6>(),
            _ => continue,
        };
        // SAFETY: a sockaddr of those families is its family's struct.
        let a = unsafe { from_raw(ifa.ifa_addr, len as libc::socklen_t) };
        let Some(ip) = a.map(|a| a.ip()) else {
            continue;
        };
        let link_local =
            matches!(ip, std::net::IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80);
        if ip.is_loopback() || link_local || (ip.is_ipv6() && !v6) || out.contains(&ip) {
            continue;
        }
        out.push(ip);
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for a in ["127.0.0.1:80", "[::1]:443", "[fe80::1%2]:9"] {
            let a: SocketAddr = a.parse().unwrap();
            let (ss, len) = to_raw(a);
            // SAFETY: ss holds len bytes.
            let b = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) };
            assert_eq!(b, Some(a));
            // A truncated length is refused, not over-read.
            // SAFETY: ss holds more than len - 1 bytes.
            let c = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len - 1) };
            assert_eq!(c, None);
        }
    }

    /// A buffer of just the family (`len` 2) that ends where readable
    /// memory ends: nothing past `len` may be read.
    #[test]
    fn reads_nothing_past_len() {
        // SAFETY: plain calls; the mapping is ours and unmapped at the end.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
            let m = libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(m, libc::MAP_FAILED);
            assert_eq!(
                libc::mprotect(m.cast::<u8>().add(page).cast(), page, libc::PROT_NONE),
                0
            );
            let fam = m.cast::<u8>().add(page - 2).cast::<libc::sa_family_t>();
            fam.write_unaligned(libc::AF_INET as libc::sa_family_t);
            assert_eq!(from_raw(fam.cast(), 2), None);
            libc::munmap(m, 2 * page);
        }
    }
}
