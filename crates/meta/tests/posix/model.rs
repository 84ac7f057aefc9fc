//! Randomized test: thousands of random operations with random credentials, each checked
//! against an independent model of the namespace (names, kinds, link counts, parent links,
//! and the errno Linux gives for structural mistakes), plus the engine's own invariant check
//! and a full journal replay every `CHECK_EVERY` steps.
//!
//! The model knows nothing about permissions: for root it predicts the exact outcome; for
//! other users an operation the model expects to succeed may also fail with EACCES or
//! EPERM, and one it expects to fail may fail with those instead (the VFS checks some
//! permissions before it looks at the names).

use crate::support::*;
use kochab_proto::mode::*;
use kochab_proto::rename_flags::{RENAME_EXCHANGE, RENAME_NOREPLACE};
use kochab_proto::{
    Credentials, Errno, FileKind, InodeId, NAME_MAX, Op, Reply, SYMLINK_MAX, SetAttrs, TimeSet,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};

const CHECK_EVERY: usize = 100;

#[derive(Clone, Debug)]
struct Node {
    kind: FileKind,
    /// Names of a non-directory (directories: computed from their children).
    nlink: u32,
    /// Parent of a directory.
    parent: InodeId,
    children: BTreeMap<Vec<u8>, InodeId>,
}

/// What a successful operation does to the namespace.
#[derive(Debug)]
enum Effect {
    Nothing,
    /// Lookup: the id the name must resolve to.
    Resolves(InodeId),
    Create {
        parent: InodeId,
        name: Vec<u8>,
        kind: FileKind,
    },
    /// O_CREAT without O_EXCL of an existing file: that file, unchanged.
    Open(InodeId),
    Link {
        id: InodeId,
        parent: InodeId,
        name: Vec<u8>,
    },
    Remove {
        parent: InodeId,
        name: Vec<u8>,
    },
    Rename {
        parent: InodeId,
        name: Vec<u8>,
        new_parent: InodeId,
        new_name: Vec<u8>,
    },
    Exchange {
        parent: InodeId,
        name: Vec<u8>,
        new_parent: InodeId,
        new_name: Vec<u8>,
    },
}

#[derive(Debug)]
enum Pred {
    Ok(Effect),
    Err(Errno),
    /// Permission- or attribute-dependent: any outcome, as long as it is consistent.
    Any,
}

struct Model {
    root: InodeId,
    nodes: HashMap<InodeId, Node>,
}

fn is_dots(name: &[u8]) -> bool {
    name == b"." || name == b".."
}

fn name_error(name: &[u8]) -> Option<Errno> {
    if name.is_empty() {
        Some(Errno::ENOENT)
    } else if name.len() > NAME_MAX {
        Some(Errno::ENAMETOOLONG)
    } else if name.iter().any(|&c| c == b'/' || c == 0) {
        Some(Errno::EINVAL)
    } else {
        None
    }
}

macro_rules! fail {
    ($e:expr) => {
        return Pred::Err($e)
    };
}

macro_rules! check {
    ($r:expr) => {
        if let Err(e) = $r {
            return Pred::Err(e);
        }
    };
}

impl Model {
    fn new(root: InodeId) -> Model {
        let mut nodes = HashMap::new();
        nodes.insert(
            root,
            Node {
                kind: FileKind::Dir,
                nlink: 0,
                parent: root,
                children: BTreeMap::new(),
            },
        );
        Model { root, nodes }
    }

