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
//! Manifests are keyed by table id (the table's first inode id), say who owns the table
//! and from which journals (server incarnation, LSN range) it is replayed, and are replaced
//! only by a conditional write of their next version: a fenced owner's late checkpoint is
//! refused by the store.

use crate::core::Shared;
use crate::replycache::HandedOver;
use kochab_journal::JournalId;
use kochab_journal::record::{Scan, encode_record_with, scan_limited};
use kochab_meta::{BoxImage, BoxSet, Table};
use kochab_store::{ObjectStore, newest_version, versioned_name};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::time::Instant;

/// Largest image of one box. An inode box is at most 64 inodes (each under 5 KiB with a
/// symlink target) with their extended attributes (at most `kochab_meta::ops::XATTR_TOTAL_MAX`
/// = 128 KiB each): about 8.3 MiB; the test below checks it. A dentry box holds 1/1024 of a
/// directory's names (a directory would need about 60 million long names to pass this); a
/// box that does fails its checkpoint with an error, which is retried, never an abort. A
/// layout record holds about `kochab_meta::table::LAYOUT_RECORD_BYTES` (1 MiB), or one chunk
/// of at most `kochab_meta::layout::CHUNK_REFS_MAX` refs (about 160 KiB): a huge file's
/// layout is cut into many records (a test below checks a 1 TiB one).
pub const BOX_IMAGE_BYTES_MAX: usize = 16 << 20;
/// Boxes copied per lock acquisition: short enough that operations barely notice.
const BOXES_PER_LOCK: usize = 256;
/// Image bytes buffered before they are written out.
const IMAGE_FLUSH_BYTES: usize = 4 << 20;
/// Deltas are folded into a new base once they exceed the base and this many bytes.
const COMPACT_MIN_BYTES: u64 = 8 << 20;
/// ... or once there are this many of them (each costs an object read at recovery).
const COMPACT_MAX_DELTAS: usize = 64;

/// One image listed in a manifest. Its object name carries the writer's server and epoch,
/// so a fenced writer's late image can never overwrite the new owner's.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageRef {
    pub seq: u64,
    pub bytes: u64,
    pub full: bool,
    pub server: u64,
    pub epoch: u64,
    /// Objects the image is cut into, on a store of whole objects (S3), where it cannot be
    /// streamed into one: the first under the image's name, the others after it (see
    /// `image_objects`). 0: one object streamed in place (the local store).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parts: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A journal a table must be replayed from: the records with LSNs in `(after, until]`
/// (`until`: `None` for the owner's live journal; for a sealed one, the end its first reader
/// found, so that a fenced writer's later, never acknowledged records are never replayed).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JournalPos {
    pub server: u64,
    pub epoch: u64,
    pub after: u64,
    pub until: Option<u64>,
}

impl JournalPos {
    pub fn id(&self) -> JournalId {
        JournalId {
            server: self.server,
            epoch: self.epoch,
        }
    }
}

/// The soft state a server hands to a released table's next owner (see the `Manifest`
/// fields of the same names).
#[derive(Clone, Debug, Default)]
pub struct Handover {
    pub open_counts: Vec<(u64, u32)>,
    pub open_handles: Vec<(u64, u64, u64)>,
    pub replies: HandedOver,
    pub locks: Vec<(u64, crate::locks::Held)>,
    pub quarantine: Vec<u64>,
}

/// Who serves a table.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Owner {
    pub server: u64,
    pub epoch: u64,
}

