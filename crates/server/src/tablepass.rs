//! Tables leaving and arriving, as steps ([`crate::step::Event::Table`]). The shell
//! (`membership`) waits, writes checkpoints and manifests and loads tables from the store;
//! the core takes a table out with what travels with it (open handles, locks, quarantined
//! ids), calls back the leases on it, hands over its reply-cache entries, and puts tables
//! in with what came with them.

use crate::clock::Now;
use crate::core::Core;
use crate::leases::Urgency;
use crate::manifest::{Handover, Manifest};
use crate::replycache::{HandedOver, ReplyCache};
use kochab_meta::{BoxSet, Table};

/// The session id the server's own callbacks are counted under (no client has it: session
/// ids are MACs, and this one is reserved).
pub const SERVER_ITSELF: u64 = u64::MAX;

/// A table's move, as the core sees it.
pub enum TableChange<'a> {
    /// The table whose id is `lo` leaves: no operation on it runs here from now on.
    Leaves { lo: u64 },
    /// The reply-cache entries a leaving table hands over (of every table: the cache is per
    /// session), at most `max`.
    ExportReplies { max: usize },
    /// A table that could not be released is served again, with what it took along.
    Back {
        table: Box<Table>,
        handover: &'a Handover,
    },
    /// Tables loaded from the store (`tables`, each with its manifest) are served from now
    /// on, with the reply-cache entries recovery rebuilt. `live`: released by a live
    /// server, whose clients' open handles, locks and entries came along in the manifest.
    Arrived {
        tables: Vec<(Table, &'a Manifest)>,
        replies: ReplyCache,
        live: bool,
    },
    /// A checkpoint of table `lo` begins: the boxes changed since the last (all of them if
    /// `full`, or if the table must have a full image) are taken as saved.
    Snapshot { lo: u64, full: bool },
    /// A checkpoint of `lo` failed: its boxes `set` are unsaved again (`full`: and it
    /// still needs a full image).
    Unsaved { lo: u64, set: BoxSet, full: bool },
    /// Table `lo`'s manifest now says replay starts after record `after`.
    ReplayFrom { lo: u64, after: u64 },
    /// Table `lo` splits at `at` (`None`: where the engine would); both halves get full
    /// images.
    Split { lo: u64, at: Option<u64> },
}

/// What a table step answers.
pub enum TableDone {
    /// The table left: it, what goes with it, and the last record numbered (every record
    /// that touched it is at or below; the release waits until that is durable).
    Left {
        table: Box<Table>,
        handover: Handover,
        last: u64,
    },
    /// The table is not hosted here.
    NotHosted,
    /// The entries handed over, and the last record numbered (each entry's record is at or
    /// below: entries are cached under the lock right after their records).
    Exported { replies: HandedOver, last: u64 },
    /// Put back (`Err`: why it could not be).
    Back(Result<(), String>),
    /// The first `inserted` of the tables arrived are served; `failed`: why the next one
    /// could not be (the rest were not put in).
    Arrived {
        inserted: usize,
        failed: Option<String>,
    },
    /// The boxes a checkpoint saves, whether its image is full, and the last record
    /// numbered (every change in the boxes is at or below).
    Snapshot { set: BoxSet, full: bool, last: u64 },
    /// The table split at `at`: the halves' boxes, and the last record numbered.
    Split {
        at: u64,
        lower: BoxSet,
        upper: BoxSet,
        last: u64,
    },
    /// Not split (nothing changed).
    SplitRefused(kochab_meta::TableError),
    /// Noted.
    Noted,
}

