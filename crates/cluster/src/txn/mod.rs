//! Multi-server operations as two-phase commit between the servers that hold their
//! tables (issue 33), beside BORROW/RETURN: no table moves, only the inodes and entries an
//! operation names are locked, and only while it runs.
//!
//! The initiator (the server a client sent the operation to) asks each participant to lock
//! the keys of its part of the plan, check the part's preconditions and journal a
//! [`Record::Prepared`]; once every participant voted yes it journals its decision
//! ([`Record::Decided`], the commit point) and tells them; each applies, journals
//! [`Record::Applied`] and acknowledges; when all have, the initiator journals
//! [`Record::Forgotten`]. Presumed abort: no durable commit decision means abort, so
//! aborts are never waited for. A participant in doubt keeps its locks and asks the
//! initiator's journal ([`Msg::Inquiry`], addressed to the initiator's server id, which the
//! host resolves to whoever holds that journal now, after a failover the server that
//! recovered it). Locks are taken by wait-die ([`locks`]), so there is no deadlock.
//!
//! Pure, like the rest of this crate: [`initiator::Initiator`] and
//! [`participant::Participant`] take events and the host's clock and return [`Effect`]s;
//! the host owns the network, the journal and the tables. [`sim`] runs both over a seeded
//! network, journal and crash model and checks the invariants after every step.

pub mod initiator;
pub mod locks;
pub mod participant;
pub mod sim;

use kochab_proto::InodeId;
use kochab_proto::cluster::ServerId;
use serde::{Deserialize, Serialize};

/// A client, as the reply cache knows it.
pub type ClientId = u64;

/// One attempt of a transaction: unique across the initiator's incarnations because
/// `epoch` is (the host passes a new one on every start or recovery of a journal, larger
/// than any in it). Ordered, so a participant can tell, from an initiator's
/// [`Msg::Prepare::watermark`], which attempts are over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TxnId {
    /// The initiator's journal: where the decision is, and whom to ask about it.
    pub origin: ServerId,
    pub epoch: u64,
    pub seq: u64,
}

/// Wait-die priority: smaller is older. A retry keeps its transaction's age, so an old
/// transaction gets older until it wins; `first` breaks ties between equal clocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Age {
    /// The initiator's clock when the first attempt started.
    pub start_ms: u64,
    pub first: TxnId,
}

/// What a transaction locks: an inode, or a directory entry (parent, name).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Key {
    Inode(InodeId),
    Entry { parent: InodeId, name: Vec<u8> },
}

/// A precondition on a key's value, checked by the participant once it holds the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Expect {
    Any,
    Absent,
    Present,
}

/// What a mutation writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Write {
    Put(Vec<u8>),
    Delete,
}

/// One change to one key, applied only if the transaction commits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mutation {
    pub key: Key,
    pub expect: Expect,
    pub write: Write,
}

/// One participant's share of a plan: the keys it locks (every mutated key among them)
/// and the mutations it applies on commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    pub locks: Vec<Key>,
    pub mutations: Vec<Mutation>,
}

/// A whole operation: each participant's part (one per server).
pub type Plan = Vec<(ServerId, Part)>;

/// Most participants in one transaction (a rename touches at most four tables: both
/// parents, the child and a replaced target).
pub const PARTICIPANTS_MAX: usize = 8;
/// Most keys one participant locks for one transaction (bounds a prepare record).
pub const KEYS_MAX: usize = 16;

/// Whether `plan` is well formed: 1..=PARTICIPANTS_MAX distinct servers, each with
/// 1..=KEYS_MAX distinct keys covering its mutations. Checked by the initiator before it
/// starts and by each participant on its part (the part came over the network).
pub fn plan_ok(plan: &Plan) -> bool {
    let mut servers: Vec<ServerId> = plan.iter().map(|(s, _)| *s).collect();
    servers.sort();
    servers.dedup();
    !plan.is_empty()
        && plan.len() <= PARTICIPANTS_MAX
        && servers.len() == plan.len()
        && plan.iter().all(|(_, p)| part_ok(p))
}

