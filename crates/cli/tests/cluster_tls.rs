//! A cluster on "separate hosts" with TLS throughout, on loopback: three `kochab coord`
//! replicas and two `kochab mds` processes, all given --tls-cert/--tls-key/--tls-ca (a
//! throw-away authority and one certificate for 127.0.0.1 made here with openssl). A
//! client over TLS creates, writes and reads files on both servers and renames one from a
//! directory of one server into a directory of the other; `kochab status --tls-ca` reaches
//! the servers and the replicas. Without TLS, neither the servers nor the replicas serve;
//! a replica whose certificate names another host is refused.

mod common;

use common::{Procs, free_addr, kochab_bin, metric_at, spawn_ready};
use kochab_client::tls::TlsClient;
use kochab_client::{Client, ClientConfig};
use kochab_cluster::state::CoordState;
use kochab_coord::CoordClient;
use kochab_proto::Credentials;
use kochab_proto::cluster::ServerId;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const O_RDWR: u32 = 2;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn genkey(dir: &Path, out: &str) {
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            out,
        ],
    );
}

/// `ca.pem`, `node.pem` (key `node.key`) signed by it for IP:127.0.0.1 and DNS:localhost,
/// which every process of this loopback "cluster" uses, and `elsewhere.pem` (key
/// `elsewhere.key`), signed by it too but for DNS:elsewhere.example only.
fn make_certs(dir: &Path) {
    genkey(dir, "ca.key");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-subj",
            "/CN=kochab test CA",
            "-days",
            "2",
            "-out",
            "ca.pem",
        ],
    );
    leaf(dir, "node", "IP:127.0.0.1,DNS:localhost");
    leaf(dir, "elsewhere", "DNS:elsewhere.example");
}

/// `NAME.pem` and `NAME.key`, signed by `ca.pem`, whose subject-alternative names are `san`.
fn leaf(dir: &Path, name: &str, san: &str) {
    let (key, csr, pem, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}.cnf"),
    );
    genkey(dir, &key);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &key,
            "-subj",
            "/CN=kochab node",
            "-out",
            &csr,
        ],
    );
    std::fs::write(
        dir.join(&ext),
        format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &pem,
        ],
    );
}

/// A data directory holding a cluster whose every table is released, as `kochab up
/// --servers N` leaves it.
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

