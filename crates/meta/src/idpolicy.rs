//! The child-closest id policy (Ursa Minor §3.3, Fig. 1): id arithmetic only.
//!
//! A 64-bit id is `2 region bits | 62 bits`. In the primary and too-deep regions the 62 bits
//! are a directory segment of slots (one per tree level, most significant first) followed
//! by a file segment. A directory copies its parent's directory segment and takes a value in
//! the first empty slot; its files take values of its file segment. So a subtree is a
//! contiguous id range and parent and child almost always share a table.
//!
//! Overflow goes elsewhere: a directory too deep for the slots becomes a new root in the
//! too-deep region; a directory with too many files first takes over the file segment of its
//! nonexistent next sibling ("cousins"), then ranges of the too-wide region (few directory
//! bits, many file bits); when those run out, ids come sequentially from the catch-all region.
//! The allocation state machine lives in the engine (it needs the tables); this module only
//! computes ids.

use crate::error::ConfigError;
use kochab_proto::InodeId;
use serde::{Deserialize, Serialize};

/// Bits below the two region bits.
pub const REGION_SHIFT: u32 = 62;

/// The four regions of the id space, by their two prefix bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Region {
    /// Sequential ids for whatever overflowed everything else (prefix 00; 0 and 1 unused,
    /// so FUSE's root inode number 1 never names a real inode).
    CatchAll = 0,
    /// The child-closest tree under the root (prefix 01).
    Primary = 1,
    /// New roots for directories deeper than the primary slots (prefix 10).
    TooDeep = 2,
    /// File ranges for directories with too many files (prefix 11).
    TooWide = 3,
}

impl Region {
    /// The region an id belongs to.
    pub fn of(id: InodeId) -> Region {
        match id >> REGION_SHIFT {
            0 => Region::CatchAll,
            1 => Region::Primary,
            2 => Region::TooDeep,
            _ => Region::TooWide,
        }
    }

    /// The lowest id of the region.
    pub fn base(self) -> InodeId {
        (self as u64) << REGION_SHIFT
    }

    /// One past the highest id of the region (saturating for the last region).
    pub fn end(self) -> InodeId {
        match self {
            Region::TooWide => u64::MAX,
            r => ((r as u64) + 1) << REGION_SHIFT,
        }
    }

    /// Lower-case name for status output.
    pub fn label(self) -> &'static str {
        match self {
            Region::CatchAll => "catch-all",
            Region::Primary => "primary",
            Region::TooDeep => "too-deep",
            Region::TooWide => "too-wide",
        }
    }
}

/// Lowest id the catch-all region hands out.
pub const CATCHALL_FIRST: InodeId = 2;

/// Bit widths of the id segments. Configuration, not constants: tune for the workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdPolicyConfig {
    /// Directory slot widths of the primary region, root level first.
    pub primary_slots: Vec<u8>,
    /// Directory slot widths of the too-deep region; slot 0 numbers the new roots.
    pub deep_slots: Vec<u8>,
    /// Directory-number bits of the too-wide region; the rest is file segment.
    pub wide_dir_bits: u8,
}

impl Default for IdPolicyConfig {
    /// 7 levels before a subtree overflows to the too-deep region (255 top-level directories,
    /// then 127, 63, 63, 31, 31, 15 per level) and 2^21 files per directory before it
    /// borrows a sibling's range; 65535 too-deep roots; 2^20 too-wide ranges of 2^42 files.
    fn default() -> Self {
        IdPolicyConfig {
            primary_slots: vec![8, 7, 6, 6, 5, 5, 4],
            deep_slots: vec![16, 6, 6, 5, 5],
            wide_dir_bits: 20,
        }
    }
}

/// One region's split into directory slots and a file segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    slot_bits: Vec<u32>,
    /// Right shift of each slot's value.
    shifts: Vec<u32>,
    file_bits: u32,
    region: Region,
}

