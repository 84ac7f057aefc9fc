//! The coordinator's replicated state machine: delegation map, membership and leases,
//! migrations in progress, the borrow lock table, per-table load and the client keys.
//!
//! [`CoordState::apply`] is pure and deterministic: the same commands in the same order give
//! the same state on every replica. Time enters only as a command's `now_ms`. Every command
//! is safe to apply twice or late: it names the incarnation or migration it is about, and
//! a command about anything that has moved on is answered `Stale` and changes nothing.

use std::collections::{BTreeMap, BTreeSet};

use crate::keys::ClientKeys;
use kochab_proto::InodeId;
use kochab_proto::cluster::{
    BorrowId, BorrowPhase, CoordCommand, CoordReply, DelegationMap, Epoch, Incarnation, MapVersion,
    Placement, ServerId, ServerRequest, TableId, TableLoad,
};
use serde::{Deserialize, Serialize};

/// Lease length when the bootstrap names none.
pub const DEFAULT_LEASE_MS: u64 = 5_000;

/// Most tables one borrow may name: an operation touches at most a few inodes (rename: two
/// parents, a child, a victim), so more is a bug or an attack.
pub const BORROW_TABLES_MAX: usize = 8;

/// Most borrows waiting at once; a server asks for one per waiting operation.
pub const BORROW_QUEUE_MAX: usize = 4096;

/// Earlier process nonces remembered per server: one per restart, so this covers far more
/// restarts than a Register can stay in flight.
pub const NONCES_MAX: usize = 64;

/// A table waiting for a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unplaced {
    pub hi: InodeId,
    /// As [`Migration::not_before_ms`].
    pub not_before_ms: u64,
}

/// One registered server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub addr: String,
    /// The current incarnation; every lower epoch is fenced.
    pub epoch: Epoch,
    /// Nonce of the process that registered `epoch`.
    pub nonce: u64,
    /// Nonces of earlier processes (newest last, at most `NONCES_MAX`): a late duplicate
    /// of their Register must not start a new incarnation and fence the live one.
    pub old_nonces: Vec<u64>,
    pub lease_until_ms: u64,
    /// False once fenced, until the server registers again.
    pub live: bool,
}

/// Where a migration stands. The map names `from` while `Dropping` and `to` while `Adding`,
/// so at no time does the map name a server that has let the table go without another
/// being asked to take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Dropping,
    Adding,
}

/// A table on its way to `to`. `from` is `None` for a first placement or a recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Migration {
    pub from: Option<Incarnation>,
    pub to: ServerId,
    pub phase: Phase,
    /// Map version when the migration started (controls carry it so a late one is ignored).
    pub started: MapVersion,
    /// Do not ask `to` to add before this time: the lease of the fenced incarnation that
    /// held the table may still run until then.
    pub not_before_ms: u64,
}

/// A borrow the coordinator knows of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Borrow {
    pub tables: Vec<TableId>,
    pub phase: BorrowPhase,
    /// Where each table was when the borrow was granted; RETURN sends it back there.
    pub homes: Vec<(TableId, ServerId)>,
}

/// Returned borrows of one server incarnation, to refuse their late duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BorrowHistory {
    pub epoch: Epoch,
    pub done_below: u64,
    pub returned: BTreeSet<u64>,
}

/// A split the coordinator asked a table's owner for. While it is pending the table
/// neither moves nor is borrowed, so the owner is the only one that can finish it; if the
/// owner dies, the split is forgotten and its recoverer reports what the store shows
/// (`CoordCommand::Added::splits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingSplit {
    /// Where to split; `None`: where the owner finds half of the table's inodes below.
    pub at: Option<InodeId>,
    pub by: Incarnation,
    /// Map version when the split was asked for (the control carries it).
    pub started: MapVersion,
}

/// The coordinator's whole state (what Raft replicates and snapshots).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordState {
    pub bootstrapped: bool,
    pub lease_ms: u64,
    /// Highest time any command carried (leaders' clocks may step back; this does not).
    pub now_ms: u64,
    pub map: DelegationMap,
    /// Tables no server holds (no live server when they lost theirs).
    pub unplaced: BTreeMap<TableId, Unplaced>,
    pub servers: BTreeMap<ServerId, Member>,
    pub migrations: BTreeMap<TableId, Migration>,
    /// Every borrow not yet returned, granted or queued. (Stored as pairs: JSON, which a
    /// snapshot may use, allows only strings as map keys.)
    #[serde(with = "pairs")]
    pub borrows: BTreeMap<BorrowId, Borrow>,
    /// Waiting borrows in arrival order.
    pub queue: Vec<BorrowId>,
    /// Tables locked by a granted borrow.
    pub locks: BTreeMap<TableId, BorrowId>,
    pub history: BTreeMap<ServerId, BorrowHistory>,
    /// Last reported load of each table.
    pub load: BTreeMap<TableId, TableLoad>,
    /// Servers an operator is draining: no placement, recovery or balancing move picks
    /// them while another live server can take the table, and the balancer moves their
    /// tables off. (Last field: a snapshot without it is older than draining.)
    pub draining: BTreeSet<ServerId>,
    /// Splits asked for and not finished.
    #[serde(default)]
    pub splits: BTreeMap<TableId, PendingSplit>,
    /// Tables whose owner refused to split them, with their inode count then: the balancer
    /// asks again only once they have doubled.
    #[serde(default)]
    pub unsplittable: BTreeMap<TableId, u64>,
    /// The cluster's client keys (secrets sealed under the cluster key) and how far each
    /// member has applied them.
    #[serde(default)]
    pub keys: ClientKeys,
    /// Last reported remote use of each table: per server, its multi-server operations
    /// that needed the table while another server held it (`--multi-server auto`).
    #[serde(default)]
    pub remote_use: BTreeMap<TableId, BTreeMap<ServerId, u64>>,
}

