//! The loopback-ism device: one shared file per device directory.
//!
//! `<dir>/device` (layout in [`smclo_wire::device_layout`]) holds the GID,
//! CHID and SEID, the knobs, the counters, and four tables: DMBs, listeners
//! ([`crate::registry`]), handshake slots ([`crate::rendezvous`]) and open
//! fallback connections ([`crate::fallbacks`]). Every smclo process that
//! uses the directory (one user, or a group's members: [`crate::access`])
//! maps it shared, for the rest of its life.
//!
//! # Creation
//! The file is built under a temporary name, fully allocated (no holes: a
//! store into a hole on a full filesystem would be a SIGBUS) and
//! initialised, then `link()`ed to `device`. `link` fails with `EEXIST` for every creator but
//! one, so exactly one GID exists even when many processes start at once.
//! Every opener validates the header (magic, version, sizes, geometry) and
//! the file's size, owner and mode *before* mapping it: a damaged file is an
//! [`Error::Device`], never a crash.
//!
//! # Shared tables
//! The four tables keep their entries with one protocol, [`crate::table`]
//! (claim, fill, publish, release, reclaim of dead owners, and why kill -9
//! at any instant leaves them consistent). Opening the device joins the
//! caller's pid namespace's membership lock, which that protocol needs
//! before anything can be claimed.
//!
//! # DMBs
//! A DMB is a sealed memfd (never named in the directory: its descriptor
//! goes to the peer over the handshake's UNIX channel, see
//! [`crate::handshake`]) plus an entry in the DMB table, found by token.
//! The table is what the stats are computed from: `dmbs_cnt`, `conns_active` and
//! `xfer_bytes` remain right after kill -9 because dead owners' entries are
//! reclaimed (and their byte counts folded into `xfer_bytes_retired`).

use crate::access::{self, Creds, Shape};
use crate::dmb::Dmb;
use crate::error::{DeviceError, DeviceProblem, Error, Result};
use crate::owner::Owner;
use crate::table::{Claim, Gen, Head, Holder, Judge, Membership, State, Ticket};
use smclo_wire::device_layout as layout;
use smclo_wire::device_layout::end_flags;
use smclo_wire::dmb_header;
use smclo_wire::ends;
use smclo_wire::reason::Reason;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// CHID of loopback-ism (`SMC_LO_RESERVED_CHID`).
pub use smclo_wire::clc::CHID_LOOPBACK as LOOPBACK_CHID;

/// Creates a group device directory (`smclo dev init --group`).
pub use crate::access::create_group_dir;

/// Which end of a connection: used for DMB table entries and to split the
/// fallback counters into client side and server side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The connecting side.
    Client = 1,
    /// The accepting side.
    Server = 2,
}

/// How writes reach the peer's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Straight from the caller's buffer into the peer's ring (one copy).
    NoCopy,
    /// Through a private send buffer of `sndbuf_len` bytes (two copies), as
    /// the kernel does without `dmb_nocopy`; kept for comparison.
    Copy {
        /// Send buffer size; at most this much is staged per step.
        sndbuf_len: u32,
    },
}

/// The `dmb_type` knob: how DMB memory should be backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmbType {
    /// Ordinary 4 KiB pages (the default).
    Pages4k = 0,
    /// Transparent huge pages (`madvise(MADV_HUGEPAGE)` on the ring).
    Huge = 1,
}

/// One DMB table entry: two cache lines, the first changed by the sending
/// side of the data path (`tx_bytes`), the second by the receiving side
/// (`rx_bytes`), so that a reader and a writer thread of one connection do
/// not share a line; the rest is written when the connection is set up,
/// shut down or closed, and read by `smclo ss` ([`crate::ss`]).
#[repr(C)]
pub(crate) struct DmbEntry {
    head: Head,
    token: AtomicU64,
    peer_token: AtomicU64,
    ring_len: AtomicU32,
    role: AtomicU32,
    /// Bytes this end wrote into the peer's ring.
    tx_bytes: AtomicU64,
    _pad: AtomicU64,
    /// Bytes this end's application consumed from its own ring.
    rx_bytes: AtomicU64,
    /// The TCP connection's local and peer addresses ([`ends`]).
    ends: [AtomicU64; ends::WORDS],
    /// [`end_flags`].
    flags: AtomicU64,
    _reserved: AtomicU64,
}

const _: () = assert!(std::mem::offset_of!(DmbEntry, rx_bytes) == 64);

/// A published DMB table entry as [`Device::published_ends`] read it.
pub(crate) struct RawEnd {
    /// Part of an established connection (otherwise registered for a
    /// handshake that has not finished here).
    pub connected: bool,
    pub owner: Owner,
    pub role: Role,
    pub token: u64,
    pub peer_token: u64,
    pub ring_len: u32,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    /// [`ends`]-packed addresses.
    pub ends: [u64; ends::WORDS],
    /// [`end_flags`].
    pub flags: u64,
}

/// DMB entry states (published; [`crate::table`] has FREE and WRITING).
const DMB_REGISTERED: State = State(2);
const DMB_CONNECTED: State = State(3);
/// Both published states, for moves that accept either.
const DMB_STATES: [State; 2] = [DMB_REGISTERED, DMB_CONNECTED];

/// How long `stats` retries its sum of the byte counts while entries keep
/// retiring ([`Device::xfer_total`]).
const XFER_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

const _: () = assert!(std::mem::size_of::<DmbEntry>() == layout::DMB_ENTRY_LEN as usize);

// ---------------------------------------------------------------------------
// The device.

/// The loopback-ism device of one device directory, mapped for the life of
/// the process.
pub struct Device {
    dir: PathBuf,
    base: *mut u8,
    gid: u64,
    chid: u16,
    seid: [u8; 32],
    /// The device file's identity (filesystem, inode): a new filesystem
    /// mounted on the directory may reuse the inode number.
    file_id: (u64, u64),
    /// The directory's shape: who may use it, and the mode of its files.
    shape: Shape,
    /// Our effective uid when we opened the device.
    opened_by: u32,
    /// The last effective uid other than `opened_by` that
    /// [`Device::check_caller`] judged, and its verdict
    /// ([`ADMITTED_UNKNOWN`] before any).
    admitted: AtomicU64,
    me: Weak<Device>,
    /// The mapping, registered for recovery from a shrunk file
    /// ([`crate::fault`]).
    region: crate::fault::Region,
    /// This process's pid namespace's membership lock ([`crate::table`]):
    /// held before any entry can be claimed.
    _membership: Membership,
}

