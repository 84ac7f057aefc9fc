//! `kochab up --servers N [--coords R]`: R coordinator replicas (one Raft group; 1 by
//! default) and N metadata servers on this machine, each its own OS process (children of
//! this one, restarted when they exit), over one data directory: its object store is
//! shared, each server keeps its own journal in it.
//!
//! The first start as a cluster turns the directory's tables over to the cluster: a single
//! server recovers the directory (creating it if new) and releases every table (a clean
//! checkpoint, no owner); the coordinator then places them on the servers, which ADD them.
//! From then on the directory belongs to the cluster (`coord/` exists) and a plain
//! `kochab up` refuses it.

use crate::mount;
use kochab_client::{Client, ClientConfig};
use kochab_cluster::state::CoordState;
use kochab_coord::CoordClient;
use kochab_store::ObjectStore;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Id of the first metadata server of a cluster: id 1 names the single-server mode's
/// journals (`journal/1.<epoch>`), which the cluster's data may still hold.
pub const FIRST_SERVER_ID: u32 = 2;

/// The coordinator's data inside the cluster's data directory; its presence marks a
/// directory that belongs to a cluster.
pub const COORD_DIR: &str = "coord";

/// Most coordinator replicas `up` starts (a group of 5 survives the loss of 2; more only
/// slows every commit).
pub const COORDS_MAX: usize = 7;

/// How long `up` waits for every table to be placed before it reports the cluster ready
/// anyway (loading a large table takes about a second per million inodes).
const PLACEMENT_WAIT: Duration = Duration::from_secs(120);

/// A child that exits sooner than this after its start is restarted only after a pause
/// (doubling up to `RESTART_PAUSE_MAX`), so a server that cannot start does not spin.
const QUICK_EXIT: Duration = Duration::from_secs(5);
const RESTART_PAUSE_MAX: Duration = Duration::from_secs(5);

/// What `kochab up --servers N` needs from its arguments.
pub struct ClusterArgs {
    pub data: PathBuf,
    pub host: String,
    /// First server's port (0: free ports for everything).
    pub port: u16,
    pub servers: usize,
    /// Coordinator replicas (1, or 3 or 5 to survive the loss of a minority).
    pub coords: usize,
    /// Lease of a server, in seconds (a killed server's tables are recovered elsewhere
    /// about this long after it died).
    pub lease: f64,
    pub no_fsync: bool,
    pub mount: Option<PathBuf>,
    pub mount_options: Option<String>,
    /// Extra arguments for every `kochab mds` (tests' checkpoint and segment sizes).
    pub mds_extra: Vec<String>,
    /// Extra arguments for every coordinator replica (tests' balancing thresholds).
    pub coord_extra: Vec<String>,
    /// The cluster's store on S3 (`--store`, opened and self-tested) instead of the data
    /// directory's own, and how the servers are told to open it.
    pub store: Option<(Arc<dyn ObjectStore>, crate::store::StoreArgs)>,
}

/// True if `data` belongs to a cluster of servers.
pub fn is_cluster_dir(data: &Path) -> bool {
    data.join(COORD_DIR).exists()
}

/// Where replica `id` (1-based) keeps its Raft log and snapshots: replica 1 in `coord/`
/// itself (where a one-replica cluster always kept it), the others beside it.
fn replica_dir(data: &Path, id: usize) -> PathBuf {
    let coord = data.join(COORD_DIR);
    if id == 1 {
        coord
    } else {
        coord.join(format!("replica-{id}"))
    }
}

/// The file in `coord/` that records the replicas' addresses of a group of more than one:
/// a Raft group's membership holds its members' addresses, so a restarted group must listen
/// where it did (a one-replica group talks to nobody and takes any port).
const REPLICAS_FILE: &str = "replicas";

