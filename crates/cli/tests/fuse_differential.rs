//! Randomized differential test of the FUSE mount against ext4.
//!
//! A seeded random sequence of file-system calls runs both in a local directory (a temporary
//! directory on ext4) and at the same relative paths in a fresh Kochab mount. After every
//! step the results of the calls (return value or errno, bytes read) are compared, then both
//! trees: names, file types, modes, sizes (not of directories), contents, link counts,
//! symlink targets, extended attributes and which names share an inode. Differences that
//! exist by design are not compared: inode numbers, timestamps, st_blocks, the st_size of
//! directories; RENAME_WHITEOUT (not supported by the mount) is never generated.
//!
//! A small pool of names (six names, up to three levels) makes the calls collide often.
//! Open descriptors are kept across steps, so data is written through descriptors whose
//! name was unlinked, renamed or replaced meanwhile. Every `SERVER_VIEW_EVERY` steps and at
//! the end of each run the tree is also read straight from the servers with the native
//! client, so that the kernel's attribute and page caches cannot hide a server-side
//! difference.
//!
//! Not generated, with the reason: RENAME_WHITEOUT (by design); fallocate's COLLAPSE_RANGE
//! and INSERT_RANGE, O_TMPFILE (the kernel's FUSE layer or fuser 0.18 refuse them before
//! Kochab sees them); SEEK_DATA/SEEK_HOLE (without FUSE_LSEEK the kernel reports the whole
//! file as data, which POSIX allows, where ext4 reports its real holes); O_DIRECT (ext4
//! wants aligned buffers, the mount does not); locks (the fuse_basic tests cover them);
//! absolute symlink targets (they would name different files on the two sides); block
//! devices (opening one could write to a disk); keeping descriptors of anything but regular
//! files (see the KNOWN GAP in `Side::apply`).
//!
//! On a difference the test prints the seed, the step and the difference, then shrinks the
//! failing sequence by delta debugging (replaying it from scratch without chunks of steps,
//! down to single steps, keeping every removal that still shows a difference) and prints
//! the shortest sequence found before it panics.
//!
//! Environment: `KOCHAB_DIFF_SEED` (default: the clock; printed), `KOCHAB_DIFF_STEPS`
//! (default 10000), `KOCHAB_DIFF_SHRINK_SECS` (time allowed for shrinking, default 240),
//! `KOCHAB_DIFF_STORE=s3` (the cluster keeps its state and file data on the Ceph RGW that
//! `KOCHAB_S3_ENV` names, instead of a local directory; scripts/test.sh runs it so too).
//! The steps run as runs of `RUN_STEPS` steps, run `i` with seed `seed + i`, each in a fresh
//! directory of the same cluster; a failing run is replayed alone with its own seed.

mod common;

use common::{Cluster, errno_name};
use kochab_proto::Credentials;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::CString;
use std::fmt;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Steps of one run (a fresh directory, a fresh sequence).
const RUN_STEPS: usize = 1000;
/// The name pool.
const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
/// Descriptor slots kept open across steps.
const SLOTS: usize = 4;
/// Above this many names under the base directory, removals are favoured over creations.
const CROWDED: usize = 16;
/// Kochab's chunk size: writes near it cross a chunk boundary.
const CHUNK: u64 = kochab_proto::CHUNK_BYTES;
/// Every this many steps the servers' own view is compared too (and at the end of a run).
const SERVER_VIEW_EVERY: usize = 20;
/// A step that takes longer than this is a hang: the test reports it and exits.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------
// Random numbers

/// xorshift64, seeded through splitmix64 so that small seeds give unrelated sequences.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// Open flags: `access`, each of `bits` with its percent chance, O_EXCL with `excl` percent
/// when O_CREAT was picked, and O_NONBLOCK on a FIFO (which would otherwise block the open
/// until the other end opens).
fn open_flags(rng: &mut Rng, access: i32, bits: &[(u64, i32)], excl: u64, fifo: bool) -> i32 {
    let mut flags = access;
    for &(p, bit) in bits {
        if rng.chance(p) {
            flags |= bit;
        }
    }
    if flags & libc::O_CREAT != 0 && rng.chance(excl) {
        flags |= libc::O_EXCL;
    }
    if fifo {
        flags |= libc::O_NONBLOCK;
    }
    flags
}

/// The bytes a write with fill `fill` writes: reproducible from (fill, len).
fn fill_bytes(fill: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(fill);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&r.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

fn hash(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(0x100_0000_01b3);
        h = h.rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h ^ data.len() as u64
}

// ---------------------------------------------------------------------------------------
// Operations

/// One file-system call (or a short fixed sequence of them), with every argument concrete
/// so that a sequence can be replayed, shortened and printed. Paths are relative to the
/// base directory of a run; `slot` names a descriptor kept open across steps (an empty slot
/// makes an operation a no-op on both sides).
#[derive(Clone, Debug)]
enum Op {
    Open {
        slot: usize,
        path: String,
        flags: i32,
        mode: u32,
    },
    Close {
        slot: usize,
    },
    Write {
        slot: usize,
        len: usize,
        fill: u64,
    },
    Pwrite {
        slot: usize,
        off: u64,
        len: usize,
        fill: u64,
    },
    Read {
        slot: usize,
        len: usize,
    },
    Pread {
        slot: usize,
        off: u64,
        len: usize,
    },
    Seek {
        slot: usize,
        off: i64,
        whence: i32,
    },
    Ftruncate {
        slot: usize,
        size: i64,
    },
    Fallocate {
        slot: usize,
        mode: i32,
        off: i64,
        len: i64,
    },
    Fstat {
        slot: usize,
    },
    Fsync {
        slot: usize,
    },
    /// open + pwrite (or write, with O_APPEND) + close.
    Put {
        path: String,
        flags: i32,
        mode: u32,
        off: u64,
        len: usize,
        fill: u64,
    },
    Truncate {
        path: String,
        size: i64,
    },
    Mkdir {
        path: String,
        mode: u32,
    },
    Rmdir {
        path: String,
    },
    Unlink {
        path: String,
    },
    Rename {
        from: String,
        to: String,
        flags: u32,
    },
    Link {
        from: String,
        to: String,
        follow: bool,
    },
    Symlink {
        target: String,
        path: String,
    },
    Readlink {
        path: String,
    },
    Chmod {
        path: String,
        mode: u32,
    },
    Mknod {
        path: String,
        mode: u32,
        dev: u64,
    },
    SetXattr {
        path: String,
        name: String,
        len: usize,
        fill: u64,
        flags: i32,
        follow: bool,
    },
    RemoveXattr {
        path: String,
        name: String,
        follow: bool,
    },
    GetXattr {
        path: String,
        name: String,
        follow: bool,
    },
    Stat {
        path: String,
        follow: bool,
    },
    Chown {
        path: String,
        uid: u32,
        gid: u32,
        follow: bool,
    },
    Fchmod {
        slot: usize,
        mode: u32,
    },
    Fchown {
        slot: usize,
        uid: u32,
        gid: u32,
    },
    FSetXattr {
        slot: usize,
        name: String,
        len: usize,
        fill: u64,
        flags: i32,
    },
    FGetXattr {
        slot: usize,
        name: String,
    },
    /// Writes through a shared mapping of the descriptor (within the file's size), msync.
    MmapWrite {
        slot: usize,
        off: u64,
        len: usize,
        fill: u64,
    },
    /// Reads through a shared mapping (within the file's size).
    MmapRead {
        slot: usize,
        off: u64,
        len: usize,
    },
    /// copy_file_range between two slots (the same one included).
    CopyRange {
        from: usize,
        to: usize,
        off_in: i64,
        off_out: i64,
        len: usize,
    },
    /// rm -r: every call of a depth-first removal, stopping at the first failure.
    Rmrf {
        path: String,
    },
}

fn open_flags_str(flags: i32) -> String {
    let mut s = match flags & libc::O_ACCMODE {
        libc::O_RDONLY => "O_RDONLY".to_string(),
        libc::O_WRONLY => "O_WRONLY".to_string(),
        _ => "O_RDWR".to_string(),
    };
    for (bit, name) in [
        (libc::O_CREAT, "O_CREAT"),
        (libc::O_EXCL, "O_EXCL"),
        (libc::O_TRUNC, "O_TRUNC"),
        (libc::O_APPEND, "O_APPEND"),
        (libc::O_DIRECTORY, "O_DIRECTORY"),
        (libc::O_NOFOLLOW, "O_NOFOLLOW"),
        (libc::O_NONBLOCK, "O_NONBLOCK"),
        (libc::O_SYNC, "O_SYNC"),
    ] {
        if flags & bit != 0 {
            s.push('|');
            s.push_str(name);
        }
    }
    s
}

fn rename_flags_str(flags: u32) -> String {
    let mut parts = Vec::new();
    if flags & libc::RENAME_NOREPLACE != 0 {
        parts.push("RENAME_NOREPLACE");
    }
    if flags & libc::RENAME_EXCHANGE != 0 {
        parts.push("RENAME_EXCHANGE");
    }
    if parts.is_empty() {
        "0".into()
    } else {
        parts.join("|")
    }
}

fn falloc_str(mode: i32) -> String {
    let mut parts = Vec::new();
    for (bit, name) in [
        (libc::FALLOC_FL_KEEP_SIZE, "KEEP_SIZE"),
        (libc::FALLOC_FL_PUNCH_HOLE, "PUNCH_HOLE"),
        (libc::FALLOC_FL_ZERO_RANGE, "ZERO_RANGE"),
    ] {
        if mode & bit != 0 {
            parts.push(name);
        }
    }
    if parts.is_empty() {
        "0".into()
    } else {
        parts.join("|")
    }
}

fn xattr_flags_str(flags: i32) -> &'static str {
    match flags {
        0 => "0",
        libc::XATTR_CREATE => "XATTR_CREATE",
        libc::XATTR_REPLACE => "XATTR_REPLACE",
        _ => "?",
    }
}

