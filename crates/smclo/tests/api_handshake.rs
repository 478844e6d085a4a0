//! End-to-end tests of the handshake and the native API, across processes.
//!
//! The other end runs in `smclo-testpeer` (a connection inside one process is
//! never upgraded). Every test uses its own device directory and checks the
//! device counters, so "it went through shared memory" is proven, not assumed.

use smclo::api::{SmcListener, SmcStream};
use smclo::config::Config;
use smclo::device::Device;
use smclo::testing::handshake::{ClientProposal, Decision, Pending, Polled, Until};
use smclo_testsupport::{DevDir, Peer};
use smclo_wire::reason::Reason;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A fresh device directory ([`Dir::new`]), removed at the end of the test.
type Dir = DevDir;

/// What these tests ask of their device directory.
trait DirExt {
    fn cfg(&self) -> Config;
    fn dev(&self) -> std::sync::Arc<Device>;
    fn leftovers(&self) -> Vec<String>;
}

impl DirExt for Dir {
    fn cfg(&self) -> Config {
        let mut c = Config::from_env().unwrap();
        c.device_dir = self.0.clone();
        c
    }
    fn dev(&self) -> std::sync::Arc<Device> {
        Device::open(&self.0).unwrap()
    }
    /// Names of DMB and rendezvous files left in the directory.
    fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("dmb-") || n.starts_with("u-"))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// `smclo-testpeer` on a device directory.
