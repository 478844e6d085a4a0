//! haproxy in TCP mode between an smclo client and an smclo server: every
//! client connection is two SMC-D connections (client → haproxy, haproxy's
//! non-blocking connect → the server), every byte moved twice through rings.

use smclo_apptests::*;
use std::time::Duration;

#[test]
fn haproxy_tcp_mode_between_smclo_ends() {
    let mut env = Env::new("haproxy");
    let (front, back) = (free_port(), free_port());
    let mut server = start_asyncio_echo(&mut env, "echo-server", back);
    let lo = "127.0.0.1";
    let mut proxy = start_haproxy_tcp(&mut env, None, (lo, front), (lo, back));
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
