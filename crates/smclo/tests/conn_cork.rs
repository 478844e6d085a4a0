//! Corking (TCP_CORK, MSG_MORE) on a connection pair: held bytes are not
//! visible to the reader (no data, no readiness) until published, and every
//! way of publishing delivers them in order, in both transfer modes.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::{Conn, Mode, RecvFlags, SendFlags};
use std::io::ErrorKind;
use std::time::Duration;

fn modes() -> [(Conn, Conn); 2] {
    let copy = Mode::Copy { sndbuf_len: RING };
    let c = pair_with(RING, RING, copy, copy);
    [pair(), (c.a, c.b)]
}

/// Nothing to read (non-blocking) and the descriptor not readable.
fn nothing(r: &Conn, what: &str) {
    assert!(!readable(r.fd()), "{what}: readable while held");
    let mut b = [0u8; 64];
    let e = r.recv(&mut b, RecvFlags::DONTWAIT).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock, "{what}");
}

fn read_n(r: &Conn, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    let mut got = 0;
    while got < n {
        got += r.recv(&mut out[got..], RecvFlags::EMPTY).unwrap();
    }
    out
}

#[test]
fn cork_holds_until_uncorked() {
    for (w, r) in modes() {
        w.set_cork(true).unwrap();
        assert!(w.corked());
        assert_eq!(w.write(b"head ").unwrap(), 5);
        assert_eq!(w.write(b"body").unwrap(), 4);
        assert!(w.holding());
        nothing(&r, "corked");
        w.set_cork(false).unwrap();
        assert!(!w.holding());
        assert_eq!(read_n(&r, 9), b"head body");
    }
}

#[test]
fn msg_more_then_plain_write_publishes_both() {
    for (w, r) in modes() {
        w.send(b"one ", SendFlags::MORE).unwrap();
        nothing(&r, "MSG_MORE");
        w.send(b"two", SendFlags::EMPTY).unwrap();
        assert_eq!(read_n(&r, 7), b"one two");
    }
}

#[test]
fn flush_and_ceiling_publish_held_bytes() {
    let (w, r) = pair();
    w.send(b"x", SendFlags::MORE).unwrap();
    // Younger than the age asked for: still held, and the time left said.
    let left = w.flush_older(Duration::from_secs(60)).unwrap();
    assert!(
        left.is_some_and(|d| d > Duration::from_secs(50)),
        "{left:?}"
    );
    nothing(&r, "young");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(w.flush_older(Duration::from_millis(10)).unwrap(), None);
    assert_eq!(read_n(&r, 1), b"x");
    w.send(b"y", SendFlags::MORE).unwrap();
    w.flush().unwrap();
    assert_eq!(read_n(&r, 1), b"y");
}

#[test]
fn half_ring_and_full_ring_publish_while_corked() {
    for (w, r) in modes() {
        w.set_cork(true).unwrap();
        let half = vec![7u8; RING as usize / 2];
        w.write(&half).unwrap();
        // Half the ring is in use: published although corked.
        assert!(!w.holding());
        assert_eq!(read_n(&r, half.len()), half);
        // More than the ring, corked all along: a reader thread drains it
        // (each full ring is published), the last piece on shutdown.
        let total = 3 * RING as usize + 123;
        let data: Vec<u8> = (0..total).map(|i| stream_byte(9, i as u64)).collect();
        std::thread::scope(|sc| {
            let rd = sc.spawn(|| read_n(&r, total));
            w.write(&data).unwrap();
            w.shutdown_write().unwrap();
            assert_eq!(rd.join().unwrap(), data);
        });
    }
}

#[test]
fn zero_copy_commit_while_corked_is_held_after_written_bytes() {
    let (w, r) = pair();
    w.set_cork(true).unwrap();
    w.write(b"ab").unwrap();
    let mut region = w.reserve(2).unwrap();
    region.copy_from_slice(0, b"cd");
    region.commit(2).unwrap();
    nothing(&r, "corked commit");
    w.set_cork(false).unwrap();
    assert_eq!(read_n(&r, 4), b"abcd");
}

#[test]
fn close_delivers_held_bytes() {
    let (w, r) = pair();
    w.send(b"last words", SendFlags::MORE).unwrap();
    w.close().unwrap();
    assert_eq!(read_n(&r, 10), b"last words");
    let mut b = [0u8; 1];
    assert_eq!(r.recv(&mut b, RecvFlags::EMPTY).unwrap(), 0);
}
