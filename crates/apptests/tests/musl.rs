//! Programs linked against musl (Alpine's, anything built with musl-gcc)
//! under `smclo run`: musl's loader gets the preload's musl build
//! (`libsmclo_preload_musl.so`), glibc's the glibc build, also for a
//! program another one execs, and the two builds meet on one device. The
//! test programs are dynamically linked C programs, each built for both C
//! libraries from one source; every test checks the bytes at both ends
//! and the device's counters (SMC-D connections, no fallback, exactly the
//! bytes sent). Needs musl-gcc (Debian's musl-tools) and the musl build
//! (scripts/build-musl-preload, which test.sh runs).

use smclo_apptests::*;
use smclo_loader::Loader;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
/// Larger than the default ring (256 KiB): the writer blocks for room.
const N: usize = 300_000;
/// The request line each exec test's client sends first.
const LINE: u64 = 4;

/// The C library a test program is built against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Libc {
    Glibc,
    Musl,
}

impl Libc {
    fn name(self) -> &'static str {
        match self {
            Libc::Glibc => "glibc",
            Libc::Musl => "musl",
        }
    }

    fn loader(self) -> Loader {
        match self {
            Libc::Glibc => Loader::Glibc,
            Libc::Musl => Loader::Musl,
        }
    }
}

fn src(dir: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(dir)
        .join(name)
}

/// Builds `src` against `libc` (cc, or musl-gcc), linked dynamically, into
/// the test's temp dir; checks that the program asks for that C library's
/// loader.
fn build(env: &Env, src: &Path, libc: Libc) -> String {
    let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("prog");
    let exe = env.path(&format!("{stem}-{}", libc.name()));
    let mut c = match libc {
        Libc::Glibc => Command::new("cc"),
        Libc::Musl => {
            let mut c = Command::new(require("musl-gcc"));
            // musl has no execveat wrapper: the exec tests' inetd reaches
            // it through syscall(2) (these tests never take that path).
            c.args([
                "-include",
                "sys/syscall.h",
                "-Dexecveat(d,p,a,e,f)=syscall(SYS_execveat,d,p,a,e,f)",
            ]);
            c
        }
    };
    let st = c
        .args(["-O2", "-Wall", "-o"])
        .arg(&exe)
        .arg(src)
        .status()
        .expect("running the C compiler");
    assert!(
        st.success(),
        "building {} for {libc:?} failed",
        src.display()
    );
    assert_eq!(Loader::of_path(&exe), libc.loader(), "{}", exe.display());
    exe.display().to_string()
}

/// Starts `prog args` under smclo with the debug log, and waits until it
/// listens on `port`.
fn server(env: &mut Env, port: u16, prog: &str, args: &[&str]) -> Proc {
    let mut c = env.command(Mode::Smclo, None, prog, args);
    c.env("SMCLO_DEBUG", "1");
    let mut p = env.spawn_cmd("server", c);
    wait_listen(&mut p, port);
    p
}

/// The "ok N" line a pair end printed, as N.
fn ok_bytes(p: &Proc, logs: &str) -> u64 {
    let out = p.stdout_str();
    out.trim()
        .strip_prefix("ok ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}: {out:?}\n{}\n{logs}", p.name, p.logs()))
}

/// `clients` clients of one build against a server of the other (or the
/// same), both under `smclo run`: every connection SMC-D, byte-exact.
fn pair(server_libc: Libc, client_libc: Libc) {
    let what = format!(
        "{} server, {} client",
        server_libc.name(),
        client_libc.name()
    );
    let mut env = Env::new(&format!(
        "musl-{}-{}",
        server_libc.name(),
        client_libc.name()
    ));
    let pair_c = src("musl", "pair.c");
    let (srv_prog, cli_prog) = (
        build(&env, &pair_c, server_libc),
        build(&env, &pair_c, client_libc),
    );
    let (port, n, clients) = (free_port(), N.to_string(), 2u64);
    let s0 = env.stats();
    let p = port.to_string();
    let mut srv = server(
        &mut env,
        port,
        &srv_prog,
        &["server", &p, &clients.to_string(), &n],
    );
    for i in 0..clients {
        let mut c = env.command(Mode::Smclo, None, &cli_prog, &["client", &p, &n]);
        c.env("SMCLO_DEBUG", "1");
        let mut c = env.spawn_cmd(&format!("client{i}"), c);
        c.wait_ok(T);
        assert_eq!(ok_bytes(&c, &srv.logs()), N as u64, "{what}");
    }
    srv.wait_ok(T);
    assert_eq!(ok_bytes(&srv, ""), clients * N as u64, "{what}");
    let want = clients * 2 * N as u64;
    assert_smc(
        &what,
        &delta(&s0, &env.stats()),
        clients,
        want,
        want,
        &srv.logs(),
    );
}

