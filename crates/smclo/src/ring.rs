//! Copying bytes into and out of a DMB ring at a cursor position.
//!
//! Thanks to the double mapping ([`crate::dmb`]), a copy of up to
//! `ring_len` bytes starting at any offset is one `memcpy`.
//!
//! # Memory the peer may be writing
//!
//! The ring is shared with another process that we do not trust. Two rules
//! make our side sound whatever that process does:
//!
//! 1. **No reference ever covers ring bytes.** Safe code never holds a
//!    `&[u8]` or `&mut [u8]` into the ring (a reference promises the
//!    compiler that the bytes do not change, or that nobody else sees them,
//!    for its whole life, which a peer can break at any moment). The ring is
//!    reached only through raw pointers, in the two copy functions below
//!    ([`copy_to_shared`], [`copy_from_shared`]), which every path uses:
//!    `read`/`write` ([`copy_in`], [`copy_out`]) and the zero-copy regions
//!    of [`crate::conn`], whose safe methods copy and whose raw pointers
//!    come with the same contract for the caller.
//! 2. **Each copy reads or writes each shared byte once, into or from
//!    private memory**, and only the private copy is looked at afterwards.
//!    A byte is a `u8`, valid with any value, so whatever the peer stores
//!    concurrently, the copy holds valid bytes; we never branch on ring
//!    bytes in place and never read them twice expecting the same value.
//!
//! With an honest peer there is no race at all: the writer fills bytes and
//! then publishes `prod` (release); the reader loads `prod` (acquire) before
//! copying, and publishes `cons` (release) only after it is done; the writer
//! loads `cons` (acquire) before it reuses those bytes. The cursors split
//! the ring into the part only the writer touches and the part only the
//! reader touches, and the atomics order the hand-over across processes.
//!
//! A misbehaving peer may write the bytes we are copying anyway. That write
//! comes from outside our program, like a device doing DMA into a buffer:
//! under rules 1 and 2 the compiler has made no assumption it can break
//! (`copy_nonoverlapping` through raw pointers is an opaque bulk copy of
//! `u8`s; no reference asserted their stability), and the worst outcome is
//! garbage bytes in the stream that peer sends us, which it could have
//! sent anyway. Every offset and length comes from a cursor word that was
//! validated ([`smclo_wire::cursor::distance`]) and is reduced modulo
//! `ring_len` here, and lengths are at most `ring_len`, so a copy never
//! leaves the `2 * ring_len` mapped bytes whatever the peer writes.
//!
//! Volatile or atomic per-byte copies would be the alternative; they add
//! nothing to rules 1 and 2 for bytes without a validity invariant and cost
//! the bulk `memcpy` that makes shared memory faster than TCP.

use crate::dmb::Dmb;

