//! An asyncio server and an asyncio client (selector event loops: epoll,
//! non-blocking accept and connect) under `smclo run`, many connections at
//! once, every answer checked by the client.

use smclo_apptests::*;
use std::time::Duration;

#[test]
fn python_asyncio_echo() {
    let mut env = Env::new("py-asyncio");
    let port = free_port();
    let mut server = start_asyncio_echo(&mut env, "asyncio-server", port);
    let s0 = env.stats();
    let (conns, rounds) = (16u64, 40);
    let run = (conns, rounds, 7);
    let (sent, received) = asyncio_echo_client(&mut env, "asyncio-client", port, run, &[&server]);
    let d = delta(&s0, &env.stats());
    // Both directions moved through the rings, nothing else.
    assert_smc(
        "asyncio echo",
        &d,
        conns,
        sent + received,
        sent + received,
        &server.logs(),
    );
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
}