trait Testpeer: Sized {
    fn spawn(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self;
    fn serve(dir: &Path, workload: &str) -> (Self, String);
    fn serve_env(dir: &Path, workload: &str, env: &[(&str, &str)]) -> (Self, String);
}

impl Testpeer for Peer {
    fn spawn(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_smclo-testpeer"));
        cmd.args(args).env("SMCLO_DEVICE_DIR", dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::start(cmd)
    }
    fn serve(dir: &Path, workload: &str) -> (Peer, String) {
        Peer::serve_env(dir, workload, &[])
    }
    fn serve_env(dir: &Path, workload: &str, env: &[(&str, &str)]) -> (Peer, String) {
        let mut p = Peer::spawn(dir, &["serve", "127.0.0.1:0", workload], env);
        let l = p.line();
        let addr = l
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("peer said {l:?}"))
            .to_string();
        (p, addr)
    }
}

fn fnv(h: &mut u64, data: &[u8]) {
    for &b in data {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// The stream `smclo-testpeer source:N:SEED` writes, hashed.
fn source_hash(n: u64, seed: u64) -> u64 {
    let mut seed = seed.max(1);
    let mut h = 0xcbf29ce484222325u64;
    let mut left = n;
    let max = 61 * 1024 + 7;
    let mut buf = vec![0u8; max];
    while left > 0 {
        let k = (left as usize).min(1 + (xorshift(&mut seed) as usize % max));
        for b in &mut buf[..k] {
            *b = xorshift(&mut seed) as u8;
        }
        fnv(&mut h, &buf[..k]);
        left -= k as u64;
    }
    h
}

fn read_to_end_hash(mut r: impl Read) -> std::io::Result<(u64, u64)> {
    let mut buf = vec![0u8; 100_000];
    let (mut n, mut h) = (0u64, 0xcbf29ce484222325u64);
    loop {
        let k = r.read(&mut buf)?;
        if k == 0 {
            return Ok((n, h));
        }
        fnv(&mut h, &buf[..k]);
        n += k as u64;
    }
}

#[test]
fn upgrades_and_moves_bytes_exactly_both_ways() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let s = SmcStream::connect_with(&addr, &dir.cfg()).unwrap();
    assert!(s.is_smc(), "fell back: {:?}", s.fallback_reason());
    assert_eq!(peer.line(), "smc=1 reason=-");
    const TOTAL: u64 = 24 << 20;
    let (got, want) = std::thread::scope(|sc| {
        let w = sc.spawn(|| {
            let mut seed = 7u64;
            let mut h = 0xcbf29ce484222325u64;
            let mut left = TOTAL;
            let mut buf = vec![0u8; 200_003];
            while left > 0 {
                let k = (left as usize).min(1 + xorshift(&mut seed) as usize % buf.len());
                for b in &mut buf[..k] {
                    *b = xorshift(&mut seed) as u8;
                }
                fnv(&mut h, &buf[..k]);
                (&s).write_all(&buf[..k]).unwrap();
                left -= k as u64;
            }
            s.shutdown(Shutdown::Write).unwrap();
            h
        });
        let got = read_to_end_hash(&s).unwrap();
        (got, w.join().unwrap())
    });
    assert_eq!(got, (TOTAL, want));
    drop(s);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert!(st.conns_opened >= 1, "{st:?}");
    // Both directions went through the rings: at least 2 × TOTAL bytes moved.
    assert!(
        st.xfer_bytes >= 2 * TOTAL,
        "xfer_bytes {} < {}",
        st.xfer_bytes,
        2 * TOTAL
    );
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(dir.leftovers().is_empty(), "left: {:?}", dir.leftovers());
}

/// The SYN mark stays on an SMC-D stream's TCP socket until the program
/// looks: `tcp()` shows the default TTL and TOS, and `set_nodelay` does not
/// need to put them back.
#[test]
fn smc_stream_tcp_shows_no_syn_mark() {
    let dir = Dir::new("hs");
    let n = 1000u64;
    let (peer, addr) = Peer::serve(&dir.0, &format!("source:{n}:7"));
    let s = SmcStream::connect_with(&addr, &dir.cfg()).unwrap();
    assert!(s.is_smc(), "fell back: {:?}", s.fallback_reason());
    s.set_nodelay(true).unwrap();
    let t = s.tcp();
    assert_eq!(t.ttl().unwrap(), 64);
    let mut tos: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `tos`.
    let r = unsafe {
        libc::getsockopt(
            t.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_TOS,
            (&mut tos as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!((r, tos), (0, 0));
    assert!(t.nodelay().unwrap());
    assert_eq!(read_to_end_hash(&s).unwrap(), (n, source_hash(n, 7)));
    peer.wait_ok();
    assert_eq!(dir.dev().stats().conns_opened, 1);
}

#[test]
fn server_speaks_first_through_shared_memory() {
    let dir = Dir::new("hs");
    let n = 5_000_000u64;
    let (peer, addr) = Peer::serve(&dir.0, &format!("source:{n}:99"));
    let s = SmcStream::connect_with(&addr, &dir.cfg()).unwrap();
    assert!(s.is_smc(), "fell back: {:?}", s.fallback_reason());
    assert_eq!(read_to_end_hash(&s).unwrap(), (n, source_hash(n, 99)));
    peer.wait_ok();
    assert!(dir.dev().stats().xfer_bytes >= n);
}

#[test]
fn many_sequential_connections_leave_nothing_behind() {
    let dir = Dir::new("hs");
    let l = {
        // The server is the other process; run 50 connections against a
        // fresh echo peer each time would be slow, so use one sink per
        // connection through a loop of peers.
        dir.dev()
    };
    // A successful handshake never waits for the client's bound: with a
    // 30 s bound, 20 connections must finish long before one bound passes.
    let mut cfg = dir.cfg();
    cfg.clc_wait = Duration::from_secs(30);
    let start = Instant::now();
    for i in 0..20 {
        let (peer, addr) = Peer::serve(&dir.0, "sink");
        let mut s = SmcStream::connect_with(&addr, &cfg).unwrap();
        assert!(
            s.is_smc(),
            "connection {i} fell back: {:?}",
            s.fallback_reason()
        );
        s.write_all(&[i as u8; 1000]).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut r = [0u8; 16];
        s.read_exact(&mut r).unwrap();
        assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), 1000);
        drop(s);
        peer.wait_ok();
    }
    assert!(
        start.elapsed() < Duration::from_secs(29),
        "handshakes waited for the timeout: {:?}",
        start.elapsed()
    );
    let st = l.stats();
    assert_eq!(st.conns_opened, 20);
    assert_eq!(st.conns_active, 0, "{st:?}");
    assert_eq!(st.dmbs_cnt, 0, "{st:?}");
    assert!(dir.leftovers().is_empty(), "left: {:?}", dir.leftovers());
}

/// Runs an echo exchange over a fallen-back connection and checks the
/// bytes, so a fallback is proven to be a working plain TCP connection.
fn echo_check(mut s: SmcStream) {
    let msg: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    s.write_all(&msg).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert!(back == msg, "echo differs");
}

#[test]
fn fallback_device_inactive() {
    let dir = Dir::new("hs");
    dir.dev().set_active(false);
    let (peer, addr) = Peer::serve(&dir.0, "echo");
    let s = SmcStream::connect_with(&addr, &dir.cfg()).unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::NoSmcdDev));
    echo_check(s);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::NoSmcdDev).0, 1, "{st:?}");
    assert_eq!(st.conns_opened, 0);
}

#[test]
fn fallback_different_device_directory() {
    let a = Dir::new("hs");
    let b = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&a.0, "echo");
    let s = SmcStream::connect_with(&addr, &b.cfg()).unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::PeerNoSmc));
    echo_check(s);
    assert_eq!(peer.line(), "smc=0 reason=PEERNOSMC");
    peer.wait_ok();
    assert_ne!(a.dev().gid(), b.dev().gid(), "two devices share a GID");
}

