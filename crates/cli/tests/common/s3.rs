//! A Ceph RGW for tests that need an object store: where it is (`KOCHAB_S3_ENV`, made by
//! `scripts/ceph-rgw.sh up`), a prefix of each run's own in its bucket, and `kochab up`
//! over it with a mount.

use super::{ServerProc, is_mounted};
use kochab_s3store::S3Location;
use std::fs;
use std::path::{Path, PathBuf};

/// The env file of the RGW and a prefix of this run's own in its bucket (`None`: skipped).
pub fn rgw_location(test: &str) -> Option<(PathBuf, S3Location)> {
    if std::env::var("KOCHAB_S3_TESTS").as_deref() == Ok("0") {
        eprintln!("KOCHAB_S3_TESTS=0: skipping the tests against Ceph RGW");
        return None;
    }
    let env_file = PathBuf::from(std::env::var("KOCHAB_S3_ENV").unwrap_or_else(|_| {
        panic!(
            "this test needs a Ceph RGW: run it with KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up), \
             or skip it with KOCHAB_S3_TESTS=0"
        )
    }));
    let text = fs::read_to_string(&env_file).unwrap();
    let bucket = text
        .lines()
        .find_map(|l| l.strip_prefix("export KOCHAB_S3_BUCKET="))
        .expect("KOCHAB_S3_BUCKET in the env file")
        .to_string();
    let mut b = [0u8; 6];
    getrandom::fill(&mut b).unwrap();
    let tag: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let location = S3Location::parse(&format!("s3://{bucket}/t/{test}-{tag}")).unwrap();
    Some((env_file, location))
}

/// `kochab up` over the store, mounted at `mnt`.
pub fn up(data: &Path, mnt: &Path, url: &str, env_file: &Path) -> ServerProc {
    fs::create_dir_all(mnt).unwrap();
    let args = [
        "--mount",
        mnt.to_str().unwrap(),
        "--store",
        url,
        "--store-env",
        env_file.to_str().unwrap(),
    ];
    let server = ServerProc::start(data, &args);
    assert!(is_mounted(mnt), "not mounted; log:\n{}", server.log_text());
    server
}
