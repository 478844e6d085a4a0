//! `smclo bench`: the seeds' workloads over TCP loopback, a UNIX socket,
//! smclo (no-copy and copy) and, where the kernel has it, the kernel's own
//! SMC-D loopback, side by side in one run.
//!
//! The hidden `__peer` and `__client` subcommands are also the workload
//! programs of `scripts/bench-suite`, which runs them under `smclo run`
//! beside the real programs of the seeds (sockperf, iperf3, nginx, redis).
//!
//! Each measurement runs the server in a separate process (this binary,
//! re-executed with a hidden subcommand) pinned to one core and the client
//! pinned to the other. Transports are interleaved within every round, so a
//! noisy neighbour hurts all of them alike; the table shows the median of the
//! rounds and the ratio to TCP.

use smclo::api::{SmcListener, SmcStream};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PING_SIZE: usize = 14;
const STREAM_SIZE: usize = 64000;
/// ipc-bench's message size in the seeds (`-s 100`).
const MSG_SIZE: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    Tcp,
    Unix,
    Smclo,
    SmcloCopy,
    /// The `tcp` code, unchanged, with both processes started under
    /// `smclo run`: what an unmodified program gets.
    SmcloRun,
    /// The kernel's SMC (`socket(AF_SMC)`), which uses its loopback-ism
    /// device between local processes.
    KernelSmc,
}

impl Transport {
    const ALL: [Transport; 6] = [
        Transport::Tcp,
        Transport::Unix,
        Transport::Smclo,
        Transport::SmcloCopy,
        Transport::SmcloRun,
        Transport::KernelSmc,
    ];
    fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Unix => "unix",
            Transport::Smclo => "smclo",
            Transport::SmcloCopy => "smclo-copy",
            Transport::SmcloRun => "tcp+smclo-run",
            Transport::KernelSmc => "kernel-smc",
        }
    }

    /// The code the processes run: `tcp+smclo-run` runs the TCP code.
    fn code(self) -> Transport {
        if self == Transport::SmcloRun {
            Transport::Tcp
        } else {
            self
        }
    }
    fn from_name(s: &str) -> Option<Transport> {
        Transport::ALL.into_iter().find(|t| t.name() == s)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Workload {
    PingPong,
    /// ipc-bench's message rate: 100-byte ping-pong messages.
    MsgRate,
    Stream,
    Setup,
    /// Many idle connections held open; the memory they cost is read from
    /// outside the processes (`scripts/bench-suite`), so it is not a
    /// workload of `smclo bench`'s own table.
    Idle,
}

impl Workload {
    const ALL: [Workload; 5] = [
        Workload::PingPong,
        Workload::MsgRate,
        Workload::Stream,
        Workload::Setup,
        Workload::Idle,
    ];
    /// The workloads of `smclo bench`'s own table.
    const TABLE: [Workload; 4] = [
        Workload::PingPong,
        Workload::MsgRate,
        Workload::Stream,
        Workload::Setup,
    ];
    fn name(self) -> &'static str {
        match self {
            Workload::PingPong => "pingpong",
            Workload::MsgRate => "msgrate",
            Workload::Stream => "stream",
            Workload::Setup => "setup",
            Workload::Idle => "idle",
        }
    }
    fn from_name(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name() == s)
    }
    fn from_table_name(s: &str) -> Option<Workload> {
        Workload::TABLE.into_iter().find(|w| w.name() == s)
    }
    /// What the table shows, and whether more is better.
    fn metric(self) -> (&'static str, bool) {
        match self {
            Workload::PingPong => ("round trip, µs (14 B each way)", false),
            Workload::MsgRate => ("messages/s (100 B ping-pong)", true),
            Workload::Stream => ("throughput, Gbit/s (64000 B writes)", true),
            Workload::Setup => ("connections/s (connect+accept+first byte)", true),
            Workload::Idle => ("idle connections held", true),
        }
    }
}

