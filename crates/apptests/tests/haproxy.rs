//! haproxy in TCP mode between an smclo client and an smclo server: every
//! client connection is two SMC-D connections (client → haproxy, haproxy's
//! non-blocking connect → the server), every byte moved twice through rings.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn haproxy_tcp_mode_between_smclo_ends() {
    let mut env = Env::new("haproxy");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/asyncio_echo.py");
    let script = script.to_str().unwrap();
    let (front, back) = (free_port(), free_port());
    let bs = back.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "echo-server",
        "python3",
        &[script, "server", &bs],
    );
    wait_listen(&mut server, back);
    let lo = "127.0.0.1";
    let mut proxy = start_haproxy_tcp(&mut env, None, (lo, front), (lo, back));
    let s0 = env.stats();
    let conns = 8u64;
    let client = env.run(
        Mode::Smclo,
        "echo-client",
        "python3",
        &[
            script,
            "client",
            &front.to_string(),
            &conns.to_string(),
            "20",
            "3",
        ],
        Duration::from_secs(120),
    );
    let [sent, received] = ok_numbers(&client, &proxy.logs())[..] else {
        panic!("asyncio_echo.py printed no byte counts")
    };
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
