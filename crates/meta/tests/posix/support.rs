//! Test harness: an engine with a clock, a redo log of every mutation it emitted, reply
//! decoders, whole-engine snapshots and the replay check.

#![allow(dead_code)]

use kochab_meta::{Engine, EngineConfig, Inode, Mutation};
use kochab_proto::{
    Attr, Credentials, DirEntry, Errno, FileKind, InodeId, Op, Reply, SetAttrs, TimeNs, TimeSet,
    mode,
};

/// Boot time of every test cluster; each operation runs one `STEP` later than the one before.
pub const T0: TimeNs = 1_700_000_000_000_000_000;
pub const STEP: TimeNs = 1_000;

pub type R<T> = Result<T, Errno>;

pub const ALICE: u32 = 1000;
pub const BOB: u32 = 1001;
pub const CAROL: u32 = 1002;
/// A group neither user has as primary group.
pub const STAFF: u32 = 50;

pub fn root() -> Credentials {
    Credentials::root()
}

/// A user whose primary group has the same number as the uid.
pub fn usr(uid: u32) -> Credentials {
    Credentials::user(uid, uid)
}

/// A user with a primary group and supplementary groups.
pub fn usr_g(uid: u32, gid: u32, groups: &[u32]) -> Credentials {
    Credentials {
        uid,
        gid,
        groups: groups.to_vec(),
    }
}

/// One directory entry as stored: (directory, cookie, name, child, kind).
pub type EntryRow = (InodeId, u64, Vec<u8>, InodeId, FileKind);
/// One inode's extended attributes, by name.
pub type XattrRow = (InodeId, Vec<(Vec<u8>, Vec<u8>)>);

/// One file's chunk layout: (chunk, refs) ascending.
pub type LayoutRow = (InodeId, Vec<(u64, Vec<kochab_meta::SliceRef>)>);

/// Everything an engine holds, in a comparable form.
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    pub inodes: Vec<(InodeId, Inode)>,
    pub entries: Vec<EntryRow>,
    pub xattrs: Vec<XattrRow>,
    /// Each table's recorded overflow-region allocation point.
    pub regions: Vec<(InodeId, Option<u64>)>,
    /// Chunk layouts by file: (chunk, refs) ascending.
    pub layouts: Vec<LayoutRow>,
}

pub fn snapshot(e: &Engine) -> Snapshot {
    let mut s = Snapshot {
        inodes: Vec::new(),
        entries: Vec::new(),
        xattrs: Vec::new(),
        regions: Vec::new(),
        layouts: Vec::new(),
    };
    for t in e.tables() {
        s.regions.push((t.lo, t.region_next()));
        for (id, l) in t.iter_layouts() {
            s.layouts
                .push((id, l.iter().map(|(&c, r)| (c, r.clone())).collect()));
        }
        for (id, inode) in t.iter_inodes() {
            s.inodes.push((id, inode.clone()));
            if let Some(x) = t.xattrs(id) {
                s.xattrs
                    .push((id, x.iter().map(|(k, v)| (k.clone(), v.clone())).collect()));
            }
        }
        for (dir, entries) in t.iter_dirs() {
            for (cookie, d) in entries.iter() {
                s.entries
                    .push((dir, cookie, d.name.as_bytes().to_vec(), d.child, d.kind));
            }
        }
    }
    s.entries.sort_by_key(|e| (e.0, e.1));
    s.layouts.sort_by_key(|l| l.0);
    s
}

pub fn to_entry(r: Reply) -> R<Attr> {
    match r {
        Reply::Entry(a) => Ok(a),
        Reply::Error(e) => Err(e.errno),
        r => panic!("expected an entry, got {r:?}"),
    }
}

pub fn to_attr(r: Reply) -> R<Attr> {
    match r {
        Reply::Attr(a) => Ok(a),
        Reply::Error(e) => Err(e.errno),
        r => panic!("expected attributes, got {r:?}"),
    }
}

pub fn to_empty(r: Reply) -> R<()> {
    match r {
        Reply::Empty => Ok(()),
        Reply::Error(e) => Err(e.errno),
        r => panic!("expected an empty reply, got {r:?}"),
    }
}

pub fn to_bytes(r: Reply) -> R<Vec<u8>> {
    match r {
        Reply::Bytes(b) => Ok(b),
        Reply::Error(e) => Err(e.errno),
        r => panic!("expected bytes, got {r:?}"),
    }
}

