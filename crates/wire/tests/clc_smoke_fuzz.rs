//! A cheap, deterministic stand-in for `fuzz/` that runs on stable Rust in
//! every `cargo test`: 200 000 inputs (random bytes, and valid messages with
//! random mutations) go through `ClcMsg::parse`, which must never panic, and
//! whatever it accepts must re-encode to exactly the same bytes.

use smclo_wire::clc::*;
use smclo_wire::reason::Reason;

/// xorshift64*: small, no dependencies, good enough to spread inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn eid(&mut self) -> [u8; 32] {
        let mut e = [0u8; 32];
        e.iter_mut().for_each(|b| *b = self.byte());
        e
    }
}

/// A valid message with random field values.
fn random_valid(r: &mut Rng) -> ClcMsg {
    match r.below(4) {
        0 => ClcMsg::Proposal(Proposal {
            gid: r.next(),
            chid: r.next() as u16,
            seid: r.eid(),
            ueids: (0..r.below(MAX_UEIDS + 1)).map(|_| r.eid()).collect(),
            mark_ttl: r.byte(),
            mark_tos: r.byte() & 0xFC,
            token: r.next(),
            dmbe_size_comp: r.below(MAX_SIZE_COMP as usize + 1) as u8,
            nonce: r.next(),
            pid: r.next() as u32,
            start_time: r.next(),
            netns: r.next(),
        }),
        1 => ClcMsg::Accept(Accept {
            gid: r.next(),
            token: r.next(),
            dmbe_size_comp: r.below(7) as u8,
            linkid: r.next() as u32,
            chid: r.next() as u16,
        }),
        2 => ClcMsg::Confirm(Confirm {
            gid: r.next(),
            token: r.next(),
            dmbe_size_comp: r.below(7) as u8,
            linkid: r.next() as u32,
            chid: r.next() as u16,
        }),
        _ => ClcMsg::Decline(if r.below(2) == 0 {
            Decline::new(r.next(), Reason::ALL[r.below(Reason::COUNT)])
        } else {
            Decline {
                id_for_peer: r.next().to_be_bytes(),
                peer_diagnosis: r.next() as u32,
            }
        }),
    }
}

/// Changes a few bytes, or the length, of `b`.
fn mutate(r: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..1 + r.below(3) {
        match r.below(6) {
            0 if !b.is_empty() => {
                let i = r.below(b.len());
                b[i] ^= 1 << r.below(8);
            }
            1 if !b.is_empty() => {
                let i = r.below(b.len());
                b[i] = r.byte();
            }
            2 => b.truncate(r.below(b.len() + 1)),
            3 => b.extend((0..r.below(64)).map(|_| r.byte())),
            // Keep the length field consistent with a changed size, so that
            // the later checks are reached.
            4 if b.len() >= 7 => {
                let n = b.len() as u16;
                b[5..7].copy_from_slice(&n.to_be_bytes());
            }
            // UEID count: the field that decides a proposal's size.
            _ if b.len() > 80 => b[80] = r.below(10) as u8,
            _ => {}
        }
    }
}

/// The property the fuzz target checks, too.
fn check(input: &[u8]) -> bool {
    match ClcMsg::parse(input) {
        Ok(m) => {
            let out = m.to_bytes();
            assert_eq!(
                out, input,
                "accepted bytes do not re-encode identically: {m:?}"
            );
            assert_eq!(ClcMsg::parse(&out), Ok(m));
            true
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            false
        }
    }
}

#[test]
fn clc_parse_smoke_fuzz() {
    let mut r = Rng(0x5EED_0F5A_C100_0000 | 1);
    let (mut accepted, mut rejected, mut mutants_accepted) = (0u32, 0u32, 0u32);
    for i in 0..200_000u32 {
        let input = match i % 4 {
            // Random bytes, now and then behind a valid header.
            0 => {
                let mut b: Vec<u8> = (0..r.below(MAX_LEN + 8)).map(|_| r.byte()).collect();
                if b.len() >= 8 && r.below(2) == 0 {
                    let t = 1 + r.below(4) as u8;
                    let eye = if t == 2 || t == 3 {
                        EYECATCHER_SMCD
                    } else {
                        EYECATCHER_SMCR
                    };
                    b[..4].copy_from_slice(&eye);
                    b[4] = t;
                    let n = b.len() as u16;
                    b[5..7].copy_from_slice(&n.to_be_bytes());
                    b[7] = 0x20 | (r.byte() & 0x0F);
                }
                b
            }
            // A valid message, unchanged: must be accepted.
            1 => {
                let m = random_valid(&mut r);
                let b = m.to_bytes();
                assert_eq!(ClcMsg::parse(&b), Ok(m));
                b
            }
            // A valid message, mutated.
            _ => {
                let mut b = random_valid(&mut r).to_bytes();
                mutate(&mut r, &mut b);
                b
            }
        };
        if check(&input) {
            accepted += 1;
            mutants_accepted += u32::from(i % 4 >= 2);
        } else {
            rejected += 1;
        }
    }
    eprintln!("accepted {accepted} (mutants {mutants_accepted}), rejected {rejected}");
    // Both outcomes must be well exercised, including mutants that stay
    // valid (changes to field bytes), or the test proves little.
    assert!(accepted > 60_000 && rejected > 60_000 && mutants_accepted > 5_000);
}
