//! Randomized stress of the doorbell protocol (`smclo::testing::doorbell`) with std
//! threads and std atomics, over a real UNIX socket pair: the same logic the
//! loom model checks exhaustively on tiny rings, here with random sizes,
//! spinning, applications that poll between reads and stop early, and
//! random delays. A lost wake-up shows up as a poll that times out.

use smclo::testing::doorbell::{self, BellChannel, Block, Word};
use smclo_wire::cursor::{bells, Cursor};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

const LOST: i32 = 3000; // ms: a poll this long means a lost wake-up

struct Shared {
    prod: AtomicU64,
    cons: AtomicU64,
    ring: Vec<AtomicU64>, // one byte per slot; atomics only to stay data-race free
    len: u32,
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
    fn jitter(&mut self) {
        match self.below(16) {
            0 => std::thread::yield_now(),
            1 => std::thread::sleep(Duration::from_micros(self.below(50))),
            2..=5 => {
                // Short busy waits land inside the other side's windows.
                let until = std::time::Instant::now() + Duration::from_micros(self.below(20));
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            _ => {}
        }
    }
}

fn wait(fd: i32, ev: i16, what: &str) {
    let r = doorbell::poll_fd(fd, ev, LOST).unwrap();
    assert!(r != 0, "lost wake-up: {what} never came");
}

/// Takes `n` owed bells as far as they are queued; returns how many are
/// still owed (the writer counted them and has not sent them yet).
fn recv_bells(ch: &UnixStream, n: u32) -> u32 {
    n - ch.take_bells(n).unwrap().expect("the channel is open")
}

fn pos(w: u64, len: u32) -> usize {
    (Cursor::from_word(w).position(len) % len as u64) as usize
}

/// Lockstep: the writer announces each write's size and waits for the
/// reader to have read it all, so every write is the last one for a while
/// and a missing bell cannot be rescued by the next write.
struct Lockstep {
    sizes: std::sync::mpsc::Sender<u64>,
    acks: std::sync::mpsc::Receiver<()>,
}

fn writer(s: &Shared, ch: &UnixStream, total: u64, seed: u64, lock: Option<Lockstep>) {
    let mut rng = Rng(seed | 1);
    let mut off = 0u64;
    while off < total {
        let mut left = (1 + rng.below(s.len as u64 * 2)).min(total - off);
        if let Some(l) = &lock {
            l.sizes.send(left).unwrap();
        }
        while left > 0 {
            rng.jitter();
            let snap = doorbell::snapshot(&s.prod, &s.cons, s.len).unwrap();
            let free = (s.len - snap.used) as u64;
            if free == 0 {
                if let Block::Wait { send } =
                    doorbell::writer_block(&s.prod, &s.cons, s.len, 1).unwrap()
                {
                    ch.send_bells(send).unwrap();
                    wait(ch.as_raw_fd(), libc::POLLOUT, "writable");
                }
                continue;
            }
            let k = free.min(left);
            let p = pos(snap.prod, s.len);
            for i in 0..k {
                s.ring[(p + i as usize) % s.len as usize]
                    .store((off + i) as u8 as u64, std::sync::atomic::Ordering::Relaxed);
            }
            rng.jitter();
            let b = doorbell::publish(&s.prod, &s.cons, s.len, k as u32).unwrap();
            ch.send_bells(b).unwrap();
            off += k;
            left -= k;
        }
        if let Some(l) = &lock {
            l.acks.recv().unwrap();
        }
    }
}

fn reader(
    s: &Shared,
    ch: &UnixStream,
    total: u64,
    leftover: u64,
    seed: u64,
    lock: Option<(std::sync::mpsc::Receiver<u64>, std::sync::mpsc::Sender<()>)>,
) {
    let mut rng = Rng(seed.wrapping_mul(7) | 1);
    let mut got = 0u64;
    // Bells un-counted but not received yet (`Conn`'s `rx_owed`).
    let mut owed = 0u32;
    let mut until = if lock.is_some() { 0 } else { total - leftover };
    while got < total - leftover {
        if let Some((sizes, acks)) = &lock {
            if got == until {
                if got > 0 {
                    acks.send(()).unwrap();
                }
                until = got + sizes.recv().unwrap();
            }
        }
        let cap = (1 + rng.below(s.len as u64)).min(until - got);
        if rng.below(2) == 0 {
            wait(ch.as_raw_fd(), libc::POLLIN, "readable (before a read)");
        }
        // One blocking read call, as Conn::recv.
        loop {
            let snap = doorbell::snapshot(&s.prod, &s.cons, s.len).unwrap();
            if snap.used > 0 {
                let k = (snap.used as u64).min(cap);
                let p = pos(snap.cons, s.len);
                for i in 0..k {
                    let v = s.ring[(p + i as usize) % s.len as usize]
                        .load(std::sync::atomic::Ordering::Relaxed);
                    assert_eq!(v as u8, (got + i) as u8, "byte {}", got + i);
                }
                rng.jitter();
                let take = doorbell::reader_consume(&s.prod, &s.cons, s.len, k as u32).unwrap();
                owed = recv_bells(ch, owed + take);
                got += k;
                break;
            }
            let take = doorbell::reader_settle(&s.prod, &s.cons, s.len).unwrap();
            owed = recv_bells(ch, owed + take);
            if rng.below(2) == 0
                && doorbell::spin_begin(&s.prod, &s.cons, s.len, cap as usize).unwrap()
            {
                let from = Word::load(&s.prod);
                for _ in 0..rng.below(2000) {
                    if Word::load(&s.prod) != from {
                        break;
                    }
                    std::hint::spin_loop();
                }
                doorbell::spin_end(&s.prod, s.len).unwrap();
            }
            if doorbell::snapshot(&s.prod, &s.cons, s.len).unwrap().used > 0 {
                continue;
            }
            owed = recv_bells(ch, owed);
            wait(ch.as_raw_fd(), libc::POLLIN, "readable (in a read)");
        }
    }
    if let Some((_, acks)) = &lock {
        acks.send(()).unwrap();
    }
}

#[test]
fn random_schedules_never_lose_a_wakeup() {
    for round in 0..40u64 {
        let len = [16u32, 64, 256, 4096][round as usize % 4];
        let (wch, rch) = UnixStream::pair().unwrap();
        doorbell::set_min_sndbuf(wch.as_raw_fd()).unwrap();
        let s = Arc::new(Shared {
            prod: AtomicU64::new(0),
            cons: AtomicU64::new(0),
            ring: (0..len).map(|_| AtomicU64::new(0)).collect(),
            len,
        });
        let total = 20_000 + round * 1000;
        let lockstep = round % 2 == 1;
        let leftover = if round % 3 == 0 && !lockstep {
            len as u64
        } else {
            0
        };
        let (wl, rl) = if lockstep {
            let (st, sr) = std::sync::mpsc::channel();
            let (at, ar) = std::sync::mpsc::channel();
            (
                Some(Lockstep {
                    sizes: st,
                    acks: ar,
                }),
                Some((sr, at)),
            )
        } else {
            (None, None)
        };
        let w = {
            let s = s.clone();
            std::thread::spawn(move || writer(&s, &wch, total, round + 1, wl))
        };
        reader(&s, &rch, total, leftover, round + 1, rl);
        w.join().unwrap();
        // Quiescent: the readable state matches the ring, bells are counted.
        let p = Word::load(&s.prod);
        let used = smclo_wire::cursor::distance(p, Word::load(&s.cons), len).unwrap() as u64;
        assert_eq!(used, leftover, "round {round}");
        let mut queued = 0i32;
        assert_eq!(
            // SAFETY: FIONREAD writes one int.
            unsafe { libc::ioctl(rch.as_raw_fd(), libc::FIONREAD, &mut queued) },
            0
        );
        assert_eq!(bells(p) as i32, queued, "round {round}: word {p:#x}");
        if used > 0 {
            assert!(queued > 0, "round {round}: data left, not readable");
        }
    }
}
