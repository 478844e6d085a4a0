//! Copying bytes into and out of a DMB ring at a cursor position.
//!
//! Thanks to the double mapping ([`crate::dmb`]), a copy of up to
//! `ring_len` bytes starting at any offset is one `memcpy`.
//!
//! # Reading memory that the peer may be writing
//!
//! The ring is shared with another process that we do not trust. A
//! malicious peer may change bytes while we copy them out (or in). That is
//! acceptable here because:
//!
//! - we only *copy* ring bytes, as plain `u8`s with no validity invariant;
//!   we never interpret them, branch on them or build references to typed
//!   data in the ring. The worst a racing peer achieves is garbage in its
//!   own stream, which it could have sent anyway;
//! - every offset and length comes from a cursor word that was validated
//!   ([`smclo_wire::cursor::distance`]) and is reduced modulo `ring_len`
//!   here, and lengths are at most `ring_len`, so a copy never leaves the
//!   `2 * ring_len` mapped bytes whatever the peer writes;
//! - the copies go through raw pointers (`copy_nonoverlapping`), so the
//!   compiler never assumes the shared bytes are stable across accesses.
//!
//! With an honest peer the protocol orders the accesses: the writer fills
//! bytes and then publishes `prod` (release); the reader loads `prod`
//! (acquire) before copying, and publishes `cons` only after it is done.

use crate::dmb::Dmb;

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
    let off = (pos as usize) & (len - 1);
    // SAFETY: off < len and src.len() <= len, so the destination range lies
    // in the 2 * len mapped ring bytes; `src` is private memory, so the
    // ranges do not overlap. See the module docs for concurrent peers.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dmb.ring_ptr().add(off), src.len()) };
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
    let off = (pos as usize) & (len - 1);
    // SAFETY: as in `copy_in`, the source range is inside the mapping and
    // `dst` is private memory.
    unsafe { std::ptr::copy_nonoverlapping(dmb.ring_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
}

/// Raw pointer to the ring byte at `pos` (reduced modulo `ring_len`); the
/// following `ring_len` bytes are mapped (the double mapping). For the
/// zero-copy regions of [`crate::conn`].
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

    #[test]
    fn copies_across_the_wrap_in_one_piece() {
        let f = memfd("ring-test").unwrap();
        let d = Dmb::create(&f, 1, 16 * 1024, 0, 0, 0).unwrap();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let pos = 5 * 16 * 1024 + 16 * 1024 - 1000; // 1000 bytes before the end
        copy_in(&d, pos, &data);
        let mut out = vec![0u8; 3000];
        copy_out(&d, pos, &mut out);
        assert_eq!(out, data);
        // The tail landed at the ring's start.
        let mut head = [0u8; 2000];
        copy_out(&d, 0, &mut head);
        assert_eq!(&head[..], &data[1000..]);
        // A whole ring from the middle.
        let big: Vec<u8> = (0..16 * 1024u32).map(|i| (i ^ 0x5a) as u8).collect();
        copy_in(&d, 77, &big);
        let mut back = vec![0u8; big.len()];
        copy_out(&d, 77 + 16 * 1024 * 3, &mut back);
        assert_eq!(back, big);
    }

    #[test]
    #[should_panic]
    fn refuses_more_than_a_ring() {
        let f = memfd("ring-test").unwrap();
        let d = Dmb::create(&f, 1, 16 * 1024, 0, 0, 0).unwrap();
        copy_in(&d, 0, &vec![0u8; 16 * 1024 + 1]);
    }
}
