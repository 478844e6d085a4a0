//! exec keeps SMC-D connections: a program that passes a connection to a
//! new program (inetd-style servers, `socat ... EXEC:...,nofork`, python's
//! `subprocess` with `pass_fds`, shells, a chain of execs) and the new
//! program both run under `smclo run`; the new program goes on with the
//! connection in shared memory, byte-exact both ways, with what was in
//! flight at the exec. Each test checks the device's counters: SMC-D
//! connections, no fallback, and exactly the bytes both ends sent. A new
//! program without the preload gets the clean, logged fallback (reset).

use smclo_apptests::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
/// Larger than the default ring (256 KiB): the client blocks for room,
/// so bytes are in flight at every exec.
const N: usize = 300_000;
/// The request line each client sends first.
const LINE: u64 = 4;

fn src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/exec")
        .join(name)
}

fn write_script(env: &Env, name: &str) -> String {
    let p = env.path(name);
    std::fs::copy(src(name), &p).unwrap();
    p.display().to_string()
}

/// Starts `args` (a server listening on `port`) under smclo with the debug
/// log, with `vars` in its environment.
fn server(env: &mut Env, port: u16, prog: &str, args: &[&str], vars: &[(&str, &str)]) -> Proc {
    let mut c = env.command(Mode::Smclo, None, prog, args);
    c.env("SMCLO_DEBUG", "1");
    for (k, v) in vars {
        c.env(k, v);
    }
    let mut p = env.spawn_cmd("server", c);
    wait_listen(&mut p, port);
    p
}

/// Runs `clients` clients (client.py) at once against `port`, each
/// checking what it reads byte for byte.
fn clients(env: &mut Env, port: u16, clients: usize, check: &[&str], server: &Proc) {
    let script = write_script(env, "client.py");
    let (ps, ns) = (port.to_string(), N.to_string());
    let mut args = vec![script.as_str(), ps.as_str(), ns.as_str()];
    args.extend_from_slice(check);
    let mut cs: Vec<Proc> = (0..clients)
        .map(|i| {
            let c = env.command(Mode::Smclo, None, "python3", &args);
            env.spawn_cmd(&format!("client{i}"), c)
        })
        .collect();
    for c in cs.iter_mut() {
        let st = c.wait(T);
        assert!(
            st.success() && c.stdout_str().starts_with("ok "),
            "{}\n{}",
            c.logs(),
            server.logs()
        );
    }
}

fn inetd(env: &Env) -> String {
    compile_c(env, &src("inetd.c"), &[]).display().to_string()
}

fn filter(env: &Env) -> String {
    compile_c(env, &src("filter.c"), &[]).display().to_string()
}

/// Bytes one connection moves: the client's request line and payload, the
/// server's greeting, the payload back and the trailer.
fn exchange(greeting: &str, trailer: &str) -> u64 {
    LINE + N as u64 + greeting.len() as u64 + N as u64 + trailer.len() as u64
}

/// `n` clients (client.py) against the server `srv` on `port`, each
/// checking that it reads `greeting`, its payload back and `trailer`;
/// then the server exits, and the device must have counted exactly their
/// bytes, over SMC-D.
fn served(
    env: &mut Env,
    srv: &mut Proc,
    port: u16,
    n: usize,
    greeting: &str,
    trailer: &str,
    how: &str,
) {
    let s0 = env.stats();
    let (g, t) = (greeting.escape_default(), trailer.escape_default());
    clients(env, port, n, &[&g.to_string(), &t.to_string()], srv);
    srv.wait_ok(T);
    let d = delta(&s0, &env.stats());
    let want = n as u64 * exchange(greeting, trailer);
    assert_smc(how, &d, n as u64, want, want, &srv.logs());
}

#[test]
fn inetd_dup2_exec_c_filter() {
    let mut env = Env::new("exec-inetd");
    let (inetd, filter) = (inetd(&env), filter(&env));
    let port = free_port();
    let mut srv = server(
        &mut env,
        port,
        &inetd,
        &[&port.to_string(), "3", &filter],
        &[],
    );
    let trailer = format!("filter {N}\n");
    let how = "inetd + exec'd filter";
    served(
        &mut env,
        &mut srv,
        port,
        3,
        "hello from inetd\n",
        &trailer,
        how,
    );
    assert!(
        srv.logs()
            .contains("exec: adopted SMC-D connection on fd 0+1"),
        "{}",
        srv.logs()
    );
}

/// The other exec forms: `execveat` and `fexecve`.
#[test]
fn execveat_and_fexecve() {
    for how in ["execveat", "fexecve"] {
        let mut env = Env::new(&format!("exec-{how}"));
        let (inetd, filter) = (inetd(&env), filter(&env));
        let port = free_port();
        let args = [&port.to_string() as &str, "1", &filter];
        let mut srv = server(&mut env, port, &inetd, &args, &[("INETD_EXEC", how)]);
        let trailer = format!("filter {N}\n");
        served(
            &mut env,
            &mut srv,
            port,
            1,
            "hello from inetd\n",
            &trailer,
            how,
        );
    }
}

