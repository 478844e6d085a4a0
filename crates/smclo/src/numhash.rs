//! The hasher of maps keyed by the process's own numbers (descriptor
//! numbers, proposals' tokens): one multiplication per key, where the standard
//! library's keyed SipHash costs some 70 instructions per look, several
//! per connection. No peer chooses these keys, so nothing can flood a map
//! with colliding ones.

use std::hash::{BuildHasherDefault, Hasher};

/// Fibonacci hashing's constant (2^64 / the golden ratio, odd): distinct
/// low bits of a key stay distinct in the hash's low bits (the bucket), and
/// every bit of the key reaches its high ones (the tag a map compares).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// See the module documentation.
#[derive(Default, Clone, Copy)]
pub struct NumHasher(u64);

impl Hasher for NumHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_i32(&mut self, n: i32) {
        self.write_u64(n as u32 as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// Fibonacci hashing of `key`: the product's upper bits, which every
/// lower bit of the key reaches, spread consecutive keys over a table
/// (the registry's home takes bits 32 and up of a port's; a key with
/// entropy in its high bits needs the top bits, as the fallback table's
/// start does).
pub(crate) fn fib(key: u64) -> u64 {
    key.wrapping_mul(K)
}

/// A map keyed by numbers of the process's own.
pub type NumMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<NumHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_numbers_land_in_distinct_buckets_with_distinct_tags() {
        let hash = |n: i32| {
            let mut h = NumHasher::default();
            h.write_i32(n);
            h.finish()
        };
        let buckets: std::collections::BTreeSet<u64> = (0..1024).map(|n| hash(n) & 1023).collect();
        assert_eq!(buckets.len(), 1024);
        let tags: std::collections::BTreeSet<u64> = (0..128).map(|n| hash(n) >> 57).collect();
        assert!(tags.len() > 64, "{} tags of 128 numbers", tags.len());
    }

    #[test]
    fn a_map_keyed_by_numbers_finds_what_it_holds() {
        let mut m: NumMap<u64, u64> = NumMap::default();
        for n in 0..10_000u64 {
            m.insert(n.wrapping_mul(0x1234_5678_9abc_def1), n);
        }
        for n in 0..10_000u64 {
            assert_eq!(m.get(&n.wrapping_mul(0x1234_5678_9abc_def1)), Some(&n));
        }
        assert_eq!(m.get(&1), None);
    }
}
