//! Two containers made with unshare, each with its own user, mount, pid and
//! network namespace, their network namespaces joined by a veth pair, the
//! device directory bind-mounted into both: "rootful" (a user namespace
//! with the identity map, created by root, the program run as a plain user
//! U, as `--user U`) and rootless (a user namespace created by U itself,
//! mapping its root to U). Servers listen on the wildcard, as servers in
//! containers do. Connections between the containers are SMC-D both ways,
//! byte-exact; a connection to a plain server stays TCP; a client in a
//! third network namespace with its own device falls back. Then two
//! containers of two different users share a group device. Needs root
//! (ip netns, unshare, setpriv); addresses from 10.195.0.0/16 to
//! 10.197.0.0/16 on veths inside the test's namespaces.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SIZE: usize = 200_000;
/// Where each container sees the device directory.
const INNER_DIR: &str = "/mnt/smclo";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/echo_check.py")
}

/// A uid of no account on this machine, below 65536 (the rootful
/// container's identity map covers 0..65536).
fn free_uid(from: u32) -> u32 {
    let mut u = from + std::process::id() % 4_000;
    // SAFETY: getpwuid returns a pointer into static storage or null; only
    // null is looked at.
    while !unsafe { libc::getpwuid(u) }.is_null() {
        u += 1;
    }
    u
}

/// A gid of no group on this machine, below 65536.
fn free_gid() -> u32 {
    let mut g = 60_000 + std::process::id() % 4_000;
    // SAFETY: as getpwuid in free_uid.
    while !unsafe { libc::getgrgid(g) }.is_null() {
        g += 1;
    }
    g
}

/// The host side of the shared device, removed when dropped.
use smclo_testsupport::DevDir as HostDir;

trait HostDirs {
    fn private(uid: u32) -> HostDir;
    fn group(gid: u32) -> HostDir;
}

impl HostDirs for HostDir {
    /// A private directory of uid `uid`.
    fn private(uid: u32) -> HostDir {
        let d = HostDir::new("ct-private");
        std::fs::create_dir(&d.0).unwrap();
        std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&d.0, Some(uid), Some(uid)).unwrap();
        d
    }

    /// A group device of gid `gid`, made by `smclo dev init --group` (root's).
    fn group(gid: u32) -> HostDir {
        let d = HostDir::new("ct-group");
        let o = Command::new(smclo_bin())
            .args(["dev", "init", "--group", &gid.to_string()])
            .arg(&d.0)
            .output()
            .unwrap();
        assert!(o.status.success(), "smclo dev init: {o:?}");
        d
    }
}

