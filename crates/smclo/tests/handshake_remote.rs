//! A wildcard smclo listener must not make clients propose to other hosts
//! that use its port. Two network namespaces joined by a veth pair stand for
//! this host (A) and a remote one (B); needs root (`ip netns`). The remote
//! server is a plain socket that keeps the SYN (`TCP_SAVE_SYN`), so the test
//! sees the TTL and DSCP exactly as they arrived.

use smclo::device::Device;
use smclo_testsupport::Peer;
use smclo_wire::reason::Reason;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A network namespace, deleted (with its veth end) when dropped.
struct Netns(String);

impl Netns {
    fn new(label: &str) -> Netns {
        let name = format!("smclo-hr{}-{label}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        ip(&["netns", "add", &name]);
        let ns = Netns(name);
        ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?} failed (needs root)");
}

/// A veth pair between `a` (address `addr_a`) and `b` (`addr_b`), /30.
fn veth(a: &Netns, b: &Netns, addr_a: &str, addr_b: &str) {
    let (ia, ib) = (
        format!("hrA{}", std::process::id()),
        format!("hrB{}", std::process::id()),
    );
    ip(&[
        "link", "add", &ia, "netns", &a.0, "type", "veth", "peer", "name", &ib, "netns", &b.0,
    ]);
    for (ns, dev, addr) in [(a, &ia, addr_a), (b, &ib, addr_b)] {
        ip(&[
            "-n",
            &ns.0,
            "addr",
            "add",
            &format!("{addr}/30"),
            "dev",
            dev,
        ]);
        ip(&["-n", &ns.0, "link", "set", dev, "up"]);
    }
}

/// `smclo-testpeer` in a namespace.
trait InNetns {
    fn spawn(ns: &Netns, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self;
}

impl InNetns for Peer {
    fn spawn(ns: &Netns, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &ns.0, env!("CARGO_BIN_EXE_smclo-testpeer")])
            .args(args)
            .env("SMCLO_DEVICE_DIR", dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::start(cmd)
    }
}

/// A plain server in `ns` on `addr`: accepts `n` connections one after the
/// other, sends each a line, reads the echo, and returns (TTL, DSCP) of the
/// SYN that opened it.
fn plain_server(ns: &Netns, addr: SocketAddr, n: usize) -> std::sync::mpsc::Receiver<(u8, u8)> {
    let path = format!("/run/netns/{}", ns.0);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a descriptor we hold; it moves only this thread
        // (which creates the listener and then ends) into the namespace.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        let l = TcpListener::bind(addr).unwrap();
        smclo::testing::tcp_syn::save_syns(l.as_raw_fd()).unwrap();
        ready_tx.send(()).unwrap();
        for _ in 0..n {
            let (mut s, _) = l.accept().unwrap();
            let syn = smclo::testing::tcp_syn::saved_syn(s.as_raw_fd())
                .unwrap()
                .expect("a saved SYN")
                .unwrap();
            s.write_all(b"plain remote\n").unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            let mut back = String::new();
            s.read_to_string(&mut back).unwrap();
            assert_eq!(back, "plain remote\n");
            tx.send((syn.mark.ttl, syn.mark.dscp)).unwrap();
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("plain server up");
    rx
}

use smclo_testsupport::DevDir as Dir;

#[test]
fn wildcard_listener_does_not_propose_to_remote_hosts() {
    let dir = Dir(PathBuf::from(format!(
        "/dev/shm/smclo-test-hr-{}",
        std::process::id()
    )));
    let (a, b) = (Netns::new("host"), Netns::new("remote"));
    let id = std::process::id() % 250;
    let (addr_a, addr_b) = (format!("10.198.{id}.1"), format!("10.198.{id}.2"));
    veth(&a, &b, &addr_a, &addr_b);
    let port = 7000 + (std::process::id() % 1000) as u16;

    let remote: SocketAddr = format!("{addr_b}:{port}").parse().unwrap();
    let syn = plain_server(&b, remote, 2);
    let mut listener = Peer::spawn(
        &a,
        &dir.0,
        &["serve", &format!("0.0.0.0:{port}"), "sink"],
        &[],
    );
    assert_eq!(listener.line(), format!("listening 0.0.0.0:{port}"));

    // A client on this host connects to the remote host's port: plain TCP,
    // at plain cost (a proposal would wait the 2 s CLC bound for an answer
    // that never comes), with an unmarked SYN.
    let start = Instant::now();
    let mut client = Peer::spawn(
        &a,
        &dir.0,
        &["connect", &remote.to_string(), "echo"],
        &[("SMCLO_CLC_WAIT_MS", "2000")],
    );
    let said = client.line();
    let took = start.elapsed();
    client.wait_ok();
    let (ttl, dscp) = syn
        .recv_timeout(Duration::from_secs(10))
        .expect("the remote server saw the connection");
    println!(
        "remote connect with a wildcard listener on its port: {took:?}, SYN ttl {ttl} dscp {dscp}"
    );
    assert_eq!(said, "smc=0 reason=PEERNOSMC", "{took:?}, ttl {ttl}");
    assert_eq!((ttl, dscp), (64, 0), "the remote host saw a marked SYN");
    assert!(took < Duration::from_secs(1), "connect took {took:?}");

    // A client in the remote namespace shares the device, but the wildcard
    // listener of another namespace says nothing about its destinations: it
    // connects to its own namespace's server as plain TCP, unmarked.
    let start = Instant::now();
    let mut other = Peer::spawn(
        &b,
        &dir.0,
        &["connect", &remote.to_string(), "echo"],
        &[("SMCLO_CLC_WAIT_MS", "2000")],
    );
    let said = other.line();
    let took = start.elapsed();
    other.wait_ok();
    let seen = syn
        .recv_timeout(Duration::from_secs(10))
        .expect("second connection");
    assert_eq!(said, "smc=0 reason=PEERNOSMC", "{took:?}, SYN {seen:?}");
    assert_eq!(seen, (64, 0), "marked SYN from the other namespace");
    assert!(took < Duration::from_secs(1), "connect took {took:?}");
    let dev = Device::open(&dir.0).unwrap();
    assert_eq!(dev.stats().fallback(Reason::Timeout), (0, 0));

    // The same wildcard listener still accelerates a local client.
    let mut local = Peer::spawn(
        &a,
        &dir.0,
        &["connect", &format!("127.0.0.1:{port}"), "source:100000:7"],
        &[],
    );
    assert_eq!(local.line(), "smc=1 reason=-");
    assert_eq!(listener.line(), "smc=1 reason=-");
    local.wait_ok();
    let st = dev.stats();
    assert_eq!(st.conns_opened, 1, "{st:?}");
    assert!(st.xfer_bytes >= 100_000, "{st:?}");
    drop(listener);
}
