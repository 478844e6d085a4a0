//! exec keeps SMC-D connections, as it keeps kernel sockets: when the new
//! program loads this library too ([`super::target`]), each connection
//! goes on in it at the same descriptor numbers with everything in flight.
//!
//! Before exec ([`prepare`]): for every connection of the table, the
//! memfds of both DMBs (mappings do not survive exec; closed memfds come
//! back from the core's `vault`), its channel and hidden TCP socket are made
//! inheritable, the descriptors the program passes (no `FD_CLOEXEC` in its
//! view) too, and all of it is described in [`VAR`], added to the
//! environment the exec passes. Its value starts with [`Moves`], which
//! every version reads the same way, then the layout of this version.
//! Nothing is torn down: if exec fails the descriptors get `FD_CLOEXEC`
//! back ([`Handoff::undo`]) and the connections go on in this image. A
//! connection the program does not pass (all its descriptors
//! close-on-exec in the program's view) ends before exec, as the kernel
//! would close it at exec, unless another process of the family holds
//! it.
//!
//! At load ([`at_load`]): the new image removes [`VAR`] from its
//! environment (its own children must not see it), maps the DMBs again,
//! takes over the DMB table entries (same pid and start time), and fills
//! its table. A connection it cannot adopt is reset at both ends, and its
//! descriptors become the TCP socket (a debug line says why). A value of
//! another layout (another smclo version wrote it) is carried out by its
//! [`Moves`] alone: the program's descriptors become the TCP sockets.

use super::LIVE;
use crate::holders;
use crate::real;
use crate::table::{self, Sock, LOCK};
use libc::c_char;
use smclo::adapter::conn::{Conn, ExecParts, ExecState};
use smclo::debug;
use smclo::device::Device;
use smclo::device::Registration;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The environment variable that carries the connections to the new image.
const VAR: &str = "SMCLO_EXEC_CONNS";
/// The version of the layout after [`Moves`] in its value.
const FORMAT: &str = "2";

/// The start of [`VAR`]'s value, the same in every version, up to the
/// first space: comma-separated `N=M`, the program's descriptor `N` gets
/// (a duplicate of) descriptor `M`, a connection's TCP socket; and `N=`,
/// descriptor `N` is smclo's own. A reader that does not know the layout
/// after the space does every `N=M` (`dup2`), then closes every `M` and
/// every `N=` that is not the `N` of a move: the program has its TCP
/// connections at its numbers, as when the new program does not load the
/// preload, and the peer sees its SMC-D connection end without a close
/// (a reset).
#[derive(Debug, Default, PartialEq, Eq)]
struct Moves(Vec<(RawFd, Option<RawFd>)>);

impl Moves {
    fn encode(&self) -> String {
        let one = |(n, m): &(RawFd, Option<RawFd>)| match m {
            Some(m) => format!("{n}={m}"),
            None => format!("{n}="),
        };
        self.0.iter().map(one).collect::<Vec<_>>().join(",")
    }

    fn decode(s: &str) -> Option<Moves> {
        let one = |x: &str| {
            let (n, m) = x.split_once('=')?;
            let m = if m.is_empty() {
                None
            } else {
                Some(m.parse().ok()?)
            };
            Some((n.parse().ok()?, m))
        };
        let v: Option<Vec<_>> = s.split(',').filter(|x| !x.is_empty()).map(one).collect();
        v.filter(|v| v.iter().all(|&(n, m)| n >= 0 && m.is_none_or(|m| m >= 0)))
            .map(Moves)
    }

    /// The moves of connection `p`: its descriptors get its TCP socket;
    /// its channel (where not one of them) and memfds are smclo's.
    fn add(&mut self, p: &Passed) {
        self.0.extend(p.fds.iter().map(|&fd| (fd, Some(p.tcp))));
        let own = [p.chan].into_iter().filter(|c| !p.fds.contains(c));
        self.0
            .extend(own.chain([p.local, p.peer]).map(|fd| (fd, None)));
    }

