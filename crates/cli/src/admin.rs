//! Operator commands of a cluster of servers, through the coordinator group:
//! `kochab table move`, `kochab server drain`, `kochab server add`, and the coordinator's
//! part of `kochab status` (per-table load, migrations, borrows, draining servers).
//!
//! Every command proposes a [`CoordCommand`] and then, unless `--no-wait`, watches the
//! replicated state until the placement it asked for is reached. Drain and add also drive
//! the balancer's pure `next_move` themselves while they wait, so they finish on a
//! coordinator started with `--no-balance` too (a move the leader's balancer proposed at
//! the same time is refused as "already moving", which is harmless).

use crate::ConnArgs;
use clap::{Args, Subcommand};
use kochab_client::{Client, ClientConfig};
use kochab_cluster::balance::next_move;
use kochab_cluster::state::{CoordState, Phase};
use kochab_coord::CoordClient;
use kochab_proto::cluster::{CoordCommand, CoordReply, DelegationMap, ServerId, TableId};
use kochab_proto::{StatusReport, auth::ADMIN_KEY_ID};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How an operator command reaches the coordinator group.
#[derive(Args, Clone)]
pub struct AdminArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Coordinator replicas' addresses, comma separated (default: the replicas the servers
    /// named by --cluster follow). Needs the cluster key.
    #[arg(long, value_delimiter = ',')]
    coord: Vec<String>,
    /// Return once the coordinator accepted the command, without waiting for the tables
    /// to move.
    #[arg(long)]
    no_wait: bool,
    /// Most seconds to wait for the tables to move.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(Subcommand)]
