//! The file service: open handles, locks and the data path.
//!
//! Session operations (open, create, close, locks) run inside a batch under the core lock
//! like any metadata operation. Data operations (read, write, fsync, fallocate, and
//! truncation) run as their own tasks: the core lock is taken only for the metadata part,
//! the chunk I/O runs on the blocking pool, and a per-inode stripe lock orders writes
//! against truncation, so that a truncation's data trim can never destroy a later write.

use crate::core::{Core, Shared, journal_entry, note_modified, now_ns};
use crate::session::OpenFile;
use kochab_meta::files::{open_flags, reads, writes};
use kochab_meta::{Mutation, Reclaim};
use kochab_proto::*;
use std::sync::Arc;

/// Stripes of the per-inode data lock.
pub const STRIPES: usize = 64;
/// Largest read or write in one request (a FUSE request is at most 1 MiB).
pub const IO_MAX: usize = 4 << 20;
/// Largest file: offsets are signed in POSIX.
const FILE_MAX: u64 = i64::MAX as u64;
/// fallocate(2) modes served.
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
const O_EXCL: u32 = 0o200;

/// True for operations served by [`data_op`] rather than in a batch.
pub fn is_data_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Read { .. } | Op::Write { .. } | Op::Fsync { .. } | Op::Fallocate { .. }
    ) || matches!(op, Op::SetAttr { set, .. } if set.size.is_some())
}

fn bad_handle(handle: u64) -> Reply {
    Reply::Error(fs_err!(
        EBADF,
        "unknown file handle {handle} (closed, or the server restarted)"
    ))
}

