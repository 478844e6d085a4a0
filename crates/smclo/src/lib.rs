//! smclo: SMC-D loopback ("loopback-ism") in user space.
//!
//! TCP connections between smclo processes on one host (or containers that
//! share a device directory) are upgraded, out of band, to a pair of shared
//! memory rings (DMBs); a peer that does not run smclo keeps plain TCP and
//! never sees a byte of the handshake. See `docs/ARCHITECTURE.md`.
//!
//! This crate knows nothing about `LD_PRELOAD`. Programs use the native
//! API, [`api`], with [`config`], [`device`], [`error`] and [`ss`] (what the
//! command line tool shows). An adapter that puts programs it does not own
//! on the core, as the preload library does, uses [`adapter`] as well.
//! Everything else is the crate's own; [`testing`] lays it open to the
//! programs that test it, and is no interface.

pub mod api;
pub mod config;
pub mod device;
pub mod error;
pub mod ss;

pub mod adapter;
/// Public only for the expansion of the exported `debug!` macro.
#[doc(hidden)]
pub mod debug;
#[doc(hidden)]
pub mod testing;

mod accept_spin;
mod access;
mod announced;
mod backoff;
mod chan_sys;
mod clock;
mod conn;
mod deferred;
mod dmb;
mod doorbell;
mod early_count;
mod errno;
mod fallbacks;
mod fault;
mod fdnum;
mod handshake;
mod numhash;
mod owner;
mod poller;
mod registry;
mod rendezvous;
mod ring;
mod rng;
mod short;
mod signal;
mod sockaddr;
mod spin;
mod table;
mod tcp_syn;
mod vault;
mod wait;

pub use error::{Error, Result};
