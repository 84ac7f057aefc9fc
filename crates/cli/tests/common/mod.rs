//! Helpers shared by the integration tests: real `kochab up` processes on loopback ports,
//! killed with real signals, and a deterministic random number generator.
#![allow(dead_code)]

pub mod hosts;
pub mod s3;

use kochab_client::{Client, ClientConfig};
use kochab_proto::auth::ClusterKey;
pub use kochab_store::crashsim::{Loss, LossReport};
use kochab_store::crashsim::{Whose, lose_unsynced};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The `kochab` binary under test.
/// The journal folder of the newest server incarnation (`store/journal/<server>.<epoch>`).
#[allow(dead_code)]
pub fn newest_journal_dir(data: &Path) -> PathBuf {
    let mut dirs: Vec<(u64, u64, PathBuf)> = std::fs::read_dir(data.join("store/journal"))
        .expect("journal dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            let (s, e) = name.split_once('.')?;
            Some((e.parse().ok()?, s.parse().ok()?, p))
        })
        .collect();
    dirs.sort();
    dirs.pop().expect("a journal").2
}

pub fn kochab_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kochab"))
}

/// A `kochab up` process.
pub struct ServerProc {
    pub child: Child,
    /// The first address `kochab up` printed (of a cluster, its first server's).
    pub addr: SocketAddr,
    /// Every address it printed (each server of a cluster).
    pub addrs: Vec<SocketAddr>,
    pub key: ClusterKey,
    pub data: PathBuf,
    pub log: PathBuf,
    /// Where it mounts the file system itself (`--mount`), if it does.
    pub mount: Option<PathBuf>,
}

impl ServerProc {
    /// Starts `kochab up` on a free loopback port with `extra` flags and waits until it
    /// serves (or panics with its log after 60 s).
    pub fn start(data: &Path, extra: &[&str]) -> ServerProc {
        Self::start_on(data, "0", extra)
    }

    /// Like `start`, on a given port.
    pub fn start_on(data: &Path, port: &str, extra: &[&str]) -> ServerProc {
        Self::start_env(data, port, extra, &[])
    }

