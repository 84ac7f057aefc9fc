//! Several real server cores over one in-memory store, with tables moving between them:
//! migrations, borrows and their returns, splits, and kill -9 of a server whose tables
//! another server (or the next incarnation) recovers while the clients replay what it
//! answered early.
//!
//! Each server is the core `kochab-server` assembles for a member (engine, reply cache,
//! journal, checkpoints; its engine answers WRONG_SERVER for what it does not host), and
//! every move runs the real code of a migration: [`Shared::drop_table`] (drain, durable,
//! release with the open handles, locks and reply-cache entries handed over),
//! [`Shared::add_table_to`], [`Shared::recover_tables_to`] (which seals the dead
//! incarnation's journal first) and [`Shared::split_table`]. The world itself plays the
//! coordinator: it keeps the map (which server holds each table) and decides the moves;
//! [`SimMember`] admits each operation as a member's host does, by the tables its ids
//! fall in ([`Ranges`], the host's own code), and asks for a borrow when the first
//! table is here and others are not. The coordinator's and the participant's state
//! machines are simulated apart, over model servers (`kochab_cluster::sim`).
//!
//! After every step: each table is held by exactly one server, the one the map names (at
//! most one writer); each engine's own invariants; the links between servers' tables
//! ([`kochab_meta::links::check_cluster`], as `kochab fsck` checks a running cluster);
//! and every client's names read as its accepted replies say, at whichever server holds
//! the directory now; every data client's files ([`data`]) read as its acknowledged writes
//! say, at whichever server holds the file now; and a lease holder caches nothing any
//! server changed unless called back or its lease ran out (`cluster_lease`).

mod data;
mod txn;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock};

use kochab_breaks::Breaks;
use kochab_cluster::host::ranges::Ranges;
use kochab_cluster::sim::Rng;
use kochab_journal::JournalId;
use kochab_meta::{Engine, EngineConfig};
use kochab_proto::cluster::{ServerId, TableId};
use kochab_proto::{Credentials, InodeId, Op, Reply, ReplyMode, Request};
use kochab_server::core::{Core, Member, Parked, Refusal};
use kochab_server::replaytags::SessionTags;
use kochab_server::server::{SimulatedServer, core_for_simulation};
use kochab_server::shared::Shared;
use kochab_server::txn_host::{MultiServer, TxnHost};
use kochab_store::{MemStore, ObjectStore};

use crate::cluster_lease::{ClusterLeases, LeaseCounts};
use crate::data::{DataClients, dir_name};
use crate::model::{DIRS, Model, NAMES, Planned, SHARED};
use crate::names::{Client, Kept};
use crate::step::SimStats;
use crate::world::{STEP_MS_MAX, Seeded, WALL_START_NS, check_shared, journal_options, shared_op};
use kochab_server::clock::SimulatedClock;
use kochab_server::conn::waits_for_replays;
use kochab_server::leases::LEASE;
use std::time::Duration;

/// A pause of everything (a stopped VM, a stalled machine): up to past a lease and a
/// callback deadline, from less than `CALLBACK_SLOW` (as in the single-server world).
const PAUSE_MS: (u64, u64) = (200, 8000);
/// Time a drop waits between two looks at its revocations (a stalled holder's).
const REVOKE_WAIT_MS: (u64, u64) = (50, 800);
/// Session of the set-up requests.
const SETUP_SESSION: u64 = 1;
/// How many times one request follows borrows before the run counts it as stuck (each
/// borrow brings every table it named; one more can only come from an id its plan
/// missed).
const ROUTE_TRIES: usize = 6;

/// What to run.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub seed: u64,
    pub steps: u64,
    pub servers: usize,
    pub clients: usize,
    /// Clients of file data (see [`data`]).
    pub data_clients: usize,
    pub breaks: Breaks,
    pub trace: bool,
    /// How an operation that needs tables of several servers runs: borrowed there, or
    /// as a transaction between them (`txn`; `auto` runs as `txn` here: the world, not a
    /// coordinator, moves tables).
    pub multi_server: MultiServer,
}

