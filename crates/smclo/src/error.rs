//! The error type of the core library.

use smclo_wire::device_layout::LayoutError;
use smclo_wire::dmb_header::DmbHeaderError;
use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in smclo's core.
///
/// I/O errors keep their errno so that the preload can hand it to the
/// application unchanged.
#[derive(Debug)]
pub enum Error {
    /// A system call failed.
    Io(io::Error),
    /// The device directory or file is not one this process may use:
    /// damaged, written by another version of smclo, or not private to us.
    Device(DeviceError),
    /// A peer's DMB descriptor was refused ([`crate::dmb::Dmb::attach_peer`]).
    Attach(AttachError),
    /// The peer wrote a value into shared memory that breaks the protocol
    /// (an impossible cursor, unknown flags). The connection is aborted.
    Protocol(String),
    /// A configuration value (environment variable or knob) is malformed.
    Config(String),
    /// The filesystem of the device directory `dir` has no room for the
    /// device file (`ENOSPC`, or `EDQUOT` for a quota): the device cannot be
    /// used and connections stay plain TCP.
    NoSpace {
        /// The device directory.
        dir: PathBuf,
        /// The failed call's error (its errno goes to errno-only callers).
        source: io::Error,
    },
}

/// Why the device in a directory cannot be used: the path and the problem.
#[derive(Debug)]
pub struct DeviceError {
    /// The device directory or the device file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub problem: DeviceProblem,
}

/// What is wrong with a device directory or file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceProblem {
    /// The directory path is something else.
    NotADirectory,
    /// The device file is a symbolic link.
    SymbolicLink,
    /// The device file is not a regular file.
    NotARegularFile,
    /// It belongs to `uid`, not to our effective uid.
    WrongOwner {
        /// The owner found.
        uid: u32,
        /// Our effective uid.
        ours: u32,
    },
    /// Others have access, or (a private device) the group has
    /// (`mode`, the permission bits).
    NotPrivate {
        /// The permission bits found.
        mode: u32,
    },
    /// A directory with group access that is not setgid: files created in
    /// it would not get the directory's group.
    GroupNotSetgid {
        /// The permission bits found.
        mode: u32,
    },
    /// A group device directory whose group the caller is not in.
    NotAMember {
        /// The directory's group.
        gid: u32,
        /// Our effective uid.
        uid: u32,
    },
    /// A private device directory where a group device directory is asked
    /// for.
    PrivateNotGroup,
    /// A file of a group device directory has another group than it.
    WrongGroup {
        /// The file's group.
        gid: u32,
        /// The directory's group.
        expected: u32,
    },
    /// The device header is invalid ([`smclo_wire::device_layout`]).
    Header(LayoutError),
    /// The device's CHID is not loopback-ism's.
    WrongChid(u16),
}