    /// Like `start_on`, with environment variables for every process of the cluster.
    pub fn start_env(data: &Path, port: &str, extra: &[&str], env: &[(&str, &str)]) -> ServerProc {
        let log = data.with_extension(format!("log{}", std::process::id()));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log file");
        let mut child = Command::new(kochab_bin())
            .args(["up", "--data"])
            .arg(data)
            .args(["--port", port])
            .args(extra)
            .env("KOCHAB_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .expect("spawn kochab up");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("kochab: cluster ready at ") {
                    let _ = tx.send(a.trim().to_string());
                }
            }
        });
        let addrs: Vec<SocketAddr> = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a.split(',').map(|a| a.parse().expect("address")).collect(),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "server did not start; log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        let key = kochab_proto::auth::key_from_hex(
            &std::fs::read_to_string(data.join("cluster.key")).expect("key file"),
        )
        .expect("key");
        let mount = extra
            .iter()
            .position(|a| *a == "--mount")
            .and_then(|i| extra.get(i + 1))
            .map(PathBuf::from);
        ServerProc {
            child,
            addr: addrs[0],
            addrs,
            key,
            data: data.to_path_buf(),
            log,
            mount,
        }
    }

    /// SIGKILL: no chance to flush or checkpoint.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        self.reap();
    }

    /// Waits for the process, signalled already (see [`reap`]: its mount is its own
    /// `--mount`).
    fn reap(&mut self) {
        let mnt = self
            .mount
            .as_ref()
            .map(|m| m.to_string_lossy().into_owned());
        reap(&mut self.child, &|_, point| Some(point) == mnt.as_deref());
    }

    /// A power cut: every process of this `kochab up` (its servers and coordinators too)
    /// is stopped, what their object store had not synced is taken away (`loss`: see
    /// `kochab_store::crashsim`; the processes must have been started with [`CRASH_SIM`]),
    /// and they are killed. Returns what was undone.
    pub fn power_loss(&mut self, loss: Loss) -> LossReport {
        let tree = process_tree(self.child.id() as i32);
        stop_all(&tree);
        let report = lose_unsynced(&self.data.join("store"), Whose::All, loss)
            .unwrap_or_else(|e| panic!("power loss of {}: {e}", self.data.display()));
        for &p in &tree {
            // SAFETY: kill(2) of processes of this test's cluster.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        let _ = self.child.wait();
        report
    }

    /// SIGTERM and wait for a clean exit; returns the exit status code.
    pub fn stop(&mut self) -> Option<i32> {
        // SAFETY: kill(2) with a pid we spawned and still own.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.reap();
        self.child.wait().ok().and_then(|s| s.code())
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A client with the given number of attempts per request.
    pub async fn client(&self, attempts: u32) -> Client {
        let mut cfg = ClientConfig::with_entries(self.addrs.clone(), self.key);
        cfg.attempts = attempts;
        cfg.request_timeout = Duration::from_secs(10);
        Client::connect(cfg).await.expect("connect")
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        self.reap();
        // Its own mount (`kochab up --mount`) outlives it in the kernel: gone too, so that
        // no test leaves a dead mount behind. (Mounts of other processes are theirs.)
        if let Some(mnt) = &self.mount {
            force_unmount(mnt);
        }
    }
}

/// How long a signalled process that serves a FUSE mount may take to exit before its
/// mounts' connections are aborted (see [`reap`]).
const REAP_GRACE: Duration = Duration::from_secs(20);

/// Waits until `child` (signalled already) has exited. A FUSE server killed at the wrong
/// moment can keep one thread in an uninterruptible wait: a reverse invalidation waiting
/// for a page lock that a read holds, a read only the dead process could answer, so the
/// process never exits and its /dev/fuse never closes (seen once in the suite, 2026-12-06,
/// `fsx_and_stress_ng_find_nothing_wrong_on_the_s3_store`). After [`REAP_GRACE`] the
/// connections of the mounts `served(source, mount point)` picks are aborted through
/// fusectl, which ends the wait, as an operator would.
pub fn reap(child: &mut Child, served: &dyn Fn(&str, &str) -> bool) {
    let deadline = std::time::Instant::now() + REAP_GRACE;
    while std::time::Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    abort_fuse_connections(served);
    let _ = child.wait();
}

/// The FUSE mounts `served` picks, as (connection number, mount point), from
/// /proc/self/mountinfo: "id parent major:minor root point options... - type source ...".
fn fuse_mount_table(served: &dyn Fn(&str, &str) -> bool) -> Vec<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found = Vec::new();
    for line in info.lines() {
        let Some((head, tail)) = line.split_once(" - ") else {
            continue;
        };
        let head: Vec<&str> = head.split(' ').collect();
        let tail: Vec<&str> = tail.split(' ').collect();
        let (Some(dev), Some(point), Some(fstype), Some(source)) =
            (head.get(2), head.get(4), tail.first(), tail.get(1))
        else {
            continue;
        };
        let fuse = *fstype == "fuse" || fstype.starts_with("fuse.");
        if let Some((_, minor)) = dev.split_once(':')
            && fuse
            && served(source, point)
        {
            found.push((minor.to_string(), point.to_string()));
        }
    }
    found
}

/// Aborts the FUSE connections of the mounts `served(source, mount point)` picks (fusectl
/// is mounted first if it is not).
pub fn abort_fuse_connections(served: &dyn Fn(&str, &str) -> bool) {
    let ctl = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(ctl).is_ok_and(|mut d| d.next().is_none()) {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "none"])
            .arg(ctl)
            .status();
    }
    for (minor, point) in fuse_mount_table(served) {
        eprintln!("aborting the FUSE connection of {point} (its server did not exit)");
        let _ = std::fs::write(ctl.join(minor).join("abort"), "1");
    }
}

/// The environment that turns on the object store's crash simulation in the processes a
/// test starts (`kochab_store::crashsim`): they record what a power cut could take away,
/// and [`ServerProc::power_loss`] or [`power_loss_of`] takes it.
pub const CRASH_SIM: [(&str, &str); 1] = [(kochab_store::crashsim::ENV, "1")];

