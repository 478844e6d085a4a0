//! Harness for the application acceptance tests in `tests/`: real programs
//! from Debian's packages run under `smclo run` (or plain), each test with its
//! own device directory under /dev/shm, its own temp dir, free ports on
//! 127.0.0.1 and a time bound on everything it starts. Every process a test
//! starts is the leader of its own process group and is killed with its whole
//! group (nginx workers, redis's BGSAVE child) when its guard drops.
//!
//! Programs that are missing make the test FAIL with the Debian package to
//! install (`.ci/run` installs them); nothing is skipped silently.

pub mod haproxy;
pub mod redis;
pub mod routed;
pub mod sockdiag;

pub use haproxy::{start_haproxy_tcp, start_haproxy_tcp_with};
pub use redis::{
    info_field, redis_benchmark_ping_in, redis_cli_in, redis_get_value_in, redis_ping_in,
    redis_set_value_in, start_redis, start_redis_in, start_redis_with,
};
pub use routed::Routed;

use smclo::device::{Device, Stats};
use smclo_wire::reason::Reason;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// How a program is started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `smclo run -- PROGRAM ARGS`
    Smclo,
    /// `PROGRAM ARGS`, no preload.
    Plain,
}

pub use smclo_testsupport::profile_dir;

/// The `smclo` binary next to the test executable's parent dir; panics with
/// a clear message if it has not been built.
pub fn smclo_bin() -> PathBuf {
    let p = profile_dir().join("smclo");
    assert!(
        p.is_file(),
        "{} is missing: build it first with `cargo build --release --workspace` (test.sh does; `cargo test` alone does not build the smclo binary)",
        p.display()
    );
    p
}

/// Debian package that provides each program the tests use.
fn package_of(prog: &str) -> &'static str {
    match prog {
        "redis-server" => "redis-server",
        "redis-cli" | "redis-benchmark" => "redis-tools",
        "nginx" => "nginx-light",
        "sockperf" => "sockperf",
        "iperf3" => "iperf3",
        "wrk" => "wrk",
        "curl" => "curl",
        "python3" => "python3",
        "ip" => "iproute2",
        "taskset" => "util-linux",
        "memcached" => "memcached",
        "memcslap" => "libmemcached-tools",
        "haproxy" => "haproxy",
        "psql" | "pgbench" => "postgresql-client",
        "node" => "nodejs",
        "runuser" | "setpriv" => "util-linux",
        "systemd-socket-activate" => "systemd",
        "socat" => "socat",
        "musl-gcc" => "musl-tools",
        "readelf" => "binutils",
        "useradd" | "usermod" | "userdel" | "groupadd" | "groupdel" | "gpasswd" => "passwd",
        _ => "(unknown package)",
    }
}

/// Absolute path of `prog`, found in PATH (and the sbin dirs, for nginx);
/// panics naming the Debian package when it is missing. Prefers Debian's
/// /usr/bin/python3 over shims earlier in PATH.
pub fn require(prog: &str) -> PathBuf {
    if prog == "python3" && Path::new("/usr/bin/python3").is_file() {
        return PathBuf::from("/usr/bin/python3");
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let extra = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];
    for d in path.split(':').chain(extra) {
        if d.is_empty() {
            continue;
        }
        let p = Path::new(d).join(prog);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "required program `{prog}` is not installed: apt-get install {} (.ci/run installs it)",
        package_of(prog)
    );
}

/// A port that was free on 127.0.0.1 and ::1 a moment ago, below the
/// ephemeral range (32768..) so that no client's source port takes it, and
/// found without bind(port 0), which fails once tens of thousands of
/// TIME_WAIT sockets (a connection-rate benchmark) hold the ephemeral range.
/// No port is handed out twice by one process, and a port any socket still
/// uses in any state (TIME_WAIT included) is skipped: a server that binds
/// without SO_REUSEADDR (sockperf) fails on those.
pub fn free_port() -> u16 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = *SEED.get_or_init(|| {
        (std::process::id() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ time_seed()
    });
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let in_use = sockdiag::ports_in_use().expect("sock_diag: TCP sockets in use");
    for _ in 0..2000 {
        let i = NEXT.fetch_add(1, Ordering::SeqCst) as u64;
        let port = 20000 + ((seed.wrapping_add(i * 7919)) % 12000) as u16;
        if given.contains(&port) || in_use.contains(&port) {
            continue;
        }
        // std's TcpListener sets SO_REUSEADDR, as the servers do.
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("::1", port)).is_ok()
        {
            given.push(port);
            return port;
        }
    }
    panic!("no free port in 20000..32000 on 127.0.0.1");
}

fn time_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A process (group) that is killed when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
    done: Option<ExitStatus>,
}

