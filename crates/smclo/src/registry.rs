//! The listener registry: which smclo processes listen on which address.
//!
//! A client looks here before connecting: only if a live smclo listener
//! matches its destination does it publish a Proposal; otherwise it connects
//! as plain TCP and costs nothing more. Entries live in the device file
//! (1024 of them), in a window of [`PROBE`] entries starting at a hash of
//! the port, so that a lookup reads a bounded number of cache lines.
//!
//! Entries are kept with the protocol of [`crate::table`]: claimed,
//! filled, published LISTENING, released by the listener's guard. An entry
//! whose owner is gone is freed by whoever finds it; one of another pid
//! namespace only once that namespace has no process left on the device.
//!
//! A wildcard listener (`0.0.0.0`, `::`) is also registered under each
//! address its network namespace has when it starts listening
//! ([`sockaddr::namespace_addrs`]), as *aliases*: a client in another
//! namespace (another container on a bridge or veth) matches a listener
//! only by its exact address, and a container's server listens on the
//! wildcard. An alias is an address configured on an interface of this
//! host, so matching it proposes to nothing off the host; addresses added
//! later are not registered. `smclo ss -l` and the listener count show the
//! wildcard entry only.
//!
//! Before it registers, a listener sets its port's bit in the device's
//! port filter ([`layout::PORT_FILTER_WORDS`]), which is never cleared: a
//! client connecting to a port whose bit is clear (most connections to
//! plain servers and other hosts) reads one word instead of the port's
//! window of entries.
//!
//! A *decline* is an entry of its own ([`DECLINE`] in its `meta`), made
//! by a process that holds a listening socket but cannot serve SMC-D
//! connections from it (it uses io_uring, whose `accept` smclo never
//! sees): while the process lives, clients do not propose to the
//! registrations that may stand for that socket ([`may_share`]), whoever
//! made them and whenever. Its port's bit in the decline filter
//! ([`layout::DECLINE_FILTER_WORDS`]) is set first, so that a lookup on a
//! port without one reads nothing more.
//!
//! Matching ignores `IPV6_V6ONLY`: a listener on `::` is taken to accept
//! IPv4 too (the Linux default). A wrong guess only costs a Proposal that no
//! server answers, and the client falls back after its bounded wait.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::owner::{netns_inode, Owner};
use crate::sockaddr;
use crate::table::{Head, Holder, Judge, State, Ticket, Word};
use crate::tcp_syn::is_local;
use smclo_wire::device_layout as layout;
use smclo_wire::ends;
use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Entries examined per lookup or registration, from the port's hash on.
pub const PROBE: usize = 128;

const LISTENING: State = State(2);

/// `meta` bit of an alias entry: a concrete address of a wildcard
/// listener's namespace.
const ALIAS: u64 = 1 << 32;

/// `meta` bit of a decline: the entry names a listening socket whose
/// registrations clients must not propose to (see the module's
/// documentation).
const DECLINE: u64 = 1 << 33;

/// Declines of one socket published at most, so that a pool of workers
/// that each decline it cannot fill its port's window.
pub const MAX_DECLINES: usize = 8;

/// Aliases registered per wildcard listener at most: a namespace with many
/// addresses must not fill the port's window.
pub const MAX_ALIASES: usize = 8;

/// One listener entry (one cache line).
#[repr(C)]
pub(crate) struct ListenerEntry {
    head: Head,
    netns: AtomicU64,
    /// family (4 or 6) in bits 0..16, port in bits 16..32.
    meta: AtomicU64,
    addr: [AtomicU64; 2],
    _reserved: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<ListenerEntry>() == layout::LISTENER_ENTRY_LEN as usize);

fn entry(dev: &Device, i: usize) -> &ListenerEntry {
    let i = i % layout::LISTENER_ENTRIES as usize;
    dev.at(layout::LISTENER_OFF as usize + i * layout::LISTENER_ENTRY_LEN as usize)
}