// SAFETY: `base` points to a MAP_SHARED mapping (or, once lost, the private
// zeros [`crate::fault`] put in its place) that is never unmapped and is
// only accessed through atomics (or read-only fields validated at open), so
// it may be used from any thread.
unsafe impl Send for Device {}
// SAFETY: as above; all mutation of the mapping goes through atomics.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("dir", &self.dir)
            .field("gid", &format_args!("{:016x}", self.gid))
            .finish()
    }
}

/// A snapshot of the device's counters, as `smclo stats` prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// The device's GID.
    pub gid: u64,
    /// SMC-D connections opened since the last reset.
    pub conns_opened: u64,
    /// Connections with at least one live end (distinct token pairs).
    pub conns_active: u64,
    /// DMBs registered since the last reset.
    pub dmbs_registered: u64,
    /// DMBs registered now (live table entries).
    pub dmbs_cnt: u64,
    /// Bytes sent over SMC-D since the last reset.
    pub xfer_bytes: u64,
    /// Live listener registrations.
    pub listeners: u64,
    /// Client-side fallbacks, indexed by `Reason::index()`.
    pub fallback_client: [u64; layout::REASON_SLOTS as usize],
    /// Server-side fallbacks, indexed by `Reason::index()`.
    pub fallback_server: [u64; layout::REASON_SLOTS as usize],
}

impl Stats {
    /// (client side, server side) fallbacks for `r`.
    pub fn fallback(&self, r: Reason) -> (u64, u64) {
        (
            self.fallback_client[r.index()],
            self.fallback_server[r.index()],
        )
    }

    /// All fallbacks, both sides, every reason.
    pub fn fallbacks_total(&self) -> u64 {
        self.fallback_client
            .iter()
            .chain(&self.fallback_server)
            .sum()
    }
}

struct CacheEntry {
    dir: PathBuf,
    file_id: (u64, u64),
    dev: Arc<Device>,
}

static CACHE: Mutex<Vec<CacheEntry>> = Mutex::new(Vec::new());

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn errno_err(errno: i32) -> Error {
    Error::Io(io::Error::from_raw_os_error(errno))
}

/// A random 64-bit value, never zero, unique within the process
/// ([`crate::rng`]: one getrandom per process, not per call).
pub(crate) fn random_u64() -> Result<u64> {
    Ok(crate::rng::next_u64())
}

/// Milliseconds of CLOCK_MONOTONIC, which all processes of the host share.
fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write into; CLOCK_MONOTONIC exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Derives the 32-byte SEID from `/etc/machine-id` (or the hostname):
/// `SEID-` and 16 hex digits of a hash, blank padded, as SMC EIDs are.
pub fn derive_seid() -> [u8; 32] {
    let source = std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    // FNV-1a 64: stable across builds, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"smclo-seid:".iter().chain(source.as_bytes()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let text = format!("SEID-{h:016X}");
    let mut out = [b' '; 32];
    out[..text.len()].copy_from_slice(text.as_bytes());
    out
}

/// Creates the device directory (mode 0700) or checks an existing one: a
/// private directory of ours or a group device directory we may use
/// ([`crate::access`]); anything else is refused, naming it and why.
fn ensure_dir(dir: &Path) -> Result<Shape> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(Error::Config(format!(
                "cannot create device directory {}: its parent does not exist",
                dir.display()
            )))
        }
        Err(e) => return Err(Error::Io(e)),
    }
    Shape::of(dir, &Creds::current())?.map_err(|problem| device_error(dir, problem))
}

fn device_error(path: &Path, problem: DeviceProblem) -> Error {
    Error::Device(DeviceError {
        path: path.to_path_buf(),
        problem,
    })
}

fn open_flags() -> i32 {
    libc::O_NOFOLLOW | libc::O_CLOEXEC
}

