//! Programs that use io_uring under `smclo run`: io_uring's reads and
//! writes bypass the C library, so on an SMC-D connection (whose
//! descriptor is smclo's channel) they would go to the channel itself. A
//! process that uses io_uring keeps its connections TCP (`IO_URING`), and
//! its listeners leave the registry, however its ring was made.

use smclo_apptests::*;
use smclo_wire::reason::Reason;
use std::path::Path;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn src(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/uring")
        .join(name)
}

/// An echo server under `smclo run` (socat, a process per connection),
/// and the device's counters before the client.
fn echo_server(env: &mut Env) -> (Proc, u16, smclo::device::Stats) {
    let port = free_port();
    let listen = format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork");
    let mut server = env.spawn(Mode::Smclo, "echo-server", "socat", &[&listen, "EXEC:cat"]);
    wait_listen(&mut server, port);
    let s0 = env.stats();
    (server, port, s0)
}

/// `tests/uring/NAME.c` compiled into the test's directory, linked with
/// liburing when `liburing`.
fn program(env: &Env, name: &str, liburing: bool) -> String {
    let exe = env.path(name);
    let link: &[&str] = if liburing { &["-luring"] } else { &[] };
    smclo_testsupport::compile_c_with(
        "cc".as_ref(),
        &smclo_testsupport::CFLAGS,
        &src(&format!("{name}.c")),
        &exe,
        link,
    );
    exe.display().to_string()
}

/// An echo server's client under `smclo run`: connects to `port`, sends
/// "ping" and prints what became of its echo: "echo", "end" (the end of
/// stream first), "reset" or "timeout" (none within 10 s).
fn ping_client(env: &mut Env, port: u16) -> Proc {
    let script = format!(
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}))\n\
         s.settimeout(10)\ns.sendall(b'ping')\n\
         try:\n    print('echo' if s.recv(4, socket.MSG_WAITALL) == b'ping' else 'end')\n\
         except ConnectionResetError:\n    print('reset')\n\
         except socket.timeout:\n    print('timeout')\n"
    );
    env.run(Mode::Smclo, "client", "python3", &["-c", &script], T)
}

/// `raw_ring MODE PORT` under `smclo run`, started (`wait`: false) or run
/// to its end.
fn raw_ring(env: &mut Env, mode: &str, port: u16, wait: bool) -> Proc {
    let exe = program(env, "raw_ring", false);
    let mut p = env.spawn(Mode::Smclo, "raw-ring", &exe, &[mode, &port.to_string()]);
    if wait {
        p.wait_ok(T);
    }
    p
}

/// The client's connections were TCP, each counted `IO_URING` at the
/// client, and none went through shared memory.
fn assert_io_uring(env: &Env, s0: &smclo::device::Stats, conns: u64, logs: &str) {
    let d = delta(s0, &env.stats());
    assert_eq!(d.conns_opened, 0, "no SMC-D connection\n{logs}");
    assert_eq!(
        d.fallback_client[Reason::IoUring.index()],
        conns,
        "{}\n{logs}",
        d.fallbacks_desc()
    );
}

/// `raw_ring MODE` against an echo server, where MODE makes a connection,
/// then uses io_uring, then a second connection: the first went through
/// shared memory, the second stayed TCP (`IO_URING`).
fn smc_then_io_uring(tag: &str, mode: &str) {
    let mut env = Env::new(tag);
    let (server, port, s0) = echo_server(&mut env);
    let c = raw_ring(&mut env, mode, port, true);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert!(c.stdout_str().starts_with("ok 2"), "{logs}");
    assert_smc_then_io_uring(&env, &s0, &logs);
}

/// Of the client's two connections, the first (made before its ring)
/// went through shared memory, the second stayed TCP (`IO_URING`).
fn assert_smc_then_io_uring(env: &Env, s0: &smclo::device::Stats, logs: &str) {
    let d = delta(s0, &env.stats());
    assert_eq!(d.conns_opened, 1, "the first connection only\n{logs}");
    assert_eq!(
        d.fallback_client[Reason::IoUring.index()],
        1,
        "{}\n{logs}",
        d.fallbacks_desc()
    );
}

