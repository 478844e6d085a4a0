//! The one busy wait of smclo: every wait that spins before it sleeps
//! (a blocking read or write on its ring, `crate::conn`; an event loop,
//! `crate::poller` and the preload's `epoll`; a blocking `accept`,
//! `crate::accept_spin`; the handshake's waits) spins here, for a time its
//! caller takes from `SMCLO_SPIN_US` ([`crate::wait::spin_budget`]).

use crate::signal::Watch;
use std::time::{Duration, Instant};

/// Calls `look` until it finds something (`Some`) or fails, for at most
/// `time` after the first look, and until a signal handler that
/// `signals` watches runs (the wait then does not sleep,
/// [`Watch::check`]). A zero `time` does not spin (nor look); any other
/// looks at least once. First closes the TCP sockets of ended
/// connections ([`crate::deferred`]): a wait is the process's idle
/// moment.
pub fn run<T, E>(
    time: Duration,
    signals: Option<&Watch>,
    mut look: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    crate::deferred::close_deferred();
    if time.is_zero() {
        return Ok(None);
    }
    let start = Instant::now();
    loop {
        match look() {
            Ok(None) if start.elapsed() < time && !signals.is_some_and(Watch::interrupted) => {
                std::hint::spin_loop()
            }
            r => return r,
        }
    }
}

/// [`run`] for a `look` that cannot fail.
pub fn until<T>(
    time: Duration,
    signals: Option<&Watch>,
    mut look: impl FnMut() -> Option<T>,
) -> Option<T> {
    let r: Result<Option<T>, std::convert::Infallible> = run(time, signals, || Ok(look()));
    match r {
        Ok(v) => v,
        Err(never) => match never {},
    }
}
