//! Step-by-step tests of the coordinator state, the driver and the participant.

use kochab_cluster::driver::{Driver, DriverAction, DriverConfig};
use kochab_cluster::participant::{Action, Admit, Break, Participant, ParticipantConfig};
use kochab_cluster::state::{CoordState, Phase};
use kochab_proto::cluster::{
    BorrowId, BorrowPhase, Control, ControlBody, ControlReply, CoordCommand, CoordReply, Epoch,
    Incarnation, ServerId, ServerRequest, TableId,
};

const LEASE: u64 = 1_000;

fn t(i: u64) -> TableId {
    TableId(i * 100)
}

fn req(s: &mut CoordState, req: ServerRequest, now_ms: u64) -> CoordReply {
    let r = s.apply(&CoordCommand::Request { req, now_ms });
    s.check().unwrap();
    r
}

fn register(s: &mut CoordState, server: u32, nonce: u64, now: u64) -> Epoch {
    let r = req(
        s,
        ServerRequest::Register {
            server: ServerId(server),
            addr: format!("s{server}"),
            nonce,
        },
        now,
    );
    match r {
        CoordReply::Registered { epoch, .. } => epoch,
        other => panic!("{other:?}"),
    }
}

/// Bootstraps `n` tables and registers servers 0 and 1; every first ADD is acknowledged.
fn cluster(n: u64) -> CoordState {
    let mut s = CoordState::default();
    let tables = (0..n).map(|i| (t(i), i * 100 + 100)).collect();
    s.apply(&CoordCommand::Bootstrap {
        tables,
        lease_ms: LEASE,
    });
    register(&mut s, 0, 10, 0);
    register(&mut s, 1, 11, 0);
    finish_adds(&mut s);
    // The first server to register got every table; move the odd ones to server 1.
    let by = s.live(ServerId(0)).unwrap();
    for i in (1..n).step_by(2) {
        s.apply(&CoordCommand::Move {
            table: t(i),
            to: ServerId(1),
        });
        let map_version = s.migrations[&t(i)].started;
        s.apply(&CoordCommand::Dropped {
            table: t(i),
            by,
            map_version,
        });
    }
    finish_adds(&mut s);
    s.check().unwrap();
    assert!(s.migrations.is_empty());
    s
}

fn finish_adds(s: &mut CoordState) {
    let adds: Vec<(TableId, ServerId)> = s
        .migrations
        .iter()
        .filter(|(_, m)| m.phase == Phase::Adding)
        .map(|(t, m)| (*t, m.to))
        .collect();
    for (table, to) in adds {
        let by = s.live(to).unwrap();
        let map_version = s.map.version;
        s.apply(&CoordCommand::Added {
            tables: vec![table],
            by,
            map_version,
            splits: vec![],
        });
        s.check().unwrap();
    }
}

#[test]
fn register_is_idempotent_and_old_processes_stay_dead() {
    let mut s = cluster(2);
    let e = s.live(ServerId(0)).unwrap().epoch;
    assert_eq!(
        register(&mut s, 0, 10, 5),
        e,
        "a retried Register keeps the epoch"
    );
    let e2 = register(&mut s, 0, 20, 6);
    assert!(e2 > e, "a new process is a new incarnation");
    let late = req(
        &mut s,
        ServerRequest::Register {
            server: ServerId(0),
            addr: "s0".into(),
            nonce: 10,
        },
        7,
    );
    assert!(matches!(late, CoordReply::Fenced { .. }), "{late:?}");
    assert_eq!(s.live(ServerId(0)).unwrap().epoch, e2);
}

