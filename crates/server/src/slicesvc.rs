//! File data as slice objects on a store of whole objects (S3; issue 31): the operations
//! that hand out capabilities and commit what clients put ([`Op::DataGrant`],
//! [`Op::CommitSlices`], [`Op::Layout`]), the server's own reads and writes through the
//! same layout and commit path (`Read`/`Write` RPCs of native clients), the deletion of
//! objects no ref names any more once the change that dropped them is durable, and the
//! compaction of chunks whose refs pile up. The garbage collector of objects never
//! committed is in `gc`.
//!
//! Invariants:
//! - An object becomes part of a file only through a journal record that commits its ref
//!   (`Engine::commit_slices`); a reader (server or client) resolves a chunk's refs from
//!   the engine, never from a listing, so an object that was put and never committed is
//!   never read.
//! - An object that a change dropped is deleted only once that change's record is durable
//!   (a crash before leaves the refs as they were, naming it); a crash after the record and
//!   before the delete leaves an orphan for the garbage collector.
//! - An object the server itself is putting (a write's, a compaction's) is in `own_puts`
//!   from before its PUT until its commit returned, so that the collector never counts it
//!   as an orphan however slow the PUT.

use crate::datapass::{DataChange, DataDone};

use crate::data::slices::COMPACT_REFS_MAX;
use crate::datapass::{WriteReq, current_generation};
use crate::fileaccess::{blocking, end_within_limit, lock_file, write_done_before};
use crate::grants::{GRANT_OBJECTS_MAX, grant_life, object_name};
use crate::session::OpenFile;
use crate::shared::Shared;
use crate::slicework::{OwnPuts, SliceWork};
use kochab_proto::auth::GrantTokenInput;
use kochab_proto::layout::{ChunkLayout, CommittedSlice, Grant, GrantedObject, Layout, SliceRef};
use kochab_proto::*;
use kochab_store::Presign;
use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Objects one call of the deleter removes at most: the S3 store deletes a call's names
/// concurrently, so this bounds the deletes in flight (and a call's duration) whatever
/// the backlog.
pub const DELETES_IN_FLIGHT_MAX: usize = 64;
/// Attempts at a read whose objects were deleted under it (a compaction or an overwrite
/// freed them after the read took the layout): each takes the layout again. Two in a row
/// would need two compactions of the chunk within one read.
const READ_TRIES_MAX: usize = 4;
/// Attempts at a free object id for one slice the server writes: a collision needs two
/// servers' 64-bit ids to meet, so a second attempt is already a curiosity.
const PUT_TRIES_MAX: usize = 4;
/// How often the deleter looks for objects freed by truncations (which the engine keeps
/// until asked, see `Engine::take_freed_objects`) when nothing wakes it.
const FREED_POLL: Duration = Duration::from_secs(1);
/// Pause after a failed delete before the deleter tries again (the objects stay queued).
const DELETE_RETRY: Duration = Duration::from_secs(2);

fn slices_only(shared: &Shared, what: &str) -> Result<(), FsError> {
    if shared.data().slices().is_none() {
        return Err(fs_err!(
            EOPNOTSUPP,
            "{what}: this server's store keeps file data in place (the local directory); \
             read and write through the server"
        ));
    }
    Ok(())
}

fn presign(shared: &Shared, name: &str, how: Presign) -> Result<String, FsError> {
    let store = shared
        .data()
        .slices()
        .ok_or_else(|| fs_err!(EOPNOTSUPP, "no object store for file data"))?
        .store();
    store.presign(name, how, grant_life()).ok_or_else(|| {
        fs_err!(
            EOPNOTSUPP,
            "the object store cannot hand out presigned URLs; read and write through the \
             server"
        )
    })
}

