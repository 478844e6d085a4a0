//! An established SMC-D connection passed to another process with
//! `SCM_RIGHTS` (a dispatcher handing connections to a worker) goes on in
//! that process through shared memory, as a TCP socket would: the worker
//! reads and writes it, every byte checked by the client and counted by
//! the device. The dispatcher closes its copy right after passing it,
//! before the worker reads it, or exits before the worker reads it; none of
//! these ends the connection. A process may pass a connection to itself,
//! with `SO_LINGER` 0 set, or twice in one message; a receiver whose
//! control buffer is too small for all the connections gets those that
//! fit, the others end. A worker may receive them with `recvmmsg`, several
//! messages per call.

use smclo_apptests::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

const COUNT: u64 = 4;
const SIZE: u64 = 200_000;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/pass_conn.py")
}

/// pass_conn.py's dispatcher under `smclo run` on `port` for `count`
/// connections (`hold`: see pass_conn.py), once it says it is ready.
fn dispatcher(env: &mut Env, port: &str, count: &str, hold: &str) -> Proc {
    dispatcher_with(env, port, count, hold, &[])
}

/// [`dispatcher`] with `vars` in its environment.
fn dispatcher_with(
    env: &mut Env,
    port: &str,
    count: &str,
    hold: &str,
    vars: &[(&str, &str)],
) -> Proc {
    let s = script();
    let args = [s.to_str().unwrap(), "dispatch", port, count, hold];
    let mut cmd = env.command(Mode::Smclo, None, "python3", &args);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let mut p = env.spawn_cmd("dispatcher", cmd);
    p.wait_stdout("ready", Duration::from_secs(20), &[]);
    p
}

/// echo_check.py's client under `smclo run`: one connection to `port`,
/// `size` bytes each way.
fn client(env: &mut Env, name: &str, port: &str, size: u64) -> Proc {
    let echo = script().with_file_name("echo_check.py");
    let size = size.to_string();
    let args = [
        echo.to_str().unwrap(),
        "client",
        "127.0.0.1",
        port,
        "1",
        &size,
    ];
    env.spawn(Mode::Smclo, name, "python3", &args)
}

/// A dispatcher under `smclo run` passes `COUNT` connections to its worker
/// (`hold`: see pass_conn.py); a client under `smclo run` checks each echo.
fn passed_connections_stay_smc(hold: &str) {
    let mut env = Env::new(&format!("passing-{hold}"));
    let ps = free_port().to_string();
    let mut server = dispatcher(&mut env, &ps, &COUNT.to_string(), hold);
    let s0 = env.stats();
    // One client per connection, all at once: with `hold` the worker
    // serves none before the dispatcher has passed them all.
    let mut clients: Vec<Proc> = (0..COUNT)
        .map(|i| client(&mut env, &format!("client-{i}"), &ps, SIZE))
        .collect();
    let (mut sent, mut received) = (0, 0);
    for c in &mut clients {
        c.wait_ok(Duration::from_secs(60));
        let [s, r] = ok_numbers(c, &server.logs())[..] else {
            panic!("echo_check.py client printed no byte counts")
        };
        (sent, received) = (sent + s, received + r);
    }
    let logs = server.logs();
    assert_eq!((sent, received), (COUNT * SIZE, COUNT * SIZE), "{logs}");
    let st = server.wait(Duration::from_secs(30));
    assert!(st.success(), "dispatcher: {st:?}\n{}", server.logs());
    if hold != "exit" {
        let out = server.stdout_str();
        assert_eq!(out.lines().last(), Some(&*format!("ok {COUNT}")), "{logs}");
    }
    let d = delta(&s0, &env.stats());
    assert_smc(
        &format!("passed ({hold})"),
        &d,
        COUNT,
        sent + received,
        sent + received,
        &server.logs(),
    );
    assert_eq!(d.conns_opened, COUNT, "{d:?}\n{}", server.logs());
    assert_clean(&env, false);
}

#[test]
fn a_connection_passed_to_a_worker_stays_smc() {
    passed_connections_stay_smc("now");
}

#[test]
fn a_connection_in_flight_when_the_dispatcher_closes_it_stays_smc() {
    passed_connections_stay_smc("hold");
}

#[test]
fn a_connection_in_flight_when_the_dispatcher_exits_stays_smc() {
    passed_connections_stay_smc("exit");
}

#[test]
fn a_connection_passed_to_the_same_process_stays_smc() {
    passed_connections_stay_smc("self");
}

/// The same process holds both descriptors for a while: closing the one
/// it passed lets go of nothing the received one uses (the device still
/// counts every byte).
#[test]
fn a_connection_passed_to_the_same_process_and_closed_late_stays_smc() {
    passed_connections_stay_smc("self-late");
}

/// A worker that receives its connections with `recvmmsg`, as many as
/// have come (`MSG_WAITFORONE`), serves them through shared memory.
#[test]
fn a_connection_received_with_recvmmsg_stays_smc() {
    passed_connections_stay_smc("mmsg");
}

/// Two messages, each with a connection, in every `recvmmsg` of the
/// worker: both connections go on through shared memory.
#[test]
fn two_connections_received_in_one_recvmmsg_stay_smc() {
    passed_connections_stay_smc("mmsg2");
}

