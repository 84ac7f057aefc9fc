//! Tables joining and leaving a running server: the DROP and ADD of a migration and the
//! takeover of a failed server's tables (DESIGN.md "Ownership over time").
//!
//! - [`Shared::drop_table`]: stop admitting operations on the table (they get WRONG_SERVER
//!   from then on), make every record that touched it durable, write a checkpoint of the
//!   boxes it changed and release it (its manifest names no owner and no journal, and
//!   carries the open handles, reply-cache entries and advisory locks its next owner
//!   takes over).
//! - [`Shared::add_table`]: load a released table's checkpoint, claim it (a conditional
//!   write of its manifest's next version) and serve it.
//! - [`Shared::recover_tables`]: seal a failed incarnation's journal first, then load its
//!   tables, replaying that journal from where each table's manifest says, and claim them.
//!
//! Operations run whole under the core lock, so "wait for the table's operations in flight"
//! is taking that lock: after it, none is half-applied; their replies wait for durability,
//! which the drop waits for too before it releases the table.

use crate::manifest::{Manifest, manifests_covering};
use crate::shared::Shared;
use crate::tablepass::{SERVER_ITSELF, TableChange, TableDone};
use kochab_journal::JournalId;
use std::io::{self, ErrorKind};
use std::time::{Duration, Instant};

impl Shared {
    /// Gives up the table whose id is `lo` (see the module). Afterwards another server can
    /// [`Shared::add_table`] it; operations on it here get WRONG_SERVER.
    pub fn drop_table(&self, lo: u64) -> io::Result<()> {
        self.drop_table_waiting(lo, wait_until)
    }

    /// [`Shared::drop_table`], with `wait` in place of its waits: first for the end of
    /// the replay window (the table still served here), then for the callbacks that
    /// revoke the table's leases (once they are sent, the table no longer served here).
    /// Each time `wait` is called with a test of whether the drop may go on, and the drop
    /// goes on when it returns. A served core blocks its thread until the test passes or
    /// a lease has passed ([`wait_until`]); a simulation, which owns time and the
    /// holders, delivers the callbacks, lets the holders answer or moves its clock on,
    /// and returns once the test passes.
    pub fn drop_table_waiting(
        &self,
        lo: u64,
        mut wait: impl FnMut(&dyn Fn() -> bool),
    ) -> io::Result<()> {
        let started = std::time::Instant::now();
        // In a replay window (this incarnation recovered a failed server's tables) no
        // change runs here, for two reasons that a table's next owner knows nothing of:
        // a lease the failed server granted may still be cached, and nobody can call its
        // holder back; and the failed server's clients are still replaying. So a table
        // leaves only once the window is over, served here until then (replays land):
        // else its next owner ran changes at once, acknowledged while another mount
        // still cached what they changed (the cluster simulation, seed 71: a table
        // recovered by the failed server's next incarnation, migrated in its window, a
        // chmod at the new owner acknowledged while the holder cached the old mode).
        let window = self.replay_window();
        wait(&|| window.left().is_zero());
        // txn (issue 33): nor while a transaction's part here holds its keys (a clean
        // checkpoint does not carry what is in doubt).
        if let Some(t) = self.txn_host() {
            let hi = self.hosted_tables().into_iter().find(|&(l, _)| l == lo);
            if let Some((_, hi)) = hi {
                wait(&|| !t.holds_range(lo, hi));
            }
        }
        let mut ckpt = self.checkpointer();
        if ckpt.manifest(lo).is_none() {
            return Err(io::Error::new(
                ErrorKind::NotFound,
                format!("table {lo:016x} is not hosted here"),
            ));
        }
        let (mut table, mut handover, last) = match self.table_step(TableChange::Leaves { lo }) {
            TableDone::Left {
                table,
                handover,
                last,
            } => (*table, handover, last),
            _ => {
                return Err(io::Error::new(
                    ErrorKind::NotFound,
                    format!("table {lo:016x} is not hosted"),
                ));
            }
        };
        let board = self.callback_board(SERVER_ITSELF);
        let ticket = board.ticket();
        let revoked = board.subscribe();
        wait(&|| *revoked.borrow() >= ticket);
        // Taken after the table left the engine: no operation on it can add one now. The
        // entries are of every table (the cache is per session), and the next owner
        // answers a replay from them as done: each one's record must be durable before
        // the release says so, or a crash of this server would lose an operation that
        // another server then claims ran (an early-answered rename on a table still
        // served here, made between the table's removal and this export, came back
        // "done" from the next owner of that table too, its record lost with this
        // server's journal: tests/cluster.rs `a_released_table_hands_over_only_durable_replies`).
        // Every entry is cached under the core lock right after its record is appended,
        // so the last LSN the core numbered, read under the same lock, covers all exported.
        let max = crate::replycache::HANDED_OVER_MAX;
        let TableDone::Exported {
            replies,
            last: exported,
        } = self.table_step(TableChange::ExportReplies { max })
        else {
            return Err(io::Error::other("the core exported no reply-cache entries"));
        };
        handover.replies = replies;
        let skip_wait = self.has_break(kochab_breaks::Break::ReleaseBeforeDurable);
        if !skip_wait {
            self.journal().flush_now();
        }
        let result = if skip_wait || self.journal().wait_durable(last.max(exported)) {
            ckpt.release(self, &mut table, handover.clone())
        } else {
            Err(io::Error::other("journal failed; table not released"))
        };
        match result {
            // A borrow brings it back soon: keep it (see `released`).
            Ok(images) if self.cluster().is_some() => self.released().keep(table, images),
            Ok(_) => {}
            Err(e) => {
                if !self.journal().failed() {
                    // Not released: serve it again rather than lose it.
                    let back = TableChange::Back {
                        table: Box::new(table),
                        handover: &handover,
                    };
                    if let TableDone::Back(Err(e2)) = self.table_step(back) {
                        tracing::error!("{e2}");
                    }
                }
                return Err(e);
            }
        }
        tracing::info!("released table {lo:016x} in {:?}", started.elapsed());
        Ok(())
    }

