//! Coherent caching between mounts: how long the kernel may cache what a reply showed (the
//! rest of the server's lease), and the callbacks that make it drop it sooner
//! (docs/ARCHITECTURE.md, "Coherent caching between mounts").
//!
//! The servers grant this mount a lease on every inode a reply shows and on the names of
//! every directory a lookup, listing or change of it read, counted from when they handled
//! the request. The kernel is told to cache for what is left of the lease counted from when
//! its request reached the mount, which is earlier, so the kernel never caches past the
//! server's record. Before another client's change to something leased here is
//! acknowledged, its server sends a callback; a thread of its own drops what the kernel
//! caches (`inval_entry`, `inval_inode`) and then lets the callback be answered. It never
//! runs on the FUSE request threads: an invalidation may wait for a directory lock that a
//! request of this mount holds.

use kochab_client::conn::CallbackAnswer;
use kochab_proto::{InodeId, Invalidation};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

tokio::task_local! {
    /// When the kernel's request that a task serves reached the mount.
    pub static ARRIVED: Instant;
}

/// Names the kernel may cache (positive or negative) in each directory, by the kernel's
/// inode number of the directory, and the requests in flight that may hand it more, so
/// that a callback drops only what the kernel can hold.
///
/// Why it matters: the kernel's `inval_entry` takes the directory's lock, which the
/// kernel holds for every change this mount makes there. When two mounts create in one
/// directory, each create waits at the server for the other mount's callback answer, and
/// each mount's invalidation waits for its own create: a deadlock that only
/// `CALLBACK_ANSWER_MAX` broke (200 ms per create). The name a callback names is nearly
/// always one this kernel never saw (the other mount's new file): then there is nothing
/// to drop and no lock to take.
///
/// A name needs the kernel's invalidation if it was handed out and its TTL may not have
/// run out, or if a request that may hand it out is in flight (registered by [`begin`]
/// before the request is looked at, so either the callback sees it or the request sees
/// the callback's effect: the complete-directory state and kept listing pages are dropped
/// before the callback's names are looked up here). The kernel holds the directory's lock
/// for such a request until its reply is in, so an invalidation by name runs after it;
/// since that reply may wait for the other mount (the deadlock above), a name to drop in a
/// directory with a request of this mount in flight is dropped by making every cached
/// entry stale instead (`Kernel::inc_epoch`, no lock; each is looked up again before its
/// next use). Only a request not registered here (a setattr of the directory itself) can
/// still hold an invalidation up, for at most `CALLBACK_ANSWER_MAX`.
///
/// [`begin`]: HandedNames::begin
#[derive(Default)]
pub struct HandedNames(Mutex<Dirs>);

#[derive(Default)]
struct Dirs {
    dirs: FxHashMap<u64, DirNames>,
    /// Names handed out since the last prune.
    inserted: usize,
}

#[derive(Default)]
struct DirNames {
    /// Names handed out, with when the kernel's TTL runs out at the latest.
    handed: FxHashMap<Vec<u8>, Instant>,
    /// Requests in flight per name that may hand it out.
    busy: FxHashMap<Vec<u8>, u32>,
    /// Listings (readdirplus) in flight: may hand out any name.
    listings: u32,
}

impl DirNames {
    fn is_empty(&self) -> bool {
        self.handed.is_empty() && self.busy.is_empty() && self.listings == 0
    }

    /// Takes the names the kernel may hold or be handed (the handed ones are forgotten;
    /// requests in flight stay registered), for a drop of the whole directory.
    fn take(&mut self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = self.handed.drain().map(|(n, _)| n).collect();
        out.extend(self.busy.keys().cloned());
        out
    }
}

/// Whether the kernel may hold a name (see [`HandedNames::must_drop`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Held {
    No,
    Yes,
    /// And a request of this mount in its directory may hold the directory's lock (until
    /// the server answers it, which may wait for another mount's callback answer).
    Locked,
}

/// Slack on a handed name's expiry: the kernel starts its TTL when it reads the reply,
/// a little after the mount computed it.
const TTL_SLACK: Duration = Duration::from_secs(1);

/// Every this many names handed out, the ones the kernel no longer caches are forgotten.
const PRUNE_AT: usize = 1 << 16;

