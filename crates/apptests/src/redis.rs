//! redis-server, redis-cli and redis-benchmark as the tests run them: a
//! server on 127.0.0.1 with its configuration in the test's temp dir, or
//! one on the wildcard inside a network namespace with the clients in
//! another (routed and translated paths).

use crate::{free_port, pseudo_random, wait_listen, Env, Mode, Proc};
use std::fs::{self, File};
use std::path::Path;
use std::time::{Duration, Instant};

/// The bound on each redis-cli and redis-benchmark run.
const T: Duration = Duration::from_secs(60);

/// Extracts `key:value` from redis INFO output.
pub fn info_field(info: &str, key: &str) -> Option<String> {
    info.lines().find_map(|l| {
        l.strip_prefix(&format!("{key}:"))
            .map(|v| v.trim().to_string())
    })
}

/// Starts redis-server in `mode` on a free port with a config file in the
/// test's temp dir (no persistence unless BGSAVE is asked for, an RDB
/// file `dump.rdb` not compressed).
pub fn start_redis(env: &mut Env, mode: Mode) -> (Proc, u16) {
    let dir = env.tmp.clone();
    let extra = "dbfilename dump.rdb\nrdbcompression no\n";
    start_redis_with(env, mode, "redis-server", &dir, extra)
}

/// Starts redis-server (`name`) in `mode` on 127.0.0.1 at a free port,
/// without persistence, its configuration (with the lines `extra`), log
/// and files in `dir`; waits until it listens.
pub fn start_redis_with(
    env: &mut Env,
    mode: Mode,
    name: &str,
    dir: &Path,
    extra: &str,
) -> (Proc, u16) {
    let port = free_port();
    let conf = dir.join("redis.conf");
    fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\nsave \"\"\nappendonly no\n\
             dir {}\nlogfile {}\n{extra}\n",
            dir.display(),
            dir.join("redis.log").display()
        ),
    )
    .unwrap();
    let mut p = env.spawn(mode, name, "redis-server", &[conf.to_str().unwrap()]);
    wait_listen(&mut p, port);
    (p, port)
}

/// redis-server in `mode` inside network namespace `ns`, on the wildcard
/// at `port`, without persistence; waits until it listens.
pub fn start_redis_in(env: &mut Env, mode: Mode, ns: &str, port: u16) -> Proc {
    let port_s = port.to_string();
    let args = [
        "--port",
        &port_s,
        "--bind",
        "0.0.0.0",
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ];
    let cmd = env.command(mode, Some(ns), "redis-server", &args);
    let mut p = env.spawn_cmd("redis-server", cmd);
    wait_listen(&mut p, port);
    p
}

/// redis-cli in `mode` inside `ns` to `host:port` with `args`, its stdin
/// from the file `stdin` if given, which must succeed; its output, and
/// how long it took.
pub fn redis_cli_in(
    env: &mut Env,
    mode: Mode,
    ns: &str,
    (host, port): (&str, u16),
    args: &[&str],
    stdin: Option<&Path>,
) -> (String, Duration) {
    let port_s = port.to_string();
    let mut a = vec!["-h", host, "-p", &port_s];
    a.extend_from_slice(args);
    let mut cmd = env.command(mode, Some(ns), "redis-cli", &a);
    if let Some(f) = stdin {
        cmd.stdin(File::open(f).unwrap());
    }
    let t0 = Instant::now();
    let mut p = env.spawn_cmd("redis-cli", cmd);
    p.wait_ok(T);
    (p.stdout_str(), t0.elapsed())
}

/// PING by a redis-cli under `smclo run` inside `ns`, answered PONG; how
/// long it took.
pub fn redis_ping_in(env: &mut Env, ns: &str, to: (&str, u16)) -> Duration {
    let (pong, took) = redis_cli_in(env, Mode::Smclo, ns, to, &["ping"], None);
    assert_eq!(pong.trim(), "PONG");
    took
}

/// Sets key `v` to the hex of 256 KiB of [`pseudo_random`] bytes from
/// `seed` by a redis-cli in `mode` inside `ns` (`-x`, from a file of the
/// temp dir), answered OK; returns the hex.
pub fn redis_set_value_in(
    env: &mut Env,
    mode: Mode,
    ns: &str,
    to: (&str, u16),
    seed: u64,
) -> String {
    let value = pseudo_random(256 << 10, seed);
    let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
    let file = env.path("value");
    fs::write(&file, &hex).unwrap();
    let args = ["-x", "set", "v"];
    let (ok, _) = redis_cli_in(env, mode, ns, to, &args, Some(&file));
    assert_eq!(ok.trim(), "OK");
    hex
}

/// GET of key `v` by a redis-cli under `smclo run` inside `ns`, which
/// must come back as `hex` byte-exact.
pub fn redis_get_value_in(env: &mut Env, ns: &str, to: (&str, u16), hex: &str) {
    let (back, _) = redis_cli_in(env, Mode::Smclo, ns, to, &["get", "v"], None);
    assert!(
        back.trim_end() == hex,
        "the value came back changed ({} bytes for {})",
        back.len(),
        hex.len()
    );
}

/// redis-benchmark under `smclo run` inside `ns`: `requests` PINGs
/// (`-t ping`) to `host:port` from 4 clients, each request on a
/// connection of its own (`-k 0`); waits until it has succeeded.
pub fn redis_benchmark_ping_in(
    env: &mut Env,
    ns: &str,
    (host, port): (&str, u16),
    requests: u64,
) -> Proc {
    let (port_s, n) = (port.to_string(), requests.to_string());
    let bench = [
        "-h", host, "-p", &port_s, "-n", &n, "-c", "4", "-k", "0", "-t", "ping", "-q",
    ];
    let mut cmd = env.command(Mode::Smclo, Some(ns), "redis-benchmark", &bench);
    // Every connection proposes: these runs test the handshake on each (a
    // client that learns short connections, the default, makes most of
    // them plain TCP after 16).
    cmd.env("SMCLO_SHORT", "smc");
    let mut b = env.spawn_cmd("redis-benchmark", cmd);
    b.wait_ok(T);
    b
}
