//! Which session made each change that may not be durable yet, so that a change that
//! depended on another session's is never answered early.
//!
//! After a crash every client replays the changes it was answered early, each client in
//! its own order but not in the order across clients. A change that needed another
//! session's lost change (an unlink of a name another client had just made, a create in a
//! directory another client had just made, a rename over a file another client had just
//! changed) could then replay first and fail: acknowledged, and lost. So such a change's
//! reply waits until the journal holds what it depended on, and then it is no longer
//! early (its own record is durable with it, which makes it an ordinary reply); its client,
//! which got no reply before a crash, sends it again after the replays.
//!
//! What counts as depending, from the mutations of the change itself:
//! - a name (parent, name) that another session made or removed;
//! - an inode that another session made, removed or changed (its attributes, data, links,
//!   extended attributes), including a directory another session made, as the parent of
//!   a new or removed entry;
//! - for a directory that goes (it must be empty) or whose own attributes change (its
//!   permissions), the entries another session added to or removed from it;
//! - the names a change without mutations found (a rename between two names of one
//!   inode), which also count as changed by it: a later change of them by another session
//!   depends on it.
//!
//! What does not: the times and link count of a directory that another session's entries
//! changed. Clients creating files side by side in one shared directory each keep their
//! early replies (and replay in any order: their names differ).

use kochab_meta::{Mutation, Name};
use kochab_proto::InodeId;
use rustc_hash::FxHashMap;

/// Who last changed something, and in which journal record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Change {
    session: u64,
    lsn: u64,
}

/// The changes of the records not yet known durable, by what they changed.
#[derive(Default)]
pub struct Unsettled {
    names: FxHashMap<(InodeId, Name), Change>,
    inodes: FxHashMap<InodeId, Change>,
    /// Directories whose set of entries changed.
    entries: FxHashMap<InodeId, Change>,
    /// Scratch: the parents and children of this record's entry mutations (a few).
    parents: Vec<InodeId>,
    children: Vec<InodeId>,
    /// Entries at which the next prune runs: twice what the last one kept, at least
    /// [`PRUNE_AT`] (a journal far behind does not make every change prune).
    prune_at: usize,
}

/// Entries kept before those of durable records are dropped: few, so that the maps stay
/// in cache (a record is durable within milliseconds; only those not yet durable matter).
const PRUNE_AT: usize = 4096;

impl Unsettled {
    /// Notes `session`'s record `lsn` with mutations `muts`, the journal being durable up
    /// to `durable`. Returns the LSN of the latest record above `durable` of another session
    /// that this change depended on (0: none): its reply must not leave before that one is
    /// durable.
    pub fn note(&mut self, session: u64, muts: &[Mutation], lsn: u64, durable: u64) -> u64 {
        let this = Change { session, lsn };
        // The server's own records (session 0: cleanup of ended sessions, orphans,
        // reclaims) are redone by recovery, never replayed by a client: nothing waits for
        // them.
        let other = |c: Option<&Change>| match c {
            Some(c) if c.session != session && c.session != 0 && c.lsn > durable => c.lsn,
            _ => 0,
        };
        self.parents.clear();
        self.children.clear();
        for m in muts {
            match m {
                Mutation::PutDentry { parent, child, .. } => {
                    self.parents.push(*parent);
                    self.children.push(*child);
                }
                Mutation::DropDentry { parent, .. } => {
                    self.parents.push(*parent);
                }
                _ => {}
            }
        }
        let mut depends = 0;
        for m in muts {
            match m {
                Mutation::PutDentry { parent, name, .. }
                | Mutation::DropDentry { parent, name } => {
                    let key = (*parent, name.clone());
                    depends = depends
                        .max(other(self.names.get(&key)))
                        .max(other(self.inodes.get(parent)));
                    self.names.insert(key, this);
                    self.entries.insert(*parent, this);
                }
                Mutation::PutInode { id, .. } => {
                    // A parent's times and link count, from its entries' changes: the
                    // entries themselves were checked above.
                    if self.parents.contains(id) && !self.children.contains(id) {
                        continue;
                    }
                    // A directory's own attributes (its permissions): the entries
                    // another session made in it depend on them as they were.
                    depends = depends
                        .max(other(self.inodes.get(id)))
                        .max(other(self.entries.get(id)));
                    self.inodes.insert(*id, this);
                }
                Mutation::DropInode { id } => {
                    depends = depends
                        .max(other(self.inodes.get(id)))
                        .max(other(self.entries.get(id)));
                    self.inodes.insert(*id, this);
                }
                Mutation::SetXattr { id, .. }
                | Mutation::DropXattr { id, .. }
                | Mutation::PutChunk { id, .. }
                | Mutation::DropChunks { id, .. } => {
                    depends = depends.max(other(self.inodes.get(id)));
                    self.inodes.insert(*id, this);
                }
                // Reclaims follow the inode's own change in the same record; an id
                // region's high-water mark only rises (any order gives the same).
                Mutation::PutReclaim { .. }
                | Mutation::DropReclaim { .. }
                | Mutation::SetRegionNext { .. } => {}
            }
        }
        if self.len() > self.prune_at.max(PRUNE_AT) {
            self.prune(durable);
        }
        depends
    }

    /// Notes `session`'s change at `lsn` that succeeded without mutations (a rename
    /// between two names of one inode, journaled as a record of its own) as a change of
    /// the names it found: a later change of them by another session depends on it, for
    /// its replay needs them as they were. Returns the latest record above `durable` of
    /// another session that changed those names (0: none).
    pub fn note_found(
        &mut self,
        session: u64,
        names: &[(InodeId, &[u8])],
        lsn: u64,
        durable: u64,
    ) -> u64 {
        let mut depends = 0;
        for (parent, name) in names {
            let key = (*parent, Name::new(name));
            if let Some(c) = self.names.get(&key)
                && c.session != session
                && c.lsn > durable
            {
                depends = depends.max(c.lsn);
            }
            self.names.insert(key, Change { session, lsn });
        }
        depends
    }

