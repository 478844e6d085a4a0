//! C API of smclo: the native API ([`smclo::api`]) behind opaque handles,
//! declared in `include/smclo.h`.
//!
//! Conventions, the same for every function:
//! - errors are reported as `NULL` or `-1` with `errno` set: the OS error
//!   when there is one, otherwise the closest errno for the error kind
//!   (`EINVAL`, `EAGAIN`, ... and `EIO` as the last resort);
//! - every pointer argument is checked, `NULL` gives `EINVAL` (the
//!   `*_close` functions accept `NULL` and do nothing);
//! - a panic never crosses the boundary: it is caught and reported as `EIO`.
//!
//! `smclo_poller_*` wrap [`smclo::api::Poller`]: one wait over several
//! streams and descriptors, with the event-loop fast path.
//!
//! The zero-copy regions of the native API are memory the peer maps on
//! SMC-D: C gets raw pointers to them, under the contract of
//! [`smclo::api::ReadRegion::as_ptr`] and
//! [`smclo::api::WriteRegion::as_mut_ptr`] (spelled out in the header).
//! They borrow the stream. C holds them between two calls, so the stream object keeps the outstanding region in
//! a slot, with its lifetime extended to `'static`; see [`smclo_stream`] for
//! why that is sound.

#![allow(non_camel_case_types)]

use smclo::api::Ready;
use smclo::api::{Poller, ReadRegion, SmcListener, SmcStream, WriteRegion};
use smclo_wire::reason::Reason;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

// ----- errors ---------------------------------------------------------------

/// Sets the calling thread's `errno`.
fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns a valid pointer to this thread's
    // errno for the life of the thread.
    unsafe { *libc::__errno_location() = e }
}

/// The errno that best describes `e`.
fn errno_of(e: &io::Error) -> c_int {
    if let Some(code) = e.raw_os_error() {
        return code;
    }
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock => libc::EAGAIN,
        K::InvalidInput => libc::EINVAL,
        K::InvalidData => libc::EINVAL,
        K::NotFound => libc::ENOENT,
        K::PermissionDenied => libc::EACCES,
        K::ConnectionRefused => libc::ECONNREFUSED,
        K::ConnectionReset => libc::ECONNRESET,
        K::ConnectionAborted => libc::ECONNABORTED,
        K::NotConnected => libc::ENOTCONN,
        K::AddrInUse => libc::EADDRINUSE,
        K::AddrNotAvailable => libc::EADDRNOTAVAIL,
        K::BrokenPipe => libc::EPIPE,
        K::AlreadyExists => libc::EEXIST,
        K::TimedOut => libc::ETIMEDOUT,
        K::Interrupted => libc::EINTR,
        K::Unsupported => libc::EOPNOTSUPP,
        K::OutOfMemory => libc::ENOMEM,
        _ => libc::EIO,
    }
}

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// Runs `f`; on error (or panic) sets errno and returns `fail`.
fn guard<T>(fail: T, f: impl FnOnce() -> io::Result<T>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_errno(errno_of(&e));
            fail
        }
        Err(_) => {
            set_errno(libc::EIO);
            fail
        }
    }
}

// ----- handles ----------------------------------------------------------------

/// A listening socket (opaque in C).
pub struct smclo_listener {
    l: SmcListener,
}

/// A connected stream (opaque in C).
///
/// The stream lives in its own heap allocation (`stream`, from
/// `Box::into_raw`) that is never moved and is freed only in `Drop`, after
/// both region slots have been emptied. An outstanding region borrows that
/// allocation; it is stored here as `'static`, which is sound because:
/// - the borrow it stands for is shared (`&SmcStream`), and the stream is
///   only ever accessed through shared references while the handle lives;
/// - the allocation outlives every region: `Drop` drops the slots first;
/// - regions are taken out of the slot before they are committed/released.
///
/// The regions hold the connection's reader/writer locks, so at most one is
/// outstanding per direction, and plain reads/writes in that direction are
/// refused (`EBUSY`) instead of deadlocking on the lock.
pub struct smclo_stream {
    wr: Mutex<Option<WriteRegion<'static>>>,
    rd: Mutex<Option<ReadRegion<'static>>>,
    stream: NonNull<SmcStream>,
}

