//! A server's participant side: locks a transaction's keys (wait-die), has the host check
//! the preconditions, journals the prepare record, votes, applies or discards on the
//! decision, and asks about decisions it is in doubt of. What it knows after a crash is
//! rebuilt from its journal by [`Participant::recover`]: in-doubt transactions get their
//! locks back and keep asking until they learn the outcome.

use std::collections::BTreeMap;

use kochab_proto::cluster::ServerId;

use super::locks::{Acquire, LockTable};
use super::{Age, Break, Effect, Msg, NoVote, Part, Record, TxnConfig, TxnError, TxnId, part_ok};

/// Most transactions one participant takes part in at once (waiting, prepared or
/// applying); beyond it new prepares die at once.
pub const TXNS_MAX: usize = 4_096;

/// What the participant is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A message from the server holding `from`'s journal.
    Message { from: ServerId, msg: Msg },
    /// The host's answer to [`Effect::Check`]: whether every precondition holds.
    Checked { txn: TxnId, ok: bool },
    /// A record this side appended is durable.
    Durable(Record),
    /// Time passed (the host calls it every few tens of ms).
    Tick,
    /// The origin's journals, from the attempt's incarnation on, are all sealed, and say
    /// whether it committed (`commit`: a commit decision is in one of them). Final, as a
    /// decision message is: a sealed journal takes no more records, and a later
    /// incarnation of the origin never decides an earlier one's attempt. How a part in
    /// doubt ends when its origin died for good (nobody answers its inquiries).
    OriginSealed { txn: TxnId, commit: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting {
        since_ms: u64,
    },
    Checking,
    /// The prepare record is appended, not yet durable; no vote sent.
    Preparing,
    /// Voted yes: in doubt until the decision arrives. Asks when it last asked (`None`:
    /// at the next tick).
    Prepared {
        asked_ms: Option<u64>,
    },
    /// Committed: applied, the outcome record not yet durable; locks still held.
    Applying,
}

#[derive(Clone, Debug)]
struct Txn {
    age: Age,
    part: Part,
    state: State,
}

/// How a transaction ended here (kept until its origin's watermark passes it, so a late
/// duplicate prepare is not taken for a new transaction and applied twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Committed,
    Aborted,
    VotedNo(NoVote),
}

/// The participant side of one server (one incarnation; a restart recovers a new one).
#[derive(Clone, Debug)]
pub struct Participant {
    server: ServerId,
    cfg: TxnConfig,
    locks: LockTable,
    txns: BTreeMap<TxnId, Txn>,
    finished: BTreeMap<TxnId, Fate>,
    /// Per origin, the highest watermark heard: attempts below it are over.
    watermarks: BTreeMap<ServerId, TxnId>,
}

impl Participant {
    /// A participant with an empty journal.
    pub fn new(server: ServerId, cfg: TxnConfig) -> Participant {
        Participant {
            server,
            cfg,
            locks: LockTable::default(),
            txns: BTreeMap::new(),
            finished: BTreeMap::new(),
            watermarks: BTreeMap::new(),
        }
    }

    /// Rebuilds the participant from its journal (every durable record, in order; the
    /// initiator side's records are skipped). Returns the committed transactions'
    /// [`Effect::Apply`]s in journal order, for a host that rebuilds its tables by replay.
    /// Transactions prepared without an outcome are in doubt: their locks are restored and
    /// the first tick asks their origins.
    pub fn recover(
        server: ServerId,
        cfg: TxnConfig,
        records: &[Record],
    ) -> Result<(Participant, Vec<Effect>), TxnError> {
        let mut p = Participant::new(server, cfg);
        let mut doubt: BTreeMap<TxnId, (Age, Part)> = BTreeMap::new();
        let mut replay = Vec::new();
        for r in records {
            match r {
                Record::Prepared { txn, age, part } | Record::Adopted { txn, age, part, .. } => {
                    if !part_ok(part) {
                        return Err(TxnError::Foreign(Box::new(r.clone())));
                    }
                    doubt.insert(*txn, (*age, part.clone()));
                    p.finished.remove(txn);
                }
                Record::Applied { txn, commit } => {
                    let Some((_, part)) = doubt.remove(txn) else {
                        return Err(TxnError::Foreign(Box::new(r.clone())));
                    };
                    if *commit {
                        replay.push(Effect::Apply {
                            txn: *txn,
                            mutations: part.mutations,
                        });
                        p.finished.insert(*txn, Fate::Committed);
                    } else {
                        p.finished.insert(*txn, Fate::Aborted);
                    }
                }
                Record::Decided { .. } | Record::Forgotten { .. } => {}
            }
        }
        for (txn, (age, part)) in doubt {
            if !p.locks.restore(txn, age, &part.locks) {
                return Err(TxnError::Foreign(Box::new(Record::Prepared {
                    txn,
                    age,
                    part,
                })));
            }
            let state = State::Prepared { asked_ms: None };
            p.txns.insert(txn, Txn { age, part, state });
        }
        Ok((p, replay))
    }

