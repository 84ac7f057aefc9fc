//! POSIX conformance of the metadata engine: every operation against what Linux ext4 and the
//! Linux VFS do. Each expectation that is not plain POSIX was checked on a real ext4 file
//! system (kernel 6.18, protected_hardlinks=1) as root and as unprivileged users.
//!
//! The harness (`posix/support.rs`) checks on every call that a failed or read-only
//! operation emits no mutation and leaves the engine exactly as it was, so "nothing changes
//! on a failed operation" is tested by every error assertion below.

#[path = "posix/model.rs"]
mod model;
#[path = "posix/support.rs"]
mod support;

use kochab_meta::{EngineConfig, IdPolicyConfig, Region};
use kochab_proto::access::{F_OK, R_OK, W_OK, X_OK};
use kochab_proto::mode::*;
use kochab_proto::rename_flags::{RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT};
use kochab_proto::xattr_flags::{XATTR_CREATE, XATTR_REPLACE};
use kochab_proto::{
    Errno as E, FILE_BYTES_MAX, FileKind, InodeId, LINK_MAX, NAME_MAX, Op, Reply, SYMLINK_MAX,
    SetAttrs, TimeSet, XATTR_SIZE_MAX,
};
use support::*;

const FILE: u32 = S_IFREG;

// ------------------------------------------------------------------------------------------
// lookup
// ------------------------------------------------------------------------------------------

#[test]
fn lookup_resolves_names_dot_and_dotdot() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let f = fs.file(d, "f");
    assert_eq!(fs.lookup(r, ".").unwrap().id, r);
    assert_eq!(
        fs.lookup(r, "..").unwrap().id,
        r,
        "the root is its own parent"
    );
    assert_eq!(fs.lookup(d, ".").unwrap().id, d);
    assert_eq!(fs.lookup(d, "..").unwrap().id, r);
    let a = fs.lookup(d, "f").unwrap();
    assert_eq!(a, fs.attr(f), "lookup returns the inode's attributes");
    assert_eq!(a.kind(), Some(FileKind::File));
    assert_eq!(fs.lookup(d, "..").unwrap(), fs.attr(r));
    fs.check();
}

#[test]
fn lookup_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let f = fs.file(d, "f");
    assert_eq!(fs.lookup(d, "nope"), Err(E::ENOENT));
    for name in ["x", ".", ".."] {
        assert_eq!(fs.lookup(f, name), Err(E::ENOTDIR), "{name} in a file");
    }
    assert_eq!(
        fs.lookup(r + 12345, "x"),
        Err(E::ENOENT),
        "parent id that names nothing"
    );

    // Search (x) permission on the directory is needed for every name, "." and ".." too,
    // and is checked before the entry is looked for.
    let alice = usr(ALICE);
    fs.chmod_as(&root(), d, 0o744).unwrap();
    for name in ["f", ".", "..", "nope"] {
        assert_eq!(
            fs.lookup_as(&alice, d, name),
            Err(E::EACCES),
            "{name} without x"
        );
    }
    fs.chmod_as(&root(), d, 0o711).unwrap();
    assert_eq!(
        fs.lookup_as(&alice, d, "f").unwrap().id,
        f,
        "x alone suffices"
    );
    assert_eq!(fs.lookup_as(&alice, d, "nope"), Err(E::ENOENT));

    // The class is chosen first: the owner gets the owner bits only, even when the group
    // bits would allow more.
    fs.own(d, ALICE, STAFF, 0o070);
    assert_eq!(
        fs.lookup_as(&usr_g(ALICE, ALICE, &[STAFF]), d, "f"),
        Err(E::EACCES)
    );
    assert_eq!(
        fs.lookup_as(&usr_g(BOB, BOB, &[STAFF]), d, "f").unwrap().id,
        f,
        "group member"
    );
    assert_eq!(fs.lookup_as(&usr(BOB), d, "f"), Err(E::EACCES), "other");
    fs.chmod_as(&root(), d, 0o000).unwrap();
    assert_eq!(
        fs.lookup(d, "f").unwrap().id,
        f,
        "root searches any directory"
    );
    fs.check();
}

// ------------------------------------------------------------------------------------------
// getattr
// ------------------------------------------------------------------------------------------

#[test]
fn new_inodes_carry_the_creator_and_the_current_time() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.chmod_as(&root(), r, 0o777).unwrap();
    let alice = usr_g(ALICE, ALICE, &[STAFF]);
    let a = fs.create_as(&alice, r, "f", 0o640).unwrap();
    let t = fs.now;
    assert_eq!(a.mode, FILE | 0o640);
    assert_eq!(
        (a.uid, a.gid),
        (ALICE, ALICE),
        "primary group, not a supplementary one"
    );
    assert_eq!((a.nlink, a.size, a.blocks, a.rdev), (1, 0, 0, 0));
    assert_eq!((a.atime, a.mtime, a.ctime, a.btime), (t, t, t, t));
    assert_eq!(a.blksize, 4096);
    assert_eq!(fs.attr(a.id), a, "getattr agrees with the create reply");

    let d = fs.mkdir_as(&alice, r, "d", 0o750).unwrap();
    let t = fs.now;
    assert_eq!(d.mode, S_IFDIR | 0o750);
    assert_eq!(d.nlink, 2);
    assert_eq!(d.size, 4096, "an ext4 directory block");
    assert_eq!((d.atime, d.mtime, d.ctime), (t, t, t));

    let root_attr = fs.attr(r);
    assert_eq!(root_attr.mode, S_IFDIR | 0o777);
    assert_eq!((root_attr.uid, root_attr.gid, root_attr.nlink), (0, 0, 3));
    assert_eq!(root_attr.btime, T0);
    fs.check();
}

#[test]
fn getattr_of_ids_that_name_nothing() {
    let mut fs = Fs::new();
    let r = fs.root();
    for id in [
        0,
        1,
        2,
        r + 1,
        r + (1 << 54),
        Region::TooDeep.base() + 5,
        Region::TooWide.base() + 5,
    ] {
        assert_eq!(fs.getattr(id), Err(E::ENOENT), "{id:#x}");
    }
}

// ------------------------------------------------------------------------------------------
// setattr: chmod
// ------------------------------------------------------------------------------------------

#[test]
fn chmod_only_by_the_owner_or_root() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.own(f, ALICE, ALICE, 0o644);
    assert_eq!(fs.chmod_as(&usr(BOB), f, 0o777), Err(E::EPERM));
    assert_eq!(
        fs.chmod_as(&usr_g(BOB, ALICE, &[]), f, 0o777),
        Err(E::EPERM),
        "group membership is not ownership"
    );
    assert_eq!(
        fs.chmod_as(&usr(ALICE), f, 0o600).unwrap().mode,
        FILE | 0o600
    );
    assert_eq!(
        fs.chmod_as(&usr(ALICE), f, S_IFDIR | 0o644).unwrap().mode,
        FILE | 0o644,
        "the type cannot change"
    );
    assert_eq!(fs.chmod_as(&root(), f, 0o7777).unwrap().mode, FILE | 0o7777);
    let d = fs.dir(r, "d");
    fs.own(d, ALICE, ALICE, 0o755);
    assert_eq!(
        fs.chmod_as(&usr(ALICE), d, 0o1777).unwrap().mode,
        S_IFDIR | 0o1777
    );
    assert_eq!(fs.chmod_as(&usr(BOB), d, 0o777), Err(E::EPERM));
    fs.check();
}

#[test]
fn chmod_by_a_non_member_clears_setgid() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let d = fs.dir(r, "d");
    fs.own(f, ALICE, STAFF, 0o644);
    fs.own(d, ALICE, STAFF, 0o755);
    let alice = usr(ALICE);
    assert_eq!(fs.chmod_as(&alice, f, 0o2755).unwrap().mode, FILE | 0o755);
    assert_eq!(
        fs.chmod_as(&alice, d, 0o2755).unwrap().mode,
        S_IFDIR | 0o755,
        "directories too"
    );
    assert_eq!(
        fs.chmod_as(&alice, f, 0o4755).unwrap().mode,
        FILE | 0o4755,
        "setuid stays"
    );
    let member = usr_g(ALICE, ALICE, &[STAFF]);
    assert_eq!(fs.chmod_as(&member, f, 0o2755).unwrap().mode, FILE | 0o2755);
    assert_eq!(
        fs.chmod_as(&root(), d, 0o2755).unwrap().mode,
        S_IFDIR | 0o2755
    );
    // The group the bit is checked against is the new one when the request changes both.
    let both = SetAttrs {
        gid: Some(ALICE),
        mode: Some(0o2755),
        ..Default::default()
    };
    assert_eq!(fs.setattr_as(&alice, f, both).unwrap().mode, FILE | 0o2755);
    fs.check();
}

#[test]
fn chmod_of_a_symlink_is_not_supported() {
    // Linux 6.6+ refuses mode changes of symlinks in notify_change (fchmodat2 with
    // AT_SYMLINK_NOFOLLOW gives EOPNOTSUPP), before the ownership check.
    let mut fs = Fs::new();
    let r = fs.root();
    let l = fs.symlink_as(&root(), r, "l", "target").unwrap().id;
    assert_eq!(fs.chmod_as(&root(), l, 0o700), Err(E::EOPNOTSUPP));
    assert_eq!(fs.chmod_as(&usr(ALICE), l, 0o700), Err(E::EOPNOTSUPP));
    assert_eq!(
        fs.chown_as(&root(), l, Some(ALICE), Some(ALICE))
            .unwrap()
            .mode,
        S_IFLNK | 0o777,
        "chown works"
    );
    fs.check();
}

// ------------------------------------------------------------------------------------------
// setattr: chown
// ------------------------------------------------------------------------------------------

#[test]
fn chown_and_chgrp_permissions() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.own(f, ALICE, ALICE, 0o644);
    let alice = usr(ALICE);
    assert_eq!(
        fs.chown_as(&alice, f, Some(BOB), None),
        Err(E::EPERM),
        "only root gives files away"
    );
    assert_eq!(
        fs.chown_as(&alice, f, Some(ALICE), None).unwrap().uid,
        ALICE,
        "to oneself is allowed"
    );
    assert_eq!(
        fs.chown_as(&usr(BOB), f, Some(ALICE), None),
        Err(E::EPERM),
        "non-owner, even to the same uid"
    );
    assert_eq!(
        fs.chown_as(&alice, f, None, Some(STAFF)),
        Err(E::EPERM),
        "not a member of the new group"
    );
    assert_eq!(
        fs.chown_as(&usr_g(BOB, BOB, &[ALICE]), f, None, Some(ALICE)),
        Err(E::EPERM),
        "member but not owner"
    );
    assert_eq!(
        fs.chown_as(&usr_g(ALICE, ALICE, &[STAFF]), f, None, Some(STAFF))
            .unwrap()
            .gid,
        STAFF,
        "supplementary group"
    );
    assert_eq!(
        fs.chown_as(&alice, f, None, Some(STAFF)).unwrap().gid,
        STAFF,
        "to the current group, member or not"
    );
    assert_eq!(
        fs.chown_as(&alice, f, None, Some(ALICE)).unwrap().gid,
        ALICE,
        "primary group"
    );
    let a = fs.chown_as(&root(), f, Some(BOB), Some(STAFF)).unwrap();
    assert_eq!((a.uid, a.gid), (BOB, STAFF));
    assert_eq!(
        fs.chown_as(&alice, f, None, Some(ALICE)),
        Err(E::EPERM),
        "alice no longer owns it"
    );
    fs.check();
}

#[test]
fn chown_clears_setuid_and_setgid_like_linux() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let (alice, member) = (usr(ALICE), usr_g(ALICE, ALICE, &[STAFF]));
    // Root's chown: setuid goes; setgid only when group-executable.
    fs.own(f, ALICE, STAFF, 0o6644);
    assert_eq!(
        fs.chown_as(&root(), f, Some(BOB), None).unwrap().mode,
        FILE | 0o2644
    );
    fs.own(f, ALICE, STAFF, 0o6654);
    assert_eq!(
        fs.chown_as(&root(), f, Some(BOB), None).unwrap().mode,
        FILE | 0o654
    );
    fs.own(f, ALICE, STAFF, 0o2644);
    assert_eq!(
        fs.chown_as(&root(), f, None, Some(BOB)).unwrap().mode,
        FILE | 0o2644
    );
    // The owner's chown clears them even when the ids stay the same.
    fs.own(f, ALICE, ALICE, 0o6654);
    let a = fs.chown_as(&alice, f, Some(ALICE), Some(ALICE)).unwrap();
    assert_eq!(a.mode, FILE | 0o654);
    // A setgid bit without group x goes when the caller is not in the file's (old) group.
    fs.own(f, ALICE, STAFF, 0o2644);
    assert_eq!(
        fs.chown_as(&alice, f, None, Some(ALICE)).unwrap().mode,
        FILE | 0o644
    );
    fs.own(f, ALICE, STAFF, 0o2644);
    assert_eq!(
        fs.chown_as(&member, f, None, Some(ALICE)).unwrap().mode,
        FILE | 0o2644
    );
    // Directories keep their bits.
    let d = fs.dir(r, "d");
    fs.own(d, ALICE, STAFF, 0o6755);
    let a = fs.chown_as(&root(), d, Some(BOB), Some(BOB)).unwrap();
    assert_eq!(a.mode, S_IFDIR | 0o6755);
    fs.check();
}

// ------------------------------------------------------------------------------------------
// setattr: size
// ------------------------------------------------------------------------------------------

