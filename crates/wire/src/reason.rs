//! Decline and fallback reasons, with SMC's reason codes.
//!
//! A connection that does not become SMC-D falls back to plain TCP for one of
//! these reasons. The codes are those of Linux `net/smc` (`smc_clc.h`) where
//! SMC has a matching case, so that people who read `smcss` output recognise
//! them; smclo's own cases use the range `0x0A00xxxx`, which SMC does not
//! use. A code travels in a [`Decline`](crate::clc::Decline) and is counted
//! per reason in the device file.

use std::fmt;

/// Why a connection fell back to TCP (or why a handshake was declined).
///
/// The discriminant is the reason code. [`Reason::index`] is a separate,
/// dense numbering (0..[`Reason::COUNT`]) used to address per-reason counters
/// in the shared device file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum Reason {
    /// The peer does not run smclo: no live smclo listener for the
    /// destination, or no Proposal was published for this connection.
    /// As in SMC, no Decline is sent for it.
    PeerNoSmc = 0x0301_0000,
    /// The local smclo device is switched off (`smclo dev set active=0`),
    /// or unusable (its file was shrunk under this process's mapping).
    NoSmcdDev = 0x0303_0001,
    /// The peer proposed a different device (its GID is not ours).
    NoSmcd2Dev = 0x0303_0007,
    /// No UEID in the Proposal matches one of ours.
    NoUeid = 0x0303_0008,
    /// No free rendezvous slot, or the device's DMB limit is reached.
    MaxDmb = 0x030d_0000,
    /// A DMB could not be created (out of memory, or `/dev/shm` is full), or
    /// the connection would take smclo past its share of `RLIMIT_NOFILE`.
    Mem = 0x0101_0000,
    /// The server did not answer the Proposal in time (SMC: `TIMEOUT_CL`).
    Timeout = 0x0201_0000,
    /// The two ends disagree about the state of the handshake.
    SyncErr = 0x0400_0000,
    /// The peer declined; its own reason is in the Decline's diagnosis.
    /// As in SMC, no Decline is sent back for it.
    PeerDecl = 0x0500_0000,
    /// An internal error on this side.
    IntErr = 0x0999_0000,
    /// The DMB token the peer named no longer exists.
    ErrRtok = 0x0999_0001,
    /// A socket option in use cannot be carried over SMC (e.g. `TCP_FASTOPEN`).
    OptUnsupp = 0x0306_0000,
    /// smclo extension: the SYN does not carry the mark the Proposal promised,
    /// so the TCP peer is not provably the proposer.
    MarkMismatch = 0x0A00_0001,
    /// smclo extension: the peer process has exited.
    PeerDead = 0x0A00_0002,
    /// smclo extension: the listener is in the connecting process itself,
    /// which cannot wait for its own `accept`.
    SelfConnect = 0x0A00_0003,
    /// smclo extension: the listener cannot read the SYN because
    /// `TCP_SAVE_SYN` is not set on it.
    NoSavedSyn = 0x0A00_0004,
    /// smclo extension: the peer sent a handshake message that does not parse.
    Protocol = 0x0A00_0005,
    /// smclo extension: the peer's user may not share this device: it is
    /// neither our uid nor a member of the device directory's group.
    PeerCred = 0x0A00_0006,
    /// smclo extension: a process (this one, or the peer that declined)
    /// changed its uid after it opened the device, and the device does not
    /// admit the new uid.
    UidChanged = 0x0A00_0007,
    /// smclo extension: the client announced the connection (its
    /// destination has no registered listener but may be translated to
    /// one on this host) and no server took the announcement: its server
    /// does not run smclo, or is off this host, or sees another source
    /// address than the client's own.
    Unanswered = 0x0A00_0008,
    /// smclo extension: the server found the client's announcement by its
    /// TCP timestamp, but sees the connection from another source address
    /// or port (source NAT or MASQUERADE on the way).
    SourceNat = 0x0A00_0009,
    /// smclo extension: the server passed the connection's descriptor to
    /// another process (`SCM_RIGHTS`: a primary handing accepted
    /// connections to its workers) before the handshake ended; shared
    /// memory cannot follow a descriptor into another process.
    Passed = 0x0A00_000A,
    /// smclo extension: the client did not propose, because its last
    /// connections to this destination through shared memory were short
    /// (a request or two and closed): setting one up costs more than it
    /// saves (`SMCLO_SHORT`). Now and then one proposes again.
    Short = 0x0A00_000B,
    /// smclo extension: the process uses io_uring, whose reads and writes
    /// do not go through the C library: smclo could not carry them.
    IoUring = 0x0A00_000C,
}

