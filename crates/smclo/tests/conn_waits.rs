//! How blocking calls wait: a signal handler interrupts them (EINTR, or the
//! bytes moved so far), the direction's timeout bounds them (EAGAIN), a
//! non-blocking call never waits behind another thread's sleeping call, a
//! peer that does not take its doorbells cannot make a writer spin, and a
//! writer stopped between counting a doorbell and sending it is waited for.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::{Conn, Mode, RecvFlags, SendFlags};
use smclo::testing::dmb::Dmb;
use smclo::testing::doorbell;
use smclo_wire::cursor::with_bells;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Once};
use std::time::{Duration, Instant};

extern "C" fn on_usr1(_: libc::c_int) {}

/// SIGUSR1 runs a handler (without `SA_RESTART`) in this process.
fn install_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: an all-zero sigaction is valid; the handler is an
        // async-signal-safe function that does nothing.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
    });
}

/// Runs `call` on a thread, signals that thread (SIGUSR1) after `after`
/// while the call sleeps, and returns the call's result and duration.
fn interrupted<T: Send + 'static>(
    after: Duration,
    call: impl FnOnce() -> T + Send + 'static,
) -> (T, Duration) {
    install_handler();
    let (tid_tx, tid_rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        // SAFETY: pthread_self has no preconditions.
        tid_tx.send(unsafe { libc::pthread_self() }).unwrap();
        let t0 = Instant::now();
        let r = call();
        (r, t0.elapsed())
    });
    let tid = tid_rx.recv().unwrap();
    std::thread::sleep(after);
    // Signal until the call returns: a signal that lands before the call
    // sleeps only runs the handler.
    let t0 = Instant::now();
    while !h.is_finished() && t0.elapsed() < Duration::from_secs(5) {
        // SAFETY: the thread is alive (not finished, not joined).
        unsafe { libc::pthread_kill(tid, libc::SIGUSR1) };
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(h.is_finished(), "the call was not interrupted (hang)");
    h.join().unwrap()
}

