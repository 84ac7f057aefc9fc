//! Directories whose every name this client knows, so that a lookup of a name absent from
//! one is answered without a round trip (CephFS's "complete" directories).
//!
//! A directory becomes complete when this client makes it: the server grants the client a
//! lease on the names of a directory it creates, under the lock that creates it, so from
//! that instant no other client can add or remove a name in it without first calling this
//! client back. From then on the client follows its own changes (creates add a name,
//! unlinks and renames take one away) and renews the lease with every operation that reads
//! the directory's names (the server grants again on each). The directory stops being
//! complete when a callback names it, when the connection that held its lease is lost,
//! when any change of this client in it fails (the outcome may be unknown), or when the
//! lease runs out (counted from when the renewing request was *sent*, which is before the
//! server granted it).
//!
//! Names are kept as 64-bit hashes with a count: a hash collision makes an absent name look
//! present (one round trip, never a wrong answer), and a count never falls below the names
//! really there.
//!
//! A state machine: time comes in as arguments.

use kochab_proto::{Attr, Errno, FileKind, FsError, InodeId, NAME_MAX, Op, Reply, rename_flags};
use rustc_hash::FxHashMap;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

/// Names kept over all complete directories at most; beyond it, all are forgotten.
const NAMES_MAX: usize = 1 << 22;

/// What one operation may do to the names of complete directories, taken before it is sent
/// (the operation itself moves into the request).
#[derive(Debug)]
pub enum Change {
    /// Reads the names of `dir` (a lookup): renews its lease when it succeeds, or when
    /// the name is absent.
    Read { dir: InodeId, name: u64 },
    /// Adds `name` to `dir` (create, mknod, symlink, link); a mkdir also makes a new
    /// complete directory.
    Add {
        dir: InodeId,
        name: u64,
        mkdir: bool,
    },
    /// Removes `name` from `dir` (unlink, rmdir).
    Remove { dir: InodeId, name: u64 },
    Rename {
        from: (InodeId, u64),
        to: (InodeId, u64),
        flags: u32,
    },
}

impl Change {
    /// The directories whose names it reads or changes.
    fn dirs(&self) -> impl Iterator<Item = InodeId> {
        let (a, b) = match *self {
            Change::Read { dir, .. } | Change::Add { dir, .. } | Change::Remove { dir, .. } => {
                (dir, None)
            }
            Change::Rename { from, to, .. } => (from.0, Some(to.0)),
        };
        std::iter::once(a).chain(b)
    }
}

/// Hash of a name as the complete directories keep it.
pub fn name_hash(name: &[u8]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    name.hash(&mut h);
    h.finish()
}

impl Change {
    /// What `op` may change, if it touches names at all.
    pub fn of(op: &Op) -> Option<Change> {
        Some(match op {
            Op::Lookup { parent, name } => Change::Read {
                dir: *parent,
                name: name_hash(name),
            },
            Op::Mknod { parent, name, .. }
            | Op::Symlink { parent, name, .. }
            | Op::Create { parent, name, .. } => Change::Add {
                dir: *parent,
                name: name_hash(name),
                mkdir: false,
            },
            Op::Mkdir { parent, name, .. } => Change::Add {
                dir: *parent,
                name: name_hash(name),
                mkdir: true,
            },
            Op::Link {
                new_parent,
                new_name,
                ..
            } => Change::Add {
                dir: *new_parent,
                name: name_hash(new_name),
                mkdir: false,
            },
            Op::Unlink { parent, name } | Op::Rmdir { parent, name } => Change::Remove {
                dir: *parent,
                name: name_hash(name),
            },
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => Change::Rename {
                from: (*parent, name_hash(name)),
                to: (*new_parent, name_hash(new_name)),
                flags: *flags,
            },
            _ => return None,
        })
    }
}

struct Dir {
    /// The lease on the names runs out no earlier than this.
    until: Instant,
    names: FxHashMap<u64, u32>,
}

