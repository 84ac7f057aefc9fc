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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_this_process_is_reached_without_a_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let a = start(ServerConfig::new(
        tmp.path(),
        "127.0.0.1:0".parse().unwrap(),
    ))
    .await
    .unwrap();
    let c = Client::connect(ClientConfig::with_entries(vec![a.addr], a.key))
        .await
        .unwrap();
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