/// What a table's checkpoint consists of and who owns it. Stored as versioned objects
/// `tables/<lo>/manifest.<version>`; a new version is only ever written by creating the
/// next one if absent (see `ObjectStore::swap_version`), so of two writers from one version
/// exactly one wins, and a fenced owner's late write is refused by the store.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    /// The table's id: the first inode id of its range.
    pub lo: u64,
    pub hi: u64,
    /// The server incarnation that serves it; `None` once released (dropped, clean).
    pub owner: Option<Owner>,
    /// Journals to replay on top of the images, in order. After a move the table is
    /// released with a checkpoint and an empty list, so a list longer than one only comes
    /// from restarts and failovers without a checkpoint in between (each older entry's
    /// journal is sealed); the owner's next checkpoint collapses it to its own journal.
    pub journals: Vec<JournalPos>,
    pub images: Vec<ImageRef>,
    pub next_seq: u64,
    /// Inodes of the table that were open at the server that released it (id, handles).
    /// The server that adds it counts them as open, so an unlink there does not drop an
    /// inode a client of the old owner still has open; kept only by a live ADD (a start or
    /// a failover drops them: their sessions are gone) and cleared by the next manifest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_elsewhere: Vec<(u64, u32)>,
    /// The open handles behind those counts that the releasing server knew by name
    /// (client, handle, inode): the next owner counts each and ends it when the client's
    /// close of that handle reaches it. `open_elsewhere` then holds only the rest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_handles: Vec<(u64, u64, u64)>,
    /// The reply-cache entries of the server that released it, so that a retry of an
    /// operation that ran there is answered once here too; kept like `open_elsewhere`.
    #[serde(default, skip_serializing_if = "HandedOver::is_empty")]
    pub replies: HandedOver,
    /// Advisory locks held on its inodes at the server that released it (granted there:
    /// the next owner keeps them); kept like `open_elsewhere`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locks: Vec<(u64, crate::locks::Held)>,
    /// Ids of the table's inodes removed in the last seconds at the server that released
    /// it: not handed out again before their quarantine ends (a kernel may still reach
    /// them by a cached name); kept like `open_elsewhere`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quarantine: Vec<u64>,
    /// Set by a split: the manifest of the upper half `[hi, ..)`, whose own manifest may
    /// not be written yet. This manifest is the split's commit point: from it on, `hi` is
    /// the split point and whoever loads the table loads that half too, from its own
    /// manifest if there is one, else from this. Cleared by the next manifest after the
    /// upper half's own is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Box<Manifest>>,
    /// The version this manifest was read as or written as (0: none in the store).
    #[serde(skip)]
    pub version: u64,
}

impl Manifest {
    fn base_bytes(&self) -> u64 {
        self.images.iter().filter(|i| i.full).map(|i| i.bytes).sum()
    }

    fn delta_bytes(&self) -> u64 {
        self.images
            .iter()
            .filter(|i| !i.full)
            .map(|i| i.bytes)
            .sum()
    }

    fn wants_full(&self) -> bool {
        let deltas = self.images.iter().filter(|i| !i.full).count();
        (self.delta_bytes() > self.base_bytes() && self.delta_bytes() > COMPACT_MIN_BYTES)
            || deltas >= COMPACT_MAX_DELTAS
    }

    /// Where this table stands in journal `j` (if it needs `j` at all).
    pub fn position_in(&self, j: JournalId) -> Option<&JournalPos> {
        self.journals.iter().find(|p| p.id() == j)
    }

    /// Bytes of images, for balancing loads.
    pub fn image_bytes(&self) -> u64 {
        self.images.iter().map(|i| i.bytes).sum()
    }
}

/// Folder of the table checkpoints.
pub const TABLES_DIR: &str = "tables";

fn table_dir(lo: u64) -> String {
    format!("{TABLES_DIR}/{lo:016x}")
}

fn manifest_base(lo: u64) -> String {
    format!("{}/manifest", table_dir(lo))
}

fn image_name(lo: u64, img: &ImageRef) -> String {
    format!(
        "{}/{:010}.{}.{}.img",
        table_dir(lo),
        img.seq,
        img.server,
        img.epoch
    )
}

/// The objects holding image `img` of table `lo`, in order.
fn image_objects(lo: u64, img: &ImageRef) -> Vec<String> {
    let first = image_name(lo, img);
    (0..img.parts.max(1))
        .map(|k| match k {
            0 => first.clone(),
            k => format!("{first}.{k:05}"),
        })
        .collect()
}