/// One measurement: the workload's metric, plus what the suite also reports
/// (`ops`: round trips, bytes or connections; latency percentiles).
struct Sample {
    value: f64,
    extra: Vec<(&'static str, f64)>,
}

/// A byte stream that can half-close, whatever the transport.
trait Duplex: Read + Write {
    fn shutdown_write(&self) -> io::Result<()>;
}

impl Duplex for TcpStream {
    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Duplex for UnixStream {
    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Duplex for SmcStream {
    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

struct Options {
    rounds: usize,
    seconds: f64,
    json: bool,
    workloads: Vec<Workload>,
    transports: Vec<Transport>,
}

fn usage() -> i32 {
    eprintln!(
        "usage: smclo bench [--rounds N] [--seconds S] [--json] [--workloads pingpong,msgrate,stream,setup]\n\
         \x20                  [--transports tcp,unix,smclo,smclo-copy,tcp+smclo-run,kernel-smc]\n\
         Runs each workload over each transport, interleaved, N rounds (default 5) of S seconds (default 1),\n\
         server and client in separate processes pinned to different cores; prints medians and ratios to TCP.\n\
         kernel-smc (the kernel's SMC-D loopback, socket(AF_SMC)) is included when the kernel offers it.\n\
         The seeds' full suite with real programs (sockperf, iperf3, nginx, redis): scripts/bench-suite"
    );
    2
}

fn parse_list<T>(v: &str, f: fn(&str) -> Option<T>) -> Option<Vec<T>> {
    v.split(',').map(|s| f(s.trim())).collect()
}

/// Entry point of `smclo bench`.
pub fn main(args: &[String]) -> i32 {
    if args.first().map(String::as_str) == Some("__peer") {
        return match peer_main(&args[1..]) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("smclo bench peer: {e}");
                1
            }
        };
    }
    if args.first().map(String::as_str) == Some("__kernel-smc") {
        // For scripts/bench-suite: one definition of "the kernel offers it".
        return match crate::kernel_smc::availability() {
            Ok(()) => {
                println!("available");
                0
            }
            Err(why) => {
                println!("{why}");
                1
            }
        };
    }
    if args.first().map(String::as_str) == Some("__client") {
        return match client_main(&args[1..]) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("smclo bench client: {e}");
                1
            }
        };
    }
    let kernel_smc = crate::kernel_smc::availability();
    let mut o = Options {
        rounds: 5,
        seconds: 1.0,
        json: false,
        workloads: Workload::TABLE.to_vec(),
        transports: Transport::ALL
            .into_iter()
            .filter(|&t| t != Transport::KernelSmc || kernel_smc.is_ok())
            .collect(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let ok = match a.as_str() {
            "--json" => {
                o.json = true;
                true
            }
            "--rounds" => it
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|&n: &usize| n >= 1)
                .map(|n| o.rounds = n)
                .is_some(),
            "--seconds" => it
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|&s: &f64| s > 0.0 && s <= 60.0)
                .map(|s| o.seconds = s)
                .is_some(),
            "--workloads" => it
                .next()
                .and_then(|v| parse_list(v, Workload::from_table_name))
                .map(|w| o.workloads = w)
                .is_some(),
            "--transports" => it
                .next()
                .and_then(|v| parse_list(v, Transport::from_name))
                .map(|t| o.transports = t)
                .is_some(),
            "-h" | "--help" => return usage().min(0),
            _ => false,
        };
        if !ok {
            eprintln!("smclo bench: bad argument {a:?}");
            return usage();
        }
    }
    if o.transports.contains(&Transport::KernelSmc) {
        if let Err(why) = &kernel_smc {
            eprintln!("smclo bench: kernel-smc is unavailable: {why}");
            return 1;
        }
    }
    match run(&o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("smclo bench: {e}");
            1
        }
    }
}

/// A private device directory for the benchmark, removed afterwards.
struct BenchDevice(PathBuf);

