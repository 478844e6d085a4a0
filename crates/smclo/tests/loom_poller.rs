//! Model check of the pollers' doorbell skip (`smclo::testing::doorbell`
//! "Pollers") with loom: a writer publishes while event-loop threads of
//! the reader's process poll the ring from user space, each inside a
//! `POLLED` session, and sleep in a simulated kernel wait (readable iff a
//! bell is queued) only after ending the session and looking once more.
//!
//! Run (also in CI, with the doorbell model):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_poller
//! ```
//!
//! Property: no lost wake-up. While bytes are unread, some poller is awake
//! or will be woken by a bell (loom reports a deadlock otherwise), with one
//! poller, with two threads polling the same ring (overlapping sessions:
//! the per-process count), and beside a blocking reader that spins with
//! `READER_SPINNING`. The last test is the protocol without the look after
//! the session ends, which loom must find losing a wake-up.
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Condvar, Mutex};
use smclo::testing::doorbell::{self, BellChannel, Word};
use std::io;

const LEN: u32 = 16;

/// The bell queue (the UNIX socket) and the event loop's state: bytes
/// read so far, and whether everything was read (the loop then stops its
/// other threads, as a program would).
#[derive(Default)]
struct Kernel {
    queued: u32,
    read: u32,
    /// Consumer threads asleep in [`kernel_wait`].
    asleep: u32,
    /// The writer published everything.
    written: bool,
}

struct Shared {
    prod: AtomicU64,
    cons: AtomicU64,
    /// This process's pollers of the ring (`Conn`'s count).
    pollers: AtomicU64,
    k: Mutex<Kernel>,
    cv: Condvar,
    /// Serialises consumers (`Conn`'s reader lock); holds the bells they
    /// un-counted that were not queued yet (`Conn`'s `rx_owed`).
    rx: Mutex<u32>,
    /// How many threads consume (pollers and blocking readers).
    consumers: u32,
}

impl BellChannel for Shared {
    fn send_bells(&self, n: u32) -> io::Result<()> {
        let mut k = self.k.lock().unwrap();
        k.queued += n;
        assert!(k.queued <= 6, "{} bells queued", k.queued);
        self.cv.notify_all();
        Ok(())
    }
    fn take_bells(&self, n: u32) -> io::Result<Option<u32>> {
        let mut k = self.k.lock().unwrap();
        let got = n.min(k.queued);
        k.queued -= got;
        Ok(Some(got))
    }
}

#[derive(Clone, Copy)]
struct Opts {
    /// Look at the ring after ending the session (the protocol).
    recheck: bool,
}

fn writer(s: &Shared, chunks: &[u32]) {
    for &n in chunks {
        let b = doorbell::publish(&s.prod, &s.cons, LEN, n).unwrap();
        s.send_bells(b).unwrap();
    }
    s.k.lock().unwrap().written = true;
    s.cv.notify_all();
}

/// Reads what is there (a non-blocking read): consume, settle, take the
/// bells un-counted as far as they are queued (the rest stay owed).
fn read_all(s: &Shared, cap: u32) -> u32 {
    let mut owed = s.rx.lock().unwrap();
    read_locked(s, cap, &mut owed)
}

fn take_owed(s: &Shared, owed: &mut u32, n: u32) {
    *owed += n;
    *owed -= s.take_bells(*owed).unwrap().unwrap();
}

fn read_locked(s: &Shared, cap: u32, owed: &mut u32) -> u32 {
    let snap = doorbell::snapshot(&s.prod, &s.cons, LEN).unwrap();
    let n = snap.used.min(cap);
    let take = doorbell::reader_consume(&s.prod, &s.cons, LEN, n).unwrap();
    take_owed(s, owed, take);
    if n > 0 {
        let mut k = s.k.lock().unwrap();
        k.read += n;
        s.cv.notify_all();
    }
    n
}

fn unread(s: &Shared) -> u32 {
    doorbell::snapshot(&s.prod, &s.cons, LEN).unwrap().used
}

