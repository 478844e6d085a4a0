//! haproxy in TCP mode between an smclo client and an smclo server: every
//! client connection is two SMC-D connections (client → haproxy, haproxy's
//! non-blocking connect → the server), every byte moved twice through rings;
//! with haproxy's copies through its buffers, and with `option
//! splice-request` and `splice-response`, where it moves the frames (up to
//! 300 kB) between the connections with `splice(2)` through pipes.

use smclo_apptests::*;
use std::time::Duration;

/// The asyncio echo pair through haproxy with `options`, byte-checked by
/// the client; every connection SMC-D on both hops, per the counters.
fn echo_through_haproxy(name: &str, options: &[&str]) {
    let mut env = Env::new(name);
    let (front, back) = (free_port(), free_port());
    let mut server = start_asyncio_echo(&mut env, "echo-server", back);
    let lo = "127.0.0.1";
    let mut proxy = start_haproxy_tcp_with(&mut env, None, (lo, front), (lo, back), options);
    let s0 = env.stats();
    let conns = 8u64;
    let run = (conns, 20, 3);
    let (sent, received) = asyncio_echo_client(&mut env, "echo-client", front, run, &[&proxy]);
    let d = delta(&s0, &env.stats());
    let both = 2 * (sent + received);
    assert_smc(
        "client -> haproxy -> server",
        &d,
        2 * conns,
        both,
        both,
        &format!("{}\n{}", proxy.logs(), server.logs()),
    );
    proxy.stop(Duration::from_secs(5));
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
}

#[test]
fn haproxy_tcp_mode_between_smclo_ends() {
    echo_through_haproxy("haproxy", &[]);
}

/// haproxy splices between its two SMC-D connections. Each side of a
/// splice is a connection and a pipe; smclo refused them (EOPNOTSUPP),
/// which haproxy takes for a broken connection.
#[test]
fn haproxy_splicing_between_smclo_ends() {
    echo_through_haproxy(
        "haproxy-splice",
        &["option splice-request", "option splice-response"],
    );
}