impl ClusterConfig {
    /// The default run of `seed`: three servers, three clients, two data clients.
    pub fn new(seed: u64) -> ClusterConfig {
        ClusterConfig {
            seed,
            steps: 200,
            servers: 3,
            clients: 3,
            data_clients: 2,
            breaks: Breaks::NONE,
            trace: false,
            multi_server: MultiServer::Borrow,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct ClusterStats {
    pub ops: u64,
    /// Operations that needed a table of another server (each borrowed it here).
    pub borrows: u64,
    /// Borrowed tables given back to their lender.
    pub returns: u64,
    /// Tables moved for good.
    pub migrations: u64,
    pub splits: u64,
    /// Splits the engine refused (a table too small, or one directory).
    pub splits_refused: u64,
    pub kills: u64,
    /// Pauses after which another incarnation took the server's tables while it still
    /// ran (and served one more change).
    pub pauses: u64,
    /// Kills and pauses whose tables another live server recovered (else the next incarnation did).
    pub failovers: u64,
    pub replays: u64,
    pub flushes: u64,
    pub checkpoints: u64,
    pub dropped_replies: u64,
    /// Creates, writes, reads and fsyncs of file data.
    pub data_ops: u64,
    /// Writes answered early replayed after their server went.
    pub data_replays: u64,
    /// Handles reopened (a reclaim) where their file's table went after a kill or pause.
    pub reopens: u64,
    /// Writes a paused old process answered (early) after its tables were taken over.
    pub writes_at_old: u64,
    /// Table moves (migrations, borrows, returns) that carried an open handle of a data
    /// client's file.
    pub open_moves: u64,
    /// Pauses of everything (the clock jumped, up to past a lease).
    pub time_jumps: u64,
    /// Tries of a change that found its server in a replay window (it waits: sent again
    /// at a later step).
    pub window_waits: u64,
    /// What the lease holder and its writer did.
    pub leases: LeaseCounts,
    /// Multi-server operations run as transactions, and those that committed.
    pub txns: u64,
    pub txn_commits: u64,
    /// Servers killed while a transaction was in flight.
    pub txn_kills: u64,
    /// Transaction messages delivered, lost, and delivered twice.
    pub txn_msgs: u64,
    pub txn_msgs_lost: u64,
    pub txn_msgs_repeated: u64,
}

/// A member's admission in the simulation: by the tables the operation's ids fall in, as
/// `cluster_host::ClusterHost::admit_op` does without the participant's lease (the world
/// keeps every server's lease).
struct SimMember {
    ranges: Arc<RwLock<Ranges>>,
    /// The member's transaction host (`txn`), and the map it reads (held here: the host
    /// holds it weakly, as a served host holds its member).
    txn: Option<Arc<TxnHost>>,
    _map: Option<Arc<txn::SimMap>>,
}

fn wrong_server() -> Reply {
    Reply::WrongServer {
        map_version: 0,
        owner: None,
        addr: None,
    }
}

impl Member for SimMember {
    fn admit_op(&self, core: &Core, client: u64, op: &Op) -> Result<Vec<TableId>, Refusal> {
        let ranges = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        let tables = ranges.tables_of(core.op_ids(client, op)).map_err(|id| {
            Refusal::Reply(Box::new(Reply::Error(kochab_meta::not_in_any_table(id))))
        })?;
        let here = |t: &TableId| core.engine.table_index(t.0).is_some();
        // A key a transaction holds here: ask again (as the host does).
        if !tables.is_empty()
            && self
                .txn
                .as_ref()
                .is_some_and(|t| t.blocks(&core.engine, op))
        {
            return Err(Refusal::Reply(Box::new(wrong_server())));
        }
        match tables.first() {
            None => Ok(tables),
            Some(first) if !here(first) => Err(Refusal::Reply(Box::new(wrong_server()))),
            Some(_) if tables.iter().all(here) => Ok(tables),
            Some(_) => Err(Refusal::Borrow(tables)),
        }
    }

    fn fix_reply(
        &self,
        engine: &mut Engine,
        admitted: &[TableId],
        reply: Reply,
    ) -> Result<Reply, Refusal> {
        let Reply::WrongServer { owner: None, .. } = reply else {
            return Ok(reply);
        };
        let ranges = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        match engine
            .last_not_hosted
            .take()
            .and_then(|id| ranges.table_of(id))
        {
            Some(t) if !admitted.is_empty() && !admitted.contains(&t) => {
                let mut tables = admitted.to_vec();
                tables.push(t);
                Err(Refusal::Borrow(tables))
            }
            _ => Ok(reply),
        }
    }

    fn op_done(&self, _tables: Vec<TableId>, _lsn: u64, _durable: u64) {}

    fn can_ack(&self) -> bool {
        true
    }

    fn coord_addrs(&self) -> Vec<String> {
        Vec::new()
    }

    fn txn_host(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        let host: Arc<dyn std::any::Any + Send + Sync> = self.txn.clone()?;
        Some(host)
    }
}

/// One server id: its live incarnation.
struct Server {
    id: u64,
    epoch: u64,
    live: Arc<Shared>,
}

/// What a routed request got: the reply, its LSN, whether it left early, and where.
struct Routed {
    reply: Reply,
    lsn: u64,
    early: bool,
    at: usize,
}

struct World {
    cfg: ClusterConfig,
    rng: Rng,
    store: MemStore,
    engine: EngineConfig,
    key: kochab_proto::auth::ClusterKey,
    ranges: Arc<RwLock<Ranges>>,
    servers: Vec<Server>,
    /// The map: which server holds each table (by its first id).
    owner: BTreeMap<u64, usize>,
    /// The same by server id, as the members' transaction hosts read it.
    owner_ids: Arc<RwLock<BTreeMap<u64, u64>>>,
    multi_server: MultiServer,
    /// The network between the members' transaction hosts.
    net: Arc<txn::Net>,
    /// Borrowed tables and the server each is to go back to.
    lent: BTreeMap<u64, usize>,
    clients: Vec<Client>,
    shared_dir: InodeId,
    data: DataClients,
    stats: ClusterStats,
    /// What the data clients count.
    data_stats: SimStats,
    /// A data client's request that waits out a replay window (sent at a later step).
    data_waiting: Option<crate::data::Next>,
    /// A lease holder and a writer of one file.
    leases: Option<ClusterLeases>,
    /// Every server's clock and the holder's: it moves between steps, in pauses of
    /// everything, and while a change or a drop waits.
    clock: SimulatedClock,
    _rt: tokio::runtime::Runtime,
}

/// Runs one seed of the cluster simulation; `Err` says which invariant broke, at which step.
pub fn run_cluster(cfg: ClusterConfig) -> Result<ClusterStats, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| format!("no runtime: {e}"))?;
    let _enter = rt.enter();
    let seed = cfg.seed;
    let mut w = World::new(cfg, rt)?;
    w.setup().map_err(|e| format!("seed {seed} set-up: {e}"))?;
    for step in 0..w.cfg.steps {
        w.step()
            .and_then(|()| w.settle_txns_or_kill(true))
            .and_then(|()| w.settle())
            .and_then(|()| w.check())
            .map_err(|e| format!("seed {seed} step {step}: {e}"))?;
    }
    for i in 0..w.servers.len() {
        w.flush(i)?;
    }
    w.after_flush();
    w.check()
        .map_err(|e| format!("seed {seed} at the end: {e}"))?;
    w.data_totals();
    Ok(w.stats)
}

/// Runs seeds `first..first + n` of the cluster simulation over the machine's cores; on
/// failure, the error of the lowest failing seed.
pub fn run_cluster_seeds(
    first: u64,
    n: u64,
    adjust: impl Fn(&mut ClusterConfig) + Sync,
) -> Result<Vec<ClusterStats>, String> {
    crate::spread(first, n, |seed| {
        let mut cfg = ClusterConfig::new(seed);
        adjust(&mut cfg);
        run_cluster(cfg)
    })
}

impl World {
    fn new(cfg: ClusterConfig, rt: tokio::runtime::Runtime) -> Result<World, String> {
        let mut rng = Rng::new(cfg.seed);
        let Seeded {
            engine,
            ranges,
            key,
        } = Seeded::draw(&mut rng)?;
        let multi_server = cfg.multi_server;
        Ok(World {
            cfg,
            rng,
            store: MemStore::new(),
            engine,
            key,
            ranges: Arc::new(RwLock::new(Ranges::new(ranges))),
            servers: Vec::new(),
            owner: BTreeMap::new(),
            owner_ids: Arc::default(),
            multi_server,
            net: Arc::default(),
            lent: BTreeMap::new(),
            clients: Vec::new(),
            shared_dir: 0,
            data: DataClients::default(),
            stats: ClusterStats::default(),
            data_stats: SimStats::default(),
            data_waiting: None,
            leases: None,
            clock: SimulatedClock::new(WALL_START_NS),
            _rt: rt,
        })
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.cfg.trace {
            eprintln!("[{}] {}", self.cfg.seed, what());
        }
    }

