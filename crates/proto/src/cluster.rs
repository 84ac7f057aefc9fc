//! Scale-out messages and the data the coordinator replicates: the delegation map, server
//! incarnations, borrows, and the messages between coordinator and metadata servers.
//!
//! Pure data. The state machines that use these types live in `kochab-cluster`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::auth::{KEY_BYTES, KeyId, SEAL_NONCE_BYTES};
use crate::errno::FsError;
use crate::types::{InodeId, KeyPolicy};

/// A metadata server, stable across its restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ServerId(pub u32);

/// One incarnation of a server. Bumped by the coordinator when the server registers again
/// or is fenced; journals and manifests are written in the name of an epoch, and a lower
/// epoch of the same server is dead forever.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Epoch(pub u64);

/// A table is a contiguous inode-id range `[lo, hi)`; its id is its `lo`. A split creates
/// a new table whose id is the split point, so ids never change meaning.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct TableId(pub InodeId);

/// Version of the delegation map; bumped on every change of a placement or of the server
/// list, so a cached map can be compared with the coordinator's.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct MapVersion(pub u64);

/// A server incarnation: whose journal, whose manifest write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Incarnation {
    pub server: ServerId,
    pub epoch: Epoch,
}

/// Where one table is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// End of the table's id range (exclusive); the start is the table id.
    pub hi: InodeId,
    pub owner: ServerId,
    /// The owner's epoch when the table was assigned to it.
    pub epoch: Epoch,
}

/// Which server serves which table. Clients and servers cache it; `version` says how old a
/// copy is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegationMap {
    pub version: MapVersion,
    pub tables: BTreeMap<TableId, Placement>,
    /// Address of every registered server (clients route to them).
    pub servers: BTreeMap<ServerId, String>,
}

impl DelegationMap {
    /// The table whose range holds `id`, with its placement.
    pub fn table_of(&self, id: InodeId) -> Option<(TableId, Placement)> {
        let (t, p) = self.tables.range(..=TableId(id)).next_back()?;
        (id < p.hi).then_some((*t, *p))
    }

    /// The server a request for `table` goes to.
    pub fn owner(&self, table: TableId) -> Option<ServerId> {
        self.tables.get(&table).map(|p| p.owner)
    }
}

/// A borrow request's name: chosen by the asking incarnation, increasing per incarnation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BorrowId {
    pub server: ServerId,
    pub epoch: Epoch,
    pub seq: u64,
}

/// Operations counted on one table since the last report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableLoad {
    pub table: TableId,
    pub ops: u64,
    pub inodes: u64,
}

/// A client key as a cluster's coordinator keeps it: its secret sealed under the cluster
/// key (see [`crate::auth::seal_client_key`]), so the replicated state holds no usable
/// secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedKey {
    /// Drawn at random for this key: the seal's input, and what makes a retried proposal
    /// of the same key recognisable (the coordinator's client may apply a command twice).
    pub nonce: [u8; SEAL_NONCE_BYTES],
    pub sealed: [u8; KEY_BYTES],
    pub policy: KeyPolicy,
    pub revoked: bool,
    /// What the admin said the key is for.
    pub note: String,
}

/// What a metadata server asks of the coordinator (the coordinator stamps the time and
/// turns each into a [`CoordCommand`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerRequest {
    /// A new process: `nonce` is random per process start, so a retried Register of the
    /// same process gets the same epoch back instead of fencing itself.
    Register {
        server: ServerId,
        addr: String,
        nonce: u64,
    },
    RenewLease {
        server: ServerId,
        epoch: Epoch,
    },
    /// Every table one operation needs, granted all at once or queued (FIFO).
    /// `done_below`: every borrow of this incarnation with a lower seq is returned (lets
    /// the coordinator forget them and still refuse their late duplicates).
    Borrow {
        id: BorrowId,
        tables: Vec<TableId>,
        done_below: u64,
    },
    /// The operation that needed the borrow is done (durable or failed).
    Return {
        id: BorrowId,
        done_below: u64,
    },
    ReportLoad {
        server: ServerId,
        epoch: Epoch,
        loads: Vec<TableLoad>,
    },
    /// Operations of this server that needed tables another server holds, since the last
    /// report (`--multi-server auto`: the balancer's affinity rule). Sent every report
    /// interval, empty too: each report replaces the server's last one.
    ReportRemoteUse {
        server: ServerId,
        epoch: Epoch,
        uses: Vec<RemoteUse>,
    },
}

