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
//!
//! On an object store the servers do not write (S3: `DataGrant` succeeds; an EOPNOTSUPP
//! makes the mount write through the servers as above, remembered for the mount), a send
//! is a slice instead: the bytes up to the next chunk boundary (so a sequential writer's
//! slices are whole chunks, `CHUNK_BYTES`), encoded as a slice object and put straight
//! into the store under a name the servers granted (grants are fetched `GRANT_BATCH` at a
//! time per file and renewed before they expire). Several PUTs run at once, per inode and
//! per mount (`IN_FLIGHT_DIRECT`, `MOUNT_BYTES_MAX`); their commits go to the servers per
//! inode one at a time, strictly in the order the slices were written (the newest commit
//! wins where slices overlap), each carrying every finished slice at the head of the
//! order (up to `COMMIT_SLICES_MAX`). A slice counts as in flight until its commit is
//! answered, so everything above (own reads, sizes, flushes, errors) holds unchanged;
//! fsync then waits for the commits to be durable as for writes.

use kochab_client::Client;
use kochab_client::direct::{DirectError, DirectIo};
use kochab_proto::layout::{CommittedSlice, GrantedObject, SliceRef, encode_slice};
use kochab_proto::{CHUNK_BYTES, COMMIT_SLICES_MAX, Credentials, Errno, FsError, InodeId, fs_err};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
/// Slices of one inode put or committing at once on an object store: 8 whole-chunk PUTs
/// (32 MiB) keep a single writer's link to the store busy (an S3 PUT runs at tens of MiB/s
/// per connection), and commits batch what finishes meanwhile.
pub const IN_FLIGHT_DIRECT: usize = 8;
/// Bytes of slices a mount has in flight at most (put, or waiting for their commit); a
/// writer past it waits. Bounds the mount's memory for write-behind on an object store
/// whatever the number of files written at once.
pub const MOUNT_BYTES_MAX: usize = 64 << 20;
/// Objects asked for per `DataGrant`: one round trip to the servers per 64 MiB written
/// sequentially, and few unused grants when a file stays small.
pub const GRANT_BATCH: u32 = 16;
/// A grant is used only if this much of its life is left (at most a third of its life, for
/// tests with short grants): the slice must be put and its commit reach a server before
/// it expires.
const GRANT_MARGIN: Duration = Duration::from_secs(60);
/// Tries of one slice's PUT with a new grant each: a name found taken (a retried PUT that
/// had reached the store, or a stale grant) or a URL refused (expired, or the grant's key
/// was revoked).
const PUT_TRIES: u32 = 4;
/// Files whose unused grants are kept: enough for every file a mount writes at once.
const GRANT_POOLS_MAX: usize = 1024;

/// Whether this mount's servers grant direct slice writes and layouts (learnt from their
/// first answer; the same for every file of a mount, whose servers share one store).
#[derive(Default)]
pub struct DirectMode(AtomicU8);

const MODE_UNKNOWN: u8 = 0;
const MODE_DIRECT: u8 = 1;
const MODE_THROUGH: u8 = 2;

/// Whether `e` says the servers serve file data themselves: EOPNOTSUPP (a store they
/// write in place), or ENOSYS (a server from before direct I/O, which knows no such op).
pub fn through_servers(e: &FsError) -> bool {
    matches!(e.errno, Errno::EOPNOTSUPP | Errno::ENOSYS)
}

impl DirectMode {
    /// False once the servers said they serve the data themselves (EOPNOTSUPP).
    pub fn may_be_direct(&self) -> bool {
        self.0.load(Ordering::Relaxed) != MODE_THROUGH
    }

