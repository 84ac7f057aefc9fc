//! An mdtest-like benchmark through the native client: C concurrent clients each create,
//! stat and remove their share of N files, in a directory of their own or all in one shared
//! directory. Names are deterministic, so phases can run in separate invocations (as
//! mdtest's -C, -T and -r do) and a stat run after a restart checks what a create run made.

pub mod churn;

use kochab_client::Client;
use kochab_client::proto::{Credentials, Errno, FsResult, InodeId, fs_err};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The three mdtest phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Create,
    Stat,
    Remove,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Create => "create",
            Phase::Stat => "stat",
            Phase::Remove => "remove",
        }
    }

    pub fn parse(s: &str) -> Option<Phase> {
        match s.trim() {
            "create" => Some(Phase::Create),
            "stat" => Some(Phase::Stat),
            "remove" => Some(Phase::Remove),
            _ => None,
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub clients: usize,
    pub items: u64,
    pub shared_dir: bool,
    /// Each client's directory is a directory of the root (`<base>.c<i>`) instead of
    /// `<base>/c<i>`: the id policy deals top-level directories across tables, so with
    /// several servers the clients start on different servers (Ursa Minor's Fig. 3 layout).
    pub top_level: bool,
    /// In the create phase, every `cross_every`-th file (0: none) is also renamed into the
    /// next client's directory: with directories on different servers, a multi-server
    /// operation (Ursa Minor's Fig. 4 workload). Later phases then miss those files.
    pub cross_every: u64,
    pub phases: Vec<Phase>,
    /// Directory (under the root) that holds the benchmark's tree.
    pub base: String,
    /// Show progress on stderr when it is a terminal.
    pub progress: bool,
}

/// Results of one phase.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseReport {
    pub ops: u64,
    pub seconds: f64,
    pub ops_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub errors: u64,
    /// Of `ops`, the renames into another client's directory, and their median latency.
    pub cross_ops: u64,
    pub cross_p50_us: f64,
    /// Median latency of the other operations.
    pub local_p50_us: f64,
}

/// Items of client `c` out of `total` over `clients`.
fn share(total: u64, clients: usize, c: usize) -> u64 {
    let base = total / clients as u64;
    base + u64::from((c as u64) < total % clients as u64)
}

fn file_name(shared: bool, client: usize, i: u64) -> Vec<u8> {
    if shared {
        format!("c{client}.f{i}").into_bytes()
    } else {
        format!("f{i}").into_bytes()
    }
}

async fn ensure_dir(
    client: &Client,
    cred: &Credentials,
    parent: InodeId,
    name: &[u8],
) -> FsResult<InodeId> {
    match client.mkdir(cred, parent, name, 0o755).await {
        Ok(a) => Ok(a.id),
        Err(e) if e.errno == Errno::EEXIST => Ok(client.lookup(cred, parent, name).await?.id),
        Err(e) => Err(e),
    }
}

/// The directory each client works in.
async fn prepare_dirs(client: &Client, cfg: &BenchConfig, create: bool) -> FsResult<Vec<InodeId>> {
    let cred = Credentials::root();
    let root = client.root();
    let get = |parent: InodeId, name: Vec<u8>| {
        let client = client.clone();
        let cred = cred.clone();
        async move {
            if create {
                ensure_dir(&client, &cred, parent, &name).await
            } else {
                Ok(client.lookup(&cred, parent, &name).await?.id)
            }
        }
    };
    if cfg.top_level && !cfg.shared_dir {
        let mut dirs = Vec::with_capacity(cfg.clients);
        for c in 0..cfg.clients {
            dirs.push(get(root, format!("{}.c{c}", cfg.base).into_bytes()).await?);
        }
        return Ok(dirs);
    }
    let base = get(root, cfg.base.as_bytes().to_vec()).await?;
    if cfg.shared_dir {
        let d = get(base, b"shared".to_vec()).await?;
        Ok(vec![d; cfg.clients])
    } else {
        let mut dirs = Vec::with_capacity(cfg.clients);
        for c in 0..cfg.clients {
            dirs.push(get(base, format!("c{c}").into_bytes()).await?);
        }
        Ok(dirs)
    }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)] as f64
}

