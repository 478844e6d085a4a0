//! Harder cases for the same programs: the smallest rings (flow control and
//! wrap-around on every transfer, nginx's sendfile in pieces), many
//! connections, pipelining, and an nginx reload (new workers) under load.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::fs;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn www(env: &Env) -> (std::path::PathBuf, Vec<u8>, Vec<u8>) {
    let small = b"stress small file\n".repeat(7);
    let (root, big) = web_root(env, &small, 0xabcdef);
    (root, small, big)
}

/// 16 KiB rings (the minimum) on both ends: a 1 MiB response is 64 rings
/// full, nginx's sendfile returns partial counts and waits in epoll.
#[test]
fn nginx_sendfile_small_rings() {
    let mut env = Env::new("stress-rings");
    env.run_opts = ["-r", "16k", "-t", "16k"].map(String::from).to_vec();
    let (root, _, big) = www(&env);
    let (nginx, port) = start_local_nginx(&mut env, &root);
    let url = format!("http://127.0.0.1:{port}/big.bin");
    let s0 = env.stats();
    let (bodies, bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl",
        &[url.clone(), url.clone(), url.clone()],
    );
    for b in &bodies {
        assert_eq!(
            sha256_bytes(&env, "b", b),
            sha256_bytes(&env, "b0", &big),
            "1 MiB body differs with 16 KiB rings"
        );
    }
    let d = delta(&s0, &env.stats());
    assert_smc(
        "nginx 1 MiB x3, 16 KiB rings",
        &d,
        1,
        bytes,
        bytes,
        &nginx.logs(),
    );
    // wrk on the 1 MiB file, every body length checked.
    let script = wrk_check_script(&env, "check", big.len());
    let (_, w) = wrk(
        &mut env,
        Mode::Smclo,
        None,
        "wrk",
        &["-t2", "-c8", "-d2s"],
        &script,
        &url,
    );
    w.assert_clean("wrk, 1 MiB, 16 KiB rings", 20, &nginx.logs());
    let d = delta(&s0, &env.stats());
    assert_eq!(d.fallbacks(), 0, "fallbacks: {}", d.fallbacks_desc());
}

/// 200 concurrent connections over both nginx workers.
#[test]
fn nginx_wrk_200_connections() {
    let mut env = Env::new("stress-conns");
    let (root, small, _) = www(&env);
    let (nginx, port) = start_local_nginx(&mut env, &root);
    let script = wrk_check_script(&env, "check", small.len());
    let s0 = env.stats();
    let url = format!("http://127.0.0.1:{port}/small.txt");
    let (_, w) = wrk(
        &mut env,
        Mode::Smclo,
        None,
        "wrk",
        &["-t2", "-c200", "-d2s"],
        &script,
        &url,
    );
    w.assert_clean("nginx + wrk -c200", 0, &nginx.logs());
    assert_nginx_served(&env, &s0, &w, 200, &nginx.logs());
}

/// redis-benchmark with 16-deep pipelines from 50 clients, 16 KiB rings.
#[test]
fn redis_pipelined_small_rings() {
    let mut env = Env::new("stress-redis");
    env.run_opts = ["-r", "16k"].map(String::from).to_vec();
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let ps = port.to_string();
    let n = 100000u64;
    let s0 = env.stats();
    let b = env.run(
        Mode::Smclo,
        "redis-benchmark",
        "redis-benchmark",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &ps,
            "-t",
            "set,get",
            "-d",
            "1024",
            "-c",
            "50",
            "-P",
            "16",
            "-n",
            &n.to_string(),
            "-q",
        ],
        T,
    );
    assert!(b.stdout_str().contains("GET: "), "{}", b.logs());
    let cs = env
        .run(
            Mode::Smclo,
            "cli-cmdstats",
            "redis-cli",
            &["-p", &ps, "INFO", "commandstats"],
            T,
        )
        .stdout_str();
    for cmd in ["set", "get"] {
        let calls: u64 = info_field(&cs, &format!("cmdstat_{cmd}"))
            .unwrap()
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(calls, n, "{cmd} calls\n{cs}");
    }
    let info = env
        .run(
            Mode::Smclo,
            "cli-info",
            "redis-cli",
            &["-p", &ps, "INFO", "stats"],
            T,
        )
        .stdout_str();
    let moved: u64 = ["total_net_input_bytes", "total_net_output_bytes"]
        .iter()
        .map(|k| info_field(&info, k).unwrap().parse::<u64>().unwrap())
        .sum();
    let d = delta(&s0, &env.stats());
    // As in redis_benchmark_set_get, plus the INFO reply (a few KiB).
    assert_smc(
        "redis-benchmark -P 16, 16 KiB rings",
        &d,
        50,
        moved,
        moved + 16384,
        &server.logs(),
    );
}

