//! Kochab's FUSE adapter.
//!
//! Every kernel request is handed to a task on a tokio runtime, which calls the cluster
//! through the native client and answers the kernel from there, so many requests are in
//! flight at once. Inode numbers are Kochab inode ids mixed by a fixed bijection
//! ([`ino_of_id`]; the root is shown as 1).
//!
//! Caching (see docs/ARCHITECTURE.md): with leases (the mount's default) the kernel caches
//! entries, negative entries and attributes for what is left of the servers' lease, and a
//! callback makes it drop them before another client's change is acknowledged
//! (`coherence`); without leases, for `attr_ttl`/`entry_ttl` (1 s), negative lookups not at
//! all. In a directory whose every name the client knows, a lookup is answered here: of an
//! absent name, and of a file this mount made (`known`). A directory this mount just
//! changed is answered from the attributes the change's
//! reply carried (see `kochab_client::dircache`); the page cache of a
//! file is kept across opens only if its size and mtime did not change, and the kernel
//! drops it when a getattr shows a new mtime (auto_inval_data) or a callback says another
//! client changed the file; small sequential writes
//! are gathered in the mount and sent in large requests (`writebehind`; at the latest on
//! close, fsync, or any request that shows the file's size or data), not in the kernel
//! (no writeback cache, which would make the kernel ignore other mounts' sizes).

mod coherence;
mod creds;
mod dir_opens;
mod directread;
mod interrupts;
mod known;
mod listing;
mod loops;
mod uring;
mod writebehind;

use creds::GroupCache;
use fuser::{
    AccessFlags, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, RequestId,
    SessionACL, TimeOrNow, WriteFlags,
};
use interrupts::Interrupts;
use kochab_client::Client;
use kochab_proto::{
    AtimeRule, Attr, Credentials, FileKind, FsError, InodeId, Invalidation, LockKind, LockSpec,
    SetAttrs, TimeNs, TimeSet,
};
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// FUSE's inode number of the root directory.
const FUSE_ROOT: u64 = 1;
/// Entries fetched per readdir round trip.
const READDIR_PAGE: u32 = 512;
/// Largest write the kernel sends (needs FUSE_MAX_PAGES).
const MAX_WRITE: u32 = 1 << 20;
/// Longest pause between attempts of a blocking lock (F_SETLKW, flock without LOCK_NB).
const LOCK_POLL_MAX: Duration = Duration::from_millis(100);

/// Mount settings.
#[derive(Clone, Debug)]
pub struct MountConfig {
    pub attr_ttl: Duration,
    pub entry_ttl: Duration,
    /// Request loops reading /dev/fuse, each with its own descriptor (tasks on the
    /// runtime; see `loops`).
    pub threads: usize,
    /// The mount's source as /proc/mounts shows it: the cluster's address, so that tools
    /// (findmnt -S, xfstests) find the mount by what was mounted.
    pub source: String,
    /// When reads set access times (the atime mount options; relatime by default).
    pub atime: AtimeRule,
    /// A read-only mount (`-o ro`): the kernel refuses every change, and reads set no
    /// access times.
    pub read_only: bool,
    /// Honour setuid and setgid bits (`-o suid`). Off by default: any key holder can write
    /// a setuid-root file into the cluster, so a mount that honoured the bits would hand
    /// root to every local user of it (see docs/SECURITY.md).
    pub suid: bool,
    /// Allow opening device nodes (`-o dev`). Off by default for the same reason: a key
    /// holder can create a world-writable node of any device number.
    pub dev: bool,
    /// Gather small sequential writes in the mount (see `writebehind`); `-o sync` turns it
    /// off, so every write(2) reaches the servers before it returns.
    pub write_behind: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            attr_ttl: Duration::from_secs(1),
            entry_ttl: Duration::from_secs(1),
            threads: 2,
            source: "kochab".into(),
            atime: AtimeRule::Relative,
            read_only: false,
            suid: false,
            dev: false,
            write_behind: true,
        }
    }
}

struct Inner {
    client: Client,
    rt: tokio::runtime::Handle,
    root: InodeId,
    config: MountConfig,
    /// Lookups the kernel holds per inode (forget gives them back).
    lookups: Mutex<FxHashMap<u64, u64>>,
    /// (mtime, size) seen at the last open, to decide whether the page cache is still good.
    seen_at_open: Mutex<FxHashMap<InodeId, (TimeNs, u64)>>,
    /// Inodes on which this mount ever took a lock: only their closes need to tell the
    /// server to release locks (saves a round trip on every other close).
    locked: Mutex<rustc_hash::FxHashSet<InodeId>>,
    /// Per inode, the handles open here through which a lock was asked for: a lock request
    /// through another handle may have to wait for their closes (see `closes_done`).
    lock_handles: Mutex<FxHashMap<InodeId, rustc_hash::FxHashSet<u64>>>,
    /// Open setuid/setgid files: a non-root write clears those bits on the servers, and the
    /// kernel's cached mode must then be dropped.
    privileged: Mutex<rustc_hash::FxHashSet<InodeId>>,
    /// Sends invalidations to the kernel (set once the session is mounted).
    notifier: std::sync::OnceLock<fuser::Notifier>,
    /// The thread that drops inodes' cached pages for callbacks (see `coherence::Kernel`).
    page_dropper: std::sync::OnceLock<std::sync::mpsc::Sender<u64>>,
    groups: GroupCache,
    /// Waiting lock requests, which a signal to their caller interrupts.
    interrupts: Interrupts,
    /// Open handles per inode, and which handles bypass the page cache: a direct write
    /// must drop the pages other handles of the inode may have cached.
    opens: Mutex<Opens>,
    /// Closes in flight of handles of inodes that had locks on this mount, and a wake-up
    /// when one ends (see `Inner::closes_done`).
    closing: Mutex<FxHashMap<InodeId, u32>>,
    closed: tokio::sync::Notify,
    /// Rings when a lock of this mount may have been let go (an unlock, a close that
    /// released locks): its waiting lock requests try again at once instead of at their
    /// next poll. Waiters on other mounts still poll.
    unlocked: tokio::sync::Notify,
    /// Directory opens not yet answered by their servers (see `dir_opens`).
    dir_opens: dir_opens::DirOpens,
    /// Writes gathered in the mount before they are sent.
    wb: Arc<writebehind::WriteBehind>,
    /// Reads straight from the object store (see `directread`).
    reads: Arc<directread::DirectReads>,
    /// How long the servers' leases last (zero: no leases, the TTLs of `config` apply).
    lease: Duration,
    /// Names handed to the kernel with a TTL, per directory (see `coherence`).
    names: Arc<coherence::HandedNames>,
    /// The rest of readdirplus pages, per directory handle (see `listing`).
    listings: listing::Listings,
    /// Files this mount created, which have no security.capability (see `getxattr`), and
    /// until when the lease on each runs at least.
    bare: Mutex<FxHashMap<InodeId, Instant>>,
    /// Files this mount made, by name, with the attributes the kernel last saw (see
    /// `known`): lookups of them in complete directories need no round trip.
    known: Mutex<known::KnownNames>,
}

#[derive(Default)]
struct Opens {
    per_inode: FxHashMap<InodeId, u32>,
    direct: rustc_hash::FxHashSet<u64>,
    /// Handles opened with O_APPEND (their offsets come from the kernel's idea of the
    /// size, so their writes are never held back).
    append: rustc_hash::FxHashSet<u64>,
}

/// The file system the kernel talks to.
#[derive(Clone)]
pub struct KochabFs {
    inner: Arc<Inner>,
}

