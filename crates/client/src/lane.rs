//! A thread's lane: the connections of its own that the requests it makes use (see
//! [`set_lane`]); the pool picks them, and a connection opened on a lane is served there.

use std::cell::Cell;

thread_local! {
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Gives the requests this thread makes connections of their own, lane `lane`'s, opened
/// from this thread: their I/O tasks, and for a server of this process the server's side
/// of them, run on the runtime this thread drives. A thread that drives a current-thread
/// runtime (the mount's per-CPU FUSE queues) then serves a request from start to end
/// without waking another thread. Requests made on other threads never use a lane's
/// connections; `None` returns this thread to the shared ones.
pub fn set_lane(lane: Option<usize>) {
    LANE.with(|l| l.set(lane));
}

/// This thread's lane, if it has one.
pub(crate) fn lane() -> Option<usize> {
    LANE.with(Cell::get)
}
