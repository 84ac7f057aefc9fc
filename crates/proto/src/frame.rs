//! Length-framed, multiplexed frames. Pure functions over byte buffers: the caller owns the
//! socket. Layout (little-endian):
//!
//! ```text
//! u32 body_len | u8 kind | u64 request_id | payload (postcard, body_len - 9 bytes)
//! ```
//!
//! `request_id` lets many requests be in flight on one connection and replies come back in
//! any order.

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;

/// Bytes before the payload: length, kind, request id.
pub const FRAME_HEADER_BYTES: usize = 4 + 1 + 8;

/// Largest frame body accepted. Bounds the memory one connection can make a peer allocate;
/// 8 MiB holds a 4 MiB data chunk or a full readdirplus page with room to spare.
pub const MAX_FRAME_BYTES: usize = 8 << 20;

/// Largest frame body accepted before a connection has authenticated. The handshake's
/// frames are under 200 bytes; 4 KiB leaves room for growth while an unauthenticated peer
/// can make a server hold no more than this per connection (not 8 MiB).
pub const PREAUTH_FRAME_BYTES_MAX: usize = 4 << 10;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Challenge = 1,
    Auth = 2,
    Welcome = 3,
    Request = 4,
    Reply = 5,
    /// Server to client before it closes a connection on purpose (bad auth, bad frame).
    Goodbye = 6,
    /// A reply sent before its journal record is durable: payload `(lsn, ReplayTag,
    /// Reply)` (the tag lets a replay of the request prove it is one, see
    /// `auth::ReplayKey`).
    Unsafe = 7,
    /// Server to client: its journal is durable up to the LSN in the payload (sent after
    /// `Unsafe` replies, once the journal holds them). Request id 0.
    Durable = 8,
    /// Server to client: drop what you cache of these names and inodes (payload
    /// `Vec<Invalidation>`), then answer with `CallbackDone` and the same request id. Sent
    /// only to connections that asked for leases.
    Callback = 9,
    /// Client to server: the callback with this request id is done (empty payload).
    CallbackDone = 10,
}

impl FrameKind {
    fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Challenge,
            2 => FrameKind::Auth,
            3 => FrameKind::Welcome,
            4 => FrameKind::Request,
            5 => FrameKind::Reply,
            6 => FrameKind::Goodbye,
            7 => FrameKind::Unsafe,
            8 => FrameKind::Durable,
            9 => FrameKind::Callback,
            10 => FrameKind::CallbackDone,
            _ => return None,
        })
    }
}

/// Why a byte stream is not a valid frame sequence. Any of these closes the connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    TooLarge(usize),
    TooShort(usize),
    UnknownKind(u8),
    Payload(String),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge(n) => write!(f, "frame of {n} bytes exceeds the limit"),
            FrameError::TooShort(n) => {
                write!(f, "frame body of {n} bytes is shorter than its header")
            }
            FrameError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::Payload(e) => write!(f, "malformed payload: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// A complete frame found at the start of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub request_id: u64,
    /// Bytes of the whole frame, header included: where the next frame starts.
    pub total_len: usize,
}

/// Looks for one complete frame at the start of `buf`. `Ok(None)` means more bytes are needed.
/// The payload is `buf[FRAME_HEADER_BYTES..header.total_len]`.
pub fn parse_header(buf: &[u8]) -> Result<Option<FrameHeader>, FrameError> {
    parse_header_limited(buf, MAX_FRAME_BYTES)
}

/// [`parse_header`] with a smaller limit on the body (before authentication).
pub fn parse_header_limited(
    buf: &[u8],
    body_max: usize,
) -> Result<Option<FrameHeader>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let body_len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if body_len > body_max.min(MAX_FRAME_BYTES) {
        return Err(FrameError::TooLarge(body_len));
    }
    if body_len < FRAME_HEADER_BYTES - 4 {
        return Err(FrameError::TooShort(body_len));
    }
    if buf.len() < 5 {
        return Ok(None);
    }
    let kind = FrameKind::from_u8(buf[4]).ok_or(FrameError::UnknownKind(buf[4]))?;
    if buf.len() < FRAME_HEADER_BYTES {
        return Ok(None);
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&buf[5..13]);
    let total_len = 4 + body_len;
    if buf.len() < total_len {
        return Ok(None);
    }
    Ok(Some(FrameHeader {
        kind,
        request_id: u64::from_le_bytes(id),
        total_len,
    }))
}

/// Appends one frame carrying `msg` to `out`.
pub fn encode_frame<T: Serialize>(
    out: &mut Vec<u8>,
    kind: FrameKind,
    request_id: u64,
    msg: &T,
) -> Result<(), FrameError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.push(kind as u8);
    out.extend_from_slice(&request_id.to_le_bytes());
    let buf = std::mem::take(out);
    let mut buf = match postcard::to_extend(msg, buf) {
        Ok(b) => b,
        Err(e) => return Err(FrameError::Payload(e.to_string())),
    };
    let body_len = buf.len() - start - 4;
    if body_len > MAX_FRAME_BYTES {
        buf.truncate(start);
        *out = buf;
        return Err(FrameError::TooLarge(body_len));
    }
    buf[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
    *out = buf;
    Ok(())
}

/// Decodes a payload, refusing trailing bytes (a sign of a confused or hostile peer).
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    match postcard::take_from_bytes::<T>(payload) {
        Ok((v, [])) => Ok(v),
        Ok((_, rest)) => Err(FrameError::Payload(format!(
            "{} trailing bytes",
            rest.len()
        ))),
        Err(e) => Err(FrameError::Payload(e.to_string())),
    }
}

/// Encodes a value with the same codec as frame payloads (journal records, checkpoints).
pub fn encode_value<T: Serialize>(out: Vec<u8>, v: &T) -> Result<Vec<u8>, FrameError> {
    postcard::to_extend(v, out).map_err(|e| FrameError::Payload(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::*;
    use crate::types::Credentials;

    #[test]
    fn round_trip_and_partial_frames() {
        let req = Request {
            cred: Credentials::user(1000, 100),
            seq: 7,
            seq_floor: 3,
            map_version: 0,
            mode: Default::default(),
            op: Op::Lookup {
                parent: 42,
                name: b"hello".to_vec(),
            },
        };
        let mut buf = Vec::new();
        encode_frame(&mut buf, FrameKind::Request, 99, &req).unwrap();
        encode_frame(&mut buf, FrameKind::Request, 100, &req).unwrap();
        let h = parse_header(&buf).unwrap().unwrap();
        assert_eq!(h.kind, FrameKind::Request);
        assert_eq!(h.request_id, 99);
        let back: Request = decode_payload(&buf[FRAME_HEADER_BYTES..h.total_len]).unwrap();
        assert_eq!(back, req);
        for cut in 0..h.total_len {
            assert_eq!(parse_header(&buf[..cut]).unwrap(), None, "cut at {cut}");
        }
        let h2 = parse_header(&buf[h.total_len..]).unwrap().unwrap();
        assert_eq!(h2.request_id, 100);
    }

    #[test]
    fn hostile_headers_are_errors() {
        let mut big = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes().to_vec();
        big.extend_from_slice(&[4; 9]);
        assert!(matches!(parse_header(&big), Err(FrameError::TooLarge(_))));
        assert!(matches!(
            parse_header(&[1, 0, 0, 0, 4]),
            Err(FrameError::TooShort(1))
        ));
        assert!(matches!(
            parse_header(&[9, 0, 0, 0, 77]),
            Err(FrameError::UnknownKind(77))
        ));
        let garbage = [0xffu8; 20];
        assert!(decode_payload::<Request>(&garbage).is_err());
    }
}
