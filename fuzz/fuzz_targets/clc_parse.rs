//! CLC messages come from a peer process that is not trusted: parsing any
//! bytes must not panic, and whatever parses must be exactly what encoding
//! it gives back (the parser checks every byte, so nothing is lost).
#![no_main]

use libfuzzer_sys::fuzz_target;
use smclo_wire::clc::{ClcMsg, MAX_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = ClcMsg::parse(data) {
        let bytes = msg.to_bytes();
        assert!(bytes.len() <= MAX_LEN);
        assert_eq!(bytes.len(), msg.encoded_len());
        assert_eq!(bytes, data, "re-encoding differs from the accepted bytes");
        assert_eq!(ClcMsg::parse(&bytes).as_ref(), Ok(&msg));
    }
    // A slot area holds one message followed by anything.
    if let Ok((msg, len)) = ClcMsg::parse_prefix(data) {
        assert!(len <= data.len());
        assert_eq!(ClcMsg::parse(&data[..len]), Ok(msg));
    }
});