/// Writes `m` as the next version after `m.version`, only if nobody wrote that version
/// first: `AlreadyExists` means the table was taken over (or claimed) by another server
/// incarnation, whose write stands. On success `m.version` is the new version and the
/// version before the previous one is deleted (the previous stays, for readers in flight).
pub fn swap_manifest(store: &dyn ObjectStore, m: &mut Manifest) -> io::Result<()> {
    let json = serde_json::to_vec(m).map_err(io::Error::other)?;
    let base = manifest_base(m.lo);
    let v = store.swap_version(&base, m.version, &json)?;
    m.version = v;
    if v >= 3 {
        store.delete(&versioned_name(&base, v - 2))?;
    }
    Ok(())
}

/// Reads a table's newest manifest (an empty one, version 0, if the table was never
/// checkpointed or claimed).
pub fn read_manifest(store: &dyn ObjectStore, lo: u64, hi: u64) -> io::Result<Manifest> {
    match read_manifest_by_id(store, lo)? {
        None => Ok(Manifest {
            lo,
            hi,
            ..Default::default()
        }),
        Some(m) if m.lo != lo || m.hi != hi => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "manifest of table {lo:016x} describes {:x}..{:x}",
                m.lo, m.hi
            ),
        )),
        Some(m) => Ok(m),
    }
}

/// The newest manifest of the table whose id is `lo`, whatever its range (`None` if it was
/// never written).
pub fn read_manifest_by_id(store: &dyn ObjectStore, lo: u64) -> io::Result<Option<Manifest>> {
    let Some((version, bytes)) = newest_version(store, &manifest_base(lo))? else {
        return Ok(None);
    };
    let mut m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("manifest of table {lo:016x}: {e}"),
        )
    })?;
    m.version = version;
    Ok(Some(m))
}

/// The manifests that hold `[lo, hi)` between them, lowest first: the table's own, then
/// those of the halves split off it that the caller's range (the coordinator's map) does
/// not know of yet. With `hi` unknown (`None`), only splits still pending in a manifest
/// (`Manifest::split`) are followed. An upper half with no manifest of its own yet comes
/// from its lower half's (version 0: its first write creates it).
pub fn manifests_covering(
    store: &dyn ObjectStore,
    lo: u64,
    hi: Option<u64>,
) -> io::Result<Vec<Manifest>> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut out: Vec<Manifest> = Vec::new();
    let mut next = lo;
    let mut pending: Option<Manifest> = None;
    loop {
        let m = match (read_manifest_by_id(store, next)?, pending.take()) {
            (Some(m), _) => m,
            (None, Some(mut m)) => {
                m.version = 0;
                m
            }
            (None, None) if out.is_empty() => match hi {
                // Never checkpointed nor claimed: an empty table.
                Some(hi) => Manifest {
                    lo,
                    hi,
                    ..Default::default()
                },
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("table {lo:016x} has no manifest in the store"),
                    ));
                }
            },
            (None, None) => {
                return Err(bad(format!(
                    "table {next:016x} was split off {:016x} but has no manifest",
                    out.last().map_or(lo, |m| m.lo)
                )));
            }
        };
        if m.lo != next || m.hi <= next || hi.is_some_and(|h| m.hi > h) {
            return Err(bad(format!(
                "manifest of table {next:016x} describes {:x}..{:x}, not a part of {lo:x}..{}",
                m.lo,
                m.hi,
                hi.map_or("".to_string(), |h| format!("{h:x}"))
            )));
        }
        next = m.hi;
        pending = m.split.as_deref().cloned();
        let go_on = match hi {
            Some(h) => next < h,
            None => pending.is_some(),
        };
        out.push(m);
        if !go_on {
            return Ok(out);
        }
    }
}