    fn ranges(&self) -> Ranges {
        self.ranges
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A new incarnation of server `id` at `epoch`, starting with the tables `ranges`
    /// (a new cluster's root is made by whoever starts with its table).
    fn start(&self, id: u64, epoch: u64, ranges: &[(u64, u64)]) -> Result<Arc<Shared>, String> {
        let me = JournalId { server: id, epoch };
        let store: Arc<dyn ObjectStore> = Arc::new(self.store.clone());
        let recovered = kochab_server::recovery::recover_tables(
            store.as_ref(),
            self.engine.clone(),
            ranges,
            me,
            None,
            None,
            Vec::new(),
        )
        .map_err(|e| format!("start of {me}: {e}"))?;
        let txn = TxnHost::for_mode(self.multi_server, ServerId(id as u32), None);
        let map = txn.as_ref().map(|_| self.txn_map(me));
        let sim = SimulatedServer {
            store,
            key: self.key,
            me,
            journal: journal_options(self.cfg.breaks),
            crashed: false,
            breaks: self.cfg.breaks,
            member: Some(Arc::new(SimMember {
                ranges: self.ranges.clone(),
                txn: txn.clone(),
                _map: map.clone(),
            })),
            clock: self.clock.clock(),
        };
        let live =
            core_for_simulation(sim, recovered).map_err(|e| format!("start of {me}: {e}"))?;
        if let (Some(t), Some(map)) = (&txn, map) {
            self.attach_txn(t, &live, map);
            // What it journaled again (commits still to tell) is written before it goes on.
            live.journal().wait_asked();
        }
        Ok(live)
    }

    /// The map gives table `lo` to server `at`.
    fn set_owner(&mut self, lo: u64, at: usize) {
        self.owner.insert(lo, at);
        let id = self.servers[at].id;
        self.owner_ids
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lo, id);
    }

    /// Server 0 makes the cluster with every table, the clients' directories, then the
    /// tables spread over the servers at random.
    fn setup(&mut self) -> Result<(), String> {
        let all = self.ranges().as_slice().to_vec();
        for i in 0..self.cfg.servers {
            let mine = if i == 0 { all.clone() } else { Vec::new() };
            let live = self.start(i as u64 + 1, 1, &mine)?;
            self.servers.push(Server {
                id: i as u64 + 1,
                epoch: 1,
                live,
            });
        }
        for &(lo, _) in &all {
            self.set_owner(lo, 0);
        }
        let root = self.servers[0].live.root();
        let mkdir = |w: &mut World, name: String| -> Result<InodeId, String> {
            let op = Op::Mkdir {
                parent: root,
                name: name.into_bytes(),
                mode: 0o777,
            };
            let r = w.route(SETUP_SESSION, Request::plain(&Credentials::root(), op))?;
            r.reply
                .entry()
                .map(|a| a.id)
                .ok_or_else(|| format!("set-up mkdir answered {:?}", r.reply))
        };
        self.shared_dir = mkdir(self, "shared".into())?;
        for c in 0..self.cfg.clients {
            let mut dirs = [self.shared_dir; DIRS];
            for (d, slot) in dirs.iter_mut().enumerate().filter(|(d, _)| *d != SHARED) {
                *slot = mkdir(self, format!("c{c}-{d}"))?;
            }
            self.clients.push(Client::new(c, dirs));
        }
        let mut data_dirs = Vec::with_capacity(self.cfg.data_clients);
        for c in 0..self.cfg.data_clients {
            let name = String::from_utf8_lossy(&dir_name(c)).into_owned();
            data_dirs.push(mkdir(self, name)?);
        }
        self.data = DataClients::in_dirs(&data_dirs);
        let trace = self.cfg.trace.then_some(self.cfg.seed);
        self.leases = Some(ClusterLeases::setup(&self.servers[0].live, root, trace)?);
        for &(lo, _) in &all {
            let to = self.rng.range(0, self.cfg.servers as u64 - 1) as usize;
            if to != 0 {
                self.migrate(lo, to)?;
            }
        }
        for i in 0..self.servers.len() {
            self.flush(i)?;
        }
        self.after_flush();
        self.check()
    }

