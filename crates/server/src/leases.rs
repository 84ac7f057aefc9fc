//! Leases on what mounts cache, and the callbacks that revoke them (Panasas callbacks,
//! CephFS capabilities; docs/ARCHITECTURE.md, "Coherent caching between mounts").
//!
//! A session that asked for leases holds one on every inode a reply showed it and on the
//! names of every directory a lookup, listing or namespace change of it read. Before
//! another session's change to a leased key is acknowledged, each holder is told to drop
//! what it caches of it (a callback) and the change's reply waits until the holder answered
//! or its lease ran out. A holder that does not answer in time is in default: it loses its
//! leases and gets none for a while (see [`Callbacks`]), so that holding a lease (which
//! takes no more than search permission on a directory) cannot stall other clients.
//! Everything here is pure state: the server sends the callbacks and makes the replies
//! wait ([`Callbacks`] keeps the books), so tests drive it step by step.

use kochab_breaks::{Break, Breaks};
use kochab_meta::Mutation;
use kochab_proto::{InodeId, Invalidation};
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a lease lasts from its grant. Long enough that a mount answers most repeated
/// lookups and stats itself (the kernel's TTL is what is left of it); short enough that a
/// mount that stops answering callbacks holds up others' changes for at most this long,
/// and that a server restarted after a crash (which forgot who holds what) waits it out
/// before it runs new changes (`core::REPLAY_WINDOW`).
pub const LEASE: Duration = Duration::from_secs(5);

/// Grants between two sweeps of expired leases: bounds the memory of leases nobody
/// renews (a sweep is a pass over all of them, so it is amortised over this many).
const SWEEP_EVERY: usize = 1 << 16;

/// What a lease covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeaseKey {
    /// The names of a directory (positive and negative entries cached under it).
    Names(InodeId),
    /// An inode's attributes and data.
    Inode(InodeId),
}

impl LeaseKey {
    fn id(self) -> InodeId {
        match self {
            LeaseKey::Names(id) | LeaseKey::Inode(id) => id,
        }
    }
}

/// Who holds which lease, until when.
#[derive(Default)]
pub struct Leases {
    held: FxHashMap<LeaseKey, Vec<(u64, Instant)>>,
    grants: usize,
    /// Deliberate bugs switched on (only a simulation sets any, see `kochab_breaks`).
    pub(crate) breaks: Breaks,
}

/// Invalidations for one holder.
pub type Revocation = (u64, Vec<Invalidation>);

impl Leases {
    /// `session` may cache `key` until `now + LEASE`.
    pub fn grant(&mut self, session: u64, key: LeaseKey, now: Instant) {
        self.grants += 1;
        if self.grants >= SWEEP_EVERY {
            self.grants = 0;
            self.sweep(now);
        }
        let until = match self.breaks.has(Break::LeaseExpiryEarly) {
            false => now + LEASE,
            true => now + LEASE / 2,
        };
        let holders = self.held.entry(key).or_default();
        match holders.iter_mut().find(|(s, _)| *s == session) {
            Some(h) => h.1 = h.1.max(until),
            None => holders.push((session, until)),
        }
    }

    /// Forgets every expired lease.
    pub fn sweep(&mut self, now: Instant) {
        self.held.retain(|_, holders| {
            holders.retain(|&(_, until)| until > now);
            !holders.is_empty()
        });
    }

    /// Number of keys with a lease (for tests and status).
    pub fn keys(&self) -> usize {
        self.held.len()
    }

    /// What every holder other than `changer` must drop before `muts` become visible, with
    /// the latest expiry among the leases called back (the longest the change must wait).
    /// An inode's lease ends with its callback (the holder drops all it caches of the
    /// inode); a directory's names lease stays (the holder still caches its other names),
    /// but only as long as the holder answers: one that misses the callback's deadline
    /// loses it, renewed or not, with all its others ([`Callbacks::expire`]).
    pub fn changed(
        &mut self,
        changer: u64,
        muts: &[Mutation],
        now: Instant,
    ) -> Vec<(u64, Vec<Invalidation>, Instant)> {
        let mut out: Vec<(u64, Vec<Invalidation>, Instant)> = Vec::new();
        if self.held.is_empty() {
            return out;
        }
        for m in muts {
            let (key, what) = match m {
                Mutation::PutDentry { parent, name, .. }
                | Mutation::DropDentry { parent, name } => (
                    LeaseKey::Names(*parent),
                    Invalidation::Entry {
                        parent: *parent,
                        name: name.as_bytes().to_vec(),
                    },
                ),
                Mutation::PutInode { id, .. }
                | Mutation::DropInode { id }
                | Mutation::SetXattr { id, .. }
                | Mutation::DropXattr { id, .. }
                // A layout change (compaction's included) makes cached layouts stale.
                | Mutation::PutChunk { id, .. }
                | Mutation::DropChunks { id, .. } => {
                    (LeaseKey::Inode(*id), Invalidation::Inode { id: *id })
                }
                Mutation::PutReclaim { .. }
                | Mutation::DropReclaim { .. }
                | Mutation::SetRegionNext { .. } => continue,
            };
            self.call_back_key(changer, key, what, now, &mut out);
        }
        out
    }

    /// What holders other than `opener` must drop of inode `id` before `opener` may hold
    /// writes of it back (their cached size and data would go stale unseen), as for
    /// [`Leases::changed`].
    pub fn opened_for_writing(
        &mut self,
        opener: u64,
        id: InodeId,
        now: Instant,
    ) -> Vec<(u64, Vec<Invalidation>, Instant)> {
        let mut out = Vec::new();
        let what = Invalidation::Inode { id };
        self.call_back_key(opener, LeaseKey::Inode(id), what, now, &mut out);
        out
    }

