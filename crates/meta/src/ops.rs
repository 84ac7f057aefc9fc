//! The namespace operations with their POSIX rules: checks in the order the Linux VFS makes
//! them (so the errno a program sees matches ext4), then mutations. Timestamps and link
//! counts change exactly as ext4 changes them.

use crate::dir::{COOKIE_DOT, COOKIE_DOTDOT};
use crate::engine::{Engine, Fail, OpResult};
use crate::inode::Inode;
use crate::mutation::Mutation;
use crate::name::{Name, is_dot_or_dotdot, validate_name};
use crate::perm::{check_access, check_may_link, check_sticky, is_owner};
use kochab_proto::access::{R_OK, W_OK, X_OK};
use kochab_proto::mode::*;
use kochab_proto::rename_flags::*;
use kochab_proto::xattr_flags::*;
use kochab_proto::*;
use std::collections::BTreeMap;

/// Most entries one readdir reply carries; bounds the reply frame.
pub const READDIR_MAX_ENTRIES: u32 = 4096;
/// Bytes of extended attributes one inode may hold: each attribute counts its name, its
/// value and [`XATTR_ENTRY_OVERHEAD`]. Room for one value of the largest size Linux allows
/// (XATTR_SIZE_MAX, 64 KiB) and as much again in others (ext4 holds about 4 KiB, XFS far
/// more). They live in memory with the inode and are written whole with its checkpoint box,
/// so this bounds both: 64 inodes at the limit stay within the checkpoint's box-image limit
/// (`kochab_server::checkpoint::BOX_IMAGE_BYTES_MAX`, checked by a test there).
pub const XATTR_TOTAL_MAX: usize = 128 << 10;
/// What each attribute counts towards [`XATTR_TOTAL_MAX`] beyond its name and value (its
/// share of the map and of the encoded lengths), so that many tiny attributes cannot weigh
/// more than they are charged.
pub const XATTR_ENTRY_OVERHEAD: usize = 16;

fn fs<T>(e: FsError) -> OpResult<T> {
    Err(Fail::Fs(e))
}

/// ext4_inc_count: a directory's link count saturates at 1 past LINK_MAX subdirectories.
fn inc_dir_nlink(dir: &mut Inode) {
    dir.nlink += 1;
    // "> EXT4_LINK_MAX" as in ext4: 64998 subdirectories still show 65000.
    if dir.nlink > LINK_MAX || dir.nlink == 2 {
        dir.nlink = 1;
    }
}

/// ext4_dec_count.
fn dec_dir_nlink(dir: &mut Inode) {
    if dir.nlink > 2 {
        dir.nlink -= 1;
    }
}

/// mode_strip_sgid: a new non-directory in a setgid directory loses S_ISGID (when it is
/// group-executable) unless the creator is in the directory's group.
fn strip_sgid(m: u32, parent: &Inode, cred: &Credentials) -> u32 {
    let both = S_ISGID | S_IXGRP;
    if m & both != both || m & S_IFMT == S_IFDIR || parent.mode & S_ISGID == 0 {
        return m;
    }
    if cred.is_root() || cred.in_group(parent.gid) {
        return m;
    }
    m & !S_ISGID
}

/// setattr_should_drop_sgid: a file's setgid bit goes with a chown or a truncate when it is
/// group-executable, or when the caller is neither root nor in the file's group `gid`.
fn drops_sgid(m: u32, gid: u32, cred: &Credentials) -> bool {
    m & S_ISGID != 0 && (m & S_IXGRP != 0 || !(cred.is_root() || cred.in_group(gid)))
}

/// The length rules of an extended-attribute name (ERANGE, as strncpy_from_user reports them).
fn xattr_name_check(name: &[u8]) -> OpResult<()> {
    if name.is_empty() || name.len() > XATTR_NAME_MAX {
        return fs(fs_err!(
            ERANGE,
            "xattr name of {} bytes (1..={XATTR_NAME_MAX} allowed)",
            name.len()
        ));
    }
    if name.contains(&0) {
        return fs(fs_err!(EINVAL, "xattr name contains NUL"));
    }
    Ok(())
}

/// The group of a new inode: the directory's if it is setgid, else the creator's.
fn new_gid(parent: &Inode, cred: &Credentials) -> u32 {
    if parent.mode & S_ISGID != 0 {
        parent.gid
    } else {
        cred.gid
    }
}

/// Inodes an operation changes, by id; aliasing (the same directory as both parents) is
/// handled by keeping one copy per id.
#[derive(Default)]
struct Changes {
    inodes: BTreeMap<InodeId, Inode>,
}

impl Changes {
    fn load<'a>(&'a mut self, engine: &Engine, id: InodeId) -> OpResult<&'a mut Inode> {
        match self.inodes.entry(id) {
            std::collections::btree_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::btree_map::Entry::Vacant(e) => Ok(e.insert(engine.get(id)?.clone())),
        }
    }

    fn put(&mut self, id: InodeId, inode: Inode) {
        self.inodes.insert(id, inode);
    }

    fn emit(self, out: &mut Vec<Mutation>) {
        for (id, inode) in self.inodes {
            out.push(Mutation::PutInode { id, inode });
        }
    }
}