impl Drop for BenchDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(o: &Options) -> io::Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (client_cpu, server_cpu) = if cores >= 2 {
        (Some(0), Some(1))
    } else {
        (None, None)
    };
    let dev = BenchDevice(std::env::temp_dir().join(format!("smclo-bench-{}", std::process::id())));
    // /dev/shm is where DMBs belong; use it when present.
    let dev = if Path::new("/dev/shm").is_dir() {
        BenchDevice(PathBuf::from(format!(
            "/dev/shm/smclo-bench-{}",
            std::process::id()
        )))
    } else {
        dev
    };
    let copy_dev = BenchDevice(PathBuf::from(format!("{}-copy", dev.0.display())));
    smclo::device::Device::open(&copy_dev.0)
        .map_err(io::Error::from)?
        .set_dmb_copy(true);
    smclo::device::Device::open(&dev.0).map_err(io::Error::from)?;
    // results[workload][transport] = samples
    let mut results = vec![vec![Vec::new(); o.transports.len()]; o.workloads.len()];
    for round in 0..o.rounds {
        for (wi, &w) in o.workloads.iter().enumerate() {
            for (ti, &t) in o.transports.iter().enumerate() {
                let dir = if t == Transport::SmcloCopy {
                    &copy_dev.0
                } else {
                    &dev.0
                };
                let v = measure(t, w, o.seconds, dir, client_cpu, server_cpu)?;
                if !o.json {
                    eprint!(
                        "\rround {}/{} {:>8} {:>10}: {:>10.2}   ",
                        round + 1,
                        o.rounds,
                        w.name(),
                        t.name(),
                        v
                    );
                }
                results[wi][ti].push(v);
            }
        }
    }
    if !o.json {
        eprintln!();
    }
    print_results(o, &results, client_cpu, server_cpu, &dev.0);
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn print_results(
    o: &Options,
    results: &[Vec<Vec<f64>>],
    ccpu: Option<usize>,
    scpu: Option<usize>,
    dev: &Path,
) {
    let tcp_i = o.transports.iter().position(|&t| t == Transport::Tcp);
    if o.json {
        let mut out = String::from("{");
        out += &format!(
            "\"rounds\":{},\"seconds\":{},\"client_cpu\":{},\"server_cpu\":{},\"results\":{{",
            o.rounds,
            o.seconds,
            ccpu.map_or("null".into(), |c| c.to_string()),
            scpu.map_or("null".into(), |c| c.to_string())
        );
        for (wi, w) in o.workloads.iter().enumerate() {
            if wi > 0 {
                out.push(',');
            }
            out += &format!("\"{}\":{{\"unit\":\"{}\",", w.name(), w.metric().0);
            for (ti, t) in o.transports.iter().enumerate() {
                if ti > 0 {
                    out.push(',');
                }
                let m = median(&results[wi][ti]);
                let ratio = tcp_i.map(|i| m / median(&results[wi][i]));
                let samples: Vec<String> =
                    results[wi][ti].iter().map(|v| format!("{v:.3}")).collect();
                out += &format!(
                    "\"{}\":{{\"median\":{m:.3},\"vs_tcp\":{},\"samples\":[{}]}}",
                    t.name(),
                    ratio.map_or("null".into(), |r| format!("{r:.3}")),
                    samples.join(",")
                );
            }
            out.push('}');
        }
        out += "}}";
        println!("{out}");
        return;
    }
    println!(
        "smclo bench: median of {} rounds of {} s; client on CPU {}, server on CPU {}; transports interleaved in each round",
        o.rounds,
        o.seconds,
        ccpu.map_or("any".into(), |c| c.to_string()),
        scpu.map_or("any".into(), |c| c.to_string())
    );
    let _ = dev;
    println!();
    print!("| workload | metric |");
    for t in &o.transports {
        print!(" {} |", t.name());
    }
    println!();
    print!("| --- | --- |");
    for _ in &o.transports {
        print!(" --- |");
    }
    println!();
    for (wi, w) in o.workloads.iter().enumerate() {
        let (metric, _) = w.metric();
        print!("| {} | {} |", w.name(), metric);
        let tcp = tcp_i.map(|i| median(&results[wi][i]));
        for (t_kind, samples) in o.transports.iter().zip(&results[wi]) {
            let m = median(samples);
            match tcp {
                Some(t) if *t_kind != Transport::Tcp => {
                    print!(" {} ({:.2}× TCP) |", fmt_val(m), m / t)
                }
                _ => print!(" {} |", fmt_val(m)),
            }
        }
        println!();
    }
}

fn fmt_val(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn pin(cpu: Option<usize>) {
    if let Some(c) = cpu {
        // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it; the
        // affinity call only reads it. Failure (e.g. in a restricted cpuset)
        // leaves the process unpinned, which the table header would misstate,
        // so it is reported.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(c, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                eprintln!(
                    "smclo bench: cannot pin to CPU {c}: {}",
                    io::Error::last_os_error()
                );
            }
        }
    }
}

struct Peer {
    child: Child,
    addr: String,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This binary, re-executed with `args`, under `smclo run` for
/// `tcp+smclo-run`.
fn bench_command(t: Transport, args: &[&str], dir: &Path) -> io::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("bench").args(args).env("SMCLO_DEVICE_DIR", dir);
    if t == Transport::SmcloRun {
        let lib = crate::run::find_build(smclo_loader::Variant::Glibc).map_err(io::Error::other)?;
        // Every connection through shared memory, the setup workload's
        // short ones too: what is measured is the transport.
        cmd.env("LD_PRELOAD", lib).env("SMCLO_SHORT", "smc");
    }
    Ok(cmd)
}