/// Builds a device file under a temporary name and links it to `device`.
/// Losing the race (EEXIST) is success: the winner's file is used.
fn create_device_file(dir: &Path, shape: &Shape) -> Result<()> {
    let tmp = dir.join(format!(
        ".device-{}-{:016x}",
        std::process::id(),
        random_u64()?
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(shape.file_mode())
        .custom_flags(open_flags())
        .open(&tmp)?;
    let result = (|| -> Result<()> {
        use std::os::fd::AsRawFd;
        access::set_mode(f.as_raw_fd(), shape.file_mode())?;
        let header = layout::DeviceHeader {
            gid: random_u64()?,
            chid: LOOPBACK_CHID,
            seid: derive_seid(),
        };
        allocate_new(&f)?;
        f.write_all_at(&layout::encode_header(&header), 0)?;
        match std::fs::hard_link(&tmp, dir.join("device")) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(Error::Io(e)),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Gives a new device file (nobody else has it yet) its full size with every
/// block allocated: a store into a hole of a shared mapping on a full
/// filesystem is a SIGBUS, so no page of the device may be a hole. Where the
/// filesystem cannot `fallocate`, the zeros are written.
fn allocate_new(f: &File) -> Result<()> {
    match fallocate(f) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            let zeros = vec![0u8; layout::TOTAL_SIZE as usize];
            f.write_all_at(&zeros, 0)?;
            Ok(())
        }
        r => Ok(r?),
    }
}

/// Allocates the holes of an existing device file (one made by a version
/// that created it sparse): `fallocate` leaves the data, which other
/// processes may be using, as it is. A filesystem that cannot `fallocate`
/// keeps the file as it is.
fn allocate_holes(f: &File, md: &std::fs::Metadata) -> Result<()> {
    if md.blocks() * 512 >= layout::TOTAL_SIZE {
        return Ok(());
    }
    match fallocate(f) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
        r => Ok(r?),
    }
}

/// `fallocate(2)` of the whole device, mode 0 (never `posix_fallocate`,
/// whose fallback writes zeros over data that other processes may own).
fn fallocate(f: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: fallocate on a valid descriptor of ours; no memory effects.
        let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, layout::TOTAL_SIZE as libc::off_t) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `ENOSPC` or `EDQUOT` anywhere in creating or opening the device means the
/// filesystem of `dir` is full: [`Error::NoSpace`].
fn no_space(dir: &Path, e: Error) -> Error {
    match e {
        Error::Io(source) if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            Error::NoSpace {
                dir: dir.to_path_buf(),
                source,
            }
        }
        e => e,
    }
}

impl Device {
    /// Opens (creating if needed) the device in `dir`. One mapping per
    /// directory and process: later calls return the same `Arc`, unless the
    /// device file was replaced meanwhile (another file, or a new
    /// filesystem mounted on the directory, as logind does with
    /// `/run/user/<uid>` at each first login). A full filesystem gives
    /// [`Error::NoSpace`].
    pub fn open(dir: &Path) -> Result<Arc<Device>> {
        Device::open_cached(dir).map_err(|e| no_space(dir, e))
    }

    fn open_cached(dir: &Path) -> Result<Arc<Device>> {
        let shape = ensure_dir(dir)?;
        let path = dir.join("device");
        let file_id = std::fs::symlink_metadata(&path)
            .map(|m| (m.dev(), m.ino()))
            .ok();
        {
            let cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(c) = cache
                .iter()
                .find(|c| c.dir == dir && Some(c.file_id) == file_id && !c.dev.lost())
            {
                return Ok(c.dev.clone());
            }
        }
        let dev = Device::open_uncached(dir, shape)?;
        let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache
            .iter()
            .find(|c| c.dir == dir && c.file_id == dev.file_id && !c.dev.lost())
        {
            // Another thread mapped the same file meanwhile: use one mapping.
            return Ok(c.dev.clone());
        }
        cache.retain(|c| c.dir != dir);
        cache.push(CacheEntry {
            dir: dir.to_path_buf(),
            file_id: dev.file_id,
            dev: dev.clone(),
        });
        Ok(dev)
    }

    /// Opens the device of `SMCLO_DEVICE_DIR` (default:
    /// [`crate::config::default_device_dir`]).
    pub fn open_default() -> Result<Arc<Device>> {
        Device::open(&crate::config::Config::from_env()?.device_dir)
    }

    fn open_uncached(dir: &Path, shape: Shape) -> Result<Arc<Device>> {
        let path = dir.join("device");
        let mut created = false;
        let file = loop {
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(open_flags())
                .open(&path)
            {
                Ok(f) => break f,
                Err(e) if e.kind() == io::ErrorKind::NotFound && !created => {
                    create_device_file(dir, &shape)?;
                    created = true;
                }
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                    return Err(device_error(&path, DeviceProblem::SymbolicLink))
                }
                Err(e) => return Err(Error::Io(e)),
            }
        };
        Device::map(dir, &path, &file, shape)
    }

    /// Validates an open device file (type, owner, mode, size, header) and
    /// maps it. Everything is checked before mmap, so a short file can never
    /// make us touch a page past its end.
    fn map(dir: &Path, path: &Path, file: &File, shape: Shape) -> Result<Arc<Device>> {
        let md = file.metadata()?;
        let bad = |problem| Err(device_error(path, problem));
        if !md.file_type().is_file() {
            return bad(DeviceProblem::NotARegularFile);
        }
        if let Some(problem) = shape.file_problem(md.uid(), md.gid(), md.mode()) {
            return bad(problem);
        }
        let mut head = vec![0u8; layout::HEADER_LEN as usize];
        let mut have = 0;
        while have < head.len() {
            match file.read_at(&mut head[have..], have as u64) {
                Ok(0) => break,
                Ok(n) => have += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io(e)),
            }
        }
        head.truncate(have);
        let hdr = match layout::validate_header(&head, md.len()) {
            Ok(h) => h,
            Err(e) => return bad(DeviceProblem::Header(e)),
        };
        if hdr.chid != LOOPBACK_CHID {
            return bad(DeviceProblem::WrongChid(hdr.chid));
        }
        allocate_holes(file, &md)?;
        let membership = Membership::join(dir, shape.file_mode())?;
        use std::os::fd::AsRawFd;
        let len = layout::TOTAL_SIZE as usize;
        // SAFETY: a fresh shared mapping of `len` bytes of an open file that
        // has exactly that size (checked above); the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Io(io::Error::last_os_error()));
        }
        // SAFETY: the mapping is never unmapped (see `Device`'s `Send`),
        // so its spinner slots live as long as the process; atomics at an
        // 8-aligned offset of the page-aligned mapping, any bits valid.
        let slots = unsafe {
            &*((p as *const u8).add(layout::off::SPINNERS)
                as *const [AtomicU64; layout::SPIN_SLOTS])
        };
        let dev = Arc::new_cyclic(|me| Device {
            dir: dir.to_path_buf(),
            base: p as *mut u8,
            gid: hdr.gid,
            chid: hdr.chid,
            seid: hdr.seid,
            file_id: (md.dev(), md.ino()),
            shape,
            opened_by: euid(),
            admitted: AtomicU64::new(ADMITTED_UNKNOWN),
            me: me.clone(),
            region: crate::fault::Region::register(p.cast(), len),
            _membership: membership,
        });
        crate::spin::use_table(slots);
        Ok(dev)
    }

    /// Whether this process lost its mapping of the device: the file was
    /// shrunk under it (or a hole in it could not be filled), and
    /// [`crate::fault`] put private zeros in its place. A lost device
    /// reads as switched off; its connections are reset
    /// ([`crate::conn`]), and [`Device::open`] maps the file anew.
    pub fn lost(&self) -> bool {
        self.region.lost()
    }

    /// The device directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The device's GID (random, fixed when the device file was created).
    pub fn gid(&self) -> u64 {
        self.gid
    }

    /// The device's CHID: always [`LOOPBACK_CHID`].
    pub fn chid(&self) -> u16 {
        self.chid
    }

    /// The SEID (32 bytes, blank padded ASCII).
    pub fn seid(&self) -> [u8; 32] {
        self.seid
    }

    /// The device directory's shape: private to one uid, or shared by a
    /// group ([`crate::access`]).
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The mode of every file smclo creates in the device directory.
    pub fn file_mode(&self) -> u32 {
        self.shape.file_mode()
    }

    /// Whether the calling process may still use the device: it may, unless
    /// it changed its effective uid since it opened the device (a server's
    /// workers that switch from root to an unprivileged user keep root's
    /// mapping) and the device does not admit its new credentials. Then
    /// its connections fall back with [`Reason::UidChanged`]. The verdict
    /// for a changed uid is kept: one `geteuid` per handshake otherwise.
    pub fn check_caller(&self) -> std::result::Result<(), Reason> {
        let uid = euid();
        if uid == self.opened_by {
            return Ok(());
        }
        let seen = self.admitted.load(Ordering::Relaxed);
        let ok = if seen != ADMITTED_UNKNOWN && (seen >> 1) as u32 == uid {
            seen & 1 == 1
        } else {
            let ok = self.shape.admits(&Creds::current());
            self.admitted
                .store(((uid as u64) << 1) | ok as u64, Ordering::Relaxed);
            ok
        };
        if ok {
            return Ok(());
        }
        crate::debug!(
            "this process changed its uid from {} to {uid} after opening the device in {}, which uid {uid} may not use (the device is {}); for such a server use a group device (smclo dev init --group)",
            self.opened_by,
            self.dir.display(),
            self.shape
        );
        Err(Reason::UidChanged)
    }

    /// A reference to a value of type `T` at byte offset `off` of the mapping.
    ///
    /// Only used with `T` made of atomics, at offsets from the layout.
    pub(crate) fn at<T>(&self, off: usize) -> &T {
        assert!(off + std::mem::size_of::<T>() <= layout::TOTAL_SIZE as usize);
        assert!(off.is_multiple_of(std::mem::align_of::<T>()));
        // SAFETY: in bounds of the mapping (asserted; the file has exactly
        // TOTAL_SIZE bytes, validated at open), aligned (asserted; the mapping
        // is page aligned), and valid for the device's lifetime because the
        // mapping is never unmapped. Callers use only atomic types, which are
        // sound to share with other threads and processes, and any bit
        // pattern is a valid integer.
        unsafe { &*(self.base.add(off) as *const T) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.at(off)
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.at(off)
    }

    pub(crate) fn dmb_entry(&self, i: usize) -> &DmbEntry {
        debug_assert!(i < layout::DMB_ENTRIES as usize);
        self.at(layout::DMB_TABLE_OFF as usize
            + (i % layout::DMB_ENTRIES as usize) * layout::DMB_ENTRY_LEN as usize)
    }

    /// DMB table entry `i` if it holds incarnation `gen` (not freed since).
    fn live_entry(&self, i: usize, gen: Gen) -> Option<&DmbEntry> {
        let e = self.dmb_entry(i);
        let w = e.head.word();
        (w.gen() == gen && !w.is_free()).then_some(e)
    }

    /// An `Arc` of this device (every `Device` lives in an `Arc`).
    pub(crate) fn arc(&self) -> Arc<Device> {
        self.me
            .upgrade()
            .expect("a Device is only reachable through its Arc")
    }

    // --- knobs -------------------------------------------------------------

    /// Knob `active`: whether new connections may use SMC-D.
    pub fn active(&self) -> bool {
        self.u32_at(layout::off::ACTIVE).load(Ordering::Relaxed) != 0
    }

    /// Sets knob `active`.
    pub fn set_active(&self, on: bool) {
        self.u32_at(layout::off::ACTIVE)
            .store(on as u32, Ordering::Relaxed)
    }

    /// Knob `dmb_copy`: senders copy into a private buffer first (the seeds'
    /// "SMC-lo" mode) instead of writing into the peer's DMB.
    pub fn dmb_copy(&self) -> bool {
        self.u32_at(layout::off::DMB_COPY).load(Ordering::Relaxed) != 0
    }

    /// Sets knob `dmb_copy`.
    pub fn set_dmb_copy(&self, on: bool) {
        self.u32_at(layout::off::DMB_COPY)
            .store(on as u32, Ordering::Relaxed)
    }

    /// Knob `dmb_type`. Unknown values (another version wrote them) read as
    /// the default, 4 KiB pages.
    pub fn dmb_type(&self) -> DmbType {
        match self.u32_at(layout::off::DMB_TYPE).load(Ordering::Relaxed) {
            1 => DmbType::Huge,
            _ => DmbType::Pages4k,
        }
    }

    /// Sets knob `dmb_type`.
    pub fn set_dmb_type(&self, t: DmbType) {
        self.u32_at(layout::off::DMB_TYPE)
            .store(t as u32, Ordering::Relaxed)
    }

    // --- counters ----------------------------------------------------------

    /// Counts one SMC-D connection opened (call once per connection end
    /// pair, from the client side).
    pub fn count_conn_opened(&self) {
        self.u64_at(layout::off::CONNS_OPENED)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one fallback to TCP for `reason`, on the `side` that decided.
    pub fn count_fallback(&self, reason: Reason, side: Role) {
        let idx = reason.index();
        if idx >= layout::REASON_SLOTS as usize {
            return;
        }
        let base = match side {
            Role::Client => layout::off::FALLBACK_CLIENT,
            Role::Server => layout::off::FALLBACK_SERVER,
        };
        self.u64_at(base + 8 * idx).fetch_add(1, Ordering::Relaxed);
    }

    /// The counters of the device file and its DMB table, `listeners` left
    /// 0 (the listener table is [`crate::registry`]'s: [`Device::stats`],
    /// in [`crate::ss`], adds it). Also reclaims the DMB table entries of
    /// dead owners first, so that the gauges are right after kill -9.
    pub(crate) fn counters(&self) -> Stats {
        self.reclaim_dead_dmbs();
        let mut judge = Judge::new(&self.dir);
        let mut pairs = std::collections::HashSet::new();
        let mut dmbs_cnt = 0;
        for i in 0..layout::DMB_ENTRIES as usize {
            let e = self.dmb_entry(i);
            let w = e.head.word();
            if w.is_free() {
                continue;
            }
            if !DMB_STATES.contains(&w.state()) || judge.dead(&e.head, w) {
                continue;
            }
            dmbs_cnt += 1;
            if w.state() == DMB_CONNECTED {
                let (a, b) = (
                    e.token.load(Ordering::Relaxed),
                    e.peer_token.load(Ordering::Relaxed),
                );
                pairs.insert((a.min(b), a.max(b)));
            }
        }
        let total = self.xfer_total();
        let base = self.u64_at(layout::off::XFER_BASE).load(Ordering::Relaxed);
        let mut fallback_client = [0u64; layout::REASON_SLOTS as usize];
        let mut fallback_server = [0u64; layout::REASON_SLOTS as usize];
        for i in 0..layout::REASON_SLOTS as usize {
            fallback_client[i] = self
                .u64_at(layout::off::FALLBACK_CLIENT + 8 * i)
                .load(Ordering::Relaxed);
            fallback_server[i] = self
                .u64_at(layout::off::FALLBACK_SERVER + 8 * i)
                .load(Ordering::Relaxed);
        }
        Stats {
            gid: self.gid,
            conns_opened: self
                .u64_at(layout::off::CONNS_OPENED)
                .load(Ordering::Relaxed),
            conns_active: pairs.len() as u64,
            dmbs_registered: self
                .u64_at(layout::off::DMBS_REGISTERED)
                .load(Ordering::Relaxed),
            dmbs_cnt,
            xfer_bytes: total.saturating_sub(base),
            listeners: 0,
            fallback_client,
            fallback_server,
        }
    }

    /// Every published DMB table entry (connected: one per SMC-D connection
    /// end; registered: a handshake under way), each read consistently
    /// with its word; dead owners' entries are reclaimed first, as for
    /// [`Device::stats`].
    pub(crate) fn published_ends(&self) -> Vec<RawEnd> {
        self.reclaim_dead_dmbs();
        (0..layout::DMB_ENTRIES as usize)
            .filter_map(|i| {
                let e = self.dmb_entry(i);
                let w = e.head.word();
                if !DMB_STATES.contains(&w.state()) {
                    return None;
                }
                let Holder::Known(owner) = e.head.holder(w)? else {
                    return None;
                };
                let role = match e.role.load(Ordering::Relaxed) {
                    r if r == Role::Server as u32 => Role::Server,
                    _ => Role::Client,
                };
                // Read while the word (the incarnation judged) is unchanged.
                let (_, end) = e.head.read(
                    |now| now == w,
                    || RawEnd {
                        connected: w.state() == DMB_CONNECTED,
                        owner,
                        role,
                        token: e.token.load(Ordering::Relaxed),
                        peer_token: e.peer_token.load(Ordering::Relaxed),
                        ring_len: e.ring_len.load(Ordering::Relaxed),
                        tx_bytes: e.tx_bytes.load(Ordering::Relaxed),
                        rx_bytes: e.rx_bytes.load(Ordering::Relaxed),
                        ends: e.ends.each_ref().map(|a| a.load(Ordering::Relaxed)),
                        flags: e.flags.load(Ordering::Acquire),
                    },
                )?;
                Some(end)
            })
            .collect()
    }

    /// Number of DMB table entries not FREE, whatever their owner's state:
    /// after a sweep this equals `stats().dmbs_cnt` (diagnostics and tests
    /// use it to see that dead owners' entries were really reclaimed).
    pub fn dmb_entries_in_use(&self) -> usize {
        (0..layout::DMB_ENTRIES as usize)
            .filter(|&i| !self.dmb_entry(i).head.word().is_free())
            .count()
    }

    /// Zeroes the counters (`smclo stats reset`). Gauges (active
    /// connections, DMBs in use) are not counters and stay.
    pub fn reset_stats(&self) {
        for off in [layout::off::CONNS_OPENED, layout::off::DMBS_REGISTERED] {
            self.u64_at(off).store(0, Ordering::Relaxed);
        }
        for i in 0..layout::REASON_SLOTS as usize {
            self.u64_at(layout::off::FALLBACK_CLIENT + 8 * i)
                .store(0, Ordering::Relaxed);
            self.u64_at(layout::off::FALLBACK_SERVER + 8 * i)
                .store(0, Ordering::Relaxed);
        }
        // xfer_bytes = retired + live - base: moving the base keeps the
        // per-entry byte counts (which the owners keep adding to) intact.
        self.u64_at(layout::off::XFER_BASE)
            .store(self.xfer_total(), Ordering::Relaxed);
    }

    // --- DMBs --------------------------------------------------------------

    /// Registers a DMB with a ring of `ring_len` bytes for this process.
    ///
    /// Claims a DMB table entry (`ENOSPC` when all are in use by live
    /// processes: the handshake reports `MAX_DMB`) under a fresh token, and
    /// fills it with a DMB from this process's pool ([`crate::dmb::pool`]) or a
    /// new sealed memfd ([`Dmb::create_own`]). Reclaims the table entries of
    /// dead processes first (at most every [`SWEEP_INTERVAL_MS`], and always
    /// when the table is full).
    pub fn register_dmb(&self, ring_len: u32, role: Role) -> Result<DmbHandle> {
        self.register_dmb_preferring(ring_len, role, crate::dmb::pool::Prefer::default())
    }

    /// [`register_dmb`](Self::register_dmb), reusing the pooled DMB that
    /// `prefer` names if it is free: the peer keeps a mapping of it.
    pub fn register_dmb_preferring(
        &self,
        ring_len: u32,
        role: Role,
        prefer: crate::dmb::pool::Prefer,
    ) -> Result<DmbHandle> {
        self.maybe_sweep();
        let me = Owner::current();
        let (idx, claim) = match self.claim_dmb_entry(&me) {
            Some(c) => c,
            None => {
                self.sweep();
                self.claim_dmb_entry(&me)
                    .ok_or_else(|| errno_err(libc::ENOSPC))?
            }
        };
        let e = self.dmb_entry(idx);
        let token = random_u64()?;
        let dmb = match crate::dmb::pool::take(ring_len, self.gid, token, prefer) {
            // The last peer's bytes stay in a pooled ring: on a group
            // device the next peer may be another user, who must not see
            // them.
            Some(d) if matches!(self.shape, Shape::Group { .. }) => match d.forget_ring() {
                Ok(()) => d,
                Err(err) => {
                    e.head.free(claim);
                    return Err(err.into());
                }
            },
            Some(d) => d,
            None => match Dmb::create_own(token, ring_len, self.gid, me.pid, me.start) {
                Ok(d) => d,
                Err(err) => {
                    e.head.free(claim);
                    return Err(err);
                }
            },
        };
        e.token.store(token, Ordering::Relaxed);
        e.peer_token.store(0, Ordering::Relaxed);
        e.ring_len.store(ring_len, Ordering::Relaxed);
        e.role.store(role as u32, Ordering::Relaxed);
        e.tx_bytes.store(0, Ordering::Relaxed);
        e.rx_bytes.store(0, Ordering::Relaxed);
        for w in &e.ends {
            w.store(0, Ordering::Relaxed);
        }
        e.flags.store(0, Ordering::Relaxed);
        let ticket = e.head.publish(claim, DMB_REGISTERED);
        self.u64_at(layout::off::DMBS_REGISTERED)
            .fetch_add(1, Ordering::Relaxed);
        crate::debug!("registered DMB {token:016x} ({ring_len} bytes, {role:?}) in entry {idx}");
        Ok(DmbHandle {
            reg: Registration {
                dev: self.arc(),
                idx,
                ticket,
                token,
                role,
            },
            dmb,
        })
    }

    /// Claims a FREE DMB table entry, starting at a random index so that
    /// processes do not contend on the first ones.
    fn claim_dmb_entry(&self, me: &Owner) -> Option<(usize, Claim)> {
        let n = layout::DMB_ENTRIES as usize;
        let start = (random_u64().ok()? % n as u64) as usize;
        (0..n).find_map(|k| {
            let i = (start + k) % n;
            self.dmb_entry(i).head.claim(me).map(|c| (i, c))
        })
    }

    /// The registration of DMB table entry `idx` holding `token` (an
    /// accepting end's, or with `client` a connecting end's) that the image
    /// of this process before an exec had: its owner is this process (same
    /// pid and start time) or another of its fork family, which hands it
    /// over when it lets go. `None` if the entry is no longer that.
    pub fn adopt_registration(&self, idx: usize, token: u64, client: bool) -> Option<Registration> {
        if idx >= layout::DMB_ENTRIES as usize {
            return None;
        }
        let e = self.dmb_entry(idx);
        let w = e.head.word();
        if w.is_free() || e.token.load(Ordering::Relaxed) != token {
            return None;
        }
        Some(Registration {
            dev: self.arc(),
            idx,
            ticket: Ticket::of(w),
            token,
            role: if client { Role::Client } else { Role::Server },
        })
    }

    /// Maps the peer's DMB `token` from the memfd `fd` it passed over the
    /// handshake channel ([`Dmb::attach_peer`] checks seals, owner, size,
    /// header, token and GID); a refusal is an [`Error::Attach`].
    pub fn attach_dmb(&self, token: u64, fd: File) -> Result<Dmb> {
        Dmb::attach_peer(fd, token, self.gid, |uid| self.may_own_dmb(uid))
    }

    /// Maps the peer's DMB `token` whose memfd is `id`, owned by `owner`,
    /// from a mapping this process keeps of it since the peer last passed
    /// it ([`crate::dmb::pool`]); `None` when it keeps none (the peer must pass
    /// the descriptor).
    pub fn attach_cached_dmb(&self, id: (u64, u64), token: u64, owner: Owner) -> Option<Dmb> {
        Dmb::attach_cached(id, token, self.gid, (owner.pid, owner.start))
    }

    /// Whether a peer's DMB (a memfd, owned by the uid that created it) may
    /// belong to `uid`: ours on a private device; on a group device any
    /// uid, as the handshake channel's credential check
    /// ([`access::check_peer`]) already vouched for the peer that passed it.
    fn may_own_dmb(&self, uid: u32) -> bool {
        uid == euid() || matches!(self.shape, Shape::Group { .. })
    }

    // --- garbage collection ------------------------------------------------

    /// Sweeps when the last sweep (by any process) is at least
    /// [`SWEEP_INTERVAL_MS`] old; the CAS on the timestamp elects one sweeper.
    fn maybe_sweep(&self) {
        let last = self.u64_at(layout::off::LAST_SWEEP_MS);
        let now = monotonic_ms();
        let prev = last.load(Ordering::Relaxed);
        if now.saturating_sub(prev) < SWEEP_INTERVAL_MS && prev <= now {
            return;
        }
        if last
            .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.sweep();
        }
    }

    /// Removes what dead processes left: their DMB and fallback table entries, `dmb-*`
    /// files that older versions (which named DMBs in the directory) left
    /// behind, and temporary device files of dead creators.
    /// Runs on its own schedule inside [`Device::register_dmb`] and
    /// [`Device::stats`]; public so tools and tests can force it.
    pub fn sweep(&self) {
        self.u64_at(layout::off::LAST_SWEEP_MS)
            .store(monotonic_ms(), Ordering::Relaxed);
        self.reclaim_dead_dmbs();
        self.reclaim_dead_fallbacks();
        self.remove_dead_files();
    }

    /// Frees the DMB table entries of dead owners, folding their byte counts
    /// into `xfer_bytes_retired`.
    fn reclaim_dead_dmbs(&self) {
        let mut judge = Judge::new(&self.dir);
        for i in 0..layout::DMB_ENTRIES as usize {
            let e = self.dmb_entry(i);
            if let Some(c) = judge.reclaim(&e.head, e.head.word()) {
                self.retire_entry(e, c);
            }
        }
    }

    /// Frees the fallback table's entries of dead owners. Each entry starts
    /// with its [`Head`]; the rest of it is [`crate::fallbacks`]'s.
    fn reclaim_dead_fallbacks(&self) {
        let mut judge = Judge::new(&self.dir);
        for i in 0..layout::FALLBACK_ENTRIES as usize {
            let off = layout::FALLBACK_OFF as usize + i * layout::FALLBACK_ENTRY_LEN as usize;
            let head: &Head = self.at(off);
            if let Some(c) = judge.reclaim(head, head.word()) {
                head.free(c);
            }
        }
    }

    /// Folds an entry's byte count into the retired total and frees it.
    ///
    /// The move is bracketed by [`layout::off::XFER_SEQ`] (odd while under
    /// way), so that [`Device::xfer_total`] never sums the bytes in both
    /// places, or in neither.
    fn retire_entry(&self, e: &DmbEntry, c: Claim) {
        let seq = self.u64_at(layout::off::XFER_SEQ);
        seq.fetch_add(1, Ordering::AcqRel);
        let tx = e.tx_bytes.swap(0, Ordering::AcqRel);
        self.u64_at(layout::off::XFER_RETIRED)
            .fetch_add(tx, Ordering::AcqRel);
        seq.fetch_add(1, Ordering::AcqRel);
        e.head.free(c);
    }

    /// Bytes sent over the device's connections since it was created: the
    /// retired total plus the live entries' counts, taken while no entry
    /// retired (the sequence was even and unchanged around the sum). Busy
    /// retirers only delay the sum (tried again for up to [`XFER_WAIT`]); a
    /// retirer killed halfway leaves the sequence odd for good: once it has
    /// stayed odd and unchanged for a few tries the last sum is taken, off
    /// by at most that entry's bytes.
    fn xfer_total(&self) -> u64 {
        const STUCK_TRIES: usize = 8;
        let seq = self.u64_at(layout::off::XFER_SEQ);
        let until = std::time::Instant::now() + XFER_WAIT;
        let (mut total, mut stuck, mut prev) = (0, 0, None);
        while stuck < STUCK_TRIES && std::time::Instant::now() < until {
            let s0 = seq.load(Ordering::Acquire);
            let mut live: u64 = 0;
            for i in 0..layout::DMB_ENTRIES as usize {
                let e = self.dmb_entry(i);
                if !e.head.word().is_free() {
                    live = live.wrapping_add(e.tx_bytes.load(Ordering::Acquire));
                }
            }
            total = self
                .u64_at(layout::off::XFER_RETIRED)
                .load(Ordering::Acquire)
                .wrapping_add(live);
            if s0.is_multiple_of(2) && seq.load(Ordering::Acquire) == s0 {
                break;
            }
            stuck = if prev == Some(s0) { stuck + 1 } else { 0 };
            prev = Some(s0);
            std::thread::yield_now();
        }
        total
    }

    /// Unlinks `dmb-*` files of dead owners (read with a plain `pread` of
    /// the header, never mapped: the file may be short or garbage) and
    /// `.device-<pid>-*` temporaries of dead creators.
    fn remove_dead_files(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut judge = Judge::new(&self.dir);
        for ent in rd.flatten() {
            let name = ent.file_name();
            let name = name.as_bytes();
            if let Some(hex) = name.strip_prefix(b"dmb-") {
                if hex.len() == 16
                    && hex.iter().all(u8::is_ascii_hexdigit)
                    && self.dmb_file_is_dead(&ent.path(), &mut judge)
                {
                    crate::debug!(
                        "removing DMB file of a dead owner: {}",
                        ent.path().display()
                    );
                    let _ = std::fs::remove_file(ent.path());
                }
            } else if let Some(rest) = name.strip_prefix(b".device-") {
                let pid = std::str::from_utf8(rest)
                    .ok()
                    .and_then(|r| r.split('-').next()?.parse::<u32>().ok());
                if let Some(pid) = pid {
                    if !Owner::local(pid, 0).pid_exists() {
                        let _ = std::fs::remove_file(ent.path());
                    }
                }
            }
        }
    }

    /// Whether a DMB file belongs to a dead process. A file without a valid
    /// header yet is its creator's until it is [`STALE_FILE_SECS`] old
    /// (`Dmb::create` writes the header right after creating the file).
    fn dmb_file_is_dead(&self, path: &Path, judge: &mut Judge<'_>) -> bool {
        let Ok(f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(open_flags() | libc::O_NONBLOCK)
            .open(path)
        else {
            return false;
        };
        let Ok(md) = f.metadata() else { return false };
        if !md.file_type().is_file() || md.uid() != euid() {
            return false;
        }
        let mut h = [0u8; dmb_header::STATIC_LEN];
        let hdr = f
            .read_exact_at(&mut h, 0)
            .ok()
            .and_then(|()| dmb_header::parse(&h).ok());
        let Some(hdr) = hdr.filter(|hdr| md.len() >= hdr.file_len()) else {
            let age = md
                .modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .map(|d| d.as_secs());
            return age.is_some_and(|a| a >= STALE_FILE_SECS);
        };
        // The file header names no pid namespace: judged in ours.
        judge.owner_dead(Owner::local(hdr.owner_pid, hdr.owner_start))
    }
}

/// [`Device::admitted`] before any changed uid was judged.
const ADMITTED_UNKNOWN: u64 = u64::MAX;

/// Minimum time between two automatic sweeps for dead owners.
pub const SWEEP_INTERVAL_MS: u64 = 200;

/// Age after which a DMB file that never got a valid header is removed.
pub const STALE_FILE_SECS: u64 = 10;

// ---------------------------------------------------------------------------
// DmbHandle.

/// A registered DMB owned by this process: the mapping of its own receive
/// ring plus its [`Registration`] in the DMB table. Dropping it unregisters
/// the DMB (the mapping goes back to the process's pool, [`crate::dmb::pool`]). A connection takes the two apart ([`DmbHandle::into_parts`]):
/// the mapping goes to the data path, the registration stays with the
/// connection for stats and unregistration.
pub struct DmbHandle {
    reg: Registration,
    dmb: Dmb,
}

impl std::fmt::Debug for DmbHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.reg.fmt(f)
    }
}

