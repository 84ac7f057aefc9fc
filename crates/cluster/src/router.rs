//! Client-side routing: a cached delegation map, routing by table, refresh on WrongServer,
//! and a retry budget in (injected) time that covers a failover.

use kochab_proto::InodeId;
use kochab_proto::cluster::{DelegationMap, MapVersion, ServerId, TableId};

/// How long a request keeps retrying before the client reports an error: a failover is a
/// lease (5 s) plus the coordinator's tick plus the recovery, so 15 s rides one out.
pub const RETRY_BUDGET_MS: u64 = 15_000;

/// First and longest pause between retries. The first is short because the usual cause is
/// a table in flight between two servers (a move or a borrow), which takes milliseconds.
pub const BACKOFF_MIN_MS: u64 = 2;
pub const BACKOFF_MAX_MS: u64 = 1_000;

/// Where to send a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    Server {
        id: ServerId,
        addr: String,
    },
    /// No usable map: fetch one from this entry address first.
    FetchMap {
        entry: String,
    },
}

/// What to do after a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    After { delay_ms: u64 },
    GiveUp,
}

/// The client's map cache.
#[derive(Clone, Debug)]
pub struct Router {
    map: Option<DelegationMap>,
    /// Any server's or coordinator's address: each can hand out the map.
    entries: Vec<String>,
    next_entry: usize,
    budget_ms: u64,
}

impl Router {
    /// A router without a map; `entries` are addresses any map can be fetched from.
    pub fn new(entries: Vec<String>) -> Router {
        Router {
            map: None,
            entries,
            next_entry: 0,
            budget_ms: RETRY_BUDGET_MS,
        }
    }

    /// Overrides the retry budget (tests).
    pub fn with_budget(mut self, budget_ms: u64) -> Router {
        self.budget_ms = budget_ms;
        self
    }

    /// Version of the cached map (0 without one).
    pub fn map_version(&self) -> MapVersion {
        self.map.as_ref().map(|m| m.version).unwrap_or_default()
    }

    /// The cached map.
    pub fn map(&self) -> Option<&DelegationMap> {
        self.map.as_ref()
    }

    /// A fetched map replaces the cache only if newer (replies can arrive out of order).
    pub fn on_map(&mut self, map: DelegationMap) {
        if self.map.as_ref().is_none_or(|m| map.version > m.version) {
            self.map = Some(map);
        }
    }

    /// The server for `table`, or where to fetch a map.
    pub fn route(&mut self, table: TableId) -> Route {
        if let Some(m) = &self.map
            && let Some(id) = m.owner(table)
            && let Some(addr) = m.servers.get(&id)
        {
            return Route::Server {
                id,
                addr: addr.clone(),
            };
        }
        self.fetch()
    }

    /// The server for the table that holds inode `id`.
    pub fn route_inode(&mut self, id: InodeId) -> Route {
        match self.map.as_ref().and_then(|m| m.table_of(id)) {
            Some((t, _)) => self.route(t),
            None => self.fetch(),
        }
    }

    fn fetch(&mut self) -> Route {
        let entry = match self.entries.len() {
            0 => String::new(),
            n => {
                self.next_entry = (self.next_entry + 1) % n;
                self.entries[self.next_entry].clone()
            }
        };
        Route::FetchMap { entry }
    }

    /// A server answered WrongServer. With a hint the cached map is patched so the retry
    /// goes straight to the new owner; either way the map is stale and is dropped unless
    /// the hint fixed it, so the next `route` fetches a fresh one.
    pub fn on_wrong_server(
        &mut self,
        table: TableId,
        _server_version: MapVersion,
        owner: Option<ServerId>,
    ) {
        let Some(m) = self.map.as_mut() else {
            return;
        };
        match owner {
            Some(o) if m.servers.contains_key(&o) && m.owner(table) != Some(o) => {
                if let Some(p) = m.tables.get_mut(&table) {
                    p.owner = o;
                }
            }
            _ => self.map = None,
        }
    }

