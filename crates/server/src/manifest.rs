//! The store layout of tables: each table's versioned manifest (owner, journals, images)
//! and its checkpoint images, and loading a table from them.
//!
//! Manifests are keyed by table id (the table's first inode id), say who owns the table
//! and from which journals (server incarnation, LSN range) it is replayed, and are replaced
//! only by a conditional write of their next version: a fenced owner's late checkpoint is
//! refused by the store.

use crate::replycache::HandedOver;
use kochab_journal::JournalId;
use kochab_journal::record::{Scan, scan_limited};
use kochab_meta::{BoxImage, Table};
use kochab_store::{ObjectStore, newest_version, versioned_name};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;

/// Largest image of one box. An inode box is at most 64 inodes (each under 5 KiB with a
/// symlink target) with their extended attributes (at most `kochab_meta::ops::XATTR_TOTAL_MAX`
/// = 128 KiB each): about 8.3 MiB; the test below checks it. A dentry box holds 1/1024 of a
/// directory's names (a directory would need about 60 million long names to pass this); a
/// box that does fails its checkpoint with an error, which is retried, never an abort. A
/// layout record holds about `kochab_meta::table::LAYOUT_RECORD_BYTES` (1 MiB), or one chunk
/// of at most `kochab_meta::layout::CHUNK_REFS_MAX` refs (about 160 KiB): a huge file's
/// layout is cut into many records (a test below checks a 1 TiB one).
pub const BOX_IMAGE_BYTES_MAX: usize = 16 << 20;
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

    pub(crate) fn wants_full(&self) -> bool {
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

pub(crate) fn table_dir(lo: u64) -> String {
    format!("{TABLES_DIR}/{lo:016x}")
}

pub(crate) fn manifest_base(lo: u64) -> String {
    format!("{}/manifest", table_dir(lo))
}

pub(crate) fn image_name(lo: u64, img: &ImageRef) -> String {
    format!(
        "{}/{:010}.{}.{}.img",
        table_dir(lo),
        img.seq,
        img.server,
        img.epoch
    )
}

/// The objects holding image `img` of table `lo`, in order.
pub(crate) fn image_objects(lo: u64, img: &ImageRef) -> Vec<String> {
    let first = image_name(lo, img);
    (0..img.parts.max(1))
        .map(|k| match k {
            0 => first.clone(),
            k => format!("{first}.{k:05}"),
        })
        .collect()
}

/// The reply cache of one journal as of one of its LSNs (see [`write_replies`]).
#[derive(Serialize, Deserialize)]
pub struct RepliesSnapshot {
    /// Every record up to this LSN that carries a reply-cache entry is in `replies`.
    pub lsn: u64,
    pub replies: HandedOver,
}

/// Where journal `id`'s reply-cache snapshot lives (beside the journals, not in a journal's
/// own folder, whose listing must hold its segments alone).
pub fn replies_name(id: JournalId) -> String {
    format!("replies/{:016x}.{:016x}", id.server, id.epoch)
}

/// Saves the reply cache of journal `id`'s writer as of `lsn` (durable when it returns),
/// before a checkpoint round lets the journal's replay start pass records whose entries a
/// client may still need: a crash then loses no entry of an operation a client may replay
/// (its early reply not yet known durable) or retry (its reply lost). Recovery imports it
/// and reads the journal from `lsn` on for the entries after it ([`read_replies`]). Each
/// incarnation writes only its own, and a successor reads it once, after sealing the
/// journal: a fenced writer's late snapshot (which it cannot make, its journal failing
/// first) could not change what the successor took.
pub fn write_replies(
    store: &dyn ObjectStore,
    id: JournalId,
    lsn: u64,
    replies: HandedOver,
) -> io::Result<()> {
    let bytes =
        postcard::to_allocvec(&RepliesSnapshot { lsn, replies }).map_err(io::Error::other)?;
    store.put(&replies_name(id), &bytes)
}

/// Journal `id`'s reply-cache snapshot, if it made one.
pub fn read_replies(store: &dyn ObjectStore, id: JournalId) -> io::Result<Option<RepliesSnapshot>> {
    let Some(bytes) = store.get(&replies_name(id))? else {
        return Ok(None);
    };
    postcard::from_bytes(&bytes).map(Some).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {e}", replies_name(id)),
        )
    })
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
pub(crate) fn load_image_part(
    table: &mut Table,
    name: &str,
    bytes: &[u8],
    n: &mut u64,
) -> io::Result<u64> {
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

/// Checkpoint state of every table this server hosts, keyed by table id (its `lo`).
pub struct Checkpointer {
    pub(crate) manifests: BTreeMap<u64, Manifest>,
    pub(crate) me: JournalId,
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
}