    fn is_dir(&self, id: InodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.kind == FileKind::Dir)
    }

    fn dir(&self, id: InodeId) -> Result<&Node, Errno> {
        match self.nodes.get(&id) {
            None => Err(Errno::ENOENT),
            Some(n) if n.kind != FileKind::Dir => Err(Errno::ENOTDIR),
            Some(n) => Ok(n),
        }
    }

    fn child(&self, dir: InodeId, name: &[u8]) -> Option<InodeId> {
        self.nodes
            .get(&dir)
            .and_then(|n| n.children.get(name).copied())
    }

    fn nlink(&self, id: InodeId) -> u32 {
        let n = &self.nodes[&id];
        if n.kind == FileKind::Dir {
            2 + n.children.values().filter(|c| self.is_dir(**c)).count() as u32
        } else {
            n.nlink
        }
    }

    /// True if `a` is `d` or one of its ancestors.
    fn is_ancestor(&self, a: InodeId, mut d: InodeId) -> bool {
        loop {
            if d == a {
                return true;
            }
            if d == self.root {
                return false;
            }
            d = self.nodes[&d].parent;
        }
    }

    /// The outcome Linux gives, in the order the VFS checks (permissions aside).
    fn predict(&self, op: &Op) -> Pred {
        match op {
            Op::Lookup { parent, name } => {
                check!(self.dir(*parent));
                if name == b"." {
                    return Pred::Ok(Effect::Resolves(*parent));
                }
                if name == b".." {
                    return Pred::Ok(Effect::Resolves(self.nodes[parent].parent));
                }
                if let Some(e) = name_error(name) {
                    fail!(e);
                }
                match self.child(*parent, name) {
                    Some(c) => Pred::Ok(Effect::Resolves(c)),
                    None => Pred::Err(Errno::ENOENT),
                }
            }
            Op::Mknod {
                parent,
                name,
                mode,
                exclusive,
                ..
            } => {
                let t = mode & S_IFMT;
                if t == S_IFDIR {
                    fail!(Errno::EPERM);
                }
                let kind = match t {
                    0 | S_IFREG => FileKind::File,
                    S_IFIFO => FileKind::Fifo,
                    S_IFSOCK => FileKind::Socket,
                    S_IFCHR => FileKind::CharDev,
                    S_IFBLK => FileKind::BlockDev,
                    _ => fail!(Errno::EINVAL),
                };
                check!(self.dir(*parent));
                if let Some(e) = name_error(name) {
                    fail!(e);
                }
                if !exclusive && kind == FileKind::File {
                    if is_dots(name) {
                        fail!(Errno::EISDIR);
                    }
                    if let Some(c) = self.child(*parent, name) {
                        return if self.is_dir(c) {
                            Pred::Err(Errno::EISDIR)
                        } else {
                            Pred::Ok(Effect::Open(c))
                        };
                    }
                }
                self.create(*parent, name, kind)
            }
            Op::Mkdir { parent, name, .. } => {
                check!(self.dir(*parent));
                self.create(*parent, name, FileKind::Dir)
            }
            Op::Symlink {
                parent,
                name,
                target,
            } => {
                if target.is_empty() {
                    fail!(Errno::ENOENT);
                }
                if target.len() > SYMLINK_MAX {
                    fail!(Errno::ENAMETOOLONG);
                }
                check!(self.dir(*parent));
                self.create(*parent, name, FileKind::Symlink)
            }
            Op::Link {
                id,
                new_parent,
                new_name,
            } => {
                if !self.nodes.contains_key(id) {
                    fail!(Errno::ENOENT);
                }
                check!(self.dir(*new_parent));
                if let Some(e) = name_error(new_name) {
                    fail!(e);
                }
                if is_dots(new_name) || self.child(*new_parent, new_name).is_some() {
                    fail!(Errno::EEXIST);
                }
                if self.is_dir(*id) {
                    fail!(Errno::EPERM);
                }
                Pred::Ok(Effect::Link {
                    id: *id,
                    parent: *new_parent,
                    name: new_name.clone(),
                })
            }
            Op::Unlink { parent, name } => {
                check!(self.dir(*parent));
                if is_dots(name) {
                    fail!(Errno::EISDIR);
                }
                if let Some(e) = name_error(name) {
                    fail!(e);
                }
                match self.child(*parent, name) {
                    None => Pred::Err(Errno::ENOENT),
                    Some(c) if self.is_dir(c) => Pred::Err(Errno::EISDIR),
                    Some(_) => Pred::Ok(Effect::Remove {
                        parent: *parent,
                        name: name.clone(),
                    }),
                }
            }
            Op::Rmdir { parent, name } => {
                check!(self.dir(*parent));
                if name == b"." {
                    fail!(Errno::EINVAL);
                }
                if name == b".." {
                    fail!(Errno::ENOTEMPTY);
                }
                if let Some(e) = name_error(name) {
                    fail!(e);
                }
                match self.child(*parent, name) {
                    None => Pred::Err(Errno::ENOENT),
                    Some(c) if !self.is_dir(c) => Pred::Err(Errno::ENOTDIR),
                    Some(c) if !self.nodes[&c].children.is_empty() => Pred::Err(Errno::ENOTEMPTY),
                    Some(_) => Pred::Ok(Effect::Remove {
                        parent: *parent,
                        name: name.clone(),
                    }),
                }
            }
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => self.predict_rename(*parent, name, *new_parent, new_name, *flags),
            Op::Readdir { id, .. } => match self.dir(*id) {
                Err(e) => Pred::Err(e),
                Ok(_) => Pred::Any,
            },
            Op::Readlink { id } => match self.nodes.get(id) {
                None => Pred::Err(Errno::ENOENT),
                Some(n) if n.kind != FileKind::Symlink => Pred::Err(Errno::EINVAL),
                Some(_) => Pred::Any,
            },
            Op::GetAttr { id } => {
                if self.nodes.contains_key(id) {
                    Pred::Ok(Effect::Nothing)
                } else {
                    Pred::Err(Errno::ENOENT)
                }
            }
            Op::SetAttr { id, .. }
            | Op::SetXattr { id, .. }
            | Op::GetXattr { id, .. }
            | Op::ListXattr { id }
            | Op::RemoveXattr { id, .. }
            | Op::Access { id, .. } => {
                if self.nodes.contains_key(id) {
                    Pred::Any
                } else {
                    Pred::Err(Errno::ENOENT)
                }
            }
            // Server-level operations the generator never makes.
            _ => Pred::Any,
        }
    }

    fn create(&self, parent: InodeId, name: &[u8], kind: FileKind) -> Pred {
        if let Some(e) = name_error(name) {
            fail!(e);
        }
        if is_dots(name) || self.child(parent, name).is_some() {
            fail!(Errno::EEXIST);
        }
        Pred::Ok(Effect::Create {
            parent,
            name: name.to_vec(),
            kind,
        })
    }

    fn predict_rename(
        &self,
        p: InodeId,
        name: &[u8],
        np: InodeId,
        new_name: &[u8],
        flags: u32,
    ) -> Pred {
        let noreplace = flags & RENAME_NOREPLACE != 0;
        let exchange = flags & RENAME_EXCHANGE != 0;
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0 || (noreplace && exchange) {
            fail!(Errno::EINVAL);
        }
        check!(self.dir(p));
        check!(self.dir(np));
        if is_dots(name) {
            fail!(Errno::EBUSY);
        }
        if is_dots(new_name) {
            fail!(if noreplace {
                Errno::EEXIST
            } else {
                Errno::EBUSY
            });
        }
        if let Some(e) = name_error(name) {
            fail!(e);
        }
        let Some(src) = self.child(p, name) else {
            fail!(Errno::ENOENT)
        };
        if let Some(e) = name_error(new_name) {
            fail!(e);
        }
        let dst = self.child(np, new_name);
        if noreplace && dst.is_some() {
            fail!(Errno::EEXIST);
        }
        if exchange && dst.is_none() {
            fail!(Errno::ENOENT);
        }
        let (src_dir, dst_dir) = (self.is_dir(src), dst.is_some_and(|d| self.is_dir(d)));
        if p != np {
            if src_dir && self.is_ancestor(src, np) {
                fail!(Errno::EINVAL);
            }
            if let Some(d) = dst.filter(|_| dst_dir)
                && self.is_ancestor(d, p)
            {
                fail!(if exchange {
                    Errno::EINVAL
                } else {
                    Errno::ENOTEMPTY
                });
            }
        }
        if dst == Some(src) {
            return Pred::Ok(Effect::Nothing);
        }
        let (name, new_name) = (name.to_vec(), new_name.to_vec());
        if exchange {
            return Pred::Ok(Effect::Exchange {
                parent: p,
                name,
                new_parent: np,
                new_name,
            });
        }
        if let Some(d) = dst {
            if src_dir && !dst_dir {
                fail!(Errno::ENOTDIR);
            }
            if !src_dir && dst_dir {
                fail!(Errno::EISDIR);
            }
            if dst_dir && !self.nodes[&d].children.is_empty() {
                fail!(Errno::ENOTEMPTY);
            }
        }
        Pred::Ok(Effect::Rename {
            parent: p,
            name,
            new_parent: np,
            new_name,
        })
    }

    /// Drops one name of `id` (already removed from its directory).
    fn drop_name(&mut self, id: InodeId) {
        let n = self.nodes.get_mut(&id).expect("named inode");
        if n.kind == FileKind::Dir {
            assert!(n.children.is_empty(), "removed a non-empty directory");
            self.nodes.remove(&id);
        } else {
            n.nlink -= 1;
            if n.nlink == 0 {
                self.nodes.remove(&id);
            }
        }
    }

    fn apply(&mut self, effect: Effect, reply: &Reply) {
        match effect {
            Effect::Nothing => {}
            Effect::Resolves(id) => match reply {
                Reply::Entry(a) => assert_eq!(a.id, id, "lookup resolved to the wrong inode"),
                r => panic!("lookup replied {r:?}"),
            },
            Effect::Create { parent, name, kind } => {
                let Reply::Entry(a) = reply else {
                    panic!("create replied {reply:?}")
                };
                assert!(
                    !self.nodes.contains_key(&a.id),
                    "new inode {:#x} reuses a live id",
                    a.id
                );
                assert_eq!(a.kind(), Some(kind));
                let node = Node {
                    kind,
                    nlink: 1,
                    parent,
                    children: BTreeMap::new(),
                };
                self.nodes.insert(a.id, node);
                self.nodes
                    .get_mut(&parent)
                    .unwrap()
                    .children
                    .insert(name, a.id);
            }
            Effect::Open(id) => match reply {
                Reply::Entry(a) => assert_eq!(a.id, id, "O_CREAT opened another inode"),
                r => panic!("open replied {r:?}"),
            },
            Effect::Link { id, parent, name } => {
                self.nodes.get_mut(&id).unwrap().nlink += 1;
                self.nodes
                    .get_mut(&parent)
                    .unwrap()
                    .children
                    .insert(name, id);
            }
            Effect::Remove { parent, name } => {
                let id = self
                    .nodes
                    .get_mut(&parent)
                    .unwrap()
                    .children
                    .remove(&name)
                    .unwrap();
                self.drop_name(id);
            }
            Effect::Rename {
                parent,
                name,
                new_parent,
                new_name,
            } => {
                let src = self
                    .nodes
                    .get_mut(&parent)
                    .unwrap()
                    .children
                    .remove(&name)
                    .unwrap();
                if let Some(old) = self
                    .nodes
                    .get_mut(&new_parent)
                    .unwrap()
                    .children
                    .insert(new_name, src)
                {
                    self.drop_name(old);
                }
                if self.is_dir(src) {
                    self.nodes.get_mut(&src).unwrap().parent = new_parent;
                }
            }
            Effect::Exchange {
                parent,
                name,
                new_parent,
                new_name,
            } => {
                let src = self.child(parent, &name).unwrap();
                let dst = self.child(new_parent, &new_name).unwrap();
                self.nodes
                    .get_mut(&parent)
                    .unwrap()
                    .children
                    .insert(name, dst);
                self.nodes
                    .get_mut(&new_parent)
                    .unwrap()
                    .children
                    .insert(new_name, src);
                if self.is_dir(src) {
                    self.nodes.get_mut(&src).unwrap().parent = new_parent;
                }
                if self.is_dir(dst) {
                    self.nodes.get_mut(&dst).unwrap().parent = parent;
                }
            }
        }
    }
}

