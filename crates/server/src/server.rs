//! Starting, running and stopping one metadata server.

use crate::checkpoint::Checkpointer;
use crate::clock::Clock;
use crate::conn::Accepted;
use crate::core::{Cleanup, Core, journal_before_core};
use crate::data::DataStore;
use crate::datadir::{DataDir, DataDirLock};
use crate::metrics::Metrics;
use crate::shared::{Shared, SharedParts};
use kochab_breaks::Breaks;
use kochab_journal::JournalId;
use kochab_journal::{Journal, JournalObserver, JournalOptions};
use kochab_meta::EngineConfig;
use kochab_proto::InodeId;
use kochab_proto::auth::ClusterKey;
use kochab_store::ObjectStore;
use parking_lot::{Condvar, Mutex};
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Most simultaneous client connections, authenticated or still in the handshake; more
/// are closed at once. Each costs two tasks and a 64 KiB read buffer (about 100 KiB), so
/// the limit keeps idle or hostile connections under half a GiB, and under the default
/// file-descriptor limits once raised for a server.
pub const MAX_CONNECTIONS: u64 = 4096;

/// Smallest journal segment a server uses: a record must fit in one segment, and the largest
/// a client can cause (a 64 KiB xattr value with its inode, see `core::tests`) and the
/// largest internal one (a cleanup batch, under 64 KiB) fit with room to spare.
pub const SEGMENT_BYTES_MIN: u64 = 256 << 10;

/// How a server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    /// fdatasync every group commit before replying (the default). Off is the named
    /// "buffered" mode: a machine crash may lose acknowledged operations.
    pub fsync: bool,
    /// Journal records between checkpoint rounds (bounds replay time at restart).
    pub checkpoint_records: u64,
    /// A round also runs this often if anything changed.
    pub checkpoint_interval: Duration,
    pub segment_bytes: u64,
    /// How long a client may be disconnected before its handles are closed and its locks
    /// released (and how long, after a restart, unlinked files wait to be reopened).
    pub session_grace: Duration,
    /// TLS for client connections: a PEM certificate chain and its PEM private key.
    pub tls_cert_key: Option<(PathBuf, PathBuf)>,
    /// The cluster key, given instead of read from (or made in) the data directory's key
    /// file: a server over a store on S3 that a cluster's hosts share, each with a copy.
    pub cluster_key: Option<ClusterKey>,
    /// What `kochab status` says of the store when it is not the data directory's own
    /// (the URL of a store on S3 and its engine's self-test).
    pub store_description: Option<String>,
}

impl ServerConfig {
    /// Defaults for a data directory and listen address.
    pub fn new(data_dir: impl Into<PathBuf>, listen: SocketAddr) -> ServerConfig {
        ServerConfig {
            data_dir: data_dir.into(),
            listen,
            metrics_listen: None,
            fsync: true,
            // ~300k creates: a few tenths of a second of replay at restart.
            checkpoint_records: 300_000,
            checkpoint_interval: Duration::from_secs(30),
            segment_bytes: JournalOptions::default().segment_bytes,
            session_grace: Duration::from_secs(10),
            tls_cert_key: None,
            cluster_key: None,
            store_description: None,
        }
    }
}

struct JournalMetrics(Arc<Metrics>);

impl JournalObserver for JournalMetrics {
    fn on_commit(&self, records: u64, bytes: u64, sync_seconds: f64, waited_seconds: f64) {
        self.0.fsync_seconds.observe(sync_seconds);
        self.0.journal_wait_seconds.observe(waited_seconds);
        self.0.records_per_fsync.observe(records as f64);
        self.0.bytes_per_fsync.observe(bytes as f64);
    }
}

struct Stopper {
    stop: Mutex<bool>,
    cv: Condvar,
}

/// A server that is serving.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub key: ClusterKey,
    pub root: InodeId,
    pub data_dir: PathBuf,
    shared: Arc<Shared>,
    /// Held for the life of the server: no second server may use the directory (none for
    /// a member started over a shared store).
    _lock: Option<DataDirLock>,
    shutdown_tx: watch::Sender<bool>,
    accept_task: tokio::task::JoinHandle<()>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    maintenance: tokio::task::JoinHandle<()>,
    reclaimer: tokio::task::JoinHandle<()>,
    cleanup: tokio::task::JoinHandle<()>,
    /// Deleter of freed slice objects, compactor, collector of orphans.
    slice_tasks: [tokio::task::JoinHandle<()>; 3],
    checkpointer: Option<JoinHandle<()>>,
    stopper: Arc<Stopper>,
}