#[test]
fn fallback_ueid_mismatch() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve_env(&dir.0, "echo", &[("SMCLO_UEID", "TENANT-A")]);
    let mut cfg = dir.cfg();
    cfg.ueid = Some(*b"TENANT-B                        ");
    let s = SmcStream::connect_with(&addr, &cfg).unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::NoUeid));
    echo_check(s);
    assert_eq!(peer.line(), "smc=0 reason=NOUEID");
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!(
        st.fallback(Reason::NoUeid),
        (1, 1),
        "client and server each count it: {st:?}"
    );
}

/// Waits for the decision of the proposal `p`, whose socket connected,
/// as a blocking `connect` does.
fn finish(p: ClientProposal, cfg: &Config) -> Decision {
    Pending::connect(p, Instant::now() + cfg.clc_wait).finish()
}

/// A client's proposal to `dest` made by hand on a fresh TCP socket, so
/// that a test can meddle between its steps.
fn raw_proposal(
    dev: &std::sync::Arc<Device>,
    cfg: &Config,
    dest: std::net::SocketAddr,
) -> (TcpStream, smclo::testing::handshake::ClientProposal) {
    // SAFETY: a fresh socket, owned by the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is the fresh socket above, owned by nothing else.
    let tcp: TcpStream = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
    let Ok(p) = smclo::testing::handshake::client_propose(dev, cfg, fd, dest) else {
        panic!("proposal");
    };
    (tcp, p)
}

/// The echo peer answers over the plain TCP connection `t`.
fn echo_plain(mut t: TcpStream) {
    t.write_all(b"plain").unwrap();
    t.shutdown(Shutdown::Write).unwrap();
    let mut back = String::new();
    t.read_to_string(&mut back).unwrap();
    assert_eq!(back, "plain");
}

#[test]
fn fallback_token_gone() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let dest: std::net::SocketAddr = addr.parse().unwrap();
    let cfg = dir.cfg();
    let dev = dir.dev();
    let (tcp, mut p) = raw_proposal(&dev, &cfg, dest);
    let fd = tcp.as_raw_fd();
    // The DMB named in the proposal is unregistered before the client
    // passes it: the server gets no DMB for the token.
    assert_ne!(p.token(), 0);
    p.unregister_dmb();
    smclo::testing::sockaddr::connect(fd, dest).unwrap();
    let d = finish(p, &cfg);
    assert_eq!(d.fallback_reason(), Some(Reason::ErrRtok));
    assert_eq!(peer.line(), "smc=0 reason=ERR_RTOK");
    echo_plain(tcp);
    peer.wait_ok();
}

/// A client's proposal made by hand, connected, with `early` written into
/// its TCP stream as counted early bytes (`Some`), or counted but not sent
/// (`None`: a client stopped between the two).
fn early_proposal(
    dir: &Dir,
    cfg: &Config,
    addr: &str,
    early: Option<&[u8]>,
) -> (TcpStream, smclo::testing::handshake::ClientProposal) {
    let dest: std::net::SocketAddr = addr.parse().unwrap();
    let (mut tcp, mut p) = raw_proposal(&dir.dev(), cfg, dest);
    smclo::testing::sockaddr::connect(tcp.as_raw_fd(), dest).unwrap();
    p.syn_sent();
    // A first contact: the server waits for our DMB, so it cannot have
    // taken the count yet.
    assert!(p.add_early(early.map_or(5, <[u8]>::len)));
    if let Some(b) = early {
        tcp.write_all(b).unwrap();
    }
    (tcp, p)
}

#[test]
fn early_bytes_reach_an_smc_server_first_and_in_order() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let (tcp, p) = early_proposal(&dir, &dir.cfg(), &addr, Some(b"early"));
    let smclo::testing::handshake::Decision::Smc(e) = finish(p, &dir.cfg()) else {
        panic!("the handshake fell back");
    };
    assert_eq!(peer.line(), "smc=1 reason=-");
    assert_eq!(e.conn.write(b", then the ring").unwrap(), 15);
    e.conn.shutdown_write().unwrap();
    let mut back = Vec::new();
    let mut b = [0u8; 64];
    loop {
        match e.conn.read(&mut b).unwrap() {
            0 => break,
            n => back.extend_from_slice(&b[..n]),
        }
    }
    assert_eq!(back, b"early, then the ring");
    drop(e);
    drop(tcp);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!((st.conns_opened, st.fallbacks_total()), (1, 0), "{st:?}");
    // Both ways: the echo peer read all 20 bytes from its ring.
    assert_eq!(st.xfer_bytes, 40, "{st:?}");
}

