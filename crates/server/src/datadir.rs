//! The data directory: the cluster key (mode 0600), the cluster description and the object
//! store. Created on first start, read on every later one. The object store is the
//! directory's own (`DIR/store`) or one given (a bucket on S3, `kochab --store`); the
//! cluster description and the servers' epochs live in the store, written by conditional
//! create wherever two hosts could race.

use kochab_meta::{EngineConfig, initial_table_ranges};
use kochab_proto::auth::{ClusterKey, key_from_hex, key_to_hex};
use kochab_store::{LocalStore, ObjectStore, newest_version, versioned_name};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// File name of the cluster key inside the data directory.
pub const KEY_FILE: &str = "cluster.key";
/// File whose lock a server (or an offline repair) holds for as long as it uses the data
/// directory; it holds the holder's pid, for the message the next one gets.
pub const LOCK_FILE: &str = "kochab.lock";
/// Object holding the cluster description.
const CLUSTER_OBJECT: &str = "cluster.json";
/// Object holding the check of the cluster key ([`kochab_proto::auth::key_check`], hex),
/// recorded by conditional create by the first start given a store: every later start,
/// on whatever host, must hold the same key.
const KEY_CHECK_OBJECT: &str = "cluster.keycheck";
/// Object whose presence says every table of the store was released to a cluster of
/// servers (by conditional create, once the release is done): metadata servers serve it,
/// a single server (`kochab up` without --servers) refuses it.
pub const RELEASED_OBJECT: &str = "cluster.released";
/// Object naming who initialises a new cluster in a store (created by conditional create:
/// of several first starts on several hosts, one turns the store over to the cluster and
/// the others wait for [`RELEASED_OBJECT`]).
pub const INIT_CLAIM_OBJECT: &str = "cluster.init";
/// Object holding this server's id and its current epoch (bumped on every start), kept for
/// older versions; the epoch that counts is the newest of [`epoch_base`]'s versions.
const SERVER_OBJECT: &str = "server.json";

/// The versioned object whose newest version is server `id`'s epoch (version = epoch): a
/// start creates the next version if absent, so two starts of one server, on two hosts
/// over one store, never get the same epoch.
fn epoch_base(id: u64) -> String {
    format!("servers/{id}/epoch")
}
/// Attempts at the next epoch when other starts of the same server take each one first
/// (two hosts starting one server at once take one more each; this many is a loop).
const EPOCH_TRIES_MAX: usize = 16;
/// The server id of `kochab up`'s one server, which hosts every table. Ids of servers that
/// join a cluster come from the coordinator (intent, issue 9).
pub const SINGLE_SERVER_ID: u64 = 1;
/// The layout of the data directory this version reads and writes. Bumped whenever an
/// older version's data would be misread; an older directory is refused, never guessed at.
/// 2: chunk 0 at `data/<shard>/<id>.<generation>`, the others in a folder per file
/// generation (`data/<shard>/<id>.<generation>.d/<chunk>`, u64 chunk numbers), reclaim
/// entries without a chunk count, inodes with a "may have data" mark instead of a chunk
/// high-water mark.
/// 3: journals per server incarnation (`journal/<server>.<epoch>/`), records that carry
/// their epoch (24-byte headers, checkpoint images too), versioned manifests
/// (`tables/<id>/manifest.<version>`) naming owner and journals, images named by writer.
pub const DATA_FORMAT: u32 = 3;

/// An exclusive lock on a data directory (flock on [`LOCK_FILE`]), held until dropped. The
/// kernel releases it when the process dies, however it dies, so a crash never leaves a
/// stale lock behind.
pub struct DataDirLock {
    _file: fs::File,
}

impl DataDirLock {
    /// Locks `path` (created with mode 0700 if missing), or fails with `ResourceBusy`
    /// naming the pid of the process that holds it.
    pub fn acquire(path: &Path) -> io::Result<DataDirLock> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)?;
        let lock_path = path.join(LOCK_FILE);
        // Not truncated before the lock is ours: it names the current holder.
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let holder = fs::read_to_string(&lock_path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => "another process".to_string(),
                    pid => format!("process {pid}"),
                };
                return Err(io::Error::new(
                    ErrorKind::ResourceBusy,
                    format!(
                        "data directory {} is in use by {holder} (it holds the lock on {}); \
                         two servers on one directory would destroy each other's journal",
                        path.display(),
                        lock_path.display()
                    ),
                ));
            }
            Err(fs::TryLockError::Error(e)) => return Err(e),
        }
        file.set_len(0)?;
        file.write_all(format!("{}\n", std::process::id()).as_bytes())?;
        Ok(DataDirLock { _file: file })
    }
}

