//! Addresses as the device's tables keep them: a listener's address, and a
//! connection's two endpoints packed into [`WORDS`] 64-bit words (stored as
//! atomics in the device file).
//!
//! Addresses are canonical: an IPv4-mapped IPv6 address is kept as IPv4, so
//! the two ends of one connection have one family. Packed ends:
//!
//! ```text
//! word 0..2  local address, 16 bytes (IPv4 in the first 4)
//! word 2..4  peer address, 16 bytes
//! word 4     local port (bits 0..16), peer port (bits 16..32),
//!            family (bits 32..40: 4 or 6; 0 when nothing is recorded),
//!            bits 40..64 the table's own (pack leaves them 0, unpack
//!            ignores them)
//! ```

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Family code of IPv4 addresses.
pub const FAMILY_V4: u8 = 4;
/// Family code of IPv6 addresses.
pub const FAMILY_V6: u8 = 6;
/// Words of a packed pair of ends.
pub const WORDS: usize = 5;
/// First bit of word 4 that belongs to the table.
pub const TABLE_BITS_SHIFT: u32 = 40;

/// `ip` in canonical form: its family code and 16 bytes (IPv4, also
/// IPv4-mapped IPv6, in the first 4).
pub fn canon_ip(ip: IpAddr) -> (u8, [u8; 16]) {
    let v4 = match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4,
            None => return (FAMILY_V6, v6.octets()),
        },
    };
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&v4.octets());
    (FAMILY_V4, b)
}

/// The address of `family` in `b` (the inverse of [`canon_ip`]); `None` for
/// an unknown family.
pub fn ip_from(family: u8, b: [u8; 16]) -> Option<IpAddr> {
    match family {
        FAMILY_V4 => Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        FAMILY_V6 => Some(IpAddr::V6(Ipv6Addr::from(b))),
        _ => None,
    }
}

/// 16 address bytes as two words (host byte order, as stored).
pub fn to_words(b: [u8; 16]) -> [u64; 2] {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&b[..8]);
    hi.copy_from_slice(&b[8..]);
    [u64::from_ne_bytes(lo), u64::from_ne_bytes(hi)]
}

/// The inverse of [`to_words`].
pub fn from_words(w: [u64; 2]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&w[0].to_ne_bytes());
    b[8..].copy_from_slice(&w[1].to_ne_bytes());
    b
}

/// Packs a connection's local and peer addresses. Both are made canonical;
/// if only one is IPv4 (never so for one TCP connection) both are kept as
/// IPv6, IPv4-mapped.
pub fn pack(local: SocketAddr, peer: SocketAddr) -> [u64; WORDS] {
    let (lf, lb) = canon_ip(local.ip());
    let (pf, pb) = canon_ip(peer.ip());
    let (family, lb, pb) = if lf == pf {
        (lf, lb, pb)
    } else {
        (FAMILY_V6, mapped(local.ip()), mapped(peer.ip()))
    };
    let [l0, l1] = to_words(lb);
    let [p0, p1] = to_words(pb);
    let meta = local.port() as u64 | (peer.port() as u64) << 16 | (family as u64) << 32;
    [l0, l1, p0, p1, meta]
}

fn mapped(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The (local, peer) addresses packed in `w`; `None` when nothing is
/// recorded (family 0) or the family is unknown.
pub fn unpack(w: &[u64; WORDS]) -> Option<(SocketAddr, SocketAddr)> {
    let meta = w[4];
    let family = (meta >> 32) as u8;
    let local = ip_from(family, from_words([w[0], w[1]]))?;
    let peer = ip_from(family, from_words([w[2], w[3]]))?;
    Some((
        SocketAddr::new(local, meta as u16),
        SocketAddr::new(peer, (meta >> 16) as u16),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn roundtrip_v4_v6_and_mapped() {
        for (l, p) in [
            ("127.0.0.1:40000", "127.0.0.2:7000"),
            ("[::1]:1", "[fe80::1]:65535"),
        ] {
            assert_eq!(unpack(&pack(sa(l), sa(p))), Some((sa(l), sa(p))));
        }
        // IPv4-mapped IPv6 is kept as IPv4.
        assert_eq!(
            unpack(&pack(sa("[::ffff:10.0.0.1]:5"), sa("10.0.0.2:6"))),
            Some((sa("10.0.0.1:5"), sa("10.0.0.2:6")))
        );
        // Mixed families: both as IPv6.
        assert_eq!(
            unpack(&pack(sa("10.0.0.1:5"), sa("[::2]:6"))),
            Some((sa("[::ffff:10.0.0.1]:5"), sa("[::2]:6")))
        );
    }

    #[test]
    fn nothing_recorded_and_table_bits() {
        assert_eq!(unpack(&[0; WORDS]), None);
        let mut w = pack(sa("127.0.0.1:1"), sa("127.0.0.1:2"));
        assert_eq!(w[4] >> TABLE_BITS_SHIFT, 0);
        w[4] |= 0xab << TABLE_BITS_SHIFT;
        assert_eq!(unpack(&w), Some((sa("127.0.0.1:1"), sa("127.0.0.1:2"))));
        w[4] = (w[4] & !(0xff << 32)) | 9 << 32;
        assert_eq!(unpack(&w), None, "unknown family");
    }
}