impl smclo_stream {
    fn new(s: SmcStream) -> smclo_stream {
        smclo_stream {
            wr: Mutex::new(None),
            rd: Mutex::new(None),
            stream: NonNull::from(Box::leak(Box::new(s))),
        }
    }

    fn s(&self) -> &SmcStream {
        // SAFETY: `stream` comes from Box::leak in `new` and is freed only
        // in Drop, which needs `&mut self`; shared access only.
        unsafe { self.stream.as_ref() }
    }

    fn s_static(&self) -> &'static SmcStream {
        // SAFETY: see the type docs: the allocation is live until Drop and
        // Drop empties the region slots (the only holders of this
        // reference) before freeing it.
        unsafe { &*self.stream.as_ptr() }
    }

    fn wr(&self) -> MutexGuard<'_, Option<WriteRegion<'static>>> {
        self.wr.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn rd(&self) -> MutexGuard<'_, Option<ReadRegion<'static>>> {
        self.rd.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for smclo_stream {
    fn drop(&mut self) {
        // Regions first: they borrow the stream (and hold its locks).
        drop(self.wr.get_mut().unwrap_or_else(|p| p.into_inner()).take());
        drop(self.rd.get_mut().unwrap_or_else(|p| p.into_inner()).take());
        // SAFETY: `stream` came from Box::leak in `new`, nothing borrows it
        // any more (the slots are empty, and `&mut self` excludes other
        // calls), and it is freed exactly once, here.
        drop(unsafe { Box::from_raw(self.stream.as_ptr()) });
    }
}

/// `&T` from a C pointer, or `EINVAL` for NULL.
///
/// # Safety
/// A non-NULL `p` must point to a live `T` handed out by this library.
unsafe fn obj<'a, T>(p: *const T) -> io::Result<&'a T> {
    // SAFETY: per the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| einval("NULL handle"))
}

/// The `host` C string, or `EINVAL`.
///
/// # Safety
/// A non-NULL `host` must be a NUL-terminated string.
unsafe fn host_str<'a>(host: *const c_char) -> io::Result<&'a str> {
    if host.is_null() {
        return Err(einval("NULL host"));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(host) }
        .to_str()
        .map_err(|_| einval("host is not UTF-8"))
}

// ----- listener -----------------------------------------------------------

/// Binds `host:port` (a name or an address; port 0 picks a free port),
/// listens, and announces the listener to smclo clients. Settings come from
/// the environment (`SMCLO_*`). NULL with errno on error.
///
/// # Safety
/// `host` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn smclo_listen(host: *const c_char, port: u16) -> *mut smclo_listener {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes NULL or a C string.
        let h = unsafe { host_str(host) }?;
        let l = SmcListener::bind((h, port))?;
        Ok(Box::into_raw(Box::new(smclo_listener { l })))
    })
}

/// Accepts one connection whose handshake decided: the stream uses shared
/// memory if the client runs smclo, TCP otherwise. Non-blocking, it never
/// waits on a client: a handshake that goes on is returned by a later call
/// ([`SmcListener::accept`]). NULL with errno on error (`EAGAIN` when
/// non-blocking and no connection has decided).
///
/// # Safety
/// `l` is NULL or a live listener from [`smclo_listen`].
#[no_mangle]
pub unsafe extern "C" fn smclo_accept(l: *mut smclo_listener) -> *mut smclo_stream {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or a live listener, per the contract.
        let l = unsafe { obj(l) }?;
        let (s, _) = l.l.accept()?;
        Ok(Box::into_raw(Box::new(smclo_stream::new(s))))
    })
}

/// The descriptor to poll for readability: readable when `smclo_accept`
/// may return a connection (a pending one, or a handshake that may have
/// decided). An epoll set, not the listening socket. Owned by the
/// listener: do not close it. -1 with errno on error.
///
/// # Safety
/// `l` is NULL or a live listener.
#[no_mangle]
pub unsafe extern "C" fn smclo_listener_fd(l: *const smclo_listener) -> c_int {
    // SAFETY: NULL or a live listener, per the contract.
    guard(-1, || Ok(unsafe { obj(l) }?.l.as_raw_fd()))
}

