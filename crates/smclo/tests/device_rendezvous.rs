//! Rendezvous slots: propose / find / answer / confirm, CAS agreement
//! between a client that gives up and a server that answers, stale
//! references after reuse, a full table, and slots of dead clients.

mod common;
use common::{spawn_child, TempDir};
use smclo::device::Device;
use smclo::testing::rendezvous::{Rendezvous, SlotKey, SlotState, MSG_LEN, PROBE};
use smclo::Error;
use smclo_wire::syn::Mark;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A distinct mark for each `n` the tests use (40000 ..= 41200).
fn mark(n: u16) -> Mark {
    Mark {
        ttl: (n / 64 % 256) as u8,
        dscp: (n % 64) as u8,
    }
}

fn key(n: u16, sport: u16) -> SlotKey {
    SlotKey::new(
        "127.0.0.1".parse().unwrap(),
        mark(n),
        format!("127.0.0.1:{sport}").parse().unwrap(),
    )
}

/// Runs in a child process when SMCLO_TEST_ROLE is set; a no-op otherwise.
#[test]
fn child_entry() {
    let Some((role, dir)) = common::child_role() else {
        return;
    };
    let dev = Device::open(&dir).unwrap();
    match role.as_str() {
        // Every slot of one key's window, then wait to be killed.
        "fill" => hold_window(&dev, key(40000, 80)),
        // The whole announcements' window, then wait to be killed.
        "announce-all" => hold_window(&dev, SlotKey::announcement("10.7.7.7".parse().unwrap())),
        other => panic!("unknown role {other}"),
    }
}

/// A child's role: proposes in every slot of `k`'s window, says READY,
/// and holds them until it is killed.
fn hold_window(dev: &Device, k: SlotKey) {
    let held: Vec<_> = (0..PROBE)
        .map(|_| Rendezvous::propose(dev, k, b"child").unwrap())
        .collect();
    println!("READY");
    std::thread::sleep(Duration::from_secs(30));
    drop(held);
}

/// Waits until child `c` says READY.
fn await_ready(c: &mut std::process::Child) {
    let mut r = BufReader::new(c.stdout.as_mut().unwrap());
    loop {
        let mut l = String::new();
        assert!(r.read_line(&mut l).unwrap() > 0, "child exited early");
        if l.trim() == "READY" {
            break;
        }
    }
}

/// The server reads only the slots the announcement map names: another
/// process's announcements are there, and so is one that took over a dead
/// announcer's slot (its bit set by the new owner).
#[test]
fn the_announcement_map_names_every_announcement() {
    let t = TempDir::new("rdvmap");
    let dev = Device::open(&t.0).unwrap();
    let mut c = spawn_child("announce-all", &t.0);
    await_ready(&mut c.0);
    assert_eq!(Rendezvous::find_announcements(&dev, |_| false).len(), PROBE);
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    let me: std::net::IpAddr = "10.9.9.9".parse().unwrap();
    let mine = Rendezvous::propose(&dev, SlotKey::announcement(me), b"mine")
        .expect("a dead announcer's slot taken over");
    let found = Rendezvous::find_announcements(&dev, |s| s.client_ip() == Some(me));
    assert_eq!(found.last().and_then(|s| s.client_ip()), Some(me));
    assert_eq!(found.last().unwrap().proposal().unwrap(), b"mine");
    drop(mine);
    let left = Rendezvous::find_announcements(&dev, |_| false);
    assert_eq!(left.len(), PROBE - 1, "the dead announcer's others");
    assert!(left.iter().all(|s| s.client_ip() != Some(me)));
}

