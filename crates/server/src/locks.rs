//! Advisory locks held on the server so that every mount sees them: fcntl record locks
//! (POSIX locks, owned by a process, and OFD locks, owned by an open file description) and
//! flock (whole file, owned by an open file description). As on Linux, flock and fcntl
//! locks live in separate spaces and never conflict with each other; POSIX and OFD locks
//! share one space and differ only in their owner. Every lock remembers the handle it was
//! taken through, so the last close of an open file description (the handle's `Close`)
//! drops its OFD locks and its flock; POSIX locks go earlier, when their process closes
//! any descriptor of the file (`release_owner`). Pure state: the caller serializes access
//! and decides about waiting.

use kochab_proto::{Errno, FsError, InodeId, LockKind, LockSpec, fs_err};
use rustc_hash::FxHashMap;

/// Lock ranges one inode may carry, counted after splitting (unlocking the middle of a
/// range makes two): bounds the server memory and the work of every lock request on the
/// inode. Past it a request that would add ranges fails with ENOLCK, as Linux's does when
/// it cannot allocate a lock.
pub const LOCKS_PER_INODE_MAX: usize = 4096;
/// Lock ranges one client may hold over all inodes: one client must not fill the server's
/// memory with locks on many files (64k ranges are a few MiB).
pub const LOCKS_PER_CLIENT_MAX: usize = 65_536;

/// A held lock, as it travels with its inode's table from the server that releases the
/// table to the next owner (in the table's manifest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Held {
    client: u64,
    owner: u64,
    /// The client's handle the lock was taken through.
    handle: u64,
    start: u64,
    /// Inclusive.
    end: u64,
    write: bool,
    flock: bool,
    pid: u32,
}

impl Held {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    fn same_owner(&self, client: u64, owner: u64, flock: bool) -> bool {
        self.client == client && self.owner == owner && self.flock == flock
    }
}

/// Every lock, by inode.
#[derive(Default)]
pub struct LockTable {
    by_inode: FxHashMap<InodeId, Vec<Held>>,
    /// Ranges held per client (for [`LOCKS_PER_CLIENT_MAX`]).
    per_client: FxHashMap<u64, usize>,
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
                h.flock == want.flock
                    && !h.same_owner(client, want.owner, want.flock)
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
                flock: h.flock,
            })
    }

    /// Takes, changes or releases a lock (F_SETLK, flock with LOCK_NB) taken through
    /// `handle`. A conflict is EAGAIN (the caller retries for a waiting lock); more ranges
    /// than [`LOCKS_PER_INODE_MAX`] or [`LOCKS_PER_CLIENT_MAX`] allow is ENOLCK, and the
    /// locks stay as they were.
    pub fn set(
        &mut self,
        client: u64,
        id: InodeId,
        handle: u64,
        spec: &LockSpec,
    ) -> Result<(), FsError> {
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
        let list = self.by_inode.get(&id).map_or(&[][..], Vec::as_slice);
        let (kept, delta) = replace_range(list, client, handle, spec);
        if kept.len() > list.len() {
            if kept.len() > LOCKS_PER_INODE_MAX {
                return Err(fs_err!(
                    ENOLCK,
                    "more than {LOCKS_PER_INODE_MAX} lock ranges on inode {id:#x}"
                ));
            }
            let held = self.per_client.get(&client).copied().unwrap_or(0);
            if held + delta.max(0) as usize > LOCKS_PER_CLIENT_MAX {
                return Err(fs_err!(
                    ENOLCK,
                    "this client holds {held} lock ranges, the most allowed is {LOCKS_PER_CLIENT_MAX}"
                ));
            }
        }
        self.count(client, delta);
        if kept.is_empty() {
            self.by_inode.remove(&id);
        } else {
            self.by_inode.insert(id, kept);
        }
        Ok(())
    }

    /// Releases every fcntl lock of `owner` on `id` (its process closed a descriptor of
    /// the file: POSIX semantics).
    pub fn release_owner(&mut self, client: u64, id: InodeId, owner: u64) {
        self.release_where(id, |h| h.same_owner(client, owner, false));
    }

    /// Releases every lock taken through `handle` on `id`: the last close of an open file
    /// description ends its OFD locks and its flock (its process's POSIX locks went with
    /// the close's flush already).
    pub fn release_handle(&mut self, client: u64, id: InodeId, handle: u64) {
        self.release_where(id, |h| h.client == client && h.handle == handle);
    }

    /// The inodes holding a lock of `client` taken through `handle`: for a close or a
    /// flush of a handle this server does not know, whose locks came with a table that
    /// moved here after the handle was opened elsewhere.
    pub fn inodes_of_handle(&self, client: u64, handle: u64) -> Vec<InodeId> {
        self.by_inode
            .iter()
            .filter(|(_, l)| l.iter().any(|h| h.client == client && h.handle == handle))
            .map(|(id, _)| *id)
            .collect()
    }

    fn release_where(&mut self, id: InodeId, gone: impl Fn(&Held) -> bool) {
        let Some(list) = self.by_inode.get_mut(&id) else {
            return;
        };
        let mut released: Vec<u64> = Vec::new();
        list.retain(|h| {
            let drop = gone(h);
            if drop {
                released.push(h.client);
            }
            !drop
        });
        if list.is_empty() {
            self.by_inode.remove(&id);
        }
        for client in released {
            self.count(client, -1);
        }
    }

    /// Releases every lock a client holds (its session ended).
    pub fn release_client(&mut self, client: u64) {
        self.by_inode.retain(|_, list| {
            list.retain(|h| h.client != client);
            !list.is_empty()
        });
        self.per_client.remove(&client);
    }

    fn count(&mut self, client: u64, delta: isize) {
        let n = self.per_client.entry(client).or_insert(0);
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            self.per_client.remove(&client);
        }
    }

    /// Takes out every lock on an inode in `[lo, hi)` (a table this server lets go).
    pub fn take_range(&mut self, lo: InodeId, hi: InodeId) -> Vec<(InodeId, Held)> {
        let ids: Vec<InodeId> = self
            .by_inode
            .keys()
            .copied()
            .filter(|id| (lo..hi).contains(id))
            .collect();
        let mut out = Vec::new();
        for id in ids {
            for h in self.by_inode.remove(&id).unwrap_or_default() {
                self.count(h.client, -1);
                out.push((id, h));
            }
        }
        out
    }

    /// Takes in the locks of a table that joined this server. They were granted by its
    /// previous owner, so they are kept as they are (no conflict check, no caps: refusing
    /// them would silently drop a lock a client holds).
    pub fn put_moved(&mut self, moved: &[(InodeId, Held)]) {
        for (id, h) in moved {
            let list = self.by_inode.entry(*id).or_default();
            if !list.contains(h) {
                list.push(*h);
                self.count(h.client, 1);
            }
        }
    }

    /// Lock ranges held, over all inodes.
    pub fn len(&self) -> usize {
        self.by_inode.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
    }
}

