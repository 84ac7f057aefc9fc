//! `kochab up --servers N`: a coordinator and N metadata server processes serving one
//! namespace; a server killed or paused past its lease is replaced and clients ride it out.

mod common;

use common::{ServerProc, offline_fsck_clean, runtime, status};
use kochab_client::Client;
use kochab_proto::{Credentials, InodeId};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// Server id -> (pid, number of tables), once every server answers and the tables are
/// spread evenly (each holds at least `min_tables`). Panics with the log after 90 s.
fn wait_spread(server: &ServerProc, n: usize, min_tables: usize) -> BTreeMap<u64, (i32, usize)> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(v) = status(server) {
            let servers = v["servers"].as_array().cloned().unwrap_or_default();
            let got: BTreeMap<u64, (i32, usize)> = servers
                .iter()
                .filter_map(|s| {
                    Some((
                        s["id"].as_u64()?,
                        (s["pid"].as_i64()? as i32, s["tables"].as_array()?.len()),
                    ))
                })
                .collect();
            if got.len() == n && got.values().all(|&(_, t)| t >= min_tables) {
                return got;
            }
            last = Some(v);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!(
        "tables not spread over {n} servers within 90 s; last status {last:#?}\nlog:\n{}",
        server.log_text()
    );
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a server process this test's cluster started.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The server that holds `id`'s table, by the cluster's status.
fn owner_of(server: &ServerProc, id: InodeId) -> Option<(u64, i32)> {
    let v = status(server)?;
    let owner = v["tables"].as_array()?.iter().find_map(|t| {
        let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
        let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
        (lo <= id && id < hi).then(|| t["owner"].as_u64())?
    })?;
    let pid = v["servers"]
        .as_array()?
        .iter()
        .find(|s| s["id"].as_u64() == Some(owner))?["pid"]
        .as_i64()? as i32;
    Some((owner, pid))
}

/// The address server `id` serves on, by the cluster's status.
fn addr_of(server: &ServerProc, id: u64) -> Option<std::net::SocketAddr> {
    let v = status(server)?;
    v["servers"]
        .as_array()?
        .iter()
        .find(|s| s["id"].as_u64() == Some(id))?["addr"]
        .as_str()?
        .parse()
        .ok()
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

fn start(dir: &Path, servers: &str) -> ServerProc {
    ServerProc::start(&dir.join("data"), &["--servers", servers, "--lease", "2"])
}

/// Like `start`, with the store's crash simulation on (a power loss takes what a server
/// had not synced: see `common::power_loss_of`).
fn start_crash_sim(dir: &Path, servers: &str) -> ServerProc {
    ServerProc::start_env(
        &dir.join("data"),
        "0",
        &["--servers", servers, "--lease", "2"],
        &common::CRASH_SIM,
    )
}

/// A new cluster of `n` servers, its tables spread, whose root holds the directories
/// `dirs` (dealt across the tables, so across the servers: a mkdir whose slot is on
/// another server borrows its table).
fn start_with_dirs(dir: &Path, n: usize, dirs: &[&str]) -> ServerProc {
    with_dirs(start(dir, &n.to_string()), n, dirs)
}

fn with_dirs(server: ServerProc, n: usize, dirs: &[&str]) -> ServerProc {
    wait_spread(&server, n, 19 / n);
    runtime().block_on(async {
        let c = server.client(3).await;
        for d in dirs {
            c.mkdir(&Credentials::root(), c.root(), d.as_bytes(), 0o755)
                .await
                .unwrap_or_else(|e| panic!("mkdir {d}: {e}"));
        }
    });
    server
}

/// The first of `dirs` and one of them whose table another server holds.
fn dirs_on_two_servers(server: &ServerProc, dirs: &[InodeId]) -> (InodeId, InodeId) {
    let owner = |id| owner_of(server, id).expect("owner").0;
    let a = dirs[0];
    let b = *dirs
        .iter()
        .find(|&&d| owner(d) != owner(a))
        .expect("directories on both servers");
    (a, b)
}

async fn dir_ids(c: &Client, names: &[&str]) -> Vec<InodeId> {
    let mut out = Vec::new();
    for d in names {
        out.push(
            c.lookup(&Credentials::root(), c.root(), d.as_bytes())
                .await
                .unwrap_or_else(|e| panic!("lookup {d}: {e}"))
                .id,
        );
    }
    out
}

#[test]
fn three_server_processes_serve_one_namespace_and_spread_its_tables() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["d0", "d1", "d2", "d3", "d4", "d5"];
    let server = start_with_dirs(dir.path(), 3, &names);
    // 19 tables over 3 servers: 6, 6 and 7.
    let spread = wait_spread(&server, 3, 6);
    let pids: BTreeSet<i32> = spread.values().map(|&(p, _)| p).collect();
    assert_eq!(pids.len(), 3, "each server its own process: {spread:?}");
    assert!(pids.iter().all(|&p| alive(p)));
    let rt = runtime();
    rt.block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        let dirs = dir_ids(&c, &names).await;
        // The entry server is not the root's: every request is routed by the map.
        let (root_owner, _) = owner_of(&server, c.root()).expect("root's owner");
        assert_ne!(root_owner, 2, "the root's table moved off the first server");
        // Top-level directories made on the running cluster are spread over its servers.
        let homes: BTreeSet<u64> = dirs
            .iter()
            .filter_map(|&d| owner_of(&server, d).map(|o| o.0))
            .collect();
        assert_eq!(homes.len(), 3, "six top-level directories on three servers");
        for (i, &d) in dirs.iter().enumerate() {
            for f in 0..30 {
                c.create(&cred, d, format!("f{f}").as_bytes(), 0o644)
                    .await
                    .unwrap_or_else(|e| panic!("create d{i}/f{f}: {e}"));
            }
            c.mkdir(&cred, d, b"sub", 0o755).await.expect("mkdir below");
        }
        for (i, &d) in dirs.iter().enumerate() {
            let got = names_of(&c, d).await;
            assert_eq!(got.len(), 31, "d{i}: {got:?}");
            let a = c.lookup(&cred, d, b"f7").await.expect("lookup");
            c.getattr(&cred, a.id).await.expect("getattr");
            c.rename(&cred, d, b"f0", d, b"g0", 0)
                .await
                .expect("rename in a directory");
            c.unlink(&cred, d, b"f1").await.expect("unlink");
        }
        let top = names_of(&c, c.root()).await;
        assert_eq!(top, names.iter().map(|s| s.to_string()).collect());
        // statfs counts the inodes of every server: the root, 6 directories with 30
        // files (one unlinked) and a subdirectory each.
        let st = c.statfs(&cred).await.expect("statfs");
        assert_eq!(st.files - st.ffree, 1 + 6 * (1 + 29 + 1));
    });
}

