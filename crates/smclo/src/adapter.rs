//! What an adapter that puts unmodified programs on the core needs beyond
//! the public modules: the preload library (`crates/preload`) is one. It
//! translates the socket calls of a program it does not own, so it drives
//! what [`crate::api`] wraps: the handshake step by step around the
//! program's own `connect` and `accept`, connections adopted under the
//! program's descriptor numbers, its event loops' waits, smclo's
//! descriptors beside the program's, and signal handlers that interrupt a
//! spin.
//!
//! Exactly the items an adapter uses, grouped by the core module that
//! defines them (docs/ARCHITECTURE.md, "Layers of the core"), and
//! [`prime`], which an adapter calls before the program runs. The
//! `debug!` macro (`SMCLO_DEBUG`) is exported at the crate root.

/// Makes the process-wide values the core makes on first use (the debug
/// switch, the spin and pool settings read from the environment, the
/// announcements' home slot), before any signal
/// handler of the program can run: a handler whose call reached one while
/// its own thread was making it (a `OnceLock` being initialised) would
/// wait for that thread for ever. An adapter calls it once, at load.
pub fn prime() {
    crate::debug::enabled();
    crate::wait::spin_budget();
    crate::dmb::pool::limits();
    crate::rendezvous::announcements_home();
}

/// A blocking `accept` that polls its listening socket before it sleeps.
pub mod accept_spin {
    pub use crate::accept_spin::{accepted, before_accept, may_spin, peer_proposed, Spun};
}

/// The wait for another thread's few instructions, real-time waiters
/// included.
pub mod backoff {
    pub use crate::backoff::Backoff;
}

/// The system calls on a connection's channel, past the interposed names.
pub mod chan_sys {
    pub use crate::chan_sys::{fcntl, syscall, timespec};
}

/// One SMC-D connection end, and what it carries through `exec`.
pub mod conn {
    pub use crate::conn::{
        allow_holding, forbid_holding, Conn, ExecParts, ExecState, Mode, RecvFlags, SendFlags,
    };
    pub use crate::wait::spin_budget;
}

/// TCP sockets of ended connections, closed at the process's next wait.
pub mod deferred {
    pub use crate::deferred::{close_deferred, close_deferred_freeing, close_later, set_closer};
}

/// The bound on a client's early bytes.
pub mod early_count {
    pub use crate::early_count::EARLY_MAX;
}

/// The calling thread's `errno`, set and kept.
pub mod errno {
    pub use crate::errno::{get, kept, set};
}

/// The device's table of open fallback connections (`smclo ss -a`).
pub mod fallbacks {
    pub use crate::fallbacks::{client_lists, record, FallbackRecord, Known};
}

/// `SIGBUS` from shared files shrunk under smclo's mappings, and the
/// program's own `SIGBUS` actions kept behind the core's handler.
pub mod fault {
    pub use crate::fault::{
        around_exec, install, kernel_handler_mask, program_action, program_mask, use_sigaction,
        with_handler_view,
    };
}

/// smclo's descriptors: high numbers, counted against a budget, and the
/// program's own descriptor limit.
pub mod fdnum {
    pub use crate::fdnum::{
        app_limit, app_nofile, close_own, dup_high, floor, in_internal, internal, is_ours,
        set_app_nofile, widen, ForExec, Held,
    };
}

/// The handshake, driven by the adapter around the program's calls.
pub mod handshake {
    pub use crate::handshake::{
        client_propose_with, ClientProposal, Decision, Established, Looker, Pending, Polled,
        SocketFacts, TcpNews, Until, Wake,
    };
}

/// Process identity.
/// Maps keyed by the process's own numbers (the descriptor table's).
pub mod numhash {
    pub use crate::numhash::NumMap;
}

pub mod owner {
    pub use crate::owner::{current_pid, Owner};
}

/// Registers now the `fork` handlers the core otherwise registers on
/// first use (the process identity's, the random source's, the descriptor
/// vault's). glibc runs prepare handlers in the reverse order of their
/// registration and the others in order: an adapter that registers them
/// at load, and its own after them, has its prepare handler run before
/// theirs (it may still use the vault) and its child handler after them
/// (the child's own pid known), and the program's handlers, registered
/// later, outside all of them.
pub fn register_fork_handlers() {
    crate::owner::ensure_fork_hook();
    crate::rng::ensure_fork_hook();
    crate::vault::ensure_fork_hook();
}

/// The clock of every timed decision.
pub mod clock {
    pub use crate::clock::{now_ns, ns, since_ns};
}

/// Event-loop waits over connections and other descriptors.
pub mod poller {
    pub use crate::poller::{poll, Budget, Few, Member, Pace, Ready, KERNEL_EVERY};
}

/// The device's listener registry.
pub mod registry {
    pub use crate::registry::{decline_listener, register_listener, ListenerGuard};
}

/// Which signal handlers ran during a wait.
pub mod signal {
    pub use crate::signal::{handler_ran, Call, Handler, Watch};
}

/// Destinations whose connections end short: whether to propose.
pub mod short {
    pub use crate::short::{ended, propose};
}

/// Addresses of raw descriptors.
pub mod sockaddr {
    pub use crate::sockaddr::{from_raw, local, peer};
}

/// The SYN's mark and the saved SYN.
pub mod tcp_syn {
    pub use crate::tcp_syn::{is_mark_option, reset, save_syns, LeftMark};
}
