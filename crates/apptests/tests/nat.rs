//! Address translation on the way, as container platforms install it on a
//! node: a Kubernetes-style ClusterIP (an iptables DNAT of a virtual
//! address, as kube-proxy's iptables and nftables modes write it), a Docker-style
//! published port (DNAT of the node's own address and port), and a
//! sidecar's capture (an iptables REDIRECT of the application's outbound
//! connection to a local haproxy, which dials the server); redis and
//! redis-benchmark through each, nginx, curl and wrk through a ClusterIP. The server sees
//! the client's own source address and port on each, and the connections
//! are SMC-D: the client announces them in the device, and the server
//! finds the announcement by what it sees (docs/handshake.md, "Connections
//! through address translation"). The negative cases: DNAT to a plain
//! server costs what TCP costs (no wait; its connect latency is measured
//! against plain TCP's), and a MASQUERADE in the path leaves plain TCP with
//! SOURCE_NAT counted on both sides.
//!
//! The layout: a client namespace and a server namespace, each on a veth
//! to a "node" namespace that forwards and holds the translation rules.
//! Needs root (ip netns, iptables); addresses are from 10.199.80.0/22 and
//! the virtual 10.96.77.0/24, on veths that exist only inside the test's
//! namespaces, whose rules go with them.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::fs;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// A ClusterIP-style virtual address: no interface has it.
const CLUSTER_IP: &str = "10.96.77.10";
const CLUSTER_PORT: u16 = 80;
/// The node's address on the client's link, where a published port is;
/// the client's and the server's addresses ([`node`]'s links).
const NODE_IP: &str = "10.199.80.2";
const PUBLISHED_PORT: u16 = 8080;
const CLIENT_IP: &str = "10.199.80.1";
const SERVER_IP: &str = "10.199.81.2";

/// client — node — server, the node forwarding: a [`Routed`] path with
/// one router, its links from 10.199.80.0.
fn node(env: &mut Env) -> Routed {
    let n = Routed::new(env, 1, 80);
    let ips = (n.client_ip(), n.addr(0, 2), n.server_ip());
    assert_eq!(ips, (CLIENT_IP.into(), NODE_IP.into(), SERVER_IP.into()));
    n
}

/// The node's DNAT of `vip:vport` to the server's `port`, as kube-proxy
/// (a ClusterIP) or Docker (a published port) writes it.
fn dnat(n: &Routed, vip: &str, vport: u16, port: u16) {
    let to = format!("{SERVER_IP}:{port}");
    let vport = vport.to_string();
    exec_in(
        n.last_router(),
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "-d",
            vip,
            "--dport",
            &vport,
            "-j",
            "DNAT",
            "--to-destination",
            &to,
        ],
    );
}

/// redis-cli PING, a 256 KiB value read back byte-exact, then
/// redis-benchmark with a connection per request (`requests` of them),
/// all to `to` from namespace `ns` under smclo; every application
/// connection is `legs` SMC-D connections (two through a proxy), none
/// falls back at the client. The value goes in by a redis-cli without
/// smclo: a first write larger than the early bytes (`EARLY_MAX`) before
/// the server answered ends an announcement as TCP (UNANSWERED), where a
/// connection to a plain server must not wait, so the value goes in over
/// TCP and is read back through shared memory. `logs`: the servers.
fn redis_through(
    env: &mut Env,
    ns: &str,
    to: (&str, u16),
    seed: u64,
    requests: u64,
    legs: u64,
    logs: &[&Proc],
) {
    let (host, port) = to;
    let hex = redis_set_value_in(env, Mode::Plain, ns, to, seed);
    let s0 = env.stats();
    redis_ping_in(env, ns, to);
    redis_get_value_in(env, ns, to, &hex);
    let b = redis_benchmark_ping_in(env, ns, to, requests);
    let d = delta(&s0, &env.stats());
    let logs: Vec<String> = logs.iter().map(|p| p.logs()).collect();
    eprintln!(
        "{host}:{port}: {} SMC-D, fallbacks {}",
        d.conns_opened,
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallback_client.iter().sum::<u64>(),
        0,
        "client fallbacks through {host}:{port}: {}\n{}\n{}",
        d.fallbacks_desc(),
        b.logs(),
        logs.join("\n")
    );
    // redis-cli twice, and redis-benchmark's requests of each of its two
    // tests (PING_INLINE, PING_MBULK) each on a connection of its own
    // (-k 0).
    assert!(
        d.conns_opened >= legs * (2 * requests + 2),
        "{} SMC-D connections through {host}:{port}: {}",
        d.conns_opened,
        d.fallbacks_desc()
    );
}