    /// Carries them out (see [`Moves`]).
    fn apply(&self) {
        for &(n, m) in &self.0 {
            if let Some(m) = m {
                // SAFETY: replaces the program's descriptor with the TCP
                // socket passed for it.
                unsafe { real::dup3(m, n, 0) };
            }
        }
        let kept: Vec<RawFd> = self
            .0
            .iter()
            .filter(|(_, m)| m.is_some())
            .map(|&(n, _)| n)
            .collect();
        let mut closed = Vec::new();
        for fd in self.0.iter().map(|&(n, m)| m.unwrap_or(n)) {
            if !kept.contains(&fd) && !closed.contains(&fd) {
                closed.push(fd);
                // SAFETY: a descriptor passed to this image for smclo.
                unsafe { real::close(fd) };
            }
        }
    }
}

/// One connection as the new image (or a process it is passed to,
/// [`super::passing`]) receives it.
pub(super) struct Passed {
    /// The program's descriptors of it (none: close it at once).
    pub(super) fds: Vec<RawFd>,
    pub(super) chan: RawFd,
    pub(super) tcp: RawFd,
    pub(super) local: RawFd,
    pub(super) peer: RawFd,
    pub(super) shut_rd: bool,
    pub(super) linger0: bool,
    /// Other processes that hold it (fork family).
    pub(super) holders: Vec<u32>,
    pub(super) st: ExecState,
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join("+")
}

fn split<T: std::str::FromStr>(s: &str) -> Option<Vec<T>> {
    s.split('+')
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().ok())
        .collect()
}

impl Passed {
    pub(super) fn encode(&self) -> String {
        let st = &self.st;
        let b = |x: bool| x as u8;
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            join(&self.fds),
            self.chan,
            self.tcp,
            self.local,
            self.peer,
            b(self.shut_rd),
            b(self.linger0),
            join(&self.holders),
            st.local_token,
            st.entry,
            b(st.client),
            st.peer_token,
            st.peer_attach,
            st.sndbuf_len,
            st.sent,
            st.received,
            st.rx_owed,
            st.rcv_timeo_us,
            st.snd_timeo_us,
            b(st.cork),
            b(st.shut_wr),
            st.err,
            b(st.forked)
        )
    }

    pub(super) fn decode(s: &str) -> Option<Passed> {
        let f: Vec<&str> = s.split(',').collect();
        if f.len() != 23 {
            return None;
        }
        let n = |i: usize| f[i].parse::<u64>().ok();
        let fd = |i: usize| f[i].parse::<RawFd>().ok();
        let b = |i: usize| n(i).map(|v| v != 0);
        Some(Passed {
            fds: split(f[0])?,
            chan: fd(1)?,
            tcp: fd(2)?,
            local: fd(3)?,
            peer: fd(4)?,
            shut_rd: b(5)?,
            linger0: b(6)?,
            holders: split(f[7])?,
            st: ExecState {
                local_token: n(8)?,
                entry: n(9)? as usize,
                client: b(10)?,
                peer_token: n(11)?,
                peer_attach: n(12)?,
                sndbuf_len: n(13)? as u32,
                sent: n(14)?,
                received: n(15)?,
                rx_owed: n(16)? as u32,
                rcv_timeo_us: n(17)?,
                snd_timeo_us: n(18)?,
                cork: b(19)?,
                shut_wr: b(20)?,
                err: f[21].parse().ok()?,
                forked: b(22)?,
            },
        })
    }
}

/// What [`prepare`] changed, to give exec its environment and to undo it
/// if exec fails.
pub(super) struct Handoff {
    /// `VAR=...`.
    var: CString,
    /// Descriptors whose `FD_CLOEXEC` was cleared.
    opened: Vec<RawFd>,
    /// Descriptors made for the new image (the DMBs' memfds).
    made: Vec<OwnedFd>,
}

fn set_cloexec(fd: RawFd, on: bool) {
    let flag = if on { libc::FD_CLOEXEC } else { 0 };
    // The system call itself: `fd` may be a table descriptor, whose libc
    // fcntl the hooks answer with the program's view.
    smclo::adapter::chan_sys::fcntl(fd, libc::F_SETFD, flag as libc::c_long);
}

