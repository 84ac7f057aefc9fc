//! A seeded, deterministic simulation of a whole cluster: one coordinator (its replication
//! modelled as an atomic apply; Raft is tested elsewhere), several metadata servers, and
//! clients, over a network that drops, delays and reorders messages, with partitions,
//! crashes, SIGSTOP-like pauses and lease expiry. Tables hold a model of their contents
//! (the ids of the operations applied to them) persisted through [`SimStore`], an
//! in-memory object store that loses unsynced writes on a crash and offers the conditional
//! writes fencing relies on.
//!
//! What runs is the real code, not a model of it: the coordinator's state and driver, each
//! server's participant and its host's bookkeeping ([`crate::host`]: borrow slots and
//! joins, operations ending once their record is durable, the load decision for each
//! table, load reports), and each client's router and retry policy
//! ([`crate::router::Retries`]). Only the engine, the journal and the store are models.
//!
//! After every step it checks: no two servers serve one table at any instant, every
//! acknowledged operation is in the durable state exactly once, the coordinator's own
//! invariants, and that no manifest was ever taken over from a journal still writable.
//! At the end (faults stopped): every operation acknowledged, every borrow returned.

use std::collections::{BTreeMap, VecDeque};

use kochab_proto::cluster::{
    BorrowId, Control, ControlReply, CoordCommand, CoordReply, DelegationMap, Incarnation,
    MapVersion, ServerId, ServerRequest, TableId,
};

use crate::driver::{Driver, DriverAction, DriverConfig};
use crate::host::borrows::{Borrows, Granted, Join};
use crate::host::ends::Ends;
use crate::host::load::{Claim, LOAD_REPORT_EVERY_MS, LoadCounter, LoadPlan, Owner};
use crate::participant::{Action, Admit, Break, Participant, ParticipantConfig};
use crate::router::{Retries, Retry, RetryPolicy, Route, Router};
use crate::state::CoordState;

/// splitmix64: small, fast, and the same on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose whole sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `permille / 1000`.
    pub fn chance(&mut self, permille: u64) -> bool {
        self.next_u64() % 1000 < permille
    }
}

/// An operation's id (unique per simulation run).
pub type OpId = u64;

#[derive(Clone, Debug)]
struct Rec {
    lsn: u64,
    op: OpId,
    tables: Vec<TableId>,
}

#[derive(Clone, Debug, Default)]
struct Journal {
    durable: Vec<Rec>,
    pending: Vec<Rec>,
    sealed: bool,
}

/// A table's manifest: its checkpointed contents and the journal to replay after them.
#[derive(Clone, Debug)]
struct Manifest {
    version: u64,
    owner: Incarnation,
    ops: Vec<OpId>,
    /// `None`: cleanly dropped, the checkpoint is complete.
    replay: Option<(Incarnation, u64)>,
}

/// The in-memory object store: per-incarnation journals (appends are lost on a crash until
/// synced; a sealed journal refuses syncs) and per-table manifests replaced only by
/// compare-and-swap on their version.
#[derive(Clone, Debug, Default)]
pub struct SimStore {
    manifests: BTreeMap<TableId, Manifest>,
    journals: BTreeMap<Incarnation, Journal>,
    violations: Vec<String>,
}

impl SimStore {
    fn append(&mut self, j: Incarnation, rec: Rec) {
        self.journals.entry(j).or_default().pending.push(rec);
    }

    fn sync(&mut self, j: Incarnation) -> Result<(), String> {
        let jr = self.journals.entry(j).or_default();
        if jr.sealed {
            jr.pending.clear();
            return Err(format!("journal {j:?} is sealed"));
        }
        let p = std::mem::take(&mut jr.pending);
        jr.durable.extend(p);
        Ok(())
    }

    fn crash(&mut self, j: Incarnation) {
        if let Some(jr) = self.journals.get_mut(&j) {
            jr.pending.clear();
        }
    }

    fn seal(&mut self, j: Incarnation) {
        self.journals.entry(j).or_default().sealed = true;
    }

    fn sealed(&self, j: Incarnation) -> bool {
        self.journals.get(&j).is_some_and(|x| x.sealed)
    }

    /// Replaces `t`'s manifest if its version is still `expect`, and `writer`'s journal is
    /// not sealed (the store's fencing).
    fn cas_manifest(
        &mut self,
        t: TableId,
        expect: Option<u64>,
        mut new: Manifest,
        writer: Incarnation,
    ) -> Result<(), String> {
        if self.sealed(writer) {
            return Err(format!("{writer:?} is fenced"));
        }
        let cur = self.manifests.get(&t);
        if cur.map(|m| m.version) != expect {
            return Err(format!("manifest of {:#x} changed", t.0));
        }
        if let Some(m) = cur
            && let Some((j, _)) = m.replay
            && j != writer
            && !self.sealed(j)
        {
            // Two incarnations could now both write records that count for `t`.
            self.violations.push(format!(
                "table {:#x} taken over by {writer:?} while {j:?} may still write it",
                t.0
            ));
        }
        new.version = expect.map_or(1, |v| v + 1);
        self.manifests.insert(t, new);
        Ok(())
    }

    /// What recovery would find for `t`: the checkpoint plus the replayed journal tail.
    fn durable_view(&self, t: TableId) -> Vec<OpId> {
        let Some(m) = self.manifests.get(&t) else {
            return Vec::new();
        };
        let mut ops = m.ops.clone();
        if let Some((j, from)) = m.replay {
            ops.extend(self.replay(j, from, t));
        }
        ops
    }

