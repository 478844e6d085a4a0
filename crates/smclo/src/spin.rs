//! The one busy wait of smclo: every wait that spins before it sleeps
//! (a blocking read or write on its ring, `crate::conn`; an event loop,
//! `crate::poller` and the preload's `epoll`; a blocking `accept`,
//! `crate::accept_spin`; the handshake's waits) spins here, for a time its
//! caller takes from `SMCLO_SPIN_US` ([`crate::wait::spin_budget`]).
//!
//! A spin pays only while the CPU it burns would otherwise be idle: it
//! saves the peer's wake-up of a sleeper. Where runnable threads outnumber
//! CPUs (a process per connection, left to the scheduler), each spin
//! takes a CPU from a thread with work, whose request the spinner may be
//! waiting for. So spins give way:
//!
//! - **At most one spinner per CPU.** A thread spins only while it holds
//!   a spinner slot of the device (`SPIN_SLOTS` words in the header that
//!   every process using the device maps, one per CPU, [`slot_of`]), taken among the
//!   slots of the CPUs it may run on (`sched_getaffinity`), its current
//!   CPU's first. A thread allowed N CPUs finds at most N slots; when all
//!   are held it does not spin and sleeps at once, as over TCP.
//! - **A spin lets its CPU's other threads run.** After [`FIRST_YIELD`] of
//!   spinning, and again each time it has spun as long again (5, 10, 20,
//!   40 µs...), it calls `sched_yield`, which returns at once when no
//!   other thread waits for the CPU and otherwise runs one first (the
//!   kernel's busy poll stops on `need_resched()` the same way). Without it a
//!   spinner keeps the CPU for the scheduler's whole slice while the very
//!   thread it waits for (its peer, woken on the same CPU) cannot run: a
//!   ping-pong pair placed on one CPU exchanged a sixth of TCP's messages.
//!   A yield that ran other threads is a gap like any preemption (below).
//! - **A thread that yields into a long slice stops yielding.** A yield
//!   that kept the spinner off its CPU longer than [`LONG_YIELD`] handed
//!   it to a thread that keeps CPUs (a busy loop, a batch job) or to a
//!   crowd of them: the spinner then waited a whole slice (milliseconds)
//!   while what it waited for arrived without a doorbell, since a spinner
//!   needs none. After [`LONG_YIELDS`] such yields (less its spins whose
//!   yields all came straight back) a thread does not yield for [`QUIET`],
//!   twice that after one more, and so on up to [`QUIET`] ×
//!   2^[`QUIET_DOUBLINGS`]: its spins end where they would have yielded
//!   ([`FIRST_YIELD`]) and its waits sleep, as over TCP, and a wake-up
//!   takes the CPU back from a busy loop without waiting for its slice.
//!   A short spin still catches what comes within microseconds (eight
//!   backends on one CPU answer a client spinning on another that fast).
//! - **A preempted spin ends.** Two looks further apart than
//!   [`PREEMPTED`] on the monotonic clock mean the thread lost its CPU to
//!   another in between: the CPUs are contended. The spin ends at once
//!   and leaves its slot held, by no one, for as long as it was kept off
//!   its CPU (at most [`GIVE_WAY`]): while the contention lasts the
//!   device spins on fewer CPUs, and once it is over the slots free
//!   themselves. A short preemption (a thread woken for a moment) costs
//!   the CPU's spinners as short a pause.
//!
//! A slot holds the time (CLOCK_MONOTONIC nanoseconds, which every process
//! of the host shares) until which its holder may spin, not who holds it;
//! a slot whose time has passed is free. So a holder that dies (`kill
//! -9`), jumps out of its spin (`siglongjmp` from a handler) or is stopped
//! holds it no longer than the spin it took it for, and nothing needs to
//! know whether it is alive. A holder gives its slot back by a
//! compare-and-swap from its own time, which fails once the slot has
//! passed to another holder: a slot taken from under a holder whose time
//! is over never holds that time again (every later claim and give-way
//! writes a time later than the moment it is written, past that time),
//! so a late holder never frees or marks another's claim. A process
//! with no device yet uses slots of its own.

pub use crate::clock::now_ns;
use crate::clock::ns;
use crate::doorbell::Word;
use crate::signal::Watch;
use smclo_wire::device_layout::SPIN_SLOTS;
use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

