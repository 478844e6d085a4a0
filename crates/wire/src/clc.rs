//! CLC messages: the SMC-D handshake (Proposal, Accept, Confirm, Decline).
//!
//! smclo exchanges these through a rendezvous slot in the shared device,
//! never through the TCP stream, but keeps SMC's byte layout (Linux
//! `net/smc/smc_clc.h`, SMC-Dv2 with an emulated-ISM device) so that the
//! messages read like SMC's in a hex dump. All integers are big-endian.
//!
//! Every message is framed as in SMC:
//!
//! ```text
//! 0  eyecatcher [4]   "SMCR" in EBCDIC (E2 D4 C3 D9) for Proposal and Decline,
//!                     "SMCD" (E2 D4 C3 C4) for Accept and Confirm
//! 4  type u8          1 Proposal, 2 Accept, 3 Confirm, 4 Decline
//! 5  length __be16    whole message, header and trailer included
//! 7  version<<4 | typev2<<2 | typev1
//!    ...body...
//! -4 eyecatcher [4]   the same as in the header
//! ```
//!
//! The bytes come from another process that is not trusted, so
//! [`ClcMsg::parse`] checks every byte: the length must be exactly the size
//! computed from the message's contents, and every byte is either a field or
//! has one allowed value (zero for reserved bytes). As a consequence a
//! message that parses re-encodes to exactly the same bytes.
//!
//! Where SMC has no field for something smclo needs (the SYN mark, the
//! client's DMB token and process identity), the Proposal carries it in
//! bytes that a loopback-only SMC proposal leaves zero; see [`Proposal`].

use std::fmt;

use crate::dmb_header::{MAX_RING_LEN, MIN_RING_LEN};
use crate::reason::Reason;

/// "SMCR" in EBCDIC: the eyecatcher of Proposal and Decline.
pub const EYECATCHER_SMCR: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xD9];
/// "SMCD" in EBCDIC: the eyecatcher of SMC-D Accept and Confirm.
pub const EYECATCHER_SMCD: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xC4];

/// The only CLC version smclo sends and accepts (SMCv2).
pub const VERSION: u8 = 2;
/// Header size: eyecatcher, type, length, version/type byte.
pub const HEADER_LEN: usize = 8;
/// Trailer size: the closing eyecatcher.
pub const TRAILER_LEN: usize = 4;
/// Most user-defined EIDs (UEIDs) a Proposal may carry (SMC's limit).
pub const MAX_UEIDS: usize = 8;
/// Length of an EID (SEID or UEID), as in SMC.
pub const EID_LEN: usize = 32;
/// Size of a Proposal without UEIDs; each UEID adds [`EID_LEN`] bytes.
pub const PROPOSAL_BASE_LEN: usize = 192;
/// Size of an Accept or a Confirm (SMC-Dv2 without first-contact extension).
pub const ACCEPT_CONFIRM_LEN: usize = 78;
/// Size of a Decline (SMCv2 layout).
pub const DECLINE_LEN: usize = 44;
/// Largest encoded size of any CLC message (a Proposal with 8 UEIDs); a
/// buffer of this size holds every message.
pub const MAX_LEN: usize = PROPOSAL_BASE_LEN + MAX_UEIDS * EID_LEN;
/// The CHID of a loopback-ism device (SMC reserves 0xFFxx for emulated ISM).
pub const CHID_LOOPBACK: u16 = 0xFFFF;
/// Largest compressed DMB size for SMC-D: 6 means 1 MiB.
pub const MAX_SIZE_COMP: u8 = 6;
/// Compressed size 0 is the smallest ring, `1 << MIN_RING_SHIFT` bytes.
const MIN_RING_SHIFT: u32 = MIN_RING_LEN.trailing_zeros();
const _: () = assert!(MIN_RING_LEN << MAX_SIZE_COMP == MAX_RING_LEN);
/// `os_type` of Linux in a Decline.
pub const OS_TYPE_LINUX: u8 = 2;

/// Header byte 7 of a loopback-only Proposal: version 2, typev2 D, typev1 N.
pub const PROPOSAL_TYPE_BYTE: u8 = (VERSION << 4) | (1 << 2) | 2;
/// Header byte 7 of an Accept or Confirm: version 2, typev1 D, no first
/// contact (smclo has no link-group setup to announce).
pub const ACCEPT_CONFIRM_TYPE_BYTE: u8 = (VERSION << 4) | 1;
/// Header byte 7 of a Decline: version 2; SMC adds the first-contact bit
/// (typev2 0b10, i.e. 0x08) when the reason is SYNCERR.
pub const DECLINE_TYPE_BYTE: u8 = VERSION << 4;
/// SMC's first-contact flag as it appears in header byte 7.
pub const FIRST_CONTACT_BIT: u8 = 0b10 << 2;

// Proposal layout (offsets from the start of the message); n = UEID count.
const P_ID_FOR_PEER: usize = 8; // lcl.id_for_peer[8]: the GID again
const P_TOKEN: usize = 16; // lcl.gid[16] (SMC-R only) -> smclo: token, nonce
const P_NONCE: usize = 24;
const P_MARK_TTL: usize = 32; // lcl.mac[6] (SMC-R only) -> smclo: mark, size
const P_MARK_TOS: usize = 33;
const P_SIZE: usize = 34;
const P_LCL_RSVD: usize = 35; // 3 bytes
const P_IPAREA_OFF: usize = 38;
const P_ISM_GID: usize = 40; // V1 ISM gid/chid, unused by a V2-only proposal
const P_ISM_CHID: usize = 48;
const P_V2_EXT_OFF: usize = 50;
const P_VENDOR: usize = 52; // vendor_oui[3] + vendor_exp_options[5]
const P_PID: usize = 60; // reserved[20] -> smclo: pid, start_time, netns
const P_START_TIME: usize = 64;
const P_NETNS: usize = 72;
const P_EID_CNT: usize = 80;
const P_ISM_GID_CNT: usize = 81;
const P_RSVD1: usize = 82;
const P_FLAG: usize = 83;
const P_RSVD2: usize = 84; // 2 bytes
const P_SMCD_V2_OFF: usize = 86;
const P_ROCE: usize = 88; // roce[16], max_conns, max_links: SMC-R only
const P_FEATURE: usize = 106;
const P_V2_RSVD: usize = 108; // 12 bytes
const P_UEIDS: usize = 120;
// Relative to the end of the UEIDs (120 + 32 n):
const PD_SEID: usize = 0;
const PD_RSVD: usize = 32; // 16 bytes
const PD_GIDCHID0: usize = 48; // gid u64, chid u16
const PD_GIDCHID1: usize = 58; // gid_ext u64, chid u16

/// `v2_ext_offset` in a proposal without IP prefix area (SMC: 28).
const V2_EXT_OFFSET: u16 = 28;
/// V2 extension flag byte: release 1 (SMCv2.1) in the high nibble, SEID
/// present in bit 0.
const V2_FLAG: u8 = 0x11;
/// SMC_SPF_EMULATED_ISM_DEV.
const FEATURE_MASK: u16 = 0x0001;
/// GID/CHID entries an emulated-ISM device takes in the SMC-Dv2 extension.
const ISM_GID_CNT: u8 = 2;

// Accept / Confirm layout.
const A_GID: usize = 8;
const A_TOKEN: usize = 16;
const A_DMBE_IDX: usize = 24;
const A_SIZE: usize = 25;
const A_RSVD4: usize = 26; // 2 bytes
const A_LINKID: usize = 28;
const A_CHID: usize = 32;
const A_EID: usize = 34; // 32 bytes, zero: smclo does not echo the EID
const A_GID_EXT: usize = 66;

// Decline layout.
const D_ID_FOR_PEER: usize = 8;
const D_DIAG: usize = 16;
const D_OS_TYPE: usize = 20;
const D_RSVD: usize = 21; // 3 bytes
const D_DIAG_V2: usize = 24; // 16 bytes, zero

/// The four CLC message types, with SMC's type numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    /// Client → server: what the client offers.
    Proposal = 1,
    /// Server → client: the server's DMB.
    Accept = 2,
    /// Client → server: the client's DMB.
    Confirm = 3,
    /// Either side: no SMC-D for this connection, with a reason.
    Decline = 4,
}