/// An inheritable duplicate of `fd` at a high number (smclo::adapter::fdnum).
fn inheritable_dup(fd: RawFd) -> Option<OwnedFd> {
    let n = smclo::adapter::chan_sys::fcntl(
        fd,
        libc::F_DUPFD,
        smclo::adapter::fdnum::floor() as libc::c_long,
    );
    // SAFETY: `n` was just returned to us.
    (n >= 0).then(|| unsafe { OwnedFd::from_raw_fd(n) })
}

impl Handoff {
    fn open(&mut self, fd: RawFd) {
        set_cloexec(fd, false);
        self.opened.push(fd);
    }

    /// `f` inheritable (moved to a high number); its number.
    fn keep(&mut self, f: OwnedFd) -> Option<RawFd> {
        let d = inheritable_dup(f.as_raw_fd())?;
        let n = d.as_raw_fd();
        self.made.push(d);
        Some(n)
    }

    /// The environment for exec: `plain` plus ours.
    pub(super) fn envp(&self, plain: PlainEnv) -> Vec<*const c_char> {
        let mut v = plain.into_vec();
        v.insert(v.len() - 1, self.var.as_ptr());
        v
    }

    /// Exec failed: the connections go on here.
    pub(super) fn undo(self) {
        for fd in self.opened {
            set_cloexec(fd, true);
        }
        debug!("exec failed; the SMC-D connections stay with this program");
    }
}

/// The environment an exec passes: `envp` (NULL-terminated; NULL: none)
/// without [`VAR`]. Only the image that wrote the variable may pass it,
/// since a new image takes its numbers for its own descriptors. Without
/// one in `envp` (the common case) nothing is allocated: exec may follow
/// `fork` in a multithreaded program.
pub(super) struct PlainEnv {
    envp: *const *const c_char,
    /// The entries but [`VAR`], NULL-terminated, where `envp` has it.
    copy: Option<Vec<*const c_char>>,
}

/// Whether the environment entry `e` is [`VAR`]'s.
fn is_var(e: &[u8]) -> bool {
    e.strip_prefix(VAR.as_bytes())
        .is_some_and(|r| r.first() == Some(&b'='))
}

impl PlainEnv {
    pub(super) fn new(envp: *const *const c_char) -> PlainEnv {
        let entries = || super::target::entries(envp);
        let copy = has_var(envp).then(|| {
            let mut v: Vec<_> = entries()
                .filter(|e| !is_var(e.to_bytes()))
                .map(|e| e.as_ptr())
                .collect();
            v.push(std::ptr::null());
            v
        });
        PlainEnv { envp, copy }
    }

    pub(super) fn as_ptr(&self) -> *const *const c_char {
        self.copy.as_ref().map_or(self.envp, |v| v.as_ptr())
    }

    /// The entries, NULL-terminated.
    fn into_vec(self) -> Vec<*const c_char> {
        self.copy.unwrap_or_else(|| {
            let mut v: Vec<_> = super::target::entries(self.envp)
                .map(|e| e.as_ptr())
                .collect();
            v.push(std::ptr::null());
            v
        })
    }
}

/// Whether `envp` has a [`VAR`] entry (no allocation).
fn has_var(envp: *const *const c_char) -> bool {
    if envp.is_null() {
        return false;
    }
    (0..)
        .map(|i| {
            // SAFETY: envp is a NULL-terminated vector of C strings (exec's
            // contract), read up to its NULL.
            unsafe { *envp.add(i) }
        })
        .take_while(|p| !p.is_null())
        .any(|p| {
            // SAFETY: each entry is a NUL-terminated string.
            is_var(unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes())
        })
}

/// Connections that do not go along: the program does not pass them, or
/// they cannot follow (they fall back).
pub(super) type Refused = Vec<Arc<Sock>>;

