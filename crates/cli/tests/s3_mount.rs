//! A mount of a cluster on S3 (Ceph RGW) moves file data itself (issue 31): it puts slice
//! objects straight into the bucket under names the server granted and commits them, and
//! reads them straight from the bucket with the layout the server hands out. The server
//! sees grants, commits and layouts, never the bytes.
//!
//! Every test runs a server (`kochab up --store s3://...`, no mount of its own) and
//! separate mount processes. Needs a running RGW: `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh
//! up)` names its env file; without it these tests fail, unless KOCHAB_S3_TESTS=0 says to
//! skip them.

mod common;

use common::s3::rgw_location;
use common::{MountProc, Rng, ServerProc, process_tree};
use kochab_s3store::{S3Settings, S3Store};
use kochab_store::ObjectStore;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Bytes of each big file: 16 chunks.
const BIG: usize = 64 << 20;

/// A server over the store (no mount in its process) and what the tests need of it.
struct S3Cluster {
    server: ServerProc,
    s3: S3Store,
    key: PathBuf,
    dir: tempfile::TempDir,
}

impl S3Cluster {
    fn start(test: &str) -> Option<S3Cluster> {
        let (env_file, location) = rgw_location(test)?;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let url = location.to_string();
        let args = ["--store", &url, "--store-env", env_file.to_str().unwrap()];
        let server = ServerProc::start(&data, &args);
        let vars = kochab_s3store::read_settings_file(&env_file).unwrap();
        let s3 = S3Store::open(&location, &S3Settings::from_vars(&vars).unwrap()).unwrap();
        Some(S3Cluster {
            key: data.join("cluster.key"),
            server,
            s3,
            dir,
        })
    }

    fn mount(&self, name: &str) -> MountProc {
        let log = self.dir.path().join(format!("{name}.log"));
        MountProc::start_logged(
            self.server.addr,
            &self.key,
            &self.dir.path().join(name),
            &[],
            Some(&log),
        )
    }

