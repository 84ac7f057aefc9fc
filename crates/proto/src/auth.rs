//! Connection authentication. Both ends prove a key by HMAC-SHA256 over both nonces, so the
//! key itself never crosses the wire and neither end can be impersonated by someone without
//! it: the client proves it holds key `key_id` against the server's nonce, and the server
//! proves it holds the same key against the client's nonce (a spoofed server that does not
//! know the key cannot produce the proof, so the client never uses it).
//!
//! Keys have ids. Id 0 is the cluster key (the admin key, written by `kochab up` into its
//! data directory); the others are client keys made with `kochab key add`, each with its
//! own squash rule (see [`crate::types::KeyPolicy`]).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes of a key.
pub const KEY_BYTES: usize = 32;

/// A random 64-bit name (a client's id, a server process's nonce): from the OS, or without
/// OS randomness from the time and pid, which still differ between processes.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(b)
}

/// A key (the cluster key or a client key).
pub type ClusterKey = [u8; KEY_BYTES];

/// Names a key among a cluster's keys.
pub type KeyId = u32;

/// The cluster key's id: the admin key, which alone may add, list and revoke keys.
pub const ADMIN_KEY_ID: KeyId = 0;

/// A key with its id, as a client presents it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ClientKey {
    pub id: KeyId,
    pub key: ClusterKey,
}

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key bytes: Debug output ends up in logs.
        write!(f, "ClientKey {{ id: {} }}", self.id)
    }
}

impl ClientKey {
    /// The cluster (admin) key.
    pub fn admin(key: ClusterKey) -> ClientKey {
        ClientKey {
            id: ADMIN_KEY_ID,
            key,
        }
    }
}

impl From<ClusterKey> for ClientKey {
    fn from(key: ClusterKey) -> ClientKey {
        ClientKey::admin(key)
    }
}

/// The inputs both proofs of one handshake cover.
#[derive(Clone, Copy, Debug)]
pub struct Transcript {
    pub server_nonce: [u8; 32],
    pub client_nonce: [u8; 32],
    pub key_id: KeyId,
    pub client_id: u64,
}

/// Domain separation: a client proof can never be replayed as a server proof.
const CLIENT_ROLE: &[u8] = b"kochab client proof v2";
const SERVER_ROLE: &[u8] = b"kochab server proof v2";
const SESSION_ROLE: &[u8] = b"kochab session id v2";
const REPLAY_KEY_ROLE: &[u8] = b"kochab replay tag key v1";
const KEY_CHECK_ROLE: &[u8] = b"kochab cluster key check v1";

fn mac_for(key: &ClusterKey, role: &[u8], t: &Transcript) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(role);
    m.update(&t.server_nonce);
    m.update(&t.client_nonce);
    m.update(&t.key_id.to_le_bytes());
    m.update(&t.client_id.to_le_bytes());
    m
}

/// The proof a client sends.
pub fn prove_client(key: &ClusterKey, t: &Transcript) -> [u8; 32] {
    mac_for(key, CLIENT_ROLE, t).finalize().into_bytes().into()
}

/// Checks a client's proof in constant time.
pub fn verify_client(key: &ClusterKey, t: &Transcript, proof: &[u8; 32]) -> bool {
    mac_for(key, CLIENT_ROLE, t).verify_slice(proof).is_ok()
}

/// The proof a server sends back once the client's proof checked.
pub fn prove_server(key: &ClusterKey, t: &Transcript) -> [u8; 32] {
    mac_for(key, SERVER_ROLE, t).finalize().into_bytes().into()
}

/// Checks a server's proof in constant time.
pub fn verify_server(key: &ClusterKey, t: &Transcript, proof: &[u8; 32]) -> bool {
    mac_for(key, SERVER_ROLE, t).verify_slice(proof).is_ok()
}

