//! Tables this server released lately, kept in memory with the images that describe them.
//!
//! A borrow moves a table to the borrower and back. Loading it again from its images means
//! deserializing the whole table each time, which made every multi-server operation cost
//! milliseconds of CPU on both servers. When a released table comes back and its manifest
//! still lists the images it was released with (the same base and deltas, in order),
//! followed only by deltas written while it was away, the kept copy plus those deltas is
//! exactly what a load from the store would build. Anything else (a full image written
//! meanwhile, a copy too old) falls back to the store.

use crate::manifest::ImageRef;
use kochab_meta::Table;
use std::collections::VecDeque;

/// Tables kept at most (the oldest goes first).
const KEPT_TABLES_MAX: usize = 8;
/// Inodes kept at most over all kept tables (about 172 bytes each).
const KEPT_INODES_MAX: u64 = 1 << 20;

/// A released table and the images its manifest listed when it was released.
pub struct Released {
    pub table: Table,
    pub images: Vec<ImageRef>,
}

#[derive(Default)]
pub struct ReleasedTables {
    kept: VecDeque<Released>,
}

impl ReleasedTables {
    /// Keeps `table`, released with `images`, in place of any older copy of it.
    pub fn keep(&mut self, table: Table, images: Vec<ImageRef>) {
        self.kept.retain(|r| r.table.lo != table.lo);
        if table.inode_count() > KEPT_INODES_MAX {
            return;
        }
        self.kept.push_back(Released { table, images });
        while self.kept.len() > KEPT_TABLES_MAX || self.inodes() > KEPT_INODES_MAX {
            self.kept.pop_front();
        }
    }

    /// Takes the kept copy of the table whose id is `lo`, if any.
    pub fn take(&mut self, lo: u64) -> Option<Released> {
        let i = self.kept.iter().position(|r| r.table.lo == lo)?;
        self.kept.remove(i)
    }

    fn inodes(&self) -> u64 {
        self.kept.iter().map(|r| r.table.inode_count()).sum()
    }
}

impl Released {
    /// The images of `listed` still to apply to this copy: those after the ones it was
    /// released with, when `listed` starts with exactly those and adds only deltas.
    pub fn missing<'a>(&self, listed: &'a [ImageRef]) -> Option<&'a [ImageRef]> {
        let rest = listed.strip_prefix(self.images.as_slice())?;
        (!self.images.is_empty() && rest.iter().all(|i| !i.full)).then_some(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(seq: u64, full: bool) -> ImageRef {
        ImageRef {
            seq,
            bytes: 10,
            full,
            server: 2,
            epoch: 1,
            parts: 0,
        }
    }

    #[test]
    fn a_copy_serves_only_while_its_images_are_a_prefix_followed_by_deltas() {
        let r = Released {
            table: Table::new(0, 100),
            images: vec![img(1, true), img(2, false)],
        };
        let same = [img(1, true), img(2, false)];
        assert_eq!(r.missing(&same), Some(&[][..]));
        let more = [img(1, true), img(2, false), img(3, false)];
        assert_eq!(r.missing(&more), Some(&more[2..]));
        // A new base written meanwhile, or images the copy never had: load from the store.
        assert_eq!(r.missing(&[img(3, true)]), None);
        assert_eq!(
            r.missing(&[img(1, true), img(2, false), img(3, true)]),
            None
        );
        assert_eq!(r.missing(&[img(1, true)]), None);
    }

    #[test]
    fn the_oldest_copies_go_first() {
        let mut k = ReleasedTables::default();
        for i in 0..(KEPT_TABLES_MAX as u64 + 2) {
            k.keep(Table::new(i * 10, i * 10 + 10), vec![img(1, true)]);
        }
        assert!(k.take(0).is_none());
        assert!(k.take(10).is_none());
        assert!(k.take(20).is_some());
        assert!(k.take(20).is_none());
    }
}