/// A request in flight that may hand the kernel names of a directory; ends when dropped
/// (after the request's reply went to the kernel).
pub struct Busy {
    names: Arc<HandedNames>,
    parent: u64,
    name: Option<Vec<u8>>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut names = self.names.0.lock();
        let names = &mut names.dirs;
        let Some(dir) = names.get_mut(&self.parent) else {
            return;
        };
        match &self.name {
            Some(name) => {
                if let Some(n) = dir.busy.get_mut(name) {
                    *n -= 1;
                    if *n == 0 {
                        dir.busy.remove(name);
                    }
                }
            }
            None => dir.listings = dir.listings.saturating_sub(1),
        }
        if dir.is_empty() {
            names.remove(&self.parent);
        }
    }
}

impl HandedNames {
    /// A request that may hand out `parent/name` (`None`: any name of `parent`, a listing)
    /// is about to be looked at; it ends when the guard is dropped.
    pub fn begin(self: &Arc<Self>, parent: u64, name: Option<&[u8]>) -> Busy {
        let mut names = self.0.lock();
        let dir = names.dirs.entry(parent).or_default();
        match name {
            Some(name) => *dir.busy.entry(name.to_vec()).or_insert(0) += 1,
            None => dir.listings += 1,
        }
        Busy {
            names: self.clone(),
            parent,
            name: name.map(<[u8]>::to_vec),
        }
    }

    /// The kernel was handed `parent/name` for `ttl`.
    pub fn handed(&self, parent: u64, name: &[u8], ttl: Duration) {
        let until = Instant::now() + ttl + TTL_SLACK;
        let mut names = self.0.lock();
        let dir = names.dirs.entry(parent).or_default();
        match dir.handed.get_mut(name) {
            Some(u) => *u = (*u).max(until),
            None => {
                dir.handed.insert(name.to_vec(), until);
                names.inserted += 1;
                if names.inserted >= PRUNE_AT {
                    names.inserted = 0;
                    let now = Instant::now();
                    names.dirs.retain(|_, d| {
                        d.handed.retain(|_, u| *u > now);
                        !d.is_empty()
                    });
                }
            }
        }
    }

    /// Whether the kernel may hold `parent/name` or be about to, and whether a request of
    /// this mount may hold the directory's lock; forgets the name as handed out.
    pub fn must_drop(&self, parent: u64, name: &[u8], now: Instant) -> Held {
        let mut names = self.0.lock();
        let names = &mut names.dirs;
        let Some(dir) = names.get_mut(&parent) else {
            return Held::No;
        };
        let handed = dir.handed.remove(name).is_some_and(|until| until > now);
        let busy = dir.listings > 0 || dir.busy.contains_key(name);
        let locked = dir.listings > 0 || !dir.busy.is_empty();
        if dir.is_empty() {
            names.remove(&parent);
        }
        match (handed || busy, locked) {
            (false, _) => Held::No,
            (true, false) => Held::Yes,
            (true, true) => Held::Locked,
        }
    }

    /// Takes the names the kernel may hold in `parent`.
    pub fn take_dir(&self, parent: u64) -> Vec<Vec<u8>> {
        let mut names = self.0.lock();
        let names = &mut names.dirs;
        let Some(dir) = names.get_mut(&parent) else {
            return Vec::new();
        };
        let taken = dir.take();
        if dir.is_empty() {
            names.remove(&parent);
        }
        taken
    }

    /// Takes every name the kernel may hold.
    pub fn take_all(&self) -> Vec<(u64, Vec<u8>)> {
        let mut names = self.0.lock();
        let names = &mut names.dirs;
        let mut out = Vec::new();
        for (&parent, dir) in names.iter_mut() {
            out.extend(dir.take().into_iter().map(|n| (parent, n)));
        }
        names.retain(|_, d| !d.is_empty());
        out
    }
}

/// How long the kernel may cache what the reply to the request being served shows: what is
/// left of `lease` since the request reached the mount, or `fallback` with no lease (then
/// nothing calls this mount back, and the mount's TTLs are what they were).
pub fn ttl(lease: Duration, fallback: Duration) -> Duration {
    match ARRIVED.try_with(|a| *a) {
        Ok(arrived) => ttl_since(lease, fallback, arrived),
        // Not from a served request: no time is known, cache nothing.
        Err(_) if !lease.is_zero() => Duration::ZERO,
        Err(_) => fallback,
    }
}