impl Shared {
    /// Session operations, under the core lock.
    pub(crate) fn session_op(
        &self,
        core: &mut Core,
        client: u64,
        req: &Request,
        now: TimeNs,
    ) -> Reply {
        match &req.op {
            Op::Open { id, flags, handle } => {
                match core.engine.check_open(&req.cred, *id, *flags) {
                    Ok(attr) => {
                        register(core, client, *handle, &attr, *flags);
                        Reply::Entry(attr)
                    }
                    Err(kochab_meta::Fail::Fs(e)) => Reply::Error(e),
                    Err(kochab_meta::Fail::NotHosted(_)) => Reply::WrongServer {
                        epoch: core.engine.epoch,
                    },
                }
            }
            Op::Create {
                parent,
                name,
                mode,
                flags,
                handle,
            } => self.create(
                core, client, req, *parent, name, *mode, *flags, *handle, now,
            ),
            Op::Close { handle } => {
                if let Some(of) = core.sessions.close(client, *handle) {
                    let muts = core.engine.close_ref(of.id);
                    self.journal_now(core, client, &muts);
                }
                Reply::Empty
            }
            Op::GetLk { handle, lock } => match core.sessions.get(client, *handle) {
                None => bad_handle(*handle),
                Some(of) => Reply::Lock(core.locks.conflict(client, of.id, lock).unwrap_or(
                    LockSpec {
                        kind: LockKind::Unlock,
                        ..*lock
                    },
                )),
            },
            Op::SetLk { handle, lock } => match core.sessions.get(client, *handle) {
                None => bad_handle(*handle),
                // No access-mode check: flock locks any descriptor, and for fcntl the
                // kernel has checked the descriptor already; the locks are advisory.
                Some(of) => match core.locks.set(client, of.id, lock) {
                    Ok(()) => Reply::Empty,
                    Err(e) => Reply::Error(e),
                },
            },
            Op::ReleaseLocks { handle, owner } => {
                if let Some(of) = core.sessions.get(client, *handle) {
                    core.locks.release_owner(client, of.id, *owner);
                }
                Reply::Empty
            }
            Op::EndSession => {
                self.end_session(core, client);
                Reply::Empty
            }
            _ => Reply::Error(fs_err!(
                ENOSYS,
                "{} is not a session operation",
                req.op.name()
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        &self,
        core: &mut Core,
        client: u64,
        req: &Request,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        flags: u32,
        handle: u64,
        now: TimeNs,
    ) -> Reply {
        let cached = req.seq != 0;
        if cached && let Some(Some(id)) = core.replies.get(client, req.seq) {
            // A retry: the first attempt created (and opened) it.
            return match core.engine.inode(id).map(|i| i.attr(id)) {
                Some(attr) => {
                    register(core, client, handle, &attr, flags);
                    Reply::Entry(attr)
                }
                None => Reply::Error(fs_err!(
                    ESTALE,
                    "created by the first attempt, removed before this retry"
                )),
            };
        }
        let mknod = Op::Mknod {
            parent,
            name: name.to_vec(),
            mode: mode::S_IFREG | (mode & mode::PERM_MASK),
            rdev: 0,
            exclusive: flags & O_EXCL != 0,
        };
        let mut muts = Vec::new();
        let reply = core.engine.execute(&req.cred, &mknod, now, &mut muts);
        let Reply::Entry(attr) = reply else {
            return reply;
        };
        if attr.kind() != FileKind::File {
            return Reply::Error(fs_err!(
                EEXIST,
                "{:?} exists and is not a regular file",
                String::from_utf8_lossy(name)
            ));
        }
        if muts.is_empty() {
            // An existing file is opened under the usual permission rules; a new one may be
            // opened as asked even if its mode forbids it (open(2) with O_CREAT).
            if let Err(kochab_meta::Fail::Fs(e)) = core.engine.check_open(&req.cred, attr.id, flags)
            {
                return Reply::Error(e);
            }
        } else {
            let lsn = journal_entry(
                &self.journal,
                client,
                if cached { req.seq } else { 0 },
                req.seq_floor,
                Some(attr.id),
                &muts,
            );
            note_modified(&mut core.modified, &muts, lsn);
            if cached {
                core.replies.insert(client, req.seq, Some(attr.id));
            }
        }
        register(core, client, handle, &attr, flags);
        Reply::Entry(attr)
    }

    /// Closes every handle of a client and releases its locks (explicit end or expiry).
    pub fn end_session(&self, core: &mut Core, client: u64) {
        let mut muts = Vec::new();
        for of in core.sessions.end(client) {
            muts.extend(core.engine.close_ref(of.id));
        }
        core.locks.release_client(client);
        self.journal_now(core, client, &muts);
    }

    /// The open handle `handle` of `client`, checked for the access it needs.
    fn handle(&self, client: u64, handle: u64, need_write: bool) -> Result<OpenFile, FsError> {
        let core = self.core.lock();
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

    /// Journals `muts` (if any) as one record; returns its LSN or 0.
    pub(crate) fn journal_now(&self, core: &mut Core, client: u64, muts: &[Mutation]) -> u64 {
        if muts.is_empty() {
            return 0;
        }
        let lsn = journal_entry(&self.journal, client, 0, 0, None, muts);
        note_modified(&mut core.modified, muts, lsn);
        self.journal.flush_now();
        lsn
    }
}

/// Registers a handle, counting the open once.
fn register(core: &mut Core, client: u64, handle: u64, attr: &Attr, flags: u32) {
    let file = OpenFile {
        id: attr.id,
        generation: attr.generation,
        flags: flags & (open_flags::O_ACCMODE | open_flags::O_TRUNC),
    };
    if core.sessions.open(client, handle, file) == crate::session::Registered::Opened {
        core.engine.open_ref(attr.id);
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> Result<T, FsError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(fs_err!(EIO, "data I/O failed: {e}")),
        Err(e) => Err(fs_err!(EIO, "data I/O task failed: {e}")),
    }
}

/// Runs one data operation; returns the reply and the LSN that must be durable first.
pub async fn data_op(shared: Arc<Shared>, client: u64, req: Request) -> (Reply, u64) {
    match run_data_op(&shared, client, req).await {
        Ok(r) => r,
        Err(e) => (Reply::Error(e), 0),
    }
}

async fn run_data_op(
    shared: &Arc<Shared>,
    client: u64,
    req: Request,
) -> Result<(Reply, u64), FsError> {
    match req.op {
        Op::Read {
            handle,
            offset,
            len,
        } => {
            let of = shared.handle(client, handle, false)?;
            let _stripe = shared.stripes[(of.id as usize) % STRIPES].read().await;
            let size = current_size(shared, &of)?;
            let data = shared.data.clone();
            let len = (len as usize).min(IO_MAX) as u32;
            let bytes =
                blocking(move || data.read(of.id, of.generation, size, offset, len)).await?;
            let observed = shared.core.lock().observed(of.id);
            Ok((Reply::Bytes(bytes), observed))
        }
        Op::Write {
            handle,
            offset,
            data: bytes,
        } => {
            let of = shared.handle(client, handle, true)?;
            if bytes.len() > IO_MAX {
                return Err(fs_err!(
                    EINVAL,
                    "write of {} bytes exceeds {IO_MAX}",
                    bytes.len()
                ));
            }
            let end = offset
                .checked_add(bytes.len() as u64)
                .filter(|&e| e <= FILE_MAX)
                .ok_or_else(|| fs_err!(EFBIG, "write past the largest file size"))?;
            let _stripe = shared.stripes[(of.id as usize) % STRIPES].read().await;
            // The chunk high-water mark is durable before a new chunk exists, so deleting
            // the file later can never miss an object.
            let lsn = {
                let mut core = shared.core.lock();
                current_generation(&core, &of)?;
                let muts = core.engine.reserve_chunks(of.id, end).map_err(fail)?;
                shared.journal_now(&mut core, client, &muts)
            };
            if lsn != 0 {
                wait_durable(shared, lsn).await?;
            }
            if !bytes.is_empty() {
                let data = shared.data.clone();
                blocking(move || data.write(of.id, of.generation, offset, &bytes)).await?;
            }
            // Size and times: journaled, but a write is not durable before fsync anyway,
            // so the reply does not wait for them.
            let attr = {
                let mut core = shared.core.lock();
                current_generation(&core, &of)?;
                let (muts, attr) = core
                    .engine
                    .write_done(&req.cred, of.id, end, now_ns())
                    .map_err(fail)?;
                shared.journal_now(&mut core, client, &muts);
                attr
            };
            Ok((Reply::Attr(attr), 0))
        }
        Op::Fsync { handle, .. } => {
            let of = shared
                .core
                .lock()
                .sessions
                .get(client, handle)
                .ok_or_else(|| fs_err!(EBADF, "unknown file handle {handle}"))?;
            let data = shared.data.clone();
            blocking(move || data.sync(of.id, of.generation)).await?;
            Ok((Reply::Empty, shared.journal.last_lsn()))
        }
        Op::Fallocate {
            handle,
            offset,
            len,
            mode: fmode,
        } => {
            let of = shared.handle(client, handle, true)?;
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= FILE_MAX)
                .ok_or_else(|| fs_err!(EFBIG, "range past the largest file size"))?;
            if len == 0 {
                return Err(fs_err!(EINVAL, "fallocate of zero bytes"));
            }
            let keep_size = fmode & FALLOC_FL_KEEP_SIZE != 0;
            let zeroing = fmode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0;
            if fmode & !(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0
                || (fmode & FALLOC_FL_PUNCH_HOLE != 0 && !keep_size)
            {
                return Err(fs_err!(
                    EOPNOTSUPP,
                    "fallocate mode {fmode:#x} is not supported"
                ));
            }
            let _stripe = shared.stripes[(of.id as usize) % STRIPES].read().await;
            if zeroing {
                let size = current_size(shared, &of)?;
                let zero_end = end.min(size);
                if zero_end > offset {
                    let data = shared.data.clone();
                    blocking(move || data.zero(of.id, of.generation, offset, zero_end - offset))
                        .await?;
                }
            }
            let mut core = shared.core.lock();
            current_generation(&core, &of)?;
            let size = core.engine.inode(of.id).map_or(0, |i| i.size);
            let new_end = if keep_size || end <= size { size } else { end };
            let changed = zeroing || new_end != size;
            let lsn = if changed {
                let (muts, _) = core
                    .engine
                    .write_done(&req.cred, of.id, new_end, now_ns())
                    .map_err(fail)?;
                shared.journal_now(&mut core, client, &muts)
            } else {
                0
            };
            Ok((Reply::Empty, lsn))
        }
        Op::SetAttr { id, ref set } if set.size.is_some() => {
            // Truncation: no write of this file may run between the size change and the
            // trim of the data beyond it.
            let _stripe = shared.stripes[(id as usize) % STRIPES].write().await;
            let now = now_ns();
            let (reply, trims) = {
                let mut core = shared.core.lock();
                let reply = shared.execute_traced(&mut core, client, &req, now);
                let trims: Vec<Reclaim> = core
                    .last_mutations()
                    .iter()
                    .filter_map(|m| match m {
                        Mutation::PutReclaim { id, generation, .. } => core
                            .engine
                            .pending_reclaims()
                            .into_iter()
                            .find(|r| r.id == *id && r.generation == *generation),
                        _ => None,
                    })
                    .collect();
                (reply, trims)
            };
            shared.journal.flush_now();
            for r in trims {
                let data = shared.data.clone();
                blocking(move || data.reclaim(&r)).await?;
                let mut core = shared.core.lock();
                let muts = core.engine.finish_reclaim(&r);
                shared.journal_now(&mut core, client, &muts);
            }
            Ok((reply, shared.journal.last_lsn()))
        }
        _ => Err(fs_err!(ENOSYS, "{} is not a data operation", req.op.name())),
    }
}

fn fail(f: kochab_meta::Fail) -> FsError {
    match f {
        kochab_meta::Fail::Fs(e) => e,
        kochab_meta::Fail::NotHosted(id) => fs_err!(ESTALE, "inode {id:#x} is not served here"),
    }
}

/// Checks that the handle's file is still the same generation (ids are reused).
fn current_generation(core: &Core, of: &OpenFile) -> Result<(), FsError> {
    match core.engine.inode(of.id) {
        Some(i) if i.btime as u64 == of.generation => Ok(()),
        _ => Err(fs_err!(ESTALE, "the file of this handle is gone")),
    }
}

fn current_size(shared: &Shared, of: &OpenFile) -> Result<u64, FsError> {
    let core = shared.core.lock();
    current_generation(&core, of)?;
    Ok(core.engine.inode(of.id).map_or(0, |i| i.size))
}

async fn wait_durable(shared: &Shared, lsn: u64) -> Result<(), FsError> {
    let mut rx = shared.journal.subscribe();
    while *rx.borrow_and_update() < lsn {
        if shared.journal.failed() {
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