async fn run_phase(
    client: &Client,
    cfg: &BenchConfig,
    dirs: &[InodeId],
    phase: Phase,
) -> PhaseReport {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let first_error: Arc<first::FirstError> = Arc::new(first::FirstError::default());
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(cfg.clients);
    for (c, &dir) in dirs.iter().enumerate() {
        let client = client.clone();
        let done = done.clone();
        let errors = errors.clone();
        let first_error = first_error.clone();
        let n = share(cfg.items, cfg.clients, c);
        let shared = cfg.shared_dir;
        let cross_every = if phase == Phase::Create {
            cfg.cross_every
        } else {
            0
        };
        let next_dir = dirs[(c + 1) % dirs.len()];
        tasks.push(tokio::spawn(async move {
            let cred = Credentials::root();
            let mut lat = Vec::with_capacity(n as usize);
            let mut cross = Vec::new();
            for i in 0..n {
                let name = file_name(shared, c, i);
                let t = Instant::now();
                let r = match phase {
                    Phase::Create => client.create(&cred, dir, &name, 0o644).await.map(|_| ()),
                    Phase::Stat => client.lookup(&cred, dir, &name).await.map(|_| ()),
                    Phase::Remove => client.unlink(&cred, dir, &name).await,
                };
                lat.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                let r = match r {
                    Ok(()) if cross_every > 0 && (i + 1) % cross_every == 0 => {
                        let to = format!("x{c}.{i}").into_bytes();
                        let t = Instant::now();
                        let r = client.rename(&cred, dir, &name, next_dir, &to, 0).await;
                        cross.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                        done.fetch_add(1, Ordering::Relaxed);
                        r
                    }
                    r => r,
                };
                if let Err(e) = r {
                    errors.fetch_add(1, Ordering::Relaxed);
                    first_error.set(format!(
                        "{} {:?}: {e}",
                        phase.name(),
                        String::from_utf8_lossy(&name)
                    ));
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            (lat, cross)
        }));
    }
    let progress = cfg.progress && std::io::stderr().is_terminal();
    let ticker = progress.then(|| {
        let done = done.clone();
        let total = cfg.items;
        let name = phase.name();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let d = done.load(Ordering::Relaxed);
                let secs = started.elapsed().as_secs_f64().max(1e-9);
                eprint!(
                    "\r{name}: {d}/{total} ({:.0}%) {:.0} ops/s   ",
                    100.0 * d as f64 / total.max(1) as f64,
                    d as f64 / secs
                );
                let _ = std::io::stderr().flush();
            }
        })
    });
    let mut local: Vec<u32> = Vec::with_capacity(cfg.items as usize);
    let mut cross: Vec<u32> = Vec::new();
    for t in tasks {
        if let Ok((l, x)) = t.await {
            local.extend(l);
            cross.extend(x);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if let Some(t) = ticker {
        t.abort();
        eprint!("\r{:60}\r", "");
    }
    if let Some(e) = first_error.get() {
        eprintln!(
            "kochab bench: {} errors in {}; first: {e}",
            errors.load(Ordering::Relaxed),
            phase.name()
        );
    }
    local.sort_unstable();
    cross.sort_unstable();
    let mut all: Vec<u32> = local.iter().chain(&cross).copied().collect();
    all.sort_unstable();
    let ops = all.len() as u64;
    PhaseReport {
        ops,
        seconds,
        ops_per_sec: ops as f64 / seconds.max(1e-9),
        p50_us: percentile(&all, 0.50),
        p99_us: percentile(&all, 0.99),
        errors: errors.load(Ordering::Relaxed),
        cross_ops: cross.len() as u64,
        cross_p50_us: percentile(&cross, 0.50),
        local_p50_us: percentile(&local, 0.50),
    }
}

/// Runs the configured phases in order; returns a report per phase.
pub async fn run(
    client: &Client,
    cfg: &BenchConfig,
) -> FsResult<BTreeMap<&'static str, PhaseReport>> {
    if cfg.clients == 0 || cfg.items == 0 {
        return Err(fs_err!(EINVAL, "need at least one client and one item"));
    }
    let creating = cfg.phases.contains(&Phase::Create);
    let dirs = prepare_dirs(client, cfg, creating).await?;
    let mut out = BTreeMap::new();
    for &phase in &cfg.phases {
        let r = run_phase(client, cfg, &dirs, phase).await;
        out.insert(phase.name(), r);
    }
    Ok(out)
}

/// A write-once message slot shared by tasks (the first error is the useful one).
mod first {
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct FirstError(Mutex<Option<String>>);

    impl FirstError {
        pub fn set(&self, s: String) {
            if let Ok(mut g) = self.0.lock()
                && g.is_none()
            {
                *g = Some(s);
            }
        }

        pub fn get(&self) -> Option<String> {
            self.0.lock().ok().and_then(|g| g.clone())
        }
    }
}