/// Recovers the data directory and starts serving every table of the cluster (the one
/// server of `kochab up`), as a new incarnation: its epoch is bumped, the previous
/// incarnation's journal is sealed and replayed, every table is claimed.
pub async fn start(config: ServerConfig) -> io::Result<RunningServer> {
    start_on(config, None).await
}

/// [`start`] with the cluster's object store in `store` (a bucket on S3) instead of the data
/// directory's own; the directory keeps the key and the lock (file data goes to the store
/// too: see [`DataDir::data_store`]).
pub async fn start_on(
    config: ServerConfig,
    store: Option<Arc<dyn ObjectStore>>,
) -> io::Result<RunningServer> {
    let dir_path = config.data_dir.clone();
    let key = config.cluster_key;
    let (lock, dir, me, recovered) = tokio::task::spawn_blocking(move || -> io::Result<_> {
        // Before anything is read: two servers on one directory would overwrite each
        // other's journal.
        let lock = DataDirLock::acquire(&dir_path)?;
        let dir = DataDir::open_or_create_with(&dir_path, store, key)?;
        // A single server would claim every table while the cluster's servers serve them.
        if crate::datadir::is_released(dir.store.as_ref())? {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "the store of {} belongs to a cluster of servers (it holds {}): start \
                     it with `kochab up --servers N` or `kochab mds`",
                    dir_path.display(),
                    crate::datadir::RELEASED_OBJECT
                ),
            ));
        }
        let state = dir.next_incarnation()?;
        let me = JournalId {
            server: state.server_id,
            epoch: state.epoch,
        };
        let recovered = crate::recovery::recover(&dir, me)?;
        // Without the marker of a clean stop, the last incarnation may have acknowledged
        // early replies that its journal lost: clients replay them in the replay window.
        let crashed = match std::fs::remove_file(dir.path.join(CLEAN_STOP_MARKER)) {
            Ok(()) => false,
            Err(e) if e.kind() == io::ErrorKind::NotFound => state.epoch > 1,
            Err(e) => return Err(e),
        };
        Ok((lock, dir, me, (recovered, crashed)))
    })
    .await
    .map_err(io::Error::other)??;
    let (recovered, crashed) = recovered;
    let member = Member {
        store: dir.store.clone(),
        data_store: dir.data_store.clone(),
        key: dir.key,
        status_id: dir.meta.server_id,
        me,
        data_path: dir.path.clone(),
        cluster: None,
        admission: None,
        replay_window: crashed,
    };
    serve(config, member, recovered, Some(lock)).await
}

/// A server over a shared store that starts with the tables `ranges` (possibly none) as
/// incarnation `me` (its id and a fresh epoch, which the caller guarantees unique), and
/// gets others at run time through [`Shared::add_table`] / [`Shared::recover_tables`]
/// (tests run such members in process; `kochab mds` starts with [`start_cluster_member`]).
pub async fn start_member(
    config: ServerConfig,
    store: Arc<dyn ObjectStore>,
    key: ClusterKey,
    engine: EngineConfig,
    me: JournalId,
    ranges: Vec<(u64, u64)>,
) -> io::Result<RunningServer> {
    start_over_store(config, store, key, engine, me, ranges, None).await
}

/// A metadata server under the coordinator (`kochab mds`): it starts with no tables as the
/// incarnation `host` registered, and from then on `host` admits every operation and
/// carries out the coordinator's ADD and DROP (see `cluster_host`).
pub async fn start_cluster_member(
    config: ServerConfig,
    store: Arc<dyn ObjectStore>,
    key: ClusterKey,
    engine: EngineConfig,
    host: Arc<crate::cluster_host::ClusterHost>,
) -> io::Result<RunningServer> {
    let me = host.journal_id();
    start_over_store(config, store, key, engine, me, Vec::new(), Some(host)).await
}

