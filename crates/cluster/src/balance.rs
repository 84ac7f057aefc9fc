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
//! borrow or a recovery.
//!
//! When the counts are even, load decides: the servers' loads are the sums of what their
//! tables' owners last reported (operations per 5 s report), and a server with at least
//! twice the load of the least busy one and [`LOAD_GAP_MIN_OPS`] more gives it the table
//! that halves the gap best; the count rule then sends the coolest table of the receiver
//! back (with loads known, the count rule always picks the coolest table). The
//! thresholds are the hysteresis: a swap that leaves the two within a factor of two stops
//! it. `kochab coord --no-balance` turns both rules off.
//!
//! Splits: a table whose owner reports at least [`SPLIT_INODES`] inodes is split (its
//! owner picks a subtree boundary with about half below), and so is the busiest table of a
//! hot server when every busy table there carries more than the gap (moving it would only
//! move the hot spot). The halves start on the same server; the count rule then spreads
//! them. A table whose owner refused (one directory's files, an overflow region) is asked
//! again only once it has doubled.
//!
//! Affinity (`--multi-server auto`, [`AFFINITY_MIN_OPS`]): servers report how often
//! their multi-server operations (transactions or borrows) needed each table another
//! server holds; a table that one server needs at least twice as often as its owner's
//! clients use it moves to that server for good. It comes before the count rule, which
//! counts that use as the table's heat so that it does not send the table back.
//!
//! A draining server ([`CoordState::draining`]) is neither counted nor a target: its
//! tables move off first, one at a time, each to the server in service with the fewest
//! tables. Once it is back in service (`Drain { drain: false }`) it is counted again, so
//! the count rule hands it tables.

use kochab_proto::cluster::{CoordCommand, ServerId, TableId};

use crate::state::CoordState;

/// The next `Move` toward an even spread, or `None` when the placement is already even or
/// the cluster is busy (the load rule with [`LOAD_GAP_MIN_OPS`]).
pub fn next_move(state: &CoordState) -> Option<CoordCommand> {
    next_move_with(state, LOAD_GAP_MIN_OPS)
}

