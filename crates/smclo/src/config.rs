//! Configuration from the environment, validated once.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `SMCLO_DEVICE_DIR` | the device directory | [`default_device_dir`] |
//! | `SMCLO_RMEM` | receive DMB size (like `net.smc.rmem`), rounded up to a power of two in 16 KiB ..= 1 MiB; `k`/`m` suffixes | [`DEFAULT_DMB_SIZE`] |
//! | `SMCLO_WMEM` | send buffer size in copy mode (like `net.smc.wmem`), same rules | [`DEFAULT_DMB_SIZE`] |
//! | `SMCLO_CLC_WAIT_MS` | how long a client waits for the server's answer before falling back (from `connect`; a non-blocking one returns at once and the handshake goes on) | 1000 |
//! | `SMCLO_POOL_BYTES` | DMB memory the process keeps for reuse ([`crate::dmb::pool`]); `k`/`m` suffixes | [`DEFAULT_POOL_BYTES`] |
//! | `SMCLO_POOL_IDLE_MS` | a kept DMB unused this long is unmapped at the next pool operation | 10000 |
//! | `SMCLO_SPIN_US` | how long a wait busy-polls before it sleeps in the kernel; 0 turns spinning off | [`DEFAULT_SPIN`] |
//! | `SMCLO_UEID` | user-defined EID; both ends must name the same one (or none) | none |
//! | `SMCLO_ANNOUNCE` | which destinations without a registered listener a client announces ([`Announce`]): `on`, `off`, or a comma-separated list of CIDRs (`10.96.0.0/12,fd00::/108`; an address alone is one host) | every one not loopback |
//! | `SMCLO_PASS_WAIT_MS` | how long a process that passes an accepted connection to another process (`SCM_RIGHTS`, node's cluster mode) before its handshake ended waits for the handshake, so that the connection goes as SMC-D; 0: it goes as TCP at once (PASSED) and the process's listeners on that port leave the registry, their later connections plain TCP | 0 |
//! | `SMCLO_SHORT` | what a client does for a destination whose connections through shared memory end short ([`Short`]): `learn` (propose less often to it, [`crate::short`]) or `smc` (always propose) | `learn` |
//! | `SMCLO_IO_URING` | what a process that uses io_uring does ([`IoUring`]): `tcp` (its connections stay TCP: io_uring's socket calls bypass smclo) or `files` (its io_uring reads and writes files only, as PostgreSQL's `io_method=io_uring` and MariaDB's InnoDB do: its connections go through shared memory as any other's) | `tcp` |
//! | `SMCLO_DEBUG` | log every decision to stderr | off |

use crate::error::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// Default ring size (see README "Choosing the DMB size" for the measurement).
pub const DEFAULT_DMB_SIZE: u32 = 256 * 1024;

/// Default of `SMCLO_POOL_BYTES`: about 64 DMBs of the default ring size.
pub const DEFAULT_POOL_BYTES: u64 = 16 << 20;
/// Default of `SMCLO_POOL_IDLE_MS`.
pub const DEFAULT_POOL_IDLE: Duration = Duration::from_secs(10);

/// Default of `SMCLO_SPIN_US`.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// `SMCLO_SPIN_US`, validated: the longest a wait busy-polls before it
/// sleeps in the kernel.
pub fn spin_from_env() -> Result<Duration> {
    match var("SMCLO_SPIN_US") {
        Some(v) => v.parse::<u64>().map(Duration::from_micros).map_err(|_| {
            Error::Config(format!(
                "SMCLO_SPIN_US={v:?} is not a number of microseconds"
            ))
        }),
        None => Ok(DEFAULT_SPIN),
    }
}

/// `SMCLO_ANNOUNCE`: which destinations without a registered listener a
/// client announces (docs/handshake.md "Connections through address
/// translation"): a ClusterIP, a published port or a sidecar's capture
/// is found only by an announcement, which costs a connection to a plain
/// server or another host its proof's system calls. An operator who knows
/// where translated services are limits it to those addresses, or turns
/// it off.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Announce {
    /// Every destination that is not loopback (the default).
    #[default]
    All,
    /// None: a destination without a registered listener is plain TCP.
    Off,
    /// Destinations within one of these networks.
    Within(std::sync::Arc<[Cidr]>),
}

/// A network: an address and the length of its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: std::net::IpAddr,
    len: u8,
}

