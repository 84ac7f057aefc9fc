//! Request and reply payloads: any bytes decode or are refused; what decodes encodes and
//! decodes again to the same value.
#![no_main]

use kochab_proto::frame::{decode_payload, encode_value};
use kochab_proto::{Reply, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = decode_payload::<Request>(data) {
        let bytes = encode_value(Vec::new(), &r).expect("a decoded request encodes");
        assert_eq!(decode_payload::<Request>(&bytes).ok(), Some(r));
    }
    if let Ok(r) = decode_payload::<Reply>(data) {
        let _ = r.check_attrs();
        let bytes = encode_value(Vec::new(), &r).expect("a decoded reply encodes");
        assert_eq!(decode_payload::<Reply>(&bytes).ok(), Some(r));
    }
});