#[test]
fn early_bytes_counted_but_not_in_the_stream_keep_tcp() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let (tcp, p) = early_proposal(&dir, &dir.cfg(), &addr, None);
    assert_eq!(
        finish(p, &dir.cfg()).fallback_reason(),
        Some(Reason::SyncErr)
    );
    assert_eq!(peer.line(), "smc=0 reason=SYNCERR");
    // The stream is exactly what was sent on it: nothing.
    echo_plain(tcp);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::SyncErr), (1, 1), "{st:?}");
}

#[test]
fn early_bytes_stay_in_the_stream_when_the_server_declines() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve_env(&dir.0, "echo", &[("SMCLO_UEID", "TENANT-A")]);
    let mut cfg = dir.cfg();
    cfg.ueid = Some(*b"TENANT-B                        ");
    let (mut tcp, p) = early_proposal(&dir, &cfg, &addr, Some(b"early"));
    assert_eq!(finish(p, &cfg).fallback_reason(), Some(Reason::NoUeid));
    assert_eq!(peer.line(), "smc=0 reason=NOUEID");
    tcp.write_all(b", then plain").unwrap();
    tcp.shutdown(Shutdown::Write).unwrap();
    let mut back = String::new();
    tcp.read_to_string(&mut back).unwrap();
    assert_eq!(back, "early, then plain");
    peer.wait_ok();
}

#[test]
fn early_bytes_of_a_client_gone_after_its_write_arrive() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut client = Peer::spawn(&dir.0, &["stall", &addr, "early"], &[]);
    assert_eq!(client.line(), "stalled");
    let st = client.child.wait().unwrap();
    assert!(st.success(), "{st}");
    // It exited with its proposal standing and its early bytes counted:
    // the server cannot reach it, keeps TCP, and reads them there.
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::PeerDead));
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"early");
}

#[test]
fn fallback_timeout_when_server_accepts_late() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut peer = Peer::spawn(
        &dir.0,
        &["connect", &addr, "echo"],
        &[("SMCLO_CLC_WAIT_MS", "100")],
    );
    // The client gives up after 100 ms; accept only later.
    assert_eq!(peer.line(), "smc=0 reason=TIMEOUT");
    let (mut s, _) = l.accept().unwrap();
    assert!(!s.is_smc());
    s.write_all(b"late but plain").unwrap();
    let mut b = [0u8; 14];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"late but plain");
    drop(s);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::Timeout).0, 1, "{st:?}");
}

#[test]
fn fallback_proposer_dead() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut peer = Peer::spawn(
        &dir.0,
        &["connect", &addr, "echo"],
        &[("SMCLO_CLC_WAIT_MS", "10000")],
    );
    // Wait until the client's connection is in the accept queue, then kill
    // it before the server answers.
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&l),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 5000) }, 1);
    peer.kill9();
    let (s, _) = l.accept().unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::PeerDead));
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::PeerDead).1, 1, "{st:?}");
    drop(s);
    drop(l);
    // The dead client's DMB file is gone after the next registration sweeps.
    let _ = dir.dev().stats();
}

#[test]
fn plain_server_gets_exactly_its_bytes_client_first() {
    let dir = Dir::new("hs");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        s.write_all(&(got.len() as u64).to_le_bytes()).unwrap();
        got
    });
    let mut s = SmcStream::connect_with(addr, &dir.cfg()).unwrap();
    assert_eq!(s.fallback_reason(), Some(Reason::PeerNoSmc));
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut n = [0u8; 8];
    s.read_exact(&mut n).unwrap();
    assert_eq!(t.join().unwrap(), b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(u64::from_le_bytes(n), 18);
}

#[test]
fn plain_server_speaks_first() {
    let dir = Dir::new("hs");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"220 banner\r\n").unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });
    let mut s = SmcStream::connect_with(addr, &dir.cfg()).unwrap();
    let mut banner = [0u8; 12];
    s.read_exact(&mut banner).unwrap();
    assert_eq!(&banner, b"220 banner\r\n");
    s.write_all(b"QUIT\r\n").unwrap();
    drop(s);
    assert_eq!(t.join().unwrap(), b"QUIT\r\n");
}

#[test]
fn plain_client_gets_exactly_its_bytes_from_smclo_server() {
    let dir = Dir::new("hs");
    // Client speaks first: echo.
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(b"hello plain world").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"hello plain world");
    assert_eq!(peer.line(), "smc=0 reason=PEERNOSMC");
    peer.wait_ok();
    // Server speaks first: the plain client reads exactly the stream, no
    // byte more.
    let n = 300_000u64;
    let (peer, addr) = Peer::serve(&dir.0, &format!("source:{n}:5"));
    let c = TcpStream::connect(&addr).unwrap();
    assert_eq!(read_to_end_hash(&c).unwrap(), (n, source_hash(n, 5)));
    peer.wait_ok();
}