#[test]
fn a_killed_server_is_replaced_and_its_clients_ride_it_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = with_dirs(start_crash_sim(dir.path(), "2"), 2, &["work"]);
    let store = server.data.join("store");
    let rt = runtime();
    rt.block_on(async {
        let c = server.client(3).await;
        let d = dir_ids(&c, &["work"]).await[0];
        let (victim, pid) = owner_of(&server, d).expect("owner of the directory");
        let writer = {
            let c = c.clone();
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut longest = Duration::ZERO;
                let mut last = Instant::now();
                for i in 0..400u32 {
                    let name = format!("f{i}");
                    match c
                        .create(&Credentials::root(), d, name.as_bytes(), 0o644)
                        .await
                    {
                        Ok(_) => {
                            longest = longest.max(last.elapsed());
                            last = Instant::now();
                            acked.push(name);
                        }
                        Err(e) => panic!("create {name} failed: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (acked, longest)
            })
        };
        tokio::time::sleep(Duration::from_millis(800)).await;
        // A power loss of the owner's machine: what it had not synced is gone, torn.
        let lost = tokio::task::block_in_place(|| {
            common::power_loss_of(&store, pid, common::Loss::Tear { seed: 1 })
        });
        let (acked, longest) = writer.await.expect("writer");
        eprintln!(
            "server {victim} lost power ({lost:?}); longest pause between acknowledged \
             creates {longest:?}"
        );
        assert!(
            longest < Duration::from_secs(20),
            "clients did not ride out the failover: {longest:?}"
        );
        let got = names_of(&c, d).await;
        for name in &acked {
            assert!(got.contains(name), "acknowledged {name} lost");
        }
        assert_eq!(got.len(), acked.len());
    });
    // The killed server comes back as a new process (a new incarnation).
    let spread = wait_spread(&server, 2, 1);
    assert!(spread.values().all(|&(p, _)| alive(p)));
}