impl DmbHandle {
    /// The DMB's token.
    pub fn token(&self) -> u64 {
        self.reg.token
    }

    /// Which end registered it.
    pub fn role(&self) -> Role {
        self.reg.role
    }

    /// The mapping of the DMB (this end's receive ring).
    pub fn dmb(&self) -> &Dmb {
        &self.dmb
    }

    /// The device it is registered on.
    pub fn device(&self) -> &Arc<Device> {
        &self.reg.dev
    }

    /// Counts `n` bytes sent, as a connection's data path does through
    /// its [`ConnRecord`].
    pub fn add_tx(&self, n: u64) {
        self.reg.record().add_tx(n)
    }

    /// See [`Registration::set_connected`].
    pub fn set_connected(&self, peer_token: u64, local: SocketAddr, peer: SocketAddr, mode: Mode) {
        self.reg.set_connected(peer_token, local, peer, mode)
    }

    /// The memfd holding the DMB, to pass to the peer (`SCM_RIGHTS`).
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.dmb.own_fd().expect("a registered DMB has its memfd")
    }

    /// The identity (device, inode) of the DMB's memfd.
    pub fn id(&self) -> (u64, u64) {
        self.dmb.own_id().expect("a registered DMB has its memfd")
    }

    /// The mapping and the registration, to be kept by different owners
    /// (the handshake is done: the peer has the memfd). The memfd is closed
    /// now ([`Dmb::close_own_file`]) unless the pool could take the DMB
    /// back when the connection ends, and in a process short of
    /// descriptors.
    pub fn into_parts(mut self) -> (Dmb, Registration) {
        if crate::fdnum::pressed() || !crate::dmb::pool::may_keep_memfd() {
            self.dmb.close_own_file();
        }
        (self.dmb, self.reg)
    }
}

