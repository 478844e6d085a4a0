//! Pure byte layouts of smclo, apart from the state machines that use them.
//!
//! Nothing here does I/O or holds `unsafe`; every parser takes bytes written
//! by a peer that is not trusted and returns either a validated value or an
//! error naming what was wrong. The parsers are fuzzed (`fuzz/`).

#![forbid(unsafe_code)]

pub mod clc;
pub mod cursor;
pub mod device_layout;
pub mod dmb_header;
pub mod ends;
pub mod reason;
pub mod syn;
