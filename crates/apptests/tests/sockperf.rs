//! sockperf server with sockperf ping-pong (no-copy and copy mode) and
//! throughput over TCP, both under `smclo run`.

use smclo::device::Device;
use smclo_apptests::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// `key=value` from sockperf's output (value up to ';' or whitespace).
fn field(out: &str, key: &str) -> u64 {
    out.split(|c: char| c.is_whitespace() || c == ';')
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in sockperf output:\n{out}"))
}

// sockperf's warm-up sends "a few dummy messages" of the test's size before
// the measured run and does not count them; allow up to 1000 of them.
const WARMUP_MSGS: u64 = 1000;

/// One `sockperf ping-pong` run of 64-byte messages against `server`, with
/// the device's `dmb_copy` knob set to `copy` for its connection: every
/// message the client sent is echoed, byte-checked (`--data-integrity`) and
/// in order.
fn ping_pong(env: &mut Env, server: &Proc, ps: &str, copy: bool) {
    let what = if copy {
        "sockperf ping-pong, copy mode"
    } else {
        "sockperf ping-pong, no-copy"
    };
    // Both ends read the knob when their connection is set up.
    Device::open(&env.dev_dir).unwrap().set_dmb_copy(copy);
    let m = 64u64;
    let s0 = env.stats();
    // --mps 5000000 (a rate limit it does not reach): with the default
    // (max) sockperf sizes its sequence table for at most 600k messages/s
    // (1 800 011 messages for -t 2) and aborts ("_seqN > m_maxSequenceNo")
    // when the round trip is faster than that, as it is over shared memory.
    let pp = env.run(
        Mode::Smclo,
        if copy {
            "sockperf-pp-copy"
        } else {
            "sockperf-pp"
        },
        "sockperf",
        &[
            "ping-pong",
            "--tcp",
            "-i",
            "127.0.0.1",
            "-p",
            ps,
            "-t",
            "2",
            "--mps",
            "5000000",
            "--data-integrity",
            "-m",
            &m.to_string(),
        ],
        T,
    );
    let out = pp.stderr_str() + &pp.stdout_str();
    // The debug log (SMCLO_DEBUG) names the mode of the client's end.
    let mode = if copy { "copy mode)" } else { "no-copy)" };
    assert!(
        out.lines()
            .any(|l| l.contains(": SMC-D (") && l.ends_with(mode)),
        "{what}: no SMC-D connection in {mode}\n{out}"
    );
    let total = out
        .lines()
        .find(|l| l.contains("[Total Run]"))
        .unwrap_or_else(|| panic!("no [Total Run] line:\n{out}"));
    let (sent, recv) = (
        field(total, "SentMessages"),
        field(total, "ReceivedMessages"),
    );
    assert!(out.contains("Summary: Latency is"), "{out}");
    assert!(
        out.contains(
            "# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0"
        ),
        "{out}"
    );
    assert!(
        recv > 1000 && recv <= sent && sent - recv <= 1,
        "sent {sent}, received {recv}\n{out}"
    );
    let d = delta(&s0, &env.stats());
    // The client's messages and the server's echoes; the server may have
    // echoed the last message after the client stopped counting.
    assert_smc(
        what,
        &d,
        1,
        (sent + recv) * m,
        (2 * sent + 2 * WARMUP_MSGS) * m,
        &server.logs(),
    );
    Device::open(&env.dev_dir).unwrap().set_dmb_copy(false);
}

#[test]
fn sockperf_ping_pong_and_throughput() {
    let mut env = Env::new("sockperf");
    env.extra_env.push(("SMCLO_DEBUG".into(), "1".into()));
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "sockperf-server",
        "sockperf",
        &["server", "--tcp", "-i", "127.0.0.1", "-p", &ps],
    );
    wait_listen(&mut server, port);

    ping_pong(&mut env, &server, &ps, false);
    ping_pong(&mut env, &server, &ps, true);
    let srv = server.stderr_str();
    assert!(
        srv.lines().any(|l| l.ends_with("copy mode)")),
        "the server's end was never in copy mode\n{}",
        server.logs()
    );

    // throughput, 1400-byte messages, no replies.
    let m = 1400u64;
    let s0 = env.stats();
    let tp = env.run(
        Mode::Smclo,
        "sockperf-tp",
        "sockperf",
        &[
            "throughput",
            "--tcp",
            "-i",
            "127.0.0.1",
            "-p",
            &ps,
            "-t",
            "2",
            "-m",
            &m.to_string(),
        ],
        T,
    );
    let out = tp.stderr_str() + &tp.stdout_str();
    let line = out
        .lines()
        .find(|l| l.contains("Total of ") && l.contains("messages sent"))
        .unwrap_or_else(|| panic!("no total:\n{out}"));
    let sent: u64 = line
        .split("Total of ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(out.contains("Summary: BandWidth is"), "{out}");
    assert!(sent > 10000, "only {sent} messages\n{out}");
    let d = delta(&s0, &env.stats());
    assert_smc(
        "sockperf throughput",
        &d,
        1,
        sent * m,
        (sent + WARMUP_MSGS) * m,
        &server.logs(),
    );
    assert!(server.alive(), "sockperf server died\n{}", server.logs());
    let mut server = server;
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
}

/// Three TCP connections in one sockperf client, multiplexed with select,
/// poll and epoll in turn, against one server multiplexing with select.
/// (sockperf takes about 3.3 s for `-t 1` with a feed file, plain or not.)
#[test]
fn sockperf_multiplexed_select_poll_epoll() {
    let mut env = Env::new("sockperf-mux");
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let feed = env.path("feed.txt");
    std::fs::write(
        &feed,
        ports
            .iter()
            .map(|p| format!("T:127.0.0.1:{p}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let f = feed.to_str().unwrap();
    let mut server = env.spawn(
        Mode::Smclo,
        "sockperf-server",
        "sockperf",
        &["server", "-f", f, "-F", "s"],
    );
    for p in &ports {
        wait_listen(&mut server, *p);
    }
    let m = 64u64;
    for mux in ["s", "p", "e"] {
        let s0 = env.stats();
        let pp = env.run(
            Mode::Smclo,
            &format!("sockperf-pp-{mux}"),
            "sockperf",
            &[
                "ping-pong",
                "-f",
                f,
                "-F",
                mux,
                "-t",
                "1",
                "--mps",
                "5000000",
                "-m",
                &m.to_string(),
            ],
            T,
        );
        let out = pp.stderr_str() + &pp.stdout_str();
        let total = out
            .lines()
            .find(|l| l.contains("[Total Run]"))
            .unwrap_or_else(|| panic!("no [Total Run] line:\n{out}"));
        let (sent, recv) = (
            field(total, "SentMessages"),
            field(total, "ReceivedMessages"),
        );
        assert!(
            out.contains(
                "# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0"
            ),
            "{out}"
        );
        assert!(
            recv > 1000 && recv <= sent && sent - recv <= 3,
            "-F {mux}: sent {sent}, received {recv}\n{out}"
        );
        let d = delta(&s0, &env.stats());
        assert_smc(
            &format!("sockperf ping-pong -F {mux}, 3 connections"),
            &d,
            3,
            (sent + recv) * m,
            (2 * sent + 6 * WARMUP_MSGS) * m,
            &server.logs(),
        );
    }
}
