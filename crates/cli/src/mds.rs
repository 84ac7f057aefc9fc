//! `kochab mds`: one metadata server process of a many-server cluster. It registers with
//! the coordinator group as a new incarnation, starts with no tables, and serves the tables
//! the coordinator ADDs to it (until they are DROPped), over the cluster's shared object
//! store: the directory of this machine's servers (`--data`), or a bucket on S3
//! (`--store`), which servers on separate hosts share with nothing else (see [`run`]).

use clap::Args;
use kochab_cluster::participant::ParticipantConfig;
use kochab_proto::cluster::ServerId;
use kochab_server::ServerConfig;
use kochab_server::cluster_host::{ClusterHost, HostConfig, monotonic_clock};
use kochab_server::datadir::{DataDir, DataDirLock};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Exit status of a fenced server (its supervisor starts a new incarnation).
pub const EXIT_FENCED: i32 = 3;

#[derive(Args)]
pub struct MdsArgs {
    /// This server's id, stable across its restarts. At least 2: id 1 names the journals
    /// of the single-server mode (`kochab up`, journal/1.<epoch>).
    #[arg(long)]
    id: u32,
    /// Address to serve clients and the coordinator on (a concrete port).
    #[arg(long)]
    listen: SocketAddr,
    /// Address clients and the coordinator reach this server at (default: --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// The coordinator replicas' addresses, comma separated (any one suffices).
    #[arg(long, value_delimiter = ',', required = true)]
    coord: Vec<SocketAddr>,
    /// The cluster's data directory shared by the servers of this machine: its object
    /// store is DIR/store; this server's own files go under DIR/mds/<id>/. With --store:
    /// this host's own directory, for its lock only, nothing another host needs (default: $XDG_CACHE_HOME/kochab/mds-<id>,
    /// else ~/.cache/kochab/mds-<id>, else /var/tmp/kochab/mds-<id>).
    #[arg(long)]
    data: Option<PathBuf>,
    #[command(flatten)]
    store: crate::store::StoreArgs,
    /// The cluster key (the one in DIR/cluster.key; with --store, the same file on every
    /// host: the store records a check of it, and a server given another is refused).
    #[arg(long)]
    key_file: PathBuf,
    #[command(flatten)]
    tls: crate::ServeTlsArgs,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Do not fdatasync before replying (a machine crash may lose acknowledged operations).
    #[arg(long)]
    no_fsync: bool,
    /// Worker threads (default: one per core). A server held to a fraction of a CPU
    /// serves more with one: a second worker only adds hand-offs between threads.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Journal records between checkpoint rounds (tests set it low).
    #[arg(long, hide = true)]
    checkpoint_records: Option<u64>,
    /// Bytes per journal segment (tests set it low).
    #[arg(long, hide = true)]
    segment_bytes: Option<u64>,
    /// How operations that need tables of several servers run: `borrow` moves the tables
    /// here for the operation (BORROW/RETURN); `txn` runs a two-phase commit between the
    /// servers where the operation is covered (a rename of a non-directory onto a new
    /// name, a hard link), else borrows; `auto` is `txn` and also reports which other
    /// servers' tables its multi-server operations needed, so that the coordinator moves
    /// a table one server keeps needing there for good (affinity).
    #[arg(long, default_value = "borrow")]
    multi_server: kochab_server::txn_host::MultiServer,
}

