//! `smclo run [-d] [-r SIZE] [-t SIZE] [--] PROGRAM [ARGS...]`: runs an
//! unmodified program with the preload library, like smc-tools' `smc_run`
//! (the same options; the `smc_run` binary is this command under that name).
//!
//! The library is `libsmclo_preload.so` next to the smclo executable (or in
//! its `deps/` directory in a cargo target dir), or `SMCLO_PRELOAD_LIB`.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

const USAGE: &str = "\
usage: smclo run [-d] [-r SIZE] [-t SIZE] [--] PROGRAM [ARGS...]
       smc_run  [-d] [-r SIZE] [-t SIZE] PROGRAM [ARGS...]

Runs PROGRAM with the smclo preload library: its TCP connections to other
smclo processes on this host go through shared memory (SMC-D loopback).

  -d        debug: one line per decision on standard error (SMCLO_DEBUG=1)
  -r SIZE   receive buffer (DMB) size, k/m suffixes (SMCLO_RMEM)
  -t SIZE   send buffer size in copy mode (SMCLO_WMEM)

The library is libsmclo_preload.so next to this executable, or the file
named by SMCLO_PRELOAD_LIB.
";

/// Where the preload library is: `SMCLO_PRELOAD_LIB`, or next to us.
pub fn find_lib() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("SMCLO_PRELOAD_LIB").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("SMCLO_PRELOAD_LIB={} is not a file", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    let mut tried = Vec::new();
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for d in [
        dir.clone(),
        dir.join("deps"),
        dir.join("../lib"),
        dir.join("../lib/smclo"),
    ] {
        let p = d.join("libsmclo_preload.so");
        if let Ok(m) = std::fs::metadata(&p).and_then(|m| m.modified()) {
            // In a cargo target directory the copy next to the executable
            // is only refreshed by `cargo build`; `deps/` by every build:
            // take the newest.
            if best.as_ref().is_none_or(|(t, _)| m > *t) {
                best = Some((m, p.clone()));
            }
        }
        tried.push(p.display().to_string());
    }
    if let Some((_, p)) = best {
        // An absolute path: the program may change directory.
        return Ok(p.canonicalize().unwrap_or(p));
    }
    Err(format!(
        "libsmclo_preload.so not found (tried {}); build it (cargo build --release -p smclo-preload) or set SMCLO_PRELOAD_LIB",
        tried.join(", ")
    ))
}

/// Entry point; `args` are the arguments after `run` (or after `smc_run`).
pub fn main(args: &[String]) -> i32 {
    let mut i = 0;
    let mut debug = false;
    let mut rmem = None;
    let mut wmem = None;
    while i < args.len() {
        let a = args[i].as_str();
        match a {
            "--" => {
                i += 1;
                break;
            }
            "-h" | "--help" => {
                print!("{USAGE}");
                return 0;
            }
            "-d" => debug = true,
            "-r" | "-t" => {
                let Some(v) = args.get(i + 1) else {
                    eprintln!("smclo run: {a} needs a size\n");
                    eprint!("{USAGE}");
                    return 2;
                };
                if smclo::config::parse_size(v).is_none() {
                    eprintln!("smclo run: {a} {v:?}: not a size (digits with optional k or m)");
                    return 2;
                }
                if a == "-r" {
                    rmem = Some(v.clone());
                } else {
                    wmem = Some(v.clone());
                }
                i += 1;
            }
            _ if a.starts_with('-') && a.len() > 1 => {
                eprintln!("smclo run: unknown option {a}\n");
                eprint!("{USAGE}");
                return 2;
            }
            _ => break,
        }
        i += 1;
    }
    let prog = &args[i.min(args.len())..];
    if prog.is_empty() {
        eprint!("{USAGE}");
        return 2;
    }
    let lib = match find_lib() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smclo run: {e}");
            return 1;
        }
    };
    // Append to LD_PRELOAD, keeping what the user preloads already.
    let mut preload: OsString = std::env::var_os("LD_PRELOAD").unwrap_or_default();
    let already = preload
        .as_bytes()
        .split(|b| *b == b':' || *b == b' ')
        .any(|p| p == lib.as_os_str().as_bytes());
    if !already {
        if !preload.is_empty() {
            preload.push(":");
        }
        preload.push(lib.as_os_str());
    }
    std::env::set_var("LD_PRELOAD", &preload);
    if debug {
        std::env::set_var("SMCLO_DEBUG", "1");
    }
    if let Some(r) = rmem {
        std::env::set_var("SMCLO_RMEM", r);
    }
    if let Some(w) = wmem {
        std::env::set_var("SMCLO_WMEM", w);
    }
    let cargs: Vec<CString> = match prog
        .iter()
        .map(|a| CString::new(OsString::from(a.clone()).into_vec()))
        .collect()
    {
        Ok(v) => v,
        Err(_) => {
            eprintln!("smclo run: an argument contains a NUL byte");
            return 2;
        }
    };
    let mut ptrs: Vec<*const libc::c_char> = cargs.iter().map(|c| c.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: a NUL-terminated program name and a NULL-terminated argv of
    // CStrings that live until the call (which only returns on failure).
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    let e = std::io::Error::last_os_error();
    eprintln!("smclo run: cannot run {}: {e}", prog[0]);
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}
