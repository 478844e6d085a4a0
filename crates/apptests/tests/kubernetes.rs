//! The Kubernetes recipe (deploy/kubernetes/, deploy/docker/Dockerfile):
//! its manifests parsed as YAML and checked against the fields they use
//! (tests/py/k8s_manifests.py, with Debian's python3-yaml), and its
//! node-side step run here: the DaemonSet's install script, with the
//! capabilities the manifest grants it, puts the library on a "node" (a
//! temporary directory standing for the node's root) and makes the group
//! device, twice; then redis-server and redis-cli, run as the example
//! pods' uid and gid with the device's group as their supplementary group
//! and the pods' LD_PRELOAD, connect through shared memory, and
//! `smclo exporter`, run as the DaemonSet's container with no
//! capabilities, serves the device's counters. No cluster is involved.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `k8s_manifests.py ARGS` on the repository.
fn manifests(args: &[&str]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/k8s_manifests.py");
    Command::new(require("python3"))
        .arg(script)
        .arg(args[0])
        .arg(repo_root())
        .args(&args[1..])
        .output()
        .expect("python3")
}

fn ok_stdout(what: &str, o: Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{what}: {}\n{out}{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn manifests_and_dockerfile_use_fields_that_match() {
    let out = ok_stdout("the recipe's checks", manifests(&["check"]));
    assert!(out.is_empty(), "{out}");
}

/// A group made for the test, deleted when dropped.
struct Group {
    name: String,
    gid: u32,
}

impl Group {
    fn new() -> Group {
        let name = format!("smclo-k8s-{}", std::process::id());
        let st = Command::new(require("groupadd"))
            .arg(&name)
            .status()
            .unwrap();
        assert!(st.success(), "groupadd {name}");
        let o = Command::new("getent")
            .args(["group", &name])
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&o.stdout).into_owned();
        let gid = line.split(':').nth(2).and_then(|g| g.parse().ok());
        Group {
            gid: gid.unwrap_or_else(|| panic!("getent group {name}: {line:?}")),
            name,
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).status();
    }
}

/// The DaemonSet's install step as the manifest states it.
struct Install {
    script: PathBuf,
    /// Its environment, with hostPath paths moved under the node's root.
    env: Vec<(String, String)>,
    /// The capabilities it is granted, as setpriv spells them (+chown).
    caps: Vec<String>,
}

/// Reads the install step, placing the node's paths under `node` and the
/// image's files at the freshly built ones, with the group `gid`.
fn install_step(env: &Env, node: &Path, gid: u32) -> Install {
    let script = env.path("install.sh");
    let out = ok_stdout(
        "the DaemonSet's install step",
        manifests(&["node", script.to_str().unwrap()]),
    );
    let mut inst = Install {
        script,
        env: Vec::new(),
        caps: Vec::new(),
    };
    for l in out.lines() {
        let f: Vec<&str> = l.split(' ').collect();
        match f[..] {
            ["host", name, p] => inst.env.push((name.into(), under(node, p))),
            ["image", name, _] => inst
                .env
                .push((name.into(), profile_dir().display().to_string())),
            ["group", name, _] => inst.env.push((name.into(), gid.to_string())),
            ["cap", c] => inst.caps.push(format!("+{}", c.to_lowercase())),
            _ => panic!("unexpected line {l:?}"),
        }
    }
    inst
}

fn under(node: &Path, p: &str) -> String {
    node.join(p.trim_start_matches('/')).display().to_string()
}

/// Runs the install script as the container would: root, no new
/// privileges, only the granted capabilities.
fn run_install(inst: &Install) -> Output {
    let caps = format!("-all,{}", inst.caps.join(","));
    let mut c = Command::new(require("setpriv"));
    c.args(["--no-new-privs", "--inh-caps=-all", "--bounding-set"])
        .arg(&caps)
        .args(["--", "/bin/sh", "-c"])
        .arg(fs::read_to_string(&inst.script).unwrap())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    for (k, v) in &inst.env {
        c.env(k, v);
    }
    c.output().expect("setpriv")
}

/// The node's files after the install step: the device and the library.
fn check_node(dev: &Path, lib: &Path, gid: u32) {
    let d = fs::metadata(dev).expect("the device directory");
    assert_eq!(d.mode() & 0o7777, 0o2770, "device directory mode");
    assert_eq!((d.uid(), d.gid()), (0, gid), "device directory owner");
    let f = fs::metadata(dev.join("device")).expect("the device file");
    assert_eq!((f.mode() & 0o777, f.gid()), (0o660, gid), "device file");
    for name in ["smclo", "libsmclo_preload.so", "libsmclo_preload_musl.so"] {
        let built = profile_dir().join(name);
        assert!(
            built.is_file(),
            "{} is missing: build it (cargo build --release --workspace; scripts/build-musl-preload)",
            built.display()
        );
        let on_node = lib.join(name);
        assert_eq!(
            fs::read(&on_node).ok(),
            fs::read(&built).ok(),
            "{} is not the built {name}",
            on_node.display()
        );
        assert_eq!(fs::metadata(&on_node).unwrap().mode() & 0o777, 0o755);
    }
    let left: Vec<_> = fs::read_dir(lib)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

/// (name, inode) of each file in `dir`.
fn inodes(dir: &Path) -> Vec<(String, u64)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            Some((e.file_name().into_string().ok()?, e.metadata().ok()?.ino()))
        })
        .collect();
    v.sort();
    v
}

