//! Where each request goes: by the cached delegation map (kochab_cluster's `Router`) to the
//! server of the table that holds the inode the request names, or, against a server that
//! hands out no map (a single server), everything to that server as before.
//!
//! Pure: no I/O and no clock; the client's request loop feeds it what happened. How long
//! to pause between attempts and when to give up is `kochab_cluster`'s retry policy (the
//! simulation's clients run it too); this module only names the client's policies.

use kochab_cluster::router::{RetryPolicy, Route, Router};
use kochab_proto::InodeId;
use kochab_proto::cluster::{DelegationMap, MapVersion, ServerId, TableId};
use std::sync::Arc;

/// First pause before a server that cannot be reached (a single server restarting, or no
/// entry answering at connect) is tried again; it doubles up to
/// [`RESTART_PAUSE_MAX_MS`]: soon after a restarted server listens again, without a storm
/// of connection attempts while it does not.
pub const RESTART_PAUSE_MIN_MS: u64 = 50;

/// Longest pause before a server that cannot be reached is tried again.
pub const RESTART_PAUSE_MAX_MS: u64 = 800;

/// The retries of a request to one server that may be restarting (or of the entries at
/// connect): for `budget_ms`, at most `attempts_max` attempts (the first included).
pub fn restart_policy(budget_ms: u64, attempts_max: u32) -> RetryPolicy {
    RetryPolicy {
        budget_ms,
        pause_min_ms: RESTART_PAUSE_MIN_MS,
        pause_max_ms: RESTART_PAUSE_MAX_MS,
        attempts_max: attempts_max.max(1),
    }
}

/// Where the next attempt of a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send it to `addr`; `table` is the table it was routed by (none in single-server
    /// mode), `map_version` goes into the request.
    Send {
        addr: Arc<str>,
        table: Option<TableId>,
        map_version: u64,
    },
    /// No usable map: fetch one from `entry` first.
    Fetch { entry: Arc<str> },
}

/// The map cache, or the one server.
#[derive(Debug)]
pub enum Routing {
    /// A server that answered GetMap with ENOSYS (or an empty map): it serves everything.
    Single {
        addr: Arc<str>,
    },
    Cluster(Router),
}