    /// The operations on `t` in `j`'s durable journal from record `from` on.
    fn replay(&self, j: Incarnation, from: u64, t: TableId) -> impl Iterator<Item = OpId> {
        let records = self.journals.get(&j).map_or(&[][..], |jr| &jr.durable[..]);
        records
            .iter()
            .filter(move |r| r.lsn >= from && r.tables.contains(&t))
            .map(|r| r.op)
    }
}

/// One client operation: the tables it touches (the first is the one it is routed by).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Op {
    id: OpId,
    tables: Vec<TableId>,
    client: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Coord,
    Server(usize),
    Client(usize),
}

#[derive(Clone, Debug)]
enum Msg {
    Req {
        req_id: u64,
        req: ServerRequest,
    },
    Resp {
        req_id: u64,
        reply: CoordReply,
    },
    Ctl(Control),
    CtlReply(ControlReply),
    ClientOp(Op),
    ClientOk(OpId),
    ClientWrong {
        op: OpId,
        table: TableId,
        owner: Option<ServerId>,
    },
    GetMap,
    Map(DelegationMap),
}

#[derive(Clone, Debug)]
enum Ev {
    Deliver { from: Node, to: Node, msg: Msg },
    Tick(Node),
    Crash(usize),
    Restart(usize),
    Pause(usize, u64),
    Partition(usize, u64),
    LeaderChange(u64),
    Move,
}

struct SimServer {
    id: ServerId,
    p: Option<Participant>,
    paused_until: u64,
    mem: BTreeMap<TableId, Vec<OpId>>,
    next_lsn: u64,
    /// Admitted and not run yet, with the borrow each runs under.
    admitted: Vec<(Op, Option<BorrowId>)>,
    /// The borrows operations wait for or run under: the real server's bookkeeping.
    borrows: Borrows<Op>,
    /// Ran, and wait for their journal record to be durable (the real server's too).
    ends: Ends<Op>,
    /// Operations admitted per table since the last load report, and when that was (host
    /// clock).
    load: LoadCounter,
    last_load_ms: u64,
}

impl SimServer {
    fn new(id: ServerId, p: Participant) -> SimServer {
        SimServer {
            id,
            p: Some(p),
            paused_until: 0,
            mem: BTreeMap::new(),
            next_lsn: 0,
            admitted: Vec::new(),
            borrows: Borrows::new(),
            ends: Ends::new(),
            load: LoadCounter::default(),
            last_load_ms: 0,
        }
    }

    fn reset(&mut self) {
        self.p = None;
        self.mem.clear();
        self.admitted.clear();
        self.borrows = Borrows::new();
        self.ends.clear();
        self.load = LoadCounter::default();
    }

    fn busy_with(&self, op: OpId) -> bool {
        self.admitted.iter().any(|(o, _)| o.id == op)
            || self.ends.iter().any(|o| o.id == op)
            || self.borrows.waiters().any(|o| o.id == op)
    }

    /// The tables of admitted operations that have not ended (some more than once).
    fn busy_tables(&self) -> Vec<TableId> {
        let ops = self.admitted.iter().map(|(o, _)| o).chain(self.ends.iter());
        ops.flat_map(|o| o.tables.iter().copied()).collect()
    }
}

/// The reply cache: each table remembers the operations applied to it, and a multi-table
/// operation is one record, so finding it in any table held here means it is done.
fn already_applied(s: &SimServer, op: &Op, now: u64) -> bool {
    let Some(p) = s.p.as_ref() else {
        return false;
    };
    op.tables
        .iter()
        .any(|t| p.serves(*t, now) && s.mem.get(t).is_some_and(|v| v.contains(&op.id)))
}

/// How long a simulated client waits for the answer to one attempt before it counts as
/// unanswered (the real client's `request_timeout`, scaled to the simulated network's
/// 1-40 ms delays).
const ATTEMPT_TIMEOUT_MS: u64 = 300;

/// How long a simulated client waits for a map it asked for before it routes again.
const FETCH_TIMEOUT_MS: u64 = 100;

/// "Not now, ask again" (a table loading, a lease being renewed, a borrow refused or
/// moved on), told as the real server tells it: WrongServer without a hint, so the client
/// fetches the map again before it retries.
fn not_ready(op: &Op) -> Msg {
    Msg::ClientWrong {
        op: op.id,
        table: op.tables[0],
        owner: None,
    }
}

/// A client's operation in progress, retried as the real client retries a request.
struct Current {
    op: Op,
    retries: Retries,
    next_try: u64,
    /// The attempt awaiting an answer: its server and the map version it was routed by.
    sent: Option<(ServerId, MapVersion)>,
}

impl Current {
    fn new(op: Op, now: u64) -> Current {
        Current {
            op,
            retries: Retries::new(RetryPolicy::default()),
            next_try: now,
            sent: None,
        }
    }
}

struct SimClient {
    router: Router,
    ops: VecDeque<Op>,
    cur: Option<Current>,
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub servers: usize,
    pub tables: usize,
    pub clients: usize,
    pub ops_per_client: usize,
    /// Share of operations that touch two tables (need a borrow when split), per mille.
    pub multi_permille: u64,
    /// Faults happen before this time; after it the cluster must finish all work.
    pub fault_end_ms: u64,
    pub broken: Option<Break>,
    /// Servers' clocks run up to this fast or slow (parts per million).
    pub drift_ppm_max: i64,
    /// Print every event (for replaying a failing seed).
    pub trace: bool,
}

impl SimConfig {
    /// The default cluster and fault mix for `seed`.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            servers: 4,
            tables: 8,
            clients: 3,
            ops_per_client: 30,
            multi_permille: 150,
            fault_end_ms: 20_000,
            broken: None,
            // 2%: far beyond real quartz (~50 ppm); the margin (300 ms of a 2 s lease)
            // covers 15%.
            drift_ppm_max: 20_000,
            trace: false,
        }
    }
}