fn kill_group(pid: u32) {
    // SAFETY: kill has no memory-safety preconditions; the negative pid is
    // the process group this harness created for the child.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    pub fn stdout(&self) -> Vec<u8> {
        fs::read(&self.out).unwrap_or_default()
    }
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout()).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.err).unwrap_or_default()).into_owned()
    }
    /// Stdout and stderr, for failure messages (stderr truncated to its end).
    pub fn logs(&self) -> String {
        let mut e = self.stderr_str();
        if e.len() > 6000 {
            e = format!("...{}", &e[e.len() - 6000..]);
        }
        let mut o = self.stdout_str();
        if o.len() > 3000 {
            o = format!("{}...", &o[..3000]);
        }
        format!(
            "--- {} stdout:\n{o}\n--- {} stderr:\n{e}",
            self.name, self.name
        )
    }
    /// Still running?
    pub fn alive(&mut self) -> bool {
        if self.done.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(st)) => {
                self.done = Some(st);
                false
            }
            _ => true,
        }
    }
    /// Waits up to `timeout` for the process to exit; kills its group and
    /// panics (with its logs) if it does not.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.done {
                return st;
            }
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                self.done = Some(st);
                return st;
            }
            if t0.elapsed() > timeout {
                kill_group(self.pid());
                let _ = self.child.wait();
                panic!(
                    "{} did not finish within {timeout:?}; killed\n{}",
                    self.name,
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    /// Waits until its standard output contains `text`; panics with its
    /// logs and those of `others` if it exits first or `timeout` passes.
    pub fn wait_stdout(&mut self, text: &str, timeout: Duration, others: &[&Proc]) {
        let t0 = Instant::now();
        while !self.stdout_str().contains(text) {
            let why = if !self.alive() {
                format!("exited before printing {text:?}")
            } else if t0.elapsed() >= timeout {
                format!("did not print {text:?} within {timeout:?}")
            } else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let others: Vec<String> = others.iter().map(|p| p.logs()).collect();
            panic!(
                "{} {why}\n{}\n{}",
                self.name,
                self.logs(),
                others.join("\n")
            );
        }
    }

    /// Waits, then panics unless it exited with status 0.
    pub fn wait_ok(&mut self, timeout: Duration) {
        let st = self.wait(timeout);
        assert!(st.success(), "{} failed: {st}\n{}", self.name, self.logs());
    }
    /// SIGTERM to the leader, a grace period, then SIGKILL to the group.
    pub fn stop(&mut self, grace: Duration) {
        if self.alive() {
            // SAFETY: as in kill_group.
            unsafe {
                libc::kill(self.pid() as i32, libc::SIGTERM);
            }
            let t0 = Instant::now();
            while self.alive() && t0.elapsed() < grace {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        kill_group(self.pid());
        if self.done.is_none() {
            if let Ok(st) = self.child.wait() {
                self.done = Some(st);
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        kill_group(self.pid());
        if self.done.is_none() {
            let _ = self.child.wait();
        }
    }
}

/// A network namespace that is deleted when dropped.
pub struct Netns {
    pub name: String,
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Kill whatever still runs in it, then delete it.
        let _ = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
            .map(|o| {
                for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                    if let Ok(p) = pid.parse::<i32>() {
                        // SAFETY: kill has no memory-safety preconditions.
                        unsafe {
                            libc::kill(p, libc::SIGKILL);
                        }
                    }
                }
            });
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// `ip -n ns args...`, which must succeed.
pub fn ip_in(ns: &str, args: &[&str]) {
    let mut a = vec!["-n", ns];
    a.extend_from_slice(args);
    let st = Command::new("ip").args(&a).status().expect("ip");
    assert!(st.success(), "ip {a:?} failed");
}

/// `prog args...` inside network namespace `ns`, which must succeed.
pub fn exec_in(ns: &str, prog: &str, args: &[&str]) {
    let st = Command::new("ip")
        .args(["netns", "exec", ns, prog])
        .args(args)
        .status()
        .expect("ip netns exec");
    assert!(st.success(), "{prog} {args:?} in {ns} failed");
}

/// One test's world: a device dir, a temp dir, and the processes it started.
pub struct Env {
    pub name: String,
    pub dev_dir: PathBuf,
    pub tmp: PathBuf,
    /// Options for `smclo run` (e.g. `-r 16k`), before the `--`.
    pub run_opts: Vec<String>,
    /// Extra environment for every program started from now on.
    pub extra_env: Vec<(String, String)>,
    seq: u32,
}

impl Env {
    pub fn new(name: &str) -> Env {
        smclo_bin();
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{name}-{}-{n}", std::process::id());
        let dev_dir = PathBuf::from(format!("/dev/shm/smclo-apptest-{tag}"));
        let tmp = std::env::temp_dir().join(format!("smclo-apptest-{tag}"));
        let _ = fs::remove_dir_all(&dev_dir);
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).expect("create temp dir");
        // The device file exists before any program starts, so that the
        // first program does not race the test's own open.
        Device::open(&dev_dir).expect("create the test's smclo device");
        Env {
            name: name.to_string(),
            dev_dir,
            tmp,
            run_opts: Vec::new(),
            extra_env: Vec::new(),
            seq: 0,
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.tmp.join(rel)
    }

    /// A command for `prog args` in `mode`, optionally inside a netns; the
    /// device dir is set in its environment either way.
    pub fn command(&self, mode: Mode, netns: Option<&str>, prog: &str, args: &[&str]) -> Command {
        let prog_path = require(prog);
        let mut argv: Vec<String> = Vec::new();
        if let Some(ns) = netns {
            argv.extend(["ip", "netns", "exec", ns].map(String::from));
        }
        if mode == Mode::Smclo {
            argv.push(smclo_bin().display().to_string());
            argv.push("run".into());
            argv.extend(self.run_opts.iter().cloned());
            argv.push("--".into());
        }
        argv.push(prog_path.display().to_string());
        argv.extend(args.iter().map(|s| s.to_string()));
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..]);
        c.env("SMCLO_DEVICE_DIR", &self.dev_dir);
        c.env_remove("LD_PRELOAD");
        c.env_remove("SMCLO_DEBUG");
        if std::env::var_os("SMCLO_APPTEST_DEBUG").is_some() {
            c.env("SMCLO_DEBUG", "1");
        }
        c.env_remove("SMCLO_UEID");
        for (k, v) in &self.extra_env {
            c.env(k, v);
        }
        c.current_dir(&self.tmp);
        c.stdin(Stdio::null());
        c.process_group(0);
        c
    }

    /// [`Env::command`] run as `user` (`runuser`, which gives it the user's
    /// groups); the device directory and the extra environment are passed
    /// explicitly, as runuser may not keep the environment.
    pub fn command_as(&self, user: &str, mode: Mode, prog: &str, args: &[&str]) -> Command {
        let inner = self.command(mode, None, prog, args);
        let mut c = Command::new(require("runuser"));
        c.args(["-u", user, "--", "env"]);
        for (k, v) in inner.get_envs() {
            if let Some(v) = v {
                let mut kv = k.to_os_string();
                kv.push("=");
                kv.push(v);
                c.arg(kv);
            }
        }
        c.arg(inner.get_program()).args(inner.get_args());
        c.env_remove("LD_PRELOAD");
        c.current_dir(&self.tmp);
        c.stdin(Stdio::null());
        c.process_group(0);
        c
    }

    /// Starts `cmd` with stdout/stderr in files of the temp dir.
    pub fn spawn_cmd(&mut self, name: &str, mut cmd: Command) -> Proc {
        // A test run from a background job of a shell without job control
        // (`./test.sh &`, nohup) inherits SIGINT and SIGQUIT ignored, and so
        // would the programs: python then ignores the SIGINT a test stops it
        // with. They start with the defaults, as from a terminal.
        // SAFETY: signal(2) is async-signal-safe; the closure runs in the
        // child between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                libc::signal(libc::SIGQUIT, libc::SIG_DFL);
                Ok(())
            });
        }
        self.seq += 1;
        let out = self.tmp.join(format!("{}-{name}.out", self.seq));
        let err = self.tmp.join(format!("{}-{name}.err", self.seq));
        cmd.stdout(fs::File::create(&out).unwrap());
        cmd.stderr(fs::File::create(&err).unwrap());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            out,
            err,
            done: None,
        }
    }

    pub fn spawn(&mut self, mode: Mode, name: &str, prog: &str, args: &[&str]) -> Proc {
        let c = self.command(mode, None, prog, args);
        self.spawn_cmd(name, c)
    }

    /// Runs to completion (bounded), panics unless it exits 0; returns it
    /// for its output.
    pub fn run(
        &mut self,
        mode: Mode,
        name: &str,
        prog: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Proc {
        let mut p = self.spawn(mode, name, prog, args);
        p.wait_ok(timeout);
        p
    }

    /// Like [`Env::run`], with bytes on stdin.
    pub fn run_stdin(
        &mut self,
        mode: Mode,
        name: &str,
        prog: &str,
        args: &[&str],
        stdin: &[u8],
        timeout: Duration,
    ) -> Proc {
        let input = self.tmp.join(format!("{name}.stdin"));
        fs::write(&input, stdin).unwrap();
        let mut c = self.command(mode, None, prog, args);
        c.stdin(fs::File::open(&input).unwrap());
        let mut p = self.spawn_cmd(name, c);
        p.wait_ok(timeout);
        p
    }

    pub fn stats(&self) -> Stats {
        Device::open(&self.dev_dir)
            .expect("open the test's smclo device")
            .stats()
    }

    /// Creates a network namespace with a unique name (deleted on drop).
    pub fn netns(&mut self, label: &str) -> Netns {
        require("ip");
        self.seq += 1;
        let name = format!(
            "smclo-t{}-{}-{label}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("ip netns add");
        assert!(
            st.success(),
            "ip netns add {name} failed (the netns tests need root)"
        );
        Netns { name }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dev_dir);
        if std::env::var_os("SMCLO_APPTEST_KEEP").is_none() {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Gives the calling test's thread a private mount namespace, which the
/// programs it starts inherit: its mounts are seen by nobody else and vanish
/// with the thread and its programs, even if the test dies.
pub fn private_mounts() {
    assert!(is_root(), "mounting a tmpfs needs root");
    // SAFETY: unshare takes no pointers; mount gets a valid C string (the
    // root path) and nulls. Neither has memory effects on this process.
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
}

/// A tmpfs of `size` (mode 0700) mounted on `at` in the test thread's
/// private mount namespace ([`private_mounts`]), unmounted when dropped.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount_at(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("tmpfs")
            .arg(at)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs on {} failed", at.display());
        Tmpfs(at.to_path_buf())
    }

    /// A fresh tmpfs in the test's temp dir.
    pub fn mount(env: &Env, size: &str) -> Tmpfs {
        private_mounts();
        Tmpfs::mount_at(&env.path("tmpfs"), size)
    }

    /// Fills the filesystem until the kernel says ENOSPC.
    pub fn fill(&self) {
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

/// Runs `ip args`, panicking on failure.
pub fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        o.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Joins two namespaces with a veth pair: `a` gets `addr_a`/30, `b` gets
/// `addr_b`/30. Interface names are derived from a unique id (<= 15 chars).
pub fn veth(a: &Netns, b: &Netns, addr_a: &str, addr_b: &str) {
    let id = SEQ.fetch_add(1, Ordering::SeqCst);
    let ia = format!("svA{}x{id}", std::process::id() % 100000);
    let ib = format!("svB{}x{id}", std::process::id() % 100000);
    ip(&[
        "link", "add", &ia, "netns", &a.name, "type", "veth", "peer", "name", &ib, "netns", &b.name,
    ]);
    ip(&[
        "-n",
        &a.name,
        "addr",
        "add",
        &format!("{addr_a}/30"),
        "dev",
        &ia,
    ]);
    ip(&[
        "-n",
        &b.name,
        "addr",
        "add",
        &format!("{addr_b}/30"),
        "dev",
        &ib,
    ]);
    for (ns, i) in [(&a.name, &ia), (&b.name, &ib)] {
        ip(&["-n", ns, "link", "set", i, "up"]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
    }
}

/// True if a socket listens on `port` in the network namespace of `pid`
/// (or of this process), asked of the kernel ([`sockdiag`]); asking instead
/// of connecting keeps probe connections out of the counters.
pub fn listening(port: u16, pid: Option<u32>) -> bool {
    let ports = match pid {
        Some(p) => sockdiag::listening_ports_of(p),
        None => sockdiag::listening_ports(),
    };
    ports.is_ok_and(|v| v.contains(&port))
}

/// Waits until `proc` listens on `port` (in its own netns); panics with its
/// logs if it dies or takes longer than 10 s.
pub fn wait_listen(p: &mut Proc, port: u16) {
    let t0 = Instant::now();
    while !listening(port, Some(p.pid())) {
        assert!(
            p.alive(),
            "{} exited before listening on {port}\n{}",
            p.name,
            p.logs()
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{} not listening on {port} after 10 s\n{}",
            p.name,
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Human-readable non-zero fallback counters.
pub fn fallbacks_desc(s: &Stats) -> String {
    describe_fallbacks(&s.fallback_client, &s.fallback_server)
}

/// Non-zero per-reason counters (client side, server side), readable.
fn describe_fallbacks(client: &[u64], server: &[u64]) -> String {
    let mut v = Vec::new();
    for r in Reason::ALL {
        let (c, sv) = (client[r.index()], server[r.index()]);
        if c + sv > 0 {
            v.push(format!("{r:?}: client {c}, server {sv}"));
        }
    }
    if v.is_empty() {
        "none".into()
    } else {
        v.join("; ")
    }
}

/// Counters moved between two snapshots.
#[derive(Debug, Clone)]
pub struct Delta {
    pub conns_opened: u64,
    pub dmbs_registered: u64,
    pub xfer_bytes: u64,
    pub fallback_client: Vec<u64>,
    pub fallback_server: Vec<u64>,
}

pub fn delta(before: &Stats, after: &Stats) -> Delta {
    Delta {
        conns_opened: after.conns_opened - before.conns_opened,
        dmbs_registered: after.dmbs_registered - before.dmbs_registered,
        xfer_bytes: after.xfer_bytes - before.xfer_bytes,
        fallback_client: (0..Reason::COUNT)
            .map(|i| after.fallback_client[i] - before.fallback_client[i])
            .collect(),
        fallback_server: (0..Reason::COUNT)
            .map(|i| after.fallback_server[i] - before.fallback_server[i])
            .collect(),
    }
}

impl Delta {
    pub fn fallbacks(&self) -> u64 {
        self.fallback_client.iter().sum::<u64>() + self.fallback_server.iter().sum::<u64>()
    }
    pub fn fallbacks_desc(&self) -> String {
        describe_fallbacks(&self.fallback_client, &self.fallback_server)
    }
    /// Fallbacks for reason `r`: (client, server).
    pub fn fallback(&self, r: Reason) -> (u64, u64) {
        (
            self.fallback_client[r.index()],
            self.fallback_server[r.index()],
        )
    }
}

/// Asserts that traffic went through shared memory: at least `min_conns`
/// SMC-D connections, xfer_bytes within `[lo, hi]`, and no fallback at all.
pub fn assert_smc(what: &str, d: &Delta, min_conns: u64, lo: u64, hi: u64, logs: &str) {
    eprintln!(
        "{what}: {} SMC-D connections, xfer_bytes {} (want [{lo}, {hi}]), fallbacks: {}",
        d.conns_opened,
        d.xfer_bytes,
        d.fallbacks_desc()
    );
    assert!(
        d.fallbacks() == 0,
        "{what}: fallbacks to TCP: {} (counters {d:?})\n{logs}",
        d.fallbacks_desc()
    );
    assert!(
        d.conns_opened >= min_conns,
        "{what}: only {} SMC-D connections, want >= {min_conns} (counters {d:?})\n{logs}",
        d.conns_opened
    );
    assert!(
        d.xfer_bytes >= lo && d.xfer_bytes <= hi,
        "{what}: xfer_bytes {} outside [{lo}, {hi}] (counters {d:?})\n{logs}",
        d.xfer_bytes
    );
}

/// Asserts that nothing went through shared memory, and that the smclo side
/// counted exactly `conns` PEERNOSMC fallbacks on `side` ("client" or
/// "server") and nothing else.
pub fn assert_plain(what: &str, d: &Delta, conns: u64, side: &str, logs: &str) {
    eprintln!(
        "{what}: {} SMC-D connections, xfer_bytes {}, fallbacks: {}",
        d.conns_opened,
        d.xfer_bytes,
        d.fallbacks_desc()
    );
    assert_eq!(
        d.conns_opened, 0,
        "{what}: SMC-D connections with a plain peer (counters {d:?})\n{logs}"
    );
    assert_eq!(
        d.xfer_bytes, 0,
        "{what}: bytes over SMC-D with a plain peer (counters {d:?})\n{logs}"
    );
    let i = Reason::PeerNoSmc.index();
    let (mine, other) = if side == "client" {
        (&d.fallback_client, &d.fallback_server)
    } else {
        (&d.fallback_server, &d.fallback_client)
    };
    assert_eq!(
        mine[i],
        conns,
        "{what}: want {conns} {side} PEERNOSMC fallbacks: {}\n{logs}",
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallbacks(),
        conns,
        "{what}: unexpected fallbacks: {} ({other:?})\n{logs}",
        d.fallbacks_desc()
    );
}

/// A document root for web servers: `small.txt` with `small`, and
/// `big.bin`, 1 MiB of `pseudo_random` bytes from `seed` (returned).
pub fn web_root(env: &Env, small: &[u8], seed: u64) -> (PathBuf, Vec<u8>) {
    let root = env.path("www");
    fs::create_dir_all(&root).unwrap();
    let big = pseudo_random(1 << 20, seed);
    fs::write(root.join("small.txt"), small).unwrap();
    fs::write(root.join("big.bin"), &big).unwrap();
    (root, big)
}

/// Deterministic pseudo-random bytes (xorshift), for bodies to checksum.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// The value of the python expression `expr` over `d`, iperf3's JSON
/// output `json` (parsed by python3), as a number.
pub fn iperf3_json(env: &Env, json: &str, expr: &str) -> f64 {
    let f = env.path("iperf3.json");
    fs::write(&f, json).unwrap();
    let o = Command::new(require("python3"))
        .args([
            "-c",
            &format!("import json,sys; d=json.load(open(sys.argv[1])); print({expr})"),
            f.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| {
            panic!(
                "no {expr} in iperf3's output: {}\n{json}",
                String::from_utf8_lossy(&o.stderr)
            )
        })
}

/// Lowercase hex SHA-256 of a file, via coreutils' sha256sum.
pub fn sha256_file(p: &Path) -> String {
    let o = Command::new("sha256sum")
        .arg(p)
        .output()
        .expect("sha256sum");
    assert!(o.status.success(), "sha256sum {} failed", p.display());
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

/// Lowercase hex SHA-256 of bytes (written to a temp file first).
pub fn sha256_bytes(env: &Env, name: &str, b: &[u8]) -> String {
    let p = env.path(&format!("{name}.sha-input"));
    fs::write(&p, b).unwrap();
    sha256_file(&p)
}

/// A plain HTTP/1.0 GET over std TcpStream (used for control probes only).
pub fn http_get_plain(addr: &str, path: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut v = Vec::new();
    s.read_to_end(&mut v).unwrap();
    v
}

/// `user root;` when running as root (nginx's default user may not exist).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// nginx under `smclo run` on 127.0.0.1 at a free port, serving `root`
/// (configuration and logs tagged "a"); returns it and its port.
pub fn start_local_nginx(env: &mut Env, root: &Path) -> (Proc, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    (
        start_nginx(env, Mode::Smclo, None, &listen, root, "a"),
        port,
    )
}

/// Writes an nginx config (master + 2 workers, sendfile, keepalive, `daemon
/// off`, every path in the temp dir) serving `root` on `listen`, and starts
/// nginx in `mode`, optionally inside `netns`. Access log lines are
/// `$request_length $bytes_sent $status $request`, so tests can add up the
/// bytes nginx moved.
pub fn start_nginx(
    env: &mut Env,
    mode: Mode,
    netns: Option<&str>,
    listen: &str,
    root: &Path,
    tag: &str,
) -> Proc {
    let port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();
    let servers = format!(
        "server {{\n    listen {listen};\n    root {};\n  }}",
        root.display()
    );
    start_nginx_servers(env, mode, netns, &servers, port, tag)
}

/// [`start_nginx`] with the given `server { }` blocks; waits for `port`.
pub fn start_nginx_servers(
    env: &mut Env,
    mode: Mode,
    netns: Option<&str>,
    servers: &str,
    port: u16,
    tag: &str,
) -> Proc {
    let dir = env.path(&format!("nginx-{tag}"));
    fs::create_dir_all(dir.join("body")).unwrap();
    fs::create_dir_all(dir.join("proxy")).unwrap();
    let user = if is_root() { "user root;\n" } else { "" };
    let conf = format!(
        "{user}worker_processes 2;\ndaemon off;\nmaster_process on;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
         events {{ worker_connections 512; }}\n\
         http {{\n  log_format counts '$request_length $bytes_sent $status \"$request\"';\n  access_log {d}/access.log counts;\n\
           client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           sendfile on;\n  tcp_nopush on;\n  keepalive_timeout 30s;\n  keepalive_requests 1000000;\n\
           types {{ text/plain txt; application/octet-stream bin; }}\n  default_type application/octet-stream;\n\
           {servers}\n}}\n",
        d = dir.display(),
    );
    let cf = dir.join("nginx.conf");
    fs::write(&cf, conf).unwrap();
    let (c, p, e) = (
        cf.display().to_string(),
        dir.display().to_string(),
        dir.join("error.log").display().to_string(),
    );
    let cmd = env.command(mode, netns, "nginx", &["-c", &c, "-p", &p, "-e", &e]);
    let mut proc_ = env.spawn_cmd(&format!("nginx-{tag}"), cmd);
    wait_listen(&mut proc_, port);
    // master + 2 workers
    let t0 = Instant::now();
    loop {
        let kids = fs::read_to_string(format!("/proc/{0}/task/{0}/children", proc_.pid()))
            .unwrap_or_default();
        if kids.split_whitespace().count() >= 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "nginx did not start 2 workers\n{}",
            proc_.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    proc_
}

/// Sum of `$request_length + $bytes_sent` and the number of lines of an
/// nginx access log written by [`start_nginx`].
pub fn nginx_log_bytes(env: &Env, tag: &str) -> (u64, u64, Vec<String>) {
    let log = fs::read_to_string(env.path(&format!("nginx-{tag}/access.log"))).unwrap_or_default();
    let mut sum = 0;
    let mut n = 0;
    let mut lines = Vec::new();
    for l in log.lines() {
        let mut it = l.split_whitespace();
        let a: u64 = it.next().unwrap().parse().unwrap();
        let b: u64 = it.next().unwrap().parse().unwrap();
        sum += a + b;
        n += 1;
        lines.push(l.to_string());
    }
    (sum, n, lines)
}

/// Runs curl in `mode` (optionally in `netns`) fetching `urls` over one
/// keep-alive connection into files; returns the bodies and the bytes curl
/// sent plus received (`size_request + size_header + size_download`).
pub fn curl(
    env: &mut Env,
    mode: Mode,
    netns: Option<&str>,
    name: &str,
    urls: &[String],
) -> (Vec<Vec<u8>>, u64) {
    let mut args: Vec<String> = vec![
        "-sS".into(),
        "--fail".into(),
        "--http1.1".into(),
        "--max-time".into(),
        "30".into(),
    ];
    args.push("-w".into());
    args.push("%{size_request} %{size_header} %{size_download}\\n".into());
    let mut outs = Vec::new();
    for (i, u) in urls.iter().enumerate() {
        let o = env.path(&format!("{name}-body{i}"));
        args.push("-o".into());
        args.push(o.display().to_string());
        args.push(u.clone());
        outs.push(o);
    }
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let cmd = env.command(mode, netns, "curl", &a);
    let mut p = env.spawn_cmd(name, cmd);
    p.wait_ok(Duration::from_secs(60));
    let mut bytes = 0;
    for l in p.stdout_str().lines() {
        bytes += l
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap())
            .sum::<u64>();
    }
    (outs.iter().map(|o| fs::read(o).unwrap()).collect(), bytes)
}

/// After wrk (`w`, over `conns` connections) against nginx [`start_nginx`]
/// tagged "a", started after `s0`: nginx logged every request wrk
/// completed, and the device moved exactly the bytes nginx logged, over
/// SMC-D. nginx logs a request once it has sent the response; wrk stops
/// with up to one request in flight per connection, which may have been
/// read (and answered) but not counted by wrk, or be in the ring unread.
pub fn assert_nginx_served(env: &Env, s0: &Stats, w: &Wrk, conns: u64, logs: &str) {
    let (logged, n, _) = nginx_log_bytes(env, "a");
    assert!(
        n >= w.reqs && n <= w.reqs + conns,
        "nginx logged {n} requests, wrk completed {}",
        w.reqs
    );
    let per = logged / n.max(1);
    let d = delta(s0, &env.stats());
    let what = format!("nginx + wrk over {conns} connections");
    let (lo, hi) = wrk_slack(logged, conns, per);
    assert_smc(&what, &d, conns, lo, hi, logs);
}

/// The bytes the device may count for nginx's `logged` bytes served to wrk
/// over `conns` connections, `per` bytes a request and its response: up
/// to one request and response more per connection (in flight when wrk
/// stopped, which nginx never logged), or one response less (written to a
/// connection wrk had just closed: the write succeeds, as TCP's that the
/// peer resets, and nginx logs bytes that go nowhere).
pub fn wrk_slack(logged: u64, conns: u64, per: u64) -> (u64, u64) {
    (logged.saturating_sub(conns * per), logged + conns * per)
}

/// A wrk Lua script that checks every response body against `body_len`
/// bytes and status 200, and prints `checked=<n> bad=<n>` at the end.
pub fn wrk_check_script(env: &Env, name: &str, body_len: usize) -> PathBuf {
    let p = env.path(&format!("{name}.lua"));
    fs::write(
        &p,
        format!(
            r#"local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) checked = 0; bad = 0 end
function response(status, headers, body)
  checked = checked + 1
  if status ~= 200 or #body ~= {body_len} then bad = bad + 1 end
end
function done(summary, latency, requests)
  local c, b = 0, 0
  for _, t in ipairs(threads) do c = c + t:get("checked"); b = b + t:get("bad") end
  io.write(string.format("checked=%d bad=%d\n", c, b))
end
"#
        ),
    )
    .unwrap();
    p
}

/// What a wrk run with a [`wrk_check_script`] printed.
pub struct Wrk {
    /// Requests completed.
    pub reqs: u64,
    /// Responses the script checked, and those with a wrong status or
    /// body length.
    pub checked: u64,
    pub bad: u64,
    /// wrk's "Socket errors" or "Non-2xx" line, if any.
    pub errs: Option<String>,
    /// Its standard output, and its logs (stdout and stderr) as
    /// [`Proc::logs`] shows them.
    pub out: String,
    pub logs: String,
}

impl Wrk {
    /// Parses the output of the finished wrk `p`.
    pub fn parse(p: &Proc) -> Wrk {
        let out = p.stdout_str();
        let reqs = out
            .lines()
            .find(|l| l.contains(" requests in "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no request count in wrk output:\n{out}"));
        let kv = |k: &str| -> u64 {
            out.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k}= in wrk output:\n{out}"))
        };
        let (checked, bad) = (kv("checked"), kv("bad"));
        let errs = out
            .lines()
            .find(|l| l.contains("Socket errors") || l.contains("Non-2xx"))
            .map(|s| s.to_string());
        Wrk {
            reqs,
            checked,
            bad,
            errs,
            out,
            logs: p.logs(),
        }
    }

    /// Every response was checked and right.
    pub fn assert_all_right(&self, what: &str) {
        assert_eq!(
            (self.bad, self.checked),
            (0, self.reqs),
            "{what}: responses with a wrong status or body length\n{}",
            self.out
        );
    }

    /// No socket error, more than `min` requests, every response right.
    /// `logs`: what to show when it fails (the programs' logs).
    pub fn assert_clean(&self, what: &str, min: u64, logs: &str) {
        assert!(
            self.errs.is_none(),
            "{what}: wrk: {:?}\n{}\n{logs}",
            self.errs,
            self.logs
        );
        assert!(
            self.reqs > min,
            "{what}: only {} requests\n{}",
            self.reqs,
            self.out
        );
        self.assert_all_right(what);
    }
}

/// Runs wrk in `mode` (optionally in `netns`) with `args` and the check
/// `script` against `url`, and waits for it.
pub fn wrk(
    env: &mut Env,
    mode: Mode,
    netns: Option<&str>,
    name: &str,
    args: &[&str],
    script: &Path,
    url: &str,
) -> (Proc, Wrk) {
    let mut p = spawn_wrk(env, mode, netns, name, args, script, url);
    p.wait_ok(Duration::from_secs(60));
    let w = Wrk::parse(&p);
    (p, w)
}

/// [`wrk`] without waiting.
pub fn spawn_wrk(
    env: &mut Env,
    mode: Mode,
    netns: Option<&str>,
    name: &str,
    args: &[&str],
    script: &Path,
    url: &str,
) -> Proc {
    let mut a = args.to_vec();
    a.extend(["-s", script.to_str().unwrap(), url]);
    let cmd = env.command(mode, netns, "wrk", &a);
    env.spawn_cmd(name, cmd)
}

/// After every program of the test has exited: no DMB, connection or
/// listener left in the device, and no file but `device` in its directory.
/// `orderly`: the programs exited through exit() (not a fatal signal), so
/// their ends must already be released without the device's sweep of dead
/// owners; otherwise the sweep (which the next smclo process would run) must
/// reclaim everything.
pub fn assert_clean(env: &Env, orderly: bool) {
    let dev = Device::open(&env.dev_dir).expect("open device");
    let check = |when: &str| {
        let s = dev.stats();
        let files: Vec<String> = fs::read_dir(&env.dev_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            // The device and the pid namespaces' membership locks stay.
            .filter(|n| n != "device" && !n.starts_with("pidns-"))
            .collect();
        eprintln!(
            "{} {when}: dmbs_cnt {}, conns_active {}, listeners {}, files {files:?}",
            env.name, s.dmbs_cnt, s.conns_active, s.listeners
        );
        (s.dmbs_cnt, s.conns_active, s.listeners, files)
    };
    if orderly {
        let (d, c, l, f) = check("after orderly exit");
        assert!(
            d == 0 && c == 0 && l == 0 && f.is_empty(),
            "{}: left behind after every program exited normally: {d} DMBs, {c} active connections, {l} listeners, files {f:?}",
            env.name
        );
    }
    dev.sweep();
    let (d, c, l, f) = check("after sweep");
    assert!(
        d == 0 && c == 0 && l == 0 && f.is_empty(),
        "{}: left behind after the sweep of dead owners: {d} DMBs, {c} active connections, {l} listeners, files {f:?}",
        env.name
    );
}

/// The numbers of the `ok N M ...` line a checked test program prints when
/// every check passed; panics with its output and `logs` otherwise.
pub fn ok_numbers(p: &Proc, logs: &str) -> Vec<u64> {
    let out = p.stdout_str();
    let f: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(
        f.first(),
        Some(&"ok"),
        "{}: {out}\n{}\n{logs}",
        p.name,
        p.logs()
    );
    f[1..]
        .iter()
        .map(|n| {
            n.parse()
                .unwrap_or_else(|e| panic!("{}: {n:?} in {out:?}: {e}", p.name))
        })
        .collect()
}

/// tests/py/asyncio_echo.py: an asyncio echo server and a client that
/// checks every answer.
fn asyncio_echo_script() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/asyncio_echo.py");
    p.display().to_string()
}

/// The asyncio echo server (`name`) under `smclo run` on 127.0.0.1:`port`;
/// waits until it listens.
pub fn start_asyncio_echo(env: &mut Env, name: &str, port: u16) -> Proc {
    let (script, ps) = (asyncio_echo_script(), port.to_string());
    let mut server = env.spawn(Mode::Smclo, name, "python3", &[&script, "server", &ps]);
    wait_listen(&mut server, port);
    server
}

/// The asyncio echo client (`name`) under `smclo run`: `conns` connections
/// at once to `port`, `rounds` frames each (their sizes from `seed`),
/// every answer checked; the bytes it sent and received. `others`: the
/// logs to show if it fails.
pub fn asyncio_echo_client(
    env: &mut Env,
    name: &str,
    port: u16,
    (conns, rounds, seed): (u64, u64, u64),
    others: &[&Proc],
) -> (u64, u64) {
    let script = asyncio_echo_script();
    let [c, r, s] = [conns, rounds, seed].map(|n| n.to_string());
    let args = [&script[..], "client", &port.to_string(), &c, &r, &s];
    let client = env.run(
        Mode::Smclo,
        name,
        "python3",
        &args,
        Duration::from_secs(120),
    );
    let logs: Vec<String> = others.iter().map(|p| p.logs()).collect();
    let [sent, received] = ok_numbers(&client, &logs.join("\n"))[..] else {
        panic!("asyncio_echo.py printed no byte counts")
    };
    (sent, received)
}

/// Compiles the C program `src` into the test's temp dir with
/// [`smclo_testsupport::CFLAGS`] and `flags`; returns the executable.
pub fn compile_c(env: &Env, src: &Path, flags: &[&str]) -> PathBuf {
    let exe = env.path(src.file_stem().and_then(|s| s.to_str()).unwrap_or("prog"));
    smclo_testsupport::compile_c(src, &exe, flags)
}

/// The newest PostgreSQL's `bin` directory (`/usr/lib/postgresql/*/bin`).
pub fn postgres_bindir() -> PathBuf {
    let mut v: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .unwrap_or_else(|_| panic!("PostgreSQL is missing: install the Debian package postgresql"))
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("postgres").is_file())
        .collect();
    v.sort();
    v.pop().expect("no /usr/lib/postgresql/*/bin/postgres")
}

/// The arguments of a test's postgres server: data directory `data`, TCP
/// on 127.0.0.1:`port`, its UNIX socket in `sockdir`, no fsync.
pub fn postgres_server_args(data: &Path, port: u16, sockdir: &Path) -> Vec<String> {
    let (d, p, k) = (data.display(), port, sockdir.display());
    format!(
        "-D {d} -p {p} -k {k} -c listen_addresses=127.0.0.1 -c fsync=off -c shared_buffers=32MB"
    )
    .split(' ')
    .map(String::from)
    .collect()
}
