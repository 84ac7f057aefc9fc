//! A bounded create/stat/rename load that checks its own results: each client repeats
//! create `f<i>`, stat `f<i>`, rename `f<i>` -> `r<i>` (in its own directory) for a given
//! time, counts every error a client sees, keeps operations per second, and afterwards
//! lists each directory to check that every acknowledged create and rename is there
//! exactly once. Made to run while tables migrate (`bench/migration.sh`).

use crate::{BenchConfig, prepare_dirs};
use kochab_client::Client;
use kochab_client::proto::{Credentials, FsResult, InodeId, fs_err};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Longest run, in seconds (bounds the per-second counters).
pub const CHURN_SECONDS_MAX: f64 = 3_600.0;

/// What a churn run found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChurnReport {
    /// Wall-clock start (ms since the Unix epoch), to line the seconds up with events.
    pub started_unix_ms: u64,
    pub seconds: f64,
    /// Operations completed (successful or not).
    pub ops: u64,
    pub ops_per_sec: f64,
    /// Operations completed in each second since the start (the last may be partial).
    pub per_second: Vec<u64>,
    /// Lowest and median of the full seconds, and their ratio.
    pub min_window: u64,
    pub median_window: f64,
    pub dip: f64,
    /// Operations that failed as a client sees it (any error).
    pub errors: u64,
    pub first_error: Option<String>,
    pub creates_acked: u64,
    pub renames_acked: u64,
    /// Acknowledged results missing afterwards.
    pub lost: u64,
    /// Names present more than once, or an item present under both names, or names the
    /// load never made.
    pub doubled: u64,
    /// Items whose failed operation may or may not have taken effect (not counted lost).
    pub ambiguous: u64,
}

/// How far one item got, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    CreateFailed,
    Renamed,
    RenameFailed,
}

struct Shared {
    started: Instant,
    per_second: Vec<AtomicU64>,
    errors: AtomicU64,
    first_error: crate::first::FirstError,
}

impl Shared {
    fn done(&self, r: &FsResult<()>, what: &str, c: usize, i: u64) {
        let sec = self.started.elapsed().as_secs() as usize;
        if let Some(n) = self.per_second.get(sec) {
            n.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(e) = r {
            self.errors.fetch_add(1, Ordering::Relaxed);
            self.first_error.set(format!("{what} c{c} item {i}: {e}"));
        }
    }
}

/// Runs the churn load for `seconds` (at most `cfg.items` items over all clients), then
/// checks the directories.
pub async fn run(client: &Client, cfg: &BenchConfig, seconds: f64) -> FsResult<ChurnReport> {
    if cfg.clients == 0 || cfg.items == 0 {
        return Err(fs_err!(EINVAL, "need at least one client and one item"));
    }
    if cfg.shared_dir {
        return Err(fs_err!(EINVAL, "churn uses a directory per client"));
    }
    if !(seconds > 0.0 && seconds <= CHURN_SECONDS_MAX) {
        return Err(fs_err!(
            EINVAL,
            "churn runs between 0 and {CHURN_SECONDS_MAX} seconds"
        ));
    }
    let dirs = prepare_dirs(client, cfg, true).await?;
    let slots = seconds.ceil() as usize + 120;
    let shared = Arc::new(Shared {
        started: Instant::now(),
        per_second: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        errors: AtomicU64::new(0),
        first_error: Default::default(),
    });
    let started_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let stop_at = shared.started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::with_capacity(cfg.clients);
    for (c, &dir) in dirs.iter().enumerate() {
        let client = client.clone();
        let shared = shared.clone();
        let n = crate::share(cfg.items, cfg.clients, c);
        tasks.push(tokio::spawn(async move {
            let cred = Credentials::root();
            let mut out = Vec::new();
            for i in 0..n {
                if Instant::now() >= stop_at {
                    break;
                }
                let f = format!("f{i}").into_bytes();
                let r = client.create(&cred, dir, &f, 0o644).await.map(|_| ());
                shared.done(&r, "create", c, i);
                if r.is_err() {
                    out.push(Outcome::CreateFailed);
                    continue;
                }
                let r = client.lookup(&cred, dir, &f).await.map(|_| ());
                shared.done(&r, "stat", c, i);
                let to = format!("r{i}").into_bytes();
                let r = client.rename(&cred, dir, &f, dir, &to, 0).await;
                shared.done(&r, "rename", c, i);
                out.push(if r.is_ok() {
                    Outcome::Renamed
                } else {
                    Outcome::RenameFailed
                });
            }
            out
        }));
    }
    let mut outcomes = Vec::with_capacity(cfg.clients);
    for t in tasks {
        outcomes.push(t.await.unwrap_or_default());
    }
    let secs = shared.started.elapsed().as_secs_f64();
    let per_second: Vec<u64> = shared
        .per_second
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .take(secs.ceil() as usize)
        .collect();
    let ops: u64 = per_second.iter().sum();
    let mut full: Vec<u64> = per_second
        .iter()
        .copied()
        .take(secs.floor() as usize)
        .collect();
    full.sort_unstable();
    let min_window = full.first().copied().unwrap_or(0);
    let median_window = median(&full);
    let mut report = ChurnReport {
        started_unix_ms,
        seconds: secs,
        ops,
        ops_per_sec: ops as f64 / secs.max(1e-9),
        per_second,
        min_window,
        median_window,
        dip: if median_window > 0.0 {
            min_window as f64 / median_window
        } else {
            0.0
        },
        errors: shared.errors.load(Ordering::Relaxed),
        first_error: shared.first_error.get(),
        ..Default::default()
    };
    for (c, out) in outcomes.iter().enumerate() {
        verify(client, dirs[c], out, &mut report).await?;
    }
    Ok(report)
}

fn median(sorted: &[u64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2] as f64,
        n => (sorted[n / 2 - 1] + sorted[n / 2]) as f64 / 2.0,
    }
}

/// Checks one client's directory against what it was told.
async fn verify(
    client: &Client,
    dir: InodeId,
    out: &[Outcome],
    report: &mut ChurnReport,
) -> FsResult<()> {
    let mut names: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
    for e in client.readdir_all(&Credentials::root(), dir, false).await? {
        if e.name != b"." && e.name != b".." {
            *names.entry(e.name).or_default() += 1;
        }
    }
    report.doubled += names
        .values()
        .filter(|n| **n > 1)
        .map(|n| n - 1)
        .sum::<u64>();
    for (i, o) in out.iter().enumerate() {
        let f = names.remove(format!("f{i}").as_bytes()).is_some();
        let r = names.remove(format!("r{i}").as_bytes()).is_some();
        if *o != Outcome::CreateFailed {
            report.creates_acked += 1;
        }
        match o {
            Outcome::Renamed => {
                report.renames_acked += 1;
                report.lost += u64::from(!r);
                report.doubled += u64::from(f);
            }
            Outcome::RenameFailed => {
                report.ambiguous += 1;
                report.lost += u64::from(!f && !r);
                report.doubled += u64::from(f && r);
            }
            Outcome::CreateFailed => {
                report.ambiguous += 1;
                report.doubled += u64::from(r);
            }
        }
    }
    // Names left over were never made by this load (a create applied twice under a new
    // name cannot happen; anything else here is a bug or a stale earlier run).
    report.doubled += names.len() as u64;
    Ok(())
}
