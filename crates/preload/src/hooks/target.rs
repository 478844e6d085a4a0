//! Whether the program an exec starts will load this library: only then
//! can it adopt the process's SMC-D connections (`hooks::adopt`). It will
//! when the environment passed to the exec has `LD_PRELOAD` naming a build
//! of this library (`hooks::variant`), the file is a dynamically linked ELF program (`PT_INTERP`), or
//! a script whose interpreter is one, and the exec is not a secure one
//! (set-user-ID or set-group-ID, where the loader ignores `LD_PRELOAD`).
//! Anything unsure counts as "no": the connection then falls back cleanly
//! instead of reaching a program that would read doorbell bytes as data.
//! A program file that does not exist is told apart: that exec fails, and
//! the connections must stay as they are.

use libc::c_char;
use std::ffi::{CStr, OsStr};
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

/// Whether `envp` has `LD_PRELOAD` naming a build of this library.
pub(super) fn preload_in(envp: *const *const c_char) -> bool {
    let env = entries(envp);
    env.iter().any(|e| {
        e.to_bytes().strip_prefix(b"LD_PRELOAD=").is_some_and(|v| {
            v.split(|&b| b == b':' || b == b' ')
                .any(|p| super::variant::is_ours(p, &env))
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

/// An exec's program file, found as the exec will find it.
pub(super) enum Program {
    /// The file, open for reading.
    File(File),
    /// There is no such file: the exec will fail.
    Missing,
    /// It cannot be opened for reading.
    Unreadable,
}

/// What the exec's program is.
pub(super) fn runs_preload(p: &Program) -> Target {
    match p {
        Program::File(f) => target(loads_preload(f, 0)),
        Program::Missing => Target::Missing,
        Program::Unreadable => Target::Plain,
    }
}

/// The program file at `p`.
fn open(p: &Path) -> Program {
    match File::open(p) {
        Ok(f) => Program::File(f),
        Err(e) => missing_or_unreadable(&e),
    }
}

fn missing_or_unreadable(e: &std::io::Error) -> Program {
    if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) {
        Program::Missing
    } else {
        Program::Unreadable
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

/// The program file at `path` (an exec's path argument).
pub(super) fn open_path(path: *const c_char) -> Program {
    if path.is_null() {
        return Program::Missing;
    }
    // SAFETY: exec's path is a NUL-terminated string.
    let p = unsafe { CStr::from_ptr(path) };
    open(Path::new(OsStr::from_bytes(p.to_bytes())))
}

/// As [`open_path`] for `execvp`'s `file`: searched in `PATH` as execvp
/// does when it has no slash.
pub(super) fn open_file(file: *const c_char) -> Program {
    if file.is_null() {
        return Program::Missing;
    }
    // SAFETY: exec's file is a NUL-terminated string.
    let f = unsafe { CStr::from_ptr(file) }.to_bytes();
    if f.contains(&b'/') {
        return open_path(file);
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(OsStr::from_bytes(f)))
        .find(|p| p.is_file())
        .map_or(Program::Missing, |p| open(&p))
}

/// As [`open_path`] for `execveat`'s `path` relative to `dirfd` (or
/// `dirfd` itself with `AT_EMPTY_PATH` and an empty path).
pub(super) fn open_at(dirfd: RawFd, path: *const c_char, flags: libc::c_int) -> Program {
    if path.is_null() {
        return Program::Missing;
    }
    // SAFETY: exec's path is a NUL-terminated string.
    if flags & libc::AT_EMPTY_PATH != 0 && unsafe { *path } == 0 {
        return open_fd(dirfd);
    }
    let nofollow = if flags & libc::AT_SYMLINK_NOFOLLOW != 0 {
        libc::O_NOFOLLOW
    } else {
        0
    };
    // SAFETY: openat reads the path; the descriptor it returns is ours.
    let fd = unsafe { libc::openat(dirfd, path, libc::O_RDONLY | libc::O_CLOEXEC | nofollow) };
    if fd < 0 {
        return missing_or_unreadable(&std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is ours.
    Program::File(unsafe { File::from_raw_fd(fd) })
}

/// As [`open_path`] for `fexecve`'s descriptor.
pub(super) fn open_fd(fd: RawFd) -> Program {
    // SAFETY: a duplicate of the caller's descriptor, owned by the File.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Program::Missing;
    }
    // SAFETY: `dup` is ours.
    Program::File(unsafe { File::from_raw_fd(dup) })
}