    /// Takes over an attempt another incarnation prepared and left in doubt, found in its
    /// journal by the server that recovered the tables of its keys (a failover, or a
    /// restart that got its tables back): in-doubt state travels with the tables, as locks
    /// do. Its locks are held from now on and its origin is asked at the next tick; its
    /// mutations are applied with this side's own part of the attempt, if it has one in
    /// doubt too (merged), or alone. The host journals the `Prepared` record again first,
    /// and acknowledges the commit for the server whose part it was (see the host).
    /// False, and nothing changes, if the part is malformed, the attempt is over by its
    /// origin's watermark or aborted here, this side's part is past its vote or not yet at
    /// it (then the attempt cannot have committed), or a key is held by another attempt.
    pub fn adopt(&mut self, txn: TxnId, age: Age, part: Part) -> bool {
        if !part_ok(&part) || self.below_watermark(txn) {
            return false;
        }
        if let Some(t) = self.txns.get_mut(&txn) {
            if let State::Waiting { .. } = t.state {
                // This side's own part waits for its locks, so it has not voted: it gives
                // way (its origin's resent prepare is answered no, see `on_prepare`, and
                // the attempt aborts), and the part in doubt is held here instead. Found
                // by the cluster simulation: refused, the adopted half of a commit was
                // lost.
                self.locks.cancel(txn);
                self.txns.remove(&txn);
            } else {
                if !matches!(t.state, State::Prepared { .. })
                    || t.part.locks.len() + part.locks.len() > crate::txn::KEYS_MAX * 2
                    || !self.locks.extend(txn, &part.locks)
                {
                    return false;
                }
                t.part.locks.extend(part.locks);
                t.part.mutations.extend(part.mutations);
                return true;
            }
        }
        match self.finished.get(&txn) {
            // Committed here: the adopted part still needs the commit, which the origin
            // keeps telling until every part acknowledged it.
            Some(Fate::Committed) | None => {}
            Some(Fate::Aborted | Fate::VotedNo(_)) => return false,
        }
        if !self.locks.restore(txn, age, &part.locks) {
            return false;
        }
        self.finished.remove(&txn);
        let state = State::Prepared { asked_ms: None };
        self.txns.insert(txn, Txn { age, part, state });
        true
    }

    /// The server this participant speaks for.
    pub fn server(&self) -> ServerId {
        self.server
    }

    /// Transactions here (any state), and how many of them are in doubt.
    pub fn load(&self) -> (usize, usize) {
        let doubt = self
            .txns
            .values()
            .filter(|t| matches!(t.state, State::Prepared { .. }))
            .count();
        (self.txns.len(), doubt)
    }

    /// The lock table (an operation outside any transaction asks it whether its keys are
    /// free).
    pub fn locks(&self) -> &LockTable {
        &self.locks
    }

    /// Nothing in progress and no lock held.
    pub fn idle(&self) -> bool {
        self.txns.is_empty() && self.locks.load() == (0, 0)
    }

