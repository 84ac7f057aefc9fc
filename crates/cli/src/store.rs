//! `--store s3://BUCKET/PREFIX`: the cluster's state in an S3 bucket instead of the local
//! directory. The store is opened and its engine self-tested before anything else.

use clap::Args;
use kochab_s3store::{S3Location, S3Settings, S3Store};
use kochab_store::ObjectStore;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Clone, Default)]
pub struct StoreArgs {
    /// Keep the cluster's state in an S3 bucket (Ceph RGW, AWS S3) instead of the local
    /// directory. Endpoint, region and keys come from AWS_ENDPOINT_URL, AWS_REGION,
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and AWS_ALLOW_HTTP, or
    /// from --store-env, never from the command line. A self-test at start refuses an
    /// engine that does not honour conditional create. File data goes there too, as
    /// immutable slice objects.
    #[arg(long, value_name = "s3://BUCKET/PREFIX")]
    pub store: Option<String>,
    /// With --store: a file of NAME=VALUE lines (the AWS_* variables above; `export `
    /// before a name is allowed), mode 0600, whose values override the environment's.
    #[arg(long, env = "KOCHAB_STORE_ENV", value_name = "FILE")]
    pub store_env: Option<PathBuf>,
}

/// Opens the store named by `url` and runs the engine self-test, printing what it found.
fn open_and_test(url: &str, env_file: Option<&std::path::Path>) -> Result<S3Store, String> {
    let location = S3Location::parse(url).map_err(|e| format!("--store {e}"))?;
    let settings = S3Settings::load(env_file).map_err(|e| format!("--store {location}: {e}"))?;
    let store = S3Store::open(&location, &settings).map_err(|e| e.to_string())?;
    let report = store
        .self_test()
        .map_err(|e| format!("refusing the store: {e}"))?;
    for line in &report.lines {
        eprintln!("kochab: store {}: self-test: {line}", store.name());
    }
    eprintln!(
        "kochab: store {}: the engine honours conditional create",
        store.name()
    );
    Ok(store)
}

/// The store `--store` names, opened and self-tested (`None` without `--store`).
pub fn open(args: &StoreArgs) -> Result<Option<Arc<dyn ObjectStore>>, String> {
    let Some(url) = &args.store else {
        return Ok(None);
    };
    let store = open_and_test(url, args.store_env.as_deref())?;
    Ok(Some(Arc::new(store)))
}

/// What `kochab status` says of a store on S3 that passed the self-test at start.
pub fn description(args: &StoreArgs) -> Option<String> {
    let url = args.store.as_ref()?;
    Some(format!(
        "{url}, engine self-test passed at start (conditional create honoured)"
    ))
}

/// [`open`] off the calling runtime's worker threads (the store's requests are waited for
/// synchronously).
pub async fn open_async(args: &StoreArgs) -> Result<Option<Arc<dyn ObjectStore>>, String> {
    if args.store.is_none() {
        return Ok(None);
    }
    let args = args.clone();
    tokio::task::spawn_blocking(move || open(&args))
        .await
        .map_err(|e| format!("the store's self-test failed: {e}"))?
}

/// `kochab store ...`: the object store by itself.
#[derive(clap::Subcommand)]
pub enum StoreCommand {
    /// Throughput of the object store from this one client, the baseline that file data
    /// through a mount is measured against: --parallel threads create --total bytes of
    /// fresh --size objects, then read them back whole, then delete them. Requests go
    /// through Kochab's own store client (the ObjectStore trait of the S3 store, on
    /// object_store/reqwest, from that many threads, each waiting for one request at a
    /// time); creates are conditional (If-None-Match: *), as slices of file data are.
    /// MB/s counts 10^6 bytes, as dd does.
    Bench(BenchArgs),
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Requests in flight (threads).
    #[arg(long, default_value_t = 16)]
    pub parallel: usize,
    /// Bytes per object (e.g. 1MiB, 4KiB, 65536).
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
    pub size: u64,
    /// Bytes written, then read (rounded up to whole objects).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub total: u64,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// Largest object the bench writes: the store sends each object in one PUT, and a slice
/// object is at most a chunk (4 MiB) plus its checksums; 64 MiB leaves room for probing
/// bigger ones without letting a typo allocate gigabytes per thread.
const BENCH_OBJECT_MAX: u64 = 64 << 20;
/// Most objects one run makes (and must delete after).
const BENCH_OBJECTS_MAX: u64 = 1 << 20;
/// Most threads: more would measure the machine's scheduler, not the store.
const BENCH_PARALLEL_MAX: usize = 1024;

/// `4096`, `4k`, `4KiB`, `1MiB`, `1GiB` (powers of 1024), `1MB` (powers of 1000).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 4096, 64KiB, 1MiB, 1GiB)"))?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// One phase's figures.
#[derive(serde::Serialize)]
struct PhaseReport {
    objects: u64,
    bytes: u64,
    seconds: f64,
    mb_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(serde::Serialize)]
struct BenchReport {
    store: String,
    client: &'static str,
    parallel: usize,
    object_bytes: u64,
    put: PhaseReport,
    get: PhaseReport,
    delete_seconds: f64,
}

/// What the report says the client was.
const BENCH_CLIENT: &str = "kochab store client (ObjectStore trait of the S3 store: \
     object_store over reqwest), one request in flight per thread";

/// Runs `op(i)` for i in 0..n from `parallel` threads; returns the wall time and each
/// call's latency (sorted). Stops at the first error.
fn run_phase(
    n: u64,
    parallel: usize,
    op: &(dyn Fn(u64) -> Result<(), String> + Sync),
) -> Result<(std::time::Duration, Vec<std::time::Duration>), String> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Instant;
    let next = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<Result<Vec<std::time::Duration>, String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                s.spawn(|| {
                    let mut lat = Vec::new();
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        let t = Instant::now();
                        if let Err(e) = op(i) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                        lat.push(t.elapsed());
                    }
                    Ok(lat)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("a bench thread panicked".into()))
            })
            .collect()
    });
    let wall = start.elapsed();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    all.sort_unstable();
    Ok((wall, all))
}

