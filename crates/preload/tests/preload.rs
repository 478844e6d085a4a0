//! The preload library under real programs: `tests/c/peer.c` (plain POSIX
//! socket code) runs as server and client in two processes, each with
//! `LD_PRELOAD=libsmclo_preload.so` (or without, for the mixed cases), on a
//! device directory of its own. Every test checks the bytes (the peers
//! verify a known pattern) and the device counters: SMC-D connections were
//! opened and carried the bytes, or, for a plain peer, a fallback happened.

use smclo::device::{Device, Stats};
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::{compile, lib};

static N: AtomicU32 = AtomicU32::new(0);

/// Compiles peer.c once.
fn peer() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("peer", &["-D_FORTIFY_SOURCE=2"]))
}

/// A device directory for one test, removed when dropped.
use smclo_testsupport::DevDir;

trait DevStats {
    fn stats(&self) -> Stats;
}

impl DevStats for DevDir {
    fn stats(&self) -> Stats {
        Device::open(&self.0).expect("open the test device").stats()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Smc,
    Plain,
}

fn spawn(dev: &DevDir, side: Side, args: &[&str]) -> Child {
    let mut c = Command::new(peer());
    c.args(args)
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if side == Side::Smc {
        c.env("LD_PRELOAD", lib());
    } else {
        c.env_remove("LD_PRELOAD");
    }
    c.spawn().expect("spawn peer")
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Waits (bounded) for a child and collects its output.
fn finish(mut c: Child, first: String, what: &str) -> Out {
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        if let Some(st) = c.try_wait().expect("wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stdout = first;
    c.stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let mut stderr = String::new();
    c.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    if st.is_none() {
        stdout.push_str(&format!("\n{what}: TIMED OUT (killed)\n"));
    }
    Out {
        ok: st.is_some_and(|s| s.success()),
        stdout,
        stderr,
    }
}

struct Run {
    server: Out,
    client: Out,
    stats: Stats,
}

impl Run {
    fn report(&self) -> String {
        format!(
            "server stdout:\n{}\nserver stderr:\n{}\nclient stdout:\n{}\nclient stderr:\n{}\nstats: {:?}",
            self.server.stdout, self.server.stderr, self.client.stdout, self.client.stderr, self.stats
        )
    }
    fn assert_ok(&self) {
        assert!(
            self.server.ok && self.client.ok,
            "a peer failed\n{}",
            self.report()
        );
    }
    fn fallbacks(&self) -> u64 {
        self.stats.fallbacks_total()
    }
    /// Upgraded, exactly `conns` SMC-D connections, no fallback, and the
    /// device counted at least `bytes` bytes (and not wildly more).
    fn assert_smc(&self, conns: u64, bytes: u64) {
        self.assert_ok();
        assert_eq!(
            self.stats.conns_opened,
            conns,
            "SMC-D connections\n{}",
            self.report()
        );
        assert_eq!(self.fallbacks(), 0, "fallbacks\n{}", self.report());
        let x = self.stats.xfer_bytes;
        assert!(
            x >= bytes && x <= bytes + bytes / 100 + 4096,
            "xfer_bytes {x}, expected about {bytes}\n{}",
            self.report()
        );
    }
}

fn run(mode: &str, server: Side, client: Side, extra: &[&str]) -> Run {
    let dev = DevDir::new(mode);
    let mut sargs = vec!["server", mode];
    sargs.extend_from_slice(extra);
    let mut s = spawn(&dev, server, &sargs);
    let mut out = BufReader::new(s.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).expect("server output");
    let port = line.strip_prefix("READY ").map(|p| p.trim().to_string());
    let Some(port) = port else {
        let _ = s.kill();
        let mut rest = String::new();
        let _ = out.read_to_string(&mut rest);
        let mut err = String::new();
        let _ = s.stderr.take().unwrap().read_to_string(&mut err);
        panic!("server did not start: {line}{rest}\n{err}");
    };
    s.stdout = None;
    let mut cargs = vec!["client", mode, port.as_str()];
    cargs.extend_from_slice(extra);
    let c = spawn(&dev, client, &cargs);
    let client = finish(c, String::new(), "client");
    // Put the reader back for finish().
    let mut rest = String::new();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = out.read_to_string(&mut rest);
        let _ = tx.send(rest);
    });
    let server = finish_detached(s, rx);
    let stats = dev.stats();
    Run {
        server,
        client,
        stats,
    }
}

/// `finish` for a child whose stdout is read by another thread.
fn finish_detached(mut c: Child, rx: std::sync::mpsc::Receiver<String>) -> Out {
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        if let Some(st) = c.try_wait().expect("wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stdout = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
    if st.is_none() {
        stdout.push_str("\nserver: TIMED OUT (killed)\n");
    }
    let mut stderr = String::new();
    c.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Out {
        ok: st.is_some_and(|s| s.success()),
        stdout,
        stderr,
    }
}

const BIG: u64 = 3 << 20;

#[test]
fn blocking_echo() {
    let r = run("echo", Side::Smc, Side::Smc, &[]);
    r.assert_smc(1, 2 * BIG);
    assert!(
        r.server.stderr.contains("SMC-D"),
        "no upgrade line in the debug output\n{}",
        r.report()
    );
}

#[test]
fn poll_echo() {
    run("poll", Side::Smc, Side::Smc, &[]).assert_smc(1, 2 * BIG);
}

#[test]
fn epoll_level_triggered() {
    run("epoll", Side::Smc, Side::Smc, &[]).assert_smc(1, 2 * BIG);
}

#[test]
fn epoll_edge_oneshot_rdhup() {
    run("epollet", Side::Smc, Side::Smc, &[]).assert_smc(1, 2 * BIG);
}

#[test]
fn two_threads_one_socket() {
    run("threads", Side::Smc, Side::Smc, &[]).assert_smc(1, 2 * (BIG + 12345));
}

#[test]
fn flags_vectors_fionread() {
    run("flags", Side::Smc, Side::Smc, &[]).assert_smc(1, 3300 + 1 + 300);
}

#[test]
fn shutdown_write_half_close() {
    run("shut", Side::Smc, Side::Smc, &[]).assert_smc(1, 100000 + 777777);
}

#[test]
fn so_linger_zero_resets() {
    run("linger", Side::Smc, Side::Smc, &[]).assert_smc(1, 1000);
}

#[test]
fn ipv6_loopback() {
    run("echo", Side::Smc, Side::Smc, &["v6"]).assert_smc(1, 2 * BIG);
}

#[test]
fn nonblocking_connect_with_epoll() {
    run("nbconnect", Side::Smc, Side::Smc, &[]).assert_smc(1, 200);
}

/// A non-blocking connect does not wait for the server application's
/// `accept` (here 2 s late): it returns at once, falls back when
/// SMCLO_CLC_WAIT_MS passes without an answer, and the connection carries
/// the stream exactly.
#[test]
fn nonblocking_connect_does_not_wait_for_accept() {
    let r = run("lateaccept", Side::Smc, Side::Smc, &[]);
    r.assert_ok();
    let ms: f64 = r
        .client
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("CONNECT_MS "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no CONNECT_MS line\n{}", r.report()));
    assert!(ms < 300.0, "connect took {ms} ms\n{}", r.report());
    assert_eq!(r.stats.conns_opened, 0, "{}", r.report());
    assert_eq!(r.stats.xfer_bytes, 0, "{}", r.report());
    assert_eq!(
        r.stats.fallback(smclo_wire::reason::Reason::Timeout).0,
        1,
        "the client falls back with TIMEOUT\n{}",
        r.report()
    );
    assert!(
        r.client.stderr.contains("TIMEOUT"),
        "the debug log says why\n{}",
        r.report()
    );
}

/// A non-blocking connect to a server that accepts 300 ms late returns at
/// once; the handshake goes on, driven by what the client does next, and
/// decides SMC-D (a connect that waited a fixed time for the server would
/// fall back with TIMEOUT): `how` is epoll or poll for writability, a
/// write at once without polling, or blocking writes after clearing
/// O_NONBLOCK.
fn late_accept(how: &str, bytes: u64) -> Run {
    let r = run(&format!("late{how}"), Side::Smc, Side::Smc, &[]);
    r.assert_smc(1, 2 * bytes);
    r
}

#[test]
fn nonblocking_connect_epoll_late_accept_is_smc() {
    late_accept("epoll", BIG);
}

#[test]
fn nonblocking_connect_poll_late_accept_is_smc() {
    late_accept("poll", BIG);
}

#[test]
fn nonblocking_connect_write_without_polling() {
    let r = late_accept("write", 100);
    assert!(
        r.client.stdout.lines().any(|l| l
            .strip_prefix("EAGAIN ")
            .and_then(|n| n.trim().parse::<u32>().ok())
            .is_some_and(|n| n > 0)),
        "writes before the decision are EAGAIN\n{}",
        r.report()
    );
}

#[test]
fn nonblocking_connect_then_blocking_write() {
    late_accept("blockwrite", BIG);
}

#[test]
fn fork_child_keeps_connection() {
    let r = run("fork", Side::Smc, Side::Smc, &[]);
    // The server's bytes are sent by the child after the parent closed its
    // copy, which retires the parent's DMB registration (it owns the stats
    // entry): only the client's BIG bytes are certain to be counted.
    r.assert_ok();
    assert_eq!(r.stats.conns_opened, 1, "{}", r.report());
    assert_eq!(r.fallbacks(), 0, "{}", r.report());
    assert!(
        r.stats.xfer_bytes >= BIG && r.stats.xfer_bytes <= 2 * BIG,
        "{}",
        r.report()
    );
    assert!(
        r.server.stdout.contains(&format!("CHILD {BIG}")),
        "{}",
        r.report()
    );
}

/// The exec'd program runs with the preload too (LD_PRELOAD is inherited):
/// it adopts the connection and echoes all of it through shared memory.
/// (A program without the preload: crates/apptests/tests/exec.rs.)
#[test]
fn exec_keeps_the_connection() {
    for form in ["execl", "execlp", "execle"] {
        exec_keeps_the_connection_with(form);
    }
}

/// The server's child execs itself with `form` (one of the variadic exec
/// functions) on the accepted connection.
fn exec_keeps_the_connection_with(form: &str) {
    let r = run("exec", Side::Smc, Side::Smc, &[form]);
    r.assert_ok();
    assert_eq!(r.stats.conns_opened, 1, "{}", r.report());
    assert_eq!(r.fallbacks(), 0, "{}", r.report());
    assert_eq!(r.stats.xfer_bytes, 2 * 4096, "{}", r.report());
    assert!(
        r.client.stdout.contains("EXEC eof after 4096"),
        "{}",
        r.report()
    );
    assert!(
        r.server
            .stderr
            .contains("exec: adopted SMC-D connection on fd 0+1"),
        "no adoption line in the debug output\n{}",
        r.report()
    );
}

#[test]
fn msg_oob_fails_loudly() {
    let r = run("oob", Side::Smc, Side::Smc, &[]);
    r.assert_smc(1, 10);
    assert!(
        r.client
            .stderr
            .contains("not supported on an SMC-D connection"),
        "{}",
        r.report()
    );
}

/// `peer.c` in `mode` (its client sets `TCP_ULP` and `SO_PEEK_OFF`, then
/// sends): both refused, with the debug line's words `when` ("" or " before
/// its decision"), and the connection SMC-D.
fn options_refused(mode: &str, when: &str) {
    let r = run(mode, Side::Smc, Side::Smc, &[]);
    r.assert_smc(1, 10);
    for what in ["setsockopt(TCP_ULP)", "setsockopt(SO_PEEK_OFF)"] {
        assert!(
            r.client
                .stderr
                .contains(&format!("{what}{when} is not supported")),
            "{what}\n{}",
            r.report()
        );
    }
}

/// `TCP_ULP` (kernel TLS) and `SO_PEEK_OFF` on an SMC-D connection are
/// refused (`EOPNOTSUPP`, the kernel's SMC's answer), so that a program
/// keeps TLS in user space and peeks from the start: applied to the
/// hidden TCP socket, kernel TLS would encrypt nothing the peer reads
/// (the program's plaintext reaching a peer that reads TLS records) and
/// the peek offset would be ignored.
#[test]
fn tcp_ulp_and_peek_offsets_are_refused_as_the_kernels_smc_refuses_them() {
    options_refused("ulp", "");
}

/// The same while a non-blocking connect's handshake is undecided: the
/// connection may still become SMC-D.
#[test]
fn tcp_ulp_and_peek_offsets_are_refused_before_the_decision() {
    options_refused("ulp-pending", " before its decision");
}

#[test]
fn plain_client_smc_server() {
    let r = run("echo", Side::Smc, Side::Plain, &[]);
    r.assert_ok();
    assert_eq!(r.stats.conns_opened, 0, "{}", r.report());
    assert_eq!(r.stats.xfer_bytes, 0, "{}", r.report());
    assert!(
        r.fallbacks() >= 1,
        "the server should count a fallback\n{}",
        r.report()
    );
}

#[test]
fn smc_client_plain_server() {
    let r = run("shut", Side::Plain, Side::Smc, &[]);
    r.assert_ok();
    assert_eq!(r.stats.conns_opened, 0, "{}", r.report());
    assert!(
        r.fallbacks() >= 1,
        "the client should count a fallback\n{}",
        r.report()
    );
}

/// `smclo run` and `smc_run` set up the environment and exec the program.
#[test]
fn smclo_run_sets_up_the_preload() {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let profile = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().unwrap()
    } else {
        deps
    };
    for (bin, pre) in [
        ("smclo", &["run", "-d", "-r", "64k", "-t", "1m", "--"][..]),
        ("smc_run", &["-d", "-r", "64k", "-t", "1m"][..]),
    ] {
        let path = profile.join(bin);
        assert!(
            path.is_file(),
            "{} is missing: build the smclo-cli binaries (cargo test --workspace does)",
            path.display()
        );
        let out = Command::new(&path)
            .args(pre)
            .args([
                "sh",
                "-c",
                "echo \"$LD_PRELOAD|$SMCLO_DEBUG|$SMCLO_RMEM|$SMCLO_WMEM\"",
            ])
            .env("LD_PRELOAD", "")
            .env("SMCLO_PRELOAD_LIB", lib())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{bin}: {out:?}");
        assert!(
            text.contains("libsmclo_preload.so|1|64k|1m"),
            "{bin}: {text}"
        );
        // A missing library is a clear error.
        let missing = Command::new(&path)
            .args(if bin == "smclo" {
                &["run", "--", "true"][..]
            } else {
                &["true"][..]
            })
            .env("SMCLO_PRELOAD_LIB", "/nonexistent/libsmclo_preload.so")
            .output()
            .unwrap();
        assert_eq!(missing.status.code(), Some(1), "{bin}: {missing:?}");
        assert!(
            String::from_utf8_lossy(&missing.stderr).contains("SMCLO_PRELOAD_LIB"),
            "{bin}: {missing:?}"
        );
    }
    let bad = Command::new(profile.join("smclo"))
        .args(["run", "-r", "lots", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
}

/// Without strace the budget cannot be checked, and the test fails with
/// the reason (`./test.sh` installs strace), so no run passes a check it
/// did not make.
fn budget_unchecked(why: &str) -> ! {
    panic!("{why}: the system call budget cannot be checked (./test.sh runs as root with strace installed)");
}

/// Iterations of a budget test's shorter and longer traced run: the
/// difference of their counts is what [`RUNS_APART`] iterations cost, with
/// the start-up and exit of the program and of the preload cancelled out.
const SHORT_RUN: u32 = 20;
const LONG_RUN: u32 = 120;
const RUNS_APART: i64 = (LONG_RUN - SHORT_RUN) as i64;

/// How many more system calls, by name and in `total`, a run of `peer
/// ARGS.. LONG_RUN` made than one of `peer ARGS.. SHORT_RUN`, under
/// `strace -f -c`, with the preload or without.
struct Grown(std::collections::HashMap<String, i64>);

impl Grown {
    /// Under the preload if `preload`, with more environment variables.
    fn of_peer(dev: &DevDir, preload: bool, args: &[&str], env: &[(&str, &str)]) -> Grown {
        let run = |n: u32| {
            let n = n.to_string();
            let mut a = args.to_vec();
            a.push(&n);
            traced_peer(dev, preload, &a, env)
        };
        let (a, b) = (run(SHORT_RUN), run(LONG_RUN));
        let calls = |m: &std::collections::HashMap<String, u64>, k: &str| {
            m.get(k).copied().unwrap_or(0) as i64
        };
        Grown(
            a.keys()
                .chain(b.keys())
                .map(|k| (k.clone(), calls(&b, k) - calls(&a, k)))
                .collect(),
        )
    }

    /// The growth of one call's count (or of `total`).
    fn of(&self, call: &str) -> i64 {
        self.0.get(call).copied().unwrap_or(0)
    }
}

/// System calls of `peer ARGS` (name → calls), counted by `strace -f -c`.
fn traced_peer(
    dev: &DevDir,
    preload: bool,
    args: &[&str],
    env: &[(&str, &str)],
) -> std::collections::HashMap<String, u64> {
    let (trace, mut c) = Strace::command(dev, true, preload, peer().as_os_str());
    c.args(args).envs(env.iter().copied());
    let r = c
        .output()
        .unwrap_or_else(|e| budget_unchecked(&format!("strace not usable ({e})")));
    let (report, m) = trace.read();
    if !r.status.success() {
        let err = String::from_utf8_lossy(&r.stderr);
        if err.contains("ptrace") || err.contains("Operation not permitted") {
            budget_unchecked(&format!("strace may not trace here ({})", err.trim()));
        }
        panic!("peer {args:?} under strace failed: {r:?}\n{report}");
    }
    assert!(m.contains_key("total"), "no strace summary:\n{report}");
    m
}

/// `c` runs under the preload if `preload`, else without it.
fn with_preload(c: &mut Command, preload: bool) -> &mut Command {
    if preload {
        c.env("LD_PRELOAD", lib())
    } else {
        c.env_remove("LD_PRELOAD")
    }
}

/// One run of a program under `strace -c` (`-f`: its threads and children
/// too), its report in a file of its own. Without `SMCLO_DEBUG`, whose
/// messages would be system calls of their own.
struct Strace {
    report: PathBuf,
}

impl Strace {
    /// The command that runs `program` so, under the preload if `preload`,
    /// on device `dev`; the caller adds the arguments and runs it.
    fn command(
        dev: &DevDir,
        follow: bool,
        preload: bool,
        program: &std::ffi::OsStr,
    ) -> (Strace, Command) {
        let report = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "preload-strace-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let mut c = Command::new("strace");
        if follow {
            c.arg("-f");
        }
        c.arg("-c").arg("-o").arg(&report).arg(program);
        c.env("SMCLO_DEVICE_DIR", &dev.0)
            .env_remove("SMCLO_DEBUG")
            .env_remove("SMCLO_DISABLE")
            .stdin(Stdio::null());
        with_preload(&mut c, preload);
        (Strace { report }, c)
    }

    /// The report and its calls per system call, once the run has ended;
    /// the file is removed.
    fn read(self) -> (String, std::collections::HashMap<String, u64>) {
        let report = std::fs::read_to_string(&self.report).unwrap_or_default();
        let _ = std::fs::remove_file(&self.report);
        let m = strace_counts(&report);
        (report, m)
    }
}

/// The calls per system call in a `strace -c` report.
fn strace_counts(report: &str) -> std::collections::HashMap<String, u64> {
    // Rows: % time, seconds, usecs/call, calls, [errors,] syscall.
    let mut m = std::collections::HashMap::new();
    for line in report.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 5 && f[0].starts_with(|c: char| c.is_ascii_digit()) {
            if let Ok(calls) = f[3].parse::<u64>() {
                m.insert(f[f.len() - 1].to_string(), calls);
            }
        }
    }
    m
}

/// An epoll set whose SMC-D connections have all ended waits in the
/// kernel alone: its other members, plain descriptors, cost one kernel
/// wait per `epoll_wait`, as without smclo. Before, the set kept its
/// shadow and every wait spun over no rings first, asking the kernel again
/// and again (an event loop whose connections to a server went plain,
/// wrk's, spent half its CPU there).
#[test]
fn a_set_whose_connections_ended_does_not_spin() {
    let script = r#"
import os, select, socket
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(4)
port = l.getsockname()[1]
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:
    l.close()
    ep = select.epoll()
    c = socket.create_connection(("127.0.0.1", port))
    ep.register(c.fileno(), select.EPOLLIN)
    c.sendall(b"x")
    ep.poll(5)
    c.recv(1)
    ep.unregister(c.fileno())
    c.close()
    os.read(done_r, 1)
    r, w = socket.socketpair()
    ep.register(r.fileno(), select.EPOLLIN)
    for _ in range(WAITS):
        ep.poll(0.002)
    os._exit(0)
a, _ = l.accept()
a.sendall(a.recv(1))
a.recv(1)
a.close()
os.write(done_w, b"d")
_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#;
    const WAITS: u64 = 200;
    let dev = DevDir::new("nospin");
    let (trace, mut c) = Strace::command(&dev, true, true, "python3".as_ref());
    let r = c
        .args(["-c", &script.replace("WAITS", &WAITS.to_string())])
        .output()
        .expect("strace (./test.sh runs as root with strace installed)");
    let (report, m) = trace.read();
    let text = format!("{}\n{report}", String::from_utf8_lossy(&r.stdout));
    assert!(
        r.status.success() && text.contains("OK done"),
        "{text}\n{r:?}"
    );
    let stats = dev.stats();
    assert_eq!(stats.conns_opened, 1, "{text}\n{stats:?}");
    let waits = ["epoll_wait", "epoll_pwait", "epoll_pwait2"]
        .iter()
        .map(|k| m.get(*k).copied().unwrap_or(0))
        .sum::<u64>();
    assert!(waits >= WAITS, "{text}");
    assert!(
        waits <= WAITS + WAITS / 4,
        "{waits} kernel waits for {WAITS} epoll waits on plain descriptors\n{text}"
    );
}

/// A connect under the preload to a server with no smclo listener costs no
/// system call besides the ones the program makes: in particular no
/// getsockopt (the socket type is recorded by socket()) and no fcntl (the
/// descriptor flags matter only for a swap). Counted with strace over two
/// run lengths, so the preload's one-time start-up cancels out.
#[test]
fn plain_connect_syscall_budget() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            drop(c);
        }
    });
    let dev = DevDir::new("budget");
    let port = port.to_string();
    let [base, pre] = [false, true].map(|preload| {
        let g = Grown::of_peer(&dev, preload, &["client", "churn", &port], &[]);
        assert_eq!(g.of("connect"), RUNS_APART, "connects counted");
        g
    });
    let n = RUNS_APART;
    let added = |call: &str| pre.of(call) - base.of(call);
    assert_eq!(
        added("getsockopt"),
        0,
        "getsockopt calls added by the preload over {n} plain connects"
    );
    assert_eq!(
        added("fcntl"),
        0,
        "fcntl calls added by the preload over {n} plain connects"
    );
    // All system calls: none per connect (a few slack for anything the
    // runtime does once in a while, far below one per connect).
    assert!(
        added("total") <= n / 20,
        "system calls added by the preload over {n} plain connects: {}",
        added("total")
    );
    let st = dev.stats();
    assert_eq!(
        st.conns_opened, 0,
        "a plain server gets no SMC-D connection: {st:?}"
    );
}

