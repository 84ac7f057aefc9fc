//! Value types shared by every layer: ids, attributes, credentials, directory entries.

use serde::{Deserialize, Serialize};

/// An inode id. Assigned by the child-closest policy (see `kochab_meta::idpolicy`); the FUSE
/// adapter uses it as the inode number, except that the root is shown as 1.
pub type InodeId = u64;

/// Nanoseconds since the Unix epoch (signed: times before 1970 are legal in POSIX).
pub type TimeNs = i64;

/// Longest name of one directory entry, in bytes (Linux NAME_MAX).
pub const NAME_MAX: usize = 255;
/// Longest symlink target, in bytes (Linux PATH_MAX minus the terminating NUL).
pub const SYMLINK_MAX: usize = 4095;
/// Longest extended-attribute name (Linux XATTR_NAME_MAX).
pub const XATTR_NAME_MAX: usize = 255;
/// Largest extended-attribute value (Linux XATTR_SIZE_MAX).
pub const XATTR_SIZE_MAX: usize = 65536;
/// Largest listxattr result (Linux XATTR_LIST_MAX).
pub const XATTR_LIST_MAX: usize = 65536;
/// Bytes per data chunk: a file's data is stored as objects named by (inode, chunk).
pub const CHUNK_BYTES: u64 = 4 << 20;
/// The largest file size, in bytes: the kernel's MAX_LFS_FILESIZE (file offsets are signed
/// 64-bit), which FUSE uses as the mount's s_maxbytes. Rule: a write, truncation or
/// fallocate whose end would pass it fails with EFBIG, and nothing beyond it is stored.
/// Chunk numbers are u64 everywhere (at most `FILE_BYTES_MAX / CHUNK_BYTES`, 2^41 - 1), so
/// they never wrap.
pub const FILE_BYTES_MAX: u64 = i64::MAX as u64;

/// Most hard links to one inode; ext4's limit, so programs see the same EMLINK.
pub const LINK_MAX: u32 = 65000;

/// File type bits of `mode` (S_IFMT and friends, as in Linux).
pub mod mode {
    pub const S_IFMT: u32 = 0o170000;
    pub const S_IFSOCK: u32 = 0o140000;
    pub const S_IFLNK: u32 = 0o120000;
    pub const S_IFREG: u32 = 0o100000;
    pub const S_IFBLK: u32 = 0o060000;
    pub const S_IFDIR: u32 = 0o040000;
    pub const S_IFCHR: u32 = 0o020000;
    pub const S_IFIFO: u32 = 0o010000;
    pub const S_ISUID: u32 = 0o4000;
    pub const S_ISGID: u32 = 0o2000;
    pub const S_ISVTX: u32 = 0o1000;
    pub const S_IXGRP: u32 = 0o0010;
    /// Permission and special bits: everything but the type.
    pub const PERM_MASK: u32 = 0o7777;
}

/// access(2) mask bits.
pub mod access {
    pub const F_OK: u32 = 0;
    pub const X_OK: u32 = 1;
    pub const W_OK: u32 = 2;
    pub const R_OK: u32 = 4;
}

/// renameat2(2) flags.
pub mod rename_flags {
    pub const RENAME_NOREPLACE: u32 = 1;
    pub const RENAME_EXCHANGE: u32 = 2;
    pub const RENAME_WHITEOUT: u32 = 4;
}

/// setxattr(2) flags.
pub mod xattr_flags {
    pub const XATTR_CREATE: u32 = 1;
    pub const XATTR_REPLACE: u32 = 2;
}

/// The type of an inode, as readdir reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

impl FileKind {
    /// The kind encoded in the S_IFMT bits of `mode`, if those bits name one.
    pub fn from_mode(m: u32) -> Option<FileKind> {
        use mode::*;
        Some(match m & S_IFMT {
            S_IFREG => FileKind::File,
            S_IFDIR => FileKind::Dir,
            S_IFLNK => FileKind::Symlink,
            S_IFIFO => FileKind::Fifo,
            S_IFSOCK => FileKind::Socket,
            S_IFCHR => FileKind::CharDev,
            S_IFBLK => FileKind::BlockDev,
            _ => return None,
        })
    }

