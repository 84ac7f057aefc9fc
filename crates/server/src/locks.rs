//! POSIX advisory locks (fcntl byte ranges; flock arrives as whole-file ranges with the open
//! file description as owner), held on the server so that every mount sees them. Pure
//! state: the caller serializes access and decides about waiting.

use kochab_proto::{Errno, FsError, InodeId, LockKind, LockSpec, fs_err};
use rustc_hash::FxHashMap;

/// Locks one inode may carry; bounds what one client can make the server hold.
pub const LOCKS_PER_INODE_MAX: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    client: u64,
    owner: u64,
    start: u64,
    /// Inclusive.
    end: u64,
    write: bool,
    pid: u32,
}

impl Held {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    fn same_owner(&self, client: u64, owner: u64) -> bool {
        self.client == client && self.owner == owner
    }
}

/// Every lock, by inode.
#[derive(Default)]
pub struct LockTable {
    by_inode: FxHashMap<InodeId, Vec<Held>>,
}

impl LockTable {
    /// The first lock of someone else that conflicts with `want`, as F_GETLK reports it.
    pub fn conflict(&self, client: u64, id: InodeId, want: &LockSpec) -> Option<LockSpec> {
        if want.kind == LockKind::Unlock {
            return None;
        }
        let write = want.kind == LockKind::Write;
        self.by_inode
            .get(&id)?
            .iter()
            .find(|h| {
                !h.same_owner(client, want.owner)
                    && h.overlaps(want.start, want.end)
                    && (write || h.write)
            })
            .map(|h| LockSpec {
                owner: h.owner,
                start: h.start,
                end: h.end,
                kind: if h.write {
                    LockKind::Write
                } else {
                    LockKind::Read
                },
                pid: h.pid,
            })
    }

    /// Takes, changes or releases a lock (F_SETLK). A conflict is EAGAIN; the caller
    /// retries for F_SETLKW.
    pub fn set(&mut self, client: u64, id: InodeId, spec: &LockSpec) -> Result<(), FsError> {
        if spec.start > spec.end {
            return Err(fs_err!(
                EINVAL,
                "lock range {}..={} is empty",
                spec.start,
                spec.end
            ));
        }
        if spec.kind != LockKind::Unlock && self.conflict(client, id, spec).is_some() {
            return Err(FsError::new(
                Errno::EAGAIN,
                "the range is locked by another owner",
            ));
        }
        let list = self.by_inode.entry(id).or_default();
        // Cut the owner's existing locks out of the range (POSIX: a new lock replaces what
        // the same owner held there, splitting ranges as needed).
        let mut kept = Vec::with_capacity(list.len() + 2);
        for h in list.drain(..) {
            if !h.same_owner(client, spec.owner) || !h.overlaps(spec.start, spec.end) {
                kept.push(h);
                continue;
            }
            if h.start < spec.start {
                kept.push(Held {
                    end: spec.start - 1,
                    ..h
                });
            }
            if h.end > spec.end {
                kept.push(Held {
                    start: spec.end + 1,
                    ..h
                });
            }
        }
        if spec.kind != LockKind::Unlock {
            if kept.len() >= LOCKS_PER_INODE_MAX {
                *list = kept;
                return Err(fs_err!(ENOLCK, "too many locks on inode {id:#x}"));
            }
            kept.push(Held {
                client,
                owner: spec.owner,
                start: spec.start,
                end: spec.end,
                write: spec.kind == LockKind::Write,
                pid: spec.pid,
            });
        }
        if kept.is_empty() {
            self.by_inode.remove(&id);
        } else {
            *list = kept;
        }
        Ok(())
    }

    /// Releases every lock of `owner` on `id` (a descriptor was closed).
    pub fn release_owner(&mut self, client: u64, id: InodeId, owner: u64) {
        if let Some(list) = self.by_inode.get_mut(&id) {
            list.retain(|h| !h.same_owner(client, owner));
            if list.is_empty() {
                self.by_inode.remove(&id);
            }
        }
    }

    /// Releases every lock a client holds (its session ended).
    pub fn release_client(&mut self, client: u64) {
        self.by_inode.retain(|_, list| {
            list.retain(|h| h.client != client);
            !list.is_empty()
        });
    }

    /// Locks held, over all inodes.
    pub fn len(&self) -> usize {
        self.by_inode.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(owner: u64, start: u64, end: u64, kind: LockKind) -> LockSpec {
        LockSpec {
            owner,
            start,
            end,
            kind,
            pid: owner as u32,
        }
    }

    #[test]
    fn readers_share_writers_exclude() {
        let mut t = LockTable::default();
        t.set(1, 7, &lock(10, 0, 99, LockKind::Read)).unwrap();
        t.set(2, 7, &lock(20, 50, 149, LockKind::Read)).unwrap();
        assert_eq!(
            t.set(2, 7, &lock(20, 90, 95, LockKind::Write))
                .unwrap_err()
                .errno,
            Errno::EAGAIN
        );
        assert!(
            t.set(2, 7, &lock(20, 100, 149, LockKind::Write)).is_ok(),
            "no overlap with client 1"
        );
        let c = t.conflict(3, 7, &lock(30, 0, 0, LockKind::Write)).unwrap();
        assert_eq!((c.owner, c.kind), (10, LockKind::Read));
        assert!(
            t.conflict(3, 8, &lock(30, 0, u64::MAX, LockKind::Write))
                .is_none(),
            "other inode"
        );
    }

    #[test]
    fn unlocking_the_middle_splits_and_owners_never_conflict_with_themselves() {
        let mut t = LockTable::default();
        t.set(1, 7, &lock(10, 0, 99, LockKind::Write)).unwrap();
        t.set(1, 7, &lock(10, 40, 59, LockKind::Unlock)).unwrap();
        assert_eq!(t.len(), 2);
        assert!(
            t.conflict(2, 7, &lock(20, 40, 59, LockKind::Write))
                .is_none()
        );
        assert!(
            t.conflict(2, 7, &lock(20, 39, 39, LockKind::Read))
                .is_some()
        );
        // The same owner converts its own lock in place (write -> read).
        t.set(1, 7, &lock(10, 0, 99, LockKind::Read)).unwrap();
        assert_eq!(t.len(), 1);
        assert!(t.conflict(2, 7, &lock(20, 0, 99, LockKind::Read)).is_none());
        // Same owner number from another client is another owner.
        assert!(t.set(2, 7, &lock(10, 0, 0, LockKind::Write)).is_err());
    }

    #[test]
    fn releases() {
        let mut t = LockTable::default();
        t.set(1, 7, &lock(10, 0, 9, LockKind::Write)).unwrap();
        t.set(1, 8, &lock(11, 0, 9, LockKind::Write)).unwrap();
        t.set(2, 7, &lock(20, 10, 19, LockKind::Write)).unwrap();
        t.release_owner(1, 7, 10);
        assert!(t.conflict(3, 7, &lock(30, 0, 9, LockKind::Write)).is_none());
        assert!(t.conflict(3, 8, &lock(30, 0, 9, LockKind::Write)).is_some());
        t.release_client(1);
        assert_eq!(t.len(), 1);
        assert!(
            t.set(1, 7, &lock(10, 5, 4, LockKind::Read)).is_err(),
            "empty range"
        );
    }
}
