use super::*;
use std::path::PathBuf;

/// A test's own directory, removed with everything in it on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(test: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("smclo-loader-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    /// A file in it.
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A minimal little-endian ELF file: the header, one program header (a
/// PT_INTERP naming `interp`, or a PT_LOAD) and the path.
fn elf(class64: bool, machine: u16, interp: Option<&str>) -> Vec<u8> {
    let (ehsize, phsize) = if class64 { (64, 56) } else { (52, 32) };
    let path_at = ehsize + phsize;
    let path = interp.map(|p| format!("{p}\0")).unwrap_or_default();
    let mut b = vec![0u8; path_at + path.len()];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = if class64 { 2 } else { 1 };
    b[5] = 1;
    b[16] = 2; // ET_EXEC
    b[18..20].copy_from_slice(&machine.to_le_bytes());
    let ty: u32 = if interp.is_some() { PT_INTERP } else { 1 };
    if class64 {
        b[32..40].copy_from_slice(&(ehsize as u64).to_le_bytes());
        b[54..56].copy_from_slice(&(phsize as u16).to_le_bytes());
        b[56..58].copy_from_slice(&1u16.to_le_bytes());
        let ph = &mut b[ehsize..];
        ph[..4].copy_from_slice(&ty.to_le_bytes());
        ph[8..16].copy_from_slice(&(path_at as u64).to_le_bytes());
        ph[32..40].copy_from_slice(&(path.len() as u64).to_le_bytes());
    } else {
        b[28..32].copy_from_slice(&(ehsize as u32).to_le_bytes());
        b[42..44].copy_from_slice(&(phsize as u16).to_le_bytes());
        b[44..46].copy_from_slice(&1u16.to_le_bytes());
        let ph = &mut b[ehsize..];
        ph[..4].copy_from_slice(&ty.to_le_bytes());
        ph[4..8].copy_from_slice(&(path_at as u32).to_le_bytes());
        ph[16..20].copy_from_slice(&(path.len() as u32).to_le_bytes());
    }
    b[path_at..].copy_from_slice(path.as_bytes());
    b
}

const OURS: u16 = match MACHINE {
    Some(m) => m,
    None => 62,
};

#[test]
fn a_program_is_told_by_its_interpreter() {
    let d = Dir::new("interp");
    let cases = [
        (
            "musl",
            elf(true, OURS, Some("/lib/ld-musl-x86_64.so.1")),
            Loader::Musl,
        ),
        (
            "glibc",
            elf(true, OURS, Some("/lib64/ld-linux-x86-64.so.2")),
            Loader::Glibc,
        ),
        (
            "nix",
            elf(
                true,
                OURS,
                Some("/nix/store/x-glibc/lib/ld-linux-x86-64.so.2"),
            ),
            Loader::Glibc,
        ),
        (
            "bionic",
            elf(true, OURS, Some("/system/bin/linker64")),
            Loader::Foreign,
        ),
        ("static", elf(true, OURS, None), Loader::Static),
        (
            "i386",
            elf(false, 3, Some("/lib/ld-linux.so.2")),
            Loader::Foreign,
        ),
        ("i386-static", elf(false, 3, None), Loader::Static),
        (
            "other-machine",
            elf(true, OURS + 1, Some("/lib/ld-linux-aarch64.so.1")),
            Loader::Foreign,
        ),
    ];
    for (name, bytes, want) in cases {
        assert_eq!(Loader::of_path(&d.file(name, &bytes)), want, "{name}");
    }
}

#[test]
fn a_script_is_told_by_its_interpreter() {
    let d = Dir::new("script");
    let musl = d.file(
        "musl-sh",
        &elf(true, OURS, Some("/lib/ld-musl-x86_64.so.1")),
    );
    let script = d.file(
        "script",
        format!("#!{} -e\necho\n", musl.display()).as_bytes(),
    );
    assert_eq!(Loader::of_path(&script), Loader::Musl);
    // A script run by a script, up to the kernel's depth.
    let mut p = script;
    for i in 0..MAX_DEPTH - 1 {
        p = d.file(
            &format!("nested{i}"),
            format!("#! {}\n", p.display()).as_bytes(),
        );
    }
    assert_eq!(Loader::of_path(&p), Loader::Musl);
    let deeper = d.file("deeper", format!("#!{}\n", p.display()).as_bytes());
    assert_eq!(Loader::of_path(&deeper), Loader::Unknown);
}

#[test]
fn what_is_not_a_program_is_unknown() {
    let d = Dir::new("unknown");
    assert_eq!(
        Loader::of_path(&d.file("text", b"hello\n")),
        Loader::Unknown
    );
    assert_eq!(
        Loader::of_path(Path::new("/nonexistent/prog")),
        Loader::Unknown
    );
    let mut cut = elf(true, OURS, Some("/lib/ld-musl-x86_64.so.1"));
    cut.truncate(70);
    assert_eq!(Loader::of_path(&d.file("cut", &cut)), Loader::Unknown);
}

#[test]
fn this_test_runs_under_its_own_builds_loader() {
    let exe = std::env::current_exe().unwrap();
    let want = match Variant::this_build() {
        Variant::Glibc => Loader::Glibc,
        Variant::Musl => Loader::Musl,
    };
    // A statically linked test binary has no loader at all.
    let got = Loader::of_path(&exe);
    assert!(got == want || got == Loader::Static, "{got:?}");
}

fn ours(e: &[u8]) -> bool {
    is_build(e, [b"/opt/x/custom.so".as_slice()])
}

type Case<'a> = (&'a [u8], Option<&'a [u8]>, Option<&'a [u8]>);

