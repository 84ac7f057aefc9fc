//! Multi-server operations as transaction plans (issue 33): what each server of a
//! cross-server operation locks, checks and changes, as a `kochab_cluster::txn::Plan`.
//! Pure functions over the engine; `txn_host` carries them out.
//!
//! A plan's writes are not post-images but small changes ([`Change`], encoded into
//! `Write::Put`) that the participant checks once it holds the locks and turns into the
//! engine's redo mutations when the commit is durable: the initiator sees only its own
//! tables, so it cannot know the other servers' inodes, and while the keys are locked
//! nothing else changes them, so the change computed at apply time is the one checked.
//!
//! Covered: a rename of a non-directory between directories of different servers, flags
//! 0, onto a name that does not exist; a hard link to a non-directory of this server from
//! a directory of another; an unlink of a name here whose non-directory inode another
//! server holds (a file renamed or linked here from there). Anything else (a directory moved, a replaced
//! target, an exchange, a sticky directory whose victim lives elsewhere) has no plan, or
//! its check fails at a participant; the caller then borrows as before, which answers
//! the exact errno.

use kochab_cluster::txn::{Expect, Key, Mutation as TxnMutation, Part, Plan, Write};
use kochab_meta::{Engine, Inode, Mutation, Name};
use kochab_proto::access::{W_OK, X_OK};
use kochab_proto::cluster::ServerId;
use kochab_proto::{Credentials, FileKind, InodeId, Op, TimeNs};
use serde::{Deserialize, Serialize};

/// What one key of a plan becomes on commit (the `Write::Put` payload).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// The entry (the key) named `child` and goes away.
    DropEntry { child: InodeId },
    /// The entry (the key) is created naming `child`.
    PutEntry { child: InodeId, kind: FileKind },
    /// A directory (the key) gains or loses an entry: the caller needs write and search
    /// permission, and, if the directory is sticky and an entry leaves, to own it or the
    /// victim; mtime and ctime become `time`.
    Dir {
        cred: Credentials,
        time: TimeNs,
        victim: Option<InodeId>,
    },
    /// The inode (the key) was renamed: its ctime becomes `time`.
    Touch { time: TimeNs },
    /// The inode (the key) gains a name: the caller may link it (owner, or
    /// `protected_hardlinks` rules), it is a live non-directory below `LINK_MAX`; nlink
    /// rises by one and ctime becomes `time`.
    Link { cred: Credentials, time: TimeNs },
    /// The inode (the key), a non-directory, loses a name: nlink falls by one and ctime
    /// becomes `time`; with its last name, unless it is open here, it goes (and its data
    /// with it, as a local unlink does).
    Unlink { time: TimeNs },
}

/// Why a plan was not made (the caller borrows instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoPlan {
    /// An operation or a case transactions do not cover (yet).
    NotCovered(&'static str),
    /// The owner of a table is not known from the cached map.
    NoOwner(InodeId),
}

/// The plan of `op` as the initiator's engine sees it, `owner` naming the server of an
/// id's table. Only the source side of a rename must be hosted here (the client routes a
/// rename to its source directory's server).
pub fn plan_op(
    engine: &Engine,
    cred: &Credentials,
    op: &Op,
    now: TimeNs,
    owner: impl Fn(InodeId) -> Option<ServerId>,
) -> Result<Plan, NoPlan> {
    let keyed = match op {
        Op::Rename { .. } => rename_keys(engine, cred, op, now)?,
        Op::Link {
            id,
            new_parent,
            new_name,
        } => link_keys(engine, cred, *id, *new_parent, new_name, now)?,
        Op::Unlink { parent, name } => unlink_keys(engine, cred, *parent, name, now)?,
        _ => {
            return Err(NoPlan::NotCovered(
                "only rename, link and unlink run as transactions",
            ));
        }
    };
    by_server(keyed, owner)
}

