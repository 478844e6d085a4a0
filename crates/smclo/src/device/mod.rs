//! The loopback-ism device: one shared file per device directory.
//!
//! `<dir>/device` (layout in [`smclo_wire::device_layout`]) holds the GID,
//! CHID and SEID, the knobs, the counters, and four tables: DMBs, listeners
//! ([`crate::registry`]), handshake slots ([`crate::rendezvous`]) and open
//! fallback connections ([`crate::fallbacks`]). Every smclo process that
//! uses the directory (one user, or a group's members: [`crate::access`])
//! maps it shared, for the rest of its life.
//!
//! Split by job: the file's creation and opening (`file`), its counters
//! (`stats`), the DMB table (`dmb_table`) and the registrations that own
//! its entries (`registration`), and the sweep of what dead processes
//! left (`sweep`). This file has the device itself and its knobs.
//!
//! # Shared tables
//! The four tables keep their entries with one protocol, [`crate::table`]
//! (claim, fill, publish, release, reclaim of dead owners, and why kill -9
//! at any instant leaves them consistent). Opening the device joins the
//! caller's pid namespace's membership lock, which that protocol needs
//! before anything can be claimed.

use crate::access::{Creds, Shape};
use crate::error::{Error, Result};
use crate::table::Membership;
use smclo_wire::device_layout as layout;
use smclo_wire::reason::Reason;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

mod dmb_table;
mod file;
mod registration;
mod stats;
mod sweep;

pub use file::derive_seid;
pub use registration::{ConnRecord, DmbHandle, Registration};
pub use stats::Stats;
pub use sweep::{STALE_FILE_SECS, SWEEP_INTERVAL_MS};

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
    /// When [`Device::check_caller`] last passed ([`monotonic_ms`] + 1; 0:
    /// never), which [`Device::check_caller_recent`] trusts a while.
    caller_checked: AtomicU64,
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

/// [`Device::admitted`] before any changed uid was judged.
const ADMITTED_UNKNOWN: u64 = u64::MAX;

/// How long [`Device::check_caller_recent`] trusts a passed check, in
/// milliseconds.
pub const CALLER_TRUSTED_MS: u64 = 100;

/// The milliseconds in [`Device::caller_checked`]; the fork generation's
/// low 24 bits are above them.
const CHECKED_MS: u64 = (1 << 40) - 1;

impl Device {
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

    /// [`Device::check_caller`], trusting one that passed in this fork
    /// generation less than [`CALLER_TRUSTED_MS`] ago: an announcement's
    /// connection to a plain server asks the kernel nothing beyond its
    /// proof (docs/handshake.md); a uid changed within that time is seen
    /// that much later.
    pub fn check_caller_recent(&self) -> std::result::Result<(), Reason> {
        let at = self.caller_checked.load(Ordering::Relaxed);
        let ms = at & CHECKED_MS;
        let fresh = (at >> 40) == (crate::owner::fork_gen() & 0xff_ffff)
            && ms != 0
            && monotonic_ms() < ms - 1 + CALLER_TRUSTED_MS;
        if fresh {
            return Ok(());
        }
        self.check_caller()
    }

    /// Notes a passed [`Device::check_caller`] for [`Device::check_caller_recent`]:
    /// when, and in which fork generation (a child that changes its uid
    /// right after `fork`, as a server's workers do, checks afresh).
    fn note_caller_checked(&self) {
        let gen = crate::owner::fork_gen() & 0xff_ffff;
        let ms = (monotonic_ms() + 1) & CHECKED_MS;
        self.caller_checked
            .store((gen << 40) | ms, Ordering::Relaxed);
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
            self.note_caller_checked();
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
            self.note_caller_checked();
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

    /// An `Arc` of this device (every `Device` lives in an `Arc`).
    pub(crate) fn arc(&self) -> Arc<Device> {
        self.me
            .upgrade()
            .expect("a Device is only reachable through its Arc")
    }

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use smclo_testsupport::DevDir;

    /// A passed check is trusted for [`CALLER_TRUSTED_MS`] in its fork
    /// generation; an older one, or one of another generation (a fork
    /// child's, which may change its uid next), is made again.
    #[test]
    fn a_passed_caller_check_is_trusted_a_while_in_its_fork_generation() {
        let dir = DevDir::new("caller-check");
        let dev = Device::open(&dir.0).unwrap();
        dev.check_caller().unwrap();
        let noted = dev.caller_checked.load(Ordering::Relaxed);
        // A note no check makes now (one 50 ms ahead): kept while trusted.
        let mark = ((noted >> 40) << 40) | (monotonic_ms() + 50);
        dev.caller_checked.store(mark, Ordering::Relaxed);
        dev.check_caller_recent().unwrap();
        let kept = dev.caller_checked.load(Ordering::Relaxed);
        assert_eq!(kept, mark, "a trusted check was made again");
        let gen = noted >> 40;
        let aged = (monotonic_ms() + 1).saturating_sub(CALLER_TRUSTED_MS);
        dev.caller_checked
            .store((gen << 40) | aged, Ordering::Relaxed);
        dev.check_caller_recent().unwrap();
        let again = dev.caller_checked.load(Ordering::Relaxed);
        assert!((again & CHECKED_MS) > aged, "an aged check was trusted");
        let other = (gen + 1) & 0xff_ffff;
        dev.caller_checked
            .store((other << 40) | (again & CHECKED_MS), Ordering::Relaxed);
        dev.check_caller_recent().unwrap();
        let after = dev.caller_checked.load(Ordering::Relaxed);
        assert_eq!(
            after >> 40,
            gen,
            "another fork generation's check was trusted"
        );
    }
}
