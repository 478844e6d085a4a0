//! `SMCLO_DEBUG=1`: one line per decision on standard error.
//!
//! Why a connection fell back to TCP must be visible to the user; this is
//! where it becomes visible.

use std::sync::atomic::{AtomicU8, Ordering};

/// [`enabled`]'s answer once known: 0 before, then 1 (off) or 2 (on).
/// Not a `OnceLock`: a signal handler whose call logs while its thread
/// was making one would wait for that thread for ever; two threads that
/// read the environment at once store the same answer.
static ON: AtomicU8 = AtomicU8::new(0);

/// Whether `SMCLO_DEBUG` is set to something other than `0` or empty.
pub fn enabled() -> bool {
    match ON.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var_os("SMCLO_DEBUG").is_some_and(|v| !v.is_empty() && v != "0");
            ON.store(1 + on as u8, Ordering::Relaxed);
            on
        }
    }
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
