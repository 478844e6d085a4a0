//! `smclo run [-d] [-r SIZE] [-t SIZE] [--] PROGRAM [ARGS...]`: runs an
//! unmodified program with the preload library, like smc-tools' `smc_run`
//! (the same options; the `smc_run` binary is this command under that name).
//!
//! The library is built once for each C library's loader: glibc's
//! `libsmclo_preload.so` and musl's `libsmclo_preload_musl.so`, next to
//! the smclo executable (or in its `deps/` directory in a cargo target
//! dir), or at `SMCLO_PRELOAD_LIB` and `SMCLO_PRELOAD_MUSL_LIB`. The
//! program's `PT_INTERP` decides which one goes in its `LD_PRELOAD`; a
//! program whose loader has no build runs without smclo (a loader handed a
//! library it cannot load may stop the program before `main`). Both paths
//! go in the environment, for the program's exec hooks to do the same.

use smclo_loader::{Choice, Loader, Variant};
use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether SIGPIPE was ignored when this process started. The Rust
/// runtime ignores it before `main` (so that its own writes get `EPIPE`),
/// and an ignored signal stays ignored across `exec`: the program `run`
/// starts must get the disposition smclo was given instead.
static SIGPIPE_IGNORED_AT_START: AtomicBool = AtomicBool::new(false);

/// Reads SIGPIPE's disposition at load, before the Rust runtime's set-up
/// (constructors run before `main`).
extern "C" fn note_sigpipe() {
    // SAFETY: an all-zero sigaction is valid storage for the query.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: queries SIGPIPE's action into `old` (no new action).
    if unsafe { libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old) } == 0 {
        SIGPIPE_IGNORED_AT_START.store(old.sa_sigaction == libc::SIG_IGN, Ordering::Relaxed);
    }
}

#[used]
#[link_section = ".init_array"]
static NOTE_SIGPIPE: extern "C" fn() = note_sigpipe;

/// Gives SIGPIPE back the disposition this process started with (see
/// [`SIGPIPE_IGNORED_AT_START`]), for the program about to be executed.
fn restore_sigpipe() {
    let h = if SIGPIPE_IGNORED_AT_START.load(Ordering::Relaxed) {
        libc::SIG_IGN
    } else {
        libc::SIG_DFL
    };
    // SAFETY: sets SIGPIPE's disposition to default or ignore, right before exec.
    unsafe { libc::signal(libc::SIGPIPE, h) };
}

const USAGE: &str = "\
usage: smclo run [-d] [-r SIZE] [-t SIZE] [--] PROGRAM [ARGS...]
       smc_run  [-d] [-r SIZE] [-t SIZE] PROGRAM [ARGS...]

Runs PROGRAM with the smclo preload library: its TCP connections to other
smclo processes on this host go through shared memory (SMC-D loopback).

  -d        debug: one line per decision on standard error (SMCLO_DEBUG=1)
  -r SIZE   receive buffer (DMB) size, k/m suffixes (SMCLO_RMEM)
  -t SIZE   send buffer size in copy mode (SMCLO_WMEM)

The library is libsmclo_preload.so (glibc programs) or
libsmclo_preload_musl.so (musl programs) next to this executable, or the
file named by SMCLO_PRELOAD_LIB or SMCLO_PRELOAD_MUSL_LIB.
";

/// Why a build of the preload library was not found.
#[derive(Debug)]
pub enum NotFound {
    /// Its variable names no file.
    BadVar { var: &'static str, path: PathBuf },
    /// None of the places it is looked for has it.
    Nowhere { v: Variant, tried: Vec<PathBuf> },
    /// There is no telling where this executable is, nor the build.
    NoOwnPath(String),
}

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotFound::BadVar { var, path } => write!(f, "{var}={} is not a file", path.display()),
            NotFound::NoOwnPath(e) => write!(f, "cannot find my own executable: {e}"),
            NotFound::Nowhere { v, tried } => {
                let build = match v {
                    Variant::Glibc => "cargo build --release -p smclo-preload",
                    Variant::Musl => "scripts/build-musl-preload",
                };
                let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "{} not found (tried {}); build it ({build}) or set {}",
                    v.file_name(),
                    tried.join(", "),
                    v.env_var()
                )
            }
        }
    }
}

impl std::error::Error for NotFound {}

