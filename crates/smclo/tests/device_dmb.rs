//! DMBs by token: register, attach (from the passed memfd), unregister,
//! reuse through the pool, stats derived from the DMB table, garbage
//! collection after kill -9, and isolation from other users.

mod common;
use common::{spawn_child, TempDir};
use smclo::device::{Device, Role, SWEEP_INTERVAL_MS};
use smclo::error::AttachError;
use smclo::testing::conn::Mode;
use smclo::testing::owner::Owner;
use std::ffi::CString;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{BorrowedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The addresses recorded for the pairs made here without a TCP connection.
const LO: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1));

const RING: u32 = smclo_wire::dmb_header::MIN_RING_LEN;

fn dmb_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dmb-"))
        .collect();
    v.sort();
    v
}

/// A descriptor of its own for `fd`, as a peer gets it through SCM_RIGHTS.
fn dup(fd: RawFd) -> File {
    // SAFETY: `fd` is open for the duration of the call (the caller holds it).
    File::from(
        unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .unwrap(),
    )
}

fn seals(f: &File) -> i32 {
    // SAFETY: F_GET_SEALS on an open descriptor; no memory effects.
    unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(f), libc::F_GET_SEALS) }
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    let dev = Device::open(&dir).unwrap();
    match role.as_str() {
        "hold" => {
            // Three DMBs: a connected pair (both ends here, as after an
            // upgrade between two threads) with traffic, and one that no
            // peer ever attached.
            let a = dev.register_dmb(RING, Role::Client).unwrap();
            let b = dev.register_dmb(RING, Role::Server).unwrap();
            let c = dev.register_dmb(RING, Role::Client).unwrap();
            a.set_connected(b.token(), LO, LO, Mode::NoCopy);
            b.set_connected(a.token(), LO, LO, Mode::NoCopy);
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
    // A sealed memfd of our uid, named nowhere in the directory.
    let f = dup(h.fd());
    assert_eq!(
        seals(&f) & smclo::testing::dmb::REQUIRED_SEALS,
        smclo::testing::dmb::REQUIRED_SEALS
    );
    assert_eq!(f.metadata().unwrap().uid(), unsafe_free_euid());
    assert!(f.set_len(100).is_err(), "sealed against shrinking");
    assert!(dmb_files(&t.0).is_empty());
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.dmbs_registered, s.conns_active), (1, 1, 0));
    assert_eq!(dev.dmb_entries_in_use(), 1);

    // The peer attaches the descriptor it was passed, by token.
    let peer = dev.attach_dmb(h.token(), f).unwrap();
    assert_eq!(peer.token(), h.token());
    h.dmb()
        .prod()
        .store(0xabcdef, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        peer.prod().load(std::sync::atomic::Ordering::SeqCst),
        0xabcdef
    );

    // A descriptor holding another token: the token is gone.
    let e = refusal(dev.attach_dmb(0x1234, dup(h.fd())));
    assert!(
        matches!(e, AttachError::TokenGone { wanted: 0x1234, found } if found == h.token()),
        "{e}"
    );
    // A second attacher while the first maps it is refused.
    let e = refusal(dev.attach_dmb(h.token(), dup(h.fd())));
    assert!(matches!(e, AttachError::AlreadyAttached), "{e}");
    drop(peer);

    // A connected pair with traffic.
    let c = dev.register_dmb(RING, Role::Client).unwrap();
    h.set_connected(c.token(), LO, LO, Mode::NoCopy);
    c.set_connected(h.token(), LO, LO, Mode::NoCopy);
    h.add_tx(10);
    c.add_tx(5);
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (2, 1, 15));
    drop(h);
    let s = dev.stats();
    assert_eq!(
        (s.dmbs_cnt, s.conns_active, s.xfer_bytes),
        (1, 1, 15),
        "one live end keeps the connection active; bytes are retired, not lost"
    );
    drop(c);
    let s = dev.stats();
    assert_eq!(
        (s.dmbs_cnt, s.conns_active, s.xfer_bytes, s.dmbs_registered),
        (0, 0, 15, 2)
    );
    assert!(dmb_files(&t.0).is_empty());
    dev.reset_stats();
    assert_eq!(dev.stats().xfer_bytes, 0);
}

/// Why attaching was refused; panics if it was not.
fn refusal<T: std::fmt::Debug>(r: smclo::Result<T>) -> AttachError {
    match r {
        Err(smclo::Error::Attach(e)) => e,
        other => panic!("expected an attach refusal, got {other:?}"),
    }
}

fn unsafe_free_euid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

