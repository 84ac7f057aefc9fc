//! Kochab coordinator replication: any pure, deterministic state (`ReplicatedState`) kept
//! by a group of 1, 3 or 5 replicas through openraft 0.9 (the v2 storage traits, no
//! adaptor).
//!
//! - `log_store`: the Raft log, append-only segment files with a CRC32C per entry, fsynced
//!   before openraft hears "flushed"; the vote in its own atomically replaced file.
//! - `sm_store`: the applied state and its snapshots (written atomically).
//! - `wire`: frames (length + CRC32C) and the mutual HMAC-SHA256 handshake. It is
//!   self-contained here on purpose: the metadata protocol's handshake in `kochab-proto` is
//!   being changed separately, and the replicas must not depend on that churn.
//! - `net`: the RPCs between replicas and from clients over that wire.
//! - `replica`: `Replica<S>`, a running replica (propose, linearizable read, subscribe,
//!   membership, status).
//! - `client`: `CoordClient<S>`, finds the leader from any replica address and rides out an
//!   election.

pub mod client;
pub mod coordinator;
pub mod error;
pub mod log_store;
pub mod net;
pub mod replica;
pub mod sm_store;
pub mod wire;

use std::cmp::Ordering;
use std::fmt;
use std::marker::PhantomData;

pub use client::{ClientConfig, CoordClient};
pub use error::CoordError;
pub use net::{ReplicaStatus, ReplicaTls};
pub use replica::{CoordView, Replica, ReplicaConfig, Timing, run_replica_until_signal};
pub use wire::{CLUSTER_KEY_BYTES, ClusterKey};

/// A replica's id within its group (nonzero by convention, unique in the group).
pub type ReplicaId = u64;

/// The state the replicas agree on. The lead's coordinator state implements it.
pub trait ReplicatedState:
    Clone + Default + serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static
{
    /// A change to the state, decided by the log's order.
    type Command: Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static;
    /// What applying a command answers to its proposer.
    type Reply: Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static;
    /// Pure and deterministic: time enters only inside commands.
    fn apply(&mut self, cmd: &Self::Command) -> Self::Reply;
    /// Called by the replica that appends a proposed command, just before (only the
    /// leader's append succeeds): lets the state put the leader's clock into commands that
    /// carry time, so that every replica applies the same time from the log and `apply`
    /// stays pure. The default leaves commands as proposed.
    fn stamp(_cmd: &mut Self::Command) {}
}

/// openraft's type configuration for a state `S`. A zero-sized marker; the manual trait
/// impls avoid derive's bounds on `S`, which openraft's `Copy + Ord + ...` would pull in.
pub struct TypeConfig<S>(PhantomData<fn() -> S>);

impl<S> Clone for TypeConfig<S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for TypeConfig<S> {}
impl<S> Default for TypeConfig<S> {
    fn default() -> Self {
        TypeConfig(PhantomData)
    }
}
impl<S> fmt::Debug for TypeConfig<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TypeConfig")
    }
}
impl<S> PartialEq for TypeConfig<S> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<S> Eq for TypeConfig<S> {}
impl<S> PartialOrd for TypeConfig<S> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<S> Ord for TypeConfig<S> {
    fn cmp(&self, _: &Self) -> Ordering {
        Ordering::Equal
    }
}

impl<S: ReplicatedState> openraft::RaftTypeConfig for TypeConfig<S> {
    type D = S::Command;
    type R = Option<S::Reply>;
    type NodeId = ReplicaId;
    type Node = openraft::BasicNode;
    type Entry = openraft::Entry<Self>;
    type SnapshotData = std::io::Cursor<Vec<u8>>;
    type AsyncRuntime = openraft::TokioRuntime;
    type Responder = openraft::impls::OneshotResponder<Self>;
}

/// The openraft handle for a state `S`.
pub type Raft<S> = openraft::Raft<TypeConfig<S>>;
