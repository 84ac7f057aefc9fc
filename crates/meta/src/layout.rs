//! Files' chunk layouts: on an object store without positioned I/O, a regular file's data is,
//! per chunk, a list of slice refs, oldest first (see `kochab_proto::layout`). The engine
//! holds them beside the inodes (in their table), journals each changed chunk's whole new
//! list ([`Mutation::PutChunk`]) and checkpoints them; a commit appends refs, a truncation
//! trims them, and the objects no ref names any more are handed to the server to delete
//! once the change is durable. Files on a store with positioned I/O have no layout.

use crate::engine::{Engine, Fail, OpResult};
use crate::files::written;
use crate::mutation::Mutation;
use crate::table::CHUNK_COUNT_MAX;
use kochab_proto::layout::{SliceRef, push_slice};
use kochab_proto::{Attr, CHUNK_BYTES, Credentials, FILE_BYTES_MAX, InodeId, TimeNs, fs_err};
use std::collections::BTreeMap;
use std::ops::Range;

/// Refs one chunk may hold. Compaction merges a chunk past 16 refs, so this is reached
/// only if compaction cannot keep up for a long time (a chunk of 512-byte slices); it
/// bounds a chunk's journal record (about 20 bytes a ref: 160 KiB) and image record.
pub const CHUNK_REFS_MAX: usize = 8192;
/// Refs the chunks one commit touches may hold together: their records share one journal
/// record (at most 4 MiB; about 20 bytes a ref, so 2.6 MiB at most).
pub const COMMIT_REFS_MAX: usize = 128 << 10;

fn fail<T>(e: kochab_proto::FsError) -> OpResult<T> {
    Err(Fail::Fs(e))
}

/// The first byte past `r` at chunk `chunk`, if within the largest file.
fn ref_end(chunk: u64, r: &SliceRef) -> Option<u64> {
    chunk
        .checked_mul(CHUNK_BYTES)?
        .checked_add(u64::from(r.end()))
        .filter(|&e| e <= FILE_BYTES_MAX)
}

/// The data objects of `refs` (no zeros refs), each once, in order.
fn objects<'a>(refs: impl IntoIterator<Item = &'a SliceRef>) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    for r in refs {
        if !r.is_zeros() && !out.contains(&r.object) {
            out.push(r.object);
        }
    }
    out
}

impl Engine {
    /// The chunks in `chunks` of file `id` that have refs, ascending, with their refs
    /// (oldest first). Empty for a file without a layout or not hosted here.
    pub fn layout(&self, id: InodeId, chunks: Range<u64>) -> Vec<(u64, Vec<SliceRef>)> {
        let Some(l) = self.table(id).ok().and_then(|t| t.layout(id)) else {
            return Vec::new();
        };
        if chunks.start >= chunks.end {
            return Vec::new();
        }
        l.range(chunks).map(|(&c, r)| (c, r.clone())).collect()
    }

    /// The refs of chunk `chunk` of file `id`, oldest first (none if it has none).
    pub fn chunk_refs(&self, id: InodeId, chunk: u64) -> &[SliceRef] {
        self.table(id).map_or(&[], |t| t.chunk_refs(id, chunk))
    }

    /// Checks that `id` is a regular file (EISDIR, EINVAL).
    fn regular_file(&self, id: InodeId) -> OpResult<&crate::Inode> {
        let inode = self.get(id)?;
        if inode.is_dir() {
            return fail(fs_err!(EISDIR, "inode {id:#x} is a directory"));
        }
        if !inode.is_regular() {
            return fail(fs_err!(EINVAL, "inode {id:#x} is not a regular file"));
        }
        Ok(inode)
    }

