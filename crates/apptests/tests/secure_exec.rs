//! exec into a program the kernel runs in secure mode (`AT_SECURE`, where
//! the loader ignores `LD_PRELOAD` paths), or into a Go program (which
//! loads the preload but makes its system calls itself): an inetd-style
//! server under
//! `smclo run` hands its SMC-D connection (dup2'd onto 0 and 1) to a
//! program that will not load the preload, so the connection falls back
//! as documented: the program gets the TCP socket at 0 and 1, never the
//! channel, and no `SMCLO_EXEC_CONNS`; the client sees the connection end
//! (a reset) at once instead of waiting for an answer that cannot come.
//! The device's counters show the connection was SMC-D.
//!
//! The secure-mode tests each create a user (unique name) and delete it
//! when they end, even when they fail.

use smclo_apptests::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
/// The client's payload after its request line.
const N: usize = 100_000;
/// How long the client may wait for the end of its connection: its own
/// socket timeout is 10 s, a hang.
const PROMPT: Duration = Duration::from_secs(8);

static SEQ: AtomicU32 = AtomicU32::new(0);

fn src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/exec")
        .join(name)
}

/// A user made for one test (no home, no login), deleted when dropped.
struct User {
    name: String,
}

impl User {
    fn new() -> User {
        assert!(is_root(), "creating a user needs root");
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("smclo-sx{}-{n}", std::process::id());
        let args = [
            "-M",
            "-N",
            "-g",
            "nogroup",
            "-s",
            "/usr/sbin/nologin",
            &name,
        ];
        // The account files' lock may be held by a concurrent useradd for
        // a moment.
        let t0 = Instant::now();
        loop {
            let o = Command::new(require("useradd"))
                .args(args)
                .output()
                .unwrap();
            if o.status.success() {
                return User { name };
            }
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("lock") && t0.elapsed() < Duration::from_secs(20),
                "useradd {name}: {err}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `uid:gid`, as inetd.c's INETD_USER and INETD_EUSER take it.
    fn ids(&self) -> String {
        let id = |flag: &str| {
            let o = Command::new("id")
                .args([flag, &self.name])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        };
        format!("{}:{}", id("-u"), id("-g"))
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

/// The probe (tests/exec/probe.c), readable and executable by anyone.
fn probe(env: &Env) -> String {
    compile_c(env, &src("probe.c"), &[]).display().to_string()
}

/// inetd.c, serving one client: it reads the request line, greets, puts
/// the connection on 0 and 1 and execs `prog` (with execv, or the
/// function `how` names) with `var` in its environment. One client (fallback_client.py) sends its request and
/// payload and must see its connection end promptly (reset, or the end of
/// the stream before the answer); the exec'd program must report the TCP
/// socket at 0 and 1 and no SMCLO_EXEC_CONNS; the server's log must say
/// `why` the new program does not load the preload.
fn secure_exec(env: &mut Env, prog: &str, how: &str, var: (&str, &str), why: &str) {
    let inetd = compile_c(env, &src("inetd.c"), &[]).display().to_string();
    let client = env.path("fallback_client.py");
    std::fs::copy(src("fallback_client.py"), &client).unwrap();
    let port = free_port();
    let s0 = env.stats();
    let mut c = env.command(Mode::Smclo, None, &inetd, &[&port.to_string(), "1", prog]);
    c.env("SMCLO_DEBUG", "1")
        .env("INETD_EXEC", how)
        .env(var.0, var.1);
    let mut srv = env.spawn_cmd("server", c);
    wait_listen(&mut srv, port);
    let t0 = Instant::now();
    let script = client.display().to_string();
    let mut cl = env.spawn(
        Mode::Smclo,
        "client",
        "python3",
        &[&script, &port.to_string(), &N.to_string()],
    );
    let st = cl.wait(T);
    let waited = t0.elapsed();
    let st_srv = srv.wait(T);
    let (out, logs) = (cl.stdout_str(), srv.logs());
    let report = format!(
        "client: {st} {out}\n{}\nserver: {st_srv}\n{logs}",
        cl.logs()
    );
    assert!(
        logs.contains("probe fd0=inet fd1=inet env=absent"),
        "the program got the channel or SMCLO_EXEC_CONNS\n{report}"
    );
    assert!(
        logs.contains(&format!(
            "will not load LD_PRELOAD libraries ({why}); its SMC-D connections fall back"
        )),
        "{report}"
    );
    let short = out
        .strip_prefix("eof ")
        .and_then(|n| n.trim().parse::<usize>().ok())
        .is_some_and(|n| n < N);
    assert!(
        st.success() && (out.starts_with("reset") || short),
        "the client must see its connection end\n{report}"
    );
    assert!(waited < PROMPT, "the client waited {waited:?}\n{report}");
    assert!(st_srv.success(), "{report}");
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, 1, "SMC-D before the exec: {d:?}\n{report}");
    assert_eq!(d.fallbacks(), 0, "{}\n{report}", d.fallbacks_desc());
}

/// The program has file capabilities (`setcap cap_net_bind_service+ep`)
/// and the server's child is an ordinary user when it execs it, by path
/// (execv, execveat) or by descriptor (fexecve).
#[test]
fn exec_of_a_program_with_file_capabilities_falls_back() {
    let user = User::new();
    let mut env = Env::new("exec-filecaps");
    let prog = probe(&env);
    let st = Command::new(require("setcap"))
        .args(["cap_net_bind_service+ep", &prog])
        .status()
        .unwrap();
    assert!(st.success(), "setcap on {prog}");
    let ids = user.ids();
    let why = "file capabilities: secure mode";
    for how in ["execv", "execveat", "fexecve"] {
        secure_exec(&mut env, &prog, how, ("INETD_USER", &ids), why);
    }
}

/// The server's child set only its effective user and group (seteuid,
/// setegid) before the exec of an ordinary program.
#[test]
fn exec_with_effective_ids_apart_from_real_falls_back() {
    let user = User::new();
    let mut env = Env::new("exec-euid");
    let prog = probe(&env);
    let ids = user.ids();
    let why = "real and effective user or group differ: secure mode";
    secure_exec(&mut env, &prog, "execv", ("INETD_EUSER", &ids), why);
}

/// The program is a Go program linked dynamically (tests/exec/probe.go):
/// its loader loads the preload, but Go reads and writes descriptors with
/// its own system calls, so it must get the TCP socket, not the channel.
#[test]
fn exec_of_a_go_program_falls_back() {
    let mut env = Env::new("exec-go");
    let dir = env.path("probe-go");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src("probe.go"), dir.join("probe.go")).unwrap();
    std::fs::write(dir.join("go.mod"), "module probe\ngo 1.18\n").unwrap();
    let st = Command::new(require("go"))
        .args(["build", "-o", "probe", "."])
        .current_dir(&dir)
        .env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", "1")
        .status()
        .unwrap();
    assert!(st.success(), "go build of probe.go failed");
    let prog = dir.join("probe").display().to_string();
    let why = "a Go program, which makes its system calls without the C library";
    secure_exec(&mut env, &prog, "execv", ("INETD_GO", "1"), why);
}