fn assert_ends_within(what: &str, start: Instant, r: std::io::Result<usize>) {
    let el = start.elapsed();
    assert!(el < Duration::from_secs(1), "{what}: took {el:?}");
    match r {
        Ok(0) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ) => {}
        other => panic!("{what}: expected EOF or a reset, got {other:?}"),
    }
}

#[test]
fn kill9_server_mid_transfer() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "source:100000000000:3");
    let s = SmcStream::connect_with(&addr, &dir.cfg()).unwrap();
    assert!(s.is_smc());
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    while n < 10 << 20 {
        n += (&s).read(&mut buf).unwrap();
    }
    peer.kill9();
    let start = Instant::now();
    // What was in the ring is still delivered; then EOF or a reset.
    let r = loop {
        match (&s).read(&mut buf) {
            Ok(0) => break Ok(0),
            Ok(_) if start.elapsed() < Duration::from_secs(1) => continue,
            other => break other,
        }
    };
    assert_ends_within("reader after writer was killed", start, r);
    drop(s);
    assert!(dir.leftovers().is_empty(), "left: {:?}", dir.leftovers());
    assert_eq!(dir.dev().stats().dmbs_cnt, 0);
}

#[test]
fn kill9_client_while_server_blocked_writing() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    // The client reads one byte's worth of nothing: it holds.
    let mut peer = Peer::spawn(&dir.0, &["connect", &addr, "hold"], &[]);
    let (s, _) = l.accept().unwrap();
    assert!(s.is_smc(), "{:?}", s.fallback_reason());
    assert_eq!(peer.line(), "smc=1 reason=-");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let chunk = vec![1u8; 1 << 16];
            // The peer never reads: this blocks once its ring is full.
            let r = loop {
                if let Err(e) = (&s).write_all(&chunk) {
                    break e;
                }
            };
            tx.send((Instant::now(), r)).unwrap();
        });
        std::thread::sleep(Duration::from_millis(300));
        let killed = Instant::now();
        peer.kill9();
        let (when, e) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("blocked writer never woke");
        assert!(when.duration_since(killed) < Duration::from_secs(1));
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{e:?}"
        );
    });
    drop(s);
    assert!(dir.leftovers().is_empty(), "left: {:?}", dir.leftovers());
}

#[test]
fn kill9_both_ends_leaves_no_dmb() {
    let dir = Dir::new("hs");
    let (mut server, addr) = Peer::serve(&dir.0, "echo");
    let mut client = Peer::spawn(&dir.0, &["connect", &addr, "hold"], &[]);
    assert_eq!(client.line(), "smc=1 reason=-");
    assert_eq!(server.line(), "smc=1 reason=-");
    server.kill9();
    client.kill9();
    assert!(dir.leftovers().is_empty(), "left: {:?}", dir.leftovers());
    let st = dir.dev().stats();
    assert_eq!((st.dmbs_cnt, st.conns_active), (0, 0), "{st:?}");
}

#[test]
fn zero_copy_on_a_fallback_keeps_bytes_visible_to_poll() {
    let dir = Dir::new("hs");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"abcdef").unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });
    let s = SmcStream::connect_with(addr, &dir.cfg()).unwrap();
    assert!(!s.is_smc());
    let mut peeked = Vec::new();
    while peeked.len() < 6 {
        let r = s.peek_region().unwrap();
        peeked = vec![0; r.len()];
        r.copy_to_slice(0, &mut peeked);
        r.release(0).unwrap();
    }
    assert_eq!(peeked, b"abcdef");
    s.peek_region().unwrap().release(2).unwrap();
    // Unreleased bytes are still in the socket: poll says readable.
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&s),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 0) }, 1);
    let mut rest = [0u8; 4];
    (&s).read_exact(&mut rest).unwrap();
    assert_eq!(&rest, b"cdef");
    let mut w = s.reserve(5).unwrap();
    w.copy_from_slice(0, b"hello");
    w.commit(5).unwrap();
    drop(s);
    assert_eq!(t.join().unwrap(), b"hello");
}

/// The name of the abstract rendezvous socket listening for the device with
/// GID `gid`, as every uid of the network namespace sees it.
fn abstract_rendezvous_name(gid: u64) -> Option<Vec<u8>> {
    let prefix = format!("@smclo-{gid:016x}-u-");
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .find(|p| p.starts_with(&prefix))
        .map(|p| p.as_bytes()[1..].to_vec())
}

