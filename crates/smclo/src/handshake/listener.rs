//! The client's rendezvous listener: the UNIX listening socket the servers
//! of its proposals connect to.
//!
//! In the registered listener's network namespace it is one abstract socket
//! per process and device (`\0smclo-<gid>-u-<nonce>`), made at the first
//! proposal and kept: a socket, `bind`, `listen` and `close` per connection
//! were a tenth of a connection's time. Its name dies with the process
//! (kill -9 included), and its nonce comes from `getrandom` and is bound
//! before any proposal names it, so no other user can predict or take it
//! first. Across network namespaces only a path reaches it, and a path
//! would outlive a killed process, so there the listener is made per
//! proposal (`u-<nonce>` in the device directory, unlinked when done),
//! except for announcements (a destination without a registered listener,
//! perhaps translated to one on this host), which share one path listener
//! per process and device, its file removed by the device's sweep once it
//! refuses connections.
//!
//! Any uid of the namespace can connect to an abstract socket, and the
//! threads of one process share it, so every connection says which proposal
//! it answers: the server binds its end to `\0smclo-<gid>-s-<token>`, the
//! token in the Proposal: its DMB's, or an announcement's random id (see
//! [`super::channel::server_name`]). A connection is handed to the thread
//! waiting for that token only if the token is one of this listener's live
//! proposals and its peer may share the device
//! ([`crate::access::check_peer`]); any other is closed.
//!
//! Whichever waiting thread accepts takes the pending connections and files
//! each under its token; one thread at a time sleeps in `poll` on the
//! socket, the others on a condition variable, signalled when a connection
//! is filed or the poller leaves. A program's waits (a non-blocking
//! connect's) sleep in the kernel instead, on the socket and on an eventfd
//! readable while a filed connection waits to be taken.

use super::channel::{check_peer, poll_in, token_of, RendezvousAddr, ABSTRACT_NONCE};
use super::Wake;
use crate::access::Shape;
use crate::device::Device;
use crate::numhash::NumMap;
use crate::owner::{self, Owner};
use smclo_wire::reason::Reason;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Connections taken off the socket per look, so that a flood of foreign
/// connections cannot keep a waiting thread from its own.
const ACCEPT_BATCH: usize = 64;

/// How soon a waiter looks again while a connection filed for another
/// waiter of the process is not taken yet (see [`RendezvousListener::wake_for`]).
const OTHERS_LOOK: Duration = Duration::from_millis(1);

/// A client process's rendezvous listener (see the module documentation).
pub(super) struct RendezvousListener {
    sock: Option<UnixListener>,
    nonce: u64,
    gid: u64,
    /// The process that made it: only it accepts on it and closes it.
    pid: u32,
    netns: u64,
    /// The effective uid it was made under, on a group device: the
    /// credentials servers check are those of its `listen`, so a process
    /// that changed uid needs a new one. `None` on a private device, which
    /// admits only its owner's uid anyway.
    uid: Option<u32>,
    shape: Shape,
    /// Unlinked when the listener is dropped (per-proposal listeners).
    path: Option<PathBuf>,
    /// On the process's shared listener, readable while a connection one
    /// thread filed for another's proposal waits to be taken: a waiter
    /// asleep in the kernel on the socket would not see it (the socket is
    /// no longer readable), so it sleeps on this too (see [`Self::wake_for`]).
    filed_fd: Option<OwnedFd>,
    inbox: Mutex<Inbox>,
    woken: Condvar,
    _held: crate::fdnum::Held,
    _held_filed: Option<crate::fdnum::Held>,
    /// The two descriptors are the core's: a program's `close_range` in
    /// this process leaves them open.
    _marks: [Option<crate::fdnum::Mark>; 2],
}

#[derive(Default)]
struct Inbox {
    /// The tokens of the live proposals, and the server's connection for
    /// each once it arrived, or why one that named it was refused.
    expected: NumMap<u64, Option<Result<UnixStream, Reason>>>,
    /// A thread sleeps in `poll` on the socket.
    polling: bool,
    /// Threads waiting on the condition variable.
    sleepers: usize,
    /// The listener's eventfd is set (see [`RendezvousListener::note_filed`]).
    signalled: bool,
}

/// The shared listeners of this process, one per device.
static SHARED: Mutex<Vec<Arc<RendezvousListener>>> = Mutex::new(Vec::new());

/// The shared path listeners of this process for announcements, one per
/// device (see [`RendezvousListener::for_announcement`]).
static SHARED_PATHS: Mutex<Vec<Arc<RendezvousListener>>> = Mutex::new(Vec::new());