/// The replicas' addresses a cluster's directory recorded (a group of one records none),
/// checked against `coords`: `up` keeps the size of the group its directory was made with.
fn recorded_replicas(data: &Path, coords: usize) -> Result<Option<Vec<String>>, String> {
    let file = data.join(COORD_DIR).join(REPLICAS_FILE);
    let had = match std::fs::read_to_string(&file) {
        Ok(text) => Some(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.trim().to_string())
                .collect::<Vec<_>>(),
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    let size = match &had {
        Some(a) => a.len(),
        None if data.join(COORD_DIR).join("raft-log").exists() => 1,
        None => return Ok(None),
    };
    if size != coords {
        return Err(format!(
            "{} was run with {size} coordinator replica(s); start it with --coords {size} \
             (changing the size of the group is not supported by `up`)",
            data.display()
        ));
    }
    Ok(had)
}

/// Records the replicas' addresses (one per line), atomically.
fn record_replicas(data: &Path, addrs: &[String]) -> Result<(), String> {
    let dir = data.join(COORD_DIR);
    private_dir(&dir)?;
    let tmp = dir.join(format!("{REPLICAS_FILE}.tmp"));
    let mut text = addrs.join("\n");
    text.push('\n');
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(REPLICAS_FILE)).map_err(|e| format!("{}: {e}", dir.display()))
}

/// Creates `dir` (and parents) for its owner alone, as a replica's files are (the
/// coordinator's state holds the cluster's client keys, sealed).
fn private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))
}

/// One child process and how to start it again.
struct Proc {
    name: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    started: Instant,
    pause: Duration,
}

impl Proc {
    fn spawn(&mut self) -> Result<(), String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let err = log
            .try_clone()
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let mut cmd = Command::new(exe);
        // SAFETY: prctl(2) in the child between fork and exec touches no memory of the
        // parent. The child dies with the thread that started it (the supervisor, which
        // lives as long as `up`): a killed `up` leaves no server behind.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.name))?;
        self.child = Some(child);
        self.started = Instant::now();
        Ok(())
    }
}

/// Free loopback ports, found by binding port 0 (released before the children bind them;
/// a race with another program is possible and shows as a child that cannot listen).
fn free_ports(host: &str, n: usize) -> Result<Vec<u16>, String> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind((host, 0)).map_err(|e| format!("{host}: {e}")))
        .collect::<Result<_, _>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string()))
        .collect()
}

/// Turns a single server's directory (or a new one) over to the cluster: every table
/// released, so the coordinator can place it. With `store`, the cluster's store is that
/// (a bucket on S3) and `data` is only the single server's local directory; with `key`,
/// the cluster key is that instead of `data`'s key file. The store is marked released
/// (see [`kochab_server::datadir::RELEASED_OBJECT`]) once every table is; a store already
/// marked is left as it is.
async fn prepare(
    data: &Path,
    store: Option<Arc<dyn ObjectStore>>,
    key: Option<kochab_proto::auth::ClusterKey>,
) -> Result<(), String> {
    let listen: SocketAddr = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
    let mut config = kochab_server::ServerConfig::new(data, listen);
    config.cluster_key = key;
    // Releasing and marking are done in this order, so a marked store is one whose every
    // table was released; a start that died between them releases them again (nothing
    // else serves a store before it is marked).
    if let Some(s) = &store
        && blocking(s.clone(), |s| {
            kochab_server::datadir::is_released(s.as_ref())
        })
        .await?
    {
        return Ok(());
    }
    let server = kochab_server::start_on(config, store.clone())
        .await
        .map_err(|e| format!("cannot prepare {}: {e}", data.display()))?;
    let released = tokio::task::block_in_place(|| server.release_all_tables())
        .map_err(|e| format!("cannot release the tables of {}: {e}", data.display()))?;
    let marked = match &store {
        Some(s) => s.clone(),
        None => server.shared().store().clone(),
    };
    server.shutdown().await;
    blocking(marked, |s| {
        kochab_server::datadir::mark_released(s.as_ref())
    })
    .await?;
    eprintln!(
        "kochab: {} tables of {} released to the cluster",
        released.len(),
        data.display()
    );
    Ok(())
}

