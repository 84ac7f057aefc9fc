//! A table: every inode whose id lies in `[lo, hi)`, the entries of those that are
//! directories, their extended attributes and the chunk layouts of their data (on an
//! object store without positioned I/O, see `kochab_proto::layout`). Inodes are grouped in boxes of 64
//! consecutive ids (the child-closest policy makes a directory's files consecutive, so boxes
//! fill up) and the boxes changed since the last checkpoint are tracked, so checkpoints are
//! incremental (the "dirty boxes" of Xing et al.).

use crate::dir::{Dentry, DirEntries};
use crate::error::{ImageError, TableError};
use crate::inode::Inode;
use crate::name::Name;
use kochab_proto::layout::SliceRef;
use kochab_proto::{CHUNK_BYTES, FILE_BYTES_MAX, FileKind, InodeId};
use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// log2 of the inodes per box.
pub const BOX_SHIFT: u32 = 6;
const BOX_MASK: u64 = (1 << BOX_SHIFT) - 1;

/// Extended attributes of one inode, by name.
pub type Xattrs = BTreeMap<Vec<u8>, Vec<u8>>;

/// A file's data layout: per chunk that has any, its refs, oldest first.
pub type FileLayout = BTreeMap<u64, Vec<SliceRef>>;

/// log2 of the chunks per layout group: the unit of dirty tracking and of checkpoint
/// images for layouts. 1024 chunks are 4 GiB of a file, typically a few dozen KiB of
/// refs, so appending to a huge file rewrites one group per checkpoint, not its whole
/// layout (a 1 TiB file has 256 groups).
pub const LAYOUT_GROUP_SHIFT: u32 = 10;
/// Bytes of refs one layout image record aims at: a group holding more is cut into several
/// records (each at least one whole chunk). Far below the checkpoint's box-image limit
/// (16 MiB) so that even a chunk at its ref limit plus the rest of its record fits, and
/// small enough that copying one under the core lock is short.
pub const LAYOUT_RECORD_BYTES: usize = 1 << 20;
/// Most postcard bytes one chunk costs in an image beside its refs (chunk number and
/// count), and one ref (object, pos and len as varints): the estimate that cuts records.
const LAYOUT_CHUNK_IMAGE_BYTES: usize = 15;
const LAYOUT_REF_IMAGE_BYTES: usize = 20;
/// Chunks a file may have: those that start below the largest file size.
pub const CHUNK_COUNT_MAX: u64 = FILE_BYTES_MAX.div_ceil(CHUNK_BYTES);

/// The layout group of chunk `chunk`.
pub fn layout_group(chunk: u64) -> u64 {
    chunk >> LAYOUT_GROUP_SHIFT
}

/// The chunks of layout group `group`.
pub fn layout_group_chunks(group: u64) -> std::ops::Range<u64> {
    let lo = group << LAYOUT_GROUP_SHIFT;
    lo..lo.saturating_add(1 << LAYOUT_GROUP_SHIFT)
}

/// Up to 64 inodes with consecutive ids, stored densely.
#[derive(Clone, Debug, Default)]
struct InodeBox {
    present: u64,
    inodes: Vec<Inode>,
}

impl InodeBox {
    fn rank(&self, slot: u32) -> usize {
        (self.present & ((1u64 << slot) - 1)).count_ones() as usize
    }

    fn has(&self, slot: u32) -> bool {
        self.present & (1u64 << slot) != 0
    }

    fn get(&self, slot: u32) -> Option<&Inode> {
        self.has(slot).then(|| &self.inodes[self.rank(slot)])
    }

    /// Stores an inode; true if the slot was empty.
    fn put(&mut self, slot: u32, inode: Inode) -> bool {
        let r = self.rank(slot);
        if self.has(slot) {
            self.inodes[r] = inode;
            false
        } else {
            self.inodes.insert(r, inode);
            self.present |= 1u64 << slot;
            true
        }
    }

    fn remove(&mut self, slot: u32) -> Option<Inode> {
        if !self.has(slot) {
            return None;
        }
        let r = self.rank(slot);
        self.present &= !(1u64 << slot);
        Some(self.inodes.remove(r))
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &Inode)> + '_ {
        (0..64u32).filter(|&s| self.has(s)).zip(self.inodes.iter())
    }
}

/// One inode in a checkpoint image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeImage {
    pub slot: u8,
    pub inode: Inode,
    pub xattrs: Vec<(serde_bytes::ByteBuf, serde_bytes::ByteBuf)>,
}

/// One directory entry in a checkpoint image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DentryImage {
    pub cookie: u64,
    pub name: Name,
    pub child: InodeId,
    pub kind: FileKind,
}

/// Data still to be deleted: everything of inode `id`'s generation `generation` at or
/// beyond byte `from` (0 for a removed file). The chunks themselves are listed from the
/// store, so reclaiming costs what exists, not what the largest offset was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reclaim {
    pub id: InodeId,
    pub generation: u64,
    pub from: u64,
}