/// The complete directories of one client.
pub struct CompleteDirs {
    lease: Duration,
    dirs: FxHashMap<InodeId, Dir>,
    names: usize,
    /// Callbacks seen: a mkdir that a callback overtook is not trusted (see `ended`).
    callbacks: u64,
}

impl Default for CompleteDirs {
    fn default() -> Self {
        CompleteDirs::new(Duration::ZERO)
    }
}

impl CompleteDirs {
    /// Complete directories under leases of `lease` (zero: none are ever complete).
    pub fn new(lease: Duration) -> CompleteDirs {
        CompleteDirs {
            lease,
            dirs: FxHashMap::default(),
            names: 0,
            callbacks: 0,
        }
    }

    /// Sets the lease length (known once connected).
    pub fn set_lease(&mut self, lease: Duration) {
        self.lease = lease;
    }

    /// To take before an operation is sent, and hand to [`CompleteDirs::ended`].
    pub fn seen(&self) -> u64 {
        self.callbacks
    }

    /// How long `dir` is known to hold no `name` from `now`, if it is. Only for names a
    /// server would look up: any other (empty, too long, with '/' or NUL, "." or "..") is
    /// the server's to refuse.
    pub fn absent(&self, dir: InodeId, name: &[u8], now: Instant) -> Option<Duration> {
        let plain = !name.is_empty()
            && name.len() <= NAME_MAX
            && name != b"."
            && name != b".."
            && !name.contains(&b'/')
            && !name.contains(&0);
        if !plain {
            return None;
        }
        let d = self.dirs.get(&dir)?;
        let left = d.until.checked_duration_since(now)?;
        (!left.is_zero() && !d.names.contains_key(&name_hash(name))).then_some(left)
    }

    /// How long `dir` is known to hold a name hashed as `name` from `now`, if it is (the
    /// caller knows which name: a hash may stand for several).
    pub fn present(&self, dir: InodeId, name: &[u8], now: Instant) -> Option<Duration> {
        let d = self.dirs.get(&dir)?;
        let left = d.until.checked_duration_since(now)?;
        (!left.is_zero() && d.names.contains_key(&name_hash(name))).then_some(left)
    }

    /// A callback named `dir` (`None`: everything, the connection holding the leases was
    /// lost).
    pub fn called_back(&mut self, dir: Option<InodeId>) {
        self.callbacks += 1;
        match dir {
            Some(dir) => self.forget(dir),
            None => self.forget_all(),
        }
    }

    fn forget(&mut self, dir: InodeId) {
        if let Some(d) = self.dirs.remove(&dir) {
            self.names -= d.names.len();
        }
    }

    fn forget_all(&mut self) {
        self.dirs.clear();
        self.names = 0;
    }

    /// Notes the end of an operation that was sent at `sent`, when [`CompleteDirs::seen`]
    /// said `seen`, with its outcome, now.
    pub fn ended(
        &mut self,
        change: &Change,
        seen: u64,
        outcome: Result<&Reply, &FsError>,
        sent: Instant,
    ) {
        self.ended_at(change, seen, outcome, sent, Instant::now());
    }