    /// Handles one event at the host's time `now_ms`.
    pub fn step(&mut self, ev: Event, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        match ev {
            Event::Message { from: _, msg } => self.on_msg(msg, now_ms, &mut out),
            Event::Checked { txn, ok } => self.on_checked(txn, ok, &mut out),
            Event::Durable(r) => self.on_durable(&r, now_ms, &mut out),
            Event::Tick => self.on_tick(now_ms, &mut out),
            Event::OriginSealed { txn, commit } => self.on_decision(txn, commit, &mut out),
        }
        out
    }

    fn on_msg(&mut self, msg: Msg, now_ms: u64, out: &mut Vec<Effect>) {
        match msg {
            Msg::Prepare {
                txn,
                age,
                part,
                watermark,
            } => {
                self.watermark(txn.origin, watermark, out);
                self.on_prepare(txn, age, part, now_ms, out);
            }
            Msg::Decision {
                txn,
                commit,
                watermark,
            } => {
                self.watermark(txn.origin, watermark, out);
                self.on_decision(txn, commit, out);
            }
            Msg::Vote { .. } | Msg::Ack { .. } | Msg::Inquiry { .. } => {}
        }
    }

    fn on_prepare(&mut self, txn: TxnId, age: Age, part: Part, now_ms: u64, out: &mut Vec<Effect>) {
        if self.below_watermark(txn) {
            return; // Over: a late duplicate.
        }
        if let Some(fate) = self.finished.get(&txn) {
            if let Fate::VotedNo(no) = fate {
                vote(out, txn, Some(*no));
            }
            return;
        }
        if let Some(t) = self.txns.get(&txn) {
            let ours = part.locks.iter().all(|k| self.locks.holds_key(txn, k));
            match t.state {
                State::Prepared { .. } if ours => vote(out, txn, None), // Our vote was lost.
                // Known here only by a part taken over from another server's journal
                // (`adopt`): this side's own part was never locked, checked or journaled,
                // so it cannot vote yes; the attempt dies and its origin retries with a
                // new one (the part in doubt learns the abort by asking). The cluster
                // simulation: a yes vote here once committed the adopted half alone.
                State::Prepared { .. } => vote(out, txn, Some(NoVote::Died)),
                _ => {}
            }
            return;
        }
        if !part_ok(&part) {
            self.voted_no(txn, NoVote::Refused, out);
            return;
        }
        if self.txns.len() >= TXNS_MAX {
            self.voted_no(txn, NoVote::Died, out);
            return;
        }
        let state = match self.locks.acquire(txn, age, &part.locks) {
            Acquire::Granted => {
                out.push(Effect::Check {
                    txn,
                    part: part.clone(),
                });
                State::Checking
            }
            Acquire::Wait => State::Waiting { since_ms: now_ms },
            Acquire::Die => {
                self.voted_no(txn, NoVote::Died, out);
                return;
            }
        };
        self.txns.insert(txn, Txn { age, part, state });
    }

    fn on_checked(&mut self, txn: TxnId, ok: bool, out: &mut Vec<Effect>) {
        let Some(t) = self.txns.get_mut(&txn) else {
            return; // Aborted while the host checked.
        };
        if t.state != State::Checking {
            return;
        }
        if ok {
            t.state = State::Preparing;
            out.push(Effect::Append(Record::Prepared {
                txn,
                age: t.age,
                part: t.part.clone(),
            }));
        } else {
            self.txns.remove(&txn);
            self.release(txn, out);
            self.voted_no(txn, NoVote::Refused, out);
        }
    }

    fn on_durable(&mut self, r: &Record, now_ms: u64, out: &mut Vec<Effect>) {
        match r {
            Record::Prepared { txn, .. } => {
                if let Some(t) = self.txns.get_mut(txn)
                    && t.state == State::Preparing
                {
                    t.state = State::Prepared {
                        asked_ms: Some(now_ms),
                    };
                    vote(out, *txn, None);
                }
            }
            Record::Applied { txn, commit: true } => {
                if let Some(t) = self.txns.get(txn)
                    && t.state == State::Applying
                {
                    self.txns.remove(txn);
                    self.finished.insert(*txn, Fate::Committed);
                    self.release(*txn, out);
                    out.push(ack(*txn));
                }
            }
            _ => {}
        }
    }