impl MsgType {
    /// The type with this SMC type number, if any.
    pub fn from_u8(t: u8) -> Option<MsgType> {
        match t {
            1 => Some(MsgType::Proposal),
            2 => Some(MsgType::Accept),
            3 => Some(MsgType::Confirm),
            4 => Some(MsgType::Decline),
            _ => None,
        }
    }

    /// The eyecatcher SMC uses for this type (header and trailer).
    pub fn eyecatcher(self) -> [u8; 4] {
        match self {
            MsgType::Proposal | MsgType::Decline => EYECATCHER_SMCR,
            MsgType::Accept | MsgType::Confirm => EYECATCHER_SMCD,
        }
    }

    /// Lower-case name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            MsgType::Proposal => "proposal",
            MsgType::Accept => "accept",
            MsgType::Confirm => "confirm",
            MsgType::Decline => "decline",
        }
    }
}

impl fmt::Display for MsgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes are not a valid CLC message. Every variant names the value it
/// found, so that a log line is enough to see what the peer sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClcError {
    /// Fewer bytes than a header.
    Truncated {
        /// Bytes present.
        len: usize,
    },
    /// Type byte is not 1..=4.
    BadType(u8),
    /// Header or trailer eyecatcher is not the one of this message type.
    BadEyecatcher {
        /// The message type from the header.
        kind: MsgType,
        /// `"header"` or `"trailer"`.
        place: &'static str,
        /// The four bytes found.
        found: [u8; 4],
    },
    /// Version nibble is not [`VERSION`].
    BadVersion(u8),
    /// The length field does not match the number of bytes given.
    LengthField {
        /// Value of the length field.
        field: u16,
        /// Bytes given.
        actual: usize,
    },
    /// An Accept, Confirm or Decline whose length is not its fixed size.
    WrongLength {
        /// The message type.
        kind: MsgType,
        /// The length.
        length: usize,
        /// The only valid length for this type.
        expected: usize,
    },
    /// A Proposal shorter than one without UEIDs.
    ProposalTooShort {
        /// The length.
        length: usize,
    },
    /// A Proposal announcing more than [`MAX_UEIDS`] UEIDs.
    TooManyUeids(u8),
    /// A Proposal whose length does not match its UEID count.
    ProposalLength {
        /// The length.
        length: usize,
        /// The UEID count it announces.
        ueids: u8,
        /// The size of a proposal with that many UEIDs.
        expected: usize,
    },
    /// Header byte 7 (version, typev2, typev1) is not the one smclo sends
    /// for this message.
    BadTypeByte {
        /// The message type.
        kind: MsgType,
        /// The byte found.
        found: u8,
        /// The byte required.
        expected: u8,
    },
    /// A compressed DMB size above [`MAX_SIZE_COMP`].
    BadSizeComp {
        /// The message type.
        kind: MsgType,
        /// The value found.
        comp: u8,
    },
    /// A field with one allowed value holds another.
    BadField {
        /// The message type.
        kind: MsgType,
        /// SMC's name of the field.
        field: &'static str,
        /// The value found.
        found: u64,
        /// The value required.
        expected: u64,
    },
    /// A reserved byte is not zero.
    NonZero {
        /// The message type.
        kind: MsgType,
        /// SMC's name of the reserved area.
        field: &'static str,
        /// Offset of the first non-zero byte in the message.
        offset: usize,
        /// Its value.
        value: u8,
    },
    /// The Proposal's TOS mark has ECN bits set; the mark is DSCP only.
    MarkEcn(u8),
}

impl fmt::Display for ClcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ClcError::Truncated { len } => {
                write!(f, "CLC message of {len} bytes is shorter than its {HEADER_LEN}-byte header")
            }
            ClcError::BadType(t) => write!(
                f,
                "CLC type {t} is not 1 (proposal), 2 (accept), 3 (confirm) or 4 (decline)"
            ),
            ClcError::BadEyecatcher { kind, place, found } => {
                let e = kind.eyecatcher();
                let name = if e == EYECATCHER_SMCR { "SMCR" } else { "SMCD" };
                write!(
                    f,
                    "CLC {kind} {place} eyecatcher is {}, expected {} (\"{name}\" in EBCDIC)",
                    hex(&found),
                    hex(&e)
                )
            }
            ClcError::BadVersion(v) => {
                write!(f, "CLC version {v}, but smclo speaks only version {VERSION}")
            }
            ClcError::LengthField { field, actual } => {
                write!(f, "CLC length field says {field} but the message has {actual} bytes")
            }
            ClcError::WrongLength { kind, length, expected } => {
                write!(f, "CLC length {length} but {kind} is {expected} bytes")
            }
            ClcError::ProposalTooShort { length } => write!(
                f,
                "CLC length {length} but proposal is at least {PROPOSAL_BASE_LEN} bytes"
            ),
            ClcError::TooManyUeids(n) => {
                write!(f, "CLC proposal has {n} UEIDs, at most {MAX_UEIDS} are allowed")
            }
            ClcError::ProposalLength { length, ueids, expected } => write!(
                f,
                "CLC length {length} but proposal with {ueids} UEIDs is {expected} bytes"
            ),
            ClcError::BadTypeByte { kind, found, expected } => write!(
                f,
                "CLC {kind} header byte 7 (version/type) is 0x{found:02x}, expected 0x{expected:02x}"
            ),
            ClcError::BadSizeComp { kind, comp } => write!(
                f,
                "CLC {kind} DMB size code {comp} is above {MAX_SIZE_COMP} (1 MiB)"
            ),
            ClcError::BadField { kind, field, found, expected } => {
                write!(f, "CLC {kind} field {field} is {found:#x}, expected {expected:#x}")
            }
            ClcError::NonZero { kind, field, offset, value } => write!(
                f,
                "CLC {kind} reserved byte {offset} ({field}) is 0x{value:02x}, must be zero"
            ),
            ClcError::MarkEcn(tos) => write!(
                f,
                "CLC proposal mark TOS 0x{tos:02x} has ECN bits set (the mark is DSCP only)"
            ),
        }
    }
}