/// A client passes its socket to another process right after a
/// non-blocking `connect`, its handshake undecided: the handshake is
/// decided before the descriptor leaves (as before `fork` and exec), and
/// the SMC-D connection goes with it.
#[test]
fn a_connecting_socket_passed_to_another_process_stays_smc() {
    let mut env = Env::new("passing-connect");
    let port = free_port();
    let (s, echo) = (script(), script().with_file_name("echo_check.py"));
    let ps = port.to_string();
    let mut server = env.spawn(
        Mode::Smclo,
        "server",
        "python3",
        &[echo.to_str().unwrap(), "listen", "127.0.0.1", &ps, "1"],
    );
    server.wait_stdout("ready", Duration::from_secs(20), &[]);
    let s0 = env.stats();
    let client = env.run(
        Mode::Smclo,
        "connector",
        "python3",
        &[s.to_str().unwrap(), "connect", &ps, &SIZE.to_string()],
        Duration::from_secs(60),
    );
    let logs = server.logs();
    let [sent, received] = ok_numbers(&client, &logs)[..] else {
        panic!("pass_conn.py use printed no byte counts")
    };
    assert_eq!((sent, received), (SIZE, SIZE));
    server.wait(Duration::from_secs(30));
    let d = delta(&s0, &env.stats());
    assert_smc("passed while connecting", &d, 1, 2 * SIZE, 2 * SIZE, &logs);
    assert_eq!(d.conns_opened, 1, "{d:?}\n{logs}");
    assert_clean(&env, false);
}

/// `SO_LINGER` 0 applies to the last close: the dispatcher's close of a
/// connection it passed aborts nothing (the worker sets the option off
/// again before its own close, as a program that wants an orderly end
/// would).
#[test]
fn a_connection_passed_with_linger_zero_stays_smc() {
    passed_connections_stay_smc("linger");
}

/// Two descriptors of one connection in one message: one connection in
/// the worker, which closes one of them and serves through the other.
#[test]
fn a_connection_passed_twice_in_one_message_stays_smc() {
    passed_connections_stay_smc("dup");
}

/// Two connections per message to a worker that takes one descriptor
/// per message (`MSG_CTRUNC`): it serves the one it got, through shared
/// memory; the other's client sees its connection end instead of
/// waiting, and nothing of it stays in the worker (the files the worker
/// opens next read as files).
#[test]
fn a_connection_truncated_from_a_message_ends() {
    let mut env = Env::new("passing-two");
    let ps = free_port().to_string();
    let mut server = dispatcher(&mut env, &ps, &COUNT.to_string(), "two");
    let s0 = env.stats();
    let mut clients: Vec<Proc> = (0..COUNT)
        .map(|i| client(&mut env, &format!("client-{i}"), &ps, 1000))
        .collect();
    let mut served = 0;
    for c in &mut clients {
        if c.wait(Duration::from_secs(30)).success() {
            assert_eq!(ok_numbers(c, &server.logs()), vec![1000, 1000]);
            served += 1;
        }
    }
    let st = server.wait(Duration::from_secs(30));
    let logs = server.logs();
    assert!(st.success(), "dispatcher: {st:?}\n{logs}");
    assert_eq!(
        server.stdout_str().lines().last(),
        Some(&*format!("ok {}", COUNT / 2)),
        "{logs}"
    );
    assert_eq!(served, COUNT / 2, "{logs}");
    let d = delta(&s0, &env.stats());
    assert_eq!((d.conns_opened, d.fallbacks()), (COUNT, 0), "{d:?}\n{logs}");
    assert_eq!(env.stats().conns_active, 0, "{d:?}\n{logs}");
}

/// A worker without smclo cannot read an SMC-D connection: it gets the
/// connection's descriptor and one more (the parcel), no more, and once
/// it closes them the client sees its connection end instead of waiting.
#[test]
fn a_connection_passed_to_a_process_without_smclo_ends_when_it_closes() {
    let mut env = Env::new("passing-plain");
    let ps = free_port().to_string();
    let mut server = dispatcher(&mut env, &ps, "1", "plain");
    let t0 = std::time::Instant::now();
    let mut c = client(&mut env, "client", &ps, 1000);
    let st = c.wait(Duration::from_secs(30));
    assert!(!st.success(), "{}", c.logs());
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let st = server.wait(Duration::from_secs(30));
    let logs = server.logs();
    assert!(st.success(), "dispatcher: {st:?}\n{logs}");
    assert!(logs.contains("fds 2"), "{logs}");
}

/// A connection passed as soon as it is accepted, its handshake
/// undecided, goes as TCP (PASSED at both ends), and the listener it came
/// from leaves the registry; another listener of the same process stays
/// registered: its connection is SMC-D. The dispatcher does not spin
/// (`SMCLO_SPIN_US=0`), so that its non-blocking `accept` returns before
/// the client's confirmation: with a spin, a quick client (CI met one)
/// ends the handshake within the `accept`, and the connection goes as
/// SMC-D.
#[test]
fn a_connection_passed_undecided_leaves_other_listeners_registered() {
    let mut env = Env::new("passing-early");
    let ps = free_port().to_string();
    let mut server = dispatcher_with(&mut env, &ps, "1", "early", &[("SMCLO_SPIN_US", "0")]);
    let other = server
        .stdout_str()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    let s0 = env.stats();
    for (p, name) in [(&ps, "client-passed"), (&other, "client-other")] {
        let mut c = client(&mut env, name, p, 1000);
        c.wait_ok(Duration::from_secs(30));
        assert_eq!(ok_numbers(&c, &server.logs()), vec![1000, 1000]);
    }
    let st = server.wait(Duration::from_secs(30));
    let logs = server.logs();
    assert!(st.success(), "dispatcher: {st:?}\n{logs}");
    let d = delta(&s0, &env.stats());
    let what = d.fallbacks_desc();
    assert_eq!(
        d.fallback(smclo_wire::reason::Reason::Passed),
        (1, 1),
        "{what}\n{logs}"
    );
    assert_eq!((d.conns_opened, d.fallbacks()), (1, 2), "{d:?}\n{logs}");
}