/// A DMB's entry in the device's DMB table, owned by the process named in
/// the entry's word: the one that registered it, until it hands the entry
/// over ([`Registration::hand_over`]). Dropping it in the owning process
/// unregisters the DMB: the table entry is freed (its byte count folded
/// into `xfer_bytes_retired`). The memory is the mapping's business
/// ([`Dmb`], [`crate::dmb::pool`]); a pooled DMB has no table entry, so
/// `dmbs_cnt` counts DMBs registered for handshakes and connections, never
/// pooled ones.
///
/// Copies inherited through `fork` share the entry: each counts the bytes
/// its process moves ([`ConnRecord`]) while the entry exists.
/// [`set_connected`](Self::set_connected) and the drop act only in the
/// process that owns the entry at the time of the call (never a pid cached
/// at creation), so after a hand-over the new owner unregisters and every
/// other copy's drop does nothing.
pub struct Registration {
    dev: Arc<Device>,
    idx: usize,
    /// The incarnation registered, under the registering process (a fork
    /// child that receives the entry has the same generation).
    ticket: Ticket,
    token: u64,
    role: Role,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("token", &format_args!("{:016x}", self.token))
            .field("role", &self.role)
            .field("entry", &self.idx)
            .finish()
    }
}

impl Registration {
    /// The DMB's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The entry, if it is still this registration's (same generation, not
    /// freed) and, with `own`, the calling process owns it.
    fn entry(&self, own: bool) -> Option<&DmbEntry> {
        let e = self.dev.live_entry(self.idx, self.ticket.gen())?;
        (!own || e.head.word().pid() == Owner::current().pid).then_some(e)
    }

