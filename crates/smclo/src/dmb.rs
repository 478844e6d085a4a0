//! DMB mappings: a header page plus a ring mapped twice, back to back.
//!
//! ```text
//! address  base                 header page (file offset 0)
//!          base + 4096          ring, first copy (file offset 4096)
//!          base + 4096 + len    ring, second copy (file offset 4096 again)
//! ```
//!
//! Because the second copy follows the first, any region of up to
//! `ring_len` bytes that starts anywhere in the first copy is contiguous in
//! memory: wrap-around copies are one `memcpy`, and the zero-copy API hands
//! out one region (reached through raw pointers only, see [`crate::ring`]).
//! The whole range is first reserved with an anonymous
//! `PROT_NONE` mapping, so that the two `MAP_FIXED` file mappings replace
//! only address space we own.
//!
//! The layout of the header is [`smclo_wire::dmb_header`]. Its static fields
//! are read with `pread`, never through the mapping, so they are validated
//! once and then kept in the [`Dmb`] value. The words that change while the
//! peer may look (the cursors, the attach record, and the token, which the
//! owner rewrites on reuse) are accessed in the shared page as atomics only.

use crate::error::{AttachError, Error, Result};
use crate::fault::PAGE;
use smclo_wire::dmb_header::{self, DmbHeader, CONS_OFFSET, HEADER_LEN, PROD_OFFSET};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

pub mod attach_record;
pub mod pool;

/// The most [`Dmb::prepare_write`] makes present at once beyond what a
/// write needs.
const POPULATE_STEP: usize = 256 * 1024;

/// One mapped DMB. `Send + Sync`: all shared access goes through atomics or
/// through [`crate::ring`], whose soundness argument does not depend on the
/// thread. Dropping it unmaps the memory (the file may live on in the peer).
pub struct Dmb {
    /// Start of the reservation: header page, then the ring twice.
    base: *mut u8,
    /// Length of the reservation (`4096 + 2 * ring_len`).
    map_len: usize,
    hdr: DmbHeader,
    /// Our own DMB (from [`Dmb::create_own`]): its memfd, kept to pass to
    /// peers and to reuse the DMB ([`crate::dmb::pool`]).
    own: Option<Own>,
    /// A peer's DMB attached with [`Dmb::attach_peer`]: the attach record we
    /// wrote into its header, the fork generation we did it in, and the
    /// file's identity (device, inode). On drop the record is cleared and
    /// the mapping cached for the next time the peer passes the same memfd
    /// ([`crate::dmb::pool`]), unless a fork happened since (a child may still
    /// use the mapping).
    attach: Option<(u64, u64, (u64, u64))>,
    /// Our memfd of this DMB parked in [`crate::vault`] once closed (a
    /// peer's, or our own without `own`): exec passes it to the new image.
    kept: Option<crate::vault::Kept>,
    /// The reservation, registered for recovery from a shrunk file
    /// ([`crate::fault`]); `None` only while the drop moves the mapping.
    region: Option<crate::fault::Region>,
    /// Bytes of the ring's first copy made present for writing
    /// ([`Dmb::prepare_write`]), kept while the mapping is reused.
    populated: AtomicU32,
}

/// The parts of a [`Dmb`] that only its owner has.
pub(crate) struct Own {
    /// The sealed memfd.
    pub(crate) file: File,
    /// The memfd's identity (device, inode): a peer that keeps a mapping
    /// of this DMB finds it by this ([`Dmb::attach_cached`]).
    pub(crate) id: (u64, u64),
    /// Fork generation in which this mapping was made or taken from the
    /// pool; a mapping from before a `fork` is never reused.
    pub(crate) fork_gen: u64,
    /// Whether dropping the mapping hands it to the pool (true for DMBs in
    /// use; false for the pool's own copies, which really unmap).
    pub(crate) reuse: bool,
    /// The pid of the peer whose connection used it last (0: none yet): a
    /// client's next connection to that process prefers it, since that
    /// process likely keeps a mapping of it ([`crate::dmb::pool::Prefer`]).
    pub(crate) last_peer: u32,
    /// `file` counts against the descriptor budget ([`crate::fdnum`]).
    pub(crate) _held: crate::fdnum::Held,
    /// `file`'s number is the core's ([`crate::fdnum::Mark`]).
    pub(crate) _mark: crate::fdnum::Mark,
    /// `file` counts against what the pool could take back
    /// ([`crate::dmb::pool::may_keep_memfd`]).
    pub(crate) _kept: crate::dmb::pool::KeptMemfd,
}