fn whence_str(w: i32) -> &'static str {
    match w {
        libc::SEEK_SET => "SEEK_SET",
        libc::SEEK_CUR => "SEEK_CUR",
        _ => "SEEK_END",
    }
}

impl Op {
    /// The call's name, for the statistics.
    fn name(&self) -> &'static str {
        match self {
            Op::Open { .. } => "open",
            Op::Close { .. } => "close",
            Op::Write { .. } => "write",
            Op::Pwrite { .. } => "pwrite",
            Op::Read { .. } => "read",
            Op::Pread { .. } => "pread",
            Op::Seek { .. } => "lseek",
            Op::Ftruncate { .. } => "ftruncate",
            Op::Fallocate { .. } => "fallocate",
            Op::Fstat { .. } => "fstat",
            Op::Fsync { .. } => "fsync",
            Op::Put { .. } => "open+write+close",
            Op::Truncate { .. } => "truncate",
            Op::Mkdir { .. } => "mkdir",
            Op::Rmdir { .. } => "rmdir",
            Op::Unlink { .. } => "unlink",
            Op::Rename { flags: 0, .. } => "rename",
            Op::Rename { .. } => "renameat2",
            Op::Link { .. } => "link",
            Op::Symlink { .. } => "symlink",
            Op::Readlink { .. } => "readlink",
            Op::Chmod { .. } => "chmod",
            Op::Mknod { .. } => "mknod",
            Op::SetXattr { .. } => "setxattr",
            Op::RemoveXattr { .. } => "removexattr",
            Op::GetXattr { .. } => "getxattr",
            Op::Stat { .. } => "stat",
            Op::Rmrf { .. } => "rm -r",
            Op::Chown { .. } => "chown",
            Op::Fchmod { .. } => "fchmod",
            Op::Fchown { .. } => "fchown",
            Op::FSetXattr { .. } => "fsetxattr",
            Op::FGetXattr { .. } => "fgetxattr",
            Op::CopyRange { .. } => "copy_file_range",
            Op::MmapWrite { .. } => "mmap write",
            Op::MmapRead { .. } => "mmap read",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Open {
                slot,
                path,
                flags,
                mode,
            } => write!(
                f,
                "fd{slot} = open({path:?}, {}, 0o{mode:o})",
                open_flags_str(*flags)
            ),
            Op::Close { slot } => write!(f, "close(fd{slot})"),
            Op::Write { slot, len, fill } => write!(f, "write(fd{slot}, <{len} bytes #{fill}>)"),
            Op::Pwrite {
                slot,
                off,
                len,
                fill,
            } => write!(f, "pwrite(fd{slot}, <{len} bytes #{fill}>, {off})"),
            Op::Read { slot, len } => write!(f, "read(fd{slot}, {len})"),
            Op::Pread { slot, off, len } => write!(f, "pread(fd{slot}, {len}, {off})"),
            Op::Seek { slot, off, whence } => {
                write!(f, "lseek(fd{slot}, {off}, {})", whence_str(*whence))
            }
            Op::Ftruncate { slot, size } => write!(f, "ftruncate(fd{slot}, {size})"),
            Op::Fallocate {
                slot,
                mode,
                off,
                len,
            } => write!(
                f,
                "fallocate(fd{slot}, {}, {off}, {len})",
                falloc_str(*mode)
            ),
            Op::Fstat { slot } => write!(f, "fstat(fd{slot})"),
            Op::Fsync { slot } => write!(f, "fsync(fd{slot})"),
            Op::Put {
                path,
                flags,
                mode,
                off,
                len,
                fill,
            } => {
                if flags & libc::O_APPEND != 0 {
                    write!(
                        f,
                        "fd = open({path:?}, {}, 0o{mode:o}); write(fd, <{len} bytes #{fill}>); close(fd)",
                        open_flags_str(*flags)
                    )
                } else {
                    write!(
                        f,
                        "fd = open({path:?}, {}, 0o{mode:o}); pwrite(fd, <{len} bytes #{fill}>, {off}); close(fd)",
                        open_flags_str(*flags)
                    )
                }
            }
            Op::Truncate { path, size } => write!(f, "truncate({path:?}, {size})"),
            Op::Mkdir { path, mode } => write!(f, "mkdir({path:?}, 0o{mode:o})"),
            Op::Rmdir { path } => write!(f, "rmdir({path:?})"),
            Op::Unlink { path } => write!(f, "unlink({path:?})"),
            Op::Rename { from, to, flags } => {
                if *flags == 0 {
                    write!(f, "rename({from:?}, {to:?})")
                } else {
                    write!(
                        f,
                        "renameat2({from:?}, {to:?}, {})",
                        rename_flags_str(*flags)
                    )
                }
            }
            Op::Link { from, to, follow } => {
                if *follow {
                    write!(f, "linkat({from:?}, {to:?}, AT_SYMLINK_FOLLOW)")
                } else {
                    write!(f, "link({from:?}, {to:?})")
                }
            }
            Op::Symlink { target, path } => write!(f, "symlink({target:?}, {path:?})"),
            Op::Readlink { path } => write!(f, "readlink({path:?})"),
            Op::Chmod { path, mode } => write!(f, "chmod({path:?}, 0o{mode:o})"),
            Op::Mknod { path, mode, dev } => {
                write!(f, "mknod({path:?}, 0o{mode:o}, {dev:#x})")
            }
            Op::SetXattr {
                path,
                name,
                len,
                fill,
                flags,
                follow,
            } => write!(
                f,
                "{}setxattr({path:?}, {name:?}, <{len} bytes #{fill}>, {})",
                if *follow { "" } else { "l" },
                xattr_flags_str(*flags)
            ),
            Op::RemoveXattr { path, name, follow } => write!(
                f,
                "{}removexattr({path:?}, {name:?})",
                if *follow { "" } else { "l" }
            ),
            Op::GetXattr { path, name, follow } => write!(
                f,
                "{}getxattr({path:?}, {name:?})",
                if *follow { "" } else { "l" }
            ),
            Op::Stat { path, follow } => {
                write!(f, "{}stat({path:?})", if *follow { "" } else { "l" })
            }
            Op::Rmrf { path } => write!(f, "rm -r {path:?}"),
            Op::Chown {
                path,
                uid,
                gid,
                follow,
            } => write!(
                f,
                "{}chown({path:?}, {}, {})",
                if *follow { "" } else { "l" },
                *uid as i32,
                *gid as i32
            ),
            Op::Fchmod { slot, mode } => write!(f, "fchmod(fd{slot}, 0o{mode:o})"),
            Op::Fchown { slot, uid, gid } => {
                write!(f, "fchown(fd{slot}, {}, {})", *uid as i32, *gid as i32)
            }
            Op::FSetXattr {
                slot,
                name,
                len,
                fill,
                flags,
            } => write!(
                f,
                "fsetxattr(fd{slot}, {name:?}, <{len} bytes #{fill}>, {})",
                xattr_flags_str(*flags)
            ),
            Op::FGetXattr { slot, name } => write!(f, "fgetxattr(fd{slot}, {name:?})"),
            Op::MmapWrite {
                slot,
                off,
                len,
                fill,
            } => write!(
                f,
                "p = mmap(fd{slot}, MAP_SHARED, PROT_READ|PROT_WRITE); copy <{len} bytes #{fill}> to p[{off}..] (up to the size); msync(MS_SYNC); munmap"
            ),
            Op::MmapRead { slot, off, len } => write!(
                f,
                "p = mmap(fd{slot}, MAP_SHARED, PROT_READ); read p[{off}..{off}+{len}] (up to the size); munmap"
            ),
            Op::CopyRange {
                from,
                to,
                off_in,
                off_out,
                len,
            } => write!(
                f,
                "copy_file_range(fd{from}, &{off_in}, fd{to}, &{off_out}, {len}, 0)"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Results

/// What a call returned. Compared for equality between the two sides.
#[derive(Clone, PartialEq, Eq)]
enum Res {
    /// The descriptor slot was empty: nothing was called.
    Skip,
    Ok(i64),
    /// The call that failed and its errno.
    Err(&'static str, i32),
    Data(Vec<u8>),
    Stat(StatSum),
}

/// The attributes compared by stat-like calls.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StatSum {
    mode: u32,
    uid: u32,
    gid: u32,
    /// None for directories (their size differs by design).
    size: Option<u64>,
    nlink: u64,
    rdev: u64,
}

impl StatSum {
    fn of(md: &fs::Metadata) -> StatSum {
        let dir = md.mode() & libc::S_IFMT == libc::S_IFDIR;
        StatSum {
            mode: md.mode(),
            uid: md.uid(),
            gid: md.gid(),
            size: (!dir).then(|| md.size()),
            nlink: md.nlink(),
            rdev: md.rdev(),
        }
    }
}

impl fmt::Debug for Res {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Res::Skip => write!(f, "(empty slot)"),
            Res::Ok(v) => write!(f, "{v}"),
            Res::Err(call, e) => write!(f, "{call}: {}", errno_name(*e)),
            Res::Data(d) if d.len() <= 16 => write!(f, "{d:?}"),
            Res::Data(d) => write!(f, "<{} bytes, hash {:016x}>", d.len(), hash(d)),
            Res::Stat(s) => write!(
                f,
                "{{mode 0o{:o}, owner {}:{}, size {:?}, nlink {}, rdev {:#x}}}",
                s.mode, s.uid, s.gid, s.size, s.nlink, s.rdev
            ),
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A syscall's return value as a result: negative means errno.
fn ret(r: i64, call: &'static str) -> Res {
    if r < 0 {
        Res::Err(call, errno())
    } else {
        Res::Ok(r)
    }
}

fn io_err(call: &'static str, e: &std::io::Error) -> Res {
    Res::Err(call, e.raw_os_error().unwrap_or(-1))
}

/// The first byte where two buffers differ (or the shorter length).
fn first_difference(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

fn describe_results(a: &Res, b: &Res) -> String {
    let mut s = format!("ext4 returned {a:?}, kochab returned {b:?}");
    if let (Res::Data(x), Res::Data(y)) = (a, b) {
        let at = first_difference(x, y);
        s += &format!(
            " (lengths {} and {}, first difference at byte {at})",
            x.len(),
            y.len()
        );
    }
    s
}

// ---------------------------------------------------------------------------------------
// One side: a directory and its open descriptors

/// Where a run lives on one side: `<root>/run<N>` (the compared tree) holds `u/t`, the base
/// of the relative paths. Symlink targets climb at most two levels, so whatever they reach
/// (and create) is inside `run<N>`, the same on both sides, and compared.
struct Side {
    top: PathBuf,
    base: String,
    fds: [i32; SLOTS],
}

fn cpath(s: &str) -> CString {
    CString::new(s.as_bytes()).expect("no NUL in paths")
}

impl Side {
    fn create(root: &Path, run: u64) -> Side {
        let top = root.join(format!("run{run}"));
        let base = top.join("u/t");
        fs::create_dir_all(&base).expect("create the run directory");
        Side {
            top,
            base: base.to_str().expect("utf8 path").to_string(),
            fds: [-1; SLOTS],
        }
    }

    fn full(&self, rel: &str) -> String {
        if rel.is_empty() {
            self.base.clone()
        } else {
            format!("{}/{rel}", self.base)
        }
    }

    fn path(&self, rel: &str) -> CString {
        cpath(&self.full(rel))
    }

    fn close_slot(&mut self, slot: usize) -> Res {
        let fd = std::mem::replace(&mut self.fds[slot], -1);
        if fd < 0 {
            return Res::Skip;
        }
        // SAFETY: a descriptor this side opened and still owns.
        ret(unsafe { libc::close(fd) } as i64, "close")
    }

    /// Closes every slot; the results, slot by slot.
    fn close_all(&mut self) -> Vec<Res> {
        (0..SLOTS).map(|s| self.close_slot(s)).collect()
    }

    /// Closes everything and removes the run's tree (best effort).
    fn dispose(mut self) {
        self.close_all();
        let _ = fs::remove_dir_all(&self.top);
    }

    /// The descriptor open in `slot`, if any.
    fn fd(&self, slot: usize) -> Option<i32> {
        Some(self.fds[slot]).filter(|&fd| fd >= 0)
    }

    fn apply(&mut self, op: &Op) -> Res {
        // SAFETY (all the libc calls below): valid NUL-terminated paths, descriptors this
        // side owns, and buffers at least as long as the lengths passed.
        unsafe {
            match op {
                Op::Open {
                    slot,
                    path,
                    flags,
                    mode,
                } => {
                    self.close_slot(*slot);
                    let fd = libc::open(
                        self.path(path).as_ptr(),
                        *flags | libc::O_CLOEXEC,
                        *mode as libc::c_uint,
                    );
                    if fd < 0 {
                        return Res::Err("open", errno());
                    }
                    let mut st: libc::stat = std::mem::zeroed();
                    if libc::fstat(fd, &mut st) < 0 {
                        let e = errno();
                        libc::close(fd);
                        return Res::Err("fstat after open", e);
                    }
                    let kind = st.st_mode & libc::S_IFMT;
                    if kind != libc::S_IFREG {
                        // KNOWN GAP: the servers keep an unlinked inode only while it has
                        // open handles; files and directories get handles, but the kernel
                        // opens FIFOs and devices itself, so one whose last name goes while
                        // a descriptor is open on it vanishes (fstat, fchmod... fail where
                        // ext4 answers with nlink 0). Only descriptors of regular files are
                        // kept here (open directories: fuse_conformance.rs).
                        libc::close(fd);
                    } else {
                        self.fds[*slot] = fd;
                    }
                    Res::Ok(kind as i64)
                }
                Op::Close { slot } => self.close_slot(*slot),
                Op::Write { slot, len, fill } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let buf = fill_bytes(*fill, *len);
                    ret(
                        libc::write(fd, buf.as_ptr().cast(), buf.len()) as i64,
                        "write",
                    )
                }
                Op::Pwrite {
                    slot,
                    off,
                    len,
                    fill,
                } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let buf = fill_bytes(*fill, *len);
                    ret(
                        libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), *off as i64) as i64,
                        "pwrite",
                    )
                }
                Op::Read { slot, len } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let mut buf = vec![0u8; *len];
                    let r = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                    if r < 0 {
                        return Res::Err("read", errno());
                    }
                    buf.truncate(r as usize);
                    Res::Data(buf)
                }
                Op::Pread { slot, off, len } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let mut buf = vec![0u8; *len];
                    let r = libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), *off as i64);
                    if r < 0 {
                        return Res::Err("pread", errno());
                    }
                    buf.truncate(r as usize);
                    Res::Data(buf)
                }
                Op::Seek { slot, off, whence } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::lseek(fd, *off, *whence), "lseek")
                }
                Op::Ftruncate { slot, size } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::ftruncate(fd, *size) as i64, "ftruncate")
                }
                Op::Fallocate {
                    slot,
                    mode,
                    off,
                    len,
                } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::fallocate(fd, *mode, *off, *len) as i64, "fallocate")
                }
                Op::Fstat { slot } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let mut st: libc::stat = std::mem::zeroed();
                    if libc::fstat(fd, &mut st) < 0 {
                        return Res::Err("fstat", errno());
                    }
                    let dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
                    Res::Stat(StatSum {
                        mode: st.st_mode,
                        uid: st.st_uid,
                        gid: st.st_gid,
                        size: (!dir).then_some(st.st_size as u64),
                        nlink: st.st_nlink,
                        rdev: st.st_rdev,
                    })
                }
                Op::Fsync { slot } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::fsync(fd) as i64, "fsync")
                }
                Op::Put {
                    path,
                    flags,
                    mode,
                    off,
                    len,
                    fill,
                } => {
                    let fd = libc::open(
                        self.path(path).as_ptr(),
                        *flags | libc::O_CLOEXEC,
                        *mode as libc::c_uint,
                    );
                    if fd < 0 {
                        return Res::Err("open", errno());
                    }
                    let buf = fill_bytes(*fill, *len);
                    let w = if flags & libc::O_APPEND != 0 {
                        ret(
                            libc::write(fd, buf.as_ptr().cast(), buf.len()) as i64,
                            "write",
                        )
                    } else {
                        ret(
                            libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), *off as i64) as i64,
                            "pwrite",
                        )
                    };
                    let c = ret(libc::close(fd) as i64, "close");
                    match (w, c) {
                        (Res::Ok(n), Res::Ok(_)) => Res::Ok(n),
                        (Res::Ok(_), c) => c,
                        (w, _) => w,
                    }
                }
                Op::Truncate { path, size } => ret(
                    libc::truncate(self.path(path).as_ptr(), *size) as i64,
                    "truncate",
                ),
                Op::Mkdir { path, mode } => {
                    ret(libc::mkdir(self.path(path).as_ptr(), *mode) as i64, "mkdir")
                }
                Op::Rmdir { path } => ret(libc::rmdir(self.path(path).as_ptr()) as i64, "rmdir"),
                Op::Unlink { path } => ret(libc::unlink(self.path(path).as_ptr()) as i64, "unlink"),
                Op::Rename { from, to, flags } => ret(
                    libc::renameat2(
                        libc::AT_FDCWD,
                        self.path(from).as_ptr(),
                        libc::AT_FDCWD,
                        self.path(to).as_ptr(),
                        *flags,
                    ) as i64,
                    "renameat2",
                ),
                Op::Link { from, to, follow } => ret(
                    libc::linkat(
                        libc::AT_FDCWD,
                        self.path(from).as_ptr(),
                        libc::AT_FDCWD,
                        self.path(to).as_ptr(),
                        if *follow { libc::AT_SYMLINK_FOLLOW } else { 0 },
                    ) as i64,
                    "linkat",
                ),
                Op::Symlink { target, path } => ret(
                    libc::symlink(cpath(target).as_ptr(), self.path(path).as_ptr()) as i64,
                    "symlink",
                ),
                Op::Readlink { path } => {
                    let mut buf = vec![0u8; 4096];
                    let r = libc::readlink(self.path(path).as_ptr(), buf.as_mut_ptr().cast(), 4096);
                    if r < 0 {
                        return Res::Err("readlink", errno());
                    }
                    buf.truncate(r as usize);
                    Res::Data(buf)
                }
                Op::Chmod { path, mode } => {
                    ret(libc::chmod(self.path(path).as_ptr(), *mode) as i64, "chmod")
                }
                Op::Mknod { path, mode, dev } => ret(
                    libc::mknod(self.path(path).as_ptr(), *mode, *dev) as i64,
                    "mknod",
                ),
                Op::SetXattr {
                    path,
                    name,
                    len,
                    fill,
                    flags,
                    follow,
                } => {
                    let value = fill_bytes(*fill, *len);
                    let f = if *follow {
                        libc::setxattr
                    } else {
                        libc::lsetxattr
                    };
                    ret(
                        f(
                            self.path(path).as_ptr(),
                            cpath(name).as_ptr(),
                            value.as_ptr().cast(),
                            value.len(),
                            *flags,
                        ) as i64,
                        "setxattr",
                    )
                }
                Op::RemoveXattr { path, name, follow } => {
                    let f = if *follow {
                        libc::removexattr
                    } else {
                        libc::lremovexattr
                    };
                    ret(
                        f(self.path(path).as_ptr(), cpath(name).as_ptr()) as i64,
                        "removexattr",
                    )
                }
                Op::GetXattr { path, name, follow } => {
                    let f = if *follow {
                        libc::getxattr
                    } else {
                        libc::lgetxattr
                    };
                    let mut buf = vec![0u8; 65536];
                    let r = f(
                        self.path(path).as_ptr(),
                        cpath(name).as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    );
                    if r < 0 {
                        return Res::Err("getxattr", errno());
                    }
                    buf.truncate(r as usize);
                    Res::Data(buf)
                }
                Op::Stat { path, follow } => {
                    let p = self.full(path);
                    let md = if *follow {
                        fs::metadata(&p)
                    } else {
                        fs::symlink_metadata(&p)
                    };
                    match md {
                        Ok(md) => Res::Stat(StatSum::of(&md)),
                        Err(e) => io_err("stat", &e),
                    }
                }
                Op::Chown {
                    path,
                    uid,
                    gid,
                    follow,
                } => {
                    let f = if *follow { libc::chown } else { libc::lchown };
                    ret(f(self.path(path).as_ptr(), *uid, *gid) as i64, "chown")
                }
                Op::Fchmod { slot, mode } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::fchmod(fd, *mode) as i64, "fchmod")
                }
                Op::Fchown { slot, uid, gid } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    ret(libc::fchown(fd, *uid, *gid) as i64, "fchown")
                }
                Op::FSetXattr {
                    slot,
                    name,
                    len,
                    fill,
                    flags,
                } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let value = fill_bytes(*fill, *len);
                    ret(
                        libc::fsetxattr(
                            fd,
                            cpath(name).as_ptr(),
                            value.as_ptr().cast(),
                            value.len(),
                            *flags,
                        ) as i64,
                        "fsetxattr",
                    )
                }
                Op::FGetXattr { slot, name } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let mut buf = vec![0u8; 65536];
                    let r = libc::fgetxattr(
                        fd,
                        cpath(name).as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    );
                    if r < 0 {
                        return Res::Err("fgetxattr", errno());
                    }
                    buf.truncate(r as usize);
                    Res::Data(buf)
                }
                Op::MmapWrite {
                    slot,
                    off,
                    len,
                    fill,
                } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let data = fill_bytes(*fill, *len);
                    map_range(fd, *off, *len, true, |m| {
                        m.copy_from_slice(&data[..m.len()]);
                    })
                }
                Op::MmapRead { slot, off, len } => {
                    let Some(fd) = self.fd(*slot) else {
                        return Res::Skip;
                    };
                    let mut out = Vec::new();
                    match map_range(fd, *off, *len, false, |m| out = m.to_vec()) {
                        Res::Ok(_) => Res::Data(out),
                        r => r,
                    }
                }
                Op::CopyRange {
                    from,
                    to,
                    off_in,
                    off_out,
                    len,
                } => {
                    let (a, b) = (self.fds[*from], self.fds[*to]);
                    if a < 0 || b < 0 {
                        return Res::Skip;
                    }
                    let (mut oi, mut oo) = (*off_in, *off_out);
                    ret(
                        libc::copy_file_range(a, &mut oi, b, &mut oo, *len, 0) as i64,
                        "copy_file_range",
                    )
                }
                Op::Rmrf { path } => {
                    let mut n = 0;
                    match rmrf(Path::new(&self.full(path)), &mut n) {
                        Ok(()) => Res::Ok(n),
                        Err(r) => r,
                    }
                }
            }
        }
    }
}

