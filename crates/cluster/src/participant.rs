//! The metadata server's side of the cluster protocols: registration and lease renewal,
//! self-fencing, DROP with drain, ADD/recovery, and borrows for multi-table operations.
//!
//! Pure: the host calls in with events and its clock and carries out the returned actions
//! (send this, load these tables, write this checkpoint, stop). The host also asks
//! [`Participant::admit`] before every operation and calls [`Participant::end_op`] after,
//! which is how a DROP knows when a table is idle.

use std::collections::BTreeMap;

use kochab_proto::InodeId;
use kochab_proto::cluster::{
    BorrowId, BorrowPhase, Control, ControlBody, ControlReply, CoordReply, Epoch, Incarnation,
    MapVersion, RemoteUse, ServerId, ServerRequest, TableId, TableLoad,
};

/// A deliberate protocol bug, for showing that the simulation catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// Never stop serving when the lease runs out (and recoverers do not seal journals).
    Fencing,
    /// DROP checkpoints at once, without waiting for in-flight operations.
    Drain,
    /// A borrow's operations end when the borrow is returned, before their journal
    /// record is durable: the DROP that sends the tables home checkpoints at once, so a
    /// crash of the borrower loses the record from its own tables while the lender's
    /// checkpoint has the operation.
    BorrowEarly,
}

impl Break {
    /// Every switch, in the order of [`Break::name`]'s list.
    pub const ALL: [Break; 3] = [Break::Fencing, Break::Drain, Break::BorrowEarly];

    /// The name `SIM_BREAK` takes.
    pub fn name(self) -> &'static str {
        match self {
            Break::Fencing => "fencing",
            Break::Drain => "drain",
            Break::BorrowEarly => "borrow-early",
        }
    }

    /// The switch called `name`.
    pub fn parse(name: &str) -> Option<Break> {
        Break::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// Timers of a participant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParticipantConfig {
    /// Stop serving this long before the lease ends by the local clock: covers clock rate
    /// differences between this server and the coordinator over one lease.
    pub margin_ms: u64,
    /// Renew this often (a third of the lease leaves two retries before it ends).
    pub renew_every_ms: u64,
    /// Resend an unanswered request after this long.
    pub retry_ms: u64,
    /// A deliberate bug, for the simulation; production never sets one.
    pub broken: Option<Break>,
}

impl Default for ParticipantConfig {
    fn default() -> Self {
        ParticipantConfig {
            margin_ms: 500,
            renew_every_ms: 1_000,
            retry_ms: 500,
            broken: None,
        }
    }
}

/// Most lease renewals remembered while unanswered (older ones are no longer useful).
const RENEWALS_MAX: usize = 8;

/// What the host must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a request to the coordinator; its answer comes back through `on_reply(req_id)`.
    ToCoord { req_id: u64, req: ServerRequest },
    /// Answer the coordinator's driver.
    Reply(ControlReply),
    /// Load these tables from the store (sealing and replaying the journal of any fenced
    /// incarnation their manifests name, if its epoch is below `epochs`), write manifests
    /// naming this incarnation, then call `loaded`.
    Load {
        tables: Vec<TableId>,
        epochs: Vec<Incarnation>,
    },
    /// `table` is idle and refuses new operations: write its clean checkpoint (a manifest
    /// CAS that the store refuses if this incarnation is fenced), forget it, call
    /// `checkpointed`.
    Checkpoint { table: TableId },
    /// Every table of this borrow is here: run the operations that waited for it, then
    /// call `borrow_done`.
    RunBorrowed { id: BorrowId },
    /// The borrow was refused: fail (the client retries) the operations that waited.
    BorrowFailed { id: BorrowId },
    /// `table` is idle and refuses new operations: split it (at `at`, or where half of
    /// its inodes are below), write both halves' checkpoints, then call `split_done`.
    Split { table: TableId, at: Option<InodeId> },
    /// Stop serving and acknowledging anything; restart as a new incarnation.
    Fence,
}

/// Whether an operation may run now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Run it; call `end_op` with the same tables when it is durable (or failed).
    Ok,
    /// Another server serves the first table (`owner` if known): the client refreshes.
    WrongServer {
        map_version: MapVersion,
        owner: Option<ServerId>,
    },
    /// A table is being loaded here, or the lease is not valid: retry shortly.
    NotReady,
    /// The first table is here, others are not: borrow them all.
    NeedBorrow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Registering { first_sent_ms: Option<u64> },
    Live { epoch: Epoch, valid_until_ms: u64 },
    Fenced,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TableState {
    Loading,
    Serving,
    Draining {
        checkpointing: bool,
    },
    /// New operations wait (NotReady) until the split is written.
    Splitting {
        at: Option<InodeId>,
        writing: bool,
    },
}

