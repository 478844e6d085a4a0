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
//! 10.199.60.0/22 ([`Routed`] from link 60), on veths that exist only
//! inside the test's namespaces.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// One and two routing hops: every connection is SMC-D (none falls back,
/// none waits for a proposal the server cannot see), and a 256 KiB value
/// comes back byte-exact.
fn through_hops(routers: usize) {
    let mut env = Env::new(&format!("routed-{routers}"));
    let path = Routed::new(&mut env, routers, 60);
    let port = 6391;
    let redis = start_redis_in(&mut env, Mode::Smclo, path.server(), port);
    let (client, host) = (path.client().to_string(), path.server_ip());
    let to = (&host[..], port);
    let s0 = env.stats();
    redis_ping_in(&mut env, &client, to);
    let seed = 0x5eed + routers as u64;
    let hex = redis_set_value_in(&mut env, Mode::Smclo, &client, to, seed);
    redis_get_value_in(&mut env, &client, to, &hex);
    let b = redis_benchmark_ping_in(&mut env, &client, to, 2000);
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
    // redis-cli three times, and redis-benchmark's 2000 requests of each
    // of its two tests each on a connection of its own (-k 0).
    assert!(
        d.conns_opened >= 2 * 2000 + 3,
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
    let path = Routed::new(&mut env, 1, 60);
    let mut ipt = vec!["-t", "mangle", "-A", "FORWARD", "-p", "tcp", "--syn", "-j"];
    ipt.extend_from_slice(rule);
    exec_in(path.last_router(), "iptables", &ipt);
    let port = 6392;
    let _redis = start_redis_in(&mut env, Mode::Smclo, path.server(), port);
    let (client, host) = (path.client().to_string(), path.server_ip());
    let s0 = env.stats();
    for _ in 0..3 {
        let took = redis_ping_in(&mut env, &client, (&host, port));
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
