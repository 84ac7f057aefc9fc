//! The client's half of early replies (docs/ARCHITECTURE.md, "Early replies"): a request
//! the server answered before its journal record was durable is kept here until that
//! server process reports its journal durable past the record's LSN, and is replayed if
//! the process is gone first (restarted, or its tables failed over), so that a crash of a
//! server alone loses nothing it acknowledged.
//!
//! A state machine: the client feeds it replies, durability reports and lost connections,
//! and asks it what to replay; no I/O, no clocks.

use kochab_proto::auth::ReplayTag;
use kochab_proto::{InodeId, Reply, Request};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What an early (`Unsafe`) reply says besides the reply: its journal record, and the tag a
/// replay of the request must send back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EarlyAck {
    pub lsn: u64,
    pub tag: ReplayTag,
}

/// One request answered early.
#[derive(Clone, Debug)]
pub struct Unsafe {
    pub req: Request,
    /// The inode it is routed by.
    pub target: InodeId,
    /// The server that answered it, and which process of it.
    pub addr: Arc<str>,
    pub incarnation: u64,
    /// Its journal record at that process.
    pub lsn: u64,
    /// The inode the reply created (0: none), asked for again by a replay.
    pub created: InodeId,
    /// The server's replay tag for it: a replay without it is refused.
    pub tag: ReplayTag,
}

/// Requests answered early and not known durable yet, in the order they were answered.
#[derive(Default)]
pub struct ReplayLog {
    next: u64,
    entries: BTreeMap<u64, Unsafe>,
    /// Reply-cache sequence numbers of the entries: the floor the client announces stays
    /// below them, so that a replay to a server that did not lose them is answered once.
    seqs: BTreeSet<u64>,
    /// Durable LSN reported per process (a report can overtake the reply it covers).
    durable: FxHashMap<u64, u64>,
    /// Processes a connection to which was lost while entries of theirs were kept: is the
    /// process still there (its journal will hold them) or gone (replay them)?
    suspects: BTreeSet<u64>,
    /// Processes found gone: an entry that still arrives from one is replayed too.
    gone: BTreeSet<u64>,
    /// Orders of the entries taken to be replayed and not replayed yet: a sync point
    /// waits for them as for the entries kept (they left `entries`, not the log's debt).
    in_replay: BTreeSet<u64>,
    /// Bytes of written data the entries hold (writes are replayed with their data).
    bytes: usize,
    /// Per server process with entries kept or being replayed: where it answered.
    processes: FxHashMap<u64, Process>,
}

/// What the log holds of one server process.
struct Process {
    addr: Arc<str>,
    kept: usize,
    /// Taken to be replayed, not replayed yet.
    replaying: usize,
}

/// Bytes of file data a kept request carries.
fn data_bytes(e: &Unsafe) -> usize {
    match &e.req.op {
        kochab_proto::Op::Write { data, .. } => data.len(),
        _ => 0,
    }
}

impl ReplayLog {
    /// Keeps a request answered early; false if its process already reported it durable.
    pub fn answered(&mut self, e: Unsafe) -> bool {
        if self
            .durable
            .get(&e.incarnation)
            .is_some_and(|&d| d >= e.lsn)
        {
            return false;
        }
        if self.gone.contains(&e.incarnation) {
            self.suspects.insert(e.incarnation);
        }
        if e.req.seq != 0 {
            self.seqs.insert(e.req.seq);
        }
        self.bytes += data_bytes(&e);
        self.processes
            .entry(e.incarnation)
            .or_insert_with(|| Process {
                addr: e.addr.clone(),
                kept: 0,
                replaying: 0,
            })
            .kept += 1;
        self.entries.insert(self.next, e);
        self.next += 1;
        true
    }

    /// Process `incarnation` made its journal durable up to `lsn`.
    pub fn durable(&mut self, incarnation: u64, lsn: u64) {
        let d = self.durable.entry(incarnation).or_default();
        if lsn <= *d {
            return;
        }
        *d = lsn;
        self.forget(|_, e| e.incarnation == incarnation && e.lsn <= lsn);
    }

    /// Everything process `incarnation` answered before the entry numbered `upto` is
    /// durable (a durable request to it answered after they were).
    pub fn durable_before(&mut self, incarnation: u64, upto: u64) {
        self.forget(|order, e| e.incarnation == incarnation && order < upto);
    }

    fn forget(&mut self, mut done: impl FnMut(u64, &Unsafe) -> bool) {
        let seqs = &mut self.seqs;
        let bytes = &mut self.bytes;
        let processes = &mut self.processes;
        self.entries.retain(|&order, e| {
            let drop = done(order, e);
            if drop {
                if e.req.seq != 0 {
                    seqs.remove(&e.req.seq);
                }
                *bytes -= data_bytes(e);
                count(processes, e.incarnation, |p| p.kept -= 1);
            }
            !drop
        });
    }