/// `DataGrant`: object ids with a PUT URL and a commit token each.
pub(crate) async fn grant(
    shared: &Arc<Shared>,
    client: u64,
    key_id: u32,
    handle: u64,
    objects: u32,
) -> Result<(Reply, u64), FsError> {
    let of = shared.handle(client, handle, true)?;
    slices_only(shared, "DataGrant")?;
    if objects == 0 || objects > GRANT_OBJECTS_MAX {
        return Err(fs_err!(
            EINVAL,
            "a grant of {objects} objects; 1 to {GRANT_OBJECTS_MAX} per DataGrant"
        ));
    }
    current_generation(&shared.core(), &of)?;
    let expires = shared.clock().unix_secs() + grant_life().as_secs();
    let work = shared.slice_work();
    let mut granted = Vec::with_capacity(objects as usize);
    for _ in 0..objects {
        let object = work.ids.next();
        let put_url = presign(
            shared,
            &object_name(of.id, of.generation, object),
            Presign::PutCreate,
        )?;
        let token = work.grant_key.token(&GrantTokenInput {
            key_id,
            id: of.id,
            generation: of.generation,
            object,
            expires,
        });
        granted.push(GrantedObject {
            object,
            put_url,
            token,
        });
    }
    Ok((
        Reply::Grant(Grant {
            id: of.id,
            generation: of.generation,
            objects: granted,
            expires,
        }),
        0,
    ))
}

/// Checks a committed slice's shape (before its token: a malformed one is EINVAL).
fn check_slice(s: &CommittedSlice) -> Result<(), FsError> {
    if s.r.is_zeros() || !s.r.is_valid() {
        return Err(fs_err!(
            EINVAL,
            "slice ref {:?} of chunk {} is empty, zeros or past its chunk",
            s.r,
            s.chunk
        ));
    }
    let end = s
        .chunk
        .checked_mul(CHUNK_BYTES)
        .and_then(|b| b.checked_add(u64::from(s.r.end())));
    match end {
        Some(e) if e <= FILE_BYTES_MAX => Ok(()),
        _ => Err(fs_err!(
            EFBIG,
            "slice at chunk {} passes the largest file size {FILE_BYTES_MAX}",
            s.chunk
        )),
    }
}

/// Verifies a slice's token for this session's key and the handle's file, and that its
/// grant has not expired (by this server's clock, now).
fn verify_token(
    work: &SliceWork,
    key_id: u32,
    of: &OpenFile,
    s: &CommittedSlice,
    now: u64,
) -> Result<(), FsError> {
    let input = GrantTokenInput {
        key_id,
        id: of.id,
        generation: of.generation,
        object: s.r.object,
        expires: s.expires,
    };
    if !work.grant_key.verify(&input, &s.token) {
        return Err(fs_err!(
            EACCES,
            "object {:#x}: its commit token was not granted to this client key for this \
             file",
            s.r.object
        ));
    }
    if s.expires < now {
        return Err(fs_err!(
            ETIMEDOUT,
            "object {:#x}: its grant expired {} s ago; put the slice again under a new grant",
            s.r.object,
            now - s.expires
        ));
    }
    Ok(())
}

/// `CommitSlices`: the client's slices become refs, in one record, as a write's.
pub(crate) async fn commit(
    shared: &Arc<Shared>,
    client: u64,
    key_id: u32,
    how: WriteReq<'_>,
    handle: u64,
    slices: Vec<CommittedSlice>,
    end: u64,
) -> Result<(Reply, u64), FsError> {
    let kept = how.mode != ReplyMode::Durable;
    if how.seq != 0
        && let Some(done) = write_done_before(shared, client, how.seq)
    {
        return Ok(done);
    }
    let of = shared.handle(client, handle, true)?;
    slices_only(shared, "CommitSlices")?;
    if slices.len() > COMMIT_SLICES_MAX {
        return Err(fs_err!(
            EINVAL,
            "{} slices in one CommitSlices; at most {COMMIT_SLICES_MAX}",
            slices.len()
        ));
    }
    end_within_limit(end, 0)?;
    for s in &slices {
        check_slice(s)?;
    }
    let (_file, _) = lock_file(shared, &of, false).await?;
    // Verified under the core lock, right before the commit: a token that verifies there
    // is committed at once, so the collector's wait past expiry is enough (see `gc`).
    let work = shared.slice_work();
    let verify = || {
        let now = shared.clock().unix_secs();
        slices
            .iter()
            .try_for_each(|s| verify_token(work, key_id, &of, s, now))
    };
    let refs: Vec<(u64, SliceRef)> = slices.iter().map(|s| (s.chunk, s.r)).collect();
    let committed = DataChange::SlicesCommitted {
        how: &how,
        of,
        refs: &refs,
        end,
        verify: Some(&verify),
    };
    let (attr, lsn, depended) = written(shared.data_step(client, committed)?)?;
    if depended {
        crate::fileaccess::answer_when_durable(shared, lsn).await?;
    }
    Ok((Reply::Attr(attr), if kept { lsn } else { 0 }))
}

