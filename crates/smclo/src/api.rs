//! The native API: TCP listener and stream types that upgrade to SMC-D when
//! the peer runs smclo on the same device, and otherwise are plain TCP.
//!
//! ```no_run
//! use smclo::api::{SmcListener, SmcStream};
//! use std::io::{Read, Write};
//! let l = SmcListener::bind("127.0.0.1:7000")?;
//! let mut c = SmcStream::connect("127.0.0.1:7000")?;
//! let (mut s, _) = l.accept()?;
//! c.write_all(b"ping")?;
//! let mut b = [0u8; 4];
//! s.read_exact(&mut b)?;
//! println!("shared memory: {}", s.is_smc());
//! # Ok::<(), std::io::Error>(())
//! ```

mod backlog;
mod poller;

/// A program's own `SIGBUS` handler calls it first: a fault of a shared
/// file shrunk under smclo's mappings is recovered (and the handler
/// returns) when it says true.
pub use crate::fault::recover as fault_recover;
/// A program's signal handlers call it, so that a spinning wait fails with
/// `EINTR` as the kernel's sleep would.
pub use crate::signal::handler_ran;
/// Readiness bits, as `poll(2)` spells them: what a [`Poller`] waits for.
pub use crate::wait::Ready;
use backlog::Backlog;
pub use poller::{Event, Poller};

use crate::config::Config;
use crate::conn;
use crate::device::{Device, Role};
use crate::fallbacks::{self, FallbackRecord};
use crate::handshake::{self, Decision, Established};
use crate::registry::{self, ListenerGuard};
use crate::sockaddr;
use crate::tcp_syn;
use smclo_wire::reason::Reason;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

/// How long [`device`] reuses a device without re-validating its directory.
const DEVICE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// The device named by `cfg`, opened (and created) on first use. Kept per
/// directory for [`DEVICE_TTL`], so a connect costs no `mkdir`/`statx`
/// re-validation; after that, [`Device::open`] checks the directory and the
/// device file again (and maps a replaced file). `None`, with a debug line
/// saying why, when the device is unusable (its filesystem is full, its
/// directory is not ours, ...): connections then stay plain TCP
/// (NOSMCDDEV), as the program's would over plain sockets.
fn device(cfg: &Config) -> Option<Arc<Device>> {
    use std::sync::Mutex;
    use std::time::Instant;
    static CACHE: Mutex<Vec<(std::path::PathBuf, Instant, Arc<Device>)>> = Mutex::new(Vec::new());
    // try_lock: a fork child must not wait for a lock held by a lost thread.
    if let Ok(c) = CACHE.try_lock() {
        if let Some((_, _, d)) = c
            .iter()
            .find(|(p, at, _)| *p == cfg.device_dir && at.elapsed() < DEVICE_TTL)
        {
            return Some(d.clone());
        }
    }
    let dev = match Device::open(&cfg.device_dir) {
        Ok(d) => d,
        Err(e) => {
            let dir = cfg.device_dir.display();
            crate::debug!("device {dir} unusable ({e}); connections stay plain TCP");
            return None;
        }
    };
    if let Ok(mut c) = CACHE.try_lock() {
        let now = Instant::now();
        c.retain(|(p, at, _)| *p != cfg.device_dir && now.duration_since(*at) < DEVICE_TTL);
        c.push((cfg.device_dir.clone(), now, dev.clone()));
    }
    Some(dev)
}

fn env_config() -> io::Result<Config> {
    Config::from_env().map_err(io::Error::from)
}

fn resolve<A: ToSocketAddrs>(addr: A) -> io::Result<Vec<SocketAddr>> {
    let v: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if v.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no address to use",
        ));
    }
    Ok(v)
}

