//! Per-table incremental checkpoints, taken while operations continue.
//!
//! A checkpoint of table T notes the last LSN `L`, takes T's dirty-box set, then copies
//! those boxes a few hundred at a time (the lock is held only per group) into an image
//! object of CRC-framed box images. Boxes copied later may already hold effects of records
//! after `L`; that is fine because records are post-images and replay from `L` is
//! idempotent. Before the manifest makes an image count, the journal must be durable up to
//! the last LSN whose effects the image could hold, so that an image never contains half
//! of an operation the journal lost. The manifest (replaced atomically) lists a base image
//! and deltas; when the deltas outgrow the base, the next checkpoint is a full one.
//!
//!
//! The store layout the checkpoints write (manifests and images) is in `manifest`.

use crate::replycache::HandedOver;
use crate::shared::Shared;
use crate::tablepass::{TableChange, TableDone};
use kochab_journal::JournalId;
use kochab_journal::record::encode_record_with;
use kochab_meta::{BoxImage, BoxSet, Table};
use kochab_store::ObjectStore;
use std::io;
use std::time::Instant;

pub use crate::manifest::*;
use crate::manifest::{image_name, image_objects, table_dir};

/// Boxes copied per lock acquisition: short enough that operations barely notice.
const BOXES_PER_LOCK: usize = 256;
/// Image bytes buffered before they are written out.
const IMAGE_FLUSH_BYTES: usize = 4 << 20;

/// Where the bytes of an image go: streamed into one object in place (a store with
/// positioned I/O), or, on a store of whole objects, cut into parts of about
/// `IMAGE_FLUSH_BYTES` (whole box records each), each one PUT (see `ImageRef::parts`).
enum ImageOut {
    InPlace(std::sync::Arc<dyn kochab_store::Object>),
    Parts {
        store: std::sync::Arc<dyn ObjectStore>,
        first: String,
        parts: u32,
    },
}

impl ImageOut {
    fn open(store: std::sync::Arc<dyn ObjectStore>, name: String) -> io::Result<ImageOut> {
        if !store.positioned_io() {
            return Ok(ImageOut::Parts {
                store,
                first: name,
                parts: 0,
            });
        }
        let obj = store.open(&name, true)?;
        obj.set_len(0)?;
        Ok(ImageOut::InPlace(obj))
    }

    /// Writes `buf` (whole box records) at `offset`, the bytes written so far.
    fn write(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        match self {
            ImageOut::InPlace(obj) => obj.write_at(buf, offset),
            // An empty last piece needs no object, unless it is the only one.
            ImageOut::Parts { parts, .. } if buf.is_empty() && *parts > 0 => Ok(()),
            ImageOut::Parts {
                store,
                first,
                parts,
            } => {
                let name = match *parts {
                    0 => first.clone(),
                    k => format!("{first}.{k:05}"),
                };
                store.put(&name, buf)?;
                *parts += 1;
                Ok(())
            }
        }
    }

    /// Makes the image durable; returns its `ImageRef::parts`.
    fn finish(self) -> io::Result<u32> {
        match self {
            ImageOut::InPlace(obj) => obj.sync_data().map(|()| 0),
            // Each PUT was durable when it returned.
            ImageOut::Parts { parts, .. } => Ok(parts),
        }
    }
}

/// Why a table was not split (nothing changed).
#[derive(Debug, thiserror::Error)]
pub enum SplitRefused {
    #[error("table {0:016x} has no manifest here")]
    NoManifest(u64),
    #[error(transparent)]
    Table(#[from] kochab_meta::TableError),
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy)]
pub struct RoundReport {
    pub tables: usize,
    pub boxes: usize,
    pub bytes: u64,
    pub trimmed_segments: u64,
    pub journals_deleted: usize,
}

/// Where a checkpoint reads a table from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The engine's table of this id, a group of boxes per hold of the core lock.
    Engine(u64),
    /// A table already taken out of the engine (a drop).
    Detached(&'a Table),
}

impl Checkpointer {
    /// The manifest of a hosted table.
    pub fn manifest(&self, lo: u64) -> Option<&Manifest> {
        self.manifests.get(&lo)
    }

