//! A cluster of metadata servers on a store on S3 (Ceph RGW): `kochab up --servers 3
//! --store`, and three `kochab mds --store` "hosts" (each its own local directory, its own
//! copy of the key, its own coordinator replica) that share nothing but the bucket. Both
//! serve creates and renames across servers, move a table (or borrow one), ride out a
//! SIGKILLed server whose tables are served again by the others, lose nothing acknowledged,
//! and leave a store that `kochab fsck --store` finds clean with every inode there.
//!
//! Needs a running RGW: `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)` names its env file
//! (endpoint, keys, bucket). Without it these tests say so and pass without running.

mod common;

use common::{ServerProc, kochab_bin, runtime};
use kochab_client::{Client, ClientConfig};
use kochab_proto::{Credentials, InodeId};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The RGW the tests run against: its env file and bucket.
struct Rgw {
    env_file: PathBuf,
    bucket: String,
}

impl Rgw {
    /// `None` (the test is skipped, with a message) without KOCHAB_S3_ENV.
    fn get() -> Option<Rgw> {
        let Some(env_file) = std::env::var_os("KOCHAB_S3_ENV").map(PathBuf::from) else {
            eprintln!(
                "KOCHAB_S3_ENV is not set: skipping the cluster on Ceph RGW \
                 (run with KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up))"
            );
            return None;
        };
        let text = std::fs::read_to_string(&env_file).expect("the env file");
        let bucket = text
            .lines()
            .find_map(|l| l.strip_prefix("export KOCHAB_S3_BUCKET="))
            .expect("KOCHAB_S3_BUCKET in the env file")
            .to_string();
        Some(Rgw { env_file, bucket })
    }

    /// A prefix of its own for one test run, so tests and runs never see each other's
    /// objects.
    fn url(&self, test: &str) -> String {
        let mut b = [0u8; 6];
        getrandom::fill(&mut b).expect("randomness");
        let tag: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!("s3://{}/t/{test}-{tag}", self.bucket)
    }

    fn store_args<'a>(&'a self, url: &'a str) -> [&'a str; 4] {
        [
            "--store",
            url,
            "--store-env",
            self.env_file.to_str().expect("utf8 path"),
        ]
    }
}

/// `kochab status --json` through `addr` with the key in `key_file`, once it answers as a
/// cluster.
fn status_at(addr: SocketAddr, key_file: &Path) -> Option<serde_json::Value> {
    let out = Command::new(kochab_bin())
        .args(["status", "--json", "--cluster", &addr.to_string()])
        .arg("--key-file")
        .arg(key_file)
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v.get("servers").is_some().then_some(v)
}

/// Server id -> (pid, tables), once `n` servers answer with at least `min` tables each.
fn wait_spread(addr: SocketAddr, key_file: &Path, n: usize, min: usize) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(v) = status_at(addr, key_file) {
            let counts = tables_per_server(&v);
            if counts.len() == n && counts.values().all(|&(_, t)| t >= min) {
                return v;
            }
            last = Some(v);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("tables not spread over {n} servers within 40 s; last status {last:#?}");
}