/// A commit's answer.
fn written(done: DataDone) -> Result<(Attr, u64, bool), FsError> {
    match done {
        DataDone::Written {
            attr,
            lsn,
            depended,
        } => Ok((attr, lsn, depended)),
        other => Err(fs_err!(EIO, "the core answered a commit with {other:?}")),
    }
}

/// `Layout`: the refs of the chunks asked for, with a GET URL per data ref.
pub(crate) async fn layout(
    shared: &Arc<Shared>,
    client: u64,
    handle: u64,
    first_chunk: u64,
    chunks: u32,
) -> Result<(Reply, u64), FsError> {
    let of = shared.handle(client, handle, false)?;
    slices_only(shared, "Layout")?;
    let chunks = chunks.min(LAYOUT_CHUNKS_MAX);
    let (_file, _) = lock_file(shared, &of, false).await?;
    let (size, refs, observed) = {
        let core = shared.core();
        current_generation(&core, &of)?;
        let size = core.engine.inode(of.id).map_or(0, |i| i.size);
        let span = first_chunk..first_chunk.saturating_add(u64::from(chunks));
        (size, core.engine.layout(of.id, span), core.observed(of.id))
    };
    let expires = shared.clock().unix_secs() + grant_life().as_secs();
    let mut out = Vec::with_capacity(refs.len());
    for (chunk, refs) in refs {
        let mut get_urls = Vec::with_capacity(refs.len());
        for r in &refs {
            get_urls.push(if r.is_zeros() {
                String::new()
            } else {
                presign(
                    shared,
                    &object_name(of.id, of.generation, r.object),
                    Presign::Get,
                )?
            });
        }
        out.push(ChunkLayout {
            chunk,
            refs,
            get_urls,
        });
    }
    Ok((
        Reply::Layout(Layout {
            id: of.id,
            generation: of.generation,
            size,
            chunks: out,
            expires,
        }),
        observed,
    ))
}

/// The server's own read of `[offset, offset + len)` (cut at `size`) through the layout.
pub(crate) async fn read(
    shared: &Arc<Shared>,
    of: &OpenFile,
    size: u64,
    offset: u64,
    len: u32,
) -> Result<Vec<u8>, FsError> {
    if offset >= size || len == 0 {
        return Ok(Vec::new());
    }
    let len = u64::from(len).min(size - offset);
    let (sh, of) = (shared.clone(), *of);
    blocking("read", move || {
        let span = crate::data::chunk_span(offset, len);
        let span = *span.start()..span.end().saturating_add(1);
        let slices = sh
            .data()
            .slices()
            .ok_or_else(|| std::io::Error::other("no slice store"))?;
        for attempt in 1..=READ_TRIES_MAX {
            let layout = sh.core().engine.layout(of.id, span.clone());
            match slices.read(of.id, of.generation, &layout, offset, len) {
                // Freed under this read (a compaction, a newer write): the layout again.
                Err(e) if e.kind() == ErrorKind::NotFound && attempt < READ_TRIES_MAX => {}
                r => return r,
            }
        }
        unreachable!("the last attempt returns")
    })
    .await
}

