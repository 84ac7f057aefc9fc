//! The serving core: the engine and the reply cache behind one lock, and the journal.
//!
//! A batch of requests from one connection runs under one lock acquisition; each
//! operation that changed something appends one journal record while the lock is held, so
//! journal order is execution order. Replies wait until the journal is durable up to the
//! last LSN the batch could have observed: nothing a client sees can be lost in a crash.

use crate::leases::{Answered, Callbacks, Expired, Flushes, LeaseKey, Leases, Leasing, Urgency};
use crate::locks::LockTable;
use crate::outbox::{CallbackTx, Outbox};
use crate::replycache::{Outcome, ReplyCache};
use crate::session::{EndedHandles, Sessions};
use crate::unsettled::Unsettled;
use kochab_breaks::Breaks;
use kochab_journal::Journal;
use kochab_meta::{Engine, Mutation};
use kochab_proto::cluster::TableId;
use kochab_proto::frame::encode_frame;
use kochab_proto::*;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// The payload of one journal record: one operation's mutations plus what the reply cache
/// needs to answer a retry of it after a crash.
#[derive(Serialize)]
pub struct JournalEntryRef<'a> {
    pub client: u64,
    pub seq: u64,
    pub seq_floor: u64,
    pub outcome: Outcome,
    pub muts: &'a [Mutation],
}

/// Owned form of [`JournalEntryRef`], as read back.
#[derive(Deserialize)]
pub struct JournalEntry {
    pub client: u64,
    pub seq: u64,
    pub seq_floor: u64,
    pub outcome: Outcome,
    pub muts: Vec<Mutation>,
}

/// Items of internal cleanup done per journal record and per hold of the core lock. Each
/// item emits at most two small mutations (`DropInode` and a `PutReclaim`, under 64 bytes
/// encoded), so a batch's record stays under 64 KiB, far below the journal's record limit
/// in any segment size the server accepts; and a batch holds the lock for about a
/// millisecond, so other clients are served between batches. (One record for a whole
/// session of 500,000 open-unlinked files would be ~20 MiB: over the limit.)
pub const CLEANUP_ITEMS_PER_RECORD: usize = 1024;

/// Internal work that may cover any number of inodes, done [`CLEANUP_ITEMS_PER_RECORD`]
/// items at a time. Each batch is one record, atomic for what it covers; a crash between
/// batches leaves unnamed inodes that the next start removes as orphans.
pub enum Cleanup {
    /// The handles of an ended session (still counted as open until closed here).
    Closes(EndedHandles),
    /// Inodes that had no name at start-up: removed unless a client reopened them.
    Orphans(std::vec::IntoIter<InodeId>),
    /// Handles of an ended session that came here with their file's table.
    ArrivedCloses(std::vec::IntoIter<InodeId>),
}

/// An open handle that travels with its file's table: (client, handle, inode).
pub type MovedHandle = (u64, u64, InodeId);

/// The reply to request `rid` of a batch, and when it may leave.
#[derive(Debug)]
pub struct Answer {
    pub rid: u64,
    pub reply: Reply,
    /// The LSN that must be durable before the reply is final (0: now).
    pub lsn: u64,
    /// A request that asked for an early reply may have it before `lsn` is durable only
    /// once this is: the record of another session's change that it depended on (0: none;
    /// see `unsettled`). Until then it waits for `lsn`, as any reply.
    pub early_after: u64,
}

impl Answer {
    /// A reply that may leave at once.
    pub fn now(rid: u64, reply: Reply) -> Answer {
        Answer {
            rid,
            reply,
            lsn: 0,
            early_after: 0,
        }
    }

    /// True if it may leave now as an early reply, the journal durable up to `durable`.
    pub fn early_by(&self, durable: u64) -> bool {
        self.early_after <= durable
    }
}

