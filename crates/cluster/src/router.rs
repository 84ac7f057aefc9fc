//! Client-side routing: a cached delegation map, routing by table, refresh on WrongServer
//! or an unanswered request, and the retry policy (pauses and a budget in injected time
//! that covers a failover). The real client (`kochab-client`) and the
//! [simulation](crate::sim)'s clients both run it.

use kochab_proto::InodeId;
use kochab_proto::cluster::{DelegationMap, MapVersion, ServerId, TableId};

/// How long a request keeps retrying before the client reports an error: a failover is a
/// lease (5 s) plus the coordinator's tick plus the recovery, so 15 s rides one out.
pub const RETRY_BUDGET_MS: u64 = 15_000;

/// First pause between two attempts of one request in a cluster. Short because the usual
/// cause is a table in flight between two servers (a move or a borrow), which takes
/// milliseconds.
pub const RETRY_PAUSE_MIN_MS: u64 = 2;

/// Longest pause between two attempts of one request in a cluster. A backoff that grows to
/// a second suits an overloaded server but, during a failover (WrongServer, a refused
/// connection, a table not yet loaded), adds up to that second after the new owner already
/// serves: a failover is over within a few hundred ms of the map changing, and a retry
/// every ~150 ms per waiting request is no load on a server.
pub const RETRY_PAUSE_MAX_MS: u64 = 150;

/// WrongServer replies naming a new owner elsewhere that one request follows without a
/// pause; more than a few means two servers each name the other (maps in flux), and the
/// request backs off like any other failure.
pub const FOLLOW_AT_ONCE: u32 = 3;

/// Doublings of the pause at most: past them the pause is at its longest anyway, and the
/// shift stays far from overflowing.
const PAUSE_DOUBLINGS_MAX: u32 = 16;

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
    /// Try again after this pause.
    After {
        /// The pause, in milliseconds.
        delay_ms: u64,
    },
    /// The budget is spent (or the attempts): report the error.
    GiveUp,
}

/// How the attempts of one request are paced and when they stop: the pause starts at
/// `pause_min_ms` and doubles with every failure up to `pause_max_ms`; the request gives up
/// once it has been failing for `budget_ms`, or after `attempts_max` attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// How long a request keeps retrying after its first failure.
    pub budget_ms: u64,
    /// The pause after the first failure.
    pub pause_min_ms: u64,
    /// The longest pause.
    pub pause_max_ms: u64,
    /// Most attempts, the first included (`u32::MAX`: the budget alone bounds them).
    pub attempts_max: u32,
}

impl RetryPolicy {
    /// A request to a cluster, retried for `budget_ms` (the client's retry budget).
    pub fn cluster(budget_ms: u64) -> RetryPolicy {
        RetryPolicy {
            budget_ms,
            pause_min_ms: RETRY_PAUSE_MIN_MS,
            pause_max_ms: RETRY_PAUSE_MAX_MS,
            attempts_max: u32::MAX,
        }
    }

    /// The attempt that made `failures` failures so far (1 for the first) failed, the
    /// request having failed for `failing_ms`: the pause before the next, or give up.
    pub fn after(&self, failing_ms: u64, failures: u32) -> Retry {
        if failing_ms >= self.budget_ms || failures >= self.attempts_max {
            return Retry::GiveUp;
        }
        let doublings = failures.saturating_sub(1).min(PAUSE_DOUBLINGS_MAX);
        let delay_ms = self
            .pause_min_ms
            .saturating_mul(1u64 << doublings)
            .min(self.pause_max_ms);
        Retry::After { delay_ms }
    }
}

impl Default for RetryPolicy {
    /// A cluster request with the default budget ([`RETRY_BUDGET_MS`]).
    fn default() -> RetryPolicy {
        RetryPolicy::cluster(RETRY_BUDGET_MS)
    }
}

/// The retries of one request: its failures so far and since when, under a
/// [`RetryPolicy`]. The caller owns the clock and passes the time in.
#[derive(Clone, Debug)]
pub struct Retries {
    policy: RetryPolicy,
    /// When the budget started to run: the first failure, unless given.
    since_ms: Option<u64>,
    failures: u32,
    followed: u32,
    /// A map was fetched for it since its last failure.
    fetched: bool,
}

impl Retries {
    /// A request not failed yet; its budget starts at its first failure.
    pub fn new(policy: RetryPolicy) -> Retries {
        Retries {
            policy,
            since_ms: None,
            failures: 0,
            followed: 0,
            fetched: false,
        }
    }

    /// A request whose budget runs from `start_ms` (before its first failure).
    pub fn since(policy: RetryPolicy, start_ms: u64) -> Retries {
        Retries {
            since_ms: Some(start_ms),
            ..Retries::new(policy)
        }
    }

