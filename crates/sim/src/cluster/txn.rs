//! Multi-server operations as transactions in the cluster simulation (issue 33,
//! `--multi-server txn`): every member runs the real transaction host
//! (`kochab_server::txn_host::TxnHost`, with the protocol's state machines of
//! `kochab_cluster::txn`) over the real core, and its messages cross a simulated network
//! that loses, repeats and reorders them, while time passes, journals flush at random
//! and a server may be killed at any step of an attempt.
//!
//! A request that needs another server's table starts its transaction where its first
//! table is, and the world then runs the network until the initiator answers (a kill of
//! the initiator loses the answer: the client sends the request again later, and the
//! reply cache must answer it if it committed). Before the next step everything in flight
//! is settled; then no server may hold a lock, a prepared part or a waiting request (no
//! lock left behind, no deadlock), and the world's checks (names as acknowledged, links
//! between servers, exact link counts) see every operation whole or absent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kochab_cluster::host::ranges::Ranges;
use kochab_cluster::txn::{Msg, Outcome};
use kochab_journal::JournalId;
use kochab_proto::cluster::ServerId;
use kochab_proto::{InodeId, Reply, Request};
use kochab_server::shared::Shared;
use kochab_server::txn_host::{MemberMap, MultiServer, Start, TxnHost, TxnIo, Waiting};
use kochab_server::txn_wire;
use tokio::sync::oneshot::error::TryRecvError;

use super::{World, wrong_server};

/// Most actions of the network one settling runs before it calls the transactions stuck
/// (a deadlock, or a lock nobody releases): far above what one attempt needs, with
/// timeouts (`TxnConfig`: inquiries every 300 ms, prepares given up after 1 s).
const PUMP_MAX: u32 = 20_000;
/// Per mille of messages lost, and of messages delivered twice.
const LOSS_PERMILLE: u64 = 60;
const DUPLICATE_PERMILLE: u64 = 60;
/// Per mille of network actions at which a server is killed (at most once per request,
/// and only where the caller can lose its answer).
const KILL_PERMILLE: u64 = 40;
/// Time passing in one network action that moves the clock (ms).
const TICK_MS: (u64, u64) = (10, 120);

/// The simulated network between the members' transaction hosts, and the slow reads
/// they run off their thread.
#[derive(Default)]
pub(super) struct Net {
    /// (from, to, encoded message) in the order sent; delivered in any order.
    messages: Mutex<Vec<(ServerId, ServerId, Vec<u8>)>>,
    /// Slow reads, by the incarnation that asked (a killed one's never run).
    jobs: Mutex<Vec<Job>>,
}

impl Net {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Nothing in flight.
    fn empty(&self) -> bool {
        Net::lock(&self.messages).is_empty() && Net::lock(&self.jobs).is_empty()
    }

    /// A killed incarnation's slow reads never finish.
    pub(super) fn forget_jobs_of(&self, dead: JournalId) {
        Net::lock(&self.jobs).retain(|(j, _)| *j != dead);
    }
}

/// A slow read and the incarnation that asked.
type Job = (JournalId, Box<dyn FnOnce() + Send>);

/// One incarnation's way onto the network.
struct SimIo {
    net: Arc<Net>,
    me: JournalId,
}

impl TxnIo for SimIo {
    fn send(&self, from: ServerId, to: ServerId, msg: Msg) {
        let bytes = txn_wire::encode_msg(&msg);
        Net::lock(&self.net.messages).push((from, to, bytes));
    }

    fn later(&self, job: Box<dyn FnOnce() + Send>) {
        Net::lock(&self.net.jobs).push((self.me, job));
    }

    fn tells_durable(&self) -> bool {
        true
    }
}

/// What a member's transaction host reads of the map: the world's.
pub(super) struct SimMap {
    ranges: Arc<RwLock<Ranges>>,
    /// Which server id holds each table (by its first id), as the world's map says.
    owners: Arc<RwLock<BTreeMap<u64, u64>>>,
    me: JournalId,
}

impl MemberMap for SimMap {
    fn owner_of(&self, id: InodeId) -> Option<ServerId> {
        let table = self.ranges.read().ok()?.table_of(id)?;
        let server = *self.owners.read().ok()?.get(&table.0)?;
        Some(ServerId(server as u32))
    }

    fn server_addr(&self, _server: ServerId) -> Option<String> {
        None
    }

