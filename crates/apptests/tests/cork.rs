//! TCP_CORK and MSG_MORE on SMC-D connections (python under `smclo run`):
//! corked bytes are held until uncorked, a last MSG_MORE write still
//! arrives after TCP's ceiling, and a corked stream larger than the ring is
//! delivered byte-exact at the end of stream.

use smclo_apptests::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn cork_and_msg_more() {
    let mut env = Env::new("cork");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/cork_check.py");
    let port = free_port();
    let s0 = env.stats();
    let p = env.run(
        Mode::Smclo,
        "cork",
        "python3",
        &[script.to_str().unwrap(), &port.to_string()],
        Duration::from_secs(60),
    );
    let [bytes, waited_ms] = ok_numbers(&p, "")[..] else {
        panic!("cork_check.py printed no byte count and wait")
    };
    // Held for TCP's ceiling (200 ms), not published at once.
    assert!(
        waited_ms >= 150,
        "a MSG_MORE write arrived after {waited_ms} ms"
    );
    let d = delta(&s0, &env.stats());
    assert_smc("cork", &d, 1, bytes, bytes, &p.logs());
}