/// The port the listener is bound to (useful after binding port 0); 0 with
/// errno on error.
///
/// # Safety
/// `l` is NULL or a live listener.
#[no_mangle]
pub unsafe extern "C" fn smclo_listener_port(l: *const smclo_listener) -> u16 {
    // SAFETY: NULL or a live listener, per the contract.
    guard(0, || Ok(unsafe { obj(l) }?.l.local_addr()?.port()))
}

/// Non-blocking `smclo_accept` when `on` is non-zero. 0, or -1 with errno.
///
/// # Safety
/// `l` is NULL or a live listener.
#[no_mangle]
pub unsafe extern "C" fn smclo_listener_set_nonblocking(
    l: *mut smclo_listener,
    on: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live listener, per the contract.
        unsafe { obj(l) }?.l.set_nonblocking(on != 0)?;
        Ok(0)
    })
}

/// Closes the listener and frees it. NULL is a no-op. Streams accepted from
/// it stay open; connections whose handshake was still going on are reset.
///
/// # Safety
/// `l` is NULL or a live listener, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn smclo_listener_close(l: *mut smclo_listener) {
    if l.is_null() {
        return;
    }
    // SAFETY: `l` came from Box::into_raw in smclo_listen and the caller
    // gives up its ownership here.
    let b = unsafe { Box::from_raw(l) };
    guard((), || {
        drop(b);
        Ok(())
    })
}

// ----- stream -----------------------------------------------------------------

/// Connects to `host:port`; the connection uses shared memory if the server
/// runs smclo on this host's device, plain TCP otherwise (see
/// [`smclo_fallback_reason`]). Settings come from the environment
/// (`SMCLO_*`). NULL with errno on error.
///
/// # Safety
/// `host` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn smclo_connect(host: *const c_char, port: u16) -> *mut smclo_stream {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes NULL or a C string.
        let h = unsafe { host_str(host) }?;
        let s = SmcStream::connect((h, port))?;
        Ok(Box::into_raw(Box::new(smclo_stream::new(s))))
    })
}

/// The descriptor to poll: readable/writable exactly when `smclo_read` /
/// `smclo_write` would make progress. Owned by the stream: do not close it,
/// do not read or write it. -1 with errno on error.
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_fd(s: *const smclo_stream) -> c_int {
    // SAFETY: NULL or a live stream, per the contract.
    guard(-1, || Ok(unsafe { obj(s) }?.s().as_raw_fd()))
}

/// 1 if the connection goes through shared memory (SMC-D), 0 if it is plain
/// TCP, -1 with errno on error.
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_is_smc(s: *const smclo_stream) -> c_int {
    // SAFETY: NULL or a live stream, per the contract.
    guard(-1, || Ok(unsafe { obj(s) }?.s().is_smc() as c_int))
}

/// Why the connection is plain TCP: the SMC decline code (e.g. `0x03010000`,
/// PEERNOSMC, when the peer does not run smclo), 0 when it uses SMC-D.
/// 0 with errno `EINVAL` for a NULL stream.
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_fallback_reason(s: *const smclo_stream) -> u32 {
    guard(0, || {
        // SAFETY: NULL or a live stream, per the contract.
        Ok(unsafe { obj(s) }?
            .s()
            .fallback_reason()
            .map_or(0, |r| r.code()))
    })
}

/// Names of the reasons, NUL-terminated, in `Reason::ALL` order.
fn reason_names() -> &'static [CString] {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    NAMES.get_or_init(|| {
        Reason::ALL
            .iter()
            .map(|r| CString::new(r.name()).expect("reason names have no NUL"))
            .collect()
    })
}

/// The short name of a decline code as `smcss` prints it (`"PEERNOSMC"`),
/// `"-"` for 0 (no fallback), `"UNKNOWN"` for a code smclo does not know.
/// The string is static: never free it.
#[no_mangle]
pub extern "C" fn smclo_reason_name(code: u32) -> *const c_char {
    const NONE: &[u8] = b"-\0";
    const UNKNOWN: &[u8] = b"UNKNOWN\0";
    guard(UNKNOWN.as_ptr().cast(), || {
        if code == 0 {
            return Ok(NONE.as_ptr().cast());
        }
        Ok(match Reason::from_code(code) {
            Some(r) => reason_names()[r.index()].as_ptr(),
            None => UNKNOWN.as_ptr().cast(),
        })
    })
}

