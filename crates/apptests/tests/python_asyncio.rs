//! An asyncio server and an asyncio client (selector event loops: epoll,
//! non-blocking accept and connect) under `smclo run`, many connections at
//! once, every answer checked by the client.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn python_asyncio_echo() {
    let mut env = Env::new("py-asyncio");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/asyncio_echo.py");
    let script = script.to_str().unwrap();
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "asyncio-server",
        "python3",
        &[script, "server", &ps],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let (conns, rounds) = (16u64, 40);
    let client = env.run(
        Mode::Smclo,
        "asyncio-client",
        "python3",
        &[
            script,
            "client",
            &ps,
            &conns.to_string(),
            &rounds.to_string(),
            "7",
        ],
        Duration::from_secs(120),
    );
    let [sent, received] = ok_numbers(&client, &server.logs())[..] else {
        panic!("asyncio_echo.py printed no byte counts")
    };
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
