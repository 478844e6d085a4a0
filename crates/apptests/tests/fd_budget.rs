//! Descriptors: an SMC-D connection holds more descriptors than a TCP one
//! (its channel, the hidden TCP socket, the DMB's memfd). Where the hard
//! `RLIMIT_NOFILE` is above the soft one, smclo keeps its own above the
//! program's soft limit and the program sees and gets exactly what it
//! would over TCP; where they are equal, smclo keeps its own within a
//! share of the limit and lets further connections fall back to TCP (MEM)
//! instead of making the program hit `EMFILE`.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const CONNS: u64 = 900;

/// `cmd` runs with a soft `RLIMIT_NOFILE` of `soft` and a hard one of
/// `hard`.
fn limit_nofile_split(cmd: &mut Command, soft: u64, hard: u64) {
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls setrlimit, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let rl = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn script(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fd_budget")
        .join(name)
        .display()
        .to_string()
}

/// `script` (in tests/fd_budget) under `smclo run` with `args` and an
/// `RLIMIT_NOFILE` of `limit`.
fn python(env: &mut Env, name: &str, script_name: &str, args: &[&str], limit: u64) -> Proc {
    python_split(env, Mode::Smclo, name, script_name, args, (limit, limit))
}

/// `script` in `mode` with `args` and the soft and hard `RLIMIT_NOFILE`
/// `limits`.
fn python_split(
    env: &mut Env,
    mode: Mode,
    name: &str,
    script_name: &str,
    args: &[&str],
    limits: (u64, u64),
) -> Proc {
    let path = script(script_name);
    let mut argv = vec![path.as_str()];
    argv.extend_from_slice(args);
    let mut cmd = env.command(mode, None, "python3", &argv);
    limit_nofile_split(&mut cmd, limits.0, limits.1);
    env.spawn_cmd(name, cmd)
}

/// The python echo server under `smclo run` with an `RLIMIT_NOFILE` of
/// `limit`, listening; returns it and its port.
fn echo_server(env: &mut Env, limit: u64) -> (Proc, u16) {
    let port = free_port();
    let mut server = python(
        env,
        "echo-server",
        "echo_server.py",
        &[&port.to_string()],
        limit,
    );
    wait_listen(&mut server, port);
    (server, port)
}

/// A python event-loop echo server and a client, both under `smclo run`,
/// the server with `RLIMIT_NOFILE` 1024 and the client with
/// `client_limit`, 900 concurrent connections with distinct payloads:
/// every one is served byte-exact (over TCP the same programs serve them
/// all) and the server survives. Returns the counters' change.
fn nine_hundred_connections(client_limit: u64) -> Delta {
    let mut env = Env::new("fd-budget");
    // A loaded machine must not turn a handshake into a TIMEOUT fallback.
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let (mut server, port) = echo_server(&mut env, 1024);
    let s0 = env.stats();
    let (ps, n) = (port.to_string(), CONNS.to_string());
    let mut client = python(
        &mut env,
        "echo-client",
        "echo_client.py",
        &[&ps, &n],
        client_limit,
    );
    // A fallback that waited for the handshake's timeout would take
    // 10 s per connection; a decline is answered at once.
    client.wait(Duration::from_secs(120));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    assert!(
        server.alive(),
        "the server died (EMFILE in accept?)\n{logs}"
    );
    assert_eq!(
        client.stdout_str().trim(),
        format!("SERVED {CONNS} BAD 0"),
        "not every connection was served byte-exact\n{logs}"
    );
    let d = delta(&s0, &env.stats());
    eprintln!(
        "{} SMC-D connections, xfer_bytes {}, fallbacks: {}",
        d.conns_opened,
        d.xfer_bytes,
        d.fallbacks_desc()
    );
    assert!(
        d.conns_opened > 0 && d.xfer_bytes > 0,
        "no connection went through shared memory: {d:?}\n{logs}"
    );
    assert!(
        d.conns_opened < CONNS,
        "all {CONNS} connections were SMC-D under a 1024 descriptor limit: {d:?}"
    );
    server.stop(Duration::from_secs(5));
    d
}

/// Both at 1024: the client runs short first and does not propose (MEM);
/// its server sees plain TCP clients.
#[test]
fn nine_hundred_connections_under_a_1024_descriptor_limit() {
    let d = nine_hundred_connections(1024);
    let mem = d.fallback_client[Reason::Mem.index()];
    assert_eq!(
        d.conns_opened + mem,
        CONNS,
        "every connection is SMC-D or fell back for lack of descriptors (MEM): {}",
        d.fallbacks_desc()
    );
    assert_eq!(
        mem + d.fallback_server[Reason::PeerNoSmc.index()],
        d.fallbacks(),
        "other fallbacks: {}",
        d.fallbacks_desc()
    );
}

/// Only the server at 1024: it declines (MEM), and the client falls back
/// at once on the decline, counting the server's reason, instead of
/// waiting for a timeout.
#[test]
fn server_short_of_descriptors_declines() {
    let d = nine_hundred_connections(16384);
    let mem = d.fallback_server[Reason::Mem.index()];
    assert_eq!(
        d.conns_opened + mem,
        CONNS,
        "every connection is SMC-D or declined by the server for lack of descriptors (MEM): {}",
        d.fallbacks_desc()
    );
    assert_eq!(
        mem + d.fallback_client[Reason::Mem.index()],
        d.fallbacks(),
        "other fallbacks: {}",
        d.fallbacks_desc()
    );
}

/// The descriptors of process `pid`: (sockets, DMB memfds, all).
fn fd_kinds(pid: u32) -> (usize, usize, usize) {
    let (mut sockets, mut memfds, mut all) = (0, 0, 0);
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("/proc/PID/fd") {
        let Ok(target) = std::fs::read_link(e.unwrap().path()) else {
            continue; // closed meanwhile
        };
        let t = target.to_string_lossy();
        all += 1;
        if t.starts_with("socket:") {
            sockets += 1;
        } else if t.contains("memfd:smclo-dmb") {
            memfds += 1;
        }
    }
    (sockets, memfds, all)
}

/// The python echo server and a client that holds `n` connections open,
/// both under `smclo run` with `RLIMIT_NOFILE` 20000 (far from the
/// budget) and `rmem` as ring size. Returns, per process (server, client),
/// how many sockets, DMB memfds and descriptors in all the `n` SMC-D
/// connections added.
fn descriptors_of_held_connections(n: usize, rmem: &str) -> [(usize, usize, usize); 2] {
    let mut env = Env::new("fd-count");
    env.extra_env.push(("SMCLO_RMEM".into(), rmem.into()));
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let (mut server, port) = echo_server(&mut env, 20000);
    let s0 = env.stats();
    let base_server = fd_kinds(server.pid());
    let (ps, ns) = (port.to_string(), n.to_string());
    let mut client = python(
        &mut env,
        "hold-client",
        "hold_client.py",
        &[&ps, &ns],
        20000,
    );
    client.wait_stdout("HELD", Duration::from_secs(60), &[&server]);
    // The client's descriptors before it connected: python with the same
    // script and no connection.
    let mut idle = python(
        &mut env,
        "idle-client",
        "hold_client.py",
        &[&ps, "0"],
        20000,
    );
    idle.wait_stdout("HELD", Duration::from_secs(60), &[]);
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.conns_opened,
        n as u64,
        "every connection is SMC-D: {}",
        d.fallbacks_desc()
    );
    let sub =
        |a: (usize, usize, usize), b: (usize, usize, usize)| (a.0 - b.0, a.1 - b.1, a.2 - b.2);
    let counts = [
        sub(fd_kinds(server.pid()), base_server),
        sub(fd_kinds(client.pid()), fd_kinds(idle.pid())),
    ];
    eprintln!(
        "{n} connections, rings {rmem}: (sockets, memfds, all) added: server {:?}, client {:?}",
        counts[0], counts[1]
    );
    client.stop(Duration::from_secs(5));
    idle.stop(Duration::from_secs(5));
    server.stop(Duration::from_secs(5));
    counts
}