    /// Splits the hosted, drained table `lo` (see [`crate::checkpoint::Checkpointer::split`]).
    /// `Ok(Err)`: not split, nothing changed. `Err`: the store failed part-way; the
    /// journal is stopped, as this incarnation must not go on.
    pub fn split_table(
        &self,
        lo: u64,
        at: Option<u64>,
    ) -> io::Result<Result<u64, crate::checkpoint::SplitRefused>> {
        let started = std::time::Instant::now();
        let result = self.checkpointer().split(self, lo, at);
        match &result {
            Ok(Ok(at)) => tracing::info!(
                "split table {lo:016x} at {at:016x} in {:?}",
                started.elapsed()
            ),
            Ok(Err(_)) => {}
            Err(e) => self
                .journal()
                .fail_stop(format!("the split of table {lo:016x} failed half-way: {e}")),
        }
        result
    }

    /// Loads and serves the released table whose id is `lo` (and the halves split off it
    /// that its manifest still names). Returns the splits found (see `load_tables`).
    pub fn add_table(&self, lo: u64) -> io::Result<Vec<(u64, u64)>> {
        self.add_table_to(lo, None)
    }

    /// [`Shared::add_table`] for the table `[lo, hi)` of the coordinator's map: the
    /// halves split off it in the store are loaded too.
    pub fn add_table_to(&self, lo: u64, hi: Option<u64>) -> io::Result<Vec<(u64, u64)>> {
        let pieces = manifests_covering(self.store().as_ref(), lo, hi)?;
        if let Some(o) = pieces.iter().find_map(|m| m.owner) {
            return Err(io::Error::new(
                ErrorKind::ResourceBusy,
                format!(
                    "table {lo:016x} is owned by server {} at epoch {}; a failed owner's \
                     tables are taken with recover_tables, which seals its journal first",
                    o.server, o.epoch
                ),
            ));
        }
        self.load_tables(&[(lo, covered_end(&pieces, lo))], true)
    }

    /// Takes over the tables `ids` of the failed incarnation `journal`: seals its journal
    /// (from then on it acknowledges nothing), then loads each table from its checkpoint
    /// and the journals its manifest names, and serves them.
    pub fn recover_tables(&self, ids: &[u64], journal: JournalId) -> io::Result<Vec<(u64, u64)>> {
        let tables: Vec<(u64, Option<u64>)> = ids.iter().map(|&lo| (lo, None)).collect();
        self.recover_tables_to(&tables, journal)
    }

