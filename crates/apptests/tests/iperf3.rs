//! iperf3 -s with iperf3 -c, both directions (-R), both under `smclo run`.

use smclo_apptests::*;
use std::time::Duration;

/// `end.<section>.<key>` of iperf3's JSON output.
fn json_num(env: &Env, json: &str, section: &str, key: &str) -> f64 {
    iperf3_json(env, json, &format!("d['end']['{section}']['{key}']"))
}

#[test]
fn iperf3_both_directions() {
    let mut env = Env::new("iperf3");
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "iperf3-server",
        "iperf3",
        &["-s", "-B", "127.0.0.1", "-p", &ps],
    );
    wait_listen(&mut server, port);
    for reverse in [false, true] {
        let s0 = env.stats();
        let mut args = vec!["-c", "127.0.0.1", "-p", &ps, "-t", "2", "--json"];
        if reverse {
            args.push("-R");
        }
        let name = if reverse {
            "iperf3-client-R"
        } else {
            "iperf3-client"
        };
        let c = env.run(Mode::Smclo, name, "iperf3", &args, Duration::from_secs(30));
        let json = c.stdout_str();
        assert!(
            !json.contains("\"error\""),
            "iperf3 error:\n{json}\n{}",
            server.logs()
        );
        let sent = json_num(&env, &json, "sum_sent", "bytes") as u64;
        let received = json_num(&env, &json, "sum_received", "bytes") as u64;
        assert!(sent > 100 << 20, "{name}: only {sent} bytes in 2 s");
        // The receiver stops reading when the test time is up: the last
        // blocks the sender wrote may stay unread (in the ring, or in TCP's
        // buffers without smclo), at most a few MiB.
        assert!(
            received <= sent && sent - received <= 4 << 20,
            "{name}: sent {sent}, received {received}"
        );
        let d = delta(&s0, &env.stats());
        // Data connection: exactly `sent` (written into the peer's ring,
        // read or not). Control connection: the cookie,
        // parameters and both JSON result exchanges, a few tens of KiB with
        // --json (bounded here at 256 KiB).
        assert_smc(
            name,
            &d,
            2,
            sent,
            sent + (256 << 10),
            &format!("{}\n{}", c.logs(), server.logs()),
        );
    }
    assert!(server.alive(), "iperf3 server died\n{}", server.logs());
    let mut server = server;
    server.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}
