//! The online check of links between tables of different servers.
//!
//! A member's [`Engine::check_invariants`] checks what its own tables show and leaves out
//! what crosses servers: entries naming another server's inodes, names an inode of its
//! tables has in another server's directories, and parent chains that go on elsewhere.
//! Each server reports exactly those facts ([`Engine::links_page`], paged, and
//! [`Engine::inode_links`] for inodes asked about by id); [`check_cluster`] sums them over
//! every server with the rules `check_invariants` applies to one engine.

use crate::engine::Engine;
use kochab_proto::links::{
    CrossEntry, InodeLinks, LINKS_PAGE_BYTES_MAX, LinksCursor, LinksPage, Up,
};
use kochab_proto::{FileKind, InodeId};
use rustc_hash::{FxHashMap, FxHashSet};

/// Steps of a parent chain inside one server before it counts as broken (as in
/// `check_invariants`: deeper than any path the id policy and PATH_MAX allow).
const CHAIN_STEPS_MAX: u32 = 100_000;

impl Engine {
    /// One page of the cross-server facts of the hosted tables, starting at `after`:
    /// first the entries naming inodes outside them, then the inodes whose links they do
    /// not account for (see [`LinksPage`]). Pages are cut by [`LINKS_PAGE_BYTES_MAX`].
    pub fn links_page(&self, after: LinksCursor) -> LinksPage {
        let mut page = LinksPage::default();
        let mut bytes = 0;
        let inodes_from = match after {
            LinksCursor::Start => self.cross_entries(0, 0, &mut page, &mut bytes),
            LinksCursor::Entries { dir, cookie } => {
                self.cross_entries(dir, cookie, &mut page, &mut bytes)
            }
            LinksCursor::Inodes { from } => Some(from),
        };
        if let Some(from) = inodes_from {
            self.unaccounted_inodes(from, &mut page, &mut bytes);
        }
        page
    }

    /// Appends the entries after (`dir`, `cookie`) that name inodes outside the hosted
    /// tables. Returns where the inodes start when every entry fit, else sets `page.next`.
    fn cross_entries(
        &self,
        from_dir: InodeId,
        after_cookie: u64,
        page: &mut LinksPage,
        bytes: &mut usize,
    ) -> Option<InodeId> {
        let mut ups: FxHashMap<InodeId, Up> = FxHashMap::default();
        for t in self.tables.iter().filter(|t| t.hi > from_dir) {
            let mut dirs: Vec<_> = t.iter_dirs().filter(|(d, _)| *d >= from_dir).collect();
            dirs.sort_unstable_by_key(|(d, _)| *d);
            for (dir, entries) in dirs {
                let after = if dir == from_dir { after_cookie } else { 0 };
                for (cookie, e) in entries.iter_after(after) {
                    if self.table_index(e.child).is_some() {
                        continue;
                    }
                    let up = (e.kind == FileKind::Dir)
                        .then(|| *ups.entry(dir).or_insert_with(|| self.up_from(dir)));
                    let entry = CrossEntry {
                        dir,
                        cookie,
                        name: e.name.as_bytes().to_vec(),
                        child: e.child,
                        kind: e.kind,
                        up,
                    };
                    if !page.entries.is_empty() && *bytes + entry.bytes_max() > LINKS_PAGE_BYTES_MAX
                    {
                        let last = &page.entries[page.entries.len() - 1];
                        page.next = Some(LinksCursor::Entries {
                            dir: last.dir,
                            cookie: last.cookie,
                        });
                        return None;
                    }
                    *bytes += entry.bytes_max();
                    page.entries.push(entry);
                }
            }
        }
        Some(0)
    }

    /// Appends the hosted inodes from `from` on whose links the hosted tables do not
    /// account for: non-directories with fewer names here than links, live directories
    /// (the root aside) whose parent lies outside. Sets `page.next` when the page fills.
    fn unaccounted_inodes(&self, from: InodeId, page: &mut LinksPage, bytes: &mut usize) {
        let names = self.names_here(|id| id >= from);
        let root = self.root();
        for t in self.tables.iter().filter(|t| t.hi > from) {
            for (id, inode) in t.iter_inodes().filter(|(id, _)| *id >= from) {
                let n = names.get(&id).copied().unwrap_or(0);
                let parent = inode.dir().map_or(0, |d| d.parent);
                let unaccounted = if inode.is_dir() {
                    inode.nlink != 0 && id != root && self.table_index(parent).is_none()
                } else {
                    n < inode.nlink
                };
                if !unaccounted {
                    continue;
                }
                let empty = page.entries.is_empty() && page.inodes.is_empty();
                if !empty && *bytes + InodeLinks::BYTES_MAX > LINKS_PAGE_BYTES_MAX {
                    page.next = Some(LinksCursor::Inodes { from: id });
                    return;
                }
                *bytes += InodeLinks::BYTES_MAX;
                page.inodes.push(InodeLinks {
                    id,
                    kind: inode.kind(),
                    nlink: inode.nlink,
                    names: n,
                    parent,
                });
            }
        }
    }

