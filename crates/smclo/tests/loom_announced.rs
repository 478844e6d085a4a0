//! Model check of the announcement map (`smclo::testing::announced`) with
//! loom: clients set and clear their slots' bits in one word while a
//! server, after an announcer's SYN, reads the map.
//!
//! Run (also in CI, with the other models):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_announced
//! ```
//!
//! Properties: a server that looks after an announcer's SYN finds its bit,
//! whatever other clients of the same word do meanwhile (announce and
//! release, or take over a dead announcer's slot with a proposal that is
//! no announcement); and once every client is done, the map holds exactly
//! the bits of the announcements still proposed.
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, AtomicU64};
use loom::sync::Arc;
use smclo::testing::announced::{mark, positions};
use std::sync::atomic::Ordering;

#[test]
fn a_server_after_the_syn_finds_the_announcement() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        // Bit 2: a dead announcer's slot, still set.
        let map = Arc::new([AtomicU64::new(1 << 2), AtomicU64::new(0)]);
        let syn = Arc::new(AtomicBool::new(false));
        let announcer = {
            let (map, syn) = (map.clone(), syn.clone());
            loom::thread::spawn(move || {
                // Claimed slot 0: its bit, then the proposal, then the SYN.
                mark(&map[..], 0, true);
                syn.store(true, Ordering::Release);
            })
        };
        let others = {
            let map = map.clone();
            loom::thread::spawn(move || {
                // An announcement at slot 1 that comes and goes, and slot 2
                // taken over by a marked proposal.
                mark(&map[..], 1, true);
                mark(&map[..], 2, false);
                mark(&map[..], 1, false);
            })
        };
        // The server accepts after the SYN.
        if syn.load(Ordering::Acquire) {
            assert!(
                positions(&map[..]).any(|p| p == 0),
                "the announcement's bit is missing after its SYN"
            );
        }
        announcer.join().unwrap();
        others.join().unwrap();
        assert_eq!(positions(&map[..]).collect::<Vec<_>>(), [0]);
    });
}

/// Bits of the second word are found at their positions, and a bit
/// cleared there leaves the first word's alone.
#[test]
fn positions_span_both_words() {
    loom::model(|| {
        let map = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let t = {
            let map = map.clone();
            loom::thread::spawn(move || mark(&map[..], 127, true))
        };
        mark(&map[..], 3, true);
        mark(&map[..], 64, true);
        mark(&map[..], 64, false);
        t.join().unwrap();
        assert_eq!(positions(&map[..]).collect::<Vec<_>>(), [3, 127]);
    });
}