#[test]
fn musl_server_and_musl_client() {
    pair(Libc::Musl, Libc::Musl);
}

#[test]
fn glibc_server_and_musl_client() {
    pair(Libc::Glibc, Libc::Musl);
}

#[test]
fn musl_server_and_glibc_client() {
    pair(Libc::Musl, Libc::Glibc);
}

/// The musl build needs nothing of the system but musl's libc.so (which
/// is musl's loader itself): no libgcc_s, nothing of glibc.
#[test]
fn the_musl_build_needs_musls_libc_alone() {
    let lib = profile_dir().join("libsmclo_preload_musl.so");
    assert!(
        lib.is_file(),
        "{} is missing: build it with scripts/build-musl-preload (test.sh does)",
        lib.display()
    );
    let out = Command::new(require("readelf"))
        .arg("-d")
        .arg(&lib)
        .output()
        .expect("readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1)?.split(']').next())
        .collect();
    assert_eq!(needed, ["libc.so"], "{text}");
}

/// A glibc program under `smclo run` starts a musl client: a shell by
/// exec and by fork and exec, a program by `posix_spawnp`. The client runs
/// with the musl build and its connection is SMC-D with the glibc server.
#[test]
fn a_glibc_program_starts_a_musl_client() {
    let mut env = Env::new("musl-started");
    let pair_c = src("musl", "pair.c");
    let (srv_prog, cli_prog) = (
        build(&env, &pair_c, Libc::Glibc),
        build(&env, &pair_c, Libc::Musl),
    );
    let spawn = build(&env, &src("musl", "spawn.c"), Libc::Glibc);
    let (port, n) = (free_port(), N.to_string());
    let clients = 3;
    let s0 = env.stats();
    let mut srv = server(
        &mut env,
        port,
        &srv_prog,
        &["server", &port.to_string(), &clients.to_string(), &n],
    );
    let client = format!("{cli_prog} client {port} {N}");
    let (by_exec, by_fork) = (format!("exec {client}"), format!("{client}; echo done"));
    let p = port.to_string();
    let starts: [(&str, &[&str]); 3] = [
        ("sh", &["-c", &by_exec]),
        ("sh", &["-c", &by_fork]),
        (&spawn, &[&cli_prog, "client", &p, &n]),
    ];
    for (i, (prog, args)) in starts.into_iter().enumerate() {
        let c = env.run(Mode::Smclo, &format!("start{i}"), prog, args, T);
        assert!(
            c.stdout_str().starts_with(&format!("ok {N}\n")),
            "{prog} {args:?}: {}",
            c.logs()
        );
    }
    srv.wait_ok(T);
    let want = clients * 2 * N as u64;
    assert_smc(
        "glibc programs start musl clients",
        &delta(&s0, &env.stats()),
        clients,
        want,
        want,
        &srv.logs(),
    );
}

/// Without a musl build to give it, a musl program runs without smclo
/// (plain TCP, byte-exact), started by `smclo run` or exec'd by a glibc
/// program under it: never stopped before `main` by a library its loader
/// cannot load. A variable naming no file is an error, as for glibc.
#[test]
fn without_a_musl_build_a_musl_program_runs_plain() {
    let mut env = Env::new("musl-no-build");
    let pair_c = src("musl", "pair.c");
    let (srv_prog, cli_prog) = (
        build(&env, &pair_c, Libc::Glibc),
        build(&env, &pair_c, Libc::Musl),
    );
    // smclo and the glibc build alone in a directory: no musl build.
    let alone = env.path("glibc-build-alone");
    std::fs::create_dir_all(&alone).unwrap();
    let smclo = alone.join("smclo");
    std::fs::copy(smclo_bin(), &smclo).unwrap();
    let glibc = profile_dir().join("libsmclo_preload.so");
    std::fs::copy(glibc, alone.join("libsmclo_preload.so")).unwrap();
    let smclo = smclo.display().to_string();
    let (port, n) = (free_port(), N.to_string());
    let s0 = env.stats();
    let mut srv = server(
        &mut env,
        port,
        &srv_prog,
        &["server", &port.to_string(), "2", &n],
    );
    let p = port.to_string();
    let by_sh = format!("exec {cli_prog} client {port} {N}");
    let starts: [&[&str]; 2] = [
        &["run", "-d", "--", &cli_prog, "client", &p, &n],
        &["run", "-d", "--", "sh", "-c", &by_sh],
    ];
    for (i, args) in starts.into_iter().enumerate() {
        let c = env.command(Mode::Plain, None, &smclo, args);
        let mut c = env.spawn_cmd(&format!("client{i}"), c);
        c.wait_ok(T);
        assert_eq!(ok_bytes(&c, &srv.logs()), N as u64);
        assert!(
            c.stderr_str().contains("runs without"),
            "the debug log says why: {}",
            c.logs()
        );
    }
    srv.wait_ok(T);
    assert_plain(
        "musl clients without their build",
        &delta(&s0, &env.stats()),
        2,
        "server",
        &srv.logs(),
    );
    let mut c = env.command(Mode::Smclo, None, &cli_prog, &["client", &p, &n]);
    c.env(
        "SMCLO_PRELOAD_MUSL_LIB",
        "/nonexistent/libsmclo_preload_musl.so",
    );
    let mut c = env.spawn_cmd("bad-variable", c);
    assert_eq!(c.wait(T).code(), Some(1), "{}", c.logs());
    assert!(
        c.stderr_str().contains("SMCLO_PRELOAD_MUSL_LIB"),
        "{}",
        c.logs()
    );
}

/// Bytes one exec test connection moves: the client's request line and
/// payload, the server's greeting, the payload back and the trailer.
fn exchange(greeting: &str, trailer: &str) -> u64 {
    LINE + N as u64 + greeting.len() as u64 + N as u64 + trailer.len() as u64
}

/// One client (the exec tests' client.py, under smclo) against the server
/// `srv` on `port`: it checks that it reads `greeting`, its payload
/// complemented and `trailer`.
fn client_py(env: &mut Env, port: u16, greeting: &str, trailer: &str, srv: &Proc, what: &str) {
    let script = env.path("client.py");
    std::fs::copy(src("exec", "client.py"), &script).unwrap();
    let (g, t) = (
        greeting.escape_default().to_string(),
        trailer.escape_default().to_string(),
    );
    let c = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &[
            &script.display().to_string(),
            &port.to_string(),
            &N.to_string(),
            &g,
            &t,
        ],
        T,
    );
    assert!(
        c.stdout_str().starts_with("ok "),
        "{what}: {}\n{}",
        c.logs(),
        srv.logs()
    );
}