/// What a passing run did.
#[derive(Clone, Debug, Default)]
pub struct SimStats {
    pub events: u64,
    pub acked: usize,
    pub borrows: u64,
    pub fences: u64,
    /// Operations whose retry budget ran out during the fault storm (then retried).
    pub client_errors: u64,
    pub end_ms: u64,
}

const LEASE_MS: u64 = 2_000;
/// After faults stop, everything must be done within this.
const SETTLE_MS: u64 = 60_000;

struct World {
    cfg: SimConfig,
    rng: Rng,
    now: u64,
    seq: u64,
    events: BTreeMap<(u64, u64), Ev>,
    store: SimStore,
    state: CoordState,
    driver: Driver,
    coord_down_until: u64,
    servers: Vec<SimServer>,
    isolated: BTreeMap<usize, u64>,
    clients: Vec<SimClient>,
    /// Acknowledged operations and their tables.
    acked: BTreeMap<OpId, Vec<TableId>>,
    dirty: bool,
    /// Clock rate error of each server, parts per million.
    drift_ppm: Vec<i64>,
    stats: SimStats,
    pcfg: ParticipantConfig,
}

/// Runs one seed; `Err` names the seed, the step (events run) and the first broken
/// invariant.
pub fn run(cfg: SimConfig) -> Result<SimStats, String> {
    let seed = cfg.seed;
    let mut w = World::new(cfg);
    w.run().map_err(|e| {
        format!(
            "SIM_SEED={seed}: step {}, at {} ms: {e}",
            w.stats.events, w.now
        )
    })
}

impl World {
    fn new(cfg: SimConfig) -> World {
        let mut rng = Rng::new(cfg.seed);
        let span = 1u64 << 20;
        let tables: Vec<(TableId, u64)> = (0..cfg.tables as u64)
            .map(|i| (TableId(i * span), (i + 1) * span))
            .collect();
        let mut state = CoordState::default();
        state.apply(&CoordCommand::Bootstrap {
            tables: tables.clone(),
            lease_ms: LEASE_MS,
        });
        let pcfg = ParticipantConfig {
            margin_ms: 300,
            renew_every_ms: 500,
            retry_ms: 300,
            broken: cfg.broken,
        };
        let servers = (0..cfg.servers)
            .map(|i| {
                let id = ServerId(i as u32);
                SimServer::new(
                    id,
                    Participant::new(id, format!("s{i}"), rng.next_u64(), pcfg),
                )
            })
            .collect();
        let mut next_op = 0;
        let clients = (0..cfg.clients)
            .map(|c| {
                let ops = (0..cfg.ops_per_client)
                    .map(|_| {
                        next_op += 1;
                        let a = TableId(rng.range(0, cfg.tables as u64 - 1) * span);
                        let mut tables = vec![a];
                        if rng.chance(cfg.multi_permille) {
                            let b = TableId(rng.range(0, cfg.tables as u64 - 1) * span);
                            if b != a {
                                tables.push(b);
                            }
                        }
                        Op {
                            id: next_op,
                            tables,
                            client: c,
                        }
                    })
                    .collect();
                SimClient {
                    router: Router::new(vec!["coord".into()]),
                    ops,
                    cur: None,
                }
            })
            .collect();
        let mut w = World {
            rng,
            now: 0,
            seq: 0,
            events: BTreeMap::new(),
            store: SimStore::default(),
            state,
            driver: Driver::new(DriverConfig {
                retry_ms: 500,
                tick_ms: 100,
                ..DriverConfig::default()
            }),
            coord_down_until: 0,
            servers,
            isolated: BTreeMap::new(),
            clients,
            acked: BTreeMap::new(),
            dirty: false,
            drift_ppm: Vec::new(),
            stats: SimStats::default(),
            pcfg,
            cfg,
        };
        let max = w.cfg.drift_ppm_max as u64;
        w.drift_ppm = (0..w.cfg.servers)
            .map(|_| w.rng.range(0, 2 * max) as i64 - max as i64)
            .collect();
        w.schedule_start();
        w
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.insert((t, self.seq), ev);
    }

    fn schedule_start(&mut self) {
        self.at(0, Ev::Tick(Node::Coord));
        for i in 0..self.cfg.servers {
            let t = self.rng.range(0, 20);
            self.at(t, Ev::Tick(Node::Server(i)));
        }
        for c in 0..self.cfg.clients {
            let t = self.rng.range(100, 300);
            self.at(t, Ev::Tick(Node::Client(c)));
        }
        let end = self.cfg.fault_end_ms;
        let faults = self.rng.range(4, 12);
        for _ in 0..faults {
            let t = self.rng.range(1_000, end);
            let i = self.rng.range(0, self.cfg.servers as u64 - 1) as usize;
            let ev = match self.rng.range(0, 3) {
                0 => Ev::Crash(i),
                1 => Ev::Pause(i, self.rng.range(500, 4_000)),
                2 => Ev::Partition(i, self.rng.range(500, 4_000)),
                _ => Ev::LeaderChange(self.rng.range(100, 1_500)),
            };
            self.at(t, ev);
        }
        let mut t = 500;
        while t < end {
            t += self.rng.range(100, 800);
            self.at(t, Ev::Move);
        }
    }

    /// Server `i`'s clock: each runs at its own rate (`drift_ppm`), which the lease margin
    /// must absorb.
    fn local(&self, i: usize) -> u64 {
        let d = self.drift_ppm[i];
        (self.now as i64 + self.now as i64 * d / 1_000_000).max(0) as u64
    }

