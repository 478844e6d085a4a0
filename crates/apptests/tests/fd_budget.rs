//! Descriptors: an SMC-D connection holds more descriptors than a TCP one
//! (its channel, the hidden TCP socket, the DMB's memfd), so smclo keeps
//! its own within a share of `RLIMIT_NOFILE` and lets further connections
//! fall back to TCP (MEM) instead of making the program hit `EMFILE`.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const CONNS: u64 = 900;

/// `cmd` runs with a soft and hard `RLIMIT_NOFILE` of `n`.
fn limit_nofile(cmd: &mut Command, n: u64) {
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls setrlimit, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let rl = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
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
    let port = free_port();
    let ps = port.to_string();
    let mut cmd = env.command(
        Mode::Smclo,
        None,
        "python3",
        &[&script("echo_server.py"), &ps],
    );
    limit_nofile(&mut cmd, 1024);
    let mut server = env.spawn_cmd("echo-server", cmd);
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let n = CONNS.to_string();
    let mut cmd = env.command(
        Mode::Smclo,
        None,
        "python3",
        &[&script("echo_client.py"), &ps, &n],
    );
    limit_nofile(&mut cmd, client_limit);
    let mut client = env.spawn_cmd("echo-client", cmd);
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