// SAFETY: `Dmb` owns its mapping (nothing else unmaps it); the pointers are
// only dereferenced as atomics (`prod`/`cons`) or by `ring`'s raw copies,
// which are valid from any thread.
unsafe impl Send for Dmb {}
// SAFETY: as above; `&Dmb` exposes only atomics and raw-pointer copies.
unsafe impl Sync for Dmb {}

impl Dmb {
    /// Initialise a new DMB in an open empty file: size it (4096 +
    /// ring_len), write the header, map it.
    pub fn create(
        file: &File,
        token: u64,
        ring_len: u32,
        gid: u64,
        owner_pid: u32,
        owner_start: u64,
    ) -> Result<Dmb> {
        if !dmb_header::ring_len_ok(ring_len) {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "DMB ring length {ring_len} is not a power of two in {}..={}",
                    dmb_header::MIN_RING_LEN,
                    dmb_header::MAX_RING_LEN
                ),
            )));
        }
        let hdr = DmbHeader {
            ring_len,
            token,
            owner_pid,
            owner_start,
            gid,
        };
        // set_len zero-fills: the cursor words start at 0 (empty ring, no
        // flags) and the reserved bytes are zero.
        file.set_len(0)?;
        file.set_len(hdr.file_len())?;
        file.write_all_at(&hdr.encode(), 0)?;
        seal_size(file);
        Dmb::map(file, hdr)
    }

    /// A new DMB of our own in a fresh memfd (close-on-exec), sized, with
    /// its header written and sealed against any size change
    /// (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`): a peer holding the
    /// descriptor can never truncate it under our mapping. The descriptor
    /// is kept ([`Dmb::own_fd`]) to pass to the peer, at a high number
    /// ([`crate::fdnum`]).
    pub(crate) fn create_own(
        token: u64,
        ring_len: u32,
        gid: u64,
        owner_pid: u32,
        owner_start: u64,
    ) -> Result<Dmb> {
        // Kept open for the DMB's life (and in the pool): out of the
        // application's range of numbers (crate::fdnum).
        let file = crate::fdnum::move_high(memfd("smclo-dmb")?);
        let mut d = Dmb::create(&file, token, ring_len, gid, owner_pid, owner_start)?;
        // SAFETY: F_ADD_SEALS on our own valid descriptor; no memory effects.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        use std::os::unix::fs::MetadataExt;
        let md = file.metadata()?;
        let mark_fd = file.as_raw_fd();
        d.own = Some(Own {
            id: (md.dev(), md.ino()),
            file,
            fork_gen: crate::owner::fork_gen(),
            reuse: true,
            last_peer: 0,
            _held: crate::fdnum::Held::new(),
            _mark: crate::fdnum::Mark::new(mark_fd),
            _kept: crate::dmb::pool::KeptMemfd::new(d.ring_len()),
        });
        Ok(d)
    }

    /// Closes the memfd of our own DMB once the peer has it (it maps the
    /// file; our mapping keeps the memory): one descriptor less for the
    /// connection's life, and the DMB is unmapped instead of pooled when it
    /// is dropped. For a process short of descriptors ([`crate::fdnum`]).
    pub(crate) fn close_own_file(&mut self) {
        if let Some(o) = self.own.take() {
            use std::os::fd::AsFd;
            self.kept = crate::vault::keep(o.id, o.file.as_fd());
        }
    }

    /// The memfd of our own DMB (None for a peer's).
    pub(crate) fn own_fd(&self) -> Option<RawFd> {
        self.own.as_ref().map(|o| o.file.as_raw_fd())
    }

    /// The identity (device, inode) of our own DMB's memfd.
    pub(crate) fn own_id(&self) -> Option<(u64, u64)> {
        self.own.as_ref().map(|o| o.id)
    }

    pub(crate) fn own_mut(&mut self) -> Option<&mut Own> {
        self.own.as_mut()
    }

    /// The pid of the peer that used our own DMB last (0: none, or not
    /// ours): see [`Own::last_peer`].
    pub(crate) fn last_peer(&self) -> u32 {
        self.own.as_ref().map_or(0, |o| o.last_peer)
    }

    /// Gives this pooled DMB a new token (so that a stale holder of its
    /// descriptor, validating against an old CLC token, refuses it) and an
    /// empty ring. Only for our own DMB while no peer maps it.
    pub(crate) fn renew(&mut self, token: u64) {
        use std::sync::atomic::Ordering;
        self.prod().store(0, Ordering::SeqCst);
        self.cons().store(0, Ordering::SeqCst);
        self.token_word().store(token, Ordering::SeqCst);
        self.hdr.token = token;
    }

    /// Whether the header in the mapping still says what this DMB is (a
    /// peer that maps it may have zeroed it: a hole punched in the memfd
    /// reads as zeros). Read word by word, as the shared memory it is.
    pub(crate) fn header_intact(&self) -> bool {
        use std::sync::atomic::Ordering;
        let mut b = [0u8; dmb_header::STATIC_LEN];
        for (off, chunk) in (0..).step_by(8).zip(b.chunks_exact_mut(8)) {
            chunk.copy_from_slice(&self.word_at(off).load(Ordering::Relaxed).to_ne_bytes());
        }
        dmb_header::parse(&b).is_ok_and(|h| h == self.hdr)
    }

    /// The attach record word of this DMB (see [`dmb_header::ATTACH_OFFSET`]).
    pub(crate) fn attach_word(&self) -> &AtomicU64 {
        self.word_at(dmb_header::ATTACH_OFFSET)
    }

    /// The token word in the mapped header: the owner rewrites it when it
    /// reuses the DMB ([`Dmb::renew`]), while a cached mapping of the peer
    /// may read it ([`Dmb::attach_peer`]), so it is an atomic like the
    /// cursor words.
    fn token_word(&self) -> &AtomicU64 {
        self.word_at(dmb_header::TOKEN_OFFSET)
    }

    /// The 64-bit header word at `off`, as the atomic it is shared as.
    fn word_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off & 7 == 0 && off + 8 <= HEADER_LEN);
        // SAFETY: every caller passes a constant offset that is 8-aligned
        // and inside the header page (checked at compile time in
        // `smclo_wire::dmb_header`); the page-aligned mapping lives as long
        // as `self`, and these words are only ever accessed atomically (by
        // us and, in its own mapping, by the peer).
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    /// Maps a peer's DMB from the descriptor it passed us, after checking
    /// everything a peer could get wrong: the descriptor is a sealed memfd
    /// (`F_GET_SEALS` has [`REQUIRED_SEALS`], so its size can never change
    /// under our mapping) owned by a uid `owner_ok` admits, its size and header are those
    /// of a DMB of `gid` named `token`. Then writes a fresh attach record
    /// into its header (compare-and-swap from 0; a DMB someone else still
    /// maps is refused), which the drop clears.
    ///
    /// A refusal is an [`Error::Attach`]: [`AttachError::TokenGone`] when
    /// the header names another token (the DMB for `token` is not there).
    pub(crate) fn attach_peer(
        file: File,
        token: u64,
        gid: u64,
        owner_ok: impl FnOnce(u32) -> bool,
    ) -> Result<Dmb> {
        let md = Dmb::sealed_and_owned(&file, owner_ok)?;
        use std::os::unix::fs::MetadataExt;
        let id = (md.dev(), md.ino());
        let d = match crate::dmb::pool::take_peer(id) {
            // The same file as a mapping we made and validated before (our
            // cached mapping keeps the inode alive, so the identity cannot
            // have been reused). Its static fields are those we validated
            // then; only the token changes when the owner reuses the DMB.
            Some(d) => {
                use std::sync::atomic::Ordering;
                let found = d.token_word().load(Ordering::SeqCst);
                let refused = check_identity(found, d.gid(), token, gid);
                if let Err(e) = refused {
                    drop(d);
                    return Err(e.into());
                }
                d
            }
            None => Dmb::attach_inner(&file, token, gid, md.len())?,
        };
        let mut d = d;
        if d.kept.is_none() {
            use std::os::fd::AsFd;
            d.kept = crate::vault::keep(id, file.as_fd());
        }
        drop(file);
        Dmb::claim(d, id, token)
    }

    /// What every DMB handed to this process must be before anything of it
    /// is read: a sealed memfd (`F_GET_SEALS` has [`REQUIRED_SEALS`], so
    /// its size can never change under our mapping, and a file of another
    /// kind, one whose reads may block for ever among them, fails here)
    /// owned by a uid `owner_ok` admits.
    fn sealed_and_owned(
        file: &File,
        owner_ok: impl FnOnce(u32) -> bool,
    ) -> Result<std::fs::Metadata> {
        // SAFETY: F_GET_SEALS on a valid descriptor we own; no memory effects.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(AttachError::NotSealed { seals }.into());
        }
        use std::os::unix::fs::MetadataExt;
        let md = file.metadata()?;
        if !md.file_type().is_file() || !owner_ok(md.uid()) {
            return Err(AttachError::NotOurs.into());
        }
        Ok(md)
    }

    /// The peer's DMB whose memfd is `id`, from a mapping we keep of it
    /// (see [`attach_peer`](Self::attach_peer)), without the peer passing
    /// the descriptor again: `None` unless we keep one, its owner is
    /// `owner` (pid and start time) and it holds `token` now. The mapping
    /// was validated when the peer first passed it, sealed, and its
    /// identity cannot be reused while we keep it.
    pub(crate) fn attach_cached(
        id: (u64, u64),
        token: u64,
        gid: u64,
        owner: (u32, u64),
    ) -> Option<Dmb> {
        let d = crate::dmb::pool::take_peer(id)?;
        if (d.owner_pid(), d.owner_start()) != owner {
            crate::dmb::pool::put_peer(id, d);
            return None;
        }
        Dmb::attach_kept(d, id, token, gid)
    }

    /// Attaches the idle mapping `d` of the peer DMB whose memfd is `id`,
    /// taken from the pool ([`crate::dmb::pool::take_peer_of`]): `None`, and `d`
    /// back in the pool, unless it holds `token` of device `gid` now (its
    /// owner renewed it for this connection).
    pub(crate) fn attach_kept(d: Dmb, id: (u64, u64), token: u64, gid: u64) -> Option<Dmb> {
        use std::sync::atomic::Ordering;
        let found = d.token_word().load(Ordering::SeqCst);
        if check_identity(found, d.gid(), token, gid).is_err() {
            crate::dmb::pool::put_peer(id, d);
            return None;
        }
        Dmb::claim(d, id, token).ok()
    }

    /// Writes our attach record into the peer's DMB `d` (memfd `id`), which
    /// holds `token`: over the owner's reservation for us, or over 0;
    /// fails if another attacher holds it.
    fn claim(mut d: Dmb, id: (u64, u64), token: u64) -> Result<Dmb> {
        d.hdr.token = token;
        let rec = attach_record::record_from(crate::rng::next_u64());
        if !attach_record::claim(d.attach_word(), rec) {
            crate::dmb::pool::put_peer(id, d);
            return Err(AttachError::AlreadyAttached.into());
        }
        d.attach = Some((rec, crate::owner::fork_gen(), id));
        Ok(d)
    }

    /// A descriptor of this DMB's memfd for a new image of this process
    /// (exec): our own memfd, or the one parked in [`crate::vault`].
    /// Close-on-exec; the caller that passes it clears that.
    pub(crate) fn exec_file(&self) -> Option<std::os::fd::OwnedFd> {
        match (&self.own, &self.kept) {
            (Some(o), _) => crate::fdnum::internal(|| o.file.try_clone())
                .ok()
                .map(Into::into),
            (None, Some(k)) => crate::vault::withdraw(k.id()),
            (None, None) => None,
        }
    }

    /// Reserves our own DMB for the peer we name it to (see
    /// [`attach_record`]): until that peer attached and
    /// detached, the pool does not reuse it, even once our end is gone.
    pub(crate) fn reserve_for_peer(&self) {
        attach_record::reserve(self.attach_word());
    }

    /// Takes back a reservation no peer will claim (the handshake did not
    /// accept), so that the pool may reuse the DMB.
    pub(crate) fn unreserve(&self) {
        attach_record::unreserve(self.attach_word());
    }

    /// The attach record this process wrote into the peer's DMB.
    pub(crate) fn attach_record(&self) -> Option<u64> {
        self.attach.map(|a| a.0)
    }

    /// Whether a `fork` happened since this mapping was made or attached:
    /// another process may then use the DMB through its copy.
    pub(crate) fn forked_since(&self) -> bool {
        let now = crate::owner::fork_gen();
        self.own.as_ref().is_some_and(|o| o.fork_gen != now)
            || self.attach.is_some_and(|a| a.1 != now)
    }

    /// Another process goes on with this mapping's connection (its
    /// descriptor was passed there): as after a fork, the mapping is
    /// neither pooled nor detached from when it is dropped.
    pub(crate) fn mark_shared(&mut self) {
        if let Some(o) = self.own.as_mut() {
            o.fork_gen = 0;
        }
        if let Some(a) = self.attach.as_mut() {
            a.1 = 0;
        }
    }

    /// The fork generation an adopted mapping records: the current one, or
    /// one that never matches when the image before exec had forked since
    /// (`forked`), so that, as in a fork child, the mapping is neither
    /// pooled nor detached from.
    fn adopted_gen(forked: bool) -> u64 {
        if forked {
            0
        } else {
            crate::owner::fork_gen()
        }
    }

    /// Our own DMB, from its memfd passed through exec by this process's
    /// image before, or by the process that passed the connection:
    /// validated as a peer's is (seals, owner by `owner_ok`, header,
    /// `token`, `gid`), since whoever sent the descriptors chose them.
    /// The header names the process that created it, which may be another
    /// of the fork family. Its memfd is kept or parked as after a
    /// handshake ([`crate::device::DmbHandle::into_parts`]). `forked`: see
    /// [`Dmb::adopted_gen`].
    pub(crate) fn adopt_own(
        file: File,
        token: u64,
        gid: u64,
        forked: bool,
        owner_ok: impl FnOnce(u32) -> bool,
    ) -> Result<Dmb> {
        let md = Dmb::sealed_and_owned(&file, owner_ok)?;
        let mut d = Dmb::attach_inner(&file, token, gid, md.len())?;
        use std::os::unix::fs::MetadataExt;
        let mark_fd = file.as_raw_fd();
        d.own = Some(Own {
            id: (md.dev(), md.ino()),
            file,
            fork_gen: Dmb::adopted_gen(forked),
            reuse: true,
            last_peer: 0,
            _held: crate::fdnum::Held::new(),
            _mark: crate::fdnum::Mark::new(mark_fd),
            _kept: crate::dmb::pool::KeptMemfd::new(d.ring_len()),
        });
        if crate::fdnum::pressed() || !crate::dmb::pool::may_keep_memfd() {
            d.close_own_file();
        }
        Ok(d)
    }

    /// The peer's DMB, from its memfd passed through exec or with a passed
    /// connection: validated as an attach is (seals and owner first), and
    /// our attach record `rec` must still be in it (no one else attached
    /// meanwhile). The memfd is parked, as after a handshake.
    /// `forked`: see [`Dmb::adopted_gen`].
    pub(crate) fn adopt_peer(
        file: File,
        token: u64,
        gid: u64,
        rec: u64,
        forked: bool,
        owner_ok: impl FnOnce(u32) -> bool,
    ) -> Result<Dmb> {
        let md = Dmb::sealed_and_owned(&file, owner_ok)?;
        let mut d = Dmb::attach_inner(&file, token, gid, md.len())?;
        use std::sync::atomic::Ordering;
        if rec == 0 || d.attach_word().load(Ordering::SeqCst) != rec {
            return Err(AttachError::AlreadyAttached.into());
        }
        use std::os::unix::fs::MetadataExt;
        let id = (md.dev(), md.ino());
        d.attach = Some((rec, Dmb::adopted_gen(forked), id));
        use std::os::fd::AsFd;
        d.kept = crate::vault::keep(id, file.as_fd());
        Ok(d)
    }

    /// Maps an existing DMB, validating its header (magic, version,
    /// ring_len power of two in 16K..=1M, file size, token, gid): anything
    /// wrong is an [`Error::Attach`] saying what.
    pub fn attach(file: &File, token: u64, gid: u64) -> Result<Dmb> {
        let size = file.metadata()?.len();
        Dmb::attach_inner(file, token, gid, size)
    }

    /// [`Dmb::attach`] of a file of `size` bytes.
    fn attach_inner(file: &File, token: u64, gid: u64, size: u64) -> Result<Dmb> {
        let mut b = [0u8; dmb_header::STATIC_LEN];
        file.read_exact_at(&mut b, 0)
            .map_err(AttachError::Unreadable)?;
        let hdr = dmb_header::parse(&b).map_err(AttachError::BadHeader)?;
        if size != hdr.file_len() {
            return Err(AttachError::WrongSize {
                size,
                expected: hdr.file_len(),
            }
            .into());
        }
        check_identity(hdr.token, hdr.gid, token, gid)?;
        Dmb::map(file, hdr)
    }

    fn map(file: &File, hdr: DmbHeader) -> Result<Dmb> {
        let ring = hdr.ring_len as usize;
        let map_len = HEADER_LEN + 2 * ring;
        let fd = file.as_raw_fd();
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address of the
        // kernel's choosing touches no existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error().into());
        }
        let unmap = |e: io::Error| {
            // SAFETY: `base..base+map_len` is our reservation, mapped above
            // and not yet handed to anyone.
            unsafe { libc::munmap(base, map_len) };
            Error::Io(e)
        };
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_SHARED | libc::MAP_FIXED;
        // SAFETY: MAP_FIXED replaces pages inside our own reservation only
        // (base .. base + HEADER_LEN + ring <= base + map_len).
        let first = unsafe { libc::mmap(base, HEADER_LEN + ring, prot, flags, fd, 0) };
        if first == libc::MAP_FAILED {
            return Err(unmap(io::Error::last_os_error()));
        }
        // SAFETY: the second copy of the ring, again inside our reservation
        // (base + HEADER_LEN + ring .. base + map_len), file offset 4096 is
        // page aligned.
        let second = unsafe {
            libc::mmap(
                (base as *mut u8).add(HEADER_LEN + ring).cast(),
                ring,
                prot,
                flags,
                fd,
                HEADER_LEN as libc::off_t,
            )
        };
        if second == libc::MAP_FAILED {
            return Err(unmap(io::Error::last_os_error()));
        }
        Ok(Dmb {
            base: base.cast(),
            map_len,
            hdr,
            own: None,
            attach: None,
            kept: None,
            region: Some(crate::fault::Region::register(base.cast(), map_len)),
            populated: AtomicU32::new(0),
        })
    }

    /// Whether the memfd under this mapping was shrunk and the mapping
    /// replaced by private zeros ([`crate::fault`]): the connection that
    /// uses it is reset.
    pub fn lost(&self) -> bool {
        self.region.as_ref().is_some_and(|r| r.lost())
    }

    /// The DMB token.
    pub fn token(&self) -> u64 {
        self.hdr.token
    }

    /// Ring length in bytes (a validated power of two).
    pub fn ring_len(&self) -> u32 {
        self.hdr.ring_len
    }

    /// Pid of the owner (the reader of this ring).
    pub fn owner_pid(&self) -> u32 {
        self.hdr.owner_pid
    }

    /// Start time of the owner, in clock ticks since boot.
    pub fn owner_start(&self) -> u64 {
        self.hdr.owner_start
    }

    /// GID of the device this DMB belongs to.
    pub fn gid(&self) -> u64 {
        self.hdr.gid
    }

    /// The producer cursor word (written by the writer; the reader changes
    /// only its doorbell and spinning bits, by compare-and-swap).
    pub fn prod(&self) -> &AtomicU64 {
        self.word_at(PROD_OFFSET)
    }

    /// The consumer cursor word (written by the reader, read by the writer).
    pub fn cons(&self) -> &AtomicU64 {
        self.word_at(CONS_OFFSET)
    }

    /// Drops the ring's contents (the file's pages behind it read as zeros
    /// again, `MADV_REMOVE`), before one of our pooled DMBs is handed to a
    /// peer that may be another user than the last one.
    pub(crate) fn forget_ring(&self) -> std::io::Result<()> {
        // SAFETY: the first ring copy is a shared mapping of the memfd that
        // this `Dmb` keeps mapped; MADV_REMOVE frees the file's pages in it
        // (both copies, and every other mapping, then read zeros) and never
        // unmaps anything. Only cursor-validated copies ever read the ring.
        let r = unsafe {
            libc::madvise(
                self.ring_ptr().cast(),
                self.ring_len() as usize,
                libc::MADV_REMOVE,
            )
        };
        if r == 0 {
            self.populated.store(0, Ordering::Relaxed);
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Makes the ring's pages for a write of `len` bytes at `pos` present
    /// in this mapping before the copy, with one `MADV_POPULATE_WRITE` for
    /// many pages where the copy would take a page fault per page (a
    /// shared mapping's write faults map one page each). The mapping's
    /// first lap only, and not its first page, which the copy faults in
    /// as before (a connection that moves a few bytes makes no system
    /// call more). Past it, each call takes at least what the write needs
    /// and as much again as is present already (at most
    /// [`POPULATE_STEP`]), so a ring holds at most twice what was written
    /// into it. The kernel's DMBs are allocated whole; these are memfds
    /// that grow as written. A failure (a kernel without it, a shrunk
    /// file) leaves the copies to fault as before; so does a peer that
    /// dropped its ring's pages (`forget_ring`) under a mapping reused.
    pub(crate) fn prepare_write(&self, pos: u64, len: usize) {
        let ring = self.ring_len() as usize;
        let done = self.populated.load(Ordering::Relaxed) as usize;
        let end = (pos as usize & (ring - 1)) + len;
        if done >= ring || end <= done {
            return;
        }
        if done == 0 && end <= PAGE {
            self.populated.store(PAGE as u32, Ordering::Relaxed);
            return;
        }
        let step = done.clamp(PAGE, POPULATE_STEP);
        let want = end.max(done + step).next_multiple_of(PAGE).min(ring);
        // The caller's write succeeds or fails on its own: a failure here
        // leaves errno as it was.
        let r = crate::errno::kept(|| {
            // SAFETY: `done..want` lies in the ring's first copy (want <=
            // ring), a shared mapping of the memfd this `Dmb` keeps mapped;
            // MADV_POPULATE_WRITE only faults its pages in, as the copy
            // would, and reports a failure (EFAULT for a file shrunk under
            // it) instead of raising SIGBUS.
            unsafe {
                libc::madvise(
                    self.ring_ptr().add(done).cast(),
                    want - done,
                    libc::MADV_POPULATE_WRITE,
                )
            }
        });
        let next = if r == 0 { want } else { ring };
        self.populated.store(next as u32, Ordering::Relaxed);
    }

    /// Start of the first copy of the ring. `ring_len * 2` bytes from here
    /// are mapped: the ring, then the ring again. Used by [`crate::ring`].
    pub(crate) fn ring_ptr(&self) -> *mut u8 {
        // SAFETY: HEADER_LEN < map_len, inside the reservation.
        unsafe { self.base.add(HEADER_LEN) }
    }
}

impl Drop for Dmb {
    fn drop(&mut self) {
        if self.lost() {
            // Private zeros now: nothing to detach, nothing to reuse.
            self.attach = None;
            self.own = None;
        }
        if let Some((rec, gen, id)) = self.attach.take() {
            // Detach: the owner may reuse its DMB once the record is 0. Not
            // after a fork (a child may still write through the mapping),
            // and only our own record (compare-and-swap). The idle mapping
            // is kept for the next time the peer passes this memfd.
            if gen == crate::owner::fork_gen() {
                attach_record::release(self.attach_word(), rec);
                let cached = Dmb {
                    base: self.base,
                    map_len: self.map_len,
                    hdr: self.hdr,
                    own: None,
                    attach: None,
                    kept: self.kept.take(),
                    region: self.region.take(),
                    populated: AtomicU32::new(self.populated.load(Ordering::Relaxed)),
                };
                self.base = std::ptr::null_mut();
                crate::dmb::pool::put_peer(id, cached);
                return;
            }
        }
        if let Some(own) = self.own.take() {
            // A process short of descriptors does not keep the memfd.
            if own.reuse && own.fork_gen == crate::owner::fork_gen() && !crate::fdnum::pressed() {
                let pooled = Dmb {
                    base: self.base,
                    map_len: self.map_len,
                    hdr: self.hdr,
                    own: Some(Own {
                        reuse: false,
                        ..own
                    }),
                    attach: None,
                    kept: None,
                    region: self.region.take(),
                    populated: AtomicU32::new(self.populated.load(Ordering::Relaxed)),
                };
                self.base = std::ptr::null_mut();
                crate::dmb::pool::put(pooled);
                return;
            }
        }
        // Unregistered before the range is given back.
        self.region = None;
        // SAFETY: the reservation is ours and nothing borrowed from `self`
        // outlives it (accessors borrow `self`).
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

impl std::fmt::Debug for Dmb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dmb")
            .field("token", &format_args!("{:016x}", self.hdr.token))
            .field("ring_len", &self.hdr.ring_len)
            .field("owner_pid", &self.hdr.owner_pid)
            .finish()
    }
}

/// Whether a header naming `found` of device `found_gid` is the DMB
/// `token` of device `gid`.
fn check_identity(
    found: u64,
    found_gid: u64,
    token: u64,
    gid: u64,
) -> std::result::Result<(), AttachError> {
    if found != token {
        Err(AttachError::TokenGone {
            wanted: token,
            found,
        })
    } else if found_gid != gid {
        Err(AttachError::WrongGid { found: found_gid })
    } else {
        Ok(())
    }
}

/// The seals a DMB's memfd must carry: no shrinking (a peer would make our
/// accesses fault, SIGBUS), no growing, and no changing the seals.
pub const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Forbids resizing a memfd once its size is set, where the file supports
/// seals: a peer that truncated the file would otherwise make our accesses
/// fault (SIGBUS). Plain tmpfs files do not support seals; that is fine.
fn seal_size(file: &File) {
    // SAFETY: F_ADD_SEALS on a valid fd has no memory effects; failure is
    // ignored on purpose (files without sealing support).
    unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
    };
}