/// A gap between two looks of a spin longer than this is a preemption
/// (a look costs at most a non-blocking system call, microseconds).
pub const PREEMPTED: Duration = Duration::from_micros(20);

/// How long a spin runs before it first lets its CPU's other runnable
/// threads go first (`sched_yield`): short next to a scheduler slice (a
/// peer on the same CPU waits no longer), long next to the system call.
/// Later yields come at doubling times, so that a long spin yields a few
/// times only: each yield moves the spinner's scheduling deadline a
/// slice later, which would otherwise hand its CPU to any busy loop.
pub const FIRST_YIELD: Duration = Duration::from_micros(5);

/// A yield that kept its thread off the CPU longer than this ran a thread
/// that keeps CPUs, or many: just under the shortest slice the scheduler
/// gives a busy loop (EEVDF's base slice, 0.75 ms, on one CPU; 1.5 ms on
/// two, and a thread yielding beside a busy loop here lost 2.4 ms each
/// time).
pub const LONG_YIELD: Duration = Duration::from_micros(700);

/// How long a thread does not yield after [`LONG_YIELDS`] long yields
/// ([`LONG_YIELD`]), at first.
pub const QUIET: Duration = Duration::from_millis(10);

/// Doublings of [`QUIET`] for further long yields, at most: against a
/// busy loop that stays, one probe (a slice lost) per 1.3 s.
pub const QUIET_DOUBLINGS: u32 = 7;

/// How long the slot of a preempted spin stays held by no one, at most
/// (as long as the spin was kept off its CPU, up to this): a few
/// wake-ups of the threads the spinner kept waiting.
pub const GIVE_WAY: Duration = Duration::from_millis(1);

thread_local! {
    /// When a spin of this thread last ended preempted (monotonic ns; 0:
    /// never).
    static PREEMPTED_AT: Cell<u64> = const { Cell::new(0) };
    /// This thread's long yields ([`LONG_YIELD`]): until when it does not
    /// yield (monotonic ns; 0: it yields), when the last was, and how many
    /// it counts (long ones less spins whose yields came straight back;
    /// [`LONG_YIELDS`] more than the doublings of [`QUIET`] at most).
    static LONG_YIELD_COUNT: Cell<Quiet> = const { Cell::new(Quiet { until: 0, last: 0, count: 0 }) };
}

/// A thread's count of long yields, [`LONG_YIELD_COUNT`].
#[derive(Clone, Copy)]
struct Quiet {
    until: u64,
    last: u64,
    count: u32,
}

/// Whether this thread is in the quiet time of a long yield
/// ([`LONG_YIELD`]) at `now`: its spins are short and do not yield.
fn quiet(now: u64) -> bool {
    now < LONG_YIELD_COUNT.with(Cell::get).until
}

/// Whether this thread is in the quiet time of long yields now: a wait
/// that spins by calling [`run`] or [`until`] again and again (the
/// handshake's) sleeps instead, since each call spins briefly and does not
/// yield.
pub fn quiet_now() -> bool {
    quiet(now_ns())
}

/// Long yields ([`LONG_YIELD`]) that start a quiet time, counted less
/// the spins whose yields all came straight back. Fewer are not a thread
/// that keeps the CPU: a crowd of short wake-ups sometimes runs that long
/// too (one yield in twenty to thirty, for eight postgres backends on one
/// CPU or redis-benchmark's two threads beside redis on two; one in ten
/// for memcslap's sixteen), and so does the host of a virtual machine
/// that runs another guest on this CPU meanwhile. Beside a busy loop
/// nearly every yield is long. Counted net, not strictly in a row: right
/// after its wake-up a thread's yields may come straight back even beside
/// a busy loop (the loop has used up its share), and such a spin must not
/// start the count again.
pub const LONG_YIELDS: u32 = 6;

/// Notes a yield of this thread that returned at `now` after more than
/// [`LONG_YIELD`] off its CPU: from the [`LONG_YIELDS`]th on, a quiet
/// time, doubled after each further one. A long yield more than the
/// longest quiet time after the last one starts a new count, so that an
/// old busy loop does not make a crowd's occasional long yield quiet.
fn yielded_long(now: u64) {
    LONG_YIELD_COUNT.with(|q| {
        let mut t = q.get();
        if now.saturating_sub(t.last) > ns(QUIET) << QUIET_DOUBLINGS {
            t.count = 0;
        }
        t.count = (t.count + 1).min(LONG_YIELDS + QUIET_DOUBLINGS);
        if let Some(d) = t.count.checked_sub(LONG_YIELDS) {
            t.until = now.saturating_add(ns(QUIET) << d);
        }
        t.last = now;
        q.set(t);
    });
}