/// `accept` on a listener the preload did not make (here a UNIX one made
/// by a raw system call, as a listener inherited through exec) asks the
/// kernel once whether it is a TCP listener to register, then never
/// again: no system call per accept beyond the program's own.
#[test]
fn unknown_listener_accept_syscall_budget() {
    let dev = DevDir::new("abudget");
    let [base, pre] = [false, true].map(|preload| {
        let g = Grown::of_peer(&dev, preload, &["unixchurn"], &[]);
        assert_eq!(g.of("accept"), RUNS_APART, "accepts counted");
        g
    });
    let n = RUNS_APART;
    let added = |call: &str| pre.of(call) - base.of(call);
    assert_eq!(
        added("getsockopt"),
        0,
        "getsockopt calls added by the preload over {n} accepts"
    );
    assert!(
        added("total") <= n / 20,
        "system calls added by the preload over {n} accepts: {}",
        added("total")
    );
}

/// A server under the preload pays one system call per plain client's
/// connection beyond the program's own: the saved SYN (`getsockopt`),
/// which tells that the client did not propose. The fallback table
/// takes the connection's addresses from the SYN, not `getsockname`, and
/// a blocking accept asks the listener's flags (`fcntl`) only when it
/// may spin or the client proposed. Both were a system call per plain
/// connection before.
#[test]
fn plain_client_accept_syscall_budget() {
    let dev = DevDir::new("pbudget");
    let [base, pre] = [false, true].map(|preload| {
        let g = Grown::of_peer(&dev, preload, &["plainchurn"], &[]);
        // glibc's accept is the accept system call; the preload's, accept4.
        assert_eq!(
            g.of("accept") + g.of("accept4"),
            RUNS_APART,
            "accepts counted"
        );
        g
    });
    let n = RUNS_APART;
    let added = |call: &str| pre.of(call) - base.of(call);
    assert_eq!(
        added("getsockopt"),
        n,
        "getsockopt calls added over {n} plain accepts"
    );
    assert_eq!(
        added("getsockname"),
        0,
        "getsockname calls added over {n} plain accepts"
    );
    assert_eq!(
        added("fcntl"),
        0,
        "fcntl calls added over {n} plain accepts"
    );
    assert!(
        added("total") <= n + n / 20,
        "system calls added by the preload over {n} plain accepts: {}",
        added("total")
    );
    let st = dev.stats();
    assert_eq!(st.conns_opened, 0, "{st:?}");
    assert_eq!(
        st.fallbacks_total(),
        u64::from(SHORT_RUN + LONG_RUN),
        "every accept counted as a fallback (PEERNOSMC): {st:?}"
    );
}

