//! The mount's early replies (docs/ARCHITECTURE.md, "Early replies"), by crashing real
//! processes: the server's journal is slowed (`KOCHAB_JOURNAL_DELAY_MS`, a slow disk) so
//! that the mount holds acknowledged changes that are not durable yet when the server
//! loses power (its store's crash simulation drops what it had not synced: see
//! `kochab_store::crashsim`). Each test proves that the window was open at the crash: the
//! durable namespace the server left (an offline fsck) held fewer inodes than the mount
//! had acknowledged; a replay that is never needed would otherwise pass unseen.

mod common;

use common::{CRASH_SIM, Loss, MountProc, ServerProc, durable_inodes};
use kochab_client::{Client, ClientConfig};
use kochab_proto::Credentials;
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Files created, one process, one after the other.
const FILES: usize = 40;

/// How long the slowed journal holds each flush: far longer than the creates after which
/// the server loses power take, so none of them can be durable by then.
const HOLD_MS: &str = "3000";

fn slow_server(data: &Path, port: &str, delay_ms: &str) -> ServerProc {
    ServerProc::start_env(
        data,
        port,
        &[],
        &[("KOCHAB_JOURNAL_DELAY_MS", delay_ms), CRASH_SIM[0]],
    )
}

fn restarted(data: &Path, port: &str) -> ServerProc {
    ServerProc::start_env(data, port, &[], &CRASH_SIM)
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
    let mut server = slow_server(&data, "0", HOLD_MS);
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
    server.power_loss(Loss::Drop);
    // The window was open: the root, d and its files were acknowledged; fewer are durable.
    let durable = durable_inodes(&data);
    assert!(
        durable < (2 + FILES) as u64,
        "all {} acknowledged inodes were durable at the crash: nothing to replay",
        2 + FILES
    );
    eprintln!(
        "{durable} of {} acknowledged inodes durable at the crash",
        2 + FILES
    );
    let _server = restarted(&data, &port);
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

/// The server and the mount crash together: what an fsync covered survives, and of the
/// rest, what survives is a prefix of the order the server acknowledged (here the order of
/// one process's creates). With the journal slowed, the creates after the fsync were not
/// durable: the early replies did come before the journal.
#[test]
fn a_crash_of_server_and_mount_keeps_what_fsync_covered_and_a_prefix() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = slow_server(&data, "0", HOLD_MS);
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
    // Half the files, covered by an fsync of their directory, then the other half.
    let dir = mount.mnt.join("d");
    fs::create_dir(&dir).expect("mkdir");
    for i in 0..FILES / 2 {
        fs::File::create(dir.join(format!("f{i:02}"))).expect("create");
    }
    fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .expect("fsync of the directory");
    let started = Instant::now();
    for i in FILES / 2..FILES {
        fs::File::create(dir.join(format!("f{i:02}"))).expect("create");
    }
    let took = started.elapsed();
    mount.kill9();
    server.power_loss(Loss::Drop);
    // Acknowledged: the root, synced, kept, d and all its files.
    let acknowledged = (4 + FILES) as u64;
    let durable = durable_inodes(&data);
    let server = restarted(&data, &port);
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
        "{} of {FILES} creates survived (the second half acknowledged in {took:?}); \
         {durable} of {acknowledged} inodes durable at the crash",
        got.len()
    );
    assert_eq!(got, expected(got.len()), "not a prefix: {got:?}");
    assert!(
        got.len() >= FILES / 2,
        "creates the directory's fsync covered were lost: {got:?}"
    );
    // Every run: acknowledged creates were not durable when the server died, and so were
    // lost with the mount.
    assert!(
        durable < acknowledged && got.len() < FILES,
        "all {FILES} creates were durable at the crash (acknowledged in {took:?}) although \
         the journal held each flush for {HOLD_MS} ms"
    );
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
    server.power_loss(Loss::Drop);
    let server = restarted(&data, &port);
    let mount = MountProc::start(server.addr, &data.join("cluster.key"), &mnt);
    assert_eq!(names(&mount.mnt.join("d")), expected(FILES));
}

/// A mount creates a name, and another client (native, with early replies, as a mount's
/// client is) unlinks it, both before the journal has the create. The unlink depended on
/// the other session's change, so it is not answered early
/// (`crates/server/src/unsettled.rs`): it waits for the journal. The server loses power
/// before either record is durable; the mount replays its create, and the client sends its
/// unlink again, which the replay window holds until the replays are in. Both calls return
/// 0, and the name is gone, as they said. (Answered early, the unlink could replay before
/// the create and fail, and the name would come back: an acknowledged unlink lost.)
///
/// Not a second mount: its kernel looks the name up before the unlink, and that lookup,
/// which observed the create, is what waits for the journal; sent again after the crash it
/// can find no name yet (reads are not held by the replay window), and the kernel then
/// never sends the unlink.
#[test]
fn an_unlink_of_a_name_another_mount_just_made_is_not_lost_in_a_crash() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = slow_server(&data, "0", HOLD_MS);
    let port = server.addr.port().to_string();
    let key = data.join("cluster.key");
    let maker_log = tmp.path().join("maker.log");
    let maker = MountProc::start_logged(
        server.addr,
        &key,
        &tmp.path().join("a"),
        &[],
        Some(&maker_log),
    );
    fs::File::create(maker.mnt.join("x")).expect("create at the mount");
    let mut cfg = ClientConfig::with_entries(server.addrs.clone(), server.key);
    cfg.early_replies = true;
    cfg.retry_budget = Duration::from_secs(60);
    let unlinked = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async {
            let c = Client::connect(cfg).await.expect("connect");
            c.unlink(&Credentials::root(), c.root(), b"x").await
        })
    });
    // The unlink reaches the server and waits there for the held flush.
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        !unlinked.is_finished(),
        "the unlink was answered before the create it depended on was durable"
    );
    server.power_loss(Loss::Drop);
    assert!(
        durable_inodes(&data) < 2,
        "the create was durable at the crash: nothing to replay"
    );
    let server = restarted(&data, &port);
    if let Err(e) = unlinked.join().expect("unlink thread") {
        panic!(
            "the unlink, sent again after the restart: {e}\nserver log:\n{}\nmount log:\n{}",
            server.log_text(),
            fs::read_to_string(&maker_log).unwrap_or_default(),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && names(&maker.mnt).contains("x") {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !names(&maker.mnt).contains("x"),
        "the acknowledged unlink was lost: x is back"
    );
}
