//! The engine: the tables a server hosts and the single code path that changes them.
//!
//! Every operation (see `ops.rs`) first checks everything it needs, then emits redo
//! mutations, then applies them with [`Engine::apply`]; replay applies the same mutations
//! through the same function. An operation either emits all its mutations or none, so a
//! failed check never leaves half an operation behind.

use crate::dir::Dentry;
use crate::error::{ApplyError, ConfigError, TableError};
use crate::idpolicy::{CATCHALL_FIRST, IdPolicy, IdPolicyConfig, Region};
use crate::inode::Inode;
use crate::mutation::Mutation;
use crate::table::{BOX_SHIFT, Table};
use kochab_proto::{
    Attr, Credentials, FileKind, FsError, InodeId, Op, Reply, TimeNs, fs_err, mode,
};
use serde::{Deserialize, Serialize};
use siphasher::sip::SipHasher13;
use std::hash::Hasher;

/// Engine settings that must stay the same for the life of a cluster (they shape ids and
/// entry order), so they are stored with the data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineConfig {
    pub id_policy: IdPolicyConfig,
    /// Tables the primary region is cut into at creation (a power of two, at most the
    /// number of top-level slot values).
    pub primary_tables: u32,
    /// Key of the name hash that orders directory entries (random per cluster, so that
    /// nobody can craft colliding names).
    pub name_hash_key: [u64; 2],
}

impl EngineConfig {
    /// Default widths with the given hash key.
    pub fn with_key(name_hash_key: [u64; 2]) -> Self {
        EngineConfig {
            id_policy: IdPolicyConfig::default(),
            primary_tables: 16,
            name_hash_key,
        }
    }
}

/// How long the id of a removed inode is not reused: well past the 1 s a mount caches
/// names, so no cached name can reach a new inode under an old number.
pub const QUARANTINE_NS: TimeNs = 5_000_000_000;

/// Inodes named one by one per region when fsck finds ids past a region's allocation
/// point; the rest are counted (one cause usually places many).
const REGION_PROBLEMS_MAX: u64 = 16;

/// Most ancestors a plan names: past this the walk stops and the engine's own subtree
/// check reports any table the plan missed.
const PLAN_WALK_MAX: usize = 4096;

/// Why an operation did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fail {
    /// A file-system error for the caller.
    Fs(FsError),
    /// A table the operation needs is not served here.
    NotHosted(InodeId),
}

impl From<FsError> for Fail {
    fn from(e: FsError) -> Fail {
        Fail::Fs(e)
    }
}

/// The answer for an id that no table holds. WRONG_SERVER is for an id whose table the
/// delegation map gives to another server; until a coordinator and its map exist, every
/// table of the cluster is hosted here, so an id outside them is no file anywhere: stale,
/// as NFS answers a handle that can never be valid (never a redirection the client would
/// chase).
pub fn not_in_any_table(id: InodeId) -> FsError {
    fs_err!(ESTALE, "inode {id:#x} lies in no table of this cluster")
}

/// Result of engine internals.
pub type OpResult<T> = Result<T, Fail>;

/// The overflow regions, whose allocators are region-wide counters (the primary region's
/// allocators live in its directories).
pub const OVERFLOW_REGIONS: [Region; 3] = [Region::CatchAll, Region::TooDeep, Region::TooWide];

/// The metadata of the tables one server hosts.
#[derive(Debug)]
pub struct Engine {
    pub(crate) policy: IdPolicy,
    pub(crate) config: EngineConfig,
    /// Sorted by `lo`, never overlapping.
    pub(crate) tables: Vec<Table>,
    /// Open handles per inode (server session state, not journaled): an inode whose last
    /// name goes while it is open lives on with nlink 0 until its last close.
    pub(crate) open_counts: rustc_hash::FxHashMap<InodeId, u32>,
    /// Ids of recently removed inodes, not handed out again before `QUARANTINE_NS` passed:
    /// a kernel may still hold a name for the old inode (for its entry TTL) and would
    /// otherwise reach a new file through it. Oldest first.
    quarantine: std::collections::VecDeque<(TimeNs, InodeId)>,
    quarantined: rustc_hash::FxHashSet<InodeId>,
    /// The latest time an operation brought (for removals outside `execute`).
    clock: TimeNs,
    /// Epoch of the delegation map this server serves under (reported in WRONG_SERVER).
    pub epoch: u64,
    /// Ranges of tables this engine gave away at run time: an operation on them is answered
    /// WRONG_SERVER (served elsewhere now), not ESTALE (no file anywhere).
    departed: Vec<(InodeId, InodeId)>,
    /// A member of a many-server cluster: an id outside the hosted tables is served by
    /// another server (WRONG_SERVER), never "no file anywhere".
    pub member: bool,
    /// The last id an operation needed outside the hosted tables (a member's host names
    /// that table's owner in the WRONG_SERVER it sends).
    pub last_not_hosted: Option<InodeId>,
    /// The id the next create should get if it is free: a client's replay of a create
    /// that a crash lost asks for the id its first reply gave (see `ReplyMode::Replay`).
    /// Set only for a genuine replay (the server verified its replay tag); bounded still by
    /// the region's allocation point (see `alloc::REPLAY_LEAD_MAX`). Taken by the next
    /// allocation, whether it is used or not.
    pub want_id: Option<InodeId>,
    /// Objects freed by operations whose reply has no room for them (truncations), for
    /// the server to delete once the change is durable: (inode, generation, object).
    pub(crate) freed_objects: Vec<(InodeId, u64, u64)>,
}