/// A server over a shared store, starting with the tables `ranges` as incarnation `me`;
/// with `cluster`, a member whose host admits its operations.
async fn start_over_store(
    config: ServerConfig,
    store: Arc<dyn ObjectStore>,
    key: ClusterKey,
    engine: EngineConfig,
    me: JournalId,
    ranges: Vec<(u64, u64)>,
    cluster: Option<Arc<crate::cluster_host::ClusterHost>>,
) -> io::Result<RunningServer> {
    let s = store.clone();
    let mut recovered = tokio::task::spawn_blocking(move || {
        crate::recovery::recover_tables(s.as_ref(), engine, &ranges, me, None, None, Vec::new())
    })
    .await
    .map_err(io::Error::other)??;
    recovered.engine.member = cluster.is_some();
    let member = Member {
        data_store: crate::datadir::data_store_for(&store, &config.data_dir)?,
        store,
        key,
        status_id: me.server,
        me,
        data_path: config.data_dir.clone(),
        cluster,
        admission: None,
        // A member opens it when it recovers a crashed server's tables.
        replay_window: false,
    };
    serve(config, member, recovered, None).await
}

/// Who a starting server is.
struct Member {
    store: Arc<dyn ObjectStore>,
    /// Where file data goes (see `DataDir::data_store`).
    data_store: Arc<dyn ObjectStore>,
    key: ClusterKey,
    /// The id `kochab status` shows.
    status_id: u64,
    me: JournalId,
    data_path: PathBuf,
    /// The participant of a member under the coordinator (none: every table is hosted).
    cluster: Option<Arc<crate::cluster_host::ClusterHost>>,
    /// The admission of a simulated member (set only without `cluster`).
    admission: Option<Arc<dyn crate::core::Member>>,
    /// Serve only replays for a while first (the last incarnation crashed).
    replay_window: bool,
}

/// Written into the data directory when the single server stopped cleanly (everything it
/// acknowledged is durable); its absence at the next start means a crash.
const CLEAN_STOP_MARKER: &str = "stopped-cleanly";

/// The core of a recovered server, with its journal started and a new cluster's root made,
/// but no socket, task or thread of its own yet: [`serve`] starts those around it, and the
/// simulation drives it as it is ([`core_for_simulation`]). Also returns the inodes that
/// had no name at start (orphans, removed unless a client reopens them).
fn assemble(
    config: &ServerConfig,
    dir: &Member,
    recovered: crate::recovery::Recovered,
    options: JournalOptions,
    keys: Arc<crate::keys::KeyStore>,
    breaks: Breaks,
    clock: Clock,
) -> io::Result<(Arc<Shared>, Vec<InodeId>)> {
    let crate::recovery::Recovered {
        mut engine,
        replies,
        manifests,
        journal: report,
        next_lsn,
        boxes_loaded,
        from_kept: _,
        splits: _,
        load_time,
        replay_time,
    } = recovered;
    tracing::info!(
        "recovered {} inodes: {boxes_loaded} checkpoint boxes in {:.3}s, {} journal records replayed in {:.3}s",
        engine.counts().0,
        load_time.as_secs_f64(),
        report.replayed,
        replay_time.as_secs_f64()
    );
    let metrics = Arc::new(Metrics::new());
    metrics.replay_records.set(report.replayed);
    let journal = Journal::start(
        dir.store.clone(),
        dir.me,
        next_lsn,
        options,
        Some(Arc::new(JournalMetrics(metrics.clone()))),
    )?;
    // A new cluster's root, made by whoever hosts its table (a member without it has none).
    if engine.table_index(engine.root()).is_some() && !engine.has_root() {
        let muts = engine.bootstrap(clock.wall_ns());
        for m in &muts {
            engine.apply(m).map_err(io::Error::other)?;
        }
        let lsn = journal_before_core(&journal, &muts);
        journal.flush_now();
        if !journal.wait_durable(lsn) {
            return Err(io::Error::other("journal failed while creating the root"));
        }
        tracing::info!("created a new cluster in {}", dir.data_path.display());
    }
    let data = Arc::new(DataStore::new(dir.data_store.clone()));
    // Data deletions and trims left over from before the restart run in the background
    // (`reclaim_loop`): serving never waits for bulk deletion, and a data operation on a
    // file with a pending trim finishes that trim first (see `filesvc::lock_file`).
    let pending = engine.pending_reclaim_count();
    if pending > 0 {
        tracing::info!(
            "{pending} data reclaims pending from before the restart; finishing them in the background"
        );
    }
    // Open-unlinked files outlive a restart only if a client reopens them in time.
    let orphans = engine.orphans();
    let mut core = Core::new(engine, replies);
    core.set_breaks(breaks);
    let shared = Arc::new(Shared::new(SharedParts {
        core,
        journal,
        store: dir.store.clone(),
        metrics: metrics.clone(),
        server_id: dir.status_id,
        durable_mode: config.fsync,
        store_description: config
            .store_description
            .clone()
            .unwrap_or_else(|| format!("local, {}", config.data_dir.join("store").display())),
        data,
        session_grace: config.session_grace,
        checkpointer: Checkpointer::new(manifests, dir.me),
        keys,
        cluster: dir
            .cluster
            .clone()
            .map(|h| -> Arc<dyn crate::core::Member> { h })
            .or_else(|| dir.admission.clone()),
        replay_key: kochab_proto::auth::ReplayKey::derive(&dir.key),
        slice_work: crate::slicework::SliceWork::new(&dir.key, dir.me.server, dir.me.epoch),
        breaks,
        clock,
    }));
    if dir.replay_window {
        tracing::info!(
            "the last incarnation stopped without a clean shutdown: serving only clients' \
             replays for {:?}",
            crate::shared::REPLAY_WINDOW
        );
        shared.replay_window().open();
    }
    if let Some(host) = &dir.cluster {
        host.attach(&shared);
    }
    Ok((shared, orphans))
}

