//! What the hooks remember about descriptors besides the table: which
//! listeners are registered in the device and which fallback connections
//! are listed in it (both shared by their `dup`s), and the epoll registrations of
//! not-yet-connected TCP sockets, which the swap moves to the channel. All
//! are only touched with the table's lock held for writing, so a closed or
//! reused descriptor number is forgotten here in the same step as in the
//! table.

use super::in_table_range;
use crate::table::{self, F_CANDIDATE, F_FALLBACK, F_LISTENER, F_PENDING};
use smclo::adapter::fallbacks::FallbackRecord;
use smclo::adapter::registry::ListenerGuard;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Registered listeners: descriptor → its registration, shared by `dup`s.
/// Only touched with [`LOCK`](crate::table::LOCK) held for writing (so never held across fork).
pub(super) static LISTENERS: Mutex<Option<HashMap<RawFd, Arc<ListenerGuard>>>> = Mutex::new(None);

/// Fallback connections listed in the device: descriptor → its entry,
/// shared by `dup`s; the last one's close frees it. Same locking as
/// [`LISTENERS`].
pub(super) static FALLBACKS: Mutex<Option<HashMap<RawFd, Arc<FallbackRecord>>>> = Mutex::new(None);

/// epoll registrations of candidate descriptors: (fd, epfd, event).
/// Same locking as [`LISTENERS`].
pub(super) static EPOLL: Mutex<Vec<(RawFd, RawFd, libc::epoll_event)>> = Mutex::new(Vec::new());

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `new`, a duplicate of `old`, share `old`'s listener registration
/// and fallback listing.
pub(super) fn share_records_locked(old: RawFd, new: RawFd) {
    fn share<T>(m: &Mutex<Option<HashMap<RawFd, Arc<T>>>>, flag: u16, old: RawFd, new: RawFd) {
        if !table::has_flag(old, flag) {
            return;
        }
        if let Some(m) = lock(m).as_mut() {
            if let Some(r) = m.get(&old).cloned() {
                m.insert(new, r);
                table::set_flag(new, flag, true);
            }
        }
    }
    if in_table_range(new) {
        share(&LISTENERS, F_LISTENER, old, new);
        share(&FALLBACKS, F_FALLBACK, old, new);
    }
}

/// Forgets what we knew about descriptor number `fd` (it was closed). A
/// handshake still pending on it comes back, to be dropped once the
/// table's lock is released ([`super::pending::Forgotten`]).
#[must_use = "drop it after the table's lock is released"]
pub(super) fn forget_fd_locked(fd: RawFd) -> Option<super::pending::Forgotten> {
    if !in_table_range(fd) {
        return None;
    }
    let f = table::FLAGS[fd as usize].swap(0, Ordering::Relaxed);
    if f & F_LISTENER != 0 {
        if let Some(m) = lock(&LISTENERS).as_mut() {
            m.remove(&fd);
        }
    }
    if f & F_CANDIDATE != 0 {
        lock(&EPOLL).retain(|(x, _, _)| *x != fd);
    }
    let pending = if f & F_PENDING != 0 {
        super::pending::forget_locked(fd)
    } else {
        None
    };
    if f & F_FALLBACK != 0 {
        if let Some(m) = lock(&FALLBACKS).as_mut() {
            m.remove(&fd);
        }
    }
    super::epoll::forget_fd(fd);
    pending
}