    /// The link facts of those of `ids` that lie in the hosted tables and exist, in the
    /// order asked (each once).
    pub fn inode_links(&self, ids: &[InodeId]) -> Vec<InodeLinks> {
        let wanted: FxHashSet<InodeId> = ids
            .iter()
            .copied()
            .filter(|&id| self.inode(id).is_some())
            .collect();
        let names = self.names_here(|id| wanted.contains(&id));
        let mut seen = FxHashSet::default();
        ids.iter()
            .filter(|&&id| seen.insert(id))
            .filter_map(|&id| {
                let inode = self.inode(id)?;
                Some(InodeLinks {
                    id,
                    kind: inode.kind(),
                    nlink: inode.nlink,
                    names: names.get(&id).copied().unwrap_or(0),
                    parent: inode.dir().map_or(0, |d| d.parent),
                })
            })
            .collect()
    }

    /// Entries of the hosted tables naming each hosted inode that `want` picks.
    fn names_here(&self, want: impl Fn(InodeId) -> bool) -> FxHashMap<InodeId, u32> {
        let mut names: FxHashMap<InodeId, u32> = FxHashMap::default();
        for t in &self.tables {
            for (_, entries) in t.iter_dirs() {
                for (_, e) in entries.iter() {
                    if want(e.child) && self.table_index(e.child).is_some() {
                        *names.entry(e.child).or_default() += 1;
                    }
                }
            }
        }
        names
    }

    /// Where the parent chain of hosted directory `dir` leaves the hosted tables.
    fn up_from(&self, dir: InodeId) -> Up {
        let root = self.root();
        let mut cur = dir;
        for _ in 0..CHAIN_STEPS_MAX {
            if cur == root {
                return Up::Root;
            }
            let Some(d) = self.inode(cur).and_then(|i| i.dir()) else {
                return Up::Broken;
            };
            if self.table_index(d.parent).is_none() {
                return Up::Via(cur);
            }
            cur = d.parent;
        }
        Up::Broken
    }
}

/// Every server's cross-server facts, gathered: the entries of all pages, and the inodes
/// of all pages together with the answers to `FsckInodes` for [`ClusterLinks::unknown`].
#[derive(Clone, Debug, Default)]
pub struct ClusterLinks {
    pub entries: Vec<CrossEntry>,
    pub inodes: Vec<InodeLinks>,
}

