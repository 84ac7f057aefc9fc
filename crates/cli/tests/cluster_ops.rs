//! Operator commands on a cluster of server processes: `kochab server drain` empties a
//! server under load with no client-visible error and nothing lost, `kochab server add`
//! gives it tables again, `kochab table move` puts a table where it is asked, and
//! `kochab status` shows the draining mark, migrations and per-table load.

mod common;

use common::{ServerProc, kochab_at as kochab, runtime, status, tables_per_server};
use kochab_proto::{Credentials, InodeId};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Waits until `n` servers answer and each holds at least `min` tables.
fn wait_spread(server: &ServerProc, n: usize, min: usize) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(v) = status(server) {
            let t = tables_per_server(&v);
            if t.len() == n && t.iter().all(|&(_, c)| c >= min) {
                return v;
            }
            last = Some(v);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!(
        "tables not spread over {n} servers; last status {last:#?}\nlog:\n{}",
        server.log_text()
    );
}

/// The status once no table is moving (at most 60 s).
fn wait_quiet(server: &ServerProc) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = status(server)
            && v["coordinator"]["migrations"]
                .as_array()
                .is_some_and(|m| m.is_empty())
        {
            return v;
        }
        assert!(Instant::now() < deadline, "tables kept moving for 60 s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The table (lo, as status prints it) holding `id`, and its owner.
fn table_of(v: &serde_json::Value, id: InodeId) -> Option<(String, u64)> {
    v["tables"].as_array()?.iter().find_map(|t| {
        let lo = u64::from_str_radix(t["lo"].as_str()?, 16).ok()?;
        let hi = u64::from_str_radix(t["hi"].as_str()?, 16).ok()?;
        (lo <= id && id < hi)
            .then(|| Some((t["lo"].as_str()?.to_string(), t["owner"].as_u64()?)))?
    })
}

#[test]
fn drain_under_load_loses_nothing_and_add_and_move_place_tables() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start(
        &dir.path().join("data"),
        &["--servers", "3", "--lease", "2"],
    );
    // 19 tables over 3 servers.
    wait_spread(&server, 3, 6);
    let rt = runtime();
    let (client, work) = rt.block_on(async {
        let c = server.client(3).await;
        let a = c
            .mkdir(&Credentials::root(), c.root(), b"work", 0o755)
            .await
            .expect("mkdir");
        (c, a.id)
    });
    let v = status(&server).expect("status");
    let (_, victim) = table_of(&v, work).expect("the directory's table");

    // A small steady load on the directory, on the server about to be drained.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let c = client.clone();
        let stop = stop.clone();
        rt.spawn(async move {
            let mut acked = BTreeSet::new();
            let mut errors = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let name = format!("f{i}");
                match c
                    .create(&Credentials::root(), work, name.as_bytes(), 0o644)
                    .await
                {
                    Ok(_) => {
                        acked.insert(name);
                    }
                    Err(e) => errors.push(format!("create {name}: {e}")),
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (acked, errors)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let id = victim.to_string();
    let (ok, out) = kochab(&server, &["server", "drain", &id, "--timeout", "120"]);
    assert!(ok, "drain failed: {out}\nlog:\n{}", server.log_text());
    let v = status(&server).expect("status");
    let t = tables_per_server(&v);
    assert!(
        t.iter().any(|&(s, c)| s == victim && c == 0),
        "server {victim} still holds tables: {t:?}"
    );
    assert_eq!(
        v["coordinator"]["draining"],
        serde_json::json!([victim]),
        "{v:#}"
    );
    let (ok, text) = kochab(&server, &["status"]);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("draining servers: {victim}")),
        "{text}"
    );
    assert!(text.contains("migrations in progress: 0"), "{text}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    let (acked, errors) = rt.block_on(writer).expect("writer");
    assert!(errors.is_empty(), "client-visible errors: {errors:?}");
    assert!(acked.len() > 20, "the load ran: {} creates", acked.len());
    let names: BTreeSet<String> = rt.block_on(async {
        client
            .readdir_all(&Credentials::root(), work, false)
            .await
            .expect("readdir")
            .into_iter()
            .map(|e| String::from_utf8_lossy(&e.name).into_owned())
            .filter(|n| n != "." && n != "..")
            .collect()
    });
    assert_eq!(names, acked, "every acknowledged create, nothing else");

    // Back in service: the balancer gives it its share again.
    let (ok, out) = kochab(&server, &["server", "add", &id, "--timeout", "120"]);
    assert!(ok, "add failed: {out}");
    let v = wait_spread(&server, 3, 6);
    assert_eq!(v["coordinator"]["draining"], serde_json::json!([]), "{v:#}");

    // One table moved by hand: from the server with the most tables to the one with the
    // fewest, so the counts stay even and the balancer leaves it there.
    let counts = tables_per_server(&v);
    let &(from, _) = counts.iter().max_by_key(|(_, c)| *c).expect("servers");
    let &(to, _) = counts.iter().min_by_key(|(_, c)| *c).expect("servers");
    let lo = v["tables"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|t| t["owner"].as_u64() == Some(from))
                .and_then(|t| t["lo"].as_str())
        })
        .expect("a table of the fullest server")
        .to_string();
    let (ok, out) = kochab(
        &server,
        &[
            "table",
            "move",
            &lo,
            "--to",
            &to.to_string(),
            "--timeout",
            "120",
        ],
    );
    assert!(ok, "move failed: {out}");
    assert!(out.contains(&format!("moved to server {to}")), "{out}");
    // The entry server's copy of the map is at most 200 ms old.
    std::thread::sleep(Duration::from_millis(500));
    let v = status(&server).expect("status");
    let owner = v["tables"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["lo"].as_str() == Some(lo.as_str())))
        .and_then(|t| t["owner"].as_u64());
    assert_eq!(owner, Some(to), "{v:#}");
    rt.block_on(async {
        client
            .create(&Credentials::root(), work, b"after-move", 0o644)
            .await
            .expect("create after the move");
    });
    // A move to a server that does not exist is refused with a reason.
    let (ok, out) = kochab(&server, &["table", "move", &lo, "--to", "99"]);
    assert!(!ok && out.contains("not live"), "{out}");
}

