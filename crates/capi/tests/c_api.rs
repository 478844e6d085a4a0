//! The C API from C: compiles `tests/c/smoke.c` against `include/smclo.h`
//! and the built `libsmclo.so`, and runs it against another process
//! (`smclo-testpeer`; a connection inside one process is never upgraded) and
//! against a plain TCP echo server.
//!
//! `smclo-testpeer` must already be built in the same target directory;
//! `cargo test --release --workspace` builds it.

use smclo_testsupport::{built, compile_c_with};
// A private device directory under /dev/shm, removed at the end; a child
// killed if the test ends early.
use smclo_testsupport::{ChildGuard as Kill, DevDir as Dir};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn testpeer() -> PathBuf {
    built("smclo-testpeer")
}

/// Compiles smoke.c once; returns the executable.
fn smoke() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let include = manifest.join("../../include");
        let src = manifest.join("tests/c/smoke.c");
        let lib_dir = built("libsmclo.so").parent().unwrap().to_path_buf();
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("smoke-{}", std::process::id()));
        let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
        let include = format!("-I{}", include.display());
        let flags = [
            "-std=gnu11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            &include,
        ];
        let lib = format!("-L{}", lib_dir.display());
        let rpath = format!("-Wl,-rpath,{}", lib_dir.display());
        compile_c_with(&cc, &flags, &src, &out, &[&lib, &rpath, "-lsmclo"])
    })
}

/// Runs `cmd` to completion within `limit`, or kills it and fails.
fn run(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut child = Kill(child);
    let mut out = child.0.stdout.take().unwrap();
    let mut err = child.0.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.0.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.0.kill();
            let _ = child.0.wait();
            panic!(
                "{cmd:?} did not finish within {limit:?}\nstderr: {}",
                String::from_utf8_lossy(&t_err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

fn smoke_cmd(dir: &Dir, args: &[&str]) -> Command {
    let mut c = Command::new(smoke());
    c.args(args).env("SMCLO_DEVICE_DIR", &dir.0);
    c
}

fn assert_ok(o: &Output, want: &str) {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains(want),
        "smoke failed ({}):\nstdout: {out}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn c_client_upgrades_with_a_smclo_server() {
    let dir = Dir::new("capi");
    let peer = Command::new(testpeer())
        .args(["serve", "127.0.0.1:0", "echo"])
        .env("SMCLO_DEVICE_DIR", &dir.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn smclo-testpeer");
    let mut peer = Kill(peer);
    let mut out = BufReader::new(peer.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("testpeer said {line:?}"));
    let port = addr.rsplit(':').next().unwrap().to_string();

    let o = run(smoke_cmd(&dir, &["smc", &port]), Duration::from_secs(60));
    assert_ok(&o, "ok smc");

    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "smc=1 reason=-",
        "the server side of the connection"
    );
    let st = peer.0.wait().unwrap();
    assert!(st.success(), "smclo-testpeer: {st}");
}

#[test]
fn c_client_falls_back_with_a_plain_tcp_server() {
    let dir = Dir::new("capi");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0usize;
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                return total;
            }
            s.write_all(&buf[..n]).unwrap();
            total += n;
        }
    });
    let o = run(smoke_cmd(&dir, &["tcp", &port]), Duration::from_secs(60));
    assert_ok(&o, "ok tcp");
    assert_eq!(
        echo.join().unwrap(),
        1024 * 1024 + 100 + 4,
        "bytes through the plain echo"
    );
}

#[test]
fn c_server_upgrades_with_a_smclo_client() {
    let dir = Dir::new("capi");
    let tp = testpeer();
    let o = run(
        smoke_cmd(&dir, &["listen", tp.to_str().unwrap()]),
        Duration::from_secs(60),
    );
    assert_ok(&o, "ok listen");
}

/// A non-blocking C listener beside a client stopped mid-handshake:
/// `smclo_accept` fails with `EAGAIN` at once, `smclo_listener_fd` stays
/// quiet until the continued client's handshake decides, then the
/// connection is SMC-D, byte-checked.
#[test]
fn c_nonblocking_accept_does_not_wait_on_a_stopped_client() {
    let dir = Dir::new("capi");
    let tp = testpeer();
    let o = run(
        smoke_cmd(&dir, &["nbaccept", tp.to_str().unwrap()]),
        Duration::from_secs(60),
    );
    assert_ok(&o, "ok nbaccept");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("smc=1 reason=-"), "the client's end: {out}");
    let st = smclo::device::Device::open(&dir.0).unwrap().stats();
    assert_eq!(st.conns_opened, 1, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(st.xfer_bytes >= 1024 * 1024, "{st:?}");
}

/// An echo server (`smclo-testpeer`) on the device in `dir`, its port and
/// its output.
fn echo_server(dir: &Dir) -> (Kill, BufReader<std::process::ChildStdout>, String) {
    let peer = Command::new(testpeer())
        .args(["serve", "127.0.0.1:0", "echo"])
        .env("SMCLO_DEVICE_DIR", &dir.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn smclo-testpeer");
    let mut peer = Kill(peer);
    let mut out = BufReader::new(peer.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let port = line
        .trim()
        .strip_prefix("listening ")
        .and_then(|a| a.rsplit(':').next())
        .unwrap_or_else(|| panic!("testpeer said {line:?}"))
        .to_string();
    (peer, out, port)
}

/// `smclo_poller` from C over two SMC-D streams and a pipe; the device's
/// counters prove both streams went through shared memory.
#[test]
fn c_poller_over_two_streams() {
    let dir = Dir::new("capi");
    let (mut a, _oa, pa) = echo_server(&dir);
    let (mut b, _ob, pb) = echo_server(&dir);
    let o = run(
        smoke_cmd(&dir, &["poller", &format!("{pa},{pb}")]),
        Duration::from_secs(60),
    );
    assert_ok(&o, "ok poller");
    for p in [&mut a, &mut b] {
        let st = p.0.wait().unwrap();
        assert!(st.success(), "smclo-testpeer: {st}");
    }
    let st = smclo::device::Device::open(&dir.0)
        .expect("the test device")
        .stats();
    assert_eq!(st.conns_opened, 2, "{st:?}");
    assert_eq!(st.fallbacks_total(), 0, "{st:?}");
    assert!(st.xfer_bytes >= 4 * 2000 * 64, "{st:?}");
}

/// A C client whose own SIGBUS handler (installed after smclo's, asking
/// `smclo_fault_recover` first) truncates its private device under an
/// SMC-D connection: the stream is reset (ECONNRESET), the client lives and
/// its own fault still reaches its handler; the server (the native API,
/// with smclo's handler) is not killed either.
#[test]
fn c_client_survives_its_device_truncated() {
    let dir = Dir::new("capi");
    let peer = Command::new(testpeer())
        .args(["serve", "127.0.0.1:0", "echo"])
        .env("SMCLO_DEVICE_DIR", &dir.0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn smclo-testpeer");
    let mut peer = Kill(peer);
    let mut out = BufReader::new(peer.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("testpeer said {line:?}"));
    let port = addr.rsplit(':').next().unwrap().to_string();
    let o = run(smoke_cmd(&dir, &["shrink", &port]), Duration::from_secs(60));
    assert_ok(&o, "ok shrink");
    let st = peer.0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), None, "smclo-testpeer: {st}");
}
