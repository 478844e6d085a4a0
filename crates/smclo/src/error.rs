//! The error type of the core library.

use std::fmt;
use std::io;

/// Everything that can go wrong in smclo's core.
///
/// I/O errors keep their errno so that the preload can hand it to the
/// application unchanged.
#[derive(Debug)]
pub enum Error {
    /// A system call failed.
    Io(io::Error),
    /// The device file (or a DMB header) is not one this version understands:
    /// corrupted, truncated, or written by another version of smclo.
    InvalidDevice(String),
    /// The peer wrote a value into shared memory that breaks the protocol
    /// (an impossible cursor, unknown flags). The connection is aborted.
    Protocol(String),
    /// A configuration value (environment variable or knob) is malformed.
    Config(String),
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::InvalidDevice(m) => write!(f, "invalid smclo device: {m}"),
            Error::Protocol(m) => write!(f, "smclo protocol violation by peer: {m}"),
            Error::Config(m) => write!(f, "smclo configuration: {m}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<Error> for io::Error {
    /// Protocol violations become `EPROTO`, device problems `EINVAL`, so a
    /// caller that only speaks errno still gets a precise one.
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) => e,
            // io::Error cannot carry both a message and an errno: the errno
            // goes to the caller, the message to the debug log.
            Error::Protocol(m) => {
                crate::debug::log(format_args!("{}", Error::Protocol(m)));
                io::Error::from_raw_os_error(libc::EPROTO)
            }
            Error::InvalidDevice(m) => {
                io::Error::new(io::ErrorKind::InvalidData, Error::InvalidDevice(m))
            }
            Error::Config(m) => io::Error::new(io::ErrorKind::InvalidInput, Error::Config(m)),
        }
    }
}