/// Notes a spin of this thread whose yields all came straight back: one
/// long yield less. Counted per spin, not per yield (several may come
/// straight back in one spin).
fn yielded_short() {
    LONG_YIELD_COUNT.with(|q| {
        let mut t = q.get();
        t.count = t.count.saturating_sub(1);
        q.set(t);
    });
}

/// Whether a spin of this thread ended preempted within the last
/// [`GIVE_WAY`]: the CPUs it may run on are contended, and a longer spin
/// would not have caught what came soon after its sleep began (a waiter's
/// budget is not restored for it, [`crate::wait::Budget::woken`]). Reads
/// the clock only for a thread whose spin was ever preempted.
pub fn contended() -> bool {
    let at = PREEMPTED_AT.with(Cell::get);
    at != 0 && crate::clock::since_ns(at) < ns(GIVE_WAY)
}

/// How long a thread trusts what it read of its CPU affinity.
const AFFINITY_FRESH: Duration = Duration::from_secs(1);

/// The device's spinner slots, given by the first device the process
/// maps ([`use_table`]); null before.
static TABLE: AtomicPtr<[AtomicU64; SPIN_SLOTS]> = AtomicPtr::new(std::ptr::null_mut());

/// The slots of a process that has no device yet.
static OWN: [AtomicU64; SPIN_SLOTS] = [const { AtomicU64::new(0) }; SPIN_SLOTS];

/// Makes `slots` (a device's, mapped for the life of the process) the
/// process's spinner slots, unless a device gave its slots already.
pub fn use_table(slots: &'static [AtomicU64; SPIN_SLOTS]) {
    let p = slots as *const _ as *mut _;
    let _ = TABLE.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire);
}

/// The process's spinner slots.
pub fn table() -> &'static [AtomicU64; SPIN_SLOTS] {
    let p = TABLE.load(Ordering::Acquire);
    if p.is_null() {
        return &OWN;
    }
    // SAFETY: `use_table` stored a `&'static` reference.
    unsafe { &*p }
}

/// Slots per cache line.
const PER_LINE: usize = 8;

/// The slot of CPU `cpu`: consecutive CPUs (a server and its client
/// pinned side by side) on different cache lines, so that their takes
/// and give-backs do not move one line between them.
pub fn slot_of(cpu: usize) -> usize {
    let c = cpu % SPIN_SLOTS;
    let lines = SPIN_SLOTS / PER_LINE;
    (c % lines) * PER_LINE + c / lines
}

/// Slots as bits: bit `i` is slot `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slots(pub u128);

impl Slots {
    /// The slots of the CPUs in `set`.
    fn of(set: &libc::cpu_set_t) -> Slots {
        let mut bits = 0u128;
        for cpu in 0..libc::CPU_SETSIZE as usize {
            // SAFETY: `cpu` is below CPU_SETSIZE, the bits `set` holds.
            if unsafe { libc::CPU_ISSET(cpu, set) } {
                bits |= 1 << slot_of(cpu);
            }
        }
        Slots(bits)
    }

    /// How many slots.
    pub fn count(self) -> u32 {
        self.0.count_ones()
    }
}

const _: () = assert!(SPIN_SLOTS == u128::BITS as usize);

thread_local! {
    /// This thread's allowed slots and when they were read (0: never).
    static ALLOWED: Cell<(Slots, u64)> = const { Cell::new((Slots(0), 0)) };
}

/// The slots of the CPUs this thread may run on, read again once
/// [`AFFINITY_FRESH`] old.
fn allowed(now: u64) -> Slots {
    ALLOWED.with(|a| {
        let (s, at) = a.get();
        if at != 0 && now.saturating_sub(at) < ns(AFFINITY_FRESH) {
            return s;
        }
        let s = read_affinity();
        a.set((s, now));
        s
    })
}

/// The slots of this thread's CPU affinity (all, if it cannot be read).
fn read_affinity() -> Slots {
    // SAFETY: cpu_set_t is plain bits; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size given.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    match rc {
        0 => Slots::of(&set),
        _ => Slots(u128::MAX),
    }
}