/// Compares everything the model knows with what the engine shows through its operations.
fn compare(fs: &mut Fs, model: &Model) {
    let live: BTreeSet<InodeId> = snapshot(&fs.e).inodes.iter().map(|(id, _)| *id).collect();
    let expect: BTreeSet<InodeId> = model.nodes.keys().copied().collect();
    assert_eq!(live, expect, "the engine's inodes differ from the model's");
    let ids: Vec<InodeId> = expect.into_iter().collect();
    for id in ids {
        let node = model.nodes[&id].clone();
        let a = fs.attr(id);
        assert_eq!(a.kind(), Some(node.kind), "kind of {id:#x}");
        assert_eq!(a.nlink, model.nlink(id), "nlink of {id:#x}");
        if node.kind != FileKind::Dir {
            continue;
        }
        let entries = fs.readdir_all_as(&root(), id, 5, false).unwrap();
        assert_eq!(entries[0].name, b".");
        assert_eq!(entries[0].id, id);
        assert_eq!(entries[1].name, b"..");
        assert_eq!(entries[1].id, node.parent, "\"..\" of {id:#x}");
        let got: BTreeMap<Vec<u8>, (InodeId, FileKind)> = entries[2..]
            .iter()
            .map(|e| (e.name.clone(), (e.id, e.kind)))
            .collect();
        assert_eq!(
            got.len(),
            entries.len() - 2,
            "a name listed twice in {id:#x}"
        );
        let want: BTreeMap<Vec<u8>, (InodeId, FileKind)> = node
            .children
            .iter()
            .map(|(n, c)| (n.clone(), (*c, model.nodes[c].kind)))
            .collect();
        assert_eq!(got, want, "entries of {id:#x}");
        assert_eq!(fs.lookup(id, "..").unwrap().id, node.parent);
    }
}