/// What the lock protects.
pub struct Core {
    pub engine: Engine,
    pub(crate) replies: ReplyCache,
    pub sessions: Sessions,
    pub(crate) locks: LockTable,
    /// Handles opened at another server whose file's table came here with them (client,
    /// handle -> inode): each is counted open here, and its close here ends that.
    pub(crate) arrived: FxHashMap<(u64, u64), InodeId>,
    /// LSN of the last journal record that changed each inode (or its entries), for inodes
    /// changed since about the last durable point: a reply must wait only until what it
    /// observed is durable, not for unrelated operations in flight.
    modified: FxHashMap<InodeId, u64>,
    /// Which session made each change not yet durable: a change that depended on another
    /// session's is not answered early (see `unsettled`).
    unsettled: Unsettled,
    /// The latest record of another session, not durable when noted, that the changes
    /// journaled since the last [`Core::take_depended`] depended on (0: none).
    depended: u64,
    /// Cleanup still to do, oldest first (see [`Shared::cleanup_batch`]).
    pub(crate) cleanup: VecDeque<Cleanup>,
    /// What sessions that asked for leases may cache (see `leases`).
    pub(crate) leases: Leases,
    /// Callbacks in flight, and the replies that wait for them.
    pub callbacks: Callbacks,
    /// Where to send a session's callbacks: its connections that asked for leases
    /// (connection number, frames for its writer).
    lease_conns: FxHashMap<u64, Vec<(u64, CallbackTx)>>,
    /// The last append through each handle (client, handle -> its seq and reply): a retry
    /// of it is answered from here, not appended twice. Soft, as the sessions are.
    pub(crate) appended: FxHashMap<(u64, u64), (u64, kochab_proto::Attr)>,
    /// Writers that may hold writes back, and their flush callbacks (see `leases`).
    pub(crate) flushes: Flushes,
    /// The mutations of the last operation run (see [`Core::last_mutations`]).
    pub(crate) scratch: Vec<Mutation>,
    /// The LSN the next record gets: the core numbers its records, and the shell appends
    /// them in that order under the lock (see `step`).
    pub(crate) next_lsn: u64,
    /// Records and callbacks not yet carried out.
    pub(crate) out: Outbox,
    /// Deliberate bugs switched on (only a simulation sets any, see `kochab_breaks`).
    pub(crate) breaks: Breaks,
}

/// Entries of `Core::modified` before it is pruned to the records not yet durable.
pub(crate) const MODIFIED_PRUNE_AT: usize = 1 << 16;

/// Notes that `muts` were journaled at `lsn`.
pub fn note_modified(modified: &mut FxHashMap<InodeId, u64>, muts: &[Mutation], lsn: u64) {
    for m in muts {
        modified.insert(m.table_key(), lsn);
    }
}

impl Core {
    /// The inodes an operation touches: by id, through a handle of this client, and those
    /// the engine's plan adds (the entries it removes, the ancestors a directory move
    /// checks). The first is the one the client routed by. A member's admission maps them
    /// to tables.
    pub fn op_ids(&self, client: u64, op: &Op) -> Vec<InodeId> {
        let mut ids: Vec<InodeId> = op.inode_ids().into_iter().flatten().collect();
        if let Some(h) = op.handle()
            && let Some(of) = self.sessions.get(client, h)
        {
            ids.push(of.id);
        }
        if let Op::CloseMany { handles } = op {
            // A longer one is refused when it runs; looking beyond the bound costs for nothing.
            ids.extend(
                handles
                    .iter()
                    .take(CLOSE_MANY_HANDLES_MAX + 1)
                    .filter_map(|&h| Some(self.sessions.get(client, h)?.id)),
            );
        }
        ids.extend(self.engine.plan(op));
        ids
    }

    /// The open handles on inodes in `lo..hi`, taken out for a table leaving this server:
    /// this server's own handles and those that arrived with the table earlier, each once,
    /// and the open counts no handle here accounts for (they came with the table from a
    /// server before, as counts).
    pub fn take_open_handles(
        &mut self,
        lo: InodeId,
        hi: InodeId,
    ) -> (Vec<MovedHandle>, Vec<(InodeId, u32)>) {
        let counts = self.engine.take_open_counts(lo, hi);
        self.flushes.forget(None, Some((lo, hi)));
        let mut handles = self.sessions.take_range(lo, hi);
        let mut arrived = Vec::new();
        self.arrived.retain(|&(c, h), id| {
            let inside = (lo..hi).contains(id);
            if inside {
                arrived.push((c, h, *id));
            }
            !inside
        });
        for a in arrived {
            if !handles.iter().any(|&(c, h, _)| (c, h) == (a.0, a.1)) {
                handles.push(a);
            }
        }
        let mut per_id: FxHashMap<InodeId, u32> = FxHashMap::default();
        for &(_, _, id) in &handles {
            *per_id.entry(id).or_default() += 1;
        }
        let rest = counts
            .into_iter()
            .filter_map(|(id, n)| {
                let left = n.saturating_sub(per_id.get(&id).copied().unwrap_or(0));
                (left > 0).then_some((id, left))
            })
            .collect();
        (handles, rest)
    }