/// nginx reloads (SIGHUP: new workers, old ones finish gracefully) while
/// wrk runs; new connections after the reload are still accelerated.
#[test]
fn nginx_reload_under_load() {
    let mut env = Env::new("stress-reload");
    let (root, small, _) = www(&env);
    let (mut nginx, port) = start_local_nginx(&mut env, &root);
    let script = wrk_check_script(&env, "check", small.len());
    let url = format!("http://127.0.0.1:{port}/small.txt");
    let s0 = env.stats();
    let mut w = spawn_wrk(
        &mut env,
        Mode::Smclo,
        None,
        "wrk",
        &["-t2", "-c8", "-d3s"],
        &script,
        &url,
    );
    std::thread::sleep(Duration::from_millis(1000));
    let old = fs::read_to_string(format!("/proc/{0}/task/{0}/children", nginx.pid())).unwrap();
    // SAFETY: kill has no memory-safety preconditions; nginx is our child.
    unsafe { libc::kill(nginx.pid() as i32, libc::SIGHUP) };
    w.wait_ok(T);
    assert!(nginx.alive(), "nginx died on reload\n{}", nginx.logs());
    let new = fs::read_to_string(format!("/proc/{0}/task/{0}/children", nginx.pid())).unwrap();
    assert!(
        old.split_whitespace()
            .all(|p| !new.split_whitespace().any(|q| q == p)),
        "workers not replaced: {old} -> {new}"
    );
    // Old workers close idle keep-alive connections when they exit, which
    // wrk may count as read errors, as with plain TCP; no body may be wrong.
    Wrk::parse(&w).assert_all_right("wrk across the reload");
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.fallbacks(),
        0,
        "fallbacks across the reload: {}\n{}",
        d.fallbacks_desc(),
        nginx.logs()
    );
    let s1 = env.stats();
    let (b, bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl-after",
        std::slice::from_ref(&url),
    );
    assert_eq!(b[0], small);
    let d = delta(&s1, &env.stats());
    assert_smc(
        "curl after nginx reload",
        &d,
        1,
        bytes,
        bytes,
        &nginx.logs(),
    );
    nginx.stop(Duration::from_secs(2));
}

/// Connection churn: wrk with `Connection: close`, a new SMC-D handshake
/// for every request (thousands in 2 s), over both nginx workers.
#[test]
fn nginx_connection_churn() {
    let mut env = Env::new("stress-churn");
    // Every connection proposes: the churn of handshakes is what is
    // tested (a client that learns short connections, the default, makes
    // most of these plain TCP after 16).
    env.extra_env.push(("SMCLO_SHORT".into(), "smc".into()));
    let (root, small, _) = www(&env);
    let (mut nginx, port) = start_local_nginx(&mut env, &root);
    let script = wrk_check_script(&env, "check", small.len());
    let s0 = env.stats();
    let url = format!("http://127.0.0.1:{port}/small.txt");
    let (_, w) = wrk(
        &mut env,
        Mode::Smclo,
        None,
        "wrk",
        &["-t2", "-c8", "-d2s", "-H", "Connection: close"],
        &script,
        &url,
    );
    let reqs = w.reqs;
    eprintln!("churn: {reqs} requests, {:?}", w.errs);
    assert!(reqs > 500, "only {reqs} requests\n{}", w.out);
    // A failed connect is never TCP's doing here (a pending connect's
    // number reused by the next socket once got another's handshake).
    let connect_errors = w
        .errs
        .as_deref()
        .and_then(|e| e.split("connect ").nth(1))
        .and_then(|e| e.split(',').next())
        .map_or(0, |n| n.trim().parse::<u64>().unwrap_or(u64::MAX));
    assert_eq!(connect_errors, 0, "{}", w.out);
    w.assert_all_right("wrk with Connection: close");
    let d = delta(&s0, &env.stats());
    // One connection per request (plus those cut off when wrk stopped).
    assert!(
        d.conns_opened >= reqs && d.conns_opened <= reqs + 16,
        "{} connections for {reqs} requests",
        d.conns_opened
    );
    // wrk exits with connects in flight (its non-blocking connects return
    // before their handshakes end): nginx may find such a client gone
    // mid-handshake (PEER_DEAD, which only the server counts), at most once
    // per connection wrk holds. The client falls back never.
    let mut d = d;
    let abandoned = d.fallback_server[Reason::PeerDead.index()];
    assert!(
        d.fallback_client.iter().sum::<u64>() == 0 && abandoned <= 8,
        "{}",
        d.fallbacks_desc()
    );
    d.fallback_server[Reason::PeerDead.index()] = 0;
    let (logged, _, _) = nginx_log_bytes(&env, "a");
    let per = logged / reqs.max(1);
    let (lo, hi) = wrk_slack(logged, 16, per);
    assert_smc("nginx connection churn", &d, reqs, lo, hi, &nginx.logs());
    nginx.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}