/// The port filter's word and bit for `port`.
fn port_bit(dev: &Device, port: u16) -> (&AtomicU64, u64) {
    let bit = port as usize % (64 * layout::PORT_FILTER_WORDS);
    let word = dev.at::<AtomicU64>(layout::off::PORT_FILTER + bit / 64 * 8);
    (word, 1 << (bit % 64))
}

/// Notes in the port filter that a listener may be registered on `port`,
/// before its entry is published: a client that finds the bit clear would
/// not have found the entry either.
fn mark_port(dev: &Device, port: u16) {
    let (word, bit) = port_bit(dev, port);
    if word.load(Ordering::Relaxed) & bit == 0 {
        word.fetch_or(bit, Ordering::SeqCst);
    }
}

/// The decline filter's word and bit for `port`.
fn decline_bit(dev: &Device, port: u16) -> (&AtomicU64, u64) {
    let bit = port as usize % (64 * layout::DECLINE_FILTER_WORDS);
    let word = dev.at::<AtomicU64>(layout::off::DECLINE_FILTER + bit / 64 * 8);
    (word, 1 << (bit % 64))
}

/// Whether a decline may ever have been published on `port`.
fn port_may_decline(dev: &Device, port: u16) -> bool {
    let (word, bit) = decline_bit(dev, port);
    word.load(Ordering::Acquire) & bit != 0
}

/// Whether a listener may ever have been registered on `port`.
fn port_may_listen(dev: &Device, port: u16) -> bool {
    let (word, bit) = port_bit(dev, port);
    word.load(Ordering::Acquire) & bit != 0
}

/// Whether a listener may ever have been registered on the device, on any
/// port (the port filter has a bit set): whether a connection to a
/// destination without a listener may be translated to one on this host.
/// Reads the filter's words up to the first that is not zero.
pub fn any_port_listens(dev: &Device) -> bool {
    (0..layout::PORT_FILTER_WORDS).any(|i| {
        dev.at::<AtomicU64>(layout::off::PORT_FILTER + i * 8)
            .load(Ordering::Acquire)
            != 0
    })
}

/// An address in canonical form ([`ends::canon_ip`]), family widened to
/// the `meta` field's width.
fn canon(ip: IpAddr) -> (u64, [u8; 16]) {
    let (fam, b) = ends::canon_ip(ip);
    (fam as u64, b)
}

fn home(port: u16) -> usize {
    // Fibonacci hashing spreads neighbouring ports over the table.
    (crate::numhash::fib(port as u64) >> 32) as usize % layout::LISTENER_ENTRIES as usize
}

/// A live listener found by [`find_listener`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerInfo {
    /// The listening process.
    pub owner: Owner,
    /// Inode of its network namespace.
    pub netns: u64,
    /// The address it listens on (canonical: IPv4-mapped shown as IPv4).
    pub addr: SocketAddr,
}

impl ListenerInfo {
    /// Whether the listener is in the calling process: a connection to it
    /// from here cannot wait for its `accept` (reason `SELF_CONNECT`).
    pub fn is_self(&self) -> bool {
        self.owner == Owner::current()
    }

    /// Whether the listener is in the caller's network namespace.
    pub fn same_netns(&self) -> bool {
        self.netns == netns_inode()
    }
}

/// Keeps a listener registered; dropping it removes the registration
/// (and its aliases).
///
/// A copy inherited through `fork` does nothing when dropped in the child.
#[derive(Debug)]
pub struct ListenerGuard {
    dev: Arc<Device>,
    idx: usize,
    ticket: Ticket,
    aliases: Vec<ListenerGuard>,
}

impl ListenerGuard {
    /// Index of the entry (for diagnostics).
    pub fn index(&self) -> usize {
        self.idx
    }

    /// Whether this registration no longer stands for the listener: the
    /// process that made it closed its copy (the entry was released) or
    /// is gone (it exited, as a program that daemonizes after it listens),
    /// while a fork child still listens on the socket. Clients propose
    /// only to live registrations, so that child registers it again.
    fn lost(&self) -> bool {
        let e = entry(&self.dev, self.idx);
        let w = e.head.word();
        !self.ticket.matches(w) || Judge::fast(self.dev.dir()).dead(&e.head, w)
    }