    /// The S_IFMT bits of this kind.
    pub fn mode_bits(self) -> u32 {
        use mode::*;
        match self {
            FileKind::File => S_IFREG,
            FileKind::Dir => S_IFDIR,
            FileKind::Symlink => S_IFLNK,
            FileKind::Fifo => S_IFIFO,
            FileKind::Socket => S_IFSOCK,
            FileKind::CharDev => S_IFCHR,
            FileKind::BlockDev => S_IFBLK,
        }
    }

    /// A stable one-byte code, used in the journal and checkpoints.
    pub fn code(self) -> u8 {
        match self {
            FileKind::File => 1,
            FileKind::Dir => 2,
            FileKind::Symlink => 3,
            FileKind::Fifo => 4,
            FileKind::Socket => 5,
            FileKind::CharDev => 6,
            FileKind::BlockDev => 7,
        }
    }

    /// Inverse of [`FileKind::code`].
    pub fn from_code(c: u8) -> Option<FileKind> {
        Some(match c {
            1 => FileKind::File,
            2 => FileKind::Dir,
            3 => FileKind::Symlink,
            4 => FileKind::Fifo,
            5 => FileKind::Socket,
            6 => FileKind::CharDev,
            7 => FileKind::BlockDev,
            _ => return None,
        })
    }
}

/// Attributes of one inode, as getattr returns them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub id: InodeId,
    /// Distinguishes successive inodes that reuse one id (NFS/FUSE generation).
    pub generation: u64,
    /// Type and permission bits, as st_mode.
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// 512-byte blocks allocated, as st_blocks.
    pub blocks: u64,
    pub atime: TimeNs,
    pub mtime: TimeNs,
    pub ctime: TimeNs,
    pub btime: TimeNs,
    pub rdev: u32,
    pub blksize: u32,
}

impl Attr {
    /// Attributes of inode `id` with `mode` and `nlink`, generation 1, owned by root, empty,
    /// every time zero, 4 KiB blocks (a starting point for tests).
    pub fn new(id: InodeId, mode: u32, nlink: u32) -> Attr {
        Attr {
            id,
            generation: 1,
            mode,
            nlink,
            uid: 0,
            gid: 0,
            size: 0,
            blocks: 0,
            atime: 0,
            mtime: 0,
            ctime: 0,
            btime: 0,
            rdev: 0,
            blksize: 4096,
        }
    }

    /// The file type, from the mode bits; `None` if they name none. A server never sends
    /// such attributes and the client refuses them (EIO, see [`crate::Reply::check_attrs`]),
    /// so no caller has to guess a type.
    pub fn kind(&self) -> Option<FileKind> {
        FileKind::from_mode(self.mode)
    }
}

/// How a server rewrites the credentials of requests made with a client key (root squash,
/// as NFS's `root_squash`/`all_squash`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Squash {
    /// Credentials pass as the client sends them (the admin key; trusted clients only).
    None,
    /// uid 0 becomes the anonymous uid, gid 0 (primary or supplementary) the anonymous gid.
    Root,
    /// Every request runs as the anonymous uid and gid, without supplementary groups.
    All,
}

/// An inclusive range of user or group ids a client key may claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    pub lo: u32,
    pub hi: u32,
}

impl IdRange {
    /// True if `id` is in the range.
    pub fn contains(&self, id: u32) -> bool {
        self.lo <= id && id <= self.hi
    }
}

/// What a key may do with the credentials of its requests. Applied by the server to every
/// request before anything else looks at it (see [`KeyPolicy::apply`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyPolicy {
    pub squash: Squash,
    /// The unprivileged ids squashed credentials become (65534, "nobody", by default).
    pub anon_uid: u32,
    pub anon_gid: u32,
    /// If set, the uids a request may carry (after squashing); others are refused EPERM.
    pub uids: Option<IdRange>,
    /// If set, the primary gids a request may carry (after squashing; others are refused
    /// EPERM); supplementary groups outside it are dropped from the request.
    pub gids: Option<IdRange>,
}

