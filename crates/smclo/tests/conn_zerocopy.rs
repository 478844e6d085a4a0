//! Zero copy: reserve/commit and peek_region/release, byte-exact across
//! ring wraps (one region each, thanks to the double mapping). The regions
//! are reached by copies and raw pointers only, never as slices.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::RecvFlags;
use std::time::Duration;

/// `n` bytes of test stream `seed` from offset `from`.
fn stream(seed: u64, from: u64, n: usize) -> Vec<u8> {
    (0..n as u64).map(|i| stream_byte(seed, from + i)).collect()
}

/// All the bytes of a read region, copied out.
fn contents(r: &smclo::testing::conn::ReadRegion<'_>) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.copy_to_slice(0, &mut v);
    v
}

#[test]
fn regions_are_contiguous_across_the_wrap() {
    let (a, b) = pair();
    // Move the cursors to 100 bytes before the end of the ring.
    let pre = RING as usize - 100;
    assert_eq!(a.write(&vec![0u8; pre]).unwrap(), pre);
    let mut sink = vec![0u8; pre];
    assert_eq!(b.recv(&mut sink, RecvFlags::WAITALL).unwrap(), pre);
    // One region spanning the wrap, filled in two pieces.
    let mut w = a.reserve(1000).unwrap();
    assert_eq!(w.len(), RING as usize, "all free space, in one region");
    let data = stream(3, 0, 1000);
    w.copy_from_slice(0, &data[..60]);
    w.copy_from_slice(60, &data[60..]);
    w.commit(1000).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(contents(&r), data);
    // Pieces at an offset, across the wrap (ring bytes 100 before the end).
    let mut piece = [0u8; 300];
    r.copy_to_slice(50, &mut piece);
    assert_eq!(&piece[..], &data[50..350]);
    r.release(600).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(r.len(), 400);
    let mut first = [0u8; 1];
    r.copy_to_slice(0, &mut first);
    assert_eq!(first[0], stream_byte(3, 600));
    drop(r); // releases nothing
    assert_eq!(b.readable_len().unwrap(), 400);
    // Reading with read() after the zero-copy path continues the stream.
    let mut rest = [0u8; 400];
    assert_eq!(b.read(&mut rest).unwrap(), 400);
    assert_eq!(rest[399], stream_byte(3, 999));
    // An uncommitted reservation sends nothing; commit beyond it fails.
    let mut w = a.reserve(10).unwrap();
    w.copy_from_slice(0, b"not sent");
    drop(w);
    assert_eq!(b.readable_len().unwrap(), 0);
    let w = a.reserve(10).unwrap();
    let n = w.len();
    assert!(w.commit(n + 1).is_err());
    assert!(a.reserve(RING as usize + 1).is_err());
}

#[test]
fn a_partial_commit_sends_only_the_committed_prefix() {
    let (a, b) = pair();
    let mut w = a.reserve(100).unwrap();
    w.copy_from_slice(0, &stream(5, 0, 100));
    w.commit(40).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(contents(&r), stream(5, 0, 40));
    r.release(40).unwrap();
    // The next reservation starts right after the committed bytes.
    let mut w = a.reserve(1).unwrap();
    w.copy_from_slice(0, &stream(5, 40, 10));
    w.commit(10).unwrap();
    let mut got = [0u8; 10];
    assert_eq!(b.read(&mut got).unwrap(), 10);
    assert_eq!(&got[..], &stream(5, 40, 10)[..]);
}

#[test]
fn raw_pointers_reach_the_same_bytes() {
    let (a, b) = pair();
    let mut w = a.reserve(64).unwrap();
    let p = w.as_mut_ptr();
    for i in 0..64 {
        // SAFETY: the region has at least 64 bytes; written through the
        // raw pointer, never through a slice (the regions' contract).
        unsafe { p.add(i).write(stream_byte(8, i as u64)) };
    }
    w.commit(64).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(r.len(), 64);
    let got: Vec<u8> = (0..64)
        // SAFETY: 64 received bytes, each read once through the pointer.
        .map(|i| unsafe { r.as_ptr().add(i).read() })
        .collect();
    assert_eq!(got, stream(8, 0, 64));
    r.release(64).unwrap();
}

#[test]
fn copies_outside_a_region_panic() {
    let (a, b) = pair();
    let mut w = a.reserve(1).unwrap();
    let n = w.len();
    let past_end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.copy_from_slice(n - 1, &[1, 2])
    }));
    assert!(past_end.is_err(), "a write past the region's end panics");
    let overflow = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.copy_from_slice(usize::MAX, &[1])
    }));
    assert!(overflow.is_err(), "an offset that overflows panics");
    w.copy_from_slice(n - 2, &[7, 9]);
    w.commit(0).unwrap();
    assert_eq!(a.write(b"abc").unwrap(), 3);
    let r = b.peek_region().unwrap();
    let mut big = [0u8; 4];
    let past_end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        r.copy_to_slice(0, &mut big)
    }));
    assert!(past_end.is_err(), "a read past the received bytes panics");
    r.copy_to_slice(1, &mut big[..2]);
    assert_eq!(&big[..2], b"bc");
}

#[test]
fn zero_copy_stream_is_byte_exact() {
    let (a, b) = pair();
    let total: u64 = 16 << 20;
    within(Duration::from_secs(60), move || {
        let w = std::thread::spawn(move || {
            let mut rng = Rng(77);
            let mut off = 0u64;
            while off < total {
                let min = 1 + rng.below(3000) as usize;
                let mut reg = a.reserve(min).unwrap();
                assert!(reg.len() >= min);
                let n = (1 + rng.below(reg.len() as u64)).min(total - off) as usize;
                reg.copy_from_slice(0, &stream(11, off, n));
                reg.commit(n).unwrap();
                off += n as u64;
            }
            a.shutdown_write().unwrap();
            a
        });
        let mut rng = Rng(99);
        let mut off = 0u64;
        loop {
            let r = b.peek_region().unwrap();
            if r.is_empty() {
                break;
            }
            let n = 1 + rng.below(r.len() as u64) as usize;
            let mut got = vec![0u8; n];
            r.copy_to_slice(0, &mut got);
            assert!(got == stream(11, off, n), "bytes {off}..{}", off + n as u64);
            r.release(n).unwrap();
            off += n as u64;
        }
        assert_eq!(off, total);
        w.join().unwrap();
    });
}