#[test]
fn a_server_paused_past_its_lease_never_serves_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start_with_dirs(dir.path(), 2, &["work"]);
    let rt = runtime();
    rt.block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        let d = dir_ids(&c, &["work"]).await[0];
        let (owner, pid) = owner_of(&server, d).expect("owner");
        c.create(&cred, d, b"before", 0o644).await.expect("create");
        // A raw connection to the owner, made while it serves: a request is written to it
        // while it is stopped and must find no answer when it resumes.
        let addr = addr_of(&server, owner).expect("the owner's address");
        let mut held = common::RawConn::connect(addr, &server.key, 0xfe).expect("raw connection");
        common::stop_process(pid);
        let stopped = Instant::now();
        let fenced = |n: u64| {
            kochab_proto::Request::plain(
                &Credentials::root(),
                kochab_proto::Op::Mknod {
                    parent: d,
                    name: format!("fenced{n}").into_bytes(),
                    mode: 0o100644,
                    rdev: 0,
                    exclusive: true,
                },
            )
        };
        // Written first, so that it is the first request the server reads on resuming.
        held.send(1, &fenced(0))
            .expect("request to the stopped server");
        // Past the 2 s lease: the coordinator fences it and another server recovers its
        // tables; the client follows.
        c.create(&cred, d, b"during", 0o644)
            .await
            .expect("create while the owner is stopped");
        // Stopped for well past its lease whatever the create took (it is quick if a
        // borrow had the table elsewhere when the status was read).
        let paused = Duration::from_secs(4);
        tokio::time::sleep(paused.saturating_sub(stopped.elapsed())).await;
        // Resumed, it finds its lease over: it must not serve or acknowledge, whoever asks;
        // it stops and is restarted as a new incarnation.
        let refused = tokio::task::block_in_place(|| {
            common::resume_and_probe_fenced(
                pid,
                addr,
                &server.key,
                held,
                fenced,
                || !alive(pid),
                Duration::from_secs(15),
            )
        });
        eprintln!("the fenced server refused {refused} requests before it exited");
        c.create(&cred, d, b"after", 0o644).await.expect("create");
        let got = names_of(&c, d).await;
        assert_eq!(
            got,
            ["after", "before", "during"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            "a request to the fenced server made a name"
        );
    });
    let log = server.log_text();
    assert!(log.contains("exited"), "the supervisor saw it go:\n{log}");
}

#[test]
fn a_cluster_restarted_with_more_servers_serves_what_one_server_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["t0", "t1", "t2", "t3"];
    let mut one = start(dir.path(), "1");
    runtime().block_on(async {
        let c = one.client(3).await;
        let cred = Credentials::root();
        for d in names {
            // One server holds every table: top-level directories are dealt across them.
            let a = c
                .mkdir(&cred, c.root(), d.as_bytes(), 0o755)
                .await
                .expect("mkdir");
            c.create(&cred, a.id, b"kept", 0o644).await.expect("create");
        }
    });
    assert_eq!(one.stop(), Some(0), "clean stop; log:\n{}", one.log_text());
    drop(one);
    let server = start(dir.path(), "2");
    wait_spread(&server, 2, 9);
    runtime().block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        // The root's entries name directories whose inodes another server may hold: the
        // lookup is answered with the id and the attributes come from its owner.
        let dirs = dir_ids(&c, &names).await;
        let owners: BTreeSet<u64> = dirs
            .iter()
            .filter_map(|&d| owner_of(&server, d).map(|o| o.0))
            .collect();
        assert_eq!(owners.len(), 2, "the directories are on both servers");
        for (i, &d) in dirs.iter().enumerate() {
            c.lookup(&cred, d, b"kept")
                .await
                .expect("a file made before the restart");
            c.create(&cred, d, b"new", 0o644).await.expect("create");
            assert_eq!(names_of(&c, d).await.len(), 2, "t{i}");
        }
    });
}

/// Operations whose inodes lie on two servers borrow every table they need and run as one
/// record: a rename and a link between directories of different servers, a directory moved
/// between them (with its subtree check), an rmdir whose directory's inode is not on the
/// root's server. The servers' fsck finds their tables consistent afterwards.
#[test]
fn operations_across_servers_borrow_the_tables_they_need() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["t0", "t1", "t2", "t3", "t4", "t5"];
    let mut one = start(dir.path(), "1");
    runtime().block_on(async {
        let c = one.client(3).await;
        for d in names {
            c.mkdir(&Credentials::root(), c.root(), d.as_bytes(), 0o755)
                .await
                .expect("mkdir");
        }
    });
    assert_eq!(one.stop(), Some(0), "clean stop; log:\n{}", one.log_text());
    drop(one);
    let server = start(dir.path(), "2");
    wait_spread(&server, 2, 9);
    runtime().block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        let dirs = dir_ids(&c, &names).await;
        let owner = |id| owner_of(&server, id).expect("owner").0;
        let root_owner = owner(c.root());
        let a = dirs[0];
        let b = *dirs
            .iter()
            .find(|&&d| owner(d) != owner(a))
            .expect("directories on both servers");
        let log = || server.log_text();

        c.create(&cred, a, b"f", 0o644).await.expect("create");
        c.rename(&cred, a, b"f", b, b"f", 0)
            .await
            .unwrap_or_else(|e| panic!("rename across servers: {e}\n{}", log()));
        let f = c.lookup(&cred, b, b"f").await.expect("moved file");
        assert!(c.lookup(&cred, a, b"f").await.is_err(), "old name gone");
        c.link(&cred, f.id, a, b"l")
            .await
            .unwrap_or_else(|e| panic!("link across servers: {e}\n{}", log()));
        assert_eq!(c.getattr(&cred, f.id).await.expect("stat").nlink, 2);

        let sub = c.mkdir(&cred, a, b"sub", 0o755).await.expect("mkdir");
        c.create(&cred, sub.id, b"x", 0o644)
            .await
            .expect("create below");
        c.rename(&cred, a, b"sub", b, b"sub", 0)
            .await
            .unwrap_or_else(|e| panic!("directory across servers: {e}\n{}", log()));
        let moved = c.lookup(&cred, b, b"sub").await.expect("moved directory");
        assert_eq!(moved.id, sub.id);
        c.lookup(&cred, moved.id, b"x").await.expect("its entry");
        assert_eq!(c.getattr(&cred, a).await.expect("stat a").nlink, 2);
        assert_eq!(c.getattr(&cred, b).await.expect("stat b").nlink, 3);
        // Into its own subtree, across servers: refused by the subtree check.
        let e = c
            .rename(&cred, b, b"sub", moved.id, b"loop", 0)
            .await
            .expect_err("a directory into itself");
        assert_eq!(e.errno, kochab_proto::Errno::EINVAL, "{e}");

        // A file open at its server and replaced by a rename from the other server (which
        // borrows its table): it lives on until closed, as on one server.
        let (_, h) = c
            .create_open(&cred, b, b"open", 0o644, libc::O_RDWR as u32)
            .await
            .expect("create and open");
        c.write(&cred, h, 0, b"still here".to_vec())
            .await
            .expect("write");
        c.create(&cred, a, b"new", 0o644).await.expect("create");
        c.rename(&cred, a, b"new", b, b"open", 0)
            .await
            .unwrap_or_else(|e| panic!("rename over an open file: {e}\n{}", log()));
        assert_eq!(
            c.read(&cred, h, 0, 64)
                .await
                .expect("read the replaced file"),
            b"still here"
        );
        c.close(&cred, h).await.expect("close");

        c.unlink(&cred, a, b"l").await.expect("unlink the link");
        assert_eq!(c.getattr(&cred, f.id).await.expect("stat").nlink, 1);
        // An empty top-level directory whose inode is not on the root's server.
        let (name, _) = names
            .iter()
            .zip(&dirs)
            .find(|(_, d)| owner(**d) != root_owner && **d != a && **d != b)
            .expect("an empty directory away from the root's server");
        c.rmdir(&cred, c.root(), name.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("rmdir across servers: {e}\n{}", log()));
        assert!(c.lookup(&cred, c.root(), name.as_bytes()).await.is_err());
        assert_eq!(names_of(&c, c.root()).await.len(), names.len() - 1);
        let problems = c.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
    });
}

