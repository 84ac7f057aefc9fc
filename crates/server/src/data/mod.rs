//! File data in the object store, cut into chunks of `CHUNK_BYTES` and named by (inode,
//! file generation, chunk), so that a reused inode id never sees an old file's data. Two
//! layouts, chosen by what the store can do ([`ObjectStore::positioned_io`]):
//!
//! - [`local`]: a store with positioned I/O (the local directory, the embedded default)
//!   keeps each chunk as one object written in place.
//! - [`slices`]: a store of whole objects (S3) keeps each chunk as a list of refs to
//!   immutable slice objects in the metadata (the engine's layout), so that file data lives
//!   in the shared store, a file's next owner (another host) reads it, and clients can move
//!   it themselves. The data operations for it are in `filesvc`: they take the layout from
//!   the engine and commit refs there; [`SliceStore`] moves the bytes.
//!
//! Missing chunks and bytes never written read as zeros in both.

pub mod local;
pub mod slices;

pub use local::{ChunkKey, ChunkStore, chunk_name, file_folder};
pub use slices::SliceStore;

use kochab_meta::Reclaim;
use kochab_proto::{CHUNK_BYTES, InodeId};
use kochab_store::ObjectStore;
use std::io;
use std::ops::RangeInclusive;
use std::sync::Arc;

/// The chunks `[first, last]` that a byte range `[offset, offset + len)` touches (its
/// first chunk if `len` is 0).
pub fn chunk_span(offset: u64, len: u64) -> RangeInclusive<u64> {
    let last = offset.saturating_add(len.max(1) - 1);
    offset / CHUNK_BYTES..=last / CHUNK_BYTES
}

/// A byte range cut into consecutive parts of at most `chunks_max` whole chunks each (the
/// first and last may be partial), so that work over a long range can be done in bounded
/// calls.
pub fn chunk_batches(offset: u64, len: u64, chunks_max: u64) -> impl Iterator<Item = (u64, u64)> {
    let step = chunks_max.max(1).saturating_mul(CHUNK_BYTES);
    let end = offset.saturating_add(len);
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let boundary = (pos / step).saturating_add(1).saturating_mul(step);
        let next = boundary.min(end);
        let part = (pos, next - pos);
        pos = next;
        Some(part)
    })
}

/// The pieces of a byte range, chunk by chunk: (chunk, offset in chunk, length).
pub(crate) fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, usize)> {
    let mut pos = offset;
    let end = offset.saturating_add(len);
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let chunk = pos / CHUNK_BYTES;
        let within = pos % CHUNK_BYTES;
        let n = (CHUNK_BYTES - within).min(end - pos);
        pos += n;
        Some((chunk, within, n as usize))
    })
}

/// What a reclaim entry deletes, once the chunk holding its cut is cut.
#[derive(Default)]
pub struct ReclaimPlan {
    /// Chunks to delete, ascending (chunks in place).
    pub chunks: Vec<u64>,
    /// Slice objects to delete by name (a removed file's folder on S3).
    pub objects: Vec<String>,
}

fn needs_layout(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{what} of slice objects goes through the file's layout"),
    )
}

/// Reads and writes file data in the layout the store calls for (see the module).
pub enum DataStore {
    Chunks(ChunkStore),
    Slices(SliceStore),
}

impl DataStore {
    /// A data store over `store`'s `data/` folder: chunks in place if it has positioned
    /// I/O, immutable slices otherwise.
    pub fn new(store: Arc<dyn ObjectStore>) -> DataStore {
        if store.positioned_io() {
            DataStore::Chunks(ChunkStore::new(store))
        } else {
            DataStore::Slices(SliceStore::new(store))
        }
    }

    /// Chunks of a generation that hold data, ascending.
    pub fn existing_chunks(
        &self,
        id: InodeId,
        generation: u64,
        span: RangeInclusive<u64>,
    ) -> io::Result<Vec<u64>> {
        match self {
            DataStore::Chunks(c) => c.existing_chunks(id, generation, span),
            DataStore::Slices(_) => Err(needs_layout("listing chunks")),
        }
    }

    /// Reads `len` bytes at `offset` of a file of `size` bytes (short at the end).
    pub fn read(
        &self,
        id: InodeId,
        generation: u64,
        size: u64,
        offset: u64,
        len: u32,
    ) -> io::Result<Vec<u8>> {
        match self {
            DataStore::Chunks(c) => c.read(id, generation, size, offset, len),
            DataStore::Slices(_) => Err(needs_layout("a read")),
        }
    }