/// A ClusterIP: the client connects to a virtual address that the node
/// translates to the server's; redis and redis-benchmark through it are
/// SMC-D, byte-exact.
#[test]
fn a_clusterip_dnat_is_smcd() {
    let port = 6394;
    redis_behind("nat-clusterip", port, (CLUSTER_IP, CLUSTER_PORT), |_, n| {
        dnat(n, CLUSTER_IP, CLUSTER_PORT, port)
    });
}

/// Client — node — server ([`node`]) with `translate` on the node, a redis
/// server under smclo on `port` in the server's namespace, and
/// [`redis_through`] from the client's to `to`.
fn redis_behind(name: &str, port: u16, to: (&str, u16), translate: impl FnOnce(&Env, &Routed)) {
    let mut env = Env::new(name);
    let n = node(&mut env);
    translate(&env, &n);
    let redis = start_redis_in(&mut env, Mode::Smclo, n.server(), port);
    let cli = n.client().to_string();
    let seed = 0x7a7 + u64::from(port);
    redis_through(&mut env, &cli, to, seed, 2000, 1, &[&redis]);
}

/// The same ClusterIP as kube-proxy's nftables mode writes it: a verdict
/// map from (address, protocol, port) to the service's chain, which picks
/// an endpoint's chain at random (`numgen`), whose rule is the DNAT. A
/// rule file loaded with `nft -f` into the node's namespace.
fn dnat_nft(env: &Env, n: &Routed, vip: &str, vport: u16, port: u16) {
    let rules = format!(
        "table ip kube-proxy {{
  chain nat-prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    jump services
  }}
  map service-ips {{
    type ipv4_addr . inet_proto . inet_service : verdict
    elements = {{ {vip} . tcp . {vport} : goto service-smclo-redis }}
  }}
  chain services {{
    ip daddr . meta l4proto . th dport vmap @service-ips
  }}
  chain service-smclo-redis {{
    numgen random mod 1 vmap {{ 0 : goto endpoint-smclo-redis }}
  }}
  chain endpoint-smclo-redis {{
    meta l4proto tcp dnat to {SERVER_IP}:{port}
  }}
}}
"
    );
    let file = env.path("kube-proxy.nft");
    fs::write(&file, rules).unwrap();
    exec_in(n.last_router(), "nft", &["-f", file.to_str().unwrap()]);
}

/// A ClusterIP in kube-proxy's nftables mode ([`dnat_nft`]): SMC-D,
/// byte-exact, as through iptables' DNAT.
#[test]
fn a_clusterip_in_nftables_mode_is_smcd() {
    let (port, vip) = (6391, "10.96.77.30");
    redis_behind("nat-nftables", port, (vip, CLUSTER_PORT), |env, n| {
        dnat_nft(env, n, vip, CLUSTER_PORT, port)
    });
}

/// A published port: the client connects to the node's own address and a
/// port the node translates to the server's (Docker's `-p 8080:6395`).
#[test]
fn a_published_port_is_smcd() {
    let port = 6395;
    redis_behind("nat-published", port, (NODE_IP, PUBLISHED_PORT), |_, n| {
        dnat(n, NODE_IP, PUBLISHED_PORT, port)
    });
}