const NAMES: [&str; 7] = ["a", "b", "c", "d", "e", "f", "g"];

fn random_name(rng: &mut Rng) -> Vec<u8> {
    if rng.chance(94, 100) {
        return rng.pick(&NAMES).as_bytes().to_vec();
    }
    match rng.below(5) {
        0 => b".".to_vec(),
        1 => b"..".to_vec(),
        2 => Vec::new(),
        3 => vec![b'n'; NAME_MAX + 1],
        _ => b"x/y".to_vec(),
    }
}

fn random_cred(rng: &mut Rng) -> Credentials {
    match rng.below(10) {
        0..=3 => root(),
        4 | 5 => usr(ALICE),
        6 | 7 => usr_g(BOB, BOB, &[ALICE, STAFF]),
        _ => usr_g(CAROL, STAFF, &[]),
    }
}

fn random_time(rng: &mut Rng) -> Option<TimeSet> {
    match rng.below(3) {
        0 => None,
        1 => Some(TimeSet::Now),
        _ => Some(TimeSet::At(rng.below(1 << 40) as i64 - (1 << 39))),
    }
}

struct Gen<'a> {
    rng: &'a mut Rng,
    model: &'a Model,
    /// Ids that once existed (some are gone, some were reused).
    seen: &'a [InodeId],
}