#[test]
fn lease_expiry_fences_and_recovery_waits_for_the_lease() {
    let mut s = cluster(4);
    let dead = s.live(ServerId(1)).unwrap();
    let epoch = s.live(ServerId(0)).unwrap().epoch;
    req(
        &mut s,
        ServerRequest::RenewLease {
            server: ServerId(0),
            epoch,
        },
        900,
    );
    s.apply(&CoordCommand::Tick { now_ms: 1_500 });
    s.check().unwrap();
    assert!(s.live(ServerId(1)).is_none());
    assert!(s.map.tables.values().all(|p| p.owner == ServerId(0)));
    // The dead incarnation's renewal is refused; its epoch is below the current one.
    let r = req(
        &mut s,
        ServerRequest::RenewLease {
            server: ServerId(1),
            epoch: dead.epoch,
        },
        1_501,
    );
    assert!(matches!(r, CoordReply::Fenced { current } if current > dead.epoch));
    // Recovery of all of server 1's tables goes out as one Add naming the epochs.
    let mut d = Driver::new(DriverConfig::default());
    let sent = d.tick(&s, 1_600);
    let add = sent.iter().find_map(|a| match a {
        DriverAction::Send(Control {
            body: ControlBody::Add { tables, epochs, .. },
            ..
        }) => Some((tables.len(), epochs.clone())),
        _ => None,
    });
    let (n, epochs) = add.expect("recovery Add");
    assert_eq!(n, 2);
    assert!(
        epochs
            .iter()
            .any(|e| e.server == ServerId(1) && e.epoch > dead.epoch)
    );
}

#[test]
fn early_fence_by_a_new_process_waits_for_the_old_lease() {
    let mut s = cluster(2);
    // Server 1 restarts at 100 while its old lease runs to 1000.
    register(&mut s, 1, 99, 100);
    let mut d = Driver::new(DriverConfig::default());
    let adds = |acts: &[DriverAction]| {
        acts.iter()
            .filter(|a| {
                matches!(
                    a,
                    DriverAction::Send(Control {
                        body: ControlBody::Add { .. },
                        ..
                    })
                )
            })
            .count()
    };
    assert_eq!(
        adds(&d.tick(&s, 200)),
        0,
        "no Add while the old lease may run"
    );
    assert_eq!(adds(&d.tick(&s, 1_001)), 1);
}

#[test]
fn migration_drop_then_map_then_add_and_duplicates_are_stale() {
    let mut s = cluster(2);
    let table = t(0);
    let from = s.live(s.map.owner(table).unwrap()).unwrap();
    let to = ServerId(1 - from.server.0);
    let v0 = s.map.version;
    assert_eq!(s.apply(&CoordCommand::Move { table, to }), CoordReply::Ok);
    assert_eq!(
        s.map.owner(table),
        Some(from.server),
        "the map moves only after DROP"
    );
    assert!(matches!(
        s.apply(&CoordCommand::Move { table, to }),
        CoordReply::Refused(_)
    ));
    let mut d = Driver::new(DriverConfig::default());
    let acts = d.tick(&s, 10);
    assert!(acts.iter().any(|a| matches!(a,
        DriverAction::Send(Control { to: inc, body: ControlBody::Drop { table: tt, .. } })
            if *inc == from && *tt == table)));
    let started = s.migrations[&table].started;
    let prop = d.on_reply(&ControlReply::Dropped {
        table,
        by: from,
        map_version: started,
    });
    for p in &prop {
        if let DriverAction::Propose(c) = p {
            assert_eq!(s.apply(c), CoordReply::Ok);
        }
    }
    assert_eq!(s.map.owner(table), Some(to));
    assert!(s.map.version > v0);
    assert!(matches!(
        s.apply(&CoordCommand::Dropped {
            table,
            by: from,
            map_version: started
        }),
        CoordReply::Stale(_)
    ));
    let by = s.live(to).unwrap();
    let dead = Incarnation {
        server: to,
        epoch: Epoch(by.epoch.0 - 1),
    };
    assert!(matches!(
        s.apply(&CoordCommand::Added {
            tables: vec![table],
            by: dead,
            map_version: s.map.version,
            splits: vec![],
        }),
        CoordReply::Stale(_)
    ));
    assert_eq!(
        s.apply(&CoordCommand::Added {
            tables: vec![table],
            by,
            map_version: s.map.version,
            splits: vec![],
        }),
        CoordReply::Ok
    );
    assert!(s.migrations.is_empty());
    // Moved back to `from` and out again: a late duplicate of the first Dropped must not
    // complete the new drop.
    s.apply(&CoordCommand::Move {
        table,
        to: from.server,
    });
    let v = s.migrations[&table].started;
    s.apply(&CoordCommand::Dropped {
        table,
        by,
        map_version: v,
    });
    finish_adds(&mut s);
    s.apply(&CoordCommand::Move { table, to });
    assert!(matches!(
        s.apply(&CoordCommand::Dropped {
            table,
            by: from,
            map_version: started
        }),
        CoordReply::Stale(_)
    ));
    assert_eq!(s.map.owner(table), Some(from.server));
}