    /// Commits slices written to file `id`: each `(chunk, ref)` becomes its chunk's newest
    /// ref, in the order given (`push_slice`, which drops the older refs it wholly hides),
    /// the size becomes at least `end` and the end of every ref, mtime and ctime `now`,
    /// setuid/setgid are cleared as a write clears them, and the file is marked as having
    /// data, all in one set of mutations: the inode, then one `PutChunk` per chunk touched.
    /// Returns them, the new attributes and the objects no ref names any more (to delete
    /// once the mutations are durable). EINVAL for an invalid ref, EFBIG for one past the
    /// largest file, ENOSPC for a chunk past [`CHUNK_REFS_MAX`] refs.
    pub fn commit_slices(
        &mut self,
        cred: &Credentials,
        id: InodeId,
        slices: &[(u64, SliceRef)],
        end: u64,
        now: TimeNs,
    ) -> OpResult<(Vec<Mutation>, Attr, Vec<u64>)> {
        let mut inode = self.regular_file(id)?.clone();
        if end > FILE_BYTES_MAX {
            return fail(fs_err!(
                EFBIG,
                "end {end} exceeds the largest file size {FILE_BYTES_MAX}"
            ));
        }
        let mut size = end;
        for (chunk, r) in slices {
            if !r.is_valid() {
                return fail(fs_err!(
                    EINVAL,
                    "slice ref {r:?} of chunk {chunk} is empty or leaves its chunk"
                ));
            }
            let Some(e) = ref_end(*chunk, r) else {
                return fail(fs_err!(
                    EFBIG,
                    "slice ref {r:?} of chunk {chunk} lies past the largest file size"
                ));
            };
            size = size.max(e);
        }
        let mut touched: BTreeMap<u64, Vec<SliceRef>> = BTreeMap::new();
        let mut freed = Vec::new();
        for (chunk, r) in slices {
            let refs = touched
                .entry(*chunk)
                .or_insert_with(|| self.chunk_refs(id, *chunk).to_vec());
            freed.extend(push_slice(refs, *r));
        }
        let mut total = 0;
        for (chunk, refs) in &touched {
            if refs.len() > CHUNK_REFS_MAX {
                return fail(fs_err!(
                    ENOSPC,
                    "chunk {chunk} of {id:#x} would hold {} slice refs (at most \
                     {CHUNK_REFS_MAX} until compaction merges them)",
                    refs.len()
                ));
            }
            total += refs.len();
        }
        if total > COMMIT_REFS_MAX {
            return fail(fs_err!(
                ENOSPC,
                "the chunks of this commit would hold {total} slice refs (at most \
                 {COMMIT_REFS_MAX} in one commit)"
            ));
        }
        // An object pushed, hidden and pushed again within one commit is still named.
        freed.retain(|o| {
            touched
                .values()
                .all(|refs| refs.iter().all(|r| r.object != *o))
        });
        freed.sort_unstable();
        freed.dedup();
        written(&mut inode, cred, size, now);
        inode.may_have_data = true;
        let attr = inode.attr(id);
        let mut muts = vec![Mutation::PutInode { id, inode }];
        muts.extend(touched.into_iter().map(|(chunk, refs)| Mutation::PutChunk {
            id,
            chunk,
            refs,
        }));
        self.apply_live(&muts);
        Ok((muts, attr, freed))
    }

    /// Compaction's swap: chunk `chunk` of file `id` gets the refs `new` if it still has
    /// exactly `expected` (ESTALE otherwise: a commit or truncation came between). Returns
    /// the mutation and the objects of `expected` that `new` does not name.
    pub fn replace_chunk(
        &mut self,
        id: InodeId,
        chunk: u64,
        expected: &[SliceRef],
        new: Vec<SliceRef>,
    ) -> OpResult<(Vec<Mutation>, Vec<u64>)> {
        self.regular_file(id)?;
        let current = self.chunk_refs(id, chunk);
        if current != expected {
            return fail(fs_err!(
                ESTALE,
                "chunk {chunk} of {id:#x} changed since it was read for compaction"
            ));
        }
        if let Some(r) = new.iter().find(|r| !r.is_valid()) {
            return fail(fs_err!(
                EINVAL,
                "slice ref {r:?} is empty or leaves its chunk"
            ));
        }
        if new.iter().any(|r| ref_end(chunk, r).is_none()) {
            return fail(fs_err!(
                EFBIG,
                "chunk {chunk} lies past the largest file size"
            ));
        }
        if new.len() > CHUNK_REFS_MAX {
            return fail(fs_err!(
                ENOSPC,
                "{} slice refs for one chunk (at most {CHUNK_REFS_MAX})",
                new.len()
            ));
        }
        let freed: Vec<u64> = objects(current)
            .into_iter()
            .filter(|o| new.iter().all(|r| r.object != *o))
            .collect();
        let muts = vec![Mutation::PutChunk {
            id,
            chunk,
            refs: new,
        }];
        self.apply_live(&muts);
        Ok((muts, freed))
    }