#[test]
fn published_port_belongs_to_one_incarnation() {
    let t = TempDir::new("rdvport");
    let dev = Device::open(&t.0).unwrap();
    let k = key(40009, 80);
    let first = Rendezvous::propose(&dev, k, b"p1").unwrap();
    let stale = Rendezvous::find(&dev, k).unwrap();
    first.set_client_port(1111);
    assert_eq!(stale.client_port(), Some(1111));
    drop(first);
    // The slot is reused: the old reference sees nothing, and the new
    // incarnation starts without a port.
    let second = Rendezvous::propose(&dev, k, b"p2").unwrap();
    let fresh = Rendezvous::find(&dev, k).unwrap();
    assert_eq!(stale.client_port(), None);
    assert_eq!(fresh.client_port(), None);
    stale.set_client_port(2222);
    assert_eq!(
        fresh.client_port(),
        None,
        "a stale reference changes nothing"
    );
    second.set_client_port(3333);
    assert_eq!(fresh.client_port(), Some(3333));
}

#[test]
fn full_handshake_path() {
    let t = TempDir::new("rdv");
    let dev = Device::open(&t.0).unwrap();
    let k = key(40001, 80);
    assert!(Rendezvous::find(&dev, k).is_none());
    let client = Rendezvous::propose(&dev, k, b"proposal bytes").unwrap();
    assert_eq!(client.state(), SlotState::Proposed);

    // The server sees the key as peer/local; a dual-stack server sees the
    // client as an IPv4-mapped address, which is the same key.
    let mapped = SlotKey::new(
        "::ffff:127.0.0.1".parse().unwrap(),
        mark(40001),
        "[::ffff:127.0.0.1]:80".parse().unwrap(),
    );
    assert_eq!(mapped, k);
    let server = Rendezvous::find(&dev, mapped).expect("found by 4-tuple");
    assert!(
        Rendezvous::find(&dev, key(40002, 80)).is_none(),
        "other mark"
    );
    assert!(
        Rendezvous::find(&dev, key(40001, 81)).is_none(),
        "other server port"
    );
    assert_eq!(server.index(), client.index());
    assert_eq!(server.client().pid, std::process::id());
    assert_eq!(server.proposal().unwrap(), b"proposal bytes");
    // The client's port, published after its connect.
    assert_eq!(server.client_port(), None);
    client.set_client_port(51234);
    assert_eq!(server.client_port(), Some(51234));

    server.answer(b"accept!", true).unwrap();
    assert_eq!(client.state(), SlotState::Accepted);
    assert_eq!(client.reply().unwrap(), b"accept!");
    assert!(
        Rendezvous::find(&dev, k).is_none(),
        "only PROPOSED slots are found"
    );
    // A second answer cannot change the decision.
    assert_eq!(server.answer(b"again", false), Err(SlotState::Accepted));
    assert_eq!(client.reply().unwrap(), b"accept!");

    client.confirm(b"confirm", true).unwrap();
    assert_eq!(
        server.wait_while(SlotState::Accepted, Instant::now() + Duration::from_secs(1)),
        SlotState::Confirmed
    );
    assert_eq!(server.confirm_msg().unwrap(), b"confirm");
    // The server's timeout CAS fails: the client decided.
    assert_eq!(
        server.cas(SlotState::Accepted, SlotState::Declined),
        Err(SlotState::Confirmed)
    );

    // Messages are bounded.
    let big = vec![7u8; MSG_LEN + 1];
    assert!(matches!(
        Rendezvous::propose(&dev, key(40003, 80), &big),
        Err(Error::Io(_))
    ));
    let exact = vec![9u8; MSG_LEN];
    let s = Rendezvous::propose(&dev, key(40003, 80), &exact).unwrap();
    assert_eq!(
        Rendezvous::find(&dev, key(40003, 80))
            .unwrap()
            .proposal()
            .unwrap(),
        exact
    );
    drop(s);

    client.release();
    assert_eq!(server.state(), SlotState::Stale);
}

