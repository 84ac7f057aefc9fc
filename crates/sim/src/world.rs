//! One seeded run: a server's real core over an in-memory store, clients that get early
//! replies and replay them, and faults, with the invariants checked after every step.

use std::sync::Arc;
use std::time::Duration;

use kochab_breaks::{Break, Breaks};
use kochab_cluster::sim::Rng;
use kochab_journal::{JournalId, JournalOptions};
use kochab_meta::{EngineConfig, IdPolicy, initial_table_ranges};
use kochab_proto::{Credentials, InodeId, Op, Reply, ReplyMode, Request, mode};
use kochab_server::clock::SimulatedClock;
use kochab_server::replaytags::SessionTags;
use kochab_server::server::{SimulatedServer, core_for_simulation};
use kochab_server::shared::Shared;
use kochab_store::{MemLoss, MemStore, ObjectStore};

use crate::data::DataClients;
use crate::exec::{Answered, exec_at};
use crate::lease::LeaseClients;
use crate::model::{DIRS, Model, NAMES, Planned, SHARED};
use crate::names::{Client, Kept};
use crate::step::{Ctx, SimStats};

/// Session of the set-up requests (the clients' directories).
const SETUP_SESSION: u64 = 1;
/// Names in the shared directory that every client uses (only with
/// [`SimConfig::cross_client`]): one client's change may depend on another's.
pub(crate) const SHARED_NAMES: [&str; 4] = ["s0", "s1", "s2", "s3"];
/// A journal that flushes only when the simulation asks: longer than any run.
const NEVER: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// Small segments (a server takes at least 256 KiB, for the largest records, which no
/// simulated client makes): rollovers happen within a run, and every crash image copies
/// less (a segment is zero-filled to full length when made).
const SEGMENT_BYTES: u64 = 64 << 10;
/// The simulated clock's wall time at the start of every run (2026-01-01 UTC): file
/// times depend on the seed alone.
pub(crate) const WALL_START_NS: i64 = 1_767_225_600_000_000_000;
/// Time between two steps, at most (at least 1 ms: no two steps happen at one instant,
/// as none do on a real machine): 200 steps take a few seconds, about a lease.
pub(crate) const STEP_MS_MAX: u64 = 25;
/// A pause of everything (a stopped VM, a stalled machine): up to past a lease and a
/// callback deadline, from less than `CALLBACK_SLOW`.
const PAUSE_MS: (u64, u64) = (200, 8000);

/// What a seed draws first, the same in both worlds: the engine's keys, the tables the id
/// policy makes, the cluster key.
pub(crate) struct Seeded {
    pub(crate) engine: EngineConfig,
    pub(crate) ranges: Vec<(u64, u64)>,
    pub(crate) key: kochab_proto::auth::ClusterKey,
}

impl Seeded {
    pub(crate) fn draw(rng: &mut Rng) -> Result<Seeded, String> {
        let engine = EngineConfig::with_key([rng.next_u64(), rng.next_u64()]);
        let policy = IdPolicy::new(engine.id_policy.clone()).map_err(err)?;
        let ranges = initial_table_ranges(&policy, engine.primary_tables).map_err(err)?;
        let mut key = [0u8; 32];
        for (i, b) in key.iter_mut().enumerate() {
            *b = (rng.next_u64() >> (i % 8)) as u8;
        }
        Ok(Seeded {
            engine,
            ranges,
            key,
        })
    }
}

/// A simulated server's journal: small segments, flushed only when the simulation asks,
/// its spare segment prepared inline (a seed replays exactly).
pub(crate) fn journal_options(breaks: Breaks) -> JournalOptions {
    JournalOptions {
        segment_bytes: SEGMENT_BYTES,
        fsync: true,
        lazy_flush: NEVER,
        breaks,
        spare_inline: true,
        held_flushes: true,
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Steps (each one operation or fault, then the checks).
    pub steps: u64,
    pub clients: usize,
    /// Clients of file data (see `data`).
    pub data_clients: usize,
    /// Deliberate bugs switched on in the real code.
    pub breaks: Breaks,
    /// Also changes of names that every client uses in the shared directory, whose
    /// outcome depends on the other clients' changes (checked for consistency, and by
    /// their replays). On by default: the server answers such a change early only once
    /// what it depended on is durable (`kochab_server::unsettled`).
    pub cross_client: bool,
    /// Print each step.
    pub trace: bool,
}

impl SimConfig {
    /// The default run of `seed`.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            steps: 200,
            clients: 3,
            data_clients: 2,
            breaks: Breaks::NONE,
            cross_client: true,
            trace: false,
        }
    }
}

