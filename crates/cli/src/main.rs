//! `kochab`: one binary for every role. See `kochab --help`.

mod admin;
mod cluster_up;
mod coord;
mod crosscheck;
mod fsshell;
mod mds;
mod mount;
mod store;

use clap::{Args, Parser, Subcommand};
use kochab_bench::{BenchConfig, Phase};
use kochab_client::{Client, ClientConfig, resolve_addr};
use kochab_proto::auth::{ClientKey, client_key_from_text};
use kochab_server::ServerConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Default port of the metadata service.
const DEFAULT_PORT: u16 = 7420;

#[derive(Parser)]
#[command(
    name = "kochab",
    version,
    about = "Kochab: a distributed file system with a transparently scalable metadata service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an embedded cluster in the foreground until SIGINT or SIGTERM.
    Up(UpArgs),
    /// mdtest-like metadata benchmark through the native client.
    Bench(BenchArgs),
    /// Show the cluster's tables, inode counts, journal and memory.
    Status {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Mount a cluster with FUSE.
    Mount(MountArgs),
    /// Check the namespace invariants (no orphans, no cycles, nlink = names) of a running
    /// cluster; with --data, check (or repair) a stopped server's data directory instead.
    Fsck(FsckArgs),
    /// Run one replica of the coordinator group until SIGINT or SIGTERM.
    Coord(coord::CoordArgs),
    /// Run one metadata server of a many-server cluster under the coordinator, until
    /// SIGINT or SIGTERM (cluster server ids start at 2).
    Mds(mds::MdsArgs),
    /// Show the coordinator group: each replica's role, term and applied index, and the
    /// delegation map's summary.
    CoordStatus(coord::CoordStatusArgs),
    /// Client keys (admin key only): each with its squash rule and the ids it may claim.
    Key {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(subcommand)]
        cmd: KeyCommand,
    },
    /// Tables of a cluster of servers (cluster key): move one to another server, online.
    Table {
        #[command(subcommand)]
        cmd: admin::TableCommand,
    },
    /// Servers of a cluster (cluster key): drain one (move all its tables off and keep
    /// it empty) or bring a drained one back into service.
    Server {
        #[command(subcommand)]
        cmd: admin::ServerCommand,
    },
    /// The object store by itself (`kochab store bench`: its throughput from one client).
    Store {
        #[command(subcommand)]
        cmd: store::StoreCommand,
    },
    /// A small file-system shell over the native client.
    Fs {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(subcommand)]
        cmd: fsshell::FsCommand,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Make a client key and write it (mode 0600) to --out.
    Add {
        /// File to write the new key to (must not exist).
        #[arg(long)]
        out: PathBuf,
        /// root: uid/gid 0 become --anon-uid/--anon-gid; all: every request runs as them;
        /// none: credentials pass as sent (a trusted client, as root as the admin key).
        #[arg(long, default_value = "root")]
        squash: String,
        #[arg(long, default_value_t = kochab_proto::NOBODY)]
        anon_uid: u32,
        #[arg(long, default_value_t = kochab_proto::NOBODY)]
        anon_gid: u32,
        /// Uids the key may claim, LO-HI (others are refused with EPERM).
        #[arg(long)]
        uids: Option<String>,
        /// Gids the key may claim as primary group, LO-HI (others EPERM; supplementary
        /// groups outside it are dropped).
        #[arg(long)]
        gids: Option<String>,
        /// What the key is for.
        #[arg(long, default_value = "")]
        note: String,
    },
    /// List the client keys (never their secrets).
    List,
    /// Revoke a client key: refused from now on, its connections closed at once.
    Revoke { id: u32 },
}

fn id_range(s: &str) -> Result<kochab_proto::IdRange, String> {
    let (lo, hi) = s.split_once('-').unwrap_or((s, s));
    let parse = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("{s:?} is not an id range LO-HI"))
    };
    let r = kochab_proto::IdRange {
        lo: parse(lo)?,
        hi: parse(hi)?,
    };
    if r.lo > r.hi {
        return Err(format!("id range {s:?} is empty"));
    }
    Ok(r)
}

/// How long `kochab key` waits for its answer. A cluster's server answers an add or a
/// revocation once every live server applied it, which takes up to a lease or two when a
/// server has to be fenced first (`kochab_cluster::keys::settle_bound_ms`); a retry after
/// a timeout could make a second key.
const KEY_COMMAND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);