/// liburing's program (connect with the C library, then send and receive
/// through the ring): it hung, its send written into smclo's channel and
/// its receive waiting there.
#[test]
fn a_liburing_client_gets_its_echo_over_tcp() {
    let mut env = Env::new("uring-liburing");
    let (server, port, s0) = echo_server(&mut env);
    let exe = program(&env, "liburing_client", true);
    let c = env.run(
        Mode::Smclo,
        "liburing-client",
        &exe,
        &[&port.to_string()],
        T,
    );
    assert!(c.stdout_str().starts_with("ok 26"), "{}", c.logs());
    assert_io_uring(&env, &s0, 1, &format!("{}\n{}", c.logs(), server.logs()));
}

/// A ring set up with `syscall(2)` after a first connection: the
/// connections from then on are TCP (the first, made before, is SMC-D).
#[test]
fn a_ring_made_through_syscall_keeps_later_connections_tcp() {
    smc_then_io_uring("uring-syscall", "syscall-between");
}

/// A ring made with the system call instruction (no library call to
/// see) before the process's first connection: found among its
/// descriptors.
#[test]
fn a_ring_made_by_the_instruction_is_found_among_the_descriptors() {
    let mut env = Env::new("uring-instruction");
    let (server, port, s0) = echo_server(&mut env);
    let c = raw_ring(&mut env, "instruction-first", port, true);
    assert!(c.stdout_str().starts_with("ok 1"), "{}", c.logs());
    assert_io_uring(&env, &s0, 1, &format!("{}\n{}", c.logs(), server.logs()));
}

/// liburing loaded with `dlopen` after the process's first connection
/// (a plugin or an extension module that links it): the next connection
/// stays TCP.
#[test]
fn a_liburing_loaded_later_keeps_later_connections_tcp() {
    smc_then_io_uring("uring-dlopen", "dlopen-between");
}

/// `raw_ring MODE` serving one connection after it set a ring up, and an
/// smclo client's "ping" echoed by it: the listeners registered once the
/// ring was set up, and the device's counters of the client's connection.
fn served_by_raw_ring(env: &mut Env, mode: &str) -> (u64, Delta) {
    let port = free_port();
    let mut server = raw_ring(env, mode, port, false);
    server.wait_stdout("listening", T, &[]);
    let s0 = env.stats();
    let c = ping_client(env, port);
    assert_eq!(c.stdout_str(), "echo\n", "{}\n{}", c.logs(), server.logs());
    server.wait_ok(T);
    (s0.listeners, delta(&s0, &env.stats()))
}

/// A server that sets a ring up after it listens: its listener leaves the
/// registry, so an smclo client does not propose to it (and its plain
/// `accept` never meets a proposal it would have swapped).
#[test]
fn a_listener_leaves_the_registry_when_its_process_sets_a_ring_up() {
    let mut env = Env::new("uring-listener");
    let (listeners, d) = served_by_raw_ring(&mut env, "listen-then-setup");
    assert_eq!(listeners, 0, "the listener left the registry");
    assert_eq!(d.conns_opened, 0, "{}", d.fallbacks_desc());
    assert_eq!(
        d.fallback_client[Reason::PeerNoSmc.index()],
        1,
        "the client found no listener to propose to: {}",
        d.fallbacks_desc()
    );
}

/// The client of a listener whose registration a process that uses
/// io_uring declined: it found no listener to propose to (PEERNOSMC), so
/// it did not wait for an answer (TIMEOUT) and nothing declined it.
fn assert_declined(d: &Delta, logs: &str) {
    assert_eq!(d.conns_opened, 0, "{}\n{logs}", d.fallbacks_desc());
    for (side, r, n) in [
        ("client", Reason::PeerNoSmc, 1),
        ("client", Reason::Timeout, 0),
        ("server", Reason::IoUring, 0),
    ] {
        let counts = if side == "client" {
            &d.fallback_client
        } else {
            &d.fallback_server
        };
        assert_eq!(
            counts[r.index()],
            n,
            "{side} {r:?}: {}\n{logs}",
            d.fallbacks_desc()
        );
    }
}

/// A prefork server whose worker sets a ring up after its parent
/// registered the listener: the worker declines the parent's
/// registration, so clients no longer propose to it.
#[test]
fn a_worker_that_sets_a_ring_up_declines_its_parents_registration() {
    let mut env = Env::new("uring-prefork");
    let (listeners, d) = served_by_raw_ring(&mut env, "prefork");
    assert_eq!(listeners, 0, "the registration is declined");
    assert_declined(&d, "");
}

