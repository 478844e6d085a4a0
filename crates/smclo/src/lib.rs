//! smclo: SMC-D loopback ("loopback-ism") in user space.
//!
//! TCP connections between smclo processes on one host (or containers that
//! share a device directory) are upgraded, out of band, to a pair of shared
//! memory rings (DMBs); a peer that does not run smclo keeps plain TCP and
//! never sees a byte of the handshake. See `docs/ARCHITECTURE.md`.
//!
//! This crate knows nothing about `LD_PRELOAD`; the preload library is a thin
//! translation layer over [`api`].
pub mod accept_spin;
pub mod access;
pub mod api;
pub mod chan_sys;
pub mod config;
pub mod conn;
pub mod debug;
pub mod deferred;
pub mod device;
pub mod dmb;
pub mod doorbell;
pub mod early_count;
pub mod error;
pub mod fallbacks;
pub mod fault;
pub mod fdnum;
pub mod handshake;
pub mod owner;
pub use dmb::pool;
pub mod poller;
pub mod registry;
pub mod rendezvous;
pub mod ring;
mod rng;
pub mod signal;
pub mod sockaddr;
pub mod ss;
pub mod table;
pub mod tcp_syn;
pub mod vault;
pub mod wait;

pub use error::{Error, Result};
