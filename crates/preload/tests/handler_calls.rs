//! Signal handlers under the preload.
//!
//! Handlers that call socket functions (async-signal-safe in
//! POSIX) while the thread they interrupt is inside the preload's hooks
//! for the same functions. The hooks that change a descriptor's state
//! hold the preload's table lock, which is not re-entrant: a handler run
//! in the middle of one and taking it again waited for its own thread for
//! ever. The program's handlers now run once the lock is let go.
//! Each run is bounded by a timeout; a hang is its failure.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::{compile, lib};

/// How long each run's main loop lasts (s).
const SECONDS: &str = "2";
/// A run that has not ended by then is hung (s).
const HUNG_AFTER: &str = "30";

/// `tests/c/handler_calls.c` in `mode` under the preload: its loops,
/// handler runs and the device's counters.
fn run(mode: &str) -> (u64, u64, smclo::device::Stats) {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("handler_calls", &[]));
    let dev = smclo_testsupport::DevDir::new(&format!("handler-calls-{mode}"));
    let out = Command::new("timeout")
        .args(["-s", "KILL", HUNG_AFTER])
        .arg(exe)
        .args([mode, SECONDS])
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev.0)
        // Every connection proposes, though each carries one byte.
        .env("SMCLO_SHORT", "smc")
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run handler_calls");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{mode}: {:?} (killed by signal 9: hung for {HUNG_AFTER} s)\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let f: Vec<u64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("OK "))
        .unwrap_or_else(|| panic!("{mode}: no OK line: {stdout}"))
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    let stats = smclo::device::Device::open(&dev.0)
        .expect("open the test device")
        .stats();
    (f[0], f[1], stats)
}

#[test]
fn a_handler_that_makes_and_closes_sockets_does_not_hang_its_thread() {
    let (loops, handled, _) = run("socket");
    assert!(
        loops > 1000 && handled > 1000,
        "{loops} loops, {handled} handler runs"
    );
}

#[test]
fn a_handler_that_makes_and_closes_listeners_does_not_hang_its_thread() {
    let (loops, handled, _) = run("listen");
    assert!(
        loops > 100 && handled > 100,
        "{loops} loops, {handled} handler runs"
    );
}

/// The handler closes SMC-D connections while the thread it interrupts
/// makes and closes sockets and connects.
#[test]
fn a_handler_that_closes_connections_does_not_hang_its_thread() {
    let (loops, closed, stats) = run("close");
    assert!(
        loops > 100 && closed > 100,
        "{loops} loops, {closed} connections closed by the handler"
    );
    assert!(
        stats.conns_opened > 100,
        "the connections were SMC-D: {stats:?}"
    );
}

/// `tests/c/handler_mask.c` in `mode`, with or without the preload: its
/// output and how it ended.
fn run_mask(mode: &str, preload: bool) -> (String, std::process::ExitStatus) {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("handler_mask", &[]));
    let dev = smclo_testsupport::DevDir::new(&format!("handler-mask-{mode}"));
    let mut c = Command::new("timeout");
    c.args(["-s", "KILL", HUNG_AFTER])
        .arg(exe)
        .arg(mode)
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env_remove("SMCLO_DISABLE");
    if preload {
        c.env("LD_PRELOAD", lib());
    } else {
        c.env_remove("LD_PRELOAD");
    }
    let out = c.output().expect("run handler_mask");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status,
    )
}

/// A handler's mask (`sa_mask`, here every signal) never blocks `SIGBUS`
/// in the kernel while it runs: a fault in a shared file another process
/// shrank would kill the thread instead of breaking a connection. The
/// program's queries and its view inside the handler still have it, and a
/// fault of the program's own there still kills it by `SIGBUS`, as
/// without smclo.
#[test]
fn a_handlers_mask_never_blocks_sigbus_in_the_kernel() {
    use std::os::unix::process::ExitStatusExt;
    for (preload, kernel) in [(false, 1), (true, 0)] {
        let (out, status) = run_mask("mask", preload);
        assert_eq!(
            out,
            format!("query 1\nhandler kernel {kernel} view 1\nafter kernel 0 view 0\n"),
            "preload {preload}: {status:?}"
        );
        assert!(status.success(), "preload {preload}: {status:?}");
        let (out, status) = run_mask("fault", preload);
        assert_eq!(
            status.signal(),
            Some(libc::SIGBUS),
            "preload {preload}: the program's own fault kills it\n{out}"
        );
    }
}

/// The program's first listen opens the device, which waits for a lock
/// another process holds (here for 4 s): a signal handler due meanwhile
/// runs on time. Before, the wait was a section that deferred it until
/// the lock was let go.
#[test]
fn a_handler_runs_while_the_device_setup_waits() {
    let exe = compile("setup_signal", &[]);
    let dev = smclo_testsupport::DevDir::new("setup-signal");
    let dev_dir = dev.0.to_string_lossy().into_owned();
    // The device exists, with its pid-namespace lock file, after one run.
    let first = Command::new(&exe)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run setup_signal");
    assert!(first.status.success(), "{first:?}");
    let lock = std::fs::read_dir(&dev.0)
        .expect("device directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pidns-"))
        })
        .expect("a pidns lock file");
    let mut holder = Command::new("flock")
        .arg("-x")
        .arg(&lock)
        .args(["sleep", "4"])
        .spawn()
        .expect("flock");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = Command::new("timeout")
        .args(["-s", "KILL", HUNG_AFTER])
        .arg(&exe)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev_dir)
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run setup_signal");
    let _ = holder.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ms: f64 = stdout
        .trim()
        .strip_prefix("OK ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!(
        (900.0..2500.0).contains(&ms),
        "the handler due at 1 s ran at {ms} ms (the lock was held 4 s)"
    );
}

/// `tests/c/cork_signals.c` in `mode` with `args` under the preload, on a
/// device of its own: checks that it ended well over SMC-D connections.
fn run_cork(mode: &str, args: &[&str]) {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("cork_signals", &[]));
    let dev = smclo_testsupport::DevDir::new(&format!("cork-signals-{mode}"));
    let out = Command::new("timeout")
        .args(["-s", "KILL", HUNG_AFTER])
        .arg(exe)
        .arg(mode)
        .args(args)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env("SMCLO_SHORT", "smc")
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run cork_signals");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("OK "),
        "{mode}: {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stats = smclo::device::Device::open(&dev.0)
        .expect("open the test device")
        .stats();
    assert!(
        stats.conns_opened > 0,
        "{mode}: SMC-D connections: {stats:?}"
    );
}

/// A program that blocks SIGTERM to take it on a signalfd gets it there
/// after it corked an SMC-D connection. Before, the preload's cork
/// flusher thread did not block it, so the kernel delivered it there and
/// its default action ended the process (status 143).
#[test]
fn a_signal_the_program_blocks_never_lands_on_the_cork_flusher() {
    run_cork("signalfd", &[]);
}

/// A handler that corks a connection while its thread's first corked
/// write starts the cork flusher with the queue locked. Before, the
/// handler waited for that lock, held by its own thread, for ever: 10 of
/// 10 children hung.
#[test]
fn a_handler_that_corks_while_its_thread_queues_a_cork_does_not_hang() {
    run_cork("spawn", &["10"]);
}