impl Gen<'_> {
    fn any_id(&mut self) -> InodeId {
        let mut ids: Vec<InodeId> = self.model.nodes.keys().copied().collect();
        ids.sort_unstable();
        if self.rng.chance(1, 12) && !self.seen.is_empty() {
            return *self.rng.pick(self.seen);
        }
        if self.rng.chance(1, 40) {
            return self.model.root + 1 + self.rng.below(1 << 20);
        }
        *self.rng.pick(&ids)
    }

    fn dir_id(&mut self) -> InodeId {
        if self.rng.chance(1, 10) {
            return self.any_id();
        }
        let mut dirs: Vec<InodeId> = self
            .model
            .nodes
            .iter()
            .filter(|(_, n)| n.kind == FileKind::Dir)
            .map(|(id, _)| *id)
            .collect();
        dirs.sort_unstable();
        *self.rng.pick(&dirs)
    }

    /// A random existing entry `(directory, name)` whose inode passes `keep`, if any.
    fn entry(&mut self, keep: impl Fn(&Node) -> bool) -> Option<(InodeId, Vec<u8>)> {
        let mut all: Vec<(InodeId, Vec<u8>)> = Vec::new();
        for (dir, node) in &self.model.nodes {
            for (name, child) in &node.children {
                if keep(&self.model.nodes[child]) {
                    all.push((*dir, name.clone()));
                }
            }
        }
        all.sort();
        (!all.is_empty()).then(|| all[self.rng.below(all.len() as u64) as usize].clone())
    }

    /// Mostly an existing entry that passes `keep`, sometimes any directory and name.
    fn target(&mut self, keep: impl Fn(&Node) -> bool) -> (InodeId, Vec<u8>) {
        if self.rng.chance(3, 4)
            && let Some(e) = self.entry(keep)
        {
            return e;
        }
        (self.dir_id(), random_name(self.rng))
    }

    fn op(&mut self) -> Op {
        let name = random_name(self.rng);
        match self.rng.below(100) {
            0..=13 => {
                let parent = self.dir_id();
                let perm = *self.rng.pick(&[0o644, 0o600, 0o755, 0o2755, 0o4755, 0o666]);
                Op::Mknod {
                    parent,
                    name,
                    mode: S_IFREG | perm,
                    rdev: 0,
                    exclusive: self.rng.chance(4, 5),
                }
            }
            14..=17 => {
                let parent = self.dir_id();
                let t = *self.rng.pick(&[
                    S_IFIFO, S_IFSOCK, S_IFCHR, S_IFBLK, S_IFDIR, S_IFLNK, 0, 0o170000,
                ]);
                Op::Mknod {
                    parent,
                    name,
                    mode: t | 0o640,
                    rdev: 0x0801,
                    exclusive: self.rng.chance(1, 2),
                }
            }
            18..=31 => {
                let parent = self.dir_id();
                let mode = *self.rng.pick(&[0o755, 0o777, 0o1777, 0o2775, 0o700]);
                Op::Mkdir { parent, name, mode }
            }
            32..=35 => {
                let parent = self.dir_id();
                let target = match self.rng.below(12) {
                    0 => Vec::new(),
                    1 => vec![b't'; SYMLINK_MAX + 1],
                    _ => b"some/where".to_vec(),
                };
                Op::Symlink {
                    parent,
                    name,
                    target,
                }
            }
            36..=43 => {
                let id = match self.entry(|n| n.kind != FileKind::Dir) {
                    Some((dir, n)) if self.rng.chance(3, 4) => self.model.child(dir, &n).unwrap(),
                    _ => self.any_id(),
                };
                let new_parent = self.dir_id();
                Op::Link {
                    id,
                    new_parent,
                    new_name: name,
                }
            }
            44..=52 => {
                let (parent, name) = self.target(|n| n.kind != FileKind::Dir);
                Op::Unlink { parent, name }
            }
            53..=60 => {
                let (parent, name) = if self.rng.chance(1, 2) {
                    self.target(|n| n.kind == FileKind::Dir && n.children.is_empty())
                } else {
                    self.target(|n| n.kind == FileKind::Dir)
                };
                Op::Rmdir { parent, name }
            }
            61..=76 => {
                let flags = match self.rng.below(20) {
                    0..=12 => 0,
                    13 | 14 => RENAME_NOREPLACE,
                    15..=18 => RENAME_EXCHANGE,
                    _ => *self
                        .rng
                        .pick(&[RENAME_NOREPLACE | RENAME_EXCHANGE, 8, 1 << 31]),
                };
                let (parent, name) = self.target(|_| true);
                let (new_parent, new_name) = if self.rng.chance(1, 2) {
                    self.target(|_| true)
                } else {
                    (self.dir_id(), random_name(self.rng))
                };
                Op::Rename {
                    parent,
                    name,
                    new_parent,
                    new_name,
                    flags,
                }
            }
            77..=84 => {
                let id = self.any_id();
                let mut set = SetAttrs::default();
                match self.rng.below(5) {
                    0 => {
                        set.mode = Some(*self.rng.pick(&[
                            0o777, 0o777, 0o1777, 0o2777, 0o755, 0o700, 0o711, 0o000, 0o6755,
                        ]))
                    }
                    1 => {
                        set.uid = self
                            .rng
                            .chance(1, 2)
                            .then(|| *self.rng.pick(&[0, ALICE, BOB, CAROL]));
                        set.gid = self
                            .rng
                            .chance(1, 2)
                            .then(|| *self.rng.pick(&[0, ALICE, BOB, STAFF]));
                    }
                    2 => set.size = Some(self.rng.below(10_000)),
                    3 => {
                        set.atime = random_time(self.rng);
                        set.mtime = random_time(self.rng);
                    }
                    _ => {
                        set.mode = Some(0o777);
                        set.size = Some(0);
                    }
                }
                Op::SetAttr { id, set }
            }
            85..=89 => {
                let id = self.any_id();
                let xname = self
                    .rng
                    .pick(&[
                        "user.a",
                        "user.b",
                        "trusted.t",
                        "security.s",
                        "system.x",
                        "foo.bar",
                        "user.",
                    ])
                    .as_bytes()
                    .to_vec();
                match self.rng.below(4) {
                    0 | 1 => {
                        let len = self.rng.below(20) as usize;
                        Op::SetXattr {
                            id,
                            name: xname,
                            value: vec![b'v'; len],
                            flags: self.rng.below(4) as u32,
                        }
                    }
                    2 => Op::GetXattr { id, name: xname },
                    _ => Op::RemoveXattr { id, name: xname },
                }
            }
            90..=93 => Op::Lookup {
                parent: self.dir_id(),
                name,
            },
            94 | 95 => Op::Readdir {
                id: self.dir_id(),
                cookie: 0,
                max_entries: 1 + self.rng.below(8) as u32,
                plus: self.rng.chance(1, 2),
            },
            96 => Op::Access {
                id: self.any_id(),
                mask: self.rng.below(9) as u32,
            },
            97 => Op::Readlink { id: self.any_id() },
            98 => Op::ListXattr { id: self.any_id() },
            _ => Op::GetAttr { id: self.any_id() },
        }
    }
}

