//! The object store: named byte objects that hold journal segments, table checkpoints and
//! file data chunks, grouped in folders. Servers are soft state; everything durable lives
//! here.
//!
//! [`LocalStore`] keeps objects as files under one directory (the embedded default);
//! `kochab-s3store` implements the same trait over the S3 API, without positioned I/O
//! ([`ObjectStore::positioned_io`]).

mod aligned;
mod blocks;
pub mod crashsim;
mod mem;

pub use aligned::AlignedBuf;
pub use mem::{MemLoss, MemStore};

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// An object opened for positioned reads and writes (journal segments, data chunks).
pub trait Object: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many (0 at the end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes all of `data` at `offset`, extending the object if needed.
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Makes written data durable (fdatasync).
    fn sync_data(&self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// True if the object holds no bytes.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Truncates or extends (with zeros) to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reserves space for `[offset, offset + len)` without changing the length
    /// (fallocate(2) with FALLOC_FL_KEEP_SIZE), so that writes there cannot fail for lack
    /// of space; fails with the store's ENOSPC if it cannot (`Unsupported` by default).
    fn allocate(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::new(
            ErrorKind::Unsupported,
            "this store cannot reserve space",
        ))
    }
    /// Makes `[offset, offset + len)` read as zeros and frees its space where the store can
    /// (FALLOC_FL_PUNCH_HOLE), keeping the length. By default it writes the zeros.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        zero_by_writing(self, offset, len)
    }
}

/// Writes zeros over `[offset, offset + len)` up to the object's end (bytes past it read
/// as zeros already).
fn zero_by_writing<O: Object + ?Sized>(o: &O, offset: u64, len: u64) -> io::Result<()> {
    let end = offset.saturating_add(len).min(o.len()?);
    let zeros = vec![0u8; ZERO_WRITE_BYTES.min(end.saturating_sub(offset) as usize)];
    let mut pos = offset;
    while pos < end {
        let n = (end - pos).min(zeros.len() as u64) as usize;
        o.write_at(&zeros[..n], pos)?;
        pos += n as u64;
    }
    Ok(())
}

/// Alignment of offsets, lengths and buffers for objects opened with `open_sync_direct`.
pub const DIRECT_ALIGN: usize = 4096;

