//! The serving core: the engine and the reply cache behind one lock, and the journal.
//!
//! A batch of requests from one connection runs under one lock acquisition; each
//! operation that changed something appends one journal record while the lock is held, so
//! journal order is execution order. Replies wait until the journal is durable up to the
//! last LSN the batch could have observed: nothing a client sees can be lost in a crash.

use crate::clock::Clock;
use crate::data::DataStore;
use crate::leases::{Answered, Callbacks, Expired, Flushes, LeaseKey, Leases, Leasing, Urgency};
use crate::locks::LockTable;
use crate::metrics::Metrics;
use crate::replycache::{Outcome, ReplyCache};
use crate::session::{EndedHandles, Sessions};
use crate::unsettled::Unsettled;
use kochab_breaks::{Break, Breaks};
use kochab_journal::Journal;
use kochab_meta::{Engine, Mutation};
use kochab_proto::cluster::TableId;
use kochab_proto::frame::encode_frame;
use kochab_proto::*;
use kochab_store::ObjectStore;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    scratch: Vec<Mutation>,
}

/// Frames a connection's writer sends ahead of its replies (callbacks).
pub type CallbackTx = tokio::sync::mpsc::UnboundedSender<Vec<u8>>;

/// Entries of `Core::modified` before it is pruned to the records not yet durable.
const MODIFIED_PRUNE_AT: usize = 1 << 16;

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
        }
    }

    /// The LSN a reply about `id` must wait for (0 if nothing about it is pending).
    pub fn observed(&self, id: InodeId) -> u64 {
        self.modified.get(&id).copied().unwrap_or(0)
    }

    /// The LSN that must be durable before `reply` to `req` can be sent.
    fn needed_lsn(&self, op: &Op, reply: &Reply) -> u64 {
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
        let sent = encode_frame(&mut frame, FrameKind::Callback, id, &list).is_ok()
            && self
                .lease_conns
                .get(&holder)
                .is_some_and(|conns| conns.iter().any(|(_, tx)| tx.send(frame.clone()).is_ok()));
        if !sent {
            self.callbacks.cancel(id);
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
fn shown_ids(reply: &Reply, out: &mut Vec<InodeId>) {
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
}

/// Everything the connection tasks, the checkpointer and the admin paths share. Its fields
/// are private: each is reached through a method that says what it is for, and the core
/// lock is taken in one place, [`Shared::core`].
pub struct Shared {
    core: Mutex<Core>,
    /// The runtime the server was started on: operations that outlive one turn of a
    /// connection run there, not on a client's runtime that may serve the connection
    /// (see `kochab_local`) and end before they do.
    runtime: tokio::runtime::Handle,
    journal: Journal,
    store: Arc<dyn ObjectStore>,
    metrics: Arc<Metrics>,
    server_id: u64,
    durable_mode: bool,
    /// What `kochab status` says of the store (see `ServerConfig::store_description`).
    store_description: String,
    started: Instant,
    /// Connections open, from accept to close (see [`Shared::count_connection`]).
    connections: AtomicU64,
    /// Numbers connections (callbacks name the connection they go to).
    next_conn: AtomicU64,
    /// File data.
    data: Arc<DataStore>,
    /// Orders writes against truncation, per file (see `filelocks`).
    file_locks: crate::filelocks::FileLocks,
    /// How long a client may stay disconnected before its session ends.
    session_grace: std::time::Duration,
    /// Wakes the task that works through `Core::cleanup`.
    cleanup_wake: tokio::sync::Notify,
    /// The manifests of the hosted tables; held for a whole checkpoint round, and by a
    /// table's drop or add.
    checkpointer: Mutex<crate::manifest::Checkpointer>,
    /// Tables this member released lately, for a quick load when they come back.
    released: Mutex<crate::released::ReleasedTables>,
    /// The cluster key and the client keys, with their policies.
    keys: Arc<crate::keys::KeyStore>,
    /// Rate limit of the warnings about malformed frames (any peer can cause them).
    bad_frame_log: crate::loglimit::LogLimiter,
    /// The participant of a member under the coordinator; `None` for the single server of
    /// `kochab up`, which hosts every table and admits everything.
    cluster: Option<Arc<dyn Member>>,
    /// Random per process, sent in the welcome: a client that finds another after losing
    /// its connection replays what this process acknowledged early.
    incarnation: u64,
    /// Until when only replays are served (after a crash, see [`ReplayWindow`]).
    replay_window: ReplayWindow,
    /// Tags early replies and checks replays (the same at every server of the cluster).
    replay_key: kochab_proto::auth::ReplayKey,
    /// Grants, freed objects and compaction of file data as slice objects (`slicesvc`).
    slice_work: crate::slicework::SliceWork,
    /// Deliberate bugs switched on (only a simulation sets any, see `kochab_breaks`).
    breaks: Breaks,
    /// The clock of everything the core times (see `clock`).
    clock: Clock,
}

/// What a server's start chose for its [`Shared`] state; the rest (counters, clocks, the
/// incarnation) [`Shared::new`] makes itself.
pub(crate) struct SharedParts {
    pub core: Core,
    pub journal: Journal,
    pub store: Arc<dyn ObjectStore>,
    pub metrics: Arc<Metrics>,
    pub server_id: u64,
    pub durable_mode: bool,
    pub store_description: String,
    pub data: Arc<DataStore>,
    pub session_grace: std::time::Duration,
    pub checkpointer: crate::manifest::Checkpointer,
    pub keys: Arc<crate::keys::KeyStore>,
    pub cluster: Option<Arc<dyn Member>>,
    pub replay_key: kochab_proto::auth::ReplayKey,
    pub slice_work: crate::slicework::SliceWork,
    pub breaks: Breaks,
    pub clock: Clock,
}

impl Shared {
    /// The shared state of a server starting now, on the current runtime.
    pub(crate) fn new(parts: SharedParts) -> Shared {
        Shared {
            core: Mutex::new(parts.core),
            runtime: tokio::runtime::Handle::current(),
            journal: parts.journal,
            store: parts.store,
            metrics: parts.metrics,
            server_id: parts.server_id,
            durable_mode: parts.durable_mode,
            store_description: parts.store_description,
            started: Instant::now(),
            connections: AtomicU64::new(0),
            next_conn: AtomicU64::new(1),
            data: parts.data,
            file_locks: Default::default(),
            session_grace: parts.session_grace,
            cleanup_wake: tokio::sync::Notify::new(),
            checkpointer: Mutex::new(parts.checkpointer),
            released: Default::default(),
            keys: parts.keys,
            bad_frame_log: Default::default(),
            cluster: parts.cluster,
            incarnation: kochab_proto::auth::random_u64(),
            replay_window: ReplayWindow::new(parts.clock.clone()),
            replay_key: parts.replay_key,
            slice_work: parts.slice_work,
            breaks: parts.breaks,
            clock: parts.clock,
        }
    }

    /// Takes the core lock: the one place it is taken, so that it can be measured. Hold it
    /// briefly (no I/O, no await): every request of every connection waits for it.
    pub fn core(&self) -> parking_lot::MutexGuard<'_, Core> {
        self.core.lock()
    }

    /// The runtime the server was started on: spawn there what must outlive the turn of a
    /// connection that starts it.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// The journal every change is appended to.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The object store of the journal, the checkpoints and the manifests.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The Prometheus metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The number `kochab status` and the welcome name this server by.
    pub fn server_id(&self) -> u64 {
        self.server_id
    }

    /// File data.
    pub fn data(&self) -> &Arc<DataStore> {
        &self.data
    }

    /// The per-file locks that order writes against truncation.
    pub fn file_locks(&self) -> &crate::filelocks::FileLocks {
        &self.file_locks
    }

    /// How long a client may stay disconnected before its session ends.
    pub fn session_grace(&self) -> std::time::Duration {
        self.session_grace
    }

    /// Wakes the task that works through the cleanup queue.
    pub fn wake_cleanup(&self) {
        self.cleanup_wake.notify_one();
    }

    /// Waits until [`Shared::wake_cleanup`] is called.
    pub async fn cleanup_woken(&self) {
        self.cleanup_wake.notified().await;
    }

    /// The manifests of the hosted tables, locked (for a checkpoint round, or a table's
    /// drop or add).
    pub fn checkpointer(&self) -> parking_lot::MutexGuard<'_, crate::manifest::Checkpointer> {
        self.checkpointer.lock()
    }

    /// The tables this member released lately, locked.
    pub fn released(&self) -> parking_lot::MutexGuard<'_, crate::released::ReleasedTables> {
        self.released.lock()
    }

    /// The cluster key and the client keys.
    pub fn keys(&self) -> &Arc<crate::keys::KeyStore> {
        &self.keys
    }

    /// Whether a warning about a malformed frame may be logged now: `Some(n)` with the
    /// number suppressed since the last one, `None` while over the rate limit.
    pub fn may_log_bad_frame(&self) -> Option<u64> {
        self.bad_frame_log.allow(Instant::now())
    }

    /// The participant of a member under the coordinator (`None`: the single server).
    pub fn cluster(&self) -> Option<&Arc<dyn Member>> {
        self.cluster.as_ref()
    }

    /// Random per process, sent in the welcome (a client that finds another replays what
    /// it kept).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The window after a crash in which only replays run.
    pub fn replay_window(&self) -> &ReplayWindow {
        &self.replay_window
    }

    /// The key that tags early replies and checks replays.
    pub fn replay_key(&self) -> &kochab_proto::auth::ReplayKey {
        &self.replay_key
    }

    /// Grants, freed objects and compaction of file data as slice objects.
    pub fn slice_work(&self) -> &crate::slicework::SliceWork {
        &self.slice_work
    }

    /// The clock of everything the core times: leases, callbacks, sessions, the replay
    /// window, file times (the system's, but in a simulation).
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Whether the deliberate bug `b` is switched on (only ever in a simulation).
    pub(crate) fn has_break(&self, b: Break) -> bool {
        self.breaks.has(b)
    }

    /// Counts one more open connection, unless `max` are open already (then false).
    pub fn count_connection(&self, max: u64) -> bool {
        if self.connections.fetch_add(1, Ordering::Relaxed) >= max {
            self.connections.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Uncounts a connection [`Shared::count_connection`] counted.
    pub fn uncount_connection(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// The number of connections open.
    pub fn open_connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// A number for a new connection, never given before in this process.
    pub fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}

/// What the other files ask of the core with one hold of its lock. Each method does one
/// thing, so the files that take the lock themselves are those that must do several under
/// one hold (run operations, checkpoint, move tables).
impl Shared {
    /// The root directory's inode.
    pub fn root(&self) -> InodeId {
        self.core().engine.root()
    }

    /// The engine's configuration (a member started beside this server uses the same).
    pub fn engine_config(&self) -> kochab_meta::EngineConfig {
        self.core().engine.config().clone()
    }

    /// The tables hosted here, as (lo, hi) bounds of their id ranges.
    pub fn hosted_tables(&self) -> Vec<(u64, u64)> {
        let core = self.core();
        core.engine.tables().iter().map(|t| (t.lo, t.hi)).collect()
    }

    /// What the engine's invariant checker finds wrong (empty: nothing).
    pub fn check_invariants(&self) -> Vec<String> {
        self.core().engine.check_invariants()
    }

    /// The inode `name` in directory `dir` names, if any.
    pub fn lookup(&self, dir: InodeId, name: &[u8]) -> Option<InodeId> {
        self.core().engine.child(dir, name)
    }

    /// The size of file `id`, if it exists.
    pub fn file_size(&self, id: InodeId) -> Option<u64> {
        self.core().engine.inode(id).map(|i| i.size)
    }

    /// What the reply cache remembers of request `seq` of `session` (`None`: nothing).
    pub fn reply_cached(&self, session: u64, seq: u64) -> Option<Outcome> {
        self.core().replies.get(session, seq)
    }

    /// A connection of `session` begins (see [`Core::attach`]); returns the session's board.
    pub fn attach(
        &self,
        session: u64,
        conn_id: u64,
        callbacks: Option<CallbackTx>,
    ) -> Arc<crate::leases::Board> {
        self.core().attach(session, conn_id, callbacks)
    }

    /// A connection of `session` ended (see [`Core::detach`]).
    pub fn detach(&self, session: u64, conn_id: u64) {
        let now = self.clock.now();
        self.core().detach(session, conn_id, now);
    }

    /// Session `from` answered the callbacks `ids` (see [`Core::callbacks_answered`]).
    pub fn callbacks_answered(&self, from: u64, ids: &[u64]) -> (bool, usize) {
        let now = self.clock.now();
        self.core().callbacks_answered(from, ids, now)
    }

    /// The board where the replies of `changer` wait for the callbacks its changes caused.
    pub fn callback_board(&self, changer: u64) -> Arc<crate::leases::Board> {
        self.core().callbacks.board(changer)
    }

    /// When the next callback in flight runs out, if any is.
    pub fn next_callback_deadline(&self) -> Option<Instant> {
        self.core().callbacks.next_deadline()
    }

    /// Ends the callbacks whose deadline passed (their holders go into default).
    pub fn expire_callbacks(&self) -> Expired {
        let now = self.clock.now();
        self.core().expire_callbacks(now)
    }

    /// Up to `max` reclaim entries after `after` (id, generation), in order.
    pub fn pending_reclaims(&self, after: (InodeId, u64), max: usize) -> Vec<kochab_meta::Reclaim> {
        self.core().engine.pending_reclaims(after, max)
    }

    /// The reclaim entry of a file generation as it is now, and whether that generation
    /// is still live (then the entry is a trim, else the deletion of a removed file).
    pub fn reclaim_now(
        &self,
        id: InodeId,
        generation: u64,
    ) -> (Option<kochab_meta::Reclaim>, bool) {
        let core = self.core();
        let live = core
            .engine
            .inode(id)
            .is_some_and(|i| i.btime as u64 == generation);
        (core.engine.reclaim_of(id, generation), live)
    }

    /// Journals the reclaim entries `done` as finished (their deletions are durable), in
    /// one record.
    pub fn finish_reclaims(&self, done: &[kochab_meta::Reclaim]) {
        let mut core = self.core();
        let muts: Vec<_> = done
            .iter()
            .flat_map(|r| core.engine.finish_reclaim(r))
            .collect();
        self.journal_now(&mut core, 0, &muts);
    }

    /// Queues cleanup work and wakes the task that works through it.
    pub fn queue_cleanup(&self, work: Cleanup) {
        self.core().cleanup.push_back(work);
        self.wake_cleanup();
    }
}

/// How long a server recovered from a crash runs no change but replays: clients that hold
/// early replies the crash lost reconnect (their retries are at most 1.6 s apart) and
/// replay them before anyone else's new operation can take the names or ids they need.
/// As long as a lease, too: the crash forgot who caches what, so no change may become
/// visible before every lease the last incarnation granted ran out.
pub const REPLAY_WINDOW: std::time::Duration = crate::leases::LEASE;

/// The window after a crash in which only replayed changes run; other changes wait for its
/// end (reads do not). A replay is admitted only with a replay tag that verifies for its
/// session (see `replaytags::SessionTags`): setting the mode is not enough.
pub struct ReplayWindow {
    until: Mutex<Option<Instant>>,
    clock: Clock,
}

impl ReplayWindow {
    /// A closed window, timed by `clock`.
    pub fn new(clock: Clock) -> ReplayWindow {
        ReplayWindow {
            until: Mutex::new(None),
            clock,
        }
    }

    /// Opens (or extends) the window for [`REPLAY_WINDOW`] from now.
    pub fn open(&self) {
        let until = self.clock.now() + REPLAY_WINDOW;
        let mut w = self.until.lock();
        *w = Some(w.map_or(until, |u| u.max(until)));
    }

    /// Ends the window now: every client has replayed what it kept (a simulation, whose
    /// clients replay at once, says so; a served core waits the window out).
    pub fn close(&self) {
        *self.until.lock() = None;
    }

    /// How long until the window ends (zero when it is not open), on its clock: what a
    /// new change waits.
    pub fn left(&self) -> std::time::Duration {
        self.until().map_or(std::time::Duration::ZERO, |u| {
            u.saturating_duration_since(self.clock.now())
        })
    }

    /// The end of the window, while it is open.
    pub fn until(&self) -> Option<Instant> {
        let mut w = self.until.lock();
        match *w {
            Some(u) if u > self.clock.now() => Some(u),
            Some(_) => {
                *w = None;
                None
            }
            None => None,
        }
    }
}

/// Nanoseconds since the epoch from the system clock (for tools beside the core; the
/// core stamps files by [`Shared::clock`]).
pub fn now_ns() -> TimeNs {
    Clock::system().wall_ns()
}

/// Appends one engine result to the journal; the caller holds the core lock.
pub fn journal_entry(
    journal: &Journal,
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
    journal.append_deferred(|buf| {
        let taken = std::mem::take(buf);
        *buf = match postcard::to_extend(&entry, taken) {
            Ok(b) => b,
            // Serializing our own in-memory types into a Vec cannot fail; if it does the
            // journal would diverge from memory, so stop loudly.
            Err(e) => panic!("journal entry does not serialize: {e}"),
        };
    })
}

/// The inode an operation's reply names, remembered for retries.
fn outcome_of(reply: &Reply) -> Outcome {
    match reply {
        Reply::Entry(a) => Some(a.id),
        _ => None,
    }
}

impl Shared {
    /// Runs at most [`CLEANUP_ITEMS_PER_RECORD`] items of queued cleanup and journals their
    /// mutations as one record; the caller holds the core lock (and releases it before the
    /// next batch). True if more is queued.
    pub fn cleanup_batch(&self, core: &mut Core) -> bool {
        let mut muts = Vec::new();
        let mut left = CLEANUP_ITEMS_PER_RECORD;
        while left > 0 {
            let Some(work) = core.cleanup.front_mut() else {
                break;
            };
            let taken = left;
            match work {
                Cleanup::Closes(handles) => {
                    for of in handles.by_ref().take(taken) {
                        muts.extend(core.engine.close_ref(of.id));
                        left -= 1;
                    }
                }
                Cleanup::Orphans(ids) => {
                    for id in ids.by_ref().take(taken) {
                        muts.extend(core.engine.drop_if_orphan(id));
                        left -= 1;
                    }
                }
                Cleanup::ArrivedCloses(ids) => {
                    for id in ids.by_ref().take(taken) {
                        muts.extend(core.engine.close_ref(id));
                        left -= 1;
                    }
                }
            }
            if left > 0 {
                // This item ran dry before the batch was full.
                core.cleanup.pop_front();
            }
        }
        self.journal_now(core, 0, &muts);
        !core.cleanup.is_empty()
    }

    /// Works through the cleanup queue one batch per hold of the core lock, until it is
    /// empty.
    pub async fn run_cleanup(&self) {
        while self.cleanup_batch(&mut self.core()) {
            tokio::task::yield_now().await;
        }
    }

    /// Waits until `reader` may see `ids`: every other session that may hold writes of
    /// them back has sent them (or failed to answer within a lease).
    /// Once: a writer that did not answer within a lease is not asked again.
    pub async fn wait_flushes(&self, reader: u64, ids: &[InodeId]) {
        let wait = {
            let mut core = self.core();
            if core.flushes.is_empty() {
                return;
            }
            core.call_flushes(reader, ids.iter().copied(), self.clock.now())
        };
        if !wait.is_empty() {
            self.wait_answered(&wait).await;
        }
    }

    /// Waits until none of the callbacks `ids` is pending (answered, or run out).
    pub async fn wait_answered(&self, ids: &[u64]) {
        let started = Instant::now();
        self.wait_pending(ids).await;
        self.metrics
            .flush_wait_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    async fn wait_pending(&self, ids: &[u64]) {
        loop {
            let mut ended = {
                let core = self.core();
                if !ids.iter().any(|&id| core.callbacks.is_pending(id)) {
                    return;
                }
                core.callbacks.watch_ended()
            };
            if ended.changed().await.is_err() {
                return;
            }
        }
    }

    /// Runs a batch of requests of one client; returns each reply with the LSN that must
    /// be durable before it is sent. Some requests are returned instead of a reply
    /// ([`Parked`]): those that must wait for other sessions' flushes, and at a member
    /// those that need tables other servers hold (run them with
    /// [`crate::cluster_host::parked_op`]).
    pub fn execute_batch(
        &self,
        client: u64,
        reqs: &[(u64, Request)],
        replies: &mut Vec<Answer>,
    ) -> Vec<(u64, Parked)> {
        self.run_batch(client, reqs, replies, true)
    }

    /// [`Shared::execute_batch`] for a request that already waited for flushes once: it
    /// waits for none again (a writer that did not answer within a lease is not asked
    /// again and again; one that opened the file since wrote after this request began).
    pub fn execute_flushed(
        &self,
        client: u64,
        req: &(u64, Request),
        replies: &mut Vec<Answer>,
    ) -> Vec<(u64, Parked)> {
        self.run_batch(client, std::slice::from_ref(req), replies, false)
    }

    fn run_batch(
        &self,
        client: u64,
        reqs: &[(u64, Request)],
        replies: &mut Vec<Answer>,
        flushes: bool,
    ) -> Vec<(u64, Parked)> {
        let now = self.clock.wall_ns();
        let mut parked = Vec::new();
        let mut core = self.core();
        let leasing = core.lease_conns.contains_key(&client);
        let granted = self.clock.now();
        let mut depended = false;
        for (rid, req) in reqs {
            core.take_depended();
            // Files another session may hold writes of: they are sent first (an open of
            // an existing name by create too: it may truncate, and shows the size).
            if flushes && !core.flushes.is_empty() {
                let existing = match &req.op {
                    Op::Create { parent, name, .. } => core.engine.child(*parent, name),
                    _ => None,
                };
                let ids = req.op.inode_ids().into_iter().flatten().chain(existing);
                let wait = core.call_flushes(client, ids, granted);
                if !wait.is_empty() {
                    parked.push((*rid, Parked::Flush(wait)));
                    continue;
                }
            }
            // A member runs only what its participant admits (see `cluster_host`).
            let admitted = match &self.cluster {
                Some(host) => match host.admit_op(&core, client, &req.op) {
                    Ok(tables) => tables,
                    Err(Refusal::Reply(reply)) => {
                        replies.push(Answer::now(*rid, *reply));
                        continue;
                    }
                    Err(Refusal::Borrow(tables)) => {
                        parked.push((*rid, Parked::Borrow(tables)));
                        continue;
                    }
                },
                None => Vec::new(),
            };
            let before = self.journal.last_lsn();
            let global = matches!(
                req.op,
                Op::Status | Op::StatFs | Op::Fsck | Op::FsckLinks { .. } | Op::FsckInodes { .. }
            );
            // Only a replay whose tag verified gets here in this mode (the connection
            // refuses the others, see `replaytags::SessionTags`).
            core.engine.want_id = match req.mode {
                ReplyMode::Replay { want_id, .. }
                    if want_id != 0 && !self.breaks.has(Break::WantId) =>
                {
                    Some(want_id)
                }
                _ => None,
            };
            let reply = match req.op {
                Op::Status => Reply::Status(self.status(&core)),
                Op::StatFs => self.statfs(&mut core, req, now),
                Op::Open { .. }
                | Op::Create { .. }
                | Op::Close { .. }
                | Op::CloseMany { .. }
                | Op::GetLk { .. }
                | Op::SetLk { .. }
                | Op::ReleaseLocks { .. }
                | Op::EndSession => self.session_op(&mut core, client, req, now),
                _ => self.execute_one(&mut core, client, req, now),
            };
            core.engine.want_id = None;
            let after = self.journal.last_lsn();
            // An operation that journaled waits for its record; every reply waits for what
            // it observed; whole-server answers wait for everything.
            let own = if after > before || global { after } else { 0 };
            let reply = match &self.cluster {
                Some(host) => match host.fix_reply(&mut core.engine, &admitted, reply) {
                    Ok(reply) => reply,
                    Err(refusal) => {
                        // It changed nothing (a failed operation emits no mutation).
                        host.op_done(admitted, 0, 0);
                        match refusal {
                            Refusal::Borrow(tables) => parked.push((*rid, Parked::Borrow(tables))),
                            Refusal::Reply(reply) => replies.push(Answer::now(*rid, *reply)),
                        }
                        continue;
                    }
                },
                None => reply,
            };
            // Attributes of a file another session may hold writes of, which only the
            // reply named (a lookup, a listing): asked again after the flush. A change
            // cannot be undone: the writer is called back, and the reply goes as it is.
            if flushes && !core.flushes.is_empty() {
                let mut ids = Vec::new();
                shown_ids(&reply, &mut ids);
                let wait = core.call_flushes(client, ids, granted);
                if !wait.is_empty() && after == before {
                    if let Some(host) = &self.cluster {
                        host.op_done(admitted, 0, 0);
                    }
                    parked.push((*rid, Parked::Flush(wait)));
                    continue;
                }
            }
            let needed = match self.breaks.has(Break::ReplyBeforeDurable) {
                false => own.max(core.needed_lsn(&req.op, &reply)),
                true => 0,
            };
            if let Some(host) = &self.cluster {
                host.op_done(admitted, needed, self.journal.durable_lsn());
            }
            let reply = if after > before {
                with_changed_dirs(&core.engine, &req.op, reply)
            } else {
                reply
            };
            if leasing {
                core.grant_leases(client, &req.op, &reply, granted);
            }
            let early_after = match self.breaks.has(Break::DependentEarly) {
                false => core.take_depended(),
                true => 0,
            };
            depended |= early_after != 0;
            replies.push(Answer {
                rid: *rid,
                reply,
                lsn: needed,
                early_after,
            });
        }
        if core.modified.len() > MODIFIED_PRUNE_AT {
            let durable = self.journal.durable_lsn();
            core.modified.retain(|_, lsn| *lsn > durable);
        }
        drop(core);
        // Early replies do not wait for the journal: their records go with the next flush
        // (within `LAZY_FLUSH`); anything else in the batch waits for one now (a change
        // that depended on another session's too: it is not answered early).
        if depended || reqs.iter().any(|(_, r)| r.mode != ReplyMode::Early) {
            self.journal.flush_now();
        }
        parked
    }

    /// Runs one engine operation with the reply cache and the journal; its mutations stay
    /// readable in `core.last_mutations()` until the next one.
    pub(crate) fn execute_traced(
        &self,
        core: &mut Core,
        client: u64,
        req: &Request,
        now: TimeNs,
    ) -> Reply {
        self.execute_one(core, client, req, now)
    }

    fn execute_one(&self, core: &mut Core, client: u64, req: &Request, now: TimeNs) -> Reply {
        let cached = req.seq != 0 && req.op.needs_reply_cache();
        if req.seq_floor != 0 {
            core.replies.acknowledge(client, req.seq_floor);
        }
        if cached
            && !self.breaks.has(Break::ReplyCache)
            && let Some(outcome) = core.replies.get(client, req.seq)
        {
            core.scratch.clear();
            let replay = matches!(req.mode, ReplyMode::Replay { .. });
            return retry_reply(&mut core.engine, &req.op, outcome, replay);
        }
        let mut muts = std::mem::take(&mut core.scratch);
        muts.clear();
        let reply = core.engine.execute(&req.cred, &req.op, now, &mut muts);
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
            let lsn = journal_entry(
                &self.journal,
                client,
                if cached { req.seq } else { 0 },
                req.seq_floor,
                outcome,
                &muts,
            );
            let durable = self.journal.durable_lsn();
            core.journaled(client, &muts, lsn, durable, self.clock.now());
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
                let depended = core.unsettled.note_found(client, &found, lsn, durable);
                core.depended = core.depended.max(depended);
            }
            if cached {
                core.replies.insert(client, req.seq, outcome);
            }
        }
        core.scratch = muts;
        reply
    }

    fn statfs(&self, core: &mut Core, req: &Request, now: TimeNs) -> Reply {
        let Core {
            engine, scratch, ..
        } = core;
        let reply = engine.execute(&req.cred, &req.op, now, scratch);
        // File data's store, the cluster's (on S3, a large fixed figure: see
        // `kochab_s3store::REPORTED_CAPACITY`).
        match (reply, self.data.capacity()) {
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

    /// The server's state for `kochab status`.
    pub fn status(&self, core: &Core) -> StatusReport {
        let tables = core
            .engine
            .tables()
            .iter()
            .map(|t| TableStatus {
                lo: t.lo,
                hi: t.hi,
                region: kochab_meta::Region::of(t.lo).label().to_string(),
                inodes: t.inode_count(),
                dentries: t.dentry_count(),
                checkpoint_lsn: t.replay_from,
            })
            .collect();
        let (inodes, dentries) = core.engine.counts();
        StatusReport {
            server_id: self.server_id,
            pid: std::process::id(),
            epoch: self.journal.id().epoch,
            coordinators: self
                .cluster
                .as_ref()
                .map(|h| h.coord_addrs())
                .unwrap_or_default(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            tables,
            inodes,
            dentries,
            journal_bytes: self.journal.bytes(),
            journal_segments: self.journal.segments(),
            applied_lsn: self.journal.last_lsn(),
            durable_lsn: self.journal.durable_lsn(),
            rss_bytes: crate::metrics::rss_bytes(),
            connections: self.connections.load(Ordering::Relaxed),
            durable_mode: self.durable_mode,
            store: self.store_description.clone(),
            slices: self.slice_work().counters(),
        }
    }

    /// Updates the gauges that are sampled rather than counted.
    pub fn refresh_gauges(&self) {
        let m = &self.metrics;
        m.rss_bytes.set(crate::metrics::rss_bytes() as i64);
        m.journal_bytes.set(self.journal.bytes() as i64);
        m.connections
            .set(self.connections.load(Ordering::Relaxed) as i64);
        let core = self.core();
        m.data_reclaims_pending
            .set(core.engine.pending_reclaim_count() as i64);
        for t in core.engine.tables() {
            let label = crate::metrics::TableLabel {
                table: format!("{:016x}", t.lo),
            };
            m.table_inodes
                .get_or_create(&label)
                .set(t.inode_count() as i64);
            m.table_dentries
                .get_or_create(&label)
                .set(t.dentry_count() as i64);
        }
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