/// [`next_move`] with another load gap (operations per report) for the load rule.
pub fn next_move_with(state: &CoordState, load_gap_ops: u64) -> Option<CoordCommand> {
    if !state.bootstrapped
        || !state.migrations.is_empty()
        || !state.borrows.is_empty()
        || !state.unplaced.is_empty()
        || !state.splits.is_empty()
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
    if let Some(m) = affinity_move(state) {
        return Some(m);
    }
    let (&from, &most) = counts.iter().rev().max_by_key(|(_, c)| **c)?;
    let (&to, &fewest) = counts.iter().min_by_key(|(_, c)| **c)?;
    if most < fewest + 2 {
        return load_move(state, &live, load_gap_ops);
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
    // Once load is reported, the coolest table goes (after a load move, this hands the
    // hot server a cool table back instead of undoing the move).
    // Remote use counts as heat: a table that just moved by affinity is hot where it went
    // (before its new owner reports it), so the count rule does not send it back.
    let heat = |t: TableId| ops(state, t) + remote_total(state, t);
    let loaded = mine.iter().any(|(_, t)| heat(*t) > 0);
    let table = if loaded {
        mine.iter().min_by_key(|(_, t)| heat(*t)).map(|(_, t)| *t)?
    } else {
        mine.iter()
            .find(|(i, _)| slot(*i) == to)
            .or_else(|| mine.iter().find(|(i, _)| slot(*i) != from))
            .or(mine.first())
            .map(|(_, t)| *t)?
    };
    Some(CoordCommand::Move { table, to })
}

/// Operations a table's owner last reported for it (one report interval).
fn ops(state: &CoordState, t: TableId) -> u64 {
    state.load.get(&t).map_or(0, |l| l.ops)
}

/// Multi-server operations of all servers that last reported needing `t`.
fn remote_total(state: &CoordState, t: TableId) -> u64 {
    state.remote_use.get(&t).map_or(0, |by| by.values().sum())
}

/// The affinity rule needs at least this many multi-server operations of one server on a
/// table per report interval (with 5 s reports, 10 per second), so that a few stray
/// renames never move a table.
pub const AFFINITY_MIN_OPS: u64 = 50;

/// Affinity (`--multi-server auto`): a table one other server keeps needing moves there
/// for good. The server whose multi-server operations needed the table most in its last
/// report gets it if they were at least [`AFFINITY_MIN_OPS`] and at least twice the
/// operations its owner served on it: a table its own clients use more stays (moving it
/// would only turn their operations into multi-server ones). The factor of two is the
/// hysteresis: once moved, the table's operations there count as its load, and the old
/// owner would have to need it twice as much to take it back. Tables with the most such
/// use first; ties by table id.
fn affinity_move(state: &CoordState) -> Option<CoordCommand> {
    state
        .remote_use
        .iter()
        .filter_map(|(t, by)| {
            let owner = state.map.owner(*t)?;
            let (&to, &n) = by
                .iter()
                .filter(|(s, _)| **s != owner)
                .max_by_key(|(_, n)| **n)?;
            let wanted = n >= AFFINITY_MIN_OPS && n >= 2 * ops(state, *t);
            (wanted && state.in_service(to)).then_some((n, *t, to))
        })
        .max_by_key(|(n, t, _)| (*n, std::cmp::Reverse(*t)))
        .map(|(_, table, to)| CoordCommand::Move { table, to })
}

/// A hot server's gap to the coolest one that a load move needs: at least twice its
/// load and this many operations per report interval more (with 5 s reports, 2,000
/// operations per second), so that noise in the reports does not move tables.
pub const LOAD_GAP_MIN_OPS: u64 = 10_000;

/// With the counts even: one table from the busiest server to the least busy one, if the
/// busiest has at least twice the load and [`LOAD_GAP_MIN_OPS`] more. The table is the one
/// whose load comes closest to half the gap and is below the gap (so the move narrows it).
/// The counts are then uneven by the move, and the count rule hands the hot server the
/// coolest table of the cool one: in effect a swap.
fn load_move(state: &CoordState, live: &[ServerId], gap_min: u64) -> Option<CoordCommand> {
    let mut loads: std::collections::BTreeMap<ServerId, u64> =
        live.iter().map(|s| (*s, 0)).collect();
    for (t, p) in &state.map.tables {
        if let Some(l) = loads.get_mut(&p.owner) {
            *l += ops(state, *t);
        }
    }
    let (&hot, &high) = loads.iter().rev().max_by_key(|(_, l)| **l)?;
    let (&cool, &low) = loads.iter().min_by_key(|(_, l)| **l)?;
    let gap = high.saturating_sub(low);
    if hot == cool || high < 2 * low || gap < gap_min.max(1) {
        return None;
    }
    let movable = state
        .map
        .tables
        .iter()
        .filter(|(t, p)| p.owner == hot && ops(state, **t) > 0 && ops(state, **t) < gap)
        .min_by_key(|(t, _)| ops(state, **t).abs_diff(gap / 2))
        .map(|(t, _)| *t);
    if let Some(table) = movable {
        return Some(CoordCommand::Move { table, to: cool });
    }
    // Every busy table of the hot server carries more than the gap: moving one only moves
    // the hot spot. Split the busiest instead (its halves can then go separate ways).
    let (&table, _) = state
        .map
        .tables
        .iter()
        .filter(|(t, p)| p.owner == hot && ops(state, **t) >= gap && splittable(state, **t))
        .max_by_key(|(t, _)| ops(state, **t))?;
    Some(CoordCommand::Split { table, at: None })
}

/// Tables with more inodes than this are split when nothing else is in motion (a full
/// checkpoint of each half follows, and smaller tables move faster).
pub const SPLIT_INODES: u64 = 1_000_000;

/// A table to split because it holds at least `split_inodes` inodes (0: never), the
/// biggest first; `None` while anything is in motion.
pub fn next_split(state: &CoordState, split_inodes: u64) -> Option<CoordCommand> {
    if split_inodes == 0
        || !state.bootstrapped
        || !state.migrations.is_empty()
        || !state.borrows.is_empty()
        || !state.splits.is_empty()
    {
        return None;
    }
    let (table, _) = state
        .load
        .iter()
        .filter(|(t, l)| l.inodes >= split_inodes && splittable(state, **t))
        .max_by_key(|(_, l)| l.inodes)?;
    Some(CoordCommand::Split {
        table: *table,
        at: None,
    })
}

/// True if `table` is placed on a live server and its owner did not refuse to split it
/// (or it has doubled since).
fn splittable(state: &CoordState, table: TableId) -> bool {
    let Some(p) = state.map.tables.get(&table) else {
        return false;
    };
    let inodes = state.load.get(&table).map_or(0, |l| l.inodes);
    state.live(p.owner).is_some()
        && !state.splits.contains_key(&table)
        && state
            .unsplittable
            .get(&table)
            .is_none_or(|then| inodes >= 2 * then.max(&1))
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
                splits: vec![],
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

    /// Servers 1 and 2 with four tables, evened out to two each.
    fn two_servers_two_tables_each() -> CoordState {
        let mut s = CoordState::default();
        let tables: Vec<(TableId, u64)> = (0..4).map(|i| (TableId(i * 10), i * 10 + 10)).collect();
        s.apply(&CoordCommand::Bootstrap {
            tables,
            lease_ms: 10_000,
        });
        register(&mut s, 1, 1);
        register(&mut s, 2, 2);
        settle(&mut s);
        while let Some(m) = next_move(&s) {
            s.apply(&m);
            settle(&mut s);
        }
        s
    }

    /// Reports `ops` for `table` from its current owner.
    fn report(s: &mut CoordState, table: TableId, ops: u64) {
        let owner = s.map.owner(table).expect("placed");
        let inc = s.live(owner).expect("live owner");
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::ReportLoad {
                server: owner,
                epoch: inc.epoch,
                loads: vec![kochab_proto::cluster::TableLoad {
                    table,
                    ops,
                    inodes: 0,
                }],
            },
            now_ms: 10,
        });
        assert_eq!(r, CoordReply::Ok);
    }

    /// Reports `ops` multi-server operations of `server` that needed `table`.
    fn report_remote(s: &mut CoordState, server: u32, table: TableId, ops: u64) {
        let inc = s.live(ServerId(server)).expect("live");
        let r = s.apply(&CoordCommand::Request {
            req: ServerRequest::ReportRemoteUse {
                server: ServerId(server),
                epoch: inc.epoch,
                uses: vec![kochab_proto::cluster::RemoteUse { table, ops }],
            },
            now_ms: 10,
        });
        assert_eq!(r, CoordReply::Ok);
    }

    #[test]
    fn a_table_one_other_server_keeps_needing_moves_there_and_stays() {
        let mut s = two_servers_two_tables_each();
        let t = TableId(10);
        let owner = s.map.owner(t).expect("placed");
        let other = if owner == ServerId(1) { 2 } else { 1 };
        for u in s.map.tables.keys().copied().collect::<Vec<_>>() {
            report(&mut s, u, 100);
        }
        // A few multi-server operations, or fewer than twice the owner's own: no move.
        report_remote(&mut s, other, t, AFFINITY_MIN_OPS - 1);
        assert_eq!(next_move(&s), None);
        report(&mut s, t, 400);
        report_remote(&mut s, other, t, 799);
        assert_eq!(next_move(&s), None, "its own clients use it about as much");
        // Needed twice as much elsewhere: it moves there.
        report_remote(&mut s, other, t, 800);
        let to = ServerId(other);
        assert_eq!(next_move(&s), Some(CoordCommand::Move { table: t, to }));
        s.apply(&CoordCommand::Move { table: t, to });
        settle(&mut s);
        assert_eq!(s.map.owner(t), Some(to));
        // The counts are 3/1 now: the count rule hands back another table, not this one
        // (its remote use counts as heat until its new owner reports it).
        let m = next_move(&s).expect("3/1 is uneven");
        assert!(
            matches!(m, CoordCommand::Move { table, .. } if table != t),
            "{m:?}"
        );
        s.apply(&m);
        settle(&mut s);
        // Its new owner reports it busy and needs nothing elsewhere: it stays.
        report(&mut s, t, 800);
        report_remote(&mut s, other, TableId(0), 0);
        assert!(!s.remote_use.contains_key(&t), "a report replaces the last");
        assert_eq!(next_move(&s), None);
        assert_eq!(s.map.owner(t), Some(to));
    }

    #[test]
    fn a_big_table_and_a_hot_spot_no_move_can_fix_are_split() {
        let mut s = two_servers_two_tables_each();
        let t = TableId(10);
        let owner = s.map.owner(t).expect("placed");
        let inc = s.live(owner).expect("live");
        let big = |inodes| CoordCommand::Request {
            req: ServerRequest::ReportLoad {
                server: owner,
                epoch: inc.epoch,
                loads: vec![kochab_proto::cluster::TableLoad {
                    table: t,
                    ops: 0,
                    inodes,
                }],
            },
            now_ms: 10,
        };
        s.apply(&big(SPLIT_INODES - 1));
        assert_eq!(next_split(&s, SPLIT_INODES), None);
        s.apply(&big(SPLIT_INODES));
        let split = CoordCommand::Split { table: t, at: None };
        assert_eq!(next_split(&s, SPLIT_INODES), Some(split.clone()));
        assert_eq!(next_split(&s, 0), None, "0 turns the size rule off");
        // Refused by the owner: not asked again until the table has doubled.
        s.apply(&split);
        let v = s.splits[&t].started;
        s.apply(&CoordCommand::SplitRefused {
            table: t,
            by: inc,
            map_version: v,
            reason: "one directory".into(),
        });
        assert_eq!(next_split(&s, SPLIT_INODES), None);
        s.apply(&big(2 * SPLIT_INODES));
        assert_eq!(next_split(&s, SPLIT_INODES), Some(split));

        // One table carries all of a server's load: moving it moves the hot spot, so it
        // is split instead.
        let u = *s
            .map
            .tables
            .iter()
            .find(|(x, p)| **x != t && p.owner == owner)
            .expect("a second table on the server")
            .0;
        report(&mut s, u, 50_000);
        assert_eq!(
            next_move(&s),
            Some(CoordCommand::Split { table: u, at: None })
        );
    }

    #[test]
    fn a_hot_server_swaps_a_table_with_a_cool_one_and_then_stays() {
        let mut s = two_servers_two_tables_each();
        let on = |s: &CoordState, id: u32| -> Vec<TableId> {
            s.map
                .tables
                .iter()
                .filter(|(_, p)| p.owner == ServerId(id))
                .map(|(t, _)| *t)
                .collect()
        };
        let (a, b) = (on(&s, 1), on(&s, 2));
        assert_eq!((a.len(), b.len()), (2, 2));
        // Even load, or a small gap: nothing moves.
        for (t, ops) in [(a[0], 3_000), (a[1], 2_000), (b[0], 1_000), (b[1], 0)] {
            report(&mut s, t, ops);
        }
        assert_eq!(next_move(&s), None, "a gap under LOAD_GAP_MIN_OPS");
        // Server 1 does 50k per report, server 2 1k: the table nearest half the gap goes.
        report(&mut s, a[0], 30_000);
        report(&mut s, a[1], 20_000);
        assert_eq!(
            next_move(&s),
            Some(CoordCommand::Move {
                table: a[1],
                to: ServerId(2)
            })
        );
        s.apply(&next_move(&s).expect("load move"));
        settle(&mut s);
        // The counts (1/3) send server 2's coolest table back: a swap.
        assert_eq!(
            next_move(&s),
            Some(CoordCommand::Move {
                table: b[1],
                to: ServerId(1)
            })
        );
        s.apply(&next_move(&s).expect("count move"));
        settle(&mut s);
        // 30k against 21k: within a factor of two, so it stays.
        assert_eq!(next_move(&s), None);
        assert_eq!(on(&s, 1), vec![a[0], b[1]]);
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