    /// Bytes the server's processes have read and written (files and sockets alike).
    fn server_io(&self) -> u64 {
        process_tree(self.server.child.id() as i32)
            .iter()
            .map(|p| {
                let io = fs::read_to_string(format!("/proc/{p}/io")).unwrap_or_default();
                io.lines()
                    .filter(|l| l.starts_with("rchar:") || l.starts_with("wchar:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum::<u64>()
            })
            .sum()
    }

    /// Slice objects in the bucket.
    fn slices(&self) -> usize {
        let s3 = &self.s3;
        s3.list("data")
            .unwrap()
            .iter()
            .flat_map(|shard| s3.list(shard).unwrap())
            .filter(|f| f.ends_with(".s"))
            .map(|f| s3.list(&f).unwrap().len())
            .sum()
    }
}

fn dd(src: &Path, dst: &Path, bs: &str) {
    let out = Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", dst.display()))
        .arg(format!("bs={bs}"))
        .arg("conv=fsync")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "dd bs={bs}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn same(got: &[u8], want: &[u8], what: &str) {
    if got.len() != want.len() {
        panic!("{what}: {} bytes, {} expected", got.len(), want.len());
    }
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: differs first at byte {at}");
    }
}

#[test]
fn a_mount_on_s3_puts_and_gets_file_data_itself() {
    let Some(c) = S3Cluster::start("direct") else {
        return;
    };
    let mut rng = Rng::new(common::seed("s3_mount"));
    let src = c.dir.path().join("src");
    let want = rng.bytes(BIG);
    fs::write(&src, &want).unwrap();
    let a = c.mount("a");
    let io_before = c.server_io();

    dd(&src, &a.mnt.join("bs4k"), "4k");
    // Gathered into whole chunks: one slice object per 4 MiB.
    assert_eq!(c.slices(), BIG >> 22, "slices after dd bs=4k");
    dd(&src, &a.mnt.join("bs1m"), "1M");
    assert_eq!(c.slices(), 2 * (BIG >> 22), "slices after dd bs=1M");

    // Another mount reads them back, from the bucket.
    let b = c.mount("b");
    for name in ["bs4k", "bs1m"] {
        same(&fs::read(b.mnt.join(name)).unwrap(), &want, name);
    }
    // Random reads (no read-ahead): parts of slices.
    let f = fs::File::open(b.mnt.join("bs4k")).unwrap();
    for _ in 0..20 {
        let at = rng.below(BIG as u64 - 70_000) as usize;
        let len = 1 + rng.below(70_000) as usize;
        let mut got = vec![0; len];
        f.read_exact_at(&mut got, at as u64).unwrap();
        same(&got, &want[at..at + len], "a random read");
    }
    drop(f);

    let io = c.server_io() - io_before;
    let moved = 2 * BIG as u64;
    eprintln!("server rchar+wchar: {io} bytes for {moved} written (and read again)");
    assert!(
        io * 100 < moved,
        "the server read and wrote {io} bytes for {moved} bytes written and read again"
    );
    drop((a, b));
}

#[test]
fn small_files_round_trip_between_mounts() {
    let Some(c) = S3Cluster::start("small") else {
        return;
    };
    let mut rng = Rng::new(common::seed("s3_mount_small"));
    let a = c.mount("a");
    let dir = a.mnt.join("tree");
    fs::create_dir(&dir).unwrap();
    let mut files = Vec::new();
    for i in 0..500 {
        let len = 1024 + rng.below(19 * 1024) as usize;
        let bytes = rng.bytes(len);
        let mut f = fs::File::create(dir.join(format!("f{i}"))).unwrap();
        // As tar writes: a few writes per file.
        for part in bytes.chunks(10 * 1024) {
            f.write_all(part).unwrap();
        }
        drop(f);
        files.push(bytes);
    }
    let b = c.mount("b");
    for (i, want) in files.iter().enumerate() {
        let got = fs::read(b.mnt.join(format!("tree/f{i}"))).unwrap();
        same(&got, want, &format!("f{i}"));
    }
    // The writer's own mount reads them too.
    for (i, want) in files.iter().enumerate().step_by(50) {
        let got = fs::read(a.mnt.join(format!("tree/f{i}"))).unwrap();
        same(&got, want, &format!("f{i} on the writer"));
    }
    assert!(c.slices() >= 500, "slices: {}", c.slices());
}

#[test]
fn a_killed_mount_leaves_fsynced_data_and_only_committed_slices() {
    let Some(c) = S3Cluster::start("kill") else {
        return;
    };
    let mut rng = Rng::new(common::seed("s3_mount_kill"));
    let src = c.dir.path().join("src");
    let want = rng.bytes(BIG);
    fs::write(&src, &want).unwrap();
    let mut a = c.mount("a");

    // Written with an overwrite in the middle, then fsync'd.
    let synced = rng.bytes(10 << 20);
    let patch = rng.bytes(100_000);
    let mut synced_model = synced.clone();
    synced_model[3_000_000..3_100_000].copy_from_slice(&patch);
    let f = fs::File::create(a.mnt.join("synced")).unwrap();
    f.write_all_at(&synced, 0).unwrap();
    f.write_all_at(&patch, 3_000_000).unwrap();
    f.sync_all().unwrap();

    // A writer that is killed with its mount, with slices put and commits in flight.
    let before = c.slices();
    let mut writer = Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", a.mnt.join("torn").display()))
        .arg("bs=64k")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.slices() < before + 4 {
        assert!(Instant::now() < deadline, "the writer put no slices");
        assert!(writer.try_wait().unwrap().is_none(), "the writer ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    a.kill9();
    let _ = writer.wait();
    drop(f);

    let b = c.mount("b");
    same(
        &fs::read(b.mnt.join("synced")).unwrap(),
        &synced_model,
        "fsync'd file after the kill",
    );
    // Commits go in write order: what is there is a prefix of what was written, and
    // nothing put but not committed shows.
    let torn = fs::read(b.mnt.join("torn")).unwrap();
    eprintln!("the killed writer's file: {} bytes committed", torn.len());
    assert!(torn.len() <= BIG, "torn: {} bytes", torn.len());
    same(&torn, &want[..torn.len()], "the killed writer's file");
}
