//! Creating and opening the device file.
//!
//! The file is built under a temporary name, fully allocated (no holes: a
//! store into a hole on a full filesystem would be a SIGBUS) and
//! initialised, then `link()`ed to `device`. `link` fails with `EEXIST`
//! for every creator but one, so exactly one GID exists even when many
//! processes start at once.
//! Every opener validates the header (magic, version, sizes, geometry) and
//! the file's size, owner and mode *before* mapping it: a damaged file is an
//! [`Error::Device`], never a crash.

use super::{euid, random_u64, Device, ADMITTED_UNKNOWN, LOOPBACK_CHID};
use crate::access::{self, Creds, Shape};
use crate::error::{DeviceError, DeviceProblem, Error, Result};
use crate::table::Membership;
use smclo_wire::device_layout as layout;
use std::fs::File;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

struct CacheEntry {
    dir: PathBuf,
    file_id: (u64, u64),
    dev: Arc<Device>,
}

static CACHE: Mutex<Vec<CacheEntry>> = Mutex::new(Vec::new());

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

pub(super) fn open_flags() -> i32 {
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
            caller_checked: AtomicU64::new(0),
            me: me.clone(),
            region: crate::fault::Region::register(p.cast(), len),
            _membership: membership,
        });
        crate::spin::use_table(slots);
        Ok(dev)
    }
}