/// Connects to the abstract UNIX socket `name` without blocking until its
/// backlog is full; the connected sockets.
fn flood_abstract(name: &[u8]) -> Vec<std::os::fd::OwnedFd> {
    // SAFETY: all-zero bytes are a valid sockaddr_un.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in sa.sun_path[1..].iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as u32;
    let mut held = Vec::new();
    for _ in 0..20_000 {
        // SAFETY: plain socket(2); owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is the fresh socket above.
        let owned = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
        // SAFETY: `sa` is a valid sockaddr_un of at least `len` bytes.
        let rc = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::EAGAIN), "connect: {e}");
            return held;
        }
        held.push(owned);
    }
    panic!(
        "the backlog of @{} never filled",
        String::from_utf8_lossy(name)
    );
}

#[test]
fn flooded_rendezvous_socket_does_not_stall_the_server() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let dest: std::net::SocketAddr = addr.parse().unwrap();
    let cfg = dir.cfg();
    let dev = dir.dev();
    let (tcp, mut p) = raw_proposal(&dev, &cfg, dest);
    let fd = tcp.as_raw_fd();
    // Another process of the namespace fills the client's rendezvous
    // backlog before the server connects to it.
    let name = abstract_rendezvous_name(dev.gid()).expect("abstract rendezvous socket");
    let flood = flood_abstract(&name);
    let start = Instant::now();
    smclo::testing::sockaddr::connect(fd, dest).unwrap();
    p.syn_sent();
    // The server declines within its connect bound; waiting for room in the
    // backlog would stall its accept until the client gives up.
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(peer.out.get_ref()),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert_eq!(
        ready, 1,
        "the server is stuck connecting to the flooded socket"
    );
    assert_eq!(peer.line(), "smc=0 reason=TIMEOUT");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(finish(p, &cfg).fallback_reason(), Some(Reason::Timeout));
    drop(flood);
    echo_plain(tcp);
    peer.wait_ok();
    assert_eq!(dev.stats().fallback(Reason::Timeout), (1, 1));
}

/// A UNIX stream socket bound to `from`, connected to `to`.
fn connect_named(
    from: &std::os::unix::net::SocketAddr,
    to: &std::os::unix::net::SocketAddr,
) -> std::os::unix::net::UnixStream {
    use std::os::linux::net::SocketAddrExt;
    let name = |a: &std::os::unix::net::SocketAddr| {
        // SAFETY: all-zero bytes are a valid sockaddr_un.
        let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let n = a.as_abstract_name().expect("an abstract name");
        for (d, s) in sa.sun_path[1..].iter_mut().zip(n) {
            *d = *s as libc::c_char;
        }
        let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + n.len()) as u32;
        (sa, len)
    };
    // SAFETY: plain socket(2); owned right below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is the fresh socket above.
    let s: std::os::unix::net::UnixStream = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
    let (f, flen) = name(from);
    let (t, tlen) = name(to);
    // SAFETY: valid sockaddr_un values of the lengths given.
    unsafe {
        assert_eq!(
            libc::bind(fd, (&f as *const libc::sockaddr_un).cast(), flen),
            0
        );
        assert_eq!(
            libc::connect(fd, (&t as *const libc::sockaddr_un).cast(), tlen),
            0
        );
    }
    s
}

/// Waits (bounded) until `accept` may return something.
fn wait_acceptable(l: &SmcListener) {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(l),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 5000) }, 1, "no connection");
}

/// A non-blocking listener's next connection (bounded), and its longest
/// `accept` call.
fn accept_ready(l: &SmcListener) -> (SmcStream, Duration) {
    let start = Instant::now();
    let mut longest = Duration::ZERO;
    loop {
        assert!(start.elapsed() < Duration::from_secs(10), "no connection");
        wait_acceptable(l);
        let t = Instant::now();
        let r = l.accept();
        longest = longest.max(t.elapsed());
        match r {
            Ok((s, _)) => return (s, longest),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
    }
}

#[test]
fn nonblocking_accept_does_not_wait_on_a_stalled_client() {
    let dir = Dir::new("hs");
    // The server's SMCLO_CLC_WAIT_MS is the default (1 s): a non-blocking
    // accept must not wait on any one client, and returns its connection
    // once its handshake decides.
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    // A client asleep in something else than the handshake, before or
    // after publishing its port, and one stopped (SIGSTOP). Killed, it
    // is PEER_DEAD: before publishing its port only a look at shared
    // memory tells (the listener's timer), after it its channel does.
    for stage in ["noport", "nodmb", "stopped"] {
        let how = if stage == "stopped" { "nodmb" } else { stage };
        let mut staller = Peer::spawn(&dir.0, &["stall", &addr, how], &[]);
        assert_eq!(staller.line(), "stalled");
        if stage == "stopped" {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(staller.child.id() as i32, libc::SIGSTOP) };
        }
        wait_acceptable(&l);
        let t = Instant::now();
        let e = l.accept().map(|_| ()).unwrap_err();
        let took = t.elapsed();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{stage}: {e}");
        assert!(
            took < Duration::from_millis(25),
            "accept waited {took:?} on a client stalled at {stage}"
        );
        staller.kill9();
        let (s, _) = accept_ready(&l);
        assert_eq!(s.fallback_reason(), Some(Reason::PeerDead), "{stage}");
    }
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::PeerDead).1, 3, "server side: {st:?}");
    // A healthy client right after is still upgraded.
    let peer = Peer::spawn(&dir.0, &["connect", &addr, "echo"], &[]);
    let (s, _) = accept_ready(&l);
    assert!(s.is_smc(), "fell back: {:?}", s.fallback_reason());
    echo_check(s);
    peer.wait_ok();
    let st = dir.dev().stats();
    assert_eq!(st.conns_opened, 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 3, "{st:?}");
}