/// An inetd-style server of one build passes each connection, by exec, to
/// a filter of the other build, which passes it on after 100000 bytes to a
/// filter of the first: both builds adopt the connection in turn, in
/// shared memory all along (the exec tests' programs).
fn exec_chain(first: Libc, second: Libc) {
    let what = format!(
        "{} inetd, {} filter, {} filter",
        first.name(),
        second.name(),
        first.name()
    );
    let mut env = Env::new(&format!("musl-exec-{}", first.name()));
    let inetd = build(&env, &src("exec", "inetd.c"), first);
    let filter_c = src("exec", "filter.c");
    let (f1, f2) = (
        build(&env, &filter_c, second),
        build(&env, &filter_c, first),
    );
    let port = free_port();
    let s0 = env.stats();
    let mut srv = server(
        &mut env,
        port,
        &inetd,
        &[&port.to_string(), "1", &f1, "100000", &f2],
    );
    let greeting = "hello from inetd\n";
    let trailer = format!("filter {}\n", N - 100_000);
    client_py(&mut env, port, greeting, &trailer, &srv, &what);
    srv.wait_ok(T);
    let logs = srv.logs();
    assert_eq!(
        logs.matches("exec: adopted SMC-D connection").count(),
        2,
        "{what}: {logs}"
    );
    let want = exchange(greeting, &trailer);
    assert_smc(&what, &delta(&s0, &env.stats()), 1, want, want, &logs);
}

