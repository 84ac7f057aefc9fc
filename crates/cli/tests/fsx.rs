//! fsx, the File System eXerciser (the Rust port from crates.io that scripts/setup.sh builds
//! into target/tools), and stress-ng's file-system stressors through a mount, on the local
//! store and on the S3 store (Ceph RGW). fsx checks every byte it reads against its model
//! of the file through writes, mmap writes, truncations, hole punching, fallocate,
//! copy_file_range, sendfile, fsync and close/reopen. stress-ng runs in place of xfstests'
//! fsstress, which neither Debian 12 nor a registry this machine reaches packages: many
//! file-system calls at once, its `--verify` checking the data stressors read back.
//!
//! The S3 test needs `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)` (or KOCHAB_S3_TESTS=0 to
//! skip it).

mod common;

use common::ServerProc;
use common::s3::{rgw_location, up};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Operations of one fsx run (each seed a different sequence; the seed is printed): about
/// 20 s through a mount on the local store, ...
const FSX_OPS_LOCAL: u32 = 3000;
/// ... and on RGW, where every fsync and close waits for PUTs (100 s for 3000 here).
const FSX_OPS_S3: u32 = 1000;
/// How long stress-ng runs its stressors.
const STRESS_SECS: &str = "10s";

/// Files of up to three chunks (4 MiB each) and operations of up to 1 MiB, so that writes,
/// truncations and punched holes cross chunk boundaries; every operation fsx knows on Linux.
const FSX_CONFIG: &str = r#"
flen = 12582912
[opsize]
max = 1048576
min = 0
align = 1
[weights]
close_open = 2
read = 10
write = 10
mapread = 5
mapwrite = 5
invalidate = 1
truncate = 3
fsync = 1
fdatasync = 1
posix_fallocate = 1
punch_hole = 2
sendfile = 2
copy_file_range = 2
"#;

fn fsx_bin() -> PathBuf {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/bin/fsx");
    assert!(
        bin.exists(),
        "{} is missing: scripts/setup.sh installs it",
        bin.display()
    );
    bin
}

/// Runs fsx on `dir/name` with `seed`; panics with its output if it finds a difference.
fn fsx(dir: &Path, name: &str, seed: u64, ops: u32) {
    let work = tempfile::tempdir().expect("tempdir");
    let config = work.path().join("fsx.toml");
    fs::write(&config, FSX_CONFIG).unwrap();
    let out = Command::new(fsx_bin())
        .args(["-N", &ops.to_string(), "-S", &seed.to_string(), "-f"])
        .arg(&config)
        .arg("-P")
        .arg(work.path())
        .arg(dir.join(name))
        .output()
        .expect("fsx runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "fsx seed {seed} on {} (rerun with KOCHAB_FSX_SEED={seed}): {}\n{text}",
        dir.display(),
        out.status
    );
    eprintln!("fsx seed {seed}: {}", text.lines().last().unwrap_or(""));
}

/// Runs stress-ng's file-system stressors in `dir`; panics if any fails or finds bad data.
fn stress(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    let out = Command::new("stress-ng")
        .arg("--temp-path")
        .arg(dir)
        .args([
            "--hdd",
            "1",
            "--hdd-bytes",
            "8M",
            "--hdd-opts",
            "wr-rnd,rd-rnd",
            "--dir",
            "1",
            "--rename",
            "1",
            "--link",
            "1",
            "--filename",
            "1",
            "--fallocate",
            "1",
            "--fallocate-bytes",
            "8M",
            "--seek",
            "1",
            "--seek-size",
            "8M",
            "--sync-file",
            "1",
            "--sync-file-bytes",
            "8M",
            "--xattr",
            "1",
            "--chmod",
            "1",
            "--utime",
            "1",
            "--dentry",
            "1",
            "--mmap",
            "1",
            "--mmap-file",
            "--mmap-bytes",
            "4M",
            "--verify",
            "--timeout",
            STRESS_SECS,
            "--metrics-brief",
        ])
        .output()
        .expect("stress-ng runs (scripts/setup.sh installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("successful run completed"),
        "stress-ng in {}: {}\n{text}",
        dir.display(),
        out.status
    );
}

/// fsx (a new seed each run, or KOCHAB_FSX_SEED) and stress-ng, in `mnt`.
fn exercise(mnt: &Path, server: &ServerProc, ops: u32) {
    let seed = std::env::var("KOCHAB_FSX_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs())
        });
    let started = std::time::Instant::now();
    fsx(mnt, &format!("fsx-{seed}"), seed, ops);
    let fsx_took = started.elapsed();
    stress(&mnt.join("stress"));
    eprintln!(
        "fsx took {:.1} s, stress-ng {:.1} s",
        fsx_took.as_secs_f64(),
        (started.elapsed() - fsx_took).as_secs_f64()
    );
    assert!(
        !server.log_text().contains("panicked"),
        "a server panicked:\n{}",
        server.log_text()
    );
}

#[test]
fn fsx_and_stress_ng_find_nothing_wrong_on_the_local_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let server = ServerProc::start(
        &dir.path().join("data"),
        &["--mount", mnt.to_str().unwrap()],
    );
    assert!(
        common::is_mounted(&mnt),
        "not mounted:\n{}",
        server.log_text()
    );
    exercise(&mnt, &server, FSX_OPS_LOCAL);
}

#[test]
fn fsx_and_stress_ng_find_nothing_wrong_on_the_s3_store() {
    let Some((env_file, location)) = rgw_location("fsx") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("mnt");
    let server = up(
        &dir.path().join("data"),
        &mnt,
        &location.to_string(),
        &env_file,
    );
    exercise(&mnt, &server, FSX_OPS_S3);
}