    /// Adds to `out` the callback of `what` to every holder of `key` but `changer`.
    fn call_back_key(
        &mut self,
        changer: u64,
        key: LeaseKey,
        what: Invalidation,
        now: Instant,
        out: &mut Vec<(u64, Vec<Invalidation>, Instant)>,
    ) {
        let Some(holders) = self.held.get_mut(&key) else {
            return;
        };
        // The common case (one mount changing what only it caches) costs no more.
        if holders.iter().all(|&(s, _)| s == changer) {
            return;
        }
        holders.retain(|&(_, until)| until > now);
        let mut kept = Vec::new();
        for &(session, until) in holders.iter() {
            if session == changer {
                kept.push((session, until));
                continue;
            }
            match out.iter_mut().find(|(s, _, _)| *s == session) {
                Some((_, list, latest)) => {
                    if !list.contains(&what) {
                        list.push(what.clone());
                    }
                    *latest = (*latest).max(until);
                }
                None => out.push((session, vec![what.clone()], until)),
            }
            if matches!(key, LeaseKey::Names(_)) {
                kept.push((session, until));
            }
        }
        if kept.is_empty() {
            self.held.remove(&key);
        } else {
            *holders = kept;
        }
    }

    /// Ends every lease on ids in `lo..hi` (a table leaving this server: whoever serves it
    /// next knows nothing of them); returns what each holder must drop and until when it
    /// might still cache it.
    pub fn revoke_range(
        &mut self,
        lo: InodeId,
        hi: InodeId,
        now: Instant,
    ) -> Vec<(u64, Vec<Invalidation>, Instant)> {
        let mut out: Vec<(u64, Vec<Invalidation>, Instant)> = Vec::new();
        let keys: Vec<LeaseKey> = self
            .held
            .keys()
            .filter(|k| (lo..hi).contains(&k.id()))
            .copied()
            .collect();
        for key in keys {
            let Some(holders) = self.held.remove(&key) else {
                continue;
            };
            let what = match key {
                LeaseKey::Names(dir) => Invalidation::Names { dir },
                LeaseKey::Inode(id) => Invalidation::Inode { id },
            };
            for (session, until) in holders.into_iter().filter(|&(_, u)| u > now) {
                match out.iter_mut().find(|(s, _, _)| *s == session) {
                    Some((_, list, latest)) => {
                        list.push(what.clone());
                        *latest = (*latest).max(until);
                    }
                    None => out.push((session, vec![what.clone()], until)),
                }
            }
        }
        out
    }

    /// Forgets the leases of a session (its last connection closed: it forgot them too).
    pub fn forget_session(&mut self, session: u64) {
        self.held.retain(|_, holders| {
            holders.retain(|&(s, _)| s != session);
            !holders.is_empty()
        });
    }
}

/// How long a writer writes through (holds nothing back) after a flush callback: twice a
/// lease, so that it still writes through for a whole lease after any check that found
/// its promise good (a lease granted then ends first; see [`Flushes::wanted`]).
pub const WRITE_THROUGH: Duration = Duration::from_secs(LEASE.as_secs() * 2);

/// Writers that may hold writes back (a mount's write-behind), and the flush callbacks
/// that make them send them before another session sees the file's size or data.
///
/// Every session with a handle open for writing may hold writes back. Before another
/// session reads, stats, truncates or appends to the file (or is shown its attributes),
/// each such writer is called back to flush and to write through for [`WRITE_THROUGH`]:
/// while that promise lasts, every write it makes reaches the server, which calls back
/// the readers' leases as for any change. A promise is asked for again when less than a
/// lease of it is left, so no lease granted on the file outlives it.
#[derive(Default)]
pub struct Flushes {
    /// Per inode: the sessions holding it open for writing, once per handle.
    writers: FxHashMap<InodeId, Vec<u64>>,
    /// Per (inode, writer): its promise to write through.
    promised: FxHashMap<(InodeId, u64), Promise>,
}

/// A writer's promise to write a file through, made by answering a flush callback.
#[derive(Clone, Copy, Debug)]
struct Promise {
    until: Instant,
    /// The flush callback, which the writer may not have answered yet.
    callback: Option<u64>,
    /// Another session was granted a lease on the file under it: the writer's next
    /// write calls that lease back, and then may hold writes back again.
    leased: bool,
}

impl Flushes {
    /// `session` opened `id` for writing (one more handle).
    pub fn opened(&mut self, id: InodeId, session: u64) {
        self.writers.entry(id).or_default().push(session);
    }

    /// `session` closed a handle of `id` that was open for writing.
    pub fn closed(&mut self, id: InodeId, session: u64) {
        if let Some(w) = self.writers.get_mut(&id) {
            if let Some(i) = w.iter().position(|&s| s == session) {
                w.swap_remove(i);
            }
            if !w.contains(&session) {
                self.promised.remove(&(id, session));
            }
            if w.is_empty() {
                self.writers.remove(&id);
            }
        }
    }

    /// Forgets a session whose handles ended, or every writer of ids in `lo..hi` (a
    /// table leaving: its handles go with it).
    pub fn forget(&mut self, session: Option<u64>, range: Option<(InodeId, InodeId)>) {
        let gone = |id: InodeId, s: u64| {
            session == Some(s) || range.is_some_and(|(lo, hi)| (lo..hi).contains(&id))
        };
        self.writers.retain(|&id, w| {
            w.retain(|&s| !gone(id, s));
            !w.is_empty()
        });
        self.promised.retain(|&(id, s), _| !gone(id, s));
    }

