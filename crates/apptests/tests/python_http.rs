//! python3 -m http.server (blocking sockets, another runtime) with curl,
//! both under `smclo run`.

use smclo_apptests::*;
use std::time::Duration;

#[test]
fn python_http_server_curl() {
    let mut env = Env::new("python-http");
    let small = b"python http.server small file\n".to_vec();
    let (root, big) = web_root(&env, &small, 0x9e3779b9);
    let port = free_port();
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "http.server",
        "python3",
        &[
            "-m",
            "http.server",
            &ps,
            "--bind",
            "127.0.0.1",
            "--directory",
            root.to_str().unwrap(),
        ],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let base = format!("http://127.0.0.1:{port}");
    // http.server speaks HTTP/1.0 and closes: one connection per URL.
    let (bodies, bytes) = curl(
        &mut env,
        Mode::Smclo,
        None,
        "curl",
        &[
            format!("{base}/small.txt"),
            format!("{base}/big.bin"),
            format!("{base}/big.bin"),
        ],
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
    assert_eq!(
        sha256_bytes(&env, "b2", &bodies[2]),
        sha256_bytes(&env, "b0", &big),
        "1 MiB body differs (2nd)"
    );
    let d = delta(&s0, &env.stats());
    // Exact: curl counts every byte it sent and received.
    assert_smc(
        "python http.server + curl",
        &d,
        3,
        bytes,
        bytes,
        &server.logs(),
    );
    // SIGINT: KeyboardInterrupt, the interpreter exits normally.
    // SAFETY: kill has no memory-safety preconditions; server is our child.
    unsafe { libc::kill(server.pid() as i32, libc::SIGINT) };
    server.wait(Duration::from_secs(10));
    assert_clean(&env, true);
}