/// Copies `src` to `dst` in shared memory (see the module docs).
///
/// # Safety
/// `dst .. dst + src.len()` is mapped, writable, and covered by no Rust
/// reference (it is ring memory reached through a raw pointer).
#[inline]
pub(crate) unsafe fn copy_to_shared(dst: *mut u8, src: &[u8]) {
    // SAFETY: `dst` is valid for `src.len()` bytes (caller); `src` is
    // private memory, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

/// Copies `dst.len()` bytes from `src` in shared memory to `dst` (see the
/// module docs).
///
/// # Safety
/// `src .. src + dst.len()` is mapped and covered by no Rust reference.
#[inline]
pub(crate) unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    // SAFETY: `src` is valid for `dst.len()` bytes (caller); `dst` is
    // private memory, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}

/// Copies `src` into the ring at byte offset `pos` (any value; reduced
/// modulo `ring_len`). Panics if `src` is longer than the ring, which the
/// callers rule out (they copy at most the free space).
#[inline]
pub fn copy_in(dmb: &Dmb, pos: u64, src: &[u8]) {
    let len = dmb.ring_len() as usize;
    assert!(
        src.len() <= len,
        "copy of {} bytes into a {len}-byte ring",
        src.len()
    );
    dmb.prepare_write(pos, src.len());
    // SAFETY: ptr_at gives a position with `ring_len` mapped bytes after it
    // (the double mapping) and src.len() <= ring_len; ring memory is never
    // behind a reference.
    unsafe { copy_to_shared(ptr_at(dmb, pos), src) };
}

/// Copies `dst.len()` bytes out of the ring, starting at byte offset `pos`
/// (reduced modulo `ring_len`). Panics if `dst` is longer than the ring.
#[inline]
pub fn copy_out(dmb: &Dmb, pos: u64, dst: &mut [u8]) {
    let len = dmb.ring_len() as usize;
    assert!(
        dst.len() <= len,
        "copy of {} bytes out of a {len}-byte ring",
        dst.len()
    );
    // SAFETY: as in `copy_in`, the source range is inside the mapping.
    unsafe { copy_from_shared(ptr_at(dmb, pos), dst) };
}

/// Raw pointer to the ring byte at `pos` (reduced modulo `ring_len`); the
/// following `ring_len` bytes are mapped (the double mapping). For the
/// copies above and the zero-copy regions of [`crate::conn`].
#[inline]
pub(crate) fn ptr_at(dmb: &Dmb, pos: u64) -> *mut u8 {
    let off = (pos as usize) & (dmb.ring_len() as usize - 1);
    // SAFETY: off < ring_len, inside the mapping.
    unsafe { dmb.ring_ptr().add(off) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dmb::memfd;
    use smclo_wire::dmb_header::MIN_RING_LEN;

    const RING: u32 = MIN_RING_LEN;

    #[test]
    fn copies_across_the_wrap_in_one_piece() {
        let f = memfd("ring-test").unwrap();
        let d = Dmb::create(&f, 1, RING, 0, 0, 0).unwrap();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let pos = 6 * RING as u64 - 1000; // 1000 bytes before the end
        copy_in(&d, pos, &data);
        let mut out = vec![0u8; 3000];
        copy_out(&d, pos, &mut out);
        assert_eq!(out, data);
        // The tail landed at the ring's start.
        let mut head = [0u8; 2000];
        copy_out(&d, 0, &mut head);
        assert_eq!(&head[..], &data[1000..]);
        // A whole ring from the middle.
        let big: Vec<u8> = (0..RING).map(|i| (i ^ 0x5a) as u8).collect();
        copy_in(&d, 77, &big);
        let mut back = vec![0u8; big.len()];
        copy_out(&d, 77 + RING as u64 * 3, &mut back);
        assert_eq!(back, big);
    }

    /// Page-fault exceptions this thread takes while `f` runs, counted by
    /// the kernel's software event (`perf_event_open`); the faults
    /// `MADV_POPULATE_WRITE` takes on the caller's behalf are not
    /// exceptions and are not counted.
    fn page_faults_in(f: impl FnOnce()) -> u64 {
        // perf_event_attr as its first version (64 bytes, which every kernel
        // takes): type PERF_TYPE_SOFTWARE (1) and size, config
        // PERF_COUNT_SW_PAGE_FAULTS (2), and in the flags word
        // exclude_kernel (bit 5) and exclude_hv (bit 6).
        let mut attr = [0u64; 8];
        attr[0] = 1 | (std::mem::size_of_val(&attr) as u64) << 32;
        attr[1] = 2;
        attr[5] = 1 << 5 | 1 << 6;
        // SAFETY: perf_event_open reads `attr`'s 64 bytes, the size it
        // declares, for this thread (pid 0, any CPU, no group); the
        // descriptor is owned below.
        let fd =
            unsafe { libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), 0, -1, -1, 0) } as i32;
        assert!(
            fd >= 0,
            "perf_event_open: {} (./test.sh runs as root)",
            std::io::Error::last_os_error()
        );
        // SAFETY: the descriptor perf_event_open just returned, ours.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f();
        let mut n = [0u8; 8];
        std::io::Read::read_exact(&mut &file, &mut n).expect("the count");
        u64::from_ne_bytes(n)
    }

    /// A connection's first lap through a ring takes a page fault for
    /// each page it writes, since a shared mapping's write faults map one
    /// page at a time, where the kernel's DMBs are allocated whole: 256
    /// faults for a 1 MiB ring, some 7% of memcached's time in a short
    /// run. Written through `prepare_write`, it takes almost none; and a
    /// ring that carried a few bytes holds no more pages than before.
    #[test]
    fn a_first_lap_takes_almost_no_page_fault_and_a_few_bytes_one_page() {
        const MIB: u32 = 1 << 20;
        let f = memfd("ring-lap").unwrap();
        let d = Dmb::create(&f, 1, MIB, 0, 0, 0).unwrap();
        let chunk: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let faults = page_faults_in(|| {
            let mut pos = 0u64;
            while pos < u64::from(MIB) {
                copy_in(&d, pos, &chunk);
                pos += chunk.len() as u64;
            }
        });
        assert!(
            faults < 16,
            "{faults} page faults writing a 1 MiB ring's first lap"
        );
        let mut back = vec![0u8; chunk.len()];
        copy_out(&d, 5000, &mut back);
        assert_eq!(back, chunk);

        let f = memfd("ring-few").unwrap();
        let d = Dmb::create(&f, 1, MIB, 0, 0, 0).unwrap();
        copy_in(&d, 0, &chunk[..100]);
        let blocks = std::os::unix::fs::MetadataExt::blocks(&f.metadata().unwrap());
        assert!(
            blocks * 512 <= 2 * crate::fault::PAGE as u64,
            "{} bytes allocated for a header and 100 bytes",
            blocks * 512
        );
    }

    #[test]
    #[should_panic]
    fn refuses_more_than_a_ring() {
        let f = memfd("ring-test").unwrap();
        let d = Dmb::create(&f, 1, RING, 0, 0, 0).unwrap();
        copy_in(&d, 0, &vec![0u8; RING as usize + 1]);
    }
}