    /// True if no file is open for writing (the common test before any other work).
    pub fn is_empty(&self) -> bool {
        self.writers.is_empty()
    }

    /// The writers of `ids` other than `reader` that must be called back (their promise
    /// is missing or has less than a lease left) and the callbacks already out that
    /// `reader` must wait for. `pending` tells whether a callback is still unanswered.
    pub fn wanted(
        &self,
        reader: u64,
        ids: impl IntoIterator<Item = InodeId>,
        now: Instant,
        pending: impl Fn(u64) -> bool,
    ) -> (Vec<(u64, InodeId)>, Vec<u64>) {
        let (mut call, mut wait) = (Vec::new(), Vec::new());
        for id in ids {
            let Some(writers) = self.writers.get(&id) else {
                continue;
            };
            for &w in writers.iter().filter(|&&w| w != reader) {
                if call.contains(&(w, id)) {
                    continue;
                }
                match self.promised.get(&(id, w)) {
                    Some(p) if p.until >= now + LEASE => {
                        if let Some(cb) = p.callback.filter(|&cb| pending(cb))
                            && !wait.contains(&cb)
                        {
                            wait.push(cb);
                        }
                    }
                    _ => call.push((w, id)),
                }
            }
        }
        (call, wait)
    }

    /// Records that `writer` was sent flush callback `callback` for `ids` at `now`.
    pub fn called(&mut self, writer: u64, ids: &[InodeId], callback: u64, now: Instant) {
        for &id in ids {
            let promise = Promise {
                until: now + WRITE_THROUGH,
                callback: Some(callback),
                leased: false,
            };
            self.promised.insert((id, writer), promise);
        }
    }

    /// `session` was granted a lease on `id`: the promises of its other writers now
    /// cover a lease.
    pub fn leased(&mut self, id: InodeId, session: u64) {
        if let Some(writers) = self.writers.get(&id) {
            for &w in writers.iter().filter(|&&w| w != session) {
                if let Some(p) = self.promised.get_mut(&(id, w)) {
                    p.leased = true;
                }
            }
        }
    }

    /// `writer` changed `id` at the server: if it promised to write through and a lease
    /// was granted under that promise, this change calls the lease back (leases on an
    /// inode end with their callback), so the promise ends. True if it did: tell the
    /// writer it may hold writes back again (a `Hold` callback).
    pub fn wrote(&mut self, id: InodeId, writer: u64) -> bool {
        let ends = self.promised.get(&(id, writer)).is_some_and(|p| p.leased);
        if ends {
            self.promised.remove(&(id, writer));
        }
        ends
    }
}

/// How far the callbacks a session's changes caused are done, for the replies that wait
/// for them: every reply to the session waits until the callbacks issued before it was
/// made are done (so replies keep their order, as the journal's durability keeps it).
#[derive(Default)]
pub struct Board {
    /// Tickets handed out: one per callback this session's changes caused.
    issued: AtomicU64,
    /// Every ticket up to this one is done.
    done: tokio::sync::watch::Sender<u64>,
}

impl Board {
    /// The ticket a reply made now must wait for.
    pub fn ticket(&self) -> u64 {
        self.issued.load(Ordering::Acquire)
    }

    /// Watches the tickets done.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.done.subscribe()
    }
}

/// How long a holder may take over a callback that only drops what it caches before the
/// answer counts against it as a missed one. The mount answers such callbacks within
/// 200 ms even when the kernel holds an invalidation up (`CALLBACK_ANSWER_MAX` in
/// kochab-client); five times that leaves room for a loaded machine. Without this bound a
/// holder that answers each callback just before its deadline would hold every change it
/// is called back for up to a lease. Measured from when the callback was sent or the
/// holder answered one sent before it, whichever is later, so callbacks queued behind one
/// another at a busy holder are not counted twice (see `Standing::began`).
pub const CALLBACK_SLOW: Duration = Duration::from_secs(1);

/// How long a holder that went into default gets no leases at least, the first time.
/// Each default doubles it: a holder that answers late again and again (or answers the
/// callback it missed only to miss the next) costs others one deadline per default, and
/// defaults grow further apart, so its share of others' time falls (a lease in 65 at the
/// cap below).
const PENALTY_FIRST: Duration = LEASE;

/// The longest penalty: 64 leases (5 min 20 s).
const PENALTY_MAX: Duration = Duration::from_secs(LEASE.as_secs() * 64);

/// Defaults are forgotten after this long without another (twice the longest penalty):
/// a mount that was stopped once a day starts over at the shortest penalty.
const DEFAULTS_KEPT: Duration = Duration::from_secs(PENALTY_MAX.as_secs() * 2);

/// Missed callbacks remembered per holder in default; answering any of them counts. A
/// holder answers in order, so the first ones are kept; the bound caps what a holder
/// that ignores many callbacks at once can make the server keep.
const MISSED_KEPT: usize = 16;

/// How quickly a holder must answer a callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Urgency {
    /// It drops what it caches of a changed name or inode: within [`CALLBACK_SLOW`],
    /// else it is in default (as if it had missed the deadline).
    Drop,
    /// It sends writes it held back, or drops everything it caches of a table or of all
    /// tables: that may take as long as what it holds needs, up to the deadline.
    Work,
}

struct Pending {
    changer: u64,
    ticket: u64,
    holder: u64,
    sent: Instant,
    deadline: Instant,
    urgency: Urgency,
}

