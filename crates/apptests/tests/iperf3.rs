//! iperf3 -s with iperf3 -c, both directions (-R), both under `smclo run`.

use smclo_apptests::*;
use std::time::Duration;

/// A number at `"key":` after the first occurrence of `"section":` in
/// iperf3's JSON (enough for end.sum_sent / end.sum_received).
fn json_num(json: &str, section: &str, key: &str) -> f64 {
    let end = json.rfind("\"end\":").unwrap_or_else(|| panic!("no end section:\n{json}"));
    let s = &json[end..];
    let at = s.find(&format!("\"{section}\":")).unwrap_or_else(|| panic!("no {section}:\n{s}"));
    let s = &s[at..];
    let k = s.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
    s[k..].trim_start().split(|c: char| c == ',' || c == '}' || c.is_whitespace()).next().unwrap().parse().unwrap()
}

#[test]
fn iperf3_both_directions() {
    let mut env = Env::new("iperf3");
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(Mode::Smclo, "iperf3-server", "iperf3", &["-s", "-B", "127.0.0.1", "-p", &ps]);
    wait_listen(&mut server, port);
    for reverse in [false, true] {
        let s0 = env.stats();
        let mut args = vec!["-c", "127.0.0.1", "-p", &ps, "-t", "2", "--json"];
        if reverse {
            args.push("-R");
        }
        let name = if reverse { "iperf3-client-R" } else { "iperf3-client" };
        let c = env.run(Mode::Smclo, name, "iperf3", &args, Duration::from_secs(30));
        let json = c.stdout_str();
        assert!(!json.contains("\"error\""), "iperf3 error:\n{json}\n{}", server.logs());
        let sent = json_num(&json, "sum_sent", "bytes") as u64;
        let received = json_num(&json, "sum_received", "bytes") as u64;
        assert!(sent > 100 << 20, "{name}: only {sent} bytes in 2 s");
        assert_eq!(sent, received, "{name}: sent {sent} != received {received}");
        let d = delta(&s0, &env.stats());
        // Data connection: exactly `sent`. Control connection: the cookie,
        // parameters and both JSON result exchanges, a few tens of KiB with
        // --json (bounded here at 256 KiB).
        assert_smc(name, &d, 2, sent, sent + (256 << 10), &format!("{}\n{}", c.logs(), server.logs()));
    }
    assert!(server.alive(), "iperf3 server died\n{}", server.logs());
}