impl Cidr {
    /// `a.b.c.d/n`, `x::y/n`, or an address alone (one host); `None` if
    /// it is none of these.
    pub fn parse(v: &str) -> Option<Cidr> {
        let (a, len) = match v.split_once('/') {
            Some((a, n)) => (a, Some(n)),
            None => (v, None),
        };
        let addr: std::net::IpAddr = a.trim().parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            Some(n) => n.trim().parse::<u8>().ok().filter(|&n| n <= max)?,
            None => max,
        };
        Some(Cidr { addr, len })
    }

    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address as its
    /// IPv4 one).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let bits = |net: u128, ip: u128, width: u32| {
            let keep = u32::from(self.len);
            keep == 0 || (net ^ ip) >> (width - keep) == 0
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(i)) => bits(u32::from(n).into(), u32::from(i).into(), 32),
            (IpAddr::V6(n), IpAddr::V6(i)) => bits(u128::from(n), u128::from(i), 128),
            _ => false,
        }
    }
}

impl Announce {
    /// `SMCLO_ANNOUNCE`, validated.
    pub fn from_env() -> Result<Announce> {
        let Some(v) = var("SMCLO_ANNOUNCE") else {
            return Ok(Announce::All);
        };
        match v.trim() {
            "off" => return Ok(Announce::Off),
            "on" => return Ok(Announce::All),
            _ => {}
        }
        let nets: Option<Vec<Cidr>> = v.split(',').map(Cidr::parse).collect();
        match nets {
            Some(n) if !n.is_empty() => Ok(Announce::Within(n.into())),
            _ => Err(Error::Config(format!(
                "SMCLO_ANNOUNCE={v:?} is not on, off or a comma-separated list of CIDRs (10.96.0.0/12,fd00::/108)"
            ))),
        }
    }

    /// Whether a connection to `ip` (no listener registered there) may be
    /// announced.
    pub fn covers(&self, ip: std::net::IpAddr) -> bool {
        match self {
            Announce::All => true,
            Announce::Off => false,
            Announce::Within(nets) => nets.iter().any(|n| n.contains(ip)),
        }
    }
}

/// What the per-process DMB pool ([`crate::dmb::pool`]) may keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLimits {
    /// Bytes (header page and ring) of all DMBs kept: our own, free or
    /// still mapped by a peer, and idle mappings of peers' DMBs.
    pub bytes: u64,
    /// A kept DMB unused for this long is unmapped at the next pool
    /// operation.
    pub idle: Duration,
}

impl Default for PoolLimits {
    fn default() -> PoolLimits {
        PoolLimits {
            bytes: DEFAULT_POOL_BYTES,
            idle: DEFAULT_POOL_IDLE,
        }
    }
}

impl PoolLimits {
    /// `SMCLO_POOL_BYTES` and `SMCLO_POOL_IDLE_MS`, validated.
    pub fn from_env() -> Result<PoolLimits> {
        let mut l = PoolLimits::default();
        if let Some(v) = var("SMCLO_POOL_BYTES") {
            l.bytes = parse_size(&v).ok_or_else(|| {
                Error::Config(format!(
                    "SMCLO_POOL_BYTES={v:?} is not a size (digits with optional k or m)"
                ))
            })?;
        }
        if let Some(v) = var("SMCLO_POOL_IDLE_MS") {
            l.idle = millis("SMCLO_POOL_IDLE_MS", &v)?;
        }
        Ok(l)
    }
}

/// An environment variable, if set and not empty.
fn var(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

/// A number of milliseconds, for variable `name`.
fn millis(name: &str, v: &str) -> Result<Duration> {
    v.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a number of milliseconds")))
}

/// `SMCLO_SHORT`: whether a client stops proposing to a destination whose
/// connections through shared memory carry a request or two and close
/// ([`crate::short`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Short {
    /// Learn such destinations and connect to them as TCP, proposing again
    /// now and then (the default).
    #[default]
    Learn,
    /// Always propose.
    Smc,
}

impl Short {
    /// From the environment, validated.
    pub fn from_env() -> Result<Short> {
        either("SMCLO_SHORT", ("learn", Short::Learn), ("smc", Short::Smc))
    }
}

/// `SMCLO_IO_URING`: what a process that uses io_uring does with its
/// connections. io_uring's reads and writes bypass the C library, so on a
/// connection through shared memory (whose descriptor is smclo's channel)
/// they would miss the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoUring {
    /// Its connections stay TCP (IO_URING), whatever its rings do (the
    /// default: a program that sends and receives through its ring keeps
    /// working).
    #[default]
    Tcp,
    /// Its io_uring touches files only: its connections go through shared
    /// memory as any other process's.
    Files,
}

impl IoUring {
    /// From the environment, validated.
    pub fn from_env() -> Result<IoUring> {
        either(
            "SMCLO_IO_URING",
            ("tcp", IoUring::Tcp),
            ("files", IoUring::Files),
        )
    }
}

/// Knob `name` with two values: `default`'s (also when unset) or
/// `other`'s.
fn either<T>(name: &str, default: (&str, T), other: (&str, T)) -> Result<T> {
    match var(name) {
        None => Ok(default.1),
        Some(v) if v == default.0 => Ok(default.1),
        Some(v) if v == other.0 => Ok(other.1),
        Some(v) => Err(Error::Config(format!(
            "{name}={v:?} is neither {:?} nor {:?}",
            default.0, other.0
        ))),
    }
}