/// System calls per SMC-D connection under the preload, both ends together
/// (connect, accept, one byte each way, close; docs/handshake.md, "Connection
/// setup cost"), above which setup has regressed: 54 now (early bytes
/// made it 52.5, then asking an early connect's `O_NONBLOCK` at each call
/// that depends on it, putting the SYN mark back before its early bytes and
/// peeking them before dropping them from the stream 59, then leaving the
/// channel where the kernel put it until the swap 54). With a `getpid`
/// per holder claim and close, the rlimit read three times per connection
/// and side, the hidden socket's timeouts and the peer's groups always
/// asked, and `getsockname` before every SYN, it was 82; with the server's
/// DMB passed on every connection, 64; with the SYN mark put back after
/// every SYN, 58; with the channel's `O_NONBLOCK` read at the swap and
/// each read's, 56. The slack is for a loaded machine, where waits wake
/// more often.
const PRELOAD_BUDGET_PER_CONN: i64 = 59;

/// `peer MODE`, a server and its client in one program (a fork), under the
/// preload on a fresh device: its output, once it succeeded with `conns`
/// SMC-D connections and no fallback.
fn peer_mode(mode: &str, conns: u64) -> Out {
    let dev = DevDir::new(mode);
    let c = spawn(&dev, Side::Smc, &[mode]);
    let out = finish(c, String::new(), mode);
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    let st = dev.stats();
    assert_eq!(st.conns_opened, conns, "{st:?}\n{}", out.stderr);
    assert_eq!(st.fallbacks_total(), 0, "{st:?}\n{}", out.stderr);
    out
}

/// The line of `out` that starts with `prefix`, a list of names and
/// numbers (`name n name n ...`), and those numbers by name.
fn counts<'a>(out: &'a str, prefix: &str) -> (&'a str, std::collections::HashMap<&'a str, i64>) {
    let line = out
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no counts: {out}"));
    let n = line
        .split_whitespace()
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|kv| (kv[0], kv[1].parse().expect("a count")))
        .collect();
    (line, n)
}

/// An ended SMC-D connection's hidden TCP socket is closed at the
/// process's next wait (here a `poll` with a timeout), not on the way to
/// its next step, and a `fork` child never inherits one that waits
/// (`smclo::adapter::deferred`).
#[test]
fn an_ended_connections_tcp_socket_is_closed_at_the_next_wait() {
    let out = peer_mode("deferclose", 3);
    let (line, n) = counts(&out.stdout, "base ");
    assert_eq!(
        n["after_close"],
        n["base"] + 1,
        "closed before a wait: {line}"
    );
    assert_eq!(n["after_wait"], n["base"], "left open after a wait: {line}");
    assert_eq!(n["before_fork"], n["base"] + 1, "{line}");
    assert_eq!(
        n["in_child"], n["base"],
        "a fork child inherited it: {line}"
    );
}

