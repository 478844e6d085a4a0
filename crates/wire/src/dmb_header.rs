//! The DMB header: the first 4096 bytes (one page) of a DMB file.
//!
//! ```text
//!   0   magic "SMCLODMB"          8
//!   8   version u32 = 1
//!   12  ring_len u32              power of two, 16 KiB ..= 1 MiB
//!   16  token u64
//!   24  owner pid u32, 28 reserved u32
//!   32  owner start time u64      (clock ticks since boot)
//!   40  device gid u64
//!   64  prod  AtomicU64           CDC producer word (written by the peer)
//!   128 cons  AtomicU64           CDC consumer word (written by the owner)
//!   192 attach AtomicU64          attach record: non-zero while a peer maps it
//!   200 reserved to 4096
//! ```
//!
//! The static fields (0..48) are written once by the owner before the peer
//! can see the file and only read afterwards; [`parse`] validates them. The
//! cursor words are atomics, accessed in place by `smclo::dmb`, never
//! through this module. All integers are in host byte order: both ends are
//! on one host.

use std::fmt;

/// `"SMCLODMB"`.
pub const MAGIC: [u8; 8] = *b"SMCLODMB";
/// The only header version this code reads and writes.
pub const VERSION: u32 = 1;
/// Size of the header; the ring starts at this file offset.
pub const HEADER_LEN: usize = 4096;
/// How many leading bytes hold the static fields ([`parse`] needs these).
pub const STATIC_LEN: usize = 48;
/// Offset of the version (u32).
pub const VERSION_OFFSET: usize = 8;
/// Offset of the ring length (u32).
pub const RING_LEN_OFFSET: usize = 12;
/// Offset of the token (u64, 8-aligned). The owner rewrites it in place
/// when it reuses the DMB, so it is accessed in the mapping as an atomic.
pub const TOKEN_OFFSET: usize = 16;
/// Offset of the owner's pid (u32).
pub const OWNER_PID_OFFSET: usize = 24;
/// Offset of the owner's start time (u64).
pub const OWNER_START_OFFSET: usize = 32;
/// Offset of the device GID (u64).
pub const GID_OFFSET: usize = 40;
/// Offset of the `prod` cursor word.
pub const PROD_OFFSET: usize = 64;
/// Offset of the `cons` cursor word (its own cache line, away from `prod`).
pub const CONS_OFFSET: usize = 128;
/// Offset of the attach record: a non-zero value chosen by the attacher,
/// set (by compare-and-swap from 0 or [`ATTACH_RESERVED`]) when it maps
/// the DMB and cleared when it unmaps it. The owner reuses a DMB only while
/// the record is 0.
pub const ATTACH_OFFSET: usize = 192;
/// The attach record of a DMB its owner has named to a peer that has not
/// attached it yet (a server's DMB in its Accept): not 0, so the owner does
/// not reuse it before that peer attached and detached; no attacher's own
/// record.
pub const ATTACH_RESERVED: u64 = u64::MAX;
/// Smallest ring.
pub const MIN_RING_LEN: u32 = 16 * 1024;
/// Largest ring.
pub const MAX_RING_LEN: u32 = 1024 * 1024;

// The cursor words follow the static fields, are 8-aligned and sit on
// separate cache lines (checked at compile time).
const _: () = assert!(TOKEN_OFFSET & 7 == 0 && GID_OFFSET + 8 == STATIC_LEN);
const _: () = assert!(PROD_OFFSET >= STATIC_LEN && PROD_OFFSET & 7 == 0 && CONS_OFFSET & 7 == 0);
const _: () = assert!(CONS_OFFSET - PROD_OFFSET >= 64 && CONS_OFFSET + 8 <= HEADER_LEN);
const _: () = assert!(
    ATTACH_OFFSET - CONS_OFFSET >= 64 && ATTACH_OFFSET & 7 == 0 && ATTACH_OFFSET + 8 <= HEADER_LEN
);

/// The static fields of a DMB header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmbHeader {
    /// Ring length in bytes.
    pub ring_len: u32,
    /// The DMB token (the identity the CLC messages carry).
    pub token: u64,
    /// Pid of the owner, the process that reads this ring.
    pub owner_pid: u32,
    /// Start time of the owner (`/proc/<pid>/stat` field 22), so that a
    /// recycled pid is not taken for the owner.
    pub owner_start: u64,
    /// GID of the device the DMB belongs to.
    pub gid: u64,
}

/// What is wrong with a DMB header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DmbHeaderError {
    /// Fewer than [`STATIC_LEN`] bytes.
    Truncated(usize),
    /// Not `"SMCLODMB"`.
    BadMagic([u8; 8]),
    /// A version this code does not know.
    BadVersion(u32),
    /// Not a power of two in `MIN_RING_LEN..=MAX_RING_LEN`.
    BadRingLen(u32),
}