/// The anonymous id squashed credentials become by default (Linux's "nobody").
pub const NOBODY: u32 = 65534;

impl KeyPolicy {
    /// No squashing, no ranges: the admin key's policy.
    pub const TRUSTED: KeyPolicy = KeyPolicy {
        squash: Squash::None,
        anon_uid: NOBODY,
        anon_gid: NOBODY,
        uids: None,
        gids: None,
    };

    /// Rewrites `cred` as the policy says, or refuses it (EPERM). A few integer compares
    /// per request, plus one pass over the supplementary groups when a rule needs it.
    pub fn apply(&self, cred: &mut Credentials) -> Result<(), crate::FsError> {
        match self.squash {
            Squash::None => {}
            Squash::Root => {
                if cred.uid == 0 {
                    cred.uid = self.anon_uid;
                }
                if cred.gid == 0 {
                    cred.gid = self.anon_gid;
                }
                for g in cred.groups.iter_mut().filter(|g| **g == 0) {
                    *g = self.anon_gid;
                }
            }
            Squash::All => {
                cred.uid = self.anon_uid;
                cred.gid = self.anon_gid;
                cred.groups.clear();
            }
        }
        // The anonymous ids are always allowed: squashing must not make a request fail.
        if let Some(r) = self.uids
            && cred.uid != self.anon_uid
            && !r.contains(cred.uid)
        {
            return Err(crate::fs_err!(
                EPERM,
                "uid {} is outside the range {}-{} this client's key may claim",
                cred.uid,
                r.lo,
                r.hi
            ));
        }
        if let Some(r) = self.gids {
            if cred.gid != self.anon_gid && !r.contains(cred.gid) {
                return Err(crate::fs_err!(
                    EPERM,
                    "gid {} is outside the range {}-{} this client's key may claim",
                    cred.gid,
                    r.lo,
                    r.hi
                ));
            }
            let anon = self.anon_gid;
            cred.groups.retain(|&g| g == anon || r.contains(g));
        }
        Ok(())
    }
}

/// A client key as `kochab key list` shows it (never its secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    pub id: u32,
    pub policy: KeyPolicy,
    pub revoked: bool,
    /// What the admin said the key is for.
    pub note: String,
}

/// Who is asking. Checked against permission bits on the server, after the server applied
/// the connection's key policy (root squash, id ranges) to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (bounded by `MAX_GROUPS` when decoded on a server).
    pub groups: Vec<u32>,
}

/// Most supplementary groups a request may carry (Linux NGROUPS_MAX is 65536, but NFS's
/// AUTH_SYS carries 16; 64 is generous and keeps requests small).
pub const MAX_GROUPS: usize = 64;

impl Credentials {
    /// The superuser.
    pub fn root() -> Self {
        Credentials {
            uid: 0,
            gid: 0,
            groups: Vec::new(),
        }
    }

    /// A user with one primary group and no supplementary groups.
    pub fn user(uid: u32, gid: u32) -> Self {
        Credentials {
            uid,
            gid,
            groups: Vec::new(),
        }
    }

    /// True for uid 0, which bypasses permission bits as CAP_DAC_OVERRIDE does.
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// True if `gid` is the primary or a supplementary group (in_group_p).
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// A timestamp in a setattr request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeSet {
    /// The server's clock (UTIME_NOW).
    Now,
    /// An explicit time.
    At(TimeNs),
}

/// Which attributes a setattr changes; `None` leaves one alone (UTIME_OMIT for times).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttrs {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    /// Always refused (EPERM): only the server sets the change time. Kept so that a request
    /// asking for it gets a clear error rather than a silent ignore.
    pub ctime: Option<TimeNs>,
}

/// One entry returned by readdir.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Where to resume after this entry; stays valid while the directory changes.
    pub cookie: u64,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub id: InodeId,
    pub kind: FileKind,
    /// Readdirplus: the child's attributes when the caller may search the directory (as a
    /// stat of the entry would need) and this server holds the child. `None` means exactly
    /// that: ask for them with a getattr; it never stands for default attributes.
    pub attr: Option<Attr>,
}

/// File-system totals, as statfs(2) reports them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}