    /// The LSN of this server's journal after which a restart would have to replay: the
    /// oldest hosted table's replay point in it.
    pub fn replay_from(&self) -> u64 {
        self.manifests
            .values()
            .filter_map(|m| m.position_in(self.me).map(|p| p.after))
            .min()
            .unwrap_or(0)
    }

    /// True if some table still needs an older journal than this server's (after a
    /// restart or a failover): the next round collapses it.
    pub fn needs_older_journals(&self) -> bool {
        self.manifests
            .values()
            .any(|m| m.journals.iter().any(|p| p.id() != self.me))
    }

    /// Checkpoints every table that changed, advances clean tables' replay points, then
    /// trims the journal below what every table still needs and deletes sealed journals
    /// that no table in the store needs any more.
    pub fn round(&mut self, shared: &Shared) -> io::Result<RoundReport> {
        let mut report = RoundReport::default();
        let replies_lsn = self.save_replies(shared)?;
        let ids: Vec<u64> = self.manifests.keys().copied().collect();
        for lo in ids {
            let (b, bytes) = self.checkpoint_table(shared, lo)?;
            if b > 0 {
                report.tables += 1;
                report.boxes += b;
                report.bytes += bytes;
            }
        }
        // The records after the reply cache's snapshot stay too: their entries are in no
        // image.
        let keep_from = self.replay_from().min(replies_lsn) + 1;
        // txn (issue 33): open transaction records stay (recovery reads them).
        let keep_from = match shared.txn_host() {
            Some(t) => keep_from.min(t.keep_from()),
            None => keep_from,
        };
        report.trimmed_segments = shared.journal().trim(keep_from)?;
        // txn (issue 33): a server's newest journal may hold commit decisions that its
        // next incarnation reads when it starts: kept until one has started.
        let keep_newest = shared.txn_host().is_some();
        report.journals_deleted = self.collect_journals(shared.store().as_ref(), keep_newest)?;
        Ok(report)
    }

    /// Saves the reply cache as of the journal's last record, once that is durable (an
    /// entry must never outlive a lost record: a replay it answered would be skipped),
    /// before this round moves any replay point past records whose entries it holds (see
    /// [`crate::manifest::write_replies`]). Returns the LSN it covers.
    fn save_replies(&self, shared: &Shared) -> io::Result<u64> {
        let (replies, lsn) = {
            let core = shared.core();
            (core.replies.export(usize::MAX), core.last_lsn())
        };
        if !shared.journal().wait_durable(lsn) {
            return Err(io::Error::other("journal failed; checkpoint abandoned"));
        }
        crate::manifest::write_replies(shared.store().as_ref(), self.me, lsn, replies)?;
        Ok(lsn)
    }

    /// Deletes the journals no table in the store names and that can never be written again:
    /// sealed ones, and earlier incarnations of this server (sealed here first).
    fn collect_journals(&self, store: &dyn ObjectStore, keep_newest: bool) -> io::Result<usize> {
        let needed: std::collections::BTreeSet<JournalId> = all_manifests(store)?
            .iter()
            .flat_map(|m| m.journals.iter().map(|p| p.id()))
            .collect();
        let journals = kochab_journal::segment::list_journals(store)?;
        let mut newest: std::collections::BTreeMap<u64, u64> = Default::default();
        for j in &journals {
            let e = newest.entry(j.server).or_insert(j.epoch);
            *e = (*e).max(j.epoch);
        }
        let mut deleted = 0;
        for j in journals {
            if j == self.me || needed.contains(&j) {
                continue;
            }
            if keep_newest && newest.get(&j.server) == Some(&j.epoch) {
                continue;
            }
            let mine_older = j.server == self.me.server && j.epoch < self.me.epoch;
            if mine_older {
                kochab_journal::seal(store, j)?;
            } else if !kochab_journal::segment::is_sealed(store, j)? {
                continue;
            }
            kochab_journal::segment::delete_journal(store, j)?;
            store.delete(&crate::manifest::replies_name(j))?;
            deleted += 1;
        }
        Ok(deleted)
    }