/// What the simulation gives to build a server's core over its own store (see
/// [`core_for_simulation`]).
pub struct SimulatedServer {
    /// The cluster's store (in memory, crashing back to its last sync).
    pub store: Arc<dyn ObjectStore>,
    pub key: ClusterKey,
    /// This incarnation (a new epoch for every start).
    pub me: JournalId,
    /// How its journal writes (a simulation flushes only when it asks).
    pub journal: JournalOptions,
    /// The last incarnation stopped without a clean shutdown: replays only for a while.
    pub crashed: bool,
    /// Deliberate bugs to switch on.
    pub breaks: Breaks,
    /// A member's admission, standing in for the cluster host (its engine then answers
    /// WRONG_SERVER for what it does not host); `None`: a single server.
    pub member: Option<Arc<dyn crate::core::Member>>,
    /// The simulation's clock (see `clock::SimulatedClock`): every incarnation reads one.
    pub clock: Clock,
}

/// The core of a server recovered from `recovered` (a single server's: every table; a
/// simulated member's: those it starts with), for a deterministic simulation: the same
/// assembly as a served one, with no socket, task or
/// thread but the journal's. Call from within a tokio runtime (the core keeps its handle).
pub fn core_for_simulation(
    sim: SimulatedServer,
    mut recovered: crate::recovery::Recovered,
) -> io::Result<Arc<Shared>> {
    recovered.engine.member = sim.member.is_some();
    let data_path = PathBuf::from("simulated");
    let config = ServerConfig {
        store_description: Some("simulated, in memory".into()),
        ..ServerConfig::new(&data_path, SocketAddr::from(([127, 0, 0, 1], 0)))
    };
    let member = Member {
        data_store: sim.store.clone(),
        store: sim.store,
        key: sim.key,
        status_id: sim.me.server,
        me: sim.me,
        data_path,
        cluster: None,
        admission: sim.member,
        replay_window: sim.crashed,
    };
    let keys = Arc::new(crate::keys::KeyStore::for_cluster(sim.key));
    let (shared, _orphans) = assemble(
        &config,
        &member,
        recovered,
        sim.journal,
        keys,
        sim.breaks,
        sim.clock,
    )?;
    Ok(shared)
}

