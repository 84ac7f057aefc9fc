//! The engine's errors, as types: a caller tells a record that cannot be applied (journal
//! damage or a bug) from a table it does not host, or a split refused, without parsing text.

use kochab_proto::InodeId;
use thiserror::Error;

/// A mutation that cannot be applied (live: a bug; on replay: a damaged or foreign record).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ApplyError {
    #[error("mutation for {key:#x}, whose table is not hosted")]
    NotHosted { key: InodeId },
    #[error("inode {id:#x} with mode {mode:o}, which names no file type")]
    NoFileType { id: InodeId, mode: u32 },
    #[error("hash bucket of {name} in {parent:#x} is full")]
    BucketFull { parent: InodeId, name: String },
    #[error("an allocation point for the primary region, which has none")]
    PrimaryRegionNext,
    #[error("chunk {chunk} of {id:#x}: past the largest file or an invalid ref")]
    BadChunk { id: InodeId, chunk: u64 },
}

/// A change to the set of hosted tables that was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TableError {
    #[error("table {lo:#x}..{hi:#x} overlaps a hosted table")]
    Overlaps { lo: InodeId, hi: InodeId },
    #[error("no hosted table starts at {lo:#x}")]
    NotHosted { lo: InodeId },
    #[error("table {lo:#x} is in the {region} region; only subtree (primary) tables are split")]
    NotSubtree { lo: InodeId, region: &'static str },
    #[error("table {lo:#x} has no tree layout")]
    NoTreeLayout { lo: InodeId },
    #[error(
        "table {lo:#x} has no subtree boundary between its {inodes} inodes \
         (they are one directory's files)"
    )]
    NoBoundary { lo: InodeId, inodes: u64 },
    #[error("cannot split {lo:#x}..{hi:#x} at {at:#x}: not a box boundary inside the range")]
    NotABoxBoundary {
        lo: InodeId,
        hi: InodeId,
        at: InodeId,
    },
    #[error("directory {dir:#x}: too many names share one hash bucket")]
    BucketOverflow { dir: InodeId },
}

/// A checkpoint image that does not fit the table it is loaded into (damage, or another
/// table's image): what was wrong, for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct ImageError(pub String);

/// An id policy or table layout that cannot be built (an operator's configuration).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