/// Sleeps until a bell is queued or everything was read; false then.
/// The last consumer to fall asleep with bytes unread, no bell queued and
/// nothing more to be written will never be woken: a lost wake-up.
fn kernel_wait(s: &Shared, total: u32) -> bool {
    let mut k = s.k.lock().unwrap();
    k.asleep += 1;
    let r = loop {
        if k.read == total {
            break false;
        }
        if k.queued > 0 {
            break true;
        }
        assert!(
            !(k.written && k.asleep == s.consumers),
            "lost wake-up: {} bytes unread, no bell queued, every consumer asleep",
            total - k.read
        );
        k = s.cv.wait(k).unwrap();
    };
    k.asleep -= 1;
    r
}

/// An event loop thread: poll (one look inside the session), end the
/// session, look again, read or sleep in the kernel.
fn poller(s: &Shared, total: u32, o: Opts) {
    loop {
        if s.k.lock().unwrap().read == total {
            return;
        }
        doorbell::poll_begin(&s.prod, &s.pollers, LEN).unwrap();
        let seen = unread(s) > 0;
        doorbell::poll_end(&s.prod, &s.pollers, LEN).unwrap();
        if seen || (o.recheck && unread(s) > 0) {
            read_all(s, LEN);
            continue;
        }
        if !kernel_wait(s, total) {
            return;
        }
        read_all(s, LEN);
    }
}

/// A blocking reader beside the poller: spins with `READER_SPINNING`
/// (capacity `cap`), then reads, holding the reader lock as `Conn::recv`
/// does; sleeps in the kernel only on an empty ring.
fn blocking_reader(s: &Shared, total: u32, cap: u32) {
    loop {
        if s.k.lock().unwrap().read == total {
            return;
        }
        {
            let mut owed = s.rx.lock().unwrap();
            let spun = doorbell::spin_begin(&s.prod, &s.cons, LEN, cap as usize).unwrap();
            let _ = unread(s);
            if spun {
                doorbell::spin_end(&s.prod, LEN).unwrap();
            }
            if read_locked(s, cap, &mut owed) > 0 {
                continue;
            }
            let take = doorbell::reader_settle(&s.prod, &s.cons, LEN).unwrap();
            take_owed(s, &mut owed, take);
            if unread(s) > 0 {
                continue;
            }
        }
        if !kernel_wait(s, total) {
            return;
        }
    }
}

#[derive(Clone, Copy)]
enum Other {
    None,
    Poller,
    Reader(u32),
}

fn model(chunks: &'static [u32], other: Other, o: Opts, preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(move || {
        let s = Arc::new(Shared {
            prod: AtomicU64::new(0),
            cons: AtomicU64::new(0),
            pollers: AtomicU64::new(0),
            k: Mutex::new(Kernel::default()),
            cv: Condvar::new(),
            rx: Mutex::new(0),
            consumers: if matches!(other, Other::None) { 1 } else { 2 },
        });
        let total: u32 = chunks.iter().sum();
        let w = {
            let s = s.clone();
            loom::thread::spawn(move || writer(&s, chunks))
        };
        let t = match other {
            Other::None => None,
            Other::Poller => {
                let s = s.clone();
                Some(loom::thread::spawn(move || poller(&s, total, o)))
            }
            Other::Reader(cap) => {
                let s = s.clone();
                Some(loom::thread::spawn(move || blocking_reader(&s, total, cap)))
            }
        };
        poller(&s, total, o);
        w.join().unwrap();
        if let Some(t) = t {
            t.join().unwrap();
        }
        assert_eq!(Word::load(&s.pollers), 0);
        assert_eq!(unread(&s), 0);
    });
}

const PROTOCOL: Opts = Opts { recheck: true };

#[test]
fn one_poller() {
    model(&[1, 2, 1], Other::None, PROTOCOL, 4);
}

#[test]
fn two_threads_poll_one_ring() {
    model(&[1, 2], Other::Poller, PROTOCOL, 3);
}

#[test]
fn poller_beside_a_spinning_blocking_reader() {
    model(&[1, 3], Other::Reader(1), PROTOCOL, 2);
}

/// The mutation: ending the session without looking again loses the
/// wake-up of a write that skipped its bell just before the flag cleared.
#[test]
#[should_panic(expected = "lost wake-up")]
fn without_the_last_look_a_wake_up_is_lost() {
    model(&[1, 2], Other::None, Opts { recheck: false }, 3);
}
