//! The device file: one GID under concurrent creation, damaged files are
//! clear errors, directory checks, knobs and counters shared across
//! processes.

mod common;
use common::{spawn_child_env, ChildGuard, TempDir};
use smclo::device::{Device, DmbType, Role};
use smclo::error::DeviceProblem;
use smclo::Error;
use smclo_wire::device_layout as layout;
use smclo_wire::device_layout::LayoutError;
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

trait Made {
    fn made(tag: &str) -> TempDir;
}

impl Made for TempDir {
    /// Creates the directory itself (mode 0700).
    fn made(tag: &str) -> TempDir {
        let t = TempDir::new(tag);
        std::fs::create_dir(&t.0).unwrap();
        std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o700)).unwrap();
        t
    }
}

/// A child running `role`, with `extra` in `SMCLO_TEST_ARG`.
fn spawn_child_arg(role: &str, dir: &Path, extra: &str) -> ChildGuard {
    spawn_child_env(role, dir, &[("SMCLO_TEST_ARG", extra)])
}

/// Lines the child printed that start with `prefix`, until it exits.
fn child_lines(c: &mut ChildGuard, prefix: &str) -> Vec<String> {
    let out = c.0.stdout.take().unwrap();
    let lines: Vec<String> = BufReader::new(out)
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| l.strip_prefix(prefix).map(str::to_string))
        .collect();
    let st = c.0.wait().unwrap();
    assert!(st.success(), "child failed: {st:?}");
    lines
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    let arg = std::env::var("SMCLO_TEST_ARG").unwrap_or_default();
    match role.as_str() {
        "create" => {
            // Wait for the start signal, spinning, so that all children call
            // open at nearly the same instant.
            let go = PathBuf::from(arg);
            let deadline = Instant::now() + Duration::from_secs(20);
            while !go.exists() {
                assert!(Instant::now() < deadline, "no start signal");
                std::hint::spin_loop();
            }
            let dev = Device::open(&dir).unwrap();
            println!("GID={:016x}", dev.gid());
        }
        "count" => {
            let dev = Device::open(&dir).unwrap();
            dev.count_conn_opened();
            dev.count_conn_opened();
            dev.count_fallback(Reason::PeerNoSmc, Role::Client);
            dev.count_fallback(Reason::Timeout, Role::Server);
            dev.count_fallback(Reason::Timeout, Role::Server);
            dev.set_active(false);
            dev.set_dmb_type(DmbType::Huge);
            println!("GID={:016x}", dev.gid());
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn concurrent_creation_yields_one_gid() {
    let t = TempDir::new("create");
    let go = PathBuf::from(format!("{}.go", t.0.display()));
    let _ = std::fs::remove_file(&go);
    // Create the directory first, so that the race is on the device file
    // itself; also run a second round where the children race on mkdir too.
    for round in 0..2 {
        let t = TempDir::new(&format!("create{round}"));
        if round == 0 {
            std::fs::create_dir(&t.0).unwrap();
            std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let mut kids: Vec<ChildGuard> = (0..16)
            .map(|_| spawn_child_arg("create", &t.0, go.to_str().unwrap()))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&go, b"").unwrap();
        let gids: Vec<String> = kids
            .iter_mut()
            .flat_map(|k| child_lines(k, "GID="))
            .collect();
        std::fs::remove_file(&go).unwrap();
        assert_eq!(gids.len(), 16, "every child reports a GID");
        assert!(
            gids.iter().all(|g| *g == gids[0]),
            "more than one GID: {gids:?}"
        );
        let dev = Device::open(&t.0).unwrap();
        assert_eq!(format!("{:016x}", dev.gid()), gids[0]);
        assert_eq!(dev.chid(), 0xffff);
        assert!(dev.seid().starts_with(b"SEID-"));
        // Only the device file and our pid namespace's membership lock
        // remain: no temporaries of the losers.
        let mut names: Vec<_> = std::fs::read_dir(&t.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        let lock = format!("pidns-{}", smclo::testing::owner::PidNs::current().0);
        assert_eq!(names, vec!["device".into(), std::ffi::OsString::from(lock)]);
        let md = std::fs::metadata(&t.0).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o700);
    }
}

fn write_device(dir: &Path, bytes: &[u8], len: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(dir.join("device"))
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(bytes, 0).unwrap();
    f.set_len(len).unwrap();
}

fn valid_header() -> Vec<u8> {
    layout::encode_header(&layout::DeviceHeader {
        gid: 0x1122_3344_5566_7788,
        chid: smclo::device::LOOPBACK_CHID,
        seid: [b' '; 32],
    })
}

/// Which device problem a case expects.
type Expect = fn(&DeviceProblem) -> bool;

/// Opening `dir` fails with an [`Error::Device`] about `path` (the
/// directory itself, or its device file) whose problem satisfies `expect`.
fn expect_invalid(dir: &Path, path: &Path, expect: Expect) {
    match Device::open(dir) {
        Err(Error::Device(e)) => {
            assert!(e.path == path && expect(&e.problem), "unexpected: {e}");
        }
        Err(e) => panic!("expected Error::Device, got {e}"),
        Ok(d) => panic!("a damaged device was accepted: {d:?}"),
    }
}

#[test]
fn damaged_device_files_are_clear_errors() {
    // Sanity: the valid header is accepted, so the cases below fail for the
    // damage alone.
    let t = TempDir::made("ok");
    write_device(&t.0, &valid_header(), layout::TOTAL_SIZE);
    assert_eq!(Device::open(&t.0).unwrap().gid(), 0x1122_3344_5566_7788);

    let truncated: Expect = |p| matches!(p, DeviceProblem::Header(LayoutError::Truncated { .. }));
    let bad_magic: Expect = |p| matches!(p, DeviceProblem::Header(LayoutError::BadMagic(_)));
    let cases: Vec<(&str, Vec<u8>, u64, Expect)> = vec![
        ("empty", vec![], 0, truncated),
        (
            "garbage",
            (0..8192u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                .collect(),
            layout::TOTAL_SIZE,
            bad_magic,
        ),
        ("trunc", valid_header(), 1000, truncated),
        (
            "trunc-tables",
            valid_header(),
            layout::TOTAL_SIZE - u64::from(layout::HEADER_LEN),
            truncated,
        ),
        (
            "long",
            valid_header(),
            layout::TOTAL_SIZE + u64::from(layout::HEADER_LEN),
            |p| {
                matches!(
                    p,
                    DeviceProblem::Header(LayoutError::Geometry {
                        field: "file size",
                        ..
                    })
                )
            },
        ),
        (
            "magic",
            {
                let mut h = valid_header();
                h[layout::off::MAGIC] ^= 1;
                h
            },
            layout::TOTAL_SIZE,
            bad_magic,
        ),
        (
            "version",
            {
                let mut h = valid_header();
                h[layout::off::VERSION..layout::off::VERSION + 4]
                    .copy_from_slice(&99u32.to_ne_bytes());
                h
            },
            layout::TOTAL_SIZE,
            |p| matches!(p, DeviceProblem::Header(LayoutError::Version(99))),
        ),
        (
            "geometry",
            {
                let mut h = valid_header();
                h[layout::off::DMB_TABLE + 4..layout::off::DMB_TABLE + 8]
                    .copy_from_slice(&7u32.to_ne_bytes());
                h
            },
            layout::TOTAL_SIZE,
            |p| {
                matches!(
                    p,
                    DeviceProblem::Header(LayoutError::Geometry {
                        field: "dmb table",
                        ..
                    })
                )
            },
        ),
        (
            "chid",
            {
                let mut h = valid_header();
                h[layout::off::CHID..layout::off::CHID + 2]
                    .copy_from_slice(&0x1234u16.to_ne_bytes());
                h
            },
            layout::TOTAL_SIZE,
            |p| matches!(p, DeviceProblem::WrongChid(0x1234)),
        ),
    ];
    for (tag, bytes, len, expect) in cases {
        let t = TempDir::made(tag);
        write_device(&t.0, &bytes, len);
        expect_invalid(&t.0, &t.0.join("device"), expect);
    }

    // A symlink instead of the file, and a file others can read.
    let t = TempDir::made("symlink");
    let target = TempDir::made("target");
    write_device(&target.0, &valid_header(), layout::TOTAL_SIZE);
    std::os::unix::fs::symlink(target.0.join("device"), t.0.join("device")).unwrap();
    expect_invalid(&t.0, &t.0.join("device"), |p| {
        *p == DeviceProblem::SymbolicLink
    });
    let t = TempDir::made("mode");
    write_device(&t.0, &valid_header(), layout::TOTAL_SIZE);
    std::fs::set_permissions(t.0.join("device"), std::fs::Permissions::from_mode(0o644)).unwrap();
    expect_invalid(&t.0, &t.0.join("device"), |p| {
        *p == DeviceProblem::NotPrivate { mode: 0o644 }
    });
}

#[test]
fn device_directory_must_be_private() {
    let t = TempDir::made("dirmode");
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    expect_invalid(&t.0, &t.0, |p| {
        *p == DeviceProblem::NotPrivate { mode: 0o755 }
    });
    let t = TempDir::new("notdir");
    std::fs::write(&t.0, b"x").unwrap();
    expect_invalid(&t.0, &t.0, |p| *p == DeviceProblem::NotADirectory);
    std::fs::remove_file(&t.0).unwrap();
    let missing = PathBuf::from("/dev/shm/smclo-test-no-such-parent/x");
    assert!(matches!(Device::open(&missing), Err(Error::Config(_))));
}

#[test]
fn counters_and_knobs_are_shared_across_processes() {
    let t = TempDir::new("count");
    let dev = Device::open(&t.0).unwrap();
    assert!(
        dev.active() && !dev.dmb_copy() && dev.dmb_type() == DmbType::Pages4k,
        "defaults"
    );
    dev.count_fallback(Reason::PeerNoSmc, Role::Client);
    let mut c = spawn_child_arg("count", &t.0, "");
    let gid = child_lines(&mut c, "GID=");
    assert_eq!(gid, vec![format!("{:016x}", dev.gid())]);
    let s = dev.stats();
    assert_eq!(s.conns_opened, 2);
    assert_eq!(s.fallback_client[Reason::PeerNoSmc.index()], 2);
    assert_eq!(s.fallback_server[Reason::Timeout.index()], 2);
    assert_eq!(s.fallback_client[Reason::Timeout.index()], 0);
    assert!(!dev.active(), "knob set by the child");
    assert_eq!(dev.dmb_type(), DmbType::Huge);
    dev.set_active(true);
    dev.reset_stats();
    let s = dev.stats();
    assert_eq!((s.conns_opened, s.xfer_bytes), (0, 0));
    assert!(s
        .fallback_client
        .iter()
        .chain(s.fallback_server.iter())
        .all(|&n| n == 0));
    // A second open in this process returns the same mapping.
    assert!(std::sync::Arc::ptr_eq(&dev, &Device::open(&t.0).unwrap()));
}
