//! Placement balancing: which table the coordinator leader moves next so that tables end
//! up spread evenly over the live servers.
//!
//! Balance is by count: while the live server with the most tables has at least two more
//! than the one with the fewest, one of its tables moves there. A placement an operator
//! chose is therefore left alone as long as it is even; the balancer never undoes a move
//! that did not unbalance the counts. Which table moves: preferably one whose slot in the
//! id order (the i-th table by id on the (i mod n)-th live server) is the receiving
//! server, so a cluster filled from one server ends with consecutive tables on different
//! servers, which spreads independent top-level trees (the id policy deals them across
//! consecutive primary tables). One move at a time, and only while nothing else is in
//! motion (no migration, no borrow, nothing unplaced), so balancing never competes with a
//! borrow or a recovery. Load-based moves (hot tables to cool servers) are not built;
//! `load` is recorded but not read here.
//!
//! A draining server ([`CoordState::draining`]) is neither counted nor a target: its
//! tables move off first, one at a time, each to the server in service with the fewest
//! tables. Once it is back in service (`Drain { drain: false }`) it is counted again, so
//! the count rule hands it tables.

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
        .filter(|s| state.in_service(*s))
        .collect();
    let mut counts: std::collections::BTreeMap<ServerId, usize> =
        live.iter().map(|s| (*s, 0)).collect();
    for p in state.map.tables.values() {
        if let Some(c) = counts.get_mut(&p.owner) {
            *c += 1;
        }
    }
    // Ties go to the lowest server id, so the choice is deterministic.
    if let Some((&to, _)) = counts.iter().min_by_key(|(_, c)| **c)
        && let Some((&table, _)) = state
            .map
            .tables
            .iter()
            .find(|(_, p)| state.draining.contains(&p.owner) && state.live(p.owner).is_some())
    {
        return Some(CoordCommand::Move { table, to });
    }
    if live.len() < 2 {
        return None;
    }
    let (&from, &most) = counts.iter().rev().max_by_key(|(_, c)| **c)?;
    let (&to, &fewest) = counts.iter().min_by_key(|(_, c)| **c)?;
    if most < fewest + 2 {
        return None;
    }
    let slot = |i: usize| live[i % live.len()];
    let mine: Vec<(usize, TableId)> = state
        .map
        .tables
        .iter()
        .enumerate()
        .filter(|(_, (_, p))| p.owner == from)
        .map(|(i, (t, _))| (i, *t))
        .collect();
    let table = mine
        .iter()
        .find(|(i, _)| slot(*i) == to)
        .or_else(|| mine.iter().find(|(i, _)| slot(*i) != from))
        .or(mine.first())
        .map(|(_, t)| *t)?;
    Some(CoordCommand::Move { table, to })
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

        // An operator's move that keeps the counts even stays where it was put.
        let t = *s.map.tables.keys().next().expect("tables");
        s.apply(&CoordCommand::Move {
            table: t,
            to: ServerId(3),
        });
        settle(&mut s);
        assert_eq!(next_move(&s), None, "3/3/2 -> 2/3/3 is still even");
        assert_eq!(s.map.owner(t), Some(ServerId(3)));
        // One that unbalances them is evened out again, by one move.
        let t2 = *s.map.tables.keys().nth(1).expect("tables");
        s.apply(&CoordCommand::Move {
            table: t2,
            to: ServerId(3),
        });
        settle(&mut s);
        let m = next_move(&s).expect("2/2/4 is uneven");
        s.apply(&m);
        settle(&mut s);
        assert_eq!(next_move(&s), None);
    }

    #[test]
    fn a_drained_server_is_emptied_one_move_at_a_time_and_refilled_when_added() {
        let mut s = CoordState::default();
        let tables: Vec<(TableId, u64)> = (0..9).map(|i| (TableId(i * 10), i * 10 + 10)).collect();
        s.apply(&CoordCommand::Bootstrap {
            tables,
            lease_ms: 10_000,
        });
        for id in 1..=3 {
            register(&mut s, id, 1);
        }
        settle(&mut s);
        while let Some(m) = next_move(&s) {
            s.apply(&m);
            settle(&mut s);
        }
        let count = |s: &CoordState, id: u32| {
            s.map
                .tables
                .values()
                .filter(|p| p.owner == ServerId(id))
                .count()
        };
        assert_eq!((count(&s, 1), count(&s, 2), count(&s, 3)), (3, 3, 3));
        let r = s.apply(&CoordCommand::Drain {
            server: ServerId(2),
            drain: true,
        });
        assert_eq!(r, CoordReply::Ok);
        let mut moves = 0;
        while let Some(m) = next_move(&s) {
            let CoordCommand::Move { table, to } = m else {
                panic!("not a move: {m:?}");
            };
            assert_eq!(
                s.map.owner(table),
                Some(ServerId(2)),
                "only 2's tables move"
            );
            assert_ne!(to, ServerId(2));
            s.apply(&m);
            assert_eq!(next_move(&s), None, "one move at a time");
            settle(&mut s);
            moves += 1;
            assert!(moves <= 3, "draining does not converge");
        }
        assert_eq!(moves, 3);
        assert_eq!(count(&s, 2), 0, "drained");
        assert!(
            count(&s, 1).abs_diff(count(&s, 3)) <= 1,
            "spread over the rest"
        );
        // Back in service: the count rule hands it tables again.
        let r = s.apply(&CoordCommand::Drain {
            server: ServerId(2),
            drain: false,
        });
        assert_eq!(r, CoordReply::Ok);
        while let Some(m) = next_move(&s) {
            s.apply(&m);
            settle(&mut s);
        }
        assert_eq!((count(&s, 1), count(&s, 2), count(&s, 3)), (3, 3, 3));
    }
}