/// The example pods' identity: uid, gid and LD_PRELOAD's file.
fn app_identity() -> HashMap<String, String> {
    ok_stdout("the application pod", manifests(&["app"]))
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `prog args` as an application container: the pod's uid and gid,
/// `groups` as its supplementary groups (none if empty), the pod's LD_PRELOAD (in the
/// node's library directory `lib`) and SMCLO_DEVICE_DIR.
fn as_pod(env: &Env, lib: &Path, groups: &str, prog: &str, args: &[&str]) -> Command {
    let id = app_identity();
    let mut c = Command::new(require("setpriv"));
    c.arg(format!("--reuid={}", id["uid"]))
        .arg(format!("--regid={}", id["gid"]))
        .arg(if groups.is_empty() {
            "--clear-groups".to_string()
        } else {
            format!("--groups={groups}")
        })
        .args(["--no-new-privs", "--"])
        .arg(require(prog))
        .args(args)
        .env_remove("SMCLO_DEBUG")
        .env("LD_PRELOAD", lib.join(&id["preload"]))
        .env("SMCLO_DEVICE_DIR", &env.dev_dir)
        .current_dir("/")
        .process_group(0);
    c
}

fn redis_cli(env: &mut Env, lib: &Path, groups: &str, port: u16, args: &[&str]) -> String {
    let p = port.to_string();
    let mut all = vec!["-h", "127.0.0.1", "-p", &p];
    all.extend(args);
    let c = as_pod(env, lib, groups, "redis-cli", &all);
    let mut cli = env.spawn_cmd("redis-cli", c);
    cli.wait_ok(T);
    cli.stdout_str()
}

/// GET of `/metrics` from the exporter at `port`.
fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the exporter");
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    page
}

/// The value of the sample that starts with `prefix` (name and labels).
fn sample(page: &str, prefix: &str) -> u64 {
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{page}"))
}

/// The node as the DaemonSet leaves it, under `env`'s temporary directory:
/// the install step run once for `group`; returns the step, the library
/// directory and the device directory (which becomes `env`'s).
fn installed_node(env: &mut Env, group: &Group) -> (Install, PathBuf, PathBuf) {
    fs::remove_dir_all(&env.dev_dir).unwrap();
    let inst = install_step(env, &env.path("node"), group.gid);
    let path_of = |name: &str| {
        let v = inst.env.iter().find(|(k, _)| k == name);
        PathBuf::from(&v.unwrap_or_else(|| panic!("no {name}")).1)
    };
    let (lib, dev) = (path_of("NODE_LIB_DIR"), path_of("NODE_DEVICE_DIR"));
    // What the node has before: /run, and the directory kubelet makes for
    // a DirectoryOrCreate volume.
    fs::create_dir_all(dev.parent().unwrap()).unwrap();
    fs::create_dir_all(&lib).unwrap();
    env.dev_dir = dev.clone();
    ok_stdout("the install script", run_install(&inst));
    check_node(&dev, &lib, group.gid);
    (inst, lib, dev)
}

