//! The attach record of a DMB ([`smclo_wire::dmb_header::ATTACH_OFFSET`]):
//! the one word that tells its owner whether a peer may still use it, and
//! so whether the owner's pool may hand it to another connection (with a
//! fresh token). Generic over [`Atom`] so that
//! `crates/smclo/tests/loom_attach.rs` model-checks it.
//!
//! The argument:
//! - An attacher writes its own record (never 0 nor [`RESERVED`]) by
//!   compare-and-swap, from [`RESERVED`] or from 0, and clears it by
//!   compare-and-swap from its own record: two attachers never hold a DMB
//!   at once, and nobody clears another's record.
//! - The owner reuses a DMB only while the word is 0 ([`reusable`]).
//! - An owner that names its DMB to a peer before that peer attached (a
//!   server's DMB in its Accept: the client attaches it at its next call,
//!   which may come after the server's connection ended) first
//!   [`reserve`]s it, from 0, and only then publishes the token. The word
//!   is then never 0 until the peer has attached and detached: either the
//!   reservation is still there or the peer's record replaced it. So the
//!   peer that follows the Accept finds the token it was told, however
//!   late it comes. An owner whose Accept did not go out (the client gave
//!   up first) [`unreserve`]s, from [`RESERVED`] only.
//! - A peer that never comes (it aborted, or died) leaves the reservation:
//!   the DMB is not reused, and is unmapped by the pool's bounds as a
//!   dead attacher's is.

use crate::table::Atom;
use smclo_wire::dmb_header::ATTACH_RESERVED;
use std::sync::atomic::Ordering::SeqCst;

/// The record of a DMB named to a peer that has not attached it yet.
pub const RESERVED: u64 = ATTACH_RESERVED;

/// An attacher's record from a random value: never 0 (free) nor
/// [`RESERVED`].
pub fn record_from(random: u64) -> u64 {
    match random {
        0 | RESERVED => 1,
        r => r,
    }
}

/// Owner: reserves its DMB for the peer it is about to name it to.
/// `false` if the word was not 0 (a peer already holds it).
pub fn reserve<A: Atom>(word: &A) -> bool {
    word.compare_exchange(0, RESERVED, SeqCst, SeqCst).is_ok()
}

/// Owner: takes back a reservation that no peer will claim.
pub fn unreserve<A: Atom>(word: &A) {
    let _ = word.compare_exchange(RESERVED, 0, SeqCst, SeqCst);
}

/// Attacher: writes its record `rec` ([`record_from`]) over the owner's
/// reservation or over 0; `false` if another attacher holds the DMB.
pub fn claim<A: Atom>(word: &A, rec: u64) -> bool {
    word.compare_exchange(RESERVED, rec, SeqCst, SeqCst).is_ok()
        || word.compare_exchange(0, rec, SeqCst, SeqCst).is_ok()
}

/// Attacher: clears its own record `rec` (another's stays).
pub fn release<A: Atom>(word: &A, rec: u64) {
    let _ = word.compare_exchange(rec, 0, SeqCst, SeqCst);
}

/// Owner: whether no peer holds the DMB nor may still come for it.
pub fn reusable<A: Atom>(word: &A) -> bool {
    word.load(SeqCst) == 0
}