/// The same worker accepts through its ring (`IORING_OP_ACCEPT`), which
/// smclo never sees: a client that proposed to the parent's registration
/// would wait `SMCLO_CLC_WAIT_MS` for an answer (TIMEOUT); the decline
/// keeps it from proposing.
#[test]
fn a_worker_that_accepts_through_its_ring_costs_its_client_no_wait() {
    let mut env = Env::new("uring-ring-accept");
    let (_, d) = served_by_raw_ring(&mut env, "prefork-ring-accept");
    assert_declined(&d, "");
}

/// A python program that imports `imports`, listens on 127.0.0.1:`port`
/// (as `lst`), then runs `rest`.
fn launcher_script(port: u16, imports: &str, rest: &str) -> String {
    format!(
        "import {imports}\n\
         lst = socket.socket()\n\
         lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         lst.bind(('127.0.0.1', {port}))\nlst.listen(8)\n{rest}"
    )
}

/// An smclo client's "ping" to `port`, echoed by `server`, which then
/// ends with status 0: the device's counters over it, and both logs.
fn ping_served(env: &mut Env, server: &mut Proc, port: u16) -> (Delta, String) {
    let s0 = env.stats();
    let c = ping_client(env, port);
    server.wait_ok(T);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert_eq!(c.stdout_str(), "echo\n", "{logs}");
    (delta(&s0, &env.stats()), logs)
}

/// A launcher (no io_uring) listens and hands the listener to a liburing
/// server it execs, which accepts and serves through its ring: the server
/// declines the launcher's registration as it starts, so that its client
/// does not propose and wait for an answer (TIMEOUT).
#[test]
fn a_liburing_server_given_its_listener_by_exec_costs_its_client_no_wait() {
    let mut env = Env::new("uring-exec-listener");
    let acceptor = program(&env, "liburing_acceptor", true);
    let port = free_port();
    let launch = launcher_script(
        port,
        "socket, subprocess",
        &format!(
            "s = subprocess.Popen(['{acceptor}', str(lst.fileno())], pass_fds=[lst.fileno()])\n\
             print('server', s.wait(), flush=True)\n"
        ),
    );
    let mut server = env.spawn(Mode::Smclo, "launcher", "python3", &["-c", &launch]);
    server.wait_stdout("ready", T, &[]);
    // `smclo ss -l` shows the decline, and not the launcher's listener.
    let rows = listening(&env);
    let at = format!("127.0.0.1:{port} ");
    assert!(
        rows.lines()
            .any(|l| l.starts_with("DECLINED") && l.contains(&at)),
        "{rows}"
    );
    assert!(
        !rows
            .lines()
            .any(|l| l.starts_with("LISTEN") && l.contains(&at)),
        "{rows}"
    );
    assert_eq!(env.stats().declines, 1, "the device counts the decline");
    let (d, logs) = ping_served(&mut env, &mut server, port);
    assert!(server.stdout_str().contains("server 0"), "{logs}");
    assert_declined(&d, &logs);
}