impl ClusterLinks {
    /// Inodes named by cross entries that no page reported: a healthy namespace has none
    /// (such an inode is fully named where it lives, or missing); their servers are
    /// asked for them by id before the check. Sorted, each once.
    pub fn unknown(&self) -> Vec<InodeId> {
        let known: FxHashSet<InodeId> = self.inodes.iter().map(|i| i.id).collect();
        let mut ids: Vec<InodeId> = self
            .entries
            .iter()
            .map(|e| e.child)
            .filter(|c| !known.contains(c))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// The cross-server facts of engines in one process (a simulation's servers), gathered as
/// `kochab fsck` gathers them over the network: every page, then the unknown ids.
pub fn gather(servers: &[&Engine]) -> ClusterLinks {
    let mut links = ClusterLinks::default();
    for e in servers {
        let mut after = LinksCursor::Start;
        loop {
            let page = e.links_page(after);
            links.entries.extend(page.entries);
            links.inodes.extend(page.inodes);
            match page.next {
                Some(next) => after = next,
                None => break,
            }
        }
    }
    let unknown = links.unknown();
    for e in servers {
        links.inodes.extend(e.inode_links(&unknown));
    }
    links
}

/// The problems of links between servers' tables that the gathered facts show, in the
/// style of [`Engine::check_invariants`]: entries naming missing inodes or the wrong
/// kind, link counts that differ from the names across all servers, directories with no
/// name, several names or a name elsewhere than their parent link says, and parent chains
/// that cross servers without reaching the root.
pub fn check_cluster(links: &ClusterLinks) -> Vec<String> {
    let mut problems = Vec::new();
    let mut inodes: FxHashMap<InodeId, &InodeLinks> = FxHashMap::default();
    for i in &links.inodes {
        if inodes.insert(i.id, i).is_some() {
            problems.push(format!("inode {:#x} is held by more than one server", i.id));
        }
    }
    let mut named: FxHashMap<InodeId, Vec<&CrossEntry>> = FxHashMap::default();
    for e in &links.entries {
        let name = String::from_utf8_lossy(&e.name);
        match inodes.get(&e.child) {
            None => problems.push(format!(
                "{:#x}/{name:?} names missing inode {:#x} (of another server)",
                e.dir, e.child
            )),
            Some(i) if i.kind != e.kind => problems.push(format!(
                "{:#x}/{name:?} has kind {:?}, inode {:#x} of another server is {:?}",
                e.dir, e.kind, e.child, i.kind
            )),
            Some(_) => {}
        }
        named.entry(e.child).or_default().push(e);
    }
    for i in &links.inodes {
        let here = i.names;
        let across = named.get(&i.id).map_or(&[][..], |v| &v[..]);
        let total = here + across.len() as u32;
        if i.kind != FileKind::Dir {
            if i.nlink != total {
                problems.push(format!(
                    "inode {:#x} has nlink {} but {total} names ({here} on its server, {} on others)",
                    i.id,
                    i.nlink,
                    across.len()
                ));
            }
            continue;
        }
        if i.nlink == 0 {
            // Removed while open: lives, unnamed, until its last close.
            for e in across {
                problems.push(format!(
                    "{:#x}/{:?} names removed directory {:#x}",
                    e.dir,
                    String::from_utf8_lossy(&e.name),
                    i.id
                ));
            }
            continue;
        }
        match (here, across) {
            // Named on its own server only: that server's check covers it.
            (1, []) => {}
            (0, []) => problems.push(format!(
                "directory {:#x} has no name (parent link {:#x} on another server)",
                i.id, i.parent
            )),
            (0, [e]) if e.dir != i.parent => problems.push(format!(
                "directory {:#x}: parent link {:#x} but named in {:#x}",
                i.id, i.parent, e.dir
            )),
            (0, [_]) => {}
            _ => problems.push(format!(
                "directory {:#x} has {total} names ({here} on its server, in {:x?} on others)",
                i.id,
                across.iter().map(|e| e.dir).collect::<Vec<_>>()
            )),
        }
    }
    check_chains(&named, &mut problems);
    problems
}

/// Every directory named across servers leads to the root: from the entry's [`Up`], to
/// the one entry naming the directory where that chain left its server, and so on.
/// Directories with no name or several are reported by the caller; the walk stops there.
fn check_chains(named: &FxHashMap<InodeId, Vec<&CrossEntry>>, problems: &mut Vec<String>) {
    // Per `Up::Via` directory already walked: whether its chain reaches the root.
    let mut reaches: FxHashMap<InodeId, bool> = FxHashMap::default();
    let mut entries: Vec<&CrossEntry> = named
        .values()
        .flatten()
        .copied()
        .filter(|e| e.kind == FileKind::Dir)
        .collect();
    entries.sort_unstable_by_key(|e| (e.dir, e.cookie));
    for e in entries {
        let mut path = Vec::new();
        let mut up = e.up.unwrap_or(Up::Broken);
        let ok = loop {
            let Up::Via(via) = up else {
                // The root, or broken inside one server: that server's check names it.
                break true;
            };
            if let Some(&known) = reaches.get(&via) {
                break known;
            }
            if path.contains(&via) {
                break false;
            }
            path.push(via);
            match named.get(&via).map(|v| &v[..]) {
                Some([next]) if next.kind == FileKind::Dir => up = next.up.unwrap_or(Up::Broken),
                // No name or several: reported as such; the chain is not followed further.
                _ => break true,
            }
        };
        for via in path {
            reaches.insert(via, ok);
        }
        if !ok {
            problems.push(format!(
                "directory {:#x} does not lead to the root (its parent chain crosses servers \
                 in a cycle)",
                e.child
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::mutation::Mutation;
    use kochab_proto::{Credentials, Op, Reply, mode};

    /// A whole namespace in one engine, and the mutations that made it.
    struct Whole {
        e: Engine,
        log: Vec<Mutation>,
    }

    impl Whole {
        fn new() -> Whole {
            let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
            let log = e.bootstrap(1);
            for m in &log {
                e.apply(m).unwrap();
            }
            Whole { e, log }
        }

        fn run(&mut self, op: Op) -> InodeId {
            let mut out = Vec::new();
            let reply = self.e.execute(&Credentials::root(), &op, 2, &mut out);
            self.log.extend(out);
            match reply {
                Reply::Entry(a) => a.id,
                Reply::Empty => 0,
                other => panic!("{op:?}: {other:?}"),
            }
        }

        fn mkdir(&mut self, parent: InodeId, name: &str) -> InodeId {
            self.run(Op::Mkdir {
                parent,
                name: name.as_bytes().to_vec(),
                mode: 0o755,
            })
        }

        fn mknod(&mut self, parent: InodeId, name: &str) -> InodeId {
            self.run(Op::Mknod {
                parent,
                name: name.as_bytes().to_vec(),
                mode: mode::S_IFREG | 0o644,
                rdev: 0,
                exclusive: true,
            })
        }

        fn rename(&mut self, parent: InodeId, name: &str, new_parent: InodeId) {
            self.run(Op::Rename {
                parent,
                name: name.as_bytes().to_vec(),
                new_parent,
                new_name: name.as_bytes().to_vec(),
                flags: 0,
            });
        }

        /// A member engine replayed from the first `upto` mutations, holding the tables
        /// `keep` picks (by their `lo`).
        fn member(&self, upto: usize, keep: impl Fn(InodeId) -> bool) -> Engine {
            let mut e = Engine::new_cluster(EngineConfig::with_key([1, 2])).unwrap();
            for m in &self.log[..upto] {
                e.apply(m).unwrap();
            }
            e.member = true;
            let gone: Vec<InodeId> = e
                .tables()
                .iter()
                .map(|t| t.lo)
                .filter(|&lo| !keep(lo))
                .collect();
            for lo in gone {
                e.remove_table(lo).unwrap();
            }
            e
        }
    }

    /// Two servers: A holds the root and /a's table, B holds /b's table; renames of files
    /// and directories across them and, last, a hard link across. Also returns B's table,
    /// the linked file and the length of the log before the link.
    fn two_servers() -> (Whole, InodeId, InodeId, usize) {
        let mut w = Whole::new();
        let root = w.e.root();
        let a = w.mkdir(root, "a");
        let b = w.mkdir(root, "b");
        let table_of = |w: &Whole, id| w.e.tables()[w.e.table_index(id).unwrap()].lo;
        assert_ne!(
            table_of(&w, a),
            table_of(&w, b),
            "top-level directories spread"
        );
        assert_ne!(table_of(&w, root), table_of(&w, b));
        let f = w.mknod(b, "f");
        w.mknod(b, "moved");
        w.rename(b, "moved", a);
        let sub = w.mkdir(b, "sub");
        w.mknod(sub, "inner");
        w.rename(b, "sub", a);
        let x = w.mkdir(a, "x");
        w.mkdir(x, "deeper");
        w.rename(a, "x", b);
        let before_link = w.log.len();
        w.run(Op::Link {
            id: f,
            new_parent: a,
            new_name: b"g".to_vec(),
        });
        let b_lo = table_of(&w, b);
        (w, b_lo, f, before_link)
    }

    #[test]
    fn members_of_a_consistent_namespace_report_facts_that_check_clean() {
        let (w, b_lo, _, _) = two_servers();
        assert_eq!(w.e.check_invariants(), Vec::<String>::new());
        let n = w.log.len();
        let sa = w.member(n, |lo| lo != b_lo);
        let sb = w.member(n, |lo| lo == b_lo);
        assert_eq!(sa.check_invariants(), Vec::<String>::new());
        assert_eq!(sb.check_invariants(), Vec::<String>::new());
        let links = gather(&[&sa, &sb]);
        // /b in the root, /a/moved, /a/sub and /a/g (B's inodes named on A), /b/x (A's
        // directory named on B).
        let mut names: Vec<&[u8]> = links.entries.iter().map(|e| &e.name[..]).collect();
        names.sort_unstable();
        assert_eq!(names, [&b"b"[..], b"g", b"moved", b"sub", b"x"]);
        assert_eq!(check_cluster(&links), Vec::<String>::new());
    }

    #[test]
    fn servers_at_different_moments_show_the_link_one_of_them_missed() {
        let (w, b_lo, f, before_link) = two_servers();
        let n = w.log.len();
        // B from before the hard link /a/g: A names f, whose one link B counts by its one
        // name there (f is in no page; B answers for it by id).
        let sa = w.member(n, |lo| lo != b_lo);
        let sb = w.member(before_link, |lo| lo == b_lo);
        assert_eq!(
            check_cluster(&gather(&[&sa, &sb])),
            vec![format!(
                "inode {f:#x} has nlink 1 but 2 names (1 on its server, 1 on others)"
            )]
        );
        // A from before it: f has two links and one name.
        let sa = w.member(before_link, |lo| lo != b_lo);
        let sb = w.member(n, |lo| lo == b_lo);
        assert_eq!(
            check_cluster(&gather(&[&sa, &sb])),
            vec![format!(
                "inode {f:#x} has nlink 2 but 1 names (1 on its server, 0 on others)"
            )]
        );
    }

    #[test]
    fn pages_resume_where_the_last_one_stopped() {
        // Enough cross entries with long names for several pages.
        let mut w = Whole::new();
        let root = w.e.root();
        let a = w.mkdir(root, "a");
        let b = w.mkdir(root, "b");
        let name = |i: usize| format!("{i:0>250}");
        let count = 3 * LINKS_PAGE_BYTES_MAX / 300;
        for i in 0..count {
            w.mknod(b, &name(i));
            w.rename(b, &name(i), a);
        }
        // A holds the root's table and /a's, B every other (where /b's files overflow to).
        let table_of = |id| w.e.tables()[w.e.table_index(id).unwrap()].lo;
        let a_side = [table_of(root), table_of(a)];
        let n = w.log.len();
        let sa = w.member(n, |lo| a_side.contains(&lo));
        let sb = w.member(n, |lo| !a_side.contains(&lo));
        let mut pages = 0;
        let mut after = LinksCursor::Start;
        let mut entries = Vec::new();
        loop {
            let page = sa.links_page(after);
            pages += 1;
            let bytes = postcard::to_allocvec(&page).unwrap().len();
            assert!(bytes <= LINKS_PAGE_BYTES_MAX, "{bytes}");
            entries.extend(page.entries);
            match page.next {
                Some(next) => after = next,
                None => break,
            }
        }
        assert!(pages >= 3, "{pages} pages");
        // Each entry once, in order: /b and the files.
        assert_eq!(entries.len(), count + 1);
        let mut keys: Vec<_> = entries.iter().map(|e| (e.dir, e.cookie)).collect();
        keys.dedup();
        assert_eq!(keys.len(), entries.len());
        assert!(keys.is_sorted());
        assert_eq!(check_cluster(&gather(&[&sa, &sb])), Vec::<String>::new());
    }

    fn file(id: InodeId, nlink: u32, names: u32) -> InodeLinks {
        InodeLinks {
            id,
            kind: FileKind::File,
            nlink,
            names,
            parent: 0,
        }
    }

    fn dir(id: InodeId, parent: InodeId) -> InodeLinks {
        InodeLinks {
            id,
            kind: FileKind::Dir,
            nlink: 2,
            names: 0,
            parent,
        }
    }

    fn entry(
        dir: InodeId,
        name: &str,
        child: InodeId,
        kind: FileKind,
        up: Option<Up>,
    ) -> CrossEntry {
        CrossEntry {
            dir,
            cookie: 16 + child,
            name: name.as_bytes().to_vec(),
            child,
            kind,
            up,
        }
    }

    /// Server A holds the root 1 and directory 0x10; server B holds directory 0x20
    /// (named "b" in the root) and file 0x21, linked as /b/f and /a/g.
    fn clean() -> ClusterLinks {
        ClusterLinks {
            entries: vec![
                entry(1, "b", 0x20, FileKind::Dir, Some(Up::Root)),
                entry(0x10, "g", 0x21, FileKind::File, None),
            ],
            inodes: vec![dir(0x20, 1), file(0x21, 2, 1)],
        }
    }

    #[test]
    fn a_consistent_cluster_has_no_problems() {
        let links = clean();
        assert!(links.unknown().is_empty());
        assert_eq!(check_cluster(&links), Vec::<String>::new());
    }

    #[test]
    fn an_entry_naming_a_missing_inode_is_reported() {
        let mut links = clean();
        links
            .entries
            .push(entry(0x10, "gone", 0x99, FileKind::File, None));
        assert_eq!(links.unknown(), vec![0x99]);
        // No server knew 0x99 when asked by id.
        let p = check_cluster(&links);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("names missing inode 0x99"), "{p:?}");
    }

    #[test]
    fn a_link_count_that_differs_from_names_across_servers_is_reported() {
        let mut links = clean();
        // Three links, one name on its server and one across: one name is missing.
        links.inodes[1].nlink = 3;
        let p = check_cluster(&links);
        assert_eq!(
            p,
            vec!["inode 0x21 has nlink 3 but 2 names (1 on its server, 1 on others)"]
        );
        // And one name too many: a file whose only link is named on its server and across
        // (it was not in the page; its server answered when asked by id).
        let mut links = clean();
        links
            .entries
            .push(entry(0x10, "h", 0x30, FileKind::File, None));
        assert_eq!(links.unknown(), vec![0x30]);
        links.inodes.push(file(0x30, 1, 1));
        let p = check_cluster(&links);
        assert_eq!(
            p,
            vec!["inode 0x30 has nlink 1 but 2 names (1 on its server, 1 on others)"]
        );
    }

    #[test]
    fn an_entry_of_the_wrong_kind_is_reported() {
        let mut links = clean();
        links.entries[1].kind = FileKind::Symlink;
        let p = check_cluster(&links);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].contains("has kind Symlink, inode 0x21 of another server is File"),
            "{p:?}"
        );
    }

    #[test]
    fn directories_need_exactly_one_name_where_their_parent_link_says() {
        // Named twice: in the root and in 0x10, both on server A.
        let mut links = clean();
        links
            .entries
            .push(entry(0x10, "again", 0x20, FileKind::Dir, Some(Up::Root)));
        let p = check_cluster(&links);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("directory 0x20 has 2 names"), "{p:?}");
        // Named once across and once on its own server.
        let mut links = clean();
        links.inodes[0].names = 1;
        let p = check_cluster(&links);
        assert!(
            p[0].starts_with("directory 0x20 has 2 names (1 on its server"),
            "{p:?}"
        );
        // Named nowhere.
        let mut links = clean();
        links.entries.remove(0);
        assert_eq!(
            check_cluster(&links),
            vec!["directory 0x20 has no name (parent link 0x1 on another server)"]
        );
        // Named elsewhere than its parent link.
        let mut links = clean();
        links.entries[0].dir = 0x10;
        assert_eq!(
            check_cluster(&links),
            vec!["directory 0x20: parent link 0x1 but named in 0x10"]
        );
        // A removed directory (open somewhere) still named across.
        let mut links = clean();
        links.inodes[0].nlink = 0;
        let p = check_cluster(&links);
        assert_eq!(p, vec!["0x1/\"b\" names removed directory 0x20"]);
    }

    #[test]
    fn a_parent_chain_that_cycles_between_servers_is_reported() {
        // Directory 0x20 (server B) is named in 0x10 (server A), whose chain leaves A at
        // 0x10 itself; 0x10 is named in 0x20 on B, whose chain leaves B at 0x20.
        let links = ClusterLinks {
            entries: vec![
                entry(0x10, "b", 0x20, FileKind::Dir, Some(Up::Via(0x10))),
                entry(0x20, "a", 0x10, FileKind::Dir, Some(Up::Via(0x20))),
            ],
            inodes: vec![dir(0x20, 0x10), dir(0x10, 0x20)],
        };
        let p = check_cluster(&links);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p.iter().all(|l| l.contains("does not lead to the root")),
            "{p:?}"
        );
        // The same two, with 0x10's chain leaving A towards the root's server: clean.
        let links = ClusterLinks {
            entries: vec![
                entry(0x10, "b", 0x20, FileKind::Dir, Some(Up::Via(0x10))),
                entry(1, "a", 0x10, FileKind::Dir, Some(Up::Root)),
            ],
            inodes: vec![dir(0x20, 0x10), dir(0x10, 1)],
        };
        assert_eq!(check_cluster(&links), Vec::<String>::new());
    }

    #[test]
    fn an_inode_claimed_by_two_servers_is_reported() {
        let mut links = clean();
        links.inodes.push(file(0x21, 2, 1));
        let p = check_cluster(&links);
        assert!(
            p.contains(&"inode 0x21 is held by more than one server".to_string()),
            "{p:?}"
        );
    }
}