/// The mutations of a link, each with the id whose table holds its key.
fn link_keys(
    engine: &Engine,
    cred: &Credentials,
    id: InodeId,
    new_parent: InodeId,
    new_name: &[u8],
    now: TimeNs,
) -> Result<Vec<(InodeId, TxnMutation)>, NoPlan> {
    if !name_ok(new_name) {
        return Err(NoPlan::NotCovered("an invalid name"));
    }
    let Some(inode) = engine.inode(id) else {
        return Err(NoPlan::NotCovered("the inode is elsewhere"));
    };
    let kind = inode.kind();
    if kind == FileKind::Dir {
        return Err(NoPlan::NotCovered("a directory"));
    }
    Ok(vec![
        on_inode(
            id,
            &Change::Link {
                cred: cred.clone(),
                time: now,
            },
        ),
        on_entry(
            new_parent,
            new_name,
            Expect::Absent,
            &Change::PutEntry { child: id, kind },
        ),
        on_inode(new_parent, &dir_change(cred, now, None)),
    ])
}

/// The mutations of an unlink, each with the id whose table holds its key: the entry and
/// its directory here, the inode where it lives.
fn unlink_keys(
    engine: &Engine,
    cred: &Credentials,
    parent: InodeId,
    name: &[u8],
    now: TimeNs,
) -> Result<Vec<(InodeId, TxnMutation)>, NoPlan> {
    if !name_ok(name) {
        return Err(NoPlan::NotCovered("dot or invalid name"));
    }
    let Some((child, kind)) = engine.child_kind(parent, name) else {
        return Err(NoPlan::NotCovered("no entry here"));
    };
    if kind == FileKind::Dir {
        return Err(NoPlan::NotCovered("a directory"));
    }
    Ok(vec![
        on_entry(parent, name, Expect::Present, &Change::DropEntry { child }),
        on_inode(parent, &dir_change(cred, now, Some(child))),
        on_inode(child, &Change::Unlink { time: now }),
    ])
}

fn name_ok(n: &[u8]) -> bool {
    !n.is_empty()
        && !is_dot(n)
        && n.len() <= kochab_proto::NAME_MAX
        && !n.contains(&b'/')
        && !n.contains(&0)
}

/// The mutations of a rename, each with the id whose table holds its key.
fn rename_keys(
    engine: &Engine,
    cred: &Credentials,
    op: &Op,
    now: TimeNs,
) -> Result<Vec<(InodeId, TxnMutation)>, NoPlan> {
    let Op::Rename {
        parent,
        name,
        new_parent,
        new_name,
        flags,
    } = op
    else {
        return Err(NoPlan::NotCovered("not a rename"));
    };
    if *flags != 0 {
        return Err(NoPlan::NotCovered("rename flags"));
    }
    if parent == new_parent {
        return Err(NoPlan::NotCovered("one directory"));
    }
    if !name_ok(name) || !name_ok(new_name) {
        return Err(NoPlan::NotCovered("dot or invalid names"));
    }
    // The moved inode may live on another server: its entry says what it is, and its
    // owner checks that (a `Touch` is refused on a directory).
    let Some((child, kind)) = engine.child_kind(*parent, name) else {
        return Err(NoPlan::NotCovered("no source entry here"));
    };
    if kind == FileKind::Dir {
        return Err(NoPlan::NotCovered("a directory moves"));
    }
    Ok(vec![
        on_entry(*parent, name, Expect::Present, &Change::DropEntry { child }),
        on_entry(
            *new_parent,
            new_name,
            Expect::Absent,
            &Change::PutEntry { child, kind },
        ),
        on_inode(*parent, &dir_change(cred, now, Some(child))),
        on_inode(*new_parent, &dir_change(cred, now, None)),
        on_inode(child, &Change::Touch { time: now }),
    ])
}

/// A mutation of inode `id` (which must exist), keyed by its own table.
fn on_inode(id: InodeId, change: &Change) -> (InodeId, TxnMutation) {
    let m = TxnMutation {
        key: Key::Inode(id),
        expect: Expect::Present,
        write: Write::Put(encode(change)),
    };
    (id, m)
}

/// A mutation of the entry `parent/name`, keyed by its directory's table.
fn on_entry(
    parent: InodeId,
    name: &[u8],
    expect: Expect,
    change: &Change,
) -> (InodeId, TxnMutation) {
    let key = Key::Entry {
        parent,
        name: name.to_vec(),
    };
    let m = TxnMutation {
        key,
        expect,
        write: Write::Put(encode(change)),
    };
    (parent, m)
}

