//! The Kochab metadata server.
//!
//! - [`server`]: start (recover, then serve), the checkpointer thread, shutdown.
//! - [`conn`]: one connection: handshake, batched execution, durable replies.
//! - [`core`]: the engine, reply cache, sessions and leases: the state behind one lock.
//! - [`step`]: the core's one entry (`Core::step(event, now) -> effects`); [`opens`]: its
//!   session operations; [`outbox`]: the records and callbacks it hands out.
//! - [`shared`]: the core's shell: the lock, the journal, the stores, the clock.
//! - [`clock`]: the one clock the core reads (the system's, or a simulation's).
//! - [`checkpoint`] / [`recovery`]: per-table incremental checkpoints, versioned manifests
//!   that name each table's owner and journals, and start-up.
//! - [`cluster_host`]: a member's participant in the coordinator's protocols (admission,
//!   lease, ADD/DROP over the network).
//! - [`txn_host`]: multi-server operations as two-phase commit (issue 33, `--multi-server
//!   txn`): [`txn_plan`] makes and checks their plans, [`txn_wire`] encodes their records
//!   and messages.
//! - [`membership`]: tables joining and leaving a running server (drop, add, takeover).
//! - [`replycache`]: answers to retried non-idempotent requests; [`replaytags`]: what
//!   proves a replay genuine.
//! - [`leases`]: what mounts cache, and the callbacks that revoke it before a change.
//! - [`datadir`]: the cluster key and description; [`metrics`]: Prometheus endpoint.
//! - [`data`]: file data as chunk objects; [`filesvc`]: open files, locks and data
//!   operations; [`filelocks`]: the per-file lock that orders writes against truncation.

pub mod checkpoint;
pub mod clock;
pub mod cluster_host;
pub mod conn;
pub mod core;
pub mod data;
pub mod datadir;
pub mod datapass;
pub mod fileaccess;
pub mod filelocks;
pub mod filesvc;
pub mod gc;
pub mod grants;
pub mod keys;
pub mod leases;
pub mod locks;
pub mod loglimit;
pub mod manifest;
pub mod membership;
pub mod metrics;
pub mod opens;
pub mod outbox;
pub mod recovery;
pub mod released;
pub mod replaytags;
pub mod replycache;
pub mod server;
pub mod session;
pub mod shared;
pub mod slicesvc;
pub mod slicework;
pub mod step;
pub mod stop_reason;
pub mod tablepass;
pub mod txn_host;
pub mod txn_plan;
pub mod txn_wire;
pub mod unsettled;
pub use kochab_tls as tls;

pub use datadir::{DataDir, KEY_FILE, read_key_file};
pub use server::{RunningServer, ServerConfig, start, start_member, start_on};
