//! Poll readiness of the UNIX end matches the ring: readable iff data (or
//! end of stream), writable iff room; non-blocking paths; and the kernel
//! fact the protocol rests on.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::{RecvFlags, SendFlags};
use std::io::{self, Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn kernel_fact_0_or_1_queued_writable_2_not() {
    let (mut w, mut r) = UnixStream::pair().unwrap();
    smclo::testing::doorbell::set_min_sndbuf(w.as_raw_fd()).unwrap();
    assert!(
        writable(w.as_raw_fd()) && !readable(r.as_raw_fd()),
        "0 queued"
    );
    w.write_all(b"!").unwrap();
    assert!(
        writable(w.as_raw_fd()) && readable(r.as_raw_fd()),
        "1 queued"
    );
    w.write_all(b"!").unwrap();
    assert!(
        !writable(w.as_raw_fd()) && readable(r.as_raw_fd()),
        "2 queued"
    );
    let mut b = [0u8; 1];
    r.read_exact(&mut b).unwrap();
    assert!(
        writable(w.as_raw_fd()) && readable(r.as_raw_fd()),
        "back to 1"
    );
    r.read_exact(&mut b).unwrap();
    assert!(
        writable(w.as_raw_fd()) && !readable(r.as_raw_fd()),
        "back to 0"
    );
    // Two bytes in one send are one buffer: still writable. This is why
    // doorbells are sent one per syscall.
    w.write_all(b"!!").unwrap();
    assert!(writable(w.as_raw_fd()));
}

#[test]
fn readiness_follows_the_ring() {
    let (a, b) = pair();
    assert!(!readable(b.fd()) && writable(a.fd()), "empty");
    a.write(&[1u8; 10]).unwrap();
    assert!(readable(b.fd()) && writable(a.fd()), "data and room");
    let mut buf = vec![0u8; 2 * RING as usize];
    assert_eq!(b.read(&mut buf[..5]).unwrap(), 5);
    assert!(readable(b.fd()), "partial read leaves it readable");
    assert_eq!(b.read(&mut buf).unwrap(), 5);
    assert!(!readable(b.fd()) && writable(a.fd()), "drained");

    // Fill the ring with non-blocking writes: the attempt that finds it
    // full makes the writer unwritable.
    a.set_nonblocking(true).unwrap();
    let mut sent = 0;
    loop {
        match a.write(&buf[..3000]) {
            Ok(n) => sent += n,
            Err(e) => {
                assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                break;
            }
        }
    }
    assert_eq!(sent, RING as usize);
    assert!(!writable(a.fd()) && readable(b.fd()), "full");
    assert_eq!(b.read(&mut buf[..1]).unwrap(), 1);
    assert!(writable(a.fd()) && readable(b.fd()), "one byte of room");
    assert_eq!(a.write(&buf[..100]).unwrap(), 1);
    assert_eq!(
        a.write(&buf[..100]).unwrap_err().kind(),
        io::ErrorKind::WouldBlock
    );
    assert!(!writable(a.fd()), "full again");
    assert_eq!(b.read(&mut buf).unwrap(), RING as usize);
    assert!(writable(a.fd()) && !readable(b.fd()), "drained again");

    // Non-blocking reads of an empty ring.
    b.set_nonblocking(true).unwrap();
    assert_eq!(
        b.read(&mut buf).unwrap_err().kind(),
        io::ErrorKind::WouldBlock
    );
    assert!(b.peek_region().err().unwrap().kind() == io::ErrorKind::WouldBlock);
    // reserve() with a full ring: WouldBlock, and not writable.
    assert_eq!(a.write(&buf[..RING as usize]).unwrap(), RING as usize);
    assert_eq!(
        a.reserve(1).err().unwrap().kind(),
        io::ErrorKind::WouldBlock
    );
    assert!(!writable(a.fd()));
    assert_eq!(
        b.read(&mut buf[..RING as usize - 100]).unwrap(),
        RING as usize - 100
    );
    assert!(writable(a.fd()));
    // 100 bytes unread: RING - 100 free.
    let free = RING as usize - 100;
    assert_eq!(
        a.reserve(free + 1).err().unwrap().kind(),
        io::ErrorKind::WouldBlock,
        "not enough room"
    );
    assert!(!writable(a.fd()), "armed for the larger reservation");
    assert_eq!(b.read(&mut buf[..1]).unwrap(), 1);
    assert!(
        writable(a.fd()),
        "any consumption wakes the writer to re-check"
    );
    assert_eq!(a.reserve(free).unwrap().len(), free + 1);
}

/// A blocked reader with a small buffer (likely spinning, so the writer may
/// skip the doorbell) must leave the descriptor readable when data remains:
/// otherwise an application that polls next would sleep forever.
#[test]
fn small_blocking_reads_keep_readiness_right() {
    let (a, b) = pair();
    let b = Arc::new(b);
    let (go, ready) = mpsc::channel::<usize>();
    let (done_tx, done) = mpsc::channel::<usize>();
    let reader = {
        let b = b.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; RING as usize];
            while let Ok(k) = ready.recv() {
                let n = b.read(&mut buf[..k]).unwrap();
                done_tx.send(n).unwrap();
            }
        })
    };
    let mut rng = Rng(0x1234_5678);
    let mut msg = vec![0u8; 4000];
    for i in 0..3000 {
        let k = 1 + rng.below(200) as usize;
        let m = 1 + rng.below(400) as usize;
        go.send(k).unwrap();
        // Land the write at a random point of the reader's read call, often
        // inside its spin window (busy-wait: timer sleeps are too coarse).
        let until = std::time::Instant::now() + Duration::from_micros(rng.below(40));
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
        for (j, x) in msg[..m].iter_mut().enumerate() {
            *x = j as u8;
        }
        assert_eq!(a.write(&msg[..m]).unwrap(), m);
        let n = done
            .recv_timeout(Duration::from_secs(5))
            .expect("reader hung");
        assert_eq!(n, k.min(m), "iteration {i}");
        let left = b.readable_len().unwrap();
        assert_eq!(left, m - n);
        if left == 0 && readable(b.fd()) {
            // The writer's post-check rang for data the read had already
            // taken (a bell it had not counted yet): the next call takes
            // it, and readiness is right again.
            let e = b.recv(&mut [0u8; 1], RecvFlags::DONTWAIT).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "iteration {i}");
        }
        assert_eq!(
            readable(b.fd()),
            left > 0,
            "iteration {i}: k={k} m={m} left={left}"
        );
        if left > 0 {
            let mut rest = vec![0u8; left];
            assert_eq!(b.recv(&mut rest, RecvFlags::DONTWAIT).unwrap(), left);
            assert_eq!(rest[0], n as u8);
        }
        assert!(!readable(b.fd()), "iteration {i}: drained");
        assert!(writable(a.fd()));
    }
    drop(go);
    reader.join().unwrap();
}