    /// A connection to `addr` reached process `incarnation`: true if entries of another
    /// process that answered at that address are kept or being replayed (it is gone, and
    /// a new request must not overtake their replay), and those kept become suspects.
    pub fn superseded(&mut self, addr: &str, incarnation: u64) -> bool {
        let mut found = false;
        for (&inc, p) in &self.processes {
            if inc != incarnation && &*p.addr == addr {
                found = true;
                if p.kept > 0 {
                    self.suspects.insert(inc);
                }
            }
        }
        found
    }

    /// A connection to process `incarnation` failed.
    pub fn lost(&mut self, incarnation: u64) {
        if self.entries.values().any(|e| e.incarnation == incarnation) {
            self.suspects.insert(incarnation);
        }
    }

    /// A process to look at, with the server address it answered at.
    pub fn next_suspect(&mut self) -> Option<(u64, Arc<str>)> {
        while let Some(&inc) = self.suspects.first() {
            match self.entries.values().find(|e| e.incarnation == inc) {
                Some(e) => return Some((inc, e.addr.clone())),
                None => {
                    self.suspects.remove(&inc);
                }
            }
        }
        None
    }

    /// True while some process must be looked at (the replayer's work).
    pub fn has_suspects(&self) -> bool {
        !self.suspects.is_empty()
    }

    /// True while a lost process may have changes still to replay: some process must be
    /// looked at, or a replay is under way (its entries are taken out of the log while
    /// they run). A request waits for this before it goes out, new or sent again, so that
    /// it cannot overtake a replay.
    pub fn replays_owed(&self) -> bool {
        !self.suspects.is_empty() || !self.in_replay.is_empty()
    }

    /// Process `incarnation` still runs: its journal will hold what it answered.
    pub fn alive(&mut self, incarnation: u64) {
        self.suspects.remove(&incarnation);
    }

