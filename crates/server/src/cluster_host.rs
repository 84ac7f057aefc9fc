//! A member server's side of the coordinator's protocols: it hosts the pure
//! [`Participant`] (registration, lease, self-fencing, DROP with drain, ADD) and carries
//! out what it asks over the network and the store.
//!
//! - Before an operation runs, [`ClusterHost::admit_op`] maps every id it names to its table
//!   and asks the participant; after it, [`ClusterHost::op_done`] ends it once its reply is
//!   durable (that count is the drain of a DROP).
//! - A loop ticks the participant (~every 100 ms) and carries out its actions: requests go
//!   to the coordinator as `CoordCommand::Request` (the leader stamps the time), loads run
//!   [`Shared::add_table`] / [`Shared::recover_tables`], checkpoints [`Shared::drop_table`],
//!   and a fence ends the process (its supervisor starts a new incarnation).
//! - `GetMap` and `Control` requests are answered here, never by the engine.
//! - The client keys are the coordinator's (`kochab_cluster::keys`): every read of its
//!   state updates this server's copy ([`ClusterHost::keys`]), the driver's `Keys` control
//!   is answered once the keys are applied and revoked keys' connections closed, and
//!   `kochab key` requests are proposed to the coordinator and answered once every live
//!   server has applied the change ([`ClusterHost::key_op`]).
//!
//! - An operation whose tables are not all here (its first one is) is parked and run by
//!   [`borrowed_op`] once the coordinator has moved them all here (BORROW); the last
//!   operation using the borrow returns them (RETURN).

use crate::core::{Core, Member, Parked, Refusal};

use crate::keys::KeyStore;
use crate::manifest::read_manifest_by_id;
use crate::shared::Shared;
use kochab_cluster::host::borrows::{BORROW_WAIT_MS, Borrows, Granted, Join};
use kochab_cluster::host::load::{self, ClaimRefused, LoadCounter, LoadPlan};
use kochab_cluster::host::{ends::Ends, ranges::Ranges};
use kochab_cluster::participant::{Action, Admit, Participant, ParticipantConfig, SplitOutcome};
use kochab_cluster::state::CoordState;
use kochab_coord::{ClientConfig, CoordClient, CoordError};
use kochab_journal::JournalId;
use kochab_proto::auth::{ADMIN_KEY_ID, ClusterKey, KeyId, seal_client_key};
use kochab_proto::cluster::{
    BorrowId, Control, ControlBody, ControlReply, CoordCommand, CoordReply, DelegationMap,
    Incarnation, MapVersion, SealedKey, ServerId, TableId,
};
use kochab_proto::*;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

/// How often the participant is ticked (lease renewal, retries, fencing).
pub const TICK: Duration = Duration::from_millis(100);
/// A cached map older than this is refreshed from the coordinator before `GetMap` answers.
pub const MAP_FRESH: Duration = Duration::from_millis(200);
/// The map is refreshed in the background this often (for WRONG_SERVER hints).
const MAP_REFRESH_EVERY: Duration = Duration::from_secs(1);
/// Per-table load goes to the coordinator this often (operations admitted in the interval
/// and inodes held): one Raft entry per server per interval.
pub const LOAD_REPORT_EVERY: Duration = Duration::from_millis(load::LOAD_REPORT_EVERY_MS);
/// How long a `GetMap` waits for the coordinator before answering from the cache.
const MAP_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a `Control` waits for the participant's answer (the driver resends after).
pub const CONTROL_WAIT: Duration = Duration::from_secs(2);
/// How long registration may take before the start fails.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a key command may try to reach the coordinator (an election included).
const KEY_PROPOSE_BUDGET: Duration = Duration::from_secs(5);
/// How often a key change is checked for being settled while `kochab key` waits.
const KEYS_SETTLE_POLL: Duration = Duration::from_millis(50);

/// How long an operation waits for its borrow before the client is told to ask again.
const BORROW_WAIT: Duration = Duration::from_millis(BORROW_WAIT_MS);

