//! Model check of the doorbell protocol (`smclo::testing::doorbell`) with loom: one
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
//! writer is done and the reader still waits for the last bytes), also for
//! applications that use non-blocking calls and edge-triggered epoll and
//! wait after a short read or write, or after reading what FIONREAD said,
//! as nginx does; `BELLS` never above 2 (every load is validated) nor
//! negative (the queue count would underflow); at most 6 bytes ever queued
//! (2 counted and a loose bell, plus as many the reader took by CAS and is
//! about to receive), also while the reader owes bells the writer counted
//! and has not sent (the reader never waits for them); every byte
//! delivered once and in order; and at the end the bells counted in the
//! word (`BELLS` and a loose bell) plus those owed equal the bells queued.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Condvar, Mutex};
use smclo::testing::doorbell::{self, BellChannel, Block, Word};
use smclo_wire::cursor::{self, bells, Cursor};
use std::io;

/// The bell queue of one direction (what the UNIX socket does), and its
/// edges: how many times the kernel woke the reader's wait queue for input
/// (every send) and the writer's for output (every receive that leaves the
/// writer writable), which is what edge-triggered epoll reports.
struct Chan {
    q: Mutex<Queue>,
    cv: Condvar,
}

#[derive(Default)]
struct Queue {
    queued: u32,
    rx_edges: u32,
    tx_edges: u32,
}

impl Chan {
    fn wait_readable(&self) {
        let mut q = self.q.lock().unwrap();
        while q.queued == 0 {
            q = self.cv.wait(q).unwrap();
        }
    }
    fn wait_writable(&self) {
        let mut q = self.q.lock().unwrap();
        while q.queued >= 2 {
            q = self.cv.wait(q).unwrap();
        }
    }
    /// `epoll_wait` for EPOLLIN|EPOLLET: sleeps until an edge newer than
    /// `seen` finds the descriptor readable (an edge that finds it not
    /// readable is dropped, as the kernel drops the ready-list entry).
    fn wait_rx_edge(&self, seen: &mut u32) {
        let mut q = self.q.lock().unwrap();
        loop {
            while q.rx_edges == *seen {
                q = self.cv.wait(q).unwrap();
            }
            *seen = q.rx_edges;
            if q.queued > 0 {
                return;
            }
        }
    }
    /// `epoll_wait` for EPOLLOUT|EPOLLET, likewise.
    fn wait_tx_edge(&self, seen: &mut u32) {
        let mut q = self.q.lock().unwrap();
        loop {
            while q.tx_edges == *seen {
                q = self.cv.wait(q).unwrap();
            }
            *seen = q.tx_edges;
            if q.queued < 2 {
                return;
            }
        }
    }
}

impl BellChannel for Chan {
    fn send_bells(&self, n: u32) -> io::Result<()> {
        let mut q = self.q.lock().unwrap();
        q.queued += n;
        // BELLS (<= 2, checked on every load) and a loose bell, plus as
        // many the reader has un-counted but not yet received; the minimum
        // send buffer holds 6.
        assert!(q.queued <= 6, "{} bells queued", q.queued);
        if n > 0 {
            q.rx_edges += 1;
        }
        self.cv.notify_all();
        Ok(())
    }
    fn take_bells(&self, n: u32) -> io::Result<Option<u32>> {
        let mut q = self.q.lock().unwrap();
        // Counted bells may not be sent yet: take what is there.
        let k = n.min(q.queued);
        q.queued -= k;
        if k > 0 && q.queued < 2 {
            q.tx_edges += 1;
        }
        self.cv.notify_all();
        Ok(Some(k))
    }
}

struct Shared {
    prod: AtomicU64,
    cons: AtomicU64,
    ring: Vec<UnsafeCell<u8>>,
    chan: Chan,
    /// Bells the reader un-counted and has not received (`Conn`'s
    /// `rx_owed`); only the reader thread touches it.
    owed: std::sync::atomic::AtomicU32,
}

/// Receives `n` bells the reader un-counted, and those owed before, as
/// far as they are queued now (`Conn::recv_bells`): never waits for a bell
/// the writer counted and has not sent.
fn recv_bells(s: &Shared, n: u32) {
    use std::sync::atomic::Ordering::Relaxed;
    let owed = s.owed.load(Relaxed) + n;
    let got = s.chan.take_bells(owed).unwrap().unwrap();
    s.owed.store(owed - got, Relaxed);
}

fn pos(w: u64, len: u32) -> usize {
    (Cursor::from_word(w).position(len) % len as u64) as usize
}