/// Whether one part is well formed (see [`plan_ok`]).
pub fn part_ok(part: &Part) -> bool {
    let mut keys = part.locks.clone();
    keys.sort();
    keys.dedup();
    !keys.is_empty()
        && keys.len() == part.locks.len()
        && keys.len() <= KEYS_MAX
        && part.mutations.len() <= KEYS_MAX
        && part
            .mutations
            .iter()
            .all(|m| keys.binary_search(&m.key).is_ok())
}

/// Whether `m`'s precondition holds when the key's present value is `present`. One copy
/// of the rule for every host.
pub fn expect_holds(m: &Mutation, present: bool) -> bool {
    match m.expect {
        Expect::Any => true,
        Expect::Absent => !present,
        Expect::Present => present,
    }
}

/// Why a participant voted no.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoVote {
    /// A precondition failed: the operation's answer (the client is told).
    Refused,
    /// Wait-die chose this attempt to die, it waited too long, or the part was malformed
    /// for this server: the initiator retries with a new attempt.
    Died,
}

/// Messages between initiator and participants. Every one may be lost, duplicated,
/// delayed or reordered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Initiator -> participant: lock, check, journal, vote.
    Prepare {
        txn: TxnId,
        age: Age,
        part: Part,
        /// Every attempt of this origin below it is over (decided and, if committed,
        /// acknowledged by all): a participant forgets what it kept about them and
        /// aborts any it is still in doubt about.
        watermark: TxnId,
    },
    /// Initiator -> participant (also the answer to an inquiry).
    Decision {
        txn: TxnId,
        commit: bool,
        watermark: TxnId,
    },
    /// Participant -> initiator.
    Vote { txn: TxnId, no: Option<NoVote> },
    /// Participant -> initiator: the commit is applied and durable here.
    Ack { txn: TxnId },
    /// Participant -> whoever holds the origin's journal: what was decided?
    Inquiry { txn: TxnId },
}

impl Msg {
    /// Whether the initiator side handles it (else the participant side).
    pub fn to_initiator(&self) -> bool {
        matches!(
            self,
            Msg::Vote { .. } | Msg::Ack { .. } | Msg::Inquiry { .. }
        )
    }
}

/// The decision an initiator journals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    Commit,
    /// A precondition failed: journaled only so a retry gets the same answer (presumed
    /// abort needs no record for the protocol's sake).
    Refuse,
}

/// Journal records of both sides (one journal per server).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// Participant: locked and checked; must learn the outcome before releasing.
    Prepared { txn: TxnId, age: Age, part: Part },
    /// Initiator: the commit point (or a refusal kept for the reply cache).
    Decided {
        txn: TxnId,
        client: ClientId,
        seq: u64,
        decision: Decision,
        participants: Vec<ServerId>,
    },
    /// Participant: the outcome is applied (commit) or discarded (abort).
    Applied { txn: TxnId, commit: bool },
    /// Initiator: every participant acknowledged the commit; nobody will ask again.
    Forgotten { txn: TxnId },
    /// Participant: another server's prepared part, taken over from a failed journal with
    /// the tables it locks (the host's `adopt_from`), in doubt here as a `Prepared` is;
    /// `owner` is the server it speaks for (its acknowledgement goes out as that server's),
    /// so that a part taken over twice still answers for the right one. Last, so that
    /// records written before it existed still decode.
    Adopted {
        txn: TxnId,
        age: Age,
        part: Part,
        owner: ServerId,
    },
}

impl Record {
    /// The attempt it is about.
    pub fn txn(&self) -> TxnId {
        match self {
            Record::Prepared { txn, .. }
            | Record::Adopted { txn, .. }
            | Record::Decided { txn, .. }
            | Record::Applied { txn, .. }
            | Record::Forgotten { txn } => *txn,
        }
    }

    /// Whether the initiator side wrote it (else the participant side).
    pub fn by_initiator(&self) -> bool {
        matches!(self, Record::Decided { .. } | Record::Forgotten { .. })
    }
}

/// What the client is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied everywhere (or will be, by recovery: the decision is durable).
    Committed,
    /// A precondition failed at a participant; nothing applied.
    Refused,
    /// Not done, nothing applied; ask again with the same (client, seq). Not cached.
    Busy,
    /// The plan is malformed.
    Invalid,
    /// The reply cache no longer holds this request's answer.
    TooOld,
}

