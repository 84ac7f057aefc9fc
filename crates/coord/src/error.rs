//! Errors a proposer or reader of the coordinator sees, each with an errno.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::ReplicaId;

/// Why a coordinator request failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CoordError {
    /// This replica is not the leader; `leader` is the one it knows, if any. The command
    /// was not proposed.
    #[error("not the coordinator leader (leader: {leader:?} at {addr:?})")]
    NotLeader {
        /// The leader this replica follows, if it knows one.
        leader: Option<ReplicaId>,
        /// That leader's address.
        addr: Option<SocketAddr>,
    },
    /// No answer within the retry budget (e.g. no quorum). A proposal may or may not have
    /// been applied: commands should carry an idempotency id.
    #[error("coordinator did not answer in time: {0}")]
    Timeout(String),
    /// No replica could be reached.
    #[error("no coordinator replica reachable: {0}")]
    Unavailable(String),
    /// A replica refused our cluster key, or we refused its.
    #[error("coordinator authentication failed: {0}")]
    Auth(String),
    /// A malformed or unexpected message.
    #[error("coordinator protocol error: {0}")]
    Protocol(String),
    /// The replica is shutting down or its Raft core stopped.
    #[error("coordinator replica stopped: {0}")]
    Stopped(String),
    /// A membership change or other Raft request was refused.
    #[error("coordinator refused the request: {0}")]
    Refused(String),
    /// Local storage failed.
    #[error("coordinator storage error: {0}")]
    Storage(String),
}

impl CoordError {
    /// The errno a caller maps this to.
    pub fn errno(&self) -> i32 {
        match self {
            CoordError::NotLeader { .. } => libc::EAGAIN,
            CoordError::Timeout(_) => libc::ETIMEDOUT,
            CoordError::Unavailable(_) => libc::EHOSTUNREACH,
            CoordError::Auth(_) => libc::EACCES,
            CoordError::Protocol(_) => libc::EPROTO,
            CoordError::Stopped(_) => libc::ESHUTDOWN,
            CoordError::Refused(_) => libc::EINVAL,
            CoordError::Storage(_) => libc::EIO,
        }
    }

    /// Whether another replica, or the same one later, may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            CoordError::NotLeader { .. }
                | CoordError::Timeout(_)
                | CoordError::Unavailable(_)
                | CoordError::Stopped(_)
        )
    }
}
