//! Client sessions: the files each client has open (its handles) and whether it is still
//! connected. A client whose connections are all gone for longer than the grace period
//! is considered dead: its handles are closed and its locks released. Session state is
//! soft: after a server restart clients reopen their handles on first use.

use kochab_proto::InodeId;
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Handles one client may hold open (like a large RLIMIT_NOFILE): each costs about 40
/// bytes of session memory here and keeps its inode alive, so one client (a mount serves a
/// whole machine) may not grow them without end. Past it an open fails with EMFILE.
pub const HANDLES_PER_CLIENT_MAX: usize = 1 << 20;

/// One open handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFile {
    pub id: InodeId,
    pub generation: u64,
    pub flags: u32,
}

/// What registering a handle did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    Opened,
    Known,
    TooMany,
}

#[derive(Default)]
struct ClientSession {
    handles: FxHashMap<u64, OpenFile>,
    connections: u32,
    gone_since: Option<Instant>,
}

/// The handles of an ended session, to be closed a bounded number at a time.
pub type EndedHandles = std::collections::hash_map::IntoValues<u64, OpenFile>;

/// Every client's session.
pub struct Sessions {
    clients: FxHashMap<u64, ClientSession>,
    handles_max: usize,
}

impl Default for Sessions {
    fn default() -> Sessions {
        Sessions::with_handle_limit(HANDLES_PER_CLIENT_MAX)
    }
}

impl Sessions {
    /// Sessions whose clients may each hold `handles_max` handles (tests use small ones).
    pub fn with_handle_limit(handles_max: usize) -> Sessions {
        Sessions {
            clients: FxHashMap::default(),
            handles_max,
        }
    }

    /// Handles one client may hold.
    pub fn handle_limit(&self) -> usize {
        self.handles_max
    }

    /// True if `open(client, handle, ..)` would not be refused for the handle limit.
    pub fn may_open(&self, client: u64, handle: u64) -> bool {
        self.clients
            .get(&client)
            .is_none_or(|c| c.handles.len() < self.handles_max || c.handles.contains_key(&handle))
    }

    /// A connection of `client` authenticated.
    pub fn connect(&mut self, client: u64) {
        let c = self.clients.entry(client).or_default();
        c.connections += 1;
        c.gone_since = None;
    }

    /// True while `client` has a connection.
    pub fn connected(&self, client: u64) -> bool {
        self.clients.get(&client).is_some_and(|c| c.connections > 0)
    }

    /// A connection of `client` closed.
    pub fn disconnect(&mut self, client: u64, now: Instant) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.connections = c.connections.saturating_sub(1);
            if c.connections == 0 {
                c.gone_since = Some(now);
            }
        }
    }

    /// Registers a handle: `Opened` if it is new, `Known` if it was already open (a
    /// retried or repeated open), `TooMany` past the per-client limit.
    pub fn open(&mut self, client: u64, handle: u64, file: OpenFile) -> Registered {
        let c = self.clients.entry(client).or_default();
        if c.handles.contains_key(&handle) {
            return Registered::Known;
        }
        if c.handles.len() >= self.handles_max {
            return Registered::TooMany;
        }
        c.handles.insert(handle, file);
        Registered::Opened
    }

    pub fn get(&self, client: u64, handle: u64) -> Option<OpenFile> {
        self.clients.get(&client)?.handles.get(&handle).copied()
    }

    pub fn close(&mut self, client: u64, handle: u64) -> Option<OpenFile> {
        self.clients.get_mut(&client)?.handles.remove(&handle)
    }

    /// Takes out every handle on an inode in `lo..hi` (a table leaving this server: each
    /// goes with it, so that its close at the next owner ends its open count there).
    /// Returns (client, handle, inode).
    pub fn take_range(&mut self, lo: InodeId, hi: InodeId) -> Vec<(u64, u64, InodeId)> {
        let mut out = Vec::new();
        for (&client, c) in &mut self.clients {
            c.handles.retain(|&h, of| {
                let inside = (lo..hi).contains(&of.id);
                if inside {
                    out.push((client, h, of.id));
                }
                !inside
            });
        }
        out
    }

    /// Clients without a connection for longer than `grace`.
    pub fn expired(&self, grace: Duration, now: Instant) -> Vec<u64> {
        self.clients
            .iter()
            .filter(|(_, c)| c.gone_since.is_some_and(|t| now.duration_since(t) >= grace))
            .map(|(&id, _)| id)
            .collect()
    }

    /// Ends a session, returning the handles it still held (in O(1): the caller closes
    /// them a bounded number at a time).
    pub fn end(&mut self, client: u64) -> Option<EndedHandles> {
        self.clients
            .remove(&client)
            .map(|c| c.handles.into_values())
    }

    /// Sessions known (connected or within their grace period).
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// Handles open over all clients.
    pub fn handles(&self) -> usize {
        self.clients.values().map(|c| c.handles.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_after_their_last_connection() {
        let mut s = Sessions::default();
        let t0 = Instant::now();
        s.connect(1);
        s.connect(1);
        assert_eq!(
            s.open(
                1,
                10,
                OpenFile {
                    id: 5,
                    generation: 1,
                    flags: 0
                }
            ),
            Registered::Opened
        );
        assert_eq!(
            s.open(
                1,
                10,
                OpenFile {
                    id: 5,
                    generation: 1,
                    flags: 0
                }
            ),
            Registered::Known
        );
        s.disconnect(1, t0);
        assert!(
            s.expired(Duration::ZERO, t0).is_empty(),
            "one connection left"
        );
        s.disconnect(1, t0);
        assert!(
            s.expired(Duration::from_secs(5), t0 + Duration::from_secs(1))
                .is_empty()
        );
        assert_eq!(
            s.expired(Duration::from_secs(5), t0 + Duration::from_secs(6)),
            vec![1]
        );
        s.connect(1);
        assert!(
            s.expired(Duration::ZERO, t0 + Duration::from_secs(9))
                .is_empty(),
            "reconnected"
        );
        assert_eq!(s.end(1).map(|h| h.count()), Some(1));
        assert!(s.is_empty());
    }

    #[test]
    fn the_handle_limit_refuses_new_handles_only() {
        let mut s = Sessions::with_handle_limit(2);
        let f = |id| OpenFile {
            id,
            generation: 1,
            flags: 0,
        };
        assert_eq!(s.open(1, 10, f(5)), Registered::Opened);
        assert_eq!(s.open(1, 11, f(6)), Registered::Opened);
        assert!(!s.may_open(1, 12));
        assert_eq!(s.open(1, 12, f(7)), Registered::TooMany);
        assert!(s.may_open(1, 11), "a known handle is no new one");
        assert_eq!(s.open(1, 11, f(6)), Registered::Known);
        assert!(s.may_open(2, 10), "the limit is per client");
        s.close(1, 10);
        assert_eq!(s.open(1, 12, f(7)), Registered::Opened);
    }
}