/// A TCP listener whose accepted connections use SMC-D when the client runs
/// smclo, and plain TCP otherwise.
///
/// A blocking [`accept`](Self::accept) runs the handshake before it
/// returns. A non-blocking one never waits on a client: a handshake that
/// does not decide within the spin budget goes on after `accept` returned
/// `WouldBlock`, and a later `accept` returns its connection once it
/// decided, as the kernel's SMC does. So
/// [`as_raw_fd`](AsRawFd::as_raw_fd) is not the listening socket but a
/// descriptor for `poll`/`epoll` (an epoll set) that is readable when
/// `accept` may have something to return: a new connection, or a
/// handshake that may have decided.
pub struct SmcListener {
    // Field order matters: kept handshakes are declined and their
    // connections reset before the listener closes.
    backlog: Backlog,
    tcp: TcpListener,
    /// The device and the registration in it; `None` when the device is
    /// unusable (every connection is then plain TCP). A fork child that
    /// finds the registration lost replaces it ([`Self::renew_if_lost`]).
    smc: Option<(Arc<Device>, Mutex<ListenerGuard>)>,
    cfg: Config,
    /// Whether `accept` is non-blocking (the socket's `O_NONBLOCK`).
    nonblocking: AtomicBool,
}

impl SmcListener {
    /// Binds, listens, and announces the listener in the device; settings
    /// from the environment (`SMCLO_*`). Where the device is unusable the
    /// listener is plain TCP (debug log).
    pub fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<SmcListener> {
        SmcListener::bind_with(addr, &env_config()?)
    }

    /// [`bind`](Self::bind) with explicit settings.
    pub fn bind_with<A: ToSocketAddrs>(addr: A, cfg: &Config) -> io::Result<SmcListener> {
        let mut last = None;
        for a in resolve(addr)? {
            match TcpListener::bind(a) {
                Ok(l) => return SmcListener::from_std_with(l, cfg),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("resolve returns at least one address"))
    }

    /// Takes over a listening socket, blocking or not. SYNs that arrived
    /// before this call were not saved, so those connections stay TCP.
    pub fn from_std(tcp: TcpListener) -> io::Result<SmcListener> {
        SmcListener::from_std_with(tcp, &env_config()?)
    }

    /// [`from_std`](Self::from_std) with explicit settings.
    pub fn from_std_with(tcp: TcpListener, cfg: &Config) -> io::Result<SmcListener> {
        let smc = match device(cfg) {
            Some(dev) => {
                tcp_syn::save_syns(tcp.as_raw_fd())?;
                let reg = registry::register_listener(&dev, tcp.local_addr()?)
                    .map_err(io::Error::from)?;
                Some((dev, Mutex::new(reg)))
            }
            None => None,
        };
        // SAFETY: F_GETFL on the listening socket we own.
        let fl = unsafe { libc::fcntl(tcp.as_raw_fd(), libc::F_GETFL) };
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SmcListener {
            backlog: Backlog::new(tcp.as_raw_fd())?,
            tcp,
            smc,
            cfg: cfg.clone(),
            nonblocking: AtomicBool::new(fl & libc::O_NONBLOCK != 0),
        })
    }