#[test]
fn decline_paths() {
    let t = TempDir::new("rdvdecl");
    let dev = Device::open(&t.0).unwrap();
    // Server declines.
    let c = Rendezvous::propose(&dev, key(40010, 80), b"p").unwrap();
    let s = Rendezvous::find(&dev, key(40010, 80)).unwrap();
    s.answer(b"decline", false).unwrap();
    assert_eq!(c.state(), SlotState::Declined);
    assert_eq!(
        c.give_up(),
        Err(SlotState::Declined),
        "server decided first"
    );
    assert_eq!(c.reply().unwrap(), b"decline");
    drop(c);

    // Client gives up first: the server's answer fails, nothing written.
    let c = Rendezvous::propose(&dev, key(40011, 80), b"p").unwrap();
    let s = Rendezvous::find(&dev, key(40011, 80)).unwrap();
    assert_eq!(c.give_up(), Ok(()));
    assert_eq!(s.answer(b"late accept", true), Err(SlotState::Declined));
    assert_eq!(c.reply().unwrap(), b"");
    drop(c);

    // Server gives up waiting for the Confirm; the client's confirm fails.
    let c = Rendezvous::propose(&dev, key(40012, 80), b"p").unwrap();
    let s = Rendezvous::find(&dev, key(40012, 80)).unwrap();
    s.answer(b"a", true).unwrap();
    s.cas(SlotState::Accepted, SlotState::Declined).unwrap();
    assert_eq!(c.confirm(b"c", true), Err(SlotState::Declined));

    // Illegal transitions are refused.
    assert!(s.cas(SlotState::Declined, SlotState::Free).is_err());
    assert!(s.cas(SlotState::Declined, SlotState::Writing).is_err());
}

#[test]
fn client_timeout_and_server_answer_always_agree() {
    let t = TempDir::new("rdvrace");
    let dev = Device::open(&t.0).unwrap();
    let (mut client_won, mut server_won) = (0, 0);
    for i in 0..400u16 {
        let k = key(41000 + i, 80);
        let c = Rendezvous::propose(&dev, k, b"p").unwrap();
        let s = Rendezvous::find(&dev, k).unwrap();
        let b = Arc::new(Barrier::new(2));
        let b2 = b.clone();
        let srv = std::thread::spawn(move || {
            b2.wait();
            s.answer(b"accept", true)
        });
        b.wait();
        let gave_up = c.give_up();
        let answered = srv.join().unwrap();
        match (gave_up, answered) {
            (Ok(()), Err(SlotState::Declined)) => {
                client_won += 1;
                assert_eq!(c.state(), SlotState::Declined);
            }
            (Err(SlotState::Accepted), Ok(())) => {
                server_won += 1;
                assert_eq!(
                    c.reply().unwrap(),
                    b"accept",
                    "reply complete when Accepted is seen"
                );
            }
            other => panic!("disagreement: {other:?}"),
        }
    }
    assert_eq!(client_won + server_won, 400);
}

#[test]
fn stale_reference_cannot_touch_a_reused_slot() {
    let t = TempDir::new("rdvstale");
    let dev = Device::open(&t.0).unwrap();
    let k = key(40020, 80);
    let c1 = Rendezvous::propose(&dev, k, b"first").unwrap();
    let stale = Rendezvous::find(&dev, k).unwrap();
    let idx = c1.index();
    drop(c1); // released
    let c2 = Rendezvous::propose(&dev, k, b"second").unwrap();
    assert_eq!(c2.index(), idx, "the freed slot is reused");
    assert_ne!(c2.generation(), stale.generation());
    assert_eq!(stale.state(), SlotState::Stale);
    assert_eq!(stale.proposal(), None);
    assert_eq!(stale.answer(b"stale accept", true), Err(SlotState::Stale));
    assert_eq!(
        stale.cas(SlotState::Proposed, SlotState::Declined),
        Err(SlotState::Stale)
    );
    assert_eq!(
        c2.state(),
        SlotState::Proposed,
        "the new incarnation is untouched"
    );
    let fresh = Rendezvous::find(&dev, k).unwrap();
    assert_eq!(fresh.proposal().unwrap(), b"second");
    fresh.answer(b"ok", true).unwrap();
    assert_eq!(c2.reply().unwrap(), b"ok");
}

