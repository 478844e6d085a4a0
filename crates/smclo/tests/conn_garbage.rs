//! A peer that writes garbage into the cursor words: the connection is
//! aborted with EPROTO; nothing panics, nothing is read or written out of
//! bounds (a stray access would fault the test process).

mod conn_util;

use conn_util::*;
use smclo::testing::conn::{Conn, Mode, RecvFlags, SendFlags};
use smclo::testing::dmb::{memfd, Dmb};
use smclo_wire::cursor::{
    with_bells, with_conn_state_flags, with_prod_flags, Cursor, CONN_STATE_KNOWN, PEER_CONN_ABORT,
    PROD_FLAGS_KNOWN,
};
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn errno<T>(r: io::Result<T>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

#[test]
fn impossible_producer_is_eproto_and_resets_the_peer() {
    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    // The attacker (b's side) maps a's receive ring and lies about prod.
    let evil = Dmb::attach(&p.fa, 0xa, 0x5eed).unwrap();
    evil.prod().store(
        Cursor {
            count: RING + 5,
            ..Default::default()
        }
        .to_word(),
        Ordering::SeqCst,
    );
    let mut buf = [0u8; 64];
    assert_eq!(errno(p.a.read(&mut buf)), Some(libc::EPROTO));
    // Aborted: sticky, and the peer is told.
    assert_eq!(errno(p.a.write(b"x")), Some(libc::EPROTO));
    assert_eq!(errno(p.b.read(&mut buf)), Some(libc::ECONNRESET));
    let peer_flags = Dmb::attach(&p.fb, 0xb, 0x5eed)
        .unwrap()
        .prod()
        .load(Ordering::SeqCst)
        >> 56;
    assert_eq!(peer_flags as u8 & PEER_CONN_ABORT, PEER_CONN_ABORT);
}

#[test]
fn consumer_ahead_or_too_far_behind_is_eproto() {
    for lie in [
        Cursor {
            count: 1,
            ..Default::default()
        }
        .to_word(),
        Cursor {
            count: 0,
            wrap: 2,
            ..Default::default()
        }
        .to_word(),
    ] {
        let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
        // b lies about how much of a's writes it consumed.
        let evil = Dmb::attach(&p.fb, 0xb, 0x5eed).unwrap();
        evil.cons().store(lie, Ordering::SeqCst);
        assert_eq!(errno(p.a.write(b"hello")), Some(libc::EPROTO));
    }
}

#[test]
fn unknown_flags_and_three_bells_are_eproto() {
    // The lowest flag bit of each byte that no version of the protocol
    // defines (derived, so that a new flag does not make it a known one).
    let unknown_prod = 1u8 << (!PROD_FLAGS_KNOWN).trailing_zeros();
    let unknown_state = 1u8 << (!CONN_STATE_KNOWN).trailing_zeros();
    for w in [
        with_prod_flags(0, unknown_prod),
        with_conn_state_flags(0, unknown_state),
        with_bells(0, 3),
        with_bells(0, 2),
    ] {
        let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
        Dmb::attach(&p.fa, 0xa, 0x5eed)
            .unwrap()
            .prod()
            .store(w, Ordering::SeqCst);
        assert_eq!(errno(p.a.readable_len()), Some(libc::EPROTO), "{w:#x}");
    }
}

/// Random and nearly-valid words in all four cursor slots, random
/// non-blocking operations: results may be anything but a crash or a hang.
#[test]
fn random_garbage_never_crashes() {
    let mut rng = Rng(0xDEAD_BEEF);
    let mut eproto = 0;
    for i in 0..1500 {
        let p = pair_with(RING, RING, Mode::NoCopy, Mode::Copy { sndbuf_len: 4096 });
        p.a.set_nonblocking(true).unwrap();
        let evil_a = Dmb::attach(&p.fa, 0xa, 0x5eed).unwrap();
        let evil_b = Dmb::attach(&p.fb, 0xb, 0x5eed).unwrap();
        // Some honest traffic first, so cursors are somewhere.
        let _ = p.b.write(&vec![1u8; rng.below(RING as u64) as usize + 1]);
        let _ = p.a.write(&vec![2u8; rng.below(RING as u64) as usize + 1]);
        for _ in 0..4 {
            let word = match rng.below(3) {
                0 => rng.next(),
                // Valid count, random wrap and flags.
                1 => (rng.next() & !0xFFFF_FFFF) | rng.below(RING as u64),
                // Valid count and wrap near zero, one random known flag.
                _ => {
                    rng.below(RING as u64)
                        | rng.below(3) << 32
                        | [0u64, 0x80, 0x81, 0x82, 0x84, 0x02][rng.below(6) as usize] << 48
                }
            };
            let target = match rng.below(4) {
                0 => evil_a.prod(),
                1 => evil_a.cons(),
                2 => evil_b.prod(),
                _ => evil_b.cons(),
            };
            target.store(word, Ordering::SeqCst);
            // Bytes on the channel too, so lies about queued bells can be
            // "honoured" rather than waited for.
            // SAFETY: send from a valid buffer on the attacker's descriptor.
            unsafe {
                libc::send(
                    p.b.fd(),
                    b"!!".as_ptr().cast(),
                    rng.below(3) as usize,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            let mut buf = vec![0u8; rng.below(2 * RING as u64) as usize + 1];
            let r: io::Result<usize> = match rng.below(7) {
                0 => p.a.read(&mut buf),
                1 => p.a.recv(&mut buf, RecvFlags::PEEK | RecvFlags::DONTWAIT),
                2 => p.a.write(&buf),
                3 => p.a.readable_len(),
                4 => {
                    p.a.reserve(rng.below(RING as u64) as usize)
                        .map(|r| {
                            let n = r.len();
                            r.commit(n / 2).map(|_| n)
                        })
                        .and_then(|x| x)
                }
                5 => p.a.peek_region().map(|r| {
                    let n = r.len();
                    let mut got = vec![0u8; n];
                    r.copy_to_slice(0, &mut got);
                    let sum: usize = got.iter().map(|&b| b as usize).sum();
                    let _ = r.release(n);
                    sum
                }),
                _ => p.a.send(&buf, SendFlags::DONTWAIT),
            };
            if errno(r) == Some(libc::EPROTO) {
                eproto += 1;
                break;
            }
        }
        if i % 500 == 0 {
            eprintln!("iteration {i}: {eproto} aborted so far");
        }
    }
    assert!(eproto > 500, "garbage was detected only {eproto} times");
}

/// b's `cons` of the ring a writes into, a whole ring behind a's `prod`
/// (0): a distance the cursors alone allow (the ring full, unread).
fn cons_one_ring_back(p: &Pair) {
    let evil = Dmb::attach(&p.fb, 0xb, 0x5eed).unwrap();
    evil.cons().store(
        Cursor {
            count: 0,
            wrap: u16::MAX,
            ..Default::default()
        }
        .to_word(),
        Ordering::SeqCst,
    );
}

/// A writer holding corked bytes whose peer then moves `cons` a whole ring
/// back: the unread and the held bytes are more than the ring. Before,
/// the room was computed as `ring - unread - held`, which wrapped to
/// 4 GiB: `reserve` handed out a region that long over the 16 KiB ring,
/// and a `send` larger than the ring panicked in the copy.
#[test]
fn a_consumer_moved_back_over_held_bytes_is_eproto() {
    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    p.a.set_nonblocking(true).unwrap();
    assert_eq!(p.a.send(&[7u8; 100], SendFlags::MORE).unwrap(), 100);
    cons_one_ring_back(&p);
    assert_eq!(errno(p.a.reserve(1).map(|r| r.len())), Some(libc::EPROTO));

    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    p.a.set_nonblocking(true).unwrap();
    assert_eq!(p.a.send(&[7u8; 100], SendFlags::MORE).unwrap(), 100);
    cons_one_ring_back(&p);
    let big = vec![1u8; 2 * RING as usize];
    assert_eq!(errno(p.a.send(&big, SendFlags::EMPTY)), Some(libc::EPROTO));
    // Aborted, as every other violation.
    assert_eq!(errno(p.a.write(b"x")), Some(libc::EPROTO));
}

/// A process that stays runnable (a busy loop) until dropped.
struct Runnable(std::process::Child);

impl Drop for Runnable {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A non-blocking connection end `conn` whose writer is a busy process
/// (it can run, so a doorbell it counted may still come), with `ring`,
/// the writer's mapping of `conn`'s receive ring, and `bells`, the
/// writer's end of the channel.
struct OwedBells {
    conn: Conn,
    ring: Dmb,
    bells: UnixStream,
    _theirs: Dmb,
    _writer: Runnable,
}

impl OwedBells {
    fn new() -> OwedBells {
        let writer = Runnable(
            std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .unwrap(),
        );
        // Running its loop (state R) before the reader looks at it: just
        // spawned, under load, it may still be in exec.
        let stat = format!("/proc/{}/stat", writer.0.id());
        let until = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(&stat)
            .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('R')))
        {
            assert!(Instant::now() < until, "the busy writer never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (fa, fb) = (memfd("a").unwrap(), memfd("b").unwrap());
        let own = Dmb::create(&fa, 0xa, RING, 0x5eed, std::process::id(), 0).unwrap();
        // The DMB the reader's writer owns names the busy process.
        let theirs = Dmb::create(&fb, 0xb, RING, 0x5eed, writer.0.id(), 0).unwrap();
        let peer = Dmb::attach(&fb, 0xb, 0x5eed).unwrap();
        let (chan, bells) = UnixStream::pair().unwrap();
        let conn = Conn::new(own, peer, chan, Mode::NoCopy).unwrap();
        conn.set_nonblocking(true).unwrap();
        OwedBells {
            conn,
            ring: Dmb::attach(&fa, 0xa, 0x5eed).unwrap(),
            bells,
            _theirs: theirs,
            _writer: writer,
        }
    }
}

/// An honest writer whose doorbells come late (preempted between its
/// count and its send) costs the reader's budget for missing doorbells
/// nothing: after more than a second of such waits, a read still waits
/// for the late doorbell. Before, every wait was charged, and a long-lived
/// connection stopped waiting for good, leaving its descriptor readable
/// with nothing to read once the doorbell came.
#[test]
fn late_doorbells_do_not_spend_the_budget_for_missing_ones() {
    let w = OwedBells::new();
    let mut buf = [0u8; 16];
    let mut took = Vec::new();
    for _ in 0..14 {
        w.ring.prod().store(with_bells(0, 1), Ordering::SeqCst);
        let late = w.bells.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            std::io::Write::write_all(&mut &late, b"!").unwrap();
        });
        let t = Instant::now();
        assert_eq!(
            w.conn.read(&mut buf).map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::WouldBlock)
        );
        took.push(t.elapsed());
        sender.join().unwrap();
    }
    assert!(
        took.iter().all(|t| *t >= Duration::from_millis(80)),
        "a read stopped waiting for its late doorbell: {took:?}"
    );
}

/// A writer that counts a doorbell in the reader's `prod` word and never
/// sends it, while it keeps a thread runnable: the reader waits for that
/// doorbell (an honest writer is between its count and its send) for at
/// most a second over the connection's life. Before, every call waited the
/// whole second again, non-blocking reads and `FIONREAD` included: an event
/// loop stalled a second per call, for as long as the peer liked.
#[test]
fn a_doorbell_counted_and_never_sent_holds_up_reads_once() {
    let w = OwedBells::new();
    let (a, evil) = (&w.conn, &w.ring);
    evil.prod().store(with_bells(0, 1), Ordering::SeqCst);
    let mut buf = [0u8; 16];
    let start = Instant::now();
    let mut calls = Vec::new();
    for _ in 0..4 {
        let t = Instant::now();
        assert_eq!(
            a.read(&mut buf).map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::WouldBlock)
        );
        calls.push(t.elapsed());
    }
    let t = Instant::now();
    assert_eq!(a.readable_len().unwrap(), 0);
    calls.push(t.elapsed());
    let all = start.elapsed();
    assert!(
        all < Duration::from_millis(1600),
        "{all:?} in five calls: {calls:?}"
    );
    // Which call waits depends on when the writer's thread last ran (the
    // wait is for a writer between its count and its send): the first
    // usually, a later one when the writer was not runnable yet.
    assert!(
        calls
            .iter()
            .filter(|c| **c >= Duration::from_millis(200))
            .count()
            <= 1,
        "more than one call waited: {calls:?}"
    );
}