impl Layout {
    fn new(region: Region, slots: &[u8]) -> Result<Layout, ConfigError> {
        if slots.is_empty() {
            return Err(ConfigError(format!(
                "{} region needs at least one directory slot",
                region.label()
            )));
        }
        let total: u32 = slots.iter().map(|&b| b as u32).sum();
        if slots.iter().any(|&b| b == 0 || b > 32) {
            return Err(ConfigError(format!(
                "{} slot widths must be 1..=32 bits",
                region.label()
            )));
        }
        // A file segment narrower than 8 bits overflows after 255 files: useless.
        if total + 8 > REGION_SHIFT {
            return Err(ConfigError(format!(
                "{} slots use {total} bits; at most {} allowed",
                region.label(),
                REGION_SHIFT - 8
            )));
        }
        let mut shifts = Vec::with_capacity(slots.len());
        let mut used = 0;
        for &b in slots {
            used += b as u32;
            shifts.push(REGION_SHIFT - used);
        }
        Ok(Layout {
            slot_bits: slots.iter().map(|&b| b as u32).collect(),
            shifts,
            file_bits: REGION_SHIFT - total,
            region,
        })
    }

    /// Number of directory slots (tree levels) of this layout.
    pub fn levels(&self) -> usize {
        self.slot_bits.len()
    }

    /// Largest value slot `level` can hold (0 means "empty slot").
    pub fn slot_max(&self, level: usize) -> u64 {
        (1u64 << self.slot_bits[level]) - 1
    }

    /// Ids one value of slot `level` spans: the size of a subtree rooted at that level.
    pub fn slot_span(&self, level: usize) -> u64 {
        1u64 << self.shifts[level]
    }

    /// Value of slot `level` of `id`.
    pub fn slot(&self, id: InodeId, level: usize) -> u64 {
        (id >> self.shifts[level]) & self.slot_max(level)
    }

    /// Filled slots of a directory id: its depth below the region's root.
    pub fn depth(&self, id: InodeId) -> usize {
        (0..self.levels())
            .take_while(|&l| self.slot(id, l) != 0)
            .count()
    }

    /// The id with its file segment cleared.
    pub fn dir_base(&self, id: InodeId) -> InodeId {
        id & !((1u64 << self.file_bits) - 1)
    }

    /// The file segment of `id`.
    pub fn file_part(&self, id: InodeId) -> u64 {
        id & ((1u64 << self.file_bits) - 1)
    }

    /// The files' id range `[lo, hi)` of the directory whose base is `dir_base(dir)`.
    pub fn file_range(&self, dir: InodeId) -> (InodeId, InodeId) {
        let base = self.dir_base(dir);
        (base + 1, base + (1u64 << self.file_bits))
    }

    /// The id of child directory number `value` of `parent`, if the slots allow one.
    pub fn child_dir(&self, parent: InodeId, value: u64) -> Option<InodeId> {
        let level = self.depth(parent);
        if level >= self.levels() || value == 0 || value > self.slot_max(level) {
            return None;
        }
        Some(self.dir_base(parent) | (value << self.shifts[level]))
    }

    /// The directory one level up in id space (not necessarily the current parent: renames
    /// move directories without changing ids) and this directory's slot value there.
    pub fn id_parent(&self, dir: InodeId) -> Option<(InodeId, u64)> {
        let depth = self.depth(dir);
        if depth == 0 {
            return None;
        }
        let level = depth - 1;
        let value = self.slot(dir, level);
        Some((
            self.dir_base(dir) & !(self.slot_max(level) << self.shifts[level]),
            value,
        ))
    }

    /// Root id number `value` of a region whose roots are numbered by slot 0 (too-deep,
    /// too-wide).
    pub fn root(&self, value: u64) -> Option<InodeId> {
        if value == 0 || value > self.slot_max(0) {
            return None;
        }
        Some(self.region.base() | (value << self.shifts[0]))
    }
}

/// The configured id policy: a layout per structured region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdPolicy {
    pub config: IdPolicyConfig,
    pub primary: Layout,
    pub deep: Layout,
    pub wide: Layout,
}

impl IdPolicy {
    /// Checks the widths and precomputes shifts.
    pub fn new(config: IdPolicyConfig) -> Result<IdPolicy, ConfigError> {
        let primary = Layout::new(Region::Primary, &config.primary_slots)?;
        let deep = Layout::new(Region::TooDeep, &config.deep_slots)?;
        let wide = Layout::new(Region::TooWide, &[config.wide_dir_bits])?;
        Ok(IdPolicy {
            config,
            primary,
            deep,
            wide,
        })
    }

    /// The root directory: the primary region with every slot empty.
    pub fn root(&self) -> InodeId {
        Region::Primary.base()
    }