#[test]
fn chain_of_two_execs() {
    let mut env = Env::new("exec-chain");
    let (inetd, filter) = (inetd(&env), filter(&env));
    let port = free_port();
    // inetd execs a filter that complements 100000 bytes and execs a
    // filter that complements the rest.
    let args = [&port.to_string() as &str, "1", &filter, "100000", &filter];
    let mut srv = server(&mut env, port, &inetd, &args, &[]);
    let trailer = format!("filter {}\n", N - 100_000);
    let how = "inetd + two execs";
    served(
        &mut env,
        &mut srv,
        port,
        1,
        "hello from inetd\n",
        &trailer,
        how,
    );
    assert_eq!(
        srv.logs().matches("exec: adopted SMC-D connection").count(),
        2,
        "{}",
        srv.logs()
    );
}

/// The shell lists the device's connections (`smclo ss`, a program that
/// inherits the connection on its stdin and lets go of it), then forks
/// and execs tr (stdio on stdin and stdout), then writes its own line
/// once tr has seen the end of the stream. `smclo ss` names the shell,
/// with its pid, as the owner of the server's end.
#[test]
fn inetd_exec_shell_with_stdio_program() {
    let mut env = Env::new("exec-shell");
    let inetd = inetd(&env);
    let port = free_port();
    let s0 = env.stats();
    let script = format!(
        "{} ss --json > ss.json; echo $$ > sh.pid; tr a-z A-Z; echo done",
        smclo_bin().display()
    );
    let args = [&port.to_string() as &str, "1", "/bin/sh", "-c", &script];
    let mut srv = server(&mut env, port, &inetd, &args, &[]);
    clients(
        &mut env,
        port,
        1,
        &["hello from inetd\\n", "done\\n", "upper"],
        &srv,
    );
    srv.wait_ok(T);
    let d = delta(&s0, &env.stats());
    let want = exchange("hello from inetd\n", "done\n");
    assert_smc("inetd + sh + tr", &d, 1, want, want, &srv.logs());
    let json = std::fs::read_to_string(env.path("ss.json")).unwrap();
    let pid = std::fs::read_to_string(env.path("sh.pid")).unwrap();
    let end = json
        .split('{')
        .find(|o| o.contains(&format!("\"pid\":{},", pid.trim())))
        .unwrap_or_else(|| panic!("no end of pid {pid} in {json}"));
    for field in [
        "\"state\":\"ACTIVE\"",
        "\"program\":\"sh\"",
        "\"role\":\"server\"",
        "\"mode\":\"smcd\"",
    ] {
        assert!(end.contains(field), "{field} in {end}");
    }
}

#[test]
fn socat_exec_nofork() {
    let mut env = Env::new("exec-socat");
    let filter = filter(&env);
    let port = free_port();
    let s0 = env.stats();
    let listen = format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork");
    let exec = format!("EXEC:{filter},nofork");
    let mut srv = server(&mut env, port, "socat", &[&listen, &exec], &[]);
    // No request line is read by socat: it reaches the filter too.
    let trailer = format!("filter {}\n", N as u64 + LINE);
    clients(
        &mut env,
        port,
        2,
        &["", &trailer.escape_default().to_string(), "not", "raw"],
        &srv,
    );
    let d = delta(&s0, &env.stats());
    let want = 2 * (LINE + N as u64 + LINE + N as u64 + trailer.len() as u64);
    srv.stop(Duration::from_secs(2));
    assert_smc("socat EXEC:...,nofork", &d, 2, want, want, &srv.logs());
}

#[test]
fn python_subprocess_pass_fds() {
    let mut env = Env::new("exec-pass-fds");
    let server_py = write_script(&env, "pass_fds_server.py");
    let child_py = write_script(&env, "pass_fds_child.py");
    let port = free_port();
    let args = [&server_py as &str, &port.to_string(), "2", &child_py];
    let mut srv = server(&mut env, port, "python3", &args, &[]);
    let trailer = format!("child {N}\n");
    let how = "python pass_fds";
    served(
        &mut env,
        &mut srv,
        port,
        2,
        "hello from python\n",
        &trailer,
        how,
    );
}

#[test]
fn failed_exec_keeps_the_connection() {
    let mut env = Env::new("exec-fails");
    let inetd = inetd(&env);
    let port = free_port();
    let missing = env.path("no-such-program").display().to_string();
    let vars = [("INETD_SERVE_ON_FAIL", "1")];
    let mut srv = server(
        &mut env,
        port,
        &inetd,
        &[&port.to_string(), "1", &missing],
        &vars,
    );
    let trailer = format!("inline {N}\n");
    let how = "failed exec, served inline";
    served(
        &mut env,
        &mut srv,
        port,
        1,
        "hello from inetd\n",
        &trailer,
        how,
    );
}