/// The power loss of the `k`-th crash of a run: unsynced changes dropped whole, or every
/// other time torn block by block (seeded from the run's seed).
pub fn loss_for(seed: u64, k: u64) -> Loss {
    if k.is_multiple_of(2) {
        Loss::Drop
    } else {
        Loss::Tear {
            seed: seed ^ k.wrapping_mul(0x9e37_79b9),
        }
    }
}

/// `pid` and every process descended from it.
pub fn process_tree(pid: i32) -> Vec<i32> {
    let mut parent_of: Vec<(i32, i32)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        if let Some(pp) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<i32>().ok())
        {
            parent_of.push((p, pp));
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(
            parent_of
                .iter()
                .filter(|&&(_, pp)| pp == p)
                .map(|&(c, _)| c),
        );
        i += 1;
    }
    tree
}

/// SIGSTOPs every process of `pids` and waits until each of their threads has stopped
/// (a thread inside a system call stops when it returns), so that none writes any more.
pub fn stop_all(pids: &[i32]) {
    for &p in pids {
        // SAFETY: kill(2) of processes of this test's cluster.
        unsafe { libc::kill(p, libc::SIGSTOP) };
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stopped = |p: i32| {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            return true;
        };
        tasks.flatten().all(|t| {
            std::fs::read_to_string(t.path().join("stat")).map_or(true, |st| {
                matches!(
                    st.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().next()),
                    Some("T" | "t" | "Z" | "X") | None
                )
            })
        })
    };
    while !pids.iter().all(|&p| stopped(p)) {
        assert!(
            std::time::Instant::now() < deadline,
            "processes {pids:?} did not stop within 10 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The power loss of one process of a cluster (a server whose machine loses power): it is
/// stopped, what it had not synced in the store at `store` is taken away, and it is
/// killed (its parent reaps it). It must have been started with [`CRASH_SIM`].
pub fn power_loss_of(store: &Path, pid: i32, loss: Loss) -> LossReport {
    power_loss_of_then(store, pid, loss, || ()).0
}

/// Like [`power_loss_of`], running `while_off` after the loss and before the kill (while
/// the process can neither write nor be replaced).
pub fn power_loss_of_then<T>(
    store: &Path,
    pid: i32,
    loss: Loss,
    while_off: impl FnOnce() -> T,
) -> (LossReport, T) {
    stop_all(&[pid]);
    let report = lose_unsynced(store, Whose::Process(pid as u32), loss)
        .unwrap_or_else(|e| panic!("power loss of process {pid}: {e}"));
    let out = while_off();
    // SAFETY: kill(2) of a process of this test's cluster.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    (report, out)
}

/// xorshift64*: small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Random bytes of a random length below `max`.
    pub fn bytes_below(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A seed from the environment (KOCHAB_TEST_SEED) or the clock, printed so a failure can
/// be replayed.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("KOCHAB_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: seed {s} (rerun with KOCHAB_TEST_SEED={s})");
    s
}

/// A tokio runtime for a test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// True if `dir` is a FUSE mount right now.
pub fn is_mounted(dir: &Path) -> bool {
    let Ok(canon) = std::fs::canonicalize(dir) else {
        return false;
    };
    let Some(target) = canon.to_str() else {
        return false;
    };
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            l.split_whitespace().nth(1) == Some(target)
                && l.split_whitespace()
                    .nth(2)
                    .is_some_and(|t| t.starts_with("fuse"))
        })
}

/// Lazily unmounts `dir` if it is mounted (after a SIGKILL the mount is left dangling).
pub fn force_unmount(dir: &Path) {
    if is_mounted(dir) {
        let _ = Command::new("fusermount3").arg("-uz").arg(dir).status();
    }
}

/// An embedded cluster (`kochab up --mount`) with its FUSE mount at `mnt`.
pub struct Cluster {
    pub server: ServerProc,
    pub mnt: PathBuf,
}

