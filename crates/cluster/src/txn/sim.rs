//! A seeded, deterministic simulation of the transaction protocol: sites (a server's
//! journal, its tables as a key-value map, its initiator and participant) hosted by
//! processes, clients moving entries between sites' directories (a cross-server rename,
//! sometimes with a third site's entry), a network that drops, duplicates, delays and
//! reorders, partitions, and crashes at random times and right after chosen steps (an
//! append, a record turning durable). A crash loses the site's volatile state and any
//! unsynced tail of its journal past a random prefix; the site comes back on its own
//! process, or another process adopts its journal (failover) and answers for it.
//!
//! What runs is the real [`Initiator`] and [`Participant`]; only the network, the journal
//! and the tables are models. The checks, each made where the fact it guards appears:
//! nothing is applied before its commit is durable, applied twice, or applied without
//! its locks; no attempt commits after one of its participants voted no or discarded
//! it, and none is discarded once committed; one request
//! commits at most one attempt; a commit is forgotten only once every participant made it
//! durable; a client is told "committed" only after the commit is durable, and every
//! answer to one (client, seq) is the same; a client that was told "committed" and then
//! reads a changed key outside any transaction (waiting while it is locked) finds the
//! commit applied there. At the end, with faults stopped, the run must
//! settle: every request answered, every initiator and participant idle (no lock left,
//! nothing in doubt: no deadlock), every commit applied at all its participants and
//! no abort anywhere (all or nothing), every entry in exactly one directory, and each
//! request asked again gets its first answer.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kochab_proto::cluster::ServerId;

use super::initiator::{self, Initiator};
use super::participant::{self, Participant};
use super::{
    Decision, Effect, Expect, Key, Msg, NoVote, Outcome, Part, Plan, Record, TxnConfig, TxnId,
    Write, expect_holds,
};
use crate::sim::Rng;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Sites, and processes (one per site at the start).
    pub sites: usize,
    pub clients: usize,
    pub ops_per_client: usize,
    /// Entries that move between the sites' directories.
    pub tokens: usize,
    /// Share of moves that also create a marker entry at a third site, per mille.
    pub three_permille: u64,
    /// Share of requests sent to a random site rather than the entry's (often an
    /// initiator that is not a participant), per mille.
    pub foreign_origin_permille: u64,
    /// Chance of a crash right after an append or a record turning durable, per mille.
    pub crash_step_permille: u64,
    /// Share of crashed sites adopted by another process rather than restarted, per
    /// mille.
    pub failover_permille: u64,
    /// Faults happen before this time; after it the run must settle.
    pub fault_end_ms: u64,
    pub txn: TxnConfig,
    /// Print every event but ticks (for replaying a failing seed).
    pub trace: bool,
}

impl SimConfig {
    /// The default mix for `seed`.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            sites: 4,
            clients: 4,
            ops_per_client: 8,
            tokens: 6,
            three_permille: 300,
            foreign_origin_permille: 200,
            crash_step_permille: 15,
            failover_permille: 500,
            fault_end_ms: 4_000,
            txn: TxnConfig::default(),
            trace: false,
        }
    }
}

/// What a passing run did.
#[derive(Clone, Debug, Default)]
pub struct SimStats {
    pub events: u64,
    pub committed: u64,
    pub refused: u64,
    /// Requests answered Busy (then asked again).
    pub busy: u64,
    /// Attempts that died (wait-die, wait limit, prepare timeout).
    pub died: u64,
    pub inquiries: u64,
    /// Reads by clients of what they were told is committed, and of them how many
    /// found the key locked at first.
    pub reads: u64,
    pub reads_waited: u64,
    pub crashes: u64,
    pub failovers: u64,
    /// Crashes by the step they followed.
    pub crash_points: BTreeMap<&'static str, u64>,
    pub end_ms: u64,
}

/// After faults stop, everything must settle within this.
const SETTLE_MS: u64 = 30_000;
const TICK_MS: u64 = 50;
const CLIENT_TICK_MS: u64 = 100;
/// A client asks again after this long without an answer.
const CLIENT_RETRY_MS: u64 = 500;

