//! What the preload's test binaries share: the library under test and the
//! C programs they run under it.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;

/// `libsmclo_preload.so` from this build: `deps/` next to the test
/// executable (always written there by cargo) or `target/<profile>`.
pub fn lib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe
        .parent()
        .expect("test executable has a directory")
        .to_path_buf();
    let profile = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().unwrap().to_path_buf()
    } else {
        deps.clone()
    };
    for d in [&deps, &profile] {
        let p = d.join("libsmclo_preload.so");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "libsmclo_preload.so is in neither {} nor {}: build the smclo-preload cdylib with the same profile \
         and target directory (cargo test --workspace builds it)",
        deps.display(),
        profile.display()
    );
}

/// Compiles `tests/c/NAME.c` (`-O2 -g -Wall -pthread` and `extra`) into the
/// test's temporary directory.
pub fn compile(name: &str, extra: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("preload-{name}-{}", std::process::id()));
    let st = Command::new("cc")
        .args(["-O2", "-g", "-Wall", "-pthread"])
        .args(extra)
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .status()
        .expect("running cc");
    assert!(st.success(), "compiling {} failed", src.display());
    out
}
