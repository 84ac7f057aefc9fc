//! The allocation state machine of the child-closest policy: which id a new file or
//! directory gets. Ids are always checked free before they are handed out, so the in-memory
//! counters are hints for locality, never a source of duplicates.

use crate::engine::{Engine, Fail, OpResult};
use crate::idpolicy::Region;
use crate::inode::{DirMeta, Inode};
use kochab_proto::{InodeId, fs_err};

/// Candidate ids examined per step before moving on; bounds the work of one allocation
/// in a range that is mostly taken.
const SCAN_MAX: u32 = 64;

/// A change to another directory that an allocation needs (claiming a sibling's range).
pub(crate) type Claim = Option<(InodeId, Inode)>;

impl Engine {
    /// Takes the first free id in `[*next, end)`, looking at most `SCAN_MAX` candidates;
    /// advances `*next` past what it looked at.
    fn scan_free(&self, next: &mut InodeId, end: InodeId) -> Option<InodeId> {
        for _ in 0..SCAN_MAX {
            if *next >= end {
                return None;
            }
            let id = *next;
            *next += 1;
            if self.is_free(id) {
                return Some(id);
            }
        }
        None
    }

    /// Chooses the id of a new file in `dir`, updating the directory's allocator `dm`.
    /// May claim the file range of a nonexistent sibling; the changed id-parent is returned
    /// for the caller to journal with the operation.
    pub(crate) fn alloc_file(
        &mut self,
        dir: InodeId,
        dm: &mut DirMeta,
    ) -> OpResult<(InodeId, Claim)> {
        if let Some(id) = self.wanted() {
            return Ok((id, None));
        }
        let own = self.policy.own_file_range(dir);
        if dm.file_end == 0
            && let Some((lo, hi)) = own
        {
            dm.file_next = lo;
            dm.file_end = hi;
        }
        // 1. The current range.
        if let Some(id) = self.scan_free(&mut dm.file_next, dm.file_end) {
            return Ok((id, None));
        }
        // 2. Back to the start of the own range: ids of deleted files are reused.
        if let Some((lo, hi)) = own {
            let mut next = lo;
            if let Some(id) = self.scan_free(&mut next, hi) {
                dm.file_next = next;
                dm.file_end = hi;
                return Ok((id, None));
            }
        }
        // 3. The file segment of the next, nonexistent sibling (the paper's "cousins").
        if let Some(claim) = self.claim_sibling_range(dir, dm)
            && let Some(id) = self.scan_free(&mut dm.file_next, dm.file_end)
        {
            return Ok((id, Some(claim)));
        }
        // 4. A range of the too-wide region.
        for _ in 0..SCAN_MAX {
            let n = self.counters.wide_next;
            let Some((lo, hi)) = self.policy.wide_range(n) else {
                break;
            };
            self.counters.wide_next += 1;
            if self.is_free(lo) {
                let mut next = lo;
                if let Some(id) = self.scan_free(&mut next, hi) {
                    dm.file_next = next;
                    dm.file_end = hi;
                    return Ok((id, None));
                }
            }
        }
        // 5. The catch-all region, sequentially.
        self.alloc_catchall().map(|id| (id, None))
    }

    /// Claims the file segment of the sibling that follows the range `dm` is in, if that
    /// sibling has never been handed out by its id-parent.
    fn claim_sibling_range(&self, dir: InodeId, dm: &mut DirMeta) -> Option<(InodeId, Inode)> {
        let layout = self.policy.tree_layout(dir)?;
        let current = if dm.file_end > 0 {
            dm.file_end - 1
        } else {
            dir
        };
        if Region::of(current) != Region::of(dir) {
            return None;
        }
        let (id_parent, value) = layout.id_parent(layout.dir_base(current))?;
        if self.deals_top_level(id_parent) {
            // Top-level slots are dealt across tables (see `subdir_value`): the next value
            // is not the next one handed out, so there is no sibling range to take over.
            return None;
        }
        let sibling = layout.child_dir(id_parent, value + 1)?;
        let parent = self.inode(id_parent)?;
        if !parent.is_dir() || parent.dir().map_or(1, |d| d.subdir_next.max(1)) > value + 1 {
            return None;
        }
        let (lo, hi) = layout.file_range(sibling);
        if !self.is_free(sibling) || !self.is_free(lo) {
            return None;
        }
        let mut p = parent.clone();
        p.dir_mut().subdir_next = value + 2;
        dm.file_next = lo;
        dm.file_end = hi;
        Some((id_parent, p))
    }

