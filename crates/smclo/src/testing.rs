//! Not an interface: every internal module of the core, re-exported whole
//! for the programs that test or measure the internals directly (this
//! crate's integration tests, loom models, example and `smclo-testpeer`,
//! and the application tests). Hidden from the documentation; nothing
//! here is kept stable. Programs use [`crate::api`] (or, adapters,
//! [`crate::adapter`]).

pub mod accept_spin {
    pub use crate::accept_spin::*;
}
pub mod access {
    pub use crate::access::*;
}
pub mod attach_record {
    pub use crate::dmb::attach_record::*;
}
pub mod chan_sys {
    pub use crate::chan_sys::*;
}
pub mod conn {
    pub use crate::conn::*;
}
pub mod numhash {
    pub use crate::numhash::*;
}
pub mod deferred {
    pub use crate::deferred::*;
}
pub mod dmb {
    pub use crate::dmb::*;
}
pub mod doorbell {
    pub use crate::doorbell::*;
}
/// The announcement map (`crates/smclo/tests/loom_announced.rs`).
pub mod announced {
    pub use crate::announced::*;
}

pub mod early_count {
    pub use crate::early_count::*;
}
pub mod fallbacks {
    pub use crate::fallbacks::*;
}
pub mod fault {
    pub use crate::fault::*;
}
pub mod fdnum {
    pub use crate::fdnum::*;
}
pub mod handshake {
    pub use crate::handshake::*;
}
pub mod owner {
    pub use crate::owner::*;
}
pub mod poller {
    pub use crate::poller::*;
}
pub mod pool {
    pub use crate::dmb::pool::*;
}
pub mod registry {
    pub use crate::registry::*;
}
pub mod rendezvous {
    pub use crate::rendezvous::*;
}
pub mod ring {
    pub use crate::ring::*;
}
pub mod short {
    pub use crate::short::*;
}
pub mod signal {
    pub use crate::signal::*;
}
pub mod sockaddr {
    pub use crate::sockaddr::*;
}
pub mod spin {
    pub use crate::spin::*;
}
pub mod table {
    pub use crate::table::*;
}
pub mod tcp_syn {
    pub use crate::tcp_syn::*;
}
pub mod vault {
    pub use crate::vault::*;
}
pub mod wait {
    pub use crate::wait::*;
}