    fn checkpoint_table(&mut self, shared: &Shared, lo: u64) -> io::Result<(usize, u64)> {
        let started = Instant::now();
        let full = self.manifests[&lo].wants_full();
        let (start_lsn, set, full) = match shared.table_step(TableChange::Snapshot { lo, full }) {
            TableDone::Snapshot { set, full, last } => (last, set, full),
            _ => return Ok((0, 0)),
        };
        let m = &self.manifests[&lo];
        let own_after = m.position_in(self.me).map_or(0, |p| p.after);
        let older = m.journals.iter().any(|p| p.id() != self.me);
        if set.is_empty() {
            // Nothing changed since the last image: only the replay point moves (and older
            // journals are let go), and only when that lets the journal be trimmed.
            if start_lsn > own_after || older {
                // The replay point may only pass records that are durable: a manifest ahead
                // of the journal would make the next start refuse (or, after a journal
                // failure, skip records that were never written).
                if !shared.journal().wait_durable(start_lsn) {
                    return Err(io::Error::other("journal failed; checkpoint abandoned"));
                }
                let mut m = m.clone();
                m.journals = vec![self.own_pos(start_lsn)];
                self.write_manifest(shared, m, Vec::new())?;
            }
            return Ok((0, 0));
        }
        match self.write_image(shared, lo, Source::Engine(lo), &set, full, start_lsn) {
            Ok(bytes) => {
                shared
                    .metrics()
                    .checkpoint_seconds
                    .observe(started.elapsed().as_secs_f64());
                shared.metrics().checkpoint_bytes.inc_by(bytes);
                Ok((set.len(), bytes))
            }
            Err(e) => {
                // The boxes are still unsaved: track them again for the next round.
                shared.table_step(TableChange::Unsaved { lo, set, full });
                Err(e)
            }
        }
    }

    fn own_pos(&self, after: u64) -> JournalPos {
        JournalPos {
            server: self.me.server,
            epoch: self.me.epoch,
            after,
            until: None,
        }
    }

    /// Writes an image of `set` from `source` and a manifest that names it. The manifest's
    /// journals become this server's journal from `start_lsn` (or none at all for a
    /// released table, whose image holds everything).
    fn write_image(
        &mut self,
        shared: &Shared,
        lo: u64,
        source: Source<'_>,
        set: &BoxSet,
        full: bool,
        start_lsn: u64,
    ) -> io::Result<u64> {
        let mut m = self.manifests[&lo].clone();
        let seq = m.next_seq + 1;
        m.next_seq = seq;
        let img = self.write_image_object(shared, lo, source, set, seq, full)?;
        // Effects of every record up to here may be in the image: they must be durable first.
        let end_lsn = shared.journal().last_lsn();
        if !shared.journal().wait_durable(end_lsn) {
            return Err(io::Error::other("journal failed; checkpoint abandoned"));
        }
        let obsolete = if full {
            std::mem::take(&mut m.images)
        } else {
            Vec::new()
        };
        let written = img.bytes;
        m.images.push(img);
        m.journals = match source {
            Source::Engine(_) => vec![self.own_pos(start_lsn)],
            Source::Detached(_) => Vec::new(),
        };
        match source {
            Source::Detached(_) => m.owner = None,
            // Counted by this server when it added the table; not for whoever is next.
            Source::Engine(_) => {
                m.open_elsewhere.clear();
                m.open_handles.clear();
                m.replies = HandedOver::default();
                m.locks.clear();
                m.quarantine.clear();
            }
        }
        self.write_manifest(shared, m, obsolete)?;
        Ok(written)
    }