fn run(seed: u64, steps: usize) {
    let mut fs = Fs::new();
    let mut rng = Rng::new(seed);
    let r = fs.root();
    fs.chmod_as(&root(), r, 0o777).unwrap();
    let mut model = Model::new(r);
    let mut seen: Vec<InodeId> = vec![r];
    let mut counts: HashMap<(&'static str, bool), usize> = HashMap::new();
    for step in 0..steps {
        let op = Gen {
            rng: &mut rng,
            model: &model,
            seen: &seen,
        }
        .op();
        let cred = random_cred(&mut rng);
        let pred = model.predict(&op);
        let reply = fs.exec(&cred, op.clone());
        let ctx = || format!("seed {seed} step {step}: {op:?} as {cred:?} -> {reply:?}");
        let got = match &reply {
            Reply::Error(e) => Err(e.errno),
            Reply::WrongServer { .. } => panic!("{}: every table is hosted", ctx()),
            _ => Ok(()),
        };
        *counts.entry((op.name(), got.is_ok())).or_default() += 1;
        let perm = |e: Errno| e == Errno::EACCES || e == Errno::EPERM;
        match (pred, got) {
            (Pred::Any, _) => {}
            (Pred::Err(want), Err(e)) => {
                assert!(
                    e == want || (!cred.is_root() && perm(e)),
                    "{}: expected {want:?}",
                    ctx()
                );
            }
            (Pred::Err(want), Ok(())) => panic!("{}: expected {want:?}", ctx()),
            (Pred::Ok(effect), Err(e)) => {
                assert!(
                    !cred.is_root() && perm(e),
                    "{}: expected success ({effect:?})",
                    ctx()
                );
            }
            (Pred::Ok(effect), Ok(())) => {
                if let Reply::Entry(a) = &reply
                    && !seen.contains(&a.id)
                {
                    seen.push(a.id);
                }
                model.apply(effect, &reply);
            }
        }
        if (step + 1) % CHECK_EVERY == 0 {
            compare(&mut fs, &model);
            fs.check();
        }
    }
    compare(&mut fs, &model);
    fs.check();
    // The run must have exercised both outcomes of the namespace operations.
    for name in [
        "mknod", "mkdir", "link", "unlink", "rmdir", "rename", "symlink", "setattr",
    ] {
        for ok in [true, false] {
            assert!(
                counts.get(&(name, ok)).copied().unwrap_or(0) > 0,
                "seed {seed}: no {name} with ok={ok}: {counts:?}"
            );
        }
    }
}

#[test]
fn random_operations_match_the_model_seed_1() {
    run(1, 4000);
}

#[test]
fn random_operations_match_the_model_seed_2() {
    run(2, 4000);
}

#[test]
fn random_operations_match_the_model_seed_3() {
    run(0xC0FFEE, 4000);
}
