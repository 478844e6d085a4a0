//! Two network namespaces joined by a veth pair, the device directory shared
//! (the seeds' case 2): nginx in one, wrk and curl in the other, under
//! `smclo run`. Then two pairs of namespaces with identical addresses and
//! ports at the same time, one accelerated and one plain: no cross-talk.
//! Needs root (ip netns); addresses are from 10.199.0.0/16 on veths that
//! exist only inside the test's namespaces.

use smclo_apptests::*;
use std::fs;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn wrk_in(
    env: &mut Env,
    mode: Mode,
    ns: &str,
    name: &str,
    script: &std::path::Path,
    url: &str,
) -> Proc {
    spawn_wrk(
        env,
        mode,
        Some(ns),
        name,
        &["-t2", "-c8", "-d2s"],
        script,
        url,
    )
}

fn check_wrk(p: &mut Proc, what: &str) -> u64 {
    p.wait_ok(T);
    let w = Wrk::parse(p);
    // Wrong bodies here would be cross-talk between the pairs.
    w.assert_clean(what, 200, "");
    w.reqs
}

#[test]
fn netns_veth_nginx_wrk_curl() {
    let mut env = Env::new("netns-veth");
    let (a, b) = (env.netns("srv"), env.netns("cli"));
    veth(&a, &b, "10.199.1.1", "10.199.1.2");
    let small = b"served across a veth pair\n".to_vec();
    let (root, big) = web_root(&env, &small, 0xfeed);
    let nginx = start_nginx(
        &mut env,
        Mode::Smclo,
        Some(&a.name),
        "10.199.1.1:8080",
        &root,
        "a",
    );
    let script = wrk_check_script(&env, "check", small.len());
    let s0 = env.stats();
    let mut w = wrk_in(
        &mut env,
        Mode::Smclo,
        &b.name,
        "wrk",
        &script,
        "http://10.199.1.1:8080/small.txt",
    );
    check_wrk(&mut w, "wrk across namespaces");
    let (bodies, _) = curl(
        &mut env,
        Mode::Smclo,
        Some(&b.name),
        "curl",
        &["http://10.199.1.1:8080/big.bin".to_string()],
    );
    assert_eq!(
        sha256_bytes(&env, "b", &bodies[0]),
        sha256_bytes(&env, "b0", &big),
        "1 MiB body differs across namespaces"
    );
    let (logged, _, _) = nginx_log_bytes(&env, "a");
    let d = delta(&s0, &env.stats());
    // As in nginx_wrk: nginx's log, give or take a request and response
    // per wrk connection when wrk stopped.
    let per = (small.len() + 400) as u64;
    let (lo, hi) = wrk_slack(logged, 8, per);
    assert_smc("nginx/wrk across namespaces", &d, 9, lo, hi, &nginx.logs());
    let mut nginx = nginx;
    nginx.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

#[test]
fn netns_identical_addresses_no_crosstalk() {
    let mut env = Env::new("netns-twins");
    let (a1, b1, a2, b2) = (
        env.netns("a1"),
        env.netns("b1"),
        env.netns("a2"),
        env.netns("b2"),
    );
    // The same addresses and port in both pairs.
    veth(&a1, &b1, "10.199.2.1", "10.199.2.2");
    veth(&a2, &b2, "10.199.2.1", "10.199.2.2");
    let (r1, r2) = (env.path("www1"), env.path("www2"));
    fs::create_dir_all(&r1).unwrap();
    fs::create_dir_all(&r2).unwrap();
    let c1 = b"pair ONE, accelerated\n".repeat(5);
    let c2 = b"pair two, plain TCP\n".repeat(9);
    assert_ne!(c1.len(), c2.len());
    fs::write(r1.join("f.txt"), &c1).unwrap();
    fs::write(r2.join("f.txt"), &c2).unwrap();
    let n1 = start_nginx(
        &mut env,
        Mode::Smclo,
        Some(&a1.name),
        "10.199.2.1:8080",
        &r1,
        "one",
    );
    let n2 = start_nginx(
        &mut env,
        Mode::Plain,
        Some(&a2.name),
        "10.199.2.1:8080",
        &r2,
        "two",
    );
    let url = "http://10.199.2.1:8080/f.txt";
    let (s1, s2) = (
        wrk_check_script(&env, "one", c1.len()),
        wrk_check_script(&env, "two", c2.len()),
    );

    // Both pairs under load at the same time.
    let s0 = env.stats();
    let mut w1 = wrk_in(&mut env, Mode::Smclo, &b1.name, "wrk-one", &s1, url);
    let mut w2 = wrk_in(&mut env, Mode::Plain, &b2.name, "wrk-two", &s2, url);
    check_wrk(&mut w1, "pair one (smclo)");
    check_wrk(&mut w2, "pair two (plain)");
    let (b, _) = curl(
        &mut env,
        Mode::Smclo,
        Some(&b1.name),
        "curl-one",
        &[url.to_string()],
    );
    assert_eq!(b[0], c1, "pair one's client got someone else's content");
    let (b, _) = curl(
        &mut env,
        Mode::Plain,
        Some(&b2.name),
        "curl-two",
        &[url.to_string()],
    );
    assert_eq!(b[0], c2, "pair two's client got someone else's content");
    let d = delta(&s0, &env.stats());
    let (logged1, _, _) = nginx_log_bytes(&env, "one");
    let per = (c1.len() + 400) as u64;
    let (lo, hi) = wrk_slack(logged1, 8, per);
    assert_smc("pair one", &d, 9, lo, hi, &n1.logs());

    // A client under smclo in pair two: the device knows a listener on
    // 10.199.2.1:8080 (pair one's), but this client's server is pair two's
    // plain nginx. It must get pair two's content over plain TCP.
    let s0 = env.stats();
    let t0 = std::time::Instant::now();
    let (b, _) = curl(
        &mut env,
        Mode::Smclo,
        Some(&b2.name),
        "curl-two-smclo",
        &[url.to_string()],
    );
    let took = t0.elapsed();
    assert_eq!(b[0], c2, "smclo client in pair two got pair one's content");
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.conns_opened, 0,
        "an SMC-D connection for pair two's plain server: {d:?}"
    );
    assert_eq!(
        d.xfer_bytes, 0,
        "bytes over SMC-D for pair two's plain server: {d:?}"
    );
    eprintln!(
        "smclo client in the plain pair: {} in {took:?}",
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallbacks(),
        1,
        "want one client fallback: {}",
        d.fallbacks_desc()
    );
    assert_eq!(
        d.fallback_client.iter().sum::<u64>(),
        1,
        "the fallback is the client's: {}",
        d.fallbacks_desc()
    );
    drop((n1, n2));
}