/// `(ptr, len)` as a slice; NULL is allowed only with `len == 0`.
///
/// # Safety
/// A non-NULL `p` is valid for `len` bytes of access for `'a`.
unsafe fn buf<'a>(p: *mut u8, len: usize) -> io::Result<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(einval("NULL buffer"));
    }
    let len = len.min(isize::MAX as usize);
    // SAFETY: non-NULL and valid for `len` bytes per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// Reads up to `len` bytes into `buf`, like `read(2)`: the count, 0 at end
/// of stream, -1 with errno (`EAGAIN` when non-blocking and nothing is
/// there; `EINTR` when a signal handler ran while it waited; `EBUSY` while
/// a `smclo_peek` region is outstanding).
///
/// # Safety
/// `s` is NULL or a live stream; `buf` is NULL or valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn smclo_read(s: *mut smclo_stream, buf: *mut c_void, len: usize) -> isize {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        // SAFETY: `buf` is valid for `len` bytes, per the contract.
        let b = unsafe { self::buf(buf.cast(), len) }?;
        if s.rd().is_some() {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        Ok(s.s().read(b)? as isize)
    })
}

/// Writes up to `len` bytes from `buf`, like `write(2)`: the count (possibly
/// short), -1 with errno (`EAGAIN` when non-blocking and there is no room;
/// `EINTR` when a signal handler ran while it waited and nothing was
/// written; `EPIPE` after the peer closed; `EBUSY` while a `smclo_reserve`
/// region is outstanding). Never raises SIGPIPE.
///
/// # Safety
/// `s` is NULL or a live stream; `buf` is NULL or valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn smclo_write(
    s: *mut smclo_stream,
    buf: *const c_void,
    len: usize,
) -> isize {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        // SAFETY: `buf` is valid for `len` bytes, per the contract; the
        // slice is only read.
        let b = unsafe { self::buf(buf as *mut u8, len) }?;
        if s.wr().is_some() {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        Ok(s.s().write(b)? as isize)
    })
}

/// Non-blocking reads, writes, reserves and peeks when `on` is non-zero
/// (they fail with `EAGAIN` instead of waiting). 0, or -1 with errno.
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_set_nonblocking(s: *mut smclo_stream, on: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        unsafe { obj(s) }?.s().set_nonblocking(on != 0)?;
        Ok(0)
    })
}

/// Half-close: the peer reads everything written so far, then end of
/// stream; this end can still read. 0, or -1 with errno.
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_shutdown_write(s: *mut smclo_stream) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        unsafe { obj(s) }?.s().shutdown(Shutdown::Write)?;
        Ok(0)
    })
}

/// Closes the connection and frees the stream; an outstanding region is
/// dropped first (uncommitted bytes are not sent, unreleased bytes are not
/// consumed). NULL is a no-op.
///
/// # Safety
/// `s` is NULL or a live stream, not used again afterwards (no other thread
/// may be inside a call on it).
#[no_mangle]
pub unsafe extern "C" fn smclo_close(s: *mut smclo_stream) {
    if s.is_null() {
        return;
    }
    // SAFETY: `s` came from Box::into_raw in smclo_connect/smclo_accept and
    // the caller gives up its ownership here.
    let b = unsafe { Box::from_raw(s) };
    guard((), || {
        drop(b);
        Ok(())
    })
}

// ----- zero copy ------------------------------------------------------------

/// Zero-copy send, step 1: a writable region of at least `min` bytes
/// (`min` at most the ring size; 0 means 1) directly inside the peer's
/// receive ring; `*len` gets its size. Waits for room unless non-blocking.
/// NULL with errno on error (`EBUSY` if a region is already outstanding).
///
/// # Safety
/// `s` is NULL or a live stream; `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn smclo_reserve(
    s: *mut smclo_stream,
    min: usize,
    len: *mut usize,
) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        if len.is_null() {
            return Err(einval("NULL len"));
        }
        let mut slot = s.wr();
        if slot.is_some() {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        let r = slot.insert(s.s_static().reserve(min)?);
        // SAFETY: `len` is non-NULL and writable, per the contract.
        unsafe { *len = r.len() };
        Ok(r.as_mut_ptr().cast())
    })
}