/// A connection its peer aborted (`SO_LINGER` 0) closes its TCP socket at
/// the program's `close`, with the channel: its TCP peer may be a program
/// that reads the TCP socket itself (a connection that could not follow an
/// exec falls back to it) and waits for that end of stream.
#[test]
fn an_aborted_connections_tcp_socket_is_closed_at_once() {
    let out = peer_mode("abortclose", 2);
    let (line, n) = counts(&out.stdout, "read ");
    assert!(
        n["read"] == -1 && n["errno"] == libc::ECONNRESET as i64,
        "the client did not read the reset: {line}"
    );
    assert_eq!(
        n["after_close"],
        n["before_close"] - 2,
        "the channel and the TCP socket close together: {line}"
    );
}

/// Connections from one fixed source port one after the other: an ended
/// connection's TCP socket, whose close waits for the next wait
/// (`smclo::adapter::deferred`), must not keep the port and the 4-tuple from the
/// next `bind` and `connect` (`bind` closes it first), as over TCP.
#[test]
fn a_fixed_source_port_is_free_for_the_next_connection() {
    let out = peer_mode("fixedport", 3);
    assert!(out.stdout.contains("fixedport 3"), "{}", out.stdout);
}

/// The same when the client closes first and binds again before its
/// server has closed: the TCP socket of the client's ended SMC-D
/// connection, whose close waited for the `bind`, is closed with an abort
/// there, so it leaves no TIME_WAIT holding the 4-tuple (closed with a
/// FIN, it did: the next connect failed with EADDRNOTAVAIL, as it does
/// over TCP for a client that closes first; here the program's own
/// socket was gone long before).
#[test]
fn a_fixed_source_port_is_free_when_the_server_closes_late() {
    let out = peer_mode("fixedportlate", 3);
    assert!(out.stdout.contains("fixedport 3"), "{}", out.stdout);
}

/// Counted with strace over two run lengths, so the start-up cancels out.
/// Waits sleep at once (`SMCLO_SPIN_US=0`): a busy-poll's looks would be
/// counted too, as many as the timing under strace allows. A loaded
/// machine adds looks of its own (a handshake that finds its peer's step
/// not taken yet naps and looks again: 53 to 58 calls on one build,
/// depending on the machine's load), so the pair of runs is made up to
/// three times and the one with the fewest calls is judged: a call added
/// to every connection shows in each.
#[test]
fn smc_setup_syscall_budget() {
    let n = RUNS_APART;
    let mut best: Option<Grown> = None;
    for attempt in 0..3 {
        let dev = DevDir::new(&format!("sbudget{attempt}"));
        let g = Grown::of_peer(
            &dev,
            true,
            &["smcchurn"],
            &[("SMCLO_SPIN_US", "0"), ("SMCLO_SHORT", "smc")],
        );
        let st = dev.stats();
        assert_eq!(st.conns_opened, u64::from(SHORT_RUN + LONG_RUN), "{st:?}");
        assert_eq!(st.fallbacks_total(), 0, "{st:?}");
        let fits = g.of("total") <= PRELOAD_BUDGET_PER_CONN * n;
        if best.as_ref().is_none_or(|b| g.of("total") < b.of("total")) {
            best = Some(g);
        }
        if fits {
            break;
        }
    }
    let best = best.expect("three attempts");
    // The TCP and the rendezvous accept. A blocking call that waits for a
    // pending connect's handshake (an early connect's first read) wakes
    // every 5 ms to look at the TCP connection, and then at its rendezvous
    // socket, which is empty when the traced server has not connected yet
    // (6 such looks over 100 connections in a full test run). The count is
    // the difference of two runs, so such looks in the shorter run take a
    // few off (199 seen).
    assert!(
        (2 * n - n / 20..=2 * n + n / 5).contains(&best.of("accept4")),
        "{} accepts over {n} connections (TCP and rendezvous)",
        best.of("accept4")
    );
    // The identity is cached, the limit read once per connection attempt.
    assert!(
        best.of("getpid") <= n / 20,
        "{} getpid calls over {n} connections",
        best.of("getpid")
    );
    assert!(
        best.of("prlimit64") <= 2 * n,
        "{} rlimit reads over {n} connections",
        best.of("prlimit64")
    );
    // Neither end asks the peer's groups (same uid) or its socket's
    // timeouts (none set), nor the client its unbound socket's address
    // before the SYN: `SO_PEERCRED` at each end and the server's
    // `TCP_SAVED_SYN` are left.
    assert!(
        best.of("getsockopt") <= 3 * n,
        "{} getsockopt calls over {n} connections",
        best.of("getsockopt")
    );
    // The SYN mark's two options and each end's `SO_SNDBUF` of its
    // channel: an SMC-D connection leaves the mark on its TCP socket,
    // unless its first request went out as early bytes, which carry the
    // program's TTL and TOS (two more). Under load a few connections of
    // either run miss the early path, so the difference of the two runs
    // may show a few more.
    assert!(
        best.of("setsockopt") <= 6 * n + n / 20,
        "{} setsockopt calls over {n} connections",
        best.of("setsockopt")
    );
    // Each end: the hidden socket's high number (the channel goes from
    // where the kernel put it straight to the application's number), and
    // the blocking listener's (server) or socket's (client) `F_GETFL`; the
    // client's `F_GETFD` of the program's socket. The swap does not ask the
    // channel's `O_NONBLOCK`, which the connection keeps. An early
    // connect's socket is asked its `O_NONBLOCK` again by its early write,
    // the read that waits for the answer and the swap (its open file may be
    // shared with descriptors made before the connect, whose `F_SETFL` no
    // hook on it sees).
    assert!(
        best.of("fcntl") <= 8 * n + n / 20,
        "{} fcntl calls over {n} connections",
        best.of("fcntl")
    );
    let per = best.of("total") as f64 / n as f64;
    eprintln!("system calls per SMC-D connection under the preload (both ends): {per:.1}");
    for k in [
        "setsockopt",
        "getsockopt",
        "getsockname",
        "fcntl",
        "geteuid",
        "close",
        "poll",
        "ppoll",
        "sendto",
    ] {
        eprintln!("  {k}: {:.2}", best.of(k) as f64 / n as f64);
    }
    assert!(
        best.of("total") <= PRELOAD_BUDGET_PER_CONN * n,
        "{per:.1} system calls per SMC-D connection, budget {PRELOAD_BUDGET_PER_CONN}"
    );
}

