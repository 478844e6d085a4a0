//! Zero copy: reserve/commit and peek_region/release, byte-exact across
//! ring wraps (one slice each, thanks to the double mapping).

mod conn_util;

use conn_util::*;
use std::time::Duration;

#[test]
fn regions_are_contiguous_across_the_wrap() {
    let (a, b) = pair();
    // Move the cursors to 100 bytes before the end of the ring.
    let pre = RING as usize - 100;
    assert_eq!(a.write(&vec![0u8; pre]).unwrap(), pre);
    let mut sink = vec![0u8; pre];
    assert_eq!(b.recv(&mut sink, false, true, false).unwrap(), pre);
    // One region spanning the wrap.
    let mut w = a.reserve(1000).unwrap();
    assert_eq!(w.len(), RING as usize, "all free space, in one slice");
    for (i, x) in w[..1000].iter_mut().enumerate() {
        *x = stream_byte(3, i as u64);
    }
    w.commit(1000).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(r.len(), 1000);
    for (i, x) in r.iter().enumerate() {
        assert_eq!(*x, stream_byte(3, i as u64), "byte {i}");
    }
    r.release(600).unwrap();
    let r = b.peek_region().unwrap();
    assert_eq!(r.len(), 400);
    assert_eq!(r[0], stream_byte(3, 600));
    drop(r); // releases nothing
    assert_eq!(b.readable_len().unwrap(), 400);
    // Reading with read() after the zero-copy path continues the stream.
    let mut rest = [0u8; 400];
    assert_eq!(b.read(&mut rest).unwrap(), 400);
    assert_eq!(rest[399], stream_byte(3, 999));
    // An uncommitted reservation sends nothing; commit beyond it fails.
    let w = a.reserve(10).unwrap();
    drop(w);
    assert_eq!(b.readable_len().unwrap(), 0);
    let w = a.reserve(10).unwrap();
    let n = w.len();
    assert!(w.commit(n + 1).is_err());
    assert!(a.reserve(RING as usize + 1).is_err());
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
                for (i, x) in reg[..n].iter_mut().enumerate() {
                    *x = stream_byte(11, off + i as u64);
                }
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
            for (i, x) in r[..n].iter().enumerate() {
                assert_eq!(
                    *x,
                    stream_byte(11, off + i as u64),
                    "byte {}",
                    off + i as u64
                );
            }
            r.release(n).unwrap();
            off += n as u64;
        }
        assert_eq!(off, total);
        w.join().unwrap();
    });
}