/// What never changes for the life of a cluster.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterMeta {
    pub format: u32,
    pub cluster_id: u64,
    pub server_id: u64,
    pub engine: EngineConfig,
    /// The tables this server hosts.
    pub tables: Vec<(u64, u64)>,
}

/// An opened data directory.
pub struct DataDir {
    pub path: PathBuf,
    pub store: Arc<dyn ObjectStore>,
    /// Where file data goes: the store itself (on a store without positioned I/O, S3, as
    /// immutable slices: `data::slices`), so that every host reaches every file's data.
    pub data_store: Arc<dyn ObjectStore>,
    pub key: ClusterKey,
    pub meta: ClusterMeta,
    /// True if this start created the cluster.
    pub created: bool,
}

/// The store file data goes to (see [`DataDir::data_store`]): `store` itself. Over a store
/// without positioned I/O (S3), an earlier version kept file data in the local store under
/// `dir` (`DIR/store/data`); a directory that still holds some is refused rather than its
/// files read as zeros.
pub fn data_store_for(
    store: &Arc<dyn ObjectStore>,
    dir: &Path,
) -> io::Result<Arc<dyn ObjectStore>> {
    if !store.positioned_io() {
        let local = dir.join("store").join("data");
        let left = match fs::read_dir(&local) {
            Ok(mut entries) => entries.next().is_some(),
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(e) => return Err(e),
        };
        if left {
            return Err(io::Error::new(
                ErrorKind::InvalidData,
                format!(
                    "{} holds file data that an earlier version of kochab kept beside the \
                     store on S3; this version keeps file data in the store itself and does \
                     not move it: copy the files out with the version that wrote them, or \
                     start with a new data directory",
                    local.display()
                ),
            ));
        }
    }
    Ok(store.clone())
}

fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    Ok(u64::from_le_bytes(b))
}

/// Reads the key file, refusing one that others can read.
pub fn read_key_file(path: &Path) -> io::Result<ClusterKey> {
    let text = fs::read_to_string(path)?;
    key_from_hex(&text).ok_or_else(|| {
        io::Error::new(
            ErrorKind::InvalidData,
            format!("{} is not a cluster key", path.display()),
        )
    })
}

fn create_key_file(path: &Path) -> io::Result<ClusterKey> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(key_to_hex(&key).as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    Ok(key)
}

/// Reads the cluster description in `store` (`None`: no cluster there), refusing another
/// data format.
pub fn read_meta(store: &dyn ObjectStore, name: &str) -> io::Result<Option<ClusterMeta>> {
    let Some(bytes) = store.get(CLUSTER_OBJECT)? else {
        return Ok(None);
    };
    let meta: ClusterMeta = serde_json::from_slice(&bytes)
        .map_err(|e| io::Error::new(ErrorKind::InvalidData, format!("{CLUSTER_OBJECT}: {e}")))?;
    if meta.format != DATA_FORMAT {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!(
                "{name} holds data format {}, and this version of kochab reads only format \
                 {DATA_FORMAT} (format 1 named chunks data/<shard>/<id>.<generation>.<chunk>; \
                 format 2 had one unnamed journal with 16-byte record headers and \
                 unversioned manifests; neither is converted); use the kochab version \
                 that wrote it, or start with a new data directory",
                meta.format
            ),
        ));
    }
    Ok(Some(meta))
}

/// The cluster description in `store`, made (by conditional create) if there is none: of
/// two first starts over one store, one description wins and both use it.
fn read_or_create_meta(store: &dyn ObjectStore, name: &str) -> io::Result<(ClusterMeta, bool)> {
    if let Some(meta) = read_meta(store, name)? {
        return Ok((meta, false));
    }
    let engine = EngineConfig::with_key([random_u64()?, random_u64()?]);
    let policy = kochab_meta::IdPolicy::new(engine.id_policy.clone()).map_err(io::Error::other)?;
    let tables = initial_table_ranges(&policy, engine.primary_tables).map_err(io::Error::other)?;
    let meta = ClusterMeta {
        format: DATA_FORMAT,
        cluster_id: random_u64()?,
        server_id: random_u64()?,
        engine,
        tables,
    };
    let json = serde_json::to_vec_pretty(&meta).map_err(io::Error::other)?;
    match store.create_if_absent(CLUSTER_OBJECT, &json) {
        Ok(()) => Ok((meta, true)),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let meta = read_meta(store, name)?.ok_or_else(|| {
                io::Error::other(format!("{name}: {CLUSTER_OBJECT} exists and then does not"))
            })?;
            Ok((meta, false))
        }
        Err(e) => Err(e),
    }
}

