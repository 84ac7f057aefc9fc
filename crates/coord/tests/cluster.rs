//! Replicas on real TCP over loopback, each on its own tokio runtime; "kill" drops a
//! runtime without shutting the replica down, as a crash would (its disk is what fsync
//! left). Outcomes are asserted, never timings; every wait is bounded.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kochab_coord::log_store::LogStore;
use kochab_coord::{
    ClientConfig, CoordClient, CoordError, Replica, ReplicaConfig, ReplicaId, ReplicatedState,
    Timing,
};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;

/// A ledger of uniquely numbered additions: a retried command is recognised by its id and
/// not applied twice.
#[derive(Clone, Default, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Ledger {
    /// Ids in the order they were applied.
    order: Vec<u64>,
    /// Id to its position in `order`.
    seen: BTreeMap<u64, u64>,
    total: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Add {
    id: u64,
    amount: u64,
}

/// (position of the command in the ledger, whether this application was its first)
type Placed = (u64, bool);

impl ReplicatedState for Ledger {
    type Command = Add;
    type Reply = Placed;
    fn apply(&mut self, cmd: &Add) -> Placed {
        if let Some(&pos) = self.seen.get(&cmd.id) {
            return (pos, false);
        }
        let pos = self.order.len() as u64;
        self.order.push(cmd.id);
        self.seen.insert(cmd.id, pos);
        self.total += cmd.amount;
        (pos, true)
    }
}

const KEY: [u8; 32] = [0x5a; 32];
/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(15);

fn timing() -> Timing {
    Timing {
        heartbeat_ms: 50,
        election_min_ms: 300,
        election_max_ms: 600,
        snapshot_every_entries: 1000,
        entries_kept_after_snapshot: 100,
        request_timeout_ms: 2000,
    }
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Node {
    id: ReplicaId,
    addr: SocketAddr,
    dir: PathBuf,
    peers: BTreeMap<ReplicaId, SocketAddr>,
    timing: Timing,
    live: Option<(Runtime, Replica<Ledger>)>,
}

impl Node {
    fn start(&mut self, bootstrap: bool) {
        assert!(self.live.is_none());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let cfg = ReplicaConfig {
            id: self.id,
            listen: self.addr,
            peers: self.peers.clone(),
            data_dir: self.dir.clone(),
            key: KEY,
            bootstrap,
            timing: self.timing,
            tls: Default::default(),
        };
        let r = rt.block_on(Replica::<Ledger>::start(cfg)).unwrap();
        self.live = Some((rt, r));
    }

    /// Crash: every task of the replica stops at its next await, nothing is shut down
    /// cleanly. (Waits for the worker to drop the tasks, so the port is free again.)
    fn kill(&mut self) {
        if let Some((rt, r)) = self.live.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
            drop(r);
        }
    }

    fn replica(&self) -> &Replica<Ledger> {
        &self.live.as_ref().unwrap().1
    }

    /// Waits until this replica has applied a state satisfying `f`.
    fn wait_state(&self, f: impl Fn(&Ledger) -> bool) -> Ledger {
        let (rt, r) = self.live.as_ref().unwrap();
        let mut rx = r.subscribe();
        rt.block_on(async {
            let v = tokio::time::timeout(WAIT, rx.wait_for(|v| f(&v.state)))
                .await
                .expect("state not reached in time")
                .unwrap();
            (*v.state).clone()
        })
    }

    /// Waits until this replica's status satisfies `f`.
    fn wait_status(&self, f: impl Fn(&kochab_coord::ReplicaStatus) -> bool) {
        let (rt, r) = self.live.as_ref().unwrap();
        let mut rx = r.subscribe();
        rt.block_on(async {
            tokio::time::timeout(WAIT, async {
                loop {
                    if f(&r.status()) {
                        return;
                    }
                    // Leadership and applied index both change the view.
                    let _ = tokio::time::timeout(Duration::from_millis(100), rx.changed()).await;
                }
            })
            .await
            .expect("status not reached in time")
        })
    }
}

struct Cluster {
    nodes: Vec<Node>,
    client_rt: Runtime,
    _tmp: tempfile::TempDir,
}

