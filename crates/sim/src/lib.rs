//! A deterministic simulation of Kochab's real server core (DESIGN.md, "Simulation").
//!
//! It builds the metadata server's actual core — engine, reply cache, journal, checkpoints
//! and recovery from `kochab-server`, not a model of them — over an in-memory store that
//! crashes back to its last sync ([`kochab_store::MemStore`]), and drives it with seeded
//! clients that get early replies, keep them until durable and replay them after a crash,
//! as the mount does. Faults: replies lost on the way (the request is sent again), kill -9
//! (what was written stays), power loss (only what was synced stays, unsynced blocks
//! dropped or torn), and a pause after which a successor seals the journal while the old
//! process still serves one more request. After every step: the namespace is a tree with
//! exact link counts, and every client's directories read exactly as its accepted replies
//! say (no acknowledged change lost, none applied twice); every replay tells the story its
//! early reply told. Data clients (`data`) create files, write them (early writes kept and
//! replayed through reopened handles), read them back and fsync them through the real data
//! path: every file reads exactly as the acknowledged writes say, but for bytes no fsync
//! covered at a power loss, which may read as they did at the last one.
//!
//! A lease holder (`lease`) caches a file a writer changes: callbacks, lease expiry and
//! callback deadlines run on the simulated clock the core reads
//! (`kochab_server::clock::SimulatedClock`), which moves between steps and jumps in pauses.
//!
//! The journal flushes only when the simulation asks, so a seed replays exactly.
//! `SIM_BREAK=NAME` switches on a deliberate bug in the real code (`kochab_breaks`).

mod cluster;
mod cluster_lease;
mod data;
mod exec;
mod lease;
pub mod model;
mod names;
mod step;
mod world;

pub use cluster::{ClusterConfig, ClusterStats, run_cluster, run_cluster_seeds};
pub use cluster_lease::LeaseCounts;
pub use step::SimStats;
pub use world::{SimConfig, describe, run};

/// Runs seeds `first..first + n` with `adjust` applied to each default config, spread over
/// the machine's cores (each seed is a world of its own); on failure, the error of the
/// lowest failing seed.
pub fn run_seeds(
    first: u64,
    n: u64,
    adjust: impl Fn(&mut SimConfig) + Sync,
) -> Result<Vec<SimStats>, String> {
    spread(first, n, |seed| {
        let mut cfg = SimConfig::new(seed);
        adjust(&mut cfg);
        run(cfg)
    })
}

/// Runs `one` for seeds `first..first + n` over the machine's cores: the results in seed
/// order, or the error of the lowest failing seed.
fn spread<T: Send>(
    first: u64,
    n: u64,
    one: impl Fn(u64) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()) as u64;
    let results: Vec<(u64, Result<T, String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let one = &one;
                s.spawn(move || {
                    (first + t..first + n)
                        .step_by(threads as usize)
                        .map(|seed| (seed, one(seed)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut results = results;
    results.sort_by_key(|r| r.0);
    if results.len() as u64 != n {
        return Err("a simulation thread panicked".into());
    }
    results.into_iter().map(|(_, r)| r).collect()
}