async fn serve(
    config: ServerConfig,
    dir: Member,
    recovered: crate::recovery::Recovered,
    lock: Option<DataDirLock>,
) -> io::Result<RunningServer> {
    let options = JournalOptions {
        segment_bytes: config.segment_bytes.max(SEGMENT_BYTES_MIN),
        fsync: config.fsync,
        ..JournalOptions::default()
    };
    let keys = match &dir.cluster {
        // A member's keys are the coordinator's, which its host keeps.
        Some(host) => host.keys(),
        // A single server's are in its data directory.
        None => Arc::new(crate::keys::KeyStore::load(&dir.data_path, dir.key)?),
    };
    let (shared, orphans) = assemble(
        &config,
        &dir,
        recovered,
        options,
        keys,
        Breaks::NONE,
        Clock::system(),
    )?;
    let metrics = shared.metrics().clone();
    let root = shared.root();
    // Group commits written on this runtime's own thread when it has one worker, not
    // handed to the flusher thread (see `Journal::committer`).
    tokio::spawn(shared.journal().committer());
    let maintenance = tokio::spawn(maintenance_loop(shared.clone(), orphans));
    let reclaimer = tokio::spawn(reclaim_loop(shared.clone()));
    let cleanup = tokio::spawn(cleanup_loop(shared.clone()));
    // File data as slice objects: deletion of freed objects once durable, compaction, and
    // the collector of orphans (each returns at once on a store without slices, or idles).
    let slice_tasks = [
        tokio::spawn(crate::slicesvc::freed_loop(shared.clone())),
        tokio::spawn(crate::slicesvc::compaction_loop(shared.clone())),
        tokio::spawn(crate::gc::gc_loop(shared.clone())),
    ];

    let stopper = Arc::new(Stopper {
        stop: Mutex::new(false),
        cv: Condvar::new(),
    });
    let checkpointer = {
        let shared = shared.clone();
        let stopper = stopper.clone();
        let config = config.clone();
        std::thread::Builder::new()
            .name("checkpointer".into())
            .spawn(move || checkpoint_loop(shared, stopper, config))?
    };

    let tls = match &config.tls_cert_key {
        Some((cert, key)) => Some(crate::tls::acceptor(cert, key)?),
        None => None,
    };
    let listener = TcpListener::bind(config.listen).await?;
    let addr = listener.local_addr()?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Clients of this process reach the server without a socket (see `kochab_local`);
    // registered before `start` returns, so a client started next finds it.
    let local = kochab_local::listen(addr);
    let accept_task = tokio::spawn(accept_loop(
        listener,
        local,
        shared.clone(),
        shutdown_rx,
        shared.journal().subscribe_failure(),
        tls,
    ));
    let (metrics_task, metrics_addr) = match config.metrics_listen {
        Some(a) => {
            let l = crate::metrics::bind(a).await?;
            let maddr = l.local_addr()?;
            let s = shared.clone();
            let refresh: Arc<dyn Fn() + Send + Sync> = Arc::new(move || s.refresh_gauges());
            (
                Some(tokio::spawn(crate::metrics::serve_http(
                    l, metrics, refresh,
                ))),
                Some(maddr),
            )
        }
        None => (None, None),
    };
    Ok(RunningServer {
        addr,
        metrics_addr,
        key: dir.key,
        root,
        data_dir: dir.data_path,
        shared,
        _lock: lock,
        shutdown_tx,
        accept_task,
        metrics_task,
        maintenance,
        reclaimer,
        cleanup,
        slice_tasks,
        checkpointer: Some(checkpointer),
        stopper,
    })
}

async fn accept_loop(
    listener: TcpListener,
    mut local: kochab_local::Listener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
    mut journal_failure: watch::Receiver<Option<String>>,
    tls: Option<crate::tls::TlsAcceptor>,
) {
    loop {
        // Where the connection is served: here, unless a client of this process asked for
        // its own runtime (see `kochab_local`).
        let mut runtime = None;
        let accepted = tokio::select! {
            // A server whose journal failed takes no new clients (fail-stop).
            _ = journal_failure.changed() => return,
            r = listener.accept() => match r {
                Ok((sock, peer)) => Accepted::Tcp(sock, peer),
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            incoming = local.accept() => {
                runtime = incoming.runtime;
                Accepted::Local(incoming.stream)
            }
            _ = shutdown.changed() => return,
        };
        // Counted from accept, not from authentication: unauthenticated connections take
        // slots too (each for at most the handshake timeout).
        let Some(counted) = crate::conn::Counted::take(&shared, MAX_CONNECTIONS) else {
            if shared.may_log_bad_frame().is_some() {
                let peer = accepted.peer();
                tracing::warn!("refusing {peer}: {MAX_CONNECTIONS} connections open");
            }
            continue;
        };
        let served = crate::conn::serve(counted, accepted, shutdown.clone(), tls.clone());
        match runtime {
            Some(rt) => drop(rt.spawn(served)),
            None => drop(tokio::spawn(served)),
        }
    }
}

/// Ends sessions of clients gone longer than the grace period and drops open-unlinked files
/// nobody reopened after a restart.
async fn maintenance_loop(shared: Arc<Shared>, mut orphans: Vec<InodeId>) {
    let orphan_deadline = shared.clock().now() + shared.session_grace();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        shared.end_expired_sessions();
        if !orphans.is_empty() && shared.clock().now() >= orphan_deadline {
            // However many there are, in bounded records (see `Cleanup`).
            let ids = std::mem::take(&mut orphans);
            shared.queue_cleanup(Cleanup::Orphans(ids.into_iter()));
        }
    }
}