    /// Accepts a connection whose handshake has decided: the stream is
    /// SMC-D if the client proposed, TCP otherwise.
    ///
    /// Blocking, it returns a connection whose handshake went on after an
    /// earlier non-blocking `accept` first, else accepts a new one and runs
    /// its handshake (waiting on the client at most `SMCLO_CLC_WAIT_MS`).
    /// Non-blocking, it never waits on a client: it returns the first
    /// earlier connection whose handshake decided meanwhile, else accepts
    /// new ones and gives each the spin budget; a handshake that does not
    /// decide within it goes on, and `WouldBlock` means none decided. Every
    /// accepted connection is returned once, SMC-D or TCP (TIMEOUT when the
    /// client did not answer within `SMCLO_CLC_WAIT_MS`), with every byte
    /// the client wrote; those still undecided when the listener is
    /// dropped are reset, as the kernel resets a closed listener's queue.
    ///
    /// A fork child that goes on accepting after the process that made the
    /// listener dropped it or exited (a program that daemonizes after it
    /// listens) registers the listener again when it accepts a client
    /// that did not propose: that connection stays TCP (PEERNOSMC), the
    /// next ones are SMC-D.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        let Some((dev, reg)) = &self.smc else {
            let (tcp, peer) = self.tcp.accept()?;
            return Ok((SmcStream::new(tcp, Decision::Tcp(Reason::NoSmcdDev)), peer));
        };
        let (tcp, peer, d) = if self.nonblocking.load(Ordering::Relaxed) {
            self.backlog.accept(&self.tcp, dev, &self.cfg)?
        } else if let Some(a) = self.backlog.accept_kept_blocking() {
            a
        } else {
            // std's accept restarts after a signal handler: so does the
            // spin's end.
            let spun = crate::accept_spin::before_accept(
                self.tcp.as_raw_fd(),
                &crate::signal::Watch::begin(None),
            );
            let (tcp, peer) = self.tcp.accept()?;
            crate::accept_spin::accepted(spun);
            let deadline = std::time::Instant::now() + self.cfg.clc_wait;
            let d = handshake::Pending::accept(dev, &self.cfg, tcp.as_raw_fd(), deadline).finish();
            (tcp, peer, d)
        };
        let plain = d.peer_did_not_propose();
        crate::accept_spin::peer_proposed(!plain);
        if plain {
            self.renew_if_lost(reg);
        }
        Ok((
            SmcStream::new(tcp, d).on_device(dev, Role::Server, peer),
            peer,
        ))
    }

    /// A client that did not propose was accepted: if the registration
    /// `reg` was lost while this process listens (a fork child whose
    /// parent, which made it, dropped the listener or exited), the
    /// listener is registered again, so that the next clients propose.
    fn renew_if_lost(&self, reg: &Mutex<ListenerGuard>) {
        // try_lock: a thread renewing meanwhile does it for this one too,
        // and a fork child must not wait for a lock held by a lost thread.
        let mut g = match reg.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        match g.renewed(self.tcp.as_raw_fd()) {
            Some(Ok(new)) => *g = new,
            Some(Err(e)) => crate::debug!("listener not registered again ({e}); clients use TCP"),
            None => {}
        }
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Non-blocking `accept`: it then never waits on a client (see
    /// [`accept`](Self::accept)). Connections whose handshakes went on are
    /// still returned after switching back to blocking, first.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nonblocking(on)?;
        self.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }
}

impl AsRawFd for SmcListener {
    /// The descriptor to wait on for [`accept`](SmcListener::accept), with
    /// `poll`/`epoll` (or [`Poller::add_fd`]): readable when `accept` may
    /// have something to return (a pending connection, or a handshake
    /// that may have decided). It is not the listening socket: use
    /// [`local_addr`](SmcListener::local_addr) for its address. Owned by
    /// the listener.
    fn as_raw_fd(&self) -> RawFd {
        self.backlog.fd()
    }
}

/// A connected stream: SMC-D through shared memory, or plain TCP.
///
/// It reads and writes like a `TcpStream` (`Read`/`Write`, also through
/// `&SmcStream`), and [`as_raw_fd`](AsRawFd::as_raw_fd) is a descriptor that
/// `poll`/`epoll` report readable and writable exactly when `read`/`write`
/// would make progress. A blocking call that a signal handler interrupts
/// before it moved any byte fails with [`io::ErrorKind::Interrupted`]
/// (`read_exact` and `write_all` retry it, as for a `TcpStream`); while
/// the call spins before it sleeps, only a handler that calls
/// [`crate::signal::handler_ran`] is seen.
pub struct SmcStream {
    // Field order matters: the SMC-D end closes (and delivers its close
    // flag) before the TCP connection, which only carries identity.
    smc: Option<Established>,
    tcp: TcpStream,
    fallback: Option<Reason>,
    /// A TCP stream's entry in the device's fallback table (`smclo ss -a`).
    _listed: Option<FallbackRecord>,
}

impl SmcStream {
    fn new(tcp: TcpStream, d: Decision) -> SmcStream {
        let (smc, fallback) = match d {
            Decision::Smc(e) => (Some(e), None),
            Decision::Tcp(r) => (None, Some(r)),
        };
        SmcStream {
            smc,
            tcp,
            fallback,
            _listed: None,
        }
    }

    /// A stream on `dev`: a TCP one is listed in the fallback table while
    /// it lives, as the `side` that decided, connected to `peer`.
    fn on_device(mut self, dev: &Device, side: Role, peer: SocketAddr) -> SmcStream {
        if let Some(r) = self.fallback {
            self._listed = fallbacks::record(
                dev,
                self.tcp.as_raw_fd(),
                side,
                r,
                fallbacks::Known::peer(Some(peer)),
            );
        }
        self
    }

