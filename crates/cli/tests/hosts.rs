//! Servers on separate hosts (issue 30, item 4), hosts being network namespaces
//! (`common::hosts`): Ceph RGW on a store host, three coordinator replicas on three hosts,
//! three metadata servers on three more, and a client host that mounts the file system and
//! also uses the native client. Under a load of creates and renames from the client host,
//! each test makes one fault happen and checks that every acknowledged operation is there
//! afterwards and that the namespace is consistent:
//!
//! - every process of a server host SIGKILLed: its tables are served again by the others
//!   (the time that takes is printed);
//! - a server host's link cut: the server is fenced and exits, its tables are recovered
//!   elsewhere, and once the link is back it answers nothing until a new incarnation has
//!   registered;
//! - every Ceph daemon SIGKILLed and restarted: the servers stall and resume, none exits.
//!
//! Needs root (namespaces) and Ceph's packages (scripts/ceph-rgw.sh installs them); skipped
//! with a message where namespaces cannot be made, or with KOCHAB_S3_TESTS=0. The figures
//! are printed (`-- --nocapture` shows them); nothing is asserted about speed.
//!
//!     cargo test --release --locked -p kochab --test hosts -- --nocapture

mod common;

use common::hosts::{self, Host, Net};
use common::{RawConn, force_unmount, is_mounted, kochab_bin};
use kochab_client::{Client, ClientConfig};
use kochab_cluster::state::CoordState;
use kochab_coord::CoordClient;
use kochab_proto::cluster::{ServerId, TableId};
use kochab_proto::{Credentials, InodeId};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where the metadata servers keep their state. `S3`: the RGW on the store host (`kochab
/// mds --store`), each server's local directory its host's own. `Local`: one directory
/// every host reads (the hosts share the test machine's filesystem), `kochab mds --data`,
/// for comparison: `KOCHAB_HOSTS_STORE=local`.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Store {
    Local,
    S3,
}

fn store() -> Store {
    match std::env::var("KOCHAB_HOSTS_STORE").as_deref() {
        Ok("local") => Store::Local,
        _ => Store::S3,
    }
}

/// A server's lease (s), as `kochab up --servers` gives by default: a dead server's tables
/// are recovered about this long after it stopped renewing.
const LEASE_S: u32 = 2;
const MDS_PORT: u16 = 7420;
const COORD_PORT: u16 = 7431;
/// The store host's address (last byte) and those of the others: coordinators .11-.13,
/// metadata servers .21-.23 (ids 2-4), the client .31.
const STORE_HOST: u8 = 2;
const COORD_HOSTS: [u8; 3] = [11, 12, 13];
const MDS_HOSTS: [u8; 3] = [21, 22, 23];
const CLIENT_HOST: u8 = 31;
/// Workers of the load: through the mount, and through the native client.
const MOUNT_WORKERS: usize = 2;
const NATIVE_WORKERS: usize = 2;
/// Pause of a load worker between operations: a load, not a flood. Unpaced, the four
/// workers acknowledged about 7,000 operations a second on this 2-core machine and kept
/// its CPUs and disk so busy (with Ceph's restart on top) that the coordinator replicas'
/// AppendEntries went unanswered past 100 ms again and again, lease renewals were not
/// committed in time, and a healthy server was fenced (exit 3): a test of overload, not
/// of the fault it makes.
const OP_PAUSE: Duration = Duration::from_millis(2);
/// How long the load runs before the fault, and after the cluster is whole again.
const LOAD_BEFORE: Duration = Duration::from_secs(2);
const LOAD_AFTER: Duration = Duration::from_secs(2);
/// Most time a test waits for the cluster to serve again after a fault (a lease, a
/// recovery and the 5 s replay window take well under this).
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);

/// The net and the store host, shared by the tests of this file (Ceph's cold start takes
/// seconds and hundreds of MiB): made by the first test, torn down when the process exits.
struct World {
    net: Net,
    store: Host,
    /// scripts/ceph-rgw.sh's directory for this cluster, and its env file.
    rgw_dir: PathBuf,
    env_file: PathBuf,
    bucket: String,
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);
/// The tests take turns: each runs seven hosts' processes on a machine of few cores.
static TURN: Mutex<()> = Mutex::new(());

extern "C" fn tear_down_world() {
    // (A test that failed while holding the lock poisoned it; the world is torn down all
    // the same.)
    let mut w = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = w.take() {
        rgw(&w.store, &w.rgw_dir, "down").ok();
        drop(w);
    }
}

fn rgw_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-rgw.sh")
}

