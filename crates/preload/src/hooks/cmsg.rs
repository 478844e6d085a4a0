//! Control messages (`cmsg(3)`) as the kernel reads and writes them: a
//! buffer's messages walked and built, and what the kernel would have
//! written into a program's buffer of a given size (truncation included),
//! for the receive of [`super::passing`], which gives the kernel a larger
//! buffer than the program's.

use libc::{c_int, msghdr};
use std::os::fd::RawFd;

/// Descriptors per message (the kernel's `SCM_MAX_FD`).
pub(super) const MAX_FDS: usize = 253;

/// Room for the descriptors a message can carry beyond the program's
/// control buffer.
pub(super) fn room() -> usize {
    align(hdr_len() + 4 * MAX_FDS)
}

/// The size of a control message header.
pub(super) fn hdr_len() -> usize {
    std::mem::size_of::<libc::cmsghdr>()
}

/// `CMSG_ALIGN`: control messages are aligned to `size_t`.
pub(super) fn align(n: usize) -> usize {
    let a = std::mem::size_of::<usize>();
    (n + a - 1) & !(a - 1)
}

/// One control message of a buffer.
pub(super) struct Cmsg<'a> {
    pub(super) level: c_int,
    pub(super) kind: c_int,
    pub(super) data: &'a [u8],
}

/// `SCM_PIDFD` (Linux 6.5): a descriptor of the sender's process, which
/// the kernel installs only where the buffer has room for it.
const SCM_PIDFD: c_int = 0x04;

impl Cmsg<'_> {
    pub(super) fn is_rights(&self) -> bool {
        self.level == libc::SOL_SOCKET && self.kind == libc::SCM_RIGHTS
    }

    fn is_pidfd(&self) -> bool {
        self.level == libc::SOL_SOCKET && self.kind == SCM_PIDFD
    }

    pub(super) fn fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        self.data
            .chunks_exact(4)
            .map(|c| RawFd::from_ne_bytes([c[0], c[1], c[2], c[3]]))
    }
}

/// The control messages of `buf`, as `CMSG_NXTHDR` walks them.
pub(super) fn cmsgs(buf: &[u8]) -> impl Iterator<Item = Cmsg<'_>> {
    let mut off = 0;
    std::iter::from_fn(move || {
        let rest = buf.get(off..)?;
        if rest.len() < hdr_len() {
            return None;
        }
        // SAFETY: `rest` holds at least a header's bytes; read unaligned,
        // as a copy.
        let h = unsafe { std::ptr::read_unaligned(rest.as_ptr().cast::<libc::cmsghdr>()) };
        let len = h.cmsg_len as usize;
        if len < hdr_len() {
            return None;
        }
        let data = &rest[hdr_len()..len.min(rest.len())];
        off += align(len);
        Some(Cmsg {
            level: h.cmsg_level,
            kind: h.cmsg_type,
            data,
        })
    })
}

/// Appends a control message (aligned) to `out`, its header saying
/// `len` bytes (the kernel's truncated length) or its full length.
pub(super) fn push_cmsg(out: &mut Vec<u8>, level: c_int, kind: c_int, data: &[u8]) {
    out.resize(align(out.len()), 0);
    // SAFETY: an all-zero cmsghdr is valid; its fields are set below.
    let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
    h.cmsg_len = (hdr_len() + data.len()) as _;
    h.cmsg_level = level;
    h.cmsg_type = kind;
    // SAFETY: a plain struct viewed as its bytes.
    let hb = unsafe { std::slice::from_raw_parts(std::ptr::addr_of!(h).cast::<u8>(), hdr_len()) };
    out.extend_from_slice(hb);
    out.extend_from_slice(data);
}

pub(super) fn fd_bytes(fds: &[RawFd]) -> Vec<u8> {
    fds.iter().flat_map(|f| f.to_ne_bytes()).collect()
}

/// `msg_controllen` (`size_t` in glibc, `socklen_t` in musl).
pub(super) fn control_len(m: &msghdr) -> usize {
    m.msg_controllen as _
}

/// The descriptors passed in `control`, in order.
pub(super) fn passed_fds(control: &[u8]) -> Vec<RawFd> {
    cmsgs(control)
        .filter(|c| c.is_rights())
        .flat_map(|c| c.fds().collect::<Vec<_>>())
        .collect()
}

/// The pidfds (`SCM_PIDFD`) in `control`.
pub(super) fn pidfds(control: &[u8]) -> Vec<RawFd> {
    cmsgs(control)
        .filter(|c| c.is_pidfd())
        .flat_map(|c| c.fds().collect::<Vec<_>>())
        .collect()
}

/// What the kernel would have written into a control buffer of `want`
/// bytes, with descriptors `fds`: the buffer, whether it was truncated,
/// how many of `fds` it has and whether it has the pidfd (the caller
/// closes the descriptors it does not have, as the kernel would not have
/// installed them).
pub(super) fn program_control(
    got: &[u8],
    want: usize,
    fds: &[RawFd],
) -> (Vec<u8>, bool, usize, bool) {
    let mut out = Vec::new();
    let mut trunc = false;
    let mut fit = 0;
    let mut pidfd = false;
    let mut rights_done = false;
    for c in cmsgs(got) {
        let start = align(out.len());
        if c.is_pidfd() {
            // The kernel's scm_pidfd_recv: the whole message or nothing.
            if want < start + hdr_len() + c.data.len() {
                trunc = true;
                continue;
            }
            push_cmsg(&mut out, c.level, c.kind, c.data);
            pad(&mut out, want);
            pidfd = true;
        } else if c.is_rights() {
            if rights_done {
                continue;
            }
            rights_done = true;
            // The kernel's scm_detach_fds: as many as fit after a header.
            fit = (want.saturating_sub(start + hdr_len()) / 4).min(fds.len());
            if fit > 0 {
                push_cmsg(&mut out, c.level, c.kind, &fd_bytes(&fds[..fit]));
                pad(&mut out, want);
            }
            if fit < fds.len() {
                trunc = true;
            }
        } else {
            // The kernel's put_cmsg: no room for a header, nothing; else
            // as much as fits, the header saying so.
            if want < start + hdr_len() {
                trunc = true;
                break;
            }
            push_cmsg(&mut out, c.level, c.kind, c.data);
            if out.len() > want {
                out.truncate(want);
                let cut = want - start;
                // SAFETY: the header lies within `out` (checked above);
                // written unaligned.
                unsafe {
                    let h = out.as_mut_ptr().add(start).cast::<libc::cmsghdr>();
                    let mut v = std::ptr::read_unaligned(h);
                    v.cmsg_len = cut as _;
                    std::ptr::write_unaligned(h, v);
                }
                trunc = true;
                break;
            }
            pad(&mut out, want);
        }
    }
    (out, trunc, fit, pidfd)
}

/// As the kernel does after each control message: its alignment padding,
/// as far as the buffer has room.
fn pad(out: &mut Vec<u8>, want: usize) {
    let end = align(out.len()).min(want);
    if end > out.len() {
        out.resize(end, 0);
    }
}

/// A message of one buffer, `iov`, with the control buffer `control` of
/// `len` bytes: what our own sends and receives pass to the kernel.
pub(super) fn one_buffer(iov: &mut libc::iovec, control: *mut libc::c_void, len: usize) -> msghdr {
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut m: msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = len as _;
    m
}
