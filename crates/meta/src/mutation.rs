//! Redo mutations: what an operation changed, as post-images. They are what the journal
//! records, and the engine applies them through the same code both live and on replay, so
//! memory and journal cannot disagree. Post-images make replay idempotent, which fuzzy
//! (while-running) checkpoints need: replaying a record whose effect a checkpoint already
//! holds changes nothing.

use crate::idpolicy::Region;
use crate::inode::Inode;
use crate::name::Name;
use kochab_proto::layout::SliceRef;
use kochab_proto::{FileKind, InodeId};
use serde::{Deserialize, Serialize};

/// One change to one key of one table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mutation {
    /// The inode's full new state (extended attributes excepted).
    PutInode { id: InodeId, inode: Inode },
    /// The inode is gone, with its extended attributes.
    DropInode { id: InodeId },
    /// `parent/name` now names `child`.
    PutDentry {
        parent: InodeId,
        name: Name,
        child: InodeId,
        kind: FileKind,
    },
    /// `parent/name` names nothing.
    DropDentry { parent: InodeId, name: Name },
    SetXattr {
        id: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    DropXattr {
        id: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
    },
    /// Data of inode `id` (generation `generation`) at and beyond byte `from` must be
    /// deleted (which chunks exist is read from the store). Durable until the data is gone,
    /// so a crash never leaks objects.
    PutReclaim {
        id: InodeId,
        generation: u64,
        from: u64,
    },
    /// The data named by a reclaim entry is gone.
    DropReclaim { id: InodeId, generation: u64 },
    /// The allocation point of an overflow region moved to `next` (a too-deep root number,
    /// a too-wide range number, a catch-all id): everything below it may have been handed
    /// out, nothing at or above it has. Kept by the table that holds the region (its base
    /// id), so it travels with that table and survives restarts as it was, never derived
    /// from the highest id present (one planted id would move it). Applied as a maximum:
    /// a high-water mark only rises, and replay stays idempotent.
    SetRegionNext { region: Region, next: u64 },
    /// Chunk `chunk` of file `id` now has exactly `refs`, oldest first (none: no refs).
    PutChunk {
        id: InodeId,
        chunk: u64,
        refs: Vec<SliceRef>,
    },
    /// Every chunk of file `id` at or past `from` has no refs (a truncation: one record
    /// however many chunks go, where a PutChunk each would pass a journal record's limit
    /// for a huge file).
    DropChunks { id: InodeId, from: u64 },
}

impl Mutation {
    /// The id whose table this mutation changes (dentries live with their parent).
    pub fn table_key(&self) -> InodeId {
        match self {
            Mutation::PutInode { id, .. }
            | Mutation::DropInode { id }
            | Mutation::SetXattr { id, .. }
            | Mutation::DropXattr { id, .. }
            | Mutation::PutReclaim { id, .. }
            | Mutation::DropReclaim { id, .. }
            | Mutation::PutChunk { id, .. }
            | Mutation::DropChunks { id, .. } => *id,
            Mutation::PutDentry { parent, .. } | Mutation::DropDentry { parent, .. } => *parent,
            Mutation::SetRegionNext { region, .. } => region.base(),
        }
    }
}
