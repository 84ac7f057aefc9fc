//! The host of a member's multi-server transactions (issue 33): it owns this server's
//! `txn::Initiator` and `txn::Participant` (pure state machines, `kochab_cluster::txn`),
//! feeds them requests, messages, durable records and ticks, and carries out their
//! effects: messages to other members, records into this server's journal, checks and
//! commits through the engine, replies to the waiting client request. No protocol
//! decision is made here.
//!
//! - Messages travel as `ControlBody::Txn` over the member protocol with the cluster key
//!   ([`link`]), to the address the delegation map gives for a server id (whoever holds
//!   that journal now; after a restart, the new incarnation).
//! - Records are journal entries with a trailer (`txn_wire`); a participant's commit is
//!   one record holding its engine mutations and its `Applied` record.
//! - An operation outside transactions that names a locked key is answered "ask again"
//!   (the WRONG_SERVER without owner that a client already retries after refreshing its
//!   map): [`TxnHost::blocks`]. It does not wait on the server.
//! - On start, the previous incarnation's journal is read for transaction records; both
//!   sides are recovered from them and what is still open is journaled again here (so it
//!   outlives that journal); journal trimming keeps every open record ([`keep_from`]).

mod link;

use crate::shared::Shared;
use crate::step::{Event, TxnRecorded};
use crate::txn_plan::{self, NoPlan};
use crate::txn_wire;
use kochab_cluster::txn::initiator::{self, Initiator};
use kochab_cluster::txn::participant::{self, Participant};
use kochab_cluster::txn::{
    Age, Decision, Effect, Msg, Mutation as TxnMutation, Outcome, Part, Record, TxnConfig, TxnId,
};
use kochab_journal::JournalId;
use kochab_meta::Mutation;
use kochab_proto::cluster::ServerId;
use kochab_proto::{Op, Reply, Request, fs_err};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// What the transaction host asks of the member it runs in (`cluster_host::ClusterHost` is
/// the one there is). A trait, so that the member and its transaction host do not import
/// each other.
pub trait MemberMap: Send + Sync {
    /// The server of `id`'s table by the cached map.
    fn owner_of(&self, id: kochab_proto::InodeId) -> Option<ServerId>;
    /// A server's address by the cached map.
    fn server_addr(&self, server: ServerId) -> Option<String>;
    /// "Not now, ask again": the client refreshes its map and retries.
    fn not_ready(&self) -> Reply;
    /// This incarnation's journal.
    fn journal_id(&self) -> JournalId;
}

/// Where a transaction host's messages go and where its slow reads run: a served
/// member's links and blocking threads ([`TxnHost::attach`]), or a simulation's network
/// and steps ([`TxnHost::attach_with`]).
pub trait TxnIo: Send + Sync {
    /// Sends `msg` as server `from` to server `to` (itself too), or drops it: the protocol
    /// resends what is lost.
    fn send(&self, from: ServerId, to: ServerId, msg: Msg);
    /// Runs `job` (store reads) off the caller's thread, some time later.
    fn later(&self, job: Box<dyn FnOnce() + Send>);
    /// True if the caller tells the host every durable point itself
    /// ([`TxnHost::on_durable`]; a simulation, whose runs must not depend on when the
    /// journal's thread wrote); false: the host also reads the journal's, so that a record
    /// durable before it was queued is not missed.
    fn tells_durable(&self) -> bool {
        false
    }
}

/// A served member's: the send loop's queue, and tokio's blocking threads.
struct Served {
    out: mpsc::UnboundedSender<(ServerId, ServerId, Msg)>,
}

impl TxnIo for Served {
    fn send(&self, from: ServerId, to: ServerId, msg: Msg) {
        let _ = self.out.send((from, to, msg));
    }

    fn later(&self, job: Box<dyn FnOnce() + Send>) {
        tokio::task::spawn_blocking(job);
    }
}

/// How multi-server operations run (`--multi-server`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MultiServer {
    /// Borrow every table (BORROW/RETURN), as before issue 33.
    #[default]
    Borrow,
    /// A transaction where a plan covers the operation, else borrow.
    Txn,
    /// As `Txn`, and every multi-server operation counts the tables it needed of other
    /// servers; the member reports them, and the coordinator's affinity rule moves a
    /// table one server keeps needing there for good (`kochab_cluster::balance`).
    Auto,
}

impl std::str::FromStr for MultiServer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "borrow" => Ok(MultiServer::Borrow),
            "txn" => Ok(MultiServer::Txn),
            "auto" => Ok(MultiServer::Auto),
            other => Err(format!("--multi-server {other}: txn, borrow or auto")),
        }
    }
}

/// Ticks of both state machines (resends, inquiries, timeouts): well under their timers
/// (`TxnConfig::resend_ms` 200, `wait_max_ms` 500).
const TICK: Duration = Duration::from_millis(50);

/// Most time a client request waits for its transaction's answer before it is told to
/// ask again (its retry, same seq, gets the answer once decided).
const REPLY_WAIT: Duration = Duration::from_secs(10);

/// Attempts remembered as applied here (for late duplicate decisions): far more than
/// are in flight at once (a participant holds at most 4,096).
const APPLIED_KEPT: usize = 16_384;

/// A test switch that stops the process at one step (crash tests): `STEP` or
/// `STEP:FILE`, STEP `after-prepared` or `after-decided` (the process aborts), or
/// `pause-after-decided` (it stops itself with SIGSTOP: alive, holding its sockets,
/// answering nothing, as a server that hangs for good); with FILE, only the process that
/// creates FILE first stops (once in a cluster whose servers all have the switch).
const CRASH_ENV: &str = "KOCHAB_TXN_CRASH";

