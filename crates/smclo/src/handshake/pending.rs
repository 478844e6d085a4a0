//! [`Pending`]: one handshake that has not decided yet, either end's, as
//! every driver sees it: the native listener's backlog, the native
//! `connect` and `accept`, and the preload's descriptors. A driver makes
//! one, [`poll`](Pending::poll)s it as far as it may wait, and sleeps on
//! its [`Wake`] between two polls.

use super::{ClientProposal, Decision, ServerHandshake, Wake};
use crate::config::Config;
use crate::device::{Device, Role};
use smclo_wire::reason::Reason;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Instant;

/// How long one [`Pending::poll`] may wait, and for whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// An event loop's look: it busy-polls or sleeps at most until then,
    /// and a server does not wait for its client's early bytes longer than
    /// such a step may take.
    Step(Instant),
    /// A blocking call's look, which looks again after it: as
    /// [`Until::Step`], but a server waits for the client's early bytes as
    /// a blocking `accept` does.
    BlockingStep(Instant),
    /// Until the handshake decides (at its deadline at the latest).
    Decided,
}

impl Until {
    /// The instant the poll returns by, undecided; `None`: it decides.
    fn at(self) -> Option<Instant> {
        match self {
            Until::Step(t) | Until::BlockingStep(t) => Some(t),
            Until::Decided => None,
        }
    }

    /// Whether the caller waits for the decision all the same.
    fn may_wait(self) -> bool {
        !matches!(self, Until::Step(_))
    }
}

/// What a client's look knows of its TCP socket before it polls
/// ([`Pending::poll_told`]): whether its server went on over TCP is asked
/// of the socket, or the caller's own wait on it already said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcpNews {
    /// The look asks the socket (a `recv(MSG_PEEK)`) when it is due.
    #[default]
    Ask,
    /// The caller has not seen the socket readable: the look makes no
    /// system call for it.
    Nothing,
    /// The caller's wait found the socket readable (bytes, the end of
    /// the stream): the server went on over TCP.
    Spoke,
}

/// What a [`Pending::poll`] found.
// Made once per connection and moved once: boxing the decision would cost
// an allocation per connection for nothing.
#[allow(clippy::large_enum_variant)]
pub enum Polled {
    /// The handshake decided (fallbacks are counted and logged).
    Decided(Decision),
    /// Not yet: what to sleep on before the next poll.
    Waiting(Wake),
}

/// Who looks at a [`Pending`] whose wake descriptor a wait found readable
/// ([`Pending::readable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Looker {
    /// The caller polls this handshake next.
    Caller,
    /// Another thread does: it is woken when its step is ready.
    Other,
}

/// The two ends' state machines.
// Made once per connection and moved once: see [`Polled`].
#[allow(clippy::large_enum_variant)]
enum Side {
    Connect(ClientProposal),
    Accept(ServerHandshake),
}

/// One undecided handshake, with the instant this end gives up
/// (TIMEOUT). Dropped undecided, it withdraws the proposal (a client) or
/// declines it if it had answered (a server).
pub struct Pending {
    side: Side,
    deadline: Instant,
}

impl Pending {
    /// The client's handshake of proposal `p`, whose `connect` returned
    /// (0 or `EINPROGRESS`): its port is published in the slot now.
    pub fn connect(mut p: ClientProposal, deadline: Instant) -> Pending {
        p.syn_sent();
        Pending {
            side: Side::Connect(p),
            deadline,
        }
    }

    /// The server's handshake of the freshly accepted TCP connection
    /// `conn_fd`: reads its saved SYN and finds the proposals it may
    /// answer, without waiting.
    pub fn accept(dev: &Arc<Device>, cfg: &Config, conn_fd: RawFd, deadline: Instant) -> Pending {
        Pending {
            side: Side::Accept(ServerHandshake::new(dev, cfg, conn_fd)),
            deadline,
        }
    }

    /// Advances the handshake, waiting at most as `until` says: up to the
    /// spin budget before it busy-polls, a longer wait sleeps on
    /// [`wake`](Self::wake).
    pub fn poll(&mut self, until: Until) -> Polled {
        self.poll_told(until, TcpNews::Ask)
    }