impl RendezvousListener {
    /// The listener for a proposal to a listener in our network namespace
    /// (`same_netns`: the shared abstract one) or in another (a new one
    /// with a path).
    pub(super) fn for_proposal(dev: &Device, same_netns: bool) -> io::Result<Arc<Self>> {
        if !same_netns {
            return Self::bind(dev, crate::rng::next_u64() & !ABSTRACT_NONCE, false).map(Arc::new);
        }
        let me = Owner::current().pid;
        let netns = owner::netns_inode();
        let uid = group_uid(dev);
        // try_lock: a fork child must not wait for a lock a lost thread
        // holds; it then makes a listener of its own for this proposal.
        let Ok(mut shared) = SHARED.try_lock() else {
            return Self::bind_abstract(dev, false).map(Arc::new);
        };
        // A fork child inherits its parent's listeners but must not accept
        // on them; a process that moved to another network namespace needs
        // one there.
        shared.retain(|l| l.pid == me && l.netns == netns && l.uid == uid);
        if let Some(l) = shared.iter().find(|l| l.gid == dev.gid()) {
            return Ok(l.clone());
        }
        let l = Arc::new(Self::bind_abstract(dev, true)?);
        shared.push(l.clone());
        Ok(l)
    }

    /// The listener for an announcement, whose server may be in any
    /// network namespace: a path, one per process and device, made at the
    /// first announcement and kept (a socket, `bind`, `chmod`, `listen`,
    /// `unlink` and `close` per connection were most of what an
    /// announcement to a plain server cost). A killed or exited process's
    /// file is removed by the device's sweep once it refuses connections
    /// (`device/sweep`).
    pub(super) fn for_announcement(dev: &Device) -> io::Result<Arc<Self>> {
        let me = Owner::current().pid;
        let netns = owner::netns_inode();
        let uid = group_uid(dev);
        let path_nonce = || crate::rng::next_u64() & !ABSTRACT_NONCE;
        let Ok(mut shared) = SHARED_PATHS.try_lock() else {
            return Self::bind(dev, path_nonce(), false).map(Arc::new);
        };
        shared.retain(|l| l.pid == me && l.netns == netns && l.uid == uid);
        if let Some(l) = shared.iter().find(|l| l.gid == dev.gid()) {
            return Ok(l.clone());
        }
        let l = Arc::new(Self::bind(dev, path_nonce(), true)?);
        shared.push(l.clone());
        Ok(l)
    }

    /// `shared`: the process's shared listener.
    fn bind_abstract(dev: &Device, shared: bool) -> io::Result<Self> {
        match Self::bind(dev, crate::rng::next_u64() | ABSTRACT_NONCE, shared) {
            Err(e) => {
                crate::debug!("abstract rendezvous socket failed ({e}); using a path");
                Self::bind(dev, crate::rng::next_u64() & !ABSTRACT_NONCE, shared)
            }
            ok => ok,
        }
    }

    fn bind(dev: &Device, nonce: u64, shared: bool) -> io::Result<Self> {
        let (sock, path) = match RendezvousAddr::new(dev, nonce) {
            RendezvousAddr::Path(p) => {
                let l = crate::fdnum::internal(|| UnixListener::bind(&p))?;
                // Connecting needs write permission on the socket: a group
                // device's members need it, others never get it.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(dev.file_mode()))?;
                (l, Some(p))
            }
            RendezvousAddr::Abstract(n) => {
                use std::os::linux::net::SocketAddrExt;
                let a = std::os::unix::net::SocketAddr::from_abstract_name(n)?;
                (
                    crate::fdnum::internal(|| UnixListener::bind_addr(&a))?,
                    None,
                )
            }
        };
        sock.set_nonblocking(true)?;
        let sock = crate::fdnum::move_high(sock);
        let filed_fd = if shared { Some(eventfd()?) } else { None };
        let marks = [
            Some(crate::fdnum::Mark::new(sock.as_raw_fd())),
            filed_fd
                .as_ref()
                .map(|f| crate::fdnum::Mark::new(f.as_raw_fd())),
        ];
        Ok(RendezvousListener {
            sock: Some(sock),
            nonce,
            gid: dev.gid(),
            pid: Owner::current().pid,
            netns: owner::netns_inode(),
            uid: group_uid(dev),
            shape: dev.shape(),
            path,
            filed_fd,
            inbox: Mutex::new(Inbox::default()),
            woken: Condvar::new(),
            _held: crate::fdnum::Held::new(),
            _held_filed: shared.then(crate::fdnum::Held::new),
            _marks: marks,
        })
    }

    /// The nonce that names this listener in a Proposal.
    pub(super) fn nonce(&self) -> u64 {
        self.nonce
    }

