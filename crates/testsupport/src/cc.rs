//! C programs built for tests.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The flags of [`compile_c`].
pub const CFLAGS: [&str; 4] = ["-O2", "-g", "-Wall", "-pthread"];

/// Compiles `src` into `out` with `cc`, [`CFLAGS`] and `flags`; returns
/// `out`.
pub fn compile_c(src: &Path, out: &Path, flags: &[&str]) -> PathBuf {
    let all: Vec<&str> = CFLAGS.iter().chain(flags).copied().collect();
    compile_c_with(OsStr::new("cc"), &all, src, out, &[])
}

/// Runs `compiler flags -o out src link` (libraries follow the source that
/// needs them); returns `out`, or panics with the compiler's messages.
pub fn compile_c_with(
    compiler: &OsStr,
    flags: &[&str],
    src: &Path,
    out: &Path,
    link: &[&str],
) -> PathBuf {
    let o = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(out)
        .arg(src)
        .args(link)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", compiler.to_string_lossy()));
    assert!(
        o.status.success(),
        "compiling {} failed:\n{}{}",
        src.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    out.to_path_buf()
}
