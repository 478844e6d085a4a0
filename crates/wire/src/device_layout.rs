//! Layout of the loopback-ism device file (`<device dir>/device`).
//!
//! The file is mapped shared by every smclo process of one user. This module
//! only describes where things are and validates the fixed header; the
//! atomics that live at these offsets are in `smclo::device`. All integers are
//! in the host's byte order: the file never leaves the host that created it.
//!
//! ```text
//! offset 0          header, 4096 bytes
//!   0   magic "SMCLODEV"                8
//!   8   version u32 = 10
//!   12  header_len u32 = 4096
//!   16  total_size u64                  size of the whole file
//!   24  dmb table:        offset u32, entries u32, entry size u32
//!   36  listener table:   offset u32, entries u32, entry size u32
//!   48  rendezvous table: offset u32, entries u32, entry size u32
//!   60  reason slots u32 = 32           fallback counters per side
//!   64  gid u64                         random, never 0
//!   72  chid u16 = 0xFFFF, 74 reserved
//!   80  seid [u8; 32]                   blank padded ASCII
//!   112 fallback table:   offset u32, entries u32, entry size u32
//!   128 knobs (atomic u32 each): active, dmb_copy, dmb_type
//!   192 counters (atomic u64 each): conns_opened, dmbs_registered,
//!       xfer_bytes_retired, xfer_bytes_base, last_sweep_ms
//!   256 fallbacks by reason, client side: [u64; 32]
//!   512 fallbacks by reason, server side: [u64; 32]
//!   768 announcement map: [u64; 2], one bit per slot of the
//!       announcements' window of rendezvous slots
//!   784 decline filter: [u64; 16], one bit per port modulo 1024
//!   912 reserved to 1024
//!   1024 listener port filter: [u64; 256], one bit per port modulo 16384
//!   3072 spinner slots: [u64; 128], one per CPU (modulo 128)
//! DMB_TABLE_OFF     DMB table, DMB_ENTRIES x 128 bytes
//! LISTENER_OFF      listener registry, LISTENER_ENTRIES x 64 bytes
//! RENDEZVOUS_OFF    rendezvous slots, RENDEZVOUS_ENTRIES x 2048 bytes
//! FALLBACK_OFF      open fallback connections, FALLBACK_ENTRIES x 64 bytes
//! ```
//!
//! Every table entry starts with the same 24-byte head (state word, owner
//! start time, owner identity with its pid namespace), kept by
//! `smclo::table`. Version 2 added the pid namespace: a version 1 process
//! would judge other namespaces' entries by pid. Version 3 doubled the DMB
//! entry to carry what `smclo ss` shows (the connection's addresses, mode,
//! bytes received, close flags): a version 2 process would read the
//! listener registry at the wrong offset. Version 4 added the fallback
//! table (`smclo ss -a`); version 5 moved a DMB entry's `rx_bytes` to its
//! second cache line. Version 6 gave a rendezvous slot's reserved word the
//! client's early-byte count: a version 5 server would ignore it and leave
//! the counted bytes in its TCP stream ahead of the ring's. Version 7 left
//! the SYN mark's TTL out of a rendezvous slot's key (routing hops
//! decrement it; a version 6 server would look in the wrong place) and
//! added the listener port filter, which a version 6 listener would not
//! set. Version 8 added the spinner slots, which bound the device's busy
//! waits by the CPUs they may run on: a version 7 process would spin
//! without taking one. Version 9 added the announcement map, which a
//! server reads instead of the announcements' whole window: a version 8
//! client would announce without setting its bit, and its server would
//! not find it. Version 10 added declines to the listener registry and
//! their port filter: a version 9 client would propose to a declined
//! listener.

use core::fmt;

/// First 8 bytes of the device file.
pub const MAGIC: [u8; 8] = *b"SMCLODEV";
/// Layout version this code reads and writes.
pub const VERSION: u32 = 10;
/// Size of the header page.
pub const HEADER_LEN: u32 = 4096;

/// Entries in the DMB table (the kernel's loopback allows 5000 DMBs).
pub const DMB_ENTRIES: u32 = 4096;
/// Bytes per DMB table entry: two cache lines, the first changed by the
/// data path (byte counts), the second written at connection setup and
/// close (what `smclo ss` shows).
pub const DMB_ENTRY_LEN: u32 = 128;
/// Offset of the DMB table.
pub const DMB_TABLE_OFF: u32 = HEADER_LEN;