/// The inode's locks after `spec` (POSIX rules: a new lock replaces what the same owner
/// held in its range, splitting ranges as needed; an unlock cuts the range out), and the
/// change in the number of ranges `client` holds.
fn replace_range(list: &[Held], client: u64, handle: u64, spec: &LockSpec) -> (Vec<Held>, isize) {
    let mut kept = Vec::with_capacity(list.len() + 2);
    let mut delta = 0isize;
    for h in list {
        if !h.same_owner(client, spec.owner, spec.flock) || !h.overlaps(spec.start, spec.end) {
            kept.push(*h);
            continue;
        }
        delta -= 1;
        if h.start < spec.start {
            kept.push(Held {
                end: spec.start - 1,
                ..*h
            });
            delta += 1;
        }
        if h.end > spec.end {
            kept.push(Held {
                start: spec.end + 1,
                ..*h
            });
            delta += 1;
        }
    }
    if spec.kind != LockKind::Unlock {
        kept.push(Held {
            client,
            owner: spec.owner,
            handle,
            start: spec.start,
            end: spec.end,
            write: spec.kind == LockKind::Write,
            flock: spec.flock,
            pid: spec.pid,
        });
        delta += 1;
    }
    (kept, delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_taken_out_with_a_table_hold_at_the_next_owner() {
        let spec = |owner, start, end, kind| LockSpec {
            owner,
            start,
            end,
            kind,
            pid: 1,
            flock: false,
        };
        let mut a = LockTable::default();
        a.set(1, 10, 5, &spec(1, 0, 99, LockKind::Write)).unwrap();
        a.set(1, 500, 5, &spec(1, 0, 9, LockKind::Read)).unwrap();
        let moved = a.take_range(0, 100);
        assert_eq!(moved.len(), 1);
        assert_eq!(a.len(), 1, "the lock outside the range stays");
        assert!(a.conflict(2, 10, &spec(2, 0, 0, LockKind::Write)).is_none());
        let mut b = LockTable::default();
        b.put_moved(&moved);
        assert!(
            b.conflict(2, 10, &spec(2, 50, 50, LockKind::Read))
                .is_some()
        );
        // The holder's last close at the new owner ends it.
        b.release_handle(1, 10, 5);
        assert!(b.is_empty());
        assert!(b.per_client.is_empty());
    }

    fn lock(owner: u64, start: u64, end: u64, kind: LockKind) -> LockSpec {
        LockSpec {
            owner,
            start,
            end,
            kind,
            pid: owner as u32,
            flock: false,
        }
    }

    #[test]
    fn readers_share_writers_exclude() {
        let mut t = LockTable::default();
        t.set(1, 7, 0, &lock(10, 0, 99, LockKind::Read)).unwrap();
        t.set(2, 7, 0, &lock(20, 50, 149, LockKind::Read)).unwrap();
        assert_eq!(
            t.set(2, 7, 0, &lock(20, 90, 95, LockKind::Write))
                .unwrap_err()
                .errno,
            Errno::EAGAIN
        );
        assert!(
            t.set(2, 7, 0, &lock(20, 100, 149, LockKind::Write)).is_ok(),
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
        t.set(1, 7, 0, &lock(10, 0, 99, LockKind::Write)).unwrap();
        t.set(1, 7, 0, &lock(10, 40, 59, LockKind::Unlock)).unwrap();
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
        t.set(1, 7, 0, &lock(10, 0, 99, LockKind::Read)).unwrap();
        assert_eq!(t.len(), 1);
        assert!(t.conflict(2, 7, &lock(20, 0, 99, LockKind::Read)).is_none());
        // Same owner number from another client is another owner.
        assert!(t.set(2, 7, 0, &lock(10, 0, 0, LockKind::Write)).is_err());
    }

    #[test]
    fn releases() {
        let mut t = LockTable::default();
        t.set(1, 7, 0, &lock(10, 0, 9, LockKind::Write)).unwrap();
        t.set(1, 8, 0, &lock(11, 0, 9, LockKind::Write)).unwrap();
        t.set(2, 7, 0, &lock(20, 10, 19, LockKind::Write)).unwrap();
        t.release_owner(1, 7, 10);
        assert!(t.conflict(3, 7, &lock(30, 0, 9, LockKind::Write)).is_none());
        assert!(t.conflict(3, 8, &lock(30, 0, 9, LockKind::Write)).is_some());
        t.release_client(1);
        assert_eq!(t.len(), 1);
        assert!(
            t.set(1, 7, 0, &lock(10, 5, 4, LockKind::Read)).is_err(),
            "empty range"
        );
    }

    #[test]
    fn ranges_are_counted_after_splits() {
        let mut t = LockTable::default();
        t.set(1, 7, 0, &lock(10, 0, u64::MAX, LockKind::Write))
            .unwrap();
        // Every other byte unlocked: each unlock splits one range into two.
        let mut refused = None;
        for i in 0..(LOCKS_PER_INODE_MAX as u64 + 10) {
            if let Err(e) = t.set(1, 7, 0, &lock(10, 2 * i + 1, 2 * i + 1, LockKind::Unlock)) {
                refused = Some((i, e.errno));
                break;
            }
        }
        assert_eq!(
            refused,
            Some((LOCKS_PER_INODE_MAX as u64 - 1, Errno::ENOLCK)),
            "the split past the bound is refused"
        );
        assert_eq!(t.len(), LOCKS_PER_INODE_MAX);
        // Unlocking whole ranges never adds one, so it is always allowed.
        t.set(1, 7, 0, &lock(10, 0, u64::MAX, LockKind::Unlock))
            .unwrap();
        assert!(t.is_empty());
        assert!(t.per_client.is_empty());
    }

    #[test]
    fn a_client_is_bounded_over_all_inodes() {
        let mut t = LockTable::default();
        for id in 0..LOCKS_PER_CLIENT_MAX as u64 {
            t.set(1, id, 0, &lock(10, 0, 0, LockKind::Read)).unwrap();
        }
        let e = t
            .set(1, u64::MAX, 0, &lock(10, 0, 0, LockKind::Read))
            .unwrap_err();
        assert_eq!(e.errno, Errno::ENOLCK);
        assert!(
            t.set(2, u64::MAX, 0, &lock(10, 0, 0, LockKind::Read))
                .is_ok()
        );
        t.release_owner(1, 5, 10);
        assert!(
            t.set(1, u64::MAX, 0, &lock(10, 0, 0, LockKind::Read))
                .is_ok()
        );
        t.release_client(1);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn flock_and_fcntl_locks_never_conflict_and_handles_release_theirs() {
        let mut t = LockTable::default();
        let flock = LockSpec {
            flock: true,
            ..lock(10, 0, u64::MAX, LockKind::Write)
        };
        t.set(1, 7, 100, &flock).unwrap();
        // Another owner's fcntl write lock on the whole file: another lock space.
        t.set(1, 7, 101, &lock(20, 0, u64::MAX, LockKind::Write))
            .unwrap();
        assert!(t.conflict(2, 7, &lock(30, 0, 0, LockKind::Read)).is_some());
        let other_flock = LockSpec { owner: 30, ..flock };
        assert_eq!(
            t.set(2, 7, 200, &other_flock).unwrap_err().errno,
            Errno::EAGAIN
        );
        // A flush (fcntl semantics) never ends an flock, even of the same owner value; the
        // close of the handle it was taken through does.
        t.release_owner(1, 7, 10);
        assert!(
            t.set(2, 7, 200, &other_flock).is_err(),
            "flock survives a flush"
        );
        t.release_handle(1, 7, 100);
        t.set(2, 7, 200, &other_flock).unwrap();
        t.release_handle(1, 7, 101);
        assert_eq!(t.len(), 1);
    }
}
