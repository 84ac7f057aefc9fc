//! Metadata servers as processes: one `kochab coord` and two `kochab mds` on loopback over
//! one data directory whose tables were all released. The coordinator places every table,
//! moves one to the other server (DROP and ADD over the network), a native client creates
//! and stats a file on the server of the root's table, and a request for the moved table
//! gets WRONG_SERVER naming its owner and address.

mod common;

use common::{Procs, free_addr, kochab_bin, spawn_ready};
use kochab_client::conn::Conn;
use kochab_client::{Client, ClientConfig};
use kochab_cluster::state::CoordState;
use kochab_coord::CoordClient;
use kochab_proto::auth::ClientKey;
use kochab_proto::cluster::{Control, ControlBody, CoordCommand, CoordReply, ServerId};
use kochab_proto::{Credentials, Errno, KeyPolicy, Op, Reply, Request};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A data directory holding a cluster with a root whose every table is released, as
/// `kochab up --servers N` leaves it: the single server starts once, lets every table go.
fn prepare(data: &Path) {
    let rt = common::runtime();
    let server = rt
        .block_on(kochab_server::start(kochab_server::ServerConfig::new(
            data,
            "127.0.0.1:0".parse().unwrap(),
        )))
        .unwrap();
    for (lo, _) in server.shared().hosted_tables() {
        server.shared().drop_table(lo).unwrap();
    }
    rt.block_on(server.shutdown());
}

