//! Client keys are cluster state (`kochab up --servers 3`): a key added through one server
//! works on all three; keys added through different servers, one at a time and at once,
//! get different ids and work everywhere; once `kochab key revoke` returns, every server
//! refuses the key (a new connection to each server's own address is refused, a connection
//! opened before is closed); after the whole cluster restarts the key is still revoked and
//! the others still work. The coordinator's files, which now hold the keys (sealed), are
//! for their owner alone. A single server's keys go with its data directory when it
//! becomes a cluster's. A revoked key's client that reads nothing cannot keep its
//! connection, nor get its server fenced.

mod common;

use common::{ServerProc, kochab_bin, runtime, status};
use kochab_client::conn::{Conn, ConnError};
use kochab_proto::auth::{ClientKey, client_key_from_text};
use kochab_proto::{Credentials, Errno, KeyPolicy, Op, Reply, Request};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Servers of the cluster.
const SERVERS: usize = 3;
/// A key command's longest wait here: a healthy cluster settles a change in well under a
/// second; the bound with a server to fence is a lease or two (2 s leases here).
const KEY_OP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection may take to be refused, or to show it was closed.
const CONN_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `kochab key --cluster ADDR --key-file ADMIN ARGS...`: exit code, stdout, stderr.
fn key_cli(addr: SocketAddr, admin: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(kochab_bin())
        .args(["key", "--cluster", &addr.to_string(), "--key-file"])
        .arg(admin)
        .args(args)
        .env_remove("KOCHAB_KEY")
        .output()
        .expect("run kochab key");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every server's own address, once all `n` answer and hold a table. Panics with the log
/// after 90 s.
fn server_addrs(server: &ServerProc, n: usize) -> Vec<SocketAddr> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(v) = status(server) {
            let ready: Vec<SocketAddr> = v["servers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["tables"].as_array().is_some_and(|t| !t.is_empty()))
                .filter_map(|s| s["addr"].as_str()?.parse().ok())
                .collect();
            if ready.len() == n {
                return ready;
            }
            last = Some(v);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!(
        "{n} servers not ready within 90 s; last status {last:#?}\nlog:\n{}",
        server.log_text()
    );
}

fn request(op: Op) -> Request {
    Request {
        cred: Credentials::user(1000, 1000),
        seq: 0,
        seq_floor: 0,
        map_version: 0,
        mode: Default::default(),
        op,
    }
}

/// A connection to exactly `addr` with `key` (no routing, no retry).
async fn connect(addr: SocketAddr, key: &ClientKey) -> Result<Arc<Conn>, ConnError> {
    let client_id = kochab_proto::auth::random_u64();
    match tokio::time::timeout(
        CONN_TIMEOUT,
        Conn::connect(addr, key, client_id, CONN_TIMEOUT),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(ConnError::Lost(format!("{addr}: no answer in time"))),
    }
}

/// Asserts that `key` authenticates at `addr` and is served there (the map: any server
/// answers it, whichever tables it holds).
async fn works_at(addr: SocketAddr, key: &ClientKey) -> Arc<Conn> {
    let conn = match connect(addr, key).await {
        Ok(c) => c,
        Err(ConnError::Refused(e)) => panic!("key {} refused by {addr}: {e:?}", key.id),
        Err(ConnError::Lost(e)) => panic!("key {} at {addr}: {e}", key.id),
    };
    match conn.call(&request(Op::GetMap)).await {
        Ok(Reply::Map(_)) => conn,
        other => panic!("key {} at {addr}: the map: {other:?}", key.id),
    }
}

/// Asserts that `addr` refuses `key` with EACCES (a revoked key).
async fn refused_at(addr: SocketAddr, key: &ClientKey) {
    match connect(addr, key).await {
        Err(ConnError::Refused(e)) => {
            assert_eq!(e.errno, Errno::EACCES, "key {} at {addr}: {e:?}", key.id)
        }
        Err(ConnError::Lost(e)) => panic!("key {} at {addr}: not refused but lost: {e}", key.id),
        Ok(_) => panic!("key {} still authenticates at {addr}", key.id),
    }
}

/// `KeyAdd` sent to exactly `addr` with the cluster key: the new key.
async fn add_at(addr: SocketAddr, admin: ClientKey, note: String) -> ClientKey {
    let conn = connect(addr, &admin).await.expect("admin connection");
    let mut req = request(Op::KeyAdd {
        policy: KeyPolicy::TRUSTED,
        note,
    });
    req.cred = Credentials::root();
    match tokio::time::timeout(KEY_OP_TIMEOUT, conn.call(&req)).await {
        Ok(Ok(Reply::KeyAdded { id, key })) => ClientKey { id, key },
        other => panic!("key add at {addr}: {other:?}"),
    }
}

/// `kochab key add` through `addr`: the new key, from the file it wrote.
fn add_cli(addr: SocketAddr, admin: &Path, out: &Path) -> ClientKey {
    let (code, stdout, stderr) = key_cli(
        addr,
        admin,
        &["add", "--out", out.to_str().expect("utf8"), "--note", "cli"],
    );
    assert_eq!(code, Some(0), "key add: {stdout} {stderr}");
    client_key_from_text(&std::fs::read_to_string(out).expect("key file")).expect("a key")
}

/// Every regular file under `dir` has mode 0600 (directories 0700).
fn private_tree(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for e in std::fs::read_dir(dir).expect("read dir").flatten() {
        let path = e.path();
        let meta = e.metadata().expect("metadata");
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() {
            assert_eq!(mode, 0o700, "{}", path.display());
            private_tree(&path);
        } else {
            assert_eq!(mode, 0o600, "{}", path.display());
        }
    }
}

#[test]
fn client_keys_are_the_clusters_and_a_revocation_holds_on_every_server() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let args = ["--servers", "3", "--lease", "2"];
    let up = ServerProc::start(&data, &args);
    let admin_file = data.join("cluster.key");
    let admin = ClientKey::admin(up.key);
    let addrs = server_addrs(&up, SERVERS);
    let rt = runtime();

    // A key added through one server works on all three.
    let k = add_cli(addrs[0], &admin_file, &tmp.path().join("k.key"));
    let mut ids = BTreeSet::from([k.id]);
    let mut others = Vec::new();
    rt.block_on(async {
        for a in &addrs {
            works_at(*a, &k).await;
        }
        // Ids are the cluster's: keys added through each server, then through all at once,
        // never share one, and each works everywhere.
        for (i, a) in addrs.iter().enumerate() {
            others.push(add_at(*a, admin, format!("one at a time {i}")).await);
        }
        let at_once: Vec<_> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| tokio::spawn(add_at(*a, admin, format!("at once {i}"))))
            .collect();
        for t in at_once {
            others.push(t.await.expect("key add task"));
        }
        for o in &others {
            assert!(ids.insert(o.id), "key id {} given twice: {others:?}", o.id);
            for a in &addrs {
                works_at(*a, o).await;
            }
        }
    });
    assert_eq!(ids.len(), 1 + 2 * SERVERS);

    // Revoked through the second server: once the command returns, every server refuses
    // the key and its connections opened before are closed.
    rt.block_on(async {
        let mut open = Vec::new();
        for a in &addrs {
            open.push((*a, works_at(*a, &k).await));
        }
        let started = Instant::now();
        let (code, out, err) = tokio::task::block_in_place(|| {
            key_cli(addrs[1], &admin_file, &["revoke", &k.id.to_string()])
        });
        assert_eq!(code, Some(0), "revoke: {out} {err}");
        eprintln!("key revoke took {:?}", started.elapsed());
        for (a, conn) in open {
            let r = tokio::time::timeout(CONN_TIMEOUT, conn.call(&request(Op::GetMap))).await;
            assert!(
                matches!(r, Ok(Err(_))),
                "a connection of the revoked key at {a} is still served: {r:?}"
            );
            assert!(
                !conn.is_alive(),
                "{a} left the revoked key's connection open"
            );
        }
        for a in &addrs {
            refused_at(*a, &k).await;
        }
        for o in &others {
            works_at(addrs[2], o).await;
        }
    });
    let (code, out, err) = key_cli(addrs[2], &admin_file, &["list"]);
    assert_eq!(code, Some(0), "list: {out} {err}");
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&k.id.to_string()))
        .unwrap_or_else(|| panic!("key {} not listed: {out}", k.id));
    assert!(line.contains("revoked"), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("active")).count(),
        others.len(),
        "{out}"
    );

    // The whole cluster restarts: the key stays revoked everywhere, the others work.
    let mut up = up;
    assert_eq!(up.stop(), Some(0), "clean stop; log:\n{}", up.log_text());
    private_tree(&data.join("coord"));
    let up = ServerProc::start(&data, &args);
    let addrs = server_addrs(&up, SERVERS);
    rt.block_on(async {
        for a in &addrs {
            refused_at(*a, &k).await;
            works_at(*a, &others[0]).await;
            works_at(*a, &others[others.len() - 1]).await;
        }
    });
}

