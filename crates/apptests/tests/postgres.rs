//! PostgreSQL (postmaster accepts, forked backends wait in epoll) and pgbench
//! -S (its clients wait in poll/select), both under `smclo run` as the
//! postgres user, with a private device directory of that user. The data
//! read back over SMC-D is compared with the same query over plain TCP.

use smclo_apptests::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const USER: &str = "postgres";

/// `prog args` as the postgres user, under `smclo run` when `smclo`, with
/// the test's device directory.
fn as_postgres(env: &Env, dev: &Path, smclo: bool, prog: &str, args: &[&str]) -> Command {
    let mut c = Command::new("runuser");
    c.args([
        "-u",
        USER,
        "--",
        "env",
        &format!("SMCLO_DEVICE_DIR={}", dev.display()),
    ]);
    if smclo {
        c.arg(smclo_bin()).args(["run", "--"]);
    }
    c.arg(require(prog)).args(args);
    c.env_remove("LD_PRELOAD")
        .current_dir(&env.tmp)
        .process_group(0);
    c
}

/// conns_opened, xfer_bytes and all fallbacks of the device, read by the
/// postgres user (the directory is private to it).
fn stats(dev: &Path) -> (u64, u64, u64) {
    let out = Command::new("runuser")
        .args([
            "-u",
            USER,
            "--",
            "env",
            &format!("SMCLO_DEVICE_DIR={}", dev.display()),
        ])
        .arg(smclo_bin())
        .args(["stats", "--json"])
        .output()
        .expect("smclo stats");
    let j = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "smclo stats: {j} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let num = |key: &str, from: usize| -> (u64, usize) {
        let i = j[from..]
            .find(key)
            .unwrap_or_else(|| panic!("{key} in {j}"))
            + from
            + key.len();
        let n: String = j[i..].chars().take_while(|c| c.is_ascii_digit()).collect();
        (n.parse().unwrap(), i)
    };
    let (conns, _) = num("\"conns_opened\":", 0);
    let (xfer, _) = num("\"xfer_bytes\":", 0);
    let (mut fallbacks, mut at) = (0, 0);
    while j[at..].contains("\"client\":") {
        let (c, i) = num("\"client\":", at);
        let (s, k) = num("\"server\":", i);
        fallbacks += c + s;
        at = k;
    }
    (conns, xfer, fallbacks)
}

fn psql_md5(env: &mut Env, dev: &Path, smclo: bool, port: u16) -> String {
    let q = "SELECT count(*) || ' ' || md5(string_agg(aid::text || filler || abalance::text, ',' ORDER BY aid)) FROM pgbench_accounts";
    let c = as_postgres(
        env,
        dev,
        smclo,
        "psql",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-At",
            "-c",
            q,
            "postgres",
        ],
    );
    let mut p = env.spawn_cmd("psql", c);
    p.wait_ok(Duration::from_secs(60));
    p.stdout_str().trim().to_string()
}

#[test]
fn postgres_pgbench_select_only() {
    assert!(
        is_root(),
        "the postgres test runs the server as the postgres user and needs root"
    );
    let mut env = Env::new("postgres");
    let home = env.path("pg");
    fs::create_dir_all(&home).unwrap();
    let dev = home.join("dev");
    let chown = |p: &Path| {
        let st = Command::new("chown")
            .args(["-R", USER, p.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(st.success(), "chown {}", p.display());
    };
    chown(&home);
    fs::set_permissions(&env.tmp, fs::Permissions::from_mode(0o755)).unwrap();
    let bin = postgres_bindir();
    let data = home.join("data");
    let init = as_postgres(
        &env,
        &dev,
        false,
        bin.join("initdb").to_str().unwrap(),
        &["-D", data.to_str().unwrap(), "-A", "trust", "-U", USER],
    );
    env.spawn_cmd("initdb", init)
        .wait_ok(Duration::from_secs(120));
    let port = free_port();
    let ps = port.to_string();
    let server_args = postgres_server_args(&data, port, &home);
    let server_args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let c = as_postgres(
        &env,
        &dev,
        true,
        bin.join("postgres").to_str().unwrap(),
        &server_args,
    );
    let mut server = env.spawn_cmd("postgres", c);
    wait_listen(&mut server, port);
    let c = as_postgres(
        &env,
        &dev,
        true,
        "pgbench",
        &["-i", "-s", "1", "-h", "127.0.0.1", "-p", &ps, "postgres"],
    );
    env.spawn_cmd("pgbench-init", c)
        .wait_ok(Duration::from_secs(120));
    let (c0, x0, f0) = stats(&dev);
    let c = as_postgres(
        &env,
        &dev,
        true,
        "pgbench",
        &[
            "-S",
            "-c",
            "4",
            "-j",
            "2",
            "-T",
            "3",
            "-h",
            "127.0.0.1",
            "-p",
            &ps,
            "postgres",
        ],
    );
    let mut bench = env.spawn_cmd("pgbench", c);
    bench.wait_ok(Duration::from_secs(60));
    let out = bench.stdout_str();
    assert!(
        out.contains("number of failed transactions: 0")
            && out.contains("number of transactions actually processed"),
        "pgbench:\n{}",
        bench.logs()
    );
    let smc = psql_md5(&mut env, &dev, true, port);
    let (c1, x1, f1) = stats(&dev);
    let plain = psql_md5(&mut env, &dev, false, port);
    assert!(smc.starts_with("100000 "), "psql over SMC-D: {smc:?}");
    assert_eq!(
        smc, plain,
        "the table read over SMC-D differs from the one read over TCP"
    );
    eprintln!(
        "postgres: {} SMC-D connections, xfer_bytes {}, fallbacks {}",
        c1 - c0,
        x1 - x0,
        f1 - f0
    );
    assert_eq!(f1 - f0, 0, "fallbacks to TCP\n{}", server.logs());
    // pgbench's 4 clients and psql.
    assert!(
        c1 - c0 >= 5,
        "only {} SMC-D connections\n{}",
        c1 - c0,
        server.logs()
    );
    // psql's reply alone is the whole table's text and md5: far more than
    // nothing; pgbench -S moves ~100 bytes each way per transaction.
    assert!(x1 - x0 > 10_000, "xfer_bytes {}", x1 - x0);
    server.stop(Duration::from_secs(10));
}