/// Prepares every connection of the table for the new image (see the
/// module documentation). Returns the handoff, and the program's
/// descriptors of connections that cannot go along (they fall back as
/// when the new program does not load this library).
pub(super) fn prepare() -> (Option<Handoff>, Refused) {
    let Some(ctx) = super::ctx() else {
        return (None, Vec::new());
    };
    let g = LOCK.write();
    let all = table::all_locked();
    let mut h = Handoff {
        var: CString::default(),
        opened: Vec::new(),
        made: Vec::new(),
    };
    let mut entries = Vec::new();
    let mut moves = Moves::default();
    let mut refused = Vec::new();
    let mut seen: Vec<*const Sock> = Vec::new();
    for (_, s) in &all {
        if seen.contains(&Arc::as_ptr(s)) {
            continue;
        }
        seen.push(Arc::as_ptr(s));
        let fds: Vec<RawFd> = all
            .iter()
            .filter(|(fd, x)| Arc::ptr_eq(x, s) && !table::app_cloexec(*fd))
            .map(|(fd, _)| *fd)
            .collect();
        if fds.is_empty() {
            // Close-on-exec in the program's view: it ends here, as the
            // kernel closes such a socket (another process of the family
            // may still hold it, recognised by the channel's number).
            refused.push(s.clone());
            continue;
        }
        match pass(&mut h, s, &fds) {
            Ok(p) => {
                moves.add(&p);
                entries.push(p.encode());
            }
            Err(why) => {
                debug!(
                    "exec: SMC-D connection (channel fd {}) cannot follow: {why}",
                    s.conn.fd()
                );
                refused.push(s.clone());
            }
        }
    }
    drop(g);
    let dir = hex(ctx.dev.dir().as_os_str().as_encoded_bytes());
    let var = format!(
        "{VAR}={} {FORMAT}:{dir}:{}",
        moves.encode(),
        entries.join(";")
    );
    h.var = CString::new(var).expect("no NUL in numbers and hex");
    debug!(
        "exec: {} SMC-D connection(s) go to the new program",
        entries.len()
    );
    (Some(h), refused)
}

