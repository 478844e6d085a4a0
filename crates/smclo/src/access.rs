//! Who may use a device directory, and who may be a peer on it.
//!
//! A device directory has one of two shapes:
//!
//! - **private**: a real directory owned by our effective uid, no access for
//!   group and others (0700). Only that uid uses it (the per-user default).
//! - **group**: a real directory owned by root or by us, group-owned by a
//!   group G, setgid, no access for others (2770 or stricter), as
//!   `smclo dev init --group G DIR` makes it. Every member of G (primary or
//!   supplementary) uses it; the setgid bit gives every file created in it
//!   group G, and smclo creates them group-readable and -writable (0660).
//!
//! Anything else is refused, naming the directory and why. A process outside
//! G cannot open anything in a group directory (the kernel says `EACCES`);
//! smclo says so before trying ([`DeviceProblem::NotAMember`]).
//!
//! The same shape decides who may be the peer of a handshake: before any
//! descriptor is passed on the handshake's UNIX channel, each end checks the
//! other's credentials ([`check_peer`]: `SO_PEERCRED`, and `SO_PEERGROUPS`
//! when the uid and gid do not decide). The
//! peer must run as our uid, or, on a group device, as the directory's
//! owner or a member of G.

use crate::error::DeviceProblem;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Mode of the files smclo creates in a private device directory.
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// Mode of the files smclo creates in a group device directory.
pub const GROUP_FILE_MODE: u32 = 0o660;
/// Mode `smclo dev init --group` gives a group device directory.
pub const GROUP_DIR_MODE: u32 = 0o2770;

/// The shape of an accepted device directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Owned by `uid`, no access for group and others.
    Private {
        /// The owner (our effective uid when it was checked).
        uid: u32,
    },
    /// Owned by `owner` (root or the caller), shared by group `gid`.
    Group {
        /// The directory's owner.
        owner: u32,
        /// The directory's group.
        gid: u32,
    },
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Private { uid } => write!(f, "private to uid {uid}"),
            Shape::Group { owner, gid } => {
                write!(f, "shared by uid {owner} and the members of gid {gid}")
            }
        }
    }
}

/// A process's credentials, as the kernel reports them for a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creds {
    /// Effective uid.
    pub uid: u32,
    /// Effective gid.
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

impl Creds {
    /// The calling thread's effective credentials.
    pub fn current() -> Creds {
        // SAFETY: geteuid/getegid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Creds {
            uid,
            gid,
            groups: supplementary_groups(),
        }
    }

    /// Whether `gid` is this process's effective or a supplementary group.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

fn supplementary_groups() -> Vec<u32> {
    // SAFETY: getgroups(0, NULL) only returns the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n <= 0 {
        return Vec::new();
    }
    let mut v = vec![0 as libc::gid_t; n as usize];
    // SAFETY: `v` has room for `n` gids.
    let got = unsafe { libc::getgroups(n, v.as_mut_ptr()) };
    v.truncate(got.max(0) as usize);
    v
}

impl Shape {
    /// The shape of `dir` as the caller (`me`) sees it, or why `dir` is
    /// refused. `Err` is an I/O error of `lstat` itself.
    pub fn of(dir: &Path, me: &Creds) -> io::Result<Result<Shape, DeviceProblem>> {
        let md = std::fs::symlink_metadata(dir)?;
        if !md.file_type().is_dir() {
            return Ok(Err(DeviceProblem::NotADirectory));
        }
        Ok(Shape::from_metadata(md.uid(), md.gid(), md.mode(), me))
    }

    fn from_metadata(uid: u32, gid: u32, mode: u32, me: &Creds) -> Result<Shape, DeviceProblem> {
        let perm = mode & 0o7777;
        if perm & 0o007 != 0 {
            return Err(DeviceProblem::NotPrivate { mode: perm });
        }
        if perm & 0o070 == 0 {
            return if uid == me.uid {
                Ok(Shape::Private { uid })
            } else {
                Err(DeviceProblem::WrongOwner { uid, ours: me.uid })
            };
        }
        if perm & libc::S_ISGID == 0 {
            return Err(DeviceProblem::GroupNotSetgid { mode: perm });
        }
        if uid != 0 && uid != me.uid {
            return Err(DeviceProblem::WrongOwner { uid, ours: me.uid });
        }
        let shape = Shape::Group { owner: uid, gid };
        if !shape.admits(me) {
            return Err(DeviceProblem::NotAMember { gid, uid: me.uid });
        }
        Ok(shape)
    }