/// The session a server keeps for client `client_id` authenticated with key `key_id`: a
/// keyed hash under the cluster key, so the same client id presented with another key
/// names another session (its handles, locks and reply cache are out of reach), and the
/// id is the same after a server restart (the reply cache outlives one).
pub fn session_id(cluster_key: &ClusterKey, key_id: KeyId, client_id: u64) -> u64 {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(cluster_key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(SESSION_ROLE);
    m.update(&key_id.to_le_bytes());
    m.update(&client_id.to_le_bytes());
    let h = m.finalize().into_bytes();
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    u64::from_le_bytes(b)
}

/// What a cluster's store records of its key: a keyed hash of the cluster's id under the
/// key, so a server given another key is refused at start, and the store (which anyone
/// with the bucket's credentials reads) tells nothing of the key itself.
pub fn key_check(cluster_key: &ClusterKey, cluster_id: u64) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(cluster_key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(KEY_CHECK_ROLE);
    m.update(&cluster_id.to_le_bytes());
    m.finalize().into_bytes().into()
}

/// Bytes of a replay tag: HMAC-SHA256 truncated to 128 bits (RFC 2104 allows truncation to
/// half the hash; a forger has one guess per request, and 2^-128 per guess).
pub const REPLAY_TAG_BYTES: usize = 16;

/// What an early (`Unsafe`) reply carries and a replay of its request sends back: the
/// servers' proof that they answered that request of that session early (see
/// [`ReplayKey`]).
pub type ReplayTag = [u8; REPLAY_TAG_BYTES];

/// The servers' key for replay tags: derived from the cluster key with its own role, so
/// every server of a cluster (the one that replays after a failover too) computes and
/// checks the same tags, and no client key, proof or session id can stand in for one.
#[derive(Clone)]
pub struct ReplayKey(Hmac<Sha256>);

impl std::fmt::Debug for ReplayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayKey")
    }
}

/// What a replay tag covers: the request as the server saw it and what its reply created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayTagInput {
    /// The session the server keeps for the client's key and client id (`session_id`).
    pub session: u64,
    /// The request's reply-cache sequence number (0: none).
    pub seq: u64,
    /// The inode the reply created or named (`Reply::created`), which a replay may ask for.
    pub created: u64,
    /// The operation's kind (`Op::index`).
    pub op: u8,
    /// The inode the request is routed by (`Op::replay_route`).
    pub route: u64,
}