    /// The server the map names for the table of `id`.
    fn owner_of(&self, id: InodeId) -> Result<(u64, usize), String> {
        let t = self
            .ranges()
            .table_of(id)
            .ok_or_else(|| format!("{id:#x} is in no table"))?;
        let at = self
            .owner
            .get(&t.0)
            .copied()
            .ok_or_else(|| format!("table {:016x} has no owner in the map", t.0))?;
        Ok((t.0, at))
    }

    /// Runs `req` of `session` where the map says its first id's table is, borrowing the
    /// tables it needs from other servers there first (as a member's host does); a reply
    /// that is not early waits for its record.
    fn route(&mut self, session: u64, req: Request) -> Result<Routed, String> {
        self.route_or_lost(session, req, false)?
            .ok_or_else(|| "a request's answer was lost with no kill".to_string())
    }

    /// [`World::route`]; under `txn`, an operation that needs another server's table runs
    /// as a transaction where it could, and `may_kill` lets a server be killed while it
    /// runs (`None`: its initiator went before it answered).
    fn route_or_lost(
        &mut self,
        session: u64,
        req: Request,
        may_kill: bool,
    ) -> Result<Option<Routed>, String> {
        let first = req
            .op
            .inode_ids()
            .into_iter()
            .flatten()
            .next()
            .ok_or_else(|| format!("{} names no inode", req.op.name()))?;
        for _ in 0..ROUTE_TRIES {
            let (_, at) = self.owner_of(first)?;
            let s = self.servers[at].live.clone();
            let mut replies = Vec::with_capacity(1);
            let parked = s.execute_batch(session, &[(1, req.clone())], &mut replies);
            match parked.into_iter().next() {
                Some((_, Parked::Borrow(tables))) => {
                    match self.run_txn(at, session, &req, may_kill)? {
                        txn::Ran::Lost => return Ok(None),
                        txn::Ran::Answered(answer) => {
                            let (reply, lsn) = *answer;
                            if let Reply::WrongServer { .. } = reply {
                                // Told to ask again (its keys were held): it does.
                                continue;
                            }
                            return Ok(Some(Routed {
                                reply,
                                lsn,
                                early: false,
                                at,
                            }));
                        }
                        txn::Ran::NotCovered => {}
                    }
                    self.borrow(at, &tables)?;
                    continue;
                }
                Some((_, Parked::Flush(ids))) => {
                    return Err(format!("a request waited for flush callbacks {ids:?}"));
                }
                None => {}
            }
            let a = replies
                .pop()
                .ok_or_else(|| "a request got no reply".to_string())?;
            if let Reply::WrongServer { .. } = a.reply
                && self.multi_server != MultiServer::Borrow
                && s.txn_host().is_some_and(|t| t.busy().is_some())
            {
                // A transaction holds its keys: it asks again once that is over.
                self.settle_txns()?;
                continue;
            }
            if let Reply::WrongServer { .. } = a.reply {
                return Err(format!(
                    "server {} answered WRONG_SERVER to {:?}, whose first table the map gives it",
                    self.servers[at].id, req.op
                ));
            }
            let early = req.mode == ReplyMode::Early && a.early_by(s.journal().durable_lsn());
            if !early && !s.journal().wait_durable(s.journal().last_lsn()) {
                return Err(format!(
                    "the journal of server {} failed",
                    self.servers[at].id
                ));
            }
            return Ok(Some(Routed {
                reply: a.reply,
                lsn: a.lsn,
                early,
                at,
            }));
        }
        Err(format!(
            "{:?} still needed other tables after {ROUTE_TRIES} borrows",
            req.op
        ))
    }

    /// Brings `tables` to server `to` for an operation there: each is lent by its holder
    /// (and goes back to whoever first lent it, see [`World::give_back`]).
    fn borrow(&mut self, to: usize, tables: &[TableId]) -> Result<(), String> {
        for t in tables {
            let from = self
                .owner
                .get(&t.0)
                .copied()
                .ok_or_else(|| format!("a borrow names table {:016x}, not in the map", t.0))?;
            if from == to {
                continue;
            }
            self.trace(|| format!("borrow {:016x}: {} -> {}", t.0, from, to));
            self.move_table(t.0, from, to)?;
            self.lent.entry(t.0).or_insert(from);
            self.stats.borrows += 1;
        }
        Ok(())
    }

    /// Moves table `lo` to server `to` for good.
    fn migrate(&mut self, lo: u64, to: usize) -> Result<(), String> {
        let from = self.owner[&lo];
        if from == to {
            return Ok(());
        }
        self.trace(|| format!("migrate {lo:016x}: {from} -> {to}"));
        self.move_table(lo, from, to)?;
        self.lent.remove(&lo);
        self.stats.migrations += 1;
        Ok(())
    }