impl Engine {
    pub(crate) fn dispatch(
        &mut self,
        cred: &Credentials,
        op: &Op,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        if cred.groups.len() > MAX_GROUPS {
            return fs(fs_err!(
                EINVAL,
                "{} supplementary groups exceed {MAX_GROUPS}",
                cred.groups.len()
            ));
        }
        match op {
            Op::Lookup { parent, name } => self.lookup(cred, *parent, name),
            Op::GetAttr { id } => Ok(Reply::Attr(self.get(*id)?.attr(*id))),
            Op::SetAttr { id, set } => self.setattr(cred, *id, set, now, out),
            Op::Mknod {
                parent,
                name,
                mode,
                rdev,
                exclusive,
            } => self.mknod(cred, *parent, name, *mode, *rdev, *exclusive, now, out),
            Op::Mkdir { parent, name, mode } => self.mkdir(cred, *parent, name, *mode, now, out),
            Op::Symlink {
                parent,
                name,
                target,
            } => self.symlink(cred, *parent, name, target, now, out),
            Op::Link {
                id,
                new_parent,
                new_name,
            } => self.link(cred, *id, *new_parent, new_name, now, out),
            Op::Unlink { parent, name } => self.unlink(cred, *parent, name, now, out),
            Op::Rmdir { parent, name } => self.rmdir(cred, *parent, name, now, out),
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => self.rename(cred, *parent, name, *new_parent, new_name, *flags, now, out),
            Op::Readlink { id } => {
                let inode = self.get(*id)?;
                match inode.symlink() {
                    Some(t) => Ok(Reply::Bytes(t.to_vec())),
                    None => fs(fs_err!(EINVAL, "inode {id:#x} is not a symlink")),
                }
            }
            Op::Readdir {
                id,
                cookie,
                max_entries,
                plus,
            } => self.readdir(cred, *id, *cookie, *max_entries, *plus),
            Op::SetXattr {
                id,
                name,
                value,
                flags,
            } => self.setxattr(cred, *id, name, value, *flags, now, out),
            Op::GetXattr { id, name } => self.getxattr(cred, *id, name),
            Op::ListXattr { id } => self.listxattr(cred, *id),
            Op::RemoveXattr { id, name } => self.removexattr(cred, *id, name, now, out),
            Op::Access { id, mask } => {
                let inode = self.get(*id)?;
                if *mask & !7 != 0 {
                    return fs(fs_err!(EINVAL, "access mask {mask:#o} has unknown bits"));
                }
                check_access(inode, cred, *mask)?;
                Ok(Reply::Empty)
            }
            Op::StatFs => Ok(Reply::StatFs(self.statfs())),
            Op::Status => fs(fs_err!(
                ENOSYS,
                "status is answered by the server, not the engine"
            )),
            Op::Open { .. }
            | Op::Create { .. }
            | Op::Close { .. }
            | Op::CloseMany { .. }
            | Op::Read { .. }
            | Op::Write { .. }
            | Op::Fsync { .. }
            | Op::Fallocate { .. }
            | Op::GetLk { .. }
            | Op::SetLk { .. }
            | Op::ReleaseLocks { .. }
            | Op::EndSession
            | Op::KeyAdd { .. }
            | Op::KeyList
            | Op::KeyRevoke { .. }
            | Op::GetMap
            | Op::Control { .. }
            | Op::DataGrant { .. }
            | Op::CommitSlices { .. }
            | Op::Layout { .. } => fs(fs_err!(
                ENOSYS,
                "{} is answered by the server's session layer",
                op.name()
            )),
            Op::Fsck => {
                if !cred.is_root() {
                    return fs(fs_err!(EPERM, "fsck needs root"));
                }
                Ok(Reply::Problems(self.check_invariants()))
            }
            Op::FsckLinks { after } => {
                if !cred.is_root() {
                    return fs(fs_err!(EPERM, "fsck needs root"));
                }
                Ok(Reply::Links(self.links_page(*after)))
            }
            Op::FsckInodes { ids } => {
                if !cred.is_root() {
                    return fs(fs_err!(EPERM, "fsck needs root"));
                }
                if ids.len() > kochab_proto::links::FSCK_IDS_MAX {
                    return fs(fs_err!(
                        EINVAL,
                        "fsck asks about {} inodes at once, more than {}",
                        ids.len(),
                        kochab_proto::links::FSCK_IDS_MAX
                    ));
                }
                Ok(Reply::InodeLinks(self.inode_links(ids)))
            }
        }
    }

    fn statfs(&self) -> StatFs {
        let (inodes, _) = self.counts();
        let files = 1u64 << 48;
        StatFs {
            blocks: 0,
            bfree: 0,
            bavail: 0,
            files,
            ffree: files - inodes,
            bsize: 4096,
            namelen: NAME_MAX as u32,
            frsize: 4096,
        }
    }

    fn lookup(&self, cred: &Credentials, parent: InodeId, name: &[u8]) -> OpResult<Reply> {
        let p = self.get_dir(parent)?;
        check_access(p, cred, X_OK)?;
        // The VFS walks to the directory (checking x) before the file system sees the name.
        validate_name(name)?;
        let id = match name {
            b"." => parent,
            b".." => p.dir().map_or(parent, |d| d.parent),
            _ => match self.entry(parent, name)? {
                Some(e) => e.child,
                None => {
                    return fs(fs_err!(
                        ENOENT,
                        "no entry {:?} in {parent:#x}",
                        String::from_utf8_lossy(name)
                    ));
                }
            },
        };
        if self.member && self.table_index(id).is_none() {
            // The name is here, the inode in a table another server holds: its owner
            // answers for the attributes.
            return Ok(Reply::Child { id });
        }
        Ok(Reply::Entry(self.get(id)?.attr(id)))
    }

    /// Common checks of every create: a valid, free name in a writable directory with room
    /// in the entry's hash bucket.
    fn check_create(&self, cred: &Credentials, parent: InodeId, name: &[u8]) -> OpResult<()> {
        let p = self.get_dir(parent)?;
        check_access(p, cred, X_OK)?;
        validate_name(name)?;
        if is_dot_or_dotdot(name) || self.entry(parent, name)?.is_some() {
            return fs(fs_err!(
                EEXIST,
                "{:?} exists",
                String::from_utf8_lossy(name)
            ));
        }
        check_access(p, cred, W_OK | X_OK)?;
        if p.nlink == 0 {
            return fs(fs_err!(ENOENT, "directory {parent:#x} has been removed"));
        }
        self.check_bucket_room(parent, name)
    }

