//! Write-behind: small sequential writes to a file are gathered in the mount and sent to
//! the servers as large requests, several in flight at once (as the NFS and CephFS clients
//! do), instead of one synchronous round trip per `write(2)`.
//!
//! A write is answered once it is in the mount's buffer. What is buffered for an inode is
//! sent before anything on this mount could see the file without it: a read, getattr,
//! setattr, fallocate, lookup or readdirplus of the inode, another open of it, fsync,
//! close (flush and release), and unmount; and whatever is buffered is sent once it is
//! `MAX_HELD` old (see `start_ager`). So every reader on this mount sees its own
//! writes and exact sizes; other mounts see them once they are sent (at the latest at the
//! writer's close: close-to-open consistency, as NFS gives). An error of a send is kept
//! and returned by the next write, fsync or close of the inode.
//!
//! Only the simple, common case is buffered: one open handle of the inode on this mount,
//! not O_APPEND, no setuid/setgid bits (see `Inner::may_buffer`); anything else first
//! sends what is buffered and then writes through as before.
//!
//! Other mounts see exact sizes and data too: before another client reads, stats,
//! truncates or appends to a file this mount has open for writing, the server calls it
//! back (a `Flush` callback); the mount sends what it holds of the file and then writes
//! it through ([`WriteBehind::write_through`]), so every change reaches the server, which
//! calls back the other clients' caches; once its next write has done that, the server
//! says it may hold writes back again (a `Hold` callback, [`WriteBehind::hold_again`]).

use kochab_client::Client;
use kochab_proto::{Credentials, FsError, InodeId};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes gathered before they are sent as one request.
pub const CHUNK: usize = 1 << 20;
/// Requests of one inode in flight at once; a writer past it waits (back-pressure: at most
/// `CHUNK * (IN_FLIGHT + 1)` bytes per inode are held).
pub const IN_FLIGHT: usize = 4;
/// Longest a written byte is held back in the mount. A writer that keeps its file open and
/// writes little (a log) still reaches the servers within about this, as the kernel sends
/// a local file system's dirty pages after `dirty_expire_centisecs`; until then only a
/// crash of the mount loses it (fsync and close send it at once).
pub const MAX_HELD: Duration = Duration::from_secs(5);

/// What is buffered and in flight for one inode.
struct Pending {
    /// The handle the buffered bytes were written through (sends go through it).
    handle: u64,
    cred: Credentials,
    /// Offset of `buf[0]`.
    start: u64,
    buf: Vec<u8>,
    /// When the oldest byte of `buf` was buffered.
    since: Instant,
    in_flight: usize,
    /// The first error of a send, until it is reported.
    error: Option<FsError>,
}

/// The mount's write-behind state.
pub struct WriteBehind {
    client: Client,
    /// Sends run here (a write may be buffered from a FUSE request thread).
    rt: tokio::runtime::Handle,
    inodes: Mutex<FxHashMap<InodeId, Pending>>,
    /// Woken when a send ends.
    sent: tokio::sync::Notify,
    /// Until when writes of an inode (of any, for `None`) go through: promised to the
    /// server by a flush callback, or after a lost connection (whose server forgot whom
    /// it told what).
    through: Mutex<(FxHashMap<InodeId, Instant>, Option<Instant>)>,
}

/// A request to start: (handle, credentials, offset, bytes).
type Send = (u64, Credentials, u64, Vec<u8>);

impl WriteBehind {
    pub fn new(client: Client, rt: tokio::runtime::Handle) -> Arc<WriteBehind> {
        Arc::new(WriteBehind {
            client,
            rt,
            inodes: Mutex::new(FxHashMap::default()),
            sent: tokio::sync::Notify::new(),
            through: Mutex::new((FxHashMap::default(), None)),
        })
    }

    /// False while writes of `id` must go through (see [`WriteBehind::write_through`]).
    pub fn may_hold(&self, id: InodeId) -> bool {
        let through = self.through.lock();
        let now = Instant::now();
        through.1.is_none_or(|t| t <= now) && through.0.get(&id).is_none_or(|&t| t <= now)
    }

