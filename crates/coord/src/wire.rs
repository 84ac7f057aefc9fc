//! Frames and the handshake between coordinator peers (replicas and clients).
//!
//! A frame is `[len u32 LE][crc32c u32 LE][payload]`, the payload a postcard message. On
//! connect both sides prove the cluster key without sending it: the dialer sends a nonce,
//! the acceptor answers with its own nonce and an HMAC-SHA256 over both (so the dialer
//! knows it reached a member, not an impostor), then the dialer sends its HMAC over both
//! and the acceptor says welcome. The two proofs carry different labels, so one side's
//! proof can never be replayed as the other's.

use std::path::Path;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes of a cluster key.
pub const CLUSTER_KEY_BYTES: usize = 32;

/// The secret every replica and client of one coordinator group shares.
pub type ClusterKey = [u8; CLUSTER_KEY_BYTES];

/// Largest frame accepted. Snapshot chunks are capped at 1 MiB (`replica`), append
/// batches at `max_payload_entries`; 16 MiB leaves room for a large coordinator state
/// sent whole in a read reply, and bounds what a bad peer can make us allocate.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Time a peer gets to complete the handshake before we hang up.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

const MAGIC: u64 = 0x4b4f_4348_4352_4431; // "KOCHCRD1"
const VERSION: u32 = 1;
const LABEL_ACCEPTOR: &[u8] = b"kochab-coord acceptor proof";
const LABEL_DIALER: &[u8] = b"kochab-coord dialer proof";

/// What can go wrong on the wire.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed or closed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame's checksum did not match its bytes.
    #[error("frame checksum mismatch")]
    BadChecksum,
    /// A frame longer than `MAX_FRAME_BYTES`.
    #[error("frame of {0} bytes is over the limit")]
    TooLong(usize),
    /// The payload did not decode as the expected message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer does not hold our cluster key, or speaks another protocol.
    #[error("authentication failed: {0}")]
    Auth(&'static str),
    /// The peer did not finish the handshake in time.
    #[error("handshake timed out")]
    Timeout,
}

/// Encodes `msg` as one frame.
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    let payload = postcard::to_stdvec(msg).map_err(|e| WireError::Malformed(e.to_string()))?;
    if payload.len() > MAX_FRAME_BYTES {
        return Err(WireError::TooLong(payload.len()));
    }
    let mut buf = Vec::with_capacity(8 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    buf.extend_from_slice(&payload);
    Ok(buf)
}

/// Writes `msg` as one frame.
pub async fn write_msg<W, T>(w: &mut W, msg: &T) -> Result<(), WireError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let buf = encode_frame(msg)?;
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Largest frame read before the peer has proved the key: the handshake's messages are
/// under 100 bytes, and a stranger must not make us allocate more.
pub const HANDSHAKE_FRAME_MAX: usize = 256;

/// Reads one frame and decodes it as `T`.
pub async fn read_msg<R, T>(r: &mut R) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    read_msg_max(r, MAX_FRAME_BYTES).await
}

/// Reads one frame of at most `max` bytes and decodes it as `T`.
pub async fn read_msg_max<R, T>(r: &mut R, max: usize) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut head = [0u8; 8];
    r.read_exact(&mut head).await?;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len > max {
        return Err(WireError::TooLong(len));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    if crc32c::crc32c(&payload) != crc {
        return Err(WireError::BadChecksum);
    }
    postcard::from_bytes(&payload).map_err(|e| WireError::Malformed(e.to_string()))
}

#[derive(Serialize, Deserialize)]
struct Hello {
    magic: u64,
    version: u32,
    nonce: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Challenge {
    nonce: [u8; 32],
    proof: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Proof {
    proof: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Welcome {
    ok: bool,
}

fn mac(key: &ClusterKey, label: &[u8], dialer: &[u8; 32], acceptor: &[u8; 32]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(label);
    m.update(dialer);
    m.update(acceptor);
    m
}

fn prove(key: &ClusterKey, label: &[u8], dialer: &[u8; 32], acceptor: &[u8; 32]) -> [u8; 32] {
    mac(key, label, dialer, acceptor)
        .finalize()
        .into_bytes()
        .into()
}

fn verify(
    key: &ClusterKey,
    label: &[u8],
    dialer: &[u8; 32],
    acceptor: &[u8; 32],
    proof: &[u8; 32],
) -> bool {
    mac(key, label, dialer, acceptor)
        .verify_slice(proof)
        .is_ok()
}

fn nonce() -> Result<[u8; 32], WireError> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| WireError::Io(std::io::Error::other(e.to_string())))?;
    Ok(n)
}

/// The dialer's half of the handshake.
pub async fn handshake_dial<S>(s: &mut S, key: &ClusterKey) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let run = async {
        let mine = nonce()?;
        let hello = Hello {
            magic: MAGIC,
            version: VERSION,
            nonce: mine,
        };
        write_msg(s, &hello).await?;
        let ch: Challenge = read_msg_max(s, HANDSHAKE_FRAME_MAX).await?;
        if !verify(key, LABEL_ACCEPTOR, &mine, &ch.nonce, &ch.proof) {
            return Err(WireError::Auth("the replica does not hold our cluster key"));
        }
        let proof = Proof {
            proof: prove(key, LABEL_DIALER, &mine, &ch.nonce),
        };
        write_msg(s, &proof).await?;
        let w: Welcome = read_msg_max(s, HANDSHAKE_FRAME_MAX).await?;
        if !w.ok {
            return Err(WireError::Auth("the replica refused our cluster key"));
        }
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| WireError::Timeout)?
}