/// An SMC-D connection holds, in each process, the program's descriptor
/// (the channel itself) and the hidden TCP socket, plus its DMB's memfd
/// while the pool could take the DMB back: 3 descriptors with a few
/// connections, never the 4 of a channel beside the program's duplicate.
/// Besides, a process holds a rendezvous listener and its eventfd once it
/// has connected, and the socket where closed memfds wait for an exec
/// (the core's `vault` module), whatever its number of connections.
#[test]
fn descriptors_per_smcd_connection() {
    const N: usize = 20;
    for (who, (sockets, memfds, all)) in ["server", "client"]
        .into_iter()
        .zip(descriptors_of_held_connections(N, "256k"))
    {
        assert!(
            sockets <= 2 * N + 2,
            "{who}: {sockets} sockets for {N} connections (2 each: the channel, the hidden TCP socket)"
        );
        assert!(memfds <= N, "{who}: {memfds} memfds for {N} connections");
        assert!(
            all <= 3 * N + 4,
            "{who}: {all} descriptors for {N} connections (at most 3 each)"
        );
    }
}

/// The program's descriptor is the connection's channel: duplicates, a
/// close of the original number, `dup2` onto it and the reuse of a closed
/// number behave as over TCP (`numbers_client.py` checks each), and every
/// connection went through shared memory.
#[test]
fn the_programs_numbers_are_the_channels() {
    let mut env = Env::new("fd-numbers");
    let (mut server, port) = echo_server(&mut env, 20000);
    let ps = port.to_string();
    let s0 = env.stats();
    let mut client = env.spawn(
        Mode::Smclo,
        "numbers-client",
        "python3",
        &[&script("numbers_client.py"), &ps],
    );
    let st = client.wait(Duration::from_secs(60));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    assert!(st.success(), "{logs}");
    assert_eq!(client.stdout_str().trim(), "OK 4", "{logs}");
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, 4, "{}\n{logs}", d.fallbacks_desc());
    assert_eq!(d.fallbacks(), 0, "{}\n{logs}", d.fallbacks_desc());
    server.stop(Duration::from_secs(5));
}