/// Makes connection `s` (the program passes it as `fds`) ready to go.
fn pass(h: &mut Handoff, s: &Sock, fds: &[RawFd]) -> Result<Passed, String> {
    let ExecParts { local, peer, state } = s.conn.exec_export(&s.reg).map_err(|e| e.to_string())?;
    let no_fd = || "no descriptor left".to_string();
    let local = h.keep(local).ok_or_else(no_fd)?;
    let peer = h.keep(peer).ok_or_else(no_fd)?;
    // The channel keeps its number, even one the program let go of at
    // exec (close-on-exec in its view; the new image holds it as an
    // internal descriptor): the fork family recognises its holders by that
    // number, and a process that still holds the connection must not
    // take the new program for gone.
    let chan = s.conn.fd();
    if chan < 0 {
        return Err("its channel is gone".into());
    }
    for fd in fds.iter().copied().chain([chan, s.tcp]) {
        if !h.opened.contains(&fd) {
            h.open(fd);
        }
    }
    Ok(Passed {
        fds: fds.to_vec(),
        chan,
        tcp: s.tcp,
        local,
        peer,
        shut_rd: s.conn.read_shut(),
        linger0: s.linger0.load(Ordering::Relaxed),
        holders: holders::others(s.slot),
        st: state,
    })
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// At load: adopts the connections an exec passed (see the module
/// documentation).
pub(crate) fn at_load() {
    let Some(v) = std::env::var_os(VAR) else {
        return;
    };
    // Only this image adopts them; its own children must not try.
    std::env::remove_var(VAR);
    let v = v.to_string_lossy().into_owned();
    let Some(moves) = moves_of(&v) else {
        debug!("exec: {VAR} is unreadable; nothing passed is adopted or moved");
        return;
    };
    let Some((dir, passed)) = v.split_once(' ').and_then(|(_, rest)| this_layout(rest)) else {
        debug!("exec: {VAR} is not in this smclo version's layout; the passed connections fall back, their descriptors get the TCP sockets");
        moves.apply();
        return;
    };
    let dev = match unhex(dir).map(|d| {
        // SAFETY: bytes that were an OsStr's encoded bytes in the image
        // before exec, on this same platform.
        std::path::PathBuf::from(unsafe { std::ffi::OsString::from_encoded_bytes_unchecked(d) })
    }) {
        Some(_) if super::disabled() => Err("SMCLO_DISABLE is set".into()),
        // Its io_uring calls would go to the channel itself.
        Some(_) if super::uring::in_use() => Err("this program uses io_uring".into()),
        Some(d) => Device::open(&d).map_err(|e| e.to_string()),
        None => Err("unreadable description".into()),
    };
    for p in passed {
        for fd in [p.chan, p.tcp, p.local, p.peer].iter().chain(&p.fds) {
            set_cloexec(*fd, true);
        }
        let r = match &dev {
            Ok(dev) => adopt(dev, &p).map_err(|e| (e, true)),
            Err(e) => Err((e.clone(), false)),
        };
        if let Err((why, consumed)) = r {
            reset(&p, &why, consumed);
        }
    }
}

/// The layout before [`Moves`]: the same connections as now, without them.
const FORMAT_1: &str = "1:";

/// The [`Moves`] of a value of [`VAR`]: its start, or, in layout 1, made
/// from its connections.
fn moves_of(v: &str) -> Option<Moves> {
    let Some(list) = v.strip_prefix(FORMAT_1) else {
        return Moves::decode(v.split_once(' ')?.0);
    };
    let mut moves = Moves::default();
    for p in list.split_once(':')?.1.split(';').filter(|e| !e.is_empty()) {
        moves.add(&Passed::decode(p)?);
    }
    Some(moves)
}

/// The device directory (hex) and the connections of a value's rest in
/// this version's layout; None for another layout.
fn this_layout(rest: &str) -> Option<(&str, Vec<Passed>)> {
    let (dir, list) = rest
        .strip_prefix(FORMAT)?
        .strip_prefix(':')?
        .split_once(':')?;
    let passed = list.split(';').filter(|e| !e.is_empty());
    Some((dir, passed.map(Passed::decode).collect::<Option<_>>()?))
}

/// Adopts one passed connection into the table. It owns the memfds and
/// the channel from the start, even when it fails.
fn adopt(dev: &Arc<Device>, p: &Passed) -> Result<(), String> {
    // SAFETY: the descriptors were passed to this image for this purpose
    // and nothing else owns them.
    let (local, peer, chan) = unsafe {
        (
            OwnedFd::from_raw_fd(p.local),
            OwnedFd::from_raw_fd(p.peer),
            OwnedFd::from_raw_fd(p.chan),
        )
    };
    let parts = ExecParts {
        local,
        peer,
        state: p.st,
    };
    let (conn, reg) = match Conn::exec_adopt(dev, parts, chan) {
        Ok(x) => x,
        Err(e) => return Err(e.to_string()),
    };
    install(p, conn, reg, false)?;
    debug!(
        "exec: adopted SMC-D connection on fd {} (channel fd {}, hidden TCP fd {})",
        join(&p.fds),
        p.chan,
        p.tcp
    );
    Ok(())
}

/// Puts adopted connection `p` into the table at its descriptors
/// (`cloexec`: in the program's view).
pub(super) fn install(
    p: &Passed,
    conn: Conn,
    reg: Registration,
    cloexec: bool,
) -> Result<(), String> {
    let Some(slot) = holders::claim() else {
        conn.abort();
        return Err("no holder slot".into());
    };
    for pid in &p.holders {
        holders::add(slot, *pid);
    }
    conn.count_channel(!p.fds.contains(&p.chan));
    if p.shut_rd {
        // The old image's SHUT_RD (an error here is the connection's,
        // which its next call reports).
        let _ = conn.shutdown_read();
    }
    let sock = Arc::new(Sock {
        conn,
        reg,
        tcp: p.tcp,
        // The old image put it back before exec.
        syn_mark: Default::default(),
        fds: AtomicUsize::new(0),
        linger0: AtomicBool::new(p.linger0),
        inq: AtomicBool::new(super::swap::inq_set(p.tcp)),
        slot,
        cork_armed: Default::default(),
        _held: smclo::adapter::fdnum::Held::new(),
        learn: Default::default(),
        calls: Default::default(),
    });
    let g = LOCK.write();
    super::state::internal_locked(p.tcp);
    if !p.fds.contains(&p.chan) {
        super::state::internal_locked(p.chan);
    }
    for fd in &p.fds {
        super::state::install_locked(*fd, &sock, cloexec);
    }
    drop(g);
    LIVE.fetch_add(1, Ordering::Relaxed);
    for fd in p.fds.iter().filter(|fd| (0..=2).contains(*fd)) {
        crate::stdio::adopt_std(*fd);
    }
    Ok(())
}

/// A passed connection this image cannot adopt: both ends see a reset (the
/// peer through the channel closing without a close flag, this program
/// through the TCP socket its descriptors become). `consumed`: [`adopt`]
/// has closed the memfds and the channel already.
pub(super) fn reset(p: &Passed, why: &str, consumed: bool) {
    debug!(
        "SMC-D connection on fd {} cannot be adopted ({why}); it is reset, the descriptors get the TCP socket",
        join(&p.fds)
    );
    if let Err(e) = smclo::adapter::tcp_syn::reset(p.tcp) {
        debug!("exec: resetting the TCP connection failed: {e}");
    }
    for fd in &p.fds {
        // SAFETY: replaces the program's descriptor with the TCP socket.
        unsafe { real::dup3(p.tcp, *fd, 0) };
    }
    let mine: &[RawFd] = if consumed {
        &[p.tcp]
    } else {
        &[p.tcp, p.chan, p.local, p.peer]
    };
    for &fd in mine {
        if !p.fds.contains(&fd) {
            // SAFETY: a descriptor passed to this image for the connection.
            unsafe { real::close(fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(fds: Vec<RawFd>, chan: RawFd) -> Passed {
        let st = ExecState::default();
        Passed {
            fds,
            chan,
            tcp: 1001,
            local: 1002,
            peer: 1003,
            shut_rd: false,
            linger0: false,
            holders: vec![7],
            st,
        }
    }

    #[test]
    fn moves_name_the_tcp_socket_for_each_descriptor_and_smclos_own() {
        let mut m = Moves::default();
        m.add(&passed(vec![0, 1], 1000));
        m.add(&passed(vec![5], 5));
        let s = m.encode();
        assert_eq!(s, "0=1001,1=1001,1000=,1002=,1003=,5=1001,1002=,1003=");
        assert_eq!(Moves::decode(&s), Some(m));
        assert_eq!(Moves::decode(""), Some(Moves::default()));
        for bad in ["0", "x=1", "0=y", "-1=3", "0=-3"] {
            assert_eq!(Moves::decode(bad), None, "{bad}");
        }
    }

    /// Whatever follows the moves, a reader finds them; the layout before
    /// them (1) gives them from its connections.
    #[test]
    fn moves_are_read_from_every_layout() {
        let p = passed(vec![0, 1], 1000);
        let mut one = Moves::default();
        one.add(&p);
        let any = format!("{} 99:whatever;comes:next", one.encode());
        assert_eq!(moves_of(&any).as_ref(), Some(&one));
        assert!(this_layout("99:whatever").is_none());
        let v1 = format!("1:2f746d70:{};{}", p.encode(), p.encode());
        let mut twice = Moves::default();
        twice.add(&p);
        twice.add(&p);
        assert_eq!(moves_of(&v1), Some(twice));
        let ours = format!("{FORMAT}:2f746d70:{}", p.encode());
        let (dir, got) = this_layout(&ours).unwrap();
        assert_eq!(
            (dir, got.len(), &got[0].fds[..]),
            ("2f746d70", 1, &[0, 1][..])
        );
        assert!(moves_of("no moves here").is_none());
    }
}