    /// Connects; upgrades to SMC-D if the server runs smclo on this
    /// device. Settings from the environment (`SMCLO_*`). Where the device
    /// is unusable the connection is plain TCP (NOSMCDDEV, debug log).
    pub fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<SmcStream> {
        SmcStream::connect_with(addr, &env_config()?)
    }

    /// [`connect`](Self::connect) with explicit settings.
    pub fn connect_with<A: ToSocketAddrs>(addr: A, cfg: &Config) -> io::Result<SmcStream> {
        let dev = device(cfg);
        let mut last = None;
        for a in resolve(addr)? {
            let s = match &dev {
                Some(dev) => connect_one(dev, cfg, a),
                None => TcpStream::connect(a)
                    .map(|tcp| SmcStream::new(tcp, Decision::Tcp(Reason::NoSmcdDev))),
            };
            match s {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("resolve returns at least one address"))
    }

    /// Whether this connection goes through shared memory.
    pub fn is_smc(&self) -> bool {
        self.smc.is_some()
    }

    /// Why this connection is plain TCP (`None` when it is SMC-D).
    pub fn fallback_reason(&self) -> Option<Reason> {
        self.fallback
    }

    /// The SMC-D connection, if any.
    pub fn smc(&self) -> Option<&conn::Conn> {
        self.smc.as_ref().map(|e| &e.conn)
    }

    /// The peer's address (from the TCP connection, which is kept for
    /// identity even when the data goes through shared memory).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// This end's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The TCP connection underneath (idle while SMC-D is in use), with
    /// its IP options as the program left them (the SYN mark put back).
    pub fn tcp(&self) -> &TcpStream {
        if let Some(e) = &self.smc {
            e.syn_mark.put_back(self.tcp.as_raw_fd());
        }
        &self.tcp
    }

    /// Non-blocking mode for reads and writes. The only way to change it:
    /// the stream keeps the flag and, while no other process shares its
    /// descriptor, does not ask it again, so an `fcntl` on the raw
    /// descriptor is not seen. After a `fork` it is asked; a program that
    /// passes the descriptor to another process otherwise (`SCM_RIGHTS`)
    /// must not change the flag there.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nonblocking(on)?;
        match &self.smc {
            Some(e) => e.conn.set_nonblocking(on),
            None => Ok(()),
        }
    }

