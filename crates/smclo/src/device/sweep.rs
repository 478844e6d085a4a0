//! The sweep: what dead processes left in the device's tables and
//! directory is reclaimed, on a schedule every process shares.

use super::dmb_table::DmbEntry;
use super::file::open_flags;
use super::{euid, monotonic_ms, Device};
use crate::owner::Owner;
use crate::table::{Claim, Head, Judge};
use smclo_wire::device_layout as layout;
use smclo_wire::dmb_header;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::Ordering;

/// Minimum time between two automatic sweeps for dead owners.
pub const SWEEP_INTERVAL_MS: u64 = 200;

/// Age after which a DMB file that never got a valid header is removed.
pub const STALE_FILE_SECS: u64 = 10;

impl Device {
    /// Sweeps when the last sweep (by any process) is at least
    /// [`SWEEP_INTERVAL_MS`] old; the CAS on the timestamp elects one sweeper.
    pub(super) fn maybe_sweep(&self) {
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
    pub(super) fn reclaim_dead_dmbs(&self) {
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
    pub(super) fn retire_entry(&self, e: &DmbEntry, c: Claim) {
        let seq = self.u64_at(layout::off::XFER_SEQ);
        seq.fetch_add(1, Ordering::AcqRel);
        let tx = e.tx_bytes.swap(0, Ordering::AcqRel);
        self.u64_at(layout::off::XFER_RETIRED)
            .fetch_add(tx, Ordering::AcqRel);
        seq.fetch_add(1, Ordering::AcqRel);
        e.head.free(c);
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
            } else if name.starts_with(b"u-") && stale_socket(&ent.path()) {
                crate::debug!(
                    "removing a rendezvous socket nobody listens on: {}",
                    ent.path().display()
                );
                let _ = std::fs::remove_file(ent.path());
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

/// Whether `path` is a UNIX socket at least [`STALE_FILE_SECS`] old that
/// refuses connections: a rendezvous listener's whose process is gone (a
/// process's shared one for announcements is never unlinked by it). The
/// age spares one between its `bind` and its `listen`; a live listener
/// takes the probe's connection and closes it (it names no proposal).
fn stale_socket(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileTypeExt;
    let old = std::fs::symlink_metadata(path).is_ok_and(|m| {
        m.file_type().is_socket()
            && m.modified()
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a.as_secs() >= STALE_FILE_SECS)
    });
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; zeroes are a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if !old || bytes.len() >= sa.sun_path.len() {
        return false;
    }
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, b) in sa.sun_path.iter_mut().zip(bytes) {
        *d = *b as libc::c_char;
    }
    // SAFETY: no pointers; the flags are valid.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return false;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: a valid sockaddr_un of the length given, on our own socket.
    let rc = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) };
    let refused = rc != 0 && crate::errno::get() == libc::ECONNREFUSED;
    // SAFETY: closes the socket made above, which nothing else holds.
    unsafe { libc::close(fd) };
    refused
}