/// How a split the host tried ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SplitOutcome {
    /// Both halves are durable: the upper one starts at this id.
    Done(InodeId),
    /// Nothing changed: the table cannot be split (too few inodes, an overflow region).
    Refused(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum BorrowState {
    Asking,
    Granted,
    Returning,
}

/// The server side of the cluster protocols, for one incarnation (a fenced participant is
/// replaced by a new one).
#[derive(Clone, Debug)]
pub struct Participant {
    server: ServerId,
    addr: String,
    nonce: u64,
    cfg: ParticipantConfig,
    life: Life,
    tables: BTreeMap<TableId, TableState>,
    /// Highest map version of a control about each table (older controls are late).
    seen: BTreeMap<TableId, MapVersion>,
    /// Where dropped tables went (the WrongServer hint).
    moved_to: BTreeMap<TableId, ServerId>,
    inflight: BTreeMap<TableId, u32>,
    borrows: BTreeMap<u64, (Vec<TableId>, BorrowState)>,
    next_borrow: u64,
    /// Splits of this incarnation's tables (done here, or found finished in the store
    /// when loading), told to the coordinator in every answer about those tables.
    split_at: BTreeMap<TableId, InodeId>,
    /// Requests awaiting an answer: (request, last sent).
    pending: BTreeMap<u64, (ServerRequest, u64)>,
    /// Renewals awaiting an answer: req id -> sent at.
    renewals: BTreeMap<u64, u64>,
    next_req: u64,
    last_renew_ms: Option<u64>,
}

impl Participant {
    /// A new incarnation of `server`; `nonce` must differ for every process start.
    pub fn new(server: ServerId, addr: String, nonce: u64, cfg: ParticipantConfig) -> Self {
        Participant {
            server,
            addr,
            nonce,
            cfg,
            life: Life::Registering {
                first_sent_ms: None,
            },
            tables: BTreeMap::new(),
            seen: BTreeMap::new(),
            moved_to: BTreeMap::new(),
            inflight: BTreeMap::new(),
            borrows: BTreeMap::new(),
            next_borrow: 0,
            split_at: BTreeMap::new(),
            pending: BTreeMap::new(),
            renewals: BTreeMap::new(),
            // Request ids of different processes must not meet (a late reply to an earlier
            // process would otherwise be taken for an answer).
            next_req: nonce & !0xffff_ffff,
            last_renew_ms: None,
        }
    }

    /// The server this participant speaks for.
    pub fn server(&self) -> ServerId {
        self.server
    }

    /// This incarnation, once registered (and not fenced).
    pub fn incarnation(&self) -> Option<Incarnation> {
        match self.life {
            Life::Live { epoch, .. } => Some(Incarnation {
                server: self.server,
                epoch,
            }),
            _ => None,
        }
    }

    /// True while the lease (minus the margin) is valid by the local clock: only then may
    /// the server apply or acknowledge anything.
    pub fn can_ack(&self, now_ms: u64) -> bool {
        match self.life {
            Life::Live { valid_until_ms, .. } => {
                now_ms < valid_until_ms || self.cfg.broken == Some(Break::Fencing)
            }
            _ => false,
        }
    }

    /// True if this server serves `table` right now.
    pub fn serves(&self, table: TableId, now_ms: u64) -> bool {
        self.can_ack(now_ms)
            && matches!(
                self.tables.get(&table),
                Some(
                    TableState::Serving
                        | TableState::Draining { .. }
                        | TableState::Splitting { .. }
                )
            )
    }

    /// Tables held (serving or draining).
    pub fn tables(&self) -> Vec<TableId> {
        self.tables
            .iter()
            .filter(|(_, s)| **s != TableState::Loading)
            .map(|(t, _)| *t)
            .collect()
    }

    /// Operations in flight on `table`.
    pub fn inflight(&self, table: TableId) -> u32 {
        self.inflight.get(&table).copied().unwrap_or(0)
    }

    fn request(&mut self, req: ServerRequest, now_ms: u64) -> Action {
        let req_id = self.next_req;
        self.next_req += 1;
        self.pending.insert(req_id, (req.clone(), now_ms));
        Action::ToCoord { req_id, req }
    }

    fn fence(&mut self) -> Vec<Action> {
        self.life = Life::Fenced;
        self.tables.clear();
        self.pending.clear();
        vec![Action::Fence]
    }

    /// Timer: register, renew the lease, resend late requests, fence when the lease ends.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match self.life {
            Life::Fenced => return out,
            Life::Registering { first_sent_ms } => {
                if first_sent_ms.is_none() {
                    self.life = Life::Registering {
                        first_sent_ms: Some(now_ms),
                    };
                    let req = ServerRequest::Register {
                        server: self.server,
                        addr: self.addr.clone(),
                        nonce: self.nonce,
                    };
                    out.push(self.request(req, now_ms));
                }
            }
            Life::Live {
                epoch,
                valid_until_ms,
            } => {
                if now_ms >= valid_until_ms && self.cfg.broken != Some(Break::Fencing) {
                    return self.fence();
                }
                if self
                    .last_renew_ms
                    .is_none_or(|t| now_ms >= t + self.cfg.renew_every_ms)
                {
                    self.last_renew_ms = Some(now_ms);
                    let req_id = self.next_req;
                    self.next_req += 1;
                    self.renewals.insert(req_id, now_ms);
                    while self.renewals.len() > RENEWALS_MAX {
                        self.renewals.pop_first();
                    }
                    out.push(Action::ToCoord {
                        req_id,
                        req: ServerRequest::RenewLease {
                            server: self.server,
                            epoch,
                        },
                    });
                }
            }
        }
        for (req_id, (req, sent)) in self.pending.iter_mut() {
            if now_ms >= *sent + self.cfg.retry_ms {
                *sent = now_ms;
                out.push(Action::ToCoord {
                    req_id: *req_id,
                    req: req.clone(),
                });
            }
        }
        out
    }

    /// The coordinator answered request `req_id`.
    pub fn on_reply(&mut self, req_id: u64, reply: &CoordReply, now_ms: u64) -> Vec<Action> {
        if self.life == Life::Fenced {
            return Vec::new();
        }
        let known = self.renewals.contains_key(&req_id) || self.pending.contains_key(&req_id);
        if !known {
            return Vec::new();
        }
        if let CoordReply::Fenced { .. } = reply {
            return self.fence();
        }
        if let Some(sent) = self.renewals.remove(&req_id) {
            // The coordinator extended the lease to at least `sent + lease` by its clock.
            if let (
                CoordReply::Renewed {
                    epoch: renewed,
                    lease_ms,
                },
                Life::Live {
                    epoch,
                    valid_until_ms,
                },
            ) = (reply, self.life)
                && *renewed == epoch
            {
                let until = (sent + lease_ms).saturating_sub(self.cfg.margin_ms);
                self.life = Life::Live {
                    epoch,
                    valid_until_ms: valid_until_ms.max(until),
                };
            }
            return Vec::new();
        }
        let Some((req, _)) = self.pending.remove(&req_id) else {
            return Vec::new();
        };
        match (req, reply) {
            (
                ServerRequest::Register { .. },
                CoordReply::Registered {
                    epoch,
                    lease_ms,
                    nonce,
                },
            ) if *nonce == self.nonce => {
                // Measured from the first send: a retry may be answered from the first.
                let first = match self.life {
                    Life::Registering { first_sent_ms } => first_sent_ms.unwrap_or(now_ms),
                    _ => now_ms,
                };
                self.life = Life::Live {
                    epoch: *epoch,
                    valid_until_ms: (first + lease_ms).saturating_sub(self.cfg.margin_ms),
                };
                self.last_renew_ms = Some(now_ms);
                Vec::new()
            }
            (ServerRequest::Register { .. }, CoordReply::Registered { .. }) => {
                // Meant for an earlier process: keep asking.
                let req = ServerRequest::Register {
                    server: self.server,
                    addr: self.addr.clone(),
                    nonce: self.nonce,
                };
                vec![self.request(req, now_ms)]
            }
            (ServerRequest::Register { .. }, _) => self.fence(),
            (ServerRequest::Borrow { id, .. }, CoordReply::Borrow { phase }) => {
                if *phase == BorrowPhase::Ready {
                    self.granted(id)
                } else {
                    Vec::new()
                }
            }
            (ServerRequest::Borrow { id, .. }, _) => {
                self.borrows.remove(&id.seq);
                vec![Action::BorrowFailed { id }]
            }
            (ServerRequest::Return { id, .. }, _) => {
                self.borrows.remove(&id.seq);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    fn granted(&mut self, id: BorrowId) -> Vec<Action> {
        match self.borrows.get_mut(&id.seq) {
            Some((_, st)) if *st == BorrowState::Asking => {
                *st = BorrowState::Granted;
                // The Borrow request is answered for good.
                self.pending.retain(
                    |_, (r, _)| !matches!(r, ServerRequest::Borrow { id: b, .. } if *b == id),
                );
                vec![Action::RunBorrowed { id }]
            }
            _ => Vec::new(),
        }
    }

    /// A control message from the coordinator's driver.
    pub fn on_control(&mut self, c: &Control, now_ms: u64) -> Vec<Action> {
        let Some(me) = self.incarnation() else {
            return Vec::new();
        };
        if c.to != me || !self.can_ack(now_ms) {
            return Vec::new();
        }
        match &c.body {
            ControlBody::Drop {
                table,
                map_version,
                to,
            } => {
                if self.late(*table, *map_version) {
                    return Vec::new();
                }
                self.moved_to.insert(*table, *to);
                match self.tables.get(table) {
                    None => vec![Action::Reply(ControlReply::Dropped {
                        table: *table,
                        by: me,
                        map_version: *map_version,
                    })],
                    Some(TableState::Loading) => Vec::new(),
                    Some(TableState::Serving) => {
                        self.tables.insert(
                            *table,
                            TableState::Draining {
                                checkpointing: false,
                            },
                        );
                        self.maybe_checkpoint(*table)
                    }
                    Some(TableState::Draining { .. }) => self.maybe_checkpoint(*table),
                    // Asked while splitting: drop once the split is done (the driver
                    // resends; the coordinator never asks both at once).
                    Some(TableState::Splitting { .. }) => Vec::new(),
                }
            }
            ControlBody::Add {
                tables,
                map_version,
                epochs,
            } => {
                let mut serving = Vec::new();
                let mut load = Vec::new();
                for t in tables {
                    if self.late(*t, *map_version) {
                        continue;
                    }
                    match self.tables.get(t) {
                        Some(TableState::Serving) => serving.push(*t),
                        Some(_) => {}
                        None => {
                            self.tables.insert(*t, TableState::Loading);
                            self.moved_to.remove(t);
                            load.push(*t);
                        }
                    }
                }
                let mut out = Vec::new();
                if !serving.is_empty() {
                    let splits = self.splits_of(&serving);
                    out.push(Action::Reply(ControlReply::Added {
                        tables: serving,
                        by: me,
                        map_version: *map_version,
                        splits,
                    }));
                }
                if !load.is_empty() {
                    out.push(Action::Load {
                        tables: load,
                        epochs: epochs.clone(),
                    });
                }
                out
            }
            ControlBody::Grant { id } => {
                let mut out = self.granted(*id);
                out.push(Action::Reply(ControlReply::GrantAck { id: *id }));
                out
            }
            ControlBody::Split {
                table,
                at,
                map_version,
            } => {
                if self.late(*table, *map_version) {
                    return Vec::new();
                }
                if let Some(done) = self.split_at.get(table)
                    && at.is_none_or(|a| a == *done)
                {
                    return vec![Action::Reply(ControlReply::Split {
                        table: *table,
                        at: *done,
                        by: me,
                        map_version: *map_version,
                    })];
                }
                match self.tables.get(table) {
                    Some(TableState::Serving) => {
                        self.tables.insert(
                            *table,
                            TableState::Splitting {
                                at: *at,
                                writing: false,
                            },
                        );
                        self.maybe_split(*table)
                    }
                    Some(TableState::Splitting { .. }) => self.maybe_split(*table),
                    // Not here (any more), loading or leaving: the coordinator's map is
                    // behind; it forgets the split when it catches up.
                    _ => vec![Action::Reply(ControlReply::SplitRefused {
                        table: *table,
                        by: me,
                        map_version: *map_version,
                        reason: "the table is not served here right now".into(),
                    })],
                }
            }
            // The host answers it: the keys are its server's, not the protocol's.
            ControlBody::Keys { .. } => Vec::new(),
            // Member to member, carried out by the transaction host (issue 33).
            ControlBody::Txn { .. } => Vec::new(),
        }
    }

    /// The splits this incarnation knows of among `tables`.
    fn splits_of(&self, tables: &[TableId]) -> Vec<(TableId, InodeId)> {
        tables
            .iter()
            .filter_map(|t| Some((*t, *self.split_at.get(t)?)))
            .collect()
    }

    fn maybe_split(&mut self, table: TableId) -> Vec<Action> {
        let idle = self.inflight(table) == 0;
        match self.tables.get_mut(&table) {
            Some(TableState::Splitting { at, writing }) if !*writing && idle => {
                *writing = true;
                vec![Action::Split { table, at: *at }]
            }
            _ => Vec::new(),
        }
    }

    /// The host finished (or gave up) the split of `table`; `Err`: the store failed or
    /// refused half-way, so this incarnation stops (its recoverer finishes the split).
    pub fn split_done(
        &mut self,
        table: TableId,
        result: Result<SplitOutcome, String>,
    ) -> Vec<Action> {
        let Some(me) = self.incarnation() else {
            return Vec::new();
        };
        if !matches!(self.tables.get(&table), Some(TableState::Splitting { .. })) {
            return Vec::new();
        }
        let map_version = self.seen_min(&[table]);
        match result {
            Err(_) => self.fence(),
            Ok(SplitOutcome::Refused(reason)) => {
                self.tables.insert(table, TableState::Serving);
                vec![Action::Reply(ControlReply::SplitRefused {
                    table,
                    by: me,
                    map_version,
                    reason,
                })]
            }
            Ok(SplitOutcome::Done(at)) => {
                self.tables.insert(table, TableState::Serving);
                self.tables.insert(TableId(at), TableState::Serving);
                self.seen.insert(TableId(at), map_version);
                self.split_at.insert(table, at);
                vec![Action::Reply(ControlReply::Split {
                    table,
                    at,
                    by: me,
                    map_version,
                })]
            }
        }
    }

    /// True if a control about `table` at `v` is older than one already seen.
    fn late(&mut self, table: TableId, v: MapVersion) -> bool {
        let seen = self.seen.entry(table).or_default();
        if v < *seen {
            return true;
        }
        *seen = v;
        false
    }

    fn maybe_checkpoint(&mut self, table: TableId) -> Vec<Action> {
        let idle = self.inflight(table) == 0 || self.cfg.broken == Some(Break::Drain);
        match self.tables.get_mut(&table) {
            Some(TableState::Draining { checkpointing }) if !*checkpointing && idle => {
                *checkpointing = true;
                vec![Action::Checkpoint { table }]
            }
            _ => Vec::new(),
        }
    }

    /// The host finished loading `tables` (`Err`: the store refused or failed). `Ok`
    /// lists splits the store showed that the tables' ranges did not (`(table, at)`): the
    /// upper halves are served here too.
    pub fn loaded(
        &mut self,
        tables: &[TableId],
        result: Result<Vec<(TableId, InodeId)>, String>,
    ) -> Vec<Action> {
        let Some(me) = self.incarnation() else {
            return Vec::new();
        };
        let mine: Vec<TableId> = tables
            .iter()
            .filter(|t| self.tables.get(t) == Some(&TableState::Loading))
            .copied()
            .collect();
        match result {
            Ok(found) => {
                for t in &mine {
                    self.tables.insert(*t, TableState::Serving);
                }
                let map_version = self.seen_min(&mine);
                for (t, at) in found {
                    if mine.contains(&t) {
                        self.split_at.insert(t, at);
                        self.tables.insert(TableId(at), TableState::Serving);
                        self.seen.insert(TableId(at), map_version);
                    }
                }
                let splits = self.splits_of(&mine);
                vec![Action::Reply(ControlReply::Added {
                    tables: mine,
                    by: me,
                    map_version,
                    splits,
                })]
            }
            Err(reason) => {
                for t in &mine {
                    self.tables.remove(t);
                }
                vec![Action::Reply(ControlReply::AddFailed {
                    tables: mine,
                    by: me,
                    reason,
                })]
            }
        }
    }

    /// The host wrote `table`'s clean checkpoint (`Err`: the store refused it, so this
    /// incarnation is fenced).
    pub fn checkpointed(&mut self, table: TableId, result: Result<(), String>) -> Vec<Action> {
        let Some(me) = self.incarnation() else {
            return Vec::new();
        };
        if result.is_err() {
            return self.fence();
        }
        self.tables.remove(&table);
        let map_version = self.seen_min(&[table]);
        vec![Action::Reply(ControlReply::Dropped {
            table,
            by: me,
            map_version,
        })]
    }

    /// The oldest control version seen for these tables (what a reply about them names).
    fn seen_min(&self, tables: &[TableId]) -> MapVersion {
        tables
            .iter()
            .map(|t| self.seen.get(t).copied().unwrap_or_default())
            .min()
            .unwrap_or_default()
    }

    /// May an operation on `tables` (the first is the one the client routed by) run now?
    /// On `Ok` it counts as in flight on each table until `end_op`.
    pub fn admit(&mut self, tables: &[TableId], now_ms: u64) -> Admit {
        let Some(first) = tables.first() else {
            return Admit::NotReady;
        };
        if !self.can_ack(now_ms) {
            return Admit::NotReady;
        }
        let wrong = |p: &Self, t: &TableId| Admit::WrongServer {
            map_version: p.seen.get(t).copied().unwrap_or_default(),
            owner: p.moved_to.get(t).copied(),
        };
        match self.tables.get(first) {
            Some(TableState::Serving) => {}
            Some(TableState::Loading | TableState::Splitting { .. }) => return Admit::NotReady,
            _ => return wrong(self, first),
        }
        for t in &tables[1..] {
            match self.tables.get(t) {
                Some(TableState::Serving) => {}
                Some(TableState::Loading | TableState::Splitting { .. }) => {
                    return Admit::NotReady;
                }
                _ => return Admit::NeedBorrow,
            }
        }
        for t in tables {
            *self.inflight.entry(*t).or_default() += 1;
        }
        Admit::Ok
    }

    /// An admitted operation finished (durable, or failed). May complete a drain.
    pub fn end_op(&mut self, tables: &[TableId]) -> Vec<Action> {
        let mut out = Vec::new();
        for t in tables {
            if let Some(n) = self.inflight.get_mut(t) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.inflight.remove(t);
                }
            }
            out.extend(self.maybe_checkpoint(*t));
            out.extend(self.maybe_split(*t));
        }
        out
    }

    /// Asks the coordinator for every table of one operation at once.
    pub fn borrow(&mut self, tables: &[TableId], now_ms: u64) -> (Option<BorrowId>, Vec<Action>) {
        let Some(me) = self.incarnation() else {
            return (None, Vec::new());
        };
        let id = BorrowId {
            server: me.server,
            epoch: me.epoch,
            seq: self.next_borrow,
        };
        self.next_borrow += 1;
        self.borrows
            .insert(id.seq, (tables.to_vec(), BorrowState::Asking));
        let req = ServerRequest::Borrow {
            id,
            tables: tables.to_vec(),
            done_below: self.done_below(),
        };
        (Some(id), vec![self.request(req, now_ms)])
    }

    /// The operations of a granted borrow are done: return its tables.
    pub fn borrow_done(&mut self, id: BorrowId, now_ms: u64) -> Vec<Action> {
        match self.borrows.get_mut(&id.seq) {
            Some((_, st)) if *st != BorrowState::Returning => *st = BorrowState::Returning,
            _ => return Vec::new(),
        }
        if self.cfg.broken == Some(Break::BorrowEarly)
            && let Some((tables, _)) = self.borrows.get(&id.seq)
        {
            // The bug: what ran under the borrow counts as ended before it is durable.
            for t in tables {
                self.inflight.remove(t);
            }
        }
        let req = ServerRequest::Return {
            id,
            done_below: self.done_below(),
        };
        vec![self.request(req, now_ms)]
    }

    /// Reports per-table load (sent once, not retried: the next report replaces it).
    pub fn report_load(&mut self, loads: Vec<TableLoad>) -> Vec<Action> {
        self.report(|me| ServerRequest::ReportLoad {
            server: me.server,
            epoch: me.epoch,
            loads,
        })
    }

    /// Reports this server's remote use of other servers' tables (`--multi-server auto`;
    /// sent once, not retried: the next report replaces it).
    pub fn report_remote_use(&mut self, uses: Vec<RemoteUse>) -> Vec<Action> {
        self.report(|me| ServerRequest::ReportRemoteUse {
            server: me.server,
            epoch: me.epoch,
            uses,
        })
    }

    /// A report of this incarnation to the coordinator (none while it has no epoch).
    fn report(&mut self, req: impl FnOnce(Incarnation) -> ServerRequest) -> Vec<Action> {
        let Some(me) = self.incarnation() else {
            return Vec::new();
        };
        let req_id = self.next_req;
        self.next_req += 1;
        vec![Action::ToCoord {
            req_id,
            req: req(me),
        }]
    }

    /// Borrows still open (for tests and status).
    pub fn open_borrows(&self) -> usize {
        self.borrows.len()
    }

    fn done_below(&self) -> u64 {
        self.borrows
            .keys()
            .next()
            .copied()
            .unwrap_or(self.next_borrow)
    }
}