    fn lock(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Announces a proposal named `token`: from now on a server's
    /// connection for it is kept for [`take`](Self::take).
    pub(super) fn expect(&self, token: u64) {
        self.lock().expected.insert(token, None);
    }

    /// Forgets the proposal with `token`, closing its server's connection
    /// if it arrived and was not taken (the server then reads end of file).
    /// With `drain`, also takes the connections waiting on the socket, so
    /// that a server that connected for it is not left waiting.
    pub(super) fn forget(&self, token: u64, drain: bool) {
        let mut inbox = self.lock();
        if drain && !inbox.polling {
            self.collect(&mut inbox, None, true);
        }
        inbox.expected.remove(&token);
        self.note_filed(&mut inbox, false);
    }

    /// The server's connection for `token`, waiting at most `timeout`
    /// (`None` when none came). A connection for it from a process that may
    /// not share the device is refused and reported (`Some(Err)`) without
    /// ending the wait: anyone in the namespace can connect to an abstract
    /// socket, and must not be able to make us fall back. Busy-polls
    /// `arrived` (a look at shared memory: has the server connected?) for
    /// the spin budget, then sleeps.
    ///
    /// While one thread sleeps in `poll` on the socket, no other accepts on
    /// it: a connection taken from under the poller would not wake it.
    pub(super) fn take(
        &self,
        token: u64,
        timeout: Duration,
        arrived: impl Fn() -> bool,
    ) -> Option<Result<UnixStream, Reason>> {
        let start = Instant::now();
        let deadline = start + timeout;
        let spin = super::spin_budget().min(timeout);
        // Whether this thread slept: before that, the socket is asked only
        // once `arrived` says so (a sleep in `poll` asks it anyway).
        let mut slept = false;
        loop {
            let left = spin.saturating_sub(start.elapsed());
            crate::spin::until(left, None, || arrived().then_some(()));
            let mut inbox = self.lock();
            if !inbox.polling && (slept || arrived()) {
                self.collect(&mut inbox, Some(token), false);
            }
            if let Some(got) = inbox.expected.get_mut(&token).and_then(Option::take) {
                self.note_filed(&mut inbox, false);
                return Some(got);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            // A quiet thread's spins are short and do not yield: sleep.
            if now - start < spin && !crate::spin::quiet_now() {
                continue;
            }
            slept = true;
            if inbox.polling {
                inbox.sleepers += 1;
                let mut inbox = match self.woken.wait_timeout(inbox, deadline - now) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
                inbox.sleepers -= 1;
                continue;
            }
            inbox.polling = true;
            drop(inbox);
            let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            poll_in(self.fd(), ms);
            let mut inbox = self.lock();
            inbox.polling = false;
            // Another waiter takes over the socket.
            self.wake(&inbox);
        }
    }

    /// Whether the server's connection for `token` is filed, waiting for
    /// [`take`](Self::take).
    pub(super) fn filed(&self, token: u64) -> bool {
        self.lock()
            .expected
            .get(&token)
            .is_some_and(Option::is_some)
    }

    /// What the waiter for `token`'s connection sleeps on in the kernel:
    /// the socket, and on the shared listener the descriptor readable
    /// once another thread's look filed a connection. While one is filed
    /// for another waiter, that descriptor stays readable until its
    /// waiter takes it: the others look again after [`OTHERS_LOOK`]
    /// instead of spinning on it (and keeping that waiter off the CPU).
    pub(super) fn wake_for(&self, token: u64) -> Wake {
        let inbox = self.lock();
        if inbox.expected.get(&token).is_some_and(Option::is_some) {
            return Wake::now();
        }
        let others = inbox.expected.values().any(Option::is_some);
        let (also, within) = match &self.filed_fd {
            Some(_) if others => (None, Some(OTHERS_LOOK)),
            Some(f) => (Some(f.as_raw_fd()), None),
            None => (None, None),
        };
        Wake {
            fd: Some(self.fd()),
            also,
            within,
        }
    }

    /// Sets the descriptor of [`Self::wake_for`]'s `also` (`set`: a
    /// connection was filed for another waiter than the filing thread), or
    /// clears it once no filed connection waits to be taken: a system call
    /// only when that changes, none when each thread files its own.
    fn note_filed(&self, inbox: &mut Inbox, set: bool) {
        let Some(fd) = &self.filed_fd else { return };
        let on = set || (inbox.signalled && inbox.expected.values().any(Option::is_some));
        if on == inbox.signalled {
            return;
        }
        inbox.signalled = on;
        let mut v: u64 = 1;
        let p = (&mut v as *mut u64).cast();
        if on {
            // SAFETY: 8 bytes of our own to our eventfd.
            unsafe { libc::write(fd.as_raw_fd(), p, 8) };
        } else {
            // SAFETY: 8 bytes into our own from our eventfd (set, so the
            // non-blocking read does not fail).
            unsafe { libc::read(fd.as_raw_fd(), p, 8) };
        }
    }

    /// Takes the connections waiting on the socket until the one for
    /// `token`, unless a thread sleeps in `poll` on it (it takes them when
    /// it wakes). `elsewhere`: `token`'s waiter is another thread (a
    /// connection filed for it must wake it).
    pub(super) fn collect_now(&self, token: u64, elsewhere: bool) {
        let mut inbox = self.lock();
        if !inbox.polling {
            self.collect(&mut inbox, Some(token), elsewhere);
        }
    }

    fn wake(&self, inbox: &Inbox) {
        if inbox.sleepers > 0 {
            self.woken.notify_all();
        }
    }

    pub(super) fn fd(&self) -> i32 {
        self.sock.as_ref().map_or(-1, |s| s.as_raw_fd())
    }

    /// Takes pending connections off the socket and files each under its
    /// token, until the one for `want` is filed (`elsewhere`: for a waiter
    /// on another thread); closes those that answer no live proposal of
    /// ours or come from another uid.
    fn collect(&self, inbox: &mut Inbox, want: Option<u64>, elsewhere: bool) {
        let Some(sock) = &self.sock else { return };
        let (mut filed, mut others) = (false, false);
        for _ in 0..ACCEPT_BATCH {
            let (c, name) = match crate::fdnum::internal(|| accept_named(sock.as_raw_fd())) {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    crate::debug!("accepting on the rendezvous socket failed: {e}");
                    break;
                }
            };
            let token = name.and_then(|n| token_of(self.gid, &n));
            let Some(slot) = token.and_then(|t| inbox.expected.get_mut(&t)) else {
                crate::debug!("refused a rendezvous connection for no proposal of ours");
                crate::fdnum::close_own(c.into());
                continue;
            };
            // One filed for another proposal may wait there for a while
            // (a program that starts many connections at once): out of
            // the application's range of numbers.
            let c = if token == want {
                c
            } else {
                crate::fdnum::move_high(c)
            };
            *slot = Some(match check_peer(c.as_raw_fd(), &self.shape) {
                Ok(()) => Ok(c),
                Err(e) => {
                    crate::debug!("refused a rendezvous connection: {e}");
                    Err(e.reason())
                }
            });
            filed = true;
            if token == want {
                others |= elsewhere;
                break;
            }
            crate::debug!("filed a server's connection for another waiter's proposal");
            others = true;
        }
        if filed {
            self.wake(inbox);
            self.note_filed(inbox, others);
        }
    }
}

/// Accepts a connection on the rendezvous socket `fd` (close-on-exec), with
/// the abstract name its peer bound, if any. The system call itself: the
/// preload interposes `accept4`, and this socket is smclo's own.
fn accept_named(fd: RawFd) -> io::Result<(UnixStream, Option<Vec<u8>>)> {
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let (c, len) = crate::chan_sys::accept_unix(fd, &mut sa, libc::SOCK_CLOEXEC);
    if c < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `c` is the fresh descriptor accept returned, owned by nothing
    // else.
    let c = unsafe { UnixStream::from_raw_fd(c) };
    let path = std::mem::offset_of!(libc::sockaddr_un, sun_path);
    let end = (len as usize).min(std::mem::size_of::<libc::sockaddr_un>());
    // An abstract name: a path that starts with a zero byte.
    let name = (end > path + 1 && sa.sun_path[0] == 0).then(|| {
        sa.sun_path[1..end - path]
            .iter()
            .map(|&b| b as u8)
            .collect()
    });
    Ok((c, name))
}

impl Drop for RendezvousListener {
    fn drop(&mut self) {
        let Some(sock) = self.sock.take() else { return };
        if Owner::current().pid != self.pid {
            // A fork child's copy: the parent still listens on it, and the
            // child may have closed the number and reused it already.
            let _ = sock.into_raw_fd();
            return;
        }
        drop(sock);
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A new non-blocking eventfd, out of the application's range of numbers.
fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: no pointers; the flags are valid.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(crate::fdnum::move_high(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The effective uid to key a listener by (see [`RendezvousListener`]'s
/// `uid`).
fn group_uid(dev: &Device) -> Option<u32> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    matches!(dev.shape(), Shape::Group { .. }).then(|| unsafe { libc::geteuid() })
}