    /// An attempt failed at `now_ms`: the pause before the next, or give up.
    pub fn failed(&mut self, now_ms: u64) -> Retry {
        let since = *self.since_ms.get_or_insert(now_ms);
        self.failures = self.failures.saturating_add(1);
        self.fetched = false;
        self.policy
            .after(now_ms.saturating_sub(since), self.failures)
    }

    /// A server answered WrongServer and named the table's new owner, elsewhere: true if
    /// the request goes there at once (not a failure), false if it is one (call
    /// [`Retries::failed`]) because it already followed [`FOLLOW_AT_ONCE`] hints.
    pub fn follow_hint(&mut self) -> bool {
        if self.followed >= FOLLOW_AT_ONCE {
            return false;
        }
        self.followed += 1;
        true
    }

    /// The cached map cannot route the request: true if it fetches one now, false if one
    /// was fetched since its last failure and did not help (a failure: call
    /// [`Retries::failed`]). One fetch per failure, so a map that never places the
    /// request's table costs pauses, and the budget ends it.
    pub fn fetch(&mut self) -> bool {
        !std::mem::replace(&mut self.fetched, true)
    }

    /// True if a map was fetched since the last failure.
    pub fn fetched(&self) -> bool {
        self.fetched
    }

    /// When the budget started to run (none before the first failure, unless given).
    pub fn since_ms(&self) -> Option<u64> {
        self.since_ms
    }

