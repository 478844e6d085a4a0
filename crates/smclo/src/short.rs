//! Destinations whose connections end short (docs/handshake.md "Short
//! connections"): a client learns, per destination address and port, that
//! its connections there carry a request or two and close, and then stops
//! proposing to it for a while: setting up shared memory costs such a
//! connection more CPU than it saves, so TCP serves it better. As the
//! kernel's SMC leaves it to a policy whether a connection tries SMC
//! (`smc_hs_ctrl`), smclo decides from what the destination's own
//! connections did.
//!
//! - A connection through shared memory is *short* when it made at most
//!   [`SHORT_CALLS`] sends and [`SHORT_CALLS`] reads that returned data,
//!   and moved less than [`SHORT_BYTES`] ([`is_short`]). A stream, a
//!   subscription or a connection reused for a few requests is not.
//! - After [`LEARN_AFTER`] short ones in a row, the next [`FIRST_SKIP`]
//!   connections to the destination go as TCP without a proposal (SHORT,
//!   counted at the client). The one after proposes again: if it is short
//!   too, twice as many go as TCP (up to [`MAX_SKIP`]); a connection that is
//!   not short forgets the destination, and every later one proposes.
//! - Per process, at most [`ENTRIES`] destinations (the least recently
//!   used one goes). The lock is only ever tried (a fork child never waits
//!   for a thread that does not exist in it): contention proposes, and
//!   leaves the ending connection unrecorded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Most sends, and most reads that returned data, of a short connection.
pub const SHORT_CALLS: u32 = 2;
/// A short connection moved fewer bytes than this, both ways together.
pub const SHORT_BYTES: u64 = 64 << 10;
/// Short connections in a row before the destination's next ones go as TCP.
pub const LEARN_AFTER: u32 = 16;
/// Connections that go as TCP after the destination was first learnt short.
pub const FIRST_SKIP: u32 = 64;
/// The most connections that go as TCP between two proposals.
pub const MAX_SKIP: u32 = 4096;
/// Destinations remembered per process.
pub const ENTRIES: usize = 256;

/// Whether a connection through shared memory that made `sends` sends and
/// `reads` reads that returned data, moving `bytes` both ways, was short.
pub fn is_short(sends: u32, reads: u32, bytes: u64) -> bool {
    sends <= SHORT_CALLS && reads <= SHORT_CALLS && bytes < SHORT_BYTES
}

/// What is known of one destination.
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    /// Short connections in a row, until learnt.
    run: u32,
    /// Connections still to go as TCP.
    skip: u32,
    /// How many go as TCP after the next short proposal; 0 until learnt.
    next_skip: u32,
    /// When last used ([`Ledger::tick`]), for the least recently used.
    used: u64,
}

/// The destinations of one process.
#[derive(Debug, Default)]
pub struct Ledger {
    map: HashMap<SocketAddr, Entry>,
    tick: u64,
}

impl Ledger {
    /// Whether the next connection to `dest` proposes (`false`: it goes as
    /// TCP, SHORT).
    pub fn propose(&mut self, dest: SocketAddr) -> bool {
        let Some(e) = self.map.get_mut(&dest) else {
            return true;
        };
        if e.skip == 0 {
            return true;
        }
        e.skip -= 1;
        false
    }

