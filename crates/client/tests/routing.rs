//! Client routing over two in-process servers that share one store: requests reach the
//! server of their table, a moved table is followed through WRONG_SERVER, a handle opened
//! before a move keeps working after it, and a server that is gone is routed around.
//!
//! The servers do not hand out the delegation map yet (GetMap is ENOSYS), so a tiny fake
//! entry server plays the coordinator: it answers GetMap with the map the test sets, and
//! nothing else.

use kochab_client::{Client, ClientConfig};
use kochab_journal::JournalId;
use kochab_proto::auth::{ClusterKey, Transcript, prove_server};
use kochab_proto::cluster::{DelegationMap, Epoch, MapVersion, Placement, ServerId, TableId};
use kochab_proto::frame::{FRAME_HEADER_BYTES, FrameKind, decode_payload, encode_frame};
use kochab_proto::*;
use kochab_server::{RunningServer, ServerConfig, start, start_member};
use kochab_store::{LocalStore, ObjectStore};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn config(dir: &Path) -> ServerConfig {
    let mut c = ServerConfig::new(dir, "127.0.0.1:0".parse().unwrap());
    c.checkpoint_records = u64::MAX;
    c.checkpoint_interval = std::time::Duration::from_secs(3600);
    c
}

async fn member(dir: &Path, a: &RunningServer, server: u64) -> RunningServer {
    let store: Arc<dyn ObjectStore> = Arc::new(LocalStore::open(a.data_dir.join("store")).unwrap());
    let engine = a.shared().engine_config();
    start_member(
        config(dir),
        store,
        a.key,
        engine,
        JournalId { server, epoch: 1 },
        Vec::new(),
    )
    .await
    .unwrap()
}

/// The fake entry server: the current map, and how many times it was asked for it.
struct MapServer {
    addr: std::net::SocketAddr,
    map: Arc<Mutex<Option<DelegationMap>>>,
    asked: Arc<AtomicU64>,
}

impl MapServer {
    async fn start(key: ClusterKey, root: InodeId, map: Option<DelegationMap>) -> MapServer {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let map = Arc::new(Mutex::new(map));
        let asked = Arc::new(AtomicU64::new(0));
        let (m, a) = (map.clone(), asked.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve_maps(s, key, root, m.clone(), a.clone()));
            }
        });
        MapServer { addr, map, asked }
    }

    fn set(&self, map: DelegationMap) {
        *self.map.lock() = Some(map);
    }

    fn asked(&self) -> u64 {
        self.asked.load(Ordering::SeqCst)
    }
}

async fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(FrameKind, u64, Vec<u8>)> {
    loop {
        if let Ok(Some(h)) = kochab_proto::frame::parse_header(buf) {
            let payload = buf[FRAME_HEADER_BYTES..h.total_len].to_vec();
            buf.drain(..h.total_len);
            return Some((h.kind, h.request_id, payload));
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn send<T: serde::Serialize>(s: &mut TcpStream, kind: FrameKind, id: u64, msg: &T) {
    let mut out = Vec::new();
    encode_frame(&mut out, kind, id, msg).unwrap();
    let _ = s.write_all(&out).await;
}

async fn serve_maps(
    mut s: TcpStream,
    key: ClusterKey,
    root: InodeId,
    map: Arc<Mutex<Option<DelegationMap>>>,
    asked: Arc<AtomicU64>,
) {
    let nonce = [7u8; 32];
    send(
        &mut s,
        FrameKind::Challenge,
        0,
        &Challenge {
            version: PROTOCOL_VERSION,
            nonce,
        },
    )
    .await;
    let mut buf = Vec::new();
    let Some((FrameKind::Auth, _, payload)) = read_frame(&mut s, &mut buf).await else {
        return;
    };
    let auth: Auth = decode_payload(&payload).unwrap();
    let t = Transcript {
        server_nonce: nonce,
        client_nonce: auth.client_nonce,
        key_id: auth.key_id,
        client_id: auth.client_id,
    };
    let welcome = Welcome {
        server_id: 99,
        root,
        max_frame_bytes: 1 << 20,
        session: 1,
        mac: prove_server(&key, &t),
        incarnation: 1,
        durable_lsn: 0,
        lease_ms: 0,
    };
    send(&mut s, FrameKind::Welcome, 0, &welcome).await;
    while let Some((kind, id, payload)) = read_frame(&mut s, &mut buf).await {
        if kind != FrameKind::Request {
            return;
        }
        let req: Request = decode_payload(&payload).unwrap();
        let reply = match req.op {
            Op::GetMap => {
                asked.fetch_add(1, Ordering::SeqCst);
                match map.lock().clone() {
                    Some(m) => Reply::Map(m),
                    None => Reply::Error(fs_err!(ENOSYS, "no map yet")),
                }
            }
            Op::EndSession => Reply::Empty,
            // It serves no table.
            _ => Reply::WrongServer {
                map_version: 0,
                owner: None,
                addr: None,
            },
        };
        send(&mut s, FrameKind::Reply, id, &reply).await;
    }
}

/// Every table on server 1, except those `moved` (table id, owner); `servers` by id.
fn map_of(
    version: u64,
    ranges: &[(u64, u64)],
    moved: &[(u64, u32)],
    servers: &[&str],
) -> DelegationMap {
    let mut m = DelegationMap {
        version: MapVersion(version),
        ..Default::default()
    };
    for &(lo, hi) in ranges {
        let owner = moved.iter().find(|m| m.0 == lo).map_or(1, |m| m.1);
        m.tables.insert(
            TableId(lo),
            Placement {
                hi,
                owner: ServerId(owner),
                epoch: Epoch(1),
            },
        );
    }
    for (i, addr) in servers.iter().enumerate() {
        m.servers.insert(ServerId(i as u32 + 1), addr.to_string());
    }
    m
}

fn hosts(s: &RunningServer, id: InodeId) -> bool {
    s.shared().core().engine.inode(id).is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_follow_their_tables_across_moves_and_a_lost_server() {
    let tmp = tempfile::tempdir().unwrap();
    let a = start(config(&tmp.path().join("a"))).await.unwrap();
    let b = member(&tmp.path().join("b"), &a, 2).await;
    let root = a.root;
    let ranges = a.shared().hosted_tables();
    let (sa, sb) = (a.addr.to_string(), b.addr.to_string());
    let maps = MapServer::start(a.key, root, Some(map_of(1, &ranges, &[], &[&sa, &sb]))).await;

    let mut cfg = ClientConfig::with_entries(vec![maps.addr], a.key);
    cfg.request_timeout = std::time::Duration::from_secs(10);
    let c = Client::connect(cfg).await.unwrap();
    assert!(c.routes_by_map());
    assert_eq!(c.map_version(), 1);
    assert_eq!(maps.asked(), 1, "asked once, at connect");
    let cred = Credentials::root();

    // A top-level directory in another table than the root's (16 slots per table).
    let table_of = |id: InodeId| ranges.iter().find(|r| r.0 <= id && id < r.1).unwrap().0;
    let mut dir = None;
    for i in 0..40 {
        let d = c
            .mkdir(&cred, root, format!("d{i}").as_bytes(), 0o755)
            .await
            .unwrap();
        if table_of(d.id) != table_of(root) {
            dir = Some(d);
            break;
        }
    }
    let dir = dir.expect("a directory in another table");
    let moved = table_of(dir.id);
    let (f, h) = c
        .create_open(&cred, dir.id, b"f", 0o644, 0o2 /* O_RDWR */)
        .await
        .unwrap();
    c.write(&cred, h, 0, b"before the move".to_vec())
        .await
        .unwrap();

    // The directory's table moves to B; the coordinator's map says so.
    let s = a.shared().clone();
    tokio::task::spawn_blocking(move || s.drop_table(moved))
        .await
        .unwrap()
        .unwrap();
    let s = b.shared().clone();
    tokio::task::spawn_blocking(move || s.add_table(moved))
        .await
        .unwrap()
        .unwrap();
    maps.set(map_of(2, &ranges, &[(moved, 2)], &[&sa, &sb]));

    // The client still routes by map 1: A answers WRONG_SERVER, the client fetches map 2
    // and goes to B, invisibly.
    // Many requests at once: one GetMap answers them all.
    let lookups: Vec<_> = (0..8)
        .map(|_| {
            let c = c.clone();
            let cred = cred.clone();
            tokio::spawn(async move { c.lookup(&cred, dir.id, b"f").await })
        })
        .collect();
    for l in lookups {
        assert_eq!(l.await.unwrap().unwrap().id, f.id);
    }
    assert_eq!(c.map_version(), 2);
    assert_eq!(maps.asked(), 2, "one refetch");
    // The handle opened on A is unknown to B: reopened there, it reads and writes.
    assert_eq!(
        c.read(&cred, h, 0, 100).await.unwrap(),
        b"before the move".to_vec()
    );
    c.write(&cred, h, 0, b"AFTER".to_vec()).await.unwrap();
    assert_eq!(
        c.read(&cred, h, 0, 100).await.unwrap(),
        b"AFTERe the move".to_vec()
    );

    // Each table's requests reach its server: no more detours (the map is not asked).
    let on_b = c.create(&cred, dir.id, b"on-b", 0o644).await.unwrap();
    let on_a = c.create(&cred, root, b"on-a", 0o644).await.unwrap();
    assert!(hosts(&b, on_b.id) && !hosts(&a, on_b.id));
    assert!(hosts(&a, on_a.id) && !hosts(&b, on_a.id));
    assert_eq!(c.getattr(&cred, on_b.id).await.unwrap().id, on_b.id);
    assert_eq!(c.readdir_all(&cred, dir.id, false).await.unwrap().len(), 2);
    assert_eq!(maps.asked(), 2, "routed by map 2 without a detour");

    // A client entering at a server with a map of its own (the servers do not hand one
    // out) routes by it, and its status is that server's.
    for (entry, holds_moved) in [(a.addr, false), (b.addr, true)] {
        let mut cfg = ClientConfig::with_entries(vec![entry], a.key);
        cfg.map = Some(map_of(2, &ranges, &[(moved, 2)], &[&sa, &sb]));
        let pinned = Client::connect(cfg).await.unwrap();
        assert!(pinned.routes_by_map());
        let s = pinned.status().await.unwrap();
        assert_eq!(s.tables.iter().any(|t| t.lo == moved), holds_moved);
        assert_eq!(
            pinned.lookup(&cred, dir.id, b"on-b").await.unwrap().id,
            on_b.id
        );
        pinned.end_session().await.unwrap();
    }

    // B goes away (a clean stop); A takes the table back from B's journal. The client
    // finds B unreachable, fetches map 3 and follows the table to A.
    let b_journal = b.shared().journal().id();
    b.shutdown().await;
    let s = a.shared().clone();
    tokio::task::spawn_blocking(move || s.recover_tables(&[moved], b_journal))
        .await
        .unwrap()
        .unwrap();
    maps.set(map_of(3, &ranges, &[], &[&sa, &sb]));
    assert_eq!(
        c.read(&cred, h, 0, 5).await.unwrap(),
        b"AFTER".to_vec(),
        "A still holds the handle"
    );
    assert_eq!(c.map_version(), 3);
    assert!(c.lookup(&cred, dir.id, b"on-b").await.is_ok());

    // The table moves once more, to a third server, and the first request after it is a
    // handle's: A still knows the handle but not the file (ESTALE), so the client fetches
    // map 4 and reopens the handle at the new owner.
    let s = a.shared().clone();
    tokio::task::spawn_blocking(move || s.drop_table(moved))
        .await
        .unwrap()
        .unwrap();
    let d = member(&tmp.path().join("d"), &a, 3).await;
    let s = d.shared().clone();
    tokio::task::spawn_blocking(move || s.add_table(moved))
        .await
        .unwrap()
        .unwrap();
    let sd = d.addr.to_string();
    maps.set(map_of(4, &ranges, &[(moved, 3)], &[&sa, &sb, &sd]));
    assert_eq!(c.read(&cred, h, 0, 5).await.unwrap(), b"AFTER".to_vec());
    assert_eq!(c.map_version(), 4);
    assert_eq!(maps.asked(), 4);

    // And back to A, with an open as the first request: D, having let the table go,
    // answers it ESTALE (not WRONG_SERVER); the client refetches the map all the same.
    let s = d.shared().clone();
    tokio::task::spawn_blocking(move || s.drop_table(moved))
        .await
        .unwrap()
        .unwrap();
    let s = a.shared().clone();
    tokio::task::spawn_blocking(move || s.add_table(moved))
        .await
        .unwrap()
        .unwrap();
    maps.set(map_of(5, &ranges, &[], &[&sa, &sb, &sd]));
    let (_, h2) = c.open(&cred, f.id, 0).await.unwrap();
    assert_eq!(c.map_version(), 5);
    assert_eq!(maps.asked(), 5);
    assert_eq!(c.read(&cred, h2, 0, 5).await.unwrap(), b"AFTER".to_vec());
    c.close(&cred, h2).await.unwrap();
    c.write(&cred, h, 5, b"!".to_vec()).await.unwrap();
    assert_eq!(
        c.getattr(&cred, f.id).await.unwrap().size,
        b"AFTERe the move".len() as u64
    );
    c.close(&cred, h).await.unwrap();
    c.end_session().await.unwrap();
    d.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_server_without_a_map_serves_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let a = start(config(&tmp.path().join("a"))).await.unwrap();
    // The first entry address is dead: the next one is used.
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let c = Client::connect(ClientConfig::with_entries(vec![dead, a.addr], a.key))
        .await
        .unwrap();
    assert!(!c.routes_by_map(), "GetMap is ENOSYS: single-server mode");
    assert_eq!(c.map_version(), 0);
    let cred = Credentials::root();
    let d = c.mkdir(&cred, c.root(), b"d", 0o755).await.unwrap();
    let (_, h) = c.create_open(&cred, d.id, b"f", 0o644, 0o2).await.unwrap();
    c.write(&cred, h, 0, b"x".to_vec()).await.unwrap();
    assert_eq!(c.read(&cred, h, 0, 10).await.unwrap(), b"x".to_vec());
    c.close(&cred, h).await.unwrap();
    c.end_session().await.unwrap();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_found_no_map_routes_by_one_once_a_server_says_wrong_server() {
    let tmp = tempfile::tempdir().unwrap();
    let a = start(config(&tmp.path().join("a"))).await.unwrap();
    let ranges = a.shared().hosted_tables();
    let maps = MapServer::start(a.key, a.root, None).await;
    let c = Client::connect(ClientConfig::new(maps.addr, a.key))
        .await
        .unwrap();
    assert!(!c.routes_by_map(), "no map at connect: single-server mode");
    let sa = a.addr.to_string();
    maps.set(map_of(1, &ranges, &[], &[&sa]));
    // The entry serves no table; when it says so, the client asks it for a map again.
    let cred = Credentials::root();
    let d = c.mkdir(&cred, c.root(), b"d", 0o755).await.unwrap();
    assert!(c.routes_by_map());
    assert!(hosts(&a, d.id));
    a.shutdown().await;
}
