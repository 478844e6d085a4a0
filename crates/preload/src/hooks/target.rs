//! Whether the program an exec starts will load this library: only then
//! can it adopt the process's SMC-D connections (`hooks::adopt`). It will
//! when the environment passed to the exec has `LD_PRELOAD` naming this
//! library, the file is a dynamically linked ELF program (`PT_INTERP`), or
//! a script whose interpreter is one, and the exec is not a secure one
//! (set-user-ID or set-group-ID, where the loader ignores `LD_PRELOAD`).
//! Anything unsure counts as "no": the connection then falls back cleanly
//! instead of reaching a program that would read doorbell bytes as data.
//! A program file that does not exist is told apart: that exec fails, and
//! the connections must stay as they are.

use libc::c_char;
use std::ffi::{CStr, OsStr, OsString};
use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What an exec's program file says about the new image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// It will load this library (given `LD_PRELOAD`).
    Preloads,
    /// It will not, or that cannot be told.
    Plain,
    /// There is no such file: the exec will fail.
    Missing,
}

fn target(loads: bool) -> Target {
    if loads {
        Target::Preloads
    } else {
        Target::Plain
    }
}

/// The environment entries of `envp` (NULL-terminated; NULL: none).
pub(super) fn entries<'a>(envp: *const *const c_char) -> Vec<&'a CStr> {
    let mut v = Vec::new();
    if envp.is_null() {
        return v;
    }
    let mut i = 0;
    loop {
        // SAFETY: envp is a NULL-terminated vector of C strings (exec's
        // contract), read up to its NULL.
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            return v;
        }
        // SAFETY: each entry is a NUL-terminated string.
        v.push(unsafe { CStr::from_ptr(p) });
        i += 1;
    }
}

/// The file name of this library, as the loader mapped it.
fn our_name() -> Option<&'static OsStr> {
    static NAME: std::sync::OnceLock<Option<OsString>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        // SAFETY: an all-zero Dl_info is valid; dladdr fills it for an
        // address inside this library.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        let f: fn() -> Option<&'static OsStr> = our_name;
        // SAFETY: dladdr reads the address only.
        if unsafe { libc::dladdr(f as *const libc::c_void, &mut info) } == 0
            || info.dli_fname.is_null()
        {
            return None;
        }
        // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
        let path = unsafe { CStr::from_ptr(info.dli_fname) };
        Path::new(OsStr::from_bytes(path.to_bytes()))
            .file_name()
            .map(OsStr::to_os_string)
    })
    .as_deref()
}

/// Whether `envp` has `LD_PRELOAD` naming this library.
pub(super) fn preload_in(envp: *const *const c_char) -> bool {
    let Some(name) = our_name() else { return false };
    entries(envp).iter().any(|e| {
        e.to_bytes().strip_prefix(b"LD_PRELOAD=").is_some_and(|v| {
            v.split(|&b| b == b':' || b == b' ')
                .any(|p| Path::new(OsStr::from_bytes(p)).file_name() == Some(name))
        })
    })
}

/// Scripts may name an interpreter that is a script in turn; the kernel
/// stops at 4 levels too.
const MAX_DEPTH: usize = 4;

/// Whether the program in `f` loads `LD_PRELOAD` libraries.
fn loads_preload(f: &File, depth: usize) -> bool {
    let Ok(md) = f.metadata() else { return false };
    if md.permissions().mode() & (libc::S_ISUID | libc::S_ISGID) != 0 {
        return false;
    }
    let mut head = [0u8; 4096];
    let Ok(n) = f.read_at(&mut head, 0) else {
        return false;
    };
    let head = &head[..n];
    if let Some(rest) = head.strip_prefix(b"#!") {
        return depth < MAX_DEPTH && interpreter(rest).is_some_and(|p| path_loads(&p, depth + 1));
    }
    has_interp(f, head)
}