/// Maps the part of `[off, off + len)` that lies within the file's size (shared; writable if
/// `write`), hands it to `f`, then msyncs (if writing) and unmaps. The bytes mapped, or the
/// failing call.
fn map_range(fd: i32, off: u64, len: usize, write: bool, f: impl FnOnce(&mut [u8])) -> Res {
    // SAFETY: fstat/mmap/msync/munmap on a descriptor this side owns; the slice covers only
    // mapped bytes below the file's size (nothing else changes the file meanwhile).
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) < 0 {
            return Res::Err("fstat", errno());
        }
        let size = st.st_size as u64;
        let end = (off + len as u64).min(size);
        if end <= off {
            return Res::Ok(0);
        }
        let start = off & !4095;
        let maplen = (end - start) as usize;
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let p = libc::mmap(
            std::ptr::null_mut(),
            maplen,
            prot,
            libc::MAP_SHARED,
            fd,
            start as i64,
        );
        if p == libc::MAP_FAILED {
            return Res::Err("mmap", errno());
        }
        let within = (off - start) as usize;
        let bytes = std::slice::from_raw_parts_mut((p as *mut u8).add(within), maplen - within);
        f(bytes);
        let mut r = Res::Ok((end - off) as i64);
        if write && libc::msync(p, maplen, libc::MS_SYNC) < 0 {
            r = Res::Err("msync", errno());
        }
        libc::munmap(p, maplen);
        r
    }
}

