//! The count of a client's early bytes in its rendezvous slot (see
//! `handshake::early` for what they are): one word, which the client adds
//! to before it writes the bytes into its TCP stream and the server seals
//! before it decides. Generic over [`Atom`] so that
//! `crates/smclo/tests/loom_early.rs` model-checks it.
//!
//! The argument: the client adds by compare-and-swap from a word without
//! [`SEALED`], the server sets [`SEALED`] by compare-and-swap, so every
//! add that succeeds is ordered before the seal and is in the count the
//! seal returns, and no add succeeds after it. The client writes its bytes
//! only after its add succeeded, so the stream never holds a counted byte
//! beyond those, nor an uncounted one before them: the server, which
//! accepts only once the stream holds the count, moves exactly the
//! client's early bytes into its ring, and the client's later writes,
//! which wait for the decision, follow them there.

use crate::table::Atom;
use std::sync::atomic::Ordering;

/// The most bytes a client may write into its TCP stream before the
/// server answers: below the smallest ring (16 KiB), so that the server's
/// ring always takes them.
pub const EARLY_MAX: u32 = 4096;

/// Set in the word once the server took the count: no more may be added.
pub const SEALED: u64 = 1 << 63;

/// Client: adds `n` to the count; `false` once sealed, or when the total
/// would pass [`EARLY_MAX`] (the bytes then wait for the decision).
pub fn add<A: Atom>(word: &A, n: usize) -> bool {
    let mut cur = word.load(Ordering::Acquire);
    loop {
        let total = cur.saturating_add(n as u64);
        if cur & SEALED != 0 || total > u64::from(EARLY_MAX) {
            return false;
        }
        match word.compare_exchange(cur, total, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

/// Server: seals the count and returns it. The client never counts past
/// [`EARLY_MAX`]; a larger value is another process's garbage, which the
/// caller's checks (the ring's length, the bytes in the stream) refuse.
pub fn seal<A: Atom>(word: &A) -> u32 {
    let mut cur = word.load(Ordering::Acquire);
    loop {
        match word.compare_exchange(cur, cur | SEALED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return (cur & !SEALED).min(u64::from(u32::MAX)) as u32,
            Err(now) => cur = now,
        }
    }
}
