//! The metadata part of a data operation, as a step ([`crate::step::Event::Data`]). The
//! shell (`filesvc`) does the file's data I/O around it and tells the core what landed; the
//! core checks the handle's file, changes the inode, journals, and says what the reply
//! waits for.

use crate::clock::Now;
use crate::core::Core;
use crate::data::slices::COMPACT_REFS_MAX;
use crate::session::OpenFile;
use kochab_meta::Mutation;
use kochab_proto::layout::SliceRef;
use kochab_proto::*;

/// Who writes, and how the reply is wanted.
pub struct WriteReq<'a> {
    pub cred: &'a Credentials,
    /// The request's sequence number (0: none). An append has one, and so does a write
    /// answered early: a retry or a replay of one already done is answered, not run again.
    pub seq: u64,
    pub mode: ReplyMode,
}

/// An engine failure as the client's error.
pub(crate) fn fail(f: kochab_meta::Fail) -> FsError {
    match f {
        kochab_meta::Fail::Fs(e) => e,
        kochab_meta::Fail::NotHosted(id) => kochab_meta::not_in_any_table(id),
    }
}

/// Checks that the handle's file is still the same generation (ids are reused).
pub(crate) fn current_generation(core: &Core, of: &OpenFile) -> Result<(), FsError> {
    match core.engine.inode(of.id) {
        Some(i) if i.btime as u64 == of.generation => Ok(()),
        _ => Err(fs_err!(ESTALE, "the file of this handle is gone")),
    }
}

/// What landed, or is to change, of an open file.
pub enum DataChange<'a> {
    /// A read of `of` ended: its access time as `atime` says.
    Read { of: OpenFile, atime: AtimeRule },
    /// A write of `of` landed, its file now at least `end` long. `append`: the handle and
    /// sequence number of an append, whose retry is answered from here.
    Written {
        how: &'a WriteReq<'a>,
        of: OpenFile,
        end: u64,
        append: Option<(u64, u64)>,
    },
    /// An append through `handle` (request `seq`) was answered with `attr` (a retry gets
    /// the same).
    Appended { handle: u64, seq: u64, attr: Attr },
    /// `of` is about to get its first data object: marked so, durably, first.
    MarkData { of: OpenFile },
    /// A fallocate of `of` ended, the range up to `end`; `keep_size` as asked; `rewrote`:
    /// it punched or zeroed (the file changed whatever its size).
    Fallocated {
        cred: &'a Credentials,
        of: OpenFile,
        end: u64,
        keep_size: bool,
        rewrote: bool,
    },
    /// A truncation (a setattr with a size), run as the request says; the slice objects it
    /// dropped go once it is durable.
    Truncate { req: &'a Request },
    /// Slices of `of` put by the client (or by the server for a write) become its refs, the
    /// file at least `end` long. `verify`: checks the client's commit tokens, run under
    /// the lock right before the commit (so the collector's wait past their expiry is
    /// enough, see `gc`).
    SlicesCommitted {
        how: &'a WriteReq<'a>,
        of: OpenFile,
        refs: &'a [(u64, SliceRef)],
        end: u64,
        verify: Option<&'a (dyn Fn() -> Result<(), FsError> + Sync)>,
    },
    /// A hole punched or a range zeroed on slices: a zeros ref over the part of each chunk
    /// in the range that holds refs (the caller holds the file's exclusive lock).
    ZeroSlices {
        cred: &'a Credentials,
        of: OpenFile,
        offset: u64,
        len: u64,
    },
    /// A compaction's object replaces the refs `expected` of a chunk (ESTALE: they
    /// changed, or the file is gone).
    ChunkCompacted {
        id: InodeId,
        generation: u64,
        chunk: u64,
        expected: &'a [SliceRef],
        new: Vec<SliceRef>,
    },
    /// Objects the engine freed outside a commit (truncations): queued for deletion once
    /// what freed them is durable.
    TakeFreed,
}

