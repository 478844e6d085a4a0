//! A device shared by a group of users (`smclo dev init --group`): services
//! of different users, members of the group, use shared memory with each
//! other; a user outside the group cannot open the device and its
//! connections stay plain TCP; server workers that switch to a user the
//! device does not admit fall back with UID_CHANGED.
//!
//! Every test creates its own group and users (unique names) and deletes
//! them when it ends, even when it fails.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs a user administration command; the account files' lock may be held
/// by a concurrent one for a moment, so it is retried for a while.
fn admin(prog: &str, args: &[&str]) {
    let t0 = Instant::now();
    loop {
        let o = Command::new(require(prog))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{prog}: {e}"));
        if o.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("lock") && t0.elapsed() < Duration::from_secs(20),
            "{prog} {args:?}: {err}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A group and users made for one test, deleted when dropped.
struct Accounts {
    group: String,
    users: Vec<String>,
    /// Existing users added to the group (removed from it on drop).
    joined: Vec<String>,
}

impl Accounts {
    fn new() -> Accounts {
        assert!(is_root(), "creating users and groups needs root");
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let group = format!("smclo-g{}-{n}", std::process::id());
        admin("groupadd", &[&group]);
        Accounts {
            group,
            users: Vec::new(),
            joined: Vec::new(),
        }
    }

    /// A new user: a member of the group through its primary group
    /// (`Member::Primary`), through a supplementary one, or not at all.
    fn user(&mut self, label: &str, m: Member) -> String {
        let name = format!("{}-{label}", self.group.replacen("smclo-g", "smclo-u", 1));
        let mut args = vec!["-M", "-N", "-s", "/usr/sbin/nologin"];
        match m {
            Member::Primary => args.extend(["-g", &self.group]),
            Member::Supplementary => args.extend(["-g", "nogroup", "-G", &self.group]),
            Member::No => args.extend(["-g", "nogroup"]),
        }
        args.push(&name);
        admin("useradd", &args);
        self.users.push(name.clone());
        name
    }

    /// Adds the existing user `user` to the group.
    fn join(&mut self, user: &str) {
        admin("usermod", &["-aG", &self.group, user]);
        self.joined.push(user.to_string());
    }
}

impl Drop for Accounts {
    fn drop(&mut self) {
        for u in &self.users {
            let _ = Command::new("userdel").arg(u).status();
        }
        for u in &self.joined {
            let _ = Command::new("gpasswd")
                .args(["-d", u, &self.group])
                .output();
        }
        let _ = Command::new("groupdel").arg(&self.group).status();
    }
}

#[derive(Clone, Copy)]
enum Member {
    Primary,
    Supplementary,
    No,
}

/// Replaces the test's private device directory by a group device of
/// `group`, made by `smclo dev init --group`, and checks its shape.
fn group_device(env: &Env, group: &str) {
    fs::remove_dir_all(&env.dev_dir).unwrap();
    let o = Command::new(smclo_bin())
        .args(["dev", "init", "--group", group])
        .arg(&env.dev_dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "smclo dev init: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    use std::os::unix::fs::MetadataExt;
    let d = fs::metadata(&env.dev_dir).unwrap();
    assert_eq!(d.mode() & 0o7777, 0o2770, "directory mode");
    let f = fs::metadata(env.dev_dir.join("device")).unwrap();
    assert_eq!(f.mode() & 0o777, 0o660, "device file mode");
    assert_eq!(f.gid(), d.gid(), "device file group");
    let o = Command::new(smclo_bin())
        .args(["dev", "-v"])
        .env("SMCLO_DEVICE_DIR", &env.dev_dir)
        .output()
        .unwrap();
    let v = String::from_utf8_lossy(&o.stdout);
    assert!(
        v.contains(&format!("the members of gid {}", d.gid())),
        "smclo dev -v:\n{v}"
    );
}

/// The temp dir readable by the test's users (programs' files live there).
fn open_tmp(env: &Env) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&env.tmp, fs::Permissions::from_mode(0o755)).unwrap();
}

/// An nginx config serving `root` on `port`, its workers running as `user`.
fn nginx_conf(env: &Env, user: &str, port: u16, root: &Path) -> PathBuf {
    let d = env.path("nginx");
    fs::create_dir_all(d.join("body")).unwrap();
    let conf = format!(
        "user {user};\nworker_processes 2;\ndaemon off;\nmaster_process on;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log info;\nevents {{ worker_connections 512; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  sendfile on;\n\
           keepalive_timeout 30s;\n  default_type application/octet-stream;\n\
           server {{\n    listen 127.0.0.1:{port};\n    root {r};\n  }}\n}}\n",
        d = d.display(),
        r = root.display()
    );
    let cf = d.join("nginx.conf");
    fs::write(&cf, conf).unwrap();
    cf
}

/// Starts nginx as root under `smclo run` (workers as `user`) and waits
/// for its port.
fn start_nginx_as(env: &mut Env, user: &str, port: u16, root: &Path) -> Proc {
    let cf = nginx_conf(env, user, port, root);
    let d = cf.parent().unwrap().display().to_string();
    let e = format!("{d}/error.log");
    let cmd = env.command(
        Mode::Smclo,
        None,
        "nginx",
        &["-c", cf.to_str().unwrap(), "-p", &d, "-e", &e],
    );
    let mut p = env.spawn_cmd("nginx", cmd);
    wait_listen(&mut p, port);
    p
}

/// `curl` run as `user` under `smclo run`, fetching `url` `times` times
/// over one connection; returns what it wrote to stdout.
fn curl_as(env: &mut Env, user: &str, url: &str, times: usize) -> (Vec<u8>, Proc) {
    let mut args = vec!["-sS", "--fail", "--http1.1", "--max-time", "30"];
    args.extend(std::iter::repeat_n(url, times));
    let c = env.command_as(user, Mode::Smclo, "curl", &args);
    let mut p = env.spawn_cmd("curl", c);
    p.wait_ok(T);
    (p.stdout(), p)
}

#[test]
fn nginx_workers_and_client_of_two_group_members() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let cli = acc.user("cli", Member::Supplementary);
    let mut env = Env::new("group-nginx");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let (root, big) = web_root(&env, b"small\n", 7);
    let port = free_port();
    let mut nginx = start_nginx_as(&mut env, &format!("{web} {}", acc.group), port, &root);
    let before = env.stats();
    let url = format!("http://127.0.0.1:{port}/big.bin");
    let (body, curl) = curl_as(&mut env, &cli, &url, 3);
    let after = env.stats();
    assert!(
        body.len() == 3 * big.len() && body.chunks(big.len()).all(|c| c == big),
        "curl got {} bytes, not 3 copies of the file\n{}",
        body.len(),
        curl.stderr_str()
    );
    let d = delta(&before, &after);
    // (curl's stdout is the binary file.)
    let logs = format!("{}\n{}", nginx.logs(), curl.stderr_str());
    assert_smc(
        "nginx (workers as one member) and curl (another member)",
        &d,
        1,
        3 * big.len() as u64,
        4 * big.len() as u64,
        &logs,
    );
    nginx.stop(Duration::from_secs(10));
    drop(acc);
}

