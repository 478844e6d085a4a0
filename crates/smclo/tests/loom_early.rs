//! Model check of the early-byte count (`smclo::testing::early_count`) with loom.
//!
//! A client makes three writes of early bytes (each adds to the count,
//! then appends its bytes to a stand-in for its TCP stream) while a server
//! seals the count. Then, in every interleaving:
//! - the sealed count is exactly the bytes of the writes whose add
//!   succeeded, and every one of those precedes the seal: once the client
//!   is done, the stream holds exactly the count (the server accepts only
//!   then, and moves exactly the client's early bytes);
//! - no add succeeds after the seal: a write refused waits for the
//!   decision, and so does every later one (the stream never holds an
//!   uncounted byte between counted ones).
//!
//! A second model runs the count inside the handshake's order, with the
//! slot's states as `rendezvous` moves them (a stand-in word; the count is
//! the real `add` and `seal`): the server owns the reply (PROPOSED →
//! REPLYING), seals, checks that the stream holds the count, copies it
//! into its ring, moves to ACCEPTED and only then drops it from the
//! stream; it declines if the bytes are not there. The client gives up
//! from PROPOSED, or from REPLYING as after `REPLY_GRACE`, and a write
//! that was not counted waits for the decision: into the ring after
//! ACCEPTED, into the stream otherwise. In every interleaving, what the
//! server's application reads (the ring on SMC-D, the stream on TCP) is
//! every byte the client wrote, once and in order.
//!
//! Run (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_early
//! ```
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Mutex};
use smclo::testing::early_count::{add, seal};
use std::sync::atomic::Ordering::SeqCst;

#[test]
fn the_sealed_count_is_exactly_the_counted_bytes_in_the_stream() {
    loom::model(|| {
        let word = Arc::new(AtomicU64::new(0));
        let stream = Arc::new(Mutex::new(Vec::<u8>::new()));
        let client = {
            let (word, stream) = (word.clone(), stream.clone());
            loom::thread::spawn(move || {
                let mut refused = false;
                for (i, n) in [1usize, 2, 3].into_iter().enumerate() {
                    // After a refusal the write waits for the decision
                    // (as the preload does); it is never early.
                    if !refused && add(&*word, n) {
                        stream
                            .lock()
                            .unwrap()
                            .extend(std::iter::repeat(i as u8).take(n));
                    } else {
                        refused = true;
                    }
                }
            })
        };
        let sealed = seal(&*word);
        // Nothing counts after the seal.
        assert!(!add(&*word, 1));
        client.join().unwrap();
        let s = stream.lock().unwrap();
        assert_eq!(s.len(), sealed as usize, "stream {s:?}, count {sealed}");
        // The counted writes are a prefix of the client's writes.
        let prefix: Vec<u8> = [(0u8, 1usize), (1, 2), (2, 3)]
            .iter()
            .flat_map(|&(i, n)| std::iter::repeat(i).take(n))
            .take(s.len())
            .collect();
        assert_eq!(*s, prefix);
    });
}

/// The slot's states in the second model (`rendezvous::SlotState`).
const PROPOSED: u64 = 0;
const REPLYING: u64 = 1;
const ACCEPTED: u64 = 2;
/// The server declined, or the client gave up: TCP.
const DECLINED: u64 = 3;

#[test]
fn every_byte_arrives_once_and_in_order_whatever_decides() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let count = Arc::new(AtomicU64::new(0));
        let state = Arc::new(AtomicU64::new(PROPOSED));
        let stream = Arc::new(Mutex::new(Vec::<u8>::new()));
        let ring = Arc::new(Mutex::new(Vec::<u8>::new()));
        let client = {
            let (count, state, stream, ring) =
                (count.clone(), state.clone(), stream.clone(), ring.clone());
            loom::thread::spawn(move || {
                let mut early = true;
                for (bytes, give_up) in [(&[1u8][..], false), (&[2u8, 3][..], true)] {
                    if early && add(&*count, bytes.len()) {
                        stream.lock().unwrap().extend_from_slice(bytes);
                        continue;
                    }
                    early = false;
                    if give_up {
                        // Its deadline: from PROPOSED, or from REPLYING as
                        // after the reply's grace; it fails once decided.
                        let _ = state.compare_exchange(PROPOSED, DECLINED, SeqCst, SeqCst);
                        let _ = state.compare_exchange(REPLYING, DECLINED, SeqCst, SeqCst);
                    }
                    // Waits for the decision, then writes where it says.
                    loop {
                        match state.load(SeqCst) {
                            ACCEPTED => {
                                ring.lock().unwrap().extend_from_slice(bytes);
                                break;
                            }
                            DECLINED => {
                                stream.lock().unwrap().extend_from_slice(bytes);
                                break;
                            }
                            _ => loom::thread::yield_now(),
                        }
                    }
                }
            })
        };
        // The server.
        let mut accepted = false;
        if state
            .compare_exchange(PROPOSED, REPLYING, SeqCst, SeqCst)
            .is_ok()
        {
            let n = seal(&*count) as usize;
            let copied = {
                let st = stream.lock().unwrap();
                // MSG_PEEK: copied, left in the stream.
                (st.len() >= n).then(|| st[..n].to_vec())
            };
            match copied {
                Some(c) => {
                    ring.lock().unwrap().extend_from_slice(&c);
                    if state
                        .compare_exchange(REPLYING, ACCEPTED, SeqCst, SeqCst)
                        .is_ok()
                    {
                        // After its message: MSG_TRUNC drops them.
                        stream.lock().unwrap().drain(..n);
                        accepted = true;
                    } else {
                        // The client gave up first: the ring is dropped.
                        ring.lock().unwrap().clear();
                    }
                }
                None => {
                    let _ = state.compare_exchange(REPLYING, DECLINED, SeqCst, SeqCst);
                }
            }
        }
        client.join().unwrap();
        let read = if accepted {
            assert!(
                stream.lock().unwrap().is_empty(),
                "bytes left in the stream"
            );
            ring.lock().unwrap().clone()
        } else {
            stream.lock().unwrap().clone()
        };
        assert_eq!(read, vec![1, 2, 3], "accepted {accepted}");
    });
}
