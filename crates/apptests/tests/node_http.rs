//! node's http module (libuv) as server and as keep-alive client, both under
//! `smclo run`: every body checked by the client, and every byte the
//! client's sockets wrote and read (headers included) counted by the device.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
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

/// Runs node's cluster module under `smclo run` with `env` and `conns`
/// curls (each must answer in under 2 s, waiting up to 5 s for a
/// server's answer); returns the device's counts over them, the bytes the
/// curls read and the server's log.
fn cluster_requests(name: &str, env_vars: &[(&str, &str)], conns: u64) -> (Delta, u64, String) {
    let mut env = Env::new(name);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/js/cluster.js");
    let port = free_port();
    let ps = port.to_string();
    let mut cmd = env.command(Mode::Smclo, None, "node", &[script.to_str().unwrap(), &ps]);
    for (k, v) in env_vars {
        cmd.env(k, v);
    }
    let mut server = env.spawn_cmd("node-cluster", cmd);
    server.wait_stdout("ready", Duration::from_secs(30), &[]);
    let s0 = env.stats();
    let url = format!("http://127.0.0.1:{port}/");
    let mut bytes = 0;
    for i in 0..conns {
        let t0 = std::time::Instant::now();
        let mut c = env.command(Mode::Smclo, None, "curl", &["-sS", "-m", "20", &url]);
        c.env("SMCLO_CLC_WAIT_MS", "5000");
        let mut p = env.spawn_cmd("curl", c);
        let st = p.wait(Duration::from_secs(30));
        let took = t0.elapsed();
        assert!(
            st.success() && p.stdout_str().starts_with("worker "),
            "connection {i}: {}\n{}\n{:?}",
            p.logs(),
            server.logs(),
            delta(&s0, &env.stats())
        );
        assert!(
            took < Duration::from_secs(2),
            "a connection took {took:?}\n{}",
            server.logs()
        );
        bytes += p.stdout_str().len() as u64;
    }
    let d = delta(&s0, &env.stats());
    let logs = server.logs();
    server.stop(Duration::from_secs(5));
    (d, bytes, logs)
}

/// node's cluster module (PM2's cluster mode): the primary accepts each
/// connection and passes its descriptor to a worker (`SCM_RIGHTS`), most
/// often before the handshake ends, which the worker cannot finish. By
/// default the primary does not wait for it: it declines the client's
/// proposal as it passes it (PASSED at both ends) and unregisters its
/// listener, so the later clients do not propose (PEERNOSMC at the
/// client) and every connection is plain TCP at TCP's cost. Before, every
/// client waited for an answer no process would give
/// (`SMCLO_CLC_WAIT_MS`, 5 s here) and fell back with TIMEOUT. A
/// handshake that ends within the primary's `accept` (a client quick to
/// confirm) passes as an SMC-D connection, which the worker adopts: those
/// come before the first PASSED.
#[test]
fn node_cluster_primary_passing_connections_costs_no_wait() {
    let conns = 6;
    // Without a spin in the primary's accept, a handshake ends there only
    // rarely.
    let (d, _, logs) = cluster_requests("node-cluster", &[("SMCLO_SPIN_US", "0")], conns);
    let what = d.fallbacks_desc();
    let smc = d.conns_opened;
    // A primary that waited for each handshake would make them all SMC-D.
    assert!(smc + 2 <= conns, "{smc} SMC-D: {what}\n{logs}");
    assert_eq!(d.fallback(Reason::Passed), (1, 1), "{what}\n{logs}");
    assert_eq!(
        d.fallback(Reason::PeerNoSmc),
        (conns - 1 - smc, 0),
        "{what}\n{logs}"
    );
    assert_eq!(d.fallbacks(), conns - smc + 1, "{what}\n{logs}");
}

/// With `SMCLO_PASS_WAIT_MS` the primary waits for each handshake before
/// it passes the connection, and the SMC-D connection goes to the worker
/// with what it needs to adopt it: the workers answer every request
/// through shared memory. A handshake that takes longer than the wait (a
/// loaded machine) is declined (PASSED): that connection is TCP, without
/// a wait.
#[test]
fn node_cluster_primary_waiting_passes_smc_connections_to_workers() {
    let conns = 8;
    let (d, bytes, logs) =
        cluster_requests("node-cluster-smc", &[("SMCLO_PASS_WAIT_MS", "5")], conns);
    let what = d.fallbacks_desc();
    let (passed, passed_server) = d.fallback(Reason::Passed);
    assert_eq!(passed, passed_server, "{what}\n{logs}");
    assert_eq!(d.fallbacks(), 2 * passed, "only PASSED: {what}\n{logs}");
    assert_eq!(d.conns_opened + passed, conns, "{d:?}\n{logs}");
    assert!(passed <= 1, "{passed} of {conns} declined: {what}\n{logs}");
    // Requests and responses, headers included, went through the rings.
    assert!(d.xfer_bytes > 2 * bytes, "{d:?}\n{logs}");
}

/// libuv closes descriptors with `syscall(SYS_close, fd)`, not `close`: a
/// node client that destroys its socket ends the SMC-D connection as over
/// TCP. The server reads what was written, then end of stream; before,
/// the close went by smclo, and the server read a reset (the channel
/// closed without the close flag) while the connection stayed in the
/// client's table.
#[test]
fn a_node_socket_destroyed_is_an_end_of_stream() {
    let mut env = Env::new("node-destroy");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let (js, py) = (dir.join("js/destroy.js"), dir.join("py/read_to_end.py"));
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "reader",
        "python3",
        &[py.to_str().unwrap(), &ps],
    );
    server.wait_stdout("ready", Duration::from_secs(20), &[]);
    let s0 = env.stats();
    env.run(
        Mode::Smclo,
        "node-destroy",
        "node",
        &[js.to_str().unwrap(), &ps],
        Duration::from_secs(30),
    );
    server.wait(Duration::from_secs(20));
    let out = server.stdout_str();
    assert_eq!(out.lines().last(), Some("eof 5"), "{}", server.logs());
    let d = delta(&s0, &env.stats());
    assert_smc("node destroy", &d, 1, 5, 5, &server.logs());
    assert_eq!(env.stats().conns_active, 0, "{d:?}");
}
