//! Connections to every server the client talks to: a few multiplexed connections per
//! address, opened on first use and reopened after a failure, and one per lane (see
//! `lane::set_lane`).

use crate::conn::{Conn, ConnError};
use crate::lane::lane;
use kochab_proto::auth::ClientKey;
use kochab_proto::*;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Lane connections per server at most: lane `l` uses connection `l % MAX_LANES` (a server
/// takes at most 4,096 connections; a client of a machine with many CPUs must not take
/// hundreds). Lanes sharing a connection reach it across threads; they are one mount's
/// queues, which end together.
const MAX_LANES: usize = 16;

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Conn>>>>;

/// How connections are made.
pub(crate) struct Dial {
    pub key: ClientKey,
    pub client_id: u64,
    pub timeout: Duration,
    pub tls: Option<crate::tls::TlsClient>,
    /// Told of durability reports and lost connections (early replies), and of callbacks.
    pub events: Option<Arc<dyn crate::conn::ConnEvents>>,
    /// Ask for leases (see `ClientConfig::leases`).
    pub leases: bool,
}

/// The connections to one server.
struct Slots {
    slots: Vec<Slot>,
    next: AtomicUsize,
    /// The lanes' connections (`MAX_LANES`).
    lanes: Vec<Slot>,
}

/// One pool per server address.
pub(crate) struct Pool {
    dial: Dial,
    per_server: usize,
    servers: Mutex<FxHashMap<Arc<str>, Arc<Slots>>>,
    /// Servers a connection was authenticated with: each keeps a session for this client.
    sessions: Mutex<Vec<Arc<str>>>,
}

impl Pool {
    pub fn new(dial: Dial, per_server: usize) -> Pool {
        Pool {
            dial,
            per_server: per_server.clamp(1, 64),
            servers: Mutex::new(FxHashMap::default()),
            sessions: Mutex::new(Vec::new()),
        }
    }

    /// A live connection to `addr` (the next slot in turn); ENOTCONN if the server cannot
    /// be reached, the server's refusal (bad key, other protocol) as it is.
    pub async fn conn(&self, addr: &Arc<str>) -> FsResult<Arc<Conn>> {
        let slots = {
            let mut servers = self.servers.lock();
            servers
                .entry(addr.clone())
                .or_insert_with(|| {
                    Arc::new(Slots {
                        slots: (0..self.per_server).map(|_| Slot::default()).collect(),
                        next: AtomicUsize::new(0),
                        lanes: (0..MAX_LANES).map(|_| Slot::default()).collect(),
                    })
                })
                .clone()
        };
        let slot = match lane() {
            Some(l) => slots.lanes[l % MAX_LANES].clone(),
            None => {
                let i = slots.next.fetch_add(1, Ordering::Relaxed) % slots.slots.len();
                slots.slots[i].clone()
            }
        };
        let mut guard = slot.lock().await;
        if let Some(c) = guard.as_ref()
            && c.is_alive()
        {
            return Ok(c.clone());
        }
        let sock = resolve(addr).await?;
        let d = &self.dial;
        let events = d.events.clone();
        let c = Conn::connect_with(
            sock,
            &d.key,
            d.client_id,
            d.timeout,
            d.tls.as_ref().map(|t| (t, &**addr)),
            events,
            d.leases,
        );
        match c.await {
            Ok(c) => {
                *guard = Some(c.clone());
                let mut s = self.sessions.lock();
                if !s.contains(addr) {
                    s.push(addr.clone());
                }
                Ok(c)
            }
            Err(ConnError::Refused(e)) => Err(e),
            Err(ConnError::Lost(why)) => Err(fs_err!(ENOTCONN, "cannot reach {addr}: {why}")),
        }
    }

    /// The client id every connection authenticates as.
    pub fn client_id(&self) -> u64 {
        self.dial.client_id
    }

    /// The servers this client has a session on.
    pub fn sessions(&self) -> Vec<Arc<str>> {
        self.sessions.lock().clone()
    }
}

/// "host:port" to a socket address (numeric addresses without a lookup).
async fn resolve(addr: &str) -> FsResult<SocketAddr> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    tokio::net::lookup_host(addr)
        .await
        .map_err(|e| fs_err!(ENOTCONN, "cannot resolve {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| fs_err!(ENOTCONN, "{addr:?} resolves to no address"))
}