/// Server id -> (pid, number of tables), by the servers' own reports (those that answer).
fn tables_per_server(v: &serde_json::Value) -> BTreeMap<u64, (i32, usize)> {
    v["servers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| {
                    Some((
                        s["id"].as_u64()?,
                        (s["pid"].as_i64()? as i32, s["tables"].as_array()?.len()),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The server the map says holds `id`'s table.
fn owner_of(v: &serde_json::Value, id: InodeId) -> Option<u64> {
    v["tables"].as_array()?.iter().find_map(|t| {
        let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
        let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
        (lo <= id && id < hi).then(|| t["owner"].as_u64())?
    })
}

async fn names_of(c: &Client, dir: InodeId) -> BTreeSet<String> {
    c.readdir_all(&Credentials::root(), dir, false)
        .await
        .expect("readdir")
        .into_iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .filter(|n| n != "." && n != "..")
        .collect()
}

/// Top-level directories `names`, 10 files in each, a rename inside each and one across
/// two directories of different servers (which borrows a table), a setattr; returns the
/// directories' ids and the inodes the namespace then holds (the root included).
async fn make_tree(c: &Client, v: &serde_json::Value, names: &[&str]) -> (Vec<InodeId>, u64) {
    let cred = Credentials::root();
    let mut dirs = Vec::new();
    for d in names {
        let a = c
            .mkdir(&cred, c.root(), d.as_bytes(), 0o755)
            .await
            .unwrap_or_else(|e| panic!("mkdir {d}: {e}"));
        dirs.push(a.id);
        for f in 0..10 {
            c.create(&cred, a.id, format!("f{f}").as_bytes(), 0o644)
                .await
                .unwrap_or_else(|e| panic!("create {d}/f{f}: {e}"));
        }
        c.rename(&cred, a.id, b"f0", a.id, b"g0", 0)
            .await
            .expect("rename in a directory");
        c.unlink(&cred, a.id, b"f1").await.expect("unlink");
    }
    let homes: BTreeSet<u64> = dirs.iter().filter_map(|&d| owner_of(v, d)).collect();
    assert!(
        homes.len() >= 2,
        "directories on several servers: {homes:?}"
    );
    let a = dirs[0];
    let b = *dirs
        .iter()
        .find(|&&d| owner_of(v, d) != owner_of(v, a))
        .expect("directories on two servers");
    c.rename(&cred, a, b"f2", b, b"moved", 0)
        .await
        .expect("rename across servers");
    assert!(c.lookup(&cred, a, b"f2").await.is_err(), "old name gone");
    let moved = c.lookup(&cred, b, b"moved").await.expect("moved file");
    let set = kochab_proto::SetAttrs {
        mode: Some(0o600),
        ..Default::default()
    };
    let attr = c.setattr(&cred, moved.id, set).await.expect("setattr");
    assert_eq!(attr.mode & 0o777, 0o600);
    // The root, and per directory itself and 9 files.
    (dirs, 1 + names.len() as u64 * 10)
}

/// Creates `n` files `wN` in `dir`, one every 10 ms, while the test kills a server; every
/// create must succeed (the client rides out the failover). Returns the names.
fn spawn_writer(c: &Client, dir: InodeId, n: u32) -> tokio::task::JoinHandle<Vec<String>> {
    let c = c.clone();
    tokio::spawn(async move {
        let mut acked = Vec::new();
        for i in 0..n {
            let name = format!("w{i}");
            c.create(&Credentials::root(), dir, name.as_bytes(), 0o644)
                .await
                .unwrap_or_else(|e| panic!("create {name} failed: {e}"));
            acked.push(name);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        acked
    })
}

/// `kochab fsck --store URL` of a stopped cluster: clean, as a cluster's, with `inodes`.
fn fsck_store_clean(rgw: &Rgw, url: &str, inodes: u64) -> String {
    let out = Command::new(kochab_bin())
        .args(["fsck", "--store", url, "--store-env"])
        .arg(&rgw.env_file)
        .output()
        .expect("run kochab fsck");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "fsck --store: {text}");
    assert!(text.contains("cluster namespace of"), "{text}");
    assert!(text.contains(&format!(" {inodes} inodes")), "{text}");
    assert!(text.contains(": clean"), "{text}");
    text
}

/// Files under `dir` whose path names a journal, a checkpoint, a manifest or the cluster's
/// description: none may be on a host's local directory.
fn durable_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if ["journal", "tables", "servers", "cluster.json", "manifest"]
                .iter()
                .any(|n| name.starts_with(n))
            {
                out.push(p.clone());
            }
            if p.is_dir() {
                todo.push(p);
            }
        }
    }
    out
}

/// `kochab status` shows every server's store: the bucket, and that its engine passed.
fn assert_store_shown(v: &serde_json::Value, url: &str) {
    let servers = v["servers"].as_array().expect("servers");
    for s in servers {
        let store = s["store"].as_str().unwrap_or_default();
        assert!(store.starts_with(url), "{s:#}");
        assert!(store.contains("self-test passed"), "{s:#}");
    }
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// `kochab up --servers 3 --store` on RGW: the cluster is made in the store, its tables
/// spread; creates and renames across servers, a table moved by the operator, a SIGKILLed
/// server whose tables are served again while a client writes; after a clean stop the
/// store alone holds every inode, and fsck finds it clean.
#[test]
fn up_servers_3_on_rgw_serves_moves_and_fails_over() {
    let Some(rgw) = Rgw::get() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let url = rgw.url("up3");
    let mut extra = vec!["--servers", "3", "--lease", "2"];
    extra.extend(rgw.store_args(&url));
    let mut up = ServerProc::start(&data, &extra);
    let key_file = data.join(kochab_server::KEY_FILE);
    let v = wait_spread(up.addr, &key_file, 3, 6);
    assert_store_shown(&v, &url);
    let rt = runtime();
    let names = ["d0", "d1", "d2", "d3", "d4", "d5"];
    let mut inodes = rt.block_on(async {
        let c = up.client(5).await;
        let (_, inodes) = make_tree(&c, &v, &names).await;
        inodes
    });

    // The operator moves a table of the fullest server to the emptiest.
    let v = status_at(up.addr, &key_file).expect("status");
    let counts = tables_per_server(&v);
    let (&from, _) = counts.iter().max_by_key(|(_, c)| c.1).expect("servers");
    let (&to, _) = counts.iter().min_by_key(|(_, c)| c.1).expect("servers");
    let lo = v["tables"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|t| t["owner"].as_u64() == Some(from))
                .and_then(|t| t["lo"].as_str())
        })
        .expect("a table of the fullest server")
        .to_string();
    let out = Command::new(kochab_bin())
        .args([
            "table",
            "move",
            &lo,
            "--to",
            &to.to_string(),
            "--timeout",
            "30",
        ])
        .args(["--cluster", &up.addr.to_string()])
        .arg("--key-file")
        .arg(&key_file)
        .output()
        .expect("kochab table move");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "move: {text}");
    assert!(text.contains(&format!("moved to server {to}")), "{text}");

    // A SIGKILL of the server of a directory a client is writing into.
    let v = status_at(up.addr, &key_file).expect("status");
    rt.block_on(async {
        let c = up.client(20).await;
        let d = c
            .lookup(&Credentials::root(), c.root(), b"d1")
            .await
            .expect("d1")
            .id;
        let victim = owner_of(&v, d).expect("owner of d1");
        let pid = tables_per_server(&v)[&victim].0;
        let writer = spawn_writer(&c, d, 150);
        tokio::time::sleep(Duration::from_millis(400)).await;
        // SAFETY: kill(2) of a server process of this test's cluster.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let acked = writer.await.expect("writer");
        let got = names_of(&c, d).await;
        for name in &acked {
            assert!(got.contains(name), "acknowledged {name} lost");
        }
        inodes += acked.len() as u64;
        eprintln!(
            "server {victim} (pid {pid}) SIGKILLed; {} creates acknowledged",
            acked.len()
        );
    });
    // Its tables are served again: every table placed on a live server.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = status_at(up.addr, &key_file);
        let served = v.as_ref().is_some_and(|v| {
            let counts = tables_per_server(v);
            counts.len() == 3
                && counts.values().all(|&(p, _)| alive(p))
                && counts.values().map(|&(_, t)| t).sum::<usize>() >= 19
        });
        if served {
            break;
        }
        assert!(Instant::now() < deadline, "tables not served again: {v:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }

    assert_eq!(up.stop(), Some(0), "clean stop; log:\n{}", up.log_text());
    fsck_store_clean(&rgw, &url, inodes);
    // Nothing of the metadata is in the local directory: it is all in the store.
    let local = durable_files_under(&data);
    assert!(
        local.is_empty(),
        "metadata in the local directory: {local:?}"
    );
}

