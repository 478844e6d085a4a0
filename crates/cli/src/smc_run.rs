//! `smc_run`: smc-tools' name for `smclo run` (same options: -d, -r, -t).
#[path = "run.rs"]
mod run;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(run::main(&args));
}