    fn faulty(&self) -> bool {
        self.now < self.cfg.fault_end_ms
    }

    fn send(&mut self, from: Node, to: Node, msg: Msg) {
        let cut = |n: Node, w: &World| match n {
            Node::Server(i) => w.isolated.get(&i).is_some_and(|u| *u > w.now),
            _ => false,
        };
        if cut(from, self) || cut(to, self) {
            return;
        }
        if self.faulty() && self.rng.chance(20) {
            return;
        }
        if self.faulty() && self.rng.chance(20) {
            // A duplicate, arriving whenever (retransmissions, replays).
            let delay = self.rng.range(1, 2_000);
            let m = msg.clone();
            self.at(self.now + delay, Ev::Deliver { from, to, msg: m });
        }
        let delay = self.rng.range(1, 40);
        self.at(self.now + delay, Ev::Deliver { from, to, msg });
    }

    fn run(&mut self) -> Result<SimStats, String> {
        let deadline = self.cfg.fault_end_ms + SETTLE_MS;
        while let Some(((t, _), ev)) = self.events.pop_first() {
            self.now = t;
            if t > deadline {
                return Err(format!(
                    "not done after faults stopped: {}",
                    self.pending_work()
                ));
            }
            self.stats.events += 1;
            if self.cfg.trace && !matches!(ev, Ev::Tick(_)) {
                eprintln!("{t} {ev:?}");
            }
            self.step(ev)?;
            self.check()?;
            if !self.faulty() && self.done() {
                self.stats.acked = self.acked.len();
                self.stats.end_ms = self.now;
                return Ok(self.stats.clone());
            }
        }
        Err("ran out of events".into())
    }

    fn done(&self) -> bool {
        self.clients
            .iter()
            .all(|c| c.ops.is_empty() && c.cur.is_none())
            && self.state.borrows.is_empty()
            && self.state.migrations.is_empty()
            && self
                .servers
                .iter()
                .all(|s| s.p.as_ref().is_none_or(|p| p.open_borrows() == 0))
    }

    fn pending_work(&self) -> String {
        let ops: usize = self
            .clients
            .iter()
            .map(|c| c.ops.len() + usize::from(c.cur.is_some()))
            .sum();
        format!(
            "{ops} ops unacknowledged, borrows {:?}, migrations {:?}",
            self.state.borrows, self.state.migrations
        )
    }

    fn step(&mut self, ev: Ev) -> Result<(), String> {
        // A paused server does nothing; what reaches it waits in its socket buffers.
        let target = match &ev {
            Ev::Deliver {
                to: Node::Server(i),
                ..
            }
            | Ev::Tick(Node::Server(i)) => Some(*i),
            _ => None,
        };
        if let Some(i) = target
            && self.servers[i].paused_until > self.now
        {
            let t = self.servers[i].paused_until + self.rng.range(0, 5);
            self.at(t, ev);
            return Ok(());
        }
        match ev {
            Ev::Tick(Node::Coord) => {
                self.at(self.now + 50, Ev::Tick(Node::Coord));
                if self.now >= self.coord_down_until {
                    let acts = self.driver.tick(&self.state, self.now);
                    self.driver_actions(acts)?;
                }
            }
            Ev::Tick(Node::Server(i)) => {
                self.at(self.now + 20, Ev::Tick(Node::Server(i)));
                self.server_tick(i)?;
            }
            Ev::Tick(Node::Client(c)) => {
                self.at(self.now + 20, Ev::Tick(Node::Client(c)));
                self.client_tick(c)?;
            }
            Ev::Deliver { from, to, msg } => self.deliver(from, to, msg)?,
            Ev::Crash(i) => {
                self.crash(i);
                let t = self.now + self.rng.range(300, 3_000);
                self.at(t, Ev::Restart(i));
            }
            Ev::Restart(i) => self.restart(i),
            Ev::Pause(i, d) => self.servers[i].paused_until = self.now + d,
            Ev::Partition(i, d) => {
                self.isolated.insert(i, self.now + d);
            }
            Ev::LeaderChange(d) => {
                // The new leader starts with an empty driver: repair from state alone.
                self.driver = Driver::new(DriverConfig {
                    retry_ms: 500,
                    tick_ms: 100,
                    ..DriverConfig::default()
                });
                self.coord_down_until = self.now + d;
            }
            Ev::Move => {
                let t = TableId(self.rng.range(0, self.cfg.tables as u64 - 1) << 20);
                let to = ServerId(self.rng.range(0, self.cfg.servers as u64 - 1) as u32);
                if self.now >= self.coord_down_until {
                    self.propose(CoordCommand::Move { table: t, to })?;
                }
            }
        }
        Ok(())
    }

    fn crash(&mut self, i: usize) {
        let s = &mut self.servers[i];
        if let Some(inc) = s.p.as_ref().and_then(|p| p.incarnation()) {
            self.store.crash(inc);
        }
        s.reset();
    }

    fn restart(&mut self, i: usize) {
        let nonce = self.rng.next_u64();
        let local = self.local(i);
        let s = &mut self.servers[i];
        if s.p.is_none() {
            s.reset();
            s.p = Some(Participant::new(s.id, format!("s{i}"), nonce, self.pcfg));
            s.last_load_ms = local;
        }
    }

    fn propose(&mut self, cmd: CoordCommand) -> Result<CoordReply, String> {
        let reply = self.state.apply(&cmd);
        self.state.check()?;
        let acts = self.driver.on_state(&self.state, self.now);
        self.driver_actions(acts)?;
        Ok(reply)
    }

