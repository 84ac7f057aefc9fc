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

use crate::core::Shared;
use kochab_journal::record::{Scan, encode_record_with, scan_limited};
use kochab_meta::{BoxImage, BoxSet, Table};
use kochab_store::ObjectStore;
use serde::{Deserialize, Serialize};
use std::io;
use std::time::Instant;

/// Largest image of one box. An inode box is at most 64 inodes (each under 5 KiB with a
/// symlink target) with their extended attributes (at most `kochab_meta::ops::XATTR_TOTAL_MAX`
/// = 128 KiB each): about 8.3 MiB; the test below checks it. A dentry box holds 1/1024 of a
/// directory's names (a directory would need about 60 million long names to pass this); a
/// box that does fails its checkpoint with an error, which is retried, never an abort.
pub const BOX_IMAGE_BYTES_MAX: usize = 16 << 20;
/// Boxes copied per lock acquisition: short enough that operations barely notice.
const BOXES_PER_LOCK: usize = 256;
/// Image bytes buffered before they are written out.
const IMAGE_FLUSH_BYTES: usize = 4 << 20;
/// Deltas are folded into a new base once they exceed the base and this many bytes.
const COMPACT_MIN_BYTES: u64 = 8 << 20;
/// ... or once there are this many of them (each costs an object read at recovery).
const COMPACT_MAX_DELTAS: usize = 64;

/// One image listed in a manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageRef {
    pub seq: u64,
    pub bytes: u64,
    pub full: bool,
}

/// What a table's checkpoint consists of. Replaced atomically.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub lo: u64,
    pub hi: u64,
    /// Journal records after this LSN must be replayed on top of the images.
    pub replay_from: u64,
    pub images: Vec<ImageRef>,
    pub next_seq: u64,
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
}

fn table_dir(lo: u64) -> String {
    format!("tables/{lo:016x}")
}

fn manifest_name(lo: u64) -> String {
    format!("{}/manifest", table_dir(lo))
}

fn image_name(lo: u64, seq: u64) -> String {
    format!("{}/{seq:010}.img", table_dir(lo))
}

/// Replaces a table's manifest (atomically). For offline repair; a running server's
/// checkpointer writes its own.
pub fn put_manifest(store: &dyn ObjectStore, m: &Manifest) -> io::Result<()> {
    let json = serde_json::to_vec(m).map_err(io::Error::other)?;
    store.put(&manifest_name(m.lo), &json)
}

/// Reads a table's manifest (an empty one if the table was never checkpointed).
pub fn read_manifest(store: &dyn ObjectStore, lo: u64, hi: u64) -> io::Result<Manifest> {
    match store.get(&manifest_name(lo))? {
        None => Ok(Manifest {
            lo,
            hi,
            ..Default::default()
        }),
        Some(bytes) => {
            let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("manifest of table {lo:016x}: {e}"),
                )
            })?;
            if m.lo != lo || m.hi != hi {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "manifest of table {lo:016x} describes {:x}..{:x}",
                        m.lo, m.hi
                    ),
                ));
            }
            Ok(m)
        }
    }
}

/// Loads a table from its checkpoint images.
pub fn load_table(
    store: &dyn ObjectStore,
    table: &mut Table,
    manifest: &Manifest,
) -> io::Result<u64> {
    let mut boxes = 0;
    for img in &manifest.images {
        let name = image_name(manifest.lo, img.seq);
        let bytes = store.get(&name)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("checkpoint image {name} is missing"),
            )
        })?;
        let mut off = 0;
        let mut n = 1;
        loop {
            match scan_limited(&bytes[off..], n, BOX_IMAGE_BYTES_MAX) {
                Scan::Record { payload, len, .. } => {
                    let image: BoxImage = postcard::from_bytes(payload).map_err(|e| {
                        io::Error::new(io::ErrorKind::InvalidData, format!("{name}: box {n}: {e}"))
                    })?;
                    table.load_image(image).map_err(|e| {
                        io::Error::new(io::ErrorKind::InvalidData, format!("{name}: {e}"))
                    })?;
                    off += len;
                    n += 1;
                    boxes += 1;
                }
                Scan::End => break,
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
    table.replay_from = manifest.replay_from;
    Ok(boxes)
}

/// Checkpoint state of every table of this server (index = engine table index).
pub struct Checkpointer {
    manifests: Vec<Manifest>,
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy)]
pub struct RoundReport {
    pub tables: usize,
    pub boxes: usize,
    pub bytes: u64,
    pub trimmed_segments: u64,
}

impl Checkpointer {
    pub fn new(manifests: Vec<Manifest>) -> Checkpointer {
        Checkpointer { manifests }
    }

    /// The LSN after which a restart would have to replay: the oldest table's replay point.
    pub fn replay_from(&self) -> u64 {
        self.manifests
            .iter()
            .map(|m| m.replay_from)
            .min()
            .unwrap_or(0)
    }