/// What the host must do. The host carries them out in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Send to the server holding `to`'s journal now.
    Send { to: ServerId, msg: Msg },
    /// Append to this server's journal; once durable (with everything before it), call
    /// `Event::Durable` with it on the side that wrote it ([`Record::by_initiator`]).
    Append(Record),
    /// Participant: the locks are held; check `part`'s preconditions against the tables
    /// and call `Event::Checked`.
    Check { txn: TxnId, part: Part },
    /// Participant: apply these mutations to the tables (the decision is durable).
    Apply {
        txn: TxnId,
        mutations: Vec<Mutation>,
    },
    /// Participant: these keys are free again (wake operations waiting on them).
    Released { keys: Vec<Key> },
    /// Initiator: answer the client.
    Reply {
        client: ClientId,
        seq: u64,
        outcome: Outcome,
    },
}

/// A deliberate protocol bug, for showing that the simulation catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// The initiator decides commit on the first yes vote, not after all of them.
    CommitBeforeAllPrepared,
    /// A participant acknowledges a commit before its [`Record::Applied`] is durable.
    AckBeforeDurable,
}

/// Timers and the deliberate break, shared by both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnConfig {
    /// Initiator: give up an attempt whose votes are not all in after this long (a dead
    /// or partitioned participant; wait-die waits are shorter, see `wait_max_ms`).
    pub prepare_timeout_ms: u64,
    /// Initiator: resend unanswered prepares and decisions this often.
    pub resend_ms: u64,
    /// Initiator: attempts of one request before the client is told Busy.
    pub attempts_max: u32,
    /// Initiator: wait this long times the attempt number before retrying a dead attempt.
    pub backoff_ms: u64,
    /// Participant: a prepare waits for locks at most this long, then dies. Below
    /// `prepare_timeout_ms`, so a waiter dies before its initiator gives up on it.
    pub wait_max_ms: u64,
    /// Participant: ask about an in-doubt transaction this often.
    pub inquiry_ms: u64,
    pub broken: Option<Break>,
}

impl Default for TxnConfig {
    fn default() -> Self {
        TxnConfig {
            prepare_timeout_ms: 1_000,
            resend_ms: 200,
            attempts_max: 8,
            backoff_ms: 20,
            wait_max_ms: 500,
            inquiry_ms: 300,
            broken: None,
        }
    }
}

/// Errors of recovery (bad journal contents are the host's to report; nothing is
/// repaired silently).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TxnError {
    /// The host must give a recovered initiator an epoch above every one in its journal,
    /// or new attempts could take the ids of old ones.
    #[error("epoch {given} is not above epoch {seen} found in the journal")]
    StaleEpoch { given: u64, seen: u64 },
    /// A record the other side of this server wrote, or one about another origin, where
    /// only this origin's may be.
    #[error("journal record {0:?} does not belong here")]
    Foreign(Box<Record>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(p: u64, n: &str) -> Key {
        Key::Entry {
            parent: p,
            name: n.as_bytes().to_vec(),
        }
    }

    #[test]
    fn plans_are_checked() {
        let m = Mutation {
            key: entry(1, "a"),
            expect: Expect::Absent,
            write: Write::Delete,
        };
        let part = Part {
            locks: vec![entry(1, "a")],
            mutations: vec![m.clone()],
        };
        assert!(plan_ok(&vec![(ServerId(0), part.clone())]));
        assert!(!plan_ok(&vec![]), "empty");
        assert!(
            !plan_ok(&vec![
                (ServerId(0), part.clone()),
                (ServerId(0), part.clone())
            ]),
            "one server twice"
        );
        let unlocked = Part {
            locks: vec![entry(1, "b")],
            mutations: vec![m],
        };
        assert!(!part_ok(&unlocked), "mutates a key it does not lock");
        let twice = Part {
            locks: vec![entry(1, "a"), entry(1, "a")],
            mutations: vec![],
        };
        assert!(!part_ok(&twice), "a key twice");
        let none = Part {
            locks: vec![],
            mutations: vec![],
        };
        assert!(!part_ok(&none));
    }
}
