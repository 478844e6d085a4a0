//! Duplicates of a connection across `fork` and during a connect
//! (`tests/c/dup_family.c` says what each mode does). Each failed before
//! its fix; the failure is quoted at its test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::{compile, compile_with_late_atfork, lib};

/// `tests/c/dup_family.c` in `mode` under the preload on the device
/// `dev`, for 60 s at most.
fn output(mode: &str, dev: &smclo_testsupport::DevDir) -> std::process::Output {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let exe = EXE.get_or_init(|| compile("dup_family", &["-pthread"]));
    output_of(exe, mode, dev)
}

/// The test program `exe` in `mode` under the preload on the device
/// `dev`, for 60 s at most.
fn output_of(exe: &Path, mode: &str, dev: &smclo_testsupport::DevDir) -> std::process::Output {
    Command::new("timeout")
        .args(["-s", "KILL", "60"])
        .arg(exe)
        .arg(mode)
        .env("LD_PRELOAD", lib())
        .env("SMCLO_DEVICE_DIR", &dev.0)
        .env("SMCLO_SHORT", "smc")
        // The handshake's bound counts from connect, and `dup-pending`'s
        // connect waits a second for its SYN to be sent again: under load
        // the default (1 s) would leave it none.
        .env("SMCLO_CLC_WAIT_MS", "5000")
        .env("SMCLO_DEBUG", "1")
        .env_remove("SMCLO_DISABLE")
        .output()
        .expect("run the test program")
}

/// [`output`] on a device of its own: checks that it printed `OK`, and
/// returns the device's SMC-D connections.
fn run(mode: &str) -> u64 {
    let dev = smclo_testsupport::DevDir::new(&format!("dup-family-{mode}"));
    let out = output(mode, &dev);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim() == "OK",
        "{mode}: {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    smclo::device::Device::open(&dev.0)
        .expect("open the test device")
        .stats()
        .conns_opened
}

/// A fork-per-connection server whose child takes the connection at a
/// `dup` and closes the accepted number before the parent closes its copy:
/// the child's reply reaches the client. Before, the child's close moved
/// its channel to another number, the parent's last close then did not
/// recognise the child as a holder and ended the connection: the client
/// read "" and the child's write was lost.
#[test]
fn a_fork_child_that_keeps_a_connection_at_a_dup_keeps_it() {
    assert_eq!(run("fork-close"), 2, "both rounds SMC-D");
}

/// The same with the accepted number taken by `dup2` in the child: the
/// parent's close finds the child's channel at the number the child moved
/// it to. Before, the parent looked for it at the accepted number, now
/// /dev/null in the child, and ended the connection (the client read "").
#[test]
fn a_fork_child_that_puts_a_file_at_a_connections_number_keeps_it() {
    assert_eq!(run("fork-dup2"), 2, "both rounds SMC-D");
}

/// A fork child's `dup` of a socket whose blocking connect a thread of
/// the parent is in returns at once. Before, the child waited for that
/// thread, which it does not have, for ever (killed by its alarm after
/// 5 s).
#[test]
fn a_fork_childs_dup_of_a_socket_its_parent_connects_returns() {
    assert_eq!(run("fork-dup"), 1, "the parent's connection SMC-D");
}

/// A `dup` during a blocking connect that returns before its handshake
/// decided names the connection once it decides. Before, it named the
/// TCP socket, and what was written through it never reached the server
/// (which read "hello" of "helloWORLD").
#[test]
fn a_dup_during_a_connect_that_returns_pending_names_the_connection() {
    assert_eq!(
        run("dup-pending"),
        2,
        "the first contact and the connection SMC-D"
    );
}

/// A thread in a blocking read through a `dup` when the main thread
/// closes the connection's own number and forks: the number is closed in
/// the child, whose calls never use it. Before, the child counted the
/// parent's read as its own for ever and kept the number open.
#[test]
fn a_number_closed_during_a_call_is_closed_in_a_fork_child() {
    assert_eq!(run("fork-in-call"), 1, "SMC-D");
}