impl Cluster {
    /// Starts `kochab up --data DIR/data --mount DIR/mnt` (plus `extra` flags).
    pub fn start(dir: &Path, extra: &[&str]) -> Cluster {
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).expect("mountpoint");
        let mut args = vec!["--mount", mnt.to_str().expect("utf8 path")];
        args.extend_from_slice(extra);
        let server = ServerProc::start(&dir.join("data"), &args);
        assert!(
            is_mounted(&mnt),
            "not mounted after start; log:\n{}",
            server.log_text()
        );
        Cluster { server, mnt }
    }

    /// A second, separate mount process (`kochab mount --foreground`) of the same cluster.
    pub fn mount_again(&self, dir: &Path) -> MountProc {
        MountProc::start(self.server.addr, &self.server.data.join("cluster.key"), dir)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.server.child.kill();
        let _ = self.server.child.wait();
        force_unmount(&self.mnt);
    }
}

/// A `kochab mount --foreground` process.
pub struct MountProc {
    pub child: Child,
    pub mnt: PathBuf,
}

impl MountProc {
    pub fn start(addr: SocketAddr, key_file: &Path, mnt: &Path) -> MountProc {
        Self::start_with(addr, key_file, mnt, &[])
    }

    /// Like `start`, with more arguments (`-o OPTIONS`).
    pub fn start_with(addr: SocketAddr, key_file: &Path, mnt: &Path, extra: &[&str]) -> MountProc {
        Self::start_logged(addr, key_file, mnt, extra, None)
    }

    /// Like `start_with`, the process's log written to `log`.
    pub fn start_logged(
        addr: SocketAddr,
        key_file: &Path,
        mnt: &Path,
        extra: &[&str],
        log: Option<&Path>,
    ) -> MountProc {
        let stderr = match log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("mount log")),
            None => Stdio::null(),
        };
        std::fs::create_dir_all(mnt).expect("mountpoint");
        let mut child = Command::new(kochab_bin())
            .args(["mount", &addr.to_string()])
            .arg(mnt)
            .arg("--foreground")
            .arg("--key-file")
            .arg(key_file)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn kochab mount");
        for _ in 0..300 {
            if is_mounted(mnt) {
                return MountProc {
                    child,
                    mnt: mnt.to_path_buf(),
                };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("{} was not mounted within 15 s", mnt.display());
    }

    /// SIGKILL the mount process (its session ends after the server's grace period).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        self.reap();
        force_unmount(&self.mnt);
    }

    /// Waits for the mount process, signalled already (see [`reap`]).
    fn reap(&mut self) {
        let mnt = self.mnt.to_string_lossy().into_owned();
        reap(&mut self.child, &|_, point| point == mnt);
    }
}

impl Drop for MountProc {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a child we spawned.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.reap();
        force_unmount(&self.mnt);
    }
}

/// An errno's name for test logs and outcome comparisons ("errno N" for one the protocol
/// has no name for).
pub fn errno_name(code: i32) -> String {
    match kochab_proto::Errno(code).name() {
        "E?" => format!("errno {code}"),
        name => name.to_string(),
    }
}

