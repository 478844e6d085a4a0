//! Knobs read from the environment: a malformed value is refused by
//! `Config::from_env`, naming the variable. One test: the environment is
//! the process's.

use smclo::config::Config;
use std::time::Duration;

/// `SMCLO_SPIN_US` and `SMCLO_ANNOUNCE` are validated like the other
/// knobs; `SMCLO_ANNOUNCE`'s networks cover what they say.
#[test]
fn malformed_knobs_are_refused() {
    for (k, bad) in [
        ("SMCLO_SPIN_US", "fast"),
        ("SMCLO_CLC_WAIT_MS", "soon"),
        ("SMCLO_RMEM", "lots"),
        ("SMCLO_ANNOUNCE", "10.96.0.0/33"),
        ("SMCLO_ANNOUNCE", "10.96.0.0/12,cluster"),
        ("SMCLO_ANNOUNCE", "no"),
        ("SMCLO_SHORT", "never"),
        ("SMCLO_IO_URING", "sockets"),
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
    std::env::set_var("SMCLO_ANNOUNCE", "10.96.0.0/12, fd00::/108,192.0.2.7");
    let a = Config::from_env().expect("a valid SMCLO_ANNOUNCE").announce;
    for (ip, covered) in [
        ("10.96.0.1", true),
        ("10.111.255.255", true),
        ("10.112.0.0", false),
        ("::ffff:10.100.0.1", true),
        ("fd00::1:2", true),
        ("fd00::1:0:0", false),
        ("192.0.2.7", true),
        ("192.0.2.8", false),
    ] {
        assert_eq!(a.covers(ip.parse().unwrap()), covered, "{ip} in {a:?}");
    }
    std::env::set_var("SMCLO_ANNOUNCE", "off");
    let off = Config::from_env().expect("SMCLO_ANNOUNCE=off").announce;
    assert!(!off.covers("10.96.0.1".parse().unwrap()));
    std::env::remove_var("SMCLO_ANNOUNCE");
    let all = Config::from_env().expect("no SMCLO_ANNOUNCE").announce;
    assert!(all.covers("203.0.113.1".parse().unwrap()));
    use smclo::config::Short;
    assert_eq!(
        Config::from_env().expect("no SMCLO_SHORT").short,
        Short::Learn
    );
    std::env::set_var("SMCLO_SHORT", "smc");
    assert_eq!(
        Config::from_env().expect("SMCLO_SHORT=smc").short,
        Short::Smc
    );
    std::env::remove_var("SMCLO_SHORT");
}