impl fmt::Display for DmbHeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DmbHeaderError::Truncated(n) => {
                write!(f, "DMB header truncated: {n} bytes, need {STATIC_LEN}")
            }
            DmbHeaderError::BadMagic(m) => {
                write!(
                    f,
                    "DMB header magic {m:02x?} is not {:?}",
                    String::from_utf8_lossy(&MAGIC)
                )
            }
            DmbHeaderError::BadVersion(v) => {
                write!(
                    f,
                    "DMB header version {v}, this smclo reads version {VERSION}"
                )
            }
            DmbHeaderError::BadRingLen(l) => write!(
                f,
                "DMB ring length {l} is not a power of two in {MIN_RING_LEN}..={MAX_RING_LEN}"
            ),
        }
    }
}

impl std::error::Error for DmbHeaderError {}

/// Whether `len` is a ring length this version accepts.
pub const fn ring_len_ok(len: u32) -> bool {
    len.is_power_of_two() && len >= MIN_RING_LEN && len <= MAX_RING_LEN
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_ne_bytes(a)
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_ne_bytes(a)
}

/// Parses and validates the static fields from the first bytes of a DMB
/// (at least [`STATIC_LEN`]).
pub fn parse(b: &[u8]) -> Result<DmbHeader, DmbHeaderError> {
    if b.len() < STATIC_LEN {
        return Err(DmbHeaderError::Truncated(b.len()));
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&b[..MAGIC.len()]);
    if magic != MAGIC {
        return Err(DmbHeaderError::BadMagic(magic));
    }
    let version = u32_at(b, VERSION_OFFSET);
    if version != VERSION {
        return Err(DmbHeaderError::BadVersion(version));
    }
    let ring_len = u32_at(b, RING_LEN_OFFSET);
    if !ring_len_ok(ring_len) {
        return Err(DmbHeaderError::BadRingLen(ring_len));
    }
    Ok(DmbHeader {
        ring_len,
        token: u64_at(b, TOKEN_OFFSET),
        owner_pid: u32_at(b, OWNER_PID_OFFSET),
        owner_start: u64_at(b, OWNER_START_OFFSET),
        gid: u64_at(b, GID_OFFSET),
    })
}

impl DmbHeader {
    /// The static fields as bytes (the rest of the header page is zero).
    pub fn encode(&self) -> [u8; STATIC_LEN] {
        let mut out = [0u8; STATIC_LEN];
        let mut put = |o: usize, b: &[u8]| out[o..o + b.len()].copy_from_slice(b);
        put(0, &MAGIC);
        put(VERSION_OFFSET, &VERSION.to_ne_bytes());
        put(RING_LEN_OFFSET, &self.ring_len.to_ne_bytes());
        put(TOKEN_OFFSET, &self.token.to_ne_bytes());
        put(OWNER_PID_OFFSET, &self.owner_pid.to_ne_bytes());
        put(OWNER_START_OFFSET, &self.owner_start.to_ne_bytes());
        put(GID_OFFSET, &self.gid.to_ne_bytes());
        out
    }

    /// Size of the DMB file: header plus ring.
    pub fn file_len(&self) -> u64 {
        HEADER_LEN as u64 + self.ring_len as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DmbHeader {
        DmbHeader {
            ring_len: 64 * 1024,
            token: 0xfeed_beef,
            owner_pid: 4242,
            owner_start: 99,
            gid: 7,
        }
    }

    #[test]
    fn round_trips() {
        let h = sample();
        let b = h.encode();
        assert_eq!(&b[0..8], b"SMCLODMB");
        assert_eq!(parse(&b), Ok(h));
        assert_eq!(h.file_len(), 4096 + 65536);
        let mut page = vec![0u8; HEADER_LEN];
        page[..STATIC_LEN].copy_from_slice(&b);
        assert_eq!(parse(&page), Ok(h));
    }

    #[test]
    fn rejects_bad_fields() {
        let b = sample().encode();
        assert_eq!(parse(&b[..47]), Err(DmbHeaderError::Truncated(47)));
        let mut m = b;
        m[0] = b'X';
        assert!(matches!(parse(&m), Err(DmbHeaderError::BadMagic(_))));
        let mut v = b;
        v[VERSION_OFFSET..VERSION_OFFSET + 4].copy_from_slice(&2u32.to_ne_bytes());
        assert_eq!(parse(&v), Err(DmbHeaderError::BadVersion(2)));
        for bad in [0u32, 8192, 16 * 1024 + 1, 3 << 14, 2 << 20] {
            let mut r = b;
            r[RING_LEN_OFFSET..RING_LEN_OFFSET + 4].copy_from_slice(&bad.to_ne_bytes());
            assert_eq!(parse(&r), Err(DmbHeaderError::BadRingLen(bad)), "{bad}");
        }
        for good in [16 * 1024u32, 1 << 20] {
            let mut r = b;
            r[RING_LEN_OFFSET..RING_LEN_OFFSET + 4].copy_from_slice(&good.to_ne_bytes());
            assert_eq!(parse(&r).map(|h| h.ring_len), Ok(good));
        }
    }
}
