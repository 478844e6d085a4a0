//! Whether the program an exec starts will load this library: only then
//! can it adopt the process's SMC-D connections (`hooks::adopt`). It will
//! when the environment passed to the exec has `LD_PRELOAD` naming a build
//! of this library (`hooks::variant`), the file is a dynamically linked
//! ELF program (`PT_INTERP`) of this library's machine, class and byte
//! order and not Go's (whose programs make their system calls
//! themselves), as `smclo_loader::Header` reads it, or a script whose
//! interpreter is one, and the kernel will not run it in secure mode
//! (`AT_SECURE`, where the loader ignores `LD_PRELOAD` paths): see
//! [`new_image`], the one judgement every exec form makes. Anything unsure
//! counts as "no": the connection then falls back cleanly instead of
//! reaching a program that would read doorbell bytes as data. A program
//! file that does not exist is told apart: that exec fails, and the
//! connections must stay as they are.

use libc::c_char;
use smclo_loader::{Header, MAX_DEPTH};
use std::ffi::{CStr, OsStr};
use std::fmt;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;

/// What an exec's program file says about the new image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// It will load this library (given `LD_PRELOAD`).
    Preloads,
    /// It will not, or that cannot be told.
    Plain(NoPreload),
    /// There is no such file: the exec will fail.
    Missing,
}

/// Why the new image will not load this library (or may not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoPreload {
    /// The file (or a script's interpreter) cannot be opened or read.
    Unreadable,
    /// Neither an ELF program nor a script.
    NotElf,
    /// An ELF program of another machine (`e_machine`; binfmt_misc runs
    /// it through an emulator, which does not load this library), ELF
    /// class or byte order (a 32-bit one's loader cannot load this 64-bit
    /// library): `smclo_loader::Header::is_ours`.
    Foreign,
    /// No `PT_INTERP`: linked statically.
    Static,
    /// Linked by Go: it makes its system calls itself, so the library it
    /// loads would see none of its sockets' reads and writes.
    Go,
    /// Scripts nested deeper than the kernel follows.
    TooDeep,
    /// Secure mode: a set-user-ID or set-group-ID file.
    SetId,
    /// Secure mode: the file has capabilities (`security.capability`) and
    /// the real user is not root.
    FileCaps,
    /// Secure mode: the caller's real and effective user or group differ.
    IdsDiffer,
    /// Secure mode may follow: a security module's exec transition was
    /// asked for (`/proc/self/attr/exec`).
    LsmExec,
}

impl fmt::Display for NoPreload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NoPreload::Unreadable => "its file cannot be read",
            NoPreload::NotElf => "neither an ELF program nor a script",
            NoPreload::Foreign => "an ELF program of another machine, ELF class or byte order",
            NoPreload::Static => "linked statically",
            NoPreload::Go => "a Go program, which makes its system calls without the C library",
            NoPreload::TooDeep => "scripts nested too deep",
            NoPreload::SetId => "set-user-ID or set-group-ID: secure mode",
            NoPreload::FileCaps => "file capabilities: secure mode",
            NoPreload::IdsDiffer => "real and effective user or group differ: secure mode",
            NoPreload::LsmExec => "a security module's exec transition is set",
        })
    }
}

/// The environment entries of `envp` (NULL-terminated; NULL: none), read
/// as they are iterated: nothing is allocated (an exec after `fork` may
/// run where allocating is not safe).
pub(super) fn entries<'a>(envp: *const *const c_char) -> impl Iterator<Item = &'a CStr> {
    (0..).map_while(move |i| {
        if envp.is_null() {
            return None;
        }
        // SAFETY: envp is a NULL-terminated vector of C strings (exec's
        // contract), read up to its NULL.
        let p = unsafe { *envp.add(i) };
        // SAFETY: each entry is a NUL-terminated string.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
    })
}

/// Whether the image an exec of the program in `f` starts will load
/// `LD_PRELOAD` libraries: the process's credentials ([`secure_caller`]),
/// then the file and, for a script, its interpreter ([`loads_preload`]).
pub(super) fn new_image(f: &File) -> Target {
    match secure_caller().and_then(|()| loads_preload(f, 0)) {
        Ok(()) => Target::Preloads,
        Err(why) => Target::Plain(why),
    }
}