impl std::error::Error for ClcError {}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Compressed DMB size as SMC computes it (`smc_compress_bufsize` for
/// SMC-D): 0 for up to 16 KiB, then `ilog2((size - 1) >> 14) + 1`, at most
/// [`MAX_SIZE_COMP`] (1 MiB). Rounds up: the result is never smaller than
/// `bytes`, except that sizes above 1 MiB give 1 MiB.
pub fn size_comp(bytes: u32) -> u8 {
    if bytes <= MIN_RING_LEN {
        return 0;
    }
    let c = ((bytes - 1) >> MIN_RING_SHIFT).ilog2() + 1;
    c.min(MAX_SIZE_COMP as u32) as u8
}

/// DMB size in bytes of a compressed size: `1 << (comp + 14)`, 16 KiB for 0
/// up to 1 MiB for 6. Codes above [`MAX_SIZE_COMP`] (which [`ClcMsg::parse`]
/// rejects) are clamped to it, so the result is always a valid ring size.
pub fn size_uncomp(comp: u8) -> u32 {
    MIN_RING_LEN << comp.min(MAX_SIZE_COMP)
}

/// Client → server: "I want SMC-D for this connection; here is my device,
/// my DMB, and how to prove the SYN is mine".
///
/// Layout: SMC's loopback-only proposal (typev1 N, typev2 D), `192 + 32 n`
/// bytes for n UEIDs: base part, SMC-D area, V2 extension with the UEIDs,
/// SMC-Dv2 extension with the SEID and one emulated-ISM device as two
/// GID/CHID entries (`gid, chid` then `gid_ext = 0, chid`: smclo GIDs are 64
/// bits), trailer.
///
/// smclo extension fields, in bytes SMC leaves zero in a loopback-only
/// proposal:
///
/// | offset | SMC field (unused here) | smclo field |
/// | --- | --- | --- |
/// | 16 | `lcl.gid[0..8]` (SMC-R) | `token` |
/// | 24 | `lcl.gid[8..16]` (SMC-R) | `nonce` |
/// | 32 | `lcl.mac[0]` (SMC-R) | `mark_ttl` |
/// | 33 | `lcl.mac[1]` | `mark_tos` |
/// | 34 | `lcl.mac[2]` | `dmbe_size_comp` |
/// | 35..38 | `lcl.mac[3..6]` | zero |
/// | 60 | `smcd.reserved[0..4]` | `pid` |
/// | 64 | `smcd.reserved[4..12]` | `start_time` |
/// | 72 | `smcd.reserved[12..20]` | `netns` |
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Proposal {
    /// The client's device GID (first GID/CHID entry; also `id_for_peer`).
    pub gid: u64,
    /// The client's device CHID ([`CHID_LOOPBACK`]).
    pub chid: u16,
    /// System EID (from the machine id), compared with the server's.
    pub seid: [u8; EID_LEN],
    /// User-defined EIDs (`SMCLO_UEID`), at most [`MAX_UEIDS`].
    pub ueids: Vec<[u8; EID_LEN]>,
    /// smclo: IP TTL / hop limit the client puts into its SYN.
    pub mark_ttl: u8,
    /// smclo: TOS / traffic class byte the client puts into its SYN; DSCP
    /// bits only, the two ECN bits must be zero.
    pub mark_tos: u8,
    /// smclo: the client's DMB token (its receive ring).
    pub token: u64,
    /// smclo: the client's DMB size, compressed ([`size_comp`]), `<= 6`.
    pub dmbe_size_comp: u8,
    /// smclo: names the client's UNIX rendezvous socket `u-<nonce:016x>`.
    pub nonce: u64,
    /// smclo: client process id, with `start_time` for liveness checks.
    pub pid: u32,
    /// smclo: client process start time (clock ticks since boot).
    pub start_time: u64,
    /// smclo: inode of the client's network namespace.
    pub netns: u64,
}

/// Server → client: "yes; write into my DMB `token`".
///
/// Layout: SMC-Dv2 accept without first-contact extension, 78 bytes: `gid`,
/// `token`, `dmbe_idx` (0), size byte (`dmbe_size_comp << 4`), 2 reserved,
/// `linkid`, `chid`, `eid[32]` (zero), `gid_ext` (zero), trailer "SMCD".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Accept {
    /// The server's device GID.
    pub gid: u64,
    /// The server's DMB token.
    pub token: u64,
    /// The server's DMB size, compressed ([`size_comp`]), `<= 6`.
    pub dmbe_size_comp: u8,
    /// Link (group) id chosen by the server.
    pub linkid: u32,
    /// The server's device CHID.
    pub chid: u16,
}

/// Client → server: "done; write into my DMB `token`". Same layout as
/// [`Accept`], type 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Confirm {
    /// The client's device GID.
    pub gid: u64,
    /// The client's DMB token (the one from the Proposal).
    pub token: u64,
    /// The client's DMB size, compressed ([`size_comp`]), `<= 6`.
    pub dmbe_size_comp: u8,
    /// The link id from the Accept.
    pub linkid: u32,
    /// The client's device CHID.
    pub chid: u16,
}

/// Either side: "no SMC-D for this connection", with a reason.
///
/// Layout: SMCv2 decline, 44 bytes: `id_for_peer[8]`, `peer_diagnosis`,
/// `os_type` 2 (Linux) in the high nibble, 3 reserved, 16 reserved
/// (`peer_diagnosis_v2`), trailer "SMCR". Header byte 7 carries SMC's
/// first-contact bit exactly when the diagnosis is SYNCERR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decline {
    /// Sender's identity: its GID, big-endian.
    pub id_for_peer: [u8; 8],
    /// The reason code ([`Reason::code`]). Unknown codes are kept as they
    /// are (the peer may be newer), see [`Decline::reason`].
    pub peer_diagnosis: u32,
}

impl Decline {
    /// A Decline from the device `gid` for `reason`.
    pub fn new(gid: u64, reason: Reason) -> Decline {
        Decline {
            id_for_peer: gid.to_be_bytes(),
            peer_diagnosis: reason.code(),
        }
    }

    /// The reason, if smclo knows the code.
    pub fn reason(&self) -> Option<Reason> {
        Reason::from_code(self.peer_diagnosis)
    }

    /// Header byte 7 for this decline.
    fn type_byte(&self) -> u8 {
        if self.peer_diagnosis == Reason::SyncErr.code() {
            DECLINE_TYPE_BYTE | FIRST_CONTACT_BIT
        } else {
            DECLINE_TYPE_BYTE
        }
    }
}

/// Any CLC message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClcMsg {
    /// See [`Proposal`].
    Proposal(Proposal),
    /// See [`Accept`].
    Accept(Accept),
    /// See [`Confirm`].
    Confirm(Confirm),
    /// See [`Decline`].
    Decline(Decline),
}

// ---------------------------------------------------------------- encoding

fn put_u16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_be_bytes());
}
fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
fn put_u64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Zeroes `out[..len]` and writes header and trailer.
fn frame(out: &mut [u8], kind: MsgType, len: usize, type_byte: u8) {
    assert!(
        out.len() >= len,
        "CLC {kind} needs {len} bytes, buffer has {}",
        out.len()
    );
    out[..len].fill(0);
    let eye = kind.eyecatcher();
    out[..4].copy_from_slice(&eye);
    out[4] = kind as u8;
    put_u16(out, 5, len as u16);
    out[7] = type_byte;
    out[len - TRAILER_LEN..len].copy_from_slice(&eye);
}

impl Proposal {
    /// Encoded size: `192 + 32 * ueids.len()`.
    pub fn encoded_len(&self) -> usize {
        PROPOSAL_BASE_LEN + self.ueids.len() * EID_LEN
    }

    /// Writes the message into `out[..encoded_len()]` and returns its length.
    ///
    /// # Panics
    ///
    /// If there are more than [`MAX_UEIDS`] UEIDs, or `out` is too short:
    /// both are the caller's bugs (configuration must be bounded earlier).
    /// The other fields are written as they are; a `dmbe_size_comp` above 6
    /// or a `mark_tos` with ECN bits encodes but will not parse.
    pub fn encode(&self, out: &mut [u8]) -> usize {
        let n = self.ueids.len();
        assert!(
            n <= MAX_UEIDS,
            "CLC proposal with {n} UEIDs, at most {MAX_UEIDS} allowed"
        );
        let len = self.encoded_len();
        frame(out, MsgType::Proposal, len, PROPOSAL_TYPE_BYTE);
        put_u64(out, P_ID_FOR_PEER, self.gid);
        put_u64(out, P_TOKEN, self.token);
        put_u64(out, P_NONCE, self.nonce);
        out[P_MARK_TTL] = self.mark_ttl;
        out[P_MARK_TOS] = self.mark_tos;
        out[P_SIZE] = self.dmbe_size_comp;
        put_u16(out, P_V2_EXT_OFF, V2_EXT_OFFSET);
        put_u32(out, P_PID, self.pid);
        put_u64(out, P_START_TIME, self.start_time);
        put_u64(out, P_NETNS, self.netns);
        out[P_EID_CNT] = n as u8;
        out[P_ISM_GID_CNT] = ISM_GID_CNT;
        out[P_FLAG] = V2_FLAG;
        put_u16(out, P_SMCD_V2_OFF, smcd_v2_ext_offset(n));
        put_u16(out, P_FEATURE, FEATURE_MASK);
        for (i, u) in self.ueids.iter().enumerate() {
            let at = P_UEIDS + i * EID_LEN;
            out[at..at + EID_LEN].copy_from_slice(u);
        }
        let d = P_UEIDS + n * EID_LEN;
        out[d + PD_SEID..d + PD_SEID + EID_LEN].copy_from_slice(&self.seid);
        put_u64(out, d + PD_GIDCHID0, self.gid);
        put_u16(out, d + PD_GIDCHID0 + 8, self.chid);
        put_u16(out, d + PD_GIDCHID1 + 8, self.chid);
        len
    }

    /// The encoded message.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = vec![0; self.encoded_len()];
        self.encode(&mut v);
        v
    }
}

/// SMC's `smcd_v2_ext_offset`: from the end of that field to the SMC-Dv2
/// extension, i.e. the rest of the V2 extension plus the UEIDs.
fn smcd_v2_ext_offset(ueids: usize) -> u16 {
    (P_UEIDS - (P_SMCD_V2_OFF + 2) + ueids * EID_LEN) as u16
}

