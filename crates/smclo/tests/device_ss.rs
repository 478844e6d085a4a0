//! `smclo::ss` on DMB table entries made directly (no TCP connection): how
//! the two ends of a connection pair up while the handshake finishes.

mod common;

use common::TempDir;
use smclo::conn::Mode;
use smclo::device::{Device, Role};
use smclo::ss::{self, SmcState};
use std::net::SocketAddr;

const RING: u32 = 16 * 1024;

/// The server end is connected before the client's (it sends its DMB,
/// then the client marks its own entry connected): meanwhile the server's
/// peer is there, not closed.
#[test]
fn an_end_whose_peer_is_not_connected_yet_is_active() {
    let t = TempDir::new("ss-pairing");
    let dev = Device::open(&t.0).unwrap();
    let client = dev.register_dmb(RING, Role::Client).unwrap();
    let server = dev.register_dmb(RING, Role::Server).unwrap();
    let (c_addr, s_addr): (SocketAddr, SocketAddr) = (
        "127.0.0.1:40000".parse().unwrap(),
        "127.0.0.1:7000".parse().unwrap(),
    );
    server.set_connected(client.token(), s_addr, c_addr, Mode::NoCopy);
    let ends = ss::smc_ends(&dev);
    assert_eq!(ends.len(), 1, "only the connected end is listed: {ends:?}");
    assert_eq!(
        (ends[0].state, ends[0].ring_fill),
        (SmcState::Active, Some(0))
    );
    client.set_connected(server.token(), c_addr, s_addr, Mode::NoCopy);
    let ends = ss::smc_ends(&dev);
    assert_eq!(ends.len(), 2);
    assert!(ends.iter().all(|e| e.state == SmcState::Active), "{ends:?}");
}