/// Depth-first removal with std's calls; the first failure ends it.
fn rmrf(p: &Path, n: &mut i64) -> Result<(), Res> {
    let md = fs::symlink_metadata(p).map_err(|e| io_err("lstat", &e))?;
    if md.is_dir() {
        let mut names: Vec<_> = fs::read_dir(p)
            .map_err(|e| io_err("opendir", &e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| io_err("readdir", &e))?;
        names.sort();
        for name in names {
            rmrf(&p.join(name), n)?;
        }
        fs::remove_dir(p).map_err(|e| io_err("rmdir", &e))?;
    } else {
        fs::remove_file(p).map_err(|e| io_err("unlink", &e))?;
    }
    *n += 1;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Trees

/// What is compared of one name.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    mode: u32,
    uid: u32,
    gid: u32,
    /// None for directories.
    size: Option<u64>,
    nlink: u64,
    rdev: u64,
    target: Option<Vec<u8>>,
    /// Length and hash of a regular file's contents.
    content: Option<(u64, u64)>,
    xattrs: Xattrs,
    /// The first name (in walk order) of the same inode, for every further hard link.
    same_as: Option<String>,
    /// A call of the walk that failed here.
    error: Option<String>,
}

/// Every name under a run's top directory ("" is the top itself), by relative path.
type Tree = BTreeMap<String, Node>;

fn snapshot(top: &Path) -> Tree {
    let mut tree = Tree::new();
    let mut inodes = HashMap::new();
    walk(top, String::new(), &mut tree, &mut inodes);
    tree
}

/// Extended attributes: (name, value), sorted by name.
type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

fn xattrs_of(p: &Path) -> Result<Xattrs, String> {
    let c = cpath(p.to_str().expect("utf8"));
    let mut list = vec![0u8; 65536];
    // SAFETY: valid path and buffer of the given length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
    if n < 0 {
        return Err(format!("llistxattr: {}", errno_name(errno())));
    }
    list.truncate(n as usize);
    let mut names: Vec<&[u8]> = list.split(|&b| b == 0).filter(|s| !s.is_empty()).collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let cn = CString::new(name).expect("no NUL");
        let mut v = vec![0u8; 65536];
        // SAFETY: valid path, name and buffer of the given length.
        let r = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if r < 0 {
            return Err(format!(
                "lgetxattr {}: {}",
                String::from_utf8_lossy(name),
                errno_name(errno())
            ));
        }
        v.truncate(r as usize);
        out.push((name.to_vec(), v));
    }
    Ok(out)
}

fn walk(p: &Path, rel: String, tree: &mut Tree, inodes: &mut HashMap<u64, String>) {
    let mut node = Node {
        mode: 0,
        uid: 0,
        gid: 0,
        size: None,
        nlink: 0,
        rdev: 0,
        target: None,
        content: None,
        xattrs: Vec::new(),
        same_as: None,
        error: None,
    };
    let md = match fs::symlink_metadata(p) {
        Ok(md) => md,
        Err(e) => {
            node.error = Some(format!("lstat: {e}"));
            tree.insert(rel, node);
            return;
        }
    };
    let kind = md.mode() & libc::S_IFMT;
    node.mode = md.mode();
    node.uid = md.uid();
    node.gid = md.gid();
    node.nlink = md.nlink();
    node.rdev = md.rdev();
    if kind != libc::S_IFDIR {
        node.size = Some(md.size());
        let first = inodes.entry(md.ino()).or_insert_with(|| rel.clone());
        if *first != rel {
            node.same_as = Some(first.clone());
        }
    }
    match xattrs_of(p) {
        Ok(x) => node.xattrs = x,
        Err(e) => node.error = Some(e),
    }
    match kind {
        libc::S_IFLNK => match fs::read_link(p) {
            Ok(t) => node.target = Some(t.as_os_str().as_bytes().to_vec()),
            Err(e) => node.error = Some(format!("readlink: {e}")),
        },
        libc::S_IFREG => match fs::read(p) {
            Ok(d) => node.content = Some((d.len() as u64, hash(&d))),
            Err(e) => node.error = Some(format!("read: {e}")),
        },
        libc::S_IFDIR => {
            let names = fs::read_dir(p).and_then(|rd| {
                rd.map(|e| e.map(|e| e.file_name()))
                    .collect::<Result<Vec<_>, _>>()
            });
            match names {
                Ok(mut names) => {
                    names.sort();
                    tree.insert(rel.clone(), node);
                    for name in names {
                        let name = name.to_str().expect("utf8 name").to_string();
                        let child = if rel.is_empty() {
                            name.clone()
                        } else {
                            format!("{rel}/{name}")
                        };
                        walk(&p.join(&name), child, tree, inodes);
                    }
                    return;
                }
                Err(e) => node.error = Some(format!("readdir: {e}")),
            }
        }
        _ => {}
    }
    tree.insert(rel, node);
}

fn kind_name(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "fifo",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "char device",
        libc::S_IFBLK => "block device",
        _ => "?",
    }
}

