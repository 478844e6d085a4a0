//! Knobs read from the environment: a malformed value is refused by
//! `Config::from_env`, naming the variable. One test: the environment is
//! the process's.

use smclo::config::Config;
use std::time::Duration;

/// `SMCLO_SPIN_US` is validated like the other knobs.
#[test]
fn malformed_knobs_are_refused() {
    for (k, bad) in [
        ("SMCLO_SPIN_US", "fast"),
        ("SMCLO_CLC_WAIT_MS", "soon"),
        ("SMCLO_RMEM", "lots"),
    ] {
        std::env::set_var(k, bad);
        let e = Config::from_env().expect_err(k).to_string();
        assert!(e.contains(k) && e.contains(bad), "{k}: {e}");
        std::env::remove_var(k);
    }
    std::env::set_var("SMCLO_SPIN_US", "7");
    let c = Config::from_env().expect("a valid SMCLO_SPIN_US");
    assert_eq!(c.spin, Duration::from_micros(7));
    std::env::remove_var("SMCLO_SPIN_US");
}