#[test]
fn outsider_gets_eacces_and_falls_back() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let out = acc.user("out", Member::No);
    let mut env = Env::new("group-outsider");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let (root, _) = web_root(&env, b"for members only\n", 3);
    let port = free_port();
    let mut nginx = start_nginx_as(&mut env, &format!("{web} {}", acc.group), port, &root);
    let before = env.stats();
    // The device file is out of reach: EACCES, from the kernel.
    let dev = env.dev_dir.join("device");
    let probe = format!(
        "import os\ntry:\n    os.open({:?}, os.O_RDONLY)\n    print('opened')\nexcept OSError as e:\n    print(e.errno)\n",
        dev.display()
    );
    let c = env.command_as(&out, Mode::Plain, "python3", &["-c", &probe]);
    let mut p = env.spawn_cmd("open-device", c);
    p.wait_ok(T);
    assert_eq!(p.stdout_str().trim(), libc::EACCES.to_string(), "open");
    // smclo says why it cannot use the device.
    let o = Command::new(require("runuser"))
        .args(["-u", &out, "--", "env"])
        .arg(format!("SMCLO_DEVICE_DIR={}", env.dev_dir.display()))
        .arg(smclo_bin())
        .arg("stats")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("is not a member of that group"),
        "smclo stats as an outsider: {err}"
    );
    // Its connections stay plain TCP and still work; it registered no
    // listener, and the member's side counts no proposal.
    env.extra_env
        .push(("SMCLO_DEBUG".to_string(), "1".to_string()));
    let url = format!("http://127.0.0.1:{port}/small.txt");
    let (body, curl) = curl_as(&mut env, &out, &url, 2);
    assert_eq!(body, b"for members only\nfor members only\n".to_vec());
    let err = fs::read_to_string(&curl.err).unwrap();
    assert!(
        err.contains("unusable") && err.contains("not a member"),
        "the outsider's debug log says why:\n{err}"
    );
    let after = env.stats();
    let d = delta(&before, &after);
    assert_eq!(d.conns_opened, 0, "{}", d.fallbacks_desc());
    assert_eq!(after.listeners, before.listeners);
    assert_eq!(
        after.fallback(Reason::PeerNoSmc).1 - before.fallback(Reason::PeerNoSmc).1,
        1,
        "the member's side: no proposal from the outsider ({})",
        d.fallbacks_desc()
    );
    // A server of the outsider registers no listener: a member's
    // connection to it finds none (PEERNOSMC on the member's side).
    let oport = free_port();
    let op = oport.to_string();
    let c = env.command_as(
        &out,
        Mode::Smclo,
        "python3",
        &[
            "-m",
            "http.server",
            &op,
            "--bind",
            "127.0.0.1",
            "--directory",
            root.to_str().unwrap(),
        ],
    );
    let mut server = env.spawn_cmd("outsider-server", c);
    wait_listen(&mut server, oport);
    let before = env.stats();
    let url = format!("http://127.0.0.1:{oport}/small.txt");
    let (body, curl) = curl_as(&mut env, &web, &url, 1);
    assert_eq!(body, b"for members only\n".to_vec(), "{}", curl.logs());
    let after = env.stats();
    assert_eq!(after.listeners, before.listeners, "the outsider's listener");
    let d = delta(&before, &after);
    assert_eq!(
        (d.conns_opened, d.fallbacks()),
        (0, 1),
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(
        after.fallback(Reason::PeerNoSmc).0 - before.fallback(Reason::PeerNoSmc).0,
        1,
        "the member's side: no listener of the outsider ({})",
        d.fallbacks_desc()
    );
    server.stop(Duration::from_secs(5));
    nginx.stop(Duration::from_secs(10));
}

