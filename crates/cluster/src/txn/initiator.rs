//! A server's initiator side: runs a client's multi-server operation as attempts of a
//! two-phase commit, journals the decision (the commit point) before telling anyone,
//! keeps resending it until every participant acknowledged, answers inquiries, and keeps
//! the reply cache that makes a client's retry of the same (client, seq) get the same
//! answer. Presumed abort: an attempt without a durable commit decision is aborted, and
//! after a crash [`Initiator::recover`] knows only the decisions in its journal.
//!
//! An attempt that dies (wait-die, a participant's wait limit) or times out before the
//! decision is retried with a new id and the same age; after `attempts_max` the client
//! is told [`Outcome::Busy`] and may ask again.

use std::collections::{BTreeMap, BTreeSet};

use kochab_proto::cluster::ServerId;

use super::{
    Age, Break, ClientId, Decision, Effect, Msg, NoVote, Outcome, Plan, Record, TxnConfig,
    TxnError, TxnId, plan_ok,
};

/// Most requests in progress at one initiator; beyond it clients are told Busy.
pub const ACTIVE_MAX: usize = 1_024;
/// Answers kept per client: a client has at most a few requests outstanding, and asks
/// again about one only until it has the answer, so the last 64 cover every retry.
pub const REPLIES_PER_CLIENT: usize = 64;

/// What the initiator is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A client's operation (or its retry: same client and seq, same plan).
    Request {
        client: ClientId,
        seq: u64,
        plan: Plan,
    },
    /// A message from the server holding `from`'s journal.
    Message { from: ServerId, msg: Msg },
    /// A record this side appended is durable.
    Durable(Record),
    /// Time passed (the host calls it every few tens of ms).
    Tick,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Preparing {
        yes: BTreeSet<ServerId>,
        started_ms: u64,
        sent_ms: u64,
    },
    /// The commit decision is appended, not yet durable.
    Deciding,
    /// The refusal is appended, not yet durable.
    Refusing,
    /// The commit is durable and told; waiting for every participant's ack.
    Committed {
        acked: BTreeSet<ServerId>,
        sent_ms: Option<u64>,
    },
    /// The attempt died; the next starts at `until_ms`.
    Backoff { until_ms: u64 },
}

#[derive(Clone, Debug)]
struct Active {
    client: ClientId,
    seq: u64,
    participants: Vec<ServerId>,
    /// `None` for a commit recovered from the journal (it never prepares again).
    plan: Option<Plan>,
    age: Age,
    attempt: u32,
    phase: Phase,
    /// Servers that asked about this attempt: one that is no participant holds a part it
    /// took over from a failed one, and acknowledges for it. A commit is resent to them
    /// too: the owner's new incarnation knows nothing of that part (the cluster
    /// simulation: a lost acknowledgement of a part taken over, its origin telling the
    /// owner forever).
    askers: BTreeSet<ServerId>,
}

/// The initiator side of one server's journal, for one incarnation.
#[derive(Clone, Debug)]
pub struct Initiator {
    server: ServerId,
    epoch: u64,
    cfg: TxnConfig,
    next_seq: u64,
    active: BTreeMap<TxnId, Active>,
    by_request: BTreeMap<(ClientId, u64), TxnId>,
    replies: BTreeMap<ClientId, BTreeMap<u64, Outcome>>,
}

impl Initiator {
    /// The initiator of `server`'s journal, started fresh. `epoch` must be larger than
    /// that of every earlier incarnation that wrote to or sent for this journal.
    pub fn new(server: ServerId, epoch: u64, cfg: TxnConfig) -> Initiator {
        Initiator {
            server,
            epoch,
            cfg,
            next_seq: 0,
            active: BTreeMap::new(),
            by_request: BTreeMap::new(),
            replies: BTreeMap::new(),
        }
    }

