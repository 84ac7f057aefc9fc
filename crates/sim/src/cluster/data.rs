//! File data in the cluster: the data clients of the single-server simulation
//! ([`crate::data`]: their model of what each byte may read as, their requests and
//! checks), each request sent where the map says its file's table is now, so that open
//! handles and the writes answered early go with tables that migrate, are borrowed and
//! returned, split, or recovered by another server after a kill or a pause.
//!
//! A create goes where its directory is ([`World::route`], borrowing as any operation
//! does); a write, read or fsync of a handle goes to the server holding its file's table,
//! admitted there as a member's host admits it (`exec::run_data`). After a kill or a pause
//! the clients reopen (reclaim) the handles of the files whose tables the gone incarnation
//! held, where those tables are now, and replay there the writes it answered early, in
//! order. There is no power loss here (kill -9 keeps what was written), so a byte may read
//! only as the last acknowledged write left it.

use std::collections::BTreeMap;
use std::sync::Arc;

use kochab_cluster::host::ranges::Ranges;
use kochab_journal::JournalId;
use kochab_proto::InodeId;
use kochab_server::shared::Shared;

use super::{Server, World};
use crate::data::{DataClients, Next};
use crate::step::Ctx;

/// The server the map names for the table of `id`.
fn server_in(
    ranges: &Ranges,
    owner: &BTreeMap<u64, usize>,
    servers: &[Server],
    id: InodeId,
) -> Result<Arc<Shared>, String> {
    let t = ranges
        .table_of(id)
        .ok_or_else(|| format!("file {id:#x} is in no table"))?;
    let at = owner
        .get(&t.0)
        .ok_or_else(|| format!("table {:016x} has no owner in the map", t.0))?;
    Ok(servers[*at].live.clone())
}

/// Whether `id` is in one of `tables` (`hi` known: the map's tables).
fn in_tables(tables: &[(u64, Option<u64>)], id: InodeId) -> bool {
    tables
        .iter()
        .any(|&(lo, hi)| lo <= id && hi.is_none_or(|hi| id < hi))
}

