//! Session operations under the core lock: open, create, close, byte-range locks and the
//! end of a session. They run inside a step's pass like any metadata operation (see
//! `step`); their records and callbacks leave through the core's outbox.

use crate::clock::Now;
use crate::core::{Cleanup, Core};
use crate::leases::Urgency;
use crate::session::{OpenFile, Registered};
use kochab_meta::files::{open_flags, reads, writes};
use kochab_proto::*;
use std::time::Instant;

const O_EXCL: u32 = 0o200;

fn bad_handle(handle: u64) -> Reply {
    Reply::Error(fs_err!(
        EBADF,
        "unknown file handle {handle} (closed, or the server restarted)"
    ))
}

impl Core {
    /// Session operations, under the core lock.
    pub(crate) fn session_op(&mut self, client: u64, req: &Request, now: Now) -> Reply {
        match &req.op {
            Op::Open { id, flags, handle } => {
                match self.engine.check_open(&req.cred, *id, *flags) {
                    Ok(attr) => match register(self, client, *handle, &attr, *flags, now.instant) {
                        Ok(()) => Reply::Entry(attr),
                        Err(e) => Reply::Error(e),
                    },
                    Err(kochab_meta::Fail::Fs(e)) => Reply::Error(e),
                    Err(kochab_meta::Fail::NotHosted(id)) => {
                        Reply::Error(kochab_meta::not_in_any_table(id))
                    }
                }
            }
            Op::Create {
                parent,
                name,
                mode,
                flags,
                handle,
            } => self.create(client, req, *parent, name, *mode, *flags, *handle, now),
            Op::Close { handle } => {
                self.close_handle(client, *handle, now);
                Reply::Empty
            }
            Op::CloseMany { handles } => {
                if let Err(e) = check_close_many(handles) {
                    return Reply::Error(e);
                }
                // Admitted as a whole (every file's table is served here). A handle this
                // server does not know may be known where its file's table went: then
                // nothing is closed, and the client closes each, routed by its file.
                let known = |h: &u64| {
                    self.sessions.get(client, *h).is_some()
                        || self.arrived.contains_key(&(client, *h))
                };
                if let Some(h) = handles.iter().find(|h| !known(h)) {
                    return bad_handle(*h);
                }
                for handle in handles {
                    self.close_handle(client, *handle, now);
                }
                Reply::Empty
            }
            Op::GetLk { handle, lock } => match self.sessions.get(client, *handle) {
                None => bad_handle(*handle),
                Some(of) => Reply::Lock(self.locks.conflict(client, of.id, lock).unwrap_or(
                    LockSpec {
                        kind: LockKind::Unlock,
                        ..*lock
                    },
                )),
            },
            Op::SetLk { handle, lock } => match self.sessions.get(client, *handle) {
                None => bad_handle(*handle),
                Some(of) => match lock_access(&of, *handle, lock)
                    .and_then(|()| self.locks.set(client, of.id, *handle, lock))
                {
                    Ok(()) => Reply::Empty,
                    Err(e) => Reply::Error(e),
                },
            },
            Op::ReleaseLocks { handle, owner } => {
                let ids = match self.sessions.get(client, *handle) {
                    Some(of) => vec![of.id],
                    // As for Close: locks that came here with the file's table.
                    None => self.locks.inodes_of_handle(client, *handle),
                };
                for id in ids {
                    self.locks.release_owner(client, id, *owner);
                }
                Reply::Empty
            }
            Op::EndSession => {
                self.end_session(client, now);
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
        &mut self,
        client: u64,
        req: &Request,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        flags: u32,
        handle: u64,
        now: Now,
    ) -> Reply {
        // open(2) takes its descriptor before it creates anything: a client at its handle
        // limit gets EMFILE and no new file.
        if !self.sessions.may_open(client, handle) {
            return Reply::Error(too_many_handles(self.sessions.handle_limit()));
        }
        let cached = req.seq != 0;
        if cached && let Some(Some(id)) = self.replies.get(client, req.seq) {
            // A retry: the first attempt created (and opened) it. At a member that does
            // not hold its table (the first attempt borrowed it), WRONG_SERVER: the
            // member borrows the table and answers then.
            return match self.engine.attr_for_retry(id) {
                Ok(Some(attr)) => match register(self, client, handle, &attr, flags, now.instant) {
                    Ok(()) => Reply::Entry(attr),
                    Err(e) => Reply::Error(e),
                },
                Err(wrong_server) => *wrong_server,
                Ok(None) => Reply::Error(fs_err!(
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
        let reply = self.engine.execute(&req.cred, &mknod, now.wall, &mut muts);
        let Reply::Entry(attr) = reply else {
            return reply;
        };
        if attr.kind() != Some(FileKind::File) {
            return Reply::Error(fs_err!(
                EEXIST,
                "{:?} exists and is not a regular file",
                String::from_utf8_lossy(name)
            ));
        }
        if muts.is_empty() {
            // An existing file is opened under the usual permission rules; a new one may be
            // opened as asked even if its mode forbids it (open(2) with O_CREAT).
            if let Err(kochab_meta::Fail::Fs(e)) = self.engine.check_open(&req.cred, attr.id, flags)
            {
                return Reply::Error(e);
            }
        } else {
            let seq = if cached { req.seq } else { 0 };
            let lsn = self.append(client, seq, req.seq_floor, Some(attr.id), &muts);
            self.journaled(client, &muts, lsn, now.durable, now.instant);
            if cached {
                self.replies.insert(client, req.seq, Some(attr.id));
            }
        }
        match register(self, client, handle, &attr, flags, now.instant) {
            Ok(()) => Reply::Entry(attr),
            Err(e) => Reply::Error(e),
        }
    }

    /// Closes every handle of a client and releases its locks (explicit end or expiry).
    /// The closes go through the bounded cleanup queue: a small session ends within this
    /// call, a large one (any number of open-unlinked files) one bounded record per hold of
    /// the core lock, with other clients served in between.
    pub fn end_session(&mut self, client: u64, now: Now) {
        self.locks.release_client(client);
        self.flushes.forget(Some(client), None);
        if !self.appended.is_empty() {
            self.appended.retain(|&(c, _), _| c != client);
        }
        let mut queued = false;
        if let Some(handles) = self.sessions.end(client) {
            self.cleanup.push_back(Cleanup::Closes(handles));
            queued = true;
        }
        let mut arrived = Vec::new();
        self.arrived.retain(|&(c, _), id| {
            if c == client {
                arrived.push(*id);
            }
            c != client
        });
        if !arrived.is_empty() {
            self.cleanup
                .push_back(Cleanup::ArrivedCloses(arrived.into_iter()));
            queued = true;
        }
        if queued && self.cleanup_batch(now) {
            // The rest one batch per hold of the lock, by the cleanup task.
            self.out.wake_cleanup = true;
        }
    }

    /// Closes one handle of `client`: the last close of an open file description ends its
    /// OFD locks and flock, and the last close of an unlinked file removes it.
    fn close_handle(&mut self, client: u64, handle: u64, now: Now) {
        self.appended.remove(&(client, handle));
        if let Some(of) = self.sessions.close(client, handle) {
            if writes(of.flags) {
                self.flushes.closed(of.id, client);
            }
            // (A handle reopened here after its table arrived was converted from
            // `arrived` when reopened.)
            self.locks.release_handle(client, of.id, handle);
            let muts = self.engine.close_ref(of.id);
            self.journal_change(client, &muts, now);
        } else {
            // Opened at another server; its locks may have come here with the file's
            // table, and so may its open count.
            for id in self.locks.inodes_of_handle(client, handle) {
                self.locks.release_handle(client, id, handle);
            }
            if let Some(id) = self.arrived.remove(&(client, handle)) {
                self.flushes.closed(id, client);
                let muts = self.engine.close_ref(id);
                self.journal_change(client, &muts, now);
            }
        }
    }
}

/// As fcntl(2) on Linux: a read lock needs a handle open for reading, a write lock one
/// open for writing (EBADF). flock locks any handle.
fn lock_access(of: &OpenFile, handle: u64, lock: &LockSpec) -> Result<(), FsError> {
    let (ok, what) = match lock.kind {
        _ if lock.flock => (true, ""),
        LockKind::Read => (
            reads(of.flags),
            "a read lock needs a handle open for reading",
        ),
        LockKind::Write => (
            writes(of.flags),
            "a write lock needs a handle open for writing",
        ),
        LockKind::Unlock => (true, ""),
    };
    if ok {
        Ok(())
    } else {
        Err(fs_err!(EBADF, "handle {handle}: {what}"))
    }
}

fn too_many_handles(limit: usize) -> FsError {
    fs_err!(
        EMFILE,
        "this client holds {limit} open files, the most a client may"
    )
}

/// Refuses a `CloseMany` that would cost more under the core lock than the batch it counts
/// as (see `CLOSE_MANY_HANDLES_MAX`): too many handles, or one named twice (the client
/// gathers each close once; copies of a known handle before an unknown one were looked up
/// for nothing).
pub fn check_close_many(handles: &[u64]) -> Result<(), FsError> {
    if handles.len() > CLOSE_MANY_HANDLES_MAX {
        return Err(fs_err!(
            EINVAL,
            "{} handles in one CloseMany; at most {CLOSE_MANY_HANDLES_MAX}",
            handles.len()
        ));
    }
    let mut sorted = handles.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(fs_err!(
            EINVAL,
            "handle {} named twice in one CloseMany",
            w[0]
        ));
    }
    Ok(())
}

/// Registers a handle at `now`, counting the open once; EMFILE past the client's handle
/// limit.
fn register(
    core: &mut Core,
    client: u64,
    handle: u64,
    attr: &Attr,
    flags: u32,
    now: Instant,
) -> Result<(), FsError> {
    let file = OpenFile {
        id: attr.id,
        generation: attr.generation,
        flags: flags & (open_flags::O_ACCMODE | open_flags::O_TRUNC),
    };
    match core.sessions.open(client, handle, file) {
        Registered::Opened => {
            core.engine.open_ref(attr.id);
            if writes(file.flags) {
                core.flushes.opened(attr.id, client);
                // Others' cached size and data of it go first: this client may hold its
                // writes back, unseen by the server, until someone looks again.
                let revoked = core.leases.opened_for_writing(client, attr.id, now);
                for (holder, list, until) in revoked {
                    core.call_back(client, holder, &list, until, Urgency::Drop, now);
                }
            }
            if core.arrived.get(&(client, handle)) == Some(&attr.id) {
                // The client reopened here a handle that came with the table: it is this
                // server's handle from now on, counted once (the count stays above zero,
                // so this close drops nothing).
                core.arrived.remove(&(client, handle));
                core.flushes.closed(attr.id, client);
                let muts = core.engine.close_ref(attr.id);
                debug_assert!(muts.is_empty());
            }
            Ok(())
        }
        Registered::Known => Ok(()),
        Registered::TooMany => Err(too_many_handles(core.sessions.handle_limit())),
    }
}
