//! Which dynamic loader runs a program, and which build of the preload
//! library that loader can load.
//!
//! A loader handed a library built against another C library does not
//! skip it: musl's stops the program before `main` ("Error relocating
//! libsmclo_preload.so: _Unwind_Resume: symbol not found"). So `smclo run`
//! and the preload's exec hooks read the program's `PT_INTERP` (through
//! `#!` interpreters, as the kernel does) and give its `LD_PRELOAD` the
//! build for that loader, or none of smclo's. The exec hooks also judge
//! with [`Header`] whether the new program loads the library at all (of
//! this machine, linked dynamically, not by Go). Nothing here allocates
//! unless `LD_PRELOAD` changes: an exec may follow `fork` in a
//! multithreaded program.

#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The dynamic loader a program file asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loader {
    /// glibc's (`ld-linux-x86-64.so.2`, `ld-linux-aarch64.so.1`).
    Glibc,
    /// musl's (`ld-musl-x86_64.so.1`).
    Musl,
    /// Another loader, or a program of another machine, ELF class or byte
    /// order: no build of the library loads there.
    Foreign,
    /// No loader runs: the program is linked statically.
    Static,
    /// Cannot be told: the file is unreadable, neither an ELF file nor a
    /// script, or its `#!` chain is too deep.
    Unknown,
}

impl Loader {
    /// The loader of the program in `f` (an ELF file or a `#!` script).
    pub fn of_file(f: &File) -> Loader {
        of_file(f, 0)
    }

    /// The loader of the program at `p`.
    pub fn of_path(p: &Path) -> Loader {
        of_path(p, 0)
    }

    /// The loader named by a `PT_INTERP` path of this machine's class.
    pub fn of_interp(path: &[u8]) -> Loader {
        let name = file_name(path);
        if name.starts_with(b"ld-musl-") {
            Loader::Musl
        } else if name.starts_with(b"ld-linux") {
            Loader::Glibc
        } else {
            Loader::Foreign
        }
    }
}

/// A build of the preload library, for one C library's loader. Both are
/// the same source: their ends of a connection meet on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Glibc,
    Musl,
}

impl Variant {
    pub const ALL: [Variant; 2] = [Variant::Glibc, Variant::Musl];

    /// Its file name as installed (side by side in one directory).
    pub const fn file_name(self) -> &'static str {
        match self {
            Variant::Glibc => "libsmclo_preload.so",
            Variant::Musl => "libsmclo_preload_musl.so",
        }
    }

    /// The environment variable with its path: the user's choice for
    /// `smclo run`, which sets it for the exec hooks of the program.
    pub const fn env_var(self) -> &'static str {
        match self {
            Variant::Glibc => "SMCLO_PRELOAD_LIB",
            Variant::Musl => "SMCLO_PRELOAD_MUSL_LIB",
        }
    }

    /// Its C library, for messages.
    pub const fn libc_name(self) -> &'static str {
        match self {
            Variant::Glibc => "glibc",
            Variant::Musl => "musl",
        }
    }

    /// The build this code is compiled into.
    pub const fn this_build() -> Variant {
        if cfg!(target_env = "musl") {
            Variant::Musl
        } else {
            Variant::Glibc
        }
    }
}

/// What a program's `LD_PRELOAD` gets of smclo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The build for its loader.
    Load(Variant),
    /// None: its loader could load no build.
    Nothing,
    /// Whatever it has: no loader reads it (a static program, whose
    /// children may be dynamic), or the loader cannot be told.
    Keep,
}

impl Choice {
    pub fn for_loader(l: Loader) -> Choice {
        match l {
            Loader::Glibc => Choice::Load(Variant::Glibc),
            Loader::Musl => Choice::Load(Variant::Musl),
            Loader::Foreign => Choice::Nothing,
            Loader::Static | Loader::Unknown => Choice::Keep,
        }
    }
}

/// The last component of a path.
fn file_name(path: &[u8]) -> &[u8] {
    path.rsplit(|&b| b == b'/').next().unwrap_or(path)
}

