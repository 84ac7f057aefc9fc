//! The applied state and its snapshots (openraft's `RaftStateMachine`).
//!
//! The state lives in memory; a snapshot is the postcard encoding of the whole state, kept
//! in memory and in one file replaced atomically, from which the state is rebuilt on
//! restart (openraft then re-applies the log after it). A snapshot from the leader replaces
//! the state whole.

use std::io::{self, Cursor};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, OptionalSend, RaftLogId, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::log_store::{create_dir_durable, read_atomic, write_atomic};
use crate::{ReplicaId, ReplicatedState, TypeConfig};

const SNAPSHOT_FILE: &str = "snapshot";

type C<S> = TypeConfig<S>;
type SErr = StorageError<ReplicaId>;
type Meta = SnapshotMeta<ReplicaId, BasicNode>;

/// The state as last applied, published after every applied batch.
#[derive(Clone)]
pub struct Applied<S> {
    /// The state.
    pub state: Arc<S>,
    /// Index of the last log entry applied to it.
    pub last_applied: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    meta: Meta,
    data: Vec<u8>,
}

struct Inner<S> {
    state: S,
    last_applied: Option<LogId<ReplicaId>>,
    membership: StoredMembership<ReplicaId, BasicNode>,
    snapshot: Option<(Meta, Vec<u8>)>,
    /// Snapshots built by this process, to keep ids unique.
    built: u64,
}

/// The state machine store. Clones share one state; a clone is the snapshot builder.
pub struct SmStore<S: ReplicatedState> {
    inner: Arc<Mutex<Inner<S>>>,
    dir: PathBuf,
    applied: watch::Sender<Applied<S>>,
}

impl<S: ReplicatedState> Clone for SmStore<S> {
    fn clone(&self) -> Self {
        SmStore {
            inner: Arc::clone(&self.inner),
            dir: self.dir.clone(),
            applied: self.applied.clone(),
        }
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl<S: ReplicatedState> SmStore<S> {
    /// Opens the store in `dir`, starting from its snapshot if there is one.
    pub fn open(dir: &Path) -> io::Result<SmStore<S>> {
        create_dir_durable(dir)?;
        let mut inner = Inner {
            state: S::default(),
            last_applied: None,
            membership: StoredMembership::default(),
            snapshot: None,
            built: 0,
        };
        if let Some(bytes) = read_atomic(&dir.join(SNAPSHOT_FILE))? {
            let file: SnapshotFile =
                postcard::from_bytes(&bytes).map_err(|e| bad(format!("snapshot file: {e}")))?;
            inner.state = postcard::from_bytes(&file.data)
                .map_err(|e| bad(format!("snapshot state: {e}")))?;
            inner.last_applied = file.meta.last_log_id;
            inner.membership = file.meta.last_membership.clone();
            inner.snapshot = Some((file.meta, file.data));
        }
        let (applied, _) = watch::channel(Applied {
            state: Arc::new(inner.state.clone()),
            last_applied: inner.last_applied.map(|l| l.index),
        });
        Ok(SmStore {
            inner: Arc::new(Mutex::new(inner)),
            dir: dir.to_path_buf(),
            applied,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<S>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Follows the applied state.
    pub fn watch(&self) -> watch::Receiver<Applied<S>> {
        self.applied.subscribe()
    }

    /// A copy of the state and the index it reflects.
    pub fn current(&self) -> (S, Option<u64>) {
        let g = self.lock();
        (g.state.clone(), g.last_applied.map(|l| l.index))
    }

    fn publish(&self, g: &Inner<S>) {
        self.applied.send_replace(Applied {
            state: Arc::new(g.state.clone()),
            last_applied: g.last_applied.map(|l| l.index),
        });
    }

    fn persist(&self, meta: &Meta, data: &[u8]) -> io::Result<()> {
        let file = SnapshotFile {
            meta: meta.clone(),
            data: data.to_vec(),
        };
        let bytes = postcard::to_stdvec(&file).map_err(|e| bad(e.to_string()))?;
        write_atomic(&self.dir, SNAPSHOT_FILE, &bytes)
    }
}

impl<S: ReplicatedState> RaftSnapshotBuilder<C<S>> for SmStore<S> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<C<S>>, SErr> {
        let (meta, data) = {
            let mut g = self.lock();
            g.built += 1;
            let data = postcard::to_stdvec(&g.state)
                .map_err(|e| StorageIOError::write_snapshot(None, &bad(e.to_string())))?;
            let snapshot_id = match g.last_applied {
                Some(l) => format!("{}-{}-{}", l.leader_id.term, l.index, g.built),
                None => format!("none-{}", g.built),
            };
            let meta = Meta {
                last_log_id: g.last_applied,
                last_membership: g.membership.clone(),
                snapshot_id,
            };
            (meta, data)
        };
        self.persist(&meta, &data)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        self.lock().snapshot = Some((meta.clone(), data.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl<S: ReplicatedState> RaftStateMachine<C<S>> for SmStore<S> {
    type SnapshotBuilder = SmStore<S>;

    async fn applied_state(
        &mut self,
    ) -> Result<
        (
            Option<LogId<ReplicaId>>,
            StoredMembership<ReplicaId, BasicNode>,
        ),
        SErr,
    > {
        let g = self.lock();
        Ok((g.last_applied, g.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Option<S::Reply>>, SErr>
    where
        I: IntoIterator<Item = Entry<C<S>>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut g = self.lock();
        let mut replies = Vec::new();
        for entry in entries {
            let log_id = *entry.get_log_id();
            g.last_applied = Some(log_id);
            match entry.payload {
                EntryPayload::Blank => replies.push(None),
                EntryPayload::Normal(cmd) => replies.push(Some(g.state.apply(&cmd))),
                EntryPayload::Membership(m) => {
                    g.membership = StoredMembership::new(Some(log_id), m);
                    replies.push(None);
                }
            }
        }
        self.publish(&g);
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let state: S = postcard::from_bytes(&data).map_err(|e| {
            StorageIOError::read_snapshot(Some(meta.signature()), &bad(e.to_string()))
        })?;
        self.persist(meta, &data)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let mut g = self.lock();
        g.state = state;
        g.last_applied = meta.last_log_id;
        g.membership = meta.last_membership.clone();
        g.snapshot = Some((meta.clone(), data));
        self.publish(&g);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<C<S>>>, SErr> {
        let g = self.lock();
        Ok(g.snapshot.as_ref().map(|(meta, data)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(data.clone())),
        }))
    }
}
