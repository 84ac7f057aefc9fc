//! Kochab's scale-out protocols as pure state machines (events in, actions out; the caller
//! owns sockets, disks and clocks): the coordinator's replicated state ([`state`], with
//! the cluster's client keys in [`keys`]), the leader's driver ([`driver`]), the metadata server's side ([`participant`]) and its host's bookkeeping ([`host`]), client
//! routing and its retry policy ([`router`]) and a seeded whole-cluster simulation ([`sim`]).
//! Beside them, multi-server operations as two-phase commit ([`txn`]), with its own
//! seeded simulation ([`txn::sim`]); not yet wired into the server.

pub mod balance;
pub mod driver;
pub mod host;
pub mod keys;
pub mod participant;
pub mod router;
pub mod sim;
pub mod state;
pub mod txn;