/// The errno the kernel is given. A cluster still unreachable when the mount's retry limit
/// (`-o retry=`) runs out is EIO, as an NFS soft mount answers: ENOTCONN from a FUSE mount
/// reads "Transport endpoint is not connected", which users and tools take for a dead mount
/// process, and this one is alive and will serve again once its servers do.
fn errno(e: &FsError) -> Errno {
    match e.errno {
        kochab_proto::Errno::ENOTCONN | kochab_proto::Errno::ETIMEDOUT => Errno::EIO,
        other => Errno::from_i32(other.0),
    }
}

/// The errno of an operation on an inode the kernel named by its number: ENOENT there means
/// the inode is gone (another mount removed or replaced the name this kernel still caches
/// for up to entry_ttl), which the VFS must hear as ESTALE. Then open, stat, truncate,
/// chmod, utimensat and the like walk the path again with revalidation and act on what the
/// name is now (open with O_CREAT creates it); with ENOENT, sqlite on a second mount failed
/// to reopen its journal after the first mount had deleted it.
fn errno_of_inode(e: &FsError) -> Errno {
    if e.errno == kochab_proto::Errno::ENOENT {
        Errno::ESTALE
    } else {
        errno(e)
    }
}

fn time(ns: TimeNs) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

/// The nanoseconds of a time the kernel sent in a setattr. fuser 0.18's
/// `system_time_from_time` turns the kernel's (seconds < 0, nanoseconds) into
/// `UNIX_EPOCH - (|seconds| + nanoseconds)` instead of `UNIX_EPOCH - |seconds| +
/// nanoseconds`, so `touch -d '1969-12-31 23:59:59.25'` stored 23:59:58.75; this undoes it
/// (the kernel's nanoseconds are the sub-second part of the difference). Revisit when
/// fuser fixes its conversion.
fn ns_of(t: SystemTime) -> TimeNs {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos().min(i64::MAX as u128) as i64,
        Err(e) => {
            let d = e.duration();
            let secs = d.as_secs().min(i64::MAX as u64 / 1_000_000_000 - 1) as i64;
            -secs * 1_000_000_000 + i64::from(d.subsec_nanos())
        }
    }
}

/// The attributes of a negative entry: inode 0 tells the kernel the name is absent.
const NO_INODE: FileAttr = FileAttr {
    ino: INodeNo(0),
    size: 0,
    blocks: 0,
    atime: UNIX_EPOCH,
    mtime: UNIX_EPOCH,
    ctime: UNIX_EPOCH,
    crtime: UNIX_EPOCH,
    kind: FileType::RegularFile,
    perm: 0,
    nlink: 0,
    uid: 0,
    gid: 0,
    rdev: 0,
    blksize: 0,
    flags: 0,
};

fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDev => FileType::CharDevice,
        FileKind::BlockDev => FileType::BlockDevice,
    }
}

fn lock_kind(typ: i32) -> LockKind {
    match typ {
        libc::F_RDLCK => LockKind::Read,
        libc::F_WRLCK => LockKind::Write,
        _ => LockKind::Unlock,
    }
}

fn lock_typ(kind: LockKind) -> i32 {
    match kind {
        LockKind::Read => libc::F_RDLCK,
        LockKind::Write => libc::F_WRLCK,
        LockKind::Unlock => libc::F_UNLCK,
    }
}

impl KochabFs {
    /// A file system over `client`, running its work on `rt`.
    pub fn new(client: Client, rt: tokio::runtime::Handle, mut config: MountConfig) -> KochabFs {
        if config.read_only {
            config.atime = AtimeRule::Never;
        }
        let root = client.root();
        let mode = Arc::new(writebehind::DirectMode::default());
        let direct = match kochab_client::direct::DirectIo::new() {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!("{e}: file data goes through the servers");
                None
            }
        };
        let reads =
            directread::DirectReads::new(client.clone(), direct.clone(), mode.clone(), rt.clone());
        let wb = writebehind::WriteBehind::new(client.clone(), rt.clone(), mode, direct);
        wb.start_ager();
        let dropper = Arc::downgrade(&reads);
        wb.set_commit_hook(Arc::new(move |id| {
            if let Some(reads) = dropper.upgrade() {
                reads.drop_file(id);
            }
        }));
        let lease = client.lease();
        let inner = Arc::new(Inner {
            lease,
            names: Default::default(),
            listings: Default::default(),
            bare: Mutex::new(FxHashMap::default()),
            known: Mutex::new(known::KnownNames::default()),
            wb,
            reads,
            client,
            rt,
            root,
            config,
            lookups: Mutex::new(FxHashMap::default()),
            seen_at_open: Mutex::new(FxHashMap::default()),
            locked: Mutex::new(Default::default()),
            lock_handles: Mutex::new(Default::default()),
            notifier: std::sync::OnceLock::new(),
            page_dropper: std::sync::OnceLock::new(),
            privileged: Mutex::new(Default::default()),
            groups: GroupCache::default(),
            interrupts: Interrupts::default(),
            opens: Mutex::new(Opens::default()),
            closing: Mutex::new(FxHashMap::default()),
            closed: tokio::sync::Notify::new(),
            unlocked: tokio::sync::Notify::new(),
            dir_opens: dir_opens::DirOpens::default(),
        });
        if !lease.is_zero() {
            start_callbacks(&inner);
        }
        KochabFs { inner }
    }

    /// Gives the adapter the session's notifier (call right after mounting).
    pub fn set_notifier(&self, notifier: fuser::Notifier) {
        let _ = self.inner.notifier.set(notifier);
    }

    /// The mount options Kochab uses.
    pub fn fuse_config(&self) -> Config {
        let mut c = Config::default();
        c.mount_options = vec![
            MountOption::FSName(self.inner.config.source.clone()),
            MountOption::Subtype("kochab".into()),
            MountOption::DefaultPermissions,
            if self.inner.config.dev {
                MountOption::Dev
            } else {
                MountOption::NoDev
            },
            if self.inner.config.suid {
                MountOption::Suid
            } else {
                MountOption::NoSuid
            },
        ];
        // The kernel leaves access times to FUSE file systems; the servers set them on
        // reads as the rule says (relatime, the kernel's default, or strictatime).
        if self.inner.config.atime == AtimeRule::Never {
            c.mount_options.push(MountOption::NoAtime);
        }
        if self.inner.config.read_only {
            c.mount_options.push(MountOption::RO);
        }
        // Every user may use the mount; permissions are checked by the kernel (default
        // permissions) and again by the servers.
        c.acl = SessionACL::All;
        c.n_threads = Some(self.inner.config.threads.max(1));
        c.clone_fd = true;
        if loops::on_runtime() {
            c.loop_runner = Some(loops::runner(self.inner.rt.clone(), MAX_WRITE as usize));
        }
        c
    }

    /// Runs `f` on the runtime with the caller's credentials.
    fn spawn<F, Fut>(&self, req: &Request, f: F)
    where
        F: FnOnce(Arc<Inner>, Credentials) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let cred = self
            .inner
            .groups
            .credentials(req.uid(), req.gid(), req.pid());
        let inner = self.inner.clone();
        let arrived = Instant::now();
        let task = coherence::ARRIVED.scope(arrived, async move { f(inner, cred).await });
        // A request from a FUSE queue runs on that queue's thread (see `uring`).
        match uring::queue_runtime() {
            Some(rt) => drop(rt.spawn(task)),
            None => drop(self.inner.rt.spawn(task)),
        }
    }
}