/// A sidecar: in the client's namespace an iptables REDIRECT sends the
/// application's connections to a virtual service address to a local
/// haproxy in TCP mode (as Istio and Linkerd capture outbound traffic),
/// which dials the server by its own address. Both hops are SMC-D: the
/// application's by its announcement, haproxy's by the server's
/// registration.
#[test]
fn a_sidecar_redirect_is_smcd() {
    let mut env = Env::new("nat-sidecar");
    let n = node(&mut env);
    let (port, sidecar) = (6396, 15001);
    let service = "10.96.77.20";
    let redis = start_redis_in(&mut env, Mode::Smclo, n.server(), port);
    let (front, back) = (("0.0.0.0", sidecar), (SERVER_IP, port));
    // haproxy's connections to redis, one per application connection,
    // each carry one request: every one proposes, as the application's
    // (redis_benchmark_ping_in), since their handshakes are what is tested.
    env.extra_env.push(("SMCLO_SHORT".into(), "smc".into()));
    let proxy = start_haproxy_tcp(&mut env, Some(n.client()), front, back);
    let to = sidecar.to_string();
    exec_in(
        n.client(),
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            service,
            "--dport",
            "6379",
            "-j",
            "REDIRECT",
            "--to-ports",
            &to,
        ],
    );
    let cli = n.client().to_string();
    // Each application connection is two SMC-D connections (application
    // → haproxy, haproxy → redis).
    let logs = [&proxy, &redis];
    redis_through(&mut env, &cli, (service, 6379), 0x51de, 500, 2, &logs);
}

/// `connect_rtt`'s medians: (connect, whole connection) in µs.
fn rtt(env: &mut Env, mode: Mode, prog: &str, ns: &str, host: &str, port: u16) -> (f64, f64) {
    let port_s = port.to_string();
    let cmd = env.command(mode, Some(ns), prog, &[host, &port_s, "400"]);
    let mut p = env.spawn_cmd("connect_rtt", cmd);
    p.wait_ok(T);
    let out = p.stdout_str();
    let f: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(f.len(), 4, "connect_rtt said {out:?}\n{}", p.logs());
    eprintln!("{mode:?}: {out}");
    (f[0], f[2])
}

/// DNAT to a plain server (not under smclo) while the device has an smclo
/// listener elsewhere: the client announces every connection and goes on
/// over TCP without waiting; each ends UNANSWERED at its first read of
/// the server's reply. Connect and whole-connection latency against plain
/// TCP's on the same path, alternated, best of three rounds each.
#[test]
fn dnat_to_a_plain_server_costs_what_tcp_costs() {
    let mut env = Env::new("nat-plain");
    let n = node(&mut env);
    let (plain, smc) = (6397, 6398);
    dnat(&n, CLUSTER_IP, CLUSTER_PORT, plain);
    let _plain = start_redis_in(&mut env, Mode::Plain, n.server(), plain);
    // A registered listener: the device has listeners, so the client
    // announces.
    let _smc = start_redis_in(&mut env, Mode::Smclo, n.server(), smc);
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nat/connect_rtt.c");
    let prog = compile_c(&env, &src, &[]).display().to_string();
    let cli = n.client().to_string();
    let s0 = env.stats();
    let (mut tcp, mut ours) = ((f64::MAX, f64::MAX), (f64::MAX, f64::MAX));
    for _ in 0..3 {
        let t = rtt(&mut env, Mode::Plain, &prog, &cli, CLUSTER_IP, CLUSTER_PORT);
        let s = rtt(&mut env, Mode::Smclo, &prog, &cli, CLUSTER_IP, CLUSTER_PORT);
        tcp = (tcp.0.min(t.0), tcp.1.min(t.1));
        ours = (ours.0.min(s.0), ours.1.min(s.1));
    }
    let d = delta(&s0, &env.stats());
    eprintln!(
        "connect µs (median, best of 3): TCP {:.1}, smclo {:.1}; whole connection: TCP {:.1}, smclo {:.1}; {}",
        tcp.0,
        ours.0,
        tcp.1,
        ours.1,
        d.fallbacks_desc()
    );
    assert_eq!(d.conns_opened, 0);
    assert_eq!(
        d.fallback(Reason::Unanswered),
        (1200, 0),
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallbacks(), 1200, "{}", d.fallbacks_desc());
    // No wait: a wait for the server (SMCLO_CLC_WAIT_MS, or a look at the
    // TCP socket after 5 ms) would be milliseconds per connection.
    assert!(
        ours.0 < tcp.0 * 1.5 + 30.0 && ours.1 < tcp.1 * 1.5 + 60.0,
        "smclo's connections cost more than TCP's: connect {:.1} µs vs {:.1}, whole {:.1} vs {:.1}",
        ours.0,
        tcp.0,
        ours.1,
        tcp.1
    );
}

