//! The device directory's filesystem: a device on a tmpfs that is too small
//! or fills up later must never kill a program (a store into a hole of the
//! shared device file on a full filesystem is a SIGBUS); the program falls
//! back to plain TCP with a line saying why, or, when the device was fully
//! allocated before the filesystem filled up, keeps using shared memory.
//!
//! And the default device directory: `$XDG_RUNTIME_DIR/smclo`, else
//! `/run/user/<uid>/smclo`, else `/dev/shm/smclo-<uid>`, each runtime
//! directory only when it is private to us, every refusal named with its
//! reason. These tests mount their own `/dev/shm` and `/run/user` in a
//! private mount namespace, so the host's are never touched.

use smclo::device::Device;
use smclo::Error;
use smclo_apptests::*;
use std::ffi::OsStr;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Bytes the client sends and gets echoed back.
const ECHO_LEN: u64 = 300_000;

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
/// exit 0 and the client must have checked the echo. Returns their logs.
fn echo(env: &mut Env, dir: &Path) -> String {
    echo_with(env, &[("SMCLO_DEVICE_DIR", Some(dir.as_os_str()))])
}

/// [`echo`] with these variables set (`Some`) or removed (`None`) in both
/// programs' environments, and `SMCLO_DEBUG=1`.
fn echo_with(env: &mut Env, vars: &[(&str, Option<&OsStr>)]) -> String {
    let command = |env: &Env, args: &[&str]| {
        let mut c = env.command(Mode::Smclo, None, "python3", args);
        c.env("SMCLO_DEBUG", "1");
        for (k, v) in vars {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c
    };
    let script = echo_script(env);
    let port = free_port().to_string();
    let c = command(env, &[&script, "server", &port]);
    let mut server = env.spawn_cmd("server", c);
    wait_listen(&mut server, port.parse().unwrap());
    let c = command(env, &[&script, "client", &port]);
    let mut client = env.spawn_cmd("client", c);
    client.wait_ok(T);
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

/// The native API on an unusable device: the listener and the client are
/// plain TCP, the connection says why (NOSMCDDEV), and the bytes arrive.
#[test]
fn native_api_on_a_too_small_tmpfs_is_plain_tcp() {
    use smclo::api::{SmcListener, SmcStream};
    use smclo_wire::reason::Reason;
    use std::io::{Read, Write};
    let env = Env::new("devdir-api");
    let mnt = Tmpfs::mount(&env, "1m");
    let mut cfg = smclo::config::Config::from_env().unwrap();
    cfg.device_dir = mnt.0.join("dev");
    let l = SmcListener::bind_with("127.0.0.1:0", &cfg).expect("a plain listener");
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).unwrap();
        s.write_all(&buf).unwrap();
        (s.is_smc(), s.fallback_reason())
    });
    let mut c = SmcStream::connect_with(addr, &cfg).expect("a plain connection");
    let data: Vec<u8> = (0..ECHO_LEN).map(|i| (i * 7 + 3) as u8).collect();
    c.write_all(&data).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert!(back == data, "echo differs");
    let want = (false, Some(Reason::NoSmcdDev));
    assert_eq!((c.is_smc(), c.fallback_reason()), want);
    assert_eq!(server.join().unwrap(), want);
    assert!(!cfg.device_dir.join("device").exists());
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