    /// Whether this process made the registration, so that dropping this
    /// guard takes the listener out of the registry (a fork child's copy
    /// does not).
    pub fn is_own(&self) -> bool {
        self.ticket.pid() == crate::owner::current_pid()
    }

    /// The listening socket `fd`'s registration made again by this
    /// process, at the address it is bound to, when this one is
    /// [`lost`](Self::lost); `None` while it stands. Asked when the
    /// listener accepted a client that did not propose, as every client
    /// of a lost registration is: a connection that proposed pays nothing
    /// for it, and the one that finds the registration lost stays TCP.
    pub fn renewed(&self, fd: RawFd) -> Option<Result<ListenerGuard>> {
        if !self.lost() {
            return None;
        }
        crate::debug!(
            "fd {fd}: its listener's registration was lost (the process that made it closed it \
             or exited); registering again"
        );
        Some(
            sockaddr::local(fd)
                .map_err(Error::from)
                .and_then(|a| register_listener(&self.dev, a)),
        )
    }
}

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        let e = entry(&self.dev, self.idx);
        if let Some(c) = e.head.release(self.ticket, &Owner::current()) {
            e.head.free(c);
        }
    }
}

/// Records that this process listens on `addr` (in its network namespace);
/// a wildcard `addr` also under its namespace's addresses (aliases, as far
/// as there is room: a wildcard without them still serves its namespace).
///
/// Fails with `ENOSPC` when the [`PROBE`] entries of the port's window are
/// all held by live listeners.
pub fn register_listener(dev: &Device, addr: SocketAddr) -> Result<ListenerGuard> {
    mark_port(dev, addr.port());
    let mut guard = register_entry(dev, addr, 0)?;
    if addr.ip().is_unspecified() {
        let ips = sockaddr::namespace_addrs(addr.is_ipv6()).unwrap_or_else(|e| {
            crate::debug!("listener {addr}: addresses of its namespace unknown ({e})");
            Vec::new()
        });
        for ip in ips.into_iter().take(MAX_ALIASES) {
            let alias = SocketAddr::new(ip, addr.port());
            match register_entry(dev, alias, ALIAS) {
                Ok(g) => guard.aliases.push(g),
                Err(e) => crate::debug!("listener {addr}: alias {alias} not registered ({e})"),
            }
        }
    }
    Ok(guard)
}

/// One registry entry for `addr`, with `flags` in its `meta` word.
fn register_entry(dev: &Device, addr: SocketAddr, flags: u64) -> Result<ListenerGuard> {
    let me = Owner::current();
    let (fam, bytes) = canon(addr.ip());
    let h = home(addr.port());
    for attempt in 0..2 {
        for k in 0..PROBE {
            let i = (h + k) % layout::LISTENER_ENTRIES as usize;
            let e = entry(dev, i);
            let Some(claim) = e.head.claim(&me) else {
                continue;
            };
            e.netns.store(netns_inode(), Ordering::Relaxed);
            e.meta
                .store(fam | (addr.port() as u64) << 16 | flags, Ordering::Relaxed);
            for (cell, w) in e.addr.iter().zip(ends::to_words(bytes)) {
                cell.store(w, Ordering::Relaxed);
            }
            let ticket = e.head.publish(claim, LISTENING);
            crate::debug!("registered listener {addr} in entry {i}");
            return Ok(ListenerGuard {
                dev: dev.arc(),
                idx: i,
                ticket,
                aliases: Vec::new(),
            });
        }
        if attempt == 0 {
            reclaim_window(dev, h);
        }
    }
    Err(Error::Io(std::io::Error::from_raw_os_error(libc::ENOSPC)))
}

/// Frees entries of dead owners in the window starting at `h`.
fn reclaim_window(dev: &Device, h: usize) {
    let mut judge = Judge::new(dev.dir());
    for k in 0..PROBE {
        reclaim(&mut judge, entry(dev, h + k));
    }
}