async fn key_command(conn: ConnArgs, cmd: KeyCommand) -> Result<(), String> {
    use kochab_proto::{KeyPolicy, Squash};
    let client = connect_with(&conn, Some(KEY_COMMAND_TIMEOUT)).await?;
    match cmd {
        KeyCommand::Add {
            out,
            squash,
            anon_uid,
            anon_gid,
            uids,
            gids,
            note,
        } => {
            let squash = match squash.as_str() {
                "root" => Squash::Root,
                "all" => Squash::All,
                "none" => Squash::None,
                other => return Err(format!("--squash {other:?}: root, all or none")),
            };
            let policy = KeyPolicy {
                squash,
                anon_uid,
                anon_gid,
                uids: uids.as_deref().map(id_range).transpose()?,
                gids: gids.as_deref().map(id_range).transpose()?,
            };
            // Refuse an existing --out before the server makes a key nobody would get.
            if out.exists() {
                return Err(format!("{} exists; not replacing it", out.display()));
            }
            let key = client
                .key_add(policy, &note)
                .await
                .map_err(|e| e.to_string())?;
            kochab_client::write_key_file(&out, &key).map_err(|e| {
                format!(
                    "key {} was made but cannot be written to {}: {e} (revoke it)",
                    key.id,
                    out.display()
                )
            })?;
            println!("key {} written to {}", key.id, out.display());
        }
        KeyCommand::List => {
            println!(
                "{:>5} {:<8} {:<6} {:>11} {:>11} {:<13} {:<13} note",
                "id", "state", "squash", "anon uid", "anon gid", "uids", "gids"
            );
            let range = |r: Option<kochab_proto::IdRange>| {
                r.map_or("any".to_string(), |r| format!("{}-{}", r.lo, r.hi))
            };
            for k in client.key_list().await.map_err(|e| e.to_string())? {
                println!(
                    "{:>5} {:<8} {:<6} {:>11} {:>11} {:<13} {:<13} {}",
                    k.id,
                    if k.revoked { "revoked" } else { "active" },
                    format!("{:?}", k.policy.squash).to_lowercase(),
                    k.policy.anon_uid,
                    k.policy.anon_gid,
                    range(k.policy.uids),
                    range(k.policy.gids),
                    k.note
                );
            }
        }
        KeyCommand::Revoke { id } => {
            client.key_revoke(id).await.map_err(|e| e.to_string())?;
            println!("key {id} revoked");
        }
    }
    Ok(())
}

#[derive(Args)]
struct UpArgs {
    /// Data directory (created on first start; reused, and recovered, afterwards).
    #[arg(long, default_value = "./kochab-data")]
    data: PathBuf,
    #[command(flatten)]
    store: store::StoreArgs,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the metadata service (0 picks a free one). With --servers: the first
    /// server's; the others follow it, then the coordinator replicas.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Run a cluster: a coordinator and this many metadata servers, each its own process
    /// (the data directory then belongs to the cluster; plain `up` refuses it).
    #[arg(long)]
    servers: Option<usize>,
    /// With --servers: a server's lease in seconds. A server that dies is replaced (its
    /// tables recovered by another) about this long after it stopped renewing.
    #[arg(long, default_value_t = 2.0, requires = "servers")]
    lease: f64,
    /// With --servers: coordinator replicas, each its own process (3 survive the loss of
    /// one, the leader included). Their ports follow the servers' (recorded in DATA/coord/
    /// on the first start: a restart listens where the group's membership says).
    #[arg(long, default_value_t = 1, requires = "servers")]
    coords: usize,
    /// Port of the Prometheus metrics endpoint (0 picks a free one).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// Buffered mode: acknowledge before fdatasync. A machine crash may lose acknowledged
    /// operations; a process crash does not.
    #[arg(long)]
    no_fsync: bool,
    /// Worker threads of the server (default: one per core); with --servers, of each
    /// server process.
    #[arg(long)]
    threads: Option<usize>,
    /// Also mount the cluster here (FUSE), for as long as it runs.
    #[arg(long)]
    mount: Option<PathBuf>,
    /// Options of that mount, as `kochab mount -o` takes them (e.g. dev,suid).
    #[arg(long, value_name = "OPTIONS", requires = "mount")]
    mount_options: Option<String>,
    /// TLS for client connections: this PEM certificate chain (it must name the host
    /// clients are given: a DNS name, or an IP address for a numeric one) ...
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// ... and this PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With TLS and --mount: the PEM file of the authority the mount trusts.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Seconds a disconnected client keeps its open files and locks.
    #[arg(long, default_value_t = 10.0)]
    session_grace: f64,
    /// Journal records between checkpoint rounds (tests set it low).
    #[arg(long, hide = true)]
    checkpoint_records: Option<u64>,
    /// Bytes per journal segment (tests set it low).
    #[arg(long, hide = true)]
    segment_bytes: Option<u64>,
    /// With --servers: the coordinator's load-balancing gap (see `kochab coord
    /// --load-gap-ops`; tests set it low).
    #[arg(long, hide = true, requires = "servers")]
    load_gap_ops: Option<u64>,
    /// With --servers: the coordinator's split threshold (see `kochab coord
    /// --split-inodes`; tests set it low).
    #[arg(long, hide = true, requires = "servers")]
    split_inodes: Option<u64>,
    /// With --servers: how multi-server operations run (`borrow`, `txn` or `auto`; see
    /// `kochab mds --multi-server`).
    #[arg(long, requires = "servers")]
    multi_server: Option<String>,
}

