//! The kernel's own SMC (`socket(AF_SMC)`), for benchmarking smclo beside
//! the kernel's SMC-D loopback (loopback-ism, Linux ≥ 6.10 with
//! `CONFIG_SMC_LO`).
//!
//! An AF_SMC socket speaks the socket API of a TCP socket (bind, listen,
//! accept, connect take `sockaddr_in`; `getsockname` answers with the
//! underlying TCP socket's name), so once created it is handed to the
//! standard library as a `TcpListener` or `TcpStream`.

use std::io;
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};

/// `AF_SMC` from `<linux/socket.h>`; the libc crate does not name it.
const AF_SMC: libc::c_int = 43;
/// `SMCPROTO_SMC`: SMC over IPv4 (`SMCPROTO_SMC6` is 1).
const SMCPROTO_SMC: libc::c_int = 0;

/// Whether the running kernel can create SMC sockets and can use its
/// loopback-ism device; `Err` says why not, for the benchmark's table.
pub fn availability() -> Result<(), String> {
    let fd = socket().map_err(|e| match e.raw_os_error() {
        Some(libc::EAFNOSUPPORT) => {
            "socket(AF_SMC) fails with EAFNOSUPPORT: this kernel has no SMC (CONFIG_SMC off, or the smc module not loaded)"
                .to_string()
        }
        _ => format!("socket(AF_SMC) fails: {e}"),
    })?;
    drop(fd);
    // SMC without a loopback-ism device falls back to TCP on every local
    // connection, which would be measured as "SMC". The kernel's build
    // configuration tells, where it is readable.
    match kernel_config_option("CONFIG_SMC_LO") {
        Some(v) if v == "y" => Ok(()),
        Some(v) => Err(format!(
            "AF_SMC exists but CONFIG_SMC_LO={v}: no loopback-ism device"
        )),
        None => Ok(()),
    }
}

/// The value of `name` in the running kernel's configuration
/// (`/proc/config.gz` is compressed, so only `/boot/config-$(uname -r)` is
/// read); `None` when it cannot be read or the option is absent.
fn kernel_config_option(name: &str) -> Option<String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let text = std::fs::read_to_string(format!("/boot/config-{}", release.trim())).ok()?;
    let prefix = format!("{name}=");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; a non-negative result is a new
    // descriptor that nothing else owns.
    let fd = unsafe { libc::socket(AF_SMC, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, SMCPROTO_SMC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn v4(addr: SocketAddr) -> io::Result<SocketAddrV4> {
    match addr {
        SocketAddr::V4(a) => Ok(a),
        SocketAddr::V6(_) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "AF_SMC benchmark sockets are IPv4",
        )),
    }
}

/// A listening SMC socket bound to `addr`.
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = socket()?;
    let sa = sockaddr(v4(addr)?);
    let fdn = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: sa is a valid sockaddr_in that outlives the call, and its
    // size is passed with it.
    let rc = unsafe {
        libc::bind(
            fdn,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of_val(&sa) as u32,
        )
    };
    // SAFETY: listen(2) takes no pointers.
    if rc != 0 || unsafe { libc::listen(fdn, 1024) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

/// An SMC connection to `addr` (SMC-D if the kernel agrees, else TCP
/// underneath, which the kernel does not report through this API).
pub fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let fd = socket()?;
    let sa = sockaddr(v4(addr)?);
    // SAFETY: as in `listen`.
    let rc = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of_val(&sa) as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpStream::from(fd))
}