#[test]
fn a_foreign_descriptor_is_not_attached() {
    let t = TempDir::new("foreign");
    let dev = Device::open(&t.0).unwrap();
    let gid = dev.stats().gid;
    let token = 0x0123_4567_89ab_cdefu64;
    // A regular file with a valid DMB in it: not sealable, refused.
    let path = t.0.join("plain");
    let plain = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .unwrap();
    drop(smclo::testing::dmb::Dmb::create(&plain, token, RING, gid, 1, 1).unwrap());
    let e = refusal(dev.attach_dmb(token, plain));
    assert!(matches!(e, AttachError::NotSealed { .. }), "{e}");
    // A memfd that can still change its seals (no F_SEAL_SEAL): refused.
    let m = smclo::testing::dmb::memfd("t").unwrap();
    drop(smclo::testing::dmb::Dmb::create(&m, token, RING, gid, 1, 1).unwrap());
    let e = refusal(dev.attach_dmb(token, dup(std::os::fd::AsRawFd::as_raw_fd(&m))));
    assert!(matches!(e, AttachError::NotSealed { .. }), "{e}");
    // Fully sealed: accepted; with another GID or garbage: refused.
    assert_eq!(
        // SAFETY: F_ADD_SEALS on our own descriptor.
        unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&m),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SEAL,
            )
        },
        0
    );
    drop(
        dev.attach_dmb(token, dup(std::os::fd::AsRawFd::as_raw_fd(&m)))
            .unwrap(),
    );
    let other = smclo::testing::dmb::memfd("t").unwrap();
    drop(smclo::testing::dmb::Dmb::create(&other, token, RING, gid ^ 1, 1, 1).unwrap());
    // SAFETY: as above.
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&other),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SEAL,
        )
    };
    let e = refusal(dev.attach_dmb(token, other));
    assert!(
        matches!(e, AttachError::WrongGid { found } if found == gid ^ 1),
        "{e}"
    );
    let g = smclo::testing::dmb::memfd("t").unwrap();
    std::os::unix::fs::FileExt::write_all_at(&g, &[0x5au8; 8192], 0).unwrap();
    // SAFETY: as above.
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&g),
            libc::F_ADD_SEALS,
            smclo::testing::dmb::REQUIRED_SEALS,
        )
    };
    let e = refusal(dev.attach_dmb(token, g));
    assert!(matches!(e, AttachError::BadHeader(_)), "{e}");
}

#[test]
fn dropped_dmbs_are_reused_once_the_peer_detached() {
    let t = TempDir::new("pool");
    let dev = Device::open(&t.0).unwrap();
    let ring = 32 * 1024; // a size no other test in this process uses
    let a = dev.register_dmb(ring, Role::Client).unwrap();
    let ino = dup(a.fd()).metadata().unwrap().ino();
    let peer = dev.attach_dmb(a.token(), dup(a.fd())).unwrap();
    a.dmb()
        .cons()
        .store(77, std::sync::atomic::Ordering::SeqCst);
    let old = a.token();
    drop(a);
    assert_eq!(dev.stats().dmbs_cnt, 0, "a pooled DMB has no table entry");
    // The peer still maps it: a new registration gets another memfd.
    let b = dev.register_dmb(ring, Role::Client).unwrap();
    assert_ne!(dup(b.fd()).metadata().unwrap().ino(), ino);
    drop(peer);
    // Detached: the next registration reuses it, renewed.
    let c = dev.register_dmb(ring, Role::Server).unwrap();
    assert_eq!(dup(c.fd()).metadata().unwrap().ino(), ino);
    assert_ne!(c.token(), old);
    assert_eq!(c.dmb().cons().load(std::sync::atomic::Ordering::SeqCst), 0);
    // The old token no longer matches the descriptor's header.
    assert!(matches!(
        refusal(dev.attach_dmb(old, dup(c.fd()))),
        AttachError::TokenGone { wanted, found } if wanted == old && found == c.token()
    ));
    drop(dev.attach_dmb(c.token(), dup(c.fd())).unwrap());
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.dmbs_registered), (2, 3));
    drop((b, c));
    assert_eq!(dev.stats().dmbs_cnt, 0);
}