/// Runs `cmd` under the preload on a fresh device (60 s at most); returns
/// whether it succeeded, its output and the device's counters.
fn run_preloaded(tag: &str, mut cmd: Command) -> (bool, String, Stats) {
    let dev = DevDir::new(tag);
    let c = cmd
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env("SMCLO_DEBUG", "1")
        .env("LD_PRELOAD", lib())
        .env_remove("SMCLO_DISABLE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let out = finish(c, String::new(), tag);
    let stats = dev.stats();
    let text = format!("stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    (out.ok, text, stats)
}

/// `tests/c/intr.c` in `mode`: its checks passed over one SMC-D connection.
fn intr(mode: &str) -> (String, Stats) {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("intr", &["-D_FORTIFY_SOURCE=2"]));
    let mut cmd = Command::new(exe);
    cmd.arg(mode);
    let (ok, out, stats) = run_preloaded(mode, cmd);
    assert!(ok && out.contains("OK done"), "intr {mode} failed\n{out}");
    assert_eq!(stats.conns_opened, 1, "SMC-D connections\n{out}");
    assert_eq!(stats.fallbacks_total(), 0, "fallbacks\n{out}");
    (out, stats)
}

/// A handler without SA_RESTART ends a blocking recv with EINTR.
#[test]
fn signal_without_sa_restart_is_eintr() {
    intr("eintr");
}

/// A handler with SA_RESTART restarts the recv, which then gets its data.
#[test]
fn signal_with_sa_restart_restarts() {
    let (_, stats) = intr("restart");
    assert_eq!(stats.xfer_bytes, 1);
}

/// SO_RCVTIMEO (also set before the connection exists) ends a recv with
/// EAGAIN, and makes a handler's interruption EINTR even with SA_RESTART.
#[test]
fn so_rcvtimeo_is_eagain_and_forbids_restart() {
    intr("rcvtimeo");
}

/// SO_RCVTIMEO set on a listener applies to the SMC-D connections it
/// accepts, as the kernel copies it to an accepted socket.
#[test]
fn listener_so_rcvtimeo_is_inherited() {
    let (out, _) = intr("lrcvtimeo");
    assert!(out.contains("OK peer recv timed out"), "{out}");
}

/// SO_SNDTIMEO bounds a write on a full ring: the partial count, then EAGAIN.
#[test]
fn so_sndtimeo_bounds_a_write() {
    let (out, stats) = intr("sndtimeo");
    let wrote: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("OK wrote "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count\n{out}"));
    assert_eq!(stats.xfer_bytes, wrote, "{out}");
}

/// A process that accepts its own pending non-blocking connect on a
/// listener its parent registered (an nginx worker proxying to a port the
/// workers share) declines it at once (SELF_CONNECT): the handshake it
/// would wait for continues in this very thread after `accept` returns.
#[test]
fn accepting_its_own_pending_connect_declines_at_once() {
    let script = r#"
import errno, os, select, socket, sys, time
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(8)
l.setblocking(False)
port = l.getsockname()[1]
pid = os.fork()
if pid == 0:
    c = socket.socket()
    c.setblocking(False)
    e = c.connect_ex(("127.0.0.1", port))
    assert e in (0, errno.EINPROGRESS), e
    select.select([l], [], [], 5)
    t0 = time.monotonic()
    a, _ = l.accept()
    took = time.monotonic() - t0
    select.select([], [c], [], 5)
    a.setblocking(True)
    c.setblocking(True)
    c.sendall(b"ping")
    got = a.recv(4)
    print("OK accept took %.3f s, got %r" % (took, got))
    os._exit(0 if got == b"ping" else 1)
_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]);
    let (ok, out, stats) = run_preloaded("self-pending", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    // Before, the accept waited for the client until its budget ran out:
    // TIMEOUT on both ends.
    assert_eq!(
        stats.fallback(Reason::SelfConnect),
        (1, 1),
        "SELF_CONNECT (client, server)\n{out}"
    );
    assert_eq!(stats.fallbacks_total(), 2, "fallbacks\n{out}");
}

/// A blocking client's first request travels with the handshake (early
/// bytes, `smclo::adapter::handshake::early`): once an earlier connection joined
/// the two processes, `connect` returns before the server answers, the
/// request goes into the TCP stream, and the server moves it into its ring
/// before it accepts, so its application finds it at once, as a TCP server
/// finds it in its socket. Before, the client's `connect` waited for the
/// server's `accept` and wrote only after it: the server found nothing.
#[test]
fn blocking_clients_first_request_comes_with_the_handshake() {
    let script = r#"
import array, fcntl, os, select, socket, termios, time
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(4)
port = l.getsockname()[1]
reqs = [b"first contact", b"the request that comes early"]
# The server's close of a connection is done (its mapping of the client's
# DMB dropped) before the client connects again.
closed_r, closed_w = os.pipe()
pid = os.fork()
if pid == 0:
    l.close()
    for r in reqs:
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(r)
        got = c.recv(64)
        c.close()
        if got != r[::-1]:
            os._exit(1)
        os.read(closed_r, 1)
    os._exit(0)
for i, r in enumerate(reqs):
    if i:
        # The client has long written its request when the server accepts.
        select.select([l], [], [], 10)
        time.sleep(0.2)
    a, _ = l.accept()
    n = array.array("i", [0])
    fcntl.ioctl(a, termios.FIONREAD, n)
    got = a.recv(64)
    a.sendall(got[::-1])
    a.close()
    os.write(closed_w, b"c")
    print("connection %d: %d bytes there at accept, read %r" % (i, n[0], got))
_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]);
    let (ok, out, stats) = run_preloaded("early", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(
        out.contains(
            "connection 1: 28 bytes there at accept, read b'the request that comes early'"
        ),
        "{out}"
    );
    assert_eq!(stats.conns_opened, 2, "{out}\n{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
    // Both requests and both answers through the rings.
    assert!(stats.xfer_bytes >= 2 * (13 + 28), "{out}\n{stats:?}");
}

/// A blocking connect that returned before the server answered (a server
/// process this one was connected to before) and whose program then idles
/// past its own handshake deadline still ends up SMC-D: the server, which
/// keeps a mapping of the client's DMB, answered without the client, and
/// the client follows that answer at its first call. Nothing falls back.
#[test]
fn an_idle_client_after_an_early_connect_follows_the_server() {
    let (ok, out, stats) = early_pair_with(
        "early-idle",
        r#"c = socket.create_connection(("127.0.0.1", port))
time.sleep(0.8)
c.sendall(b"ping")
got = c.recv(4)
c.close()
if got != b"pong":
    os._exit(1)
"#,
        r#"a, _ = l.accept()
got = a.recv(4)
a.sendall(b"pong" if got == b"ping" else b"FAIL")
a.close()
"#,
        &[("SMCLO_CLC_WAIT_MS", "300")],
    );
    assert_both_smc(ok, &out, &stats);
}

/// A program that connects and closes without a word (a health check),
/// after an early connect whose server has already answered: the server's
/// application reads end of file, as after a TCP client's close. Before,
/// the close hung for good (dropping the withdrawn proposal closed the
/// server's connection through the interposed `close` under the table's
/// lock, which that `close` took again), and with that mended the server
/// read a reset (the client vanished from an accepted connection).
#[test]
fn a_client_that_closes_right_after_an_early_connect_ends_cleanly() {
    let (ok, out, stats) = early_pair(
        "early-close",
        r#"for _ in range(4):
    c = socket.create_connection(("127.0.0.1", port))
    time.sleep(0.05)
    c.close()
"#,
        r#"seen = []
for _ in range(4):
    a, _ = l.accept()
    try:
        seen.append("eof" if a.recv(10) == b"" else "data")
    except OSError as e:
        seen.append(e.strerror)
    a.close()
print("seen", seen)
"#,
    );
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(out.contains("seen ['eof', 'eof', 'eof', 'eof']"), "{out}");
    assert_eq!(stats.conns_opened, 5, "{out}\n{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

/// A server part for [`early_pair`]: accepts, reads to the end of the
/// stream (3 s at most) and prints what it read and how the stream ended.
const READ_TO_END: &str = r#"a, _ = l.accept()
a.settimeout(3)
buf = b""
try:
    while True:
        d = a.recv(64)
        if not d:
            break
        buf += d
    print("read %r then end of stream" % buf)
except OSError as e:
    print("read %r then %r" % (buf, e))
"#;

/// An [`early_pair`] run succeeded with both of its connections SMC-D.
fn assert_both_smc(ok: bool, out: &str, stats: &Stats) {
    assert!(ok && out.contains("OK done"), "{out}");
    assert_eq!(stats.conns_opened, 2, "{out}\n{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

/// The client's first contact, then `body` (a Python snippet run in the
/// child on `port` for its second, early connection) against a server
/// that runs `serve` (which accepts it) on its second connection: shared by the
/// early-byte tests below. The output has the server's `print`s.
fn early_pair(tag: &str, body: &str, serve: &str) -> (bool, String, Stats) {
    early_pair_with(tag, body, serve, &[])
}

/// [`early_pair`] with more environment variables.
fn early_pair_with(
    tag: &str,
    body: &str,
    serve: &str,
    env: &[(&str, &str)],
) -> (bool, String, Stats) {
    let indent = |s: &str, n: usize| {
        s.lines()
            .map(|l| format!("{}{l}\n", " ".repeat(n)))
            .collect::<String>()
    };
    let script = format!(
        r#"
import ctypes, os, select, socket, sys, time
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(4)
port = l.getsockname()[1]
# The server's close of the first connection is done (its mapping of the
# client's DMB dropped, so the client's pool may hand that DMB out again)
# before the client connects again.
closed_r, closed_w = os.pipe()
pid = os.fork()
if pid == 0:
    l.close()
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"x")
    c.recv(1)
    c.close()
    os.read(closed_r, 1)
{}    os._exit(0)
a, _ = l.accept()
a.recv(1)
a.sendall(b"y")
a.close()
os.write(closed_w, b"c")
{}_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#,
        indent(body, 4),
        indent(serve, 0)
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &script]).envs(env.iter().copied());
    run_preloaded(tag, cmd)
}

/// The client of an early connect reads its reply (and the end of the
/// stream) even when the server replied, closed and made another
/// connection before the client followed its answer: the server's DMB,
/// named in its Accept, is not handed to the next connection while the
/// client may still attach it. Before, the server's pool renewed it for
/// the next connection (its attach record was 0: the client had not
/// attached yet), and the client found another token there: ERR_RTOK,
/// the connection reset. `prelude` makes the early connection `c` and
/// writes the request.
fn early_reply_outlives_the_servers_close(tag: &str, prelude: &str) {
    let body = format!(
        r#"{prelude}time.sleep(0.4)
d = socket.create_connection(("127.0.0.1", port))
d.sendall(b"again")
if d.recv(64) != b"reply 2":
    os._exit(2)
d.close()
c.setblocking(True)
got = c.recv(64)
rest = c.recv(64)
c.close()
if got != b"reply" or rest != b"":
    os._exit(1)
"#
    );
    let (ok, out, stats) = early_pair(
        tag,
        &body,
        r#"time.sleep(0.15)
a, _ = l.accept()
print("read %r" % a.recv(64))
a.sendall(b"reply")
a.close()
b, _ = l.accept()
b.recv(64)
b.sendall(b"reply 2")
b.close()
"#,
    );
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(out.contains("read b'request'"), "{out}");
    assert_eq!(stats.conns_opened, 3, "{out}\n{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

#[test]
fn a_blocking_early_clients_reply_outlives_the_servers_close() {
    early_reply_outlives_the_servers_close(
        "early-outlives",
        r#"c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"request")
"#,
    );
}

/// A client whose connections to a server carry one request each learns
/// it (`SMCLO_SHORT`, `smclo::short`): after `LEARN_AFTER` of them through
/// shared memory, the next `FIRST_SKIP` go as TCP without a proposal
/// (SHORT at the client, PEERNOSMC at the server), byte for byte as
/// before; the one after proposes again, and being long (five requests),
/// makes the client forget: the later ones are SMC-D. With
/// `SMCLO_SHORT=smc`, every one is SMC-D.
fn short_then_long(env: &[(&str, &str)]) -> (String, Stats) {
    use smclo::testing::short::{FIRST_SKIP, LEARN_AFTER};
    let script = format!(
        r#"
import os, socket
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(16)
port = l.getsockname()[1]
plan = [1] * ({LEARN_AFTER} + {FIRST_SKIP}) + [5] * 3
pid = os.fork()
if pid == 0:
    l.close()
    for i, n in enumerate(plan):
        c = socket.create_connection(("127.0.0.1", port))
        for k in range(n):
            msg = b"request %d.%d" % (i, k)
            c.sendall(msg)
            got = b""
            while len(got) < len(msg):
                got += c.recv(64)
            if got != msg[::-1]:
                os._exit(1)
        c.close()
    os._exit(0)
for n in plan:
    a, _ = l.accept()
    while True:
        d = a.recv(64)
        if not d:
            break
        a.sendall(d[::-1])
    a.close()
_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &script]).envs(env.iter().copied());
    let (ok, out, stats) = run_preloaded("short", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    (out, stats)
}

#[test]
fn short_connections_are_learnt_and_long_ones_forget_them() {
    use smclo::testing::short::{FIRST_SKIP, LEARN_AFTER};
    let (out, stats) = short_then_long(&[]);
    let learnt = u64::from(LEARN_AFTER);
    assert_eq!(stats.conns_opened, learnt + 3, "{out}\n{stats:?}");
    assert_eq!(
        stats.fallback(Reason::Short),
        (u64::from(FIRST_SKIP), 0),
        "{out}\n{stats:?}"
    );
    assert_eq!(
        stats.fallback(Reason::PeerNoSmc),
        (0, u64::from(FIRST_SKIP)),
        "{out}\n{stats:?}"
    );
    let (out, stats) = short_then_long(&[("SMCLO_SHORT", "smc")]);
    assert_eq!(
        stats.conns_opened,
        learnt + u64::from(FIRST_SKIP) + 3,
        "{out}\n{stats:?}"
    );
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

/// A blocking `accept` whose clients do not propose (plain ones, or
/// clients that learnt their connections short) does not spin: it sleeps
/// in the kernel as over TCP. Before, it polled its listening socket for
/// its budget before each accept, taking a CPU the clients needed (the
/// suite's setup row as deployed: 47% more CPU per connection than TCP).
/// Counted with strace on the server alone: its `ppoll`s (the spin's)
/// beside its accepts.
#[test]
fn an_accept_whose_clients_do_not_propose_does_not_spin() {
    const N: usize = 40;
    let server = format!(
        r#"
import socket, sys
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(64)
print(l.getsockname()[1], flush=True)
for _ in range({N}):
    a, _ = l.accept()
    a.sendall(a.recv(1))
    a.close()
print("OK done", flush=True)
"#
    );
    let dev = DevDir::new("acceptspin");
    let (trace, mut c) = Strace::command(&dev, false, true, "python3".as_ref());
    let mut srv = c
        .args(["-c", &server])
        .stdout(Stdio::piped())
        .spawn()
        .expect("strace (./test.sh runs as root with strace installed)");
    let mut line = String::new();
    let mut stdout = std::io::BufReader::new(srv.stdout.take().expect("stdout"));
    std::io::BufRead::read_line(&mut stdout, &mut line).expect("the server's port");
    let port: u16 = line.trim().parse().expect("a port");
    // The plain client paces its connections, as clients do: a spin would
    // find nothing and run out its budget each time.
    for _ in 0..N {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        std::io::Write::write_all(&mut c, b"x").expect("send");
        let mut b = [0u8; 1];
        std::io::Read::read_exact(&mut c, &mut b).expect("recv");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).expect("the server's output");
    assert!(
        srv.wait().expect("wait").success() && rest.contains("OK done"),
        "{rest}"
    );
    let (report, m) = trace.read();
    assert_eq!(m.get("accept4").copied().unwrap_or(0), N as u64, "{report}");
    // The first accept may spin (no client seen yet); none after it.
    assert!(
        m.get("ppoll").copied().unwrap_or(0) <= 2,
        "the accepts of plain clients spun\n{report}"
    );
}

/// A server that waits for its early connection in an epoll set nested in
/// another (or anything else that trusts the descriptor alone) is woken by
/// the client's request, as over TCP. Before, the server moved the early
/// bytes into its ring with no doorbell: the descriptor stayed unreadable
/// (no event in 2 s) while the request sat in the ring.
#[test]
fn early_bytes_wake_a_server_in_a_nested_epoll_set() {
    let (ok, out, stats) = early_pair(
        "early-nested",
        r#"c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"request")
if c.recv(64) != b"reply":
    os._exit(1)
c.close()
"#,
        r#"a, _ = l.accept()
inner = select.epoll()
inner.register(a.fileno(), select.EPOLLIN)
outer = select.epoll()
outer.register(inner.fileno(), select.EPOLLIN)
ev = outer.poll(2)
print("nested epoll: %d events" % len(ev))
print("read %r" % a.recv(64))
a.sendall(b"reply")
a.close()
"#,
    );
    assert_both_smc(ok, &out, &stats);
    assert!(out.contains("nested epoll: 1 events"), "{out}");
    assert!(out.contains("read b'request'"), "{out}");
}

/// `shutdown(SHUT_WR)` right after an early connect's request reaches the
/// server as end of stream, as over TCP (`nc -N`, HTTP/1.0 clients).
/// Before, it went to the TCP socket while the connection turned SMC-D:
/// the server read the request and then waited for good.
#[test]
fn shutdown_after_an_early_connect_ends_the_stream() {
    let (ok, out, stats) = early_pair(
        "early-shutdown",
        r#"c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"request")
c.shutdown(socket.SHUT_WR)
if c.recv(64) != b"reply":
    os._exit(1)
c.close()
"#,
        &format!("{READ_TO_END}a.sendall(b\"reply\")\na.close()\n"),
    );
    assert_both_smc(ok, &out, &stats);
    assert!(out.contains("read b'request' then end of stream"), "{out}");
}

/// A client that writes its request after an early connect and exits
/// without closing (libc `exit`, which runs no Python finaliser): its
/// server reads the request and then end of stream, as from a TCP client.
/// Before, the exit left the handshake undecided and the server read a
/// reset after the request.
#[test]
fn a_client_that_exits_after_an_early_connect_ends_the_stream() {
    let (ok, out, stats) = early_pair(
        "early-exit",
        r#"c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"fire and forget")
time.sleep(0.2)
sys.stdout.flush()
ctypes.CDLL(None).exit(0)
"#,
        &format!("{READ_TO_END}a.close()\n"),
    );
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(
        out.contains("read b'fire and forget' then end of stream"),
        "{out}"
    );
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

/// The SYN mark stays on an SMC-D connection's TCP socket (see
/// `tcp_syn::LeftMark`), but the program never sees it: its IP options
/// read as it left them (the default, or what it set before connect), and
/// setting one puts the other back too. IPv4 and IPv6.
#[test]
fn smc_connection_ip_options_are_the_programs() {
    let script = r#"
import os, signal, socket
IPV6_TCLASS = getattr(socket, "IPV6_TCLASS", 67)
def opts(c, v6):
    if v6:
        return (c.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS),
                c.getsockopt(socket.IPPROTO_IPV6, IPV6_TCLASS))
    return (c.getsockopt(socket.IPPROTO_IP, socket.IP_TTL),
            c.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
def check(fam, host, port, v6):
    def conn(setup):
        c = socket.socket(fam)
        setup(c)
        c.connect((host, port))
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        return c
    c = conn(lambda c: None)
    got = opts(c, v6)
    assert got == (64, 0), ("default", v6, got)
    c.close()
    if v6:
        set_first = lambda c: c.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 33)
    else:
        set_first = lambda c: c.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 33)
    c = conn(set_first)
    got = opts(c, v6)
    assert got == (33, 0), ("set before connect", v6, got)
    c.close()
    c = conn(lambda c: None)
    if v6:
        c.setsockopt(socket.IPPROTO_IPV6, IPV6_TCLASS, 0x20)
    else:
        c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0x20)
    got = opts(c, v6)
    assert got == (64, 0x20), ("one set after connect", v6, got)
    c.close()
for fam, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    v6 = fam == socket.AF_INET6
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # The listener's process is not the client's (that stays TCP).
        signal.alarm(20)
        l = socket.socket(fam)
        l.bind((host, 0))
        l.listen(8)
        os.write(w, b"%d" % l.getsockname()[1])
        for _ in range(3):
            a, _ = l.accept()
            a.sendall(a.recv(1))
            a.close()
        os._exit(0)
    port = int(os.read(r, 10))
    try:
        check(fam, host, port, v6)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    _, st = os.waitpid(pid, 0)
    assert st == 0, st
print("OK done")
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]);
    let (ok, out, stats) = run_preloaded("ipopts", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    assert_eq!(stats.conns_opened, 6, "SMC-D connections\n{out}");
    assert_eq!(stats.fallbacks_total(), 0, "fallbacks\n{out}");
}

/// A recv with MSG_DONTWAIT while another thread sleeps in a blocking recv
/// on the same descriptor: EAGAIN at once, as over TCP.
#[test]
fn dontwait_recv_beside_a_blocking_recv() {
    let (_, stats) = intr("dontwait");
    assert_eq!(stats.xfer_bytes, 1);
}

/// Python (whose handlers never use SA_RESTART) under signal.alarm(1): a
/// recv from an idle SMC-D peer returns after the alarm, with the handler
/// run (its exception propagates), as over TCP.
#[test]
fn python_recv_is_interrupted_by_alarm() {
    let script = r#"
import os, signal, socket, sys, time
r, w = os.pipe()
pr, pw = os.pipe()
if os.fork() == 0:
    # The peer: a listener in another process (same process stays TCP).
    l = socket.socket()
    l.bind(("127.0.0.1", 0))
    l.listen(1)
    os.write(pw, b"%d" % l.getsockname()[1])
    c, _ = l.accept()
    os.close(w)
    os.read(r, 1)
    os._exit(0)
os.close(r)
s = socket.create_connection(("127.0.0.1", int(os.read(pr, 10))))
class Alarm(Exception):
    pass
def on_alarm(sig, frame):
    raise Alarm()
signal.signal(signal.SIGALRM, on_alarm)
t0 = time.monotonic()
signal.alarm(1)
try:
    s.recv(10)
    print("FAIL recv returned")
    sys.exit(1)
except Alarm:
    print("OK interrupted after %.2f s" % (time.monotonic() - t0))
s.sendall(b"x" * 1000)
os.close(w)
os.wait()
print("OK done")
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]);
    let (ok, out, stats) = run_preloaded("python-alarm", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    let secs: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("OK interrupted after "))
        .and_then(|l| l.trim_end_matches(" s").parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!((0.8..3.0).contains(&secs), "{secs} s\n{out}");
    assert_eq!(stats.conns_opened, 1, "{out}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}");
    assert_eq!(stats.xfer_bytes, 1000, "{out}");
}

/// A writer stopped mid-stream (SIGSTOP for 5 s, and many short stops, as
/// a cgroup freezer or a debugger would) and continued: the reader waits
/// as long as it is stopped, and every byte arrives, in order.
#[test]
fn stopped_writer_mid_stream_loses_nothing() {
    let script = r#"
import os, socket, sys, time
TOTAL = 48 << 20
PAT = bytes(range(256)) * 1024
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    l = socket.socket()
    l.bind(("127.0.0.1", 0))
    l.listen(1)
    os.write(w, b"%d" % l.getsockname()[1])
    c, _ = l.accept()
    sent, k, gap, t = 0, 0, 0.0, time.monotonic()
    while sent < TOTAL:
        n = min((1, 700, 4096, 65536)[k % 4], TOTAL - sent)
        off = sent % 256
        c.sendall(PAT[off:off + n])
        sent += n
        k += 1
        if k % 2 == 0:
            time.sleep(0.001)  # a stream of a few seconds
        now = time.monotonic()
        gap, t = max(gap, now - t), now
    c.close()
    print("GAP %.1f" % gap, flush=True)
    os._exit(0)
print("WRITER %d" % pid, flush=True)
s = socket.create_connection(("127.0.0.1", int(os.read(r, 10))))
got = 0
while True:
    b = s.recv(100000)
    if not b:
        break
    off = got % 256
    if b != PAT[off:off + len(b)]:
        print("FAIL bytes differ at %d" % got)
        sys.exit(1)
    got += len(b)
os.wait()
print("OK %d" % got)
"#;
    let dev = DevDir::new("stopped-writer");
    let mut c = Command::new("python3")
        .args(["-c", script])
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env("SMCLO_DEBUG", "1")
        .env("LD_PRELOAD", lib())
        .env_remove("SMCLO_DISABLE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).expect("python output");
    let writer: i32 = match line.strip_prefix("WRITER ") {
        Some(p) => p.trim().parse().unwrap(),
        None => {
            let _ = c.kill();
            panic!("no writer: {line}");
        }
    };
    std::thread::sleep(Duration::from_millis(300));
    let stop = |d: Duration| {
        // SAFETY: signals the writer process, which the test's child reaps
        // only after the stream.
        unsafe { libc::kill(writer, libc::SIGSTOP) };
        std::thread::sleep(d);
        // SAFETY: as above.
        unsafe { libc::kill(writer, libc::SIGCONT) };
    };
    stop(Duration::from_secs(5));
    for i in 0..60 {
        stop(Duration::from_millis(10 + i % 7 * 5));
        std::thread::sleep(Duration::from_millis(3));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = out.read_to_string(&mut rest);
        let _ = tx.send(rest);
    });
    let out = finish_detached(c, rx);
    let stats = dev.stats();
    let text = format!("stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    let total = 48u64 << 20;
    assert!(
        out.ok && out.stdout.contains(&format!("OK {total}")),
        "{text}"
    );
    // The long stop was mid-stream: the writer saw it.
    let gap: f64 = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("GAP "))
        .and_then(|g| g.trim().parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(gap >= 4.5, "the writer was not stopped mid-stream\n{text}");
    assert_eq!(stats.conns_opened, 1, "{text}");
    assert_eq!(stats.fallbacks_total(), 0, "{text}");
    assert_eq!(stats.xfer_bytes, total, "{text}");
}

/// A blocking connect that returned before the server answered is
/// writable at once, as a connected TCP socket is: `select` for writing
/// reports it and a `MSG_DONTWAIT` send goes out (as early bytes), while
/// the server has not even accepted. Before, writability was hidden and
/// the send failed with EAGAIN until the server accepted.
#[test]
fn an_early_connect_is_writable_before_the_server_accepts() {
    let (ok, out, stats) = early_pair(
        "early-writable",
        r#"c = socket.create_connection(("127.0.0.1", port))
_, w, _ = select.select([], [c], [], 0.2)
if not w:
    os._exit(2)
try:
    c.send(b"req", socket.MSG_DONTWAIT)
except OSError:
    os._exit(3)
c.sendall(b"uest")
if c.recv(64) != b"reply":
    os._exit(4)
c.close()
"#,
        r#"time.sleep(0.5)
a, _ = l.accept()
buf = b""
while len(buf) < 7:
    buf += a.recv(64)
print("read %r" % buf)
a.sendall(b"reply")
a.close()
"#,
    );
    assert_both_smc(ok, &out, &stats);
    assert!(out.contains("read b'request'"), "{out}");
}

/// Early bytes leave with the program's TTL and TOS, not the SYN's mark
/// (which only told the server which proposal it answers): a packet
/// socket on `lo` sees the request's segment with the defaults. Before,
/// the mark stayed on until the handshake decided, and the request went
/// out with the SYN's random TTL and DSCP.
#[test]
fn early_bytes_leave_without_the_syn_mark() {
    let (ok, out, stats) = early_pair(
        "early-mark",
        r#"r = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
r.bind(("lo", 0))
r.settimeout(2)
c = socket.create_connection(("127.0.0.1", port))
c.sendall(b"early-mark-check")
seen = None
t0 = time.time()
while seen is None and time.time() - t0 < 2:
    ip = r.recv(65535)[14:]
    if ip[9] != 6:
        continue
    tcp = ip[(ip[0] & 15) * 4:]
    if tcp[(tcp[12] >> 4) * 4:] == b"early-mark-check":
        seen = (ip[1], ip[8])
print("request sent with %s" % ("tos %d ttl %d" % seen if seen else "no TCP segment"))
sys.stdout.flush()
if c.recv(64) != b"reply":
    os._exit(1)
c.close()
"#,
        r#"# Accepted late, so the request goes early whatever the load.
time.sleep(0.3)
a, _ = l.accept()
buf = b""
while len(buf) < 16:
    buf += a.recv(64)
a.sendall(b"reply")
a.close()
"#,
    );
    let ttl = std::fs::read_to_string("/proc/sys/net/ipv4/ip_default_ttl").unwrap();
    assert_both_smc(ok, &out, &stats);
    assert!(
        out.contains(&format!("request sent with tos 0 ttl {}", ttl.trim())),
        "{out}"
    );
}

/// An early connect's socket turned non-blocking, in an edge-triggered
/// epoll set: a send that must wait for the decision (more than the early
/// bytes' bound) fails with EAGAIN, and the program waits for the next
/// EPOLLOUT edge, which the decision brings, here TCP (the server accepts
/// after the client's `SMCLO_CLC_WAIT_MS`). Before, the fallback left the
/// registration alone (writability had never been hidden), no edge came
/// and the request was never sent.
#[test]
fn an_early_connect_that_falls_back_wakes_an_edge_triggered_writer() {
    let (ok, out, stats) = early_pair_with(
        "early-et",
        r#"c = socket.create_connection(("127.0.0.1", port))
c.setblocking(False)
ep = select.epoll()
ep.register(c.fileno(), select.EPOLLOUT | select.EPOLLET)
ep.poll(1)
big = b"z" * 10000
sent = 0
try:
    sent = c.send(big)
except BlockingIOError:
    print("EAGAIN before the decision", flush=True)
    print("then %d events" % len(ep.poll(3)), flush=True)
c.setblocking(True)
c.sendall(big[sent:])
if c.recv(64) != b"reply":
    os._exit(1)
c.close()
"#,
        r#"time.sleep(0.6)
a, _ = l.accept()
buf = b""
while len(buf) < 10000:
    buf += a.recv(65536)
print("read %d bytes" % len(buf))
a.sendall(b"reply")
a.close()
"#,
        &[("SMCLO_CLC_WAIT_MS", "300")],
    );
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(out.contains("EAGAIN before the decision"), "{out}");
    assert!(out.contains("then 1 events"), "{out}");
    assert!(out.contains("read 10000 bytes"), "{out}");
    // The first contact over SMC-D, the second fell back (TIMEOUT).
    assert_eq!(stats.conns_opened, 1, "{out}\n{stats:?}");
    assert!(stats.fallback(Reason::Timeout).0 >= 1, "{out}\n{stats:?}");
}

/// An event loop's `shutdown` on a connection whose handshake is still
/// undecided (its client stopped right after its connect) returns at
/// once; the end of stream reaches the client when the handshake decides,
/// here SMC-D. Before, `shutdown` waited for the stopped client.
#[test]
fn an_event_loops_shutdown_of_an_undecided_connection_does_not_wait() {
    let script = r#"
import os, select, signal, socket, time
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(4)
port = l.getsockname()[1]
pid = os.fork()
if pid == 0:
    l.close()
    c = socket.socket()
    c.setblocking(False)
    try:
        c.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    os.kill(os.getpid(), signal.SIGSTOP)
    select.select([], [c], [], 10)
    c.setblocking(True)
    c.settimeout(5)
    print("client read %r" % c.recv(64), flush=True)
    c.close()
    os._exit(0)
os.waitpid(pid, os.WUNTRACED)
l.setblocking(False)
select.select([l], [], [], 5)
a, _ = l.accept()
a.setblocking(False)
t0 = time.time()
a.shutdown(socket.SHUT_WR)
print("shutdown took %d ms" % int((time.time() - t0) * 1000))
os.kill(pid, signal.SIGCONT)
a.setblocking(True)
a.settimeout(5)
print("server read %r" % a.recv(64))
a.close()
_, st = os.waitpid(pid, 0)
print("OK done" if st == 0 else "FAIL child %d" % st)
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]).env("SMCLO_CLC_WAIT_MS", "5000");
    let (ok, out, stats) = run_preloaded("shutdown-undecided", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    let took: u64 = out
        .split("shutdown took ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(took < 500, "shutdown waited {took} ms\n{out}");
    assert!(out.contains("client read b''"), "{out}");
    assert!(out.contains("server read b''"), "{out}");
    assert_eq!(stats.conns_opened, 1, "{out}\n{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{out}\n{stats:?}");
}

/// A program that blocks `SIGBUS` sees it blocked, while the kernel's mask
/// does not have it (a fault in a shared file smclo maps would otherwise
/// kill the thread, see `apptests/tests/group.rs`); a fault of the
/// program's own with `SIGBUS` blocked still kills it by `SIGBUS`, as
/// without smclo.
#[test]
fn a_blocked_sigbus_is_the_programs_view_and_its_own_faults_still_kill() {
    let script = r#"
import mmap, os, re, signal, sys, tempfile
def kernel_blocks(sig):
    with open("/proc/thread-self/status") as f:
        blk = int(re.search(r"SigBlk:\s*([0-9a-f]+)", f.read()).group(1), 16)
    return bool(blk >> (sig - 1) & 1)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGBUS, signal.SIGUSR1})
view = signal.pthread_sigmask(signal.SIG_BLOCK, [])
print("view", signal.SIGBUS in view, signal.SIGUSR1 in view)
print("kernel", kernel_blocks(signal.SIGBUS), kernel_blocks(signal.SIGUSR1))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGBUS})
print("unblocked", signal.SIGBUS in signal.pthread_sigmask(signal.SIG_BLOCK, []))
signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGBUS})
sys.stdout.flush()
f = tempfile.TemporaryFile()
f.truncate(mmap.PAGESIZE)
m = mmap.mmap(f.fileno(), mmap.PAGESIZE)
f.truncate(0)
m[0]
print("FAIL survived the fault")
"#;
    let run = |preload: bool| {
        let dev = DevDir::new("sigbus-view");
        let mut c = Command::new("python3");
        c.args(["-c", script])
            .env("SMCLO_DEVICE_DIR", &dev.0)
            .env_remove("SMCLO_DISABLE")
            .stdin(Stdio::null());
        with_preload(&mut c, preload).output().expect("python3")
    };
    let expect =
        |kernel_bus: &str| format!("view True True\nkernel {kernel_bus} True\nunblocked False\n");
    for (preload, kernel_bus) in [(false, "True"), (true, "False")] {
        let r = run(preload);
        let out = String::from_utf8_lossy(&r.stdout);
        assert_eq!(out, expect(kernel_bus), "preload {preload}: {r:?}");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&r.status),
            Some(libc::SIGBUS),
            "preload {preload}: {r:?}"
        );
    }
}