/// The owner of each of `ids`, by one status of the cluster.
fn owners(server: &ServerProc, ids: &[InodeId]) -> Option<Vec<u64>> {
    let v = status(server)?;
    let tables = v["tables"].as_array()?;
    ids.iter()
        .map(|&id| {
            tables.iter().find_map(|t| {
                let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
                let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
                (lo <= id && id < hi).then(|| t["owner"].as_u64())?
            })
        })
        .collect()
}

/// `kochab fsck` of the cluster while its tables stay where they are (the balancer may
/// move them between two runs): its success, its output, and which of the names `names`
/// ((directory, inode) pairs) cross servers by the placement it ran under.
fn fsck_placed(server: &ServerProc, names: &[(InodeId, InodeId)]) -> (bool, String, Vec<bool>) {
    let ids: Vec<InodeId> = names.iter().flat_map(|&(d, c)| [d, c]).collect();
    for _ in 0..20 {
        let before = owners(server, &ids);
        let started = Instant::now();
        let out = std::process::Command::new(common::kochab_bin())
            .args(["fsck", "--cluster", &server.addr.to_string()])
            .arg("--key-file")
            .arg(server.data.join("cluster.key"))
            .output()
            .expect("run kochab fsck");
        let took = started.elapsed();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        match (before, owners(server, &ids)) {
            (Some(b), Some(a)) if a == b => {
                eprintln!("kochab fsck took {took:?}:\n{text}");
                let crossing = b.chunks(2).map(|p| p[0] != p[1]).collect();
                return (out.status.success(), text, crossing);
            }
            _ => std::thread::sleep(Duration::from_millis(500)),
        }
    }
    panic!("tables kept moving during 20 runs of kochab fsck");
}

