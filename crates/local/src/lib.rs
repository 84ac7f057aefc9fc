//! Connections between a client and a server of the same process (`kochab up --mount`: the
//! mount and the cluster's servers), as in-memory byte streams instead of loopback TCP.
//!
//! The streams carry exactly what a socket would: the same frames, the same handshake
//! with its key proofs, the same end of stream when either side goes away. Only the socket
//! system calls, the loopback network stack and the poller's wake-ups are gone; a request
//! and its reply hand over between tasks of one runtime (Linux NFS's LOCALIO does the same
//! for a client and a server on one host). A client in another process, or one whose
//! server is in another process, uses TCP as before: nothing here is visible on the wire.
//!
//! A server registers the address it listens on ([`listen`]); a client asks for that
//! address ([`connect`]) before it dials it. A client may ask for the server's side of its
//! connection to run on a runtime of its choosing (its own thread's, see
//! `kochab_client::set_lane`), so that a request and its reply never leave that thread.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use tokio::sync::mpsc;

/// One end of an in-process connection.
pub type Stream = tokio::io::DuplexStream;

/// Bytes one direction buffers before its writer waits (as a socket's buffer would).
pub const BUFFER_BYTES: usize = 4 << 20;

/// Environment variable that turns in-process connections off (`1`): every client dials
/// TCP, as it would from another process (to measure what the sockets cost).
pub const DISABLE_ENV: &str = "KOCHAB_NO_LOCAL_CONNECTIONS";

struct Registered {
    id: u64,
    accept: mpsc::UnboundedSender<Incoming>,
}

/// A connection a client of this process made.
pub struct Incoming {
    /// The server's end.
    pub stream: Stream,
    /// Where the client asks the server to run its side of the connection (`None`: where
    /// the server runs its connections).
    pub runtime: Option<tokio::runtime::Handle>,
}

static LISTENERS: LazyLock<Mutex<HashMap<SocketAddr, Registered>>> =
    LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static DISABLED: LazyLock<bool> =
    LazyLock::new(|| std::env::var(DISABLE_ENV).is_ok_and(|v| v == "1"));

fn listeners() -> std::sync::MutexGuard<'static, HashMap<SocketAddr, Registered>> {
    // The map stays consistent whatever a panicking holder did (single inserts/removes).
    LISTENERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A server's side: the in-process connections made to its address.
pub struct Listener {
    addr: SocketAddr,
    id: u64,
    incoming: mpsc::UnboundedReceiver<Incoming>,
}

/// Registers `addr` (the address a server's TCP listener is bound to) for in-process
/// connections, in place of any earlier registration of it; undone when the listener is
/// dropped.
pub fn listen(addr: SocketAddr) -> Listener {
    let (accept, incoming) = mpsc::unbounded_channel();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    listeners().insert(addr, Registered { id, accept });
    Listener { addr, id, incoming }
}

impl Listener {
    /// The next in-process connection (never ends while the listener lives).
    pub async fn accept(&mut self) -> Incoming {
        match self.incoming.recv().await {
            Some(s) => s,
            // Unreachable while registered (the map holds a sender): wait forever, as an
            // idle socket listener would.
            None => std::future::pending().await,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut map = listeners();
        if map.get(&self.addr).is_some_and(|r| r.id == self.id) {
            map.remove(&self.addr);
        }
    }
}

/// An in-process connection to the server listening on `addr` in this process, if there
/// is one (and they are not turned off), served by the server on `runtime` if given;
/// `None` means dial TCP.
pub fn connect(addr: SocketAddr, runtime: Option<tokio::runtime::Handle>) -> Option<Stream> {
    if *DISABLED {
        return None;
    }
    let map = listeners();
    let unspecified = match addr.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    // A server bound to every address also answers on this one (if it is a local one:
    // the client dials an address of this host or it would not reach this process).
    let reg = map
        .get(&addr)
        .or_else(|| map.get(&SocketAddr::new(unspecified, addr.port())))?;
    let (client, server) = tokio::io::duplex(BUFFER_BYTES);
    reg.accept
        .send(Incoming {
            stream: server,
            runtime,
        })
        .ok()?;
    Some(client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_cross_and_the_end_is_seen() {
        let addr: SocketAddr = "127.0.0.1:61001".parse().unwrap();
        let mut l = listen(addr);
        let mut c = connect(addr, None).expect("registered");
        let mut s = l.accept().await.stream;
        c.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        drop(s);
        assert_eq!(
            c.read(&mut buf).await.unwrap(),
            0,
            "end of stream after the server went"
        );
    }

    #[tokio::test]
    async fn unregistered_addresses_dial_tcp() {
        let addr: SocketAddr = "127.0.0.1:61002".parse().unwrap();
        assert!(connect(addr, None).is_none());
        let l = listen(addr);
        assert!(connect(addr, None).is_some());
        drop(l);
        assert!(connect(addr, None).is_none(), "gone with its listener");
    }

    #[tokio::test]
    async fn a_newer_listener_keeps_its_registration() {
        let addr: SocketAddr = "127.0.0.1:61003".parse().unwrap();
        let old = listen(addr);
        let mut new = listen(addr);
        drop(old);
        let _c = connect(addr, None).expect("the newer one is still there");
        let _s = new.accept().await;
    }

    #[tokio::test]
    async fn a_server_bound_to_every_address_is_found() {
        let mut l = listen("0.0.0.0:61004".parse().unwrap());
        assert!(connect("127.0.0.1:61004".parse().unwrap(), None).is_some());
        let _s = l.accept().await;
    }

    #[tokio::test]
    async fn the_client_may_choose_where_the_server_serves() {
        let addr: SocketAddr = "127.0.0.1:61005".parse().unwrap();
        let mut l = listen(addr);
        let here = tokio::runtime::Handle::current();
        let _c = connect(addr, Some(here)).expect("registered");
        assert!(l.accept().await.runtime.is_some());
        let _c = connect(addr, None).expect("registered");
        assert!(l.accept().await.runtime.is_none());
    }
}
