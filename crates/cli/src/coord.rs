//! `kochab coord`: one replica of the coordinator group (the Raft-replicated delegation
//! map, membership, leases and borrows); `kochab coord-status`: the group as its replicas
//! see it.

use clap::Args;
use kochab_cluster::state::CoordState;
use kochab_coord::{ClientConfig, CoordClient, Replica, ReplicaConfig, ReplicaId, Timing};
use kochab_proto::cluster::{CoordCommand, CoordReply, TableId};
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
    /// Lease of a metadata server, in seconds: a server that does not renew it within this
    /// long is fenced and its tables are recovered elsewhere.
    #[arg(long, default_value_t = 10.0)]
    lease: f64,
}

#[derive(Args)]
pub struct CoordStatusArgs {
    /// Any replicas' addresses, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    coord: Vec<SocketAddr>,
    /// The cluster key file.
    #[arg(long)]
    key_file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// The cluster key from a key file, through the client's reader (which refuses a file
/// group or others may read): replicas trust only the cluster (admin) key, never a
/// client key.
fn key_file(path: &Path) -> Result<[u8; 32], String> {
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
fn initial_tables() -> Result<Vec<(TableId, u64)>, String> {
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
    let replica = Replica::<CoordState>::start(ReplicaConfig {
        id: args.id,
        listen: args.listen,
        peers,
        data_dir: args.data.clone(),
        key,
        bootstrap: args.bootstrap,
        timing: Timing::default(),
    })
    .await
    .map_err(|e| format!("coordinator replica {}: {e}", args.id))?;
    println!(
        "kochab: coordinator replica {} ready at {}",
        args.id,
        replica.listen_addr()
    );
    if args.bootstrap {
        let lease_ms = (args.lease * 1000.0) as u64;
        record_tables(&replica, lease_ms).await?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("signal handler: {e}"))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    replica.shutdown().await.map_err(|e| e.to_string())
}

/// Once this replica leads, records the cluster's tables (the first command of a group;
/// a later Bootstrap is refused by the state, so a restart with --bootstrap is harmless).
async fn record_tables(replica: &Replica<CoordState>, lease_ms: u64) -> Result<(), String> {
    let mut view = replica.subscribe();
    let led = tokio::time::timeout(
        Duration::from_secs(30),
        view.wait_for(|v| v.leader.is_some() && v.last_applied.is_some()),
    )
    .await;
    let Ok(Ok(v)) = led else {
        return Err("no coordinator leader within 30 s of start".into());
    };
    if !v.is_leader || v.state.bootstrapped {
        return Ok(());
    }
    drop(v);
    match replica
        .propose(CoordCommand::Bootstrap {
            tables: initial_tables()?,
            lease_ms,
        })
        .await
    {
        Ok(CoordReply::Ok) => {
            tracing::info!("coordinator: cluster tables recorded");
            Ok(())
        }
        Ok(other) => {
            tracing::info!("coordinator: tables already recorded ({other:?})");
            Ok(())
        }
        Err(e) => Err(format!("recording the cluster's tables: {e}")),
    }
}

pub async fn status(args: CoordStatusArgs) -> Result<(), String> {
    let key = key_file(&args.key_file)?;
    let client = CoordClient::<CoordState>::new(ClientConfig::new(args.coord.clone(), key));
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
