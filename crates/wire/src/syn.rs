//! The saved SYN (`TCP_SAVED_SYN`): the IP and TCP headers of the segment
//! that opened an accepted connection, as the kernel kept them.
//!
//! The handshake reads from it the 4-tuple and the mark the proposer put into
//! its SYN (IP TTL / IPv6 hop limit, and the DSCP bits of TOS / traffic
//! class). Those fields are the only ones a client can set per connection
//! without changing the connection afterwards.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The SYN mark: values the client set for its SYN only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mark {
    /// IPv4 TTL or IPv6 hop limit.
    pub ttl: u8,
    /// The six DSCP bits (TOS or traffic class shifted right by 2); the two
    /// ECN bits belong to the kernel and are ignored.
    pub dscp: u8,
}

impl Mark {
    /// No mark: an announcing client's proposal, whose SYN is proven by
    /// its TCP timestamp instead ([`TsWindow`]).
    pub const NONE: Mark = Mark { ttl: 0, dscp: 0 };

    /// The TTL a plain Linux client sends; never used as a mark, so that a
    /// plain client cannot match by accident.
    pub const DEFAULT_TTL: u8 = 64;

    /// The lowest TTL a mark uses. High, so that a marked SYN outlives any
    /// routing path on one host, and far above a plain Linux client's.
    pub const MIN_TTL: u8 = 128;

    /// The highest TTL a mark uses (255 is left to programs that set it
    /// themselves, e.g. for TTL security).
    pub const MAX_TTL: u8 = 254;

    /// Routing hops between the client and the server (network namespaces
    /// joined through a forwarding namespace, as routed container networks
    /// do) that a mark survives: each decrements the TTL by one.
    pub const MAX_HOPS: u8 = 8;

    /// Derives a mark from random bits: TTL in [`MIN_TTL`](Self::MIN_TTL)
    /// ..= [`MAX_TTL`](Self::MAX_TTL), DSCP in 1..=63 (never a plain
    /// client's 0, so that a mark whose TTL was rewritten on the way still
    /// looks marked). With the hop window ([`fits`](Self::fits)), about 10
    /// bits of proof that a SYN is the proposer's, beside its addresses and
    /// port.
    pub fn from_random(r: u32) -> Mark {
        let span = (Self::MAX_TTL - Self::MIN_TTL) as u32 + 1;
        let ttl = Self::MIN_TTL + (r % span) as u8;
        let dscp = ((r >> 8) % 63) as u8 + 1;
        Mark { ttl, dscp }
    }

    /// Whether a SYN that arrived with mark `seen` may have left with this
    /// one: the same DSCP, and a TTL decremented by at most
    /// [`MAX_HOPS`](Self::MAX_HOPS) routing hops.
    pub fn fits(self, seen: Mark) -> bool {
        seen.dscp == self.dscp && seen.ttl <= self.ttl && self.ttl - seen.ttl <= Self::MAX_HOPS
    }

    /// Whether a SYN that arrived with mark `seen` may carry a mark at all,
    /// perhaps one changed on the way: a TTL a mark could have become
    /// ([`ttl_looks_marked`](Self::ttl_looks_marked)), or a DSCP a plain
    /// client does not set by default. A plain Linux SYN (TTL 64 less its
    /// hops, DSCP 0) does not.
    pub fn may_be_marked(seen: Mark) -> bool {
        Self::ttl_looks_marked(seen.ttl) || seen.dscp != 0
    }

    /// Whether a SYN that arrived with TTL `ttl` may have left with a mark's
    /// TTL (perhaps with its DSCP rewritten on the way).
    pub fn ttl_looks_marked(ttl: u8) -> bool {
        ttl >= Self::MIN_TTL - Self::MAX_HOPS
    }

    /// The byte to set with `IP_TOS` / `IPV6_TCLASS`.
    pub fn tos(self) -> u8 {
        self.dscp << 2
    }
}

