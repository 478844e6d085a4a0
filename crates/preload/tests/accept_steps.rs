//! Handshakes that go on after `accept` and `connect` returned
//! (`tests/c/accept_steps.c`, docs/handshake.md "Handshake waits"): an event
//! loop's `accept` does not wait on a client stopped mid-handshake and
//! serves other clients over SMC-D meanwhile; the stopped client, once
//! continued, gets its connection with every byte (a greeting the server
//! writes at once, a payload the client writes at once, its echo): over
//! SMC-D, or over TCP when both ends gave up meanwhile; and a wait over an
//! unanswered handshake sleeps until the answer instead of waking every
//! millisecond, also beside SMC-D connections.

use smclo::device::{Device, Stats};
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::{compile, lib};

static N: AtomicU32 = AtomicU32::new(0);

/// Bytes each connection carries: the greeting, the payload and its echo
/// (accept_steps.c's GREETING and PAYLOAD).
const CONN_BYTES: u64 = 3000 + 2 * 60000;

fn program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("accept_steps", &[]))
}

/// A device directory and the processes of one test, removed and killed
/// when dropped.
struct Setup {
    dev: PathBuf,
    children: Vec<Child>,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        let dev = PathBuf::from(format!(
            "/dev/shm/smclo-accept-steps-{}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dev);
        Setup {
            dev,
            children: Vec::new(),
        }
    }

    /// Starts `accept_steps args` under the preload (killed when dropped;
    /// every wait on it is bounded); its stdout lines arrive on the
    /// receiver. Returns its index.
    fn spawn(&mut self, args: &[&str]) -> (usize, Receiver<String>) {
        // Generous under load; the stops below are much shorter.
        self.spawn_waiting(args, 8000)
    }

    /// [`spawn`](Self::spawn) with `SMCLO_CLC_WAIT_MS` set to `clc_ms`.
    fn spawn_waiting(&mut self, args: &[&str], clc_ms: u64) -> (usize, Receiver<String>) {
        let mut c = Command::new(program())
            .args(args)
            .env("LD_PRELOAD", lib())
            .env("SMCLO_DEVICE_DIR", &self.dev)
            .env("SMCLO_DEBUG", "1")
            .env("SMCLO_CLC_WAIT_MS", clc_ms.to_string())
            .env_remove("SMCLO_DISABLE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn accept_steps");
        let rx = lines(c.stdout.take().expect("stdout"));
        self.children.push(c);
        (self.children.len() - 1, rx)
    }

    fn pid(&self, i: usize) -> i32 {
        self.children[i].id() as i32
    }

    /// Waits (bounded) for child `i` to exit successfully.
    fn wait_ok(&mut self, i: usize, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = self.children[i].try_wait().expect("try_wait") {
                assert!(st.success(), "{what} failed: {st}");
                return;
            }
            assert!(Instant::now() < deadline, "{what} did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stats(&self) -> Stats {
        Device::open(&self.dev)
            .expect("open the test device")
            .stats()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dev);
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

/// The next line starting with `prefix` (bounded), without it.
fn expect(rx: &Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.starts_with("FAIL") => panic!("{l}"),
            Ok(l) => {
                if let Some(rest) = l.strip_prefix(prefix) {
                    return rest.trim().to_string();
                }
            }
            Err(e) => panic!("no line {prefix:?}: {e}"),
        }
    }
}

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
        .unwrap_or(false)
}

/// The longest an event loop's `accept4` may take, in microseconds: a
/// handful of system calls and the spin budget (0.3 to 0.6 ms measured),
/// with room for a loaded machine's scheduling (10.2 ms seen in a full
/// test run). The wait on the client this replaced took 50 ms, and left
/// the stopped client on TCP, which the counters check as well.
const ACCEPT_BOUND_US: u64 = 40_000;

