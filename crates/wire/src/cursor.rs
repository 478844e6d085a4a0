//! CDC cursor words: SMC's `{count, wrap, prod_flags, conn_state_flags}`
//! cursor packed into one 64-bit word, so that the producer cursor, the
//! writer's flags and the doorbell count change together in one atomic
//! compare-and-swap.
//!
//! | bits | field |
//! | --- | --- |
//! | 0..32 | `count`: offset in the ring, `< ring_len` |
//! | 32..48 | `wrap`: how many times the ring wrapped, modulo 2^16 |
//! | 48..56 | `prod_flags` |
//! | 56..64 | `conn_state_flags` |
//!
//! The byte position of a cursor is `wrap * ring_len + count`, modulo
//! `2^16 * ring_len`; distances are computed in that modulus.
//!
//! Two words live in a DMB header: `prod` (the producer cursor, with the
//! writer's flags and the doorbell state) and `cons` (the consumer cursor).
//! In `cons`, the 16 flag bits carry the reader's spin capacity
//! ([`spin_cap_encode`]): zero unless the reader is busy-polling inside a
//! consuming read, see `smclo::doorbell`.
//!
//! Everything here is pure arithmetic on values; the words come from shared
//! memory that the peer can write at will, so [`validate_prod`],
//! [`validate_cons`] and [`distance`] check every field before a value is
//! used as an offset.

use std::fmt;

/// `prod_flags`: the writer wants to write but the ring is full (SMC's
/// `write_blocked`).
pub const WRITE_BLOCKED: u8 = 0x80;
/// `prod_flags`: mask of the doorbell count, 0..=2 one-byte doorbells that
/// the writer has queued on the readiness channel and the reader has not
/// taken yet.
pub const BELLS: u8 = 0x03;
/// `prod_flags`: the reader is busy-polling the cursor; the writer may skip
/// the doorbell (see `smclo::doorbell` for the exact condition).
pub const READER_SPINNING: u8 = 0x04;
/// `prod_flags`: the reader told its application how much is unread
/// (FIONREAD) while a doorbell was queued; the next write must wake an
/// edge-triggered poller again, with a [`LOOSE_BELL`]. Only with `BELLS > 0`.
pub const EDGE_WANTED: u8 = 0x08;
/// `prod_flags`: one doorbell byte queued beyond `BELLS`, sent for
/// [`EDGE_WANTED`]; the reader takes it at its next settle. Only with
/// `BELLS > 0`.
pub const LOOSE_BELL: u8 = 0x10;
/// `prod_flags`: a poller of the reader's process (an event loop's
/// `epoll_wait`, `poll`, `select`) is looking at this ring and re-checks it
/// after clearing the flag; the writer skips the doorbell while it is set.
pub const POLLED: u8 = 0x20;
/// Every `prod_flags` bit this version knows.
pub const PROD_FLAGS_KNOWN: u8 =
    WRITE_BLOCKED | BELLS | READER_SPINNING | EDGE_WANTED | LOOSE_BELL | POLLED;

/// `conn_state_flags`: the writer will write no more (SHUT_WR).
pub const PEER_DONE_WRITING: u8 = 0x80;
/// `conn_state_flags`: the writer closed the connection.
pub const PEER_CONN_CLOSED: u8 = 0x40;
/// `conn_state_flags`: the writer aborted the connection (like a TCP RST).
pub const PEER_CONN_ABORT: u8 = 0x20;
/// Every `conn_state_flags` bit this version knows.
pub const CONN_STATE_KNOWN: u8 = PEER_DONE_WRITING | PEER_CONN_CLOSED | PEER_CONN_ABORT;
/// Any of the flags after which the writer sends nothing more.
pub const CLOSING: u8 = CONN_STATE_KNOWN;

/// The largest number of doorbells that may be queued.
pub const MAX_BELLS: u8 = 2;

/// One cursor, unpacked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cursor {
    /// Offset in the ring, `< ring_len` in a valid cursor.
    pub count: u32,
    /// Number of wraps, modulo 2^16.
    pub wrap: u16,
    /// `WRITE_BLOCKED`, `BELLS`, `READER_SPINNING`, `EDGE_WANTED`,
    /// `LOOSE_BELL`, `POLLED` (in `prod`); low byte of
    /// the spin capacity (in `cons`).
    pub prod_flags: u8,
    /// `PEER_*` (in `prod`); high byte of the spin capacity (in `cons`).
    pub conn_state_flags: u8,
}

