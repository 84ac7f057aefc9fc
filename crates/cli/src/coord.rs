//! `kochab coord`: one replica of the coordinator group (the Raft-replicated delegation
//! map, membership, leases and borrows); `kochab coord-status`: the group as its replicas
//! see it.

use clap::Args;
use kochab_cluster::driver::DriverConfig;
use kochab_cluster::state::CoordState;
use kochab_coord::coordinator::{ControlFuture, ServerLink, spawn_driver, wall_clock_ms};
use kochab_coord::{ClientConfig, CoordClient, Replica, ReplicaConfig, ReplicaId, Timing};
use kochab_proto::cluster::{Control, ControlReply, CoordCommand, CoordReply, TableId};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args)]
pub struct CoordArgs {
    /// This replica's id (nonzero, unique in the group).
    #[arg(long)]
    id: ReplicaId,
    /// Address it listens on for its peers and for clients.
    #[arg(long)]
    listen: SocketAddr,
    /// The group, this replica included: ID=HOST:PORT,ID=HOST:PORT,...
    #[arg(long, value_delimiter = ',', required = true)]
    peers: Vec<String>,
    /// Its Raft log, vote and snapshots live here.
    #[arg(long)]
    data: PathBuf,
    /// Start a new group from --peers when this replica's log is empty, and record the
    /// cluster's tables once it leads. Give it to one replica of a new group.
    #[arg(long)]
    bootstrap: bool,
    /// The cluster key (64 hex digits; a file only its owner may read).
    #[arg(long)]
    key_file: PathBuf,
    #[command(flatten)]
    tls: crate::ServeTlsArgs,
    /// Lease of a metadata server, in seconds: a server that does not renew it within this
    /// long is fenced and its tables are recovered elsewhere.
    #[arg(long, default_value_t = 10.0)]
    lease: f64,
    /// Leave placement to the operator: never move a table to even out the servers'
    /// table counts (moves are then only an operator's, and recoveries).
    #[arg(long)]
    no_balance: bool,
    /// Load balancing: with the table counts even, a server that did at least twice the
    /// operations of the least busy one, and this many more in a 5 s report, gives it a
    /// table (tests set it low).
    #[arg(long, default_value_t = kochab_cluster::balance::LOAD_GAP_MIN_OPS)]
    load_gap_ops: u64,
    /// Split a table once it holds this many inodes (0: never by size; a hot table whose
    /// move would not even out the load is split too, unless --no-balance).
    #[arg(long, default_value_t = kochab_cluster::balance::SPLIT_INODES)]
    split_inodes: u64,
}