/// The full contents of one box at one moment: loading it replaces the box.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BoxImage {
    Inodes {
        boxno: u64,
        inodes: Vec<InodeImage>,
    },
    /// Format 1 (64-bit name hashes, boxes of `LEGACY_DENTRY_BOX_SHIFT`): still read, never
    /// written; a table that loads one rehashes it and writes a full checkpoint next.
    DentriesV1 {
        dir: InodeId,
        boxno: u16,
        entries: Vec<DentryImage>,
    },
    /// The table's whole reclaim list.
    Reclaims {
        entries: Vec<Reclaim>,
    },
    /// A directory's entries in one box (63-bit name hashes).
    Dentries {
        dir: InodeId,
        boxno: u16,
        entries: Vec<DentryImage>,
    },
    /// The allocation point of the overflow region this table holds (see
    /// [`crate::Mutation::SetRegionNext`]). Images without one (written before it existed)
    /// leave it to be derived once from the ids present.
    RegionNext {
        next: u64,
    },
    /// Chunks `[from, to)` of file `id` have exactly these refs (ascending by chunk; a chunk
    /// not listed has none). A layout group is written as one or more of these covering
    /// the group's whole range, so loading a later image of the group replaces every
    /// chunk of it, a layout that shrank or went included.
    Layout {
        id: InodeId,
        from: u64,
        to: u64,
        chunks: Vec<(u64, Vec<SliceRef>)>,
    },
}

/// Boxes to write in a checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BoxSet {
    pub inode_boxes: Vec<u64>,
    pub dentry_boxes: Vec<(InodeId, u16)>,
    /// The reclaim list changed (it is written whole).
    pub reclaims: bool,
    /// The region's allocation point moved.
    pub region_next: bool,
    /// Layout groups `(file, group)` (see [`LAYOUT_GROUP_SHIFT`]).
    pub layout_groups: Vec<(InodeId, u64)>,
}

