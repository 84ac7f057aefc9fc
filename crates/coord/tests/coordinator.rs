//! The coordinator's state replicated by three real replicas (TCP on loopback, each on its
//! own runtime), with the leader-only driver sending controls to test servers that answer
//! in process. A migration left half done by a crashed leader is finished by the next one
//! from the replicated state alone (Ursa Minor §3.7). Outcomes are asserted, never timings.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kochab_cluster::driver::DriverConfig;
use kochab_cluster::state::CoordState;
use kochab_coord::coordinator::{ControlFuture, ServerLink, spawn_driver, wall_clock_ms};
use kochab_coord::{ClientConfig, CoordClient, Replica, ReplicaConfig, ReplicaId, Timing};
use kochab_proto::cluster::{
    Control, ControlBody, ControlReply, CoordCommand, CoordReply, ServerId, ServerRequest, TableId,
};
use tokio::runtime::Runtime;

const KEY: [u8; 32] = [0x3c; 32];
const WAIT: Duration = Duration::from_secs(20);

/// Test servers: answer every control as a healthy server would, except that DROPs are
/// held (unanswered) while `hold_drops` is set, as a server still draining would.
#[derive(Default)]
struct Servers {
    hold_drops: Mutex<bool>,
    /// Servers that never answer a `Keys` control (cut off from the driver).
    deaf_to_keys: Mutex<Vec<ServerId>>,
    seen: Mutex<Vec<Control>>,
}

impl ServerLink for Servers {
    fn send(&self, _addr: String, control: Control) -> ControlFuture {
        self.seen.lock().unwrap().push(control.clone());
        let held = *self.hold_drops.lock().unwrap();
        let reply = match control.body {
            ControlBody::Drop {
                table, map_version, ..
            } if !held => Some(ControlReply::Dropped {
                table,
                by: control.to,
                map_version,
            }),
            ControlBody::Drop { .. } => None,
            ControlBody::Add {
                tables,
                map_version,
                ..
            } => Some(ControlReply::Added {
                tables,
                by: control.to,
                map_version,
                splits: vec![],
            }),
            ControlBody::Grant { id } => Some(ControlReply::GrantAck { id }),
            ControlBody::Split { .. } | ControlBody::Txn { .. } => None,
            ControlBody::Keys { .. }
                if self
                    .deaf_to_keys
                    .lock()
                    .unwrap()
                    .contains(&control.to.server) =>
            {
                None
            }
            ControlBody::Keys { version } => Some(ControlReply::KeysApplied {
                by: control.to,
                version,
            }),
        };
        Box::pin(async move { reply })
    }
}

struct Node {
    id: ReplicaId,
    addr: SocketAddr,
    dir: PathBuf,
    peers: BTreeMap<ReplicaId, SocketAddr>,
    live: Option<(Runtime, Arc<Replica<CoordState>>)>,
}

impl Node {
    fn start(&mut self, bootstrap: bool, servers: &Arc<Servers>) {
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
            timing: Timing {
                heartbeat_ms: 50,
                election_min_ms: 300,
                election_max_ms: 600,
                snapshot_every_entries: 1000,
                entries_kept_after_snapshot: 100,
                request_timeout_ms: 2000,
            },
            tls: Default::default(),
        };
        let replica = Arc::new(rt.block_on(Replica::<CoordState>::start(cfg)).unwrap());
        let link: Arc<dyn ServerLink> = servers.clone();
        let cfg = DriverConfig {
            retry_ms: 200,
            tick_ms: 100,
            balance: false,
            ..DriverConfig::default()
        };
        let _guard = rt.enter();
        spawn_driver(Arc::clone(&replica), link, cfg, Arc::new(wall_clock_ms));
        drop(_guard);
        self.live = Some((rt, replica));
    }

    /// A crash: the runtime stops with every task of the replica and its driver.
    fn kill(&mut self) {
        if let Some((rt, r)) = self.live.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
            drop(r);
        }
    }

    fn wait_state(&self, what: &str, f: impl Fn(&CoordState) -> bool) -> CoordState {
        let (rt, r) = self.live.as_ref().unwrap();
        let mut rx = r.subscribe();
        rt.block_on(async {
            let v = tokio::time::timeout(WAIT, rx.wait_for(|v| f(&v.state)))
                .await
                .unwrap_or_else(|_| panic!("{what}: not reached in time"))
                .unwrap();
            (*v.state).clone()
        })
    }
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn owner(s: &CoordState, t: u64) -> Option<ServerId> {
    s.map.owner(TableId(t))
}