#[derive(Args)]
struct FsckArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Check this data directory offline (its server, or every server and coordinator of
    /// its cluster, must be stopped): journal damage, whether a start would refuse, then
    /// every table loaded and the namespace invariants checked across all of them (no
    /// orphan, no cycle, exact nlink). Changes nothing unless --repair is given (a torn
    /// journal tail is zeroed, as the next start would).
    #[arg(long)]
    data: Option<PathBuf>,
    /// With --data (or --store): make a directory (a store) whose journal is damaged start
    /// again.
    #[arg(long)]
    repair: bool,
    /// With --repair: agree to lose every journal record from the damage on (the command
    /// lists exactly which).
    #[arg(long, requires = "repair")]
    accept_loss: bool,
    /// Check a stopped server's or cluster's store on S3 instead (see `kochab up --store`,
    /// `kochab mds --store`), as --data checks a directory's: every server's journals,
    /// whether a start would refuse, the namespace across every table.
    #[command(flatten)]
    store: store::StoreArgs,
}

#[derive(Args)]
struct MountArgs {
    /// HOST:PORT of any server of the cluster; several, comma-separated, are tried in turn.
    cluster: String,
    /// Where to mount.
    mountpoint: PathBuf,
    /// Stay in the foreground (otherwise the mount runs in the background).
    #[arg(long)]
    foreground: bool,
    #[command(flatten)]
    key: KeyArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Where the background mount writes its log.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Mount options, comma-separated (as mount(8) passes them to mount.fuse.kochab):
    /// relatime (default), noatime, strictatime, ro, rw, suid, dev (mounts are nosuid,nodev
    /// unless these are given), sync (every write reaches the servers before it returns;
    /// default async: small writes are gathered in the mount until close or fsync); others
    /// are accepted and ignored.
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Option<String>,
}

/// How a client finds its key. The key itself is never an argument (arguments show in
/// `ps` to every local user): a file (mode 0600), or the KOCHAB_KEY environment variable.
#[derive(Args, Clone)]
struct KeyArgs {
    /// File holding the key: the cluster key (written by `kochab up` into its data
    /// directory) or a client key from `kochab key add`. Refused if group or others may
    /// read it. The environment variable KOCHAB_KEY (HEX or ID:HEX), if set, is used instead.
    #[arg(
        long,
        env = "KOCHAB_KEY_FILE",
        default_value = "./kochab-data/cluster.key"
    )]
    key_file: PathBuf,
}

impl KeyArgs {
    fn load(&self) -> Result<ClientKey, String> {
        if let Ok(text) = std::env::var("KOCHAB_KEY") {
            return client_key_from_text(&text)
                .ok_or_else(|| "KOCHAB_KEY is not HEX or ID:HEX (64 hex digits)".to_string());
        }
        kochab_client::read_key_file(&self.key_file)
            .map_err(|e| format!("cannot read the key from {}: {e}", self.key_file.display()))
    }
}

/// TLS to the cluster (when its server runs with --tls-cert).
#[derive(Args, Clone)]
pub(crate) struct TlsArgs {
    /// Connect with TLS, trusting the certificate authorities in this PEM file.
    #[arg(long, env = "KOCHAB_TLS_CA")]
    tls_ca: Option<PathBuf>,
}

/// TLS of a process of a cluster on separate hosts (`kochab mds`, `kochab coord`): all
/// three or none, so that a cluster is encrypted throughout.
#[derive(Args, Clone)]
pub(crate) struct ServeTlsArgs {
    /// Serve over TLS with this PEM certificate chain. It must name the address others
    /// dial this process at: for `mds`, the host of --advertise (a DNS name, or an IP
    /// address for a numeric one); for `coord`, the IP address of --listen/--peers.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// Dial the cluster's other processes with TLS, trusting the certificate authorities
    /// in this PEM file (each certificate is checked against the address dialed).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
}