/// Capacity of the store, for statfs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// Named objects. Names are relative paths of `[A-Za-z0-9._-]` components joined by '/'.
pub trait ObjectStore: Send + Sync {
    /// Replaces `name` with `data` atomically and durably: afterwards a reader sees either
    /// the old or the new contents, never a mix, even after a crash.
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// The whole object, or `None` if it does not exist.
    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>>;
    /// Removes an object; removing a missing object is not an error.
    fn delete(&self, name: &str) -> io::Result<()>;
    /// Removes the folder `prefix` (made when an object was created in it), which must hold
    /// no objects; removing a missing folder is not an error. A store without folders has
    /// nothing to do.
    fn delete_folder(&self, _prefix: &str) -> io::Result<()> {
        Ok(())
    }
    /// Names of the objects directly under `prefix` (a folder name such as "journal"),
    /// sorted.
    fn list(&self, prefix: &str) -> io::Result<Vec<String>>;
    /// Renames an object atomically (replacing `to` if it exists).
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Opens an object for positioned I/O, creating it (empty) if `create` is set.
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>>;
    /// Opens an existing object for writes that are durable when they return, bypassing
    /// the page cache (O_DIRECT | O_DSYNC: one device write with FUA instead of a write
    /// plus a separate flush). Writes must be `DIRECT_ALIGN`-aligned in offset, length and
    /// memory. `Ok(None)` if the store cannot do this (the caller writes and syncs instead).
    fn open_sync_direct(&self, name: &str) -> io::Result<Option<Arc<dyn Object>>>;
    /// Opens an object for direct I/O (O_DIRECT, bypassing the page cache; not synchronous:
    /// `sync_data` still makes it durable), creating it if `create`. Same alignment rules.
    /// `Ok(None)` if the store cannot.
    fn open_direct(&self, name: &str, create: bool) -> io::Result<Option<Arc<dyn Object>>>;
    /// Makes the existence of objects created or removed under `prefix` durable.
    fn sync_dir(&self, prefix: &str) -> io::Result<()>;
    /// Space in the store.
    fn capacity(&self) -> io::Result<Capacity>;
    /// Creates `name` holding `data`, atomically and durably, only if no object of that
    /// name exists: of any number of racing creators exactly one succeeds, the others get
    /// `AlreadyExists`, and a reader never sees a partial object. This conditional write is
    /// what fencing rests on (seals, versioned manifests), so a store that cannot do it
    /// atomically must not pretend: the default is `Unsupported`.
    fn create_if_absent(&self, _name: &str, _data: &[u8]) -> io::Result<()> {
        Err(io::Error::new(
            ErrorKind::Unsupported,
            "this store has no atomic create-if-absent",
        ))
    }
    /// Compare-and-swap on a version: creates `<base>.<expected + 1>` (20 digits) if
    /// `expected` is still the newest version, atomically (through
    /// [`ObjectStore::create_if_absent`], so `Unsupported` where that is). A writer whose
    /// version is stale, because another wrote `expected + 1` first, gets `AlreadyExists`.
    /// Returns the new version. Versions start at 1; 0 means "none yet".
    ///
    /// Writers delete versions well behind the newest (manifests keep two, epochs one), so
    /// a writer stale by more than that finds `expected + 1` free again and its create
    /// succeeds. A listing after the create catches it: a newer version exists, so the
    /// write is refused as stale (`AlreadyExists`), as it would have been had the name
    /// still been taken. The newest version is never deleted, so the listing sees it.
    fn swap_version(&self, base: &str, expected: u64, data: &[u8]) -> io::Result<u64> {
        let next = expected
            .checked_add(1)
            .ok_or_else(|| io::Error::new(ErrorKind::InvalidInput, "version overflow"))?;
        self.create_if_absent(&versioned_name(base, next), data)?;
        if let Some(newer) = newest_listed_version(self, base)?.filter(|&v| v > next) {
            return Err(io::Error::new(
                ErrorKind::AlreadyExists,
                format!("{base}: version {next} is stale, version {newer} exists"),
            ));
        }
        Ok(next)
    }
    /// True if `name` exists. Cheap where the store allows (a stat on a local directory):
    /// the journal in segments asks once per group commit whether it has been sealed.
    fn exists(&self, name: &str) -> io::Result<bool> {
        Ok(self.get(name)?.is_some())
    }
    /// True if the store has positioned I/O (`open` and its kin, `rename`), as a local
    /// directory has. A store without it (S3) holds only whole objects written once: the
    /// journal is then a sequence of immutable objects instead of segments written in
    /// place, and checkpoint images are written in whole parts.
    fn positioned_io(&self) -> bool {
        true
    }
    /// Several whole objects (`None` for a missing one), in the order named. A store over
    /// a network fetches them concurrently: recovery reads a journal of many objects.
    fn get_many(&self, names: &[String]) -> io::Result<Vec<Option<Vec<u8>>>> {
        names.iter().map(|n| self.get(n)).collect()
    }
    /// Up to `len` bytes of `name` from `offset` (fewer at its end, none past it), or
    /// `None` if it does not exist. A store over a network asks for just that range (one
    /// ranged GET); the default reads the whole object and cuts.
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Option<Vec<u8>>> {
        Ok(self.get(name)?.map(|mut all| {
            let start = usize::try_from(offset).map_or(all.len(), |o| o.min(all.len()));
            let end =
                usize::try_from(offset.saturating_add(len)).map_or(all.len(), |e| e.min(all.len()));
            all.truncate(end);
            all.drain(..start);
            all
        }))
    }
    /// Removes several objects (missing ones are not an error). A store over a network
    /// removes them concurrently: trimming a journal deletes many small objects at once.
    fn delete_many(&self, names: &[String]) -> io::Result<()> {
        names.iter().try_for_each(|n| self.delete(n))
    }
    /// A URL through which someone holding no credentials of the store may do `how` to
    /// `name` until `expires_in` has passed (a store may shorten that to its own limit,
    /// S3's being 7 days), or `None` if the store cannot hand out such URLs. A store the
    /// server reaches on its own disk or memory (a local directory, the memory store, the
    /// crash simulation's) cannot: the server moves file data itself there. `None` too for
    /// a name that is not a valid object name.
    fn presign(&self, _name: &str, _how: Presign, _expires_in: Duration) -> Option<String> {
        None
    }
}