/// Checks `key` against the check `store` records of its cluster's key, recording it (by
/// conditional create: the first start wins, every other must agree) if there is none.
pub fn check_key(
    store: &dyn ObjectStore,
    meta: &ClusterMeta,
    key: &ClusterKey,
    name: &str,
) -> io::Result<()> {
    let want = key_to_hex(&kochab_proto::auth::key_check(key, meta.cluster_id));
    let have = match store.get(KEY_CHECK_OBJECT)? {
        Some(b) => b,
        None => match store.create_if_absent(KEY_CHECK_OBJECT, want.as_bytes()) {
            Ok(()) => return Ok(()),
            // Another start recorded it first, or a retried create whose first try made it.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                store.get(KEY_CHECK_OBJECT)?.ok_or_else(|| {
                    io::Error::other(format!(
                        "{name}: {KEY_CHECK_OBJECT} exists and then does not"
                    ))
                })?
            }
            Err(e) => return Err(e),
        },
    };
    if have.trim_ascii() != want.as_bytes() {
        return Err(io::Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "the key given is not the key of the cluster in {name} (its {KEY_CHECK_OBJECT} \
                 records another): give every server and coordinator the same cluster key"
            ),
        ));
    }
    Ok(())
}

/// True if every table of `store` was released to a cluster of servers.
pub fn is_released(store: &dyn ObjectStore) -> io::Result<bool> {
    store.exists(RELEASED_OBJECT)
}

/// Records that every table of `store` was released to a cluster of servers (a second
/// record, or a retried one, changes nothing).
pub fn mark_released(store: &dyn ObjectStore) -> io::Result<()> {
    match store.create_if_absent(RELEASED_OBJECT, b"every table released to the cluster\n") {
        Err(e) if e.kind() != ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

impl DataDir {
    /// A metadata server's view of a cluster's store on another host's or a bucket's:
    /// the description read from `store` (which must hold a cluster), `key` checked
    /// against it. `local` is this host's own directory: file data while the store has no
    /// positioned I/O (see [`DataDir::data_store`]), nothing another host needs.
    pub fn open_member(
        local: &Path,
        store: Arc<dyn ObjectStore>,
        key: ClusterKey,
        name: &str,
    ) -> io::Result<DataDir> {
        let meta = read_meta(store.as_ref(), name)?.ok_or_else(|| {
            io::Error::new(
                ErrorKind::NotFound,
                format!("{name} holds no Kochab cluster (no {CLUSTER_OBJECT})"),
            )
        })?;
        check_key(store.as_ref(), &meta, &key, name)?;
        let data_store = data_store_for(&store, local)?;
        Ok(DataDir {
            path: local.to_path_buf(),
            store,
            data_store,
            key,
            meta,
            created: false,
        })
    }

    /// Opens the cluster in `path`, which must hold one (for offline tools: nothing is
    /// created). The caller holds the directory's [`DataDirLock`].
    pub fn open_existing(path: &Path) -> io::Result<DataDir> {
        for needed in [path.join(KEY_FILE), path.join("store").join(CLUSTER_OBJECT)] {
            if !needed.exists() {
                return Err(io::Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "{} holds no Kochab cluster ({} is missing)",
                        path.display(),
                        needed.display()
                    ),
                ));
            }
        }
        DataDir::open_or_create(path)
    }

    /// Opens `path`, creating a new cluster there if it holds none.
    pub fn open_or_create(path: &Path) -> io::Result<DataDir> {
        DataDir::open_or_create_on(path, None)
    }

    /// Opens `path` with its object store in `store` instead of `path/store` (if given),
    /// creating a new cluster there if the store holds none. The key stays in `path`.
    pub fn open_or_create_on(
        path: &Path,
        store: Option<Arc<dyn ObjectStore>>,
    ) -> io::Result<DataDir> {
        DataDir::open_or_create_with(path, store, None)
    }

    /// [`DataDir::open_or_create_on`] with the cluster key `key` (if given) instead of the
    /// directory's key file, which is then neither read nor made. A key is checked against
    /// the check a given store records (see [`check_key`]).
    pub fn open_or_create_with(
        path: &Path,
        store: Option<Arc<dyn ObjectStore>>,
        key: Option<ClusterKey>,
    ) -> io::Result<DataDir> {
        // A new directory is made 0700; an existing one keeps the mode its owner gave it
        // (the key files in it are 0600 whatever the directory's mode).
        if !path.exists() {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)?;
        }
        let key = match key {
            Some(k) => k,
            None => {
                let key_path = path.join(KEY_FILE);
                let key = match read_key_file(&key_path) {
                    Ok(k) => k,
                    Err(e) if e.kind() == ErrorKind::NotFound => create_key_file(&key_path)?,
                    Err(e) => return Err(e),
                };
                let mode = fs::metadata(&key_path)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(io::Error::new(
                        ErrorKind::PermissionDenied,
                        format!("{} has mode {mode:o}; it must be 0600", key_path.display()),
                    ));
                }
                key
            }
        };
        let given = store.is_some();
        let store: Arc<dyn ObjectStore> = match store {
            Some(s) => s,
            None => Arc::new(LocalStore::open(path.join("store"))?),
        };
        let (meta, created) = read_or_create_meta(store.as_ref(), &path.display().to_string())?;
        // A store of its own (a bucket) may be shared by hosts that each hold a copy of the
        // key: the store says which key is the cluster's. The directory's own store sits
        // beside its key and needs no check.
        if given {
            check_key(store.as_ref(), &meta, &key, &path.display().to_string())?;
        }
        let data_store = data_store_for(&store, path)?;
        Ok(DataDir {
            path: path.to_path_buf(),
            store,
            data_store,
            key,
            meta,
            created,
        })
    }
}