    /// Writes image `seq` of table `lo` holding `set` from `source` and syncs it; nothing
    /// names it until a manifest does.
    fn write_image_object(
        &self,
        shared: &Shared,
        lo: u64,
        source: Source<'_>,
        set: &BoxSet,
        seq: u64,
        full: bool,
    ) -> io::Result<ImageRef> {
        let mut img = ImageRef {
            seq,
            bytes: 0,
            full,
            server: self.me.server,
            epoch: self.me.epoch,
            parts: 0,
        };
        let name = image_name(lo, &img);
        // Streamed in pieces so a full checkpoint of a huge table needs no huge buffer. The
        // image counts only once the manifest names it, so it need not appear atomically.
        let mut out = ImageOut::open(shared.store().clone(), name)?;
        let mut written = 0u64;
        let mut buf = Vec::with_capacity(IMAGE_FLUSH_BYTES + (64 << 10));
        let mut n = 0u64;
        let mut scratch = Vec::new();
        let mut inode_boxes = set.inode_boxes.iter();
        let mut dentry_boxes = set.dentry_boxes.iter();
        let mut layout_groups = set.layout_groups.iter();
        // A layout group may need several records (a huge group is cut to fit).
        let mut pending: std::collections::VecDeque<BoxImage> = Default::default();
        let mut reclaims_left = set.reclaims;
        let mut region_next_left = set.region_next;
        loop {
            // The core lock (if any) is held only while boxes are copied, never over I/O.
            let copied = {
                let core;
                let t = match source {
                    Source::Detached(t) => t,
                    Source::Engine(lo) => {
                        core = shared.core();
                        match hosted_index(&core.engine, lo) {
                            Some(i) => &core.engine.tables()[i],
                            None => {
                                return Err(io::Error::other(format!(
                                    "table {lo:016x} left this server during its checkpoint"
                                )));
                            }
                        }
                    }
                };
                let mut copied = 0;
                while copied < BOXES_PER_LOCK {
                    let img = if let Some(img) = pending.pop_front() {
                        img
                    } else if let Some(&b) = inode_boxes.next() {
                        t.image_inode_box(b)
                    } else if let Some(&(d, b)) = dentry_boxes.next() {
                        t.image_dentry_box(d, b)
                    } else if let Some(&(id, g)) = layout_groups.next() {
                        // A group's records are taken under one lock: they show one moment.
                        pending.extend(t.image_layout_group(id, g));
                        match pending.pop_front() {
                            Some(img) => img,
                            None => continue,
                        }
                    } else if reclaims_left {
                        reclaims_left = false;
                        t.image_reclaims()
                    } else if region_next_left {
                        region_next_left = false;
                        t.image_region_next()
                    } else {
                        break;
                    };
                    scratch.clear();
                    scratch = postcard::to_extend(&img, std::mem::take(&mut scratch))
                        .map_err(io::Error::other)?;
                    n += 1;
                    // See BOX_IMAGE_BYTES_MAX: a larger box fails this round, never the server.
                    encode_record_with(&mut buf, n, self.me.epoch, BOX_IMAGE_BYTES_MAX, |o| {
                        o.extend_from_slice(&scratch)
                    })
                    .map_err(io::Error::other)?;
                    copied += 1;
                }
                copied
            };
            if buf.len() >= IMAGE_FLUSH_BYTES || copied < BOXES_PER_LOCK {
                out.write(&buf, written)?;
                written += buf.len() as u64;
                buf.clear();
            }
            if copied < BOXES_PER_LOCK {
                break;
            }
        }
        img.parts = out.finish()?;
        shared.store().sync_dir(&table_dir(lo))?;
        img.bytes = written;
        Ok(img)
    }

    /// Swaps in the next version of a table's manifest. A refusal means another server
    /// incarnation took the table over: this one is fenced and stops (fail-stop), since
    /// everything it would acknowledge from now on could be lost.
    fn write_manifest(
        &mut self,
        shared: &Shared,
        mut m: Manifest,
        obsolete: Vec<ImageRef>,
    ) -> io::Result<()> {
        if let Err(e) = swap_manifest(shared.store().as_ref(), &mut m) {
            if e.kind() == io::ErrorKind::AlreadyExists {
                let why = format!(
                    "the manifest of table {:016x} was replaced by another server \
                     incarnation (this one, {}, is fenced)",
                    m.lo, self.me
                );
                shared.journal().fail_stop(why.clone());
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
            }
            return Err(e);
        }
        let names: Vec<String> = obsolete
            .iter()
            .flat_map(|img| image_objects(m.lo, img))
            .collect();
        shared.store().delete_many(&names)?;
        if let Some(p) = m.position_in(self.me) {
            let (lo, after) = (m.lo, p.after);
            shared.table_step(TableChange::ReplayFrom { lo, after });
        }
        self.manifests.insert(m.lo, m);
        Ok(())
    }