/// Writer: `chunks` writes of consecutive byte values, waiting for room as
/// `Conn::send` does (block protocol, then wait until writable); with
/// `app.et_write`, as a non-blocking `Conn::send` whose caller waits for an
/// EPOLLOUT edge after every short write.
fn writer(s: &Shared, len: u32, early: u32, chunks: &[u32], app: App) {
    let mut next = early as u8;
    let mut seen = 0;
    if early > 0 {
        // The client follows the server's Accept: it rings for the early
        // bytes the server copied into its ring, if still unread.
        let b = doorbell::ring_for_unread(&s.prod, &s.cons, len).unwrap();
        s.chan.send_bells(b).unwrap();
    }
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
                        if app.et_write {
                            // WouldBlock, or a short write: wait for the edge.
                            s.chan.wait_tx_edge(&mut seen);
                        } else {
                            s.chan.wait_writable();
                        }
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
    /// The reader uses non-blocking reads and edge-triggered epoll, and
    /// waits for the next EPOLLIN edge after any read that returned less
    /// than it asked for (nginx does so when the kernel has EPOLLRDHUP):
    /// a short read must leave no data behind that no future edge covers.
    et_read: bool,
    /// The writer uses non-blocking writes and waits for an EPOLLOUT edge
    /// when the ring is full.
    et_write: bool,
    /// With `et_read`, also nginx's accounting: after an edge, a read that
    /// fills the buffer is followed by FIONREAD, and the reader then reads
    /// that many bytes more before it waits for the next edge (it also
    /// waits if it read more than FIONREAD said: for TCP, the extra bytes
    /// brought an edge of their own).
    fionread: bool,
}

/// Takes up to `want` bytes from the ring if there are any, as `Conn::recv`
/// does: copy, consume, receive the bells the settle took. Checks the bytes
/// against `expect`; returns how many it took.
fn take(s: &Shared, len: u32, want: u32, expect: &mut u8) -> u32 {
    let snap = doorbell::snapshot(&s.prod, &s.cons, len).unwrap();
    let k = snap.used.min(want);
    if k == 0 {
        return 0;
    }
    let p = pos(snap.cons, len);
    for i in 0..k as usize {
        // SAFETY: as in the writer.
        let v = s.ring[(p + i) % len as usize].with(|c| unsafe { *c });
        assert_eq!(v, *expect, "bytes out of order");
        *expect += 1;
    }
    let take = doorbell::reader_consume(&s.prod, &s.cons, len, k).unwrap();
    recv_bells(s, take);
    k
}

/// One read call of at most `cap` bytes, as `Conn::recv` does it: take
/// what is there, and keep taking while there is more and room for it (so
/// the call returns short only after a settle that found the ring empty);
/// if there was nothing, settle, and (blocking) maybe spin, then sleep
/// until readable and look again, or (non-blocking) report `None`.
fn read_call(s: &Shared, len: u32, app: App, cap: u32, expect: &mut u8) -> Option<u32> {
    loop {
        let mut got = 0;
        loop {
            let k = take(s, len, cap - got, expect);
            got += k;
            if k == 0 || got == cap {
                break;
            }
        }
        if got > 0 {
            return Some(got);
        }
        let take = doorbell::reader_settle(&s.prod, &s.cons, len).unwrap();
        recv_bells(s, take);
        if app.et_read {
            return None;
        }
        if app.spin && doorbell::spin_begin(&s.prod, &s.cons, len, cap as usize).unwrap() {
            // One look at the word while "spinning", then stop.
            let _ = Word::load(&s.prod);
            loom::thread::yield_now();
            doorbell::spin_end(&s.prod, len).unwrap();
        }
        let snap = doorbell::snapshot(&s.prod, &s.cons, len).unwrap();
        if snap.used > 0 {
            continue;
        }
        // Owed bells that arrived are taken before sleeping (`rx_next`).
        recv_bells(s, 0);
        s.chan.wait_readable();
    }
}

/// FIONREAD, as `Conn::readable_len`.
fn fionread(s: &Shared, len: u32) -> u32 {
    let (used, take) = doorbell::reader_report(&s.prod, &s.cons, len).unwrap();
    recv_bells(s, take);
    used
}

/// Reader: the application reads `total - leftover` bytes in read calls.
fn reader(s: &Shared, len: u32, total: u32, app: App) {
    let mut expect = 0u8;
    let mut got = 0;
    let mut call = 0;
    let mut seen = 0;
    // Edge-triggered: ready after an edge (none yet), until a read says
    // otherwise; `avail` is what FIONREAD said, minus what was read since.
    let mut ready = !app.et_read;
    let mut avail: Option<u32> = None;
    while got < total - app.leftover {
        if !ready {
            s.chan.wait_rx_edge(&mut seen);
            ready = true;
            avail = None;
        }
        if avail == Some(0) {
            ready = false;
            continue;
        }
        call += 1;
        if app.poll_first && call % 2 == 0 {
            s.chan.wait_readable();
        }
        let cap = app.cap.min(total - app.leftover - got);
        let r = read_call(s, len, app, cap, &mut expect);
        let n = r.unwrap_or(0);
        got += n;
        if !app.et_read {
            continue;
        }
        if r.is_none() || n < cap {
            ready = false;
        } else if app.fionread {
            avail = match avail {
                Some(a) if n > a => {
                    ready = false;
                    Some(0)
                }
                Some(a) => Some(a - n),
                None => Some(fionread(s, len)),
            };
        }
    }
}