/// Python: a peer in a forked child that answers the first 8 bytes
/// reversed and exits 0 if they were `via-dup!`; `port` is its port,
/// `read8` reads 8 bytes with a `recv`, `peer_done` prints whether the
/// peer was content. It accepts after `ACCEPT_DELAY` seconds if the
/// script defines that.
const REVERSING_PEER: &str = r#"
import time
def read8(recv):
    got = b""
    while len(got) < 8:
        b = recv(8 - len(got))
        if not b:
            break
        got += b
    return got
def peer_done():
    _, st = os.wait()
    print("OK done" if st == 0 else "FAIL server %d" % st)
pr, pw = os.pipe()
if os.fork() == 0:
    l = socket.socket()
    l.bind(("127.0.0.1", 0))
    l.listen(1)
    os.write(pw, b"%d" % l.getsockname()[1])
    time.sleep(globals().get("ACCEPT_DELAY", 0))
    c, _ = l.accept()
    got = read8(c.recv)
    c.sendall(got[::-1])
    os._exit(0 if got == b"via-dup!" else 1)
port = int(os.read(pr, 10))
"#;

/// A socket duplicated before its connect stays TCP, so that both numbers
/// carry the connection: a swap replaces one number only. Before, the
/// `dup` still named the TCP socket after the swap, and what the program
/// wrote through it was lost (the write succeeded, the peer never read it).
#[test]
fn a_socket_duplicated_before_its_connect_stays_tcp() {
    let script = format!(
        r#"
import os, socket
{REVERSING_PEER}
s = socket.socket()
d = os.dup(s.fileno())
s.connect(("127.0.0.1", port))
os.write(d, b"via-dup!")
print("echo", read8(s.recv).decode())
peer_done()
"#
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &script]);
    let (ok, out, stats) = run_preloaded("dup-before-connect", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(out.lines().any(|l| l == "echo !pud-aiv"), "{out}");
    assert_eq!(stats.conns_opened, 0, "TCP\n{out}");
}