    /// Counts the handles that came with a table (see [`Core::take_open_handles`]).
    pub fn add_arrived_handles(&mut self, handles: &[MovedHandle]) {
        for &(c, h, id) in handles {
            if self.arrived.insert((c, h), id).is_none() {
                self.engine.add_open_counts(&[(id, 1)]);
                // Its access mode did not come with it: counted as a writer (at worst
                // a flush callback with nothing to send).
                self.flushes.opened(id, c);
            }
        }
    }

    pub fn new(engine: Engine, replies: ReplyCache) -> Core {
        Core {
            engine,
            replies,
            sessions: Sessions::default(),
            locks: LockTable::default(),
            arrived: FxHashMap::default(),
            modified: FxHashMap::default(),
            unsettled: Unsettled::default(),
            depended: 0,
            cleanup: VecDeque::new(),
            leases: Leases::default(),
            callbacks: Callbacks::default(),
            lease_conns: FxHashMap::default(),
            appended: FxHashMap::default(),
            flushes: Flushes::default(),
            scratch: Vec::with_capacity(16),
            next_lsn: 1,
            out: Outbox::default(),
            breaks: Breaks::NONE,
        }
    }

    /// Switches on deliberate bugs (a simulation's), here and in the lease bookkeeping.
    pub fn set_breaks(&mut self, breaks: Breaks) {
        self.breaks = breaks;
        self.callbacks.breaks = breaks;
        self.leases.breaks = breaks;
    }

    /// The next record journaled gets `lsn` (the journal's next).
    pub(crate) fn number_records_from(&mut self, lsn: u64) {
        debug_assert!(self.out.ends.is_empty());
        self.next_lsn = lsn;
        self.out.first_lsn = lsn;
    }

    /// True if `session` asked for leases on some connection.
    pub(crate) fn is_leasing(&self, session: u64) -> bool {
        self.lease_conns.contains_key(&session)
    }

    /// Forgets which inodes changed at records now durable, once there are `at` of them.
    pub(crate) fn prune_modified(&mut self, at: usize, durable: u64) {
        if self.modified.len() > at {
            self.modified.retain(|_, lsn| *lsn > durable);
        }
    }

    /// Notes the names a change found, for what its early reply depends on (see
    /// `unsettled`).
    pub(crate) fn note_found(
        &mut self,
        client: u64,
        found: &[(InodeId, &[u8])],
        lsn: u64,
        durable: u64,
    ) {
        let depended = self.unsettled.note_found(client, found, lsn, durable);
        self.depended = self.depended.max(depended);
    }

    /// The LSN a reply about `id` must wait for (0 if nothing about it is pending).
    pub fn observed(&self, id: InodeId) -> u64 {
        self.modified.get(&id).copied().unwrap_or(0)
    }

    /// The LSN that must be durable before `reply` to `req` can be sent.
    pub(crate) fn needed_lsn(&self, op: &Op, reply: &Reply) -> u64 {
        let mut lsn = op
            .inode_ids()
            .into_iter()
            .flatten()
            .map(|id| self.observed(id))
            .max()
            .unwrap_or(0);
        match reply {
            Reply::Entry(a) | Reply::Attr(a) => lsn = lsn.max(self.observed(a.id)),
            Reply::Dir { entries, .. } => {
                for e in entries.iter().filter(|e| e.attr.is_some()) {
                    lsn = lsn.max(self.observed(e.id));
                }
            }
            _ => {}
        }
        lsn
    }

    /// The mutations of the last operation run through `execute_one`.
    pub fn last_mutations(&self) -> &[Mutation] {
        &self.scratch
    }

