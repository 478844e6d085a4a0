//! nginx (master + 2 workers, sendfile, keepalive) with curl and wrk, all
//! under `smclo run`.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::time::Duration;

fn www(env: &Env) -> (std::path::PathBuf, Vec<u8>, Vec<u8>) {
    let small = b"smclo nginx small file: 0123456789 abcdefghijklmnopqrstuvwxyz\n".repeat(3);
    let (root, big) = web_root(env, &small, 0xb16_f11e);
    (root, small, big)
}

#[test]
fn nginx_curl_small_and_1mib() {
    let mut env = Env::new("nginx-curl");
    let (root, small, big) = www(&env);
    let (nginx, port) = start_local_nginx(&mut env, &root);
    let s0 = env.stats();
    let base = format!("http://127.0.0.1:{port}");
    // Both files over one keep-alive connection, then each on its own.
    let (bodies, curl_bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl-both",
        &[format!("{base}/small.txt"), format!("{base}/big.bin")],
    );
    assert_eq!(
        sha256_bytes(&env, "s", &bodies[0]),
        sha256_bytes(&env, "s0", &small),
        "small body differs"
    );
    assert_eq!(
        sha256_bytes(&env, "b", &bodies[1]),
        sha256_bytes(&env, "b0", &big),
        "1 MiB body differs"
    );
    let (b1, c1) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl-big",
        &[format!("{base}/big.bin")],
    );
    assert_eq!(
        sha256_bytes(&env, "b1", &b1[0]),
        sha256_bytes(&env, "b0", &big),
        "1 MiB body differs (2nd)"
    );
    let d = delta(&s0, &env.stats());
    // Exact: curl counts every byte it sent (request) and received (headers
    // and body) on its connections, which are all of the traffic.
    let want = curl_bytes + c1;
    assert_smc("nginx + curl", &d, 2, want, want, &nginx.logs());
    // nginx agrees: $request_length + $bytes_sent over its log.
    let (logged, n, lines) = nginx_log_bytes(&env, "a");
    assert_eq!(n, 3, "access log: {lines:?}");
    assert_eq!(
        logged, want,
        "nginx logged {logged} bytes, curl moved {want}: {lines:?}"
    );
    let mut nginx = nginx;
    nginx.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

#[test]
fn nginx_wrk() {
    let mut env = Env::new("nginx-wrk");
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
        &["-t2", "-c8", "-d2s"],
        &script,
        &url,
    );
    w.assert_clean("nginx + wrk", 1000, &nginx.logs());
    assert_nginx_served(&env, &s0, &w, 8, &nginx.logs());
    drop(nginx); // SIGKILL to master and workers
    assert_clean(&env, false);
}

/// nginx as a client too: a reverse proxy (keep-alive upstream) to another
/// server block of the same nginx, whose workers then connect to their own
/// listener, and to a python http.server backend.
#[test]
fn nginx_reverse_proxy() {
    let mut env = Env::new("nginx-proxy");
    let (root, small, big) = www(&env);
    let (front, back) = (free_port(), free_port());
    let py = free_port();
    let mut backend = env.spawn(
        Mode::Smclo,
        "py-backend",
        "python3",
        &[
            "-m",
            "http.server",
            &py.to_string(),
            "--bind",
            "127.0.0.1",
            "--directory",
            root.to_str().unwrap(),
        ],
    );
    wait_listen(&mut backend, py);
    let servers = format!(
        "upstream self_back {{ server 127.0.0.1:{back}; keepalive 4; }}\n\
         server {{ listen 127.0.0.1:{front};\n\
           location /py/ {{ proxy_pass http://127.0.0.1:{py}/; }}\n\
           location / {{ proxy_pass http://self_back; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}\n\
         server {{ listen 127.0.0.1:{back}; root {}; }}",
        root.display()
    );
    let nginx = start_nginx_servers(&mut env, Mode::Smclo, None, &servers, front, "a");
    assert!(listening(back, Some(nginx.pid())));
    let s0 = env.stats();
    let base = format!("http://127.0.0.1:{front}");
    let (b, _) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl",
        &[
            format!("{base}/small.txt"),
            format!("{base}/big.bin"),
            format!("{base}/py/big.bin"),
            format!("{base}/big.bin"),
        ],
    );
    assert_eq!(b[0], small);
    for (i, body) in b.iter().enumerate().skip(1) {
        assert_eq!(
            sha256_bytes(&env, "b", body),
            sha256_bytes(&env, "b0", &big),
            "body {i} through the proxy differs"
        );
    }
    let d = delta(&s0, &env.stats());
    // curl -> front (1 connection), front -> back (keep-alive: >= 1),
    // front -> python (1 per request, HTTP/1.0).
    eprintln!("reverse proxy: {d:?}");
    // A worker may accept its own connection to the backend port (both
    // workers listen there): a process's connection to itself stays TCP
    // (SELF_CONNECT, counted at both ends). Nothing else may fall back.
    let (own_c, own_s) = d.fallback(Reason::SelfConnect);
    assert!(
        own_c == own_s && d.fallbacks() == own_c + own_s,
        "fallbacks: {}\n{}",
        d.fallbacks_desc(),
        nginx.logs()
    );
    // curl -> front and front -> python (at least 2 requests) always.
    assert!(d.conns_opened >= 3 - own_c.min(1), "{d:?}");
    // At least the bodies twice (backend -> nginx -> curl) each; once for
    // the nginx backend's when its connection stayed TCP (SELF_CONNECT).
    let (s, b) = (small.len() as u64, big.len() as u64);
    let min = if own_c == 0 {
        2 * (s + 3 * b)
    } else {
        s + 3 * b + b
    };
    assert!(
        d.xfer_bytes >= min && d.xfer_bytes < min + 64 * 1024,
        "xfer_bytes {} for {min} bytes of bodies moved twice",
        d.xfer_bytes
    );
}