struct World {
    cfg: SimConfig,
    rng: Rng,
    store: MemStore,
    engine: EngineConfig,
    ranges: Vec<(u64, u64)>,
    key: kochab_proto::auth::ClusterKey,
    epoch: u64,
    live: Option<Arc<Shared>>,
    clients: Vec<Client>,
    data: DataClients,
    leases: Option<LeaseClients>,
    shared_dir: InodeId,
    stats: SimStats,
    /// The time of every incarnation's core and of the clients: it moves only between
    /// steps (and in pauses), so a seed replays exactly.
    clock: SimulatedClock,
    _rt: tokio::runtime::Runtime,
}

/// Runs one seed; `Err` says which invariant broke, at which step.
pub fn run(cfg: SimConfig) -> Result<SimStats, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| format!("no runtime: {e}"))?;
    let _enter = rt.enter();
    let mut w = World::new(cfg, rt)?;
    w.setup()?;
    for step in 0..w.cfg.steps {
        if let Some(s) = w.live.as_ref().filter(|_| w.cfg.trace) {
            let (d, l) = (s.journal().durable_lsn(), s.journal().last_lsn());
            let lost: Vec<_> = w
                .clients
                .iter()
                .filter_map(|c| {
                    let (r, _) = c.lost.as_ref()?;
                    Some((c.session, r.seq, s.reply_cached(c.session, r.seq)))
                })
                .collect();
            w.trace(|| {
                format!("step {step}: durable {d} of {l}, lost (session, seq, cached) {lost:?}")
            });
        }
        w.tick()
            .and_then(|()| w.step())
            .and_then(|()| w.settle())
            .and_then(|()| w.check())
            .map_err(|e| format!("seed {} step {step}: {e}", w.cfg.seed))?;
    }
    // The faults are over: every kept reply must become durable as it is.
    w.flush()?;
    w.after_flush();
    w.check()
        .map_err(|e| format!("seed {} at the end: {e}", w.cfg.seed))?;
    Ok(w.stats)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl World {
    fn new(cfg: SimConfig, rt: tokio::runtime::Runtime) -> Result<World, String> {
        let mut rng = Rng::new(cfg.seed);
        let Seeded {
            engine,
            ranges,
            key,
        } = Seeded::draw(&mut rng)?;
        Ok(World {
            cfg,
            rng,
            store: MemStore::new(),
            engine,
            ranges,
            key,
            epoch: 0,
            live: None,
            clients: Vec::new(),
            data: DataClients::default(),
            leases: None,
            shared_dir: 0,
            stats: SimStats::default(),
            clock: SimulatedClock::new(WALL_START_NS),
            _rt: rt,
        })
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.cfg.trace {
            eprintln!("[{}] {}", self.cfg.seed, what());
        }
    }

    /// Starts a new incarnation over the current store (recovering what it holds).
    fn start(&mut self, crashed: bool) -> Result<Arc<Shared>, String> {
        self.epoch += 1;
        let me = JournalId {
            server: 1,
            epoch: self.epoch,
        };
        let store: Arc<dyn ObjectStore> = Arc::new(self.store.clone());
        let recovered = kochab_server::recovery::recover_tables(
            store.as_ref(),
            self.engine.clone(),
            &self.ranges,
            me,
            None,
            None,
            Vec::new(),
        )
        .map_err(|e| format!("recovery of epoch {}: {e}", self.epoch))?;
        self.trace(|| {
            let j = &recovered.journal;
            let m: Vec<String> = recovered
                .manifests
                .iter()
                .map(|m| format!("{:x}:{:?}", m.lo >> 56, m.journals))
                .collect();
            format!(
                "epoch {}: replayed {} skipped {} last {} next {}; {m:?}",
                self.epoch, j.replayed, j.skipped, j.last_lsn, recovered.next_lsn
            )
        });
        let sim = SimulatedServer {
            store,
            key: self.key,
            me,
            journal: journal_options(self.cfg.breaks),
            crashed,
            breaks: self.cfg.breaks,
            member: None,
            clock: self.clock.clock(),
        };
        core_for_simulation(sim, recovered).map_err(|e| format!("start: {e}"))
    }

    fn live(&self) -> Result<&Arc<Shared>, String> {
        self.live.as_ref().ok_or_else(|| "no server".to_string())
    }

    /// The first incarnation, and the directories of every client (durable).
    fn setup(&mut self) -> Result<(), String> {
        let s = self.start(false)?;
        let root = s.root();
        self.live = Some(s);
        let mkdir = |w: &mut World, name: String| -> Result<InodeId, String> {
            let op = Op::Mkdir {
                parent: root,
                name: name.into_bytes(),
                mode: 0o777,
            };
            let req = Request::plain(&Credentials::root(), op);
            let (reply, _) = w.exec(SETUP_SESSION, req)?;
            reply
                .entry()
                .map(|a| a.id)
                .ok_or_else(|| format!("set-up mkdir answered {reply:?}"))
        };
        self.shared_dir = mkdir(self, "shared".into())?;
        for c in 0..self.cfg.clients {
            let mut dirs = [self.shared_dir; DIRS];
            for (d, slot) in dirs.iter_mut().enumerate().filter(|(d, _)| *d != SHARED) {
                *slot = mkdir(self, format!("c{c}-{d}"))?;
            }
            self.clients.push(Client::new(c, dirs));
        }
        let s = self.live()?.clone();
        self.data = DataClients::setup(self.cfg.data_clients, &s, root)?;
        self.leases = Some(LeaseClients::setup(&s, root)?);
        self.flush()
    }

    /// Runs one request at the live server: its reply and the LSN that must be durable
    /// before the reply may count as durable.
    fn exec(&mut self, session: u64, req: Request) -> Result<(Reply, u64), String> {
        let s = self.live()?.clone();
        let a = exec_at(&s, session, req)?;
        Ok((a.reply, a.lsn))
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.range(0, 101) {
            54..=65 if !self.data.is_empty() => self.data_op(),
            66..=71 if self.leases.is_some() => self.lease_op(),
            0..=71 => {
                let c = self.rng.range(0, self.cfg.clients as u64 - 1) as usize;
                self.client_op(c)
            }
            72..=83 => self.flush(),
            84..=86 => self.checkpoint(),
            87..=90 => self.kill(),
            91..=94 => self.power_loss(),
            95..=99 => self.fence(),
            _ => self.pause(),
        }
    }

    /// Time passes between two steps: a few milliseconds.
    fn tick(&mut self) -> Result<(), String> {
        let by = Duration::from_millis(self.rng.range(1, STEP_MS_MAX));
        self.advance(by)
    }

    /// Everything stops for a while (up to past a lease): leases run out, callbacks reach
    /// their deadlines.
    fn pause(&mut self) -> Result<(), String> {
        self.stats.pauses += 1;
        let by = Duration::from_millis(self.rng.range(PAUSE_MS.0, PAUSE_MS.1));
        self.trace(|| format!("pause of {by:?}"));
        self.advance(by)
    }

    /// Moves the clock on by `by`, and the live server does what its timers do then: the
    /// callbacks whose deadline passed end (as `server::cleanup_loop` ends them).
    fn advance(&mut self, by: Duration) -> Result<(), String> {
        let s = self.live()?.clone();
        if let Some(l) = &mut self.leases {
            let mut cx = Ctx {
                rng: &mut self.rng,
                rt: &self._rt,
                stats: &mut self.stats,
                trace: self.cfg.trace.then_some(self.cfg.seed),
            };
            l.before_time_passes(&mut cx, &s)?;
        }
        self.clock.advance(by);
        let expired = s.expire_callbacks();
        if expired.missed > 0 {
            self.stats.defaults += expired.defaulted.len() as u64;
            self.trace(|| format!("callbacks ran out: {expired:?}"));
        }
        Ok(())
    }

    /// Writes whose callbacks are now done are acknowledged (checked).
    fn settle(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        match &mut self.leases {
            Some(l) => l.settle(&mut self.stats, &s),
            None => Ok(()),
        }
    }

    /// The next request of client `c`: its lost one again, or a new one.
    fn next_request(&mut self, c: usize) -> (Request, Option<Planned>) {
        if let Some(again) = self.clients[c].lost.take() {
            return again;
        }
        let floor = self.clients[c].seq_floor();
        let cl = &mut self.clients[c];
        let seq = cl.next_seq;
        cl.next_seq += 1;
        let (op, planned) = if !self.cfg.cross_client || self.rng.chance(700) {
            let p = cl.model.plan(&mut self.rng, &cl.dirs);
            (p.op.clone(), Some(p))
        } else {
            let live = self.live.clone();
            let dir = self.shared_dir;
            let lookup = |name: &[u8]| live.as_ref()?.lookup(dir, name);
            (shared_op(&mut self.rng, dir, lookup), None)
        };
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
        (req, planned)
    }

    fn client_op(&mut self, c: usize) -> Result<(), String> {
        let (req, planned) = self.next_request(c);
        let session = self.clients[c].session;
        let s = self.live()?.clone();
        let Answered { reply, lsn, early } = exec_at(&s, session, req.clone())?;
        self.stats.ops += 1;
        if !early && lsn > s.journal().durable_lsn() {
            s.journal().flush_now();
            if !s.journal().wait_durable(lsn) {
                return Err("the live journal failed".into());
            }
            self.after_flush();
        }
        if self.rng.chance(40) {
            // The reply is lost on its way: the client sends the request again later.
            self.stats.dropped_replies += 1;
            self.trace(|| format!("client {c}: reply to seq {} lost", req.seq));
            self.clients[c].lost = Some((req, planned));
            return Ok(());
        }
        self.accept(c, &s, req, planned, reply, lsn)
    }

    /// Client `c` takes in `reply` from server `s`: checked against its model, and kept
    /// for replay while its record may not be durable.
    fn accept(
        &mut self,
        c: usize,
        s: &Shared,
        req: Request,
        planned: Option<Planned>,
        reply: Reply,
        lsn: u64,
    ) -> Result<(), String> {
        self.trace(|| {
            format!(
                "client {c}: seq {} {:?} -> {reply:?} @{lsn}",
                req.seq, req.op
            )
        });
        let cl = &mut self.clients[c];
        match &planned {
            Some(p) => {
                let created = Model::check(p, &reply).map_err(|e| format!("client {c}: {e}"))?;
                cl.model.apply(p.change, created);
            }
            None => check_shared(&reply).map_err(|e| format!("client {c}: {e}"))?,
        }
        let early = req.mode == ReplyMode::Early;
        if early && lsn > s.journal().durable_lsn() && !matches!(reply, Reply::Error(_)) {
            let tag = SessionTags::new(s.replay_key(), cl.session).tag(&req, &reply);
            cl.kept.push(Kept {
                req,
                reply,
                lsn,
                at: s.journal().id(),
                tag,
                planned,
            });
        }
        Ok(())
    }

    /// Makes everything appended durable, and tells the clients.
    fn flush(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        s.journal().flush_now();
        if !s.journal().wait_durable(s.journal().last_lsn()) {
            return Err("the live journal failed".into());
        }
        self.stats.flushes += 1;
        // The clients learn it (a frame on each connection) unless a crash comes first.
        if self.rng.chance(800) {
            self.after_flush();
        }
        Ok(())
    }

    /// Clients drop the kept requests the live journal now holds.
    fn after_flush(&mut self) {
        let Some(s) = &self.live else { return };
        let durable = s.journal().durable_lsn();
        for cl in &mut self.clients {
            cl.kept.retain(|k| k.lsn > durable);
        }
        self.data.after_flush(durable);
    }

    /// One operation of a data client.
    fn data_op(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        let mut cx = Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        };
        self.data.step(&mut cx, &s)
    }

    /// One step of the lease holder or of the writer that changes what it caches.
    fn lease_op(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        let mut cx = Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        };
        match &mut self.leases {
            Some(l) => l.step(&mut cx, &s),
            None => Ok(()),
        }
    }

    fn checkpoint(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        let report = s.checkpointer().round(&s);
        let report = report.map_err(|e| format!("checkpoint: {e}"))?;
        self.stats.journals_deleted += report.journals_deleted as u64;
        self.trace(|| "checkpoint".into());
        self.stats.checkpoints += 1;
        Ok(())
    }

    /// kill -9: what the process wrote stays (the page cache survives it).
    fn kill(&mut self) -> Result<(), String> {
        self.stats.kills += 1;
        self.trace(|| "kill -9".into());
        self.data.crashed(false);
        let image = self.store.deep_clone();
        self.restart(image)
    }

    /// The machine loses power: only what was synced stays (unsynced blocks dropped, or
    /// torn at random).
    fn power_loss(&mut self) -> Result<(), String> {
        self.stats.power_losses += 1;
        let loss = match self.rng.chance(500) {
            true => MemLoss::Drop,
            false => MemLoss::Tear {
                seed: self.rng.next_u64(),
            },
        };
        self.trace(|| format!("power loss ({loss:?})"));
        self.data.crashed(true);
        let image = self.store.crash_image(loss);
        self.restart(image)
    }

    /// The process is gone and `image` is what its store holds: a new incarnation
    /// recovers it and the clients replay what the old one answered early.
    fn restart(&mut self, image: MemStore) -> Result<(), String> {
        if let Some(old) = self.live.take() {
            // Its journal stops (flushing into the store it had, which nobody reads now).
            old.journal().shutdown();
        }
        self.store = image;
        let s = self.start(true)?;
        self.live = Some(s);
        self.replay_all()
    }

    /// A pause: the server stops answering long enough that a successor takes over its
    /// journal (sealing it) while the old process still runs. A client whose connection
    /// still reaches the old one sends it a change; the old journal must not make it
    /// durable, so the client replays it at the successor.
    fn fence(&mut self) -> Result<(), String> {
        self.stats.fences += 1;
        let Some(old) = self.live.take() else {
            return Err("no server".into());
        };
        let successor = self.start(true)?;
        self.live = Some(successor);
        self.data.crashed(false);
        if !self.data.is_empty() && self.rng.chance(500) {
            let mut cx = Ctx {
                rng: &mut self.rng,
                rt: &self._rt,
                stats: &mut self.stats,
                trace: self.cfg.trace.then_some(self.cfg.seed),
            };
            self.data.write_at_old(&mut cx, &old, &|_| true)?;
        }
        let c = self.rng.range(0, self.cfg.clients as u64 - 1) as usize;
        self.trace(|| {
            format!(
                "pause; epoch {} took over; client {c} still at the old",
                self.epoch
            )
        });
        let (req, planned) = self.next_request(c);
        let mut req = req;
        req.mode = ReplyMode::Early;
        let session = self.clients[c].session;
        let Answered { reply, lsn, early } = exec_at(&old, session, req.clone())?;
        if !early && lsn > old.journal().durable_lsn() {
            // It must wait for the journal, which the successor sealed: no reply leaves.
            self.clients[c].lost = Some((req, planned));
        } else {
            self.accept(c, &old, req, planned, reply, lsn)?;
        }
        old.journal().flush_now();
        if old.journal().wait_durable(old.journal().last_lsn()) {
            // The old journal says durable: its clients believe it.
            let durable = old.journal().durable_lsn();
            self.clients[c].kept.retain(|k| k.lsn > durable);
        }
        old.journal().shutdown();
        drop(old);
        self.replay_all()
    }

    /// Every client replays what it kept, each in its own order, the clients interleaved
    /// at random (as independent mounts do); then the lost replies' requests are still to
    /// send.
    fn replay_all(&mut self) -> Result<(), String> {
        let s = self.live()?.clone();
        let mut queues: Vec<(usize, std::collections::VecDeque<Kept>)> = self
            .clients
            .iter_mut()
            .enumerate()
            .map(|(c, cl)| (c, std::mem::take(&mut cl.kept).into()))
            .collect();
        loop {
            queues.retain(|(_, q)| !q.is_empty());
            if queues.is_empty() {
                break;
            }
            let i = self.rng.range(0, queues.len() as u64 - 1) as usize;
            let c = queues[i].0;
            let Some(k) = queues[i].1.pop_front() else {
                continue;
            };
            self.replay_one(&s, c, k)?;
        }
        let mut cx = Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        };
        self.data.replay(&mut cx, &s)?;
        if let Some(l) = &mut self.leases {
            l.restarted(&s)?;
        }
        // Every client replayed: new changes run (the window's time has passed).
        s.replay_window().close();
        // Replays are answered once durable.
        s.journal().flush_now();
        if !s.journal().wait_durable(s.journal().last_lsn()) {
            return Err("the live journal failed".into());
        }
        self.after_flush();
        Ok(())
    }

    fn replay_one(&mut self, s: &Arc<Shared>, c: usize, k: Kept) -> Result<(), String> {
        self.stats.replays += 1;
        let cl = &self.clients[c];
        let want_id = k.reply.created();
        let mut req = k.req.clone();
        req.mode = ReplyMode::Replay {
            want_id,
            tag: k.tag,
        };
        req.seq_floor = cl.seq_floor().min(req.seq);
        if !SessionTags::new(s.replay_key(), cl.session).genuine(&req) {
            return Err(format!(
                "client {c}: its replay of seq {} was refused",
                req.seq
            ));
        }
        let cached = s.reply_cached(cl.session, req.seq);
        let reply = exec_at(s, cl.session, req)?.reply;
        self.trace(|| {
            format!(
                "client {c}: replay seq {} @{} (cached {cached:?}) {:?} -> {reply:?}",
                k.req.seq, k.lsn, k.req.op
            )
        });
        // The replay must tell the same story as the early reply the client acted on.
        if !k.replay_agrees(&reply) {
            return Err(format!(
                "client {c}: seq {} ({}) was answered {:?} early, its replay {reply:?}",
                k.req.seq,
                k.req.op.name(),
                k.reply
            ));
        }
        Ok(())
    }

    /// The invariants: the namespace is a tree with exact link counts, and every client's
    /// directories read as its accepted replies say.
    fn check(&self) -> Result<(), String> {
        let s = self.live()?;
        self.data.check(&|_| Ok(s.clone()))?;
        if let Some(l) = &self.leases {
            l.check(s)?;
        }
        let core = s.core();
        let problems = core.engine.check_invariants();
        if !problems.is_empty() {
            return Err(format!("namespace: {}", problems.join("; ")));
        }
        for (c, cl) in self.clients.iter().enumerate() {
            if cl.lost.is_some() {
                // Its last change may have run without the client knowing yet.
                continue;
            }
            for (d, &dir) in cl.dirs.iter().enumerate() {
                for name in NAMES {
                    let want = cl.model.names.get(&(d, name)).map(|e| e.0);
                    let have = core.engine.child(dir, &cl.model.name_of((d, name)));
                    if want != have {
                        return Err(format!(
                            "client {c}: {d}/{name} is {have:?} at the server, {want:?} as \
                             acknowledged (an acknowledged change lost or applied twice)"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Directories every client may make and remove in the shared directory, and make and
/// remove names in.
const SHARED_DIRS: [&str; 2] = ["d0", "d1"];

/// A change in the shared directory or one of its subdirectories (its outcome depends on
/// the other clients): `lookup` finds a subdirectory as the server has it now (as a
/// client's lookup before its change would).
pub(crate) fn shared_op(
    rng: &mut Rng,
    dir: InodeId,
    lookup: impl Fn(&[u8]) -> Option<InodeId>,
) -> Op {
    let pick = |rng: &mut Rng, names: &[&str]| {
        names[rng.range(0, names.len() as u64 - 1) as usize]
            .as_bytes()
            .to_vec()
    };
    // Names in the shared directory itself, or in one of its subdirectories if it is
    // there.
    let parent = match rng.range(0, 2) {
        0 => lookup(&pick(rng, &SHARED_DIRS)).unwrap_or(dir),
        _ => dir,
    };
    match rng.range(0, 4) {
        0 => Op::Mknod {
            parent,
            name: pick(rng, &SHARED_NAMES),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        },
        1 => Op::Unlink {
            parent,
            name: pick(rng, &SHARED_NAMES),
        },
        2 => Op::Rename {
            parent,
            name: pick(rng, &SHARED_NAMES),
            new_parent: parent,
            new_name: pick(rng, &SHARED_NAMES),
            flags: 0,
        },
        3 => Op::Mkdir {
            parent: dir,
            name: pick(rng, &SHARED_DIRS),
            mode: 0o755,
        },
        _ => Op::Rmdir {
            parent: dir,
            name: pick(rng, &SHARED_DIRS),
        },
    }
}

/// The answers a change in the shared directory may get.
pub(crate) fn check_shared(reply: &Reply) -> Result<(), String> {
    match reply.clone().without_dirs() {
        Reply::Entry(_) | Reply::Empty => Ok(()),
        Reply::Error(e)
            if matches!(
                e.errno,
                kochab_proto::Errno::EEXIST
                    | kochab_proto::Errno::ENOENT
                    | kochab_proto::Errno::ENOTEMPTY
                    | kochab_proto::Errno::ESTALE
            ) =>
        {
            Ok(())
        }
        other => Err(format!(
            "a change in the shared directory answered {other:?}"
        )),
    }
}

/// Whether a break is on (for the trace).
pub fn describe(breaks: Breaks) -> String {
    Break::ALL
        .iter()
        .filter(|b| breaks.has(**b))
        .map(|b| b.name())
        .collect::<Vec<_>>()
        .join(",")
}