/// What the servers know of a holder's answers: when it last answered, and whether it is
/// in default (NFSv4 revokes the delegations of a client that does not return them).
#[derive(Default)]
struct Standing {
    /// When its last answer came, and to which callback (for [`CALLBACK_SLOW`]).
    answered: Option<(Instant, u64)>,
    /// Defaults so far (forgotten after [`DEFAULTS_KEPT`] without one).
    defaults: u32,
    /// When it last went into default.
    last_default: Option<Instant>,
    /// In default: no leases, no callbacks, nobody waits for it.
    in_default: bool,
    /// In default: the callbacks it missed. It leaves default once it has answered one of
    /// them (or its connections all ended: it then dropped everything it cached) and its
    /// penalty is over. Empty: answered.
    missed: Vec<u64>,
    /// In default: no lease before this.
    penalty_until: Option<Instant>,
}

impl Standing {
    /// When the holder could start on callback `id`, sent at `sent`: when it was sent, or
    /// when the holder answered the one before it (a holder works through its callbacks
    /// in order). An answer to a later one does not count: a holder that answers new
    /// callbacks and leaves an old one is not working through them.
    fn began(&self, id: u64, sent: Instant) -> Instant {
        match self.answered {
            Some((at, last)) if last < id => at.max(sent),
            _ => sent,
        }
    }

    /// Goes into default at `now`, having missed `missed` (empty: a slow answer, given).
    fn default_at(&mut self, now: Instant, missed: Vec<u64>) {
        let forgotten = self
            .last_default
            .is_some_and(|t| now.saturating_duration_since(t) > DEFAULTS_KEPT);
        self.defaults = if forgotten { 1 } else { self.defaults + 1 };
        self.last_default = Some(now);
        self.in_default = true;
        self.missed = missed;
        self.missed.truncate(MISSED_KEPT);
        self.penalty_until = Some(now + penalty(self.defaults));
    }

    /// Nothing worth keeping: no default, none to remember, no answer to time against.
    fn is_idle(&self, now: Instant) -> bool {
        !self.in_default
            && self.answered.is_none()
            && self
                .last_default
                .is_none_or(|t| now.saturating_duration_since(t) > DEFAULTS_KEPT)
    }
}

/// The shortest time in default after `defaults` of them (the last one included).
fn penalty(defaults: u32) -> Duration {
    let doublings = defaults.saturating_sub(1).min(16);
    PENALTY_FIRST
        .saturating_mul(1 << doublings)
        .min(PENALTY_MAX)
}

/// Whether a holder may be granted leases now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leasing {
    Yes,
    /// It is in default.
    No,
    /// It leaves default now: first tell it to drop everything it cached (it cached
    /// replies that granted nothing, and missed callbacks), then grant as usual.
    Resume,
}

/// How the callbacks whose deadline passed ended.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Expired {
    /// Callbacks that ran out unanswered.
    pub missed: usize,
    /// Holders that went into default for it (their leases are gone).
    pub defaulted: Vec<u64>,
}

/// What became of an answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Answered {
    /// It ended a callback in flight, or was the answer a holder in default owed.
    Done,
    /// Not a callback sent to this session (or one that ended already): ignored.
    Ignored,
    /// It came later than [`CALLBACK_SLOW`]: the holder is in default now.
    Slow,
}

/// Callbacks in flight: who caused each, whom it went to, and until when it is waited for;
/// and the standing of the holders (see [`Standing`]).
#[derive(Default)]
pub struct Callbacks {
    next_id: u64,
    pending: FxHashMap<u64, Pending>,
    /// Per changing session: its board and its tickets not done yet.
    changers: FxHashMap<u64, (Arc<Board>, BTreeSet<u64>)>,
    /// Bumped whenever a callback ends (for whoever waits for particular ones).
    ended: tokio::sync::watch::Sender<u64>,
    standings: FxHashMap<u64, Standing>,
    /// Holders in default (the common test before any lookup in `standings`).
    in_default: usize,
    /// Deliberate bugs switched on (only a simulation sets any, see `kochab_breaks`).
    pub(crate) breaks: Breaks,
}

impl Callbacks {
    /// The board of `session` (made on first use).
    pub fn board(&mut self, session: u64) -> Arc<Board> {
        self.changers
            .entry(session)
            .or_insert_with(|| (Arc::new(Board::default()), BTreeSet::new()))
            .0
            .clone()
    }

    /// Records a callback caused by `changer` to `holder`, sent at `now` and waited for
    /// until `deadline`; returns its id (the request id of its `Callback` frame), or
    /// `None` if `holder` is in default (nothing is sent to it, nobody waits for it).
    pub fn issue(
        &mut self,
        changer: u64,
        holder: u64,
        deadline: Instant,
        urgency: Urgency,
        now: Instant,
    ) -> Option<u64> {
        if self.is_in_default(holder) {
            return None;
        }
        self.next_id += 1;
        let id = self.next_id;
        let (board, outstanding) = self
            .changers
            .entry(changer)
            .or_insert_with(|| (Arc::new(Board::default()), BTreeSet::new()));
        let ticket = board.issued.fetch_add(1, Ordering::AcqRel) + 1;
        outstanding.insert(ticket);
        self.pending.insert(
            id,
            Pending {
                changer,
                ticket,
                holder,
                sent: now,
                deadline,
                urgency,
            },
        );
        Some(id)
    }

    /// True while callback `id` is neither answered nor run out.
    pub fn is_pending(&self, id: u64) -> bool {
        self.pending.contains_key(&id)
    }

    /// Changes whenever a callback ends.
    pub fn watch_ended(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ended.subscribe()
    }

    /// True if `holder` is in default.
    pub fn is_in_default(&self, holder: u64) -> bool {
        self.in_default > 0 && self.standings.get(&holder).is_some_and(|s| s.in_default)
    }

