//! What the preload's test binaries share: the library under test, the C
//! programs they run under it (built by smclo-testsupport) and runs of them
//! on a device of their own.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;

/// `libsmclo_preload.so` from this build.
pub fn lib() -> PathBuf {
    smclo_testsupport::built("libsmclo_preload.so")
}

/// Compilations so far: each writes a file of its own, so that tests of
/// one file that compile the same program at once do not share one.
static COMPILES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Compiles `tests/c/NAME.c` (with `extra`) into the test's temporary
/// directory.
pub fn compile(name: &str, extra: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let k = COMPILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("preload-{name}-{}-{k}", std::process::id()));
    smclo_testsupport::compile_c(&src, &out, extra)
}

/// Compiles `tests/c/NAME.c` linked with `tests/c/late_atfork.c` (a
/// library whose constructor registers a fork handler before the
/// preload's, which therefore runs inside the preload's part of `fork`):
/// the program, and the library beside it.
pub fn compile_with_late_atfork(name: &str) -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let k = COMPILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let so = tmp.join(format!("liblate_atfork-{}-{k}.so", std::process::id()));
    smclo_testsupport::compile_c(&dir.join("late_atfork.c"), &so, &["-shared", "-fPIC"]);
    let exe = tmp.join(format!("preload-{name}-{}-{k}", std::process::id()));
    let rpath = format!("-Wl,-rpath,{}", tmp.display());
    smclo_testsupport::compile_c_with(
        std::ffi::OsStr::new("cc"),
        &smclo_testsupport::CFLAGS,
        &dir.join(format!("{name}.c")),
        &exe,
        &[so.to_str().expect("a UTF-8 path"), &rpath],
    );
    (exe, so)
}

/// Runs of [`run_smc`] so far: each gets a device directory of its own.
static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// `perf stat` for [`run_smc`]: its options naming the events (`-e EVENT`
/// pairs, each perhaps followed by `--filter F`), and the file it writes.
pub struct Perf<'a> {
    pub events: &'a [&'a str],
    pub out: &'a Path,
}

/// Runs `exe args` (a test program whose first argument is its mode, which
/// prints `OK <bytes read>`) under the preload on a device of its own, with
/// `SMCLO_SPIN_US` set to `spin_us` (unset for `None`), under `perf stat`
/// when given; checks that it succeeded over one SMC-D connection that
/// moved the bytes it read, and returns its output.
pub fn run_smc(exe: &Path, args: &[&str], spin_us: Option<&str>, perf: Option<Perf>) -> String {
    let (stdout, stats, report) = run_counted(exe, args, spin_us, perf);
    let read: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("OK "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no OK line\n{report}"));
    assert_eq!(stats.conns_opened, 1, "one SMC-D connection\n{report}");
    assert_eq!(stats.fallbacks_total(), 0, "no fallback\n{report}");
    assert!(
        stats.xfer_bytes >= read,
        "the {read} bytes read went through the rings\n{report}"
    );
    stdout
}

/// Runs `exe args` as [`run_smc`] does, checking only that it succeeded:
/// its standard output, the device's counters after it, and a report of
/// both (with its standard error) for assertion messages.
pub fn run_counted(
    exe: &Path,
    args: &[&str],
    spin_us: Option<&str>,
    perf: Option<Perf>,
) -> (String, smclo::device::Stats, String) {
    use smclo::device::Device;
    let name = exe.file_name().unwrap().to_string_lossy();
    let mode = args[0];
    let dev = PathBuf::from(format!(
        "/dev/shm/smclo-{name}-test-{}-{}-{mode}",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dev);
    let mut c = match perf {
        Some(p) => {
            let mut c = Command::new("perf");
            c.arg("stat")
                .args(p.events)
                .args(["-x,", "-o"])
                .arg(p.out)
                .args(["--", "timeout"]);
            c
        }
        None => Command::new("timeout"),
    };
    c.arg("60").arg(exe).args(args);
    c.env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev)
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE");
    match spin_us {
        Some(us) => c.env("SMCLO_SPIN_US", us),
        None => c.env_remove("SMCLO_SPIN_US"),
    };
    let out = c.output().expect("run the test program");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stats = Device::open(&dev).expect("open the test device").stats();
    let _ = std::fs::remove_dir_all(&dev);
    let report = format!("stdout:\n{stdout}\nstderr:\n{stderr}\nstats: {stats:?}");
    assert!(out.status.success(), "{name} {mode} failed\n{report}");
    (stdout.into_owned(), stats, report)
}

/// System calls per request of `exe mode N`, counted by `perf stat` with
/// `events` (both processes together) as the difference between 20000 and
/// 2000 requests, which cancels the setup.
pub struct PerRequest {
    /// Per request, one figure per event, in the order of `events`.
    pub per: Vec<f64>,
    /// The counts for 2000 and for 20000 requests.
    pub few: Vec<u64>,
    pub many: Vec<u64>,
    /// The output of the run with 20000.
    pub stdout: String,
}

/// Measures [`PerRequest`] (see there).
pub fn per_request(exe: &Path, mode: &str, events: &[&str]) -> PerRequest {
    assert!(
        perf_usable(events),
        "perf stat cannot count {events:?}: system calls cannot be counted \
         (./test.sh runs as root with perf installed)"
    );
    let count = |n: u64| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("perf-{}-{mode}-{n}", std::process::id()));
        let perf = Perf { events, out: &out };
        let stdout = run_smc(exe, &[mode, &n.to_string()], None, Some(perf));
        let c = perf_counts(&out);
        let _ = std::fs::remove_file(&out);
        (c, stdout)
    };
    let (few, _) = count(2000);
    let (many, stdout) = count(20000);
    let per = few
        .iter()
        .zip(&many)
        .map(|(f, m)| m.saturating_sub(*f) as f64 / 18000.0)
        .collect();
    PerRequest {
        per,
        few,
        many,
        stdout,
    }
}

/// Whether `perf stat` can count `events` here.
fn perf_usable(events: &[&str]) -> bool {
    Command::new("perf")
        .arg("stat")
        .args(events)
        .args(["-x,", "--", "true"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The counts of the system-call events in a `perf stat -x,` output file,
/// in order.
fn perf_counts(path: &Path) -> Vec<u64> {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .filter(|l| l.contains("syscalls:sys_enter"))
        .filter_map(|l| l.split(',').next()?.trim().parse().ok())
        .collect();
    assert!(!v.is_empty(), "no count in perf output:\n{s}");
    v
}

/// Runs `exe args` without the preload, over plain TCP (the control that
/// proves a test program's expectations are TCP's), and returns its
/// output, which must say `OK`.
pub fn run_plain(exe: &Path, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("60")
        .arg(exe)
        .args(args)
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run the test program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("OK "),
        "{} {args:?} over plain TCP failed:\n{stdout}{}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