/// `/top` with four directories `d0`..`d3` of 25 files each: (top, the four).
async fn make_tree(c: &kochab_client::Client) -> (InodeId, Vec<InodeId>) {
    let cred = Credentials::root();
    let top = c
        .mkdir(&cred, c.root(), b"top", 0o755)
        .await
        .expect("mkdir")
        .id;
    let mut subs = Vec::new();
    for d in 0..4 {
        let sub = c
            .mkdir(&cred, top, format!("d{d}").as_bytes(), 0o755)
            .await
            .expect("mkdir sub")
            .id;
        for i in 0..25 {
            c.create(&cred, sub, format!("f{i}").as_bytes(), 0o644)
                .await
                .expect("create");
        }
        subs.push(sub);
    }
    (top, subs)
}

/// Every name in the directories `dirs`, sorted.
async fn names_in(c: &kochab_client::Client, dirs: &[InodeId]) -> Vec<(InodeId, String)> {
    let mut out = Vec::new();
    for &d in dirs {
        for e in c
            .readdir_all(&Credentials::root(), d, false)
            .await
            .expect("readdir")
        {
            let n = String::from_utf8_lossy(&e.name).into_owned();
            if n != "." && n != ".." {
                out.push((d, n));
            }
        }
    }
    out.sort();
    out
}