fn model(len: u32, chunks: &'static [u32], app: App, preemptions: usize) {
    model_early(len, 0, chunks, app, preemptions);
}

/// [`model`] of a connection whose ring starts with `early` bytes that the
/// server published without a doorbell (a client's early bytes,
/// `handshake::early`); the writer, the client, rings for them first.
fn model_early(len: u32, early: u32, chunks: &'static [u32], app: App, preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(move || {
        let s = Arc::new(Shared {
            prod: AtomicU64::new(cursor::advance(0, early, len)),
            cons: AtomicU64::new(0),
            ring: (0..len)
                .map(|i| UnsafeCell::new(if i < early { i as u8 } else { 0 }))
                .collect(),
            chan: Chan {
                q: Mutex::new(Queue::default()),
                cv: Condvar::new(),
            },
            owed: Default::default(),
        });
        let total: u32 = early + chunks.iter().sum::<u32>();
        assert!(app.leftover <= len && early <= len);
        let w = {
            let s = s.clone();
            loom::thread::spawn(move || writer(&s, len, early, chunks, app))
        };
        reader(&s, len, total, app);
        w.join().unwrap();
        let p = Word::load(&s.prod);
        let q = s.chan.q.lock().unwrap().queued;
        let loose = (cursor::prod_flags(p) & cursor::LOOSE_BELL != 0) as u32;
        let owed = s.owed.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            bells(p) as u32 + loose + owed,
            q,
            "bell count {p:#x} and {owed} owed vs {q} queued"
        );
        let used = cursor::distance(p, Word::load(&s.cons), len).unwrap();
        assert_eq!(used, app.leftover);
        if used > 0 {
            assert!(
                q > 0,
                "data left but the reader's descriptor is not readable"
            );
        }
    });
}

const PLAIN: App = App {
    cap: 8,
    spin: false,
    poll_first: true,
    leftover: 0,
    et_read: false,
    et_write: false,
    fionread: false,
};
const EDGE: App = App {
    cap: 8,
    spin: false,
    poll_first: false,
    leftover: 0,
    et_read: true,
    et_write: true,
    fionread: false,
};

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
    model(
        2,
        &[2, 2],
        App {
            cap: 1,
            leftover: 2,
            ..PLAIN
        },
        3,
    );
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
    model(
        4,
        &[1, 3],
        App {
            cap: 1,
            spin: true,
            ..PLAIN
        },
        3,
    );
}

/// A spinning reader whose capacity covers the writes, ring filling.
#[test]
fn spinning_reader_full_ring() {
    model(
        2,
        &[2, 2],
        App {
            cap: 2,
            spin: true,
            ..PLAIN
        },
        3,
    );
}

/// Spinning, stopping with a full ring.
#[test]
fn spinning_reader_stops_after_making_room() {
    model(
        2,
        &[1, 3],
        App {
            cap: 1,
            spin: true,
            leftover: 2,
            ..PLAIN
        },
        3,
    );
}

/// Edge-triggered applications, the reader's buffer larger than each
/// write: a write that lands while a read is copying the previous one must
/// be taken by that read (it brings no new bell, so no new edge).
#[test]
fn edge_triggered_short_reads() {
    model(4, &[1, 1, 1], EDGE, 3);
}

/// Edge-triggered applications and a full ring: the writer waits for an
/// EPOLLOUT edge, the reader for EPOLLIN edges after short reads.
#[test]
fn edge_triggered_full_ring() {
    model(2, &[3, 2], App { cap: 1, ..EDGE }, 3);
}

/// nginx's FIONREAD accounting: a write after the FIONREAD (a bell already
/// queued) must still bring an edge, or the reader, having read what
/// FIONREAD said, sleeps with the rest in the ring.
#[test]
fn edge_triggered_fionread() {
    model(
        4,
        &[1, 1, 1],
        App {
            cap: 1,
            fionread: true,
            ..EDGE
        },
        3,
    );
}

/// FIONREAD accounting with a full ring: the loose bell next to two
/// counted ones, and the reader taking them while making room.
#[test]
fn edge_triggered_fionread_full_ring() {
    model(
        2,
        &[2, 2, 1],
        App {
            cap: 1,
            fionread: true,
            ..EDGE
        },
        3,
    );
}

/// A client's early bytes in the server's ring, published there without a
/// doorbell: the client's ring for what is unread, racing the server's
/// reads and settles, leaves no unread data without a bell (a poller that
/// waits for readability first, and an edge-triggered one, are woken).
#[test]
fn early_bytes_then_writes() {
    model_early(3, 2, &[2], PLAIN, 3);
    model_early(3, 2, &[2], EDGE, 3);
}

/// Early bytes the server leaves unread: the client's ring must make the
/// server's descriptor readable.
#[test]
fn early_bytes_left_unread() {
    model_early(
        3,
        2,
        &[],
        App {
            leftover: 2,
            ..PLAIN
        },
        3,
    );
}
