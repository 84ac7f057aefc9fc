//! The seeded simulation of the transaction protocol (`kochab_cluster::txn::sim`).
//! `TXN_SIM_SEEDS=n` runs n seeds (default 1000) from `TXN_SIM_FIRST` (default 0),
//! `TXN_SIM_SEED=s` replays one (`TXN_SIM_TRACE=1` prints its events),
//! `TXN_SIM_BREAK=commit-early|ack-early` runs a deliberately broken protocol,
//! `TXN_SIM_SITES` (4), `TXN_SIM_CLIENTS` (4) and `TXN_SIM_TOKENS` (6, the entries that
//! move: fewer means more conflicts) change the load, `TXN_SIM_FAULT_MS` (4000) how long
//! faults last and `TXN_SIM_CRASH_STEP_PERMILLE` (15) the chance of a crash after each
//! step.

use std::time::Instant;

use kochab_cluster::txn::Break;
use kochab_cluster::txn::sim::{SimConfig, run, run_seeds};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn broken() -> Option<Break> {
    match std::env::var("TXN_SIM_BREAK").ok().as_deref() {
        Some("commit-early") => Some(Break::CommitBeforeAllPrepared),
        Some("ack-early") => Some(Break::AckBeforeDurable),
        _ => None,
    }
}

fn adjust(cfg: &mut SimConfig) {
    cfg.txn.broken = broken();
    if let Some(n) = env_u64("TXN_SIM_SITES") {
        cfg.sites = n.max(2) as usize;
    }
    if let Some(n) = env_u64("TXN_SIM_CLIENTS") {
        cfg.clients = n as usize;
    }
    if let Some(n) = env_u64("TXN_SIM_TOKENS") {
        cfg.tokens = n.max(1) as usize;
    }
    if let Some(n) = env_u64("TXN_SIM_FAULT_MS") {
        cfg.fault_end_ms = n;
    }
    if let Some(n) = env_u64("TXN_SIM_CRASH_STEP_PERMILLE") {
        cfg.crash_step_permille = n;
    }
}

#[test]
fn seeds_pass() {
    if let Some(seed) = env_u64("TXN_SIM_SEED") {
        let mut cfg = SimConfig::new(seed);
        adjust(&mut cfg);
        cfg.trace = std::env::var("TXN_SIM_TRACE").is_ok();
        let stats = run(cfg).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("seed {seed}: {stats:?}");
        return;
    }
    let n = env_u64("TXN_SIM_SEEDS").unwrap_or(1000);
    let first = env_u64("TXN_SIM_FIRST").unwrap_or(0);
    let start = Instant::now();
    let stats = run_seeds(first, n, adjust).unwrap_or_else(|e| panic!("{e}"));
    let secs = start.elapsed().as_secs_f64();
    let sum =
        |f: fn(&kochab_cluster::txn::sim::SimStats) -> u64| -> u64 { stats.iter().map(f).sum() };
    let mut points = std::collections::BTreeMap::new();
    for s in &stats {
        for (k, v) in &s.crash_points {
            *points.entry(*k).or_insert(0u64) += v;
        }
    }
    eprintln!(
        "{n} seeds passed in {secs:.2} s ({:.0} seeds/s): {} events, {} committed, {} refused, \
         {} busy answers, {} attempts died, {} inquiries, {} reads back ({} waited for a lock), {} crashes ({} failovers); crash \
         points {points:?}",
        n as f64 / secs,
        sum(|s| s.events),
        sum(|s| s.committed),
        sum(|s| s.refused),
        sum(|s| s.busy),
        sum(|s| s.died),
        sum(|s| s.inquiries),
        sum(|s| s.reads),
        sum(|s| s.reads_waited),
        sum(|s| s.crashes),
        sum(|s| s.failovers),
    );
}

/// Wait-die alone keeps conflicting transactions from deadlocking: with no faults, heavy
/// contention, and every timeout far beyond the run (so none can break a deadlock), every
/// run settles.
#[test]
fn no_deadlock_without_timeouts() {
    let hour_ms = 3_600_000;
    run_seeds(0, 200, |cfg| {
        cfg.fault_end_ms = 0;
        cfg.clients = 8;
        cfg.tokens = 3;
        cfg.txn.wait_max_ms = hour_ms;
        cfg.txn.prepare_timeout_ms = hour_ms;
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

/// What the simulation's safety checks report, as opposed to a run that merely does not
/// settle (which a broken protocol may also cause without the checks seeing the breakage).
const SAFETY_VIOLATIONS: [&str; 9] = [
    "voted no",
    "unlocked",
    "discard",
    "forgotten",
    "before its commit is durable",
    "twice",
    "committed but not applied",
    "directories",
    "answered",
];

/// Each deliberate break is caught by a safety check within 100 seeds.
#[test]
fn breaks_are_caught() {
    for (name, b) in [
        ("commit-early", Break::CommitBeforeAllPrepared),
        ("ack-early", Break::AckBeforeDurable),
    ] {
        let e = run_seeds(0, 100, |cfg| cfg.txn.broken = Some(b))
            .err()
            .unwrap_or_else(|| panic!("{name}: 100 seeds passed"));
        assert!(
            SAFETY_VIOLATIONS.iter().any(|v| e.contains(v)) && !e.contains("not settled"),
            "{name}: caught, but not as a safety violation: {e}"
        );
        eprintln!("{name} caught: {e}");
    }
}