/// Whether an `LD_PRELOAD` entry names a build of the library: its file
/// name is a build's, or that of one of the `known` paths (a build
/// installed under another name).
pub fn is_build<'a>(entry: &[u8], known: impl IntoIterator<Item = &'a [u8]>) -> bool {
    let name = file_name(entry);
    Variant::ALL
        .iter()
        .any(|v| name == v.file_name().as_bytes())
        || known.into_iter().any(|k| name == file_name(k))
}

/// `LD_PRELOAD`'s separators, as both loaders split it.
fn entries(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b':' || b == b' ' || b == b'\t')
        .filter(|e| !e.is_empty())
}

/// Whether `value` (an `LD_PRELOAD`) names a build (`is_ours`).
pub fn names_build(value: &[u8], is_ours: impl Fn(&[u8]) -> bool) -> bool {
    entries(value).any(is_ours)
}

/// `value` (an `LD_PRELOAD`) with `lib` in place of its builds of the
/// library (`is_ours`), or without them if `lib` is `None`. `None` when
/// nothing changes: it names no build, or names `lib` alone.
pub fn rewrite(
    value: &[u8],
    is_ours: impl Fn(&[u8]) -> bool,
    lib: Option<&[u8]>,
) -> Option<Vec<u8>> {
    let mut ours = entries(value).filter(|e| is_ours(e));
    let first = ours.next()?;
    if lib == Some(first) && ours.next().is_none() {
        return None;
    }
    let mut placed = false;
    let mut out: Vec<&[u8]> = Vec::new();
    for e in entries(value) {
        if !is_ours(e) {
            out.push(e);
        } else if !placed {
            placed = true;
            out.extend(lib);
        }
    }
    Some(out.join(&b':'))
}

/// [`rewrite`] for a launcher: `lib` is also appended when `value` names
/// no build yet. The new value (possibly empty: no `LD_PRELOAD`).
pub fn with_lib(value: &[u8], is_ours: impl Fn(&[u8]) -> bool, lib: Option<&[u8]>) -> Vec<u8> {
    if names_build(value, &is_ours) {
        return rewrite(value, is_ours, lib).unwrap_or_else(|| value.to_vec());
    }
    let mut out: Vec<&[u8]> = entries(value).collect();
    out.extend(lib);
    out.join(&b':')
}

/// Scripts may name an interpreter that is a script in turn; the kernel
/// stops at 4 levels too.
pub const MAX_DEPTH: usize = 4;

/// How much of a file's start is read: the ELF header, a `#!` line.
const HEAD: usize = 256;

/// The longest `PT_INTERP` read (PATH_MAX).
const MAX_INTERP: usize = 4096;

fn of_path(p: &Path, depth: usize) -> Loader {
    File::open(p).map_or(Loader::Unknown, |f| of_file(&f, depth))
}

fn of_file(f: &File, depth: usize) -> Loader {
    let mut head = [0u8; HEAD];
    let Ok(n) = f.read_at(&mut head, 0) else {
        return Loader::Unknown;
    };
    let head = &head[..n];
    if let Some(rest) = head.strip_prefix(b"#!") {
        return match interpreter(rest) {
            Some(p) if depth < MAX_DEPTH => of_path(Path::new(OsStr::from_bytes(p)), depth + 1),
            _ => Loader::Unknown,
        };
    }
    let Some(h) = Header::parse(head) else {
        return Loader::Unknown;
    };
    let mut path = [0u8; MAX_INTERP];
    match h.interp(f, &mut path) {
        Err(_) => Loader::Unknown,
        Ok(None) => Loader::Static,
        Ok(Some(_)) if !h.is_ours() => Loader::Foreign,
        Ok(Some(path)) => Loader::of_interp(path),
    }
}

/// The interpreter named on a `#!` line (`rest`: what follows the `#!`).
pub fn interpreter(rest: &[u8]) -> Option<&[u8]> {
    let line = rest.split(|&b| b == b'\n').next()?;
    line.split(|&b| b == b' ' || b == b'\t')
        .find(|w| !w.is_empty())
}