#[test]
fn event_loop_accept_does_not_wait_on_a_stopped_client() {
    const FAST: usize = 3;
    let mut s = Setup::new("stopped");
    let total = (FAST + 1).to_string();
    let (server, srx) = s.spawn(&["server", &total]);
    let port = expect(&srx, "READY ");
    // A client stopped right after its connect returned: its proposal and
    // source port are published, its DMB never comes while it is stopped.
    let (stopper, stop_rx) = s.spawn(&["stopper", &port]);
    let stopper_pid = s.pid(stopper);
    let t = Instant::now();
    while !stopped(stopper_pid) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the client never stopped"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(expect(&srx, "ACCEPTED "), "1");
    // Meanwhile the server serves others, through shared memory.
    for k in 0..FAST {
        let (c, rx) = s.spawn(&["client", &port]);
        assert_eq!(expect(&srx, "ACCEPTED "), (k + 2).to_string());
        expect(&rx, "OK");
        s.wait_ok(c, "a client beside the stopped one");
    }
    let st = s.stats();
    assert_eq!(st.conns_opened, FAST as u64, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(stopper_pid, libc::SIGCONT) };
    expect(&stop_rx, "OK");
    s.wait_ok(stopper, "the stopped client");
    let max_us: u64 = expect(&srx, "MAXACCEPT ").parse().expect("microseconds");
    expect(&srx, "OK");
    s.wait_ok(server, "the server");
    eprintln!("longest accept: {max_us} µs");
    assert!(
        max_us < ACCEPT_BOUND_US,
        "an accept took {max_us} µs while a client was stopped mid-handshake"
    );
    // The stopped client's connection went through shared memory too, and
    // every byte of all of them.
    let st = s.stats();
    assert_eq!(st.conns_opened, FAST as u64 + 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(
        st.xfer_bytes >= (FAST as u64 + 1) * CONN_BYTES,
        "{} bytes through the rings: {st:?}",
        st.xfer_bytes
    );
}

#[test]
fn a_client_stopped_past_the_wait_gets_tcp_with_every_byte() {
    const CLC_MS: u64 = 300;
    let mut s = Setup::new("stopped-long");
    let (server, srx) = s.spawn_waiting(&["server", "1"], CLC_MS);
    let port = expect(&srx, "READY ");
    let (stopper, stop_rx) = s.spawn_waiting(&["stopper", &port], CLC_MS);
    let stopper_pid = s.pid(stopper);
    let t = Instant::now();
    while !stopped(stopper_pid) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the client never stopped"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(expect(&srx, "ACCEPTED "), "1");
    // Both ends give up meanwhile: the server (its greeting then goes out
    // over TCP) while the client is stopped, the client when it continues.
    std::thread::sleep(Duration::from_millis(3 * CLC_MS));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(stopper_pid, libc::SIGCONT) };
    expect(&stop_rx, "OK");
    s.wait_ok(stopper, "the stopped client");
    let max_us: u64 = expect(&srx, "MAXACCEPT ").parse().expect("microseconds");
    expect(&srx, "OK");
    s.wait_ok(server, "the server");
    assert!(max_us < ACCEPT_BOUND_US, "an accept took {max_us} µs");
    let st = s.stats();
    assert_eq!(st.conns_opened, 0, "{st:?}");
    assert_eq!(st.fallback(Reason::Timeout), (1, 1), "{st:?}");
    assert_eq!(st.fallbacks_total(), 2, "{st:?}");
}

#[test]
fn an_unanswered_handshake_sleeps_until_the_answer() {
    const MS: u64 = 500;
    let mut s = Setup::new("idle");
    let (server, srx) = s.spawn(&["listen"]);
    let port = expect(&srx, "READY ");
    let server_pid = s.pid(server);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(server_pid, libc::SIGSTOP) };
    let (_, rx) = s.spawn(&["idle", &port, &MS.to_string()]);
    let w = expect(&rx, "WAKEUPS ");
    let n: Vec<u64> = w
        .split_whitespace()
        .map(|x| x.parse().expect("a count"))
        .collect();
    // SAFETY: as above.
    unsafe { libc::kill(server_pid, libc::SIGCONT) };
    eprintln!("voluntary context switches (epoll_wait, poll): {n:?}");
    // Slices of 1 ms made about MS wakeups per wait; a sleep on the
    // handshake's own descriptor a handful.
    assert!(
        n.iter().all(|&k| k < MS / 20),
        "voluntary context switches of epoll_wait and poll over {MS} ms: {n:?}"
    );
}

#[test]
fn an_unanswered_handshake_beside_smc_d_connections_sleeps_until_the_answer() {
    const MS: u64 = 500;
    let mut s = Setup::new("idlemixed");
    let (_, live_rx) = s.spawn(&["server", "1"]);
    let live = expect(&live_rx, "READY ");
    let (stopped, srx) = s.spawn(&["listen"]);
    let port = expect(&srx, "READY ");
    let stopped_pid = s.pid(stopped);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(stopped_pid, libc::SIGSTOP) };
    let (client, rx) = s.spawn(&["idlemixed", &live, &port, &MS.to_string()]);
    let n: u64 = expect(&rx, "WAKEUPS ").parse().expect("a count");
    expect(&rx, "OK");
    s.wait_ok(client, "the client");
    // SAFETY: as above.
    unsafe { libc::kill(stopped_pid, libc::SIGCONT) };
    eprintln!("voluntary context switches of epoll_wait: {n}");
    // The set's SMC-D member makes it the event-loop fast path's: its
    // sleep, too, ends on the handshake's descriptor, not every 1 ms.
    let st = s.stats();
    assert!(
        st.conns_opened >= 1,
        "the set held an SMC-D connection: {st:?}"
    );
    assert!(
        n < MS / 20,
        "voluntary context switches of epoll_wait over {MS} ms: {n}"
    );
}