    /// Notes that `changer`'s mutations `muts` were journaled at `lsn` (the journal durable
    /// up to `durable`), and calls back every other session that holds a lease on what
    /// they change; the replies to `changer` wait for those callbacks (see
    /// `leases::Board`), at `now`. Returns the LSN of another session's record, not
    /// durable, that the change depended on (0: none): an early reply to it must wait for
    /// that record.
    pub fn journaled(
        &mut self,
        changer: u64,
        muts: &[Mutation],
        lsn: u64,
        durable: u64,
        now: Instant,
    ) -> u64 {
        note_modified(&mut self.modified, muts, lsn);
        let depended = self.unsettled.note(changer, muts, lsn, durable);
        self.depended = self.depended.max(depended);
        self.call_back_leases(changer, muts, now);
        depended
    }

    /// What [`Core::journaled`] noted as depended on since the last call.
    pub fn take_depended(&mut self) -> u64 {
        std::mem::take(&mut self.depended)
    }

    fn call_back_leases(&mut self, changer: u64, muts: &[Mutation], now: Instant) {
        if !self.flushes.is_empty() {
            self.end_promises(changer, muts, now);
        }
        if self.leases.keys() == 0 {
            return;
        }
        for (holder, list, until) in self.leases.changed(changer, muts, now) {
            self.call_back(changer, holder, &list, until, Urgency::Drop, now);
        }
    }

    /// A writer that promised to write a file through, whose change now calls back the
    /// leases granted under the promise (below, in `journaled`), may hold writes back
    /// again: told so by a `Hold` callback, sent on the connection its flush callbacks
    /// took (so a later flush callback reaches it after this one).
    fn end_promises(&mut self, changer: u64, muts: &[Mutation], now: Instant) {
        // `wrote` forgets the promise it ends: an inode put twice is told once.
        let mut ended = Vec::new();
        for m in muts {
            if let Mutation::PutInode { id, .. } = m
                && self.flushes.wrote(*id, changer)
            {
                ended.push(Invalidation::Hold { id: *id });
            }
        }
        if !ended.is_empty() {
            let until = now + crate::leases::LEASE;
            self.call_back(0, changer, &ended, until, Urgency::Work, now);
        }
    }

    /// Sends one callback to `holder` on one of its connections, to be waited for by
    /// `changer`'s replies until `until` (the holder's lease ends then anyway), sent at
    /// `now`. Returns
    /// its id, which is not pending if it could not be sent (the holder's connections are
    /// gone, and its leases with them); `None` if the holder is in default (nothing is
    /// sent to it).
    pub fn call_back(
        &mut self,
        changer: u64,
        holder: u64,
        list: &[Invalidation],
        until: Instant,
        urgency: Urgency,
        now: Instant,
    ) -> Option<u64> {
        let id = self.callbacks.issue(changer, holder, until, urgency, now)?;
        let mut frame = Vec::new();
        // To the first of its connections still open; the shell sends it (a connection
        // that closes meanwhile ends the holder's leases with it, see `detach`).
        let to = self
            .lease_conns
            .get(&holder)
            .and_then(|conns| conns.iter().find(|(_, tx)| !tx.is_closed()));
        match to {
            Some((_, tx)) if encode_frame(&mut frame, FrameKind::Callback, id, &list).is_ok() => {
                self.out.callbacks.push((tx.clone(), frame));
            }
            _ => self.callbacks.cancel(id),
        }
        Some(id)
    }

    /// Connection `conn_id` of `session` begins: its session counts it, and if it asked for
    /// leases its callbacks go out through `callbacks`. Returns the session's board (its
    /// replies wait there for the callbacks its changes caused).
    pub fn attach(
        &mut self,
        session: u64,
        conn_id: u64,
        callbacks: Option<CallbackTx>,
    ) -> Arc<crate::leases::Board> {
        self.sessions.connect(session);
        if let Some(tx) = callbacks {
            self.lease_conns
                .entry(session)
                .or_default()
                .push((conn_id, tx));
        }
        self.callbacks.board(session)
    }

    /// Connection `conn_id` of `session` ended (see [`Core::attach`]).
    pub fn detach(&mut self, session: u64, conn_id: u64, now: Instant) {
        self.sessions.disconnect(session, now);
        if let Some(conns) = self.lease_conns.get_mut(&session) {
            conns.retain(|(c, _)| *c != conn_id);
            if conns.is_empty() {
                // The client drops everything it cached when it loses its last connection.
                self.lease_conns.remove(&session);
                self.callbacks.holder_gone(session, &mut self.leases);
            }
        }
        if !self.sessions.connected(session) {
            // Its board goes with its last connection (unless callbacks it caused are out).
            self.callbacks.forget_changer(session);
        }
    }

