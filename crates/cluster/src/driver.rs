//! The coordinator leader's driver: turns the replicated state into control messages for
//! servers, and servers' control replies into commands to replicate.
//!
//! It keeps only retry timers. Everything it must do follows from [`CoordState`] (the
//! migrations and ready borrows in it), so a new leader, or a restarted one, repairs every
//! half-done migration by simply running (Ursa Minor §3.7). Its messages are idempotent at
//! the server, so resending after a timeout or a leader change is always safe.

use std::collections::BTreeMap;

use kochab_proto::cluster::{
    BorrowId, BorrowPhase, Control, ControlBody, ControlReply, CoordCommand, Incarnation, TableId,
};

use crate::state::{CoordState, Phase};

/// Timers of the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverConfig {
    /// Resend an unanswered control after this long (a server that is alive answers in
    /// about a round trip plus a checkpoint; a dead one is fenced by its lease instead).
    pub retry_ms: u64,
    /// Propose a `Tick` this often (lease expiry is noticed within this).
    pub tick_ms: u64,
    /// Move tables toward an even spread over the live servers ([`crate::balance`]).
    pub balance: bool,
    /// The balancer's load rule: how many more operations per report the busiest server
    /// must have than the least busy one (and at least twice its load).
    pub load_gap_ops: u64,
    /// Split tables that hold at least this many inodes (0: never split by size).
    pub split_inodes: u64,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            retry_ms: 1_000,
            tick_ms: 250,
            balance: true,
            load_gap_ops: crate::balance::LOAD_GAP_MIN_OPS,
            split_inodes: crate::balance::SPLIT_INODES,
        }
    }
}

/// What the leader must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverAction {
    Send(Control),
    Propose(CoordCommand),
}

/// What a control is about, for its retry timer.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Drop(TableId, Incarnation),
    /// Keyed by the whole set, so a table joining the set is sent at once.
    Add(Incarnation, Vec<TableId>),
    Grant(BorrowId),
    Split(TableId, Incarnation),
    /// Keyed by the version, so a newer change is sent at once.
    Keys(Incarnation, u64),
}

/// The leader-side protocol driver (not replicated; rebuilt from nothing on a new leader).
#[derive(Clone, Debug, Default)]
pub struct Driver {
    cfg: DriverConfig,
    /// When each control was last sent.
    sent: BTreeMap<Key, u64>,
    /// Grants the borrower acknowledged.
    acked: BTreeMap<BorrowId, ()>,
    last_tick_ms: Option<u64>,
}

impl Driver {
    /// A driver with no memory: what it must do follows from the state it is shown.
    pub fn new(cfg: DriverConfig) -> Driver {
        Driver {
            cfg,
            ..Default::default()
        }
    }

    /// Timer: proposes a `Tick` when due and resends every control whose answer is late.
    pub fn tick(&mut self, state: &CoordState, now_ms: u64) -> Vec<DriverAction> {
        let mut out = Vec::new();
        if self
            .last_tick_ms
            .is_none_or(|t| now_ms >= t + self.cfg.tick_ms)
        {
            self.last_tick_ms = Some(now_ms);
            out.push(DriverAction::Propose(CoordCommand::Tick { now_ms }));
            // At most one balancing move per tick: a duplicate (the previous one not yet
            // applied) is refused by the state, as the table is already moving.
            if self.cfg.balance
                && let Some(m) = crate::balance::next_split(state, self.cfg.split_inodes)
                    .or_else(|| crate::balance::next_move_with(state, self.cfg.load_gap_ops))
            {
                out.push(DriverAction::Propose(m));
            }
        }
        out.extend(self.controls(state, now_ms));
        out
    }

    /// The state changed (a command was applied): send what is new at once.
    pub fn on_state(&mut self, state: &CoordState, now_ms: u64) -> Vec<DriverAction> {
        self.controls(state, now_ms)
    }