/// The manifests of every table in the store (hosted here or not), for collecting journals
/// no table needs any more.
pub fn all_manifests(store: &dyn ObjectStore) -> io::Result<Vec<Manifest>> {
    let mut out = Vec::new();
    for dir in store.list(TABLES_DIR)? {
        if let Some((_, bytes)) = newest_version(store, &format!("{dir}/manifest"))? {
            let m: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{dir}: {e}")))?;
            out.push(m);
        }
    }
    Ok(out)
}

/// Loads a table from its checkpoint images.
pub fn load_table(
    store: &dyn ObjectStore,
    table: &mut Table,
    manifest: &Manifest,
) -> io::Result<u64> {
    let mut boxes = 0;
    for img in &manifest.images {
        let names = image_objects(manifest.lo, img);
        let name = &names[0];
        // Box records are numbered across the parts of an image.
        let mut n = 1;
        for (part, bytes) in names.iter().zip(store.get_many(&names)?) {
            let bytes = bytes.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("checkpoint image {part} is missing"),
                )
            })?;
            boxes += load_image_part(table, name, &bytes, &mut n)?;
        }
    }
    Ok(boxes)
}

/// Loads the box records of one object of image `name` into `table`; `n` is the number the
/// next record must have.
fn load_image_part(table: &mut Table, name: &str, bytes: &[u8], n: &mut u64) -> io::Result<u64> {
    let mut boxes = 0;
    let mut off = 0;
    loop {
        match scan_limited(&bytes[off..], *n, BOX_IMAGE_BYTES_MAX) {
            Scan::Record { payload, len, .. } => {
                let image: BoxImage = postcard::from_bytes(payload).map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidData, format!("{name}: box {n}: {e}"))
                })?;
                table.load_image(image).map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidData, format!("{name}: {e}"))
                })?;
                off += len;
                *n += 1;
                boxes += 1;
            }
            Scan::End => return Ok(boxes),
            Scan::Stale { lsn } => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("checkpoint image {name}: box {lsn} out of order"),
                ));
            }
            Scan::Corrupt { reason } => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("checkpoint image {name} is damaged: {reason}"),
                ));
            }
        }
    }
}

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