/// Who a container's program runs as: uid U (its own gid U) and, if
/// given, a supplementary group.
#[derive(Clone, Copy)]
struct User {
    uid: u32,
    group: Option<u32>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Container {
    /// A user namespace made by root with the identity map (written by
    /// the test: unshare's own map options need newuidmap); the program
    /// runs as U.
    Rootful,
    /// A user namespace U made itself, its root mapped to U.
    Rootless,
}

/// Starts `argv` (python3 arguments) in a container of kind `kind` in
/// network namespace `ns`: new user, mount and pid namespaces (with their
/// own /proc), a tmpfs on /mnt and the host's device directory
/// bind-mounted at [`INNER_DIR`]; under `smclo run` when `smclo`.
#[allow(clippy::too_many_arguments)]
fn start(
    env: &mut Env,
    name: &str,
    kind: Container,
    ns: &Netns,
    user: User,
    host: &Path,
    smclo: bool,
    argv: &[&str],
) -> Proc {
    let u = user.uid.to_string();
    let groups = user
        .group
        .map_or("--clear-groups".to_string(), |g| format!("--groups={g}"));
    let drop_to_u = ["setpriv", "--reuid", &u, "--regid", &u, &groups, "--"];
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", ns.name)).arg("--");
    if kind == Container::Rootless {
        c.args(drop_to_u);
    }
    c.args([
        "unshare",
        "--user",
        "--mount",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
    ]);
    // The rootful container waits for its map (a line on stdin), mounts
    // as the container's root, then runs the program as U; the rootless
    // one's root is U.
    let (wait, run) = match kind {
        Container::Rootful => (
            "read go && ",
            format!("exec {} \"$@\"", drop_to_u.join(" ")),
        ),
        Container::Rootless => ("", "exec \"$@\"".to_string()),
    };
    if kind == Container::Rootless {
        c.arg("--map-root-user");
    }
    c.args([
        "--",
        "sh",
        "-c",
        &format!(
            "{wait}mount -t tmpfs tmpfs /mnt && mkdir {INNER_DIR} && mount --bind \"$0\" {INNER_DIR} && {run}"
        ),
    ]);
    c.arg(host);
    if smclo {
        c.arg(smclo_bin()).args(["run", "--"]);
    }
    c.arg(require("python3")).args(argv);
    c.env("SMCLO_DEVICE_DIR", INNER_DIR)
        .env("SMCLO_DEBUG", "1")
        .env_remove("LD_PRELOAD");
    c.stdin(Stdio::piped());
    c.process_group(0);
    let mut p = env.spawn_cmd(name, c);
    let mut go = p.child.stdin.take().unwrap();
    if kind == Container::Rootful {
        identity_map(&mut p);
        go.write_all(b"go\n").unwrap();
    }
    p
}

/// Writes the identity map (0..65536) of the user namespace of `p` (which
/// nsenter turned into unshare, same pid) once unshare has made it.
fn identity_map(p: &mut Proc) {
    let pid = p.pid();
    let me = std::fs::read_link("/proc/self/ns/user").unwrap();
    let t0 = Instant::now();
    while std::fs::read_link(format!("/proc/{pid}/ns/user"))
        .ok()
        .as_ref()
        == Some(&me)
    {
        assert!(p.alive(), "{} exited\n{}", p.name, p.logs());
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", p.logs());
        std::thread::sleep(Duration::from_millis(5));
    }
    for f in ["uid_map", "gid_map"] {
        std::fs::write(format!("/proc/{pid}/{f}"), "0 0 65536\n")
            .unwrap_or_else(|e| panic!("{f} of {pid}: {e}"));
    }
}

/// Waits for "ready" on the server's stdout.
fn ready(p: &mut Proc) {
    p.wait_stdout("ready", Duration::from_secs(20), &[]);
}

/// Bytes the client `p` moved (both ways), after it checked every byte.
fn checked(mut p: Proc, logs: &str) -> u64 {
    p.wait_ok(T);
    let [sent, received] = ok_numbers(&p, logs)[..] else {
        panic!("{}: no byte counts", p.name)
    };
    sent + received
}

/// The shared device's counters, read by `smclo stats --json` as U (the
/// directory is U's).
struct Counts(String);

impl Counts {
    fn read(host: &Path, uid: u32) -> Counts {
        let u = uid.to_string();
        let o = Command::new("setpriv")
            .args(["--reuid", &u, "--regid", &u, "--clear-groups", "--"])
            .arg(smclo_bin())
            .args(["stats", "--json"])
            .env("SMCLO_DEVICE_DIR", host)
            .output()
            .unwrap();
        assert!(o.status.success(), "smclo stats: {o:?}");
        Counts(String::from_utf8(o.stdout).unwrap())
    }

    /// The number after `"key":` (after `within`'s object when given).
    fn num(&self, within: Option<&str>, key: &str) -> u64 {
        let from = within.map_or(0, |w| self.0.find(&format!("\"{w}\":")).unwrap());
        let rest = &self.0[from..];
        let at = rest.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
        let digits: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits.parse().unwrap()
    }

    fn fallbacks(&self, r: Reason) -> (u64, u64) {
        let n = r.name();
        (self.num(Some(n), "client"), self.num(Some(n), "server"))
    }