    fn not_ready(&self) -> Reply {
        wrong_server()
    }

    fn journal_id(&self) -> JournalId {
        self.me
    }
}

/// A request whose transaction runs at server `at`'s incarnation `initiator`.
struct Pending {
    waiting: Waiting,
    at: usize,
    initiator: JournalId,
}

/// How a request run as a transaction ended.
pub(super) enum Ran {
    /// Its reply and LSN.
    Answered(Box<(Reply, u64)>),
    /// No transaction covers it: borrow instead.
    NotCovered,
    /// Its initiator was killed before it answered: the client sends it again later.
    Lost,
}

impl Ran {
    fn from(done: Option<(Reply, u64)>) -> Ran {
        match done {
            Some(r) => Ran::Answered(Box::new(r)),
            None => Ran::NotCovered,
        }
    }
}

impl World {
    /// What incarnation `me`'s transaction host reads of the map.
    pub(super) fn txn_map(&self, me: JournalId) -> Arc<SimMap> {
        Arc::new(SimMap {
            ranges: self.ranges.clone(),
            owners: self.owner_ids.clone(),
            me,
        })
    }

    /// Starts the transaction host of a new incarnation on the world's network.
    pub(super) fn attach_txn(&self, host: &Arc<TxnHost>, live: &Arc<Shared>, map: Arc<SimMap>) {
        let me = map.me;
        let io = Arc::new(SimIo {
            net: self.net.clone(),
            me,
        });
        if !host.attach_with(map, live, io) {
            // Transactions are off there: every multi-server operation borrows.
            self.trace(|| format!("transactions off at {me}"));
        }
    }

    /// Runs `req` (parked for a borrow at server `at`) as a transaction there, if one
    /// covers it: the network runs until the initiator answers. `may_kill`: a server may
    /// be killed meanwhile (the caller can lose the answer).
    pub(super) fn run_txn(
        &mut self,
        at: usize,
        session: u64,
        req: &Request,
        may_kill: bool,
    ) -> Result<Ran, String> {
        let s = self.servers[at].live.clone();
        let Some(host) = s.txn_host() else {
            return Ok(Ran::NotCovered);
        };
        let waiting = match host.start(&s, session, req) {
            Start::Done(done) => {
                self.trace(|| format!("{:?}: no transaction ({:?})", req.op, done.is_some()));
                return Ok(Ran::from(done));
            }
            Start::Waiting(w) => w,
        };
        // Nothing here keeps the initiator alive: a kill drops its host, and the answer.
        drop((s, host));
        self.stats.txns += 1;
        let initiator = self.servers[at].live.journal().id();
        self.trace(|| format!("{} runs as a transaction at {initiator}", req.op.name()));
        let mut waiting = Some(Pending {
            waiting,
            at,
            initiator,
        });
        let outcome = self.pump(&mut waiting, may_kill)?;
        let (Some(outcome), Some(p)) = (outcome, waiting) else {
            self.trace(|| format!("{initiator} was killed before it answered"));
            return Ok(Ran::Lost);
        };
        if outcome == Outcome::Committed {
            self.stats.txn_commits += 1;
        }
        // The rest (the parts applied, acknowledged, forgotten) runs in the step's
        // settling, where a server may be killed too.
        let s = self.servers[at].live.clone();
        let Some(host) = s.txn_host().filter(|_| s.journal().id() == initiator) else {
            return Ok(Ran::Lost);
        };
        Ok(Ran::from(host.finish_now(&s, outcome, &p.waiting)))
    }

    /// Runs the network, with no kill, until nothing is in flight and no server holds a
    /// lock, a part or a waiting request (else the error says what stays held).
    pub(super) fn settle_txns(&mut self) -> Result<(), String> {
        self.settle_txns_or_kill(false)
    }

    /// [`World::settle_txns`]; `may_kill`: a server may be killed once meanwhile (after a
    /// step, when no client waits for an answer).
    pub(super) fn settle_txns_or_kill(&mut self, may_kill: bool) -> Result<(), String> {
        if self.multi_server == MultiServer::Borrow {
            return Ok(());
        }
        self.pump(&mut None, may_kill).map(|_| ())
    }