/// This server's identity over time.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServerState {
    pub server_id: u64,
    /// The epoch of the incarnation that runs (or ran last).
    pub epoch: u64,
}

impl DataDir {
    /// Starts a new incarnation of this directory's server: its epoch is bumped and made
    /// durable before anything is written under it, so no two starts share an epoch (and so
    /// a journal). The caller holds the directory's lock.
    pub fn next_incarnation(&self) -> io::Result<ServerState> {
        let store = self.store.as_ref();
        let legacy = match store.get(SERVER_OBJECT)? {
            Some(bytes) => serde_json::from_slice::<ServerState>(&bytes).map_err(|e| {
                io::Error::new(ErrorKind::InvalidData, format!("{SERVER_OBJECT}: {e}"))
            })?,
            None => ServerState {
                server_id: SINGLE_SERVER_ID,
                epoch: 0,
            },
        };
        let base = epoch_base(legacy.server_id);
        for _ in 0..EPOCH_TRIES_MAX {
            let newest = newest_version(store, &base)?.map_or(0, |(v, _)| v);
            let current = newest.max(legacy.epoch);
            let state = ServerState {
                epoch: current + 1,
                ..legacy
            };
            let json = serde_json::to_vec_pretty(&state).map_err(io::Error::other)?;
            match store.swap_version(&base, current, &json) {
                Ok(_) => {
                    // For older versions, which read only this; and the version before the
                    // last is not needed any more.
                    store.put(SERVER_OBJECT, &json)?;
                    if current >= 2 {
                        store.delete(&versioned_name(&base, current - 1))?;
                    }
                    return Ok(state);
                }
                // Another start of this server took that epoch first: take the next.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::other(format!(
            "server {}: {EPOCH_TRIES_MAX} starts raced for its next epoch",
            legacy.server_id
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_data_format_is_refused_clearly() {
        let d = tempfile::tempdir().unwrap();
        let dir = DataDir::open_or_create(d.path()).unwrap();
        assert_eq!(dir.meta.format, DATA_FORMAT);
        let mut meta = dir.meta.clone();
        meta.format = 1;
        dir.store
            .put(CLUSTER_OBJECT, &serde_json::to_vec(&meta).unwrap())
            .unwrap();
        let err = DataDir::open_or_create(d.path()).err().expect("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidData);
        assert!(err.to_string().contains("data format 1"), "{err}");
        meta.format = 2;
        dir.store
            .put(CLUSTER_OBJECT, &serde_json::to_vec(&meta).unwrap())
            .unwrap();
        let err = DataDir::open_or_create(d.path()).err().expect("refused");
        assert!(err.to_string().contains("data format 2"), "{err}");
    }

    #[test]
    fn starts_racing_over_one_store_share_one_cluster_and_never_an_epoch() {
        // Four hosts (directories of their own, a copy of the key each) start one server
        // over one store of whole objects at once, five times each.
        let store: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::objects_only());
        let key = [7u8; 32];
        let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
        let barrier = Arc::new(std::sync::Barrier::new(dirs.len()));
        let runs: Vec<_> = dirs
            .iter()
            .map(|d| {
                let (path, store, barrier) =
                    (d.path().to_path_buf(), store.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let dir = DataDir::open_or_create_with(&path, Some(store.clone()), Some(key))
                        .unwrap();
                    assert!(
                        !path.join(KEY_FILE).exists(),
                        "the key given is not written"
                    );
                    assert!(
                        Arc::ptr_eq(&dir.data_store, &store),
                        "file data in the shared store"
                    );
                    let epochs: Vec<u64> = (0..5)
                        .map(|_| dir.next_incarnation().unwrap().epoch)
                        .collect();
                    (dir.meta.cluster_id, dir.created, epochs)
                })
            })
            .collect();
        let results: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(results.iter().all(|r| r.0 == results[0].0), "one cluster");
        assert_eq!(results.iter().filter(|r| r.1).count(), 1, "created once");
        let mut epochs: Vec<u64> = results.iter().flat_map(|r| r.2.clone()).collect();
        epochs.sort_unstable();
        epochs.dedup();
        // Never one epoch twice. Not necessarily 1..=20: a start whose version was
        // written but that then sees a newer one (`swap_version`'s stale check) gives
        // its epoch up and takes the next, leaving a gap nobody uses.
        assert_eq!(epochs.len(), 20, "every epoch once: {epochs:?}");
        assert!(epochs[0] >= 1);
    }

    #[test]
    fn a_store_shared_by_hosts_refuses_another_key() {
        let store: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::objects_only());
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // The first start makes the cluster and records its key's check, not the key.
        let dir = DataDir::open_or_create_on(a.path(), Some(store.clone())).unwrap();
        let check = store.get(KEY_CHECK_OBJECT).unwrap().unwrap();
        assert!(!String::from_utf8_lossy(&check).contains(&key_to_hex(&dir.key)));
        // Another host with its own new key file is refused; with a copy of the key, it
        // opens the same cluster, as a member does without touching its directory's key.
        let err = DataDir::open_or_create_on(b.path(), Some(store.clone()))
            .err()
            .expect("another key");
        assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
        let err = DataDir::open_member(b.path(), store.clone(), [9; 32], "s3://b/p")
            .err()
            .expect("another key");
        assert!(
            err.to_string().contains("not the key of the cluster"),
            "{err}"
        );
        let m = DataDir::open_member(b.path(), store.clone(), dir.key, "s3://b/p").unwrap();
        assert_eq!(m.meta.cluster_id, dir.meta.cluster_id);
        // A member needs a cluster there.
        let empty: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::objects_only());
        let err = DataDir::open_member(b.path(), empty, dir.key, "s3://b/q")
            .err()
            .expect("no cluster");
        assert_eq!(err.kind(), ErrorKind::NotFound);
        // Marking released is idempotent.
        assert!(!is_released(store.as_ref()).unwrap());
        mark_released(store.as_ref()).unwrap();
        mark_released(store.as_ref()).unwrap();
        assert!(is_released(store.as_ref()).unwrap());
    }