/// A DMB keeps its memfd only while the pool could take it back: with 1 MiB
/// rings the pool (`SMCLO_POOL_BYTES`, 16 MiB) holds 15 DMBs, so of 30
/// held connections at most 15 keep a memfd in each process (all 30 did,
/// though 15 of those DMBs were going to be unmapped when they closed).
#[test]
fn memfds_only_for_dmbs_the_pool_could_take_back() {
    const N: usize = 30;
    for (who, (sockets, memfds, _)) in ["server", "client"]
        .into_iter()
        .zip(descriptors_of_held_connections(N, "1m"))
    {
        assert!(
            sockets <= 2 * N + 2,
            "{who}: {sockets} sockets for {N} connections"
        );
        assert!(
            memfds <= 15,
            "{who}: {memfds} DMB memfds kept for {N} connections; the pool takes back 15"
        );
    }
}

/// A connection that an event loop closes gives its descriptors back at
/// once, also while the loop never sleeps: its epoll set's poll session,
/// which stays open as long as the loop finds work, held every member it
/// had polled, and a closed member's channel, hidden TCP socket and DMB
/// stayed open until the loop next slept (nginx under wrk's connection
/// churn ran out of its descriptor budget that way and declined with MEM).
#[test]
fn closed_connections_leave_a_busy_event_loop() {
    const N: usize = 60;
    let mut env = Env::new("fd-busy-loop");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    // Every connection proposes: the test is about the descriptors of
    // many short SMC-D connections (a client that learns short
    // connections, the default, makes most of them plain TCP).
    env.extra_env.push(("SMCLO_SHORT".into(), "smc".into()));
    let port = free_port();
    let (ps, ns) = (port.to_string(), N.to_string());
    let mut server = env.spawn(
        Mode::Smclo,
        "busy-server",
        "python3",
        &[&script("busy_server.py"), &ps, &ns],
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let mut client = env.spawn(
        Mode::Smclo,
        "seq-client",
        "python3",
        &[&script("seq_client.py"), &ps, &ns],
    );
    client.wait_ok(Duration::from_secs(60));
    server.wait_ok(Duration::from_secs(30));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, N as u64, "{}\n{logs}", d.fallbacks_desc());
    assert_eq!(d.fallbacks(), 0, "{}\n{logs}", d.fallbacks_desc());
    let out = server.stdout_str();
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("FDS "))
        .unwrap_or_else(|| panic!("no FDS line\n{logs}"));
    eprintln!("descriptors after the first and the last close, stale events: {line}");
    let v: Vec<usize> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let (first, last, stale) = (v[0], v[1], v[2]);
    assert_eq!(stale, 0, "epoll reported closed descriptors\n{logs}");
    // The pool may keep a DMB memfd or two more after the first close.
    assert!(
        last <= first + 4,
        "descriptors after the first and the last of {N} closed connections: {first} and {last}\n{logs}"
    );
}