#[test]
fn a_new_driver_repairs_a_half_done_migration_from_state_alone() {
    let mut s = cluster(2);
    let table = t(1);
    let to = ServerId(1 - s.map.owner(table).unwrap().0);
    s.apply(&CoordCommand::Move { table, to });
    // The leader that started it is gone; a new one knows only the state.
    let mut d = Driver::new(DriverConfig::default());
    let first = d.tick(&s, 50);
    assert!(first.iter().any(|a| matches!(
        a,
        DriverAction::Send(Control {
            body: ControlBody::Drop { .. },
            ..
        })
    )));
    assert!(
        d.tick(&s, 60)
            .iter()
            .all(|a| !matches!(a, DriverAction::Send(_))),
        "no resend before the retry timer"
    );
    assert!(
        d.tick(&s, 50 + DriverConfig::default().retry_ms)
            .iter()
            .any(|a| matches!(
                a,
                DriverAction::Send(Control {
                    body: ControlBody::Drop { .. },
                    ..
                })
            ))
    );
}

fn borrow(s: &mut CoordState, server: u32, seq: u64, tables: &[u64]) -> CoordReply {
    let inc = s.live(ServerId(server)).unwrap();
    req(
        s,
        ServerRequest::Borrow {
            id: BorrowId {
                server: inc.server,
                epoch: inc.epoch,
                seq,
            },
            tables: tables.iter().map(|i| t(*i)).collect(),
            done_below: 0,
        },
        10,
    )
}

fn give_back(s: &mut CoordState, server: u32, seq: u64) -> CoordReply {
    let inc = s.live(ServerId(server)).unwrap();
    req(
        s,
        ServerRequest::Return {
            id: BorrowId {
                server: inc.server,
                epoch: inc.epoch,
                seq,
            },
            done_below: 0,
        },
        10,
    )
}

#[test]
fn borrows_are_granted_whole_in_fifo_order() {
    let mut s = cluster(4);
    let granted = |r: &CoordReply| {
        matches!(
            r,
            CoordReply::Borrow {
                phase: BorrowPhase::Moving | BorrowPhase::Ready
            }
        )
    };
    assert!(granted(&borrow(&mut s, 0, 0, &[0, 1])));
    let queued = CoordReply::Borrow {
        phase: BorrowPhase::Queued,
    };
    assert_eq!(borrow(&mut s, 1, 0, &[1, 2]), queued);
    // Table 2 is free but wanted by an earlier waiter: FIFO says wait.
    assert_eq!(borrow(&mut s, 0, 1, &[2]), queued);
    // Unrelated tables go ahead.
    assert!(granted(&borrow(&mut s, 1, 1, &[3])));
    // A duplicate changes nothing.
    assert_eq!(borrow(&mut s, 1, 0, &[1, 2]), queued);
    assert_eq!(give_back(&mut s, 0, 0), CoordReply::Ok);
    assert!(
        s.borrows
            .values()
            .filter(|b| b.phase != BorrowPhase::Queued)
            .count()
            == 2
    );
    assert!(matches!(give_back(&mut s, 0, 0), CoordReply::Stale(_)));
    // A late duplicate of a returned borrow does not come back.
    assert!(matches!(
        borrow(&mut s, 0, 0, &[0, 1]),
        CoordReply::Stale(_)
    ));
}

