//! A native-API event loop (a non-blocking `SmcListener` and a `Poller`)
//! beside a client stopped (SIGSTOP) between its connect and its answer to
//! the server: `accept` never waits on it, the loop serves other clients
//! over SMC-D meanwhile, the listener becomes readable when the stopped
//! client's handshake decides (nothing else arriving), and the stopped
//! client, once continued, gets its connection with every byte: SMC-D, or
//! TCP (TIMEOUT) when the server's `SMCLO_CLC_WAIT_MS` ran out first.
//! Dropping the listener resets a connection whose handshake is still
//! kept, and leaves nothing behind in the device.
//!
//! Each server connection carries [`N`] bytes to a `sink` client
//! (`smclo-testpeer connect ADDR sink`, or `stopper ADDR`), which answers
//! with their count and hash.

mod common;

use common::TempDir;
use smclo::api::{Poller, SmcListener, SmcStream};
use smclo::config::Config;
use smclo::device::{Device, Stats};
use smclo::testing::poller::Ready;
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// Bytes the server sends on each connection.
const N: usize = 200_000;

/// The listener's token in the event loop's `Poller`.
const LISTENER: u64 = u64::MAX;

/// The longest an `accept` may take: a handful of system calls and the spin
/// budget, with room for a loaded machine's scheduling (a call took 31 ms
/// with other builds running). Well under the handshake waits these tests
/// set (300 ms, 20 s), so an accept that waits on the client fails it; the
/// busy-poll this replaced (50 ms, then TIMEOUT) fails `assert_kept`'s
/// check of what accept returned.
const ACCEPT_BOUND: Duration = Duration::from_millis(250);

fn pat(i: usize) -> u8 {
    (i.wrapping_mul(131) + (i >> 11) + 7) as u8
}

