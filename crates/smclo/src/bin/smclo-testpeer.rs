//! `smclo-testpeer`: the other process in smclo's integration tests.
//!
//! A connection whose two ends are in one process is never upgraded (the
//! handshake declines self-connects), so every test of the handshake needs
//! a second process; this is it.
//!
//! ```text
//! smclo-testpeer serve ADDR WORKLOAD    listen (smclo), print "listening ADDR", serve one connection
//! smclo-testpeer connect ADDR WORKLOAD  connect (smclo) and run WORKLOAD
//! smclo-testpeer stall ADDR STAGE       propose, connect, print "stalled", then
//!                                       never answer the server (to be killed)
//! smclo-testpeer earlymissing ADDR      as `stopper ADDR`, but instead of stopping
//!                                       counts 5 early bytes it never sends
//! smclo-testpeer stopper ADDR           as `connect ADDR sink`, but stops itself
//!                                       (SIGSTOP) right after its connect
//!                                       returned, before it answers the server
//! smclo-testpeer churn N                start a server process, then open N
//!                                       connections to it one after the other,
//!                                       one byte each way on each; fails unless
//!                                       every end of every one is SMC-D
//! ```
//! STAGE says where the client stops: `noport` before it publishes its
//! source port, `nodmb` after (it never accepts the server's connection to
//! its rendezvous socket, so its DMB never arrives), `taken` once it took
//! the server's connection (it never passes its DMB on it), `noconfirm`
//! after it passed its DMB (it never reads the server's answer), `early`
//! after it wrote 5 early bytes into the TCP stream (it exits), and
//! `earlyfinish` the same, but it then follows the server's answer, prints
//! "decided smc=0|1" and holds the connection.
//! WORKLOAD is one of:
//! - `echo`: copy everything read back until EOF;
//! - `pollecho`: the same as a level-triggered event loop: non-blocking,
//!   one read per readability a `Poller` reports;
//! - `sink`: read until EOF, then write back the byte count and FNV-1a hash
//!   (16 bytes) and close;
//! - `source:N:SEED`: write N pseudo-random bytes (xorshift from SEED), then
//!   close;
//! - `hold`: write one byte, then wait forever (to be killed).
//!
//! Each side prints `smc=<0|1> reason=<NAME|->` after the handshake.

use smclo::api::{Event, Poller, SmcListener, SmcStream};
use smclo::config::Config;
use smclo::device::Device;
use smclo::testing::poller::Ready;
use smclo::testing::{handshake, sockaddr};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::ExitCode;

/// FNV-1a 64, for checksumming streams.
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

fn report(s: &SmcStream) {
    println!(
        "smc={} reason={}",
        s.is_smc() as u8,
        s.fallback_reason()
            .map_or("-".to_string(), |r| r.name().to_string())
    );
    let _ = io::stdout().flush();
}

fn run(mut s: SmcStream, workload: &str) -> io::Result<()> {
    report(&s);
    let mut parts = workload.split(':');
    match parts.next() {
        Some("echo") => {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    return Ok(());
                }
                s.write_all(&buf[..n])?;
            }
        }
        Some("pollecho") => poll_echo(&s),
        Some("sink") => sink(&s),
        Some("source") => {
            let n: u64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            let mut seed: u64 = parts
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
                .max(1);
            let mut left = n;
            let mut buf = vec![0u8; 61 * 1024 + 7];
            while left > 0 {
                let k = (left as usize).min(1 + (xorshift(&mut seed) as usize % buf.len()));
                for b in &mut buf[..k] {
                    *b = xorshift(&mut seed) as u8;
                }
                s.write_all(&buf[..k])?;
                left -= k as u64;
            }
            Ok(())
        }
        Some("hold") => {
            s.write_all(b"h")?;
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unknown workload {workload:?}"),
        )),
    }
}

/// Reads until EOF, then writes back the byte count and FNV-1a hash.
fn sink(mut s: impl Read + Write) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    let (mut n, mut h) = (0u64, 0xcbf29ce484222325u64);
    loop {
        let k = s.read(&mut buf)?;
        if k == 0 {
            break;
        }
        fnv(&mut h, &buf[..k]);
        n += k as u64;
    }
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(&h.to_le_bytes());
    s.write_all(&out)
}