/// Cross entries the online check gathered: `(N entries,` of its clean line.
fn cross_entries(out: &str) -> usize {
    let at = out
        .find("links across servers (")
        .expect("cross-server line")
        + 22;
    out[at..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no entry count: {out}"))
}

/// `kochab fsck` of a running two-server cluster whose names cross servers (files moved
/// and hard-linked between directories of different servers, directories moved both
/// ways, a symlink moved across) checks the links between the servers' tables, gathers
/// exactly the names that cross and finds them consistent; after the cross names are
/// removed again it is clean as well.
#[test]
fn fsck_of_a_running_cluster_checks_links_across_servers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["t0", "t1", "t2", "t3"];
    let server = start_with_dirs(dir.path(), 2, &names);
    let rt = runtime();
    let c = rt.block_on(server.client(3));
    let cred = Credentials::root();
    let root = c.root();
    let dirs = rt.block_on(dir_ids(&c, &names));
    let top: Vec<(InodeId, InodeId)> = dirs.iter().map(|&d| (root, d)).collect();
    let count = |v: &[bool]| v.iter().filter(|&&x| x).count();
    let (ok, out, crossing) = fsck_placed(&server, &top);
    assert!(ok, "fsck of the new cluster: {out}");
    assert_eq!(cross_entries(&out), count(&crossing), "{out}");

    let (a, b) = dirs_on_two_servers(&server, &dirs);
    let log = || server.log_text();
    let made = rt.block_on(async {
        // A file of a's table, named in b twice and in a once.
        c.create(&cred, a, b"f", 0o644).await.expect("create");
        c.rename(&cred, a, b"f", b, b"f", 0)
            .await
            .unwrap_or_else(|e| panic!("rename across servers: {e}\n{}", log()));
        let f = c.lookup(&cred, b, b"f").await.expect("moved file").id;
        c.link(&cred, f, b, b"again").await.expect("link");
        c.link(&cred, f, a, b"home").await.expect("link at home");
        // Directories both ways, with something below them.
        let sub = c.mkdir(&cred, a, b"sub", 0o755).await.expect("mkdir").id;
        let deeper = c
            .mkdir(&cred, sub, b"deeper", 0o755)
            .await
            .expect("mkdir")
            .id;
        c.create(&cred, deeper, b"x", 0o644).await.expect("create");
        c.rename(&cred, a, b"sub", b, b"sub", 0)
            .await
            .unwrap_or_else(|e| panic!("directory across servers: {e}\n{}", log()));
        let back = c.mkdir(&cred, b, b"back", 0o755).await.expect("mkdir").id;
        c.rename(&cred, b, b"back", a, b"back", 0)
            .await
            .unwrap_or_else(|e| panic!("directory back across: {e}\n{}", log()));
        let s = c.symlink(&cred, b, b"s", b"f").await.expect("symlink").id;
        c.rename(&cred, b, b"s", a, b"s", 0)
            .await
            .unwrap_or_else(|e| panic!("symlink across servers: {e}\n{}", log()));
        vec![(b, f), (b, f), (a, f), (b, sub), (a, back), (a, s)]
    });
    let all: Vec<(InodeId, InodeId)> = top.iter().chain(&made).copied().collect();
    // The balancer may have put a's and b's tables together since (by load); then b's
    // table is moved away by hand, so that the check sees names cross.
    let mut tries = 0;
    let (ok, out, crossing) = loop {
        let (ok, out, crossing) = fsck_placed(&server, &all);
        tries += 1;
        if count(&crossing[top.len()..]) > 0 || tries == 5 {
            break (ok, out, crossing);
        }
        let (with_a, _) = owner_of(&server, a).expect("owner");
        let other = owners(&server, &dirs)
            .expect("owners")
            .into_iter()
            .chain([2, 3])
            .find(|&s| s != with_a)
            .expect("another server");
        let table = status(&server).expect("status")["tables"]
            .as_array()
            .expect("tables")
            .iter()
            .find_map(|t| {
                let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
                let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
                (lo <= b && b < hi).then(|| t["lo"].as_str().map(str::to_string))?
            })
            .expect("b's table");
        let moved = std::process::Command::new(common::kochab_bin())
            .args(["table", "move", &table, "--to", &other.to_string()])
            .args(["--timeout", "60", "--cluster", &server.addr.to_string()])
            .arg("--key-file")
            .arg(server.data.join("cluster.key"))
            .output()
            .expect("kochab table move");
        // The balancer may be moving that table right now: look again once it is done.
        if String::from_utf8_lossy(&moved.stderr).contains("is already moving") {
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        assert!(moved.status.success(), "move: {moved:?}");
    };
    assert!(ok, "fsck with names across servers: {out}");
    assert!(
        !out.contains("across servers:"),
        "no cross-server problem: {out}"
    );
    assert_eq!(cross_entries(&out), count(&crossing), "{out}");
    assert!(
        count(&crossing[top.len()..]) > 0,
        "names cross servers: {out}"
    );

    rt.block_on(async {
        for (d, n) in [(b, "f"), (b, "again"), (a, "s")] {
            c.unlink(&cred, d, n.as_bytes()).await.expect("unlink");
        }
        let sub = c.lookup(&cred, b, b"sub").await.expect("sub").id;
        let deeper = c.lookup(&cred, sub, b"deeper").await.expect("deeper").id;
        c.unlink(&cred, deeper, b"x").await.expect("unlink");
        c.rmdir(&cred, sub, b"deeper").await.expect("rmdir");
        c.rmdir(&cred, b, b"sub").await.expect("rmdir across");
        c.rmdir(&cred, a, b"back").await.expect("rmdir across");
    });
    let (ok, out, crossing) = fsck_placed(&server, &top);
    assert!(ok, "fsck after removing the cross names: {out}");
    assert_eq!(cross_entries(&out), count(&crossing), "{out}");
}

/// A borrowed table goes back and forth by deltas (only the boxes it changed) and comes
/// back to a server that kept its copy; after many round trips both ways, a SIGKILL of
/// everything and a restart that loads every table from the store alone serve exactly the
/// same names, and an offline fsck is clean.
#[test]
fn tables_borrowed_many_times_reload_exactly_from_their_deltas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["t0", "t1", "t2", "t3", "t4", "t5"];
    let mut server = start_with_dirs(dir.path(), 2, &names);
    let before = runtime().block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        let dirs = dir_ids(&c, &names).await;
        let (a, b) = dirs_on_two_servers(&server, &dirs);
        for i in 0..40 {
            let f = format!("f{i}");
            c.create(&cred, a, f.as_bytes(), 0o644)
                .await
                .expect("create");
            c.rename(&cred, a, f.as_bytes(), b, format!("g{i}").as_bytes(), 0)
                .await
                .unwrap_or_else(|e| panic!("rename {i} a->b: {e}\n{}", server.log_text()));
            c.create(&cred, b, format!("k{i}").as_bytes(), 0o644)
                .await
                .expect("create in b");
            if i % 3 == 0 {
                c.rename(
                    &cred,
                    b,
                    format!("g{i}").as_bytes(),
                    a,
                    format!("h{i}").as_bytes(),
                    0,
                )
                .await
                .unwrap_or_else(|e| panic!("rename {i} b->a: {e}\n{}", server.log_text()));
            }
        }
        let problems = c.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
        let logs: String = ["mds-2.log", "mds-3.log"]
            .iter()
            .map(|f| {
                std::fs::read_to_string(dir.path().join("data/logs").join(f)).unwrap_or_default()
            })
            .collect();
        assert!(
            logs.contains("from the copy kept since its release"),
            "no returning table was loaded from its kept copy:\n{logs}"
        );
        (a, b, names_of(&c, a).await, names_of(&c, b).await)
    });
    assert_eq!(before.2.len(), 14, "{:?}", before.2);
    assert_eq!(before.3.len(), 40 + 26, "{:?}", before.3);
    let pids: Vec<i32> = wait_spread(&server, 2, 1)
        .values()
        .map(|&(p, _)| p)
        .collect();
    server.kill9();
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    offline_fsck_clean(&dir.path().join("data"), "after SIGKILL");
    let server = start(dir.path(), "2");
    wait_spread(&server, 2, 19 / 2);
    runtime().block_on(async {
        let c = server.client(3).await;
        assert_eq!(names_of(&c, before.0).await, before.2, "a after restart");
        assert_eq!(names_of(&c, before.1).await, before.3, "b after restart");
    });
}