/// The program's fork handlers send on a connection (before the fork, in
/// the parent and in the child), which glibc runs inside `fork` while the
/// preload holds its descriptor table's lock: all five bytes arrive.
/// Before, the first send aborted the process: "the descriptor table's
/// lock taken again by the thread that holds it".
#[test]
fn fork_handlers_use_a_connection() {
    let opened = run("fork-handlers");
    assert_eq!(opened, 1, "SMC-D");
}

/// A write held back (`MSG_MORE`) when the process forks reaches the peer
/// once, before what the child and then the parent send. Before, parent
/// and child each published their own copy of it, over each other's
/// writes: the server read "pc" of "pcP".
#[test]
fn a_write_held_at_fork_reaches_the_peer_once() {
    assert_eq!(run("fork-held"), 1, "SMC-D");
}

/// The program's fork handlers wait on an epoll set that holds the
/// connection, and the child's closes the set and takes the connection at
/// a dup: both processes' bytes arrive. Before, the first wait aborted the
/// process (the table's lock taken again), and once the fork let handlers
/// read the table it waited for itself for ever (the epoll set's locks).
#[test]
fn fork_handlers_use_epoll_and_change_the_childs_table() {
    assert_eq!(run("fork-handler-epoll"), 1, "SMC-D");
}

/// A fork child that moved its channel (a dup, then a close of the
/// connection's own number) and closed its last descriptor before `fork`
/// returned in its parent: the parent's entry in the holders still said
/// "at the reader's own number", which the child read as its moved one,
/// so it missed the parent and ended the connection (the server read "k"
/// and the end of stream, and the parent's send failed). The parent now
/// lists its number before it forks.
#[test]
fn a_fork_child_that_moved_its_channel_first_sees_its_parent() {
    assert_eq!(run("fork-moved-first"), 1, "SMC-D");
}

/// An exec'd image lists its old image's fork child "at the reader's own
/// number"; its own fork child that moved its channel then looked for
/// that sibling at the moved number, missed it and freed its entry, so
/// the exec'd image's close ended the connection under the sibling (the
/// server read "k" and the end of stream). The fork pins such entries at
/// the image's number first.
#[test]
fn an_exec_d_images_siblings_stay_holders_across_its_forks() {
    assert_eq!(run("exec-sibling-moved"), 1, "SMC-D");
}

/// `tests/c/late_fork.c` in `mode` (its fork handler registered by a
/// library before the preload's, so run inside the preload's part of
/// `fork`) on a device of its own.
fn late_fork(mode: &str) -> (std::process::Output, u64) {
    let (exe, so) = compile_with_late_atfork("late_fork");
    let dev = smclo_testsupport::DevDir::new(&format!("late-fork-{mode}"));
    let out = output_of(&exe, mode, &dev);
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&so);
    let opened = smclo::device::Device::open(&dev.0)
        .expect("open the test device")
        .stats()
        .conns_opened;
    (out, opened)
}

/// A fork handler a library registered before the preload's (so it runs
/// while the preload holds its table's lock for the fork) sends on a
/// connection: the byte arrives before the parent's.
#[test]
fn a_librarys_fork_handler_sends_on_a_connection() {
    let (out, opened) = late_fork("send");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "OK",
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(opened, 1, "SMC-D");
}

/// Such a handler that waits on an epoll set holding a connection, whose
/// locks the fork holds, ends the process with the reason (abort) instead
/// of waiting for itself for ever (killed by the 60 s bound here).
#[test]
fn a_librarys_fork_handler_on_a_served_epoll_set_aborts_with_the_reason() {
    use std::os::unix::process::ExitStatusExt;
    let (out, _) = late_fork("epoll");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.signal() == Some(libc::SIGABRT)
            && stderr.contains("a fork handler (pthread_atfork) used a wait on an epoll set"),
        "{:?}\nstdout: {}\nstderr: {stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}