/// Entries in the listener registry.
pub const LISTENER_ENTRIES: u32 = 1024;
/// Bytes per listener entry: one cache line.
pub const LISTENER_ENTRY_LEN: u32 = 64;
/// Offset of the listener registry.
pub const LISTENER_OFF: u32 = DMB_TABLE_OFF + DMB_ENTRIES * DMB_ENTRY_LEN;

/// Handshake (rendezvous) slots.
pub const RENDEZVOUS_ENTRIES: u32 = 1024;
/// Bytes per rendezvous slot: 128 bytes of state and key, then three
/// 512-byte message areas, padded to 2048.
pub const RENDEZVOUS_ENTRY_LEN: u32 = 2048;
/// Offset of the rendezvous slots.
pub const RENDEZVOUS_OFF: u32 = LISTENER_OFF + LISTENER_ENTRIES * LISTENER_ENTRY_LEN;

/// Entries in the fallback table: TCP connections that fell back, while
/// their descriptor is open (`smclo ss -a`).
pub const FALLBACK_ENTRIES: u32 = 1024;
/// Bytes per fallback entry: one cache line (head and packed ends, whose
/// table bits hold the reason index and the role).
pub const FALLBACK_ENTRY_LEN: u32 = 64;
/// Offset of the fallback table.
pub const FALLBACK_OFF: u32 = RENDEZVOUS_OFF + RENDEZVOUS_ENTRIES * RENDEZVOUS_ENTRY_LEN;

/// Size of each message area in a rendezvous slot.
pub const MSG_AREA_LEN: u32 = 512;
/// Offsets of the proposal, reply and confirm areas inside a slot.
pub const MSG_AREA_OFF: [u32; 3] = [128, 128 + MSG_AREA_LEN, 128 + 2 * MSG_AREA_LEN];

/// Words of the listener port filter in the header: bit `port %
/// (64 * PORT_FILTER_WORDS)` is set before a listener on `port` is
/// registered and never cleared, so a client whose destination port's bit
/// is clear knows without reading the registry that no smclo listener has
/// it.
pub const PORT_FILTER_WORDS: usize = 256;

const _: () = assert!(off::PORT_FILTER + PORT_FILTER_WORDS * 8 <= HEADER_LEN as usize);

/// Words of the announcement map in the header: bit `p` is set while
/// the slot `p` places after the announcements' home (the window every
/// announcement shares, `smclo::rendezvous`) holds an announcement
/// (`smclo::announced`).
pub const ANNOUNCED_WORDS: usize = 2;

const _: () = assert!(off::ANNOUNCED + ANNOUNCED_WORDS * 8 <= off::DECLINE_FILTER);

/// Words of the decline filter in the header: bit `port % (64 *
/// DECLINE_FILTER_WORDS)` is set before a decline on `port` is published
/// in the listener registry (`smclo::registry`) and never cleared, so a
/// client whose destination port's bit is clear knows that no decline
/// has it.
pub const DECLINE_FILTER_WORDS: usize = 16;

const _: () = assert!(off::DECLINE_FILTER + DECLINE_FILTER_WORDS * 8 <= off::PORT_FILTER);

/// Spinner slots in the header: one word per CPU (modulo `SPIN_SLOTS`;
/// which word is `smclo::spin`'s choice), holding the CLOCK_MONOTONIC nanosecond until which a
/// thread that spins may hold it, 0 when free (`smclo::spin`).
pub const SPIN_SLOTS: usize = 128;

const _: () = assert!(off::SPINNERS + SPIN_SLOTS * 8 <= HEADER_LEN as usize);
const _: () = assert!(off::PORT_FILTER + PORT_FILTER_WORDS * 8 <= off::SPINNERS);

/// Counters per side for fallbacks by reason (indexed by `Reason::index()`).
pub const REASON_SLOTS: u32 = 32;

/// Total size of the device file.
pub const TOTAL_SIZE: u64 =
    FALLBACK_OFF as u64 + FALLBACK_ENTRIES as u64 * FALLBACK_ENTRY_LEN as u64;

