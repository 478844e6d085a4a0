//! Model check of the doorbell protocol (`smclo::doorbell`) with loom: one
//! writer thread and one reader thread over loom atomics, a loom ring and a
//! simulated bell queue whose readiness follows the kernel's rule (readable
//! iff a bell is queued, writable iff at most one is).
//!
//! Run (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_doorbell
//! ```
//!
//! Properties: no lost wake-up (a thread that waits for readiness is always
//! woken: loom reports a deadlock otherwise, including at the end, when the
//! writer is done and the reader still waits for the last bytes); `BELLS`
//! never above 2 (every load is validated) nor negative (the queue count
//! would underflow); at most 4 bytes ever queued (2 counted plus 2 the
//! reader took by CAS and is about to receive); every byte delivered once
//! and in order; and at the end the bell count in the word equals the
//! bells queued.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Condvar, Mutex};
use smclo::doorbell::{self, BellChannel, Block, Word};
use smclo_wire::cursor::{self, bells, Cursor};
use std::io;

/// The bell queue of one direction (what the UNIX socket does).
struct Chan {
    queued: Mutex<u32>,
    cv: Condvar,
}

impl Chan {
    fn wait_readable(&self) {
        let mut q = self.queued.lock().unwrap();
        while *q == 0 {
            q = self.cv.wait(q).unwrap();
        }
    }
    fn wait_writable(&self) {
        let mut q = self.queued.lock().unwrap();
        while *q >= 2 {
            q = self.cv.wait(q).unwrap();
        }
    }
}

impl BellChannel for Chan {
    fn send_bells(&self, n: u32) -> io::Result<()> {
        let mut q = self.queued.lock().unwrap();
        *q += n;
        // BELLS (<= 2, checked on every load) plus at most 2 the reader has
        // un-counted but not yet received; the minimum send buffer holds 6.
        assert!(*q <= 4, "{} bells queued", *q);
        self.cv.notify_all();
        Ok(())
    }
    fn recv_bells(&self, n: u32) -> io::Result<bool> {
        let mut q = self.queued.lock().unwrap();
        // Counted bells may not be sent yet: wait for them.
        while *q < n {
            q = self.cv.wait(q).unwrap();
        }
        *q -= n;
        self.cv.notify_all();
        Ok(true)
    }
}

struct Shared {
    prod: AtomicU64,
    cons: AtomicU64,
    ring: Vec<UnsafeCell<u8>>,
    chan: Chan,
}

fn pos(w: u64, len: u32) -> usize {
    (Cursor::from_word(w).position(len) % len as u64) as usize
}

/// Writer: `chunks` writes of consecutive byte values, waiting for room as
/// `Conn::send` does (block protocol, then wait until writable).
fn writer(s: &Shared, len: u32, chunks: &[u32]) {
    let mut next = 0u8;
    for &n in chunks {
        let mut left = n;
        while left > 0 {
            let snap = doorbell::snapshot(&s.prod, &s.cons, len).unwrap();
            let free = len - snap.used;
            if free == 0 {
                match doorbell::writer_block(&s.prod, &s.cons, len, 1).unwrap() {
                    Block::Room => {}
                    Block::Wait { send } => {
                        s.chan.send_bells(send).unwrap();
                        s.chan.wait_writable();
                    }
                }
                continue;
            }
            let k = free.min(left);
            let p = pos(snap.prod, len);
            for i in 0..k as usize {
                let v = next;
                next += 1;
                // SAFETY: loom's cell checks that no reader accesses this
                // slot concurrently; that is part of what is verified.
                s.ring[(p + i) % len as usize].with_mut(|c| unsafe { *c = v });
            }
            let b = doorbell::publish(&s.prod, &s.cons, len, k).unwrap();
            s.chan.send_bells(b).unwrap();
            left -= k;
        }
    }
}

/// How the reading application behaves.
#[derive(Clone, Copy)]
struct App {
    /// Bytes per read call (the buffer; also the spin capacity).
    cap: u32,
    /// Busy-poll (with `READER_SPINNING`) before sleeping in a read.
    spin: bool,
    /// Wait for readability before every other read call (the others are
    /// plain blocking reads, which may spin), like an application mixing
    /// epoll and blocking reads: data left without a bell hangs the poll.
    poll_first: bool,
    /// Stop after all but this many bytes, leaving them unread: a writer
    /// still waiting for room it actually has then hangs.
    leftover: u32,
}

