//! `splice(2)` and `sendfile(2)` between a connection and a pipe, as
//! proxies use them (haproxy's `option splice-*`), through shared memory
//! with the kernel's semantics: `tests/c/splice.c` relays a stream pipe →
//! connection → one-page pipe, blocking and non-blocking (a full pipe
//! gives `EAGAIN` and loses nothing), checks the kernel's answers for a
//! TCP socket where one end is not a pipe, and in the kernel's order (the
//! pipe before the connection), and that a splice waiting on its pipe
//! blocks no other call on the connection. The device's counters prove
//! the connection was SMC-D.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod common;
use common::{compile, run_smc};

fn exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile("splice", &["-pthread"]))
}

#[test]
fn a_stream_spliced_through_pipes_arrives_whole() {
    let out = run_smc(exe(), &["relay", "5000000"], None, None);
    assert!(out.contains("OK 5000000"), "{out}");
}

#[test]
fn non_blocking_splices_wait_for_nothing_and_lose_nothing() {
    let out = run_smc(exe(), &["nonblock", "3000000"], None, None);
    assert!(out.contains("OK 3000000"), "{out}");
}

/// A splice waiting on its pipe held the connection's writer lock: a send
/// by another thread, and so the write that would feed the pipe, hung.
#[test]
fn a_splice_waiting_on_its_pipe_holds_no_lock_of_the_connection() {
    let out = run_smc(exe(), &["locks"], None, None);
    assert!(out.contains("OK 0"), "{out}");
}

#[test]
fn splices_the_kernel_refuses_for_tcp_are_refused_alike() {
    let out = run_smc(exe(), &["errors"], None, None);
    assert!(out.contains("OK 5"), "{out}");
}