    /// The real DROP at `from` and ADD at `to`.
    fn move_table(&mut self, lo: u64, from: usize, to: usize) -> Result<(), String> {
        // A table moves once the parts its transactions hold there are over.
        self.settle_txns()?;
        let hi = self
            .ranges()
            .as_slice()
            .iter()
            .find(|r| r.0 == lo)
            .map(|r| r.1)
            .ok_or_else(|| format!("table {lo:016x} is not in the ranges"))?;
        self.data_table_moves(lo, hi);
        let s = self.servers[from].live.clone();
        let mut revoked = Ok(());
        s.drop_table_waiting(lo, |ready| revoked = self.wait_revoked(ready))
            .map_err(|e| format!("drop of {lo:016x} at server {}: {e}", self.servers[from].id))?;
        revoked?;
        self.servers[to]
            .live
            .add_table_to(lo, Some(hi))
            .map_err(|e| format!("add of {lo:016x} at server {}: {e}", self.servers[to].id))?;
        self.set_owner(lo, to);
        Ok(())
    }

    fn step(&mut self) -> Result<(), String> {
        let ms = self.rng.range(1, STEP_MS_MAX);
        self.advance(Duration::from_millis(ms))?;
        match self.rng.range(0, 111) {
            100..=109 => self.lease_op(),
            110..=111 => self.time_jump(),
            50..=64 if !self.data.is_empty() => self.data_op(),
            0..=64 => {
                let c = self.rng.range(0, self.cfg.clients as u64 - 1) as usize;
                self.client_op(c)
            }
            65..=76 => {
                let i = self.rng.range(0, self.servers.len() as u64 - 1) as usize;
                self.flush(i)?;
                if self.rng.chance(800) {
                    self.after_flush();
                }
                Ok(())
            }
            77..=79 => self.checkpoint(),
            80..=85 => self.give_back(),
            86..=89 => self.random_migration(),
            90..=92 => self.split(),
            93..=96 => self.kill(false),
            _ => self.kill(true),
        }
    }

    fn next_request(&mut self, c: usize) -> Result<(Request, Option<Planned>), String> {
        if let Some(again) = self.clients[c].lost.take() {
            return Ok(again);
        }
        let floor = self.clients[c].seq_floor();
        let (op, planned) = if self.rng.chance(700) {
            let cl = &self.clients[c];
            let p = cl.model.plan(&mut self.rng, &cl.dirs);
            (p.op.clone(), Some(p))
        } else {
            // A lookup first, as a client's would, wherever the directory is now.
            let dir = self.shared_dir;
            let (_, at) = self.owner_of(dir)?;
            let s = self.servers[at].live.clone();
            (
                shared_op(&mut self.rng, dir, |name| s.lookup(dir, name)),
                None,
            )
        };
        let cl = &mut self.clients[c];
        let seq = cl.next_seq;
        cl.next_seq += 1;
        let mode = if self.rng.chance(900) {
            ReplyMode::Early
        } else {
            ReplyMode::Durable
        };
        let req = Request {
            cred: Credentials::root(),
            seq,
            seq_floor: floor,
            map_version: 0,
            mode,
            op,
        };
        Ok((req, planned))
    }

    fn client_op(&mut self, c: usize) -> Result<(), String> {
        let (req, planned) = self.next_request(c)?;
        if self.waits_window(&req)? {
            // It waits at the server, the client with it: sent again at a later step.
            self.clients[c].lost = Some((req, planned));
            return Ok(());
        }
        let session = self.clients[c].session;
        let Some(r) = self.route_or_lost(session, req.clone(), true)? else {
            self.clients[c].lost = Some((req, planned));
            return Ok(());
        };
        self.stats.ops += 1;
        if self.rng.chance(40) {
            self.stats.dropped_replies += 1;
            self.trace(|| format!("client {c}: reply to seq {} lost", req.seq));
            self.clients[c].lost = Some((req, planned));
            return Ok(());
        }
        self.accept(c, req, planned, r)
    }

    /// Client `c` takes in a reply: checked against its model, and kept for replay while
    /// its record may not be durable.
    fn accept(
        &mut self,
        c: usize,
        req: Request,
        planned: Option<Planned>,
        r: Routed,
    ) -> Result<(), String> {
        let s = self.servers[r.at].live.clone();
        self.accept_from(c, &s, req, planned, r)
    }

    /// [`World::accept`] of a reply from server `s` (which may no longer be in the map).
    fn accept_from(
        &mut self,
        c: usize,
        s: &Arc<Shared>,
        req: Request,
        planned: Option<Planned>,
        r: Routed,
    ) -> Result<(), String> {
        self.trace(|| {
            format!(
                "client {c}: seq {} {:?} -> {:?} @{} at {}",
                req.seq,
                req.op,
                r.reply,
                r.lsn,
                s.journal().id()
            )
        });
        let cl = &mut self.clients[c];
        match &planned {
            Some(p) => {
                let created = Model::check(p, &r.reply).map_err(|e| format!("client {c}: {e}"))?;
                cl.model.apply(p.change, created);
            }
            None => check_shared(&r.reply).map_err(|e| format!("client {c}: {e}"))?,
        }
        if r.early && r.lsn > s.journal().durable_lsn() && !matches!(r.reply, Reply::Error(_)) {
            let tag = SessionTags::new(s.replay_key(), cl.session).tag(&req, &r.reply);
            cl.kept.push(Kept {
                req,
                reply: r.reply,
                lsn: r.lsn,
                at: s.journal().id(),
                tag,
                planned,
            });
        }
        Ok(())
    }

    /// Makes everything server `i` appended durable.
    fn flush(&mut self, i: usize) -> Result<(), String> {
        let s = &self.servers[i].live;
        s.journal().flush_now();
        if !s.journal().wait_durable(s.journal().last_lsn()) {
            return Err(format!(
                "the journal of server {} failed",
                self.servers[i].id
            ));
        }
        self.flushes_done();
        self.stats.flushes += 1;
        self.trace(|| {
            format!(
                "flush of {} to {}",
                s.journal().id(),
                s.journal().durable_lsn()
            )
        });
        Ok(())
    }