/// Shared by Accept and Confirm, which differ only in their type.
fn encode_accept_confirm(
    out: &mut [u8],
    kind: MsgType,
    gid: u64,
    token: u64,
    comp: u8,
    linkid: u32,
    chid: u16,
) -> usize {
    frame(out, kind, ACCEPT_CONFIRM_LEN, ACCEPT_CONFIRM_TYPE_BYTE);
    put_u64(out, A_GID, gid);
    put_u64(out, A_TOKEN, token);
    // The high nibble only: the low one is reserved.
    out[A_SIZE] = comp << 4;
    put_u32(out, A_LINKID, linkid);
    put_u16(out, A_CHID, chid);
    ACCEPT_CONFIRM_LEN
}

/// Accept and Confirm have one layout and differ only in their type, so
/// their encoders are one piece of code.
macro_rules! accept_confirm_encoding {
    ($ty:ident) => {
        impl $ty {
            /// Encoded size: [`ACCEPT_CONFIRM_LEN`].
            pub fn encoded_len(&self) -> usize {
                ACCEPT_CONFIRM_LEN
            }

            /// Writes the message into `out[..78]` and returns 78.
            ///
            /// # Panics
            ///
            /// If `out` is shorter than 78 bytes. A `dmbe_size_comp` above 15
            /// loses its high bits; above 6 it encodes but does not parse.
            pub fn encode(&self, out: &mut [u8]) -> usize {
                encode_accept_confirm(
                    out,
                    MsgType::$ty,
                    self.gid,
                    self.token,
                    self.dmbe_size_comp,
                    self.linkid,
                    self.chid,
                )
            }

            /// The encoded message.
            pub fn to_bytes(&self) -> Vec<u8> {
                let mut v = vec![0; ACCEPT_CONFIRM_LEN];
                self.encode(&mut v);
                v
            }
        }
    };
}

accept_confirm_encoding!(Accept);
accept_confirm_encoding!(Confirm);

impl Decline {
    /// Encoded size: [`DECLINE_LEN`].
    pub fn encoded_len(&self) -> usize {
        DECLINE_LEN
    }

    /// Writes the message into `out[..44]` and returns 44.
    ///
    /// # Panics
    ///
    /// If `out` is shorter than 44 bytes.
    pub fn encode(&self, out: &mut [u8]) -> usize {
        frame(out, MsgType::Decline, DECLINE_LEN, self.type_byte());
        out[D_ID_FOR_PEER..D_ID_FOR_PEER + 8].copy_from_slice(&self.id_for_peer);
        put_u32(out, D_DIAG, self.peer_diagnosis);
        out[D_OS_TYPE] = OS_TYPE_LINUX << 4;
        DECLINE_LEN
    }

    /// The encoded message.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = vec![0; DECLINE_LEN];
        self.encode(&mut v);
        v
    }
}

impl ClcMsg {
    /// The message's type.
    pub fn msg_type(&self) -> MsgType {
        match self {
            ClcMsg::Proposal(_) => MsgType::Proposal,
            ClcMsg::Accept(_) => MsgType::Accept,
            ClcMsg::Confirm(_) => MsgType::Confirm,
            ClcMsg::Decline(_) => MsgType::Decline,
        }
    }

    /// Encoded size, at most [`MAX_LEN`].
    pub fn encoded_len(&self) -> usize {
        match self {
            ClcMsg::Proposal(m) => m.encoded_len(),
            ClcMsg::Accept(m) => m.encoded_len(),
            ClcMsg::Confirm(m) => m.encoded_len(),
            ClcMsg::Decline(m) => m.encoded_len(),
        }
    }

    /// Writes the message at the start of `out` and returns its length.
    ///
    /// # Panics
    ///
    /// As the `encode` of the message type: if `out` is too short (a buffer
    /// of [`MAX_LEN`] bytes is always enough) or a Proposal has more than
    /// [`MAX_UEIDS`] UEIDs.
    pub fn encode(&self, out: &mut [u8]) -> usize {
        match self {
            ClcMsg::Proposal(m) => m.encode(out),
            ClcMsg::Accept(m) => m.encode(out),
            ClcMsg::Confirm(m) => m.encode(out),
            ClcMsg::Decline(m) => m.encode(out),
        }
    }

    /// The encoded message.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = vec![0; self.encoded_len()];
        self.encode(&mut v);
        v
    }

    /// Parses and validates exactly one message: `bytes.len()` must equal the
    /// header's length field, which must equal the size the message's
    /// contents require. Never panics.
    pub fn parse(bytes: &[u8]) -> Result<ClcMsg, ClcError> {
        let kind = header(bytes)?;
        let field = u16::from_be_bytes([bytes[5], bytes[6]]);
        if field as usize != bytes.len() {
            return Err(ClcError::LengthField {
                field,
                actual: bytes.len(),
            });
        }
        match kind {
            MsgType::Proposal => parse_proposal(bytes).map(ClcMsg::Proposal),
            MsgType::Accept => {
                let (gid, token, dmbe_size_comp, linkid, chid) = parse_accept_confirm(bytes, kind)?;
                Ok(ClcMsg::Accept(Accept {
                    gid,
                    token,
                    dmbe_size_comp,
                    linkid,
                    chid,
                }))
            }
            MsgType::Confirm => {
                let (gid, token, dmbe_size_comp, linkid, chid) = parse_accept_confirm(bytes, kind)?;
                Ok(ClcMsg::Confirm(Confirm {
                    gid,
                    token,
                    dmbe_size_comp,
                    linkid,
                    chid,
                }))
            }
            MsgType::Decline => parse_decline(bytes).map(ClcMsg::Decline),
        }
    }

    /// Parses the message at the start of `bytes`, which may be followed by
    /// anything (e.g. the rest of a [`MAX_LEN`] slot area); returns it and
    /// its length. The header's length field decides where it ends.
    pub fn parse_prefix(bytes: &[u8]) -> Result<(ClcMsg, usize), ClcError> {
        header(bytes)?;
        let field = u16::from_be_bytes([bytes[5], bytes[6]]);
        let len = field as usize;
        if len > bytes.len() || len < HEADER_LEN {
            return Err(ClcError::LengthField {
                field,
                actual: bytes.len(),
            });
        }
        ClcMsg::parse(&bytes[..len]).map(|m| (m, len))
    }
}

// ----------------------------------------------------------------- parsing

fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn get_32(b: &[u8], at: usize) -> [u8; 32] {
    b[at..at + 32].try_into().expect("32 bytes")
}

/// Checks what the header alone can tell: size, type, header eyecatcher,
/// version. Returns the type.
fn header(b: &[u8]) -> Result<MsgType, ClcError> {
    if b.len() < HEADER_LEN {
        return Err(ClcError::Truncated { len: b.len() });
    }
    let kind = MsgType::from_u8(b[4]).ok_or(ClcError::BadType(b[4]))?;
    let found: [u8; 4] = b[..4].try_into().expect("4 bytes");
    if found != kind.eyecatcher() {
        return Err(ClcError::BadEyecatcher {
            kind,
            place: "header",
            found,
        });
    }
    if b[7] >> 4 != VERSION {
        return Err(ClcError::BadVersion(b[7] >> 4));
    }
    Ok(kind)
}

/// Checks the trailer and byte 7 once the length is known to be right.
fn trailer_and_type_byte(b: &[u8], kind: MsgType, type_byte: u8) -> Result<(), ClcError> {
    let found: [u8; 4] = b[b.len() - TRAILER_LEN..].try_into().expect("4 bytes");
    if found != kind.eyecatcher() {
        return Err(ClcError::BadEyecatcher {
            kind,
            place: "trailer",
            found,
        });
    }
    if b[7] != type_byte {
        return Err(ClcError::BadTypeByte {
            kind,
            found: b[7],
            expected: type_byte,
        });
    }
    Ok(())
}

