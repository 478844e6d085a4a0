//! The spinner slots (`smclo::testing::spin`): no more threads spin at
//! once than the CPUs they may run on, a thread that finds its CPUs'
//! slots held does not spin, a preempted spin's slot stays held for a
//! while, a spin lets the threads waiting for its CPU run, and a
//! spinner that dies (`kill -9`) holds its slot no longer
//! than the spin it took it for.

mod common;
use common::{spawn_child, TempDir};
use smclo::device::Device;
use smclo::testing::spin::{self, claim, Slots};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The process's spinner slots are one table: the tests that use it take
/// turns.
static TABLE: Mutex<()> = Mutex::new(());

/// How long the child's spins last (it spins again after each).
const CHILD_SPIN: Duration = Duration::from_millis(300);

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    match role.as_str() {
        "spinner" => {
            let _dev = Device::open(&dir).unwrap();
            println!("READY");
            loop {
                spin::until(CHILD_SPIN, None, || None::<()>);
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn slots(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

#[test]
fn a_thread_allowed_n_cpus_finds_at_most_n_slots() {
    let t = slots(8);
    // Allowed: slots 1, 4 and 6 (three CPUs).
    let allowed = Slots(0b0101_0010);
    let held: Vec<_> = (0..3)
        .map(|_| claim(&t, allowed, 0, 100, 200).expect("a free allowed slot"))
        .collect();
    let mut got: Vec<usize> = held.iter().map(|c| c.slot()).collect();
    got.sort();
    assert_eq!(got, [1, 4, 6]);
    assert!(
        claim(&t, allowed, 0, 100, 200).is_none(),
        "a fourth spinner on three CPUs"
    );
    // Another thread's CPUs are other slots.
    assert_eq!(claim(&t, Slots(0b1), 0, 100, 200).unwrap().slot(), 0);
    // The current CPU's slot first.
    drop(held);
    assert_eq!(claim(&t, allowed, 4, 100, 200).unwrap().slot(), 4);
    assert!(
        t.iter().all(|w| w.load(Ordering::SeqCst) == 0),
        "given back"
    );
}

#[test]
fn a_slot_whose_time_is_over_is_free_and_its_old_holder_cannot_free_it() {
    let t = slots(1);
    let all = Slots(1);
    let old = claim(&t, all, 0, 100, 200).unwrap();
    assert!(claim(&t, all, 0, 199, 300).is_none(), "within its time");
    let new = claim(&t, all, 0, 200, 300).expect("the old holder's time is over");
    // The old holder, descheduled past its time, gives its slot back:
    // not the new holder's.
    drop(old);
    assert_eq!(t[0].load(Ordering::SeqCst), 300);
    assert!(claim(&t, all, 0, 250, 400).is_none());
    drop(new);
    assert_eq!(t[0].load(Ordering::SeqCst), 0);
}

#[test]
fn a_preempted_spin_leaves_its_slot_held_for_a_while() {
    let t = slots(1);
    let all = Slots(1);
    claim(&t, all, 0, 100, 200).unwrap().give_way(1_000);
    assert!(claim(&t, all, 0, 999, 2_000).is_none());
    assert!(claim(&t, all, 0, 1_000, 2_000).is_some());
}

/// The process's spinner table for one test at a time, once no slot is
/// held or paused: a spin of the test before (preempted on a busy
/// machine, its slot paused for up to `GIVE_WAY`) must not decide whether
/// this test's spins may run.
fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    let turn = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let held = |s: &AtomicU64| s.load(Ordering::SeqCst) > spin::now_ns();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while spin::table().iter().any(held) {
        assert!(std::time::Instant::now() < deadline, "a slot stays held");
        std::thread::sleep(Duration::from_millis(1));
    }
    turn
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) {
    // SAFETY: an empty cpu_set_t, then one bit set below CPU_SETSIZE.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: a valid set of the size given, for this thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
}

/// A CPU this process may run on.
fn some_cpu() -> usize {
    // SAFETY: as in `pin`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid set of the size given.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(rc, 0);
    // SAFETY: below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .unwrap()
}

#[test]
fn a_wait_whose_cpus_slots_are_held_does_not_spin() {
    let _turn = take_turn();
    let cpu = some_cpu();
    // A fresh thread: it reads its affinity at its first spin.
    std::thread::spawn(move || {
        pin(cpu);
        let now = spin::now_ns();
        let slot = spin::slot_of(cpu);
        let other = claim(
            spin::table(),
            Slots(1 << slot),
            slot,
            now,
            now + 60_000_000_000,
        )
        .expect("the slot of this CPU is free");
        let mut looks = 0;
        let r = spin::until(Duration::from_millis(100), None, || {
            looks += 1;
            Some(())
        });
        assert_eq!((r, looks), (None, 0), "spun beside the CPU's spinner");
        drop(other);
        let r = spin::until(Duration::from_millis(100), None, || {
            looks += 1;
            Some(())
        });
        assert_eq!((r, looks), (Some(()), 1), "no spin on a free CPU");
    })
    .join()
    .unwrap();
}

#[test]
fn a_preempted_spin_ends_and_pauses_its_cpus_spinners() {
    let _turn = take_turn();
    let cpu = some_cpu();
    let slot = spin::slot_of(cpu);
    std::thread::spawn(move || {
        pin(cpu);
        // A look that takes 3 ms is what a spin preempted for 3 ms sees.
        let mut looks = 0;
        let mut looked = 0;
        let r = spin::until(Duration::from_secs(1), None, || {
            looks += 1;
            std::thread::sleep(Duration::from_millis(3));
            looked = spin::now_ns();
            None::<()>
        });
        let ended = spin::now_ns();
        assert_eq!((r, looks), (None, 1), "spun on after a preemption");
        let held = spin::table()[slot].load(Ordering::SeqCst);
        let most = spin::GIVE_WAY.as_nanos() as u64;
        assert!(
            held >= looked + most && held <= ended + most,
            "the slot is not paused for the preemption (held until {held}, looked at {looked})"
        );
        let mine = Slots(1 << slot);
        assert!(
            claim(spin::table(), mine, slot, looked, looked + 1).is_none(),
            "the paused slot taken"
        );
        while spin::now_ns() <= held {
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = spin::until(Duration::from_millis(100), None, || Some(()));
        assert_eq!(r, Some(()), "the pause did not end");
    })
    .join()
    .unwrap();
}

/// A thread that waits for the spinner's CPU runs after a few
/// microseconds of the spin, not when the scheduler takes the CPU away at
/// the end of the spinner's slice (0.7 ms to a 4 ms tick here): a spin
/// yields. The waiting thread is a busy loop on the same CPU; the spinner
/// sleeps first, so that it spins on a fresh slice. What is measured is
/// the spinner's own CPU time until the other thread runs: the CPU it
/// kept from that thread. Other programs' threads that the scheduler runs
/// on that CPU in between (a loaded machine: 5 ms on the wall clock)
/// add nothing to it, and a spin that does not yield spends its slice.
#[test]
fn a_spin_lets_the_thread_waiting_for_its_cpu_run() {
    let _turn = take_turn();
    let cpu = some_cpu();
    let rounds = std::thread::spawn(move || {
        pin(cpu);
        (0..5).map(|_| waited_for_the_cpu()).collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    let (spun, wall): (Vec<u64>, Vec<u64>) = rounds.into_iter().unzip();
    let mut sorted = spun.clone();
    sorted.sort();
    assert!(
        sorted[2] < 300_000,
        "a thread runnable on the spinner's CPU waited while it spun {spun:?} ns of CPU ({wall:?} ns on the wall clock)"
    );
}

/// The CPU time of the thread whose clock is `clock`, in nanoseconds.
fn cpu_ns(clock: libc::clockid_t) -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec.
    let rc = unsafe { libc::clock_gettime(clock, &mut t) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One round of the test above, on the calling (pinned) thread: how much
/// CPU time the spin used before the other thread ran, and how long after
/// the spin began that was.
fn waited_for_the_cpu() -> (u64, u64) {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: this thread's own handle; writes one clockid_t.
    let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) };
    assert_eq!(rc, 0);
    let go = Arc::new(AtomicBool::new(false));
    let ran = Arc::new(AtomicU64::new(0));
    let spun = Arc::new(AtomicU64::new(0));
    let (g, r, sp) = (go.clone(), ran.clone(), spun.clone());
    // Inherits the pinning: runnable on the same CPU only, so the
    // spinner is not running when it reads the spinner's clock.
    let other = std::thread::spawn(move || {
        while !g.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        sp.store(cpu_ns(clock), Ordering::Relaxed);
        r.store(spin::now_ns(), Ordering::Release);
    });
    // Longer than a paused slot (`GIVE_WAY`) and than the other's start.
    std::thread::sleep(Duration::from_millis(3));
    let (start, cpu_start) = (spin::now_ns(), cpu_ns(clock));
    go.store(true, Ordering::Release);
    let mut looks = 0;
    spin::until(Duration::from_millis(50), None, || {
        looks += 1;
        (ran.load(Ordering::Acquire) != 0).then_some(())
    });
    other.join().unwrap();
    assert!(looks > 0, "did not spin");
    (
        spun.load(Ordering::Relaxed).saturating_sub(cpu_start),
        ran.load(Ordering::Acquire).saturating_sub(start),
    )
}

/// Starts a spinner child on the device in `dir`, waits until it holds a
/// slot and kills it (`SIGKILL`); the slots' times then, and when it died.
/// None: it died between two spins, holding no slot.
fn kill_a_spinner(dir: &std::path::Path, table: &[AtomicU64]) -> Option<(Vec<u64>, u64)> {
    let mut child = spawn_child("spinner", dir);
    child.wait_ready();
    let held = || {
        table
            .iter()
            .filter(|w| w.load(Ordering::SeqCst) != 0)
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held() == 0 {
        assert!(std::time::Instant::now() < deadline, "the child never spun");
        std::thread::sleep(Duration::from_millis(1));
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let killed = spin::now_ns();
    let times: Vec<u64> = table.iter().map(|w| w.load(Ordering::SeqCst)).collect();
    times.iter().any(|t| *t != 0).then_some((times, killed))
}

#[test]
fn a_killed_spinner_holds_its_slot_no_longer_than_its_spin() {
    let _turn = take_turn();
    let d = TempDir::new("spin-kill");
    // The device's slots are this process's too: the child's claims show.
    let _dev = Device::open(&d.0).unwrap();
    let table = spin::table();
    assert!(table.iter().all(|w| w.load(Ordering::SeqCst) == 0));
    let (times, killed) = (0..3)
        .find_map(|_| kill_a_spinner(&d.0, &table[..]))
        .expect("killed between two spins three times");
    let last = *times.iter().max().unwrap();
    let bound = CHILD_SPIN.max(spin::GIVE_WAY).as_nanos() as u64;
    assert!(
        last <= killed + bound,
        "a slot held past the dead spinner's own spin"
    );
    // Once that time has passed, every slot can be taken again.
    while spin::now_ns() <= last {
        std::thread::sleep(Duration::from_millis(5));
    }
    let now = spin::now_ns();
    let all = Slots(u128::MAX);
    for (i, t) in times.iter().enumerate().filter(|(_, t)| **t != 0) {
        let c = claim(&table[..], all, i, now, now + 1_000).expect("reclaimed");
        assert_eq!(c.slot(), i, "slot {i} (held until {t}) reclaimed");
    }
    assert!(table.iter().all(|w| w.load(Ordering::SeqCst) == 0));
}

#[test]
fn cpus_side_by_side_have_slots_on_different_cache_lines() {
    let n = smclo_wire::device_layout::SPIN_SLOTS;
    let mut seen = vec![false; n];
    for cpu in 0..n {
        let s = spin::slot_of(cpu);
        assert!(!seen[s], "CPUs {cpu} and another share slot {s}");
        seen[s] = true;
        assert_ne!(
            s / 8,
            spin::slot_of(cpu + 1) / 8,
            "CPUs {cpu} and {}",
            cpu + 1
        );
    }
    assert_eq!(spin::slot_of(n + 3), spin::slot_of(3));
}

/// A waiter whose spins are preempted (its CPUs are contended) keeps its
/// halved budget when what it waits for comes soon after its sleep began:
/// it came because other threads ran, and a full spin would have kept them
/// from running. A thread whose spins are not preempted gets its full
/// budget back.
#[test]
fn a_preempted_waiter_keeps_its_halved_budget() {
    use smclo::testing::wait::Budget;
    let _turn = take_turn();
    let cpu = some_cpu();
    std::thread::spawn(move || {
        pin(cpu);
        let b = Budget::new();
        let full = b.next();
        b.note(false);
        b.note(false);
        let halved = b.next();
        assert!(halved < full);
        b.woken(true, spin::now_ns());
        assert_eq!(b.next(), full, "not contended: the full budget back");
        b.note(false);
        b.note(false);
        assert!(!spin::contended());
        // A look that takes 3 ms is what a spin preempted for 3 ms sees.
        spin::until(Duration::from_secs(1), None, || {
            std::thread::sleep(Duration::from_millis(3));
            None::<()>
        });
        assert!(spin::contended(), "the preemption not noted");
        b.woken(true, spin::now_ns());
        assert_eq!(b.next(), halved, "the budget restored while contended");
    })
    .join()
    .unwrap();
}

/// A spin yields after a few microseconds, and beside a busy loop on its
/// CPU that yield hands the busy loop the CPU for the rest of its slice
/// (milliseconds), while what the spinner waits for arrives without a
/// doorbell. After `LONG_YIELDS` such yields in a row the thread stops
/// yielding for a while (its spins stop at the first yield's time, so its
/// waits sleep, as over TCP, and a wake-up takes the CPU back from the
/// busy loop). Sixty waits of a thread pinned beside a busy loop, each a
/// spin then a sleep past a paused slot (`GIVE_WAY`): the first ones lose
/// a slice (which the test requires, or it would check nothing: a
/// scheduler whose yield came straight back), then the quiet time doubles
/// with each long yield, so a third at most lose one (all of them before).
#[test]
fn a_thread_that_yields_into_a_busy_loops_slice_stops_spinning() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let _turn = take_turn();
    let cpu = some_cpu();
    let took = std::thread::spawn(move || {
        pin(cpu);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        // Inherits the pinning: the spinner's CPU.
        let busy = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        std::thread::sleep(Duration::from_millis(3));
        let took: Vec<u64> = (0..60)
            .map(|_| {
                let t0 = spin::now_ns();
                spin::until(Duration::from_micros(100), None, || None::<()>);
                let t = spin::now_ns() - t0;
                std::thread::sleep(spin::GIVE_WAY + Duration::from_micros(500));
                t
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        busy.join().unwrap();
        took
    })
    .join()
    .unwrap();
    let long = took
        .iter()
        .filter(|&&t| t > spin::LONG_YIELD.as_nanos() as u64)
        .count();
    assert!(
        long >= 1,
        "no spin beside a busy loop lost its CPU to it, so the rule was not exercised: {took:?} ns"
    );
    assert!(
        long <= 20,
        "{long} of 60 spins beside a busy loop were kept off their CPU for its slice: {took:?} ns"
    );
}
