//! A client reaches a server of its own process through an in-memory stream (see
//! `kochab_local`): the same requests work, no TCP connection is made, and a server that
//! shuts down is gone for new clients too.

use kochab_client::{Client, ClientConfig};
use kochab_proto::*;
use kochab_server::{ServerConfig, start};

/// Established TCP connections with `port` at either end, from /proc/net/tcp.
fn tcp_connections(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "01" && (f[1].ends_with(&port) || f[2].ends_with(&port))
        })
        .count()
}

/// A server in `dir` of this process and a client of it.
async fn server_and_client(dir: &std::path::Path) -> (kochab_server::RunningServer, Client) {
    let a = start(ServerConfig::new(dir, "127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let c = Client::connect(ClientConfig::with_entries(vec![a.addr], a.key))
        .await
        .unwrap();
    (a, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_this_process_is_reached_without_a_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, c) = server_and_client(tmp.path()).await;
    let cred = Credentials::root();
    let d = c.mkdir(&cred, c.root(), b"d", 0o755).await.unwrap();
    let (_, h) = c.create_open(&cred, d.id, b"f", 0o644, 0o2).await.unwrap();
    c.write(&cred, h, 0, vec![7; 3 << 20]).await.unwrap();
    assert_eq!(c.read(&cred, h, 0, 4).await.unwrap(), vec![7; 4]);
    c.close(&cred, h).await.unwrap();
    c.wait_durable().await.unwrap();
    assert_eq!(tcp_connections(a.addr.port()), 0, "no socket between them");
    c.end_session().await.unwrap();
    let (addr, key) = (a.addr, a.key);
    a.shutdown().await;
    // Unregistered with the listener: a new client dials TCP and finds nobody.
    let again = Client::connect(ClientConfig::with_entries(vec![addr], key)).await;
    assert!(again.is_err(), "a shut-down server refuses new clients");
}

/// A client lane (`set_lane`) on a thread that drives a runtime of its own, as the mount's
/// FUSE queues do: its requests go over a connection of its own, which the server of this
/// process serves on that runtime; when the runtime goes away the connection ends with it,
/// for the server too (uncounted), and the lane's next runtime connects again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_is_served_on_its_own_runtime_and_ends_with_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, c) = server_and_client(tmp.path()).await;
    let cred = Credentials::root();
    let d = c.mkdir(&cred, c.root(), b"d", 0o755).await.unwrap();
    let shared_conns = a.shared().open_connections();
    let on_lane = |name: &'static [u8]| {
        let (c, counted) = (c.clone(), a.shared().clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            kochab_client::set_lane(Some(0));
            let served = rt.block_on(async {
                let f = c
                    .create(&Credentials::root(), d.id, name, 0o644)
                    .await
                    .unwrap();
                (f.id, counted.open_connections())
            });
            kochab_client::set_lane(None);
            drop(rt);
            served
        })
    };
    for name in [&b"one"[..], b"two"] {
        let (_, during) = tokio::task::spawn_blocking({
            let t = on_lane(name);
            move || t.join().unwrap()
        })
        .await
        .unwrap();
        assert_eq!(
            during,
            shared_conns + 1,
            "the lane has a connection of its own"
        );
        assert_eq!(
            a.shared().open_connections(),
            shared_conns,
            "gone with the lane's runtime"
        );
    }
    // Both creates are there for everyone.
    let names: Vec<Vec<u8>> = c
        .readdir_all(&cred, d.id, false)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&b"one".to_vec()) && names.contains(&b"two".to_vec()));
    c.end_session().await.unwrap();
    a.shutdown().await;
}
