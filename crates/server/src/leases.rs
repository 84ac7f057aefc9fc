//! Leases on what mounts cache, and the callbacks that revoke them (Panasas callbacks,
//! CephFS capabilities; docs/ARCHITECTURE.md, "Coherent caching between mounts").
//!
//! A session that asked for leases holds one on every inode a reply showed it and on the
//! names of every directory a lookup, listing or namespace change of it read. Before
//! another session's change to a leased key is acknowledged, each holder is told to drop
//! what it caches of it (a callback) and the change's reply waits until the holder answered
//! or its lease ran out. Everything here is pure state: the server sends the callbacks and
//! makes the replies wait ([`Callbacks`] keeps the books), so tests drive it step by step.

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
        let until = now + LEASE;
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
    /// inode); a directory's names lease stays (the holder still caches its other names).
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
                | Mutation::DropXattr { id, .. } => {
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

struct Pending {
    changer: u64,
    ticket: u64,
    holder: u64,
    deadline: Instant,
}

/// Callbacks in flight: who caused each, whom it went to, and until when it is waited for.
#[derive(Default)]
pub struct Callbacks {
    next_id: u64,
    pending: FxHashMap<u64, Pending>,
    /// Per changing session: its board and its tickets not done yet.
    changers: FxHashMap<u64, (Arc<Board>, BTreeSet<u64>)>,
    /// Bumped whenever a callback ends (for whoever waits for particular ones).
    ended: tokio::sync::watch::Sender<u64>,
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

    /// Records a callback caused by `changer` to `holder`, waited for until `deadline`;
    /// returns its id (the request id of its `Callback` frame).
    pub fn issue(&mut self, changer: u64, holder: u64, deadline: Instant) -> u64 {
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
                deadline,
            },
        );
        id
    }

    /// True while callback `id` is neither answered nor run out.
    pub fn is_pending(&self, id: u64) -> bool {
        self.pending.contains_key(&id)
    }

    /// Changes whenever a callback ends.
    pub fn watch_ended(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ended.subscribe()
    }

    /// The holder answered callback `id` (an unknown id is ignored: it ran out already).
    pub fn done(&mut self, id: u64) {
        if let Some(p) = self.pending.remove(&id) {
            self.finish(p.changer, p.ticket);
        }
    }

    /// Ends the callbacks whose holder is `holder` (its leases are gone with it) or whose
    /// deadline passed; returns how many ended.
    pub fn expire(&mut self, now: Instant, holder: Option<u64>) -> usize {
        let ended: Vec<(u64, u64, u64)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now || Some(p.holder) == holder)
            .map(|(&id, p)| (id, p.changer, p.ticket))
            .collect();
        for &(id, changer, ticket) in &ended {
            self.pending.remove(&id);
            self.finish(changer, ticket);
        }
        ended.len()
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
        let t = Instant::now();
        let board = c.board(1);
        let done = board.subscribe();
        let a = c.issue(1, 2, t + LEASE);
        let b = c.issue(1, 3, t + LEASE);
        assert_eq!(board.ticket(), 2);
        c.done(b);
        assert_eq!(*done.borrow(), 0, "ticket 1 is still out");
        c.done(a);
        assert_eq!(*done.borrow(), 2);
        // A holder that goes away, and a deadline that passes, end callbacks too.
        let _ = c.issue(1, 2, t + LEASE);
        let _ = c.issue(1, 3, t + Duration::from_secs(1));
        assert_eq!(c.expire(t, Some(2)), 1);
        assert_eq!(*done.borrow(), 3);
        assert_eq!(c.next_deadline(), Some(t + Duration::from_secs(1)));
        assert_eq!(c.expire(t + Duration::from_secs(1), None), 1);
        assert_eq!(*done.borrow(), 4);
    }
}