    /// Session `from` answered the callbacks `ids`. Returns whether it went into default
    /// for a slow answer (see `leases::CALLBACK_SLOW`), and how many answers were ignored
    /// (not callbacks sent to `from`, or ones that had ended).
    pub fn callbacks_answered(&mut self, from: u64, ids: &[u64], now: Instant) -> (bool, usize) {
        let (mut slow, mut ignored) = (false, 0);
        for &id in ids {
            match self.callbacks.done(from, id, now, &mut self.leases) {
                Answered::Done => {}
                Answered::Ignored => ignored += 1,
                Answered::Slow => slow = true,
            }
        }
        (slow, ignored)
    }

    /// Ends the callbacks whose deadline passed (their holders go into default).
    pub fn expire_callbacks(&mut self, now: Instant) -> Expired {
        self.callbacks.expire(now, &mut self.leases)
    }

    /// The flush callbacks `reader` must wait for before it may see `ids` (see
    /// `leases::Flushes`): sends those still to send, and returns every one unanswered.
    /// Empty when no other session may hold writes of them back.
    pub fn call_flushes(
        &mut self,
        reader: u64,
        ids: impl IntoIterator<Item = InodeId>,
        now: Instant,
    ) -> Vec<u64> {
        let callbacks = &self.callbacks;
        let (call, mut wait) = self
            .flushes
            .wanted(reader, ids, now, |cb| callbacks.is_pending(cb));
        let mut writers: Vec<u64> = call.iter().map(|&(w, _)| w).collect();
        writers.sort_unstable();
        writers.dedup();
        for w in writers {
            let ids: Vec<InodeId> = call.iter().filter(|c| c.0 == w).map(|c| c.1).collect();
            let write_through_ms = crate::leases::WRITE_THROUGH.as_millis() as u64;
            let list: Vec<Invalidation> = ids
                .iter()
                .map(|&id| Invalidation::Flush {
                    id,
                    write_through_ms,
                })
                .collect();
            // Waited for by the reader's request alone, not by its other replies (changer
            // 0 is no session): a writer that never answers holds it up for a lease once,
            // and is then in default (asked for nothing, waited for by nobody).
            let until = now + crate::leases::LEASE;
            if let Some(cb) = self.call_back(0, w, &list, until, Urgency::Work, now) {
                self.flushes.called(w, &ids, cb, now);
                if self.callbacks.is_pending(cb) {
                    wait.push(cb);
                }
            }
        }
        wait
    }

    /// Grants `session` the leases a reply to `op` shows it (the caller checked that the
    /// session asked for leases). Made under the lock that ran the operation, so a change
    /// after it calls the session back.
    pub fn grant_leases(&mut self, session: u64, op: &Op, reply: &Reply, now: Instant) {
        match self.callbacks.leasing(session, now) {
            Leasing::Yes => {}
            // In default: nothing granted (the holder's cache is its own affair until it
            // answered and its penalty is over).
            Leasing::No => return,
            Leasing::Resume => {
                // It cached what replies showed it meanwhile, unleased, and missed
                // callbacks: it drops everything (and writes through, as after a lost
                // connection) before any reply that grants again. Answering it is owed
                // as any callback is.
                let all = [Invalidation::Everything];
                let until = now + crate::leases::LEASE;
                self.call_back(0, session, &all, until, Urgency::Work, now);
            }
        }
        let failed = matches!(reply, Reply::Error(_) | Reply::WrongServer { .. });
        let names = |l: &mut Leases, dir: InodeId| l.grant(session, LeaseKey::Names(dir), now);
        match op {
            // An absent name is cached too (a negative entry).
            Op::Lookup { parent, .. }
                if !failed || matches!(reply, Reply::Error(e) if e.errno == Errno::ENOENT) =>
            {
                names(&mut self.leases, *parent)
            }
            _ if failed => return,
            Op::Readdir { id, plus: true, .. } => names(&mut self.leases, *id),
            Op::Mkdir { parent, .. } => {
                names(&mut self.leases, *parent);
                // The new directory's names too, while it is still empty: the client then
                // knows all of them, and answers lookups of absent ones itself (its
                // `complete` directories). This server hosts the new directory (the engine
                // refuses a mkdir whose inodes are not hosted), so every change to its names
                // comes here until its table leaves, which calls the lease back.
                if let Some(a) = reply.entry() {
                    names(&mut self.leases, a.id);
                }
            }
            Op::Mknod { parent, .. }
            | Op::Symlink { parent, .. }
            | Op::Create { parent, .. }
            | Op::Unlink { parent, .. }
            | Op::Rmdir { parent, .. } => names(&mut self.leases, *parent),
            Op::Link { new_parent, .. } => names(&mut self.leases, *new_parent),
            Op::Rename {
                parent, new_parent, ..
            } => {
                names(&mut self.leases, *parent);
                names(&mut self.leases, *new_parent);
            }
            _ => {}
        }
        grant_shown(&mut self.leases, session, reply, now);
        if !self.flushes.is_empty() {
            let mut ids = Vec::new();
            shown_ids(reply, &mut ids);
            for id in ids {
                self.flushes.leased(id, session);
            }
        }
    }
}