impl Reason {
    /// Number of reasons; the length of [`Reason::ALL`] and the number of
    /// per-reason counters in the device file.
    pub const COUNT: usize = 24;

    /// Every reason, in [`Reason::index`] order.
    ///
    /// This order numbers the per-reason counters in the shared device file,
    /// which processes of different smclo builds may map at the same time.
    /// NEVER reorder or remove entries: only append new ones at the end (and
    /// grow [`Reason::COUNT`] together with the device file layout).
    pub const ALL: [Reason; Reason::COUNT] = [
        Reason::PeerNoSmc,
        Reason::NoSmcdDev,
        Reason::NoSmcd2Dev,
        Reason::NoUeid,
        Reason::MaxDmb,
        Reason::Mem,
        Reason::Timeout,
        Reason::SyncErr,
        Reason::PeerDecl,
        Reason::IntErr,
        Reason::ErrRtok,
        Reason::OptUnsupp,
        Reason::MarkMismatch,
        Reason::PeerDead,
        Reason::SelfConnect,
        Reason::NoSavedSyn,
        Reason::Protocol,
        Reason::PeerCred,
        Reason::UidChanged,
        Reason::Unanswered,
        Reason::SourceNat,
        Reason::Passed,
        Reason::Short,
        Reason::IoUring,
    ];

    /// The reason code as SMC writes it (`peer_diagnosis`, `smcss`).
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The reason with this code, or `None` for a code smclo does not know
    /// (a peer may run a newer version, so this is not an error by itself).
    pub fn from_code(code: u32) -> Option<Reason> {
        Reason::ALL.iter().copied().find(|r| r.code() == code)
    }

    /// Stable position of this reason in [`Reason::ALL`] (0..[`Reason::COUNT`]),
    /// the index of its counter in the device file. Append-only, see
    /// [`Reason::ALL`].
    pub const fn index(self) -> usize {
        match self {
            Reason::PeerNoSmc => 0,
            Reason::NoSmcdDev => 1,
            Reason::NoSmcd2Dev => 2,
            Reason::NoUeid => 3,
            Reason::MaxDmb => 4,
            Reason::Mem => 5,
            Reason::Timeout => 6,
            Reason::SyncErr => 7,
            Reason::PeerDecl => 8,
            Reason::IntErr => 9,
            Reason::ErrRtok => 10,
            Reason::OptUnsupp => 11,
            Reason::MarkMismatch => 12,
            Reason::PeerDead => 13,
            Reason::SelfConnect => 14,
            Reason::NoSavedSyn => 15,
            Reason::Protocol => 16,
            Reason::PeerCred => 17,
            Reason::UidChanged => 18,
            Reason::Unanswered => 19,
            Reason::SourceNat => 20,
            Reason::Passed => 21,
            Reason::Short => 22,
            Reason::IoUring => 23,
        }
    }