#[derive(Args)]
pub struct CoordStatusArgs {
    /// Any replicas' addresses, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    coord: Vec<SocketAddr>,
    /// The cluster key file.
    #[arg(long)]
    key_file: PathBuf,
    #[command(flatten)]
    tls: crate::TlsArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// The cluster key from a key file, through the client's reader (which refuses a file
/// group or others may read): replicas trust only the cluster (admin) key, never a
/// client key.
pub(crate) fn key_file(path: &Path) -> Result<[u8; 32], String> {
    let k = kochab_client::read_key_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if k.id != kochab_proto::auth::ADMIN_KEY_ID {
        return Err(format!(
            "{}: a client key (id {}); the coordinator needs the cluster key",
            path.display(),
            k.id
        ));
    }
    Ok(k.key)
}

fn parse_peers(peers: &[String]) -> Result<BTreeMap<ReplicaId, SocketAddr>, String> {
    let mut out = BTreeMap::new();
    for p in peers {
        let (id, addr) = p
            .split_once('=')
            .ok_or_else(|| format!("--peers entry {p:?} is not ID=HOST:PORT"))?;
        let id: ReplicaId = id
            .parse()
            .map_err(|_| format!("--peers entry {p:?}: bad replica id"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| format!("--peers entry {p:?}: bad address"))?;
        if out.insert(id, addr).is_some() {
            return Err(format!("--peers names replica {id} twice"));
        }
    }
    Ok(out)
}

/// The tables of a new cluster: the id ranges every metadata server's engine is cut into.
fn initial_tables() -> Result<Vec<(TableId, u64)>, kochab_meta::ConfigError> {
    let config = kochab_meta::EngineConfig::with_key([0, 0]);
    let policy = kochab_meta::IdPolicy::new(config.id_policy.clone())?;
    let ranges = kochab_meta::initial_table_ranges(&policy, config.primary_tables)?;
    Ok(ranges
        .into_iter()
        .map(|(lo, hi)| (TableId(lo), hi))
        .collect())
}

pub async fn run(args: CoordArgs) -> Result<(), String> {
    let peers = parse_peers(&args.peers)?;
    if !args.lease.is_finite() || args.lease < 1.0 {
        return Err("--lease must be at least 1 second".into());
    }
    let key = key_file(&args.key_file)?;
    let tls = args.tls.load()?;
    let replica = Replica::<CoordState>::start(ReplicaConfig {
        id: args.id,
        listen: args.listen,
        peers,
        data_dir: args.data.clone(),
        key,
        bootstrap: args.bootstrap,
        timing: Timing::default(),
        tls: kochab_coord::ReplicaTls {
            accept: tls.as_ref().map(|(accept, _)| accept.clone()),
            dial: tls.as_ref().map(|(_, dial)| dial.clone()),
        },
    })
    .await
    .map_err(|e| format!("coordinator replica {}: {e}", args.id))?;
    println!(
        "kochab: coordinator replica {} ready at {}",
        args.id,
        replica.listen_addr()
    );
    let replica = std::sync::Arc::new(replica);
    let recorder = args.bootstrap.then(|| {
        let lease_ms = (args.lease * 1000.0) as u64;
        tokio::spawn(record_tables(replica.clone(), lease_ms))
    });
    // While this replica leads, the driver sends the ADDs, DROPs and grants the state calls
    // for to the metadata servers and proposes their answers.
    let driver = spawn_driver(
        replica.clone(),
        std::sync::Arc::new(ClientLink::new(key, tls.map(|(_, dial)| dial))),
        DriverConfig {
            balance: !args.no_balance,
            load_gap_ops: args.load_gap_ops,
            split_inodes: args.split_inodes,
            // A dead server's lease is noticed within a tick: 100 ms rather than the
            // default 250 keeps failover short (ten small log entries a second).
            tick_ms: DRIVER_TICK_MS,
            ..DriverConfig::default()
        },
        std::sync::Arc::new(wall_clock_ms),
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("signal handler: {e}"))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    driver.abort();
    let _ = driver.await;
    if let Some(r) = recorder {
        r.abort();
        let _ = r.await;
    }
    match std::sync::Arc::try_unwrap(replica) {
        Ok(r) => r.shutdown().await.map_err(|e| e.to_string()),
        Err(_) => Ok(()),
    }
}

/// How often the leader proposes a `Tick` (lease expiry is noticed within this).
const DRIVER_TICK_MS: u64 = 100;

/// Most time one control may take, connecting included; `None` after it (the driver
/// resends on its timer).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(4);

/// The coordinator's link to metadata servers: `Op::Control` over the metadata protocol
/// with the cluster key, one cached connection per address.
struct ClientLink {
    inner: std::sync::Arc<LinkInner>,
}

struct LinkInner {
    key: kochab_proto::auth::ClientKey,
    client_id: u64,
    /// TLS to the servers (their certificates must name the addresses they registered).
    tls: Option<kochab_client::tls::TlsClient>,
    conns: tokio::sync::Mutex<BTreeMap<String, std::sync::Arc<kochab_client::conn::Conn>>>,
}

impl ClientLink {
    fn new(key: [u8; 32], tls: Option<kochab_client::tls::TlsClient>) -> ClientLink {
        let mut b = [0u8; 8];
        // The id only names the link's session on each server; any value works.
        let _ = getrandom::fill(&mut b);
        ClientLink {
            inner: std::sync::Arc::new(LinkInner {
                key: key.into(),
                client_id: u64::from_le_bytes(b),
                tls,
                conns: Default::default(),
            }),
        }
    }
}

impl LinkInner {
    async fn conn(&self, addr: &str) -> Option<std::sync::Arc<kochab_client::conn::Conn>> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(addr)
            && c.is_alive()
        {
            return Some(c.clone());
        }
        conns.remove(addr);
        let sock = kochab_client::resolve_addr(addr).ok()?;
        let c = kochab_client::conn::Conn::connect_with(
            sock,
            &self.key,
            self.client_id,
            CONTROL_TIMEOUT,
            self.tls.as_ref().map(|t| (t, addr)),
            None,
            false,
        )
        .await
        .map_err(|e| tracing::info!("cannot reach server {addr}: {e:?}"))
        .ok()?;
        conns.insert(addr.to_string(), c.clone());
        Some(c)
    }

    async fn send(&self, addr: String, control: Control) -> Option<ControlReply> {
        let conn = self.conn(&addr).await?;
        let req = kochab_proto::Request {
            cred: kochab_proto::Credentials::root(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: kochab_proto::Op::Control { control },
        };
        match conn.call(&req).await {
            Ok(kochab_proto::Reply::Control(r)) => r,
            Ok(other) => {
                tracing::debug!("{addr} answered a control with {other:?}");
                None
            }
            Err(_) => {
                conn.mark_dead();
                None
            }
        }
    }
}

impl ServerLink for ClientLink {
    fn send(&self, addr: String, control: Control) -> ControlFuture {
        let inner = self.inner.clone();
        Box::pin(async move {
            tokio::time::timeout(CONTROL_TIMEOUT, inner.send(addr, control))
                .await
                .ok()
                .flatten()
        })
    }
}

/// Records the cluster's tables (the first command of a group) once this replica leads,
/// unless another replica already did: several replicas of a new group may be started with
/// --bootstrap, and whichever is elected first records them (a later Bootstrap is refused
/// by the state, so a restart with --bootstrap is harmless).
async fn record_tables(replica: std::sync::Arc<Replica<CoordState>>, lease_ms: u64) {
    let mut view = replica.subscribe();
    loop {
        let bootstrapped = match view
            .wait_for(|v| v.state.bootstrapped || (v.is_leader && v.last_applied.is_some()))
            .await
        {
            Ok(v) => v.state.bootstrapped,
            Err(_) => return,
        };
        if bootstrapped {
            return;
        }
        let tables = match initial_tables() {
            Ok(t) => t,
            Err(e) => {
                tracing::error!("coordinator: cannot compute the cluster's tables: {e}");
                return;
            }
        };
        match replica
            .propose(CoordCommand::Bootstrap { tables, lease_ms })
            .await
        {
            Ok(CoordReply::Ok) => {
                tracing::info!("coordinator: cluster tables recorded");
                return;
            }
            Ok(other) => {
                tracing::info!("coordinator: tables already recorded ({other:?})");
                return;
            }
            // Deposed or no quorum yet: wait for the next change of leader or state.
            Err(e) => {
                tracing::info!("coordinator: recording the cluster's tables: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

pub async fn status(args: CoordStatusArgs) -> Result<(), String> {
    let key = key_file(&args.key_file)?;
    let mut cfg = ClientConfig::new(args.coord.clone(), key);
    cfg.tls = args.tls.load()?;
    let client = CoordClient::<CoordState>::new(cfg);
    let replicas = client.statuses().await;
    let state = client.read_state().await.ok().map(|(s, _)| s);
    if args.json {
        let replicas: Vec<serde_json::Value> = replicas
            .iter()
            .map(|(addr, r)| match r {
                Ok(s) => serde_json::json!({"addr": addr.to_string(), "status": s}),
                Err(e) => serde_json::json!({"addr": addr.to_string(), "error": e.to_string()}),
            })
            .collect();
        let summary = state.as_ref().map(|s| {
            serde_json::json!({
                "bootstrapped": s.bootstrapped,
                "map_version": s.map.version.0,
                "tables": s.map.tables.len() + s.unplaced.len(),
                "placed": s.map.tables.len(),
                "servers": s.servers.iter().map(|(id, m)| serde_json::json!({
                    "id": id.0, "addr": m.addr, "epoch": m.epoch.0, "live": m.live,
                })).collect::<Vec<_>>(),
                "map": s.map.tables.iter().map(|(t, p)| serde_json::json!({
                    "table": format!("{:016x}", t.0), "owner": p.owner.0, "epoch": p.epoch.0,
                })).collect::<Vec<_>>(),
                "migrations": s.migrations.len(),
                "borrows": s.borrows.len(),
            })
        });
        let out = serde_json::json!({"replicas": replicas, "state": summary});
        println!("{out:#}");
        return Ok(());
    }
    for (addr, r) in &replicas {
        match r {
            Ok(s) => println!(
                "replica {} at {addr}: {} term {} leader {:?} applied {:?}",
                s.id, s.role, s.term, s.leader, s.last_applied
            ),
            Err(e) => println!("replica at {addr}: {e}"),
        }
    }
    match state {
        Some(s) => println!(
            "map version {}: {} tables ({} placed), {} servers, {} migrations, {} borrows",
            s.map.version.0,
            s.map.tables.len() + s.unplaced.len(),
            s.map.tables.len(),
            s.servers.len(),
            s.migrations.len(),
            s.borrows.len()
        ),
        None => println!("no leader answered: the group has no quorum"),
    }
    Ok(())
}