/// The server's own write: one object per chunk touched, put now; the caller commits the
/// refs returned while holding the guard.
async fn put_write<'a>(
    shared: &'a Arc<Shared>,
    of: &OpenFile,
    offset: u64,
    bytes: Vec<u8>,
) -> Result<(Vec<(u64, SliceRef)>, OwnPuts<'a>), FsError> {
    let work = shared.slice_work();
    let mut own = OwnPuts::new(work);
    let mut refs = Vec::new();
    let mut at = 0;
    let mut planned = Vec::new();
    for (chunk, within, n) in crate::data::pieces(offset, bytes.len() as u64) {
        let object = work.ids.next();
        own.add(object_name(of.id, of.generation, object));
        let r = SliceRef {
            object,
            pos: within as u32,
            len: n as u32,
        };
        planned.push((chunk, r, at));
        refs.push((chunk, r));
        at += n;
    }
    let (sh, of) = (shared.clone(), *of);
    let taken = blocking("write", move || {
        let slices = sh
            .data()
            .slices()
            .ok_or_else(|| std::io::Error::other("no slice store"))?;
        let put = |&(chunk, r, at): &(u64, SliceRef, usize)| -> std::io::Result<Option<u64>> {
            let data = &bytes[at..at + r.len as usize];
            let mut r = r;
            for attempt in 1..=PUT_TRIES_MAX {
                match slices.put(of.id, of.generation, chunk, &r, data) {
                    Ok(()) => return Ok((attempt > 1).then_some(r.object)),
                    Err(e) if e.kind() == ErrorKind::AlreadyExists && attempt < PUT_TRIES_MAX => {
                        r.object = sh.slice_work().ids.next();
                        sh.slice_work()
                            .note_own_put(object_name(of.id, of.generation, r.object));
                    }
                    Err(e) => return Err(e),
                }
            }
            unreachable!("the last attempt returns")
        };
        // A write touches at most two chunks (IO_MAX is one chunk): both at once.
        let results: Vec<std::io::Result<Option<u64>>> = if planned.len() <= 1 {
            planned.iter().map(put).collect()
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = planned.iter().map(|p| sc.spawn(move || put(p))).collect();
                hs.into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(std::io::Error::other("a slice put panicked")))
                    })
                    .collect()
            })
        };
        results.into_iter().collect::<std::io::Result<Vec<_>>>()
    })
    .await?;
    // Objects retaken after a collision: the refs name the ids that were created (and the
    // guard releases them with the others).
    for ((_, r), retaken) in refs.iter_mut().zip(taken) {
        if let Some(object) = retaken {
            r.object = object;
            own.adopt(object_name(of.id, of.generation, object));
        }
    }
    Ok((refs, own))
}

/// The server's own write on slices: puts, then commits as [`commit`] does (the caller
/// holds the file's data lock). Returns the reply and its record's LSN.
pub(crate) async fn write(
    shared: &Arc<Shared>,
    client: u64,
    how: &WriteReq<'_>,
    of: &OpenFile,
    offset: u64,
    end: u64,
    bytes: Vec<u8>,
) -> Result<(Attr, u64), FsError> {
    let (refs, _own) = if bytes.is_empty() {
        (Vec::new(), OwnPuts::new(shared.slice_work()))
    } else {
        put_write(shared, of, offset, bytes).await?
    };
    let committed = DataChange::SlicesCommitted {
        how,
        of: *of,
        refs: &refs,
        end,
        verify: None,
    };
    let (attr, lsn, depended) = written(shared.data_step(client, committed)?)?;
    if depended {
        crate::fileaccess::answer_when_durable(shared, lsn).await?;
    }
    Ok((attr, lsn))
}

/// Deletes freed objects once their records are durable, at most
/// [`DELETES_IN_FLIGHT_MAX`] at a time.
pub async fn freed_loop(shared: Arc<Shared>) {
    let mut durable = shared.journal().subscribe();
    let work = shared.slice_work();
    loop {
        // An error here is a bug reported as EIO; the objects stay queued in the engine.
        let _ = shared.data_step(0, DataChange::TakeFreed);
        let batch = work.take_durable(shared.journal().durable_lsn(), DELETES_IN_FLIGHT_MAX);
        if batch.is_empty() {
            tokio::select! {
                r = durable.changed() => if r.is_err() { return },
                _ = work.freed_wake().notified() => {}
                _ = tokio::time::sleep(FREED_POLL) => {}
            }
            continue;
        }
        let Some(slices) = shared.data().slices() else {
            continue;
        };
        let store = slices.store().clone();
        let names = batch.clone();
        let n = batch.len() as u64;
        match tokio::task::spawn_blocking(move || store.delete_many(&names)).await {
            Ok(Ok(())) => {
                work.freed_deleted.fetch_add(n, Ordering::Relaxed);
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    Ok(Ok(())) => String::new(),
                };
                tracing::warn!("cannot delete {n} freed slice objects: {why} (will retry)");
                work.requeue(batch);
                tokio::time::sleep(DELETE_RETRY).await;
            }
        }
    }
}

