//! redis-server and its own clients under `smclo run`.

use smclo_apptests::*;
use std::fs;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn info(env: &mut Env, mode: Mode, port: u16, section: &str) -> (String, usize) {
    let p = env.run(
        mode,
        "redis-cli-info",
        "redis-cli",
        &["-p", &port.to_string(), "INFO", section],
        T,
    );
    let out = p.stdout_str();
    // The reply as sent: "$<len>\r\n<body>\r\n"; redis-cli prints the body
    // and a newline.
    let body_len = out.len().saturating_sub(1);
    (out, body_len + format!("${body_len}\r\n").len() + 2)
}

/// The bytes redis counted (in + out) at the time of an INFO stats, plus
/// that INFO reply itself, which it sends after taking the numbers.
fn redis_bytes(env: &mut Env, mode: Mode, port: u16) -> u64 {
    let (out, reply_len) = info(env, mode, port, "stats");
    let i: u64 = info_field(&out, "total_net_input_bytes")
        .unwrap()
        .parse()
        .unwrap();
    let o: u64 = info_field(&out, "total_net_output_bytes")
        .unwrap()
        .parse()
        .unwrap();
    i + o + reply_len as u64
}

fn calls(cmdstats: &str, cmd: &str) -> u64 {
    let line = info_field(cmdstats, &format!("cmdstat_{cmd}"))
        .unwrap_or_else(|| panic!("no cmdstat_{cmd} in\n{cmdstats}"));
    line.split(',')
        .find_map(|kv| kv.strip_prefix("calls="))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn redis_benchmark_set_get() {
    redis_benchmark(1);
}

/// 16 requests in flight per connection: many replies per ring read.
#[test]
fn redis_benchmark_pipelined() {
    redis_benchmark(16);
}

fn redis_benchmark(pipeline: u32) {
    let mut env = Env::new("redis-bench");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let s0 = env.stats();
    let n = 20000u64;
    let (ps, ns, pl) = (port.to_string(), n.to_string(), pipeline.to_string());
    let bench = env.run(
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
            "8",
            "-n",
            &ns,
            "-P",
            &pl,
            "-q",
        ],
        T,
    );
    let out = bench.stdout_str();
    for t in ["SET", "GET"] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(&format!("{t}: "))
                    && l.contains("requests per second")),
            "redis-benchmark printed no {t} result:\n{}\n{}",
            bench.logs(),
            server.logs()
        );
    }
    // Every request reached the server, every SET stored 1024 bytes.
    let (cs, _) = info(&mut env, Mode::Smclo, port, "commandstats");
    assert_eq!(calls(&cs, "set"), n, "SET calls\n{cs}");
    assert_eq!(calls(&cs, "get"), n, "GET calls\n{cs}");
    let v = env.run(
        Mode::Smclo,
        "redis-cli-strlen",
        "redis-cli",
        &["-p", &port.to_string(), "STRLEN", "key:__rand_int__"],
        T,
    );
    assert_eq!(v.stdout_str().trim(), "1024");
    let moved = redis_bytes(&mut env, Mode::Smclo, port);
    let d = delta(&s0, &env.stats());
    // Every byte the server read or wrote went through the device: redis
    // counts them itself (total_net_{input,output}_bytes), and every client
    // byte is a server byte. The only bytes redis has not counted when it
    // reports are those of that INFO reply, which redis_bytes adds from
    // redis-cli's printout of it; that reconstruction may be off by a few
    // bytes (line endings), hence +-64 bytes.
    let (lo, hi) = (moved - 64, moved + 64);
    // 8 benchmark clients (its CONFIG GET probes reuse or add connections)
    // plus the three redis-cli runs.
    assert_smc(
        &format!("redis-benchmark -P {pipeline}"),
        &d,
        8 + 3,
        lo,
        hi,
        &format!("{}\n{}", bench.logs(), server.logs()),
    );
    assert!(moved > 2 * n * 1024, "redis moved only {moved} bytes");
}

