//! The handshake's credential check ([`smclo::testing::access::check_peer`]) on real
//! UNIX connections from processes of other uids and groups: a member of a
//! group device's group (primary or supplementary, read with
//! `SO_PEERGROUPS`) and the directory's owner are admitted, anyone else is
//! refused with its uid and gid. The peers are fork children that switch to
//! made-up uids and gids (no account needed), so the test needs root.

use smclo::testing::access::{check_peer, PeerRefused, Shape};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};

const GROUP: u32 = 47_011;
const MEMBER: u32 = 47_012;
const OUTSIDER: u32 = 47_013;
const OTHER_GROUP: u32 = 47_014;

/// Forks a child that takes `uid`, `gid` and supplementary `groups`,
/// connects to the abstract socket `name` and waits for the parent to close
/// the connection; returns its pid.
fn peer(name: &str, uid: u32, gid: u32, groups: &[u32]) -> libc::pid_t {
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    // SAFETY: the child only makes system calls (setgroups, setgid, setuid,
    // connect, read) and leaves with _exit: nothing that needs a lock
    // another thread of the test harness may hold.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: as above; every pointer is to live memory of this frame.
        unsafe {
            let ok = libc::setgroups(groups.len(), groups.as_ptr()) == 0
                && libc::setgid(gid) == 0
                && libc::setuid(uid) == 0;
            if !ok {
                libc::_exit(2);
            }
            match std::os::unix::net::UnixStream::connect_addr(&addr) {
                Ok(s) => {
                    let mut b = [0u8; 1];
                    libc::read(s.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                    libc::_exit(0)
                }
                Err(_) => libc::_exit(3),
            }
        }
    }
    pid
}

fn reap(pid: libc::pid_t) {
    let mut st = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    assert!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "peer {pid}: status {st:#x}"
    );
}

/// What `check_peer` says of a peer with these credentials on `shape`.
fn judge(shape: Shape, uid: u32, gid: u32, groups: &[u32]) -> Result<(), (u32, u32)> {
    let name = format!("smclo-test-peercred-{}-{uid}-{gid}", std::process::id());
    let l =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let pid = peer(&name, uid, gid, groups);
    let (c, _) = l.accept().unwrap();
    let r = check_peer(c.as_raw_fd(), &shape).map_err(|e| match e {
        PeerRefused::NotPermitted { uid, gid } => (uid, gid),
        PeerRefused::Unknown(e) => panic!("credentials unknown: {e}"),
    });
    drop(c);
    reap(pid);
    r
}

#[test]
fn members_and_owner_are_admitted_others_refused() {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "the test switches uids: run it as root"
    );
    let group = Shape::Group {
        owner: 0,
        gid: GROUP,
    };
    assert_eq!(judge(group, MEMBER, GROUP, &[]), Ok(()), "primary group");
    assert_eq!(
        judge(group, MEMBER, OTHER_GROUP, &[OTHER_GROUP, GROUP]),
        Ok(()),
        "supplementary group (SO_PEERGROUPS)"
    );
    assert_eq!(judge(group, 0, 0, &[]), Ok(()), "the directory's owner");
    assert_eq!(
        judge(group, OUTSIDER, OTHER_GROUP, &[OTHER_GROUP]),
        Err((OUTSIDER, OTHER_GROUP)),
        "outside the group"
    );
    // A private device admits its own uid only (ours: root).
    let private = Shape::Private { uid: 0 };
    assert_eq!(judge(private, 0, 0, &[]), Ok(()));
    assert_eq!(
        judge(private, MEMBER, GROUP, &[GROUP]),
        Err((MEMBER, GROUP))
    );
}
