//! A new image that cannot read `SMCLO_EXEC_CONNS` (another smclo
//! version wrote it) still gets the TCP sockets at the numbers passed:
//! the moves the value starts with are read by every version.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| common::compile("exec_conns", &[]))
}

/// Runs `exec_conns LAYOUT` (see there), itself under the preload when
/// `preloaded`; the child's `OK` line, and its debug log.
fn run(layout: &str, preloaded: bool) -> (String, String) {
    let lib = common::lib();
    let mut c = Command::new("timeout");
    c.arg("20").arg(exe()).arg(layout).arg(&lib);
    if preloaded {
        c.env("LD_PRELOAD", &lib)
            .env("SMCLO_DEVICE_DIR", "/nonexistent/smclo");
    } else {
        c.env_remove("LD_PRELOAD");
    }
    let out = c.output().expect("run exec_conns");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success() && stdout.starts_with("OK "),
        "{layout}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// The child read the bytes waiting on the TCP socket at the channel's
/// number, and its debug log says why nothing was adopted.
fn moved(layout: &str) {
    let (stdout, stderr) = run(layout, false);
    assert!(stdout.starts_with("OK 15"), "{stdout}");
    assert!(
        stderr.contains("not in this smclo version's layout"),
        "the debug log says why: {stderr}"
    );
}

#[test]
fn an_unknown_layout_gets_the_tcp_sockets() {
    moved("future");
}

#[test]
fn the_layout_before_the_moves_gets_the_tcp_sockets() {
    moved("v1");
}

/// A value the exec's caller did not write never reaches the new image,
/// which would move its descriptors.
#[test]
fn a_value_this_image_did_not_write_is_not_passed_on() {
    let (_, stderr) = run("stale", true);
    assert!(!stderr.contains("SMCLO_EXEC_CONNS"), "{stderr}");
}