    /// Rebuilds the initiator of `server`'s journal from its durable records (in order;
    /// the participant side's are skipped), as a new incarnation `epoch`. Attempts
    /// without a commit decision are over (presumed abort); commits not yet forgotten are
    /// told again at the first tick.
    pub fn recover(
        server: ServerId,
        epoch: u64,
        cfg: TxnConfig,
        records: &[Record],
    ) -> Result<Initiator, TxnError> {
        let mut init = Initiator::new(server, epoch, cfg);
        for r in records {
            let txn = r.txn();
            if txn.origin == server && txn.epoch >= epoch {
                return Err(TxnError::StaleEpoch {
                    given: epoch,
                    seen: txn.epoch,
                });
            }
            match r {
                Record::Decided {
                    txn,
                    client,
                    seq,
                    decision,
                    participants,
                } => {
                    if txn.origin != server {
                        return Err(TxnError::Foreign(Box::new(r.clone())));
                    }
                    let outcome = match decision {
                        Decision::Commit => Outcome::Committed,
                        Decision::Refuse => Outcome::Refused,
                    };
                    init.remember(*client, *seq, outcome);
                    if *decision == Decision::Commit {
                        init.active.insert(
                            *txn,
                            Active {
                                client: *client,
                                seq: *seq,
                                participants: participants.clone(),
                                plan: None,
                                age: Age {
                                    start_ms: 0,
                                    first: *txn,
                                },
                                attempt: 0,
                                phase: Phase::Committed {
                                    acked: BTreeSet::new(),
                                    sent_ms: None,
                                },
                                askers: BTreeSet::new(),
                            },
                        );
                    }
                }
                Record::Forgotten { txn } => {
                    init.active.remove(txn);
                }
                Record::Prepared { .. } | Record::Adopted { .. } | Record::Applied { .. } => {}
            }
        }
        Ok(init)
    }

    /// The journal this initiator speaks for.
    pub fn server(&self) -> ServerId {
        self.server
    }

    /// Requests in progress (including commits waiting for acknowledgements).
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Every attempt of this origin below it is over: the lowest one in progress, or the
    /// next id if none is.
    pub fn watermark(&self) -> TxnId {
        self.active.keys().next().copied().unwrap_or(TxnId {
            origin: self.server,
            epoch: self.epoch,
            seq: self.next_seq,
        })
    }

    /// Handles one event at the host's time `now_ms`.
    pub fn step(&mut self, ev: Event, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        match ev {
            Event::Request { client, seq, plan } => {
                self.on_request(client, seq, plan, now_ms, &mut out)
            }
            Event::Message { from, msg } => self.on_msg(from, msg, now_ms, &mut out),
            Event::Durable(r) => self.on_durable(&r, now_ms, &mut out),
            Event::Tick => self.on_tick(now_ms, &mut out),
        }
        out
    }

    fn on_request(
        &mut self,
        client: ClientId,
        seq: u64,
        plan: Plan,
        now_ms: u64,
        out: &mut Vec<Effect>,
    ) {
        if let Some(outcome) = self.cached(client, seq) {
            out.push(reply(client, seq, outcome));
            return;
        }
        if self.by_request.contains_key(&(client, seq)) {
            return; // In progress: answered when decided.
        }
        let outcome = if !plan_ok(&plan) {
            Outcome::Invalid
        } else if self.active.len() >= ACTIVE_MAX {
            Outcome::Busy
        } else {
            let txn = self.next_id();
            let age = Age {
                start_ms: now_ms,
                first: txn,
            };
            let a = Active {
                client,
                seq,
                participants: plan.iter().map(|(s, _)| *s).collect(),
                plan: Some(plan),
                age,
                attempt: 1,
                phase: Phase::Backoff { until_ms: now_ms },
                askers: BTreeSet::new(),
            };
            self.start(txn, a, now_ms, out);
            return;
        };
        out.push(reply(client, seq, outcome));
    }

    /// The cached answer to (client, seq), `TooOld` if it fell out of the cache.
    fn cached(&self, client: ClientId, seq: u64) -> Option<Outcome> {
        let c = self.replies.get(&client)?;
        if let Some(o) = c.get(&seq) {
            return Some(*o);
        }
        let full = c.len() >= REPLIES_PER_CLIENT;
        (full && c.keys().next().is_some_and(|first| seq < *first)).then_some(Outcome::TooOld)
    }

    fn remember(&mut self, client: ClientId, seq: u64, outcome: Outcome) {
        let c = self.replies.entry(client).or_default();
        c.insert(seq, outcome);
        while c.len() > REPLIES_PER_CLIENT {
            c.pop_first();
        }
    }