    /// The clients learn what every live journal holds, and drop those kept requests.
    fn after_flush(&mut self) {
        let durable: Vec<(JournalId, u64)> = self
            .servers
            .iter()
            .map(|s| (s.live.journal().id(), s.live.journal().durable_lsn()))
            .collect();
        for cl in &mut self.clients {
            cl.kept
                .retain(|k| !durable.iter().any(|&(j, d)| j == k.at && k.lsn <= d));
        }
        self.data_after_flush(&durable);
    }

    fn checkpoint(&mut self) -> Result<(), String> {
        let i = self.rng.range(0, self.servers.len() as u64 - 1) as usize;
        let s = self.servers[i].live.clone();
        s.checkpointer()
            .round(&s)
            .map_err(|e| format!("checkpoint at server {}: {e}", self.servers[i].id))?;
        self.stats.checkpoints += 1;
        self.trace(|| format!("checkpoint at {}", s.journal().id()));
        Ok(())
    }

    /// A borrowed table goes back to its lender (RETURN).
    fn give_back(&mut self) -> Result<(), String> {
        if self.lent.is_empty() {
            return Ok(());
        }
        let k = self.rng.range(0, self.lent.len() as u64 - 1) as usize;
        let Some((&lo, &lender)) = self.lent.iter().nth(k) else {
            return Ok(());
        };
        let holder = self.owner[&lo];
        self.trace(|| format!("return {lo:016x}: {holder} -> {lender}"));
        if holder != lender {
            self.move_table(lo, holder, lender)?;
        }
        self.lent.remove(&lo);
        self.stats.returns += 1;
        Ok(())
    }

    /// A table moves for good to another server (the balancer's choice; often one with
    /// a data client's open file, see [`World::data_table`]).
    fn random_migration(&mut self) -> Result<(), String> {
        let tables: Vec<u64> = self.owner.keys().copied().collect();
        let lo = match self.data_table() {
            Some(lo) => lo,
            None => tables[self.rng.range(0, tables.len() as u64 - 1) as usize],
        };
        let to = self.rng.range(0, self.servers.len() as u64 - 1) as usize;
        self.migrate(lo, to)
    }

    /// A table is split where its holder's engine says (a lent table's upper half is lent
    /// too).
    fn split(&mut self) -> Result<(), String> {
        let tables: Vec<u64> = self.owner.keys().copied().collect();
        let lo = tables[self.rng.range(0, tables.len() as u64 - 1) as usize];
        let at_server = self.owner[&lo];
        let s = self.servers[at_server].live.clone();
        match s.split_table(lo, None) {
            Ok(Ok(at)) => {
                self.trace(|| format!("split {lo:016x} at {at:016x} on {at_server}"));
                self.ranges
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .split([(lo, at)]);
                self.set_owner(at, at_server);
                if let Some(&lender) = self.lent.get(&lo) {
                    self.lent.insert(at, lender);
                }
                self.stats.splits += 1;
                Ok(())
            }
            Ok(Err(_)) => {
                self.stats.splits_refused += 1;
                Ok(())
            }
            Err(e) => Err(format!("split of {lo:016x}: {e}")),
        }
    }

    /// kill -9 of a server: what it wrote stays, what it had not flushed is gone. Its
    /// tables are recovered from its journal by another live server or by its next
    /// incarnation (which starts either way), and the clients replay what it answered
    /// early.
    ///
    /// Or a pause instead of the kill (`paused`): the process stops answering long enough
    /// that its tables are taken over (its journal sealed) while it still runs, and a
    /// client whose connection still reaches it sends it one more change.
    fn kill(&mut self, paused: bool) -> Result<(), String> {
        let i = self.rng.range(0, self.servers.len() as u64 - 1) as usize;
        let old = self.servers[i].live.clone();
        let dead = old.journal().id();
        if paused {
            self.stats.pauses += 1;
        } else {
            self.stats.kills += 1;
            // Nothing it appended from now on is written: the process is gone.
            old.journal().fail_stop("killed (simulated)".into());
        }
        // Its slow reads never finish.
        self.net.forget_jobs_of(dead);
        let epoch = self.servers[i].epoch + 1;
        let next = self.start(self.servers[i].id, epoch, &[])?;
        self.servers[i] = Server {
            id: self.servers[i].id,
            epoch,
            live: next,
        };
        let ranges = self.ranges();
        let tables: Vec<(u64, Option<u64>)> = ranges
            .as_slice()
            .iter()
            .filter(|(lo, _)| self.owner.get(lo) == Some(&i))
            .map(|&(lo, hi)| (lo, Some(hi)))
            .collect();
        let others: Vec<usize> = (0..self.servers.len()).filter(|&j| j != i).collect();
        let to = match others.is_empty() || self.rng.chance(500) {
            true => i,
            false => others[self.rng.range(0, others.len() as u64 - 1) as usize],
        };
        if to != i {
            self.stats.failovers += 1;
        }
        self.trace(|| {
            let what = if paused { "pause" } else { "kill -9" };
            format!("{what} of {dead}; its {} tables to {to}", tables.len())
        });
        let s = self.servers[to].live.clone();
        if !tables.is_empty() {
            s.recover_tables_to(&tables, dead)
                .map_err(|e| format!("recovery of {dead}'s tables at {to}: {e}"))?;
            // Its clients replay what it acknowledged early and lost (as the host does).
            s.replay_window().open();
        }
        for (lo, _) in &tables {
            self.set_owner(*lo, to);
        }
        if paused {
            self.data_write_at_old(&old, &tables)?;
            self.late_change(i, &old)?;
        }
        drop(old);
        if let Some(l) = &mut self.leases {
            l.server_gone(dead, &mut self.stats.leases);
        }
        self.replay(dead)?;
        self.data_replay(dead, &tables)?;
        // The window stays open for its time (a lease): the holders of leases the dead
        // incarnation granted may cache them until then, and nobody can call them back.
        for j in 0..self.servers.len() {
            self.flush(j)?;
        }
        self.after_flush();
        Ok(())
    }