// --- The default device directory ------------------------------------------

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// A directory at `p` with `mode`, owned by `owner`.
fn dir_of(p: &Path, owner: u32, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(p).unwrap();
    std::os::unix::fs::chown(p, Some(owner), None).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

/// SMC-D moved the echo through the device in `dir`, which `s0` was taken
/// from before.
fn assert_echo_smc(what: &str, dir: &Path, s0: &smclo::device::Stats, logs: &str) {
    let d = delta(s0, &Device::open(dir).unwrap().stats());
    assert_smc(what, &d, 1, 2 * ECHO_LEN, 2 * ECHO_LEN, logs);
}

/// Another user created `/dev/shm/smclo-<uid>` first: without a runtime
/// directory the device there is refused, saying whose it is, and the
/// programs work as plain TCP; with `XDG_RUNTIME_DIR` (private to us) the
/// device is `$XDG_RUNTIME_DIR/smclo`, out of the other user's reach, and
/// the echo goes through shared memory.
#[test]
fn xdg_runtime_dir_escapes_a_squatted_dev_shm() {
    let mut env = Env::new("devdir-squat");
    private_mounts();
    let _shm = Tmpfs::mount_at(Path::new("/dev/shm"), "16m");
    let _run = Tmpfs::mount_at(Path::new("/run/user"), "16m");
    let squatted = PathBuf::from(format!("/dev/shm/smclo-{}", uid()));
    dir_of(&squatted, 65534, 0o700);

    let logs = echo_with(
        &mut env,
        &[("SMCLO_DEVICE_DIR", None), ("XDG_RUNTIME_DIR", None)],
    );
    let why = format!(
        "device {} unusable (invalid smclo device: {}: belongs to uid 65534",
        squatted.display(),
        squatted.display()
    );
    assert_eq!(
        logs.matches(&why).count(),
        2,
        "want one line per side\n{logs}"
    );

    let xdg = env.path("xdg");
    dir_of(&xdg, uid(), 0o700);
    let dev = xdg.join("smclo");
    let s0 = Device::open(&dev).unwrap().stats();
    let logs = echo_with(
        &mut env,
        &[
            ("SMCLO_DEVICE_DIR", None),
            ("XDG_RUNTIME_DIR", Some(xdg.as_os_str())),
        ],
    );
    assert_echo_smc("device in $XDG_RUNTIME_DIR/smclo", &dev, &s0, &logs);
}

/// Runtime directories that are not private to us are passed over with a
/// line saying which and why (an `XDG_RUNTIME_DIR` of another uid, a
/// `/run/user/<uid>` that others can read); the device is then
/// `/dev/shm/smclo-<uid>`.
#[test]
fn refused_runtime_dirs_are_named() {
    let mut env = Env::new("devdir-refused");
    private_mounts();
    let _shm = Tmpfs::mount_at(Path::new("/dev/shm"), "16m");
    let _run = Tmpfs::mount_at(Path::new("/run/user"), "16m");
    let run_user = PathBuf::from(format!("/run/user/{}", uid()));
    dir_of(&run_user, uid(), 0o755);
    let xdg = env.path("xdg-other");
    dir_of(&xdg, 65534, 0o700);
    let dev = PathBuf::from(format!("/dev/shm/smclo-{}", uid()));
    let s0 = Device::open(&dev).unwrap().stats();
    let logs = echo_with(
        &mut env,
        &[
            ("SMCLO_DEVICE_DIR", None),
            ("XDG_RUNTIME_DIR", Some(xdg.as_os_str())),
        ],
    );
    for why in [
        format!(
            "device directory: XDG_RUNTIME_DIR refused ({}: belongs to uid 65534, not to us (uid {}))",
            xdg.display(),
            uid()
        ),
        format!(
            "device directory: /run/user/<uid> refused ({}: mode 755",
            run_user.display()
        ),
    ] {
        assert!(logs.matches(&why).count() >= 2, "want {why:?} from both sides\n{logs}");
    }
    assert_echo_smc("device in /dev/shm", &dev, &s0, &logs);
}

/// A process started without `XDG_RUNTIME_DIR` (by a service manager) finds
/// the same device as the user's shell: `/run/user/<uid>/smclo`.
#[test]
fn run_user_dir_without_xdg_runtime_dir() {
    let mut env = Env::new("devdir-run-user");
    private_mounts();
    let _shm = Tmpfs::mount_at(Path::new("/dev/shm"), "16m");
    let _run = Tmpfs::mount_at(Path::new("/run/user"), "16m");
    let run_user = PathBuf::from(format!("/run/user/{}", uid()));
    dir_of(&run_user, uid(), 0o700);
    let dev = run_user.join("smclo");
    let s0 = Device::open(&dev).unwrap().stats();
    let logs = echo_with(
        &mut env,
        &[("SMCLO_DEVICE_DIR", None), ("XDG_RUNTIME_DIR", None)],
    );
    assert_echo_smc("device in /run/user/<uid>/smclo", &dev, &s0, &logs);
}

/// A device directory whose filesystem is replaced (unmounted, a new one
/// mounted at the same path) holds a new device, even where the new device
/// file has the inode number of the old one: the process maps the new one.
#[test]
fn a_new_filesystem_at_the_same_path_is_a_new_device() {
    let env = Env::new("devdir-remount");
    let first = Tmpfs::mount(&env, "4m");
    let dir = first.0.join("dev");
    let old = Device::open(&dir).unwrap().gid();
    let old_ino = fs::metadata(dir.join("device")).unwrap().ino();
    drop(first);
    let second = Tmpfs::mount_at(&env.path("tmpfs"), "4m");
    let new = Device::open(&second.0.join("dev")).unwrap();
    let new_ino = fs::metadata(dir.join("device")).unwrap().ino();
    eprintln!("device inode {old_ino} then {new_ino}");
    assert_ne!(new.gid(), old, "the old filesystem's device is still used");
    let on_disk = fs::read(dir.join("device")).unwrap();
    let gid = u64::from_ne_bytes(on_disk[64..72].try_into().unwrap());
    assert_eq!(new.gid(), gid);
}