fn phase_report(
    objects: u64,
    bytes: u64,
    wall: std::time::Duration,
    lat: &[std::time::Duration],
) -> PhaseReport {
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    let seconds = wall.as_secs_f64();
    PhaseReport {
        objects,
        bytes,
        seconds,
        mb_per_s: if seconds > 0.0 {
            bytes as f64 / seconds / 1e6
        } else {
            0.0
        },
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
    }
}

/// `kochab store bench`.
pub fn bench(args: &BenchArgs) -> Result<(), String> {
    if args.size == 0 || args.size > BENCH_OBJECT_MAX {
        return Err(format!(
            "--size must be 1 byte to {} MiB",
            BENCH_OBJECT_MAX >> 20
        ));
    }
    if args.parallel == 0 || args.parallel > BENCH_PARALLEL_MAX {
        return Err(format!("--parallel must be 1 to {BENCH_PARALLEL_MAX}"));
    }
    let n = args.total.div_ceil(args.size).max(1);
    if n > BENCH_OBJECTS_MAX {
        return Err(format!(
            "--total / --size makes {n} objects; at most {BENCH_OBJECTS_MAX}"
        ));
    }
    let Some(url) = &args.store.store else {
        return Err("--store s3://BUCKET/PREFIX is needed".into());
    };
    let store = open_and_test(url, args.store.store_env.as_deref())?;
    let mut tag = [0u8; 8];
    getrandom::fill(&mut tag).map_err(|e| format!("no randomness: {e}"))?;
    let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    let names: Vec<String> = (0..n)
        .map(|i| format!("store-bench/{tag}/{i:08}"))
        .collect();
    let size = args.size as usize;
    // Random bytes (an engine that compressed or deduplicated would flatter zeros), the
    // object's index in front so that no two objects are equal.
    let mut data = vec![0u8; size];
    getrandom::fill(&mut data).map_err(|e| format!("no randomness: {e}"))?;
    let bytes = n * args.size;

    let put = |i: u64| -> Result<(), String> {
        let mut d = data.clone();
        let idx = i.to_le_bytes();
        let k = idx.len().min(d.len());
        d[..k].copy_from_slice(&idx[..k]);
        store
            .create_if_absent(&names[i as usize], &d)
            .map_err(|e| e.to_string())
    };
    let get = |i: u64| -> Result<(), String> {
        let name = &names[i as usize];
        match store.get(name).map_err(|e| e.to_string())? {
            Some(d) if d.len() == size => Ok(()),
            Some(d) => Err(format!("{name}: read {} bytes, wrote {size}", d.len())),
            None => Err(format!("{name}: missing after it was written")),
        }
    };
    let measured = (|| {
        let (w, lat) = run_phase(n, args.parallel, &put)?;
        let put = phase_report(n, bytes, w, &lat);
        if !args.json {
            print_phase("PUT", &put, args);
        }
        let (w, lat) = run_phase(n, args.parallel, &get)?;
        let get = phase_report(n, bytes, w, &lat);
        if !args.json {
            print_phase("GET", &get, args);
        }
        Ok::<_, String>((put, get))
    })();
    // Deleted whatever happened: a failed run must not leave a gigabyte behind.
    let t = std::time::Instant::now();
    let deleted = store.delete_many(&names);
    let delete_seconds = t.elapsed().as_secs_f64();
    let _ = store.delete_folder(&format!("store-bench/{tag}"));
    let (put, get) = measured?;
    deleted.map_err(|e| format!("deleting the bench's objects: {e}"))?;
    let report = BenchReport {
        store: store.name().to_string(),
        client: BENCH_CLIENT,
        parallel: args.parallel,
        object_bytes: args.size,
        put,
        get,
        delete_seconds,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!("deleted {n} objects in {delete_seconds:.1} s; client: {BENCH_CLIENT}");
    }
    Ok(())
}

fn print_phase(what: &str, r: &PhaseReport, args: &BenchArgs) {
    println!(
        "{what} {} objects of {} bytes, {} in parallel: {:.1} MB/s ({} bytes in {:.2} s; \
         per request p50 {:.1} ms, p99 {:.1} ms)",
        r.objects, args.size, args.parallel, r.mb_per_s, r.bytes, r.seconds, r.p50_ms, r.p99_ms
    );
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4k"), Ok(4096));
        assert_eq!(parse_bytes("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("2MB"), Ok(2_000_000));
        assert!(parse_bytes("1XB").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("99999999999GiB").is_err());
    }
}