#[derive(Clone, Debug)]
enum Ev {
    /// A client told "committed" reads a key the commit changed at one participant: an
    /// operation outside any transaction, which waits while the key is locked.
    Read {
        client: usize,
        site: usize,
        key: Key,
        txn: TxnId,
    },
    Tick(usize),
    ClientTick(usize),
    Deliver {
        from: usize,
        to: usize,
        msg: Msg,
    },
    Request {
        client: usize,
        site: usize,
        seq: u64,
    },
    Reply {
        client: usize,
        seq: u64,
        outcome: Outcome,
    },
    Sync(usize),
    Crash(usize, &'static str),
    Restart(usize),
    Adopt {
        site: usize,
        proc: usize,
    },
    Isolate {
        proc: usize,
        until_ms: u64,
    },
}

#[derive(Clone, Debug)]
enum Input {
    Init(initiator::Event),
    Part(participant::Event),
}

#[derive(Default)]
struct Journal {
    durable: Vec<Record>,
    pending: Vec<Record>,
}

struct Up {
    init: Initiator,
    part: Participant,
    kv: BTreeMap<Key, Vec<u8>>,
    applied: BTreeSet<TxnId>,
}

struct Site {
    journal: Journal,
    epoch: u64,
    host: usize,
    up: Option<Up>,
    sync_scheduled: bool,
    genesis: BTreeMap<Key, Vec<u8>>,
}

struct Proc {
    up: bool,
    isolated_until_ms: u64,
}

#[derive(Default)]
struct Client {
    ops_left: usize,
    next_seq: u64,
    /// The request in progress and when it was last sent.
    cur: Option<(u64, u64)>,
    /// Every request's origin site and plan (a retry resends the same).
    plans: BTreeMap<u64, (usize, Plan)>,
    answers: BTreeMap<u64, Outcome>,
}

struct World {
    cfg: SimConfig,
    rng: Rng,
    now: u64,
    seq: u64,
    events: BTreeMap<(u64, u64), Ev>,
    sites: Vec<Site>,
    procs: Vec<Proc>,
    clients: Vec<Client>,
    /// Where each token was last put (the clients' guess when planning).
    where_is: Vec<usize>,
    /// Durable commit decisions: participants.
    commits: BTreeMap<TxnId, Vec<ServerId>>,
    /// Requests with a durable decision: the attempt and whether it commits.
    decided: BTreeMap<(u64, u64), (TxnId, Decision)>,
    /// No votes of the participants' live incarnations.
    voted_no: BTreeSet<(ServerId, TxnId)>,
    /// Prepared attempts a participant ended without applying (its abort record).
    discarded: BTreeSet<(ServerId, TxnId)>,
    /// Per site, commits whose outcome record is durable there.
    durable_applied: Vec<BTreeSet<TxnId>>,
    stats: SimStats,
}

/// Runs one seed; `Err` names the seed and the first broken invariant.
pub fn run(cfg: SimConfig) -> Result<SimStats, String> {
    let seed = cfg.seed;
    let mut w = World::new(cfg);
    w.run()
        .map_err(|e| format!("TXN_SIM_SEED={seed}: at {} ms: {e}", w.now))
}

/// Runs `n` seeds from `first`, each with the default config changed by `adjust`; the
/// first failure stops.
pub fn run_seeds(
    first: u64,
    n: u64,
    adjust: impl Fn(&mut SimConfig),
) -> Result<Vec<SimStats>, String> {
    crate::sim::each_seed(first, n, SimConfig::new, adjust, run)
}

fn dir(site: usize) -> u64 {
    1_000 + site as u64
}

fn token_key(site: usize, token: usize) -> Key {
    Key::Entry {
        parent: dir(site),
        name: format!("t{token}").into_bytes(),
    }
}

fn sid(site: usize) -> ServerId {
    ServerId(site as u32)
}

impl World {
    fn new(cfg: SimConfig) -> World {
        let mut rng = Rng::new(cfg.seed);
        let mut where_is = Vec::new();
        let mut genesis = vec![BTreeMap::new(); cfg.sites];
        for t in 0..cfg.tokens {
            let s = rng.range(0, cfg.sites as u64 - 1) as usize;
            genesis[s].insert(token_key(s, t), t.to_le_bytes().to_vec());
            where_is.push(s);
        }
        let sites = genesis
            .into_iter()
            .enumerate()
            .map(|(i, g)| Site {
                journal: Journal::default(),
                epoch: 1,
                host: i,
                up: Some(Up {
                    init: Initiator::new(sid(i), 1, cfg.txn),
                    part: Participant::new(sid(i), cfg.txn),
                    kv: g.clone(),
                    applied: BTreeSet::new(),
                }),
                sync_scheduled: false,
                genesis: g,
            })
            .collect();
        let procs = (0..cfg.sites)
            .map(|_| Proc {
                up: true,
                isolated_until_ms: 0,
            })
            .collect();
        let clients = (0..cfg.clients)
            .map(|_| Client {
                ops_left: cfg.ops_per_client,
                ..Client::default()
            })
            .collect();
        let mut w = World {
            rng,
            now: 0,
            seq: 0,
            events: BTreeMap::new(),
            sites,
            procs,
            clients,
            where_is,
            commits: BTreeMap::new(),
            decided: BTreeMap::new(),
            voted_no: BTreeSet::new(),
            discarded: BTreeSet::new(),
            durable_applied: vec![BTreeSet::new(); cfg.sites],
            stats: SimStats::default(),
            cfg,
        };
        w.schedule_start();
        w
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.insert((t, self.seq), ev);
    }

