//! `smclo bench` (being written).

/// Entry point of `smclo bench`.
pub fn main(_args: &[String]) -> i32 {
    eprintln!("smclo bench: not built yet");
    2
}
