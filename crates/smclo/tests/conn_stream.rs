//! Byte-exact streams through connection pairs: random sizes, many ring
//! wraps, both directions at once, both modes, slow readers, recv flags,
//! ping-pong with exact-size reads.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::{Conn, Mode, RecvFlags};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Writes `total` bytes of stream `seed` in random-sized writes.
fn send_stream(c: &Conn, seed: u64, total: u64, max_chunk: u64) {
    let mut rng = Rng(seed | 1);
    let mut buf = vec![0u8; max_chunk as usize];
    let mut off = 0u64;
    while off < total {
        let n = (1 + rng.below(max_chunk)).min(total - off) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = stream_byte(seed, off + i as u64);
        }
        assert_eq!(c.write(&buf[..n]).unwrap(), n, "blocking write is complete");
        off += n as u64;
    }
}

/// Reads stream `seed` to its end, checking every byte; returns its length.
fn recv_stream(c: &Conn, seed: u64, max_chunk: u64, slow: bool) -> u64 {
    let mut rng = Rng(seed.wrapping_mul(3) | 1);
    let mut buf = vec![0u8; max_chunk as usize];
    let mut off = 0u64;
    loop {
        let n = (1 + rng.below(max_chunk)) as usize;
        let got = c.read(&mut buf[..n]).unwrap();
        if got == 0 {
            return off;
        }
        for (i, b) in buf[..got].iter().enumerate() {
            assert_eq!(
                *b,
                stream_byte(seed, off + i as u64),
                "byte {} of stream {seed:x}",
                off + i as u64
            );
        }
        off += got as u64;
        if slow && rng.below(64) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn both_directions(a: Conn, b: Conn, total: u64, chunk: u64) {
    let a = Arc::new(a);
    let b = Arc::new(b);
    let mut th = Vec::new();
    for (w, r, seed) in [
        (a.clone(), b.clone(), 0xA11CEu64),
        (b.clone(), a.clone(), 0xB0B),
    ] {
        th.push(std::thread::spawn(move || {
            send_stream(&w, seed, total, chunk);
            w.shutdown_write().unwrap();
        }));
        th.push(std::thread::spawn(move || {
            assert_eq!(recv_stream(&r, seed, chunk, false), total)
        }));
    }
    for t in th {
        t.join().unwrap();
    }
    assert_eq!(a.bytes_sent(), total);
    assert_eq!(a.bytes_received(), total);
    assert_eq!(b.bytes_sent(), total);
}

#[test]
fn both_directions_at_once_no_copy() {
    let (a, b) = pair();
    within(Duration::from_secs(60), move || {
        both_directions(a, b, 24 << 20, 40_000)
    });
}

#[test]
fn both_directions_at_once_copy_mode() {
    let p = pair_with(
        RING,
        32 * 1024,
        Mode::Copy { sndbuf_len: 8192 },
        Mode::Copy { sndbuf_len: 65536 },
    );
    let (a, b) = (p.a, p.b);
    within(Duration::from_secs(60), move || {
        both_directions(a, b, 12 << 20, 70_000)
    });
}

#[test]
fn small_writes_and_reads() {
    let (a, b) = pair();
    within(Duration::from_secs(60), move || {
        both_directions(a, b, 2 << 20, 40)
    });
}

#[test]
fn slow_reader_loses_nothing() {
    let (a, b) = pair();
    within(Duration::from_secs(60), move || {
        let w = std::thread::spawn(move || {
            send_stream(&a, 7, 4 << 20, 64_000);
            a.shutdown_write().unwrap();
            a
        });
        assert_eq!(recv_stream(&b, 7, 3000, true), 4 << 20);
        w.join().unwrap();
    });
}

#[test]
fn peek_waitall_and_readable_len() {
    let (a, b) = pair();
    a.write(b"hello world").unwrap();
    let mut buf = [0u8; 5];
    assert_eq!(b.readable_len().unwrap(), 11);
    assert_eq!(b.recv(&mut buf, RecvFlags::PEEK).unwrap(), 5);
    assert_eq!(&buf, b"hello");
    assert_eq!(b.readable_len().unwrap(), 11, "peek consumes nothing");
    let mut big = [0u8; 64];
    assert_eq!(b.recv(&mut big, RecvFlags::EMPTY).unwrap(), 11);
    assert_eq!(&big[..11], b"hello world");
    assert_eq!(b.readable_len().unwrap(), 0);
    // Nothing there: MSG_DONTWAIT says so at once.
    assert_eq!(
        b.recv(&mut big, RecvFlags::DONTWAIT).unwrap_err().kind(),
        io::ErrorKind::WouldBlock
    );
    assert_eq!(
        b.recv(&mut big, RecvFlags::PEEK | RecvFlags::DONTWAIT)
            .unwrap_err()
            .kind(),
        io::ErrorKind::WouldBlock
    );

    // WAITALL gathers several writes.
    let b = Arc::new(b);
    let r = {
        let b = b.clone();
        std::thread::spawn(move || {
            let mut all = [0u8; 30];
            let n = b.recv(&mut all, RecvFlags::WAITALL).unwrap();
            (n, all)
        })
    };
    for i in 0..3u8 {
        std::thread::sleep(Duration::from_millis(20));
        a.write(&[b'a' + i; 10]).unwrap();
    }
    let (n, all) = r.join().unwrap();
    assert_eq!(n, 30);
    assert_eq!(&all[..], &[[b'a'; 10], [b'b'; 10], [b'c'; 10]].concat()[..]);

    // PEEK|WAITALL waits until the whole request is there, then consumes
    // nothing; end of stream cuts it short.
    let r = {
        let b = b.clone();
        std::thread::spawn(move || {
            let mut p = [0u8; 8];
            let n = b
                .recv(&mut p, RecvFlags::PEEK | RecvFlags::WAITALL)
                .unwrap();
            (n, p)
        })
    };
    a.write(b"1234").unwrap();
    std::thread::sleep(Duration::from_millis(30));
    a.write(b"5678").unwrap();
    let (n, p) = r.join().unwrap();
    assert_eq!((n, &p), (8, b"12345678"));
    assert_eq!(b.readable_len().unwrap(), 8);
    a.write(b"9").unwrap();
    a.shutdown_write().unwrap();
    let mut w = [0u8; 100];
    assert_eq!(
        b.recv(&mut w, RecvFlags::WAITALL).unwrap(),
        9,
        "WAITALL stops at end of stream"
    );
    assert_eq!(b.read(&mut w).unwrap(), 0);
}

#[test]
fn waitall_larger_than_the_ring() {
    let (a, b) = pair();
    within(Duration::from_secs(20), move || {
        let total = 5 * RING as usize + 123;
        let w = std::thread::spawn(move || {
            let data: Vec<u8> = (0..total).map(|i| stream_byte(9, i as u64)).collect();
            a.write(&data).unwrap();
            a
        });
        let mut buf = vec![0u8; total];
        assert_eq!(b.recv(&mut buf, RecvFlags::WAITALL).unwrap(), total);
        for (i, x) in buf.iter().enumerate() {
            assert_eq!(*x, stream_byte(9, i as u64));
        }
        w.join().unwrap();
    });
}

/// sockperf's ping-pong pattern: the client writes a 14-byte message that
/// carries its sequence number and reads exactly 14 bytes back (so a
/// spinning read's capacity is one message and the echo skips the
/// doorbell); the server reads up to 65507 bytes and echoes what it got.
/// Every reply must be the message just sent, whole.
fn ping_pong(mode: Mode, rounds: u64) {
    let p = pair_with(256 * 1024, 256 * 1024, mode, mode);
    let (a, b) = (p.a, p.b);
    within(Duration::from_secs(60), move || {
        let echo = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65507];
            loop {
                let n = b.read(&mut buf).unwrap();
                if n == 0 {
                    return;
                }
                assert_eq!(b.write(&buf[..n]).unwrap(), n);
            }
        });
        let mut reply = [0u8; 14];
        for seq in 1..=rounds {
            let mut m = [0u8; 14];
            m[..8].copy_from_slice(&seq.to_be_bytes());
            m[8..].copy_from_slice(&[0, 3, 0, 0, 0, 14]);
            assert_eq!(a.write(&m).unwrap(), 14);
            let mut got = 0;
            while got < 14 {
                let n = a.read(&mut reply[got..]).unwrap();
                assert!(n > 0, "end of stream after {got} bytes of reply {seq}");
                got += n;
            }
            assert_eq!(reply, m, "reply {seq}");
        }
        a.shutdown_write().unwrap();
        echo.join().unwrap();
    });
}

#[test]
fn ping_pong_exact_reads_no_copy() {
    ping_pong(Mode::NoCopy, 100_000);
}

#[test]
fn ping_pong_exact_reads_copy_mode() {
    ping_pong(
        Mode::Copy {
            sndbuf_len: 256 * 1024,
        },
        100_000,
    );
}