    /// Failed attempts so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// The client's map cache.
#[derive(Clone, Debug)]
pub struct Router {
    map: Option<DelegationMap>,
    /// Any server's or coordinator's address: each can hand out the map.
    entries: Vec<String>,
    next_entry: usize,
}

impl Router {
    /// A router without a map; `entries` are addresses any map can be fetched from.
    pub fn new(entries: Vec<String>) -> Router {
        Router {
            map: None,
            entries,
            next_entry: 0,
        }
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

    /// A server answered WrongServer to a request routed by map `routed_by` for `table`
    /// (none: the map covered no table for it). A newer map than `routed_by` is kept
    /// (another request already fetched it after the move). Else with a hint (`owner`, and
    /// its address if the server named it) the cached map is patched so the retry goes
    /// straight to the new owner; without one the map is stale and dropped, so the next
    /// `route` fetches a fresh one.
    pub fn on_wrong_server(
        &mut self,
        table: Option<TableId>,
        routed_by: MapVersion,
        owner: Option<ServerId>,
        addr: Option<String>,
    ) {
        if self.map_version() > routed_by {
            return;
        }
        if let (Some(o), Some(a)) = (owner, addr) {
            self.learn_server(o, a);
        }
        let (Some(table), Some(m)) = (table, self.map.as_mut()) else {
            self.map = None;
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

    /// A request routed by map `routed_by` to the owner of `table` (none: the map covered
    /// no table for it) could not be sent, lost its connection or got no answer in time:
    /// the owner may be dead and its tables recovered elsewhere, so the next attempt asks
    /// for a fresh map first. A map newer than `routed_by` is kept.
    pub fn on_unreachable(&mut self, table: Option<TableId>, routed_by: MapVersion) {
        if self.map_version() > routed_by {
            return;
        }
        let placed = |m: &DelegationMap| table.is_none_or(|t| m.owner(t).is_some());
        if self.map.as_ref().is_some_and(placed) {
            self.map = None;
        }
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
        r.on_wrong_server(Some(TableId(0)), MapVersion(5), Some(ServerId(2)), None);
        assert!(matches!(
            r.route(TableId(0)),
            Route::Server {
                id: ServerId(2),
                ..
            }
        ));
        r.on_wrong_server(Some(TableId(0)), MapVersion(5), None, None);
        assert!(matches!(r.route(TableId(0)), Route::FetchMap { .. }));
    }

    #[test]
    fn a_hinted_owner_with_its_address_is_routed_to() {
        let mut r = Router::new(vec!["x".into()]);
        r.on_map(map(5, 1));
        r.on_wrong_server(
            Some(TableId(0)),
            MapVersion(5),
            Some(ServerId(3)),
            Some("c".into()),
        );
        assert_eq!(
            r.route(TableId(0)),
            Route::Server {
                id: ServerId(3),
                addr: "c".into()
            }
        );
        r.learn_entries(&["a".to_string(), "x".to_string()]);
        r.on_unreachable(Some(TableId(0)), MapVersion(5));
        let a = r.route(TableId(0));
        let b = r.route(TableId(0));
        assert_ne!(a, b, "two distinct entries: x and a");
    }

    #[test]
    fn a_failure_of_a_request_routed_by_an_older_map_keeps_the_newer_one() {
        let mut r = Router::new(vec!["x".into()]);
        r.on_map(map(5, 1));
        r.on_wrong_server(Some(TableId(0)), MapVersion(4), None, Some("c".into()));
        r.on_unreachable(Some(TableId(0)), MapVersion(4));
        r.on_unreachable(None, MapVersion(4));
        assert_eq!(r.map_version(), MapVersion(5));
        assert!(matches!(
            r.route(TableId(0)),
            Route::Server {
                id: ServerId(1),
                ..
            }
        ));
        // A table the map does not place: its owner's silence says nothing about the map.
        r.on_unreachable(Some(TableId(100)), MapVersion(5));
        assert_eq!(r.map_version(), MapVersion(5));
        // Routed without a table (the map covered none for the inode): the map is no help.
        r.on_unreachable(None, MapVersion(5));
        assert_eq!(r.map_version(), MapVersion(0));
        r.on_map(map(6, 1));
        r.on_wrong_server(None, MapVersion(6), Some(ServerId(2)), None);
        assert!(r.map().is_none());
    }

    #[test]
    fn entries_rotate() {
        let mut r = Router::new(vec!["x".into(), "y".into()]);
        let a = r.route(TableId(0));
        let b = r.route(TableId(0));
        assert_ne!(a, b);
    }

    #[test]
    fn the_cluster_pause_doubles_to_its_cap_until_the_budget_ends() {
        let p = RetryPolicy::cluster(15_000);
        let pauses: Vec<Retry> = (1..=9).map(|n| p.after(0, n)).collect();
        let ms: Vec<u64> = pauses
            .iter()
            .map(|r| match r {
                Retry::After { delay_ms } => *delay_ms,
                Retry::GiveUp => panic!("gave up"),
            })
            .collect();
        assert_eq!(ms, vec![2, 4, 8, 16, 32, 64, 128, 150, 150]);
        assert_eq!(
            p.after(14_999, u32::MAX - 1),
            Retry::After {
                delay_ms: RETRY_PAUSE_MAX_MS
            }
        );
        assert_eq!(p.after(15_000, 1), Retry::GiveUp);
        assert_eq!(RetryPolicy::default().budget_ms, RETRY_BUDGET_MS);
    }

    #[test]
    fn attempts_max_counts_the_first_attempt() {
        let p = RetryPolicy {
            budget_ms: 1_000,
            pause_min_ms: 50,
            pause_max_ms: 800,
            attempts_max: 3,
        };
        assert_eq!(p.after(0, 1), Retry::After { delay_ms: 50 });
        assert_eq!(p.after(0, 2), Retry::After { delay_ms: 100 });
        assert_eq!(p.after(0, 3), Retry::GiveUp, "three attempts made");
        assert_eq!(p.after(0, 0), Retry::After { delay_ms: 50 });
    }

    #[test]
    fn a_requests_budget_runs_from_its_first_failure() {
        let mut r = Retries::new(RetryPolicy::cluster(1_000));
        assert_eq!(r.since_ms(), None);
        assert_eq!(r.failed(5_000), Retry::After { delay_ms: 2 });
        assert_eq!(r.since_ms(), Some(5_000));
        assert_eq!(r.failed(5_999), Retry::After { delay_ms: 4 });
        assert_eq!(r.failed(6_000), Retry::GiveUp);
        assert_eq!(r.failures(), 3);
        // A clock that steps back counts as no time failing.
        let mut r = Retries::new(RetryPolicy::cluster(1_000));
        r.failed(5_000);
        assert_eq!(r.failed(10), Retry::After { delay_ms: 4 });
    }

    #[test]
    fn a_budget_given_a_start_runs_from_it() {
        let mut r = Retries::since(RetryPolicy::cluster(1_000), 100);
        assert_eq!(r.failed(1_099), Retry::After { delay_ms: 2 });
        assert_eq!(r.failed(1_100), Retry::GiveUp);
    }

    #[test]
    fn a_few_hints_are_followed_at_once_then_they_count_as_failures() {
        let mut r = Retries::new(RetryPolicy::default());
        for _ in 0..FOLLOW_AT_ONCE {
            assert!(r.follow_hint());
        }
        assert!(!r.follow_hint());
        assert_eq!(r.failures(), 0, "following a hint is no failure");
    }

    #[test]
    fn a_map_is_fetched_once_between_two_failures() {
        let mut r = Retries::new(RetryPolicy::default());
        assert!(!r.fetched());
        assert!(r.fetch());
        assert!(r.fetched());
        assert!(!r.fetch(), "the fetched map did not help: a failure");
        assert_eq!(r.failures(), 0);
        r.failed(0);
        assert!(!r.fetched());
        assert!(r.fetch());
    }
}