/// FNV-1a 64 of the [`N`] bytes the server sends.
fn sent_hash() -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for i in 0..N {
        h ^= pat(i) as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn cfg(dir: &Path, clc: Duration) -> Config {
    let mut c = Config::from_env().expect("config");
    c.device_dir = dir.to_path_buf();
    c.clc_wait = clc;
    c
}

/// A `smclo-testpeer` client (killed when dropped); its stdout lines
/// arrive on `out`, its stderr is kept.
struct Client {
    child: Child,
    out: Receiver<String>,
}

impl Client {
    fn spawn(dir: &Path, args: &[&str], clc: Duration) -> Client {
        let mut child = Command::new(env!("CARGO_BIN_EXE_smclo-testpeer"))
            .args(args)
            .env("SMCLO_DEVICE_DIR", dir)
            .env("SMCLO_CLC_WAIT_MS", clc.as_millis().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn smclo-testpeer");
        let out = lines(child.stdout.take().expect("stdout"));
        Client { child, out }
    }

    /// Starts `stopper ADDR` and waits (bounded) until it has stopped
    /// itself, its connect done and its answer to the server not given.
    fn stopped(dir: &Path, addr: &str, clc: Duration) -> Client {
        let c = Client::spawn(dir, &["stopper", addr], clc);
        let t = Instant::now();
        while !is_stopped(c.pid()) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the client never stopped"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        c
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn cont(&self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.pid(), libc::SIGCONT) };
    }

    /// Its next stdout line (bounded).
    fn line(&self) -> String {
        self.out
            .recv_timeout(Duration::from_secs(30))
            .expect("a line from the client")
    }

    /// Waits (bounded) for it to exit; its status and stderr.
    fn wait(mut self) -> (std::process::ExitStatus, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                let mut err = String::new();
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                return (st, err);
            }
            assert!(t.elapsed() < Duration::from_secs(30), "the client hangs");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_ok(self) {
        let (st, err) = self.wait();
        assert!(st.success(), "client: {st} {err}");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lines(out: ChildStdout) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn is_stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
        .unwrap_or(false)
}

/// One served connection: [`N`] bytes out, then the client's count and
/// hash back.
struct Served {
    s: SmcStream,
    sent: usize,
    reply: Vec<u8>,
}

impl Served {
    fn interest(&self) -> Ready {
        if self.sent < N {
            Ready::OUT
        } else {
            Ready::IN
        }
    }

    /// Makes what progress it can without blocking; true once the client's
    /// answer is in (and checked).
    fn progress(&mut self) -> bool {
        while self.sent < N {
            let chunk: Vec<u8> = (self.sent..N.min(self.sent + 16384)).map(pat).collect();
            match (&self.s).write(&chunk) {
                Ok(k) => self.sent += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(e) => panic!("write: {e}"),
            }
            if self.sent == N {
                self.s.shutdown(Shutdown::Write).expect("shutdown");
            }
        }
        let mut b = [0u8; 64];
        loop {
            match (&self.s).read(&mut b) {
                Ok(0) => break,
                Ok(k) => self.reply.extend_from_slice(&b[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(e) => panic!("read: {e}"),
            }
        }
        assert_eq!(self.reply.len(), 16, "the client's answer");
        let count = u64::from_le_bytes(self.reply[..8].try_into().unwrap());
        let hash = u64::from_le_bytes(self.reply[8..].try_into().unwrap());
        assert_eq!(
            (count, hash),
            (N as u64, sent_hash()),
            "bytes the client got"
        );
        true
    }
}

/// A level-triggered event loop over the listener and its connections.
/// A listener on a device of its own (`name`), whose handshakes wait
/// `clc`.
fn listener(name: &str, clc: Duration) -> (TempDir, SmcListener) {
    let dir = TempDir::new(name);
    let l = SmcListener::bind_with("127.0.0.1:0", &cfg(&dir.0, clc)).expect("bind");
    (dir, l)
}

struct Loop<'l> {
    l: &'l SmcListener,
    conns: Vec<Served>,
    /// How each finished connection went: (SMC-D, fallback reason).
    done: Vec<(bool, Option<Reason>)>,
    /// The longest `accept` call.
    max_accept: Duration,
    accepts: u32,
}

impl<'l> Loop<'l> {
    fn new(l: &'l SmcListener) -> Loop<'l> {
        l.set_nonblocking(true).expect("non-blocking listener");
        Loop {
            l,
            conns: Vec::new(),
            done: Vec::new(),
            max_accept: Duration::ZERO,
            accepts: 0,
        }
    }

    /// One wait (at most `t`) and what it reported; whether the listener
    /// was readable.
    fn turn(&mut self, t: Duration) -> bool {
        let mut p = Poller::new();
        p.add_fd(self.l.as_raw_fd(), LISTENER, Ready::IN);
        for (i, c) in self.conns.iter().enumerate() {
            p.add(&c.s, i as u64, c.interest());
        }
        let mut ev = Vec::new();
        match p.wait(&mut ev, Some(t)) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => return false,
            Err(e) => panic!("wait: {e}"),
        }
        drop(p);
        let listener = ev.iter().any(|e| e.token == LISTENER);
        if listener {
            self.accept_all();
        }
        let mut i = 0;
        while i < self.conns.len() {
            if self.conns[i].progress() {
                let c = self.conns.swap_remove(i);
                self.done.push((c.s.is_smc(), c.s.fallback_reason()));
            } else {
                i += 1;
            }
        }
        listener
    }

    fn accept_all(&mut self) {
        loop {
            let t = Instant::now();
            let r = self.l.accept();
            self.max_accept = self.max_accept.max(t.elapsed());
            self.accepts += 1;
            match r {
                Ok((s, _)) => {
                    s.set_nonblocking(true).expect("non-blocking stream");
                    self.conns.push(Served {
                        s,
                        sent: 0,
                        reply: Vec::new(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// A client that stops itself mid-handshake: the loop accepts its
    /// TCP connection and keeps its handshake ([`Loop::assert_kept`]).
    fn stopped_client(&mut self, dir: &Path, clc: Duration) -> Client {
        let addr = self.l.local_addr().unwrap().to_string();
        let c = Client::stopped(dir, &addr, clc);
        assert!(self.turn(Duration::from_secs(5)), "no connection arrived");
        self.assert_kept();
        c
    }

    /// Checks that `accept` kept the stopped client's handshake: it did not
    /// return its connection, nor wait on it.
    fn assert_kept(&self) {
        let got: Vec<_> = self.conns.iter().map(|c| c.s.fallback_reason()).collect();
        assert!(
            got.is_empty() && self.done.is_empty(),
            "accept returned the stopped client's connection undecided (fallback {got:?}), \
             its longest call {:?}",
            self.max_accept
        );
        assert!(
            self.max_accept < ACCEPT_BOUND,
            "an accept took {:?}",
            self.max_accept
        );
    }

    /// Turns until `n` connections in all are done (bounded).
    fn until_done(&mut self, n: usize) {
        let t = Instant::now();
        while self.done.len() < n {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{} of {n} connections served",
                self.done.len()
            );
            self.turn(Duration::from_millis(100));
        }
    }
}

fn stats(dir: &Path) -> Stats {
    Device::open(dir).expect("device").stats()
}

/// Waits at most `t` for the listener alone to become readable: whether it
/// did.
fn listener_readable(l: &SmcListener, t: Duration) -> bool {
    let mut p = Poller::new();
    p.add_fd(l.as_raw_fd(), LISTENER, Ready::IN);
    let mut ev = Vec::new();
    p.wait(&mut ev, Some(t)).expect("wait") == 1
}

#[test]
fn event_loop_accept_does_not_wait_on_a_stopped_client() {
    const FAST: usize = 3;
    // Generous: the stopped client's handshake must still be going on
    // when it is continued.
    let clc = Duration::from_secs(20);
    let (dir, l) = listener("backlog-stopped", clc);
    let mut ev = Loop::new(&l);
    // Its TCP connection is accepted; its handshake goes on.
    let stopper = ev.stopped_client(&dir.0, clc);
    // Nothing to return while it is stopped: the listener stays quiet.
    assert!(
        !listener_readable(&l, Duration::from_millis(300)),
        "the listener is readable while the only handshake waits on a stopped client"
    );
    // Meanwhile the loop serves others, through shared memory.
    let addr = l.local_addr().unwrap().to_string();
    for k in 0..FAST {
        let c = Client::spawn(&dir.0, &["connect", &addr, "sink"], clc);
        ev.until_done(k + 1);
        assert_eq!(c.line(), "smc=1 reason=-");
        c.wait_ok();
    }
    assert_eq!(ev.done, vec![(true, None); FAST]);
    let st = stats(&dir.0);
    assert_eq!(st.conns_opened, FAST as u64, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    // Continued, the client answers: the listener becomes readable with no
    // new connection, and accept returns its connection, SMC-D.
    stopper.cont();
    let t = Instant::now();
    assert!(
        listener_readable(&l, Duration::from_secs(10)),
        "the listener did not become readable when the handshake decided"
    );
    eprintln!("readable {:?} after SIGCONT", t.elapsed());
    ev.until_done(FAST + 1);
    assert_eq!(stopper.line(), "smc=1 reason=-");
    stopper.wait_ok();
    assert_eq!(ev.done, vec![(true, None); FAST + 1]);
    eprintln!("longest accept: {:?} ({} calls)", ev.max_accept, ev.accepts);
    assert!(
        ev.max_accept < ACCEPT_BOUND,
        "an accept took {:?} while a client was stopped mid-handshake",
        ev.max_accept
    );
    let st = stats(&dir.0);
    assert_eq!(st.conns_opened, FAST as u64 + 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(
        st.xfer_bytes >= (FAST as u64 + 1) * (N as u64 + 16),
        "{st:?}"
    );
}

#[test]
fn a_client_stopped_past_the_wait_gets_tcp_with_every_byte() {
    let clc = Duration::from_millis(300);
    let (dir, l) = listener("backlog-timeout", clc);
    let mut ev = Loop::new(&l);
    let stopper = ev.stopped_client(&dir.0, clc);
    let kept = Instant::now();
    // The server's wait runs out while the client is still stopped: the
    // listener becomes readable (its timer), and accept returns the
    // connection as TCP.
    assert!(
        listener_readable(&l, Duration::from_secs(10)),
        "the listener did not become readable at the handshake's deadline"
    );
    let after = kept.elapsed();
    assert!(
        after >= clc - Duration::from_millis(50),
        "readable after {after:?}, before the deadline"
    );
    ev.accept_all();
    assert_eq!(ev.conns.len(), 1, "the connection is returned");
    assert_eq!(ev.conns[0].s.fallback_reason(), Some(Reason::Timeout));
    assert!(is_stopped(stopper.pid()));
    stopper.cont();
    ev.until_done(1);
    assert_eq!(stopper.line(), "smc=0 reason=TIMEOUT");
    stopper.wait_ok();
    assert!(ev.max_accept < ACCEPT_BOUND, "{:?}", ev.max_accept);
    let st = stats(&dir.0);
    assert_eq!(st.conns_opened, 0, "{st:?}");
    assert_eq!(st.fallback(Reason::Timeout), (1, 1), "{st:?}");
    assert_eq!(st.fallbacks_total(), 2, "{st:?}");
}

#[test]
fn switching_back_to_blocking_returns_kept_connections_first() {
    let clc = Duration::from_secs(20);
    let (dir, l) = listener("backlog-blocking", clc);
    let mut ev = Loop::new(&l);
    let stopper = ev.stopped_client(&dir.0, clc);
    l.set_nonblocking(false).unwrap();
    // A blocking accept waits for the kept handshake (no other connection
    // comes), which decides once the client is continued.
    let (s, _) = std::thread::scope(|sc| {
        let a = sc.spawn(|| l.accept());
        std::thread::sleep(Duration::from_millis(200));
        assert!(!a.is_finished(), "a blocking accept returned undecided");
        stopper.cont();
        a.join().unwrap()
    })
    .expect("accept");
    assert!(s.is_smc(), "{:?}", s.fallback_reason());
    s.set_nonblocking(true).unwrap();
    ev.conns.push(Served {
        s,
        sent: 0,
        reply: Vec::new(),
    });
    ev.until_done(1);
    assert_eq!(stopper.line(), "smc=1 reason=-");
    stopper.wait_ok();
    let st = stats(&dir.0);
    assert_eq!(st.conns_opened, 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
}

#[test]
fn dropping_the_listener_resets_a_kept_connection_and_leaves_nothing() {
    let clc = Duration::from_secs(20);
    let (dir, l) = listener("backlog-drop", clc);
    let mut ev = Loop::new(&l);
    let stopper = ev.stopped_client(&dir.0, clc);
    // The server's DMB for the kept handshake is registered.
    assert_eq!(stats(&dir.0).dmbs_cnt, 2, "{:?}", stats(&dir.0));
    drop(ev);
    drop(l);
    assert_eq!(stats(&dir.0).listeners, 0);
    // Continued, the client finds the proposal declined and the TCP
    // connection reset: it fails at once, never hangs.
    stopper.cont();
    let t = Instant::now();
    assert_eq!(stopper.line(), "smc=0 reason=TIMEOUT");
    let (st, err) = stopper.wait();
    assert!(!st.success(), "the client read a clean end: {err}");
    assert!(err.contains("reset"), "the client's error: {err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let st = stats(&dir.0);
    assert_eq!((st.dmbs_cnt, st.conns_active), (0, 0), "{st:?}");
    assert_eq!(st.conns_opened, 0, "{st:?}");
    assert_eq!(st.fallback(Reason::Timeout).0, 1, "{st:?}");
    let left: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dmb-") || n.starts_with("u-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// In a child forked from the test: runs `f`, then leaves without
/// unwinding into the harness (status 1 on a panic).
fn in_child(f: impl FnOnce()) -> ! {
    let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(()) => 0,
        Err(_) => 1,
    };
    // SAFETY: leaving the child without running the parent's state's
    // destructors a second time.
    unsafe { libc::_exit(code) }
}

#[test]
fn a_fork_child_leaves_the_parents_kept_connection_alone() {
    let clc = Duration::from_secs(20);
    let (dir, l) = listener("backlog-fork", clc);
    let mut ev = Loop::new(&l);
    let stopper = ev.stopped_client(&dir.0, clc);
    // SAFETY: the child only uses its copy of the listener and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // The child neither takes the parent's kept connection nor, closing
        // its listener, declines or resets it.
        drop(ev);
        in_child(move || {
            let e = l.accept().map(|_| ()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
            assert!(!listener_readable(&l, Duration::ZERO));
            drop(l);
        });
    }
    let mut st = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "the fork child failed: {st:#x}"
    );
    stopper.cont();
    ev.until_done(1);
    assert_eq!(ev.done, vec![(true, None)]);
    assert_eq!(stopper.line(), "smc=1 reason=-");
    stopper.wait_ok();
    let st = stats(&dir.0);
    assert_eq!(st.conns_opened, 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
}

/// A client that counted early bytes and never sent them (descheduled
/// between the two, for good) does not hold the event loop's `accept`:
/// the server waits for them no longer than the spin budget there, then
/// declines (SYNCERR) and the connection is served over TCP with every
/// byte. Before, `accept` slept up to 50 ms for them.
#[test]
fn counted_early_bytes_that_never_come_do_not_hold_accept() {
    let clc = Duration::from_secs(20);
    let (dir, l) = listener("early-missing", clc);
    let addr = l.local_addr().unwrap().to_string();
    let mut lp = Loop::new(&l);
    let c = Client::spawn(&dir.0, &["earlymissing", &addr], clc);
    lp.until_done(1);
    assert_eq!(c.line(), "smc=0 reason=SYNCERR");
    c.wait_ok();
    assert_eq!(lp.done, vec![(false, Some(Reason::SyncErr))]);
    // Far below the 50 ms the blocking accept waits for early bytes.
    assert!(
        lp.max_accept < Duration::from_millis(40),
        "an accept took {:?}",
        lp.max_accept
    );
    let st = Device::open(&dir.0).unwrap().stats();
    assert_eq!(st.fallback(Reason::SyncErr), (1, 1), "{st:?}");
}
