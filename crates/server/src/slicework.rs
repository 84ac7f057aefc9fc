//! What the server keeps for slice objects (see `slicesvc`): the grant key and object ids
//! it hands out, objects freed by changes waiting for their record to be durable, objects
//! it is putting itself (out of the collector's sight), and chunks queued for compaction.

use crate::grants::{ObjectIds, object_name};
use kochab_proto::auth::{self, GrantKey};
use kochab_proto::{InodeId, SliceCounters};
use parking_lot::Mutex;
use rustc_hash::FxHashSet;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Notify, mpsc};

/// What the server keeps for slice objects (present whatever the store; used on S3).
pub struct SliceWork {
    pub grant_key: GrantKey,
    pub ids: ObjectIds,
    /// Objects freed by a change, by the LSN of its record: deleted once it is durable.
    freed: Mutex<BTreeMap<u64, Vec<String>>>,
    freed_wake: Notify,
    /// Objects the server is putting and has not committed yet (see the module).
    own_puts: Mutex<FxHashSet<String>>,
    /// Chunks waiting for compaction (inode, generation, chunk), each queued once.
    compact_tx: mpsc::UnboundedSender<(InodeId, u64, u64)>,
    compact_rx: Mutex<Option<mpsc::UnboundedReceiver<(InodeId, u64, u64)>>>,
    compacting: Mutex<FxHashSet<(InodeId, u64)>>,
    pub freed_deleted: AtomicU64,
    pub orphans_deleted: AtomicU64,
    pub chunks_compacted: AtomicU64,
    pub gc_passes: AtomicU64,
}

impl SliceWork {
    pub fn new(cluster_key: &auth::ClusterKey, server_id: u64, epoch: u64) -> SliceWork {
        let (compact_tx, compact_rx) = mpsc::unbounded_channel();
        SliceWork {
            grant_key: GrantKey::derive(cluster_key),
            ids: ObjectIds::new(server_id, epoch, auth::random_u64()),
            freed: Default::default(),
            freed_wake: Notify::new(),
            own_puts: Default::default(),
            compact_tx,
            compact_rx: Mutex::new(Some(compact_rx)),
            compacting: Default::default(),
            freed_deleted: AtomicU64::new(0),
            orphans_deleted: AtomicU64::new(0),
            chunks_compacted: AtomicU64::new(0),
            gc_passes: AtomicU64::new(0),
        }
    }

    /// What `kochab status` shows.
    pub fn counters(&self) -> SliceCounters {
        SliceCounters {
            freed_deleted: self.freed_deleted.load(Ordering::Relaxed),
            orphans_deleted: self.orphans_deleted.load(Ordering::Relaxed),
            chunks_compacted: self.chunks_compacted.load(Ordering::Relaxed),
            gc_passes: self.gc_passes.load(Ordering::Relaxed),
        }
    }

    /// Queues `objects` of a file generation for deletion once record `lsn` is durable.
    pub fn free(&self, lsn: u64, id: InodeId, generation: u64, objects: &[u64]) {
        let names: Vec<String> = objects
            .iter()
            .filter(|&&o| o != 0)
            .map(|&o| object_name(id, generation, o))
            .collect();
        if names.is_empty() {
            return;
        }
        self.freed.lock().entry(lsn).or_default().extend(names);
        self.freed_wake.notify_one();
    }

    /// Up to `max` queued names whose record is durable.
    pub fn take_durable(&self, durable: u64, max: usize) -> Vec<String> {
        let mut q = self.freed.lock();
        let mut out = Vec::new();
        while out.len() < max {
            let Some(mut e) = q.first_entry() else { break };
            if *e.key() > durable {
                break;
            }
            let v = e.get_mut();
            let n = (max - out.len()).min(v.len());
            out.extend(v.drain(..n));
            if v.is_empty() {
                e.remove();
            }
        }
        out
    }

    /// True if the collector must leave `name` alone (the server is putting it).
    pub fn is_own_put(&self, name: &str) -> bool {
        self.own_puts.lock().contains(name)
    }

    /// Queues a chunk for compaction (once while queued).
    pub fn compact_later(&self, id: InodeId, generation: u64, chunk: u64) {
        if self.compacting.lock().insert((id, chunk)) {
            let _ = self.compact_tx.send((id, generation, chunk));
        }
    }
    /// Puts names taken back (a failed delete) at the front of the queue: their records
    /// are durable already.
    pub fn requeue(&self, names: Vec<String>) {
        self.freed.lock().entry(0).or_default().extend(names);
    }

    /// Wakes when objects are queued for deletion.
    pub fn freed_wake(&self) -> &Notify {
        &self.freed_wake
    }

    /// Marks `name` as being put by the server (a retry of a put under a new object id);
    /// an [`OwnPuts`] adopts it afterwards (see [`OwnPuts::adopt`]).
    pub fn note_own_put(&self, name: String) {
        self.own_puts.lock().insert(name);
    }

    /// The compaction queue's receiver: the compaction loop takes it once.
    pub fn take_compact_rx(&self) -> Option<mpsc::UnboundedReceiver<(InodeId, u64, u64)>> {
        self.compact_rx.lock().take()
    }

    /// A compaction of `(id, chunk)` ended: a later commit may queue it again.
    pub fn compacted(&self, id: InodeId, chunk: u64) {
        self.compacting.lock().remove(&(id, chunk));
    }
}

/// Names the server is putting, out of the collector's sight until dropped (after the
/// commit that made them refs, or that failed).
pub struct OwnPuts<'a> {
    work: &'a SliceWork,
    names: Vec<String>,
}

impl<'a> OwnPuts<'a> {
    pub fn new(work: &'a SliceWork) -> OwnPuts<'a> {
        OwnPuts {
            work,
            names: Vec::new(),
        }
    }

    /// Takes over `name`, already marked with [`SliceWork::note_own_put`].
    pub fn adopt(&mut self, name: String) {
        self.names.push(name);
    }

    pub fn add(&mut self, name: String) {
        self.work.own_puts.lock().insert(name.clone());
        self.names.push(name);
    }
}

impl Drop for OwnPuts<'_> {
    fn drop(&mut self) {
        let mut own = self.work.own_puts.lock();
        for n in &self.names {
            own.remove(n);
        }
    }
}