/// Compacts the chunks queued by commits (see [`compact`]).
pub async fn compaction_loop(shared: Arc<Shared>) {
    let Some(mut rx) = shared.slice_work().take_compact_rx() else {
        return;
    };
    while let Some((id, generation, chunk)) = rx.recv().await {
        let raced = match compact(&shared, id, generation, chunk).await {
            Ok(swapped) => !swapped,
            Err(e) => {
                tracing::warn!(
                    "compaction of chunk {chunk} of {id:#x} (generation {generation:#x}) failed: \
                     {e} (the next commit of it tries again)"
                );
                false
            }
        };
        shared.slice_work().compacted(id, chunk);
        if raced {
            // Commits landed while it ran (they found it queued and queued nothing): try
            // again a little later, or the chunk could keep its refs until its next commit.
            let shared = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(COMPACT_RETRY).await;
                let refs = {
                    let core = shared.core();
                    match core.engine.inode(id) {
                        Some(i) if i.btime as u64 == generation => {
                            core.engine.chunk_refs(id, chunk).len()
                        }
                        _ => 0,
                    }
                };
                if refs > COMPACT_REFS_MAX {
                    shared.slice_work().compact_later(id, generation, chunk);
                }
            });
        }
    }
}

/// Wait before a compaction that lost a race with commits tries again: long enough for a
/// burst of writes to the chunk to pass, short enough that its refs are merged soon after.
const COMPACT_RETRY: Duration = Duration::from_millis(200);

/// Compacts one chunk if it still holds more than [`COMPACT_REFS_MAX`] refs: reads what
/// they resolve to, puts it as one object, and swaps it in if the refs are still the ones
/// read. `Ok(false)`: they were not (commits raced with it; the caller tries again).
/// The objects the swap dropped are deleted once it is durable. A crash at any point
/// leaves either the old refs (and an orphan for the collector) or the new one.
pub async fn compact(
    shared: &Arc<Shared>,
    id: InodeId,
    generation: u64,
    chunk: u64,
) -> Result<bool, FsError> {
    let expected = {
        let core = shared.core();
        match core.engine.inode(id) {
            Some(i) if i.btime as u64 == generation => {}
            _ => return Ok(true),
        }
        core.engine.chunk_refs(id, chunk).to_vec()
    };
    if expected.len() <= COMPACT_REFS_MAX {
        return Ok(true);
    }
    let work = shared.slice_work();
    let object = work.ids.next();
    let mut own = OwnPuts::new(work);
    own.add(object_name(id, generation, object));
    let (sh, refs) = (shared.clone(), expected.clone());
    let merged = blocking("compaction", move || {
        let slices = sh
            .data()
            .slices()
            .ok_or_else(|| std::io::Error::other("no slice store"))?;
        match slices.read_chunk(id, generation, chunk, &refs)? {
            None => Ok(None),
            Some((pos, bytes)) => {
                let r = SliceRef {
                    object,
                    pos,
                    len: bytes.len() as u32,
                };
                slices.put(id, generation, chunk, &r, &bytes)?;
                Ok(Some(r))
            }
        }
    })
    .await?;
    let put = merged.is_some();
    let compacted = DataChange::ChunkCompacted {
        id,
        generation,
        chunk,
        expected: &expected,
        new: merged.into_iter().collect(),
    };
    let swapped = shared.data_step(0, compacted);
    match swapped {
        Ok(_) => {
            work.chunks_compacted.fetch_add(1, Ordering::Relaxed);
            Ok(true)
        }
        Err(e) => {
            // Never committed: nobody reads it, it can go now.
            if put {
                let store = shared.data().slices().map(|s| s.store().clone());
                let name = object_name(id, generation, object);
                if let Some(store) = store {
                    let _ = tokio::task::spawn_blocking(move || store.delete(&name)).await;
                }
            }
            drop(own);
            if e.errno == Errno::ESTALE {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}
