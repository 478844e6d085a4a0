//! musl's standard streams on an adopted connection (`stdio`). musl's own
//! functions (`printf`, `puts`, `getchar`, the flush at exit) use the
//! stream objects directly, so the stream is kept and given a read and a
//! write function (its `read` and `write` members) that do what musl's
//! `__stdio_read` and `__stdio_write` do, through the interposed `readv`
//! and `writev` instead of raw system calls.

use crate::hooks;
use libc::{c_int, c_uint, iovec, FILE};

/// The start of musl's `struct _IO_FILE` (`src/internal/stdio_impl.h`,
/// the same from musl 1.0 to 1.2.5).
#[repr(C)]
struct MuslFile {
    flags: c_uint,
    rpos: *mut u8,
    rend: *mut u8,
    close: usize,
    wend: *mut u8,
    wpos: *mut u8,
    mustbezero_1: *mut u8,
    wbase: *mut u8,
    read: Option<unsafe extern "C" fn(*mut MuslFile, *mut u8, usize) -> usize>,
    write: Option<unsafe extern "C" fn(*mut MuslFile, *const u8, usize) -> usize>,
    seek: usize,
    buf: *mut u8,
    buf_size: usize,
    prev: usize,
    next: usize,
    fd: c_int,
}

/// musl's stream flags: end of file seen, error seen.
const F_EOF: c_uint = 16;
const F_ERR: c_uint = 32;

/// Gives the standard stream `f` of descriptor `fd` the functions below.
/// `false` (nothing changed) unless `f` looks like musl's stream of `fd`.
pub(crate) fn divert(f: *mut FILE, fd: c_int) -> bool {
    let f = f.cast::<MuslFile>();
    if f.is_null() {
        return false;
    }
    // SAFETY: a standard stream of musl (the build this module is part
    // of), not in use yet (see `stdio::adopt_std`); its members are read
    // and set before any other thread runs.
    unsafe {
        if (*f).fd != fd || ((*f).read.is_none() && (*f).write.is_none()) {
            return false;
        }
        if fd == 0 {
            (*f).read = Some(read);
        } else {
            (*f).write = Some(write);
        }
    }
    true
}

fn iov(base: *const u8, len: usize) -> iovec {
    iovec {
        iov_base: base.cast_mut().cast(),
        iov_len: len,
    }
}

/// musl's `__stdio_read`: fills `buf` (all but its last byte when the
/// stream is buffered) and the stream's buffer in one read.
unsafe extern "C" fn read(f: *mut MuslFile, buf: *mut u8, len: usize) -> usize {
    // SAFETY: musl passes its stream and a buffer of `len` bytes.
    let f = unsafe { &mut *f };
    let buffered = usize::from(f.buf_size != 0);
    let v = [iov(buf, len - buffered), iov(f.buf, f.buf_size)];
    // SAFETY: both vectors are within the caller's and the stream's buffers.
    let cnt = unsafe {
        if v[0].iov_len != 0 {
            hooks::readv(f.fd, v.as_ptr(), 2)
        } else {
            hooks::read(f.fd, f.buf.cast(), f.buf_size)
        }
    };
    if cnt <= 0 {
        f.flags |= if cnt == 0 { F_EOF } else { F_ERR };
        return 0;
    }
    let cnt = cnt as usize;
    if cnt <= v[0].iov_len {
        return cnt;
    }
    // SAFETY: the bytes past `buf`'s part went to the stream's buffer,
    // which holds `cnt - v[0].iov_len` of them now.
    unsafe {
        f.rpos = f.buf;
        f.rend = f.buf.add(cnt - v[0].iov_len);
        if buffered != 0 {
            *buf.add(len - 1) = *f.rpos;
            f.rpos = f.rpos.add(1);
        }
    }
    len
}

/// musl's `__stdio_write`: the stream's pending bytes, then `buf`, all
/// written or an error.
unsafe extern "C" fn write(f: *mut MuslFile, buf: *const u8, len: usize) -> usize {
    // SAFETY: musl passes its stream and `len` bytes at `buf`.
    let f = unsafe { &mut *f };
    let pending = f.wpos as usize - f.wbase as usize;
    let mut v = [iov(f.wbase, pending), iov(buf, len)];
    let mut first = 0;
    let mut rem = pending + len;
    loop {
        // SAFETY: the vectors from `first` on are within the stream's
        // buffer and the caller's bytes.
        let cnt = unsafe { hooks::writev(f.fd, v[first..].as_ptr(), (2 - first) as c_int) };
        if cnt >= 0 && cnt as usize == rem {
            // SAFETY: the stream's buffer is `buf_size` bytes.
            f.wend = unsafe { f.buf.add(f.buf_size) };
            f.wpos = f.buf;
            f.wbase = f.buf;
            return len;
        }
        if cnt < 0 {
            f.wpos = std::ptr::null_mut();
            f.wbase = std::ptr::null_mut();
            f.wend = std::ptr::null_mut();
            f.flags |= F_ERR;
            return if first == 0 { 0 } else { len - v[1].iov_len };
        }
        let mut cnt = cnt as usize;
        rem -= cnt;
        if cnt > v[first].iov_len {
            cnt -= v[first].iov_len;
            first += 1;
        }
        // SAFETY: `cnt` bytes of this vector were written.
        v[first].iov_base = unsafe { v[first].iov_base.cast::<u8>().add(cnt) }.cast();
        v[first].iov_len -= cnt;
    }
}
