//! The state every connection task, the checkpointer and the admin paths share: the core
//! behind its lock, the journal, the stores, the clock. It is the core's shell: it feeds
//! [`Core::step`] its events with the time, and carries out the effects (appends the
//! records in the order the core numbered them, sends callbacks, starts flushes).

use crate::clock::Clock;
use crate::clock::Now;
use crate::core::{Answer, Cleanup, Core, Member, Parked};
use crate::data::DataStore;
use crate::leases::Expired;
use crate::metrics::Metrics;
use crate::outbox::{CallbackTx, Outbox};
use crate::replycache::Outcome;
use crate::step::{Effects, Env, Event};
use kochab_breaks::{Break, Breaks};
use kochab_journal::Journal;
use kochab_proto::*;
use kochab_store::ObjectStore;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Everything the connection tasks, the checkpointer and the admin paths share. Its fields
/// are private: each is reached through a method that says what it is for, and the core
/// lock is taken in one place, [`Shared::core`].
pub struct Shared {
    core: Mutex<Core>,
    /// The runtime the server was started on: operations that outlive one turn of a
    /// connection run there, not on a client's runtime that may serve the connection
    /// (see `kochab_local`) and end before they do.
    runtime: tokio::runtime::Handle,
    journal: Journal,
    store: Arc<dyn ObjectStore>,
    metrics: Arc<Metrics>,
    server_id: u64,
    durable_mode: bool,
    /// What `kochab status` says of the store (see `ServerConfig::store_description`).
    store_description: String,
    started: Instant,
    /// Connections open, from accept to close (see [`Shared::count_connection`]).
    connections: AtomicU64,
    /// Numbers connections (callbacks name the connection they go to).
    next_conn: AtomicU64,
    /// File data.
    data: Arc<DataStore>,
    /// Orders writes against truncation, per file (see `filelocks`).
    file_locks: crate::filelocks::FileLocks,
    /// How long a client may stay disconnected before its session ends.
    session_grace: std::time::Duration,
    /// Wakes the task that works through `Core::cleanup`.
    cleanup_wake: tokio::sync::Notify,
    /// The manifests of the hosted tables; held for a whole checkpoint round, and by a
    /// table's drop or add.
    checkpointer: Mutex<crate::manifest::Checkpointer>,
    /// Tables this member released lately, for a quick load when they come back.
    released: Mutex<crate::released::ReleasedTables>,
    /// The cluster key and the client keys, with their policies.
    keys: Arc<crate::keys::KeyStore>,
    /// Rate limit of the warnings about malformed frames (any peer can cause them).
    bad_frame_log: crate::loglimit::LogLimiter,
    /// The participant of a member under the coordinator; `None` for the single server of
    /// `kochab up`, which hosts every table and admits everything.
    cluster: Option<Arc<dyn Member>>,
    /// Random per process, sent in the welcome: a client that finds another after losing
    /// its connection replays what this process acknowledged early.
    incarnation: u64,
    /// Until when only replays are served (after a crash, see [`ReplayWindow`]).
    replay_window: ReplayWindow,
    /// Tags early replies and checks replays (the same at every server of the cluster).
    replay_key: kochab_proto::auth::ReplayKey,
    /// Grants, freed objects and compaction of file data as slice objects (`slicesvc`).
    slice_work: crate::slicework::SliceWork,
    /// Deliberate bugs switched on (only a simulation sets any, see `kochab_breaks`).
    breaks: Breaks,
    /// The clock of everything the core times (see `clock`).
    clock: Clock,
}

/// What a server's start chose for its [`Shared`] state; the rest (counters, clocks, the
/// incarnation) [`Shared::new`] makes itself.
pub(crate) struct SharedParts {
    pub core: Core,
    pub journal: Journal,
    pub store: Arc<dyn ObjectStore>,
    pub metrics: Arc<Metrics>,
    pub server_id: u64,
    pub durable_mode: bool,
    pub store_description: String,
    pub data: Arc<DataStore>,
    pub session_grace: std::time::Duration,
    pub checkpointer: crate::manifest::Checkpointer,
    pub keys: Arc<crate::keys::KeyStore>,
    pub cluster: Option<Arc<dyn Member>>,
    pub replay_key: kochab_proto::auth::ReplayKey,
    pub slice_work: crate::slicework::SliceWork,
    pub breaks: Breaks,
    pub clock: Clock,
}

