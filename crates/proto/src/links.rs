//! What a server of a running cluster reports for the online check of links between
//! tables of different servers (`kochab fsck`): the entries of its directories that name
//! inodes outside its tables, and the inodes of its tables that entries elsewhere may name.
//! A server's own check (`Op::Fsck`) covers everything else; the checker sums these facts
//! over every server (`kochab_meta::links::check_cluster`).

use crate::types::{FileKind, InodeId};
use serde::{Deserialize, Serialize};

/// Bytes of records per page (an upper estimate per record, see
/// [`CrossEntry::bytes_max`]): a quarter of the 8 MiB frame limit, so a page always fits
/// a reply frame while a server holding millions of such records answers in few pages.
pub const LINKS_PAGE_BYTES_MAX: usize = 2 << 20;

/// Ids per `Op::FsckInodes`: 10 bytes each at most in the request, [`InodeLinks::BYTES_MAX`]
/// each in the reply (about 2 MiB), well under the frame limit.
pub const FSCK_IDS_MAX: usize = 65_536;

/// Where a page of [`LinksPage`] starts: entries in (directory, cookie) order first, then
/// inodes in id order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinksCursor {
    /// The first page.
    Start,
    /// Entries after this one (`cookie`: the entry's readdir cookie in `dir`).
    Entries { dir: InodeId, cookie: u64 },
    /// Inodes from this id on.
    Inodes { from: InodeId },
}

/// Where a directory's parent chain goes once it leaves the answering server's tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Up {
    /// It reaches the root inside them.
    Root,
    /// It reaches directory `dir` of these tables, whose parent lies in another server's.
    Via(InodeId),
    /// It ends at something that is not a directory, or runs too long (the server's own
    /// check names it).
    Broken,
}

/// A directory entry held in the answering server's tables whose inode lies outside them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrossEntry {
    pub dir: InodeId,
    /// The entry's readdir cookie in `dir` (for paging).
    pub cookie: u64,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub child: InodeId,
    /// The kind the entry says its inode has.
    pub kind: FileKind,
    /// For an entry of a directory: where the parent chain of `dir` leaves these tables
    /// (the chain of `child` goes on from there).
    pub up: Option<Up>,
}

impl CrossEntry {
    /// Encoded size at most: three varint ids of 10 bytes, a 3-byte name length, the
    /// kind and an optional [`Up`] of 12.
    pub fn bytes_max(&self) -> usize {
        46 + self.name.len()
    }
}

/// The link facts of one inode of the answering server's tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeLinks {
    pub id: InodeId,
    pub kind: FileKind,
    pub nlink: u32,
    /// Entries in the answering server's tables that name it.
    pub names: u32,
    /// A directory's parent link (0 for other kinds).
    pub parent: InodeId,
}

impl InodeLinks {
    /// Encoded size at most: two varint ids, two varint u32s and the kind.
    pub const BYTES_MAX: usize = 31;
}

/// One page of a server's cross-server facts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinksPage {
    /// Entries naming inodes outside the server's tables, in (directory, cookie) order.
    pub entries: Vec<CrossEntry>,
    /// Inodes whose links are not all accounted for inside the server's tables: files
    /// (and other non-directories) with fewer names there than links, and live
    /// directories whose parent lies outside them. In id order.
    pub inodes: Vec<InodeLinks>,
    /// Where the next page starts; `None` after the last.
    pub next: Option<LinksCursor>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_encode_within_their_size_bounds() {
        // The largest: every id at its widest varint, the longest name, an `Up::Via`.
        let widest = CrossEntry {
            dir: u64::MAX,
            cookie: u64::MAX,
            name: vec![b'n'; 255],
            child: u64::MAX,
            kind: FileKind::BlockDev,
            up: Some(Up::Via(u64::MAX)),
        };
        let bytes = postcard::to_allocvec(&widest).unwrap().len();
        assert!(bytes <= widest.bytes_max(), "{bytes}");
        let inode = InodeLinks {
            id: u64::MAX,
            kind: FileKind::BlockDev,
            nlink: u32::MAX,
            names: u32::MAX,
            parent: u64::MAX,
        };
        let bytes = postcard::to_allocvec(&inode).unwrap().len();
        assert!(bytes <= InodeLinks::BYTES_MAX, "{bytes}");
        // What a typical record costs: primary-region ids (9-byte varints), a file named
        // by 8 bytes: 38 bytes; its inode's facts: 13.
        let file = CrossEntry {
            dir: 0x4400_0000_0000_0000,
            cookie: 0x38627f3bb1828a30,
            name: b"file.txt".to_vec(),
            child: 0x4800_0000_0000_0001,
            kind: FileKind::File,
            up: None,
        };
        assert_eq!(postcard::to_allocvec(&file).unwrap().len(), 38);
        let facts = InodeLinks {
            id: 0x4800_0000_0000_0001,
            kind: FileKind::File,
            nlink: 2,
            names: 1,
            parent: 0,
        };
        assert_eq!(postcard::to_allocvec(&facts).unwrap().len(), 13);
    }
}