#[test]
fn truncate_needs_write_permission() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    assert_eq!(fs.truncate_as(&usr(ALICE), f, 1), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o646).unwrap();
    assert_eq!(fs.truncate_as(&usr(ALICE), f, 1).unwrap().size, 1);
    fs.own(f, ALICE, ALICE, 0o444);
    assert_eq!(
        fs.truncate_as(&usr(ALICE), f, 2),
        Err(E::EACCES),
        "the owner needs w too"
    );
    assert_eq!(
        fs.truncate_as(&root(), f, 3).unwrap().size,
        3,
        "root does not"
    );
    fs.check();
}

#[test]
fn truncate_of_non_regular_files() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let p = fs
        .mknod_as(&root(), r, "p", S_IFIFO | 0o666, 0, true)
        .unwrap()
        .id;
    let l = fs.symlink_as(&root(), r, "l", "p").unwrap().id;
    let f = fs.file(r, "f");
    assert_eq!(fs.truncate_as(&root(), d, 0), Err(E::EISDIR));
    assert_eq!(fs.truncate_as(&root(), p, 0), Err(E::EINVAL));
    assert_eq!(fs.truncate_as(&root(), l, 0), Err(E::EINVAL));
    assert_eq!(fs.truncate_as(&root(), f, u64::MAX), Err(E::EFBIG));
    assert_eq!(
        fs.truncate_as(&root(), f, FILE_BYTES_MAX + 1),
        Err(E::EFBIG),
        "one byte past the largest file"
    );
    assert_eq!(
        fs.truncate_as(&root(), f, FILE_BYTES_MAX).unwrap().size,
        FILE_BYTES_MAX
    );
    assert_eq!(fs.truncate_as(&root(), f, 1 << 40).unwrap().size, 1 << 40);
}

#[test]
fn data_reclaim_entries_follow_the_may_have_data_mark() {
    let mut fs = Fs::new();
    let r = fs.root();
    // A file that never had data leaves nothing to reclaim.
    let empty = fs.file(r, "empty");
    fs.truncate_as(&root(), empty, 100).unwrap();
    fs.truncate_as(&root(), empty, 0).unwrap();
    fs.unlink(r, "empty").unwrap();
    assert_eq!(fs.e.pending_reclaim_count(), 0);
    // The mark is journaled once, before the first chunk.
    let f = fs.file(r, "f");
    let marked = fs.e.mark_data(f).unwrap();
    assert_eq!(marked.len(), 1);
    fs.log.extend(marked);
    assert!(fs.e.mark_data(f).unwrap().is_empty(), "once per file");
    let generation = fs.attr(f).generation;
    fs.truncate_as(&root(), f, 1 << 50).unwrap();
    assert_eq!(
        fs.e.reclaim_of(f, generation),
        None,
        "growing trims nothing"
    );
    fs.truncate_as(&root(), f, 10).unwrap();
    let trim = fs.e.reclaim_of(f, generation).expect("a trim");
    assert_eq!(trim.from, 10);
    // A lower cut widens the entry; finishing an outdated entry keeps the wider one.
    fs.truncate_as(&root(), f, 5).unwrap();
    assert!(fs.e.finish_reclaim(&trim).is_empty());
    let wider = fs.e.reclaim_of(f, generation).unwrap();
    assert_eq!(wider.from, 5);
    let done = fs.e.finish_reclaim(&wider);
    assert_eq!(done.len(), 1);
    fs.log.extend(done);
    // Truncating to zero always trims (preallocated space, a failed fsync's record).
    fs.truncate_as(&root(), f, 0).unwrap();
    fs.truncate_as(&root(), f, 0).unwrap();
    assert_eq!(fs.e.reclaim_of(f, generation).map(|e| e.from), Some(0));
    fs.unlink(r, "f").unwrap();
    assert_eq!(fs.e.reclaim_of(f, generation).map(|e| e.from), Some(0));
    fs.check();
}

#[test]
fn pending_reclaims_are_visited_in_turn_from_a_cursor() {
    let mut fs = Fs::new();
    fs.check_unchanged = false;
    let r = fs.root();
    let mut files = Vec::new();
    for i in 0..5 {
        let f = fs.file(r, format!("f{i}"));
        let marked = fs.e.mark_data(f).unwrap();
        fs.log.extend(marked);
        files.push((f, fs.attr(f).generation));
        fs.unlink(r, format!("f{i}")).unwrap();
    }
    files.sort();
    let keys = |v: Vec<kochab_meta::Reclaim>| -> Vec<(InodeId, u64)> {
        v.iter().map(|e| (e.id, e.generation)).collect()
    };
    assert_eq!(fs.e.pending_reclaim_count(), 5);
    assert_eq!(keys(fs.e.pending_reclaims((0, 0), 2)), files[..2]);
    assert_eq!(keys(fs.e.pending_reclaims(files[1], 2)), files[2..4]);
    // Past the last entry the visit wraps around to the first ones.
    assert_eq!(
        keys(fs.e.pending_reclaims(files[3], 3)),
        vec![files[4], files[0], files[1]]
    );
    assert_eq!(keys(fs.e.pending_reclaims(files[4], 10)), files);
}

#[test]
fn truncate_sets_mtime_and_ctime_even_to_the_same_size() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let before = fs.attr(f);
    let a = fs.truncate_as(&root(), f, 10).unwrap();
    assert_eq!((a.size, a.blocks), (10, 8));
    assert_eq!((a.mtime, a.ctime, a.atime), (fs.now, fs.now, before.atime));
    let a = fs.truncate_as(&root(), f, 10).unwrap();
    assert_eq!(
        (a.mtime, a.ctime),
        (fs.now, fs.now),
        "ext4 updates both even when the size stays"
    );
    assert_eq!(fs.attr(r).mtime, before.ctime, "the directory is untouched");
    fs.check();
}

#[test]
fn truncate_by_non_root_clears_setuid_and_setgid() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let bob = usr(BOB);
    fs.own(f, ALICE, ALICE, 0o6755);
    assert_eq!(
        fs.truncate_as(&root(), f, 1).unwrap().mode,
        FILE | 0o6755,
        "root keeps all"
    );
    fs.own(f, ALICE, ALICE, 0o6777);
    assert_eq!(
        fs.truncate_as(&bob, f, 1).unwrap().mode,
        FILE | 0o777,
        "group x"
    );
    fs.own(f, ALICE, ALICE, 0o4666);
    assert_eq!(
        fs.truncate_as(&bob, f, 1).unwrap().mode,
        FILE | 0o666,
        "setuid"
    );
    fs.own(f, ALICE, ALICE, 0o2667);
    assert_eq!(
        fs.truncate_as(&bob, f, 1).unwrap().mode,
        FILE | 0o667,
        "not in the group"
    );
    fs.own(f, ALICE, ALICE, 0o2667);
    let member = usr_g(BOB, BOB, &[ALICE]);
    assert_eq!(
        fs.truncate_as(&member, f, 1).unwrap().mode,
        FILE | 0o2667,
        "in the group"
    );
    fs.check();
}

// ------------------------------------------------------------------------------------------
// setattr: times
// ------------------------------------------------------------------------------------------

#[test]
fn explicit_times_need_the_owner() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.own(f, ALICE, ALICE, 0o666);
    let bob = usr(BOB);
    assert_eq!(
        fs.utimes_as(&bob, f, Some(TimeSet::At(5)), Some(TimeSet::At(6))),
        Err(E::EPERM),
        "write permission is not enough"
    );
    assert_eq!(
        fs.utimes_as(&bob, f, None, Some(TimeSet::At(6))),
        Err(E::EPERM)
    );
    let a = fs
        .utimes_as(
            &usr(ALICE),
            f,
            Some(TimeSet::At(5)),
            Some(TimeSet::At(-7_000_000_123)),
        )
        .unwrap();
    assert_eq!(
        (a.atime, a.mtime, a.ctime),
        (5, -7_000_000_123, fs.now),
        "exact values, before 1970 too"
    );
    let a = fs
        .utimes_as(&root(), f, Some(TimeSet::At(9)), None)
        .unwrap();
    assert_eq!(
        (a.atime, a.mtime, a.ctime),
        (9, -7_000_000_123, fs.now),
        "atime alone"
    );
    let a = fs
        .utimes_as(&root(), f, None, Some(TimeSet::At(10)))
        .unwrap();
    assert_eq!((a.atime, a.mtime), (9, 10), "mtime alone");
    fs.check();
}

#[test]
fn touching_with_now_needs_the_owner_or_write_permission() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.own(f, ALICE, ALICE, 0o666);
    let bob = usr(BOB);
    let now = Some(TimeSet::Now);
    let a = fs.utimes_as(&bob, f, now, now).unwrap();
    assert_eq!((a.atime, a.mtime, a.ctime), (fs.now, fs.now, fs.now));
    // Only "both now" is a touch (utimensat turns it into times == NULL); one time alone,
    // even "now", is an explicit time change that needs the owner.
    assert_eq!(fs.utimes_as(&bob, f, now, None), Err(E::EPERM));
    assert_eq!(fs.utimes_as(&bob, f, None, now), Err(E::EPERM));
    assert_eq!(
        fs.utimes_as(&bob, f, now, Some(TimeSet::At(1))),
        Err(E::EPERM)
    );
    fs.chmod_as(&root(), f, 0o644).unwrap();
    assert_eq!(
        fs.utimes_as(&bob, f, now, now),
        Err(E::EACCES),
        "no write permission"
    );
    fs.chmod_as(&root(), f, 0o444).unwrap();
    let before = fs.attr(f);
    let a = fs.utimes_as(&usr(ALICE), f, now, now).unwrap();
    assert_eq!(a.mtime, fs.now, "the owner needs no write permission");
    let a = fs.utimes_as(&usr(ALICE), f, now, None).unwrap();
    assert_eq!((a.atime, a.mtime, a.ctime), (fs.now, fs.now - STEP, fs.now));
    assert!(before.mtime < a.mtime);
    fs.check();
}

#[test]
fn every_setattr_updates_ctime_only() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let b = fs.attr(f);
    let a = fs.chmod_as(&root(), f, 0o644).unwrap();
    assert_eq!(
        (a.ctime, a.mtime, a.atime, a.mode),
        (fs.now, b.mtime, b.atime, b.mode),
        "chmod to the same mode"
    );
    let a = fs.chown_as(&root(), f, Some(0), Some(0)).unwrap();
    assert_eq!(
        (a.ctime, a.mtime, a.atime),
        (fs.now, b.mtime, b.atime),
        "chown to the same ids"
    );
    assert_eq!(fs.attr(r).ctime, b.ctime, "the parent is untouched");
    fs.check();
}

#[test]
fn an_explicit_ctime_is_refused_for_everyone() {
    // The old engine let the owner (and root) set any change time, which no Linux call can.
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.chown_as(&root(), f, Some(ALICE), None).unwrap();
    let b = fs.attr(f);
    for cred in [root(), usr(ALICE)] {
        let set = SetAttrs {
            ctime: Some(12345),
            ..Default::default()
        };
        assert_eq!(fs.setattr_as(&cred, f, set), Err(E::EPERM));
    }
    let set = SetAttrs {
        mode: Some(0o600),
        ctime: Some(12345),
        ..Default::default()
    };
    assert_eq!(
        fs.setattr_as(&root(), f, set),
        Err(E::EPERM),
        "nothing else changes either"
    );
    assert_eq!(fs.attr(f), b);
    fs.check();
}

#[test]
fn ids_outside_every_table_are_stale_not_a_redirection() {
    // The old engine answered WRONG_SERVER, which sends a client to look for another server
    // that does not exist: with every table of the cluster hosted here, such an id is no file.
    let mut fs = Fs::new();
    let r = fs.root();
    let nowhere = u64::MAX;
    assert_eq!(fs.getattr(nowhere), Err(E::ESTALE));
    assert_eq!(
        fs.setattr_as(&root(), nowhere, SetAttrs::default()),
        Err(E::ESTALE)
    );
    assert_eq!(
        fs.getattr(r + 12345),
        Err(E::ENOENT),
        "a hosted id that is free"
    );
    fs.check();
}

#[test]
fn setattr_of_a_missing_inode() {
    let mut fs = Fs::new();
    let r = fs.root();
    assert_eq!(fs.chmod_as(&root(), r + 1, 0o644), Err(E::ENOENT));
    assert_eq!(fs.truncate_as(&root(), r + 1, 0), Err(E::ENOENT));
}

// ------------------------------------------------------------------------------------------
// mknod and create
// ------------------------------------------------------------------------------------------

#[test]
fn mknod_creates_files_fifos_and_sockets() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.chmod_as(&root(), r, 0o777).unwrap();
    let alice = usr(ALICE);
    let cases = [
        ("reg", FILE | 0o640, FileKind::File, FILE | 0o640),
        ("zero-type", 0o640, FileKind::File, FILE | 0o640),
        ("fifo", S_IFIFO | 0o600, FileKind::Fifo, S_IFIFO | 0o600),
        ("sock", S_IFSOCK | 0o755, FileKind::Socket, S_IFSOCK | 0o755),
        ("setid", FILE | 0o6755, FileKind::File, FILE | 0o6755),
    ];
    for (name, mode, kind, expect) in cases {
        let a = fs.mknod_as(&alice, r, name, mode, 0x0103, true).unwrap();
        let t = fs.now;
        assert_eq!(
            (a.kind(), a.mode, a.rdev),
            (Some(kind), expect, 0),
            "{name}: rdev only for devices"
        );
        assert_eq!((a.uid, a.gid, a.nlink), (ALICE, ALICE, 1));
        assert_eq!((a.atime, a.mtime, a.ctime), (t, t, t));
        let p = fs.attr(r);
        assert_eq!(
            (p.mtime, p.ctime),
            (t, t),
            "{name}: the directory's mtime and ctime"
        );
        assert_eq!(fs.lookup(r, name).unwrap(), a);
    }
    fs.check();
}