/// The slot of the CPU this thread runs on.
fn current_slot() -> usize {
    // SAFETY: no arguments; -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    slot_of(usize::try_from(cpu).unwrap_or(0))
}

/// A spinner slot held until `until`; given back when dropped.
#[derive(Debug)]
pub struct Claim<'t, W: Word> {
    slots: &'t [W],
    slot: usize,
    until: u64,
    /// What the slot holds once given back: 0 (free), or a time until
    /// which it stays held by no one ([`Claim::give_way`]).
    then: u64,
}

/// Takes one of `allowed`'s slots of `slots` whose holder's time is over
/// at `now` (or that is free), trying `first` before the others, and
/// holds it until `until` (later than `now`). None: every allowed slot
/// is held.
pub fn claim<W: Word>(
    slots: &[W],
    allowed: Slots,
    first: usize,
    now: u64,
    until: u64,
) -> Option<Claim<'_, W>> {
    debug_assert!(until > now && slots.len() <= SPIN_SLOTS);
    let n = slots.len();
    (0..n)
        .map(|k| (first + k) % n)
        .filter(|i| allowed.0 & (1 << i) != 0)
        .find(|&i| take(&slots[i], now, until))
        .map(|slot| Claim {
            slots,
            slot,
            until,
            then: 0,
        })
}

/// Sets `slot` to `until` if its holder's time is over at `now` (or it is
/// free), trying again while the swap fails on a value that is still
/// free (a holder gave the slot back meanwhile, or another's time ran
/// out).
fn take<W: Word>(slot: &W, now: u64, until: u64) -> bool {
    let mut cur = slot.load();
    while cur <= now {
        match slot.cas(cur, until) {
            Ok(_) => return true,
            Err(seen) => cur = seen,
        }
    }
    false
}

impl<W: Word> Claim<'_, W> {
    /// The slot held.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Gives the slot back held by no one until `until`: the spin was
    /// preempted.
    pub fn give_way(mut self, until: u64) {
        self.then = until;
    }
}

impl<W: Word> Drop for Claim<'_, W> {
    fn drop(&mut self) {
        // Fails if the slot, expired, went to another holder: theirs.
        let _ = self.slots[self.slot].cas(self.until, self.then);
    }
}

/// Calls `look` until it finds something (`Some`) or fails, for at most
/// `time` after the first look, and until a signal handler that
/// `signals` watches runs (the wait then does not sleep,
/// [`Watch::check`]). A zero `time` does not spin (nor look); any other
/// looks at least once if the thread gets a spinner slot, and stops
/// early when preempted (see the module's documentation). First closes
/// the TCP sockets of ended connections ([`crate::deferred`]): a wait is
/// the process's idle moment.
pub fn run<T, E>(
    time: Duration,
    signals: Option<&Watch>,
    mut look: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    crate::deferred::close_deferred();
    if time.is_zero() {
        return Ok(None);
    }
    let start = now_ns();
    // A quiet thread spins no longer than it would before its first
    // yield, and does not yield.
    let may_yield = !quiet(start);
    let time = if may_yield {
        time
    } else {
        time.min(FIRST_YIELD)
    };
    let end = start.saturating_add(ns(time));
    let Some(held) = claim(table(), allowed(start), current_slot(), start, end) else {
        return Ok(None);
    };
    let mut last = start;
    let mut next_yield = start.saturating_add(ns(FIRST_YIELD));
    // Whether this spin's yields all came straight back (it yielded).
    let mut came_back = false;
    let r = loop {
        let r = look();
        let mut now = now_ns();
        if !matches!(r, Ok(None)) {
            break r;
        }
        if may_yield && now >= next_yield {
            let before = now;
            // SAFETY: no arguments; it only reorders the run queue.
            unsafe { libc::sched_yield() };
            now = now_ns();
            came_back = now - before <= ns(LONG_YIELD);
            if !came_back {
                yielded_long(now);
            }
            next_yield = now.saturating_add(now - start);
        }
        let gap = now.saturating_sub(last);
        if gap > ns(PREEMPTED) {
            held.give_way(now.saturating_add(gap.min(ns(GIVE_WAY))));
            PREEMPTED_AT.with(|p| p.set(now));
            break Ok(None);
        }
        if now >= end || signals.is_some_and(Watch::interrupted) {
            break Ok(None);
        }
        last = now;
        std::hint::spin_loop();
    };
    if came_back {
        yielded_short();
    }
    r
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