#[test]
fn postgres_and_pgbench_of_two_group_members() {
    const PG: &str = "postgres";
    let mut acc = Accounts::new();
    acc.join(PG);
    let app = acc.user("app", Member::Supplementary);
    let mut env = Env::new("group-postgres");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let home = env.path("pg");
    fs::create_dir_all(&home).unwrap();
    let st = Command::new("chown")
        .args([PG, home.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success(), "chown {}", home.display());
    let bin = postgres_bindir();
    let data = home.join("data");
    let d = data.to_str().unwrap();
    let c = env.command_as(
        PG,
        Mode::Plain,
        bin.join("initdb").to_str().unwrap(),
        &["-D", d, "-A", "trust", "-U", PG],
    );
    env.spawn_cmd("initdb", c).wait_ok(Duration::from_secs(120));
    let port = free_port();
    let ps = port.to_string();
    let server_args = postgres_server_args(&data, port, &home);
    let server_args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let c = env.command_as(
        PG,
        Mode::Smclo,
        bin.join("postgres").to_str().unwrap(),
        &server_args,
    );
    let mut server = env.spawn_cmd("postgres", c);
    wait_listen(&mut server, port);
    let pg_args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["-h", "127.0.0.1", "-p", &ps, "-U", PG]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run_as_app = |env: &mut Env, mode: Mode, name: &str, prog: &str, extra: &[&str]| {
        let a = pg_args(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let c = env.command_as(&app, mode, prog, &a);
        let mut p = env.spawn_cmd(name, c);
        p.wait_ok(Duration::from_secs(120));
        p
    };
    run_as_app(
        &mut env,
        Mode::Plain,
        "pgbench-init",
        "pgbench",
        &["-i", "-s", "1", PG],
    );
    let before = env.stats();
    let bench = run_as_app(
        &mut env,
        Mode::Smclo,
        "pgbench",
        "pgbench",
        &["-S", "-c", "4", "-j", "2", "-T", "3", PG],
    );
    let out = bench.stdout_str();
    assert!(
        out.contains("number of failed transactions: 0")
            && out.contains("number of transactions actually processed"),
        "pgbench:\n{}",
        bench.logs()
    );
    let q = "SELECT count(*) || ' ' || md5(string_agg(aid::text || filler || abalance::text, ',' ORDER BY aid)) FROM pgbench_accounts";
    let smc = run_as_app(&mut env, Mode::Smclo, "psql", "psql", &["-At", "-c", q, PG]);
    let after = env.stats();
    let plain = run_as_app(
        &mut env,
        Mode::Plain,
        "psql-plain",
        "psql",
        &["-At", "-c", q, PG],
    );
    let (smc, plain) = (smc.stdout_str(), plain.stdout_str());
    assert!(smc.starts_with("100000 "), "psql over SMC-D: {smc:?}");
    assert_eq!(smc, plain, "the table read over SMC-D differs from TCP's");
    // pgbench's 4 clients and psql; psql's reply alone is the table's text.
    let d = delta(&before, &after);
    assert_smc(
        "postgres (user postgres) and pgbench, psql (another member)",
        &d,
        5,
        10_000,
        u64::MAX,
        &format!("{}\n--- pgbench:\n{}", server.logs(), bench.logs()),
    );
    server.stop(Duration::from_secs(10));
}

/// nginx started as root on root's private device, its workers switching
/// to a user that may not use it: every connection falls back, and the
/// counters and the client's debug log say that the uid changed.
#[test]
fn workers_that_change_to_an_outsider_fall_back_with_uid_changed() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::No);
    let mut env = Env::new("group-uid-change");
    open_tmp(&env);
    let (root, _) = web_root(&env, b"served by an unprivileged worker\n", 5);
    let port = free_port();
    let mut nginx = start_nginx_as(&mut env, &format!("{web} nogroup"), port, &root);
    let before = env.stats();
    env.extra_env
        .push(("SMCLO_DEBUG".to_string(), "1".to_string()));
    let url = format!("http://127.0.0.1:{port}/small.txt");
    let (body, curl) = curl_as(&mut env, "root", &url, 1);
    assert_eq!(body, b"served by an unprivileged worker\n".to_vec());
    let after = env.stats();
    let d = delta(&before, &after);
    eprintln!("fallbacks: {}", d.fallbacks_desc());
    let changed = |s: &smclo::device::Stats| s.fallback(Reason::UidChanged);
    assert_eq!(
        (
            changed(&after).0 - changed(&before).0,
            changed(&after).1 - changed(&before).1
        ),
        (1, 1),
        "UID_CHANGED on both sides, and nothing else: {}\n{}",
        d.fallbacks_desc(),
        nginx.logs()
    );
    assert_eq!(d.fallbacks(), 2, "{}", d.fallbacks_desc());
    assert_eq!(d.conns_opened, 0);
    let err = curl.stderr_str();
    assert!(err.contains("UID_CHANGED"), "curl's debug log:\n{err}");
    nginx.stop(Duration::from_secs(10));
}