/// Checkpoint state of every table this server hosts, keyed by table id (its `lo`).
pub struct Checkpointer {
    manifests: BTreeMap<u64, Manifest>,
    me: JournalId,
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
    /// The checkpointer of journal `me`'s owner, for the tables whose (claimed) manifests
    /// are given.
    pub fn new(manifests: Vec<Manifest>, me: JournalId) -> Checkpointer {
        Checkpointer {
            manifests: manifests.into_iter().map(|m| (m.lo, m)).collect(),
            me,
        }
    }

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
        let ids: Vec<u64> = self.manifests.keys().copied().collect();
        for lo in ids {
            let (b, bytes) = self.checkpoint_table(shared, lo)?;
            if b > 0 {
                report.tables += 1;
                report.boxes += b;
                report.bytes += bytes;
            }
        }
        report.trimmed_segments = shared.journal.trim(self.replay_from() + 1)?;
        report.journals_deleted = self.collect_journals(shared.store.as_ref())?;
        Ok(report)
    }

    /// Deletes the journals no table in the store names and that can never be written again:
    /// sealed ones, and earlier incarnations of this server (sealed here first).
    fn collect_journals(&self, store: &dyn ObjectStore) -> io::Result<usize> {
        let needed: std::collections::BTreeSet<JournalId> = all_manifests(store)?
            .iter()
            .flat_map(|m| m.journals.iter().map(|p| p.id()))
            .collect();
        let mut deleted = 0;
        for j in kochab_journal::segment::list_journals(store)? {
            if j == self.me || needed.contains(&j) {
                continue;
            }
            let mine_older = j.server == self.me.server && j.epoch < self.me.epoch;
            if mine_older {
                kochab_journal::seal(store, j)?;
            } else if !kochab_journal::segment::is_sealed(store, j)? {
                continue;
            }
            kochab_journal::segment::delete_journal(store, j)?;
            deleted += 1;
        }
        Ok(deleted)
    }

    fn checkpoint_table(&mut self, shared: &Shared, lo: u64) -> io::Result<(usize, u64)> {
        let started = Instant::now();
        let (start_lsn, set, full) = {
            let mut core = shared.core.lock();
            let lsn = shared.journal.last_lsn();
            let Some(i) = hosted_index(&core.engine, lo) else {
                return Ok((0, 0));
            };
            let t = &mut core.engine.tables_mut()[i];
            // A table loaded from format-1 images replaces all of them at once.
            let full = t.take_needs_full() || self.manifests[&lo].wants_full();
            let dirty = t.take_dirty();
            let set = if full { t.all_boxes() } else { dirty };
            (lsn, set, full)
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
                if !shared.journal.wait_durable(start_lsn) {
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
                    .metrics
                    .checkpoint_seconds
                    .observe(started.elapsed().as_secs_f64());
                shared.metrics.checkpoint_bytes.inc_by(bytes);
                Ok((set.len(), bytes))
            }
            Err(e) => {
                // The boxes are still unsaved: track them again for the next round.
                let mut core = shared.core.lock();
                if let Some(i) = hosted_index(&core.engine, lo) {
                    let t = &mut core.engine.tables_mut()[i];
                    t.mark_dirty(&set);
                    if full {
                        t.set_needs_full();
                    }
                }
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
        let end_lsn = shared.journal.last_lsn();
        if !shared.journal.wait_durable(end_lsn) {
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
        let mut out = ImageOut::open(shared.store.clone(), name)?;
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
                        core = shared.core.lock();
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
        shared.store.sync_dir(&table_dir(lo))?;
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
        if let Err(e) = swap_manifest(shared.store.as_ref(), &mut m) {
            if e.kind() == io::ErrorKind::AlreadyExists {
                let why = format!(
                    "the manifest of table {:016x} was replaced by another server \
                     incarnation (this one, {}, is fenced)",
                    m.lo, self.me
                );
                shared.journal.fail_stop(why.clone());
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
            }
            return Err(e);
        }
        let names: Vec<String> = obsolete
            .iter()
            .flat_map(|img| image_objects(m.lo, img))
            .collect();
        shared.store.delete_many(&names)?;
        if let Some(p) = m.position_in(self.me) {
            let mut core = shared.core.lock();
            if let Some(i) = hosted_index(&core.engine, m.lo) {
                core.engine.tables_mut()[i].replay_from = p.after;
            }
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
        let start = shared.journal.last_lsn();
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
    ) -> io::Result<Result<u64, String>> {
        let Some(old) = self.manifests.get(&lo).cloned() else {
            return Ok(Err(format!("table {lo:016x} has no manifest here")));
        };
        let (at, start_lsn, lower_set, upper_set) = {
            let mut core = shared.core.lock();
            let at = match at {
                Some(at) => at,
                None => match core.engine.split_point(lo) {
                    Ok(at) => at,
                    Err(e) => return Ok(Err(e)),
                },
            };
            if let Err(e) = core.engine.split_table(lo, at) {
                return Ok(Err(e));
            }
            let lsn = shared.journal.last_lsn();
            // Both halves get full images: their dirty marks are covered.
            let mut all_boxes = |t: u64| {
                let i = hosted_index(&core.engine, t).ok_or_else(|| {
                    io::Error::other(format!("table {t:016x} is not hosted after its split"))
                })?;
                let t = &mut core.engine.tables_mut()[i];
                t.take_needs_full();
                t.take_dirty();
                Ok::<_, io::Error>(t.all_boxes())
            };
            let lower = all_boxes(lo)?;
            let upper = all_boxes(at)?;
            (at, lsn, lower, upper)
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
        if !shared.journal.wait_durable(shared.journal.last_lsn()) {
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
        upper.version = read_manifest_by_id(shared.store.as_ref(), at)?.map_or(0, |m| m.version);
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
