//! The simulation of several real server cores with tables moving between them
//! (`kochab_sim::run_cluster`). `SIM_CLUSTER_SEEDS=n` runs n seeds (default 1000) from
//! `SIM_FIRST` (default 0); `SIM_SEED=s` replays one (`SIM_TRACE=1` prints its steps);
//! `SIM_BREAK=NAME` runs with a deliberate bug switched on in the real code and must fail.
//! Without `SIM_BREAK`, the breaks of tables that move are run here too and must be
//! caught within 100 seeds.
//!
//! The same world with multi-server operations as transactions (`--multi-server txn`):
//! `SIM_TXN_SEEDS=n` (default 1000) seeds from `SIM_FIRST`, or `SIM_MULTI=txn` with
//! `SIM_SEED`/`SIM_BREAK` for one seed or one break; the transaction breaks must be caught
//! within 100 seeds.

mod common;

use common::{breaks, env_u64};
use kochab_breaks::{Break, Breaks};
use kochab_server::txn_host::MultiServer;
use kochab_sim::{ClusterConfig, ClusterStats, run_cluster, run_cluster_seeds};

/// The breaks only tables moving between servers can show (the single-server
/// simulation, `tests/sim.rs`, catches every other one), and those of leases, which the
/// cluster's holder must catch across moves too.
const CLUSTER_BREAKS: [Break; 3] = [
    Break::ReleaseBeforeDurable,
    Break::LeaseExpiryEarly,
    Break::CallbackOtherSession,
];

/// The breaks of the transaction protocol, in the real host (`txn_host`).
const TXN_BREAKS: [Break; 2] = [
    Break::TxnCommitBeforeAllPrepared,
    Break::TxnAckBeforeDurable,
];

/// `SIM_MULTI`: how multi-server operations run (`borrow` unless it says otherwise).
fn multi() -> MultiServer {
    match std::env::var("SIM_MULTI") {
        Ok(m) => m.parse().unwrap_or_else(|e| panic!("SIM_MULTI: {e}")),
        Err(_) => MultiServer::Borrow,
    }
}

#[test]
fn cluster_seeds_pass() {
    let breaks = breaks();
    if let Some(seed) = env_u64("SIM_SEED") {
        let mut cfg = ClusterConfig::new(seed);
        cfg.breaks = breaks;
        cfg.trace = std::env::var("SIM_TRACE").is_ok();
        cfg.multi_server = multi();
        match run_cluster(cfg) {
            Ok(stats) => eprintln!("seed {seed}: {stats:?}"),
            Err(e) => panic!("{e}"),
        }
        return;
    }
    let n = env_u64("SIM_CLUSTER_SEEDS").unwrap_or(1000);
    let first = env_u64("SIM_FIRST").unwrap_or(0);
    let started = std::time::Instant::now();
    let multi = multi();
    let result = run_cluster_seeds(first, n, |c| {
        c.breaks = breaks;
        c.multi_server = multi;
    });
    if breaks != Breaks::NONE {
        let e = result.expect_err("a deliberate bug went unnoticed");
        eprintln!("caught: {e}");
        return;
    }
    let stats = result.unwrap_or_else(|e| panic!("{e}"));
    let sum = |f: fn(&ClusterStats) -> u64| stats.iter().map(f).sum::<u64>();
    eprintln!(
        "{n} cluster seeds passed in {:.1} s: {} operations, {} borrows, {} returns, {} \
         migrations, {} splits ({} refused), {} kill -9 and {} pauses ({} failed over to another server), \
         {} replays, {} checkpoints, {} replies lost; {} data operations, {} table moves with \
         open handles, {} handles reopened, {} data writes replayed, {} written at a paused process; \
         {} pauses of everything, {} tries of a \
         change that waited for a replay window; lease holder: {} leases cached, {} changes of its file, \
         {} callbacks answered, {} revocations by drops, {} leases outlived their server, \
         {} run out, {} changes acknowledged late, {} defaults",
        started.elapsed().as_secs_f64(),
        sum(|s| s.ops),
        sum(|s| s.borrows),
        sum(|s| s.returns),
        sum(|s| s.migrations),
        sum(|s| s.splits),
        sum(|s| s.splits_refused),
        sum(|s| s.kills),
        sum(|s| s.pauses),
        sum(|s| s.failovers),
        sum(|s| s.replays),
        sum(|s| s.checkpoints),
        sum(|s| s.dropped_replies),
        sum(|s| s.data_ops),
        sum(|s| s.open_moves),
        sum(|s| s.reopens),
        sum(|s| s.data_replays),
        sum(|s| s.writes_at_old),
        sum(|s| s.time_jumps),
        sum(|s| s.window_waits),
        sum(|s| s.leases.cached),
        sum(|s| s.leases.changes),
        sum(|s| s.leases.callbacks),
        sum(|s| s.leases.revocations),
        sum(|s| s.leases.orphaned),
        sum(|s| s.leases.leases_run_out),
        sum(|s| s.leases.late_acks),
        sum(|s| s.leases.defaults),
    );
}