    /// A connection to `dest` through shared memory ended, `short` or not.
    pub fn ended(&mut self, dest: SocketAddr, short: bool) {
        if !short {
            self.map.remove(&dest);
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        if !self.map.contains_key(&dest) && self.map.len() >= ENTRIES {
            self.evict();
        }
        let e = self.map.entry(dest).or_default();
        e.used = tick;
        if e.next_skip > 0 {
            // A proposal after a run of TCP ones: still short.
            e.skip = e.next_skip;
            e.next_skip = e.next_skip.saturating_mul(2).min(MAX_SKIP);
            return;
        }
        e.run += 1;
        if e.run >= LEARN_AFTER {
            e.run = 0;
            e.skip = FIRST_SKIP;
            e.next_skip = (FIRST_SKIP * 2).min(MAX_SKIP);
        }
    }

    /// Forgets the least recently used destination.
    fn evict(&mut self) {
        if let Some(old) = self.map.iter().min_by_key(|(_, e)| e.used).map(|(d, _)| *d) {
            self.map.remove(&old);
        }
    }
}

static LEDGER: Mutex<Option<Ledger>> = Mutex::new(None);
/// Whether the ledger was ever written: until then a connection asks no
/// lock.
static USED: AtomicBool = AtomicBool::new(false);

/// [`Ledger::propose`] on the process's ledger (`true` when its lock is
/// busy).
pub fn propose(dest: SocketAddr) -> bool {
    if !USED.load(Ordering::Relaxed) {
        return true;
    }
    match LEDGER.try_lock() {
        Ok(mut g) => g.get_or_insert_with(Ledger::default).propose(dest),
        Err(_) => true,
    }
}

/// [`Ledger::ended`] on the process's ledger (nothing when its lock is
/// busy).
pub fn ended(dest: SocketAddr, short: bool) {
    if !short && !USED.load(Ordering::Relaxed) {
        return;
    }
    if let Ok(mut g) = LEDGER.try_lock() {
        USED.store(true, Ordering::Relaxed);
        g.get_or_insert_with(Ledger::default).ended(dest, short);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// How many of the next `n` connections to `d` propose, each ending
    /// `short`.
    fn proposals(l: &mut Ledger, d: SocketAddr, n: u32, short: bool) -> u32 {
        let mut p = 0;
        for _ in 0..n {
            if l.propose(d) {
                p += 1;
                l.ended(d, short);
            }
        }
        p
    }

    #[test]
    fn short_means_few_calls_and_few_bytes() {
        assert!(is_short(1, 1, 200));
        assert!(is_short(SHORT_CALLS, SHORT_CALLS, SHORT_BYTES - 1));
        assert!(!is_short(SHORT_CALLS + 1, 1, 200));
        assert!(!is_short(1, SHORT_CALLS + 1, 200));
        assert!(!is_short(1, 1, SHORT_BYTES));
    }

    #[test]
    fn a_destination_is_learnt_after_a_run_of_short_connections() {
        let mut l = Ledger::default();
        let d = dest(1);
        assert_eq!(proposals(&mut l, d, LEARN_AFTER, true), LEARN_AFTER);
        // Then FIRST_SKIP go as TCP, and the one after proposes.
        assert_eq!(proposals(&mut l, d, FIRST_SKIP, true), 0);
        assert_eq!(proposals(&mut l, d, 1, true), 1);
        // Still short: twice as many go as TCP.
        assert_eq!(proposals(&mut l, d, 2 * FIRST_SKIP + 1, true), 1);
        // Another destination is not affected.
        assert!(l.propose(dest(2)));
    }

    #[test]
    fn a_connection_that_is_not_short_forgets_the_destination() {
        let mut l = Ledger::default();
        let d = dest(1);
        proposals(&mut l, d, LEARN_AFTER - 1, true);
        proposals(&mut l, d, 1, false);
        // The run starts again.
        assert_eq!(proposals(&mut l, d, LEARN_AFTER - 1, true), LEARN_AFTER - 1);
        assert!(l.propose(d));
        l.ended(d, true);
        assert_eq!(proposals(&mut l, d, FIRST_SKIP, true), 0);
        // The probe is long: every later connection proposes.
        assert_eq!(proposals(&mut l, d, 1, false), 1);
        assert_eq!(proposals(&mut l, d, 10, false), 10);
    }

    #[test]
    fn the_skip_doubles_up_to_its_bound() {
        let mut l = Ledger::default();
        let d = dest(1);
        proposals(&mut l, d, LEARN_AFTER, true);
        let mut total = 0;
        for _ in 0..20 {
            total += proposals(&mut l, d, MAX_SKIP + 1, true);
        }
        // Once the bound is reached, one proposal per MAX_SKIP + 1.
        let e = l.map[&d];
        assert_eq!(e.next_skip, MAX_SKIP);
        assert!(total >= 20, "{total}");
    }

    #[test]
    fn the_least_recently_used_destination_goes() {
        let mut l = Ledger::default();
        for p in 0..ENTRIES as u16 + 1 {
            l.ended(dest(p), true);
        }
        assert_eq!(l.map.len(), ENTRIES);
        assert!(!l.map.contains_key(&dest(0)));
        assert!(l.map.contains_key(&dest(ENTRIES as u16)));
    }
}