/// What the handshake needs from a saved SYN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Syn {
    /// The client's address and port (the SYN's source).
    pub src: SocketAddr,
    /// The server's address and port (the SYN's destination).
    pub dst: SocketAddr,
    /// The mark found in the IP header.
    pub mark: Mark,
    /// The TSval of its TCP timestamp option, if it carries one: the
    /// client's per-connection timestamp clock when the SYN left, which
    /// proves an unmarked SYN to be an announcing client's (see
    /// [`TsWindow`]).
    pub tsval: Option<u32>,
}

/// The TSvals a client's SYN may have carried, learnt by the client right
/// after its `connect` started: its connection's timestamp clock then
/// (`TCP_TIMESTAMP`), less the milliseconds `connect` took and one for the
/// clock's tick in between, up to one more than the clock read (the kernel
/// clears the read value's lowest bit, which flags microsecond
/// timestamps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TsWindow {
    /// The lowest TSval the SYN may carry.
    pub lo: u32,
    /// How many milliseconds past `lo` it may be (at most
    /// [`TsWindow::MAX_SPAN`]).
    pub span: u16,
}

impl TsWindow {
    /// The widest window a client publishes: a `connect` that took longer
    /// (a blocking one across a slow path) proves too little.
    pub const MAX_SPAN: u16 = 1000;

    /// The window for a clock read of `now` after a `connect` that took
    /// `took_ms` milliseconds (rounded up).
    pub fn after(now: u32, took_ms: u32) -> TsWindow {
        let before = took_ms.saturating_add(1).min(u32::from(Self::MAX_SPAN) - 1);
        TsWindow {
            lo: now.wrapping_sub(before),
            span: before as u16 + 1,
        }
    }

    /// Whether a SYN carrying `tsval` fits (the clock wraps).
    pub fn fits(self, tsval: u32) -> bool {
        tsval.wrapping_sub(self.lo) <= u32::from(self.span)
    }
}

/// Why a saved SYN could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SynError {
    /// Fewer bytes than the headers need.
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Neither IPv4 nor IPv6.
    BadVersion(u8),
    /// The IP header does not carry TCP directly (options we do not follow,
    /// such as IPv6 extension headers).
    NotTcp(u8),
    /// IPv4 header length field below 20 bytes.
    BadIhl(u8),
    /// A TCP segment that is not a SYN.
    NotSyn,
}

impl fmt::Display for SynError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SynError::Truncated { what, need, have } => {
                write!(
                    f,
                    "saved SYN truncated: {what} needs {need} bytes, have {have}"
                )
            }
            SynError::BadVersion(v) => write!(f, "saved SYN has IP version {v}"),
            SynError::NotTcp(p) => write!(f, "saved SYN carries protocol {p}, not TCP"),
            SynError::BadIhl(l) => write!(f, "saved SYN has IPv4 header length {l} words"),
            SynError::NotSyn => write!(f, "saved segment is not a SYN"),
        }
    }
}

impl std::error::Error for SynError {}

const TCP_PROTO: u8 = 6;
const TCP_FLAG_SYN: u8 = 0x02;

