//! Model check of the spinner slots (`smclo::testing::spin`) with loom:
//! threads take and give back slots of one table with compare-and-swaps,
//! each slot holding the time until which its holder may spin.
//!
//! Run (also in CI, with the other models):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_spin
//! ```
//!
//! Properties: no more threads hold slots at once than the slots they may
//! take (the CPUs they may run on); a holder whose time is over, giving
//! its slot back late (it was descheduled, or it gives way), never frees
//! or marks the slot of the one that took it after it; a dead holder's
//! slot is taken again once its time is over.
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use smclo::testing::spin::{claim, Slots};
use std::sync::atomic::Ordering;

/// Three threads on two slots, each taking one (or finding none) and
/// giving it back: never three holders, and every slot free at the end.
#[test]
fn no_more_spinners_than_slots() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let t = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let holders = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..3)
            .map(|first| {
                let (t, holders) = (t.clone(), holders.clone());
                loom::thread::spawn(move || {
                    if let Some(c) = claim(&t[..], Slots(0b11), first % 2, 10, 20) {
                        let n = holders.fetch_add(1, Ordering::SeqCst) + 1;
                        assert!(n <= 2, "{n} spinners on two CPUs");
                        holders.fetch_sub(1, Ordering::SeqCst);
                        drop(c);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        assert!(t.iter().all(|w| w.load(Ordering::SeqCst) == 0));
    });
}

/// A holder whose time (20) is over gives its slot back, or gives way,
/// while another takes it at 25: the new holder keeps it, whatever the
/// order; the late holder's mark lands only on a slot no one took; and a
/// slot given back while another tries to take it is taken (the failed
/// swap looks again).
#[test]
fn a_late_holder_never_frees_its_successor() {
    for give_way in [false, true] {
        loom::model(move || {
            let t = Arc::new([AtomicU64::new(0)]);
            let old = claim(&t[..], Slots(1), 0, 10, 20).unwrap();
            let t2 = t.clone();
            let new = loom::thread::spawn(move || {
                claim(&t2[..], Slots(1), 0, 25, 40).map(|c| {
                    let held = t2[0].load(Ordering::SeqCst);
                    std::mem::forget(c);
                    held
                })
            });
            if give_way {
                old.give_way(30);
            } else {
                drop(old);
            }
            match new.join().unwrap() {
                Some(held) => {
                    assert_eq!(held, 40);
                    assert_eq!(t[0].load(Ordering::SeqCst), 40, "successor's slot lost");
                }
                None => {
                    // It came after the give-way mark (30 > 25).
                    assert!(give_way);
                    assert_eq!(t[0].load(Ordering::SeqCst), 30);
                }
            }
        });
    }
}

/// A holder that died (its claim is never given back) blocks the slot
/// until its time and no longer: one thread tries before it, one after.
#[test]
fn a_dead_holders_slot_is_taken_after_its_time() {
    loom::model(|| {
        let t = Arc::new([AtomicU64::new(0)]);
        std::mem::forget(claim(&t[..], Slots(1), 0, 10, 20).unwrap());
        let early = {
            let t = t.clone();
            loom::thread::spawn(move || claim(&t[..], Slots(1), 0, 15, 30).map(std::mem::forget))
        };
        let late = {
            let t = t.clone();
            loom::thread::spawn(move || claim(&t[..], Slots(1), 0, 20, 35).map(std::mem::forget))
        };
        assert!(
            early.join().unwrap().is_none(),
            "taken within the dead's time"
        );
        assert!(late.join().unwrap().is_some(), "stuck past the dead's time");
        assert_eq!(t[0].load(Ordering::SeqCst), 35);
    });
}
