//! The file service: the data path.
//!
//! Session operations (open, create, close, locks) run inside a batch under the core lock
//! like any metadata operation (`opens`). Data operations (read, write, fsync, fallocate, and
//! truncation) run as their own tasks: the core lock is taken only for the metadata part,
//! the chunk I/O runs on the blocking pool in bounded calls, and the file's own data lock
//! (`filelocks`) orders writes against truncation, so that a truncation's data trim can
//! never destroy a later write and only that file waits for it.

use crate::data::chunk_batches;
use crate::datapass::{DataChange, DataDone, WriteReq};
use crate::fileaccess::{
    DATA_BATCH_CHUNKS, blocking, end_within_limit, lock_file, run_reclaim, write_done_before,
};
use crate::session::OpenFile;
use crate::shared::Shared;
use kochab_breaks::Break;
use kochab_meta::files::{reads, writes};
use kochab_proto::*;
use std::sync::Arc;

/// Largest read or write in one request (a FUSE request is at most 1 MiB).
pub const IO_MAX: usize = 4 << 20;
/// fallocate(2) modes served.
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// True for operations served by [`data_op`] rather than in a batch.
pub fn is_data_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Read { .. }
            | Op::Write { .. }
            | Op::Fsync { .. }
            | Op::Fallocate { .. }
            | Op::DataGrant { .. }
            | Op::CommitSlices { .. }
            | Op::Layout { .. }
    ) || matches!(op, Op::SetAttr { set, .. } if set.size.is_some())
}

impl Shared {
    /// The open handle `handle` of `client`, checked for the access it needs.
    pub(crate) fn handle(
        &self,
        client: u64,
        handle: u64,
        need_write: bool,
    ) -> Result<OpenFile, FsError> {
        let core = self.core();
        let of = core.sessions.get(client, handle).ok_or_else(|| {
            fs_err!(
                EBADF,
                "unknown file handle {handle} (closed, or the server restarted)"
            )
        })?;
        let ok = if need_write {
            writes(of.flags)
        } else {
            reads(of.flags)
        };
        if !ok {
            return Err(fs_err!(
                EBADF,
                "handle {handle} is not open for {}",
                if need_write { "writing" } else { "reading" }
            ));
        }
        Ok(of)
    }
}

/// A data step answered with another kind of answer than the change it was given (a bug).
fn unexpected(what: &str) -> FsError {
    fs_err!(EIO, "the core answered a {what} with something else")
}

/// True for the data operations that wait out a replay window: anything but a replay, a
/// read, an fsync, a grant or a layout (see [`data_op`]).
pub fn data_waits_for_replays(req: &Request) -> bool {
    !matches!(req.mode, ReplyMode::Replay { .. })
        && !matches!(
            req.op,
            Op::Read { .. } | Op::Fsync { .. } | Op::DataGrant { .. } | Op::Layout { .. }
        )
}

/// Runs one data operation of a session of client key `key_id`; returns the reply and the
/// LSN that must be durable first.
pub async fn data_op(shared: Arc<Shared>, client: u64, key_id: u32, req: Request) -> (Reply, u64) {
    // After a crash, as for the metadata changes (conn.rs): a new write, truncation or
    // fallocate waits out the replay window, so that a client's replayed write cannot
    // land after (and undo) a newer change to the same bytes.
    if data_waits_for_replays(&req) {
        let left = shared.replay_window().left();
        if !left.is_zero() {
            tokio::time::sleep(left).await;
        }
    }
    // What others may hold back of the file is sent before it is read, truncated or
    // appended to (a plain write needs nothing: overlapping writes of two clients land in
    // the order they reach the server, and a writer's own flush is made of plain writes).
    let sees = match req.op {
        Op::Read { handle, .. } | Op::Fallocate { handle, .. } | Op::Layout { handle, .. } => {
            Some(handle)
        }
        Op::Write { handle, offset, .. } if offset == WRITE_AT_END => Some(handle),
        _ => None,
    };
    let seen = match (sees, &req.op) {
        (Some(handle), _) => shared.core().sessions.get(client, handle).map(|of| of.id),
        (None, Op::SetAttr { id, .. }) => Some(*id),
        _ => None,
    };
    if let Some(id) = seen {
        shared.wait_flushes(client, &[id]).await;
    }
    match run_data_op(&shared, client, key_id, req).await {
        Ok(r) => r,
        Err(e) => (Reply::Error(e), 0),
    }
}