/// What a presigned URL ([`ObjectStore::presign`]) lets its holder do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presign {
    /// Read the object: GET, with or without a `Range` header.
    Get,
    /// Create the object, never overwrite it: one PUT of the whole object that must carry
    /// the [`Presign::headers`], `If-None-Match: *` among them. The signature covers them,
    /// so a request without them (or with other values) is refused by the store, and a
    /// PUT to a name that exists fails its precondition: the URL can make the object while
    /// the name is free and cannot change it after.
    PutCreate,
}

impl Presign {
    /// Headers a request through such a URL must send, exactly as given (the URL's
    /// signature covers them): for a create, `If-None-Match: *`, and the canned ACL
    /// `bucket-owner-full-control`, which keeps the object the store owner's alone. Ceph
    /// RGW applies an `x-amz-acl` header the signature does not cover, so without a signed
    /// one the holder of a create URL could send `public-read` and make its object
    /// readable by anyone without a signature; AWS buckets with ACLs disabled (their
    /// default) accept this one ACL and no other.
    pub fn headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Presign::Get => &[],
            Presign::PutCreate => &[
                ("if-none-match", "*"),
                ("x-amz-acl", "bucket-owner-full-control"),
            ],
        }
    }
}

/// The object name of version `version` of `base` (see [`ObjectStore::swap_version`]).
pub fn versioned_name(base: &str, version: u64) -> String {
    format!("{base}.{version:020}")
}

/// The newest version of `base` in `folder` (the folder `base` lives in) and its contents,
/// or `None` if there is none. Older versions may linger until their writer deletes them.
pub fn newest_version(store: &dyn ObjectStore, base: &str) -> io::Result<Option<(u64, Vec<u8>)>> {
    let mut versions = listed_versions(store, base)?;
    versions.sort_unstable();
    // Newest first; one deleted under us (by its writer's cleanup) means a newer exists.
    for v in versions.into_iter().rev() {
        if let Some(data) = store.get(&versioned_name(base, v))? {
            return Ok(Some((v, data)));
        }
    }
    Ok(None)
}

/// The versions of `base` its folder lists (unsorted).
fn listed_versions<S: ObjectStore + ?Sized>(store: &S, base: &str) -> io::Result<Vec<u64>> {
    let (folder, _) = base.rsplit_once('/').unwrap_or(("", base));
    let prefix = format!("{base}.");
    Ok(store
        .list(folder)?
        .iter()
        .filter_map(|n| n.strip_prefix(&prefix))
        .filter(|v| v.len() == 20)
        .filter_map(|v| v.parse().ok())
        .collect())
}

/// The highest version of `base` listed (one listing, no read).
fn newest_listed_version<S: ObjectStore + ?Sized>(
    store: &S,
    base: &str,
) -> io::Result<Option<u64>> {
    Ok(listed_versions(store, base)?.into_iter().max())
}

/// Checks an object name: no empty, "." or ".." components, no absolute paths, a small
/// character set, bounded length. Object names come from our own code, but a bad one must
/// never escape the store's directory.
pub fn validate_object_name(name: &str) -> io::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 512
        && name.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("invalid object name {name:?}"),
        ))
    }
}

/// Objects as files under one directory.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
    /// The crash simulation's recorder, in its test mode only (see [`crashsim`]).
    sim: Option<Arc<crashsim::Recorder>>,
}

struct LocalObject {
    file: File,
    sim: Option<(Arc<crashsim::Recorder>, crashsim::SimFile)>,
}

impl Object for LocalObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match &self.sim {
            None => self.file.write_all_at(data, offset),
            Some((rec, f)) if f.dsync => {
                self.file.write_all_at(data, offset)?;
                rec.pinned(f, offset, data)
            }
            Some((rec, f)) => {
                let end = offset.saturating_add(data.len() as u64);
                rec.change(f, offset, end, None, || {
                    self.file.write_all_at(data, offset)
                })
            }
        }
    }

    fn sync_data(&self) -> io::Result<()> {
        match &self.sim {
            None => self.file.sync_data(),
            Some((rec, f)) => rec.sync(f.ino, || self.file.sync_data()),
        }
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        match &self.sim {
            None => self.file.set_len(len),
            Some((rec, f)) => rec.change(f, len, u64::MAX, Some(len), || self.file.set_len(len)),
        }
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        fallocate(&self.file, libc::FALLOC_FL_KEEP_SIZE, offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let punched = match &self.sim {
            None => fallocate(&self.file, mode, offset, len),
            Some((rec, f)) => rec.change(f, offset, offset.saturating_add(len), None, || {
                fallocate(&self.file, mode, offset, len)
            }),
        };
        match punched {
            // A file system without hole punching: write the zeros instead.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                zero_by_writing(self, offset, len)
            }
            other => other,
        }
    }
}