#[test]
fn exec_without_preload_resets_cleanly() {
    let mut env = Env::new("exec-plain");
    let (inetd, filter) = (inetd(&env), filter(&env));
    let script = write_script(&env, "fallback_client.py");
    let port = free_port();
    let s0 = env.stats();
    let vars = [("INETD_PLAIN", "1")];
    let mut srv = server(
        &mut env,
        port,
        &inetd,
        &[&port.to_string(), "1", &filter],
        &vars,
    );
    let t0 = Instant::now();
    let c = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &[&script, &port.to_string(), &N.to_string()],
        T,
    );
    let out = c.stdout_str();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the client waited {:?}",
        t0.elapsed()
    );
    // The peer sees a reset (or, had it read everything already, the end
    // of the stream), never the filter's answer.
    let short = out
        .strip_prefix("eof ")
        .and_then(|n| n.trim().parse::<usize>().ok())
        .is_some_and(|n| n < N);
    assert!(
        out.starts_with("reset") || short,
        "client: {out}\n{}\n{}",
        c.logs(),
        srv.logs()
    );
    srv.wait(T);
    let logs = srv.logs();
    assert!(
        logs.contains("LD_PRELOAD of the new program does not name smclo")
            && logs.contains("cannot follow into the new program"),
        "{logs}"
    );
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.conns_opened, 1,
        "the connection was SMC-D before the exec: {d:?}"
    );
    assert_eq!(d.fallbacks(), 0, "{}", d.fallbacks_desc());
}

/// What the preload emulates for the descriptor goes along: O_NONBLOCK,
/// SO_RCVTIMEO and SO_SNDTIMEO (set, and in effect), TCP_CORK (set, and
/// the lines written while corked arrive once uncorked), at the same
/// number.
#[test]
fn exec_keeps_flags_and_options() {
    let mut env = Env::new("exec-flags");
    let prog = compile_c(&env, &src("keep_flags.c"), &[])
        .display()
        .to_string();
    let script = write_script(&env, "flags_client.py");
    let port = free_port();
    let s0 = env.stats();
    let mut srv = server(&mut env, port, &prog, &["serve", &port.to_string()], &[]);
    let c = env.run(
        Mode::Smclo,
        "client",
        "python3",
        &[&script, &port.to_string()],
        T,
    );
    srv.wait_ok(T);
    let want = "nonblock 1\nrcvtimeo 300\nsndtimeo 700\ncork 1\neagain\ntimeout\n";
    assert_eq!(c.stdout_str(), want, "{}\n{}", c.logs(), srv.logs());
    let d = delta(&s0, &env.stats());
    let bytes = LINE + want.len() as u64;
    assert_smc("flags through exec", &d, 1, bytes, bytes, &srv.logs());
}

/// `close_range(3, ~0, 0)` between two connections, through libc's
/// wrapper and as a raw `syscall(SYS_close_range, ..)` (the preload's
/// `close_range` both ways): smclo's own descriptors stay open, the
/// process's rendezvous socket among them, and the second connection goes
/// through shared memory as the first did. Before, the rendezvous socket
/// was closed (the second connection fell back, PEER_DEAD), and the raw
/// call closed every descriptor behind smclo's back.
#[test]
fn close_range_leaves_smclo_its_descriptors() {
    let mut env = Env::new("exec-raw-close-range");
    let prog = compile_c(&env, &src("raw_close_range.c"), &[])
        .display()
        .to_string();
    let echo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/echo_check.py");
    let port = free_port();
    let ps = port.to_string();
    let mut srv = env.spawn(
        Mode::Smclo,
        "echo",
        "python3",
        &[echo.to_str().unwrap(), "listen", "127.0.0.1", &ps, "4"],
    );
    srv.wait_stdout("ready", T, &[]);
    let s0 = env.stats();
    for wrapper in [true, false] {
        let mut c = env.command(Mode::Smclo, None, &prog, &[&ps, "100000"]);
        if wrapper {
            c.env("WRAPPER", "1");
        }
        let mut p = env.spawn_cmd("close-range", c);
        p.wait_ok(T);
        assert_eq!(p.stdout_str(), "ok\n", "{}\n{}", p.logs(), srv.logs());
    }
    srv.wait_ok(T);
    let d = delta(&s0, &env.stats());
    assert_smc("close_range", &d, 4, 800_000, 800_000, &srv.logs());
    assert_eq!(d.conns_opened, 4, "{d:?}");
}

/// The preload's `close_range` (which python's subprocess uses before it
/// execs, and which leaves smclo's own descriptors open) answers as the
/// kernel's for the program's own descriptors, and for an empty range.
#[test]
fn close_range_as_the_kernels() {
    let mut env = Env::new("exec-close-range");
    let prog = compile_c(&env, &src("close_range.c"), &[])
        .display()
        .to_string();
    let p = env.run(Mode::Smclo, "close-range", &prog, &[], T);
    assert_eq!(p.stdout_str(), "ok\n", "{}", p.logs());
}
