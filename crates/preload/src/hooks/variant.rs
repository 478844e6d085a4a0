//! The build of this library an exec's new program can load. Its loader
//! (`PT_INTERP`: glibc's, musl's, another) gets the build made for it in
//! `LD_PRELOAD`, in place of this one, or no build at all: a loader never
//! gets a library it cannot load (musl's would stop the program before
//! `main`). A program left without a build does not adopt connections
//! (`preload_in`): they fall back as for a static program.
//!
//! The other build is the one `smclo run` found (its path in the variable
//! `Variant::env_var`), or the file of that build's name next to this one.
//!
//! The exec hooks (`hooks::process`) ask here for every exec; so do
//! `posix_spawn` and `posix_spawnp`, which start a program without them
//! (no connection goes along: every channel is close-on-exec). Nothing is
//! allocated unless `LD_PRELOAD` changes: exec may follow `fork` in a
//! multithreaded program.

use super::target::{self, Program};
use crate::real;
use libc::{c_char, c_int, pid_t, posix_spawn_file_actions_t, posix_spawnattr_t};
use smclo::debug;
use smclo_loader::{Choice, Loader, Variant};
use std::borrow::Cow;
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

const LD_PRELOAD: &[u8] = b"LD_PRELOAD=";

/// Looks up this library's path once, at load, so that an exec never
/// needs to.
pub(super) fn at_load() {
    own_path();
}

/// This library's path, as the loader mapped it.
fn own_path() -> Option<&'static [u8]> {
    static PATH: std::sync::OnceLock<Option<Vec<u8>>> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        // SAFETY: an all-zero Dl_info is valid; dladdr fills it for an
        // address inside this library.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        let f: fn() -> Option<&'static [u8]> = own_path;
        // SAFETY: dladdr reads the address only.
        if unsafe { libc::dladdr(f as *const libc::c_void, &mut info) } == 0
            || info.dli_fname.is_null()
        {
            return None;
        }
        // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
        Some(
            unsafe { CStr::from_ptr(info.dli_fname) }
                .to_bytes()
                .to_vec(),
        )
    })
    .as_deref()
}

/// An exec's environment, read in place (NULL-terminated; NULL: none).
#[derive(Clone, Copy)]
pub(super) struct Env(pub(super) *const *const c_char);

impl Env {
    /// The entries, up to the NULL.
    fn entries<'a>(self) -> impl Iterator<Item = &'a CStr> {
        target::entries(self.0)
    }

    /// The value of the variable `name`.
    fn var<'a>(self, name: &str) -> Option<&'a [u8]> {
        self.entries().find_map(|e| {
            e.to_bytes()
                .strip_prefix(name.as_bytes())
                .and_then(|r| r.strip_prefix(b"="))
        })
    }
}

/// Whether an `LD_PRELOAD` entry names a build of this library: by a
/// build's file name, this library's, or that of a build's path in `env`.
/// Whether `envp` has `LD_PRELOAD` naming a build of this library.
pub(super) fn preload_in(envp: *const *const c_char) -> bool {
    let env = Env(envp);
    env.entries().any(|e| {
        e.to_bytes().strip_prefix(b"LD_PRELOAD=").is_some_and(|v| {
            v.split(|&b| b == b':' || b == b' ')
                .any(|p| is_ours(p, env))
        })
    })
}

fn is_ours(entry: &[u8], env: Env) -> bool {
    let [glibc, musl] = Variant::ALL.map(|v| env.var(v.env_var()));
    smclo_loader::is_build(entry, [own_path(), glibc, musl].into_iter().flatten())
}

fn is_file(p: &[u8]) -> bool {
    !p.is_empty() && Path::new(OsStr::from_bytes(p)).is_file()
}

/// The path of build `v` (see the module docs).
fn build_path<'a>(v: Variant, env: Env) -> Option<Cow<'a, [u8]>> {
    if v == Variant::this_build() {
        return own_path().map(Cow::Borrowed);
    }
    if let Some(p) = env.var(v.env_var()).filter(|p| is_file(p)) {
        return Some(Cow::Borrowed(p));
    }
    let own = Path::new(OsStr::from_bytes(own_path()?));
    let sibling = own.with_file_name(v.file_name()).into_os_string();
    is_file(sibling.as_bytes()).then(|| Cow::Owned(sibling.into_vec()))
}

