//! memcached (libevent: epoll, non-blocking accept, several worker threads)
//! under `smclo run`, loaded by memcslap with blocking and with non-blocking
//! connections, then every value of a checked set/get round read back.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

fn start_memcached(env: &mut Env) -> (Proc, u16) {
    let port = free_port();
    let ps = port.to_string();
    let mut p = env.spawn(
        Mode::Smclo,
        "memcached",
        "memcached",
        // -U 0: no UDP; -I 1m: the largest item the check stores fits.
        &[
            "-u",
            "root",
            "-p",
            &ps,
            "-U",
            "0",
            "-l",
            "127.0.0.1",
            "-t",
            "2",
            "-m",
            "256",
            "-I",
            "1m",
        ],
    );
    wait_listen(&mut p, port);
    (p, port)
}

#[test]
fn memcached_memcslap_and_checked_values() {
    let mut env = Env::new("memcached");
    let (mut server, port) = start_memcached(&mut env);
    let servers = format!("--servers=127.0.0.1:{port}");
    for (conc, extra) in [("8", None), ("8", Some("--non-blocking"))] {
        let s0 = env.stats();
        let mut args = vec![
            servers.as_str(),
            "--concurrency",
            conc,
            "--execute-number=500",
            "--test=set",
        ];
        args.extend(extra);
        let p = env.run(
            Mode::Smclo,
            "memcslap",
            "memcslap",
            &args,
            Duration::from_secs(120),
        );
        let out = p.stdout_str();
        assert!(
            out.contains("Time total"),
            "memcslap {extra:?}: {}",
            p.logs()
        );
        let d = delta(&s0, &env.stats());
        // memcslap prints no byte counts: at least its 8 connections, and
        // 8 x 500 sets of its default value size, moved through the rings.
        assert_smc(
            &format!("memcslap {extra:?}"),
            &d,
            8,
            8 * 500 * 100,
            u64::MAX,
            &server.logs(),
        );
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/memcache_check.py");
    let s0 = env.stats();
    let ps = port.to_string();
    let c = env.run(
        Mode::Smclo,
        "check",
        "python3",
        &[script.to_str().unwrap(), &ps, "200", "11"],
        Duration::from_secs(120),
    );
    let [sent, received] = ok_numbers(&c, &server.logs())[..] else {
        panic!("memcache_check.py printed no byte counts")
    };
    let d = delta(&s0, &env.stats());
    assert_smc(
        "memcached checked set/get",
        &d,
        2,
        sent + received,
        sent + received,
        &server.logs(),
    );
    server.stop(Duration::from_secs(5));
    assert_clean(&env, false);
}