/// Leases on every inode whose attributes `reply` shows.
fn grant_shown(leases: &mut Leases, session: u64, reply: &Reply, now: Instant) {
    let mut ids = Vec::new();
    shown_ids(reply, &mut ids);
    for id in ids {
        leases.grant(session, LeaseKey::Inode(id), now);
    }
}

/// The inodes whose attributes `reply` shows.
pub(crate) fn shown_ids(reply: &Reply, out: &mut Vec<InodeId>) {
    match reply {
        Reply::Entry(a) | Reply::Attr(a) => out.push(a.id),
        Reply::Dir { entries, .. } => {
            out.extend(entries.iter().filter(|e| e.attr.is_some()).map(|e| e.id));
        }
        Reply::WithDirs { reply, dirs } => {
            out.extend(dirs.iter().map(|d| d.id));
            shown_ids(reply, out);
        }
        _ => {}
    }
}

/// A request [`Shared::execute_batch`] did not run.
#[derive(Debug)]
pub enum Parked {
    /// It needs these tables, held by other servers (borrow them).
    Borrow(Vec<TableId>),
    /// It must wait until these flush callbacks are answered (then run it again).
    Flush(Vec<u64>),
}

/// Why an operation does not run now.
pub enum Refusal {
    /// Answer this.
    Reply(Box<Reply>),
    /// The first table is here, these others are not: borrow them all (the set, the first
    /// included, is what the operation needs), then run it.
    Borrow(Vec<TableId>),
}

/// A member's admission, as the batch sees it (`cluster_host::ClusterHost` is the one
/// there is): the core asks it before and after each operation and never names the
/// cluster host's type, so the host can use the core without the two importing each other.
pub trait Member: std::any::Any + Send + Sync {
    /// Admission of one operation (the caller holds the core lock). `Ok`: run it, then call
    /// [`Member::op_done`] with the tables returned; `Err`: answer or park instead.
    fn admit_op(&self, core: &Core, client: u64, op: &Op) -> Result<Vec<TableId>, Refusal>;
    /// Turns an engine's WRONG_SERVER found while the operation ran into a borrow of that
    /// table too (an admitted operation) or the name of its owner.
    fn fix_reply(
        &self,
        engine: &mut Engine,
        admitted: &[TableId],
        reply: Reply,
    ) -> Result<Reply, Refusal>;
    /// An admitted operation ran; its reply leaves once `lsn` is durable (`durable` is now).
    fn op_done(&self, tables: Vec<TableId>, lsn: u64, durable: u64);
    /// False once the member's lease is over: it acknowledges nothing more.
    fn can_ack(&self) -> bool;
    /// The coordinator replicas' addresses (for `kochab status`).
    fn coord_addrs(&self) -> Vec<String>;
    /// txn (issue 33) hook: the member's transaction host (a `txn_host::TxnHost`), if
    /// multi-server operations may run as transactions. Type-erased so that the core does
    /// not name the host, which uses the core (`Shared::txn_host` gives it its type).
    fn txn_host(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        None
    }
}