/// Zero-copy send, step 2: sends the first `n` bytes of the region from
/// [`smclo_reserve`] (`n` at most its size; 0 sends nothing) and ends it.
/// 0, or -1 with errno (`EINVAL` if no region is outstanding or `n` is too
/// big; the region is ended either way).
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_commit(s: *mut smclo_stream, n: usize) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        let r = s.wr().take().ok_or_else(|| einval("no reserved region"))?;
        r.commit(n)?;
        Ok(0)
    })
}

/// Zero-copy receive, step 1: the received bytes in place (in this end's
/// ring), `*len` gets their count. Waits for data unless non-blocking. At
/// end of stream the result is non-NULL with `*len == 0` (still a region, to
/// end with `smclo_release(s, 0)`). NULL with errno on error (`EAGAIN`,
/// `EBUSY` if a region is already outstanding).
///
/// # Safety
/// `s` is NULL or a live stream; `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn smclo_peek(s: *mut smclo_stream, len: *mut usize) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        if len.is_null() {
            return Err(einval("NULL len"));
        }
        let mut slot = s.rd();
        if slot.is_some() {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        let r = slot.insert(s.s_static().peek_region()?);
        // SAFETY: `len` is non-NULL and writable, per the contract.
        unsafe { *len = r.len() };
        // Never NULL, as promised: a ring position, or an empty Vec's
        // dangling pointer at end of stream on TCP.
        Ok(r.as_ptr().cast())
    })
}

/// Zero-copy receive, step 2: consumes the first `n` bytes of the region
/// from [`smclo_peek`] (`n` at most its size; the rest is seen again by the
/// next read or peek) and ends it. 0, or -1 with errno (`EINVAL` if no
/// region is outstanding or `n` is too big; the region is ended either way).
///
/// # Safety
/// `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_release(s: *mut smclo_stream, n: usize) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live stream, per the contract.
        let s = unsafe { obj(s) }?;
        let r = s.rd().take().ok_or_else(|| einval("no peeked region"))?;
        r.release(n)?;
        Ok(0)
    })
}

// ----- poller ---------------------------------------------------------------

/// A poller (opaque in C): [`Poller`] of the native API, one wait over
/// several streams and other descriptors with the event-loop fast path.
///
/// It holds its streams as `&'static SmcStream`, which is sound under the
/// header's contract: a stream is removed from every poller before
/// `smclo_close` frees it (as a descriptor leaves an epoll set when it is
/// closed), so no reference outlives its stream. Calls on one poller are
/// serialized by the mutex.
pub struct smclo_poller {
    p: Mutex<Poller<'static>>,
    /// Where the next report starts when more are ready than fit, so that
    /// the last registrations are not starved.
    next: std::sync::atomic::AtomicUsize,
}

/// One ready registration, as `smclo_poller_wait` reports it.
#[repr(C)]
pub struct smclo_event {
    /// The token given to `smclo_poller_add`.
    pub token: u64,
    /// What is ready, in `poll(2)`'s bits (`POLLIN`, `POLLOUT`, `POLLHUP`,
    /// `POLLERR`, `POLLRDHUP`).
    pub events: u32,
}

impl smclo_poller {
    fn lock(&self) -> MutexGuard<'_, Poller<'static>> {
        self.p.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A new, empty poller; NULL with errno on error.
#[no_mangle]
pub extern "C" fn smclo_poller_new() -> *mut smclo_poller {
    guard(std::ptr::null_mut(), || {
        Ok(Box::into_raw(Box::new(smclo_poller {
            p: Mutex::new(Poller::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
        })))
    })
}

/// Waits for `events` (`POLLIN`, `POLLOUT`, `POLLRDHUP`) on `s`, reported
/// with `token`; a stream added again gets the new events and token. 0, or
/// -1 with errno.
///
/// # Safety
/// `p` is NULL or a live poller; `s` is NULL or a live stream, which the
/// caller removes before it closes it.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_add(
    p: *mut smclo_poller,
    s: *const smclo_stream,
    events: u32,
    token: u64,
) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or live handles, per the contract.
        let (p, s) = unsafe { (obj(p)?, obj(s)?) };
        p.lock().add(s.s_static(), token, Ready::from_bits(events));
        Ok(0)
    })
}