/// The ELF machine (`e_machine`) this code is built for; elsewhere
/// unknown: no program counts as this machine's.
pub const MACHINE: Option<u16> = if cfg!(target_arch = "x86_64") {
    Some(62)
} else if cfg!(target_arch = "aarch64") {
    Some(183)
} else {
    None
};

const PT_INTERP: u32 = 3;
const PT_NOTE: u32 = 4;

/// The type of Go's build ID note (`.note.go.buildid`, owner "Go"), which
/// the Go linker puts in every program it links, in a note segment of its
/// own.
const NT_GO_BUILDID: u32 = 4;

/// The most of a note segment read when looking for Go's note.
const MAX_NOTES: usize = 1024;

/// Whether the ELF program in `f` was linked by Go's linker (its build ID
/// note). Go makes its system calls itself, not through the C library, so
/// an interposed library sees none of its sockets even when its loader
/// loads one (a program that uses cgo is linked dynamically). A program
/// that cannot be read, or is not ELF, is not.
pub fn is_go(f: &File) -> bool {
    let mut head = [0u8; HEAD];
    let Ok(n) = f.read_at(&mut head, 0) else {
        return false;
    };
    Header::parse(&head[..n]).is_some_and(|h| h.is_go(f))
}

/// Why an ELF file's program headers, or a segment they name, cannot be
/// read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElfError {
    /// `e_phentsize` is smaller than a program header of the file's class,
    /// or a program header's offset overflows.
    Malformed,
    /// The file ends, or reading fails, before the program header or
    /// segment.
    Unreadable,
}

/// What an ELF file's header says: the program it holds and where its
/// program headers are. The one reader of ELF headers for both `smclo
/// run` and the preload's exec hooks.
pub struct Header {
    class64: bool,
    little: bool,
    machine: u16,
    phoff: u64,
    phentsize: u64,
    phnum: u64,
}

impl Header {
    /// The header at the start of a file (`b`: its first bytes, at least
    /// 64); `None` if it is not an ELF file of a known class and byte
    /// order.
    pub fn parse(b: &[u8]) -> Option<Header> {
        if b.len() < 64 || &b[..4] != b"\x7fELF" {
            return None;
        }
        let class64 = match b[4] {
            1 => false,
            2 => true,
            _ => return None,
        };
        let little = match b[5] {
            1 => true,
            2 => false,
            _ => return None,
        };
        let h = Header {
            class64,
            little,
            machine: 0,
            phoff: 0,
            phentsize: 0,
            phnum: 0,
        };
        // e_phoff, then (after e_shoff and e_flags, e_ehsize) e_phentsize
        // and e_phnum, at the offsets of each class.
        let (phoff, phent) = if class64 {
            (h.word(b, 32), 54)
        } else {
            (h.half(b, 28) as u64, 42)
        };
        Some(Header {
            machine: h.u16_at(b, 18),
            phoff,
            phentsize: h.u16_at(b, phent) as u64,
            phnum: h.u16_at(b, phent + 2) as u64,
            ..h
        })
    }

    /// Whether it is a program of this build's ELF class, byte order and
    /// [`MACHINE`]: one a build of the preload library can be loaded into.
    pub fn is_ours(&self) -> bool {
        self.class64 == cfg!(target_pointer_width = "64")
            && self.little == cfg!(target_endian = "little")
            && MACHINE == Some(self.machine)
    }

    fn u16_at(&self, b: &[u8], o: usize) -> u16 {
        let v = [b[o], b[o + 1]];
        if self.little {
            u16::from_le_bytes(v)
        } else {
            u16::from_be_bytes(v)
        }
    }

    fn half(&self, b: &[u8], o: usize) -> u32 {
        let v = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if self.little {
            u32::from_le_bytes(v)
        } else {
            u32::from_be_bytes(v)
        }
    }

    fn word(&self, b: &[u8], o: usize) -> u64 {
        let v: [u8; 8] = b[o..o + 8].try_into().expect("8 bytes");
        if self.little {
            u64::from_le_bytes(v)
        } else {
            u64::from_be_bytes(v)
        }
    }