/// A connection whose handshake this program ran itself.
enum Ends {
    /// Through shared memory; the TCP connection only for identity (it
    /// closes after the SMC-D end).
    Smc {
        smc: Box<handshake::Established>,
        _tcp: TcpStream,
    },
    Tcp(TcpStream),
}

impl Read for &Ends {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Ends::Smc { smc, .. } => smc.conn.read(buf),
            Ends::Tcp(t) => (&*t).read(buf),
        }
    }
}

impl Write for &Ends {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Ends::Smc { smc, .. } => smc.conn.write(buf),
            Ends::Tcp(t) => (&*t).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What a [`stopper`] does between its connect and its answer.
#[derive(Clone, Copy, PartialEq)]
enum Pause {
    /// Stops itself (SIGSTOP).
    Stop,
    /// Counts 5 early bytes and never sends them (a client descheduled
    /// between the two, for good).
    EarlyMissing,
}

/// `stopper ADDR` (`earlymissing ADDR`): proposes and connects, stops
/// itself (SIGSTOP) before it answers the server (counts early bytes it
/// never sends), and once continued (SIGCONT) finishes the handshake,
/// prints `smc=<0|1> reason=<NAME|->` and runs `sink`.
fn stopper(addr: &str, pause: Pause) -> io::Result<()> {
    let cfg = Config::from_env().map_err(io::Error::from)?;
    let dev = Device::open(&cfg.device_dir).map_err(io::Error::from)?;
    let dest: SocketAddr = addr
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
    let tcp = TcpStream::from(socket_for(dest)?);
    let mut p = handshake::client_propose(&dev, &cfg, tcp.as_raw_fd(), dest)
        .map_err(|r| io::Error::other(format!("no proposal: {}", r.name())))?;
    sockaddr::connect(tcp.as_raw_fd(), dest)?;
    p.syn_sent();
    match pause {
        Pause::Stop => {
            // SAFETY: raise(2) with a constant signal; the process stops here.
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        Pause::EarlyMissing => {
            if !p.add_early(5) {
                return Err(io::Error::other("the early bytes were not counted"));
            }
        }
    }
    let deadline = std::time::Instant::now() + cfg.clc_wait;
    let (ends, reason) = match handshake::Pending::connect(p, deadline).finish() {
        handshake::Decision::Smc(smc) => (
            Ends::Smc {
                smc: Box::new(smc),
                _tcp: tcp,
            },
            None,
        ),
        handshake::Decision::Tcp(r) => (Ends::Tcp(tcp), Some(r)),
    };
    println!(
        "smc={} reason={}",
        reason.is_none() as u8,
        reason.map_or("-", |r| r.name())
    );
    io::stdout().flush()?;
    sink(&ends)
}

/// A client that proposes and connects, then stops servicing the
/// handshake: what a stopped or descheduled smclo client looks like to the
/// server's `accept`.
fn stall(addr: &str, stage: &str) -> io::Result<()> {
    let cfg = Config::from_env().map_err(io::Error::from)?;
    let dev = Device::open(&cfg.device_dir).map_err(io::Error::from)?;
    let dest: SocketAddr = addr
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
    let tcp = TcpStream::from(socket_for(dest)?);
    let mut p = handshake::client_propose(&dev, &cfg, tcp.as_raw_fd(), dest)
        .map_err(|r| io::Error::other(format!("no proposal: {}", r.name())))?;
    sockaddr::connect(tcp.as_raw_fd(), dest)?;
    if stage != "noport" {
        p.syn_sent();
    }
    if stage == "early" {
        // Early bytes in the stream, then gone without withdrawing (as if
        // killed): the server must still get them.
        if !p.add_early(5) {
            return Err(io::Error::other("the early bytes were not counted"));
        }
        (&tcp).write_all(b"early")?;
        println!("stalled");
        io::stdout().flush()?;
        std::process::exit(0);
    }
    if stage == "earlyfinish" {
        // Early bytes, then the client follows the server's answer and
        // holds the connection (until killed).
        if !p.add_early(5) {
            return Err(io::Error::other("the early bytes were not counted"));
        }
        (&tcp).write_all(b"early")?;
        let deadline = std::time::Instant::now() + cfg.clc_wait;
        let d = handshake::Pending::connect(p, deadline).finish();
        println!(
            "decided smc={}",
            matches!(d, handshake::Decision::Smc(_)) as u8
        );
        io::stdout().flush()?;
        std::thread::sleep(std::time::Duration::from_secs(5));
        drop(d);
        return Ok(());
    }
    let wait = std::time::Duration::from_secs(10);
    let chan = match stage {
        "noconfirm" => Some(p.pass_dmb_and_stop(wait)),
        "taken" => Some(p.take_channel_and_stop(wait)),
        _ => None,
    };
    let _chan = match chan {
        Some(c) => Some(c.ok_or_else(|| io::Error::other("the server did not connect"))?),
        None => None,
    };
    println!("stalled");
    io::stdout().flush()?;
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// `churn N`: the client side, which starts the server (`churn-serve N`).
fn churn(n: u32) -> io::Result<()> {
    use std::io::BufRead;
    let mut server = std::process::Command::new(std::env::current_exe()?)
        .args(["churn-serve", &n.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    io::BufReader::new(server.stdout.take().expect("piped")).read_line(&mut line)?;
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .unwrap_or("")
        .to_string();
    for _ in 0..n {
        let mut s = SmcStream::connect(&addr)?;
        if !s.is_smc() {
            return Err(io::Error::other(format!(
                "fell back: {:?}",
                s.fallback_reason()
            )));
        }
        let mut b = [7u8];
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
    }
    if !server.wait()?.success() {
        return Err(io::Error::other("the churn server failed"));
    }
    println!("ok");
    Ok(())
}

/// `churn-serve N`: accepts N connections, echoing one byte on each.
fn churn_serve(n: u32) -> io::Result<()> {
    let l = SmcListener::bind("127.0.0.1:0")?;
    println!("listening {}", l.local_addr()?);
    io::stdout().flush()?;
    for _ in 0..n {
        let (mut s, _) = l.accept()?;
        if !s.is_smc() {
            return Err(io::Error::other(format!(
                "fell back: {:?}",
                s.fallback_reason()
            )));
        }
        let mut b = [0u8];
        s.read_exact(&mut b)?;
        s.write_all(&b)?;
    }
    Ok(())
}

fn socket_for(dest: SocketAddr) -> io::Result<OwnedFd> {
    let family = if dest.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2) with constant arguments; the result is checked and
    // owned right away.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `echo` as a level-triggered event loop does it: non-blocking, one read
/// per readability a `Poller` reports (and a wait for writability when
/// the peer's ring is full).
fn poll_echo(s: &SmcStream) -> io::Result<()> {
    fn wait<'a>(
        p: &mut Poller<'a>,
        s: &'a SmcStream,
        ev: &mut Vec<Event>,
        want: Ready,
    ) -> io::Result<()> {
        p.add(s, 0, want);
        match p.wait(ev, None) {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => Err(e),
            _ => Ok(()),
        }
    }
    s.set_nonblocking(true)?;
    let mut p = Poller::new();
    let mut ev = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        wait(&mut p, s, &mut ev, Ready::IN)?;
        let n = match (&*s).read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        let mut done = 0;
        while done < n {
            match (&*s).write(&buf[done..n]) {
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait(&mut p, s, &mut ev, Ready::OUT)?
                }
                Err(e) => return Err(e),
            }
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve", addr, workload] => SmcListener::bind(addr).and_then(|l| {
            println!("listening {}", l.local_addr()?);
            io::stdout().flush()?;
            let (s, _) = l.accept()?;
            run(s, workload)
        }),
        ["connect", addr, workload] => SmcStream::connect(addr).and_then(|s| run(s, workload)),
        ["stall", addr, stage @ ("noport" | "nodmb" | "taken" | "noconfirm" | "early" | "earlyfinish")] => {
            stall(addr, stage)
        }
        ["stopper", addr] => stopper(addr, Pause::Stop),
        ["earlymissing", addr] => stopper(addr, Pause::EarlyMissing),
        ["churn", n] => n.parse().map_err(io::Error::other).and_then(churn),
        ["churn-serve", n] => n.parse().map_err(io::Error::other).and_then(churn_serve),
        _ => {
            eprintln!("usage: smclo-testpeer serve|connect ADDR echo|sink|source:N:SEED|hold");
            eprintln!(
                "       smclo-testpeer stall ADDR noport|nodmb|taken|noconfirm|early|earlyfinish"
            );
            eprintln!("       smclo-testpeer stopper|earlymissing ADDR");
            eprintln!("       smclo-testpeer churn N");
            return ExitCode::from(2);
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("smclo-testpeer: {e}");
            ExitCode::FAILURE
        }
    }
}
