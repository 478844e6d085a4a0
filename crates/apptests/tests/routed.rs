//! Routed paths: a client and a server in network namespaces joined
//! through one or two forwarding namespaces, the layout of routed container
//! networks (each pod on a veth, the node routing between them), where
//! every hop decrements the SYN's TTL. redis-server under `smclo run`
//! listens on the wildcard in one end namespace; redis-cli and
//! redis-benchmark under `smclo run` in the other. Then a mark changed on
//! the way (an iptables rule in the forwarding namespace rewrites the SYN's
//! TTL or DSCP): the server cannot match the proposal, says so at once,
//! and the connection goes on over TCP without waiting for the client's
//! timeout. Needs root (ip netns, iptables); addresses are from
//! 10.199.60.0/22, on veths that exist only inside the test's namespaces.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::fs::{self, File};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// The namespaces of a routed path, client's first, server's last, and
/// the server's address.
struct Path {
    hops: Vec<Netns>,
    server_ip: String,
}

impl Path {
    fn client(&self) -> &str {
        &self.hops[0].name
    }
    fn server(&self) -> &str {
        &self.hops[self.hops.len() - 1].name
    }
    /// The forwarding namespace next to the server.
    fn last_router(&self) -> &str {
        &self.hops[self.hops.len() - 2].name
    }
}

/// Client — `routers` forwarding namespaces — server, each link a veth
/// with a /30 of 10.199.(60 + link).0, default routes towards the middle.
fn routed(env: &mut Env, routers: usize) -> Path {
    let mut hops = vec![env.netns("cli")];
    for r in 0..routers {
        hops.push(env.netns(&format!("r{r}")));
    }
    hops.push(env.netns("srv"));
    let addr = |link: usize, end: u8| format!("10.199.{}.{end}", 60 + link);
    for link in 0..hops.len() - 1 {
        veth(&hops[link], &hops[link + 1], &addr(link, 1), &addr(link, 2));
    }
    let last = hops.len() - 1;
    ip_in(
        &hops[0].name,
        &["route", "add", "default", "via", &addr(0, 2)],
    );
    ip_in(
        &hops[last].name,
        &["route", "add", "default", "via", &addr(last - 1, 1)],
    );
    // Each router forwards, and reaches the links beyond its neighbours
    // through them.
    for (r, router) in hops.iter().enumerate().take(last).skip(1) {
        exec_in(&router.name, "sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        for link in 0..last {
            let via = if link + 1 < r {
                addr(r - 1, 1)
            } else if link > r {
                addr(r, 2)
            } else {
                continue;
            };
            let net = format!("{}/30", addr(link, 0));
            ip_in(&router.name, &["route", "add", &net, "via", &via]);
        }
    }
    Path {
        server_ip: addr(last - 1, 2),
        hops,
    }
}

fn start_redis_in(env: &mut Env, ns: &str, port: u16) -> Proc {
    let port_s = port.to_string();
    let args = [
        "--port",
        &port_s,
        "--bind",
        "0.0.0.0",
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ];
    let cmd = env.command(Mode::Smclo, Some(ns), "redis-server", &args);
    let mut p = env.spawn_cmd("redis-server", cmd);
    wait_listen(&mut p, port);
    p
}

/// redis-cli under `smclo run` in `ns`; its output, and how long it took.
fn redis_cli(
    env: &mut Env,
    ns: &str,
    host: &str,
    port: u16,
    args: &[&str],
    stdin: Option<&std::path::Path>,
) -> (String, Duration) {
    let port_s = port.to_string();
    let mut a = vec!["-h", host, "-p", &port_s];
    a.extend_from_slice(args);
    let mut cmd = env.command(Mode::Smclo, Some(ns), "redis-cli", &a);
    if let Some(f) = stdin {
        cmd.stdin(File::open(f).unwrap());
    }
    let t0 = Instant::now();
    let mut p = env.spawn_cmd("redis-cli", cmd);
    p.wait_ok(T);
    (p.stdout_str(), t0.elapsed())
}