pub fn to_dir(r: Reply) -> R<(Vec<DirEntry>, bool)> {
    match r {
        Reply::Dir { entries, eof } => Ok((entries, eof)),
        Reply::Error(e) => Err(e.errno),
        r => panic!("expected directory entries, got {r:?}"),
    }
}

fn n(name: impl AsRef<[u8]>) -> Vec<u8> {
    name.as_ref().to_vec()
}

/// An engine with a clock and the log of every mutation it emitted since bootstrap.
pub struct Fs {
    pub e: Engine,
    pub cfg: EngineConfig,
    pub log: Vec<Mutation>,
    /// The time the last operation ran at.
    pub now: TimeNs,
    /// Check that every failed or read-only operation leaves the engine exactly as it was
    /// (one snapshot per operation; turned off by tests that build huge namespaces).
    pub check_unchanged: bool,
}

impl Fs {
    pub fn new() -> Fs {
        Fs::with_config(EngineConfig::with_key([1, 2]))
    }

    pub fn with_config(cfg: EngineConfig) -> Fs {
        let mut e = Engine::new_cluster(cfg.clone()).expect("cluster");
        for m in e.bootstrap(T0) {
            e.apply(&m).expect("bootstrap");
        }
        Fs {
            e,
            cfg,
            log: Vec::new(),
            now: T0,
            check_unchanged: true,
        }
    }

    pub fn root(&self) -> InodeId {
        self.e.root()
    }

    /// Runs one operation one step after the previous one. Failed and read-only operations
    /// must emit no mutation and (when checked) change nothing at all.
    pub fn exec(&mut self, c: &Credentials, op: Op) -> Reply {
        self.now += STEP;
        let before = self.check_unchanged.then(|| snapshot(&self.e));
        let mut out = Vec::new();
        let reply = self.e.execute(c, &op, self.now, &mut out);
        let failed = matches!(reply, Reply::Error(_) | Reply::WrongServer { .. });
        if failed || op.is_read_only() {
            assert!(
                out.is_empty(),
                "{op:?} -> {reply:?} emitted mutations {out:?}"
            );
            if let Some(before) = before {
                assert!(
                    before == snapshot(&self.e),
                    "{op:?} -> {reply:?} changed the engine"
                );
            }
        }
        self.log.extend(out);
        reply
    }

    // ---- operations with explicit credentials ----

