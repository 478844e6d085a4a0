//! A DMB file may be written by a hostile process: parsing its header must
//! not panic, and an accepted header has a valid ring length and encodes
//! back to the bytes it came from (apart from the reserved word at 28).
#![no_main]

use libfuzzer_sys::fuzz_target;
use smclo_wire::dmb_header::{self, ring_len_ok, HEADER_LEN, STATIC_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = dmb_header::parse(data) {
        assert!(data.len() >= STATIC_LEN);
        assert!(ring_len_ok(h.ring_len));
        assert_eq!(h.file_len(), HEADER_LEN as u64 + h.ring_len as u64);
        let mut expect = [0u8; STATIC_LEN];
        expect.copy_from_slice(&data[..STATIC_LEN]);
        expect[28..32].fill(0);
        assert_eq!(h.encode(), expect);
        assert_eq!(dmb_header::parse(&h.encode()), Ok(h));
    }
});