/// A directory gaining or losing an entry (`victim`: the inode whose entry leaves).
fn dir_change(cred: &Credentials, time: TimeNs, victim: Option<InodeId>) -> Change {
    Change::Dir {
        cred: cred.clone(),
        time,
        victim,
    }
}

/// Gathers the mutations into one part per server (`owner` of each key's table).
fn by_server(
    keyed: Vec<(InodeId, TxnMutation)>,
    owner: impl Fn(InodeId) -> Option<ServerId>,
) -> Result<Plan, NoPlan> {
    let mut plan: Plan = Vec::new();
    for (table_key, m) in keyed {
        let server = owner(table_key).ok_or(NoPlan::NoOwner(table_key))?;
        let i = match plan.iter().position(|(s, _)| *s == server) {
            Some(i) => i,
            None => {
                plan.push((
                    server,
                    Part {
                        locks: Vec::new(),
                        mutations: Vec::new(),
                    },
                ));
                plan.len() - 1
            }
        };
        plan[i].1.locks.push(m.key.clone());
        plan[i].1.mutations.push(m);
    }
    if plan.len() < 2 {
        return Err(NoPlan::NotCovered("one server holds it all"));
    }
    Ok(plan)
}

fn is_dot(n: &[u8]) -> bool {
    n == b"." || n == b".."
}

/// Encodes a change (our own in-memory type into a Vec: cannot fail).
pub fn encode(c: &Change) -> Vec<u8> {
    kochab_proto::frame::encode_value(Vec::new(), c)
        .unwrap_or_else(|e| panic!("a transaction change does not serialize: {e}"))
}

/// Decodes a change that came over the network or from the journal.
pub fn decode(bytes: &[u8]) -> Option<Change> {
    kochab_proto::frame::decode_payload(bytes).ok()
}

/// The id whose table holds `key` (an entry lives with its directory).
pub fn table_key(key: &Key) -> InodeId {
    match key {
        Key::Inode(id) => *id,
        Key::Entry { parent, .. } => *parent,
    }
}

/// Whether every mutation of `part` may be applied here: each key's table is hosted, its
/// precondition holds, and each change's own check passes (permissions, kinds). Run by a
/// participant holding the part's locks.
pub fn check_part(engine: &Engine, part: &Part) -> Result<(), String> {
    for m in &part.mutations {
        if engine.table_index(table_key(&m.key)).is_none() {
            return Err(format!("{:?} is not hosted here", m.key));
        }
        let present = match &m.key {
            Key::Inode(id) => engine.inode(*id).is_some(),
            Key::Entry { parent, name } => engine.child(*parent, name).is_some(),
        };
        if !kochab_cluster::txn::expect_holds(m, present) {
            return Err(format!("{:?}: expected {:?}", m.key, m.expect));
        }
        let Write::Put(bytes) = &m.write else {
            return Err("a delete without a change".into());
        };
        let change = decode(bytes).ok_or("an undecodable change")?;
        check_change(engine, &m.key, &change)?;
    }
    Ok(())
}

fn check_change(engine: &Engine, key: &Key, change: &Change) -> Result<(), String> {
    match (key, change) {
        (Key::Entry { parent, name }, Change::DropEntry { child }) => {
            match engine.child(*parent, name) {
                Some(c) if c == *child => Ok(()),
                _ => Err("the source entry changed".into()),
            }
        }
        (Key::Entry { .. }, Change::PutEntry { .. }) => Ok(()),
        (
            Key::Inode(id),
            Change::Dir {
                cred,
                victim,
                time: _,
            },
        ) => {
            let dir = engine.inode(*id).ok_or("no directory")?;
            if !dir.is_dir() || dir.nlink == 0 {
                return Err("not a live directory".into());
            }
            kochab_meta::perm::check_access(dir, cred, W_OK | X_OK).map_err(|e| e.to_string())?;
            if let Some(v) = victim {
                let sticky = dir.mode & kochab_proto::mode::S_ISVTX != 0;
                match engine.inode(*v) {
                    Some(victim) => kochab_meta::perm::check_sticky(dir, victim, cred)
                        .map_err(|e| e.to_string())?,
                    None if sticky => return Err("sticky, the victim elsewhere".into()),
                    None => {}
                }
            }
            Ok(())
        }
        (Key::Inode(id), Change::Touch { .. } | Change::Unlink { .. }) => match engine.inode(*id) {
            Some(i) if !i.is_dir() && i.nlink > 0 => Ok(()),
            _ => Err("no such non-directory".into()),
        },
        (Key::Inode(id), Change::Link { cred, .. }) => {
            let i = engine.inode(*id).ok_or("no inode")?;
            if i.is_dir() || i.nlink == 0 || i.nlink >= kochab_proto::LINK_MAX {
                return Err("not a live non-directory below LINK_MAX".into());
            }
            kochab_meta::perm::check_may_link(i, cred).map_err(|e| e.to_string())
        }
        _ => Err(format!("change {change:?} does not fit key {key:?}")),
    }
}

