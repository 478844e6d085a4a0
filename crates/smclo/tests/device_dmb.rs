//! DMBs by token: register, attach (and unlink), unregister, stats derived
//! from the DMB table, garbage collection after kill -9, and isolation from
//! other users.

mod common;
use common::{spawn_child, ChildGuard, TempDir};
use smclo::device::{is_token_gone, Device, Role, SWEEP_INTERVAL_MS};
use smclo::owner::Owner;
use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

const RING: u32 = 16 * 1024;

/// Reads the child's stdout up to the line `READY`, returning the lines
/// before it.
fn wait_ready(c: &mut ChildGuard) -> Vec<String> {
    let mut r = BufReader::new(c.0.stdout.as_mut().unwrap());
    let mut seen = Vec::new();
    loop {
        let mut l = String::new();
        assert!(r.read_line(&mut l).unwrap() > 0, "child exited before READY: {seen:?}");
        let l = l.trim().to_string();
        if l == "READY" {
            return seen;
        }
        seen.push(l);
    }
}

fn dmb_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dmb-"))
        .collect();
    v.sort();
    v
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMCLO_TEST_ROLE") else { return };
    let dir = PathBuf::from(std::env::var("SMCLO_TEST_DIR").unwrap());
    let dev = Device::open(&dir).unwrap();
    match role.as_str() {
        "hold" => {
            // Three DMBs: a connected pair (both ends here, as after an
            // upgrade between two threads) with traffic, and one that no
            // peer ever attached.
            let a = dev.register_dmb(RING, Role::Client).unwrap();
            let b = dev.register_dmb(RING, Role::Server).unwrap();
            let c = dev.register_dmb(RING, Role::Client).unwrap();
            a.set_connected(b.token());
            b.set_connected(a.token());
            a.add_tx(1000);
            b.add_tx(234);
            println!("PID={}", std::process::id());
            println!("READY");
            std::thread::sleep(Duration::from_secs(30));
            drop((a, b, c));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn register_attach_unregister() {
    let t = TempDir::new("dmb");
    let dev = Device::open(&t.0).unwrap();
    let h = dev.register_dmb(RING, Role::Server).unwrap();
    assert_eq!(h.dmb().token(), h.token());
    assert_eq!(h.dmb().ring_len(), RING);
    assert_eq!(h.dmb().owner_pid(), std::process::id());
    assert_eq!(h.dmb().owner_start(), Owner::current().start);
    let path = dev.dmb_path(h.token());
    let md = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(md.permissions().mode() & 0o777, 0o600);
    assert_eq!(md.uid(), unsafe_free_euid());
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.dmbs_registered, s.conns_active), (1, 1, 0));
    assert_eq!(dev.dmb_entries_in_use(), 1);

    // The peer attaches by token: the name goes away, the memory stays
    // shared between the two mappings.
    let peer = dev.attach_dmb(h.token()).unwrap();
    assert_eq!(peer.token(), h.token());
    assert!(!path.exists(), "attach unlinks the DMB file");
    h.dmb().prod().store(0xabcdef, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(peer.prod().load(std::sync::atomic::Ordering::SeqCst), 0xabcdef);

    // The token is gone for a second attacher.
    let e = dev.attach_dmb(h.token()).unwrap_err();
    assert!(is_token_gone(&e), "{e}");
    let e = dev.attach_dmb(0x1234).unwrap_err();
    assert!(is_token_gone(&e), "{e}");

    // A connected pair with traffic.
    let c = dev.register_dmb(RING, Role::Client).unwrap();
    h.set_connected(c.token());
    c.set_connected(h.token());
    h.add_tx(10);
    c.add_tx(5);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (2, 1, 15));
    drop(h);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (1, 1, 15), "one live end keeps the connection active; bytes are retired, not lost");
    drop(c);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes, s.dmbs_registered), (0, 0, 15, 2));
    assert!(dmb_files(&t.0).is_empty());
    dev.reset_stats();
    assert_eq!(dev.stats().xfer_bytes, 0);
}

fn unsafe_free_euid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

#[test]
fn a_foreign_file_is_not_attached() {
    let t = TempDir::new("foreign");
    let dev = Device::open(&t.0).unwrap();
    // A garbage file under a DMB name: Dmb::attach must refuse it cleanly.
    let token = 0x0123_4567_89ab_cdefu64;
    std::fs::write(dev.dmb_path(token), vec![0x5au8; 8192]).unwrap();
    let e = dev.attach_dmb(token).unwrap_err();
    assert!(!is_token_gone(&e));
    // A symlink under a DMB name is refused, not followed.
    let token2 = 0x1111_2222_3333_4444u64;
    std::os::unix::fs::symlink("/etc/hostname", dev.dmb_path(token2)).unwrap();
    let e = dev.attach_dmb(token2).unwrap_err();
    assert!(!is_token_gone(&e));
    assert!(e.to_string().contains("symbolic link"), "{e}");
}

