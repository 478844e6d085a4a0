//! The per-process DMB pool is bounded by bytes (`SMCLO_POOL_BYTES`) and
//! trimmed when idle (`SMCLO_POOL_IDLE_MS`). The pool is per process and its
//! limits are read once, so this file (its own test process) has one test,
//! which sets both before anything touches the pool.

mod common;
use common::TempDir;
use smclo::device::{Device, Role};
use std::fs::File;
use std::os::fd::{BorrowedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

/// `SMCLO_POOL_BYTES` for this process.
const BOUND: u64 = 4 << 20;
/// `SMCLO_POOL_IDLE_MS` for this process.
const IDLE: Duration = Duration::from_millis(1500);
/// Largest ring: a DMB of it holds a header page and the ring.
const BIG: u32 = 1 << 20;
const DMB_BYTES: u64 = 4096 + BIG as u64;

/// Sets the limits before the first pool operation of the process.
fn setup() {
    std::env::set_var("SMCLO_POOL_BYTES", BOUND.to_string());
    std::env::set_var("SMCLO_POOL_IDLE_MS", IDLE.as_millis().to_string());
}

fn dup(fd: RawFd) -> File {
    // SAFETY: `fd` is open for the duration of the call (the caller holds it).
    File::from(
        unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .unwrap(),
    )
}

fn held_total() -> usize {
    let (free, pending, peers) = smclo::testing::pool::held();
    free + pending + peers
}

/// Six connections' worth of 1 MiB DMBs (ours and our mappings of the
/// peers'), open at once and then closed: the pool keeps at most
/// `SMCLO_POOL_BYTES` of them, and still reuses them. Then, unused for
/// `SMCLO_POOL_IDLE_MS`, they are unmapped at the next pool operation.
#[test]
fn pool_is_bounded_by_bytes_and_trimmed_when_idle() {
    setup();
    let t = TempDir::new("pool");
    let dev = Device::open(&t.0).unwrap();
    let own: Vec<_> = (0..6)
        .map(|_| dev.register_dmb(BIG, Role::Client).unwrap())
        .collect();
    let peers: Vec<_> = own
        .iter()
        .map(|d| dev.attach_dmb(d.token(), dup(d.fd())).unwrap())
        .collect();
    let inos: Vec<_> = own
        .iter()
        .map(|d| dup(d.fd()).metadata().unwrap().ino())
        .collect();
    // Closing: idle peer mappings, then free DMBs, for the pool.
    drop(peers);
    drop(own);
    let bytes = held_total() as u64 * DMB_BYTES;
    assert!(
        bytes <= BOUND,
        "the pool holds {bytes} bytes ({:?}), more than {BOUND}",
        smclo::testing::pool::held()
    );
    assert!(
        smclo::testing::pool::held().0 >= 1,
        "a free DMB stays for reuse"
    );
    let again = dev.register_dmb(BIG, Role::Server).unwrap();
    let ino = dup(again.fd()).metadata().unwrap().ino();
    assert!(
        inos.contains(&ino),
        "the next registration reuses a kept DMB"
    );
    drop(again);

    std::thread::sleep(IDLE + Duration::from_millis(300));
    // One pool operation: a registration (of another size) and its drop.
    drop(dev.register_dmb(16 * 1024, Role::Client).unwrap());
    assert_eq!(
        smclo::testing::pool::held(),
        (1, 0, 0),
        "only the DMB just dropped is left"
    );
}