/// Children killed with SIGKILL however the test ends.
#[derive(Default)]
struct Procs(Vec<(String, Child, PathBuf)>);

impl Procs {
    /// Spawns `kochab ARGS` (stdout to a pipe read until a line containing `ready`,
    /// stderr to `log`), without waiting.
    fn spawn(&mut self, name: &str, args: &[String], log: &Path) -> std::sync::mpsc::Receiver<()> {
        let mut child = Command::new(kochab_bin())
            .args(args)
            .env("KOCHAB_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("log"))
            .spawn()
            .expect("spawn kochab");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains("ready at") || line.contains("serving at") {
                    let _ = tx.send(());
                }
            }
        });
        self.0.push((name.to_string(), child, log.to_path_buf()));
        rx
    }

    fn wait_ready(&self, name: &str, rx: &std::sync::mpsc::Receiver<()>) {
        if rx.recv_timeout(Duration::from_secs(40)).is_err() {
            let log = self
                .0
                .iter()
                .find(|p| p.0 == name)
                .map(|p| std::fs::read_to_string(&p.2).unwrap_or_default())
                .unwrap_or_default();
            panic!("{name} did not start; log:\n{log}");
        }
    }

    fn pid(&self, name: &str) -> i32 {
        self.0.iter().find(|p| p.0 == name).expect("process").1.id() as i32
    }

    /// SIGTERM to those named `prefix*`, and their exit codes.
    fn stop(&mut self, prefix: &str) -> Vec<(String, Option<i32>)> {
        let mut out = Vec::new();
        for (name, child, _) in self.0.iter_mut().filter(|p| p.0.starts_with(prefix)) {
            if let Ok(Some(_)) = child.try_wait() {
                continue;
            }
            // SAFETY: kill(2) of a child this test spawned and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            out.push((name.clone(), child.wait().ok().and_then(|s| s.code())));
        }
        out
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c, _) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
}