/// `kochab fsck --data DIR` of a stopped cluster (every table from its manifest and the
/// journals it names): asserts it is clean and returns its summary line. `what` names the
/// run in a failure.
pub fn offline_fsck_clean(data: &Path, what: &str) -> String {
    let out = Command::new(kochab_bin())
        .args(["fsck", "--data"])
        .arg(data)
        .output()
        .expect("fsck");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what}: fsck failed:\n{text}");
    assert!(
        text.contains("cluster namespace") && text.contains(": clean"),
        "{what}: {text}"
    );
    text.lines()
        .filter(|l| l.contains("namespace"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Inodes a start would find in `data` now: its durable namespace (what stopped or
/// power-cut servers left, and what running ones made durable), counted by an offline fsck
/// of a copy of its store, which touches nothing of `data` and works while a cluster runs.
/// Tried five times: a copy taken while a server writes may miss a file renamed meanwhile
/// or catch a checkpoint half made.
pub fn durable_inodes(data: &Path) -> u64 {
    let copies: Vec<tempfile::TempDir> = (0..5).filter_map(|_| copy_store(data)).collect();
    durable_inodes_in(&copies, data)
}

/// A copy of `data`'s store and cluster key, taken in a few milliseconds (so that it can be
/// taken while a server is stopped for less than its lease); None if a file went away
/// while it was copied (a server renamed or removed it).
pub fn copy_store(data: &Path) -> Option<tempfile::TempDir> {
    let tmp = tempfile::tempdir().expect("tempdir");
    let copy = tmp.path().join("data");
    std::fs::create_dir_all(&copy).expect("mkdir");
    let out = Command::new("cp")
        .arg("-a")
        .arg(data.join("store"))
        .arg(&copy)
        .output()
        .expect("cp");
    std::fs::copy(data.join("cluster.key"), copy.join("cluster.key")).expect("key");
    out.status.success().then_some(tmp)
}

/// The inodes an offline fsck finds in the first of `copies` (of `data`, by
/// [`copy_store`]) that it loads: a copy taken while another server wrote may hold a
/// checkpoint half made.
pub fn durable_inodes_in(copies: &[tempfile::TempDir], data: &Path) -> u64 {
    let mut last = String::from("no complete copy");
    for tmp in copies {
        let out = Command::new(kochab_bin())
            .args(["fsck", "--data"])
            .arg(tmp.path().join("data"))
            .output()
            .expect("fsck");
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let inodes = last.lines().find_map(|l| {
            let (before, _) = l.split_once(" inodes (")?;
            before.rsplit(' ').next()?.parse::<u64>().ok()
        });
        if let (true, Some(n)) = (out.status.success(), inodes) {
            return n;
        }
    }
    panic!("offline fsck of copies of {}: {last}", data.display());
}

/// fcntl(fd, cmd, {typ, start, len}) of a record lock (F_SETLK, F_SETLKW, F_OFD_SETLK...):
/// 0, or -1 with errno set.
pub fn fcntl_lock(fd: std::os::fd::RawFd, cmd: i32, typ: i32, start: i64, len: i64) -> i32 {
    let fl = libc::flock {
        l_type: typ as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: start,
        l_len: len,
        l_pid: 0,
    };
    // SAFETY: a lock command with a caller's descriptor and an initialized struct flock.
    unsafe { libc::fcntl(fd, cmd, &fl) }
}

/// Pins the calling thread to `cpu`, so its FUSE requests go to that CPU's ring queue.
pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; `cpu` is below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// An open file description's lock on the whole file (F_OFD_SETLK, or F_OFD_SETLKW to wait).
pub fn ofd_lock(f: &std::fs::File, kind: i32, wait: bool) -> std::io::Result<()> {
    let cmd = if wait {
        libc::F_OFD_SETLKW
    } else {
        libc::F_OFD_SETLK
    };
    match fcntl_lock(std::os::fd::AsRawFd::as_raw_fd(f), cmd, kind, 0, 0) {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// A server and two mounts of it under `dir` (`a`, `b`), their logs in `a.log` and
/// `b.log` there if `logged`.
pub fn two_mounts(dir: &Path, logged: bool) -> (ServerProc, MountProc, MountProc) {
    let data = dir.join("data");
    let server = ServerProc::start(&data, &[]);
    let key = data.join("cluster.key");
    let mount = |name: &str| {
        let log = dir.join(format!("{name}.log"));
        let log = logged.then_some(log.as_path());
        MountProc::start_logged(server.addr, &key, &dir.join(name), &[], log)
    };
    let (a, b) = (mount("a"), mount("b"));
    (server, a, b)
}

/// A raw protocol connection (no client library: nothing retried, nothing hidden), for
/// tests that must see exactly what a server sends. Every step returns an error instead
/// of panicking, so a test can tell a refusal from an answer.
pub struct RawConn {
    s: std::net::TcpStream,
    buf: Vec<u8>,
    /// The incarnation the server's welcome named (random per server process).
    pub incarnation: u64,
}

impl RawConn {
    /// Connects to `addr` and authenticates as client `client_id` with the admin key.
    pub fn connect(addr: SocketAddr, key: &ClusterKey, client_id: u64) -> std::io::Result<RawConn> {
        use kochab_proto::frame::{decode_payload, encode_frame};
        use kochab_proto::{Auth, Challenge, FrameKind};
        use std::io::Write;
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut c = RawConn {
            s,
            buf: Vec::new(),
            incarnation: 0,
        };
        let (kind, payload) = c.frame()?.ok_or_else(|| std::io::Error::other("closed"))?;
        if kind != FrameKind::Challenge {
            return Err(std::io::Error::other(format!(
                "{kind:?} before the challenge"
            )));
        }
        let ch: Challenge = decode_payload(&payload).map_err(std::io::Error::other)?;
        let auth = Auth::prove(
            &kochab_proto::auth::ClientKey::admin(*key),
            ch.nonce,
            [7; 32],
            client_id,
        )
        .0;
        let mut out = Vec::new();
        encode_frame(&mut out, FrameKind::Auth, 0, &auth).map_err(std::io::Error::other)?;
        c.s.write_all(&out)?;
        match c.frame()? {
            Some((FrameKind::Welcome, p)) => {
                let w: kochab_proto::Welcome = decode_payload(&p).map_err(std::io::Error::other)?;
                c.incarnation = w.incarnation;
                Ok(c)
            }
            other => Err(std::io::Error::other(format!("no welcome: {other:?}"))),
        }
    }

    /// Sends `req` with request id `id`.
    pub fn send(&mut self, id: u64, req: &kochab_proto::Request) -> std::io::Result<()> {
        use std::io::Write;
        let mut out = Vec::new();
        kochab_proto::frame::encode_frame(&mut out, kochab_proto::FrameKind::Request, id, req)
            .map_err(std::io::Error::other)?;
        self.s.write_all(&out)
    }

    /// The next frame (kind, payload); None when the server closed the connection.
    pub fn frame(&mut self) -> std::io::Result<Option<(kochab_proto::FrameKind, Vec<u8>)>> {
        use kochab_proto::frame::{FRAME_HEADER_BYTES, parse_header};
        use std::io::Read;
        loop {
            if let Some(h) = parse_header(&self.buf).map_err(std::io::Error::other)? {
                let payload = self.buf[FRAME_HEADER_BYTES..h.total_len].to_vec();
                self.buf.drain(..h.total_len);
                return Ok(Some((h.kind, payload)));
            }
            let mut chunk = [0u8; 4096];
            let n = self.s.read(&mut chunk)?;
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Sends `req` and returns the reply (a durable or an early one).
    pub fn call(&mut self, req: &kochab_proto::Request) -> std::io::Result<kochab_proto::Reply> {
        use kochab_proto::FrameKind;
        use kochab_proto::frame::decode_payload;
        self.send(1, req)?;
        loop {
            match self.frame()? {
                None => return Err(std::io::Error::other("closed")),
                Some((FrameKind::Reply, p)) => {
                    return decode_payload(&p).map_err(std::io::Error::other);
                }
                Some((FrameKind::Unsafe, p)) => {
                    let (_, _, r): (u64, kochab_proto::auth::ReplayTag, kochab_proto::Reply) =
                        decode_payload(&p).map_err(std::io::Error::other)?;
                    return Ok(r);
                }
                Some(_) => {}
            }
        }
    }
}

/// Frames by which a server answers or acknowledges (a refusal is a closed connection, or
/// a Goodbye).
fn is_answer(kind: kochab_proto::FrameKind) -> bool {
    use kochab_proto::FrameKind;
    matches!(
        kind,
        FrameKind::Reply | FrameKind::Unsafe | FrameKind::Durable | FrameKind::Callback
    )
}
/// Stops process `pid` with SIGSTOP and returns once every one of its threads is stopped:
/// kill(2) only queues the signal, and a thread running at that moment may still read and
/// serve a request for a while (long enough under load to serve one a test sends next).
pub fn stop_process(pid: i32) {
    // SAFETY: kill(2) of a process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stopped = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks.flatten().all(|t| {
                    std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                        // The state follows the parenthesised command name.
                        stat.rsplit_once(')')
                            .and_then(|(_, rest)| rest.split_whitespace().next())
                            .is_some_and(|state| state == "T" || state == "t")
                    })
                })
            })
            .unwrap_or(true);
        if stopped {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop within 10 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A server paused past its lease (SIGSTOP) and since fenced must answer nothing once it
/// resumes. `held` is a connection made to it before the pause, with requests written
/// while it was stopped; this resumes `pid` (SIGCONT), then until the process has exited
/// (at most `within`) reads `held` and keeps opening new connections to `addr` and sending
/// `request(n)` on them: any answer (a reply, early or not, or a durable report) panics.
/// A connection refused, closed or left unanswered is a refusal; one welcomed by another
/// process (a new incarnation on the same address) ends the probe, as the fenced one has
/// let its address go. Returns the number of requests refused.
pub fn resume_and_probe_fenced(
    pid: i32,
    addr: SocketAddr,
    key: &ClusterKey,
    mut held: RawConn,
    request: impl Fn(u64) -> kochab_proto::Request,
    mut exited: impl FnMut() -> bool,
    within: Duration,
) -> u64 {
    // SAFETY: kill(2) of a server process of this test's cluster.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let deadline = std::time::Instant::now() + within;
    let mut refused = 1;
    // What was written while it was stopped is read as soon as it runs again.
    let _ = held.s.set_read_timeout(Some(Duration::from_millis(300)));
    loop {
        match held.frame() {
            Ok(Some((kind, _))) if is_answer(kind) => {
                panic!(
                    "the fenced server {pid} answered a request sent before it resumed ({kind:?})"
                )
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let mut n = 0u64;
    while !exited() {
        assert!(
            std::time::Instant::now() < deadline,
            "the fenced server {pid} did not exit within {within:?}"
        );
        n += 1;
        // A new client id each time: no session or reply cache of an earlier one helps.
        if let Ok(mut c) = RawConn::connect(addr, key, 0xfe_0000 + n) {
            if c.incarnation != held.incarnation {
                break;
            }
            let _ = c.s.set_read_timeout(Some(Duration::from_millis(300)));
            if c.send(n, &request(n)).is_ok() {
                loop {
                    match c.frame() {
                        Ok(Some((kind, _))) if is_answer(kind) => {
                            panic!("the fenced server {pid} answered request {n} ({kind:?})")
                        }
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => break,
                    }
                }
            }
        }
        refused += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    refused
}

/// Runs `kochab ARGS --cluster ADDR --key-file KEY` (the admin key) against the cluster
/// `server` started; returns (success, stdout and stderr).
pub fn kochab_at(server: &ServerProc, args: &[&str]) -> (bool, String) {
    let out = Command::new(kochab_bin())
        .args(args)
        .args(["--cluster", &server.addr.to_string()])
        .arg("--key-file")
        .arg(server.data.join("cluster.key"))
        .env_remove("KOCHAB_KEY")
        .output()
        .expect("run kochab");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Server id -> number of tables, of the servers a `kochab status --json` lists.
pub fn tables_per_server(v: &serde_json::Value) -> Vec<(u64, usize)> {
    v["servers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| Some((s["id"].as_u64()?, s["tables"].as_array()?.len())))
                .collect()
        })
        .unwrap_or_default()
}

/// `kochab status --json` of the cluster `server` started, or None while it does not
/// answer as one (no server list yet).
pub fn status(server: &ServerProc) -> Option<serde_json::Value> {
    let out = Command::new(kochab_bin())
        .args(["status", "--json", "--cluster", &server.addr.to_string()])
        .arg("--key-file")
        .arg(server.data.join("cluster.key"))
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v.get("servers").is_some().then_some(v)
}

/// A free port on loopback (for processes that need a concrete `--listen`).
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Children killed with SIGKILL however the test ends.
#[derive(Default)]
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawns `kochab ARGS`, logging to `log`, and waits for its first stdout line containing
/// `ready` (EOF if it exits first).
pub fn spawn_ready(args: &[String], log: &Path, ready: &str) -> Child {
    let mut child = Command::new(kochab_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn kochab");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.contains(ready),
        "kochab {args:?} did not start: {line:?}\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    child
}

/// The value of a metric served (Prometheus text, plain HTTP) at `addr` ("host:port").
pub fn metric_at(addr: &str, name: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The value of a metric `server` exports (its metrics address is in its log; the latest
/// start's, as a restarted server appends to the same log).
pub fn metric(server: &ServerProc, name: &str) -> Option<f64> {
    let log = server.log_text();
    let addr = log.rsplit_once("metrics at http://")?.1.split('/').next()?;
    metric_at(addr, name)
}