    pub fn lookup_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
    ) -> R<Attr> {
        to_entry(self.exec(
            c,
            Op::Lookup {
                parent,
                name: n(name),
            },
        ))
    }

    pub fn getattr_as(&mut self, c: &Credentials, id: InodeId) -> R<Attr> {
        to_attr(self.exec(c, Op::GetAttr { id }))
    }

    pub fn setattr_as(&mut self, c: &Credentials, id: InodeId, set: SetAttrs) -> R<Attr> {
        to_attr(self.exec(c, Op::SetAttr { id, set }))
    }

    pub fn mknod_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        mode: u32,
        rdev: u32,
        exclusive: bool,
    ) -> R<Attr> {
        to_entry(self.exec(
            c,
            Op::Mknod {
                parent,
                name: n(name),
                mode,
                rdev,
                exclusive,
            },
        ))
    }

    /// An exclusive create of a regular file with permission bits `perm`.
    pub fn create_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        perm: u32,
    ) -> R<Attr> {
        self.mknod_as(c, parent, name, mode::S_IFREG | perm, 0, true)
    }

    pub fn mkdir_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        mode: u32,
    ) -> R<Attr> {
        to_entry(self.exec(
            c,
            Op::Mkdir {
                parent,
                name: n(name),
                mode,
            },
        ))
    }

    pub fn symlink_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        target: impl AsRef<[u8]>,
    ) -> R<Attr> {
        to_entry(self.exec(
            c,
            Op::Symlink {
                parent,
                name: n(name),
                target: n(target),
            },
        ))
    }

    pub fn link_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
    ) -> R<Attr> {
        to_entry(self.exec(
            c,
            Op::Link {
                id,
                new_parent,
                new_name: n(new_name),
            },
        ))
    }

    pub fn unlink_as(&mut self, c: &Credentials, parent: InodeId, name: impl AsRef<[u8]>) -> R<()> {
        to_empty(self.exec(
            c,
            Op::Unlink {
                parent,
                name: n(name),
            },
        ))
    }

    pub fn rmdir_as(&mut self, c: &Credentials, parent: InodeId, name: impl AsRef<[u8]>) -> R<()> {
        to_empty(self.exec(
            c,
            Op::Rmdir {
                parent,
                name: n(name),
            },
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rename_as(
        &mut self,
        c: &Credentials,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
        flags: u32,
    ) -> R<()> {
        to_empty(self.exec(
            c,
            Op::Rename {
                parent,
                name: n(name),
                new_parent,
                new_name: n(new_name),
                flags,
            },
        ))
    }

    pub fn readlink_as(&mut self, c: &Credentials, id: InodeId) -> R<Vec<u8>> {
        to_bytes(self.exec(c, Op::Readlink { id }))
    }

    pub fn readdir_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> R<(Vec<DirEntry>, bool)> {
        to_dir(self.exec(
            c,
            Op::Readdir {
                id,
                cookie,
                max_entries,
                plus,
            },
        ))
    }

    pub fn setxattr_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        name: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        flags: u32,
    ) -> R<()> {
        to_empty(self.exec(
            c,
            Op::SetXattr {
                id,
                name: n(name),
                value: n(value),
                flags,
            },
        ))
    }

    pub fn getxattr_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        name: impl AsRef<[u8]>,
    ) -> R<Vec<u8>> {
        to_bytes(self.exec(c, Op::GetXattr { id, name: n(name) }))
    }

    /// The names listxattr returns, in order.
    pub fn listxattr_as(&mut self, c: &Credentials, id: InodeId) -> R<Vec<String>> {
        let raw = to_bytes(self.exec(c, Op::ListXattr { id }))?;
        assert!(
            raw.is_empty() || raw.ends_with(&[0]),
            "listxattr must end each name with NUL"
        );
        Ok(raw
            .split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect())
    }

    pub fn removexattr_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        name: impl AsRef<[u8]>,
    ) -> R<()> {
        to_empty(self.exec(c, Op::RemoveXattr { id, name: n(name) }))
    }

    pub fn access_as(&mut self, c: &Credentials, id: InodeId, mask: u32) -> R<()> {
        to_empty(self.exec(c, Op::Access { id, mask }))
    }

    pub fn chmod_as(&mut self, c: &Credentials, id: InodeId, mode: u32) -> R<Attr> {
        self.setattr_as(
            c,
            id,
            SetAttrs {
                mode: Some(mode),
                ..Default::default()
            },
        )
    }

    pub fn chown_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> R<Attr> {
        self.setattr_as(
            c,
            id,
            SetAttrs {
                uid,
                gid,
                ..Default::default()
            },
        )
    }

    pub fn truncate_as(&mut self, c: &Credentials, id: InodeId, size: u64) -> R<Attr> {
        self.setattr_as(
            c,
            id,
            SetAttrs {
                size: Some(size),
                ..Default::default()
            },
        )
    }

    pub fn utimes_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        atime: Option<TimeSet>,
        mtime: Option<TimeSet>,
    ) -> R<Attr> {
        self.setattr_as(
            c,
            id,
            SetAttrs {
                atime,
                mtime,
                ..Default::default()
            },
        )
    }

    /// Every entry of a directory ("." and ".." included), read in pages of `page`.
    pub fn readdir_all_as(
        &mut self,
        c: &Credentials,
        id: InodeId,
        page: u32,
        plus: bool,
    ) -> R<Vec<DirEntry>> {
        let mut all = Vec::new();
        let mut cookie = 0;
        loop {
            let (entries, eof) = self.readdir_as(c, id, cookie, page, plus)?;
            assert!(
                !entries.is_empty() || eof,
                "a page without entries must be the last"
            );
            if let Some(last) = entries.last() {
                cookie = last.cookie;
            }
            all.extend(entries);
            if eof {
                return Ok(all);
            }
        }
    }

    // ---- root shorthands ----

    pub fn lookup(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> R<Attr> {
        self.lookup_as(&root(), parent, name)
    }

    pub fn attr(&mut self, id: InodeId) -> Attr {
        self.getattr_as(&root(), id)
            .unwrap_or_else(|e| panic!("getattr {id:#x}: {e:?}"))
    }

    pub fn getattr(&mut self, id: InodeId) -> R<Attr> {
        self.getattr_as(&root(), id)
    }

    /// A regular file (mode 0644) created by root.
    pub fn file(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> InodeId {
        self.create_as(&root(), parent, name, 0o644)
            .expect("create")
            .id
    }

    /// A directory (mode 0755) created by root.
    pub fn dir(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> InodeId {
        self.mkdir_as(&root(), parent, name, 0o755)
            .expect("mkdir")
            .id
    }

    pub fn unlink(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> R<()> {
        self.unlink_as(&root(), parent, name)
    }

    pub fn rmdir(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> R<()> {
        self.rmdir_as(&root(), parent, name)
    }

    pub fn rename(
        &mut self,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
    ) -> R<()> {
        self.rename_as(&root(), parent, name, new_parent, new_name, 0)
    }

    pub fn rename2(
        &mut self,
        parent: InodeId,
        name: impl AsRef<[u8]>,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
        flags: u32,
    ) -> R<()> {
        self.rename_as(&root(), parent, name, new_parent, new_name, flags)
    }

    pub fn link(
        &mut self,
        id: InodeId,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
    ) -> R<Attr> {
        self.link_as(&root(), id, new_parent, new_name)
    }

    /// Sets owner and permission bits as root (chown first: it would clear set-id bits).
    pub fn own(&mut self, id: InodeId, uid: u32, gid: u32, perm: u32) {
        self.chown_as(&root(), id, Some(uid), Some(gid))
            .expect("chown");
        self.chmod_as(&root(), id, perm).expect("chmod");
    }

    /// The id a name resolves to (as root).
    pub fn id_of(&mut self, parent: InodeId, name: impl AsRef<[u8]>) -> InodeId {
        self.lookup(parent, name).expect("lookup").id
    }

    /// The sorted names of a directory, without "." and "..".
    pub fn names(&mut self, dir: InodeId) -> Vec<String> {
        let mut v: Vec<String> = self
            .readdir_all_as(&root(), dir, 1000, false)
            .expect("readdir")
            .into_iter()
            .filter(|e| e.name != b"." && e.name != b"..")
            .map(|e| String::from_utf8_lossy(&e.name).into_owned())
            .collect();
        v.sort();
        v
    }

    /// Runs the engine's invariant check and the replay check.
    pub fn check(&mut self) {
        let problems = self.e.check_invariants();
        assert!(problems.is_empty(), "invariants violated: {problems:#?}");
        assert_replay_matches(self);
    }
}

/// Replays the whole log into a fresh engine and checks that it holds exactly what the live
/// engine holds, both as raw state and as every read-only operation shows it.
pub fn assert_replay_matches(fs: &mut Fs) {
    let mut replayed = Engine::new_cluster(fs.cfg.clone()).expect("cluster");
    for m in replayed.bootstrap(T0) {
        replayed.apply(&m).expect("bootstrap");
    }
    for m in &fs.log {
        replayed
            .apply(m)
            .unwrap_or_else(|e| panic!("replaying {m:?}: {e}"));
    }
    let live = snapshot(&fs.e);
    assert!(
        snapshot(&replayed) == live,
        "replayed engine differs from the live one"
    );
    let problems = replayed.check_invariants();
    assert!(
        problems.is_empty(),
        "replayed engine violates invariants: {problems:#?}"
    );
    let cred = root();
    let ask = |e: &mut Engine, op: &Op| {
        let mut out = Vec::new();
        let r = e.execute(&cred, op, fs.now, &mut out);
        assert!(out.is_empty(), "read-only {op:?} emitted mutations");
        r
    };
    for (id, inode) in &live.inodes {
        let id = *id;
        let mut ops = vec![
            Op::GetAttr { id },
            Op::ListXattr { id },
            Op::Readlink { id },
            Op::Access { id, mask: 7 },
        ];
        if let Some((_, x)) = live.xattrs.iter().find(|(x, _)| *x == id) {
            ops.extend(x.iter().map(|(name, _)| Op::GetXattr {
                id,
                name: name.clone(),
            }));
        }
        for op in ops {
            assert_eq!(
                ask(&mut fs.e, &op),
                ask(&mut replayed, &op),
                "live and replayed engines disagree on {op:?}"
            );
        }
        if inode.is_dir() {
            let mut cookie = 0;
            loop {
                let op = Op::Readdir {
                    id,
                    cookie,
                    max_entries: 7,
                    plus: true,
                };
                let a = ask(&mut fs.e, &op);
                assert_eq!(
                    a,
                    ask(&mut replayed, &op),
                    "live and replayed engines disagree on {op:?}"
                );
                match a {
                    Reply::Dir { entries, eof } => {
                        if eof {
                            break;
                        }
                        cookie = entries.last().expect("a non-final page has entries").cookie;
                    }
                    r => panic!("readdir of directory {id:#x}: {r:?}"),
                }
            }
            for name in [&b"."[..], b".."] {
                let op = Op::Lookup {
                    parent: id,
                    name: name.to_vec(),
                };
                assert_eq!(ask(&mut fs.e, &op), ask(&mut replayed, &op));
            }
        }
    }
}

/// xorshift64*: a small deterministic generator for the randomized tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `num/den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}