impl World {
    fn data_cx(&mut self) -> Ctx<'_> {
        Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.data_stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        }
    }

    /// One request of a data client, where its file (a create: its directory) is now.
    pub(super) fn data_op(&mut self) -> Result<(), String> {
        let mut data = std::mem::take(&mut self.data);
        let next = match self.data_waiting.take() {
            Some(next) => next,
            None => data.plan(&mut self.data_cx()),
        };
        match self.data_waits_window(&data, &next) {
            Ok(false) => {}
            Ok(true) => {
                // Sent again at a later step; no other new data request goes meanwhile.
                self.data_waiting = data.wait(next);
                self.data = data;
                return Ok(());
            }
            Err(e) => {
                self.data = data;
                return Err(e);
            }
        }
        let result = self
            .data_send(&data, &next)
            .and_then(|(s, cached, reply, lsn)| {
                data.answered(&mut self.data_cx(), &s, next, cached, reply, lsn)
            });
        self.data = data;
        result
    }

    /// Whether `next` waits out the replay window of the server it goes to, as the server
    /// makes it wait (a create by the metadata rule, a write by the data path's).
    fn data_waits_window(&mut self, data: &DataClients, next: &Next) -> Result<bool, String> {
        if next.is_create() {
            return self.waits_window(next.req());
        }
        if !kochab_server::filesvc::data_waits_for_replays(next.req()) {
            return Ok(false);
        }
        let id = next
            .file(data)
            .ok_or_else(|| "a data operation on a file never made".to_string())?;
        let (_, at) = self.owner_of(id)?;
        let left = self.servers[at].live.replay_window().left();
        if left.is_zero() {
            return Ok(false);
        }
        self.stats.window_waits += 1;
        self.trace(|| format!("a data write waits {left:?} for the replay window at {at}"));
        Ok(true)
    }

    /// Runs `next` where it belongs: the server that answered, whether it answered from
    /// its reply cache, the reply and its LSN.
    fn data_send(
        &mut self,
        data: &DataClients,
        next: &Next,
    ) -> Result<(Arc<Shared>, bool, kochab_proto::Reply, u64), String> {
        if next.is_create() {
            let dir = next.req().op.inode_ids().into_iter().flatten().next();
            let dir = dir.ok_or_else(|| "a create names no directory".to_string())?;
            let (_, at) = self.owner_of(dir)?;
            let cached = next.cached_at(&self.servers[at].live);
            let r = self.route(next.session(), next.req().clone())?;
            return Ok((self.servers[r.at].live.clone(), cached, r.reply, r.lsn));
        }
        let id = next
            .file(data)
            .ok_or_else(|| "a data operation on a file never made".to_string())?;
        let (_, at) = self.owner_of(id)?;
        let s = self.servers[at].live.clone();
        let cached = next.cached_at(&s);
        let (reply, lsn) = data.run_at(&mut self.data_cx(), &s, next)?;
        Ok((s, cached, reply, lsn))
    }

    /// A pause: a data client still connected to the old process `old` writes there to
    /// a file of the `tables` it served (taken over by now).
    pub(super) fn data_write_at_old(
        &mut self,
        old: &Arc<Shared>,
        tables: &[(u64, Option<u64>)],
    ) -> Result<(), String> {
        if self.data.is_empty() || !self.rng.chance(500) {
            return Ok(());
        }
        if !old.replay_window().left().is_zero() {
            // The old process makes a write wait out its own window: it would never run.
            return Ok(());
        }
        let before = self.data_stats.data_ops;
        let mut cx = Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.data_stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        };
        self.data
            .write_at_old(&mut cx, old, &|id| in_tables(tables, id))?;
        self.stats.writes_at_old += self.data_stats.data_ops - before;
        Ok(())
    }

    /// After the incarnation `dead` went: the data clients reopen the handles of the
    /// files in its `tables` where the map says they are now, and replay the writes it
    /// answered early.
    pub(super) fn data_replay(
        &mut self,
        dead: JournalId,
        tables: &[(u64, Option<u64>)],
    ) -> Result<(), String> {
        let ranges = self.ranges();
        let (owner, servers) = (&self.owner, &self.servers);
        let server_of = |id| server_in(&ranges, owner, servers, id);
        let mut cx = Ctx {
            rng: &mut self.rng,
            rt: &self._rt,
            stats: &mut self.data_stats,
            trace: self.cfg.trace.then_some(self.cfg.seed),
        };
        self.data
            .replay_at(&mut cx, &server_of, &|id| in_tables(tables, id), &|j| {
                j == dead
            })
    }

    /// Every data client's files read as its acknowledged writes say, at the servers
    /// holding them now.
    pub(super) fn data_check(&self) -> Result<(), String> {
        let ranges = self.ranges();
        self.data
            .check(&|id| server_in(&ranges, &self.owner, &self.servers, id))
    }

    /// The clients learn what these journals hold.
    pub(super) fn data_after_flush(&mut self, durable: &[(JournalId, u64)]) {
        self.data.after_flush_at(durable);
    }

    /// A table `lo..hi` moves: counted if it carries a data client's open handle.
    pub(super) fn data_table_moves(&mut self, lo: u64, hi: u64) {
        if self.data.files_in(lo, hi) > 0 {
            self.stats.open_moves += 1;
        }
    }

    /// Now and then (a third of the time) the table of a data client's file picked at
    /// random, so that open handles move often.
    pub(super) fn data_table(&mut self) -> Option<u64> {
        if !self.rng.chance(333) {
            return None;
        }
        let ids = self.data.file_ids();
        let id = *ids.get(self.rng.range(0, ids.len().max(1) as u64 - 1) as usize)?;
        self.ranges().table_of(id).map(|t| t.0)
    }

    /// The data clients' counts into the run's.
    pub(super) fn data_totals(&mut self) {
        self.stats.data_ops = self.data_stats.data_ops;
        self.stats.data_replays = self.data_stats.replays;
        self.stats.reopens = self.data_stats.reopens;
        self.stats.dropped_replies += std::mem::take(&mut self.data_stats.dropped_replies);
    }
}
