//! Running one request at the server's core as a connection does: the batch path
//! ([`exec_at`], [`run_meta`]) and the data path ([`run_data`]). What is durable at a crash
//! depends on the seed alone, because a request not answered early flushes the journal
//! before the next event.

use std::sync::Arc;

use kochab_proto::{Reply, ReplyMode, Request};
use kochab_server::core::Refusal;
use kochab_server::filesvc::data_op;
use kochab_server::shared::Shared;

use crate::step::Ctx;

/// What a server answered: the reply, the LSN that must be durable before it is final,
/// and whether it may leave before that as an early reply.
pub(crate) struct Answered {
    pub(crate) reply: Reply,
    pub(crate) lsn: u64,
    pub(crate) early: bool,
}

/// Runs `req` of `session` at `s`. A request that is not answered early starts a flush of
/// everything appended: it completes before the next event, so that what is durable at a
/// crash depends on the seed alone.
pub(crate) fn exec_at(s: &Shared, session: u64, req: Request) -> Result<Answered, String> {
    let mut replies = Vec::with_capacity(1);
    let asked_early = req.mode == ReplyMode::Early;
    let parked = s.execute_batch(session, &[(1, req)], &mut replies);
    if !parked.is_empty() {
        return Err(format!("a request was parked: {parked:?}"));
    }
    let a = replies
        .pop()
        .ok_or_else(|| "a request got no reply".to_string())?;
    // As the connection decides (conn.rs): early only if asked, and not after another
    // session's change that is not durable.
    let early = asked_early && a.early_by(s.journal().durable_lsn());
    if !early {
        // False only if the journal failed (a fenced one): the caller sees it.
        s.journal().wait_durable(s.journal().last_lsn());
    }
    Ok(Answered {
        reply: a.reply,
        lsn: a.lsn,
        early,
    })
}

/// Runs one data operation at `s` to its end, as the connection's task would
/// (`cluster_host::task_op`: a member admits it first, by the table of its file). One that
/// is not answered early flushes the journal: done before the next event (see `exec_at`).
pub(crate) fn run_data(
    cx: &mut Ctx,
    s: &Arc<Shared>,
    session: u64,
    req: Request,
) -> Result<(Reply, u64), String> {
    if let Some(member) = s.cluster() {
        let core = s.core();
        match member.admit_op(&core, session, &req.op) {
            Ok(_) => {}
            Err(Refusal::Reply(reply)) => return Ok((*reply, 0)),
            Err(Refusal::Borrow(tables)) => {
                return Err(format!(
                    "a data operation needed other tables {tables:?}: {:?}",
                    req.op
                ));
            }
        }
    }
    let flushes = req.mode != ReplyMode::Early;
    let (reply, lsn) = cx.rt.block_on(data_op(s.clone(), session, 0, req));
    if flushes {
        s.journal().flush_now();
        s.journal().wait_durable(s.journal().last_lsn());
    }
    Ok((reply, lsn))
}

/// Runs one request of the batch path at `s` ([`exec_at`]): its reply and LSN.
pub(crate) fn run_meta(s: &Shared, session: u64, req: Request) -> Result<(Reply, u64), String> {
    let a = exec_at(s, session, req)?;
    Ok((a.reply, a.lsn))
}
