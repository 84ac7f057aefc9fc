//! The clients of names, as both worlds (one server, several) run them: what each one kept
//! of its early replies, its lost request, and whether a replay told the story its early
//! reply told.

use kochab_journal::JournalId;
use kochab_proto::{InodeId, Reply, Request};

use crate::model::{DIRS, Model, Planned};

/// A request answered early whose record may not be durable in the journal `at`: kept to
/// replay.
pub(crate) struct Kept {
    pub(crate) req: Request,
    pub(crate) reply: Reply,
    pub(crate) lsn: u64,
    pub(crate) at: JournalId,
    pub(crate) tag: kochab_proto::auth::ReplayTag,
    pub(crate) planned: Option<Planned>,
}

impl Kept {
    /// Whether `reply`, to this request's replay, tells the same story as the early reply
    /// the client acted on. A create's replay may be told it is done (nothing made): its
    /// record was durable and a later change of the client's removed what it made.
    pub(crate) fn replay_agrees(&self, reply: &Reply) -> bool {
        let want_id = self.reply.created();
        let done_since = matches!(reply, Reply::Empty) && want_id != 0;
        match (&self.planned, reply) {
            _ if done_since => true,
            (Some(p), r) => Model::check(p, r).is_ok() && (want_id == 0 || r.created() == want_id),
            (None, Reply::Error(_)) => false,
            (None, r) => want_id == 0 || r.created() == want_id,
        }
    }
}

/// One client of names: session `100 + c`, names of its own in `dirs`.
pub(crate) struct Client {
    pub(crate) session: u64,
    pub(crate) next_seq: u64,
    pub(crate) model: Model,
    pub(crate) dirs: [InodeId; DIRS],
    pub(crate) kept: Vec<Kept>,
    /// Sent, its reply lost: sent again (same sequence number) before anything else.
    pub(crate) lost: Option<(Request, Option<Planned>)>,
}

impl Client {
    /// Client number `c`, working in `dirs`.
    pub(crate) fn new(c: usize, dirs: [InodeId; DIRS]) -> Client {
        Client {
            session: 100 + c as u64,
            next_seq: 1,
            model: Model::new(&format!("c{c}-")),
            dirs,
            kept: Vec::new(),
            lost: None,
        }
    }

    /// The lowest sequence number the client may still send again: the server may forget
    /// the replies below it.
    pub(crate) fn seq_floor(&self) -> u64 {
        let kept = self.kept.iter().map(|k| k.req.seq);
        let lost = self.lost.iter().map(|(r, _)| r.seq);
        kept.chain(lost).min().unwrap_or(self.next_seq)
    }
}