#[test]
fn a_new_leader_finishes_the_migration_its_predecessor_started() {
    let tmp = tempfile::tempdir().unwrap();
    let peers: BTreeMap<ReplicaId, SocketAddr> = (1..=3).map(|i| (i, free_addr())).collect();
    let mut nodes: Vec<Node> = peers
        .iter()
        .map(|(&id, &addr)| Node {
            id,
            addr,
            dir: tmp.path().join(format!("r{id}")),
            peers: peers.clone(),
            live: None,
        })
        .collect();
    let servers = Arc::new(Servers::default());
    for (i, n) in nodes.iter_mut().enumerate() {
        n.start(i == 0, &servers);
    }
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = ClientConfig::new(peers.values().copied().collect(), KEY);
    cfg.budget = WAIT;
    let client = CoordClient::<CoordState>::new(cfg);
    let propose = |cmd: CoordCommand| client_rt.block_on(client.propose(cmd)).unwrap();

    // Four tables, two servers with leases far longer than the test.
    let tables = vec![
        (TableId(0), 100),
        (TableId(100), 200),
        (TableId(200), 300),
        (TableId(300), 400),
    ];
    assert_eq!(
        propose(CoordCommand::Bootstrap {
            tables,
            lease_ms: 600_000
        }),
        CoordReply::Ok
    );
    let before = wall_clock_ms();
    for s in [1, 2] {
        // A sender whose clock is 41 days ahead: the leader stamps its own clock instead,
        // so nobody's lease is cut short by the stranger's time.
        let reply = propose(CoordCommand::Request {
            req: ServerRequest::Register {
                server: ServerId(s),
                addr: format!("127.0.0.1:{}", 7000 + s),
                nonce: s as u64,
            },
            now_ms: wall_clock_ms() + 3_600_000_000,
        });
        assert!(matches!(reply, CoordReply::Registered { .. }), "{reply:?}");
    }
    // The driver places every table (ADD answered by the test servers).
    let placed = nodes[0].wait_state("every table placed", |s| {
        s.migrations.is_empty() && (0..4).all(|i| owner(s, i * 100).is_some())
    });
    for m in placed.servers.values() {
        assert!(
            m.live && m.lease_until_ms >= before + 600_000 && m.lease_until_ms < before + 660_000,
            "lease not measured on the leader's clock: {m:?}"
        );
    }
    let t = TableId(0);
    let from = placed.map.owner(t).unwrap();
    let to = if from == ServerId(1) {
        ServerId(2)
    } else {
        ServerId(1)
    };

    // A move starts; the old owner does not answer its DROP yet (still draining).
    *servers.hold_drops.lock().unwrap() = true;
    assert_eq!(propose(CoordCommand::Move { table: t, to }), CoordReply::Ok);
    nodes[0].wait_state("move recorded", |s| s.migrations.contains_key(&t));
    let leader = {
        let (rt, r) = nodes[0].live.as_ref().unwrap();
        let mut rx = r.subscribe();
        rt.block_on(async {
            tokio::time::timeout(WAIT, rx.wait_for(|v| v.leader.is_some()))
                .await
                .unwrap()
                .unwrap()
                .leader
                .unwrap()
        })
    };
    // The leader crashes mid-migration; the drain finishes meanwhile.
    let li = nodes.iter().position(|n| n.id == leader).unwrap();
    nodes[li].kill();
    *servers.hold_drops.lock().unwrap() = false;

    // The next leader resends the DROP and completes the move from the state alone.
    let survivor = nodes.iter().position(|n| n.live.is_some()).unwrap();
    let done = nodes[survivor].wait_state("move finished by the new leader", |s| {
        s.migrations.is_empty() && owner(s, 0) == Some(to)
    });
    assert!(done.check().is_ok(), "{:?}", done.check());
    // The DROP went to the old owner before the ADD went to the new one.
    let seen = servers.seen.lock().unwrap();
    let last_drop = seen
        .iter()
        .rposition(|c| matches!(c.body, ControlBody::Drop { table, .. } if table == t))
        .expect("a DROP was sent");
    let add_after = seen[last_drop..].iter().any(|c| {
        c.to.server == to
            && matches!(&c.body, ControlBody::Add { tables, .. } if tables.contains(&t))
    });
    assert!(
        add_after,
        "no ADD to the new owner after the DROP: {seen:?}"
    );
    drop(seen);
    for n in &mut nodes {
        n.kill();
    }
}