/// Bits of a DMB table entry's `flags` word: how the connection end moves
/// data and how far it has closed (`smclo ss` derives SMC's socket states
/// from both ends' flags).
pub mod end_flags {
    /// The end writes through a private send buffer (copy mode).
    pub const COPY: u64 = 1 << 0;
    /// The end shut down writing (`PEER_DONE_WRITING` sent).
    pub const SHUT_WR: u64 = 1 << 1;
    /// ... after the peer had done so (passive close).
    pub const SHUT_WR_PASSIVE: u64 = 1 << 2;
    /// The end closed the connection.
    pub const CLOSED: u64 = 1 << 3;
    /// The end aborted the connection (`PEER_CONN_ABORT` sent).
    pub const ABORTED: u64 = 1 << 4;
    /// The end saw its peer's abort (`PEER_CONN_ABORT` received).
    pub const PEER_ABORTED: u64 = 1 << 5;
}

/// Header field offsets (bytes from the start of the file).
pub mod off {
    /// `magic`.
    pub const MAGIC: usize = 0;
    /// `version`.
    pub const VERSION: usize = 8;
    /// `header_len`.
    pub const HEADER_LEN: usize = 12;
    /// `total_size`.
    pub const TOTAL_SIZE: usize = 16;
    /// DMB table triple.
    pub const DMB_TABLE: usize = 24;
    /// Listener table triple.
    pub const LISTENER_TABLE: usize = 36;
    /// Rendezvous table triple.
    pub const RENDEZVOUS_TABLE: usize = 48;
    /// `reason_slots`.
    pub const REASON_SLOTS: usize = 60;
    /// `gid`.
    pub const GID: usize = 64;
    /// `chid`.
    pub const CHID: usize = 72;
    /// `seid`.
    pub const SEID: usize = 80;
    /// Fallback table triple.
    pub const FALLBACK_TABLE: usize = 112;
    /// Knob `active`.
    pub const ACTIVE: usize = 128;
    /// Knob `dmb_copy`.
    pub const DMB_COPY: usize = 132;
    /// Knob `dmb_type`.
    pub const DMB_TYPE: usize = 136;
    /// Counter `conns_opened`.
    pub const CONNS_OPENED: usize = 192;
    /// Counter `dmbs_registered`.
    pub const DMBS_REGISTERED: usize = 200;
    /// Counter `xfer_bytes_retired` (tx bytes of freed DMB table entries).
    pub const XFER_RETIRED: usize = 208;
    /// `xfer_bytes` value at the last `stats reset`.
    pub const XFER_BASE: usize = 216;
    /// Milliseconds (CLOCK_MONOTONIC) of the last dead-owner sweep.
    pub const LAST_SWEEP_MS: usize = 224;
    /// Sequence of byte-count moves into `xfer_bytes_retired`: odd while
    /// one is under way, so a reader can tell a consistent sum.
    pub const XFER_SEQ: usize = 232;
    /// Client-side fallbacks by reason.
    pub const FALLBACK_CLIENT: usize = 256;
    /// Server-side fallbacks by reason.
    pub const FALLBACK_SERVER: usize = 512;
    /// The announcement map ([`super::ANNOUNCED_WORDS`] words).
    pub const ANNOUNCED: usize = 768;
    /// The decline filter ([`super::DECLINE_FILTER_WORDS`] words).
    pub const DECLINE_FILTER: usize = 784;
    /// The listener port filter ([`super::PORT_FILTER_WORDS`] words).
    pub const PORT_FILTER: usize = 1024;
    /// The spinner slots ([`super::SPIN_SLOTS`] words).
    pub const SPINNERS: usize = 3072;
}

/// The fixed, validated part of the device header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHeader {
    /// The device's GID (random, not 0).
    pub gid: u64,
    /// The device's CHID (0xFFFF for loopback-ism).
    pub chid: u16,
    /// The SEID, 32 bytes blank padded.
    pub seid: [u8; 32],
}

/// Why a device header was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// Fewer bytes than the header needs.
    Truncated {
        /// Bytes available.
        have: u64,
        /// Bytes needed.
        need: u64,
    },
    /// The first 8 bytes are not `SMCLODEV`.
    BadMagic([u8; 8]),
    /// A version this code does not understand.
    Version(u32),
    /// A size or table geometry differs from this version's.
    Geometry {
        /// Which field.
        field: &'static str,
        /// Value found.
        found: u64,
        /// Value expected.
        expected: u64,
    },
    /// GID 0 is never generated.
    ZeroGid,
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::Truncated { have, need } => {
                write!(f, "file is truncated: {have} bytes, expected {need}")
            }
            LayoutError::BadMagic(m) => write!(
                f,
                "bad magic {:?} (expected {:?}): not an smclo device file",
                String::from_utf8_lossy(m),
                String::from_utf8_lossy(&MAGIC)
            ),
            LayoutError::Version(v) => write!(
                f,
                "layout version {v}, this smclo understands version {VERSION}: \
                 the device was created by another smclo version (remove the device directory \
                 when no smclo process runs)"
            ),
            LayoutError::Geometry {
                field,
                found,
                expected,
            } => {
                write!(f, "{field} is {found}, expected {expected}")
            }
            LayoutError::ZeroGid => write!(f, "GID is 0 (never generated): file is corrupted"),
        }
    }
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_ne_bytes(a)
}