/// Works through the cleanup queue whenever something is added to it; and ends the
/// callbacks whose holders did not answer before their leases ran out (those holders go
/// into default, see `leases::Callbacks`).
async fn cleanup_loop(shared: Arc<Shared>) {
    let cleanup = async {
        loop {
            shared.cleanup_woken().await;
            shared.run_cleanup().await;
        }
    };
    let callbacks = async {
        loop {
            // Deadlines are on the core's clock; the timer that waits for them is tokio's.
            let next = shared.next_callback_deadline();
            let now = shared.clock().now();
            let wake = next.map_or(now + CALLBACK_CHECK, |d| d.min(now + CALLBACK_CHECK));
            tokio::time::sleep(wake.saturating_duration_since(now)).await;
            let expired = shared.expire_callbacks();
            if expired.missed > 0 {
                shared
                    .metrics()
                    .callbacks_missed
                    .inc_by(expired.missed as u64);
                shared
                    .metrics()
                    .callback_defaults
                    .inc_by(expired.defaulted.len() as u64);
                for holder in expired.defaulted {
                    // Rate-limited: a key holder may open session after session.
                    if shared.may_log_bad_frame().is_none() {
                        break;
                    }
                    tracing::warn!(
                        "session {holder:016x} did not answer a callback by its deadline: its \
                         leases are revoked, and it gets none until it answers"
                    );
                }
            }
        }
    };
    tokio::join!(cleanup, callbacks);
}

/// Longest pause between two looks at the callbacks in flight (one issued meanwhile may
/// be waited for this much past its deadline).
const CALLBACK_CHECK: Duration = Duration::from_millis(50);

/// Reclaim entries one pass takes (each costs one listing of its file's folder plus its
/// deletions, in bounded calls); a full pass is followed at once by the next.
const RECLAIMS_PER_PASS: usize = 64;
/// How often an idle reclaimer looks for new entries: data of a removed file goes within
/// about this long.
const RECLAIM_INTERVAL: Duration = Duration::from_millis(250);
/// The pause after a pass in which a reclaim failed, so a failing store is not hammered
/// (the entries stay and are retried).
const RECLAIM_RETRY: Duration = Duration::from_secs(5);

/// Deletes the data of removed files and finishes trims left pending (by a restart or a
/// failed truncation), in the background. Each entry costs what its file has in the store
/// (a listing, then deletions), so entries whose chunks are already gone finish at once:
/// the loop never spins on them. Entries are visited in turn from a cursor, so one that
/// keeps failing cannot starve the others.
async fn reclaim_loop(shared: Arc<Shared>) {
    let mut cursor = (0, 0);
    loop {
        let batch = shared.pending_reclaims(cursor, RECLAIMS_PER_PASS);
        let full = batch.len() == RECLAIMS_PER_PASS;
        if let Some(last) = batch.last() {
            cursor = (last.id, last.generation);
        }
        let failed = reclaim_pass(&shared, batch).await;
        let pause = if failed {
            RECLAIM_RETRY
        } else if full {
            Duration::ZERO
        } else {
            RECLAIM_INTERVAL
        };
        tokio::time::sleep(pause).await;
    }
}

