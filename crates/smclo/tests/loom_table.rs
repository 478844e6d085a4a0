//! Model checks of the shared tables' protocol (`smclo::testing::table`) with loom.
//!
//! - `claim_publish_release_and_reclaim`: one entry, left published by an
//!   owner whose pid namespace is gone; a reclaimer frees it, and two live
//!   claimers race for it (each claims, fills, publishes, then releases it
//!   as its owner would).
//! - `a_new_holder_is_never_judged_by_an_earlier_identity`: an entry last
//!   held in the reclaimer's namespace is claimed by a process of another
//!   namespace while the reclaimer looks at it.
//!
//! Run (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_table
//! ```
//!
//! Properties, in every interleaving:
//! - no entry is ever held by two: the payload is a loom cell that only the
//!   holder touches, so two holders at once are a data race loom reports;
//! - a live entry is never freed: every live claimer's release of its own
//!   entry succeeds (it fails if anyone else took the entry meanwhile), and
//!   a reclaimer never takes a live holder's entry;
//! - the reclaimer judges the incarnation it read: liveness depends on pid,
//!   start time and pid namespace, so an identity read from an earlier
//!   incarnation (another namespace, or another start time, with the new
//!   holder's pid) would look dead and have the live entry freed;
//! - a dead owner's entry is always reclaimed, and a stale word changes
//!   nothing: the reclaimer's take is a CAS from the word it judged.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use smclo::testing::owner::{Owner, PidNs};
use smclo::testing::table::{Head, Holder, State, Word};

const PUBLISHED: State = State(2);
/// The reclaimer's namespace.
const NS: PidNs = PidNs(7);
/// Another namespace with live members.
const OTHER_NS: PidNs = PidNs(8);
/// A namespace with no process left.
const GONE_NS: PidNs = PidNs(9);

const fn owner(pid: u32, start: u64, pidns: PidNs) -> Owner {
    Owner { pid, start, pidns }
}

/// The owner that died, in a namespace that is gone: its entry is there
/// from the start.
const DEAD: Owner = owner(9, 900, GONE_NS);
/// Two live claimers, one in the reclaimer's namespace, one in another.
const CLAIMERS: [Owner; 2] = [owner(1, 100, NS), owner(2, 200, OTHER_NS)];
const RECLAIMER: Owner = owner(3, 300, NS);

/// The liveness oracle, as the reclaimer sees it: in its own namespace,
/// alive are exactly its live processes by pid and start time (a start
/// time of 0, WRITING, is judged by pid alone); `OTHER_NS` has members
/// (so its owners are never reclaimed); `GONE_NS` has none.
fn alive(o: &Owner) -> bool {
    match o.pidns {
        NS => [CLAIMERS[0], RECLAIMER]
            .iter()
            .any(|l| l.pid == o.pid && (o.start == 0 || o.start == l.start)),
        OTHER_NS => true,
        _ => false,
    }
}

struct Entry {
    head: Head<AtomicU64>,
    payload: UnsafeCell<u64>,
}

impl Entry {
    fn touch(&self, v: u64) {
        // SAFETY: only the entry's holder calls this; loom reports any two
        // unordered accesses, which is the property checked.
        self.payload.with_mut(|p| unsafe { *p = v });
    }
}

/// What the reclaimer does with a word it read: judge the incarnation's
/// holder, and take the entry from exactly that word if it is dead.
fn reclaim(e: &Entry, w: Word) -> bool {
    if w.is_free() {
        return false;
    }
    let dead = match e.head.holder(w) {
        None => false,
        Some(Holder::Known(o)) => !alive(&o),
        // Namespace unknown, and another namespace has members: kept.
        Some(Holder::Unrecorded(_)) => false,
    };
    if !dead {
        return false;
    }
    let Some(c) = e.head.take(w, &RECLAIMER) else {
        return false;
    };
    e.touch(0);
    e.head.free(c);
    true
}

fn claimer(e: &Entry, me: Owner) {
    for _ in 0..2 {
        if let Some(c) = e.head.claim(&me) {
            e.touch(me.pid as u64);
            let t = e.head.publish(c, PUBLISHED);
            let c = e
                .head
                .release(t, &me)
                .expect("a live owner's entry was taken by someone else");
            e.touch(0);
            e.head.free(c);
            return;
        }
        loom::thread::yield_now();
    }
}

#[test]
fn claim_publish_release_and_reclaim() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let e = Arc::new(Entry {
            head: Head::from_cells(AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)),
            payload: UnsafeCell::new(0),
        });
        // The dead owner's entry, made by the protocol before it died.
        let c = e.head.claim(&DEAD).unwrap();
        e.touch(DEAD.pid as u64);
        let _ = e.head.publish(c, PUBLISHED);
        let threads: Vec<_> = CLAIMERS
            .iter()
            .map(|&me| {
                let e = e.clone();
                loom::thread::spawn(move || claimer(&e, me))
            })
            .collect();
        // The reclaimer: the dead owner's entry is always reclaimed (no one
        // else moves an entry that is not free); a second look may find a
        // live claimer's, which must be left alone.
        assert!(reclaim(&e, e.head.word()), "the dead owner's entry stays");
        let w = e.head.word();
        reclaim(&e, w);
        for t in threads {
            t.join().unwrap();
        }
        // Whatever happened, nothing is left held.
        let w = e.head.word();
        assert!(w.is_free(), "entry left in {w:?}");
    });
}

/// An entry whose last holder was of the reclaimer's namespace is claimed
/// by a process of another namespace: until the claimer has written its
/// identity, the head holds the earlier one, which must never be taken
/// for the claimer's (its pid judged in the wrong namespace looks dead).
#[test]
fn a_new_holder_is_never_judged_by_an_earlier_identity() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let e = Arc::new(Entry {
            head: Head::from_cells(AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)),
            payload: UnsafeCell::new(0),
        });
        // A whole life of an entry in the reclaimer's namespace.
        claimer(&e, CLAIMERS[0]);
        let other = {
            let e = e.clone();
            loom::thread::spawn(move || claimer(&e, CLAIMERS[1]))
        };
        let r = {
            let e = e.clone();
            loom::thread::spawn(move || reclaim(&e, e.head.word()))
        };
        assert!(!r.join().unwrap(), "a live entry was reclaimed");
        other.join().unwrap();
        assert!(e.head.word().is_free());
    });
}