#[test]
fn device_nodes_need_root() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.chmod_as(&root(), r, 0o777).unwrap();
    let c = fs
        .mknod_as(&root(), r, "null", S_IFCHR | 0o666, 0x0103, true)
        .unwrap();
    assert_eq!((c.kind(), c.rdev), (Some(FileKind::CharDev), 0x0103));
    let b = fs
        .mknod_as(&root(), r, "sda", S_IFBLK | 0o660, 0x0800, true)
        .unwrap();
    assert_eq!((b.kind(), b.rdev), (Some(FileKind::BlockDev), 0x0800));
    let alice = usr(ALICE);
    assert_eq!(
        fs.mknod_as(&alice, r, "c", S_IFCHR | 0o666, 1, true),
        Err(E::EPERM)
    );
    assert_eq!(
        fs.mknod_as(&alice, r, "b", S_IFBLK | 0o666, 1, true),
        Err(E::EPERM)
    );
    assert_eq!(
        fs.mknod_as(&alice, r, "null", S_IFCHR | 0o666, 1, true),
        Err(E::EEXIST),
        "EEXIST comes first"
    );
    let d = fs.dir(r, "d");
    assert_eq!(
        fs.mknod_as(&alice, d, "c", S_IFCHR | 0o666, 1, true),
        Err(E::EACCES),
        "then the directory's permission"
    );
    fs.check();
}

#[test]
fn mknod_rejects_directories_and_unknown_types() {
    let mut fs = Fs::new();
    let r = fs.root();
    // may_mknod runs before the path is even looked up.
    assert_eq!(
        fs.mknod_as(&root(), r, "d", S_IFDIR | 0o755, 0, true),
        Err(E::EPERM)
    );
    assert_eq!(
        fs.mknod_as(&root(), r + 99, "d", S_IFDIR | 0o755, 0, true),
        Err(E::EPERM)
    );
    assert_eq!(
        fs.mknod_as(&root(), r, "x", S_IFMT | 0o755, 0, true),
        Err(E::EINVAL)
    );
    assert_eq!(
        fs.mknod_as(&root(), r, "x", S_IFLNK | 0o755, 0, true),
        Err(E::EINVAL)
    );
    assert_eq!(
        fs.mknod_as(&root(), r, "x", 0o030000 | 0o755, 0, true),
        Err(E::EINVAL)
    );
    assert!(fs.names(r).is_empty());
}

#[test]
fn exclusive_and_non_exclusive_create() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.dir(r, "d");
    let p = fs
        .mknod_as(&root(), r, "p", S_IFIFO | 0o666, 0, true)
        .unwrap();
    for name in ["f", "d", "p", ".", ".."] {
        assert_eq!(
            fs.create_as(&root(), r, name, 0o644),
            Err(E::EEXIST),
            "O_EXCL {name}"
        );
        assert_eq!(
            fs.mknod_as(&root(), r, name, S_IFIFO | 0o644, 0, false),
            Err(E::EEXIST),
            "mknod {name}"
        );
    }
    // O_CREAT without O_EXCL opens what is there: no change, no new time.
    let before = fs.attr(r);
    let log = fs.log.len();
    let a = fs
        .mknod_as(&root(), r, "f", FILE | 0o600, 0, false)
        .unwrap();
    assert_eq!(a, fs.attr(f));
    assert_eq!(a.mode, FILE | 0o644, "the mode of the request is ignored");
    assert_eq!(
        fs.mknod_as(&root(), r, "p", FILE | 0o600, 0, false)
            .unwrap(),
        p,
        "a fifo is opened too"
    );
    assert_eq!(fs.log.len(), log, "opening emits nothing");
    assert_eq!(fs.attr(r), before);
    for name in ["d", ".", ".."] {
        assert_eq!(
            fs.mknod_as(&root(), r, name, FILE | 0o644, 0, false),
            Err(E::EISDIR),
            "O_CREAT {name}"
        );
    }
    let n = fs
        .mknod_as(&root(), r, "new", FILE | 0o600, 0, false)
        .unwrap();
    assert_eq!(n.mode, FILE | 0o600, "a missing name is created");

    // Opening needs search permission only; creating needs write permission too.
    let alice = usr(ALICE);
    assert_eq!(
        fs.mknod_as(&alice, r, "f", FILE | 0o644, 0, false)
            .unwrap()
            .id,
        f
    );
    assert_eq!(
        fs.mknod_as(&alice, r, "g", FILE | 0o644, 0, false),
        Err(E::EACCES)
    );
    assert_eq!(fs.create_as(&alice, r, "f", 0o644), Err(E::EEXIST));
    fs.chmod_as(&root(), r, 0o776).unwrap();
    assert_eq!(
        fs.mknod_as(&alice, r, "f", FILE | 0o644, 0, false),
        Err(E::EACCES),
        "no search permission"
    );
    fs.check();
}

#[test]
fn create_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    assert_eq!(fs.create_as(&root(), r + 77, "x", 0o644), Err(E::ENOENT));
    assert_eq!(fs.create_as(&root(), f, "x", 0o644), Err(E::ENOTDIR));
    let d = fs.dir(r, "d");
    let alice = usr(ALICE);
    assert_eq!(
        fs.create_as(&alice, d, "x", 0o644),
        Err(E::EACCES),
        "no write permission"
    );
    fs.chmod_as(&root(), d, 0o776).unwrap();
    assert_eq!(
        fs.create_as(&alice, d, "x", 0o644),
        Err(E::EACCES),
        "no search permission"
    );
    fs.chmod_as(&root(), d, 0o773).unwrap();
    assert_eq!(
        fs.create_as(&alice, d, "x", 0o644).unwrap().uid,
        ALICE,
        "w and x suffice"
    );
    fs.check();
}

#[test]
fn setgid_directories_pass_on_their_group() {
    let mut fs = Fs::new();
    let r = fs.root();
    let sg = fs.dir(r, "sg");
    fs.own(sg, 0, STAFF, 0o2777);
    let alice = usr(ALICE);
    let a = fs
        .mknod_as(&alice, sg, "a", FILE | 0o2755, 0, true)
        .unwrap();
    assert_eq!(
        (a.gid, a.mode),
        (STAFF, FILE | 0o755),
        "a non-member loses a group-executable setgid"
    );
    let b = fs
        .mknod_as(&alice, sg, "b", FILE | 0o2745, 0, true)
        .unwrap();
    assert_eq!(
        (b.gid, b.mode),
        (STAFF, FILE | 0o2745),
        "setgid without group x stays"
    );
    let d = fs.mkdir_as(&alice, sg, "d", 0o755).unwrap();
    assert_eq!(
        (d.gid, d.mode),
        (STAFF, S_IFDIR | 0o2755),
        "directories inherit the bit, member or not"
    );
    let d2 = fs.mkdir_as(&alice, d.id, "d2", 0o3777).unwrap();
    assert_eq!(
        (d2.gid, d2.mode),
        (STAFF, S_IFDIR | 0o3777),
        "and pass it on"
    );
    let l = fs.symlink_as(&alice, sg, "l", "a").unwrap();
    assert_eq!((l.gid, l.mode), (STAFF, S_IFLNK | 0o777));
    let c = fs
        .mknod_as(
            &usr_g(ALICE, ALICE, &[STAFF]),
            sg,
            "c",
            FILE | 0o2755,
            0,
            true,
        )
        .unwrap();
    assert_eq!(c.mode, FILE | 0o2755, "a member keeps it");
    let c2 = fs
        .mknod_as(&root(), sg, "c2", FILE | 0o2755, 0, true)
        .unwrap();
    assert_eq!((c2.gid, c2.mode), (STAFF, FILE | 0o2755), "root keeps it");
    // Without a setgid parent: the creator's group, and mkdir drops setuid/setgid.
    let plain = fs.mkdir_as(&root(), r, "plain", 0o7777).unwrap();
    assert_eq!((plain.gid, plain.mode), (0, S_IFDIR | 0o1777));
    fs.chmod_as(&root(), plain.id, 0o777).unwrap();
    let e = fs
        .mknod_as(
            &usr_g(ALICE, ALICE, &[STAFF]),
            plain.id,
            "e",
            FILE | 0o2755,
            0,
            true,
        )
        .unwrap();
    assert_eq!((e.gid, e.mode), (ALICE, FILE | 0o2755));
    fs.check();
}

// ------------------------------------------------------------------------------------------
// mkdir
// ------------------------------------------------------------------------------------------

#[test]
fn mkdir_counts_links_and_sets_times() {
    let mut fs = Fs::new();
    let r = fs.root();
    assert_eq!(fs.attr(r).nlink, 2);
    let a = fs.mkdir_as(&root(), r, "a", 0o700).unwrap();
    let t = fs.now;
    assert_eq!((a.nlink, a.mode), (2, S_IFDIR | 0o700));
    let p = fs.attr(r);
    assert_eq!((p.nlink, p.mtime, p.ctime), (3, t, t));
    assert_eq!(fs.lookup(a.id, "..").unwrap().id, r);
    let b = fs.dir(a.id, "b");
    assert_eq!(fs.attr(a.id).nlink, 3);
    assert_eq!(fs.attr(r).nlink, 3, "grandchildren do not count");
    assert_eq!(fs.attr(r).mtime, t, "nor touch the grandparent");
    fs.file(a.id, "f");
    assert_eq!(fs.attr(a.id).nlink, 3, "files do not count");
    assert_eq!(fs.lookup(b, "..").unwrap().id, a.id);
    fs.check();
}

#[test]
fn mkdir_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.dir(r, "d");
    for name in ["f", "d", ".", ".."] {
        assert_eq!(
            fs.mkdir_as(&root(), r, name, 0o755),
            Err(E::EEXIST),
            "{name}"
        );
        assert_eq!(
            fs.mkdir_as(&usr(ALICE), r, name, 0o755),
            Err(E::EEXIST),
            "{name}: EEXIST before EACCES"
        );
    }
    assert_eq!(fs.mkdir_as(&usr(ALICE), r, "x", 0o755), Err(E::EACCES));
    assert_eq!(fs.mkdir_as(&root(), f, "x", 0o755), Err(E::ENOTDIR));
    assert_eq!(fs.mkdir_as(&root(), r + 5, "x", 0o755), Err(E::ENOENT));
    assert_eq!(
        fs.mkdir_as(&root(), r + 5, ".", 0o755),
        Err(E::ENOENT),
        "the parent is looked up first"
    );
    fs.check();
}

// ------------------------------------------------------------------------------------------
// unlink
// ------------------------------------------------------------------------------------------

#[test]
fn unlink_drops_a_name_and_the_inode_with_its_last_name() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let f = fs.file(d, "f");
    fs.setxattr_as(&root(), f, "user.a", "1", 0).unwrap();
    fs.link(f, r, "g").unwrap();
    let d_before = fs.attr(d);
    fs.unlink(r, "g").unwrap();
    let t = fs.now;
    let a = fs.attr(f);
    assert_eq!(
        (a.nlink, a.ctime),
        (1, t),
        "the inode loses a link and gets a new ctime"
    );
    let p = fs.attr(r);
    assert_eq!((p.mtime, p.ctime, p.nlink), (t, t, 3));
    assert_eq!(fs.attr(d), d_before, "the other directory is untouched");
    assert_eq!(fs.getxattr_as(&root(), f, "user.a").unwrap(), b"1");

    fs.unlink(d, "f").unwrap();
    let t = fs.now;
    assert_eq!(fs.getattr(f), Err(E::ENOENT), "gone with its last name");
    assert_eq!(fs.lookup(d, "f"), Err(E::ENOENT));
    assert_eq!(
        fs.getxattr_as(&root(), f, "user.a"),
        Err(E::ENOENT),
        "with its xattrs"
    );
    let p = fs.attr(d);
    assert_eq!((p.mtime, p.ctime, p.nlink), (t, t, 2));
    for (name, mode) in [("p", S_IFIFO), ("s", S_IFSOCK), ("c", S_IFCHR)] {
        let id = fs
            .mknod_as(&root(), d, name, mode | 0o600, 1, true)
            .unwrap()
            .id;
        fs.unlink(d, name).unwrap();
        assert_eq!(fs.getattr(id), Err(E::ENOENT), "{name}");
    }
    let l = fs.symlink_as(&root(), d, "l", "f").unwrap().id;
    fs.unlink(d, "l").unwrap();
    assert_eq!(fs.getattr(l), Err(E::ENOENT));
    assert!(fs.names(d).is_empty());
    fs.check();
}