/// The soft limit of most shells and of systemd's services.
const SOFT: u64 = 1024;

/// The hard limit of the tests with room above the soft one: systemd's
/// default (524288), or this process's hard limit where it is lower (it
/// cannot be raised without `CAP_SYS_RESOURCE`). It must leave the room
/// smclo asks for above a soft limit of [`SOFT`]: its own descriptors
/// (about 2 per connection) and as much again for the program to raise
/// its limit into.
fn split_hard() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, which we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) }, 0);
    let hard = rl.rlim_max.min(524288);
    assert!(
        hard >= 4 * SOFT + 64,
        "these tests need a hard RLIMIT_NOFILE of at least {} (have {hard})",
        4 * SOFT + 64
    );
    hard
}

/// Under a soft limit of 1024 with a higher hard one, a python event-loop
/// server and a client hold 1000 concurrent connections each, every one
/// SMC-D and byte-exact: smclo's descriptors live above the program's
/// soft limit (before: 42 SMC-D, then MEM fallbacks, then EMFILE in the
/// client).
#[test]
fn a_thousand_smcd_connections_under_a_soft_limit_of_1024() {
    const N: u64 = 1000;
    let limits = (SOFT, split_hard());
    let mut env = Env::new("fd-room");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let port = free_port();
    let ps = port.to_string();
    let mut server = python_split(
        &mut env,
        Mode::Smclo,
        "echo-server",
        "echo_server.py",
        &[&ps],
        limits,
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let n = N.to_string();
    let mut client = python_split(
        &mut env,
        Mode::Smclo,
        "echo-client",
        "echo_client.py",
        &[&ps, &n],
        limits,
    );
    client.wait(Duration::from_secs(120));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    assert!(server.alive(), "the server died\n{logs}");
    assert_eq!(
        client.stdout_str().trim(),
        format!("SERVED {N} BAD 0"),
        "not every connection was served byte-exact\n{logs}"
    );
    let d = delta(&s0, &env.stats());
    eprintln!(
        "{} SMC-D connections, xfer_bytes {}, fallbacks: {}",
        d.conns_opened,
        d.xfer_bytes,
        d.fallbacks_desc()
    );
    assert_eq!(d.conns_opened, N, "{}\n{logs}", d.fallbacks_desc());
    assert_eq!(d.fallbacks(), 0, "{}\n{logs}", d.fallbacks_desc());
    assert!(d.xfer_bytes > 0, "{d:?}");
    server.stop(Duration::from_secs(5));
}

/// The value after `key` on the line of `out` that starts with it.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {key} line in:\n{out}"))
}

/// `limit_client.py` against `port` in `mode` under a soft limit of 1024
/// and [`split_hard`]; its output.
fn limit_client(env: &mut Env, mode: Mode, port: u16) -> String {
    let ps = port.to_string();
    let mut c = python_split(
        env,
        mode,
        "limit-client",
        "limit_client.py",
        &[&ps],
        (SOFT, split_hard()),
    );
    let st = c.wait(Duration::from_secs(120));
    assert!(st.success(), "{}", c.logs());
    c.stdout_str()
}

