//! The simulation of the real server core. `SIM_SEEDS=n` runs n seeds (default 1000) from
//! `SIM_FIRST` (default 0); `SIM_SEED=s` replays one (`SIM_TRACE=1` prints its steps);
//! `SIM_BREAK=NAME` runs with a deliberate bug switched on in the real code and must fail.
//! Without `SIM_BREAK`, every break is also run here and must be caught within 100 seeds.

mod common;

use common::{breaks, env_u64};
use kochab_breaks::{Break, Breaks};
use kochab_sim::{SimConfig, run, run_seeds};

#[test]
fn seeds_pass() {
    let breaks = breaks();
    if let Some(seed) = env_u64("SIM_SEED") {
        let mut cfg = SimConfig::new(seed);
        cfg.breaks = breaks;
        cfg.trace = std::env::var("SIM_TRACE").is_ok();
        match run(cfg) {
            Ok(stats) => eprintln!("seed {seed}: {stats:?}"),
            Err(e) => panic!("{e}"),
        }
        return;
    }
    let n = env_u64("SIM_SEEDS").unwrap_or(1000);
    let first = env_u64("SIM_FIRST").unwrap_or(0);
    let started = std::time::Instant::now();
    let result = run_seeds(first, n, |c| c.breaks = breaks);
    if breaks != Breaks::NONE {
        let e = result.expect_err("a deliberate bug went unnoticed");
        eprintln!("caught: {e}");
        return;
    }
    let stats = result.unwrap_or_else(|e| panic!("{e}"));
    let sum = |f: fn(&kochab_sim::SimStats) -> u64| stats.iter().map(f).sum::<u64>();
    eprintln!(
        "{n} seeds passed in {:.1} s: {} operations, {} replays, {} kill -9, {} power \
         losses, {} fences, {} checkpoints ({} old journals deleted), {} replies lost, {} data \
         operations, {} callbacks answered; {} pauses, {} leases run out, {} writes acknowledged \
         late, {} defaults",
        started.elapsed().as_secs_f64(),
        sum(|s| s.ops),
        sum(|s| s.replays),
        sum(|s| s.kills),
        sum(|s| s.power_losses),
        sum(|s| s.fences),
        sum(|s| s.checkpoints),
        sum(|s| s.journals_deleted),
        sum(|s| s.dropped_replies),
        sum(|s| s.data_ops),
        sum(|s| s.callbacks),
        sum(|s| s.pauses),
        sum(|s| s.leases_run_out),
        sum(|s| s.late_acks),
        sum(|s| s.defaults),
    );
}

/// Each deliberate bug is caught within 100 seeds, by a check of what it breaks.
#[test]
fn every_break_is_caught() {
    if std::env::var("SIM_BREAK").is_ok() || env_u64("SIM_SEED").is_some() {
        return;
    }
    // Tables moving between servers and transactions: the cluster simulation's
    // (`tests/cluster.rs`).
    let single = Break::ALL.into_iter().filter(|&b| !b.needs_servers());
    for b in single {
        let caught = (0..100).find_map(|seed| {
            let mut cfg = SimConfig::new(seed);
            cfg.breaks = Breaks::NONE.with(b);
            run(cfg).err()
        });
        match caught {
            Some(e) => eprintln!("{}: caught: {e}", b.name()),
            None => panic!("SIM_BREAK={} was not caught within 100 seeds", b.name()),
        }
    }
}