/// `kochab table split` under a create load: the table of a tree of four directories is
/// cut between two of them, both halves serve at once with no client error, the upper
/// half moves to the other server (a rename between the halves then borrows), and after
/// its owner is killed with SIGKILL everything acknowledged is there and fsck is clean.
#[test]
fn a_table_split_online_serves_both_halves_on_two_servers_and_after_a_kill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start(
        &dir.path().join("data"),
        &["--servers", "2", "--lease", "2"],
    );
    wait_spread(&server, 2, 9);
    let rt = runtime();
    let cred = Credentials::root();
    let (client, top, subs) = rt.block_on(async {
        let c = server.client(3).await;
        let (top, subs) = make_tree(&c).await;
        (c, top, subs)
    });
    let v = status(&server).expect("status");
    let (lo, _) = table_of(&v, top).expect("the tree's table");

    // Creates in the first and the last directory all along.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, stop, dirs) = (client.clone(), stop.clone(), [subs[0], subs[3]]);
        rt.spawn(async move {
            let mut errors = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                for d in dirs {
                    if let Err(e) = c
                        .create(&Credentials::root(), d, format!("w{i}").as_bytes(), 0o644)
                        .await
                    {
                        errors.push(format!("create w{i}: {e}"));
                    }
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (i, errors)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let (ok, out) = kochab(&server, &["table", "split", &lo, "--timeout", "120"]);
    assert!(ok, "split failed: {out}\n{}", server.log_text());
    assert!(out.contains("split at"), "{out}");
    let v = status(&server).expect("status");
    let (first, _) = table_of(&v, subs[0]).expect("table of d0");
    let (upper, _) = table_of(&v, subs[3]).expect("table of d3");
    assert_eq!(first, lo, "the lower half keeps the table's id: {v:#}");
    assert_ne!(upper, lo, "d3 is in the new table: {v:#}");
    assert!(
        subs.iter()
            .any(|&s| u64::from_str_radix(&upper, 16) == Ok(s)),
        "the cut is a subtree boundary: {upper} among {subs:x?}"
    );

    // The upper half goes to the other server. The balancer evens the table counts after
    // each move and may pick this very table to send back (before loads are reported it
    // does not know it is busy), so ask again until the halves stay apart.
    let mut apart = false;
    for _ in 0..5 {
        let v = wait_quiet(&server);
        let (_, lower_owner) = table_of(&v, subs[0]).expect("table of d0");
        let (_, upper_owner) = table_of(&v, subs[3]).expect("table of d3");
        if lower_owner != upper_owner {
            apart = true;
            break;
        }
        let other = tables_per_server(&v)
            .into_iter()
            .map(|(s, _)| s)
            .find(|&s| s != upper_owner)
            .expect("a second server");
        let (ok, out) = kochab(
            &server,
            &[
                "table",
                "move",
                &upper,
                "--to",
                &other.to_string(),
                "--timeout",
                "120",
            ],
        );
        assert!(ok || out.contains("ended on server"), "move failed: {out}");
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(apart, "the halves never stayed on different servers");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let (rounds, errors) = rt.block_on(writer).expect("writer");
    assert!(errors.is_empty(), "client-visible errors: {errors:?}");
    assert!(rounds > 0);

    let expected = rt.block_on(async {
        // Between the halves: the rename borrows the other table.
        client
            .rename(&cred, subs[0], b"f0", subs[3], b"moved", 0)
            .await
            .unwrap_or_else(|e| panic!("rename across the halves: {e}\n{}", server.log_text()));
        let problems = client.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
        names_in(&client, &subs).await
    });
    assert_eq!(expected.len(), 100 + 2 * rounds as usize);
    // `kochab fsck` of the running cluster: every server checks the tables it holds, and
    // the links between them are checked.
    let (ok, out) = kochab(&server, &["fsck"]);
    assert!(ok, "fsck: {out}");
    assert_eq!(
        out.matches(" tables): clean").count(),
        2,
        "one clean answer per server: {out}"
    );
    assert!(out.contains("links across servers ("), "{out}");
    assert!(out.contains("20 tables on 2 servers"), "{out}");

    // The upper half's owner dies; its recoverer serves both halves' directories.
    let v = status(&server).expect("status");
    let (_, owner) = table_of(&v, subs[3]).expect("table of d3");
    let pid = v["servers"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"].as_u64() == Some(owner)))
        .and_then(|s| s["pid"].as_i64())
        .expect("pid of the owner") as i32;
    // SAFETY: kill(2) on a server process this test's cluster started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    rt.block_on(async {
        let got = names_in(&client, &subs).await;
        assert_eq!(got, expected, "after the kill");
        let problems = client.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
    });
    // The whole stopped cluster checks clean offline, split tables included.
    let pids: Vec<i32> = status(&server)
        .and_then(|v| {
            v["servers"].as_array().map(|a| {
                a.iter()
                    .filter_map(|s| Some(s["pid"].as_i64()? as i32))
                    .collect()
            })
        })
        .unwrap_or_default();
    let mut server = server;
    server.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    // SAFETY: signal 0 only checks that the process exists.
    while pids.iter().any(|&p| unsafe { libc::kill(p, 0) } == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = common::offline_fsck_clean(&dir.path().join("data"), "after a split");
    assert!(report.contains("20 tables"), "{report}");
}

/// A split whose owner dies right after its commit point (the lower half's manifest names
/// the split, the upper half has no manifest of its own yet): the table's recoverer loads
/// both halves, writes the upper's manifest, and the coordinator's map learns the split
/// from it; nothing is lost and the stopped cluster checks clean.
#[test]
fn a_split_interrupted_after_its_commit_point_is_finished_by_the_recoverer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start_env(
        &dir.path().join("data"),
        "0",
        &["--servers", "2", "--lease", "2"],
        &[("KOCHAB_CRASH_AT", "split-committed")],
    );
    wait_spread(&server, 2, 9);
    let rt = runtime();
    let cred = Credentials::root();
    let (client, top, subs) = rt.block_on(async {
        let c = server.client(3).await;
        let (top, subs) = make_tree(&c).await;
        (c, top, subs)
    });
    let expected = rt.block_on(names_in(&client, &subs));
    let v = status(&server).expect("status");
    let (lo, _) = table_of(&v, top).expect("the tree's table");
    // The owner aborts inside the split; the command may see the split dropped with it.
    let _ = kochab(&server, &["table", "split", &lo, "--timeout", "60"]);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let v = status(&server);
        let split = v.as_ref().is_some_and(|v| {
            let first = table_of(v, subs[0]).map(|t| t.0);
            let last = table_of(v, subs[3]).map(|t| t.0);
            first.as_deref() == Some(lo.as_str()) && last.is_some() && last != first
        });
        if split {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the map never showed the split; status {v:#?}\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let logs: String = ["mds-2.log", "mds-3.log"]
        .iter()
        .map(|f| std::fs::read_to_string(dir.path().join("data/logs").join(f)).unwrap_or_default())
        .collect();
    assert!(
        logs.contains("aborting here"),
        "the owner did not crash in the split"
    );
    assert!(
        logs.contains(&format!("table {lo} was split at")),
        "the recoverer did not find the split:\n{logs}"
    );
    rt.block_on(async {
        assert_eq!(names_in(&client, &subs).await, expected);
        client
            .create(&cred, subs[3], b"after", 0o644)
            .await
            .expect("create in the upper half");
        let problems = client.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
    });
    let mut server = server;
    server.kill9();
    std::thread::sleep(Duration::from_secs(2));
    common::offline_fsck_clean(&dir.path().join("data"), "after an interrupted split");
}

/// Closes gathered into one request per server (`Client::close_soon`, what the mount does
/// with closes that have nothing to report) reach every server a file is on; handles whose
/// files' table moved after they were opened (their server was drained) are refused by
/// their old server as a gathered request and closed one by one instead. Each file was unlinked while open: its
/// last close ends it.
#[test]
fn gathered_closes_reach_every_server_and_follow_a_moved_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start(&dir.path().join("data"), &["--servers", "2"]);
    wait_spread(&server, 2, 6);
    let rt = runtime();
    let cred = Credentials::root();
    let client = rt.block_on(server.client(3));
    // Directories until two are on different servers.
    let mut dirs: Vec<InodeId> = Vec::new();
    let (a, b) = loop {
        let i = dirs.len();
        assert!(i < 40, "no two directories on different servers");
        let d = rt
            .block_on(client.mkdir(&cred, client.root(), format!("d{i}").as_bytes(), 0o755))
            .expect("mkdir");
        dirs.push(d.id);
        let v = status(&server).expect("status");
        let owner = |id| table_of(&v, id).expect("table").1;
        if let Some(&other) = dirs.iter().find(|&&o| owner(o) != owner(d.id)) {
            break (other, d.id);
        }
    };
    let open_unlinked = |parent: InodeId, name: &[u8]| {
        rt.block_on(async {
            let (attr, h) = client
                .create_open(&cred, parent, name, 0o644, libc::O_RDWR as u32)
                .await
                .expect("create and open");
            client.unlink(&cred, parent, name).await.expect("unlink");
            (attr.id, h)
        })
    };
    let files = [
        open_unlinked(a, b"f"),
        open_unlinked(b, b"f"),
        open_unlinked(b, b"g"),
    ];
    // b's server is drained while the files are open: their table moves to a's server
    // (the balancer leaves it there while the drain stands).
    let v = status(&server).expect("status");
    let (_, from) = table_of(&v, b).expect("table of b");
    let (ok, out) = kochab(
        &server,
        &["server", "drain", &from.to_string(), "--timeout", "120"],
    );
    assert!(ok, "drain failed: {out}\nlog:\n{}", server.log_text());
    let v = status(&server).expect("status");
    assert_ne!(table_of(&v, files[1].0).expect("table").1, from, "{v:#}");
    rt.block_on(async {
        for (id, h) in files {
            assert!(client.getattr(&cred, id).await.is_ok(), "open: kept");
            client.close_soon(h, &tokio::runtime::Handle::current());
        }
        // A statfs waits for the gathered closes.
        client.statfs(&cred).await.expect("statfs");
        for (id, _) in files {
            assert!(
                client.getattr(&cred, id).await.is_err(),
                "inode {id:#x} outlived its last close\nlog:\n{}",
                server.log_text()
            );
        }
        let problems = client.fsck().await.expect("fsck");
        assert!(problems.is_empty(), "{problems:?}");
    });
}
