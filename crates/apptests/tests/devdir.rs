//! The device directory's filesystem: a device on a tmpfs that is too small
//! or fills up later must never kill a program (a store into a hole of the
//! shared device file on a full filesystem is a SIGBUS); the program falls
//! back to plain TCP with a line saying why, or, when the device was fully
//! allocated before the filesystem filled up, keeps using shared memory.

use smclo::device::Device;
use smclo::Error;
use smclo_apptests::*;
use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Bytes the client sends and gets echoed back.
const ECHO_LEN: u64 = 300_000;

/// A tmpfs of `size` mounted on a fresh directory, unmounted when dropped.
/// It is mounted in a private mount namespace of the test's thread, which
/// the programs the test starts inherit: even a test that dies leaves no
/// mount behind.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(env: &Env, size: &str) -> Tmpfs {
        assert!(is_root(), "mounting a tmpfs needs root");
        // SAFETY: unshare and mount take no pointers but valid C strings
        // (the root path) or null, and have no memory effects.
        let r = unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                -1
            } else {
                libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                )
            }
        };
        assert_eq!(
            r,
            0,
            "private mount namespace: {}",
            std::io::Error::last_os_error()
        );
        let at = env.path("tmpfs");
        fs::create_dir_all(&at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("tmpfs")
            .arg(&at)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs on {} failed", at.display());
        Tmpfs(at)
    }

    /// Fills the filesystem until the kernel says ENOSPC.
    fn fill(&self) {
        let mut f = fs::File::create(self.0.join("filler")).unwrap();
        let block = vec![0x5au8; 4096];
        loop {
            match std::io::Write::write(&mut f, &block) {
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling: {e}");
                    return;
                }
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A Python echo pair: the server echoes one connection; the client sends
/// [`ECHO_LEN`] patterned bytes, checks the echo byte for byte, prints "ok".
fn echo_script(env: &Env) -> String {
    let p = env.path("echo.py");
    fs::write(
        &p,
        format!(
            r#"import socket, sys
mode, port = sys.argv[1], int(sys.argv[2])
data = bytes((i * 7 + 3) % 251 for i in range({ECHO_LEN}))
def recv_all(c, n):
    buf = bytearray()
    while len(buf) < n:
        b = c.recv(65536)
        if not b:
            break
        buf += b
    return bytes(buf)
if mode == "server":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(4)
    c, _ = s.accept()
    c.sendall(recv_all(c, len(data)))
    c.close()
else:
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(data)
    assert recv_all(c, len(data)) == data, "echo differs"
    print("ok")
"#
        ),
    )
    .unwrap();
    p.display().to_string()
}

/// Runs the echo pair under `smclo run` with the device in `dir`; both must
/// exit 0 and the client must have checked the echo. Returns their stderr.
fn echo(env: &mut Env, dir: &Path) -> String {
    env.extra_env = vec![
        ("SMCLO_DEVICE_DIR".into(), dir.display().to_string()),
        ("SMCLO_DEBUG".into(), "1".into()),
    ];
    let script = echo_script(env);
    let port = free_port().to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "server",
        "python3",
        &[&script, "server", &port],
    );
    wait_listen(&mut server, port.parse().unwrap());
    let client = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &[&script, "client", &port],
        T,
    );
    server.wait_ok(T);
    assert_eq!(client.stdout_str().trim(), "ok", "{}", client.logs());
    format!("{}\n{}", server.logs(), client.logs())
}

/// A device that cannot even be allocated (the tmpfs is smaller than the
/// device file): `Device::open` says `NoSpace` and leaves nothing behind,
/// and programs under `smclo run` say why and work as plain TCP.
#[test]
fn device_on_a_too_small_tmpfs_falls_back_cleanly() {
    let mut env = Env::new("devdir-small");
    let mnt = Tmpfs::mount(&env, "1m");
    let dir = mnt.0.join("dev");
    match Device::open(&dir) {
        Err(Error::NoSpace { dir: d, source }) => {
            assert_eq!(d, dir);
            assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
        }
        other => panic!("want Error::NoSpace, got {other:?}"),
    }
    let left: Vec<_> = fs::read_dir(&dir).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let logs = echo(&mut env, &dir);
    let why = format!("device {} unusable (no room", dir.display());
    assert_eq!(
        logs.matches(&why).count(),
        2,
        "want one line per side\n{logs}"
    );
    assert!(!dir.join("device").exists(), "{logs}");
}

/// A device created while there was room keeps working when its filesystem
/// fills up afterwards: every page of it was allocated at creation.
#[test]
fn device_keeps_working_when_its_tmpfs_fills_up() {
    let mut env = Env::new("devdir-fill");
    let mnt = Tmpfs::mount(&env, "4m");
    let dir = mnt.0.join("dev");
    let dev = Device::open(&dir).expect("create the device while there is room");
    let s0 = dev.stats();
    mnt.fill();
    let logs = echo(&mut env, &dir);
    let d = delta(&s0, &dev.stats());
    assert_smc(
        "echo on a full tmpfs",
        &d,
        1,
        2 * ECHO_LEN,
        2 * ECHO_LEN,
        &logs,
    );
}

/// A device file with holes (as versions that created it sparse left it) on
/// a full filesystem: opening it tries to allocate the holes, gets ENOSPC,
/// and refuses the device instead of mapping it.
#[test]
fn sparse_device_on_a_full_tmpfs_is_refused() {
    let mut env = Env::new("devdir-sparse");
    let mnt = Tmpfs::mount(&env, "4m");
    let dir = mnt.0.join("dev");
    drop(Device::open(&dir).expect("create the device while there is room"));
    let f = fs::OpenOptions::new()
        .write(true)
        .open(dir.join("device"))
        .unwrap();
    let len = f.metadata().unwrap().len() - 4096;
    // SAFETY: fallocate on a valid descriptor; no memory effects.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            4096,
            len as libc::off_t,
        )
    };
    assert_eq!(r, 0, "punching holes: {}", std::io::Error::last_os_error());
    mnt.fill();
    let logs = echo(&mut env, &dir);
    let why = format!("device {} unusable (no room", dir.display());
    assert_eq!(
        logs.matches(&why).count(),
        2,
        "want one line per side\n{logs}"
    );
}
