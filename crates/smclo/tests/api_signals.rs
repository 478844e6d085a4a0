//! The native API: a signal handler that calls
//! `smclo::testing::signal::handler_ran` and runs while a wait spins (the spin
//! budget raised to 200 ms, the signal sent 20 ms into the wait) ends a
//! `Poller::wait` of 5 s and a blocking read of an idle SMC-D stream with
//! `Interrupted` at once, as it would their sleep in the kernel.

mod common;

use common::TempDir;
use smclo::api::{Poller, SmcStream};
use smclo::config::Config;
use smclo::testing::poller::Ready;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static HANDLED: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_usr1(sig: libc::c_int) {
    HANDLED.fetch_add(1, Ordering::Relaxed);
    smclo::testing::signal::handler_ran(sig);
}

/// Installs [`on_usr1`] for SIGUSR1, without `SA_RESTART`.
fn install() {
    // SAFETY: an all-zero sigaction is a valid start; the handler is an
    // async-signal-safe function of the right type.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
}

/// Runs `wait` with SIGUSR1 sent to this thread 20 ms into it: its result,
/// how long it took and how many times the handler ran.
fn signalled<T>(wait: impl FnOnce() -> T) -> (T, Duration, u32) {
    HANDLED.store(0, Ordering::Relaxed);
    // SAFETY: this thread's id, valid while it runs (it joins the sender).
    let me = unsafe { libc::pthread_self() };
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: the waiting thread, alive until it joined this one.
        unsafe { libc::pthread_kill(me, libc::SIGUSR1) };
    });
    let t0 = Instant::now();
    let r = wait();
    let took = t0.elapsed();
    sender.join().unwrap();
    (r, took, HANDLED.load(Ordering::Relaxed))
}

#[test]
fn a_handler_that_says_it_ran_interrupts_a_spinning_wait() {
    // Before anything reads the budget (once per process); one test in
    // this binary, so no other thread reads the environment meanwhile.
    std::env::set_var("SMCLO_SPIN_US", "200000");
    let dir = TempDir::new("api-signals");
    let mut cfg = Config::from_env().expect("config");
    cfg.device_dir = dir.0.clone();
    let mut child = Command::new(env!("CARGO_BIN_EXE_smclo-testpeer"))
        .args(["serve", "127.0.0.1:0", "echo"])
        .env("SMCLO_DEVICE_DIR", &dir.0)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn smclo-testpeer");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let _server = common::ChildGuard(child);
    let mut line = String::new();
    out.read_line(&mut line).expect("the server's address");
    let addr = line.trim().strip_prefix("listening ").expect("address");
    let s = SmcStream::connect_with(addr, &cfg).expect("connect");
    assert!(s.is_smc(), "{:?}", s.fallback_reason());
    install();

    let mut p = Poller::new();
    p.add(&s, 1, Ready::IN);
    let mut ev = Vec::new();
    let (r, took, handled) = signalled(|| p.wait(&mut ev, Some(Duration::from_secs(5))));
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Interrupted)
            && took < Duration::from_secs(1)
            && handled == 1,
        "Poller::wait: {r:?} after {took:?}, handler ran {handled} times"
    );

    let mut b = [0u8; 1];
    let (r, took, handled) = signalled(|| (&s).read(&mut b));
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Interrupted)
            && took < Duration::from_secs(1)
            && handled == 1,
        "read: {r:?} after {took:?}, handler ran {handled} times"
    );
    let stats = smclo::device::Device::open(&dir.0).expect("device").stats();
    assert_eq!(stats.conns_opened, 1, "{stats:?}");
    assert_eq!(stats.fallbacks_total(), 0, "{stats:?}");
}