/// The id ranges of a new cluster's tables: the catch-all, too-deep and too-wide regions
/// whole, and the primary region cut into `primary_tables` ranges of top-level slots.
pub fn initial_table_ranges(
    policy: &IdPolicy,
    primary_tables: u32,
) -> Result<Vec<(InodeId, InodeId)>, ConfigError> {
    let slots = policy.primary.slot_max(0) + 1;
    let n = primary_tables as u64;
    if n == 0 || !n.is_power_of_two() || n > slots {
        return Err(ConfigError(format!(
            "primary_tables must be a power of two between 1 and {slots}"
        )));
    }
    let root = policy.root();
    let step_slots = slots / n;
    let slot_span = policy
        .primary
        .child_dir(root, 1)
        .ok_or_else(|| ConfigError("primary layout has no top-level slot".into()))?
        - root;
    let mut ranges = vec![(Region::CatchAll.base(), Region::CatchAll.end())];
    for i in 0..n {
        let lo = root + i * step_slots * slot_span;
        let hi = if i + 1 == n {
            Region::Primary.end()
        } else {
            root + (i + 1) * step_slots * slot_span
        };
        ranges.push((lo, hi));
    }
    ranges.push((Region::TooDeep.base(), Region::TooDeep.end()));
    ranges.push((Region::TooWide.base(), Region::TooWide.end()));
    Ok(ranges)
}

impl Engine {
    /// An engine hosting the given (empty) tables.
    pub fn new(config: EngineConfig, ranges: &[(InodeId, InodeId)]) -> Result<Engine, ConfigError> {
        let policy = IdPolicy::new(config.id_policy.clone())?;
        let mut tables: Vec<Table> = ranges.iter().map(|&(lo, hi)| Table::new(lo, hi)).collect();
        tables.sort_by_key(|t| t.lo);
        for w in tables.windows(2) {
            if w[0].hi > w[1].lo {
                return Err(ConfigError(format!(
                    "tables {:#x}.. and {:#x}.. overlap",
                    w[0].lo, w[1].lo
                )));
            }
        }
        Ok(Engine {
            policy,
            config,
            tables,
            open_counts: Default::default(),
            quarantine: Default::default(),
            quarantined: Default::default(),
            clock: 0,
            epoch: 1,
            departed: Vec::new(),
            member: false,
            last_not_hosted: None,
            want_id: None,
            freed_objects: Vec::new(),
        })
    }

    /// An engine hosting every table of a new cluster.
    pub fn new_cluster(config: EngineConfig) -> Result<Engine, ConfigError> {
        let policy = IdPolicy::new(config.id_policy.clone())?;
        let ranges = initial_table_ranges(&policy, config.primary_tables)?;
        Engine::new(config, &ranges)
    }