    /// `SO_RCVTIMEO`, as [`TcpStream::set_read_timeout`]: a read that
    /// would sleep longer fails with `WouldBlock` (or returns what it has).
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(t)?;
        if let Some(e) = &self.smc {
            e.conn.set_read_timeout(t);
        }
        Ok(())
    }

    /// `SO_SNDTIMEO`, as [`TcpStream::set_write_timeout`], for writes.
    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)?;
        if let Some(e) = &self.smc {
            e.conn.set_write_timeout(t);
        }
        Ok(())
    }

    /// `TCP_NODELAY` of the TCP connection; turning it on sends what a cork
    /// holds, as TCP does. Unlike [`SmcStream::tcp`], leaves the SYN mark
    /// (see docs/ARCHITECTURE.md, "Handshake") where it is.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)?;
        match &self.smc {
            Some(e) if on => e.conn.flush(),
            _ => Ok(()),
        }
    }

    /// `TCP_CORK`: while on, writes are held and sent together when it is
    /// turned off (or half the peer's ring fills, or the stream ends), as
    /// TCP and the kernel's SMC cork. Over SMC-D nothing sends held bytes
    /// on a timer: turn it off when the unit is complete.
    pub fn set_cork(&self, on: bool) -> io::Result<()> {
        match &self.smc {
            Some(e) => e.conn.set_cork(on),
            None => {
                let v: libc::c_int = on.into();
                // SAFETY: an int option of our own socket, `v` lives across the call.
                let r = unsafe {
                    libc::setsockopt(
                        self.tcp.as_raw_fd(),
                        libc::IPPROTO_TCP,
                        libc::TCP_CORK,
                        (&v as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                if r == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            }
        }
    }

    /// `shutdown(2)`: `Write` half-closes (the peer reads everything, then
    /// EOF); `Read` is local only, as in SMC.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.smc {
            None => self.tcp.shutdown(how),
            Some(e) => match how {
                Shutdown::Read => Ok(()),
                Shutdown::Write | Shutdown::Both => e.conn.shutdown_write(),
            },
        }
    }

    /// Zero-copy send: a writable region of at least `min` bytes (at most
    /// the ring size) directly inside the peer's DMB. Write into it
    /// ([`WriteRegion::copy_from_slice`], or in place through
    /// [`WriteRegion::as_mut_ptr`]), then [`WriteRegion::commit`]. On a TCP
    /// connection the region is a local buffer that `commit` sends.
    pub fn reserve(&self, min: usize) -> io::Result<WriteRegion<'_>> {
        match &self.smc {
            Some(e) => Ok(WriteRegion(WriteInner::Smc(e.conn.reserve(min)?))),
            None => Ok(WriteRegion(WriteInner::Tcp(vec![0; min.max(1)], &self.tcp))),
        }
    }

    /// Zero-copy receive: the received bytes, in place in this end's DMB
    /// ([`ReadRegion::copy_to_slice`], or in place through
    /// [`ReadRegion::as_ptr`]). Empty means end of stream. Consume with
    /// [`ReadRegion::release`].
    pub fn peek_region(&self) -> io::Result<ReadRegion<'_>> {
        match &self.smc {
            Some(e) => Ok(ReadRegion(ReadInner::Smc(e.conn.peek_region()?))),
            // TCP: peek, so the bytes stay in the socket (and poll keeps
            // reporting them) until released.
            None => {
                let mut buf = vec![0u8; 64 * 1024];
                let n = self.tcp.peek(&mut buf)?;
                buf.truncate(n);
                Ok(ReadRegion(ReadInner::Tcp(buf, &self.tcp)))
            }
        }
    }

    fn read_inner(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.smc {
            Some(e) => e.conn.read(buf),
            None => (&self.tcp).read(buf),
        }
    }

    fn write_inner(&self, buf: &[u8]) -> io::Result<usize> {
        match &self.smc {
            Some(e) => e.conn.write(buf),
            None => (&self.tcp).write(buf),
        }
    }
}

fn connect_one(dev: &Arc<Device>, cfg: &Config, dest: SocketAddr) -> io::Result<SmcStream> {
    let family = if dest.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2) with constant arguments; the result is checked and
    // owned by a TcpStream right away.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nobody else owns.
    let tcp = unsafe { TcpStream::from_raw_fd(fd) };
    let proposal =
        handshake::client_propose_with(dev, cfg, fd, dest, handshake::SocketFacts::new_socket());
    let connected = sockaddr::connect(fd, dest);
    let (d, listed) = match proposal {
        Ok(p) => {
            let deadline = std::time::Instant::now() + cfg.clc_wait;
            let p = handshake::Pending::connect(p, deadline);
            connected?;
            (p.finish(), true)
        }
        Err(r) => {
            connected?;
            dev.count_fallback(r, Role::Client);
            crate::debug!("client uses TCP to {dest}: {r}");
            (Decision::Tcp(r), fallbacks::client_lists(r))
        }
    };
    let s = SmcStream::new(tcp, d);
    Ok(if listed {
        s.on_device(dev, Role::Client, dest)
    } else {
        s
    })
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_inner(buf)
    }
}

impl Read for &SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_inner(buf)
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for &SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for SmcStream {
    /// The descriptor to poll: the readiness channel for SMC-D, the socket
    /// for TCP.
    fn as_raw_fd(&self) -> RawFd {
        match &self.smc {
            Some(e) => e.conn.fd(),
            None => self.tcp.as_raw_fd(),
        }
    }
}

/// A region reserved for sending; see [`SmcStream::reserve`]. On SMC-D it
/// is free space in the peer's ring, so it is filled by copying in
/// ([`copy_from_slice`](Self::copy_from_slice)) or through a raw pointer
/// ([`as_mut_ptr`](Self::as_mut_ptr)), never through a `&mut [u8]`.
///
/// ```compile_fail
/// fn fill(s: &smclo::api::SmcStream) {
///     let mut w = s.reserve(1).unwrap();
///     w.as_mut_slice()[0] = 1; // no slice of the peer's memory
/// }
/// ```
pub struct WriteRegion<'a>(WriteInner<'a>);