#[test]
fn a_glibc_server_execs_musl_then_glibc() {
    exec_chain(Libc::Glibc, Libc::Musl);
}

#[test]
fn a_musl_server_execs_glibc_then_musl() {
    exec_chain(Libc::Musl, Libc::Glibc);
}

/// A musl program that uses C stdio on the connection it was exec'd with
/// (as descriptors 0 and 1): its `stdin` and `stdout` are replaced by
/// streams on the connection, also where musl makes them read-only.
#[test]
fn a_glibc_server_execs_a_musl_stdio_program() {
    let what = "glibc inetd, musl stdio filter";
    let mut env = Env::new("musl-exec-stdio");
    let inetd = build(&env, &src("exec", "inetd.c"), Libc::Glibc);
    let filter = build(&env, &src("musl", "stdio_filter.c"), Libc::Musl);
    let port = free_port();
    let s0 = env.stats();
    let mut srv = server(&mut env, port, &inetd, &[&port.to_string(), "1", &filter]);
    let greeting = "hello from inetd\n";
    let trailer = format!("stdio {N}\n");
    client_py(&mut env, port, greeting, &trailer, &srv, what);
    srv.wait_ok(T);
    let logs = srv.logs();
    assert!(
        logs.contains("exec: adopted SMC-D connection on fd 0+1"),
        "{what}: {logs}"
    );
    let want = exchange(greeting, &trailer);
    assert_smc(what, &delta(&s0, &env.stats()), 1, want, want, &logs);
}

/// The preload's event-loop checks (`crates/preload/tests/c/evloop.c`:
/// level- and edge-triggered epoll, one-shot, `EPOLLRDHUP`, a full ring,
/// a signal let in by a mask, mixed sets, threads, fork, poll, select and
/// pselect, a pending connect), built for musl and run under `smclo run`:
/// each over one SMC-D connection, as with glibc.
#[test]
fn the_event_loop_checks_pass_with_musl() {
    let build_env = Env::new("musl-evloop-build");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../preload/tests/c/evloop.c");
    let evloop = build(&build_env, &src, Libc::Musl);
    let modes = [
        "lt",
        "et",
        "oneshot",
        "rdhup",
        "out",
        "mixed",
        "sigmask",
        "threads",
        "fork",
        "poll",
        "exclusive",
        "select-semantics",
        "select",
        "pselect",
        "select-connect",
    ];
    for mode in modes {
        let mut env = Env::new(&format!("musl-evloop-{mode}"));
        let s0 = env.stats();
        let p = env.run(Mode::Smclo, mode, &evloop, &[mode], T);
        let read: u64 = p
            .stdout_str()
            .lines()
            .find_map(|l| l.strip_prefix("OK "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{mode}: no OK line\n{}", p.logs()));
        let d = delta(&s0, &env.stats());
        assert_eq!(
            d.conns_opened,
            1,
            "{mode}: one SMC-D connection {d:?}\n{}",
            p.logs()
        );
        assert_eq!(
            d.fallbacks(),
            0,
            "{mode}: {}\n{}",
            d.fallbacks_desc(),
            p.logs()
        );
        assert!(
            d.xfer_bytes >= read,
            "{mode}: the {read} bytes read went through the rings {d:?}"
        );
    }
}