    /// This registration's incarnation under the calling process.
    fn my_ticket(&self) -> Ticket {
        self.ticket.with_pid(Owner::current().pid)
    }

    /// Marks the DMB as part of an established connection with the DMB
    /// `peer_token`, between TCP addresses `local` and `peer`, moving data
    /// in `mode`; from now on the pair counts in `conns_active` and `smclo
    /// ss` lists it. The addresses are stored before the state changes, so
    /// a reader that sees the entry connected sees them.
    pub fn set_connected(&self, peer_token: u64, local: SocketAddr, peer: SocketAddr, mode: Mode) {
        let Some(e) = self.entry(true) else { return };
        e.peer_token.store(peer_token, Ordering::Relaxed);
        for (w, v) in e.ends.iter().zip(ends::pack(local, peer)) {
            w.store(v, Ordering::Relaxed);
        }
        let copy = matches!(mode, Mode::Copy { .. });
        e.flags
            .store(if copy { end_flags::COPY } else { 0 }, Ordering::Relaxed);
        let _ = e.head.cas(self.my_ticket(), DMB_REGISTERED, DMB_CONNECTED);
    }

    /// What the connection's data path updates in the entry (byte counts,
    /// close flags), for as long as the entry is this registration's.
    pub fn record(&self) -> ConnRecord {
        ConnRecord {
            dev: self.dev.clone(),
            idx: self.idx,
            gen: self.ticket.gen(),
        }
    }