/// `/run/smclo`, made by `smclo dev init --group GROUP` without a
/// directory, is the device of every member that sets no
/// `SMCLO_DEVICE_DIR`: nginx started as root with its workers as one
/// member, curl as another. The test thread has its own `/run` (a tmpfs in
/// a private mount namespace), so the host's is never touched.
#[test]
fn run_smclo_is_every_members_default() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let cli = acc.user("cli", Member::Supplementary);
    let mut env = Env::new("group-default");
    open_tmp(&env);
    private_mounts();
    let run = Tmpfs::mount_at(Path::new("/run"), "16m");
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&run.0, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let o = Command::new(smclo_bin())
        .args(["dev", "init", "--group", &acc.group])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dev = smclo::device::Device::open(Path::new(smclo::config::SYSTEM_DEVICE_DIR)).unwrap();
    let (root, big) = web_root(&env, b"small\n", 11);
    let port = free_port();
    let cf = nginx_conf(&env, &format!("{web} {}", acc.group), port, &root);
    let d = cf.parent().unwrap().display().to_string();
    let e = format!("{d}/error.log");
    let mut cmd = env.command(
        Mode::Smclo,
        None,
        "nginx",
        &["-c", cf.to_str().unwrap(), "-p", &d, "-e", &e],
    );
    cmd.env_remove("SMCLO_DEVICE_DIR");
    let mut nginx = env.spawn_cmd("nginx", cmd);
    wait_listen(&mut nginx, port);
    let before = dev.stats();
    let url = format!("http://127.0.0.1:{port}/big.bin");
    let mut c = Command::new(require("runuser"));
    c.args(["-u", &cli, "--"])
        .arg(smclo_bin())
        .args(["run", "--"])
        .arg(require("curl"))
        .args(["-sS", "--fail", "--max-time", "30", &url]);
    c.env_remove("SMCLO_DEVICE_DIR").env_remove("LD_PRELOAD");
    let mut curl = env.spawn_cmd("curl", c);
    curl.wait_ok(T);
    let after = dev.stats();
    assert!(curl.stdout() == big, "curl's body differs from the file");
    let logs = format!("{}\n{}", nginx.logs(), curl.stderr_str());
    assert_smc(
        "nginx and curl on /run/smclo by default",
        &delta(&before, &after),
        1,
        big.len() as u64,
        2 * big.len() as u64,
        &logs,
    );
    nginx.stop(Duration::from_secs(10));
    drop(run);
}