fn s(x: impl ToString) -> String {
    x.to_string()
}

/// Three "hosts" on loopback, each with a directory of its own (its copy of the cluster
/// key, its coordinator replica's log, its metadata server's local directory) and nothing
/// shared but the bucket: the three servers start at once on a new store (one initialises
/// the cluster in it, the others wait), a server given another key is refused, a client
/// creates and renames across servers, a SIGKILLed server's tables are served again by the
/// others with nothing acknowledged lost, the killed server started again on a new
/// directory serves tables again, and the stopped cluster's store is clean.
#[test]
fn three_hosts_share_nothing_but_the_store() {
    let Some(rgw) = Rgw::get() else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let url = rgw.url("hosts3");
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).expect("randomness");
    let hosts: Vec<PathBuf> = (1..=3)
        .map(|h| tmp.path().join(format!("host{h}")))
        .collect();
    for h in &hosts {
        std::fs::create_dir_all(h).expect("host dir");
        let k = h.join("cluster.key");
        std::fs::write(&k, format!("{}\n", kochab_proto::auth::key_to_hex(&key))).expect("key");
        let private = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(&k, private).expect("chmod");
    }
    let coords: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let mds: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = coords
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let coord_list = coords.iter().map(s).collect::<Vec<_>>().join(",");
    let key_of = |h: &Path| h.join("cluster.key").display().to_string();
    let mut procs = Procs::default();
    let mut ready = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let args = vec![
            s("coord"),
            s("--id"),
            s(i + 1),
            s("--listen"),
            s(coords[i]),
            s("--peers"),
            peers.clone(),
            s("--data"),
            h.join("coord").display().to_string(),
            s("--key-file"),
            key_of(h),
            s("--bootstrap"),
            s("--lease"),
            s("2"),
        ];
        let name = format!("coord{}", i + 1);
        ready.push((
            name.clone(),
            procs.spawn(&name, &args, &h.join("coord.log")),
        ));
    }
    let mds_args = |i: usize, key_file: String| {
        let mut a = vec![
            s("mds"),
            s("--id"),
            s(i + 2),
            s("--listen"),
            s(mds[i]),
            s("--coord"),
            coord_list.clone(),
            s("--key-file"),
            key_file,
            s("--data"),
            hosts[i].join("local").display().to_string(),
        ];
        a.extend(rgw.store_args(&url).iter().map(s));
        a
    };
    // The three servers start at once on the new store.
    for (i, h) in hosts.iter().enumerate() {
        let name = format!("mds{}", i + 2);
        ready.push((
            name.clone(),
            procs.spawn(&name, &mds_args(i, key_of(h)), &h.join("mds.log")),
        ));
    }
    for (name, rx) in &ready {
        procs.wait_ready(name, rx);
    }
    let inits: usize = hosts
        .iter()
        .map(|h| std::fs::read_to_string(h.join("mds.log")).unwrap_or_default())
        .filter(|l| l.contains("initialises the cluster in"))
        .count();
    assert_eq!(inits, 1, "one server initialised the store");

    // A fourth server with a key of its own is refused by what the store records.
    let other = tmp.path().join("other.key");
    let mut k2 = [0u8; 32];
    getrandom::fill(&mut k2).expect("randomness");
    std::fs::write(&other, format!("{}\n", kochab_proto::auth::key_to_hex(&k2))).expect("key");
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let mut bad = mds_args(0, other.display().to_string());
    bad[2] = s(9);
    bad[4] = s(free_addr());
    bad[10] = tmp.path().join("other-local").display().to_string();
    let out = Command::new(kochab_bin()).args(&bad).output().expect("mds");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("not the key of the cluster"), "{err}");

    let key_file = hosts[0].join("cluster.key");
    let v = wait_spread(mds[0], &key_file, 3, 6);
    assert_store_shown(&v, &url);
    let rt = runtime();
    let names = ["e0", "e1", "e2", "e3", "e4", "e5"];
    let (inodes, survivor, victim) = rt.block_on(async {
        let mut cfg = ClientConfig::with_entries(mds.clone(), key);
        cfg.attempts = 20;
        cfg.request_timeout = Duration::from_secs(10);
        let c = Client::connect(cfg).await.expect("connect");
        let (dirs, mut inodes) = make_tree(&c, &v, &names).await;
        // The server of e1 is SIGKILLed while the client writes into e1.
        let victim = owner_of(&v, dirs[1]).expect("owner of e1");
        let writer = spawn_writer(&c, dirs[1], 150);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let pid = procs.pid(&format!("mds{victim}"));
        // SAFETY: kill(2) of a server process this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let acked = writer.await.expect("writer");
        let got = names_of(&c, dirs[1]).await;
        for name in &acked {
            assert!(got.contains(name), "acknowledged {name} lost");
        }
        inodes += acked.len() as u64;
        let survivor = mds
            .iter()
            .enumerate()
            .find(|(i, _)| *i as u64 + 2 != victim)
            .map(|(_, a)| *a)
            .expect("a survivor");
        (inodes, survivor, victim)
    });
    // The two left serve every table.
    let v = wait_spread(survivor, &key_file, 2, 9);
    assert!(
        tables_per_server(&v).keys().all(|&id| id != victim),
        "the killed server serves nothing: {v:#}"
    );

    // The killed server starts again on a directory it never had (as on a new host): a
    // new incarnation, and the balancer gives it tables again, loaded from the store.
    let i = (victim - 2) as usize;
    let mut again = mds_args(i, key_of(&hosts[i]));
    again[10] = hosts[i].join("local-new").display().to_string();
    let name = format!("mds{victim}-again");
    let rx = procs.spawn(&name, &again, &hosts[i].join("mds-again.log"));
    procs.wait_ready(&name, &rx);
    let v = wait_spread(survivor, &key_file, 3, 3);
    let epoch = v["servers"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"].as_u64() == Some(victim)))
        .and_then(|s| s["epoch"].as_u64());
    assert!(epoch.is_some_and(|e| e > 1), "a new incarnation: {v:#}");

    for (name, code) in procs.stop("mds") {
        assert_eq!(code, Some(0), "{name} stopped cleanly");
    }
    procs.stop("coord");
    fsck_store_clean(&rgw, &url, inodes);
    for h in &hosts {
        let local = durable_files_under(h);
        assert!(local.is_empty(), "metadata on {}: {local:?}", h.display());
    }
}