    fn schedule_start(&mut self) {
        for s in 0..self.cfg.sites {
            let t = self.rng.range(0, TICK_MS);
            self.at(t, Ev::Tick(s));
        }
        for c in 0..self.cfg.clients {
            let t = self.rng.range(0, CLIENT_TICK_MS);
            self.at(t, Ev::ClientTick(c));
        }
        let end = self.cfg.fault_end_ms;
        let n = self.sites.len() as u64;
        if end <= 100 {
            return; // A run without faults.
        }
        for _ in 0..self.rng.range(1, 4) {
            let t = self.rng.range(100, end);
            let p = self.rng.range(0, n - 1) as usize;
            self.at(t, Ev::Crash(p, "any time"));
        }
        for _ in 0..self.rng.range(0, 2) {
            let t = self.rng.range(100, end);
            let proc = self.rng.range(0, n - 1) as usize;
            let until_ms = t + self.rng.range(200, 1_500);
            self.at(t, Ev::Isolate { proc, until_ms });
        }
    }

    fn faulty(&self) -> bool {
        self.now < self.cfg.fault_end_ms
    }

    fn reachable(&self, site: usize) -> bool {
        let p = &self.procs[self.sites[site].host];
        p.up && p.isolated_until_ms <= self.now && self.sites[site].up.is_some()
    }

    /// Puts `ev` on the network: maybe lost, maybe duplicated, delayed.
    fn net(&mut self, ev: Ev) {
        if self.faulty() && self.rng.chance(30) {
            return;
        }
        if self.faulty() && self.rng.chance(30) {
            let d = self.rng.range(1, 1_500);
            self.at(self.now + d, ev.clone());
        }
        let d = if self.faulty() && self.rng.chance(20) {
            self.rng.range(50, 500)
        } else {
            self.rng.range(1, 20)
        };
        self.at(self.now + d, ev);
    }

    fn run(&mut self) -> Result<SimStats, String> {
        let deadline = self.cfg.fault_end_ms + SETTLE_MS;
        while let Some(((t, _), ev)) = self.events.pop_first() {
            self.now = t;
            if t > deadline {
                return Err(format!(
                    "not settled after faults stopped: {}",
                    self.pending()
                ));
            }
            self.stats.events += 1;
            if self.cfg.trace && !matches!(ev, Ev::Tick(_) | Ev::ClientTick(_)) {
                eprintln!("{t} {ev:?}");
            }
            self.step(ev)?;
            if !self.faulty() && self.settled() {
                self.final_checks()?;
                self.stats.end_ms = self.now;
                return Ok(self.stats.clone());
            }
        }
        Err("ran out of events".into())
    }

    fn settled(&self) -> bool {
        self.clients
            .iter()
            .all(|c| c.ops_left == 0 && c.cur.is_none())
            && self.procs.iter().all(|p| p.up)
            && self.sites.iter().all(|s| {
                s.up.as_ref()
                    .is_some_and(|u| u.init.active() == 0 && u.part.idle())
            })
    }

    fn pending(&self) -> String {
        let mut out = String::new();
        for (i, c) in self.clients.iter().enumerate() {
            if c.ops_left > 0 || c.cur.is_some() {
                out += &format!("client {i}: {} left, current {:?}; ", c.ops_left, c.cur);
            }
        }
        for (i, s) in self.sites.iter().enumerate() {
            match &s.up {
                None => out += &format!("site {i} down; "),
                Some(u) => {
                    let (txns, doubt) = u.part.load();
                    let (keys, waiting) = u.part.locks().load();
                    if u.init.active() > 0 || txns > 0 || keys > 0 || waiting > 0 {
                        out += &format!(
                            "site {i}: {} initiating, {txns} participating ({doubt} in \
                             doubt), {keys} keys locked, {waiting} waiting; ",
                            u.init.active()
                        );
                    }
                }
            }
        }
        out
    }

