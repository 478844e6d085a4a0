//! Event loops under `smclo run`: in steady state a request/response
//! exchange makes (almost) no system call on either side, and an idle loop
//! sleeps (docs/ARCHITECTURE.md "Event loops").

use smclo_apptests::*;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

/// Whether `perf stat` can count system-call tracepoints here.
fn perf_usable() -> bool {
    Command::new("perf")
        .args(["stat", "-e", "raw_syscalls:sys_enter", "-x,", "--", "true"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn unchecked(why: &str) {
    panic!("{why}: system calls cannot be counted (./test.sh runs as root with perf and strace installed)");
}

/// The count in a `perf stat -x,` output file.
fn perf_count(path: &std::path::Path) -> u64 {
    let s = fs::read_to_string(path).unwrap_or_default();
    s.lines()
        .find(|l| l.contains("raw_syscalls:sys_enter"))
        .and_then(|l| l.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count in perf output:\n{s}"))
}

/// redis-server and redis-benchmark (GET, 8 connections), each pinned to
/// its own CPU, both under smclo run: system calls per request on each
/// side, counted by `perf stat` (tracepoint counting, which does not slow
/// the programs down as strace would). Before the fast path: about 2.4 on
/// the server and 7.3 on the client.
#[test]
fn redis_get_makes_almost_no_system_call_per_request() {
    if !perf_usable() {
        unchecked("perf stat cannot count raw_syscalls:sys_enter");
        return;
    }
    let mut env = Env::new("evloop-syscalls");
    let (server, port) = start_redis(&mut env, Mode::Smclo);
    let pin = |pid: u32, cpu: &str| {
        let st = Command::new("taskset")
            .args(["-a", "-p", "-c", cpu, &pid.to_string()])
            .output()
            .expect("taskset");
        assert!(st.status.success(), "taskset: {st:?}");
    };
    pin(server.pid(), "1");
    let s0 = env.stats();
    let n = 100_000u64;
    let srv_out = env.path("perf-server.txt");
    let mut perf_srv = Command::new("perf")
        .args(["stat", "-e", "raw_syscalls:sys_enter", "-x,", "-o"])
        .arg(&srv_out)
        .args(["-p", &server.pid().to_string()])
        .spawn()
        .expect("perf stat -p");
    std::thread::sleep(Duration::from_millis(300));
    let cli_out = env.path("perf-client.txt");
    let (ps, ns) = (port.to_string(), n.to_string());
    let cli = cli_out.display().to_string();
    let bench = env.run(
        Mode::Plain,
        "perf-redis-benchmark",
        "perf",
        &[
            "stat",
            "-e",
            "raw_syscalls:sys_enter",
            "-x,",
            "-o",
            &cli,
            "--",
            "taskset",
            "-c",
            "0",
            smclo_bin().to_str().unwrap(),
            "run",
            "--",
            "redis-benchmark",
            "-h",
            "127.0.0.1",
            "-p",
            &ps,
            "-t",
            "get",
            "-c",
            "8",
            "-n",
            &ns,
            "-q",
        ],
        T,
    );
    // SAFETY: SIGINT to the perf we started, by its pid: it writes its
    // count and exits.
    unsafe { libc::kill(perf_srv.id() as i32, libc::SIGINT) };
    perf_srv.wait().expect("perf stat -p exits");
    let d = delta(&s0, &env.stats());
    let logs = format!("{}\n{}", bench.logs(), server.logs());
    assert_smc("redis-benchmark GET", &d, 8, n * 10, n * 4096, &logs);
    let (srv, cl) = (perf_count(&srv_out), perf_count(&cli_out));
    let (ps_, pc) = (srv as f64 / n as f64, cl as f64 / n as f64);
    eprintln!("system calls per request: server {ps_:.3}, client {pc:.3} ({srv}, {cl})");
    assert!(
        ps_ < 0.5 && pc < 0.5,
        "system calls per request: server {ps_:.3}, client {pc:.3}\n{logs}"
    );
}

/// CPU time (utime + stime) of `pid` and its threads, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5), counted after the command name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Share of one core that `pids` used over `secs` seconds.
fn idle_shares(groups: &[&[u32]], secs: u64) -> Vec<f64> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = || -> Vec<u64> {
        groups
            .iter()
            .map(|g| g.iter().map(|&p| cpu_ticks(p)).sum())
            .collect()
    };
    let t0 = ticks();
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let t1 = ticks();
    let dt = start.elapsed().as_secs_f64();
    t0.iter()
        .zip(t1)
        .map(|(a, b)| (b - a) as f64 / hz / dt)
        .collect()
}

/// A client under smclo run that makes one exchange and then holds the
/// connection open, idle, for `secs` seconds.
fn idle_client(env: &mut Env, mode: Mode, port: u16, request: &str, secs: u64) -> Proc {
    let code = format!(
        "import socket,time\ns=socket.create_connection(('127.0.0.1',{port}))\n\
         s.sendall({request:?}.encode())\nassert s.recv(65536)\nprint('connected',flush=True)\ntime.sleep({secs})\n"
    );
    let mut p = env.spawn(mode, "idle-client", "python3", &["-c", &code]);
    p.wait_stdout("connected", Duration::from_secs(20), &[]);
    p
}

/// An idle redis-server and an idle nginx (master and workers), each with
/// an open SMC-D connection, use under 1% of a core over 10 s more than
/// the same idle programs without smclo (redis's own timers take about
/// 0.6% here): the loops sleep in the kernel after their spin.
#[test]
fn idle_event_loops_sleep() {
    let mut env = Env::new("evloop-idle");
    let plain_dir = env.tmp.join("plain-redis");
    fs::create_dir_all(&plain_dir).unwrap();
    let (plain_redis, pport) = start_redis_with(
        &mut env,
        Mode::Plain,
        "redis-server",
        &plain_dir,
        "dbfilename dump.rdb\nrdbcompression no\n",
    );
    let _pc = idle_client(&mut env, Mode::Plain, pport, "PING\r\n", 30);
    let s0 = env.stats();
    let (redis, rport) = start_redis(&mut env, Mode::Smclo);
    let _rc = idle_client(&mut env, Mode::Smclo, rport, "PING\r\n", 30);
    let (root, _) = web_root(&env, b"hello\n", 7);
    let nport = free_port();
    let nginx = start_nginx(
        &mut env,
        Mode::Smclo,
        None,
        &format!("127.0.0.1:{nport}"),
        &root,
        "idle",
    );
    let _nc = idle_client(
        &mut env,
        Mode::Smclo,
        nport,
        "GET /small.txt HTTP/1.1\r\nHost: x\r\n\r\n",
        30,
    );
    let d = delta(&s0, &env.stats());
    assert!(
        d.conns_opened >= 2 && d.fallbacks() == 0,
        "both idle connections are SMC-D: {d:?}"
    );
    let mut nginx_pids = vec![nginx.pid()];
    let kids = fs::read_to_string(format!("/proc/{0}/task/{0}/children", nginx.pid())).unwrap();
    nginx_pids.extend(kids.split_whitespace().map(|k| k.parse::<u32>().unwrap()));
    let shares = idle_shares(&[&[redis.pid()], &[plain_redis.pid()], &nginx_pids], 10);
    let (r, p, n) = (shares[0], shares[1], shares[2]);
    eprintln!(
        "idle: redis-server {:.3}% of a core (without smclo {:.3}%), nginx {:.3}%",
        r * 100.0,
        p * 100.0,
        n * 100.0
    );
    assert!(
        r < p + 0.01,
        "idle redis-server used {:.2}% of a core, {:.2}% without smclo",
        r * 100.0,
        p * 100.0
    );
    assert!(n < 0.01, "idle nginx used {:.2}% of a core", n * 100.0);
}