/// Where [`CRASH_ENV`] stops the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CrashAt {
    /// A participant's prepare record is durable (before its vote leaves).
    Prepared,
    /// The initiator's commit record is durable (before anyone is told).
    Decided,
}

/// The switch: where, whether it pauses rather than aborts, and its marker file.
type CrashSwitch = (CrashAt, bool, Option<std::path::PathBuf>);

fn crash_at() -> Option<CrashSwitch> {
    let v = std::env::var(CRASH_ENV).ok()?;
    let (step, file) = match v.split_once(':') {
        Some((s, f)) => (s.to_string(), Some(std::path::PathBuf::from(f))),
        None => (v, None),
    };
    let (at, pause) = match step.as_str() {
        "after-prepared" => (CrashAt::Prepared, false),
        "after-decided" => (CrashAt::Decided, false),
        "pause-after-decided" => (CrashAt::Decided, true),
        _ => return None,
    };
    Some((at, pause, file))
}

/// Aborts or pauses the process if the crash switch names `at` (and this process is
/// first).
fn maybe_crash(switch: &Option<CrashSwitch>, at: CrashAt) {
    let Some((want, pause, file)) = switch else {
        return;
    };
    if *want != at {
        return;
    }
    if let Some(f) = file
        && std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(f)
            .is_err()
    {
        return;
    }
    if *pause {
        tracing::error!("{CRASH_ENV}: pausing (SIGSTOP) after the {at:?} record is durable");
        // SAFETY: raise(3) with a valid signal number; the process stops until SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
        return;
    }
    tracing::error!("{CRASH_ENV}: aborting after the {at:?} record is durable");
    std::process::abort();
}

struct Sides {
    init: Initiator,
    part: Participant,
}

/// Requests waiting for one (client, seq)'s answer (a retry joins the first).
type Waiters = Vec<oneshot::Sender<Outcome>>;

/// What [`TxnHost::start`] did with a request.
pub enum Start {
    /// Answered at once (from the reply cache); `None`: no transaction covers it, or none
    /// can run here: the caller borrows.
    Done(Option<(Reply, u64)>),
    /// A transaction runs for it: [`TxnHost::finish`] its outcome.
    Waiting(Waiting),
}

/// A request whose transaction runs.
pub struct Waiting {
    /// Its outcome, once the initiator answers (closed if this host goes).
    pub outcome: oneshot::Receiver<Outcome>,
    /// A link's inode (its reply carries the attributes).
    linked: Option<kochab_proto::InodeId>,
    /// The plan's time.
    time: kochab_proto::TimeNs,
}

/// What the reply to a decided transaction still needs.
enum Finish {
    Reply(Option<(Reply, u64)>),
    /// The attributes of a committed link's inode.
    Linked(kochab_proto::InodeId, kochab_proto::TimeNs),
}

/// The transaction host of one member incarnation.
pub struct TxnHost {
    mode: MultiServer,
    me: ServerId,
    sides: OnceLock<Mutex<Sides>>,
    shared: OnceLock<Weak<Shared>>,
    host: OnceLock<Weak<dyn MemberMap>>,
    /// Client requests waiting for their answer: (client, seq).
    waiting: Mutex<HashMap<(u64, u64), Waiters>>,
    /// What the reply cache keeps for a request once committed (the inode a link names),
    /// by (client, seq), until its decision is journaled and answered.
    outcomes: Mutex<HashMap<(u64, u64), Option<kochab_proto::InodeId>>>,
    /// A commit's checked changes, between its `Apply` and its `Applied` record.
    applies: Mutex<HashMap<TxnId, Vec<TxnMutation>>>,
    /// Parts prepared here without an outcome yet (a decision to commit is taken in only
    /// once their tables are hosted here).
    prepared: Mutex<HashMap<TxnId, Part>>,
    /// Journal LSNs of the records recovery still needs: prepares without an outcome,
    /// commit decisions not forgotten.
    open: Mutex<BTreeMap<(TxnId, bool), u64>>,
    /// Attempts applied here lately (a late duplicate decision is acknowledged by the
    /// participant; one about an attempt never prepared here is not: its part, if any, is
    /// with whoever recovered this server's last journal).
    applied: Mutex<std::collections::BTreeSet<TxnId>>,
    /// Attempts whose own part (this server's, not one taken over) is prepared here and
    /// not yet applied: only those, and those in `applied`, are acknowledged as this
    /// server. A part taken over is acknowledged as its owner only; acknowledged as this
    /// server too, it told the origin this server's own part was done while that part
    /// was in doubt elsewhere (the cluster simulation: a link half applied).
    own: Mutex<std::collections::BTreeSet<TxnId>>,
    /// Parts taken over from other servers' journals, by attempt: acknowledged for them.
    adopted: Mutex<HashMap<TxnId, Vec<ServerId>>>,
    /// Attempts in doubt here whose origin's journals are being read (see
    /// [`TxnHost::ask_sealed_origin`]).
    resolving: Mutex<std::collections::HashSet<TxnId>>,
    /// Where messages go and slow reads run.
    io: OnceLock<Arc<dyn TxnIo>>,
    /// Records appended, by LSN, told to their side once durable ([`TxnHost::on_durable`]).
    undurable: Mutex<BTreeMap<u64, Vec<Record>>>,
    /// Itself, for the slow reads.
    this: OnceLock<Weak<TxnHost>>,
    /// The protocol's clock: the server's (a simulation's in one), from attach.
    clock: OnceLock<(crate::clock::Clock, Instant)>,
    crash: Option<CrashSwitch>,
    /// TLS to the other members, when the cluster runs it.
    tls: Option<crate::tls::TlsClient>,
}