/// A client that dies mid-handshake, after the server connected to its
/// rendezvous socket and before it passed its DMB, is PEER_DEAD at the
/// server, which returns at once: with the connection still in the dead
/// client's backlog (the kernel resets it; INTERR before) and with the
/// connection taken (end of file; a TIMEOUT before, as if the client had
/// withdrawn). wrk exiting with connects in flight leaves such handshakes.
#[test]
fn a_client_killed_mid_handshake_is_peer_dead() {
    let dir = Dir::new("hs");
    let mut cfg = dir.cfg();
    // A TIMEOUT would take this long.
    cfg.clc_wait = Duration::from_secs(10);
    let l = SmcListener::bind_with("127.0.0.1:0", &cfg).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    for stage in ["nodmb", "taken"] {
        let mut staller = Peer::spawn(&dir.0, &["stall", &addr, stage], &[]);
        std::thread::scope(|sc| {
            let server = sc.spawn(|| {
                let (s, _) = l.accept().unwrap();
                (s.fallback_reason(), Instant::now())
            });
            assert_eq!(staller.line(), "stalled", "{stage}");
            // "nodmb": time for the server to connect to the client's
            // rendezvous socket ("taken" is stalled only once it did).
            std::thread::sleep(Duration::from_millis(200));
            let killed = Instant::now();
            staller.kill9();
            let (reason, at) = server.join().unwrap();
            assert_eq!(reason, Some(Reason::PeerDead), "{stage}");
            let took = at.saturating_duration_since(killed);
            assert!(
                took < Duration::from_secs(3),
                "{stage}: accept took {took:?}"
            );
        });
    }
    let st = dir.dev().stats();
    assert_eq!(st.fallback(Reason::PeerDead).1, 2, "{st:?}");
    assert_eq!(st.fallbacks_total(), 2, "{st:?}");
}

#[test]
fn accept_does_not_wait_for_the_confirm() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    // The client passes its DMB, then never reads the server's answer.
    let mut staller = Peer::spawn(&dir.0, &["stall", &addr, "noconfirm"], &[]);
    let (mut s, took) = accept_ready(&l);
    assert_eq!(staller.line(), "stalled");
    // The CAS to ACCEPTED decided: the server's end is SMC-D at once.
    assert!(s.is_smc(), "fell back: {:?}", s.fallback_reason());
    assert!(
        took < Duration::from_millis(100),
        "an accept waited {took:?}"
    );
    // Data goes into the client's ring; the client that never followed
    // breaks only this connection: when it dies, the server reads a reset.
    s.write_all(b"into the ring").unwrap();
    staller.kill9();
    let mut b = [0u8; 16];
    let e = s.read(&mut b).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    let st = dir.dev().stats();
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(st.xfer_bytes >= 13, "{st:?}");
}

