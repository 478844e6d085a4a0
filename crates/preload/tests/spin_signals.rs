//! Signal handlers that run while a wait spins in user space interrupt it
//! as they would the kernel's sleep: `EINTR` from epoll, poll and select
//! always, from a blocking recv, send or accept unless `SA_RESTART` restarts it
//! (signal(7)). Before, the spin went on after the handler and the thread
//! then slept in the kernel until data or the timeout (5 s here; for ever
//! for a blocking recv on an idle connection). `SMCLO_SPIN_US` is raised
//! so that a signal sent 20 ms into a wait comes while it spins; the
//! device's counters prove the connection was SMC-D.

use smclo::device::{Device, Stats};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::{compile, compile_with_late_atfork, lib};

/// The spin budget of the runs (µs): 200 ms, ten times the signal's delay.
const WIDE_SPIN_US: &str = "200000";

/// A wait ended by the signal returns within this (the signal comes after
/// 20 ms; the wait's timeout is 5 s, the rescuing second signal 3 s).
const INTERRUPTED_MS: u64 = 1000;

/// One wait's report: `WAIT name rc errno ms handled`.
#[derive(Debug)]
struct Wait {
    name: String,
    rc: i64,
    errno: i32,
    ms: u64,
    handled: u32,
}

fn waits(out: &str) -> Vec<Wait> {
    out.lines()
        .filter_map(|l| l.strip_prefix("WAIT "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Wait {
                name: f[0].to_string(),
                rc: f[1].parse().unwrap(),
                errno: f[2].parse().unwrap(),
                ms: f[3].parse().unwrap(),
                handled: f[4].parse().unwrap(),
            }
        })
        .collect()
}

/// `tests/c/spin_signals.c` in `mode` under the preload with a spin
/// budget of `spin_us`, on a fresh device: its output and counters.
fn run(mode: &str, spin_us: &str) -> (String, Stats) {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("spin_signals", &[]));
    run_program(
        &format!("{mode}-{spin_us}"),
        exe.as_os_str(),
        &[mode],
        spin_us,
    )
}

