//! The seeded whole-cluster simulation. `SIM_SEEDS=n` runs n seeds (default 1000) from
//! `SIM_FIRST` (default 0), `SIM_SEED=s` replays one (`SIM_TRACE=1` prints its events),
//! `SIM_BREAK=fencing|drain|borrow-early` runs a deliberately broken protocol
//! (`participant::Break`), `SIM_DRIFT_PPM=n` sets the servers' clock-rate error (default
//! 20000), `SIM_MULTI_PERMILLE` the share of two-table operations (150), `SIM_CLIENTS` (3).

use kochab_cluster::participant::Break;
use kochab_cluster::sim::{SimConfig, run, run_seeds};

/// The environment's changes to the default config.
fn adjust(cfg: &mut SimConfig) {
    cfg.broken = broken();
    if let Some(d) = env_u64("SIM_DRIFT_PPM") {
        cfg.drift_ppm_max = d as i64;
    }
    if let Some(m) = env_u64("SIM_MULTI_PERMILLE") {
        cfg.multi_permille = m;
    }
    if let Some(c) = env_u64("SIM_CLIENTS") {
        cfg.clients = c as usize;
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn broken() -> Option<Break> {
    std::env::var("SIM_BREAK")
        .ok()
        .and_then(|b| Break::parse(&b))
}

#[test]
fn seeds_pass() {
    if let Some(seed) = env_u64("SIM_SEED") {
        let mut cfg = SimConfig::new(seed);
        adjust(&mut cfg);
        cfg.trace = std::env::var("SIM_TRACE").is_ok();
        let stats = run(cfg).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("seed {seed}: {stats:?}");
        return;
    }
    let n = env_u64("SIM_SEEDS").unwrap_or(1000);
    let first = env_u64("SIM_FIRST").unwrap_or(0);
    let stats = run_seeds(first, n, adjust).unwrap_or_else(|e| panic!("{e}"));
    let events: u64 = stats.iter().map(|s| s.events).sum();
    let borrows: u64 = stats.iter().map(|s| s.borrows).sum();
    let fences: u64 = stats.iter().map(|s| s.fences).sum();
    let errors: u64 = stats.iter().map(|s| s.client_errors).sum();
    eprintln!(
        "{n} seeds passed: {events} events, {borrows} borrows, {fences} fences, \
         {errors} retry budgets exhausted during fault storms"
    );
}

/// What the simulation's safety checks report (`World::check` and the store's
/// violations), as opposed to liveness failures ("not done after faults stopped", "gave up
/// on op"), which a broken protocol may also cause without the checks seeing the breakage.
const SAFETY_VIOLATIONS: [&str; 4] = [
    "served by servers",
    "may still write it",
    "times in table",
    "lost from table",
];

/// `e` reports a safety violation: a test that breaks a safety property must be caught by
/// the check for it, not by a run that merely stalls.
fn assert_safety_violation(e: &str, broken: &str) {
    assert!(
        SAFETY_VIOLATIONS.iter().any(|v| e.contains(v))
            && !e.contains("not done after faults stopped")
            && !e.contains("gave up on op"),
        "{broken}: caught, but not as a safety violation: {e}"
    );
    eprintln!("{broken}: caught: {e}");
}

/// Clocks that drift more than the lease margin allows must be caught: this is what the
/// margin is for.
#[test]
fn drift_beyond_the_margin_is_caught() {
    let e = run_seeds(0, 500, |c| c.drift_ppm_max = 400_000)
        .expect_err("40% clock drift went unnoticed");
    assert_safety_violation(&e, "40% clock drift");
}

/// The simulation must catch every deliberate protocol bug within 100 seeds, each by a
/// safety check.
#[test]
fn every_break_is_caught() {
    for b in Break::ALL {
        let e = run_seeds(0, 100, |c| c.broken = Some(b))
            .expect_err(&format!("SIM_BREAK={} went unnoticed", b.name()));
        assert_safety_violation(&e, b.name());
    }
}