/// Under `smclo run` the program sees its own soft limit (getrlimit,
/// sysconf, /proc/self/limits; a child, preloaded or not, started by exec,
/// posix_spawn or system, inherits it),
/// and meets EMFILE after as many connections as over TCP, at its own
/// limit, from socket, open, dup and pipe alike; when it raises its limit
/// it gets the new numbers as over TCP. Every connection under smclo is
/// SMC-D (before: getrlimit showed the limit, but EMFILE came 10
/// connections earlier than over TCP, after 42 SMC-D ones).
#[test]
fn the_program_meets_its_own_descriptor_limit() {
    let hard = split_hard();
    let mut env = Env::new("fd-own-limit");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let port = free_port();
    let ps = port.to_string();
    let mut server = python_split(
        &mut env,
        Mode::Smclo,
        "echo-server",
        "echo_server.py",
        &[&ps],
        (4 * SOFT, hard),
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let smclo = limit_client(&mut env, Mode::Smclo, port);
    let d = delta(&s0, &env.stats());
    let plain = limit_client(&mut env, Mode::Plain, port);
    eprintln!("under smclo:\n{smclo}over TCP:\n{plain}");
    let soft = SOFT.to_string();
    for key in ["SYSCONF", "PROC", "CHILD", "PLAINCHILD", "SPAWN", "SYSTEM"] {
        assert_eq!(field(&smclo, key), soft, "{key}\n{smclo}");
    }
    assert_eq!(field(&smclo, "GETRLIMIT"), format!("{SOFT} {hard}"));
    let emfile = libc::EMFILE.to_string();
    let want = format!(
        "{} MAXFD {} ERR {emfile} OTHERS {emfile} {emfile} {emfile}",
        field(&plain, "CONNS").split(' ').next().unwrap(),
        SOFT - 1
    );
    assert_eq!(field(&smclo, "CONNS"), want, "\n{smclo}");
    assert_eq!(field(&smclo, "BAD"), "0");
    assert_eq!(field(&smclo, "RAISED"), (SOFT + 16).to_string());
    assert_eq!(field(&smclo, "MORE"), format!("16 ERR {emfile} BAD 0"));
    let conns: u64 = field(&smclo, "CONNS")
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(d.conns_opened, conns + 16, "{}", d.fallbacks_desc());
    assert_eq!(d.fallbacks(), 0, "{}", d.fallbacks_desc());
    server.stop(Duration::from_secs(5));
}

/// A client that starts 1000 non-blocking connects at once (as
/// redis-benchmark does) under a soft limit of 1024 gets all of them, as
/// over TCP: the server's connections that its handshakes file for one
/// another, and the server's DMBs they have received, wait above the
/// program's limit (before: they filled it, and `socket` failed with
/// EMFILE after about 800 connections). Those that find no free
/// rendezvous slot of the device stay TCP (MAX_DMB); all others are
/// SMC-D.
#[test]
fn a_burst_of_non_blocking_connects_under_a_soft_limit_of_1024() {
    const N: u64 = 1000;
    let limits = (SOFT, split_hard());
    let mut env = Env::new("fd-burst");
    env.extra_env
        .push(("SMCLO_CLC_WAIT_MS".into(), "10000".into()));
    let port = free_port();
    let ps = port.to_string();
    let mut server = python_split(
        &mut env,
        Mode::Smclo,
        "echo-server",
        "echo_server.py",
        &[&ps],
        limits,
    );
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let n = N.to_string();
    let mut client = python_split(
        &mut env,
        Mode::Smclo,
        "burst-client",
        "burst_client.py",
        &[&ps, &n],
        limits,
    );
    client.wait(Duration::from_secs(120));
    let logs = format!("{}\n{}", client.logs(), server.logs());
    assert_eq!(
        client.stdout_str().trim(),
        format!("SERVED {N} BAD 0"),
        "not every connection was made and served byte-exact\n{logs}"
    );
    let d = delta(&s0, &env.stats());
    eprintln!(
        "{} SMC-D connections, fallbacks: {}",
        d.conns_opened,
        d.fallbacks_desc()
    );
    let max_dmb = d.fallback_client[Reason::MaxDmb.index()];
    assert_eq!(d.conns_opened + max_dmb, N, "{}", d.fallbacks_desc());
    assert_eq!(
        max_dmb + d.fallback_server[Reason::PeerNoSmc.index()],
        d.fallbacks(),
        "{}",
        d.fallbacks_desc()
    );
    assert!(d.conns_opened >= N / 2, "{}", d.fallbacks_desc());
    server.stop(Duration::from_secs(5));
}
