//! One device shared across pid namespaces (`unshare --pid --fork`, as
//! root): a process never judges another namespace's entries by pid, so
//! `stats` in a child namespace keeps the root namespace's listener, a
//! listener in a child namespace serves clients of the root namespace, and
//! once every process of that namespace is gone (kill -9) its entries are
//! reclaimed.

mod common;
use common::{ChildGuard, TempDir, CHILD_ENTRY};
use smclo::api::SmcStream;
use smclo::config::Config;
use smclo::device::Device;
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    match role.as_str() {
        // What `smclo stats` does.
        "stats" => {
            let st = Device::open(&dir).unwrap().stats();
            println!("LISTENERS={} PIDNS={}", st.listeners, pid_namespace());
        }
        other => panic!("unknown role {other}"),
    }
}

/// The inode of the caller's pid namespace.
fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").unwrap().ino()
}

fn cfg(dir: &Path) -> Config {
    let mut c = Config::from_env().unwrap();
    c.device_dir = dir.to_path_buf();
    c
}

/// `unshare --pid --fork [--mount-proc] --kill-child PROGRAM ARGS`: PROGRAM
/// runs as pid 1 of a new pid namespace and dies with `unshare`.
fn unshare(mount_proc: bool, program: &Path, args: &[&str], env: &[(&str, &Path)]) -> ChildGuard {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child"]);
    if mount_proc {
        cmd.arg("--mount-proc");
    }
    cmd.arg(program)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    ChildGuard(cmd.spawn().expect("unshare (util-linux) runs"))
}

/// Runs `stats` in a new pid namespace; returns the listeners it counted
/// and its namespace.
fn stats_in_child_namespace(dir: &Path, mount_proc: bool) -> (u64, u64) {
    let exe = std::env::current_exe().unwrap();
    let mut c = unshare(
        mount_proc,
        &exe,
        &CHILD_ENTRY,
        &[
            ("SMCLO_TEST_ROLE", Path::new("stats")),
            ("SMCLO_TEST_DIR", dir),
        ],
    );
    let mut out = String::new();
    c.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    assert!(c.0.wait().unwrap().success(), "child failed: {out}");
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("LISTENERS="))
        .unwrap_or_else(|| panic!("no stats from the child: {out:?}"));
    let (n, ns) = line.split_once(" PIDNS=").unwrap();
    (n.parse().unwrap(), ns.parse().unwrap())
}

fn first_line(c: &mut ChildGuard) -> String {
    let mut l = String::new();
    BufReader::new(c.0.stdout.as_mut().unwrap())
        .read_line(&mut l)
        .unwrap();
    l.trim().to_string()
}

/// Connects to `addr`, echoes a few bytes, returns whether it was SMC-D
/// and the fallback reason.
fn echo_once(dir: &Path, addr: &str) -> (bool, Option<Reason>) {
    let mut s = SmcStream::connect_with(addr, &cfg(dir)).unwrap();
    s.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    (s.is_smc(), s.fallback_reason())
}

fn assert_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "these tests create pid namespaces and must run as root"
    );
}

#[test]
fn stats_in_a_child_pid_namespace_keeps_the_root_listener() {
    assert_root();
    let t = TempDir::new("pidns-stats");
    let dev = Device::open(&t.0).unwrap();
    let peer = env!("CARGO_BIN_EXE_smclo-testpeer");
    let mut server = ChildGuard(
        Command::new(peer)
            .args(["serve", "127.0.0.1:0", "echo"])
            .env("SMCLO_DEVICE_DIR", &t.0)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let l = first_line(&mut server);
    let addr = l.strip_prefix("listening ").unwrap().to_string();
    assert_eq!(dev.stats().listeners, 1);

    // With the namespace's own /proc, and with the parent's (where
    // /proc/<pid> names other processes than the child's pids).
    for mount_proc in [true, false] {
        let (seen, ns) = stats_in_child_namespace(&t.0, mount_proc);
        assert_ne!(ns, pid_namespace(), "the child ran in a new pid namespace");
        assert_eq!(
            seen, 1,
            "the child counts the root listener (mount_proc {mount_proc})"
        );
        assert_eq!(
            dev.stats().listeners,
            1,
            "stats in a child pid namespace (mount_proc {mount_proc}) dropped the listener"
        );
    }

    let before = dev.stats();
    let (smc, reason) = echo_once(&t.0, &addr);
    assert!(smc, "the next client fell back: {reason:?}");
    assert_eq!(first_line(&mut server), "smc=1 reason=-");
    let after = dev.stats();
    assert_eq!(after.conns_opened, before.conns_opened + 1, "{after:?}");
    assert!(after.xfer_bytes >= before.xfer_bytes + 4, "{after:?}");
    assert_eq!(after.fallbacks_total(), 0, "{after:?}");
}

#[test]
fn a_child_namespace_listener_serves_the_root_and_is_reclaimed_after_kill9() {
    assert_root();
    let t = TempDir::new("pidns-serve");
    let dev = Device::open(&t.0).unwrap();
    let peer = Path::new(env!("CARGO_BIN_EXE_smclo-testpeer"));
    let mut server = unshare(
        true,
        peer,
        &["serve", "127.0.0.1:0", "hold"],
        &[("SMCLO_DEVICE_DIR", &t.0)],
    );
    let l = first_line(&mut server);
    let addr = l.strip_prefix("listening ").unwrap().to_string();
    assert_eq!(
        dev.stats().listeners,
        1,
        "the root sees the child's listener"
    );

    // The root namespace's client is accelerated by the child's listener.
    let mut c = SmcStream::connect_with(&addr, &cfg(&t.0)).unwrap();
    assert!(c.is_smc(), "fell back: {:?}", c.fallback_reason());
    let mut b = [0u8; 1];
    c.read_exact(&mut b).unwrap();
    assert_eq!(first_line(&mut server), "smc=1 reason=-");
    let st = dev.stats();
    assert_eq!((st.conns_opened, st.fallbacks_total()), (1, 0), "{st:?}");
    assert_eq!(st.listeners, 1);
    drop(c);

    // kill -9 of the namespace's pid 1 (through unshare --kill-child): no
    // process of it is left, so its listener is reclaimed from here.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGKILL) };
    let _ = server.0.wait();
    let deadline = Instant::now() + Duration::from_secs(5);
    while dev.stats().listeners != 0 {
        assert!(
            Instant::now() < deadline,
            "the dead namespace's listener stays: {:?}",
            dev.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(dev.stats().dmbs_cnt, 0, "{:?}", dev.stats());
    assert_eq!(dev.dmb_entries_in_use(), 0);
}