#[test]
fn nonblocking_write_returns_partial_count() {
    let (a, _b) = pair();
    a.set_nonblocking(true).unwrap();
    let big = vec![1u8; 3 * RING as usize];
    assert_eq!(a.write(&big).unwrap(), RING as usize);
    assert_eq!(a.write(&big).unwrap_err().kind(), io::ErrorKind::WouldBlock);
    // MSG_DONTWAIT on a blocking descriptor does the same.
    a.set_nonblocking(false).unwrap();
    assert_eq!(
        a.send(&big, SendFlags::DONTWAIT).unwrap_err().kind(),
        io::ErrorKind::WouldBlock
    );
}

/// An edge-triggered poller (non-blocking reads, EPOLLET, and like nginx it
/// waits for the next edge after any read that returns less than asked)
/// must be woken for every byte. A write that lands while a read copies the
/// previous one brings no doorbell of its own (one is already queued), so
/// no edge: the read must take it before returning short.
#[test]
fn edge_triggered_reader_after_short_reads() {
    edge_triggered(2 * 256 * 1024, false, 4000);
}

/// nginx's accounting on top: after an edge, a read that fills its buffer
/// is followed by FIONREAD, and the reader reads exactly that many bytes
/// more before it waits for the next edge. A write after the FIONREAD must
/// still bring an edge, as it does over TCP.
#[test]
fn edge_triggered_reader_counting_fionread() {
    edge_triggered(36 * 1024, true, 10_000);
}