/// Why the host could not do what its participant or a caller asked.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A manifest refuses the load: the table's owner is not fenced, or an earlier load of
    /// this incarnation stopped half-way.
    #[error(transparent)]
    Claim(#[from] ClaimRefused),
    /// A table's manifest could not be read from the store.
    #[error("table {table:016x}: {source}")]
    Manifest {
        /// The table's first id.
        table: u64,
        /// What the store said.
        #[source]
        source: std::io::Error,
    },
    /// A table of the map has no manifest in the store.
    #[error("table {0:016x} has no manifest in the store")]
    NoManifest(u64),
    /// The store or the journal failed (adding, recovering, splitting, releasing a table).
    #[error(transparent)]
    Store(#[from] std::io::Error),
    /// The coordinator did not answer, or refused.
    #[error(transparent)]
    Coord(#[from] CoordError),
    /// The coordinator answered a key import with something else than success.
    #[error("the key import was refused: {0}")]
    ImportRefused(String),
    /// The data directory's key file could not be read.
    #[error("{0}")]
    KeysFile(#[source] std::io::Error),
    /// The system gave no random bytes.
    #[error("no randomness: {0}")]
    NoRandomness(getrandom::Error),
    /// A key change is not settled yet: what it still waits for.
    #[error("{0}")]
    Unsettled(String),
    /// The host is not attached to its server yet.
    #[error("the server is still starting")]
    Starting,
    /// A blocking task carrying out an action panicked or was cancelled.
    #[error("{what} task failed: {source}")]
    Task {
        /// The action: load, split or drop.
        what: &'static str,
        /// How the task ended.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl HostError {
    /// The errno a reply that carries this error names.
    pub fn errno(&self) -> Errno {
        match self {
            HostError::Claim(_) => Errno::EBUSY,
            HostError::Manifest { source, .. } | HostError::KeysFile(source) => {
                Errno::of_io(source)
            }
            HostError::Store(e) => Errno::of_io(e),
            HostError::Coord(e) => Errno(e.errno()),
            HostError::Unsettled(_) => Errno::ETIMEDOUT,
            HostError::Starting => Errno::EAGAIN,
            HostError::NoManifest(_)
            | HostError::ImportRefused(_)
            | HostError::NoRandomness(_)
            | HostError::Task { .. } => Errno::EIO,
        }
    }
}

/// Milliseconds from a clock the host reads (monotonic in production, injected in tests).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// A monotonic millisecond clock starting at 0 now.
pub fn monotonic_clock() -> Clock {
    let base = Instant::now();
    Arc::new(move || base.elapsed().as_millis() as u64)
}

/// Who a member is and how it reaches the coordinator.
#[derive(Clone)]
pub struct HostConfig {
    pub server: ServerId,
    /// The address clients and the coordinator reach this server at.
    pub addr: String,
    pub coord: Vec<SocketAddr>,
    pub key: [u8; 32],
    /// TLS to the coordinator replicas and to the other members (their certificates must
    /// name the addresses in `coord` and those they registered); plain TCP if `None`.
    pub coord_tls: Option<crate::tls::TlsClient>,
    /// The id ranges of the cluster's tables (`lo`, `hi`): how ids map to tables.
    pub ranges: Vec<(u64, u64)>,
    pub participant: ParticipantConfig,
    pub clock: Clock,
    /// The data directory whose key file (`keys.json` of a single server) the cluster
    /// takes, if it has no keys yet (the first member to register proposes it).
    pub import_keys_from: Option<PathBuf>,
    /// txn (issue 33) hook: how multi-server operations run (`--multi-server`).
    pub multi_server: crate::txn_host::MultiServer,
}

/// One operation's use of a granted borrow: dropping it ends the use, and the last user
/// returns the tables.
pub struct BorrowUse {
    host: Arc<ClusterHost>,
    id: BorrowId,
}

impl Drop for BorrowUse {
    fn drop(&mut self) {
        self.host.leave_borrow(self.id);
    }
}

#[derive(Default)]
struct MapCache {
    map: DelegationMap,
    fetched: Option<Instant>,
}

/// The participant of one member incarnation and what carries out its actions.
pub struct ClusterHost {
    p: Mutex<Participant>,
    /// Proposals (registration, renewals, borrows) go through this one...
    coord: CoordClient<CoordState>,
    /// The coordinator replicas' addresses (for `kochab status`).
    pub coord_addrs: Vec<String>,
    /// ...and map reads through this one, so a burst of GetMap never delays a renewal.
    reader: CoordClient<CoordState>,
    clock: Clock,
    /// How ids map to tables: the cluster's tables at start, cut further by every split
    /// this server makes or sees in the map.
    ranges: parking_lot::RwLock<Ranges>,
    me: OnceLock<JournalId>,
    map: Mutex<MapCache>,
    /// One map read at a time; later callers use its result.
    refreshing: tokio::sync::Mutex<()>,
    actions: mpsc::UnboundedSender<Action>,
    control_replies: broadcast::Sender<ControlReply>,
    /// Admitted operations waiting for their record to be durable: their tables.
    ends: Mutex<Ends<Vec<TableId>>>,
    shared: OnceLock<Weak<Shared>>,
    fenced: watch::Sender<Option<String>>,
    /// This incarnation's borrows that operations wait for or run under (each waiter is
    /// told `true` when granted, `false` when refused).
    borrows: Mutex<Borrows<oneshot::Sender<bool>>>,
    /// The cluster key and this server's copy of the coordinator's client keys.
    keys: Arc<KeyStore>,
    /// Key commands and the reads that wait for them to settle, apart from the clients
    /// above: a `kochab key` waiting seconds delays no renewal and no map read.
    keys_client: CoordClient<CoordState>,
    /// The group's lease (what a key change takes to settle at worst follows from it).
    lease_ms: u64,
    /// A read of the state showed the keys imported (or added): nothing to import.
    keys_imported: AtomicBool,
    /// Operations admitted per table since the last load report.
    admitted: Mutex<LoadCounter>,
    /// txn (issue 33) hook: the transaction host (none with `--multi-server borrow`).
    txn: Option<Arc<crate::txn_host::TxnHost>>,
}

/// True if `r` answers the control `c` (the driver matches replies to what it sent).
pub fn answers(c: &Control, r: &ControlReply) -> bool {
    match (&c.body, r) {
        (ControlBody::Drop { table, .. }, ControlReply::Dropped { table: t, .. }) => t == table,
        (
            ControlBody::Add { tables, .. },
            ControlReply::Added { tables: ts, .. } | ControlReply::AddFailed { tables: ts, .. },
        ) => ts.iter().any(|t| tables.contains(t)),
        (ControlBody::Grant { id }, ControlReply::GrantAck { id: i }) => i == id,
        (
            ControlBody::Split { table, .. },
            ControlReply::Split { table: t, .. } | ControlReply::SplitRefused { table: t, .. },
        ) => t == table,
        _ => false,
    }
}

impl ClusterHost {
    /// Registers a new incarnation of `cfg.server` with the coordinator (a random nonce)
    /// and keeps its lease from then on. Fails if the coordinator does not answer within
    /// 30 s or refuses.
    pub async fn register(cfg: HostConfig) -> std::io::Result<Arc<ClusterHost>> {
        let ranges = Ranges::new(cfg.ranges.clone());
        let client = |budget: Duration| {
            let mut c = ClientConfig::new(cfg.coord.clone(), cfg.key);
            c.budget = budget;
            c.attempt_timeout = Duration::from_millis(1000);
            c.tls = cfg.coord_tls.clone();
            CoordClient::<CoordState>::new(c)
        };
        let reader = client(MAP_READ_TIMEOUT);
        let deadline = Instant::now() + REGISTER_TIMEOUT;
        // A group that has not recorded its tables yet has no lease length to give.
        let lease_ms = loop {
            match reader.read_state().await {
                Ok((state, _)) if state.bootstrapped => break state.lease_ms,
                Ok(_) => {}
                Err(e) => tracing::debug!("coordinator not ready: {e}"),
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the coordinator at {:?} was not ready within {REGISTER_TIMEOUT:?}",
                        cfg.coord
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Renew often enough for the group's lease: a third of it leaves two retries.
        let mut participant = cfg.participant;
        participant.renew_every_ms = participant.renew_every_ms.min(lease_ms / 3).max(50);
        participant.margin_ms = participant.margin_ms.min(lease_ms / 6);
        participant.retry_ms = participant.retry_ms.min(participant.renew_every_ms);
        let (tx, rx) = mpsc::unbounded_channel();
        let host = Arc::new(ClusterHost {
            p: Mutex::new(Participant::new(
                cfg.server,
                cfg.addr.clone(),
                kochab_proto::auth::random_u64(),
                participant,
            )),
            coord: client(Duration::from_secs(2)),
            coord_addrs: cfg.coord.iter().map(|a| a.to_string()).collect(),
            reader,
            clock: cfg.clock.clone(),
            ranges: parking_lot::RwLock::new(ranges),
            me: OnceLock::new(),
            map: Mutex::new(MapCache::default()),
            refreshing: tokio::sync::Mutex::new(()),
            actions: tx,
            control_replies: broadcast::channel(64).0,
            ends: Mutex::new(Ends::new()),
            shared: OnceLock::new(),
            fenced: watch::channel(None).0,
            borrows: Mutex::new(Borrows::new()),
            admitted: Mutex::new(LoadCounter::default()),
            keys: Arc::new(KeyStore::for_cluster(cfg.key)),
            keys_client: client(KEY_PROPOSE_BUDGET),
            lease_ms,
            keys_imported: AtomicBool::new(false),
            txn: crate::txn_host::TxnHost::for_mode(
                cfg.multi_server,
                cfg.server,
                cfg.coord_tls.clone(),
            ),
        });
        tokio::spawn(run(host.clone(), rx));
        let mut fenced = host.fenced.subscribe();
        loop {
            if let Some(inc) = host.p.lock().incarnation() {
                let _ = host.me.set(JournalId {
                    server: u64::from(inc.server.0),
                    epoch: inc.epoch.0,
                });
                break;
            }
            if let Some(why) = fenced.borrow_and_update().clone() {
                return Err(std::io::Error::other(format!(
                    "registration refused: {why}"
                )));
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the coordinator at {:?} did not register server {} within {:?}",
                        cfg.coord, cfg.server.0, REGISTER_TIMEOUT
                    ),
                ));
            }
            let _ = tokio::time::timeout(Duration::from_millis(20), fenced.changed()).await;
        }
        let _ = host.refresh_map().await;
        loop {
            match host.join_keys(cfg.import_keys_from.as_deref()).await {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::info!("client keys not taken yet: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("cannot take the cluster's client keys: {e}"),
                    ));
                }
            }
        }
        Ok(host)
    }

    /// The cluster key and the client keys as this server holds them (what its
    /// connections authenticate with).
    pub fn keys(&self) -> Arc<KeyStore> {
        self.keys.clone()
    }

    /// After registering: takes the cluster's keys (the map read just made took them,
    /// unless it failed), after giving a cluster without keys those of `import`'s key file,
    /// and tells the coordinator this incarnation holds them (it serves nobody yet, so no
    /// connection of a revoked key can be open here).
    async fn join_keys(self: &Arc<Self>, import: Option<&Path>) -> Result<(), HostError> {
        if !self.keys_imported.load(Ordering::Acquire) {
            let (state, _) = self.keys_client.read_state().await?;
            self.learn(&state);
            if !state.keys.imported {
                let cmd = import_command(&self.keys.admin().key, import)?;
                match self.keys_client.propose(cmd).await? {
                    CoordReply::Ok | CoordReply::Stale(_) => {}
                    other => return Err(HostError::ImportRefused(format!("{other:?}"))),
                }
                self.learn(&self.keys_client.read_state().await?.0);
            }
        }
        let version = self.keys.version();
        if version > 0
            && let Some(by) = self.incarnation()
        {
            // Best effort, in the background: the driver's `Keys` control asks otherwise.
            let host = self.clone();
            tokio::spawn(async move {
                let cmd = CoordCommand::KeysApplied { by, version };
                if let Err(e) = host.keys_client.propose(cmd).await {
                    tracing::debug!("keys applied at registration, not told: {e}");
                }
            });
        }
        Ok(())
    }

    /// The journal this incarnation writes: (server id, epoch the coordinator gave it).
    pub fn journal_id(&self) -> JournalId {
        self.me.get().copied().unwrap_or(JournalId {
            server: u64::from(self.p.lock().server().0),
            epoch: 0,
        })
    }

    /// The incarnation, while registered and not fenced.
    pub fn incarnation(&self) -> Option<Incarnation> {
        self.p.lock().incarnation()
    }

    /// Tables held now (serving or draining).
    pub fn tables(&self) -> Vec<TableId> {
        self.p.lock().tables()
    }

    /// Resolves with the reason once this incarnation is fenced: it serves and
    /// acknowledges nothing more; its process should exit (a new one is a new incarnation).
    pub fn fenced(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        crate::stop_reason::first_reason(self.fenced.subscribe())
    }

    /// Connects the host to the server it runs in (once).
    pub fn attach(self: &Arc<Self>, shared: &Arc<Shared>) {
        if self.shared.set(Arc::downgrade(shared)).is_err() {
            return;
        }
        // txn (issue 33) hook: start the transaction host.
        if let Some(t) = &self.txn {
            let map: Arc<dyn crate::txn_host::MemberMap> = self.clone();
            t.attach(map, shared);
        }
        shared.on_each_durable(Arc::downgrade(self), ClusterHost::flush_ends);
    }

    fn now(&self) -> u64 {
        (self.clock)()
    }

    fn push(&self, actions: Vec<Action>) {
        for a in actions {
            let _ = self.actions.send(a);
        }
    }

    /// True while this incarnation may acknowledge anything (its lease is valid).
    pub fn can_ack(&self) -> bool {
        self.p.lock().can_ack(self.now())
    }

    /// Admission of one operation (the caller holds the core lock). `Ok`: run it, then call
    /// [`ClusterHost::op_done`] with the tables returned; `Err`: answer this instead.
    pub fn admit_op(&self, core: &Core, client: u64, op: &Op) -> Result<Vec<TableId>, Refusal> {
        let refuse = |r: Reply| Err(Refusal::Reply(Box::new(r)));
        let tables = match self.ranges.read().tables_of(core.op_ids(client, op)) {
            Ok(tables) => tables,
            Err(id) => return refuse(Reply::Error(kochab_meta::not_in_any_table(id))),
        };
        if tables.is_empty() {
            return Ok(tables);
        }
        // txn (issue 33) hook: a key a transaction holds here: ask again.
        if self
            .txn
            .as_ref()
            .is_some_and(|t| t.blocks(&core.engine, op))
        {
            return refuse(self.not_ready());
        }
        let admit = self.p.lock().admit(&tables, self.now());
        match admit {
            Admit::Ok => {
                self.admitted.lock().admitted(tables[0]);
                Ok(tables)
            }
            Admit::WrongServer { map_version, owner } => {
                refuse(self.wrong_server(tables[0], map_version, owner))
            }
            Admit::NotReady => refuse(self.not_ready()),
            // Gathered closes never borrow: the client closes each by itself instead.
            Admit::NeedBorrow if matches!(op, Op::CloseMany { .. }) => refuse(self.not_ready()),
            Admit::NeedBorrow => Err(Refusal::Borrow(tables)),
        }
    }

    /// "Not now, ask again": the client refreshes its map and retries (a table is loading,
    /// the lease is being renewed, a borrow did not come through in time).
    fn not_ready(&self) -> Reply {
        Reply::WrongServer {
            map_version: self.map.lock().map.version.0,
            owner: None,
            addr: None,
        }
    }

    /// WRONG_SERVER for `table`, naming its owner (the participant's hint, else the cached
    /// map's) and the owner's address when known.
    fn wrong_server(&self, table: TableId, version: MapVersion, hint: Option<ServerId>) -> Reply {
        let mine = self.p.lock().server();
        let cache = self.map.lock();
        let owner = hint
            .or_else(|| cache.map.owner(table))
            .filter(|o| *o != mine);
        Reply::WrongServer {
            map_version: version.0.max(cache.map.version.0),
            owner,
            addr: owner.and_then(|o| cache.map.servers.get(&o).cloned()),
        }
    }

    /// An engine's WRONG_SERVER (an id outside the hosted tables found while the
    /// operation ran, which its plan did not show): for an admitted operation, borrow that
    /// table too; otherwise name its owner.
    pub fn fix_reply(
        &self,
        engine: &mut kochab_meta::Engine,
        admitted: &[TableId],
        reply: Reply,
    ) -> Result<Reply, Refusal> {
        match reply {
            Reply::WrongServer {
                map_version,
                owner: None,
                ..
            } => match engine
                .last_not_hosted
                .take()
                .and_then(|id| self.ranges.read().table_of(id))
            {
                Some(t) if !admitted.is_empty() && !admitted.contains(&t) => {
                    let mut tables = admitted.to_vec();
                    tables.push(t);
                    Err(Refusal::Borrow(tables))
                }
                Some(t) => Ok(self.wrong_server(t, MapVersion(map_version), None)),
                None => Ok(reply),
            },
            other => Ok(other),
        }
    }

    /// txn (issue 33) hook: the server of `id`'s table by the cached map.
    fn owner_of(&self, id: kochab_proto::InodeId) -> Option<ServerId> {
        let table = self.ranges.read().table_of(id)?;
        self.map.lock().map.owner(table)
    }

    /// txn (issue 33) hook: the transaction host, if multi-server operations may run as
    /// transactions.
    pub fn txn_host(&self) -> Option<Arc<crate::txn_host::TxnHost>> {
        self.txn.clone()
    }

    /// `--multi-server auto`: multi-server operations count the other servers' tables
    /// they need, for the coordinator's affinity rule.
    fn counts_remote_use(&self) -> bool {
        self.txn
            .as_ref()
            .is_some_and(|t| t.mode() == crate::txn_host::MultiServer::Auto)
    }

    /// txn (issue 33) hook: a server's address by the cached map.
    fn server_addr(&self, server: ServerId) -> Option<String> {
        self.map.lock().map.servers.get(&server).cloned()
    }

    /// An admitted operation ran; its reply leaves once `lsn` is durable (`durable` is now).
    pub fn op_done(&self, tables: Vec<TableId>, lsn: u64, durable: u64) {
        if tables.is_empty() {
            return;
        }
        let now = self.ends.lock().done(lsn, durable, tables);
        if let Some(tables) = now {
            let acts = self.p.lock().end_op(&tables);
            self.push(acts);
        }
    }

    fn flush_ends(&self, durable: u64) {
        let done = self.ends.lock().durable(durable);
        if done.is_empty() {
            return;
        }
        let mut p = self.p.lock();
        let acts: Vec<Action> = done.iter().flat_map(|t| p.end_op(t)).collect();
        drop(p);
        self.push(acts);
    }

    /// Answers a `GetMap` or `Control` request.
    pub async fn cluster_op(&self, op: Op) -> Reply {
        match op {
            Op::GetMap => self.get_map().await,
            Op::Control { control } => Reply::Control(self.control(control).await),
            other => Reply::Error(fs_err!(EINVAL, "{} is no cluster operation", other.name())),
        }
    }

    async fn get_map(&self) -> Reply {
        let stale = self
            .map
            .lock()
            .fetched
            .is_none_or(|t| t.elapsed() > MAP_FRESH);
        if stale {
            let _ = tokio::time::timeout(MAP_READ_TIMEOUT, self.refresh_map()).await;
        }
        let cache = self.map.lock();
        if cache.fetched.is_none() {
            return Reply::Error(fs_err!(
                EAGAIN,
                "this server has no delegation map yet (the coordinator did not answer)"
            ));
        }
        Reply::Map(cache.map.clone())
    }

    /// Reads the map from the coordinator unless another caller just did.
    async fn refresh_map(&self) -> Result<(), HostError> {
        let asked = Instant::now();
        let _one = self.refreshing.lock().await;
        if self.map.lock().fetched.is_some_and(|t| t >= asked) {
            return Ok(());
        }
        let (state, _) = self.reader.read_state().await?;
        self.learn(&state);
        self.map.lock().fetched = Some(Instant::now());
        Ok(())
    }

    /// Takes what a read of the coordinator's state shows: a newer map (and the splits in
    /// it), newer client keys.
    fn learn(&self, state: &CoordState) {
        {
            let mut cache = self.map.lock();
            if state.map.version >= cache.map.version {
                let tables = state.map.tables.iter().map(|(t, p)| (t.0, p.hi));
                self.ranges.write().cut(tables);
                cache.map = state.map.clone();
            }
        }
        self.keys.apply_cluster(&state.keys);
        if state.keys.imported {
            self.keys_imported.store(true, Ordering::Release);
        }
    }

    /// The `hi` of each of `tables` in the freshest map this server can read.
    async fn map_ranges(&self, tables: &[TableId]) -> BTreeMap<u64, u64> {
        if let Err(e) = self.refresh_map().await {
            tracing::debug!("map refresh before a load: {e}");
        }
        let cache = self.map.lock();
        tables
            .iter()
            .filter_map(|t| Some((t.0, cache.map.tables.get(t)?.hi)))
            .collect()
    }

    async fn control(&self, c: Control) -> Option<ControlReply> {
        // txn (issue 33) hook: another member's transaction message.
        if let ControlBody::Txn { from, msg } = &c.body {
            if let Some(t) = &self.txn {
                t.deliver(*from, msg);
            }
            return None;
        }
        if let ControlBody::Keys { version } = c.body {
            return self.keys_control(c.to, version).await;
        }
        let mut rx = self.control_replies.subscribe();
        let acts = self.p.lock().on_control(&c, self.now());
        let mut found = None;
        for a in &acts {
            if let Action::Reply(r) = a
                && answers(&c, r)
            {
                found = Some(r.clone());
            }
        }
        self.push(acts);
        if found.is_some() {
            return found;
        }
        if self.incarnation() != Some(c.to) {
            return None;
        }
        tokio::time::timeout(CONTROL_WAIT, async {
            loop {
                match rx.recv().await {
                    Ok(r) if answers(&c, &r) => return Some(r),
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
        .await
        .ok()
        .flatten()
    }

    /// The driver's `Keys` control: applies the coordinator's client keys (up to
    /// `version` at least) and answers once no connection of a revoked key is open here.
    /// No answer if that takes longer than [`CONTROL_WAIT`]: the driver asks again, and a
    /// server that stays behind is fenced (see `kochab_cluster::keys`).
    async fn keys_control(&self, to: Incarnation, version: u64) -> Option<ControlReply> {
        if self.incarnation() != Some(to) || !self.can_ack() {
            return None;
        }
        let deadline = Instant::now() + CONTROL_WAIT;
        if self.keys.version() < version {
            let read = tokio::time::timeout(CONTROL_WAIT, self.keys_client.read_state()).await;
            if let Ok(Ok((state, _))) = read {
                self.learn(&state);
            }
        }
        let held = self.keys.version();
        if held < version {
            return None;
        }
        // Their connections were told to close when the keys were applied.
        while self.keys.revoked_connections() > 0 {
            if Instant::now() >= deadline {
                tracing::warn!("connections of revoked keys are not closed yet");
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Some(ControlReply::KeysApplied {
            by: to,
            version: held,
        })
    }

    /// Answers a key administration request of the admin key (`kochab key`): proposed to
    /// the coordinator, answered once every live server applied it.
    pub async fn key_op(&self, op: Op) -> Reply {
        let result = match op {
            Op::KeyAdd { policy, note } => self
                .key_add(policy, note)
                .await
                .map(|(id, key)| Reply::KeyAdded { id, key }),
            Op::KeyList => self.key_list().await.map(Reply::Keys),
            Op::KeyRevoke { id } => self.key_revoke(id).await.map(|()| Reply::Empty),
            other => Err(fs_err!(EINVAL, "{} is no key operation", other.name())),
        };
        result.unwrap_or_else(Reply::Error)
    }

    async fn key_add(&self, policy: KeyPolicy, note: String) -> FsResult<(KeyId, ClusterKey)> {
        check_new_key(&policy, &note)?;
        let mut nonce = [0u8; kochab_proto::auth::SEAL_NONCE_BYTES];
        let mut secret = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| fs_err!(EIO, "no randomness: {e}"))?;
        getrandom::fill(&mut secret).map_err(|e| fs_err!(EIO, "no randomness: {e}"))?;
        let key = SealedKey {
            nonce,
            sealed: seal_client_key(&self.keys.admin().key, &nonce, &secret),
            policy,
            revoked: false,
            note,
        };
        let (id, version) = self.key_command(CoordCommand::KeyAdd { key }).await?;
        if let Err(why) = self.keys_settle(version).await {
            // The key exists for good; a server that has not applied it refuses it for a
            // moment more. Losing its secret would be worse.
            tracing::warn!("key {id} is made, but not every server took it yet: {why}");
        }
        Ok((id, secret))
    }

    async fn key_revoke(&self, id: KeyId) -> FsResult<()> {
        if id == ADMIN_KEY_ID {
            return Err(fs_err!(
                EINVAL,
                "the cluster key cannot be revoked (make a new cluster to replace it)"
            ));
        }
        let (_, version) = self.key_command(CoordCommand::KeyRevoke { id }).await?;
        self.keys_settle(version).await.map_err(|why| {
            let msg = format!(
                "key {id} is revoked for good, but not every server has confirmed it yet ({why})"
            );
            FsError::new(why.errno(), msg)
        })
    }

    async fn key_list(&self) -> FsResult<Vec<KeyInfo>> {
        let (state, _) = self
            .keys_client
            .read_state()
            .await
            .map_err(|e| fs_err!(ETIMEDOUT, "the coordinator did not answer: {e}"))?;
        self.learn(&state);
        Ok(state
            .keys
            .keys
            .iter()
            .map(|(id, k)| KeyInfo {
                id: *id,
                policy: k.policy,
                revoked: k.revoked,
                note: k.note.clone(),
            })
            .collect())
    }

    /// Proposes a key change: its key id and the version of the keys that holds it.
    async fn key_command(&self, cmd: CoordCommand) -> FsResult<(KeyId, u64)> {
        match self.keys_client.propose(cmd).await {
            Ok(CoordReply::Key { id, version }) => Ok((id, version)),
            Ok(CoordReply::KeyRefused(e)) => Err(e),
            Ok(other) => Err(fs_err!(EIO, "the coordinator answered {other:?}")),
            Err(e) => Err(fs_err!(
                ETIMEDOUT,
                "the coordinator did not take the key change (it may still apply it): {e}"
            )),
        }
    }

    /// Waits until key version `version` is settled (every live server applied it, and no
    /// fenced one can still serve), at most as long as that can take with a server that
    /// has to be fenced first. `Err`: what it still waited for.
    async fn keys_settle(&self, version: u64) -> Result<(), HostError> {
        let bound = kochab_cluster::keys::settle_bound_ms(self.lease_ms);
        let deadline = Instant::now() + Duration::from_millis(bound);
        loop {
            let why = match self.keys_client.read_state().await {
                Ok((state, _)) => {
                    self.learn(&state);
                    match state.keys_settled(version) {
                        Ok(()) => return Ok(()),
                        Err(why) => why,
                    }
                }
                Err(e) => format!("the coordinator did not answer: {e}"),
            };
            if Instant::now() >= deadline {
                return Err(HostError::Unsettled(why));
            }
            tokio::time::sleep(KEYS_SETTLE_POLL).await;
        }
    }

    /// Carries out one action of the participant.
    fn exec(self: &Arc<Self>, action: Action) {
        match action {
            Action::ToCoord { req_id, req } => {
                let host = self.clone();
                tokio::spawn(async move {
                    let cmd = CoordCommand::Request { req, now_ms: 0 };
                    match host.coord.propose(cmd).await {
                        Ok(reply) => {
                            let acts = host.p.lock().on_reply(req_id, &reply, host.now());
                            host.push(acts);
                        }
                        Err(e) => tracing::debug!("coordinator request {req_id:#x}: {e}"),
                    }
                });
            }
            Action::Reply(r) => {
                let _ = self.control_replies.send(r);
            }
            Action::Load { tables, epochs } => {
                let host = self.clone();
                tokio::spawn(async move {
                    let result = match host.shared.get().and_then(Weak::upgrade) {
                        Some(shared) => {
                            let me = host.journal_id();
                            let his = host.map_ranges(&tables).await;
                            let (t, e) = (tables.clone(), epochs.clone());
                            tokio::task::spawn_blocking(move || load(&shared, me, &t, &his, &e))
                                .await
                                .unwrap_or_else(|source| {
                                    Err(HostError::Task {
                                        what: "load",
                                        source,
                                    })
                                })
                        }
                        None => Err(HostError::Starting),
                    };
                    match &result {
                        Err(e) => tracing::warn!("cannot load tables {tables:x?}: {e}"),
                        Ok(splits) => host.cut(splits.iter().map(|(t, at)| (t.0, *at))),
                    }
                    let result = result.map_err(|e| e.to_string());
                    let acts = host.p.lock().loaded(&tables, result);
                    host.push(acts);
                });
            }
            Action::Split { table, at } => {
                let host = self.clone();
                tokio::spawn(async move {
                    let result = match host.shared.get().and_then(Weak::upgrade) {
                        Some(shared) => tokio::task::spawn_blocking(move || {
                            shared.split_table(table.0, at).map_err(HostError::Store)
                        })
                        .await
                        .unwrap_or_else(|source| {
                            Err(HostError::Task {
                                what: "split",
                                source,
                            })
                        }),
                        None => Err(HostError::Starting),
                    };
                    let outcome = match result {
                        Ok(Ok(at)) => {
                            host.cut([(table.0, at)]);
                            Ok(SplitOutcome::Done(at))
                        }
                        Ok(Err(why)) => {
                            tracing::info!("table {:016x} not split: {why}", table.0);
                            Ok(SplitOutcome::Refused(why.to_string()))
                        }
                        Err(e) => {
                            tracing::error!("split of table {:016x} failed: {e}", table.0);
                            Err(e.to_string())
                        }
                    };
                    let acts = host.p.lock().split_done(table, outcome);
                    host.push(acts);
                });
            }
            Action::Checkpoint { table } => {
                let host = self.clone();
                tokio::spawn(async move {
                    let result = match host.shared.get().and_then(Weak::upgrade) {
                        Some(shared) => tokio::task::spawn_blocking(move || {
                            shared.drop_table(table.0).map_err(HostError::Store)
                        })
                        .await
                        .unwrap_or_else(|source| {
                            Err(HostError::Task {
                                what: "drop",
                                source,
                            })
                        }),
                        None => Err(HostError::Starting),
                    };
                    if let Err(e) = &result {
                        tracing::error!("cannot release table {:016x}: {e}", table.0);
                    }
                    let result = result.map_err(|e| e.to_string());
                    let acts = host.p.lock().checkpointed(table, result);
                    host.push(acts);
                });
            }
            Action::RunBorrowed { id } => self.borrow_granted(id),
            Action::BorrowFailed { id } => {
                tracing::debug!("borrow {id:?} refused");
                for w in self.borrows.lock().failed(id) {
                    let _ = w.send(false);
                }
            }
            Action::Fence => {
                // (One lock at a time: `journal_id` may take the participant's lock too.)
                let server = self.p.lock().server().0;
                let journal = self.journal_id();
                let why = format!(
                    "server {server} ({journal}) is fenced: its lease ended or a newer \
                     incarnation registered; it serves and acknowledges nothing more"
                );
                tracing::error!("{why}");
                self.fenced.send_replace(Some(why));
            }
        }
    }
}

impl ClusterHost {
    /// Records splits `(table, at)`: ids from `at` on belong to the new table.
    fn cut(&self, splits: impl IntoIterator<Item = (u64, u64)>) {
        self.ranges.write().split(splits);
    }

    /// Tells the coordinator each held table's load: operations admitted since the last
    /// report and inodes (for `kochab status` and the balancer's load rule).
    fn report_load(self: &Arc<Self>) {
        let Some(shared) = self.shared.get().and_then(Weak::upgrade) else {
            return;
        };
        let mut ops = std::mem::take(&mut *self.admitted.lock());
        let held = self.tables();
        // `--multi-server auto`: what this server's multi-server operations needed of
        // other servers' tables (the balancer's affinity rule), every interval.
        if self.counts_remote_use() {
            let uses = ops.remote_report(&held);
            let acts = self.p.lock().report_remote_use(uses);
            for a in acts {
                self.exec(a);
            }
        }
        let loads = {
            let core = shared.core();
            let loaded = core.engine.tables().iter().map(|t| {
                let inodes = core
                    .engine
                    .table_index(t.lo)
                    .map_or(0, |i| core.engine.tables()[i].inode_count());
                (TableId(t.lo), inodes)
            });
            ops.report(loaded, &held)
        };
        if loads.is_empty() {
            return;
        }
        let acts = self.p.lock().report_load(loads);
        for a in acts {
            self.exec(a);
        }
    }

    /// Waits until every table of `tables` is here under a borrow: joins a borrow of this
    /// incarnation that covers them (while it is young), else asks for a new one. `Err`:
    /// the reply that tells the client to ask again.
    async fn borrow_tables(self: &Arc<Self>, tables: &[TableId]) -> Result<BorrowUse, Reply> {
        let now = self.now();
        let (tx, rx) = oneshot::channel();
        let (id, acts) = {
            let mut slots = self.borrows.lock();
            match slots.join(tables, now, tx) {
                Join::Run { id, .. } => {
                    return Ok(BorrowUse {
                        host: self.clone(),
                        id,
                    });
                }
                Join::Wait(id) => (id, Vec::new()),
                Join::Ask(tx) => {
                    let (id, acts) = self.p.lock().borrow(tables, now);
                    let Some(id) = id else {
                        drop(slots);
                        return Err(self.not_ready());
                    };
                    slots.asked(id, tables, tx);
                    (id, acts)
                }
            }
        };
        self.push(acts);
        // From here a failure leaves the borrow through the use's drop.
        let held = BorrowUse {
            host: self.clone(),
            id,
        };
        match tokio::time::timeout(BORROW_WAIT, rx).await {
            Ok(Ok(true)) => Ok(held),
            _ => Err(self.not_ready()),
        }
    }

    fn leave_borrow(&self, id: BorrowId) {
        let last = self.borrows.lock().leave(id);
        if last {
            let acts = self.p.lock().borrow_done(id, self.now());
            self.push(acts);
        }
    }

    /// The coordinator granted `id` (its tables are all here): wake its operations, or
    /// return it at once if none waits any more.
    fn borrow_granted(&self, id: BorrowId) {
        let now = self.now();
        let granted = self.borrows.lock().granted(id, now);
        match granted {
            Granted::Run(waiters) => {
                for w in waiters {
                    let _ = w.send(true);
                }
            }
            Granted::Return => {
                let acts = self.p.lock().borrow_done(id, now);
                self.push(acts);
            }
        }
    }
}

/// txn (issue 33) hook: what the transaction host reads of this member.
impl crate::txn_host::MemberMap for ClusterHost {
    fn owner_of(&self, id: kochab_proto::InodeId) -> Option<ServerId> {
        ClusterHost::owner_of(self, id)
    }

    fn server_addr(&self, server: ServerId) -> Option<String> {
        ClusterHost::server_addr(self, server)
    }

    fn not_ready(&self) -> Reply {
        ClusterHost::not_ready(self)
    }

    fn journal_id(&self) -> JournalId {
        ClusterHost::journal_id(self)
    }
}

/// Runs a request [`Shared::execute_batch`] parked, once what it waits for is there.
pub async fn parked_op(
    shared: Arc<Shared>,
    client: u64,
    rid: u64,
    req: Request,
    mut why: Parked,
) -> (Reply, u64) {
    let mut flushed = false;
    loop {
        let ids = match why {
            Parked::Borrow(tables) => {
                let host = shared.cluster_host();
                let txn = host.as_ref().and_then(|h| h.txn_host());
                // `auto`: counted for the affinity rule, however it runs.
                if let Some(h) = &host
                    && h.counts_remote_use()
                {
                    h.admitted.lock().needed_elsewhere(&tables);
                }
                // txn (issue 33) hook: a transaction instead, where one covers it.
                if let Some(t) = txn
                    && let Some(done) = t.run(&shared, client, &req).await
                {
                    return done;
                }
                return borrowed_op(shared, client, rid, req, tables, flushed).await;
            }
            Parked::Flush(ids) => ids,
        };
        shared.wait_answered(&ids).await;
        flushed = true;
        let mut replies = Vec::with_capacity(1);
        let parked = shared.execute_flushed(client, &(rid, req.clone()), &mut replies);
        if let Some(a) = replies.pop() {
            return (a.reply, a.lsn);
        }
        match parked.into_iter().next() {
            Some((_, p)) => why = p,
            None => return (Reply::Error(fs_err!(EIO, "a parked request vanished")), 0),
        }
    }
}

/// Runs an operation that needs tables other servers hold: borrows them all at once, runs
/// it as one local record, and lets the borrow go (its last user returns the tables, once
/// the drain of the RETURN has seen the record durable). If running it shows a table the
/// plan could not see (behind a directory that was not here), the borrow is let go first
/// and a bigger one taken: a server never waits for a borrow while holding one, so
/// borrows cannot deadlock.
async fn borrowed_op(
    shared: Arc<Shared>,
    client: u64,
    rid: u64,
    req: Request,
    mut tables: Vec<TableId>,
    mut flushed: bool,
) -> (Reply, u64) {
    let Some(host) = shared.cluster_host() else {
        return (
            Reply::Error(fs_err!(EIO, "a borrow on a server that is no member")),
            0,
        );
    };
    shared.metrics().borrowed_ops.inc();
    loop {
        if tables.len() > kochab_cluster::state::BORROW_TABLES_MAX {
            return (
                Reply::Error(fs_err!(
                    EXDEV,
                    "{} needs more than {} tables at once",
                    req.op.name(),
                    kochab_cluster::state::BORROW_TABLES_MAX
                )),
                0,
            );
        }
        let asked = Instant::now();
        let held = host.borrow_tables(&tables).await;
        shared
            .metrics()
            .borrow_wait_seconds
            .observe(asked.elapsed().as_secs_f64());
        let held = match held {
            Ok(held) => held,
            Err(reply) => return (reply, 0),
        };
        let mut replies = Vec::with_capacity(1);
        let parked = if flushed {
            shared.execute_flushed(client, &(rid, req.clone()), &mut replies)
        } else {
            shared.execute_batch(client, &[(rid, req.clone())], &mut replies)
        };
        drop(held);
        if let Some(a) = replies.pop() {
            return (a.reply, a.lsn);
        }
        let before = tables.len();
        let mut waited = false;
        for (_, why) in parked {
            match why {
                Parked::Borrow(more) => {
                    for t in more {
                        if !tables.contains(&t) {
                            tables.push(t);
                        }
                    }
                }
                Parked::Flush(ids) => {
                    shared.wait_answered(&ids).await;
                    (flushed, waited) = (true, true);
                }
            }
        }
        if tables.len() == before && !waited {
            // Granted, yet not all here (moved again since): let the client ask again.
            return (host.not_ready(), 0);
        }
    }
}

/// Ticks the participant and carries out every action, until the host is dropped.
async fn run(host: Arc<ClusterHost>, mut rx: mpsc::UnboundedReceiver<Action>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_map = Instant::now();
    let mut last_load = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let acts = host.p.lock().tick(host.now());
                for a in acts {
                    host.exec(a);
                }
                if last_load.elapsed() >= LOAD_REPORT_EVERY {
                    last_load = Instant::now();
                    host.report_load();
                }
                if last_map.elapsed() >= MAP_REFRESH_EVERY {
                    last_map = Instant::now();
                    let h = host.clone();
                    tokio::spawn(async move {
                        if let Err(e) = h.refresh_map().await {
                            tracing::debug!("map refresh: {e}");
                        }
                    });
                }
            }
            a = rx.recv() => match a {
                Some(a) => host.exec(a),
                None => return,
            },
        }
    }
}

/// Loads `tables` for incarnation `me`: every manifest is checked before any is written (a
/// released table is added; a fenced incarnation's, whose epoch is below the one `epochs`
/// lists, is recovered from its journal; one already naming `me` and loaded is an earlier
/// try of this load).
fn load(
    shared: &Shared,
    me: JournalId,
    tables: &[TableId],
    his: &BTreeMap<u64, u64>,
    epochs: &[Incarnation],
) -> Result<Vec<(TableId, u64)>, HostError> {
    let owner = |server, epoch| load::Owner { server, epoch };
    let mut plan = LoadPlan::new(owner(me.server, me.epoch), epochs);
    for t in tables {
        let lo = t.0;
        let m = read_manifest_by_id(shared.store().as_ref(), lo)
            .map_err(|source| HostError::Manifest { table: lo, source })?
            .ok_or(HostError::NoManifest(lo))?;
        let hosted = || shared.hosted_tables().iter().any(|&(x, _)| x == lo);
        plan.claim(*t, m.owner.map(|o| owner(o.server, o.epoch)), hosted)?;
    }
    let mut splits = Vec::new();
    for t in plan.fresh() {
        splits.extend(shared.add_table_to(t.0, his.get(&t.0).copied())?);
    }
    for (o, tables) in plan.recover() {
        let journal = JournalId {
            server: o.server,
            epoch: o.epoch,
        };
        let tables: Vec<(u64, Option<u64>)> = tables
            .iter()
            .map(|t| (t.0, his.get(&t.0).copied()))
            .collect();
        splits.extend(shared.recover_tables_to(&tables, journal)?);
    }
    if !plan.recover().is_empty() {
        // The crashed server's clients replay what it acknowledged early and lost.
        shared.replay_window().open();
    }
    Ok(splits
        .into_iter()
        .map(|(lower, upper)| (TableId(lower), upper))
        .collect())
}

/// The import of data directory `dir`'s key file (none: no keys), each secret sealed
/// under `cluster_key` with a nonce of its own.
fn import_command(cluster_key: &ClusterKey, dir: Option<&Path>) -> Result<CoordCommand, HostError> {
    let (next_id, file) = match dir {
        Some(d) => crate::keys::read_keys_file(d).map_err(HostError::KeysFile)?,
        None => (1, Vec::new()),
    };
    let mut keys = Vec::with_capacity(file.len());
    for k in file {
        let mut nonce = [0u8; kochab_proto::auth::SEAL_NONCE_BYTES];
        getrandom::fill(&mut nonce).map_err(HostError::NoRandomness)?;
        let sealed = SealedKey {
            nonce,
            sealed: seal_client_key(cluster_key, &nonce, &k.key),
            policy: k.policy,
            revoked: k.revoked,
            note: k.note,
        };
        keys.push((k.id, sealed));
    }
    Ok(CoordCommand::KeysImport { next_id, keys })
}

/// A request a connection task runs outside the batch: cluster operations of a member,
/// and data operations (admitted first in a member).
pub async fn task_op(shared: Arc<Shared>, client: u64, key_id: u32, req: Request) -> (Reply, u64) {
    let Some(host) = shared.cluster_host() else {
        return crate::filesvc::data_op(shared, client, key_id, req).await;
    };
    if req.op.is_cluster() {
        return (host.cluster_op(req.op).await, 0);
    }
    if req.op.is_key_admin() {
        return (host.key_op(req.op).await, 0);
    }
    let tables = {
        let core = shared.core();
        match host.admit_op(&core, client, &req.op) {
            Ok(t) => t,
            Err(Refusal::Reply(reply)) => return (*reply, 0),
            // Data operations name one inode.
            Err(Refusal::Borrow(_)) => return (host.not_ready(), 0),
        }
    };
    let (reply, lsn) = crate::filesvc::data_op(shared.clone(), client, key_id, req).await;
    host.op_done(tables, lsn, shared.journal().durable_lsn());
    (reply, lsn)
}

impl Shared {
    /// True unless this is a member whose lease is over: checked right before replies
    /// leave (a paused server that resumes late acknowledges nothing).
    pub fn may_ack(&self) -> bool {
        self.cluster().is_none_or(|h| h.can_ack())
    }

    /// txn (issue 33) hook: the member's transaction host (a served member's, or a
    /// simulated one's).
    pub fn txn_host(&self) -> Option<Arc<crate::txn_host::TxnHost>> {
        self.cluster()?.txn_host()?.downcast().ok()
    }

    /// Calls `f` on `target` with the journal's durable LSN now and at every change, in a
    /// task that ends when `target` or the journal goes.
    pub fn on_each_durable<T: Send + Sync + 'static>(
        &self,
        target: std::sync::Weak<T>,
        f: fn(&T, u64),
    ) {
        let mut durable = self.journal().subscribe();
        tokio::spawn(async move {
            loop {
                let lsn = *durable.borrow_and_update();
                match target.upgrade() {
                    Some(t) => f(&t, lsn),
                    None => return,
                }
                if durable.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    /// The cluster host of a member (the one [`Member`] there is).
    pub fn cluster_host(&self) -> Option<Arc<ClusterHost>> {
        let member: Arc<dyn std::any::Any + Send + Sync> = self.cluster()?.clone();
        member.downcast().ok()
    }
}

impl Member for ClusterHost {
    fn admit_op(&self, core: &Core, client: u64, op: &Op) -> Result<Vec<TableId>, Refusal> {
        ClusterHost::admit_op(self, core, client, op)
    }

    fn fix_reply(
        &self,
        engine: &mut kochab_meta::Engine,
        admitted: &[TableId],
        reply: Reply,
    ) -> Result<Reply, Refusal> {
        ClusterHost::fix_reply(self, engine, admitted, reply)
    }

    fn op_done(&self, tables: Vec<TableId>, lsn: u64, durable: u64) {
        ClusterHost::op_done(self, tables, lsn, durable)
    }

    fn can_ack(&self) -> bool {
        ClusterHost::can_ack(self)
    }

    fn txn_host(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        let host: Arc<dyn std::any::Any + Send + Sync> = ClusterHost::txn_host(self)?;
        Some(host)
    }

    fn coord_addrs(&self) -> Vec<String> {
        self.coord_addrs.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::{BorrowId, Epoch};

    #[test]
    fn a_control_is_answered_only_by_its_own_reply() {
        let by = Incarnation {
            server: ServerId(2),
            epoch: Epoch(3),
        };
        let drop = Control {
            to: by,
            body: ControlBody::Drop {
                table: TableId(5),
                map_version: MapVersion(4),
                to: ServerId(3),
            },
        };
        let dropped = |t| ControlReply::Dropped {
            table: TableId(t),
            by,
            map_version: MapVersion(4),
        };
        assert!(answers(&drop, &dropped(5)));
        assert!(!answers(&drop, &dropped(6)));
        let add = Control {
            to: by,
            body: ControlBody::Add {
                tables: vec![TableId(1), TableId(2)],
                map_version: MapVersion(4),
                epochs: vec![],
            },
        };
        let added = |ts: Vec<u64>| ControlReply::Added {
            tables: ts.into_iter().map(TableId).collect(),
            by,
            map_version: MapVersion(4),
            splits: vec![],
        };
        assert!(answers(&add, &added(vec![2])));
        assert!(!answers(&add, &added(vec![3])));
        assert!(!answers(&add, &dropped(1)));
        let id = BorrowId {
            server: ServerId(2),
            epoch: Epoch(3),
            seq: 7,
        };
        let grant = Control {
            to: by,
            body: ControlBody::Grant { id },
        };
        assert!(answers(&grant, &ControlReply::GrantAck { id }));
        assert!(!answers(
            &grant,
            &ControlReply::GrantAck {
                id: BorrowId { seq: 8, ..id }
            }
        ));
    }
}