/// A connection's own number closed while a `dup` of it still names the
/// connection (an inetd-style server's `dup2(s, 0); dup2(s, 1);
/// close(s)`): the number is free at once, as over TCP: the next `open`
/// gets it and `dup2` onto it works, while the connection goes on at the
/// other numbers. Before, the number stayed open for the connection: the
/// `open` got another number and `dup2` onto it failed with `EBUSY`.
#[test]
fn closing_a_connections_own_number_beside_a_dup_frees_the_number() {
    let script = format!(
        r#"
import os, socket
{REVERSING_PEER}
s = socket.socket()
s.connect(("127.0.0.1", port))
n = s.detach()
d = os.dup(n)
os.close(n)
f = os.open("/dev/null", os.O_RDONLY)
print("reused", f == n)
os.close(f)
r, w = os.pipe()
print("dup2", os.dup2(r, n) == n)
os.close(n)
os.write(d, b"via-dup!")
print("echo", read8(lambda k: os.read(d, k)).decode())
peer_done()
"#
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &script]);
    let (ok, out, stats) = run_preloaded("close-own-number", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    for line in ["reused True", "dup2 True", "echo !pud-aiv"] {
        assert!(out.lines().any(|l| l == line), "no {line:?}:\n{out}");
    }
    assert_eq!(stats.conns_opened, 1, "SMC-D\n{out}");
}