/// The differences between the ext4 tree `a` and the Kochab tree `b`, one line each.
/// `b_top` is where `b` can be read again to find where contents differ (None for the
/// servers' own view).
fn diff_trees(a: &Tree, b: &Tree, a_top: &Path, b_top: Option<&Path>) -> Vec<String> {
    let mut out = Vec::new();
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for k in keys {
        let shown = if k.is_empty() { "." } else { k.as_str() };
        match (a.get(k), b.get(k)) {
            (Some(x), None) => out.push(format!("{shown}: only on ext4 ({})", kind_name(x.mode))),
            (None, Some(y)) => out.push(format!("{shown}: only on kochab ({})", kind_name(y.mode))),
            (Some(x), Some(y)) if x != y => {
                let mut d = Vec::new();
                if x.mode != y.mode {
                    d.push(format!("mode 0o{:o} vs 0o{:o}", x.mode, y.mode));
                }
                if (x.uid, x.gid) != (y.uid, y.gid) {
                    d.push(format!("owner {}:{} vs {}:{}", x.uid, x.gid, y.uid, y.gid));
                }
                if x.size != y.size {
                    d.push(format!("size {:?} vs {:?}", x.size, y.size));
                }
                if x.nlink != y.nlink {
                    d.push(format!("nlink {} vs {}", x.nlink, y.nlink));
                }
                if x.rdev != y.rdev {
                    d.push(format!("rdev {:#x} vs {:#x}", x.rdev, y.rdev));
                }
                if x.target != y.target {
                    d.push(format!(
                        "symlink target {:?} vs {:?}",
                        x.target.as_deref().map(String::from_utf8_lossy),
                        y.target.as_deref().map(String::from_utf8_lossy)
                    ));
                }
                if x.content != y.content {
                    let ca = fs::read(a_top.join(k));
                    let cb = b_top.map(|t| fs::read(t.join(k)));
                    match (ca, cb) {
                        (Ok(ca), Some(Ok(cb))) => d.push(format!(
                            "contents differ (lengths {} and {}, first difference at byte {})",
                            ca.len(),
                            cb.len(),
                            first_difference(&ca, &cb)
                        )),
                        _ => d.push(format!("contents {:?} vs {:?}", x.content, y.content)),
                    }
                }
                if x.xattrs != y.xattrs {
                    let show = |v: &[(Vec<u8>, Vec<u8>)]| {
                        v.iter()
                            .map(|(n, v)| {
                                format!("{}=<{} bytes>", String::from_utf8_lossy(n), v.len())
                            })
                            .collect::<Vec<_>>()
                            .join(",")
                    };
                    d.push(format!(
                        "xattrs [{}] vs [{}]",
                        show(&x.xattrs),
                        show(&y.xattrs)
                    ));
                }
                if x.same_as != y.same_as {
                    d.push(format!("hard link of {:?} vs {:?}", x.same_as, y.same_as));
                }
                if x.error != y.error {
                    d.push(format!("walk error {:?} vs {:?}", x.error, y.error));
                }
                out.push(format!(
                    "{shown} ({}): {} (ext4 vs kochab)",
                    kind_name(x.mode),
                    d.join("; ")
                ));
            }
            _ => {}
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The generator

/// What the generator knows: the names under the base directory (from the last ext4 tree)
/// and which descriptor slots are open.
struct Model {
    entries: Vec<(String, u32)>,
    dirs: Vec<String>,
    open: [bool; SLOTS],
    /// The ext4 base directory, to look at what a path resolves to.
    local_base: String,
}

impl Model {
    fn new(tree: &Tree, side: &Side) -> Model {
        let mut entries = Vec::new();
        let mut dirs = vec![String::new()];
        for (k, n) in tree {
            let Some(rel) = k.strip_prefix("u/t/") else {
                continue;
            };
            let kind = n.mode & libc::S_IFMT;
            entries.push((rel.to_string(), kind));
            if kind == libc::S_IFDIR {
                dirs.push(rel.to_string());
            }
        }
        Model {
            entries,
            dirs,
            open: side.fds.map(|fd| fd >= 0),
            local_base: side.base.clone(),
        }
    }

    fn existing(&self, rng: &mut Rng) -> String {
        if self.entries.is_empty() {
            return self.fresh(rng);
        }
        rng.pick(&self.entries).0.clone()
    }

    fn existing_where(&self, rng: &mut Rng, kind: u32) -> String {
        let of: Vec<&String> = self
            .entries
            .iter()
            .filter(|(_, k)| *k == kind)
            .map(|(p, _)| p)
            .collect();
        if of.is_empty() {
            self.any(rng)
        } else {
            rng.pick(&of).to_string()
        }
    }

    /// A new name in an existing directory not deeper than the pool's three levels.
    fn fresh(&self, rng: &mut Rng) -> String {
        let shallow: Vec<&String> = self
            .dirs
            .iter()
            .filter(|d| d.is_empty() || d.split('/').count() < 3)
            .collect();
        let d = rng.pick(&shallow);
        let n = rng.pick(&NAMES);
        if d.is_empty() {
            n.to_string()
        } else {
            format!("{d}/{n}")
        }
    }

    fn random_path(rng: &mut Rng) -> String {
        let depth = 1 + rng.below(3);
        (0..depth)
            .map(|_| *rng.pick(&NAMES))
            .collect::<Vec<_>>()
            .join("/")
    }

    /// Paths with dots and slashes that the VFS treats specially.
    fn weird(&self, rng: &mut Rng) -> String {
        let e = self.existing(rng);
        let d = rng.pick(&self.dirs).clone();
        match rng.below(9) {
            7 => "n".repeat(255),
            8 => "n".repeat(256),
            0 => ".".into(),
            1 => format!("{e}/"),
            2 => format!("{e}/."),
            3 => format!("./{e}"),
            4 if !d.is_empty() => format!("{d}/.."),
            5 => format!("{e}/{}", rng.pick(&NAMES)),
            _ => format!("{e}//"),
        }
    }

    fn any(&self, rng: &mut Rng) -> String {
        match rng.below(100) {
            0..=44 => self.existing(rng),
            45..=84 => self.fresh(rng),
            85..=94 => Model::random_path(rng),
            _ => self.weird(rng),
        }
    }

    /// Mostly names that can have user attributes (regular files and directories).
    fn xattr_path(&self, rng: &mut Rng) -> String {
        match rng.below(10) {
            0..=3 => self.existing_where(rng, libc::S_IFREG),
            4..=6 => self.existing_where(rng, libc::S_IFDIR),
            _ => self.any(rng),
        }
    }

    /// True if `rel` resolves (following symlinks) to a FIFO on ext4.
    fn is_fifo(&self, rel: &str) -> bool {
        let p = if rel.is_empty() {
            self.local_base.clone()
        } else {
            format!("{}/{rel}", self.local_base)
        };
        fs::metadata(p).is_ok_and(|m| m.mode() & libc::S_IFMT == libc::S_IFIFO)
    }

    fn open_slot(&self, rng: &mut Rng) -> Option<usize> {
        let open: Vec<usize> = (0..SLOTS).filter(|&s| self.open[s]).collect();
        (!open.is_empty()).then(|| *rng.pick(&open))
    }
}

fn offset(rng: &mut Rng) -> u64 {
    match rng.below(1000) {
        0..=599 => rng.below(4096),
        600..=849 => rng.below(20_000),
        850..=989 => rng.below(70_000),
        // Around a chunk boundary of the object store.
        _ => CHUNK - 8 + rng.below(16),
    }
}

fn length(rng: &mut Rng) -> usize {
    (match rng.below(1000) {
        0..=49 => 0,
        50..=699 => 1 + rng.below(200),
        700..=949 => rng.below(5000),
        950..=994 => rng.below(70_000),
        // Larger than one FUSE request (1 MiB): split, and sent in parallel.
        _ => (1 << 20) + rng.below(2 << 20),
    }) as usize
}

fn size(rng: &mut Rng) -> i64 {
    if rng.chance(15) {
        0
    } else if rng.chance(2) {
        -1
    } else {
        offset(rng) as i64
    }
}

const FILE_MODES: [u32; 9] = [
    0o644, 0o600, 0o755, 0o777, 0o000, 0o4755, 0o2644, 0o1755, 0o6711,
];
const DIR_MODES: [u32; 8] = [0o755, 0o700, 0o777, 0o1777, 0o2755, 0o000, 0o555, 0o3775];
const CHMOD_MODES: [u32; 12] = [
    0o644, 0o755, 0o600, 0o000, 0o777, 0o4755, 0o2755, 0o1777, 0o6711, 0o444, 0o2775, 0o7777,
];

fn xattr_name(rng: &mut Rng) -> String {
    match rng.below(100) {
        0..=89 => format!("user.{}", rng.pick(&["a", "b"])),
        90..=94 => "trusted.t".into(),
        95..=96 => "security.s".into(),
        97 => "user.".into(),
        _ => "other.x".into(),
    }
}

fn symlink_target(rng: &mut Rng) -> String {
    match rng.below(100) {
        0..=4 => ".".into(),
        5..=7 => format!("{}/", rng.pick(&NAMES)),
        8 => "l".repeat(4095),
        9 => "l".repeat(4096),
        _ => {
            let ups = match rng.below(10) {
                0..=6 => 0,
                7..=8 => 1,
                _ => 2,
            };
            let names = 1 + rng.below(2);
            let mut t = "../".repeat(ups);
            t += &(0..names)
                .map(|_| *rng.pick(&NAMES))
                .collect::<Vec<_>>()
                .join("/");
            t
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Open,
    Close,
    Write,
    Pwrite,
    Read,
    Pread,
    Seek,
    Ftruncate,
    Fallocate,
    Fstat,
    Fsync,
    Put,
    Truncate,
    Mkdir,
    Rmdir,
    Unlink,
    Rename,
    Link,
    Symlink,
    Readlink,
    Chmod,
    Mknod,
    SetXattr,
    RemoveXattr,
    GetXattr,
    Stat,
    Rmrf,
    Chown,
    Fchmod,
    Fchown,
    FSetXattr,
    FGetXattr,
    CopyRange,
    MmapWrite,
    MmapRead,
}

fn generate(rng: &mut Rng, m: &Model) -> Op {
    use Kind::*;
    let crowded = m.entries.len() > CROWDED;
    // (weight, weight when crowded, kind)
    let table: [(u64, u64, Kind); 35] = [
        (9, 6, Open),
        (4, 4, Close),
        (6, 6, Write),
        (7, 7, Pwrite),
        (3, 3, Read),
        (3, 3, Pread),
        (2, 2, Seek),
        (4, 4, Ftruncate),
        (4, 4, Fallocate),
        (2, 2, Fstat),
        (1, 1, Fsync),
        (8, 4, Put),
        (3, 3, Truncate),
        (7, 2, Mkdir),
        (4, 8, Rmdir),
        (6, 14, Unlink),
        (11, 11, Rename),
        (4, 1, Link),
        (4, 1, Symlink),
        (1, 1, Readlink),
        (3, 3, Chmod),
        (2, 1, Mknod),
        (3, 3, SetXattr),
        (2, 2, RemoveXattr),
        (1, 1, GetXattr),
        (2, 2, Stat),
        (1, 5, Rmrf),
        (2, 2, Chown),
        (1, 1, Fchmod),
        (1, 1, Fchown),
        (2, 2, FSetXattr),
        (1, 1, FGetXattr),
        (2, 2, CopyRange),
        (2, 2, MmapWrite),
        (1, 1, MmapRead),
    ];
    let total: u64 = table.iter().map(|t| if crowded { t.1 } else { t.0 }).sum();
    let mut roll = rng.below(total);
    let mut kind = Open;
    for t in table {
        let w = if crowded { t.1 } else { t.0 };
        if roll < w {
            kind = t.2;
            break;
        }
        roll -= w;
    }
    // Descriptor operations need an open slot; without one, open something.
    let slot = m.open_slot(rng);
    let fd_op = matches!(
        kind,
        Close
            | Write
            | Pwrite
            | Read
            | Pread
            | Seek
            | Ftruncate
            | Fallocate
            | Fstat
            | Fsync
            | Fchmod
            | Fchown
            | FSetXattr
            | FGetXattr
            | CopyRange
            | MmapWrite
            | MmapRead
    );
    if fd_op && slot.is_none() {
        kind = Open;
    }
    let slot = slot.unwrap_or(0);
    match kind {
        Open => {
            let path = match rng.below(10) {
                0..=5 => m.existing_where(rng, libc::S_IFREG),
                _ => m.any(rng),
            };
            let access = *rng.pick(&[libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR, libc::O_RDWR]);
            let bits = [
                (60, libc::O_CREAT),
                (20, libc::O_TRUNC),
                (20, libc::O_APPEND),
                (3, libc::O_DIRECTORY),
                (5, libc::O_NOFOLLOW),
                (3, libc::O_SYNC),
            ];
            let flags = open_flags(rng, access, &bits, 20, m.is_fifo(&path));
            let free: Vec<usize> = (0..SLOTS).filter(|&s| !m.open[s]).collect();
            let slot = if free.is_empty() || rng.chance(20) {
                rng.below(SLOTS as u64) as usize
            } else {
                *rng.pick(&free)
            };
            Op::Open {
                slot,
                path,
                flags,
                mode: *rng.pick(&FILE_MODES),
            }
        }
        Close => Op::Close { slot },
        Write => Op::Write {
            slot,
            len: length(rng),
            fill: rng.next(),
        },
        Pwrite => Op::Pwrite {
            slot,
            off: offset(rng),
            len: length(rng),
            fill: rng.next(),
        },
        Read => Op::Read {
            slot,
            len: length(rng),
        },
        Pread => Op::Pread {
            slot,
            off: offset(rng),
            len: length(rng),
        },
        Seek => {
            let whence = *rng.pick(&[libc::SEEK_SET, libc::SEEK_CUR, libc::SEEK_END]);
            let off = if rng.chance(50) {
                rng.below(10_000) as i64
            } else {
                rng.below(10_000) as i64 - 5_000
            };
            Op::Seek { slot, off, whence }
        }
        Ftruncate => Op::Ftruncate {
            slot,
            size: size(rng),
        },
        Fallocate => {
            let mode = *rng.pick(&[
                0,
                0,
                libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_ZERO_RANGE,
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE,
            ]);
            // KNOWN GAP (not Kochab's): FALLOC_FL_COLLAPSE_RANGE and FALLOC_FL_INSERT_RANGE
            // are refused by the kernel's FUSE layer itself (EOPNOTSUPP) before any file
            // system sees them; ext4 supports them. Not generated.
            let len = if rng.chance(3) {
                0
            } else {
                1 + rng.below(10_000) as i64
            };
            Op::Fallocate {
                slot,
                mode,
                off: if rng.chance(2) {
                    -1
                } else {
                    offset(rng) as i64
                },
                len,
            }
        }
        Fstat => Op::Fstat { slot },
        Fsync => Op::Fsync { slot },
        Put => {
            let path = match rng.below(10) {
                0..=4 => m.existing_where(rng, libc::S_IFREG),
                _ => m.any(rng),
            };
            let access = *rng.pick(&[libc::O_WRONLY, libc::O_RDWR]);
            let bits = [
                (85, libc::O_CREAT),
                (30, libc::O_TRUNC),
                (20, libc::O_APPEND),
            ];
            let flags = open_flags(rng, access, &bits, 10, m.is_fifo(&path));
            Op::Put {
                path,
                flags,
                mode: *rng.pick(&FILE_MODES),
                off: offset(rng),
                len: length(rng),
                fill: rng.next(),
            }
        }
        Truncate => Op::Truncate {
            path: if rng.chance(70) {
                m.existing_where(rng, libc::S_IFREG)
            } else {
                m.any(rng)
            },
            size: size(rng),
        },
        Mkdir => Op::Mkdir {
            path: if rng.chance(85) {
                m.fresh(rng)
            } else {
                m.any(rng)
            },
            mode: *rng.pick(&DIR_MODES),
        },
        Rmdir => Op::Rmdir {
            path: if rng.chance(70) {
                m.existing_where(rng, libc::S_IFDIR)
            } else {
                m.any(rng)
            },
        },
        Unlink => Op::Unlink {
            path: if rng.chance(80) {
                m.existing(rng)
            } else {
                m.any(rng)
            },
        },
        Rename => {
            let from = if rng.chance(85) {
                m.existing(rng)
            } else {
                m.any(rng)
            };
            let to = match rng.below(100) {
                // A directory into its own subtree.
                0..=5 => format!("{from}/{}", rng.pick(&NAMES)),
                // Onto an ancestor.
                6..=9 if from.contains('/') => from
                    .rsplit_once('/')
                    .map(|(d, _)| d.to_string())
                    .unwrap_or_default(),
                10..=54 => m.existing(rng),
                _ => m.any(rng),
            };
            // RENAME_WHITEOUT is not supported by the mount (by design): not generated.
            let flags = match rng.below(100) {
                0..=64 => 0,
                65..=79 => libc::RENAME_NOREPLACE,
                80..=97 => libc::RENAME_EXCHANGE,
                _ => libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE,
            };
            Op::Rename { from, to, flags }
        }
        Link => Op::Link {
            from: if rng.chance(85) {
                m.existing(rng)
            } else {
                m.any(rng)
            },
            to: if rng.chance(80) {
                m.fresh(rng)
            } else {
                m.any(rng)
            },
            follow: rng.chance(20),
        },
        Symlink => Op::Symlink {
            target: symlink_target(rng),
            path: if rng.chance(85) {
                m.fresh(rng)
            } else {
                m.any(rng)
            },
        },
        Readlink => Op::Readlink {
            path: if rng.chance(70) {
                m.existing_where(rng, libc::S_IFLNK)
            } else {
                m.any(rng)
            },
        },
        Chmod => Op::Chmod {
            path: m.any(rng),
            mode: *rng.pick(&CHMOD_MODES),
        },
        Mknod => {
            let (kind, dev) = match rng.below(100) {
                0..=74 => (libc::S_IFIFO, 0),
                75..=84 => (libc::S_IFSOCK, 0),
                85..=89 => (libc::S_IFREG, 0),
                // /dev/null and /dev/zero: harmless if opened.
                90..=97 => (libc::S_IFCHR, *rng.pick(&[0x103u64, 0x105])),
                _ => (libc::S_IFDIR, 0),
            };
            Op::Mknod {
                path: if rng.chance(85) {
                    m.fresh(rng)
                } else {
                    m.any(rng)
                },
                mode: kind | *rng.pick(&FILE_MODES),
                dev,
            }
        }
        SetXattr => Op::SetXattr {
            path: m.xattr_path(rng),
            name: xattr_name(rng),
            // ext4 keeps an inode's attributes in one block: stay well below 4 KiB in all.
            len: if rng.chance(5) {
                rng.below(1000) as usize
            } else {
                rng.below(40) as usize
            },
            fill: rng.next(),
            flags: *rng.pick(&[0, 0, 0, libc::XATTR_CREATE, libc::XATTR_REPLACE]),
            follow: rng.chance(60),
        },
        RemoveXattr => Op::RemoveXattr {
            path: m.xattr_path(rng),
            name: xattr_name(rng),
            follow: rng.chance(60),
        },
        GetXattr => Op::GetXattr {
            path: m.xattr_path(rng),
            name: xattr_name(rng),
            follow: rng.chance(60),
        },
        Stat => Op::Stat {
            path: m.any(rng),
            follow: rng.chance(50),
        },
        Chown => Op::Chown {
            path: m.any(rng),
            uid: *rng.pick(&[0, 1000, 65534, u32::MAX]),
            gid: *rng.pick(&[0, 100, 1000, u32::MAX]),
            follow: rng.chance(50),
        },
        Fchmod => Op::Fchmod {
            slot,
            mode: *rng.pick(&CHMOD_MODES),
        },
        Fchown => Op::Fchown {
            slot,
            uid: *rng.pick(&[0, 1000, u32::MAX]),
            gid: *rng.pick(&[0, 100, u32::MAX]),
        },
        FSetXattr => Op::FSetXattr {
            slot,
            name: xattr_name(rng),
            len: rng.below(40) as usize,
            fill: rng.next(),
            flags: *rng.pick(&[0, 0, libc::XATTR_CREATE, libc::XATTR_REPLACE]),
        },
        FGetXattr => Op::FGetXattr {
            slot,
            name: xattr_name(rng),
        },
        CopyRange => Op::CopyRange {
            from: slot,
            to: m.open_slot(rng).unwrap_or(slot),
            off_in: offset(rng) as i64,
            off_out: offset(rng) as i64,
            len: length(rng),
        },
        MmapWrite => Op::MmapWrite {
            slot,
            off: offset(rng),
            len: length(rng),
            fill: rng.next(),
        },
        MmapRead => Op::MmapRead {
            slot,
            off: offset(rng),
            len: length(rng),
        },
        Rmrf => Op::Rmrf {
            path: if rng.chance(80) {
                m.existing_where(rng, libc::S_IFDIR)
            } else {
                m.existing(rng)
            },
        },
    }
}

// ---------------------------------------------------------------------------------------
// Running sequences

/// The servers' view of a tree, read with the native client: what the mount shows could be
/// the kernel's caches.
struct ServerView {
    client: kochab_client::Client,
    rt: tokio::runtime::Runtime,
}

impl ServerView {
    fn connect(cluster: &Cluster) -> ServerView {
        let rt = common::runtime();
        let client = rt.block_on(cluster.server.client(3));
        ServerView { client, rt }
    }

    /// The tree under the root's entry `top`, as `snapshot` makes it of a directory.
    fn snapshot(&self, top: &str) -> Result<Tree, String> {
        self.rt.block_on(server_tree(&self.client, top))
    }
}

async fn server_tree(c: &kochab_client::Client, top: &str) -> Result<Tree, String> {
    let cred = Credentials::root();
    let top = c
        .lookup(&cred, c.root(), top.as_bytes())
        .await
        .map_err(|e| format!("native lookup of {top}: {e}"))?;
    let mut tree = Tree::new();
    let mut inodes: HashMap<u64, String> = HashMap::new();
    // Depth first in name order, as `walk` goes (so hard links pair up the same way).
    let mut stack = vec![(String::new(), top.id)];
    while let Some((rel, id)) = stack.pop() {
        let fail = |what: &str, e: kochab_proto::FsError| format!("native {what} of {rel:?}: {e}");
        let a = c.getattr(&cred, id).await.map_err(|e| fail("getattr", e))?;
        let kind = a.mode & libc::S_IFMT;
        let mut node = Node {
            mode: a.mode,
            uid: a.uid,
            gid: a.gid,
            size: (kind != libc::S_IFDIR).then_some(a.size),
            nlink: a.nlink as u64,
            rdev: a.rdev as u64,
            target: None,
            content: None,
            xattrs: Vec::new(),
            same_as: None,
            error: None,
        };
        if kind != libc::S_IFDIR {
            let first = inodes.entry(id).or_insert_with(|| rel.clone());
            if *first != rel {
                node.same_as = Some(first.clone());
            }
        }
        let list = c
            .listxattr(&cred, id)
            .await
            .map_err(|e| fail("listxattr", e))?;
        let mut names: Vec<&[u8]> = list.split(|&b| b == 0).filter(|n| !n.is_empty()).collect();
        names.sort();
        for n in names {
            let v = c
                .getxattr(&cred, id, n)
                .await
                .map_err(|e| fail("getxattr", e))?;
            node.xattrs.push((n.to_vec(), v));
        }
        match kind {
            libc::S_IFLNK => {
                node.target = Some(
                    c.readlink(&cred, id)
                        .await
                        .map_err(|e| fail("readlink", e))?,
                )
            }
            libc::S_IFREG => {
                let (_, h) = c.open(&cred, id, 0).await.map_err(|e| fail("open", e))?;
                let mut data = Vec::new();
                loop {
                    let b = c
                        .read(&cred, h, data.len() as u64, 1 << 20)
                        .await
                        .map_err(|e| fail("read", e))?;
                    if b.is_empty() {
                        break;
                    }
                    data.extend_from_slice(&b);
                }
                c.close(&cred, h).await.map_err(|e| fail("close", e))?;
                node.content = Some((data.len() as u64, hash(&data)));
            }
            libc::S_IFDIR => {
                let mut entries = c
                    .readdir_all(&cred, id, false)
                    .await
                    .map_err(|e| fail("readdir", e))?;
                entries.sort_by(|x, y| y.name.cmp(&x.name));
                for e in entries {
                    let name = String::from_utf8(e.name).expect("utf8 name");
                    let child = if rel.is_empty() {
                        name
                    } else {
                        format!("{rel}/{name}")
                    };
                    stack.push((child, e.id));
                }
            }
            _ => {}
        }
        tree.insert(rel, node);
    }
    Ok(tree)
}

/// A cluster with its mount, and the local directory next to it.
struct Env {
    view: Rc<ServerView>,
    // Fields drop in order: the cluster (and its mount) goes before the directory.
    cluster: Cluster,
    local: PathBuf,
    runs: u64,
    _tmp: tempfile::TempDir,
}

impl Env {
    fn start() -> Env {
        let tmp = tempfile::tempdir().expect("tempdir");
        // Device nodes are compared with ext4's, so this mount opts in to them (mounts are
        // nodev by default).
        let mut args = vec!["--mount-options".to_string(), "dev".to_string()];
        if std::env::var("KOCHAB_DIFF_STORE").as_deref() == Ok("s3") {
            let (env_file, location) =
                common::s3::rgw_location("diff").expect("KOCHAB_DIFF_STORE=s3 needs an RGW");
            args.extend([
                "--store".to_string(),
                location.to_string(),
                "--store-env".to_string(),
                env_file.display().to_string(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let cluster = Cluster::start(tmp.path(), &args);
        let local = tmp.path().join("local");
        fs::create_dir_all(&local).expect("local dir");
        WATCHED_PID.store(cluster.server.child.id() as u64, Ordering::SeqCst);
        *WATCHED_MNT.lock().unwrap() = Some(cluster.mnt.clone());
        Env {
            view: Rc::new(ServerView::connect(&cluster)),
            cluster,
            local,
            runs: 0,
            _tmp: tmp,
        }
    }

    fn sides(&mut self) -> Runner {
        let run = self.runs;
        self.runs += 1;
        let local = Side::create(&self.local, run);
        let kochab = Side::create(&self.cluster.mnt, run);
        let mut r = Runner {
            local,
            kochab,
            tree: Tree::new(),
            view: self.view.clone(),
            steps: 0,
        };
        r.tree = snapshot(&r.local.top);
        r
    }
}

/// Both sides of one run.
struct Runner {
    local: Side,
    kochab: Side,
    /// The ext4 tree after the last step.
    tree: Tree,
    view: Rc<ServerView>,
    /// Steps whose trees were compared.
    steps: usize,
}

impl Runner {
    /// Applies `op` on both sides and compares the results, then (if `trees`) the trees.
    fn step(&mut self, op: &Op, trees: bool) -> Result<(), String> {
        note_progress(op);
        let a = self.local.apply(op);
        let b = self.kochab.apply(op);
        count(op, &a);
        if a != b {
            return Err(describe_results(&a, &b));
        }
        if trees {
            self.compare_trees()?;
            self.steps += 1;
            if self.steps.is_multiple_of(SERVER_VIEW_EVERY) {
                self.compare_server_view()?;
            }
        }
        Ok(())
    }

    /// Compares the servers' own view of the run's tree with the last ext4 tree.
    fn compare_server_view(&self) -> Result<(), String> {
        let top = self.local.top.file_name().expect("run name");
        let tb = self.view.snapshot(top.to_str().expect("utf8"))?;
        let d = diff_trees(&self.tree, &tb, &self.local.top, None);
        if d.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the servers' own view (native client, no kernel caches) differs:\n      {}",
                d.join("\n      ")
            ))
        }
    }

    fn compare_trees(&mut self) -> Result<(), String> {
        let ta = snapshot(&self.local.top);
        let tb = snapshot(&self.kochab.top);
        let d = diff_trees(&ta, &tb, &self.local.top, Some(&self.kochab.top));
        NAMES_COMPARED.fetch_add(ta.len() as u64, Ordering::Relaxed);
        self.tree = ta;
        if d.is_empty() {
            Ok(())
        } else {
            Err(format!("the trees differ:\n      {}", d.join("\n      ")))
        }
    }

    /// Closes every descriptor on both sides (comparing the results) and compares the trees.
    fn finish(&mut self) -> Result<(), String> {
        let a = self.local.close_all();
        let b = self.kochab.close_all();
        if a != b {
            return Err(format!(
                "closing the descriptors left open: ext4 {a:?}, kochab {b:?}"
            ));
        }
        self.compare_trees()?;
        self.compare_server_view()
    }

    fn dispose(self) {
        self.local.dispose();
        self.kochab.dispose();
    }

    fn model(&self) -> Model {
        Model::new(&self.tree, &self.local)
    }
}

/// A sequence that showed a difference at its last step.
struct Failure {
    ops: Vec<Op>,
    what: String,
}

/// Runs `ops` from scratch on fresh directories; the first difference, if any. With
/// `every_step`, trees are compared after every step, else only results are, and the trees
/// at the end (cheaper, for long candidates while shrinking).
fn replay(env: &mut Env, ops: &[Op], every_step: bool) -> Option<Failure> {
    let mut r = env.sides();
    let mut failure = None;
    for (i, op) in ops.iter().enumerate() {
        if let Err(what) = r.step(op, every_step) {
            failure = Some(Failure {
                ops: ops[..=i].to_vec(),
                what,
            });
            break;
        }
    }
    if failure.is_none()
        && let Err(what) = r.finish()
    {
        failure = Some(Failure {
            ops: ops.to_vec(),
            what: format!("{what} (found after the last step)"),
        });
    }
    r.dispose();
    failure
}

/// One random run of `steps` steps with `seed`.
fn random_run(env: &mut Env, seed: u64, steps: usize) -> Result<(), (usize, Failure)> {
    let mut rng = Rng::new(seed);
    let mut r = env.sides();
    let mut ops = Vec::with_capacity(steps);
    let mut result = Ok(());
    for i in 0..steps {
        let op = generate(&mut rng, &r.model());
        ops.push(op);
        if let Err(what) = r.step(ops.last().expect("pushed"), true) {
            result = Err((
                i,
                Failure {
                    ops: std::mem::take(&mut ops),
                    what,
                },
            ));
            break;
        }
    }
    if result.is_ok()
        && let Err(what) = r.finish()
    {
        result = Err((
            steps,
            Failure {
                ops,
                what: format!("{what} (after closing every descriptor at the end of the run)"),
            },
        ));
    }
    r.dispose();
    result
}

/// Delta debugging: removes chunks of steps (halving the chunk size down to single steps,
/// then single steps until none can go) while the rest still shows a difference, as
/// `check` replays it from scratch; returns the shortest failing sequence found.
fn shrink(
    check: &mut dyn FnMut(&[Op], bool) -> Option<Failure>,
    failing: Failure,
    deadline: Instant,
) -> Failure {
    let mut cur = failing;
    let mut chunk = cur.ops.len().div_ceil(2).max(1);
    let mut replays = 0u32;
    'outer: loop {
        let mut removed = false;
        let mut i = 0;
        while i < cur.ops.len() {
            if Instant::now() > deadline {
                eprintln!("  (shrinking stopped at its deadline)");
                break 'outer;
            }
            let end = (i + chunk).min(cur.ops.len());
            let cand: Vec<Op> = cur.ops[..i]
                .iter()
                .chain(&cur.ops[end..])
                .cloned()
                .collect();
            replays += 1;
            // Long candidates compare only results after every step (and trees at the end).
            match check(&cand, cand.len() <= 300) {
                Some(f) => {
                    cur = f;
                    removed = true;
                }
                None => i += chunk,
            }
        }
        if chunk == 1 && !removed {
            break;
        }
        chunk = chunk.div_ceil(2).min(cur.ops.len().div_ceil(2)).max(1);
    }
    eprintln!("  ({replays} replays)");
    // Find the first failing step of the result with trees compared after every step.
    match check(&cur.ops, true) {
        Some(f) => f,
        None => cur,
    }
}

fn print_ops(ops: &[Op]) {
    for (i, op) in ops.iter().enumerate() {
        eprintln!("    {i:>5}: {op}");
    }
}

// ---------------------------------------------------------------------------------------
// Hang detection

static PROGRESS: AtomicU64 = AtomicU64::new(0);
static WATCHED_PID: AtomicU64 = AtomicU64::new(0);
static WATCHED_MNT: Mutex<Option<PathBuf>> = Mutex::new(None);
static CURRENT: Mutex<String> = Mutex::new(String::new());
/// Per call: how often it succeeded, failed (by errno) or found its slot empty; and the
/// number of names compared, summed over steps (printed at the end, to see the coverage).
static STATS: Mutex<BTreeMap<String, [u64; 3]>> = Mutex::new(BTreeMap::new());
static NAMES_COMPARED: AtomicU64 = AtomicU64::new(0);

fn count(op: &Op, r: &Res) {
    let call = op.name();
    let i = match r {
        Res::Skip => 2,
        Res::Err(..) => 1,
        _ => 0,
    };
    STATS.lock().unwrap().entry(call.to_string()).or_default()[i] += 1;
}

fn note_progress(op: &Op) {
    PROGRESS.fetch_add(1, Ordering::SeqCst);
    *CURRENT.lock().unwrap() = op.to_string();
}

/// If no step starts for `STEP_TIMEOUT`, a call hangs: say which, kill the server (which
/// fails the hung call), unmount and exit.
fn start_watchdog(context: String) {
    std::thread::spawn(move || {
        let mut last = u64::MAX;
        let mut since = Instant::now();
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let now = PROGRESS.load(Ordering::SeqCst);
            if now != last {
                last = now;
                since = Instant::now();
                continue;
            }
            if since.elapsed() > STEP_TIMEOUT {
                eprintln!(
                    "fuse_differential: HANG: no progress for {STEP_TIMEOUT:?} in `{}` ({context})",
                    CURRENT.lock().unwrap()
                );
                let pid = WATCHED_PID.load(Ordering::SeqCst) as i32;
                if pid > 0 {
                    // SAFETY: kill(2) of the server process this test started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                if let Some(m) = WATCHED_MNT.lock().unwrap().clone() {
                    common::force_unmount(&m);
                }
                std::process::exit(1);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------
// The test

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[test]
fn random_calls_behave_as_on_ext4() {
    // Modes are compared as asked for, so no umask.
    // SAFETY: umask(2) only changes this process's file mode creation mask.
    unsafe { libc::umask(0) };
    let steps = env_u64("KOCHAB_DIFF_STEPS").unwrap_or(10_000) as usize;
    let seed = env_u64("KOCHAB_DIFF_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let shrink_secs = env_u64("KOCHAB_DIFF_SHRINK_SECS").unwrap_or(240);
    eprintln!(
        "fuse_differential: seed {seed}, {steps} steps (rerun with KOCHAB_DIFF_SEED={seed} KOCHAB_DIFF_STEPS={steps})"
    );
    start_watchdog(format!("seed {seed}"));
    let mut env = Env::start();
    let started = Instant::now();
    let mut done = 0;
    let mut run = 0u64;
    while done < steps {
        let n = (steps - done).min(RUN_STEPS);
        let run_seed = seed.wrapping_add(run);
        if let Err((at, failure)) = random_run(&mut env, run_seed, n) {
            report(&mut env, run_seed, done, at, failure, shrink_secs);
        }
        done += n;
        run += 1;
    }
    let took = started.elapsed();
    let stats = STATS.lock().unwrap();
    let line: Vec<String> = stats
        .iter()
        .map(|(k, [ok, err, _])| format!("{k} {ok}/{err}"))
        .collect();
    eprintln!(
        "fuse_differential: calls (succeeded/failed): {}; {:.1} names per compared tree",
        line.join(", "),
        NAMES_COMPARED.load(Ordering::Relaxed) as f64 / steps as f64
    );
    eprintln!(
        "fuse_differential: {steps} steps in {} runs matched ext4 in {:.1} s ({:.0} steps/s)",
        run,
        took.as_secs_f64(),
        steps as f64 / took.as_secs_f64().max(1e-9)
    );
}

/// Prints the difference and its shrunk reproduction, then panics.
fn report(env: &mut Env, run_seed: u64, done: usize, at: usize, failure: Failure, secs: u64) -> ! {
    let last = failure
        .ops
        .last()
        .map(|o| o.to_string())
        .unwrap_or_default();
    eprintln!(
        "\nfuse_differential: DIFFERENCE in the run with seed {run_seed} at its step {at} (step {} overall)",
        done + at
    );
    eprintln!("  call: {last}");
    eprintln!("  {}", failure.what);
    eprintln!(
        "  rerun just this run with KOCHAB_DIFF_SEED={run_seed} KOCHAB_DIFF_STEPS={}",
        at + 1
    );
    let tail = failure.ops.len().saturating_sub(30);
    eprintln!("  the last steps before it:");
    for (i, op) in failure.ops.iter().enumerate().skip(tail) {
        eprintln!("    {i:>5}: {op}");
    }
    eprintln!("\nfuse_differential: shrinking (delta debugging, at most {secs} s)...");
    let deadline = Instant::now() + Duration::from_secs(secs);
    let original = failure.what.clone();
    let shrunk = if let Some(f) = replay(env, &failure.ops, true) {
        Some(shrink(
            &mut |ops, every| replay(env, ops, every),
            f,
            deadline,
        ))
    } else {
        // Perhaps it needs a cluster without history: a fresh one for every replay.
        eprintln!("  not reproduced in a fresh directory; trying a fresh cluster per replay");
        let mut fresh = |ops: &[Op], every: bool| replay(&mut Env::start(), ops, every);
        fresh(&failure.ops, true).map(|f| shrink(&mut fresh, f, deadline))
    };
    let reproducible = shrunk.is_some();
    match shrunk {
        Some(s) => {
            eprintln!(
                "\nfuse_differential: shortest reproduction found ({} steps, from {}):",
                s.ops.len(),
                failure.ops.len()
            );
            eprintln!(
                "  (paths are relative to <dir>/run<N>/u/t, the trees compared are <dir>/run<N>)"
            );
            print_ops(&s.ops);
            eprintln!("  difference at its last step: {}", s.what);
        }
        None => eprintln!(
            "\nfuse_differential: the difference did not reproduce when replayed from scratch \
             (timing-dependent?); the full sequence is above in part, seed {run_seed}"
        ),
    }
    panic!(
        "kochab differs from ext4 (seed {run_seed}, step {at}{}): {original}",
        if reproducible { "" } else { ", not reproduced" }
    );
}