#[test]
fn ld_preload_gets_the_build_in_place_of_ours() {
    let musl = b"/usr/lib/smclo/libsmclo_preload_musl.so".as_slice();
    // LD_PRELOAD, the build it should name, what it becomes.
    let cases: [Case; 7] = [
        (
            b"/usr/lib/smclo/libsmclo_preload.so",
            Some(musl),
            Some(musl),
        ),
        (
            b"/a.so:/usr/lib/smclo/libsmclo_preload.so /b.so",
            Some(musl),
            Some(b"/a.so:/usr/lib/smclo/libsmclo_preload_musl.so:/b.so"),
        ),
        (
            b"/a.so:/usr/lib/smclo/libsmclo_preload.so",
            None,
            Some(b"/a.so"),
        ),
        (b"/usr/lib/smclo/libsmclo_preload.so", None, Some(b"")),
        (
            b"/opt/x/custom.so:/a.so",
            Some(musl),
            Some(b"/usr/lib/smclo/libsmclo_preload_musl.so:/a.so"),
        ),
        (b"/a.so:/b.so", Some(musl), None),
        (musl, Some(musl), None),
    ];
    for (value, lib, want) in cases {
        let got = rewrite(value, ours, lib);
        assert_eq!(got.as_deref(), want, "{}", String::from_utf8_lossy(value));
    }
}

#[test]
fn a_launcher_appends_the_build_when_there_is_none() {
    let lib = b"/l/libsmclo_preload.so".as_slice();
    assert_eq!(with_lib(b"", ours, Some(lib)), lib);
    assert_eq!(
        with_lib(b"/a.so", ours, Some(lib)),
        b"/a.so:/l/libsmclo_preload.so"
    );
    assert_eq!(with_lib(b"/a.so", ours, None), b"/a.so");
    assert_eq!(
        with_lib(b"/x/libsmclo_preload_musl.so:/a.so", ours, Some(lib)),
        b"/l/libsmclo_preload.so:/a.so"
    );
    assert_eq!(with_lib(b"/x/libsmclo_preload.so", ours, None), b"");
}

#[test]
fn each_loader_gets_its_own_build() {
    assert_eq!(
        Choice::for_loader(Loader::Musl),
        Choice::Load(Variant::Musl)
    );
    assert_eq!(
        Choice::for_loader(Loader::Glibc),
        Choice::Load(Variant::Glibc)
    );
    assert_eq!(Choice::for_loader(Loader::Foreign), Choice::Nothing);
    assert_eq!(Choice::for_loader(Loader::Static), Choice::Keep);
    assert_eq!(Choice::for_loader(Loader::Unknown), Choice::Keep);
}

/// A minimal 64-bit little-endian ELF program with a PT_INTERP (as `elf`)
/// followed by a PT_NOTE segment holding `notes`: (owner, type, desc len).
fn elf_with_notes(notes: &[(&str, u32, usize)]) -> Vec<u8> {
    let mut b = elf(true, OURS, Some("/lib64/ld-linux-x86-64.so.2"));
    let mut seg = Vec::new();
    for &(owner, ty, desc) in notes {
        let name = format!("{owner}\0");
        seg.extend_from_slice(&(name.len() as u32).to_le_bytes());
        seg.extend_from_slice(&(desc as u32).to_le_bytes());
        seg.extend_from_slice(&ty.to_le_bytes());
        seg.extend_from_slice(name.as_bytes());
        seg.resize(seg.len().div_ceil(4) * 4, 0);
        seg.extend(std::iter::repeat_n(0x5a, desc));
        seg.resize(seg.len().div_ceil(4) * 4, 0);
    }
    // A second program header, after the first (e_phnum 2): the note
    // segment, placed at the end of the file.
    let ph_at = 64 + 56;
    let seg_at = b.len() + 56;
    let mut ph = vec![0u8; 56];
    ph[..4].copy_from_slice(&PT_NOTE.to_le_bytes());
    ph[8..16].copy_from_slice(&(seg_at as u64).to_le_bytes());
    ph[32..40].copy_from_slice(&(seg.len() as u64).to_le_bytes());
    b.splice(ph_at..ph_at, ph);
    b[56..58].copy_from_slice(&2u16.to_le_bytes());
    // The interpreter's path moved by one program header.
    let interp_at = u64::from_le_bytes(b[64 + 8..64 + 16].try_into().unwrap()) + 56;
    b[64 + 8..64 + 16].copy_from_slice(&interp_at.to_le_bytes());
    b.extend_from_slice(&seg);
    b
}