    /// Checkpoints a table taken out of the engine and releases it: its manifest then names
    /// no owner and no journal (the images hold everything), so the next owner loads it
    /// without reading this server's journal. Only the boxes changed since the last image
    /// are written (a delta), unless the manifest wants a full image anyway: a borrow moves
    /// a table there and back, and writing all of it each way made every multi-server
    /// operation cost two full checkpoints. The caller made every record that touched it
    /// durable first. On failure the table's changed boxes are marked again. Returns the
    /// images the released manifest lists.
    pub fn release(
        &mut self,
        shared: &Shared,
        table: &mut Table,
        handover: Handover,
    ) -> io::Result<Vec<ImageRef>> {
        let Some(m) = self.manifests.get_mut(&table.lo) else {
            return Err(io::Error::other(format!(
                "table {:016x} has no manifest here",
                table.lo
            )));
        };
        m.open_elsewhere = handover.open_counts;
        m.open_handles = handover.open_handles;
        m.replies = handover.replies;
        m.locks = handover.locks;
        m.quarantine = handover.quarantine;
        let has_base = m.images.iter().any(|i| i.full);
        let full = table.take_needs_full() || !has_base || m.wants_full();
        let dirty = table.take_dirty();
        let start = shared.journal().last_lsn();
        let result = if full {
            let set = table.all_boxes();
            self.write_image(shared, table.lo, Source::Detached(table), &set, true, start)
        } else if dirty.is_empty() {
            // Nothing changed since the last image: only the manifest says it is free.
            let mut m = self.manifests[&table.lo].clone();
            m.journals = Vec::new();
            m.owner = None;
            self.write_manifest(shared, m, Vec::new()).map(|()| 0)
        } else {
            self.write_image(
                shared,
                table.lo,
                Source::Detached(table),
                &dirty,
                false,
                start,
            )
        };
        match result {
            Ok(_) => Ok(self
                .manifests
                .remove(&table.lo)
                .map(|m| m.images)
                .unwrap_or_default()),
            Err(e) => {
                table.mark_dirty(&dirty);
                if full {
                    table.set_needs_full();
                }
                Err(e)
            }
        }
    }

    /// Splits the hosted table `lo` at `at` (or at [`kochab_meta::Engine::split_point`])
    /// and makes the split durable: full images of both halves, then the lower half's
    /// manifest (with the new range and the upper half's manifest inside: the commit
    /// point), then the upper half's own manifest. The caller drained the table. `Ok(Err)`:
    /// nothing changed, the table cannot be split there. `Err`: the store failed part-way;
    /// the caller must stop (a recoverer finishes or ignores the split, as the lower
    /// manifest says).
    pub fn split(
        &mut self,
        shared: &Shared,
        lo: u64,
        at: Option<u64>,
    ) -> io::Result<Result<u64, SplitRefused>> {
        let Some(old) = self.manifests.get(&lo).cloned() else {
            return Ok(Err(SplitRefused::NoManifest(lo)));
        };
        let (at, start_lsn, lower_set, upper_set) =
            match shared.table_step(TableChange::Split { lo, at }) {
                TableDone::Split {
                    at,
                    lower,
                    upper,
                    last,
                } => (at, last, lower, upper),
                TableDone::SplitRefused(e) => return Ok(Err(e.into())),
                _ => {
                    return Err(io::Error::other(format!(
                        "table {lo:016x} is not hosted after its split"
                    )));
                }
            };
        let upper_img =
            self.write_image_object(shared, at, Source::Engine(at), &upper_set, 1, true)?;
        let lower_img = self.write_image_object(
            shared,
            lo,
            Source::Engine(lo),
            &lower_set,
            old.next_seq + 1,
            true,
        )?;
        if !shared.journal().wait_durable(shared.journal().last_lsn()) {
            return Err(io::Error::other("journal failed; split abandoned"));
        }
        let upper = Manifest {
            lo: at,
            hi: old.hi,
            owner: old.owner,
            journals: vec![self.own_pos(start_lsn)],
            images: vec![upper_img],
            next_seq: 1,
            ..Default::default()
        };
        let mut lower = old.clone();
        lower.hi = at;
        lower.next_seq = old.next_seq + 1;
        lower.images = vec![lower_img];
        lower.journals = vec![self.own_pos(start_lsn)];
        lower.open_elsewhere.clear();
        lower.open_handles.clear();
        lower.replies = HandedOver::default();
        lower.locks.clear();
        lower.quarantine.clear();
        lower.split = Some(Box::new(upper.clone()));
        self.write_manifest(shared, lower, old.images)?;
        crash_point("split-committed");
        // A stale manifest of the upper id cannot exist (tables never merge), but a write
        // over one would be refused, not lost.
        let mut upper = upper;
        upper.version = read_manifest_by_id(shared.store().as_ref(), at)?.map_or(0, |m| m.version);
        self.write_manifest(shared, upper, Vec::new())?;
        if let Some(m) = self.manifests.get_mut(&lo) {
            m.split = None;
        }
        Ok(Ok(at))
    }