    /// Runs the network: delivers, loses and repeats messages, runs slow reads, flushes
    /// journals, lets time pass (ticks), and may kill a server once; until `waiting` has
    /// its outcome (`None` if its initiator went), or, without one, until nothing is in
    /// flight and every host is quiet.
    fn pump(
        &mut self,
        waiting: &mut Option<Pending>,
        mut may_kill: bool,
    ) -> Result<Option<Outcome>, String> {
        for _ in 0..PUMP_MAX {
            self.flushes_done();
            if let Some(p) = waiting.as_mut() {
                if self.servers[p.at].live.journal().id() != p.initiator {
                    *waiting = None;
                    return Ok(None);
                }
                match p.waiting.outcome.try_recv() {
                    Ok(o) => return Ok(Some(o)),
                    Err(TryRecvError::Closed) => {
                        *waiting = None;
                        return Ok(None);
                    }
                    Err(TryRecvError::Empty) => {}
                }
            } else if self.net.empty() && self.hosts_quiet() {
                return Ok(None);
            }
            match self.rng.range(0, 99) {
                0..=59 => self.deliver_one(),
                60..=69 => self.run_job(),
                70..=84 => {
                    let i = self.rng.range(0, self.servers.len() as u64 - 1) as usize;
                    self.flush(i)?;
                    self.after_flush();
                }
                _ => {
                    let ms = self.rng.range(TICK_MS.0, TICK_MS.1);
                    self.advance(Duration::from_millis(ms))?;
                    for s in &self.servers {
                        if let Some(h) = s.live.txn_host() {
                            h.tick();
                        }
                    }
                }
            }
            // A kill may come before the writes the action asked for (a record appended,
            // its message sent, the process gone before the write): they are lost there.
            if may_kill && self.rng.chance(KILL_PERMILLE) {
                may_kill = false;
                self.stats.txn_kills += 1;
                self.kill(false)?;
            }
        }
        Err(format!(
            "transactions did not settle in {PUMP_MAX} network actions (a deadlock, or a \
             lock never released): {}",
            self.servers
                .iter()
                .filter_map(|s| Some(format!("server {}: {}", s.id, s.live.txn_host()?.busy()?)))
                .collect::<Vec<_>>()
                .join("; ")
        ))
    }

    /// The flushes the last action asked for (a transaction's records ask at once) end
    /// before the next one, and each host is told what is durable (which may append and
    /// flush more): a seed replays exactly, whenever the journals' threads wrote.
    pub(super) fn flushes_done(&self) {
        for s in &self.servers {
            let journal = s.live.journal();
            loop {
                journal.wait_asked();
                let last = journal.last_lsn();
                if let Some(h) = s.live.txn_host() {
                    h.on_durable(journal.durable_lsn());
                }
                if journal.last_lsn() == last {
                    break;
                }
            }
        }
    }

    fn hosts_quiet(&self) -> bool {
        self.servers
            .iter()
            .all(|s| s.live.txn_host().is_none_or(|h| h.busy().is_none()))
    }

    /// One message reaches the live incarnation of its server id, or is lost, or arrives
    /// twice (a copy stays in flight).
    fn deliver_one(&mut self) {
        let n = Net::lock(&self.net.messages).len();
        if n == 0 {
            return;
        }
        let k = self.rng.range(0, n as u64 - 1) as usize;
        let (from, to, bytes) = if self.rng.chance(DUPLICATE_PERMILLE) {
            self.stats.txn_msgs_repeated += 1;
            Net::lock(&self.net.messages)[k].clone()
        } else {
            Net::lock(&self.net.messages).swap_remove(k)
        };
        if self.rng.chance(LOSS_PERMILLE) {
            self.stats.txn_msgs_lost += 1;
            return;
        }
        self.stats.txn_msgs += 1;
        self.trace(|| match txn_wire::decode_msg(&bytes) {
            Ok(m) => format!("txn {} -> {}: {m:?}", from.0, to.0),
            Err(e) => format!("txn {} -> {}: {e}", from.0, to.0),
        });
        let host = self
            .servers
            .iter()
            .find(|s| s.id == u64::from(to.0))
            .and_then(|s| s.live.txn_host());
        if let Some(h) = host {
            h.deliver(from, &bytes);
        }
    }

    /// One slow read (a part in doubt reading its origin's sealed journals) finishes.
    fn run_job(&mut self) {
        let job = {
            let mut jobs = Net::lock(&self.net.jobs);
            match jobs.len() {
                0 => None,
                n => Some(jobs.swap_remove(self.rng.range(0, n as u64 - 1) as usize)),
            }
        };
        if let Some((_, job)) = job {
            job();
        }
    }
}
