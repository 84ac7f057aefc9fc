//! The core's one entry: [`Core::step`] takes an event and the time, and returns effects.
//!
//! Requests, callback answers, timer ticks and cleanup go in as an [`Event`] with a [`Now`]
//! (the clocks and the journal's durable point, read once by the shell); what must happen
//! in the world comes out as [`Effects`]: records to append, each with the LSN the core
//! gave it, callbacks to send, replies with the LSN they wait for, requests parked and why,
//! and whether to start a journal flush now. The core performs no I/O and reads no clock:
//! one pass per request (admit, run the engine, journal, leases and callbacks, reply).
//!
//! The shell ([`crate::shared::Shared::step`]) holds the core lock across the step and the
//! appends it returns, so that journal order is execution order; conn.rs, the data path
//! (`datapass`), table moves and checkpoints (`tablepass`), the maintenance loops and the
//! simulation all go through it. Nothing else can change the core: the lock's guard
//! ([`crate::shared::CoreGuard`]) gives read access only.

use crate::clock::Now;
use crate::core::{
    Answer, Cleanup, Core, JournalEntryRef, MODIFIED_PRUNE_AT, Member, Parked, Refusal,
};
use crate::datapass::{DataChange, DataDone};
use crate::leases::Expired;
use crate::outbox::{CallbackTx, Outbox};
use crate::replycache::Outcome;
use crate::tablepass::{TableChange, TableDone};
use kochab_breaks::Break;
use kochab_meta::{Engine, Mutation};
use kochab_proto::cluster::TableId;
use kochab_proto::*;
use std::time::Duration;