/// The engine's redo mutations for a committed part (checked when it was prepared, its
/// keys locked since), computed under the same hold of the core lock that applies them
/// (a directory's other names change meanwhile). An error is a broken invariant: a
/// checked key changed or left.
pub fn apply_part(engine: &Engine, mutations: &[TxnMutation]) -> Result<Vec<Mutation>, String> {
    let mut out = Vec::with_capacity(mutations.len());
    for m in mutations {
        let Write::Put(bytes) = &m.write else {
            return Err("a delete without a change".into());
        };
        let change = decode(bytes).ok_or("an undecodable change")?;
        let touched = |id: InodeId, f: &dyn Fn(&mut Inode)| -> Result<Mutation, String> {
            let mut inode = engine
                .inode(id)
                .cloned()
                .ok_or_else(|| format!("inode {id:#x} gone while locked"))?;
            f(&mut inode);
            Ok(Mutation::PutInode { id, inode })
        };
        out.push(match (&m.key, change) {
            (Key::Entry { parent, name }, Change::DropEntry { .. }) => Mutation::DropDentry {
                parent: *parent,
                name: Name::new(name),
            },
            (Key::Entry { parent, name }, Change::PutEntry { child, kind }) => {
                Mutation::PutDentry {
                    parent: *parent,
                    name: Name::new(name),
                    child,
                    kind,
                }
            }
            // Forward only: operations on other names of the directory run meanwhile
            // (see `op_keys`) and may have stamped it later than the plan's time.
            (Key::Inode(id), Change::Dir { time, .. }) => touched(*id, &|i| {
                i.mtime = i.mtime.max(time);
                i.ctime = i.ctime.max(time);
            })?,
            (Key::Inode(id), Change::Touch { time }) => touched(*id, &|i| i.ctime = time)?,
            (Key::Inode(id), Change::Link { time, .. }) => touched(*id, &|i| {
                i.nlink += 1;
                i.ctime = time;
            })?,
            (Key::Inode(id), Change::Unlink { time }) => {
                let inode = engine
                    .inode(*id)
                    .ok_or_else(|| format!("inode {id:#x} gone while locked"))?;
                // As a local unlink: an open file keeps its inode (and data) until its
                // last close here.
                if inode.nlink <= 1 && engine.open_count(*id) == 0 {
                    out.push(Mutation::DropInode { id: *id });
                    if inode.is_regular() && inode.may_have_data {
                        out.push(Mutation::PutReclaim {
                            id: *id,
                            generation: inode.btime as u64,
                            from: 0,
                        });
                    }
                    continue;
                }
                touched(*id, &|i| {
                    i.nlink = i.nlink.saturating_sub(1);
                    i.ctime = time;
                })?
            }
            (key, change) => return Err(format!("change {change:?} does not fit {key:?}")),
        });
    }
    Ok(out)
}

