//! The frame codec for tokio-util ([`FrameCodec`], a [`Decoder`]): cuts a byte stream into
//! frames with the pure parser of [`crate::frame`], under a body limit that follows the
//! connection's state: [`PREAUTH_FRAME_BYTES_MAX`] before authentication, the negotiated
//! maximum after. Readers drive it with `tokio_util::codec::FramedRead`, or call
//! [`Decoder::decode`] on the read buffer themselves to take every frame already there.

use crate::frame::{
    FRAME_HEADER_BYTES, FrameError, FrameKind, MAX_FRAME_BYTES, PREAUTH_FRAME_BYTES_MAX,
    parse_header_limited,
};
use crate::net::READ_CHUNK;
use bytes::{Buf, BytesMut};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio_util::codec::Decoder;

/// One frame as it arrived. The payload is still encoded: see
/// [`crate::frame::decode_payload`].
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub request_id: u64,
    pub payload: BytesMut,
}

/// Why reading frames stopped: a broken frame (the peer's fault) or the socket.
#[derive(Debug)]
pub enum CodecError {
    Frame(FrameError),
    Io(std::io::Error),
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Frame(e) => e.fmt(f),
            CodecError::Io(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for CodecError {}

impl From<std::io::Error> for CodecError {
    fn from(e: std::io::Error) -> CodecError {
        CodecError::Io(e)
    }
}

impl From<FrameError> for CodecError {
    fn from(e: FrameError) -> CodecError {
        CodecError::Frame(e)
    }
}

/// Splits a stream into frames. `Copy` so a reader can decode the frames already in a
/// `FramedRead`'s buffer with a copy while the `FramedRead` holds the original.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCodec {
    body_max: usize,
    /// Free buffer space kept before a read beyond what the current frame needs.
    read_ahead: usize,
}

impl FrameCodec {
    /// Before authentication: frames of at most [`PREAUTH_FRAME_BYTES_MAX`] body bytes, and
    /// the buffer never grows past one such frame (an unauthenticated peer cannot make a
    /// reader hold more). Start the `FramedRead` with [`FrameCodec::PREAUTH_BUFFER`] bytes.
    pub fn preauth() -> FrameCodec {
        FrameCodec {
            body_max: PREAUTH_FRAME_BYTES_MAX,
            read_ahead: 0,
        }
    }

    /// The buffer capacity that holds the largest pre-authentication frame.
    pub const PREAUTH_BUFFER: usize = PREAUTH_FRAME_BYTES_MAX + FRAME_HEADER_BYTES;

    /// After authentication: frames up to `body_max` body bytes (never above
    /// [`MAX_FRAME_BYTES`]), read [`READ_CHUNK`] at a time or a large frame in one go.
    pub fn authenticated(body_max: usize) -> FrameCodec {
        FrameCodec {
            body_max: body_max.min(MAX_FRAME_BYTES),
            read_ahead: READ_CHUNK,
        }
    }

    /// The largest body this codec accepts.
    pub fn body_max(&self) -> usize {
        self.body_max
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        match parse_header_limited(src, self.body_max)? {
            Some(h) => {
                let mut payload = src.split_to(h.total_len);
                payload.advance(FRAME_HEADER_BYTES);
                Ok(Some(Frame {
                    kind: h.kind,
                    request_id: h.request_id,
                    payload,
                }))
            }
            None => {
                // The length field (checked against the limit by the parser) says how much
                // more the frame needs: room for all of it, so a large frame is read in one
                // go, and for `read_ahead` bytes of what follows.
                let want = match src.get(..4) {
                    Some(h) => 4 + u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize,
                    None => 0,
                };
                let missing = want.saturating_sub(src.len());
                src.reserve(missing.max(self.read_ahead));
                Ok(None)
            }
        }
    }

    /// At the end of the stream a partial frame is no error of its own: the peer closed
    /// the connection, and readers report that (tokio-util's default is an I/O error).
    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        self.decode(src)
    }
}

/// The next item of a stream (a `FramedRead`), as a future; cancel-safe like the stream.
pub fn next<S: futures_core::Stream + Unpin>(s: &mut S) -> Next<'_, S> {
    Next(s)
}

/// The future of [`next`].
pub struct Next<'a, S>(&'a mut S);

