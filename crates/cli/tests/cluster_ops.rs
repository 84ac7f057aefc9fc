//! Operator commands on a cluster of server processes: `kochab server drain` empties a
//! server under load with no client-visible error and nothing lost, `kochab server add`
//! gives it tables again, `kochab table move` puts a table where it is asked, and
//! `kochab status` shows the draining mark, migrations and per-table load.

mod common;

use common::{ServerProc, kochab_bin, runtime};
use kochab_proto::{Credentials, InodeId};
use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Runs `kochab ARGS --cluster ADDR --key-file KEY` and returns (success, stdout+stderr).
fn kochab(server: &ServerProc, args: &[&str]) -> (bool, String) {
    let out = Command::new(kochab_bin())
        .args(args)
        .args(["--cluster", &server.addr.to_string()])
        .arg("--key-file")
        .arg(server.data.join("cluster.key"))
        .output()
        .expect("run kochab");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn status(server: &ServerProc) -> Option<serde_json::Value> {
    let (ok, text) = kochab(server, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&text).ok().filter(|_| ok)?;
    v.get("servers").is_some().then_some(v)
}

/// Server id -> number of tables, by the servers' own reports.
fn tables_per_server(v: &serde_json::Value) -> Vec<(u64, usize)> {
    v["servers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| Some((s["id"].as_u64()?, s["tables"].as_array()?.len())))
                .collect()
        })
        .unwrap_or_default()
}

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