#[test]
fn redis_cli_1mib_value() {
    let mut env = Env::new("redis-1mib");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let value = pseudo_random(1 << 20, 0x5eed_1234);
    let s0 = env.stats();
    let set = env.run_stdin(
        Mode::Smclo,
        "redis-cli-set",
        "redis-cli",
        &["-p", &port.to_string(), "-x", "SET", "big"],
        &value,
        T,
    );
    assert_eq!(set.stdout_str(), "OK\n", "{}", set.logs());
    let get = env.run(
        Mode::Smclo,
        "redis-cli-get",
        "redis-cli",
        &["-p", &port.to_string(), "--raw", "GET", "big"],
        T,
    );
    let mut got = get.stdout();
    assert_eq!(
        got.pop(),
        Some(b'\n'),
        "redis-cli output ends with a newline"
    );
    assert_eq!(got.len(), value.len(), "GET returned {} bytes", got.len());
    assert_eq!(
        sha256_bytes(&env, "got", &got),
        sha256_bytes(&env, "want", &value),
        "1 MiB value differs after SET/GET"
    );
    let d = delta(&s0, &env.stats());
    // Exactly the RESP bytes of the two commands and their replies: the
    // protocol is deterministic, and redis-cli sends nothing else in
    // non-interactive mode. Tolerance 0.
    let len = value.len();
    let set_req = format!("*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n${len}\r\n").len() + len + 2;
    let get_req = "*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n".len();
    let get_rep = format!("${len}\r\n").len() + len + 2;
    let want = (set_req + 5 + get_req + get_rep) as u64;
    assert_smc("redis-cli 1 MiB SET/GET", &d, 2, want, want, &server.logs());
    let mut server = server;
    server.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

/// Stops (`SIGSTOP`) or continues every process of `p`'s group.
fn signal_group(p: &Proc, sig: libc::c_int) {
    // SAFETY: kill(2) on the group the harness made for `p`.
    unsafe { libc::kill(-(p.pid() as i32), sig) };
}

/// redis-cli connects without blocking (hiredis: a non-blocking connect,
/// `poll` for writability, `connect` again to see that it is done) to a
/// redis-server that gets no CPU for 300 ms (stopped): the handshake waits
/// for the server's `accept` after `connect` returned, and every connection
/// is SMC-D, where a connect that waited a fixed time for the server
/// would fall back with TIMEOUT, as under load when redis-server does not
/// get a CPU in time.
#[test]
fn redis_cli_waits_for_a_late_server() {
    let mut env = Env::new("redis-late");
    let (mut server, port) = start_redis(&mut env, Mode::Smclo);
    let ps = port.to_string();
    let s0 = env.stats();
    let n = 3;
    for i in 0..n {
        signal_group(&server, libc::SIGSTOP);
        let key = format!("k{i}");
        let mut cli = env.spawn(
            Mode::Smclo,
            "redis-cli-late",
            "redis-cli",
            &["-p", &ps, "SET", &key, "v"],
        );
        std::thread::sleep(Duration::from_millis(300));
        signal_group(&server, libc::SIGCONT);
        cli.wait_ok(T);
        assert_eq!(cli.stdout_str(), "OK\n", "{}", cli.logs());
    }
    let d = delta(&s0, &env.stats());
    // Each SET's request and its +OK reply, nothing else.
    let want = n * ("*3\r\n$3\r\nSET\r\n$2\r\nk0\r\n$1\r\nv\r\n".len() + 5) as u64;
    assert_smc(
        "redis-cli to a late server",
        &d,
        n,
        want,
        want,
        &server.logs(),
    );
    server.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}

#[test]
fn redis_bgsave_during_load() {
    let mut env = Env::new("redis-bgsave");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let ps = port.to_string();
    let n = 60000u64;
    let s0 = env.stats();
    let mut bench = env.spawn(
        Mode::Smclo,
        "redis-benchmark",
        "redis-benchmark",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &ps,
            "-t",
            "set",
            "-r",
            "5000",
            "-d",
            "1024",
            "-c",
            "8",
            "-n",
            &n.to_string(),
            "-q",
        ],
    );
    // BGSAVE forks redis-server while the 8 clients keep going; the child
    // inherits every smclo descriptor. First wait until all 8 are connected,
    // then save up to 3 times while the benchmark runs, each save finished
    // (rdb_bgsave_in_progress:0) before the next.
    let mut cli_runs = 0u64;
    loop {
        let (c, _) = info(&mut env, Mode::Smclo, port, "clients");
        cli_runs += 1;
        let n: u64 = info_field(&c, "connected_clients")
            .unwrap()
            .parse()
            .unwrap();
        if n >= 9 {
            break;
        }
        assert!(
            bench.alive(),
            "redis-benchmark ended before its 8 clients were seen\n{}",
            bench.logs()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut saves = 0;
    while bench.alive() && saves < 3 {
        let r = env.run(
            Mode::Smclo,
            "redis-cli-bgsave",
            "redis-cli",
            &["-p", &ps, "BGSAVE"],
            T,
        );
        cli_runs += 1;
        let o = r.stdout_str();
        assert!(
            o.contains("Background saving started"),
            "BGSAVE: {o}\n{}",
            server.logs()
        );
        saves += 1;
        loop {
            let (p, _) = info(&mut env, Mode::Smclo, port, "persistence");
            cli_runs += 1;
            if info_field(&p, "rdb_bgsave_in_progress").as_deref() == Some("0") {
                assert_eq!(
                    info_field(&p, "rdb_last_bgsave_status").as_deref(),
                    Some("ok"),
                    "{p}\n{}",
                    server.logs()
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    bench.wait_ok(T);
    assert!(
        saves >= 1,
        "the benchmark ended before a BGSAVE could run; raise n"
    );
    eprintln!("{saves} BGSAVEs during the benchmark");
    let (cs, _) = info(&mut env, Mode::Smclo, port, "commandstats");
    cli_runs += 1;
    assert_eq!(calls(&cs, "set"), n, "SET calls\n{cs}\n{}", server.logs());
    assert!(
        fs::metadata(env.path("dump.rdb"))
            .map(|m| m.len() > 0)
            .unwrap_or(false),
        "no dump.rdb\n{}",
        server.logs()
    );
    // After the forks, new connections are still accelerated.
    let ping = env.run(
        Mode::Smclo,
        "redis-cli-ping",
        "redis-cli",
        &["-p", &ps, "PING"],
        T,
    );
    cli_runs += 1;
    assert_eq!(ping.stdout_str(), "PONG\n");
    let moved = redis_bytes(&mut env, Mode::Smclo, port);
    cli_runs += 1;
    let d = delta(&s0, &env.stats());
    // As in redis_benchmark_set_get.
    let (lo, hi) = (moved - 64, moved + 64);
    assert_smc(
        "redis BGSAVE under load",
        &d,
        8 + cli_runs,
        lo,
        hi,
        &format!("{}\n{}", bench.logs(), server.logs()),
    );
    let mut server = server;
    server.stop(Duration::from_secs(5));
    assert_clean(&env, true);
}