impl Cursor {
    /// Unpacks a word.
    #[inline]
    pub const fn from_word(w: u64) -> Cursor {
        Cursor {
            count: w as u32,
            wrap: (w >> 32) as u16,
            prod_flags: (w >> 48) as u8,
            conn_state_flags: (w >> 56) as u8,
        }
    }

    /// Packs into a word.
    #[inline]
    pub const fn to_word(self) -> u64 {
        self.count as u64
            | (self.wrap as u64) << 32
            | (self.prod_flags as u64) << 48
            | (self.conn_state_flags as u64) << 56
    }

    /// The doorbell count (`prod_flags & BELLS`).
    #[inline]
    pub const fn bells(self) -> u8 {
        self.prod_flags & BELLS
    }

    /// Byte position modulo `2^16 * ring_len` (`ring_len` a power of two).
    #[inline]
    pub const fn position(self, ring_len: u32) -> u64 {
        self.wrap as u64 * ring_len as u64 + self.count as u64
    }

    /// This cursor advanced by `n <= ring_len` bytes; the wrap counter
    /// itself wraps at 2^16, like SMC's `u16 wrap`. Flags are unchanged.
    #[inline]
    pub const fn advanced(self, n: u32, ring_len: u32) -> Cursor {
        let c = self.count as u64 + n as u64;
        let mut out = self;
        if c >= ring_len as u64 {
            out.count = (c - ring_len as u64) as u32;
            out.wrap = self.wrap.wrapping_add(1);
        } else {
            out.count = c as u32;
        }
        out
    }
}

/// The flag bits of a word (bits 48..64).
pub const FLAGS_MASK: u64 = 0xFFFF << 48;
/// The position bits of a word (count and wrap).
pub const POSITION_MASK: u64 = !FLAGS_MASK;

/// `prod_flags` of a packed word.
#[inline]
pub const fn prod_flags(w: u64) -> u8 {
    (w >> 48) as u8
}

/// `conn_state_flags` of a packed word.
#[inline]
pub const fn conn_state_flags(w: u64) -> u8 {
    (w >> 56) as u8
}

/// The doorbell count of a packed word.
#[inline]
pub const fn bells(w: u64) -> u8 {
    prod_flags(w) & BELLS
}

/// `w` with its doorbell count replaced by `b` (`b <= 3`).
#[inline]
pub const fn with_bells(w: u64, b: u8) -> u64 {
    (w & !((BELLS as u64) << 48)) | ((b & BELLS) as u64) << 48
}

/// `w` with `prod_flags` bits `f` set.
#[inline]
pub const fn with_prod_flags(w: u64, f: u8) -> u64 {
    w | (f as u64) << 48
}

/// `w` with `prod_flags` bits `f` cleared.
#[inline]
pub const fn without_prod_flags(w: u64, f: u8) -> u64 {
    w & !((f as u64) << 48)
}

/// `w` with `conn_state_flags` bits `f` set.
#[inline]
pub const fn with_conn_state_flags(w: u64, f: u8) -> u64 {
    w | (f as u64) << 56
}

/// `w` advanced by `n <= ring_len` bytes, flags unchanged.
#[inline]
pub const fn advance(w: u64, n: u32, ring_len: u32) -> u64 {
    Cursor::from_word(w).advanced(n, ring_len).to_word()
}

/// Whether two words name the same position (flags ignored).
#[inline]
pub const fn same_position(a: u64, b: u64) -> bool {
    a & POSITION_MASK == b & POSITION_MASK
}

/// The spin capacity carried in the flag bits of a `cons` word: a lower
/// bound of how many bytes the spinning reader will consume at once, or 0
/// when it is not spinning. Encoded in 16 bits: values below 0x8000 are
/// bytes, `0x8000 | k` means `k * 32` bytes (up to about 1 MiB).
#[inline]
pub const fn spin_cap_encode(bytes: usize) -> u16 {
    if bytes < 0x8000 {
        bytes as u16
    } else {
        let k = bytes / 32;
        0x8000 | if k > 0x7FFF { 0x7FFF } else { k as u16 }
    }
}

/// Decodes [`spin_cap_encode`]; never more than the encoded byte count.
#[inline]
pub const fn spin_cap_decode(code: u16) -> u32 {
    if code & 0x8000 == 0 {
        code as u32
    } else {
        (code & 0x7FFF) as u32 * 32
    }
}

/// The spin capacity (bytes) of a `cons` word.
#[inline]
pub const fn spin_cap(cons: u64) -> u32 {
    spin_cap_decode((cons >> 48) as u16)
}

/// A `cons` word at position `pos` with spin capacity code `cap`.
#[inline]
pub const fn cons_with_cap(pos: u64, cap: u16) -> u64 {
    (pos & POSITION_MASK) | (cap as u64) << 48
}