    fn step(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Tick(s) => {
                self.at(self.now + TICK_MS, Ev::Tick(s));
                self.input(s, Input::Init(initiator::Event::Tick))?;
                self.input(s, Input::Part(participant::Event::Tick))
            }
            Ev::ClientTick(c) => self.client_tick(c),
            Ev::Read {
                client,
                site,
                key,
                txn,
            } => self.read(client, site, key, txn),
            Ev::Deliver { from, to, msg } => {
                let cut = self.procs[self.sites[from].host].isolated_until_ms > self.now;
                if !self.reachable(to) || cut && self.faulty() {
                    return Ok(());
                }
                if matches!(msg, Msg::Inquiry { .. }) {
                    self.stats.inquiries += 1;
                }
                let from = sid(from);
                let input = if msg.to_initiator() {
                    Input::Init(initiator::Event::Message { from, msg })
                } else {
                    Input::Part(participant::Event::Message { from, msg })
                };
                self.input(to, input)
            }
            Ev::Request { client, site, seq } => {
                if !self.reachable(site) {
                    return Ok(());
                }
                let Some((_, plan)) = self.clients[client].plans.get(&seq).cloned() else {
                    return Err(format!("client {client} has no request {seq}"));
                };
                let ev = initiator::Event::Request {
                    client: client as u64,
                    seq,
                    plan,
                };
                self.input(site, Input::Init(ev))
            }
            Ev::Reply {
                client,
                seq,
                outcome,
            } => self.client_reply(client, seq, outcome),
            Ev::Sync(s) => self.sync(s),
            Ev::Crash(p, why) => {
                self.crash(p, why);
                Ok(())
            }
            Ev::Restart(p) => {
                self.procs[p].up = true;
                for s in 0..self.sites.len() {
                    if self.sites[s].host == p && self.sites[s].up.is_none() {
                        self.recover(s)?;
                    }
                }
                Ok(())
            }
            Ev::Adopt { site, proc } => {
                let old = self.sites[site].host;
                if self.sites[site].up.is_none() && !self.procs[old].up && self.procs[proc].up {
                    self.sites[site].host = proc;
                    self.stats.failovers += 1;
                    self.recover(site)?;
                }
                Ok(())
            }
            Ev::Isolate { proc, until_ms } => {
                self.procs[proc].isolated_until_ms = until_ms;
                Ok(())
            }
        }
    }

    /// Feeds one input to site `s` and everything it leads to there.
    fn input(&mut self, s: usize, first: Input) -> Result<(), String> {
        let mut queue = VecDeque::from([first]);
        while let Some(input) = queue.pop_front() {
            let now = self.now;
            let Some(up) = self.sites[s].up.as_mut() else {
                return Ok(());
            };
            let effects = match input {
                Input::Init(ev) => up.init.step(ev, now),
                Input::Part(ev) => up.part.step(ev, now),
            };
            for e in effects {
                if let Some(next) = self.effect(s, e)? {
                    queue.push_back(next);
                }
                if self.sites[s].up.is_none() {
                    return Ok(()); // Crashed right after that step.
                }
            }
        }
        Ok(())
    }

