//! Processes: a connection end used by a forked child (all state is in
//! shared memory), and a peer killed with SIGKILL mid-transfer: the
//! survivor gets end of stream or ECONNRESET within a second, never hangs.

mod conn_util;

use conn_util::*;
use smclo::testing::conn::Conn;
use std::io;
use std::time::{Duration, Instant};

/// Held from creating a pair until the parent has closed the child's end,
/// and across every fork: a child forked meanwhile by a test on another
/// thread would inherit that end and keep the channel open after its owner
/// died, and the survivor would see no end of file.
static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A pair whose second end goes to a forked child, which runs `f` with it
/// and exits without running any destructor of the parent's state. Returns
/// the parent's end and the child's pid.
fn fork_pair(f: impl FnOnce(Conn)) -> (Conn, libc::pid_t) {
    let _g = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let (mine, theirs) = pair();
    // SAFETY: the child only uses its own Conn and then _exits; the test
    // harness threads are not touched.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // Child: keep `theirs`, silently drop our copy of `mine`.
        std::mem::forget(mine);
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(theirs))) {
            Ok(()) => 0,
            Err(_) => 1,
        };
        // SAFETY: leaving the child without unwinding into the harness.
        unsafe { libc::_exit(code) };
    }
    // Parent: close our copy of the child's descriptor without the close
    // protocol (the child owns that end now).
    let fd = theirs.fd();
    std::mem::forget(theirs);
    // SAFETY: the forgotten Conn owned this descriptor.
    unsafe { libc::close(fd) };
    (mine, pid)
}

/// Bytes echoed through the forked child (a multiple of the 50 000-byte chunks).
const TOTAL: u64 = 168 * 50_000;

fn wait(pid: libc::pid_t) -> i32 {
    let mut st = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    st
}

fn kill9(pid: libc::pid_t) {
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

#[test]
fn forked_child_uses_the_connection() {
    let (a, pid) = fork_pair(|b| {
        let mut buf = vec![0u8; 100_000];
        let mut off = 0u64;
        // Echo a checked stream back, then close.
        loop {
            let n = b.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            for (i, x) in buf[..n].iter().enumerate() {
                assert_eq!(*x, stream_byte(5, off + i as u64));
            }
            off += n as u64;
            b.write(&buf[..n]).unwrap();
        }
        assert_eq!(off, TOTAL);
        b.close().unwrap();
    });
    within(Duration::from_secs(60), move || {
        let a = std::sync::Arc::new(a);
        let w = {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut off = 0u64;
                let mut chunk = vec![0u8; 50_000];
                while off < TOTAL {
                    for (i, x) in chunk.iter_mut().enumerate() {
                        *x = stream_byte(5, off + i as u64);
                    }
                    a.write(&chunk).unwrap();
                    off += chunk.len() as u64;
                }
                a.shutdown_write().unwrap();
            })
        };
        let mut buf = vec![0u8; 65536];
        let mut off = 0u64;
        loop {
            let n = a.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            assert_eq!(buf[0], stream_byte(5, off));
            off += n as u64;
        }
        w.join().unwrap();
        assert_eq!(off, TOTAL);
    });
    assert_eq!(wait(pid), 0, "child failed");
}

/// Survivor reading or writing while its peer is SIGKILLed.
#[test]
fn killed_peer_never_hangs_the_survivor() {
    for survivor_reads in [true, false] {
        for round in 0..3 {
            let (a, pid) = fork_pair(move |b| {
                let mut buf = vec![9u8; 30_000];
                loop {
                    if survivor_reads {
                        let _ = b.write(&buf);
                    } else {
                        let _ = b.read(&mut buf);
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            });
            std::thread::sleep(Duration::from_millis(20 + 15 * round));
            kill9(pid);
            let killed = Instant::now();
            let (outcome, next) = within(Duration::from_secs(5), move || {
                let mut buf = vec![0u8; 30_000];
                let mut call = || {
                    if survivor_reads {
                        a.read(&mut buf)
                    } else {
                        a.write(&buf)
                    }
                };
                loop {
                    match call() {
                        Ok(0) => return (Ok(0), None),
                        Ok(_) => continue,
                        Err(e) => {
                            let next = call().map_err(|e| e.raw_os_error());
                            return (Err(e.raw_os_error()), Some(next));
                        }
                    }
                }
            });
            let took = killed.elapsed();
            wait(pid);
            assert!(took < Duration::from_secs(1), "took {took:?}");
            if survivor_reads {
                assert_eq!(
                    outcome,
                    Err(Some(libc::ECONNRESET)),
                    "a dead writer is a reset"
                );
                assert_eq!(next, Some(Ok(0)), "reported once, as TCP's");
            } else {
                // A reader that died is a reset, whatever it had read (its
                // held bytes were lost): the reset's error, then EPIPE.
                assert_eq!(
                    outcome,
                    Err(Some(libc::ECONNRESET)),
                    "writing to a dead reader"
                );
                assert_eq!(next, Some(Err(Some(libc::EPIPE))), "then EPIPE");
            }
        }
    }
}

#[test]
fn killed_peer_with_nonblocking_survivor() {
    let (a, pid) = fork_pair(|b| loop {
        let _ = b.write(b"tick");
        std::thread::sleep(Duration::from_micros(100));
    });
    a.set_nonblocking(true).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    kill9(pid);
    wait(pid);
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    let end = loop {
        match a.read(&mut buf) {
            Ok(n) => assert!(n > 0, "a dead peer is not a clean end of stream"),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                assert!(
                    readable(a.fd()),
                    "WouldBlock while the peer is gone: the descriptor must say readable"
                );
            }
            Err(e) => break e.raw_os_error(),
        }
        assert!(start.elapsed() < Duration::from_secs(1));
    };
    assert_eq!(end, Some(libc::ECONNRESET));
}

/// The connection keeps `O_NONBLOCK` as `set_nonblocking` set it and does
/// not ask the descriptor while no other process shares its open file;
/// after a `fork` it asks: a child that turns the shared open file
/// blocking makes the parent's read wait (here, for its 300 ms timeout),
/// as the kernel's would, where the kept flag said non-blocking.
#[test]
fn fork_child_turns_the_shared_open_file_blocking() {
    let _g = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let (a, _b) = pair();
    a.set_nonblocking(true).unwrap();
    a.set_read_timeout(Some(Duration::from_millis(300)));
    let mut buf = [0u8; 16];
    let t0 = Instant::now();
    let e = a.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    assert!(t0.elapsed() < Duration::from_millis(200), "non-blocking");
    // SAFETY: the child makes one fcntl and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: the child's copy of the channel; then out, no unwinding.
        unsafe {
            libc::fcntl(a.fd(), libc::F_SETFL, 0);
            libc::_exit(0);
        }
    }
    assert_eq!(wait(pid), 0);
    let t0 = Instant::now();
    let e = a.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "the read timeout");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "the read did not wait: {:?}",
        t0.elapsed()
    );
}