#[test]
fn kill_9_leaves_nothing_behind() {
    let t = TempDir::new("kill9");
    let dev = Device::open(&t.0).unwrap();
    let mut c = spawn_child("hold", &t.0);
    let lines = wait_ready(&mut c);
    let pid: u32 = lines.iter().find_map(|l| l.strip_prefix("PID=")).unwrap().parse().unwrap();
    assert_eq!(dmb_files(&t.0).len(), 3);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (3, 1, 1234));

    // SIGKILL, and check before reaping: a zombie counts as dead.
    let owner = Owner { pid, start: 0 };
    // SAFETY: pid is our own child, still unreaped, so it cannot be reused.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while owner.is_alive() {
        assert!(std::time::Instant::now() < deadline, "killed child still alive");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The next registration (once the sweep interval has passed) removes
    // the dead owner's files and table entries.
    std::thread::sleep(Duration::from_millis(SWEEP_INTERVAL_MS + 50));
    assert_eq!(dev.dmb_entries_in_use(), 3, "nothing reclaimed before the sweep");
    let mine = dev.register_dmb(RING, Role::Client).unwrap();
    assert_eq!(dev.dmb_entries_in_use(), 1, "the registration swept the dead owner's entries");
    assert_eq!(dmb_files(&t.0), vec![format!("dmb-{:016x}", mine.token())]);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active), (1, 0), "dead owner's DMBs not counted");
    assert_eq!(dev.dmb_entries_in_use(), 1, "dead owner's entries reclaimed");
    assert_eq!(s.xfer_bytes, 1234, "the dead owner's bytes stay counted");
    drop(mine);
    drop(c);
    assert!(dmb_files(&t.0).is_empty());
}

#[test]
fn stats_reclaim_after_kill_9_without_registering() {
    let t = TempDir::new("kill9s");
    let dev = Device::open(&t.0).unwrap();
    let mut c = spawn_child("hold", &t.0);
    wait_ready(&mut c);
    assert_eq!(dev.stats().dmbs_cnt, 3);
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (0, 0, 1234));
    assert_eq!(dev.dmb_entries_in_use(), 0, "stats reclaimed the entries");
    assert_eq!(dmb_files(&t.0).len(), 3, "files wait for the sweep");
    dev.sweep();
    assert!(dmb_files(&t.0).is_empty());
}

#[test]
fn table_entries_are_reused() {
    // More registrations than table entries, in sequence: entries are freed.
    let t = TempDir::new("reuse");
    let dev = Device::open(&t.0).unwrap();
    let n = smclo_wire::device_layout::DMB_ENTRIES as usize + 10;
    for _ in 0..n {
        let h = dev.register_dmb(RING, Role::Client).unwrap();
        drop(h);
    }
    assert_eq!(dev.stats().dmbs_cnt, 0);
    assert_eq!(dev.dmb_entries_in_use(), 0);
}

#[test]
fn other_users_cannot_open_the_device_or_a_dmb() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to switch to uid 65534");
        return;
    }
    let t = TempDir::new("uid");
    let dev = Device::open(&t.0).unwrap();
    let h = dev.register_dmb(RING, Role::Server).unwrap();
    let paths: Vec<CString> = [dev.dmb_path(h.token()), t.0.join("device"), t.0.join("probe")]
        .iter()
        .map(|p| CString::new(p.as_os_str().as_bytes()).unwrap())
        .collect();
    // fork, drop privileges, try to open: only raw system calls in the child.
    // SAFETY: the child calls only async-signal-safe functions (setgroups,
    // setgid, setuid, open, __errno_location, _exit) on data prepared before
    // the fork.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: see above; every path ends in _exit.
        unsafe {
            if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(10);
            }
            for (i, p) in paths.iter().enumerate() {
                let flags = if i == 2 { libc::O_RDWR | libc::O_CREAT } else { libc::O_RDWR };
                let fd = libc::open(p.as_ptr(), flags | libc::O_NOFOLLOW, 0o600);
                if fd >= 0 {
                    libc::_exit(20 + i as i32);
                }
                if *libc::__errno_location() != libc::EACCES {
                    libc::_exit(30 + i as i32);
                }
            }
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child crashed: {status}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "20+i: opened path i, 30+i: not EACCES, 10: setuid failed");
    drop(h);
}