    /// A WrongServer named `owner`'s address: remember it, so that the hint can be followed
    /// even when the cached map does not list that server yet.
    pub fn learn_server(&mut self, owner: ServerId, addr: String) {
        if let Some(m) = self.map.as_mut() {
            m.servers.insert(owner, addr);
        }
    }

    /// Drops the cached map (it did not help): the next `route` fetches a fresh one.
    pub fn forget_map(&mut self) {
        self.map = None;
    }

    /// More addresses a map can be fetched from (the servers of a map seen before), kept
    /// after the map itself is dropped.
    pub fn learn_entries<'a>(&mut self, addrs: impl IntoIterator<Item = &'a String>) {
        for a in addrs {
            if !self.entries.contains(a) {
                self.entries.push(a.clone());
            }
        }
    }

    /// A request to the owner of `table` got no answer in time: the owner may be dead and
    /// its tables recovered elsewhere, so the next attempt asks for a fresh map first.
    pub fn on_timeout(&mut self, table: TableId) {
        if self.map.as_ref().is_some_and(|m| m.owner(table).is_some()) {
            self.map = None;
        }
    }

    /// The attempt that started at `started_ms` failed at `now_ms` after `attempts` tries.
    pub fn retry(&self, started_ms: u64, now_ms: u64, attempts: u32) -> Retry {
        if now_ms.saturating_sub(started_ms) >= self.budget_ms {
            return Retry::GiveUp;
        }
        let delay_ms = BACKOFF_MIN_MS
            .saturating_mul(1u64 << attempts.min(10))
            .min(BACKOFF_MAX_MS);
        Retry::After { delay_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::{Epoch, Placement};

    fn map(version: u64, owner: u32) -> DelegationMap {
        let mut m = DelegationMap {
            version: MapVersion(version),
            ..Default::default()
        };
        m.tables.insert(
            TableId(0),
            Placement {
                hi: 100,
                owner: ServerId(owner),
                epoch: Epoch(1),
            },
        );
        m.servers.insert(ServerId(1), "a".into());
        m.servers.insert(ServerId(2), "b".into());
        m
    }

    #[test]
    fn routes_follows_hints_and_keeps_newest_map() {
        let mut r = Router::new(vec!["x".into(), "y".into()]);
        assert!(matches!(r.route(TableId(0)), Route::FetchMap { .. }));
        r.on_map(map(5, 1));
        r.on_map(map(4, 2));
        assert_eq!(r.map_version(), MapVersion(5));
        assert!(matches!(
            r.route_inode(7),
            Route::Server {
                id: ServerId(1),
                ..
            }
        ));
        r.on_wrong_server(TableId(0), MapVersion(6), Some(ServerId(2)));
        assert!(matches!(
            r.route(TableId(0)),
            Route::Server {
                id: ServerId(2),
                ..
            }
        ));
        r.on_wrong_server(TableId(0), MapVersion(7), None);
        assert!(matches!(r.route(TableId(0)), Route::FetchMap { .. }));
    }

    #[test]
    fn a_hinted_owner_with_its_address_is_routed_to() {
        let mut r = Router::new(vec!["x".into()]);
        r.on_map(map(5, 1));
        r.learn_server(ServerId(3), "c".into());
        r.on_wrong_server(TableId(0), MapVersion(6), Some(ServerId(3)));
        assert_eq!(
            r.route(TableId(0)),
            Route::Server {
                id: ServerId(3),
                addr: "c".into()
            }
        );
        r.learn_entries(&["a".to_string(), "x".to_string()]);
        r.on_timeout(TableId(0));
        let a = r.route(TableId(0));
        let b = r.route(TableId(0));
        assert_ne!(a, b, "two distinct entries: x and a");
    }

    #[test]
    fn entries_rotate_and_budget_ends() {
        let mut r = Router::new(vec!["x".into(), "y".into()]);
        let a = r.route(TableId(0));
        let b = r.route(TableId(0));
        assert_ne!(a, b);
        assert_eq!(r.retry(0, 14_999, 3), Retry::After { delay_ms: 16 });
        assert_eq!(r.retry(0, 14_999, 30), Retry::After { delay_ms: 1_000 });
        assert_eq!(r.retry(0, 15_000, 1), Retry::GiveUp);
    }
}