    /// A server answered a control.
    pub fn on_reply(&mut self, reply: &ControlReply) -> Vec<DriverAction> {
        match reply {
            ControlReply::Dropped {
                table,
                by,
                map_version,
            } => {
                self.sent.remove(&Key::Drop(*table, *by));
                vec![DriverAction::Propose(CoordCommand::Dropped {
                    table: *table,
                    by: *by,
                    map_version: *map_version,
                })]
            }
            ControlReply::Added {
                tables,
                by,
                map_version,
                splits,
            } => {
                self.sent
                    .retain(|k, _| !matches!(k, Key::Add(i, _) if i == by));
                vec![DriverAction::Propose(CoordCommand::Added {
                    tables: tables.clone(),
                    by: *by,
                    map_version: *map_version,
                    splits: splits.clone(),
                })]
            }
            ControlReply::Split {
                table,
                at,
                by,
                map_version,
            } => {
                self.sent.remove(&Key::Split(*table, *by));
                vec![DriverAction::Propose(CoordCommand::SplitDone {
                    table: *table,
                    at: *at,
                    by: *by,
                    map_version: *map_version,
                })]
            }
            ControlReply::SplitRefused {
                table,
                by,
                map_version,
                reason,
            } => {
                self.sent.remove(&Key::Split(*table, *by));
                vec![DriverAction::Propose(CoordCommand::SplitRefused {
                    table: *table,
                    by: *by,
                    map_version: *map_version,
                    reason: reason.clone(),
                })]
            }
            // Retried on the timer; a server that cannot load a table is a bug or a store
            // outage, and either way asking again later is all the coordinator can do.
            ControlReply::AddFailed { .. } => Vec::new(),
            ControlReply::GrantAck { id } => {
                self.sent.remove(&Key::Grant(*id));
                self.acked.insert(*id, ());
                Vec::new()
            }
            ControlReply::KeysApplied { by, version } => {
                self.sent
                    .retain(|k, _| !matches!(k, Key::Keys(i, v) if i == by && v <= version));
                vec![DriverAction::Propose(CoordCommand::KeysApplied {
                    by: *by,
                    version: *version,
                })]
            }
        }
    }

    fn due(&mut self, key: Key, now_ms: u64) -> bool {
        match self.sent.get(&key) {
            Some(t) if now_ms < t + self.cfg.retry_ms => false,
            _ => {
                self.sent.insert(key, now_ms);
                true
            }
        }
    }

    /// Every control the state calls for that is not already on its way.
    fn controls(&mut self, state: &CoordState, now_ms: u64) -> Vec<DriverAction> {
        let mut out = Vec::new();
        let mut adds: BTreeMap<Incarnation, Vec<TableId>> = BTreeMap::new();
        let mut live_keys = Vec::new();
        for (t, m) in &state.migrations {
            match m.phase {
                Phase::Dropping => {
                    let Some(from) = m.from else { continue };
                    let key = Key::Drop(*t, from);
                    live_keys.push(key.clone());
                    if self.due(key, now_ms) {
                        out.push(DriverAction::Send(Control {
                            to: from,
                            body: ControlBody::Drop {
                                table: *t,
                                map_version: m.started,
                                to: m.to,
                            },
                        }));
                    }
                }
                Phase::Adding => {
                    if now_ms < m.not_before_ms {
                        continue;
                    }
                    if let Some(inc) = state.live(m.to) {
                        adds.entry(inc).or_default().push(*t);
                    }
                }
            }
        }
        // One Add per server carries all its tables: a failed server's tables are
        // recovered together.
        for (inc, tables) in adds {
            let key = Key::Add(inc, tables.clone());
            live_keys.push(key.clone());
            if self.due(key, now_ms) {
                out.push(DriverAction::Send(Control {
                    to: inc,
                    body: ControlBody::Add {
                        tables,
                        // The current version, not the migration's start: a server that
                        // saw a newer control about any of these tables must not take a
                        // retry of this one for a late message.
                        map_version: state.map.version,
                        epochs: state.epochs(),
                    },
                }));
            }
        }
        for (id, b) in &state.borrows {
            if b.phase != BorrowPhase::Ready || self.acked.contains_key(id) {
                continue;
            }
            let key = Key::Grant(*id);
            live_keys.push(key.clone());
            if self.due(key, now_ms) {
                out.push(DriverAction::Send(Control {
                    to: Incarnation {
                        server: id.server,
                        epoch: id.epoch,
                    },
                    body: ControlBody::Grant { id: *id },
                }));
            }
        }
        for (t, sp) in &state.splits {
            let key = Key::Split(*t, sp.by);
            live_keys.push(key.clone());
            if self.due(key, now_ms) {
                out.push(DriverAction::Send(Control {
                    to: sp.by,
                    body: ControlBody::Split {
                        table: *t,
                        at: sp.at,
                        map_version: sp.started,
                    },
                }));
            }
        }
        for inc in state.keys_behind() {
            let key = Key::Keys(inc, state.keys.version);
            live_keys.push(key.clone());
            if self.due(key, now_ms) {
                out.push(DriverAction::Send(Control {
                    to: inc,
                    body: ControlBody::Keys {
                        version: state.keys.version,
                    },
                }));
            }
        }
        // Forget timers of work the state no longer holds (bounded memory).
        self.sent.retain(|k, _| live_keys.contains(k));
        self.acked.retain(|id, _| state.borrows.contains_key(id));
        out
    }
}