/// `connect_rtt`'s system calls for `n` connections in `mode` (name →
/// calls), counted by `strace -f -c`.
fn traced_rtt(env: &mut Env, mode: Mode, prog: &str, ns: &str, n: u32) -> HashMap<String, f64> {
    let out = env.path(&format!("strace-{mode:?}-{n}.txt"));
    let out_s = out.display().to_string();
    let port_s = CLUSTER_PORT.to_string();
    let n_s = n.to_string();
    let args = ["-f", "-c", "-o", &out_s, prog, CLUSTER_IP, &port_s, &n_s];
    let cmd = env.command(mode, Some(ns), "strace", &args);
    let mut p = env.spawn_cmd("strace", cmd);
    p.wait_ok(T);
    let report = fs::read_to_string(&out).unwrap_or_default();
    // Rows: % time, seconds, usecs/call, calls, [errors,] syscall.
    let calls: HashMap<String, f64> = report
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() >= 5 && f[0].starts_with(|c: char| c.is_ascii_digit()))
        .filter(|f| f[f.len() - 1] != "total")
        .filter_map(|f| Some((f[f.len() - 1].to_string(), f[3].parse().ok()?)))
        .collect();
    assert!(
        calls.contains_key("connect"),
        "no strace summary:\n{report}\n{}",
        p.logs()
    );
    calls
}

/// System calls per connection of `connect_rtt` in `mode`: the counts of
/// a run of 2 × `n` connections less those of a run of `n`, so that the
/// start-up cancels out.
fn calls_per_conn(env: &mut Env, mode: Mode, prog: &str, ns: &str, n: u32) -> HashMap<String, f64> {
    let short = traced_rtt(env, mode, prog, ns, n);
    let long = traced_rtt(env, mode, prog, ns, 2 * n);
    long.iter()
        .map(|(k, v)| (k.clone(), (v - short.get(k).unwrap_or(&0.0)) / f64::from(n)))
        .filter(|(_, v)| v.abs() > 0.01)
        .collect()
}

/// An announced connection to a plain server through DNAT makes, beside
/// TCP's own calls, only `getsockname` and `getsockopt(TCP_TIMESTAMP)`
/// (its port and TSvals, published after `connect`: the server's proof)
/// and, at its first read, one `fcntl` (blocking or not) and one `poll`
/// (the socket with the handshake's descriptor), which also decides
/// UNANSWERED: no `recv(MSG_PEEK)`, no second `poll`, and neither the
/// caller check's `geteuid` nor the descriptor budget's `prlimit64` of a
/// proposal (trusted a while): 4 in all (the bound leaves room for those
/// checks' renewals and the batched `getrandom`). Before, 8: beside the
/// proof and the read's `poll`, an `fcntl` at `connect`, a `poll` at the
/// write, a `recv(MSG_PEEK)`, `geteuid` and `prlimit64`. Counted with
/// strace. No DMB is registered for an announcement no server answers
/// (its registration's periodic sweep of the device directory once showed
/// here too, as `statx` and `getdents64`).
#[test]
fn an_announcement_to_a_plain_server_makes_few_system_calls() {
    let mut env = Env::new("nat-calls");
    let n = node(&mut env);
    let plain = 6396;
    dnat(&n, CLUSTER_IP, CLUSTER_PORT, plain);
    let _plain = start_redis_in(&mut env, Mode::Plain, n.server(), plain);
    let _smc = start_redis_in(&mut env, Mode::Smclo, n.server(), plain + 1);
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nat/connect_rtt.c");
    let prog = compile_c(&env, &src, &[]).display().to_string();
    let cli = n.client().to_string();
    let s0 = env.stats();
    let tcp = calls_per_conn(&mut env, Mode::Plain, &prog, &cli, 100);
    let ours = calls_per_conn(&mut env, Mode::Smclo, &prog, &cli, 100);
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.fallback(Reason::Unanswered),
        (300, 0),
        "{}",
        d.fallbacks_desc()
    );
    // No DMB for an announcement no server answered: it is registered
    // when one does.
    assert_eq!(
        d.dmbs_registered, 0,
        "DMBs registered for 300 unanswered announcements"
    );
    let per = |m: &HashMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
    let total = |m: &HashMap<String, f64>| m.values().sum::<f64>();
    let extra = total(&ours) - total(&tcp);
    eprintln!("per connection: TCP {tcp:?}; announced {ours:?}; {extra:.2} more");
    assert!(
        per(&ours, "recvfrom") < 0.05,
        "recv(MSG_PEEK) per announced connection: {ours:?}"
    );
    assert!(
        per(&ours, "poll") < 1.05,
        "polls per announced connection: {ours:?}"
    );
    assert!(
        per(&ours, "fcntl") < 1.05,
        "fcntls per announced connection: {ours:?}"
    );
    for trusted in ["geteuid", "prlimit64"] {
        assert!(
            per(&ours, trusted) < 0.05,
            "{trusted} per announced connection: {ours:?}"
        );
    }
    assert!(
        extra < 4.5,
        "{extra:.2} system calls per announced connection beyond TCP's: {ours:?} vs {tcp:?}"
    );
}