    /// [`CompleteDirs::ended`] with the reply in at `now`.
    pub fn ended_at(
        &mut self,
        change: &Change,
        seen: u64,
        outcome: Result<&Reply, &FsError>,
        sent: Instant,
        now: Instant,
    ) {
        if self.lease.is_zero() {
            return;
        }
        // A lease that ran out before this reply came in may have run out before the
        // server granted the new one: in between, another client could change names
        // without calling this one back, so the picture is no longer known complete. (The
        // grant came before `now`; a lease still held at `now` was held at the grant.)
        for dir in change.dirs() {
            if self.dirs.get(&dir).is_some_and(|d| d.until <= now) {
                self.forget(dir);
            }
        }
        let until = sent + self.lease;
        let reply = outcome.ok();
        match (change, reply) {
            (&Change::Read { dir, name }, Some(_)) => {
                // A name found that is not kept: this client's picture was wrong.
                if self.has(dir) && !self.dirs[&dir].names.contains_key(&name) {
                    self.forget(dir);
                }
                self.renew(dir, until);
            }
            // An absent name renews the lease too; other errors grant nothing.
            (&Change::Read { dir, .. }, None) => {
                if matches!(outcome, Err(e) if e.errno == Errno::ENOENT) {
                    self.renew(dir, until);
                }
            }
            (&Change::Add { dir, name, mkdir }, Some(reply)) => {
                self.add(dir, name);
                self.renew(dir, until);
                // A callback that overtook the reply (it may come on another connection)
                // may be about a name someone added to the new directory already.
                if mkdir
                    && seen == self.callbacks
                    && let Some(a) = made_dir(reply)
                {
                    self.made(a.id, sent);
                }
            }
            (&Change::Remove { dir, name }, Some(_)) => {
                self.remove(dir, name);
                self.renew(dir, until);
            }
            (&Change::Rename { from, to, flags }, Some(_)) => {
                if flags & (rename_flags::RENAME_EXCHANGE | rename_flags::RENAME_WHITEOUT) == 0 {
                    self.remove(from.0, from.1);
                }
                self.add(to.0, to.1);
                self.renew(from.0, until);
                self.renew(to.0, until);
            }
            (Change::Add { dir, .. } | Change::Remove { dir, .. }, None) => self.forget(*dir),
            (Change::Rename { from, to, .. }, None) => {
                self.forget(from.0);
                self.forget(to.0);
            }
        }
        if self.names > NAMES_MAX {
            self.forget_all();
        }
    }

    fn has(&self, dir: InodeId) -> bool {
        self.dirs.contains_key(&dir)
    }

    fn renew(&mut self, dir: InodeId, until: Instant) {
        if let Some(d) = self.dirs.get_mut(&dir) {
            d.until = d.until.max(until);
        }
    }

    fn add(&mut self, dir: InodeId, name: u64) {
        if let Some(d) = self.dirs.get_mut(&dir) {
            let n = d.names.entry(name).or_insert(0);
            if *n == 0 {
                // `names` counts kept hashes, as `remove` and `forget` take them away.
                self.names += 1;
            }
            *n += 1;
        }
    }

    fn remove(&mut self, dir: InodeId, name: u64) {
        let Some(d) = self.dirs.get_mut(&dir) else {
            return;
        };
        match d.names.get_mut(&name) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                d.names.remove(&name);
                self.names -= 1;
            }
            // Removed a name never seen: the picture was wrong.
            None => self.forget(dir),
        }
    }

    /// A directory this client made with a mkdir sent at `sent`: empty, its names leased
    /// from the reply's grant.
    fn made(&mut self, dir: InodeId, sent: Instant) {
        self.forget(dir);
        self.dirs.insert(
            dir,
            Dir {
                until: sent + self.lease,
                names: FxHashMap::default(),
            },
        );
        // Now and then, drop the directories whose leases had run out when it was sent.
        if self.dirs.len().is_power_of_two() && self.dirs.len() >= 1024 {
            let mut dropped = 0;
            self.dirs.retain(|_, d| {
                let live = d.until > sent;
                if !live {
                    dropped += d.names.len();
                }
                live
            });
            self.names -= dropped;
        }
    }
}