/// A process that leaves the group after it opened the device (it drops
/// its supplementary groups and keeps its effective uid, so its own check
/// sees no change) is refused by its peers: the server checks the client's
/// credentials before it passes a DMB and declines with PEER_CRED, which
/// both ends count. The client is a root process that runs as another
/// user (effective uid) and keeps root as its saved uid to drop the group.
#[test]
fn a_peer_that_left_the_group_is_declined_with_peer_cred() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let cli = acc.user("cli", Member::No);
    let mut env = Env::new("group-left");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let id = |flag: &str, name: &str| -> u32 {
        let o = Command::new("id").args([flag, name]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
    };
    let (gid, cli_uid) = (id("-g", &web), id("-u", &cli));
    let port = free_port();
    let server = format!(
        "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('127.0.0.1', {port}))\ns.listen()\nc, _ = s.accept()\nc.sendall(c.recv(100))\nc.close()\n"
    );
    let c = env.command_as(&web, Mode::Smclo, "python3", &["-c", &server]);
    let mut srv = env.spawn_cmd("server", c);
    wait_listen(&mut srv, port);
    env.extra_env
        .push(("SMCLO_DEBUG".to_string(), "1".to_string()));
    // A listener opens (and registers in) the device while the group is
    // ours; then the group goes, the effective uid stays.
    let client = format!(
        "import os, socket\nos.setgroups([{gid}])\nos.setegid(65534)\nos.seteuid({cli_uid})\n\
         l = socket.socket()\nl.bind(('127.0.0.1', 0))\nl.listen()\n\
         os.seteuid(0)\nos.setgroups([])\nos.seteuid({cli_uid})\n\
         c = socket.create_connection(('127.0.0.1', {port}))\nc.sendall(b'hello')\n\
         print(c.recv(100).decode())\n"
    );
    let before = env.stats();
    let c = env.command(Mode::Smclo, None, "python3", &["-c", &client]);
    let mut cp = env.spawn_cmd("client", c);
    cp.wait_ok(T);
    srv.wait_ok(T);
    assert_eq!(cp.stdout_str().trim(), "hello", "{}", cp.logs());
    let after = env.stats();
    let d = delta(&before, &after);
    let refused = |s: &smclo::device::Stats| s.fallback(Reason::PeerCred);
    assert_eq!(
        (
            refused(&after).0 - refused(&before).0,
            refused(&after).1 - refused(&before).1
        ),
        (1, 1),
        "PEER_CRED on both sides, nothing else: {}\n{}\n{}",
        d.fallbacks_desc(),
        cp.logs(),
        srv.logs()
    );
    assert_eq!(d.fallbacks(), 2, "{}", d.fallbacks_desc());
    assert!(cp.stderr_str().contains("PEER_CRED"), "{}", cp.logs());
}

// ---------------------------------------------------------------------------
// A member that shrinks a shared file breaks connections, never processes.

/// `tests/py/shrink_peer.py`, copied where the test's users can read it.
fn shrink_script(env: &Env) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/shrink_peer.py");
    let dst = env.path("shrink_peer.py");
    fs::copy(src, &dst).unwrap();
    dst.display().to_string()
}