async fn run_data_op(
    shared: &Arc<Shared>,
    client: u64,
    key_id: u32,
    req: Request,
) -> Result<(Reply, u64), FsError> {
    match req.op {
        Op::Read {
            handle,
            offset,
            len,
            atime,
        } => {
            let of = shared.handle(client, handle, false)?;
            let (_file, file) = lock_file(shared, &of, false).await?;
            let size = file.size;
            let len = (len as usize).min(IO_MAX) as u32;
            let bytes = if shared.data().slices().is_some() {
                crate::slicesvc::read(shared, &of, size, offset, len).await?
            } else {
                let data = shared.data().clone();
                blocking("read", move || {
                    data.read(of.id, of.generation, size, offset, len)
                })
                .await?
            };
            let DataDone::Read {
                observed,
                atime_set,
            } = shared.data_step(client, DataChange::Read { of, atime })?
            else {
                return Err(unexpected("read"));
            };
            if atime_set {
                Ok((Reply::ReadAtime(bytes), observed))
            } else {
                Ok((Reply::Bytes(bytes), observed))
            }
        }
        Op::Write {
            handle,
            offset,
            data: bytes,
        } => {
            let how = WriteReq {
                cred: &req.cred,
                seq: req.seq,
                mode: req.mode,
            };
            write(shared, client, how, handle, offset, bytes).await
        }
        Op::DataGrant { handle, objects } => {
            crate::slicesvc::grant(shared, client, key_id, handle, objects).await
        }
        Op::CommitSlices {
            handle,
            slices,
            end,
        } => {
            let how = WriteReq {
                cred: &req.cred,
                seq: req.seq,
                mode: req.mode,
            };
            crate::slicesvc::commit(shared, client, key_id, how, handle, slices, end).await
        }
        Op::Layout {
            handle,
            first_chunk,
            chunks,
        } => crate::slicesvc::layout(shared, client, handle, first_chunk, chunks).await,
        Op::Fsync { handle, .. } => {
            let of = shared
                .core()
                .sessions
                .get(client, handle)
                .ok_or_else(|| fs_err!(EBADF, "unknown file handle {handle}"))?;
            let data = shared.data().clone();
            blocking("fsync", move || data.sync(of.id, of.generation)).await?;
            // Everything before it, early replies' records included, flushed now.
            shared.journal().flush_now();
            Ok((Reply::Empty, shared.journal().last_lsn()))
        }
        Op::Fallocate {
            handle,
            offset,
            len,
            mode,
        } => fallocate(shared, client, &req.cred, handle, offset, len, mode).await,
        Op::SetAttr { id, ref set } if set.size.is_some() => {
            // Truncation: no write of this file may run between the size change and the
            // trim of the data beyond it.
            let _file = shared.file_locks().exclusive(id).await;
            let DataDone::Reply(reply) =
                shared.data_step(client, DataChange::Truncate { req: &req })?
            else {
                return Err(unexpected("truncation"));
            };
            // This truncation's trim, and any other of the file's left pending.
            let pending = {
                let core = shared.core();
                core.engine
                    .inode(id)
                    .and_then(|i| core.engine.reclaim_of(id, i.btime as u64))
            };
            if let Some(r) = pending {
                run_reclaim(shared, r).await?;
            }
            Ok((reply, shared.journal().last_lsn()))
        }
        _ => Err(fs_err!(ENOSYS, "{} is not a data operation", req.op.name())),
    }
}