/// Runs one pass of reclaim entries; true if any failed. A trim of a live file runs under
/// the file's exclusive lock, start to end. For a removed file the lock is only a barrier:
/// it waits out writes that checked the file's generation before the removal (later ones
/// fail with ESTALE before creating a chunk). Removed files' deletions are made durable
/// together (one sync per folder touched), then journaled done in one record.
async fn reclaim_pass(shared: &Shared, batch: Vec<kochab_meta::Reclaim>) -> bool {
    let mut failed = false;
    let mut done = Vec::new();
    let mut dirs = Vec::new();
    for r in batch {
        let file = shared.file_locks().exclusive(r.id).await;
        let (entry, live) = shared.reclaim_now(r.id, r.generation);
        // Finished or changed meanwhile (by a truncation): the entry as it is now.
        let Some(entry) = entry else { continue };
        let result = if live {
            crate::fileaccess::run_reclaim(shared, entry).await
        } else {
            drop(file);
            crate::fileaccess::delete_reclaimed(shared, entry)
                .await
                .map(|dir| {
                    dirs.extend(dir);
                    done.push(entry);
                })
        };
        if let Err(e) = result {
            tracing::warn!(
                "cannot delete data of {:#x} (generation {:#x}): {e} (will retry)",
                r.id,
                r.generation
            );
            failed = true;
        }
    }
    if done.is_empty() {
        return failed;
    }
    let data = shared.data().clone();
    match tokio::task::spawn_blocking(move || data.sync_dirs(&dirs)).await {
        Ok(Ok(())) => {
            shared.finish_reclaims(&done);
            failed
        }
        Ok(Err(e)) => {
            tracing::warn!(
                "cannot sync the data folders of {} reclaims: {e} (will retry)",
                done.len()
            );
            true
        }
        Err(e) => {
            tracing::warn!("data folder sync task failed: {e}");
            true
        }
    }
}

fn checkpoint_loop(shared: Arc<Shared>, stopper: Arc<Stopper>, config: ServerConfig) {
    let mut last_round = Instant::now();
    loop {
        let stop = {
            let mut g = stopper.stop.lock();
            if !*g {
                stopper.cv.wait_for(&mut g, Duration::from_millis(200));
            }
            *g
        };
        if shared.journal().failed() {
            // Nothing written from here on would count: the server is stopping.
            if stop {
                return;
            }
            continue;
        }
        let lsn = shared.journal().last_lsn();
        let mut ckpt = shared.checkpointer();
        // Records a restart would replay now; older journals (from before a restart or a
        // takeover) are let go by the next round too.
        let behind = lsn.saturating_sub(ckpt.replay_from());
        let work = behind > 0 || ckpt.needs_older_journals();
        let due = behind >= config.checkpoint_records
            || (work && last_round.elapsed() >= config.checkpoint_interval);
        if due || (stop && work) {
            let started = Instant::now();
            match ckpt.round(&shared) {
                Ok(r) => tracing::info!(
                    "checkpoint: {} tables, {} boxes, {} bytes in {:.3}s; {} journal segments \
                     trimmed, {} old journals deleted",
                    r.tables,
                    r.boxes,
                    r.bytes,
                    started.elapsed().as_secs_f64(),
                    r.trimmed_segments,
                    r.journals_deleted
                ),
                Err(e) => tracing::warn!("checkpoint failed (will retry): {e}"),
            }
            last_round = Instant::now();
        }
        if stop {
            return;
        }
    }
}

impl RunningServer {
    /// The shared state (for tests and the embedded CLI).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Resolves, with the reason, once the journal has failed. The server has then stopped
    /// acknowledging and told its clients (a Goodbye with EIO on every connection); its
    /// owner should shut it down and exit with an error (fail-stop: a server that cannot
    /// make operations durable must not look alive).
    pub fn journal_failure(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        crate::stop_reason::first_reason(self.shared.journal().subscribe_failure())
    }

    /// Stops accepting, closes connections, takes a final checkpoint (so the next start
    /// replays nothing) and flushes the journal.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown_tx.send(true);
        let _ = (&mut self.accept_task).await;
        if let Some(t) = self.metrics_task.take() {
            t.abort();
        }
        self.maintenance.abort();
        // Pending reclaims stay durable and resume after the next start; the one blocking
        // call in flight is short (`DATA_BATCH_CHUNKS`).
        self.reclaimer.abort();
        self.cleanup.abort();
        // Freed objects still queued, and a compaction cut short, are orphans now: the
        // collector of the next start deletes them.
        for t in &self.slice_tasks {
            t.abort();
        }
        // Give connection tasks a moment to send what is durable.
        for _ in 0..50 {
            if self.shared.open_connections() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        *self.stopper.stop.lock() = true;
        self.stopper.cv.notify_all();
        if let Some(h) = self.checkpointer.take() {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        self.shared.journal().shutdown();
        if self.shared.cluster().is_none() && !self.shared.journal().failed() {
            let marker = self.data_dir.join(CLEAN_STOP_MARKER);
            if let Err(e) = std::fs::write(&marker, b"") {
                tracing::warn!("cannot write {}: {e}", marker.display());
            }
        }
    }
}