/// What is wrong with a cursor word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorError {
    /// `count >= ring_len`.
    CountOutOfRange {
        /// The word.
        word: u64,
        /// The ring length it was checked against.
        ring_len: u32,
    },
    /// Flag bits this version does not know.
    UnknownFlags {
        /// The word.
        word: u64,
    },
    /// More than [`MAX_BELLS`] doorbells.
    TooManyBells {
        /// The word.
        word: u64,
    },
    /// The producer is behind the consumer or more than `ring_len` ahead.
    BadDistance {
        /// The producer word.
        prod: u64,
        /// The consumer word.
        cons: u64,
        /// The ring length.
        ring_len: u32,
    },
    /// The bytes the consumer has not read and the ones the writer has
    /// written after them but not published (corked) are more than the
    /// ring: the consumer moved back over room it had left.
    HeldOverrun {
        /// Unread, by the consumer's word.
        used: u32,
        /// Written and held by the writer.
        held: u32,
        /// The ring length.
        ring_len: u32,
    },
}

impl fmt::Display for CursorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CursorError::CountOutOfRange { word, ring_len } => {
                write!(
                    f,
                    "cursor word {word:#018x}: count {} >= ring length {ring_len}",
                    word as u32
                )
            }
            CursorError::UnknownFlags { word } => {
                write!(f, "cursor word {word:#018x}: unknown flag bits")
            }
            CursorError::TooManyBells { word } => {
                write!(
                    f,
                    "cursor word {word:#018x}: {} doorbells (at most {MAX_BELLS})",
                    bells(word)
                )
            }
            CursorError::BadDistance {
                prod,
                cons,
                ring_len,
            } => write!(
                f,
                "producer {prod:#018x} and consumer {cons:#018x} are not 0..={ring_len} bytes apart"
            ),
            CursorError::HeldOverrun {
                used,
                held,
                ring_len,
            } => write!(
                f,
                "{used} bytes unread and {held} written after them exceed the {ring_len}-byte ring"
            ),
        }
    }
}

impl std::error::Error for CursorError {}

/// Checks a `prod` word: `count < ring_len`, known flags only, at most two
/// doorbells.
#[inline]
pub const fn validate_prod(w: u64, ring_len: u32) -> Result<(), CursorError> {
    if (w as u32) >= ring_len {
        return Err(CursorError::CountOutOfRange { word: w, ring_len });
    }
    if prod_flags(w) & !PROD_FLAGS_KNOWN != 0 || conn_state_flags(w) & !CONN_STATE_KNOWN != 0 {
        return Err(CursorError::UnknownFlags { word: w });
    }
    if bells(w) > MAX_BELLS {
        return Err(CursorError::TooManyBells { word: w });
    }
    Ok(())
}

/// Checks a `cons` word: `count < ring_len` (its 16 flag bits are the spin
/// capacity, any value of which is meaningful).
#[inline]
pub const fn validate_cons(w: u64, ring_len: u32) -> Result<(), CursorError> {
    if (w as u32) >= ring_len {
        return Err(CursorError::CountOutOfRange { word: w, ring_len });
    }
    Ok(())
}

