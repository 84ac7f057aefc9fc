//! What a member does with the tables it is told to load (ADD, or recovery of a fenced
//! server's tables), decided from their manifests before any is written: a load that
//! failed half-way would leave manifests naming a server that does not serve them. And
//! the per-table load it reports to the coordinator.

use std::collections::BTreeMap;

use kochab_proto::cluster::{Incarnation, RemoteUse, TableId, TableLoad};

/// How often a member reports its tables' load to the coordinator (operations admitted
/// in the interval and inodes held): one coordinator log entry per server per interval,
/// and often enough for the balancer to see a hot server within seconds.
pub const LOAD_REPORT_EVERY_MS: u64 = 5_000;

/// The incarnation a manifest names as its table's owner: its records since the table's
/// checkpoint are in that incarnation's journal (server id and epoch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Owner {
    /// The server's id.
    pub server: u64,
    /// The epoch the coordinator gave that incarnation.
    pub epoch: u64,
}

impl From<Incarnation> for Owner {
    fn from(i: Incarnation) -> Owner {
        Owner {
            server: u64::from(i.server.0),
            epoch: i.epoch.0,
        }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "journal {}.{}", self.server, self.epoch)
    }
}

/// What loading one table takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Released cleanly (no owner): its checkpoint holds everything.
    Fresh,
    /// It names this incarnation and is loaded here: an earlier try of this load did it.
    Earlier,
    /// A fenced incarnation owns it: seal that journal, then replay it after the
    /// checkpoint.
    Recover(Owner),
}

/// Why a table cannot be loaded here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClaimRefused {
    /// The manifest names this incarnation, yet the table is not loaded.
    #[error(
        "table {table:016x}'s manifest names this incarnation ({me}) but it is not loaded: \
         an earlier load failed half-way"
    )]
    HalfLoaded {
        /// The table's first id.
        table: u64,
        /// This incarnation.
        me: Owner,
    },
    /// The owner is not fenced (no newer epoch of its server is known): it may still write.
    #[error(
        "table {table:016x} is owned by server {} at epoch {}, which is not fenced",
        owner.server,
        owner.epoch
    )]
    Live {
        /// The table's first id.
        table: u64,
        /// The owner its manifest names.
        owner: Owner,
    },
}

/// The claims of one load, table by table.
#[derive(Clone, Debug)]
pub struct LoadPlan {
    me: Owner,
    epochs: Vec<Incarnation>,
    fresh: Vec<TableId>,
    recover: BTreeMap<Owner, Vec<TableId>>,
}

impl LoadPlan {
    /// A load by incarnation `me`; `epochs` are the servers' current incarnations (an owner
    /// with an older epoch than its server's is fenced).
    pub fn new(me: Owner, epochs: &[Incarnation]) -> LoadPlan {
        LoadPlan {
            me,
            epochs: epochs.to_vec(),
            fresh: Vec::new(),
            recover: BTreeMap::new(),
        }
    }

    /// `table`'s manifest names `owner`; `loaded_here` tells whether the table is loaded
    /// in this process (asked only if the manifest names this incarnation).
    pub fn claim(
        &mut self,
        table: TableId,
        owner: Option<Owner>,
        loaded_here: impl FnOnce() -> bool,
    ) -> Result<Claim, ClaimRefused> {
        let claim = match owner {
            None => Claim::Fresh,
            Some(o) if o == self.me => {
                if !loaded_here() {
                    return Err(ClaimRefused::HalfLoaded {
                        table: table.0,
                        me: self.me,
                    });
                }
                Claim::Earlier
            }
            Some(o) => {
                let fenced = self
                    .epochs
                    .iter()
                    .any(|i| u64::from(i.server.0) == o.server && i.epoch.0 > o.epoch);
                if !fenced {
                    return Err(ClaimRefused::Live {
                        table: table.0,
                        owner: o,
                    });
                }
                Claim::Recover(o)
            }
        };
        match claim {
            Claim::Fresh => self.fresh.push(table),
            Claim::Earlier => {}
            Claim::Recover(o) => self.recover.entry(o).or_default().push(table),
        }
        Ok(claim)
    }

    /// The tables released cleanly, in the order claimed.
    pub fn fresh(&self) -> &[TableId] {
        &self.fresh
    }

    /// The fenced journals to seal and replay, each with its tables.
    pub fn recover(&self) -> &BTreeMap<Owner, Vec<TableId>> {
        &self.recover
    }
}

/// Operations admitted per table (by the table they were routed by) since the last load
/// report.
#[derive(Clone, Debug, Default)]
pub struct LoadCounter {
    ops: BTreeMap<TableId, u64>,
    /// Multi-server operations that needed each table of another server.
    remote: BTreeMap<TableId, u64>,
}

impl LoadCounter {
    /// One operation routed by `table` was admitted.
    pub fn admitted(&mut self, table: TableId) {
        *self.ops.entry(table).or_default() += 1;
    }