    /// The mutations that create the root directory (mode 0755, owned by root).
    pub fn bootstrap(&self, now: TimeNs) -> Vec<Mutation> {
        let root = self.root();
        let mut inode = Inode::new(mode::S_IFDIR | 0o755, 0, 0, now);
        inode.nlink = 2;
        inode.dir_mut().parent = root;
        vec![Mutation::PutInode { id: root, inode }]
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn policy(&self) -> &IdPolicy {
        &self.policy
    }

    /// The root directory's id.
    pub fn root(&self) -> InodeId {
        self.policy.root()
    }

    /// True once the root exists (a bootstrapped or recovered cluster).
    pub fn has_root(&self) -> bool {
        self.inode(self.root()).is_some()
    }

    pub fn tables(&self) -> &[Table] {
        &self.tables
    }

    pub fn tables_mut(&mut self) -> &mut [Table] {
        &mut self.tables
    }

    /// Stops hosting the table that starts at `lo` and hands it over (for a migration):
    /// from now on operations on its ids get WRONG_SERVER. The caller has made sure no
    /// operation on it is in flight (operations run whole under the caller's lock).
    pub fn remove_table(&mut self, lo: InodeId) -> Option<Table> {
        let i = self.tables.iter().position(|t| t.lo == lo)?;
        let t = self.tables.remove(i);
        self.departed.push((t.lo, t.hi));
        Some(t)
    }

    /// Starts hosting `table` (loaded from its checkpoint and journal): it must not overlap
    /// a hosted one. Its region allocator comes with it (only one never recorded is
    /// derived, see [`Engine::fill_region_next`]).
    pub fn insert_table(&mut self, table: Table) -> Result<(), TableError> {
        let i = self.tables.partition_point(|t| t.lo < table.lo);
        let overlaps_prev = i > 0 && self.tables[i - 1].hi > table.lo;
        let overlaps_next = i < self.tables.len() && self.tables[i].lo < table.hi;
        if overlaps_prev || overlaps_next {
            return Err(TableError::Overlaps {
                lo: table.lo,
                hi: table.hi,
            });
        }
        self.departed
            .retain(|&(lo, hi)| hi <= table.lo || lo >= table.hi);
        self.tables.insert(i, table);
        self.fill_region_next();
        Ok(())
    }

    /// Splits the hosted table that starts at `lo` at `at` (see [`Table::split_off`]); both
    /// halves stay hosted here. Returns the new table's id (`at`).
    pub fn split_table(&mut self, lo: InodeId, at: InodeId) -> Result<InodeId, TableError> {
        let i = self
            .tables
            .iter()
            .position(|t| t.lo == lo)
            .ok_or(TableError::NotHosted { lo })?;
        let upper = self.tables[i].split_off(at)?;
        self.tables.insert(i + 1, upper);
        Ok(at)
    }

    /// Where to split the hosted table `lo`: a subtree boundary (a multiple of some tree
    /// level's slot span, so no directory is cut from its own files) between two boxes
    /// of inodes. Among boundaries that leave at least a quarter of the inodes on each
    /// side, the coarsest level wins, then the one nearest the median; failing that, the
    /// most even one. Only primary-region tables split: the overflow regions' id counters
    /// assume one table per region.
    pub fn split_point(&self, lo: InodeId) -> Result<InodeId, TableError> {
        let t = self
            .tables
            .iter()
            .find(|t| t.lo == lo)
            .ok_or(TableError::NotHosted { lo })?;
        if Region::of(t.lo) != Region::Primary || t.hi > Region::Primary.end() {
            return Err(TableError::NotSubtree {
                lo,
                region: Region::of(t.lo).label(),
            });
        }
        let layout = self
            .policy
            .tree_layout(t.lo)
            .ok_or(TableError::NoTreeLayout { lo })?;
        let spans: Vec<u64> = (0..layout.levels()).map(|l| layout.slot_span(l)).collect();
        let boxes: Vec<(u64, u64)> = t.box_counts().collect();
        let total: u64 = boxes.iter().map(|b| b.1).sum();
        let mut below = 0;
        let mut best: Option<((bool, usize, u64), InodeId)> = None;
        for w in boxes.windows(2) {
            below += w[0].1;
            let (start, end) = ((w[0].0 + 1) << BOX_SHIFT, w[1].0 << BOX_SHIFT);
            let Some((level, at)) = spans.iter().enumerate().find_map(|(l, &span)| {
                let at = start.div_ceil(span).checked_mul(span)?;
                (at <= end).then_some((l, at))
            }) else {
                continue;
            };
            let even = below.min(total - below) * 4 >= total;
            let key = (
                !even,
                if even { level } else { 0 },
                below.abs_diff(total / 2),
            );
            if best.is_none_or(|(k, _)| key < k) {
                best = Some((key, at));
            }
        }
        best.map(|(_, at)| at)
            .ok_or(TableError::NoBoundary { lo, inodes: total })
    }

    /// True if `id` lies in a table this engine gave away.
    pub fn departed(&self, id: InodeId) -> bool {
        self.departed.iter().any(|&(lo, hi)| lo <= id && id < hi)
    }

    /// Index of the table holding `id`.
    pub fn table_index(&self, id: InodeId) -> Option<usize> {
        let i = self.tables.partition_point(|t| t.lo <= id);
        (i > 0 && self.tables[i - 1].contains(id)).then(|| i - 1)
    }

    pub(crate) fn table(&self, id: InodeId) -> OpResult<&Table> {
        self.table_index(id)
            .map(|i| &self.tables[i])
            .ok_or(Fail::NotHosted(id))
    }

    /// The inode `id`, if it exists in a hosted table.
    pub fn inode(&self, id: InodeId) -> Option<&Inode> {
        self.table_index(id).and_then(|i| self.tables[i].inode(id))
    }

    pub(crate) fn get(&self, id: InodeId) -> OpResult<&Inode> {
        self.table(id)?
            .inode(id)
            .ok_or_else(|| Fail::Fs(fs_err!(ENOENT, "no inode {id:#x}")))
    }

    pub(crate) fn get_dir(&self, id: InodeId) -> OpResult<&Inode> {
        let inode = self.get(id)?;
        if !inode.is_dir() {
            return Err(Fail::Fs(fs_err!(
                ENOTDIR,
                "inode {id:#x} is not a directory"
            )));
        }
        Ok(inode)
    }

    /// The keyed hash that orders a directory's entries: 63 bits, so that the readdir
    /// cookies made of it are positive directory offsets.
    pub fn name_hash(&self, name: &[u8]) -> u64 {
        name_hash(self.config.name_hash_key, name)
    }

    /// Rehashes the directories loaded from format-1 checkpoint images (64-bit hashes)
    /// before the journal is replayed on top; returns how many entries moved.
    pub fn rehash_legacy_dentries(&mut self) -> Result<u64, TableError> {
        let key = self.config.name_hash_key;
        let mut moved = 0;
        for t in self.tables_mut() {
            moved += t.rehash_legacy(|name| name_hash(key, name))?;
        }
        Ok(moved)
    }

    /// The entry `dir/name`, if any.
    /// The inode `name` in `dir` names, if the hosted tables show one.
    pub fn child(&self, dir: InodeId, name: &[u8]) -> Option<InodeId> {
        self.entry(dir, name).ok().flatten().map(|e| e.child)
    }

    /// The inode `name` in `dir` names and the kind its entry records, if the hosted
    /// tables show one (the inode itself may live on another server).
    pub fn child_kind(&self, dir: InodeId, name: &[u8]) -> Option<(InodeId, FileKind)> {
        self.entry(dir, name)
            .ok()
            .flatten()
            .map(|e| (e.child, e.kind))
    }

    pub(crate) fn entry(&self, dir: InodeId, name: &[u8]) -> OpResult<Option<&Dentry>> {
        let hash = self.name_hash(name);
        Ok(self
            .table(dir)?
            .entries(dir)
            .and_then(|e| e.get(hash, name)))
    }

    /// The inodes an operation touches beyond the ids it names, as far as the hosted tables
    /// show: the first step of plan-then-execute for operations that span servers. Named:
    /// the entries an unlink, rmdir or rename removes or replaces, for a directory that
    /// moves to another parent the new parent's ancestors (the subtree check walks them),
    /// and for a new top-level directory the slot its table's turn gives it.
    /// A directory whose table is not hosted hides what lies behind it; the plan then ends
    /// at that directory, and a server that borrowed its table plans again (the engine
    /// still refuses, with `NotHosted`, anything the plan missed). Costs a few lookups.
    pub fn plan(&self, op: &Op) -> Vec<InodeId> {
        let child = |dir: InodeId, name: &[u8]| {
            self.entry(dir, name)
                .ok()
                .flatten()
                .map(|e| (e.child, e.kind))
        };
        let mut ids = Vec::new();
        match op {
            Op::Mkdir { parent, .. } => ids.extend(self.planned_dir(*parent)),
            Op::Unlink { parent, name } | Op::Rmdir { parent, name } => {
                ids.extend(child(*parent, name).map(|(c, _)| c));
            }
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => {
                let src = child(*parent, name);
                let dst = child(*new_parent, new_name);
                ids.extend(src.iter().chain(dst.iter()).map(|(c, _)| *c));
                let moves_dir = [src, dst]
                    .iter()
                    .flatten()
                    .any(|(_, k)| *k == FileKind::Dir);
                if moves_dir && parent != new_parent {
                    // An exchange moves the target too: walk above both parents.
                    self.plan_ancestors(*new_parent, &mut ids);
                    self.plan_ancestors(*parent, &mut ids);
                }
            }
            _ => {}
        }
        ids
    }

    /// Appends the ancestors of `dir` below the root, up to the first one not hosted here
    /// (which is named: its table is the next to borrow).
    fn plan_ancestors(&self, dir: InodeId, ids: &mut Vec<InodeId>) {
        let root = self.root();
        let mut cur = dir;
        // Bounded like the walk it plans for; a longer chain is corrupt anyway.
        for _ in 0..PLAN_WALK_MAX {
            let Some(next) = self.inode(cur).and_then(|i| i.dir()).map(|d| d.parent) else {
                return;
            };
            if next == root || next == cur {
                return;
            }
            if !ids.contains(&next) {
                ids.push(next);
            }
            cur = next;
        }
    }

    /// Number of entries in `dir`.
    pub(crate) fn entry_count(&self, dir: InodeId) -> OpResult<u64> {
        Ok(self.table(dir)?.entries(dir).map_or(0, |e| e.len()))
    }

    /// True if `id` may be handed to a new inode: hosted here, unused, not quarantined.
    pub(crate) fn is_free(&self, id: InodeId) -> bool {
        !self.quarantined.contains(&id) && self.is_unused(id)
    }

    /// True if `id` is hosted here and no inode has it (quarantined or not).
    pub(crate) fn is_unused(&self, id: InodeId) -> bool {
        id >= CATCHALL_FIRST
            && self
                .table_index(id)
                .is_some_and(|i| self.tables[i].inode(id).is_none())
    }

    /// Ends the quarantine of `id` now (a replayed create takes it back, see
    /// `alloc::wanted`).
    pub(crate) fn unquarantine(&mut self, id: InodeId) {
        if self.quarantined.remove(&id) {
            self.quarantine.retain(|&(_, q)| q != id);
        }
    }

    /// Applies mutations made by a live operation (already checked, so they cannot fail).
    pub(crate) fn apply_live(&mut self, muts: &[Mutation]) {
        for m in muts {
            if let Mutation::DropInode { id } = m
                && self.quarantined.insert(*id)
            {
                self.quarantine.push_back((self.clock, *id));
            }
            if let Err(e) = self.apply(m) {
                // Operations check everything before emitting mutations; reaching this is a bug.
                panic!("live mutation failed after its checks passed: {e}");
            }
        }
    }

    /// Applies one mutation to the table that holds its key.
    pub fn apply(&mut self, m: &Mutation) -> Result<(), ApplyError> {
        let key = m.table_key();
        let i = self.table_index(key).ok_or(ApplyError::NotHosted { key })?;
        match m {
            // Every stored inode has a type (operations create none without), so that
            // `Inode::kind` never has to guess; a record that says otherwise is damage.
            Mutation::PutInode { inode, .. } if FileKind::from_mode(inode.mode).is_none() => {
                return Err(ApplyError::NoFileType {
                    id: key,
                    mode: inode.mode,
                });
            }
            Mutation::PutInode { id, inode } => self.tables[i].put_inode(*id, inode.clone()),
            Mutation::DropInode { id } => self.tables[i].drop_inode(*id),
            Mutation::PutDentry {
                parent,
                name,
                child,
                kind,
            } => {
                let hash = self.name_hash(name.as_bytes());
                let d = Dentry {
                    name: name.clone(),
                    child: *child,
                    kind: *kind,
                };
                if !self.tables[i].put_dentry(*parent, hash, d) {
                    return Err(ApplyError::BucketFull {
                        parent: *parent,
                        name: format!("{name:?}"),
                    });
                }
            }
            Mutation::DropDentry { parent, name } => {
                let hash = self.name_hash(name.as_bytes());
                self.tables[i].drop_dentry(*parent, hash, name.as_bytes());
            }
            Mutation::SetXattr { id, name, value } => self.tables[i].set_xattr(*id, name, value),
            Mutation::DropXattr { id, name } => self.tables[i].drop_xattr(*id, name),
            Mutation::PutReclaim {
                id,
                generation,
                from,
            } => self.tables[i].put_reclaim(crate::table::Reclaim {
                id: *id,
                generation: *generation,
                from: *from,
            }),
            Mutation::DropReclaim { id, generation } => {
                self.tables[i].drop_reclaim(*id, *generation)
            }
            Mutation::SetRegionNext { region, next } => {
                if *region == Region::Primary {
                    return Err(ApplyError::PrimaryRegionNext);
                }
                self.tables[i].raise_region_next(*next)
            }
            // Applied whether or not the inode is there: a replayed record may precede the
            // removal that a checkpoint already holds (the removal's record follows it and
            // drops the layout again).
            Mutation::PutChunk { id, chunk, refs } => {
                if *chunk >= crate::table::CHUNK_COUNT_MAX || refs.iter().any(|r| !r.is_valid()) {
                    return Err(ApplyError::BadChunk {
                        id: *id,
                        chunk: *chunk,
                    });
                }
                self.tables[i].put_chunk(*id, *chunk, refs.clone())
            }
            Mutation::DropChunks { id, from } => self.tables[i].drop_chunks(*id, *from),
        }
        Ok(())
    }

    /// Replays the mutations of the journal record with sequence number `lsn`, skipping
    /// tables whose checkpoint already covers it and tables not hosted here.
    pub fn replay(&mut self, lsn: u64, muts: &[Mutation]) -> Result<(), ApplyError> {
        for m in muts {
            match self.table_index(m.table_key()) {
                Some(i)
                    if self.tables[i].replay_from < lsn && lsn <= self.tables[i].replay_until =>
                {
                    self.apply(m)?
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Gives a hosted region table that never recorded its allocation point but holds ids
    /// of its region (data written before the point was recorded) one derived from the
    /// highest of them, once; from then on the point is recorded (journaled with
    /// every allocation that moves it, written in checkpoints) and never derived again, so
    /// an id placed high cannot move it. Called after tables are loaded.
    pub fn fill_region_next(&mut self) {
        for r in OVERFLOW_REGIONS {
            let Some(i) = self.table_index(r.base()) else {
                continue;
            };
            if self.tables[i].region_next().is_some() {
                continue;
            }
            let highest = self
                .tables
                .iter()
                .filter(|t| t.lo < r.end() && t.hi > r.base())
                .filter_map(|t| t.max_id_below(r.end().min(t.hi)))
                .filter(|&id| Region::of(id) == r)
                .max();
            // None present: the first value is implied, nothing to record.
            if let Some(id) = highest {
                let next = (self.region_unit(r, id) + 1).max(self.region_first(r));
                self.tables[i].raise_region_next(next);
            }
        }
    }

    /// The first value of an overflow region's allocator: too-deep root and too-wide range
    /// numbers start at 1 (0 is the region's empty slot), catch-all ids at
    /// [`CATCHALL_FIRST`].
    pub(crate) fn region_first(&self, r: Region) -> u64 {
        match r {
            Region::CatchAll => CATCHALL_FIRST,
            _ => 1,
        }
    }

    /// What an overflow region's allocator counts for `id`: its too-deep root number, its
    /// too-wide range number, or (catch-all) the id itself.
    pub(crate) fn region_unit(&self, r: Region, id: InodeId) -> u64 {
        match r {
            Region::TooDeep => self.policy.deep_number(id),
            Region::TooWide => self.policy.wide_number(id),
            _ => id,
        }
    }

    /// The allocation point of overflow region `r`: its next unit (see `region_unit`), or
    /// `None` if the table that holds the region is not hosted here.
    pub fn region_next(&self, r: Region) -> Option<u64> {
        let i = self.table_index(r.base())?;
        Some(self.tables[i].region_next().unwrap_or(self.region_first(r)))
    }

    /// Runs one operation: checks it, emits its mutations into `out` (which the caller
    /// journals) and applies them. Read-only operations emit nothing.
    pub fn execute(
        &mut self,
        cred: &Credentials,
        op: &Op,
        now: TimeNs,
        out: &mut Vec<Mutation>,
    ) -> Reply {
        let start = out.len();
        self.advance_clock(now);
        let result = self.dispatch(cred, op, now, out);
        match result {
            Ok(reply) => reply,
            Err(fail) => {
                debug_assert_eq!(out.len(), start, "a failed operation emitted mutations");
                out.truncate(start);
                self.fail_reply(fail)
            }
        }
    }

    /// A failure as the reply to a request: an inode of a table not hosted here is
    /// WRONG_SERVER at a member (it borrows the table named in `last_not_hosted` and asks
    /// again).
    fn fail_reply(&mut self, fail: Fail) -> Reply {
        match fail {
            Fail::Fs(e) => Reply::Error(e),
            Fail::NotHosted(id) if self.member || self.departed(id) => {
                self.last_not_hosted = Some(id);
                Reply::WrongServer {
                    map_version: self.epoch,
                    owner: None,
                    addr: None,
                }
            }
            Fail::NotHosted(id) => Reply::Error(not_in_any_table(id)),
        }
    }

    /// The attributes of `id` for an answer given without running anything (a retry of
    /// a create whose first attempt ran): `Ok(None)` if it is gone. A table not hosted
    /// here is answered as [`Engine::execute`] answers it: a member does not say the file
    /// is gone when it only lacks the table the first attempt borrowed.
    pub fn attr_for_retry(&mut self, id: InodeId) -> Result<Option<Attr>, Box<Reply>> {
        match self.table(id) {
            Ok(t) => Ok(t.inode(id).map(|i| i.attr(id))),
            Err(fail) => Err(Box::new(self.fail_reply(fail))),
        }
    }

    /// Takes the quarantined ids in `[lo, hi)` (a table leaving this engine): the next
    /// owner keeps them out of use (see [`Engine::quarantine_arrived`]).
    pub fn take_quarantine(&mut self, lo: InodeId, hi: InodeId) -> Vec<InodeId> {
        let mut out = Vec::new();
        self.quarantine.retain(|&(_, id)| {
            let inside = (lo..hi).contains(&id);
            if inside {
                out.push(id);
            }
            !inside
        });
        for id in &out {
            self.quarantined.remove(id);
        }
        out
    }

    /// Quarantines ids that arrived with a table, for a whole quarantine from now (longer
    /// than they had left at the server before: harmless, and no clocks are compared).
    pub fn quarantine_arrived(&mut self, ids: &[InodeId]) {
        for &id in ids {
            if self.quarantined.insert(id) {
                self.quarantine.push_back((self.clock, id));
            }
        }
    }

    /// Notes the time and releases ids whose quarantine is over.
    pub fn advance_clock(&mut self, now: TimeNs) {
        self.clock = self.clock.max(now);
        while let Some(&(t, id)) = self.quarantine.front() {
            if self.clock.saturating_sub(t) < QUARANTINE_NS {
                break;
            }
            self.quarantine.pop_front();
            self.quarantined.remove(&id);
        }
    }

    /// Total inodes and entries over all tables.
    pub fn counts(&self) -> (u64, u64) {
        self.tables.iter().fold((0, 0), |(i, d), t| {
            (i + t.inode_count(), d + t.dentry_count())
        })
    }

    /// Checks the namespace invariants of DESIGN.md over every hosted table: every entry
    /// names a live inode of the right type and lies in a directory that still has its name,
    /// nlink equals the number of names (directories:
    /// 2 + subdirectories, as ext4 counts), every directory but the root has exactly one
    /// name, in the directory its parent link names, and parent links lead to the root.
    /// Returns the problems found (empty when consistent). Linear in the namespace size.
    /// A cluster member checks what its own tables show (names of other servers' inodes
    /// and links held in their directories are left to a whole-cluster check).
    pub fn check_invariants(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut names: rustc_hash::FxHashMap<InodeId, u32> = Default::default();
        let mut subdirs: rustc_hash::FxHashMap<InodeId, u32> = Default::default();
        let mut dir_name_in: rustc_hash::FxHashMap<InodeId, InodeId> = Default::default();
        for t in &self.tables {
            for (dir, entries) in t.iter_dirs() {
                match t.inode(dir) {
                    // A removed directory (kept while open) has no entries: they would go
                    // with it at its last close and leave their inodes with a lost name.
                    Some(d) if d.is_dir() && d.nlink != 0 => {}
                    _ => problems.push(format!(
                        "entries under {dir:#x}, which is not a live directory"
                    )),
                }
                for (_, e) in entries.iter() {
                    let hosted = self.table_index(e.child).is_some();
                    if !hosted && self.member {
                        // Another server's inode: only a whole-cluster check sees it.
                        if e.kind == FileKind::Dir {
                            *subdirs.entry(dir).or_default() += 1;
                        }
                        continue;
                    }
                    let Some(child) = self.inode(e.child) else {
                        problems.push(format!(
                            "{dir:#x}/{:?} names missing inode {:#x}",
                            e.name, e.child
                        ));
                        continue;
                    };
                    if child.kind() != e.kind {
                        problems.push(format!(
                            "{dir:#x}/{:?} has kind {:?}, inode is {:?}",
                            e.name,
                            e.kind,
                            child.kind()
                        ));
                    }
                    *names.entry(e.child).or_default() += 1;
                    if e.kind == FileKind::Dir {
                        *subdirs.entry(dir).or_default() += 1;
                        if let Some(prev) = dir_name_in.insert(e.child, dir) {
                            problems.push(format!(
                                "directory {:#x} has names in {prev:#x} and {dir:#x}",
                                e.child
                            ));
                        }
                    }
                }
            }
        }
        let root = self.root();
        for t in &self.tables {
            for (id, inode) in t.iter_inodes() {
                let n = names.get(&id).copied().unwrap_or(0);
                if inode.is_dir() && inode.nlink == 0 && n == 0 && !subdirs.contains_key(&id) {
                    // Removed while open: lives until its last close.
                    continue;
                }
                if inode.is_dir() {
                    let expect = 2 + subdirs.get(&id).copied().unwrap_or(0);
                    let saturated = inode.nlink == 1 && expect >= kochab_proto::LINK_MAX;
                    if inode.nlink != expect && !saturated {
                        problems.push(format!(
                            "directory {id:#x} has nlink {} but {} subdirectories",
                            inode.nlink,
                            expect - 2
                        ));
                    }
                    let parent = inode.dir().map_or(0, |d| d.parent);
                    if id == root {
                        if n != 0 || parent != root {
                            problems.push("root has a name or a foreign parent".to_string());
                        }
                    } else if self.member
                        && !dir_name_in.contains_key(&id)
                        && self.table_index(parent).is_none()
                    {
                        // Named in another server's directory.
                    } else if dir_name_in.get(&id) != Some(&parent) {
                        problems.push(format!(
                            "directory {id:#x}: parent link {parent:#x} but named in {:?}",
                            dir_name_in.get(&id)
                        ));
                    }
                } else if inode.nlink != n && !(self.member && n < inode.nlink) {
                    // (A member sees only the names in the directories it hosts: fewer
                    // names than links may be names held elsewhere.)
                    problems.push(format!(
                        "inode {id:#x} has nlink {} but {n} names",
                        inode.nlink
                    ));
                }
            }
        }
        self.check_region_ids(&mut problems);
        self.check_layouts(&mut problems);
        // Parent links lead to the root without a cycle.
        for t in &self.tables {
            for (id, inode) in t.iter_inodes() {
                if !inode.is_dir() || inode.nlink == 0 {
                    continue;
                }
                let mut cur = id;
                let mut steps = 0;
                while cur != root {
                    steps += 1;
                    if self.member && self.table_index(cur).is_none() {
                        // The walk goes on at another server.
                        break;
                    }
                    match self.inode(cur).and_then(|i| i.dir()) {
                        Some(d) if steps < 100_000 => cur = d.parent,
                        _ => {
                            problems.push(format!("directory {id:#x} does not lead to the root"));
                            break;
                        }
                    }
                }
            }
        }
        problems
    }
}

impl Engine {
    /// Reports the inodes of the overflow regions that lie at or past their region's
    /// recorded allocation point (or below its first value): no allocation handed them out.
    /// (Primary ids have no region-wide point: a directory's allocator restarts when it
    /// empties, while files renamed away keep their ids, so a directory's range is checked
    /// by no high-water mark.)
    fn check_region_ids(&self, problems: &mut Vec<String>) {
        for r in OVERFLOW_REGIONS {
            let Some(next) = self.region_next(r) else {
                continue;
            };
            let first = self.region_first(r);
            let mut found = 0u64;
            for t in self
                .tables
                .iter()
                .filter(|t| t.lo < r.end() && t.hi > r.base())
            {
                for (id, _) in t.iter_inodes() {
                    let unit = self.region_unit(r, id);
                    if Region::of(id) != r || (first..next).contains(&unit) {
                        continue;
                    }
                    found += 1;
                    if found <= REGION_PROBLEMS_MAX {
                        problems.push(format!(
                            "inode {id:#x} lies outside the {} region's allocated range \
                             ({first}..{next} of its {}): no allocation handed it out",
                            r.label(),
                            match r {
                                Region::TooDeep => "root numbers",
                                Region::TooWide => "range numbers",
                                _ => "ids",
                            }
                        ));
                    }
                }
            }
            if found > REGION_PROBLEMS_MAX {
                problems.push(format!(
                    "... and {} more inodes outside the {} region's allocated range",
                    found - REGION_PROBLEMS_MAX,
                    r.label()
                ));
            }
        }
    }
}

fn name_hash([k0, k1]: [u64; 2], name: &[u8]) -> u64 {
    let mut h = SipHasher13::new_with_keys(k0, k1);
    h.write(name);
    h.finish() >> 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster's engine with one file, "f" in the root (made at time 2): the engine, the
    /// root and the file.
    fn engine_with_a_file() -> (Engine, InodeId, InodeId) {
        let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
        for m in e.bootstrap(1) {
            e.apply(&m).unwrap();
        }
        let root = e.root();
        let op = Op::Mknod {
            parent: root,
            name: b"f".to_vec(),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        };
        let id = match e.execute(&Credentials::root(), &op, 2, &mut Vec::new()) {
            Reply::Entry(a) => a.id,
            other => panic!("{other:?}"),
        };
        (e, root, id)
    }

    #[test]
    fn quarantined_ids_leave_with_their_table_and_stay_out_of_use_where_it_arrives() {
        let (mut e, root, id) = engine_with_a_file();
        let cred = Credentials::root();
        let mut out = Vec::new();
        let unlink = Op::Unlink {
            parent: root,
            name: b"f".to_vec(),
        };
        assert!(matches!(
            e.execute(&cred, &unlink, 3, &mut out),
            Reply::Empty | Reply::WithDirs { .. }
        ));
        assert!(!e.is_free(id), "quarantined after its removal");
        let t = &e.tables()[e.table_index(id).unwrap()];
        let (lo, hi) = (t.lo, t.hi);
        let moved = e.take_quarantine(lo, hi);
        assert_eq!(moved, vec![id]);
        assert!(e.is_free(id), "no longer this engine's to hold");
        e.quarantine_arrived(&moved);
        assert!(!e.is_free(id), "held where the table arrived");
        e.advance_clock(3 + QUARANTINE_NS);
        assert!(e.is_free(id), "until a whole quarantine has passed");
    }

    #[test]
    fn a_replayed_create_takes_back_an_id_its_replayed_removal_quarantined() {
        // Before a crash: `f` removed, its id reused (its quarantine over) by a create
        // answered early; both records lost. The replays run the removal again now, which
        // quarantines the id here, and the create must still get the id its reply gave.
        let (mut e, root, id) = engine_with_a_file();
        let cred = Credentials::root();
        let mut out = Vec::new();
        let unlink = Op::Unlink {
            parent: root,
            name: b"f".to_vec(),
        };
        e.execute(&cred, &unlink, 3, &mut out);
        assert!(!e.is_free(id), "quarantined after its removal");
        e.want_id = Some(id);
        let op = Op::Mknod {
            parent: root,
            name: b"g".to_vec(),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        };
        let reply = e.execute(&cred, &op, 4, &mut out);
        assert_eq!(e.child(root, b"g"), Some(id), "{reply:?}");
        // Removed again, it is quarantined again, for a whole quarantine from now.
        let unlink = Op::Unlink {
            parent: root,
            name: b"g".to_vec(),
        };
        e.execute(&cred, &unlink, 5, &mut out);
        e.advance_clock(4 + QUARANTINE_NS);
        assert!(!e.is_free(id), "its second quarantine is not over");
        e.advance_clock(5 + QUARANTINE_NS);
        assert!(e.is_free(id));
        assert!(e.check_invariants().is_empty());
    }

    #[test]
    fn a_retry_at_a_member_without_the_inodes_table_is_wrong_server_not_gone() {
        let (mut e, _, id) = engine_with_a_file();
        assert_eq!(e.attr_for_retry(id).unwrap().map(|a| a.id), Some(id));
        let lo = e.tables()[e.table_index(id).unwrap()].lo;
        e.member = true;
        let table = e.remove_table(lo).unwrap();
        let reply = *e.attr_for_retry(id).unwrap_err();
        assert!(matches!(reply, Reply::WrongServer { .. }), "{reply:?}");
        assert_eq!(e.last_not_hosted, Some(id), "the member borrows its table");
        e.insert_table(table).unwrap();
        assert!(e.attr_for_retry(id).unwrap().is_some());
    }

    #[test]
    fn split_points_fall_between_subtrees_never_inside_a_directory() {
        let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
        for m in e.bootstrap(1) {
            e.apply(&m).unwrap();
        }
        let root = e.root();
        let cred = Credentials::root();
        let mut out = Vec::new();
        let mut run = |e: &mut Engine, op: Op| match e.execute(&cred, &op, 2, &mut out) {
            Reply::Entry(a) => a.id,
            other => panic!("{other:?}"),
        };
        let top = run(
            &mut e,
            Op::Mkdir {
                parent: root,
                name: b"top".to_vec(),
                mode: 0o755,
            },
        );
        let lo = e.tables()[e.table_index(top).unwrap()].lo;
        // One directory of files only: no boundary keeps it whole.
        for i in 0..200 {
            run(
                &mut e,
                Op::Mknod {
                    parent: top,
                    name: format!("f{i}").into_bytes(),
                    mode: mode::S_IFREG | 0o644,
                    rdev: 0,
                    exclusive: true,
                },
            );
        }
        assert!(e.split_point(lo).is_err());
        // Four subdirectories of 100 files each: the cut falls between two of them, with
        // half the inodes below.
        let mut subs = Vec::new();
        for d in 0..4 {
            let sub = run(
                &mut e,
                Op::Mkdir {
                    parent: top,
                    name: format!("d{d}").into_bytes(),
                    mode: 0o755,
                },
            );
            subs.push(sub);
            for i in 0..100 {
                run(
                    &mut e,
                    Op::Mknod {
                        parent: sub,
                        name: format!("f{i}").into_bytes(),
                        mode: mode::S_IFREG | 0o644,
                        rdev: 0,
                        exclusive: true,
                    },
                );
            }
        }
        let at = e.split_point(lo).unwrap();
        assert!(
            subs.contains(&at),
            "{at:#x} is the start of a subtree: {subs:x?}"
        );
        assert_eq!(at, subs[1], "201 + 101 inodes below d1, 303 from it on");
        assert_eq!(e.split_table(lo, at), Ok(at));
        assert!(e.check_invariants().is_empty());
        // Overflow regions are never split.
        assert!(e.split_point(crate::Region::TooWide.base()).is_err());
    }

    #[test]
    fn a_split_table_serves_the_same_namespace_from_two_tables() {
        let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
        for m in e.bootstrap(1) {
            e.apply(&m).unwrap();
        }
        let root = e.root();
        let cred = Credentials::root();
        let mut out = Vec::new();
        let mut ids = Vec::new();
        for i in 0..300 {
            let op = Op::Mknod {
                parent: root,
                name: format!("f{i}").into_bytes(),
                mode: mode::S_IFREG | 0o644,
                rdev: 0,
                exclusive: true,
            };
            match e.execute(&cred, &op, 2, &mut out) {
                Reply::Entry(a) => ids.push(a.id),
                other => panic!("{other:?}"),
            }
        }
        let lo = e.tables()[e.table_index(root).unwrap()].lo;
        let before = e.counts();
        // Split inside the files' ids, on a box boundary.
        let at = (ids[150] >> crate::table::BOX_SHIFT) << crate::table::BOX_SHIFT;
        assert!(e.split_table(lo, at + 1).is_err(), "not a box boundary");
        assert_eq!(e.split_table(lo, at), Ok(at));
        let (i, j) = (e.table_index(root).unwrap(), e.table_index(at).unwrap());
        assert_eq!((e.tables()[i].hi, e.tables()[j].lo), (at, at));
        assert!(e.tables()[i].inode_count() > 0 && e.tables()[j].inode_count() > 0);
        assert_eq!(e.counts(), before);
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
        for (k, id) in ids.iter().enumerate() {
            let op = Op::Lookup {
                parent: root,
                name: format!("f{k}").into_bytes(),
            };
            match e.execute(&cred, &op, 3, &mut out) {
                Reply::Entry(a) => assert_eq!(a.id, *id),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_inode_without_a_file_type_is_never_stored() {
        let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
        let id = e.root() + 5;
        let typeless = Mutation::PutInode {
            id,
            inode: Inode::new(0o644, 0, 0, 1),
        };
        assert!(
            e.apply(&typeless).is_err(),
            "a replayed record like this is damage"
        );
        assert!(e.inode(id).is_none());
        let typed = Mutation::PutInode {
            id,
            inode: Inode::new(mode::S_IFREG | 0o644, 0, 0, 1),
        };
        e.apply(&typed).unwrap();
        assert_eq!(e.inode(id).map(|i| i.kind()), Some(FileKind::File));
    }
}