/// [`ttl`] for what a request that reached the mount at `arrived` fetched.
pub fn ttl_since(lease: Duration, fallback: Duration, arrived: Instant) -> Duration {
    if lease.is_zero() {
        fallback
    } else {
        lease.saturating_sub(arrived.elapsed())
    }
}

/// One callback for the thread that drops cached entries.
pub type Work = (Vec<Invalidation>, CallbackAnswer);

/// What the dropping thread does for one invalidation, given how to reach the kernel.
pub trait Kernel {
    fn ino(&self, id: InodeId) -> u64;
    fn inval_entry(&self, parent: u64, name: &[u8]);
    fn inval_inode(&self, ino: u64);
    /// Drops an inode's cached attributes only (never waits: no page is touched).
    fn inval_attrs(&self, ino: u64);
    /// Drops an inode's cached pages soon, on another thread: the page locks it needs may
    /// be held by a read of this mount whose reply waits for another mount's callback
    /// answer. Buffered reads do not wait for it: the attributes are gone, and the kernel
    /// drops the pages itself when it rereads them and finds a new mtime or size.
    fn drop_pages_later(&self, ino: u64);
    /// Makes every entry the kernel caches stale without taking a lock; false if the
    /// kernel cannot.
    fn inc_epoch(&self) -> bool;
    /// Inodes the kernel holds (for `Everything`).
    fn held_inodes(&self) -> Vec<u64>;
    /// Forgets the attributes the mount keeps of a directory it changed (of all: `None`).
    fn forget_dir_attr(&self, id: Option<InodeId>);
}