    fn check_bucket_room(&self, parent: InodeId, name: &[u8]) -> OpResult<()> {
        let hash = self.name_hash(name);
        let full = self
            .table(parent)?
            .entries(parent)
            .is_some_and(|e| !e.has_room(hash, name));
        if full {
            return fs(fs_err!(
                ENOSPC,
                "too many names with the same hash in {parent:#x}"
            ));
        }
        Ok(())
    }

    /// Emits the mutations of a new inode `child` named `parent/name`, applies them and
    /// replies with its attributes.
    #[allow(clippy::too_many_arguments)]
    fn finish_create(
        &mut self,
        parent: InodeId,
        mut p: Inode,
        name: &[u8],
        id: InodeId,
        child: Inode,
        claim: crate::alloc::Claim,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        let start = out.len();
        p.mtime = now;
        p.ctime = now;
        let kind = child.kind();
        let attr = child.attr(id);
        out.push(Mutation::PutInode { id, inode: child });
        out.push(Mutation::PutInode {
            id: parent,
            inode: p,
        });
        claim.emit(out);
        out.push(Mutation::PutDentry {
            parent,
            name: Name::new(name),
            child: id,
            kind,
        });
        self.apply_live(&out[start..]);
        Ok(Reply::Entry(attr))
    }

    #[allow(clippy::too_many_arguments)]
    fn mknod(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode_in: u32,
        rdev: u32,
        exclusive: bool,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        let type_bits = if mode_in & S_IFMT == 0 {
            S_IFREG
        } else {
            mode_in & S_IFMT
        };
        let is_device = match FileKind::from_mode(type_bits) {
            Some(FileKind::File | FileKind::Fifo | FileKind::Socket) => false,
            Some(FileKind::CharDev | FileKind::BlockDev) => true,
            // may_mknod: directories are made with mkdir (EPERM), unknown types are EINVAL.
            Some(FileKind::Dir) => return fs(fs_err!(EPERM, "mknod cannot create directories")),
            _ => return fs(fs_err!(EINVAL, "mknod cannot create mode {mode_in:#o}")),
        };
        if !exclusive && type_bits == S_IFREG {
            // open(O_CREAT) without O_EXCL: an existing regular file is opened, not an error.
            let p = self.get_dir(parent)?;
            check_access(p, cred, X_OK)?;
            validate_name(name)?;
            if is_dot_or_dotdot(name) {
                // open_last_lookups: O_CREAT on "." or ".." is EISDIR (EEXIST only with O_EXCL).
                return fs(fs_err!(
                    EISDIR,
                    "{:?} is a directory",
                    String::from_utf8_lossy(name)
                ));
            }
            if let Some(e) = self.entry(parent, name)? {
                let child = e.child;
                let inode = self.get(child)?;
                if inode.is_dir() {
                    return fs(fs_err!(
                        EISDIR,
                        "{:?} is a directory",
                        String::from_utf8_lossy(name)
                    ));
                }
                return Ok(Reply::Entry(inode.attr(child)));
            }
        }
        self.check_create(cred, parent, name)?;
        if is_device && !cred.is_root() {
            return fs(fs_err!(EPERM, "only root may create device nodes"));
        }
        let mut p = self.get(parent)?.clone();
        let (id, claim) = self.alloc_file(parent, p.dir_mut())?;
        let gid = new_gid(&p, cred);
        let m = strip_sgid(type_bits | (mode_in & PERM_MASK), &p, cred);
        let mut child = Inode::new(m, cred.uid, gid, now);
        child.rdev = if is_device { rdev } else { 0 };
        self.finish_create(parent, p, name, id, child, claim, now, out)
    }

    fn mkdir(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode_in: u32,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        self.check_create(cred, parent, name)?;
        let mut p = self.get(parent)?.clone();
        let (id, claim) = self.alloc_dir(parent, p.dir_mut())?;
        let mut m = S_IFDIR | (mode_in & (0o777 | S_ISVTX));
        if p.mode & S_ISGID != 0 {
            m |= S_ISGID;
        }
        let mut child = Inode::new(m, cred.uid, new_gid(&p, cred), now);
        child.nlink = 2;
        child.dir_mut().parent = parent;
        inc_dir_nlink(&mut p);
        self.finish_create(parent, p, name, id, child, claim, now, out)
    }

    fn symlink(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        target: &[u8],
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        if target.is_empty() {
            return fs(fs_err!(ENOENT, "empty symlink target"));
        }
        if target.len() > SYMLINK_MAX {
            return fs(fs_err!(
                ENAMETOOLONG,
                "symlink target of {} bytes exceeds {SYMLINK_MAX}",
                target.len()
            ));
        }
        if target.contains(&0) {
            return fs(fs_err!(EINVAL, "symlink target contains NUL"));
        }
        self.check_create(cred, parent, name)?;
        let mut p = self.get(parent)?.clone();
        let (id, claim) = self.alloc_file(parent, p.dir_mut())?;
        let mut child = Inode::new(S_IFLNK | 0o777, cred.uid, new_gid(&p, cred), now);
        child.size = target.len() as u64;
        child.extra.get_or_insert_with(Default::default).symlink = Some(target.to_vec());
        self.finish_create(parent, p, name, id, child, claim, now, out)
    }