    fn driver_actions(&mut self, acts: Vec<DriverAction>) -> Result<(), String> {
        for a in acts {
            match a {
                DriverAction::Send(c) => {
                    let to = Node::Server(c.to.server.0 as usize);
                    self.send(Node::Coord, to, Msg::Ctl(c));
                }
                DriverAction::Propose(cmd) => {
                    self.propose(cmd)?;
                }
            }
        }
        Ok(())
    }

    fn deliver(&mut self, from: Node, to: Node, msg: Msg) -> Result<(), String> {
        match to {
            Node::Coord => {
                if self.now < self.coord_down_until {
                    return Ok(());
                }
                match msg {
                    Msg::Req { req_id, req } => {
                        let reply = self.propose(CoordCommand::Request {
                            req,
                            now_ms: self.now,
                        })?;
                        self.send(Node::Coord, from, Msg::Resp { req_id, reply });
                    }
                    Msg::CtlReply(r) => {
                        let acts = self.driver.on_reply(&r);
                        self.driver_actions(acts)?;
                    }
                    Msg::GetMap => {
                        let m = self.state.map.clone();
                        self.send(Node::Coord, from, Msg::Map(m));
                    }
                    _ => {}
                }
            }
            Node::Server(i) => self.server_msg(i, from, msg)?,
            Node::Client(c) => self.client_msg(c, from, msg)?,
        }
        Ok(())
    }

    fn server_msg(&mut self, i: usize, from: Node, msg: Msg) -> Result<(), String> {
        let now = self.local(i);
        let Some(p) = self.servers[i].p.as_mut() else {
            return Ok(());
        };
        let acts = match msg {
            Msg::Resp { req_id, reply } => p.on_reply(req_id, &reply, now),
            Msg::Ctl(c) => p.on_control(&c, now),
            Msg::ClientOp(op) => return self.client_op(i, from, op),
            _ => Vec::new(),
        };
        self.actions(i, acts)
    }