#[test]
fn unlink_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    fs.dir(d, "sub");
    let f = fs.file(d, "f");
    assert_eq!(fs.unlink(d, "sub"), Err(E::EISDIR));
    assert_eq!(fs.unlink(d, "."), Err(E::EISDIR));
    assert_eq!(fs.unlink(d, ".."), Err(E::EISDIR));
    assert_eq!(fs.unlink(d, "nope"), Err(E::ENOENT));
    assert_eq!(fs.unlink(f, "x"), Err(E::ENOTDIR));
    assert_eq!(
        fs.unlink(f, "."),
        Err(E::ENOTDIR),
        "the parent is resolved before the name is looked at"
    );
    assert_eq!(fs.unlink(r + 9, "."), Err(E::ENOENT));
    let alice = usr(ALICE);
    assert_eq!(fs.unlink_as(&alice, d, "f"), Err(E::EACCES));
    assert_eq!(
        fs.unlink_as(&alice, d, "sub"),
        Err(E::EACCES),
        "EACCES before EISDIR"
    );
    assert_eq!(
        fs.unlink_as(&alice, d, "nope"),
        Err(E::ENOENT),
        "ENOENT before EACCES"
    );
    fs.chmod_as(&root(), d, 0o700).unwrap();
    assert_eq!(
        fs.unlink_as(&alice, d, "."),
        Err(E::EACCES),
        "search permission before the dots"
    );
    assert_eq!(fs.unlink_as(&alice, d, "nope"), Err(E::EACCES));
    fs.check();
}

// ------------------------------------------------------------------------------------------
// rmdir
// ------------------------------------------------------------------------------------------

#[test]
fn rmdir_removes_an_empty_directory() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(a, "b");
    fs.setxattr_as(&root(), b, "user.x", "y", 0).unwrap();
    assert_eq!(fs.attr(a).nlink, 3);
    fs.rmdir(a, "b").unwrap();
    let t = fs.now;
    let p = fs.attr(a);
    assert_eq!((p.nlink, p.mtime, p.ctime), (2, t, t));
    assert_eq!(fs.getattr(b), Err(E::ENOENT));
    assert_eq!(fs.getxattr_as(&root(), b, "user.x"), Err(E::ENOENT));
    assert_eq!(fs.lookup(a, "b"), Err(E::ENOENT));
    assert_eq!(fs.attr(r).nlink, 3);
    fs.rmdir(r, "a").unwrap();
    assert_eq!(fs.attr(r).nlink, 2);
    fs.check();
}

#[test]
fn rmdir_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    fs.dir(d, "sub");
    let f = fs.file(d, "f");
    let e = fs.dir(r, "e");
    fs.file(e, "x");
    assert_eq!(fs.rmdir(r, "e"), Err(E::ENOTEMPTY), "a file inside");
    assert_eq!(fs.rmdir(r, "d"), Err(E::ENOTEMPTY));
    assert_eq!(fs.rmdir(d, "f"), Err(E::ENOTDIR));
    assert_eq!(fs.rmdir(d, "."), Err(E::EINVAL));
    assert_eq!(fs.rmdir(d, ".."), Err(E::ENOTEMPTY));
    assert_eq!(fs.rmdir(d, "nope"), Err(E::ENOENT));
    assert_eq!(fs.rmdir(f, "x"), Err(E::ENOTDIR));
    assert_eq!(fs.rmdir(r + 9, ".."), Err(E::ENOENT));
    let alice = usr(ALICE);
    assert_eq!(fs.rmdir_as(&alice, d, "sub"), Err(E::EACCES));
    assert_eq!(
        fs.rmdir_as(&alice, d, "f"),
        Err(E::EACCES),
        "EACCES before ENOTDIR"
    );
    assert_eq!(fs.rmdir_as(&alice, d, "nope"), Err(E::ENOENT));
    fs.unlink(e, "x").unwrap();
    fs.rmdir(r, "e").unwrap();
    fs.check();
}

// ------------------------------------------------------------------------------------------
// rename
// ------------------------------------------------------------------------------------------

#[test]
fn rename_a_file_within_and_across_directories() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let f = fs.file(a, "f");
    let before = fs.attr(f);
    fs.rename(a, "f", a, "g").unwrap();
    let t = fs.now;
    assert_eq!(fs.lookup(a, "g").unwrap().id, f, "the inode keeps its id");
    assert_eq!(fs.lookup(a, "f"), Err(E::ENOENT));
    let x = fs.attr(f);
    assert_eq!(
        (x.ctime, x.mtime, x.atime, x.nlink),
        (t, before.mtime, before.atime, 1)
    );
    let p = fs.attr(a);
    assert_eq!((p.mtime, p.ctime), (t, t));

    let root_before = fs.attr(r);
    fs.rename(a, "g", b, "h").unwrap();
    let t = fs.now;
    for dir in [a, b] {
        let p = fs.attr(dir);
        assert_eq!((p.mtime, p.ctime, p.nlink), (t, t, 2));
    }
    assert_eq!(fs.attr(f).ctime, t);
    assert_eq!(fs.attr(r), root_before, "the grandparent is untouched");
    assert!(fs.names(a).is_empty());
    assert_eq!(fs.names(b), ["h"]);
    fs.check();
}

#[test]
fn rename_a_file_over_a_file() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let f = fs.file(a, "f");
    let g = fs.file(a, "g");
    let h = fs.file(a, "h");
    fs.link(h, a, "h2").unwrap();
    fs.rename(a, "f", a, "g").unwrap();
    assert_eq!(fs.lookup(a, "g").unwrap().id, f);
    assert_eq!(
        fs.getattr(g),
        Err(E::ENOENT),
        "the replaced inode had no other name"
    );
    assert_eq!(fs.names(a), ["g", "h", "h2"]);
    fs.rename(a, "g", a, "h").unwrap();
    let t = fs.now;
    let x = fs.attr(h);
    assert_eq!(
        (x.nlink, x.ctime),
        (1, t),
        "the replaced inode lives on under its other name"
    );
    assert_eq!(fs.lookup(a, "h").unwrap().id, f);
    assert_eq!(fs.lookup(a, "h2").unwrap().id, h);
    fs.check();
}

#[test]
fn rename_a_directory_over_an_empty_directory() {
    let mut fs = Fs::new();
    let r = fs.root();
    let p = fs.dir(r, "p");
    let x = fs.dir(p, "x");
    let y = fs.dir(p, "y");
    fs.file(x, "inside");
    assert_eq!(fs.attr(p).nlink, 4);
    fs.rename(p, "x", p, "y").unwrap();
    assert_eq!(fs.attr(p).nlink, 3, "one subdirectory fewer");
    assert_eq!(fs.lookup(p, "y").unwrap().id, x);
    assert_eq!(fs.getattr(y), Err(E::ENOENT));
    let q = fs.dir(r, "q");
    let z = fs.dir(q, "z");
    fs.rename(p, "y", q, "z").unwrap();
    assert_eq!((fs.attr(p).nlink, fs.attr(q).nlink), (2, 3));
    assert_eq!(fs.getattr(z), Err(E::ENOENT));
    assert_eq!(fs.lookup(x, "..").unwrap().id, q);
    assert_eq!(fs.names(x), ["inside"]);
    fs.check();
}

#[test]
fn rename_refuses_type_mismatches_and_non_empty_targets() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.dir(r, "d");
    let e = fs.dir(r, "e");
    fs.file(e, "x");
    fs.file(r, "f");
    fs.dir(r, "empty");
    assert_eq!(fs.rename(r, "d", r, "f"), Err(E::ENOTDIR));
    assert_eq!(fs.rename(r, "f", r, "empty"), Err(E::EISDIR));
    assert_eq!(
        fs.rename(r, "f", r, "e"),
        Err(E::EISDIR),
        "the type is checked before emptiness"
    );
    assert_eq!(fs.rename(r, "d", r, "e"), Err(E::ENOTEMPTY));
    fs.unlink(e, "x").unwrap();
    fs.rename(r, "d", r, "e").unwrap();
    fs.check();
}

#[test]
fn rename_refuses_cycles() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(a, "b");
    let c = fs.dir(b, "c");
    fs.file(b, "f");
    assert_eq!(
        fs.rename(r, "a", c, "x"),
        Err(E::EINVAL),
        "into its own subtree"
    );
    assert_eq!(fs.rename(r, "a", a, "x"), Err(E::EINVAL), "into itself");
    assert_eq!(fs.rename(a, "b", c, "x"), Err(E::EINVAL));
    assert_eq!(fs.rename2(r, "a", c, "x", RENAME_NOREPLACE), Err(E::EINVAL));
    assert_eq!(
        fs.rename(b, "c", r, "a"),
        Err(E::ENOTEMPTY),
        "over an ancestor of the source"
    );
    assert_eq!(
        fs.rename(b, "f", r, "a"),
        Err(E::ENOTEMPTY),
        "a file over an ancestor too"
    );
    assert_eq!(fs.rename2(b, "c", r, "a", RENAME_NOREPLACE), Err(E::EEXIST));
    assert_eq!(
        fs.rename2(b, "f", r, "a", RENAME_EXCHANGE),
        Err(E::EINVAL),
        "exchange with an ancestor"
    );
    assert_eq!(
        fs.rename2(r, "a", b, "f", RENAME_EXCHANGE),
        Err(E::EINVAL),
        "exchange with a descendant"
    );
    fs.rename(r, "a", r, "a").unwrap();
    assert_eq!(fs.names(b), ["c", "f"]);
    assert_eq!(fs.lookup(c, "..").unwrap().id, b);
    fs.check();
}

#[test]
fn renaming_onto_the_same_inode_does_nothing() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.link(f, r, "g").unwrap();
    fs.dir(r, "d");
    let before = snapshot(&fs.e);
    let log = fs.log.len();
    fs.rename(r, "f", r, "g").unwrap();
    fs.rename(r, "f", r, "f").unwrap();
    fs.rename(r, "d", r, "d").unwrap();
    fs.rename2(r, "f", r, "g", RENAME_EXCHANGE).unwrap();
    assert_eq!(fs.log.len(), log, "no mutation");
    assert!(snapshot(&fs.e) == before, "not even a timestamp");
    assert_eq!(fs.names(r), ["d", "f", "g"], "both names stay");
    assert_eq!(fs.rename2(r, "f", r, "g", RENAME_NOREPLACE), Err(E::EEXIST));
    fs.check();
}

#[test]
fn rename_noreplace_and_the_dot_names() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.file(r, "f");
    fs.file(r, "g");
    assert_eq!(fs.rename2(r, "f", r, "g", RENAME_NOREPLACE), Err(E::EEXIST));
    assert_eq!(
        fs.rename2(r, "nope", r, "g", RENAME_NOREPLACE),
        Err(E::ENOENT),
        "the source is looked up first"
    );
    fs.rename2(r, "f", r, "h", RENAME_NOREPLACE).unwrap();
    assert_eq!(fs.names(r), ["g", "h"]);
    for dots in [".", ".."] {
        assert_eq!(fs.rename(r, "h", r, dots), Err(E::EBUSY), "to {dots}");
        assert_eq!(
            fs.rename2(r, "h", r, dots, RENAME_NOREPLACE),
            Err(E::EEXIST),
            "to {dots} without replacing"
        );
        assert_eq!(fs.rename(r, dots, r, "x"), Err(E::EBUSY), "from {dots}");
        assert_eq!(
            fs.rename2(r, dots, r, "x", RENAME_NOREPLACE),
            Err(E::EBUSY),
            "from {dots} without replacing"
        );
    }
    fs.check();
}

#[test]
fn rename_flags_are_checked_first() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.file(r, "f");
    fs.file(r, "g");
    assert_eq!(
        fs.rename2(r, "f", r, "g", RENAME_NOREPLACE | RENAME_EXCHANGE),
        Err(E::EINVAL)
    );
    assert_eq!(
        fs.rename2(
            r + 9,
            "nope",
            r + 9,
            "g",
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ),
        Err(E::EINVAL)
    );
    assert_eq!(fs.rename2(r, "f", r, "x", 8), Err(E::EINVAL));
    assert_eq!(fs.rename2(r, "f", r, "x", 1 << 31), Err(E::EINVAL));
    // Linux makes whiteouts (for overlayfs); the engine does not, but must fail cleanly.
    assert!(fs.rename2(r, "f", r, "x", RENAME_WHITEOUT).is_err());
    assert_eq!(fs.names(r), ["f", "g"]);
}

#[test]
fn rename_exchange_swaps_two_names() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let f = fs.file(a, "f");
    let g = fs.file(b, "g");
    let (fb, gb) = (fs.attr(f), fs.attr(g));
    fs.rename2(a, "f", b, "g", RENAME_EXCHANGE).unwrap();
    let t = fs.now;
    assert_eq!(fs.lookup(a, "f").unwrap().id, g);
    assert_eq!(fs.lookup(b, "g").unwrap().id, f);
    let (fa, ga) = (fs.attr(f), fs.attr(g));
    assert_eq!((fa.ctime, ga.ctime), (t, t), "both inodes get a new ctime");
    assert_eq!(
        (fa.mtime, ga.mtime, fa.nlink, ga.nlink),
        (fb.mtime, gb.mtime, 1, 1)
    );
    for dir in [a, b] {
        let p = fs.attr(dir);
        assert_eq!((p.mtime, p.ctime, p.nlink), (t, t, 2));
    }
    assert_eq!(
        fs.rename2(a, "f", a, "nope", RENAME_EXCHANGE),
        Err(E::ENOENT)
    );
    fs.rename2(a, "f", a, "f", RENAME_EXCHANGE).unwrap();
    fs.check();
}