impl<S: futures_core::Stream + Unpin> Future for Next<'_, S> {
    type Output = Option<S::Item>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut *self.0).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode_payload, encode_frame};
    use crate::msg::*;
    use crate::types::Credentials;

    fn request(n: u64) -> Request {
        Request {
            cred: Credentials::user(1000, 100),
            seq: n,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: Op::Lookup {
                parent: n,
                name: format!("file{n}").into_bytes(),
            },
        }
    }

    fn frames(n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            encode_frame(&mut out, FrameKind::Request, 100 + i, &request(i)).unwrap();
        }
        out
    }

    fn check(frame: &Frame, i: u64) {
        assert_eq!(frame.kind, FrameKind::Request);
        assert_eq!(frame.request_id, 100 + i);
        let r: Request = decode_payload(&frame.payload).unwrap();
        assert_eq!(r, request(i));
    }

    #[test]
    fn frames_split_byte_by_byte() {
        let stream = frames(3);
        let mut codec = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in &stream {
            buf.extend_from_slice(&[*b]);
            while let Some(f) = codec.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got.len(), 3);
        for (i, f) in got.iter().enumerate() {
            check(f, i as u64);
        }
        assert!(buf.is_empty());
    }

    #[test]
    fn several_frames_in_one_buffer() {
        let mut stream = frames(5);
        // Half of a sixth frame stays in the buffer for the next read.
        let mut sixth = Vec::new();
        encode_frame(&mut sixth, FrameKind::Request, 105, &request(5)).unwrap();
        stream.extend_from_slice(&sixth[..sixth.len() / 2]);
        let mut codec = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let mut buf = BytesMut::from(&stream[..]);
        for i in 0..5 {
            check(&codec.decode(&mut buf).unwrap().unwrap(), i);
        }
        assert_eq!(codec.decode(&mut buf).unwrap(), None);
        assert_eq!(&buf[..], &sixth[..sixth.len() / 2]);
        // Room for the rest of the frame and a read chunk after it.
        assert!(buf.capacity() - buf.len() >= READ_CHUNK);
        buf.extend_from_slice(&sixth[sixth.len() / 2..]);
        check(&codec.decode(&mut buf).unwrap().unwrap(), 5);
    }

    #[test]
    fn oversize_header_is_refused_before_its_payload() {
        let mut codec = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&(MAX_FRAME_BYTES as u32 + 1).to_le_bytes());
        // Only the length field has arrived: refused at once, nothing reserved for it.
        let cap = buf.capacity();
        assert!(matches!(
            codec.decode(&mut buf),
            Err(CodecError::Frame(FrameError::TooLarge(n))) if n == MAX_FRAME_BYTES + 1
        ));
        assert_eq!(buf.capacity(), cap);
        // A limit below the protocol's also holds.
        let mut small = FrameCodec::authenticated(1000);
        let mut buf = BytesMut::from(&1001u32.to_le_bytes()[..]);
        assert!(matches!(
            small.decode(&mut buf),
            Err(CodecError::Frame(FrameError::TooLarge(1001)))
        ));
        // A limit above the protocol's is the protocol's.
        assert_eq!(
            FrameCodec::authenticated(usize::MAX).body_max(),
            MAX_FRAME_BYTES
        );
    }

    #[test]
    fn before_authentication_only_small_frames() {
        let mut codec = FrameCodec::preauth();
        let mut buf = BytesMut::with_capacity(FrameCodec::PREAUTH_BUFFER);
        buf.extend_from_slice(&(PREAUTH_FRAME_BYTES_MAX as u32 + 1).to_le_bytes());
        assert!(matches!(
            codec.decode(&mut buf),
            Err(CodecError::Frame(FrameError::TooLarge(n))) if n == PREAUTH_FRAME_BYTES_MAX + 1
        ));
        // The largest allowed frame fits the pre-authentication buffer without growing it.
        let mut buf = BytesMut::with_capacity(FrameCodec::PREAUTH_BUFFER);
        let mut frame = (PREAUTH_FRAME_BYTES_MAX as u32).to_le_bytes().to_vec();
        frame.push(FrameKind::Auth as u8);
        frame.extend_from_slice(&7u64.to_le_bytes());
        frame.resize(4 + PREAUTH_FRAME_BYTES_MAX, 0);
        for b in &frame[..frame.len() - 1] {
            buf.extend_from_slice(&[*b]);
            assert_eq!(codec.decode(&mut buf).unwrap(), None);
            assert_eq!(buf.capacity(), FrameCodec::PREAUTH_BUFFER);
        }
        buf.extend_from_slice(&frame[frame.len() - 1..]);
        let f = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!((f.kind, f.request_id), (FrameKind::Auth, 7));
        assert_eq!(f.payload.len(), PREAUTH_FRAME_BYTES_MAX - 9);
        // After authentication the same size of frame and larger ones pass.
        let mut after = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let mut big = BytesMut::from(&((64u32 << 10) + 9).to_le_bytes()[..]);
        assert_eq!(after.decode(&mut big).unwrap(), None);
        assert!(big.capacity() >= (64 << 10) + 13);
    }

    #[test]
    fn bad_kind_and_short_body_are_errors() {
        let mut codec = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let mut buf = BytesMut::from(&[9u8, 0, 0, 0, 77][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(CodecError::Frame(FrameError::UnknownKind(77)))
        ));
        let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 4][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(CodecError::Frame(FrameError::TooShort(1)))
        ));
    }

    #[test]
    fn framed_read_over_a_stream_in_pieces() {
        let stream = frames(4);
        let rt = tokio_test_runtime();
        rt.block_on(async {
            let (mut tx, rx) = tokio::io::duplex(7);
            let writer = async move {
                use tokio::io::AsyncWriteExt;
                for piece in stream.chunks(5) {
                    tx.write_all(piece).await.unwrap();
                }
            };
            let reader = async move {
                let mut rd = tokio_util::codec::FramedRead::new(
                    rx,
                    FrameCodec::authenticated(MAX_FRAME_BYTES),
                );
                let mut got = 0;
                while let Some(f) = next(&mut rd).await {
                    check(&f.unwrap(), got);
                    got += 1;
                }
                got
            };
            let ((), got) = tokio::join!(writer, reader);
            assert_eq!(got, 4);
        });
    }

    #[test]
    fn a_stream_closed_mid_frame_ends_without_error() {
        let mut stream = frames(2);
        stream.truncate(stream.len() - 3);
        let rt = tokio_test_runtime();
        let got = rt.block_on(async move {
            let mut rd = tokio_util::codec::FramedRead::new(
                &stream[..],
                FrameCodec::authenticated(MAX_FRAME_BYTES),
            );
            let mut got = Vec::new();
            while let Some(f) = next(&mut rd).await {
                got.push(f.map(|f| f.request_id).map_err(|e| e.to_string()));
            }
            got
        });
        assert_eq!(got, vec![Ok(100)]);
    }

    fn tokio_test_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }
}
