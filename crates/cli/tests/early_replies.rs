//! The mount's early replies (docs/ARCHITECTURE.md, "Early replies"), by crashing real
//! processes: the server's journal is slowed (`KOCHAB_JOURNAL_DELAY_MS`, a slow disk) so
//! that the mount holds acknowledged changes that are not durable yet when the SIGKILL
//! comes.

mod common;

use common::{MountProc, ServerProc};
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Files created, one process, one after the other.
const FILES: usize = 40;

fn slow_server(data: &Path, port: &str, delay_ms: &str) -> ServerProc {
    ServerProc::start_env(data, port, &[], &[("KOCHAB_JOURNAL_DELAY_MS", delay_ms)])
}

fn names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn create_all(dir: &Path) {
    fs::create_dir_all(dir).expect("mkdir");
    for i in 0..FILES {
        fs::File::create(dir.join(format!("f{i:02}"))).expect("create");
    }
}

fn expected(n: usize) -> BTreeSet<String> {
    (0..n).map(|i| format!("f{i:02}")).collect()
}

/// SIGKILL of the server alone: the mount replays what it had acknowledged early, to the
/// restarted server, and nothing is lost (the reply caches make each replay run once; a
/// replayed create gets the inode its first reply gave, so the open files stay good).
#[test]
fn a_server_killed_alone_loses_nothing_the_mount_acknowledged() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = slow_server(&data, "0", "1000");
    let port = server.addr.port().to_string();
    let mount = MountProc::start(
        server.addr,
        &data.join("cluster.key"),
        &tmp.path().join("m"),
    );
    let dir = mount.mnt.join("d");
    create_all(&dir);
    let kept = fs::File::open(dir.join("f00")).expect("open");
    let ino = kept.metadata().expect("fstat").ino();
    server.kill9();
    let _server = ServerProc::start_on(&data, &port, &[]);
    // The mount notices the restart and replays; then it serves as before.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = BTreeSet::new();
    while Instant::now() < deadline {
        got = names(&dir);
        if got == expected(FILES) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(got, expected(FILES), "acknowledged creates lost");
    assert_eq!(
        fs::metadata(dir.join("f00")).expect("stat").ino(),
        ino,
        "the replayed create got its first inode"
    );
    fs::write(dir.join("after"), b"x").expect("write after the restart");
}

/// SIGKILL of the server and the mount together: what an fsync covered survives, and of
/// the rest, what survives is a prefix of the order the server acknowledged (here the
/// order of one process's creates). With the journal slowed, most creates were not
/// durable: the early replies did come before the journal.
#[test]
fn a_crash_of_server_and_mount_keeps_what_fsync_covered_and_a_prefix() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = slow_server(&data, "0", "1000");
    let port = server.addr.port().to_string();
    let mut mount = MountProc::start(
        server.addr,
        &data.join("cluster.key"),
        &tmp.path().join("m"),
    );
    let synced = mount.mnt.join("synced");
    fs::create_dir(&synced).expect("mkdir");
    fs::File::create(synced.join("kept")).expect("create");
    fs::File::open(&synced)
        .and_then(|d| d.sync_all())
        .expect("fsync of the directory");
    // Half the files, then time for the journal to catch up (not waited for: nothing
    // covers them), then the other half.
    let dir = mount.mnt.join("d");
    fs::create_dir(&dir).expect("mkdir");
    for i in 0..FILES / 2 {
        fs::File::create(dir.join(format!("f{i:02}"))).expect("create");
    }
    std::thread::sleep(Duration::from_millis(2500));
    let started = Instant::now();
    for i in FILES / 2..FILES {
        fs::File::create(dir.join(format!("f{i:02}"))).expect("create");
    }
    let took = started.elapsed();
    mount.kill9();
    server.kill9();
    let server = ServerProc::start_on(&data, &port, &[]);
    let mount = MountProc::start(
        server.addr,
        &data.join("cluster.key"),
        &tmp.path().join("m"),
    );
    assert!(
        mount.mnt.join("synced/kept").exists(),
        "what the directory's fsync covered was lost"
    );
    let got = names(&mount.mnt.join("d"));
    eprintln!(
        "{} of {FILES} creates survived (acknowledged in {took:?})",
        got.len()
    );
    assert_eq!(got, expected(got.len()), "not a prefix: {got:?}");
    if took < Duration::from_millis(900) {
        // The second half was acknowledged within one (slowed) flush: not all durable.
        assert!(
            got.len() < FILES,
            "all {FILES} creates were durable although the journal was held for 1 s"
        );
    }
}

/// `-o dirsync`: every change is durable before its reply, so a crash of the server and
/// the mount together loses nothing acknowledged.
#[test]
fn with_dirsync_a_crash_of_server_and_mount_loses_nothing_acknowledged() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = slow_server(&data, "0", "30");
    let port = server.addr.port().to_string();
    let mnt = tmp.path().join("m");
    let mut mount = MountProc::start_with(
        server.addr,
        &data.join("cluster.key"),
        &mnt,
        &["-o", "dirsync"],
    );
    let dir = mount.mnt.join("d");
    create_all(&dir);
    mount.kill9();
    server.kill9();
    let server = ServerProc::start_on(&data, &port, &[]);
    let mount = MountProc::start(server.addr, &data.join("cluster.key"), &mnt);
    assert_eq!(names(&mount.mnt.join("d")), expected(FILES));
}