/// The acceptor's half of the handshake.
pub async fn handshake_accept<S>(s: &mut S, key: &ClusterKey) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let run = async {
        let hello: Hello = read_msg_max(s, HANDSHAKE_FRAME_MAX).await?;
        if hello.magic != MAGIC || hello.version != VERSION {
            return Err(WireError::Auth("not a kochab coordinator peer"));
        }
        let mine = nonce()?;
        let ch = Challenge {
            nonce: mine,
            proof: prove(key, LABEL_ACCEPTOR, &hello.nonce, &mine),
        };
        write_msg(s, &ch).await?;
        let p: Proof = read_msg_max(s, HANDSHAKE_FRAME_MAX).await?;
        let ok = verify(key, LABEL_DIALER, &hello.nonce, &mine, &p.proof);
        write_msg(s, &Welcome { ok }).await?;
        if !ok {
            return Err(WireError::Auth("peer does not hold the cluster key"));
        }
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| WireError::Timeout)?
}

/// Parses a key file's contents: 64 hex digits, surrounding whitespace ignored (the same
/// format `kochab` writes for its cluster key).
pub fn key_from_hex(s: &str) -> Option<ClusterKey> {
    let s = s.trim();
    if s.len() != CLUSTER_KEY_BYTES * 2 || !s.is_ascii() {
        return None;
    }
    let mut key = [0u8; CLUSTER_KEY_BYTES];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(key)
}

/// Reads a key file.
pub fn load_key_file(path: &Path) -> std::io::Result<ClusterKey> {
    let text = std::fs::read_to_string(path)?;
    key_from_hex(&text).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: not a cluster key (64 hex digits)", path.display()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handshake_both_ways() {
        let key = [3u8; 32];
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (x, y) = tokio::join!(handshake_dial(&mut a, &key), handshake_accept(&mut b, &key));
        assert!(x.is_ok() && y.is_ok());
    }

    #[tokio::test]
    async fn wrong_key_refused_on_both_sides() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (x, y) = tokio::join!(
            handshake_dial(&mut a, &[1u8; 32]),
            handshake_accept(&mut b, &[2u8; 32])
        );
        assert!(matches!(x, Err(WireError::Auth(_))));
        // The acceptor never sends a welcome the dialer could trust; it closes.
        assert!(y.is_err());
    }

    #[tokio::test]
    async fn corrupt_frame_is_an_error() {
        let mut buf = encode_frame(&(7u64, "hello".to_string())).unwrap();
        let last = buf.len() - 1;
        buf[last] ^= 1;
        let mut r = &buf[..];
        let got: Result<(u64, String), _> = read_msg(&mut r).await;
        assert!(matches!(got, Err(WireError::BadChecksum)));
        // A stranger's huge length is refused before any allocation.
        let mut big = Vec::new();
        big.extend_from_slice(&(10_000u32).to_le_bytes());
        big.extend_from_slice(&[0u8; 4]);
        let mut r = &big[..];
        let got: Result<u64, _> = read_msg_max(&mut r, HANDSHAKE_FRAME_MAX).await;
        assert!(matches!(got, Err(WireError::TooLong(10_000))));
        let huge = [0xffu8; 8];
        let mut r = &huge[..];
        let got: Result<u64, _> = read_msg(&mut r).await;
        assert!(matches!(got, Err(WireError::TooLong(_))));
    }

    #[test]
    fn key_parse() {
        assert_eq!(key_from_hex(&"ab".repeat(32)), Some([0xab; 32]));
        assert_eq!(key_from_hex("zz"), None);
    }
}