/// `program args` under the preload with a spin budget of `spin_us`, on
/// a fresh device (`tag` names it), at most 60 s: its output and
/// counters, once it succeeded ("OK done") over one SMC-D connection.
fn run_program(tag: &str, program: &OsStr, args: &[&str], spin_us: &str) -> (String, Stats) {
    let dev = PathBuf::from(format!(
        "/dev/shm/smclo-spin-signals-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dev);
    let out = Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev)
        .env("SMCLO_SPIN_US", spin_us)
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run the test program");
    let stats = Device::open(&dev).expect("open the test device").stats();
    let _ = std::fs::remove_dir_all(&dev);
    let text = format!(
        "stdout:\n{}\nstderr:\n{}\nstats: {stats:?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("OK done"),
        "{tag} failed\n{text}"
    );
    assert_eq!(stats.conns_opened, 1, "one SMC-D connection\n{text}");
    assert_eq!(stats.fallbacks_total(), 0, "no fallback\n{text}");
    (text, stats)
}

/// Every wait of `out` named in `names` failed with EINTR soon after the
/// one signal, whose handler ran once.
fn all_interrupted(out: &str, names: &[&str]) {
    let w = waits(out);
    for name in names {
        let Some(x) = w.iter().find(|x| x.name == *name) else {
            panic!("no report of {name}\n{out}");
        };
        assert!(
            x.rc == -1 && x.errno == libc::EINTR && x.ms < INTERRUPTED_MS && x.handled == 1,
            "{name}: {x:?}, expected -1 EINTR within {INTERRUPTED_MS} ms after one handler\n{out}"
        );
    }
}

const ALL_WAITS: [&str; 10] = [
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "poll",
    "ppoll",
    "select",
    "pselect",
    "recv",
    "send",
    "accept",
];

/// A handler without SA_RESTART that runs while a wait spins ends every
/// wait with EINTR, as it would the kernel's sleep.
#[test]
fn a_handler_during_the_spin_interrupts_every_wait() {
    let (out, stats) = run("eintr", WIDE_SPIN_US);
    all_interrupted(&out, &ALL_WAITS);
    let filled: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("FILLED "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no fill count\n{out}"));
    assert_eq!(stats.xfer_bytes, filled, "the ring was filled\n{out}");
}

/// With no spinning at all the signal comes while the waits sleep in the
/// kernel: the same results.
#[test]
fn without_spinning_the_waits_are_interrupted_too() {
    let (out, _) = run("eintr", "0");
    all_interrupted(&out, &ALL_WAITS);
}

/// A handler whose signal the wait's mask blocks (it ran in the spin only
/// because the thread's own mask lets it in) does not end the wait, which
/// times out as the kernel's would; nor does a handler in another thread.
#[test]
fn a_signal_the_waits_mask_blocks_does_not_interrupt() {
    let (out, _) = run("masked", WIDE_SPIN_US);
    let w = waits(&out);
    assert_eq!(w.len(), 3, "{out}");
    for x in &w {
        assert!(
            x.rc == 0 && (250..3000).contains(&x.ms) && x.handled == 1,
            "{}: {x:?}, expected a timeout after 300 ms\n{out}",
            x.name
        );
    }
}

/// With SA_RESTART, poll still fails with EINTR, and a blocking recv is
/// restarted: it returns the byte the peer sends after 500 ms. So is a
/// blocking accept interrupted in its spin (`smclo::adapter::accept_spin`): it
/// fails only when the listening socket is shut down, after 500 ms, also
/// with a send timeout set on the socket; with a receive timeout it fails
/// with EINTR, as the kernel's.
#[test]
fn sa_restart_restarts_a_recv_interrupted_in_its_spin() {
    let (out, _) = run("restart", WIDE_SPIN_US);
    all_interrupted(&out, &["poll"]);
    let w = waits(&out);
    let r = w.iter().find(|x| x.name == "recv").expect("recv report");
    assert!(
        r.rc == 1 && r.ms >= 400 && r.handled == 1,
        "recv: {r:?}, expected the byte after the restart\n{out}"
    );
    for name in ["accept", "accept_sndtimeo"] {
        let a = w.iter().find(|x| x.name == name).expect("accept report");
        assert!(
            a.rc == -1 && a.errno == libc::EINVAL && a.ms >= 400 && a.handled == 1,
            "{name}: {a:?}, expected EINVAL at the shutdown after the restart\n{out}"
        );
    }
    // A receive timeout makes the kernel's accept fail with EINTR.
    all_interrupted(&out, &["accept_rcvtimeo"]);
}

/// The preload's wrapping of handlers is invisible: sigaction queries
/// return the program's handler, flags and mask, SA_RESETHAND, SIG_IGN,
/// signal, sysv_signal, sigset and siginterrupt behave as glibc's. The
/// same program without the preload is the control.
#[test]
fn wrapped_handlers_read_back_as_installed() {
    let exe = compile("spin_signals", &[]);
    for preload in [true, false] {
        let mut cmd = Command::new("timeout");
        cmd.arg("20")
            .arg(&exe)
            .arg("actions")
            .env_remove("LD_PRELOAD");
        if preload {
            cmd.env("LD_PRELOAD", lib());
        }
        let out = cmd.output().expect("run spin_signals actions");
        let text = format!(
            "preload {preload}\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("OK done"), "{text}");
        assert_eq!(
            text.contains("OK the kernel runs the trampoline"),
            preload,
            "{text}"
        );
    }
    let _ = std::fs::remove_file(&exe);
}

/// Python's handlers (installed without SA_RESTART): SIGALRM 20 ms into
/// a blocking recv, a selectors (epoll) wait and a recv with a timeout
/// (poll) on an idle connection raises the handler's exception at once.
#[test]
fn python_alarm_during_the_spin_interrupts_recv_and_selectors() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/spin_signals.py");
    let (out, _) = run_program(
        "python",
        OsStr::new("python3"),
        &[script.to_str().unwrap()],
        WIDE_SPIN_US,
    );
    for name in ["recv", "selectors", "recv_timeout"] {
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("PY {name} ")))
            .unwrap_or_else(|| panic!("no report of {name}\n{out}"));
        let (result, ms) = line.split_once(' ').unwrap();
        let ms: u64 = ms.parse().unwrap();
        assert!(
            result == "alarm" && ms < INTERRUPTED_MS,
            "{name}: {result} after {ms} ms, expected the alarm within {INTERRUPTED_MS} ms\n{out}"
        );
    }
}

/// A signal that comes after a wait was called but before it began to
/// wait (here: while it takes the descriptor table's lock, which another
/// thread's fork holds for 400 ms) runs its handler when the preload's
/// section ends; the wait then fails with EINTR, as the kernel's call
/// would have, and does not spin and sleep as if nothing came (which ended
/// only at the rescuing signal, after 3 s). `tests/c/late_signal.c`,
/// linked with `tests/c/late_atfork.c` (a library whose fork handler runs
/// inside the preload's hold of the lock).
#[test]
fn a_signal_deferred_before_the_wait_begins_still_interrupts_it() {
    let (exe, so) = compile_with_late_atfork("late_signal");
    // Spinning and not: a wait that does not spin checks before it sleeps.
    for spin_us in [WIDE_SPIN_US, "0"] {
        let (out, _) = run_program(&format!("late-{spin_us}"), exe.as_os_str(), &[], spin_us);
        all_interrupted(&out, &["poll", "select", "epoll_wait", "recv", "accept"]);
    }
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&so);
}