    /// The DMB table entry and whether this end connected, for a new image
    /// of this process (exec); `None` once the entry is gone.
    pub fn exec_entry(&self) -> Option<(usize, bool)> {
        self.entry(false)?;
        Some((self.idx, self.role == Role::Client))
    }

    /// Makes process `to` (a fork child that still holds the connection)
    /// the owner of the table entry, when the calling process owns it and
    /// is letting the connection go: the entry, its byte count and its
    /// state stay, and from now on `to` unregisters it.
    /// Returns whether the entry was handed over (false when the calling
    /// process does not own it).
    ///
    /// The word goes through WRITING under `to`'s pid while the start time
    /// changes, so no sweep judges `to` by our start time; if `to` dies
    /// (even by SIGKILL) the entry is reclaimed as any dead owner's.
    pub fn hand_over(&self, to: Owner) -> bool {
        let me = Owner::current().pid;
        if to.pid == 0 || to.pid == me {
            return false;
        }
        let e = self.dev.dmb_entry(self.idx);
        let done = e
            .head
            .hand_over(self.my_ticket(), &DMB_STATES, &to)
            .is_some();
        if done {
            crate::debug!(
                "DMB {:016x} (entry {}) handed over to pid {}",
                self.token,
                self.idx,
                to.pid
            );
        }
        done
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let me = Owner::current();
        let e = self.dev.dmb_entry(self.idx);
        let mine = self.my_ticket();
        // A hand-over to us may be finishing (WRITING under our pid, two
        // stores long): wait for it, briefly.
        for _ in 0..10_000 {
            if e.head.word() != mine.word(State::WRITING) {
                break;
            }
            std::thread::yield_now();
        }
        // Only the current owner's copy unregisters (the release names it).
        if let Some(c) = e.head.release(mine, &me) {
            self.dev.retire_entry(e, c);
        }
    }
}