fn cpu_arg(cpu: Option<usize>) -> String {
    cpu.map_or("-1".into(), |c| c.to_string())
}

fn spawn_peer(t: Transport, w: Workload, dir: &Path, cpu: Option<usize>) -> io::Result<Peer> {
    let mut cmd = bench_command(
        t,
        &["__peer", t.code().name(), w.name(), &cpu_arg(cpu)],
        dir,
    )?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let addr = line.trim().to_string();
    if addr.is_empty() {
        let _ = child.kill();
        return Err(io::Error::other(format!(
            "{} server for {} did not start",
            t.name(),
            w.name()
        )));
    }
    Ok(Peer { child, addr })
}

fn connect(t: Transport, addr: &str) -> io::Result<Box<dyn Duplex>> {
    Ok(match t {
        Transport::Tcp | Transport::SmcloRun => {
            let s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            Box::new(s)
        }
        Transport::Unix => Box::new(UnixStream::connect(addr)?),
        Transport::Smclo | Transport::SmcloCopy => {
            let s = SmcStream::connect(addr)?;
            if !s.is_smc() {
                return Err(io::Error::other(format!(
                    "smclo connection fell back to TCP: {:?}",
                    s.fallback_reason()
                )));
            }
            s.set_nodelay(true)?;
            Box::new(s)
        }
        Transport::KernelSmc => {
            let a = addr
                .parse()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
            let s = crate::kernel_smc::connect(a)?;
            // SMC passes TCP options to its TCP socket; without SMC-D it
            // would matter, with it it is harmless.
            let _ = s.set_nodelay(true);
            Box::new(s)
        }
    })
}

/// Runs one measurement; returns the workload's metric.
fn measure(
    t: Transport,
    w: Workload,
    seconds: f64,
    dir: &Path,
    ccpu: Option<usize>,
    scpu: Option<usize>,
) -> io::Result<f64> {
    let peer = spawn_peer(t, w, dir, scpu)?;
    if t != Transport::SmcloRun {
        // The client runs in this process; SmcStream reads the device
        // directory from the environment.
        std::env::set_var("SMCLO_DEVICE_DIR", dir);
        pin(ccpu);
        let v = client(t, w, &peer.addr, seconds)?.value;
        drop(peer);
        return Ok(v);
    }
    // Under smclo run the client is a process of its own, like the server.
    // The device counters prove that its connections were accelerated.
    let dev = smclo::device::Device::open(dir).map_err(io::Error::from)?;
    let before = dev.stats();
    let secs = seconds.to_string();
    let out = bench_command(
        t,
        &[
            "__client",
            t.code().name(),
            w.name(),
            &peer.addr,
            &secs,
            &cpu_arg(ccpu),
        ],
        dir,
    )?
    .stdin(Stdio::null())
    .stderr(Stdio::inherit())
    .output()?;
    drop(peer);
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("");
    let v: f64 = first.trim().parse().map_err(|_| {
        io::Error::other(format!(
            "{} client said {text:?} ({})",
            t.name(),
            out.status
        ))
    })?;
    let after = dev.stats();
    if after.conns_opened == before.conns_opened
        || after.fallbacks_total() != before.fallbacks_total()
    {
        return Err(io::Error::other(format!(
            "{}: the device shows {} new connections and {} new fallbacks: not accelerated",
            t.name(),
            after.conns_opened - before.conns_opened,
            after.fallbacks_total() - before.fallbacks_total()
        )));
    }
    Ok(v)
}

/// `smclo bench __client TRANSPORT WORKLOAD ADDR SECONDS CPU`: the client
/// side in a process of its own. Prints the metric on the first line, then
/// one `name value` line for each extra (`ops`, latency percentiles).
///
/// For `idle`, SECONDS is the number of connections, and the client talks
/// with whoever started it: it opens one connection and prints `base`, waits
/// for a line on standard input, opens the others (one byte each way on
/// every one, so that each is fully set up), prints `ready N`, and holds
/// them until standard input ends. The caller reads the processes' memory
/// at `base` and at `ready`.
fn client_main(args: &[String]) -> io::Result<()> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "usage: smclo bench __client TRANSPORT WORKLOAD ADDR SECONDS CPU",
        )
    };
    let t = args
        .first()
        .and_then(|s| Transport::from_name(s))
        .ok_or_else(bad)?;
    let w = args
        .get(1)
        .and_then(|s| Workload::from_name(s))
        .ok_or_else(bad)?;
    let addr = args.get(2).ok_or_else(bad)?;
    let seconds: f64 = args.get(3).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let cpu: i64 = args.get(4).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    pin(usize::try_from(cpu).ok());
    if w == Workload::Idle {
        return idle_client(t, addr, seconds as usize);
    }
    let sample = client(t, w, addr, seconds)?;
    let mut out = format!("{}\n", sample.value);
    for (name, v) in &sample.extra {
        out += &format!("{name} {v}\n");
    }
    io::stdout().write_all(out.as_bytes())
}