    /// The layout that structures directory `id`, if its region has one that places
    /// children (primary and too-deep; too-wide holds only files, catch-all is flat).
    pub fn tree_layout(&self, id: InodeId) -> Option<&Layout> {
        match Region::of(id) {
            Region::Primary => Some(&self.primary),
            Region::TooDeep => Some(&self.deep),
            _ => None,
        }
    }

    /// The own file range `[lo, hi)` of a directory, if its region gives it one.
    pub fn own_file_range(&self, dir: InodeId) -> Option<(InodeId, InodeId)> {
        let layout = self.tree_layout(dir)?;
        if Region::of(dir) == Region::TooDeep && layout.depth(dir) == 0 {
            return None; // not a real directory id
        }
        Some(layout.file_range(dir))
    }

    /// Too-wide file range number `n`.
    pub fn wide_range(&self, n: u64) -> Option<(InodeId, InodeId)> {
        let base = self.wide.root(n)?;
        Some(self.wide.file_range(base))
    }

    /// The too-wide range number an id of that region belongs to.
    pub fn wide_number(&self, id: InodeId) -> u64 {
        self.wide.slot(id, 0)
    }

    /// The too-deep root number an id of that region belongs to.
    pub fn deep_number(&self, id: InodeId) -> u64 {
        self.deep.slot(id, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit example of the paper's Fig. 1, scaled: 4-bit slots and file segment.
    fn small() -> IdPolicy {
        IdPolicy::new(IdPolicyConfig {
            primary_slots: vec![4, 4, 4],
            deep_slots: vec![8, 4],
            wide_dir_bits: 8,
        })
        .unwrap()
    }

    #[test]
    fn children_share_the_parent_prefix() {
        let p = small();
        let l = &p.primary;
        let root = p.root();
        assert_eq!(l.depth(root), 0);
        let a = l.child_dir(root, 1).unwrap();
        let b = l.child_dir(a, 3).unwrap();
        assert_eq!(l.depth(a), 1);
        assert_eq!(l.depth(b), 2);
        assert_eq!(l.id_parent(b), Some((a, 3)));
        assert_eq!(l.id_parent(a), Some((root, 1)));
        let (lo, hi) = l.file_range(b);
        assert_eq!(lo, b + 1);
        assert!(hi > lo && l.dir_base(hi - 1) == b);
        // Every id of b's subtree lies between a and a's next sibling.
        let a2 = l.child_dir(root, 2).unwrap();
        assert!(a < b && b < a2 && hi <= a2);
    }

    #[test]
    fn depth_and_width_limits() {
        let p = small();
        let l = &p.primary;
        let mut d = p.root();
        for lvl in 0..l.levels() {
            d = l.child_dir(d, 15).unwrap_or_else(|| panic!("level {lvl}"));
        }
        assert_eq!(l.child_dir(d, 1), None, "too deep");
        assert_eq!(l.child_dir(p.root(), 16), None, "too wide for a 4-bit slot");
        assert_eq!(l.child_dir(p.root(), 0), None, "0 is the empty slot");
    }

    #[test]
    fn regions_are_disjoint() {
        let p = small();
        for id in [
            p.root(),
            p.deep.root(1).unwrap(),
            p.wide_range(1).unwrap().0,
            CATCHALL_FIRST,
        ] {
            let r = Region::of(id);
            assert!(r.base() <= id && id < r.end());
        }
        assert_eq!(Region::of(p.deep.root(5).unwrap()), Region::TooDeep);
        assert_eq!(p.deep_number(p.deep.root(5).unwrap()), 5);
        assert_eq!(Region::of(p.wide_range(7).unwrap().0), Region::TooWide);
        assert_eq!(p.wide_number(p.wide_range(7).unwrap().0), 7);
    }

    #[test]
    fn bad_widths_are_refused() {
        assert!(
            IdPolicy::new(IdPolicyConfig {
                primary_slots: vec![],
                ..Default::default()
            })
            .is_err()
        );
        assert!(
            IdPolicy::new(IdPolicyConfig {
                primary_slots: vec![30, 30],
                ..Default::default()
            })
            .is_err()
        );
        assert!(IdPolicy::new(IdPolicyConfig::default()).is_ok());
    }
}