/// Frees `e` if its owner is dead; returns whether it did.
fn reclaim(judge: &mut Judge<'_>, e: &ListenerEntry) -> bool {
    let Some(c) = judge.reclaim(&e.head, e.head.word()) else {
        return false;
    };
    e.head.free(c);
    true
}

/// The fields of a LISTENING entry after its head.
struct Fields {
    netns: u64,
    /// family (4 or 6) in bits 0..16, port in bits 16..32.
    meta: u64,
    addr: [u8; 16],
}

impl Fields {
    /// The port, from `meta`.
    fn port(&self) -> u16 {
        (self.meta >> 16) as u16
    }
}

/// The address in a LISTENING entry's fields; `None` for an unknown family.
fn listen_addr(meta: u64, addr: [u8; 16]) -> Option<SocketAddr> {
    let fam = u8::try_from(meta & 0xffff).ok()?;
    Some(SocketAddr::new(
        ends::ip_from(fam, addr)?,
        (meta >> 16) as u16,
    ))
}

/// A consistent copy of a LISTENING entry's word and fields, or `None` if
/// it is not LISTENING or changed while being read.
fn snapshot(e: &ListenerEntry) -> Option<(Word, Fields)> {
    e.head.read(
        |w| w.state() == LISTENING,
        || Fields {
            netns: e.netns.load(Ordering::Relaxed),
            meta: e.meta.load(Ordering::Relaxed),
            addr: ends::from_words(e.addr.each_ref().map(|a| a.load(Ordering::Relaxed))),
        },
    )
}

/// Where a LISTENING entry says a socket listens, for [`may_share`].
#[derive(Clone, Copy)]
struct Bound {
    netns: u64,
    fam: u64,
    addr: [u8; 16],
    /// Bound to its family's wildcard (an alias is not: it is one of a
    /// wildcard's addresses).
    wildcard: bool,
}

impl Bound {
    fn of(f: &Fields) -> Bound {
        Bound {
            netns: f.netns,
            fam: f.meta & 0xffff,
            addr: f.addr,
            wildcard: f.addr == [0u8; 16] && f.meta & ALIAS == 0,
        }
    }

    /// Whether a wildcard of this family takes connections to addresses
    /// of family `fam` (an IPv6 wildcard takes IPv4 too, `IPV6_V6ONLY`
    /// ignored as in [`find_listener`]).
    fn takes(&self, fam: u64) -> bool {
        self.fam == ends::FAMILY_V6 as u64 || fam == ends::FAMILY_V4 as u64
    }

    /// Whether a socket bound here takes connections to the destination
    /// address `bytes` of family `fam` (canonical).
    fn takes_dest(&self, fam: u64, bytes: [u8; 16]) -> bool {
        (self.fam == fam && self.addr == bytes) || (self.wildcard && self.takes(fam))
    }
}

/// Whether two entries on one port may stand for the same listening
/// socket, or for sockets among which the kernel picks (`SO_REUSEPORT`, or
/// a wildcard beside an exact address, which takes the address's
/// connections): the same network namespace, and the same address, or a
/// wildcard that takes the other's family.
fn may_share(a: &Bound, b: &Bound) -> bool {
    a.netns == b.netns
        && ((a.fam == b.fam && a.addr == b.addr)
            || (a.wildcard && a.takes(b.fam))
            || (b.wildcard && b.takes(a.fam)))
}

/// The live declines on `port` (none unless its bit in the decline
/// filter is set), freeing dead ones on the way.
fn port_declines(dev: &Device, port: u16, judge: &mut Judge<'_>) -> Vec<Bound> {
    if !port_may_decline(dev, port) {
        return Vec::new();
    }
    let h = home(port);
    (0..PROBE)
        .filter_map(|k| live_decline(judge, entry(dev, h + k)))
        .filter(|(_, f)| f.port() == port)
        .map(|(_, f)| Bound::of(&f))
        .collect()
}

