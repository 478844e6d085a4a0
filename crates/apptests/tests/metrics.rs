//! The counters as monitoring reads them: `smclo stats --prometheus` and
//! `--openmetrics`, and `smclo exporter` over HTTP, each page parsed by the
//! Prometheus client library's own parsers (Debian's
//! python3-prometheus-client) and checked against the device's counters
//! after real traffic: redis-cli under `smclo run` (SMC-D) and a plain
//! redis-cli (a server-side fallback).

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

/// Samples by "name{labels}" (labels sorted, k=v joined by ','), with
/// their family's type.
type Samples = HashMap<String, (String, u64)>;

fn parser() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/metrics_parse.py")
}

/// `page` parsed as `fmt` ("prometheus" or "openmetrics").
fn parse(page: &str, fmt: &str) -> Samples {
    // Debian's python, which the package installs the library for.
    let mut c = Command::new("/usr/bin/python3")
        .arg(parser())
        .arg(fmt)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3");
    c.stdin.take().unwrap().write_all(page.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the {fmt} parser refused the page: {}\n{page}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut m = Samples::new();
    for l in String::from_utf8(out.stdout).unwrap().lines() {
        let f: Vec<&str> = l.split(' ').collect();
        let [kind, name, labels, value] = f[..] else {
            panic!("unexpected parser line {l:?}");
        };
        m.insert(
            format!("{name}{{{labels}}}"),
            (kind.to_string(), value.parse().unwrap()),
        );
    }
    m
}

fn labels(env: &Env, gid: u64, extra: &str) -> String {
    let mut v = vec![
        format!("device={}", env.dev_dir.display()),
        format!("gid={gid:016x}"),
    ];
    v.extend(extra.split(',').filter(|s| !s.is_empty()).map(String::from));
    v.sort();
    v.join(",")
}

/// Every counter of `s` is in `m` with its value and type.
fn check(env: &Env, m: &Samples, s: &smclo::device::Stats, fmt: &str) {
    let get = |name: &str, extra: &str| {
        let key = format!("{name}{{{}}}", labels(env, s.gid, extra));
        m.get(&key)
            .cloned()
            .unwrap_or_else(|| panic!("{fmt}: no sample {key} in {m:?}"))
    };
    let counter = "counter".to_string();
    let gauge = "gauge".to_string();
    assert_eq!(
        get("smclo_connections_opened_total", ""),
        (counter.clone(), s.conns_opened)
    );
    assert_eq!(
        get("smclo_sent_bytes_total", ""),
        (counter.clone(), s.xfer_bytes)
    );
    assert_eq!(
        get("smclo_dmbs_registered_total", ""),
        (counter.clone(), s.dmbs_registered)
    );
    assert_eq!(
        get("smclo_connections_active", ""),
        (gauge.clone(), s.conns_active)
    );
    assert_eq!(get("smclo_dmbs", ""), (gauge.clone(), s.dmbs_cnt));
    assert_eq!(get("smclo_listeners", ""), (gauge.clone(), s.listeners));
    for r in Reason::ALL {
        let (c, sv) = s.fallback(r);
        for (side, n) in [("client", c), ("server", sv)] {
            let extra = format!("code=0x{:08x},reason={},side={side}", r.code(), r.name());
            assert_eq!(
                get("smclo_fallbacks_total", &extra),
                (counter.clone(), n),
                "{fmt} {extra}"
            );
        }
    }
    // OpenMetrics' parser names an info family's type "info".
    let info = get("smclo_device_info", "");
    assert_eq!(info.1, 1);
}

/// The counters once the clients' connections are gone (the gauges then
/// stay put between the snapshot and the pages).
fn settled(env: &Env) -> smclo::device::Stats {
    let t0 = Instant::now();
    loop {
        let a = env.stats();
        std::thread::sleep(Duration::from_millis(100));
        if a.conns_active == 0 && a == env.stats() {
            return a;
        }
        assert!(t0.elapsed() < T, "the counters did not settle: {a:?}");
    }
}

fn traffic(env: &mut Env) -> (Proc, smclo::device::Stats) {
    let (redis, port) = start_redis(env, Mode::Smclo);
    let p = port.to_string();
    for mode in [Mode::Smclo, Mode::Smclo, Mode::Plain] {
        let out = env.run(mode, "redis-cli", "redis-cli", &["-p", &p, "ping"], T);
        assert_eq!(out.stdout_str().trim(), "PONG");
    }
    let s = settled(env);
    assert!(
        s.conns_opened >= 2,
        "redis-cli under smclo run was not SMC-D"
    );
    assert!(
        s.fallback(Reason::PeerNoSmc).1 >= 1,
        "the plain redis-cli was not counted"
    );
    assert!(s.xfer_bytes > 0 && s.listeners >= 1);
    (redis, s)
}

fn stats_page(env: &mut Env, flag: &str) -> String {
    let smclo = smclo_bin();
    let p = env.run(
        Mode::Plain,
        "stats",
        smclo.to_str().unwrap(),
        &["stats", flag],
        T,
    );
    p.stdout_str()
}

#[test]
fn stats_pages_parse_and_match_the_counters() {
    let mut env = Env::new("metrics-stats");
    let (_redis, s) = traffic(&mut env);
    let text = stats_page(&mut env, "--prometheus");
    check(&env, &parse(&text, "prometheus"), &s, "prometheus");
    let om = stats_page(&mut env, "--openmetrics");
    assert!(om.ends_with("# EOF\n"));
    check(&env, &parse(&om, "openmetrics"), &s, "openmetrics");
}

/// One HTTP request to the exporter with `curl`: status and body.
fn fetch(port: u16, path: &str, accept: Option<&str>) -> (u16, String) {
    let mut c = Command::new(require("curl"));
    c.args(["-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "10"]);
    if let Some(a) = accept {
        c.args(["-H", &format!("Accept: {a}")]);
    }
    c.arg(format!("http://127.0.0.1:{port}{path}"));
    let out = c.output().expect("curl");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (
        code.parse().unwrap(),
        format!("{body}\n").replace("\n\n", "\n"),
    )
}

#[test]
fn the_exporter_serves_both_formats_over_http() {
    let mut env = Env::new("metrics-exporter");
    let (_redis, s) = traffic(&mut env);
    let port = free_port();
    let smclo = smclo_bin();
    let listen = format!("127.0.0.1:{port}");
    let dir = env.dev_dir.display().to_string();
    let args = ["exporter", "--listen", &listen, "--device", &dir];
    let mut exporter = env.spawn(Mode::Plain, "exporter", smclo.to_str().unwrap(), &args);
    wait_listen(&mut exporter, port);
    let (code, text) = fetch(port, "/metrics", None);
    assert_eq!(code, 200);
    check(
        &env,
        &parse(&text, "prometheus"),
        &s,
        "exporter, prometheus",
    );
    let om = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
    let (code, text) = fetch(port, "/metrics", Some(om));
    assert_eq!(code, 200);
    assert!(text.ends_with("# EOF\n"), "{text}");
    check(
        &env,
        &parse(&text, "openmetrics"),
        &s,
        "exporter, openmetrics",
    );
    assert_eq!(fetch(port, "/nowhere", None).0, 404);
    // Counters move between scrapes: the exporter reads them each time.
    let t0 = Instant::now();
    env.run(
        Mode::Plain,
        "stats-reset",
        smclo.to_str().unwrap(),
        &["stats", "reset"],
        T,
    );
    let (_, text) = fetch(port, "/metrics", None);
    let m = parse(&text, "prometheus");
    let key = format!(
        "smclo_connections_opened_total{{{}}}",
        labels(&env, s.gid, "")
    );
    assert_eq!(m[&key].1, 0, "after a reset ({:?})", t0.elapsed());
}
