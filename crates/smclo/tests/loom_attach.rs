//! Model check of a DMB's attach record (`smclo::testing::attach_record`)
//! with loom: a server names its DMB in its Accept, and its pool may reuse
//! the DMB (a fresh token) whenever the record allows, even before the
//! client followed the Accept (the server's connection may have ended
//! first). The client follows the Accept as the preload does: it checks
//! the token in the DMB's header against the Accept's, claims the record,
//! reads the token again while it holds the DMB, then releases it.
//!
//! In every interleaving the client finds the Accept's token, both before
//! and after its claim, and its claim succeeds; once both are done the
//! record is 0 again (the DMB is reusable: nothing leaked). A second model
//! lets the client give up before the Accept (a CAS in the slot, as its
//! timeout does): then the server takes its reservation back, and the
//! record ends 0 too.
//!
//! Run (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_attach
//! ```
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use smclo::testing::attach_record::{claim, record_from, release, reserve, reusable, unreserve};
use std::sync::atomic::Ordering::SeqCst;

/// The token of the connection the Accept names, and the one a reuse
/// gives the DMB.
const TOKEN: u64 = 7;
const RENEWED: u64 = 8;
/// The slot's decision word: undecided, or the client gave up.
const UNDECIDED: u64 = 0;
const GAVE_UP: u64 = u64::MAX;

struct Shared {
    /// The DMB header's attach record and token words.
    record: AtomicU64,
    token: AtomicU64,
    /// The slot: the Accept's token once the server accepted.
    slot: AtomicU64,
}

/// The server: reserves, accepts (unless the client gave up first, then
/// takes the reservation back), and its connection ends at once: its pool
/// reuses the DMB if the record lets it.
fn server(s: &Shared) {
    assert!(reserve(&s.record), "a fresh DMB's record is 0");
    if s.slot
        .compare_exchange(UNDECIDED, TOKEN, SeqCst, SeqCst)
        .is_err()
    {
        unreserve(&s.record);
    }
    if reusable(&s.record) {
        s.token.store(RENEWED, SeqCst);
    }
}

/// The client following an Accept for `token`.
fn follow(s: &Shared, token: u64) {
    assert_eq!(s.token.load(SeqCst), token, "the Accept's DMB was reused");
    let rec = record_from(12345);
    assert!(claim(&s.record, rec), "another attacher holds the DMB");
    assert_eq!(s.token.load(SeqCst), token, "reused while attached");
    release(&s.record, rec);
}

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        record: AtomicU64::new(0),
        token: AtomicU64::new(TOKEN),
        slot: AtomicU64::new(UNDECIDED),
    })
}

#[test]
fn a_client_that_follows_late_finds_the_accepts_dmb() {
    loom::model(|| {
        let s = shared();
        let srv = {
            let s = s.clone();
            loom::thread::spawn(move || server(&s))
        };
        follow_when_accepted(&s);
        srv.join().unwrap();
        assert!(reusable(&s.record), "the record did not end 0");
    });
}

/// The client waits for the server's Accept, then follows it.
fn follow_when_accepted(s: &Shared) {
    loop {
        match s.slot.load(SeqCst) {
            UNDECIDED => loom::thread::yield_now(),
            token => return follow(s, token),
        }
    }
}

#[test]
fn a_client_that_gave_up_leaves_no_reservation() {
    loom::model(|| {
        let s = shared();
        let srv = {
            let s = s.clone();
            loom::thread::spawn(move || server(&s))
        };
        if s.slot
            .compare_exchange(UNDECIDED, GAVE_UP, SeqCst, SeqCst)
            .is_err()
        {
            // Accepted first: the client follows.
            follow_when_accepted(&s);
        }
        srv.join().unwrap();
        assert!(reusable(&s.record), "the record did not end 0");
    });
}