fn zero(
    b: &[u8],
    kind: MsgType,
    field: &'static str,
    at: usize,
    len: usize,
) -> Result<(), ClcError> {
    match b[at..at + len].iter().position(|&x| x != 0) {
        None => Ok(()),
        Some(i) => Err(ClcError::NonZero {
            kind,
            field,
            offset: at + i,
            value: b[at + i],
        }),
    }
}

fn expect(kind: MsgType, field: &'static str, found: u64, expected: u64) -> Result<(), ClcError> {
    if found == expected {
        Ok(())
    } else {
        Err(ClcError::BadField {
            kind,
            field,
            found,
            expected,
        })
    }
}

fn size_comp_valid(kind: MsgType, comp: u8) -> Result<u8, ClcError> {
    if comp > MAX_SIZE_COMP {
        Err(ClcError::BadSizeComp { kind, comp })
    } else {
        Ok(comp)
    }
}

fn parse_proposal(b: &[u8]) -> Result<Proposal, ClcError> {
    const K: MsgType = MsgType::Proposal;
    let length = b.len();
    if length < PROPOSAL_BASE_LEN {
        return Err(ClcError::ProposalTooShort { length });
    }
    let n = b[P_EID_CNT];
    if n as usize > MAX_UEIDS {
        return Err(ClcError::TooManyUeids(n));
    }
    let expected = PROPOSAL_BASE_LEN + n as usize * EID_LEN;
    if length != expected {
        return Err(ClcError::ProposalLength {
            length,
            ueids: n,
            expected,
        });
    }
    trailer_and_type_byte(b, K, PROPOSAL_TYPE_BYTE)?;

    let n = n as usize;
    let d = P_UEIDS + n * EID_LEN;
    let gid = get_u64(b, d + PD_GIDCHID0);
    let chid = get_u16(b, d + PD_GIDCHID0 + 8);
    expect(K, "id_for_peer", get_u64(b, P_ID_FOR_PEER), gid)?;
    zero(b, K, "lcl.mac", P_LCL_RSVD, 3)?;
    expect(K, "iparea_offset", get_u16(b, P_IPAREA_OFF).into(), 0)?;
    expect(K, "ism.gid", get_u64(b, P_ISM_GID), 0)?;
    expect(K, "ism.chid", get_u16(b, P_ISM_CHID).into(), 0)?;
    expect(
        K,
        "v2_ext_offset",
        get_u16(b, P_V2_EXT_OFF).into(),
        V2_EXT_OFFSET.into(),
    )?;
    zero(b, K, "vendor_oui/vendor_exp_options", P_VENDOR, 8)?;
    expect(
        K,
        "ism_gid_cnt",
        b[P_ISM_GID_CNT].into(),
        ISM_GID_CNT.into(),
    )?;
    zero(b, K, "reserved1", P_RSVD1, 1)?;
    expect(K, "flag", b[P_FLAG].into(), V2_FLAG.into())?;
    zero(b, K, "reserved2", P_RSVD2, 2)?;
    expect(
        K,
        "smcd_v2_ext_offset",
        get_u16(b, P_SMCD_V2_OFF).into(),
        smcd_v2_ext_offset(n).into(),
    )?;
    zero(b, K, "roce/max_conns/max_links", P_ROCE, P_FEATURE - P_ROCE)?;
    expect(
        K,
        "feature_mask",
        get_u16(b, P_FEATURE).into(),
        FEATURE_MASK.into(),
    )?;
    zero(b, K, "v2 reserved", P_V2_RSVD, P_UEIDS - P_V2_RSVD)?;
    zero(b, K, "smcd_v2 reserved", d + PD_RSVD, 16)?;
    expect(K, "gidchid[1].gid", get_u64(b, d + PD_GIDCHID1), 0)?;
    expect(
        K,
        "gidchid[1].chid",
        get_u16(b, d + PD_GIDCHID1 + 8).into(),
        chid.into(),
    )?;
    let mark_tos = b[P_MARK_TOS];
    if mark_tos & 0b11 != 0 {
        return Err(ClcError::MarkEcn(mark_tos));
    }
    let dmbe_size_comp = size_comp_valid(K, b[P_SIZE])?;

    Ok(Proposal {
        gid,
        chid,
        seid: get_32(b, d + PD_SEID),
        ueids: (0..n).map(|i| get_32(b, P_UEIDS + i * EID_LEN)).collect(),
        mark_ttl: b[P_MARK_TTL],
        mark_tos,
        token: get_u64(b, P_TOKEN),
        dmbe_size_comp,
        nonce: get_u64(b, P_NONCE),
        pid: get_u32(b, P_PID),
        start_time: get_u64(b, P_START_TIME),
        netns: get_u64(b, P_NETNS),
    })
}

/// Returns (gid, token, dmbe_size_comp, linkid, chid).
fn parse_accept_confirm(b: &[u8], kind: MsgType) -> Result<(u64, u64, u8, u32, u16), ClcError> {
    if b.len() != ACCEPT_CONFIRM_LEN {
        return Err(ClcError::WrongLength {
            kind,
            length: b.len(),
            expected: ACCEPT_CONFIRM_LEN,
        });
    }
    trailer_and_type_byte(b, kind, ACCEPT_CONFIRM_TYPE_BYTE)?;
    expect(kind, "dmbe_idx", b[A_DMBE_IDX].into(), 0)?;
    if b[A_SIZE] & 0x0f != 0 {
        let value = b[A_SIZE];
        return Err(ClcError::NonZero {
            kind,
            field: "dmbe_size low nibble",
            offset: A_SIZE,
            value,
        });
    }
    let comp = size_comp_valid(kind, b[A_SIZE] >> 4)?;
    zero(b, kind, "reserved4", A_RSVD4, 2)?;
    zero(b, kind, "eid", A_EID, EID_LEN)?;
    expect(kind, "gid_ext", get_u64(b, A_GID_EXT), 0)?;
    Ok((
        get_u64(b, A_GID),
        get_u64(b, A_TOKEN),
        comp,
        get_u32(b, A_LINKID),
        get_u16(b, A_CHID),
    ))
}

