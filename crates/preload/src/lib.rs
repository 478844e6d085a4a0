//! `libsmclo_preload.so`: run an unmodified, dynamically linked program with
//! `LD_PRELOAD=libsmclo_preload.so` (or `smclo run -- program`) and its TCP
//! connections to other smclo processes on this host go through shared
//! memory (SMC-D loopback), while all others stay plain TCP.
//!
//! This is a thin translation layer: the decision and the data path are the
//! core's ([`smclo::adapter::handshake`], [`smclo::adapter::conn::Conn`]). What lives here:
//!
//! - [`hooks`]: the interposed libc functions.
//! - [`table`]: each descriptor number's state (an SMC-D connection, a
//!   candidate, a pending handshake, a listener, ...), in one place.
//! - [`hints`]: facts about a descriptor's socket that spare system calls.
//! - [`sock`]: one SMC-D connection as this process sees it.
//! - [`shadow`]: the shadow of an epoll set with SMC-D members.
//! - [`cork`]: TCP's 200 ms ceiling on corked data.
//! - [`critical`]: the program's signal handlers wait while the table is locked.
//! - [`holders`]: which processes of a `fork` family hold a connection.
//! - [`stdio`]: C stdio streams on connections adopted through exec.
//! - [`real`]: the real libc functions behind ours.
//!
//! After an upgrade the application's descriptor is swapped (`dup3`) for a
//! duplicate of the connection's UNIX channel, so poll/epoll/select work
//! natively; the TCP socket stays open at a hidden descriptor for identity
//! and options. See `crates/preload/README.md` for fork, exec and the gaps.

// The exported functions have libc's own signatures and contracts (the
// caller passes valid buffers of the stated lengths, as for the real call);
// a `# Safety` section on each would repeat the libc manual page.
#![allow(clippy::missing_safety_doc)]

pub mod cork;
pub mod critical;
pub mod hints;
pub mod holders;
pub mod hooks;
pub mod real;
pub mod shadow;
pub mod sock;
pub mod stdio;
#[cfg(target_env = "musl")]
mod stdio_musl;
pub mod table;