/// What the core is told.
pub enum Event<'a> {
    /// A batch of one client's metadata requests (rid, request), run in order. `flushes`:
    /// wait for other sessions' flushes of what they touch (false for a request that
    /// waited once already).
    /// `answers`: where the replies go (emptied first; a connection passes the one it
    /// keeps, so a batch allocates nothing for them).
    Requests {
        client: u64,
        reqs: &'a [(u64, Request)],
        flushes: bool,
        answers: Vec<Answer>,
    },
    /// Session `from` answered the callbacks `ids`.
    CallbacksAnswered { from: u64, ids: &'a [u64] },
    /// The callback timer: end the callbacks whose deadline passed.
    ExpireCallbacks,
    /// The session timer: end the sessions of clients gone longer than `grace`.
    ExpireSessions { grace: Duration },
    /// Run one batch of queued cleanup.
    Cleanup,
    /// Connection `conn_id` of `session` begins; `callbacks`: where its callbacks go, if
    /// it asked for leases.
    Attach {
        session: u64,
        conn_id: u64,
        callbacks: Option<CallbackTx>,
    },
    /// The board where `session`'s replies wait for the callbacks its changes caused.
    Board { session: u64 },
    /// Connection `conn_id` of `session` ended.
    Detach { session: u64, conn_id: u64 },
    /// `reader` is about to see `ids`: call back the sessions that may hold writes of them.
    CallFlushes { reader: u64, ids: &'a [InodeId] },
    /// The deletions of these reclaim entries are durable: journal them as finished.
    ReclaimsDone { done: &'a [kochab_meta::Reclaim] },
    /// Internal work to do in bounded batches (see `Cleanup`).
    QueueCleanup(Cleanup),
    /// A transaction's record (issue 33, `txn_host`): `changes` (a participant's committed
    /// part, checked under its locks; empty for other records) turned into the engine's
    /// mutations and applied to the tables, then journaled with them as one record that
    /// `encode` writes (the entry and its trailer).
    TxnRecord {
        changes: &'a [kochab_cluster::txn::Mutation],
        encode: &'a EncodeTxnRecord<'a>,
    },
    /// A transaction's outcome for `client`'s request `seq` (`kept`: the inode its reply
    /// names), kept in the reply cache.
    TxnAnswered {
        client: u64,
        seq: u64,
        kept: Outcome,
    },
    /// A table leaving or arriving, or checkpointed (its waits and store I/O are the
    /// shell's).
    Table(TableChange<'a>),
    /// The metadata part of a data operation of `client` (its data I/O is the shell's).
    Data { client: u64, change: DataChange<'a> },
}

/// What the shell is to do after a step (besides its outbox, which it carries out first).
#[derive(Default)]
pub struct Effects {
    /// Journal records and callbacks.
    pub out: Outbox,
    /// Replies, each with the LSN it waits for.
    pub answers: Vec<Answer>,
    /// Requests not run, and what they wait for (tables to borrow, flushes).
    pub parked: Vec<(u64, Parked)>,
    /// For `CallbacksAnswered`: whether the session went into default for a slow answer,
    /// and how many answers were ignored.
    pub slow_answer: bool,
    pub ignored_answers: usize,
    /// For `ExpireCallbacks`.
    pub expired: Expired,
    /// Sessions ended by `ExpireSessions`.
    pub ended_sessions: Vec<u64>,
    /// More cleanup is queued: step `Cleanup` again (after letting others have the lock).
    pub more_cleanup: bool,
    /// For `Data`: what it answers.
    pub data: Option<Result<DataDone, FsError>>,
    /// For `Table`: what it answers.
    pub table: Option<TableDone>,
    /// For `Attach`: the session's board (its replies wait there for the callbacks its
    /// changes caused).
    pub board: Option<std::sync::Arc<crate::leases::Board>>,
    /// For `CallFlushes`: the callbacks to wait for.
    pub wait: Vec<u64>,
    /// For `TxnRecord`: what became of the record.
    pub record: Option<TxnRecorded>,
}

/// Writes a transaction's journal payload (the entry with its engine mutations, and the
/// trailer) into the buffer it is given.
pub type EncodeTxnRecord<'a> = dyn Fn(Vec<u8>, &[Mutation]) -> Vec<u8> + 'a;

/// What became of a transaction's record (`Event::TxnRecord`).
#[derive(Debug)]
pub enum TxnRecorded {
    /// Applied and journaled at this LSN.
    Journaled(u64),
    /// Its changes do not fit the tables (a checked key changed or left while locked: a
    /// bug, or a table that left): nothing was applied or journaled.
    NotApplicable(String),
    /// Applying a mutation failed part-way: memory may be ahead of the journal.
    Failed(String),
}

/// What the core reads of its surroundings during a step: the member's admission, and the
/// facts of a whole-server answer. Implemented by the shell; it must not take the core lock.
pub trait Env {
    /// The member's admission (`None`: the single server, which admits everything).
    fn member(&self) -> Option<&dyn Member>;
    /// `kochab status`'s report.
    fn status(&self, core: &Core) -> StatusReport;
    /// The file data store's size (for statfs).
    fn capacity(&self) -> std::io::Result<kochab_store::Capacity>;
}

impl Core {
    /// The one entry: runs `event` at `now` and returns what the shell must carry out.
    pub fn step(&mut self, event: Event<'_>, now: Now, env: &dyn Env) -> Effects {
        let mut fx = Effects::default();
        match event {
            Event::Requests {
                client,
                reqs,
                flushes,
                answers,
            } => {
                fx.answers = answers;
                fx.answers.clear();
                self.requests(client, reqs, flushes, now, env, &mut fx)
            }
            Event::CallbacksAnswered { from, ids } => {
                let (slow, ignored) = self.callbacks_answered(from, ids, now.instant);
                fx.slow_answer = slow;
                fx.ignored_answers = ignored;
            }
            Event::ExpireCallbacks => fx.expired = self.expire_callbacks(now.instant),
            Event::ExpireSessions { grace } => {
                for client in self.sessions.expired(grace, now.instant) {
                    self.end_session(client, now);
                    fx.ended_sessions.push(client);
                }
                fx.more_cleanup = !self.cleanup.is_empty();
            }
            Event::Cleanup => fx.more_cleanup = self.cleanup_batch(now),
            Event::Attach {
                session,
                conn_id,
                callbacks,
            } => fx.board = Some(self.attach(session, conn_id, callbacks)),
            Event::Board { session } => fx.board = Some(self.callbacks.board(session)),
            Event::Detach { session, conn_id } => self.detach(session, conn_id, now.instant),
            Event::CallFlushes { reader, ids } => {
                if !self.flushes.is_empty() {
                    fx.wait = self.call_flushes(reader, ids.iter().copied(), now.instant);
                }
            }
            Event::ReclaimsDone { done } => {
                let muts: Vec<_> = done
                    .iter()
                    .flat_map(|r| self.engine.finish_reclaim(r))
                    .collect();
                self.journal_change(0, &muts, now);
            }
            Event::QueueCleanup(work) => {
                self.cleanup.push_back(work);
                self.out.wake_cleanup = true;
            }
            Event::TxnRecord { changes, encode } => {
                fx.record = Some(self.txn_record(changes, encode, now));
            }
            Event::TxnAnswered { client, seq, kept } => self.replies.insert(client, seq, kept),
            Event::Table(change) => fx.table = Some(self.table_change(change, now)),
            Event::Data { client, change } => {
                fx.data = Some(self.data_change(client, change, now));
            }
        }
        fx.out = self.take_outbox();
        fx
    }

    /// Takes the records and callbacks made since the last take (the shell carries them
    /// out before letting the lock go).
    pub(crate) fn take_outbox(&mut self) -> Outbox {
        let first_lsn = self.next_lsn;
        let taken = std::mem::replace(
            &mut self.out,
            Outbox {
                first_lsn,
                ..Outbox::default()
            },
        );
        debug_assert_eq!(taken.first_lsn + taken.ends.len() as u64, first_lsn);
        taken
    }

    /// Takes back the buffers of an outbox carried out, for the next step's records (a
    /// batch's records are a few KiB: not worth an allocation each time).
    pub(crate) fn reuse_outbox(&mut self, spent: &mut Outbox) {
        if self.out.bytes.capacity() == 0 {
            spent.bytes.clear();
            self.out.bytes = std::mem::take(&mut spent.bytes);
        }
        if self.out.ends.capacity() == 0 {
            spent.ends.clear();
            self.out.ends = std::mem::take(&mut spent.ends);
        }
    }

    /// Journals one record: `muts` of `client`'s request `seq` (0: not cached), with its
    /// reply-cache floor and outcome. Returns its LSN: the journal gives the record the same
    /// one, for the shell appends the outbox in order under the lock.
    pub fn append(
        &mut self,
        client: u64,
        seq: u64,
        seq_floor: u64,
        outcome: Outcome,
        muts: &[Mutation],
    ) -> u64 {
        let entry = JournalEntryRef {
            client,
            seq,
            seq_floor,
            outcome,
            muts,
        };
        self.append_with(|buf| crate::core::encode_entry(buf, &entry))
    }

    /// Journals one record whose payload `encode` appends to the buffer it is given;
    /// returns its LSN (see [`Core::append`]).
    pub fn append_with(&mut self, encode: impl FnOnce(Vec<u8>) -> Vec<u8>) -> u64 {
        self.out.bytes = encode(std::mem::take(&mut self.out.bytes));
        self.out.ends.push(self.out.bytes.len());
        let lsn = self.next_lsn;
        self.next_lsn += 1;
        lsn
    }

    /// See [`Event::TxnRecord`].
    fn txn_record(
        &mut self,
        changes: &[kochab_cluster::txn::Mutation],
        encode: &EncodeTxnRecord<'_>,
        now: Now,
    ) -> TxnRecorded {
        let muts = match crate::txn_plan::apply_part(&self.engine, changes) {
            Ok(m) => m,
            Err(why) => return TxnRecorded::NotApplicable(why),
        };
        for m in &muts {
            if let Err(e) = self.engine.apply(m) {
                return TxnRecorded::Failed(format!(
                    "a committed transaction's mutation failed: {e}"
                ));
            }
        }
        let lsn = self.append_with(|buf| encode(buf, &muts));
        if !muts.is_empty() {
            self.journaled(0, &muts, lsn, now.durable, now.instant);
        }
        self.out.flush = true;
        TxnRecorded::Journaled(lsn)
    }

    /// Journals `muts` (if any) of `client` as one record, notes them (leases, what
    /// replies wait for) and asks for a flush now; returns its LSN or 0.
    pub fn journal_change(&mut self, client: u64, muts: &[Mutation], now: Now) -> u64 {
        if muts.is_empty() {
            return 0;
        }
        let lsn = self.append(client, 0, 0, None, muts);
        self.journaled(client, muts, lsn, now.durable, now.instant);
        self.out.flush = true;
        lsn
    }

    /// Asks the shell to start a journal flush once the lock is let go.
    pub fn flush_soon(&mut self) {
        self.out.flush = true;
    }

    /// The LSN of the last record journaled (durable or not).
    pub fn last_lsn(&self) -> u64 {
        self.next_lsn - 1
    }

    /// Runs at most `CLEANUP_ITEMS_PER_RECORD` items of queued cleanup and journals
    /// their mutations as one record. True if more is queued.
    pub(crate) fn cleanup_batch(&mut self, now: Now) -> bool {
        let mut muts = Vec::new();
        let mut left = crate::core::CLEANUP_ITEMS_PER_RECORD;
        while left > 0 {
            let Some(work) = self.cleanup.front_mut() else {
                break;
            };
            let taken = left;
            match work {
                Cleanup::Closes(handles) => {
                    for of in handles.by_ref().take(taken) {
                        muts.extend(self.engine.close_ref(of.id));
                        left -= 1;
                    }
                }
                Cleanup::Orphans(ids) => {
                    for id in ids.by_ref().take(taken) {
                        muts.extend(self.engine.drop_if_orphan(id));
                        left -= 1;
                    }
                }
                Cleanup::ArrivedCloses(ids) => {
                    for id in ids.by_ref().take(taken) {
                        muts.extend(self.engine.close_ref(id));
                        left -= 1;
                    }
                }
            }
            if left > 0 {
                // This item ran dry before the batch was full.
                self.cleanup.pop_front();
            }
        }
        self.journal_change(0, &muts, now);
        !self.cleanup.is_empty()
    }

    /// One pass per request: flushes it must wait for, admission, the engine, the journal,
    /// leases and callbacks, and the LSN its reply waits for.
    fn requests(
        &mut self,
        client: u64,
        reqs: &[(u64, Request)],
        flushes: bool,
        now: Now,
        env: &dyn Env,
        fx: &mut Effects,
    ) {
        // One allocation per batch, not one per doubling.
        fx.answers.reserve(reqs.len());
        let member = env.member();
        let leasing = self.is_leasing(client);
        let granted = now.instant;
        let mut depended = false;
        for (rid, req) in reqs {
            self.take_depended();
            // Files another session may hold writes of: they are sent first (an open of
            // an existing name by create too: it may truncate, and shows the size).
            if flushes && !self.flushes.is_empty() {
                let existing = match &req.op {
                    Op::Create { parent, name, .. } => self.engine.child(*parent, name),
                    _ => None,
                };
                let ids = req.op.inode_ids().into_iter().flatten().chain(existing);
                let wait = self.call_flushes(client, ids, granted);
                if !wait.is_empty() {
                    fx.parked.push((*rid, Parked::Flush(wait)));
                    continue;
                }
            }
            // A member runs only what its participant admits (see `cluster_host`).
            let admitted: Vec<TableId> = match member {
                Some(host) => match host.admit_op(self, client, &req.op) {
                    Ok(tables) => tables,
                    Err(Refusal::Reply(reply)) => {
                        fx.answers.push(Answer::now(*rid, *reply));
                        continue;
                    }
                    Err(Refusal::Borrow(tables)) => {
                        fx.parked.push((*rid, Parked::Borrow(tables)));
                        continue;
                    }
                },
                None => Vec::new(),
            };
            let before = self.last_lsn();
            let global = matches!(
                req.op,
                Op::Status | Op::StatFs | Op::Fsck | Op::FsckLinks { .. } | Op::FsckInodes { .. }
            );
            // Only a replay whose tag verified gets here in this mode (the connection
            // refuses the others, see `replaytags::SessionTags`).
            self.engine.want_id = match req.mode {
                ReplyMode::Replay { want_id, .. }
                    if want_id != 0 && !self.breaks.has(Break::WantId) =>
                {
                    Some(want_id)
                }
                _ => None,
            };
            let reply = match req.op {
                Op::Status => Reply::Status(env.status(self)),
                Op::StatFs => self.statfs(req, now, env),
                Op::Open { .. }
                | Op::Create { .. }
                | Op::Close { .. }
                | Op::CloseMany { .. }
                | Op::GetLk { .. }
                | Op::SetLk { .. }
                | Op::ReleaseLocks { .. }
                | Op::EndSession => self.session_op(client, req, now),
                _ => self.execute_one(client, req, now),
            };
            self.engine.want_id = None;
            let after = self.last_lsn();
            // An operation that journaled waits for its record; every reply waits for what
            // it observed; whole-server answers wait for everything.
            let own = if after > before || global { after } else { 0 };
            let reply = match member {
                Some(host) => match host.fix_reply(&mut self.engine, &admitted, reply) {
                    Ok(reply) => reply,
                    Err(refusal) => {
                        // It changed nothing (a failed operation emits no mutation).
                        host.op_done(admitted, 0, 0);
                        match refusal {
                            Refusal::Borrow(tables) => {
                                fx.parked.push((*rid, Parked::Borrow(tables)))
                            }
                            Refusal::Reply(reply) => fx.answers.push(Answer::now(*rid, *reply)),
                        }
                        continue;
                    }
                },
                None => reply,
            };
            // Attributes of a file another session may hold writes of, which only the
            // reply named (a lookup, a listing): asked again after the flush. A change
            // cannot be undone: the writer is called back, and the reply goes as it is.
            if flushes && !self.flushes.is_empty() {
                let mut ids = Vec::new();
                crate::core::shown_ids(&reply, &mut ids);
                let wait = self.call_flushes(client, ids, granted);
                if !wait.is_empty() && after == before {
                    if let Some(host) = member {
                        host.op_done(admitted, 0, 0);
                    }
                    fx.parked.push((*rid, Parked::Flush(wait)));
                    continue;
                }
            }
            let needed = match self.breaks.has(Break::ReplyBeforeDurable) {
                false => own.max(self.needed_lsn(&req.op, &reply)),
                true => 0,
            };
            if let Some(host) = member {
                host.op_done(admitted, needed, now.durable);
            }
            let reply = if after > before {
                with_changed_dirs(&self.engine, &req.op, reply)
            } else {
                reply
            };
            if leasing {
                self.grant_leases(client, &req.op, &reply, granted);
            }
            let early_after = match self.breaks.has(Break::DependentEarly) {
                false => self.take_depended(),
                true => 0,
            };
            depended |= early_after != 0;
            fx.answers.push(Answer {
                rid: *rid,
                reply,
                lsn: needed,
                early_after,
            });
        }
        self.prune_modified(MODIFIED_PRUNE_AT, now.durable);
        // Early replies do not wait for the journal: their records go with the next flush
        // (within `LAZY_FLUSH`); anything else in the batch waits for one now (a change
        // that depended on another session's too: it is not answered early).
        if depended || reqs.iter().any(|(_, r)| r.mode != ReplyMode::Early) {
            self.out.flush = true;
        }
    }

    /// Runs one engine operation with the reply cache and the journal; its mutations stay
    /// readable in `last_mutations()` until the next one.
    pub(crate) fn execute_one(&mut self, client: u64, req: &Request, now: Now) -> Reply {
        let cached = req.seq != 0 && req.op.needs_reply_cache();
        if req.seq_floor != 0 {
            self.replies.acknowledge(client, req.seq_floor);
        }
        if cached
            && !self.breaks.has(Break::ReplyCache)
            && let Some(outcome) = self.replies.get(client, req.seq)
        {
            self.scratch.clear();
            let replay = matches!(req.mode, ReplyMode::Replay { .. });
            return retry_reply(&mut self.engine, &req.op, outcome, replay);
        }
        let mut muts = std::mem::take(&mut self.scratch);
        muts.clear();
        let reply = self.engine.execute(&req.cred, &req.op, now.wall, &mut muts);
        // A change that succeeded without changing anything (a rename between two names of
        // one inode) is journaled too, as a record without mutations: its reply-cache
        // entry must outlive a crash as any other's, or a replay of its early reply would
        // run it again on a namespace that later changes moved on.
        // (Only a success: an error or WRONG_SERVER ran nothing, and a member reruns the
        // latter once it borrowed the tables, which a cached outcome would answer instead.)
        let noop_change =
            cached && muts.is_empty() && matches!(reply, Reply::Empty | Reply::Entry(_));
        if !muts.is_empty() || noop_change {
            let outcome = outcome_of(&reply);
            let seq = if cached { req.seq } else { 0 };
            let lsn = self.append(client, seq, req.seq_floor, outcome, &muts);
            self.journaled(client, &muts, lsn, now.durable, now.instant);
            if noop_change
                && let Op::Rename {
                    parent,
                    name,
                    new_parent,
                    new_name,
                    ..
                } = &req.op
            {
                let found = [
                    (*parent, name.as_slice()),
                    (*new_parent, new_name.as_slice()),
                ];
                self.note_found(client, &found, lsn, now.durable);
            }
            if cached {
                self.replies.insert(client, req.seq, outcome);
            }
        }
        self.scratch = muts;
        reply
    }

    fn statfs(&mut self, req: &Request, now: Now, env: &dyn Env) -> Reply {
        let reply = self
            .engine
            .execute(&req.cred, &req.op, now.wall, &mut self.scratch);
        // File data's store, the cluster's (on S3, a large fixed figure: see
        // `kochab_s3store::REPORTED_CAPACITY`).
        match (reply, env.capacity()) {
            (Reply::StatFs(mut s), Ok(c)) => {
                let bs = s.bsize as u64;
                s.blocks = c.total_bytes / bs;
                s.bfree = c.free_bytes / bs;
                s.bavail = c.free_bytes / bs;
                Reply::StatFs(s)
            }
            (Reply::StatFs(_), Err(e)) => {
                Reply::Error(fs_err!(EIO, "cannot read store capacity: {e}"))
            }
            (other, _) => other,
        }
    }
}

/// The inode an operation's reply names, remembered for retries.
fn outcome_of(reply: &Reply) -> Outcome {
    match reply {
        Reply::Entry(a) => Some(a.id),
        _ => None,
    }
}

/// Adds to a namespace change's reply the attributes of the directories it changed (those
/// hosted here); their changes are in this operation's record, which the reply waits for.
fn with_changed_dirs(engine: &Engine, op: &Op, reply: Reply) -> Reply {
    if matches!(reply, Reply::Error(_) | Reply::WrongServer { .. }) {
        return reply;
    }
    let dirs: Vec<Attr> = op
        .changed_dirs()
        .into_iter()
        .flatten()
        .filter_map(|d| engine.inode(d).map(|i| i.attr(d)))
        .filter(|a| a.kind() == Some(FileKind::Dir))
        .collect();
    if dirs.is_empty() {
        return reply;
    }
    Reply::WithDirs {
        reply: Box::new(reply),
        dirs,
    }
}

/// The answer to a retry of an operation that already ran. A create's inode may be gone
/// since (the client removed it): a plain retry (its first reply was lost) is told so
/// (ESTALE); a replay of an early reply is told it is done, for it is (its record is in
/// the journal) and its client acted on the first reply long ago. At a member that does
/// not hold the inode's table (the first attempt borrowed it) the answer is WRONG_SERVER,
/// as for any operation: the member borrows the table and answers then.
fn retry_reply(engine: &mut Engine, op: &Op, outcome: Outcome, replay: bool) -> Reply {
    match (op, outcome) {
        (Op::Mknod { .. } | Op::Mkdir { .. } | Op::Symlink { .. } | Op::Link { .. }, Some(id)) => {
            match engine.attr_for_retry(id) {
                Ok(Some(attr)) => Reply::Entry(attr),
                Err(wrong_server) => *wrong_server,
                Ok(None) if replay => Reply::Empty,
                Ok(None) => Reply::Error(fs_err!(
                    ESTALE,
                    "created by the first attempt, removed before this retry"
                )),
            }
        }
        _ => Reply::Empty,
    }
}

#[cfg(test)]
mod tests {
    //! The step driven alone: no runtime, journal, store or clock, only events in and
    //! effects out.
    use super::*;
    use crate::core::JournalEntry;
    use crate::replycache::ReplyCache;
    use kochab_meta::EngineConfig;
    use std::time::Instant;

    struct NoEnv;

    impl Env for NoEnv {
        fn member(&self) -> Option<&dyn Member> {
            None
        }
        fn status(&self, _: &Core) -> StatusReport {
            unreachable!("no status asked")
        }
        fn capacity(&self) -> std::io::Result<kochab_store::Capacity> {
            Err(std::io::Error::other("no store"))
        }
    }

    fn core() -> Core {
        let mut e = Engine::new_cluster(EngineConfig::with_key([5, 6])).unwrap();
        for m in e.bootstrap(1) {
            e.apply(&m).unwrap();
        }
        let mut c = Core::new(e, ReplyCache::default());
        c.number_records_from(10);
        c
    }

    fn at(instant: Instant, durable: u64) -> Now {
        Now {
            wall: 1_000,
            instant,
            durable,
        }
    }

    fn mkdir(parent: InodeId, name: &str) -> Request {
        Request::plain(
            &Credentials::root(),
            Op::Mkdir {
                parent,
                name: name.as_bytes().to_vec(),
                mode: 0o755,
            },
        )
    }

    #[test]
    fn a_change_comes_out_as_a_numbered_record_and_a_reply_that_waits_for_it() {
        let mut c = core();
        let root = c.engine.root();
        let t0 = Instant::now();
        let reqs = [(1, mkdir(root, "a")), (2, mkdir(root, "b"))];
        let fx = c.step(
            Event::Requests {
                client: 7,
                reqs: &reqs,
                flushes: true,
                answers: Vec::new(),
            },
            at(t0, 9),
            &NoEnv,
        );
        let records: Vec<(u64, JournalEntry)> = fx
            .out
            .records()
            .map(|(lsn, p)| (lsn, postcard::from_bytes(p).unwrap()))
            .collect();
        assert_eq!(records.iter().map(|r| r.0).collect::<Vec<_>>(), [10, 11]);
        assert!(
            records
                .iter()
                .all(|(_, e)| e.client == 7 && !e.muts.is_empty())
        );
        // Each reply waits for its own record; a durable request asks for a flush now.
        assert_eq!(
            fx.answers.iter().map(|a| a.lsn).collect::<Vec<_>>(),
            [10, 11]
        );
        assert!(fx.out.flush);
        assert!(fx.parked.is_empty());
        // A read journals nothing and waits for what it observed: the root, last changed
        // by the second.
        let lookup = Request::plain(
            &Credentials::root(),
            Op::Lookup {
                parent: root,
                name: b"a".to_vec(),
            },
        );
        let fx = c.step(
            Event::Requests {
                client: 8,
                reqs: &[(3, lookup)],
                flushes: true,
                answers: Vec::new(),
            },
            at(t0, 9),
            &NoEnv,
        );
        assert_eq!(fx.out.records().count(), 0);
        assert_eq!(fx.answers[0].lsn, 11);
        assert_eq!(c.last_lsn(), 11);
    }

    #[test]
    fn a_change_to_what_another_session_leased_comes_out_as_a_callback() {
        let mut c = core();
        let root = c.engine.root();
        let t0 = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        c.attach(1, 1, Some(tx));
        let lookup = Request::plain(
            &Credentials::root(),
            Op::Lookup {
                parent: root,
                name: b"x".to_vec(),
            },
        );
        // Session 1 caches the absence of "x" (a lease on the root's names).
        let fx = c.step(
            Event::Requests {
                client: 1,
                reqs: &[(1, lookup)],
                flushes: true,
                answers: Vec::new(),
            },
            at(t0, 0),
            &NoEnv,
        );
        assert!(fx.out.callbacks.is_empty());
        // Session 2 makes "x": session 1 is called back, through the outbox only.
        let fx = c.step(
            Event::Requests {
                client: 2,
                reqs: &[(2, mkdir(root, "x"))],
                flushes: true,
                answers: Vec::new(),
            },
            at(t0, 0),
            &NoEnv,
        );
        assert_eq!(fx.out.callbacks.len(), 1);
        assert!(rx.try_recv().is_err(), "the core sent nothing itself");
        // Unanswered, it runs out a lease later: the holder goes into default.
        let later = t0 + crate::leases::LEASE + Duration::from_secs(1);
        let fx = c.step(Event::ExpireCallbacks, at(later, 0), &NoEnv);
        assert_eq!(fx.expired.missed, 1);
        assert_eq!(fx.expired.defaulted, [1]);
    }
}