/// `e` as a live decline, with its holder; a decline whose owner is gone
/// is freed.
fn live_decline(judge: &mut Judge<'_>, e: &ListenerEntry) -> Option<(Option<Holder>, Fields)> {
    let (w, f) = snapshot(e)?;
    (f.meta & DECLINE != 0 && !dead(judge, e, w)).then(|| (e.head.holder(w), f))
}

/// Declines, while the calling process lives or until the guard is
/// dropped, every registration that may stand for its listening socket
/// bound to `addr` ([`may_share`]), made before or after, for clients of
/// the addresses the socket takes: the process cannot serve SMC-D
/// connections from that socket. `None` when [`MAX_DECLINES`] processes
/// decline the same socket already: the decline stands while one of them
/// lives (a pool's workers each decline, and a pool that replaces them
/// declines again with each new one).
pub fn decline_listener(dev: &Device, addr: SocketAddr) -> Result<Option<ListenerGuard>> {
    let (word, bit) = decline_bit(dev, addr.port());
    if word.load(Ordering::Relaxed) & bit == 0 {
        word.fetch_or(bit, Ordering::SeqCst);
    }
    let (fam, bytes) = canon(addr.ip());
    let me = netns_inode();
    let same = port_declines(dev, addr.port(), &mut Judge::new(dev.dir()))
        .iter()
        .filter(|d| d.netns == me && d.fam == fam && d.addr == bytes)
        .count();
    if same >= MAX_DECLINES {
        return Ok(None);
    }
    register_entry(dev, addr, DECLINE).map(Some)
}

/// Finds a live smclo listener that accepts connections to `dest`: same
/// port, and the same address (a wildcard listener's aliases included)
/// or, in the caller's network namespace, the
/// family's wildcard (`0.0.0.0` for IPv4 destinations, `::` for any) when
/// `dest` is an address of that namespace ([`is_local`]), and that no
/// decline taking `dest` holds back ([`may_share`]). A
/// wildcard says nothing about where a destination is: matching it for any
/// address made clients propose, and mark their SYNs, to remote hosts that
/// happen to use the port, and in another namespace only the exact address
/// says that the listener is the destination. Listeners in the caller's
/// namespace and exact addresses are preferred. Entries of dead owners met
/// on the way are freed.
pub fn find_listener(dev: &Device, dest: SocketAddr) -> Option<ListenerInfo> {
    if !port_may_listen(dev, dest.port()) {
        return None;
    }
    let (dfam, dbytes) = canon(dest.ip());
    let port = dest.port();
    let my_ns = netns_inode();
    let mut judge = Judge::fast(dev.dir());
    // Where a decline may be on the port, the whole window is read once:
    // the declines that take `dest`, and every match.
    let may_decline = port_may_decline(dev, port);
    let mut declined: Vec<Bound> = Vec::new();
    let mut matches: Vec<(u32, ListenerInfo, Bound)> = Vec::new();
    let mut best: Option<(u32, ListenerInfo)> = None;
    // Asked once, and only when a wildcard could match.
    let mut local: Option<bool> = None;
    let h = home(port);
    for k in 0..PROBE {
        let e = entry(dev, h + k);
        let Some((w, f)) = snapshot(e) else {
            continue;
        };
        let Some(listen) = listen_addr(f.meta, f.addr).filter(|a| a.port() == port) else {
            continue;
        };
        if f.meta & DECLINE != 0 {
            if may_decline && Bound::of(&f).takes_dest(dfam, dbytes) && !dead(&mut judge, e, w) {
                declined.push(Bound::of(&f));
            }
            continue;
        }
        let Fields { netns, meta, addr } = f;
        let exact = meta & 0xffff == dfam && addr == dbytes;
        let wildcard = addr == [0u8; 16] && (listen.is_ipv6() || dfam == ends::FAMILY_V4 as u64);
        let mut dest_is_local = || *local.get_or_insert_with(|| is_local(dest));
        if !(exact || wildcard && netns == my_ns && dest_is_local()) {
            continue;
        }
        let Some(Holder::Known(owner)) = e.head.holder(w) else {
            continue;
        };
        if judge.owner_dead(owner) {
            reclaim(&mut judge, e);
            continue;
        }
        let score = 2 * (netns == my_ns) as u32 + exact as u32;
        let info = ListenerInfo {
            owner,
            netns,
            addr: listen,
        };
        if may_decline {
            matches.push((score, info, Bound::of(&f)));
            continue;
        }
        if best.as_ref().is_some_and(|(s, _)| *s >= score) {
            continue;
        }
        best = Some((score, info));
        if score == 3 {
            break;
        }
    }
    if may_decline {
        best = matches
            .into_iter()
            .filter(|(_, _, b)| !declined.iter().any(|d| may_share(d, b)))
            .fold(None, |best, (score, info, _)| match best {
                Some((s, _)) if s >= score => best,
                _ => Some((score, info)),
            });
    }
    best.map(|(_, i)| i)
}