/// An install for another group fails on the existing device, naming the
/// problem, and leaves the device as it was.
fn install_for_another_group_fails(env: &Env, group: &Group, lib: &Path, dev: &Path) {
    let wrong = install_step(env, &env.path("node"), group.gid + 1);
    let o = run_install(&wrong);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "an install for another group succeeded"
    );
    let want = format!("has group {}, not group {}", group.gid, group.gid + 1);
    assert!(err.contains(&want), "{err}");
    check_node(dev, lib, group.gid);
}

/// redis-server as the example pod, on a free port.
fn start_redis_pod(env: &mut Env, lib: &Path, group: &Group) -> (Proc, u16) {
    let port = free_port();
    let p = port.to_string();
    let args = [
        "--port",
        &p,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ];
    let c = as_pod(env, lib, &group.gid.to_string(), "redis-server", &args);
    let mut srv = env.spawn_cmd("redis-server", c);
    wait_listen(&mut srv, port);
    (srv, port)
}

/// SET and GET of 16 KiB by two redis-cli pods with `groups`; returns the
/// counters' movement.
fn set_and_get(env: &mut Env, lib: &Path, groups: &str, port: u16) -> (Delta, u64) {
    let value: String = pseudo_random(8192, 19)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let s0 = env.stats();
    let set = redis_cli(env, lib, groups, port, &["SET", "k8s", &value]);
    assert_eq!(set.trim(), "OK");
    let got = redis_cli(env, lib, groups, port, &["GET", "k8s"]);
    assert!(
        got.trim_end_matches('\n') == value,
        "GET returned other bytes"
    );
    (delta(&s0, &env.stats()), value.len() as u64)
}

/// `smclo exporter` as the DaemonSet runs it (root without capabilities),
/// scraped once: its count of SMC-D connections equals the device's.
fn exporter_serves_the_counters(env: &mut Env, dev: &Path) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut c = Command::new(require("setpriv"));
    c.args([
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ])
    .arg(smclo_bin())
    .args(["exporter", "--listen", &listen, "--device"])
    .arg(dev)
    .process_group(0);
    let mut exp = env.spawn_cmd("exporter", c);
    wait_listen(&mut exp, port);
    let page = scrape(port);
    let opened = sample(&page, "smclo_connections_opened_total{");
    assert_eq!(opened, env.stats().conns_opened, "{page}");
    assert!(opened >= 2, "{page}");
}

#[test]
fn the_daemonsets_install_step_makes_the_device_the_pods_use() {
    assert!(
        is_root(),
        "groups, setpriv and a root-owned device need root"
    );
    let group = Group::new();
    let mut env = Env::new("k8s");
    let (inst, lib, dev) = installed_node(&mut env, &group);
    let (srv, port) = start_redis_pod(&mut env, &lib, &group);

    // The DaemonSet's pod restarts (a rollout) while the server has the
    // library mapped: the same device, each file replaced whole.
    let before = inodes(&lib);
    ok_stdout("the install script, run again", run_install(&inst));
    check_node(&dev, &lib, group.gid);
    let after = inodes(&lib);
    let kept: Vec<_> = before.iter().filter(|f| after.contains(f)).collect();
    assert!(kept.is_empty(), "files rewritten in place: {kept:?}");
    install_for_another_group_fails(&env, &group, &lib, &dev);

    let (d, n) = set_and_get(&mut env, &lib, &group.gid.to_string(), port);
    let logs = srv.logs();
    assert_smc(
        "pods in the device's group",
        &d,
        2,
        2 * n,
        2 * n + 4096,
        &logs,
    );

    // Pods without the group: plain TCP, the server counts why.
    let (d, _) = set_and_get(&mut env, &lib, "", port);
    assert_eq!(d.conns_opened, 0, "an outsider got SMC-D");
    assert_eq!(
        d.fallback(Reason::PeerNoSmc),
        (0, 2),
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallbacks(), 2, "{}", d.fallbacks_desc());

    exporter_serves_the_counters(&mut env, &dev);
}
