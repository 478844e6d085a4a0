//! node's http module (libuv) as server and as keep-alive client, both under
//! `smclo run`: every body checked by the client, and every byte the
//! client's sockets wrote and read (headers included) counted by the device.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn node_http_server_and_client() {
    let mut env = Env::new("node-http");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/js/http_pair.js");
    let script = script.to_str().unwrap();
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(Mode::Smclo, "node-server", "node", &[script, "server", &ps]);
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let sockets = 6u64;
    let client = env.run(
        Mode::Smclo,
        "node-client",
        "node",
        &[script, "client", &ps, &sockets.to_string(), "60"],
        Duration::from_secs(120),
    );
    let [bytes, used] = ok_numbers(&client, &server.logs())[..] else {
        panic!("http_pair.js printed no byte and socket counts")
    };
    assert!(used >= 1 && used <= sockets, "{used} sockets");
    let d = delta(&s0, &env.stats());
    assert_smc("node http", &d, used, bytes, bytes, &server.logs());
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
}
