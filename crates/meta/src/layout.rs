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
    /// the size becomes at least `end` and the end of every data ref, mtime and ctime `now`,
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
            // Zeros past the end need no size to show them: a punched or zeroed range
            // (fallocate with KEEP_SIZE) leaves the size as it was.
            if !r.is_zeros() {
                size = size.max(e);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::{Errno, Op, Reply, SetAttrs, mode};

    fn r(object: u64, pos: u32, len: u32) -> SliceRef {
        SliceRef { object, pos, len }
    }

    /// An engine with the root and one empty regular file (mode 06755, owned by 1000).
    fn with_file() -> (Engine, InodeId, Vec<Mutation>) {
        let mut e = Engine::new_cluster(crate::EngineConfig::with_key([1, 2])).unwrap();
        let mut log = e.bootstrap(1);
        for m in &log {
            e.apply(m).unwrap();
        }
        let op = Op::Mknod {
            parent: e.root(),
            name: b"f".to_vec(),
            mode: mode::S_IFREG | 0o6755,
            rdev: 0,
            exclusive: true,
        };
        let id = match e.execute(&Credentials::root(), &op, 2, &mut log) {
            Reply::Entry(a) => a.id,
            other => panic!("{other:?}"),
        };
        (e, id, log)
    }

    #[test]
    fn zeros_past_the_end_leave_the_size_as_it_was() {
        let (mut e, id, _) = with_file();
        let cred = Credentials::root();
        e.commit_slices(&cred, id, &[(0, r(7, 0, 7751))], 7751, 1)
            .unwrap_or_else(|f| panic!("{f:?}"));
        let (_, attr, _) = e
            .commit_slices(&cred, id, &[(0, r(0, 4263, 6530))], 6476, 2)
            .unwrap_or_else(|f| panic!("{f:?}"));
        assert_eq!(attr.size, 7751, "a zeros ref past the end grows nothing");
        let (_, attr, _) = e
            .commit_slices(&cred, id, &[(0, r(8, 9000, 10))], 0, 3)
            .unwrap_or_else(|f| panic!("{f:?}"));
        assert_eq!(attr.size, 9010, "a data ref past the end does");
    }

    fn user() -> Credentials {
        Credentials {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        }
    }

    fn errno<T: std::fmt::Debug>(r: OpResult<T>) -> Errno {
        match r {
            Err(Fail::Fs(e)) => e.errno,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn later_commits_win_and_hidden_objects_are_freed() {
        let (mut e, id, _) = with_file();
        let c = user();
        let (muts, attr, freed) = e
            .commit_slices(&c, id, &[(0, r(1, 0, 100)), (1, r(2, 0, 10))], 0, 5)
            .unwrap();
        assert!(freed.is_empty());
        assert_eq!(attr.size, CHUNK_BYTES + 10, "size covers every ref");
        assert_eq!((attr.mtime, attr.ctime), (5, 5));
        assert_eq!(
            attr.mode & 0o7777,
            0o755,
            "a write clears setuid and setgid"
        );
        assert!(matches!(&muts[0], Mutation::PutInode { inode, .. } if inode.may_have_data));
        assert_eq!(muts.len(), 3, "the inode and one record per chunk touched");
        // Within one commit, the later slice hides the earlier where they overlap; one
        // that hides a ref wholly frees its object.
        let (_, _, freed) = e
            .commit_slices(&c, id, &[(0, r(3, 50, 10)), (0, r(4, 0, 100))], 20, 6)
            .unwrap();
        assert_eq!(freed, vec![1, 3]);
        assert_eq!(e.chunk_refs(id, 0), &[r(4, 0, 100)]);
        assert_eq!(e.inode(id).unwrap().size, CHUNK_BYTES + 10);
        e.commit_slices(&c, id, &[(0, r(5, 10, 10))], 0, 7).unwrap();
        let parts = kochab_proto::layout::resolve_slices(e.chunk_refs(id, 0), 0..100);
        let objects: Vec<_> = parts.iter().map(|p| p.from.map(|s| s.object)).collect();
        assert_eq!(objects, vec![Some(4), Some(5), Some(4)]);
        assert_eq!(
            e.layout(id, 0..10),
            vec![
                (0, vec![r(4, 0, 100), r(5, 10, 10)]),
                (1, vec![r(2, 0, 10)])
            ]
        );
        assert_eq!(e.layout(id, 1..2).len(), 1);
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
    }

    #[test]
    fn bad_commits_are_refused_and_change_nothing() {
        let (mut e, id, _) = with_file();
        let c = user();
        assert_eq!(
            errno(e.commit_slices(&c, id, &[(0, r(1, 0, 0))], 0, 5)),
            Errno::EINVAL
        );
        let leaves = r(1, CHUNK_BYTES as u32 - 1, 2);
        assert_eq!(
            errno(e.commit_slices(&c, id, &[(0, leaves)], 0, 5)),
            Errno::EINVAL
        );
        let last = FILE_BYTES_MAX / CHUNK_BYTES;
        assert_eq!(
            errno(e.commit_slices(&c, id, &[(last, r(1, 0, CHUNK_BYTES as u32))], 0, 5)),
            Errno::EFBIG
        );
        assert_eq!(
            errno(e.commit_slices(&c, id, &[], FILE_BYTES_MAX + 1, 5)),
            Errno::EFBIG
        );
        let root = e.root();
        assert_eq!(
            errno(e.commit_slices(&c, root, &[(0, r(1, 0, 1))], 0, 5)),
            Errno::EISDIR
        );
        assert!(e.layout(id, 0..u64::MAX).is_empty());
        assert_eq!(e.inode(id).unwrap().size, 0);
        // A chunk at its ref limit takes no more.
        let many: Vec<_> = (0..CHUNK_REFS_MAX as u64)
            .map(|k| (0, r(10 + k, k as u32, 1)))
            .collect();
        e.commit_slices(&c, id, &many, 0, 6).unwrap();
        assert_eq!(
            errno(e.commit_slices(&c, id, &[(0, r(1, 9000, 1))], 0, 7)),
            Errno::ENOSPC
        );
    }

    #[test]
    fn truncation_trims_the_layout_and_zeros_what_it_cut() {
        let (mut e, id, _) = with_file();
        let c = user();
        e.commit_slices(
            &c,
            id,
            &[
                (0, r(1, 0, 1000)),
                (0, r(2, 2000, 1000)),
                (1, r(3, 0, 10)),
                (7, r(4, 0, 10)),
            ],
            0,
            5,
        )
        .unwrap();
        let truncate = |e: &mut Engine, size: u64| {
            let mut out = Vec::new();
            let op = Op::SetAttr {
                id,
                set: SetAttrs {
                    size: Some(size),
                    ..Default::default()
                },
            };
            let r = e.execute(&Credentials::root(), &op, 9, &mut out);
            assert!(matches!(r, Reply::Attr(_)), "{r:?}");
            out
        };
        let out = truncate(&mut e, 500);
        // The reclaim entry stays as on any store; chunks past the cut go in one record.
        assert!(
            out.iter()
                .any(|m| matches!(m, Mutation::PutReclaim { from: 500, .. }))
        );
        assert!(out.contains(&Mutation::DropChunks { id, from: 1 }));
        assert_eq!(e.chunk_refs(id, 0), &[r(1, 0, 1000), r(0, 500, 2500)]);
        let generation = e.inode(id).unwrap().btime as u64;
        let mut freed = e.take_freed_objects();
        freed.sort_unstable();
        assert_eq!(
            freed,
            vec![
                (id, generation, 2),
                (id, generation, 3),
                (id, generation, 4)
            ]
        );
        assert!(e.take_freed_objects().is_empty());
        // Growing again shows zeros past the old cut.
        let grow = truncate(&mut e, 4000);
        assert!(!grow.iter().any(|m| matches!(m, Mutation::PutChunk { .. })));
        let parts = kochab_proto::layout::resolve_slices(e.chunk_refs(id, 0), 0..4000);
        assert_eq!(parts[0].range, (0, 500));
        assert!(parts[1..].iter().all(|p| p.from.is_none()));
        // The same cut again changes no chunk.
        truncate(&mut e, 500);
        assert_eq!(e.chunk_refs(id, 0), &[r(1, 0, 1000), r(0, 500, 2500)]);
        assert!(e.take_freed_objects().is_empty());
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
        truncate(&mut e, 0);
        assert!(e.layout(id, 0..u64::MAX).is_empty());
        assert_eq!(e.take_freed_objects(), vec![(id, generation, 1)]);
    }

    #[test]
    fn replaying_the_records_twice_gives_the_same_layout() {
        let (mut e, id, mut log) = with_file();
        let c = user();
        for (k, chunk) in [0u64, 3, 0, 5, 3].into_iter().enumerate() {
            let k = k as u64;
            let (muts, _, _) = e
                .commit_slices(&c, id, &[(chunk, r(k + 1, k as u32 * 7, 100))], 0, 5)
                .unwrap();
            log.extend(muts);
        }
        let op = Op::SetAttr {
            id,
            set: SetAttrs {
                size: Some(3 * CHUNK_BYTES + 50),
                ..Default::default()
            },
        };
        let reply = e.execute(&Credentials::root(), &op, 9, &mut log);
        assert!(matches!(reply, Reply::Attr(_)), "{reply:?}");
        let expected = e.chunk_refs(id, 0).to_owned();
        let (muts, freed) = e
            .replace_chunk(id, 0, &expected, vec![r(99, 0, 200)])
            .unwrap();
        assert_eq!(freed, vec![1, 3]);
        log.extend(muts);
        let mut again = Engine::new_cluster(crate::EngineConfig::with_key([1, 2])).unwrap();
        for m in log.iter().chain(log.iter()) {
            again.apply(m).unwrap();
        }
        assert_eq!(again.layout(id, 0..u64::MAX), e.layout(id, 0..u64::MAX));
        assert_eq!(
            e.layout(id, 0..u64::MAX),
            vec![
                (0, vec![r(99, 0, 200)]),
                (3, vec![r(2, 7, 100), r(5, 28, 100), r(0, 50, 78)])
            ]
        );
        // A swap against refs that changed meanwhile is refused.
        assert_eq!(
            errno(e.replace_chunk(id, 3, &[r(2, 7, 100)], vec![])),
            Errno::ESTALE
        );
        // The file's removal takes its layout with it.
        let mut out = Vec::new();
        let unlink = Op::Unlink {
            parent: e.root(),
            name: b"f".to_vec(),
        };
        e.execute(&Credentials::root(), &unlink, 10, &mut out);
        assert!(e.layout(id, 0..u64::MAX).is_empty());
        assert!(e.tables().iter().all(|t| t.iter_layouts().next().is_none()));
    }

    #[test]
    fn a_split_table_keeps_each_file_s_layout_with_its_inode() {
        let (mut e, id, _) = with_file();
        e.commit_slices(&user(), id, &[(2, r(1, 0, 10))], 0, 5)
            .unwrap();
        let i = e.table_index(id).unwrap();
        let lo = e.tables()[i].lo;
        let at = ((id >> crate::table::BOX_SHIFT) + 1) << crate::table::BOX_SHIFT;
        e.split_table(lo, at).unwrap();
        assert_eq!(e.chunk_refs(id, 2), &[r(1, 0, 10)]);
        let upper = &e.tables()[e.table_index(at).unwrap()];
        assert!(upper.iter_layouts().next().is_none());
        // And on the other side of a split below it.
        let mut e2 = with_file().0;
        e2.commit_slices(&user(), id, &[(2, r(1, 0, 10))], 0, 5)
            .unwrap();
        let at = (id >> crate::table::BOX_SHIFT) << crate::table::BOX_SHIFT;
        if at > lo {
            e2.split_table(lo, at).unwrap();
            let t = &e2.tables()[e2.table_index(id).unwrap()];
            assert_eq!(t.lo, at);
            assert_eq!(t.chunk_refs(id, 2), &[r(1, 0, 10)]);
            assert!(
                e2.tables()[e2.table_index(lo).unwrap()]
                    .iter_layouts()
                    .next()
                    .is_none()
            );
        }
    }

    #[test]
    fn fsck_reports_a_layout_on_a_directory() {
        let (mut e, _, _) = with_file();
        let root = e.root();
        e.apply(&Mutation::PutChunk {
            id: root,
            chunk: 0,
            refs: vec![r(1, 0, 1)],
        })
        .unwrap();
        let problems = e.check_invariants();
        assert!(
            problems.iter().any(|p| p.contains("not a regular file")),
            "{problems:?}"
        );
        assert!(
            e.apply(&Mutation::PutChunk {
                id: root,
                chunk: 0,
                refs: vec![r(1, 0, 0)],
            })
            .is_err(),
            "an invalid ref in a record is damage"
        );
    }
}
