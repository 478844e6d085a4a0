//! redis replication under `smclo run`: a replica (redis as a client)
//! syncs from a master (full sync: the master forks to write the RDB, then
//! sends it), then follows the command stream. Disk-based and diskless
//! (the forked child writes the RDB into a pipe the master forwards).

use smclo_apptests::*;
use std::fs;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// redis-server `name` under smclo with the configuration lines `extra`,
/// in a directory of its own.
fn start(env: &mut Env, name: &str, extra: &str) -> (Proc, u16) {
    let dir = env.path(name);
    fs::create_dir_all(&dir).unwrap();
    start_redis_with(env, Mode::Smclo, name, &dir, extra)
}

fn cli(env: &mut Env, port: u16, args: &[&str]) -> String {
    let ps = port.to_string();
    let mut a = vec!["-p", ps.as_str()];
    a.extend_from_slice(args);
    env.run(Mode::Smclo, "redis-cli", "redis-cli", &a, T)
        .stdout_str()
}

fn replication(diskless: bool) {
    let mut env = Env::new(if diskless {
        "repl-diskless"
    } else {
        "repl-disk"
    });
    let opts = if diskless {
        "repl-diskless-sync yes\nrepl-diskless-sync-delay 0\n"
    } else {
        "repl-diskless-sync no\n"
    };
    let (master, mport) = start(&mut env, "master", opts);
    // 20000 keys of 1 KiB before the replica exists: a full sync.
    let b = env.run(
        Mode::Smclo,
        "redis-benchmark",
        "redis-benchmark",
        &[
            "-p",
            &mport.to_string(),
            "-t",
            "set",
            "-r",
            "20000",
            "-n",
            "60000",
            "-d",
            "1024",
            "-c",
            "8",
            "-q",
        ],
        T,
    );
    assert!(b.stdout_str().contains("SET: "), "{}", b.logs());
    let keys = cli(&mut env, mport, &["DBSIZE"])
        .trim()
        .parse::<u64>()
        .unwrap();
    assert!(keys > 15000, "only {keys} keys");
    let s0 = env.stats();
    let (replica, rport) = start(
        &mut env,
        "replica",
        &format!("replicaof 127.0.0.1 {mport}\n"),
    );
    let t0 = Instant::now();
    loop {
        let info = cli(&mut env, rport, &["INFO", "replication"]);
        if info_field(&info, "master_link_status").as_deref() == Some("up")
            && info_field(&info, "master_sync_in_progress").as_deref() == Some("0")
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "replica did not sync: {info}\n{}\n{}",
            master.logs(),
            replica.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Then the command stream: writes on the master appear on the replica.
    let v = pseudo_random(200_000, 42);
    env.run_stdin(
        Mode::Smclo,
        "cli-set",
        "redis-cli",
        &["-p", &mport.to_string(), "-x", "SET", "after-sync"],
        &v,
        T,
    );
    let t0 = Instant::now();
    loop {
        if cli(&mut env, rport, &["STRLEN", "after-sync"]).trim() == v.len().to_string() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "write after sync not replicated"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        cli(&mut env, rport, &["DBSIZE"]).trim(),
        (keys + 1).to_string(),
        "replica's key count"
    );
    // Same data on both sides: compare a sample of keys byte for byte.
    // redis-benchmark -r writes random keys, so sample keys that exist.
    for _ in 0..3 {
        let k = cli(&mut env, mport, &["RANDOMKEY"]).trim().to_string();
        assert!(k.starts_with("key:"), "RANDOMKEY on the master said {k:?}");
        let k = k.as_str();
        let a = cli(&mut env, mport, &["GET", k]);
        let b = cli(&mut env, rport, &["GET", k]);
        assert!(a.len() > 1000, "{k} missing on the master: {a:?}");
        assert_eq!(a, b, "{k} differs between master and replica");
    }
    let got = env
        .run(
            Mode::Smclo,
            "cli-get",
            "redis-cli",
            &["-p", &rport.to_string(), "--raw", "GET", "after-sync"],
            T,
        )
        .stdout();
    assert!(
        got[..got.len() - 1] == v[..],
        "replicated 200 KB value differs"
    );
    let d = delta(&s0, &env.stats());
    // The RDB alone is ~keys * 1 KiB; all of it must have gone through
    // shared memory (the replica's link and every redis-cli).
    eprintln!("replication (diskless {diskless}): {d:?}");
    assert_eq!(
        d.fallbacks(),
        0,
        "fallbacks: {}\n{}\n{}",
        d.fallbacks_desc(),
        master.logs(),
        replica.logs()
    );
    assert!(
        d.xfer_bytes > keys * 1024,
        "xfer_bytes {} < the RDB's {} KiB of values",
        d.xfer_bytes,
        keys
    );
}

#[test]
fn redis_replication_disk() {
    replication(false);
}

#[test]
fn redis_replication_diskless() {
    replication(true);
}