/// [`ServeTlsArgs`] loaded: the listener's acceptor and the dialer's authorities.
pub(crate) type ServeTls = Option<(
    kochab_server::tls::TlsAcceptor,
    kochab_client::tls::TlsClient,
)>;

impl ServeTlsArgs {
    /// Loads the certificate, key and authorities (so that a bad file fails at start,
    /// before the process registers anywhere).
    pub(crate) fn load(&self) -> Result<ServeTls, String> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca)
        else {
            return Ok(None);
        };
        let acceptor = kochab_server::tls::acceptor(cert, key)
            .map_err(|e| format!("cannot load --tls-cert/--tls-key: {e}"))?;
        let dial = kochab_client::tls::TlsClient::from_ca_file(ca)
            .map_err(|e| format!("cannot load --tls-ca: {e}"))?;
        Ok(Some((acceptor, dial)))
    }

    /// The certificate and key files, for a [`ServerConfig`].
    pub(crate) fn cert_key(&self) -> Option<(PathBuf, PathBuf)> {
        self.tls_cert.clone().zip(self.tls_key.clone())
    }
}

impl TlsArgs {
    pub(crate) fn load(&self) -> Result<Option<kochab_client::tls::TlsClient>, String> {
        self.tls_ca
            .as_deref()
            .map(|ca| {
                kochab_client::tls::TlsClient::from_ca_file(ca)
                    .map_err(|e| format!("cannot load --tls-ca: {e}"))
            })
            .transpose()
    }
}

#[derive(Args, Clone)]
struct ConnArgs {
    /// HOST:PORT of any server of the cluster; several, comma-separated, are tried in
    /// turn (each hands out the map of the whole cluster).
    #[arg(long, env = "KOCHAB_CLUSTER", default_value = "127.0.0.1:7420")]
    cluster: String,
    #[command(flatten)]
    key: KeyArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Connections in the client's pool.
    #[arg(long, default_value_t = 2)]
    connections: usize,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Files in total, over all clients.
    #[arg(long, default_value_t = 100_000)]
    items: u64,
    /// All clients in one shared directory instead of one directory each.
    #[arg(long)]
    shared_dir: bool,
    /// Each client's directory directly under the root (`<base>.c<i>`), so that clients
    /// start in different tables and, with several servers, on different servers.
    #[arg(long, conflicts_with = "shared_dir")]
    top_level: bool,
    /// In the create phase, also rename every Nth file into the next client's directory
    /// (a multi-server operation when the directories are on different servers).
    #[arg(long, default_value_t = 0)]
    cross_every: u64,
    /// Phases to run, in order.
    #[arg(long, default_value = "create,stat,remove", value_delimiter = ',')]
    phases: Vec<String>,
    /// Directory under the root that holds the benchmark's files.
    #[arg(long, default_value = "kochab-bench")]
    base: String,
    /// Print one JSON object keyed by phase.
    #[arg(long)]
    json: bool,
    /// Worker threads of the benchmark's runtime (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Instead of the phases: for this many seconds (at most --items items) each client
    /// repeats create, stat and rename-in-its-directory, counting every error; then
    /// checks that each acknowledged create and rename is present exactly once, and
    /// reports operations per second over time.
    #[arg(long, conflicts_with_all = ["shared_dir", "cross_every"])]
    churn: Option<f64>,
}

async fn connect(conn: &ConnArgs) -> Result<Client, String> {
    connect_with(conn, None).await
}

/// [`connect`], with requests that may take up to `request_timeout` if given.
async fn connect_with(
    conn: &ConnArgs,
    request_timeout: Option<std::time::Duration>,
) -> Result<Client, String> {
    let key = conn.key.load()?;
    let mut cfg = ClientConfig::named(&conn.cluster, key).map_err(|e| e.to_string())?;
    if let Some(t) = request_timeout {
        cfg.request_timeout = t;
    }
    cfg.connections = conn.connections;
    cfg.tls = conn.tls.load()?;
    Client::connect(cfg)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", conn.cluster))
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KOCHAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour codes only on a terminal: logs redirected to a file or a journal stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime, String> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        b.worker_threads(n.max(1));
    }
    b.enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