/// Bytes of zeros written per call where holes cannot be punched.
const ZERO_WRITE_BYTES: usize = 1 << 20;

/// fallocate(2), retried on EINTR.
fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    loop {
        // SAFETY: fallocate on a descriptor this object owns; no memory is passed.
        if unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, len) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl LocalStore {
    /// A store rooted at `root`, created if missing. In the crash simulation's test mode
    /// ([`crashsim`]) it records what a power cut could still take away.
    pub fn open(root: impl AsRef<Path>) -> io::Result<LocalStore> {
        fs::create_dir_all(root.as_ref())?;
        let root = root.as_ref().to_path_buf();
        let sim = match crashsim::enabled() {
            true => Some(Arc::new(crashsim::Recorder::new(&root)?)),
            false => None,
        };
        Ok(LocalStore { root, sim })
    }

    fn object(&self, file: File) -> io::Result<LocalObject> {
        let sim = match &self.sim {
            Some(rec) => Some((rec.clone(), crashsim::SimFile::of(&file)?)),
            None => None,
        };
        Ok(LocalObject { file, sim })
    }

    /// Runs `create`, which makes `path` if it does not exist, and records a new name.
    fn creating<T>(&self, path: &Path, create: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let Some(rec) = &self.sim else {
            return create();
        };
        let existed = fs::symlink_metadata(path).is_ok();
        let at = crashsim_now();
        let out = create()?;
        if !existed {
            rec.created(path, at)?;
        }
        Ok(out)
    }

    /// Writes `data` at `offset` of a file this store just made.
    fn write_file(&self, f: &File, data: &[u8], offset: u64) -> io::Result<()> {
        match &self.sim {
            None => f.write_all_at(data, offset),
            Some(_) => self.object(f.try_clone()?)?.write_at(data, offset),
        }
    }

    /// fsync(2) of a file this store just made: its contents are durable.
    fn sync_file(&self, f: &File) -> io::Result<()> {
        match &self.sim {
            None => f.sync_all(),
            Some(rec) => rec.sync(std::os::unix::fs::MetadataExt::ino(&f.metadata()?), || {
                f.sync_all()
            }),
        }
    }

    fn remove_path(&self, path: &Path) -> io::Result<()> {
        match &self.sim {
            None => fs::remove_file(path),
            Some(rec) => rec.remove(path),
        }
    }

    fn rename_path(&self, from: &Path, to: &Path) -> io::Result<()> {
        match &self.sim {
            None => fs::rename(from, to),
            Some(rec) => rec.rename(from, to),
        }
    }

    /// fsync(2) of a folder: names created or removed in it are durable.
    fn sync_folder(&self, dir: &Path) -> io::Result<()> {
        let began = crashsim_now();
        File::open(dir)?.sync_all()?;
        match &self.sim {
            None => Ok(()),
            Some(rec) => rec.dir_synced(dir, began),
        }
    }

    /// The directory holding the objects.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, name: &str) -> io::Result<PathBuf> {
        validate_object_name(name)?;
        Ok(self.root.join(name))
    }

    fn ensure_parent(path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(p) => fs::create_dir_all(p),
            None => Ok(()),
        }
    }
}

/// Makes temporary names of concurrent conditional writers in one process distinct.
static TMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn crashsim_now() -> u64 {
    crashsim::now()
}