fn coord_status(coord: SocketAddr, key: &Path) -> serde_json::Value {
    let out = Command::new(kochab_bin())
        .args(["coord-status", "--json", "--coord", &coord.to_string()])
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

fn wait_until(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn request(op: Op) -> Request {
    Request {
        cred: Credentials::root(),
        seq: 0,
        seq_floor: 0,
        map_version: 0,
        mode: Default::default(),
        op,
    }
}

/// One coordinator (lease `lease` seconds) and servers 2 and 3 over a prepared data
/// directory, once every table is placed.
struct Cluster {
    tmp: tempfile::TempDir,
    procs: Procs,
    coord: SocketAddr,
    addrs: std::collections::BTreeMap<ServerId, SocketAddr>,
    /// Index of each server's process in `procs`.
    index: std::collections::BTreeMap<ServerId, usize>,
    data: std::path::PathBuf,
    key_file: std::path::PathBuf,
    key: [u8; 32],
}

fn cluster(lease: u32) -> Cluster {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    prepare(&data);
    let key_file = data.join(kochab_server::KEY_FILE);
    let key = kochab_server::read_key_file(&key_file).unwrap();
    let mut procs = Procs::default();

    let coord = free_addr();
    let s = |x: &str| x.to_string();
    procs.0.push(spawn_ready(
        &[
            s("coord"),
            s("--id"),
            s("1"),
            s("--listen"),
            coord.to_string(),
            s("--peers"),
            format!("1={coord}"),
            s("--data"),
            tmp.path().join("coord").display().to_string(),
            s("--bootstrap"),
            // These tests place tables by hand.
            s("--no-balance"),
            s("--lease"),
            lease.to_string(),
            s("--key-file"),
            key_file.display().to_string(),
        ],
        &tmp.path().join("coord.log"),
        "ready at",
    ));
    let mut addrs = std::collections::BTreeMap::new();
    let mut index = std::collections::BTreeMap::new();
    for id in [2u32, 3] {
        let addr = free_addr();
        addrs.insert(ServerId(id), addr);
        index.insert(ServerId(id), procs.0.len());
        procs.0.push(spawn_ready(
            &[
                s("mds"),
                s("--id"),
                id.to_string(),
                s("--listen"),
                addr.to_string(),
                s("--coord"),
                coord.to_string(),
                s("--data"),
                data.display().to_string(),
                s("--key-file"),
                key_file.display().to_string(),
            ],
            &tmp.path().join(format!("mds{id}.log")),
            "serving at",
        ));
    }
    // Placement: every table has an owner and nothing is moving.
    wait_until("every table placed", 60, || {
        let st = &coord_status(coord, &key_file)["state"];
        st["tables"].as_u64().is_some_and(|n| n > 0)
            && st["placed"] == st["tables"]
            && st["migrations"] == 0
            && st["servers"].as_array().is_some_and(|v| v.len() == 2)
    });

    Cluster {
        tmp,
        procs,
        coord,
        addrs,
        index,
        data,
        key_file,
        key,
    }
}

#[test]
fn two_mds_processes_serve_the_tables_the_coordinator_places() {
    let Cluster {
        tmp: _tmp,
        procs: _procs,
        coord,
        addrs,
        data,
        key_file,
        key,
        ..
    } = cluster(10);
    let rt = common::runtime();
    let coord_client =
        CoordClient::<CoordState>::new(kochab_coord::ClientConfig::new(vec![coord], key));
    let map = || rt.block_on(coord_client.read_state()).unwrap().0.map;
    let m = map();
    // The root's id, as any server announces it.
    let any = *addrs.values().next().unwrap();
    let root = rt
        .block_on(Client::connect(ClientConfig::new(any, key)))
        .unwrap()
        .root();
    let (root_table, p) = m.table_of(root).expect("the root's table is placed");
    let a = p.owner;
    let b = *addrs.keys().find(|s| **s != a).unwrap();
    // Move another table to the other server: a DROP and an ADD over the network.
    let moved = *m.tables.keys().find(|t| **t != root_table).unwrap();
    let r = rt
        .block_on(coord_client.propose(CoordCommand::Move {
            table: moved,
            to: b,
        }))
        .unwrap();
    if m.owner(moved) != Some(b) {
        assert_eq!(r, CoordReply::Ok, "move of {moved:?} to {b:?}");
    }
    wait_until("the moved table at its new owner", 60, || {
        let st = rt.block_on(coord_client.read_state()).unwrap().0;
        st.map.owner(moved) == Some(b) && st.migrations.is_empty()
    });

    // A native client on the server of the root's table creates and stats a file.
    let client = rt
        .block_on(Client::connect(ClientConfig::new(addrs[&a], key)))
        .unwrap();
    let cred = Credentials::root();
    let made = rt
        .block_on(client.mknod(&cred, root, b"hello", 0o100644, 0, true))
        .unwrap();
    let seen = rt.block_on(client.lookup(&cred, root, b"hello")).unwrap();
    assert_eq!(made.id, seen.id);
    assert_eq!(
        rt.block_on(client.getattr(&cred, made.id)).unwrap().id,
        made.id
    );

    // The moved table's ids: WRONG_SERVER at the root's server, naming the owner; served
    // by the owner (no such inode there, but admitted).
    let conn_to = |addr: SocketAddr| {
        rt.block_on(Conn::connect(addr, &key.into(), 77, Duration::from_secs(5)))
            .unwrap_or_else(|_| panic!("connect {addr}"))
    };
    let at_a = conn_to(addrs[&a]);
    let stat_moved = request(Op::GetAttr { id: moved.0 + 1 });
    match rt.block_on(at_a.call(&stat_moved)).unwrap() {
        Reply::WrongServer { owner, addr, .. } => {
            assert_eq!(
                owner,
                Some(b),
                "root's server {a:?}, moved {moved:?} to {b:?}"
            );
            assert_eq!(addr, Some(addrs[&b].to_string()));
        }
        other => panic!("expected WRONG_SERVER, got {other:?}"),
    }
    let at_b = conn_to(addrs[&b]);
    match rt.block_on(at_b.call(&stat_moved)).unwrap() {
        Reply::Error(e) => assert_eq!(e.errno, Errno::ENOENT, "{e}"),
        other => panic!("expected ENOENT from the owner, got {other:?}"),
    }
    // Control messages only with the cluster key: a client key gets EPERM.
    let added = rt
        .block_on(at_a.call(&request(Op::KeyAdd {
            policy: KeyPolicy::TRUSTED,
            note: "not the coordinator".into(),
        })))
        .unwrap();
    let Reply::KeyAdded {
        id,
        key: client_key,
    } = added
    else {
        panic!("key add: {added:?}");
    };
    let as_client = rt
        .block_on(Conn::connect(
            addrs[&a],
            &ClientKey {
                id,
                key: client_key,
            },
            78,
            Duration::from_secs(5),
        ))
        .unwrap_or_else(|_| panic!("connect with the client key"));
    let st = rt.block_on(coord_client.read_state()).unwrap().0;
    let control = Control {
        to: st.live(b).unwrap(),
        body: ControlBody::Drop {
            table: moved,
            map_version: st.map.version,
            to: a,
        },
    };
    match rt
        .block_on(as_client.call(&request(Op::Control { control })))
        .unwrap()
    {
        Reply::Error(e) => assert_eq!(e.errno, Errno::EPERM, "{e}"),
        other => panic!("a client key's control was answered: {other:?}"),
    }
    // A second process with a server's id refuses to start (one journal per incarnation).
    let out = Command::new(kochab_bin())
        .args(["mds", "--id", &a.0.to_string(), "--listen"])
        .arg(free_addr().to_string())
        .args(["--coord", &coord.to_string(), "--data"])
        .arg(&data)
        .arg("--key-file")
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is in use by"), "{err}");

    // Any server answers GetMap with the coordinator's map (at most ~200 ms old).
    wait_until("GetMap showing the move", 10, || {
        match rt.block_on(at_b.call(&request(Op::GetMap))).unwrap() {
            Reply::Map(m) => {
                assert_eq!(m.owner(root_table), Some(a));
                assert_eq!(m.servers.get(&b), Some(&addrs[&b].to_string()));
                m.owner(moved) == Some(b)
            }
            other => panic!("expected the map, got {other:?}"),
        }
    });

    // The native client routes by the map: entering at either server, a request for the
    // moved table's ids reaches its owner (ENOENT there, not WRONG_SERVER), and the file
    // made under the root is found through both.
    for entry in [addrs[&a], addrs[&b]] {
        let c = rt
            .block_on(Client::connect(ClientConfig::new(entry, key)))
            .unwrap();
        assert!(c.routes_by_map(), "entered at {entry}");
        let e = rt.block_on(c.getattr(&cred, moved.0 + 1)).unwrap_err();
        assert_eq!(e.errno, Errno::ENOENT, "{e}");
        let seen = rt.block_on(c.lookup(&cred, root, b"hello")).unwrap();
        assert_eq!(seen.id, made.id);
        rt.block_on(c.end_session()).unwrap();
    }
}

#[test]
fn id_1_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(kochab_bin())
        .args(["mds", "--id", "1", "--listen", "127.0.0.1:7999", "--coord"])
        .arg("127.0.0.1:7998")
        .arg("--data")
        .arg(tmp.path())
        .arg("--key-file")
        .arg(tmp.path().join("none"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ids from 2"), "{err}");
}

/// A server paused past its lease (SIGSTOP) is fenced: the coordinator recovers its tables
/// on the other server from its journal, and when it resumes (SIGCONT) it serves nothing
/// and exits with status 3.
#[test]
fn a_server_paused_past_its_lease_is_fenced_and_its_tables_recovered() {
    let mut c = cluster(3);
    let rt = common::runtime();
    let coord_client =
        CoordClient::<CoordState>::new(kochab_coord::ClientConfig::new(vec![c.coord], c.key));
    let st = rt.block_on(coord_client.read_state()).unwrap().0;
    let any = *c.addrs.values().next().unwrap();
    let root = rt
        .block_on(Client::connect(ClientConfig::new(any, c.key)))
        .unwrap()
        .root();
    let (root_table, p) = st.map.table_of(root).unwrap();
    let a = p.owner;
    let b = *c.addrs.keys().find(|s| **s != a).unwrap();
    // Give b the root's table, with a file made there (in b's journal only).
    let r = rt
        .block_on(coord_client.propose(CoordCommand::Move {
            table: root_table,
            to: b,
        }))
        .unwrap();
    assert_eq!(r, CoordReply::Ok);
    wait_until("the root's table at b", 60, || {
        let st = rt.block_on(coord_client.read_state()).unwrap().0;
        st.map.owner(root_table) == Some(b) && st.migrations.is_empty()
    });
    let at_b = rt
        .block_on(Client::connect(ClientConfig::new(c.addrs[&b], c.key)))
        .unwrap();
    let cred = Credentials::root();
    let made = rt
        .block_on(at_b.mknod(&cred, root, b"before-pause", 0o100644, 0, true))
        .unwrap();
    drop(at_b);

    let pid = c.procs.0[c.index[&b]].id() as i32;
    // A raw connection to b, made while it serves: a request written to it while b is
    // stopped must find no answer when b resumes.
    let mut held = common::RawConn::connect(c.addrs[&b], &c.key, 0xfe).unwrap();
    common::stop_process(pid);
    wait_until("b's tables recovered on a", 60, || {
        let st = rt.block_on(coord_client.read_state()).unwrap().0;
        st.map.owner(root_table) == Some(a) && st.migrations.is_empty()
    });
    let at_a = rt
        .block_on(Client::connect(ClientConfig::new(c.addrs[&a], c.key)))
        .unwrap();
    let seen = rt
        .block_on(at_a.lookup(&cred, root, b"before-pause"))
        .unwrap();
    assert_eq!(
        seen.id, made.id,
        "the file b acknowledged is on a after recovery"
    );
    let fenced = |n: u64| {
        kochab_proto::Request::plain(
            &cred,
            Op::Mknod {
                parent: root,
                name: format!("fenced{n}").into_bytes(),
                mode: 0o100644,
                rdev: 0,
                exclusive: true,
            },
        )
    };
    held.send(1, &fenced(0)).unwrap();
    // Resumed (SIGCONT), b must answer no one, on the old connection or new ones, until
    // it exits.
    let (addr, key) = (c.addrs[&b], c.key);
    let child = &mut c.procs.0[c.index[&b]];
    let refused = common::resume_and_probe_fenced(
        pid,
        addr,
        &key,
        held,
        fenced,
        || child.try_wait().unwrap().is_some(),
        Duration::from_secs(20),
    );
    eprintln!("the fenced server refused {refused} requests before it exited");
    let status = child.try_wait().unwrap().expect("exited");
    assert_eq!(status.code(), Some(3), "{status:?}");
    for n in 0..refused + 1 {
        let name = format!("fenced{n}");
        assert!(
            rt.block_on(at_a.lookup(&cred, root, name.as_bytes()))
                .is_err(),
            "{name} was made by the fenced server"
        );
    }
    let log = std::fs::read_to_string(c.tmp.path().join(format!("mds{}.log", b.0))).unwrap();
    assert!(log.contains("is fenced"), "{log}");
}
