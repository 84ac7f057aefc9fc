//! The object store: named byte objects that hold journal segments, table checkpoints and
//! file data chunks, grouped in folders. Servers are soft state; everything durable lives
//! here.
//!
//! [`LocalStore`] keeps objects as files under one directory (the embedded default). Object
//! storage servers implement the same trait later.

mod aligned;
mod mem;

pub use aligned::AlignedBuf;
pub use mem::MemStore;

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
}

struct LocalObject {
    file: File,
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
        self.file.write_all_at(data, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        fallocate(&self.file, libc::FALLOC_FL_KEEP_SIZE, offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match fallocate(&self.file, mode, offset, len) {
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
    /// A store rooted at `root`, created if missing.
    pub fn open(root: impl AsRef<Path>) -> io::Result<LocalStore> {
        fs::create_dir_all(root.as_ref())?;
        Ok(LocalStore {
            root: root.as_ref().to_path_buf(),
        })
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

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl ObjectStore for LocalStore {
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let path = self.path(name)?;
        Self::ensure_parent(&path)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        {
            let f = File::create(&tmp)?;
            f.write_all_at(data, 0)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, &path)?;
        fsync_dir(path.parent().unwrap_or(&self.root))
    }

    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        match fs::read(self.path(name)?) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        match fs::remove_file(self.path(name)?) {
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
        fs::rename(self.path(from)?, to)
    }

    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>> {
        let path = self.path(name)?;
        if create {
            Self::ensure_parent(&path)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(&path)?;
        Ok(Arc::new(LocalObject { file }))
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
            Ok(file) => Ok(Some(Arc::new(LocalObject { file }))),
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
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        {
            Ok(file) => Ok(Some(Arc::new(LocalObject { file }))),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn sync_dir(&self, prefix: &str) -> io::Result<()> {
        let dir = self.path(prefix)?;
        fs::create_dir_all(&dir)?;
        fsync_dir(&dir)
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