impl TxnHost {
    /// The host for `mode` (none for `Borrow`: nothing changes).
    pub fn for_mode(
        mode: MultiServer,
        me: ServerId,
        tls: Option<crate::tls::TlsClient>,
    ) -> Option<Arc<TxnHost>> {
        if mode == MultiServer::Borrow {
            return None;
        }
        Some(Arc::new(TxnHost {
            mode,
            me,
            sides: OnceLock::new(),
            shared: OnceLock::new(),
            host: OnceLock::new(),
            waiting: Mutex::new(HashMap::new()),
            outcomes: Mutex::new(HashMap::new()),
            applies: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
            open: Mutex::new(BTreeMap::new()),
            applied: Mutex::new(Default::default()),
            own: Mutex::new(Default::default()),
            adopted: Mutex::new(HashMap::new()),
            resolving: Mutex::new(Default::default()),
            io: OnceLock::new(),
            undurable: Mutex::new(BTreeMap::new()),
            this: OnceLock::new(),
            clock: OnceLock::new(),
            crash: crash_at(),
            tls,
        }))
    }

    pub fn mode(&self) -> MultiServer {
        self.mode
    }

    fn now_ms(&self) -> u64 {
        match self.clock.get() {
            Some((clock, base)) => clock.now().saturating_duration_since(*base).as_millis() as u64,
            None => 0,
        }
    }

    fn shared(&self) -> Option<Arc<Shared>> {
        self.shared.get()?.upgrade()
    }

    /// Starts the host of a served member: [`TxnHost::attach_with`] its links, then
    /// ticks, sends and tells durable records in tasks of its own.
    pub fn attach(self: &Arc<Self>, host: Arc<dyn MemberMap>, shared: &Arc<Shared>) {
        let me = host.journal_id();
        let (tx, rx) = mpsc::unbounded_channel();
        if !self.attach_with(host, shared, Arc::new(Served { out: tx })) {
            return;
        }
        let key = shared.keys().admin().key;
        let links = link::Links::new(key, me, self.tls.clone());
        tokio::spawn(send_loop(Arc::downgrade(self), rx, links));
        tokio::spawn(tick_loop(Arc::downgrade(self)));
        shared.on_each_durable(Arc::downgrade(self), TxnHost::on_durable);
    }