    /// Starts checkpointing a table whose manifest this server has just claimed.
    pub fn adopt(&mut self, m: Manifest) {
        self.manifests.insert(m.lo, m);
    }
}

/// Test hook: `KOCHAB_CRASH_AT=<name>` aborts the process at the point of that name, so a
/// test can crash exactly inside a protocol's steps (a SIGKILL from outside cannot aim).
/// Points: `split-committed` (a split's lower manifest written, the upper's not yet).
pub fn crash_point(name: &str) {
    if std::env::var("KOCHAB_CRASH_AT").is_ok_and(|v| v == name) {
        eprintln!("kochab: KOCHAB_CRASH_AT={name}: aborting here, as asked");
        std::process::abort();
    }
}

/// The engine index of the hosted table whose id is `lo`.
fn hosted_index(engine: &kochab_meta::Engine, lo: u64) -> Option<usize> {
    engine
        .table_index(lo)
        .filter(|&i| engine.tables()[i].lo == lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::{Engine, EngineConfig};
    use kochab_proto::{Credentials, Op, Reply};

    /// A split's commit point is its lower half's manifest: until the upper half's own
    /// manifest is written, a loader finds it inside; afterwards the store's copy wins; a
    /// range the map still shows whole is loaded as both halves; and a range that stops
    /// at the split point is the lower half alone.
    #[test]
    fn a_split_is_found_from_its_lower_half_before_and_after_the_upper_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = kochab_store::LocalStore::open(dir.path()).unwrap();
        let owner = Some(Owner {
            server: 2,
            epoch: 1,
        });
        let upper = Manifest {
            lo: 0x80,
            hi: 0x100,
            owner,
            next_seq: 1,
            ..Default::default()
        };
        let mut lower = Manifest {
            lo: 0x40,
            hi: 0x100,
            owner,
            ..Default::default()
        };
        swap_manifest(&store, &mut lower).unwrap();
        assert_eq!(
            manifests_covering(&store, 0x40, Some(0x100)).unwrap().len(),
            1
        );
        // The commit point: the lower half ends at 0x80 and carries the upper's manifest.
        lower.hi = 0x80;
        lower.split = Some(Box::new(upper.clone()));
        swap_manifest(&store, &mut lower).unwrap();
        let found = manifests_covering(&store, 0x40, Some(0x100)).unwrap();
        assert_eq!(
            found.iter().map(|m| (m.lo, m.hi)).collect::<Vec<_>>(),
            vec![(0x40, 0x80), (0x80, 0x100)]
        );
        assert_eq!(
            found[1].version, 0,
            "not in the store yet: its first write creates it"
        );
        assert_eq!(manifests_covering(&store, 0x40, None).unwrap().len(), 2);
        assert_eq!(
            manifests_covering(&store, 0x40, Some(0x80)).unwrap().len(),
            1
        );
        // Once the upper half's own manifest exists, it is what loads.
        let mut written = upper.clone();
        written.next_seq = 7;
        swap_manifest(&store, &mut written).unwrap();
        let found = manifests_covering(&store, 0x40, Some(0x100)).unwrap();
        assert_eq!((found[1].next_seq, found[1].version), (7, 1));
        // A range that reaches past what the manifests hold is refused, not guessed.
        assert!(manifests_covering(&store, 0x40, Some(0x200)).is_err());
    }

    /// Fills `id`'s extended attributes until the engine refuses more.
    fn fill_xattrs(engine: &mut Engine, id: u64) {
        let mut out = Vec::new();
        let mut k = 0;
        for size in [65536, 8192, 1024, 64, 0] {
            loop {
                k += 1;
                let op = Op::SetXattr {
                    id,
                    name: format!("trusted.x{k}").into_bytes(),
                    value: vec![7u8; size],
                    flags: 0,
                };
                match engine.execute(&Credentials::root(), &op, 1, &mut out) {
                    Reply::Empty => {}
                    Reply::Error(e) if e.errno == kochab_proto::Errno::ENOSPC => break,
                    other => panic!("setxattr: {other:?}"),
                }
            }
        }
    }

    /// A 1 TiB file's layout (262,144 chunks of 3 refs) and chunks at the engine's ref
    /// limit with the largest object ids are cut into records that each fit, and load back.
    #[test]
    fn a_huge_layout_checkpoints_in_records_that_fit() {
        use kochab_meta::SliceRef;
        use kochab_meta::layout::CHUNK_REFS_MAX;
        let mut t = Table::new(0, 1 << 20);
        let chunks = (1u64 << 40) / kochab_proto::CHUNK_BYTES;
        for c in 0..chunks {
            let refs = (0..3u64)
                .map(|k| SliceRef {
                    object: u64::MAX - c * 3 - k,
                    pos: k as u32 * 1_000_000,
                    len: 1_000_000,
                })
                .collect();
            t.put_chunk(5, c, refs);
        }
        for c in 0..16 {
            let refs = (0..CHUNK_REFS_MAX as u64)
                .map(|k| SliceRef {
                    object: u64::MAX - k,
                    pos: u32::MAX >> 12,
                    len: u32::MAX >> 12,
                })
                .collect();
            t.put_chunk(6, c, refs);
        }
        let set = t.take_dirty();
        let mut loaded = Table::new(0, 1 << 20);
        let mut records = 0;
        for &(id, g) in &set.layout_groups {
            for img in t.image_layout_group(id, g) {
                let bytes = postcard::to_allocvec(&img).unwrap();
                let mut framed = Vec::new();
                encode_record_with(&mut framed, 1, 1, BOX_IMAGE_BYTES_MAX, |o| {
                    o.extend_from_slice(&bytes)
                })
                .unwrap();
                assert!(bytes.len() <= 2 << 20, "{} bytes", bytes.len());
                loaded.load_image(img).unwrap();
                records += 1;
            }
        }
        assert!(records > 256 + 1, "{records} records");
        let count = |t: &Table| -> usize {
            t.iter_layouts()
                .map(|(_, l)| l.values().map(|r| r.len()).sum::<usize>())
                .sum()
        };
        assert_eq!(count(&loaded), count(&t));
        assert_eq!(loaded.layout(5), t.layout(5));
        assert_eq!(loaded.layout(6), t.layout(6));
    }

    #[test]
    fn a_box_of_inodes_with_full_xattrs_fits_one_image_record() {
        // The old per-inode bound (1 MiB) made such a box a 64 MiB image record, far over
        // the 4 MiB record limit: the checkpointer's assert aborted the server, and again
        // after every restart.
        let mut engine = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
        let mut out = Vec::new();
        for m in engine.bootstrap(1) {
            engine.apply(&m).unwrap();
        }
        let root = engine.root();
        let mut ids = Vec::new();
        for i in 0..130 {
            let op = Op::Mknod {
                parent: root,
                name: format!("f{i}").into_bytes(),
                mode: 0o100644,
                rdev: 0,
                exclusive: true,
            };
            match engine.execute(&Credentials::root(), &op, 1, &mut out) {
                Reply::Entry(a) => ids.push(a.id),
                other => panic!("mknod: {other:?}"),
            }
        }
        // A box whose 64 slots are all files.
        let boxno = ids
            .iter()
            .map(|id| id >> kochab_meta::table::BOX_SHIFT)
            .find(|b| {
                ids.iter()
                    .filter(|id| *id >> kochab_meta::table::BOX_SHIFT == *b)
                    .count()
                    == 64
            })
            .expect("a full box");
        for &id in ids
            .iter()
            .filter(|id| *id >> kochab_meta::table::BOX_SHIFT == boxno)
        {
            fill_xattrs(&mut engine, id);
        }
        let t = engine
            .table_index(boxno << kochab_meta::table::BOX_SHIFT)
            .unwrap();
        let img = engine.tables()[t].image_inode_box(boxno);
        let bytes = postcard::to_allocvec(&img).unwrap();
        assert!(
            bytes.len() > 64 * kochab_meta::ops::XATTR_TOTAL_MAX * 9 / 10,
            "the box is full: {} bytes",
            bytes.len()
        );
        assert!(
            bytes.len() <= BOX_IMAGE_BYTES_MAX,
            "box image of {} bytes",
            bytes.len()
        );
    }
}