    fn on_decision(&mut self, txn: TxnId, commit: bool, out: &mut Vec<Effect>) {
        let Some(t) = self.txns.get_mut(&txn) else {
            // Unknown: applied and forgotten already (its ack was lost), or trimmed below
            // the watermark; a transaction this side voted no on or aborted is never
            // acknowledged as committed.
            let refused = matches!(
                self.finished.get(&txn),
                Some(Fate::VotedNo(_) | Fate::Aborted)
            );
            if commit && !refused {
                out.push(ack(txn));
            }
            return;
        };
        match (commit, t.state) {
            (true, State::Prepared { .. }) => {
                t.state = State::Applying;
                out.push(Effect::Apply {
                    txn,
                    mutations: t.part.mutations.clone(),
                });
                out.push(Effect::Append(Record::Applied { txn, commit: true }));
                if self.cfg.broken == Some(Break::AckBeforeDurable) {
                    out.push(ack(txn));
                }
            }
            // Commit without our yes vote cannot come from a correct initiator; there is
            // nothing this side can apply without its prepare record.
            (true, _) | (false, State::Applying) => {}
            (false, _) => self.abort(txn, out),
        }
    }

    fn on_tick(&mut self, now_ms: u64, out: &mut Vec<Effect>) {
        let mut expired = Vec::new();
        for (txn, t) in self.txns.iter_mut() {
            match &mut t.state {
                State::Waiting { since_ms } if now_ms >= *since_ms + self.cfg.wait_max_ms => {
                    expired.push(*txn);
                }
                State::Prepared { asked_ms }
                    if asked_ms.is_none_or(|a| now_ms >= a + self.cfg.inquiry_ms) =>
                {
                    *asked_ms = Some(now_ms);
                    out.push(Effect::Send {
                        to: txn.origin,
                        msg: Msg::Inquiry { txn: *txn },
                    });
                }
                _ => {}
            }
        }
        for txn in expired {
            self.txns.remove(&txn);
            let moved = self.locks.cancel(txn);
            self.moved(moved, out);
            self.voted_no(txn, NoVote::Died, out);
        }
    }

    /// Learns that every attempt of `origin` below `w` is over: aborts the ones still
    /// here (none of them can have committed: a committed one is over only once every
    /// participant, this one too, acknowledged it) and forgets their fates.
    fn watermark(&mut self, origin: ServerId, w: TxnId, out: &mut Vec<Effect>) {
        if w.origin != origin || self.watermarks.get(&origin).is_some_and(|m| *m >= w) {
            return;
        }
        self.watermarks.insert(origin, w);
        let over: Vec<TxnId> = self
            .txns
            .iter()
            .filter(|(t, x)| t.origin == origin && **t < w && x.state != State::Applying)
            .map(|(t, _)| *t)
            .collect();
        for txn in over {
            self.abort(txn, out);
        }
        self.finished.retain(|t, _| t.origin != origin || *t >= w);
    }

    fn below_watermark(&self, txn: TxnId) -> bool {
        self.watermarks.get(&txn.origin).is_some_and(|w| txn < *w)
    }

    /// Ends `txn` here without applying it.
    fn abort(&mut self, txn: TxnId, out: &mut Vec<Effect>) {
        let Some(t) = self.txns.remove(&txn) else {
            return;
        };
        match t.state {
            State::Waiting { .. } => {
                let moved = self.locks.cancel(txn);
                self.moved(moved, out);
            }
            State::Checking => self.release(txn, out),
            State::Preparing | State::Prepared { .. } => {
                // Not waited for: if it is lost, recovery finds the transaction in doubt
                // and asks again.
                out.push(Effect::Append(Record::Applied { txn, commit: false }));
                self.release(txn, out);
            }
            State::Applying => unreachable!("a committed transaction is never aborted"),
        }
        self.finished.insert(txn, Fate::Aborted);
    }

    fn voted_no(&mut self, txn: TxnId, no: NoVote, out: &mut Vec<Effect>) {
        self.finished.insert(txn, Fate::VotedNo(no));
        vote(out, txn, Some(no));
    }

