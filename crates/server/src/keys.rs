//! The cluster's keys: the cluster key (id 0, the admin key, in `cluster.key`) and the client
//! keys made with `kochab key add`, each with the policy (root squash, id ranges) the server
//! applies to its requests. Client keys live in `keys.json` in the data directory (mode
//! 0600, replaced atomically and fsynced on every change); revoked keys stay there so that
//! their ids are never reused.

use kochab_proto::auth::{ADMIN_KEY_ID, ClusterKey, KeyId, key_from_hex, key_to_hex};
use kochab_proto::{FsError, KEY_NOTE_MAX, KeyInfo, KeyPolicy, fs_err};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::watch;

/// File of the client keys inside the data directory.
pub const KEYS_FILE: &str = "keys.json";

/// Most client keys a cluster holds, revoked ones included (one per machine or service is
/// the expected use; each is a line of `keys.json`, rewritten whole on every change, so the
/// file stays small). Past it `kochab key add` fails with ENOSPC.
pub const KEYS_MAX: usize = 4096;

/// One key as the server holds it while serving.
pub struct KeyEntry {
    pub id: KeyId,
    pub key: ClusterKey,
    pub policy: KeyPolicy,
    revoked: AtomicBool,
}

impl KeyEntry {
    /// True once the key is revoked: its connections close and it authenticates no more.
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

#[derive(Serialize, Deserialize)]
struct StoredKey {
    id: KeyId,
    key: String,
    policy: KeyPolicy,
    revoked: bool,
    #[serde(default)]
    note: String,
}

#[derive(Serialize, Deserialize, Default)]
struct KeysFile {
    next_id: KeyId,
    keys: Vec<StoredKey>,
}

struct Inner {
    next_id: KeyId,
    keys: BTreeMap<KeyId, (Arc<KeyEntry>, String)>,
}

/// Every key of the cluster.
pub struct KeyStore {
    dir: PathBuf,
    admin: Arc<KeyEntry>,
    inner: Mutex<Inner>,
    /// Bumped on every revocation: connection tasks wait on it and close if their key went.
    revocations: watch::Sender<u64>,
}

impl KeyStore {
    /// Loads the client keys of data directory `dir` (none if it has no keys file).
    pub fn load(dir: &Path, admin: ClusterKey) -> io::Result<KeyStore> {
        let path = dir.join(KEYS_FILE);
        let file: KeysFile = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", path.display()))
            })?,
            Err(e) if e.kind() == ErrorKind::NotFound => KeysFile::default(),
            Err(e) => return Err(e),
        };
        let mut keys = BTreeMap::new();
        for k in file.keys {
            let key = key_from_hex(&k.key).ok_or_else(|| {
                io::Error::new(
                    ErrorKind::InvalidData,
                    format!("{}: key {} is not 64 hex digits", path.display(), k.id),
                )
            })?;
            if k.id == ADMIN_KEY_ID || k.id >= file.next_id {
                return Err(io::Error::new(
                    ErrorKind::InvalidData,
                    format!("{}: key id {} is not a client key's", path.display(), k.id),
                ));
            }
            let entry = KeyEntry {
                id: k.id,
                key,
                policy: k.policy,
                revoked: AtomicBool::new(k.revoked),
            };
            keys.insert(k.id, (Arc::new(entry), k.note));
        }
        Ok(KeyStore {
            dir: dir.to_path_buf(),
            admin: Arc::new(KeyEntry {
                id: ADMIN_KEY_ID,
                key: admin,
                policy: KeyPolicy::TRUSTED,
                revoked: AtomicBool::new(false),
            }),
            inner: Mutex::new(Inner {
                next_id: file.next_id.max(1),
                keys,
            }),
            revocations: watch::channel(0).0,
        })
    }

    /// The cluster key.
    pub fn admin(&self) -> &Arc<KeyEntry> {
        &self.admin
    }

    /// The key with id `id`, revoked or not; `None` if there is none.
    pub fn get(&self, id: KeyId) -> Option<Arc<KeyEntry>> {
        if id == ADMIN_KEY_ID {
            return Some(self.admin.clone());
        }
        self.inner.lock().keys.get(&id).map(|(k, _)| k.clone())
    }

    /// Changes whenever a key is revoked.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.revocations.subscribe()
    }

    /// Makes a new client key, durably, and returns it (blocking: writes and fsyncs).
    pub fn add(&self, policy: KeyPolicy, note: &str) -> Result<(KeyId, ClusterKey), FsError> {
        if note.len() > KEY_NOTE_MAX {
            return Err(fs_err!(
                EINVAL,
                "a key's note has at most {KEY_NOTE_MAX} bytes"
            ));
        }
        if let (Some(r), _) | (_, Some(r)) = (policy.uids, policy.gids)
            && r.lo > r.hi
        {
            return Err(fs_err!(EINVAL, "id range {}-{} is empty", r.lo, r.hi));
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| fs_err!(EIO, "no randomness: {e}"))?;
        let mut inner = self.inner.lock();
        if inner.keys.len() >= KEYS_MAX || inner.next_id == KeyId::MAX {
            return Err(fs_err!(
                ENOSPC,
                "the cluster holds {KEYS_MAX} keys, the most it may"
            ));
        }
        let id = inner.next_id;
        let entry = Arc::new(KeyEntry {
            id,
            key,
            policy,
            revoked: AtomicBool::new(false),
        });
        inner.next_id += 1;
        inner.keys.insert(id, (entry, note.to_string()));
        if let Err(e) = self.persist(&inner) {
            // Not durable, so not made: a key must never work that a restart forgets.
            inner.keys.remove(&id);
            inner.next_id -= 1;
            return Err(fs_err!(EIO, "cannot save {}: {e}", KEYS_FILE));
        }
        Ok((id, key))
    }

    /// The client keys, without their secrets.
    pub fn list(&self) -> Vec<KeyInfo> {
        self.inner
            .lock()
            .keys
            .values()
            .map(|(k, note)| KeyInfo {
                id: k.id,
                policy: k.policy,
                revoked: k.is_revoked(),
                note: note.clone(),
            })
            .collect()
    }

    /// Revokes a client key, durably (blocking), and closes its connections at once.
    pub fn revoke(&self, id: KeyId) -> Result<(), FsError> {
        if id == ADMIN_KEY_ID {
            return Err(fs_err!(
                EINVAL,
                "the cluster key cannot be revoked (make a new cluster to replace it)"
            ));
        }
        let inner = self.inner.lock();
        let Some((entry, _)) = inner.keys.get(&id) else {
            return Err(fs_err!(ENOENT, "no key {id}"));
        };
        let entry = entry.clone();
        // Refused at once, even if saving fails (a revocation errs on the safe side).
        entry.revoked.store(true, Ordering::Release);
        self.revocations.send_modify(|n| *n += 1);
        self.persist(&inner).map_err(|e| {
            fs_err!(
                EIO,
                "key {id} is revoked until the server restarts, but cannot save {KEYS_FILE}: {e}"
            )
        })
    }

    /// Writes the keys file whole: a temporary file (0600), fsync, rename, fsync of the
    /// directory, so a crash leaves the old or the new file, never a torn one.
    fn persist(&self, inner: &Inner) -> io::Result<()> {
        let file = KeysFile {
            next_id: inner.next_id,
            keys: inner
                .keys
                .values()
                .map(|(k, note)| StoredKey {
                    id: k.id,
                    key: key_to_hex(&k.key),
                    policy: k.policy,
                    revoked: k.is_revoked(),
                    note: note.clone(),
                })
                .collect(),
        };
        let json = serde_json::to_vec_pretty(&file).map_err(io::Error::other)?;
        let tmp = self.dir.join(format!("{KEYS_FILE}.tmp"));
        let _ = fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join(KEYS_FILE))?;
        fs::File::open(&self.dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::{Errno, Squash};

    #[test]
    fn keys_survive_a_reload_and_revocation_is_durable() {
        let d = tempfile::tempdir().unwrap();
        let s = KeyStore::load(d.path(), [1; 32]).unwrap();
        let policy = KeyPolicy {
            squash: Squash::Root,
            ..KeyPolicy::TRUSTED
        };
        let (a, ka) = s.add(policy, "a").unwrap();
        let (b, _) = s.add(policy, "b").unwrap();
        assert_eq!((a, b), (1, 2));
        let rx = s.subscribe();
        s.revoke(a).unwrap();
        assert!(rx.has_changed().unwrap());
        assert!(s.get(a).unwrap().is_revoked());
        assert_eq!(s.revoke(ADMIN_KEY_ID).unwrap_err().errno, Errno::EINVAL);
        assert_eq!(s.revoke(9).unwrap_err().errno, Errno::ENOENT);
        let again = KeyStore::load(d.path(), [1; 32]).unwrap();
        let ea = again.get(a).unwrap();
        assert!(ea.is_revoked());
        assert_eq!(ea.key, ka);
        assert_eq!(ea.policy.squash, Squash::Root);
        assert!(!again.get(b).unwrap().is_revoked());
        assert_eq!(again.add(policy, "c").unwrap().0, 3, "ids are never reused");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(d.path().join(KEYS_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
