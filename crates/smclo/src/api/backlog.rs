//! [`Backlog`]: the handshakes of a non-blocking [`SmcListener`] that did
//! not decide within `accept`'s spin budget, and the descriptor an event
//! loop waits on for them (docs/handshake.md "Handshake waits").
//!
//! As the kernel's SMC finishes handshakes off the accept path and its
//! `accept` returns only finished connections, a non-blocking `accept`
//! keeps such a handshake here and looks at it again, never waiting, at
//! its next calls. The listener's descriptor is an epoll set of the TCP
//! listener, each kept handshake's wake descriptor (the client's next step
//! makes it readable) and a timer for what only a look tells (a client's
//! source port, which it publishes in shared memory; each handshake's
//! deadline): readable when `accept` may have something to return.
//!
//! [`SmcListener`]: super::SmcListener

use crate::chan_sys::timespec;
use crate::config::Config;
use crate::debug;
use crate::device::Device;
use crate::handshake::{Decision, Pending, Polled, Until, Wake};
use crate::owner::current_pid;
use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a kept handshake whose wake descriptor could not join the set
/// is looked at.
const UNWATCHED_LOOK: Duration = Duration::from_millis(1);

/// An accepted TCP connection, with what its handshake decided.
pub(super) type Accepted = (TcpStream, SocketAddr, Decision);

/// The kept handshakes and the set that tells when to look at them.
///
/// Both belong to one process. A fork child's copy shares the parent's
/// set and timer (one open file in both) and holds copies of the parent's
/// kept handshakes: at its first use the child makes a set and a timer of
/// its own at the same descriptor numbers and drops those copies without
/// declining or resetting anything, as a TCP listener's queue stays the
/// parent's.
pub(super) struct Backlog {
    /// The epoll set: the TCP listener, [`timer`](Self::timer) and the
    /// watched wake descriptors, level-triggered.
    set: OwnedFd,
    /// A timerfd, armed for the earliest look only time tells.
    timer: OwnedFd,
    /// The listening socket.
    listener: RawFd,
    queue: Mutex<Queue>,
}

struct Queue {
    entries: VecDeque<Kept>,
    /// Whether the timer may be armed or have fired.
    armed: bool,
    /// The process the set, the timer and the entries belong to.
    pid: u32,
}

/// One kept handshake.
struct Kept {
    tcp: TcpStream,
    peer: SocketAddr,
    /// Gives up at `accept` + `SMCLO_CLC_WAIT_MS` (TIMEOUT).
    hs: Pending,
    /// The wake descriptor in the set, if any.
    watched: Option<RawFd>,
}

impl Backlog {
    /// An empty backlog for the listening socket `listener`.
    pub(super) fn new(listener: RawFd) -> io::Result<Backlog> {
        let (set, timer) = set_and_timer()?;
        let b = Backlog {
            set,
            timer,
            listener,
            queue: Mutex::new(Queue {
                entries: VecDeque::new(),
                armed: false,
                pid: current_pid(),
            }),
        };
        b.fill_set()?;
        Ok(b)
    }