fn kochab(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(kochab_bin())
        .args(args)
        .env_remove("KOCHAB_TLS_CA")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_cluster_of_coordinators_and_servers_talks_tls_throughout() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    make_certs(&certs);
    let p = |f: &str| certs.join(f).display().to_string();
    let (ca, cert, tls_key) = (p("ca.pem"), p("node.pem"), p("node.key"));
    let tls_args =
        || ["--tls-cert", &cert, "--tls-key", &tls_key, "--tls-ca", &ca].map(str::to_string);
    let data = tmp.path().join("data");
    prepare(&data);
    let key_file = data.join(kochab_server::KEY_FILE);
    let key = kochab_server::read_key_file(&key_file).unwrap();
    let kf = key_file.display().to_string();
    let s = |x: &str| x.to_string();
    let mut procs = Procs::default();

    let coords: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = coords
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    for (i, addr) in coords.iter().enumerate() {
        let mut args = vec![
            s("coord"),
            s("--id"),
            (i + 1).to_string(),
            s("--listen"),
            addr.to_string(),
            s("--peers"),
            peers.clone(),
            s("--data"),
            tmp.path().join(format!("coord{i}")).display().to_string(),
            s("--lease"),
            s("3"),
            s("--key-file"),
            kf.clone(),
        ];
        if i == 0 {
            args.push(s("--bootstrap"));
        }
        args.extend(tls_args());
        procs.0.push(spawn_ready(
            &args,
            &tmp.path().join(format!("coord{i}.log")),
            "ready at",
        ));
    }
    let coord_list = coords
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut servers = std::collections::BTreeMap::new();
    let mut metrics = Vec::new();
    for id in [2u32, 3] {
        let addr = free_addr();
        let metrics_addr = free_addr();
        metrics.push(metrics_addr);
        servers.insert(ServerId(id), addr);
        let mut args = vec![
            s("mds"),
            s("--id"),
            id.to_string(),
            s("--listen"),
            addr.to_string(),
            s("--coord"),
            coord_list.clone(),
            s("--data"),
            data.display().to_string(),
            s("--key-file"),
            kf.clone(),
            // Renames between the servers run as transactions over member links (TLS).
            s("--multi-server"),
            s("txn"),
            s("--metrics"),
            metrics_addr.to_string(),
        ];
        args.extend(tls_args());
        procs.0.push(spawn_ready(
            &args,
            &tmp.path().join(format!("mds{id}.log")),
            "serving at",
        ));
    }

    let rt = common::runtime();
    let tls = TlsClient::from_ca_file(&certs.join("ca.pem")).unwrap();
    let mut coord_cfg = kochab_coord::ClientConfig::new(coords.clone(), key);
    coord_cfg.tls = Some(tls.clone());
    let coord = CoordClient::<CoordState>::new(coord_cfg);
    // Every table placed, on both servers (the balancer evens the counts out): the
    // coordinator reached both servers over TLS to hand them their tables.
    let deadline = Instant::now() + Duration::from_secs(25);
    let map = loop {
        if let Ok((st, _)) = rt.block_on(coord.read_state()) {
            let owners: std::collections::BTreeSet<ServerId> =
                st.map.tables.values().map(|p| p.owner).collect();
            if st.bootstrapped
                && st.unplaced.is_empty()
                && !st.map.tables.is_empty()
                && st.migrations.is_empty()
                && owners.len() == 2
            {
                break st.map;
            }
        }
        assert!(
            Instant::now() < deadline,
            "tables not placed on both servers; coord0 log:\n{}\nmds2 log:\n{}",
            std::fs::read_to_string(tmp.path().join("coord0.log")).unwrap_or_default(),
            std::fs::read_to_string(tmp.path().join("mds2.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };

    // A client over TLS: files on both servers, and a rename between them.
    let first = servers[&ServerId(2)];
    let mut cfg = ClientConfig::new(first, key);
    cfg.tls = Some(tls.clone());
    let client = rt.block_on(Client::connect(cfg)).expect("TLS client");
    let cred = Credentials::root();
    let root = client.root();
    let mut by_owner = std::collections::BTreeMap::new();
    for i in 0..64 {
        let name = format!("d{i}");
        let d = rt
            .block_on(client.mkdir(&cred, root, name.as_bytes(), 0o755))
            .unwrap();
        let f = rt
            .block_on(client.create(&cred, d.id, b"f", 0o644))
            .unwrap();
        let owner = map.table_of(f.id).expect("placed").1.owner;
        by_owner.entry(owner).or_insert((d.id, f.id));
        if by_owner.len() == 2 {
            break;
        }
    }
    assert_eq!(by_owner.len(), 2, "no two files on different servers");
    for (owner, (_, f)) in &by_owner {
        let body = format!("on server {}", owner.0).into_bytes();
        let (_, h) = rt.block_on(client.open(&cred, *f, O_RDWR)).unwrap();
        rt.block_on(client.write(&cred, h, 0, body.clone()))
            .unwrap();
        assert_eq!(
            rt.block_on(client.read(&cred, h, 0, 4096)).unwrap(),
            body,
            "read back from server {}",
            owner.0
        );
        rt.block_on(client.close(&cred, h)).unwrap();
    }
    let mut two = by_owner.values();
    let ((dir_a, file_a), (dir_b, _)) = (*two.next().unwrap(), *two.next().unwrap());
    let counted = |name: &str| -> f64 {
        metrics
            .iter()
            .filter_map(|a| metric_at(&a.to_string(), name))
            .sum()
    };
    let borrowed = counted("kochab_borrowed_operations_total");
    rt.block_on(client.rename(&cred, dir_a, b"f", dir_b, b"moved", 0))
        .expect("rename across servers");
    // It ran as a transaction between the members (their links run TLS), not by
    // borrowing a table.
    assert_eq!(counted("kochab_transaction_operations_total"), 1.0);
    assert_eq!(counted("kochab_borrowed_operations_total"), borrowed);
    assert_eq!(
        rt.block_on(client.lookup(&cred, dir_b, b"moved"))
            .unwrap()
            .id,
        file_a
    );
    assert!(rt.block_on(client.lookup(&cred, dir_a, b"f")).is_err());

    // `kochab status` over TLS reaches the servers and the coordinator replicas.
    let cluster = first.to_string();
    let (ok, out, err) = kochab(&[
        "status",
        "--json",
        "--cluster",
        &cluster,
        "--key-file",
        &kf,
        "--tls-ca",
        &ca,
    ]);
    assert!(ok, "kochab status --tls-ca: {out} {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let replicas = v["coordinator_replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 3, "{v:#}");
    assert!(
        replicas.iter().all(|r| r["role"].is_string()),
        "every replica answered over TLS: {replicas:?}"
    );
    assert!(v["coordinator"]["error"].is_null(), "{v:#}");
    assert_eq!(v["servers"].as_array().unwrap().len(), 2);
    assert!(
        v["servers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["error"].is_null()),
        "{v:#}"
    );

    // Without TLS: `kochab status` is not served, and says why it may be.
    let (ok, out, err) = kochab(&["status", "--cluster", &cluster, "--key-file", &kf]);
    assert!(!ok, "plain kochab status was served: {out}");
    assert!(err.contains("--tls-ca"), "{err}");
    // Without TLS: the servers serve nothing (a plain client waits for a challenge the
    // TLS listener never sends: refused or unanswered), and the replicas answer nothing.
    let mut plain = ClientConfig::new(first, key);
    plain.attempts = 1;
    plain.connect_timeout = Duration::from_secs(2);
    let plain = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(3), Client::connect(plain)).await
    });
    assert!(
        !matches!(plain, Ok(Ok(_))),
        "a plain client was served by a TLS server"
    );
    let mut plain = kochab_coord::ClientConfig::new(coords.clone(), key);
    plain.budget = Duration::from_secs(2);
    match rt.block_on(CoordClient::<CoordState>::new(plain).read_state()) {
        Ok(_) => panic!("a plain connection to the coordinator was answered"),
        Err(e) => assert!(e.to_string().contains("gave up"), "{e}"),
    }

    // A replica whose certificate names another host than the address dialed: refused,
    // and the message says why.
    let stray = free_addr();
    procs.0.push(spawn_ready(
        &[
            s("coord"),
            s("--id"),
            s("9"),
            s("--listen"),
            stray.to_string(),
            s("--peers"),
            format!("9={stray}"),
            s("--data"),
            tmp.path().join("stray").display().to_string(),
            s("--key-file"),
            kf.clone(),
            s("--tls-cert"),
            p("elsewhere.pem"),
            s("--tls-key"),
            p("elsewhere.key"),
            s("--tls-ca"),
            ca.clone(),
        ],
        &tmp.path().join("stray.log"),
        "ready at",
    ));
    let mut cfg = kochab_coord::ClientConfig::new(vec![stray], key);
    cfg.tls = Some(tls.clone());
    let refused = rt.block_on(CoordClient::<CoordState>::new(cfg).status_of(stray));
    match refused {
        Ok(st) => panic!("a certificate for elsewhere.example served {stray}: {st:?}"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("TLS handshake failed"), "{e}");
            assert!(e.contains("not valid for name"), "{e}");
        }
    }
    eprintln!("took {:?}", started.elapsed());
}