/// An anonymous memory file (`memfd_create`, close-on-exec, sealable) to
/// hold a DMB without the device, e.g. in tests and benchmarks. Shared with
/// a peer by `fork` or by passing the descriptor.
pub fn memfd(name: &str) -> io::Result<File> {
    let name = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "memfd name contains NUL"))?;
    // SAFETY: `name` is a valid NUL-terminated string for the duration of
    // the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned to us and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmb_header::MIN_RING_LEN;
    use std::sync::atomic::Ordering;

    #[test]
    fn create_attach_share_memory_and_double_map() {
        let f = memfd("dmb-test").unwrap();
        let a = Dmb::create(&f, 0xabc, MIN_RING_LEN, 7, 1, 2).unwrap();
        let b = Dmb::attach(&f, 0xabc, 7).unwrap();
        assert_eq!(
            (b.token(), b.ring_len(), b.owner_pid(), b.owner_start()),
            (0xabc, MIN_RING_LEN, 1, 2)
        );
        a.prod().store(0x1234, Ordering::SeqCst);
        assert_eq!(b.prod().load(Ordering::SeqCst), 0x1234);
        assert_eq!(b.cons().load(Ordering::SeqCst), 0);
        // SAFETY: test-only raw access within the 2 * ring_len mapped bytes.
        unsafe {
            *a.ring_ptr().add(5) = 42;
            let len = MIN_RING_LEN as usize;
            assert_eq!(*b.ring_ptr().add(len + 5), 42);
            *b.ring_ptr().add(2 * len - 1) = 9;
            assert_eq!(*a.ring_ptr().add(len - 1), 9);
        }
    }

    #[test]
    fn attach_rejects_mismatches() {
        use dmb_header::{DmbHeaderError, RING_LEN_OFFSET};
        let f = memfd("dmb-test").unwrap();
        drop(Dmb::create(&f, 1, 2 * MIN_RING_LEN, 7, 1, 2).unwrap());
        let refused = |r: Result<Dmb>| match r {
            Err(Error::Attach(e)) => e,
            other => panic!("expected Error::Attach, got {other:?}"),
        };
        assert!(matches!(
            refused(Dmb::attach(&f, 2, 7)),
            AttachError::TokenGone {
                wanted: 2,
                found: 1
            }
        ));
        assert!(matches!(
            refused(Dmb::attach(&f, 1, 8)),
            AttachError::WrongGid { found: 7 }
        ));
        f.write_all_at(b"X", 0).unwrap();
        assert!(matches!(
            refused(Dmb::attach(&f, 1, 7)),
            AttachError::BadHeader(DmbHeaderError::BadMagic(_))
        ));
        let g = memfd("dmb-test").unwrap();
        let mut hdr = DmbHeader {
            ring_len: 3 * MIN_RING_LEN,
            token: 1,
            owner_pid: 1,
            owner_start: 0,
            gid: 7,
        }
        .encode();
        g.write_all_at(&hdr, 0).unwrap();
        assert!(matches!(
            refused(Dmb::attach(&g, 1, 7)),
            AttachError::BadHeader(DmbHeaderError::BadRingLen(l)) if l == 3 * MIN_RING_LEN
        ));
        hdr[RING_LEN_OFFSET..RING_LEN_OFFSET + 4].copy_from_slice(&MIN_RING_LEN.to_ne_bytes());
        g.write_all_at(&hdr, 0).unwrap();
        let expected = HEADER_LEN as u64 + MIN_RING_LEN as u64;
        assert!(matches!(
            refused(Dmb::attach(&g, 1, 7)),
            AttachError::WrongSize { size, expected: e } if size == dmb_header::STATIC_LEN as u64 && e == expected
        ));
        assert!(Dmb::create(&g, 1, 1000, 7, 1, 0).is_err());
    }

    /// A DMB that comes with a connection (through exec, or passed by a
    /// process that chose the descriptors it sent) is checked as a peer's
    /// is, seals and owner before anything of it is read. Before, an
    /// unsealed file with a valid header was adopted (a file that could
    /// shrink under the mapping, or one whose read blocks for ever), and
    /// its owner was not asked.
    #[test]
    fn adopting_a_dmb_checks_its_seals_and_owner_first() {
        let refused = |r: Result<Dmb>| match r {
            Err(Error::Attach(e)) => e,
            other => panic!("expected Error::Attach, got {other:?}"),
        };
        let path = std::env::temp_dir().join(format!("smclo-unsealed-dmb-{}", std::process::id()));
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        drop(Dmb::create(&open(), 0x77, MIN_RING_LEN, 7, 1, 0).unwrap());
        let own = Dmb::adopt_own(open(), 0x77, 7, true, |_| true);
        let peer = Dmb::adopt_peer(open(), 0x77, 7, 1, true, |_| true);
        let _ = std::fs::remove_file(&path);
        assert!(matches!(refused(own), AttachError::NotSealed { .. }));
        assert!(matches!(refused(peer), AttachError::NotSealed { .. }));

        let f = memfd("dmb-test").unwrap();
        drop(Dmb::create(&f, 0x78, MIN_RING_LEN, 7, 1, 0).unwrap());
        // SAFETY: F_ADD_SEALS on our own valid descriptor.
        let sealed = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS) };
        assert_eq!(sealed, 0);
        let dup = || f.try_clone().unwrap();
        let own = Dmb::adopt_own(dup(), 0x78, 7, true, |_| false);
        assert!(matches!(refused(own), AttachError::NotOurs));
        let peer = Dmb::adopt_peer(dup(), 0x78, 7, 1, true, |_| false);
        assert!(matches!(refused(peer), AttachError::NotOurs));
        assert!(Dmb::adopt_own(dup(), 0x78, 7, true, |_| true).is_ok());
    }

    #[test]
    fn memfd_size_is_sealed() {
        let f = memfd("dmb-test").unwrap();
        let _d = Dmb::create(&f, 1, MIN_RING_LEN, 7, 1, 2).unwrap();
        assert!(f.set_len(100).is_err());
    }
}