/// What makes the kernel run any program this process execs in secure
/// mode: its real and effective user or group differ (the kernel compares
/// the new effective ids with the real ones), or a security module's exec
/// transition was asked for (an SELinux exec context, an AppArmor
/// `change_onexec`: transitions the policy makes on its own cannot be
/// seen from here).
fn secure_caller() -> Result<(), NoPreload> {
    let (u, g) = (
        real_and_effective(libc::getresuid),
        real_and_effective(libc::getresgid),
    );
    if u.is_none_or(|(r, e)| r != e) || g.is_none_or(|(r, e)| r != e) {
        return Err(NoPreload::IdsDiffer);
    }
    // Empty where no module keeps one (or none is set).
    match std::fs::read("/proc/self/attr/exec") {
        Ok(v) if v.iter().any(|&b| b != 0 && !b.is_ascii_whitespace()) => Err(NoPreload::LsmExec),
        _ => Ok(()),
    }
}

/// The real and effective id of `getres` (`getresuid` or `getresgid`).
fn real_and_effective<T: Copy + Default>(
    getres: unsafe extern "C" fn(*mut T, *mut T, *mut T) -> libc::c_int,
) -> Option<(T, T)> {
    let (mut r, mut e, mut s) = (T::default(), T::default(), T::default());
    // SAFETY: the three pointers are to locals of the right type.
    (unsafe { getres(&mut r, &mut e, &mut s) } == 0).then_some((r, e))
}

/// Whether the program in `f` loads `LD_PRELOAD` libraries when this
/// process execs it.
fn loads_preload(f: &File, depth: usize) -> Result<(), NoPreload> {
    let md = f.metadata().map_err(|_| NoPreload::Unreadable)?;
    // Conservative: the kernel goes secure only when the ids change.
    if md.permissions().mode() & (libc::S_ISUID | libc::S_ISGID) != 0 {
        return Err(NoPreload::SetId);
    }
    if has_caps(f) && !real_root() {
        return Err(NoPreload::FileCaps);
    }
    let mut head = [0u8; 4096];
    let n = f.read_at(&mut head, 0).map_err(|_| NoPreload::Unreadable)?;
    let head = &head[..n];
    if let Some(rest) = head.strip_prefix(b"#!") {
        if depth >= MAX_DEPTH {
            return Err(NoPreload::TooDeep);
        }
        let p = smclo_loader::interpreter(rest).ok_or(NoPreload::NotElf)?;
        return path_loads(Path::new(OsStr::from_bytes(p)), depth + 1);
    }
    elf_loads(f, head)
}

/// Whether the ELF program in `f` (first bytes `head`) loads `LD_PRELOAD`
/// libraries: it is one of this library's machine, class and byte order,
/// linked dynamically, and not by Go. Its machine is judged first: a
/// 32-bit program is foreign whether or not it is linked statically.
fn elf_loads(f: &File, head: &[u8]) -> Result<(), NoPreload> {
    let h = Header::parse(head).ok_or(NoPreload::NotElf)?;
    if !h.is_ours() {
        return Err(NoPreload::Foreign);
    }
    // Program headers that cannot be read show no `PT_INTERP` (nor would
    // they to the kernel, which then does not run the file).
    if h.has_interp(f) != Ok(true) {
        Err(NoPreload::Static)
    } else if h.is_go(f) {
        Err(NoPreload::Go)
    } else {
        Ok(())
    }
}

/// Whether `f` has file capabilities, or may have (unsure counts as yes).
fn has_caps(f: &File) -> bool {
    // SAFETY: a size query (no buffer) on a descriptor the File owns.
    let n = unsafe {
        libc::fgetxattr(
            f.as_raw_fd(),
            c"security.capability".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n >= 0
        || !matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENODATA | libc::ENOTSUP)
        )
}

/// Whether the real user is root (of this user namespace): its execs of
/// programs with file capabilities are not in secure mode.
fn real_root() -> bool {
    real_and_effective(libc::getresuid).is_some_and(|(r, _)| r == 0)
}

