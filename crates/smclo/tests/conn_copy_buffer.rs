//! A copy-mode connection's private send buffer costs what its writes
//! need, not its full size at every connection set-up. Alone in its test
//! binary: it reads the process's heap counters.

mod conn_util;

use conn_util::{pair_with, RING};
use smclo::testing::conn::{Mode, RecvFlags, SendFlags};

/// Bytes the allocator has handed out (heap and mmapped chunks).
#[cfg(target_env = "gnu")]
fn allocated() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let m = unsafe { libc::mallinfo2() };
    m.uordblks + m.hblkhd
}

#[cfg(target_env = "gnu")]
#[test]
fn a_copy_mode_connection_allocates_what_its_writes_need() {
    const SNDBUF: u32 = 16 << 20;
    let copy = Mode::Copy { sndbuf_len: SNDBUF };
    let before = allocated();
    let p = pair_with(RING, RING, copy, copy);
    let mut buf = [0u8; 64];
    for i in 0..100u8 {
        let msg = [i; 64];
        assert_eq!(p.a.send(&msg, SendFlags::EMPTY).unwrap(), 64);
        assert_eq!(p.b.recv(&mut buf, RecvFlags::EMPTY).unwrap(), 64);
        assert_eq!(buf, msg);
        assert_eq!(p.b.send(&msg[..1], SendFlags::EMPTY).unwrap(), 1);
        assert_eq!(p.a.recv(&mut buf, RecvFlags::EMPTY).unwrap(), 1);
        assert_eq!(buf[0], i);
    }
    let grown = allocated().saturating_sub(before);
    assert!(
        grown < 1 << 20,
        "a pair of copy-mode connections moving 64-byte messages holds {grown} bytes (send buffers of {SNDBUF} each)"
    );
    drop(p);
}