/// Each break of moving tables is caught within 100 seeds.
#[test]
fn every_cluster_break_is_caught() {
    if std::env::var("SIM_BREAK").is_ok() || env_u64("SIM_SEED").is_some() {
        return;
    }
    for b in CLUSTER_BREAKS {
        let caught = (0..100).find_map(|seed| {
            let mut cfg = ClusterConfig::new(seed);
            cfg.breaks = Breaks::NONE.with(b);
            run_cluster(cfg).err().map(|e| (seed, e))
        });
        match caught {
            Some((seed, e)) => eprintln!("{}: caught at seed {seed}: {e}", b.name()),
            None => panic!("SIM_BREAK={} was not caught within 100 seeds", b.name()),
        }
    }
}

/// The world with multi-server operations as transactions: every seed passes, and the
/// transaction breaks are caught within 100 seeds.
#[test]
fn cluster_txn_seeds_pass_and_its_breaks_are_caught() {
    if std::env::var("SIM_BREAK").is_ok() || env_u64("SIM_SEED").is_some() {
        return;
    }
    let n = env_u64("SIM_TXN_SEEDS").unwrap_or(1000);
    let first = env_u64("SIM_FIRST").unwrap_or(0);
    let started = std::time::Instant::now();
    let stats = run_cluster_seeds(first, n, |c| c.multi_server = MultiServer::Txn)
        .unwrap_or_else(|e| panic!("{e}"));
    let sum = |f: fn(&ClusterStats) -> u64| stats.iter().map(f).sum::<u64>();
    eprintln!(
        "{n} cluster seeds with transactions passed in {:.1} s: {} operations, {} \
         transactions ({} committed), {} borrows, {} servers killed during one ({} kill -9 \
         and {} pauses in all, {} failed over), {} messages delivered, {} lost, {} \
         delivered twice, {} replays, {} replies lost",
        started.elapsed().as_secs_f64(),
        sum(|s| s.ops),
        sum(|s| s.txns),
        sum(|s| s.txn_commits),
        sum(|s| s.borrows),
        sum(|s| s.txn_kills),
        sum(|s| s.kills),
        sum(|s| s.pauses),
        sum(|s| s.failovers),
        sum(|s| s.txn_msgs),
        sum(|s| s.txn_msgs_lost),
        sum(|s| s.txn_msgs_repeated),
        sum(|s| s.replays),
        sum(|s| s.dropped_replies),
    );
    for b in TXN_BREAKS {
        let caught = (0..100).find_map(|seed| {
            let mut cfg = ClusterConfig::new(seed);
            cfg.breaks = Breaks::NONE.with(b);
            cfg.multi_server = MultiServer::Txn;
            run_cluster(cfg).err().map(|e| (seed, e))
        });
        match caught {
            Some((seed, e)) => eprintln!("{}: caught at seed {seed}: {e}", b.name()),
            None => panic!("SIM_BREAK={} was not caught within 100 seeds", b.name()),
        }
    }
}
