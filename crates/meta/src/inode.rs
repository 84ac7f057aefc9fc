//! The in-memory inode record. Kept small (72 bytes plus an optional box for the rare parts)
//! because a server holds millions in memory.

use kochab_proto::{Attr, FileKind, InodeId, TimeNs, mode};
use serde::{Deserialize, Serialize};

/// Preferred I/O size reported in st_blksize.
pub const BLKSIZE: u32 = 4096;

/// One inode. Directory entries and extended attributes are kept elsewhere in the table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inode {
    /// Type and permission bits (st_mode).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: TimeNs,
    pub mtime: TimeNs,
    pub ctime: TimeNs,
    /// Birth time; doubles as the generation number (an id is never reused within a ns).
    pub btime: TimeNs,
    pub rdev: u32,
    /// Regular files: chunk objects may exist. Set durably (journaled and waited for)
    /// before the file's first chunk object is created, and never cleared, so that a file
    /// without it has no data to reclaim and one with it always gets a reclaim entry when
    /// it goes: a crash can never leak objects. Which chunks exist is read from the store.
    pub may_have_data: bool,
    pub extra: Option<Box<InodeExtra>>,
}

/// The parts only some inodes have.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeExtra {
    #[serde(with = "serde_bytes")]
    pub symlink: Option<Vec<u8>>,
    pub dir: Option<DirMeta>,
}

/// Directory-only state: the parent link and the id allocator of the child-closest policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirMeta {
    /// The directory's parent (itself for the root); "..", and walked for rename cycles.
    pub parent: InodeId,
    /// Next file id to try and the end of the range it is taken from (0, 0 before the
    /// first file).
    pub file_next: InodeId,
    pub file_end: InodeId,
    /// Next value to try for the slot of a new subdirectory.
    pub subdir_next: u64,
}

impl Inode {
    /// A fresh inode with all times set to `now`.
    pub fn new(mode: u32, uid: u32, gid: u32, now: TimeNs) -> Inode {
        Inode {
            mode,
            uid,
            gid,
            nlink: 1,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            btime: now,
            rdev: 0,
            may_have_data: false,
            extra: None,
        }
    }

    /// The file type. Every inode in a table has one: operations create none without, and
    /// `Engine::apply` and checkpoint loading refuse one (the fallback is never taken).
    pub fn kind(&self) -> FileKind {
        FileKind::from_mode(self.mode).unwrap_or(FileKind::File)
    }

    pub fn is_dir(&self) -> bool {
        self.mode & mode::S_IFMT == mode::S_IFDIR
    }

    pub fn is_regular(&self) -> bool {
        self.mode & mode::S_IFMT == mode::S_IFREG
    }

    /// Directory state; `None` for non-directories.
    pub fn dir(&self) -> Option<&DirMeta> {
        self.extra.as_ref().and_then(|e| e.dir.as_ref())
    }

    /// Mutable directory state, created on first use.
    pub fn dir_mut(&mut self) -> &mut DirMeta {
        self.extra
            .get_or_insert_with(Default::default)
            .dir
            .get_or_insert_with(Default::default)
    }

    /// The symlink target, if this is a symlink.
    pub fn symlink(&self) -> Option<&[u8]> {
        self.extra.as_ref().and_then(|e| e.symlink.as_deref())
    }

    /// The attributes getattr reports.
    pub fn attr(&self, id: InodeId) -> Attr {
        let (size, blocks) = if self.is_dir() {
            // Report what a small ext4 directory shows; tools such as du expect blocks.
            (BLKSIZE as u64, 8)
        } else {
            (
                self.size,
                self.size.div_ceil(BLKSIZE as u64) * (BLKSIZE as u64 / 512),
            )
        };
        Attr {
            id,
            generation: self.btime as u64,
            mode: self.mode,
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            size,
            blocks,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            btime: self.btime,
            rdev: self.rdev,
            blksize: BLKSIZE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_stays_small() {
        // Memory per file is a stated goal (<= 300 bytes per file with its entry).
        assert!(
            std::mem::size_of::<Inode>() <= 72,
            "{}",
            std::mem::size_of::<Inode>()
        );
    }
}