/// The interpreter named on a `#!` line.
fn interpreter(rest: &[u8]) -> Option<PathBuf> {
    let line = rest.split(|&b| b == b'\n').next()?;
    let word = line
        .split(|&b| b == b' ' || b == b'\t')
        .find(|w| !w.is_empty())?;
    Some(PathBuf::from(OsStr::from_bytes(word)))
}

fn path_loads(p: &Path, depth: usize) -> bool {
    File::open(p).is_ok_and(|f| loads_preload(&f, depth))
}

/// [`path_loads`], or [`Target::Missing`] when `p` does not exist.
fn path_target(p: &Path) -> Target {
    match File::open(p) {
        Ok(f) => target(loads_preload(&f, 0)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => Target::Missing,
        Err(_) => Target::Plain,
    }
}

/// Whether the 64-bit little-endian ELF file `f` (first bytes `head`) has
/// a `PT_INTERP` program header: it is linked dynamically.
fn has_interp(f: &File, head: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return false;
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as u64;
    let phoff = u64::from_le_bytes(head[32..40].try_into().expect("8 bytes"));
    let (phentsize, phnum) = (u16_at(head, 54), u16_at(head, 56));
    if phentsize < 4 {
        return false;
    }
    (0..phnum).any(|i| {
        let mut ty = [0u8; 4];
        f.read_exact_at(&mut ty, phoff + i * phentsize).is_ok()
            && u32::from_le_bytes(ty) == PT_INTERP
    })
}

/// What the program at `path` (an exec's path argument) is.
pub(super) fn path_runs_preload(path: *const c_char) -> Target {
    if path.is_null() {
        return Target::Missing;
    }
    // SAFETY: exec's path is a NUL-terminated string.
    let p = unsafe { CStr::from_ptr(path) };
    path_target(Path::new(OsStr::from_bytes(p.to_bytes())))
}

/// As [`path_runs_preload`] for `execvp`'s `file`: searched in `PATH` as
/// execvp does when it has no slash.
pub(super) fn file_runs_preload(file: *const c_char) -> Target {
    if file.is_null() {
        return Target::Missing;
    }
    // SAFETY: exec's file is a NUL-terminated string.
    let f = unsafe { CStr::from_ptr(file) }.to_bytes();
    if f.contains(&b'/') {
        return path_runs_preload(file);
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(OsStr::from_bytes(f)))
        .find(|p| p.is_file())
        .map_or(Target::Missing, |p| path_target(&p))
}

/// As [`path_runs_preload`] for `execveat`'s `path` relative to `dirfd`
/// (or `dirfd` itself with `AT_EMPTY_PATH` and an empty path).
pub(super) fn at_runs_preload(dirfd: RawFd, path: *const c_char, flags: libc::c_int) -> Target {
    if path.is_null() {
        return Target::Missing;
    }
    // SAFETY: exec's path is a NUL-terminated string.
    if flags & libc::AT_EMPTY_PATH != 0 && unsafe { *path } == 0 {
        return fd_runs_preload(dirfd);
    }
    let nofollow = if flags & libc::AT_SYMLINK_NOFOLLOW != 0 {
        libc::O_NOFOLLOW
    } else {
        0
    };
    // SAFETY: openat reads the path; the descriptor it returns is ours.
    let fd = unsafe { libc::openat(dirfd, path, libc::O_RDONLY | libc::O_CLOEXEC | nofollow) };
    if fd < 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        return if matches!(e, Some(libc::ENOENT | libc::ENOTDIR)) {
            Target::Missing
        } else {
            Target::Plain
        };
    }
    // SAFETY: `fd` is ours.
    let f = unsafe { File::from_raw_fd(fd) };
    target(loads_preload(&f, 0))
}

/// As [`path_runs_preload`] for `fexecve`'s descriptor.
pub(super) fn fd_runs_preload(fd: RawFd) -> Target {
    // SAFETY: a duplicate of the caller's descriptor, owned by the File.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Target::Missing;
    }
    // SAFETY: `dup` is ours.
    let f = unsafe { File::from_raw_fd(dup) };
    target(loads_preload(&f, 0))
}