/// All settings a process reads from its environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// The device directory.
    pub device_dir: PathBuf,
    /// Receive ring size in bytes.
    pub rmem: u32,
    /// Copy-mode send buffer size in bytes.
    pub wmem: u32,
    /// Bounded client wait for the server's Accept.
    pub clc_wait: Duration,
    /// User-defined EID (32 bytes, blank padded), if any.
    pub ueid: Option<[u8; 32]>,
    /// What the DMB pool keeps (read by [`crate::dmb::pool`] itself, once per
    /// process; here so that a malformed value is reported).
    pub pool: PoolLimits,
    /// The longest a wait busy-polls (`SMCLO_SPIN_US`; read by the waits
    /// themselves once per process, `crate::wait::spin_budget`; here so
    /// that a malformed value is reported).
    pub spin: Duration,
    /// The caller moves a new connection's channel to a number of its own
    /// at once (the preload's swap puts it at the application's socket
    /// number): the handshake leaves it where the kernel put it instead of
    /// moving it to smclo's high numbers first (`crate::fdnum`), which
    /// would cost a `fcntl` and a `close` more. A channel the handshake
    /// keeps while it waits (the server's for the client's DMB, the
    /// client's once a step returns undecided) is moved all the same,
    /// since the wait may last. Not from the environment.
    pub channel_placed_by_caller: bool,
    /// `SMCLO_ANNOUNCE`.
    pub announce: Announce,
    /// `SMCLO_PASS_WAIT_MS`.
    pub pass_wait: Duration,
    /// `SMCLO_SHORT`.
    pub short: Short,
    /// `SMCLO_IO_URING`.
    pub io_uring: IoUring,
}

impl Config {
    /// Reads and validates the environment.
    pub fn from_env() -> Result<Config> {
        let device_dir = match std::env::var_os("SMCLO_DEVICE_DIR").filter(|v| !v.is_empty()) {
            Some(d) => PathBuf::from(d),
            None => default_device_dir(),
        };
        let rmem = match var("SMCLO_RMEM") {
            Some(v) => dmb_size("SMCLO_RMEM", &v)?,
            None => DEFAULT_DMB_SIZE,
        };
        let wmem = match var("SMCLO_WMEM") {
            Some(v) => dmb_size("SMCLO_WMEM", &v)?,
            None => DEFAULT_DMB_SIZE,
        };
        let clc_wait = match var("SMCLO_CLC_WAIT_MS") {
            Some(v) => millis("SMCLO_CLC_WAIT_MS", &v)?,
            None => Duration::from_millis(1000),
        };
        let pass_wait = match var("SMCLO_PASS_WAIT_MS") {
            Some(v) => millis("SMCLO_PASS_WAIT_MS", &v)?,
            None => Duration::ZERO,
        };
        let ueid = match var("SMCLO_UEID") {
            Some(v) => Some(ueid(&v)?),
            None => None,
        };
        Ok(Config {
            device_dir,
            rmem,
            wmem,
            clc_wait,
            ueid,
            pool: PoolLimits::from_env()?,
            spin: spin_from_env()?,
            channel_placed_by_caller: false,
            announce: Announce::from_env()?,
            pass_wait,
            short: Short::from_env()?,
            io_uring: IoUring::from_env()?,
        })
    }
}

/// The system-wide group device directory (`smclo dev init --group NAME`
/// makes it): the default for every user who may use it.
pub const SYSTEM_DEVICE_DIR: &str = "/run/smclo";

/// The device directory when `SMCLO_DEVICE_DIR` is not set:
/// [`SYSTEM_DEVICE_DIR`] when it exists as a group device directory the
/// caller may use ([`crate::access`]), else one device per user, the first of
///
/// 1. `$XDG_RUNTIME_DIR/smclo`, when `XDG_RUNTIME_DIR` is a directory private
///    to us (ours, no access for group and others): nobody else can create
///    anything in it beforehand;
/// 2. `/run/user/<uid>/smclo`, when that directory (the value pam_systemd
///    gives `XDG_RUNTIME_DIR`) is private to us: a process started without
///    the variable, by a service manager, finds the same device as the
///    user's login shell;
/// 3. `/dev/shm/smclo-<uid>`, which [`crate::device::Device::open`] refuses
///    (saying why) if another user created it first.
///
/// A directory passed over is logged with the reason.
pub fn default_device_dir() -> PathBuf {
    if let Some(d) = usable_group_dir(std::path::Path::new(SYSTEM_DEVICE_DIR)) {
        return d;
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    // (name, directory, whether its absence is worth a line: a missing
    // /run/user/<uid> is the rule without systemd).
    let xdg = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|v| !v.is_empty())
        .map(|v| ("XDG_RUNTIME_DIR", PathBuf::from(v), true));
    let run_user = ("/run/user/<uid>", format!("/run/user/{uid}").into(), false);
    for (what, base, report_missing) in xdg.into_iter().chain([run_user]) {
        match crate::access::private_dir_problem(&base) {
            Ok(None) => return base.join("smclo"),
            Ok(Some(problem)) => {
                let refused = crate::error::DeviceError {
                    path: base,
                    problem,
                };
                crate::debug!("device directory: {what} refused ({refused})");
            }
            Err(e) if report_missing => {
                crate::debug!("device directory: {what} {} refused ({e})", base.display());
            }
            Err(_) => {}
        }
    }
    PathBuf::from(format!("/dev/shm/smclo-{uid}"))
}