/// Raises the soft limit on open descriptors to the hard limit, for the
/// idle workload's many connections (each smclo connection also holds a
/// few descriptors of its own).
fn raise_nofile_limit() {
    // SAFETY: getrlimit/setrlimit read and write a plain struct we own.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn idle_client(t: Transport, addr: &str, n: usize) -> io::Result<()> {
    raise_nofile_limit();
    let open = || -> io::Result<Box<dyn Duplex>> {
        let mut s = connect(t, addr)?;
        let mut b = [1u8; 1];
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
        Ok(s)
    };
    let first = open()?;
    let mut out = io::stdout();
    let mut line = String::new();
    writeln!(out, "base")?;
    out.flush()?;
    io::stdin().read_line(&mut line)?;
    let mut held = Vec::with_capacity(n + 1);
    held.push(first);
    for _ in 0..n {
        held.push(open()?);
    }
    writeln!(out, "ready {n}")?;
    out.flush()?;
    io::copy(&mut io::stdin(), &mut io::sink())?;
    Ok(())
}

/// Exact percentile (nearest rank) of sorted nanosecond samples, in µs.
fn percentile_us(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
}

/// Ping-pong of `size`-byte messages for `dur`; returns the round-trip times
/// in nanoseconds.
fn ping_pong(s: &mut dyn Duplex, size: usize, dur: Duration) -> io::Result<Vec<u64>> {
    let mut buf = vec![0u8; size];
    // Warm up, then measure.
    for _ in 0..1000 {
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
    }
    let mut rtts = Vec::with_capacity(1 << 20);
    let start = Instant::now();
    let mut last = start;
    while last.duration_since(start) < dur {
        for _ in 0..100 {
            s.write_all(&buf)?;
            s.read_exact(&mut buf)?;
            let now = Instant::now();
            rtts.push(now.duration_since(last).as_nanos() as u64);
            last = now;
        }
    }
    Ok(rtts)
}

/// The client side of workload `w` over transport `t`.
fn client(t: Transport, w: Workload, addr: &str, seconds: f64) -> io::Result<Sample> {
    let dur = Duration::from_secs_f64(seconds);
    let sample = match w {
        Workload::PingPong => {
            let mut s = connect(t, addr)?;
            let mut rtts = ping_pong(&mut *s, PING_SIZE, dur)?;
            let n = rtts.len();
            let mean = rtts.iter().sum::<u64>() as f64 / n as f64 / 1000.0;
            rtts.sort_unstable();
            Sample {
                value: mean,
                extra: vec![
                    ("ops", n as f64),
                    ("rtt_p50_us", percentile_us(&rtts, 50.0)),
                    ("rtt_p99_us", percentile_us(&rtts, 99.0)),
                    ("rtt_p999_us", percentile_us(&rtts, 99.9)),
                ],
            }
        }
        Workload::MsgRate => {
            let mut s = connect(t, addr)?;
            let rtts = ping_pong(&mut *s, MSG_SIZE, dur)?;
            let n = rtts.len();
            let secs = rtts.iter().sum::<u64>() as f64 / 1e9;
            Sample {
                value: n as f64 / secs,
                extra: vec![("ops", n as f64)],
            }
        }
        Workload::Stream => {
            let mut s = connect(t, addr)?;
            let buf = vec![0x5au8; STREAM_SIZE];
            let start = Instant::now();
            let mut sent = 0u64;
            while start.elapsed() < dur {
                for _ in 0..16 {
                    s.write_all(&buf)?;
                }
                sent += 16 * STREAM_SIZE as u64;
            }
            // The server answers with its byte count once it has read
            // everything: the clock stops when the data has arrived.
            s.shutdown_write()?;
            let mut ack = [0u8; 8];
            s.read_exact(&mut ack)?;
            let secs = start.elapsed().as_secs_f64();
            let got = u64::from_le_bytes(ack);
            if got != sent {
                return Err(io::Error::other(format!(
                    "{}: sent {sent} bytes, server got {got}",
                    t.name()
                )));
            }
            Sample {
                value: sent as f64 * 8.0 / secs / 1e9,
                extra: vec![("ops", sent as f64)],
            }
        }
        Workload::Setup => {
            let start = Instant::now();
            let mut n = 0u64;
            let mut b = [7u8; 1];
            while start.elapsed() < dur {
                let mut s = connect(t, addr)?;
                s.write_all(&b)?;
                s.read_exact(&mut b)?;
                n += 1;
            }
            Sample {
                value: n as f64 / start.elapsed().as_secs_f64(),
                extra: vec![("ops", n as f64)],
            }
        }
        Workload::Idle => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "idle is measured by scripts/bench-suite",
            ));
        }
    };
    Ok(sample)
}