#[test]
fn kill_9_leaves_nothing_behind() {
    let t = TempDir::new("kill9");
    let dev = Device::open(&t.0).unwrap();
    let mut c = spawn_child("hold", &t.0);
    let lines = c.wait_ready();
    let pid: u32 = lines
        .iter()
        .find_map(|l| l.strip_prefix("PID="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        dmb_files(&t.0).is_empty(),
        "DMBs are never named in the directory"
    );
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (3, 1, 1234));

    // SIGKILL, and check before reaping: a zombie counts as dead.
    let owner = Owner::local(pid, 0);
    // SAFETY: pid is our own child, still unreaped, so it cannot be reused.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while owner.is_alive() {
        assert!(
            std::time::Instant::now() < deadline,
            "killed child still alive"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The next registration (once the sweep interval has passed) removes
    // the dead owner's files and table entries.
    std::thread::sleep(Duration::from_millis(SWEEP_INTERVAL_MS + 50));
    assert_eq!(
        dev.dmb_entries_in_use(),
        3,
        "nothing reclaimed before the sweep"
    );
    let mine = dev.register_dmb(RING, Role::Client).unwrap();
    assert_eq!(
        dev.dmb_entries_in_use(),
        1,
        "the registration swept the dead owner's entries"
    );
    assert!(dmb_files(&t.0).is_empty());
    let s = dev.stats();
    assert_eq!(
        (s.dmbs_cnt, s.conns_active),
        (1, 0),
        "dead owner's DMBs not counted"
    );
    assert_eq!(
        dev.dmb_entries_in_use(),
        1,
        "dead owner's entries reclaimed"
    );
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
    c.wait_ready();
    assert_eq!(dev.stats().dmbs_cnt, 3);
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    let s = dev.stats();
    assert_eq!((s.dmbs_cnt, s.conns_active, s.xfer_bytes), (0, 0, 1234));
    assert_eq!(dev.dmb_entries_in_use(), 0, "stats reclaimed the entries");
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
    // A DMB has no name: the only ways to it are the owner's descriptor
    // (over /proc/<pid>/fd) and its mappings (/proc/<pid>/map_files), and
    // another uid may open neither.
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "needs root to switch to uid 65534 (./test.sh runs as root)"
    );
    let t = TempDir::new("uid");
    let dev = Device::open(&t.0).unwrap();
    let h = dev.register_dmb(RING, Role::Server).unwrap();
    assert!(dmb_files(&t.0).is_empty());
    let me = std::process::id();
    let map_file = std::fs::read_dir(format!("/proc/{me}/map_files"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| std::fs::read_link(p).is_ok_and(|l| l.to_string_lossy().contains("smclo-dmb")))
        .expect("our DMB mapping in map_files");
    let paths: Vec<CString> = [
        PathBuf::from(format!("/proc/{me}/fd/{}", h.fd())),
        map_file,
        t.0.join("device"),
        t.0.join("probe"),
    ]
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
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                libc::_exit(10);
            }
            for (i, p) in paths.iter().enumerate() {
                let flags = if i == 3 {
                    libc::O_RDWR | libc::O_CREAT
                } else {
                    libc::O_RDWR
                };
                // /proc links are followed on purpose: they are the way in.
                let nofollow = if i >= 2 { libc::O_NOFOLLOW } else { 0 };
                let fd = libc::open(p.as_ptr(), flags | nofollow, 0o600);
                if fd >= 0 {
                    libc::_exit(20 + i as i32);
                }
                let errno = *libc::__errno_location();
                if errno != libc::EACCES && !(i < 2 && errno == libc::EPERM) {
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
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "20+i: opened path i, 30+i: not EACCES (or EPERM for /proc), 10: setuid failed"
    );
    drop(h);
}

/// `xfer_bytes` while DMBs come and go: the bytes of a freed entry move into
/// the retired total, and a concurrent `stats` must count them exactly once
/// (it used to see an entry already zeroed and a total not yet increased).
#[test]
fn xfer_bytes_exact_while_entries_retire() {
    let t = TempDir::new("xfer-retire");
    let dev = Device::open(&t.0).unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    let (writers, per) = (2u64, 20_000u64);
    let rounds = writers * per;
    let left = std::sync::atomic::AtomicU64::new(writers);
    std::thread::scope(|sc| {
        for w in 0..writers {
            let (dev, done, left) = (&dev, &done, &left);
            sc.spawn(move || {
                for i in 0..per {
                    let h = dev.register_dmb(RING, Role::Client).unwrap();
                    h.add_tx(1);
                    // Hold the byte in the entry for a while (up to a few
                    // microseconds), so that scans see it there.
                    let until = std::time::Instant::now()
                        + Duration::from_nanos((i * 7919 + w * 104729) % 4000);
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    drop(h);
                }
                if left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                    done.store(true, std::sync::atomic::Ordering::Release);
                }
            });
        }
        // Every byte is added before its entry is freed, and nothing else
        // moves the total: it never goes down, and never passes `rounds`.
        let mut last = 0;
        let mut reads = 0u64;
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            let x = dev.stats().xfer_bytes;
            assert!(x >= last, "xfer_bytes went from {last} to {x}");
            assert!(x <= rounds, "xfer_bytes {x} counts more than was sent");
            last = x;
            reads += 1;
        }
        eprintln!("{reads} stats reads");
    });
    assert_eq!(dev.stats().xfer_bytes, rounds);
}