#[test]
fn full_window_is_an_error_and_dead_clients_slots_are_reclaimed() {
    let t = TempDir::new("rdvfull");
    let dev = Device::open(&t.0).unwrap();
    let k = key(40030, 80);
    let held: Vec<_> = (0..PROBE)
        .map(|_| Rendezvous::propose(&dev, k, b"x").unwrap())
        .collect();
    match Rendezvous::propose(&dev, k, b"x") {
        Err(Error::Io(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC)),
        other => panic!("expected ENOSPC, got {other:?}"),
    }
    assert_eq!(Rendezvous::find_all(&dev, k).len(), PROBE);
    drop(held);
    assert!(Rendezvous::find_all(&dev, k).is_empty(), "released");

    // A killed client's slots are taken over by the next proposal.
    let mut c = spawn_child("fill", &t.0);
    await_ready(&mut c.0);
    let k40000 = key(40000, 80);
    assert_eq!(Rendezvous::find_all(&dev, k40000).len(), PROBE);
    assert!(
        Rendezvous::propose(&dev, k40000, b"mine").is_err(),
        "window full of a live client"
    );
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    let mine = Rendezvous::propose(&dev, k40000, b"mine").expect("dead client's slot reclaimed");
    assert_eq!(mine.client().pid, std::process::id());
    assert!(Rendezvous::find_all(&dev, k40000)
        .iter()
        .any(|s| s.proposal().unwrap() == b"mine"));
}

/// The server's lookup for a SYN stops at the first proposal whose client
/// published the SYN's source port, in probe order, so it reads no more
/// slots than it answers; without such a proposal it returns them all.
#[test]
fn lookup_for_a_syn_stops_at_its_published_port() {
    let t = TempDir::new("rdvsyn");
    let dev = Device::open(&t.0).unwrap();
    let k = key(40040, 80);
    let held: Vec<_> = (0..4)
        .map(|_| Rendezvous::propose(&dev, k, b"x").unwrap())
        .collect();
    held[1].set_client_port(5001);
    held[2].set_client_port(5002);
    let port = |v: &[smclo::testing::rendezvous::SlotRef]| {
        v.iter().map(|s| s.client_port()).collect::<Vec<_>>()
    };
    let found = Rendezvous::find_for_syn(&dev, k, 5001);
    assert_eq!(port(&found), [None, Some(5001)]);
    let found = Rendezvous::find_for_syn(&dev, k, 5002);
    assert_eq!(port(&found), [None, Some(5001), Some(5002)]);
    let all = Rendezvous::find_for_syn(&dev, k, 5003);
    assert_eq!(
        all.len(),
        4,
        "no proposal published 5003: all are candidates"
    );
    assert_eq!(Rendezvous::find_all(&dev, k).len(), 4);
}

/// A SYN's TTL is not part of the key (routing hops decrement it), and
/// the server's look for a proposal whose DSCP was rewritten on the way
/// finds it by addresses and port whatever its DSCP, up to the one it
/// stops at.
#[test]
fn keys_leave_the_ttl_out_and_a_look_may_ignore_the_dscp() {
    let t = TempDir::new("rdvdscp");
    let dev = Device::open(&t.0).unwrap();
    let at = |ttl: u8, dscp: u8| {
        SlotKey::new(
            "127.0.0.1".parse().unwrap(),
            Mark { ttl, dscp },
            "127.0.0.1:81".parse().unwrap(),
        )
    };
    let a = Rendezvous::propose(&dev, at(200, 7), b"a").unwrap();
    let b = Rendezvous::propose(&dev, at(150, 9), b"b").unwrap();
    a.set_client_port(6001);
    b.set_client_port(6002);
    // One hop later, and before: the same key.
    assert_eq!(Rendezvous::find_all(&dev, at(199, 7)).len(), 1);
    assert_eq!(Rendezvous::find_all(&dev, at(1, 7)).len(), 1);
    // DSCP 0 (rewritten): no key matches, the look that ignores it does.
    assert!(Rendezvous::find_all(&dev, at(199, 0)).is_empty());
    let port = |p: u16| move |s: &smclo::testing::rendezvous::SlotRef| s.client_port() == Some(p);
    let found = Rendezvous::find_any_dscp(&dev, at(199, 0), port(6002));
    assert_eq!(found.last().unwrap().proposal().unwrap(), b"b");
    let found = Rendezvous::find_any_dscp(&dev, at(199, 0), port(6003));
    assert_eq!(found.len(), 2, "both proposals of the pair");
    // Another server's proposals are not found.
    let other = SlotKey::new(
        "127.0.0.1".parse().unwrap(),
        Mark { ttl: 200, dscp: 7 },
        "127.0.0.1:82".parse().unwrap(),
    );
    assert!(Rendezvous::find_any_dscp(&dev, other, port(6001)).is_empty());
    // find_until stops at the first slot its predicate takes.
    let found = Rendezvous::find_until(&dev, at(200, 7), |s| s.proposal().unwrap() == b"a");
    assert_eq!(found.len(), 1);
}

