//! A TCP connection that ended on a port keeps its orderly close when the
//! program binds a UDP socket to that port number: only a TCP `bind` to
//! the port aborts the ended connections' TCP sockets bound to it
//! (`smclo::adapter::deferred::close_deferred_freeing`), which a UDP port
//! of the same number does not conflict with. `tests/c/deferred_bind.c`;
//! the device's counters prove the connection was SMC-D.

mod common;
use common::{compile, run_smc};

#[test]
fn a_udp_bind_to_a_listeners_port_does_not_abort_its_ended_connections() {
    let exe = compile("deferred_bind", &[]);
    run_smc(&exe, &["udp"], None, None);
    let _ = std::fs::remove_file(&exe);
}
