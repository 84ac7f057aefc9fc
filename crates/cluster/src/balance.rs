//! Placement balancing: which table the coordinator leader moves next so that tables end
//! up spread evenly over the live servers.
//!
//! The target is fixed by ids alone: the i-th table (by id) belongs on the (i mod n)-th
//! live server (by id). Consecutive tables therefore land on different servers, which is
//! what spreads independent top-level trees (the id policy deals them across consecutive
//! primary tables). One move at a time, and only while nothing else is in motion (no
//! migration, no borrow, nothing unplaced), so balancing never competes with a borrow or
//! a recovery. Load-based moves (hot tables to cool servers) are not built; `load` is
//! recorded but not read here.

use kochab_proto::cluster::{CoordCommand, ServerId, TableId};

use crate::state::CoordState;

/// The next `Move` toward an even spread, or `None` when the placement is already even or
/// the cluster is busy.
pub fn next_move(state: &CoordState) -> Option<CoordCommand> {
    if !state.bootstrapped
        || !state.migrations.is_empty()
        || !state.borrows.is_empty()
        || !state.unplaced.is_empty()
    {
        return None;
    }
    let live: Vec<ServerId> = state
        .servers
        .keys()
        .copied()
        .filter(|s| state.live(*s).is_some())
        .collect();
    if live.len() < 2 {
        return None;
    }
    state
        .map
        .tables
        .iter()
        .enumerate()
        .find_map(|(i, (table, placement))| {
            let target = live[i % live.len()];
            (placement.owner != target).then_some(CoordCommand::Move {
                table: TableId(table.0),
                to: target,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::{CoordReply, ServerRequest};

    fn register(s: &mut CoordState, id: u32, now_ms: u64) {
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::Register {
                server: ServerId(id),
                addr: format!("s{id}"),
                nonce: u64::from(id),
            },
            now_ms,
        });
        assert!(matches!(r, CoordReply::Registered { .. }), "{r:?}");
    }

    /// Finishes every migration as the servers would.
    fn settle(s: &mut CoordState) {
        while let Some((t, m)) = s.migrations.iter().next().map(|(t, m)| (*t, *m)) {
            let version = m.started;
            if let Some(from) = m.from
                && m.phase == crate::state::Phase::Dropping
            {
                s.apply(&CoordCommand::Dropped {
                    table: t,
                    by: from,
                    map_version: version,
                });
                continue;
            }
            let by = s.live(m.to).expect("target is live");
            let r = s.apply(&CoordCommand::Added {
                tables: vec![t],
                by,
                map_version: s.map.version,
            });
            assert_eq!(r, CoordReply::Ok, "{t:?}");
        }
        s.check().expect("state invariants");
    }

    #[test]
    fn tables_spread_one_move_at_a_time_until_even() {
        let mut s = CoordState::default();
        let tables: Vec<(TableId, u64)> = (0..8).map(|i| (TableId(i * 10), i * 10 + 10)).collect();
        s.apply(&CoordCommand::Bootstrap {
            tables,
            lease_ms: 10_000,
        });
        register(&mut s, 1, 1);
        settle(&mut s);
        assert_eq!(next_move(&s), None, "one server: nothing to balance");
        register(&mut s, 2, 2);
        register(&mut s, 3, 3);
        let mut moves = 0;
        while let Some(m) = next_move(&s) {
            s.apply(&m);
            assert_eq!(next_move(&s), None, "nothing else while a table moves");
            settle(&mut s);
            moves += 1;
            assert!(moves <= 8, "balancing does not converge");
        }
        let owners: Vec<u32> = s.map.tables.values().map(|p| p.owner.0).collect();
        assert_eq!(owners, vec![1, 2, 3, 1, 2, 3, 1, 2]);
        assert_eq!(moves, 5, "tables already in place stay");
    }
}