    fn next_id(&mut self) -> TxnId {
        self.next_seq += 1;
        TxnId {
            origin: self.server,
            epoch: self.epoch,
            seq: self.next_seq,
        }
    }

    /// Starts attempt `txn` of `a`: prepares go to every participant.
    fn start(&mut self, txn: TxnId, mut a: Active, now_ms: u64, out: &mut Vec<Effect>) {
        a.phase = Phase::Preparing {
            yes: BTreeSet::new(),
            started_ms: now_ms,
            sent_ms: now_ms,
        };
        a.askers.clear();
        self.by_request.insert((a.client, a.seq), txn);
        self.active.insert(txn, a);
        self.send_prepares(txn, out);
    }

    fn send_prepares(&self, txn: TxnId, out: &mut Vec<Effect>) {
        let Some(a) = self.active.get(&txn) else {
            return;
        };
        let (Phase::Preparing { yes, .. }, Some(plan)) = (&a.phase, &a.plan) else {
            return;
        };
        let watermark = self.watermark();
        for (to, part) in plan.iter().filter(|(s, _)| !yes.contains(s)) {
            out.push(Effect::Send {
                to: *to,
                msg: Msg::Prepare {
                    txn,
                    age: a.age,
                    part: part.clone(),
                    watermark,
                },
            });
        }
    }

    fn on_msg(&mut self, from: ServerId, msg: Msg, now_ms: u64, out: &mut Vec<Effect>) {
        match msg {
            Msg::Vote { txn, no } => self.on_vote(from, txn, no, now_ms, out),
            Msg::Ack { txn } => self.on_ack(from, txn, out),
            Msg::Inquiry { txn } => self.on_inquiry(from, txn, out),
            Msg::Prepare { .. } | Msg::Decision { .. } => {}
        }
    }

    fn on_vote(
        &mut self,
        from: ServerId,
        txn: TxnId,
        no: Option<NoVote>,
        now_ms: u64,
        out: &mut Vec<Effect>,
    ) {
        let Some(a) = self.active.get_mut(&txn) else {
            return;
        };
        let Phase::Preparing { yes, .. } = &mut a.phase else {
            return; // Decided already: a late or duplicate vote.
        };
        if !a.participants.contains(&from) {
            return;
        }
        match no {
            None => {
                yes.insert(from);
                let enough = if self.cfg.broken == Some(Break::CommitBeforeAllPrepared) {
                    !yes.is_empty()
                } else {
                    yes.len() == a.participants.len()
                };
                if enough {
                    a.phase = Phase::Deciding;
                    out.push(Effect::Append(decided(txn, a, Decision::Commit)));
                }
            }
            Some(NoVote::Refused) => {
                a.phase = Phase::Refusing;
                out.push(Effect::Append(decided(txn, a, Decision::Refuse)));
                self.tell_abort(txn, out);
            }
            Some(NoVote::Died) => self.attempt_over(txn, now_ms, out),
        }
    }

    /// The attempt will never commit: tell the participants (best effort; whoever misses
    /// it asks, or learns from the watermark) and retry after a backoff, or give up.
    fn attempt_over(&mut self, txn: TxnId, now_ms: u64, out: &mut Vec<Effect>) {
        self.tell_abort(txn, out);
        let Some(a) = self.active.get_mut(&txn) else {
            return;
        };
        if a.attempt >= self.cfg.attempts_max {
            let (client, seq) = (a.client, a.seq);
            self.end(txn);
            out.push(reply(client, seq, Outcome::Busy));
            return;
        }
        a.phase = Phase::Backoff {
            until_ms: now_ms + self.cfg.backoff_ms * u64::from(a.attempt),
        };
    }

    fn tell_abort(&self, txn: TxnId, out: &mut Vec<Effect>) {
        let Some(a) = self.active.get(&txn) else {
            return;
        };
        let watermark = self.watermark();
        for to in &a.participants {
            out.push(Effect::Send {
                to: *to,
                msg: Msg::Decision {
                    txn,
                    commit: false,
                    watermark,
                },
            });
        }
    }

