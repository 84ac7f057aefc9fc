//! The metadata side of file data: open and close (an unlinked file stays until its last
//! close), the size and times a write leaves, the "may have data" mark set before a file's
//! first chunk is written, and the durable list of data to delete.

use crate::engine::{Engine, Fail, OpResult};
use crate::inode::Inode;
use crate::mutation::Mutation;
use crate::perm::check_access;
use crate::table::Reclaim;
use kochab_proto::access::{R_OK, W_OK, X_OK};
use kochab_proto::mode::{S_ISGID, S_ISUID, S_IXGRP};
use kochab_proto::{AtimeRule, Attr, Credentials, FileKind, InodeId, TimeNs, fs_err};

/// open(2) access-mode and flag bits the server looks at.
pub mod open_flags {
    pub const O_ACCMODE: u32 = 0o3;
    pub const O_RDONLY: u32 = 0o0;
    pub const O_WRONLY: u32 = 0o1;
    pub const O_RDWR: u32 = 0o2;
    pub const O_TRUNC: u32 = 0o1000;
    /// The kernel's __FMODE_EXEC: the open of execve(2), which needs execute permission
    /// only (a mode 0111 program runs); the kernel then reads the program through it.
    pub const FMODE_EXEC: u32 = 0o40;
}

/// True if `flags` allow reading.
pub fn reads(flags: u32) -> bool {
    flags & open_flags::O_ACCMODE != open_flags::O_WRONLY
}

/// True if `flags` allow writing.
pub fn writes(flags: u32) -> bool {
    matches!(
        flags & open_flags::O_ACCMODE,
        open_flags::O_WRONLY | open_flags::O_RDWR
    )
}

/// What a write by `cred` that ended at byte `end` does to its inode: size, mtime and
/// ctime, and (for a non-root writer) the setuid/setgid bits that any write clears.
pub(crate) fn written(i: &mut Inode, cred: &Credentials, end: u64, now: TimeNs) {
    i.size = i.size.max(end);
    i.mtime = now;
    i.ctime = now;
    if !cred.is_root() {
        i.mode &= !S_ISUID;
        // setattr_should_drop_sgid: with group execute, or for a writer outside the group.
        if i.mode & S_IXGRP != 0 || !cred.in_group(i.gid) {
            i.mode &= !S_ISGID;
        }
    }
}

/// relatime sets an access time at least this old on the next read, as Linux does.
const RELATIME_MAX_AGE_NS: i64 = 24 * 3600 * 1_000_000_000;

impl Engine {
    /// Checks that `cred` may open `id` with `flags` (may_open): read and write permission
    /// by the access mode, no writing to directories.
    pub fn check_open(&self, cred: &Credentials, id: InodeId, flags: u32) -> OpResult<Attr> {
        let inode = self.get(id)?;
        let mut mask = 0;
        if flags & open_flags::FMODE_EXEC != 0 {
            if inode.kind() != FileKind::File {
                return Err(Fail::Fs(fs_err!(EACCES, "only regular files are executed")));
            }
            mask |= X_OK;
        } else if reads(flags) {
            mask |= R_OK;
        }
        if writes(flags) || flags & open_flags::O_TRUNC != 0 {
            if inode.is_dir() {
                return Err(Fail::Fs(fs_err!(
                    EISDIR,
                    "cannot open a directory for writing"
                )));
            }
            mask |= W_OK;
        }
        if inode.kind() == FileKind::Symlink {
            return Err(Fail::Fs(fs_err!(ELOOP, "cannot open a symlink")));
        }
        let reclaim = flags & kochab_proto::OPEN_RECLAIM != 0;
        if !(reclaim && cred.uid == inode.uid) {
            check_access(inode, cred, mask)?;
        }
        Ok(inode.attr(id))
    }

    /// Sets the access time of `id` for a read under `rule`; true if it changed. This is
    /// not journaled: the change is made in memory and the inode's box marked dirty, so
    /// the next checkpoint (or the inode's next journaled change, which carries its whole
    /// post-image) keeps it. A crash may lose access times set since, as with lazytime;
    /// a read never waits for a journal write.
    pub fn touch_atime(&mut self, id: InodeId, rule: AtimeRule, now: TimeNs) -> bool {
        let Some(inode) = self.inode(id) else {
            return false;
        };
        let due = match rule {
            AtimeRule::Never => false,
            AtimeRule::Always => inode.atime != now,
            AtimeRule::Relative => {
                inode.atime <= inode.mtime
                    || inode.atime <= inode.ctime
                    || now.saturating_sub(inode.atime) >= RELATIME_MAX_AGE_NS
            }
        };
        if !due {
            return false;
        }
        let mut inode = inode.clone();
        inode.atime = now;
        self.apply_live(&[Mutation::PutInode { id, inode }]);
        true
    }

    /// Counts one more open handle of `id`.
    pub fn open_ref(&mut self, id: InodeId) {
        *self.open_counts.entry(id).or_insert(0) += 1;
    }

    /// Removes and returns the open-handle counts of the inodes in `lo..hi` (a table
    /// leaving this server: they travel in its manifest).
    pub fn take_open_counts(&mut self, lo: InodeId, hi: InodeId) -> Vec<(InodeId, u32)> {
        let ids: Vec<(InodeId, u32)> = self
            .open_counts
            .iter()
            .filter(|(id, _)| (lo..hi).contains(*id))
            .map(|(id, n)| (*id, *n))
            .collect();
        for (id, _) in &ids {
            self.open_counts.remove(id);
        }
        ids
    }