impl Cluster {
    fn new(n: u64, timing: Timing) -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        let peers: BTreeMap<ReplicaId, SocketAddr> = (1..=n).map(|i| (i, free_addr())).collect();
        let nodes = peers
            .iter()
            .map(|(&id, &addr)| Node {
                id,
                addr,
                dir: tmp.path().join(format!("r{id}")),
                peers: peers.clone(),
                timing,
                live: None,
            })
            .collect();
        let client_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        Cluster {
            nodes,
            client_rt,
            _tmp: tmp,
        }
    }

    fn start_all(&mut self) {
        for (i, n) in self.nodes.iter_mut().enumerate() {
            n.start(i == 0);
        }
    }

    fn client(&self, budget: Duration) -> CoordClient<Ledger> {
        let mut cfg = ClientConfig::new(self.nodes.iter().map(|n| n.addr).collect(), KEY);
        cfg.budget = budget;
        cfg.attempt_timeout = Duration::from_millis(1000);
        CoordClient::new(cfg)
    }

    fn node(&mut self, id: ReplicaId) -> &mut Node {
        self.nodes.iter_mut().find(|n| n.id == id).unwrap()
    }

    /// The leader as seen by a live replica (after the group has one).
    fn leader(&self) -> ReplicaId {
        let live = self.nodes.iter().find(|n| n.live.is_some()).unwrap();
        live.wait_status(|s| s.leader.is_some());
        live.replica().status().leader.unwrap()
    }

    fn propose_all(&self, c: &CoordClient<Ledger>, ids: impl Iterator<Item = u64>) {
        self.client_rt.block_on(async {
            for id in ids {
                c.propose(Add { id, amount: id }).await.unwrap();
            }
        });
    }
}

fn assert_exactly(state: &Ledger, ids: impl Iterator<Item = u64>) {
    let want: BTreeSet<u64> = ids.collect();
    let got: BTreeSet<u64> = state.order.iter().copied().collect();
    assert_eq!(got.len(), state.order.len(), "an id was applied twice");
    assert_eq!(got, want);
}

#[test]
fn single_replica_bootstrap_and_restart_keeps_state() {
    let mut c = Cluster::new(1, timing());
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.client_rt.block_on(async {
        for id in 1..=5 {
            let (pos, fresh) = client.propose(Add { id, amount: 10 }).await.unwrap();
            assert_eq!((pos, fresh), (id - 1, true));
        }
        // A retried command is recognised, not applied again.
        assert_eq!(
            client.propose(Add { id: 3, amount: 10 }).await.unwrap(),
            (2, false)
        );
    });
    c.node(1).kill();
    c.node(1).start(true);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=5);
    assert_eq!(state.total, 50);
    // And a clean shutdown, then a restart without the bootstrap flag.
    let (rt, r) = c.node(1).live.take().unwrap();
    rt.block_on(r.shutdown()).unwrap();
    drop(rt);
    c.node(1).start(false);
    c.propose_all(&client, 6..=7);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=7);
}

#[test]
fn three_replicas_replicate_and_ride_out_leader_kill() {
    let mut c = Cluster::new(3, timing());
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=20);
    for n in &c.nodes {
        let s = n.wait_state(|s| s.order.len() == 20);
        assert_exactly(&s, 1..=20);
    }
    // Proposals keep coming while the leader dies.
    let leader = c.leader();
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let Cluster {
        nodes, client_rt, ..
    } = &mut c;
    let client_rt = &*client_rt;
    let client_ref = &client;
    let acked = std::thread::scope(|scope| {
        let h = scope.spawn(move || {
            client_rt.block_on(async {
                let mut acked = Vec::new();
                for id in 21..=60 {
                    // Every command must be acknowledged despite the failover.
                    client_ref.propose(Add { id, amount: 1 }).await.unwrap();
                    acked.push(id);
                    let _ = tx.send(id);
                }
                acked
            })
        });
        while let Ok(id) = rx.recv() {
            if id >= 25 {
                break;
            }
        }
        nodes.iter_mut().find(|n| n.id == leader).unwrap().kill();
        h.join().unwrap()
    });
    assert_eq!(acked, (21..=60).collect::<Vec<_>>());
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=60);
    assert_ne!(c.leader(), leader);
    // The old leader comes back as a follower and converges on the same state.
    c.node(leader).start(false);
    let back = c.node(leader).wait_state(|s| s.order.len() == 60);
    assert_eq!(back, state);
}

