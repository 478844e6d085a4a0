//! `smclo dev`: the device listing (as smc-tools' `smcd device`) and knobs.

use smclo::device::{Device, DmbType};

const USAGE: &str = "\
usage: smclo dev [-v|--verbose]
       smclo dev set KEY=VALUE...

knobs:
  active=0|1        0: every new connection falls back to TCP (NOSMCDDEV)
  dmb_copy=0|1      1: senders copy through a private buffer (SMC-lo mode)
  dmb_type=4k|huge  pages backing new DMBs
";

/// Entry point of `smclo dev`.
pub fn main(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("set") => set(&args[1..]),
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