#[test]
fn borrowed_tables_move_to_the_borrower_and_become_ready() {
    let mut s = cluster(2);
    let a = s.map.owner(t(0)).unwrap();
    let other = if s.map.owner(t(1)) == Some(a) {
        None
    } else {
        s.map.owner(t(1))
    };
    let b = other.expect("cluster() puts t0 and t1 on different servers");
    borrow(&mut s, a.0, 0, &[0, 1]);
    let m = s
        .migrations
        .get(&t(1))
        .copied()
        .expect("t1 moves to the borrower");
    assert_eq!((m.to, m.phase), (a, Phase::Dropping));
    let by = s.live(b).unwrap();
    let map_version = s.migrations[&t(1)].started;
    s.apply(&CoordCommand::Dropped {
        table: t(1),
        by,
        map_version,
    });
    finish_adds(&mut s);
    assert!(s.borrows.values().all(|x| x.phase == BorrowPhase::Ready));
    // A locked table cannot be moved by anyone else.
    assert!(matches!(
        s.apply(&CoordCommand::Move { table: t(1), to: b }),
        CoordReply::Refused(_)
    ));
    // RETURN sends the borrowed table home; the borrower's own table stays.
    assert_eq!(give_back(&mut s, a.0, 0), CoordReply::Ok);
    let m = s.migrations.get(&t(1)).copied().expect("t1 goes home");
    assert_eq!((m.from.map(|f| f.server), m.to), (Some(a), b));
    assert!(!s.migrations.contains_key(&t(0)));
}

#[test]
fn state_survives_a_snapshot_round_trip() {
    let mut s = cluster(3);
    borrow(&mut s, 0, 0, &[0, 1, 2]);
    let json = serde_json::to_string(&s).unwrap();
    let back: CoordState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    let bytes = postcard::to_stdvec(&s).unwrap();
    assert_eq!(postcard::from_bytes::<CoordState>(&bytes).unwrap(), s);
}

fn live_participant(now: u64) -> (Participant, Incarnation) {
    live_broken_participant(now, None)
}

fn live_broken_participant(now: u64, broken: Option<Break>) -> (Participant, Incarnation) {
    let cfg = ParticipantConfig {
        margin_ms: 100,
        renew_every_ms: 300,
        retry_ms: 200,
        broken,
    };
    let mut p = Participant::new(ServerId(7), "s7".into(), 1 << 40, cfg);
    let acts = p.tick(now);
    let Some(Action::ToCoord { req_id, .. }) = acts.first().cloned() else {
        panic!("{acts:?}")
    };
    let reply = CoordReply::Registered {
        epoch: Epoch(3),
        lease_ms: LEASE,
        nonce: 1 << 40,
    };
    p.on_reply(req_id, &reply, now + 5);
    let inc = p.incarnation().unwrap();
    (p, inc)
}

#[test]
fn a_paused_server_stops_serving_when_its_lease_ends() {
    let (mut p, me) = live_participant(0);
    let add = Control {
        to: me,
        body: ControlBody::Add {
            tables: vec![t(0)],
            map_version: Default::default(),
            epochs: vec![],
        },
    };
    let acts = p.on_control(&add, 10);
    assert!(matches!(acts.as_slice(), [Action::Load { .. }]));
    p.loaded(&[t(0)], Ok(vec![]));
    assert!(p.serves(t(0), 20));
    // SIGSTOP for longer than the lease: no renewal was answered.
    let resumed = 5_000;
    assert!(!p.serves(t(0), resumed));
    assert_eq!(p.admit(&[t(0)], resumed), Admit::NotReady);
    assert!(p.on_control(&add, resumed).is_empty());
    assert_eq!(p.tick(resumed), vec![Action::Fence]);
    assert!(p.incarnation().is_none());
}

#[test]
fn drop_waits_for_in_flight_operations() {
    let (mut p, me) = live_participant(0);
    p.on_control(
        &Control {
            to: me,
            body: ControlBody::Add {
                tables: vec![t(0), t(1)],
                map_version: Default::default(),
                epochs: vec![],
            },
        },
        10,
    );
    p.loaded(&[t(0), t(1)], Ok(vec![]));
    assert_eq!(p.admit(&[t(0), t(1)], 20), Admit::Ok);
    let drop = Control {
        to: me,
        body: ControlBody::Drop {
            table: t(1),
            map_version: Default::default(),
            to: ServerId(2),
        },
    };
    assert!(
        p.on_control(&drop, 30).is_empty(),
        "an operation is in flight"
    );
    assert_eq!(
        p.admit(&[t(1)], 31),
        Admit::WrongServer {
            map_version: Default::default(),
            owner: Some(ServerId(2))
        }
    );
    assert_eq!(p.admit(&[t(0), t(1)], 31), Admit::NeedBorrow);
    assert_eq!(
        p.end_op(&[t(0), t(1)]),
        vec![Action::Checkpoint { table: t(1) }]
    );
    let acts = p.checkpointed(t(1), Ok(()));
    assert_eq!(
        acts,
        vec![Action::Reply(ControlReply::Dropped {
            table: t(1),
            by: me,
            map_version: Default::default()
        })]
    );
    // A retried Drop is answered again; a control for another epoch is ignored.
    assert_eq!(p.on_control(&drop, 40), acts);
    let other = Control {
        to: Incarnation {
            server: me.server,
            epoch: Epoch(2),
        },
        ..drop
    };
    assert!(p.on_control(&other, 41).is_empty());
}

