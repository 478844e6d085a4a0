//! The harness itself, where its own answers decide whether a test passes.

use smclo_apptests::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// `listening` answers in well under a millisecond however many TIME_WAIT
/// sockets the network namespace holds. It read the whole of
/// /proc/<pid>/net/tcp: over 30 ms for these 25000 sockets, seconds on a
/// loaded machine after the churn tests (70000 of them), and `wait_listen`
/// on systemd-socket-activate once gave up after 10 s. The sockets are made
/// in a network namespace of the test's own.
#[test]
fn listening_is_fast_beside_many_time_wait_sockets() {
    const N: u32 = 25000;
    let mut env = Env::new("harness-time-wait");
    let ns = env.netns("tw");
    ip_in(&ns.name, &["link", "set", "lo", "up"]);
    let port = 20000;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness/time_wait.py");
    let cmd = env.command(
        Mode::Plain,
        Some(&ns.name),
        "python3",
        &[script.to_str().unwrap(), &port.to_string(), &N.to_string()],
    );
    let mut p = env.spawn_cmd("time-wait", cmd);
    p.wait_stdout("READY", Duration::from_secs(120), &[]);
    let mut fastest = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        assert!(
            listening(port, Some(p.pid())),
            "the listener is not seen: {:?}",
            sockdiag::listening_ports_of(p.pid())
        );
        fastest = fastest.min(t.elapsed());
    }
    assert!(!listening(port + 1, Some(p.pid())), "nothing else listens");
    eprintln!("listening() beside {N} TIME_WAIT sockets: {fastest:?} at best");
    assert!(
        fastest < Duration::from_millis(5),
        "listening() took {fastest:?} at best beside {N} TIME_WAIT sockets"
    );
    p.stop(Duration::from_secs(2));
}

/// A port whose only socket is in TIME_WAIT (the server closed first) is
/// in use for `free_port`, though nothing listens on it: a server that
/// binds without `SO_REUSEADDR` (sockperf) gets EADDRINUSE there.
#[test]
fn a_port_in_time_wait_is_not_free() {
    let port = free_port();
    let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (s, _) = l.accept().unwrap();
    drop(l);
    drop(s); // the server's end closes first: it goes to TIME_WAIT
    let mut buf = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut &c, &mut buf).unwrap(), 0);
    drop(c);
    assert!(!listening(port, None), "nothing listens on {port} any more");
    assert!(
        sockdiag::ports_in_use().unwrap().contains(&port),
        "the TIME_WAIT socket on {port} is not counted as in use"
    );
    let bound = bind_without_reuse(port);
    assert_eq!(
        bound.map_err(|e| e.raw_os_error()),
        Err(Some(libc::EADDRINUSE)),
        "a bind without SO_REUSEADDR should fail beside the TIME_WAIT socket"
    );
}

/// bind(2) of a fresh TCP socket to 127.0.0.1:`port` without
/// `SO_REUSEADDR` (std's listener sets it).
fn bind_without_reuse(port: u16) -> std::io::Result<()> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: plain socket(2); owned right below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is the fresh socket above, owned by nothing else.
    let _sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sa` is a valid sockaddr_in for its size.
    let r = unsafe {
        libc::bind(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Programs start with SIGINT and SIGQUIT at their defaults even when the
/// test run inherited them ignored (a background job of a shell without
/// job control, as `./test.sh &` or nohup): python http.server then
/// ignored the SIGINT its test stops it with, and the test hung 10 s.
#[test]
fn programs_do_not_inherit_an_ignored_sigint() {
    // SAFETY: signal(2) with SIG_IGN and the returned old disposition.
    let old = unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let mut env = Env::new("harness-sigint");
    let mut p = env.spawn(Mode::Plain, "status", "cat", &["/proc/self/status"]);
    // SAFETY: restores the disposition read above.
    unsafe { libc::signal(libc::SIGINT, old) };
    p.wait_ok(Duration::from_secs(10));
    let out = p.stdout_str();
    let ign = out
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .expect("SigIgn line");
    assert_eq!(ign & (1 << (libc::SIGINT - 1)), 0, "SIGINT ignored: {out}");
}

/// The panic message of `f`, which must panic.
fn panic_of(f: impl FnOnce()) -> String {
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .expect_err("it returned, where it should have panicked");
    e.downcast_ref::<String>().cloned().unwrap_or_default()
}

/// `Proc::wait_stdout` returns once the text is printed; it panics, with
/// the logs, as soon as the process exits without printing it, and when
/// the time given passes.
#[test]
fn wait_stdout_waits_for_the_text_and_no_longer() {
    let mut env = Env::new("harness-wait-stdout");
    let late = "import time; time.sleep(0.3); print('READY', flush=True); time.sleep(30)";
    let mut p = env.spawn(Mode::Plain, "late", "python3", &["-c", late]);
    p.wait_stdout("READY", Duration::from_secs(10), &[]);
    let mut gone = env.spawn(Mode::Plain, "gone", "python3", &["-c", "print('no')"]);
    let t0 = Instant::now();
    let why = panic_of(|| gone.wait_stdout("READY", Duration::from_secs(30), &[&p]));
    assert!(t0.elapsed() < Duration::from_secs(10), "{why}");
    assert!(
        why.starts_with("gone exited before printing \"READY\""),
        "{why}"
    );
    assert!(why.contains("--- late stdout:\nREADY"), "{why}");
    let mut quiet = env.spawn(Mode::Plain, "quiet", "python3", &["-c", late]);
    let short = Duration::from_millis(100);
    let why = panic_of(|| quiet.wait_stdout("READY", short, &[]));
    assert!(
        why.starts_with("quiet did not print \"READY\" within 100ms"),
        "{why}"
    );
}
