//! Recent attributes of directories this client changed, from the servers' own replies.
//!
//! After a create or an unlink the kernel forgets the parent directory's attributes and,
//! with default permissions, asks for them again before the next lookup in it: one more
//! round trip per file. A namespace change's reply carries the parent's attributes as they
//! were right after it ([`Reply::WithDirs`]), so the FUSE client can answer that getattr
//! itself, exactly as if the kernel had kept what the reply said for the attribute TTL.
//!
//! A remembered directory must be what the servers hold after this client's last change to
//! it. So attributes are kept only from a reply whose operation was the only one of this
//! client on that directory from its start to its end; any other change this client starts
//! on a directory forgets it. A rename or rmdir changes a directory it names only by name
//! (the one moved or removed), so it forgets everything, and nothing is kept while one is in
//! flight. Changes by other clients show up after the TTL, as with the kernel's own cache;
//! with leases, at once: the callback for the directory's inode forgets it here too
//! ([`DirCache::forget`]), and attributes are kept for the lease, counted from when the
//! change was sent (before the server granted the lease).
//!
//! A state machine: time comes in as arguments.

use kochab_proto::{Attr, InodeId, Op};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Above this many remembered directories, the stale ones are dropped.
const PRUNE_AT: usize = 4096;
/// Longest time a directory's attributes are kept without leases.
pub const KEEP_MAX: Duration = Duration::from_secs(1);

pub struct DirCache {
    kept: FxHashMap<InodeId, (Attr, Instant)>,
    /// Longest time a directory's attributes are kept.
    keep: Duration,
    /// Changes in flight per directory: (count, start number of the latest).
    busy: FxHashMap<InodeId, (u32, u64)>,
    starts: u64,
    /// Renames and rmdirs in flight, and the start number of the latest.
    renames: u32,
    last_rename: u64,
    /// Callbacks seen ([`DirCache::forget`]): a reply to an operation sent before one may
    /// show what the callback revoked, so it is not kept.
    forgets: u64,
}

impl Default for DirCache {
    fn default() -> Self {
        DirCache::new(KEEP_MAX)
    }
}

/// What [`DirCache::begin`] saw, to hand back to [`DirCache::end`].
#[derive(Debug)]
pub struct Ticket {
    ids: [Option<InodeId>; 2],
    start: u64,
    rename: bool,
    forgets: u64,
}

impl DirCache {
    /// A cache that keeps attributes for at most `keep` (the lease, with leases).
    pub fn new(keep: Duration) -> DirCache {
        DirCache {
            kept: FxHashMap::default(),
            keep,
            busy: FxHashMap::default(),
            starts: 0,
            renames: 0,
            last_rename: 0,
            forgets: 0,
        }
    }

    /// Forgets the attributes of `id` (another client changed it), or all of them.
    pub fn forget(&mut self, id: Option<InodeId>) {
        self.forgets += 1;
        match id {
            Some(id) => {
                self.kept.remove(&id);
            }
            None => self.kept.clear(),
        }
    }

    /// Notes an operation about to be sent.
    pub fn begin(&mut self, op: &Op) -> Option<Ticket> {
        if op.is_read_only() {
            return None;
        }
        self.starts += 1;
        let start = self.starts;
        let rename = matches!(op, Op::Rename { .. } | Op::Rmdir { .. });
        if rename {
            self.kept.clear();
            self.renames += 1;
            self.last_rename = start;
        }
        let mut ids = op.inode_ids();
        if ids[0] == ids[1] {
            ids[1] = None;
        }
        for id in ids.into_iter().flatten() {
            self.kept.remove(&id);
            let b = self.busy.entry(id).or_insert((0, 0));
            b.0 += 1;
            b.1 = start;
        }
        Some(Ticket {
            ids,
            start,
            rename,
            forgets: self.forgets,
        })
    }

    /// Notes the end of an operation, with the directory attributes its reply carried;
    /// `now` is when the operation was sent (what is kept counts from then).
    pub fn end(&mut self, ticket: Ticket, dirs: &[Attr], now: Instant) {
        if ticket.rename {
            self.renames -= 1;
        }
        let quiet =
            self.renames == 0 && self.last_rename <= ticket.start && self.forgets == ticket.forgets;
        for id in ticket.ids.into_iter().flatten() {
            let Some(b) = self.busy.get_mut(&id) else {
                continue;
            };
            let alone = b.0 == 1 && b.1 == ticket.start;
            b.0 -= 1;
            if b.0 == 0 {
                self.busy.remove(&id);
            }
            if alone
                && quiet
                && let Some(a) = dirs.iter().find(|a| a.id == id)
            {
                self.kept.insert(id, (a.clone(), now));
            }
        }
        if self.kept.len() > PRUNE_AT {
            self.kept
                .retain(|_, (_, at)| now.duration_since(*at) < self.keep);
        }
    }