impl ReplayKey {
    /// The replay key of a cluster.
    pub fn derive(cluster_key: &ClusterKey) -> ReplayKey {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(cluster_key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(REPLAY_KEY_ROLE);
        let derived = m.finalize().into_bytes();
        ReplayKey(
            <Hmac<Sha256> as KeyInit>::new_from_slice(&derived)
                .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length")),
        )
    }

    fn mac(&self, t: &ReplayTagInput) -> Hmac<Sha256> {
        // The keyed state is cloned: one key schedule per server, not per reply.
        let mut m = self.0.clone();
        m.update(&t.session.to_le_bytes());
        m.update(&t.seq.to_le_bytes());
        m.update(&t.created.to_le_bytes());
        m.update(&[t.op]);
        m.update(&t.route.to_le_bytes());
        m
    }

    /// The tag of an early reply.
    pub fn tag(&self, t: &ReplayTagInput) -> ReplayTag {
        let full = self.mac(t).finalize().into_bytes();
        let mut tag = [0u8; REPLAY_TAG_BYTES];
        tag.copy_from_slice(&full[..REPLAY_TAG_BYTES]);
        tag
    }

    /// Checks a replay's tag in constant time.
    pub fn verify(&self, t: &ReplayTagInput, tag: &ReplayTag) -> bool {
        self.mac(t).verify_truncated_left(tag).is_ok()
    }
}

/// Bytes of the random nonce a sealed client key carries.
pub const SEAL_NONCE_BYTES: usize = 16;

const SEAL_ROLE: &[u8] = b"kochab client key seal v1";

/// Seals a client key's secret under the cluster key, or opens a sealed one (the same
/// operation): XOR with HMAC-SHA256(cluster key, label, `nonce`), a one-time pad as long
/// as `nonce` is used once (each key draws its own at random). A cluster keeps its client
/// keys in the coordinator's replicated state this way: the Raft log, its snapshots and
/// the coordinator's traffic hold no usable secret for anyone without the cluster key,
/// which can do everything the client keys can anyway.
pub fn seal_client_key(
    cluster_key: &ClusterKey,
    nonce: &[u8; SEAL_NONCE_BYTES],
    secret: &ClusterKey,
) -> ClusterKey {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(cluster_key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(SEAL_ROLE);
    m.update(nonce);
    let pad: [u8; KEY_BYTES] = m.finalize().into_bytes().into();
    std::array::from_fn(|i| secret[i] ^ pad[i])
}

/// Hex form of a key, as stored in the cluster key file.
pub fn key_to_hex(key: &ClusterKey) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses 64 hex digits (surrounding whitespace ignored).
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

/// A key file's text: `ID:HEX` for a client key, plain `HEX` for the cluster key (id 0).
pub fn client_key_to_text(k: &ClientKey) -> String {
    if k.id == ADMIN_KEY_ID {
        key_to_hex(&k.key)
    } else {
        format!("{}:{}", k.id, key_to_hex(&k.key))
    }
}

/// Parses a key file's text (see [`client_key_to_text`]).
pub fn client_key_from_text(s: &str) -> Option<ClientKey> {
    let s = s.trim();
    match s.split_once(':') {
        Some((id, hex)) => Some(ClientKey {
            id: id.trim().parse().ok()?,
            key: key_from_hex(hex)?,
        }),
        None => Some(ClientKey::admin(key_from_hex(s)?)),
    }
}

const GRANT_KEY_ROLE: &[u8] = b"kochab slice commit token key v1";

/// Bytes of a commit token (see [`GrantKey`]): 128 bits, as a replay tag.
pub const GRANT_TOKEN_BYTES: usize = 16;

/// What a commit token covers: the client key the grant was made for, the file generation,
/// the object it lets the client commit, and the grant's expiry (Unix seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantTokenInput {
    pub key_id: u32,
    pub id: u64,
    pub generation: u64,
    pub object: u64,
    pub expires: u64,
}

/// The servers' key for commit tokens of slice grants (issue 31): derived from the cluster
/// key with its own role, so that any server of the cluster verifies a token another made
/// (a commit replayed after a failover too) without keeping grant state, and no replay tag,
/// proof or session id can stand in for a token.
#[derive(Clone)]
pub struct GrantKey(Hmac<Sha256>);

impl std::fmt::Debug for GrantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantKey")
    }
}