    fn link(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        new_parent: InodeId,
        new_name: &[u8],
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        let inode = self.get(id)?;
        let np = self.get_dir(new_parent)?;
        check_access(np, cred, X_OK)?;
        validate_name(new_name)?;
        // A removed directory (open, nlink 0) takes no new names, as IS_DEADDIR in the VFS:
        // its entries would vanish with it at its last close.
        if np.nlink == 0 && !is_dot_or_dotdot(new_name) {
            return fs(fs_err!(
                ENOENT,
                "directory {new_parent:#x} has been removed"
            ));
        }
        if is_dot_or_dotdot(new_name) || self.entry(new_parent, new_name)?.is_some() {
            return fs(fs_err!(
                EEXIST,
                "{:?} exists",
                String::from_utf8_lossy(new_name)
            ));
        }
        check_may_link(inode, cred)?;
        check_access(np, cred, W_OK | X_OK)?;
        if inode.is_dir() {
            return fs(fs_err!(EPERM, "hard links to directories are not allowed"));
        }
        if inode.nlink == 0 {
            return fs(fs_err!(ENOENT, "inode {id:#x} has been unlinked"));
        }
        if inode.nlink >= LINK_MAX {
            return fs(fs_err!(
                EMLINK,
                "inode {id:#x} already has {} links",
                inode.nlink
            ));
        }
        self.check_bucket_room(new_parent, new_name)?;
        let mut ch = Changes::default();
        let i = ch.load(self, id)?;
        i.nlink += 1;
        i.ctime = now;
        let kind = i.kind();
        let p = ch.load(self, new_parent)?;
        p.mtime = now;
        p.ctime = now;
        let attr = ch.inodes[&id].attr(id);
        let start = out.len();
        ch.emit(out);
        out.push(Mutation::PutDentry {
            parent: new_parent,
            name: Name::new(new_name),
            child: id,
            kind,
        });
        self.apply_live(&out[start..]);
        Ok(Reply::Entry(attr))
    }

    /// Lookup for a removal: parent, its entry and the victim, with the checks of the VFS's
    /// may_delete in its order.
    fn may_delete(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
    ) -> OpResult<(InodeId, FileKind)> {
        let p = self.get_dir(parent)?;
        check_access(p, cred, X_OK)?;
        validate_name(name)?;
        let Some(e) = self.entry(parent, name)? else {
            return fs(fs_err!(
                ENOENT,
                "no entry {:?} in {parent:#x}",
                String::from_utf8_lossy(name)
            ));
        };
        let (child, kind) = (e.child, e.kind);
        check_access(p, cred, W_OK | X_OK)?;
        check_sticky(p, self.get(child)?, cred)?;
        Ok((child, kind))
    }

    /// Emits the removal of one name of `child` (already dropped from its directory by the
    /// caller): the inode loses a link and goes away with its last one.
    fn unlink_inode(
        ch: &mut Changes,
        engine: &Engine,
        child: InodeId,
        now: TimeNs,
        drops: &mut Vec<Mutation>,
    ) -> OpResult<()> {
        let open = engine.open_count(child) > 0;
        let c = ch.load(engine, child)?;
        c.nlink = c.nlink.saturating_sub(1);
        c.ctime = now;
        // An open file keeps its inode (and data) until its last close.
        if c.nlink == 0 && !open {
            let (generation, data) = (c.btime as u64, c.is_regular() && c.may_have_data);
            ch.inodes.remove(&child);
            drops.push(Mutation::DropInode { id: child });
            if data {
                drops.push(Mutation::PutReclaim {
                    id: child,
                    generation,
                    from: 0,
                });
            }
        }
        Ok(())
    }

    /// The removal of an empty directory's inode whose last name went: an open directory
    /// lives on with nlink 0 (no entries can be made in it) until its last close, as any
    /// open object does; `close_ref` then drops it.
    fn remove_dir_inode(&self, dir: InodeId, now: TimeNs) -> OpResult<Mutation> {
        if self.open_count(dir) == 0 {
            return Ok(Mutation::DropInode { id: dir });
        }
        let mut inode = self.get(dir)?.clone();
        inode.nlink = 0;
        inode.ctime = now;
        Ok(Mutation::PutInode { id: dir, inode })
    }

    /// After the last entry of `dir` goes, its file allocator restarts at the beginning of
    /// its own range, so ids of deleted files are reused.
    fn maybe_rewind_allocator(&self, dir_id: InodeId, dir: &mut Inode, entries_left: u64) {
        if entries_left == 0
            && let Some((lo, hi)) = self.policy.own_file_range(dir_id)
        {
            let d = dir.dir_mut();
            d.file_next = lo;
            d.file_end = hi;
        }
    }

    fn unlink(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        // do_unlinkat resolves the parent (ENOENT, ENOTDIR, EACCES) before it looks at the dots.
        check_access(self.get_dir(parent)?, cred, X_OK)?;
        if is_dot_or_dotdot(name) {
            return fs(fs_err!(
                EISDIR,
                "cannot unlink {:?}",
                String::from_utf8_lossy(name)
            ));
        }
        let (child, kind) = self.may_delete(cred, parent, name)?;
        if kind == FileKind::Dir {
            return fs(fs_err!(
                EISDIR,
                "{:?} is a directory",
                String::from_utf8_lossy(name)
            ));
        }
        let mut ch = Changes::default();
        let mut drops = Vec::new();
        Self::unlink_inode(&mut ch, self, child, now, &mut drops)?;
        let left = self.entry_count(parent)? - 1;
        let p = ch.load(self, parent)?;
        p.mtime = now;
        p.ctime = now;
        let mut pc = p.clone();
        self.maybe_rewind_allocator(parent, &mut pc, left);
        ch.put(parent, pc);
        let start = out.len();
        out.push(Mutation::DropDentry {
            parent,
            name: Name::new(name),
        });
        out.append(&mut drops);
        ch.emit(out);
        self.apply_live(&out[start..]);
        Ok(Reply::Empty)
    }