#[test]
fn a_single_servers_keys_go_with_its_directory_into_a_cluster() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut single = ServerProc::start(&data, &[]);
    let admin_file = data.join("cluster.key");
    let kept = add_cli(single.addr, &admin_file, &tmp.path().join("kept.key"));
    let gone = add_cli(single.addr, &admin_file, &tmp.path().join("gone.key"));
    let (code, out, err) = key_cli(single.addr, &admin_file, &["revoke", &gone.id.to_string()]);
    assert_eq!(code, Some(0), "revoke: {out} {err}");
    assert_eq!(single.stop(), Some(0));

    let up = ServerProc::start(&data, &["--servers", "2", "--lease", "2"]);
    let addrs = server_addrs(&up, 2);
    let admin = ClientKey::admin(up.key);
    runtime().block_on(async {
        for a in &addrs {
            works_at(*a, &kept).await;
            refused_at(*a, &gone).await;
        }
        // Ids go on from the imported ones.
        let next = add_at(addrs[1], admin, "after the import".into()).await;
        assert!(next.id > gone.id, "id {} reused", next.id);
        works_at(addrs[0], &next).await;
    });
}

/// Every server's epoch by its id, as the cluster's status shows it.
fn epochs(up: &ServerProc) -> std::collections::BTreeMap<u64, u64> {
    let v = status(up).expect("status");
    v["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["id"].as_u64()?, s["epoch"].as_u64()?)))
        .collect()
}

/// A raw connection to `addr` authenticated with `key` (the welcome read, nothing else).
fn raw_connection(addr: SocketAddr, key: &ClientKey) -> std::net::TcpStream {
    use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, encode_frame, parse_header};
    use kochab_proto::{Auth, Challenge, FrameKind};
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(CONN_TIMEOUT)).expect("timeout");
    let read_frame = |s: &mut std::net::TcpStream| {
        let mut buf = Vec::new();
        loop {
            if let Some(h) = parse_header(&buf).expect("frame header") {
                return (h.kind, buf[FRAME_HEADER_BYTES..h.total_len].to_vec());
            }
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).expect("read");
            assert!(n > 0, "closed during the handshake");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let (_, payload) = read_frame(&mut s);
    let ch: Challenge = decode_payload(&payload).expect("challenge");
    let (auth, _) = Auth::prove(key, ch.nonce, [1; 32], 77);
    let mut out = Vec::new();
    encode_frame(&mut out, FrameKind::Auth, 0, &auth).expect("auth frame");
    s.write_all(&out).expect("auth");
    assert_eq!(read_frame(&mut s).0, FrameKind::Welcome);
    s
}