/// A write at `offset`, or an append (`WRITE_AT_END`). Returns the reply and the LSN of
/// its record for a write answered early or replayed (the mount keeps it until durable and
/// replays it if the server is lost first); 0 for a durable-mode client, whose write is
/// not durable before fsync anyway.
async fn write(
    shared: &Arc<Shared>,
    client: u64,
    how: WriteReq<'_>,
    handle: u64,
    offset: u64,
    bytes: Vec<u8>,
) -> Result<(Reply, u64), FsError> {
    let kept = how.mode != ReplyMode::Durable;
    let seq = how.seq;
    if seq != 0
        && let Some(done) = write_done_before(shared, client, seq)
    {
        return Ok(done);
    }
    let of = shared.handle(client, handle, true)?;
    if shared.has_break(Break::ReplayedWriteSkipped) && matches!(how.mode, ReplyMode::Replay { .. })
    {
        // The deliberate bug: a replay taken for one the journal kept, answered as done.
        let core = shared.core();
        let attr = core.engine.inode(of.id).map(|i| i.attr(of.id));
        let attr = attr.unwrap_or_else(|| Attr::new(of.id, mode::S_IFREG, 0));
        return Ok((Reply::Attr(attr), core.observed(of.id)));
    }
    if bytes.len() > IO_MAX {
        return Err(fs_err!(
            EINVAL,
            "write of {} bytes exceeds {IO_MAX}",
            bytes.len()
        ));
    }
    let append = offset == WRITE_AT_END;
    // An append finds the end and writes there alone: no other write of the file runs
    // in between (so concurrent appends, from any client, each get their own bytes).
    let (_file, file) = lock_file(shared, &of, append).await?;
    if append && seq != 0 {
        let core = shared.core();
        if let Some((done, attr)) = core.appended.get(&(client, handle))
            && *done == seq
        {
            let lsn = if kept { core.observed(of.id) } else { 0 };
            return Ok((Reply::Attr(attr.clone()), lsn));
        }
    }
    let offset = if append { file.size } else { offset };
    let end = end_within_limit(offset, bytes.len() as u64)?;
    if shared.data().slices().is_some() {
        let (attr, lsn) =
            crate::slicesvc::write(shared, client, &how, &of, offset, end, bytes).await?;
        if append && seq != 0 {
            let attr = attr.clone();
            shared.data_step(client, DataChange::Appended { handle, seq, attr })?;
        }
        return Ok((Reply::Attr(attr), if kept { lsn } else { 0 }));
    }
    if !bytes.is_empty() {
        if !file.may_have_data {
            mark_data(shared, client, &of).await?;
        }
        let data = shared.data().clone();
        blocking("write", move || {
            data.write(of.id, of.generation, offset, &bytes)
        })
        .await?;
    }
    // Answered early: a replay of it, once durable, is answered by the reply cache.
    // Answered durably: the reply does not wait for the record.
    let written = DataChange::Written {
        how: &how,
        of,
        end,
        append: (append && seq != 0).then_some((handle, seq)),
    };
    let DataDone::Written {
        attr,
        lsn,
        depended,
    } = shared.data_step(client, written)?
    else {
        return Err(unexpected("write"));
    };
    let lsn = if kept { lsn } else { 0 };
    if depended {
        crate::fileaccess::answer_when_durable(shared, lsn).await?;
    }
    Ok((Reply::Attr(attr), lsn))
}