/// `scripts/ceph-rgw.sh ACTION` on the store host: its stdout.
fn rgw(store: &Host, dir: &Path, action: &str) -> Result<String, String> {
    let out = store
        .command("bash")
        .arg(rgw_script())
        .arg(action)
        .env("KOCHAB_RGW_DIR", dir)
        .env("KOCHAB_RGW_ADDR", store.addr.to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ceph-rgw.sh {action}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ceph-rgw.sh {action}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Takes this test's turn and makes sure the world exists; None (skip) if hosts cannot be
/// made here.
fn world(
    test: &str,
) -> Option<(
    std::sync::MutexGuard<'static, ()>,
    std::sync::MutexGuard<'static, Option<World>>,
)> {
    if let Some(why) = hosts::unavailable() {
        eprintln!("{test}: skipped: {why}");
        return None;
    }
    if std::env::var("KOCHAB_S3_TESTS").as_deref() == Ok("0") {
        eprintln!("{test}: skipped: KOCHAB_S3_TESTS=0 (no Ceph RGW for the store host)");
        return None;
    }
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    if w.is_none() {
        let t0 = Instant::now();
        let net = Net::new().expect("bridge");
        let store = net.host("store", STORE_HOST).expect("store host");
        let rgw_dir = store.dir.join("rgw");
        let env = rgw(&store, &rgw_dir, "up").unwrap_or_else(|e| panic!("{e}"));
        let env_file = PathBuf::from(env.trim());
        let bucket = std::fs::read_to_string(&env_file)
            .expect("env file")
            .lines()
            .find_map(|l| l.strip_prefix("export KOCHAB_S3_BUCKET="))
            .expect("bucket")
            .to_string();
        eprintln!(
            "{test}: Ceph RGW on the store host {} in {:?}",
            store.addr,
            t0.elapsed()
        );
        // SAFETY: atexit(3) with a function that takes no arguments and does not unwind.
        unsafe { libc::atexit(tear_down_world) };
        *w = Some(World {
            net,
            store,
            rgw_dir,
            env_file,
            bucket,
        });
    }
    Some((turn, w))
}

/// A copy of the cluster key in `h`'s directory (mode 0600, as `kochab` wants it): each
/// host has its own, as separate machines would.
fn install_key(h: &Host, key: &[u8; 32]) -> PathBuf {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = h.dir.join("cluster.key");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    writeln!(f, "{}", kochab_proto::auth::key_to_hex(key)).unwrap();
    path
}

/// A data directory holding a cluster whose every table is released (as `kochab up
/// --servers` leaves one): a single server starts on it once and lets every table go.
fn prepare_local(data: &Path) {
    let rt = common::runtime();
    let server = rt
        .block_on(kochab_server::start(kochab_server::ServerConfig::new(
            data,
            "127.0.0.1:0".parse().unwrap(),
        )))
        .unwrap();
    for (lo, _) in server.shared().hosted_tables() {
        server.shared().drop_table(lo).unwrap();
    }
    rt.block_on(server.shutdown());
}

fn addr_of(h: &Host, port: u16) -> SocketAddr {
    SocketAddr::from((h.addr, port))
}

/// Waits up to `secs` for `ok`.
fn wait_until(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last `n` lines of a log.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One metadata server: its host, id, and the pid of its current process.
struct Mds {
    host: Host,
    id: u32,
    pid: u32,
    log: PathBuf,
}

/// The cluster of one test, on hosts of the shared net.
struct Cluster {
    client: Host,
    mds: Vec<Mds>,
    coords: Vec<Host>,
    key_file: PathBuf,
    key: [u8; 32],
    coord_list: String,
    mnt: PathBuf,
    mount_log: PathBuf,
    /// The shared data directory (Store::Local) or this test's location in the bucket.
    data: PathBuf,
    location: String,
    env_file: PathBuf,
}

impl Cluster {
    fn start(w: &World, test: &str) -> Cluster {
        let t0 = Instant::now();
        let net = &w.net;
        let shared = net.dir().join(format!("{test}-shared"));
        std::fs::create_dir_all(&shared).unwrap();
        let data = shared.join("data");
        let location = {
            let mut b = [0u8; 4];
            getrandom::fill(&mut b).unwrap();
            let tag: String = b.iter().map(|x| format!("{x:02x}")).collect();
            format!("s3://{}/hosts/{test}-{tag}", w.bucket)
        };
        let key: [u8; 32] = match store() {
            Store::Local => {
                prepare_local(&data);
                kochab_server::read_key_file(&data.join(kochab_server::KEY_FILE)).unwrap()
            }
            // The first server to start on the new location initialises it with this key.
            Store::S3 => {
                let mut k = [0u8; 32];
                getrandom::fill(&mut k).unwrap();
                k
            }
        };
        let client = net.host(&format!("{test}-client"), CLIENT_HOST).unwrap();
        let key_file = install_key(&client, &key);
        let coords: Vec<Host> = COORD_HOSTS
            .iter()
            .enumerate()
            .map(|(i, &last)| net.host(&format!("{test}-c{}", i + 1), last).unwrap())
            .collect();
        let peers = coords
            .iter()
            .enumerate()
            .map(|(i, h)| format!("{}={}", i + 1, addr_of(h, COORD_PORT)))
            .collect::<Vec<_>>()
            .join(",");
        let coord_list = coords
            .iter()
            .map(|h| addr_of(h, COORD_PORT).to_string())
            .collect::<Vec<_>>()
            .join(",");
        for (i, h) in coords.iter().enumerate() {
            let log = h.dir.join("coord.log");
            let out = std::fs::File::create(&log).unwrap();
            h.spawn(
                h.command(kochab_bin())
                    .args(["coord", "--id", &(i + 1).to_string(), "--listen"])
                    .arg(addr_of(h, COORD_PORT).to_string())
                    .args(["--peers", &peers, "--data"])
                    .arg(h.dir.join("coord"))
                    .arg("--key-file")
                    .arg(install_key(h, &key))
                    .args(["--bootstrap", "--lease", &LEASE_S.to_string()])
                    .env("KOCHAB_LOG", "info")
                    .stdout(out.try_clone().unwrap())
                    .stderr(out),
            )
            .unwrap();
        }
        let mut cluster = Cluster {
            client,
            mds: Vec::new(),
            coords,
            key_file,
            key,
            coord_list,
            mnt: shared.join("mnt"),
            mount_log: shared.join("mount.log"),
            data,
            location,
            env_file: w.env_file.clone(),
        };
        for (i, &last) in MDS_HOSTS.iter().enumerate() {
            let host = net.host(&format!("{test}-m{}", i + 1), last).unwrap();
            let log = host.dir.join("mds.log");
            let mut m = Mds {
                host,
                id: 2 + i as u32,
                pid: 0,
                log,
            };
            cluster.spawn_mds(&mut m);
            cluster.mds.push(m);
        }
        for m in &cluster.mds {
            wait_until(&format!("server {} serving", m.id), 60, || {
                assert!(
                    m.host.running(m.pid),
                    "server {} exited:\n{}",
                    m.id,
                    tail(&m.log, 30)
                );
                std::fs::read_to_string(&m.log)
                    .unwrap_or_default()
                    .contains("serving at")
            });
        }
        wait_until("every table placed", 60, || cluster.placed());
        cluster.mount();
        eprintln!(
            "{test}: {} coordinators, {} servers and a mount on hosts in {:?} (store: {:?})",
            cluster.coords.len(),
            cluster.mds.len(),
            t0.elapsed(),
            store()
        );
        cluster
    }

    /// `kochab mds` of `m` on its host (a new incarnation).
    fn spawn_mds(&self, m: &mut Mds) {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .unwrap();
        let mut cmd = m.host.command(kochab_bin());
        cmd.args(["mds", "--id", &m.id.to_string(), "--listen"])
            .arg(addr_of(&m.host, MDS_PORT).to_string())
            .args(["--coord", &self.coord_list, "--key-file"])
            .arg(install_key(&m.host, &self.key))
            .env("KOCHAB_LOG", "info")
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        match store() {
            Store::Local => cmd.arg("--data").arg(&self.data),
            Store::S3 => cmd
                .args(["--store", &self.location, "--store-env"])
                .arg(&self.env_file)
                .arg("--data")
                .arg(m.host.dir.join("local")),
        };
        m.pid = m.host.spawn(&mut cmd).unwrap();
    }

    fn mds_addrs(&self) -> Vec<SocketAddr> {
        self.mds
            .iter()
            .map(|m| addr_of(&m.host, MDS_PORT))
            .collect()
    }

    /// The coordinator's state, read from the client host.
    fn coord_state(&self) -> Option<CoordState> {
        let socks: Vec<SocketAddr> = self
            .coord_list
            .split(',')
            .map(|a| a.parse().unwrap())
            .collect();
        let key = self.key;
        self.client.run_in(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let mut cfg = kochab_coord::ClientConfig::new(socks, key);
            cfg.budget = Duration::from_secs(2);
            let c = CoordClient::<CoordState>::new(cfg);
            rt.block_on(c.read_state()).ok().map(|(s, _)| s)
        })
    }

    /// Every table placed on a live server, nothing moving, every server live.
    fn placed(&self) -> bool {
        self.coord_state().is_some_and(|s| {
            s.bootstrapped
                && s.unplaced.is_empty()
                && s.migrations.is_empty()
                && !s.map.tables.is_empty()
                && s.map.tables.values().all(|p| s.live(p.owner).is_some())
        })
    }

    fn mount(&mut self) {
        std::fs::create_dir_all(&self.mnt).unwrap();
        let list = self
            .mds_addrs()
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let log = std::fs::File::create(&self.mount_log).unwrap();
        let c = &self.client;
        let pid = c
            .spawn(
                c.command(kochab_bin())
                    .args(["mount", &list])
                    .arg(&self.mnt)
                    .arg("--foreground")
                    .arg("--key-file")
                    .arg(&self.key_file)
                    .args(["-o", "retry=60"])
                    .env("KOCHAB_LOG", "info")
                    .stdout(Stdio::null())
                    .stderr(log),
            )
            .unwrap();
        wait_until("the mount", 15, || {
            assert!(
                c.running(pid),
                "the mount exited:\n{}",
                tail(&self.mount_log, 30)
            );
            is_mounted(&self.mnt)
        });
    }

    /// A native client on the client host's network; `f` gets it and a runtime.
    fn with_client<T: Send>(
        &self,
        f: impl FnOnce(&tokio::runtime::Runtime, Client) -> T + Send,
    ) -> T {
        let entries = self.mds_addrs();
        let key = self.key;
        self.client.run_in(move || {
            let rt = common::runtime();
            let cfg = ClientConfig::with_entries(entries, key);
            let c = rt.block_on(Client::connect(cfg)).expect("connect");
            f(&rt, c)
        })
    }

    /// `kochab fsck` of the running cluster from the client host: its output, and
    /// whether it called the namespace clean.
    fn online_fsck(&self) -> (bool, String) {
        let list = self
            .mds_addrs()
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let out = self
            .client
            .command(kochab_bin())
            .args(["fsck", "--cluster", &list, "--key-file"])
            .arg(&self.key_file)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// Copies every process's log to a directory that outlives the test (when it failed).
    fn keep_logs(&self) {
        let keep = std::env::temp_dir().join(format!(
            "kochab-hosts-failed-{}-{}",
            std::process::id(),
            self.client.name
        ));
        let _ = std::fs::create_dir_all(&keep);
        let copy = |from: &Path, to: &str| {
            let _ = std::fs::copy(from, keep.join(to));
        };
        for m in &self.mds {
            copy(&m.log, &format!("mds-{}.log", m.id));
        }
        for (i, c) in self.coords.iter().enumerate() {
            copy(&c.dir.join("coord.log"), &format!("coord-{}.log", i + 1));
        }
        copy(&self.mount_log, "mount.log");
        eprintln!("logs kept in {}", keep.display());
    }

    /// Prints every process's log tail (when a test failed).
    fn dump_logs(&self) {
        for m in &self.mds {
            eprintln!(
                "--- server {} ({}):\n{}",
                m.id,
                m.host.addr,
                tail(&m.log, 40)
            );
        }
        for (i, c) in self.coords.iter().enumerate() {
            eprintln!(
                "--- coordinator {} ({}):\n{}",
                i + 1,
                c.addr,
                tail(&c.dir.join("coord.log"), 20)
            );
        }
        eprintln!("--- mount:\n{}", tail(&self.mount_log, 40));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
            self.keep_logs();
        }
        self.client.kill_all();
        hosts::abort_fuse(&self.mnt);
        force_unmount(&self.mnt);
    }
}

/// What the client was told of one name: the ledger of acknowledged operations.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Expect {
    Present,
    Absent,
    /// An operation on it failed or its answer was lost: either is right.
    Either,
}

#[derive(Default)]
struct Ledger {
    /// Directory (under the root) -> name -> what must be there.
    names: BTreeMap<String, BTreeMap<String, Expect>>,
    acked: u64,
    failed: u64,
}

impl Ledger {
    fn merge(&mut self, dir: &str, names: BTreeMap<String, Expect>, acked: u64, failed: u64) {
        self.names.insert(dir.to_string(), names);
        self.acked += acked;
        self.failed += failed;
    }
}

/// What one worker of the load did: its directory, what it was told of each name, and
/// how many operations were acknowledged and how many failed.
type WorkerResult = (String, BTreeMap<String, Expect>, u64, u64);

/// The load: creates and renames through the mount and through the native client until
/// `stop`, every answer recorded. Returns the ledger and the time of every acknowledged
/// operation (to see when the cluster served again).
struct Load {
    stop: Arc<AtomicBool>,
    handles: Vec<std::thread::JoinHandle<WorkerResult>>,
    /// Milliseconds since `start` of the latest acknowledged operation of any worker.
    last_ack_ms: Arc<AtomicU64>,
    start: Instant,
    /// Acknowledged operations so far.
    acked: Arc<AtomicU64>,
    /// Of which the native clients' (durable replies: the mount's are early replies, which
    /// a server gives before its journal has the record).
    acked_durable: Arc<AtomicU64>,
}

impl Load {
    fn start(c: &Cluster) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let last_ack_ms = Arc::new(AtomicU64::new(0));
        let acked = Arc::new(AtomicU64::new(0));
        let acked_durable = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let mut handles = Vec::new();
        for w in 0..MOUNT_WORKERS {
            let dir = c.mnt.join(format!("m{w}"));
            std::fs::create_dir(&dir).unwrap();
            let (stop, last, acked) = (stop.clone(), last_ack_ms.clone(), acked.clone());
            handles.push(std::thread::spawn(move || {
                let mut names = BTreeMap::new();
                let (mut ok, mut failed) = (0u64, 0u64);
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let f = format!("f{i}");
                    let r = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(dir.join(&f));
                    let ack = r.is_ok();
                    names.insert(
                        f.clone(),
                        if ack { Expect::Present } else { Expect::Either },
                    );
                    if ack && i % 2 == 1 {
                        let to = format!("r{i}");
                        if std::fs::rename(dir.join(&f), dir.join(&to)).is_ok() {
                            names.insert(f, Expect::Absent);
                            names.insert(to, Expect::Present);
                            ok += 1;
                        } else {
                            names.insert(f, Expect::Either);
                            names.insert(to, Expect::Either);
                            failed += 1;
                        }
                    }
                    if ack {
                        ok += 1;
                        acked.fetch_add(1, Ordering::SeqCst);
                        last.store(start.elapsed().as_millis() as u64, Ordering::SeqCst);
                    } else {
                        failed += 1;
                    }
                    i += 1;
                    std::thread::sleep(OP_PAUSE);
                }
                (format!("m{w}"), names, ok, failed)
            }));
        }
        for w in 0..NATIVE_WORKERS {
            let entries = c.mds_addrs();
            let key = c.key;
            let (stop, last, acked) = (stop.clone(), last_ack_ms.clone(), acked.clone());
            let durable = acked_durable.clone();
            let ns = c.client.ns.clone();
            handles.push(std::thread::spawn(move || {
                hosts_enter(&ns);
                let rt = common::runtime();
                let client = rt
                    .block_on(Client::connect(ClientConfig::with_entries(entries, key)))
                    .expect("connect");
                let cred = Credentials::root();
                let root = client.root();
                let dname = format!("n{w}");
                let dir = rt
                    .block_on(client.mkdir(&cred, root, dname.as_bytes(), 0o755))
                    .expect("mkdir")
                    .id;
                let mut names = BTreeMap::new();
                let (mut ok, mut failed) = (0u64, 0u64);
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let f = format!("f{i}");
                    let r = rt.block_on(client.mknod(&cred, dir, f.as_bytes(), 0o100644, 0, true));
                    let ack = r.is_ok();
                    names.insert(
                        f.clone(),
                        if ack { Expect::Present } else { Expect::Either },
                    );
                    if ack && i % 2 == 1 {
                        let to = format!("r{i}");
                        if rt
                            .block_on(client.rename(
                                &cred,
                                dir,
                                f.as_bytes(),
                                dir,
                                to.as_bytes(),
                                0,
                            ))
                            .is_ok()
                        {
                            names.insert(f, Expect::Absent);
                            names.insert(to, Expect::Present);
                            ok += 1;
                        } else {
                            names.insert(f, Expect::Either);
                            names.insert(to, Expect::Either);
                            failed += 1;
                        }
                    }
                    if ack {
                        ok += 1;
                        acked.fetch_add(1, Ordering::SeqCst);
                        durable.fetch_add(1, Ordering::SeqCst);
                        last.store(start.elapsed().as_millis() as u64, Ordering::SeqCst);
                    } else {
                        failed += 1;
                    }
                    i += 1;
                    std::thread::sleep(OP_PAUSE);
                }
                (dname, names, ok, failed)
            }));
        }
        Load {
            stop,
            handles,
            last_ack_ms,
            start,
            acked,
            acked_durable,
        }
    }

    fn finish(mut self) -> Ledger {
        self.stop.store(true, Ordering::SeqCst);
        let mut ledger = Ledger::default();
        for h in std::mem::take(&mut self.handles) {
            let (dir, names, ok, failed) = h.join().expect("load worker");
            ledger.merge(&dir, names, ok, failed);
        }
        ledger
    }
}