#[test]
fn rename_exchange_of_a_file_and_a_directory_across_parents() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let d = fs.dir(a, "d");
    fs.file(d, "inner");
    let f = fs.file(b, "f");
    let d_before = fs.attr(d);
    assert_eq!((fs.attr(a).nlink, fs.attr(b).nlink), (3, 2));
    fs.rename2(a, "d", b, "f", RENAME_EXCHANGE).unwrap();
    let t = fs.now;
    assert_eq!(fs.lookup(a, "d").unwrap().id, f);
    assert_eq!(fs.lookup(b, "f").unwrap().id, d);
    assert_eq!(
        (fs.attr(a).nlink, fs.attr(b).nlink),
        (2, 3),
        "the subdirectory moved from a to b"
    );
    assert_eq!(fs.lookup(d, "..").unwrap().id, b);
    let dot_dot = &fs.readdir_as(&root(), d, 0, 10, false).unwrap().0[1];
    assert_eq!((dot_dot.name.as_slice(), dot_dot.id), (&b".."[..], b));
    let da = fs.attr(d);
    assert_eq!((da.ctime, da.mtime, da.nlink), (t, d_before.mtime, 2));
    assert_eq!(fs.attr(f).ctime, t);
    assert_eq!(
        fs.names(d),
        ["inner"],
        "a non-empty directory can be exchanged"
    );
    fs.rename2(b, "f", a, "d", RENAME_EXCHANGE).unwrap();
    assert_eq!((fs.attr(a).nlink, fs.attr(b).nlink), (3, 2));
    assert_eq!(fs.lookup(d, "..").unwrap().id, a);
    fs.check();
}

#[test]
fn rename_exchange_of_two_directories_across_parents() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let x = fs.dir(a, "x");
    let y = fs.dir(b, "y");
    fs.file(x, "in-x");
    fs.rename2(a, "x", b, "y", RENAME_EXCHANGE).unwrap();
    assert_eq!((fs.attr(a).nlink, fs.attr(b).nlink), (3, 3));
    assert_eq!(fs.lookup(x, "..").unwrap().id, b);
    assert_eq!(fs.lookup(y, "..").unwrap().id, a);
    assert_eq!(fs.lookup(a, "x").unwrap().id, y);
    fs.check();
}

#[test]
fn moving_a_directory_updates_dotdot_and_link_counts() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let m = fs.dir(a, "m");
    fs.file(m, "f");
    fs.dir(m, "sub");
    let before = fs.attr(m);
    let root_before = fs.attr(r);
    fs.rename(a, "m", b, "m2").unwrap();
    let t = fs.now;
    assert_eq!((fs.attr(a).nlink, fs.attr(b).nlink), (2, 3));
    let ma = fs.attr(m);
    assert_eq!(ma.nlink, 3, "its own count is unchanged");
    assert_eq!(ma.ctime, t);
    assert_eq!(
        ma.mtime, before.mtime,
        "rewriting \"..\" does not change the moved directory's mtime"
    );
    assert_eq!(fs.lookup(m, "..").unwrap().id, b);
    let entries = fs.readdir_as(&root(), m, 0, 100, true).unwrap().0;
    assert_eq!(entries[1].id, b);
    assert_eq!(entries[1].attr.as_ref().unwrap(), &fs.attr(b));
    assert_eq!(fs.attr(r), root_before);
    fs.rename(b, "m2", b, "m3").unwrap();
    assert_eq!(fs.attr(b).nlink, 3, "within one directory nothing moves");
    fs.rename(b, "m3", r, "top").unwrap();
    assert_eq!((fs.attr(b).nlink, fs.attr(r).nlink), (2, 5));
    assert_eq!(fs.lookup(m, "..").unwrap().id, r);
    fs.check();
}

#[test]
fn rename_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    assert_eq!(fs.rename(r, "nope", r, "x"), Err(E::ENOENT));
    assert_eq!(fs.rename(r + 9, "f", r, "x"), Err(E::ENOENT));
    assert_eq!(fs.rename(r, "f", r + 9, "x"), Err(E::ENOENT));
    assert_eq!(
        fs.rename(r + 9, ".", r, "x"),
        Err(E::ENOENT),
        "parents are resolved before the dots"
    );
    assert_eq!(fs.rename(r, ".", r + 9, "x"), Err(E::ENOENT));
    assert_eq!(fs.rename(f, "x", r, "y"), Err(E::ENOTDIR));
    assert_eq!(fs.rename(r, "f", f, "y"), Err(E::ENOTDIR));
    fs.check();
}

#[test]
fn rename_permissions() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let c = fs.dir(r, "c");
    fs.chmod_as(&root(), b, 0o777).unwrap();
    fs.chmod_as(&root(), c, 0o777).unwrap();
    fs.file(a, "g");
    fs.file(b, "f");
    let alice = usr(ALICE);
    assert_eq!(
        fs.rename_as(&alice, b, "f", a, "f", 0),
        Err(E::EACCES),
        "no write permission on the target directory"
    );
    assert_eq!(
        fs.rename_as(&alice, a, "g", b, "g", 0),
        Err(E::EACCES),
        "nor on the source directory"
    );
    // Moving a directory to another parent rewrites its "..": it must be writable.
    fs.mkdir_as(&alice, b, "ud", 0o555).unwrap();
    assert_eq!(fs.rename_as(&alice, b, "ud", c, "ud", 0), Err(E::EACCES));
    fs.rename_as(&alice, b, "ud", b, "ud2", 0).unwrap();
    fs.dir(b, "rootdir");
    assert_eq!(
        fs.rename_as(&alice, b, "rootdir", c, "x", 0),
        Err(E::EACCES)
    );
    fs.rename_as(&root(), b, "rootdir", c, "x", 0).unwrap();
    let ud = fs.id_of(b, "ud2");
    fs.chmod_as(&alice, ud, 0o755).unwrap();
    fs.rename_as(&alice, b, "ud2", c, "ud", 0).unwrap();
    fs.rename_as(&alice, b, "f", c, "f", 0).unwrap();
    fs.chmod_as(&root(), c, 0o776).unwrap();
    assert_eq!(
        fs.rename_as(&alice, c, "f", b, "f", 0),
        Err(E::EACCES),
        "search permission"
    );
    fs.check();
}

// ------------------------------------------------------------------------------------------
// sticky directories
// ------------------------------------------------------------------------------------------

#[test]
fn sticky_directories_protect_other_users_entries() {
    let mut fs = Fs::new();
    let r = fs.root();
    let t = fs.dir(r, "tmp");
    fs.own(t, CAROL, CAROL, 0o1777);
    let (alice, bob, carol) = (usr(ALICE), usr(BOB), usr(CAROL));
    fs.create_as(&alice, t, "a", 0o666).unwrap();
    fs.mkdir_as(&alice, t, "ad", 0o777).unwrap();
    fs.create_as(&bob, t, "b", 0o666).unwrap();
    assert_eq!(fs.unlink_as(&bob, t, "a"), Err(E::EPERM));
    assert_eq!(fs.rmdir_as(&bob, t, "ad"), Err(E::EPERM));
    assert_eq!(
        fs.rename_as(&bob, t, "a", t, "z", 0),
        Err(E::EPERM),
        "renaming away"
    );
    assert_eq!(
        fs.rename_as(&bob, t, "b", t, "a", 0),
        Err(E::EPERM),
        "replacing"
    );
    assert_eq!(
        fs.rename_as(&bob, t, "b", t, "a", RENAME_EXCHANGE),
        Err(E::EPERM),
        "exchanging"
    );
    assert_eq!(fs.unlink_as(&bob, t, "nope"), Err(E::ENOENT));
    fs.rename_as(&bob, t, "b", t, "b2", 0).unwrap();
    // Moving one's own entry in from elsewhere is fine.
    let o = fs.dir(r, "other");
    fs.chmod_as(&root(), o, 0o777).unwrap();
    fs.create_as(&bob, o, "mine", 0o644).unwrap();
    fs.rename_as(&bob, o, "mine", t, "mine", 0).unwrap();
    fs.unlink_as(&bob, t, "b2").unwrap();
    fs.unlink_as(&carol, t, "a").unwrap();
    fs.rmdir_as(&root(), t, "ad").unwrap();
    fs.unlink_as(&alice, t, "mine").unwrap_err();
    fs.create_as(&alice, t, "a", 0o666).unwrap();
    fs.unlink_as(&alice, t, "a").unwrap();
    assert!(fs.names(t).is_empty() || fs.names(t) == ["mine"]);
    fs.check();
}

// ------------------------------------------------------------------------------------------
// link
// ------------------------------------------------------------------------------------------

#[test]
fn link_adds_a_name() {
    let mut fs = Fs::new();
    let r = fs.root();
    let a = fs.dir(r, "a");
    let b = fs.dir(r, "b");
    let f = fs.file(a, "f");
    let a_before = fs.attr(a);
    let l = fs.link(f, b, "l").unwrap();
    let t = fs.now;
    assert_eq!((l.id, l.nlink, l.ctime), (f, 2, t));
    assert_eq!(fs.attr(f), l);
    let p = fs.attr(b);
    assert_eq!((p.mtime, p.ctime, p.nlink), (t, t, 2));
    assert_eq!(fs.attr(a), a_before, "the source directory is untouched");
    assert_eq!(fs.lookup(b, "l").unwrap().id, f);
    assert_eq!(fs.link(f, a, "f2").unwrap().nlink, 3);
    let s = fs.symlink_as(&root(), a, "s", "f").unwrap().id;
    assert_eq!(
        fs.link(s, b, "s").unwrap().nlink,
        2,
        "symlinks can be linked"
    );
    let p = fs
        .mknod_as(&root(), a, "p", S_IFIFO | 0o600, 0, true)
        .unwrap()
        .id;
    assert_eq!(fs.link(p, b, "p").unwrap().nlink, 2, "and fifos");
    fs.check();
}

#[test]
fn link_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let f = fs.file(r, "f");
    assert_eq!(
        fs.link(d, r, "dl"),
        Err(E::EPERM),
        "no hard links to directories, not even for root"
    );
    assert_eq!(fs.link(d, r, "f"), Err(E::EEXIST), "EEXIST comes first");
    for name in ["f", ".", ".."] {
        assert_eq!(fs.link(f, r, name), Err(E::EEXIST), "{name}");
    }
    assert_eq!(fs.link(r + 9, r, "x"), Err(E::ENOENT));
    assert_eq!(fs.link(f, r + 9, "x"), Err(E::ENOENT));
    assert_eq!(fs.link(f, f, "x"), Err(E::ENOTDIR));
    assert_eq!(fs.link_as(&usr(ALICE), d, d, "x"), Err(E::EPERM));
    fs.check();
}

#[test]
fn protected_hardlinks() {
    // fs.protected_hardlinks=1 (the default): a non-owner may link only a plain regular
    // file that is neither setuid nor executable-setgid and that they may read and write.
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    fs.chmod_as(&root(), d, 0o777).unwrap();
    let f = fs.file(r, "f");
    let alice = usr(ALICE);
    let cases = [
        (0o600, Err(E::EPERM)),
        (0o644, Err(E::EPERM)),
        (0o666, Ok(())),
        (0o4666, Err(E::EPERM)),
        (0o2676, Err(E::EPERM)),
        (0o2666, Ok(())),
    ];
    for (i, (perm, expect)) in cases.into_iter().enumerate() {
        fs.chmod_as(&root(), f, perm).unwrap();
        assert_eq!(
            fs.link_as(&alice, f, d, format!("l{i}")).map(|_| ()),
            expect,
            "mode {perm:o}"
        );
    }
    fs.chmod_as(&root(), f, 0o600).unwrap();
    assert_eq!(
        fs.link_as(&alice, f, d, "l2"),
        Err(E::EEXIST),
        "EEXIST before EPERM"
    );
    let p = fs
        .mknod_as(&root(), r, "p", S_IFIFO | 0o666, 0, true)
        .unwrap()
        .id;
    assert_eq!(
        fs.link_as(&alice, p, d, "p"),
        Err(E::EPERM),
        "special files are never safe"
    );
    fs.own(p, ALICE, ALICE, 0o000);
    fs.link_as(&alice, p, d, "p").unwrap();
    fs.own(f, ALICE, ALICE, 0o000);
    fs.link_as(&alice, f, d, "mine").unwrap();
    // The directory's write permission is checked after the link rule.
    let ro = fs.dir(r, "ro");
    fs.own(f, 0, 0, 0o666);
    assert_eq!(fs.link_as(&alice, f, ro, "x"), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o600).unwrap();
    assert_eq!(fs.link_as(&alice, f, ro, "x"), Err(E::EPERM));
    fs.check();
}

#[test]
fn link_count_limit_is_ext4s() {
    let mut fs = Fs::new();
    fs.check_unchanged = false;
    let r = fs.root();
    let f = fs.file(r, "f");
    // Spread over directories of 1000 names each.
    let mut dirs = Vec::new();
    for n in 1..LINK_MAX {
        if n % 1000 == 1 {
            dirs.push(fs.dir(r, format!("d{}", dirs.len())));
        }
        let a = fs.link(f, *dirs.last().unwrap(), format!("l{n}")).unwrap();
        assert_eq!(a.nlink, n + 1);
    }
    assert_eq!(fs.attr(f).nlink, LINK_MAX);
    fs.check_unchanged = true;
    assert_eq!(fs.link(f, r, "one-too-many"), Err(E::EMLINK));
    fs.check_unchanged = false;
    fs.unlink(dirs[0], "l1").unwrap();
    assert_eq!(fs.link(f, r, "again").unwrap().nlink, LINK_MAX);
    assert!(fs.e.check_invariants().is_empty());
}