    /// [`poll`](Self::poll) with what the caller knows of a client's TCP
    /// socket (`news`; a server's handshake ignores it).
    pub fn poll_told(&mut self, until: Until, news: TcpNews) -> Polled {
        let d = match &mut self.side {
            Side::Connect(p) => p.decide_by(self.deadline, until.at(), news),
            Side::Accept(h) => h.decide_within(self.deadline, until.at(), until.may_wait()),
        };
        match d {
            Some(d) => Polled::Decided(d),
            None => Polled::Waiting(self.wake()),
        }
    }

    /// Polls until the handshake decides (its deadline at the latest).
    pub fn finish(mut self) -> Decision {
        loop {
            if let Polled::Decided(d) = self.poll(Until::Decided) {
                return d;
            }
        }
    }

    /// What to sleep on before the next poll: readable when the peer took
    /// its next step, or look again after a while.
    pub fn wake(&self) -> Wake {
        match &self.side {
            Side::Connect(p) => p.wake(),
            Side::Accept(h) => h.wake(),
        }
    }

    /// The descriptor of [`wake`](Self::wake) was found readable: a client
    /// takes the servers' connections off its rendezvous socket (each is
    /// filed for its proposal, and its waiter woken unless `looker` is the
    /// caller).
    pub fn readable(&self, looker: Looker) {
        if let Side::Connect(p) = &self.side {
            p.woken(looker == Looker::Caller);
        }
    }

    /// Whether this is a client's announcement
    /// ([`ClientProposal::announced`]): the connection goes on as TCP, and
    /// nothing waits for the server's answer.
    pub fn announced(&self) -> bool {
        matches!(&self.side, Side::Connect(p) if p.announced())
    }

    /// An announcement the program needs decided now: TCP (UNANSWERED,
    /// counted) unless a server has begun to answer it, in which case
    /// `None` and its decision is near ([`ClientProposal::retract`]).
    pub fn retract(&mut self) -> Option<Decision> {
        match &mut self.side {
            Side::Connect(p) => p.retract(),
            Side::Accept(_) => None,
        }
    }

    /// The descriptor goes to another process (`SCM_RIGHTS`) while the
    /// handshake is undecided: a server declines the client's proposal
    /// (PASSED, [`Pending::refuse`]) and the connection is TCP. A client's
    /// handshake goes on (`None`): its socket is the proposer's.
    pub fn pass(&mut self) -> Option<Decision> {
        self.refuse(Reason::Passed)
    }

    /// A server's connection cannot go through shared memory (`why`): it
    /// declines the client's proposal, which wakes the client at once
    /// ([`ServerHandshake::refuse`]), and the connection is TCP. A
    /// client's handshake goes on (`None`).
    pub fn refuse(&mut self, why: Reason) -> Option<Decision> {
        match &mut self.side {
            Side::Accept(h) => Some(h.refuse(why, self.deadline)),
            Side::Connect(_) => None,
        }
    }

    /// When this end gives up (TIMEOUT).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The reason a server's connection stays TCP, when its handshake
    /// decided as it began, without a client to look for (a plain
    /// client's connection): reported, and nothing else to do. `None`
    /// otherwise (a client's handshake too).
    pub fn settled(&mut self) -> Option<Reason> {
        match &mut self.side {
            Side::Accept(h) => h.settled(),
            Side::Connect(_) => None,
        }
    }

    /// A server's local and peer addresses, as its saved SYN showed them.
    pub fn seen_ends(&self) -> Option<(SocketAddr, SocketAddr)> {
        match &self.side {
            Side::Accept(h) => h.seen_ends(),
            Side::Connect(_) => None,
        }
    }

    /// Which end this is.
    pub fn role(&self) -> Role {
        match &self.side {
            Side::Connect(_) => Role::Client,
            Side::Accept(_) => Role::Server,
        }
    }

    /// The client's proposal (its early bytes, its socket's close); `None`
    /// at the server.
    pub fn proposal_mut(&mut self) -> Option<&mut ClientProposal> {
        match &mut self.side {
            Side::Connect(p) => Some(p),
            Side::Accept(_) => None,
        }
    }
}