/// A map serialized as a list of pairs.
mod pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<K: Serialize, V: Serialize, S: Serializer>(
        m: &BTreeMap<K, V>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter())
    }

    pub fn deserialize<'de, K, V, D>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
    }
}

impl CoordState {
    /// Applies one command. Pure: no clock, no randomness, no I/O.
    pub fn apply(&mut self, cmd: &CoordCommand) -> CoordReply {
        let reply = match cmd {
            CoordCommand::Bootstrap { tables, lease_ms } => self.bootstrap(tables, *lease_ms),
            CoordCommand::Request { req, now_ms } => {
                self.advance(*now_ms);
                self.request(req)
            }
            CoordCommand::Tick { now_ms } => {
                self.advance(*now_ms);
                self.fence_expired();
                self.fence_keys_late();
                CoordReply::Ok
            }
            CoordCommand::Move { table, to } => self.start_move(*table, *to),
            CoordCommand::Dropped {
                table,
                by,
                map_version,
            } => self.dropped(*table, *by, *map_version),
            CoordCommand::Added {
                tables,
                by,
                map_version,
                splits,
            } => self.added(tables, *by, *map_version, splits),
            CoordCommand::Drain { server, drain } => self.set_draining(*server, *drain),
            CoordCommand::Split { table, at } => self.start_split(*table, *at),
            CoordCommand::SplitDone {
                table,
                at,
                by,
                map_version,
            } => self.split_done(*table, *at, *by, *map_version),
            CoordCommand::SplitRefused {
                table,
                by,
                map_version,
                ..
            } => self.split_refused(*table, *by, *map_version),
            CoordCommand::KeyAdd { key } => self.keys.add(key, self.now_ms),
            CoordCommand::KeyRevoke { id } => self.keys.revoke(*id, self.now_ms),
            CoordCommand::KeysImport { next_id, keys } => {
                self.keys.import(*next_id, keys, self.now_ms)
            }
            CoordCommand::KeysApplied { by, version } => {
                if self.live(by.server) == Some(*by) {
                    self.keys.applied(*by, *version, self.now_ms)
                } else {
                    CoordReply::Stale("keys applied by a dead incarnation".into())
                }
            }
        };
        self.progress();
        reply
    }

    /// Live members that have not applied the latest client keys (the driver tells them).
    pub fn keys_behind(&self) -> Vec<Incarnation> {
        self.servers
            .keys()
            .filter_map(|s| self.live(*s))
            .filter(|i| self.keys.held_by(*i) < self.keys.version)
            .collect()
    }

    /// `Ok` once key version `version` is settled: every live member applied it (its
    /// revoked keys are refused and their connections closed there) and no fenced
    /// incarnation's lease still runs. Otherwise what it waits for.
    pub fn keys_settled(&self, version: u64) -> Result<(), String> {
        let behind: Vec<u32> = self
            .servers
            .keys()
            .filter_map(|s| self.live(*s))
            .filter(|i| self.keys.held_by(*i) < version)
            .map(|i| i.server.0)
            .collect();
        if !behind.is_empty() {
            return Err(format!("servers {behind:?} have not applied it"));
        }
        if self.now_ms < self.keys.fenced_until_ms {
            return Err(format!(
                "a fenced server's lease runs for {} ms more",
                self.keys.fenced_until_ms - self.now_ms
            ));
        }
        Ok(())
    }

    /// Fences every live member that has been behind on the client keys, without progress,
    /// for the grace (see [`crate::keys`]): a server that cannot be told about a revoked
    /// key must not go on serving it.
    fn fence_keys_late(&mut self) {
        let grace = crate::keys::apply_grace_ms(self.lease_ms);
        let late: Vec<ServerId> = self
            .servers
            .keys()
            .filter_map(|s| self.live(*s))
            .filter(|i| self.keys.late(*i, grace, self.now_ms))
            .map(|i| i.server)
            .collect();
        for s in late {
            self.fence(s);
        }
    }

    /// The current epoch of every server (what an ADD may seal below).
    pub fn epochs(&self) -> Vec<Incarnation> {
        self.servers
            .iter()
            .map(|(s, m)| Incarnation {
                server: *s,
                epoch: m.epoch,
            })
            .collect()
    }

    /// The live incarnation of `server`, if any.
    pub fn live(&self, server: ServerId) -> Option<Incarnation> {
        let m = self.servers.get(&server).filter(|m| m.live)?;
        Some(Incarnation {
            server,
            epoch: m.epoch,
        })
    }

    fn bump(&mut self) {
        self.map.version = MapVersion(self.map.version.0 + 1);
    }

    fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    fn bootstrap(&mut self, tables: &[(TableId, InodeId)], lease_ms: u64) -> CoordReply {
        if self.bootstrapped {
            return CoordReply::Stale("already bootstrapped".into());
        }
        let mut sorted = tables.to_vec();
        sorted.sort();
        if sorted.iter().any(|(lo, hi)| lo.0 >= *hi) || sorted.windows(2).any(|w| w[0].1 > w[1].0.0)
        {
            return CoordReply::Refused("table ranges are empty or overlap".into());
        }
        self.bootstrapped = true;
        self.lease_ms = if lease_ms == 0 {
            DEFAULT_LEASE_MS
        } else {
            lease_ms
        };
        self.unplaced = sorted
            .into_iter()
            .map(|(t, hi)| {
                (
                    t,
                    Unplaced {
                        hi,
                        not_before_ms: 0,
                    },
                )
            })
            .collect();
        CoordReply::Ok
    }

