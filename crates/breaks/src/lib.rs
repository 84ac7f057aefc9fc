//! Deliberate bugs in the real code, for the simulation to prove its checks: with
//! `SIM_BREAK=NAME` the simulation switches one on and must then fail within a few seeds.
//!
//! A switch is a plain value carried in the configuration of the code it breaks (the
//! journal's options, the server core), never a global: simulations of different breaks
//! run side by side in one test process, and a production server, which never sets one,
//! has every switch off.

/// One deliberate bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// The journal acknowledges a write without checking that nobody sealed it: a fenced
    /// server's late operations count as durable although its successor never reads them.
    Fencing,
    /// The core sends every reply at once, as if its record were durable: a crash loses
    /// operations clients were told are safe.
    ReplyBeforeDurable,
    /// The core runs a retried or replayed request again instead of answering it from the
    /// reply cache: an operation applied twice.
    ReplyCache,
    /// A replayed create ignores the inode id its first reply gave: the client's (and its
    /// kernel's) references name another file, or none.
    WantId,
    /// The core answers early a change that depended on another session's change not yet
    /// durable: after a crash the clients' replays run in another order, and the change
    /// fails at its replay (acknowledged, and lost).
    DependentEarly,
    /// A replayed write answered early is answered as done without writing its bytes or
    /// journaling its size, as if the lost incarnation's journal had kept it: a crash
    /// loses a write the client was told succeeded.
    ReplayedWriteSkipped,
    /// A callback's answer is accepted from any session, not only from the one it was
    /// sent to: a change proceeds while the real holder still caches what it changes.
    CallbackOtherSession,
    /// A table leaves its server (a migration, a borrow or its return) without waiting
    /// until the records that touched it, and the replies handed over with it, are
    /// durable: a crash of the old server then loses the half of an operation that
    /// another server's table also shows, or a reply its next owner says ran.
    ReleaseBeforeDurable,
    /// The server takes a lease for run out at half its length, while the holder trusts
    /// its cache for the whole lease: a change after that calls nobody back, and proceeds
    /// while the holder still caches what it changes.
    LeaseExpiryEarly,
    /// A multi-server transaction's initiator decides commit on the first yes vote, not
    /// after all of them (`kochab_cluster::txn::Break::CommitBeforeAllPrepared`): a part
    /// that was never checked or locked is applied, or never, while the rest commits.
    TxnCommitBeforeAllPrepared,
    /// A transaction's participant acknowledges a commit before its applied record is
    /// durable (`kochab_cluster::txn::Break::AckBeforeDurable`): the initiator forgets
    /// the commit, and a crash of the participant then loses its half.
    TxnAckBeforeDurable,
}

impl Break {
    /// Every switch, in the order of [`Break::name`]'s list.
    pub const ALL: [Break; 11] = [
        Break::Fencing,
        Break::ReplyBeforeDurable,
        Break::ReplyCache,
        Break::WantId,
        Break::DependentEarly,
        Break::ReplayedWriteSkipped,
        Break::CallbackOtherSession,
        Break::ReleaseBeforeDurable,
        Break::LeaseExpiryEarly,
        Break::TxnCommitBeforeAllPrepared,
        Break::TxnAckBeforeDurable,
    ];

    /// The name `SIM_BREAK` takes.
    pub fn name(self) -> &'static str {
        match self {
            Break::Fencing => "fencing",
            Break::ReplyBeforeDurable => "reply-before-durable",
            Break::ReplyCache => "reply-cache",
            Break::WantId => "want-id",
            Break::DependentEarly => "dependent-early",
            Break::ReplayedWriteSkipped => "replayed-write-skipped",
            Break::CallbackOtherSession => "callback-other-session",
            Break::ReleaseBeforeDurable => "release-before-durable",
            Break::LeaseExpiryEarly => "lease-expiry-early",
            Break::TxnCommitBeforeAllPrepared => "txn-commit-before-all-prepared",
            Break::TxnAckBeforeDurable => "txn-ack-before-durable",
        }
    }

    /// The switch called `name`.
    pub fn parse(name: &str) -> Option<Break> {
        Break::ALL.into_iter().find(|b| b.name() == name)
    }

    /// True for the breaks only operations across servers can show (tables that move,
    /// transactions): the cluster simulation catches them, the single-server one cannot.
    pub fn needs_servers(self) -> bool {
        matches!(
            self,
            Break::ReleaseBeforeDurable
                | Break::TxnCommitBeforeAllPrepared
                | Break::TxnAckBeforeDurable
        )
    }

    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// A set of switches; the default is none on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breaks(u32);

impl Breaks {
    /// Every switch off (production).
    pub const NONE: Breaks = Breaks(0);

    /// These switches plus `b`.
    pub fn with(self, b: Break) -> Breaks {
        Breaks(self.0 | b.bit())
    }

    /// True if `b` is on.
    #[inline]
    pub fn has(self, b: Break) -> bool {
        self.0 & b.bit() != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_switches_are_independent() {
        for b in Break::ALL {
            assert_eq!(Break::parse(b.name()), Some(b));
            let on = Breaks::NONE.with(b);
            assert!(on.has(b));
            assert_eq!(Break::ALL.iter().filter(|&&o| on.has(o)).count(), 1);
        }
        assert_eq!(Break::parse("nothing"), None);
        assert!(!Breaks::default().has(Break::Fencing));
    }
}