    /// [`Shared::recover_tables`] for tables `(lo, hi)` of the coordinator's map (`hi`
    /// unknown: as far as the manifests say).
    pub fn recover_tables_to(
        &self,
        tables: &[(u64, Option<u64>)],
        journal: JournalId,
    ) -> io::Result<Vec<(u64, u64)>> {
        kochab_journal::seal(self.store().as_ref(), journal)?;
        let mut ranges = Vec::new();
        for &(lo, hi) in tables {
            let pieces = manifests_covering(self.store().as_ref(), lo, hi)?;
            for m in &pieces {
                if let Some(o) = m.owner
                    && (o.server, o.epoch) != (journal.server, journal.epoch)
                {
                    return Err(io::Error::new(
                        ErrorKind::ResourceBusy,
                        format!(
                            "table {:016x} is owned by server {} at epoch {}, not by {journal}",
                            m.lo, o.server, o.epoch
                        ),
                    ));
                }
            }
            ranges.push((lo, covered_end(&pieces, lo)));
        }
        // txn (issue 33): what the journal left in doubt on these tables comes along.
        if let Some(t) = self.txn_host() {
            t.adopt_from(self, journal, &ranges);
        }
        self.load_tables(&ranges, false)
    }

    /// Loads `ranges` as start-up does (checkpoints, sealed journals, claims) and adds them
    /// to the engine. `live`: the tables come from a live server's release, whose clients
    /// may hold their inodes open (counted here too, see `Manifest::open_elsewhere`).
    /// Returns the splits the store showed inside `ranges` (`(lower, upper)`): both halves
    /// are served.
    fn load_tables(&self, ranges: &[(u64, u64)], live: bool) -> io::Result<Vec<(u64, u64)>> {
        let started = std::time::Instant::now();
        let mut ckpt = self.checkpointer();
        let config = self.engine_config();
        // Only records after this one can touch the tables (they are not served yet).
        let next = self.journal().last_lsn() + 1;
        let kept = if live {
            let mut r = self.released();
            ranges.iter().filter_map(|&(lo, _)| r.take(lo)).collect()
        } else {
            Vec::new()
        };
        let rec = crate::recovery::recover_tables(
            self.store().as_ref(),
            config,
            ranges,
            self.journal().id(),
            Some(next),
            None,
            kept,
        )?;
        let mut engine = rec.engine;
        let mut tables = Vec::with_capacity(rec.manifests.len());
        for m in &rec.manifests {
            let table = engine
                .remove_table(m.lo)
                .ok_or_else(|| io::Error::other("a loaded table went missing"))?;
            tables.push((table, m));
        }
        let arrived = TableChange::Arrived {
            tables,
            replies: rec.replies,
            live,
        };
        let (inserted, failed) = match self.table_step(arrived) {
            TableDone::Arrived { inserted, failed } => (inserted, failed),
            _ => (0, Some("the core took no table".to_string())),
        };
        for m in rec.manifests.into_iter().take(inserted) {
            tracing::info!(
                "serving table {:016x} from now on (loaded in {:?}{})",
                m.lo,
                started.elapsed(),
                if rec.from_kept.contains(&m.lo) {
                    ", from the copy kept since its release"
                } else {
                    ""
                }
            );
            ckpt.adopt(m);
        }
        if let Some(why) = failed {
            return Err(io::Error::new(ErrorKind::AlreadyExists, why));
        }
        for (lower, upper) in &rec.splits {
            tracing::info!("table {lower:016x} was split at {upper:016x}: serving both halves");
        }
        Ok(rec.splits)
    }
}

/// One past the last id the manifests `pieces` (of table `lo`, lowest first) hold.
fn covered_end(pieces: &[Manifest], lo: u64) -> u64 {
    pieces.last().map_or(lo, |m| m.hi)
}

impl crate::server::RunningServer {
    /// Releases every table this server hosts (a clean checkpoint each, its manifest naming
    /// no owner): how a single server's data directory becomes a cluster's, whose servers
    /// then ADD the tables. Blocks until each is durable.
    pub fn release_all_tables(&self) -> io::Result<Vec<u64>> {
        let los: Vec<u64> = self
            .shared()
            .hosted_tables()
            .into_iter()
            .map(|(lo, _)| lo)
            .collect();
        for &lo in &los {
            self.shared().drop_table(lo)?;
        }
        Ok(los)
    }
}

/// Waits until `ready` (the replay window is over; the callbacks a drop sent are answered,
/// or their leases ran out), for a lease at most (the window is a lease long, and so is
/// the longest callback). Blocking: for the table paths that run on blocking threads.
fn wait_until(ready: &dyn Fn() -> bool) {
    let deadline = Instant::now() + crate::leases::LEASE + Duration::from_millis(100);
    while !ready() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}