/// A socket duplicated by another thread while its blocking connect waits
/// for the server: the `dup` waits for the connection's decision and then
/// names the connection, SMC-D here, as a pending connect's `dup` does.
/// Before, the `dup` ended the candidacy after the handshake had committed
/// both ends to SMC-D, the swap was refused and the connection reset.
#[test]
fn a_socket_duplicated_during_its_blocking_connect_keeps_its_connection() {
    let script = format!(
        r#"
import os, socket, threading
ACCEPT_DELAY = 0.6
{REVERSING_PEER}
s = socket.socket()
n = s.fileno()
dups = []
def dup_later():
    time.sleep(0.2)
    dups.append(os.dup(n))
t = threading.Thread(target=dup_later)
t.start()
s.connect(("127.0.0.1", port))
t.join()
os.write(dups[0], b"via-dup!")
print("echo", read8(s.recv).decode())
peer_done()
"#
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &script]);
    let (ok, out, stats) = run_preloaded("dup-in-connect", cmd);
    assert!(ok && out.contains("OK done"), "{out}");
    assert!(out.lines().any(|l| l == "echo !pud-aiv"), "{out}");
    assert_eq!(stats.conns_opened, 1, "SMC-D\n{out}");
}

/// A thread that closes a socket while another waits in its blocking
/// connect, and opens a file that gets the same number: the file stays
/// the file, as over TCP (the connection that decided meanwhile ends).
/// Before, the swap took the file for the connection's TCP socket, hid it
/// and put the channel at its number.
#[test]
fn a_number_closed_during_a_blocking_connect_is_not_swapped() {
    let script = r#"
import os, socket, stat, threading, time
pr, pw = os.pipe()
if os.fork() == 0:
    l = socket.socket()
    l.bind(("127.0.0.1", 0))
    l.listen(1)
    os.write(pw, b"%d" % l.getsockname()[1])
    time.sleep(0.6)
    c, _ = l.accept()
    time.sleep(0.5)
    os._exit(0)
port = int(os.read(pr, 10))
s = socket.socket()
n = s.fileno()
def connect():
    try:
        s.connect(("127.0.0.1", port))
    except OSError as e:
        print("connect", e.errno)
t = threading.Thread(target=connect)
t.start()
time.sleep(0.2)
os.close(n)
path = os.path.join(os.environ["TMPDIR"], "held-file")
with open(path, "w") as f:
    f.write("mine")
f = os.open(path, os.O_RDONLY)
print("reused", f == n)
t.join()
print("regular", stat.S_ISREG(os.fstat(f).st_mode))
print("read", os.read(f, 10).decode())
os.wait()
print("OK done")
"#;
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "held-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]).env("TMPDIR", &tmp);
    let (ok, out, _) = run_preloaded("closed-in-connect", cmd);
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(ok && out.contains("OK done"), "{out}");
    for line in ["reused True", "regular True", "read mine"] {
        assert!(out.lines().any(|l| l == line), "no {line:?}:\n{out}");
    }
}

/// A program started with `SIGBUS` blocked (a mask inherited through
/// exec) sees it blocked, while the kernel's mask of its thread does not
/// have it. Before, the inherited mask stayed in the kernel, and a
/// truncated device killed the program.
#[test]
fn a_sigbus_blocked_across_exec_moves_to_the_programs_view() {
    let child = r#"
import re, signal
with open("/proc/thread-self/status") as f:
    blk = int(re.search(r"SigBlk:\s*([0-9a-f]+)", f.read()).group(1), 16)
print("view", signal.SIGBUS in signal.pthread_sigmask(signal.SIG_BLOCK, []))
print("kernel", bool(blk >> (signal.SIGBUS - 1) & 1))
"#;
    let parent = r#"
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGBUS})
env = dict(os.environ, LD_PRELOAD=sys.argv[1])
os.execvpe("python3", ["python3", "-c", sys.argv[2]], env)
"#;
    let dev = DevDir::new("sigbus-exec");
    let r = Command::new("python3")
        .args(["-c", parent])
        .arg(lib())
        .arg(child)
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env_remove("SMCLO_DISABLE")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .output()
        .expect("python3");
    let out = String::from_utf8_lossy(&r.stdout);
    assert_eq!(out, "view True\nkernel False\n", "{r:?}");
}
