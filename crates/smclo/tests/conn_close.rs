//! Close semantics (SMC): half-close, close, abort, a peer that vanishes.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::Conn;
use std::io;
use std::sync::Arc;
use std::time::Duration;

fn errno(r: io::Result<usize>) -> i32 {
    r.expect_err("expected an error")
        .raw_os_error()
        .expect("an errno")
}

/// Simulates a peer process that died: its descriptor closes, no flag set.
fn vanish(c: Conn) {
    let fd = c.fd();
    std::mem::forget(c);
    // SAFETY: the forgotten Conn owned `fd` and never uses it again.
    unsafe { libc::close(fd) };
}

#[test]
fn half_close_both_ways() {
    let (a, b) = pair();
    a.write(b"from a").unwrap();
    a.shutdown_write().unwrap();
    assert_eq!(errno(a.write(b"more")), libc::EPIPE);
    let mut buf = [0u8; 64];
    assert_eq!(b.read(&mut buf).unwrap(), 6);
    assert_eq!(&buf[..6], b"from a");
    assert_eq!(b.read(&mut buf).unwrap(), 0);
    assert_eq!(b.read(&mut buf).unwrap(), 0, "end of stream stays");
    // The other direction still works.
    b.write(b"from b").unwrap();
    assert_eq!(a.read(&mut buf).unwrap(), 6);
    b.shutdown_write().unwrap();
    assert_eq!(a.read(&mut buf).unwrap(), 0);
    assert!(
        readable(a.fd()) && readable(b.fd()),
        "end of stream is readable"
    );
    a.close().unwrap();
    b.close().unwrap();
}

#[test]
fn close_after_data_gives_data_then_eof_and_epipe() {
    let (a, b) = pair();
    a.write(b"last words").unwrap();
    a.close().unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(b.read(&mut buf).unwrap(), 10);
    assert_eq!(b.read(&mut buf).unwrap(), 0);
    // TCP's first write after the peer's close goes out (the peer answers
    // with a reset); the next one fails.
    assert_eq!(b.write(b"x").unwrap(), 1);
    assert_eq!(errno(b.write(b"x")), libc::EPIPE);
}

#[test]
fn close_with_unread_data_resets_the_peer() {
    let (a, b) = pair();
    a.write(b"never read").unwrap();
    b.write(b"read me").unwrap();
    b.close().unwrap(); // "never read" is still in b's ring: abort
    let mut buf = [0u8; 64];
    assert_eq!(a.read(&mut buf).unwrap(), 7, "data first");
    assert_eq!(errno(a.read(&mut buf)), libc::ECONNRESET);
    assert_eq!(errno(a.write(b"x")), libc::EPIPE);
}

#[test]
fn drop_is_close() {
    let (a, b) = pair();
    drop(b);
    let mut buf = [0u8; 8];
    assert_eq!(a.read(&mut buf).unwrap(), 0);
    let (a, b) = pair();
    a.write(b"x").unwrap();
    drop(b);
    assert_eq!(errno(a.read(&mut buf)), libc::ECONNRESET);
}

#[test]
fn abort_resets_the_peer_and_fails_locally() {
    let (a, b) = pair();
    a.write(b"abc").unwrap();
    a.abort();
    let mut buf = [0u8; 8];
    assert_eq!(b.read(&mut buf).unwrap(), 3);
    assert_eq!(errno(b.read(&mut buf)), libc::ECONNRESET);
    assert_eq!(errno(b.write(b"x")), libc::EPIPE);
    assert_eq!(errno(a.read(&mut buf)), libc::ECONNABORTED);
    assert_eq!(errno(a.write(b"x")), libc::ECONNABORTED);
}

#[test]
fn vanished_peer_is_a_reset_after_the_data() {
    let (a, b) = pair();
    b.write(b"orphan").unwrap();
    vanish(b);
    let mut buf = [0u8; 64];
    assert_eq!(a.read(&mut buf).unwrap(), 6);
    assert_eq!(errno(a.read(&mut buf)), libc::ECONNRESET);
    // Writing: the doorbell send hits the closed end: EPIPE from then on.
    let _ = a.write(b"x");
    assert_eq!(errno(a.write(b"x")), libc::EPIPE);
}

#[test]
fn blocked_reader_wakes_on_close_and_on_vanish() {
    let (a, b) = pair();
    let a = Arc::new(a);
    let r = {
        let a = a.clone();
        std::thread::spawn(move || a.read(&mut [0u8; 8]))
    };
    std::thread::sleep(Duration::from_millis(50));
    b.close().unwrap();
    assert_eq!(
        within(Duration::from_secs(2), move || r.join().unwrap().unwrap()),
        0
    );

    let (a, b) = pair();
    let a = Arc::new(a);
    let r = {
        let a = a.clone();
        std::thread::spawn(move || a.read(&mut [0u8; 8]).map_err(|e| e.raw_os_error()))
    };
    std::thread::sleep(Duration::from_millis(50));
    vanish(b);
    assert_eq!(
        within(Duration::from_secs(2), move || r.join().unwrap()),
        Err(Some(libc::ECONNRESET))
    );
}

#[test]
fn a_blocked_writer_wakes_and_the_reset_is_reported_once() {
    for kill in [false, true] {
        let (a, b) = pair();
        let w = std::thread::spawn(move || {
            let big = vec![7u8; 4 * RING as usize];
            let r = a.write(&big);
            (
                r.map_err(|e| e.raw_os_error()),
                a.write(b"again").map_err(|e| e.raw_os_error()),
                a.write(b"again").map_err(|e| e.raw_os_error()),
            )
        });
        std::thread::sleep(Duration::from_millis(50));
        if kill {
            vanish(b);
        } else {
            b.close().unwrap();
        }
        let (first, second, third) = within(Duration::from_secs(2), move || w.join().unwrap());
        // The first write returns what it got in (a partial count); the
        // peer left bytes unread, a reset: the next write reports it, as
        // TCP's, and the one after finds the connection gone.
        assert_eq!(first, Ok(RING as usize), "kill={kill}");
        assert_eq!(second, Err(Some(libc::ECONNRESET)), "kill={kill}");
        assert_eq!(third, Err(Some(libc::EPIPE)), "kill={kill}");
    }
}

#[test]
fn no_sigpipe_ever() {
    // With the default action a SIGPIPE would kill the test process.
    // SAFETY: restoring a default signal disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let (a, b) = pair();
    vanish(b);
    for _ in 0..3 {
        let _ = a.write(b"into the void");
    }
    let (a, b) = pair();
    b.close().unwrap();
    assert_eq!(
        a.write(b"x").unwrap(),
        1,
        "TCP's first write after the close"
    );
    assert_eq!(errno(a.write(b"x")), libc::EPIPE);
    a.shutdown_write().unwrap();
}
