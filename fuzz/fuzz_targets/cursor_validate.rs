//! CDC cursor words are written by the peer into shared memory: validation
//! must not panic, and a word it accepts must satisfy the documented
//! invariants (count < ring_len, known flags only, at most two doorbells,
//! producer 0..=ring_len bytes ahead of the consumer).
#![no_main]

use libfuzzer_sys::fuzz_target;
use smclo_wire::cursor::*;

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let prod = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let cons = u64::from_le_bytes(data[8..16].try_into().unwrap());
    // `distance` wants a power of two; small rings reach the edges sooner.
    let ring_len = 1u32 << (data[16] % 21);
    // Any ring length for the single-word checks, which have no such
    // precondition.
    let any_len = data
        .get(17..21)
        .map_or(ring_len, |b| u32::from_le_bytes(b.try_into().unwrap()));

    assert_eq!(Cursor::from_word(prod).to_word(), prod);

    for len in [ring_len, any_len] {
        if validate_prod(prod, len).is_ok() {
            let c = Cursor::from_word(prod);
            assert!(c.count < len);
            assert_eq!(c.prod_flags & !PROD_FLAGS_KNOWN, 0);
            assert_eq!(c.conn_state_flags & !CONN_STATE_KNOWN, 0);
            assert!(c.bells() <= MAX_BELLS);
        }
        if validate_cons(cons, len).is_ok() {
            assert!(Cursor::from_word(cons).count < len);
        }
    }

    if let Ok(d) = distance(prod, cons, ring_len) {
        assert!(d <= ring_len);
        assert!(validate_prod(prod, ring_len).is_ok());
        assert!(validate_cons(cons, ring_len).is_ok());
        // Advancing the consumer by the distance reaches the producer.
        assert!(same_position(advance(cons, d, ring_len), prod));
    }
});
