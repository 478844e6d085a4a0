//! Shared helpers of the `conn_*` tests: connection pairs on memfd DMBs.
#![allow(dead_code)]

use smclo::testing::conn::{Conn, Mode};
use smclo::testing::dmb::{memfd, Dmb};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Ring length of most tests: the smallest, so streams wrap often.
pub const RING: u32 = smclo_wire::dmb_header::MIN_RING_LEN;

/// The two files and a connected pair: `a` reads ring `fa`, `b` reads `fb`.
pub struct Pair {
    pub a: Conn,
    pub b: Conn,
    pub fa: std::fs::File,
    pub fb: std::fs::File,
}

/// A connected pair with the given ring lengths and modes.
pub fn pair_with(ring_a: u32, ring_b: u32, mode_a: Mode, mode_b: Mode) -> Pair {
    let fa = memfd("conn-test-a").unwrap();
    let fb = memfd("conn-test-b").unwrap();
    let pid = std::process::id();
    let da = Dmb::create(&fa, 0xa, ring_a, 0x5eed, pid, 0).unwrap();
    let db = Dmb::create(&fb, 0xb, ring_b, 0x5eed, pid, 0).unwrap();
    let da_peer = Dmb::attach(&fa, 0xa, 0x5eed).unwrap();
    let db_peer = Dmb::attach(&fb, 0xb, 0x5eed).unwrap();
    let (ua, ub) = UnixStream::pair().unwrap();
    let a = Conn::new(da, db_peer, ua, mode_a).unwrap();
    let b = Conn::new(db, da_peer, ub, mode_b).unwrap();
    Pair { a, b, fa, fb }
}

/// A no-copy pair with 16 KiB rings.
pub fn pair() -> (Conn, Conn) {
    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    (p.a, p.b)
}

/// Deterministic pseudo-random bytes (xorshift), so streams can be checked
/// without keeping a copy.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The byte at offset `i` of test stream `seed`.
pub fn stream_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// Poll revents of `fd` right now.
pub fn revents(fd: i32) -> i16 {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    assert!(r >= 0);
    p.revents
}

pub fn readable(fd: i32) -> bool {
    revents(fd) & libc::POLLIN != 0
}

pub fn writable(fd: i32) -> bool {
    revents(fd) & libc::POLLOUT != 0
}

/// Runs `f` on a thread and fails the test if it takes longer than `t`.
pub fn within<T: Send + 'static>(t: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(t) {
        Ok(v) => v,
        Err(_) => panic!("timed out after {:?} (hang)", start.elapsed()),
    }
}