/// The new directory a mkdir's reply shows, if it shows one that never had a name in it:
/// a retried mkdir is answered from the reply cache with the directory as it is *now*, and
/// its lease is granted now, so names added in between would be missed. A directory's
/// mtime equals its birth time until a name is added or removed, and its link count is 2
/// until a subdirectory is made.
fn made_dir(reply: &Reply) -> Option<&Attr> {
    let a = reply.entry()?;
    (a.kind() == Some(FileKind::Dir) && a.mtime == a.btime && a.nlink == 2).then_some(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::fs_err;

    const LEASE: Duration = Duration::from_secs(5);

    fn new_dir(id: InodeId, t: i64) -> Reply {
        Reply::Entry(Attr {
            id,
            generation: 1,
            mode: 0o040755,
            nlink: 2,
            uid: 0,
            gid: 0,
            size: 0,
            blocks: 0,
            atime: t,
            mtime: t,
            ctime: t,
            btime: t,
            rdev: 0,
            blksize: 4096,
        })
    }

    fn mkdir(parent: InodeId, name: &str) -> Change {
        Change::of(&Op::Mkdir {
            parent,
            name: name.into(),
            mode: 0o755,
        })
        .unwrap()
    }

    fn create(parent: InodeId, name: &str) -> Change {
        Change::of(&Op::Mknod {
            parent,
            name: name.into(),
            mode: 0o100644,
            rdev: 0,
            exclusive: true,
        })
        .unwrap()
    }

    fn unlink(parent: InodeId, name: &str) -> Change {
        Change::of(&Op::Unlink {
            parent,
            name: name.into(),
        })
        .unwrap()
    }

    #[test]
    fn a_made_directory_knows_its_names_until_the_lease_runs_out() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        c.ended(&mkdir(1, "d"), c.seen(), Ok(&new_dir(7, 100)), t0);
        assert!(
            c.absent(1, b"d", t0).is_none(),
            "its parent is not complete"
        );
        assert_eq!(c.absent(7, b"a", t0), Some(LEASE));
        for odd in [&b""[..], b".", b"..", b"a/b", b"a\0", &[b'n'; 256]] {
            assert!(c.absent(7, odd, t0).is_none(), "the server refuses {odd:?}");
        }
        let t1 = t0 + Duration::from_secs(1);
        c.ended(&create(7, "a"), c.seen(), Ok(&Reply::Empty), t1);
        assert!(c.absent(7, b"a", t1).is_none());
        // The create renewed the lease from when it was sent.
        assert_eq!(c.absent(7, b"b", t1), Some(LEASE));
        c.ended(&unlink(7, "a"), c.seen(), Ok(&Reply::Empty), t1);
        assert!(c.absent(7, b"a", t1).is_some());
        assert!(c.absent(7, b"b", t1 + LEASE).is_none(), "lease ran out");
    }

    #[test]
    fn failures_callbacks_and_surprises_forget_the_directory() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        let made =
            |c: &mut CompleteDirs, id| c.ended(&mkdir(1, "d"), c.seen(), Ok(&new_dir(id, 5)), t0);
        made(&mut c, 7);
        c.ended(&create(7, "a"), c.seen(), Err(&fs_err!(EIO, "lost")), t0);
        assert!(
            c.absent(7, b"b", t0).is_none(),
            "failed change: outcome unknown"
        );
        made(&mut c, 7);
        c.called_back(Some(7));
        assert!(c.absent(7, b"b", t0).is_none(), "called back");
        made(&mut c, 7);
        let lookup = Change::of(&Op::Lookup {
            parent: 7,
            name: b"x".to_vec(),
        })
        .unwrap();
        c.ended(&lookup, c.seen(), Ok(&Reply::Empty), t0);
        assert!(
            c.absent(7, b"b", t0).is_none(),
            "found a name it did not know"
        );
        made(&mut c, 7);
        c.ended(&unlink(7, "never"), c.seen(), Ok(&Reply::Empty), t0);
        assert!(
            c.absent(7, b"b", t0).is_none(),
            "removed a name it did not know"
        );
        made(&mut c, 7);
        c.called_back(None);
        assert!(c.absent(7, b"b", t0).is_none());
    }

    #[test]
    fn absent_names_renew_and_an_overtaking_callback_spoils_a_mkdir() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        c.ended(&mkdir(1, "d"), c.seen(), Ok(&new_dir(7, 5)), t0);
        let lookup = Change::of(&Op::Lookup {
            parent: 7,
            name: b"x".to_vec(),
        })
        .unwrap();
        let t1 = t0 + Duration::from_secs(4);
        c.ended(&lookup, c.seen(), Err(&fs_err!(EACCES, "no")), t1);
        assert!(
            c.absent(7, b"x", t0 + LEASE).is_none(),
            "EACCES renews nothing"
        );
        c.ended(&lookup, c.seen(), Err(&fs_err!(ENOENT, "absent")), t1);
        assert!(c.absent(7, b"x", t0 + LEASE).is_some(), "ENOENT renews");
        // A callback arrives between the mkdir's sending and its reply.
        let seen = c.seen();
        c.called_back(Some(99));
        c.ended(&mkdir(1, "e"), seen, Ok(&new_dir(8, 5)), t0);
        assert!(c.absent(8, b"x", t0).is_none());
        assert!(c.absent(7, b"x", t1).is_some(), "other directories stay");
    }

    #[test]
    fn a_lease_that_ran_out_is_not_renewed() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        c.ended_at(&mkdir(1, "d"), c.seen(), Ok(&new_dir(7, 5)), t0, t0);
        let lookup = Change::of(&Op::Lookup {
            parent: 7,
            name: b"x".to_vec(),
        })
        .unwrap();
        let absent = fs_err!(ENOENT, "absent");
        // Renewed while held: stays complete.
        let t1 = t0 + Duration::from_secs(4);
        c.ended_at(&lookup, c.seen(), Err(&absent), t1, t1);
        assert!(c.absent(7, b"y", t0 + LEASE).is_some());
        // Sent while held, answered after it ran out: another client may have added a
        // name unseen in between (no callback is due once a lease ran out).
        let late = t1 + LEASE + Duration::from_millis(1);
        c.ended_at(&lookup, c.seen(), Err(&absent), t1 + LEASE, late);
        assert!(c.absent(7, b"y", late).is_none(), "no longer complete");
        let later = late + Duration::from_secs(1);
        c.ended_at(&lookup, c.seen(), Err(&absent), later, later);
        assert!(c.absent(7, b"y", later).is_none(), "and never again");
    }

    #[test]
    fn a_directory_answered_from_the_reply_cache_is_not_complete() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        let Reply::Entry(mut a) = new_dir(7, 5) else {
            unreachable!()
        };
        a.mtime = 6;
        c.ended(&mkdir(1, "d"), c.seen(), Ok(&Reply::Entry(a.clone())), t0);
        assert!(c.absent(7, b"b", t0).is_none(), "a name came and went");
        a.mtime = 5;
        a.nlink = 3;
        c.ended(&mkdir(1, "d"), c.seen(), Ok(&Reply::Entry(a)), t0);
        assert!(c.absent(7, b"b", t0).is_none(), "has a subdirectory");
        let with_dirs = Reply::WithDirs {
            reply: Box::new(new_dir(8, 5)),
            dirs: vec![],
        };
        c.ended(&mkdir(1, "e"), c.seen(), Ok(&with_dirs), t0);
        assert!(c.absent(8, b"b", t0).is_some());
    }

    #[test]
    fn renames_move_names_and_exchanges_keep_both() {
        let t0 = Instant::now();
        let mut c = CompleteDirs::new(LEASE);
        c.ended(&mkdir(1, "d"), c.seen(), Ok(&new_dir(7, 5)), t0);
        c.ended(&create(7, "a"), c.seen(), Ok(&Reply::Empty), t0);
        let rename = |from: &str, to: &str, flags| {
            Change::of(&Op::Rename {
                parent: 7,
                name: from.into(),
                new_parent: 7,
                new_name: to.into(),
                flags,
            })
            .unwrap()
        };
        c.ended(&rename("a", "b", 0), c.seen(), Ok(&Reply::Empty), t0);
        assert!(c.absent(7, b"a", t0).is_some());
        assert!(c.absent(7, b"b", t0).is_none());
        c.ended(&create(7, "a"), c.seen(), Ok(&Reply::Empty), t0);
        c.ended(
            &rename("a", "b", rename_flags::RENAME_EXCHANGE),
            c.seen(),
            Ok(&Reply::Empty),
            t0,
        );
        assert!(c.absent(7, b"a", t0).is_none());
        assert!(c.absent(7, b"b", t0).is_none());
        // b was there twice over (replaced, then exchanged): one unlink leaves it "maybe".
        c.ended(&unlink(7, "b"), c.seen(), Ok(&Reply::Empty), t0);
        assert!(c.absent(7, b"b", t0).is_none());
    }
}