/// One and two routing hops: every connection is SMC-D (none falls back,
/// none waits for a proposal the server cannot see), and a 256 KiB value
/// comes back byte-exact.
fn through_hops(routers: usize) {
    let mut env = Env::new(&format!("routed-{routers}"));
    let path = routed(&mut env, routers);
    let port = 6391;
    let redis = start_redis_in(&mut env, path.server(), port);
    let (client, host) = (path.client().to_string(), path.server_ip.clone());
    let s0 = env.stats();
    let (pong, _) = redis_cli(&mut env, &client, &host, port, &["ping"], None);
    assert_eq!(pong.trim(), "PONG");
    let value = pseudo_random(256 << 10, 0x5eed + routers as u64);
    let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
    let file = env.path("value");
    fs::write(&file, &hex).unwrap();
    let (ok, _) = redis_cli(
        &mut env,
        &client,
        &host,
        port,
        &["-x", "set", "v"],
        Some(&file),
    );
    assert_eq!(ok.trim(), "OK");
    let (back, _) = redis_cli(&mut env, &client, &host, port, &["get", "v"], None);
    assert!(
        back.trim_end() == hex,
        "the value came back changed ({} bytes for {})",
        back.len(),
        hex.len()
    );
    let port_s = port.to_string();
    let bench = [
        "-h", &host, "-p", &port_s, "-n", "2000", "-c", "4", "-k", "0", "-t", "ping", "-q",
    ];
    let cmd = env.command(Mode::Smclo, Some(&client), "redis-benchmark", &bench);
    let mut b = env.spawn_cmd("redis-benchmark", cmd);
    b.wait_ok(T);
    let s1 = env.stats();
    let d = delta(&s0, &s1);
    let client_fallbacks: u64 = d.fallback_client.iter().sum();
    let logs = || {
        let ours = |p: &Proc| {
            let e = p.stderr_str();
            let v: Vec<&str> = e.lines().filter(|l| !l.contains(": SMC-D (")).collect();
            v.join("\n")
        };
        format!("{}\n{}", ours(&redis), ours(&b))
    };
    assert_eq!(
        client_fallbacks,
        0,
        "client fallbacks across {routers} hop(s): {}\n{}",
        d.fallbacks_desc(),
        logs()
    );
    // redis-benchmark ends each of its two tests (`-t ping` is PING_INLINE
    // and PING_MBULK) with its last connections' handshakes under way
    // (-c 4), and may close its first connection (CONFIG GET) likewise:
    // their server finds the proposals withdrawn: none for its SYN
    // (PEERNOSMC), or only another connection's under the same key
    // (MARK_MISMATCH).
    let server_fallbacks: u64 = d.fallback_server.iter().sum();
    let withdrawn = d.fallback(Reason::PeerNoSmc).1 + d.fallback(Reason::MarkMismatch).1;
    assert_eq!(
        server_fallbacks,
        withdrawn,
        "server fallbacks other than withdrawn proposals across {routers} hop(s): {}",
        d.fallbacks_desc()
    );
    assert!(
        server_fallbacks <= 2 * 4 + 1,
        "server fallbacks across {routers} hop(s): {}\n{}",
        d.fallbacks_desc(),
        logs()
    );
    // redis-cli three times, and redis-benchmark's 2000 requests each on
    // a connection of its own (-k 0).
    assert!(
        d.conns_opened >= 2003,
        "{} SMC-D connections across {routers} hop(s)",
        d.conns_opened
    );
}

#[test]
fn one_routing_hop_is_smcd() {
    through_hops(1);
}

#[test]
fn two_routing_hops_are_smcd() {
    through_hops(2);
}