    fn end(&mut self, txn: TxnId) {
        if let Some(a) = self.active.remove(&txn) {
            self.by_request.remove(&(a.client, a.seq));
        }
    }

    fn on_durable(&mut self, r: &Record, now_ms: u64, out: &mut Vec<Effect>) {
        let Record::Decided { txn, decision, .. } = r else {
            return;
        };
        let Some(a) = self.active.get_mut(txn) else {
            return;
        };
        let (client, seq) = (a.client, a.seq);
        match (decision, &a.phase) {
            (Decision::Commit, Phase::Deciding) => {
                a.phase = Phase::Committed {
                    acked: BTreeSet::new(),
                    sent_ms: Some(now_ms),
                };
                self.remember(client, seq, Outcome::Committed);
                self.tell_commit(*txn, out);
                out.push(reply(client, seq, Outcome::Committed));
            }
            (Decision::Refuse, Phase::Refusing) => {
                self.remember(client, seq, Outcome::Refused);
                self.end(*txn);
                out.push(reply(client, seq, Outcome::Refused));
            }
            _ => {}
        }
    }

    /// Sends the commit to every participant that has not acknowledged it.
    fn tell_commit(&self, txn: TxnId, out: &mut Vec<Effect>) {
        let Some(a) = self.active.get(&txn) else {
            return;
        };
        let Phase::Committed { acked, .. } = &a.phase else {
            return;
        };
        let watermark = self.watermark();
        let unacked = a.participants.iter().filter(|s| !acked.contains(s));
        let askers = a.askers.iter().filter(|s| !a.participants.contains(s));
        for to in unacked.chain(askers) {
            out.push(Effect::Send {
                to: *to,
                msg: Msg::Decision {
                    txn,
                    commit: true,
                    watermark,
                },
            });
        }
    }

    fn on_ack(&mut self, from: ServerId, txn: TxnId, out: &mut Vec<Effect>) {
        let Some(a) = self.active.get_mut(&txn) else {
            return;
        };
        let Phase::Committed { acked, .. } = &mut a.phase else {
            return;
        };
        if !a.participants.contains(&from) {
            return;
        }
        acked.insert(from);
        if acked.len() == a.participants.len() {
            // Not waited for: if it is lost, recovery tells the commit again and the
            // participants acknowledge what they no longer know.
            out.push(Effect::Append(Record::Forgotten { txn }));
            self.end(txn);
        }
    }

    fn on_inquiry(&mut self, from: ServerId, txn: TxnId, out: &mut Vec<Effect>) {
        if txn.origin != self.server {
            return;
        }
        if let Some(a) = self.active.get_mut(&txn) {
            a.askers.insert(from);
        }
        let commit = match self.active.get(&txn).map(|a| &a.phase) {
            Some(Phase::Committed { .. }) => true,
            // Undecided yet: it may still commit, so no answer; asked again later.
            Some(Phase::Preparing { .. } | Phase::Deciding) => return,
            // Refused, died, or unknown: presumed abort. An unknown attempt of this
            // incarnation ended without a commit or was committed and acknowledged by all
            // (then the asker is not in doubt and ignores the answer); one of an earlier
            // incarnation without a commit record can no longer commit.
            Some(Phase::Refusing | Phase::Backoff { .. }) | None => false,
        };
        out.push(Effect::Send {
            to: from,
            msg: Msg::Decision {
                txn,
                commit,
                watermark: self.watermark(),
            },
        });
    }

    fn on_tick(&mut self, now_ms: u64, out: &mut Vec<Effect>) {
        let ids: Vec<TxnId> = self.active.keys().copied().collect();
        for txn in ids {
            let Some(a) = self.active.get_mut(&txn) else {
                continue;
            };
            match &mut a.phase {
                Phase::Preparing {
                    started_ms,
                    sent_ms,
                    ..
                } => {
                    if now_ms >= *started_ms + self.cfg.prepare_timeout_ms {
                        self.attempt_over(txn, now_ms, out);
                    } else if now_ms >= *sent_ms + self.cfg.resend_ms {
                        *sent_ms = now_ms;
                        self.send_prepares(txn, out);
                    }
                }
                Phase::Committed { sent_ms, .. } => {
                    if sent_ms.is_none_or(|s| now_ms >= s + self.cfg.resend_ms) {
                        *sent_ms = Some(now_ms);
                        self.tell_commit(txn, out);
                    }
                }
                Phase::Backoff { until_ms } if now_ms >= *until_ms => {
                    let Some(mut a) = self.active.remove(&txn) else {
                        continue;
                    };
                    a.attempt += 1;
                    let next = self.next_id();
                    self.start(next, a, now_ms, out);
                }
                Phase::Backoff { .. } | Phase::Deciding | Phase::Refusing => {}
            }
        }
    }
}