/// Load balancing in real processes: two busy top-level directories whose tables one
/// server holds end up on different servers (the coordinator's load rule, with a low gap
/// for the test), while the client keeps creating files in them without an error.
#[test]
fn a_busy_server_hands_a_busy_table_to_an_idle_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["t0", "t1", "t2", "t3", "t4", "t5"];
    let server = ServerProc::start(
        &dir.path().join("data"),
        &["--servers", "2", "--lease", "2", "--load-gap-ops", "100"],
    );
    wait_spread(&server, 2, 19 / 2);
    runtime().block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        for d in names {
            c.mkdir(&cred, c.root(), d.as_bytes(), 0o755)
                .await
                .unwrap_or_else(|e| panic!("mkdir {d}: {e}"));
        }
        let dirs = dir_ids(&c, &names).await;
        let owner = |id| owner_of(&server, id).expect("owner").0;
        let (a, b) = dirs
            .iter()
            .enumerate()
            .find_map(|(i, &x)| {
                dirs[i + 1..]
                    .iter()
                    .find(|&&y| owner(y) == owner(x))
                    .map(|&y| (x, y))
            })
            .expect("two directories on one server");
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut made = 0u64;
        while owner(a) == owner(b) {
            assert!(
                Instant::now() < deadline,
                "still on one server after 90 s and {made} creates; status {:#?}",
                status(&server)
            );
            for _ in 0..50 {
                for d in [a, b] {
                    c.create(&cred, d, format!("f{made}").as_bytes(), 0o644)
                        .await
                        .unwrap_or_else(|e| panic!("create {made}: {e}"));
                }
                made += 1;
            }
        }
        assert_eq!(names_of(&c, a).await.len() as u64, made);
        assert_eq!(names_of(&c, b).await.len() as u64, made);
    });
}

