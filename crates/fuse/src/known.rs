//! Files this mount made, by name, with the attributes it last showed the kernel for each,
//! so that a lookup of one in a directory whose every name the client knows (a complete
//! directory, `kochab_client::complete`) is answered without a round trip.
//!
//! The kernel looks a name up again whenever its entry's TTL has run out: every `rm` of a
//! file made more than a lease ago cost a lookup at the server before its unlink. In a
//! complete directory the client knows the name is there and no other client changed it
//! (that would have called it back and ended the completeness); this map says which inode
//! it names. Both are kept under the kernel's lock of the directory: a name is added when a
//! create's reply is handed to the kernel, taken away before an unlink or rename of it is
//! sent.
//!
//! The attributes are the last ones a reply showed the kernel for the inode, so answering
//! with them changes nothing the kernel knows. Anything that may make the kernel's picture
//! differ (a write, a setattr, a link, an xattr change, a callback naming the inode) drops
//! them for good, and then the lookup goes to the servers. They are shown with the TTL the
//! lease they came with has left (none once it ran out: the kernel asks for them before
//! using them). Only files with one link are answered for (another name's unlink changes
//! the link count).
//!
//! A state machine: time comes in as arguments.

use kochab_proto::{Attr, FileKind, InodeId, Invalidation};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Names kept at most; beyond it, all are forgotten.
const NAMES_MAX: usize = 1 << 18;

struct Shown {
    attr: Attr,
    /// When the lease the attributes came with runs out at the latest (`None`: unknown).
    until: Option<Instant>,
}

#[derive(Default)]
pub struct KnownNames {
    dirs: FxHashMap<InodeId, FxHashMap<Box<[u8]>, InodeId>>,
    shown: FxHashMap<InodeId, Shown>,
    names: usize,
}

impl KnownNames {
    /// This mount made `dir/name` (create, mknod, symlink, mkdir); `a` is what its reply
    /// shows the kernel, under a lease until `until`. Only regular files are kept; a new
    /// directory starts empty.
    pub fn made(&mut self, dir: InodeId, name: &[u8], a: &Attr, until: Option<Instant>) {
        if a.kind() == Some(FileKind::Dir) {
            self.forget_dir(a.id);
        }
        if a.kind() != Some(FileKind::File) {
            // Never answered for (see `get`); the name was not there before it was made.
            return;
        }
        if self.names >= NAMES_MAX {
            self.clear();
        }
        let names = self.dirs.entry(dir).or_default();
        if let Some(old) = names.insert(name.into(), a.id) {
            self.shown.remove(&old);
        } else {
            self.names += 1;
        }
        self.shown.insert(
            a.id,
            Shown {
                attr: a.clone(),
                until,
            },
        );
    }

    /// `dir/name` is about to be unlinked, renamed or replaced.
    pub fn gone(&mut self, dir: InodeId, name: &[u8]) {
        if let Some(names) = self.dirs.get_mut(&dir)
            && let Some(id) = names.remove(name)
        {
            self.names -= 1;
            self.shown.remove(&id);
        }
    }

    /// The kernel's picture of inode `id` may no longer be the one kept.
    pub fn changed(&mut self, id: InodeId) {
        self.shown.remove(&id);
    }

    /// A reply shows the kernel `a`: kept as the kernel's picture of a known file.
    pub fn shows(&mut self, a: &Attr) {
        if let Some(s) = self.shown.get_mut(&a.id)
            && s.attr != *a
        {
            s.attr = a.clone();
            s.until = None;
        }
    }

    /// What a callback drops.
    pub fn called_back(&mut self, list: &[Invalidation]) {
        for what in list {
            match what {
                Invalidation::Entry { parent, .. } => self.forget_dir(*parent),
                Invalidation::Names { dir } => self.forget_dir(*dir),
                Invalidation::Inode { id } => {
                    self.shown.remove(id);
                    self.forget_dir(*id);
                }
                Invalidation::Everything => self.clear(),
                Invalidation::Flush { .. } | Invalidation::Hold { .. } => {}
            }
        }
    }