async fn up(args: UpArgs) -> Result<(), String> {
    if let Some(servers) = args.servers {
        let store = store::open_async(&args.store)
            .await?
            .map(|s| (s, args.store.clone()));
        if args.tls_cert.is_some() {
            return Err(
                "--servers does not take TLS: its coordinators and servers are on this \
                 machine and talk over loopback. A cluster across hosts runs `kochab coord` \
                 and `kochab mds` with --tls-cert, --tls-key and --tls-ca on each host \
                 (docs/SECURITY.md)"
                    .into(),
            );
        }
        let mut mds_extra = Vec::new();
        if let Some(n) = args.checkpoint_records {
            mds_extra.extend(["--checkpoint-records".to_string(), n.to_string()]);
        }
        if let Some(b) = args.segment_bytes {
            mds_extra.extend(["--segment-bytes".to_string(), b.to_string()]);
        }
        if let Some(n) = args.threads {
            mds_extra.extend(["--threads".to_string(), n.to_string()]);
        }
        if let Some(m) = &args.multi_server {
            m.parse::<kochab_server::txn_host::MultiServer>()?;
            mds_extra.extend(["--multi-server".to_string(), m.clone()]);
        }
        return cluster_up::up_cluster(cluster_up::ClusterArgs {
            data: args.data,
            host: args.host,
            port: args.port,
            servers,
            coords: args.coords,
            lease: args.lease,
            no_fsync: args.no_fsync,
            mount: args.mount,
            mount_options: args.mount_options,
            mds_extra,
            coord_extra: [
                ("--load-gap-ops", args.load_gap_ops),
                ("--split-inodes", args.split_inodes),
            ]
            .into_iter()
            .filter_map(|(flag, n)| Some([flag.to_string(), n?.to_string()]))
            .flatten()
            .collect(),
            store,
        })
        .await;
    }
    if cluster_up::is_cluster_dir(&args.data) {
        return Err(format!(
            "{} belongs to a cluster of servers (it has {}/); start it with --servers N",
            args.data.display(),
            cluster_up::COORD_DIR
        ));
    }
    let listen: SocketAddr =
        resolve_addr(&format!("{}:{}", args.host, args.port)).map_err(|e| e.to_string())?;
    let mut config = ServerConfig::new(&args.data, listen);
    config.fsync = !args.no_fsync;
    config.metrics_listen = args.metrics_port.map(|p| SocketAddr::new(listen.ip(), p));
    if let Some(n) = args.checkpoint_records {
        config.checkpoint_records = n.max(1);
    }
    if let Some(b) = args.segment_bytes {
        config.segment_bytes = (b.max(kochab_server::server::SEGMENT_BYTES_MIN) / 4096) * 4096;
    }
    config.session_grace =
        std::time::Duration::from_secs_f64(args.session_grace.clamp(0.0, 3600.0));
    config.tls_cert_key = args.tls_cert.clone().zip(args.tls_key.clone());
    let mount_tls = TlsArgs {
        tls_ca: args.tls_ca.clone(),
    }
    .load()?;
    if config.tls_cert_key.is_some() && args.mount.is_some() && mount_tls.is_none() {
        return Err("--mount with TLS needs --tls-ca for the mount".into());
    }
    let store = store::open_async(&args.store).await?;
    let on_s3 = store.is_some();
    config.store_description = store::description(&args.store);
    let server = kochab_server::start_on(config, store)
        .await
        .map_err(|e| format!("cannot start: {e}"))?;
    if on_s3 {
        eprintln!(
            "kochab: metadata (journal, checkpoints) and file data in {}; key in {}",
            args.store.store.as_deref().unwrap_or_default(),
            server.data_dir.join(kochab_server::KEY_FILE).display()
        );
    } else {
        eprintln!(
            "kochab: data in {}, key in {}",
            server.data_dir.display(),
            server.data_dir.join(kochab_server::KEY_FILE).display()
        );
    }
    if let Some(m) = server.metrics_addr {
        eprintln!("kochab: metrics at http://{m}/metrics");
    }
    if args.no_fsync {
        eprintln!(
            "kochab: buffered mode (--no-fsync): a machine crash may lose acknowledged operations"
        );
    }
    let mount = match &args.mount {
        Some(dir) => {
            let mut cfg = ClientConfig::new(server.addr, server.key);
            cfg.tls = mount_tls;
            let source = server.addr.to_string();
            let options = args.mount_options.as_deref();
            Some(mount::connect_and_mount(cfg, &source, dir, options).await?)
        }
        None => None,
    };
    let signal = wait_for_signal();
    println!("kochab: cluster ready at {}", server.addr);
    // Fail-stop: a server whose journal fails has told its clients (EIO) and stops here,
    // with an error, rather than stay up looking healthy.
    let journal_failure = server.journal_failure();
    let stop = async move {
        tokio::select! {
            _ = signal => None,
            why = journal_failure => Some(why),
        }
    };
    let failed = match mount {
        Some(session) => mount::wait(session, Box::pin(stop)).await.flatten(),
        None => stop.await,
    };
    match failed {
        Some(why) => {
            eprintln!("kochab: the journal failed ({why}); stopping without acknowledging more");
            server.shutdown().await;
            Err(format!("stopped: the journal failed: {why}"))
        }
        None => {
            eprintln!("kochab: shutting down");
            server.shutdown().await;
            Ok(())
        }
    }
}