fn need(b: &[u8], n: usize, what: &'static str) -> Result<(), SynError> {
    if b.len() < n {
        Err(SynError::Truncated {
            what,
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

/// Parses the bytes `getsockopt(TCP_SAVED_SYN)` returned.
pub fn parse(b: &[u8]) -> Result<Syn, SynError> {
    need(b, 1, "IP version")?;
    let (src_ip, dst_ip, mark, tcp): (IpAddr, IpAddr, Mark, &[u8]) = match b[0] >> 4 {
        4 => {
            need(b, 20, "IPv4 header")?;
            let ihl = b[0] & 0x0f;
            if ihl < 5 {
                return Err(SynError::BadIhl(ihl));
            }
            let hl = ihl as usize * 4;
            need(b, hl, "IPv4 header with options")?;
            if b[9] != TCP_PROTO {
                return Err(SynError::NotTcp(b[9]));
            }
            let ip4 = |o: usize| Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3]);
            let mark = Mark {
                ttl: b[8],
                dscp: b[1] >> 2,
            };
            (ip4(12).into(), ip4(16).into(), mark, &b[hl..])
        }
        6 => {
            need(b, 40, "IPv6 header")?;
            if b[6] != TCP_PROTO {
                return Err(SynError::NotTcp(b[6]));
            }
            let tclass = (b[0] << 4) | (b[1] >> 4);
            let ip6 = |o: usize| {
                let mut a = [0u8; 16];
                a.copy_from_slice(&b[o..o + 16]);
                Ipv6Addr::from(a)
            };
            let mark = Mark {
                ttl: b[7],
                dscp: tclass >> 2,
            };
            (ip6(8).into(), ip6(24).into(), mark, &b[40..])
        }
        v => return Err(SynError::BadVersion(v)),
    };
    need(tcp, 20, "TCP header")?;
    if tcp[13] & TCP_FLAG_SYN == 0 {
        return Err(SynError::NotSyn);
    }
    let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
    let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
    Ok(Syn {
        src: SocketAddr::new(src_ip, sport),
        dst: SocketAddr::new(dst_ip, dport),
        mark,
        tsval: tsval(tcp),
    })
}

/// TCP option kinds the option walk knows.
const OPT_END: u8 = 0;
const OPT_NOP: u8 = 1;
const OPT_TIMESTAMP: u8 = 8;
const OPT_TIMESTAMP_LEN: usize = 10;

/// The TSval of the timestamp option among the TCP header's options (its
/// data offset says where they end, bounded by the bytes present); `None`
/// without one, or when the options do not parse.
fn tsval(tcp: &[u8]) -> Option<u32> {
    let end = ((tcp[12] >> 4) as usize * 4).min(tcp.len());
    let mut i = 20;
    while i < end {
        match tcp[i] {
            OPT_END => return None,
            OPT_NOP => i += 1,
            kind => {
                let len = *tcp.get(i + 1)? as usize;
                if len < 2 || i + len > end {
                    return None;
                }
                if kind == OPT_TIMESTAMP && len == OPT_TIMESTAMP_LEN {
                    let v = &tcp[i + 2..i + 6];
                    return Some(u32::from_be_bytes([v[0], v[1], v[2], v[3]]));
                }
                i += len;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4_syn(ttl: u8, tos: u8, flags: u8) -> Vec<u8> {
        let mut b = vec![0u8; 40];
        b[0] = 0x45;
        b[1] = tos;
        b[8] = ttl;
        b[9] = 6;
        b[12..16].copy_from_slice(&[127, 0, 0, 1]);
        b[16..20].copy_from_slice(&[127, 0, 0, 2]);
        b[20..22].copy_from_slice(&40000u16.to_be_bytes());
        b[22..24].copy_from_slice(&8080u16.to_be_bytes());
        b[33] = flags;
        b
    }

    #[test]
    fn parses_ipv4_syn_with_mark() {
        let s = parse(&v4_syn(201, 0xa9, 0x02)).unwrap();
        assert_eq!(s.src, "127.0.0.1:40000".parse().unwrap());
        assert_eq!(s.dst, "127.0.0.2:8080".parse().unwrap());
        assert_eq!(
            s.mark,
            Mark {
                ttl: 201,
                dscp: 0xa9 >> 2
            }
        );
    }

    #[test]
    fn parses_ipv6_syn() {
        let mut b = vec![0u8; 60];
        b[0] = 0x6a; // version 6, traffic class high nibble 0xa
        b[1] = 0x80; // traffic class low nibble 0x8 -> 0xa8
        b[6] = 6;
        b[7] = 17;
        b[23] = 1; // src ::1
        b[39] = 1; // dst ::1
        b[40..42].copy_from_slice(&1234u16.to_be_bytes());
        b[42..44].copy_from_slice(&80u16.to_be_bytes());
        b[53] = 0x02;
        let s = parse(&b).unwrap();
        assert_eq!(s.src, "[::1]:1234".parse().unwrap());
        assert_eq!(
            s.mark,
            Mark {
                ttl: 17,
                dscp: 0xa8 >> 2
            }
        );
    }

    #[test]
    fn reads_the_timestamp_option() {
        let mut b = v4_syn(64, 0, 0x02);
        // Data offset 8 words: MSS, NOP NOP, timestamp, as Linux sends.
        b[32] = 8 << 4;
        b.resize(52, 0);
        b[40..44].copy_from_slice(&[2, 4, 0x05, 0xb4]);
        b[44..46].copy_from_slice(&[1, 1]);
        b[46..48].copy_from_slice(&[8, 10]);
        b[48..52].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        b.extend_from_slice(&[0, 0, 0, 0]);
        b[32] = 9 << 4;
        assert_eq!(parse(&b).unwrap().tsval, Some(0xdead_beef));
        // Cut short by the data offset: no timestamp.
        b[32] = 7 << 4;
        assert_eq!(parse(&b).unwrap().tsval, None);
        // A zero-length option ends the walk.
        b[32] = 9 << 4;
        b[41] = 0;
        assert_eq!(parse(&b).unwrap().tsval, None);
        assert_eq!(parse(&v4_syn(64, 0, 0x02)).unwrap().tsval, None);
    }

    #[test]
    fn a_timestamp_window_fits_across_the_wrap() {
        let w = TsWindow::after(3, 5);
        assert_eq!(w.span, 7);
        assert!(w.fits(u32::MAX - 2) && w.fits(0) && w.fits(3) && w.fits(4));
        assert!(!w.fits(5) && !w.fits(u32::MAX - 3));
        assert_eq!(TsWindow::after(5000, 1 << 20).span, TsWindow::MAX_SPAN);
    }

    #[test]
    fn rejects_malformed() {
        assert!(matches!(parse(&[]), Err(SynError::Truncated { .. })));
        assert!(matches!(parse(&v4_syn(1, 0, 0x10)), Err(SynError::NotSyn)));
        let mut b = v4_syn(1, 0, 2);
        b[0] = 0x44;
        assert_eq!(parse(&b), Err(SynError::BadIhl(4)));
        b[0] = 0x4f; // 60-byte header, only 40 bytes present
        assert!(matches!(parse(&b), Err(SynError::Truncated { .. })));
        let mut b = v4_syn(1, 0, 2);
        b[9] = 17;
        assert_eq!(parse(&b), Err(SynError::NotTcp(17)));
        b[0] = 0x55;
        assert_eq!(parse(&b), Err(SynError::BadVersion(5)));
        // Every prefix of a valid SYN is rejected without panicking.
        let full = v4_syn(9, 0, 2);
        for n in 0..full.len() {
            assert!(parse(&full[..n]).is_err(), "prefix {n} accepted");
        }
    }

    #[test]
    fn marks_avoid_plain_defaults() {
        for r in 0..100_000u32 {
            let m = Mark::from_random(r.wrapping_mul(2654435761));
            assert!(m.ttl >= Mark::MIN_TTL && m.ttl != 255, "{m:?}");
            assert!(m.dscp > 0 && m.dscp < 64, "{m:?}");
        }
    }

    #[test]
    fn a_mark_fits_after_routing_hops_only() {
        let m = Mark { ttl: 200, dscp: 17 };
        assert!(m.fits(m));
        let hops = |h: u8| Mark {
            ttl: 200 - h,
            dscp: 17,
        };
        assert!(m.fits(hops(1)) && m.fits(hops(Mark::MAX_HOPS)));
        assert!(!m.fits(hops(Mark::MAX_HOPS + 1)));
        // A TTL that grew, or another DSCP, is not this mark.
        assert!(!m.fits(Mark { ttl: 201, dscp: 17 }));
        assert!(!m.fits(Mark { ttl: 200, dscp: 16 }));
    }

    #[test]
    fn a_plain_syn_does_not_look_marked() {
        // A Linux client's default, through any number of hops.
        for ttl in 0..=Mark::DEFAULT_TTL {
            assert!(!Mark::may_be_marked(Mark { ttl, dscp: 0 }));
        }
        for r in 0..10_000u32 {
            let m = Mark::from_random(r.wrapping_mul(2654435761));
            for h in 0..=Mark::MAX_HOPS {
                let seen = Mark {
                    ttl: m.ttl - h,
                    dscp: m.dscp,
                };
                assert!(Mark::may_be_marked(seen), "{m:?} after {h} hops");
            }
        }
        // A rewritten TTL with the DSCP left still looks marked.
        assert!(Mark::may_be_marked(Mark { ttl: 64, dscp: 5 }));
    }
}
