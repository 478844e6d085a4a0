//! [`Poller`]: one wait over several streams and other descriptors, with
//! the event-loop fast path of [`crate::poller`].

use super::SmcStream;
use crate::poller::{self, Member, Pace, Ready};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// Waits for readiness on several streams (and other descriptors) at
/// once, as `poll(2)` does, without a system call while traffic keeps
/// coming: SMC-D streams are answered by their rings; a wait with nothing
/// ready spins for an adaptive budget (`SMCLO_SPIN_US`) while the peers'
/// writers skip their doorbells, then sleeps in the kernel with the
/// doorbells armed. TCP streams and other descriptors (a listener, a pipe)
/// are answered by the kernel.
///
/// ```no_run
/// use smclo::api::{Poller, SmcStream};
/// use smclo::api::Ready;
/// use std::time::Duration;
/// let a = SmcStream::connect("127.0.0.1:7000")?;
/// let b = SmcStream::connect("127.0.0.1:7001")?;
/// let mut p = Poller::new();
/// p.add(&a, 1, Ready::IN);
/// p.add(&b, 2, Ready::IN);
/// let mut events = Vec::new();
/// p.wait(&mut events, Some(Duration::from_millis(100)))?;
/// for e in &events {
///     println!("token {} ready {:?}", e.token, e.ready);
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Default)]
pub struct Poller<'a> {
    entries: Vec<Entry<'a>>,
    pace: Pace,
}

struct Entry<'a> {
    source: Source<'a>,
    token: u64,
    interest: Ready,
}

#[derive(Clone, Copy)]
enum Source<'a> {
    Stream(&'a SmcStream),
    Fd(RawFd),
}

impl Source<'_> {
    fn same(&self, o: &Source<'_>) -> bool {
        match (self, o) {
            (Source::Stream(a), Source::Stream(b)) => std::ptr::eq(*a, *b),
            (Source::Fd(a), Source::Fd(b)) => a == b,
            _ => false,
        }
    }

    fn fd(&self) -> RawFd {
        match self {
            Source::Stream(s) => s.as_raw_fd(),
            Source::Fd(fd) => *fd,
        }
    }
}

/// One ready registration, as [`Poller::wait`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// The token it was registered with.
    pub token: u64,
    /// What is ready: of what was asked for, plus `HUP` and `ERR` (and
    /// `RDHUP` when asked for) as `poll(2)` reports them.
    pub ready: Ready,
}

impl<'a> Poller<'a> {
    /// An empty poller.
    pub fn new() -> Poller<'a> {
        Poller::default()
    }

    /// Waits for `interest` (`Ready::IN`, `Ready::OUT`, `Ready::RDHUP`) on
    /// `s`, reported with `token`; a stream added again gets the new token
    /// and interest.
    pub fn add(&mut self, s: &'a SmcStream, token: u64, interest: Ready) {
        self.put(Source::Stream(s), token, interest);
    }

    /// The same for any other descriptor (a listener, a pipe, an eventfd),
    /// which the kernel answers for. The caller keeps it open while it is
    /// registered.
    pub fn add_fd(&mut self, fd: RawFd, token: u64, interest: Ready) {
        self.put(Source::Fd(fd), token, interest);
    }

    /// Stops waiting on `s`; whether it was registered.
    pub fn remove(&mut self, s: &SmcStream) -> bool {
        self.take(Source::Stream(s))
    }

    /// Stops waiting on descriptor `fd`; whether it was registered.
    pub fn remove_fd(&mut self, fd: RawFd) -> bool {
        self.take(Source::Fd(fd))
    }

    /// How many registrations there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn put(&mut self, source: Source<'a>, token: u64, interest: Ready) {
        let e = Entry {
            source,
            token,
            interest,
        };
        match self.entries.iter_mut().find(|x| x.source.same(&source)) {
            Some(x) => *x = e,
            None => self.entries.push(e),
        }
    }

    fn take(&mut self, source: Source<'_>) -> bool {
        let n = self.entries.len();
        self.entries.retain(|x| !x.source.same(&source));
        self.entries.len() != n
    }

    /// Waits at most `timeout` (`None`: for ever) until a registration is
    /// ready, and puts every ready one in `events` (cleared first); their
    /// number. Level-triggered: what stays ready is reported again. A
    /// signal handler ends a wait that sleeps (`ErrorKind::Interrupted`),
    /// and one that spins if the handler calls
    /// [`crate::signal::handler_ran`].
    pub fn wait(&self, events: &mut Vec<Event>, timeout: Option<Duration>) -> io::Result<usize> {
        events.clear();
        let mut fds: Vec<libc::pollfd> = self
            .entries
            .iter()
            .map(|e| libc::pollfd {
                fd: e.source.fd(),
                events: e.interest.bits() as i16,
                revents: 0,
            })
            .collect();
        let members: Vec<Member<'_>> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(index, e)| match e.source {
                Source::Stream(s) => s.smc().map(|conn| Member {
                    index,
                    conn,
                    also: Ready::EMPTY,
                }),
                Source::Fd(_) => None,
            })
            .collect();
        poller::poll(&self.pace, &mut fds, &members, timeout, None, kernel)?;
        events.extend(
            self.entries
                .iter()
                .zip(&fds)
                .filter(|(_, p)| p.revents != 0)
                .map(|(e, p)| Event {
                    token: e.token,
                    ready: Ready::from_bits(p.revents as u16 as u32),
                }),
        );
        Ok(events.len())
    }
}

/// The kernel's `ppoll(2)` over `fds`, at most `t` (`None`: for ever).
fn kernel(fds: &mut [libc::pollfd], t: Option<Duration>) -> io::Result<usize> {
    let ts = t.map(crate::chan_sys::timespec);
    let tp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is writable for its length and the timespec lives
    // across the call; no signal mask.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            tp,
            std::ptr::null(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}
