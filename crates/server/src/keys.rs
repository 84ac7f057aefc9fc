//! The cluster's keys: the cluster key (id 0, the admin key, in `cluster.key`) and the client
//! keys made with `kochab key add`, each with the policy (root squash, id ranges) the server
//! applies to its requests.
//!
//! Where the client keys live depends on the server:
//! - A single server (`kochab up`) keeps them in `keys.json` in its data directory (mode
//!   0600, replaced atomically and fsynced on every change); revoked keys stay there so
//!   that their ids are never reused.
//! - A cluster's member server (`kochab mds`) holds a copy of the coordinator's (see
//!   `kochab_cluster::keys`): it is changed only by [`KeyStore::apply_cluster`] with what
//!   the coordinator's state says, in version order, and never written to disk here;
//!   `kochab key` requests are forwarded to the coordinator (`cluster_host`).

use kochab_cluster::keys::ClientKeys;
use kochab_proto::auth::{ADMIN_KEY_ID, ClusterKey, KeyId, key_from_hex, key_to_hex};
use kochab_proto::{FsError, KeyInfo, KeyPolicy, check_new_key, fs_err};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::sync::watch;

pub use kochab_proto::KEYS_MAX;

/// File of the client keys inside the data directory.
pub const KEYS_FILE: &str = "keys.json";

/// One key as the server holds it while serving.
pub struct KeyEntry {
    pub id: KeyId,
    pub key: ClusterKey,
    pub policy: KeyPolicy,
    revoked: AtomicBool,
    /// Connections that looked this key up and are not closed yet.
    conns: AtomicUsize,
}

impl KeyEntry {
    fn new(id: KeyId, key: ClusterKey, policy: KeyPolicy, revoked: bool) -> KeyEntry {
        KeyEntry {
            id,
            key,
            policy,
            revoked: AtomicBool::new(revoked),
            conns: AtomicUsize::new(0),
        }
    }

    /// True once the key is revoked: its connections close and it authenticates no more.
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// Counts a connection with this key until the returned guard is dropped. Taken
    /// before the connection checks [`KeyEntry::is_revoked`]: a revocation that finds no
    /// connection counted is then seen by every later one.
    pub fn connection(self: &Arc<Self>) -> KeyConnection {
        self.conns.fetch_add(1, Ordering::SeqCst);
        KeyConnection(self.clone())
    }
}

/// One connection's hold on its key (see [`KeyEntry::connection`]).
pub struct KeyConnection(Arc<KeyEntry>);

impl Drop for KeyConnection {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, Ordering::SeqCst);
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

/// A client key as a single server's key file holds it.
pub struct FileKey {
    pub id: KeyId,
    pub key: ClusterKey,
    pub policy: KeyPolicy,
    pub revoked: bool,
    pub note: String,
}

/// The client keys of data directory `dir`'s key file and the next id it would give
/// (none and 1 if it has no key file).
pub fn read_keys_file(dir: &Path) -> io::Result<(KeyId, Vec<FileKey>)> {
    let path = dir.join(KEYS_FILE);
    let file: KeysFile = match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", path.display()))
        })?,
        Err(e) if e.kind() == ErrorKind::NotFound => KeysFile::default(),
        Err(e) => return Err(e),
    };
    let mut keys = Vec::with_capacity(file.keys.len());
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
        keys.push(FileKey {
            id: k.id,
            key,
            policy: k.policy,
            revoked: k.revoked,
            note: k.note,
        });
    }
    Ok((file.next_id.max(1), keys))
}

struct Inner {
    next_id: KeyId,
    keys: BTreeMap<KeyId, (Arc<KeyEntry>, String)>,
    /// A member's: the version of the coordinator's client keys applied (0: none yet).
    version: u64,
}

/// Every key of the cluster.
pub struct KeyStore {
    /// The data directory whose key file holds the client keys; `None` for a cluster's
    /// member, whose keys are the coordinator's.
    dir: Option<PathBuf>,
    admin: Arc<KeyEntry>,
    inner: Mutex<Inner>,
    /// Bumped on every revocation: connection tasks wait on it and close if their key went.
    revocations: watch::Sender<u64>,
}

impl KeyStore {
    fn new(dir: Option<PathBuf>, admin: ClusterKey, inner: Inner) -> KeyStore {
        KeyStore {
            dir,
            admin: Arc::new(KeyEntry::new(
                ADMIN_KEY_ID,
                admin,
                KeyPolicy::TRUSTED,
                false,
            )),
            inner: Mutex::new(inner),
            revocations: watch::channel(0).0,
        }
    }

    /// Loads the client keys of data directory `dir` (none if it has no keys file).
    pub fn load(dir: &Path, admin: ClusterKey) -> io::Result<KeyStore> {
        let (next_id, file) = read_keys_file(dir)?;
        let keys = file
            .into_iter()
            .map(|k| {
                let entry = KeyEntry::new(k.id, k.key, k.policy, k.revoked);
                (k.id, (Arc::new(entry), k.note))
            })
            .collect();
        let inner = Inner {
            next_id,
            keys,
            version: 0,
        };
        Ok(KeyStore::new(Some(dir.to_path_buf()), admin, inner))
    }

    /// A cluster member's keys: only the cluster key until [`KeyStore::apply_cluster`].
    pub fn for_cluster(admin: ClusterKey) -> KeyStore {
        let inner = Inner {
            next_id: 1,
            keys: BTreeMap::new(),
            version: 0,
        };
        KeyStore::new(None, admin, inner)
    }

