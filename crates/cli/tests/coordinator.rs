//! The coordinator group as real processes: three `kochab coord` replicas on loopback; the
//! leader is killed with SIGKILL, the survivors elect another and a client's proposals ride
//! it out; the killed replica restarts from its disk and catches up.

mod common;

use common::kochab_bin;
use kochab_cluster::state::CoordState;
use kochab_coord::{ClientConfig, CoordClient};
use kochab_proto::cluster::{CoordCommand, CoordReply, ServerId, ServerRequest};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

struct Replica {
    id: u64,
    addr: SocketAddr,
    child: Option<Child>,
}

fn start(id: u64, addr: SocketAddr, peers: &str, dir: &Path, key: &Path) -> Child {
    let mut cmd = Command::new(kochab_bin());
    cmd.args([
        "coord",
        "--id",
        &id.to_string(),
        "--listen",
        &addr.to_string(),
    ])
    .args(["--peers", peers, "--data"])
    .arg(dir.join(format!("r{id}")))
    .arg("--key-file")
    .arg(key)
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(dir.join(format!("r{id}.log"))).unwrap());
    if id == 1 {
        cmd.arg("--bootstrap");
    }
    let mut child = cmd.spawn().expect("spawn kochab coord");
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert!(
        line.contains("ready at"),
        "replica {id} did not start: {line:?}"
    );
    child
}

fn status(addrs: &[SocketAddr], key: &Path) -> serde_json::Value {
    let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let out = Command::new(kochab_bin())
        .args(["coord-status", "--json", "--coord", &list.join(",")])
        .arg("--key-file")
        .arg(key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The leader id every answering replica agrees on, once they do (bounded wait).
fn agreed_leader(addrs: &[SocketAddr], key: &Path, not: Option<u64>) -> u64 {
    for _ in 0..200 {
        let s = status(addrs, key);
        let leaders: Vec<Option<u64>> = s["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r.get("status"))
            .map(|st| st["leader"].as_u64())
            .collect();
        if let Some(Some(l)) = leaders.first()
            && leaders.iter().all(|x| *x == Some(*l))
            && Some(*l) != not
            && s["state"]["bootstrapped"] == true
        {
            return *l;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the replicas never agreed on a leader");
}

#[test]
fn coordinator_group_rides_out_sigkill_of_its_leader() {
    let tmp = tempfile::tempdir().unwrap();
    let key: PathBuf = tmp.path().join("cluster.key");
    std::fs::write(&key, "ab".repeat(32)).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut reps: Vec<Replica> = (1..=3)
        .map(|id| Replica {
            id,
            addr: free_addr(),
            child: None,
        })
        .collect();
    let peers = reps
        .iter()
        .map(|r| format!("{}={}", r.id, r.addr))
        .collect::<Vec<_>>()
        .join(",");
    for r in &mut reps {
        r.child = Some(start(r.id, r.addr, &peers, tmp.path(), &key));
    }
    let addrs: Vec<SocketAddr> = reps.iter().map(|r| r.addr).collect();
    let leader = agreed_leader(&addrs, &key, None);
    let s = status(&addrs, &key);
    assert!(s["state"]["tables"].as_u64().unwrap() > 1, "{s:#}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = ClientConfig::new(addrs.clone(), [0xab; 32]);
    cfg.budget = Duration::from_secs(15);
    let client = CoordClient::<CoordState>::new(cfg);
    let register = |server: u32| CoordCommand::Request {
        req: ServerRequest::Register {
            server: ServerId(server),
            addr: format!("127.0.0.1:{}", 9000 + server),
            nonce: u64::from(server),
        },
        now_ms: kochab_coord::coordinator::wall_clock_ms(),
    };
    let r = rt.block_on(client.propose(register(1))).unwrap();
    assert!(matches!(r, CoordReply::Registered { .. }), "{r:?}");

    // SIGKILL the leader; a proposal made right after is applied by the next leader.
    let li = reps.iter().position(|r| r.id == leader).unwrap();
    let mut dead = reps[li].child.take().unwrap();
    dead.kill().unwrap();
    dead.wait().unwrap();
    let r = rt.block_on(client.propose(register(2))).unwrap();
    assert!(matches!(r, CoordReply::Registered { .. }), "{r:?}");
    let live: Vec<SocketAddr> = reps
        .iter()
        .filter(|r| r.child.is_some())
        .map(|r| r.addr)
        .collect();
    let new_leader = agreed_leader(&live, &key, Some(leader));
    assert_ne!(new_leader, leader);
    let s = status(&live, &key);
    assert_eq!(s["state"]["servers"].as_array().unwrap().len(), 2, "{s:#}");

    // The killed replica restarts from its disk and catches up with both registrations.
    reps[li].child = Some(start(leader, reps[li].addr, &peers, tmp.path(), &key));
    let mut caught_up = false;
    for _ in 0..200 {
        let s = status(&[reps[li].addr], &key);
        let st = &s["replicas"][0]["status"];
        let theirs = status(&live, &key);
        let applied = theirs["replicas"][0]["status"]["last_applied"].clone();
        if st["last_applied"] == applied && !applied.is_null() {
            caught_up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(caught_up, "the restarted replica did not catch up");
    for r in &mut reps {
        if let Some(mut c) = r.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