/// Validates both words and returns how many bytes lie between them
/// (`prod - cons`, in `0..=ring_len`). `ring_len` must be a power of two.
#[inline]
pub const fn distance(prod: u64, cons: u64, ring_len: u32) -> Result<u32, CursorError> {
    if let Err(e) = validate_prod(prod, ring_len) {
        return Err(e);
    }
    if let Err(e) = validate_cons(cons, ring_len) {
        return Err(e);
    }
    let modulus_mask = ((ring_len as u64) << 16) - 1;
    let p = Cursor::from_word(prod).position(ring_len);
    let c = Cursor::from_word(cons).position(ring_len);
    let d = p.wrapping_sub(c) & modulus_mask;
    if d > ring_len as u64 {
        return Err(CursorError::BadDistance {
            prod,
            cons,
            ring_len,
        });
    }
    Ok(d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: u32 = 16 * 1024;

    #[test]
    fn packs_fields_at_the_documented_bits() {
        let c = Cursor {
            count: 0x1234_5678,
            wrap: 0x9abc,
            prod_flags: 0x85,
            conn_state_flags: 0x40,
        };
        assert_eq!(c.to_word(), 0x4085_9abc_1234_5678);
        assert_eq!(Cursor::from_word(0x4085_9abc_1234_5678), c);
        assert_eq!(bells(c.to_word()), 1);
        assert_eq!(with_bells(c.to_word(), 2), 0x4086_9abc_1234_5678);
        assert_eq!(conn_state_flags(c.to_word()), PEER_CONN_CLOSED);
    }

    #[test]
    fn advance_wraps_count_and_wrap() {
        let w = Cursor {
            count: L - 10,
            wrap: 3,
            prod_flags: WRITE_BLOCKED,
            conn_state_flags: 0,
        }
        .to_word();
        let a = Cursor::from_word(advance(w, 10, L));
        assert_eq!((a.count, a.wrap, a.prod_flags), (0, 4, WRITE_BLOCKED));
        let b = Cursor::from_word(advance(w, 25, L));
        assert_eq!((b.count, b.wrap), (15, 4));
        let c = Cursor::from_word(advance(w, 9, L));
        assert_eq!((c.count, c.wrap), (L - 1, 3));
        // A full ring's worth from count 0 is exactly one wrap.
        let d = Cursor::from_word(advance(0, L, L));
        assert_eq!((d.count, d.wrap), (0, 1));
    }

    #[test]
    fn wrap_counter_overflows_at_2_16_and_distance_survives_it() {
        let cons = Cursor {
            count: L - 100,
            wrap: u16::MAX,
            ..Default::default()
        }
        .to_word();
        let prod = advance(cons, 300, L);
        let p = Cursor::from_word(prod);
        assert_eq!((p.count, p.wrap), (200, 0));
        assert_eq!(distance(prod, cons, L), Ok(300));
        // Walk 2^16 + 5 wraps in ring-sized steps: back to the same place.
        let mut w = 0u64;
        for _ in 0..(1u32 << 16) + 5 {
            w = advance(w, L, L);
        }
        assert_eq!(Cursor::from_word(w).wrap, 5);
        // Full ring across the overflow.
        let full = advance(cons, L, L);
        assert_eq!(distance(full, cons, L), Ok(L));
    }

    #[test]
    fn distance_rejects_bad_words() {
        assert_eq!(distance(5, 5, L), Ok(0));
        assert!(matches!(
            distance(L as u64, 0, L),
            Err(CursorError::CountOutOfRange { .. })
        ));
        assert!(matches!(
            distance(0, L as u64 + 7, L),
            Err(CursorError::CountOutOfRange { .. })
        ));
        // Producer behind the consumer.
        assert!(matches!(
            distance(4, 5, L),
            Err(CursorError::BadDistance { .. })
        ));
        // More than a ring ahead.
        let far = advance(advance(0, L, L), 1, L);
        assert!(matches!(
            distance(far, 0, L),
            Err(CursorError::BadDistance { .. })
        ));
        // Unknown flags, too many bells.
        assert!(matches!(
            distance(with_prod_flags(0, !PROD_FLAGS_KNOWN), 0, L),
            Err(CursorError::UnknownFlags { .. })
        ));
        assert!(matches!(
            distance(with_conn_state_flags(0, !CONN_STATE_KNOWN), 0, L),
            Err(CursorError::UnknownFlags { .. })
        ));
        assert!(matches!(
            distance(with_bells(0, 3), 0, L),
            Err(CursorError::TooManyBells { .. })
        ));
        assert_eq!(
            distance(
                with_bells(with_prod_flags(0, WRITE_BLOCKED | READER_SPINNING), 2),
                0,
                L
            ),
            Ok(0)
        );
        // The consumer's flag bits are the spin capacity: allowed.
        assert_eq!(distance(3, cons_with_cap(0, 0xFFFF), L), Ok(3));
    }

    #[test]
    fn spin_capacity_never_overstates() {
        for b in [
            0usize,
            1,
            14,
            0x7FFF,
            0x8000,
            0x8001,
            64000,
            1 << 20,
            usize::MAX,
        ] {
            let d = spin_cap_decode(spin_cap_encode(b)) as usize;
            assert!(d <= b, "{b} -> {d}");
            assert!(b.min(1 << 20) - d < 32 || b > (0x7FFF * 32), "{b} -> {d}");
        }
        let c = cons_with_cap(advance(0, 77, L), spin_cap_encode(14));
        assert_eq!(spin_cap(c), 14);
        assert_eq!(Cursor::from_word(c).count, 77);
    }

    #[test]
    fn same_position_ignores_flags() {
        let a = Cursor {
            count: 9,
            wrap: 2,
            prod_flags: 0x81,
            conn_state_flags: 0x80,
        }
        .to_word();
        let b = Cursor {
            count: 9,
            wrap: 2,
            ..Default::default()
        }
        .to_word();
        assert!(same_position(a, b));
        assert!(!same_position(a, advance(b, 1, L)));
    }
}