#[test]
fn a_client_that_cannot_follow_the_accept_resets_the_connection() {
    use smclo::testing::rendezvous::{Rendezvous, SlotKey};
    use smclo_wire::clc::{Accept, ClcMsg};
    use std::os::linux::net::SocketAddrExt;
    let dir = Dir::new("hs");
    let dev = dir.dev();
    // A server that accepts the proposal (its CAS to ACCEPTED) and then
    // closes the channel without passing its DMB.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    smclo::testing::tcp_syn::save_syns(l.as_raw_fd()).unwrap();
    let addr = l.local_addr().unwrap();
    let _reg = smclo::testing::registry::register_listener(&dev, addr).unwrap();
    let _peer = Peer::spawn(&dir.0, &["connect", &addr.to_string(), "echo"], &[]);
    let (mut s, _) = l.accept().unwrap();
    let syn = smclo::testing::tcp_syn::saved_syn(s.as_raw_fd())
        .unwrap()
        .unwrap()
        .unwrap();
    let key = SlotKey::new(syn.src.ip(), syn.mark, syn.dst);
    let slot = Rendezvous::find_all(&dev, key).pop().expect("the proposal");
    let Ok(ClcMsg::Proposal(p)) = ClcMsg::parse(&slot.proposal().unwrap()) else {
        panic!("not a proposal");
    };
    let accept = Accept {
        gid: dev.gid(),
        token: 1,
        dmbe_size_comp: 0,
        linkid: 7,
        chid: 0xFFFF,
    };
    slot.answer(&ClcMsg::Accept(accept).to_bytes(), true)
        .unwrap();
    // Connected from a socket named for the proposal, as a server does.
    let name = format!("smclo-{:016x}-u-{:016x}", dev.gid(), p.nonce);
    let sa = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let ours = format!("smclo-{:016x}-s-{:016x}", dev.gid(), p.token);
    let ours = std::os::unix::net::SocketAddr::from_abstract_name(ours.as_bytes()).unwrap();
    drop(connect_named(&ours, &sa));
    // The client cannot follow (no DMB) and must not carry the stream over
    // TCP, where this server, committed to SMC-D, would never read it.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let e = s.read(&mut [0u8; 8]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    // The client counts after it reset the connection.
    let t = Instant::now();
    while dev.stats().fallback(Reason::ErrRtok).0 == 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = dev.stats();
    assert_eq!(st.fallback(Reason::ErrRtok).0, 1, "{st:?}");
    assert_eq!(st.conns_opened, 0, "{st:?}");
}

/// A client's early bytes make the server's descriptor readable, as any
/// write does: an event loop that polls `as_raw_fd` (mio, tokio) is woken
/// by the request. Before, the server moved them into its ring with no
/// doorbell: `poll` timed out while `read` found them.
#[test]
fn early_bytes_make_the_server_descriptor_readable() {
    let dir = Dir::new("hs");
    let l = SmcListener::bind_with("127.0.0.1:0", &dir.cfg()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut client = Peer::spawn(&dir.0, &["stall", &addr, "earlyfinish"], &[]);
    let (s, _) = l.accept().unwrap();
    assert_eq!(s.fallback_reason(), None, "fell back");
    assert_eq!(client.line(), "decided smc=1");
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, 2000) };
    let mut b = [0u8; 16];
    let got = (&s).read(&mut b).unwrap();
    assert_eq!(&b[..got], b"early");
    assert_eq!(
        n, 1,
        "the early bytes are in the ring but the descriptor is not readable"
    );
    let _ = client.child.kill();
}

/// With `channel_placed_by_caller` (the preload's swap puts the channel at
/// the program's number once the handshake decides), a client step that
/// returns undecided, here because the server stopped between connecting
/// to the client and answering, leaves the channel at smclo's high
/// numbers, not at a low one the program's own descriptors would skip
/// for as long as the connect stays pending. Before, it stayed where the
/// kernel put it.
#[test]
fn an_undecided_clients_channel_waits_at_a_high_number() {
    let dir = Dir::new("hs");
    let (mut peer, addr) = Peer::serve(&dir.0, "echo");
    let mut cfg = dir.cfg();
    cfg.channel_placed_by_caller = true;
    let dest: std::net::SocketAddr = addr.parse().unwrap();
    let (tcp, p) = raw_proposal(&dir.dev(), &cfg, dest);
    smclo::testing::sockaddr::connect(tcp.as_raw_fd(), dest).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut p = Pending::connect(p, deadline);
    // The server's connection to our rendezvous socket: the server then
    // waits for our DMB, a first contact's.
    let listener = p.wake().fd.expect("the rendezvous socket");
    let mut pfd = libc::pollfd {
        fd: listener,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 10_000) }, 1, "no server");
    let pid = peer.child.id() as i32;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let mut st = 0;
    // SAFETY: waitpid on our own child; reports it once stopped.
    unsafe { libc::waitpid(pid, &mut st, libc::WUNTRACED) };
    let step = p.poll(Until::Step(Instant::now() + Duration::from_millis(50)));
    assert!(
        matches!(step, Polled::Waiting(_)),
        "decided with the server stopped"
    );
    let chan = p.wake().fd.expect("the channel");
    assert_ne!(chan, listener, "the step took no connection");
    assert!(
        chan >= smclo::testing::fdnum::floor(),
        "the channel waits at {chan}, below {}",
        smclo::testing::fdnum::floor()
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let smclo::testing::handshake::Decision::Smc(e) = p.finish() else {
        panic!("the handshake fell back");
    };
    assert_eq!(peer.line(), "smc=1 reason=-");
    e.conn.shutdown_write().unwrap();
    drop(e);
    drop(tcp);
    peer.wait_ok();
}
