//! What every file data path shares (in place, `filesvc`; slice objects, `slicesvc`): the
//! open file's data lock and generation check, the pending trim finished before any data
//! operation, storage work on the blocking pool, and the write request's bounds.

use crate::datapass::current_generation;

use crate::filelocks::FileGuard;
use crate::session::OpenFile;
use crate::shared::Shared;
use kochab_meta::Reclaim;
use kochab_proto::*;

/// Chunks one blocking call of a long data operation (a reclaim's deletions, a fallocate's
/// reservations) handles: a few to tens of milliseconds of work, so that shutdown and the
/// blocking pool never wait long for one call, however large the file.
pub const DATA_BATCH_CHUNKS: usize = 256;

/// Runs storage work on the blocking pool; a storage error reaches the client as its errno
/// (`Errno::of_io`: ENOSPC stays ENOSPC, not EIO).
pub(crate) async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> Result<T, FsError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(FsError::from_io(what, &e)),
        Err(e) => Err(fs_err!(EIO, "{what}: the I/O task failed: {e}")),
    }
}

/// The end of `[offset, offset + len)`, if it stays within the largest file size.
pub(crate) fn end_within_limit(offset: u64, len: u64) -> Result<u64, FsError> {
    offset
        .checked_add(len)
        .filter(|&e| e <= FILE_BYTES_MAX)
        .ok_or_else(|| {
            fs_err!(
                EFBIG,
                "range at {offset} of {len} bytes passes the largest file size {FILE_BYTES_MAX}"
            )
        })
}

/// The reply to a write (sequence number `seq` of `client`) that already ran: its file's
/// attributes now, and the LSN a reply that reports them waits for.
pub(crate) fn write_done_before(shared: &Shared, client: u64, seq: u64) -> Option<(Reply, u64)> {
    let core = shared.core();
    let id = core.replies.get(client, seq)??;
    let reply = match core.engine.inode(id) {
        Some(i) => Reply::Attr(i.attr(id)),
        // The write was done; its file has no name left since (nor data to show).
        None => Reply::Attr(Attr::new(id, mode::S_IFREG, 0)),
    };
    Some((reply, core.observed(id)))
}

/// What a data operation needs to know of its file, read when it takes the file's lock.
pub(crate) struct FileState {
    pub size: u64,
    pub may_have_data: bool,
}

/// Takes the data lock of an open file (shared, or `exclusive`), checks that the handle's
/// file generation still exists, and returns its state.
///
/// Rule: no data operation runs while its file generation has a pending trim (a
/// truncation whose trim failed, or was cut short by a restart): the operation finishes
/// the trim first, under the file's exclusive lock, so that bytes cut off never reappear
/// and a late trim can never destroy a later write.
pub(crate) async fn lock_file<'a>(
    shared: &'a Shared,
    of: &OpenFile,
    exclusive: bool,
) -> Result<(FileGuard<'a>, FileState), FsError> {
    let mut guard = if exclusive {
        shared.file_locks().exclusive(of.id).await
    } else {
        shared.file_locks().shared(of.id).await
    };
    // A pending trim seen under a shared lock is finished under the exclusive one, and no
    // new one can appear while that is held: three rounds always suffice.
    for _ in 0..3 {
        let (state, pending) = {
            let core = shared.core();
            current_generation(&core, of)?;
            let state = core.engine.inode(of.id).map_or(
                FileState {
                    size: 0,
                    may_have_data: false,
                },
                |i| FileState {
                    size: i.size,
                    may_have_data: i.may_have_data,
                },
            );
            (state, core.engine.reclaim_of(of.id, of.generation))
        };
        match pending {
            None => return Ok((guard, state)),
            Some(r) if guard.is_exclusive() => run_reclaim(shared, r).await?,
            Some(_) => {
                drop(guard);
                guard = shared.file_locks().exclusive(of.id).await;
            }
        }
    }
    Err(fs_err!(
        EIO,
        "the pending trim of inode {:#x} did not finish",
        of.id
    ))
}

/// Deletes a reclaim entry's data and journals the entry as done, its deletions durable
/// first. The caller holds the file's exclusive lock if the file generation still exists.
pub(crate) async fn run_reclaim(shared: &Shared, r: Reclaim) -> Result<(), FsError> {
    if let Some(dir) = delete_reclaimed(shared, r).await? {
        let data = shared.data().clone();
        blocking("reclaim", move || data.sync_dirs([&dir])).await?;
    }
    shared.finish_reclaims(&[r]);
    Ok(())
}

/// Deletes a reclaim entry's data in bounded blocking calls (one listing of the file's
/// folder, then at most `DATA_BATCH_CHUNKS` deletions per call); returns the folder to sync
/// before the entry is journaled as done, if anything was deleted.
pub(crate) async fn delete_reclaimed(
    shared: &Shared,
    r: Reclaim,
) -> Result<Option<String>, FsError> {
    let data = shared.data().clone();
    let plan = blocking("reclaim", move || data.reclaim_plan(&r)).await?;
    for batch in plan.chunks.chunks(DATA_BATCH_CHUNKS) {
        let (data, batch) = (shared.data().clone(), batch.to_vec());
        blocking("reclaim", move || {
            data.delete_chunks(r.id, r.generation, &batch)
        })
        .await?;
    }
    for batch in plan.objects.chunks(DATA_BATCH_CHUNKS) {
        let (data, batch) = (shared.data().clone(), batch.to_vec());
        blocking("reclaim", move || data.delete_objects(&batch)).await?;
    }
    let data = shared.data().clone();
    blocking("reclaim", move || data.end_reclaim(&r)).await?;
    Ok((!plan.chunks.is_empty()).then(|| crate::data::DataStore::durable_dir(&r)))
}

/// A change answered early that depended on another session's change not yet durable
/// (see `unsettled`) is answered once its own record is durable instead: its reply then
/// leaves as an ordinary one.
pub(crate) async fn answer_when_durable(shared: &Shared, lsn: u64) -> Result<(), FsError> {
    shared.journal().flush_now();
    wait_durable(shared, lsn).await
}

/// Waits until the journal is durable up to `lsn` (EIO if it failed or stopped).
pub(crate) async fn wait_durable(shared: &Shared, lsn: u64) -> Result<(), FsError> {
    // Who waits asks (a journal whose flushes are held for a simulation writes only then).
    shared.journal().ask_durable(lsn);
    let mut rx = shared.journal().subscribe();
    while *rx.borrow_and_update() < lsn {
        if shared.journal().failed() {
            return Err(fs_err!(EIO, "the journal failed"));
        }
        if let Ok(Err(_)) =
            tokio::time::timeout(std::time::Duration::from_secs(1), rx.changed()).await
        {
            return Err(fs_err!(EIO, "the journal stopped"));
        }
    }
    Ok(())
}