#[allow(clippy::too_many_arguments)]
async fn fallocate(
    shared: &Arc<Shared>,
    client: u64,
    cred: &Credentials,
    handle: u64,
    offset: u64,
    len: u64,
    fmode: u32,
) -> Result<(Reply, u64), FsError> {
    let of = shared.handle(client, handle, true)?;
    if len == 0 {
        return Err(fs_err!(EINVAL, "fallocate of zero bytes"));
    }
    let keep_size = fmode & FALLOC_FL_KEEP_SIZE != 0;
    let punch = fmode & FALLOC_FL_PUNCH_HOLE != 0;
    let zero_range = fmode & FALLOC_FL_ZERO_RANGE != 0;
    if fmode & !(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0
        || (punch && (!keep_size || zero_range))
    {
        return Err(fs_err!(
            EOPNOTSUPP,
            "fallocate mode {fmode:#x} is not supported"
        ));
    }
    let end = end_within_limit(offset, len)?;
    // Punching and zeroing delete or rewrite chunks: alone, like a truncation.
    let (_file, _) = lock_file(shared, &of, punch || zero_range).await?;
    let (id, generation) = (of.id, of.generation);
    if (punch || zero_range) && shared.data().slices().is_some() {
        let zero = DataChange::ZeroSlices {
            cred,
            of,
            offset,
            len,
        };
        shared.data_step(client, zero)?;
    } else if shared.data().slices().is_some() {
        // Nothing to reserve in an object store, and no object to account for.
    } else if punch || zero_range {
        // Only the chunks that exist are touched; holes in the range stay holes (they read
        // as zeros; a zeroed range's holes get no reservation).
        let data = shared.data().clone();
        let chunks = blocking("fallocate", move || {
            data.existing_chunks(id, generation, crate::data::chunk_span(offset, len))
        })
        .await?;
        for batch in chunks.chunks(DATA_BATCH_CHUNKS) {
            let (data, batch) = (shared.data().clone(), batch.to_vec());
            blocking("fallocate", move || {
                data.zero(id, generation, offset, len, zero_range, &batch)
            })
            .await?;
        }
    } else {
        // Reserve the space for real, so a later write there cannot fail for lack of it,
        // and a range the store cannot hold is ENOSPC now (as statfs would predict).
        let data = shared.data().clone();
        blocking("fallocate", move || {
            data.check_space(id, generation, offset, len)
        })
        .await?;
        mark_data(shared, client, &of).await?;
        for (part_offset, part_len) in chunk_batches(offset, len, DATA_BATCH_CHUNKS as u64) {
            let data = shared.data().clone();
            blocking("fallocate", move || {
                data.allocate(id, generation, part_offset, part_len)
            })
            .await?;
        }
    }
    let done = DataChange::Fallocated {
        cred,
        of,
        end,
        keep_size,
        rewrote: punch || zero_range,
    };
    match shared.data_step(client, done)? {
        DataDone::Lsn(lsn) => Ok((Reply::Empty, lsn)),
        _ => Err(unexpected("fallocate")),
    }
}

/// Makes the file's "may have data" mark durable before its first chunk object exists,
/// so that deleting the file can never miss an object (a no-op once the mark is set).
async fn mark_data(shared: &Shared, client: u64, of: &OpenFile) -> Result<(), FsError> {
    let DataDone::Lsn(lsn) = shared.data_step(client, DataChange::MarkData { of: *of })? else {
        return Err(unexpected("data mark"));
    };
    if lsn != 0 {
        crate::fileaccess::wait_durable(shared, lsn).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{ServerConfig, start};
    use kochab_meta::Mutation;
    use kochab_meta::files::open_flags;
    use std::time::Duration;

    const CLIENT: u64 = 7;

    fn req(op: Op) -> Request {
        Request {
            cred: Credentials::root(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op,
        }
    }

    async fn run(shared: &Arc<Shared>, op: Op) -> Reply {
        data_op(shared.clone(), CLIENT, 0, req(op)).await.0
    }

    /// A server with one open file of two chunks of 7s; returns its id, generation and
    /// handle.
    async fn server_with_file(dir: &std::path::Path) -> (crate::RunningServer, u64, u64, u64) {
        let server = start(ServerConfig::new(dir, "127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let shared = server.shared().clone();
        let root = server.root;
        let handle = 1;
        let mut replies = Vec::new();
        let create = Op::Create {
            parent: root,
            name: b"f".to_vec(),
            mode: 0o644,
            flags: open_flags::O_RDWR,
            handle,
        };
        shared.execute_batch(CLIENT, &[(1, req(create))], &mut replies);
        let attr = match &replies[0].reply {
            Reply::WithDirs { reply, .. } => match &**reply {
                Reply::Entry(a) => a.clone(),
                other => panic!("create: {other:?}"),
            },
            Reply::Entry(a) => a.clone(),
            other => panic!("create: {other:?}"),
        };
        for chunk in 0..2 {
            let write = Op::Write {
                handle,
                offset: chunk * CHUNK_BYTES,
                data: vec![7u8; CHUNK_BYTES as usize],
            };
            let reply = run(&shared, write).await;
            assert!(matches!(reply, Reply::Attr(_)), "{reply:?}");
        }
        (server, attr.id, attr.generation, handle)
    }

    /// What a restart in the middle of a truncation leaves: the size is cut and the trim
    /// is pending, but the data beyond the cut is still in the store.
    fn leave_trim_pending(shared: &Shared, id: InodeId, generation: u64, size: u64) {
        let mut guard = shared.core();
        let core = guard.by_hand();
        let mut inode = core.engine.inode(id).unwrap().clone();
        inode.size = size;
        for m in [
            Mutation::PutInode { id, inode },
            Mutation::PutReclaim {
                id,
                generation,
                from: size,
            },
        ] {
            core.engine.apply(&m).unwrap();
        }
    }

    fn read(shared: &Shared, id: InodeId, generation: u64, len: u32) -> Vec<u8> {
        shared
            .data()
            .read(id, generation, u64::MAX, 0, len)
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_finishes_its_files_pending_trim_first() {
        let dir = tempfile::tempdir().unwrap();
        let (server, id, generation, handle) = server_with_file(dir.path()).await;
        let shared = server.shared().clone();
        leave_trim_pending(&shared, id, generation, 10);
        let write = Op::Write {
            handle,
            offset: 20,
            data: b"x".to_vec(),
        };
        let reply = run(&shared, write).await;
        assert!(matches!(reply, Reply::Attr(_)), "{reply:?}");
        assert_eq!(shared.core().engine.reclaim_of(id, generation), None);
        // The bytes cut off never come back, and the write after the trim survives it.
        let got = read(&shared, id, generation, 21);
        assert_eq!(got, [&[7u8; 10][..], &[0u8; 10], b"x"].concat());
        assert_eq!(shared.data().count_objects().unwrap(), 1);
        assert!(
            shared.file_locks().is_empty(),
            "lock entries go when unused"
        );
        server.shutdown().await;
    }

    /// A durable-mode append sent again after its server forgot the handles' last appends
    /// (soft state, gone with a restart) is answered, not appended twice: its sequence
    /// number is in the reply cache, which the journal rebuilds (found by the simulation:
    /// a lost reply, a kill -9, and the retry appended the bytes a second time).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_durable_append_sent_again_after_a_restart_is_not_applied_twice() {
        let dir = tempfile::tempdir().unwrap();
        let (server, _, _, handle) = server_with_file(dir.path()).await;
        let shared = server.shared().clone();
        let mut append = req(Op::Write {
            handle,
            offset: WRITE_AT_END,
            data: b"xyz".to_vec(),
        });
        append.seq = 42;
        assert_eq!(append.mode, ReplyMode::Durable);
        let size = |r: Reply| match r {
            Reply::Attr(a) => a.size,
            other => panic!("append answered {other:?}"),
        };
        let first = size(data_op(shared.clone(), CLIENT, 0, append.clone()).await.0);
        assert_eq!(first, 2 * CHUNK_BYTES + 3);
        shared.core().by_hand().appended.clear();
        let again = size(data_op(shared.clone(), CLIENT, 0, append).await.0);
        assert_eq!(again, first, "appended once");
        server.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pending_trims_of_live_files_finish_in_the_background() {
        let dir = tempfile::tempdir().unwrap();
        let (server, id, generation, _) = server_with_file(dir.path()).await;
        let shared = server.shared().clone();
        leave_trim_pending(&shared, id, generation, CHUNK_BYTES);
        for _ in 0..100 {
            if shared.core().engine.reclaim_of(id, generation).is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(shared.core().engine.reclaim_of(id, generation), None);
        assert_eq!(shared.data().count_objects().unwrap(), 1);
        server.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fallocate_and_punch_touch_only_what_exists() {
        let dir = tempfile::tempdir().unwrap();
        let (server, id, generation, handle) = server_with_file(dir.path()).await;
        let shared = server.shared().clone();
        // Punching a hole over the whole largest file: the two chunks go, nothing else is
        // visited.
        let punch = Op::Fallocate {
            handle,
            offset: 0,
            len: FILE_BYTES_MAX,
            mode: FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
        };
        assert_eq!(run(&shared, punch).await, Reply::Empty);
        assert_eq!(shared.data().count_objects().unwrap(), 0);
        assert_eq!(read(&shared, id, generation, 8), vec![0u8; 8]);
        let size = shared.file_size(id).unwrap();
        assert_eq!(size, 2 * CHUNK_BYTES, "KEEP_SIZE");
        // Zeroing far beyond the data extends the file without creating chunks.
        let zero = Op::Fallocate {
            handle,
            offset: 1 << 50,
            len: 1 << 40,
            mode: FALLOC_FL_ZERO_RANGE,
        };
        assert_eq!(run(&shared, zero).await, Reply::Empty);
        assert_eq!(shared.data().count_objects().unwrap(), 0);
        let size = shared.file_size(id).unwrap();
        assert_eq!(size, (1 << 50) + (1 << 40));
        // Past the largest file size: EFBIG.
        let beyond = Op::Fallocate {
            handle,
            offset: FILE_BYTES_MAX,
            len: 1,
            mode: 0,
        };
        let Reply::Error(e) = run(&shared, beyond).await else {
            panic!("fallocate past the largest file size succeeded")
        };
        assert_eq!(e.errno, Errno::EFBIG);
        server.shutdown().await;
    }
}