impl Shared {
    /// The shared state of a server starting now, on the current runtime.
    pub(crate) fn new(parts: SharedParts) -> Shared {
        let mut core = parts.core;
        core.number_records_from(parts.journal.last_lsn() + 1);
        Shared {
            core: Mutex::new(core),
            runtime: tokio::runtime::Handle::current(),
            journal: parts.journal,
            store: parts.store,
            metrics: parts.metrics,
            server_id: parts.server_id,
            durable_mode: parts.durable_mode,
            store_description: parts.store_description,
            started: Instant::now(),
            connections: AtomicU64::new(0),
            next_conn: AtomicU64::new(1),
            data: parts.data,
            file_locks: Default::default(),
            session_grace: parts.session_grace,
            cleanup_wake: tokio::sync::Notify::new(),
            checkpointer: Mutex::new(parts.checkpointer),
            released: Default::default(),
            keys: parts.keys,
            bad_frame_log: Default::default(),
            cluster: parts.cluster,
            incarnation: kochab_proto::auth::random_u64(),
            replay_window: ReplayWindow::new(parts.clock.clone()),
            replay_key: parts.replay_key,
            slice_work: parts.slice_work,
            breaks: parts.breaks,
            clock: parts.clock,
        }
    }

    /// Takes the core lock: the one place it is taken, so that it can be measured. Hold it
    /// briefly (no I/O, no await): every request of every connection waits for it. It
    /// reads; [`Shared::step`] changes.
    pub fn core(&self) -> CoreGuard<'_> {
        CoreGuard {
            core: self.core.lock(),
            shared: self,
        }
    }

    /// The time for a step: the core's clocks and the journal's durable point.
    pub fn now(&self) -> Now {
        Now {
            wall: self.clock.wall_ns(),
            instant: self.clock.now(),
            durable: self.journal.durable_lsn(),
        }
    }

    /// Runs one event through the core ([`Core::step`]) and carries out its records and
    /// callbacks before the lock is let go; returns the rest of its effects.
    pub fn step(&self, event: Event<'_>) -> Effects {
        // Read before the lock is taken (the durable point only grows: an earlier reading
        // is conservative), so the hold is no longer than the step.
        let now = self.now();
        let mut guard = self.core();
        let core = guard.stepping();
        let mut fx = core.step(event, now, self);
        let flush = self.carry_out(&mut fx.out);
        core.reuse_outbox(&mut fx.out);
        drop(guard);
        if flush {
            self.journal.flush_now();
        }
        fx
    }

    /// Runs the core's part of a table's move (see `tablepass`).
    pub(crate) fn table_step(
        &self,
        change: crate::tablepass::TableChange<'_>,
    ) -> crate::tablepass::TableDone {
        match self.step(Event::Table(change)).table {
            Some(done) => done,
            // Every table step answers; this is only the type's other case.
            None => crate::tablepass::TableDone::NotHosted,
        }
    }

    /// Runs the metadata part of a data operation of `client` (see `datapass`).
    pub(crate) fn data_step(
        &self,
        client: u64,
        change: crate::datapass::DataChange<'_>,
    ) -> Result<crate::datapass::DataDone, FsError> {
        let fx = self.step(Event::Data { client, change });
        fx.data
            .unwrap_or_else(|| Err(fs_err!(EIO, "the core answered no data step")))
    }

    /// Appends `out`'s records to the journal in order (the caller holds the core lock, so
    /// they get the LSNs the core gave them) and sends its callbacks. Returns whether a
    /// journal flush is to start once the lock is let go.
    fn carry_out(&self, out: &mut Outbox) -> bool {
        for (lsn, payload) in out.records() {
            let got = self
                .journal
                .append_deferred(|buf| buf.extend_from_slice(payload));
            if got != lsn {
                // Something appended outside the core: memory and journal disagree.
                self.journal.fail_stop(format!(
                    "record numbered {lsn} by the core was appended as {got}"
                ));
            }
        }
        for (tx, frame) in out.callbacks.drain(..) {
            // A connection that closed meanwhile: its session's leases end with it.
            let _ = tx.send(frame);
        }
        if std::mem::take(&mut out.wake_cleanup) {
            self.wake_cleanup();
        }
        for (lsn, id, generation, objects) in out.frees.drain(..) {
            self.slice_work().free(lsn, id, generation, &objects);
        }
        for (id, generation, chunk) in out.compact.drain(..) {
            self.slice_work().compact_later(id, generation, chunk);
        }
        out.flush
    }

    /// The runtime the server was started on: spawn there what must outlive the turn of a
    /// connection that starts it.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// The journal every change is appended to.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The object store of the journal, the checkpoints and the manifests.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The Prometheus metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The number `kochab status` and the welcome name this server by.
    pub fn server_id(&self) -> u64 {
        self.server_id
    }

    /// File data.
    pub fn data(&self) -> &Arc<DataStore> {
        &self.data
    }

    /// The per-file locks that order writes against truncation.
    pub fn file_locks(&self) -> &crate::filelocks::FileLocks {
        &self.file_locks
    }

    /// How long a client may stay disconnected before its session ends.
    pub fn session_grace(&self) -> std::time::Duration {
        self.session_grace
    }

    /// Wakes the task that works through the cleanup queue.
    pub fn wake_cleanup(&self) {
        self.cleanup_wake.notify_one();
    }

    /// Waits until [`Shared::wake_cleanup`] is called.
    pub async fn cleanup_woken(&self) {
        self.cleanup_wake.notified().await;
    }

    /// The manifests of the hosted tables, locked (for a checkpoint round, or a table's
    /// drop or add).
    pub fn checkpointer(&self) -> parking_lot::MutexGuard<'_, crate::manifest::Checkpointer> {
        self.checkpointer.lock()
    }

    /// The tables this member released lately, locked.
    pub fn released(&self) -> parking_lot::MutexGuard<'_, crate::released::ReleasedTables> {
        self.released.lock()
    }

    /// The cluster key and the client keys.
    pub fn keys(&self) -> &Arc<crate::keys::KeyStore> {
        &self.keys
    }

    /// Whether a warning about a malformed frame may be logged now: `Some(n)` with the
    /// number suppressed since the last one, `None` while over the rate limit.
    pub fn may_log_bad_frame(&self) -> Option<u64> {
        self.bad_frame_log.allow(Instant::now())
    }

    /// The participant of a member under the coordinator (`None`: the single server).
    pub fn cluster(&self) -> Option<&Arc<dyn Member>> {
        self.cluster.as_ref()
    }

    /// Random per process, sent in the welcome (a client that finds another replays what
    /// it kept).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The window after a crash in which only replays run.
    pub fn replay_window(&self) -> &ReplayWindow {
        &self.replay_window
    }

    /// The key that tags early replies and checks replays.
    pub fn replay_key(&self) -> &kochab_proto::auth::ReplayKey {
        &self.replay_key
    }

    /// Grants, freed objects and compaction of file data as slice objects.
    pub fn slice_work(&self) -> &crate::slicework::SliceWork {
        &self.slice_work
    }

    /// The clock of everything the core times: leases, callbacks, sessions, the replay
    /// window, file times (the system's, but in a simulation).
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Whether the deliberate bug `b` is switched on (only ever in a simulation).
    pub(crate) fn has_break(&self, b: Break) -> bool {
        self.breaks.has(b)
    }

    /// Counts one more open connection, unless `max` are open already (then false).
    pub fn count_connection(&self, max: u64) -> bool {
        if self.connections.fetch_add(1, Ordering::Relaxed) >= max {
            self.connections.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Uncounts a connection [`Shared::count_connection`] counted.
    pub fn uncount_connection(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// The number of connections open.
    pub fn open_connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// A number for a new connection, never given before in this process.
    pub fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}

/// What the other files ask of the core with one hold of its lock. Each method does one
/// thing, so the files that take the lock themselves are those that must do several under
/// one hold (run operations, checkpoint, move tables).
impl Shared {
    /// The root directory's inode.
    pub fn root(&self) -> InodeId {
        self.core().engine.root()
    }

    /// The engine's configuration (a member started beside this server uses the same).
    pub fn engine_config(&self) -> kochab_meta::EngineConfig {
        self.core().engine.config().clone()
    }

    /// The tables hosted here, as (lo, hi) bounds of their id ranges.
    pub fn hosted_tables(&self) -> Vec<(u64, u64)> {
        let core = self.core();
        core.engine.tables().iter().map(|t| (t.lo, t.hi)).collect()
    }

    /// What the engine's invariant checker finds wrong (empty: nothing).
    pub fn check_invariants(&self) -> Vec<String> {
        self.core().engine.check_invariants()
    }

    /// The inode `name` in directory `dir` names, if any.
    pub fn lookup(&self, dir: InodeId, name: &[u8]) -> Option<InodeId> {
        self.core().engine.child(dir, name)
    }

    /// The size of file `id`, if it exists.
    pub fn file_size(&self, id: InodeId) -> Option<u64> {
        self.core().engine.inode(id).map(|i| i.size)
    }

    /// What the reply cache remembers of request `seq` of `session` (`None`: nothing).
    pub fn reply_cached(&self, session: u64, seq: u64) -> Option<Outcome> {
        self.core().replies.get(session, seq)
    }

    /// A connection of `session` begins (see [`Core::attach`]); returns the session's board.
    pub fn attach(
        &self,
        session: u64,
        conn_id: u64,
        callbacks: Option<CallbackTx>,
    ) -> Arc<crate::leases::Board> {
        let attach = Event::Attach {
            session,
            conn_id,
            callbacks,
        };
        match self.step(attach).board {
            Some(board) => board,
            None => unreachable!("an attach step answers with a board"),
        }
    }

    /// A connection of `session` ended (see [`Core::detach`]).
    pub fn detach(&self, session: u64, conn_id: u64) {
        self.step(Event::Detach { session, conn_id });
    }

    /// Session `from` answered the callbacks `ids` (see [`Core::callbacks_answered`]).
    pub fn callbacks_answered(&self, from: u64, ids: &[u64]) -> (bool, usize) {
        let fx = self.step(Event::CallbacksAnswered { from, ids });
        (fx.slow_answer, fx.ignored_answers)
    }

    /// Sets the most handles a client may hold open to `limit` (configuration: tests use a
    /// small one in place of the real million). Sessions known so far are forgotten.
    pub fn set_handle_limit(&self, limit: usize) {
        self.core().stepping().sessions = crate::session::Sessions::with_handle_limit(limit);
    }

    /// The board where the replies of `changer` wait for the callbacks its changes caused.
    pub fn callback_board(&self, changer: u64) -> Arc<crate::leases::Board> {
        match self.step(Event::Board { session: changer }).board {
            Some(board) => board,
            None => unreachable!("a board step answers with a board"),
        }
    }

    /// When the next callback in flight runs out, if any is.
    pub fn next_callback_deadline(&self) -> Option<Instant> {
        self.core().callbacks.next_deadline()
    }

    /// Ends the callbacks whose deadline passed (their holders go into default).
    pub fn expire_callbacks(&self) -> Expired {
        self.step(Event::ExpireCallbacks).expired
    }

    /// Ends the sessions of clients gone longer than the grace period (see
    /// [`Core::end_session`]).
    pub fn end_expired_sessions(&self) {
        let grace = self.session_grace;
        let fx = self.step(Event::ExpireSessions { grace });
        for client in fx.ended_sessions {
            tracing::info!(
                "client {client:016x} gone for {grace:?}: closing its files, releasing its locks"
            );
        }
    }

    /// Up to `max` reclaim entries after `after` (id, generation), in order.
    pub fn pending_reclaims(&self, after: (InodeId, u64), max: usize) -> Vec<kochab_meta::Reclaim> {
        self.core().engine.pending_reclaims(after, max)
    }

    /// The reclaim entry of a file generation as it is now, and whether that generation
    /// is still live (then the entry is a trim, else the deletion of a removed file).
    pub fn reclaim_now(
        &self,
        id: InodeId,
        generation: u64,
    ) -> (Option<kochab_meta::Reclaim>, bool) {
        let core = self.core();
        let live = core
            .engine
            .inode(id)
            .is_some_and(|i| i.btime as u64 == generation);
        (core.engine.reclaim_of(id, generation), live)
    }

    /// Journals the reclaim entries `done` as finished (their deletions are durable), in
    /// one record.
    pub fn finish_reclaims(&self, done: &[kochab_meta::Reclaim]) {
        self.step(Event::ReclaimsDone { done });
    }

    /// Queues cleanup work and wakes the task that works through it.
    pub fn queue_cleanup(&self, work: Cleanup) {
        self.step(Event::QueueCleanup(work));
    }
}

/// The core lock held ([`Shared::core`]): read access to the core. Changes go through
/// [`Shared::step`] only; should the core's outbox still hold anything when the lock is let
/// go (a change made by hand in a unit test), it is carried out first, so journal order
/// stays execution order.
pub struct CoreGuard<'a> {
    core: parking_lot::MutexGuard<'a, Core>,
    shared: &'a Shared,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl CoreGuard<'_> {
    /// The core to step: the one way to change it ([`Shared::step`]).
    fn stepping(&mut self) -> &mut Core {
        &mut self.core
    }

    /// The core to change by hand, in a unit test that stages a state.
    #[cfg(test)]
    pub(crate) fn by_hand(&mut self) -> &mut Core {
        self.stepping()
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        // Only a change made by hand leaves anything here (`Shared::step` empties it): the
        // flush starts before the lock goes, which is only a little longer to hold it.
        if self.core.out.is_empty() {
            return;
        }
        let mut out = self.core.take_outbox();
        if self.shared.carry_out(&mut out) {
            self.shared.journal.flush_now();
        }
        self.core.reuse_outbox(&mut out);
    }
}

/// What a step reads of the server around the core.
impl Env for Shared {
    fn member(&self) -> Option<&dyn Member> {
        self.cluster.as_deref()
    }

    fn status(&self, core: &Core) -> StatusReport {
        Shared::status(self, core)
    }

    fn capacity(&self) -> std::io::Result<kochab_store::Capacity> {
        self.data.capacity()
    }
}

/// How long a server recovered from a crash runs no change but replays: clients that hold
/// early replies the crash lost reconnect (their retries are at most 1.6 s apart) and
/// replay them before anyone else's new operation can take the names or ids they need.
/// As long as a lease, too: the crash forgot who caches what, so no change may become
/// visible before every lease the last incarnation granted ran out.
pub const REPLAY_WINDOW: std::time::Duration = crate::leases::LEASE;

/// The window after a crash in which only replayed changes run; other changes wait for its
/// end (reads do not). A replay is admitted only with a replay tag that verifies for its
/// session (see `replaytags::SessionTags`): setting the mode is not enough.
pub struct ReplayWindow {
    until: Mutex<Option<Instant>>,
    clock: Clock,
}

impl ReplayWindow {
    /// A closed window, timed by `clock`.
    pub fn new(clock: Clock) -> ReplayWindow {
        ReplayWindow {
            until: Mutex::new(None),
            clock,
        }
    }

    /// Opens (or extends) the window for [`REPLAY_WINDOW`] from now.
    pub fn open(&self) {
        let until = self.clock.now() + REPLAY_WINDOW;
        let mut w = self.until.lock();
        *w = Some(w.map_or(until, |u| u.max(until)));
    }

    /// Ends the window now: every client has replayed what it kept (a simulation, whose
    /// clients replay at once, says so; a served core waits the window out).
    pub fn close(&self) {
        *self.until.lock() = None;
    }

    /// How long until the window ends (zero when it is not open), on its clock: what a
    /// new change waits.
    pub fn left(&self) -> std::time::Duration {
        self.until().map_or(std::time::Duration::ZERO, |u| {
            u.saturating_duration_since(self.clock.now())
        })
    }

    /// The end of the window, while it is open.
    pub fn until(&self) -> Option<Instant> {
        let mut w = self.until.lock();
        match *w {
            Some(u) if u > self.clock.now() => Some(u),
            Some(_) => {
                *w = None;
                None
            }
            None => None,
        }
    }
}

/// Nanoseconds since the epoch from the system clock (for tools beside the core; the
/// core stamps files by [`Shared::clock`]).
pub fn now_ns() -> TimeNs {
    Clock::system().wall_ns()
}

impl Shared {
    /// Works through the cleanup queue one batch per hold of the core lock, until it is
    /// empty.
    pub async fn run_cleanup(&self) {
        while self.step(Event::Cleanup).more_cleanup {
            tokio::task::yield_now().await;
        }
    }

    /// Waits until `reader` may see `ids`: every other session that may hold writes of
    /// them back has sent them (or failed to answer within a lease).
    /// Once: a writer that did not answer within a lease is not asked again.
    pub async fn wait_flushes(&self, reader: u64, ids: &[InodeId]) {
        let wait = self.step(Event::CallFlushes { reader, ids }).wait;
        if !wait.is_empty() {
            self.wait_answered(&wait).await;
        }
    }

    /// Waits until none of the callbacks `ids` is pending (answered, or run out).
    pub async fn wait_answered(&self, ids: &[u64]) {
        let started = Instant::now();
        self.wait_pending(ids).await;
        self.metrics
            .flush_wait_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    async fn wait_pending(&self, ids: &[u64]) {
        loop {
            let mut ended = {
                let core = self.core();
                if !ids.iter().any(|&id| core.callbacks.is_pending(id)) {
                    return;
                }
                core.callbacks.watch_ended()
            };
            if ended.changed().await.is_err() {
                return;
            }
        }
    }

    /// Runs a batch of requests of one client; returns each reply with the LSN that must
    /// be durable before it is sent. Some requests are returned instead of a reply
    /// ([`Parked`]): those that must wait for other sessions' flushes, and at a member
    /// those that need tables other servers hold (run them with
    /// [`crate::cluster_host::parked_op`]).
    pub fn execute_batch(
        &self,
        client: u64,
        reqs: &[(u64, Request)],
        replies: &mut Vec<Answer>,
    ) -> Vec<(u64, Parked)> {
        self.run_batch(client, reqs, replies, true)
    }

    /// [`Shared::execute_batch`] for a request that already waited for flushes once: it
    /// waits for none again (a writer that did not answer within a lease is not asked
    /// again and again; one that opened the file since wrote after this request began).
    pub fn execute_flushed(
        &self,
        client: u64,
        req: &(u64, Request),
        replies: &mut Vec<Answer>,
    ) -> Vec<(u64, Parked)> {
        self.run_batch(client, std::slice::from_ref(req), replies, false)
    }

    fn run_batch(
        &self,
        client: u64,
        reqs: &[(u64, Request)],
        replies: &mut Vec<Answer>,
        flushes: bool,
    ) -> Vec<(u64, Parked)> {
        let mut fx = self.step(Event::Requests {
            client,
            reqs,
            flushes,
            answers: Vec::new(),
        });
        if replies.is_empty() {
            *replies = std::mem::take(&mut fx.answers);
        } else {
            replies.append(&mut fx.answers);
        }
        fx.parked
    }

    /// The server's state for `kochab status`.
    pub fn status(&self, core: &Core) -> StatusReport {
        let tables = core
            .engine
            .tables()
            .iter()
            .map(|t| TableStatus {
                lo: t.lo,
                hi: t.hi,
                region: kochab_meta::Region::of(t.lo).label().to_string(),
                inodes: t.inode_count(),
                dentries: t.dentry_count(),
                checkpoint_lsn: t.replay_from,
            })
            .collect();
        let (inodes, dentries) = core.engine.counts();
        StatusReport {
            server_id: self.server_id,
            pid: std::process::id(),
            epoch: self.journal.id().epoch,
            coordinators: self
                .cluster
                .as_ref()
                .map(|h| h.coord_addrs())
                .unwrap_or_default(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            tables,
            inodes,
            dentries,
            journal_bytes: self.journal.bytes(),
            journal_segments: self.journal.segments(),
            applied_lsn: core.last_lsn(),
            durable_lsn: self.journal.durable_lsn(),
            rss_bytes: crate::metrics::rss_bytes(),
            connections: self.connections.load(Ordering::Relaxed),
            durable_mode: self.durable_mode,
            store: self.store_description.clone(),
            slices: self.slice_work().counters(),
        }
    }

    /// Updates the gauges that are sampled rather than counted.
    pub fn refresh_gauges(&self) {
        let m = &self.metrics;
        m.rss_bytes.set(crate::metrics::rss_bytes() as i64);
        m.journal_bytes.set(self.journal.bytes() as i64);
        m.connections
            .set(self.connections.load(Ordering::Relaxed) as i64);
        let core = self.core();
        m.data_reclaims_pending
            .set(core.engine.pending_reclaim_count() as i64);
        for t in core.engine.tables() {
            let label = crate::metrics::TableLabel {
                table: format!("{:016x}", t.lo),
            };
            m.table_inodes
                .get_or_create(&label)
                .set(t.inode_count() as i64);
            m.table_dentries
                .get_or_create(&label)
                .set(t.dentry_count() as i64);
        }
    }
}