    /// Forgets the changes of records durable by `durable`.
    pub fn prune(&mut self, durable: u64) {
        self.names.retain(|_, c| c.lsn > durable);
        self.inodes.retain(|_, c| c.lsn > durable);
        self.entries.retain(|_, c| c.lsn > durable);
        self.prune_at = 2 * self.len();
    }

    fn len(&self) -> usize {
        self.names.len() + self.inodes.len() + self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::Inode;
    use kochab_proto::FileKind;

    const DIR: InodeId = 10;

    fn put_dentry(parent: InodeId, name: &str, child: InodeId) -> Mutation {
        Mutation::PutDentry {
            parent,
            name: Name::new(name.as_bytes()),
            child,
            kind: FileKind::File,
        }
    }

    fn drop_dentry(parent: InodeId, name: &str) -> Mutation {
        Mutation::DropDentry {
            parent,
            name: Name::new(name.as_bytes()),
        }
    }

    fn put_inode(id: InodeId) -> Mutation {
        Mutation::PutInode {
            id,
            inode: Inode::new(0o100644, 0, 0, 0),
        }
    }

    /// A create of `name` -> `id` in `parent` (entry, new inode, parent's times).
    fn create(parent: InodeId, name: &str, id: InodeId) -> Vec<Mutation> {
        vec![
            put_dentry(parent, name, id),
            put_inode(id),
            put_inode(parent),
        ]
    }

    #[test]
    fn creates_side_by_side_in_one_directory_do_not_depend() {
        let mut u = Unsettled::default();
        assert_eq!(u.note(1, &create(DIR, "a", 100), 5, 0), 0);
        assert_eq!(u.note(2, &create(DIR, "b", 101), 6, 0), 0);
        assert_eq!(u.note(3, &create(DIR, "c", 102), 7, 0), 0);
    }

    #[test]
    fn a_change_of_another_sessions_name_depends_on_it_until_durable() {
        let mut u = Unsettled::default();
        u.note(1, &create(DIR, "a", 100), 5, 0);
        let unlink = vec![
            drop_dentry(DIR, "a"),
            Mutation::DropInode { id: 100 },
            put_inode(DIR),
        ];
        assert_eq!(
            u.note(2, &unlink, 6, 4),
            5,
            "session 1's create is not durable"
        );
        let mut u = Unsettled::default();
        u.note(1, &create(DIR, "a", 100), 5, 0);
        assert_eq!(u.note(2, &unlink, 6, 5), 0, "durable: nothing to wait for");
        let mut u = Unsettled::default();
        u.note(1, &create(DIR, "a", 100), 5, 0);
        assert_eq!(
            u.note(1, &unlink, 6, 0),
            0,
            "a session replays in its own order"
        );
    }

    #[test]
    fn a_create_in_a_directory_another_session_made_depends_on_it() {
        let mut u = Unsettled::default();
        let sub = 200;
        u.note(1, &create(DIR, "sub", sub), 5, 0);
        assert_eq!(u.note(2, &create(sub, "x", 201), 6, 0), 5);
    }

    #[test]
    fn removing_a_directory_another_session_emptied_depends_on_it() {
        let mut u = Unsettled::default();
        let sub = 200;
        u.note(1, &create(DIR, "sub", sub), 3, 0);
        u.note(1, &create(sub, "x", 201), 4, 0);
        // Durable up to 4; session 2 empties it, session 3 removes it.
        let unlink = vec![
            drop_dentry(sub, "x"),
            Mutation::DropInode { id: 201 },
            put_inode(sub),
        ];
        assert_eq!(u.note(2, &unlink, 5, 4), 0);
        let rmdir = vec![
            drop_dentry(DIR, "sub"),
            Mutation::DropInode { id: sub },
            put_inode(DIR),
        ];
        assert_eq!(u.note(3, &rmdir, 6, 4), 5);
    }

    #[test]
    fn a_rename_without_mutations_depends_on_and_guards_the_names_it_found() {
        let mut u = Unsettled::default();
        u.note(1, &create(DIR, "a", 100), 5, 0);
        assert_eq!(u.note_found(2, &[(DIR, b"a"), (DIR, b"a")], 6, 4), 5);
        assert_eq!(u.note_found(3, &[(DIR, b"b")], 7, 6), 0);
        // Session 1 renames `a` away after session 2 found it: its replay must not run
        // before session 2's.
        let rename = vec![
            drop_dentry(DIR, "a"),
            put_dentry(DIR, "c", 100),
            put_inode(DIR),
        ];
        assert_eq!(u.note(1, &rename, 8, 5), 6);
    }

    #[test]
    fn a_change_of_a_directorys_permissions_depends_on_entries_made_in_it() {
        let mut u = Unsettled::default();
        u.note(1, &create(DIR, "a", 100), 5, 0);
        assert_eq!(u.note(2, &[put_inode(DIR)], 6, 4), 5);
    }

    #[test]
    fn a_change_of_a_file_another_session_changed_depends_on_it() {
        let mut u = Unsettled::default();
        let f = 100;
        u.note(1, &[put_inode(f)], 5, 0);
        assert_eq!(u.note(2, &[put_inode(f)], 6, 0), 5);
        u.prune(6);
        assert_eq!(u.note(3, &[put_inode(f)], 7, 6), 0);
    }
}