    /// Puts the listener and the timer in the set.
    fn fill_set(&self) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, self.listener)?;
        self.ctl(libc::EPOLL_CTL_ADD, self.timer.as_raw_fd())
    }

    /// The queue, this process's (see [`Backlog`]).
    fn own(&self) -> MutexGuard<'_, Queue> {
        let mut q = lock(&self.queue);
        if q.pid != current_pid() {
            self.renew(&mut q);
        }
        q
    }

    /// In a fork child: a set and a timer of its own in place of the
    /// parent's, and no kept handshake (the parent's copies are dropped:
    /// they do not decline, and closing a copy of a socket leaves it open
    /// in the parent).
    fn renew(&self, q: &mut Queue) {
        q.entries.clear();
        q.armed = false;
        q.pid = current_pid();
        let replaced = set_and_timer().and_then(|(set, timer)| {
            replace(&set, &self.set)?;
            replace(&timer, &self.timer)?;
            self.fill_set()
        });
        if let Err(e) = replaced {
            debug!("a fork child's accept set could not be made its own: {e}");
        }
    }

    /// The descriptor to wait on: readable when `accept` may have
    /// something to return.
    pub(super) fn fd(&self) -> RawFd {
        drop(self.own());
        self.set.as_raw_fd()
    }

    /// A non-blocking `accept`: the first kept handshake that decided, or
    /// else the next new connection whose handshake decides within the
    /// spin budget (one that does not is kept); `WouldBlock` when none.
    pub(super) fn accept(
        &self,
        tcp: &TcpListener,
        dev: &Arc<Device>,
        cfg: &Config,
    ) -> io::Result<Accepted> {
        let mut q = self.own();
        let r = self.accept_locked(&mut q, tcp, dev, cfg);
        self.rearm(&mut q);
        r
    }

    fn accept_locked(
        &self,
        q: &mut Queue,
        tcp: &TcpListener,
        dev: &Arc<Device>,
        cfg: &Config,
    ) -> io::Result<Accepted> {
        if let Some(a) = self.take_decided(q) {
            return Ok(a);
        }
        loop {
            let (tcp, peer) = tcp.accept()?;
            let now = Instant::now();
            let mut hs = Pending::accept(dev, cfg, tcp.as_raw_fd(), now + cfg.clc_wait);
            let wake = match hs.poll(Until::Step(now + crate::wait::spin_budget())) {
                Polled::Decided(d) => return Ok((tcp, peer, d)),
                Polled::Waiting(w) => w,
            };
            debug!("the handshake with {peer} goes on after accept");
            let mut k = Kept {
                tcp,
                peer,
                hs,
                watched: None,
            };
            self.watch(&mut k, wake);
            q.entries.push_back(k);
        }
    }

    /// A blocking `accept`'s: the first kept handshake that decided, or
    /// else the oldest one, decided waiting (at most until its deadline);
    /// `None` when none is kept.
    pub(super) fn accept_kept_blocking(&self) -> Option<Accepted> {
        let mut q = self.own();
        let decided = self.take_decided(&mut q);
        let oldest = match decided {
            Some(_) => None,
            None => q.entries.pop_front().map(|k| self.unwatched(k)),
        };
        self.rearm(&mut q);
        drop(q);
        decided.or_else(|| oldest.map(|k| (k.tcp, k.peer, k.hs.finish())))
    }

    /// Looks once at each kept handshake, in order, and takes out the
    /// first that decided.
    fn take_decided(&self, q: &mut Queue) -> Option<Accepted> {
        let now = Instant::now();
        for i in 0..q.entries.len() {
            let k = &mut q.entries[i];
            match k.hs.poll(Until::Step(now)) {
                Polled::Decided(d) => {
                    let k = q.entries.remove(i).expect("index in range");
                    let k = self.unwatched(k);
                    return Some((k.tcp, k.peer, d));
                }
                Polled::Waiting(w) => self.watch(k, w),
            }
        }
        None
    }

    /// Puts `k`'s wake descriptor (of `wake`) in the set in place of the
    /// one there.
    fn watch(&self, k: &mut Kept, wake: Wake) {
        let want = wake.fd;
        if want == k.watched {
            return;
        }
        self.unwatch(k);
        if let Some(fd) = want {
            match self.ctl(libc::EPOLL_CTL_ADD, fd) {
                Ok(()) => k.watched = Some(fd),
                Err(e) => debug!("cannot watch a handshake's descriptor ({e}): looked at often"),
            }
        }
    }

    /// `k`, its wake descriptor out of the set.
    fn unwatched(&self, mut k: Kept) -> Kept {
        self.unwatch(&mut k);
        k
    }

    /// Takes `k`'s wake descriptor out of the set. Called right after the
    /// look that changed it: an SMC-D connection keeps the descriptor (its
    /// channel) at the same number and must leave the set; a closed one
    /// has left it already, and its number cannot have gone to another
    /// watched descriptor since (`EBADF`, `ENOENT`: nothing to do).
    fn unwatch(&self, k: &mut Kept) {
        if let Some(fd) = k.watched.take() {
            let _ = self.ctl(libc::EPOLL_CTL_DEL, fd);
        }
    }

    /// Arms the timer for the earliest look that only time tells: a kept
    /// handshake's deadline, or its next look when no descriptor wakes it
    /// (its [`Wake`] has only `within`). Re-arming
    /// clears a timer that fired, so the set is not readable for it any
    /// more.
    fn rearm(&self, q: &mut Queue) {
        if q.entries.is_empty() && !q.armed {
            return;
        }
        let now = Instant::now();
        let next = q.entries.iter().map(|k| next_look(k, now)).min();
        let value = match next {
            // The smallest non-zero time: zero would disarm it.
            Some(at) => at
                .saturating_duration_since(now)
                .max(Duration::from_nanos(1)),
            None => Duration::ZERO,
        };
        let spec = libc::itimerspec {
            it_interval: timespec(Duration::ZERO),
            it_value: timespec(value),
        };
        // SAFETY: our timerfd and a valid itimerspec; no old value asked for.
        let r = unsafe {
            libc::timerfd_settime(self.timer.as_raw_fd(), 0, &spec, std::ptr::null_mut())
        };
        if r != 0 {
            debug!(
                "arming the accept timer failed: {}",
                io::Error::last_os_error()
            );
        }
        q.armed = next.is_some();
    }

    /// `epoll_ctl(op)` of `fd` in the set, waiting for `EPOLLIN`.
    fn ctl(&self, op: libc::c_int, fd: RawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: our epoll set, a descriptor number and a valid event.
        let r = unsafe { libc::epoll_ctl(self.set.as_raw_fd(), op, fd, &mut ev) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for Backlog {
    /// As the kernel resets the connections left in a closed listener's
    /// queue: each kept handshake declines (TIMEOUT, when it answered the
    /// client; see [`Pending`]), then its TCP connection
    /// is reset.
    fn drop(&mut self) {
        let mut q = lock(&self.queue);
        if q.pid != current_pid() {
            // A fork child's copies (see `renew`): closed, nothing more.
            return;
        }
        let entries = std::mem::take(&mut q.entries);
        drop(q);
        for k in entries {
            let Kept { tcp, peer, hs, .. } = k;
            drop(hs);
            debug!("listener closed: the connection from {peer} is reset (TIMEOUT)");
            if let Err(e) = crate::tcp_syn::reset(tcp.as_raw_fd()) {
                debug!("resetting the connection from {peer} failed: {e}");
            }
        }
    }
}

/// When `k` must be looked at even if its descriptor says nothing.
fn next_look(k: &Kept, now: Instant) -> Instant {
    let w = k.hs.wake();
    let within = match w.fd {
        Some(fd) if k.watched == Some(fd) => w.within,
        Some(_) => Some(w.within.unwrap_or(UNWATCHED_LOOK)),
        None => w.within,
    };
    let deadline = k.hs.deadline();
    within.map_or(deadline, |d| deadline.min(now + d))
}

/// A new epoll set and timerfd (non-blocking), both close-on-exec.
fn set_and_timer() -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: epoll_create1 with a constant flag; the result is checked
    // and owned right away.
    let set = owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    let flags = libc::TFD_NONBLOCK | libc::TFD_CLOEXEC;
    // SAFETY: timerfd_create with constant arguments; checked and owned
    // right away.
    let timer = owned(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, flags) })?;
    Ok((set, timer))
}

/// Makes `at`'s descriptor number refer to `new`'s open file (`new`'s own
/// number is closed when it is dropped).
fn replace(new: &OwnedFd, at: &OwnedFd) -> io::Result<()> {
    // SAFETY: two descriptors we own; dup3 swaps the file `at` refers to
    // atomically, and `at` stays owned by its OwnedFd.
    let r = crate::fdnum::internal(|| unsafe {
        libc::dup3(new.as_raw_fd(), at.as_raw_fd(), libc::O_CLOEXEC)
    });
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The descriptor a system call returned, owned, or its error.
fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the call just made, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The queue; a panic elsewhere does not poison it (each kept handshake
/// stands alone).
fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