    /// Writes `data` at `offset`. The caller has made the file's "may have data" mark
    /// durable first. On a store of whole objects the data is durable when this returns.
    pub fn write(&self, id: InodeId, generation: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.write(id, generation, offset, data),
            DataStore::Slices(_) => Err(needs_layout("a write")),
        }
    }

    /// The slice store, if file data is slice objects.
    pub fn slices(&self) -> Option<&SliceStore> {
        match self {
            DataStore::Slices(s) => Some(s),
            DataStore::Chunks(_) => None,
        }
    }

    /// Reserves the space of `[offset, offset + len)` (see [`ChunkStore::allocate`]). An
    /// object store has nothing to reserve: a no-op there.
    pub fn allocate(&self, id: InodeId, generation: u64, offset: u64, len: u64) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.allocate(id, generation, offset, len),
            DataStore::Slices(_) => Ok(()),
        }
    }

    /// Space in the store that holds file data (what statfs reports).
    pub fn capacity(&self) -> io::Result<kochab_store::Capacity> {
        match self {
            DataStore::Chunks(c) => c.capacity(),
            DataStore::Slices(s) => s.capacity(),
        }
    }

    /// Fails with ENOSPC if reserving the range surely cannot succeed (see
    /// [`ChunkStore::check_space`]); an object store reports no limit.
    pub fn check_space(
        &self,
        id: InodeId,
        generation: u64,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.check_space(id, generation, offset, len),
            DataStore::Slices(_) => Ok(()),
        }
    }

    /// Makes `[offset, offset + len)` read as zeros in `chunks` (from `existing_chunks`).
    /// The caller holds the file's exclusive lock.
    pub fn zero(
        &self,
        id: InodeId,
        generation: u64,
        offset: u64,
        len: u64,
        keep_allocated: bool,
        chunks: &[u64],
    ) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.zero(id, generation, offset, len, keep_allocated, chunks),
            DataStore::Slices(_) => Err(needs_layout("zeroing")),
        }
    }

    /// Makes the file generation's written data durable (see [`ChunkStore::sync`]). Slices
    /// are durable when their write returns: nothing to do.
    pub fn sync(&self, id: InodeId, generation: u64) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.sync(id, generation),
            DataStore::Slices(_) => Ok(()),
        }
    }

    /// Starts a reclaim: cuts the chunk holding `r.from` there and lists the chunks to
    /// delete. Idempotent.
    pub fn reclaim_plan(&self, r: &Reclaim) -> io::Result<ReclaimPlan> {
        match self {
            DataStore::Chunks(c) => c.reclaim_plan(r),
            DataStore::Slices(s) => Ok(ReclaimPlan {
                chunks: Vec::new(),
                objects: s.reclaim_plan(r)?,
            }),
        }
    }

    /// Deletes some of a reclaim plan's chunks (callers bound each call).
    pub fn delete_chunks(&self, id: InodeId, generation: u64, chunks: &[u64]) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.delete_chunks(id, generation, chunks),
            DataStore::Slices(_) => {
                let _ = (id, generation, chunks);
                Err(needs_layout("deleting chunks"))
            }
        }
    }

    /// Deletes some of a reclaim plan's objects (callers bound each call).
    pub fn delete_objects(&self, names: &[String]) -> io::Result<()> {
        match self {
            DataStore::Slices(s) => s.delete_objects(names),
            DataStore::Chunks(_) => Ok(()),
        }
    }

    /// Ends a reclaim whose plan's chunks are all deleted.
    pub fn end_reclaim(&self, r: &Reclaim) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.end_reclaim(r),
            DataStore::Slices(s) => s.end_reclaim(r),
        }
    }

    /// The folder whose sync makes a reclaim's deletions durable (a no-op to sync on a
    /// store whose deletions are durable when they return).
    pub fn durable_dir(r: &Reclaim) -> String {
        ChunkStore::durable_dir(r)
    }

    /// Syncs folders named by `durable_dir` (each once).
    pub fn sync_dirs<'a>(&self, dirs: impl IntoIterator<Item = &'a String>) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.sync_dirs(dirs),
            DataStore::Slices(_) => Ok(()),
        }
    }

    /// Deletes a reclaim entry's data in one call, durably (tests and small files).
    pub fn reclaim(&self, r: &Reclaim) -> io::Result<()> {
        match self {
            DataStore::Chunks(c) => c.reclaim(r),
            DataStore::Slices(s) => {
                s.delete_objects(&s.reclaim_plan(r)?)?;
                s.end_reclaim(r)
            }
        }
    }

    /// Data objects present in the store (for leak checks in tests and fsck).
    pub fn count_objects(&self) -> io::Result<usize> {
        match self {
            DataStore::Chunks(c) => c.count_objects(),
            DataStore::Slices(s) => s.count_objects(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::FILE_BYTES_MAX;

    #[test]
    fn batches_cover_a_range_in_bounded_parts() {
        let parts: Vec<_> = chunk_batches(CHUNK_BYTES - 1, 3 * CHUNK_BYTES + 2, 2).collect();
        assert_eq!(
            parts,
            vec![
                (CHUNK_BYTES - 1, 1 + CHUNK_BYTES),
                (2 * CHUNK_BYTES, CHUNK_BYTES * 2),
                (4 * CHUNK_BYTES, 1)
            ]
        );
        assert_eq!(chunk_batches(FILE_BYTES_MAX - 1, 1, 256).count(), 1);
        assert_eq!(chunk_span(FILE_BYTES_MAX - 1, 1), {
            let c = (FILE_BYTES_MAX - 1) / CHUNK_BYTES;
            c..=c
        });
    }
}