#[test]
fn a_key_change_settles_once_every_live_server_applied_it_or_was_fenced() {
    let tmp = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut node = Node {
        id: 1,
        addr,
        dir: tmp.path().join("r1"),
        peers: BTreeMap::from([(1, addr)]),
        live: None,
    };
    let servers = Arc::new(Servers::default());
    node.start(true, &servers);
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = ClientConfig::new(vec![addr], KEY);
    cfg.budget = WAIT;
    let client = CoordClient::<CoordState>::new(cfg);
    let propose = |cmd: CoordCommand| client_rt.block_on(client.propose(cmd)).unwrap();
    let lease_ms = 3_000;
    assert_eq!(
        propose(CoordCommand::Bootstrap {
            tables: vec![(TableId(0), 100), (TableId(100), 200)],
            lease_ms,
        }),
        CoordReply::Ok
    );
    for s in [1, 2] {
        let reply = propose(CoordCommand::Request {
            req: ServerRequest::Register {
                server: ServerId(s),
                addr: format!("127.0.0.1:{}", 7000 + s),
                nonce: s as u64,
            },
            now_ms: 0,
        });
        assert!(matches!(reply, CoordReply::Registered { .. }), "{reply:?}");
    }
    // Both servers keep their leases; server 2 hears nothing of the keys.
    servers.deaf_to_keys.lock().unwrap().push(ServerId(2));
    let renewing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let renewer = {
        let renewing = renewing.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let client = CoordClient::<CoordState>::new(ClientConfig::new(vec![addr], KEY));
            while renewing.load(std::sync::atomic::Ordering::SeqCst) {
                for s in [1, 2] {
                    let epoch = kochab_proto::cluster::Epoch(1);
                    let req = ServerRequest::RenewLease {
                        server: ServerId(s),
                        epoch,
                    };
                    let _ = rt.block_on(client.propose(CoordCommand::Request { req, now_ms: 0 }));
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let key = kochab_proto::cluster::SealedKey {
        nonce: [1; 16],
        sealed: [2; 32],
        policy: kochab_proto::KeyPolicy::TRUSTED,
        revoked: false,
        note: "k".into(),
    };
    let CoordReply::Key { id, .. } = propose(CoordCommand::KeyAdd { key }) else {
        panic!("key not added");
    };
    let CoordReply::Key { version, .. } = propose(CoordCommand::KeyRevoke { id }) else {
        panic!("key not revoked");
    };
    // Server 1 applies the revocation (the driver asks, it answers); server 2 holds it up.
    let s = node.wait_state("server 1 applied the revocation", |s| {
        s.live(ServerId(1))
            .is_some_and(|i| s.keys.held_by(i) >= version)
    });
    if s.live(ServerId(2)).is_some() {
        assert!(s.keys_settled(version).is_err(), "settled without server 2");
    }
    // Past the grace, server 2 is fenced, and the change settles once its lease is over.
    let settled = node.wait_state("the revocation settled", |s| {
        s.keys_settled(version).is_ok()
    });
    assert!(
        settled.live(ServerId(2)).is_none(),
        "server 2 was not fenced"
    );
    let one = settled.live(ServerId(1)).expect("server 1 stays live");
    assert_eq!(settled.keys.held_by(one), version);
    assert!(settled.now_ms >= settled.servers[&ServerId(2)].lease_until_ms);
    assert!(settled.keys.keys[&id].revoked);
    renewing.store(false, std::sync::atomic::Ordering::SeqCst);
    renewer.join().unwrap();
    node.kill();
}