    fn request(&mut self, req: &ServerRequest) -> CoordReply {
        match req {
            ServerRequest::Register {
                server,
                addr,
                nonce,
            } => self.register(*server, addr, *nonce),
            ServerRequest::RenewLease { server, epoch } => {
                let lease_ms = self.lease_ms;
                let now = self.now_ms;
                match self.servers.get_mut(server) {
                    Some(m) if m.live && m.epoch == *epoch => {
                        m.lease_until_ms = m.lease_until_ms.max(now + lease_ms);
                        CoordReply::Renewed {
                            epoch: *epoch,
                            lease_ms,
                        }
                    }
                    Some(m) => CoordReply::Fenced { current: m.epoch },
                    None => CoordReply::Refused(format!("server {} never registered", server.0)),
                }
            }
            ServerRequest::Borrow {
                id,
                tables,
                done_below,
            } => self.borrow(*id, tables, *done_below),
            ServerRequest::Return { id, done_below } => self.give_back(*id, *done_below),
            ServerRequest::ReportLoad {
                server,
                epoch,
                loads,
            } => {
                if self.live(*server).map(|i| i.epoch) != Some(*epoch) {
                    return CoordReply::Stale("load report of a dead incarnation".into());
                }
                for l in loads {
                    if self.map.owner(l.table) == Some(*server) {
                        self.load.insert(l.table, *l);
                    }
                }
                CoordReply::Ok
            }
            ServerRequest::ReportRemoteUse {
                server,
                epoch,
                uses,
            } => {
                if self.live(*server).map(|i| i.epoch) != Some(*epoch) {
                    return CoordReply::Stale("remote use report of a dead incarnation".into());
                }
                // Each report replaces the server's last one.
                self.remote_use.retain(|_, by| {
                    by.remove(server);
                    !by.is_empty()
                });
                for u in uses {
                    let held_elsewhere = self.map.owner(u.table).is_some_and(|o| o != *server);
                    if held_elsewhere && u.ops > 0 {
                        self.remote_use
                            .entry(u.table)
                            .or_default()
                            .insert(*server, u.ops);
                    }
                }
                CoordReply::Ok
            }
        }
    }

    fn register(&mut self, server: ServerId, addr: &str, nonce: u64) -> CoordReply {
        let lease_ms = self.lease_ms;
        if let Some(m) = self.servers.get(&server)
            && m.old_nonces.contains(&nonce)
        {
            return CoordReply::Fenced { current: m.epoch };
        }
        if let Some(m) = self.servers.get(&server)
            && m.nonce == nonce
        {
            // A retried Register of the same process: same answer; of a process already
            // fenced: it must not come back under that epoch.
            return if m.live {
                CoordReply::Registered {
                    epoch: m.epoch,
                    lease_ms,
                    nonce,
                }
            } else {
                CoordReply::Fenced { current: m.epoch }
            };
        }
        if self.live(server).is_some() {
            // The server restarted: its previous incarnation is dead by definition.
            self.fence(server);
        }
        let epoch = Epoch(self.servers.get(&server).map_or(0, |m| m.epoch.0) + 1);
        let mut old_nonces = Vec::new();
        if let Some(m) = self.servers.get(&server) {
            old_nonces = m.old_nonces.clone();
            old_nonces.push(m.nonce);
            if old_nonces.len() > NONCES_MAX {
                old_nonces.remove(0);
            }
        }
        self.servers.insert(
            server,
            Member {
                addr: addr.to_string(),
                epoch,
                nonce,
                old_nonces,
                lease_until_ms: self.now_ms + lease_ms,
                live: true,
            },
        );
        self.map.servers.insert(server, addr.to_string());
        self.keys.joined(Incarnation { server, epoch }, self.now_ms);
        self.bump();
        CoordReply::Registered {
            epoch,
            lease_ms,
            nonce,
        }
    }

