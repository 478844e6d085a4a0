//! `SMCLO_DEBUG=1`: one line per decision on standard error.
//!
//! Why a connection fell back to TCP must be visible to the user; this is
//! where it becomes visible.

use std::sync::OnceLock;

/// Whether `SMCLO_DEBUG` is set to something other than `0` or empty.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SMCLO_DEBUG").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Writes `smclo[pid]: <message>` to standard error when debugging is on.
pub fn log(args: std::fmt::Arguments<'_>) {
    if enabled() {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "smclo[{}]: {}", std::process::id(), args);
    }
}

/// `debug!("...", args)`: formats only when `SMCLO_DEBUG` is on.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::debug::enabled() {
            $crate::debug::log(format_args!($($arg)*));
        }
    };
}