/// Resolves at SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled: a signal that arrives right after "cluster ready" is printed
/// must stop the server cleanly, not kill it with the default action.
pub(crate) fn wait_for_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    );
    async move {
        let (Ok(mut int), Ok(mut term)) = handlers else {
            // Without signal handlers there is nothing to wait for but the end of time.
            std::future::pending::<()>().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
    }
}

async fn bench(args: BenchArgs) -> Result<(), String> {
    let mut phases = Vec::new();
    for p in &args.phases {
        phases.push(
            Phase::parse(p).ok_or_else(|| format!("unknown phase {p:?} (create, stat, remove)"))?,
        );
    }
    let client = connect(&args.conn).await?;
    let mut cfg = BenchConfig {
        clients: args.clients,
        items: args.items,
        shared_dir: args.shared_dir,
        top_level: args.top_level,
        cross_every: args.cross_every,
        phases,
        base: args.base.clone(),
        progress: !args.json,
    };
    if let Some(seconds) = args.churn {
        cfg.phases.clear();
        return churn(&client, &cfg, seconds, args.json).await;
    }
    let report = kochab_bench::run(&client, &cfg)
        .await
        .map_err(|e| format!("benchmark failed: {e}"))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{} clients, {} files, {}",
            args.clients,
            args.items,
            if args.shared_dir {
                "one shared directory"
            } else {
                "one directory per client"
            }
        );
        println!(
            "{:<8} {:>12} {:>10} {:>10} {:>8}",
            "phase", "ops/s", "p50 us", "p99 us", "errors"
        );
        for (name, r) in &report {
            println!(
                "{name:<8} {:>12.0} {:>10.0} {:>10.0} {:>8}",
                r.ops_per_sec, r.p50_us, r.p99_us, r.errors
            );
        }
    }
    Ok(())
}

async fn churn(client: &Client, cfg: &BenchConfig, seconds: f64, json: bool) -> Result<(), String> {
    let r = kochab_bench::churn::run(client, cfg, seconds)
        .await
        .map_err(|e| format!("benchmark failed: {e}"))?;
    if json {
        println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    } else {
        println!(
            "{} clients, {:.1} s: {} ops, {:.0} ops/s; per second: {:?}",
            cfg.clients, r.seconds, r.ops, r.ops_per_sec, r.per_second
        );
        println!(
            "lowest second {} vs median {:.0} ({:.2}); errors {}; creates acked {}, renames acked {}; lost {}, doubled {}, ambiguous {}",
            r.min_window,
            r.median_window,
            r.dip,
            r.errors,
            r.creates_acked,
            r.renames_acked,
            r.lost,
            r.doubled,
            r.ambiguous
        );
        if let Some(e) = &r.first_error {
            println!("first error: {e}");
        }
    }
    if r.errors > 0 || r.lost > 0 || r.doubled > 0 {
        return Err(format!(
            "{} errors, {} lost, {} doubled",
            r.errors, r.lost, r.doubled
        ));
    }
    Ok(())
}