impl Routing {
    /// Routing by `map`, fetching newer maps from `entries` (and from the servers of any
    /// map seen).
    pub fn cluster(entries: Vec<String>, map: DelegationMap) -> Routing {
        let mut r = Router::new(entries);
        r.learn_entries(map.servers.values());
        r.on_map(map);
        Routing::Cluster(r)
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Routing::Cluster(_))
    }

    /// True if a request about inode `id` has a server to go to (the cached map places
    /// its table on a server whose address it knows, or there is one server).
    pub fn routes(&self, id: InodeId) -> bool {
        match self {
            Routing::Single { .. } => true,
            Routing::Cluster(r) => r.map().is_some_and(|m| {
                m.table_of(id)
                    .is_some_and(|(_, p)| m.servers.contains_key(&p.owner))
            }),
        }
    }

    /// One inode id per server of the cached map (the first of one of its tables), the
    /// root's server first: what a question for the whole cluster is routed by. Empty in
    /// single-server mode.
    pub fn one_id_per_server(&self, root: InodeId) -> Vec<InodeId> {
        let Routing::Cluster(r) = self else {
            return Vec::new();
        };
        let Some(m) = r.map() else {
            return Vec::new();
        };
        let mut seen = std::collections::BTreeSet::new();
        let mut ids = vec![root];
        if let Some((_, p)) = m.table_of(root) {
            seen.insert(p.owner);
        }
        for (t, p) in &m.tables {
            if seen.insert(p.owner) {
                ids.push(t.0);
            }
        }
        ids
    }

    /// The cached map's version (0 without one, and in single-server mode).
    pub fn map_version(&self) -> u64 {
        match self {
            Routing::Single { .. } => 0,
            Routing::Cluster(r) => r.map_version().0,
        }
    }

    /// Where a request about inode `id` goes next.
    pub fn step(&mut self, id: InodeId) -> Step {
        match self {
            Routing::Single { addr } => Step::Send {
                addr: addr.clone(),
                table: None,
                map_version: 0,
            },
            Routing::Cluster(r) => {
                let table = r.map().and_then(|m| m.table_of(id)).map(|(t, _)| t);
                let map_version = r.map_version().0;
                match r.route_inode(id) {
                    Route::Server { addr, .. } => Step::Send {
                        addr: addr.into(),
                        table,
                        map_version,
                    },
                    Route::FetchMap { entry } => Step::Fetch {
                        entry: entry.into(),
                    },
                }
            }
        }
    }

    /// A fetched map; an empty one (no table placed yet) changes nothing.
    pub fn on_map(&mut self, map: DelegationMap) {
        if let Routing::Cluster(r) = self
            && !map.tables.is_empty()
        {
            r.learn_entries(map.servers.values());
            r.on_map(map);
        }
    }

    /// A server does not serve `table` (now) to a request routed by map `routed_by`:
    /// follow its hint (`owner`, and its address if it named one), else drop the map. A
    /// map newer than `routed_by` is kept (another request already fetched it after the
    /// move).
    pub fn on_wrong_server(
        &mut self,
        table: Option<TableId>,
        routed_by: u64,
        owner: Option<ServerId>,
        addr: Option<String>,
    ) {
        if let Routing::Cluster(r) = self {
            r.on_wrong_server(table, MapVersion(routed_by), owner, addr);
        }
    }

    /// The server of `table` could not be reached, dropped the connection or did not
    /// answer in time: it may be dead and its tables recovered elsewhere.
    pub fn on_unreachable(&mut self, table: Option<TableId>, routed_by: u64) {
        if let Routing::Cluster(r) = self {
            r.on_unreachable(table, MapVersion(routed_by));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_cluster::router::{RETRY_PAUSE_MAX_MS, Retries, Retry};
    use kochab_proto::cluster::{Epoch, Placement};

    fn map(version: u64, owners: &[(u64, u64, u32)]) -> DelegationMap {
        let mut m = DelegationMap {
            version: MapVersion(version),
            ..Default::default()
        };
        for &(lo, hi, owner) in owners {
            m.tables.insert(
                TableId(lo),
                Placement {
                    hi,
                    owner: ServerId(owner),
                    epoch: Epoch(1),
                },
            );
        }
        m.servers.insert(ServerId(1), "a:1".into());
        m.servers.insert(ServerId(2), "b:2".into());
        m
    }

    fn sent_to(s: &Step) -> Option<&str> {
        match s {
            Step::Send { addr, .. } => Some(addr),
            Step::Fetch { .. } => None,
        }
    }

    #[test]
    fn a_single_server_gets_everything_without_a_map_version() {
        let mut r = Routing::Single { addr: "s:1".into() };
        assert_eq!(
            r.step(12345),
            Step::Send {
                addr: "s:1".into(),
                table: None,
                map_version: 0
            }
        );
        r.on_wrong_server(None, 0, None, None);
        r.on_unreachable(None, 0);
        assert_eq!(sent_to(&r.step(1)), Some("s:1"));
        // Single mode retries with the pauses of a restarting server, within its budget
        // and attempts.
        let mut retries = Retries::new(restart_policy(1_000, 3));
        assert_eq!(retries.failed(0), Retry::After { delay_ms: 50 });
        assert_eq!(retries.failed(10), Retry::After { delay_ms: 100 });
        assert_eq!(retries.failed(20), Retry::GiveUp, "three attempts made");
        let p = restart_policy(1_000, u32::MAX);
        assert_eq!(p.after(999, 5), Retry::After { delay_ms: 800 });
        assert_eq!(p.after(999, 50), Retry::After { delay_ms: 800 });
        assert_eq!(p.after(1_000, 1), Retry::GiveUp);
        assert_eq!(restart_policy(0, 0).attempts_max, 1, "at least one attempt");
    }

    #[test]
    fn requests_go_to_the_owner_of_their_inodes_table_with_the_maps_version() {
        let mut r = Routing::cluster(vec!["e:9".into()], map(4, &[(0, 100, 1), (100, 200, 2)]));
        assert!(r.is_cluster());
        assert_eq!(
            r.step(150),
            Step::Send {
                addr: "b:2".into(),
                table: Some(TableId(100)),
                map_version: 4
            }
        );
        assert_eq!(sent_to(&r.step(99)), Some("a:1"));
        // An inode no table covers: fetch a map rather than guess.
        assert!(r.routes(99) && !r.routes(500));
        assert!(matches!(r.step(500), Step::Fetch { .. }));
    }

    #[test]
    fn wrong_server_hints_are_followed_and_otherwise_the_map_is_fetched_again() {
        let mut r = Routing::cluster(vec!["e:9".into()], map(4, &[(0, 100, 1)]));
        // The hint names a server the map does not list, with its address.
        // A WrongServer to a request routed by an older map changes nothing.
        r.on_wrong_server(Some(TableId(0)), 3, None, None);
        assert_eq!(sent_to(&r.step(7)), Some("a:1"));
        r.on_wrong_server(Some(TableId(0)), 4, Some(ServerId(3)), Some("c:3".into()));
        assert_eq!(sent_to(&r.step(7)), Some("c:3"));
        // No hint: the map is dropped; entries and every server seen are fetch sources.
        r.on_wrong_server(Some(TableId(0)), 4, None, None);
        let mut fetched = std::collections::BTreeSet::new();
        for _ in 0..4 {
            match r.step(7) {
                Step::Fetch { entry } => fetched.insert(entry.to_string()),
                s => panic!("{s:?}"),
            };
        }
        assert_eq!(
            fetched.into_iter().collect::<Vec<_>>(),
            vec!["a:1", "b:2", "e:9"]
        );
        // An empty map (nothing placed) is no map; a newer real one is used.
        r.on_map(DelegationMap::default());
        assert!(matches!(r.step(7), Step::Fetch { .. }));
        r.on_map(map(7, &[(0, 100, 2)]));
        assert_eq!(sent_to(&r.step(7)), Some("b:2"));
        assert_eq!(r.map_version(), 7);
    }

    #[test]
    fn an_unreachable_owner_drops_the_map_and_the_budget_covers_a_failover() {
        let mut r = Routing::cluster(vec!["e:9".into()], map(4, &[(0, 100, 1)]));
        r.on_unreachable(Some(TableId(0)), 3);
        assert_eq!(sent_to(&r.step(7)), Some("a:1"), "routed by an older map");
        r.on_unreachable(Some(TableId(0)), 4);
        assert!(matches!(r.step(7), Step::Fetch { .. }));
        // The client's policy in a cluster (`Client::send_routed`), by failures so far.
        let p = RetryPolicy::cluster(15_000);
        assert_eq!(p.after(5_000, 4), Retry::After { delay_ms: 16 });
        // Capped: a retry soon after the new owner serves, not a second later.
        assert_eq!(
            p.after(14_999, 21),
            Retry::After {
                delay_ms: RETRY_PAUSE_MAX_MS
            }
        );
        assert_eq!(p.after(15_000, 21), Retry::GiveUp);
    }
}