#[test]
fn a_go_program_is_told_by_its_build_id_note() {
    let d = Dir::new("go");
    let judge = |name: &str, bytes: &[u8]| {
        let p = d.file(name, bytes);
        let f = File::open(&p).unwrap();
        (is_go(&f), Loader::of_file(&f))
    };
    let glibc = Loader::of_interp(b"/lib64/ld-linux-x86-64.so.2");
    // Go's linker writes its note alone, its name padded ("Go\0\0");
    // with external linking the GNU build ID may come first.
    let go = elf_with_notes(&[("Go\0", NT_GO_BUILDID, 83)]);
    assert_eq!(
        judge("go", &go),
        (true, glibc),
        "the interpreter is still read"
    );
    let cgo = elf_with_notes(&[("GNU", 3, 20), ("Go", NT_GO_BUILDID, 83)]);
    assert!(judge("cgo", &cgo).0);
    // Other owners and other Go note types are not Go's build ID.
    assert!(!judge("gnu", &elf_with_notes(&[("GNU", 3, 20)])).0);
    assert!(!judge("go-type", &elf_with_notes(&[("Go", 1, 4)])).0);
    assert!(!judge("gopher", &elf_with_notes(&[("Gopher", NT_GO_BUILDID, 4)])).0);
    // A note segment cut short, no note segment, not ELF.
    let mut cut = go.clone();
    cut.truncate(cut.len() - 90);
    assert!(!judge("cut", &cut).0);
    assert!(
        !judge(
            "plain",
            &elf(true, OURS, Some("/lib64/ld-linux-x86-64.so.2"))
        )
        .0
    );
    assert!(!judge("text", b"#!/bin/sh\necho hi\n").0);
}

/// A program Go's linker made (Debian's golang-go, which
/// scripts/install-packages.sh installs): real programs, not only crafted
/// headers.
#[test]
fn a_program_go_builds_is_go_and_a_rust_program_is_not() {
    let rust = File::open(std::env::current_exe().unwrap()).unwrap();
    assert!(!is_go(&rust), "this test program (Rust) is not Go");
    let go = "/usr/bin/go";
    assert!(
        Path::new(go).exists(),
        "{go} is missing: install golang-go (scripts/install-packages.sh)"
    );
    let d = Dir::new("go-build");
    d.file("go.mod", b"module hello\ngo 1.18\n");
    d.file(
        "main.go",
        b"package main\nfunc main() { println(\"hi\") }\n",
    );
    let st = std::process::Command::new(go)
        .args(["build", "-o", "hello", "."])
        .current_dir(&d.0)
        .env("GOCACHE", d.0.join("cache"))
        .env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", "0")
        .status()
        .unwrap();
    assert!(st.success(), "go build failed");
    assert!(is_go(&File::open(d.0.join("hello")).unwrap()));
}

/// The header's reading, as the preload's exec hooks use it: whose
/// program it is, and whether it is linked dynamically.
#[test]
fn a_header_tells_whose_program_and_whether_dynamic() {
    let d = Dir::new("header");
    let judge = |name: &str, bytes: &[u8]| {
        let f = File::open(d.file(name, bytes)).unwrap();
        let h = Header::parse(bytes).expect(name);
        (h.is_ours(), h.has_interp(&f))
    };
    let glibc = Some("/lib64/ld-linux-x86-64.so.2");
    let ours = MACHINE.is_some();
    assert_eq!(judge("dyn", &elf(true, OURS, glibc)), (ours, Ok(true)));
    assert_eq!(judge("static", &elf(true, OURS, None)), (ours, Ok(false)));
    assert_eq!(
        judge("i386", &elf(false, 3, Some("/lib/ld-linux.so.2"))),
        (false, Ok(true))
    );
    assert_eq!(
        judge("other", &elf(true, OURS + 1, glibc)),
        (false, Ok(true))
    );
    let mut big = elf(true, OURS, glibc);
    big[5] = 2;
    assert!(!Header::parse(&big).unwrap().is_ours());
    // Program headers past the end, or smaller than the class's.
    let mut cut = elf(true, OURS, glibc);
    cut.truncate(64 + 20);
    assert_eq!(judge("cut", &cut).1, Err(ElfError::Unreadable));
    let mut small = elf(true, OURS, glibc);
    small[54] = 4;
    assert_eq!(judge("small", &small).1, Err(ElfError::Malformed));
    assert!(Header::parse(b"#!/bin/sh\n").is_none());
    assert!(Header::parse(&[b'x'; 64]).is_none());
}