impl ObjectStore for LocalStore {
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let path = self.path(name)?;
        Self::ensure_parent(&path)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        {
            let f = self.creating(&tmp, || File::create(&tmp))?;
            self.write_file(&f, data, 0)?;
            self.sync_file(&f)?;
        }
        self.rename_path(&tmp, &path)?;
        self.sync_folder(path.parent().unwrap_or(&self.root))
    }

    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        match fs::read(self.path(name)?) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        match self.remove_path(&self.path(name)?) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn delete_folder(&self, prefix: &str) -> io::Result<()> {
        match fs::remove_dir(self.path(prefix)?) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let dir = self.path(prefix)?;
        let mut names = Vec::new();
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(names),
            Err(e) => return Err(e),
        };
        for entry in rd {
            let entry = entry?;
            if let Some(n) = entry.file_name().to_str()
                && validate_object_name(n).is_ok()
                && !n.contains(".tmp")
            {
                names.push(format!("{prefix}/{n}"));
            }
        }
        names.sort();
        Ok(names)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let to = self.path(to)?;
        Self::ensure_parent(&to)?;
        self.rename_path(&self.path(from)?, &to)
    }

    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>> {
        let path = self.path(name)?;
        if create {
            Self::ensure_parent(&path)?;
        }
        let file = self.creating(&path, || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .truncate(false)
                .open(&path)
        })?;
        Ok(Arc::new(self.object(file)?))
    }

    fn open_sync_direct(&self, name: &str) -> io::Result<Option<Arc<dyn Object>>> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.path(name)?;
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
            .open(&path)
        {
            Ok(file) => Ok(Some(Arc::new(self.object(file)?))),
            // tmpfs and some others refuse O_DIRECT.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn open_direct(&self, name: &str, create: bool) -> io::Result<Option<Arc<dyn Object>>> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.path(name)?;
        if create {
            Self::ensure_parent(&path)?;
        }
        let opened = self.creating(&path, || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .truncate(false)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
        });
        match opened {
            Ok(file) => Ok(Some(Arc::new(self.object(file)?))),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn sync_dir(&self, prefix: &str) -> io::Result<()> {
        let dir = self.path(prefix)?;
        fs::create_dir_all(&dir)?;
        self.sync_folder(&dir)
    }

    fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let path = self.path(name)?;
        Self::ensure_parent(&path)?;
        // A private temporary made whole and durable first, then link(2), which fails with
        // EEXIST if the name exists: the name appears atomically, with its full contents.
        let tmp = path.with_extension(format!(
            "tmp{}.{}",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let result = (|| {
            let f = self.creating(&tmp, || {
                OpenOptions::new().write(true).create_new(true).open(&tmp)
            })?;
            self.write_file(&f, data, 0)?;
            self.sync_file(&f)?;
            self.creating(&path, || fs::hard_link(&tmp, &path))
        })();
        let _ = self.remove_path(&tmp);
        result?;
        self.sync_folder(path.parent().unwrap_or(&self.root))
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        match fs::symlink_metadata(self.path(name)?) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn capacity(&self) -> io::Result<Capacity> {
        let c = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(ErrorKind::InvalidInput, "store path contains NUL"))?;
        // SAFETY: `c` is a valid NUL-terminated path and `st` is a properly sized out-buffer.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let frsize = st.f_frsize as u64;
        Ok(Capacity {
            total_bytes: st.f_blocks as u64 * frsize,
            free_bytes: st.f_bavail as u64 * frsize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_stale_past_deleted_versions_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let local = LocalStore::open(dir.path()).unwrap();
        let objects = MemStore::objects_only();
        for s in [&local as &dyn ObjectStore, &objects] {
            let base = "t/manifest";
            for v in 0..5 {
                assert_eq!(s.swap_version(base, v, b"m").unwrap(), v + 1);
            }
            // The newest writer's cleanup deleted versions 1..3; a writer that still
            // believes 2 is the newest finds 3 free, creates it, and must be refused.
            for v in 1..=3 {
                s.delete(&versioned_name(base, v)).unwrap();
            }
            let e = s.swap_version(base, 2, b"stale").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
            assert_eq!(newest_version(s, base).unwrap().unwrap().0, 5);
            assert_eq!(s.swap_version(base, 5, b"next").unwrap(), 6);
        }
    }

    #[test]
    fn put_get_list_delete() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.put("a/x", b"one").unwrap();
        s.put("a/y", b"two").unwrap();
        s.put("a/x", b"three").unwrap();
        assert_eq!(s.get("a/x").unwrap().unwrap(), b"three");
        assert_eq!(s.list("a").unwrap(), vec!["a/x", "a/y"]);
        s.delete("a/x").unwrap();
        s.delete("a/x").unwrap();
        assert_eq!(s.get("a/x").unwrap(), None);
        assert!(s.list("missing").unwrap().is_empty());
        assert!(s.capacity().unwrap().total_bytes > 0);
    }

    #[test]
    fn positioned_io() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        let o = s.open("seg/1", true).unwrap();
        o.write_at(b"hello", 10).unwrap();
        o.sync_data().unwrap();
        assert_eq!(o.len().unwrap(), 15);
        let mut buf = [1u8; 20];
        assert_eq!(o.read_at(&mut buf, 0).unwrap(), 15);
        assert_eq!(&buf[..15], b"\0\0\0\0\0\0\0\0\0\0hello");
        o.set_len(12).unwrap();
        assert_eq!(o.len().unwrap(), 12);
        o.allocate(0, 1 << 20).unwrap();
        assert_eq!(o.len().unwrap(), 12, "allocation keeps the length");
        o.punch_hole(2, 4).unwrap();
        let mut buf = [1u8; 12];
        o.read_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"\0\0\0\0\0\0\0\0\0\0he");
        o.write_at(b"abcdefgh", 0).unwrap();
        o.punch_hole(2, 4).unwrap();
        o.read_at(&mut buf, 0).unwrap();
        assert_eq!(&buf[..8], b"ab\0\0\0\0gh");
        assert_eq!(o.len().unwrap(), 12);
    }

    #[test]
    fn folders_go_when_empty() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.open("d/f/1", true).unwrap();
        assert!(s.delete_folder("d/f").is_err(), "not empty");
        s.delete("d/f/1").unwrap();
        s.delete_folder("d/f").unwrap();
        s.delete_folder("d/f").unwrap();
        assert!(s.list("d").unwrap().is_empty());
    }

    #[test]
    fn create_if_absent_refuses_an_existing_name() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.create_if_absent("a/seal", b"one").unwrap();
        let e = s.create_if_absent("a/seal", b"two").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert_eq!(s.get("a/seal").unwrap().unwrap(), b"one");
        assert!(s.exists("a/seal").unwrap());
        assert!(!s.exists("a/other").unwrap());
        assert_eq!(s.list("a").unwrap(), vec!["a/seal"], "no temporary left");
    }

    #[test]
    fn of_racing_creators_exactly_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(LocalStore::open(dir.path()).unwrap());
        for round in 0..20 {
            let name = format!("race/r{round}");
            let barrier = Arc::new(std::sync::Barrier::new(8));
            let handles: Vec<_> = (0..8u8)
                .map(|k| {
                    let (s, name, barrier) = (s.clone(), name.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        s.create_if_absent(&name, &[k; 4096]).map(|()| k)
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let winners: Vec<u8> = results
                .iter()
                .filter_map(|r| r.as_ref().ok())
                .copied()
                .collect();
            assert_eq!(winners.len(), 1, "round {round}: {results:?}");
            for r in &results {
                if let Err(e) = r {
                    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
                }
            }
            assert_eq!(s.get(&name).unwrap().unwrap(), vec![winners[0]; 4096]);
        }
    }

    #[test]
    fn a_stale_version_cannot_be_swapped_in() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(LocalStore::open(dir.path()).unwrap());
        assert_eq!(newest_version(s.as_ref(), "t/manifest").unwrap(), None);
        assert_eq!(s.swap_version("t/manifest", 0, b"v1").unwrap(), 1);
        assert_eq!(s.swap_version("t/manifest", 1, b"v2").unwrap(), 2);
        // A writer that still believes version 1 is current is refused.
        let e = s.swap_version("t/manifest", 1, b"late").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert_eq!(
            newest_version(s.as_ref(), "t/manifest").unwrap(),
            Some((2, b"v2".to_vec()))
        );
        // Racing writers from one version: exactly one wins.
        let handles: Vec<_> = (0..6u8)
            .map(|k| {
                let s = s.clone();
                std::thread::spawn(move || s.swap_version("t/manifest", 2, &[k]).is_ok())
            })
            .collect();
        let wins = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|w| *w)
            .count();
        assert_eq!(wins, 1);
        assert_eq!(
            newest_version(s.as_ref(), "t/manifest").unwrap().unwrap().0,
            3
        );
    }

    #[test]
    fn names_cannot_escape() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a//b",
            "a/./b",
            "sp ace",
        ] {
            assert!(validate_object_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_object_name("journal/00000001.seg").is_ok());
    }
}