    fn rmdir(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        // As in do_rmdir: the parent first, then the dots.
        check_access(self.get_dir(parent)?, cred, X_OK)?;
        match name {
            b"." => return fs(fs_err!(EINVAL, "cannot remove \".\"")),
            b".." => return fs(fs_err!(ENOTEMPTY, "cannot remove \"..\"")),
            _ => {}
        }
        let (child, kind) = self.may_delete(cred, parent, name)?;
        if kind != FileKind::Dir {
            return fs(fs_err!(
                ENOTDIR,
                "{:?} is not a directory",
                String::from_utf8_lossy(name)
            ));
        }
        if child == self.root() {
            return fs(fs_err!(EBUSY, "cannot remove the root"));
        }
        if self.entry_count(child)? > 0 {
            return fs(fs_err!(
                ENOTEMPTY,
                "directory {:?} is not empty",
                String::from_utf8_lossy(name)
            ));
        }
        let left = self.entry_count(parent)? - 1;
        let mut p = self.get(parent)?.clone();
        dec_dir_nlink(&mut p);
        p.mtime = now;
        p.ctime = now;
        self.maybe_rewind_allocator(parent, &mut p, left);
        let start = out.len();
        out.push(Mutation::DropDentry {
            parent,
            name: Name::new(name),
        });
        out.push(self.remove_dir_inode(child, now)?);
        out.push(Mutation::PutInode {
            id: parent,
            inode: p,
        });
        self.apply_live(&out[start..]);
        Ok(Reply::Empty)
    }

