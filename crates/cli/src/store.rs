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
    /// engine that does not honour conditional create. File data stays in the local data
    /// directory (DIR/store/data) until file data as objects is built.
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