impl BoxSet {
    pub fn len(&self) -> usize {
        self.inode_boxes.len()
            + self.dentry_boxes.len()
            + self.layout_groups.len()
            + usize::from(self.reclaims)
            + usize::from(self.region_next)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The contents of one id range.
#[derive(Debug)]
pub struct Table {
    pub lo: InodeId,
    pub hi: InodeId,
    boxes: BTreeMap<u64, InodeBox>,
    dirs: FxHashMap<InodeId, DirEntries>,
    xattrs: FxHashMap<InodeId, Xattrs>,
    dirty_boxes: FxHashSet<u64>,
    dirty_dentries: FxHashSet<(InodeId, u16)>,
    reclaims: BTreeMap<(InodeId, u64), Reclaim>,
    dirty_reclaims: bool,
    /// The allocation point of the overflow region whose base id this table holds (`None`:
    /// never recorded, as in data written before it was; see `Engine::fill_region_next`).
    region_next: Option<u64>,
    dirty_region_next: bool,
    /// Chunk layouts of regular files, kept beside their inodes (an inode's journal
    /// record carries the whole inode and must stay small).
    layouts: FxHashMap<InodeId, FileLayout>,
    dirty_layouts: FxHashSet<(InodeId, u64)>,
    inodes: u64,
    dentries: u64,
    /// Journal records with a higher LSN are not yet in this table's checkpoint and are
    /// replayed on top of it.
    pub replay_from: u64,
    /// ... and records with a higher LSN than this are not (while replaying a sealed journal
    /// whose end its first reader fixed; `u64::MAX` otherwise).
    pub replay_until: u64,
    /// Directories loaded from format-1 images, until `rehash_legacy` moves them in.
    legacy_dirs: FxHashMap<InodeId, DirEntries>,
    /// The next checkpoint must be a full one (format-1 images are still referenced).
    needs_full: bool,
}

impl Table {
    /// An empty table for `[lo, hi)`.
    pub fn new(lo: InodeId, hi: InodeId) -> Table {
        assert!(lo < hi, "empty table range");
        Table {
            lo,
            hi,
            boxes: BTreeMap::new(),
            dirs: FxHashMap::default(),
            xattrs: FxHashMap::default(),
            dirty_boxes: FxHashSet::default(),
            dirty_dentries: FxHashSet::default(),
            reclaims: BTreeMap::new(),
            dirty_reclaims: false,
            region_next: None,
            dirty_region_next: false,
            layouts: FxHashMap::default(),
            dirty_layouts: FxHashSet::default(),
            inodes: 0,
            dentries: 0,
            replay_from: 0,
            replay_until: u64::MAX,
            legacy_dirs: FxHashMap::default(),
            needs_full: false,
        }
    }

    /// Moves the directories of format-1 images in, each entry at the cookie of its name's
    /// new hash, and asks for a full checkpoint (which replaces every old image). Returns
    /// how many entries moved.
    pub fn rehash_legacy(&mut self, hash: impl Fn(&[u8]) -> u64) -> Result<u64, TableError> {
        let mut moved = 0;
        for (dir, old) in std::mem::take(&mut self.legacy_dirs) {
            let e = self.dirs.entry(dir).or_default();
            for (_, d) in old.iter() {
                let h = hash(d.name.as_bytes());
                if e.insert(h, d.clone())
                    .map_err(|_| TableError::BucketOverflow { dir })?
                {
                    self.dentries += 1;
                }
                self.dirty_dentries.insert((dir, crate::dir::box_of(h)));
                moved += 1;
            }
            self.needs_full = true;
        }
        Ok(moved)
    }

    /// True once if the next checkpoint must be full.
    pub fn take_needs_full(&mut self) -> bool {
        std::mem::take(&mut self.needs_full)
    }

    /// Asks for a full checkpoint again (the one that took the request failed).
    pub fn set_needs_full(&mut self) {
        self.needs_full = true;
    }

    pub fn contains(&self, id: InodeId) -> bool {
        self.lo <= id && id < self.hi
    }

    pub fn inode_count(&self) -> u64 {
        self.inodes
    }

    pub fn dentry_count(&self) -> u64 {
        self.dentries
    }

    pub fn inode(&self, id: InodeId) -> Option<&Inode> {
        self.boxes
            .get(&(id >> BOX_SHIFT))?
            .get((id & BOX_MASK) as u32)
    }

    /// Inodes per box, in id order: `(box number, inodes)`.
    pub fn box_counts(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.boxes
            .iter()
            .map(|(&b, x)| (b, u64::from(x.present.count_ones())))
    }

    /// The highest inode id present, if any.
    pub fn max_id(&self) -> Option<InodeId> {
        let (&boxno, b) = self.boxes.iter().next_back()?;
        let top = 63 - b.present.leading_zeros() as u64;
        Some((boxno << BOX_SHIFT) | top)
    }

    /// The highest inode id present below `end`, if any.
    pub fn max_id_below(&self, end: InodeId) -> Option<InodeId> {
        let last_box = end.checked_sub(1)? >> BOX_SHIFT;
        for (&boxno, b) in self.boxes.range(..=last_box).rev() {
            let mut present = b.present;
            if boxno == last_box {
                let keep = ((end - 1) & BOX_MASK) + 1;
                if keep < 64 {
                    present &= (1u64 << keep) - 1;
                }
            }
            if present != 0 {
                return Some((boxno << BOX_SHIFT) | (63 - present.leading_zeros() as u64));
            }
        }
        None
    }

    pub fn put_inode(&mut self, id: InodeId, inode: Inode) {
        debug_assert!(self.contains(id));
        let boxno = id >> BOX_SHIFT;
        if self
            .boxes
            .entry(boxno)
            .or_default()
            .put((id & BOX_MASK) as u32, inode)
        {
            self.inodes += 1;
        }
        self.dirty_boxes.insert(boxno);
    }

    /// Removes an inode with its extended attributes, layout and (empty) entry map.
    pub fn drop_inode(&mut self, id: InodeId) {
        self.drop_chunks(id, 0);
        let boxno = id >> BOX_SHIFT;
        if let Some(b) = self.boxes.get_mut(&boxno) {
            if b.remove((id & BOX_MASK) as u32).is_some() {
                self.inodes -= 1;
            }
            if b.present == 0 {
                self.boxes.remove(&boxno);
            }
        }
        self.xattrs.remove(&id);
        if let Some(e) = self.dirs.remove(&id) {
            self.dentries -= e.len();
        }
        self.dirty_boxes.insert(boxno);
    }

    /// Splits the table at `at` (a box boundary strictly inside the range): this table keeps
    /// `[lo, at)` and the returned one holds `[at, hi)`, each with its inodes, entries
    /// (they live with their parent's id), xattrs, reclaims and dirty state. Both need a
    /// full checkpoint next: their old images hold both halves.
    pub fn split_off(&mut self, at: InodeId) -> Result<Table, TableError> {
        if at <= self.lo || at >= self.hi || at & BOX_MASK != 0 {
            return Err(TableError::NotABoxBoundary {
                lo: self.lo,
                hi: self.hi,
                at,
            });
        }
        let mut upper = Table::new(at, self.hi);
        self.hi = at;
        let at_box = at >> BOX_SHIFT;
        upper.boxes = self.boxes.split_off(&at_box);
        fn part<K: Copy + Eq + std::hash::Hash, V>(
            from: &mut FxHashMap<K, V>,
            upper: impl Fn(K) -> bool,
        ) -> FxHashMap<K, V> {
            let keys: Vec<K> = from.keys().copied().filter(|&k| upper(k)).collect();
            keys.into_iter()
                .filter_map(|k| from.remove(&k).map(|v| (k, v)))
                .collect()
        }
        upper.dirs = part(&mut self.dirs, |d| d >= at);
        upper.xattrs = part(&mut self.xattrs, |id| id >= at);
        upper.legacy_dirs = part(&mut self.legacy_dirs, |d| d >= at);
        upper.dirty_boxes = self
            .dirty_boxes
            .iter()
            .copied()
            .filter(|&b| b >= at_box)
            .collect();
        self.dirty_boxes.retain(|&b| b < at_box);
        upper.dirty_dentries = self
            .dirty_dentries
            .iter()
            .copied()
            .filter(|&(d, _)| d >= at)
            .collect();
        self.dirty_dentries.retain(|&(d, _)| d < at);
        upper.layouts = part(&mut self.layouts, |id| id >= at);
        upper.dirty_layouts = self
            .dirty_layouts
            .iter()
            .copied()
            .filter(|&(id, _)| id >= at)
            .collect();
        self.dirty_layouts.retain(|&(id, _)| id < at);
        upper.reclaims = self.reclaims.split_off(&(at, 0));
        upper.dirty_reclaims = self.dirty_reclaims;
        for t in [&mut *self, &mut upper] {
            t.inodes = t
                .boxes
                .values()
                .map(|b| b.present.count_ones() as u64)
                .sum();
            t.dentries = t.dirs.values().map(|e| e.len()).sum();
            t.needs_full = true;
        }
        upper.replay_from = self.replay_from;
        upper.replay_until = self.replay_until;
        Ok(upper)
    }

    /// The entries of directory `dir` (which must live in this table), if it has any.
    pub fn entries(&self, dir: InodeId) -> Option<&DirEntries> {
        self.dirs.get(&dir)
    }

    /// Inserts or replaces an entry; false if its hash bucket is full.
    pub fn put_dentry(&mut self, dir: InodeId, hash: u64, d: Dentry) -> bool {
        let entries = self.dirs.entry(dir).or_default();
        match entries.insert(hash, d) {
            Ok(new) => {
                if new {
                    self.dentries += 1;
                }
                self.dirty_dentries.insert((dir, crate::dir::box_of(hash)));
                true
            }
            Err(_) => false,
        }
    }

    pub fn drop_dentry(&mut self, dir: InodeId, hash: u64, name: &[u8]) {
        let Some(entries) = self.dirs.get_mut(&dir) else {
            return;
        };
        if entries.remove(hash, name).is_some() {
            self.dentries -= 1;
            self.dirty_dentries.insert((dir, crate::dir::box_of(hash)));
        }
        if entries.is_empty() {
            self.dirs.remove(&dir);
        }
    }

    pub fn xattrs(&self, id: InodeId) -> Option<&Xattrs> {
        self.xattrs.get(&id)
    }

    pub fn set_xattr(&mut self, id: InodeId, name: &[u8], value: &[u8]) {
        self.xattrs
            .entry(id)
            .or_default()
            .insert(name.to_vec(), value.to_vec());
        self.dirty_boxes.insert(id >> BOX_SHIFT);
    }

    pub fn drop_xattr(&mut self, id: InodeId, name: &[u8]) {
        if let Some(x) = self.xattrs.get_mut(&id) {
            x.remove(name);
            if x.is_empty() {
                self.xattrs.remove(&id);
            }
        }
        self.dirty_boxes.insert(id >> BOX_SHIFT);
    }

    /// The layout of file `id`, if it has any refs.
    pub fn layout(&self, id: InodeId) -> Option<&FileLayout> {
        self.layouts.get(&id)
    }

    /// The refs of chunk `chunk` of file `id` (none if it has none).
    pub fn chunk_refs(&self, id: InodeId, chunk: u64) -> &[SliceRef] {
        self.layouts
            .get(&id)
            .and_then(|l| l.get(&chunk))
            .map_or(&[], |r| r.as_slice())
    }

    /// Sets chunk `chunk` of file `id` to `refs` (none: the chunk has no refs).
    pub fn put_chunk(&mut self, id: InodeId, chunk: u64, refs: Vec<SliceRef>) {
        self.dirty_layouts.insert((id, layout_group(chunk)));
        if refs.is_empty() {
            if let Some(l) = self.layouts.get_mut(&id) {
                l.remove(&chunk);
                if l.is_empty() {
                    self.layouts.remove(&id);
                }
            }
        } else {
            self.layouts.entry(id).or_default().insert(chunk, refs);
        }
    }

    /// Drops the refs of every chunk at or past `from` of file `id`.
    pub fn drop_chunks(&mut self, id: InodeId, from: u64) {
        let Some(l) = self.layouts.get_mut(&id) else {
            return;
        };
        let gone = l.split_off(&from);
        let empty = l.is_empty();
        for &chunk in gone.keys() {
            self.dirty_layouts.insert((id, layout_group(chunk)));
        }
        if empty {
            self.layouts.remove(&id);
        }
    }

    /// Every file with a layout, and its layout (for invariant checks and tests).
    pub fn iter_layouts(&self) -> impl Iterator<Item = (InodeId, &FileLayout)> + '_ {
        self.layouts.iter().map(|(&id, l)| (id, l))
    }

    /// Adds or widens a reclaim entry (a lower `from` wins: more data goes).
    pub fn put_reclaim(&mut self, r: Reclaim) {
        let e = self.reclaims.entry((r.id, r.generation)).or_insert(r);
        e.from = e.from.min(r.from);
        self.dirty_reclaims = true;
    }

    pub fn drop_reclaim(&mut self, id: InodeId, generation: u64) {
        if self.reclaims.remove(&(id, generation)).is_some() {
            self.dirty_reclaims = true;
        }
    }

    /// The recorded allocation point of the overflow region this table holds, if any.
    pub fn region_next(&self) -> Option<u64> {
        self.region_next
    }

    /// Raises the recorded allocation point to `next` (a high-water mark never falls).
    pub fn raise_region_next(&mut self, next: u64) {
        if self.region_next.is_none_or(|n| n < next) {
            self.region_next = Some(next);
            self.dirty_region_next = true;
        }
    }

    /// Data waiting to be deleted.
    pub fn reclaims(&self) -> impl Iterator<Item = &Reclaim> + '_ {
        self.reclaims.values()
    }