/// A rule in the forwarding namespace rewrites the SYN's mark (`rule`, an
/// iptables mangle target): the server finds the client's proposal by its
/// addresses and port, sees a mark that does not fit and declines at once.
/// The client would wait 30 s for an answer (SMCLO_CLC_WAIT_MS); it goes on
/// over TCP as soon as the decline arrives.
fn changed_mark(label: &str, rule: &[&str]) {
    let mut env = Env::new(&format!("routed-{label}"));
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "30000".into()));
    let path = routed(&mut env, 1);
    let mut ipt = vec!["-t", "mangle", "-A", "FORWARD", "-p", "tcp", "--syn", "-j"];
    ipt.extend_from_slice(rule);
    exec_in(path.last_router(), "iptables", &ipt);
    let port = 6392;
    let _redis = start_redis_in(&mut env, path.server(), port);
    let (client, host) = (path.client().to_string(), path.server_ip.clone());
    let s0 = env.stats();
    for _ in 0..3 {
        let (pong, took) = redis_cli(&mut env, &client, &host, port, &["ping"], None);
        assert_eq!(pong.trim(), "PONG");
        assert!(
            took < Duration::from_secs(10),
            "a connection with a changed mark took {took:?}: the client waited for the server"
        );
    }
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, 0);
    assert_eq!(
        d.fallback(Reason::MarkMismatch).1,
        3,
        "{}",
        d.fallbacks_desc()
    );
    assert_eq!(d.fallback(Reason::Timeout).0, 0, "{}", d.fallbacks_desc());
}

#[test]
fn a_rewritten_ttl_declines_at_once() {
    changed_mark("ttl", &["TTL", "--ttl-set", "64"]);
}

#[test]
fn a_rewritten_dscp_declines_at_once() {
    changed_mark("dscp", &["DSCP", "--set-dscp", "0"]);
}

/// A plain server that speaks first at an address an smclo listener of
/// another network namespace also has: the client's proposal reaches no
/// server that could answer or decline it, and the server's greeting over
/// TCP decides at once (the client would wait 30 s, SMCLO_CLC_WAIT_MS).
#[test]
fn a_server_that_speaks_first_over_tcp_decides_at_once() {
    let mut env = Env::new("routed-speaks");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "30000".into()));
    let (a, b) = (env.netns("smc"), env.netns("plain"));
    let addr = "10.199.70.1";
    for ns in [&a.name, &b.name] {
        ip_in(ns, &["link", "set", "lo", "up"]);
        ip_in(ns, &["addr", "add", &format!("{addr}/32"), "dev", "lo"]);
    }
    let port = 6393;
    let port_s = port.to_string();
    // The smclo listener in A registers the exact address.
    let args = [
        "--port",
        &port_s,
        "--bind",
        addr,
        "--save",
        "",
        "--appendonly",
        "no",
    ];
    let cmd = env.command(Mode::Smclo, Some(&a.name), "redis-server", &args);
    let mut redis = env.spawn_cmd("redis-server", cmd);
    wait_listen(&mut redis, port);
    // In B, a plain server on the same address and port greets first.
    let listen = format!("TCP-LISTEN:{port},bind={addr},reuseaddr,fork");
    let cmd = env.command(
        Mode::Plain,
        Some(&b.name),
        "socat",
        &[&listen, "SYSTEM:echo 220 hello"],
    );
    let mut greeter = env.spawn_cmd("greeter", cmd);
    wait_listen(&mut greeter, port);
    let s0 = env.stats();
    let target = format!("TCP:{addr}:{port}");
    for _ in 0..3 {
        let cmd = env.command(
            Mode::Smclo,
            Some(&b.name),
            "socat",
            &["-u", &target, "STDOUT"],
        );
        let t0 = Instant::now();
        let mut c = env.spawn_cmd("client", cmd);
        c.wait_ok(T);
        let took = t0.elapsed();
        assert_eq!(c.stdout_str().trim(), "220 hello");
        assert!(
            took < Duration::from_secs(10),
            "the client waited {took:?} for an answer after the server's greeting"
        );
    }
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, 0);
    assert_eq!(d.fallback(Reason::PeerNoSmc).0, 3, "{}", d.fallbacks_desc());
}
