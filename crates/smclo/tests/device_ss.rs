//! `smclo::ss` on DMB table entries made directly (no TCP connection): how
//! the two ends of a connection pair up while the handshake finishes.

mod common;

use common::TempDir;
use smclo::device::{Device, DmbHandle, Registration, Role};
use smclo::ss::{self, SmcEnd, SmcState};
use smclo::testing::conn::{Conn, Mode};
use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

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

/// One end of an in-process connection recorded in the device, as the
/// handshake builds it.
struct End {
    conn: Conn,
    _reg: Registration,
    local: SocketAddr,
}

/// A connected pair on `dev`, built as the handshake does (attach the
/// peer's memfd, mark connected, count into the entries).
fn pair(dev: &Arc<Device>) -> (End, End) {
    let a = dev.register_dmb(RING, Role::Client).unwrap();
    let b = dev.register_dmb(RING, Role::Server).unwrap();
    let attach = |h: &DmbHandle| {
        // SAFETY: the handle's memfd is open while `h` lives.
        let fd = unsafe { BorrowedFd::borrow_raw(h.fd()) };
        dev.attach_dmb(h.token(), File::from(fd.try_clone_to_owned().unwrap()))
            .unwrap()
    };
    let (pa, pb) = (attach(&b), attach(&a));
    let (la, lb): (SocketAddr, SocketAddr) = (
        "127.0.0.1:40001".parse().unwrap(),
        "127.0.0.1:7001".parse().unwrap(),
    );
    let (ua, ub) = UnixStream::pair().unwrap();
    let end = |h: DmbHandle, peer_dmb, chan, peer_token, local, peer| {
        let (dmb, reg) = h.into_parts();
        reg.set_connected(peer_token, local, peer, Mode::NoCopy);
        let mut conn = Conn::new(dmb, peer_dmb, chan, Mode::NoCopy).unwrap();
        conn.set_record(reg.record());
        End {
            conn,
            _reg: reg,
            local,
        }
    };
    let (ta, tb) = (a.token(), b.token());
    (end(a, pa, ua, tb, la, lb), end(b, pb, ub, ta, lb, la))
}

/// The listed end whose local address is `e`'s.
fn find(dev: &Device, e: &End) -> SmcEnd {
    ss::smc_ends(dev)
        .into_iter()
        .find(|x| x.local == e.local)
        .unwrap_or_else(|| panic!("{} not listed", e.local))
}

/// (state, sent, received, fill) of `e`.
fn row(dev: &Device, e: &End) -> (SmcState, u64, u64, Option<u64>) {
    let x = find(dev, e);
    (x.state, x.bytes_sent, x.bytes_received, x.ring_fill)
}

/// The connection counts what it moves and records its close steps: an
/// orderly close from both sides, as the kernel's states name it.
#[test]
fn conn_records_bytes_and_close_steps() {
    let t = TempDir::new("ss-steps");
    let dev = Device::open(&t.0).unwrap();
    let (a, b) = pair(&dev);
    a.conn.write(&[1; 300]).unwrap();
    b.conn.read(&mut [0; 100]).unwrap();
    assert_eq!(row(&dev, &a), (SmcState::Active, 300, 0, Some(0)));
    assert_eq!(row(&dev, &b), (SmcState::Active, 0, 100, Some(200)));
    a.conn.shutdown_write().unwrap();
    assert_eq!(row(&dev, &a).0, SmcState::PeerCloseWait1);
    assert_eq!(row(&dev, &b).0, SmcState::AppCloseWait1);
    b.conn.read(&mut [0; 200]).unwrap();
    b.conn.shutdown_write().unwrap();
    assert_eq!(row(&dev, &a).0, SmcState::PeerCloseWait2);
    assert_eq!(row(&dev, &b), (SmcState::AppCloseWait2, 0, 300, Some(0)));
    drop(b);
    assert_eq!(row(&dev, &a), (SmcState::AppFinCloseWait, 300, 0, None));
}

/// A peer that closes with bytes unread aborts the connection: once this
/// end has seen the abort (its read fails with ECONNRESET), it is CLOSED,
/// as the kernel's socket is after an abort, not waiting for the
/// application's close (APPCLOSEWAIT1).
#[test]
fn an_end_that_saw_its_peer_abort_is_closed() {
    let t = TempDir::new("ss-abort");
    let dev = Device::open(&t.0).unwrap();
    let (a, b) = pair(&dev);
    a.conn.write(&[1; 10]).unwrap();
    drop(b);
    let e = a.conn.read(&mut [0; 10]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET));
    assert_eq!(row(&dev, &a).0, SmcState::Closed);
}