    #[test]
    fn file_data_on_a_store_of_objects_goes_to_that_store() {
        let store: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::objects_only());
        let d = tempfile::tempdir().unwrap();
        let dir = DataDir::open_or_create_on(d.path(), Some(store.clone())).unwrap();
        assert!(Arc::ptr_eq(&dir.data_store, &store));
        // File data an earlier version left in the local store is refused, not hidden.
        fs::create_dir_all(d.path().join("store/data/07")).unwrap();
        let err = DataDir::open_or_create_on(d.path(), Some(store.clone()))
            .err()
            .expect("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidData);
        assert!(err.to_string().contains("earlier version"), "{err}");
        // The local store keeps its own data as ever.
        let local = tempfile::tempdir().unwrap();
        fs::create_dir_all(local.path().join("store/data/07")).unwrap();
        let dir = DataDir::open_or_create(local.path()).unwrap();
        assert!(dir.data_store.positioned_io());
    }

    #[test]
    fn every_start_gets_a_new_epoch() {
        let d = tempfile::tempdir().unwrap();
        let dir = DataDir::open_or_create(d.path()).unwrap();
        assert_eq!(dir.next_incarnation().unwrap().epoch, 1);
        assert_eq!(dir.next_incarnation().unwrap().epoch, 2);
        let dir = DataDir::open_or_create(d.path()).unwrap();
        let s = dir.next_incarnation().unwrap();
        assert_eq!((s.server_id, s.epoch), (SINGLE_SERVER_ID, 3));
    }
}
