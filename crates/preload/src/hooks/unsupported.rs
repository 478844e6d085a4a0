//! Calls that cannot work on an SMC-D connection (the data is in shared
//! memory, not in a kernel socket buffer a pipe could be spliced to): they
//! fail loudly with EOPNOTSUPP when either descriptor is one, and pass
//! through otherwise.

use super::unsupported;
use crate::real;
use crate::table;
use libc::{c_int, c_uint, iovec, size_t, ssize_t};

/// Interposed `splice(2)`: not to or from an SMC-D connection.
#[no_mangle]
pub unsafe extern "C" fn splice(
    a: c_int,
    ao: *mut libc::loff_t,
    b: c_int,
    bo: *mut libc::loff_t,
    n: size_t,
    f: c_uint,
) -> ssize_t {
    for fd in [a, b] {
        if table::get(fd).is_some() {
            return unsupported(fd, format_args!("splice"));
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::splice(a, ao, b, bo, n, f) }
}

/// Interposed `tee(2)`.
#[no_mangle]
pub unsafe extern "C" fn tee(a: c_int, b: c_int, n: size_t, f: c_uint) -> ssize_t {
    for fd in [a, b] {
        if table::get(fd).is_some() {
            return unsupported(fd, format_args!("tee"));
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::tee(a, b, n, f) }
}

/// Interposed `vmsplice(2)`.
#[no_mangle]
pub unsafe extern "C" fn vmsplice(fd: c_int, iov: *const iovec, n: size_t, f: c_uint) -> ssize_t {
    if table::get(fd).is_some() {
        return unsupported(fd, format_args!("vmsplice"));
    }
    // SAFETY: forwarded unchanged.
    unsafe { real::vmsplice(fd, iov, n, f) }
}