    fn effect(&mut self, s: usize, e: Effect) -> Result<Option<Input>, String> {
        match e {
            Effect::Send { to, msg } => {
                if let Msg::Vote { txn, no: Some(no) } = &msg {
                    if *no == NoVote::Died {
                        self.stats.died += 1;
                    }
                    if self.commits.contains_key(txn) {
                        return Err(format!("site {s} voted no on committed {txn:?}"));
                    }
                    self.voted_no.insert((sid(s), *txn));
                }
                let to = to.0 as usize;
                if to >= self.sites.len() {
                    return Err(format!("message to unknown site {to}"));
                }
                if self.reachable(s) || !self.faulty() {
                    self.net(Ev::Deliver { from: s, to, msg });
                }
            }
            Effect::Append(r) => {
                match &r {
                    Record::Forgotten { txn } => self.check_forgettable(*txn)?,
                    Record::Applied { txn, commit: false } => {
                        if self.commits.contains_key(txn) {
                            return Err(format!("site {s} discards committed {txn:?}"));
                        }
                        self.discarded.insert((sid(s), *txn));
                    }
                    _ => {}
                }
                let why = match &r {
                    Record::Prepared { .. } | Record::Adopted { .. } => "append prepared",
                    Record::Decided { .. } => "append decided",
                    Record::Applied { .. } => "append applied",
                    Record::Forgotten { .. } => "append forgotten",
                };
                self.sites[s].journal.pending.push(r);
                if !self.sites[s].sync_scheduled {
                    self.sites[s].sync_scheduled = true;
                    let d = self.rng.range(1, 10);
                    self.at(self.now + d, Ev::Sync(s));
                }
                self.maybe_crash(s, why);
            }
            Effect::Check { txn, part } => {
                let Some(up) = self.sites[s].up.as_ref() else {
                    return Ok(None);
                };
                let ok = part
                    .mutations
                    .iter()
                    .all(|m| expect_holds(m, up.kv.contains_key(&m.key)));
                return Ok(Some(Input::Part(participant::Event::Checked { txn, ok })));
            }
            Effect::Apply { txn, mutations } => {
                if !self.commits.contains_key(&txn) {
                    return Err(format!(
                        "site {s} applies {txn:?} before its commit is durable"
                    ));
                }
                let Some(up) = self.sites[s].up.as_ref() else {
                    return Ok(None);
                };
                if let Some(m) = mutations
                    .iter()
                    .find(|m| !up.part.locks().holds_key(txn, &m.key))
                {
                    return Err(format!("site {s} applies {txn:?} to {:?} unlocked", m.key));
                }
                self.apply(s, txn, &mutations)?;
            }
            Effect::Released { .. } => {}
            Effect::Reply {
                client,
                seq,
                outcome,
            } => {
                if outcome == Outcome::Committed
                    && !matches!(
                        self.decided.get(&(client, seq)),
                        Some((_, Decision::Commit))
                    )
                {
                    return Err(format!(
                        "client {client} request {seq} told committed without a durable commit"
                    ));
                }
                let client = client as usize;
                self.net(Ev::Reply {
                    client,
                    seq,
                    outcome,
                });
            }
        }
        Ok(None)
    }

    /// Applies a commit's mutations to site `s`'s tables (live, or replayed by recovery).
    fn apply(&mut self, s: usize, txn: TxnId, mutations: &[super::Mutation]) -> Result<(), String> {
        let Some(up) = self.sites[s].up.as_mut() else {
            return Ok(());
        };
        if !up.applied.insert(txn) {
            return Err(format!("site {s} applies {txn:?} twice"));
        }
        for m in mutations {
            if !expect_holds(m, up.kv.contains_key(&m.key)) {
                return Err(format!(
                    "site {s}: {txn:?} finds {:?} changed since its check",
                    m.key
                ));
            }
            match &m.write {
                Write::Put(v) => {
                    up.kv.insert(m.key.clone(), v.clone());
                    if let Some(t) = v.get(..8).and_then(|b| b.try_into().ok()) {
                        let t = usize::from_le_bytes(t);
                        if t < self.where_is.len() {
                            self.where_is[t] = s;
                        }
                    }
                }
                Write::Delete => {
                    up.kv.remove(&m.key);
                }
            }
        }
        Ok(())
    }

    /// A commit may be forgotten only once every participant made it durable (else one
    /// that crashes asks, and is told "abort").
    fn check_forgettable(&self, txn: TxnId) -> Result<(), String> {
        let Some(parts) = self.commits.get(&txn) else {
            return Err(format!("{txn:?} forgotten without a durable commit"));
        };
        for p in parts {
            if !self.durable_applied[p.0 as usize].contains(&txn) {
                return Err(format!(
                    "{txn:?} forgotten while site {} has not made it durable",
                    p.0
                ));
            }
        }
        Ok(())
    }

    fn maybe_crash(&mut self, s: usize, why: &'static str) {
        if self.faulty() && self.rng.chance(self.cfg.crash_step_permille) {
            let p = self.sites[s].host;
            self.crash(p, why);
        }
    }

