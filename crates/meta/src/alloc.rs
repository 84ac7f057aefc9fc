//! The allocation state machine of the child-closest policy: which id a new file or
//! directory gets. Ids are always checked free before they are handed out, so allocators
//! are never a source of duplicates. Their state is journaled with the operations that move
//! it: a directory's allocator in its inode, an overflow region's allocation point in a
//! [`Mutation::SetRegionNext`] that its table keeps (so one high id, however it came, never
//! moves an allocator on a reload).

use crate::engine::{Engine, Fail, OpResult};
use crate::idpolicy::Region;
use crate::inode::{DirMeta, Inode};
use crate::mutation::Mutation;
use kochab_proto::{InodeId, fs_err};

/// Candidate ids examined per step before moving on; bounds the work of one allocation
/// in a range that is mostly taken.
const SCAN_MAX: u32 = 64;

/// How far past its region's recorded allocation point (in the region's units: too-deep
/// roots, too-wide ranges, catch-all ids) a replay's wanted id is still honoured. A replay
/// asks for an id a crash lost: one handed out after the last record the journal kept, so
/// it lies past the recovered point by at most the region's allocations in the journal's
/// unsynced tail (milliseconds of operations: the lazy flush is 5 ms). Further than this is
/// no replay of this journal's tail; the replayed create then gets a fresh id (correct,
/// only the inode number differs), and no request can move an allocator far.
pub const REPLAY_LEAD_MAX: u64 = 4096;

/// What an allocation changes besides the new inode, journaled with the operation: the
/// directory whose never-created sibling's file range it claimed, and the overflow regions
/// whose allocation points it moved.
#[derive(Debug, Default)]
pub(crate) struct Claim {
    pub sibling: Option<(InodeId, Inode)>,
    pub regions: Vec<(Region, u64)>,
}

impl Claim {
    fn region(r: Region, next: u64) -> Claim {
        Claim {
            sibling: None,
            regions: vec![(r, next)],
        }
    }