    /// Number of reclaim entries.
    pub fn reclaim_count(&self) -> usize {
        self.reclaims.len()
    }

    /// Reclaim entries after `(id, generation)` in key order.
    pub fn reclaims_after(&self, after: (InodeId, u64)) -> impl Iterator<Item = &Reclaim> + '_ {
        use std::ops::Bound::{Excluded, Unbounded};
        self.reclaims
            .range((Excluded(after), Unbounded))
            .map(|(_, r)| r)
    }

    /// The reclaim entry of one file generation, if any.
    pub fn reclaim(&self, id: InodeId, generation: u64) -> Option<&Reclaim> {
        self.reclaims.get(&(id, generation))
    }

    /// Boxes changed since the last call; the table starts tracking afresh.
    pub fn take_dirty(&mut self) -> BoxSet {
        let mut set = BoxSet {
            inode_boxes: self.dirty_boxes.drain().collect(),
            dentry_boxes: self.dirty_dentries.drain().collect(),
            reclaims: std::mem::take(&mut self.dirty_reclaims),
            region_next: std::mem::take(&mut self.dirty_region_next),
            layout_groups: self.dirty_layouts.drain().collect(),
        };
        set.inode_boxes.sort_unstable();
        set.dentry_boxes.sort_unstable();
        set.layout_groups.sort_unstable();
        set
    }

    /// Tracks boxes as changed again (a checkpoint that took them failed).
    pub fn mark_dirty(&mut self, set: &BoxSet) {
        self.dirty_boxes.extend(set.inode_boxes.iter().copied());
        self.dirty_dentries.extend(set.dentry_boxes.iter().copied());
        self.dirty_reclaims |= set.reclaims;
        self.dirty_region_next |= set.region_next;
        self.dirty_layouts.extend(set.layout_groups.iter().copied());
    }

    /// Number of boxes changed since the last checkpoint.
    pub fn dirty_len(&self) -> usize {
        self.dirty_boxes.len() + self.dirty_dentries.len() + self.dirty_layouts.len()
    }

    /// Every box that holds something: the contents of a full checkpoint.
    pub fn all_boxes(&self) -> BoxSet {
        let mut dentry_boxes: Vec<(InodeId, u16)> = Vec::new();
        for (&dir, e) in &self.dirs {
            dentry_boxes.extend(e.boxes().into_iter().map(|b| (dir, b)));
        }
        dentry_boxes.sort_unstable();
        let mut layout_groups: Vec<(InodeId, u64)> = Vec::new();
        for (&id, l) in &self.layouts {
            let mut last = None;
            for &chunk in l.keys() {
                let g = layout_group(chunk);
                if last != Some(g) {
                    layout_groups.push((id, g));
                    last = Some(g);
                }
            }
        }
        layout_groups.sort_unstable();
        BoxSet {
            inode_boxes: self.boxes.keys().copied().collect(),
            dentry_boxes,
            reclaims: true,
            region_next: self.region_next.is_some(),
            layout_groups,
        }
    }

    /// The current contents of inode box `boxno` (empty if nothing is there any more).
    pub fn image_inode_box(&self, boxno: u64) -> BoxImage {
        let mut inodes = Vec::new();
        if let Some(b) = self.boxes.get(&boxno) {
            for (slot, inode) in b.iter() {
                let id = (boxno << BOX_SHIFT) | slot as u64;
                let xattrs = self
                    .xattrs
                    .get(&id)
                    .map(|x| {
                        x.iter()
                            .map(|(k, v)| {
                                (
                                    serde_bytes::ByteBuf::from(k.clone()),
                                    serde_bytes::ByteBuf::from(v.clone()),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                inodes.push(InodeImage {
                    slot: slot as u8,
                    inode: inode.clone(),
                    xattrs,
                });
            }
        }
        BoxImage::Inodes { boxno, inodes }
    }

    /// The current contents of dentry box `boxno` of directory `dir`.
    pub fn image_dentry_box(&self, dir: InodeId, boxno: u16) -> BoxImage {
        let entries = self
            .dirs
            .get(&dir)
            .map(|e| {
                e.iter_box(boxno)
                    .map(|(cookie, d)| DentryImage {
                        cookie,
                        name: d.name.clone(),
                        child: d.child,
                        kind: d.kind,
                    })
                    .collect()
            })
            .unwrap_or_default();
        BoxImage::Dentries {
            dir,
            boxno,
            entries,
        }
    }

    /// The whole reclaim list as an image.
    pub fn image_reclaims(&self) -> BoxImage {
        BoxImage::Reclaims {
            entries: self.reclaims.values().copied().collect(),
        }
    }

    /// The region's allocation point as an image (0: none recorded, which loads as none).
    pub fn image_region_next(&self) -> BoxImage {
        BoxImage::RegionNext {
            next: self.region_next.unwrap_or(0),
        }
    }

    /// The current layout of group `group` of file `id` as images: records of whole chunks,
    /// each of about [`LAYOUT_RECORD_BYTES`] at most, that together cover the group's whole
    /// chunk range (one empty record if the group has no refs any more).
    pub fn image_layout_group(&self, id: InodeId, group: u64) -> Vec<BoxImage> {
        let range = layout_group_chunks(group);
        let mut out = Vec::new();
        let mut from = range.start;
        let mut chunks = Vec::new();
        let mut bytes = 0;
        if let Some(l) = self.layouts.get(&id) {
            for (&chunk, refs) in l.range(range.clone()) {
                let cost = LAYOUT_CHUNK_IMAGE_BYTES + refs.len() * LAYOUT_REF_IMAGE_BYTES;
                if !chunks.is_empty() && bytes + cost > LAYOUT_RECORD_BYTES {
                    out.push(BoxImage::Layout {
                        id,
                        from,
                        to: chunk,
                        chunks: std::mem::take(&mut chunks),
                    });
                    from = chunk;
                    bytes = 0;
                }
                bytes += cost;
                chunks.push((chunk, refs.clone()));
            }
        }
        out.push(BoxImage::Layout {
            id,
            from,
            to: range.end,
            chunks,
        });
        out
    }

    /// Replaces a box with its image (checkpoint load). Images of later checkpoints
    /// override earlier ones box by box. Rejects images that do not belong here.
    pub fn load_image(&mut self, img: BoxImage) -> Result<(), ImageError> {
        match img {
            BoxImage::Layout {
                id,
                from,
                to,
                chunks,
            } => {
                if !self.contains(id) {
                    return Err(ImageError(format!(
                        "layout of {id:#x} outside table {:#x}..{:#x}",
                        self.lo, self.hi
                    )));
                }
                if from > to {
                    return Err(ImageError(format!(
                        "layout of {id:#x}: empty range {from}..{to}"
                    )));
                }
                let mut prev = None;
                for (chunk, refs) in &chunks {
                    if !(from..to).contains(chunk) || prev.is_some_and(|p| p >= *chunk) {
                        return Err(ImageError(format!(
                            "layout of {id:#x}: chunk {chunk} out of order or outside {from}..{to}"
                        )));
                    }
                    if *chunk >= CHUNK_COUNT_MAX || refs.iter().any(|r| !r.is_valid()) {
                        return Err(ImageError(format!(
                            "layout of {id:#x}: chunk {chunk} past the largest file or with an invalid ref"
                        )));
                    }
                    prev = Some(*chunk);
                }
                let l = self.layouts.entry(id).or_default();
                let mut tail = l.split_off(&from);
                let mut after = tail.split_off(&to);
                l.append(&mut after);
                l.extend(chunks.into_iter().filter(|(_, r)| !r.is_empty()));
                if l.is_empty() {
                    self.layouts.remove(&id);
                }
            }
            BoxImage::RegionNext { next } => {
                if next != 0 {
                    self.raise_region_next(next);
                }
            }
            BoxImage::Reclaims { entries } => {
                self.reclaims.clear();
                for r in entries {
                    if !self.contains(r.id) {
                        return Err(ImageError(format!(
                            "reclaim of {:#x} outside table {:#x}..{:#x}",
                            r.id, self.lo, self.hi
                        )));
                    }
                    self.reclaims.insert((r.id, r.generation), r);
                }
            }
            BoxImage::Inodes { boxno, inodes } => {
                let lo = boxno
                    .checked_shl(BOX_SHIFT)
                    .ok_or_else(|| ImageError("inode box number out of range".into()))?;
                if !self.contains(lo) {
                    return Err(ImageError(format!(
                        "inode box {boxno:#x} outside table {:#x}..{:#x}",
                        self.lo, self.hi
                    )));
                }
                if let Some(old) = self.boxes.remove(&boxno) {
                    self.inodes -= old.inodes.len() as u64;
                }
                for slot in 0..64u64 {
                    self.xattrs.remove(&(lo | slot));
                }
                let mut b = InodeBox::default();
                for img in inodes {
                    if img.slot >= 64 {
                        return Err(ImageError(format!("inode slot {} out of range", img.slot)));
                    }
                    let id = lo | img.slot as u64;
                    if FileKind::from_mode(img.inode.mode).is_none() {
                        return Err(ImageError(format!(
                            "inode {id:#x} has mode {:o}, no file type",
                            img.inode.mode
                        )));
                    }
                    if !img.xattrs.is_empty() {
                        let x = self.xattrs.entry(id).or_default();
                        for (k, v) in img.xattrs {
                            x.insert(k.into_vec(), v.into_vec());
                        }
                    }
                    if b.put(img.slot as u32, img.inode) {
                        self.inodes += 1;
                    }
                }
                if b.present != 0 {
                    self.boxes.insert(boxno, b);
                }
            }
            BoxImage::DentriesV1 {
                dir,
                boxno,
                entries,
            } => {
                if !self.contains(dir) {
                    return Err(ImageError(format!(
                        "entries of {dir:#x} outside table {:#x}..{:#x}",
                        self.lo, self.hi
                    )));
                }
                let e = self.legacy_dirs.entry(dir).or_default();
                e.clear_legacy_box(boxno);
                for img in entries {
                    if (img.cookie >> crate::dir::LEGACY_DENTRY_BOX_SHIFT) as u16 != boxno {
                        return Err(ImageError(format!(
                            "entry cookie {:#x} outside box {boxno}",
                            img.cookie
                        )));
                    }
                    e.insert_at(
                        img.cookie,
                        Dentry {
                            name: img.name,
                            child: img.child,
                            kind: img.kind,
                        },
                    );
                }
                if e.is_empty() {
                    self.legacy_dirs.remove(&dir);
                }
            }
            BoxImage::Dentries {
                dir,
                boxno,
                entries,
            } => {
                if !self.contains(dir) {
                    return Err(ImageError(format!(
                        "entries of {dir:#x} outside table {:#x}..{:#x}",
                        self.lo, self.hi
                    )));
                }
                let e = self.dirs.entry(dir).or_default();
                let before = e.len();
                e.clear_box(boxno);
                for img in entries {
                    if (img.cookie >> crate::dir::DENTRY_BOX_SHIFT) as u16 != boxno {
                        return Err(ImageError(format!(
                            "entry cookie {:#x} outside box {boxno}",
                            img.cookie
                        )));
                    }
                    e.insert_at(
                        img.cookie,
                        Dentry {
                            name: img.name,
                            child: img.child,
                            kind: img.kind,
                        },
                    );
                }
                let after = e.len();
                self.dentries = self.dentries + after - before;
                if after == 0 {
                    self.dirs.remove(&dir);
                }
            }
        }
        Ok(())
    }

    /// Every inode, in id order (for invariant checks and tests).
    pub fn iter_inodes(&self) -> impl Iterator<Item = (InodeId, &Inode)> + '_ {
        self.boxes.iter().flat_map(|(&boxno, b)| {
            b.iter()
                .map(move |(s, i)| ((boxno << BOX_SHIFT) | s as u64, i))
        })
    }

    /// Every directory with entries, and its entries.
    pub fn iter_dirs(&self) -> impl Iterator<Item = (InodeId, &DirEntries)> + '_ {
        self.dirs.iter().map(|(&d, e)| (d, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_store_sparse_slots() {
        let mut t = Table::new(0, 1 << 20);
        for id in [5u64, 3, 64, 63, 130] {
            t.put_inode(id, Inode::new(0o100644, 0, 0, id as i64));
        }
        assert_eq!(t.inode_count(), 5);
        assert_eq!(t.inode(63).unwrap().btime, 63);
        assert!(t.inode(4).is_none());
        assert_eq!(t.max_id(), Some(130));
        assert_eq!(t.max_id_below(130), Some(64));
        assert_eq!(t.max_id_below(64), Some(63));
        t.drop_inode(130);
        assert_eq!(t.max_id(), Some(64));
        let ids: Vec<u64> = t.iter_inodes().map(|(i, _)| i).collect();
        assert_eq!(ids, vec![3, 5, 63, 64]);
    }

    #[test]
    fn a_region_allocation_point_is_checkpointed_and_never_falls() {
        let mut t = Table::new(0, 1 << 20);
        assert!(t.take_dirty().is_empty());
        assert!(
            !t.all_boxes().region_next,
            "nothing recorded, nothing to write"
        );
        t.raise_region_next(7);
        t.raise_region_next(5);
        assert_eq!(t.region_next(), Some(7));
        let set = t.take_dirty();
        assert!(set.region_next && set.len() == 1);
        let mut loaded = Table::new(0, 1 << 20);
        loaded.load_image(t.image_region_next()).unwrap();
        assert_eq!(loaded.region_next(), Some(7));
        // An older image loaded after a newer one (or a replayed older record) leaves it.
        loaded.load_image(BoxImage::RegionNext { next: 3 }).unwrap();
        assert_eq!(loaded.region_next(), Some(7));
        let mut none = Table::new(0, 1 << 20);
        none.load_image(Table::new(0, 1 << 20).image_region_next())
            .unwrap();
        assert_eq!(none.region_next(), None);
    }

    #[test]
    fn images_round_trip_and_replace() {
        let mut t = Table::new(0, 1 << 20);
        t.put_inode(7, Inode::new(0o100644, 1, 1, 7));
        t.set_xattr(7, b"user.a", b"1");
        t.put_dentry(
            2,
            0xabcd_0000,
            Dentry {
                name: Name::new(b"x"),
                child: 7,
                kind: FileKind::File,
            },
        );
        let set = t.take_dirty();
        assert_eq!(set.inode_boxes, vec![0]);
        let imgs: Vec<BoxImage> = set
            .inode_boxes
            .iter()
            .map(|&b| t.image_inode_box(b))
            .chain(
                set.dentry_boxes
                    .iter()
                    .map(|&(d, b)| t.image_dentry_box(d, b)),
            )
            .collect();
        let mut u = Table::new(0, 1 << 20);
        u.put_inode(9, Inode::new(0o100644, 1, 1, 9)); // replaced by the image of box 0
        for img in imgs {
            let bytes = postcard::to_allocvec(&img).unwrap();
            u.load_image(postcard::from_bytes(&bytes).unwrap()).unwrap();
        }
        assert!(u.inode(9).is_none());
        assert_eq!(u.inode(7), t.inode(7));
        assert_eq!(u.xattrs(7), t.xattrs(7));
        assert_eq!(u.dentry_count(), 1);
        assert_eq!(u.inode_count(), 1);
        assert!(
            u.load_image(BoxImage::Inodes {
                boxno: 1 << 40,
                inodes: vec![]
            })
            .is_err()
        );
    }

    fn refs(chunk: u64, n: u64) -> Vec<SliceRef> {
        (0..n)
            .map(|k| SliceRef {
                object: chunk * 8 + k + 1,
                pos: (k * 1000) as u32,
                len: 100_000,
            })
            .collect()
    }

    /// Loads the images of `set` from `t` into `into`, through their encoding.
    fn load_set(t: &Table, set: &BoxSet, into: &mut Table) -> usize {
        let mut records = 0;
        for &(id, g) in &set.layout_groups {
            for img in t.image_layout_group(id, g) {
                let bytes = postcard::to_allocvec(&img).unwrap();
                assert!(bytes.len() <= 2 * LAYOUT_RECORD_BYTES, "{}", bytes.len());
                into.load_image(postcard::from_bytes(&bytes).unwrap())
                    .unwrap();
                records += 1;
            }
        }
        records
    }

    fn layouts(t: &Table) -> Vec<(InodeId, FileLayout)> {
        let mut v: Vec<_> = t.iter_layouts().map(|(id, l)| (id, l.clone())).collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// A 1 TiB file (262,144 chunks of 3 refs) checkpoints in records of bounded size and
    /// loads back; later images of a layout that shrank or went replace the earlier ones.
    #[test]
    fn layouts_checkpoint_in_parts_and_later_images_replace_earlier_ones() {
        let mut t = Table::new(0, 1 << 20);
        let (big, small, gone) = (7, 8, 9);
        let chunks = (1u64 << 40) / CHUNK_BYTES;
        for c in 0..chunks {
            t.put_chunk(big, c, refs(c, 3));
        }
        t.put_chunk(small, 3, refs(3, 2));
        t.put_chunk(small, 5000, refs(5000, 1));
        t.put_chunk(gone, 0, refs(0, 1));
        // One group of many refs: more than one record's worth.
        let dense = 10;
        for c in 0..1 << LAYOUT_GROUP_SHIFT {
            t.put_chunk(dense, c, refs(c, 64));
        }
        let full = t.all_boxes();
        assert_eq!(t.take_dirty().layout_groups, full.layout_groups);
        assert_eq!(full.layout_groups.len(), 256 + 2 + 1 + 1);
        let mut u = Table::new(0, 1 << 20);
        let records = load_set(&t, &full, &mut u);
        assert!(records > full.layout_groups.len(), "a dense group is cut");
        assert_eq!(layouts(&u), layouts(&t));
        // The big file shrinks to 10 chunks and a half, another file loses a chunk, and
        // the third goes with its inode: the delta replaces each of them.
        t.drop_chunks(big, 11);
        t.put_chunk(big, 10, refs(10, 1));
        t.put_chunk(small, 5000, vec![]);
        t.put_inode(gone, Inode::new(0o100644, 0, 0, 1));
        t.drop_inode(gone);
        let delta = t.take_dirty();
        assert_eq!(delta.layout_groups.len(), 256 + 1 + 1);
        load_set(&t, &delta, &mut u);
        assert_eq!(layouts(&u), layouts(&t));
        assert_eq!(u.layout(big).unwrap().len(), 11);
        assert!(u.layout(gone).is_none());
        assert!(t.take_dirty().is_empty());
        // A record outside its range, or of another table, is refused.
        let bad = BoxImage::Layout {
            id: big,
            from: 0,
            to: 4,
            chunks: vec![(4, refs(4, 1))],
        };
        assert!(u.load_image(bad).is_err());
        let foreign = BoxImage::Layout {
            id: 1 << 30,
            from: 0,
            to: 4,
            chunks: vec![],
        };
        assert!(u.load_image(foreign).is_err());
    }

    #[test]
    fn a_split_moves_layouts_and_their_dirty_marks_with_their_ids() {
        let mut t = Table::new(0, 1 << 20);
        t.put_chunk(5, 0, refs(0, 1));
        t.put_chunk(700, 2000, refs(2000, 2));
        let mut upper = t.split_off(640).unwrap();
        assert_eq!(t.chunk_refs(5, 0), refs(0, 1).as_slice());
        assert!(t.layout(700).is_none());
        assert_eq!(upper.chunk_refs(700, 2000), refs(2000, 2).as_slice());
        assert_eq!(t.take_dirty().layout_groups, vec![(5, 0)]);
        assert_eq!(upper.take_dirty().layout_groups, vec![(700, 1)]);
        assert_eq!(upper.all_boxes().layout_groups, vec![(700, 1)]);
    }

    /// Format-1 images (64-bit hashes, so cookies up to 2^64) still load: their entries
    /// move to their names' new 63-bit hashes, and the table asks for a full checkpoint.
    #[test]
    fn format_1_dentry_images_are_rehashed() {
        let mut t = Table::new(0, 1 << 20);
        let old_cookie = 0xfedc_ba98_7654_3210 & !0xf;
        let legacy = BoxImage::DentriesV1 {
            dir: 2,
            boxno: (old_cookie >> crate::dir::LEGACY_DENTRY_BOX_SHIFT) as u16,
            entries: vec![DentryImage {
                cookie: old_cookie,
                name: Name::new(b"old"),
                child: 7,
                kind: FileKind::File,
            }],
        };
        // The postcard encoding of format 1 is unchanged (same variant index).
        let bytes = postcard::to_allocvec(&legacy).unwrap();
        assert_eq!(bytes[0], 1);
        t.load_image(postcard::from_bytes(&bytes).unwrap()).unwrap();
        let hash = |name: &[u8]| name.len() as u64 * 0x1000_0000_0000;
        assert_eq!(t.rehash_legacy(hash).unwrap(), 1);
        let (cookie, d) = t.iter_dirs().next().unwrap().1.iter().next().unwrap();
        assert_eq!((cookie, d.child), (hash(b"old"), 7));
        assert!(cookie < crate::dir::HASH_LIMIT);
        assert!(t.take_needs_full());
        assert!(!t.take_needs_full());
    }
}