/// A connection end's DMB table entry as its data path sees it: the byte
/// counts and close flags that `smclo ss` shows. It does not own the entry
/// (the [`Registration`] does): every update first checks that the entry is
/// still that registration's incarnation, so a record that outlives it
/// (a fork child's copy, a late call) changes nothing. Updates are single
/// atomic operations on the entry, no system call.
#[derive(Clone)]
pub struct ConnRecord {
    dev: Arc<Device>,
    idx: usize,
    gen: Gen,
}

impl std::fmt::Debug for ConnRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnRecord(entry {})", self.idx)
    }
}

impl ConnRecord {
    /// Whether this process lost its mapping of the record's device
    /// ([`Device::lost`]).
    pub fn device_lost(&self) -> bool {
        self.dev.lost()
    }

    /// `n` bytes written into the peer's ring (summed into `xfer_bytes`).
    pub fn add_tx(&self, n: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.tx_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `n` bytes consumed from this end's ring.
    pub fn add_rx(&self, n: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.rx_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Sets [`end_flags`] bits (async-signal-safe: one load, one atomic or).
    pub fn set_flags(&self, f: u64) {
        if let Some(e) = self.dev.live_entry(self.idx, self.gen) {
            e.flags.fetch_or(f, Ordering::Release);
        }
    }
}