impl Core {
    /// Runs one table step at `now`.
    pub(crate) fn table_change(&mut self, change: TableChange<'_>, now: Now) -> TableDone {
        match change {
            TableChange::Leaves { lo } => {
                let Some(table) = self.engine.remove_table(lo) else {
                    return TableDone::NotHosted;
                };
                let (open_handles, open_counts) = self.take_open_handles(table.lo, table.hi);
                let handover = Handover {
                    open_counts,
                    open_handles,
                    locks: self.locks.take_range(table.lo, table.hi),
                    replies: Default::default(),
                    quarantine: self.engine.take_quarantine(table.lo, table.hi),
                };
                // Whoever serves the table next knows nothing of the leases granted here:
                // its holders drop what they cache of it before it leaves.
                let revoked = self.leases.revoke_range(table.lo, table.hi, now.instant);
                for (holder, list, until) in revoked {
                    // Names of whole directories: as long as dropping them takes.
                    let (work, at) = (Urgency::Work, now.instant);
                    self.call_back(SERVER_ITSELF, holder, &list, until, work, at);
                }
                TableDone::Left {
                    table: Box::new(table),
                    handover,
                    last: self.last_lsn(),
                }
            }
            TableChange::ExportReplies { max } => TableDone::Exported {
                replies: self.replies.export(max),
                last: self.last_lsn(),
            },
            TableChange::Back { table, handover } => {
                let lo = table.lo;
                let put = self
                    .engine
                    .insert_table(*table)
                    .map_err(|e| format!("table {lo:016x} could not be put back: {e}"));
                self.engine.add_open_counts(&handover.open_counts);
                self.add_arrived_handles(&handover.open_handles);
                self.locks.put_moved(&handover.locks);
                self.engine.quarantine_arrived(&handover.quarantine);
                TableDone::Back(put)
            }
            TableChange::Arrived {
                tables,
                replies,
                live,
            } => {
                self.replies.merge_from(replies);
                let n = tables.len();
                for (inserted, (table, m)) in tables.into_iter().enumerate() {
                    let lo = table.lo;
                    if let Err(e) = self.engine.insert_table(table) {
                        let failed = Some(format!("table {lo:016x}: {e}"));
                        return TableDone::Arrived { inserted, failed };
                    }
                    if live {
                        self.engine.add_open_counts(&m.open_elsewhere);
                        self.add_arrived_handles(&m.open_handles);
                        self.replies.import(&m.replies);
                        self.locks.put_moved(&m.locks);
                        self.engine.quarantine_arrived(&m.quarantine);
                    }
                }
                TableDone::Arrived {
                    inserted: n,
                    failed: None,
                }
            }
            TableChange::Snapshot { lo, full } => {
                let last = self.last_lsn();
                let Some(t) = self.hosted_mut(lo) else {
                    return TableDone::NotHosted;
                };
                // A table loaded from format-1 images replaces all of them at once.
                let full = t.take_needs_full() || full;
                let dirty = t.take_dirty();
                let set = if full { t.all_boxes() } else { dirty };
                TableDone::Snapshot { set, full, last }
            }
            TableChange::Unsaved { lo, set, full } => {
                if let Some(t) = self.hosted_mut(lo) {
                    t.mark_dirty(&set);
                    if full {
                        t.set_needs_full();
                    }
                }
                TableDone::Noted
            }
            TableChange::ReplayFrom { lo, after } => {
                if let Some(t) = self.hosted_mut(lo) {
                    t.replay_from = after;
                }
                TableDone::Noted
            }
            TableChange::Split { lo, at } => {
                let at = match at {
                    Some(at) => at,
                    None => match self.engine.split_point(lo) {
                        Ok(at) => at,
                        Err(e) => return TableDone::SplitRefused(e),
                    },
                };
                if let Err(e) = self.engine.split_table(lo, at) {
                    return TableDone::SplitRefused(e);
                }
                let last = self.last_lsn();
                // Both halves get full images: their dirty marks are covered.
                let mut all_boxes = |t: u64| {
                    let t = self.hosted_mut(t)?;
                    t.take_needs_full();
                    t.take_dirty();
                    Some(t.all_boxes())
                };
                match (all_boxes(lo), all_boxes(at)) {
                    (Some(lower), Some(upper)) => TableDone::Split {
                        at,
                        lower,
                        upper,
                        last,
                    },
                    _ => TableDone::NotHosted,
                }
            }
        }
    }

    /// The hosted table whose id is `lo` (not one that merely covers it).
    fn hosted_mut(&mut self, lo: u64) -> Option<&mut Table> {
        let i = self
            .engine
            .table_index(lo)
            .filter(|&i| self.engine.tables()[i].lo == lo)?;
        Some(&mut self.engine.tables_mut()[i])
    }
}
