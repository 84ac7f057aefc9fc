//! File data as immutable slice objects, for a store without positioned I/O (S3): the file
//! data of a server's inodes lives in the store every host shares, so when a host fails its
//! files' next owner reads their data, and clients can put and get it themselves with
//! capabilities (issue 31, see `kochab_proto::layout`).
//!
//! What a file's chunk holds is its list of refs in the metadata (the engine's layout,
//! journaled with the table): each ref names a slice object of the file generation's folder
//! (`data/<id & 0xff>/<id>.<generation>.s/<object>`) and the extent of the chunk it holds.
//! An object is written once by conditional create and becomes part of the file only when
//! a journal record commits its ref, so nothing here lists a folder to read a file, and an
//! object whose commit never happened is never read (the garbage collector, `gc`, deletes
//! it). This module moves the bytes: it puts objects and reads byte ranges through a
//! layout the caller took from the engine; the caller commits.

use super::pieces;
use kochab_meta::Reclaim;
use kochab_proto::layout::{
    SliceRef, decode_slice_range, encode_slice, resolve_slices, slice_fetch_range, slice_folder,
    slice_object_name,
};
use kochab_proto::{CHUNK_BYTES, InodeId};
use kochab_store::ObjectStore;
use std::io::{self, ErrorKind};
use std::sync::Arc;

/// Refs a chunk may hold before it is compacted: a read of the chunk resolves at most this
/// many overlapping slices (a GET each, at worst), and sequential writes of 256 KiB or more
/// fill a chunk in at most 16, so compaction rewrites each byte about once more.
pub const COMPACT_REFS_MAX: usize = 16;

/// One ranged read of a slice: the chunk offsets `span` of ref `r`, copied out by parts.
struct Fetch {
    chunk: u64,
    r: SliceRef,
    span: (u32, u32),
    /// (chunk offsets, where in the output they go).
    parts: Vec<((u32, u32), usize)>,
}

/// Moves slice objects (see the module).
pub struct SliceStore {
    store: Arc<dyn ObjectStore>,
}

fn corrupt(name: &str, what: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("slice {name}: {what}"))
}