/// The header bytes (first [`HEADER_LEN`] bytes) of a freshly created device.
///
/// Knobs get their defaults (`active` 1, `dmb_copy` 0, `dmb_type` 0), counters
/// are zero. The tables after the header are all zero (every entry free).
pub fn encode_header(h: &DeviceHeader) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN as usize];
    let put32 = |b: &mut Vec<u8>, o: usize, v: u32| b[o..o + 4].copy_from_slice(&v.to_ne_bytes());
    b[off::MAGIC..off::MAGIC + 8].copy_from_slice(&MAGIC);
    put32(&mut b, off::VERSION, VERSION);
    put32(&mut b, off::HEADER_LEN, HEADER_LEN);
    b[off::TOTAL_SIZE..off::TOTAL_SIZE + 8].copy_from_slice(&TOTAL_SIZE.to_ne_bytes());
    for (o, t) in [
        (off::DMB_TABLE, [DMB_TABLE_OFF, DMB_ENTRIES, DMB_ENTRY_LEN]),
        (
            off::LISTENER_TABLE,
            [LISTENER_OFF, LISTENER_ENTRIES, LISTENER_ENTRY_LEN],
        ),
        (
            off::RENDEZVOUS_TABLE,
            [RENDEZVOUS_OFF, RENDEZVOUS_ENTRIES, RENDEZVOUS_ENTRY_LEN],
        ),
        (
            off::FALLBACK_TABLE,
            [FALLBACK_OFF, FALLBACK_ENTRIES, FALLBACK_ENTRY_LEN],
        ),
    ] {
        for (i, v) in t.iter().enumerate() {
            put32(&mut b, o + 4 * i, *v);
        }
    }
    put32(&mut b, off::REASON_SLOTS, REASON_SLOTS);
    b[off::GID..off::GID + 8].copy_from_slice(&h.gid.to_ne_bytes());
    b[off::CHID..off::CHID + 2].copy_from_slice(&h.chid.to_ne_bytes());
    b[off::SEID..off::SEID + 32].copy_from_slice(&h.seid);
    put32(&mut b, off::ACTIVE, 1);
    b
}