    /// A client still connected to `old`, whose tables were taken over while it was
    /// paused, sends it a change: it may be answered early (the client keeps it and
    /// replays it at the new owner), but the sealed journal must never call it durable.
    /// Then the old process goes.
    fn late_change(&mut self, i: usize, old: &Arc<Shared>) -> Result<(), String> {
        let c = self.rng.range(0, self.cfg.clients as u64 - 1) as usize;
        let (mut req, planned) = self.next_request(c)?;
        req.mode = ReplyMode::Early;
        let session = self.clients[c].session;
        let mut replies = Vec::with_capacity(1);
        let parked = old.execute_batch(session, &[(1, req.clone())], &mut replies);
        let answered = replies.pop().filter(|_| parked.is_empty());
        match answered {
            Some(a) if !matches!(a.reply, Reply::WrongServer { .. }) => {
                let early = a.early_by(old.journal().durable_lsn());
                self.trace(|| {
                    format!(
                        "client {c}: seq {} sent to the paused {}",
                        req.seq,
                        old.journal().id()
                    )
                });
                if early || old.journal().wait_durable(a.lsn) {
                    let r = Routed {
                        reply: a.reply,
                        lsn: a.lsn,
                        early,
                        at: i,
                    };
                    self.accept_from(c, old, req, planned, r)?;
                } else {
                    // No reply leaves: the client sends it again to the new owner.
                    self.clients[c].lost = Some((req, planned));
                }
            }
            // Not run there (it needed a table the old process did not have): sent again.
            _ => self.clients[c].lost = Some((req, planned)),
        }
        old.journal().flush_now();
        if old.journal().wait_durable(old.journal().last_lsn()) {
            // The old journal says durable: its clients believe it.
            let (j, durable) = (old.journal().id(), old.journal().durable_lsn());
            for cl in &mut self.clients {
                cl.kept.retain(|k| k.at != j || k.lsn > durable);
            }
            self.data_after_flush(&[(j, durable)]);
        }
        old.journal().fail_stop("the paused process ends".into());
        Ok(())
    }

    /// Every client replays what `dead` answered it early, each in its own order, the
    /// clients interleaved at random, each replay where the map sends it now.
    fn replay(&mut self, dead: JournalId) -> Result<(), String> {
        let mut queues: Vec<(usize, VecDeque<Kept>)> = Vec::new();
        for (c, cl) in self.clients.iter_mut().enumerate() {
            let (theirs, rest): (Vec<Kept>, Vec<Kept>) = std::mem::take(&mut cl.kept)
                .into_iter()
                .partition(|k| k.at == dead);
            cl.kept = rest;
            queues.push((c, theirs.into()));
        }
        loop {
            queues.retain(|(_, q)| !q.is_empty());
            if queues.is_empty() {
                return Ok(());
            }
            let i = self.rng.range(0, queues.len() as u64 - 1) as usize;
            let c = queues[i].0;
            let Some(k) = queues[i].1.pop_front() else {
                continue;
            };
            self.replay_one(c, k)?;
        }
    }

    fn replay_one(&mut self, c: usize, k: Kept) -> Result<(), String> {
        self.stats.replays += 1;
        let want_id = k.reply.created();
        let mut req = k.req.clone();
        req.mode = ReplyMode::Replay {
            want_id,
            tag: k.tag,
        };
        req.seq_floor = self.clients[c].seq_floor().min(req.seq);
        let session = self.clients[c].session;
        let r = self.route(session, req)?;
        self.trace(|| {
            format!(
                "client {c}: replay seq {} @{} of {} {:?} -> {:?} at server {}",
                k.req.seq, k.lsn, k.at, k.req.op, r.reply, self.servers[r.at].id
            )
        });
        if !k.replay_agrees(&r.reply) {
            return Err(format!(
                "client {c}: seq {} ({}) was answered {:?} early by {}, its replay {:?}",
                k.req.seq,
                k.req.op.name(),
                k.reply,
                k.at,
                r.reply
            ));
        }
        Ok(())
    }