    /// Whether a process with credentials `c` may use the device: its
    /// owner, or (group shape) a member of the group.
    pub fn admits(&self, c: &Creds) -> bool {
        match *self {
            Shape::Private { uid } => c.uid == uid,
            Shape::Group { owner, gid } => c.uid == owner || c.in_group(gid),
        }
    }

    /// The mode of every file smclo creates in the directory.
    pub fn file_mode(&self) -> u32 {
        match self {
            Shape::Private { .. } => PRIVATE_FILE_MODE,
            Shape::Group { .. } => GROUP_FILE_MODE,
        }
    }

    /// Why the device file (or another file of the directory) with this
    /// owner, group and mode is refused, if it is: in a private directory
    /// it is ours and private; in a group directory it has the group and
    /// no access for others (any member may have created it).
    pub fn file_problem(&self, uid: u32, gid: u32, mode: u32) -> Option<DeviceProblem> {
        let perm = mode & 0o7777;
        match *self {
            Shape::Private { uid: ours } if uid != ours => {
                Some(DeviceProblem::WrongOwner { uid, ours })
            }
            Shape::Private { .. } if perm & 0o077 != 0 => {
                Some(DeviceProblem::NotPrivate { mode: perm })
            }
            Shape::Group { gid: g, .. } if gid != g => {
                Some(DeviceProblem::WrongGroup { gid, expected: g })
            }
            Shape::Group { .. } if perm & 0o007 != 0 => {
                Some(DeviceProblem::NotPrivate { mode: perm })
            }
            _ => None,
        }
    }
}

/// Makes `dir` a group device directory of group `gid` (owned by us,
/// group `gid`, mode [`GROUP_DIR_MODE`]) and returns its shape. A new
/// directory is created; an existing one is accepted only when it already
/// has exactly that shape: smclo never loosens an existing directory.
pub fn create_group_dir(dir: &Path, gid: u32) -> crate::Result<Shape> {
    use std::os::unix::fs::DirBuilderExt;
    let refuse = |problem| {
        crate::Error::Device(crate::error::DeviceError {
            path: dir.to_path_buf(),
            problem,
        })
    };
    let me = Creds::current();
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            std::os::unix::fs::chown(dir, None, Some(gid))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(GROUP_DIR_MODE))?;
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    match Shape::of(dir, &me)?.map_err(refuse)? {
        s @ Shape::Group { gid: g, .. } if g == gid => Ok(s),
        Shape::Group { gid: g, .. } => Err(refuse(DeviceProblem::WrongGroup {
            gid: g,
            expected: gid,
        })),
        Shape::Private { .. } => Err(refuse(DeviceProblem::PrivateNotGroup)),
    }
}

/// The mode of the files smclo creates in `dir`, for code that holds only
/// the directory's path ([`Shape::file_mode`]; private when `dir` is not
/// an accepted device directory).
pub fn file_mode_in(dir: &Path) -> u32 {
    match Shape::of(dir, &Creds::current()) {
        Ok(Ok(shape)) => shape.file_mode(),
        _ => PRIVATE_FILE_MODE,
    }
}

/// Gives the file `fd`, just created by us, exactly `mode` (creation modes
/// pass through the umask, which would take group access away).
pub fn set_mode(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: fchmod on a descriptor the caller owns; no memory effects.
    if unsafe { libc::fchmod(fd, mode as libc::mode_t) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The credentials of the process at the other end of the UNIX socket `fd`
/// (its creator's at `connect` or `listen` time): `SO_PEERCRED` and
/// `SO_PEERGROUPS`.
pub fn peer_creds(fd: RawFd) -> io::Result<Creds> {
    let (uid, gid) = peer_ids(fd)?;
    Ok(Creds {
        uid,
        gid,
        groups: peer_groups(fd)?,
    })
}

/// `SO_PEERCRED`: the peer's effective uid and gid, without its
/// supplementary groups.
fn peer_ids(fd: RawFd) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, which we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.uid, cred.gid))
}

/// `SO_PEERGROUPS`: the peer's supplementary groups. The kernel says how
/// much room it needs (`ERANGE`) when the buffer is short.
fn peer_groups(fd: RawFd) -> io::Result<Vec<u32>> {
    let mut v: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = (v.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: SO_PEERGROUPS writes at most `len` bytes into `v`.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                v.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            v.truncate(n);
            return Ok(v);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || n <= v.len() {
            return Err(e);
        }
        v.resize(n, 0);
    }
}