impl Drop for Load {
    /// A test that failed mid-load stops its workers (they end once the mount is gone).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Moves the calling thread into the namespace `ns` (a host's, by name).
fn hosts_enter(ns: &str) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(Path::new("/run/netns").join(ns)).expect("namespace");
    // SAFETY: setns(2) of the calling thread with a descriptor open for the call.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
}

/// Reads back every name of the ledger (after a sync point of the mount: fsync of each of
/// its directories, which returns once what it answered early is durable), through a new
/// native client: returns the acknowledged operations whose result is missing.
fn lost_ops(c: &Cluster, ledger: &Ledger) -> Vec<String> {
    for w in 0..MOUNT_WORKERS {
        let d = std::fs::File::open(c.mnt.join(format!("m{w}"))).unwrap();
        d.sync_all().expect("fsync of a directory of the mount");
    }
    let names = &ledger.names;
    c.with_client(|rt, client| {
        let cred = Credentials::root();
        let root = client.root();
        let mut lost = Vec::new();
        for (dir, expect) in names {
            let d = rt
                .block_on(client.lookup(&cred, root, dir.as_bytes()))
                .unwrap_or_else(|e| panic!("directory {dir}: {e}"));
            let listed: std::collections::BTreeSet<String> = rt
                .block_on(client.readdir_all(&cred, d.id, false))
                .unwrap_or_else(|e| panic!("readdir {dir}: {e}"))
                .into_iter()
                .map(|e| String::from_utf8_lossy(&e.name).into_owned())
                .collect();
            for (name, e) in expect {
                let there = listed.contains(name);
                match e {
                    Expect::Present if !there => lost.push(format!("{dir}/{name} missing")),
                    Expect::Absent if there => lost.push(format!("{dir}/{name} not renamed")),
                    _ => {}
                }
            }
            for name in &listed {
                if !expect.contains_key(name) {
                    lost.push(format!("{dir}/{name} never made"));
                }
            }
        }
        lost
    })
}

