//! The frame reader over any byte stream: split into frames as a connection does, each
//! payload decoded as the message its kind carries. Must never panic.
#![no_main]

use kochab_proto::auth::ReplayTag;
use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, parse_header};
use kochab_proto::{Auth, Challenge, FrameKind, FsError, Invalidation, Reply, Request, Welcome};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = data;
    loop {
        match parse_header(buf) {
            Ok(Some(h)) => {
                assert!(h.total_len >= FRAME_HEADER_BYTES && h.total_len <= buf.len());
                let p = &buf[FRAME_HEADER_BYTES..h.total_len];
                let _ = match h.kind {
                    FrameKind::Challenge => decode_payload::<Challenge>(p).is_ok(),
                    FrameKind::Auth => decode_payload::<Auth>(p).is_ok(),
                    FrameKind::Welcome => decode_payload::<Welcome>(p).is_ok(),
                    FrameKind::Request => decode_payload::<Request>(p).is_ok(),
                    FrameKind::Reply => decode_payload::<Reply>(p).is_ok(),
                    FrameKind::Goodbye => decode_payload::<FsError>(p).is_ok(),
                    FrameKind::Unsafe => decode_payload::<(u64, ReplayTag, Reply)>(p).is_ok(),
                    FrameKind::Durable => decode_payload::<u64>(p).is_ok(),
                    FrameKind::Callback => decode_payload::<Vec<Invalidation>>(p).is_ok(),
                    FrameKind::CallbackDone => p.is_empty(),
                };
                buf = &buf[h.total_len..];
            }
            Ok(None) | Err(_) => break,
        }
    }
});