impl SliceStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> SliceStore {
        SliceStore { store }
    }

    /// The store the objects live in (presigned URLs, the garbage collector's listings).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Creates the object of ref `r` of `chunk` holding `data` (`r.len` bytes). Fails with
    /// `AlreadyExists` if the name is taken (the caller takes another object id).
    pub fn put(
        &self,
        id: InodeId,
        generation: u64,
        chunk: u64,
        r: &SliceRef,
        data: &[u8],
    ) -> io::Result<()> {
        if data.len() != r.len as usize || r.is_zeros() || !r.is_valid() {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("slice ref {r:?} does not describe {} bytes", data.len()),
            ));
        }
        let name = slice_object_name(id, generation, r.object);
        self.store
            .create_if_absent(&name, &encode_slice(chunk, r, data))
    }

    /// Reads the chunk offsets `[a, b)` of ref `r`: one ranged GET of the blocks that hold
    /// them, each checked. A missing object is `NotFound` (freed under the reader: it takes
    /// the layout again).
    fn read_ref(
        &self,
        id: InodeId,
        generation: u64,
        chunk: u64,
        r: &SliceRef,
        span: (u32, u32),
    ) -> io::Result<Vec<u8>> {
        let name = slice_object_name(id, generation, r.object);
        let (start, end) = slice_fetch_range(r, span);
        let got = self
            .store
            .get_range(&name, start, end - start)?
            .ok_or_else(|| io::Error::new(ErrorKind::NotFound, format!("no slice {name}")))?;
        decode_slice_range(chunk, r, span, &got).map_err(|e| corrupt(&name, &e))
    }

    /// Runs `fetches` (concurrently when there are several) and copies their parts into
    /// `out`.
    fn run_fetches(
        &self,
        id: InodeId,
        generation: u64,
        fetches: &[Fetch],
        out: &mut [u8],
    ) -> io::Result<()> {
        let fetch = |f: &Fetch| self.read_ref(id, generation, f.chunk, &f.r, f.span);
        let results: Vec<io::Result<Vec<u8>>> = if fetches.len() <= 1 {
            fetches.iter().map(fetch).collect()
        } else {
            std::thread::scope(|sc| {
                let handles: Vec<_> = fetches.iter().map(|f| sc.spawn(move || fetch(f))).collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(io::Error::other("a slice read panicked")))
                    })
                    .collect()
            })
        };
        for (f, got) in fetches.iter().zip(results) {
            let got = got?;
            for &((a, b), dst) in &f.parts {
                let from = (a - f.span.0) as usize;
                let n = (b - a) as usize;
                out[dst..dst + n].copy_from_slice(&got[from..from + n]);
            }
        }
        Ok(())
    }

    /// The reads that fill `[offset, offset + len)` of a file from its `layout` (chunks
    /// ascending, as the engine gives them; zeros parts need none: `out` starts zeroed).
    fn plan(layout: &[(u64, Vec<SliceRef>)], offset: u64, len: u64) -> Vec<Fetch> {
        let mut fetches: Vec<Fetch> = Vec::new();
        let mut dst = 0;
        for (chunk, within, n) in pieces(offset, len) {
            if let Ok(at) = layout.binary_search_by_key(&chunk, |(c, _)| *c) {
                let refs = &layout[at].1;
                let want = within as u32..(within as usize + n) as u32;
                let first = fetches.len();
                for p in resolve_slices(refs, want.clone()) {
                    let Some(r) = p.from else { continue };
                    let at = dst + (p.range.0 - want.start) as usize;
                    match fetches[first..].iter_mut().find(|f| f.r == r) {
                        Some(f) => {
                            f.span = (f.span.0.min(p.range.0), f.span.1.max(p.range.1));
                            f.parts.push((p.range, at));
                        }
                        None => fetches.push(Fetch {
                            chunk,
                            r,
                            span: p.range,
                            parts: vec![(p.range, at)],
                        }),
                    }
                }
            }
            dst += n;
        }
        fetches
    }

    /// Reads `len` bytes at `offset` through `layout` (the refs of the chunks the range
    /// touches; a chunk absent reads as zeros). The caller has cut `len` at the file's
    /// size.
    pub fn read(
        &self,
        id: InodeId,
        generation: u64,
        layout: &[(u64, Vec<SliceRef>)],
        offset: u64,
        len: u64,
    ) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        let fetches = Self::plan(layout, offset, len);
        self.run_fetches(id, generation, &fetches, &mut out)?;
        Ok(out)
    }

    /// What `refs` of `chunk` read as, from the first byte of data to the last (`None`
    /// if they hold no data): compaction's input.
    pub fn read_chunk(
        &self,
        id: InodeId,
        generation: u64,
        chunk: u64,
        refs: &[SliceRef],
    ) -> io::Result<Option<(u32, Vec<u8>)>> {
        let parts = resolve_slices(refs, 0..CHUNK_BYTES as u32);
        let mut data = parts.iter().filter(|p| p.from.is_some());
        let Some(first) = data.next() else {
            return Ok(None);
        };
        let last = data.next_back().unwrap_or(first);
        let (lo, hi) = (first.range.0, last.range.1);
        let layout = [(chunk, refs.to_vec())];
        let base = chunk * CHUNK_BYTES;
        let bytes = self.read(
            id,
            generation,
            &layout,
            base + u64::from(lo),
            u64::from(hi - lo),
        )?;
        Ok(Some((lo, bytes)))
    }

    /// Deletes objects by name (missing ones are not an error).
    pub fn delete_objects(&self, names: &[String]) -> io::Result<()> {
        self.store.delete_many(names)
    }

    /// The objects a reclaim entry deletes: every object of a removed file's folder (from
    /// 0; orphans of it too), nothing for a truncation (the engine trimmed the layout and
    /// freed the objects it dropped, deleted once that change is durable).
    pub fn reclaim_plan(&self, r: &Reclaim) -> io::Result<Vec<String>> {
        if r.from != 0 {
            return Ok(Vec::new());
        }
        self.store.list(&slice_folder(r.id, r.generation))
    }

    /// Ends a reclaim: a removed file's folder goes (a no-op on a store without folders).
    pub fn end_reclaim(&self, r: &Reclaim) -> io::Result<()> {
        if r.from == 0 {
            self.store
                .delete_folder(&slice_folder(r.id, r.generation))?;
        }
        Ok(())
    }

    /// What the store reports (an object store has no fixed size: the S3 store reports a
    /// large fixed figure, `kochab_s3store::REPORTED_CAPACITY`).
    pub fn capacity(&self) -> io::Result<kochab_store::Capacity> {
        self.store.capacity()
    }

    /// The folders of file generations in the store, by shard (`data/xx/<id>.<gen>.s`).
    pub fn list_shards(&self) -> io::Result<Vec<String>> {
        self.store.list("data")
    }

    /// Names directly under `prefix` (a shard's file folders, a folder's objects).
    pub fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        self.store.list(prefix)
    }

    /// Slice objects present in a store that lists folders (S3), for leak checks.
    pub fn count_objects(&self) -> io::Result<usize> {
        let mut n = 0;
        for shard in self.store.list("data")? {
            for name in self.store.list(&shard)? {
                n += if name.ends_with(".s") {
                    self.store.list(&name)?.len()
                } else {
                    1
                };
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