/// The environment an exec passes instead of the program's.
pub(super) struct ExecEnv {
    /// Owns the strings `ptrs` points at.
    _strings: Vec<CString>,
    ptrs: Vec<*const c_char>,
}

impl ExecEnv {
    pub(super) fn as_ptr(&self) -> *const *const c_char {
        self.ptrs.as_ptr()
    }
}

/// What an exec's `LD_PRELOAD` gets of smclo.
enum Preload<'a> {
    /// What it has.
    AsIs,
    /// This build of the library.
    Names(Cow<'a, [u8]>),
    /// No build.
    Drops,
}

/// What `LD_PRELOAD` gets for a program of `loader`.
fn wanted<'a>(loader: Loader, env: Env) -> Preload<'a> {
    match Choice::for_loader(loader) {
        Choice::Keep => Preload::AsIs,
        Choice::Nothing => {
            debug!("exec: the new program's loader can load no build of smclo (another C library, machine or ELF class); LD_PRELOAD drops smclo and the program runs without it");
            Preload::Drops
        }
        Choice::Load(v) => build_path(v, env).map_or_else(
            || {
                debug!(
                    "exec: the new program runs under {}'s loader and no build of smclo for it was found ({} or {} next to this library); LD_PRELOAD drops smclo and the program runs without it",
                    v.libc_name(),
                    v.env_var(),
                    v.file_name()
                );
                Preload::Drops
            },
            Preload::Names,
        ),
    }
}

/// The environment for an exec of `program` with `envp` whose
/// `LD_PRELOAD` names the build for the program's loader, or none of
/// smclo's; `None` when `envp` is right as it is.
pub(super) fn exec_env(program: &Program, envp: *const *const c_char) -> Option<ExecEnv> {
    let Program::File(f) = program else {
        return None;
    };
    let env = Env(envp);
    let value = env.var("LD_PRELOAD")?;
    // Only a program whose LD_PRELOAD names smclo is looked at.
    if !smclo_loader::names_build(value, |e| is_ours(e, env)) {
        return None;
    }
    let lib = match wanted(Loader::of_file(f), env) {
        Preload::AsIs => return None,
        Preload::Names(l) => Some(l),
        Preload::Drops => None,
    };
    let new = smclo_loader::rewrite(value, |e| is_ours(e, env), lib.as_deref())?;
    if let Some(l) = &lib {
        debug!(
            "exec: the new program gets {} in LD_PRELOAD",
            String::from_utf8_lossy(l)
        );
    }
    let mut strings = Vec::new();
    if !new.is_empty() {
        strings.push(CString::new([LD_PRELOAD, &new].concat()).ok()?);
    }
    let mut ptrs: Vec<*const c_char> = env
        .entries()
        .filter(|e| !e.to_bytes().starts_with(LD_PRELOAD))
        .map(|e| e.as_ptr())
        .collect();
    ptrs.extend(strings.iter().map(|s| s.as_ptr()));
    ptrs.push(std::ptr::null());
    Some(ExecEnv {
        _strings: strings,
        ptrs,
    })
}

/// `envp` as the new program should get it (see [`exec_env`]), for a
/// spawn function's type.
fn spawn_env(
    program: &Program,
    envp: *const *mut c_char,
    owned: &mut Option<ExecEnv>,
) -> *const *mut c_char {
    *owned = exec_env(program, envp.cast());
    owned.as_ref().map_or(envp, |e| e.as_ptr().cast())
}

/// Interposed `posix_spawn(3)`: the program gets the build for its loader
/// in `LD_PRELOAD`, or none, and the program's soft `RLIMIT_NOFILE`
/// (`hooks::limits`).
#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    acts: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let mut owned = None;
    let env = spawn_env(&target::open_path(path), envp, &mut owned);
    let _limit = smclo::adapter::fdnum::ForExec::begin();
    // SAFETY: the caller's arguments, with the environment above.
    unsafe { real::posix_spawn(pid, path, acts, attr, argv, env) }
}

/// Interposed `posix_spawnp(3)`: as [`posix_spawn`], `file` searched in
/// `PATH`.
#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    acts: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let mut owned = None;
    let env = spawn_env(&target::open_file(file), envp, &mut owned);
    let _limit = smclo::adapter::fdnum::ForExec::begin();
    // SAFETY: the caller's arguments, with the environment above.
    unsafe { real::posix_spawnp(pid, file, acts, attr, argv, env) }
}