/// `SMCLO_ANNOUNCE` limits announcements to the networks it names: a
/// ClusterIP within them is SMC-D; with a list that leaves it out, or
/// `off`, the client announces nothing and the connection is plain TCP
/// (PEERNOSMC at both ends, as for a destination without a listener;
/// nothing UNANSWERED). Under load the server's bounded look for an
/// announcement may end before the client published its port (the
/// connection is then TCP, UNANSWERED at the client and PEERNOSMC at the
/// server): an announcing setting gets up to 5 connections to show one
/// SMC-D, and every other must be that miss.
#[test]
fn smclo_announce_limits_announcements_to_its_networks() {
    let mut env = Env::new("nat-announce");
    let n = node(&mut env);
    let port = 6393;
    dnat(&n, CLUSTER_IP, CLUSTER_PORT, port);
    let _redis = start_redis_in(&mut env, Mode::Smclo, n.server(), port);
    let cli = n.client().to_string();
    for (announce, smcd) in [
        ("10.96.0.0/12", true),
        ("192.0.2.0/24,fd00::/8", false),
        ("off", false),
        (&format!("{CLIENT_IP},{CLUSTER_IP}")[..], true),
    ] {
        env.extra_env = vec![("SMCLO_ANNOUNCE".into(), announce.into())];
        let s0 = env.stats();
        let tries = if smcd { 5 } else { 1 };
        for _ in 0..tries {
            redis_ping_in(&mut env, &cli, (CLUSTER_IP, CLUSTER_PORT));
            if delta(&s0, &env.stats()).conns_opened > 0 {
                break;
            }
        }
        let d = delta(&s0, &env.stats());
        let what = format!("SMCLO_ANNOUNCE={announce}: {}", d.fallbacks_desc());
        if smcd {
            assert_eq!(d.conns_opened, 1, "{what}");
            let (missed, unmatched) = (
                d.fallback(Reason::Unanswered).0,
                d.fallback(Reason::PeerNoSmc).1,
            );
            assert_eq!(
                (missed, unmatched),
                (d.fallbacks() / 2, d.fallbacks() / 2),
                "{what}"
            );
            assert_eq!(missed + unmatched, d.fallbacks(), "{what}");
        } else {
            assert_eq!(d.conns_opened, 0, "{what}");
            // The server found no announcement for the SYN either.
            assert_eq!(d.fallback(Reason::PeerNoSmc), (1, 1), "{what}");
            assert_eq!(d.fallbacks(), 2, "{what}");
        }
    }
}

/// The node masquerades what it forwards to the server (kube-proxy's
/// `--masquerade-all`, or a hairpin): the server sees the node's address,
/// finds the client's announcement by its TCP timestamp from another
/// source, and declines it; the connection is plain TCP with SOURCE_NAT
/// counted on both sides, and nobody waits.
#[test]
fn snat_in_the_path_stays_tcp_with_its_reason() {
    let mut env = Env::new("nat-snat");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "30000".into()));
    let n = node(&mut env);
    let port = 6399;
    dnat(&n, CLUSTER_IP, CLUSTER_PORT, port);
    exec_in(
        n.last_router(),
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-d",
            SERVER_IP,
            "-j",
            "MASQUERADE",
        ],
    );
    let _redis = start_redis_in(&mut env, Mode::Smclo, n.server(), port);
    let cli = n.client().to_string();
    let s0 = env.stats();
    // Until three are counted SOURCE_NAT. Under load the server's short
    // look for an announcement not yet published may end first: that
    // connection is TCP too, counted UNANSWERED (client) and PEERNOSMC
    // (server), and another is made.
    let mut made = 0;
    let d = loop {
        let took = redis_ping_in(&mut env, &cli, (CLUSTER_IP, CLUSTER_PORT));
        assert!(
            took < Duration::from_secs(10),
            "a connection through source NAT took {took:?}: someone waited"
        );
        made += 1;
        let d = delta(&s0, &env.stats());
        if d.fallback(Reason::SourceNat).0 >= 3 || made == 10 {
            break d;
        }
    };
    assert_eq!(d.conns_opened, 0);
    assert_eq!(
        d.fallback(Reason::SourceNat),
        (3, 3),
        "{made} connections: {}",
        d.fallbacks_desc()
    );
    let (unanswered, plain) = (
        d.fallback(Reason::Unanswered),
        d.fallback(Reason::PeerNoSmc),
    );
    assert_eq!(
        (unanswered.0, plain.1),
        (made - 3, made - 3),
        "{made} connections: {}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallbacks(), 2 * made, "{}", d.fallbacks_desc());
}