pub enum TableCommand {
    /// Move a table to a server, online (its owner drains the table's operations in
    /// flight, checkpoints it, and the target loads it; clients follow). TABLE is the
    /// table's first inode id in hex, as `kochab status` shows it, or any id in it.
    Move {
        table: String,
        /// The server to move it to.
        #[arg(long)]
        to: u32,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Split a table in two, online: its owner lets the table's operations in flight
    /// finish, cuts it at a subtree boundary (half of its inodes below, unless --at says
    /// where) and checkpoints both halves; the new table starts on the same server and
    /// can then move on its own. Only subtree (primary-region) tables split.
    Split {
        table: String,
        /// Where the new table starts (hex inode id; a multiple of 64 inside the table).
        #[arg(long)]
        at: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Subcommand)]
pub enum ServerCommand {
    /// Move every table off a server, one at a time, and keep it empty: placement,
    /// recovery and balancing skip it (unless no other server is left).
    Drain {
        id: u32,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Bring a drained server back into service: the balancer hands it tables until the
    /// table counts are even. (A new server joins by starting `kochab mds --id ID`; it
    /// registers itself and needs no `add`.)
    Add {
        id: u32,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// Coordinator addresses given or learned from the servers, and a client for them.
async fn coord_client(admin: &AdminArgs) -> Result<CoordClient<CoordState>, String> {
    let key = admin.conn.key.load()?;
    if key.id != ADMIN_KEY_ID {
        return Err(format!(
            "a client key (id {}); operator commands need the cluster key",
            key.id
        ));
    }
    let names = if admin.coord.is_empty() {
        let client = crate::connect(&admin.conn).await?;
        let s = client
            .status()
            .await
            .map_err(|e| format!("status of {}: {e}", admin.conn.cluster))?;
        if s.coordinators.is_empty() {
            return Err(format!(
                "{} is a single server, not a cluster of servers",
                admin.conn.cluster
            ));
        }
        s.coordinators
    } else {
        admin.coord.clone()
    };
    let mut addrs = Vec::new();
    for n in &names {
        addrs.extend(kochab_client::resolve_addrs(n).map_err(|e| format!("{n}: {e}"))?);
    }
    let mut cfg = kochab_coord::ClientConfig::new(addrs, key.key);
    cfg.tls = admin.conn.tls.load()?;
    Ok(CoordClient::new(cfg))
}

async fn read(coord: &CoordClient<CoordState>) -> Result<CoordState, String> {
    coord
        .read_state()
        .await
        .map(|(s, _)| s)
        .map_err(|e| format!("reading the coordinator's state: {e}"))
}

/// Proposes `cmd`; `Ok` and `Stale` (nothing to change) are success.
async fn propose(coord: &CoordClient<CoordState>, cmd: CoordCommand) -> Result<String, String> {
    match coord.propose(cmd).await {
        Ok(CoordReply::Ok) => Ok("done".into()),
        Ok(CoordReply::Stale(why)) => Ok(why),
        Ok(CoordReply::Refused(why)) => Err(why),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(format!("the coordinator did not answer: {e}")),
    }
}

/// A table id as status prints it (hex, with or without 0x) or any inode id in it.
fn parse_table(s: &str, map: &DelegationMap) -> Result<TableId, String> {
    let hex = s.trim().trim_start_matches("0x");
    let id = u64::from_str_radix(hex, 16).map_err(|_| format!("{s:?} is not a hex table id"))?;
    map.table_of(id)
        .map(|(t, _)| t)
        .ok_or_else(|| format!("no placed table holds {id:#x}"))
}

fn deadline(admin: &AdminArgs) -> Result<Instant, String> {
    if !admin.timeout.is_finite() || admin.timeout < 0.0 {
        return Err("--timeout must be a number of seconds".into());
    }
    Ok(Instant::now() + Duration::from_secs_f64(admin.timeout.min(86_400.0)))
}

/// Polls the state until `done` says so, proposing the balancer's next move when
/// `drive`; prints each table that changes owner.
async fn wait_until(
    coord: &CoordClient<CoordState>,
    until: Instant,
    drive: bool,
    what: &str,
    done: impl Fn(&CoordState) -> bool,
) -> Result<CoordState, String> {
    let mut last: Option<CoordState> = None;
    loop {
        // A leader change makes a read fail for a moment; only the deadline ends waiting.
        let s = match read(coord).await {
            Ok(s) => s,
            Err(e) if Instant::now() < until => {
                tracing::debug!("{e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some(prev) = &last {
            for (t, p) in &s.map.tables {
                if let Some(was) = prev.map.owner(*t)
                    && was != p.owner
                {
                    println!("table {:016x}: server {} -> {}", t.0, was.0, p.owner.0);
                }
            }
        }
        if done(&s) {
            return Ok(s);
        }
        if Instant::now() >= until {
            return Err(format!("{what}: not done before --timeout"));
        }
        if drive && let Some(m) = next_move(&s) {
            // Refused when the leader's own balancer proposed the same move first.
            if let Err(why) = propose(coord, m).await {
                tracing::debug!("balancing move: {why}");
            }
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn owns(s: &CoordState, server: ServerId) -> usize {
    s.map.tables.values().filter(|p| p.owner == server).count()
}

fn quiet(s: &CoordState) -> bool {
    s.migrations.is_empty() && s.borrows.is_empty() && s.unplaced.is_empty() && s.splits.is_empty()
}

pub async fn table(cmd: TableCommand) -> Result<(), String> {
    let (table, to, admin) = match cmd {
        TableCommand::Move { table, to, admin } => (table, to, admin),
        TableCommand::Split { table, at, admin } => return split(table, at, admin).await,
    };
    let coord = coord_client(&admin).await?;
    let state = read(&coord).await?;
    let t = parse_table(&table, &state.map)?;
    let to = ServerId(to);
    let until = deadline(&admin)?;
    let from = state.map.owner(t);
    let answer = propose(&coord, CoordCommand::Move { table: t, to }).await?;
    if from == Some(to) {
        println!("table {:016x} is on server {} already", t.0, to.0);
        return Ok(());
    }
    if admin.no_wait {
        println!("table {:016x}: moving to server {} ({answer})", t.0, to.0);
        return Ok(());
    }
    let started = Instant::now();
    // Done when no migration of the table toward `to` is left. A move that unbalanced
    // the table counts may be followed at once by a balancing move of this very table
    // (the leader's balancer), so "the owner is `to`" alone could be missed between polls.
    let s = wait_until(&coord, until, false, "move", |s| {
        s.migrations.get(&t).is_none_or(|m| m.to != to)
    })
    .await?;
    let moving_on = s
        .migrations
        .get(&t)
        .filter(|m| m.from.map(|f| f.server) == Some(to));
    match s.map.owner(t) {
        Some(o) if o == to || moving_on.is_some() => {
            println!(
                "table {:016x}: moved to server {} in {:.2} s",
                t.0,
                to.0,
                started.elapsed().as_secs_f64()
            );
            if let Some(m) = moving_on {
                println!(
                    "table {:016x}: the balancer moves it on to server {} (the table counts \
                     were uneven; a coordinator run with --no-balance keeps hand placements)",
                    t.0, m.to.0
                );
            }
            Ok(())
        }
        // The target died during the move and another server took the table.
        other => Err(format!(
            "table {:016x} ended on server {:?}, not {}",
            t.0,
            other.map(|o| o.0),
            to.0
        )),
    }
}

async fn split(table: String, at: Option<String>, admin: AdminArgs) -> Result<(), String> {
    let coord = coord_client(&admin).await?;
    let state = read(&coord).await?;
    let t = parse_table(&table, &state.map)?;
    let at = match at {
        Some(a) => Some(
            u64::from_str_radix(a.trim_start_matches("0x"), 16)
                .map_err(|_| format!("--at {a:?} is not a hex inode id"))?,
        ),
        None => None,
    };
    let until = deadline(&admin)?;
    let before = state.map.tables.len();
    let answer = propose(&coord, CoordCommand::Split { table: t, at }).await?;
    if admin.no_wait {
        println!("table {:016x}: splitting ({answer})", t.0);
        return Ok(());
    }
    let started = Instant::now();
    let s = wait_until(&coord, until, false, "split", |s| {
        !s.splits.contains_key(&t)
    })
    .await?;
    let hi = s.map.tables.get(&t).map(|p| p.hi);
    match hi.and_then(|hi| s.map.tables.get(&TableId(hi)).map(|p| (hi, p.owner))) {
        Some((hi, owner)) if s.map.tables.len() > before => {
            println!(
                "table {:016x}: split at {hi:016x} in {:.2} s (both halves on server {})",
                t.0,
                started.elapsed().as_secs_f64(),
                owner.0
            );
            Ok(())
        }
        _ => Err(format!(
            "table {:016x} was not split (its owner refused: see its log; subtree tables \
             with inodes in more than one directory split)",
            t.0
        )),
    }
}

pub async fn server(cmd: ServerCommand) -> Result<(), String> {
    let (id, admin, drain) = match cmd {
        ServerCommand::Drain { id, admin } => (ServerId(id), admin, true),
        ServerCommand::Add { id, admin } => (ServerId(id), admin, false),
    };
    let coord = coord_client(&admin).await?;
    let until = deadline(&admin)?;
    let answer = propose(&coord, CoordCommand::Drain { server: id, drain }).await?;
    let verb = if drain { "draining" } else { "in service" };
    println!("server {}: {verb} ({answer})", id.0);
    if admin.no_wait {
        return Ok(());
    }
    let started = Instant::now();
    let s = if drain {
        // Done once no table is here or on its way here or away (a table dropped here
        // is still migrating until its next owner has added it).
        wait_until(&coord, until, true, "drain", |s| {
            owns(s, id) == 0
                && !s
                    .migrations
                    .values()
                    .any(|m| m.to == id || m.from.is_some_and(|f| f.server == id))
        })
        .await?
    } else {
        wait_until(&coord, until, true, "add", |s| {
            quiet(s) && next_move(s).is_none()
        })
        .await?
    };
    println!(
        "server {}: {} tables after {:.2} s",
        id.0,
        owns(&s, id),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What one server says about itself, for status.
type ServerReport = (ServerId, String, Result<StatusReport, String>);

/// A client of the one server at `addr` (one connection): its status and fsck answer for
/// that server alone.
async fn server_client(
    addr: &str,
    key: kochab_proto::auth::ClientKey,
    tls: &Option<kochab_client::tls::TlsClient>,
) -> Result<Client, String> {
    let mut cfg = ClientConfig::named(addr, key).map_err(|e| e.to_string())?;
    cfg.connections = 1;
    cfg.tls = tls.clone();
    Client::connect(cfg).await.map_err(|e| e.to_string())
}

async fn server_reports(conn: &ConnArgs, map: &DelegationMap) -> Result<Vec<ServerReport>, String> {
    let key = conn.key.load()?;
    let tls = conn.tls.load()?;
    let mut out = Vec::new();
    for (id, addr) in &map.servers {
        let report = async {
            let c = server_client(addr, key, &tls).await?;
            c.status().await.map_err(|e| e.to_string())
        }
        .await;
        out.push((*id, addr.clone(), report));
    }
    Ok(out)
}

/// `kochab fsck` of a cluster: every server checks the tables it holds (inodes, entries,
/// link counts and parent chains as far as its own tables go), and the links between
/// tables of different servers are checked from every server's cross-server facts
/// (`crosscheck`); the answers are printed per server, then the cross-server problems.
pub async fn fsck(conn: &ConnArgs, map: &DelegationMap) -> Result<(), String> {
    let key = conn.key.load()?;
    let tls = conn.tls.load()?;
    let mut problems = 0;
    let mut unreachable = 0;
    let mut reached = Vec::new();
    for (id, addr) in &map.servers {
        let tables = map.tables.values().filter(|p| p.owner == *id).count();
        let answer = async {
            let c = server_client(addr, key, &tls).await?;
            let p = c.fsck().await.map_err(|e| e.to_string())?;
            Ok::<_, String>((c, p))
        }
        .await;
        match answer {
            Ok((c, p)) => {
                if p.is_empty() {
                    println!("kochab fsck: server {} ({tables} tables): clean", id.0);
                }
                for line in &p {
                    println!("server {}: {line}", id.0);
                }
                problems += p.len();
                reached.push((*id, c));
            }
            Err(e) if tables == 0 => {
                println!(
                    "kochab fsck: server {} (no tables): not reached ({e})",
                    id.0
                )
            }
            Err(e) => {
                println!(
                    "kochab fsck: server {} ({tables} tables): not reached: {e}",
                    id.0
                );
                unreachable += 1;
            }
        }
    }
    if unreachable == 0 {
        let servers: Vec<(ServerId, &Client)> = reached.iter().map(|(id, c)| (*id, c)).collect();
        let outcome = crate::crosscheck::check(&servers).await?;
        for line in &outcome.problems {
            println!("across servers: {line}");
        }
        if outcome.passed > 0 {
            println!(
                "kochab fsck: {} problems across servers were gone when looked at again \
                 after {} ms (the namespace changed while it was checked); not counted",
                outcome.passed,
                crate::crosscheck::RECHECK_PAUSE.as_millis()
            );
        }
        if outcome.problems.is_empty() {
            println!(
                "kochab fsck: links across servers ({} entries, {} inodes): clean",
                outcome.entries, outcome.inodes
            );
        }
        problems += outcome.problems.len();
    } else {
        println!(
            "kochab fsck: links across servers not checked (a server holding tables was not reached)"
        );
    }
    println!(
        "kochab fsck: {} tables on {} servers",
        map.tables.len(),
        map.servers.len()
    );
    match (problems, unreachable) {
        (0, 0) => Ok(()),
        (p, 0) => Err(format!("{p} problems")),
        (p, u) => Err(format!("{p} problems; {u} servers with tables not reached")),
    }
}

/// The coordinator's state, through the replicas the servers follow (None: no answer,
/// or the key is a client key, which the coordinator does not take).
async fn coord_state(conn: &ConnArgs, coordinators: &[String]) -> Result<CoordState, String> {
    let key = conn.key.load()?;
    if key.id != ADMIN_KEY_ID {
        return Err("the coordinator answers only the cluster key".into());
    }
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for n in coordinators {
        addrs.extend(kochab_client::resolve_addrs(n).map_err(|e| format!("{n}: {e}"))?);
    }
    let mut cfg = kochab_coord::ClientConfig::new(addrs, key.key);
    cfg.budget = Duration::from_secs(3);
    cfg.tls = conn.tls.load()?;
    read(&CoordClient::new(cfg)).await
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Dropping => "dropping",
        Phase::Adding => "adding",
    }
}

/// `kochab status` of a cluster: the servers' part (`cluster_up::status`) and the
/// coordinator's (per-table load, migrations, borrows, draining servers). The JSON form
/// is built here whole, with every field `cluster_up::status` prints and the
/// coordinator's under `coordinator` (one JSON document, so it cannot be appended).
pub async fn status(conn: &ConnArgs, map: DelegationMap, json: bool) -> Result<(), String> {
    let reports = server_reports(conn, &map).await?;
    let coordinators = coordinators_of(&reports);
    let state = coord_state(conn, &coordinators).await;
    // The entry server's copy of the map may be a few hundred ms behind the coordinator's
    // (a borrow moves tables in less): show the newer.
    let map = match &state {
        Ok(s) if s.map.version > map.version => s.map.clone(),
        _ => map,
    };
    if !json {
        crate::cluster_up::status(conn, map.clone(), false).await?;
        match &state {
            Ok(s) => print_coord_text(s, &table_sizes(&reports)),
            Err(e) => println!("coordinator: no state ({e})"),
        }
        return Ok(());
    }
    let replicas = replica_statuses(conn, &coordinators).await;
    let st = state.as_ref().ok();
    let draining = |id: ServerId| st.is_some_and(|s| s.draining.contains(&id));
    let sizes = table_sizes(&reports);
    let out = serde_json::json!({
        "map_version": map.version.0,
        "coordinators": coordinators,
        "coordinator_replicas": replicas,
        "servers": reports.iter().map(|(id, addr, r)| match r {
            Ok(s) => serde_json::json!({
                "id": id.0, "addr": addr, "pid": s.pid, "epoch": s.epoch,
                "tables": s.tables.iter().map(|t| format!("{:016x}", t.lo)).collect::<Vec<_>>(),
                "inodes": s.inodes, "rss_bytes": s.rss_bytes, "connections": s.connections,
                "store": s.store,
                "draining": draining(*id),
                "status": s,
            }),
            Err(e) => serde_json::json!({
                "id": id.0, "addr": addr, "draining": draining(*id), "error": e,
            }),
        }).collect::<Vec<_>>(),
        "tables": map.tables.iter().map(|(t, p)| {
            let load = st.and_then(|s| s.load.get(t));
            let size = sizes.get(t);
            serde_json::json!({
                "lo": format!("{:016x}", t.0), "hi": format!("{:016x}", p.hi),
                "owner": p.owner.0, "owner_epoch": p.epoch.0,
                "inodes": size.map(|s| s.0), "entries": size.map(|s| s.1),
                "load_ops": load.map(|l| l.ops),
            })
        }).collect::<Vec<_>>(),
        "coordinator": match &state {
            Ok(s) => coord_json(s),
            Err(e) => serde_json::json!({"error": e}),
        },
    });
    println!("{out:#}");
    Ok(())
}

/// Inodes and entries of each table, as the server serving it reports them.
fn table_sizes(reports: &[ServerReport]) -> BTreeMap<TableId, (u64, u64)> {
    reports
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok())
        .flat_map(|s| s.tables.iter())
        .map(|t| (TableId(t.lo), (t.inodes, t.dentries)))
        .collect()
}

/// Each coordinator replica's own view (role, term, leader, applied index); nothing with a
/// client key, which replicas do not answer.
async fn replica_statuses(conn: &ConnArgs, coordinators: &[String]) -> Vec<serde_json::Value> {
    let Ok(key) = conn.key.load() else {
        return Vec::new();
    };
    if key.id != ADMIN_KEY_ID {
        return Vec::new();
    }
    let socks: Vec<SocketAddr> = coordinators.iter().filter_map(|a| a.parse().ok()).collect();
    let mut cfg = kochab_coord::ClientConfig::new(socks.clone(), key.key);
    cfg.tls = conn.tls.load().ok().flatten();
    let client = CoordClient::<CoordState>::new(cfg);
    let mut out = Vec::new();
    for a in socks {
        out.push(match client.status_of(a).await {
            Ok(s) => serde_json::json!({
                "addr": a.to_string(), "id": s.id, "role": s.role, "term": s.term,
                "leader": s.leader, "last_applied": s.last_applied,
            }),
            Err(e) => serde_json::json!({"addr": a.to_string(), "error": e.to_string()}),
        });
    }
    out
}

fn coordinators_of(reports: &[ServerReport]) -> Vec<String> {
    reports
        .iter()
        .find_map(|(_, _, r)| r.as_ref().ok().map(|s| s.coordinators.clone()))
        .unwrap_or_default()
}

fn coord_json(s: &CoordState) -> serde_json::Value {
    serde_json::json!({
        "map_version": s.map.version.0,
        "draining": s.draining.iter().map(|d| d.0).collect::<Vec<_>>(),
        "unplaced": s.unplaced.keys().map(|t| format!("{:016x}", t.0)).collect::<Vec<_>>(),
        "migrations": s.migrations.iter().map(|(t, m)| serde_json::json!({
            "table": format!("{:016x}", t.0),
            "from": m.from.map(|f| f.server.0),
            "to": m.to.0,
            "phase": phase_name(m.phase),
            "started_map_version": m.started.0,
        })).collect::<Vec<_>>(),
        "borrows": s.borrows.iter().map(|(id, b)| serde_json::json!({
            "server": id.server.0, "epoch": id.epoch.0, "seq": id.seq,
            "tables": b.tables.iter().map(|t| format!("{:016x}", t.0)).collect::<Vec<_>>(),
            "phase": format!("{:?}", b.phase).to_lowercase(),
        })).collect::<Vec<_>>(),
        "splits": s.splits.iter().map(|(t, sp)| serde_json::json!({
            "table": format!("{:016x}", t.0),
            "at": sp.at.map(|a| format!("{a:016x}")),
            "server": sp.by.server.0,
        })).collect::<Vec<_>>(),
        "load": s.load.values().map(|l| serde_json::json!({
            "table": format!("{:016x}", l.table.0), "ops": l.ops, "inodes": l.inodes,
        })).collect::<Vec<_>>(),
    })
}

fn print_coord_text(s: &CoordState, sizes: &BTreeMap<TableId, (u64, u64)>) {
    let draining: Vec<String> = s.draining.iter().map(|d| d.0.to_string()).collect();
    println!(
        "draining servers: {}",
        if draining.is_empty() {
            "none".to_string()
        } else {
            draining.join(", ")
        }
    );
    // Load ops: as the owner last reported them to the coordinator ("-": no report).
    println!(
        "{:<18} {:>6} {:>10} {:>10} {:>10}",
        "table lo", "owner", "inodes", "entries", "load ops"
    );
    let dash = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    for (t, p) in &s.map.tables {
        let size = sizes.get(t);
        println!(
            "{:016x}   {:>6} {:>10} {:>10} {:>10}",
            t.0,
            p.owner.0,
            dash(size.map(|s| s.0)),
            dash(size.map(|s| s.1)),
            dash(s.load.get(t).map(|l| l.ops))
        );
    }
    println!("migrations in progress: {}", s.migrations.len());
    for (t, m) in &s.migrations {
        println!(
            "  table {:016x}: {} -> {} ({})",
            t.0,
            m.from
                .map_or("(none)".to_string(), |f| f.server.0.to_string()),
            m.to.0,
            phase_name(m.phase)
        );
    }
    println!("splits in progress: {}", s.splits.len());
    for (t, sp) in &s.splits {
        println!(
            "  table {:016x} on server {}{}",
            t.0,
            sp.by.server.0,
            sp.at.map_or(String::new(), |a| format!(" at {a:016x}"))
        );
    }
    println!("borrows in progress: {}", s.borrows.len());
    for (id, b) in &s.borrows {
        let tables: Vec<String> = b.tables.iter().map(|t| format!("{:016x}", t.0)).collect();
        println!(
            "  server {} epoch {} seq {}: {:?} [{}]",
            id.server.0,
            id.epoch.0,
            id.seq,
            b.phase,
            tables.join(", ")
        );
    }
    for t in s.unplaced.keys() {
        println!("  table {:016x}: unplaced (no live server)", t.0);
    }
}
