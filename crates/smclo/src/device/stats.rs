//! The device's counters (`smclo stats`): the file's own, and the gauges
//! and byte count read from its DMB table.

use super::dmb_table::{DMB_CONNECTED, DMB_STATES};
use super::{Device, Role};
use crate::table::Judge;
use smclo_wire::device_layout as layout;
use smclo_wire::reason::Reason;
use std::sync::atomic::Ordering;

/// A snapshot of the device's counters, as `smclo stats` prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// The device's GID.
    pub gid: u64,
    /// SMC-D connections opened since the last reset.
    pub conns_opened: u64,
    /// Connections with at least one live end (distinct token pairs).
    pub conns_active: u64,
    /// DMBs registered since the last reset.
    pub dmbs_registered: u64,
    /// DMBs registered now (live table entries).
    pub dmbs_cnt: u64,
    /// Bytes sent over SMC-D since the last reset.
    pub xfer_bytes: u64,
    /// Live listener registrations clients propose to.
    pub listeners: u64,
    /// Live declines: listening sockets whose process cannot serve SMC-D
    /// from them (it uses io_uring), whose clients connect over TCP.
    pub declines: u64,
    /// Client-side fallbacks, indexed by `Reason::index()`.
    pub fallback_client: [u64; layout::REASON_SLOTS as usize],
    /// Server-side fallbacks, indexed by `Reason::index()`.
    pub fallback_server: [u64; layout::REASON_SLOTS as usize],
}

impl Stats {
    /// (client side, server side) fallbacks for `r`.
    pub fn fallback(&self, r: Reason) -> (u64, u64) {
        (
            self.fallback_client[r.index()],
            self.fallback_server[r.index()],
        )
    }

    /// All fallbacks, both sides, every reason.
    pub fn fallbacks_total(&self) -> u64 {
        self.fallback_client
            .iter()
            .chain(&self.fallback_server)
            .sum()
    }
}

/// How long `stats` retries its sum of the byte counts while entries keep
/// retiring ([`Device::xfer_total`]).
const XFER_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

impl Device {
    /// Counts one SMC-D connection opened (call once per connection end
    /// pair, from the client side).
    pub fn count_conn_opened(&self) {
        self.u64_at(layout::off::CONNS_OPENED)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one fallback to TCP for `reason`, on the `side` that decided.
    pub fn count_fallback(&self, reason: Reason, side: Role) {
        let idx = reason.index();
        if idx >= layout::REASON_SLOTS as usize {
            return;
        }
        let base = match side {
            Role::Client => layout::off::FALLBACK_CLIENT,
            Role::Server => layout::off::FALLBACK_SERVER,
        };
        self.u64_at(base + 8 * idx).fetch_add(1, Ordering::Relaxed);
    }

    /// The counters of the device file and its DMB table, `listeners` left
    /// 0 (the listener table is [`crate::registry`]'s: [`Device::stats`],
    /// in [`crate::ss`], adds it). Also reclaims the DMB table entries of
    /// dead owners first, so that the gauges are right after kill -9.
    pub(crate) fn counters(&self) -> Stats {
        self.reclaim_dead_dmbs();
        let mut judge = Judge::new(&self.dir);
        let mut pairs = std::collections::HashSet::new();
        let mut dmbs_cnt = 0;
        for i in 0..layout::DMB_ENTRIES as usize {
            let e = self.dmb_entry(i);
            let w = e.head.word();
            if w.is_free() {
                continue;
            }
            if !DMB_STATES.contains(&w.state()) || judge.dead(&e.head, w) {
                continue;
            }
            dmbs_cnt += 1;
            if w.state() == DMB_CONNECTED {
                let (a, b) = (
                    e.token.load(Ordering::Relaxed),
                    e.peer_token.load(Ordering::Relaxed),
                );
                pairs.insert((a.min(b), a.max(b)));
            }
        }
        let total = self.xfer_total();
        let base = self.u64_at(layout::off::XFER_BASE).load(Ordering::Relaxed);
        let mut fallback_client = [0u64; layout::REASON_SLOTS as usize];
        let mut fallback_server = [0u64; layout::REASON_SLOTS as usize];
        for i in 0..layout::REASON_SLOTS as usize {
            fallback_client[i] = self
                .u64_at(layout::off::FALLBACK_CLIENT + 8 * i)
                .load(Ordering::Relaxed);
            fallback_server[i] = self
                .u64_at(layout::off::FALLBACK_SERVER + 8 * i)
                .load(Ordering::Relaxed);
        }
        Stats {
            gid: self.gid,
            conns_opened: self
                .u64_at(layout::off::CONNS_OPENED)
                .load(Ordering::Relaxed),
            conns_active: pairs.len() as u64,
            dmbs_registered: self
                .u64_at(layout::off::DMBS_REGISTERED)
                .load(Ordering::Relaxed),
            dmbs_cnt,
            xfer_bytes: total.saturating_sub(base),
            listeners: 0,
            declines: 0,
            fallback_client,
            fallback_server,
        }
    }

    /// Zeroes the counters (`smclo stats reset`). Gauges (active
    /// connections, DMBs in use) are not counters and stay.
    pub fn reset_stats(&self) {
        for off in [layout::off::CONNS_OPENED, layout::off::DMBS_REGISTERED] {
            self.u64_at(off).store(0, Ordering::Relaxed);
        }
        for i in 0..layout::REASON_SLOTS as usize {
            self.u64_at(layout::off::FALLBACK_CLIENT + 8 * i)
                .store(0, Ordering::Relaxed);
            self.u64_at(layout::off::FALLBACK_SERVER + 8 * i)
                .store(0, Ordering::Relaxed);
        }
        // xfer_bytes = retired + live - base: moving the base keeps the
        // per-entry byte counts (which the owners keep adding to) intact.
        self.u64_at(layout::off::XFER_BASE)
            .store(self.xfer_total(), Ordering::Relaxed);
    }

    /// Bytes sent over the device's connections since it was created: the
    /// retired total plus the live entries' counts, taken while no entry
    /// retired (the sequence was even and unchanged around the sum). Busy
    /// retirers only delay the sum (tried again for up to [`XFER_WAIT`]); a
    /// retirer killed halfway leaves the sequence odd for good: once it has
    /// stayed odd and unchanged for a few tries the last sum is taken, off
    /// by at most that entry's bytes.
    fn xfer_total(&self) -> u64 {
        const STUCK_TRIES: usize = 8;
        let seq = self.u64_at(layout::off::XFER_SEQ);
        let until = std::time::Instant::now() + XFER_WAIT;
        let (mut total, mut stuck, mut prev) = (0, 0, None);
        while stuck < STUCK_TRIES && std::time::Instant::now() < until {
            let s0 = seq.load(Ordering::Acquire);
            let mut live: u64 = 0;
            for i in 0..layout::DMB_ENTRIES as usize {
                let e = self.dmb_entry(i);
                if !e.head.word().is_free() {
                    live = live.wrapping_add(e.tx_bytes.load(Ordering::Acquire));
                }
            }
            total = self
                .u64_at(layout::off::XFER_RETIRED)
                .load(Ordering::Acquire)
                .wrapping_add(live);
            if s0.is_multiple_of(2) && seq.load(Ordering::Acquire) == s0 {
                break;
            }
            stuck = if prev == Some(s0) { stuck + 1 } else { 0 };
            prev = Some(s0);
            std::thread::yield_now();
        }
        total
    }
}