// ---- the server side, in its own process ----

fn peer_main(args: &[String]) -> io::Result<()> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "usage: smclo bench __peer TRANSPORT WORKLOAD CPU",
        )
    };
    let t = args
        .first()
        .and_then(|s| Transport::from_name(s))
        .ok_or_else(bad)?;
    let w = args
        .get(1)
        .and_then(|s| Workload::from_name(s))
        .ok_or_else(bad)?;
    let cpu: i64 = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    pin(usize::try_from(cpu).ok());
    if w == Workload::Idle {
        raise_nofile_limit();
    }
    let announce = |addr: &dyn std::fmt::Display| -> io::Result<()> {
        let mut out = io::stdout();
        writeln!(out, "{addr}")?;
        out.flush()
    };
    match t {
        Transport::Tcp | Transport::SmcloRun => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            announce(&l.local_addr()?)?;
            serve_all(w, || {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Box::new(s))
            })
        }
        Transport::KernelSmc => {
            let l = crate::kernel_smc::listen("127.0.0.1:0".parse().expect("literal address"))?;
            announce(&l.local_addr()?)?;
            serve_all(w, || {
                let (s, _) = l.accept()?;
                let _ = s.set_nodelay(true);
                Ok(Box::new(s))
            })
        }
        Transport::Unix => {
            let path =
                std::env::temp_dir().join(format!("smclo-bench-{}.sock", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let l = UnixListener::bind(&path)?;
            announce(&path.display())?;
            let r = serve_all(w, || Ok(Box::new(l.accept()?.0)));
            let _ = std::fs::remove_file(&path);
            r
        }
        Transport::Smclo | Transport::SmcloCopy => {
            let l = SmcListener::bind("127.0.0.1:0")?;
            announce(&l.local_addr()?)?;
            serve_all(w, || {
                let (s, _) = l.accept()?;
                if !s.is_smc() {
                    return Err(io::Error::other(format!(
                        "server side fell back: {:?}",
                        s.fallback_reason()
                    )));
                }
                s.set_nodelay(true)?;
                Ok(Box::new(s))
            })
        }
    }
}

/// Accepts and serves connections until the workload is over; `idle`
/// connections are held until the process is killed.
fn serve_all(
    w: Workload,
    mut accept: impl FnMut() -> io::Result<Box<dyn Duplex>>,
) -> io::Result<()> {
    let mut held = Vec::new();
    loop {
        let mut s = accept()?;
        if w == Workload::Idle {
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            s.write_all(&b)?;
            held.push(s);
        } else if serve(s, w)? {
            return Ok(());
        }
    }
}

/// Serves one connection; `Ok(true)` when the workload is over.
fn serve(mut s: Box<dyn Duplex>, w: Workload) -> io::Result<bool> {
    match w {
        Workload::PingPong | Workload::MsgRate => {
            let mut buf = vec![
                0u8;
                if w == Workload::PingPong {
                    PING_SIZE
                } else {
                    MSG_SIZE
                }
            ];
            loop {
                match s.read_exact(&mut buf) {
                    Ok(()) => s.write_all(&buf)?,
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(true),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(true),
                    Err(e) => return Err(e),
                }
            }
        }
        Workload::Stream => {
            // Read until the client half-closes, then report the byte count.
            let mut buf = vec![0u8; 256 * 1024];
            let mut total: u64 = 0;
            loop {
                match s.read(&mut buf)? {
                    0 => break,
                    n => total += n as u64,
                }
            }
            s.write_all(&total.to_le_bytes())?;
            Ok(true)
        }
        Workload::Setup => {
            let mut b = [0u8; 1];
            match s.read_exact(&mut b) {
                Ok(()) => s.write_all(&b)?,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {}
                Err(e) => return Err(e),
            }
            Ok(false)
        }
        Workload::Idle => Ok(false),
    }
}
