//! The listener registry: exact, wildcard, IPv6 and IPv4-mapped matching;
//! registrations of dead processes are reclaimed.

mod common;
use common::{spawn_child, TempDir};
use smclo::device::Device;
use smclo::testing::owner::{netns_inode, Owner};
use smclo::testing::registry::{find_listener, register_listener, PROBE};
use std::net::SocketAddr;
use std::time::Duration;

fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    let dev = Device::open(&dir).unwrap();
    match role.as_str() {
        "listen" => {
            let g1 = register_listener(&dev, a("127.0.0.1:7001")).unwrap();
            // Fill the whole window of port 7002, so that only reclamation
            // can make room there (exact addresses: a wildcard also takes
            // entries for its namespace's addresses).
            let fill: Vec<_> = (0..PROBE)
                .map(|_| register_listener(&dev, a("127.0.0.2:7002")).unwrap())
                .collect();
            println!("READY");
            std::thread::sleep(Duration::from_secs(30));
            drop((g1, fill));
        }
        "decline" => {
            let d = smclo::testing::registry::decline_listener(&dev, a("127.0.0.1:7010"))
                .unwrap()
                .unwrap();
            println!("READY");
            std::thread::sleep(Duration::from_secs(30));
            drop(d);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn exact_wildcard_ipv6_and_mapped() {
    let t = TempDir::new("reg");
    let dev = Device::open(&t.0).unwrap();
    assert!(find_listener(&dev, a("127.0.0.1:5000")).is_none());

    let g = register_listener(&dev, a("127.0.0.1:5000")).unwrap();
    let info = find_listener(&dev, a("127.0.0.1:5000")).expect("exact match");
    assert_eq!(info.owner, Owner::current());
    assert_eq!(info.netns, netns_inode());
    assert_eq!(info.addr, a("127.0.0.1:5000"));
    assert!(info.is_self() && info.same_netns());
    assert!(
        find_listener(&dev, a("127.0.0.2:5000")).is_none(),
        "other address"
    );
    assert!(
        find_listener(&dev, a("127.0.0.1:5001")).is_none(),
        "other port"
    );
    assert!(
        find_listener(&dev, a("[::1]:5000")).is_none(),
        "other family"
    );
    // An IPv4-mapped destination is the IPv4 address.
    assert!(find_listener(&dev, a("[::ffff:127.0.0.1]:5000")).is_some());

    // IPv4 wildcard: any local IPv4 destination, no IPv6 one, and no
    // address of another host (TEST-NET-1 is never assigned to one).
    let _w4 = register_listener(&dev, a("0.0.0.0:5001")).unwrap();
    assert_eq!(
        find_listener(&dev, a("127.3.2.1:5001")).unwrap().addr,
        a("0.0.0.0:5001")
    );
    assert!(find_listener(&dev, a("[::1]:5001")).is_none());
    assert!(find_listener(&dev, a("[::ffff:127.3.2.1]:5001")).is_some());
    assert!(
        find_listener(&dev, a("192.0.2.1:5001")).is_none(),
        "a wildcard matches no remote destination"
    );

    // IPv6 wildcard: local IPv6 and IPv4 destinations (dual stack).
    let _w6 = register_listener(&dev, a("[::]:5002")).unwrap();
    assert!(find_listener(&dev, a("[::1]:5002")).is_some());
    assert!(find_listener(&dev, a("127.0.0.1:5002")).is_some());
    assert!(find_listener(&dev, a("[2001:db8::1]:5002")).is_none());
    assert!(find_listener(&dev, a("192.0.2.1:5002")).is_none());

    // IPv6 exact.
    let _e6 = register_listener(&dev, a("[::1]:5003")).unwrap();
    assert!(find_listener(&dev, a("[::1]:5003")).is_some());
    assert!(find_listener(&dev, a("[::2]:5003")).is_none());
    assert!(find_listener(&dev, a("127.0.0.1:5003")).is_none());

    // A listener on an IPv4-mapped address is an IPv4 listener.
    let _m = register_listener(&dev, a("[::ffff:127.0.0.5]:5004")).unwrap();
    assert_eq!(
        find_listener(&dev, a("127.0.0.5:5004")).unwrap().addr,
        a("127.0.0.5:5004")
    );

    // Exact beats wildcard on the same port.
    let _w = register_listener(&dev, a("0.0.0.0:5000")).unwrap();
    assert_eq!(
        find_listener(&dev, a("127.0.0.1:5000")).unwrap().addr,
        a("127.0.0.1:5000")
    );
    assert_eq!(
        find_listener(&dev, a("127.0.0.9:5000")).unwrap().addr,
        a("0.0.0.0:5000")
    );

    drop(g);
    assert_eq!(
        find_listener(&dev, a("127.0.0.1:5000")).unwrap().addr,
        a("0.0.0.0:5000"),
        "dropped guard unregisters"
    );
    drop(_w);
    assert!(find_listener(&dev, a("127.0.0.1:5000")).is_none());
    assert_eq!(dev.stats().listeners, 4);
}

#[test]
fn dead_listeners_are_reclaimed() {
    let t = TempDir::new("regdead");
    let dev = Device::open(&t.0).unwrap();
    let mut c = spawn_child("listen", &t.0);
    c.wait_ready();
    let pid = c.0.id();
    let info = find_listener(&dev, a("127.0.0.1:7001")).expect("child's listener");
    assert_eq!(info.owner.pid, pid);
    assert!(!info.is_self());
    // The window of port 7002 is full of live registrations.
    assert!(
        register_listener(&dev, a("0.0.0.0:7002")).is_err(),
        "window full"
    );
    assert_eq!(dev.stats().listeners, 1 + PROBE as u64);

    c.0.kill().unwrap();
    c.0.wait().unwrap();
    assert!(
        find_listener(&dev, a("127.0.0.1:7001")).is_none(),
        "dead owner's listener is not found"
    );
    // Registration reclaims the dead owner's entries in the window.
    let g = register_listener(&dev, a("0.0.0.0:7002")).expect("reclaimed");
    assert_eq!(
        find_listener(&dev, a("127.0.0.1:7002")).unwrap().owner,
        Owner::current()
    );
    assert_eq!(dev.stats().listeners, 1);
    drop(g);
    assert_eq!(dev.stats().listeners, 0);
}

/// A wildcard listener is also registered under its namespace's addresses
/// (aliases), which a client of another namespace matches exactly; the
/// listener count and `listeners` show the wildcard once.
#[test]
fn wildcard_aliases_are_registered_and_hidden() {
    let t = TempDir::new("regalias");
    let dev = Device::open(&t.0).unwrap();
    let ips = smclo::testing::sockaddr::namespace_addrs(false).unwrap();
    let g = register_listener(&dev, a("0.0.0.0:5005")).unwrap();
    assert_eq!(dev.stats().listeners, 1);
    assert_eq!(smclo::testing::registry::listeners(&dev).len(), 1);
    for ip in &ips {
        let dest = std::net::SocketAddr::new(*ip, 5005);
        let found = find_listener(&dev, dest).expect("alias found");
        assert_eq!(found.addr, dest, "the alias entry, an exact match");
    }
    drop(g);
    assert_eq!(dev.stats().listeners, 0);
    for ip in &ips {
        assert!(find_listener(&dev, std::net::SocketAddr::new(*ip, 5005)).is_none());
    }
}

/// A decline holds back the registrations that may stand for its socket,
/// made before or after it, and no other: another address on its port, an
/// IPv6 listener beside an IPv4 wildcard. The listings do not show what it
/// holds back; dropping it gives them back.
#[test]
fn a_decline_holds_back_the_registrations_of_its_socket() {
    use smclo::testing::registry::{decline_listener, listeners, live_listeners};
    let t = TempDir::new("reg-decline");
    let dev = Device::open(&t.0).unwrap();
    let mine = register_listener(&dev, a("127.0.0.1:5300")).unwrap();
    let other = register_listener(&dev, a("127.0.0.2:5300")).unwrap();
    assert_eq!(live_listeners(&dev), 2);

    let d = decline_listener(&dev, a("127.0.0.1:5300"))
        .unwrap()
        .unwrap();
    assert!(find_listener(&dev, a("127.0.0.1:5300")).is_none());
    assert!(
        find_listener(&dev, a("127.0.0.2:5300")).is_some(),
        "another address"
    );
    assert_eq!(live_listeners(&dev), 1, "the decline is no listener either");
    assert_eq!(listeners(&dev).len(), 1);

    // A registration made after the decline (a supervisor's first
    // accept, an image after an exec) is held back too.
    drop(mine);
    let again = register_listener(&dev, a("127.0.0.1:5300")).unwrap();
    assert!(
        find_listener(&dev, a("127.0.0.1:5300")).is_none(),
        "made later"
    );
    drop(d);
    assert!(
        find_listener(&dev, a("127.0.0.1:5300")).is_some(),
        "the decline ended"
    );

    // An IPv4 wildcard holds back IPv4 registrations on its port only.
    let v6 = register_listener(&dev, a("[::1]:5300")).unwrap();
    let d4 = decline_listener(&dev, a("0.0.0.0:5300")).unwrap().unwrap();
    assert!(find_listener(&dev, a("127.0.0.2:5300")).is_none());
    assert!(
        find_listener(&dev, a("[::1]:5300")).is_some(),
        "another family"
    );
    drop(d4);
    // An IPv4 wildcard's socket takes no IPv6 client: an IPv6 wildcard
    // registration on the port still serves those.
    let any6 = register_listener(&dev, a("[::]:5300")).unwrap();
    let d4 = decline_listener(&dev, a("0.0.0.0:5300")).unwrap().unwrap();
    assert!(find_listener(&dev, a("[::1]:5300")).is_some());
    assert!(find_listener(&dev, a("127.0.0.1:5300")).is_none());
    drop((d4, any6));
    // An IPv6 wildcard takes both families.
    let d6 = decline_listener(&dev, a("[::]:5300")).unwrap().unwrap();
    assert!(find_listener(&dev, a("127.0.0.2:5300")).is_none());
    assert!(find_listener(&dev, a("[::1]:5300")).is_none());
    assert_eq!(live_listeners(&dev), 0);
    drop(d6);
    assert_eq!(live_listeners(&dev), 3);
    drop((again, other, v6));

    // Eight processes' declines of one socket at most: a pool of workers
    // cannot fill the port's window.
    let cap = smclo::testing::registry::MAX_DECLINES;
    let held: Vec<_> = (0..cap)
        .map(|_| {
            decline_listener(&dev, a("127.0.0.3:5300"))
                .unwrap()
                .unwrap()
        })
        .collect();
    assert!(decline_listener(&dev, a("127.0.0.3:5300"))
        .unwrap()
        .is_none());
    drop(held);
}

/// A decline lasts while its process lives: once it is gone (killed), the
/// registration it held back is found again.
#[test]
fn a_decline_ends_with_its_process() {
    let t = TempDir::new("reg-decline-dead");
    let dev = Device::open(&t.0).unwrap();
    let g = register_listener(&dev, a("127.0.0.1:7010")).unwrap();
    let mut c = spawn_child("decline", &t.0);
    c.wait_ready();
    assert!(
        find_listener(&dev, a("127.0.0.1:7010")).is_none(),
        "declined"
    );
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    assert_eq!(
        find_listener(&dev, a("127.0.0.1:7010")).map(|i| i.owner),
        Some(Owner::current()),
        "the decline died with its process"
    );
    drop(g);
}