/// Validates the header of a device file whose total length is `file_len`.
///
/// `bytes` are the first bytes of the file (at least [`HEADER_LEN`] of them
/// for a valid file). Checks magic, version, every size and table geometry,
/// so that a mapping of `file_len` bytes covers every offset used later.
pub fn validate_header(bytes: &[u8], file_len: u64) -> Result<DeviceHeader, LayoutError> {
    if bytes.len() < 8 || file_len < 8 {
        return Err(LayoutError::Truncated {
            have: file_len.min(bytes.len() as u64),
            need: TOTAL_SIZE,
        });
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&bytes[..8]);
    if magic != MAGIC {
        return Err(LayoutError::BadMagic(magic));
    }
    if bytes.len() < HEADER_LEN as usize {
        return Err(LayoutError::Truncated {
            have: bytes.len() as u64,
            need: TOTAL_SIZE,
        });
    }
    let version = u32_at(bytes, off::VERSION);
    if version != VERSION {
        return Err(LayoutError::Version(version));
    }
    let geo = |field: &'static str, found: u64, expected: u64| {
        if found == expected {
            Ok(())
        } else {
            Err(LayoutError::Geometry {
                field,
                found,
                expected,
            })
        }
    };
    geo(
        "header_len",
        u32_at(bytes, off::HEADER_LEN) as u64,
        HEADER_LEN as u64,
    )?;
    geo("total_size", u64_at(bytes, off::TOTAL_SIZE), TOTAL_SIZE)?;
    if file_len != TOTAL_SIZE {
        return if file_len < TOTAL_SIZE {
            Err(LayoutError::Truncated {
                have: file_len,
                need: TOTAL_SIZE,
            })
        } else {
            Err(LayoutError::Geometry {
                field: "file size",
                found: file_len,
                expected: TOTAL_SIZE,
            })
        };
    }
    let tables: [(&'static str, usize, [u32; 3]); 4] = [
        (
            "dmb table",
            off::DMB_TABLE,
            [DMB_TABLE_OFF, DMB_ENTRIES, DMB_ENTRY_LEN],
        ),
        (
            "listener table",
            off::LISTENER_TABLE,
            [LISTENER_OFF, LISTENER_ENTRIES, LISTENER_ENTRY_LEN],
        ),
        (
            "rendezvous table",
            off::RENDEZVOUS_TABLE,
            [RENDEZVOUS_OFF, RENDEZVOUS_ENTRIES, RENDEZVOUS_ENTRY_LEN],
        ),
        (
            "fallback table",
            off::FALLBACK_TABLE,
            [FALLBACK_OFF, FALLBACK_ENTRIES, FALLBACK_ENTRY_LEN],
        ),
    ];
    for (name, o, want) in tables {
        let have = [u32_at(bytes, o), u32_at(bytes, o + 4), u32_at(bytes, o + 8)];
        if have != want {
            return Err(LayoutError::Geometry {
                field: name,
                found: ((have[0] as u64) << 32) | have[1] as u64,
                expected: ((want[0] as u64) << 32) | want[1] as u64,
            });
        }
    }
    geo(
        "reason_slots",
        u32_at(bytes, off::REASON_SLOTS) as u64,
        REASON_SLOTS as u64,
    )?;
    let gid = u64_at(bytes, off::GID);
    if gid == 0 {
        return Err(LayoutError::ZeroGid);
    }
    let chid = u16::from_ne_bytes([bytes[off::CHID], bytes[off::CHID + 1]]);
    let mut seid = [0u8; 32];
    seid.copy_from_slice(&bytes[off::SEID..off::SEID + 32]);
    Ok(DeviceHeader { gid, chid, seid })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> DeviceHeader {
        DeviceHeader {
            gid: 0x1234_5678_9abc_def0,
            chid: 0xffff,
            seid: [b' '; 32],
        }
    }

    #[test]
    fn roundtrip() {
        let b = encode_header(&hdr());
        assert_eq!(validate_header(&b, TOTAL_SIZE), Ok(hdr()));
    }

    #[test]
    fn tables_fit_and_align() {
        const {
            assert!(
                LISTENER_OFF.is_multiple_of(64)
                    && RENDEZVOUS_OFF.is_multiple_of(64)
                    && FALLBACK_OFF.is_multiple_of(64)
            )
        };
        const {
            assert!(
                off::FALLBACK_TABLE + 12 <= off::ACTIVE && off::SEID + 32 <= off::FALLBACK_TABLE
            )
        };
        assert!(MSG_AREA_OFF[2] + MSG_AREA_LEN <= RENDEZVOUS_ENTRY_LEN);
        assert!(off::FALLBACK_SERVER + 8 * REASON_SLOTS as usize <= HEADER_LEN as usize);
    }

    #[test]
    fn rejects_every_kind_of_damage() {
        let good = encode_header(&hdr());
        assert!(matches!(
            validate_header(&good[..4], 4),
            Err(LayoutError::Truncated { .. })
        ));
        assert!(matches!(
            validate_header(&good[..100], 100),
            Err(LayoutError::Truncated { .. })
        ));
        assert!(matches!(
            validate_header(&good, TOTAL_SIZE - 1),
            Err(LayoutError::Truncated { .. })
        ));
        assert!(matches!(
            validate_header(&good, TOTAL_SIZE + 1),
            Err(LayoutError::Geometry { .. })
        ));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(
            validate_header(&b, TOTAL_SIZE),
            Err(LayoutError::BadMagic(_))
        ));
        let mut b = good.clone();
        b[off::VERSION] = VERSION as u8 + 1;
        assert_eq!(
            validate_header(&b, TOTAL_SIZE),
            Err(LayoutError::Version(VERSION + 1))
        );
        let mut b = good.clone();
        b[off::LISTENER_TABLE + 4] ^= 1;
        assert!(matches!(
            validate_header(&b, TOTAL_SIZE),
            Err(LayoutError::Geometry { .. })
        ));
        let mut b = good.clone();
        b[off::GID..off::GID + 8].fill(0);
        assert_eq!(validate_header(&b, TOTAL_SIZE), Err(LayoutError::ZeroGid));
        // Arbitrary garbage never panics.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 1, 7, 8, 9, 4095, 4096, 5000] {
            let g: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            assert!(validate_header(&g, len as u64).is_err());
        }
    }
}