fn reply(client: ClientId, seq: u64, outcome: Outcome) -> Effect {
    Effect::Reply {
        client,
        seq,
        outcome,
    }
}

fn decided(txn: TxnId, a: &Active, decision: Decision) -> Record {
    Record::Decided {
        txn,
        client: a.client,
        seq: a.seq,
        decision,
        participants: a.participants.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::txn::{Expect, Key, Mutation, Part, Write};

    const ME: ServerId = ServerId(0);
    const A: ServerId = ServerId(1);
    const B: ServerId = ServerId(2);

    fn plan() -> Plan {
        let part = |p: u64| Part {
            locks: vec![Key::Inode(p)],
            mutations: vec![Mutation {
                key: Key::Inode(p),
                expect: Expect::Any,
                write: Write::Delete,
            }],
        };
        vec![(A, part(1)), (B, part(2))]
    }

    fn request(seq: u64) -> Event {
        Event::Request {
            client: 5,
            seq,
            plan: plan(),
        }
    }

    fn from(s: ServerId, msg: Msg) -> Event {
        Event::Message { from: s, msg }
    }

    fn prepares(e: &[Effect]) -> Vec<(ServerId, TxnId, Age)> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Send {
                    to,
                    msg: Msg::Prepare { txn, age, .. },
                } => Some((*to, *txn, *age)),
                _ => None,
            })
            .collect()
    }

    fn replies(e: &[Effect]) -> Vec<Outcome> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Reply { outcome, .. } => Some(*outcome),
                _ => None,
            })
            .collect()
    }

    fn yes(txn: TxnId) -> Msg {
        Msg::Vote { txn, no: None }
    }

    /// Runs a request to a durable commit; returns its attempt and the decision record.
    fn committed(i: &mut Initiator, seq: u64) -> (TxnId, Record) {
        let p = prepares(&i.step(request(seq), 0));
        assert_eq!(p.len(), 2);
        let txn = p[0].1;
        assert!(i.step(from(A, yes(txn)), 1).is_empty());
        let e = i.step(from(B, yes(txn)), 1);
        let [Effect::Append(r)] = &e[..] else {
            panic!("{e:?}")
        };
        assert!(
            replies(&e).is_empty(),
            "no reply before the decision is durable"
        );
        let r = r.clone();
        let e = i.step(Event::Durable(r.clone()), 2);
        assert_eq!(replies(&e), vec![Outcome::Committed]);
        (txn, r)
    }

    #[test]
    fn commits_after_all_yes_votes_and_forgets_after_all_acks() {
        let mut i = Initiator::new(ME, 1, TxnConfig::default());
        let (txn, _) = committed(&mut i, 1);
        // The answer to a retry comes from the reply cache.
        assert_eq!(replies(&i.step(request(1), 3)), vec![Outcome::Committed]);
        assert!(i.step(from(A, Msg::Ack { txn }), 3).is_empty());
        let e = i.step(from(B, Msg::Ack { txn }), 3);
        assert_eq!(e, vec![Effect::Append(Record::Forgotten { txn })]);
        assert_eq!(i.active(), 0);
        assert_eq!(replies(&i.step(request(1), 4)), vec![Outcome::Committed]);
    }

    #[test]
    fn a_dead_attempt_is_retried_with_its_age() {
        let cfg = TxnConfig::default();
        let mut i = Initiator::new(ME, 1, cfg);
        let p = prepares(&i.step(request(1), 10));
        let (txn, age) = (p[0].1, p[0].2);
        let e = i.step(
            from(
                A,
                Msg::Vote {
                    txn,
                    no: Some(NoVote::Died),
                },
            ),
            11,
        );
        assert!(e.iter().all(|e| matches!(
            e,
            Effect::Send {
                msg: Msg::Decision { commit: false, .. },
                ..
            }
        )));
        assert!(i.step(request(1), 12).is_empty(), "in progress");
        let p = prepares(&i.step(Event::Tick, 11 + cfg.backoff_ms));
        assert_eq!(p.len(), 2);
        assert_ne!(p[0].1, txn);
        assert_eq!(p[0].2, age);
    }

    #[test]
    fn times_out_before_the_decision_only() {
        let cfg = TxnConfig {
            attempts_max: 1,
            ..TxnConfig::default()
        };
        let mut i = Initiator::new(ME, 1, cfg);
        i.step(request(1), 0);
        let e = i.step(Event::Tick, cfg.prepare_timeout_ms);
        assert_eq!(replies(&e), vec![Outcome::Busy]);
        assert_eq!(i.active(), 0);
        let (txn, _) = committed(&mut i, 2);
        let e = i.step(Event::Tick, 10 * cfg.prepare_timeout_ms);
        assert!(replies(&e).is_empty(), "a decided commit never times out");
        assert!(e.iter().all(|e| matches!(
            e,
            Effect::Send {
                msg: Msg::Decision { commit: true, .. },
                ..
            }
        )));
        assert_eq!(i.active(), 1, "{txn:?} waits for its acks");
    }

    #[test]
    fn a_refusal_is_journaled_and_cached() {
        let mut i = Initiator::new(ME, 1, TxnConfig::default());
        let txn = prepares(&i.step(request(1), 0))[0].1;
        let no = Msg::Vote {
            txn,
            no: Some(NoVote::Refused),
        };
        let e = i.step(from(B, no), 1);
        let Some(Effect::Append(r)) = e.first() else {
            panic!("{e:?}")
        };
        assert!(replies(&e).is_empty());
        let e = i.step(Event::Durable(r.clone()), 2);
        assert_eq!(replies(&e), vec![Outcome::Refused]);
        assert_eq!(replies(&i.step(request(1), 3)), vec![Outcome::Refused]);
        let r = i.step(from(A, Msg::Inquiry { txn }), 3);
        assert!(matches!(
            r[..],
            [Effect::Send {
                msg: Msg::Decision { commit: false, .. },
                ..
            }]
        ));
    }

    #[test]
    fn inquiries_are_answered_only_once_decided() {
        let mut i = Initiator::new(ME, 1, TxnConfig::default());
        let txn = prepares(&i.step(request(1), 0))[0].1;
        assert!(i.step(from(A, Msg::Inquiry { txn }), 1).is_empty());
        let stranger = TxnId { seq: 99, ..txn };
        let e = i.step(from(A, Msg::Inquiry { txn: stranger }), 1);
        assert!(matches!(
            e[..],
            [Effect::Send {
                msg: Msg::Decision { commit: false, .. },
                ..
            }]
        ));
    }

    #[test]
    fn recovery_tells_undecided_abort_and_commits_again() {
        let mut i = Initiator::new(ME, 1, TxnConfig::default());
        let (txn, r) = committed(&mut i, 1);
        let undecided = prepares(&i.step(request(2), 5))[0].1;
        assert!(Initiator::recover(ME, 1, TxnConfig::default(), std::slice::from_ref(&r)).is_err());
        let mut j = Initiator::recover(ME, 2, TxnConfig::default(), &[r]).expect("recover");
        assert_eq!(replies(&j.step(request(1), 0)), vec![Outcome::Committed]);
        let e = j.step(Event::Tick, 0);
        assert_eq!(
            e.len(),
            2,
            "the commit goes to both participants again: {e:?}"
        );
        let e = j.step(from(A, Msg::Inquiry { txn: undecided }), 0);
        assert!(matches!(
            e[..],
            [Effect::Send {
                msg: Msg::Decision { commit: false, .. },
                ..
            }]
        ));
        assert_eq!(
            j.watermark(),
            txn,
            "the unacknowledged commit holds the watermark"
        );
        let p = prepares(&j.step(request(2), 1));
        assert!(p[0].1 > undecided, "a new attempt never reuses an old id");
    }
}