/// Through the FUSE mount of a two-server cluster, as a user would: top-level directories
/// land on both servers, `ls -l` lists entries whose inodes the other server holds, and
/// `mv` and `ln` between directories of different servers work and keep the counts exact.
#[test]
fn the_mount_of_two_servers_lists_moves_and_links_across_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = common::Cluster::start(dir.path(), &["--servers", "2", "--lease", "2"]);
    wait_spread(&cluster.server, 2, 9);
    let m = &cluster.mnt;
    let names: Vec<String> = (0..6).map(|i| format!("top{i}")).collect();
    for n in &names {
        std::fs::create_dir(m.join(n)).expect("mkdir");
        std::fs::write(m.join(n).join("file"), n.as_bytes()).expect("write");
    }
    let owners: BTreeSet<u64> = names
        .iter()
        .filter_map(|n| {
            use std::os::unix::fs::MetadataExt;
            let ino = std::fs::metadata(m.join(n)).expect("stat").ino();
            owner_of(&cluster.server, kochab_fuse::id_of_ino(ino)).map(|o| o.0)
        })
        .collect();
    assert_eq!(owners.len(), 2, "top-level directories on both servers");
    // `ls -l` of the root: every directory listed, with attributes.
    let mut listed: Vec<String> = std::fs::read_dir(m)
        .expect("readdir")
        .map(|e| {
            let e = e.expect("entry");
            assert!(e.metadata().expect("attributes").is_dir());
            e.file_name().to_string_lossy().into_owned()
        })
        .collect();
    listed.sort();
    assert_eq!(listed, names);
    // Every file into top0, and top1 below top0, whichever servers they are on.
    for n in &names[1..] {
        std::fs::rename(m.join(n).join("file"), m.join("top0").join(n))
            .unwrap_or_else(|e| panic!("mv {n}/file: {e}\n{}", cluster.server.log_text()));
        std::fs::hard_link(m.join("top0").join(n), m.join(n).join("link")).expect("ln");
    }
    std::fs::rename(m.join("top1"), m.join("top0").join("moved")).expect("mv a directory");
    for n in &names[1..] {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(m.join("top0").join(n)).expect("stat moved file");
        assert_eq!(meta.nlink(), 2, "{n}");
        assert_eq!(
            std::fs::read(m.join("top0").join(n)).expect("read"),
            n.as_bytes()
        );
    }
    assert_eq!(
        std::fs::read(m.join("top0/moved/link")).expect("read through the moved directory"),
        b"top1"
    );
    let listed = std::fs::read_dir(m.join("top0")).expect("readdir").count();
    assert_eq!(
        listed,
        1 + 5 + 1,
        "file, five moved files, the moved directory"
    );
    std::fs::remove_dir_all(m.join("top0")).expect("rm -r across servers");
    for n in &names[2..] {
        std::fs::remove_dir_all(m.join(n)).expect("rm -r");
    }
    assert_eq!(std::fs::read_dir(m).expect("readdir").count(), 0);
}