/// Whether the owner of `e`, in word `w`, is gone (the entry is then
/// freed).
fn dead(judge: &mut Judge<'_>, e: &ListenerEntry, w: Word) -> bool {
    match e.head.holder(w) {
        Some(Holder::Known(owner)) if judge.owner_dead(owner) => {
            reclaim(judge, e);
            true
        }
        _ => false,
    }
}

/// Every live decline in the registry, with its holder.
fn all_declines(dev: &Device, judge: &mut Judge<'_>) -> Vec<(Option<Holder>, Fields)> {
    (0..layout::LISTENER_ENTRIES as usize)
        .filter_map(|i| live_decline(judge, entry(dev, i)))
        .collect()
}

/// Every live registration clients propose to (for `smclo ss -l` and
/// the stats' count): no aliases, no declines, none a decline holds
/// back; with each its holder and fields. Frees dead ones.
fn proposable(dev: &Device) -> Vec<(Option<Holder>, Fields)> {
    let mut judge = Judge::new(dev.dir());
    let declined: Vec<(u16, Bound)> = all_declines(dev, &mut judge)
        .iter()
        .map(|(_, f)| (f.port(), Bound::of(f)))
        .collect();
    let mut out = Vec::new();
    for i in 0..layout::LISTENER_ENTRIES as usize {
        let e = entry(dev, i);
        if e.head.word().is_free() || reclaim(&mut judge, e) {
            continue;
        }
        let Some((w, f)) = snapshot(e) else {
            continue;
        };
        let held_back = declined
            .iter()
            .any(|(p, d)| *p == f.port() && may_share(d, &Bound::of(&f)));
        if f.meta & (ALIAS | DECLINE) == 0 && !held_back {
            out.push((e.head.holder(w), f));
        }
    }
    out
}

/// Every live listener registration clients propose to (for `smclo ss
/// -l`), in table order, without aliases; frees dead ones.
pub fn listeners(dev: &Device) -> Vec<ListenerInfo> {
    proposable(dev).into_iter().filter_map(info).collect()
}

/// Every live decline (for `smclo ss -l`), in table order: the process
/// that declines and the address of its socket.
pub fn declines(dev: &Device) -> Vec<ListenerInfo> {
    all_declines(dev, &mut Judge::new(dev.dir()))
        .into_iter()
        .filter_map(info)
        .collect()
}

/// An entry's holder and fields as a [`ListenerInfo`], when its owner and
/// address are known.
fn info((holder, f): (Option<Holder>, Fields)) -> Option<ListenerInfo> {
    let Some(Holder::Known(owner)) = holder else {
        return None;
    };
    Some(ListenerInfo {
        owner,
        netns: f.netns,
        addr: listen_addr(f.meta, f.addr)?,
    })
}

/// Number of live listener registrations clients propose to, aliases not
/// counted (for stats); frees dead ones.
pub fn live_listeners(dev: &Device) -> u64 {
    proposable(dev).len() as u64
}

/// Makes a `SocketAddr` canonical: an IPv4-mapped IPv6 address becomes IPv4.
pub fn canonical_addr(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => SocketAddr::V6(SocketAddrV6::new(*v6.ip(), v6.port(), 0, 0)),
        },
        v4 => v4,
    }
}