    fn total_fallbacks(&self) -> u64 {
        Reason::ALL
            .iter()
            .map(|r| {
                let (c, s) = self.fallbacks(*r);
                c + s
            })
            .sum()
    }
}

#[test]
fn containers_share_the_device_by_bind_mount() {
    assert!(is_root(), "this test makes namespaces and needs root");
    let mut env = Env::new("containers");
    let uid = free_uid(50_000);
    let user = User { uid, group: None };
    let host = HostDir::private(uid);
    let (a, b, c) = (env.netns("cta"), env.netns("ctb"), env.netns("ctc"));
    let n = std::process::id() % 250;
    let (a_ip, b_ip) = (format!("10.197.{n}.1"), format!("10.197.{n}.2"));
    let (a_ip_c, c_ip) = (format!("10.196.{n}.1"), format!("10.196.{n}.2"));
    veth(&a, &b, &a_ip, &b_ip);
    veth(&a, &c, &a_ip_c, &c_ip);
    let s = script();
    let s = s.to_str().unwrap();
    let k = 3u64;
    let (p1, p2, p3) = ("7101", "7102", "7103");
    let kk = k.to_string();
    let k1 = (k + 1).to_string();

    // Servers on the wildcard: A's (k from B, one from C), B's (k from A),
    // and a plain one in B.
    let (ful, less) = (Container::Rootful, Container::Rootless);
    let h = host.0.clone();
    let size = SIZE.to_string();
    let mut srv_a = start(
        &mut env,
        "server-a",
        ful,
        &a,
        user,
        &h,
        true,
        &[s, "listen", "0.0.0.0", p1, &k1],
    );
    let mut srv_b = start(
        &mut env,
        "server-b",
        less,
        &b,
        user,
        &h,
        true,
        &[s, "listen", "0.0.0.0", p2, &kk],
    );
    let mut plain_b = start(
        &mut env,
        "plain-b",
        less,
        &b,
        user,
        &h,
        false,
        &[s, "listen", "0.0.0.0", p3, "1"],
    );
    for p in [&mut srv_a, &mut srv_b, &mut plain_b] {
        ready(p);
    }
    let logs = |ps: &[&Proc]| ps.iter().map(|p| p.logs()).collect::<Vec<_>>().join("\n");
    let c0 = Counts::read(&h, uid);

    // B (rootless) to A and A to B: shared memory.
    let b_to_a = start(
        &mut env,
        "client-b",
        less,
        &b,
        user,
        &h,
        true,
        &[s, "client", &a_ip, p1, &kk, &size],
    );
    let moved_ba = checked(b_to_a, &logs(&[&srv_a]));
    let a_to_b = start(
        &mut env,
        "client-a",
        ful,
        &a,
        user,
        &h,
        true,
        &[s, "client", &b_ip, p2, &kk, &size],
    );
    let moved_ab = checked(a_to_b, &logs(&[&srv_b]));
    let c1 = Counts::read(&h, uid);
    let (opened, bytes) = (
        c1.num(None, "conns_opened") - c0.num(None, "conns_opened"),
        c1.num(None, "xfer_bytes") - c0.num(None, "xfer_bytes"),
    );
    eprintln!(
        "between containers: {opened} SMC-D connections, {bytes} bytes; stats {}",
        c1.0
    );
    assert_eq!(opened, 2 * k, "{}\n{}", c1.0, logs(&[&srv_a, &srv_b]));
    assert_eq!(bytes, moved_ab + moved_ba, "{}", c1.0);
    assert_eq!(c1.total_fallbacks(), c0.total_fallbacks(), "{}", c1.0);

    // A to the plain server in B: TCP at once (no listener registered).
    let t0 = Instant::now();
    let a_to_plain = start(
        &mut env,
        "client-plain",
        ful,
        &a,
        user,
        &h,
        true,
        &[s, "client", &b_ip, p3, "1", "1000"],
    );
    checked(a_to_plain, &logs(&[&plain_b]));
    let took = t0.elapsed();
    // C, with its own device (the test's, root's): TCP, counted as
    // PEERNOSMC by A's server on the shared device and by C's client on
    // its own. A's client to B's plain server announced the connection (B's
    // address has no listener, and the device has listeners: a
    // translation could have taken it to one), which the plain server's
    // reply ended: UNANSWERED.
    let own0 = env.stats();
    let mut from_c = env.command(
        Mode::Smclo,
        Some(&c.name),
        "python3",
        &[s, "client", &a_ip_c, p1, "1", "1000"],
    );
    from_c.env("SMCLO_DEBUG", "1");
    let from_c = env.spawn_cmd("client-c", from_c);
    checked(from_c, &logs(&[&srv_a]));
    let own = delta(&own0, &env.stats());
    let c2 = Counts::read(&h, uid);
    let nosmc = |x: &Counts| x.fallbacks(Reason::PeerNoSmc);
    let ((pc0, ps0), (pc2, ps2)) = (nosmc(&c1), nosmc(&c2));
    assert_eq!(
        c2.num(None, "conns_opened"),
        c1.num(None, "conns_opened"),
        "{}",
        c2.0
    );
    assert_eq!(
        c2.num(None, "xfer_bytes"),
        c1.num(None, "xfer_bytes"),
        "{}",
        c2.0
    );
    assert_eq!((pc2 - pc0, ps2 - ps0), (0, 1), "{}", c2.0);
    let unanswered = |x: &Counts| x.fallbacks(Reason::Unanswered);
    let ((uc1, us1), (uc2, us2)) = (unanswered(&c1), unanswered(&c2));
    assert_eq!((uc2 - uc1, us2 - us1), (1, 0), "{}", c2.0);
    assert_eq!(c2.total_fallbacks() - c1.total_fallbacks(), 2, "{}", c2.0);
    assert!(
        took < Duration::from_secs(5),
        "a plain connect took {took:?}"
    );
    assert_plain(
        "client in a third namespace, own device",
        &own,
        1,
        "client",
        &srv_a.logs(),
    );

    for p in [&mut srv_a, &mut srv_b, &mut plain_b] {
        p.wait_ok(T);
    }
}

/// Two rootful containers (identity-mapped user namespaces) whose programs
/// run as two different uids, both in the device's group: the group device
/// made by `smclo dev init --group`, bind-mounted into both, is used by
/// both, and the peer credential check passes across the user namespaces.
#[test]
fn containers_of_two_users_share_a_group_device() {
    assert!(is_root(), "this test makes namespaces and needs root");
    let mut env = Env::new("containers-group");
    let g = free_gid();
    let (u, v) = (free_uid(50_000), free_uid(55_000));
    let host = HostDir::group(g);
    let (a, b) = (env.netns("cga"), env.netns("cgb"));
    let n = std::process::id() % 250;
    let (a_ip, b_ip) = (format!("10.195.{n}.1"), format!("10.195.{n}.2"));
    veth(&a, &b, &a_ip, &b_ip);
    let s = script();
    let s = s.to_str().unwrap();
    let k = 3u64;
    let (kk, size, h) = (k.to_string(), SIZE.to_string(), host.0.clone());
    let ful = Container::Rootful;
    let (uu, vv) = (
        User {
            uid: u,
            group: Some(g),
        },
        User {
            uid: v,
            group: Some(g),
        },
    );
    let mut srv = start(
        &mut env,
        "server",
        ful,
        &a,
        uu,
        &h,
        true,
        &[s, "listen", "0.0.0.0", "7104", &kk],
    );
    ready(&mut srv);
    let dev = smclo::device::Device::open(&h).unwrap();
    let s0 = dev.stats();
    let client = start(
        &mut env,
        "client",
        ful,
        &b,
        vv,
        &h,
        true,
        &[s, "client", &a_ip, "7104", &kk, &size],
    );
    let moved = checked(client, &srv.logs());
    srv.wait_ok(T);
    let d = delta(&s0, &dev.stats());
    assert_smc(
        "containers of two users, group device",
        &d,
        k,
        moved,
        moved,
        &srv.logs(),
    );
    assert_eq!(d.conns_opened, k, "{d:?}");
}