impl GrantKey {
    /// The grant key of a cluster.
    pub fn derive(cluster_key: &ClusterKey) -> GrantKey {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(cluster_key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(GRANT_KEY_ROLE);
        let derived = m.finalize().into_bytes();
        GrantKey(
            <Hmac<Sha256> as KeyInit>::new_from_slice(&derived)
                .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length")),
        )
    }

    fn mac(&self, t: &GrantTokenInput) -> Hmac<Sha256> {
        let mut m = self.0.clone();
        m.update(&t.key_id.to_le_bytes());
        m.update(&t.id.to_le_bytes());
        m.update(&t.generation.to_le_bytes());
        m.update(&t.object.to_le_bytes());
        m.update(&t.expires.to_le_bytes());
        m
    }

    /// The commit token of one granted object.
    pub fn token(&self, t: &GrantTokenInput) -> Vec<u8> {
        self.mac(t).finalize().into_bytes()[..GRANT_TOKEN_BYTES].to_vec()
    }

    /// Checks a token in constant time (a token of the wrong length never verifies).
    pub fn verify(&self, t: &GrantTokenInput, token: &[u8]) -> bool {
        token.len() == GRANT_TOKEN_BYTES && self.mac(t).verify_truncated_left(token).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(key_id: KeyId, client_id: u64) -> Transcript {
        Transcript {
            server_nonce: [9u8; 32],
            client_nonce: [3u8; 32],
            key_id,
            client_id,
        }
    }

    #[test]
    fn proofs_bind_both_nonces_the_key_and_the_role() {
        let key = [7u8; 32];
        let p = prove_client(&key, &t(1, 42));
        assert!(verify_client(&key, &t(1, 42), &p));
        assert!(!verify_client(&key, &t(1, 43), &p));
        assert!(!verify_client(&key, &t(2, 42), &p));
        assert!(!verify_client(&[8u8; 32], &t(1, 42), &p));
        let mut other = t(1, 42);
        other.client_nonce = [4u8; 32];
        assert!(!verify_client(&key, &other, &p));
        // A server cannot echo the client's proof back as its own.
        assert!(!verify_server(&key, &t(1, 42), &p));
        let s = prove_server(&key, &t(1, 42));
        assert!(verify_server(&key, &t(1, 42), &s));
        assert!(!verify_server(&[8u8; 32], &t(1, 42), &s));
    }

    #[test]
    fn key_text_and_sessions() {
        let key = [7u8; 32];
        assert_eq!(key_from_hex(&key_to_hex(&key)), Some(key));
        assert_eq!(key_from_hex("zz"), None);
        let admin = ClientKey::admin(key);
        assert_eq!(
            client_key_from_text(&client_key_to_text(&admin)),
            Some(admin)
        );
        let client = ClientKey { id: 5, key };
        assert_eq!(
            client_key_from_text(&format!("{}\n", client_key_to_text(&client))),
            Some(client)
        );
        assert_eq!(client_key_from_text("x:00"), None);
        assert!(!format!("{client:?}").contains("0707"));
        assert_ne!(session_id(&key, 1, 42), session_id(&key, 2, 42));
        assert_eq!(session_id(&key, 1, 42), session_id(&key, 1, 42));
    }

    #[test]
    fn replay_tags_bind_every_input_and_the_cluster_key() {
        let key = ReplayKey::derive(&[7u8; 32]);
        let t = ReplayTagInput {
            session: 1,
            seq: 2,
            created: 3,
            op: 4,
            route: 5,
        };
        let tag = key.tag(&t);
        assert!(key.verify(&t, &tag));
        assert!(ReplayKey::derive(&[7u8; 32]).verify(&t, &tag), "any server");
        assert!(!ReplayKey::derive(&[8u8; 32]).verify(&t, &tag));
        for other in [
            ReplayTagInput { session: 9, ..t },
            ReplayTagInput { seq: 9, ..t },
            ReplayTagInput { created: 9, ..t },
            ReplayTagInput { op: 9, ..t },
            ReplayTagInput { route: 9, ..t },
        ] {
            assert!(!key.verify(&other, &tag), "{other:?}");
        }
        assert!(!key.verify(&t, &[0u8; REPLAY_TAG_BYTES]));
    }

    #[test]
    fn a_sealed_client_key_opens_only_under_its_cluster_key_and_nonce() {
        let (cluster, secret) = ([7u8; 32], [42u8; 32]);
        let sealed = seal_client_key(&cluster, &[1; 16], &secret);
        assert_ne!(sealed, secret);
        assert_eq!(seal_client_key(&cluster, &[1; 16], &sealed), secret);
        assert_ne!(seal_client_key(&[8u8; 32], &[1; 16], &sealed), secret);
        assert_ne!(seal_client_key(&cluster, &[2; 16], &sealed), secret);
        assert_ne!(seal_client_key(&cluster, &[2; 16], &secret), sealed);
    }

    #[test]
    fn a_grant_token_verifies_only_for_what_it_was_made_for() {
        let key = GrantKey::derive(&[7u8; 32]);
        let t = GrantTokenInput {
            key_id: 3,
            id: 0x1234,
            generation: 9,
            object: 0xabc,
            expires: 1_000,
        };
        let token = key.token(&t);
        assert_eq!(token.len(), GRANT_TOKEN_BYTES);
        assert!(key.verify(&t, &token));
        for other in [
            GrantTokenInput { key_id: 4, ..t },
            GrantTokenInput { id: 0x1235, ..t },
            GrantTokenInput {
                generation: 10,
                ..t
            },
            GrantTokenInput { object: 0xabd, ..t },
            GrantTokenInput {
                expires: 1_001,
                ..t
            },
        ] {
            assert!(!key.verify(&other, &token), "{other:?}");
        }
        assert!(!key.verify(&t, &token[..8]));
        assert!(!GrantKey::derive(&[8u8; 32]).verify(&t, &token));
    }
}