/// One blocking read call of at most `app.cap` bytes, as `Conn::recv` does
/// it: read if there is data; otherwise settle, maybe spin, sleep until
/// readable. Checks the bytes against `expect`; returns how many it read.
fn read_call(s: &Shared, len: u32, app: App, expect: &mut u8) -> u32 {
    loop {
        let snap = doorbell::snapshot(&s.prod, &s.cons, len).unwrap();
        if snap.used > 0 {
            let k = snap.used.min(app.cap);
            let p = pos(snap.cons, len);
            for i in 0..k as usize {
                // SAFETY: as in the writer.
                let v = s.ring[(p + i) % len as usize].with(|c| unsafe { *c });
                assert_eq!(v, *expect, "bytes out of order");
                *expect += 1;
            }
            let take = doorbell::reader_consume(&s.prod, &s.cons, len, k).unwrap();
            s.chan.recv_bells(take).unwrap();
            return k;
        }
        let take = doorbell::reader_settle(&s.prod, &s.cons, len).unwrap();
        s.chan.recv_bells(take).unwrap();
        if app.spin && doorbell::spin_begin(&s.prod, &s.cons, len, app.cap as usize).unwrap() {
            // One look at the word while "spinning", then stop.
            let _ = Word::load(&s.prod);
            loom::thread::yield_now();
            doorbell::spin_end(&s.prod, len).unwrap();
        }
        let snap = doorbell::snapshot(&s.prod, &s.cons, len).unwrap();
        if snap.used > 0 {
            continue;
        }
        s.chan.wait_readable();
    }
}

/// Reader: the application reads `total - leftover` bytes in read calls.
fn reader(s: &Shared, len: u32, total: u32, app: App) {
    let mut expect = 0u8;
    let mut got = 0;
    let mut call = 0;
    while got < total - app.leftover {
        call += 1;
        if app.poll_first && call % 2 == 0 {
            s.chan.wait_readable();
        }
        got += read_call(s, len, App { cap: app.cap.min(total - app.leftover - got), ..app }, &mut expect);
    }
}

fn model(len: u32, chunks: &'static [u32], app: App, preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(move || {
        let s = Arc::new(Shared {
            prod: AtomicU64::new(0),
            cons: AtomicU64::new(0),
            ring: (0..len).map(|_| UnsafeCell::new(0)).collect(),
            chan: Chan { queued: Mutex::new(0), cv: Condvar::new() },
        });
        let total: u32 = chunks.iter().sum();
        assert!(app.leftover <= len);
        let w = {
            let s = s.clone();
            loom::thread::spawn(move || writer(&s, len, chunks))
        };
        reader(&s, len, total, app);
        w.join().unwrap();
        let p = Word::load(&s.prod);
        let q = *s.chan.queued.lock().unwrap();
        assert_eq!(bells(p) as u32, q, "bell count {p:#x} vs {q} queued");
        let used = cursor::distance(p, Word::load(&s.cons), len).unwrap();
        assert_eq!(used, app.leftover);
        if used > 0 {
            assert!(q > 0, "data left but the reader's descriptor is not readable");
        }
    });
}

const PLAIN: App = App { cap: 8, spin: false, poll_first: true, leftover: 0 };

/// Ring fills: the WRITE_BLOCKED Dekker handshake and the second bell.
#[test]
fn full_ring() {
    model(2, &[3, 2], PLAIN, 3);
}

/// The reader stops with a full ring after its last read made room for
/// the writer's last byte: the writer must not sleep on a ring that has
/// room (the WRITE_BLOCKED handshake at the very end).
#[test]
fn reader_stops_after_making_room() {
    model(2, &[2, 2], App { cap: 1, leftover: 2, ..PLAIN }, 3);
}

/// Small reads leave data behind: the bell must stay for the next poll.
#[test]
fn partial_reads() {
    model(4, &[3, 3], App { cap: 1, ..PLAIN }, 3);
}

/// A spinning reader with a small capacity, the last write larger than it:
/// the writer must ring.
#[test]
fn spinning_reader_small_capacity() {
    model(4, &[1, 3], App { cap: 1, spin: true, ..PLAIN }, 3);
}

/// A spinning reader whose capacity covers the writes, ring filling.
#[test]
fn spinning_reader_full_ring() {
    model(2, &[2, 2], App { cap: 2, spin: true, ..PLAIN }, 3);
}

/// Spinning, stopping with a full ring.
#[test]
fn spinning_reader_stops_after_making_room() {
    model(2, &[1, 3], App { cap: 1, spin: true, leftover: 2, ..PLAIN }, 3);
}