/// Multi-server operations of one server that needed `table` (held by another server)
/// since its last report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteUse {
    pub table: TableId,
    pub ops: u64,
}

/// A command of the coordinator's replicated state machine. Time enters only as `now_ms`,
/// stamped by the leader when it proposes, so applying is deterministic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoordCommand {
    /// First command of a cluster: the tables (`(lo, hi)`) and the lease length.
    Bootstrap {
        tables: Vec<(TableId, InodeId)>,
        lease_ms: u64,
    },
    /// A server's request, with the leader's clock.
    Request { req: ServerRequest, now_ms: u64 },
    /// Time passes: leases that ended are fenced.
    Tick { now_ms: u64 },
    /// An operator or the rebalancer asks to move a table.
    Move { table: TableId, to: ServerId },
    /// A server finished a DROP (reported by the driver). `map_version` is the Drop's, so
    /// a late duplicate from an earlier migration of the table matches nothing.
    Dropped {
        table: TableId,
        by: Incarnation,
        map_version: MapVersion,
    },
    /// A server finished an ADD or a recovery of these tables (`map_version`: of the Add).
    /// `splits`: splits it found finished in the store that the map does not show (its
    /// owner split the table and failed before the coordinator heard of it).
    Added {
        tables: Vec<TableId>,
        by: Incarnation,
        map_version: MapVersion,
        #[serde(default)]
        splits: Vec<(TableId, InodeId)>,
    },
    /// An operator drains `server` (`drain`: its tables move off one at a time and no
    /// placement picks it) or brings it back into service (`!drain`).
    Drain { server: ServerId, drain: bool },
    /// An operator or the balancer asks to split `table` (at `at`, or where its owner finds
    /// half of its inodes below).
    Split { table: TableId, at: Option<InodeId> },
    /// The owner split `table` at `at` durably (reported by the driver): the map gains the
    /// table `[at, hi)` on the same server.
    SplitDone {
        table: TableId,
        at: InodeId,
        by: Incarnation,
        map_version: MapVersion,
    },
    /// The owner cannot split `table` (too small, or in an overflow region): forget the
    /// request.
    SplitRefused {
        table: TableId,
        by: Incarnation,
        map_version: MapVersion,
        reason: String,
    },
    /// A new client key (a metadata server forwards `kochab key add`): the state gives it
    /// the next id. `key.revoked` is false.
    KeyAdd { key: SealedKey },
    /// Revokes client key `id` for good.
    KeyRevoke { id: KeyId },
    /// The client keys a single server's data directory held (`keys.json`), with their
    /// ids, taken once, when the directory became a cluster's: the first member to
    /// register proposes them, before any key is added.
    KeysImport {
        next_id: KeyId,
        keys: Vec<(KeyId, SealedKey)>,
    },
    /// Incarnation `by` applied the client keys up to `version` and closed the
    /// connections of every key revoked by then (reported by the driver).
    KeysApplied { by: Incarnation, version: u64 },
}

/// How a borrow stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BorrowPhase {
    /// Waits for conflicting borrows before it (FIFO).
    Queued,
    /// Locked; its tables are being moved to the borrower.
    Moving,
    /// Every table is served by the borrower; the operation may run.
    Ready,
}

/// The result of applying a command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoordReply {
    Ok,
    /// `nonce` echoes the Register it answers: a reply meant for an earlier process of the
    /// same server is recognised as such.
    Registered {
        epoch: Epoch,
        lease_ms: u64,
        nonce: u64,
    },
    /// The lease of `epoch` was extended to at least `lease_ms` after the request arrived.
    Renewed {
        epoch: Epoch,
        lease_ms: u64,
    },
    /// The incarnation that asked is dead; the process must restart as a new one.
    Fenced {
        current: Epoch,
    },
    Borrow {
        phase: BorrowPhase,
    },
    /// A duplicate or late command that changes nothing (safe to ignore).
    Stale(String),
    /// A command that cannot be applied, with the reason.
    Refused(String),
    /// A key was added or revoked: its id and the version of the client keys that holds
    /// the change (done once every live server has applied that version).
    Key {
        id: KeyId,
        version: u64,
    },
    /// A key command refused, with the errno the admin gets (no such key, too many keys).
    KeyRefused(FsError),
}

