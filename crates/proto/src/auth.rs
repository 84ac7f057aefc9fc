//! Connection authentication: proof of the cluster key by HMAC-SHA256 over a server nonce,
//! so the key itself never crosses the wire.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes of a cluster key.
pub const KEY_BYTES: usize = 32;

/// A cluster key.
pub type ClusterKey = [u8; KEY_BYTES];

fn mac_for(key: &ClusterKey, nonce: &[u8; 32], client_id: u64) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(nonce);
    m.update(&client_id.to_le_bytes());
    m
}

/// The proof a client sends for `nonce`.
pub fn prove(key: &ClusterKey, nonce: &[u8; 32], client_id: u64) -> [u8; 32] {
    mac_for(key, nonce, client_id)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a client's proof in constant time.
pub fn verify(key: &ClusterKey, nonce: &[u8; 32], client_id: u64, proof: &[u8; 32]) -> bool {
    mac_for(key, nonce, client_id).verify_slice(proof).is_ok()
}

/// Hex form of a key, as stored in the key file.
pub fn key_to_hex(key: &ClusterKey) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a key file's contents (64 hex digits, surrounding whitespace ignored).
pub fn key_from_hex(s: &str) -> Option<ClusterKey> {
    let s = s.trim();
    if s.len() != KEY_BYTES * 2 || !s.is_ascii() {
        return None;
    }
    let mut key = [0u8; KEY_BYTES];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs() {
        let key = [7u8; 32];
        let nonce = [9u8; 32];
        let p = prove(&key, &nonce, 42);
        assert!(verify(&key, &nonce, 42, &p));
        assert!(!verify(&key, &nonce, 43, &p));
        assert!(!verify(&[8u8; 32], &nonce, 42, &p));
        assert_eq!(key_from_hex(&key_to_hex(&key)), Some(key));
        assert_eq!(key_from_hex("zz"), None);
    }
}
