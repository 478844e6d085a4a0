//! Micro-benchmark of the connection data path against a UNIX socketpair
//! and TCP loopback: ping-pong latency (14 B) and streaming (64000 B
//! writes), the two processes pinned to different CPUs.
//!
//! ```text
//! cargo run --release -p smclo --example conn_bench [-- ROUNDS SECONDS]
//! SMCLO_SPIN_US=0 cargo run --release -p smclo --example conn_bench   # no spinning
//! ```
//!
//! This is a tuning aid for the data path; the product's benchmark is
//! `smclo bench`.

use smclo::conn::{Conn, Mode};
use smclo::dmb::{memfd, Dmb};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// What both benchmarks need from a transport.
trait Io {
    fn rd(&mut self, b: &mut [u8]) -> usize;
    fn wr(&mut self, b: &[u8]);
    /// Half-close: the reader sees end of stream.
    fn fin(&mut self);
}

impl Io for Conn {
    fn rd(&mut self, b: &mut [u8]) -> usize {
        self.read(b).unwrap()
    }
    fn wr(&mut self, b: &[u8]) {
        assert_eq!(self.write(b).unwrap(), b.len());
    }
    fn fin(&mut self) {
        self.shutdown_write().unwrap()
    }
}

impl Io for UnixStream {
    fn rd(&mut self, b: &mut [u8]) -> usize {
        self.read(b).unwrap()
    }
    fn wr(&mut self, b: &[u8]) {
        self.write_all(b).unwrap()
    }
    fn fin(&mut self) {
        self.shutdown(std::net::Shutdown::Write).unwrap()
    }
}

impl Io for TcpStream {
    fn rd(&mut self, b: &mut [u8]) -> usize {
        self.read(b).unwrap()
    }
    fn wr(&mut self, b: &[u8]) {
        self.write_all(b).unwrap()
    }
    fn fin(&mut self) {
        self.shutdown(std::net::Shutdown::Write).unwrap()
    }
}

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn read_exact(io: &mut dyn Io, b: &mut [u8]) {
    let mut got = 0;
    while got < b.len() {
        let n = io.rd(&mut b[got..]);
        assert!(n > 0, "unexpected end of stream");
        got += n;
    }
}

/// Runs `server` in a forked child pinned to CPU 1 and `client` here on
/// CPU 0; returns the client's result.
fn fork_run<A: Io, B: Io, R>(a: A, b: B, client: impl FnOnce(A) -> R, server: impl FnOnce(B)) -> R {
    // SAFETY: the child runs `server` and _exits; it touches no state
    // shared with other threads of this (single-threaded) program.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        std::mem::forget(a);
        pin(1);
        server(b);
        // SAFETY: leave without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    std::mem::forget(b); // the child's end; its descriptor dies with us
    pin(0);
    let r = client(a);
    let mut st = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    r
}

/// Mean round trip of `rounds` 14-byte ping-pongs, in microseconds.
fn ping_pong<A: Io, B: Io>(a: A, b: B, rounds: u32) -> f64 {
    fork_run(
        a,
        b,
        |mut a| {
            let mut m = [7u8; 14];
            for _ in 0..rounds / 10 {
                a.wr(&m);
                read_exact(&mut a, &mut m);
            }
            let t = Instant::now();
            for _ in 0..rounds {
                a.wr(&m);
                read_exact(&mut a, &mut m);
            }
            t.elapsed().as_secs_f64() * 1e6 / rounds as f64
        },
        |mut b| {
            let mut m = [0u8; 14];
            for _ in 0..rounds + rounds / 10 {
                read_exact(&mut b, &mut m);
                b.wr(&m);
            }
        },
    )
}

/// Streaming 64000-byte writes for `secs`; returns Gbit/s seen by the reader.
fn stream<A: Io, B: Io>(a: A, b: B, secs: f64) -> f64 {
    // The writer (child) writes for `secs`, then half-closes; the reader
    // (parent) counts until end of stream.
    let msg = 64000usize;
    fork_run(
        a,
        b,
        move |mut a| {
            let mut buf = vec![0u8; msg];
            let mut total = 0u64;
            let t = Instant::now();
            loop {
                let n = a.rd(&mut buf);
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            total as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9
        },
        move |mut b| {
            let buf = vec![1u8; msg];
            let end = Instant::now() + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                for _ in 0..16 {
                    b.wr(&buf);
                }
            }
            b.fin();
        },
    )
}

fn conn_pair(ring: u32, mode: Mode) -> (Conn, Conn) {
    let fa = memfd("bench-a").unwrap();
    let fb = memfd("bench-b").unwrap();
    let da = Dmb::create(&fa, 1, ring, 0, 0, 0).unwrap();
    let db = Dmb::create(&fb, 2, ring, 0, 0, 0).unwrap();
    let pa = Dmb::attach(&fa, 1, 0).unwrap();
    let pb = Dmb::attach(&fb, 2, 0).unwrap();
    let (ua, ub) = UnixStream::pair().unwrap();
    (
        Conn::new(da, pb, ua, mode).unwrap(),
        Conn::new(db, pa, ub, mode).unwrap(),
    )
}

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: u32 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let secs: f64 = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(2.0);
    let ring: u32 = std::env::var("BENCH_RING")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256 * 1024);
    println!(
        "spin budget {:?}, ring {} KiB, {rounds} ping-pongs, {secs} s streams",
        smclo::conn::spin_budget(),
        ring / 1024
    );
    println!(
        "{:<22} {:>14} {:>16}",
        "transport", "14 B RTT (us)", "64000 B (Gbit/s)"
    );
    let row = |name: &str, rtt: f64, gbps: f64| println!("{name:<22} {rtt:>14.2} {gbps:>16.2}");
    // BENCH_ONLY=smclo skips the kernel transports (e.g. under strace).
    let only_smclo = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "smclo");
    {
        let (a, b) = conn_pair(ring, Mode::NoCopy);
        let rtt = ping_pong(a, b, rounds);
        let (a, b) = conn_pair(ring, Mode::NoCopy);
        let g = stream(a, b, secs);
        row("smclo no-copy", rtt, g);
    }
    {
        let (a, b) = conn_pair(ring, Mode::Copy { sndbuf_len: ring });
        let rtt = ping_pong(a, b, rounds);
        let (a, b) = conn_pair(ring, Mode::Copy { sndbuf_len: ring });
        let g = stream(a, b, secs);
        row("smclo copy", rtt, g);
    }
    if only_smclo {
        return;
    }
    {
        let (a, b) = UnixStream::pair().unwrap();
        let rtt = ping_pong(a, b, rounds);
        let (a, b) = UnixStream::pair().unwrap();
        let g = stream(a, b, secs);
        row("unix socketpair", rtt, g);
    }
    {
        let (a, b) = tcp_pair();
        let rtt = ping_pong(a, b, rounds);
        let (a, b) = tcp_pair();
        let g = stream(a, b, secs);
        row("tcp loopback", rtt, g);
    }
}
