//! TCP's ceiling on corking, for SMC-D connections.
//!
//! The core holds corked bytes (`TCP_CORK`, `MSG_MORE`) unpublished until
//! the program uncorks or writes without `MSG_MORE`
//! ([`smclo::adapter::conn::Conn::send`]). TCP also sends corked data after
//! 200 ms whatever the program does (tcp(7)), and programs rely on it (a
//! last `MSG_MORE` never followed by a plain write). Here one thread per
//! process, started on the first corked write, publishes what has been held
//! that long.
//!
//! Every deadline is "armed + [`CEILING`]", so the queue is kept ordered by
//! inserting in place (almost always at the end). A connection is queued
//! at most once ([`Sock::cork_armed`]): the writer arms after it held
//! bytes, the thread disarms *before* it looks, so a hold between the look
//! and the disarm cannot be missed.
//!
//! Fork: the queue's lock is taken around `fork` (`pthread_atfork`), so a
//! child never inherits it locked; the child has no flusher thread and
//! starts its own when it corks (its pid differs from the thread's).
//!
//! Signals: a program's thread holds the queue's lock in a section
//! ([`crate::critical`]), since a handler may cork a connection too; the
//! flusher blocks every signal but faults, so it runs none of the
//! program's handlers (it holds the lock while it looks at the queue) and
//! never takes a signal the program blocks to wait for it.

use crate::table::Sock;
use smclo::adapter::owner::Owner;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, Weak};
use std::time::{Duration, Instant};

/// TCP's ceiling on how long `TCP_CORK` holds data.
pub const CEILING: Duration = Duration::from_millis(200);

struct Queue {
    /// The process whose flusher thread serves the queue (0: none yet).
    pid: u32,
    due: VecDeque<(Instant, Weak<Sock>)>,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    pid: 0,
    due: VecDeque::new(),
});
static WAKE: Condvar = Condvar::new();

fn lock() -> MutexGuard<'static, Queue> {
    QUEUE.lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// The queue's lock, held by the forking thread across `fork`.
    static AROUND_FORK: RefCell<Option<MutexGuard<'static, Queue>>> = const { RefCell::new(None) };
}

extern "C" fn before_fork() {
    AROUND_FORK.with(|g| *g.borrow_mut() = Some(lock()));
}

extern "C" fn after_fork() {
    AROUND_FORK.with(|g| drop(g.borrow_mut().take()));
}

/// After the program wrote on `s`: if bytes are held and no deadline is
/// pending for it, queue one.
pub fn arm(s: &Arc<Sock>) {
    // Nothing is held while the process forks (`hooks::process`).
    if !s.conn.holding() || s.cork_armed.swap(true, Ordering::AcqRel) {
        return;
    }
    push(Instant::now() + CEILING, Arc::downgrade(s));
}

/// Registers the queue's fork handlers once (at load, or at the first
/// queued write).
pub fn register_fork_handlers() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers plain extern "C" functions that only lock and
        // unlock the queue in the forking thread.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
    });
}

/// Queues `w` to be published at `at`, from a program's thread.
fn push(at: Instant, w: Weak<Sock>) {
    register_fork_handlers();
    let me = Owner::current().pid;
    let mut q = crate::critical::lock(&QUEUE);
    if q.pid != me {
        // No flusher in this process (first use, or a fork child): the
        // entries queued by the parent are the parent's to serve.
        q.due.clear();
        let started = crate::critical::without_signals(|| {
            std::thread::Builder::new()
                .name("smclo-cork".into())
                .spawn(run)
        });
        if started.is_err() {
            // No thread: publish now rather than hold without a ceiling.
            drop(q);
            if let Some(s) = w.upgrade() {
                s.cork_armed.store(false, Ordering::Release);
                let _ = s.conn.flush();
            }
            return;
        }
        q.pid = me;
    }
    let i = q.due.partition_point(|(t, _)| *t <= at);
    q.due.insert(i, (at, w));
    if i == 0 {
        WAKE.notify_one();
    }
}

/// The flusher thread: publishes bytes held for [`CEILING`].
fn run() {
    let mut q = lock();
    loop {
        let Some(&(at, _)) = q.due.front() else {
            q = WAKE.wait(q).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let now = Instant::now();
        if now < at {
            q = WAKE
                .wait_timeout(q, at - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        let (_, w) = q.due.pop_front().expect("front exists");
        drop(q);
        if let Some(s) = w.upgrade() {
            s.cork_armed.store(false, Ordering::Release);
            match s.conn.flush_older(CEILING) {
                Ok(Some(left)) if !s.cork_armed.swap(true, Ordering::AcqRel) => {
                    let mut q = lock();
                    let at = Instant::now() + left;
                    let i = q.due.partition_point(|(t, _)| *t <= at);
                    q.due.insert(i, (at, Arc::downgrade(&s)));
                }
                // Published, nothing held, armed again by a writer, or the
                // connection failed (its calls report that).
                _ => {}
            }
        }
        q = lock();
    }
}