    fn client_op(&mut self, i: usize, from: Node, op: Op) -> Result<(), String> {
        let now = self.local(i);
        let s = &mut self.servers[i];
        if s.busy_with(op.id) {
            return Ok(());
        }
        if already_applied(s, &op, now) {
            self.send(Node::Server(i), from, Msg::ClientOk(op.id));
            return Ok(());
        }
        let s = &mut self.servers[i];
        let Some(p) = s.p.as_mut() else {
            return Ok(());
        };
        match p.admit(&op.tables, now) {
            Admit::Ok => {
                s.load.admitted(op.tables[0]);
                s.admitted.push((op, None));
            }
            Admit::WrongServer { owner, .. } => {
                let m = Msg::ClientWrong {
                    op: op.id,
                    table: op.tables[0],
                    owner,
                };
                self.send(Node::Server(i), from, m);
            }
            Admit::NotReady => self.send(Node::Server(i), from, not_ready(&op)),
            // Join a borrow of the same tables, as the real server does, or ask for one.
            Admit::NeedBorrow => {
                let tables = op.tables.clone();
                match s.borrows.join(&tables, now, op) {
                    Join::Run { id, waiter } => return self.run_borrowed(i, id, waiter),
                    Join::Wait(_) => {}
                    Join::Ask(op) => {
                        let (id, acts) = p.borrow(&tables, now);
                        match id {
                            Some(id) => {
                                self.stats.borrows += 1;
                                s.borrows.asked(id, &tables, op);
                            }
                            None => self.send(Node::Server(i), from, not_ready(&op)),
                        }
                        self.actions(i, acts)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `op` runs under granted borrow `id`: admitted again now that the tables are here,
    /// else told to ask again; either way it leaves the borrow once it ran.
    fn run_borrowed(&mut self, i: usize, id: BorrowId, op: Op) -> Result<(), String> {
        let local = self.local(i);
        let (me, client) = (Node::Server(i), Node::Client(op.client));
        let s = &mut self.servers[i];
        if already_applied(s, &op, local) {
            self.send(me, client, Msg::ClientOk(op.id));
            return self.leave_borrow(i, id);
        }
        let Some(p) = s.p.as_mut() else {
            return Ok(());
        };
        if p.admit(&op.tables, local) == Admit::Ok {
            s.load.admitted(op.tables[0]);
            s.admitted.push((op, Some(id)));
            return Ok(());
        }
        self.send(me, client, not_ready(&op));
        self.leave_borrow(i, id)
    }

    /// One operation is done with borrow `id`; the last one returns it.
    fn leave_borrow(&mut self, i: usize, id: BorrowId) -> Result<(), String> {
        let local = self.local(i);
        let s = &mut self.servers[i];
        if !s.borrows.leave(id) {
            return Ok(());
        }
        let acts = match s.p.as_mut() {
            Some(p) => p.borrow_done(id, local),
            None => Vec::new(),
        };
        self.actions(i, acts)
    }

    fn server_tick(&mut self, i: usize) -> Result<(), String> {
        let now = self.local(i);
        let Some(p) = self.servers[i].p.as_mut() else {
            return Ok(());
        };
        let acts = p.tick(now);
        self.actions(i, acts)?;
        self.report_load(i)?;
        let s = &mut self.servers[i];
        let Some(p) = s.p.as_ref() else {
            return Ok(());
        };
        let (Some(inc), true) = (p.incarnation(), p.can_ack(now)) else {
            return Ok(());
        };
        // Execute some admitted operations: apply in memory, append to the journal. Like
        // the real server's, an operation leaves its borrow once it ran and ends (and may
        // complete a drain) once its record is durable.
        let admitted = std::mem::take(&mut s.admitted);
        let mut left = Vec::new();
        for (op, b) in admitted {
            if self.rng.chance(500) {
                s.admitted.push((op, b));
                continue;
            }
            for t in &op.tables {
                if let Some(v) = s.mem.get_mut(t) {
                    v.push(op.id);
                }
            }
            s.next_lsn += 1;
            let rec = Rec {
                lsn: s.next_lsn,
                op: op.id,
                tables: op.tables.clone(),
            };
            self.store.append(inc, rec);
            s.ends.wait(s.next_lsn, op);
            left.extend(b);
        }
        for b in left {
            self.leave_borrow(i, b)?;
        }
        let s = &mut self.servers[i];
        // Group commit: one sync acknowledges every executed operation.
        if s.ends.is_empty() || !self.rng.chance(500) {
            return Ok(());
        }
        self.dirty = true;
        if let Err(e) = self.store.sync(inc) {
            let _ = e;
            return self.fenced(i);
        }
        let done = s.ends.durable(s.next_lsn);
        let mut acts = Vec::new();
        for op in done {
            let Some(p) = s.p.as_mut() else { break };
            if p.can_ack(now) {
                self.acked.insert(op.id, op.tables.clone());
                let to = Node::Client(op.client);
                let delay = self.rng.range(1, 40);
                self.seq += 1;
                self.events.insert(
                    (self.now + delay, self.seq),
                    Ev::Deliver {
                        from: Node::Server(i),
                        to,
                        msg: Msg::ClientOk(op.id),
                    },
                );
            }
            acts.extend(p.end_op(&op.tables));
        }
        self.actions(i, acts)
    }

    /// Every [`LOAD_REPORT_EVERY_MS`], as the real server does: each held table's
    /// operations admitted since the last report and its size (its operations here).
    fn report_load(&mut self, i: usize) -> Result<(), String> {
        let now = self.local(i);
        let s = &mut self.servers[i];
        let Some(p) = s.p.as_mut() else {
            return Ok(());
        };
        if now < s.last_load_ms.saturating_add(LOAD_REPORT_EVERY_MS) {
            return Ok(());
        }
        s.last_load_ms = now;
        let sizes = s.mem.iter().map(|(t, ops)| (*t, ops.len() as u64));
        let loads = std::mem::take(&mut s.load).report(sizes, &p.tables());
        if loads.is_empty() {
            return Ok(());
        }
        let acts = p.report_load(loads);
        self.actions(i, acts)
    }

    fn fenced(&mut self, i: usize) -> Result<(), String> {
        self.stats.fences += 1;
        self.crash(i);
        self.restart(i);
        Ok(())
    }

    fn actions(&mut self, i: usize, acts: Vec<Action>) -> Result<(), String> {
        let me = Node::Server(i);
        for a in acts {
            match a {
                Action::ToCoord { req_id, req } => {
                    self.send(me, Node::Coord, Msg::Req { req_id, req })
                }
                Action::Reply(r) => self.send(me, Node::Coord, Msg::CtlReply(r)),
                Action::Load { tables, epochs } => {
                    let r = self.load(i, &tables, &epochs);
                    if self.cfg.trace {
                        eprintln!("{} server {i} load {tables:?}: {r:?}", self.now);
                    }
                    let acts = match self.servers[i].p.as_mut() {
                        Some(p) => p.loaded(&tables, r.map(|()| Vec::new())),
                        None => Vec::new(),
                    };
                    self.actions(i, acts)?;
                }
                Action::Checkpoint { table } => {
                    let r = self.checkpoint(i, table);
                    let acts = match self.servers[i].p.as_mut() {
                        Some(p) => p.checkpointed(table, r),
                        None => Vec::new(),
                    };
                    self.actions(i, acts)?;
                }
                Action::RunBorrowed { id } => {
                    let local = self.local(i);
                    match self.servers[i].borrows.granted(id, local) {
                        Granted::Run(ops) => {
                            for op in ops {
                                self.run_borrowed(i, id, op)?;
                            }
                        }
                        Granted::Return => {
                            let acts = match self.servers[i].p.as_mut() {
                                Some(p) => p.borrow_done(id, local),
                                None => Vec::new(),
                            };
                            self.actions(i, acts)?;
                        }
                    }
                }
                Action::BorrowFailed { id } => {
                    for op in self.servers[i].borrows.failed(id) {
                        self.send(me, Node::Client(op.client), not_ready(&op));
                    }
                }
                Action::Fence => return self.fenced(i),
                // The simulated servers keep no inode ranges to cut; nothing here asks.
                Action::Split { table, .. } => {
                    let r = Ok(crate::participant::SplitOutcome::Refused(
                        "the simulation does not split tables".into(),
                    ));
                    let acts = match self.servers[i].p.as_mut() {
                        Some(p) => p.split_done(table, r),
                        None => Vec::new(),
                    };
                    self.actions(i, acts)?;
                }
            }
        }
        Ok(())
    }

    /// ADD / recovery: read each manifest, seal and replay a fenced journal it names,
    /// write a manifest naming this incarnation. What each table takes is the real
    /// server's decision ([`LoadPlan`]).
    fn load(&mut self, i: usize, tables: &[TableId], epochs: &[Incarnation]) -> Result<(), String> {
        let s = &self.servers[i];
        let me =
            s.p.as_ref()
                .and_then(|p| p.incarnation())
                .ok_or("not live")?;
        // First check every table, writing nothing: a load that fails half-way would leave
        // manifests naming a server that does not serve them.
        let mut plan = LoadPlan::new(Owner::from(me), epochs);
        let mut claims = Vec::new();
        for t in tables {
            let m = self.store.manifests.get(t).cloned();
            let owner = m
                .as_ref()
                .and_then(|m| m.replay)
                .map(|(j, _)| Owner::from(j));
            let claim = plan
                .claim(*t, owner, || s.mem.contains_key(t))
                .map_err(|e| e.to_string())?;
            claims.push((*t, m, claim));
        }
        let mut loaded = Vec::new();
        for (t, m, claim) in claims {
            if claim == Claim::Earlier {
                continue;
            }
            let version = m.as_ref().map(|m| m.version);
            let mut ops = m.as_ref().map(|m| m.ops.clone()).unwrap_or_default();
            if let Claim::Recover(_) = claim
                && let Some((j, from)) = m.and_then(|m| m.replay)
            {
                if self.cfg.broken != Some(Break::Fencing) {
                    self.store.seal(j);
                }
                ops.extend(self.store.replay(j, from, t));
            }
            let new = Manifest {
                version: 0,
                owner: me,
                ops: ops.clone(),
                replay: Some((me, self.servers[i].next_lsn + 1)),
            };
            self.store.cas_manifest(t, version, new, me)?;
            self.dirty = true;
            loaded.push((t, ops));
        }
        self.servers[i].mem.extend(loaded);
        Ok(())
    }

    /// DROP's clean checkpoint: only the owner named by the manifest may write it.
    fn checkpoint(&mut self, i: usize, t: TableId) -> Result<(), String> {
        let s = &mut self.servers[i];
        let me =
            s.p.as_ref()
                .and_then(|p| p.incarnation())
                .ok_or("not live")?;
        let cur = self.store.manifests.get(&t).ok_or("no manifest")?;
        if cur.owner != me {
            return Err(format!("{:#x} is not ours", t.0));
        }
        let version = cur.version;
        let ops = s.mem.remove(&t).unwrap_or_default();
        let new = Manifest {
            version: 0,
            owner: me,
            ops,
            replay: None,
        };
        self.dirty = true;
        self.store.cas_manifest(t, Some(version), new, me)
    }

    /// Client `c`'s next attempt, when it is due: the last one went unanswered (the route
    /// is stale), or route the operation and send it, or fetch a map.
    fn client_tick(&mut self, c: usize) -> Result<(), String> {
        let now = self.now;
        let cl = &mut self.clients[c];
        if cl.cur.is_none() {
            let Some(op) = cl.ops.pop_front() else {
                return Ok(());
            };
            cl.cur = Some(Current::new(op, now));
        }
        let Some(cur) = cl.cur.as_mut() else {
            return Ok(());
        };
        if now < cur.next_try {
            return Ok(());
        }
        let table = cur.op.tables[0];
        if let Some((_, routed_by)) = cur.sent.take() {
            cl.router.on_unreachable(Some(table), routed_by);
            return self.client_failed(c);
        }
        let routed_by = cl.router.map_version();
        match cl.router.route(table) {
            Route::Server { id, .. } => {
                cur.next_try = now + ATTEMPT_TIMEOUT_MS;
                cur.sent = Some((id, routed_by));
                let op = cur.op.clone();
                let to = Node::Server(id.0 as usize);
                self.send(Node::Client(c), to, Msg::ClientOp(op));
            }
            Route::FetchMap { .. } if cur.retries.fetch() => {
                cur.next_try = now + FETCH_TIMEOUT_MS;
                self.send(Node::Client(c), Node::Coord, Msg::GetMap);
            }
            // The map fetched since the last failure did not place the table, or never came.
            Route::FetchMap { .. } => return self.client_failed(c),
        }
        Ok(())
    }

    /// Client `c`'s attempt failed: pause as the retry policy says, or give up.
    fn client_failed(&mut self, c: usize) -> Result<(), String> {
        let now = self.now;
        let Some(cur) = self.clients[c].cur.as_mut() else {
            return Ok(());
        };
        cur.sent = None;
        match cur.retries.failed(now) {
            Retry::After { delay_ms } => cur.next_try = now + delay_ms,
            Retry::GiveUp => {
                // A storm of faults may outlast one retry budget (a client-visible error,
                // which the application retries); after the faults stop it must not happen.
                if cur
                    .retries
                    .since_ms()
                    .is_some_and(|t| t >= self.cfg.fault_end_ms)
                {
                    return Err(format!("client {c} gave up on op {}", cur.op.id));
                }
                self.stats.client_errors += 1;
                cur.retries = Retries::new(RetryPolicy::default());
                cur.next_try = now;
            }
        }
        Ok(())
    }

    /// An answer reached client `c` from `from`. A server's answer counts only for the
    /// attempt that awaits it (a late duplicate of an earlier one does not), except a
    /// success, which ends the operation whichever attempt it answers.
    fn client_msg(&mut self, c: usize, from: Node, msg: Msg) -> Result<(), String> {
        let now = self.now;
        let cl = &mut self.clients[c];
        let awaited = |cur: &Current, op: OpId| match cur.sent {
            Some((s, routed_by)) if cur.op.id == op && from == Node::Server(s.0 as usize) => {
                Some((s, routed_by))
            }
            _ => None,
        };
        match msg {
            Msg::Map(m) => {
                cl.router.on_map(m);
                if let Some(cur) = cl.cur.as_mut()
                    && cur.retries.fetched()
                    && cur.sent.is_none()
                {
                    cur.next_try = now;
                }
            }
            Msg::ClientOk(op) if cl.cur.as_ref().is_some_and(|c| c.op.id == op) => {
                cl.cur = None;
            }
            Msg::ClientWrong { op, table, owner } => {
                let Some(cur) = cl.cur.as_mut() else {
                    return Ok(());
                };
                let Some((server, routed_by)) = awaited(cur, op) else {
                    return Ok(());
                };
                cl.router
                    .on_wrong_server(Some(table), routed_by, owner, None);
                // Named a new owner elsewhere: go there at once, a few times.
                if owner.is_some_and(|o| o != server) && cur.retries.follow_hint() {
                    cur.sent = None;
                    cur.next_try = now;
                    return Ok(());
                }
                return self.client_failed(c);
            }
            _ => {}
        }
        Ok(())
    }

    /// The invariants, after every step.
    fn check(&mut self) -> Result<(), String> {
        let now = self.now;
        // No two servers serve one table at any instant: the servers that could act now,
        // each with its clock and the tables of its operations not ended yet.
        let mut active = Vec::new();
        for (i, s) in self.servers.iter().enumerate() {
            let Some(p) = s.p.as_ref() else { continue };
            let local = self.local(i);
            if s.paused_until > now || !p.can_ack(local) {
                continue;
            }
            active.push((s.id.0, p, local, s.busy_tables()));
        }
        for k in 0..self.cfg.tables as u64 {
            let t = TableId(k << 20);
            let serving = |(_, p, local, busy): &&(u32, &Participant, u64, Vec<TableId>)| {
                p.serves(t, *local) || busy.contains(&t)
            };
            if active.iter().filter(serving).nth(1).is_some() {
                let who: Vec<u32> = active.iter().filter(serving).map(|a| a.0).collect();
                return Err(format!(
                    "table {:#x} served by servers {who:?} at once",
                    t.0
                ));
            }
        }
        if let Some(v) = self.store.violations.first() {
            return Err(v.clone());
        }
        if !self.dirty {
            return Ok(());
        }
        self.dirty = false;
        // Every acknowledged operation is durable exactly once in each of its tables.
        let mut views: BTreeMap<TableId, BTreeMap<OpId, usize>> = BTreeMap::new();
        for k in 0..self.cfg.tables as u64 {
            let t = TableId(k << 20);
            let mut count = BTreeMap::new();
            for op in self.store.durable_view(t) {
                *count.entry(op).or_insert(0) += 1;
            }
            if let Some((op, n)) = count.iter().find(|(_, n)| **n > 1) {
                return Err(format!("op {op} is {n} times in table {:#x}", t.0));
            }
            views.insert(t, count);
        }
        for (op, tables) in &self.acked {
            for t in tables {
                if views.get(t).and_then(|v| v.get(op)).is_none() {
                    return Err(format!("acknowledged op {op} lost from table {:#x}", t.0));
                }
            }
        }
        Ok(())
    }
}

/// Runs `n` seeds from `first`, each with the default config changed by `adjust`; the
/// first failure stops.
pub fn run_seeds(
    first: u64,
    n: u64,
    adjust: impl Fn(&mut SimConfig),
) -> Result<Vec<SimStats>, String> {
    each_seed(first, n, SimConfig::new, adjust, run)
}

/// Runs seeds `first..first + n` in order, each with the config `config(seed)` changed by
/// `adjust`, through `run`; the first failure stops. (Every simulation of this crate.)
pub fn each_seed<C, S>(
    first: u64,
    n: u64,
    config: impl Fn(u64) -> C,
    adjust: impl Fn(&mut C),
    run: impl Fn(C) -> Result<S, String>,
) -> Result<Vec<S>, String> {
    let mut out = Vec::new();
    for seed in first..first + n {
        let mut cfg = config(seed);
        adjust(&mut cfg);
        out.push(run(cfg)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::Epoch;

    fn inc(s: u32, e: u64) -> Incarnation {
        Incarnation {
            server: ServerId(s),
            epoch: Epoch(e),
        }
    }

    fn rec(lsn: u64, op: OpId) -> Rec {
        Rec {
            lsn,
            op,
            tables: vec![TableId(0)],
        }
    }

    fn manifest(owner: Incarnation, replay: Option<(Incarnation, u64)>) -> Manifest {
        Manifest {
            version: 0,
            owner,
            ops: vec![],
            replay,
        }
    }

    #[test]
    fn store_loses_unsynced_writes_and_refuses_a_sealed_journal() {
        let mut st = SimStore::default();
        let a = inc(1, 1);
        let b = inc(2, 1);
        st.cas_manifest(TableId(0), None, manifest(a, Some((a, 1))), a)
            .unwrap();
        st.append(a, rec(1, 7));
        st.sync(a).unwrap();
        st.append(a, rec(2, 8));
        st.crash(a);
        assert_eq!(st.durable_view(TableId(0)), vec![7]);
        // Taking over without sealing is flagged; with the seal it is not.
        st.seal(a);
        st.append(a, rec(3, 9));
        assert!(
            st.sync(a).is_err(),
            "a fenced writer cannot make anything durable"
        );
        assert!(
            st.cas_manifest(TableId(0), Some(1), manifest(a, None), a)
                .is_err(),
            "a fenced writer cannot checkpoint"
        );
        assert!(
            st.cas_manifest(TableId(0), Some(7), manifest(b, Some((b, 1))), b)
                .is_err(),
            "stale version"
        );
        st.cas_manifest(TableId(0), Some(1), manifest(b, Some((b, 1))), b)
            .unwrap();
        assert!(st.violations.is_empty());
        let c = inc(3, 1);
        st.cas_manifest(TableId(0), Some(2), manifest(c, None), c)
            .unwrap();
        assert_eq!(st.violations.len(), 1, "b's journal was not sealed");
    }

    #[test]
    fn a_seed_replays_exactly() {
        let a = run(SimConfig::new(7)).unwrap();
        let b = run(SimConfig::new(7)).unwrap();
        assert_eq!(
            (a.events, a.end_ms, a.fences),
            (b.events, b.end_ms, b.fences)
        );
    }
}