fn path_loads(p: &Path, depth: usize) -> Result<(), NoPreload> {
    let f = File::open(p).map_err(|_| NoPreload::Unreadable)?;
    loads_preload(&f, depth)
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
        Program::File(f) => new_image(f),
        Program::Missing => Target::Missing,
        Program::Unreadable => Target::Plain(NoPreload::Unreadable),
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
    let dup =
        smclo::adapter::fdnum::internal(|| unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) });
    if dup < 0 {
        return Program::Missing;
    }
    // SAFETY: `dup` is ours.
    Program::File(unsafe { File::from_raw_fd(dup) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smclo_loader::MACHINE;
    use std::path::PathBuf;

    /// An ELF file's class and byte order.
    #[derive(Clone, Copy)]
    enum Kind {
        Le64,
        Le32,
        Be64,
    }

    /// An ELF header of `kind` and `machine` with one program header of
    /// type `ty`, in a file of its own (removed on drop).
    struct Crafted(PathBuf);

    impl Crafted {
        fn new(tag: &str, kind: Kind, machine: u16, ty: u32) -> Crafted {
            let (class, data, big) = match kind {
                Kind::Le64 => (2, 1, false),
                Kind::Le32 => (1, 1, false),
                Kind::Be64 => (2, 2, true),
            };
            // Where e_phoff, e_phentsize and e_phnum are, and the sizes of
            // the ELF header and a program header, in this class.
            let (phoff, phent, ehsize, phsize) = if class == 2 {
                (32..40, 54, 64, 56)
            } else {
                (28..32, 42, 52, 32)
            };
            let put = |b: &mut [u8], at: usize, v: u64, n: usize| {
                let le = v.to_le_bytes();
                for i in 0..n {
                    b[at + i] = if big { le[n - 1 - i] } else { le[i] };
                }
            };
            let mut b = vec![0u8; ehsize + phsize];
            b[..4].copy_from_slice(b"\x7fELF");
            (b[4], b[5], b[6]) = (class, data, 1);
            put(&mut b, 16, 3, 2); // ET_DYN
            put(&mut b, 18, machine.into(), 2);
            put(&mut b, phoff.start, ehsize as u64, phoff.len());
            put(&mut b, phent, phsize as u64, 2);
            put(&mut b, phent + 2, 1, 2);
            put(&mut b, ehsize, ty.into(), 4);
            Crafted::write(tag, &b)
        }

        fn write(tag: &str, b: &[u8]) -> Crafted {
            let p = std::env::temp_dir().join(format!("smclo-target-{tag}-{}", std::process::id()));
            std::fs::write(&p, b).unwrap();
            Crafted(p)
        }

        fn judged(&self) -> Result<(), NoPreload> {
            loads_preload(&File::open(&self.0).unwrap(), 0)
        }
    }

    impl Drop for Crafted {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const PT_LOAD: u32 = 1;
    const PT_INTERP: u32 = 3;

    /// A machine that is not this library's.
    fn foreign() -> u16 {
        const EM_RISCV: u16 = 243;
        const EM_AARCH64: u16 = 183;
        if MACHINE == Some(EM_AARCH64) {
            EM_RISCV
        } else {
            EM_AARCH64
        }
    }

    #[test]
    fn elf_machine_class_and_interp_are_judged() {
        let Some(m) = MACHINE else {
            return;
        };
        let native = Crafted::new("native", Kind::Le64, m, PT_INTERP);
        assert_eq!(native.judged(), Ok(()));
        let other = Crafted::new("foreign", Kind::Le64, foreign(), PT_INTERP);
        assert_eq!(other.judged(), Err(NoPreload::Foreign));
        let fixed = Crafted::new("static", Kind::Le64, m, PT_LOAD);
        assert_eq!(fixed.judged(), Err(NoPreload::Static));
        let text = Crafted::write("text", &[b'x'; 100]);
        assert_eq!(text.judged(), Err(NoPreload::NotElf));
    }

    /// A 32-bit or big-endian program is an ELF program, of a class or
    /// byte order this library cannot be loaded into: the debug log says
    /// so, as it says for `LD_PRELOAD` (`hooks::variant`), and not that the
    /// file is not ELF; nor, for a static one, that it is merely static.
    #[test]
    fn a_program_of_another_class_or_byte_order_is_foreign() {
        let Some(m) = MACHINE else {
            return;
        };
        const EM_386: u16 = 3;
        for (tag, kind, machine, ty) in [
            ("i386", Kind::Le32, EM_386, PT_INTERP),
            ("i386-static", Kind::Le32, EM_386, PT_LOAD),
            ("x32", Kind::Le32, m, PT_INTERP),
            ("big", Kind::Be64, m, PT_INTERP),
        ] {
            let c = Crafted::new(tag, kind, machine, ty);
            assert_eq!(c.judged(), Err(NoPreload::Foreign), "{tag}");
        }
        let why = NoPreload::Foreign.to_string();
        assert!(why.contains("ELF class or byte order"), "{why}");
    }

    #[test]
    fn a_script_is_judged_by_its_interpreter() {
        let Some(m) = MACHINE else {
            return;
        };
        let native = Crafted::new("interp-native", Kind::Le64, m, PT_INTERP);
        let other = Crafted::new("interp-foreign", Kind::Le64, foreign(), PT_INTERP);
        let line = |c: &Crafted| format!("#!{} -x\necho\n", c.0.display());
        let on_native = Crafted::write("script-native", line(&native).as_bytes());
        let on_other = Crafted::write("script-foreign", line(&other).as_bytes());
        assert_eq!(on_native.judged(), Ok(()));
        assert_eq!(on_other.judged(), Err(NoPreload::Foreign));
    }
}