    /// The file `dir/name` names, with its attributes as the kernel last saw them and how
    /// long they stay good, if kept. The caller checks that the client still knows `dir`
    /// complete with `name` in it.
    pub fn get(&self, dir: InodeId, name: &[u8], now: Instant) -> Option<(&Attr, Duration)> {
        let id = self.dirs.get(&dir)?.get(name)?;
        let s = self.shown.get(id)?;
        if s.attr.kind() != Some(FileKind::File) || s.attr.nlink != 1 {
            return None;
        }
        let ttl = s
            .until
            .and_then(|u| u.checked_duration_since(now))
            .unwrap_or_default();
        Some((&s.attr, ttl))
    }

    fn forget_dir(&mut self, dir: InodeId) {
        if let Some(names) = self.dirs.remove(&dir) {
            self.names -= names.len();
            for id in names.values() {
                self.shown.remove(id);
            }
        }
    }

    fn clear(&mut self) {
        self.dirs.clear();
        self.shown.clear();
        self.names = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::mode::{S_IFDIR, S_IFREG};

    fn attr(id: InodeId, mode: u32) -> Attr {
        Attr::new(id, mode, if mode & S_IFDIR != 0 { 2 } else { 1 })
    }

    #[test]
    fn a_made_file_is_answered_until_it_goes_or_changes() {
        let t = Instant::now();
        let mut k = KnownNames::default();
        k.made(1, b"d", &attr(7, S_IFDIR | 0o755), None);
        assert!(k.get(1, b"d", t).is_none(), "directories go to the servers");
        let until = t + Duration::from_secs(5);
        k.made(7, b"a", &attr(10, S_IFREG | 0o644), Some(until));
        k.made(7, b"b", &attr(11, S_IFREG | 0o644), Some(until));
        let (a, ttl) = k.get(7, b"a", t).unwrap();
        assert_eq!((a.id, ttl), (10, Duration::from_secs(5)));
        assert_eq!(k.get(7, b"a", until).unwrap().1, Duration::ZERO);
        // A getattr's reply: kept, with no lease known.
        let mut newer = attr(10, S_IFREG | 0o600);
        newer.size = 3;
        k.shows(&newer);
        assert_eq!(k.get(7, b"a", t).unwrap(), (&newer, Duration::ZERO));
        k.changed(10);
        assert!(k.get(7, b"a", t).is_none(), "a write drops the attributes");
        k.shows(&newer);
        assert!(k.get(7, b"a", t).is_none(), "and no reply brings them back");
        k.gone(7, b"b");
        assert!(k.get(7, b"b", t).is_none());
        let mut linked = attr(12, S_IFREG | 0o644);
        linked.nlink = 2;
        k.made(7, b"c", &linked, None);
        assert!(k.get(7, b"c", t).is_none(), "more than one link");
        assert_eq!(k.names, 2, "a, c: no directory kept");
    }

    #[test]
    fn callbacks_drop_what_they_name() {
        let t = Instant::now();
        let mut k = KnownNames::default();
        k.made(7, b"a", &attr(10, S_IFREG), None);
        k.made(8, b"a", &attr(20, S_IFREG), None);
        k.made(9, b"a", &attr(30, S_IFREG), None);
        k.called_back(&[Invalidation::Entry {
            parent: 7,
            name: b"x".to_vec(),
        }]);
        assert!(k.get(7, b"a", t).is_none());
        k.called_back(&[Invalidation::Inode { id: 20 }]);
        assert!(k.get(8, b"a", t).is_none());
        assert!(k.get(9, b"a", t).is_some());
        // A directory made again under an id seen before starts empty.
        k.made(1, b"again", &attr(9, S_IFDIR), None);
        assert!(k.get(9, b"a", t).is_none());
        k.made(9, b"a", &attr(30, S_IFREG), None);
        k.called_back(&[Invalidation::Everything]);
        assert!(k.get(9, b"a", t).is_none());
        assert_eq!((k.names, k.shown.len()), (0, 0));
    }
}