/// Why the peer behind the UNIX socket `fd` may not share a device of shape
/// `shape` with us, if it may not: the one check every handshake channel
/// passes before a descriptor goes over it.
pub fn check_peer(fd: RawFd, shape: &Shape) -> Result<(), PeerRefused> {
    let (uid, gid) = peer_ids(fd).map_err(PeerRefused::Unknown)?;
    let mut c = Creds {
        uid,
        gid,
        groups: Vec::new(),
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    // The supplementary groups are asked only when the uid and the
    // effective gid do not decide already (the usual peer is ourselves).
    if uid == me || shape.admits(&c) {
        return Ok(());
    }
    c.groups = peer_groups(fd).map_err(PeerRefused::Unknown)?;
    if shape.admits(&c) {
        Ok(())
    } else {
        Err(PeerRefused::NotPermitted { uid, gid })
    }
}

/// Why a handshake peer was refused ([`check_peer`]).
#[derive(Debug)]
pub enum PeerRefused {
    /// The peer runs as another uid that may not use the device.
    NotPermitted {
        /// The peer's effective uid.
        uid: u32,
        /// The peer's effective gid.
        gid: u32,
    },
    /// The kernel did not tell the peer's credentials.
    Unknown(io::Error),
}

impl std::fmt::Display for PeerRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerRefused::NotPermitted { uid, gid } => write!(
                f,
                "the peer (uid {uid}, gid {gid}) is neither our uid nor a member of the device's group"
            ),
            PeerRefused::Unknown(e) => write!(f, "cannot read the peer's credentials: {e}"),
        }
    }
}

/// Why `dir` is not a directory private to us (a real directory owned by
/// our effective uid, no access for group and others), if it is not.
pub(crate) fn private_dir_problem(dir: &Path) -> io::Result<Option<DeviceProblem>> {
    let md = std::fs::symlink_metadata(dir)?;
    if !md.file_type().is_dir() {
        return Ok(Some(DeviceProblem::NotADirectory));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    Ok(Shape::Private { uid }.file_problem(md.uid(), md.gid(), md.mode()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(uid: u32, gid: u32, groups: &[u32]) -> Creds {
        Creds {
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn shapes_accepted_and_refused() {
        let me = creds(1000, 1000, &[50]);
        let shape = |uid, gid, mode| Shape::from_metadata(uid, gid, mode, &me);
        assert_eq!(shape(1000, 1000, 0o700), Ok(Shape::Private { uid: 1000 }));
        assert_eq!(shape(0, 50, 0o2770), Ok(Shape::Group { owner: 0, gid: 50 }));
        assert_eq!(
            shape(1000, 50, 0o2750),
            Ok(Shape::Group {
                owner: 1000,
                gid: 50
            })
        );
        assert_eq!(
            shape(0, 50, 0o2775),
            Err(DeviceProblem::NotPrivate { mode: 0o2775 })
        );
        assert_eq!(
            shape(0, 50, 0o770),
            Err(DeviceProblem::GroupNotSetgid { mode: 0o770 })
        );
        assert_eq!(
            shape(7, 50, 0o2770),
            Err(DeviceProblem::WrongOwner { uid: 7, ours: 1000 })
        );
        assert_eq!(
            shape(0, 60, 0o2770),
            Err(DeviceProblem::NotAMember { gid: 60, uid: 1000 })
        );
        assert_eq!(
            shape(0, 0, 0o700),
            Err(DeviceProblem::WrongOwner { uid: 0, ours: 1000 })
        );
    }

    #[test]
    fn peers_and_files_of_a_group_device() {
        let g = Shape::Group { owner: 0, gid: 50 };
        assert!(g.admits(&creds(1, 50, &[])));
        assert!(g.admits(&creds(2, 2, &[9, 50])));
        assert!(g.admits(&creds(0, 0, &[])));
        assert!(!g.admits(&creds(3, 3, &[9])));
        assert_eq!(g.file_problem(5, 50, 0o660), None);
        assert_eq!(
            g.file_problem(5, 51, 0o660),
            Some(DeviceProblem::WrongGroup {
                gid: 51,
                expected: 50
            })
        );
        assert_eq!(
            g.file_problem(5, 50, 0o664),
            Some(DeviceProblem::NotPrivate { mode: 0o664 })
        );
        let p = Shape::Private { uid: 4 };
        assert!(!p.admits(&creds(5, 50, &[])));
        assert_eq!(p.file_problem(4, 4, 0o600), None);
        assert!(p.file_problem(4, 4, 0o660).is_some());
    }
}
