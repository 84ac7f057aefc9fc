//! Reads straight from the object store: on a store the servers do not read themselves
//! (S3), a read gets the file's layout from its server (`Layout`: each chunk's slice refs
//! and presigned URLs to get their objects) and gets the bytes from the store, the parts
//! of a read in parallel, zeros without a request. An EOPNOTSUPP means the servers read
//! data themselves: the mount then reads through them, as it learns once (`DirectMode`).
//!
//! A file's layout is kept (per window of `LAYOUT_CHUNKS_MAX` chunks) until it may be
//! out of date: another open of the file (close-to-open), a change of the file on this
//! mount (its commits, a write through the servers, a truncation), a callback naming the
//! file (another client changed it), attributes that show a new size or mtime, or its
//! URLs getting close to their expiry. A GET the store refuses (403, 404: the URL expired,
//! or compaction or a truncation freed the object since) gets the layout again once and
//! tries again.
//!
//! Read-ahead: a handle that reads sequentially gets whole chunks, and the next
//! `READ_AHEAD_CHUNKS` chunks of its file are fetched in the background; chunks are kept
//! with the layout they came from (dropped with it) and at most `CACHED_CHUNKS_MAX` per
//! mount, the oldest dropped first. Random reads get just the blocks they need.

use crate::writebehind::DirectMode;
use kochab_client::Client;
use kochab_client::direct::{DirectError, DirectIo};
use kochab_proto::layout::{
    ChunkLayout, Layout, decode_slice_range, resolve_slices, slice_fetch_range,
};
use kochab_proto::{
    CHUNK_BYTES, Credentials, FsError, InodeId, Invalidation, LAYOUT_CHUNKS_MAX, TimeNs, fs_err,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::OnceCell;

/// Chunks fetched ahead of a sequential reader: 32 MiB, two seconds of a fast link to the
/// store, so that GETs of several chunks are always in flight.
pub const READ_AHEAD_CHUNKS: u64 = 8;
/// Chunks a mount keeps in memory at most (128 MiB): read-ahead for a few sequential
/// readers at once.
pub const CACHED_CHUNKS_MAX: usize = 32;
/// A read this close to the end of the handle's last one counts as sequential: the
/// kernel's own read-ahead sends several reads at once, which arrive out of order.
const SEQUENTIAL_SLACK: u64 = 4 << 20;
/// A layout is used only while this much of its URLs' life is left (at most a third of
/// it, for tests with short grants).
const LAYOUT_MARGIN_SECS: u64 = 30;
/// Handles whose last read is remembered (for read-ahead) at most.
const HANDLES_MAX: usize = 1 << 16;

type Cell<T> = Arc<OnceCell<Arc<T>>>;

/// What is kept of one file: layout windows and chunk data, all from one epoch (a new
/// `FileCache` replaces it when it may be out of date).
#[derive(Default)]
struct FileCache {
    windows: Mutex<FxHashMap<u64, Cell<(Layout, u64)>>>,
    chunks: Mutex<FxHashMap<u64, Cell<Vec<u8>>>>,
    /// The file's (mtime, size) as attributes last showed them.
    attr: Mutex<Option<(TimeNs, u64)>>,
}

pub struct DirectReads {
    client: Client,
    io: Option<DirectIo>,
    mode: Arc<DirectMode>,
    rt: tokio::runtime::Handle,
    files: Mutex<FxHashMap<InodeId, Arc<FileCache>>>,
    /// Per handle, where its last read ended.
    last_end: Mutex<FxHashMap<u64, u64>>,
    /// Chunks kept, oldest first.
    kept: Mutex<VecDeque<(InodeId, u64)>>,
}

/// Why a direct read failed: `Stale` asks for the layout again.
enum ReadErr {
    Stale,
    Fs(FsError),
}

impl From<DirectError> for ReadErr {
    fn from(e: DirectError) -> ReadErr {
        match e {
            DirectError::Stale(_) => ReadErr::Stale,
            e => ReadErr::Fs(e.into_fs("reading from the object store")),
        }
    }
}

impl From<FsError> for ReadErr {
    fn from(e: FsError) -> ReadErr {
        ReadErr::Fs(e)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl DirectReads {
    pub fn new(
        client: Client,
        io: Option<DirectIo>,
        mode: Arc<DirectMode>,
        rt: tokio::runtime::Handle,
    ) -> Arc<DirectReads> {
        Arc::new(DirectReads {
            client,
            io,
            mode,
            rt,
            files: Mutex::new(FxHashMap::default()),
            last_end: Mutex::new(FxHashMap::default()),
            kept: Mutex::new(VecDeque::new()),
        })
    }

    /// Forgets what is kept of `id` (its layout may be out of date).
    pub fn drop_file(&self, id: InodeId) {
        self.files.lock().remove(&id);
    }

    /// A callback: what it names may have changed elsewhere.
    pub fn called_back(&self, list: &[Invalidation]) {
        for i in list {
            match i {
                Invalidation::Inode { id } => self.drop_file(*id),
                Invalidation::Everything => self.files.lock().clear(),
                _ => {}
            }
        }
    }

    /// Attributes of file `id` as a reply shows them: a new size or mtime drops its layout.
    pub fn seen_attr(&self, id: InodeId, mtime: TimeNs, size: u64) {
        let mut files = self.files.lock();
        let Some(f) = files.get(&id) else {
            return;
        };
        let mut attr = f.attr.lock();
        match *attr {
            Some(was) if was != (mtime, size) => {
                drop(attr);
                files.remove(&id);
            }
            Some(_) => {}
            None => *attr = Some((mtime, size)),
        }
    }

    /// The handle is closed.
    pub fn closed(&self, handle: u64) {
        self.last_end.lock().remove(&handle);
    }

    fn file(&self, id: InodeId) -> Arc<FileCache> {
        self.files.lock().entry(id).or_default().clone()
    }

    /// Reads `size` bytes at `offset` of file `id` through `handle` from the store; `None`
    /// if the servers read data themselves (read through them).
    pub async fn read(
        self: &Arc<Self>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        offset: u64,
        size: u32,
    ) -> Option<Result<Vec<u8>, FsError>> {
        self.io.as_ref()?;
        if !self.mode.may_be_direct() {
            return None;
        }
        let sequential = {
            let mut last = self.last_end.lock();
            if last.len() >= HANDLES_MAX {
                last.clear();
            }
            let end = offset + u64::from(size);
            let e = last.entry(handle).or_insert(0);
            let seq = offset.abs_diff(*e) <= SEQUENTIAL_SLACK;
            *e = (*e).max(end);
            if !seq {
                *e = end;
            }
            seq
        };
        let mut tried_again = false;
        loop {
            let file = self.file(id);
            match self
                .read_file(&file, cred, id, handle, offset, size, sequential)
                .await
            {
                Ok(b) => return Some(Ok(b)),
                Err(ReadErr::Stale) if !tried_again => {
                    tracing::debug!("the layout of {id:#x} is stale: getting it again");
                    self.forget(id, &file);
                    tried_again = true;
                }
                Err(ReadErr::Stale) => {
                    return Some(Err(fs_err!(
                        EIO,
                        "the object store refuses the slices of file {id:#x} even with a fresh layout"
                    )));
                }
                Err(ReadErr::Fs(e)) if crate::writebehind::through_servers(&e) => {
                    self.mode.learn::<()>(&Err(e));
                    return None;
                }
                Err(ReadErr::Fs(e)) => return Some(Err(e)),
            }
        }
    }

    /// Drops `file` if it is still what is kept of `id`.
    fn forget(&self, id: InodeId, file: &Arc<FileCache>) {
        let mut files = self.files.lock();
        if files.get(&id).is_some_and(|f| Arc::ptr_eq(f, file)) {
            files.remove(&id);
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn read_file(
        self: &Arc<Self>,
        file: &Arc<FileCache>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        offset: u64,
        size: u32,
        sequential: bool,
    ) -> Result<Vec<u8>, ReadErr> {
        let first = offset / CHUNK_BYTES;
        let layout = self.window(file, cred, handle, first).await?;
        let file_size = layout.0.size;
        let end = (offset + u64::from(size)).min(file_size);
        if end <= offset {
            return Ok(Vec::new());
        }
        let last = (end - 1) / CHUNK_BYTES;
        let mut out = Vec::with_capacity((end - offset) as usize);
        for c in first..=last {
            let base = c * CHUNK_BYTES;
            let a = (offset.max(base) - base) as u32;
            let b = (end.min(base + CHUNK_BYTES) - base) as u32;
            if sequential {
                let data = self.chunk(file, cred, id, handle, c, file_size).await?;
                let got = data.get(a as usize..(b as usize).min(data.len()));
                out.extend_from_slice(got.unwrap_or_default());
                // A chunk shorter than asked for ends the file as the layout saw it.
                if (data.len() as u32) < b {
                    break;
                }
            } else {
                let w = self.window(file, cred, handle, c).await?;
                let cl = w.0.chunks.iter().find(|l| l.chunk == c);
                out.extend_from_slice(&self.fetch(cl, c, a, b).await?);
            }
        }
        if sequential {
            self.read_ahead(file, cred, id, handle, last, file_size);
        }
        Ok(out)
    }

    /// The layout window holding chunk `c` (fetched once per `file`; a window whose URLs
    /// are close to their expiry makes the layout stale).
    async fn window(
        &self,
        file: &Arc<FileCache>,
        cred: &Credentials,
        handle: u64,
        c: u64,
    ) -> Result<Arc<(Layout, u64)>, ReadErr> {
        let w = c / u64::from(LAYOUT_CHUNKS_MAX);
        let cell = file.windows.lock().entry(w).or_default().clone();
        let got = cell
            .get_or_try_init(|| async {
                let now = unix_now();
                let first = w * u64::from(LAYOUT_CHUNKS_MAX);
                let l = self
                    .client
                    .layout(cred, handle, first, LAYOUT_CHUNKS_MAX)
                    .await?;
                self.mode.learn(&Ok::<(), FsError>(()));
                let life = l.expires.saturating_sub(now);
                // At least this read: a clock behind the server's is answered by the
                // store refusing the URLs (a refetch), not by refusing to try them.
                let use_until = (l.expires - LAYOUT_MARGIN_SECS.min(life / 3)).max(now + 1);
                Ok::<_, FsError>(Arc::new((l, use_until)))
            })
            .await?
            .clone();
        if got.1 <= unix_now() {
            return Err(ReadErr::Stale);
        }
        Ok(got)
    }

    /// The bytes of chunk `c` (as long as the file's size lets it be), fetched once per
    /// `file` and kept (within the mount's bound).
    #[allow(clippy::too_many_arguments)]
    async fn chunk(
        self: &Arc<Self>,
        file: &Arc<FileCache>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        c: u64,
        file_size: u64,
    ) -> Result<Arc<Vec<u8>>, ReadErr> {
        let (cell, new) = {
            let mut chunks = file.chunks.lock();
            match chunks.get(&c) {
                Some(cell) => (cell.clone(), false),
                None => {
                    let cell: Cell<Vec<u8>> = Default::default();
                    chunks.insert(c, cell.clone());
                    (cell, true)
                }
            }
        };
        if new {
            self.keep(id, c);
        }
        let stale = std::sync::atomic::AtomicBool::new(false);
        let got = cell
            .get_or_try_init(|| async {
                let base = c * CHUNK_BYTES;
                let len = file_size.saturating_sub(base).min(CHUNK_BYTES) as u32;
                let w = self.window(file, cred, handle, c).await.map_err(|e| {
                    stale.store(
                        matches!(e, ReadErr::Stale),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    as_fs(e)
                })?;
                let cl = w.0.chunks.iter().find(|l| l.chunk == c);
                match self.fetch(cl, c, 0, len).await {
                    Ok(b) => Ok(Arc::new(b)),
                    Err(e) => {
                        stale.store(
                            matches!(e, ReadErr::Stale),
                            std::sync::atomic::Ordering::Relaxed,
                        );
                        Err(as_fs(e))
                    }
                }
            })
            .await;
        match got {
            Ok(b) => Ok(b.clone()),
            Err(_) if stale.into_inner() => Err(ReadErr::Stale),
            Err(e) => Err(ReadErr::Fs(e)),
        }
    }

    /// Notes chunk `c` of `id` kept, dropping the mount's oldest beyond the bound.
    fn keep(&self, id: InodeId, c: u64) {
        let mut kept = self.kept.lock();
        kept.push_back((id, c));
        while kept.len() > CACHED_CHUNKS_MAX {
            let Some((old, oc)) = kept.pop_front() else {
                break;
            };
            let f = self.files.lock().get(&old).cloned();
            if let Some(f) = f {
                f.chunks.lock().remove(&oc);
            }
        }
    }

    /// Starts fetching the chunks after `last` that a sequential reader will want next.
    fn read_ahead(
        self: &Arc<Self>,
        file: &Arc<FileCache>,
        cred: &Credentials,
        id: InodeId,
        handle: u64,
        last: u64,
        file_size: u64,
    ) {
        let chunks = file_size.div_ceil(CHUNK_BYTES);
        for c in last + 1..(last + 1 + READ_AHEAD_CHUNKS).min(chunks) {
            if file.chunks.lock().contains_key(&c) {
                continue;
            }
            let (me, file, cred) = (self.clone(), file.clone(), cred.clone());
            self.rt.spawn(async move {
                if let Err(ReadErr::Fs(e)) = me.chunk(&file, &cred, id, handle, c, file_size).await
                {
                    tracing::debug!("read-ahead of chunk {c} of {id:#x} failed: {e}");
                }
            });
        }
    }

    /// Bytes `[a, b)` of chunk `c` as `layout` has them (no layout: zeros), the slices'
    /// parts got from the store in parallel.
    async fn fetch(
        &self,
        layout: Option<&ChunkLayout>,
        c: u64,
        a: u32,
        b: u32,
    ) -> Result<Vec<u8>, ReadErr> {
        let mut out = vec![0u8; (b - a) as usize];
        let Some(layout) = layout else {
            return Ok(out);
        };
        let Some(io) = &self.io else {
            return Err(ReadErr::Fs(fs_err!(
                EIO,
                "no HTTP client for the object store"
            )));
        };
        let mut gets = tokio::task::JoinSet::new();
        for part in resolve_slices(&layout.refs, a..b) {
            let Some(r) = part.from else {
                continue;
            };
            let Some(i) = layout.refs.iter().rposition(|x| *x == r) else {
                continue;
            };
            let Some(url) = layout.get_urls.get(i).filter(|u| !u.is_empty()) else {
                return Err(ReadErr::Fs(fs_err!(
                    EIO,
                    "the layout of chunk {c} has no URL for slice object {:#x}",
                    r.object
                )));
            };
            let (io, url) = (io.clone(), url.clone());
            gets.spawn(async move {
                let (start, end) = slice_fetch_range(&r, part.range);
                let got = io.get_range(&url, start, end).await?;
                let data = decode_slice_range(c, &r, part.range, &got).map_err(|e| {
                    ReadErr::Fs(fs_err!(
                        EIO,
                        "slice object {:#x} of chunk {c} is damaged: {e}",
                        r.object
                    ))
                })?;
                Ok::<_, ReadErr>((part.range.0, data))
            });
        }
        while let Some(done) = gets.join_next().await {
            let (at, data) = done.map_err(|e| fs_err!(EIO, "a GET of a slice failed: {e}"))??;
            let at = (at - a) as usize;
            out[at..at + data.len()].copy_from_slice(&data);
        }
        Ok(out)
    }
}

fn as_fs(e: ReadErr) -> FsError {
    match e {
        ReadErr::Stale => fs_err!(EIO, "the layout is stale"),
        ReadErr::Fs(e) => e,
    }
}