/// Rounds of a large write the reader is woken for and copies for a
/// while, then a small one at a random point of that copy; the reader
/// reads with a `buf_len` buffer and fails if it sleeps 3 s with data
/// unread.
fn edge_triggered(buf_len: usize, fionread: bool, rounds_n: usize) {
    const BIG: u32 = 256 * 1024;
    let p = pair_with(
        BIG,
        BIG,
        smclo::testing::conn::Mode::NoCopy,
        smclo::testing::conn::Mode::NoCopy,
    );
    let (a, b) = (p.a, p.b);
    b.set_nonblocking(true).unwrap();
    // SAFETY: plain epoll calls on descriptors we own; `ev` lives across
    // the call that reads it.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0);
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLET) as u32,
        u64: 0,
    };
    assert_eq!(
        // SAFETY: `ep` is our epoll descriptor and `ev` a valid event.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, b.fd(), &mut ev) },
        0
    );
    let (sizes, rounds) = mpsc::channel::<usize>();
    let (ack, acks) = mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let mut rng = Rng(0x9e37_79b9);
        let msg = vec![7u8; BIG as usize];
        for _ in 0..rounds_n {
            let first = 32 * 1024 + rng.below(160 * 1024) as usize;
            let second = 1 + rng.below(4000) as usize;
            sizes.send(first + second).unwrap();
            assert_eq!(a.write(&msg[..first]).unwrap(), first);
            let until = std::time::Instant::now() + Duration::from_micros(rng.below(120));
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
            assert_eq!(a.write(&msg[..second]).unwrap(), second);
            if acks.recv().is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; buf_len];
    for round in 0..rounds_n {
        let want = rounds.recv().unwrap();
        let mut got = 0;
        while got < want {
            let mut out = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: one event slot.
            let r = unsafe { libc::epoll_wait(ep, &mut out, 1, 3000) };
            assert!(r >= 0);
            if r == 0 {
                panic!(
                    "round {round}: no edge for 3 s with {got} of {want} bytes read, descriptor {}",
                    if readable(b.fd()) {
                        "readable"
                    } else {
                        "not readable"
                    }
                );
            }
            // Read until a short read, WouldBlock, or (counting) exactly
            // as much as FIONREAD said; then wait again.
            let mut avail: Option<usize> = None;
            loop {
                let ask = avail.map_or(buf.len(), |a| a.min(buf.len()));
                if ask == 0 {
                    break;
                }
                match b.read(&mut buf[..ask]) {
                    Ok(n) => {
                        got += n;
                        if n < ask {
                            break;
                        }
                        if fionread {
                            avail = Some(match avail {
                                Some(a) => a - n,
                                None => b.readable_len().unwrap(),
                            });
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("round {round}: {e}"),
                }
            }
        }
        assert_eq!(got, want, "round {round}");
        ack.send(()).unwrap();
    }
    writer.join().unwrap();
    // SAFETY: closing our epoll descriptor.
    unsafe { libc::close(ep) };
}

/// A caller that does not ask about writing (`ready_for` without `OUT`)
/// gets what `ready` says of reading and of the connection's end, and
/// no `OUT`, whatever room the peer's ring has (an error that only the
/// peer's ring shows, a peer breaking its cursor, is not looked for);
/// one that asks gets `OUT` exactly when `ready` does.
#[test]
fn readiness_without_out_asked_leaves_out_and_keeps_the_rest() {
    use smclo::testing::poller::Ready;
    let (a, b) = pair();
    let reading = Ready::IN | Ready::RDHUP | Ready::HUP | Ready::ERR;
    let same = |c: &smclo::testing::conn::Conn, what: &str| {
        let all = c.ready();
        let without = c.ready_for(Ready::EMPTY);
        assert_eq!(
            without.bits(),
            all.bits() & reading.bits(),
            "{what}: {all:?} against {without:?}"
        );
        assert_eq!(c.ready_for(Ready::OUT).bits(), all.bits(), "{what}");
    };
    same(&a, "empty");
    assert!(a.ready().intersects(Ready::OUT));
    a.write(&[7u8; 100]).unwrap();
    same(&b, "data");
    assert!(b.ready_for(Ready::EMPTY).intersects(Ready::IN));
    a.set_nonblocking(true).unwrap();
    let buf = vec![0u8; RING as usize];
    while a.write(&buf).is_ok() {}
    assert!(!a.ready().intersects(Ready::OUT), "full");
    same(&a, "full");
    drop(b);
    same(&a, "peer closed");
    assert!(a
        .ready_for(Ready::EMPTY)
        .intersects(Ready::IN | Ready::RDHUP));
}
