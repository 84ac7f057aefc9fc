//! Random crashes under a mount's writers (docs/ARCHITECTURE.md, "Early replies"): the
//! server and the mount are separate processes; four writers create, write, append,
//! truncate, overwrite, rename and remove files and make directories through the mount,
//! never calling fsync; the server is SIGKILLed at random moments and restarted (or, in a
//! cluster, one server is killed and its tables fail over). Every call that returned
//! success must survive with its exact contents, and no call may fail: a server that
//! comes back is only a delay to the applications.
//!
//! Bounded for CI (`KOCHAB_CRASH_ROUNDS`, default 3 kills per test); a longer run:
//! `KOCHAB_CRASH_ROUNDS=40 cargo test --release -p kochab --test crash_random -- --nocapture`.

mod common;

use common::{MountProc, Rng, ServerProc, kochab_bin, seed};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Writer threads, each in a directory of its own (so each keeps an exact model).
const WRITERS: usize = 4;

/// Calls the writers make after a restart before the next kill's random wait begins.
const PROGRESS: usize = 20;

/// Largest file a writer makes or grows (bytes).
const FILE_MAX: u64 = 3_000;

/// Kills per test unless `KOCHAB_CRASH_ROUNDS` says otherwise.
fn rounds() -> usize {
    std::env::var("KOCHAB_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// What one writer's directory must hold: files (path relative to it -> bytes) and
/// directories.
#[derive(Default, Debug, Clone, PartialEq)]
struct Model {
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
}

/// What a writer did: its model, the calls that failed, its slowest call.
struct Outcome {
    model: Model,
    failures: Vec<String>,
    calls: usize,
    longest: (Duration, String),
    /// Calls that took over a second (a restart's delay), with what they were.
    slow: Vec<(Duration, String)>,
}

/// One writer: random acknowledged changes under `root` until `stop`; stops at its first
/// failure (what follows a failed call is unknown to the model).
fn writer(root: PathBuf, seed: u64, stop: Arc<AtomicBool>, done: Arc<AtomicUsize>) -> Outcome {
    let mut rng = Rng::new(seed);
    let mut m = Model::default();
    let mut out = Outcome {
        model: Model::default(),
        failures: Vec::new(),
        calls: 0,
        longest: (Duration::ZERO, String::new()),
        slow: Vec::new(),
    };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let started = Instant::now();
        let (what, result) = step(&root, &mut rng, &mut m, n);
        let took = started.elapsed();
        out.calls += 1;
        done.fetch_add(1, Ordering::Relaxed);
        if took > out.longest.0 {
            out.longest = (took, what.clone());
        }
        if took > Duration::from_secs(1) {
            out.slow.push((took, what.clone()));
        }
        if let Err(e) = result {
            out.failures.push(format!("{what}: {e} (after {took:?})"));
            break;
        }
    }
    out.model = m;
    out
}

/// A random existing file of the model.
fn pick_file(rng: &mut Rng, m: &Model) -> Option<String> {
    let n = m.files.len() as u64;
    (n > 0).then(|| m.files.keys().nth(rng.below(n) as usize).cloned())?
}

/// A random directory of the model ("" is the writer's root).
fn pick_dir(rng: &mut Rng, m: &Model) -> String {
    let n = m.dirs.len() as u64;
    match rng.below(n + 1) {
        0 => String::new(),
        i => m
            .dirs
            .iter()
            .nth(i as usize - 1)
            .cloned()
            .unwrap_or_default(),
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// One change; updates the model only if the call succeeded.
fn step(root: &Path, rng: &mut Rng, m: &mut Model, n: u64) -> (String, std::io::Result<()>) {
    let file = pick_file(rng, m);
    let kind = match (rng.below(100), &file) {
        (0..40, _) | (_, None) => 0,
        (40..50, _) => 1,
        (50..60, _) => 2,
        (60..66, _) => 3,
        (66..76, _) => 4,
        (76..88, _) => 5,
        _ => 6,
    };
    let file = file.unwrap_or_default();
    match kind {
        // create + write + close
        0 => {
            let path = join(&pick_dir(rng, m), &format!("f{n}"));
            let len = 10 + rng.below(FILE_MAX - 10) as usize;
            let data = rng.bytes(len);
            let r = fs::write(root.join(&path), &data);
            if r.is_ok() {
                m.files.insert(path.clone(), data);
            }
            (format!("create {path}"), r)
        }
        // rename, sometimes over another file
        1 => {
            let to = match pick_file(rng, m) {
                Some(other) if other != file && rng.below(3) == 0 => other,
                _ => join(&pick_dir(rng, m), &format!("r{n}")),
            };
            let r = fs::rename(root.join(&file), root.join(&to));
            if r.is_ok()
                && let Some(data) = m.files.remove(&file)
            {
                m.files.insert(to.clone(), data);
            }
            (format!("rename {file} -> {to}"), r)
        }
        // unlink
        2 => {
            let r = fs::remove_file(root.join(&file));
            if r.is_ok() {
                m.files.remove(&file);
            }
            (format!("unlink {file}"), r)
        }
        // mkdir (nested at most a few levels)
        3 => {
            let parent = pick_dir(rng, m);
            let path = if parent.matches('/').count() >= 3 {
                format!("d{n}")
            } else {
                join(&parent, &format!("d{n}"))
            };
            let r = fs::create_dir(root.join(&path));
            if r.is_ok() {
                m.dirs.insert(path.clone());
            }
            (format!("mkdir {path}"), r)
        }
        // truncate (shorter or longer)
        4 => {
            let len = rng.below(FILE_MAX);
            let r = fs::OpenOptions::new()
                .write(true)
                .open(root.join(&file))
                .and_then(|f| f.set_len(len));
            if r.is_ok()
                && let Some(data) = m.files.get_mut(&file)
            {
                data.resize(len as usize, 0);
            }
            (format!("truncate {file} to {len}"), r)
        }
        // append
        5 => {
            let len = 1 + rng.below(500) as usize;
            let data = rng.bytes(len);
            let r = fs::OpenOptions::new()
                .append(true)
                .open(root.join(&file))
                .and_then(|mut f| f.write_all(&data));
            if r.is_ok()
                && let Some(old) = m.files.get_mut(&file)
            {
                old.extend_from_slice(&data);
            }
            (format!("append {} to {file}", data.len()), r)
        }
        // overwrite a range, maybe past the end
        _ => {
            let len = m.files.get(&file).map_or(0, |d| d.len() as u64);
            let at = rng.below(len + 100);
            let n = 1 + rng.below(300) as usize;
            let data = rng.bytes(n);
            let r = fs::OpenOptions::new()
                .write(true)
                .open(root.join(&file))
                .and_then(|mut f| {
                    f.seek(SeekFrom::Start(at))?;
                    f.write_all(&data)
                });
            if r.is_ok()
                && let Some(old) = m.files.get_mut(&file)
            {
                let end = at as usize + data.len();
                if old.len() < end {
                    old.resize(end, 0);
                }
                old[at as usize..end].copy_from_slice(&data);
            }
            (format!("write {} at {at} of {file}", data.len()), r)
        }
    }
}

/// What a directory holds now, read through a mount.
fn read_tree(root: &Path) -> std::io::Result<Model> {
    let mut m = Model::default();
    let mut todo = vec![String::new()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(root.join(&dir))? {
            let e = e?;
            let path = join(&dir, &e.file_name().to_string_lossy());
            if e.file_type()?.is_dir() {
                m.dirs.insert(path.clone());
                todo.push(path);
            } else {
                m.files.insert(path.clone(), fs::read(root.join(&path))?);
            }
        }
    }
    Ok(m)
}

/// Every difference between what was acknowledged and what is there.
fn differences(want: &Model, got: &Model) -> Vec<String> {
    let mut out = Vec::new();
    for d in want.dirs.difference(&got.dirs) {
        out.push(format!("directory {d} lost"));
    }
    for d in got.dirs.difference(&want.dirs) {
        out.push(format!("directory {d} is there but was never made"));
    }
    for (path, data) in &want.files {
        match got.files.get(path) {
            None => out.push(format!("file {path} ({} bytes) lost", data.len())),
            Some(g) if g != data => {
                let first = g.iter().zip(data).position(|(a, b)| a != b);
                out.push(format!(
                    "file {path}: {} bytes, want {} (first difference at {first:?})",
                    g.len(),
                    data.len()
                ));
            }
            Some(_) => {}
        }
    }
    for path in got.files.keys() {
        if !want.files.contains_key(path) {
            out.push(format!("file {path} is there but was removed or renamed"));
        }
    }
    out
}

/// How the servers are killed.
trait Victim {
    /// Kills a server at a random moment's end and brings the service back.
    fn crash(&mut self, rng: &mut Rng);
    fn log(&self) -> String;
}

/// `kochab up` alone, SIGKILLed and restarted on its directory and port.
struct Single {
    server: ServerProc,
    data: PathBuf,
    port: String,
}

impl Victim for Single {
    fn crash(&mut self, _rng: &mut Rng) {
        self.server.kill9();
        self.server = ServerProc::start_on(&self.data, &self.port, &[]);
    }

    fn log(&self) -> String {
        self.server.log_text()
    }
}

/// `kochab up --servers 2`: one metadata server SIGKILLed; its tables fail over to the
/// other, and the supervisor starts it again.
struct Pair {
    cluster: ServerProc,
}

impl Victim for Pair {
    fn crash(&mut self, rng: &mut Rng) {
        let pids = server_pids(&self.cluster);
        let pid = pids[rng.below(pids.len() as u64) as usize];
        // SAFETY: kill(2) of a server process of this test's cluster.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Back to two serving servers before the next kill.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            let now = server_pids(&self.cluster);
            if now.len() == 2 && !now.contains(&pid) {
                return;
            }
        }
        panic!(
            "the cluster did not get two servers back; log:\n{}",
            self.log()
        );
    }

    fn log(&self) -> String {
        self.cluster.log_text()
    }
}

/// The pids of the cluster's metadata servers that answer its status.
fn server_pids(cluster: &ServerProc) -> Vec<i32> {
    let Ok(out) = Command::new(kochab_bin())
        .args(["status", "--json", "--cluster", &cluster.addr.to_string()])
        .arg("--key-file")
        .arg(cluster.data.join("cluster.key"))
        .output()
    else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["servers"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter(|s| s["tables"].as_array().is_some_and(|t| !t.is_empty()))
                .filter_map(|s| s["pid"].as_i64().map(|p| p as i32))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs the writers through `rounds()` crashes and checks what survived, through the
/// same mount and through a new one.
fn run(name: &str, victim: &mut dyn Victim, addr: SocketAddr, mount: &MountProc, dir: &Path) {
    let seed = seed(name);
    let mut rng = Rng::new(seed);
    let stop = Arc::new(AtomicBool::new(false));
    let roots: Vec<PathBuf> = (0..WRITERS)
        .map(|i| mount.mnt.join(format!("w{i}")))
        .collect();
    for r in &roots {
        fs::create_dir(r).expect("writer's directory");
    }
    let done = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = roots
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (r, stop, done) = (r.clone(), stop.clone(), done.clone());
            let s = seed.wrapping_add(i as u64 + 1);
            std::thread::spawn(move || writer(r, s, stop, done))
        })
        .collect();
    for round in 0..rounds() {
        // Each kill hits writers at work: after the last restart's replay window, once
        // they made progress again, at a random moment.
        let before = done.load(Ordering::Relaxed);
        let deadline = Instant::now() + STALL;
        while done.load(Ordering::Relaxed) < before + PROGRESS {
            assert!(
                Instant::now() < deadline,
                "{name} (seed {seed}): the writers made no progress for {STALL:?} before kill \
                 {round}\nserver log:\n{}\nmount log:\n{}",
                victim.log(),
                fs::read_to_string(dir.join("mount.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let wait = Duration::from_millis(500 + rng.below(2_500));
        std::thread::sleep(wait);
        eprintln!("{name}: round {round}: kill after {wait:?}");
        victim.crash(&mut rng);
    }
    std::thread::sleep(Duration::from_millis(1_000));
    stop.store(true, Ordering::Relaxed);
    // Each writer ends its call in flight: within the mount's retry limit if the call
    // fails; a writer still stuck after that is a hang of the mount (the test fails with
    // the logs instead of stalling; the mount is killed as the test unwinds).
    let deadline = Instant::now() + WRITERS_END;
    while writers.iter().any(|w| !w.is_finished()) {
        assert!(
            Instant::now() < deadline,
            "{name} (seed {seed}): writers stuck {WRITERS_END:?} after the last kill\n\
             server log:\n{}\nmount log:\n{}",
            victim.log(),
            fs::read_to_string(dir.join("mount.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let outcomes: Vec<Outcome> = writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    let calls: usize = outcomes.iter().map(|o| o.calls).sum();
    let longest = outcomes
        .iter()
        .map(|o| &o.longest)
        .max_by_key(|l| l.0)
        .cloned()
        .unwrap_or_default();
    let failures: Vec<&String> = outcomes.iter().flat_map(|o| &o.failures).collect();
    for (i, o) in outcomes.iter().enumerate() {
        for (took, what) in &o.slow {
            eprintln!("{name}: w{i}: {what} took {took:?}");
        }
    }
    eprintln!(
        "{name}: {} kills, {calls} calls, {} failed; longest call {:?} ({})",
        rounds(),
        failures.len(),
        longest.0,
        longest.1
    );
    // Past the replay window, read back through the same mount (no sync point first: the
    // mount must have replayed on its own), then through a new one.
    std::thread::sleep(Duration::from_secs(6));
    let mut lost = Vec::new();
    for (i, (o, r)) in outcomes.iter().zip(&roots).enumerate() {
        let got = read_tree(r).unwrap_or_else(|e| panic!("read back w{i}: {e}"));
        lost.extend(
            differences(&o.model, &got)
                .into_iter()
                .map(|d| format!("w{i}: {d}")),
        );
    }
    let fresh = MountProc::start(addr, &dir.join("data/cluster.key"), &dir.join("m2"));
    for (i, o) in outcomes.iter().enumerate() {
        let got = read_tree(&fresh.mnt.join(format!("w{i}")))
            .unwrap_or_else(|e| panic!("read back w{i} through a new mount: {e}"));
        lost.extend(
            differences(&o.model, &got)
                .into_iter()
                .map(|d| format!("w{i} (new mount): {d}")),
        );
    }
    assert!(
        failures.is_empty() && lost.is_empty(),
        "{name} (seed {seed}): calls that failed: {failures:#?}\nacknowledged changes lost or \
         wrong: {lost:#?}\nserver log:\n{}\nmount log:\n{}",
        victim.log(),
        fs::read_to_string(dir.join("mount.log")).unwrap_or_default()
    );
}

/// How long the writers may go without progress after a restart or failover (which takes
/// seconds) before the mount is taken to hang.
const STALL: Duration = Duration::from_secs(90);

/// How long the writers may take to end their calls once told to stop: twice the mount's
/// retry limit.
const WRITERS_END: Duration = Duration::from_secs(120);

/// How long the test's mount waits for a server (`-o retry=`): far beyond a restart or a
/// failover (seconds), far below the default (600 s), so a call that can never succeed
/// fails the test with its name instead of stalling the writers for ten minutes.
const MOUNT_RETRY: &str = "retry=60";

/// A mount of the cluster whose data directory is `dir/data`, at `dir/m`, its log in
/// `dir/mount.log` (shown when the test fails).
fn mount_logged(addr: SocketAddr, dir: &Path) -> MountProc {
    let log = dir.join("mount.log");
    let key = dir.join("data/cluster.key");
    MountProc::start_logged(addr, &key, &dir.join("m"), &["-o", MOUNT_RETRY], Some(&log))
}

#[test]
fn a_server_killed_at_random_loses_nothing_the_mount_acknowledged() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let server = ServerProc::start(&data, &[]);
    let port = server.addr.port().to_string();
    let mount = mount_logged(server.addr, tmp.path());
    let mut victim = Single { server, data, port };
    let addr = victim.server.addr;
    run("single", &mut victim, addr, &mount, tmp.path());
}

#[test]
fn a_failover_at_random_loses_nothing_the_mount_acknowledged() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let cluster = ServerProc::start(&data, &["--servers", "2", "--lease", "2"]);
    let deadline = Instant::now() + Duration::from_secs(90);
    while server_pids(&cluster).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no two servers; log:\n{}",
            cluster.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mount = mount_logged(cluster.addr, tmp.path());
    let addr = cluster.addr;
    let mut victim = Pair { cluster };
    if std::env::var_os("KOCHAB_TEST_KEEP").is_some() {
        eprintln!("keeping {}", tmp.path().display());
        let dir = tmp.keep();
        run("pair", &mut victim, addr, &mount, &dir);
        return;
    }
    run("pair", &mut victim, addr, &mount, tmp.path());
}