    /// Starts the host once the server runs, with `io` carrying its messages: recovers
    /// both sides from the previous incarnation's journal. False if that failed:
    /// transactions stay off and every multi-server operation borrows. The caller ticks
    /// ([`TxnHost::tick`]) and tells it what is durable ([`TxnHost::on_durable`]).
    /// `host` is held weakly: the caller keeps it.
    pub fn attach_with(
        self: &Arc<Self>,
        host: Arc<dyn MemberMap>,
        shared: &Arc<Shared>,
        io: Arc<dyn TxnIo>,
    ) -> bool {
        if self.shared.set(Arc::downgrade(shared)).is_err() {
            return false;
        }
        let _ = self.host.set(Arc::downgrade(&host));
        let _ = self.this.set(Arc::downgrade(self));
        let _ = self.io.set(io);
        let _ = self
            .clock
            .set((shared.clock().clone(), shared.clock().now()));
        let me = host.journal_id();
        let sides = match self.recover(shared, me) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(
                    "transactions are off on this server (every multi-server operation borrows): {e}"
                );
                return false;
            }
        };
        self.sides.set(Mutex::new(sides)).is_ok()
    }

    /// Rebuilds the initiator from the decisions in this server's previous journal (the
    /// origin answers for its old attempts) and journals again the commits not yet
    /// forgotten. The participant starts empty: what the last incarnation left in doubt
    /// travels with its tables and is taken over by whoever recovers them
    /// ([`TxnHost::adopt_from`]), this server too if they come back here.
    fn recover(&self, shared: &Shared, me: JournalId) -> Result<Sides, String> {
        let entries = match previous_journal(shared, me)? {
            Some(prev) => journal_records(shared, prev)?,
            None => Vec::new(),
        };
        let records: Vec<Record> = entries.iter().map(|(r, _)| r.clone()).collect();
        let cfg = protocol_config(shared);
        let init =
            Initiator::recover(self.me, me.epoch, cfg, &records).map_err(|e| e.to_string())?;
        // Each commit not yet forgotten, with what the reply cache keeps for it.
        let mut open: BTreeMap<TxnId, (Record, Option<kochab_proto::InodeId>)> = BTreeMap::new();
        let mut own = std::collections::BTreeSet::new();
        for (r, kept) in &entries {
            match r {
                Record::Prepared { txn, .. } => {
                    own.insert(*txn);
                }
                // This server's own part applied there, maybe not acknowledged: the
                // origin's resent decision comes here (the server id) and is acknowledged
                // (the cluster simulation: a part applied, its ack lost, its server
                // killed; its origin asked forever).
                Record::Applied { txn, commit: true } if own.contains(txn) => {
                    self.applied.lock().insert(*txn);
                }
                Record::Decided {
                    txn,
                    decision: Decision::Commit,
                    ..
                } => {
                    open.insert(*txn, (r.clone(), *kept));
                }
                Record::Forgotten { txn } => {
                    open.remove(txn);
                }
                _ => {}
            }
        }
        let n = open.len();
        for (txn, (r, kept)) in open {
            // Journaled again with the inode its reply names (the cluster simulation: a
            // link's initiator killed twice; the second incarnation's record, without
            // it, answered the retry Empty from the reply cache).
            // `u64::MAX` when the journal stopped: never durable, never trimmed past.
            let lsn = self
                .journal_record(shared, &r, &[], kept)
                .unwrap_or(u64::MAX);
            self.open.lock().insert((txn, true), lsn);
        }
        if !records.is_empty() {
            tracing::info!(
                "transactions: {} records of the last incarnation read, {n} commits still told",
                records.len()
            );
        }
        Ok(Sides {
            init,
            part: Participant::new(self.me, cfg),
        })
    }

    /// Takes over what the fenced journal `journal` left in doubt on the tables `ranges`
    /// this server is about to recover from it: each attempt prepared there without an
    /// outcome, whose keys lie in those tables, is journaled here again (durable before
    /// the tables are served) and held in doubt here until its origin answers. Runs on a
    /// blocking thread (table loads do).
    pub fn adopt_from(&self, shared: &Shared, journal: JournalId, ranges: &[(u64, u64)]) {
        let Some(sides) = self.sides.get() else {
            return;
        };
        let records = match journal_records(shared, journal) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("transactions in doubt in {journal} not taken over: {e}");
                return;
            }
        };
        // This side's own parts of those attempts finish what their records started
        // first (a prepare voted, a commit applied), so that a part taken over joins a
        // settled one (`Participant::adopt` refuses one being prepared or applied).
        let journal_ok = shared.journal().wait_durable(shared.journal().last_lsn());
        if journal_ok {
            self.on_durable(shared.journal().durable_lsn());
        }
        // One attempt may have several prepared parts there: its own, and those it took
        // over (each with the server it speaks for).
        let from = ServerId(journal.server as u32);
        let mut doubt: BTreeMap<TxnId, Vec<(Age, Part, ServerId)>> = BTreeMap::new();
        for (r, _) in records {
            match r {
                Record::Prepared { txn, age, part } => {
                    doubt.entry(txn).or_default().push((age, part, from));
                }
                Record::Adopted {
                    txn,
                    age,
                    part,
                    owner,
                } => doubt.entry(txn).or_default().push((age, part, owner)),
                Record::Applied { txn, .. } => {
                    doubt.remove(&txn);
                }
                _ => {}
            }
        }
        let ours = |k: &kochab_cluster::txn::Key| {
            let id = txn_plan::table_key(k);
            ranges.iter().any(|&(lo, hi)| lo <= id && id < hi)
        };
        let mut last = 0;
        for (txn, parts) in doubt {
            for (age, part, owner) in parts {
                if !part.locks.iter().any(ours) {
                    continue;
                }
                let taken = sides.lock().part.adopt(txn, age, part.clone());
                if !taken {
                    tracing::info!("transaction {txn:?} of {journal}: over or known here");
                    continue;
                }
                tracing::info!(
                    "transaction {txn:?} of {journal}: in doubt, server {}'s part taken over here",
                    owner.0
                );
                self.prepared
                    .lock()
                    .entry(txn)
                    .and_modify(|p| {
                        p.locks.extend(part.locks.iter().cloned());
                        p.mutations.extend(part.mutations.iter().cloned());
                    })
                    .or_insert_with(|| part.clone());
                // Acknowledged as the server whose part it is (not as the journal's, which
                // may only have taken it over itself: the cluster simulation, a part taken
                // over twice, its owner never acknowledged, its origin asking forever).
                self.adopted.lock().entry(txn).or_default().push(owner);
                // The origin learns at once who answers for that part now: it tells this
                // server the commit too (a decision that comes before this side's first
                // inquiry would otherwise leave the origin unaware of it).
                if let Some(io) = self.io.get() {
                    io.send(self.me, txn.origin, Msg::Inquiry { txn });
                }
                let r = Record::Adopted {
                    txn,
                    age,
                    part,
                    owner,
                };
                last = self
                    .journal_record(shared, &r, &[], None)
                    .unwrap_or(u64::MAX);
                self.open.lock().insert((txn, false), last);
            }
        }
        if last > 0 && !shared.journal().wait_durable(last) {
            tracing::error!("the journal failed while taking over transactions in doubt");
        }
    }

    /// What transactions still hold here, if anything: attempts this server runs, parts
    /// with their locks, requests waiting, records not yet durable. `None` once all is
    /// over (a simulation checks it when nothing is in flight: no lock left behind).
    pub fn busy(&self) -> Option<String> {
        let sides = self.sides.get()?.lock();
        let (active, locks) = (sides.init.active(), sides.part.locks().load());
        let idle = sides.part.idle();
        drop(sides);
        let waiting = self.waiting.lock().len();
        let undurable = self.undurable.lock().len();
        let prepared = self.prepared.lock().len();
        if active == 0 && idle && waiting == 0 && undurable == 0 && prepared == 0 {
            return None;
        }
        Some(format!(
            "{active} attempts running, {prepared} parts prepared, locks (held, waiting) \
             {locks:?}, {waiting} requests waiting, {undurable} records not durable"
        ))
    }

    /// The oldest LSN of this journal that recovery still needs (`u64::MAX`: none).
    pub fn keep_from(&self) -> u64 {
        self.open.lock().values().copied().min().unwrap_or(u64::MAX)
    }

    /// True if a part prepared here (in doubt or being applied) has a key in the table
    /// `[lo, hi)`: the table may not leave yet.
    pub fn holds_range(&self, lo: u64, hi: u64) -> bool {
        self.prepared.lock().values().any(|p| {
            p.locks.iter().any(|k| {
                let id = txn_plan::table_key(k);
                lo <= id && id < hi
            })
        })
    }

    /// True if `op` names a key a transaction holds here: the caller answers "ask again".
    /// Called under the core lock (lock order: core, then the sides).
    pub fn blocks(&self, engine: &kochab_meta::Engine, op: &kochab_proto::Op) -> bool {
        let Some(sides) = self.sides.get() else {
            return false;
        };
        let sides = sides.lock();
        let locks = sides.part.locks();
        if locks.load() == (0, 0) {
            return false;
        }
        txn_plan::op_keys(engine, op)
            .iter()
            .any(|k| locks.is_locked(k))
    }

    /// Runs a multi-server request as a transaction. `None`: it has no plan, or its
    /// preconditions failed somewhere; the caller borrows instead (which answers the
    /// errno a single server would).
    pub async fn run(
        self: &Arc<Self>,
        shared: &Shared,
        client: u64,
        req: &Request,
    ) -> Option<(Reply, u64)> {
        let waiting = match self.start(shared, client, req) {
            Start::Done(done) => return done,
            Start::Waiting(w) => w,
        };
        let outcome = match tokio::time::timeout(REPLY_WAIT, waiting.outcome).await {
            Ok(Ok(o)) => o,
            _ => Outcome::Busy,
        };
        let deadline = Instant::now() + LINK_ATTR_WAIT;
        match self.finish(shared, outcome, waiting.linked, waiting.time)? {
            Finish::Reply(done) => done,
            Finish::Linked(id, time) => loop {
                let late = Instant::now() >= deadline;
                match linked_reply(shared, id, time, late) {
                    Some(reply) => return Some((reply, 0)),
                    None => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            },
        }
    }

    /// Starts a multi-server request's transaction (see [`TxnHost::run`]).
    pub fn start(self: &Arc<Self>, shared: &Shared, client: u64, req: &Request) -> Start {
        let Some(host) = self.host.get().and_then(Weak::upgrade) else {
            return Start::Done(None);
        };
        if self.sides.get().is_none() {
            return Start::Done(None);
        }
        if req.seq != 0 && shared.reply_cached(client, req.seq).is_some() {
            // Answered already (by a transaction or a borrow): answered as the batch
            // path's reply cache does, with no borrow.
            return Start::Done(match req.op {
                Op::Rename { .. } | Op::Unlink { .. } => Some((Reply::Empty, 0)),
                Op::Link { id, .. } => shared
                    .core()
                    .engine
                    .inode(id)
                    .map(|i| (Reply::Entry(i.attr(id)), 0)),
                _ => None,
            });
        }
        let now = shared.clock().wall_ns();
        let plan = {
            let core = shared.core();
            txn_plan::plan_op(&core.engine, &req.cred, &req.op, now, |id| {
                host.owner_of(id)
            })
        };
        let plan = match plan {
            Ok(p) => p,
            Err(NoPlan::NotCovered(why)) => {
                tracing::debug!("{} borrows: {why}", req.op.name());
                return Start::Done(None);
            }
            Err(NoPlan::NoOwner(id)) => {
                tracing::debug!("{} borrows: no owner known for {id:#x}", req.op.name());
                return Start::Done(None);
            }
        };
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .entry((client, req.seq))
            .or_default()
            .push(tx);
        shared.metrics().txn_ops.inc();
        let linked = match req.op {
            Op::Link { id, .. } => Some(id),
            _ => None,
        };
        self.outcomes.lock().insert((client, req.seq), linked);
        let ev = initiator::Event::Request {
            client,
            seq: req.seq,
            plan,
        };
        self.step_init(ev);
        Start::Waiting(Waiting {
            outcome: rx,
            linked,
            time: now,
        })
    }

    /// The reply to a request whose transaction ended with `outcome` (`Busy` if it was
    /// not told in time); `None`: the caller borrows instead.
    fn finish(
        &self,
        shared: &Shared,
        outcome: Outcome,
        linked: Option<kochab_proto::InodeId>,
        time: kochab_proto::TimeNs,
    ) -> Option<Finish> {
        let host = self.host.get().and_then(Weak::upgrade)?;
        Some(match outcome {
            Outcome::Committed => match linked {
                None => Finish::Reply(Some((Reply::Empty, 0))),
                Some(id) => Finish::Linked(id, time),
            },
            Outcome::Refused | Outcome::Invalid => {
                shared.metrics().txn_fallbacks.inc();
                Finish::Reply(None)
            }
            Outcome::Busy => Finish::Reply(Some((host.not_ready(), 0))),
            Outcome::TooOld => Finish::Reply(Some((
                Reply::Error(fs_err!(EIO, "the answer of this request is no longer kept")),
                0,
            ))),
        })
    }

    /// [`TxnHost::finish`] for a caller that does not wait (a simulation): a committed
    /// link's attributes as they are or will be.
    pub fn finish_now(
        &self,
        shared: &Shared,
        outcome: Outcome,
        waiting: &Waiting,
    ) -> Option<(Reply, u64)> {
        match self.finish(shared, outcome, waiting.linked, waiting.time)? {
            Finish::Reply(done) => done,
            Finish::Linked(id, time) => linked_reply(shared, id, time, true).map(|r| (r, 0)),
        }
    }

    /// A message from the server holding `from`'s journal.
    pub fn deliver(&self, from: ServerId, bytes: &[u8]) {
        match txn_wire::decode_msg(bytes) {
            Ok(msg) => self.on_msg(from, msg),
            Err(e) => tracing::warn!("a bad transaction message from server {}: {e}", from.0),
        }
    }

    fn on_msg(&self, from: ServerId, msg: Msg) {
        if msg.to_initiator() {
            self.step_init(initiator::Event::Message { from, msg });
            return;
        }
        // A late prepare of a part this server applied (sent before a restart): answered
        // already. Taken in, it would be refused (its keys are no longer as it expects),
        // and the refusal would keep this side from acknowledging the commit (the cluster
        // simulation: the origin telling the commit forever).
        if let Msg::Prepare { txn, .. } = &msg
            && self.applied.lock().contains(txn)
        {
            return;
        }
        // A commit is taken in only where it can be applied: every table of the part is
        // here (after a restart they come back by ADD; the initiator resends meanwhile).
        if let Msg::Decision {
            txn, commit: true, ..
        } = &msg
        {
            // Known: a part of it is prepared here, this server's own part was applied
            // here, or a part taken over here (acknowledged for its owner).
            let known = self.prepared.lock().contains_key(txn)
                || self.applied.lock().contains(txn)
                || self.adopted.lock().contains_key(txn);
            if !known {
                return;
            }
            if !self.hosted(txn) {
                return;
            }
        }
        self.step_part(participant::Event::Message { from, msg });
    }

    fn hosted(&self, txn: &TxnId) -> bool {
        let Some(part) = self.prepared.lock().get(txn).cloned() else {
            return true;
        };
        let Some(shared) = self.shared() else {
            return false;
        };
        let core = shared.core();
        part.locks
            .iter()
            .all(|k| core.engine.table_index(txn_plan::table_key(k)).is_some())
    }

    fn step_init(&self, ev: initiator::Event) {
        let Some(sides) = self.sides.get() else {
            return;
        };
        let now = self.now_ms();
        let effects = sides.lock().init.step(ev, now);
        self.carry(effects);
    }

    /// A part in doubt asks its origin. If the origin died for good, nobody answers: so
    /// its journals are read too, from the attempt's incarnation on, and once all of them
    /// are sealed they decide it (a commit decision in one of them, or presumed abort).
    /// The store is shared, so this is "asking whoever holds the origin's journal now",
    /// with no server in between. On a blocking thread; one read per attempt at a time.
    fn ask_sealed_origin(&self, txn: TxnId) {
        let (Some(this), Some(shared), Some(io)) = (
            self.this.get().and_then(Weak::upgrade),
            self.shared(),
            self.io.get(),
        ) else {
            return;
        };
        if !self.resolving.lock().insert(txn) {
            return;
        }
        io.later(Box::new(move || {
            let verdict = sealed_verdict(&shared, txn);
            this.resolving.lock().remove(&txn);
            match verdict {
                Ok(Some(commit)) => {
                    tracing::info!(
                        "transaction {txn:?}: its origin's journals are sealed and say {}",
                        if commit { "commit" } else { "abort" }
                    );
                    this.step_part(participant::Event::OriginSealed { txn, commit });
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("transaction {txn:?}: its origin's journals: {e}"),
            }
        }));
    }

    fn step_part(&self, ev: participant::Event) {
        let Some(sides) = self.sides.get() else {
            return;
        };
        let now = self.now_ms();
        let effects = sides.lock().part.step(ev, now);
        self.carry(effects);
    }

    /// Resends, inquiries and timeouts (every [`TICK`] in a served member); also tells
    /// what became durable meanwhile.
    pub fn tick(&self) {
        let Some(sides) = self.sides.get() else {
            return;
        };
        if let Some(shared) = self.shared().filter(|_| !self.tells_durable()) {
            self.on_durable(shared.journal().durable_lsn());
        }
        let now = self.now_ms();
        let effects = {
            let mut s = sides.lock();
            let mut e = s.init.step(initiator::Event::Tick, now);
            e.extend(s.part.step(participant::Event::Tick, now));
            e
        };
        self.carry(effects);
    }

    /// Carries out effects in order; a check's answer is fed back at once (its effects
    /// join the queue). Never holds the sides' lock while taking the core's.
    fn carry(&self, effects: Vec<Effect>) {
        let Some(shared) = self.shared() else {
            return;
        };
        let mut queue: VecDeque<Effect> = effects.into();
        while let Some(e) = queue.pop_front() {
            match e {
                Effect::Send { to, msg } => {
                    let Some(out) = self.io.get() else {
                        continue;
                    };
                    if let Msg::Inquiry { txn } = &msg {
                        self.ask_sealed_origin(*txn);
                    }
                    // A part taken over is acknowledged for the server whose it was; as
                    // this server only if its own part was here too (see `own`).
                    if let Msg::Ack { txn } = &msg
                        && let Some(for_them) = self.adopted.lock().get(txn).cloned()
                    {
                        for s in &for_them {
                            out.send(*s, to, msg.clone());
                        }
                        let ours =
                            self.own.lock().contains(txn) || self.applied.lock().contains(txn);
                        if !ours || for_them.contains(&self.me) {
                            continue;
                        }
                    }
                    out.send(self.me, to, msg);
                }
                Effect::Append(record) => self.append(&shared, record),
                Effect::Check { txn, part } => {
                    let ok = {
                        let core = shared.core();
                        txn_plan::check_part(&core.engine, &part)
                    };
                    if let Err(why) = &ok {
                        tracing::debug!("transaction {txn:?} refused here: {why}");
                    }
                    let ev = participant::Event::Checked {
                        txn,
                        ok: ok.is_ok(),
                    };
                    let Some(sides) = self.sides.get() else {
                        return;
                    };
                    let now = self.now_ms();
                    queue.extend(sides.lock().part.step(ev, now));
                }
                // Turned into the engine's mutations with its `Applied` record, under one
                // hold of the core lock (see `Event::TxnRecord`).
                Effect::Apply { txn, mutations } => {
                    self.applies.lock().insert(txn, mutations);
                }
                // Operations on these keys were told to ask again; nothing waits here.
                Effect::Released { .. } => {}
                Effect::Reply {
                    client,
                    seq,
                    outcome,
                } => {
                    let kept = self.outcomes.lock().remove(&(client, seq)).flatten();
                    if outcome == Outcome::Committed && seq != 0 {
                        shared.step(Event::TxnAnswered { client, seq, kept });
                    }
                    let waiters = self.waiting.lock().remove(&(client, seq));
                    for w in waiters.into_iter().flatten() {
                        let _ = w.send(outcome);
                    }
                }
            }
        }
    }

    /// Journals a record (a commit's `Applied` with its engine mutations, applied to the
    /// tables under the same hold of the core lock) and tells its side once durable.
    fn append(&self, shared: &Arc<Shared>, record: Record) {
        let changes = match &record {
            Record::Applied { txn, commit: true } => match self.applies.lock().remove(txn) {
                Some(m) => m,
                None => {
                    tracing::error!("transaction {txn:?}: a commit without its changes");
                    return;
                }
            },
            _ => Vec::new(),
        };
        let kept = match &record {
            Record::Decided { client, seq, .. } => self
                .outcomes
                .lock()
                .get(&(*client, *seq))
                .copied()
                .flatten(),
            _ => None,
        };
        let Some(lsn) = self.journal_record(shared, &record, &changes, kept) else {
            return;
        };
        match &record {
            Record::Prepared { txn, part, .. } => {
                self.prepared.lock().insert(*txn, part.clone());
                self.open.lock().insert((*txn, false), lsn);
                self.own.lock().insert(*txn);
            }
            Record::Applied { txn, .. } => {
                self.prepared.lock().remove(txn);
                self.open.lock().remove(&(*txn, false));
                if !self.own.lock().remove(txn) {
                    return self.queue_durable(shared, lsn, record);
                }
                let mut applied = self.applied.lock();
                applied.insert(*txn);
                while applied.len() > APPLIED_KEPT {
                    applied.pop_first();
                }
            }
            Record::Decided {
                txn,
                decision: Decision::Commit,
                ..
            } => {
                self.open.lock().insert((*txn, true), lsn);
            }
            Record::Forgotten { txn } => {
                self.open.lock().remove(&(*txn, true));
            }
            // Journaled by `adopt_from` itself, not by a side's effect.
            Record::Decided { .. } | Record::Adopted { .. } => {}
        }
        self.queue_durable(shared, lsn, record);
    }

    /// Tells `record`'s side once `lsn` is durable.
    fn queue_durable(&self, shared: &Shared, lsn: u64, record: Record) {
        self.undurable.lock().entry(lsn).or_default().push(record);
        // It may be durable already (a flush that ended before it was queued).
        if !self.tells_durable() {
            self.on_durable(shared.journal().durable_lsn());
        }
    }

    fn tells_durable(&self) -> bool {
        self.io.get().is_some_and(|io| io.tells_durable())
    }

    /// Tells each side the records of its that are durable up to `durable`, in order.
    pub fn on_durable(&self, durable: u64) {
        loop {
            let next = {
                let mut undurable = self.undurable.lock();
                match undurable.first_entry() {
                    Some(e) if *e.key() <= durable => e.remove(),
                    _ => return,
                }
            };
            for record in next {
                self.durable(record);
            }
        }
    }

    fn durable(&self, record: Record) {
        match &record {
            Record::Prepared { .. } => maybe_crash(&self.crash, CrashAt::Prepared),
            Record::Decided {
                decision: Decision::Commit,
                ..
            } => maybe_crash(&self.crash, CrashAt::Decided),
            _ => {}
        }
        if record.by_initiator() {
            self.step_init(initiator::Event::Durable(record));
        } else {
            self.step_part(participant::Event::Durable(record));
        }
    }

    /// One journal record for `record` (and a commit's changes, applied here first; a
    /// commit decision's entry keeps `kept` for the reply cache); returns its LSN, `None`
    /// if nothing was journaled.
    fn journal_record(
        &self,
        shared: &Shared,
        record: &Record,
        changes: &[TxnMutation],
        kept: Option<kochab_proto::InodeId>,
    ) -> Option<u64> {
        // A commit decision carries its client and seq in the entry, so the reply cache
        // rebuilt from the journal answers a retry; other records name no request.
        let (client, seq) = match record {
            Record::Decided {
                client,
                seq,
                decision: Decision::Commit,
                ..
            } => (*client, *seq),
            _ => (0, 0),
        };
        let outcome = if seq == 0 { None } else { kept };
        let encode = |buf, muts: &[Mutation]| {
            txn_wire::encode_entry(buf, client, seq, outcome, muts, record)
        };
        let recorded = shared
            .step(Event::TxnRecord {
                changes,
                encode: &encode,
            })
            .record;
        match recorded {
            Some(TxnRecorded::Journaled(lsn)) => Some(lsn),
            // Its keys were locked since the check: a bug, or the table left while the
            // transaction held it. The commit is not acknowledged (its locks stay; the
            // initiator keeps asking).
            Some(TxnRecorded::NotApplicable(why)) => {
                tracing::error!("a committed transaction cannot be applied here: {why}");
                None
            }
            // Memory may be ahead of the journal now: the server stops (fail-stop), and
            // nothing waits for this record (it never becomes durable).
            Some(TxnRecorded::Failed(why)) => {
                shared.journal().fail_stop(why);
                None
            }
            None => {
                shared
                    .journal()
                    .fail_stop("a transaction record was not journaled".into());
                None
            }
        }
    }
}

/// Longest a committed link's reply waits for this server's own part to be applied
/// (normally one local message and one journal write), for its attributes.
const LINK_ATTR_WAIT: Duration = Duration::from_secs(1);

/// The reply to a committed link: its inode's attributes (held here, see `txn_plan`) once
/// its part is applied here (its ctime is the plan's `time`), else as they will be if
/// `late`; ESTALE if the inode is gone already (as a retry of a removed link target is
/// answered). `None`: not applied here yet, ask again.
fn linked_reply(
    shared: &Shared,
    id: kochab_proto::InodeId,
    time: kochab_proto::TimeNs,
    late: bool,
) -> Option<Reply> {
    let inode = shared.core().engine.inode(id).cloned();
    match inode {
        Some(i) if i.ctime == time => Some(Reply::Entry(i.attr(id))),
        Some(mut i) if late => {
            i.nlink += 1;
            i.ctime = time;
            Some(Reply::Entry(i.attr(id)))
        }
        None => Some(Reply::Error(fs_err!(
            ESTALE,
            "linked, then removed before the reply"
        ))),
        Some(_) => None,
    }
}

/// The protocol's timers, with the deliberate bugs a simulation switched on.
fn protocol_config(shared: &Shared) -> TxnConfig {
    use kochab_breaks::Break as B;
    let broken = if shared.has_break(B::TxnCommitBeforeAllPrepared) {
        Some(kochab_cluster::txn::Break::CommitBeforeAllPrepared)
    } else if shared.has_break(B::TxnAckBeforeDurable) {
        Some(kochab_cluster::txn::Break::AckBeforeDurable)
    } else {
        None
    };
    TxnConfig {
        broken,
        ..TxnConfig::default()
    }
}

/// This server's previous incarnation's journal, if the store still has it.
fn previous_journal(shared: &Shared, me: JournalId) -> Result<Option<JournalId>, String> {
    let journals = kochab_journal::segment::list_journals(shared.store().as_ref())
        .map_err(|e| format!("cannot list journals: {e}"))?;
    Ok(journals
        .into_iter()
        .filter(|j| j.server == me.server && j.epoch < me.epoch)
        .max_by_key(|j| j.epoch))
}

/// The transaction records of journal `prev`, in order. Every open one is there:
/// trimming keeps them (`keep_from`).
/// Each with what its entry keeps for the reply cache (a committed link's inode).
fn journal_records(
    shared: &Shared,
    prev: JournalId,
) -> Result<Vec<(Record, Option<kochab_proto::InodeId>)>, String> {
    let store = shared.store();
    let ins = kochab_journal::inspect(store.as_ref(), prev)
        .map_err(|e| format!("cannot read {prev}: {e}"))?;
    let first = ins
        .segments
        .iter()
        .filter_map(|s| s.lsns.map(|(f, _)| f))
        .min();
    let Some(first) = first else {
        return Ok(Vec::new());
    };
    let mut records = Vec::new();
    kochab_journal::recover_range(
        store.as_ref(),
        prev,
        first - 1,
        Some(ins.chain_end),
        |_, payload| {
            if let Some(r) = txn_wire::decode_entry(payload)? {
                records.push(r);
            }
            Ok(())
        },
    )
    .map_err(|e| format!("cannot read {prev}: {e}"))?;
    Ok(records)
}

/// Whether attempt `txn` committed, by its origin's journals from the attempt's
/// incarnation on, if every one of them is sealed: a commit decision in one of them, else
/// none ever will be (a sealed journal takes no more records; a later incarnation never
/// decides an earlier one's attempt, it only tells again the commits it found). `None`
/// while one still runs (its server answers) or if none is left (nobody is in doubt
/// then: a journal goes only once every commit in it is acknowledged).
fn sealed_verdict(shared: &Shared, txn: TxnId) -> Result<Option<bool>, String> {
    let store = shared.store();
    let journals: Vec<JournalId> = kochab_journal::segment::list_journals(store.as_ref())
        .map_err(|e| format!("cannot list journals: {e}"))?
        .into_iter()
        .filter(|j| j.server == u64::from(txn.origin.0) && j.epoch >= txn.epoch)
        .collect();
    if journals.is_empty() {
        return Ok(None);
    }
    for j in &journals {
        let sealed = kochab_journal::segment::is_sealed(store.as_ref(), *j)
            .map_err(|e| format!("cannot read the seal of {j}: {e}"))?;
        if !sealed {
            return Ok(None);
        }
    }
    for j in journals {
        let committed = journal_records(shared, j)?.iter().any(|(r, _)| {
            matches!(r, Record::Decided { txn: t, decision: Decision::Commit, .. } if *t == txn)
        });
        if committed {
            return Ok(Some(true));
        }
    }
    Ok(Some(false))
}

async fn tick_loop(host: Weak<TxnHost>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match host.upgrade() {
            Some(h) => h.tick(),
            None => return,
        }
    }
}

/// Sends each message to the member that holds its journal now (by the cached map), or
/// to this server's own sides. A message that cannot go is dropped: the protocol resends.
async fn send_loop(
    host: Weak<TxnHost>,
    mut rx: mpsc::UnboundedReceiver<(ServerId, ServerId, Msg)>,
    mut links: link::Links,
) {
    while let Some((from, to, msg)) = rx.recv().await {
        let Some(h) = host.upgrade() else {
            return;
        };
        if to == h.me {
            h.on_msg(from, msg);
            continue;
        }
        let Some(addr) = h
            .host
            .get()
            .and_then(|c| c.upgrade())
            .and_then(|c| c.server_addr(to))
        else {
            tracing::debug!("no address known for server {}", to.0);
            continue;
        };
        drop(h);
        links.send(&addr, from, txn_wire::encode_msg(&msg));
    }
}
