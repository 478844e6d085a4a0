//! `smclo ss` against connections whose numbers the test knows: three SMC-D
//! connections between this process (clients) and a child (server), with
//! known byte counts each way, unread bytes left in two rings, one
//! connection in copy mode and one half-closed; every field of the text
//! and JSON output is checked, the listener with `-l`, the fallbacks with
//! `-a`, and what is left after the server is killed (SIGKILL).

use smclo::api::{SmcListener, SmcStream};
use smclo::config::Config;
use smclo::device::Device;
use smclo_wire::reason::Reason;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};

/// (bytes the server reads, bytes it writes) per connection, in order.
const SERVER_SCRIPT: [(usize, usize); 3] = [(1000, 2000), (3000, 0), (0, 5000)];
const CLIENT_RING: u32 = 64 * 1024;
const SERVER_RING: &str = "32k";

use smclo_testsupport::DevDir as Dir;

use smclo_testsupport::{ChildGuard, CHILD_ENTRY};

fn config(dir: &Path) -> Config {
    let mut c = Config::from_env().unwrap();
    c.device_dir = dir.to_path_buf();
    c
}

/// The server, in a child process (an end never upgrades a connection to
/// its own process): accepts three connections, runs [`SERVER_SCRIPT`] on
/// them, prints `DONE` and holds them until its stdin closes.
#[test]
fn child_entry() {
    let Ok(dir) = std::env::var("SMCLO_SS_TEST_DIR") else {
        return;
    };
    let l = SmcListener::bind_with("127.0.0.1:0", &config(Path::new(&dir))).unwrap();
    println!("PORT={}", l.local_addr().unwrap().port());
    if std::env::var_os("SMCLO_SS_TEST_HOLD").is_some() {
        // Accept one connection and hold it until stdin closes.
        let (s, _) = l.accept().unwrap();
        assert!(s.is_smc(), "server fell back: {:?}", s.fallback_reason());
        println!("DONE");
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return;
    }
    let mut held = Vec::new();
    for (read, write) in SERVER_SCRIPT {
        let (mut s, _) = l.accept().unwrap();
        assert!(s.is_smc(), "server fell back: {:?}", s.fallback_reason());
        let mut buf = vec![0u8; read];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&vec![7u8; write]).unwrap();
        println!("SERVED");
        held.push(s);
    }
    // A plain client: TCP, listed with -a while held.
    let (s, _) = l.accept().unwrap();
    assert_eq!(
        s.fallback_reason(),
        Some(smclo_wire::reason::Reason::PeerNoSmc)
    );
    held.push(s);
    println!("DONE");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// The child's next line that starts with `prefix`, without the prefix
/// (the test harness prints lines of its own).
fn line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the server ended");
        if let Some(rest) = l.trim_end().strip_prefix(prefix) {
            return rest.to_string();
        }
    }
}

fn smclo(dir: &Path, args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_smclo"))
        .args(args)
        .env("SMCLO_DEVICE_DIR", dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "smclo {args:?}: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// What `/proc/<pid>/comm` holds for this test binary: its file name, cut
/// to 15 bytes.
fn program() -> String {
    let exe = std::env::current_exe().unwrap();
    let name = exe.file_name().unwrap().to_str().unwrap();
    name[..name.len().min(15)].to_string()
}

fn pidns(pid: u32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .unwrap()
        .ino()
}

/// One connection end as the test expects `smclo ss` to show it.
struct Expect {
    state: &'static str,
    pid: u32,
    role: &'static str,
    local: SocketAddr,
    peer: SocketAddr,
    copy: bool,
    sent: u64,
    received: u64,
    ring: u32,
    fill: u64,
}

/// The value of `key` in a flat JSON object (no nested objects or commas
/// inside strings, which holds for `smclo ss`'s connection objects).
fn field<'a>(obj: &'a str, key: &str) -> &'a str {
    let pat = format!("\"{key}\":");
    let at = obj
        .find(&pat)
        .unwrap_or_else(|| panic!("{key} missing in {obj}"))
        + pat.len();
    let rest = &obj[at..];
    rest[..rest.find(",\"").unwrap_or(rest.len())].trim_matches('"')
}