/// Starts the thread that drops what callbacks revoke, and has the client hand callbacks
/// to it (see `coherence`).
fn start_callbacks(inner: &Arc<Inner>) {
    let (pages, inos) = std::sync::mpsc::channel::<u64>();
    let weak = Arc::downgrade(inner);
    let dropper = std::thread::Builder::new()
        .name("kochab-pages".into())
        .spawn(move || {
            while let Ok(first) = inos.recv() {
                let mut todo: FxHashSet<u64> = std::iter::once(first).collect();
                todo.extend(inos.try_iter());
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                if let Some(n) = inner.notifier.get() {
                    for ino in todo {
                        let _ = n.inval_inode(INodeNo(ino), 0, 0);
                    }
                }
            }
        });
    if dropper.is_ok() {
        let _ = inner.page_dropper.set(pages);
    }
    let (tx, rx) = std::sync::mpsc::channel::<coherence::Work>();
    let weak = Arc::downgrade(inner);
    let spawned = std::thread::Builder::new()
        .name("kochab-callbacks".into())
        .spawn(move || {
            while let Ok((list, answer)) = rx.recv() {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                inner.listings.changed();
                coherence::drop_cached(&*inner, &inner.names, &list);
                // Answered once the kernel dropped it all.
                drop(answer);
            }
        });
    match spawned {
        Ok(_) => {
            let tx = Mutex::new(tx);
            let weak = Arc::downgrade(inner);
            inner.client.on_callback(Arc::new(move |mut list, answer| {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                inner.not_bare(&list);
                inner.known.lock().called_back(&list);
                inner.reads.called_back(&list);
                if list.contains(&Invalidation::Everything) {
                    // A lost connection: its server forgot which writers it called back.
                    inner.wb.write_through(None, inner.lease * 2);
                    let wb = inner.wb.clone();
                    inner.rt.spawn(async move { wb.settle_held(None).await });
                }
                // Not drops: made here, in the order the callbacks came.
                let mut flushes = Vec::new();
                list.retain(|i| match *i {
                    Invalidation::Flush {
                        id,
                        write_through_ms,
                    } => {
                        inner
                            .wb
                            .write_through(Some(id), Duration::from_millis(write_through_ms));
                        flushes.push(id);
                        false
                    }
                    Invalidation::Hold { id } => {
                        inner.wb.hold_again(id);
                        false
                    }
                    _ => true,
                });
                if flushes.is_empty() {
                    if list.is_empty() {
                        drop(answer);
                    } else {
                        let _ = tx.lock().send((list, answer));
                    }
                    return;
                }
                // Answered once what this mount held back of the files reached the servers.
                let tx = tx.lock().clone();
                let wb = inner.wb.clone();
                inner.rt.spawn(async move {
                    for id in flushes {
                        wb.settle_held(Some(id)).await;
                    }
                    if list.is_empty() {
                        drop(answer);
                    } else {
                        let _ = tx.send((list, answer));
                    }
                });
            }));
        }
        Err(e) => tracing::error!("no callback thread ({e}): the kernel caches by TTL only"),
    }
}

impl coherence::Kernel for Inner {
    fn ino(&self, id: InodeId) -> u64 {
        Inner::ino(self, id).0
    }

    fn inval_entry(&self, parent: u64, name: &[u8]) {
        if let Some(n) = self.notifier.get() {
            let _ = n.inval_entry(INodeNo(parent), OsStr::from_bytes(name));
        }
    }

    fn inval_inode(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            let _ = n.inval_inode(INodeNo(ino), 0, 0);
        }
    }

    fn inval_attrs(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            let _ = n.inval_inode(INodeNo(ino), -1, 0);
        }
    }

    fn drop_pages_later(&self, ino: u64) {
        let queued = self.page_dropper.get().is_some_and(|t| t.send(ino).is_ok());
        if !queued {
            self.inval_inode(ino);
        }
    }

    fn inc_epoch(&self) -> bool {
        let Some(n) = self.notifier.get() else {
            return false;
        };
        match n.inc_epoch() {
            Ok(()) => true,
            Err(e) => {
                static TOLD: std::sync::Once = std::sync::Once::new();
                TOLD.call_once(|| {
                    tracing::warn!(
                        "the kernel cannot make cached entries stale at once (FUSE_NOTIFY_INC_EPOCH, \
                         Linux 6.16: {e}); two mounts changing one directory may wait for each other"
                    )
                });
                false
            }
        }
    }

    fn held_inodes(&self) -> Vec<u64> {
        self.lookups.lock().keys().copied().collect()
    }

    fn forget_dir_attr(&self, id: Option<InodeId>) {
        self.client.forget_dir_attr(id);
    }
}