/// The tables `victim` owns and an inode of each that the load made there, if any.
fn tables_of(c: &Cluster, victim: ServerId) -> Vec<TableId> {
    let s = c.coord_state().expect("coordinator state");
    s.map
        .tables
        .iter()
        .filter(|(_, p)| p.owner == victim)
        .map(|(t, _)| *t)
        .collect()
}

/// The server whose tables hold the directory of the first native worker (so the load
/// meets the fault), and that directory's inode.
fn victim(c: &Cluster) -> (usize, InodeId) {
    let dir = c.with_client(|rt, client| {
        rt.block_on(client.lookup(&Credentials::root(), client.root(), b"n0"))
            .expect("n0")
            .id
    });
    let s = c.coord_state().expect("coordinator state");
    let (_, p) = s.map.table_of(dir).expect("n0's table is placed");
    let i = c
        .mds
        .iter()
        .position(|m| ServerId(m.id) == p.owner)
        .expect("a server of this cluster");
    (i, dir)
}

/// After a fault to server `gone` at `t0`: the time until each of its tables is owned by
/// a live other server and `probe` (an inode on one of them) is answered by it.
fn served_again(
    c: &Cluster,
    gone: ServerId,
    tables: &[TableId],
    probe: InodeId,
    t0: Instant,
) -> Duration {
    let mut owned_at = None;
    let entries = c.mds_addrs();
    let key = c.key;
    let deadline = t0 + RECOVERY_LIMIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "the tables of server {gone:?} were not served again within {RECOVERY_LIMIT:?}"
        );
        if owned_at.is_none()
            && let Some(s) = c.coord_state()
            && tables.iter().all(|t| {
                s.map
                    .tables
                    .get(t)
                    .is_some_and(|p| p.owner != gone && s.live(p.owner).is_some())
            })
        {
            owned_at = Some(t0.elapsed());
        }
        if owned_at.is_some() {
            let entries = entries.clone();
            let answered = c.client.run_in(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let mut cfg = ClientConfig::with_entries(entries, key);
                cfg.connect_timeout = Duration::from_millis(300);
                cfg.request_timeout = Duration::from_millis(500);
                cfg.retry_budget = Duration::from_millis(200);
                rt.block_on(async {
                    let c = Client::connect(cfg).await.ok()?;
                    c.getattr(&Credentials::root(), probe).await.ok()
                })
                .is_some()
            });
            if answered {
                return t0.elapsed();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// When the process `pid` (a child not reaped yet) ended, after `t0`: watched every 10 ms
/// by a thread of its own, at most [`RECOVERY_LIMIT`].
fn exit_watch(pid: u32, t0: Instant) -> Arc<Mutex<Option<Duration>>> {
    let seen = Arc::new(Mutex::new(None));
    let out = seen.clone();
    std::thread::spawn(move || {
        while t0.elapsed() < RECOVERY_LIMIT {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|st| {
                    let (_, rest) = st.rsplit_once(')')?;
                    rest.split_whitespace().next().map(str::to_string)
                });
            if !matches!(state.as_deref(), Some(s) if s != "Z" && s != "X") {
                *seen.lock().unwrap() = Some(t0.elapsed());
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    out
}

/// Stops every process of the cluster with SIGKILL (as if every host lost power) and checks
/// what the store holds offline (`kochab fsck --data` or `--store`): every table loaded at
/// once, links across servers included. Returns its summary.
fn offline_fsck(test: &str, c: &Cluster) -> String {
    c.client.kill_all();
    hosts::abort_fuse(&c.mnt);
    force_unmount(&c.mnt);
    for m in &c.mds {
        m.host.kill_all();
    }
    for h in &c.coords {
        h.kill_all();
    }
    // From the client host: the store host is reachable only on the hosts' network.
    let mut cmd = c.client.command(kochab_bin());
    match store() {
        Store::Local => cmd.args(["fsck", "--data"]).arg(&c.data),
        Store::S3 => cmd
            .args(["fsck", "--store", &c.location, "--store-env"])
            .arg(&c.env_file),
    };
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("namespace") && text.contains(": clean"),
        "{test}: offline fsck:\n{text}"
    );
    text.lines()
        .filter(|l| l.contains("namespace"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Fails the test with the logs if any server process of `c` but `except` exited.
fn assert_no_server_exited(c: &Cluster, except: Option<usize>) {
    for (i, m) in c.mds.iter().enumerate() {
        if Some(i) != except {
            assert!(
                m.host.running(m.pid),
                "server {} (pid {}) exited:\n{}",
                m.id,
                m.pid,
                tail(&m.log, 40)
            );
        }
    }
}

fn report(test: &str, ledger: &Ledger, lost: &[String]) {
    eprintln!(
        "{test}: ops acknowledged {}, not acknowledged {}, acknowledged ops lost {}",
        ledger.acked,
        ledger.failed,
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "{test}: acknowledged operations lost: {lost:?}"
    );
}

/// `kochab fsck` of the running cluster, then of its store once every process is stopped:
/// both clean.
fn fsck_clean(test: &str, c: &Cluster) {
    let (ok, text) = c.online_fsck();
    eprintln!("{test}: {}", text.trim().replace('\n', "; "));
    assert!(ok && !text.contains("problem"), "{test}: fsck:\n{text}");
    let offline = offline_fsck(test, c);
    eprintln!("{test}: offline: {offline}");
}

#[test]
fn a_killed_server_host_has_its_tables_served_by_the_others() {
    const T: &str = "kill";
    let Some((_turn, w)) = world(T) else { return };
    let c = Cluster::start(w.as_ref().unwrap(), T);
    let load = Load::start(&c);
    std::thread::sleep(LOAD_BEFORE);
    let (vi, probe) = victim(&c);
    let gone = ServerId(c.mds[vi].id);
    let tables = tables_of(&c, gone);
    let before = load.acked.load(Ordering::SeqCst);
    let t0 = Instant::now();
    let killed = c.mds[vi].host.kill_all();
    let kill_ms = load.start.elapsed().as_millis() as u64;
    eprintln!(
        "{T}: SIGKILLed every process of host {} (server {}, {} tables, pids {killed:?}) after {before} ops",
        c.mds[vi].host.addr,
        gone.0,
        tables.len()
    );
    let took = served_again(&c, gone, &tables, probe, t0);
    eprintln!(
        "{T}: its tables served again (map and a read of one of its inodes) after {:.2} s",
        took.as_secs_f64()
    );
    // Changes acknowledged again by every worker.
    wait_until(
        "the load acknowledged again",
        RECOVERY_LIMIT.as_secs(),
        || load.last_ack_ms.load(Ordering::SeqCst) > kill_ms + 100,
    );
    std::thread::sleep(LOAD_AFTER);
    let ledger = load.finish();
    assert_no_server_exited(&c, Some(vi));
    let lost = lost_ops(&c, &ledger);
    report(T, &ledger, &lost);
    fsck_clean(T, &c);
}

/// What `kochab mds` exits with once it learns it was fenced (crates/cli/src/mds.rs).
const EXIT_FENCED: i32 = 3;

#[test]
fn a_cut_off_server_host_is_fenced_and_serves_nothing_until_it_registers_again() {
    const T: &str = "cut";
    let Some((_turn, w)) = world(T) else { return };
    let mut c = Cluster::start(w.as_ref().unwrap(), T);
    let load = Load::start(&c);
    std::thread::sleep(LOAD_BEFORE);
    let (vi, probe) = victim(&c);
    let gone = ServerId(c.mds[vi].id);
    let tables = tables_of(&c, gone);
    let old_epoch = c
        .coord_state()
        .and_then(|s| s.live(gone).map(|i| i.epoch))
        .expect("the victim is live");
    let vaddr = addr_of(&c.mds[vi].host, MDS_PORT);
    let key = c.key;
    // A connection made before the cut: what is written to it while the link is down
    // reaches the server when it comes back.
    let mut held = c
        .client
        .run_in(|| RawConn::connect(vaddr, &key, 0xc0ffee))
        .expect("a connection to the victim");
    let held_incarnation = held.incarnation;
    let t0 = Instant::now();
    c.mds[vi].host.cut_link().unwrap();
    let exit_seen = exit_watch(c.mds[vi].pid, t0);
    eprintln!(
        "{T}: cut the link of host {} (server {gone:?}, epoch {old_epoch:?}, {} tables)",
        c.mds[vi].host.addr,
        tables.len()
    );
    let request = |n: u64| {
        kochab_proto::Request::plain(
            &Credentials::root(),
            kochab_proto::Op::Mknod {
                parent: probe,
                name: format!("fenced-probe-{n}").into_bytes(),
                mode: 0o100644,
                rdev: 0,
                exclusive: true,
            },
        )
    };
    for n in 0..3 {
        held.send(n, &request(n)).expect("written while cut");
    }
    let took = served_again(&c, gone, &tables, probe, t0);
    eprintln!(
        "{T}: its tables served again elsewhere after {:.2} s",
        took.as_secs_f64()
    );
    let s = c.coord_state().unwrap();
    assert!(
        s.live(gone).is_none(),
        "the cut-off server is still live in the coordinator's state"
    );
    // The cut-off server's own view: it cannot renew, so it fences itself and exits
    // (EXIT_FENCED) once its lease has run out by its own clock.
    let m = &c.mds[vi];
    let exited_alone = {
        let deadline = Instant::now() + Duration::from_secs(10);
        while m.host.running(m.pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        !m.host.running(m.pid)
    };
    let status = m.host.reap();
    let exit_at = match *exit_seen.lock().unwrap() {
        Some(d) => format!("{:.2} s after the cut", d.as_secs_f64()),
        None => "still running".to_string(),
    };
    eprintln!(
        "{T}: the cut-off server {} on its own while cut ({exit_at}): {status:?}",
        if exited_alone {
            "exited"
        } else {
            "did not exit"
        },
    );
    c.mds[vi].host.restore_link().unwrap();
    // Whatever the held connection and new ones get from that address before a new
    // incarnation is welcomed: no answer at all (resume_and_probe_fenced panics on one).
    let host = &c.mds[vi].host;
    let pid = c.mds[vi].pid;
    let refused = c.client.run_in(|| {
        common::resume_and_probe_fenced(
            pid as i32,
            vaddr,
            &key,
            held,
            request,
            || !host.running(pid),
            Duration::from_secs(20),
        )
    });
    eprintln!("{T}: link back; the fenced server refused {refused} requests and answered none");
    assert!(
        exited_alone,
        "the cut-off server did not exit on its own within 10 s after its tables were \
         recovered"
    );
    for (_, st) in status {
        assert_eq!(
            st.code(),
            Some(EXIT_FENCED),
            "the fenced server's exit: {st}"
        );
    }
    // A supervisor starts a new incarnation: it listens only once registered (so nothing
    // answers at that address before), under a new epoch, and then serves.
    let mut m = c.mds.remove(vi);
    c.spawn_mds(&mut m);
    c.mds.insert(vi, m);
    wait_until("the restarted server registered", 30, || {
        c.coord_state()
            .and_then(|s| s.live(gone))
            .is_some_and(|i| i.epoch > old_epoch)
    });
    let conn = c
        .client
        .run_in(|| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match RawConn::connect(vaddr, &key, 0xbeef) {
                    Ok(conn) => return Ok(conn),
                    Err(e) if Instant::now() > deadline => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        })
        .expect("the new incarnation listens");
    assert_ne!(conn.incarnation, held_incarnation);
    eprintln!(
        "{T}: a new incarnation registered (epoch {:?}) and serves",
        c.coord_state().and_then(|s| s.live(gone)).map(|i| i.epoch)
    );
    std::thread::sleep(LOAD_AFTER);
    let ledger = load.finish();
    assert_no_server_exited(&c, None);
    let lost = lost_ops(&c, &ledger);
    report(T, &ledger, &lost);
    // None of the probes' names was made.
    let made = c.with_client(|rt, client| {
        rt.block_on(client.readdir_all(&Credentials::root(), probe, false))
            .unwrap()
            .into_iter()
            .filter(|e| e.name.starts_with(b"fenced-probe-"))
            .count()
    });
    assert_eq!(
        made, 0,
        "a request sent to the fenced server was carried out"
    );
    fsck_clean(T, &c);
}

#[test]
fn every_ceph_daemon_killed_and_restarted_stalls_the_servers_and_loses_nothing() {
    const T: &str = "ceph";
    let Some((_turn, w)) = world(T) else { return };
    let world = w.as_ref().unwrap();
    let c = Cluster::start(world, T);
    let pids: Vec<u32> = c.mds.iter().map(|m| m.pid).collect();
    let load = Load::start(&c);
    std::thread::sleep(LOAD_BEFORE);
    let run = world.rgw_dir.join("run");
    let daemons: Vec<(String, i32)> = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let daemon = name.strip_suffix(".pid")?.to_string();
            let pid = std::fs::read_to_string(e.path())
                .ok()?
                .trim()
                .parse()
                .ok()?;
            Some((daemon, pid))
        })
        .collect();
    assert_eq!(
        daemons.len(),
        3,
        "mon, osd and radosgw pid files: {daemons:?}"
    );
    assert_no_server_exited(&c, None);
    let on_store = world.store.pids();
    let before = load.acked.load(Ordering::SeqCst);
    let before_durable = load.acked_durable.load(Ordering::SeqCst);
    for (name, pid) in &daemons {
        assert!(
            on_store.contains(pid),
            "{name} ({pid}) runs on the store host"
        );
        // SAFETY: kill(2) of a Ceph daemon of this test's store host.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    let t0 = Instant::now();
    wait_until("the Ceph daemons gone", 10, || {
        let now = world.store.pids();
        daemons.iter().all(|(_, p)| !now.contains(p))
    });
    // Down for a few leases: long enough for anything that would give up to give up.
    std::thread::sleep(Duration::from_secs(3 * LEASE_S as u64));
    let exited: Vec<u32> = c
        .mds
        .iter()
        .filter(|m| !m.host.running(m.pid))
        .map(|m| m.id)
        .collect();
    eprintln!("{T}: servers exited while Ceph was down: {exited:?}");
    let during = load.acked.load(Ordering::SeqCst) - before;
    let during_durable = load.acked_durable.load(Ordering::SeqCst) - before_durable;
    let t1 = Instant::now();
    rgw(&world.store, &world.rgw_dir, "start").unwrap_or_else(|e| panic!("{e}"));
    let restart = t1.elapsed();
    let at_restart = load.acked_durable.load(Ordering::SeqCst);
    // Every server must still be there (stalled, not stopped) and acknowledge again.
    wait_until(
        "the native clients acknowledged again",
        RECOVERY_LIMIT.as_secs(),
        || {
            assert_no_server_exited(&c, None);
            load.acked_durable.load(Ordering::SeqCst) > at_restart + 10
        },
    );
    eprintln!(
        "{T}: SIGKILLed {:?}; down {:.2} s ({during} ops acknowledged meanwhile, {during_durable} of them durable); restarted in \
         {:.2} s; acknowledging again {:.2} s after the restart",
        daemons.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        t1.duration_since(t0).as_secs_f64(),
        restart.as_secs_f64(),
        t1.elapsed().as_secs_f64() - restart.as_secs_f64()
    );
    std::thread::sleep(LOAD_AFTER);
    let ledger = load.finish();
    assert_no_server_exited(&c, None);
    let now: Vec<u32> = c.mds.iter().map(|m| m.pid).collect();
    assert_eq!(now, pids, "the same server processes");
    eprintln!("{T}: servers exited 0 (pids {pids:?} unchanged)");
    let lost = lost_ops(&c, &ledger);
    report(T, &ledger, &lost);
    fsck_clean(T, &c);
}