    /// Short upper-case name, as `smcss` prints SMC's reasons.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::PeerNoSmc => "PEERNOSMC",
            Reason::NoSmcdDev => "NOSMCDDEV",
            Reason::NoSmcd2Dev => "NOSMCD2DEV",
            Reason::NoUeid => "NOUEID",
            Reason::MaxDmb => "MAX_DMB",
            Reason::Mem => "MEM",
            Reason::Timeout => "TIMEOUT",
            Reason::SyncErr => "SYNCERR",
            Reason::PeerDecl => "PEERDECL",
            Reason::IntErr => "INTERR",
            Reason::ErrRtok => "ERR_RTOK",
            Reason::OptUnsupp => "OPTUNSUPP",
            Reason::MarkMismatch => "MARK_MISMATCH",
            Reason::PeerDead => "PEER_DEAD",
            Reason::SelfConnect => "SELF_CONNECT",
            Reason::NoSavedSyn => "NO_SAVED_SYN",
            Reason::Protocol => "PROTOCOL",
            Reason::PeerCred => "PEER_CRED",
            Reason::UidChanged => "UID_CHANGED",
            Reason::Unanswered => "UNANSWERED",
            Reason::SourceNat => "SOURCE_NAT",
            Reason::Passed => "PASSED",
            Reason::Short => "SHORT",
            Reason::IoUring => "IO_URING",
        }
    }

    /// One sentence for users saying what happened.
    pub const fn description(self) -> &'static str {
        match self {
            Reason::PeerNoSmc => {
                "peer does not run smclo (no live smclo listener, or no proposal for this connection)"
            }
            Reason::NoSmcdDev => {
                "no usable smclo device (switched off by smclo dev set active=0, or unusable: its directory is not ours, its filesystem is full, or its file was truncated under this process)"
            }
            Reason::NoSmcd2Dev => "peer uses a different smclo device (GID mismatch)",
            Reason::NoUeid => "UEIDs differ (SMCLO_UEID)",
            Reason::MaxDmb => "no free rendezvous slot or DMB limit reached",
            Reason::Mem => "no memory or descriptors for a connection (out of memory, or smclo's share of RLIMIT_NOFILE used)",
            Reason::Timeout => "server did not answer within SMCLO_CLC_WAIT_MS",
            Reason::SyncErr => "handshake state out of sync",
            Reason::PeerDecl => "peer declined",
            Reason::IntErr => "internal error",
            Reason::ErrRtok => "peer's DMB token is gone",
            Reason::OptUnsupp => "socket option not supported with SMC (e.g. TCP_FASTOPEN)",
            Reason::MarkMismatch => "SYN does not carry the proposer's mark",
            Reason::PeerDead => "peer process is gone",
            Reason::SelfConnect => "connection to a listener in the same process",
            Reason::NoSavedSyn => "listener cannot read the SYN (TCP_SAVE_SYN not set)",
            Reason::Protocol => "peer sent an invalid handshake message",
            Reason::PeerCred => {
                "peer's user may not share this device (not our uid, not in the device directory's group)"
            }
            Reason::UidChanged => {
                "a process changed its uid after opening the device, which its new uid may not use"
            }
            Reason::Unanswered => {
                "no server took the client's announcement (a destination without a registered listener: a plain server, another host, or a server that sees a translated source)"
            }
            Reason::SourceNat => {
                "the server sees the client from a translated source address or port (SNAT, MASQUERADE)"
            }
            Reason::Passed => {
                "the server passed the connection's descriptor to another process (SCM_RIGHTS) before the handshake ended"
            }
            Reason::Short => {
                "the client's last connections to this destination were short: shared memory costs them more than it saves (SMCLO_SHORT)"
            }
            Reason::IoUring => {
                "the process uses io_uring, whose reads and writes smclo does not see (its connections stay TCP; SMCLO_IO_URING=files when it reads and writes only files with it)"
            }
        }
    }

    /// Whether this is one of smclo's own codes (range `0x0A00xxxx`) rather
    /// than one of SMC's.
    pub const fn is_smclo_extension(self) -> bool {
        self.code() >> 16 == 0x0A00
    }
}

impl From<Reason> for u32 {
    fn from(r: Reason) -> u32 {
        r.code()
    }
}