#[test]
fn torn_log_tail_is_cut_on_restart() {
    let mut c = Cluster::new(1, timing());
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=10);
    c.node(1).kill();
    // A write that was in flight at the crash: a header promising more bytes than exist.
    let seg = last_segment(&c.node(1).dir.join("raft-log"));
    let good_len = std::fs::metadata(&seg).unwrap().len();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&seg).unwrap();
        f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 9, 9, 9]).unwrap();
    }
    // Opening the log cuts exactly the torn bytes.
    {
        let (log, rec) = LogStore::<Ledger>::open(&c.node(1).dir.join("raft-log")).unwrap();
        assert_eq!(rec.torn_bytes, 11);
        assert_eq!(std::fs::metadata(&seg).unwrap().len(), good_len);
        drop(log);
    }
    c.node(1).start(false);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=10);
    c.propose_all(&client, 11..=12);
    // The cut was durable, and what was appended after it reads back.
    c.node(1).kill();
    let (_, rec) = LogStore::<Ledger>::open(&c.node(1).dir.join("raft-log")).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    c.node(1).start(false);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=12);
}

fn last_segment(dir: &Path) -> PathBuf {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    segs.pop().unwrap()
}

#[test]
fn lagging_follower_catches_up_by_snapshot_after_purge() {
    let mut t = timing();
    t.snapshot_every_entries = 10;
    t.entries_kept_after_snapshot = 0;
    let mut c = Cluster::new(3, t);
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=5);
    let leader = c.leader();
    let lagger = c.nodes.iter().map(|n| n.id).find(|&i| i != leader).unwrap();
    c.node(lagger).wait_state(|s| s.order.len() == 5);
    c.node(lagger).kill();
    c.propose_all(&client, 6..=60);
    // The leader snapshots and purges past anything the lagger holds.
    c.node(leader)
        .wait_status(|s| s.purged.is_some_and(|p| p >= 40));
    c.node(lagger).start(false);
    let caught = c.node(lagger).wait_state(|s| s.order.len() == 60);
    assert_exactly(&caught, 1..=60);
    let st = c.node(lagger).replica().status();
    assert!(
        st.snapshot.is_some_and(|s| s >= 40),
        "no snapshot installed: {st:?}"
    );
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_eq!(caught, state);
    // And it keeps following with plain log entries after the snapshot.
    c.propose_all(&client, 61..=62);
    c.node(lagger).wait_state(|s| s.order.len() == 62);
}

#[test]
fn minority_loss_is_tolerated_majority_loss_blocks() {
    let mut c = Cluster::new(3, timing());
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=3);
    let leader = c.leader();
    let followers: Vec<ReplicaId> = c
        .nodes
        .iter()
        .map(|n| n.id)
        .filter(|&i| i != leader)
        .collect();
    c.node(followers[0]).kill();
    c.propose_all(&client, 4..=6);
    c.node(followers[1]).kill();
    // Only the leader is left: nothing commits, and nothing is acknowledged.
    let short = c.client(Duration::from_secs(3));
    let got = c
        .client_rt
        .block_on(short.propose(Add { id: 7, amount: 1 }));
    match got {
        Err(e @ CoordError::Timeout(_)) => assert_eq!(e.errno(), libc::ETIMEDOUT),
        other => panic!("a proposal without quorum must time out, got {other:?}"),
    }
    let read = c.client_rt.block_on(short.read_state());
    assert!(read.is_err(), "a read without quorum must fail");
    // A majority again: the group serves, and every acknowledged command is there.
    c.node(followers[0]).start(false);
    c.propose_all(&client, 8..=9);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    let ids: BTreeSet<u64> = state.order.iter().copied().collect();
    for id in [1, 2, 3, 4, 5, 6, 8, 9] {
        assert!(ids.contains(&id), "acknowledged {id} lost");
    }
    assert_eq!(ids.len(), state.order.len());
}