#[test]
fn ss_shows_every_field_of_known_connections() {
    let dir = Dir(PathBuf::from(format!(
        "/dev/shm/smclo-test-ss-{}",
        std::process::id()
    )));
    let _ = std::fs::remove_dir_all(&dir.0);
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(CHILD_ENTRY)
            .env("SMCLO_SS_TEST_DIR", &dir.0)
            .env("SMCLO_RMEM", SERVER_RING)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let server_pid = child.0.id();
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let port: u16 = line(&mut out, "PORT=").parse().unwrap();
    let server: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut cfg = config(&dir.0);
    cfg.rmem = CLIENT_RING;
    let dev = Device::open(&dir.0).unwrap();

    let connect = || {
        let s = SmcStream::connect_with(server, &cfg).unwrap();
        assert!(s.is_smc(), "client fell back: {:?}", s.fallback_reason());
        s
    };
    let mut a = connect();
    a.write_all(&[1u8; 1000]).unwrap();
    a.read_exact(&mut [0u8; 2000]).unwrap();
    line(&mut out, "SERVED");
    let mut b = connect();
    b.write_all(&[2u8; 3000]).unwrap();
    line(&mut out, "SERVED");
    // Each end reads the knob when its handshake ends: the server's has
    // ended for b (SERVED), and ends for c before the next SERVED.
    dev.set_dmb_copy(true);
    let mut c = connect();
    c.write_all(&[3u8; 7]).unwrap();
    line(&mut out, "SERVED");
    dev.set_dmb_copy(false);
    let plain_client = std::net::TcpStream::connect(server).unwrap();
    line(&mut out, "DONE");
    a.shutdown(Shutdown::Write).unwrap();

    let me = std::process::id();
    let (la, lb, lc) = (
        a.local_addr().unwrap(),
        b.local_addr().unwrap(),
        c.local_addr().unwrap(),
    );
    let sring = 32 * 1024;
    #[rustfmt::skip]
    let want = [
        Expect { state: "PEERCLOSEWAIT1", pid: me, role: "client", local: la, peer: server, copy: false, sent: 1000, received: 2000, ring: CLIENT_RING, fill: 0 },
        Expect { state: "ACTIVE", pid: me, role: "client", local: lb, peer: server, copy: false, sent: 3000, received: 0, ring: CLIENT_RING, fill: 0 },
        Expect { state: "ACTIVE", pid: me, role: "client", local: lc, peer: server, copy: true, sent: 7, received: 0, ring: CLIENT_RING, fill: 5000 },
        Expect { state: "APPCLOSEWAIT1", pid: server_pid, role: "server", local: server, peer: la, copy: false, sent: 2000, received: 1000, ring: sring, fill: 0 },
        Expect { state: "ACTIVE", pid: server_pid, role: "server", local: server, peer: lb, copy: false, sent: 0, received: 3000, ring: sring, fill: 0 },
        Expect { state: "ACTIVE", pid: server_pid, role: "server", local: server, peer: lc, copy: true, sent: 5000, received: 0, ring: sring, fill: 7 },
    ];
    let prog = program();

    // Text: one row per end, every column.
    let text = smclo(&dir.0, &["ss"]);
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), want.len(), "{text}");
    for w in &want {
        let cols = [
            w.state.to_string(),
            format!("{}/{prog}", w.pid),
            w.role.to_string(),
            w.local.to_string(),
            w.peer.to_string(),
            if w.copy { "SMCD-copy" } else { "SMCD" }.to_string(),
            w.sent.to_string(),
            w.received.to_string(),
            w.ring.to_string(),
            w.fill.to_string(),
        ];
        assert!(
            rows.iter()
                .any(|r| r.split_whitespace().eq(cols.iter().map(String::as_str))),
            "no row {cols:?} in\n{text}"
        );
    }

    // JSON: every field, and the tokens pair the ends.
    let json = smclo(&dir.0, &["ss", "--json"]);
    let body = json
        .trim_end()
        .strip_prefix(&format!(
            "{{\"gid\":\"{:016x}\",\"connections\":[{{",
            dev.gid()
        ))
        .and_then(|s| s.strip_suffix("}]}"))
        .unwrap_or_else(|| panic!("unexpected JSON: {json}"));
    let objs: Vec<&str> = body.split("},{").collect();
    assert_eq!(objs.len(), want.len(), "{json}");
    let mut tokens = Vec::new();
    for w in &want {
        let o = objs
            .iter()
            .find(|o| {
                field(o, "local") == w.local.to_string() && field(o, "peer") == w.peer.to_string()
            })
            .unwrap_or_else(|| panic!("no end {} -> {} in {json}", w.local, w.peer));
        let fields = [
            ("state", w.state.to_string()),
            ("pid", w.pid.to_string()),
            ("pidns", pidns(w.pid).to_string()),
            ("program", prog.clone()),
            ("role", w.role.to_string()),
            (
                "mode",
                if w.copy { "smcd-copy" } else { "smcd" }.to_string(),
            ),
            ("bytes_sent", w.sent.to_string()),
            ("bytes_received", w.received.to_string()),
            ("ring_len", w.ring.to_string()),
            ("ring_fill", w.fill.to_string()),
        ];
        for (k, v) in fields {
            assert_eq!(field(o, k), v, "{k} of {o}");
        }
        tokens.push((
            field(o, "token").to_string(),
            field(o, "peer_token").to_string(),
        ));
    }
    for i in 0..3 {
        let (client, server) = (&tokens[i], &tokens[i + 3]);
        assert_eq!(
            (&client.0, &client.1),
            (&server.1, &server.0),
            "tokens pair the ends"
        );
        assert_eq!(client.0.len(), 16);
    }

    // Listeners.
    let text = smclo(&dir.0, &["ss", "-l"]);
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|r| r.split_whitespace().collect())
        .collect();
    let netns = std::fs::metadata(format!("/proc/{server_pid}/ns/net"))
        .unwrap()
        .ino();
    assert_eq!(
        rows,
        vec![vec![
            "LISTEN",
            &server.to_string(),
            &netns.to_string(),
            &format!("{server_pid}/{prog}")
        ]],
        "{text}"
    );
    let json = smclo(&dir.0, &["ss", "-l", "--json"]);
    assert_eq!(
        json,
        format!(
            "{{\"gid\":\"{:016x}\",\"listeners\":[{{\"state\":\"LISTEN\",\"pid\":{server_pid},\"pidns\":{},\"program\":\"{prog}\",\"local\":\"{server}\",\"netns\":{netns}}}]}}\n",
            dev.gid(),
            pidns(server_pid)
        )
    );

    // -a: the fallbacks, both sides of the native API. A connection to a
    // plain server is not listed (it costs no system call); one to a
    // listener of our own process is (SELF_CONNECT), and so is its
    // accepted end (PEERNOSMC: no proposal came).
    let plain = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let plain_addr = plain.local_addr().unwrap();
    let to_plain = SmcStream::connect_with(plain_addr, &cfg).unwrap();
    assert_eq!(to_plain.fallback_reason(), Some(Reason::PeerNoSmc));
    let own = SmcListener::bind_with("127.0.0.1:0", &cfg).unwrap();
    let own_addr = own.local_addr().unwrap();
    let to_own = SmcStream::connect_with(own_addr, &cfg).unwrap();
    assert_eq!(to_own.fallback_reason(), Some(Reason::SelfConnect));
    let (from_own, _) = own.accept().unwrap();
    assert_eq!(from_own.fallback_reason(), Some(Reason::PeerNoSmc));
    let tcp_rows = |text: &str| -> Vec<Vec<String>> {
        let mut rows: Vec<Vec<String>> = text
            .lines()
            .filter(|l| l.contains("TCP/"))
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect();
        rows.sort();
        rows
    };
    let row = |pid: u32, role: &str, local: SocketAddr, peer: SocketAddr, r: Reason| {
        let p = format!("{pid}/{prog}");
        let mode = format!("TCP/{}", r.name());
        let (l, pe) = (local.to_string(), peer.to_string());
        ["ACTIVE", &p, role, &l, &pe, &mode, "-", "-", "-", "-"]
            .map(str::to_string)
            .to_vec()
    };
    let own_local = to_own.local_addr().unwrap();
    let server_row = row(
        server_pid,
        "server",
        server,
        plain_client.local_addr().unwrap(),
        Reason::PeerNoSmc,
    );
    let own_server_row = row(me, "server", own_addr, own_local, Reason::PeerNoSmc);
    let own_client_row = row(me, "client", own_local, own_addr, Reason::SelfConnect);
    assert!(tcp_rows(&smclo(&dir.0, &["ss"])).is_empty());
    let text = smclo(&dir.0, &["ss", "-a"]);
    assert_eq!(text.lines().count(), 1 + want.len() + 3, "{text}");
    let mut expect = vec![server_row.clone(), own_server_row.clone(), own_client_row];
    expect.sort();
    assert_eq!(tcp_rows(&text), expect, "{text}");
    let json = smclo(&dir.0, &["ss", "-a", "--json"]);
    assert!(json.contains(",\"fallbacks\":[{"), "{json}");
    assert!(
        json.contains(&format!(
            "{{\"state\":\"ACTIVE\",\"pid\":{me},\"pidns\":{},\"program\":\"{prog}\",\"role\":\"client\",\"local\":\"{own_local}\",\"peer\":\"{own_addr}\",\"mode\":\"tcp\",\"reason\":\"SELF_CONNECT\",\"reason_code\":\"0x{:08x}\"}}",
            pidns(me),
            Reason::SelfConnect.code()
        )),
        "{json}"
    );
    // Closed: no longer listed.
    drop(to_own);
    let mut expect = vec![server_row, own_server_row.clone()];
    expect.sort();
    assert_eq!(tcp_rows(&smclo(&dir.0, &["ss", "-a"])), expect);

    // The server killed (SIGKILL): its entries are reclaimed, and each
    // client end sees its peer closed (fill unknown from now on).
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let text = smclo(&dir.0, &["ss"]);
    let mut rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|r| r.split_whitespace().collect())
        .collect();
    rows.sort();
    let p = format!("{me}/{prog}");
    let (las, lbs, lcs, ss_) = (
        la.to_string(),
        lb.to_string(),
        lc.to_string(),
        server.to_string(),
    );
    let ring = CLIENT_RING.to_string();
    let mut expect: Vec<Vec<&str>> = vec![
        vec![
            "APPFINCLOSEWAIT",
            &p,
            "client",
            &las,
            &ss_,
            "SMCD",
            "1000",
            "2000",
            &ring,
            "-",
        ],
        vec![
            "APPCLOSEWAIT1",
            &p,
            "client",
            &lbs,
            &ss_,
            "SMCD",
            "3000",
            "0",
            &ring,
            "-",
        ],
        vec![
            "APPCLOSEWAIT1",
            &p,
            "client",
            &lcs,
            &ss_,
            "SMCD-copy",
            "7",
            "0",
            &ring,
            "-",
        ],
    ];
    expect.sort();
    assert_eq!(rows, expect, "{text}");
    let text = smclo(&dir.0, &["ss", "-l"]);
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|r| r.split_whitespace().collect())
        .collect();
    let my_netns = std::fs::metadata("/proc/self/ns/net")
        .unwrap()
        .ino()
        .to_string();
    assert_eq!(
        rows,
        vec![vec!["LISTEN", &own_addr.to_string(), &my_netns, &p]],
        "only ours is left: {text}"
    );
    assert_eq!(
        tcp_rows(&smclo(&dir.0, &["ss", "-a"])),
        vec![own_server_row]
    );

    drop((a, b, c, plain_client, to_plain, from_own));
}