    /// Objects freed by operations since the last call (truncations through setattr, whose
    /// reply has no room for them): (inode, generation, object). The server deletes them
    /// once the records that freed them are durable.
    pub fn take_freed_objects(&mut self) -> Vec<(InodeId, u64, u64)> {
        std::mem::take(&mut self.freed_objects)
    }

    /// What truncating file `id` to `size` does to its layout: chunks wholly at or past
    /// `size` lose their refs, and the chunk holding the cut gets a zeros ref from the cut
    /// to the end of its furthest ref (if one reaches past the cut), so that growing the
    /// file again shows zeros there. Returns the mutations and the objects freed.
    pub(crate) fn trim_layout(&self, id: InodeId, size: u64) -> (Vec<Mutation>, Vec<u64>) {
        let Some(l) = self.table(id).ok().and_then(|t| t.layout(id)) else {
            return (Vec::new(), Vec::new());
        };
        let mut muts = Vec::new();
        let mut freed = Vec::new();
        let first_gone = size.div_ceil(CHUNK_BYTES);
        if l.range(first_gone..).next().is_some() {
            freed = objects(l.range(first_gone..).flat_map(|(_, r)| r));
            muts.push(Mutation::DropChunks {
                id,
                from: first_gone,
            });
        }
        let (cut_chunk, cut) = (size / CHUNK_BYTES, (size % CHUNK_BYTES) as u32);
        if cut != 0
            && let Some(refs) = l.get(&cut_chunk)
            && let Some(furthest) = refs.iter().map(|r| r.end()).max()
            && furthest > cut
        {
            let mut new = refs.clone();
            freed.extend(push_slice(
                &mut new,
                SliceRef {
                    object: 0,
                    pos: cut,
                    len: furthest - cut,
                },
            ));
            if new != *refs {
                freed.retain(|o| new.iter().all(|r| r.object != *o));
                muts.push(Mutation::PutChunk {
                    id,
                    chunk: cut_chunk,
                    refs: new,
                });
            }
        }
        freed.sort_unstable();
        freed.dedup();
        (muts, freed)
    }

    /// Layout problems for fsck: a layout of an id that is no regular file, an invalid
    /// ref, a chunk past the largest file, or data visible past the file's size.
    pub(crate) fn check_layouts(&self, problems: &mut Vec<String>) {
        for t in self.tables() {
            for (id, l) in t.iter_layouts() {
                let Some(inode) = t.inode(id).filter(|i| i.is_regular()) else {
                    problems.push(format!(
                        "inode {id:#x} has a chunk layout but is not a regular file"
                    ));
                    continue;
                };
                for (&chunk, refs) in l {
                    if chunk >= CHUNK_COUNT_MAX {
                        problems.push(format!(
                            "inode {id:#x} has refs in chunk {chunk}, past the largest file"
                        ));
                        continue;
                    }
                    if refs.is_empty() || refs.iter().any(|r| !r.is_valid()) {
                        problems.push(format!(
                            "chunk {chunk} of {id:#x} has no refs or an invalid one: {refs:?}"
                        ));
                        continue;
                    }
                    let start = chunk * CHUNK_BYTES;
                    let furthest = refs.iter().map(|r| r.end()).max().unwrap_or(0);
                    let visible_from = inode.size.saturating_sub(start).min(u64::from(furthest));
                    let past =
                        kochab_proto::layout::resolve_slices(refs, visible_from as u32..furthest);
                    if past.iter().any(|p| p.from.is_some()) {
                        problems.push(format!(
                            "chunk {chunk} of {id:#x} shows data past the file's size {}",
                            inode.size
                        ));
                    }
                }
            }
        }
    }
}