#[test]
fn directory_link_count_saturates_like_ext4_dir_nlink() {
    // ext4 (dir_nlink) counts up to 65000 and then reports 1; measured on ext4: 64998
    // subdirectories show 65000, the 64999th turns it to 1 and it stays 1.
    let mut fs = Fs::new();
    fs.check_unchanged = false;
    let r = fs.root();
    let big = fs.dir(r, "big");
    for i in 0..(LINK_MAX - 2) {
        fs.dir(big, format!("{i}"));
    }
    assert_eq!(fs.attr(big).nlink, LINK_MAX);
    fs.dir(big, "one-more");
    assert_eq!(fs.attr(big).nlink, 1);
    fs.rmdir(big, "0").unwrap();
    assert_eq!(fs.attr(big).nlink, 1);
    fs.dir(big, "0");
    assert_eq!(fs.attr(big).nlink, 1);
    assert!(
        fs.e.check_invariants().is_empty(),
        "{:?}",
        fs.e.check_invariants()
    );
}

// ------------------------------------------------------------------------------------------
// symlink and readlink
// ------------------------------------------------------------------------------------------

#[test]
fn symlink_and_readlink() {
    let mut fs = Fs::new();
    let r = fs.root();
    fs.chmod_as(&root(), r, 0o777).unwrap();
    let a = fs.symlink_as(&usr(ALICE), r, "l", "some/target").unwrap();
    let t = fs.now;
    assert_eq!(
        (a.mode, a.size, a.uid, a.gid, a.nlink),
        (S_IFLNK | 0o777, 11, ALICE, ALICE, 1)
    );
    assert_eq!((a.atime, a.mtime, a.ctime), (t, t, t));
    let p = fs.attr(r);
    assert_eq!((p.mtime, p.ctime), (t, t));
    assert_eq!(
        fs.readlink_as(&usr(BOB), a.id).unwrap(),
        b"some/target",
        "no permission needed"
    );
    let long = vec![b'a'; SYMLINK_MAX];
    let l = fs.symlink_as(&root(), r, "long", &long).unwrap();
    assert_eq!(l.size, SYMLINK_MAX as u64);
    assert_eq!(fs.readlink_as(&root(), l.id).unwrap(), long);
    let f = fs.file(r, "f");
    let d = fs.dir(r, "d");
    assert_eq!(
        fs.symlink_as(&root(), r, "x", vec![b'a'; SYMLINK_MAX + 1]),
        Err(E::ENAMETOOLONG)
    );
    assert_eq!(fs.symlink_as(&root(), r, "x", ""), Err(E::ENOENT));
    assert_eq!(
        fs.symlink_as(&root(), r, "f", ""),
        Err(E::ENOENT),
        "the target is checked first"
    );
    assert_eq!(
        fs.symlink_as(&root(), r + 9, "x", vec![b'a'; 5000]),
        Err(E::ENAMETOOLONG)
    );
    assert_eq!(fs.symlink_as(&root(), r, "f", "t"), Err(E::EEXIST));
    assert_eq!(fs.symlink_as(&root(), f, "x", "t"), Err(E::ENOTDIR));
    assert_eq!(fs.symlink_as(&usr(ALICE), d, "x", "t"), Err(E::EACCES));
    assert_eq!(fs.readlink_as(&root(), f), Err(E::EINVAL));
    assert_eq!(fs.readlink_as(&root(), d), Err(E::EINVAL));
    assert_eq!(fs.readlink_as(&root(), r + 9), Err(E::ENOENT));
    fs.check();
}

// ------------------------------------------------------------------------------------------
// readdir and readdirplus
// ------------------------------------------------------------------------------------------

fn kind_of(fs: &mut Fs, id: InodeId) -> FileKind {
    fs.attr(id).kind().expect("a typed inode")
}

#[test]
fn readdir_lists_dot_dotdot_and_every_entry_once() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let (e, eof) = fs.readdir_as(&root(), d, 0, 100, false).unwrap();
    assert!(eof);
    let got: Vec<(&[u8], InodeId, FileKind)> = e
        .iter()
        .map(|e| (e.name.as_slice(), e.id, e.kind))
        .collect();
    assert_eq!(
        got,
        [
            (&b"."[..], d, FileKind::Dir),
            (&b".."[..], r, FileKind::Dir)
        ]
    );
    let (e, _) = fs.readdir_as(&root(), r, 0, 100, false).unwrap();
    assert_eq!((e[0].id, e[1].id), (r, r), "the root's \"..\" is itself");

    fs.file(d, "f");
    fs.dir(d, "sub");
    fs.symlink_as(&root(), d, "l", "f").unwrap();
    fs.mknod_as(&root(), d, "p", S_IFIFO | 0o644, 0, true)
        .unwrap();
    fs.mknod_as(&root(), d, "s", S_IFSOCK | 0o644, 0, true)
        .unwrap();
    fs.mknod_as(&root(), d, "c", S_IFCHR | 0o644, 5, true)
        .unwrap();
    fs.mknod_as(&root(), d, "b", S_IFBLK | 0o644, 6, true)
        .unwrap();
    for i in 0..40 {
        fs.file(d, format!("n{i}"));
    }
    let all = fs.readdir_all_as(&root(), d, 1000, false).unwrap();
    assert_eq!(all.len(), 2 + 47);
    let mut cookies: Vec<u64> = all.iter().map(|e| e.cookie).collect();
    cookies.dedup();
    assert_eq!(cookies.len(), all.len(), "distinct cookies");
    assert!(all.iter().all(|e| e.cookie != 0 && e.attr.is_none()));
    let mut names: Vec<&[u8]> = all[2..].iter().map(|e| e.name.as_slice()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 47, "every entry exactly once");
    for e in &all[2..] {
        assert_eq!(fs.lookup(d, &e.name).unwrap().id, e.id);
        assert_eq!(kind_of(&mut fs, e.id), e.kind, "{:?}", e.name);
    }

    // readdirplus: the same entries with the attributes getattr gives.
    let plus = fs.readdir_all_as(&root(), d, 1000, true).unwrap();
    assert_eq!(plus.len(), all.len());
    for (p, e) in plus.iter().zip(&all) {
        assert_eq!(
            (&p.name, p.id, p.cookie, p.kind),
            (&e.name, e.id, e.cookie, e.kind)
        );
        assert_eq!(p.attr.as_ref().unwrap(), &fs.attr(p.id));
    }

    // Paging with any page size gives the same sequence, and resuming from any cookie
    // gives exactly the rest.
    for page in 1..=9 {
        let paged = fs.readdir_all_as(&root(), d, page, false).unwrap();
        assert_eq!(paged, all, "page size {page}");
    }
    for (i, e) in all.iter().enumerate() {
        let (rest, eof) = fs.readdir_as(&root(), d, e.cookie, 1000, false).unwrap();
        assert!(eof);
        assert_eq!(rest, all[i + 1..], "after {:?}", e.name);
    }
    fs.check();
}

#[test]
fn readdir_cookies_stay_valid_while_the_directory_changes() {
    let mut fs = Fs::new();
    fs.check_unchanged = false;
    let r = fs.root();
    let d = fs.dir(r, "d");
    let mut rng = Rng::new(42);
    let mut present: std::collections::BTreeSet<String> = Default::default();
    let mut next = 0;
    let fresh = |next: &mut u32| {
        *next += 1;
        format!("n{next}")
    };
    for _ in 0..150 {
        let name = fresh(&mut next);
        fs.file(d, &name);
        present.insert(name);
    }
    for round in 0..60 {
        let at_start = present.clone();
        let mut added = std::collections::HashSet::new();
        let mut removed = std::collections::HashSet::new();
        let mut seen = std::collections::HashSet::new();
        let max = 1 + rng.below(12) as u32;
        let plus = rng.chance(1, 2);
        let mut cookie = 0;
        let mut dots = 0;
        loop {
            let (entries, eof) = fs.readdir_as(&root(), d, cookie, max, plus).unwrap();
            for e in &entries {
                let name = String::from_utf8(e.name.clone()).unwrap();
                if name == "." || name == ".." {
                    dots += 1;
                    continue;
                }
                assert!(
                    seen.insert(name.clone()),
                    "round {round}: {name} returned twice"
                );
                assert!(
                    at_start.contains(&name) || added.contains(&name),
                    "round {round}: {name} never existed"
                );
                if plus {
                    assert_eq!(e.attr.as_ref().map(|a| a.id), Some(e.id));
                }
            }
            if let Some(last) = entries.last() {
                cookie = last.cookie;
            }
            if eof {
                break;
            }
            for _ in 0..rng.below(6) {
                let victim = present
                    .iter()
                    .nth(rng.below(present.len().max(1) as u64) as usize)
                    .cloned();
                match (rng.below(3), victim) {
                    (0, _) | (_, None) => {
                        let name = fresh(&mut next);
                        if rng.chance(1, 4) {
                            fs.dir(d, &name);
                        } else {
                            fs.file(d, &name);
                        }
                        added.insert(name.clone());
                        present.insert(name);
                    }
                    (1, Some(v)) => {
                        if fs.unlink(d, &v).is_err() {
                            fs.rmdir(d, &v).unwrap();
                        }
                        present.remove(&v);
                        removed.insert(v);
                    }
                    (_, Some(v)) => {
                        let name = fresh(&mut next);
                        fs.rename(d, &v, d, &name).unwrap();
                        present.remove(&v);
                        removed.insert(v);
                        added.insert(name.clone());
                        present.insert(name);
                    }
                }
            }
        }
        assert_eq!(dots, 2, "round {round}: \".\" and \"..\" once each");
        for name in &at_start {
            assert!(
                removed.contains(name) || seen.contains(name),
                "round {round}: {name} existed throughout but was skipped"
            );
        }
    }
    fs.check();
}

#[test]
fn readdir_resumes_after_a_deleted_entry() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    for i in 0..50 {
        fs.file(d, format!("f{i}"));
    }
    let all = fs.readdir_all_as(&root(), d, 1000, false).unwrap();
    let (page, eof) = fs.readdir_as(&root(), d, 0, 12, false).unwrap();
    assert!(!eof);
    assert_eq!(page, all[..12]);
    let held = page.last().unwrap().clone();
    // Remove the entry whose cookie we hold, one before it and one after it.
    for e in [&held, &all[5], &all[30]] {
        fs.unlink(d, &e.name).unwrap();
    }
    let (rest, eof) = fs.readdir_as(&root(), d, held.cookie, 1000, false).unwrap();
    assert!(eof);
    let expect: Vec<_> = all[12..]
        .iter()
        .filter(|e| e.name != all[30].name)
        .cloned()
        .collect();
    assert_eq!(rest, expect);
    fs.check();
}

#[test]
fn readdir_permissions_and_errors() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let f = fs.file(d, "f");
    let alice = usr(ALICE);
    fs.chmod_as(&root(), d, 0o711).unwrap();
    assert_eq!(
        fs.readdir_as(&alice, d, 0, 10, false),
        Err(E::EACCES),
        "x without r"
    );
    assert_eq!(fs.readdir_as(&alice, d, 0, 10, true), Err(E::EACCES));
    fs.chmod_as(&root(), d, 0o744).unwrap();
    let names: Vec<Vec<u8>> = fs
        .readdir_all_as(&alice, d, 10, false)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        names,
        [b".".to_vec(), b"..".to_vec(), b"f".to_vec()],
        "r without x lists names"
    );
    fs.chmod_as(&root(), d, 0o000).unwrap();
    assert_eq!(
        fs.readdir_all_as(&root(), d, 10, false).unwrap().len(),
        3,
        "root reads anything"
    );
    assert_eq!(fs.readdir_as(&root(), f, 0, 10, false), Err(E::ENOTDIR));
    assert_eq!(fs.readdir_as(&root(), r + 9, 0, 10, false), Err(E::ENOENT));
    // A page size of 0 still makes progress.
    let (e, eof) = fs.readdir_as(&root(), d, 0, 0, false).unwrap();
    assert_eq!((e.len(), eof), (1, false));
}

// ------------------------------------------------------------------------------------------
// extended attributes
// ------------------------------------------------------------------------------------------

#[test]
fn xattrs_set_get_list_and_remove() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let before = fs.attr(f);
    fs.setxattr_as(&root(), f, "user.a", "1", 0).unwrap();
    let t = fs.now;
    let a = fs.attr(f);
    assert_eq!((a.ctime, a.mtime), (t, before.mtime), "ctime only");
    assert_eq!(fs.getxattr_as(&root(), f, "user.a").unwrap(), b"1");
    fs.setxattr_as(&root(), f, "user.b", "", 0).unwrap();
    assert_eq!(
        fs.getxattr_as(&root(), f, "user.b").unwrap(),
        b"",
        "empty values are values"
    );
    fs.setxattr_as(&root(), f, "user.a", "22", 0).unwrap();
    assert_eq!(fs.getxattr_as(&root(), f, "user.a").unwrap(), b"22");
    assert_eq!(fs.listxattr_as(&root(), f).unwrap(), ["user.a", "user.b"]);
    fs.removexattr_as(&root(), f, "user.a").unwrap();
    let t = fs.now;
    assert_eq!(fs.attr(f).ctime, t);
    assert_eq!(fs.getxattr_as(&root(), f, "user.a"), Err(E::ENODATA));
    assert_eq!(fs.removexattr_as(&root(), f, "user.a"), Err(E::ENODATA));
    assert_eq!(fs.listxattr_as(&root(), f).unwrap(), ["user.b"]);
    let d = fs.dir(r, "d");
    fs.setxattr_as(&root(), d, "user.dir", "v", 0).unwrap();
    assert_eq!(fs.getxattr_as(&root(), d, "user.dir").unwrap(), b"v");
    assert_eq!(fs.listxattr_as(&root(), r).unwrap(), Vec::<String>::new());

    // Sizes: names of 1..=255 bytes, values up to 64 KiB.
    let max_name = format!("user.{}", "n".repeat(250));
    fs.setxattr_as(&root(), f, &max_name, "x", 0).unwrap();
    let too_long = format!("user.{}", "n".repeat(251));
    assert_eq!(
        fs.setxattr_as(&root(), f, &too_long, "x", 0),
        Err(E::ERANGE)
    );
    assert_eq!(fs.getxattr_as(&root(), f, &too_long), Err(E::ERANGE));
    assert_eq!(fs.removexattr_as(&root(), f, &too_long), Err(E::ERANGE));
    assert_eq!(fs.setxattr_as(&root(), f, "", "x", 0), Err(E::ERANGE));
    assert_eq!(fs.getxattr_as(&root(), f, ""), Err(E::ERANGE));
    let big = vec![7u8; XATTR_SIZE_MAX];
    fs.setxattr_as(&root(), f, "user.big", &big, 0).unwrap();
    assert_eq!(fs.getxattr_as(&root(), f, "user.big").unwrap(), big);
    assert_eq!(
        fs.setxattr_as(&root(), f, "user.big2", vec![7u8; XATTR_SIZE_MAX + 1], 0),
        Err(E::E2BIG)
    );
    fs.check();
}