/// Announcements from any client address share one window: the server
/// finds them without knowing the address (source NAT may have changed
/// it), reads each one's address from its key, and its TSval window and
/// port belong to its incarnation only.
#[test]
fn announcements_are_found_whatever_their_address() {
    use smclo_wire::syn::TsWindow;
    let t = TempDir::new("rdvann");
    let dev = Device::open(&t.0).unwrap();
    let a: std::net::IpAddr = "10.1.2.3".parse().unwrap();
    let b: std::net::IpAddr = "fd00::7".parse().unwrap();
    let pa = Rendezvous::propose(&dev, SlotKey::announcement(a), b"a").unwrap();
    let pb = Rendezvous::propose(&dev, SlotKey::announcement(b), b"b").unwrap();
    // A marked proposal is no announcement.
    let _marked = Rendezvous::propose(&dev, key(40100, 80), b"m").unwrap();
    let found = Rendezvous::find_announcements(&dev, |_| false);
    let mut addrs: Vec<_> = found.iter().map(|s| s.client_ip()).collect();
    addrs.sort();
    assert_eq!(addrs, [Some(a), Some(b)]);
    assert!(found.iter().all(|s| s.client_ts().is_none()));
    let w = TsWindow::after(1000, 3);
    pb.set_client_ts(w);
    pb.set_client_port(4242);
    let ours = |s: &smclo::testing::rendezvous::SlotRef| {
        s.client_port() == Some(4242) && s.client_ts().is_some_and(|w| w.fits(999))
    };
    let found = Rendezvous::find_announcements(&dev, ours);
    let last = found.last().unwrap();
    assert!(ours(last));
    assert_eq!(last.client_ip(), Some(b));
    assert_eq!(last.client_ts(), Some(w));
    // Freed and reused: the old reference sees neither window nor address.
    drop(pb);
    assert_eq!(last.client_ts(), None);
    assert_eq!(last.client_ip(), None);
    drop(pa);
    assert!(Rendezvous::find_announcements(&dev, |_| false).is_empty());
}

/// An announcement's client names its DMB's token in the slot only once a
/// server answers: the server reads it from then on, for that incarnation
/// only, and a new proposal in the slot starts without one.
#[test]
fn an_announcements_dmb_token_is_named_late_and_per_incarnation() {
    let t = TempDir::new("rdvtok");
    let dev = Device::open(&t.0).unwrap();
    let a: std::net::IpAddr = "10.1.2.3".parse().unwrap();
    let p = Rendezvous::propose(&dev, SlotKey::announcement(a), b"a").unwrap();
    let server = Rendezvous::find_announcements(&dev, |_| false)
        .pop()
        .unwrap();
    assert_eq!(server.client_token(), None);
    p.set_client_token(0x1234_5678_9abc_def0);
    assert_eq!(server.client_token(), Some(0x1234_5678_9abc_def0));
    drop(p);
    assert_eq!(server.client_token(), None);
    let _q = Rendezvous::propose(&dev, SlotKey::announcement(a), b"b").unwrap();
    let again = Rendezvous::find_announcements(&dev, |_| false)
        .pop()
        .unwrap();
    assert_eq!(again.index(), server.index());
    assert_eq!(again.client_token(), None);
}