    /// The servers answered a direct operation: EOPNOTSUPP (or ENOSYS) means never again.
    pub fn learn<T>(&self, r: &Result<T, FsError>) {
        match r {
            Err(e) if through_servers(e) => {
                if self.0.swap(MODE_THROUGH, Ordering::Relaxed) != MODE_THROUGH {
                    tracing::info!("the servers write file data themselves: writing through");
                }
            }
            Ok(_) => {
                let _ = self.0.compare_exchange(
                    MODE_UNKNOWN,
                    MODE_DIRECT,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Err(_) => {}
        }
    }
}

/// Unused grants of one file.
struct GrantPool {
    generation: u64,
    objects: VecDeque<GrantedObject>,
    expires: u64,
    /// Unix seconds after which the grants are not used any more.
    use_until: u64,
}

/// A slice in the order of its inode's writes, from its send until its commit is answered.
struct Slot {
    order: u64,
    bytes: usize,
    handle: u64,
    cred: Credentials,
    /// `None` while its PUT runs; then what to commit and the end of its bytes in the
    /// file, or nothing to commit (written through the servers, or failed).
    done: Option<Option<(CommittedSlice, u64)>>,
}

/// Called with an inode after this mount committed slices of it (its layout changed).
pub type CommitHook = Arc<dyn Fn(InodeId) + std::marker::Send + Sync>;

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
    /// Slices (on an object store), oldest first, until their commit is answered.
    slots: VecDeque<Slot>,
    next_order: u64,
    /// A commit of this inode's slices is in flight (they go one at a time, in order).
    committing: bool,
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
    /// Direct slice writes, if the servers grant them.
    mode: Arc<DirectMode>,
    direct: Option<DirectIo>,
    grants: Mutex<FxHashMap<InodeId, GrantPool>>,
    /// Bytes of slices in flight on this mount.
    flying: AtomicUsize,
    on_commit: std::sync::OnceLock<CommitHook>,
}

/// A request to start: (handle, credentials, offset, bytes, its slot's order if it may
/// go to the store as a slice).
type Send = (u64, Credentials, u64, Vec<u8>, Option<u64>);

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl WriteBehind {
    pub fn new(
        client: Client,
        rt: tokio::runtime::Handle,
        mode: Arc<DirectMode>,
        direct: Option<DirectIo>,
    ) -> Arc<WriteBehind> {
        Arc::new(WriteBehind {
            client,
            rt,
            inodes: Mutex::new(FxHashMap::default()),
            sent: tokio::sync::Notify::new(),
            through: Mutex::new((FxHashMap::default(), None)),
            mode,
            direct,
            grants: Mutex::new(FxHashMap::default()),
            flying: AtomicUsize::new(0),
            on_commit: std::sync::OnceLock::new(),
        })
    }

    /// Sets what is told of this mount's commits (once).
    pub fn set_commit_hook(&self, hook: CommitHook) {
        let _ = self.on_commit.set(hook);
    }

    /// True while sends may become slices put straight into the store.
    fn direct(&self) -> bool {
        self.direct.is_some() && self.mode.may_be_direct()
    }

    /// Bytes the next send of `p` takes at most: up to the next chunk boundary for a
    /// slice, `CHUNK` for a write through the servers.
    fn send_len(&self, p: &Pending) -> usize {
        if self.direct() {
            (CHUNK_BYTES - p.start % CHUNK_BYTES) as usize
        } else {
            CHUNK
        }
    }

    /// Whether another send of `p` may start now.
    fn may_send(&self, p: &Pending) -> bool {
        if self.direct() {
            p.in_flight < IN_FLIGHT_DIRECT
                && self.flying.load(Ordering::Relaxed) + p.buf.len().min(self.send_len(p))
                    <= MOUNT_BYTES_MAX
        } else {
            p.in_flight < IN_FLIGHT
        }
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
                slots: VecDeque::new(),
                next_order: 0,
                committing: false,
            });
            if let Some(e) = p.error.take() {
                return Some(Err(e));
            }
            if p.buf.is_empty() && p.in_flight == 0 && p.handle == handle {
                p.start = offset;
            }
            let next = p.start + p.buf.len() as u64;
            let full = p.buf.len() + data.len() >= self.send_len(p) && !self.may_send(p);
            if p.handle != handle || next != offset || full {
                return None;
            }
            if p.buf.capacity() == 0 {
                p.buf.reserve_exact(self.send_len(p));
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
                .filter(|(_, p)| !p.buf.is_empty() && self.may_send(p) && p.since.elapsed() >= age)
                .map(|(&id, p)| (id, self.take(p)))
                .collect()
        };
        for (id, send) in sends {
            self.spawn_send(id, send);
        }
    }

    /// A full send (a chunk, or up to a chunk boundary), if there is one and it may start.
    fn next_send(&self, p: &mut Pending) -> Option<Send> {
        (p.buf.len() >= self.send_len(p) && self.may_send(p)).then(|| self.take(p))
    }

    /// The first buffered bytes up to [`WriteBehind::send_len`], as a send.
    fn take(&self, p: &mut Pending) -> Send {
        let n = self.send_len(p);
        let rest = if p.buf.len() > n {
            let mut rest = Vec::with_capacity(p.buf.capacity().max(n));
            rest.extend_from_slice(&p.buf[n..]);
            p.buf.truncate(n);
            rest
        } else {
            Vec::new()
        };
        let bytes = std::mem::replace(&mut p.buf, rest);
        let start = p.start;
        p.start += bytes.len() as u64;
        p.in_flight += 1;
        let order = self.direct().then(|| {
            let order = p.next_order;
            p.next_order += 1;
            self.flying.fetch_add(bytes.len(), Ordering::Relaxed);
            p.slots.push_back(Slot {
                order,
                bytes: bytes.len(),
                handle: p.handle,
                cred: p.cred.clone(),
                done: None,
            });
            order
        });
        (p.handle, p.cred.clone(), start, bytes, order)
    }

    fn spawn_send(self: &Arc<Self>, id: InodeId, (handle, cred, start, bytes, order): Send) {
        let wb = self.clone();
        self.rt.spawn(async move {
            let Some(order) = order else {
                let r = wb.client.write(&cred, handle, start, bytes).await;
                wb.sent_one(id, r.map(drop));
                return;
            };
            let r = wb.put_slice(id, handle, &cred, start, bytes).await;
            let (done, error) = match r {
                Ok(done) => (done, None),
                Err(e) => {
                    tracing::warn!("a slice of {id:#x} at {start} was not written: {e}");
                    (None, Some(e))
                }
            };
            {
                let mut inodes = wb.inodes.lock();
                if let Some(p) = inodes.get_mut(&id) {
                    if let Some(e) = error
                        && p.error.is_none()
                    {
                        p.error = Some(e);
                    }
                    if let Some(s) = p.slots.iter_mut().find(|s| s.order == order) {
                        s.done = Some(done);
                    }
                }
            }
            wb.commit_next(id);
        });
    }

    /// A write through the servers ended with `r`.
    fn sent_one(&self, id: InodeId, r: Result<(), FsError>) {
        let mut inodes = self.inodes.lock();
        if let Some(p) = inodes.get_mut(&id) {
            p.in_flight -= 1;
            if let Err(e) = r
                && p.error.is_none()
            {
                p.error = Some(e);
            }
            Self::forget_if_idle(&mut inodes, id);
        }
        drop(inodes);
        self.sent.notify_waiters();
    }

    fn forget_if_idle(inodes: &mut FxHashMap<InodeId, Pending>, id: InodeId) {
        if inodes
            .get(&id)
            .is_some_and(|p| p.in_flight == 0 && p.buf.is_empty() && p.error.is_none())
        {
            inodes.remove(&id);
        }
    }

    /// Puts `bytes` (at `start`, within one chunk) into the store as a new slice object;
    /// returns what to commit, or `None` if the servers write data themselves (then the
    /// bytes went through them).
    async fn put_slice(
        &self,
        id: InodeId,
        handle: u64,
        cred: &Credentials,
        start: u64,
        bytes: Vec<u8>,
    ) -> Result<Option<(CommittedSlice, u64)>, FsError> {
        let Some(direct) = &self.direct else {
            return Err(fs_err!(EIO, "no HTTP client for the object store"));
        };
        let chunk = start / CHUNK_BYTES;
        let pos = (start % CHUNK_BYTES) as u32;
        let len = bytes.len() as u32;
        let end = start + u64::from(len);
        let mut last = None;
        for _ in 0..PUT_TRIES {
            let granted = self.granted(id, handle, cred).await;
            self.mode.learn(&granted);
            let (object, expires) = match granted {
                Ok(g) => g,
                Err(e) if through_servers(&e) => {
                    self.client.write(cred, handle, start, bytes).await?;
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            let r = SliceRef {
                object: object.object,
                pos,
                len,
            };
            let body = bytes::Bytes::from(encode_slice(chunk, &r, &bytes));
            match direct.put_new(&object.put_url, body).await {
                Ok(()) => {
                    let slice = CommittedSlice {
                        chunk,
                        r,
                        token: object.token,
                        expires,
                    };
                    return Ok(Some((slice, end)));
                }
                Err(DirectError::Exists) => {
                    tracing::debug!("slice object {:#x} of {id:#x} exists: another", r.object);
                    last = Some(DirectError::Exists);
                }
                Err(DirectError::Stale(s)) => {
                    // Expired, or its key revoked: none of the file's grants will do.
                    self.grants.lock().remove(&id);
                    last = Some(DirectError::Stale(s));
                }
                Err(e) => return Err(e.into_fs("writing to the object store")),
            }
        }
        Err(last.map_or_else(
            || fs_err!(EIO, "writing to the object store failed"),
            |e| e.into_fs("writing to the object store"),
        ))
    }

    /// A granted object of file `id` (asking the servers for more when none is left).
    async fn granted(
        &self,
        id: InodeId,
        handle: u64,
        cred: &Credentials,
    ) -> Result<(GrantedObject, u64), FsError> {
        let now = unix_now();
        {
            let mut grants = self.grants.lock();
            if let Some(pool) = grants.get_mut(&id) {
                if pool.use_until > now
                    && let Some(o) = pool.objects.pop_front()
                {
                    return Ok((o, pool.expires));
                }
                grants.remove(&id);
            }
        }
        let mut grant = self.client.data_grant(cred, handle, GRANT_BATCH).await?;
        if grant.id != id || grant.objects.is_empty() {
            return Err(fs_err!(
                EIO,
                "the servers granted {} objects of {:#x} for file {id:#x}",
                grant.objects.len(),
                grant.id
            ));
        }
        let first = grant.objects.remove(0);
        let life = grant.expires.saturating_sub(now);
        let margin = GRANT_MARGIN.as_secs().min(life / 3);
        let mut grants = self.grants.lock();
        if grants.len() >= GRANT_POOLS_MAX {
            grants.clear();
        }
        let pool = grants.entry(id).or_insert_with(|| GrantPool {
            generation: grant.generation,
            objects: VecDeque::new(),
            expires: grant.expires,
            use_until: 0,
        });
        if pool.generation != grant.generation || pool.expires > grant.expires {
            pool.objects.clear();
        }
        pool.generation = grant.generation;
        pool.expires = grant.expires;
        pool.use_until = grant.expires.saturating_sub(margin);
        pool.objects.extend(grant.objects);
        Ok((first, grant.expires))
    }

    /// Starts the commit of the finished slices at the head of `id`'s order, unless one
    /// is in flight (it starts the next when it ends). Slices that need no commit leave.
    fn commit_next(self: &Arc<Self>, id: InodeId) {
        let batch = {
            let mut inodes = self.inodes.lock();
            let Some(p) = inodes.get_mut(&id) else {
                return;
            };
            let mut left = 0;
            while p
                .slots
                .front()
                .is_some_and(|s| matches!(s.done, Some(None)))
            {
                if let Some(s) = p.slots.pop_front() {
                    left += 1;
                    self.flying.fetch_sub(s.bytes, Ordering::Relaxed);
                }
            }
            p.in_flight -= left;
            let mut batch: Vec<(CommittedSlice, u64)> = Vec::new();
            let (mut handle, mut cred) = (0, None);
            if !p.committing {
                for s in &p.slots {
                    let Some(Some(done)) = &s.done else {
                        break;
                    };
                    if batch.len() >= COMMIT_SLICES_MAX || cred.is_some() && (handle != s.handle) {
                        break;
                    }
                    handle = s.handle;
                    cred.get_or_insert_with(|| s.cred.clone());
                    batch.push(done.clone());
                }
            }
            if batch.is_empty() {
                Self::forget_if_idle(&mut inodes, id);
                None
            } else {
                p.committing = true;
                cred.map(|c| (handle, c, batch))
            }
        };
        self.sent.notify_waiters();
        let Some((handle, cred, batch)) = batch else {
            return;
        };
        let wb = self.clone();
        self.rt.spawn(async move {
            let n = batch.len();
            let end = batch.iter().map(|(_, e)| *e).max().unwrap_or(0);
            let slices = batch.into_iter().map(|(s, _)| s).collect();
            let r = wb.client.commit_slices(&cred, handle, slices, end).await;
            if let Some(hook) = wb.on_commit.get() {
                hook(id);
            }
            {
                let mut inodes = wb.inodes.lock();
                if let Some(p) = inodes.get_mut(&id) {
                    for _ in 0..n {
                        if let Some(s) = p.slots.pop_front() {
                            wb.flying.fetch_sub(s.bytes, Ordering::Relaxed);
                        }
                    }
                    p.in_flight -= n;
                    p.committing = false;
                    if let Err(e) = r {
                        tracing::warn!("a commit of {n} slices of {id:#x} failed: {e}");
                        wb.grants.lock().remove(&id);
                        if p.error.is_none() {
                            p.error = Some(e);
                        }
                    }
                }
            }
            wb.commit_next(id);
        });
    }

    /// Waits until a send of `id` ends (or none is in flight and nothing waits for room).
    async fn wait_sent(&self, id: InodeId) {
        let woken = self.sent.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if self
            .inodes
            .lock()
            .get(&id)
            .is_none_or(|p| p.in_flight == 0 && p.buf.is_empty())
        {
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
                if !p.buf.is_empty() && self.may_send(p) {
                    Some(self.take(p))
                } else if p.in_flight > 0 || !p.buf.is_empty() {
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