#[test]
fn a_revoked_key_that_reads_nothing_is_cut_off_without_fencing_its_server() {
    use kochab_proto::FrameKind;
    use kochab_proto::frame::encode_frame;
    use std::io::Write;
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let up = ServerProc::start(&data, &["--servers", "2", "--lease", "2"]);
    let addrs = server_addrs(&up, 2);
    let admin_file = data.join("cluster.key");
    let k = add_cli(addrs[0], &admin_file, &tmp.path().join("k.key"));
    let before = epochs(&up);
    // Requests pipelined without reading a reply: the server's writer blocks on the full
    // socket, its reply backlog fills, and its reader stops reading (the rest of the
    // requests wait in the sockets: the thread writing them blocks).
    let s = raw_connection(addrs[1], &k);
    let mut out = Vec::new();
    for i in 0..1_000_000u64 {
        encode_frame(&mut out, FrameKind::Request, i + 1, &request(Op::GetMap)).expect("frame");
    }
    let (done_tx, done) = std::sync::mpsc::channel();
    let mut w = s.try_clone().expect("clone");
    std::thread::spawn(move || {
        let _ = done_tx.send(w.write_all(&out));
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        done.try_recv().is_err(),
        "the server read every request: the test needs more to block it"
    );
    let started = Instant::now();
    let (code, out, err) = key_cli(addrs[0], &admin_file, &["revoke", &k.id.to_string()]);
    assert_eq!(code, Some(0), "revoke: {out} {err}");
    eprintln!(
        "key revoke with a connection that reads nothing took {:?}",
        started.elapsed()
    );
    // The server cut the connection: the blocked write fails.
    match done.recv_timeout(CONN_TIMEOUT) {
        Ok(r) => assert!(r.is_err(), "every request was written: {r:?}"),
        Err(_) => panic!("the revoked key's connection at {} is still open", addrs[1]),
    }
    // By closing it, not by being fenced.
    assert_eq!(epochs(&up), before, "a server was fenced");
    runtime().block_on(refused_at(addrs[1], &k));
    drop(s);
}
