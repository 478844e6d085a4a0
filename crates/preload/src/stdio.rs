//! C stdio on connections a program got through exec (`hooks::adopt`).
//!
//! The C library's stdio reads and writes with internal calls that no
//! preload can interpose: `printf` or `fwrite` on a descriptor that is an SMC-D
//! connection's channel would put bytes straight into the channel. A
//! program started by an inetd-style server, `socat`'s `EXEC:...,nofork`
//! or a shell uses `stdin`/`stdout` on its connection as a matter of
//! course, so when an adopted connection is descriptor 0, 1 or 2, the
//! stream of that number is replaced before `main` by one of the same
//! buffering whose reads and writes are the interposed `read` and `write`
//! (`fopencookie`), and `fileno` still gives the number. A stream the
//! program opens itself on such a descriptor (`fdopen`) is not covered.
//! musl's library functions use its standard streams' objects, not the
//! `stdin`/`stdout` variables: there the stream itself is given reads and
//! writes through the interposed functions (`stdio_musl`).

#[cfg(not(target_env = "musl"))]
use crate::hooks;
#[cfg(not(target_env = "musl"))]
use libc::{c_char, c_void, size_t, ssize_t};
use libc::{c_int, FILE};

#[cfg(not(target_env = "musl"))]
#[repr(C)]
struct CookieIo {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    #[cfg(not(target_env = "musl"))]
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, io: CookieIo) -> *mut FILE;
    static mut stdin: *mut FILE;
    static mut stdout: *mut FILE;
    static mut stderr: *mut FILE;
}

#[cfg(not(target_env = "musl"))]
fn fd_of(cookie: *mut c_void) -> c_int {
    cookie as usize as c_int
}

#[cfg(not(target_env = "musl"))]
unsafe extern "C" fn cookie_read(cookie: *mut c_void, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: stdio passes a buffer of n bytes.
    unsafe { hooks::read(fd_of(cookie), buf.cast(), n) }
}

#[cfg(not(target_env = "musl"))]
unsafe extern "C" fn cookie_write(cookie: *mut c_void, buf: *const c_char, n: size_t) -> ssize_t {
    let mut done = 0;
    while done < n {
        // SAFETY: stdio passes a buffer of n bytes; `done < n`.
        let r = unsafe { hooks::write(fd_of(cookie), buf.add(done).cast(), n - done) };
        if r <= 0 {
            // stdio treats a short count as an error once nothing was
            // written; what was written stays counted.
            return if done > 0 { done as ssize_t } else { r };
        }
        done += r as usize;
    }
    done as ssize_t
}

#[cfg(not(target_env = "musl"))]
unsafe extern "C" fn cookie_close(cookie: *mut c_void) -> c_int {
    // SAFETY: fclose of the stream closes its descriptor, as for a file
    // stream.
    unsafe { hooks::close(fd_of(cookie)) }
}

/// Where glibc keeps a stream's descriptor number: `_fileno` in the
/// public `struct _IO_FILE` (`<bits/types/struct_FILE.h>`), after `_flags`
/// and 13 pointers. A cookie stream has -2 there; the number makes
/// `fileno` answer as for the stream it replaces.
#[cfg(all(target_env = "gnu", target_pointer_width = "64"))]
const FILENO_OFFSET: usize = 8 + 13 * 8;

/// Replaces the standard stream of `fd` (0, 1 or 2) by a cookie stream on
/// the interposed functions (see the module documentation).
#[cfg(not(target_env = "musl"))]
pub(crate) fn adopt_std(fd: c_int) {
    let (mode, buffering): (&[u8], c_int) = match fd {
        0 => (b"r\0", libc::_IOFBF),
        1 => (b"w\0", libc::_IOFBF),
        2 => (b"w\0", libc::_IONBF),
        _ => return,
    };
    let io = CookieIo {
        read: (fd == 0).then_some(cookie_read as _),
        write: (fd != 0).then_some(cookie_write as _),
        seek: None,
        close: Some(cookie_close),
    };
    // SAFETY: fopencookie copies `io`; the cookie is a number, not a
    // pointer that could dangle.
    let f = unsafe { fopencookie(fd as usize as *mut c_void, mode.as_ptr().cast(), io) };
    if f.is_null() {
        smclo::debug!("fd {fd}: no stdio stream on the adopted connection; stdio would bypass it");
        return;
    }
    // SAFETY: `f` is a fresh stream with no buffer yet; the offset is the
    // public layout's (see FILENO_OFFSET), written once before any use.
    unsafe {
        libc::setvbuf(f, std::ptr::null_mut(), buffering, 0);
        #[cfg(all(target_env = "gnu", target_pointer_width = "64"))]
        std::ptr::write(f.cast::<u8>().add(FILENO_OFFSET).cast::<c_int>(), fd);
    }
    // SAFETY: called from the load constructor, before main and before
    // any other thread: nothing uses the standard streams yet.
    unsafe {
        match fd {
            0 => stdin = f,
            1 => stdout = f,
            _ => stderr = f,
        }
    }
}

/// Gives the standard stream of `fd` (0, 1 or 2) reads and writes on the
/// interposed functions (see the module documentation).
#[cfg(target_env = "musl")]
pub(crate) fn adopt_std(fd: c_int) {
    let buffering = match fd {
        0 | 1 => libc::_IOFBF,
        2 => libc::_IONBF,
        _ => return,
    };
    // SAFETY: called from the load constructor, before main and before
    // any other thread: nothing uses the standard streams yet.
    let f = unsafe {
        match fd {
            0 => stdin,
            1 => stdout,
            _ => stderr,
        }
    };
    // SAFETY: a standard stream before its first use; the buffering of
    // the stream it replaces in glibc (stdout is not a terminal).
    unsafe { libc::setvbuf(f, std::ptr::null_mut(), buffering, 0) };
    if !crate::stdio_musl::divert(f, fd) {
        smclo::debug!("fd {fd}: its stdio stream is not musl's as known; stdio would bypass the adopted connection");
    }
}

/// Flushes every stdio stream: the cookie streams write through the
/// connection, which the exit path closes before libc's own final flush.
pub(crate) fn flush_all() {
    // SAFETY: fflush(NULL) flushes all open output streams.
    unsafe { libc::fflush(std::ptr::null_mut()) };
}