async fn status(conn: ConnArgs, json: bool) -> Result<(), String> {
    let client = connect(&conn).await?;
    if let Ok(kochab_proto::Reply::Map(map)) = client
        .call(&kochab_proto::Credentials::root(), kochab_proto::Op::GetMap)
        .await
        && !map.servers.is_empty()
    {
        return admin::status(&conn, map, json).await;
    }
    let s = client.status().await.map_err(|e| e.to_string())?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "server {:016x}, up {:.1}s, {} connections",
        s.server_id,
        s.uptime_ms as f64 / 1000.0,
        s.connections
    );
    println!("store: {}", s.store);
    println!(
        "inodes {}, entries {}, resident memory {:.1} MiB",
        s.inodes,
        s.dentries,
        s.rss_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "journal: {:.1} MiB in {} segments, applied LSN {}, durable LSN {} ({})",
        s.journal_bytes as f64 / (1 << 20) as f64,
        s.journal_segments,
        s.applied_lsn,
        s.durable_lsn,
        if s.durable_mode {
            "fsync before reply"
        } else {
            "buffered"
        }
    );
    let sl = &s.slices;
    if *sl != Default::default() {
        println!(
            "slice objects: {} freed and deleted, {} orphans deleted in {} GC passes, {} chunks compacted",
            sl.freed_deleted, sl.orphans_deleted, sl.gc_passes, sl.chunks_compacted
        );
    }
    println!(
        "{:<18} {:<18} {:<10} {:>10} {:>10} {:>12}",
        "table lo", "table hi", "region", "inodes", "entries", "ckpt LSN"
    );
    for t in &s.tables {
        println!(
            "{:016x}   {:016x}   {:<10} {:>10} {:>10} {:>12}",
            t.lo, t.hi, t.region, t.inodes, t.dentries, t.checkpoint_lsn
        );
    }
    Ok(())
}

/// Refuses `--repair` without `--accept-loss`.
fn check_repair_flags(repair: bool, accept_loss: bool) -> Result<(), String> {
    if repair && !accept_loss {
        return Err("--repair drops journal records after damage; \
             say so with --accept-loss (run without --repair first to see what is damaged)"
            .to_string());
    }
    Ok(())
}