/// The keys a non-transactional operation reads or writes, as far as a transaction may
/// hold them: every inode it names by id, every entry it names, and the inode each of
/// those entries names here (an rmdir of a directory a transaction adds an entry to, an
/// unlink of another name of an inode it links). An operation on a locked key waits
/// (see `txn_host::blocks`).
///
/// The directory an operation adds a name to or drops one from is not among them: what
/// such an operation changes in it (its times, its link count) commutes with a
/// transaction's [`Change::Dir`], which re-reads the directory when it is applied and
/// only moves its times forward. What that change checked at prepare time (the
/// directory's mode and owner, that it lives) is guarded still: a setattr, an rmdir or a
/// rename of the directory names it (by id, or as the inode of its entry).
pub fn op_keys(engine: &Engine, op: &Op) -> Vec<Key> {
    let named: [Option<InodeId>; 2] = match op {
        Op::Lookup { .. }
        | Op::Mknod { .. }
        | Op::Mkdir { .. }
        | Op::Symlink { .. }
        | Op::Unlink { .. }
        | Op::Rmdir { .. }
        | Op::Create { .. }
        | Op::Rename { .. } => [None, None],
        Op::Link { id, .. } => [Some(*id), None],
        _ => op.inode_ids(),
    };
    let mut keys: Vec<Key> = named.into_iter().flatten().map(Key::Inode).collect();
    let mut entry = |parent: InodeId, name: &[u8]| {
        keys.push(Key::Entry {
            parent,
            name: name.to_vec(),
        });
        if let Some(child) = engine.child(parent, name) {
            keys.push(Key::Inode(child));
        }
    };
    match op {
        Op::Lookup { parent, name }
        | Op::Mknod { parent, name, .. }
        | Op::Mkdir { parent, name, .. }
        | Op::Symlink { parent, name, .. }
        | Op::Unlink { parent, name }
        | Op::Rmdir { parent, name }
        | Op::Create { parent, name, .. } => entry(*parent, name),
        Op::Link {
            new_parent,
            new_name,
            ..
        } => entry(*new_parent, new_name),
        Op::Rename {
            parent,
            name,
            new_parent,
            new_name,
            ..
        } => {
            entry(*parent, name);
            entry(*new_parent, new_name);
        }
        _ => {}
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_meta::EngineConfig;
    use kochab_proto::{Reply, mode};

    fn engine() -> Engine {
        let mut e = Engine::new_cluster(EngineConfig::with_key([3, 4])).expect("engine");
        for m in e.bootstrap(1) {
            e.apply(&m).expect("bootstrap");
        }
        e
    }

    fn made(e: &mut Engine, op: Op) -> InodeId {
        let mut muts = Vec::new();
        match e.execute(&Credentials::root(), &op, 2, &mut muts) {
            Reply::Entry(a) => a.id,
            other => panic!("{op:?}: {other:?}"),
        }
    }

    fn mkdir(e: &mut Engine, parent: InodeId, name: &[u8]) -> InodeId {
        let op = Op::Mkdir {
            parent,
            name: name.to_vec(),
            mode: 0o755,
        };
        made(e, op)
    }

    fn file(e: &mut Engine, parent: InodeId, name: &[u8]) -> InodeId {
        let op = Op::Mknod {
            parent,
            name: name.to_vec(),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        };
        made(e, op)
    }

    fn rename(parent: InodeId, name: &[u8], new_parent: InodeId, new_name: &[u8]) -> Op {
        Op::Rename {
            parent,
            name: name.to_vec(),
            new_parent,
            new_name: new_name.to_vec(),
            flags: 0,
        }
    }

    /// Two top-level directories in different tables, the first's table on server 2 and
    /// every other table on server 3 (one engine hosts them all here).
    fn two_servers() -> (
        Engine,
        InodeId,
        InodeId,
        impl Fn(InodeId) -> Option<ServerId>,
    ) {
        let mut e = engine();
        let root = e.root();
        let a = mkdir(&mut e, root, b"a");
        let b = mkdir(&mut e, root, b"b");
        let ta = e.table_index(a).expect("table of a");
        assert_ne!(Some(ta), e.table_index(b), "a and b share a table");
        let tables: Vec<(InodeId, InodeId)> = e.tables().iter().map(|t| (t.lo, t.hi)).collect();
        let (lo, hi) = tables[ta];
        let owner = move |id: InodeId| Some(ServerId(if lo <= id && id < hi { 2 } else { 3 }));
        (e, a, b, owner)
    }

    #[test]
    fn a_rename_across_servers_is_planned_checked_and_applied_per_part() {
        let (mut e, a, b, owner) = two_servers();
        let f = file(&mut e, a, b"f");
        let plan = plan_op(
            &e,
            &Credentials::root(),
            &rename(a, b"f", b, b"g"),
            7,
            &owner,
        )
        .expect("plan");
        assert!(kochab_cluster::txn::plan_ok(&plan));
        assert_eq!(plan.len(), 2, "{plan:?}");
        for (_, part) in &plan {
            check_part(&e, part).expect("check");
        }
        let muts: Vec<Mutation> = plan
            .iter()
            .flat_map(|(_, p)| apply_part(&e, &p.mutations).expect("apply"))
            .collect();
        for m in &muts {
            e.apply(m).expect("mutation");
        }
        assert_eq!(e.child(a, b"f"), None);
        assert_eq!(e.child(b, b"g"), Some(f));
        assert_eq!(e.inode(b).map(|i| i.mtime), Some(7));
        assert_eq!(e.inode(f).map(|i| i.ctime), Some(7));
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
    }

    #[test]
    fn a_link_from_another_server_raises_nlink_where_the_inode_lives() {
        let (mut e, a, b, owner) = two_servers();
        let f = file(&mut e, a, b"f");
        let link = Op::Link {
            id: f,
            new_parent: b,
            new_name: b"l".to_vec(),
        };
        let plan = plan_op(&e, &Credentials::root(), &link, 9, &owner).expect("plan");
        assert_eq!(plan.len(), 2, "{plan:?}");
        for (_, part) in &plan {
            check_part(&e, part).expect("check");
        }
        let muts: Vec<Mutation> = plan
            .iter()
            .flat_map(|(_, p)| apply_part(&e, &p.mutations).expect("apply"))
            .collect();
        for m in &muts {
            e.apply(m).expect("mutation");
        }
        assert_eq!(e.child(b, b"l"), Some(f));
        assert_eq!(e.inode(f).map(|i| (i.nlink, i.ctime)), Some((2, 9)));
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
        // Another user may not link root's file (protected hard links).
        let user = Credentials {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        };
        let plan = plan_op(&e, &user, &link, 9, &owner).expect("plan");
        assert!(plan.iter().any(|(_, p)| check_part(&e, p).is_err()));
        let d = mkdir(&mut e, a, b"sub");
        let dir_link = Op::Link {
            id: d,
            new_parent: b,
            new_name: b"d".to_vec(),
        };
        assert!(plan_op(&e, &Credentials::root(), &dir_link, 9, &owner).is_err());
    }

    #[test]
    fn checks_refuse_what_changed_and_plans_refuse_what_they_do_not_cover() {
        let (mut e, a, b, owner) = two_servers();
        file(&mut e, a, b"f");
        file(&mut e, b, b"taken");
        let root = Credentials::root();
        let plan = plan_op(&e, &root, &rename(a, b"f", b, b"taken"), 7, &owner).expect("plan");
        let target = plan.iter().find(|(s, _)| *s == ServerId(3)).expect("part");
        assert!(check_part(&e, &target.1).is_err(), "the target exists");
        // Another user may not write the root-owned directories.
        let user = Credentials {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        };
        let plan = plan_op(&e, &user, &rename(a, b"f", b, b"g"), 7, &owner).expect("plan");
        assert!(plan.iter().any(|(_, p)| check_part(&e, p).is_err()));
        let d = mkdir(&mut e, a, b"sub");
        assert_ne!(d, 0);
        let no = |op: &Op| plan_op(&e, &root, op, 7, &owner).is_err();
        assert!(no(&rename(a, b"sub", b, b"sub")), "a directory moves");
        assert!(no(&rename(a, b"f", a, b"g")), "one directory");
        assert!(no(&rename(a, b"nothing", b, b"g")), "no source");
        assert!(no(&rename(a, b"f", b, b"..")), "dots");
        let mut flagged = rename(a, b"f", b, b"g");
        if let Op::Rename { flags, .. } = &mut flagged {
            *flags = 1;
        }
        assert!(no(&flagged), "flags");
        let garbage = Part {
            locks: vec![Key::Inode(a)],
            mutations: vec![TxnMutation {
                key: Key::Inode(a),
                expect: Expect::Any,
                write: Write::Put(vec![0xff, 0xff, 0xff]),
            }],
        };
        assert!(check_part(&e, &garbage).is_err(), "undecodable change");
        // An rmdir names the directory only by its entry: its inode is a key too.
        let rmdir = Op::Rmdir {
            parent: e.root(),
            name: b"b".to_vec(),
        };
        assert!(op_keys(&e, &rmdir).contains(&Key::Inode(b)));
    }

    /// Plans `op`, checks every part and applies them all to `e` (one engine hosts both
    /// servers' tables here).
    fn commit(e: &mut Engine, op: &Op, owner: &impl Fn(InodeId) -> Option<ServerId>) {
        let plan = plan_op(e, &Credentials::root(), op, 9, owner).expect("plan");
        assert!(kochab_cluster::txn::plan_ok(&plan));
        for (_, part) in &plan {
            check_part(e, part).expect("check");
        }
        let muts: Vec<Mutation> = plan
            .iter()
            .flat_map(|(_, p)| apply_part(e, &p.mutations).expect("apply"))
            .collect();
        for m in &muts {
            e.apply(m).expect("mutation");
        }
    }

    #[test]
    fn an_unlink_of_a_name_whose_inode_lives_elsewhere_drops_it_there() {
        let (mut e, a, b, owner) = two_servers();
        let f = file(&mut e, a, b"f");
        commit(&mut e, &rename(a, b"f", b, b"g"), &owner);
        // A second name, then the unlink of the one in b: the inode (on a's server) loses
        // a link and stays.
        let link = Op::Link {
            id: f,
            new_parent: b,
            new_name: b"h".to_vec(),
        };
        commit(&mut e, &link, &owner);
        assert_eq!(e.inode(f).map(|i| i.nlink), Some(2));
        let unlink = |name: &[u8]| Op::Unlink {
            parent: b,
            name: name.to_vec(),
        };
        let plan = plan_op(&e, &Credentials::root(), &unlink(b"g"), 9, &owner).expect("plan");
        assert_eq!(
            plan.len(),
            2,
            "the entry's server and the inode's: {plan:?}"
        );
        commit(&mut e, &unlink(b"g"), &owner);
        assert_eq!(e.child(b, b"g"), None);
        assert_eq!(e.inode(f).map(|i| i.nlink), Some(1));
        // The last name: the inode goes.
        commit(&mut e, &unlink(b"h"), &owner);
        assert_eq!(e.inode(f).map(|i| i.nlink), None);
        assert!(
            e.check_invariants().is_empty(),
            "{:?}",
            e.check_invariants()
        );
        // A name whose inode is here, or a directory: no transaction.
        file(&mut e, b, b"local");
        assert!(plan_op(&e, &Credentials::root(), &unlink(b"local"), 9, &owner).is_err());
    }

    #[test]
    fn names_added_meanwhile_do_not_wait_and_the_times_only_move_forward() {
        let (mut e, a, b, owner) = two_servers();
        file(&mut e, a, b"f");
        let root = Credentials::root();
        // A create or an unlink of another name in a directory a transaction holds does
        // not name the directory; a setattr of it, or its rmdir, does.
        let create = Op::Create {
            parent: b,
            name: b"other".to_vec(),
            mode: 0o644,
            flags: 0,
            handle: 0,
        };
        assert!(!op_keys(&e, &create).contains(&Key::Inode(b)));
        let unlink = Op::Unlink {
            parent: a,
            name: b"x".to_vec(),
        };
        assert!(!op_keys(&e, &unlink).contains(&Key::Inode(a)));
        // (A getattr names it by id, as a setattr does.)
        assert!(op_keys(&e, &Op::GetAttr { id: b }).contains(&Key::Inode(b)));
        // The plan's time is 7; a create stamped the target directory later (and raised
        // its link count) before the commit is applied: both stay.
        let plan = plan_op(&e, &root, &rename(a, b"f", b, b"g"), 7, &owner).expect("plan");
        let later = Op::Mkdir {
            parent: b,
            name: b"later".to_vec(),
            mode: 0o755,
        };
        let mut muts = Vec::new();
        let made = e.execute(&root, &later, 100, &mut muts);
        assert!(matches!(made, kochab_proto::Reply::Entry(_)), "{made:?}");
        let (mtime, nlink) = e.inode(b).map(|i| (i.mtime, i.nlink)).expect("b");
        assert!(mtime > 7);
        let muts: Vec<Mutation> = plan
            .iter()
            .flat_map(|(_, p)| apply_part(&e, &p.mutations).expect("apply"))
            .collect();
        for m in &muts {
            e.apply(m).expect("mutation");
        }
        assert_eq!(e.inode(b).map(|i| (i.mtime, i.nlink)), Some((mtime, nlink)));
        assert!(e.check_invariants().is_empty());
    }
}