/// Why a peer's DMB was not attached. [`AttachError::TokenGone`] means the
/// DMB the peer named is not there (its descriptor holds another DMB now);
/// every other variant means the peer passed something invalid.
#[derive(Debug)]
pub enum AttachError {
    /// The descriptor is not a memfd carrying [`crate::dmb::REQUIRED_SEALS`]
    /// (`seals` as `F_GET_SEALS` returned them, negative if it failed).
    NotSealed {
        /// The seals found.
        seals: i32,
    },
    /// Not a regular file, or owned by a uid the device does not admit.
    NotOurs,
    /// The header could not be read.
    Unreadable(io::Error),
    /// The static header fields are invalid.
    BadHeader(DmbHeaderError),
    /// The file size is not the one its header implies.
    WrongSize {
        /// The file's size.
        size: u64,
        /// The size the header implies.
        expected: u64,
    },
    /// The header names another token: the DMB `wanted` is gone.
    TokenGone {
        /// The token the peer named.
        wanted: u64,
        /// The token in the header.
        found: u64,
    },
    /// The DMB belongs to another device.
    WrongGid {
        /// The GID in the header.
        found: u64,
    },
    /// Another peer maps it (its attach record is set).
    AlreadyAttached,
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::Device(e) => write!(f, "invalid smclo device: {e}"),
            Error::Attach(e) => write!(f, "peer's DMB refused: {e}"),
            Error::Protocol(m) => write!(f, "smclo protocol violation by peer: {m}"),
            Error::Config(m) => write!(f, "smclo configuration: {m}"),
            Error::NoSpace { dir, source } => write!(
                f,
                "no room for the smclo device in {}: {source}",
                dir.display()
            ),
        }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.path.display())?;
        match &self.problem {
            DeviceProblem::NotADirectory => write!(f, "not a directory"),
            DeviceProblem::SymbolicLink => write!(f, "is a symbolic link"),
            DeviceProblem::NotARegularFile => write!(f, "not a regular file"),
            DeviceProblem::WrongOwner { uid, ours } => {
                write!(f, "belongs to uid {uid}, not to us (uid {ours})")
            }
            DeviceProblem::NotPrivate { mode } => write!(
                f,
                "mode {mode:o}: others must have no access, and the group none unless the directory is a group device (a private device directory is 700 and its file 600; a group device directory is 2770, see smclo dev init --group)"
            ),
            DeviceProblem::GroupNotSetgid { mode } => write!(
                f,
                "mode {mode:o}: a directory with group access must be setgid (2770, see smclo dev init --group)"
            ),
            DeviceProblem::NotAMember { gid, uid } => write!(
                f,
                "a group device of gid {gid}, and uid {uid} is not a member of that group"
            ),
            DeviceProblem::PrivateNotGroup => write!(
                f,
                "a private device directory (mode 700), not a group device: remove it or choose another directory"
            ),
            DeviceProblem::WrongGroup { gid, expected } => write!(
                f,
                "has group {gid}, not group {expected}"
            ),
            DeviceProblem::Header(e) => write!(f, "{e}"),
            DeviceProblem::WrongChid(c) => write!(f, "CHID {c:#06x} is not loopback-ism's {:#06x}", smclo_wire::clc::CHID_LOOPBACK),
        }
    }
}

impl fmt::Display for AttachError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttachError::NotSealed { seals } => write!(
                f,
                "the descriptor is not a memfd sealed against resizing (seals {seals:#x})"
            ),
            AttachError::NotOurs => {
                write!(f, "not a regular file owned by a user of this device")
            }
            AttachError::Unreadable(e) => write!(f, "cannot read its header: {e}"),
            AttachError::BadHeader(e) => write!(f, "{e}"),
            AttachError::WrongSize { size, expected } => {
                write!(f, "file is {size} bytes, its header says {expected}")
            }
            AttachError::TokenGone { wanted, found } => write!(
                f,
                "DMB {wanted:016x} is gone: the descriptor holds DMB {found:016x}"
            ),
            AttachError::WrongGid { found } => {
                write!(f, "belongs to device GID {found:016x}, not ours")
            }
            AttachError::AlreadyAttached => write!(f, "already attached by another peer"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) | Error::NoSpace { source: e, .. } => Some(e),
            Error::Attach(AttachError::Unreadable(e)) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<DeviceError> for Error {
    fn from(e: DeviceError) -> Self {
        Error::Device(e)
    }
}

impl From<AttachError> for Error {
    fn from(e: AttachError) -> Self {
        Error::Attach(e)
    }
}

impl From<Error> for io::Error {
    /// Protocol violations become `EPROTO`, device and DMB problems
    /// `EINVAL` (`InvalidData`, carrying the [`Error`]), so a caller that
    /// only speaks errno still gets a precise one.
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) | Error::NoSpace { source: e, .. } => e,
            // io::Error cannot carry both a message and an errno: the errno
            // goes to the caller, the message to the debug log.
            Error::Protocol(m) => {
                crate::debug::log(format_args!("{}", Error::Protocol(m)));
                io::Error::from_raw_os_error(libc::EPROTO)
            }
            e @ (Error::Device(_) | Error::Attach(_)) => {
                io::Error::new(io::ErrorKind::InvalidData, e)
            }
            Error::Config(m) => io::Error::new(io::ErrorKind::InvalidInput, Error::Config(m)),
        }
    }
}