/// Early replies over a failover: the mount's creates in a directory whose server loses
/// power before its (slowed) journal held them are replayed to the server that recovers
/// its tables; none is lost. The window is proven open at the crash: the durable
/// namespace then held fewer inodes than the mount had acknowledged.
#[test]
fn a_failover_replays_what_the_mount_had_acknowledged_early() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = ServerProc::start_env(
        &data,
        "0",
        &["--servers", "2", "--lease", "2"],
        // Each flush held for 1 s: at least the last creates are not durable at the crash.
        &[("KOCHAB_JOURNAL_DELAY_MS", "1000"), common::CRASH_SIM[0]],
    );
    wait_spread(&server, 2, 19 / 2);
    let mount = common::MountProc::start(
        server.addr,
        &data.join("cluster.key"),
        &dir.path().join("m"),
    );
    let work = mount.mnt.join("work");
    std::fs::create_dir(&work).expect("mkdir");
    std::fs::File::open(&work)
        .and_then(|d| d.sync_all())
        .expect("fsync of the directory");
    let id = kochab_fuse::id_of_ino(std::fs::metadata(&work).expect("stat").ino());
    let (victim, pid) = owner_of(&server, id).expect("owner of the directory");
    let before = common::durable_inodes(&data);
    let names: BTreeSet<String> = (0..40).map(|i| format!("f{i:02}")).collect();
    for n in &names {
        std::fs::File::create(work.join(n)).expect("create");
    }
    // Power loss of the victim alone; its store is copied while it is off, before anyone
    // recovers its tables, and the copies' durable namespace counted afterwards. (Copying
    // takes milliseconds: the victim is off for less than its lease, and is restarted as
    // after a crash rather than fenced.)
    let (_, copies) =
        common::power_loss_of_then(&data.join("store"), pid, common::Loss::Drop, || {
            (0..5)
                .filter_map(|_| common::copy_store(&data))
                .collect::<Vec<_>>()
        });
    let durable = common::durable_inodes_in(&copies, &data);
    eprintln!("{durable} inodes durable at the crash, {before} before the 40 creates");
    assert!(
        durable < before + names.len() as u64,
        "all 40 acknowledged creates were durable at the crash: nothing to replay"
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut got = BTreeSet::new();
    while Instant::now() < deadline {
        got = std::fs::read_dir(&work)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if got == names {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        got,
        names,
        "server {victim} killed: acknowledged creates lost; log:\n{}",
        server.log_text()
    );
}

/// A released table's manifest hands the next owner the releasing server's reply cache,
/// which holds the entries of every table (the cache is per session), and the next owner
/// answers a replay from them as done. An entry whose record was not durable yet (an
/// early-answered rename on a table still served there, made while the release waited
/// for a mount's callbacks) let the next owner answer that rename's replay "done" after
/// the releasing server was killed: the rename was lost (the hosts test `kill` lost a
/// create and a rename so, 1 run in 7). The release now waits until every entry it hands
/// over is durable.
#[test]
fn a_released_table_hands_over_only_durable_replies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    // Directories dealt across the tables, each with a file, made on one server (no
    // borrows, no slow journal yet).
    let names: Vec<String> = (0..8).map(|i| format!("d{i}")).collect();
    let mut one = start(dir.path(), "1");
    runtime().block_on(async {
        let c = one.client(3).await;
        let cred = Credentials::root();
        for n in &names {
            let d = c
                .mkdir(&cred, c.root(), n.as_bytes(), 0o755)
                .await
                .expect("mkdir");
            c.mknod(&cred, d.id, b"x", 0o100644, 0, true)
                .await
                .expect("create x");
        }
    });
    assert_eq!(one.stop(), Some(0), "clean stop; log:\n{}", one.log_text());
    drop(one);
    let server = ServerProc::start_env(
        &data,
        "0",
        &["--servers", "2", "--lease", "2"],
        // Each flush held for 4.5 s: the rename below (2.5 s into a release that waits
        // about 5 s) is not durable when that release ends, nor when its server is killed
        // right after.
        &[("KOCHAB_JOURNAL_DELAY_MS", "4500")],
    );
    let servers = wait_spread(&server, 2, 19 / 2);
    let rt = runtime();
    let mut cfg = kochab_client::ClientConfig::with_entries(server.addrs.clone(), server.key);
    cfg.early_replies = true;
    let client = rt.block_on(Client::connect(cfg)).expect("connect");
    let cred = Credentials::root();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let ids = rt.block_on(dir_ids(&client, &refs));
    let table_of = |id: InodeId| -> (String, u64) {
        let v = status(&server).expect("status");
        v["tables"]
            .as_array()
            .and_then(|a| {
                a.iter().find_map(|t| {
                    let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
                    let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
                    (lo <= id && id < hi)
                        .then(|| Some((t["lo"].as_str()?.to_string(), t["owner"].as_u64()?)))?
                })
            })
            .expect("the table of a directory")
    };
    let placed: Vec<(String, u64)> = ids.iter().map(|&id| table_of(id)).collect();
    let (a, b) = (0..ids.len())
        .flat_map(|i| (0..ids.len()).map(move |j| (i, j)))
        .find(|&(i, j)| placed[i].1 == placed[j].1 && placed[i].0 != placed[j].0)
        .expect("two directories on one server, in two tables");
    let (victim, pid) = owner_of(&server, ids[a]).expect("owner");
    let other = *servers
        .keys()
        .find(|&&s| s != victim)
        .expect("the other server");
    // A mount that caches directory b and then answers no callback: the release of b's
    // table waits for its lease to run out (`leases::LEASE`, 5 s), seconds in which the
    // rename below runs on a's table, on the same server.
    let mount = common::MountProc::start(
        server.addr,
        &data.join("cluster.key"),
        &dir.path().join("m"),
    );
    let bdir = mount.mnt.join(&names[b]);
    std::fs::read_dir(&bdir).expect("list b").for_each(drop);
    std::fs::metadata(bdir.join("x")).expect("stat b/x");
    signal(mount.child.id() as i32, libc::SIGSTOP);
    let mover = std::process::Command::new(common::kochab_bin())
        .args(["table", "move", &placed[b].0, "--to", &other.to_string()])
        .args(["--timeout", "120", "--cluster", &server.addr.to_string()])
        .arg("--key-file")
        .arg(data.join("cluster.key"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kochab table move");
    std::thread::sleep(Duration::from_millis(2500));
    rt.block_on(async {
        client
            .rename(&cred, ids[a], b"x", ids[a], b"y", 0)
            .await
            .expect("rename answered early");
    });
    assert_eq!(client.unsafe_count(), 1, "the rename was answered early");
    let moved = mover.wait_with_output().expect("move");
    assert!(
        moved.status.success(),
        "move: {}{}",
        String::from_utf8_lossy(&moved.stdout),
        String::from_utf8_lossy(&moved.stderr)
    );
    // Killed right after the release: the rename is replayed on its table's next owner,
    // the server that took b's table (there is no other).
    signal(pid, libc::SIGKILL);
    signal(mount.child.id() as i32, libc::SIGCONT);
    drop(mount);
    let got = rt.block_on(async {
        client.wait_durable().await.expect("the rename replayed");
        names_of(&client, ids[a]).await
    });
    assert_eq!(
        got,
        BTreeSet::from(["y".to_string()]),
        "server {victim} killed after releasing a table: the acknowledged rename x -> y \
         was lost; log:\n{}",
        server.log_text()
    );
}