    /// One multi-server operation needed `tables`, which other servers hold.
    pub fn needed_elsewhere(&mut self, tables: &[TableId]) {
        for t in tables {
            *self.remote.entry(*t).or_default() += 1;
        }
    }

    /// The remote use counted since the last report, of tables not held here (`held`):
    /// one that came here meanwhile is no longer another server's.
    pub fn remote_report(&mut self, held: &[TableId]) -> Vec<RemoteUse> {
        std::mem::take(&mut self.remote)
            .into_iter()
            .filter(|(t, _)| !held.contains(t))
            .map(|(table, ops)| RemoteUse { table, ops })
            .collect()
    }

    /// The report of the tables loaded here (`(table, inodes)`) that the participant holds
    /// (`held`); counts of other tables are dropped (they moved away).
    pub fn report(
        mut self,
        loaded: impl IntoIterator<Item = (TableId, u64)>,
        held: &[TableId],
    ) -> Vec<TableLoad> {
        loaded
            .into_iter()
            .filter(|(t, _)| held.contains(t))
            .map(|(table, inodes)| TableLoad {
                table,
                ops: self.ops.remove(&table).unwrap_or(0),
                inodes,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::{Epoch, ServerId};

    fn inc(server: u32, epoch: u64) -> Incarnation {
        Incarnation {
            server: ServerId(server),
            epoch: Epoch(epoch),
        }
    }

    fn owner(server: u64, epoch: u64) -> Owner {
        Owner { server, epoch }
    }

    #[test]
    fn released_tables_are_fresh_and_fenced_owners_recovered() {
        let me = owner(1, 4);
        let mut plan = LoadPlan::new(me, &[inc(2, 3), inc(1, 4)]);
        let t = TableId;
        assert_eq!(plan.claim(t(10), None, || unreachable!()), Ok(Claim::Fresh));
        let dead = owner(2, 2);
        assert_eq!(
            plan.claim(t(20), Some(dead), || unreachable!()),
            Ok(Claim::Recover(dead))
        );
        assert_eq!(
            plan.claim(t(30), Some(dead), || unreachable!()),
            Ok(Claim::Recover(dead))
        );
        assert_eq!(plan.claim(t(40), Some(me), || true), Ok(Claim::Earlier));
        assert_eq!(plan.fresh(), &[t(10)]);
        assert_eq!(plan.recover().get(&dead), Some(&vec![t(20), t(30)]));
        assert_eq!(plan.recover().len(), 1);
    }

    #[test]
    fn a_live_owner_or_a_half_done_load_is_refused() {
        let me = owner(1, 4);
        let mut plan = LoadPlan::new(me, &[inc(2, 3)]);
        // The same epoch as the server's current one: it may still be writing.
        let live = owner(2, 3);
        let refused = plan.claim(TableId(20), Some(live), || unreachable!());
        assert_eq!(
            refused,
            Err(ClaimRefused::Live {
                table: 20,
                owner: live
            })
        );
        // A stale epoch list (the owner is newer than what we know of): not fenced either.
        let newer = owner(2, 5);
        assert!(
            plan.claim(TableId(21), Some(newer), || unreachable!())
                .is_err()
        );
        // A server the list does not name at all.
        assert!(
            plan.claim(TableId(22), Some(owner(7, 1)), || unreachable!())
                .is_err()
        );
        let half = plan.claim(TableId(30), Some(me), || false);
        assert_eq!(half, Err(ClaimRefused::HalfLoaded { table: 30, me }));
        assert!(plan.fresh().is_empty() && plan.recover().is_empty());
        assert_eq!(
            half.unwrap_err().to_string(),
            "table 000000000000001e's manifest names this incarnation (journal 1.4) but it \
             is not loaded: an earlier load failed half-way"
        );
    }

    #[test]
    fn a_load_report_counts_held_tables_only() {
        let mut c = LoadCounter::default();
        c.admitted(TableId(1));
        c.admitted(TableId(1));
        c.admitted(TableId(9));
        let loads = c.report(
            [(TableId(1), 50), (TableId(2), 7), (TableId(3), 1)],
            &[TableId(1), TableId(2)],
        );
        let got: Vec<(u64, u64, u64)> =
            loads.iter().map(|l| (l.table.0, l.ops, l.inodes)).collect();
        assert_eq!(got, vec![(1, 2, 50), (2, 0, 7)]);
    }

    #[test]
    fn remote_use_is_reported_once_for_tables_held_elsewhere() {
        let mut c = LoadCounter::default();
        c.needed_elsewhere(&[TableId(4), TableId(5)]);
        c.needed_elsewhere(&[TableId(4)]);
        let uses = c.remote_report(&[TableId(5)]);
        assert_eq!(
            uses,
            vec![RemoteUse {
                table: TableId(4),
                ops: 2
            }]
        );
        assert!(c.remote_report(&[]).is_empty(), "counted once");
    }
}