    /// Session `from` answered callback `id` at `now`. Only the session the callback went
    /// to may answer it (ids are a counter: any client could name any). A slow answer puts
    /// the holder in default, and its leases go (from `leases`).
    pub fn done(&mut self, from: u64, id: u64, now: Instant, leases: &mut Leases) -> Answered {
        let anyone = self.breaks.has(Break::CallbackOtherSession);
        let ours = self
            .pending
            .get(&id)
            .is_some_and(|p| p.holder == from || anyone);
        let Some(p) = ours.then(|| self.pending.remove(&id)).flatten() else {
            // The answer a holder in default owed?
            if let Some(st) = self.standings.get_mut(&from)
                && st.in_default
                && st.missed.contains(&id)
            {
                st.missed.clear();
                return Answered::Done;
            }
            return Answered::Ignored;
        };
        self.finish(p.changer, p.ticket);
        let st = self.standings.entry(from).or_default();
        let began = st.began(id, p.sent);
        if st.answered.is_none_or(|(_, last)| last < id) {
            st.answered = Some((now, id));
        }
        if p.urgency == Urgency::Drop && now.saturating_duration_since(began) > CALLBACK_SLOW {
            self.go_into_default(from, now, Vec::new(), leases);
            return Answered::Slow;
        }
        Answered::Done
    }

    /// Ends callback `id` unanswered and with no effect on its holder (it could not be
    /// sent: the holder's connections are gone, and its leases with them; or the lease it
    /// called back ran out before the holder could be expected to answer).
    pub fn cancel(&mut self, id: u64) {
        if let Some(p) = self.pending.remove(&id) {
            self.finish(p.changer, p.ticket);
        }
    }