    fn release(&mut self, txn: TxnId, out: &mut Vec<Effect>) {
        let (keys, moved) = self.locks.release(txn);
        if !keys.is_empty() {
            out.push(Effect::Released { keys });
        }
        self.moved(moved, out);
    }

    /// Carries out what the lock table decided for waiters.
    fn moved(&mut self, moved: Vec<(TxnId, Acquire)>, out: &mut Vec<Effect>) {
        for (txn, verdict) in moved {
            match verdict {
                Acquire::Granted => {
                    if let Some(t) = self.txns.get_mut(&txn) {
                        t.state = State::Checking;
                        out.push(Effect::Check {
                            txn,
                            part: t.part.clone(),
                        });
                    }
                }
                Acquire::Die => {
                    self.txns.remove(&txn);
                    self.voted_no(txn, NoVote::Died, out);
                }
                Acquire::Wait => {}
            }
        }
    }
}

fn vote(out: &mut Vec<Effect>, txn: TxnId, no: Option<NoVote>) {
    out.push(Effect::Send {
        to: txn.origin,
        msg: Msg::Vote { txn, no },
    });
}

fn ack(txn: TxnId) -> Effect {
    Effect::Send {
        to: txn.origin,
        msg: Msg::Ack { txn },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::txn::{Expect, Key, Mutation, Write};

    const ORIGIN: ServerId = ServerId(7);

    fn t(seq: u64) -> TxnId {
        TxnId {
            origin: ORIGIN,
            epoch: 1,
            seq,
        }
    }

    fn age(seq: u64) -> Age {
        Age {
            start_ms: seq,
            first: t(seq),
        }
    }

    fn part(name: &str) -> Part {
        let key = Key::Entry {
            parent: 1,
            name: name.as_bytes().to_vec(),
        };
        Part {
            locks: vec![key.clone()],
            mutations: vec![Mutation {
                key,
                expect: Expect::Absent,
                write: Write::Put(vec![1]),
            }],
        }
    }

    fn prepare(seq: u64, name: &str, watermark: u64) -> Event {
        Event::Message {
            from: ORIGIN,
            msg: Msg::Prepare {
                txn: t(seq),
                age: age(seq),
                part: part(name),
                watermark: t(watermark),
            },
        }
    }

    fn decision(seq: u64, commit: bool, watermark: u64) -> Event {
        Event::Message {
            from: ORIGIN,
            msg: Msg::Decision {
                txn: t(seq),
                commit,
                watermark: t(watermark),
            },
        }
    }

    fn sent(effects: &[Effect]) -> Vec<Msg> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send { msg, .. } => Some(msg.clone()),
                _ => None,
            })
            .collect()
    }

    fn yes(seq: u64) -> Msg {
        Msg::Vote {
            txn: t(seq),
            no: None,
        }
    }

    /// Drives `seq` to a durable prepare and a yes vote.
    fn prepared(p: &mut Participant, seq: u64, name: &str) -> Record {
        let e = p.step(prepare(seq, name, 1), 0);
        assert!(matches!(e[..], [Effect::Check { .. }]), "{e:?}");
        let e = p.step(
            Event::Checked {
                txn: t(seq),
                ok: true,
            },
            0,
        );
        let [Effect::Append(r)] = &e[..] else {
            panic!("{e:?}")
        };
        let r = r.clone();
        assert_eq!(sent(&p.step(Event::Durable(r.clone()), 0)), vec![yes(seq)]);
        r
    }

    #[test]
    fn votes_yes_only_once_prepared_is_durable_then_commits() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        p.step(prepare(1, "a", 1), 0);
        let e = p.step(
            Event::Checked {
                txn: t(1),
                ok: true,
            },
            0,
        );
        assert!(sent(&e).is_empty(), "no vote before the record is durable");
        let Some(Effect::Append(r)) = e.into_iter().next() else {
            panic!()
        };
        assert_eq!(sent(&p.step(Event::Durable(r), 0)), vec![yes(1)]);
        let e = p.step(decision(1, true, 1), 0);
        assert!(matches!(e[0], Effect::Apply { .. }));
        assert!(sent(&e).is_empty(), "no ack before the outcome is durable");
        assert!(p.locks().holds(t(1)));
        let e = p.step(
            Event::Durable(Record::Applied {
                txn: t(1),
                commit: true,
            }),
            0,
        );
        assert_eq!(sent(&e), vec![Msg::Ack { txn: t(1) }]);
        assert!(p.idle());
        // A late duplicate prepare is not a new transaction.
        assert!(p.step(prepare(1, "a", 1), 0).is_empty());
        // A repeated commit is acknowledged again.
        assert_eq!(
            sent(&p.step(decision(1, true, 1), 0)),
            vec![Msg::Ack { txn: t(1) }]
        );
    }

    #[test]
    fn a_failed_check_votes_no_and_releases() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        p.step(prepare(1, "a", 1), 0);
        let e = p.step(
            Event::Checked {
                txn: t(1),
                ok: false,
            },
            0,
        );
        assert_eq!(
            sent(&e),
            vec![Msg::Vote {
                txn: t(1),
                no: Some(NoVote::Refused)
            }]
        );
        assert!(p.idle());
        assert!(
            sent(&p.step(decision(1, true, 1), 0)).is_empty(),
            "never acknowledges a commit it voted no on"
        );
    }

    #[test]
    fn in_doubt_after_a_crash_keeps_its_locks_and_asks() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        let r = prepared(&mut p, 1, "a");
        let (mut q, replay) =
            Participant::recover(ServerId(1), TxnConfig::default(), &[r]).expect("recover");
        assert!(replay.is_empty());
        assert_eq!(q.load(), (1, 1));
        let key = &part("a").locks[0];
        assert!(q.locks().is_locked(key));
        assert_eq!(
            sent(&q.step(Event::Tick, 10)),
            vec![Msg::Inquiry { txn: t(1) }]
        );
        assert!(
            sent(&q.step(Event::Tick, 20)).is_empty(),
            "asks every inquiry_ms"
        );
        let e = q.step(decision(1, false, 1), 30);
        assert!(e.contains(&Effect::Append(Record::Applied {
            txn: t(1),
            commit: false
        })));
        assert!(q.idle());
    }

    #[test]
    fn recovery_replays_commits_in_journal_order() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        let r1 = prepared(&mut p, 1, "a");
        let r2 = prepared(&mut p, 2, "b");
        let done = |seq, commit| Record::Applied {
            txn: t(seq),
            commit,
        };
        let journal = [r1, r2, done(2, true), done(1, false)];
        let (q, replay) =
            Participant::recover(ServerId(1), TxnConfig::default(), &journal).expect("recover");
        assert!(q.idle());
        assert_eq!(
            replay,
            vec![Effect::Apply {
                txn: t(2),
                mutations: part("b").mutations
            }]
        );
        let orphan = [done(3, true)];
        assert!(Participant::recover(ServerId(1), TxnConfig::default(), &orphan).is_err());
    }

    #[test]
    fn a_watermark_past_an_in_doubt_attempt_aborts_it() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        prepared(&mut p, 1, "a");
        // Some other attempt's prepare says everything below 2 is over.
        p.step(prepare(3, "b", 2), 0);
        assert_eq!(p.load(), (1, 0), "only attempt 3 is left");
        assert!(!p.locks().is_locked(&part("a").locks[0]));
        assert!(
            p.step(prepare(1, "a", 1), 0).is_empty(),
            "below the watermark: a late duplicate"
        );
    }

    #[test]
    fn a_sealed_origin_decides_what_is_in_doubt() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        prepared(&mut p, 1, "a");
        prepared(&mut p, 2, "b");
        // No commit decision in the sealed journals: aborted, its locks gone.
        p.step(
            Event::OriginSealed {
                txn: t(1),
                commit: false,
            },
            0,
        );
        assert!(!p.locks().is_locked(&part("a").locks[0]));
        // A commit decision there: applied as if the decision had arrived.
        let e = p.step(
            Event::OriginSealed {
                txn: t(2),
                commit: true,
            },
            0,
        );
        assert!(
            matches!(
                e[..],
                [
                    Effect::Apply { .. },
                    Effect::Append(Record::Applied { commit: true, .. })
                ]
            ),
            "{e:?}"
        );
    }

    #[test]
    fn an_adopted_attempt_is_in_doubt_here_until_its_origin_answers() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        let empty = Part {
            locks: vec![],
            mutations: vec![],
        };
        assert!(!p.adopt(t(1), age(1), empty), "malformed");
        assert!(p.adopt(t(2), age(2), part("a")));
        assert!(!p.adopt(t(2), age(2), part("a")), "known already");
        assert!(!p.adopt(t(3), age(3), part("a")), "a key is held");
        assert!(
            p.adopt(t(2), age(2), part("b")),
            "merged with its other part"
        );
        assert!(p.locks().is_locked(&part("b").locks[0]));
        assert_eq!(p.load(), (1, 1));
        assert!(p.locks().is_locked(&part("a").locks[0]));
        assert_eq!(
            sent(&p.step(Event::Tick, 0)),
            vec![Msg::Inquiry { txn: t(2) }],
            "asks its origin"
        );
        let e = p.step(decision(2, true, 1), 0);
        let Effect::Apply { mutations, .. } = &e[0] else {
            panic!("{e:?}")
        };
        assert_eq!(mutations.len(), 2, "both parts");
        // Committed here already: an adopted part of it is in doubt until told again.
        p.step(
            Event::Durable(Record::Applied {
                txn: t(2),
                commit: true,
            }),
            0,
        );
        assert!(p.adopt(t(2), age(2), part("c")));
        assert!(p.locks().is_locked(&part("c").locks[0]));
        // Over by the watermark: not taken.
        let mut q = Participant::new(ServerId(1), TxnConfig::default());
        q.step(prepare(5, "b", 4), 0);
        assert!(!q.adopt(t(2), age(2), part("a")));
        assert!(!q.locks().is_locked(&part("a").locks[0]));
    }

    #[test]
    fn a_waiter_dies_after_wait_max() {
        let cfg = TxnConfig::default();
        let mut p = Participant::new(ServerId(1), cfg);
        prepared(&mut p, 1, "a");
        // Attempt 0 is older than 1: it waits.
        let e = p.step(
            Event::Message {
                from: ORIGIN,
                msg: Msg::Prepare {
                    txn: t(9),
                    age: age(0),
                    part: part("a"),
                    watermark: t(1),
                },
            },
            0,
        );
        assert!(e.is_empty());
        assert!(
            sent(&p.step(Event::Tick, cfg.wait_max_ms - 1))
                .iter()
                .all(|m| matches!(m, Msg::Inquiry { .. }))
        );
        let e = p.step(Event::Tick, cfg.wait_max_ms);
        assert!(sent(&e).contains(&Msg::Vote {
            txn: t(9),
            no: Some(NoVote::Died)
        }));
    }

    /// Found by the cluster simulation: a part taken over from a failed server's journal
    /// makes the attempt known here; this side's own prepare, arriving after it, must not
    /// be taken for a duplicate (a yes vote for a part never locked, checked or
    /// journaled, which then committed the adopted half alone). A duplicate of a part
    /// that is prepared here is still answered yes.
    #[test]
    fn an_own_prepare_after_an_adopted_part_is_no_duplicate() {
        let mut p = Participant::new(ServerId(1), TxnConfig::default());
        assert!(p.adopt(t(2), age(2), part("theirs")));
        let e = p.step(prepare(2, "ours", 1), 0);
        assert_eq!(
            sent(&e),
            vec![Msg::Vote {
                txn: t(2),
                no: Some(NoVote::Died)
            }],
            "{e:?}"
        );
        assert!(
            !e.iter().any(|x| matches!(x, Effect::Check { .. })),
            "{e:?}"
        );
        // The adopted part stays in doubt (its origin's answer decides it).
        assert!(p.locks().is_locked(&part("theirs").locks[0]));
        // The adopted part's own duplicate is answered yes.
        let e = p.step(prepare(2, "theirs", 1), 0);
        assert_eq!(sent(&e), vec![yes(2)], "{e:?}");
    }
}