/// `dir` if it is a group device directory the caller may use; a `dir`
/// that exists but is refused is logged with the reason.
fn usable_group_dir(dir: &std::path::Path) -> Option<PathBuf> {
    use crate::access::{Creds, Shape};
    match Shape::of(dir, &Creds::current()) {
        Ok(Ok(Shape::Group { .. })) => Some(dir.to_path_buf()),
        Ok(Ok(Shape::Private { .. })) => {
            crate::debug!(
                "device directory: {} refused (not a group device: see smclo dev init --group)",
                dir.display()
            );
            None
        }
        Ok(Err(problem)) => {
            let refused = crate::error::DeviceError {
                path: dir.to_path_buf(),
                problem,
            };
            crate::debug!("device directory: {refused}: refused");
            None
        }
        Err(_) => None,
    }
}

/// Parses a size with an optional `k`/`K`/`m`/`M` suffix, as smc_run's -r/-t.
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 1024),
        b'm' | b'M' => (&v[..v.len() - 1], 1024 * 1024),
        _ => (v, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

/// Rounds a requested buffer size as SMC-D does: up to a power of two,
/// at least 16 KiB, at most 1 MiB.
pub fn round_dmb_size(bytes: u64) -> u32 {
    use smclo_wire::dmb_header::{MAX_RING_LEN, MIN_RING_LEN};
    let clamped = bytes.clamp(MIN_RING_LEN as u64, MAX_RING_LEN as u64);
    clamped.next_power_of_two() as u32
}

fn dmb_size(name: &str, v: &str) -> Result<u32> {
    parse_size(v).map(round_dmb_size).ok_or_else(|| {
        Error::Config(format!(
            "{name}={v:?} is not a size (digits with optional k or m)"
        ))
    })
}

fn ueid(v: &str) -> Result<[u8; 32]> {
    // SMC's UEIDs are 32 characters, upper-case, blank padded.
    if v.len() > 32 || !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::Config(format!(
            "SMCLO_UEID={v:?}: at most 32 printable ASCII characters"
        )));
    }
    let mut out = [b' '; 32];
    for (o, b) in out.iter_mut().zip(v.bytes()) {
        *o = b.to_ascii_uppercase();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_like_smc_d() {
        assert_eq!(round_dmb_size(1), 16 * 1024);
        assert_eq!(round_dmb_size(16 * 1024 + 1), 32 * 1024);
        assert_eq!(round_dmb_size(64 * 1024), 64 * 1024);
        assert_eq!(round_dmb_size(100 << 20), 1 << 20);
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("12q"), None);
        assert!(dmb_size("SMCLO_RMEM", "lots").is_err());
    }

    /// The system-wide directory is taken only when it is a group device
    /// directory the caller may use.
    #[test]
    fn system_dir_only_as_a_usable_group_device() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("smclo-sysdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        assert_eq!(usable_group_dir(&d), None, "missing");
        std::fs::create_dir(&d).unwrap();
        let set = |mode| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode));
        set(0o700).unwrap();
        assert_eq!(usable_group_dir(&d), None, "a private directory");
        // SAFETY: getegid has no preconditions.
        let gid = unsafe { libc::getegid() };
        std::os::unix::fs::chown(&d, None, Some(gid)).unwrap();
        set(0o2770).unwrap();
        assert_eq!(usable_group_dir(&d), Some(d.clone()), "our group's device");
        set(0o770).unwrap();
        assert_eq!(usable_group_dir(&d), None, "not setgid");
        set(0o2777).unwrap();
        assert_eq!(usable_group_dir(&d), None, "others have access");
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn ueid_is_padded_and_checked() {
        let u = ueid("abc").unwrap();
        assert_eq!(&u[..4], b"ABC ");
        assert!(ueid(&"x".repeat(33)).is_err());
        assert!(ueid("a b").is_err());
    }
}