/// Where build `v` of the preload library is: its variable, or next to us.
pub fn find_build(v: Variant) -> Result<PathBuf, NotFound> {
    let var = v.env_var();
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p.canonicalize().unwrap_or(p))
        } else {
            Err(NotFound::BadVar { var, path: p })
        };
    }
    let exe = std::env::current_exe().map_err(|e| NotFound::NoOwnPath(e.to_string()))?;
    let dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    let mut tried = Vec::new();
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for d in [
        dir.clone(),
        dir.join("deps"),
        dir.join("../lib"),
        dir.join("../lib/smclo"),
    ] {
        let p = d.join(v.file_name());
        if let Ok(m) = std::fs::metadata(&p).and_then(|m| m.modified()) {
            // In a cargo target directory the copy next to the executable
            // is only refreshed by `cargo build`; `deps/` by every build:
            // take the newest.
            if best.as_ref().is_none_or(|(t, _)| m > *t) {
                best = Some((m, p.clone()));
            }
        }
        tried.push(p);
    }
    if let Some((_, p)) = best {
        // An absolute path: the program may change directory.
        return Ok(p.canonicalize().unwrap_or(p));
    }
    Err(NotFound::Nowhere { v, tried })
}

/// The file `execvp` runs for `prog`: a path, or the first executable
/// file of that name in `PATH`.
fn program_file(prog: &str) -> Option<PathBuf> {
    if prog.contains('/') {
        return Some(PathBuf::from(prog));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
        })
}

/// The build for `prog`'s loader, `None` for no build. `Err`: the build
/// the program needs is not there, with what to do.
fn build_for(prog: &str, debug: bool) -> Result<Option<PathBuf>, String> {
    let file = program_file(prog).and_then(|p| std::fs::File::open(p).ok());
    if debug && file.as_ref().is_some_and(smclo_loader::is_go) {
        eprintln!("smclo run: {prog} is a Go program, which makes its system calls without the C library: its own connections stay TCP (programs it starts get smclo)");
    }
    let loader = file.as_ref().map_or(Loader::Unknown, Loader::of_file);
    let v = match Choice::for_loader(loader) {
        Choice::Load(v) => v,
        // No loader reads it, or it cannot be told: glibc's, for the
        // programs it may start.
        Choice::Keep => Variant::Glibc,
        Choice::Nothing => {
            if debug {
                eprintln!("smclo run: {prog}'s loader can load no build of smclo (another C library, machine or ELF class); it runs without smclo");
            }
            return Ok(None);
        }
    };
    match find_build(v) {
        Ok(p) => Ok(Some(p)),
        // Not installed: the program runs as it would without smclo.
        Err(e @ NotFound::Nowhere { .. }) if v == Variant::Musl => {
            if debug {
                eprintln!(
                    "smclo run: {prog} runs under musl's loader and {e}; it runs without smclo"
                );
            }
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Sets `LD_PRELOAD` to name `lib` (in place of any build of the
/// library it names, keeping what the user preloads already), and each
/// build's variable to its path, for the program's exec hooks.
fn set_preload(lib: Option<&Path>) {
    let builds: Vec<(Variant, PathBuf)> = Variant::ALL
        .iter()
        .filter_map(|&v| find_build(v).ok().map(|p| (v, p)))
        .collect();
    let known: Vec<&[u8]> = builds
        .iter()
        .map(|(_, p)| p.as_os_str().as_bytes())
        .collect();
    let old: OsString = std::env::var_os("LD_PRELOAD").unwrap_or_default();
    let new = smclo_loader::with_lib(
        old.as_bytes(),
        |e| smclo_loader::is_build(e, known.iter().copied()),
        lib.map(|l| l.as_os_str().as_bytes()),
    );
    if new.is_empty() {
        std::env::remove_var("LD_PRELOAD");
    } else {
        std::env::set_var("LD_PRELOAD", OsStr::from_bytes(&new));
    }
    for (v, p) in &builds {
        std::env::set_var(v.env_var(), p);
    }
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
    let debug = debug || smclo::debug::enabled();
    let lib = match build_for(&prog[0], debug) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smclo run: {e}");
            return 1;
        }
    };
    set_preload(lib.as_deref());
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
    restore_sigpipe();
    // SAFETY: a NUL-terminated program name and a NULL-terminated argv of
    // CStrings that live until the call (which only returns on failure).
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    let e = std::io::Error::last_os_error();
    // SAFETY: back to the runtime's own disposition, so that reporting the
    // failure to a closed stderr is an error, not a death.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    eprintln!("smclo run: cannot run {}: {e}", prog[0]);
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}