    /// Whether the program in `f` (the file this header starts) has a
    /// `PT_INTERP` program header: it is linked dynamically.
    pub fn has_interp(&self, f: &File) -> Result<bool, ElfError> {
        Ok(self.segment(f, PT_INTERP, |_, _| Ok(true))?.is_some())
    }

    /// The `PT_INTERP` path of the program in `f`, read into `buf`;
    /// `None` if there is none.
    fn interp<'b>(&self, f: &File, buf: &'b mut [u8]) -> Result<Option<&'b [u8]>, ElfError> {
        let Some((off, len)) = self.segment(f, PT_INTERP, |_, _| Ok(true))? else {
            return Ok(None);
        };
        let len = len.min(buf.len() as u64) as usize;
        read_at(f, &mut buf[..len], off)?;
        let end = buf[..len].iter().position(|&b| b == 0).unwrap_or(len);
        Ok(Some(&buf[..end]))
    }

    /// Whether the program in `f` was linked by Go's linker (see
    /// [`is_go`]); not when its program headers cannot be read.
    pub fn is_go(&self, f: &File) -> bool {
        self.has_go_note(f) == Ok(true)
    }

    /// Whether a `PT_NOTE` segment holds Go's build ID note.
    fn has_go_note(&self, f: &File) -> Result<bool, ElfError> {
        let go = |off, len: u64| {
            let mut buf = [0u8; MAX_NOTES];
            let len = len.min(MAX_NOTES as u64) as usize;
            read_at(f, &mut buf[..len], off)?;
            Ok(self.notes_have_go(&buf[..len]))
        };
        Ok(self.segment(f, PT_NOTE, go)?.is_some())
    }

    /// Whether the notes in `b` (a note segment's start) include Go's
    /// build ID: name "Go" (Go's linker pads it to 4 bytes in `namesz`),
    /// type [`NT_GO_BUILDID`].
    fn notes_have_go(&self, b: &[u8]) -> bool {
        let align4 = |n: u32| (n as usize).div_ceil(4) * 4;
        let mut at = 0;
        while at + 12 <= b.len() {
            let (namesz, descsz, ty) =
                (self.half(b, at), self.half(b, at + 4), self.half(b, at + 8));
            let name = &b[at + 12..];
            if ty == NT_GO_BUILDID && matches!(namesz, 3 | 4) && name.starts_with(b"Go\0") {
                return true;
            }
            at += 12 + align4(namesz) + align4(descsz);
        }
        false
    }

    /// The first program header of type `ty` for which `pick(p_offset,
    /// p_filesz)` holds: its offset and size.
    fn segment(
        &self,
        f: &File,
        ty: u32,
        mut pick: impl FnMut(u64, u64) -> Result<bool, ElfError>,
    ) -> Result<Option<(u64, u64)>, ElfError> {
        // p_type, then p_offset and p_filesz, at the offsets of each class.
        let (size, offset, filesz) = if self.class64 {
            (56, 8, 32)
        } else {
            (32, 4, 16)
        };
        if self.phentsize < size as u64 {
            return Err(ElfError::Malformed);
        }
        let mut whole = [0u8; 56];
        let ph = &mut whole[..size];
        for i in 0..self.phnum {
            let at = self.phoff.checked_add(i * self.phentsize);
            read_at(f, ph, at.ok_or(ElfError::Malformed)?)?;
            if self.half(ph, 0) != ty {
                continue;
            }
            let (off, len) = if self.class64 {
                (self.word(ph, offset), self.word(ph, filesz))
            } else {
                (self.half(ph, offset) as u64, self.half(ph, filesz) as u64)
            };
            if pick(off, len)? {
                return Ok(Some((off, len)));
            }
        }
        Ok(None)
    }
}

/// `buf`'s length of `f` from `off`.
fn read_at(f: &File, buf: &mut [u8], off: u64) -> Result<(), ElfError> {
    f.read_exact_at(buf, off).map_err(|_| ElfError::Unreadable)
}

#[cfg(test)]
mod tests;