/// Runs one operation under a granted borrow of tables 0 and 1, returns the borrow while
/// the operation's record is not durable yet, and asks for table 1 back: what the
/// participant does at once.
fn drop_after_early_return(broken: Option<Break>) -> (Participant, Vec<Action>) {
    let (mut p, me) = live_broken_participant(0, broken);
    let (id, _) = p.borrow(&[t(0), t(1)], 10);
    let id = id.expect("a live participant borrows");
    let add = ControlBody::Add {
        tables: vec![t(0), t(1)],
        map_version: Default::default(),
        epochs: vec![],
    };
    p.on_control(&Control { to: me, body: add }, 20);
    p.loaded(&[t(0), t(1)], Ok(vec![]));
    let grant = Control {
        to: me,
        body: ControlBody::Grant { id },
    };
    assert!(
        p.on_control(&grant, 30)
            .contains(&Action::RunBorrowed { id })
    );
    assert_eq!(p.admit(&[t(0), t(1)], 31), Admit::Ok);
    // It ran; its record is not durable yet, the borrow goes back all the same.
    let ret = p.borrow_done(id, 32);
    assert!(matches!(
        ret.as_slice(),
        [Action::ToCoord {
            req: ServerRequest::Return { .. },
            ..
        }]
    ));
    let drop = ControlBody::Drop {
        table: t(1),
        map_version: Default::default(),
        to: ServerId(2),
    };
    let acts = p.on_control(&Control { to: me, body: drop }, 40);
    (p, acts)
}

#[test]
fn a_returned_borrow_drains_until_its_operations_are_durable() {
    let (mut p, acts) = drop_after_early_return(None);
    assert!(acts.is_empty(), "the operation's record is not durable yet");
    assert_eq!(
        p.end_op(&[t(0), t(1)]),
        vec![Action::Checkpoint { table: t(1) }]
    );
    // The break lets the table go before then.
    let (_, acts) = drop_after_early_return(Some(Break::BorrowEarly));
    assert_eq!(acts, vec![Action::Checkpoint { table: t(1) }]);
}

#[test]
fn breaks_have_names() {
    for b in Break::ALL {
        assert_eq!(Break::parse(b.name()), Some(b));
    }
    assert_eq!(Break::parse("borrow-early"), Some(Break::BorrowEarly));
    assert_eq!(Break::parse("none"), None);
}

#[test]
fn load_reports_count_only_for_the_owner() {
    let mut s = cluster(2);
    let owner = s.map.owner(t(0)).unwrap();
    let other = ServerId(1 - owner.0);
    for server in [owner, other] {
        let (mut p, _) = live_participant(0);
        let acts = p.report_load(vec![kochab_proto::cluster::TableLoad {
            table: t(0),
            ops: 10 + u64::from(server.0),
            inodes: 1,
        }]);
        let Some(Action::ToCoord {
            req: ServerRequest::ReportLoad { loads, .. },
            ..
        }) = acts.first()
        else {
            panic!("{acts:?}")
        };
        let epoch = s.live(server).unwrap().epoch;
        let r = req(
            &mut s,
            ServerRequest::ReportLoad {
                server,
                epoch,
                loads: loads.clone(),
            },
            5,
        );
        assert_eq!(r, CoordReply::Ok);
    }
    assert_eq!(
        s.load.get(&t(0)).map(|l| l.ops),
        Some(10 + u64::from(owner.0))
    );
}