#[test]
fn wrong_key_is_refused() {
    let mut c = Cluster::new(1, timing());
    c.start_all();
    let mut cfg = ClientConfig::new(vec![c.nodes[0].addr], [0x11; 32]);
    cfg.budget = Duration::from_secs(2);
    let bad = CoordClient::<Ledger>::new(cfg);
    match c.client_rt.block_on(bad.propose(Add { id: 1, amount: 1 })) {
        Err(CoordError::Auth(_)) => {}
        other => panic!("expected an auth error, got {other:?}"),
    }
    let st = c
        .client_rt
        .block_on(c.client(Duration::from_secs(5)).status_of(c.nodes[0].addr));
    assert_eq!(st.unwrap().id, 1);
}

#[test]
fn one_replica_grows_to_three_then_survives_losing_the_first() {
    let mut c = Cluster::new(3, timing());
    // Replica 1 starts a group of one; 2 and 3 start empty and wait to be added.
    let addr1 = c.node(1).addr;
    c.node(1).peers = [(1, addr1)].into_iter().collect();
    c.node(1).start(true);
    c.node(2).start(false);
    c.node(3).start(false);
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=5);
    let (a2, a3) = (c.node(2).addr, c.node(3).addr);
    c.client_rt.block_on(async {
        client.add_learner(2, a2).await.unwrap();
        client.add_learner(3, a3).await.unwrap();
        client
            .change_membership([1, 2, 3].into_iter().collect())
            .await
            .unwrap();
    });
    let st = c.node(1).replica().status();
    assert_eq!(st.voters.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(st.learners.is_empty());
    c.node(3).wait_state(|s| s.order.len() == 5);
    c.node(1).kill();
    c.propose_all(&client, 6..=8);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=8);
    // Membership errors are reported, not hidden: an unknown voter is refused.
    let bad = c
        .client_rt
        .block_on(client.change_membership([2, 3, 9].into_iter().collect()));
    assert!(matches!(bad, Err(CoordError::Refused(_))), "{bad:?}");
}

#[test]
fn followers_point_at_the_leader_and_garbage_is_refused() {
    let mut c = Cluster::new(3, timing());
    c.start_all();
    let client = c.client(Duration::from_secs(10));
    c.propose_all(&client, 1..=2);
    let leader = c.leader();
    let leader_addr = c.node(leader).addr;
    for n in &c.nodes {
        n.wait_state(|s| s.order.len() == 2);
        let (rt, r) = n.live.as_ref().unwrap();
        let mut view = r.subscribe();
        let v = rt.block_on(async {
            tokio::time::timeout(WAIT, view.wait_for(|v| v.leader == Some(leader)))
                .await
                .unwrap()
                .unwrap()
                .clone()
        });
        assert_eq!(v.is_leader, n.id == leader);
        assert_eq!(v.state.order, vec![1, 2]);
        if n.id != leader {
            // A follower does not propose; it names the leader.
            let got = rt.block_on(r.propose(Add { id: 99, amount: 1 }));
            assert_eq!(
                got,
                Err(CoordError::NotLeader {
                    leader: Some(leader),
                    addr: Some(leader_addr)
                })
            );
            assert!(matches!(
                rt.block_on(r.read_state()),
                Err(CoordError::NotLeader { .. })
            ));
        }
    }
    // Garbage before and after a handshake: the connection is dropped, the replica lives.
    c.client_rt.block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(leader_addr).await.unwrap();
        s.write_all(&[0xff; 64]).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(WAIT, s.read(&mut buf)).await.unwrap();
        assert!(matches!(n, Ok(0) | Err(_)), "a stranger got an answer");
        let key = KEY;
        let mut s = tokio::net::TcpStream::connect(leader_addr).await.unwrap();
        kochab_coord::wire::handshake_dial(&mut s, &key)
            .await
            .unwrap();
        let mut frame = kochab_coord::wire::encode_frame(&(1u8, 2u8, 3u8)).unwrap();
        frame.extend_from_slice(&[7; 8]);
        s.write_all(&frame).await.unwrap();
        let n = tokio::time::timeout(WAIT, s.read(&mut buf)).await.unwrap();
        assert!(
            matches!(n, Ok(0) | Err(_)),
            "a malformed request got an answer"
        );
    });
    c.propose_all(&client, 3..=3);
    let (state, _) = c.client_rt.block_on(client.read_state()).unwrap();
    assert_exactly(&state, 1..=3);
}