/// The echo server of `shrink_peer.py` as `user` under `smclo run`.
fn start_shrink_server(env: &mut Env, user: &str, script: &str, port: u16) -> Proc {
    let p = port.to_string();
    let c = env.command_as(user, Mode::Smclo, "python3", &[script, "server", &p]);
    let mut srv = env.spawn_cmd("server", c);
    wait_listen(&mut srv, port);
    srv
}

/// One echo over `s` (a plain TCP connection of the test, no smclo).
fn echo_plain(s: &mut std::net::TcpStream, what: &str) {
    use std::io::{Read, Write};
    let msg = format!("plain {what}\n");
    s.write_all(msg.as_bytes()).unwrap();
    let mut got = vec![0u8; msg.len()];
    s.read_exact(&mut got)
        .unwrap_or_else(|e| panic!("the server's TCP connection ({what}): {e}"));
    assert_eq!(got, msg.as_bytes(), "{what}");
}

fn plain_conn(port: u16) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// Waits until `p`'s stdout has the line `line`.
fn wait_line(p: &mut Proc, line: &str) {
    let t0 = Instant::now();
    while !p.stdout_str().lines().any(|l| l == line) {
        assert!(
            p.alive() && t0.elapsed() < T,
            "{} never printed {line:?}\n{}",
            p.name,
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `shrink(device)` run as `user` (a member that never ran smclo) shrinks
/// the device file while a server (one member) and a client (another)
/// have an SMC-D connection on it and the server a plain TCP one: nobody
/// dies; the SMC-D connection is reset, the TCP one and later connections
/// (TCP: the device is gone) work.
fn shrink_device_under_live_connection(
    acc: &mut Accounts,
    env: &mut Env,
    lost: Lost,
    shrink: impl FnOnce(&mut Env, &Path, &str),
) {
    let web = acc.user("web", Member::Primary);
    let cli = acc.user("cli", Member::Supplementary);
    let evil = acc.user("evil", Member::Supplementary);
    open_tmp(env);
    env.extra_env
        .push(("SMCLO_DEBUG".to_string(), "1".to_string()));
    let script = shrink_script(env);
    let port = free_port();
    let mut srv = start_shrink_server(env, &web, &script, port);
    // A second server that has no connection until the device is gone.
    let idle_port = free_port();
    let mut idle = start_shrink_server(env, &web, &script, idle_port);
    let mut tcp = plain_conn(port);
    echo_plain(&mut tcp, "before");
    let before = env.stats();
    let go = env.path("go");
    let p = port.to_string();
    let c = env.command_as(
        &cli,
        Mode::Smclo,
        "python3",
        &[&script, "client", &p, go.to_str().unwrap()],
    );
    let mut client = env.spawn_cmd("client", c);
    wait_line(&mut client, "live ok");
    let d = delta(&before, &env.stats());
    assert_eq!(
        d.conns_opened,
        1,
        "the live connection is SMC-D: {}",
        d.fallbacks_desc()
    );
    let dev = env.dev_dir.join("device");
    shrink(env, &dev, &evil);
    fs::write(&go, b"").unwrap();
    let st = client.wait(T);
    let out = client.stdout_str();
    assert!(
        st.success(),
        "the client must survive: {st:?}\n{}",
        client.logs()
    );
    assert!(out.lines().any(|l| l == "later ok"), "{}", client.logs());
    let err = client.stderr_str();
    assert!(
        err.contains("stays TCP (NOSMCDDEV"),
        "the later connection is TCP:\n{err}"
    );
    match lost {
        Lost::Mapping => {
            assert!(
                out.lines().any(|l| l == "live ECONNRESET"),
                "the live connection is reset:\n{}",
                client.logs()
            );
            assert!(
                err.contains("connection reset: the device file was truncated")
                    && err.contains("was truncated under this process: its connections stay TCP"),
                "the client's log says why:\n{err}"
            );
        }
        Lost::Contents => assert_eq!(
            out.lines().filter(|l| *l == "live ok").count(),
            2,
            "the live connection goes on:\n{}",
            client.logs()
        ),
    }
    assert!(srv.alive(), "the server must survive\n{}", srv.logs());
    echo_plain(&mut tcp, "after");
    echo_plain(&mut plain_conn(port), "later");
    assert!(srv.alive(), "{}", srv.logs());
    // Its first access to the device is the accept of this connection.
    let t0 = Instant::now();
    echo_plain(&mut plain_conn(idle_port), "the idle server's first");
    let took = t0.elapsed();
    assert!(
        idle.alive(),
        "the idle server must survive\n{}",
        idle.logs()
    );
    assert!(
        took < Duration::from_millis(500),
        "its connection waited {took:?}\n{}",
        idle.logs()
    );
    srv.stop(Duration::from_secs(5));
    idle.stop(Duration::from_secs(5));
}

/// What a member's change to the device file costs the processes that map
/// it.
#[derive(Clone, Copy)]
enum Lost {
    /// Their mappings (their next access faults): their connections on
    /// the device are reset.
    Mapping,
    /// Only its contents (they read zeros: the device is switched off),
    /// which they may write anyway: live connections go on.
    Contents,
}

/// Runs `prog args` as `user`, without smclo; panics unless it succeeds.
fn run_as(env: &mut Env, user: &str, prog: &str, args: &[&str]) {
    let c = env.command_as(user, Mode::Plain, prog, args);
    let mut p = env.spawn_cmd(prog, c);
    p.wait_ok(T);
}

#[test]
fn a_member_that_truncates_the_device_resets_its_connections_and_kills_nobody() {
    let mut acc = Accounts::new();
    let mut env = Env::new("group-truncate");
    group_device(&env, &acc.group);
    shrink_device_under_live_connection(&mut acc, &mut env, Lost::Mapping, |env, dev, evil| {
        run_as(env, evil, "truncate", &["-s", "0", dev.to_str().unwrap()]);
    });
}

/// The same where every thread of the server and the client blocks its
/// signals, `SIGBUS` among them, as worker threads that leave signals to
/// one thread do: the kernel kills a thread that faults with `SIGBUS`
/// blocked, without running the handler. The programs still see `SIGBUS`
/// blocked (`shrink_peer.py` checks). Before, the truncation killed the
/// client at its next send and the server at its next accept.
#[test]
fn a_member_that_truncates_the_device_kills_nobody_that_blocks_its_signals() {
    let mut acc = Accounts::new();
    let mut env = Env::new("group-truncate-masked");
    group_device(&env, &acc.group);
    env.extra_env
        .push(("SHRINK_MASKED".to_string(), "1".to_string()));
    shrink_device_under_live_connection(&mut acc, &mut env, Lost::Mapping, |env, dev, evil| {
        run_as(env, evil, "truncate", &["-s", "0", dev.to_str().unwrap()]);
    });
}

#[test]
fn a_member_that_punches_a_hole_in_the_device_switches_it_off_and_kills_nobody() {
    let mut acc = Accounts::new();
    let mut env = Env::new("group-hole");
    group_device(&env, &acc.group);
    // The filesystem has room: the hole reads as zeros, and pages in again.
    shrink_device_under_live_connection(&mut acc, &mut env, Lost::Contents, |env, dev, evil| {
        let len = smclo_wire::device_layout::TOTAL_SIZE.to_string();
        let d = dev.to_str().unwrap();
        run_as(env, evil, "fallocate", &["-p", "-o", "0", "-l", &len, d]);
    });
}

#[test]
fn a_member_that_punches_a_hole_in_the_device_on_a_full_filesystem_kills_nobody() {
    let mut acc = Accounts::new();
    let mut env = Env::new("group-punch");
    // A filesystem just big enough for the device: a hole punched in it
    // and refilled by another file cannot be paged in again (SIGBUS).
    private_mounts();
    let size = format!("{}k", smclo_wire::device_layout::TOTAL_SIZE / 1024 + 256);
    let mnt = Tmpfs::mount_at(&env.path("devfs"), &size);
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&mnt.0, fs::Permissions::from_mode(0o755)).unwrap();
    }
    fs::remove_dir_all(&env.dev_dir).unwrap();
    env.dev_dir = mnt.0.join("smclo");
    fs::create_dir(&env.dev_dir).unwrap();
    group_device(&env, &acc.group);
    shrink_device_under_live_connection(&mut acc, &mut env, Lost::Mapping, |env, dev, evil| {
        let len = smclo_wire::device_layout::TOTAL_SIZE.to_string();
        let d = dev.to_str().unwrap();
        run_as(env, evil, "fallocate", &["-p", "-o", "0", "-l", &len, d]);
        let fill = dev.with_file_name("fill").display().to_string();
        let c = env.command_as(
            evil,
            Mode::Plain,
            "dd",
            &["if=/dev/zero", &format!("of={fill}"), "bs=64k"],
        );
        let mut dd = env.spawn_cmd("fill", c);
        let st = dd.wait(T);
        assert!(
            !st.success() && dd.stderr_str().contains("No space left"),
            "{}",
            dd.logs()
        );
    });
    drop(mnt);
    drop(env);
}

#[test]
fn a_peer_that_shrinks_or_holes_its_dmbs_harms_only_its_own_connection() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let cli = acc.user("cli", Member::Supplementary);
    let evil = acc.user("evil", Member::Supplementary);
    let mut env = Env::new("group-dmb");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let script = shrink_script(&env);
    let port = free_port();
    let mut srv = start_shrink_server(&mut env, &web, &script, port);
    let go = env.path("go");
    let p = port.to_string();
    let before = env.stats();
    let c = env.command_as(
        &cli,
        Mode::Smclo,
        "python3",
        &[&script, "client", &p, go.to_str().unwrap()],
    );
    let mut client = env.spawn_cmd("client", c);
    wait_line(&mut client, "live ok");
    // The attacker is a member and a peer: it holds its own DMB's memfd
    // and the server's, and tries to shrink and hole both.
    let c = env.command_as(&evil, Mode::Smclo, "python3", &[&script, "attack", &p]);
    let mut attack = env.spawn_cmd("attack", c);
    let st = attack.wait(T);
    assert!(
        st.success(),
        "the attacker survives: {st:?}\n{}",
        attack.logs()
    );
    let out = attack.stdout_str();
    let lines: Vec<&str> = out.lines().collect();
    let count = |l: &str| lines.iter().filter(|x| **x == l).count();
    let fds = count("truncate EPERM");
    assert!(
        fds >= 1 && lines.contains(&format!("dmbs {fds}").as_str()),
        "the seals refuse every truncation:\n{}",
        attack.logs()
    );
    assert_eq!(count("punch done"), fds, "{}", attack.logs());
    assert!(
        lines.contains(&"holed 2"),
        "holes in both DMBs:\n{}",
        attack.logs()
    );
    assert!(srv.alive(), "the server survives\n{}", srv.logs());
    // The other member's live connection and its later one: SMC-D, intact.
    fs::write(&go, b"").unwrap();
    client.wait_ok(T);
    let out = client.stdout_str();
    assert_eq!(
        out.lines().filter(|l| *l == "live ok").count(),
        2,
        "{}",
        client.logs()
    );
    assert!(out.lines().any(|l| l == "later ok"), "{}", client.logs());
    let d = delta(&before, &env.stats());
    assert_eq!(d.conns_opened, 3, "{}", d.fallbacks_desc());
    assert!(srv.alive(), "{}", srv.logs());
    echo_plain(&mut plain_conn(port), "later");
    srv.stop(Duration::from_secs(5));
}