    /// Process `incarnation` is gone: its entries, in the order they were answered, to
    /// replay (they leave the log; [`ReplayLog::put_back`] returns what could not be).
    pub fn take_gone(&mut self, incarnation: u64) -> Vec<(u64, Unsafe)> {
        self.suspects.remove(&incarnation);
        self.gone.insert(incarnation);
        let orders: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.incarnation == incarnation)
            .map(|(&o, _)| o)
            .collect();
        let mut out = Vec::with_capacity(orders.len());
        for o in orders {
            if let Some(e) = self.entries.remove(&o) {
                self.in_replay.insert(o);
                self.bytes -= data_bytes(&e);
                count(&mut self.processes, e.incarnation, |p| {
                    p.kept -= 1;
                    p.replaying += 1;
                });
                out.push((o, e));
            }
        }
        out
    }

    /// Replays that did not reach a server, to try again later.
    pub fn put_back(&mut self, rest: Vec<(u64, Unsafe)>) {
        for (o, e) in rest {
            self.in_replay.remove(&o);
            self.suspects.insert(e.incarnation);
            self.bytes += data_bytes(&e);
            count(&mut self.processes, e.incarnation, |p| {
                p.replaying -= 1;
                p.kept += 1;
            });
            self.entries.insert(o, e);
        }
    }

    /// Bytes of written data kept (see [`ReplayLog::answered`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The replay of the entry numbered `order` ran (or failed for good): its sequence
    /// number may leave the floor, and sync points stop waiting for it.
    pub fn replayed(&mut self, order: u64, e: &Unsafe) {
        self.in_replay.remove(&order);
        if e.req.seq != 0 {
            self.seqs.remove(&e.req.seq);
        }
        count(&mut self.processes, e.incarnation, |p| p.replaying -= 1);
    }

    /// The number the next answered entry gets.
    pub fn order_now(&self) -> u64 {
        self.next
    }

    /// True if no entry numbered below `upto` is kept or being replayed.
    pub fn clear_before(&self, upto: u64) -> bool {
        self.entries
            .first_key_value()
            .is_none_or(|(&o, _)| o >= upto)
            && self.in_replay.first().is_none_or(|&o| o >= upto)
    }

    /// The lowest sequence number kept (the floor stays at or below it).
    pub fn min_seq(&self) -> Option<u64> {
        self.seqs.first().copied()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Changes what the log counts of process `inc` (whose entry exists while it counts
/// anything).
fn count(processes: &mut FxHashMap<u64, Process>, inc: u64, change: impl FnOnce(&mut Process)) {
    if let Some(p) = processes.get_mut(&inc) {
        change(p);
        if p.kept == 0 && p.replaying == 0 {
            processes.remove(&inc);
        }
    }
}

/// The inode a successful reply created or names (what a replay asks for again, and what
/// the reply's tag covers).
pub fn created_by(reply: &Reply) -> InodeId {
    reply.created()
}

/// The request that replays `e`: the same request (sequence number included), in replay
/// mode with the inode its first reply created and the tag that proves it was answered.
pub fn replay_request(e: &Unsafe) -> Request {
    let mut req = e.req.clone();
    req.mode = kochab_proto::ReplyMode::Replay {
        want_id: e.created,
        tag: e.tag,
    };
    req
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::{Credentials, Op, ReplyMode};

    fn entry(seq: u64, inc: u64, lsn: u64) -> Unsafe {
        Unsafe {
            req: Request {
                cred: Credentials::root(),
                seq,
                seq_floor: 0,
                map_version: 0,
                mode: ReplyMode::Early,
                op: Op::Unlink {
                    parent: 1,
                    name: format!("f{seq}").into_bytes(),
                },
            },
            target: 1,
            addr: "a:1".into(),
            incarnation: inc,
            lsn,
            created: 0,
            tag: [seq as u8; 16],
        }
    }

    #[test]
    fn durability_reports_drop_entries_and_may_come_before_the_reply() {
        let mut log = ReplayLog::default();
        assert!(log.answered(entry(1, 7, 10)));
        assert!(log.answered(entry(2, 7, 11)));
        assert!(log.answered(entry(3, 8, 5)));
        assert_eq!(log.min_seq(), Some(1));
        log.durable(7, 10);
        assert_eq!(log.len(), 2);
        assert_eq!(log.min_seq(), Some(2));
        // A report that overtook its reply: nothing to keep.
        log.durable(7, 20);
        assert!(!log.answered(entry(4, 7, 15)));
        assert_eq!(log.len(), 1);
        log.durable(8, 5);
        assert!(log.is_empty());
        assert_eq!(log.min_seq(), None);
    }

    #[test]
    fn a_lost_process_is_checked_then_replayed_in_order_or_kept() {
        let mut log = ReplayLog::default();
        log.lost(7);
        assert!(!log.has_suspects(), "nothing kept: nothing to look at");
        for (seq, lsn) in [(1, 10), (2, 11), (3, 12)] {
            log.answered(entry(seq, 7, lsn));
        }
        log.answered(entry(9, 8, 1));
        log.lost(7);
        assert_eq!(log.next_suspect(), Some((7, "a:1".into())));
        // Gone: its three entries, in order; the other process's stays.
        let taken = log.take_gone(7);
        assert_eq!(
            taken.iter().map(|(_, e)| e.req.seq).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(log.len(), 1);
        // The first replayed, the others did not reach a server: kept for later.
        log.replayed(taken[0].0, &taken[0].1);
        log.put_back(taken[1..].to_vec());
        assert_eq!(log.min_seq(), Some(2));
        assert_eq!(log.next_suspect(), Some((7, "a:1".into())));
        // A late entry from a gone process is replayed too.
        let mut log = ReplayLog::default();
        log.answered(entry(1, 7, 10));
        log.lost(7);
        log.take_gone(7);
        assert!(!log.has_suspects());
        log.answered(entry(2, 7, 11));
        assert!(log.has_suspects());
    }

    /// A sync point (fsync) waits for changes taken to be replayed as for those kept: the
    /// hosts test `kill` read back after a directory fsync that had returned while the
    /// replays of a killed server's last creates still waited for its tables' new owner,
    /// and found them missing.
    #[test]
    fn a_sync_point_waits_for_replays_in_progress() {
        let mut log = ReplayLog::default();
        log.answered(entry(1, 7, 10));
        log.answered(entry(2, 7, 11));
        let upto = log.order_now();
        log.lost(7);
        let taken = log.take_gone(7);
        assert!(log.is_empty(), "taken out of the kept entries");
        assert!(
            !log.has_suspects(),
            "nothing left for the replayer to look at"
        );
        assert!(
            log.replays_owed(),
            "but requests must not overtake the replays"
        );
        assert!(!log.clear_before(upto), "being replayed: not clear yet");
        log.replayed(taken[0].0, &taken[0].1);
        assert!(!log.clear_before(upto), "one replay still to run");
        // Not reached: back among the kept entries, still owed.
        log.put_back(taken[1..].to_vec());
        assert!(!log.clear_before(upto));
        let taken = log.take_gone(7);
        log.replayed(taken[0].0, &taken[0].1);
        assert!(log.clear_before(upto), "every replay ran");
        assert!(!log.replays_owed());
    }

    #[test]
    fn a_process_still_there_keeps_its_entries_until_a_sync() {
        let mut log = ReplayLog::default();
        log.answered(entry(1, 7, 10));
        log.answered(entry(2, 7, 11));
        log.lost(7);
        log.alive(7);
        assert!(!log.has_suspects());
        let upto = log.order_now();
        log.answered(entry(3, 7, 12));
        assert!(!log.clear_before(upto));
        log.durable_before(7, upto);
        assert!(log.clear_before(upto));
        assert_eq!(log.len(), 1);
    }
}