    fn sync(&mut self, s: usize) -> Result<(), String> {
        self.sites[s].sync_scheduled = false;
        if self.sites[s].up.is_none() {
            return Ok(());
        }
        let records = std::mem::take(&mut self.sites[s].journal.pending);
        for r in &records {
            self.durable(s, r)?;
        }
        self.sites[s]
            .journal
            .durable
            .extend(records.iter().cloned());
        for r in records {
            let why = match &r {
                Record::Prepared { .. } | Record::Adopted { .. } => "prepared durable",
                Record::Decided { .. } => "decided durable",
                Record::Applied { .. } => "applied durable",
                Record::Forgotten { .. } => "forgotten durable",
            };
            let input = if r.by_initiator() {
                Input::Init(initiator::Event::Durable(r))
            } else {
                Input::Part(participant::Event::Durable(r))
            };
            self.input(s, input)?;
            if self.sites[s].up.is_none() {
                return Ok(());
            }
            self.maybe_crash(s, why);
            if self.sites[s].up.is_none() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Record `r` of site `s` just became durable: what the checks learn from it.
    fn durable(&mut self, s: usize, r: &Record) -> Result<(), String> {
        match r {
            Record::Decided {
                txn,
                client,
                seq,
                decision,
                participants,
            } => {
                if *decision == Decision::Commit {
                    if let Some(p) = participants
                        .iter()
                        .find(|p| self.voted_no.contains(&(**p, *txn)))
                    {
                        return Err(format!("{txn:?} committed although site {} voted no", p.0));
                    }
                    if let Some(p) = participants
                        .iter()
                        .find(|p| self.discarded.contains(&(**p, *txn)))
                    {
                        return Err(format!(
                            "{txn:?} committed although site {} discarded it",
                            p.0
                        ));
                    }
                    self.commits.insert(*txn, participants.clone());
                }
                if let Some(prev) = self.decided.insert((*client, *seq), (*txn, *decision)) {
                    return Err(format!(
                        "client {client} request {seq} decided twice: {prev:?}, then \
                         {txn:?} {decision:?}"
                    ));
                }
            }
            Record::Applied { txn, commit: true } => {
                self.durable_applied[s].insert(*txn);
            }
            _ => {}
        }
        Ok(())
    }

    /// Process `p` dies: its sites lose their volatile state and all but a random prefix
    /// of their unsynced journal tails.
    fn crash(&mut self, p: usize, why: &'static str) {
        if !self.procs[p].up {
            return;
        }
        if self.cfg.trace {
            eprintln!("{} crash of process {p} ({why})", self.now);
        }
        self.procs[p].up = false;
        self.stats.crashes += 1;
        *self.stats.crash_points.entry(why).or_default() += 1;
        let back = self.rng.range(200, 2_000);
        self.at(self.now + back, Ev::Restart(p));
        for s in 0..self.sites.len() {
            if self.sites[s].host != p {
                continue;
            }
            self.sites[s].up = None;
            self.sites[s].sync_scheduled = false;
            // A no vote is no promise once its voter is gone: the participant forgot it
            // and may vote yes on a resent prepare (the initiator never heard the no).
            self.voted_no.retain(|(p, _)| *p != sid(s));
            let pending = std::mem::take(&mut self.sites[s].journal.pending);
            let keep = self.rng.range(0, pending.len() as u64) as usize;
            for r in &pending[..keep] {
                // A crash cannot break an invariant by itself; a violation here was
                // already made by the step that wrote the record.
                let _ = self.durable(s, r);
            }
            self.sites[s]
                .journal
                .durable
                .extend(pending.into_iter().take(keep));
            if self.rng.chance(self.cfg.failover_permille) {
                let n = self.procs.len() as u64;
                let q = self.rng.range(0, n - 1) as usize;
                if q != p {
                    let d = self.rng.range(100, 1_000);
                    self.at(self.now + d, Ev::Adopt { site: s, proc: q });
                }
            }
        }
    }

    /// Site `s` comes back (on its host) from its durable journal, as a new epoch.
    fn recover(&mut self, s: usize) -> Result<(), String> {
        let site = &mut self.sites[s];
        site.epoch += 1;
        let records = &site.journal.durable;
        let init = Initiator::recover(sid(s), site.epoch, self.cfg.txn, records)
            .map_err(|e| format!("site {s}: {e}"))?;
        let (part, replay) = Participant::recover(sid(s), self.cfg.txn, records)
            .map_err(|e| format!("site {s}: {e}"))?;
        site.up = Some(Up {
            init,
            part,
            kv: site.genesis.clone(),
            applied: BTreeSet::new(),
        });
        for e in replay {
            if let Effect::Apply { txn, mutations } = e {
                self.apply(s, txn, &mutations)?;
            }
        }
        Ok(())
    }

    fn client_tick(&mut self, c: usize) -> Result<(), String> {
        self.at(self.now + CLIENT_TICK_MS, Ev::ClientTick(c));
        let cl = &self.clients[c];
        match cl.cur {
            None if cl.ops_left > 0 => {
                let seq = cl.next_seq;
                let (site, plan) = self.plan(c, seq);
                let cl = &mut self.clients[c];
                cl.next_seq += 1;
                cl.ops_left -= 1;
                cl.plans.insert(seq, (site, plan));
                cl.cur = Some((seq, self.now));
                self.net(Ev::Request {
                    client: c,
                    site,
                    seq,
                });
            }
            Some((seq, sent)) if self.now >= sent + CLIENT_RETRY_MS => {
                self.clients[c].cur = Some((seq, self.now));
                self.resend(c, seq);
            }
            _ => {}
        }
        Ok(())
    }

    fn resend(&mut self, c: usize, seq: u64) {
        if let Some((site, _)) = self.clients[c].plans.get(&seq) {
            let site = *site;
            self.net(Ev::Request {
                client: c,
                site,
                seq,
            });
        }
    }

    /// Moves a token from where the client believes it is to another site, sometimes with
    /// a marker entry at a third; the request goes to the source site, or sometimes to
    /// another one.
    fn plan(&mut self, c: usize, seq: u64) -> (usize, Plan) {
        let n = self.sites.len() as u64;
        let t = self.rng.range(0, self.where_is.len() as u64 - 1) as usize;
        let a = self.where_is[t];
        let b = (a + self.rng.range(1, n - 1) as usize) % n as usize;
        let mut plan = vec![
            (
                sid(a),
                Part {
                    locks: vec![token_key(a, t), Key::Inode(100 + t as u64)],
                    mutations: vec![super::Mutation {
                        key: token_key(a, t),
                        expect: Expect::Present,
                        write: Write::Delete,
                    }],
                },
            ),
            (
                sid(b),
                Part {
                    locks: vec![token_key(b, t)],
                    mutations: vec![super::Mutation {
                        key: token_key(b, t),
                        expect: Expect::Absent,
                        write: Write::Put(t.to_le_bytes().to_vec()),
                    }],
                },
            ),
        ];
        if n > 2 && self.rng.chance(self.cfg.three_permille) {
            let third = (0..n as usize).find(|x| *x != a && *x != b).unwrap_or(a);
            let key = Key::Entry {
                parent: dir(third),
                name: format!("m{c}.{seq}").into_bytes(),
            };
            plan.push((
                sid(third),
                Part {
                    locks: vec![key.clone()],
                    mutations: vec![super::Mutation {
                        key,
                        expect: Expect::Absent,
                        write: Write::Put(Vec::new()),
                    }],
                },
            ));
        }
        let origin = if self.rng.chance(self.cfg.foreign_origin_permille) {
            self.rng.range(0, n - 1) as usize
        } else {
            a
        };
        (origin, plan)
    }

    fn client_reply(&mut self, c: usize, seq: u64, outcome: Outcome) -> Result<(), String> {
        match outcome {
            Outcome::Committed | Outcome::Refused => {
                let cl = &mut self.clients[c];
                if let Some(prev) = cl.answers.insert(seq, outcome)
                    && prev != outcome
                {
                    return Err(format!(
                        "client {c} request {seq}: answered {prev:?}, then {outcome:?}"
                    ));
                }
                let first = cl.cur.is_some_and(|(s, _)| s == seq);
                if first && outcome == Outcome::Committed {
                    self.read_back(c, seq)?;
                }
                let cl = &mut self.clients[c];
                if first {
                    cl.cur = None;
                    // Sometimes ask again later anyway, as a client that missed the
                    // answer would.
                    if self.rng.chance(300) {
                        let d = self.rng.range(1, 3_000);
                        let site = self.clients[c].plans[&seq].0;
                        self.at(
                            self.now + d,
                            Ev::Request {
                                client: c,
                                site,
                                seq,
                            },
                        );
                    }
                }
            }
            Outcome::Busy => {
                self.stats.busy += 1;
                if let Some((s, sent)) = &mut self.clients[c].cur
                    && *s == seq
                {
                    *sent = self.now.saturating_sub(CLIENT_RETRY_MS - CLIENT_TICK_MS);
                }
            }
            Outcome::Invalid | Outcome::TooOld => {
                return Err(format!("client {c} request {seq} answered {outcome:?}"));
            }
        }
        Ok(())
    }

    /// Schedules a read of every key request `seq` of client `c` changed, at each of its
    /// participants.
    fn read_back(&mut self, c: usize, seq: u64) -> Result<(), String> {
        let Some((txn, _)) = self.decided.get(&(c as u64, seq)).copied() else {
            return Err(format!(
                "client {c} request {seq} committed without a decision"
            ));
        };
        let plan = self.clients[c].plans[&seq].1.clone();
        for (site, part) in plan {
            for m in part.mutations {
                let read = Ev::Read {
                    client: c,
                    site: site.0 as usize,
                    key: m.key,
                    txn,
                };
                self.at(self.now + 1, read);
            }
        }
        Ok(())
    }

    /// A read outside any transaction waits while its key is locked; once it is not, the
    /// commit the client was told of must be applied there (its participant prepared it
    /// before the commit, so the key stays locked until it is applied).
    fn read(&mut self, client: usize, site: usize, key: Key, txn: TxnId) -> Result<(), String> {
        let retry = Ev::Read {
            client,
            site,
            key: key.clone(),
            txn,
        };
        if !self.reachable(site) {
            self.at(self.now + TICK_MS, retry);
            return Ok(());
        }
        let Some(up) = self.sites[site].up.as_ref() else {
            return Ok(());
        };
        if up.part.locks().is_locked(&key) {
            self.stats.reads_waited += 1;
            self.at(self.now + 30, retry);
            return Ok(());
        }
        if !up.applied.contains(&txn) {
            return Err(format!(
                "client {client} reads {key:?} at site {site} unlocked before {txn:?}, \
                 which it was told is committed, is applied there"
            ));
        }
        self.stats.reads += 1;
        Ok(())
    }

    /// Faults are over and everything is idle: all or nothing, nothing lost, and every
    /// request asked again gets its first answer.
    fn final_checks(&mut self) -> Result<(), String> {
        for (txn, parts) in &self.commits {
            for p in parts {
                let up = self.sites[p.0 as usize].up.as_ref();
                if !up.is_some_and(|u| u.applied.contains(txn)) {
                    return Err(format!("{txn:?} committed but not applied at site {}", p.0));
                }
            }
        }
        let mut seen = vec![0usize; self.where_is.len()];
        for (s, site) in self.sites.iter().enumerate() {
            let Some(up) = &site.up else {
                return Err(format!("site {s} down at the end"));
            };
            for (t, n) in seen.iter_mut().enumerate() {
                *n += usize::from(up.kv.contains_key(&token_key(s, t)));
            }
        }
        if let Some(t) = seen.iter().position(|n| *n != 1) {
            return Err(format!("token {t} is in {} directories", seen[t]));
        }
        for c in 0..self.clients.len() {
            let answers = self.clients[c].answers.clone();
            for seq in 0..self.clients[c].next_seq {
                let Some(first) = answers.get(&seq) else {
                    return Err(format!("client {c} request {seq} never answered"));
                };
                match (first, self.decided.get(&(c as u64, seq))) {
                    (Outcome::Committed, Some((_, Decision::Commit)))
                    | (Outcome::Refused, Some((_, Decision::Refuse))) => {}
                    (o, d) => {
                        return Err(format!(
                            "client {c} request {seq} answered {o:?}, decided {d:?}"
                        ));
                    }
                }
                let (site, plan) = self.clients[c].plans[&seq].clone();
                let now = self.now;
                let Some(up) = self.sites[site].up.as_mut() else {
                    return Err(format!("site {site} down at the end"));
                };
                let again = up.init.step(
                    initiator::Event::Request {
                        client: c as u64,
                        seq,
                        plan,
                    },
                    now,
                );
                let want = Effect::Reply {
                    client: c as u64,
                    seq,
                    outcome: *first,
                };
                if again != vec![want] {
                    return Err(format!(
                        "client {c} request {seq} answered {first:?}, asked again: {again:?}"
                    ));
                }
                match first {
                    Outcome::Committed => self.stats.committed += 1,
                    _ => self.stats.refused += 1,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_exactly() {
        let a = run(SimConfig::new(11)).unwrap();
        let b = run(SimConfig::new(11)).unwrap();
        assert_eq!(
            (a.events, a.end_ms, a.crashes),
            (b.events, b.end_ms, b.crashes)
        );
    }
}
