//! The `smclo` command: a small dispatcher over one module per command.
//!
//! Every command module has `pub fn main(args: &[String]) -> i32`, where
//! `args` are the arguments after the command name; the return value is the
//! exit status (0 ok, 1 runtime failure, 2 usage error).

mod bench;
mod dev;
mod exporter;
mod kernel_smc;
mod metrics;
mod run;
mod ss;
mod stats;

use smclo::device::Device;
use std::sync::Arc;

const USAGE: &str = "\
usage: smclo <command> [arguments]

commands:
  dev [-v]                      list the loopback-ism device (like `smcd device`)
  dev set KEY=VALUE...          set knobs: active=0|1 dmb_copy=0|1 dmb_type=4k|huge
  dev init --group GROUP [DIR]  make DIR (default /run/smclo) a device shared by GROUP
  stats [-a] [--json]           connections, DMBs, bytes moved, fallbacks by reason
  stats --prometheus            the same as Prometheus text (--openmetrics: OpenMetrics)
  stats reset                   zero the counters
  exporter [--listen ADDR:PORT] [--device DIR]...
                                serve the counters at http://ADDR:PORT/metrics
                                (default 127.0.0.1:9468)
  ss [-a] [--json]              SMC-D connections (-a: and open fallbacks), like smcss
  ss -l [--json]                the listeners registered on the device
  bench [...]                   built-in benchmarks (smclo bench --help)
  run [-d] [-r SIZE] [-t SIZE] [--] PROGRAM [ARGS]
                                run PROGRAM with SMC-D acceleration (alias: smc_run)
  help                          this text

environment:
  SMCLO_DEVICE_DIR              device directory (default /run/smclo when it is a
                                group device of ours, else $XDG_RUNTIME_DIR/smclo,
                                else /run/user/<uid>/smclo, else /dev/shm/smclo-<uid>)
";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    std::process::exit(run(&args));
}

fn run(args: &[String]) -> i32 {
    // Called as `smc_run` (smc-tools' name): the whole command line is run's.
    if args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "smc_run")
    {
        return run::main(args.get(1..).unwrap_or(&[]));
    }
    let rest = args.get(2..).unwrap_or(&[]);
    match args.get(1).map(String::as_str) {
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            0
        }
        Some("dev" | "device" | "d") => dev::main(rest),
        Some("stats" | "s") => stats::main(rest),
        Some("ss") => ss::main(rest),
        Some("exporter") => exporter::main(rest),
        Some("bench") => bench::main(rest),
        Some("run") => run::main(rest),
        Some(other) => {
            eprintln!("smclo: unknown command {other:?}\n");
            eprint!("{USAGE}");
            2
        }
        None => {
            eprint!("{USAGE}");
            2
        }
    }
}

/// Opens the device of `SMCLO_DEVICE_DIR` (creating it if needed), or prints
/// why not and returns the exit status to use.
pub(crate) fn open_device() -> Result<Arc<Device>, i32> {
    Device::open_default().map_err(|e| {
        eprintln!("smclo: {e}");
        1
    })
}