    /// The attributes of `id` if kept less than `max_age` ago, with the time they stay good.
    pub fn get(&self, id: InodeId, max_age: Duration, now: Instant) -> Option<(Attr, Duration)> {
        let (a, at) = self.kept.get(&id)?;
        let left = max_age
            .min(self.keep)
            .checked_sub(now.duration_since(*at))?;
        (!left.is_zero()).then(|| (a.clone(), left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(id: InodeId, nlink: u32) -> Attr {
        Attr::new(id, 0o040755, nlink)
    }

    fn create(parent: InodeId) -> Op {
        Op::Mknod {
            parent,
            name: b"f".to_vec(),
            mode: 0o100644,
            rdev: 0,
            exclusive: true,
        }
    }

    const TTL: Duration = Duration::from_secs(1);

    #[test]
    fn keeps_the_parent_of_a_lone_change_for_the_ttl() {
        let t0 = Instant::now();
        let mut c = DirCache::default();
        let t = c.begin(&create(5)).unwrap();
        c.end(t, &[dir(5, 2)], t0);
        assert_eq!(c.get(5, TTL, t0).unwrap().0.nlink, 2);
        let (_, left) = c.get(5, TTL, t0 + Duration::from_millis(400)).unwrap();
        assert_eq!(left, Duration::from_millis(600));
        assert!(c.get(5, TTL, t0 + TTL).is_none());
        assert!(c.get(6, TTL, t0).is_none());
    }

    #[test]
    fn overlapping_changes_keep_nothing() {
        let t0 = Instant::now();
        let mut c = DirCache::default();
        let a = c.begin(&create(5)).unwrap();
        let b = c.begin(&create(5)).unwrap();
        c.end(b, &[dir(5, 3)], t0);
        assert!(c.get(5, TTL, t0).is_none());
        c.end(a, &[dir(5, 2)], t0);
        assert!(
            c.get(5, TTL, t0).is_none(),
            "a's reply may predate b's change"
        );
        // A later lone change is kept again.
        let d = c.begin(&create(5)).unwrap();
        c.end(d, &[dir(5, 4)], t0);
        assert_eq!(c.get(5, TTL, t0).unwrap().0.nlink, 4);
    }

    #[test]
    fn any_change_forgets_and_reads_do_not() {
        let t0 = Instant::now();
        let mut c = DirCache::default();
        let a = c.begin(&create(5)).unwrap();
        c.end(a, &[dir(5, 2)], t0);
        assert!(c.begin(&Op::GetAttr { id: 5 }).is_none());
        assert!(c.get(5, TTL, t0).is_some());
        let x = c
            .begin(&Op::SetXattr {
                id: 5,
                name: b"user.a".to_vec(),
                value: vec![],
                flags: 0,
            })
            .unwrap();
        assert!(c.get(5, TTL, t0).is_none());
        c.end(x, &[], t0);
        assert!(c.get(5, TTL, t0).is_none());
    }

    #[test]
    fn renames_forget_everything_and_block_keeping_while_in_flight() {
        let t0 = Instant::now();
        let mut c = DirCache::default();
        let a = c.begin(&create(7)).unwrap();
        c.end(a, &[dir(7, 2)], t0);
        let r = c
            .begin(&Op::Rename {
                parent: 1,
                name: b"x".to_vec(),
                new_parent: 1,
                new_name: b"y".to_vec(),
                flags: 0,
            })
            .unwrap();
        assert!(
            c.get(7, TTL, t0).is_none(),
            "7 may be the directory renamed"
        );
        let b = c.begin(&create(7)).unwrap();
        c.end(b, &[dir(7, 2)], t0);
        assert!(
            c.get(7, TTL, t0).is_none(),
            "the rename may have run after it"
        );
        c.end(r, &[dir(1, 3)], t0);
        assert_eq!(c.get(1, TTL, t0).unwrap().0.nlink, 3);
        // A change that started before the rename ended keeps nothing either.
        let d = c.begin(&create(7)).unwrap();
        let r2 = c.begin(&Op::Rmdir {
            parent: 1,
            name: b"z".to_vec(),
        });
        c.end(r2.unwrap(), &[], t0);
        c.end(d, &[dir(7, 2)], t0);
        assert!(c.get(7, TTL, t0).is_none());
    }
    #[test]
    fn a_reply_overtaken_by_a_callback_is_not_kept() {
        let mut c = DirCache::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let t = c.begin(&create(5)).unwrap();
        c.forget(Some(5));
        c.end(t, &[dir(5, 2)], t0);
        assert!(c.get(5, Duration::from_secs(5), t0).is_none());
        let t = c.begin(&create(5)).unwrap();
        c.end(t, &[dir(5, 2)], t0);
        let (_, left) = c.get(5, Duration::from_secs(9), t0).expect("kept");
        assert_eq!(left, Duration::from_secs(5), "kept for the lease");
    }
}