enum WriteInner<'a> {
    /// Inside the peer's DMB.
    Smc(conn::WriteRegion<'a>),
    /// A local buffer for a TCP connection.
    Tcp(Vec<u8>, &'a TcpStream),
}

impl WriteRegion<'_> {
    /// Size of the region in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            WriteInner::Smc(r) => r.len(),
            WriteInner::Tcp(b, _) => b.len(),
        }
    }

    /// Whether the region has no room (never, for a reserved region).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the region at `offset`. Panics if it does not fit
    /// (`offset + src.len() > len()`), like slice indexing.
    pub fn copy_from_slice(&mut self, offset: usize, src: &[u8]) {
        match &mut self.0 {
            WriteInner::Smc(r) => r.copy_from_slice(offset, src),
            WriteInner::Tcp(b, _) => b[offset..offset + src.len()].copy_from_slice(src),
        }
    }

    /// The start of the region, valid for [`len`](Self::len) bytes until
    /// the region is committed or dropped, under the contract of
    /// [`conn::WriteRegion::as_mut_ptr`]: write through raw pointers or
    /// system calls only, never through a `&mut [u8]` made from it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match &mut self.0 {
            WriteInner::Smc(r) => r.as_mut_ptr(),
            WriteInner::Tcp(b, _) => b.as_mut_ptr(),
        }
    }

    /// Sends the first `n` bytes of the region.
    pub fn commit(self, n: usize) -> io::Result<()> {
        match self.0 {
            WriteInner::Smc(r) => r.commit(n),
            WriteInner::Tcp(b, mut t) => {
                let n = n.min(b.len());
                t.write_all(&b[..n])
            }
        }
    }
}

/// Received bytes in place; see [`SmcStream::peek_region`]. On SMC-D they
/// are in this end's ring, which the peer maps, so they are read by copying
/// out ([`copy_to_slice`](Self::copy_to_slice)) or through a raw pointer
/// ([`as_ptr`](Self::as_ptr)), never through a `&[u8]`.
///
/// ```compile_fail
/// fn first(s: &smclo::api::SmcStream) -> u8 {
///     let r = s.peek_region().unwrap();
///     r.as_slice()[0] // no slice of memory the peer can write
/// }
/// ```
pub struct ReadRegion<'a>(ReadInner<'a>);

enum ReadInner<'a> {
    /// Inside this end's DMB.
    Smc(conn::ReadRegion<'a>),
    /// A copy of the bytes waiting in a TCP connection (still queued there).
    Tcp(Vec<u8>, &'a TcpStream),
}

impl ReadRegion<'_> {
    /// Number of received bytes (0 at end of stream).
    pub fn len(&self) -> usize {
        match &self.0 {
            ReadInner::Smc(r) => r.len(),
            ReadInner::Tcp(b, _) => b.len(),
        }
    }

    /// Whether the region is empty: end of stream.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    /// Panics if they are not all in it (`offset + dst.len() > len()`).
    pub fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) {
        match &self.0 {
            ReadInner::Smc(r) => r.copy_to_slice(offset, dst),
            ReadInner::Tcp(b, _) => dst.copy_from_slice(&b[offset..offset + dst.len()]),
        }
    }

    /// The start of the received bytes, valid for [`len`](Self::len) bytes
    /// until the region is released or dropped, under the contract of
    /// [`conn::ReadRegion::as_ptr`]: read through raw pointers or system
    /// calls only, each byte once, never through a `&[u8]` made from it.
    pub fn as_ptr(&self) -> *const u8 {
        match &self.0 {
            ReadInner::Smc(r) => r.as_ptr(),
            ReadInner::Tcp(b, _) => b.as_ptr(),
        }
    }

    /// Consumes the first `n` bytes.
    pub fn release(self, n: usize) -> io::Result<()> {
        match self.0 {
            ReadInner::Smc(r) => r.release(n),
            ReadInner::Tcp(mut b, mut t) => {
                let n = n.min(b.len());
                t.read_exact(&mut b[..n])
            }
        }
    }
}