    /// The mutations that record it.
    pub(crate) fn emit(self, out: &mut Vec<Mutation>) {
        if let Some((id, inode)) = self.sibling {
            out.push(Mutation::PutInode { id, inode });
        }
        for (region, next) in self.regions {
            out.push(Mutation::SetRegionNext { region, next });
        }
    }
}

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
        if let Some(got) = self.wanted() {
            return Ok(got);
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
            return Ok((id, Claim::default()));
        }
        // 2. Back to the start of the own range: ids of deleted files are reused.
        if let Some((lo, hi)) = own {
            let mut next = lo;
            if let Some(id) = self.scan_free(&mut next, hi) {
                dm.file_next = next;
                dm.file_end = hi;
                return Ok((id, Claim::default()));
            }
        }
        // 3. The file segment of the next, nonexistent sibling (the paper's "cousins").
        if let Some(claim) = self.claim_sibling_range(dir, dm)
            && let Some(id) = self.scan_free(&mut dm.file_next, dm.file_end)
        {
            let claim = Claim {
                sibling: Some(claim),
                regions: Vec::new(),
            };
            return Ok((id, claim));
        }
        // 4. A range of the too-wide region (if this server holds it).
        let mut moved = Vec::new();
        if let Some(first) = self.region_next(Region::TooWide) {
            let mut n = first;
            for _ in 0..SCAN_MAX {
                let Some((lo, hi)) = self.policy.wide_range(n) else {
                    break;
                };
                n += 1;
                if self.is_free(lo) {
                    let mut next = lo;
                    if let Some(id) = self.scan_free(&mut next, hi) {
                        dm.file_next = next;
                        dm.file_end = hi;
                        return Ok((id, Claim::region(Region::TooWide, n)));
                    }
                }
            }
            if n > first {
                moved.push((Region::TooWide, n));
            }
        }
        // 5. The catch-all region, sequentially.
        let (id, mut claim) = self.alloc_catchall(Region::TooWide)?;
        claim.regions.extend(moved);
        Ok((id, claim))
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
    pub(crate) fn alloc_dir(
        &mut self,
        parent: InodeId,
        pm: &mut DirMeta,
    ) -> OpResult<(InodeId, Claim)> {
        if let Some(got) = self.wanted() {
            return Ok(got);
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
                            return Ok((id, Claim::default()));
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
        // Too deep (or too many subdirectories): a new root in the too-deep region (if this
        // server holds it).
        let mut moved = Vec::new();
        if let Some(first) = self.region_next(Region::TooDeep) {
            let mut n = first;
            for _ in 0..SCAN_MAX {
                let Some(id) = self.policy.deep.root(n) else {
                    break;
                };
                n += 1;
                if self.is_free(id) {
                    return Ok((id, Claim::region(Region::TooDeep, n)));
                }
            }
            if n > first {
                moved.push((Region::TooDeep, n));
            }
        }
        let (id, mut claim) = self.alloc_catchall(Region::TooDeep)?;
        claim.regions.extend(moved);
        Ok((id, claim))
    }

    /// The id a replayed create asks for, if it may have it: unused here, and, in an
    /// overflow region, no further than [`REPLAY_LEAD_MAX`] past the region's allocation
    /// point (which then moves past it: the id was handed out before a crash lost its
    /// record). Whoever set `want_id` checked that the request is a genuine replay (the
    /// server verifies its replay tag); the engine bounds what even a genuine one may take.
    /// A quarantined id is taken too: the incarnation that handed it out respected its
    /// quarantine, and one here comes from a replayed removal of its last inode (both
    /// records lost, found by the simulation once its time ran past a quarantine).
    fn wanted(&mut self) -> Option<(InodeId, Claim)> {
        let id = self.want_id.take().filter(|&id| self.is_unused(id))?;
        let r = Region::of(id);
        if r == Region::Primary {
            // A directory's allocator is not moved by it: it skips taken ids.
            self.unquarantine(id);
            return Some((id, Claim::default()));
        }
        let next = self.region_next(r)?;
        let unit = self.region_unit(r, id);
        if unit < self.region_first(r) || unit >= next.saturating_add(REPLAY_LEAD_MAX) {
            return None;
        }
        self.unquarantine(id);
        let claim = if unit >= next {
            Claim::region(r, unit + 1)
        } else {
            Claim::default()
        };
        Some((id, claim))
    }

    /// The next catch-all id, after the `wanted` overflow region had none. A server that
    /// holds neither table (a cluster member) needs one of them: the operation fails with
    /// `NotHosted` of the wanted region's table (or of the catch-all's, if the wanted one is
    /// here but full), and the member borrows it and runs the operation again.
    fn alloc_catchall(&mut self, wanted: Region) -> OpResult<(InodeId, Claim)> {
        let Some(mut next) = self.region_next(Region::CatchAll) else {
            let missing = if self.region_next(wanted).is_none() {
                wanted
            } else {
                Region::CatchAll
            };
            return Err(Fail::NotHosted(missing.base()));
        };
        let found = self.scan_free(&mut next, Region::CatchAll.end());
        found
            .map(|id| (id, Claim::region(Region::CatchAll, next)))
            .ok_or_else(|| Fail::Fs(fs_err!(ENOSPC, "inode id space exhausted")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::idpolicy::IdPolicyConfig;
    use kochab_proto::{Credentials, Op, Reply, mode};

    /// Three primary levels (three top-level directories), only three too-deep roots of
    /// three levels, 8-bit file ranges, three too-wide ranges: every overflow region is
    /// reached in a few operations.
    fn cramped() -> (Engine, Vec<Mutation>) {
        let cfg = EngineConfig {
            id_policy: IdPolicyConfig {
                primary_slots: vec![2, 26, 26],
                deep_slots: vec![2, 26, 26],
                wide_dir_bits: 2,
            },
            primary_tables: 1,
            ..EngineConfig::with_key([3, 4])
        };
        let mut e = Engine::new_cluster(cfg).unwrap();
        let log = e.bootstrap(1);
        for m in &log {
            e.apply(m).unwrap();
        }
        (e, log)
    }

    fn mkdir(e: &mut Engine, log: &mut Vec<Mutation>, parent: InodeId, name: &str) -> InodeId {
        let op = Op::Mkdir {
            parent,
            name: name.as_bytes().to_vec(),
            mode: 0o755,
        };
        match e.execute(&Credentials::root(), &op, 2, log) {
            Reply::Entry(a) => a.id,
            other => panic!("mkdir {name}: {other:?}"),
        }
    }

    fn mknod(e: &mut Engine, log: &mut Vec<Mutation>, parent: InodeId, name: &str) -> InodeId {
        let op = Op::Mknod {
            parent,
            name: name.as_bytes().to_vec(),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        };
        match e.execute(&Credentials::root(), &op, 2, log) {
            Reply::Entry(a) => a.id,
            other => panic!("mknod {name}: {other:?}"),
        }
    }

    /// A chain of twelve directories: three primary levels, three too-deep roots of three
    /// levels each; the next (returned) is the catch-all region's first id.
    fn deep_chain(e: &mut Engine, log: &mut Vec<Mutation>) -> InodeId {
        let mut d = e.root();
        for level in 0..13 {
            d = mkdir(e, log, d, &format!("l{level}"));
            assert_eq!(Region::of(d) == Region::CatchAll, level == 12, "{d:#x}");
        }
        assert_eq!(d, crate::idpolicy::CATCHALL_FIRST);
        d
    }

    fn points(e: &Engine) -> Vec<Option<u64>> {
        crate::engine::OVERFLOW_REGIONS
            .iter()
            .map(|&r| e.region_next(r))
            .collect()
    }

    #[test]
    fn allocation_points_survive_a_replay_and_one_high_id_moves_none() {
        let (mut e, mut log) = cramped();
        let last = deep_chain(&mut e, &mut log);
        // A directory's 256th file: its own range is full, the next range is too-wide 1.
        let top = e.child(e.root(), b"l0").unwrap();
        let mut wide = 0;
        for i in 0..300 {
            wide = mknod(&mut e, &mut log, top, &format!("f{i}"));
        }
        assert_eq!(Region::of(wide), Region::TooWide);
        // Catch-all ids 2 (the chain's last directory) and 3 handed out; roots 1..=3; one
        // too-wide range.
        assert_eq!(mkdir(&mut e, &mut log, last, "c"), 3);
        assert_eq!(points(&e), [Some(4), Some(4), Some(2)]);
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );

        // The journal alone rebuilds them (as a restart replays it).
        let (mut r, _) = cramped();
        for m in &log {
            r.apply(m).unwrap();
        }
        r.fill_region_next();
        assert_eq!(points(&r), points(&e));
        assert!(r.check_invariants().is_empty());

        // An id placed at the end of the catch-all region behind the allocator's back (a
        // record forced into the journal): a load leaves the recorded point where it is,
        // the next allocation goes on from it, and fsck names the id.
        let planted = Region::CatchAll.end() - 1;
        let mut inode = Inode::new(mode::S_IFREG | 0o644, 0, 0, 3);
        inode.nlink = 1;
        let root = r.root();
        for m in [
            Mutation::PutInode { id: planted, inode },
            Mutation::PutDentry {
                parent: root,
                name: crate::Name::new(b"planted"),
                child: planted,
                kind: kochab_proto::FileKind::File,
            },
        ] {
            r.apply(&m).unwrap();
        }
        r.fill_region_next();
        assert_eq!(points(&r), points(&e), "a high id moved an allocator");
        let problems = r.check_invariants();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains(&format!("{planted:#x}"))
                && problems[0].contains("outside the catch-all region's allocated range"),
            "{problems:?}"
        );
        let mut more = Vec::new();
        assert_eq!(
            mkdir(&mut r, &mut more, last, "d"),
            4,
            "the next catch-all id"
        );
        assert!(
            more.contains(&Mutation::SetRegionNext {
                region: Region::CatchAll,
                next: 5
            }),
            "the move is journaled with the create: {more:?}"
        );
    }

    #[test]
    fn a_member_without_the_overflow_tables_asks_for_the_wanted_regions_table() {
        let (full, _) = cramped();
        let primary: Vec<(InodeId, InodeId)> = full
            .tables()
            .iter()
            .filter(|t| Region::of(t.lo) == Region::Primary)
            .map(|t| (t.lo, t.hi))
            .collect();
        let mut e = Engine::new(full.config().clone(), &primary).unwrap();
        e.member = true;
        let mut log = e.bootstrap(1);
        for m in &log {
            e.apply(m).unwrap();
        }
        let mut d = e.root();
        for level in 0..3 {
            d = mkdir(&mut e, &mut log, d, &format!("l{level}"));
        }
        let op = Op::Mkdir {
            parent: d,
            name: b"too-deep".to_vec(),
            mode: 0o755,
        };
        let reply = e.execute(&Credentials::root(), &op, 2, &mut log);
        assert!(matches!(reply, Reply::WrongServer { .. }), "{reply:?}");
        assert_eq!(e.last_not_hosted, Some(Region::TooDeep.base()), "borrow it");
    }

    #[test]
    fn a_wanted_id_is_taken_only_near_its_regions_allocation_point() {
        let (mut e, mut log) = cramped();
        let last = deep_chain(&mut e, &mut log);
        let next = e.region_next(Region::CatchAll).unwrap();
        assert_eq!(next, 3);
        // Far past the point (the end of the region): a fresh id instead, the point moves
        // by one.
        // (Directories under a catch-all directory are catch-all ids: no root is left.)
        e.want_id = Some(Region::CatchAll.end() - 1);
        assert_eq!(mkdir(&mut e, &mut log, last, "far"), 3);
        assert_eq!(e.region_next(Region::CatchAll), Some(4));
        e.want_id = Some(4 + REPLAY_LEAD_MAX);
        assert_eq!(mkdir(&mut e, &mut log, last, "just-too-far"), 4);
        // Within reach (a create a crash lost, replayed): taken, and the point moves past it.
        e.want_id = Some(100);
        assert_eq!(mkdir(&mut e, &mut log, last, "near"), 100);
        assert_eq!(e.region_next(Region::CatchAll), Some(101));
        // Below the point and free (its record lost, the point recorded later): taken,
        // the point stays.
        e.want_id = Some(50);
        assert_eq!(mkdir(&mut e, &mut log, last, "below"), 50);
        assert_eq!(e.region_next(Region::CatchAll), Some(101));
        // Too-deep roots past the last one do not exist; a taken id is never given.
        e.want_id = Some(100);
        assert_eq!(mkdir(&mut e, &mut log, last, "taken"), 101);
        // A primary id in another directory's file range: taken if free, and that
        // directory's allocator does not move.
        let top = e.child(e.root(), b"l0").unwrap();
        let before = e.inode(top).unwrap().dir().cloned();
        let (lo, _) = e.policy.own_file_range(top).unwrap();
        e.want_id = Some(lo + 200);
        assert_eq!(mknod(&mut e, &mut log, last, "inside"), lo + 200);
        assert_eq!(e.inode(top).unwrap().dir().cloned(), before);
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
    }
}