/// What a data step answers.
#[derive(Debug)]
pub enum DataDone {
    /// A read: the LSN its reply waits for (what it observed), and whether the access time
    /// was set.
    Read { observed: u64, atime_set: bool },
    /// A write: the file's attributes, its record's LSN, and whether an early reply must
    /// wait for that record (it depended on another session's change not yet durable).
    Written {
        attr: Attr,
        lsn: u64,
        depended: bool,
    },
    /// A record's LSN (0: nothing journaled).
    Lsn(u64),
    /// A truncation's reply.
    Reply(Reply),
    /// Noted.
    Noted,
}

impl Core {
    /// Runs one data step for `client` at `now`.
    pub(crate) fn data_change(
        &mut self,
        client: u64,
        change: DataChange<'_>,
        now: Now,
    ) -> Result<DataDone, FsError> {
        match change {
            DataChange::Read { of, atime } => {
                let atime_set = self.engine.touch_atime(of.id, atime, now.wall);
                Ok(DataDone::Read {
                    observed: self.observed(of.id),
                    atime_set,
                })
            }
            DataChange::Written {
                how,
                of,
                end,
                append,
            } => {
                current_generation(self, &of)?;
                let (muts, attr) = self
                    .engine
                    .write_done(how.cred, of.id, end, now.wall)
                    .map_err(fail)?;
                let (lsn, depended) = self.journal_write(client, how, of.id, &muts, now);
                if let Some((handle, seq)) = append {
                    self.appended.insert((client, handle), (seq, attr.clone()));
                }
                Ok(DataDone::Written {
                    attr,
                    lsn,
                    depended,
                })
            }
            DataChange::Appended { handle, seq, attr } => {
                self.appended.insert((client, handle), (seq, attr));
                Ok(DataDone::Noted)
            }
            DataChange::MarkData { of } => {
                current_generation(self, &of)?;
                let muts = self.engine.mark_data(of.id).map_err(fail)?;
                Ok(DataDone::Lsn(self.journal_change(client, &muts, now)))
            }
            DataChange::Fallocated {
                cred,
                of,
                end,
                keep_size,
                rewrote,
            } => {
                current_generation(self, &of)?;
                let size = self.engine.inode(of.id).map_or(0, |i| i.size);
                let new_end = if keep_size || end <= size { size } else { end };
                if !rewrote && new_end == size {
                    return Ok(DataDone::Lsn(0));
                }
                let (muts, _) = self
                    .engine
                    .write_done(cred, of.id, new_end, now.wall)
                    .map_err(fail)?;
                Ok(DataDone::Lsn(self.journal_change(client, &muts, now)))
            }
            DataChange::Truncate { req } => {
                let reply = self.execute_one(client, req, now);
                self.take_freed();
                // Its reply waits for the flush started now.
                self.flush_soon();
                Ok(DataDone::Reply(reply))
            }
            DataChange::SlicesCommitted {
                how,
                of,
                refs,
                end,
                verify,
            } => {
                current_generation(self, &of)?;
                if let Some(verify) = verify {
                    verify()?;
                }
                let (muts, attr, freed) = self
                    .engine
                    .commit_slices(how.cred, of.id, refs, end, now.wall)
                    .map_err(fail)?;
                let (lsn, depended) = self.journal_write(client, how, of.id, &muts, now);
                self.after_commit(&of, refs, freed, lsn);
                Ok(DataDone::Written {
                    attr,
                    lsn,
                    depended,
                })
            }
            DataChange::ZeroSlices {
                cred,
                of,
                offset,
                len,
            } => {
                current_generation(self, &of)?;
                self.zero_slices(client, cred, &of, offset, len, now)?;
                Ok(DataDone::Noted)
            }
            DataChange::ChunkCompacted {
                id,
                generation,
                chunk,
                expected,
                new,
            } => {
                match self.engine.inode(id) {
                    Some(i) if i.btime as u64 == generation => {}
                    _ => return Err(fs_err!(ESTALE, "the file is gone")),
                }
                let (muts, freed) = self
                    .engine
                    .replace_chunk(id, chunk, expected, new)
                    .map_err(fail)?;
                let lsn = self.journal_change(0, &muts, now);
                let lsn = if lsn == 0 { self.last_lsn() } else { lsn };
                self.out.frees.push((lsn, id, generation, freed));
                Ok(DataDone::Noted)
            }
            DataChange::TakeFreed => {
                self.take_freed();
                Ok(DataDone::Noted)
            }
        }
    }