/// The kernel's inode number of a Kochab id, through a fixed bijection of u64 (murmur3's
/// 64-bit finaliser). The kernel's inode hash picks its bucket mostly from low bits, while
/// Kochab's ids keep a directory's place in their high bits (the id policy), so every
/// directory, and the k-th file of every directory, landed in one bucket: a third of all
/// CPU of a cold `find` went to walking those chains. Mixed numbers spread evenly.
pub fn ino_of_id(id: InodeId) -> u64 {
    let mut k = id;
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The Kochab id of a kernel inode number (the inverse of [`ino_of_id`]; a shift by 33 of
/// 64 bits undoes itself, and each odd multiplier has an inverse mod 2^64).
pub fn id_of_ino(ino: u64) -> InodeId {
    let mut k = ino;
    k ^= k >> 33;
    k = k.wrapping_mul(0x9cb4_b2f8_1293_37db);
    k ^= k >> 33;
    k = k.wrapping_mul(0x4f74_430c_22a5_4005);
    k ^ (k >> 33)
}

impl Inner {
    /// The Kochab id of the kernel's inode number. The root is 1 for the kernel; the id
    /// whose mixed number would be 1 takes the root's mixed number instead (a bijection).
    fn id(&self, ino: INodeNo) -> InodeId {
        if ino.0 == FUSE_ROOT {
            self.root
        } else if ino.0 == ino_of_id(self.root) {
            id_of_ino(FUSE_ROOT)
        } else {
            id_of_ino(ino.0)
        }
    }

    /// The generation a reply gives with `a`'s attributes. The root's is 0 whatever the
    /// servers keep (the birth time of its inode): the kernel made its root inode with
    /// generation 0, encodes that in the root's file handles, and resets any other it is
    /// told for the root (a LOOKUP of "..", the "." of a file-handle decode) with the
    /// warning "fuse: root generation should be zero".
    fn generation(&self, a: &Attr) -> Generation {
        Generation(if a.id == self.root { 0 } else { a.generation })
    }

    /// The kernel's inode number of a Kochab id (see [`ino_of_id`]).
    fn ino(&self, id: InodeId) -> INodeNo {
        INodeNo(if id == self.root {
            FUSE_ROOT
        } else {
            match ino_of_id(id) {
                FUSE_ROOT => ino_of_id(self.root),
                n => n,
            }
        })
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        self.known.lock().shows(a);
        if a.kind() == Some(FileKind::File) {
            self.reads.seen_attr(a.id, a.mtime, a.size);
        }
        FileAttr {
            ino: self.ino(a.id),
            size: a.size,
            blocks: a.blocks,
            atime: time(a.atime),
            mtime: time(a.mtime),
            ctime: time(a.ctime),
            crtime: time(a.btime),
            // Never a guess: the client answers EIO for attributes without a file type
            // (Reply::check_attrs), so only typed ones reach here.
            kind: a.kind().map_or(FileType::RegularFile, file_type),
            perm: (a.mode & 0o7777) as u16,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            blksize: a.blksize,
            flags: 0,
        }
    }

    /// Notes a file this mount just created: it has no extended attributes, and the lease
    /// its creation's reply granted holds for what is left of the lease since the request
    /// reached the mount.
    fn created(&self, id: InodeId) {
        if self.lease.is_zero() {
            return;
        }
        let Ok(arrived) = coherence::ARRIVED.try_with(|a| *a) else {
            return;
        };
        let until = arrived + self.lease;
        let mut bare = self.bare.lock();
        if bare.len() >= 1 << 16 {
            let now = Instant::now();
            bare.retain(|_, u| *u > now);
        }
        bare.insert(id, until);
    }

    /// Notes `parent/name`, which this mount just made, as the reply `a` shows it to the
    /// kernel (see `known`); called before the reply goes, under the kernel's lock of the
    /// directory.
    fn made(&self, parent: INodeNo, name: &[u8], a: &Attr) {
        if self.lease.is_zero() {
            return;
        }
        let until = coherence::ARRIVED.try_with(|t| *t + self.lease).ok();
        self.known.lock().made(self.id(parent), name, a, until);
    }

    /// The kernel's picture of `ino` may change without a reply showing it.
    fn changed(&self, ino: INodeNo) {
        self.known.lock().changed(self.id(ino));
        self.reads.drop_file(self.id(ino));
    }

    /// Forgets the files callbacks name: another client may have given them attributes.
    fn not_bare(&self, list: &[Invalidation]) {
        let mut bare = self.bare.lock();
        for what in list {
            match what {
                Invalidation::Inode { id } => {
                    bare.remove(id);
                }
                Invalidation::Everything => bare.clear(),
                _ => {}
            }
        }
    }

    /// Counts a lookup the kernel now holds.
    fn looked_up(&self, id: InodeId) {
        *self.lookups.lock().entry(self.ino(id).0).or_insert(0) += 1;
    }

    /// How long the kernel may cache an entry this request's reply shows.
    fn entry_ttl(&self) -> Duration {
        coherence::ttl(self.lease, self.config.entry_ttl)
    }

    /// How long the kernel may cache attributes this request's reply shows.
    fn attr_ttl(&self) -> Duration {
        coherence::ttl(self.lease, self.config.attr_ttl)
    }

    /// Notes a request that may hand the kernel `parent/name` (`None`: names of a listing),
    /// until the guard is dropped after its reply (see `coherence::HandedNames`).
    fn busy(&self, parent: INodeNo, name: Option<&[u8]>) -> Option<coherence::Busy> {
        (!self.lease.is_zero()).then(|| self.names.begin(parent.0, name))
    }

    /// Notes that the kernel caches `parent/name` (so that a callback can drop it).
    fn handed(&self, parent: INodeNo, name: &[u8], ttl: Duration) {
        if !self.lease.is_zero() && !ttl.is_zero() {
            self.names.handed(parent.0, name, ttl);
        }
    }

    /// Answers a lookup or a creation of `parent/name`. With leases an absent name is
    /// cached too (a negative entry: inode 0 with a TTL), so repeated lookups of it (a
    /// compiler's include path, a shell's PATH) cost no round trip.
    fn entry(&self, reply: ReplyEntry, parent: INodeNo, name: &[u8], r: Result<Attr, FsError>) {
        let ttl = self.entry_ttl();
        match r {
            Ok(a) => {
                self.looked_up(a.id);
                self.handed(parent, name, ttl);
                reply.entry(&ttl, &self.file_attr(&a), self.generation(&a));
            }
            Err(e)
                if e.errno == kochab_proto::Errno::ENOENT
                    && !self.lease.is_zero()
                    && !ttl.is_zero() =>
            {
                self.handed(parent, name, ttl);
                reply.entry(&ttl, &NO_INODE, Generation(0));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn empty(&self, reply: ReplyEmpty, r: Result<(), FsError>) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// FOPEN flags for a fresh open: keep the page cache only if the file is unchanged.
    /// Write-only handles (and O_DIRECT ones) bypass the page cache: nothing is read through
    /// them, writes go straight to the servers as they would anyway, and large writes are
    /// sent as several requests at once (async direct I/O).
    fn open_flags(&self, a: &Attr, flags: i32, handle: u64) -> FopenFlags {
        let mut f = FopenFlags::empty();
        // Not for setuid/setgid files: on a direct write the kernel leaves killing those
        // bits to the servers (FUSE_WRITE_KILL_SUIDGID) and keeps showing, and exec'ing
        // with, its cached mode for attr_ttl; through the page cache it kills them with a
        // setattr whose reply updates that cache, as ext4 would at once.
        let privileged = a.mode & (kochab_proto::mode::S_ISUID | kochab_proto::mode::S_ISGID) != 0;
        if privileged {
            self.privileged.lock().insert(a.id);
        }
        if !privileged && (flags & libc::O_DIRECT != 0 || flags & libc::O_ACCMODE == libc::O_WRONLY)
        {
            f |= FopenFlags::FOPEN_DIRECT_IO;
        }
        let now = (a.mtime, a.size);
        // strictatime: every read must reach the servers to set the access time.
        let strict = self.config.atime == AtimeRule::Always;
        if self.seen_at_open.lock().insert(a.id, now) == Some(now) && !strict {
            f |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        let mut opens = self.opens.lock();
        *opens.per_inode.entry(a.id).or_insert(0) += 1;
        if f.contains(FopenFlags::FOPEN_DIRECT_IO) {
            opens.direct.insert(handle);
        }
        if flags & libc::O_APPEND != 0 {
            opens.append.insert(handle);
        }
        f
    }

    /// True if a write through `handle` may wait in the mount (see `writebehind`): write
    /// behind is on, this is the inode's only open handle here, not O_APPEND, and the file
    /// has no setuid/setgid bits to clear.
    fn may_buffer(&self, id: InodeId, handle: u64) -> bool {
        if !self.config.write_behind || self.privileged.lock().contains(&id) {
            return false;
        }
        let opens = self.opens.lock();
        opens.per_inode.get(&id) == Some(&1) && !opens.append.contains(&handle)
    }

    /// Hands the kernel as much of `page` as its buffer takes, and keeps the rest (or the
    /// end of the listing) for the handle's next request.
    fn serve_page(&self, mut reply: ReplyDirectoryPlus, fh: u64, page: listing::Page) {
        let ttl = coherence::ttl_since(self.lease, self.config.entry_ttl, page.arrived);
        let dir = INodeNo(page.dir);
        self.listings.serve(fh, page, |e, attr| {
            let full = reply.add(
                self.ino(e.id),
                e.cookie,
                OsStr::from_bytes(&e.name),
                &ttl,
                &self.file_attr(attr),
                self.generation(attr),
            );
            if !full && e.name != b"." && e.name != b".." {
                // readdirplus entries count as lookups the kernel will forget.
                self.looked_up(e.id);
                self.handed(dir, &e.name, ttl);
            }
            full
        });
        reply.ok();
    }

    /// [`Inner::serve_page`] for a plain readdir: names, numbers and types only.
    fn serve_plain_page(&self, mut reply: ReplyDirectory, fh: u64, page: listing::Page) {
        self.listings.serve(fh, page, |e, _| {
            reply.add(
                self.ino(e.id),
                e.cookie,
                file_type(e.kind),
                OsStr::from_bytes(&e.name),
            )
        });
        reply.ok();
    }

    /// Forgets a closed handle.
    fn closed(&self, id: InodeId, handle: u64) {
        let mut opens = self.opens.lock();
        opens.direct.remove(&handle);
        opens.append.remove(&handle);
        if let Some(n) = opens.per_inode.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                opens.per_inode.remove(&id);
            }
        }
    }

    /// Waits until the closes of `id`'s handles that the kernel sent before now have
    /// reached the servers. The kernel sends the RELEASE of a last close in the background
    /// and lets close(2) return at once; the release ends the description's OFD locks and
    /// flock, so a lock request that follows it (from any process) must not overtake it.
    async fn closes_done(&self, id: InodeId, fh: u64) {
        // A release of another handle that locked may be on its way through the ring of
        // another CPU: taken first. (Costs a wake-up of each queue, so only then.)
        let others = self
            .lock_handles
            .lock()
            .get(&id)
            .is_some_and(|hs| hs.iter().any(|&h| h != fh));
        if others {
            uring::settled().await;
        }
        loop {
            let woken = self.closed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if !self.closing.lock().contains_key(&id) {
                return;
            }
            woken.await;
        }
    }

    /// Waits until every directory open this mount answered before now has reached the
    /// servers (sending those still held), so that a removal or rename from this mount
    /// never overtakes it.
    async fn dir_opens_done(&self) {
        self.send_dir_opens().await;
        self.dir_opens.in_flight_done().await;
    }

    /// Sends the directory opens held (see `dir_opens`), all at once.
    async fn send_dir_opens(&self) {
        self.send_taken_dir_opens(self.dir_opens.take()).await;
    }

    /// The timer task of held directory opens: sends each once held for `HOLD`.
    async fn send_due_dir_opens(&self) {
        loop {
            let (due, next) = self.dir_opens.take_due(Instant::now());
            self.send_taken_dir_opens(due).await;
            match next {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => return,
            }
        }
    }

    /// Sends directory opens taken from `dir_opens`, all at once.
    async fn send_taken_dir_opens(&self, taken: Vec<(u64, dir_opens::Held)>) {
        let n = taken.len();
        let mut opens = tokio::task::JoinSet::new();
        for (handle, held) in taken {
            let client = self.client.clone();
            opens.spawn(async move {
                let _ = client
                    .open_as(&held.cred, held.id, held.flags, handle)
                    .await;
            });
        }
        while opens.join_next().await.is_some() {}
        self.dir_opens.sent(n);
    }

    /// True if a write through `handle` bypassed the kernel's page cache while another
    /// handle of the inode is open on this mount (and may have pages of it cached).
    fn direct_write_beside_others(&self, id: InodeId, handle: u64) -> bool {
        let opens = self.opens.lock();
        opens.direct.contains(&handle) && opens.per_inode.get(&id).is_some_and(|&n| n > 1)
    }
}

fn name_bytes(name: &OsStr) -> Vec<u8> {
    name.as_bytes().to_vec()
}

impl Filesystem for KochabFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        for cap in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_POSIX_LOCKS,
            InitFlags::FUSE_FLOCK_LOCKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_AUTO_INVAL_DATA,
            InitFlags::FUSE_ASYNC_READ,
            InitFlags::FUSE_MAX_PAGES,
            InitFlags::FUSE_BIG_WRITES,
            InitFlags::FUSE_ASYNC_DIO,
            // Shared mappings of files opened with O_DIRECT (FOPEN_DIRECT_IO); the kernel
            // then writes back and drops mapped pages around each direct I/O.
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
            // File handles (name_to_handle_at, NFS export): the kernel finds an inode it
            // no longer caches by looking up "." (and a directory's parent by "..") in its
            // id; a reused id has another generation, so an old handle is ESTALE.
            InitFlags::FUSE_EXPORT_SUPPORT,
            // Neither FUSE_HANDLE_KILLPRIV nor its v2, although they would save the GETATTR
            // the kernel sends before every chown: with either, chown(fd, -1, -1) reaches
            // the file system as an empty SETATTR (v2 adds FATTR_KILL_SUIDGID, which fuser
            // does not pass on; v1 drops the mode change the kernel computed), so
            // setuid/setgid bits would survive it (the differential test found this).
        ] {
            if config.add_capabilities(cap).is_err() {
                tracing::info!("kernel lacks FUSE capability {cap:?}");
            }
        }
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn destroy(&mut self) {
        let wb = self.inner.wb.clone();
        let _ = self.inner.rt.block_on(async move {
            tokio::time::timeout(Duration::from_secs(30), wb.flush_all()).await
        });
        let client = self.inner.client.clone();
        // An unmount leaves nothing only this process could replay; then it releases this
        // mount's locks and handles at once instead of after the grace period.
        let _ = self.inner.rt.block_on(async move {
            if let Err(e) = client.wait_durable().await {
                tracing::error!("unmounting with changes not known durable: {e}");
            }
            tokio::time::timeout(Duration::from_secs(2), client.end_session()).await
        });
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let fs = &self.inner;
        let busy = fs.busy(parent, Some(name.as_bytes()));
        // A name absent from a directory whose every name this mount knows (one it made,
        // under a lease on its names): answered here, a negative entry for the time the
        // lease has left. The open(O_CREAT) of a new file looks its name up first.
        if let Some(ttl) = fs.client.known_absent(fs.id(parent), name.as_bytes()) {
            fs.handed(parent, name.as_bytes(), ttl);
            return reply.entry(&ttl, &NO_INODE, Generation(0));
        }
        // A file this mount made there, whose entry the kernel looks up again once its TTL
        // ran out (before an unlink, say): answered with what the kernel last saw of it.
        if let Some(entry_ttl) = fs.client.known_present(fs.id(parent), name.as_bytes()) {
            let known = fs
                .known
                .lock()
                .get(fs.id(parent), name.as_bytes(), Instant::now())
                .map(|(a, ttl)| (a.clone(), ttl));
            if let Some((a, attr_ttl)) = known
                && !fs.wb.pending(a.id)
            {
                fs.looked_up(a.id);
                fs.handed(parent, name.as_bytes(), entry_ttl);
                let attr = fs.file_attr(&a);
                return reply.entry_with_ttls(&attr_ttl, &entry_ttl, &attr, fs.generation(&a));
            }
        }
        let name = name_bytes(name);
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = if name == b"." {
                // Only file handles (open_by_handle_at, NFS export) look up "." and "..":
                // the VFS resolves them itself on paths. "." is the inode of any id, ".."
                // the parent of a directory id (the server answers that lookup).
                fs.client.getattr(&cred, fs.id(parent)).await
            } else {
                fs.client.lookup(&cred, fs.id(parent), &name).await
            };
            let r = match r {
                // Writes held back here would make the size it shows too small.
                Ok(a) if fs.wb.pending(a.id) => {
                    fs.wb.settle(a.id).await;
                    fs.client.getattr(&cred, a.id).await
                }
                r => r,
            };
            fs.entry(reply, parent, &name, r);
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut l = self.inner.lookups.lock();
        if let Some(n) = l.get_mut(&ino.0) {
            *n = n.saturating_sub(nlookup);
            if *n == 0 {
                l.remove(&ino.0);
                self.inner.seen_at_open.lock().remove(&self.inner.id(ino));
            }
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        // A directory this mount just changed: the reply to that change said how it is now.
        let fs = &self.inner;
        let keep = if fs.lease.is_zero() {
            fs.config.attr_ttl
        } else {
            fs.lease
        };
        if let Some((a, left)) = fs.client.recent_dir_attr(fs.id(ino), keep) {
            return reply.attr(&left, &fs.file_attr(&a));
        }
        self.spawn(req, move |fs, cred| async move {
            fs.wb.settle(fs.id(ino)).await;
            match fs.client.getattr(&cred, fs.id(ino)).await {
                Ok(a) => reply.attr(&fs.attr_ttl(), &fs.file_attr(&a)),
                Err(e) => reply.error(errno_of_inode(&e)),
            }
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        self.inner.listings.changed();
        self.inner.changed(ino);
        let conv = |t: TimeOrNow| match t {
            TimeOrNow::Now => TimeSet::Now,
            TimeOrNow::SpecificTime(st) => TimeSet::At(ns_of(st)),
        };
        let set = SetAttrs {
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            size,
            atime: atime.map(conv),
            mtime: mtime.map(conv),
            // The server sets ctime to its own time on every setattr and refuses an explicit
            // one (no Linux call can set it). The kernel sends one only in writeback-cache
            // mode, which this mount does not use; it would be "now" anyway.
            ctime: None,
        };
        self.spawn(req, move |fs, cred| async move {
            fs.wb.settle(fs.id(ino)).await;
            match fs.client.setattr(&cred, fs.id(ino), set).await {
                Ok(a) => reply.attr(&fs.attr_ttl(), &fs.file_attr(&a)),
                Err(e) => reply.error(errno_of_inode(&e)),
            }
        });
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn(req, move |fs, cred| async move {
            match fs.client.readlink(&cred, fs.id(ino)).await {
                Ok(t) => reply.data(&t),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.inner.listings.changed();
        let name = name_bytes(name);
        let busy = self.inner.busy(parent, Some(&name));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = fs
                .client
                .mknod(&cred, fs.id(parent), &name, mode, rdev, true)
                .await;
            if let Ok(a) = &r {
                fs.made(parent, &name, a);
            }
            fs.entry(reply, parent, &name, r);
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        self.inner.listings.changed();
        let name = name_bytes(name);
        let busy = self.inner.busy(parent, Some(&name));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = fs.client.mkdir(&cred, fs.id(parent), &name, mode).await;
            if let Ok(a) = &r {
                fs.made(parent, &name, a);
            }
            fs.entry(reply, parent, &name, r);
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.inner.listings.changed();
        let name = name_bytes(name);
        // Hands out nothing, but holds the directory's lock (see `coherence::Held`).
        let busy = self.inner.busy(parent, Some(&name));
        self.inner.known.lock().gone(self.inner.id(parent), &name);
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = fs.client.unlink(&cred, fs.id(parent), &name).await;
            fs.empty(reply, r);
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.inner.listings.changed();
        let name = name_bytes(name);
        self.inner.known.lock().gone(self.inner.id(parent), &name);
        let busy = self.inner.busy(parent, Some(&name));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            fs.dir_opens_done().await;
            let r = fs.client.rmdir(&cred, fs.id(parent), &name).await;
            fs.empty(reply, r);
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.inner.listings.changed();
        let name = name_bytes(link_name);
        let target = target.as_os_str().as_bytes().to_vec();
        let busy = self.inner.busy(parent, Some(&name));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = fs
                .client
                .symlink(&cred, fs.id(parent), &name, &target)
                .await;
            if let Ok(a) = &r {
                fs.made(parent, &name, a);
            }
            fs.entry(reply, parent, &name, r);
        });
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.inner.listings.changed();
        let (name, newname) = (name_bytes(name), name_bytes(newname));
        {
            let mut known = self.inner.known.lock();
            known.gone(self.inner.id(parent), &name);
            known.gone(self.inner.id(newparent), &newname);
        }
        let busy = (
            self.inner.busy(parent, Some(&name)),
            self.inner.busy(newparent, Some(&newname)),
        );
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            fs.dir_opens_done().await;
            let r = fs
                .client
                .rename(
                    &cred,
                    fs.id(parent),
                    &name,
                    fs.id(newparent),
                    &newname,
                    flags.bits(),
                )
                .await;
            if r.is_ok() {
                // The kernel moves the old name's entry, with its TTL, to the new name
                // (and swaps them on an exchange).
                let ttl = fs.entry_ttl();
                fs.handed(newparent, &newname, ttl);
                fs.handed(parent, &name, ttl);
            }
            fs.empty(reply, r);
        });
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        self.inner.listings.changed();
        self.inner.changed(ino);
        let newname = name_bytes(newname);
        let busy = self.inner.busy(newparent, Some(&newname));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let r = fs
                .client
                .link(&cred, fs.id(ino), fs.id(newparent), &newname)
                .await;
            fs.entry(reply, newparent, &newname, r);
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let flags = flags.0;
        if flags & libc::O_TRUNC != 0 {
            // The kernel sets the size it caches to zero itself.
            self.inner.changed(ino);
        }
        // Close-to-open: a new open reads the layout the file has now.
        self.inner.reads.drop_file(self.inner.id(ino));
        self.spawn(req, move |fs, cred| async move {
            match fs.client.open(&cred, fs.id(ino), flags as u32).await {
                Ok((a, handle)) => {
                    let open = fs.open_flags(&a, flags, handle);
                    reply.opened(FileHandle(handle), open)
                }
                Err(e) => reply.error(errno_of_inode(&e)),
            }
        });
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.spawn(req, move |fs, cred| async move {
            let id = fs.id(ino);
            fs.wb.settle(id).await;
            match fs.reads.read(&cred, id, fh.0, offset, size).await {
                Some(Ok(b)) => return reply.data(&b),
                Some(Err(e)) => return reply.error(errno(&e)),
                None => {}
            }
            let rule = fs.config.atime;
            match fs.client.read_atime(&cred, fh.0, offset, size, rule).await {
                Ok((b, atime_set)) => {
                    if atime_set && let Some(n) = fs.notifier.get() {
                        // The kernel's cached access time is old now (attributes only:
                        // offset -1 leaves the pages alone).
                        let _ = n.inval_inode(ino, -1, 0);
                    }
                    reply.data(&b)
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.inner.listings.changed();
        self.inner.changed(ino);
        let len = data.len() as u32;
        // Writeback of cached (e.g. mmap'ed) pages: the kernel waits for this reply to end
        // those pages' writeback, so dropping them first would wait for itself.
        let writeback = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        // O_APPEND (as the descriptor is now, fcntl included): the kernel put the bytes at
        // the end as it knows it, which another mount may have moved; the server appends
        // at the real end instead (the kernel rereads the size after any write). Page
        // writeback is never an append, whatever handle the kernel sends it through.
        let append = !writeback && flags.0 & libc::O_APPEND != 0;
        let fs = &self.inner;
        if !writeback && !append && fs.may_buffer(fs.id(ino), fh.0) {
            // The common case answers from this thread: no hand-off to the runtime.
            let cred = fs.groups.credentials(req.uid(), req.gid(), req.pid());
            match fs.wb.write_now(&cred, fs.id(ino), fh.0, offset, data) {
                Some(Ok(())) => return reply.written(len),
                Some(Err(e)) => return reply.error(errno(&e)),
                None => {}
            }
        }
        let data = data.to_vec();
        self.spawn(req, move |fs, cred| async move {
            let id = fs.id(ino);
            if !writeback && !append && fs.may_buffer(id, fh.0) {
                match fs.wb.write(&cred, id, fh.0, offset, &data).await {
                    Some(Ok(())) => return reply.written(len),
                    Some(Err(e)) => return reply.error(errno(&e)),
                    None => {}
                }
            }
            if let Err(e) = fs.wb.flush(id).await {
                return reply.error(errno(&e));
            }
            let written = if append {
                fs.client.append(&cred, fh.0, data).await
            } else {
                fs.client.write(&cred, fh.0, offset, data).await
            };
            // The servers wrote it (S3: as slices of their own): a layout kept is old now.
            fs.reads.drop_file(id);
            match written {
                Ok(a) => {
                    let killed =
                        a.mode & (kochab_proto::mode::S_ISUID | kochab_proto::mode::S_ISGID) == 0;
                    if cred.uid != 0 && killed && fs.privileged.lock().remove(&a.id) {
                        // The write cleared setuid/setgid: drop the kernel's cached mode
                        // (attributes only: offset -1 leaves the pages alone).
                        if let Some(n) = fs.notifier.get() {
                            let _ = n.inval_inode(ino, -1, 0);
                        }
                    }
                    if !writeback && fs.direct_write_beside_others(a.id, fh.0) {
                        // A direct write leaves the page cache alone, and the kernel drops
                        // the range only when it *sends* an asynchronous one, so a
                        // buffered read on another descriptor may have cached the old
                        // bytes again meanwhile (generic/451). Drop them (and the cached
                        // size and mtime) before the write completes: the kernel waits
                        // for reads in flight on those pages, so every read after the
                        // completion reads the new bytes.
                        if let Some(n) = fs.notifier.get().cloned() {
                            let _ = tokio::task::spawn_blocking(move || {
                                n.inval_inode(ino, offset as i64, i64::from(len))
                            })
                            .await;
                        }
                    }
                    reply.written(len)
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) of any descriptor releases the process's POSIX locks on the file, and
        // reports what went wrong with writes held back in the mount.
        let id = self.inner.id(ino);
        let locked = self.inner.locked.lock().contains(&id);
        let lost = self.inner.client.has_lost_commit(fh.0);
        if !locked && !lost && !self.inner.wb.pending(id) {
            return reply.ok();
        }
        self.spawn(req, move |fs, cred| async move {
            let written = fs.wb.flush(id).await;
            let written = match fs.client.take_lost_commit(fh.0) {
                Some(e) => written.and(Err(e)),
                None => written,
            };
            let r = if locked {
                let r = fs.client.release_locks(&cred, fh.0, lock_owner.0).await;
                fs.unlocked.notify_waiters();
                r
            } else {
                Ok(())
            };
            fs.empty(reply, written.and(r));
        });
    }

    fn release(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The last close of an open file description: the server's Close ends its flock
        // and OFD locks (the locks taken through this handle); lock requests on the inode
        // wait for it (`closes_done`).
        let id = self.inner.id(ino);
        self.inner.closed(id, fh.0);
        self.inner.reads.closed(fh.0);
        let locked = self.inner.locked.lock().contains(&id);
        if !locked && !self.inner.wb.pending(id) {
            // Nothing to report and nobody waiting for the close (no locks, no writes held
            // back): the kernel is answered now, and the server told soon, with other such
            // closes in one request.
            reply.ok();
            let rt = uring::queue_runtime().unwrap_or_else(|| self.inner.rt.clone());
            return self.inner.client.close_soon(fh.0, &rt);
        }
        if locked {
            *self.inner.closing.lock().entry(id).or_insert(0) += 1;
            // Only now: a lock request that no longer sees the handle sees the close.
            let mut handles = self.inner.lock_handles.lock();
            if let Some(hs) = handles.get_mut(&id) {
                hs.remove(&fh.0);
                if hs.is_empty() {
                    handles.remove(&id);
                }
            }
        }
        self.spawn(req, move |fs, cred| async move {
            if let Err(e) = fs.wb.flush(id).await {
                // Nobody waits for a release's answer: the close(2) that could have
                // reported it (flush) has returned already.
                tracing::error!("writes to inode {id:#x} were lost at close: {e}");
            }
            let r = fs.client.close(&cred, fh.0).await;
            if locked {
                let mut closing = fs.closing.lock();
                if let Some(n) = closing.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        closing.remove(&id);
                    }
                }
                drop(closing);
                fs.closed.notify_waiters();
                fs.unlocked.notify_waiters();
            }
            fs.empty(reply, r);
        });
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn(req, move |fs, cred| async move {
            if let Err(e) = fs.wb.flush(fs.id(ino)).await {
                return reply.error(errno(&e));
            }
            let r = fs.client.fsync(&cred, fh.0, datasync).await;
            // The file's metadata may have been answered early (its create, a chmod):
            // durable too before fsync returns (O_SYNC writes come here as well).
            let r = match r {
                Ok(()) => fs.client.wait_durable().await,
                e => e,
            };
            // Slices committed early whose replay after a server loss was refused.
            let r = match fs.client.take_lost_commit(fh.0) {
                Some(e) => r.and(Err(e)),
                None => r,
            };
            fs.empty(reply, r);
        });
    }

    fn opendir(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // A server-side handle, so that a directory removed (or renamed over) while open
        // lives on with nlink 0 until its last close, as on a local file system. The
        // kernel has checked the permissions already, so the answer does not wait for the
        // open, which is held a moment and usually closed before it is sent (`dir_opens`).
        let flags = flags.0 as u32;
        let handle = self.inner.client.new_handle();
        let cred = self
            .inner
            .groups
            .credentials(req.uid(), req.gid(), req.pid());
        let held = dir_opens::Held {
            id: self.inner.id(ino),
            flags,
            cred,
            at: Instant::now(),
        };
        let timer = self.inner.dir_opens.hold(handle, held);
        reply.opened(FileHandle(handle), FopenFlags::empty());
        if timer {
            self.spawn(req, move |fs, _| async move {
                tokio::time::sleep(dir_opens::HOLD).await;
                fs.send_due_dir_opens().await;
            });
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        // The rest of a readdirplus page fetched for this handle: the kernel asks for the
        // continuation of a listing without attributes (readdirplus "auto"), so a listing
        // longer than its first buffer, or just its empty end, needs no round trip.
        if let Some(page) = self
            .inner
            .listings
            .take(fh.0, ino.0, offset, Instant::now())
        {
            return self.inner.serve_plain_page(reply, fh.0, page);
        }
        self.spawn(req, move |fs, cred| async move {
            match fs
                .client
                .readdir_page(&cred, fs.id(ino), offset, READDIR_PAGE, false)
                .await
            {
                Ok((entries, _)) => {
                    for e in entries {
                        if reply.add(
                            fs.ino(e.id),
                            e.cookie,
                            file_type(e.kind),
                            OsStr::from_bytes(&e.name),
                        ) {
                            break;
                        }
                    }
                    reply.ok();
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let busy = self.inner.busy(ino, None);
        // The rest of the page fetched for this handle's last request: no round trip.
        if let Some(page) = self
            .inner
            .listings
            .take(fh.0, ino.0, offset, Instant::now())
        {
            return self.inner.serve_page(reply, fh.0, page);
        }
        let epoch = self.inner.listings.epoch();
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            let arrived = coherence::ARRIVED
                .try_with(|a| *a)
                .unwrap_or_else(|_| Instant::now());
            match fs
                .client
                .readdir_page(&cred, fs.id(ino), offset, READDIR_PAGE, true)
                .await
            {
                Ok((entries, eof)) => {
                    // Entries whose inodes another server holds come without attributes:
                    // ask their owners, all at once.
                    let mut asked = tokio::task::JoinSet::new();
                    // So do files with writes held back here (their sizes are behind).
                    for e in entries
                        .iter()
                        .filter(|e| e.attr.is_none() || fs.wb.pending(e.id))
                    {
                        let (client, cred, id, wb) =
                            (fs.client.clone(), cred.clone(), e.id, fs.wb.clone());
                        asked.spawn(async move {
                            wb.settle(id).await;
                            (id, client.getattr(&cred, id).await)
                        });
                    }
                    let mut fetched = std::collections::HashMap::new();
                    while let Some(Ok((id, r))) = asked.join_next().await {
                        fetched.insert(id, r);
                    }
                    let mut page = std::collections::VecDeque::with_capacity(entries.len());
                    for mut e in entries {
                        let attr = match e.attr.take().filter(|_| !fetched.contains_key(&e.id)) {
                            Some(a) => a,
                            None => match fetched.get(&e.id).cloned().unwrap_or_else(|| {
                                Err(kochab_proto::fs_err!(EIO, "attributes of {:#x} lost", e.id))
                            }) {
                                Ok(a) => a,
                                // Removed since the listing: the entry is gone, leave it out.
                                Err(ge)
                                    if matches!(
                                        ge.errno,
                                        kochab_proto::Errno::ENOENT | kochab_proto::Errno::ESTALE
                                    ) =>
                                {
                                    continue;
                                }
                                // Anything else is the caller's error, not a hidden entry.
                                Err(ge) => return reply.error(errno(&ge)),
                            },
                        };
                        page.push_back((e, attr));
                    }
                    let page = listing::Page::new(ino.0, offset, page, eof, arrived, epoch);
                    fs.serve_page(reply, fh.0, page);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn releasedir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        // Nothing waits for this close (closedir cannot fail), so it goes after the reply;
        // a removal that overtakes it only keeps the dead directory a moment longer.
        self.inner.listings.closed(fh.0);
        reply.ok();
        if self.inner.dir_opens.closed_while_held(fh.0) {
            return; // Its open never reached the servers.
        }
        self.spawn(req, move |fs, _| async move {
            // Never before the open it closes (which would then stay registered). A
            // directory handle has nothing to report (flock on a directory stays in the
            // kernel), so its close goes with others (`close_soon`).
            fs.dir_opens.in_flight_done().await;
            fs.client
                .close_soon(fh.0, &tokio::runtime::Handle::current());
        });
    }

    fn fsyncdir(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Every change this mount had answered early, not only the directory's: durable
        // before it returns (with `-o dirsync` everything already is).
        self.spawn(req, move |fs, _| async move {
            let r = fs.client.wait_durable().await;
            fs.empty(reply, r);
        });
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.spawn(req, move |fs, cred| async move {
            match fs.client.statfs(&cred).await {
                Ok(s) => reply.statfs(
                    s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
                ),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.inner.listings.changed();
        self.inner.bare.lock().remove(&self.inner.id(ino));
        self.inner.changed(ino);
        let (name, value) = (name_bytes(name), value.to_vec());
        self.spawn(req, move |fs, cred| async move {
            let r = fs
                .client
                .setxattr(&cred, fs.id(ino), &name, &value, flags as u32)
                .await;
            fs.empty(reply, r);
        });
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        // The kernel asks for security.capability before every chown and every write that
        // may drop privileges. A file this mount created has none until a setxattr, which
        // goes through this mount (`not_bare` before it is sent) or calls it back.
        if name.as_bytes() == b"security.capability" {
            let id = self.inner.id(ino);
            let bare = self.inner.bare.lock().get(&id).copied();
            if bare.is_some_and(|until| until > Instant::now()) {
                return reply.error(Errno::ENODATA);
            }
        }
        let name = name_bytes(name);
        self.spawn(req, move |fs, cred| async move {
            match fs.client.getxattr(&cred, fs.id(ino), &name).await {
                Ok(v) => xattr_reply(reply, &v, size),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.spawn(req, move |fs, cred| async move {
            match fs.client.listxattr(&cred, fs.id(ino)).await {
                Ok(v) => xattr_reply(reply, &v, size),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.inner.listings.changed();
        self.inner.bare.lock().remove(&self.inner.id(ino));
        self.inner.changed(ino);
        let name = name_bytes(name);
        self.spawn(req, move |fs, cred| async move {
            let r = fs.client.removexattr(&cred, fs.id(ino), &name).await;
            fs.empty(reply, r);
        });
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let mask = mask.bits() as u32;
        self.spawn(req, move |fs, cred| async move {
            let r = fs.client.access(&cred, fs.id(ino), mask).await;
            fs.empty(reply, r);
        });
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        self.inner.listings.changed();
        let name = name_bytes(name);
        let busy = self.inner.busy(parent, Some(&name));
        self.spawn(req, move |fs, cred| async move {
            let _busy = busy;
            match fs
                .client
                .create_open(&cred, fs.id(parent), &name, mode, flags as u32)
                .await
            {
                Ok((a, handle)) => {
                    fs.looked_up(a.id);
                    fs.created(a.id);
                    fs.made(parent, &name, &a);
                    let ttl = fs.entry_ttl();
                    fs.handed(parent, &name, ttl);
                    let open = fs.open_flags(&a, flags, handle);
                    reply.created(
                        &ttl,
                        &fs.file_attr(&a),
                        fs.generation(&a),
                        FileHandle(handle),
                        open,
                    );
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn getlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let want = LockSpec {
            owner: lock_owner.0,
            start,
            end,
            kind: lock_kind(typ),
            pid,
            // The kernel asks only about fcntl locks.
            flock: false,
        };
        let id = self.inner.id(ino);
        self.spawn(req, move |fs, cred| async move {
            fs.closes_done(id, fh.0).await;
            match fs.client.getlk(&cred, fh.0, want).await {
                Ok(l) => reply.locked(l.start, l.end, lock_typ(l.kind), l.pid),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        flock: bool,
        reply: ReplyEmpty,
    ) {
        let want = LockSpec {
            owner: lock_owner.0,
            start,
            end,
            kind: lock_kind(typ),
            pid,
            flock,
        };
        if want.kind != LockKind::Unlock {
            let id = self.inner.id(ino);
            self.inner.locked.lock().insert(id);
            self.inner
                .lock_handles
                .lock()
                .entry(id)
                .or_default()
                .insert(fh.0);
        }
        // Watch before the task starts: the interrupt may be handled by another thread.
        let watch = sleep.then(|| self.inner.interrupts.watch(req.unique().0));
        self.spawn(req, move |fs, cred| async move {
            // The server never blocks; a waiting lock is retried here with backoff until it
            // is granted or its caller gets a signal (FUSE_INTERRUPT): then EINTR, which
            // the kernel turns into a restart or EINTR as the signal's handler says, and a
            // SIGKILL kills the process. The interrupt is looked at only between attempts,
            // so a lock is never granted to a caller that was told EINTR.
            let id = fs.id(ino);
            fs.closes_done(id, fh.0).await;
            let mut pause = Duration::from_millis(2);
            loop {
                // Listening from before the attempt, so an unlock during it is not missed.
                let unlocked = fs.unlocked.notified();
                tokio::pin!(unlocked);
                unlocked.as_mut().enable();
                match fs.client.setlk(&cred, fh.0, want).await {
                    Err(e) if sleep && e.errno == kochab_proto::Errno::EAGAIN => {
                        let interrupted = async {
                            match &watch {
                                Some(w) => w.interrupted().await,
                                None => std::future::pending().await,
                            }
                        };
                        tokio::select! {
                            () = tokio::time::sleep(pause) => {}
                            () = unlocked => {}
                            () = interrupted => return reply.error(Errno::EINTR),
                        }
                        pause = (pause * 2).min(LOCK_POLL_MAX);
                    }
                    Ok(()) if want.kind == LockKind::Unlock => {
                        fs.unlocked.notify_waiters();
                        return reply.ok();
                    }
                    Ok(()) => {
                        // Taking a lock is a consistency point (as in NFS): another mount
                        // may have changed the file while this kernel kept its pages.
                        // Dropped off this thread: the kernel waits for reads in flight on
                        // those pages, which this thread may be the one to answer (a FUSE
                        // queue's thread serves every request of its CPU).
                        if let Some(n) = fs.notifier.get().cloned() {
                            let _ =
                                tokio::task::spawn_blocking(move || n.inval_inode(ino, 0, 0)).await;
                        }
                        return reply.ok();
                    }
                    r => return fs.empty(reply, r),
                }
            }
        });
    }

    fn interrupt(&self, _req: &Request, unique: RequestId) -> Result<(), Errno> {
        self.inner.interrupts.interrupt(unique.0);
        Ok(())
    }

    /// No ioctl is supported (terminal probes, FS_IOC_GETFLAGS): ENOTTY, as from a file
    /// system without them. fuser's default logged a warning for each, and the kernel asks
    /// on every call (Python probes isatty() at every open): a log line per file opened.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        self.inner.listings.changed();
        self.inner.changed(ino);
        self.spawn(req, move |fs, cred| async move {
            fs.wb.settle(fs.id(ino)).await;
            let r = fs
                .client
                .fallocate(&cred, fh.0, offset, length, mode as u32)
                .await;
            fs.empty(reply, r);
        });
    }
}

fn xattr_reply(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if (size as usize) < value.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers_are_a_bijection_of_ids() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..100_000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            for id in [i, rng, u64::MAX - i] {
                assert_eq!(id_of_ino(ino_of_id(id)), id);
            }
        }
        // Ids that differ in high bits only land far apart in the low bits.
        let low = |id: u64| ino_of_id(id) & 0xffff;
        assert_ne!(low(1 << 40), low(2 << 40));
    }
}