    /// A flush callback: from now on, for `write_through`, writes of `id` (of every
    /// inode, for `None`) go through. Made at once, in the order callbacks arrive (a
    /// later `Hold` ends it); [`WriteBehind::settle_held`] then sends what was held back.
    pub fn write_through(&self, id: Option<InodeId>, write_through: Duration) {
        tracing::debug!("writes of {id:?} go through for {write_through:?}");
        let until = Instant::now() + write_through;
        // Under the buffers' lock: a write held back before this is sent by
        // `settle_held`, and none is held back after it.
        let _inodes = self.inodes.lock();
        let mut through = self.through.lock();
        let now = Instant::now();
        if through.0.len() >= 1 << 16 {
            through.0.retain(|_, t| *t > now);
        }
        match id {
            Some(id) => {
                let t = through.0.entry(id).or_insert(until);
                *t = (*t).max(until);
            }
            None => through.1 = Some(through.1.map_or(until, |t| t.max(until))),
        }
    }

    /// A `Hold` callback: writes of `id` may be held back again (the server ended the
    /// write-through a flush callback asked for).
    pub fn hold_again(&self, id: InodeId) {
        tracing::debug!("writes of {id:#x} may be held back again");
        self.through.lock().0.remove(&id);
    }

    /// Sends what is held back of `id` (of every inode, for `None`) and waits until the
    /// servers have it; an error stays for the writer's next write, fsync or close.
    pub async fn settle_held(self: &Arc<Self>, id: Option<InodeId>) {
        match id {
            Some(id) => self.settle(id).await,
            None => {
                let ids: Vec<InodeId> = self.inodes.lock().keys().copied().collect();
                for id in ids {
                    self.settle(id).await;
                }
            }
        }
    }

    /// True if bytes of `id` are buffered or in flight (cheap: for the paths that must
    /// then call [`WriteBehind::flush`]).
    pub fn pending(&self, id: InodeId) -> bool {
        self.inodes.lock().contains_key(&id)
    }

    /// [`WriteBehind::write`] without waiting, for the FUSE request thread (no hand-off to
    /// the runtime for the common write): `None` if the write would have to wait (it is
    /// not next to the buffered bytes, or too much is in flight) or must go through; then
    /// nothing changed.
    pub fn write_now(
        self: &Arc<Self>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        offset: u64,
        data: &[u8],
    ) -> Option<Result<(), FsError>> {
        let send = {
            let mut inodes = self.inodes.lock();
            if !self.may_hold(id) {
                return None;
            }
            let p = inodes.entry(id).or_insert_with(|| Pending {
                handle,
                cred: cred.clone(),
                start: offset,
                buf: Vec::new(),
                since: Instant::now(),
                in_flight: 0,
                error: None,
            });
            if let Some(e) = p.error.take() {
                return Some(Err(e));
            }
            if p.buf.is_empty() && p.in_flight == 0 && p.handle == handle {
                p.start = offset;
            }
            let next = p.start + p.buf.len() as u64;
            let full = p.buf.len() + data.len() >= CHUNK && p.in_flight >= IN_FLIGHT;
            if p.handle != handle || next != offset || full {
                return None;
            }
            if p.buf.capacity() == 0 {
                p.buf.reserve_exact(CHUNK);
            }
            if p.buf.is_empty() {
                p.since = Instant::now();
            }
            p.buf.extend_from_slice(data);
            p.cred.clone_from(cred);
            self.next_send(p)
        };
        if let Some(send) = send {
            self.spawn_send(id, send);
        }
        Some(Ok(()))
    }

    /// Buffers `data` written at `offset` through `handle`; sends a full chunk. Waits
    /// when [`WriteBehind::write_now`] cannot take it: the buffered bytes are sent first
    /// when these are not next to them, else a request in flight must end. `Err`: an
    /// earlier send of the inode failed (reported once). `None`: the write must go
    /// through (a flush callback asked so); nothing was buffered.
    pub async fn write(
        self: &Arc<Self>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        offset: u64,
        data: &[u8],
    ) -> Option<Result<(), FsError>> {
        loop {
            if !self.may_hold(id) {
                return None;
            }
            if let Some(done) = self.write_now(cred, id, handle, offset, data) {
                return Some(done);
            }
            let adjacent = self
                .inodes
                .lock()
                .get(&id)
                .is_some_and(|p| p.handle == handle && p.start + p.buf.len() as u64 == offset);
            if adjacent {
                self.wait_sent(id).await;
            } else if let Err(e) = self.flush(id).await {
                return Some(Err(e));
            }
        }
    }