/// Runs `f` on `store` off the runtime's worker threads (a store on S3 is waited for
/// synchronously).
async fn blocking<T: Send + 'static>(
    store: Arc<dyn ObjectStore>,
    f: impl FnOnce(&Arc<dyn ObjectStore>) -> std::io::Result<T> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// How often a start waiting for another to initialise a store looks again.
const INIT_POLL: Duration = Duration::from_millis(250);
/// How often a start waiting for another to initialise a store says so.
const INIT_WAIT_NOTICE: Duration = Duration::from_secs(10);

/// Who initialises a store (the content of its [`INIT_CLAIM_OBJECT`]).
#[derive(serde::Serialize, serde::Deserialize)]
struct InitClaim {
    /// What started it, e.g. "server 3": a later start of the same claims it again.
    by: String,
    pid: u32,
    at_unix_ms: u64,
}

use kochab_server::datadir::INIT_CLAIM_OBJECT;

/// Makes sure the cluster's store `store` (`name`, e.g. its URL) was turned over to a
/// cluster of servers, doing it if nobody has: the start that creates the store's
/// [`INIT_CLAIM_OBJECT`] (conditional create: of several first starts on several hosts,
/// one) runs a single server on `work` (this host's own directory) with `key`, which
/// creates the cluster if the store holds none and releases every table; the others wait
/// until the store is marked released. `by` names the claimant ("server 3"): a later start
/// with the same name (the claimant died half-way) initialises it again.
pub async fn init_store(
    work: &Path,
    store: Arc<dyn ObjectStore>,
    key: kochab_proto::auth::ClusterKey,
    by: &str,
    name: &str,
) -> Result<(), String> {
    if blocking(store.clone(), |s| {
        kochab_server::datadir::is_released(s.as_ref())
    })
    .await?
    {
        return Ok(());
    }
    let claim = InitClaim {
        by: by.to_string(),
        pid: std::process::id(),
        at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    };
    let json = serde_json::to_vec_pretty(&claim).map_err(|e| e.to_string())?;
    let created = blocking(store.clone(), move |s| {
        match s.create_if_absent(INIT_CLAIM_OBJECT, &json) {
            Ok(()) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Ok(Some(s.get(INIT_CLAIM_OBJECT)?.unwrap_or_default()))
            }
            Err(e) => Err(e),
        }
    })
    .await
    .map_err(|e| format!("{name}: {e}"))?;
    let holder = match created {
        None => None,
        Some(bytes) => match serde_json::from_slice::<InitClaim>(&bytes) {
            // Ours: a retried create whose first try made it, or an earlier start of this
            // server that died before it was done.
            Ok(c) if c.by == by => None,
            Ok(c) => Some(format!(
                "{} (pid {}, claimed at unix ms {})",
                c.by, c.pid, c.at_unix_ms
            )),
            Err(e) => return Err(format!("{name}: {INIT_CLAIM_OBJECT}: {e}")),
        },
    };
    let Some(holder) = holder else {
        eprintln!("kochab: {by} initialises the cluster in {name}");
        return prepare(work, Some(store), Some(key))
            .await
            .map_err(|e| format!("{name}: {e}"));
    };
    let mut notice = Instant::now();
    eprintln!("kochab: waiting for {holder} to initialise the cluster in {name}");
    loop {
        tokio::time::sleep(INIT_POLL).await;
        if blocking(store.clone(), |s| {
            kochab_server::datadir::is_released(s.as_ref())
        })
        .await?
        {
            return Ok(());
        }
        if notice.elapsed() >= INIT_WAIT_NOTICE {
            notice = Instant::now();
            eprintln!(
                "kochab: still waiting for {holder} to initialise the cluster in {name}; \
                 if it died, start it again (or delete {INIT_CLAIM_OBJECT} from the store)"
            );
        }
    }
}