pub async fn run(args: MdsArgs) -> Result<(), String> {
    if args.id < 2 {
        return Err(format!(
            "--id {}: cluster servers use ids from 2 (id 1 names the single-server mode's \
             journals)",
            args.id
        ));
    }
    if args.listen.port() == 0 {
        return Err(
            "--listen needs a concrete port (it is registered with the coordinator)".into(),
        );
    }
    // The engine's self-test first: a store that cannot be used is the first thing to say.
    let store = crate::store::open_async(&args.store).await?;
    let key = crate::coord::key_file(&args.key_file)?;
    let tls = args.tls.load()?;
    let (data_dir, dir, import_keys_from) = match store {
        Some(store) => open_on_store(&args, store, key).await?,
        None => {
            let Some(data_dir) = args.data.clone() else {
                return Err("--data DIR or --store s3://BUCKET/PREFIX is needed".into());
            };
            let (lock, dir) = open_shared_dir(&args, &data_dir, key).await?;
            // A single server's keys go with its data directory when it becomes a
            // cluster's.
            (data_dir.clone(), (lock, dir), Some(data_dir))
        }
    };
    let (_lock, dir) = dir;
    let addr = args
        .advertise
        .clone()
        .unwrap_or_else(|| args.listen.to_string());
    let host = ClusterHost::register(HostConfig {
        server: ServerId(args.id),
        addr: addr.clone(),
        coord: args.coord.clone(),
        key,
        coord_tls: tls.as_ref().map(|(_, dial)| dial.clone()),
        ranges: dir.meta.tables.clone(),
        // Renewed four times per lease of `kochab up` (2 s): a renewal delayed by a busy
        // coordinator does not cost the server its lease.
        participant: ParticipantConfig {
            renew_every_ms: 400,
            ..ParticipantConfig::default()
        },
        clock: monotonic_clock(),
        import_keys_from,
        multi_server: args.multi_server,
    })
    .await
    .map_err(|e| format!("server {}: {e}", args.id))?;
    let mut config = ServerConfig::new(&data_dir, args.listen);
    config.metrics_listen = args.metrics;
    config.tls_cert_key = args.tls.cert_key();
    config.store_description = crate::store::description(&args.store);
    config.fsync = !args.no_fsync;
    if let Some(n) = args.checkpoint_records {
        config.checkpoint_records = n.max(1);
    }
    if let Some(b) = args.segment_bytes {
        config.segment_bytes = (b.max(kochab_server::server::SEGMENT_BYTES_MIN) / 4096) * 4096;
    }
    let server = kochab_server::server::start_cluster_member(
        config,
        dir.store.clone(),
        dir.key,
        dir.meta.engine.clone(),
        host.clone(),
    )
    .await
    .map_err(|e| format!("cannot start server {}: {e}", args.id))?;
    println!(
        "kochab: metadata server {} ({}) serving at {addr}",
        args.id,
        host.journal_id()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("signal handler: {e}"))?;
    let journal_failure = server.journal_failure();
    let fenced = host.fenced();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        why = journal_failure => {
            server.shutdown().await;
            return Err(format!("stopped: the journal failed: {why}"));
        }
        why = fenced => {
            // Nothing of this incarnation may be acknowledged any more; a restart is a new one.
            eprintln!("kochab: {why}; exiting");
            std::process::exit(EXIT_FENCED);
        }
    }
    server.shutdown().await;
    Ok(())
}

/// The cluster in the data directory `data_dir` shared by this machine's servers, with this
/// server's lock in DIR/mds/<id>/.
async fn open_shared_dir(
    args: &MdsArgs,
    data_dir: &Path,
    key: [u8; 32],
) -> Result<(DataDirLock, DataDir), String> {
    let own = data_dir.join("mds").join(args.id.to_string());
    // Two processes with one id would write one journal.
    let lock = DataDirLock::acquire(&own).map_err(|e| format!("{}: {e}", own.display()))?;
    let data = data_dir.to_path_buf();
    let dir = tokio::task::spawn_blocking(move || DataDir::open_existing(&data))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{}: {e}", data_dir.display()))?;
    if dir.key != key {
        return Err(format!(
            "{} is not the key of the cluster in {}",
            args.key_file.display(),
            data_dir.display()
        ));
    }
    Ok((lock, dir))
}

/// The cluster in the store on S3 `store`, which holds everything durable: the cluster
/// description, the journals, checkpoints and manifests of every server. This host's own
/// directory (`--data`, or the default) holds only this server's lock (file data is in the
/// store too). A store with no cluster yet is initialised first (see
/// [`crate::cluster_up::init_store`]: of several servers started at once on a new store,
/// one does it, the others wait).
async fn open_on_store(
    args: &MdsArgs,
    store: std::sync::Arc<dyn kochab_store::ObjectStore>,
    key: [u8; 32],
) -> Result<(PathBuf, (DataDirLock, DataDir), Option<PathBuf>), String> {
    let url = args.store.store.clone().unwrap_or_default();
    let local = match &args.data {
        Some(d) => d.clone(),
        None => default_local_dir(args.id)?,
    };
    let own = local.join("mds").join(args.id.to_string());
    // Two processes with one id on this host would write one journal (on two hosts, the
    // epochs in the store keep them apart: the later start fences the earlier).
    let lock = DataDirLock::acquire(&own).map_err(|e| format!("{}: {e}", own.display()))?;
    crate::cluster_up::init_store(
        &own.join("init"),
        store.clone(),
        key,
        &format!("server {}", args.id),
        &url,
    )
    .await?;
    let path = local.clone();
    let name = url.clone();
    let dir = tokio::task::spawn_blocking(move || DataDir::open_member(&path, store, key, &name))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{}: {e}", args.key_file.display()))?;
    eprintln!(
        "kochab: server {}: metadata in {url}; local directory {} (lock, file data)",
        args.id,
        local.display()
    );
    // The keys of a single server that ran on this directory (`kochab up --store`), if
    // any: the first server to join a cluster without keys imports them.
    Ok((local.clone(), (lock, dir), Some(local)))
}

/// This host's directory for server `id` when --store is given without --data.
fn default_local_dir(id: u32) -> Result<PathBuf, String> {
    let base = match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
        (Some(x), _) if !x.is_empty() => PathBuf::from(x).join("kochab"),
        (_, Some(h)) if !h.is_empty() => PathBuf::from(h).join(".cache").join("kochab"),
        _ => PathBuf::from("/var/tmp/kochab"),
    };
    Ok(base.join(format!("mds-{id}")))
}
