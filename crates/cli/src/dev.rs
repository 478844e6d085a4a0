//! `smclo dev`: the device listing (as smc-tools' `smcd device`) and knobs.

use smclo::device::{Device, DmbType};

const USAGE: &str = "\
usage: smclo dev [-v|--verbose]
       smclo dev set KEY=VALUE...
       smclo dev init --group GROUP [DIR]

init: makes DIR (default /run/smclo, which `smclo run` finds by itself) a
  device shared by the members of GROUP (a name or a number): owned by the
  caller and GROUP, mode 2770, its files 0660; members use it with
  SMCLO_DEVICE_DIR=DIR. An existing DIR must already have that shape.

knobs:
  active=0|1        0: every new connection falls back to TCP (NOSMCDDEV)
  dmb_copy=0|1      1: senders copy through a private buffer (SMC-lo mode)
  dmb_type=4k|huge  pages backing new DMBs
";

/// Entry point of `smclo dev`.
pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("set") => set(&args[1..]),
        Some("init") => init(&args[1..]),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            0
        }
        None => show(false),
        Some("-v" | "--verbose") if args.len() == 1 => show(true),
        Some(_) => {
            eprintln!("smclo dev: unexpected argument {:?}\n", args.join(" "));
            eprint!("{USAGE}");
            2
        }
    }
}

fn show(verbose: bool) -> i32 {
    let dev = match crate::open_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    let s = dev.stats();
    let in_use = if s.dmbs_cnt > 0 || s.conns_active > 0 {
        "Yes"
    } else {
        "No"
    };
    // Columns as `smcd d`; loopback-ism is not a PCI device, so its PCI-ID
    // column carries its name (as in the loopback-ism RFC's listing).
    println!(
        "{:<4} {:<5} {:<13} {:<6} {:<6} {:>4}  PNET-ID",
        "FID", "Type", "PCI-ID", "PCHID", "InUse", "#LGs"
    );
    println!(
        "{:<4} {:<5} {:<13} {:<6} {:<6} {:>4}  ",
        "0000", "ISM", "loopback-ism", "ffff", in_use, s.conns_active
    );
    if verbose {
        println!();
        println!("GID       {:016x}", dev.gid());
        println!("CHID      {:04x}", dev.chid());
        println!(
            "SEID      {}",
            String::from_utf8_lossy(&dev.seid()).trim_end()
        );
        println!("directory {}", dev.dir().display());
        println!("users     {}", dev.shape());
        print_knobs(&dev);
    }
    0
}

fn print_knobs(dev: &Device) {
    println!("active    {}", dev.active() as u8);
    println!("dmb_copy  {}", dev.dmb_copy() as u8);
    println!("dmb_type  {}", dmb_type_name(dev.dmb_type()));
}

fn dmb_type_name(t: DmbType) -> &'static str {
    match t {
        DmbType::Pages4k => "4k",
        DmbType::Huge => "huge",
    }
}

enum Knob {
    Active(bool),
    DmbCopy(bool),
    DmbType(DmbType),
}

fn parse_knob(arg: &str) -> Result<Knob, String> {
    let (k, v) = arg
        .split_once('=')
        .ok_or_else(|| format!("{arg:?} is not KEY=VALUE"))?;
    let bool01 = |v: &str| match v {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("{k}={v:?}: the value must be 0 or 1")),
    };
    match k {
        "active" => Ok(Knob::Active(bool01(v)?)),
        "dmb_copy" => Ok(Knob::DmbCopy(bool01(v)?)),
        "dmb_type" => match v {
            "4k" | "0" => Ok(Knob::DmbType(DmbType::Pages4k)),
            "huge" | "1" => Ok(Knob::DmbType(DmbType::Huge)),
            _ => Err(format!("dmb_type={v:?}: the value must be 4k or huge")),
        },
        _ => Err(format!(
            "unknown knob {k:?} (known: active, dmb_copy, dmb_type)"
        )),
    }
}

fn set(args: &[String]) -> i32 {
    if args.is_empty() {
        eprintln!("smclo dev set: nothing to set\n");
        eprint!("{USAGE}");
        return 2;
    }
    // Validate everything before changing anything.
    let knobs: Result<Vec<Knob>, String> = args.iter().map(|a| parse_knob(a)).collect();
    let knobs = match knobs {
        Ok(k) => k,
        Err(m) => {
            eprintln!("smclo dev set: {m}");
            return 2;
        }
    };
    let dev = match crate::open_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    for k in knobs {
        match k {
            Knob::Active(b) => dev.set_active(b),
            Knob::DmbCopy(b) => dev.set_dmb_copy(b),
            Knob::DmbType(t) => dev.set_dmb_type(t),
        }
    }
    print_knobs(&dev);
    0
}

fn init(args: &[String]) -> i32 {
    let (group, dir) = match args {
        [g, name, rest @ ..] if g == "--group" && rest.len() <= 1 => (
            name.as_str(),
            rest.first()
                .map_or(smclo::config::SYSTEM_DEVICE_DIR, String::as_str),
        ),
        _ => {
            eprintln!("smclo dev init: expected --group GROUP [DIR]\n");
            eprint!("{USAGE}");
            return 2;
        }
    };
    let Some(gid) = group_id(group) else {
        eprintln!("smclo dev init: no group {group:?}");
        return 1;
    };
    let dir = std::path::Path::new(dir);
    let made = smclo::device::create_group_dir(dir, gid).and_then(|_| Device::open(dir));
    match made {
        Ok(dev) => {
            println!(
                "group device {} (group {group}, gid {gid}), GID {:016x}: members use it with SMCLO_DEVICE_DIR={}",
                dir.display(),
                dev.gid(),
                dir.display()
            );
            0
        }
        Err(e) => {
            eprintln!("smclo dev init: {e}");
            1
        }
    }
}

/// The gid of group `name` (or of the number `name`), from the group
/// database.
fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    let cname = std::ffi::CString::new(name).ok()?;
    let mut grp: libc::group = empty_group();
    let mut buf = vec![0 as libc::c_char; 16384];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is to live memory of the stated size; the
    // result points into `grp` (or is null) and is only tested for null.
    let r = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut out,
        )
    };
    (r == 0 && !out.is_null()).then_some(grp.gr_gid)
}

fn empty_group() -> libc::group {
    // SAFETY: all-zero bytes are a valid `struct group` (null pointers,
    // gid 0), which getgrnam_r overwrites.
    unsafe { std::mem::zeroed() }
}
