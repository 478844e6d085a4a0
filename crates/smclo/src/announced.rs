//! The announcement map: which slots of the announcements' window hold an
//! announcement (`crate::rendezvous`), so that a server whose client
//! did not mark its SYN (a plain client, or one whose destination was
//! translated) reads two words instead of the window's slots, each on a
//! page of its own. Generic over [`Atom`] so that
//! `crates/smclo/tests/loom_announced.rs` model-checks it.
//!
//! The argument: bit `p` is written only by the client that owns the slot
//! at window position `p` (it claimed it and has not freed it): set to
//! whether its proposal is an announcement after its claim and before it
//! publishes the proposal (so before its SYN), cleared before it frees
//! the slot. Every write is a compare-and-swap of the one word, so no
//! client's write loses another's bit. A server looks after it accepted
//! the connection, which follows the client's SYN, which follows the set:
//! it finds the bit of every announcement whose SYN it is answering.
//! A client that dies leaves its bit set until the slot's next owner
//! writes it; a bit set without an announcement only costs a look at
//! that slot.

use crate::table::Atom;
use std::sync::atomic::Ordering;

/// Sets bit `pos` of the map `words` to `on`.
pub fn mark<A: Atom>(words: &[A], pos: usize, on: bool) {
    let word = &words[pos / 64];
    let bit = 1u64 << (pos % 64);
    let mut cur = word.load(Ordering::Acquire);
    loop {
        let new = if on { cur | bit } else { cur & !bit };
        if new == cur {
            return;
        }
        match word.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

/// The positions whose bit is set, in order.
pub fn positions<A: Atom>(words: &[A]) -> impl Iterator<Item = usize> + '_ {
    words.iter().enumerate().flat_map(|(i, w)| {
        let mut bits = w.load(Ordering::Acquire);
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let b = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(i * 64 + b)
        })
    })
}
