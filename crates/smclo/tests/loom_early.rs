//! Model check of the early-byte count (`smclo::early_count`) with loom.
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
//! Run (also in CI):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p smclo --test loom_early
//! ```
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Mutex};
use smclo::early_count::{add, seal};

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
