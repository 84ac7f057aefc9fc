//! Replay tags: what makes a replayed request provably one that this cluster answered early
//! (see `auth::ReplayKey`). The connection checks them before anything runs; the
//! simulation drives the same checks.

use kochab_proto::auth::{REPLAY_TAG_BYTES, ReplayKey, ReplayTag, ReplayTagInput};
use kochab_proto::*;

/// The replay tags of one session (see `auth::ReplayKey`): made for its early replies,
/// checked on its replays. A replay is genuine when its tag verifies for the session it
/// arrives in, its sequence number, operation kind, routing inode and the id it asks for:
/// then a server answered that request of that session early, and gave it that id.
#[derive(Clone)]
pub struct SessionTags {
    key: ReplayKey,
    session: u64,
}

impl SessionTags {
    /// The tags of session `session` under the cluster's replay key.
    pub fn new(key: &ReplayKey, session: u64) -> SessionTags {
        SessionTags {
            key: key.clone(),
            session,
        }
    }

    fn input(&self, seq: u64, created: InodeId, op: &Op) -> ReplayTagInput {
        ReplayTagInput {
            session: self.session,
            seq,
            created,
            op: op.index() as u8,
            route: op.replay_route(),
        }
    }

    /// The tag of an early reply to a write (which creates nothing), made from the
    /// request alone.
    pub fn write_tag(&self, req: &Request) -> ReplayTag {
        self.key.tag(&self.input(req.seq, 0, &req.op))
    }

    /// The tag of an early reply: none (zeros) where there is nothing to replay, a read or
    /// a failure (the client keeps neither).
    pub fn tag(&self, req: &Request, reply: &Reply) -> ReplayTag {
        if req.op.is_read_only() || matches!(reply, Reply::Error(_)) {
            return [0; REPLAY_TAG_BYTES];
        }
        self.key.tag(&self.input(req.seq, reply.created(), &req.op))
    }

    /// False for a request in replay mode whose tag does not verify (other modes need none).
    pub fn genuine(&self, req: &Request) -> bool {
        match req.mode {
            ReplyMode::Replay { want_id, tag } => self
                .key
                .verify(&self.input(req.seq, want_id, &req.op), &tag),
            _ => true,
        }
    }
}