/// The same for any other descriptor (a listener's, a pipe), which the
/// kernel answers for. 0, or -1 with errno.
///
/// # Safety
/// `p` is NULL or a live poller.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_add_fd(
    p: *mut smclo_poller,
    fd: c_int,
    events: u32,
    token: u64,
) -> c_int {
    guard(-1, || {
        if fd < 0 {
            return Err(einval("negative descriptor"));
        }
        // SAFETY: NULL or a live poller, per the contract.
        unsafe { obj(p) }?
            .lock()
            .add_fd(fd, token, Ready::from_bits(events));
        Ok(0)
    })
}

/// Stops waiting on `s`. 0, or -1 with errno (`ENOENT`: not registered).
///
/// # Safety
/// `p` is NULL or a live poller; `s` is NULL or a live stream.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_remove(
    p: *mut smclo_poller,
    s: *const smclo_stream,
) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or live handles, per the contract.
        let (p, s) = unsafe { (obj(p)?, obj(s)?) };
        removed(p.lock().remove(s.s()))
    })
}

/// Stops waiting on descriptor `fd`. 0, or -1 with errno (`ENOENT`).
///
/// # Safety
/// `p` is NULL or a live poller.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_remove_fd(p: *mut smclo_poller, fd: c_int) -> c_int {
    // SAFETY: NULL or a live poller, per the contract.
    guard(-1, || removed(unsafe { obj(p) }?.lock().remove_fd(fd)))
}

fn removed(was: bool) -> io::Result<c_int> {
    if was {
        Ok(0)
    } else {
        Err(io::Error::from_raw_os_error(libc::ENOENT))
    }
}

/// Waits at most `timeout_ms` (negative: for ever) until a registration
/// is ready; writes at most `max` ready ones to `out` and returns their
/// number (0 after the timeout), -1 with errno (`EINTR` when a signal
/// handler ended the wait). Level-triggered.
///
/// # Safety
/// `p` is NULL or a live poller whose streams are live; `out` is NULL or
/// points to `max` writable events.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_wait(
    p: *mut smclo_poller,
    out: *mut smclo_event,
    max: c_int,
    timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: NULL or a live poller, per the contract.
        let p = unsafe { obj(p) }?;
        if out.is_null() || max <= 0 {
            return Err(einval("no room for events"));
        }
        let timeout = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        let mut ev = Vec::new();
        let n = p.lock().wait(&mut ev, timeout)?;
        let k = n.min(max as usize);
        let start = p.next.fetch_add(k, std::sync::atomic::Ordering::Relaxed);
        for i in 0..k {
            let e = ev[(start + i) % n];
            let c = smclo_event {
                token: e.token,
                events: e.ready.bits(),
            };
            // SAFETY: i < max, and `out` holds `max` events (the contract).
            unsafe { out.add(i).write(c) };
        }
        Ok(k as c_int)
    })
}

/// Frees the poller (NULL: no-op); its streams stay open.
///
/// # Safety
/// `p` is NULL or a live poller, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn smclo_poller_free(p: *mut smclo_poller) {
    if p.is_null() {
        return;
    }
    // SAFETY: `p` came from Box::into_raw in smclo_poller_new and the
    // caller gives up its ownership here.
    drop(unsafe { Box::from_raw(p) });
}

/// Tells smclo that a signal handler for `sig` runs in this thread: a
/// wait of this thread that spins before it would sleep (a blocking read
/// or write, [`smclo_poller_wait`]) then fails with `EINTR`, as the
/// kernel's sleep would. Async-signal-safe; call it from every handler.
#[no_mangle]
pub extern "C" fn smclo_signal_handler_ran(sig: c_int) {
    smclo::api::handler_ran(sig);
}

/// For a program whose own `SIGBUS` handler displaced smclo's (installed
/// after smclo first mapped a shared file): call it first from that
/// handler with the kernel's `siginfo_t`; 1 means the fault was in one of
/// smclo's shared mappings, whose file another process shrank, and is
/// recovered (return from the handler: the access runs again on zeros and
/// the connections involved are reset), 0 means it is the program's own.
/// Async-signal-safe.
///
/// # Safety
/// `info` is NULL or the `siginfo_t` the kernel passed to the handler.
#[no_mangle]
pub unsafe extern "C" fn smclo_fault_recover(info: *const libc::siginfo_t) -> c_int {
    // SAFETY: the caller's siginfo, when not null.
    unsafe { info.as_ref() }.is_some_and(smclo::api::fault_recover) as c_int
}