    /// Counts handles held open elsewhere (a table arriving from a live server).
    pub fn add_open_counts(&mut self, counts: &[(InodeId, u32)]) {
        for &(id, n) in counts {
            *self.open_counts.entry(id).or_insert(0) += n;
        }
    }

    /// Open handles of `id`.
    pub fn open_count(&self, id: InodeId) -> u32 {
        self.open_counts.get(&id).copied().unwrap_or(0)
    }

    /// Drops one open handle of `id`; if that was the last one of an unlinked inode, the
    /// inode goes now: its removal (and its data's reclaim entry) is returned to journal.
    pub fn close_ref(&mut self, id: InodeId) -> Vec<Mutation> {
        match self.open_counts.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return Vec::new();
            }
            Some(_) => {
                self.open_counts.remove(&id);
            }
            None => return Vec::new(),
        }
        self.drop_if_orphan(id)
    }

    /// If `id` has no name and no open handle, emits (and applies) its removal.
    pub fn drop_if_orphan(&mut self, id: InodeId) -> Vec<Mutation> {
        let Some(inode) = self.inode(id) else {
            return Vec::new();
        };
        if inode.nlink != 0 || self.open_count(id) != 0 {
            return Vec::new();
        }
        let mut muts = vec![Mutation::DropInode { id }];
        if inode.is_regular() && inode.may_have_data {
            muts.push(Mutation::PutReclaim {
                id,
                generation: inode.btime as u64,
                from: 0,
            });
        }
        self.apply_live(&muts);
        muts
    }

    /// Inodes with no name (open-unlinked files). After a restart nobody holds them open
    /// any more, once clients had a grace period to reopen them.
    pub fn orphans(&self) -> Vec<InodeId> {
        self.tables()
            .iter()
            .flat_map(|t| {
                t.iter_inodes()
                    .filter(|(_, i)| i.nlink == 0)
                    .map(|(id, _)| id)
            })
            .collect()
    }

    /// Marks `id` as possibly having data, before its first chunk object is created; the
    /// caller waits until the returned mutations are durable (none if already marked), so
    /// that deleting the file later can never miss an object. Once per file.
    pub fn mark_data(&mut self, id: InodeId) -> OpResult<Vec<Mutation>> {
        let inode = self.get(id)?;
        if !inode.is_regular() {
            return Err(Fail::Fs(fs_err!(
                EINVAL,
                "inode {id:#x} is not a regular file"
            )));
        }
        if inode.may_have_data {
            return Ok(Vec::new());
        }
        let mut i = inode.clone();
        i.may_have_data = true;
        let muts = vec![Mutation::PutInode { id, inode: i }];
        self.apply_live(&muts);
        Ok(muts)
    }

    /// The metadata change of a write that ended at byte `end`: size, mtime and ctime, and
    /// (for a non-root writer) the setuid/setgid bits that any write clears.
    pub fn write_done(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        end: u64,
        now: TimeNs,
    ) -> OpResult<(Vec<Mutation>, Attr)> {
        let mut i = self.get(id)?.clone();
        written(&mut i, cred, end, now);
        let attr = i.attr(id);
        let muts = vec![Mutation::PutInode { id, inode: i }];
        self.apply_live(&muts);
        Ok((muts, attr))
    }

    /// Number of reclaim entries, over all tables.
    pub fn pending_reclaim_count(&self) -> usize {
        self.tables().iter().map(|t| t.reclaim_count()).sum()
    }

    /// Up to `max` reclaim entries after `after` (by id and generation), wrapping around to
    /// the first ones: a caller that passes the last entry it got back visits every entry
    /// in turn, so one that keeps failing cannot starve the others.
    pub fn pending_reclaims(&self, after: (InodeId, u64), max: usize) -> Vec<Reclaim> {
        let later = self
            .tables()
            .iter()
            .filter(|t| t.hi > after.0)
            .flat_map(|t| t.reclaims_after(after));
        let earlier = self
            .tables()
            .iter()
            .filter(|t| t.lo <= after.0)
            .flat_map(|t| t.reclaims())
            .take_while(|r| (r.id, r.generation) <= after);
        later.chain(earlier).take(max).copied().collect()
    }

    /// The reclaim entry of one file generation (a pending trim or deletion), if any.
    pub fn reclaim_of(&self, id: InodeId, generation: u64) -> Option<Reclaim> {
        let i = self.table_index(id)?;
        self.tables[i].reclaim(id, generation).copied()
    }

    /// Marks a reclaim entry done (its data is gone), unless it grew meanwhile: then the
    /// larger entry stays for the next pass.
    pub fn finish_reclaim(&mut self, r: &Reclaim) -> Vec<Mutation> {
        let current = self.table_index(r.id).and_then(|i| {
            self.tables[i]
                .reclaims()
                .find(|e| e.id == r.id && e.generation == r.generation)
                .copied()
        });
        if current != Some(*r) {
            return Vec::new();
        }
        let muts = vec![Mutation::DropReclaim {
            id: r.id,
            generation: r.generation,
        }];
        self.apply_live(&muts);
        muts
    }
}