    /// True for the primary root, whose subdirectories' slots are dealt across tables.
    fn deals_top_level(&self, parent: InodeId) -> bool {
        Region::of(parent) == Region::Primary && self.policy.primary.depth(parent) == 0
    }

    /// The slot value of the `counter`-th subdirectory of `parent`. Under the primary root
    /// the counter is dealt across the primary tables (the i-th top-level directory lands in
    /// table i mod n), so independent top-level trees start in different tables and, once
    /// tables are spread over servers, on different servers; everywhere else values are
    /// sequential, so a subtree stays one contiguous range. A bijection on `0..=slot_max`
    /// (0, the root's own slot, is never asked for).
    fn subdir_value(&self, parent: InodeId, counter: u64) -> u64 {
        if !self.deals_top_level(parent) {
            return counter;
        }
        let slots = self.policy.primary.slot_max(0) + 1;
        let tables = u64::from(self.config.primary_tables).clamp(1, slots);
        if !tables.is_power_of_two() || counter >= slots {
            return counter;
        }
        let per_table = slots / tables;
        (counter % tables) * per_table + counter / tables
    }

    /// For a member: the id a new top-level directory under `parent` should get when its
    /// table is on another server (so the server borrows that table and the directory
    /// lands where the dealing puts it, spreading top-level trees over servers). `None`
    /// when the next slot is here, or `parent` deals nothing.
    pub(crate) fn planned_dir(&self, parent: InodeId) -> Option<InodeId> {
        if !self.member || !self.deals_top_level(parent) {
            return None;
        }
        let layout = self.policy.tree_layout(parent)?;
        let first = self.inode(parent)?.dir()?.subdir_next.max(1);
        // One pass over the tables' turns: each slot is either here (free: no borrow) or
        // on another server (borrow it) or taken (try the next).
        for v in first..=first + u64::from(self.config.primary_tables) {
            let id = layout.child_dir(parent, self.subdir_value(parent, v))?;
            if self.table_index(id).is_none() {
                return Some(id);
            }
            if self.is_free(id) {
                return None;
            }
        }
        None
    }

    /// Chooses the id of a new subdirectory of `parent`, updating its allocator `pm`.
    pub(crate) fn alloc_dir(&mut self, parent: InodeId, pm: &mut DirMeta) -> OpResult<InodeId> {
        if let Some(id) = self.wanted() {
            return Ok(id);
        }
        if let Some(layout) = self.policy.tree_layout(parent) {
            let real_dir = Region::of(parent) == Region::Primary || layout.depth(parent) > 0;
            if real_dir && layout.depth(parent) < layout.levels() {
                let max = layout.slot_max(layout.depth(parent));
                let mut v = pm.subdir_next.max(1);
                for pass in 0..2 {
                    for _ in 0..SCAN_MAX {
                        let value = self.subdir_value(parent, v);
                        let Some(id) = layout.child_dir(parent, value) else {
                            break;
                        };
                        v += 1;
                        if self.is_free(id) {
                            pm.subdir_next = v;
                            return Ok(id);
                        }
                    }
                    if v <= max || pass == 1 {
                        break;
                    }
                    // Every slot value handed out: reuse values of removed directories.
                    v = 1;
                }
                pm.subdir_next = v.min(max + 1).max(pm.subdir_next);
            }
        }
        // Too deep (or too many subdirectories): a new root in the too-deep region.
        for _ in 0..SCAN_MAX {
            let Some(id) = self.policy.deep.root(self.counters.deep_next) else {
                break;
            };
            self.counters.deep_next += 1;
            if self.is_free(id) {
                return Ok(id);
            }
        }
        self.alloc_catchall()
    }

    /// The id a replayed create asks for, if it is free here.
    fn wanted(&mut self) -> Option<InodeId> {
        self.want_id.take().filter(|&id| self.is_free(id))
    }

    fn alloc_catchall(&mut self) -> OpResult<InodeId> {
        let end = Region::CatchAll.end();
        let mut next = self.counters.catchall_next;
        let found = self.scan_free(&mut next, end);
        self.counters.catchall_next = next;
        found.ok_or_else(|| Fail::Fs(fs_err!(ENOSPC, "inode id space exhausted")))
    }
}
