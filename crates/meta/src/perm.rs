//! Permission checks, as the Linux VFS makes them. The server makes them itself because
//! clients are untrusted.

use crate::inode::Inode;
use kochab_proto::{Credentials, FsResult, access, fs_err, mode};

/// May `cred` access `inode` for `mask` (R_OK | W_OK | X_OK)? Root passes, except that
/// executing needs at least one x bit on a non-directory (as with CAP_DAC_OVERRIDE).
pub fn check_access(inode: &Inode, cred: &Credentials, mask: u32) -> FsResult<()> {
    if mask == 0 {
        return Ok(());
    }
    if cred.is_root() {
        if mask & access::X_OK != 0 && !inode.is_dir() && inode.mode & 0o111 == 0 {
            return Err(fs_err!(EACCES, "no execute bit for anyone"));
        }
        return Ok(());
    }
    let bits = if cred.uid == inode.uid {
        (inode.mode >> 6) & 7
    } else if cred.in_group(inode.gid) {
        (inode.mode >> 3) & 7
    } else {
        inode.mode & 7
    };
    if bits & mask == mask {
        Ok(())
    } else {
        Err(fs_err!(
            EACCES,
            "permission denied (mode {:o}, need {})",
            inode.mode & mode::PERM_MASK,
            mask_name(mask)
        ))
    }
}

fn mask_name(mask: u32) -> &'static str {
    match mask {
        1 => "x",
        2 => "w",
        3 => "wx",
        4 => "r",
        5 => "rx",
        6 => "rw",
        _ => "rwx",
    }
}

/// Is `cred` the owner (or root)? (inode_owner_or_capable)
pub fn is_owner(inode: &Inode, cred: &Credentials) -> bool {
    cred.is_root() || cred.uid == inode.uid
}

/// Sticky-directory rule: in a directory with S_ISVTX only the owner of the entry, the owner
/// of the directory or root may remove or rename it.
pub fn check_sticky(dir: &Inode, victim: &Inode, cred: &Credentials) -> FsResult<()> {
    if dir.mode & mode::S_ISVTX == 0
        || cred.is_root()
        || cred.uid == victim.uid
        || cred.uid == dir.uid
    {
        Ok(())
    } else {
        Err(fs_err!(
            EPERM,
            "sticky directory: only the owner may remove or rename this entry"
        ))
    }
}

/// Linux's protected_hardlinks rule (on by default): a user may hard-link a file only if
/// they own it or could open it for reading and writing, and it is a plain, non-setuid file.
pub fn check_may_link(inode: &Inode, cred: &Credentials) -> FsResult<()> {
    if is_owner(inode, cred) {
        return Ok(());
    }
    let setuid = inode.mode & mode::S_ISUID != 0;
    let setgid_exec =
        inode.mode & (mode::S_ISGID | mode::S_IXGRP) == (mode::S_ISGID | mode::S_IXGRP);
    if inode.is_regular()
        && !setuid
        && !setgid_exec
        && check_access(inode, cred, access::R_OK | access::W_OK).is_ok()
    {
        return Ok(());
    }
    Err(fs_err!(
        EPERM,
        "hard link to a file you neither own nor may read and write"
    ))
}