#[test]
fn xattr_create_and_replace_flags() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    assert_eq!(
        fs.setxattr_as(&root(), f, "user.a", "1", XATTR_REPLACE),
        Err(E::ENODATA)
    );
    fs.setxattr_as(&root(), f, "user.a", "1", XATTR_CREATE)
        .unwrap();
    assert_eq!(
        fs.setxattr_as(&root(), f, "user.a", "2", XATTR_CREATE),
        Err(E::EEXIST)
    );
    fs.setxattr_as(&root(), f, "user.a", "3", XATTR_REPLACE)
        .unwrap();
    assert_eq!(fs.getxattr_as(&root(), f, "user.a").unwrap(), b"3");
    assert_eq!(
        fs.setxattr_as(&root(), f, "user.a", "4", XATTR_CREATE | XATTR_REPLACE),
        Err(E::EEXIST)
    );
    assert_eq!(
        fs.setxattr_as(&root(), f, "user.b", "4", XATTR_CREATE | XATTR_REPLACE),
        Err(E::ENODATA)
    );
    assert_eq!(fs.setxattr_as(&root(), f, "user.a", "5", 4), Err(E::EINVAL));
    assert_eq!(fs.getxattr_as(&root(), f, "user.a").unwrap(), b"3");
    fs.check();
}

#[test]
fn xattr_namespaces() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.chmod_as(&root(), f, 0o600).unwrap();
    let alice = usr(ALICE);

    // trusted.*: root only; to others it does not exist.
    fs.setxattr_as(&root(), f, "trusted.t", "x", 0).unwrap();
    assert_eq!(fs.getxattr_as(&root(), f, "trusted.t").unwrap(), b"x");
    assert_eq!(fs.getxattr_as(&alice, f, "trusted.t"), Err(E::ENODATA));
    assert_eq!(fs.getxattr_as(&alice, f, "trusted.nope"), Err(E::ENODATA));
    assert_eq!(
        fs.setxattr_as(&alice, f, "trusted.t", "y", 0),
        Err(E::EPERM)
    );
    assert_eq!(fs.removexattr_as(&alice, f, "trusted.t"), Err(E::EPERM));

    // security.*: root writes; anyone reads, without any permission on the file.
    assert_eq!(
        fs.setxattr_as(&alice, f, "security.s", "x", 0),
        Err(E::EPERM)
    );
    fs.setxattr_as(&root(), f, "security.s", "sec", 0).unwrap();
    assert_eq!(fs.getxattr_as(&alice, f, "security.s").unwrap(), b"sec");

    // user.*: the file's r and w bits.
    fs.setxattr_as(&root(), f, "user.u", "x", 0).unwrap();
    assert_eq!(fs.getxattr_as(&alice, f, "user.u"), Err(E::EACCES));
    assert_eq!(fs.setxattr_as(&alice, f, "user.u", "y", 0), Err(E::EACCES));
    assert_eq!(fs.removexattr_as(&alice, f, "user.u"), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o604).unwrap();
    assert_eq!(fs.getxattr_as(&alice, f, "user.u").unwrap(), b"x");
    assert_eq!(fs.setxattr_as(&alice, f, "user.u", "y", 0), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o602).unwrap();
    fs.setxattr_as(&alice, f, "user.u", "y", 0).unwrap();

    // listxattr needs no permission and hides trusted.* from everyone but root.
    assert_eq!(
        fs.listxattr_as(&alice, f).unwrap(),
        ["security.s", "user.u"]
    );
    assert_eq!(
        fs.listxattr_as(&root(), f).unwrap(),
        ["security.s", "trusted.t", "user.u"]
    );

    // system.* (POSIX ACLs) is not supported; unknown namespaces are refused after the
    // permission check.
    for name in ["system.posix_acl_access", "system.foo", "system."] {
        assert_eq!(
            fs.setxattr_as(&root(), f, name, "x", 0),
            Err(E::EOPNOTSUPP),
            "{name}"
        );
        assert_eq!(
            fs.getxattr_as(&root(), f, name),
            Err(E::EOPNOTSUPP),
            "{name}"
        );
    }
    assert_eq!(
        fs.setxattr_as(&root(), f, "foo.bar", "x", 0),
        Err(E::EOPNOTSUPP)
    );
    assert_eq!(fs.getxattr_as(&root(), f, "foo.bar"), Err(E::EOPNOTSUPP));
    fs.chmod_as(&root(), f, 0o600).unwrap();
    assert_eq!(fs.setxattr_as(&alice, f, "foo.bar", "x", 0), Err(E::EACCES));
    // A bare namespace prefix is not a name.
    for name in ["user.", "trusted.", "security."] {
        assert_eq!(
            fs.setxattr_as(&root(), f, name, "x", 0),
            Err(E::EINVAL),
            "{name}"
        );
        assert_eq!(fs.getxattr_as(&root(), f, name), Err(E::EINVAL), "{name}");
    }
    fs.check();
}

#[test]
fn user_xattrs_only_on_files_and_directories() {
    let mut fs = Fs::new();
    let r = fs.root();
    let l = fs.symlink_as(&root(), r, "l", "x").unwrap().id;
    let p = fs
        .mknod_as(&root(), r, "p", S_IFIFO | 0o666, 0, true)
        .unwrap()
        .id;
    for id in [l, p] {
        assert_eq!(fs.setxattr_as(&root(), id, "user.a", "x", 0), Err(E::EPERM));
        assert_eq!(fs.getxattr_as(&root(), id, "user.a"), Err(E::ENODATA));
        fs.setxattr_as(&root(), id, "trusted.a", "x", 0).unwrap();
    }
    // In a sticky directory only the owner (and root) may write user xattrs.
    let t = fs.dir(r, "t");
    fs.chmod_as(&root(), t, 0o1777).unwrap();
    let alice = usr(ALICE);
    assert_eq!(fs.setxattr_as(&alice, t, "user.a", "x", 0), Err(E::EPERM));
    fs.setxattr_as(&root(), t, "user.a", "x", 0).unwrap();
    assert_eq!(fs.getxattr_as(&alice, t, "user.a").unwrap(), b"x");
    assert_eq!(fs.removexattr_as(&alice, t, "user.a"), Err(E::EPERM));
    fs.own(t, ALICE, ALICE, 0o1777);
    fs.removexattr_as(&alice, t, "user.a").unwrap();
    fs.check();
}

#[test]
fn xattr_argument_errors_come_first() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    let alice = usr(ALICE);
    let big = vec![0u8; XATTR_SIZE_MAX + 1];
    // setxattr copies flags, name and value in before it looks at the file.
    assert_eq!(
        fs.setxattr_as(&alice, f, "trusted.x", &big, 0),
        Err(E::E2BIG)
    );
    assert_eq!(
        fs.setxattr_as(&root(), r + 9, "user.x", &big, 0),
        Err(E::E2BIG)
    );
    assert_eq!(
        fs.setxattr_as(&root(), r + 9, format!("user.{}", "x".repeat(300)), "v", 0),
        Err(E::ERANGE)
    );
    assert_eq!(
        fs.setxattr_as(&root(), r + 9, "user.x", "v", 4),
        Err(E::EINVAL)
    );
    assert_eq!(
        fs.setxattr_as(&root(), r + 9, "user.x", "v", 0),
        Err(E::ENOENT)
    );
    assert_eq!(fs.getxattr_as(&root(), r + 9, "user.x"), Err(E::ENOENT));
    assert_eq!(fs.listxattr_as(&root(), r + 9), Err(E::ENOENT));
    assert_eq!(fs.removexattr_as(&root(), r + 9, "user.x"), Err(E::ENOENT));
    fs.check();
}

// ------------------------------------------------------------------------------------------
// access
// ------------------------------------------------------------------------------------------

#[test]
fn access_follows_the_permission_bits() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.own(f, ALICE, STAFF, 0o640);
    let (alice, member, other) = (usr(ALICE), usr_g(BOB, BOB, &[STAFF]), usr(CAROL));
    for c in [&alice, &member, &other, &root()] {
        assert_eq!(fs.access_as(c, f, F_OK), Ok(()), "F_OK needs nothing");
    }
    assert_eq!(fs.access_as(&alice, f, R_OK | W_OK), Ok(()));
    assert_eq!(fs.access_as(&alice, f, X_OK), Err(E::EACCES));
    assert_eq!(fs.access_as(&member, f, R_OK), Ok(()));
    assert_eq!(fs.access_as(&member, f, R_OK | W_OK), Err(E::EACCES));
    assert_eq!(fs.access_as(&other, f, R_OK), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o077).unwrap();
    assert_eq!(
        fs.access_as(&usr_g(ALICE, ALICE, &[STAFF]), f, R_OK),
        Err(E::EACCES),
        "the owner class wins"
    );
    assert_eq!(fs.access_as(&member, f, R_OK | W_OK | X_OK), Ok(()));
    // Root: read and write always; execute when anyone may execute (files), always (dirs).
    fs.chmod_as(&root(), f, 0o600).unwrap();
    assert_eq!(fs.access_as(&root(), f, R_OK | W_OK), Ok(()));
    assert_eq!(fs.access_as(&root(), f, X_OK), Err(E::EACCES));
    fs.chmod_as(&root(), f, 0o001).unwrap();
    assert_eq!(fs.access_as(&root(), f, R_OK | W_OK | X_OK), Ok(()));
    let d = fs.dir(r, "d");
    fs.chmod_as(&root(), d, 0o000).unwrap();
    assert_eq!(fs.access_as(&root(), d, R_OK | W_OK | X_OK), Ok(()));
    assert_eq!(fs.access_as(&alice, d, X_OK), Err(E::EACCES));
    assert_eq!(fs.access_as(&root(), f, 8), Err(E::EINVAL));
    assert_eq!(fs.access_as(&root(), r + 9, F_OK), Err(E::ENOENT));
}

// ------------------------------------------------------------------------------------------
// names
// ------------------------------------------------------------------------------------------

#[test]
fn name_rules_apply_to_every_operation() {
    let mut fs = Fs::new();
    let r = fs.root();
    let f = fs.file(r, "f");
    fs.dir(r, "d");
    let long = vec![b'x'; NAME_MAX + 1];
    let bad: [(&[u8], E); 5] = [
        (b"", E::ENOENT),
        (&long, E::ENAMETOOLONG),
        (b"a/b", E::EINVAL),
        (b"a\0b", E::EINVAL),
        (b"/", E::EINVAL),
    ];
    for (name, want) in bad {
        let ops = [
            Op::Lookup {
                parent: r,
                name: name.to_vec(),
            },
            Op::Mknod {
                parent: r,
                name: name.to_vec(),
                mode: FILE | 0o644,
                rdev: 0,
                exclusive: true,
            },
            Op::Mknod {
                parent: r,
                name: name.to_vec(),
                mode: FILE | 0o644,
                rdev: 0,
                exclusive: false,
            },
            Op::Mkdir {
                parent: r,
                name: name.to_vec(),
                mode: 0o755,
            },
            Op::Symlink {
                parent: r,
                name: name.to_vec(),
                target: b"t".to_vec(),
            },
            Op::Link {
                id: f,
                new_parent: r,
                new_name: name.to_vec(),
            },
            Op::Unlink {
                parent: r,
                name: name.to_vec(),
            },
            Op::Rmdir {
                parent: r,
                name: name.to_vec(),
            },
            Op::Rename {
                parent: r,
                name: name.to_vec(),
                new_parent: r,
                new_name: b"x".to_vec(),
                flags: 0,
            },
            Op::Rename {
                parent: r,
                name: b"f".to_vec(),
                new_parent: r,
                new_name: name.to_vec(),
                flags: 0,
            },
            Op::Rename {
                parent: r,
                name: b"d".to_vec(),
                new_parent: r,
                new_name: name.to_vec(),
                flags: RENAME_EXCHANGE,
            },
        ];
        for op in ops {
            match fs.exec(&root(), op.clone()) {
                Reply::Error(e) => assert_eq!(e.errno, want, "{op:?}"),
                other => panic!("{op:?} -> {other:?}"),
            }
        }
    }
    // 255 bytes are fine everywhere.
    let max = "y".repeat(NAME_MAX);
    let max2 = "z".repeat(NAME_MAX);
    let id = fs.create_as(&root(), r, &max, 0o644).unwrap().id;
    assert_eq!(fs.lookup(r, &max).unwrap().id, id);
    fs.link(id, r, &max2).unwrap();
    fs.unlink(r, &max2).unwrap();
    fs.rename(r, &max, r, &max2).unwrap();
    fs.unlink(r, &max2).unwrap();
    fs.mkdir_as(&root(), r, &max, 0o755).unwrap();
    fs.rmdir(r, &max).unwrap();
    fs.symlink_as(&root(), r, &max, "t").unwrap();
    // A missing source is reported before a bad target name.
    assert_eq!(fs.rename(r, "nope", r, &long), Err(E::ENOENT));
    fs.check();
}