    /// True if `ancestor` is `dir` or lies on the parent chain from `dir` to the root.
    fn is_ancestor(&self, ancestor: InodeId, dir: InodeId) -> OpResult<bool> {
        let root = self.root();
        let mut cur = dir;
        // Bounded walk: a longer chain than this means a corrupted parent link.
        for _ in 0..1_000_000 {
            if cur == ancestor {
                return Ok(true);
            }
            if cur == root {
                return Ok(false);
            }
            cur = self.get(cur)?.dir().map_or(root, |d| d.parent);
        }
        fs(fs_err!(
            ELOOP,
            "parent chain of {dir:#x} does not reach the root"
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn rename(
        &mut self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        new_parent: InodeId,
        new_name: &[u8],
        flags: u32,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) != 0
            || flags & (RENAME_NOREPLACE | RENAME_EXCHANGE) == (RENAME_NOREPLACE | RENAME_EXCHANGE)
        {
            return fs(fs_err!(EINVAL, "invalid rename flags {flags:#x}"));
        }
        if flags & RENAME_WHITEOUT != 0 {
            return fs(fs_err!(EINVAL, "RENAME_WHITEOUT is not supported"));
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        // The checks of do_renameat2 and vfs_rename, in their order: both parents are
        // resolved first, then the dots, then each name as it is looked up.
        check_access(self.get_dir(parent)?, cred, X_OK)?;
        check_access(self.get_dir(new_parent)?, cred, X_OK)?;
        if is_dot_or_dotdot(name) {
            return fs(fs_err!(EBUSY, "cannot rename \".\" or \"..\""));
        }
        if is_dot_or_dotdot(new_name) {
            // do_renameat2 answers EEXIST here when RENAME_NOREPLACE is set.
            return if flags & RENAME_NOREPLACE != 0 {
                fs(fs_err!(
                    EEXIST,
                    "{:?} exists",
                    String::from_utf8_lossy(new_name)
                ))
            } else {
                fs(fs_err!(EBUSY, "cannot rename onto \".\" or \"..\""))
            };
        }
        validate_name(name)?;
        let Some((src, src_kind)) = self.entry(parent, name)?.map(|e| (e.child, e.kind)) else {
            return fs(fs_err!(
                ENOENT,
                "no entry {:?} in {parent:#x}",
                String::from_utf8_lossy(name)
            ));
        };
        validate_name(new_name)?;
        // As in link: a removed directory takes no new names (the lookup of the target in a
        // dead directory is ENOENT).
        if self.get(new_parent)?.nlink == 0 {
            return fs(fs_err!(
                ENOENT,
                "directory {new_parent:#x} has been removed"
            ));
        }
        let dst = self.entry(new_parent, new_name)?.map(|e| (e.child, e.kind));
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return fs(fs_err!(
                EEXIST,
                "{:?} exists",
                String::from_utf8_lossy(new_name)
            ));
        }
        // The inode an exchange swaps with; it must exist.
        let swapped = match (exchange, dst) {
            (true, None) => {
                return fs(fs_err!(
                    ENOENT,
                    "RENAME_EXCHANGE target {:?} does not exist",
                    String::from_utf8_lossy(new_name)
                ));
            }
            (true, Some(d)) => Some(d),
            (false, _) => None,
        };
        let src_is_dir = src_kind == FileKind::Dir;
        let dst_is_dir = dst.is_some_and(|(_, k)| k == FileKind::Dir);
        if parent != new_parent {
            if src_is_dir && self.is_ancestor(src, new_parent)? {
                return fs(fs_err!(
                    EINVAL,
                    "cannot move a directory into its own subtree"
                ));
            }
            if let Some((d, _)) = dst.filter(|_| dst_is_dir)
                && self.is_ancestor(d, parent)?
            {
                // do_renameat2's trap check: ENOTEMPTY, or EINVAL when exchanging.
                return if exchange {
                    fs(fs_err!(
                        EINVAL,
                        "cannot exchange a directory with its own descendant"
                    ))
                } else {
                    fs(fs_err!(ENOTEMPTY, "target directory contains the source"))
                };
            }
        }
        if dst.is_some_and(|(d, _)| d == src) {
            // Two names of one inode (or the same name): POSIX says do nothing.
            return Ok(Reply::Empty);
        }
        let p = self.get(parent)?;
        check_access(p, cred, W_OK | X_OK)?;
        check_sticky(p, self.get(src)?, cred)?;
        let np = self.get(new_parent)?;
        check_access(np, cred, W_OK | X_OK)?;
        if let Some((d, _)) = dst {
            check_sticky(np, self.get(d)?, cred)?;
            if !exchange {
                if src_is_dir && !dst_is_dir {
                    return fs(fs_err!(
                        ENOTDIR,
                        "cannot replace non-directory {:?} with a directory",
                        String::from_utf8_lossy(new_name)
                    ));
                }
                if !src_is_dir && dst_is_dir {
                    return fs(fs_err!(
                        EISDIR,
                        "cannot replace directory {:?} with a non-directory",
                        String::from_utf8_lossy(new_name)
                    ));
                }
            }
        }
        if src == self.root() || dst.is_some_and(|(d, _)| d == self.root()) {
            return fs(fs_err!(EBUSY, "cannot rename the root"));
        }
        // A directory moving to a new parent rewrites its "..": it must be writable.
        let moves = |is_dir: bool, from: InodeId, to: InodeId| is_dir && from != to;
        if moves(src_is_dir, parent, new_parent) {
            check_access(self.get(src)?, cred, W_OK)?;
        }
        if let Some((d, _)) = swapped.filter(|_| moves(dst_is_dir, new_parent, parent)) {
            check_access(self.get(d)?, cred, W_OK)?;
        }
        if !exchange {
            if let Some((d, _)) = dst.filter(|_| dst_is_dir)
                && self.entry_count(d)? > 0
            {
                return fs(fs_err!(
                    ENOTEMPTY,
                    "directory {:?} is not empty",
                    String::from_utf8_lossy(new_name)
                ));
            }
            if dst.is_none() {
                self.check_bucket_room(new_parent, new_name)?;
            }
        }

        let mut ch = Changes::default();
        let mut drops = Vec::new();
        let mut dentries = vec![Mutation::DropDentry {
            parent,
            name: Name::new(name),
        }];
        for p in [parent, new_parent] {
            let p = ch.load(self, p)?;
            p.mtime = now;
            p.ctime = now;
        }
        ch.load(self, src)?.ctime = now;
        if let Some((d, dk)) = swapped {
            ch.load(self, d)?.ctime = now;
            dentries = vec![
                Mutation::PutDentry {
                    parent,
                    name: Name::new(name),
                    child: d,
                    kind: dk,
                },
                Mutation::PutDentry {
                    parent: new_parent,
                    name: Name::new(new_name),
                    child: src,
                    kind: src_kind,
                },
            ];
            if moves(dst_is_dir, new_parent, parent) {
                ch.load(self, d)?.dir_mut().parent = parent;
                dec_dir_nlink(ch.load(self, new_parent)?);
                inc_dir_nlink(ch.load(self, parent)?);
            }
        } else {
            if let Some((d, _)) = dst {
                if dst_is_dir {
                    ch.inodes.remove(&d);
                    drops.push(self.remove_dir_inode(d, now)?);
                    dec_dir_nlink(ch.load(self, new_parent)?);
                } else {
                    Self::unlink_inode(&mut ch, self, d, now, &mut drops)?;
                }
            }
            dentries.push(Mutation::PutDentry {
                parent: new_parent,
                name: Name::new(new_name),
                child: src,
                kind: src_kind,
            });
        }
        if moves(src_is_dir, parent, new_parent) {
            ch.load(self, src)?.dir_mut().parent = new_parent;
            dec_dir_nlink(ch.load(self, parent)?);
            inc_dir_nlink(ch.load(self, new_parent)?);
        }
        if !exchange && parent != new_parent {
            let left = self.entry_count(parent)? - 1;
            let mut p = ch.load(self, parent)?.clone();
            self.maybe_rewind_allocator(parent, &mut p, left);
            ch.put(parent, p);
        }
        let start = out.len();
        out.append(&mut dentries);
        out.append(&mut drops);
        ch.emit(out);
        self.apply_live(&out[start..]);
        Ok(Reply::Empty)
    }

    fn setattr(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        set: &SetAttrs,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        let old = self.get(id)?;
        // The change time records when the server changed the inode; nobody may set it, root
        // included: Linux offers no call that does (notify_change always sets it to the
        // current time) and a FUSE kernel asks only in writeback-cache mode, which the mount
        // does not use (and the mount drops it anyway: every setattr sets ctime to now).
        if set.ctime.is_some() {
            return fs(fs_err!(EPERM, "the change time cannot be set"));
        }
        let owner = is_owner(old, cred);
        if set.mode.is_some() && old.mode & S_IFMT == S_IFLNK {
            // notify_change refuses mode changes of symlinks (Linux 6.6+), before any other check.
            return fs(fs_err!(EOPNOTSUPP, "the mode of a symlink cannot change"));
        }
        if let Some(size) = set.size {
            if old.is_dir() {
                return fs(fs_err!(EISDIR, "cannot truncate a directory"));
            }
            if !old.is_regular() {
                return fs(fs_err!(EINVAL, "cannot truncate a non-regular file"));
            }
            if size > FILE_BYTES_MAX {
                return fs(fs_err!(
                    EFBIG,
                    "size {size} exceeds the largest file size {FILE_BYTES_MAX}"
                ));
            }
            check_access(old, cred, W_OK)?;
        }
        if let Some(uid) = set.uid
            && !cred.is_root()
            && (cred.uid != old.uid || uid != old.uid)
        {
            return fs(fs_err!(EPERM, "only root may change the owner"));
        }
        if let Some(gid) = set.gid
            && !cred.is_root()
            && !(cred.uid == old.uid && (cred.in_group(gid) || gid == old.gid))
        {
            return fs(fs_err!(
                EPERM,
                "only the owner may change the group, to one of their groups"
            ));
        }
        // A mode change that only clears S_ISUID/S_ISGID, by someone who may write the file,
        // is the kernel killing privileges for a write or a truncate: without
        // FUSE_HANDLE_KILLPRIV, file_remove_privs and do_truncate send it as a setattr with
        // the writer's credentials, and ext4 lets such a writer through.
        let kill_privs = !owner
            && set.mode.is_some_and(|m| {
                let (new, cur) = (m & PERM_MASK, old.mode & PERM_MASK);
                new != cur && new & !cur == 0 && (cur & !new) & !(S_ISUID | S_ISGID) == 0
            })
            && check_access(old, cred, W_OK).is_ok();
        if set.mode.is_some() && !owner && !kill_privs {
            return fs(fs_err!(EPERM, "only the owner may change the mode"));
        }
        // utimensat turns "both now" into a touch (owner or write permission); any other time
        // change, a single "now" included, is an explicit one (ATTR_TIMES_SET): owner only.
        let touch = set.atime == Some(TimeSet::Now) && set.mtime == Some(TimeSet::Now);
        let explicit_time = !touch && (set.atime.is_some() || set.mtime.is_some());
        if explicit_time && !owner {
            return fs(fs_err!(EPERM, "only the owner may set explicit times"));
        }
        if touch && !owner {
            check_access(old, cred, W_OK)?;
        }

        let mut i = old.clone();
        if let Some(uid) = set.uid {
            i.uid = uid;
        }
        if let Some(gid) = set.gid {
            i.gid = gid;
        }
        if let Some(m) = set.mode {
            let mut m = m & PERM_MASK;
            if !kill_privs && !cred.is_root() && !cred.in_group(i.gid) {
                m &= !S_ISGID;
            }
            i.mode = (i.mode & S_IFMT) | m;
        } else if (set.uid.is_some() || set.gid.is_some()) && !i.is_dir() {
            // chown kills setuid, and setgid as setattr_should_drop_sgid decides from the
            // group the file had (ATTR_KILL_SUID/SGID).
            i.mode &= !S_ISUID;
            if drops_sgid(i.mode, old.gid, cred) {
                i.mode &= !S_ISGID;
            }
        }
        if let Some(size) = set.size {
            // truncate(2) sets mtime even when the size does not change.
            i.mtime = now;
            i.size = size;
            if !cred.is_root() && set.mode.is_none() {
                i.mode &= !S_ISUID;
                if drops_sgid(i.mode, i.gid, cred) {
                    i.mode &= !S_ISGID;
                }
            }
        }
        let resolve = |t: TimeSet| match t {
            TimeSet::Now => now,
            TimeSet::At(t) => t,
        };
        if let Some(t) = set.atime {
            i.atime = resolve(t);
        }
        if let Some(t) = set.mtime {
            i.mtime = resolve(t);
        }
        i.ctime = now;
        // Shrinking drops the data beyond the new end (and so zeros it, should the file
        // grow again); the entry is durable with the size until the data is gone. A
        // truncation to zero always drops everything (space fallocated past the end too,
        // and the file's record of a failed fsync, see the server's data service).
        let trim = match set.size {
            Some(size) if (size < old.size || size == 0) && i.may_have_data => {
                Some(Mutation::PutReclaim {
                    id,
                    generation: i.btime as u64,
                    from: size,
                })
            }
            _ => None,
        };
        // A layout (object-store data) is trimmed here too; the reclaim entry above stays
        // as on any store (the server decides what it means on its own).
        let (layout_muts, freed) = match set.size {
            Some(size) => self.trim_layout(id, size),
            None => (Vec::new(), Vec::new()),
        };
        let generation = i.btime as u64;
        let attr = i.attr(id);
        let start = out.len();
        out.push(Mutation::PutInode { id, inode: i });
        out.extend(trim);
        out.extend(layout_muts);
        self.apply_live(&out[start..]);
        self.freed_objects
            .extend(freed.into_iter().map(|o| (id, generation, o)));
        Ok(Reply::Attr(attr))
    }

    fn readdir(
        &self,
        cred: &Credentials,
        id: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> OpResult<Reply> {
        let dir = self.get_dir(id)?;
        check_access(dir, cred, R_OK)?;
        let max = max_entries.clamp(1, READDIR_MAX_ENTRIES) as usize;
        let mut entries = Vec::new();
        // Attributes need search permission, as a stat of each entry would.
        let plus = plus && check_access(dir, cred, X_OK).is_ok();
        let attr_of = |child: InodeId| {
            if plus {
                self.inode(child).map(|i| i.attr(child))
            } else {
                None
            }
        };
        if cookie == 0 {
            entries.push(DirEntry {
                cookie: COOKIE_DOT,
                name: b".".to_vec(),
                id,
                kind: FileKind::Dir,
                attr: attr_of(id),
            });
        }
        if cookie <= COOKIE_DOT {
            let parent = dir.dir().map_or(id, |d| d.parent);
            entries.push(DirEntry {
                cookie: COOKIE_DOTDOT,
                name: b"..".to_vec(),
                id: parent,
                kind: FileKind::Dir,
                attr: attr_of(parent),
            });
        }
        let mut eof = true;
        if let Some(list) = self.table(id)?.entries(id) {
            for (c, e) in list.iter_after(cookie.max(COOKIE_DOTDOT)) {
                if entries.len() >= max {
                    eof = false;
                    break;
                }
                entries.push(DirEntry {
                    cookie: c,
                    name: e.name.as_bytes().to_vec(),
                    id: e.child,
                    kind: e.kind,
                    attr: attr_of(e.child),
                });
            }
        }
        if entries.len() > max {
            // "." and ".." alone can exceed a max of 1.
            entries.truncate(max);
            eof = false;
        }
        Ok(Reply::Dir { entries, eof })
    }

    /// The namespace rules of an extended-attribute name (xattr_permission), then the
    /// permission bits for reading or writing it.
    fn xattr_check(
        &self,
        cred: &Credentials,
        id: InodeId,
        name: &[u8],
        write: bool,
    ) -> OpResult<()> {
        xattr_name_check(name)?;
        let inode = self.get(id)?;
        if name.starts_with(b"user.") {
            if !inode.is_regular() && !inode.is_dir() {
                return if write {
                    fs(fs_err!(
                        EPERM,
                        "user xattrs only on regular files and directories"
                    ))
                } else {
                    fs(fs_err!(ENODATA, "no such attribute"))
                };
            }
            if write && inode.is_dir() && inode.mode & S_ISVTX != 0 && !is_owner(inode, cred) {
                return fs(fs_err!(
                    EPERM,
                    "user xattrs of a sticky directory belong to its owner"
                ));
            }
            check_access(inode, cred, if write { W_OK } else { R_OK })?;
        } else if name.starts_with(b"trusted.") {
            if !cred.is_root() {
                return if write {
                    fs(fs_err!(EPERM, "trusted xattrs need root"))
                } else {
                    fs(fs_err!(ENODATA, "no such attribute"))
                };
            }
        } else if name.starts_with(b"security.") {
            if write && !cred.is_root() {
                return fs(fs_err!(EPERM, "security xattrs need root"));
            }
        } else if name.starts_with(b"system.") {
            return fs(fs_err!(
                EOPNOTSUPP,
                "system xattrs (POSIX ACLs) are not supported"
            ));
        } else {
            // xattr_permission checks the mode bits before the name is resolved to a handler.
            check_access(inode, cred, if write { W_OK } else { R_OK })?;
            return fs(fs_err!(EOPNOTSUPP, "unknown xattr namespace"));
        }
        if [&b"user."[..], b"trusted.", b"security."].contains(&name) {
            // xattr_resolve_name: a namespace prefix alone names no attribute.
            return fs(fs_err!(EINVAL, "xattr name is only a namespace prefix"));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn setxattr(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        name: &[u8],
        value: &[u8],
        flags: u32,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        if flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 {
            return fs(fs_err!(EINVAL, "invalid setxattr flags {flags:#x}"));
        }
        // setxattr copies in the name and the value before it looks at the inode.
        xattr_name_check(name)?;
        if value.len() > XATTR_SIZE_MAX {
            return fs(fs_err!(
                E2BIG,
                "xattr value of {} bytes exceeds {XATTR_SIZE_MAX}",
                value.len()
            ));
        }
        self.xattr_check(cred, id, name, true)?;
        let existing = self.table(id)?.xattrs(id);
        let exists = existing.is_some_and(|x| x.contains_key(name));
        if flags & XATTR_CREATE != 0 && exists {
            return fs(fs_err!(EEXIST, "xattr exists"));
        }
        if flags & XATTR_REPLACE != 0 && !exists {
            return fs(fs_err!(ENODATA, "no such attribute"));
        }
        let (mut total, mut list) = existing.map_or((0, 0), |x| {
            x.iter()
                .filter(|(k, _)| k.as_slice() != name)
                .fold((0, 0), |(t, l), (k, v)| {
                    (
                        t + k.len() + v.len() + XATTR_ENTRY_OVERHEAD,
                        l + k.len() + 1,
                    )
                })
        });
        total += name.len() + value.len() + XATTR_ENTRY_OVERHEAD;
        list += name.len() + 1;
        if total > XATTR_TOTAL_MAX || list > XATTR_LIST_MAX {
            return fs(fs_err!(
                ENOSPC,
                "no room for more extended attributes on {id:#x}"
            ));
        }
        let mut i = self.get(id)?.clone();
        i.ctime = now;
        let start = out.len();
        out.push(Mutation::SetXattr {
            id,
            name: name.to_vec(),
            value: value.to_vec(),
        });
        out.push(Mutation::PutInode { id, inode: i });
        self.apply_live(&out[start..]);
        Ok(Reply::Empty)
    }

    fn getxattr(&self, cred: &Credentials, id: InodeId, name: &[u8]) -> OpResult<Reply> {
        self.xattr_check(cred, id, name, false)?;
        match self.table(id)?.xattrs(id).and_then(|x| x.get(name)) {
            Some(v) => Ok(Reply::Bytes(v.clone())),
            None => fs(fs_err!(ENODATA, "no such attribute")),
        }
    }

    fn listxattr(&self, cred: &Credentials, id: InodeId) -> OpResult<Reply> {
        self.get(id)?;
        let mut list = Vec::new();
        if let Some(x) = self.table(id)?.xattrs(id) {
            for k in x.keys() {
                if k.starts_with(b"trusted.") && !cred.is_root() {
                    continue;
                }
                list.extend_from_slice(k);
                list.push(0);
            }
        }
        Ok(Reply::Bytes(list))
    }

    fn removexattr(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        name: &[u8],
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> OpResult<Reply> {
        self.xattr_check(cred, id, name, true)?;
        if !self
            .table(id)?
            .xattrs(id)
            .is_some_and(|x| x.contains_key(name))
        {
            return fs(fs_err!(ENODATA, "no such attribute"));
        }
        let mut i = self.get(id)?.clone();
        i.ctime = now;
        let start = out.len();
        out.push(Mutation::DropXattr {
            id,
            name: name.to_vec(),
        });
        out.push(Mutation::PutInode { id, inode: i });
        self.apply_live(&out[start..]);
        Ok(Reply::Empty)
    }
}