#[test]
fn a_programs_own_sigbus_handler_gets_its_own_faults() {
    let mut acc = Accounts::new();
    let web = acc.user("web", Member::Primary);
    let mut env = Env::new("group-own-sigbus");
    group_device(&env, &acc.group);
    open_tmp(&env);
    let script = shrink_script(&env);
    let port = free_port();
    let mut srv = start_shrink_server(&mut env, &web, &script, port);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/own_sigbus.c");
    let exe = compile_c(&env, &src, &[]);
    let before = env.stats();
    let scratch = env.path("scratch");
    let p = env.run(
        Mode::Smclo,
        "own_sigbus",
        exe.to_str().unwrap(),
        &[&port.to_string(), scratch.to_str().unwrap()],
        T,
    );
    let d = delta(&before, &env.stats());
    assert_eq!(d.conns_opened, 1, "{}", d.fallbacks_desc());
    let out = p.stdout_str();
    for line in [
        "echo ok",
        "query answers",
        "own fault handled",
        "sent handled",
        "signal() fault handled",
        "default kills",
    ] {
        assert!(out.lines().any(|l| l == line), "{line:?}:\n{}", p.logs());
    }
    let ign = out
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no SigIgn line:\n{}", p.logs()));
    assert_ne!(
        ign & 1 << (libc::SIGBUS - 1),
        0,
        "an ignored SIGBUS stays ignored through exec"
    );
    srv.stop(Duration::from_secs(5));
}