    /// Sends, every `MAX_HELD / 5` for as long as the write-behind lives, what has been
    /// held back for `MAX_HELD` or longer.
    pub fn start_ager(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        self.rt.spawn(async move {
            let mut tick = tokio::time::interval(MAX_HELD / 5);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                let Some(wb) = weak.upgrade() else {
                    return;
                };
                wb.send_aged(MAX_HELD);
            }
        });
    }

    /// Starts a send of what each inode has held back for `age` or longer (its errors stay
    /// for the writer's next write, fsync or close, as for any send).
    fn send_aged(self: &Arc<Self>, age: Duration) {
        let sends: Vec<(InodeId, Send)> = {
            let mut inodes = self.inodes.lock();
            inodes
                .iter_mut()
                .filter(|(_, p)| {
                    !p.buf.is_empty() && p.in_flight < IN_FLIGHT && p.since.elapsed() >= age
                })
                .map(|(&id, p)| (id, self.take(p)))
                .collect()
        };
        for (id, send) in sends {
            self.spawn_send(id, send);
        }
    }

    /// A full chunk to send, if there is one and a request may start.
    fn next_send(&self, p: &mut Pending) -> Option<Send> {
        (p.buf.len() >= CHUNK && p.in_flight < IN_FLIGHT).then(|| self.take(p))
    }

    /// The first `CHUNK` buffered bytes (or all, if fewer), as a send.
    fn take(&self, p: &mut Pending) -> Send {
        let rest = if p.buf.len() > CHUNK {
            p.buf.split_off(CHUNK)
        } else {
            Vec::new()
        };
        let bytes = std::mem::replace(&mut p.buf, rest);
        let start = p.start;
        p.start += bytes.len() as u64;
        p.in_flight += 1;
        (p.handle, p.cred.clone(), start, bytes)
    }

    fn spawn_send(self: &Arc<Self>, id: InodeId, (handle, cred, start, bytes): Send) {
        let wb = self.clone();
        self.rt.spawn(async move {
            let r = wb.client.write(&cred, handle, start, bytes).await;
            let mut inodes = wb.inodes.lock();
            if let Some(p) = inodes.get_mut(&id) {
                p.in_flight -= 1;
                if let Err(e) = r
                    && p.error.is_none()
                {
                    p.error = Some(e);
                }
                if p.in_flight == 0 && p.buf.is_empty() && p.error.is_none() {
                    inodes.remove(&id);
                }
            }
            drop(inodes);
            wb.sent.notify_waiters();
        });
    }

    /// Waits until a send of `id` ends (or none is in flight).
    async fn wait_sent(&self, id: InodeId) {
        let woken = self.sent.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if self.inodes.lock().get(&id).is_none_or(|p| p.in_flight == 0) {
            return;
        }
        woken.await;
    }

    /// Sends everything buffered for `id` and waits until the servers have it all; returns
    /// (and forgets) the first error of a send since the last report.
    pub async fn flush(self: &Arc<Self>, id: InodeId) -> Result<(), FsError> {
        self.drain(id, true).await
    }

    /// As [`WriteBehind::flush`], but an error stays for the next write, fsync or close to
    /// report (for reads and attribute requests, which do not report write errors).
    pub async fn settle(self: &Arc<Self>, id: InodeId) {
        let _ = self.drain(id, false).await;
    }

    async fn drain(self: &Arc<Self>, id: InodeId, report: bool) -> Result<(), FsError> {
        loop {
            let send = {
                let mut inodes = self.inodes.lock();
                let Some(p) = inodes.get_mut(&id) else {
                    return Ok(());
                };
                if !p.buf.is_empty() && p.in_flight < IN_FLIGHT {
                    Some(self.take(p))
                } else if p.in_flight > 0 {
                    None
                } else if !report && p.error.is_some() {
                    return Ok(());
                } else {
                    let error = p.error.take();
                    inodes.remove(&id);
                    return error.map_or(Ok(()), Err);
                }
            };
            match send {
                Some(send) => self.spawn_send(id, send),
                None => self.wait_sent(id).await,
            }
        }
    }

    /// Sends everything buffered for every inode and waits (unmount).
    pub async fn flush_all(self: &Arc<Self>) {
        let ids: Vec<InodeId> = self.inodes.lock().keys().copied().collect();
        for id in ids {
            if let Err(e) = self.flush(id).await {
                tracing::error!("buffered writes of inode {id:#x} were lost at unmount: {e}");
            }
        }
    }
}
