//! A DMB reused from the per-process pool still holds the bytes its last
//! peer wrote. On a private device every peer is our own uid; on a group
//! device the next peer may be another user, so the ring is emptied before
//! the DMB is registered again.

mod common;
use common::TempDir;
use smclo::device::{Device, Role};
use smclo::testing::access::{create_group_dir, Shape};
use std::fs::File;
use std::os::fd::{BorrowedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

const RING: u32 = 16 * 1024;
/// Where the ring starts in a DMB's memfd (after the header page).
const RING_OFF: u64 = 4096;
const SECRET: &[u8] = b"what the last peer sent";

fn dup(fd: RawFd) -> File {
    // SAFETY: `fd` is open for the duration of the call (the caller holds it).
    File::from(
        unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .unwrap(),
    )
}

/// Registers a DMB, writes into its ring as a peer would, drops it (to the
/// pool) and registers again: returns whether the pool gave the same memfd
/// back, and what its ring then holds where the bytes were.
fn reuse(dir: &Path) -> (bool, Vec<u8>) {
    let dev = Device::open(dir).unwrap();
    let first = dev.register_dmb(RING, Role::Server).unwrap();
    let f = dup(first.fd());
    f.write_all_at(SECRET, RING_OFF).unwrap();
    let ino = f.metadata().unwrap().ino();
    drop(first);
    let again = dev.register_dmb(RING, Role::Server).unwrap();
    let g = dup(again.fd());
    let mut seen = vec![0u8; SECRET.len()];
    g.read_exact_at(&mut seen, RING_OFF).unwrap();
    (g.metadata().unwrap().ino() == ino, seen)
}

#[test]
fn a_pooled_ring_is_emptied_only_on_a_group_device() {
    let private = TempDir::new("pool-private");
    let (same, seen) = reuse(&private.0);
    assert!(same, "the pool did not reuse the DMB");
    assert_eq!(seen, SECRET, "a private device keeps the ring as it was");

    let group = TempDir::new("pool-group");
    // SAFETY: getegid has no preconditions.
    let gid = unsafe { libc::getegid() };
    assert!(matches!(
        create_group_dir(&group.0, gid).unwrap(),
        Shape::Group { .. }
    ));
    let (same, seen) = reuse(&group.0);
    assert!(same, "the pool did not reuse the DMB");
    assert_eq!(seen, vec![0u8; SECRET.len()], "the last peer's bytes");
}
