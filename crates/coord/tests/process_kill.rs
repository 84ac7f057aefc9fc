//! Three replica processes (the `coord-ledger-replica` test binary) on loopback; the leader is
//! SIGKILLed while a client proposes, and a follower is stopped with SIGTERM.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use kochab_coord::{ClientConfig, CoordClient, ReplicaId, ReplicatedState};
use serde::{Deserialize, Serialize};

/// The example's state, mirrored (same encoding).
#[derive(Clone, Default, Debug, Serialize, Deserialize)]
struct Ledger {
    order: Vec<u64>,
    seen: BTreeMap<u64, u64>,
}

impl ReplicatedState for Ledger {
    type Command = u64;
    type Reply = (u64, bool);
    fn apply(&mut self, _id: &u64) -> (u64, bool) {
        unreachable!("the client never applies")
    }
}

const KEY_HEX: &str = "7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b7b";

fn example_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_coord-ledger-replica"))
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Procs {
    peers: BTreeMap<ReplicaId, SocketAddr>,
    dir: PathBuf,
    children: BTreeMap<ReplicaId, Child>,
}

impl Procs {
    fn spawn(&mut self, id: ReplicaId, bootstrap: bool) {
        let mut cmd = Command::new(example_bin());
        cmd.arg(id.to_string())
            .arg(self.peers[&id].to_string())
            .arg(self.dir.join(format!("r{id}")))
            .arg(KEY_HEX)
            .arg(if bootstrap { "1" } else { "0" });
        for (i, a) in &self.peers {
            cmd.arg(format!("{i}={a}"));
        }
        let child = cmd.spawn().unwrap();
        self.children.insert(id, child);
    }

    fn sigkill(&mut self, id: ReplicaId) {
        let mut c = self.children.remove(&id).unwrap();
        c.kill().unwrap(); // SIGKILL
        c.wait().unwrap();
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn sigkill_of_the_leader_process_is_ridden_out() {
    assert!(example_bin().exists(), "missing {:?}", example_bin());
    let tmp = tempfile::tempdir().unwrap();
    let mut p = Procs {
        peers: (1..=3).map(|i| (i, free_addr())).collect(),
        dir: tmp.path().to_path_buf(),
        children: BTreeMap::new(),
    };
    for id in 1..=3 {
        p.spawn(id, id == 1);
    }
    let key = kochab_coord::wire::key_from_hex(KEY_HEX).unwrap();
    let mut cfg = ClientConfig::new(p.peers.values().copied().collect(), key);
    cfg.budget = Duration::from_secs(10);
    let client = CoordClient::<Ledger>::new(cfg);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for id in 1..=10 {
            client.propose(id).await.unwrap();
        }
    });
    let leader = rt
        .block_on(client.status_of(p.peers[&1]))
        .unwrap()
        .leader
        .unwrap();
    p.sigkill(leader);
    let (state, applied) = rt.block_on(async {
        for id in 11..=20 {
            client.propose(id).await.unwrap();
        }
        client.read_state().await.unwrap()
    });
    let ids: BTreeSet<u64> = state.order.iter().copied().collect();
    assert_eq!(ids, (1..=20).collect());
    assert_eq!(ids.len(), state.order.len());
    let new_leader = rt
        .block_on(client.status_of(p.peers[&(leader % 3 + 1)]))
        .unwrap()
        .leader;
    assert!(new_leader.is_some_and(|l| l != leader));

    // The killed replica comes back from its disk and catches up.
    p.spawn(leader, false);
    let back = p.peers[&leader];
    let caught_up = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                if let Ok(s) = client.status_of(back).await
                    && s.last_applied >= applied
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
    });
    assert!(caught_up.is_ok(), "restarted replica did not catch up");

    // SIGTERM: a clean stop, exit status 0.
    let mut c = p.children.remove(&leader).unwrap();
    let pid = c.id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(c.wait().unwrap().success());
}
