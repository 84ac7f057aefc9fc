//! The metadata part of a data operation, as a step ([`crate::step::Event::Data`]). The
//! shell (`filesvc`) does the file's data I/O around it and tells the core what landed; the
//! core checks the handle's file, changes the inode, journals, and says what the reply
//! waits for.

use crate::core::Core;
use crate::fileaccess::{WriteReq, current_generation, fail};
use crate::session::OpenFile;
use crate::step::Now;
use kochab_meta::Mutation;
use kochab_proto::*;

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
    /// A truncation (a setattr with a size), run as the request says.
    Truncate { req: &'a Request },
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
                // Its reply waits for the flush started now.
                self.flush_soon();
                Ok(DataDone::Reply(reply))
            }
        }
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