/// Encodes one record's payload at the end of `buf`.
pub(crate) fn encode_entry(buf: Vec<u8>, entry: &JournalEntryRef<'_>) -> Vec<u8> {
    match postcard::to_extend(entry, buf) {
        Ok(b) => b,
        // Serializing our own in-memory types into a Vec cannot fail; if it does the
        // journal would diverge from memory, so stop loudly.
        Err(e) => panic!("journal entry does not serialize: {e}"),
    }
}

/// Appends a record before the core exists (a new cluster's root); later ones leave
/// through the core's outbox (see `step`).
pub fn journal_before_core(journal: &Journal, muts: &[Mutation]) -> u64 {
    let entry = JournalEntryRef {
        client: 0,
        seq: 0,
        seq_floor: 0,
        outcome: None,
        muts,
    };
    journal.append_deferred(|buf| *buf = encode_entry(std::mem::take(buf), &entry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::EngineConfig;

    fn encoded(muts: &[Mutation]) -> usize {
        let entry = JournalEntryRef {
            client: u64::MAX,
            seq: u64::MAX,
            seq_floor: u64::MAX,
            outcome: Some(u64::MAX),
            muts,
        };
        postcard::to_allocvec(&entry).unwrap().len()
    }

    fn engine() -> Engine {
        let mut e = Engine::new_cluster(EngineConfig::with_key([3, 4])).unwrap();
        for m in e.bootstrap(1) {
            e.apply(&m).unwrap();
        }
        e
    }

    /// The room a record has in the smallest segment a server uses.
    fn segment_room() -> usize {
        (crate::server::SEGMENT_BYTES_MIN - kochab_journal::segment::SEGMENT_DATA_START) as usize
    }

    #[test]
    fn the_largest_client_record_fits_the_smallest_segment_twice() {
        // Client input is bounded where it enters (names: NAME_MAX, symlink targets:
        // SYMLINK_MAX, xattr values: XATTR_SIZE_MAX, a handful of inodes per operation), so
        // the journal's refusal of an oversized record can never be reached from a client.
        let mut e = engine();
        let root = e.root();
        let cred = Credentials::root();
        let mut out = Vec::new();
        let target = vec![b't'; SYMLINK_MAX];
        let name = vec![b'n'; NAME_MAX];
        let op = Op::Symlink {
            parent: root,
            name: name.clone(),
            target,
        };
        let Reply::Entry(link) = e.execute(&cred, &op, 1, &mut out) else {
            panic!("symlink");
        };
        assert!(encoded(&out) < 16 << 10);
        out.clear();
        let mut xname = b"trusted.".to_vec();
        xname.resize(XATTR_NAME_MAX, b'x');
        let op = Op::SetXattr {
            id: link.id,
            name: xname,
            value: vec![7; XATTR_SIZE_MAX],
            flags: 0,
        };
        assert_eq!(e.execute(&cred, &op, 2, &mut out), Reply::Empty);
        let setxattr = encoded(&out);
        assert!(setxattr > XATTR_SIZE_MAX);
        assert!(
            2 * setxattr <= segment_room(),
            "setxattr record of {setxattr} bytes"
        );
    }

    #[test]
    fn a_cleanup_batch_is_one_small_record() {
        let mut e = engine();
        let root = e.root();
        let cred = Credentials::root();
        let mut ids = Vec::new();
        for i in 0..CLEANUP_ITEMS_PER_RECORD {
            let mut out = Vec::new();
            let op = Op::Mknod {
                parent: root,
                name: format!("file-{i:08}").into_bytes(),
                mode: mode::S_IFREG | 0o644,
                rdev: 0,
                exclusive: true,
            };
            let Reply::Entry(a) = e.execute(&cred, &op, 1, &mut out) else {
                panic!("mknod");
            };
            e.mark_data(a.id).unwrap();
            e.open_ref(a.id);
            let op = Op::Unlink {
                parent: root,
                name: format!("file-{i:08}").into_bytes(),
            };
            e.execute(&cred, &op, 1, &mut out);
            ids.push(a.id);
        }
        let muts: Vec<Mutation> = ids.into_iter().flat_map(|id| e.close_ref(id)).collect();
        assert_eq!(
            muts.len(),
            2 * CLEANUP_ITEMS_PER_RECORD,
            "a drop and a reclaim each"
        );
        let bytes = encoded(&muts);
        assert!(bytes < 64 << 10, "a batch of {bytes} bytes");
        assert!(bytes <= segment_room());
    }
}