/// Waits until the coordinator has placed every table and nothing moves, or `deadline`.
async fn wait_placed(coord: &CoordClient<CoordState>, deadline: Instant) -> bool {
    while Instant::now() < deadline {
        if let Ok((s, _)) = coord.read_state().await
            && s.bootstrapped
            && s.unplaced.is_empty()
            && s.migrations.is_empty()
            && !s.map.tables.is_empty()
            && all_live(&s)
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Every server the map names is live.
fn all_live(s: &CoordState) -> bool {
    s.map.tables.values().all(|p| s.live(p.owner).is_some())
}

pub async fn up_cluster(args: ClusterArgs) -> Result<(), String> {
    if args.servers == 0 {
        return Err("--servers must be at least 1".into());
    }
    if args.coords == 0 || args.coords > COORDS_MAX {
        return Err(format!("--coords must be 1 to {COORDS_MAX}"));
    }
    if !args.lease.is_finite() || args.lease < 1.0 {
        return Err("--lease must be at least 1 second".into());
    }
    match &args.store {
        // The store says whether it was turned over; the directory keeps the key, the
        // coordinator's logs (file data is in the store too).
        Some((store, how)) => {
            let url = how.store.clone().unwrap_or_default();
            if args.data.join(kochab_server::KEY_FILE).exists() {
                let key = kochab_server::read_key_file(&args.data.join(kochab_server::KEY_FILE))
                    .map_err(|e| format!("{}: {e}", args.data.display()))?;
                // A first start racing `kochab mds` of other hosts claims it like them.
                init_store(&args.data, store.clone(), key, "kochab up", &url).await?;
            } else {
                // A new key: the store must hold no cluster yet (the check says if it does).
                prepare(&args.data, Some(store.clone()), None)
                    .await
                    .map_err(|e| format!("{url}: {e}"))?;
            }
        }
        None if !is_cluster_dir(&args.data) => prepare(&args.data, None, None).await?,
        None => {}
    }
    // Held for the life of the cluster: a plain `kochab up` on the directory refuses.
    let _lock =
        kochab_server::datadir::DataDirLock::acquire(&args.data).map_err(|e| e.to_string())?;
    let recorded = recorded_replicas(&args.data, args.coords)?;
    let logs = args.data.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let ports = if args.port == 0 {
        // Not one of the recorded replicas' ports (free now, but taken once they start).
        let taken: Vec<u16> = recorded
            .iter()
            .flatten()
            .filter_map(|a| a.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
            .collect();
        let mut ports = free_ports(&args.host, args.servers + 2 * args.coords)?;
        ports.retain(|p| !taken.contains(p));
        ports.truncate(args.servers + args.coords);
        ports
    } else {
        (0..args.servers + args.coords)
            .map(|i| {
                args.port
                    .checked_add(i as u16)
                    .ok_or_else(|| "--port too high for that many servers".to_string())
            })
            .collect::<Result<_, _>>()?
    };
    let coord_addrs: Vec<String> = match recorded {
        Some(addrs) => addrs,
        None => {
            let addrs: Vec<String> = ports[args.servers..]
                .iter()
                .map(|p| format!("{}:{p}", args.host))
                .collect();
            if args.coords > 1 {
                record_replicas(&args.data, &addrs)?;
            }
            addrs
        }
    };
    let coord_list = coord_addrs.join(",");
    if let Some(p) = ports[..args.servers]
        .iter()
        .find(|p| coord_addrs.iter().any(|a| a.ends_with(&format!(":{p}"))))
    {
        return Err(format!(
            "port {p} is a coordinator replica's ({}/{REPLICAS_FILE} of {}); choose another --port",
            COORD_DIR,
            args.data.display()
        ));
    }
    let peers = coord_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let key_file = args.data.join(kochab_server::KEY_FILE);
    let key_path = key_file.display().to_string();
    let data = args.data.display().to_string();
    let mut procs = Vec::new();
    for (i, addr) in coord_addrs.iter().enumerate() {
        let id = i + 1;
        let dir = replica_dir(&args.data, id);
        private_dir(&dir)?;
        procs.push(Proc {
            name: if args.coords == 1 {
                "coordinator".into()
            } else {
                format!("coordinator replica {id}")
            },
            args: vec![
                "coord".into(),
                "--id".into(),
                id.to_string(),
                "--listen".into(),
                addr.clone(),
                "--peers".into(),
                peers.clone(),
                "--data".into(),
                dir.display().to_string(),
                "--key-file".into(),
                key_path.clone(),
                // Every replica may start the group (the same members; the first to reach
                // the others wins) and record the tables once it leads: whichever is
                // elected first does, and a lost replica does not stop a new cluster.
                "--bootstrap".into(),
                "--lease".into(),
                args.lease.to_string(),
            ]
            .into_iter()
            .chain(args.coord_extra.iter().cloned())
            .collect(),
            log: logs.join(if args.coords == 1 {
                "coord.log".to_string()
            } else {
                format!("coord-{id}.log")
            }),
            child: None,
            started: Instant::now(),
            pause: Duration::from_millis(200),
        });
    }
    let mut server_addrs = Vec::new();
    for (i, port) in ports[..args.servers].iter().enumerate() {
        let id = FIRST_SERVER_ID + i as u32;
        let addr = format!("{}:{port}", args.host);
        server_addrs.push(addr.clone());
        let mut a = vec![
            "mds".into(),
            "--id".into(),
            id.to_string(),
            "--listen".into(),
            addr,
            "--coord".into(),
            coord_list.clone(),
            "--data".into(),
            data.clone(),
            "--key-file".into(),
            key_path.clone(),
        ];
        if let Some((_, how)) = &args.store {
            a.extend(["--store".into(), how.store.clone().unwrap_or_default()]);
            if let Some(env) = &how.store_env {
                a.extend(["--store-env".into(), env.display().to_string()]);
            }
        }
        if args.no_fsync {
            a.push("--no-fsync".into());
        }
        a.extend(args.mds_extra.iter().cloned());
        procs.push(Proc {
            name: format!("server {id}"),
            args: a,
            log: logs.join(format!("mds-{id}.log")),
            child: None,
            started: Instant::now(),
            pause: Duration::from_millis(200),
        });
    }
    let stopping = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    // The children are started, watched and stopped by one thread that lives as long as
    // the cluster: their parent-death signal is tied to it.
    let supervisor = {
        let stopping = stopping.clone();
        let coords = args.coords;
        std::thread::spawn(move || supervise(procs, coords, &stopping, started_tx))
    };
    started_rx
        .recv()
        .map_err(|_| "the supervisor thread ended".to_string())??;
    let key = kochab_client::read_key_file(&key_file).map_err(|e| format!("{key_path}: {e}"))?;
    let coord_socks: Vec<SocketAddr> = coord_addrs
        .iter()
        .map(|a| {
            a.parse()
                .map_err(|e| format!("coordinator address {a}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let coord =
        CoordClient::<CoordState>::new(kochab_coord::ClientConfig::new(coord_socks, key.key));
    if !wait_placed(&coord, Instant::now() + PLACEMENT_WAIT).await {
        eprintln!(
            "kochab: not every table is placed after {PLACEMENT_WAIT:?}; see {}",
            logs.display()
        );
    }
    let mount_session = match &args.mount {
        Some(dir) => {
            let entries = server_addrs
                .iter()
                .map(|a| a.parse().map_err(|e| format!("server address {a}: {e}")))
                .collect::<Result<Vec<SocketAddr>, String>>()?;
            let cfg = ClientConfig::with_entries(entries, key);
            let options = args.mount_options.as_deref();
            let source = server_addrs.join(",");
            Some(mount::connect_and_mount(cfg, &source, dir, options).await?)
        }
        None => None,
    };
    eprintln!(
        "kochab: data in {}, key in {key_path}, logs in {}",
        args.data.display(),
        logs.display()
    );
    eprintln!(
        "kochab: {} servers at {}, coordinator replicas at {coord_list}",
        args.servers,
        server_addrs.join(",")
    );
    // Every server is an entry point: the list is usable as `KOCHAB_CLUSTER` or as the
    // source of `kochab mount`, and a client given it gets in while any one of them runs.
    println!("kochab: cluster ready at {}", server_addrs.join(","));
    let signal = crate::wait_for_signal();
    match mount_session {
        Some(session) => {
            mount::wait(session, Box::pin(signal)).await;
        }
        None => signal.await,
    }
    eprintln!("kochab: shutting down the cluster");
    stopping.store(true, Ordering::SeqCst);
    let _ = tokio::task::spawn_blocking(move || supervisor.join()).await;
    Ok(())
}

/// Starts every child, restarts those that exit (with a growing pause if they exit right
/// after starting), and once `stopping` is set stops them: servers first, with SIGTERM,
/// then SIGKILL after 10 s; the coordinator replicas (the first `coords`) last.
fn supervise(
    mut procs: Vec<Proc>,
    coords: usize,
    stopping: &AtomicBool,
    started: std::sync::mpsc::Sender<Result<(), String>>,
) {
    for p in &mut procs {
        if let Err(e) = p.spawn() {
            let _ = started.send(Err(e));
            return;
        }
    }
    let _ = started.send(Ok(()));
    while !stopping.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        for p in procs.iter_mut() {
            let Some(child) = p.child.as_mut() else {
                if p.started.elapsed() >= p.pause
                    && let Err(e) = p.spawn()
                {
                    eprintln!("kochab: {e}");
                    p.started = Instant::now();
                }
                continue;
            };
            if let Ok(Some(status)) = child.try_wait() {
                let quick = p.started.elapsed() < QUICK_EXIT;
                p.pause = if quick {
                    (p.pause * 2).min(RESTART_PAUSE_MAX)
                } else {
                    Duration::from_millis(200)
                };
                eprintln!(
                    "kochab: {} exited ({status}); restarting it in {:?} (log: {})",
                    p.name,
                    p.pause,
                    p.log.display()
                );
                p.child = None;
                p.started = Instant::now();
            }
        }
    }
    // Servers first (they may still write their journals), the coordinator last.
    procs.rotate_left(coords);
    for p in &mut procs {
        if let Some(child) = p.child.as_mut() {
            // SAFETY: kill(2) on a pid this process spawned and has not reaped.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in &mut procs {
        if let Some(child) = p.child.as_mut() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Ok(None) = child.try_wait() {
                eprintln!("kochab: {} did not stop within 10 s; killing it", p.name);
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Each coordinator replica's own view (role, term, leader), asked with the cluster key;
/// nothing with a client key (replicas answer only the cluster key).
async fn replica_statuses(
    addrs: &[String],
    key: &kochab_proto::auth::ClientKey,
    tls: &Option<kochab_client::tls::TlsClient>,
) -> Vec<(String, Result<kochab_coord::ReplicaStatus, String>)> {
    if key.id != kochab_proto::auth::ADMIN_KEY_ID {
        return Vec::new();
    }
    let socks: Vec<SocketAddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
    let mut cfg = kochab_coord::ClientConfig::new(socks.clone(), key.key);
    cfg.tls = tls.clone();
    let client = CoordClient::<CoordState>::new(cfg);
    let mut out = Vec::new();
    for a in socks {
        let r = client.status_of(a).await.map_err(|e| e.to_string());
        out.push((a.to_string(), r));
    }
    out
}

/// `kochab status` of a cluster: every server the map names (pid, address, epoch, tables),
/// the placement of every table, and the coordinator replicas the servers follow.
pub async fn status(
    conn: &crate::ConnArgs,
    map: kochab_proto::cluster::DelegationMap,
    json: bool,
) -> Result<(), String> {
    let key = conn.key.load()?;
    let tls = conn.tls.load()?;
    let mut servers = Vec::new();
    for (id, addr) in &map.servers {
        let report = async {
            let mut cfg = ClientConfig::named(addr, key).map_err(|e| e.to_string())?;
            cfg.connections = 1;
            cfg.tls = tls.clone();
            let c = Client::connect(cfg).await.map_err(|e| e.to_string())?;
            c.status().await.map_err(|e| e.to_string())
        }
        .await;
        servers.push((*id, addr.clone(), report));
    }
    let coordinators: Vec<String> = servers
        .iter()
        .find_map(|(_, _, r)| r.as_ref().ok().map(|s| s.coordinators.clone()))
        .unwrap_or_default();
    let replicas = replica_statuses(&coordinators, &key, &tls).await;
    if json {
        let out = serde_json::json!({
            "map_version": map.version.0,
            "coordinators": coordinators,
            "coordinator_replicas": replicas.iter().map(|(addr, r)| match r {
                Ok(s) => serde_json::json!({
                    "addr": addr, "id": s.id, "role": s.role, "term": s.term,
                    "leader": s.leader, "last_applied": s.last_applied,
                }),
                Err(e) => serde_json::json!({"addr": addr, "error": e}),
            }).collect::<Vec<_>>(),
            "servers": servers.iter().map(|(id, addr, r)| match r {
                Ok(s) => serde_json::json!({
                    "id": id.0, "addr": addr, "pid": s.pid, "epoch": s.epoch,
                    "tables": s.tables.iter().map(|t| format!("{:016x}", t.lo)).collect::<Vec<_>>(),
                    "inodes": s.inodes, "rss_bytes": s.rss_bytes, "connections": s.connections,
                    "store": s.store,
                    "status": s,
                }),
                Err(e) => serde_json::json!({"id": id.0, "addr": addr, "error": e}),
            }).collect::<Vec<_>>(),
            "tables": map.tables.iter().map(|(t, p)| serde_json::json!({
                "lo": format!("{:016x}", t.0), "hi": format!("{:016x}", p.hi),
                "owner": p.owner.0, "owner_epoch": p.epoch.0,
            })).collect::<Vec<_>>(),
        });
        println!("{out:#}");
        return Ok(());
    }
    println!(
        "cluster: map version {}, {} servers, {} tables, coordinators {}",
        map.version.0,
        map.servers.len(),
        map.tables.len(),
        if coordinators.is_empty() {
            "unknown".to_string()
        } else {
            coordinators.join(",")
        }
    );
    // One line per store the servers report (one, unless they were started on different
    // ones by mistake).
    let stores: std::collections::BTreeSet<&str> = servers
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok().map(|s| s.store.as_str()))
        .collect();
    for store in stores {
        println!("store: {store}");
    }
    for (addr, r) in &replicas {
        match r {
            Ok(s) => println!(
                "coordinator replica {} at {addr}: {}, term {}, leader {:?}, applied {:?}",
                s.id, s.role, s.term, s.leader, s.last_applied
            ),
            Err(e) => println!("coordinator replica at {addr}: unreachable ({e})"),
        }
    }
    for (id, addr, r) in &servers {
        match r {
            Ok(s) => println!(
                "server {} at {addr}: pid {}, epoch {}, {} tables, {} inodes, {:.1} MiB, {} connections",
                id.0,
                s.pid,
                s.epoch,
                s.tables.len(),
                s.inodes,
                s.rss_bytes as f64 / (1 << 20) as f64,
                s.connections
            ),
            Err(e) => println!("server {} at {addr}: unreachable ({e})", id.0),
        }
    }
    println!(
        "{:<18} {:<18} {:>6} {:>6}",
        "table lo", "table hi", "owner", "epoch"
    );
    for (t, p) in &map.tables {
        println!(
            "{:016x}   {:016x}   {:>6} {:>6}",
            t.0, p.hi, p.owner.0, p.epoch.0
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three first starts on three "hosts" (directories of their own) race to initialise
    /// one new store of whole objects (the stand-in for S3): exactly one runs the single
    /// server and releases the tables, the others wait for the mark; then a single server
    /// refuses the store, and a member with the key opens it (with another key, refused).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_first_starts_racing_on_a_new_store_one_initialises_it() {
        let store: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::objects_only());
        let hosts: Vec<_> = (0..3)
            .map(|_| tempfile::tempdir().expect("tempdir"))
            .collect();
        let key = [5u8; 32];
        let runs: Vec<_> = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let (work, store) = (h.path().join("init"), store.clone());
                tokio::spawn(async move {
                    init_store(&work, store, key, &format!("server {}", i + 2), "mem").await
                })
            })
            .collect();
        for r in runs {
            r.await.expect("join").expect("init_store");
        }
        assert!(kochab_server::datadir::is_released(store.as_ref()).expect("released"));
        // The single server that initialised it stopped cleanly on its host, and only there.
        let ran: Vec<bool> = hosts
            .iter()
            .map(|h| h.path().join("init").join("stopped-cleanly").exists())
            .collect();
        assert_eq!(ran.iter().filter(|&&r| r).count(), 1, "{ran:?}");
        // Every table was released: each manifest names no owner.
        let meta = kochab_server::datadir::read_meta(store.as_ref(), "mem")
            .expect("meta")
            .expect("a cluster");
        for &(lo, _) in &meta.tables {
            let m = kochab_server::checkpoint::read_manifest_by_id(store.as_ref(), lo)
                .expect("manifest")
                .expect("a manifest per table");
            assert!(m.owner.is_none(), "table {lo:016x} released");
        }
        // Initialising again changes nothing.
        init_store(
            &hosts[0].path().join("init"),
            store.clone(),
            key,
            "server 9",
            "mem",
        )
        .await
        .expect("again");
        let single = tempfile::tempdir().expect("tempdir");
        let mut config =
            kochab_server::ServerConfig::new(single.path(), "127.0.0.1:0".parse().unwrap());
        config.cluster_key = Some(key);
        let e = kochab_server::start_on(config, Some(store.clone()))
            .await
            .err()
            .expect("a single server refuses a cluster's store");
        assert!(e.to_string().contains("belongs to a cluster"), "{e}");
        let member = kochab_server::DataDir::open_member(single.path(), store.clone(), key, "mem")
            .expect("member");
        assert_eq!(member.meta.cluster_id, meta.cluster_id);
        assert!(kochab_server::DataDir::open_member(single.path(), store, [6; 32], "mem").is_err());
    }

    #[test]
    fn a_directory_keeps_the_size_and_addresses_of_its_coordinator_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path();
        // New: anything goes, nothing recorded.
        assert_eq!(recorded_replicas(data, 3), Ok(None));
        let addrs: Vec<String> = (1..=3).map(|i| format!("127.0.0.1:{}", 7000 + i)).collect();
        record_replicas(data, &addrs).expect("record");
        assert_eq!(recorded_replicas(data, 3), Ok(Some(addrs)));
        let e = recorded_replicas(data, 1).expect_err("another size");
        assert!(e.contains("--coords 3"), "{e}");
        // A one-replica cluster (its log only, nothing recorded) stays one.
        let one = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(one.path().join(COORD_DIR).join("raft-log")).expect("mkdir");
        assert_eq!(recorded_replicas(one.path(), 1), Ok(None));
        assert!(recorded_replicas(one.path(), 3).is_err());
        assert_eq!(replica_dir(data, 1), data.join(COORD_DIR));
        assert_eq!(replica_dir(data, 2), data.join(COORD_DIR).join("replica-2"));
    }
}