    fn fence_expired(&mut self) {
        let now = self.now_ms;
        let expired: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|(_, m)| m.live && m.lease_until_ms < now)
            .map(|(s, _)| *s)
            .collect();
        for s in expired {
            self.fence(s);
        }
    }

    /// Kills the current incarnation of `server`: bumps its epoch (the store then lets a
    /// recoverer seal its journal), cancels its borrows and hands all its tables, as one
    /// unit, to one live server to recover.
    fn fence(&mut self, server: ServerId) {
        let Some(m) = self.servers.get_mut(&server) else {
            return;
        };
        m.epoch = Epoch(m.epoch.0 + 1);
        m.live = false;
        // Fenced early (a new process registered) the old one may still believe in its
        // lease: nobody else serves its tables before that lease is over.
        let not_before_ms = m.lease_until_ms;
        // Nor does a change of the client keys settle before then: it may not know of it.
        self.keys.fenced(not_before_ms);
        self.bump();
        let dead: Vec<BorrowId> = self
            .borrows
            .keys()
            .filter(|b| b.server == server)
            .copied()
            .collect();
        for b in dead {
            self.release(b);
        }
        self.splits.retain(|_, p| p.by.server != server);
        // A migration into the dead server whose drop is under way is kept: the old owner
        // may already have let the table go, so cancelling it could leave the map naming a
        // server that no longer holds the table. `dropped` picks another target.
        let tables: Vec<TableId> = self
            .map
            .tables
            .iter()
            .filter(|(_, p)| p.owner == server)
            .map(|(t, _)| *t)
            .collect();
        let recoverer = self.least_loaded(Some(server));
        for t in tables {
            self.migrations.remove(&t);
            match recoverer {
                Some(r) => self.place(t, r, None, not_before_ms),
                None => {
                    if let Some(p) = self.map.tables.remove(&t) {
                        let u = Unplaced {
                            hi: p.hi,
                            not_before_ms,
                        };
                        self.unplaced.insert(t, u);
                    }
                }
            }
        }
    }

    /// Points the map at `to` and asks it to add (or recover) `table`.
    fn place(
        &mut self,
        table: TableId,
        to: ServerId,
        from: Option<Incarnation>,
        not_before_ms: u64,
    ) {
        let Some(inc) = self.live(to) else {
            return;
        };
        let (hi, not_before_ms) = match self.map.tables.get(&table) {
            Some(p) => (p.hi, not_before_ms),
            None => match self.unplaced.remove(&table) {
                Some(u) => (u.hi, u.not_before_ms.max(not_before_ms)),
                None => return,
            },
        };
        self.bump();
        self.map.tables.insert(
            table,
            Placement {
                hi,
                owner: to,
                epoch: inc.epoch,
            },
        );
        self.migrations.insert(
            table,
            Migration {
                from,
                to,
                phase: Phase::Adding,
                started: self.map.version,
                not_before_ms,
            },
        );
    }

    /// True if `server` is live and not draining: a server placements may pick.
    pub fn in_service(&self, server: ServerId) -> bool {
        self.live(server).is_some() && !self.draining.contains(&server)
    }

    /// The live server with the fewest tables (ties: lowest id), other than `except`;
    /// a draining one only when no other is live (a table served by a draining server is
    /// better than one served by nobody).
    fn least_loaded(&self, except: Option<ServerId>) -> Option<ServerId> {
        self.least_loaded_of(except, false)
            .or_else(|| self.least_loaded_of(except, true))
    }

    fn least_loaded_of(&self, except: Option<ServerId>, draining: bool) -> Option<ServerId> {
        let mut count: BTreeMap<ServerId, usize> = self
            .servers
            .iter()
            .filter(|(s, m)| {
                m.live && Some(**s) != except && (draining || !self.draining.contains(s))
            })
            .map(|(s, _)| (*s, 0))
            .collect();
        for p in self.map.tables.values() {
            if let Some(c) = count.get_mut(&p.owner) {
                *c += 1;
            }
        }
        count
            .into_iter()
            .min_by_key(|(s, c)| (*c, *s))
            .map(|(s, _)| s)
    }

    fn start_move(&mut self, table: TableId, to: ServerId) -> CoordReply {
        let Some(p) = self.map.tables.get(&table).copied() else {
            return CoordReply::Refused(format!("table {:#x} is not placed", table.0));
        };
        if self.migrations.contains_key(&table) {
            return CoordReply::Refused(format!("table {:#x} is already moving", table.0));
        }
        if self.locks.contains_key(&table) {
            return CoordReply::Refused(format!("table {:#x} is borrowed", table.0));
        }
        if self.splits.contains_key(&table) {
            return CoordReply::Refused(format!("table {:#x} is being split", table.0));
        }
        if self.live(to).is_none() {
            return CoordReply::Refused(format!("server {} is not live", to.0));
        }
        if self.draining.contains(&to) {
            return CoordReply::Refused(format!(
                "server {} is draining (`kochab server add {}` ends that)",
                to.0, to.0
            ));
        }
        if p.owner == to {
            return CoordReply::Stale("already there".into());
        }
        self.begin_drop(table, p, to);
        CoordReply::Ok
    }

    fn set_draining(&mut self, server: ServerId, drain: bool) -> CoordReply {
        if !self.servers.contains_key(&server) {
            return CoordReply::Refused(format!("server {} has never registered", server.0));
        }
        if !drain {
            return if self.draining.remove(&server) {
                CoordReply::Ok
            } else {
                CoordReply::Stale(format!("server {} is not draining", server.0))
            };
        }
        if self.draining.contains(&server) {
            return CoordReply::Stale(format!("server {} is already draining", server.0));
        }
        let others = self
            .servers
            .keys()
            .any(|s| *s != server && self.in_service(*s));
        if !others {
            return CoordReply::Refused(format!(
                "no other live server in service could take the tables of server {}",
                server.0
            ));
        }
        self.draining.insert(server);
        CoordReply::Ok
    }

    fn begin_drop(&mut self, table: TableId, p: Placement, to: ServerId) {
        self.bump();
        self.migrations.insert(
            table,
            Migration {
                from: Some(Incarnation {
                    server: p.owner,
                    epoch: p.epoch,
                }),
                to,
                phase: Phase::Dropping,
                started: self.map.version,
                not_before_ms: 0,
            },
        );
    }

    fn dropped(&mut self, table: TableId, by: Incarnation, v: MapVersion) -> CoordReply {
        match self.migrations.get(&table) {
            Some(m) if m.phase == Phase::Dropping && m.from == Some(by) && m.started == v => {
                let (to, from) = (m.to, m.from);
                self.migrations.remove(&table);
                if self.live(to).is_some() {
                    self.place(table, to, from, 0);
                } else if let Some(r) = self.least_loaded(None) {
                    // The target died after the drop began: the table is clean, any live
                    // server can add it.
                    self.place(table, r, from, 0);
                } else if let Some(p) = self.map.tables.remove(&table) {
                    self.bump();
                    let u = Unplaced {
                        hi: p.hi,
                        not_before_ms: 0,
                    };
                    self.unplaced.insert(table, u);
                }
                CoordReply::Ok
            }
            _ => CoordReply::Stale(format!("no drop of {:#x} by {:?} pending", table.0, by)),
        }
    }

    fn added(
        &mut self,
        tables: &[TableId],
        by: Incarnation,
        v: MapVersion,
        splits: &[(TableId, InodeId)],
    ) -> CoordReply {
        if self.live(by.server) != Some(by) {
            return CoordReply::Stale("added by a dead incarnation".into());
        }
        let mut done = 0;
        for t in tables {
            if let Some(m) = self.migrations.get(t)
                && m.phase == Phase::Adding
                && m.to == by.server
                && m.started <= v
            {
                self.migrations.remove(t);
                done += 1;
            }
        }
        // Splits the store shows and the map does not: the table is served by `by` as two.
        for (t, at) in splits {
            if !self.migrations.contains_key(t) && !self.locks.contains_key(t) {
                done += usize::from(self.apply_split(*t, *at, by));
            }
        }
        if done == 0 {
            CoordReply::Stale("no add pending".into())
        } else {
            CoordReply::Ok
        }
    }

    fn start_split(&mut self, table: TableId, at: Option<InodeId>) -> CoordReply {
        let Some(p) = self.map.tables.get(&table).copied() else {
            return CoordReply::Refused(format!("table {:#x} is not placed", table.0));
        };
        if self.splits.contains_key(&table) {
            return CoordReply::Stale(format!("table {:#x} is already being split", table.0));
        }
        if self.migrations.contains_key(&table) {
            return CoordReply::Refused(format!("table {:#x} is moving", table.0));
        }
        if self.locks.contains_key(&table) {
            return CoordReply::Refused(format!("table {:#x} is borrowed", table.0));
        }
        if let Some(at) = at
            && (at <= table.0 || at >= p.hi)
        {
            return CoordReply::Refused(format!(
                "{at:#x} is not inside table {:#x}..{:#x}",
                table.0, p.hi
            ));
        }
        let Some(by) = self.live(p.owner).filter(|i| i.epoch == p.epoch) else {
            return CoordReply::Refused(format!("the owner of table {:#x} is not live", table.0));
        };
        self.bump();
        self.splits.insert(
            table,
            PendingSplit {
                at,
                by,
                started: self.map.version,
            },
        );
        CoordReply::Ok
    }

    fn split_done(
        &mut self,
        table: TableId,
        at: InodeId,
        by: Incarnation,
        v: MapVersion,
    ) -> CoordReply {
        match self.splits.get(&table) {
            Some(s) if s.by == by && s.started == v && s.at.is_none_or(|a| a == at) => {
                self.splits.remove(&table);
                if self.apply_split(table, at, by) {
                    self.grant_waiting();
                    CoordReply::Ok
                } else {
                    CoordReply::Refused(format!("{at:#x} does not split table {:#x}", table.0))
                }
            }
            _ => CoordReply::Stale(format!("no split of {:#x} by {:?} pending", table.0, by)),
        }
    }

    fn split_refused(&mut self, table: TableId, by: Incarnation, v: MapVersion) -> CoordReply {
        match self.splits.get(&table) {
            Some(s) if s.by == by && s.started == v => {
                self.splits.remove(&table);
                let inodes = self.load.get(&table).map_or(0, |l| l.inodes);
                self.unsplittable.insert(table, inodes);
                self.grant_waiting();
                CoordReply::Ok
            }
            _ => CoordReply::Stale(format!("no split of {:#x} by {:?} pending", table.0, by)),
        }
    }

    /// Cuts `table` at `at` in the map: `[at, hi)` becomes a table of its own on the same
    /// incarnation. False if the map cannot show it (the table is not `by`'s or `at` is
    /// not inside it).
    fn apply_split(&mut self, table: TableId, at: InodeId, by: Incarnation) -> bool {
        let Some(p) = self.map.tables.get(&table).copied() else {
            return false;
        };
        if p.owner != by.server || at <= table.0 || at >= p.hi {
            return false;
        }
        self.bump();
        self.map.tables.insert(table, Placement { hi: at, ..p });
        self.map.tables.insert(
            TableId(at),
            Placement {
                hi: p.hi,
                owner: by.server,
                epoch: by.epoch,
            },
        );
        // Each half is assumed to carry half the load until its owner reports again.
        if let Some(l) = self.load.get_mut(&table) {
            l.ops /= 2;
            l.inodes /= 2;
            let upper = TableLoad {
                table: TableId(at),
                ..*l
            };
            self.load.insert(TableId(at), upper);
        }
        self.unsplittable.remove(&table);
        true
    }

    fn borrow(&mut self, id: BorrowId, tables: &[TableId], done_below: u64) -> CoordReply {
        if self.live(id.server).map(|i| i.epoch) != Some(id.epoch) {
            let current = self.servers.get(&id.server).map_or(Epoch(0), |m| m.epoch);
            return CoordReply::Fenced { current };
        }
        if let Some(b) = self.borrows.get(&id) {
            return CoordReply::Borrow { phase: b.phase };
        }
        let h = self.history_of(id);
        if id.seq < h.done_below || h.returned.contains(&id.seq) {
            return CoordReply::Stale("borrow already returned".into());
        }
        h.done_below = h.done_below.max(done_below);
        let mut set: Vec<TableId> = tables.to_vec();
        set.sort();
        set.dedup();
        if set.is_empty() || set.len() > BORROW_TABLES_MAX {
            return CoordReply::Refused(format!("a borrow names 1 to {BORROW_TABLES_MAX} tables"));
        }
        if let Some(t) = set.iter().find(|t| !self.map.tables.contains_key(t)) {
            return CoordReply::Refused(format!("table {:#x} is not placed", t.0));
        }
        if self.queue.len() >= BORROW_QUEUE_MAX {
            return CoordReply::Refused("too many borrows waiting".into());
        }
        self.borrows.insert(
            id,
            Borrow {
                tables: set,
                phase: BorrowPhase::Queued,
                homes: Vec::new(),
            },
        );
        self.queue.push(id);
        self.grant_waiting();
        self.progress();
        CoordReply::Borrow {
            phase: self
                .borrows
                .get(&id)
                .map_or(BorrowPhase::Queued, |b| b.phase),
        }
    }

    fn history_of(&mut self, id: BorrowId) -> &mut BorrowHistory {
        let h = self.history.entry(id.server).or_default();
        if h.epoch != id.epoch {
            *h = BorrowHistory {
                epoch: id.epoch,
                ..Default::default()
            };
        }
        h
    }

    fn give_back(&mut self, id: BorrowId, done_below: u64) -> CoordReply {
        if let Some(b) = self.borrows.get(&id) {
            let homes = b.homes.clone();
            self.release(id);
            self.send_home(id.server, &homes);
            if self.live(id.server).map(|i| i.epoch) == Some(id.epoch) {
                let h = self.history_of(id);
                h.returned.insert(id.seq);
                h.done_below = h.done_below.max(done_below);
                let below = h.done_below;
                h.returned.retain(|s| *s >= below);
            }
            CoordReply::Ok
        } else {
            CoordReply::Stale("borrow not held".into())
        }
    }

    /// Ursa's default after RETURN: each table goes back where it was, unless a waiting
    /// borrow has just taken it (then it moves straight on) or it is already elsewhere.
    fn send_home(&mut self, borrower: ServerId, homes: &[(TableId, ServerId)]) {
        for (t, home) in homes {
            let Some(p) = self.map.tables.get(t).copied() else {
                continue;
            };
            let free = !self.locks.contains_key(t) && !self.migrations.contains_key(t);
            if free && p.owner == borrower && *home != borrower && self.in_service(*home) {
                self.begin_drop(*t, p, *home);
            }
        }
    }

    fn release(&mut self, id: BorrowId) {
        self.borrows.remove(&id);
        self.queue.retain(|b| *b != id);
        self.locks.retain(|_, b| *b != id);
        self.grant_waiting();
    }

    /// Grants waiting borrows in FIFO order: one is granted when none of its tables is
    /// locked or wanted by an earlier waiting borrow, so nobody starves and, because a set
    /// is locked all at once, nobody deadlocks.
    fn grant_waiting(&mut self) {
        let mut wanted: BTreeSet<TableId> = BTreeSet::new();
        let mut granted = Vec::new();
        for id in &self.queue {
            let Some(b) = self.borrows.get(id) else {
                continue;
            };
            let free = b.tables.iter().all(|t| {
                !self.locks.contains_key(t) && !wanted.contains(t) && !self.splits.contains_key(t)
            });
            if free {
                granted.push(*id);
                for t in &b.tables {
                    self.locks.insert(*t, *id);
                }
            } else {
                wanted.extend(b.tables.iter().copied());
            }
        }
        for id in granted {
            self.queue.retain(|b| *b != id);
            let Some(b) = self.borrows.get(&id) else {
                continue;
            };
            let homes = b
                .tables
                .iter()
                .filter_map(|t| Some((*t, self.map.owner(*t)?)))
                .collect();
            if let Some(b) = self.borrows.get_mut(&id) {
                b.phase = BorrowPhase::Moving;
                b.homes = homes;
            }
        }
    }

    /// Work that follows from the state alone: place unplaced tables, move borrowed tables
    /// to their borrower, mark borrows ready. Runs after every command, so a new leader
    /// needs no memory of what the old one was doing.
    fn progress(&mut self) {
        let unplaced: Vec<TableId> = self.unplaced.keys().copied().collect();
        for t in unplaced {
            match self.least_loaded(None) {
                Some(s) => self.place(t, s, None, 0),
                None => break,
            }
        }
        let moving: Vec<(BorrowId, Vec<TableId>)> = self
            .borrows
            .iter()
            .filter(|(_, b)| b.phase != BorrowPhase::Queued)
            .map(|(id, b)| (*id, b.tables.clone()))
            .collect();
        for (id, tables) in moving {
            let mut ready = true;
            for t in tables {
                let Some(p) = self.map.tables.get(&t).copied() else {
                    ready = false;
                    continue;
                };
                if p.owner == id.server && !self.migrations.contains_key(&t) {
                    continue;
                }
                ready = false;
                if !self.migrations.contains_key(&t) {
                    self.begin_drop(t, p, id.server);
                }
            }
            if let Some(b) = self.borrows.get_mut(&id) {
                b.phase = if ready {
                    BorrowPhase::Ready
                } else {
                    BorrowPhase::Moving
                };
            }
        }
    }

    /// Checks the state's own invariants; a violation is a bug (tests and the simulation
    /// call this after every command).
    pub fn check(&self) -> Result<(), String> {
        if let Some(s) = self.draining.iter().find(|s| !self.servers.contains_key(s)) {
            return Err(format!("unregistered server {} is draining", s.0));
        }
        for t in self.map.tables.keys() {
            if self.unplaced.contains_key(t) {
                return Err(format!("table {:#x} both placed and unplaced", t.0));
            }
        }
        for (t, m) in &self.migrations {
            let Some(p) = self.map.tables.get(t) else {
                return Err(format!("migration of unplaced table {:#x}", t.0));
            };
            let expect = match m.phase {
                Phase::Dropping => m.from.map(|f| f.server),
                Phase::Adding => Some(m.to),
            };
            if expect != Some(p.owner) {
                return Err(format!("map and migration disagree on {:#x}", t.0));
            }
        }
        for (t, sp) in &self.splits {
            if self.migrations.contains_key(t) || self.locks.contains_key(t) {
                return Err(format!("table {:#x} split while moving or borrowed", t.0));
            }
            if self.map.owner(*t) != Some(sp.by.server) {
                return Err(format!(
                    "split of {:#x} asked of a server not its owner",
                    t.0
                ));
            }
        }
        let mut end = 0;
        for (t, p) in &self.map.tables {
            if t.0 < end || t.0 >= p.hi {
                return Err(format!(
                    "table {:#x}..{:#x} overlaps or is empty",
                    t.0, p.hi
                ));
            }
            end = p.hi;
        }
        for (t, b) in &self.locks {
            match self.borrows.get(b) {
                Some(bw) if bw.tables.contains(t) && bw.phase != BorrowPhase::Queued => {}
                _ => return Err(format!("lock on {:#x} without its granted borrow", t.0)),
            }
        }
        for (id, b) in &self.borrows {
            let queued = self.queue.contains(id);
            if queued != (b.phase == BorrowPhase::Queued) {
                return Err(format!(
                    "borrow {id:?} queue state disagrees with its phase"
                ));
            }
            if self.live(id.server).map(|i| i.epoch) != Some(id.epoch) {
                return Err(format!("borrow {id:?} of a dead incarnation"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(s: &mut CoordState, id: u32, now_ms: u64) -> Incarnation {
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::Register {
                server: ServerId(id),
                addr: format!("s{id}"),
                nonce: u64::from(id),
            },
            now_ms,
        });
        assert!(matches!(r, CoordReply::Registered { .. }), "{r:?}");
        s.live(ServerId(id)).expect("registered")
    }

    fn renew(s: &mut CoordState, id: u32, now_ms: u64) {
        let epoch = s.live(ServerId(id)).expect("live").epoch;
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::RenewLease {
                server: ServerId(id),
                epoch,
            },
            now_ms,
        });
        assert!(matches!(r, CoordReply::Renewed { .. }), "{r:?}");
    }

    /// Finishes every Adding migration as its target would.
    fn add_all(s: &mut CoordState) {
        let adding: Vec<(TableId, ServerId)> = s
            .migrations
            .iter()
            .filter(|(_, m)| m.phase == Phase::Adding)
            .map(|(t, m)| (*t, m.to))
            .collect();
        for (t, to) in adding {
            let by = s.live(to).expect("target is live");
            let v = s.map.version;
            s.apply(&CoordCommand::Added {
                tables: vec![t],
                by,
                map_version: v,
                splits: vec![],
            });
        }
        s.check().expect("state invariants");
    }

    /// Three live servers (2, 3, 4), tables 0..6 placed and added.
    fn three_servers() -> CoordState {
        let mut s = CoordState::default();
        let tables: Vec<(TableId, u64)> = (0..6).map(|i| (TableId(i * 10), i * 10 + 10)).collect();
        s.apply(&CoordCommand::Bootstrap {
            tables,
            lease_ms: 1_000,
        });
        for id in 2..=4 {
            register(&mut s, id, 1);
        }
        add_all(&mut s);
        s
    }

    #[test]
    fn a_split_holds_off_moves_and_borrows_and_then_cuts_the_map() {
        let mut s = three_servers();
        let t = TableId(20);
        let owner = s.live(s.map.owner(t).expect("placed")).expect("live");
        let other = s
            .live(ServerId(if owner.server == ServerId(2) { 3 } else { 2 }))
            .unwrap();
        assert!(matches!(
            s.apply(&CoordCommand::Split {
                table: t,
                at: Some(40)
            }),
            CoordReply::Refused(_)
        ));
        assert_eq!(
            s.apply(&CoordCommand::Split { table: t, at: None }),
            CoordReply::Ok
        );
        let v = s.splits[&t].started;
        assert!(matches!(
            s.apply(&CoordCommand::Move {
                table: t,
                to: other.server
            }),
            CoordReply::Refused(_)
        ));
        // A borrow of the table waits for the split.
        let id = BorrowId {
            server: other.server,
            epoch: other.epoch,
            seq: 0,
        };
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::Borrow {
                id,
                tables: vec![t],
                done_below: 0,
            },
            now_ms: 2,
        });
        assert_eq!(
            r,
            CoordReply::Borrow {
                phase: BorrowPhase::Queued
            }
        );
        s.check().expect("state invariants");
        // A late or foreign report changes nothing.
        let done = |by, v| CoordCommand::SplitDone {
            table: t,
            at: 24,
            by,
            map_version: v,
        };
        assert!(matches!(s.apply(&done(other, v)), CoordReply::Stale(_)));
        assert!(matches!(
            s.apply(&done(owner, MapVersion(0))),
            CoordReply::Stale(_)
        ));
        assert_eq!(s.apply(&done(owner, v)), CoordReply::Ok);
        assert_eq!(s.map.tables[&t].hi, 24);
        assert_eq!(s.map.tables[&TableId(24)].hi, 30);
        assert_eq!(s.map.owner(TableId(24)), Some(owner.server));
        assert_eq!(s.map.table_of(25).map(|x| x.0), Some(TableId(24)));
        assert!(s.splits.is_empty());
        assert_ne!(
            s.borrows[&id].phase,
            BorrowPhase::Queued,
            "the borrow went on"
        );
        s.check().expect("state invariants");
    }

    #[test]
    fn a_dead_owners_split_is_reported_by_its_recoverer() {
        let mut s = three_servers();
        let t = TableId(20);
        let owner = s.map.owner(t).expect("placed");
        assert_eq!(
            s.apply(&CoordCommand::Split { table: t, at: None }),
            CoordReply::Ok
        );
        // The owner's lease ends: the split is forgotten with it...
        for id in 2..=4u32 {
            if ServerId(id) != owner {
                renew(&mut s, id, 1_500);
            }
        }
        s.apply(&CoordCommand::Tick { now_ms: 1_600 });
        assert!(s.splits.is_empty());
        let m = s.migrations[&t];
        let by = s.live(m.to).expect("recoverer");
        // ...and the recoverer, which found it finished in the store, tells.
        let r = s.apply(&CoordCommand::Added {
            tables: vec![t],
            by,
            map_version: s.map.version,
            splits: vec![(t, 26)],
        });
        assert_eq!(r, CoordReply::Ok);
        assert_eq!(s.map.tables[&t].hi, 26);
        assert_eq!(s.map.owner(TableId(26)), Some(by.server));
        s.check().expect("state invariants");
    }

    fn drain(s: &mut CoordState, id: u32, drain: bool) -> CoordReply {
        let r = s.apply(&CoordCommand::Drain {
            server: ServerId(id),
            drain,
        });
        s.check().expect("state invariants");
        r
    }

    #[test]
    fn drain_is_idempotent_and_undone_by_add() {
        let mut s = three_servers();
        let before = s.map.version;
        assert_eq!(drain(&mut s, 3, true), CoordReply::Ok);
        assert!(matches!(drain(&mut s, 3, true), CoordReply::Stale(_)));
        assert!(s.draining.contains(&ServerId(3)));
        assert!(!s.in_service(ServerId(3)));
        assert_eq!(
            s.map.version, before,
            "the mark alone does not change the map"
        );
        assert_eq!(drain(&mut s, 3, false), CoordReply::Ok);
        assert!(matches!(drain(&mut s, 3, false), CoordReply::Stale(_)));
        assert!(s.in_service(ServerId(3)));
        assert!(matches!(drain(&mut s, 9, true), CoordReply::Refused(_)));
        assert!(matches!(drain(&mut s, 9, false), CoordReply::Refused(_)));
    }

    #[test]
    fn the_last_server_in_service_cannot_be_drained() {
        let mut s = three_servers();
        assert_eq!(drain(&mut s, 2, true), CoordReply::Ok);
        assert_eq!(drain(&mut s, 3, true), CoordReply::Ok);
        assert!(matches!(drain(&mut s, 4, true), CoordReply::Refused(_)));
        assert!(s.in_service(ServerId(4)));
    }

    #[test]
    fn moves_and_recoveries_skip_a_draining_server() {
        let mut s = three_servers();
        assert_eq!(drain(&mut s, 3, true), CoordReply::Ok);
        let t = s
            .map
            .tables
            .iter()
            .find(|(_, p)| p.owner == ServerId(2))
            .map(|(t, _)| *t)
            .expect("a table of server 2");
        let r = s.apply(&CoordCommand::Move {
            table: t,
            to: ServerId(3),
        });
        assert!(matches!(r, CoordReply::Refused(_)), "{r:?}");
        // Server 4's lease runs out: its tables go to 2, not to the draining 3, although
        // 3 has as few tables.
        renew(&mut s, 2, 900);
        renew(&mut s, 3, 900);
        s.apply(&CoordCommand::Tick { now_ms: 1_600 });
        assert!(s.live(ServerId(4)).is_none(), "4 is fenced");
        for (t, m) in &s.migrations {
            assert_eq!(
                m.to,
                ServerId(2),
                "table {t:?} recovered by a draining server"
            );
        }
        add_all(&mut s);
        assert!(s.map.tables.values().all(|p| p.owner != ServerId(4)));
    }

    #[test]
    fn a_draining_server_still_recovers_when_it_is_the_only_one_left() {
        let mut s = three_servers();
        assert_eq!(drain(&mut s, 3, true), CoordReply::Ok);
        // 2 and 4 stop renewing; only the draining 3 is left: it takes their tables
        // rather than leave them unserved.
        renew(&mut s, 3, 900);
        s.apply(&CoordCommand::Tick { now_ms: 1_600 });
        add_all(&mut s);
        assert!(s.unplaced.is_empty());
        assert!(s.map.tables.values().all(|p| p.owner == ServerId(3)));
    }

    #[test]
    fn a_key_change_settles_when_every_live_server_holds_it_or_is_fenced_for_good() {
        let mut s = three_servers();
        let key = kochab_proto::cluster::SealedKey {
            nonce: [1; 16],
            sealed: [2; 32],
            policy: kochab_proto::KeyPolicy::TRUSTED,
            revoked: false,
            note: String::new(),
        };
        let CoordReply::Key { id, .. } = s.apply(&CoordCommand::KeyAdd { key }) else {
            panic!("not added");
        };
        let CoordReply::Key { version, .. } = s.apply(&CoordCommand::KeyRevoke { id }) else {
            panic!("not revoked");
        };
        assert_eq!(s.keys_behind().len(), 3);
        for id in [2, 3] {
            let by = s.live(ServerId(id)).unwrap();
            let r = s.apply(&CoordCommand::KeysApplied { by, version });
            assert_eq!(r, CoordReply::Ok);
        }
        let four = s.live(ServerId(4)).unwrap();
        assert_eq!(s.keys_behind(), vec![four]);
        assert!(s.keys_settled(version).is_err());
        // Server 4 renews its lease but never applies the keys: fenced past the grace.
        let grace = crate::keys::apply_grace_ms(s.lease_ms);
        let mut now = 1;
        while s.live(ServerId(4)).is_some() {
            now += 500;
            assert!(now <= grace + 1_000, "server 4 was not fenced");
            for id in 2..=4 {
                if s.live(ServerId(id)).is_some() {
                    renew(&mut s, id, now);
                }
            }
            s.apply(&CoordCommand::Tick { now_ms: now });
        }
        assert!(now > grace);
        // Its lease may still run: the change settles only after it.
        let until = s.servers[&ServerId(4)].lease_until_ms;
        assert!(until > now && s.keys_settled(version).is_err());
        s.apply(&CoordCommand::Tick { now_ms: until });
        assert_eq!(s.keys_settled(version), Ok(()));
        // A late report of the fenced incarnation changes nothing.
        let r = s.apply(&CoordCommand::KeysApplied { by: four, version });
        assert!(matches!(r, CoordReply::Stale(_)), "{r:?}");
        s.check().expect("state invariants");
    }

    #[test]
    fn drain_round_trips_through_the_snapshot_encoding() {
        let mut s = three_servers();
        drain(&mut s, 4, true);
        let bytes = postcard::to_stdvec(&s).expect("encode");
        let back: CoordState = postcard::from_bytes(&bytes).expect("decode");
        assert_eq!(back, s);
    }
}