fn parse_decline(b: &[u8]) -> Result<Decline, ClcError> {
    const K: MsgType = MsgType::Decline;
    if b.len() != DECLINE_LEN {
        return Err(ClcError::WrongLength {
            kind: K,
            length: b.len(),
            expected: DECLINE_LEN,
        });
    }
    let d = Decline {
        id_for_peer: b[D_ID_FOR_PEER..D_ID_FOR_PEER + 8]
            .try_into()
            .expect("8 bytes"),
        peer_diagnosis: get_u32(b, D_DIAG),
    };
    trailer_and_type_byte(b, K, d.type_byte())?;
    expect(
        K,
        "os_type",
        b[D_OS_TYPE].into(),
        (OS_TYPE_LINUX << 4).into(),
    )?;
    zero(b, K, "reserved2", D_RSVD, 3)?;
    zero(b, K, "peer_diagnosis_v2", D_DIAG_V2, 16)?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn proposal(ueids: usize) -> Proposal {
        Proposal {
            gid: 0x0102_0304_0506_0708,
            chid: CHID_LOOPBACK,
            seid: [b'S'; 32],
            ueids: (0..ueids).map(|i| [b'U' + i as u8; 32]).collect(),
            mark_ttl: 0x2A,
            mark_tos: 0x48,
            token: 0x1112_1314_1516_1718,
            dmbe_size_comp: 2,
            nonce: 0x2122_2324_2526_2728,
            pid: 0x3132_3334,
            start_time: 0x4142_4344_4546_4748,
            netns: 0x5152_5354_5556_5758,
        }
    }

    fn accept() -> Accept {
        Accept {
            gid: 0x0102_0304_0506_0708,
            token: 0x1112_1314_1516_1718,
            dmbe_size_comp: 4,
            linkid: 0x100,
            chid: CHID_LOOPBACK,
        }
    }

    fn confirm() -> Confirm {
        let a = accept();
        Confirm {
            gid: a.gid,
            token: a.token,
            dmbe_size_comp: a.dmbe_size_comp,
            linkid: a.linkid,
            chid: a.chid,
        }
    }

    fn err(b: &[u8]) -> ClcError {
        ClcMsg::parse(b).expect_err("must not parse")
    }

    // ------------------------------------------------------------ golden

    #[test]
    fn golden_proposal() {
        let want = unhex(&format!(
            "e2d4c3d9 01 00e0 26
             0102030405060708
             1112131415161718 2122232425262728
             2a 48 02 000000
             0000
             0000000000000000 0000 001c
             000000 0000000000
             31323334 4142434445464748 5152535455565758
             01 02 00 11 0000 0040
             {roce} 00 00 0001 {rsvd12}
             {ueid}
             {seid} {rsvd16}
             0102030405060708 ffff
             0000000000000000 ffff
             e2d4c3d9",
            roce = "00".repeat(16),
            rsvd12 = "00".repeat(12),
            ueid = "55".repeat(32),
            seid = "53".repeat(32),
            rsvd16 = "00".repeat(16),
        ));
        assert_eq!(want.len(), 224);
        let p = proposal(1);
        assert_eq!(p.to_bytes(), want);
        assert_eq!(ClcMsg::parse(&want), Ok(ClcMsg::Proposal(p)));
        // Byte 7: version 2, typev2 D (1), typev1 N (2).
        assert_eq!(want[7], 0x26);
    }

    #[test]
    fn golden_accept_and_confirm() {
        let body = format!(
            "0102030405060708 1112131415161718 00 40 0000 00000100 ffff {} 0000000000000000 e2d4c3c4",
            "00".repeat(32)
        );
        let a = unhex(&format!("e2d4c3c4 02 004e 21 {body}"));
        let c = unhex(&format!("e2d4c3c4 03 004e 21 {body}"));
        assert_eq!(a.len(), 78);
        assert_eq!(accept().to_bytes(), a);
        assert_eq!(confirm().to_bytes(), c);
        assert_eq!(ClcMsg::parse(&a), Ok(ClcMsg::Accept(accept())));
        assert_eq!(ClcMsg::parse(&c), Ok(ClcMsg::Confirm(confirm())));
    }

    #[test]
    fn golden_decline() {
        let d = Decline::new(0x0102_0304_0506_0708, Reason::NoUeid);
        let want = unhex(&format!(
            "e2d4c3d9 04 002c 20 0102030405060708 03030008 20 000000 {} e2d4c3d9",
            "00".repeat(16)
        ));
        assert_eq!(want.len(), 44);
        assert_eq!(d.to_bytes(), want);
        assert_eq!(ClcMsg::parse(&want), Ok(ClcMsg::Decline(d)));
        assert_eq!(d.reason(), Some(Reason::NoUeid));

        // SYNCERR carries SMC's first-contact bit: typev2 0b10 -> 0x08.
        let s = Decline::new(0x0102_0304_0506_0708, Reason::SyncErr).to_bytes();
        assert_eq!(s[7], 0x28);
        assert_eq!(&s[16..20], &[0x04, 0, 0, 0]);
    }

    // --------------------------------------------------------- round trips

    #[test]
    fn round_trip_all_ueid_counts_and_sizes() {
        for n in 0..=MAX_UEIDS {
            for comp in 0..=MAX_SIZE_COMP {
                let mut p = proposal(n);
                p.dmbe_size_comp = comp;
                p.chid = 0xFF00 | n as u16;
                let b = p.to_bytes();
                assert_eq!(b.len(), PROPOSAL_BASE_LEN + 32 * n);
                assert_eq!(ClcMsg::parse(&b), Ok(ClcMsg::Proposal(p)));
            }
        }
        for comp in 0..=MAX_SIZE_COMP {
            let a = Accept {
                dmbe_size_comp: comp,
                ..accept()
            };
            assert_eq!(ClcMsg::parse(&a.to_bytes()), Ok(ClcMsg::Accept(a)));
        }
    }

    #[test]
    fn round_trip_extreme_values() {
        let p = Proposal {
            gid: u64::MAX,
            chid: u16::MAX,
            seid: [0xFF; 32],
            ueids: vec![[0; 32]; 8],
            mark_ttl: 255,
            mark_tos: 0xFC,
            token: u64::MAX,
            dmbe_size_comp: 6,
            nonce: u64::MAX,
            pid: u32::MAX,
            start_time: u64::MAX,
            netns: u64::MAX,
        };
        let b = p.to_bytes();
        assert_eq!(b.len(), MAX_LEN);
        assert_eq!(ClcMsg::parse(&b), Ok(ClcMsg::Proposal(p)));
        let zero_p = Proposal {
            gid: 0,
            chid: 0,
            seid: [0; 32],
            ueids: vec![],
            mark_ttl: 0,
            mark_tos: 0,
            token: 0,
            dmbe_size_comp: 0,
            nonce: 0,
            pid: 0,
            start_time: 0,
            netns: 0,
        };
        assert_eq!(
            ClcMsg::parse(&zero_p.to_bytes()),
            Ok(ClcMsg::Proposal(zero_p))
        );
        let c = Confirm {
            gid: u64::MAX,
            token: u64::MAX,
            dmbe_size_comp: 6,
            linkid: u32::MAX,
            chid: u16::MAX,
        };
        assert_eq!(ClcMsg::parse(&c.to_bytes()), Ok(ClcMsg::Confirm(c)));
        let d = Decline {
            id_for_peer: [0xFF; 8],
            peer_diagnosis: u32::MAX,
        };
        assert_eq!(ClcMsg::parse(&d.to_bytes()), Ok(ClcMsg::Decline(d)));
        assert_eq!(d.reason(), None);
    }

    #[test]
    fn every_reason_round_trips_in_a_decline() {
        for r in Reason::ALL {
            let d = Decline::new(7, r);
            assert_eq!(ClcMsg::parse(&d.to_bytes()), Ok(ClcMsg::Decline(d)), "{r}");
        }
    }

    #[test]
    fn clcmsg_encode_into_max_len_buffer() {
        let msgs = [
            ClcMsg::Proposal(proposal(8)),
            ClcMsg::Accept(accept()),
            ClcMsg::Confirm(confirm()),
            ClcMsg::Decline(Decline::new(1, Reason::MaxDmb)),
        ];
        for m in msgs {
            let mut buf = [0xAAu8; MAX_LEN + 16];
            let n = m.encode(&mut buf);
            assert_eq!(n, m.encoded_len());
            assert!(n <= MAX_LEN);
            assert_eq!(&buf[..n], &m.to_bytes()[..]);
            // Bytes after the message are untouched, and parse_prefix skips them.
            assert!(buf[n..].iter().all(|&x| x == 0xAA));
            assert_eq!(ClcMsg::parse_prefix(&buf), Ok((m.clone(), n)));
            // parse wants exactly one message.
            assert_eq!(
                ClcMsg::parse(&buf[..n + 1]),
                Err(ClcError::LengthField {
                    field: n as u16,
                    actual: n + 1
                })
            );
        }
    }

    #[test]
    fn parse_prefix_rejects_length_beyond_buffer() {
        let b = accept().to_bytes();
        assert_eq!(
            ClcMsg::parse_prefix(&b[..77]),
            Err(ClcError::LengthField {
                field: 78,
                actual: 77
            })
        );
        let mut b = accept().to_bytes();
        b[5..7].copy_from_slice(&3u16.to_be_bytes());
        assert_eq!(
            ClcMsg::parse_prefix(&b),
            Err(ClcError::LengthField {
                field: 3,
                actual: 78
            })
        );
    }

    #[test]
    #[should_panic(expected = "9 UEIDs")]
    fn encode_refuses_too_many_ueids() {
        proposal(9).to_bytes();
    }

    #[test]
    #[should_panic(expected = "needs 78 bytes")]
    fn encode_refuses_short_buffer() {
        accept().encode(&mut [0u8; 77]);
    }

    // -------------------------------------------------------------- sizes

    #[test]
    fn size_comp_matches_smc() {
        let cases = [
            (0, 0),
            (1, 0),
            (16384, 0),
            (16385, 1),
            (32768, 1),
            (32769, 2),
            (65536, 2),
            (65537, 3),
            (131072, 3),
            (262144, 4),
            (524288, 5),
            (1 << 20, 6),
            ((1 << 20) + 1, 6),
            (u32::MAX, 6),
        ];
        for (bytes, comp) in cases {
            assert_eq!(size_comp(bytes), comp, "{bytes}");
        }
        for c in 0..=MAX_SIZE_COMP {
            assert_eq!(size_uncomp(c), 1 << (c + 14));
            assert_eq!(size_comp(size_uncomp(c)), c);
        }
        assert_eq!(size_uncomp(7), 1 << 20);
        assert_eq!(size_uncomp(255), 1 << 20);
        for bytes in (1..=(1u32 << 20)).step_by(4093) {
            assert!(size_uncomp(size_comp(bytes)) >= bytes, "{bytes}");
        }
    }

    #[test]
    fn max_len_is_the_largest_message() {
        assert_eq!(MAX_LEN, 448);
        assert_eq!(proposal(MAX_UEIDS).encoded_len(), MAX_LEN);
        const { assert!(ACCEPT_CONFIRM_LEN < MAX_LEN && DECLINE_LEN < MAX_LEN) };
    }

    // --------------------------------------------------------- validation

    /// No byte of a valid message is ignored by the parser: changing any bit
    /// either makes the message invalid or changes the parsed value (and
    /// then it re-encodes to the changed bytes). Fails if any check of a
    /// fixed or reserved byte is dropped.
    #[test]
    fn no_byte_is_ignored() {
        let msgs = [
            ClcMsg::Proposal(proposal(0)),
            ClcMsg::Proposal(proposal(3)),
            ClcMsg::Accept(accept()),
            ClcMsg::Confirm(confirm()),
            ClcMsg::Decline(Decline::new(9, Reason::Timeout)),
            ClcMsg::Decline(Decline::new(9, Reason::SyncErr)),
        ];
        for m in msgs {
            let good = m.to_bytes();
            for i in 0..good.len() {
                for bit in 0..8 {
                    let mut b = good.clone();
                    b[i] ^= 1 << bit;
                    if let Ok(p) = ClcMsg::parse(&b) {
                        assert_ne!(p, m, "{} byte {i} bit {bit} ignored", m.msg_type());
                        assert_eq!(p.to_bytes(), b, "{} byte {i} bit {bit}", m.msg_type());
                    }
                }
            }
        }
    }

    #[test]
    fn truncated() {
        let good = accept().to_bytes();
        for len in 0..HEADER_LEN {
            assert_eq!(err(&good[..len]), ClcError::Truncated { len });
        }
    }

    #[test]
    fn bad_type() {
        for t in [0u8, 5, 0xFF] {
            let mut b = accept().to_bytes();
            b[4] = t;
            assert_eq!(err(&b), ClcError::BadType(t));
        }
    }

    #[test]
    fn header_eyecatcher_must_match_type() {
        // Linux accepts either eyecatcher; smclo wants the one of the type.
        let mut b = proposal(0).to_bytes();
        b[..4].copy_from_slice(&EYECATCHER_SMCD);
        assert_eq!(
            err(&b),
            ClcError::BadEyecatcher {
                kind: MsgType::Proposal,
                place: "header",
                found: EYECATCHER_SMCD
            }
        );
        let mut b = accept().to_bytes();
        b[..4].copy_from_slice(&EYECATCHER_SMCR);
        assert_eq!(
            err(&b),
            ClcError::BadEyecatcher {
                kind: MsgType::Accept,
                place: "header",
                found: EYECATCHER_SMCR
            }
        );
        let mut b = Decline::new(1, Reason::Mem).to_bytes();
        b[..4].copy_from_slice(b"SMCR");
        assert!(matches!(
            err(&b),
            ClcError::BadEyecatcher {
                place: "header",
                ..
            }
        ));
    }

    #[test]
    fn trailer_eyecatcher_must_match_type() {
        let cases: [(Vec<u8>, MsgType); 4] = [
            (proposal(2).to_bytes(), MsgType::Proposal),
            (accept().to_bytes(), MsgType::Accept),
            (confirm().to_bytes(), MsgType::Confirm),
            (Decline::new(1, Reason::Mem).to_bytes(), MsgType::Decline),
        ];
        for (mut b, kind) in cases {
            let n = b.len();
            b[n - 1] ^= 0x1D; // D9 <-> C4
            let found = b[n - 4..].try_into().unwrap();
            assert_eq!(
                err(&b),
                ClcError::BadEyecatcher {
                    kind,
                    place: "trailer",
                    found
                }
            );
        }
    }

    #[test]
    fn bad_version() {
        for v in [0u8, 1, 3, 0xF] {
            let mut b = proposal(0).to_bytes();
            b[7] = (v << 4) | (b[7] & 0x0F);
            assert_eq!(err(&b), ClcError::BadVersion(v));
        }
    }

    #[test]
    fn length_field_must_match_bytes_given() {
        let mut b = accept().to_bytes();
        b.push(0);
        assert_eq!(
            err(&b),
            ClcError::LengthField {
                field: 78,
                actual: 79
            }
        );
        let b = proposal(1).to_bytes();
        assert_eq!(
            err(&b[..200]),
            ClcError::LengthField {
                field: 224,
                actual: 200
            }
        );
    }

    /// A well-framed message of `len` bytes of type `kind`, otherwise zero.
    fn framed(kind: MsgType, len: usize, type_byte: u8) -> Vec<u8> {
        let mut b = vec![0; len];
        frame(&mut b, kind, len, type_byte);
        b
    }

    #[test]
    fn fixed_lengths() {
        for (kind, tb, want) in [
            (
                MsgType::Accept,
                ACCEPT_CONFIRM_TYPE_BYTE,
                ACCEPT_CONFIRM_LEN,
            ),
            (
                MsgType::Confirm,
                ACCEPT_CONFIRM_TYPE_BYTE,
                ACCEPT_CONFIRM_LEN,
            ),
            (MsgType::Decline, DECLINE_TYPE_BYTE, DECLINE_LEN),
        ] {
            // 130: a first-contact SMC-Dv2 accept; 28: a V1 decline.
            for len in [12, 28, 48, 130, want - 1, want + 1] {
                let b = framed(kind, len, tb);
                assert_eq!(
                    err(&b),
                    ClcError::WrongLength {
                        kind,
                        length: len,
                        expected: want
                    }
                );
            }
        }
    }

    #[test]
    fn proposal_too_short() {
        for len in [12, 100, 191] {
            let b = framed(MsgType::Proposal, len, PROPOSAL_TYPE_BYTE);
            assert_eq!(err(&b), ClcError::ProposalTooShort { length: len });
        }
    }

    #[test]
    fn proposal_too_many_ueids() {
        for n in [9u8, 255] {
            let mut b = proposal(8).to_bytes();
            b[P_EID_CNT] = n;
            assert_eq!(err(&b), ClcError::TooManyUeids(n));
        }
    }

    #[test]
    fn proposal_length_must_match_ueid_count() {
        let mut b = proposal(1).to_bytes();
        b[P_EID_CNT] = 2;
        assert_eq!(
            err(&b),
            ClcError::ProposalLength {
                length: 224,
                ueids: 2,
                expected: 256
            }
        );
        let mut b = proposal(1).to_bytes();
        b[P_EID_CNT] = 0;
        assert_eq!(
            err(&b),
            ClcError::ProposalLength {
                length: 224,
                ueids: 0,
                expected: 192
            }
        );
        // A length between two valid sizes.
        let b = framed(MsgType::Proposal, 200, PROPOSAL_TYPE_BYTE);
        assert_eq!(
            err(&b),
            ClcError::ProposalLength {
                length: 200,
                ueids: 0,
                expected: 192
            }
        );
    }

    #[test]
    fn type_byte() {
        let bad = |mut b: Vec<u8>, v: u8| {
            b[7] = v;
            err(&b)
        };
        // typev1 D instead of N, or first contact in a proposal.
        for v in [0x21, 0x25, 0x27, 0x2E, 0x20] {
            assert_eq!(
                bad(proposal(0).to_bytes(), v),
                ClcError::BadTypeByte {
                    kind: MsgType::Proposal,
                    found: v,
                    expected: 0x26
                }
            );
        }
        // First contact (0x29) would promise an extension smclo does not send.
        for v in [0x29, 0x20, 0x26] {
            assert_eq!(
                bad(accept().to_bytes(), v),
                ClcError::BadTypeByte {
                    kind: MsgType::Accept,
                    found: v,
                    expected: 0x21
                }
            );
            assert_eq!(
                bad(confirm().to_bytes(), v),
                ClcError::BadTypeByte {
                    kind: MsgType::Confirm,
                    found: v,
                    expected: 0x21
                }
            );
        }
        // The first-contact bit must be present exactly for SYNCERR.
        assert_eq!(
            bad(Decline::new(1, Reason::Mem).to_bytes(), 0x28),
            ClcError::BadTypeByte {
                kind: MsgType::Decline,
                found: 0x28,
                expected: 0x20
            }
        );
        assert_eq!(
            bad(Decline::new(1, Reason::SyncErr).to_bytes(), 0x20),
            ClcError::BadTypeByte {
                kind: MsgType::Decline,
                found: 0x20,
                expected: 0x28
            }
        );
    }

    #[test]
    fn proposal_fixed_fields() {
        let n = 1;
        let d = P_UEIDS + n * EID_LEN;
        // (offset, field name, found value after writing 0x01 at the offset's
        // last byte, expected value)
        let cases: [(usize, usize, &str, u64); 11] = [
            (P_ID_FOR_PEER, 8, "id_for_peer", 0x0102_0304_0506_0708),
            (P_IPAREA_OFF, 2, "iparea_offset", 0),
            (P_ISM_GID, 8, "ism.gid", 0),
            (P_ISM_CHID, 2, "ism.chid", 0),
            (P_V2_EXT_OFF, 2, "v2_ext_offset", 28),
            (P_ISM_GID_CNT, 1, "ism_gid_cnt", 2),
            (P_FLAG, 1, "flag", 0x11),
            (P_SMCD_V2_OFF, 2, "smcd_v2_ext_offset", 64),
            (P_FEATURE, 2, "feature_mask", 1),
            (d + PD_GIDCHID1, 8, "gidchid[1].gid", 0),
            (d + PD_GIDCHID1 + 8, 2, "gidchid[1].chid", 0xFFFF),
        ];
        for (at, width, field, expected) in cases {
            let mut b = proposal(n).to_bytes();
            b[at + width - 1] ^= 0x80;
            let found = b[at..at + width]
                .iter()
                .fold(0u64, |a, &x| (a << 8) | x as u64);
            assert_eq!(
                err(&b),
                ClcError::BadField {
                    kind: MsgType::Proposal,
                    field,
                    found,
                    expected
                },
                "{field}"
            );
        }
    }

    #[test]
    fn proposal_reserved_bytes() {
        let n = 2;
        let d = P_UEIDS + n * EID_LEN;
        let areas: [(usize, usize, &str); 7] = [
            (P_LCL_RSVD, 3, "lcl.mac"),
            (P_VENDOR, 8, "vendor_oui/vendor_exp_options"),
            (P_RSVD1, 1, "reserved1"),
            (P_RSVD2, 2, "reserved2"),
            (P_ROCE, 18, "roce/max_conns/max_links"),
            (P_V2_RSVD, 12, "v2 reserved"),
            (d + PD_RSVD, 16, "smcd_v2 reserved"),
        ];
        for (at, len, field) in areas {
            for offset in at..at + len {
                let mut b = proposal(n).to_bytes();
                b[offset] = 0x5A;
                assert_eq!(
                    err(&b),
                    ClcError::NonZero {
                        kind: MsgType::Proposal,
                        field,
                        offset,
                        value: 0x5A
                    }
                );
            }
        }
    }

    #[test]
    fn proposal_mark_ecn_and_size() {
        for tos in [0x01, 0x02, 0x4B] {
            let p = Proposal {
                mark_tos: tos,
                ..proposal(0)
            };
            assert_eq!(err(&p.to_bytes()), ClcError::MarkEcn(tos));
        }
        for comp in [7, 15, 255] {
            let p = Proposal {
                dmbe_size_comp: comp,
                ..proposal(0)
            };
            assert_eq!(
                err(&p.to_bytes()),
                ClcError::BadSizeComp {
                    kind: MsgType::Proposal,
                    comp
                }
            );
        }
    }

    #[test]
    fn accept_confirm_fields() {
        for (good, kind) in [
            (accept().to_bytes(), MsgType::Accept),
            (confirm().to_bytes(), MsgType::Confirm),
        ] {
            let with = |at: usize, v: u8| {
                let mut b = good.clone();
                b[at] = v;
                err(&b)
            };
            assert_eq!(
                with(A_DMBE_IDX, 3),
                ClcError::BadField {
                    kind,
                    field: "dmbe_idx",
                    found: 3,
                    expected: 0
                }
            );
            assert_eq!(
                with(A_SIZE, 0x41),
                ClcError::NonZero {
                    kind,
                    field: "dmbe_size low nibble",
                    offset: A_SIZE,
                    value: 0x41
                }
            );
            assert_eq!(with(A_SIZE, 0x70), ClcError::BadSizeComp { kind, comp: 7 });
            assert_eq!(with(A_SIZE, 0xF0), ClcError::BadSizeComp { kind, comp: 15 });
            for offset in [A_RSVD4, A_RSVD4 + 1] {
                assert_eq!(
                    with(offset, 9),
                    ClcError::NonZero {
                        kind,
                        field: "reserved4",
                        offset,
                        value: 9
                    }
                );
            }
            for offset in A_EID..A_EID + EID_LEN {
                assert_eq!(
                    with(offset, 9),
                    ClcError::NonZero {
                        kind,
                        field: "eid",
                        offset,
                        value: 9
                    }
                );
            }
            assert_eq!(
                with(A_GID_EXT, 1),
                ClcError::BadField {
                    kind,
                    field: "gid_ext",
                    found: 1 << 56,
                    expected: 0
                }
            );
        }
    }

    #[test]
    fn decline_fields() {
        let good = Decline::new(1, Reason::PeerDead).to_bytes();
        let with = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            err(&b)
        };
        const K: MsgType = MsgType::Decline;
        for v in [0x00, 0x10, 0x21, 0x30] {
            assert_eq!(
                with(D_OS_TYPE, v),
                ClcError::BadField {
                    kind: K,
                    field: "os_type",
                    found: v as u64,
                    expected: 0x20
                }
            );
        }
        for offset in D_RSVD..D_RSVD + 3 {
            assert_eq!(
                with(offset, 1),
                ClcError::NonZero {
                    kind: K,
                    field: "reserved2",
                    offset,
                    value: 1
                }
            );
        }
        for offset in D_DIAG_V2..D_DIAG_V2 + 16 {
            assert_eq!(
                with(offset, 1),
                ClcError::NonZero {
                    kind: K,
                    field: "peer_diagnosis_v2",
                    offset,
                    value: 1
                }
            );
        }
    }

    #[test]
    fn error_messages() {
        assert_eq!(
            ClcError::ProposalLength {
                length: 130,
                ueids: 2,
                expected: 256
            }
            .to_string(),
            "CLC length 130 but proposal with 2 UEIDs is 256 bytes"
        );
        assert_eq!(
            ClcError::WrongLength {
                kind: MsgType::Accept,
                length: 130,
                expected: 78
            }
            .to_string(),
            "CLC length 130 but accept is 78 bytes"
        );
        assert_eq!(
            ClcError::BadEyecatcher {
                kind: MsgType::Accept,
                place: "trailer",
                found: EYECATCHER_SMCR
            }
            .to_string(),
            "CLC accept trailer eyecatcher is e2d4c3d9, expected e2d4c3c4 (\"SMCD\" in EBCDIC)"
        );
        assert_eq!(
            ClcError::NonZero {
                kind: MsgType::Decline,
                field: "reserved2",
                offset: 21,
                value: 1
            }
            .to_string(),
            "CLC decline reserved byte 21 (reserved2) is 0x01, must be zero"
        );
        assert_eq!(
            ClcError::BadTypeByte {
                kind: MsgType::Proposal,
                found: 0x21,
                expected: 0x26
            }
            .to_string(),
            "CLC proposal header byte 7 (version/type) is 0x21, expected 0x26"
        );
        assert_eq!(
            ClcError::Truncated { len: 3 }.to_string(),
            "CLC message of 3 bytes is shorter than its 8-byte header"
        );
    }
}