/// nginx (a master and two workers, under `smclo run`) behind a ClusterIP:
/// curl fetches a file through the translation byte-exact over SMC-D, and
/// wrk's keep-alive connections (each response's status and length
/// checked) are SMC-D.
#[test]
fn nginx_and_wrk_through_a_clusterip_are_smcd() {
    let mut env = Env::new("nat-nginx");
    let n = node(&mut env);
    let port = 8090;
    dnat(&n, CLUSTER_IP, CLUSTER_PORT, port);
    let root = env.path("www");
    fs::create_dir_all(&root).unwrap();
    let body = pseudo_random(100_000, 0x6e67);
    fs::write(root.join("f.bin"), &body).unwrap();
    fs::write(root.join("small.txt"), vec![b'x'; 612]).unwrap();
    let listen = format!("0.0.0.0:{port}");
    let srv = n.server().to_string();
    let nginx = start_nginx(&mut env, Mode::Smclo, Some(&srv), &listen, &root, "a");
    let cli = n.client().to_string();
    let url = format!("http://{CLUSTER_IP}:{CLUSTER_PORT}");
    let s0 = env.stats();
    let (got, _) = curl(
        &mut env,
        Mode::Smclo,
        Some(&cli),
        "curl",
        &[format!("{url}/f.bin")],
    );
    assert!(
        got[0] == body,
        "the file came back changed ({} bytes)",
        got[0].len()
    );
    let d = delta(&s0, &env.stats());
    assert_eq!(
        (d.conns_opened, d.fallbacks()),
        (1, 0),
        "curl through the ClusterIP: {}",
        d.fallbacks_desc()
    );
    let script = wrk_check_script(&env, "wrk", 612);
    let s1 = env.stats();
    let args = ["-t", "2", "-c", "8", "-d", "2s"];
    let small = format!("{url}/small.txt");
    let (p, w) = wrk(
        &mut env,
        Mode::Smclo,
        Some(&cli),
        "wrk",
        &args,
        &script,
        &small,
    );
    assert!(
        w.reqs > 0 && w.bad == 0 && w.checked >= w.reqs && w.errs.is_none(),
        "wrk through the ClusterIP: {}",
        p.logs()
    );
    // nginx's log holds curl's request too.
    let (_, logged_n, _) = nginx_log_bytes(&env, "a");
    assert!(
        logged_n > w.reqs,
        "nginx logged {logged_n} requests for wrk's {}",
        w.reqs
    );
    let d = delta(&s1, &env.stats());
    let desc = format!("{}\n{}", d.fallbacks_desc(), nginx.logs());
    assert_eq!(d.conns_opened, 8, "wrk through the ClusterIP: {desc}");
    assert_eq!(d.fallback_client.iter().sum::<u64>(), 0, "{desc}");
    // A connection wrk closes before it writes (it may try the address
    // first) withdraws its announcement: nginx counts it PEERNOSMC if the
    // withdrawal came before it looked, TIMEOUT (the client gave up) if it
    // had begun to answer; nothing else.
    let withdrawn = d.fallback(Reason::PeerNoSmc).1 + d.fallback(Reason::Timeout).1;
    assert!(d.fallbacks() == withdrawn && d.fallbacks() <= 2, "{desc}");
}
