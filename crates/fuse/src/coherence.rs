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
use rustc_hash::{FxHashMap, FxHashSet};
use std::time::{Duration, Instant};

tokio::task_local! {
    /// When the kernel's request that a task serves reached the mount.
    pub static ARRIVED: Instant;
}

/// Names the kernel may cache (positive or negative) in each directory, by the kernel's
/// inode number of the directory, so that a callback for a whole directory (its table
/// left the server) or for everything (a connection ended) can drop them.
#[derive(Default)]
pub struct HandedNames(Mutex<FxHashMap<u64, FxHashSet<Vec<u8>>>>);

impl HandedNames {
    /// The kernel was handed `parent/name` with a TTL.
    pub fn handed(&self, parent: u64, name: &[u8]) {
        let mut names = self.0.lock();
        let set = names.entry(parent).or_default();
        if !set.contains(name) {
            set.insert(name.to_vec());
        }
    }

    /// Forgets `parent/name` (dropped from the kernel).
    pub fn dropped(&self, parent: u64, name: &[u8]) {
        let mut names = self.0.lock();
        if let Some(set) = names.get_mut(&parent) {
            set.remove(name);
            if set.is_empty() {
                names.remove(&parent);
            }
        }
    }

    /// Takes the names handed out in `parent`.
    pub fn take_dir(&self, parent: u64) -> Vec<Vec<u8>> {
        self.0
            .lock()
            .remove(&parent)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default()
    }

    /// Takes every name handed out.
    pub fn take_all(&self) -> Vec<(u64, Vec<u8>)> {
        std::mem::take(&mut *self.0.lock())
            .into_iter()
            .flat_map(|(p, set)| set.into_iter().map(move |n| (p, n)))
            .collect()
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
    /// Inodes the kernel holds (for `Everything`).
    fn held_inodes(&self) -> Vec<u64>;
    /// Forgets the attributes the mount keeps of a directory it changed (of all: `None`).
    fn forget_dir_attr(&self, id: Option<InodeId>);
}

/// Drops what `list` names from the kernel's cache.
pub fn drop_cached(k: &impl Kernel, names: &HandedNames, list: &[Invalidation]) {
    for what in list {
        match what {
            Invalidation::Entry { parent, name } => {
                let parent = k.ino(*parent);
                names.dropped(parent, name);
                k.inval_entry(parent, name);
            }
            Invalidation::Inode { id } => {
                k.forget_dir_attr(Some(*id));
                k.inval_inode(k.ino(*id));
            }
            Invalidation::Names { dir } => {
                k.forget_dir_attr(Some(*dir));
                let dir = k.ino(*dir);
                for name in names.take_dir(dir) {
                    k.inval_entry(dir, &name);
                }
                k.inval_inode(dir);
            }
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

    #[derive(Default)]
    struct Recorder(RefCell<Vec<String>>);

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
        fn held_inodes(&self) -> Vec<u64> {
            vec![7]
        }
        fn forget_dir_attr(&self, _: Option<InodeId>) {}
    }

    #[test]
    fn a_directory_callback_drops_every_name_handed_out_there() {
        let names = HandedNames::default();
        names.handed(1001, b"a");
        names.handed(1001, b"b");
        names.handed(1002, b"c");
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