/// A server in another pid namespace (`unshare --pid`, its own `/proc`) is
/// shown by the pid it has there, its namespace, and no program name: its
/// pid names another process here, whose name must not be shown.
#[test]
fn ss_names_no_program_of_another_pid_namespace() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "creating a pid namespace needs root");
    let dir = Dir(PathBuf::from(format!(
        "/dev/shm/smclo-test-ss-pidns-{}",
        std::process::id()
    )));
    let _ = std::fs::remove_dir_all(&dir.0);
    let mut child = ChildGuard(
        Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .arg(std::env::current_exe().unwrap())
            .args(CHILD_ENTRY)
            .env("SMCLO_SS_TEST_DIR", &dir.0)
            .env("SMCLO_SS_TEST_HOLD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare (util-linux) runs"),
    );
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let port: u16 = line(&mut out, "PORT=").parse().unwrap();
    let server: SocketAddr = ([127, 0, 0, 1], port).into();
    let c = SmcStream::connect_with(server, &config(&dir.0)).unwrap();
    assert!(c.is_smc(), "client fell back: {:?}", c.fallback_reason());
    line(&mut out, "DONE");
    let mine = pidns(std::process::id());

    let json = smclo(&dir.0, &["ss", "--json"]);
    let server_end = format!("\"role\":\"server\",\"local\":\"{server}\"");
    let obj = json
        .split("},{")
        .find(|o| o.contains(&server_end))
        .unwrap_or_else(|| panic!("no server end in {json}"));
    assert_eq!(field(obj, "pid"), "1", "{obj}");
    assert_ne!(field(obj, "pidns"), mine.to_string(), "{obj}");
    assert_eq!(field(obj, "program"), "null", "{obj}");
    let text = smclo(&dir.0, &["ss", "-l"]);
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|r| r.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 1, "{text}");
    assert_eq!(
        (rows[0][1], rows[0][3]),
        (server.to_string().as_str(), "1/?"),
        "{text}"
    );
    drop(c);
    drop(child.0.stdin.take());
}