fn fill(c: &Conn) -> usize {
    c.set_nonblocking(true).unwrap();
    let mut n = 0;
    let chunk = [7u8; 4096];
    loop {
        match c.write(&chunk) {
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    c.set_nonblocking(false).unwrap();
    n
}

#[test]
fn a_handler_interrupts_a_blocking_read() {
    let (a, b) = pair();
    let a = Arc::new(a);
    let a2 = a.clone();
    let (r, took) = interrupted(Duration::from_millis(300), move || {
        let mut buf = [0u8; 64];
        a2.read(&mut buf).map_err(|e| e.kind())
    });
    assert_eq!(r, Err(io::ErrorKind::Interrupted));
    assert!(took < Duration::from_secs(3), "{took:?}");
    // The connection still works.
    b.write(b"after").unwrap();
    let mut buf = [0u8; 5];
    assert_eq!(a.read(&mut buf).unwrap(), 5);
    assert_eq!(&buf, b"after");
}

#[test]
fn an_interrupted_waitall_read_returns_what_it_has() {
    let (a, b) = pair();
    b.write(b"abc").unwrap();
    let (r, _) = interrupted(Duration::from_millis(300), move || {
        let mut buf = [0u8; 64];
        let r = a.recv(&mut buf, RecvFlags::WAITALL).map_err(|e| e.kind());
        (r, buf[..3].to_vec())
    });
    assert_eq!(r, (Ok(3), b"abc".to_vec()));
}

#[test]
fn a_handler_interrupts_a_blocking_write() {
    let (a, b) = pair();
    let filled = fill(&a);
    assert_eq!(filled, RING as usize);
    let (r, took) = interrupted(Duration::from_millis(300), move || {
        let r = a.write(&[1u8; 100]).map_err(|e| e.kind());
        (r, a)
    });
    assert_eq!(r.0, Err(io::ErrorKind::Interrupted));
    assert!(took < Duration::from_secs(3), "{took:?}");
    drop(b);
}

#[test]
fn read_timeout_is_eagain_after_the_timeout() {
    let (a, _b) = pair();
    a.set_read_timeout(Some(Duration::from_millis(400)));
    assert_eq!(a.read_timeout(), Some(Duration::from_millis(400)));
    let t0 = Instant::now();
    let mut buf = [0u8; 8];
    let e = within(Duration::from_secs(10), move || {
        a.read(&mut buf).unwrap_err()
    });
    let took = t0.elapsed();
    assert_eq!(e.raw_os_error(), Some(libc::EAGAIN));
    assert!(
        took >= Duration::from_millis(390) && took < Duration::from_secs(4),
        "{took:?}"
    );
}

#[test]
fn write_timeout_returns_the_partial_count_then_eagain() {
    let (a, _b) = pair();
    a.set_write_timeout(Some(Duration::from_millis(400)));
    let t0 = Instant::now();
    let (first, second) = within(Duration::from_secs(10), move || {
        let first = a
            .write(&vec![3u8; RING as usize + 100])
            .map_err(|e| e.kind());
        let second = a.write(b"x").map_err(|e| e.raw_os_error());
        (first, second)
    });
    let took = t0.elapsed();
    assert_eq!(first, Ok(RING as usize));
    assert_eq!(second, Err(Some(libc::EAGAIN)));
    assert!(
        took >= Duration::from_millis(780) && took < Duration::from_secs(6),
        "{took:?}"
    );
}

/// A non-blocking read (MSG_DONTWAIT) while another thread sleeps in a
/// blocking read of the same connection returns at once, as over TCP.
#[test]
fn dontwait_read_does_not_wait_behind_a_sleeping_read() {
    let (a, b) = pair();
    let a = Arc::new(a);
    let a2 = a.clone();
    let sleeper = std::thread::spawn(move || {
        let mut buf = [0u8; 4];
        a2.read(&mut buf).unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let (r, took) = timed_beside(move || {
        let mut buf = [0u8; 4];
        a.recv(&mut buf, RecvFlags::DONTWAIT).map_err(|e| e.kind())
    });
    // Wake the sleeper so the test ends either way.
    b.write(b"wake").unwrap();
    let r = r.recv().unwrap();
    assert_eq!(r, Err(io::ErrorKind::WouldBlock));
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert_eq!(sleeper.join().unwrap(), 4);
}

/// Likewise for a non-blocking write while another thread sleeps in a
/// blocking write on a full ring.
#[test]
fn dontwait_write_does_not_wait_behind_a_sleeping_write() {
    let (a, b) = pair();
    fill(&a);
    let a = Arc::new(a);
    let a2 = a.clone();
    let sleeper = std::thread::spawn(move || a2.write(b"late").unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let (r, took) = timed_beside(move || a.send(b"now", SendFlags::DONTWAIT).map_err(|e| e.kind()));
    // Make room so the sleeper ends.
    let mut buf = vec![0u8; RING as usize];
    let mut got = 0;
    while got < RING as usize + 4 {
        got += b.read(&mut buf).unwrap();
    }
    assert_eq!(r.recv().unwrap(), Err(io::ErrorKind::WouldBlock));
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert_eq!(sleeper.join().unwrap(), 4);
}

/// Runs `call` on a thread and waits up to 2 s for it: how long it took
/// (2 s or more if it had not returned), and its result, to be received
/// once the caller has unblocked it.
fn timed_beside<T: Send + 'static>(
    call: impl FnOnce() -> T + Send + 'static,
) -> (mpsc::Receiver<T>, Duration) {
    let (tx, rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let t0 = Instant::now();
    std::thread::spawn(move || {
        let r = call();
        let _ = done_tx.send(());
        let _ = tx.send(r);
    });
    let _ = done_rx.recv_timeout(Duration::from_secs(2));
    (rx, t0.elapsed())
}

/// The peer keeps clearing `BELLS` in the word it reads (so every write
/// rings) and never receives: the doorbell queue fills, which an honest
/// peer never lets happen. The write fails with EPROTO and aborts, instead
/// of retrying for ever at full CPU.
#[test]
fn a_peer_that_takes_no_doorbells_is_eproto() {
    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    let evil = Dmb::attach(&p.fb, 0xb, 0x5eed).unwrap();
    let a = p.a;
    let _b = p.b;
    a.set_nonblocking(true).unwrap();
    let (r, cpu) = within(Duration::from_secs(10), move || {
        let cpu0 = thread_cpu();
        let mut r = Ok(0);
        for _ in 0..10_000 {
            let w = evil.prod().load(Ordering::SeqCst);
            evil.prod().store(with_bells(w, 0), Ordering::SeqCst);
            r = a
                .send(b"x", SendFlags::DONTWAIT)
                .map_err(|e| e.raw_os_error());
            if r.is_err() {
                break;
            }
        }
        (r, thread_cpu() - cpu0)
    });
    assert_eq!(r, Err(Some(libc::EPROTO)));
    assert!(cpu < Duration::from_secs(1), "{cpu:?} of CPU");
}

fn thread_cpu() -> Duration {
    // SAFETY: an all-zero timespec is valid storage for the result.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The writer counted a doorbell and was stopped (SIGSTOP, a cgroup
/// freezer, a debugger) before it sent it. The reader does not wait for
/// that doorbell: it returns the data at once, owes the doorbell, and the
/// connection keeps working when the writer resumes, however long it was
/// stopped (TCP survives stopped peers too).
#[test]
fn a_writer_stopped_between_count_and_send_is_not_an_error() {
    let p = pair_with(RING, RING, Mode::NoCopy, Mode::NoCopy);
    // b's writer, by hand: a's receive ring, b's end of the channel.
    let w = Dmb::attach(&p.fa, 0xa, 0x5eed).unwrap();
    smclo::testing::ring::copy_in(&w, 0, b"hello");
    assert_eq!(doorbell::publish(w.prod(), w.cons(), RING, 5).unwrap(), 1);
    // ... and the writer stops here, its doorbell counted, not sent.
    let a = Arc::new(p.a);
    let a2 = a.clone();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 5];
        for _ in 0..2 {
            let t0 = Instant::now();
            let r = a2.read(&mut buf).map(|n| buf[..n].to_vec());
            tx.send((r.map_err(|e| e.raw_os_error()), t0.elapsed()))
                .unwrap();
        }
    });
    let (first, took) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(first, Ok(b"hello".to_vec()));
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Stopped for longer than any bound a reader might put on it.
    std::thread::sleep(Duration::from_secs(3));
    assert!(rx.try_recv().is_err(), "the second read returned early");
    // The writer resumes: its doorbell, then the next write.
    // SAFETY: sends one byte from a static buffer on b's channel.
    let r = unsafe { libc::send(p.b.fd(), b"!".as_ptr().cast(), 1, libc::MSG_NOSIGNAL) };
    assert_eq!(r, 1);
    p.b.write(b"world").unwrap();
    let (second, _) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(second, Ok(b"world".to_vec()));
    reader.join().unwrap();
    // Every doorbell was taken: a's descriptor is not readable with an
    // empty ring, and both directions still work.
    assert!(!readable(a.fd()));
    a.write(b"ok").unwrap();
    let mut buf = [0u8; 2];
    assert_eq!(p.b.read(&mut buf).unwrap(), 2);
}

/// A process standing in for the peer whose state the reader judges:
/// busy (always running or waiting for a CPU) or stopped. Killed on drop.
struct PeerProcess(std::process::Child);

impl PeerProcess {
    fn busy() -> PeerProcess {
        let c = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        // Until it loops, a fresh child may be seen sleeping (loading sh):
        // the reader would then rightly not wait for it.
        let stat = format!("/proc/{}/stat", c.id());
        let t0 = Instant::now();
        for _ in 0..3 {
            while !std::fs::read_to_string(&stat).unwrap().contains(") R ") {
                assert!(t0.elapsed() < Duration::from_secs(5), "not running");
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        PeerProcess(c)
    }

    fn stopped() -> PeerProcess {
        let c = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        // SAFETY: signals our own child, which is alive (not reaped).
        assert_eq!(unsafe { libc::kill(c.id() as i32, libc::SIGSTOP) }, 0);
        let stat = format!("/proc/{}/stat", c.id());
        let t0 = Instant::now();
        while !std::fs::read_to_string(&stat).unwrap().contains(") T ") {
            assert!(t0.elapsed() < Duration::from_secs(5), "not stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        PeerProcess(c)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pair whose `b` end is, by its DMB's header, the process `writer`:
/// the process that writes into `a`'s ring.
fn pair_written_by(writer: u32) -> Pair {
    let fa = smclo::testing::dmb::memfd("conn-test-a").unwrap();
    let fb = smclo::testing::dmb::memfd("conn-test-b").unwrap();
    let da = Dmb::create(&fa, 0xa, RING, 0x5eed, std::process::id(), 0).unwrap();
    let db = Dmb::create(&fb, 0xb, RING, 0x5eed, writer, 0).unwrap();
    let da_peer = Dmb::attach(&fa, 0xa, 0x5eed).unwrap();
    let db_peer = Dmb::attach(&fb, 0xb, 0x5eed).unwrap();
    let (ua, ub) = std::os::unix::net::UnixStream::pair().unwrap();
    let a = Conn::new(da, db_peer, ua, Mode::NoCopy).unwrap();
    let b = Conn::new(db, da_peer, ub, Mode::NoCopy).unwrap();
    Pair { a, b, fa, fb }
}

/// `b`'s writer, by hand: publishes `data` into `a`'s ring and counts its
/// doorbell, which it sends `after` later from another thread (the writer
/// was descheduled between its count and its send).
fn publish_and_ring_late(p: &Pair, data: &[u8], after: Duration) -> std::thread::JoinHandle<()> {
    let w = Dmb::attach(&p.fa, 0xa, 0x5eed).unwrap();
    smclo::testing::ring::copy_in(&w, 0, data);
    assert_eq!(
        doorbell::publish(w.prod(), w.cons(), RING, data.len() as u32).unwrap(),
        1
    );
    let fd = p.b.fd();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        // SAFETY: sends one byte from a static buffer on b's channel, which
        // stays open until the caller joins this thread.
        let r = unsafe { libc::send(fd, b"!".as_ptr().cast(), 1, libc::MSG_NOSIGNAL) };
        assert_eq!(r, 1);
    })
}

/// The reader consumed data whose doorbell the writer had counted but not
/// sent yet (the writer was preempted between the two). The read waits for
/// that doorbell while the writer can still send it (it is running or
/// waiting for a CPU): had it returned at once, the doorbell would arrive
/// later and make the descriptor readable with nothing to read, as TCP
/// never is. A level-triggered poller would then call `read` and get
/// EAGAIN, which wrk counts as a read error and answers by closing the
/// connection (nginx under wrk lost connections that way).
#[test]
fn a_doorbell_sent_after_the_read_took_its_data_is_taken_by_that_read() {
    let writer = PeerProcess::busy();
    let p = pair_written_by(writer.pid());
    p.a.set_nonblocking(true).unwrap();
    let sender = publish_and_ring_late(&p, b"hello", Duration::from_millis(300));
    let mut buf = [0u8; 16];
    let t0 = Instant::now();
    assert_eq!(p.a.read(&mut buf).unwrap(), 5);
    // Near 300 ms when the read waited for the doorbell; the writer's
    // state tells why it did not.
    let took = t0.elapsed();
    let state = std::fs::read_to_string(format!("/proc/{}/stat", writer.pid()));
    sender.join().unwrap();
    assert!(
        !readable(p.a.fd()),
        "the descriptor is readable with an empty ring: a poller wakes for nothing \
         (the read returned after {took:?}; the writer: {state:?})"
    );
    let e = p.a.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    // The connection still works both ways.
    p.b.write(b"world").unwrap();
    assert!(readable(p.a.fd()));
    assert_eq!(p.a.read(&mut buf).unwrap(), 5);
    p.a.write(b"ok").unwrap();
    assert_eq!(p.b.read(&mut buf).unwrap(), 2);
}

/// The same with a writer that is stopped (SIGSTOP) between its count and
/// its send: the read does not wait for it (it may stay stopped for good),
/// and the doorbell, once sent, is taken by the next call.
#[test]
fn a_read_does_not_wait_for_the_doorbell_of_a_stopped_writer() {
    let writer = PeerProcess::stopped();
    let p = pair_written_by(writer.pid());
    p.a.set_nonblocking(true).unwrap();
    let sender = publish_and_ring_late(&p, b"hello", Duration::from_secs(2));
    let mut buf = [0u8; 16];
    let t0 = Instant::now();
    assert_eq!(p.a.read(&mut buf).unwrap(), 5);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    sender.join().unwrap();
    let e = p.a.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    assert!(!readable(p.a.fd()));
}

/// Two blocking readers in ping-pong that both once waited long (each
/// answer came 2 ms late, so both spin budgets shrank) go back to spinning
/// once answers come at once: a sleep woken by data within a full budget
/// restores it. Before, only a spin that hit restored a budget, and with
/// both peers asleep each answer came after a wake-up, longer than the
/// shrunken spins, so neither ever spun again (the message rate was then
/// that of two sleeping processes, by chance).
#[test]
fn ping_pong_readers_spin_again_after_a_slow_phase() {
    if smclo::testing::conn::spin_budget().is_zero() {
        panic!("SMCLO_SPIN_US=0: nothing spins, nothing to check");
    }
    let (a, b) = pair();
    let (a, b) = (Arc::new(a), Arc::new(b));
    const SLOW: usize = 10;
    const FAST: usize = 300;
    let echo = {
        let b = b.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1];
            for i in 0..SLOW + FAST {
                assert_eq!(b.read(&mut buf).unwrap(), 1);
                if i < SLOW {
                    std::thread::sleep(Duration::from_millis(2));
                }
                assert_eq!(b.write(&buf).unwrap(), 1);
            }
        })
    };
    let mut buf = [0u8; 1];
    let full = a.read_spin_budget();
    let mut full_again = 0;
    for i in 0..SLOW + FAST {
        if i < SLOW {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(a.write(&[i as u8]).unwrap(), 1);
        assert_eq!(a.read(&mut buf).unwrap(), 1);
        assert_eq!(buf[0], i as u8);
        if i == SLOW - 1 {
            assert!(a.read_spin_budget() < full, "the slow phase shrank nothing");
        }
        if i >= SLOW && a.read_spin_budget() == full {
            full_again += 1;
        }
    }
    echo.join().unwrap();
    assert!(
        full_again > 0,
        "after the slow phase, {FAST} prompt answers never restored the reader's spin budget"
    );
    assert!(b.read_spin_budget() > Duration::ZERO);
}