/// `kochab fsck --data DIR [--repair --accept-loss]`: offline, on a stopped server's directory.
fn fsck_offline(dir: &std::path::Path, repair: bool, accept_loss: bool) -> Result<(), String> {
    check_repair_flags(repair, accept_loss)?;
    let report = if repair {
        kochab_server::recovery::repair_accept_loss(dir)
    } else {
        kochab_server::recovery::check_offline(dir)
    }
    .map_err(|e| format!("{}: {e}", dir.display()))?;
    let name = dir.display().to_string();
    if !print_offline(&report, &name)? || repair {
        return Ok(());
    }
    // The namespace across every table: in a cluster's directory each table is loaded from
    // its manifest and the journals it names, whichever servers wrote them.
    let ns = kochab_server::recovery::check_namespace_offline(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let what = if cluster_up::is_cluster_dir(dir) {
        "cluster"
    } else {
        "server"
    };
    print_namespace(&ns, what)
}

/// `kochab fsck --store s3://BUCKET/PREFIX [--repair --accept-loss]`: offline, on the store of
/// a stopped server or cluster (nothing locks a store on S3: every server using it must be
/// stopped): every server's journals, every table's manifest.
fn fsck_store(args: &store::StoreArgs, repair: bool, accept_loss: bool) -> Result<(), String> {
    check_repair_flags(repair, accept_loss)?;
    let Some(store) = store::open(args)? else {
        return Err("--store is needed".into());
    };
    let url = args.store.clone().unwrap_or_default();
    let meta = kochab_server::datadir::read_meta(store.as_ref(), &url)
        .map_err(|e| format!("{url}: {e}"))?
        .ok_or_else(|| format!("{url} holds no Kochab cluster (no cluster.json)"))?;
    let o = kochab_server::recovery::Offline {
        store: store.as_ref(),
        meta: &meta,
        repair_command: format!("kochab fsck --store {url} --repair --accept-loss"),
    };
    let report = if repair {
        kochab_server::recovery::repair_store_accept_loss(&o)
    } else {
        kochab_server::recovery::check_store_offline(&o)
    }
    .map_err(|e| format!("{url}: {e}"))?;
    if !print_offline(&report, &url)? || repair {
        return Ok(());
    }
    let ns =
        kochab_server::recovery::check_store_namespace(&o).map_err(|e| format!("{url}: {e}"))?;
    // Every table is loaded from its manifest and the journals it names, whichever server
    // wrote them: one server's store and a cluster's are checked alike.
    let cluster =
        kochab_server::datadir::is_released(store.as_ref()).map_err(|e| format!("{url}: {e}"))?;
    print_namespace(&ns, if cluster { "cluster" } else { "server" })
}

/// Prints what the journal check found; `Ok(true)` if the store starts.
fn print_offline(
    report: &kochab_server::recovery::OfflineReport,
    name: &str,
) -> Result<bool, String> {
    for line in &report.lines {
        println!("{line}");
    }
    if report.refuses_to_start {
        return Err(format!("{name} does not start as it is"));
    }
    println!("kochab fsck: {name} starts");
    Ok(true)
}

/// Prints the namespace check; an error if it found problems.
fn print_namespace(
    ns: &kochab_server::recovery::NamespaceReport,
    what: &str,
) -> Result<(), String> {
    for p in &ns.problems {
        println!("{p}");
    }
    println!(
        "kochab fsck: {what} namespace of {} tables, {} inodes ({} journal records replayed): {}",
        ns.tables,
        ns.inodes,
        ns.replayed,
        if ns.problems.is_empty() {
            "clean".to_string()
        } else {
            format!("{} problems", ns.problems.len())
        }
    );
    if !ns.problems.is_empty() {
        return Err(format!("{} namespace problems", ns.problems.len()));
    }
    Ok(())
}

async fn fsck(conn: ConnArgs) -> Result<(), String> {
    let client = connect(&conn).await?;
    if let Ok(kochab_proto::Reply::Map(map)) = client
        .call(&kochab_proto::Credentials::root(), kochab_proto::Op::GetMap)
        .await
        && !map.servers.is_empty()
    {
        return admin::fsck(&conn, &map).await;
    }
    let problems = client.fsck().await.map_err(|e| e.to_string())?;
    if problems.is_empty() {
        println!("kochab fsck: clean");
        return Ok(());
    }
    for p in &problems {
        println!("{p}");
    }
    Err(format!("{} problems", problems.len()))
}

/// Keeps glibc from giving large buffers back to the kernel after each use: on this kind of
/// VM every first touch of a page is a fault to the hypervisor, and 1 MiB data buffers
/// re-faulted on every request cost more than the copy itself (measured: 1 MiB writes
/// through the client went from 5.5 ms to under 2 ms).
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    // Commands that only print end quietly when their reader goes away (`status | head`),
    // as other Unix tools do; the servers keep ignoring SIGPIPE (a client that hangs up
    // must not kill them).
    if matches!(
        cli.command,
        Command::Status { .. } | Command::CoordStatus(_) | Command::Fsck(_)
    ) {
        // SAFETY: restores the default disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Up(args) => {
            init_logging("info");
            runtime(args.threads).and_then(|rt| rt.block_on(up(args)))
        }
        Command::Bench(args) => {
            init_logging("warn");
            runtime(args.threads).and_then(|rt| rt.block_on(bench(args)))
        }
        Command::Coord(args) => {
            init_logging("info");
            runtime(None).and_then(|rt| rt.block_on(coord::run(args)))
        }
        Command::Mds(args) => {
            init_logging("info");
            runtime(args.threads).and_then(|rt| rt.block_on(mds::run(args)))
        }
        Command::CoordStatus(args) => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| rt.block_on(coord::status(args)))
        }
        Command::Status { conn, json } => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| rt.block_on(status(conn, json)))
        }
        Command::Mount(args) => {
            init_logging("warn");
            if args.foreground {
                runtime(None).and_then(|rt| rt.block_on(mount::foreground(args)))
            } else {
                mount::background(&args)
            }
        }
        Command::Fsck(args) => {
            init_logging("warn");
            match &args.data {
                _ if args.store.store.is_some() => {
                    if args.data.is_some() {
                        Err("--store and --data name two stores: give one".to_string())
                    } else {
                        fsck_store(&args.store, args.repair, args.accept_loss)
                    }
                }
                Some(dir) => fsck_offline(dir, args.repair, args.accept_loss),
                None if args.repair => {
                    Err("--repair needs --data DIR or --store s3://BUCKET/PREFIX".to_string())
                }
                None => runtime(Some(1)).and_then(|rt| rt.block_on(fsck(args.conn))),
            }
        }
        Command::Key { conn, cmd } => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| rt.block_on(key_command(conn, cmd)))
        }
        Command::Table { cmd } => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| rt.block_on(admin::table(cmd)))
        }
        Command::Server { cmd } => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| rt.block_on(admin::server(cmd)))
        }
        Command::Store { cmd } => {
            init_logging("warn");
            match cmd {
                store::StoreCommand::Bench(args) => store::bench(&args),
            }
        }
        Command::Fs { conn, cmd } => {
            init_logging("warn");
            runtime(Some(1)).and_then(|rt| {
                rt.block_on(async {
                    let client = connect(&conn).await?;
                    fsshell::run(&client, cmd).await
                })
            })
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kochab: {e}");
            ExitCode::FAILURE
        }
    }
}