    /// Takes the coordinator's client keys if they are newer than those held (versions
    /// only grow, so an older read changes nothing). A key revoked there is refused from
    /// now on and its connections are told to close; a key is never un-revoked. Returns
    /// the version held afterwards.
    pub fn apply_cluster(&self, keys: &ClientKeys) -> u64 {
        let mut inner = self.inner.lock();
        if keys.version <= inner.version {
            return inner.version;
        }
        let mut revoked = false;
        for (id, k) in &keys.keys {
            match inner.keys.get_mut(id) {
                Some((entry, note)) => {
                    if k.revoked && !entry.is_revoked() {
                        entry.revoked.store(true, Ordering::SeqCst);
                        revoked = true;
                    }
                    note.clone_from(&k.note);
                }
                None => {
                    let secret =
                        kochab_proto::auth::seal_client_key(&self.admin.key, &k.nonce, &k.sealed);
                    let entry = KeyEntry::new(*id, secret, k.policy, k.revoked);
                    inner.keys.insert(*id, (Arc::new(entry), k.note.clone()));
                }
            }
        }
        // The coordinator never forgets a key; one it does not list is refused, not kept.
        for (id, (entry, _)) in &inner.keys {
            if !keys.keys.contains_key(id) && !entry.is_revoked() {
                entry.revoked.store(true, Ordering::SeqCst);
                revoked = true;
            }
        }
        inner.version = keys.version;
        inner.next_id = keys.next_id.max(1);
        let version = inner.version;
        drop(inner);
        if revoked {
            self.revocations.send_modify(|n| *n += 1);
        }
        version
    }

    /// The version of the coordinator's client keys applied (a member's; 0 otherwise).
    pub fn version(&self) -> u64 {
        self.inner.lock().version
    }

    /// Connections still open with a revoked key (they are closing).
    pub fn revoked_connections(&self) -> usize {
        self.inner
            .lock()
            .keys
            .values()
            .filter(|(k, _)| k.is_revoked())
            .map(|(k, _)| k.conns.load(Ordering::SeqCst))
            .sum()
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

    /// Makes a new client key, durably, and returns it (blocking: writes and fsyncs). A
    /// single server's only: a cluster's keys change through its coordinator.
    pub fn add(&self, policy: KeyPolicy, note: &str) -> Result<(KeyId, ClusterKey), FsError> {
        let dir = self.file_dir()?;
        check_new_key(&policy, note)?;
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
        let entry = Arc::new(KeyEntry::new(id, key, policy, false));
        inner.next_id += 1;
        inner.keys.insert(id, (entry, note.to_string()));
        if let Err(e) = persist(dir, &inner) {
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

    /// Revokes a client key, durably (blocking), and closes its connections at once. A
    /// single server's only, as [`KeyStore::add`].
    pub fn revoke(&self, id: KeyId) -> Result<(), FsError> {
        let dir = self.file_dir()?;
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
        entry.revoked.store(true, Ordering::SeqCst);
        self.revocations.send_modify(|n| *n += 1);
        persist(dir, &inner).map_err(|e| {
            fs_err!(
                EIO,
                "key {id} is revoked until the server restarts, but cannot save {KEYS_FILE}: {e}"
            )
        })
    }

    /// The directory of the key file, or why there is none.
    fn file_dir(&self) -> Result<&Path, FsError> {
        self.dir.as_deref().ok_or_else(|| {
            fs_err!(
                EINVAL,
                "a cluster's keys are changed through its coordinator, not one server's copy"
            )
        })
    }
}

/// Writes the keys file whole: a temporary file (0600), fsync, rename, fsync of the
/// directory, so a crash leaves the old or the new file, never a torn one.
fn persist(dir: &Path, inner: &Inner) -> io::Result<()> {
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
    let tmp = dir.join(format!("{KEYS_FILE}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&json)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(KEYS_FILE))?;
    fs::File::open(dir)?.sync_all()
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

    #[test]
    fn a_members_keys_follow_the_coordinators_in_version_order() {
        use kochab_proto::cluster::SealedKey;
        let admin = [1; 32];
        let s = KeyStore::for_cluster(admin);
        let secret = [9; 32];
        let nonce = [4; 16];
        let mut state = ClientKeys::default();
        let sealed = SealedKey {
            nonce,
            sealed: kochab_proto::auth::seal_client_key(&admin, &nonce, &secret),
            policy: KeyPolicy::TRUSTED,
            revoked: false,
            note: "n".into(),
        };
        let kochab_proto::cluster::CoordReply::Key { id, .. } = state.add(&sealed, 0) else {
            panic!("not added");
        };
        assert!(s.get(id).is_none());
        assert_eq!(s.apply_cluster(&state), 1);
        let entry = s.get(id).expect("applied");
        assert_eq!(
            entry.key, secret,
            "the secret is unsealed with the cluster key"
        );
        let conn = entry.connection();
        let rx = s.subscribe();
        let older = state.clone();
        state.revoke(id, 1);
        assert_eq!(s.apply_cluster(&state), 2);
        assert!(entry.is_revoked() && rx.has_changed().unwrap());
        assert_eq!(s.revoked_connections(), 1);
        drop(conn);
        assert_eq!(s.revoked_connections(), 0);
        // An older read changes nothing: a revoked key stays revoked.
        assert_eq!(s.apply_cluster(&older), 2);
        assert!(s.get(id).unwrap().is_revoked());
        assert_eq!(
            s.add(KeyPolicy::TRUSTED, "x").unwrap_err().errno,
            Errno::EINVAL
        );
        assert_eq!(s.revoke(id).unwrap_err().errno, Errno::EINVAL);
    }
}