    /// Queues the objects the engine freed outside a commit for deletion once the record
    /// that freed them (the last one numbered) is durable.
    fn take_freed(&mut self) {
        let freed = self.engine.take_freed_objects();
        if freed.is_empty() {
            return;
        }
        let lsn = self.last_lsn();
        for (id, generation, object) in freed {
            self.out.frees.push((lsn, id, generation, vec![object]));
        }
    }

    /// After refs were committed by record `lsn`: the objects they hid are queued for
    /// deletion, and chunks with too many refs for compaction.
    fn after_commit(&mut self, of: &OpenFile, refs: &[(u64, SliceRef)], freed: Vec<u64>, lsn: u64) {
        // No record (nothing changed): what was freed is free now.
        let lsn = if lsn == 0 { self.last_lsn() } else { lsn };
        if !freed.is_empty() {
            self.out.frees.push((lsn, of.id, of.generation, freed));
        }
        let mut last = None;
        for &(chunk, _) in refs {
            if last == Some(chunk) {
                continue;
            }
            last = Some(chunk);
            if self.engine.chunk_refs(of.id, chunk).len() > COMPACT_REFS_MAX {
                self.out.compact.push((of.id, of.generation, chunk));
            }
        }
    }

    /// Zeros `offset..offset + len` of `of` on slices (see [`DataChange::ZeroSlices`]).
    fn zero_slices(
        &mut self,
        client: u64,
        cred: &Credentials,
        of: &OpenFile,
        offset: u64,
        len: u64,
        now: Now,
    ) -> Result<(), FsError> {
        let end = offset.saturating_add(len);
        let span = crate::data::chunk_span(offset, len);
        let span = *span.start()..span.end().saturating_add(1);
        let mut zeros = Vec::new();
        for (chunk, refs) in self.engine.layout(of.id, span) {
            let lo = chunk * CHUNK_BYTES;
            let from = (offset.max(lo) - lo) as u32;
            let to = (end.min(lo + CHUNK_BYTES) - lo) as u32;
            // Past the last byte any ref covers, the chunk reads as zeros already.
            let covered = refs.iter().map(SliceRef::end).max().unwrap_or(0);
            let to = to.min(covered);
            if from < to {
                zeros.push((
                    chunk,
                    SliceRef {
                        object: 0,
                        pos: from,
                        len: to - from,
                    },
                ));
            }
        }
        for batch in zeros.chunks(COMMIT_SLICES_MAX) {
            let (muts, _, freed) = self
                .engine
                .commit_slices(cred, of.id, batch, 0, now.wall)
                .map_err(fail)?;
            let lsn = self.journal_change(client, &muts, now);
            self.after_commit(of, batch, freed, lsn);
        }
        Ok(())
    }

    /// Journals a write's change (`muts`: size and times, or committed refs) as one record
    /// of `client`; returns its LSN (0: nothing to journal).
    ///
    /// Rule: a write with a sequence number (answered early, or an append) is journaled
    /// with it and enters the reply cache, so that a retry or a replay of it, after a crash
    /// too, is answered and not run again (an append run twice adds its bytes twice). One
    /// answered durably is flushed now, and its reply does not wait (a write is not durable
    /// before fsync anyway); one answered early goes with the next flush. Returns the
    /// record's LSN (0: none) and whether an early reply must wait for it.
    pub(crate) fn journal_write(
        &mut self,
        client: u64,
        how: &WriteReq<'_>,
        id: InodeId,
        muts: &[Mutation],
        now: Now,
    ) -> (u64, bool) {
        if how.mode == ReplyMode::Durable && how.seq == 0 {
            return (self.journal_change(client, muts, now), false);
        }
        let lsn = self.append(client, how.seq, 0, Some(id), muts);
        let depended = self.journaled(client, muts, lsn, now.durable, now.instant);
        if how.seq != 0 {
            self.replies.insert(client, how.seq, Some(id));
        }
        if how.mode == ReplyMode::Durable {
            self.flush_soon();
        }
        // An early reply to a write that depended on another session's change not yet
        // durable waits for its record instead (see `unsettled`).
        (lsn, how.mode != ReplyMode::Durable && depended != 0)
    }
}