impl fmt::Display for Reason {
    /// `PEERNOSMC (0x03010000): peer does not run smclo (...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (0x{:08x}): {}",
            self.name(),
            self.code(),
            self.description()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn index_matches_position_in_all() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i, "{r:?}");
        }
    }

    /// Pins the counter numbering: a change here means the device file's
    /// counters would be misread by processes of another build.
    #[test]
    fn index_order_is_frozen() {
        let names: Vec<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(
            names,
            [
                "PEERNOSMC",
                "NOSMCDDEV",
                "NOSMCD2DEV",
                "NOUEID",
                "MAX_DMB",
                "MEM",
                "TIMEOUT",
                "SYNCERR",
                "PEERDECL",
                "INTERR",
                "ERR_RTOK",
                "OPTUNSUPP",
                "MARK_MISMATCH",
                "PEER_DEAD",
                "SELF_CONNECT",
                "NO_SAVED_SYN",
                "PROTOCOL",
                "PEER_CRED",
                "UID_CHANGED",
                "UNANSWERED",
                "SOURCE_NAT",
                "PASSED",
                "SHORT",
                "IO_URING",
            ]
        );
    }

    #[test]
    fn codes_match_smc() {
        let expect: [(Reason, u32); 17] = [
            (Reason::PeerNoSmc, 0x03010000),
            (Reason::NoSmcdDev, 0x03030001),
            (Reason::NoSmcd2Dev, 0x03030007),
            (Reason::NoUeid, 0x03030008),
            (Reason::MaxDmb, 0x030d0000),
            (Reason::Mem, 0x01010000),
            (Reason::Timeout, 0x02010000),
            (Reason::SyncErr, 0x04000000),
            (Reason::PeerDecl, 0x05000000),
            (Reason::IntErr, 0x09990000),
            (Reason::ErrRtok, 0x09990001),
            (Reason::OptUnsupp, 0x03060000),
            (Reason::MarkMismatch, 0x0A000001),
            (Reason::PeerDead, 0x0A000002),
            (Reason::SelfConnect, 0x0A000003),
            (Reason::NoSavedSyn, 0x0A000004),
            (Reason::Protocol, 0x0A000005),
        ];
        for (r, c) in expect {
            assert_eq!(r.code(), c, "{r:?}");
            assert_eq!(u32::from(r), c);
        }
    }

    #[test]
    fn codes_and_names_are_unique_and_round_trip() {
        let codes: HashSet<u32> = Reason::ALL.iter().map(|r| r.code()).collect();
        let names: HashSet<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(codes.len(), Reason::COUNT);
        assert_eq!(names.len(), Reason::COUNT);
        for r in Reason::ALL {
            assert_eq!(Reason::from_code(r.code()), Some(r));
            assert!(!r.description().is_empty());
            assert_eq!(r.name(), r.name().to_ascii_uppercase());
        }
    }

    #[test]
    fn unknown_codes_are_none() {
        for c in [0, 1, 0x03030000, 0x0A000000, 0x0A0000FF, u32::MAX] {
            assert_eq!(Reason::from_code(c), None, "0x{c:08x}");
        }
    }

    #[test]
    fn extensions_are_exactly_the_0a00_range() {
        let ext: Vec<Reason> = Reason::ALL
            .into_iter()
            .filter(|r| r.is_smclo_extension())
            .collect();
        assert_eq!(
            ext,
            [
                Reason::MarkMismatch,
                Reason::PeerDead,
                Reason::SelfConnect,
                Reason::NoSavedSyn,
                Reason::Protocol,
                Reason::PeerCred,
                Reason::UidChanged,
                Reason::Unanswered,
                Reason::SourceNat,
                Reason::Passed,
                Reason::Short,
                Reason::IoUring
            ]
        );
    }

    #[test]
    fn display() {
        assert_eq!(
            Reason::PeerNoSmc.to_string(),
            "PEERNOSMC (0x03010000): peer does not run smclo (no live smclo listener, \
             or no proposal for this connection)"
        );
        assert_eq!(
            Reason::MarkMismatch.to_string(),
            "MARK_MISMATCH (0x0a000001): SYN does not carry the proposer's mark"
        );
    }
}