    /// The invariants (see the module).
    fn check(&self) -> Result<(), String> {
        if let Some(l) = &self.leases {
            let (_, at) = self.owner_of(l.file())?;
            let live = self.live();
            l.check(&live, &live[at])?;
        }
        let cores: Vec<_> = self.servers.iter().map(|s| s.live.core()).collect();
        for (lo, _) in self.ranges().as_slice() {
            let holders: Vec<u64> = cores
                .iter()
                .zip(&self.servers)
                .filter(|(core, _)| core.engine.tables().iter().any(|t| t.lo == *lo))
                .map(|(_, s)| s.id)
                .collect();
            let want = self.owner.get(lo).map(|&i| self.servers[i].id);
            if holders.len() != 1 || Some(holders[0]) != want {
                return Err(format!(
                    "table {lo:016x} is held by servers {holders:?}, the map says {want:?}"
                ));
            }
        }
        for (core, s) in cores.iter().zip(&self.servers) {
            let problems = core.engine.check_invariants();
            if !problems.is_empty() {
                return Err(format!("server {}: {}", s.id, problems.join("; ")));
            }
        }
        let engines: Vec<&Engine> = cores.iter().map(|c| &c.engine).collect();
        let problems = kochab_meta::links::check_cluster(&kochab_meta::links::gather(&engines));
        if !problems.is_empty() {
            return Err(format!("links between servers: {}", problems.join("; ")));
        }
        drop(cores);
        self.data_check()?;
        let cores: Vec<_> = self.servers.iter().map(|s| s.live.core()).collect();
        for (c, cl) in self.clients.iter().enumerate() {
            if cl.lost.is_some() {
                continue;
            }
            for (d, &dir) in cl.dirs.iter().enumerate() {
                let (_, at) = self.owner_of(dir)?;
                for name in NAMES {
                    let want = cl.model.names.get(&(d, name)).map(|e| e.0);
                    let have = cores[at].engine.child(dir, &cl.model.name_of((d, name)));
                    if want != have {
                        return Err(format!(
                            "client {c}: {d}/{name} is {have:?} at server {}, {want:?} as \
                             acknowledged (an acknowledged change lost or applied twice)",
                            self.servers[at].id
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Time, the lease holder and the waits that time ends.
impl World {
    /// Every server's live incarnation, in the order of `servers`.
    fn live(&self) -> Vec<Arc<Shared>> {
        self.servers.iter().map(|s| s.live.clone()).collect()
    }

    /// Moves the clock on by `by`: the holder first takes in what was sent to it, and
    /// every live server then ends the callbacks whose deadline passed (as its
    /// `server::cleanup_loop` does).
    fn advance(&mut self, by: Duration) -> Result<(), String> {
        let live = self.live();
        if let Some(l) = &mut self.leases {
            l.before_time_passes(&live, &mut self.stats.leases)?;
        }
        self.clock.advance(by);
        for s in &live {
            let expired = s.expire_callbacks();
            if expired.missed > 0 {
                self.stats.leases.defaults += expired.defaulted.len() as u64;
                self.trace(|| format!("callbacks ran out at {}: {expired:?}", s.journal().id()));
            }
        }
        Ok(())
    }

    /// Everything stops for a while (up to past a lease).
    fn time_jump(&mut self) -> Result<(), String> {
        self.stats.time_jumps += 1;
        let by = Duration::from_millis(self.rng.range(PAUSE_MS.0, PAUSE_MS.1));
        self.trace(|| format!("pause of everything: {by:?}"));
        self.advance(by)
    }

    /// Whether `req`, a change (not a replay), waits out the replay window of the server
    /// that holds its first table, as the connection makes it wait
    /// (`conn::waits_for_replays`); meanwhile the world goes on.
    fn waits_window(&mut self, req: &Request) -> Result<bool, String> {
        let replay = matches!(req.mode, ReplyMode::Replay { .. });
        let Some(first) = req.op.inode_ids().into_iter().flatten().next() else {
            return Ok(false);
        };
        let (_, at) = self.owner_of(first)?;
        let left = self.servers[at].live.replay_window().left();
        if replay || left.is_zero() || !waits_for_replays(&req.op) {
            return Ok(false);
        }
        self.stats.window_waits += 1;
        self.trace(|| {
            format!(
                "{} waits {left:?} for the replay window at {at}",
                req.op.name()
            )
        });
        Ok(true)
    }

    /// A drop sent the callbacks that revoke its table's leases and waits until `ready`:
    /// the holder gets them and answers, or time passes until it does or they run out.
    fn wait_revoked(&mut self, ready: &dyn Fn() -> bool) -> Result<(), String> {
        let started = self.clock.now();
        loop {
            let live = self.live();
            if let Some(l) = &mut self.leases {
                l.revoked(&mut self.rng, &live, &mut self.stats.leases)?;
            }
            if ready() {
                return Ok(());
            }
            let waited = self.clock.now().saturating_duration_since(started);
            if waited > LEASE + Duration::from_secs(1) {
                return Err(format!("a drop waited {waited:?} for its revocations"));
            }
            let ms = self.rng.range(REVOKE_WAIT_MS.0, REVOKE_WAIT_MS.1);
            self.advance(Duration::from_millis(ms))?;
        }
    }

    /// One step of the lease holder or of its writer, at the server that holds the file.
    fn lease_op(&mut self) -> Result<(), String> {
        let Some(file) = self.leases.as_ref().map(|l| l.file()) else {
            return Ok(());
        };
        let live = self.live();
        let change = match &mut self.leases {
            Some(l) => l.next_is_change(&mut self.rng, &live, &mut self.stats.leases)?,
            None => false,
        };
        let (_, at) = self.owner_of(file)?;
        if change {
            let set = kochab_proto::SetAttrs::default();
            let chmod = Request::plain(&Credentials::root(), Op::SetAttr { id: file, set });
            if self.waits_window(&chmod)? {
                return Ok(());
            }
        }
        let live = self.live();
        match &mut self.leases {
            Some(l) if change => l.change(&mut self.rng, &live[at], &live, &mut self.stats.leases),
            Some(l) => l.look(&live[at], &live, &mut self.stats.leases),
            None => Ok(()),
        }
    }

    /// After a step: the holder takes in what reached it, and a change that waited for it
    /// is acknowledged once its callbacks are done.
    fn settle(&mut self) -> Result<(), String> {
        let Some(file) = self.leases.as_ref().map(|l| l.file()) else {
            return Ok(());
        };
        let (_, at) = self.owner_of(file)?;
        let live = self.live();
        match &mut self.leases {
            Some(l) => l.settle(&live, &live[at], &mut self.stats.leases),
            None => Ok(()),
        }
    }
}