/// What the coordinator tells a server to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlBody {
    /// Stop serving `table`: let in-flight operations finish, refuse new ones (answering
    /// WrongServer naming `to`), write a clean checkpoint, reply `Dropped`.
    Drop {
        table: TableId,
        map_version: MapVersion,
        to: ServerId,
    },
    /// Start serving these tables. A table whose manifest names a journal of an incarnation
    /// older than `epochs` says (a fenced one) is recovered: that journal is sealed in the
    /// store, then replayed. This one message is both Ursa's ADD and its recovery (all the
    /// tables of a failed server are recovered together by one server).
    Add {
        tables: Vec<TableId>,
        map_version: MapVersion,
        epochs: Vec<Incarnation>,
    },
    /// Every table of this borrow is yours until you Return it.
    Grant { id: BorrowId },
    /// Split `table` (at `at`, or at the box boundary with half its inodes below): let
    /// in-flight operations finish, write both halves' checkpoints, reply `Split`.
    Split {
        table: TableId,
        at: Option<InodeId>,
        map_version: MapVersion,
    },
    /// The client keys changed up to `version`: read them from the coordinator, refuse
    /// revoked keys and close their connections, reply `KeysApplied`.
    Keys { version: u64 },
    /// Not the coordinator's: one member's multi-server transaction message (issue 33) to
    /// another, `msg` an encoded `kochab_cluster::txn::Msg` from the server holding
    /// journal `from` now. Sent over the same authenticated channel (admin key only); the
    /// receiving host decodes and checks it, and `to` is not looked at (the protocol
    /// names journals, not incarnations). Never answered.
    Txn {
        from: ServerId,
        #[serde(with = "serde_bytes")]
        msg: Vec<u8>,
    },
}

/// A control message addressed to one incarnation; any other incarnation ignores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Control {
    pub to: Incarnation,
    pub body: ControlBody,
}

/// A server's answer to a control message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlReply {
    Dropped {
        table: TableId,
        by: Incarnation,
        map_version: MapVersion,
    },
    Added {
        tables: Vec<TableId>,
        by: Incarnation,
        map_version: MapVersion,
        /// As `CoordCommand::Added::splits`.
        #[serde(default)]
        splits: Vec<(TableId, InodeId)>,
    },
    AddFailed {
        tables: Vec<TableId>,
        by: Incarnation,
        reason: String,
    },
    GrantAck {
        id: BorrowId,
    },
    /// `table` is split at `at`, durably.
    Split {
        table: TableId,
        at: InodeId,
        by: Incarnation,
        map_version: MapVersion,
    },
    /// `table` cannot be split (`reason`); asking again is pointless until it changes.
    SplitRefused {
        table: TableId,
        by: Incarnation,
        map_version: MapVersion,
        reason: String,
    },
    /// The client keys up to `version` are applied here (see `ControlBody::Keys`).
    KeysApplied {
        by: Incarnation,
        version: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_of_finds_the_range() {
        let mut m = DelegationMap::default();
        let p = |hi, o| Placement {
            hi,
            owner: ServerId(o),
            epoch: Epoch(1),
        };
        m.tables.insert(TableId(10), p(20, 1));
        m.tables.insert(TableId(30), p(40, 2));
        assert_eq!(m.table_of(15).map(|x| x.0), Some(TableId(10)));
        assert_eq!(m.table_of(20), None);
        assert_eq!(m.table_of(5), None);
        assert_eq!(m.table_of(39).map(|x| x.1.owner), Some(ServerId(2)));
    }

    #[test]
    fn commands_round_trip() {
        let c = CoordCommand::Request {
            req: ServerRequest::Borrow {
                id: BorrowId {
                    server: ServerId(1),
                    epoch: Epoch(2),
                    seq: 3,
                },
                tables: vec![TableId(1), TableId(9)],
                done_below: 0,
            },
            now_ms: 5,
        };
        let bytes = postcard::to_stdvec(&c).unwrap();
        assert_eq!(postcard::from_bytes::<CoordCommand>(&bytes).unwrap(), c);
    }
}