/// `smclo ss -l` of the test's device.
fn listening(env: &Env) -> String {
    let o = std::process::Command::new(smclo_bin())
        .args(["ss", "-l"])
        .env("SMCLO_DEVICE_DIR", &env.dev_dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "smclo ss -l: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// As above, but the launcher sends the listener to the liburing server
/// with `SCM_RIGHTS` after the server started: the server declines it as
/// it receives it.
#[test]
fn a_liburing_server_sent_its_listener_costs_its_client_no_wait() {
    let mut env = Env::new("uring-sent-listener");
    let acceptor = program(&env, "liburing_acceptor", true);
    let port = free_port();
    let launch = launcher_script(
        port,
        "socket, subprocess",
        &format!(
            "mine, theirs = socket.socketpair()\n\
             s = subprocess.Popen(['{acceptor}', 'recv', str(theirs.fileno())], pass_fds=[theirs.fileno()])\n\
             theirs.close()\nsocket.send_fds(mine, [b'l'], [lst.fileno()])\n\
             print('server', s.wait(), flush=True)\n"
        ),
    );
    let mut server = env.spawn(Mode::Smclo, "launcher", "python3", &["-c", &launch]);
    server.wait_stdout("ready", T, &[]);
    let (d, logs) = ping_served(&mut env, &mut server, port);
    assert!(server.stdout_str().contains("server 0"), "{logs}");
    assert_declined(&d, &logs);
}

/// As above, but the launcher then execs a new image that registers the
/// listener again (its `epoll_ctl`, as an event loop's first step): the
/// acceptor's decline holds the new registration back too.
#[test]
fn a_registration_made_after_the_decline_is_held_back() {
    let mut env = Env::new("uring-exec-late");
    let acceptor = program(&env, "liburing_acceptor", true);
    let port = free_port();
    let again = "import os, select, sys\n\
                 ep = select.epoll()\nep.register(int(sys.argv[1]), select.EPOLLIN)\n\
                 print('registered', flush=True)\n\
                 print('server', os.waitpid(int(sys.argv[2]), 0)[1], flush=True)\n";
    let launch = launcher_script(
        port,
        "os, socket, subprocess, sys",
        &format!(
            "s = subprocess.Popen(['{acceptor}', str(lst.fileno())], pass_fds=[lst.fileno()], stdout=subprocess.PIPE)\n\
             print(s.stdout.readline().decode().strip(), flush=True)\n\
             lst.set_inheritable(True)\n\
             os.execv(sys.executable, [sys.executable, '-c', {again:?}, str(lst.fileno()), str(s.pid)])\n"
        ),
    );
    let mut cmd = env.command(Mode::Smclo, None, "python3", &["-c", &launch]);
    cmd.env("SMCLO_DEBUG", "1");
    let mut server = env.spawn_cmd("launcher", cmd);
    server.wait_stdout("registered", T, &[]);
    let (d, logs) = ping_served(&mut env, &mut server, port);
    assert!(server.stdout_str().contains("ready"), "{logs}");
    assert!(server.stdout_str().contains("server 0"), "{logs}");
    assert!(
        server.stderr_str().contains("registering it"),
        "the new image registered the listener again\n{logs}"
    );
    assert_declined(&d, &logs);
}

/// A wrapper linked with liburing, handed a listener, declines it while it
/// runs, then execs a server that serves it with the C library: the
/// wrapper's decline leaves with its image (the process lives on), so
/// the server's clients go through shared memory.
#[test]
fn a_decline_leaves_with_the_image_that_made_it() {
    let mut env = Env::new("uring-decline-exec");
    let wrapper = program(&env, "liburing_exec", true);
    let port = free_port();
    let serve = "import socket, select, sys\n\
                 lst = socket.socket(fileno=int(sys.argv[1]))\n\
                 select.epoll().register(lst.fileno(), select.EPOLLIN)\n\
                 print('registered', flush=True)\n\
                 c, _ = lst.accept()\nc.sendall(c.recv(4, socket.MSG_WAITALL))\nc.close()\n";
    let launch = launcher_script(
        port,
        "os, socket, sys",
        &format!(
            "lst.set_inheritable(True)\n\
             os.execv('{wrapper}', ['{wrapper}', sys.executable, '-c', {serve:?}, str(lst.fileno())])\n"
        ),
    );
    let mut cmd = env.command(Mode::Smclo, None, "python3", &["-c", &launch]);
    cmd.env("SMCLO_DEBUG", "1");
    let mut server = env.spawn_cmd("launcher", cmd);
    server.wait_stdout("registered", T, &[]);
    let (d, logs) = ping_served(&mut env, &mut server, port);
    assert!(
        server
            .stderr_str()
            .contains("declined: its clients connect over TCP"),
        "the wrapper declined the listener\n{logs}"
    );
    assert_eq!(d.conns_opened, 1, "{}\n{logs}", d.fallbacks_desc());
}

/// A connection handed to a liburing program by exec (socat's
/// `EXEC:...,nofork`, inetd style): the new image cannot carry it, so it
/// gets the TCP socket and both ends a reset, as for any program that
/// cannot follow a connection. It adopted the connection, and the
/// program's io_uring read waited on smclo's channel for ever.
#[test]
fn a_liburing_program_given_a_connection_by_exec_gets_a_reset() {
    let mut env = Env::new("uring-exec");
    let exe = program(&env, "liburing_echo", true);
    let port = free_port();
    let listen = format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork");
    let target = format!("EXEC:{exe},nofork");
    let mut server = env.spawn(Mode::Smclo, "socat", "socat", &[&listen, &target]);
    wait_listen(&mut server, port);
    let s0 = env.stats();
    let c = ping_client(&mut env, port);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert_eq!(c.stdout_str(), "reset\n", "{logs}");
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.conns_opened, 1,
        "the connection was SMC-D in socat\n{logs}"
    );
}

/// A dispatcher (no io_uring) hands an SMC-D connection to a liburing
/// worker with `SCM_RIGHTS`: the worker cannot carry it, so it gets the
/// TCP socket and both ends a reset. It adopted the connection, and the
/// worker's io_uring read waited on smclo's channel for ever.
#[test]
fn a_liburing_worker_handed_a_connection_gets_a_reset() {
    let mut env = Env::new("uring-passed");
    let worker = program(&env, "liburing_worker", true);
    let port = free_port();
    let dispatch = launcher_script(
        port,
        "socket, subprocess",
        &format!(
            "mine, theirs = socket.socketpair()\n\
             w = subprocess.Popen(['{worker}', str(theirs.fileno())], pass_fds=[theirs.fileno()])\n\
             theirs.close()\nprint('ready', flush=True)\n\
             c, _ = lst.accept()\nc.recv(4, socket.MSG_PEEK)\n\
             socket.send_fds(mine, [b'c'], [c.fileno()])\nc.close()\n\
             print('worker', w.wait(), flush=True)\n"
        ),
    );
    let mut server = env.spawn(Mode::Smclo, "dispatcher", "python3", &["-c", &dispatch]);
    server.wait_stdout("ready", T, &[]);
    let s0 = env.stats();
    let c = ping_client(&mut env, port);
    server.wait_ok(T);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert_eq!(c.stdout_str(), "reset\n", "{logs}");
    assert!(server.stdout_str().contains("worker 2"), "{logs}");
    let d = delta(&s0, &env.stats());
    assert_eq!(
        d.conns_opened, 1,
        "the connection was SMC-D in the dispatcher\n{logs}"
    );
}

/// The program's parent fork handler sets the process's first ring up
/// through `syscall(2)`: while the fork holds the descriptor table's lock.
/// Taking the lock again to unlist the listeners aborted the process; they
/// leave the registry at the next look after the fork (the next connect),
/// and the connections after the fork are TCP.
#[test]
fn a_ring_set_up_in_a_fork_handler_does_not_abort() {
    let mut env = Env::new("uring-fork-handler");
    let (server, port, s0) = echo_server(&mut env);
    let mut c = raw_ring(&mut env, "in-fork-handler", port, false);
    c.wait_stdout("listening", T, &[&server]);
    assert_eq!(
        env.stats().listeners,
        s0.listeners,
        "its listener left the registry\n{}",
        c.logs()
    );
    c.wait_ok(T);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert!(c.stdout_str().ends_with("ok 2\n"), "{logs}");
    assert_smc_then_io_uring(&env, &s0, &logs);
}

/// `SMCLO_IO_URING=files`: the program says its io_uring touches files
/// only (PostgreSQL's `io_method=io_uring`, MariaDB's InnoDB), so a ring
/// does not keep its connections TCP.
#[test]
fn a_program_whose_ring_reads_files_only_is_accelerated_when_it_says_so() {
    let mut env = Env::new("uring-files");
    let (server, port, s0) = echo_server(&mut env);
    let exe = program(&env, "raw_ring", false);
    let mut cmd = env.command(
        Mode::Smclo,
        None,
        &exe,
        &["syscall-between", &port.to_string()],
    );
    cmd.env("SMCLO_IO_URING", "files");
    let mut c = env.spawn_cmd("raw-ring", cmd);
    c.wait_ok(T);
    let logs = format!("{}\n{}", c.logs(), server.logs());
    assert!(c.stdout_str().starts_with("ok 2"), "{logs}");
    let d = delta(&s0, &env.stats());
    assert_eq!(d.conns_opened, 2, "both connections\n{logs}");
    assert_eq!(d.fallbacks(), 0, "{}\n{logs}", d.fallbacks_desc());
}