    /// Checkpoints every table that changed, advances clean tables' replay points, then
    /// trims the journal below what every table still needs.
    pub fn round(&mut self, shared: &Shared) -> io::Result<RoundReport> {
        let mut report = RoundReport::default();
        for i in 0..self.manifests.len() {
            let (b, bytes) = self.checkpoint_table(shared, i)?;
            if b > 0 {
                report.tables += 1;
                report.boxes += b;
                report.bytes += bytes;
            }
        }
        report.trimmed_segments = shared.journal.trim(self.replay_from() + 1)?;
        Ok(report)
    }

    fn checkpoint_table(&mut self, shared: &Shared, i: usize) -> io::Result<(usize, u64)> {
        let started = Instant::now();
        let (start_lsn, set, full) = {
            let mut core = shared.core.lock();
            let lsn = shared.journal.last_lsn();
            let t = &mut core.engine.tables_mut()[i];
            // A table loaded from format-1 images replaces all of them at once.
            let full = t.take_needs_full() || self.manifests[i].wants_full();
            let dirty = t.take_dirty();
            let set = if full { t.all_boxes() } else { dirty };
            (lsn, set, full)
        };
        if set.is_empty() {
            // Nothing changed since the last image: only the replay point moves, and only
            // when that lets the journal be trimmed.
            if start_lsn > self.manifests[i].replay_from {
                // The replay point may only pass records that are durable: a manifest ahead
                // of the journal would make the next start refuse (or, after a journal
                // failure, skip records that were never written).
                if !shared.journal.wait_durable(start_lsn) {
                    return Err(io::Error::other("journal failed; checkpoint abandoned"));
                }
                let mut m = self.manifests[i].clone();
                m.replay_from = start_lsn;
                self.write_manifest(shared, i, m, Vec::new())?;
            }
            return Ok((0, 0));
        }
        match self.write_image(shared, i, &set, full, start_lsn) {
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
                let t = &mut core.engine.tables_mut()[i];
                t.mark_dirty(&set);
                if full {
                    t.set_needs_full();
                }
                Err(e)
            }
        }
    }

    fn write_image(
        &mut self,
        shared: &Shared,
        i: usize,
        set: &BoxSet,
        full: bool,
        start_lsn: u64,
    ) -> io::Result<u64> {
        let mut m = self.manifests[i].clone();
        let seq = m.next_seq + 1;
        m.next_seq = seq;
        let name = image_name(m.lo, seq);
        // Streamed in pieces so a full checkpoint of a huge table needs no huge buffer. The
        // image counts only once the manifest names it, so it need not appear atomically.
        let obj = shared.store.open(&name, true)?;
        obj.set_len(0)?;
        let mut written = 0u64;
        let mut buf = Vec::with_capacity(IMAGE_FLUSH_BYTES + (64 << 10));
        let mut n = 0u64;
        let mut scratch = Vec::new();
        let mut inode_boxes = set.inode_boxes.iter();
        let mut dentry_boxes = set.dentry_boxes.iter();
        let mut reclaims_left = set.reclaims;
        loop {
            let core = shared.core.lock();
            let t = &core.engine.tables()[i];
            let mut copied = 0;
            while copied < BOXES_PER_LOCK {
                let img = if let Some(&b) = inode_boxes.next() {
                    t.image_inode_box(b)
                } else if let Some(&(d, b)) = dentry_boxes.next() {
                    t.image_dentry_box(d, b)
                } else if reclaims_left {
                    reclaims_left = false;
                    t.image_reclaims()
                } else {
                    break;
                };
                scratch.clear();
                scratch = postcard::to_extend(&img, std::mem::take(&mut scratch))
                    .map_err(io::Error::other)?;
                n += 1;
                // See BOX_IMAGE_BYTES_MAX: a larger box fails this round, never the server.
                encode_record_with(&mut buf, n, BOX_IMAGE_BYTES_MAX, |o| {
                    o.extend_from_slice(&scratch)
                })
                .map_err(io::Error::other)?;
                copied += 1;
            }
            drop(core);
            if buf.len() >= IMAGE_FLUSH_BYTES || copied < BOXES_PER_LOCK {
                obj.write_at(&buf, written)?;
                written += buf.len() as u64;
                buf.clear();
            }
            if copied < BOXES_PER_LOCK {
                break;
            }
        }
        obj.sync_data()?;
        shared.store.sync_dir(&table_dir(m.lo))?;
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
        m.images.push(ImageRef {
            seq,
            bytes: written,
            full,
        });
        m.replay_from = start_lsn;
        self.write_manifest(shared, i, m, obsolete)?;
        Ok(written)
    }

    fn write_manifest(
        &mut self,
        shared: &Shared,
        i: usize,
        m: Manifest,
        obsolete: Vec<ImageRef>,
    ) -> io::Result<()> {
        let json = serde_json::to_vec(&m).map_err(io::Error::other)?;
        shared.store.put(&manifest_name(m.lo), &json)?;
        for img in obsolete {
            shared.store.delete(&image_name(m.lo, img.seq))?;
        }
        shared.core.lock().engine.tables_mut()[i].replay_from = m.replay_from;
        self.manifests[i] = m;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::{Engine, EngineConfig};
    use kochab_proto::{Credentials, Op, Reply};

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