/// Drops what `list` names from the kernel's cache.
pub fn drop_cached(k: &impl Kernel, names: &HandedNames, list: &[Invalidation]) {
    let mut stale_all = false;
    for what in list {
        match what {
            Invalidation::Entry { parent, name } => {
                let parent = k.ino(*parent);
                match names.must_drop(parent, name, Instant::now()) {
                    Held::No => {}
                    // Waiting for the directory's lock could wait for this very callback's
                    // answer (a change of this mount there waits for another's): make every
                    // entry stale instead, once per callback.
                    Held::Locked if stale_all => {}
                    Held::Locked if k.inc_epoch() => stale_all = true,
                    Held::Yes | Held::Locked => k.inval_entry(parent, name),
                }
            }
            Invalidation::Inode { id } => {
                k.forget_dir_attr(Some(*id));
                let ino = k.ino(*id);
                k.inval_attrs(ino);
                k.drop_pages_later(ino);
            }
            Invalidation::Names { dir } => {
                k.forget_dir_attr(Some(*dir));
                let dir = k.ino(*dir);
                for name in names.take_dir(dir) {
                    k.inval_entry(dir, &name);
                }
                k.inval_inode(dir);
            }
            // Not drops (the mount's write-behind takes them).
            Invalidation::Flush { .. } | Invalidation::Hold { .. } => {}
            Invalidation::Everything => {
                k.forget_dir_attr(None);
                for (parent, name) in names.take_all() {
                    k.inval_entry(parent, &name);
                }
                for ino in k.held_inodes() {
                    k.inval_inode(ino);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// What the kernel was told; the second field: it has no epochs (before Linux 6.16).
    #[derive(Default)]
    struct Recorder(RefCell<Vec<String>>, bool);

    impl Kernel for Recorder {
        fn ino(&self, id: InodeId) -> u64 {
            id + 1000
        }
        fn inval_entry(&self, parent: u64, name: &[u8]) {
            let name = String::from_utf8_lossy(name);
            self.0.borrow_mut().push(format!("entry {parent} {name}"));
        }
        fn inval_inode(&self, ino: u64) {
            self.0.borrow_mut().push(format!("inode {ino}"));
        }
        fn inval_attrs(&self, ino: u64) {
            self.0.borrow_mut().push(format!("attrs {ino}"));
        }
        fn drop_pages_later(&self, ino: u64) {
            self.0.borrow_mut().push(format!("pages {ino}"));
        }
        fn inc_epoch(&self) -> bool {
            if !self.1 {
                self.0.borrow_mut().push("epoch".into());
            }
            !self.1
        }
        fn held_inodes(&self) -> Vec<u64> {
            vec![7]
        }
        fn forget_dir_attr(&self, _: Option<InodeId>) {}
    }

    #[test]
    fn a_directory_callback_drops_every_name_handed_out_there() {
        let names = HandedNames::default();
        let ttl = Duration::from_secs(5);
        names.handed(1001, b"a", ttl);
        names.handed(1001, b"b", ttl);
        names.handed(1002, b"c", ttl);
        let k = Recorder::default();
        drop_cached(
            &k,
            &names,
            &[Invalidation::Entry {
                parent: 1,
                name: b"a".to_vec(),
            }],
        );
        drop_cached(&k, &names, &[Invalidation::Names { dir: 1 }]);
        let seen = k.0.take();
        assert_eq!(seen, ["entry 1001 a", "entry 1001 b", "inode 1001"]);
        drop_cached(&k, &names, &[Invalidation::Everything]);
        assert_eq!(k.0.take(), ["entry 1002 c", "inode 7"]);
        assert!(names.take_all().is_empty());
    }

    #[test]
    fn only_names_the_kernel_may_hold_are_invalidated() {
        let names = Arc::new(HandedNames::default());
        let k = Recorder::default();
        let entry = |name: &str| Invalidation::Entry {
            parent: 1,
            name: name.as_bytes().to_vec(),
        };
        // Another mount's new file: never seen here, nothing to drop (no directory lock).
        drop_cached(&k, &names, &[entry("new")]);
        assert!(k.0.take().is_empty());
        // A lookup of it in flight: its reply may hand it out, so the kernel must drop it,
        // and the lookup holds the directory's lock: every entry is made stale instead.
        let lookup = names.begin(1001, Some(b"new"));
        drop_cached(&k, &names, &[entry("new"), entry("other")]);
        assert_eq!(k.0.take(), ["epoch"]);
        drop(lookup);
        drop_cached(&k, &names, &[entry("new")]);
        assert!(k.0.take().is_empty());
        // A listing in flight may hand out any name.
        let listing = names.begin(1001, None);
        drop_cached(&k, &names, &[entry("any"), entry("more")]);
        assert_eq!(k.0.take(), ["epoch"], "once per callback");
        drop(listing);
        // Handed out, nothing of this mount in the directory: dropped by name, once.
        names.handed(1001, b"x", Duration::from_secs(5));
        drop_cached(&k, &names, &[entry("x"), entry("x")]);
        assert_eq!(k.0.take(), ["entry 1001 x"]);
        // Handed out while a create of this mount holds the directory: stale by epoch, or,
        // on a kernel without epochs, by name.
        let create = names.begin(1001, Some(b"mine"));
        names.handed(1001, b"x", Duration::from_secs(5));
        drop_cached(&k, &names, &[entry("x")]);
        assert_eq!(k.0.take(), ["epoch"]);
        let old = Recorder(RefCell::default(), true);
        names.handed(1001, b"x", Duration::from_secs(5));
        drop_cached(&old, &names, &[entry("x")]);
        assert_eq!(old.0.take(), ["entry 1001 x"]);
        drop(create);
        // Handed out long ago: the kernel's TTL ran out, it asks again before using it.
        names.handed(1001, b"y", Duration::from_secs(5));
        let later = Instant::now() + Duration::from_secs(10);
        assert_eq!(names.must_drop(1001, b"y", later), Held::No);
        // Nothing is left behind once the guards are gone.
        assert!(names.0.lock().dirs.is_empty());
    }

    #[test]
    fn the_kernel_caches_for_what_is_left_of_the_lease_since_arrival() {
        let lease = Duration::from_secs(5);
        let fallback = Duration::from_secs(1);
        assert_eq!(ttl(Duration::ZERO, fallback), fallback);
        assert_eq!(ttl(lease, fallback), Duration::ZERO, "outside a request");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let arrived = Instant::now() - Duration::from_secs(2);
        let left = rt.block_on(ARRIVED.scope(arrived, async { ttl(lease, fallback) }));
        assert!(left <= Duration::from_secs(3) && left > Duration::from_millis(2500));
    }
}