    /// Ends the callbacks whose deadline passed. A holder that had [`CALLBACK_SLOW`] to
    /// answer one (counted as for a slow answer) missed it: it goes into default and loses
    /// its leases (from `leases`). One whose lease simply ran out sooner (the deadline is
    /// never past the lease) is not at fault: its cache ran out with the lease.
    pub fn expire(&mut self, now: Instant, leases: &mut Leases) -> Expired {
        let ran_out: Vec<(u64, u64, bool)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&id, p)| {
                let began = self
                    .standings
                    .get(&p.holder)
                    .map_or(p.sent, |s| s.began(id, p.sent));
                let had_time = now.saturating_duration_since(began) >= CALLBACK_SLOW;
                (p.holder, id, had_time)
            })
            .collect();
        let mut missed = Vec::new();
        for (holder, id, had_time) in ran_out {
            if had_time {
                missed.push((holder, id));
            } else {
                self.cancel(id);
            }
        }
        let mut out = Expired {
            missed: missed.len(),
            defaulted: Vec::new(),
        };
        if !missed.is_empty() {
            missed.sort_unstable();
            for chunk in missed.chunk_by(|a, b| a.0 == b.0) {
                let holder = chunk[0].0;
                let ids = chunk.iter().map(|&(_, id)| id).collect();
                self.go_into_default(holder, now, ids, leases);
                out.defaulted.push(holder);
            }
        }
        let mut resumed = 0;
        self.standings.retain(|_, st| {
            // In default, answered, penalty over a lease ago, and no request since (that
            // would have resumed it): whatever it cached without a lease has run out, so
            // there is nothing to tell it.
            let over = st.in_default
                && st.missed.is_empty()
                && st
                    .penalty_until
                    .is_some_and(|t| now.saturating_duration_since(t) > LEASE);
            if over {
                st.in_default = false;
                resumed += 1;
            }
            !st.is_idle(now)
        });
        self.in_default -= resumed;
        out
    }

    /// `holder` goes into default: every callback to it ends (nobody waits for it any
    /// more), and so do its leases.
    fn go_into_default(
        &mut self,
        holder: u64,
        now: Instant,
        missed: Vec<u64>,
        leases: &mut Leases,
    ) {
        self.end_holder(holder);
        leases.forget_session(holder);
        let st = self.standings.entry(holder).or_default();
        if !st.in_default {
            self.in_default += 1;
        }
        st.default_at(now, missed);
    }

    /// Whether `holder` may be granted leases at `now`.
    pub fn leasing(&mut self, holder: u64, now: Instant) -> Leasing {
        if self.in_default == 0 {
            return Leasing::Yes;
        }
        let Some(st) = self.standings.get_mut(&holder) else {
            return Leasing::Yes;
        };
        if !st.in_default {
            return Leasing::Yes;
        }
        if !st.missed.is_empty() || st.penalty_until.is_some_and(|t| now < t) {
            return Leasing::No;
        }
        st.in_default = false;
        self.in_default -= 1;
        Leasing::Resume
    }

    /// The last connection of `holder` ended: the client dropped everything it cached
    /// (which answers what it missed), and its leases and callbacks end. A default's
    /// penalty stays: a reconnect does not end it.
    pub fn holder_gone(&mut self, holder: u64, leases: &mut Leases) {
        leases.forget_session(holder);
        self.end_holder(holder);
        if let Some(st) = self.standings.get_mut(&holder) {
            st.missed.clear();
            st.answered = None;
        }
    }

    /// Ends every callback to `holder`.
    fn end_holder(&mut self, holder: u64) {
        let ended: Vec<(u64, u64, u64)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.holder == holder)
            .map(|(&id, p)| (id, p.changer, p.ticket))
            .collect();
        for (id, changer, ticket) in ended {
            self.pending.remove(&id);
            self.finish(changer, ticket);
        }
    }

    /// The earliest deadline of a callback in flight.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.deadline).min()
    }

    fn finish(&mut self, changer: u64, ticket: u64) {
        self.ended.send_modify(|n| *n += 1);
        if let Some((board, outstanding)) = self.changers.get_mut(&changer) {
            outstanding.remove(&ticket);
            let upto = match outstanding.first() {
                Some(first) => first - 1,
                None => board.issued.load(Ordering::Acquire),
            };
            board.done.send_if_modified(|d| {
                let moved = upto > *d;
                *d = (*d).max(upto);
                moved
            });
        }
    }

    /// Forgets a session that ended (no reply of it waits any more).
    pub fn forget_changer(&mut self, session: u64) {
        if let Some((_, outstanding)) = self.changers.get(&session)
            && outstanding.is_empty()
        {
            self.changers.remove(&session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::Name;

    fn dentry(parent: InodeId, name: &str) -> Mutation {
        Mutation::DropDentry {
            parent,
            name: Name::new(name.as_bytes()),
        }
    }

    #[test]
    fn a_change_calls_back_other_holders_not_the_changer() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(1, LeaseKey::Names(10), t);
        l.grant(2, LeaseKey::Names(10), t);
        let out = l.changed(1, &[dentry(10, "a")], t);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 2);
        assert_eq!(
            out[0].1,
            vec![Invalidation::Entry {
                parent: 10,
                name: b"a".to_vec()
            }]
        );
        assert_eq!(out[0].2, t + LEASE);
        // The names lease stays: another name's change calls back again.
        assert_eq!(l.changed(1, &[dentry(10, "b")], t).len(), 1);
    }

    #[test]
    fn an_inode_lease_ends_with_its_callback() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(2, LeaseKey::Inode(7), t);
        let drop = Mutation::DropInode { id: 7 };
        assert_eq!(l.changed(1, std::slice::from_ref(&drop), t).len(), 1);
        assert!(l.changed(1, &[drop], t).is_empty());
        assert_eq!(l.keys(), 0);
    }

    #[test]
    fn expired_leases_are_not_called_back() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(2, LeaseKey::Names(10), t);
        assert!(l.changed(1, &[dentry(10, "a")], t + LEASE).is_empty());
        l.grant(3, LeaseKey::Inode(5), t);
        l.sweep(t + LEASE);
        assert_eq!(l.keys(), 0);
    }

    #[test]
    fn one_callback_per_holder_gathers_every_invalidation_of_a_change() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(2, LeaseKey::Names(10), t);
        l.grant(2, LeaseKey::Inode(10), t);
        let muts = [
            dentry(10, "a"),
            Mutation::DropInode { id: 10 },
            dentry(10, "a"),
        ];
        let out = l.changed(1, &muts, t);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.len(), 2);
    }

    #[test]
    fn revoking_a_range_ends_its_leases_only() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(2, LeaseKey::Names(10), t);
        l.grant(2, LeaseKey::Inode(20), t);
        l.grant(3, LeaseKey::Inode(30), t);
        let out = l.revoke_range(10, 30, t);
        assert_eq!(out.len(), 1);
        assert!(out[0].1.contains(&Invalidation::Names { dir: 10 }));
        assert!(out[0].1.contains(&Invalidation::Inode { id: 20 }));
        assert_eq!(out[0].1.len(), 2);
        assert_eq!(l.keys(), 1);
        l.forget_session(3);
        assert_eq!(l.keys(), 0);
    }

    #[test]
    fn readers_wait_for_other_writers_flush_until_a_lease_of_its_promise_is_left() {
        let mut f = Flushes::default();
        let t = Instant::now();
        let none = |_| false;
        assert!(f.is_empty());
        f.opened(7, 1);
        f.opened(7, 1);
        // The writer itself, and files nobody writes, need nothing.
        assert_eq!(f.wanted(1, [7], t, none), (vec![], vec![]));
        assert_eq!(f.wanted(2, [8], t, none), (vec![], vec![]));
        // Another session: the writer is called back, and waited for while unanswered.
        assert_eq!(f.wanted(2, [7, 7], t, none), (vec![(1, 7)], vec![]));
        f.called(1, &[7], 40, t);
        assert_eq!(f.wanted(3, [7], t, |cb| cb == 40), (vec![], vec![40]));
        assert_eq!(f.wanted(3, [7], t + LEASE, none), (vec![], vec![]));
        // Less than a lease of the promise left: asked again.
        let late = t + WRITE_THROUGH - LEASE + Duration::from_millis(1);
        assert_eq!(f.wanted(3, [7], late, none), (vec![(1, 7)], vec![]));
        // The writer's own change ends its promise only once a lease was granted under
        // it (that change calls the lease back); then a reader needs a new flush.
        assert!(!f.wrote(7, 1));
        f.leased(7, 1);
        assert!(!f.wrote(7, 1), "its own lease");
        f.leased(7, 3);
        assert!(!f.wrote(7, 3), "not the writer");
        assert!(f.wrote(7, 1));
        assert_eq!(f.wanted(3, [7], t, none), (vec![(1, 7)], vec![]));
        f.called(1, &[7], 41, late);
        // One close of two handles keeps the writer; the last ends it and its promise.
        f.closed(7, 1);
        assert_eq!(f.wanted(3, [7], late + WRITE_THROUGH, none).0.len(), 1);
        f.closed(7, 1);
        assert!(f.is_empty());
        f.opened(7, 1);
        f.opened(9, 2);
        f.forget(Some(1), None);
        f.forget(None, Some((9, 10)));
        assert!(f.is_empty());
    }

    #[test]
    fn opening_for_writing_calls_back_others_cached_attributes() {
        let mut l = Leases::default();
        let t = Instant::now();
        l.grant(2, LeaseKey::Inode(7), t);
        l.grant(1, LeaseKey::Inode(7), t);
        let out = l.opened_for_writing(1, 7, t);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 2);
        assert_eq!(out[0].1, vec![Invalidation::Inode { id: 7 }]);
        assert!(l.opened_for_writing(1, 7, t).is_empty(), "the lease ended");
    }

    #[test]
    fn replies_wait_for_every_callback_issued_before_them() {
        let mut c = Callbacks::default();
        let mut l = Leases::default();
        let t = Instant::now();
        let board = c.board(1);
        let done = board.subscribe();
        let issue = |c: &mut Callbacks, holder, deadline| {
            c.issue(1, holder, deadline, Urgency::Drop, t).unwrap()
        };
        let a = issue(&mut c, 2, t + LEASE);
        let b = issue(&mut c, 3, t + LEASE);
        assert_eq!(board.ticket(), 2);
        assert_eq!(c.done(3, b, t, &mut l), Answered::Done);
        assert_eq!(*done.borrow(), 0, "ticket 1 is still out");
        assert_eq!(c.done(2, a, t, &mut l), Answered::Done);
        assert_eq!(*done.borrow(), 2);
        // A holder that goes away, and a deadline that passes, end callbacks too.
        let _ = issue(&mut c, 2, t + LEASE);
        let _ = issue(&mut c, 3, t + Duration::from_secs(1));
        c.holder_gone(2, &mut l);
        assert_eq!(*done.borrow(), 3);
        assert_eq!(c.next_deadline(), Some(t + Duration::from_secs(1)));
        let expired = c.expire(t + Duration::from_secs(1), &mut l);
        assert_eq!((expired.missed, expired.defaulted), (1, vec![3]));
        assert_eq!(*done.borrow(), 4);
        // A lease about to run out when it is called back: the callback ends with it,
        // before the holder could answer, and that is no fault of the holder.
        let e = issue(&mut c, 5, t + Duration::from_millis(10));
        let expired = c.expire(t + Duration::from_millis(10), &mut l);
        assert_eq!((expired.missed, expired.defaulted), (0, vec![]));
        assert!(!c.is_pending(e));
        assert_eq!(c.leasing(5, t), Leasing::Yes);
        // One that could not be sent ends at once, and costs its holder nothing.
        let d = issue(&mut c, 4, t + LEASE);
        c.cancel(d);
        assert_eq!(*done.borrow(), 6);
        assert_eq!(c.leasing(4, t), Leasing::Yes);
    }

    #[test]
    fn a_callback_is_answered_only_by_the_session_it_went_to() {
        let mut c = Callbacks::default();
        let mut l = Leases::default();
        let t = Instant::now();
        let done = c.board(1).subscribe();
        let id = c.issue(1, 2, t + LEASE, Urgency::Drop, t).unwrap();
        // Callback ids are a counter: another session can name this one, to no effect.
        assert_eq!(c.done(3, id, t, &mut l), Answered::Ignored);
        assert!(c.is_pending(id));
        assert_eq!(*done.borrow(), 0);
        assert_eq!(c.done(2, id, t, &mut l), Answered::Done);
        assert_eq!(*done.borrow(), 1);
        assert_eq!(c.done(2, id, t, &mut l), Answered::Ignored, "answered once");
    }

    #[test]
    fn a_holder_that_misses_a_deadline_loses_its_leases_until_it_answers() {
        let (mut l, mut c) = (Leases::default(), Callbacks::default());
        let t = Instant::now();
        let ms = Duration::from_millis;
        let board = c.board(1);
        l.grant(2, LeaseKey::Names(10), t);
        l.grant(2, LeaseKey::Inode(20), t);
        l.grant(3, LeaseKey::Names(10), t);
        // Session 1 creates a name in directory 10: both holders are called back.
        let mut called = Vec::new();
        for (holder, _, until) in l.changed(1, &[dentry(10, "a")], t) {
            called.push((holder, c.issue(1, holder, until, Urgency::Drop, t).unwrap()));
        }
        called.sort_unstable();
        let [(2, missed), (3, answered)] = called[..] else {
            panic!("{called:?}");
        };
        assert_eq!(c.done(3, answered, t + ms(5), &mut l), Answered::Done);
        // Holder 2 keeps renewing its names lease and never answers: the renewals do not
        // keep the lease past the callback's deadline.
        for i in 1..10 {
            assert_eq!(c.leasing(2, t + ms(400 * i)), Leasing::Yes);
            l.grant(2, LeaseKey::Names(10), t + ms(400 * i));
        }
        assert!(c.expire(t + LEASE - ms(1), &mut l).defaulted.is_empty());
        let expired = c.expire(t + LEASE, &mut l);
        assert_eq!((expired.missed, expired.defaulted), (1, vec![2]));
        assert_eq!(board.ticket(), 2);
        assert_eq!(
            *board.subscribe().borrow(),
            2,
            "nothing is waited for any more"
        );
        // Every lease of holder 2 is gone; holder 3's (renewed) stays.
        let later = t + LEASE + ms(10);
        l.grant(3, LeaseKey::Names(10), t + LEASE);
        let out = l.changed(1, &[dentry(10, "b"), Mutation::DropInode { id: 20 }], later);
        assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![3]);
        // No new leases, no callbacks; the creates that follow wait for nobody.
        assert_eq!(c.leasing(2, later), Leasing::No);
        assert!(c.is_in_default(2));
        assert_eq!(c.issue(1, 2, later + LEASE, Urgency::Work, later), None);
        // Answering something else does not count; the missed callback does, from
        // session 2 only. The penalty (a lease from the default) still runs.
        assert_eq!(c.done(3, missed, later, &mut l), Answered::Ignored);
        assert_eq!(c.done(2, missed + 100, later, &mut l), Answered::Ignored);
        assert_eq!(c.leasing(2, t + LEASE * 3), Leasing::No, "not answered");
        assert_eq!(c.done(2, missed, later, &mut l), Answered::Done);
        assert_eq!(c.leasing(2, t + LEASE * 2 - ms(1)), Leasing::No, "penalty");
        // Then it resumes once: told to drop everything, and granted again.
        assert_eq!(c.leasing(2, t + LEASE * 2), Leasing::Resume);
        assert_eq!(c.leasing(2, t + LEASE * 2), Leasing::Yes);
        assert!(!c.is_in_default(2));
    }

    #[test]
    fn a_slow_answer_to_a_drop_is_a_default_but_a_queue_is_not_slow() {
        let (mut l, mut c) = (Leases::default(), Callbacks::default());
        let t = Instant::now();
        let ms = Duration::from_millis;
        // Ten callbacks sent at once, each answered 200 ms after the one before: the
        // last comes 2 s after it was sent, but the holder took 200 ms over each.
        let ids: Vec<u64> = (0..10)
            .map(|_| c.issue(1, 2, t + LEASE, Urgency::Drop, t).unwrap())
            .collect();
        for (i, &id) in ids.iter().enumerate() {
            let at = t + ms(200 * (i as u64 + 1));
            assert_eq!(c.done(2, id, at, &mut l), Answered::Done);
        }
        // A holder that answers new callbacks and leaves an old one: the old one's clock
        // is not reset by those answers, and it misses its deadline.
        let old = c
            .issue(1, 2, t + ms(2000) + LEASE, Urgency::Drop, t + ms(2000))
            .unwrap();
        for i in 1..=5 {
            let at = t + ms(2000 + 900 * i);
            let new = c.issue(1, 2, at + LEASE, Urgency::Drop, at).unwrap();
            assert_eq!(c.done(2, new, at + ms(1), &mut l), Answered::Done);
        }
        let expired = c.expire(t + ms(2000) + LEASE, &mut l);
        assert_eq!((expired.missed, expired.defaulted), (1, vec![2]));
        assert!(!c.is_pending(old));
        let mut c = Callbacks::default();
        // Flushes and table drops may take as long as they need.
        let t = t + ms(2000);
        let flush = c.issue(1, 2, t + LEASE, Urgency::Work, t).unwrap();
        assert_eq!(c.done(2, flush, t + ms(4000), &mut l), Answered::Done);
        // A drop answered more than CALLBACK_SLOW after it was sent: in default, with
        // its leases gone, although it answered (its penalty runs).
        let t = t + ms(4000);
        l.grant(2, LeaseKey::Inode(7), t);
        let other = c.issue(1, 2, t + LEASE, Urgency::Drop, t).unwrap();
        let slow = c.issue(1, 2, t + LEASE, Urgency::Drop, t).unwrap();
        let at = t + CALLBACK_SLOW + ms(1);
        assert_eq!(c.done(2, slow, at, &mut l), Answered::Slow);
        assert!(!c.is_pending(other), "its other callbacks end");
        assert_eq!(l.keys(), 0);
        assert_eq!(c.leasing(2, at + LEASE - ms(1)), Leasing::No);
        assert_eq!(c.leasing(2, at + LEASE), Leasing::Resume);
    }

    /// Issues a callback from 1 to `holder` at `t` and lets it run out unanswered; the
    /// holder goes into default at the returned instant.
    fn miss(c: &mut Callbacks, l: &mut Leases, holder: u64, t: Instant) -> (u64, Instant) {
        let id = c.issue(1, holder, t + LEASE, Urgency::Drop, t).unwrap();
        assert_eq!(c.expire(t + LEASE, l).defaulted, vec![holder]);
        (id, t + LEASE)
    }

    #[test]
    fn each_default_doubles_the_penalty_up_to_a_cap_and_defaults_are_forgotten() {
        let (mut l, mut c) = (Leases::default(), Callbacks::default());
        let mut t = Instant::now();
        let mut penalties = Vec::new();
        for _ in 0..9 {
            let (id, at) = miss(&mut c, &mut l, 2, t);
            assert_eq!(c.done(2, id, at, &mut l), Answered::Done);
            let mut p = LEASE;
            while c.leasing(2, at + p) == Leasing::No {
                p += LEASE;
            }
            penalties.push(p.as_secs() / LEASE.as_secs());
            t = at + p;
        }
        assert_eq!(penalties, [1, 2, 4, 8, 16, 32, 64, 64, 64]);
        // Long in good standing: the next default costs the shortest penalty again.
        t += DEFAULTS_KEPT + LEASE;
        let (_, at) = miss(&mut c, &mut l, 2, t);
        // Its connections end: that answers what it missed (it dropped everything), but
        // the penalty stays for a reconnect.
        c.holder_gone(2, &mut l);
        let ms = Duration::from_millis;
        assert_eq!(c.leasing(2, at + LEASE - ms(1)), Leasing::No);
        assert_eq!(c.leasing(2, at + LEASE), Leasing::Resume);
        // A holder idle in default past its penalty is resumed by the sweep, and a
        // standing with nothing to remember is forgotten.
        let (id, at) = miss(&mut c, &mut l, 3, t);
        c.holder_gone(3, &mut l);
        let _ = c.expire(at + LEASE * 2 + ms(1), &mut l);
        assert!(!c.is_in_default(3));
        assert_eq!(c.done(3, id, at, &mut l), Answered::Ignored);
        let _ = c.expire(at + DEFAULTS_KEPT * 2, &mut l);
        assert!(c.standings.is_empty());
    }
}
