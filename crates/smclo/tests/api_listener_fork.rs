//! An `SmcListener` whose registering process lets go of it while a fork
//! child goes on accepting on it (the parent drops its listener, or exits
//! without dropping it, as a program that daemonizes after it listens
//! does) serves SMC-D again from the child's first accept of a client that
//! did not propose: that connection stays TCP (PEERNOSMC), the next ones
//! are SMC-D. The clients are native ones (`SmcStream::connect`); each
//! connection's transport is proven by both ends' reports and by the
//! device's counters.
//!
//! The listening process is this test binary run as a child in a role
//! (`child_entry`); the server is its fork child, bounded by `alarm` and
//! killed through a pidfd when the test ends.

mod common;

use common::{child_role, spawn_child, ChildGuard, TempDir};
use smclo::api::{SmcListener, SmcStream};
use smclo::config::Config;
use smclo::device::Device;
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::ChildStdout;

/// Connections made to the fork child.
const CONNS: usize = 3;

/// Bytes each connection carries each way.
const N: usize = 100;

/// Seconds the fork child may live, whatever happens.
const SERVER_LIFETIME: u32 = 30;

fn cfg(dir: &Path) -> Config {
    let mut c = Config::from_env().unwrap();
    c.device_dir = dir.to_path_buf();
    c
}

fn pattern(k: usize) -> Vec<u8> {
    (0..N).map(|i| (i * 7 + k) as u8).collect()
}

/// One line a connection's end prints of its transport.
fn transport(s: &SmcStream) -> String {
    match s.fallback_reason() {
        None => "smc".to_string(),
        Some(r) => format!("tcp {}", r.name()),
    }
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = child_role() else {
        return;
    };
    let l = SmcListener::bind_with("127.0.0.1:0", &cfg(&dir)).unwrap();
    let port = l.local_addr().unwrap().port();
    // SAFETY: the child only serves on its copy of the listener and then
    // _exits; it never returns into the harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: alarm(2) has no memory effects; SIGALRM's default
        // action ends the server if the test never connects.
        unsafe { libc::alarm(SERVER_LIFETIME) };
        let ok = std::panic::catch_unwind(|| serve(l, role.ends_with("-nb"))).is_ok();
        // SAFETY: leaving the fork child without unwinding into the harness.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    match role.as_str() {
        "close" | "close-nb" => {
            drop(l);
            say(&format!("serving {port} {pid}"));
            let mut st = 0;
            // SAFETY: waiting for our own child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
            assert!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "server failed"
            );
        }
        "exit" => {
            say(&format!("serving {port} {pid}"));
            // SAFETY: ends this process without running the listener's
            // destructor, as a daemon's first process exits.
            unsafe { libc::_exit(0) };
        }
        other => panic!("unknown role {other}"),
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

/// The fork child: accepts [`CONNS`] clients, echoes [`N`] bytes on each
/// and prints each one's transport.
fn serve(l: SmcListener, nonblocking: bool) {
    l.set_nonblocking(nonblocking).unwrap();
    for k in 0..CONNS {
        let mut s = accept(&l);
        s.set_nonblocking(false).unwrap();
        let mut b = [0u8; N];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        say(&format!("conn {k} {}", transport(&s)));
    }
}

/// A connection of `l`, waiting for one on its descriptor when it does
/// not block.
fn accept(l: &SmcListener) -> SmcStream {
    loop {
        match l.accept() {
            Ok((s, _)) => return s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd: l.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 1000) };
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// The fork child, killed when the test ends (through a pidfd: its pid
/// may have gone to another process once it exited and was reaped).
struct Server(OwnedFd);

impl Server {
    fn new(pid: libc::pid_t) -> Server {
        // SAFETY: pidfd_open(2) with a pid and no flags; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor that nothing else owns.
        Server(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: pidfd_send_signal(2) on our pidfd, no siginfo; a server
        // that has exited makes it fail, harmlessly.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

/// The next line of `out` that starts with `prefix` (the harness prints
/// its own lines too), without it; "" at the end of the output.
fn line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    loop {
        let mut l = String::new();
        if out.read_line(&mut l).unwrap() == 0 {
            return String::new();
        }
        if let Some(rest) = l.trim().strip_prefix(prefix) {
            return rest.to_string();
        }
    }
}

/// One native client's connection to `port`: [`N`] bytes there and back;
/// its transport.
fn echo(port: u16, c: &Config, k: usize) -> String {
    let mut s = SmcStream::connect_with(("127.0.0.1", port), c).unwrap();
    let sent = pattern(k);
    s.write_all(&sent).unwrap();
    let mut b = [0u8; N];
    s.read_exact(&mut b).unwrap();
    assert_eq!(b[..], sent[..], "connection {k}");
    transport(&s)
}

/// Runs the listening process in `role` and connects [`CONNS`] times to its
/// fork child: the first connection finds no live registration and stays
/// TCP at both ends; the child, accepting it, registers the listener again,
/// so the later ones are SMC-D.
fn later_connections_are_smc_d(role: &str) {
    let t = TempDir::new("lfork");
    let c = cfg(&t.0);
    let mut child: ChildGuard = spawn_child(role, &t.0);
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let serving = line(&mut out, "serving ");
    let (port, pid) = serving
        .split_once(' ')
        .unwrap_or_else(|| panic!("listening process said {serving:?}"));
    let _server = Server::new(pid.parse().unwrap());
    let port: u16 = port.parse().unwrap();
    if role == "exit" {
        // Its registration's owner is gone before any client looks.
        assert!(child.0.wait().unwrap().success());
    }
    let dev = Device::open(&t.0).unwrap();
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    let mut listeners = Vec::new();
    for k in 0..CONNS {
        // Asked while the server waits for connection k (it may be gone
        // after the last).
        listeners.push(dev.stats().listeners);
        clients.push(echo(port, &c, k));
        servers.push(line(&mut out, &format!("conn {k} ")));
    }
    let mut want = vec!["tcp PEERNOSMC".to_string()];
    want.resize(CONNS, "smc".to_string());
    let stats = dev.stats();
    let report =
        format!("clients {clients:?}, servers {servers:?}, listeners {listeners:?}, {stats:?}");
    assert_eq!(clients, want, "{report}");
    assert_eq!(servers, want, "{report}");
    assert_eq!(stats.fallback(Reason::PeerNoSmc), (1, 1), "{report}");
    assert_eq!(stats.fallbacks_total(), 2, "{report}");
    assert_eq!(stats.conns_opened, CONNS as u64 - 1, "{report}");
    // None before the first connection; the server's own after it.
    let mut registered = vec![0];
    registered.resize(CONNS, 1);
    assert_eq!(listeners, registered, "{report}");
    if role != "exit" {
        assert!(child.0.wait().unwrap().success(), "{report}");
    }
}

#[test]
fn a_listener_the_parent_dropped_serves_its_fork_child_over_smc_d() {
    later_connections_are_smc_d("close");
}

#[test]
fn a_listener_whose_registering_process_exited_serves_its_fork_child_over_smc_d() {
    later_connections_are_smc_d("exit");
}

#[test]
fn a_non_blocking_listener_the_parent_dropped_serves_its_fork_child_over_smc_d() {
    later_connections_are_smc_d("close-nb");
}