#[test]
fn search_permission_is_checked_before_the_name() {
    // The VFS checks x on the directory while walking to the last component and only then
    // looks the name up (ext4_lookup gives ENAMETOOLONG); write permission comes later.
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let long = vec![b'x'; NAME_MAX + 1];
    let alice = usr(ALICE);
    fs.chmod_as(&root(), d, 0o666).unwrap();
    assert_eq!(fs.lookup_as(&alice, d, &long), Err(E::EACCES));
    assert_eq!(fs.mkdir_as(&alice, d, &long, 0o755), Err(E::EACCES));
    assert_eq!(fs.unlink_as(&alice, d, &long), Err(E::EACCES));
    fs.chmod_as(&root(), d, 0o755).unwrap();
    assert_eq!(fs.lookup_as(&alice, d, &long), Err(E::ENAMETOOLONG));
    assert_eq!(
        fs.mkdir_as(&alice, d, &long, 0o755),
        Err(E::ENAMETOOLONG),
        "before the missing write permission"
    );
    assert_eq!(fs.create_as(&alice, d, &long, 0o644), Err(E::ENAMETOOLONG));
    assert_eq!(fs.unlink_as(&alice, d, &long), Err(E::ENAMETOOLONG));
}

// ------------------------------------------------------------------------------------------
// ids that name nothing
// ------------------------------------------------------------------------------------------

#[test]
fn ids_that_name_nothing_give_enoent_everywhere() {
    let mut fs = Fs::new();
    let r = fs.root();
    let gone = fs.dir(r, "gone");
    fs.rmdir(r, "gone").unwrap();
    let f = fs.file(r, "f");
    for ghost in [
        gone,
        r + 4242,
        0,
        1,
        Region::TooDeep.base() + 3,
        Region::TooWide.base() + 3,
    ] {
        let name = b"x".to_vec();
        let ops = [
            Op::GetAttr { id: ghost },
            Op::SetAttr {
                id: ghost,
                set: SetAttrs {
                    mode: Some(0o644),
                    ..Default::default()
                },
            },
            Op::Readlink { id: ghost },
            Op::Readdir {
                id: ghost,
                cookie: 0,
                max_entries: 10,
                plus: false,
            },
            Op::SetXattr {
                id: ghost,
                name: b"user.a".to_vec(),
                value: b"v".to_vec(),
                flags: 0,
            },
            Op::GetXattr {
                id: ghost,
                name: b"user.a".to_vec(),
            },
            Op::ListXattr { id: ghost },
            Op::RemoveXattr {
                id: ghost,
                name: b"user.a".to_vec(),
            },
            Op::Access {
                id: ghost,
                mask: F_OK,
            },
            Op::Lookup {
                parent: ghost,
                name: name.clone(),
            },
            Op::Mknod {
                parent: ghost,
                name: name.clone(),
                mode: FILE | 0o644,
                rdev: 0,
                exclusive: true,
            },
            Op::Mknod {
                parent: ghost,
                name: name.clone(),
                mode: FILE | 0o644,
                rdev: 0,
                exclusive: false,
            },
            Op::Mkdir {
                parent: ghost,
                name: name.clone(),
                mode: 0o755,
            },
            Op::Symlink {
                parent: ghost,
                name: name.clone(),
                target: b"t".to_vec(),
            },
            Op::Link {
                id: ghost,
                new_parent: r,
                new_name: name.clone(),
            },
            Op::Link {
                id: f,
                new_parent: ghost,
                new_name: name.clone(),
            },
            Op::Unlink {
                parent: ghost,
                name: name.clone(),
            },
            Op::Rmdir {
                parent: ghost,
                name: name.clone(),
            },
            Op::Rename {
                parent: ghost,
                name: name.clone(),
                new_parent: r,
                new_name: b"y".to_vec(),
                flags: 0,
            },
            Op::Rename {
                parent: r,
                name: b"f".to_vec(),
                new_parent: ghost,
                new_name: b"y".to_vec(),
                flags: 0,
            },
        ];
        for op in ops {
            match fs.exec(&root(), op.clone()) {
                Reply::Error(e) => assert_eq!(e.errno, E::ENOENT, "{op:?}"),
                other => panic!("{op:?} -> {other:?}"),
            }
        }
    }
    fs.check();
}

// ------------------------------------------------------------------------------------------
// the id policy
// ------------------------------------------------------------------------------------------

/// Right shifts of the primary region's slots with the default widths [8, 7, 6, 6, 5, 5, 4]:
/// 21 bits are left for the files of a directory.
const SLOT_SHIFTS: [u32; 7] = [54, 47, 41, 35, 30, 25, 21];

#[test]
fn children_get_ids_next_to_their_directory() {
    let mut fs = Fs::new();
    let r = fs.root();
    assert_eq!(r, Region::Primary.base());
    assert_eq!(fs.file(r, "f1"), r + 1);
    assert_eq!(fs.file(r, "f2"), r + 2);
    let d = fs.dir(r, "d");
    assert_eq!(
        d,
        r + (16 << 54),
        "top-level directories are dealt across the 16 primary tables of 16 slot values: \
         the first takes the first value of table 1"
    );
    assert_eq!(fs.dir(r, "d2"), r + (32 << 54), "the second, table 2's");
    assert_eq!(
        fs.symlink_as(&root(), r, "l", "f1").unwrap().id,
        r + 3,
        "every non-directory is a file"
    );
    assert_eq!(
        fs.mknod_as(&root(), r, "p", S_IFIFO | 0o644, 0, true)
            .unwrap()
            .id,
        r + 4
    );
    assert_eq!(fs.file(d, "a"), d + 1);
    assert_eq!(fs.file(d, "b"), d + 2);
    let sub = fs.dir(d, "sub");
    assert_eq!(
        sub,
        d + (1 << 47),
        "below the top level the first subdirectory takes value 1 in its slot"
    );
    assert_eq!(fs.file(sub, "x"), sub + 1);
    // The whole subtree of d lies between d and its next sibling.
    let mut stack = vec![d];
    while let Some(dir) = stack.pop() {
        for e in fs
            .readdir_all_as(&root(), dir, 100, false)
            .unwrap()
            .into_iter()
            .skip(2)
        {
            assert!(
                d <= e.id && e.id < r + (17 << 54),
                "{:?} {:#x}",
                e.name,
                e.id
            );
            if e.kind == FileKind::Dir {
                stack.push(e.id);
            }
        }
    }
    fs.check();
}

#[test]
fn top_level_directories_are_dealt_across_the_primary_tables() {
    let mut fs = Fs::new();
    let r = fs.root();
    // 16 tables of 16 top-level slot values each; the root is value 0 of table 0.
    let table_of = |id: u64| ((id - r) >> 54) / 16;
    let tables: Vec<u64> = (0..32)
        .map(|i| table_of(fs.dir(r, format!("top{i}"))))
        .collect();
    let expected: Vec<u64> = (1..16).chain([0]).chain(1..16).chain([0]).collect();
    assert_eq!(tables, expected, "one per table, round after round");
    fs.check();
}

#[test]
fn deep_trees_overflow_into_the_too_deep_region() {
    let mut fs = Fs::new();
    let r = fs.root();
    let mut cur = r;
    for (level, shift) in SLOT_SHIFTS.into_iter().enumerate() {
        let next = fs.dir(cur, "n");
        // The top level is dealt across tables (the first goes to table 1, value 16).
        let value = if level == 0 { 16 } else { 1 };
        assert_eq!(next, cur + (value << shift));
        assert_eq!(Region::of(next), Region::Primary);
        cur = next;
    }
    // Eight levels down every primary slot is taken: a new root in the too-deep region,
    // whose 16-bit slot 0 numbers the roots, then 6, 6, 5, 5 bits per level and 24 file bits.
    let deep = fs.dir(cur, "n");
    assert_eq!(Region::of(deep), Region::TooDeep);
    assert_eq!(deep, Region::TooDeep.base() | (1 << 46));
    assert_eq!(fs.file(deep, "f"), deep + 1);
    let mut cur = deep;
    for shift in [40, 34, 29, 24] {
        let next = fs.dir(cur, "n");
        assert_eq!(next, cur + (1 << shift));
        cur = next;
    }
    let deeper = fs.dir(cur, "n");
    assert_eq!(
        deeper,
        Region::TooDeep.base() | (2 << 46),
        "the next too-deep root"
    );
    assert_eq!(fs.file(deeper, "f"), deeper + 1);
    assert_eq!(fs.lookup(deeper, "..").unwrap().id, cur);
    fs.check();
}

#[test]
fn full_directory_slots_overflow_and_freed_values_are_reused() {
    let mut fs = Fs::new();
    let r = fs.root();
    let mut cur = r;
    for _ in 0..6 {
        cur = fs.dir(cur, "n");
    }
    // The last slot has 4 bits: 15 subdirectories.
    for v in 1..=15u64 {
        assert_eq!(fs.dir(cur, format!("s{v}")), cur + (v << 21));
    }
    let over = fs.dir(cur, "s16");
    assert_eq!(Region::of(over), Region::TooDeep);
    fs.rmdir(cur, "s3").unwrap();
    // Removed ids are reused once their quarantine is over.
    fs.now += kochab_meta::engine::QUARANTINE_NS;
    assert_eq!(
        fs.dir(cur, "s3again"),
        cur + (3 << 21),
        "a freed value is taken again"
    );
    assert_eq!(Region::of(fs.dir(cur, "s17")), Region::TooDeep);
    fs.check();
}

#[test]
fn ids_of_deleted_files_come_back_once_the_directory_is_empty() {
    let mut fs = Fs::new();
    let r = fs.root();
    let d = fs.dir(r, "d");
    let ids: Vec<InodeId> = ["a", "b", "c"].iter().map(|n| fs.file(d, n)).collect();
    assert_eq!(ids, [d + 1, d + 2, d + 3]);
    let gen_a = fs.attr(d + 1).generation;
    fs.unlink(d, "b").unwrap();
    assert_eq!(
        fs.file(d, "x"),
        d + 4,
        "not while the directory has entries"
    );
    for n in ["a", "c", "x"] {
        fs.unlink(d, n).unwrap();
    }
    assert_eq!(
        fs.file(d, "early"),
        d + 5,
        "removed ids (d+1..=d+4) wait out their quarantine"
    );
    fs.unlink(d, "early").unwrap();
    fs.now += kochab_meta::engine::QUARANTINE_NS;
    assert_eq!(fs.file(d, "y"), d + 1, "an empty directory starts over");
    assert_eq!(fs.file(d, "z"), d + 2);
    assert_ne!(
        fs.attr(d + 1).generation,
        gen_a,
        "a reused id gets a new generation"
    );

    // An id still in use elsewhere is skipped.
    let e = fs.dir(r, "e");
    assert_eq!(fs.file(e, "m"), e + 1);
    fs.rename(e, "m", r, "m").unwrap();
    assert_eq!(fs.file(e, "n"), e + 2);

    // Removing the last subdirectory empties the directory too.
    let g = fs.dir(r, "g");
    fs.file(g, "f");
    fs.dir(g, "sub");
    fs.unlink(g, "f").unwrap();
    fs.rmdir(g, "sub").unwrap();
    fs.now += kochab_meta::engine::QUARANTINE_NS;
    assert_eq!(fs.file(g, "again"), g + 1);
    fs.check();
}

#[test]
fn a_full_file_range_borrows_the_next_siblings_range_then_the_too_wide_region() {
    // 54 slot bits leave 8 bits of files: 255 per directory.
    let cfg = EngineConfig {
        id_policy: IdPolicyConfig {
            primary_slots: vec![8, 23, 23],
            ..Default::default()
        },
        ..EngineConfig::with_key([1, 2])
    };
    let mut fs = Fs::with_config(cfg);
    fs.check_unchanged = false;
    let r = fs.root();
    // One level down: top-level slots are dealt across tables, so siblings there are not
    // handed out in order and have no range to lend.
    let top = fs.dir(r, "top");
    let d = fs.dir(top, "d");
    assert_eq!(d, top + (1 << 31));
    for i in 1..=255 {
        assert_eq!(fs.file(d, format!("f{i}")), d + i);
    }
    let sibling = top + (2 << 31);
    assert_eq!(
        fs.file(d, "f256"),
        sibling + 1,
        "the next sibling's file range"
    );
    assert_eq!(fs.file(d, "f257"), sibling + 2);
    assert_eq!(
        fs.dir(top, "d2"),
        top + (3 << 31),
        "that sibling's slot value is taken"
    );
    for i in 1..=255 {
        assert_eq!(fs.file(r, format!("r{i}")), r + i);
    }
    let wide = fs.file(r, "r256");
    assert_eq!(
        Region::of(wide),
        Region::TooWide,
        "the root has no sibling to borrow from"
    );
    let next = fs.file(r, "r257");
    assert_eq!(next, wide + 1);
    fs.check_unchanged = true;
    fs.check();
}
