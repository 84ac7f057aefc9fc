//! Ordinary programs on a real mount, each run the same way on a local directory (a
//! tempdir, ext4 on the CI machines) and compared with it: tar and diff, cp -a, rsync, git,
//! make, sqlite3 (with a second mount), find/du/ls, hard and symbolic links, fifos,
//! sockets, mv, permissions and ownership as other users, and the errno, link-count, data,
//! xattr and timestamp rules of each call.
//!
//! Where Kochab differs from ext4 and the fix is not a small one, the check sits alone in
//! an ignored test marked `KNOWN GAP` (run them with `-- --ignored`).
//!
//! Checks that run in-process record every outcome in a log ([`Probe`]) with the outcome
//! POSIX (and Linux on ext4) gives; the same steps run on both sides, so a failed
//! expectation on the local side is a wrong test, one on the mount is a Kochab bug, and the
//! two logs must also be equal line for line.

mod common;

use common::Cluster;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsStr};
use std::fmt::Debug;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

// ---------------------------------------------------------------------------------------
// Set-up: a cluster with its mount, and a local directory next to it.

/// A mounted cluster and a local directory to compare with. Fields drop in order: the
/// cluster (and its mount) goes before the temporary directory is removed.
struct Bench {
    c: Cluster,
    tmp: tempfile::TempDir,
}

impl Bench {
    fn new() -> Bench {
        let tmp = tempfile::tempdir().expect("tempdir");
        // Other users (setpriv, setfsuid) must reach both sides.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let c = Cluster::start(tmp.path(), &[]);
        fs::create_dir(tmp.path().join("local")).unwrap();
        let local = tmp.path().join("local");
        if statfs_type(&local) != Some(EXT4_SUPER_MAGIC) {
            eprintln!(
                "note: {} is not on ext4; the local side is the reference anyway",
                local.display()
            );
        }
        Bench { c, tmp }
    }

    fn local(&self) -> PathBuf {
        self.tmp.path().join("local")
    }

    fn mnt(&self) -> PathBuf {
        self.c.mnt.clone()
    }

    /// A scratch directory on the local disk (sources, archives).
    fn scratch(&self, name: &str) -> PathBuf {
        let p = self.tmp.path().join(name);
        fs::create_dir_all(&p).unwrap();
        p
    }

    /// Both sides: (label, directory).
    fn sides(&self) -> [(&'static str, PathBuf); 2] {
        [("local", self.local()), ("mount", self.mnt())]
    }
}

const EXT4_SUPER_MAGIC: i64 = 0xEF53;
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

fn statfs_type(p: &Path) -> Option<i64> {
    let c = cstr(p);
    // SAFETY: a valid C string and an out-parameter of the right type.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut s) } == 0).then_some(s.f_type)
}

// ---------------------------------------------------------------------------------------
// Running programs.

fn command(cwd: &Path, script: &str) -> Command {
    let mut c = Command::new("bash");
    c.arg("-c")
        .arg(format!("set -euo pipefail\n{script}"))
        .current_dir(cwd)
        .env("LC_ALL", "C")
        .env("TZ", "UTC")
        .stdin(Stdio::null());
    c
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a bash script in `cwd`; panics (with its output) unless it succeeds; returns stdout.
fn sh(cwd: &Path, script: &str) -> String {
    let o = command(cwd, script).output().expect("spawn bash");
    assert!(
        o.status.success(),
        "script failed in {}:\n{script}\n{}",
        cwd.display(),
        show(&o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs a bash script as another user (setpriv; no capabilities are kept).
fn sh_as(uid: u32, gid: u32, groups: &[u32], cwd: &Path, script: &str) -> String {
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"));
    if groups.is_empty() {
        c.arg("--clear-groups");
    } else {
        let g: Vec<String> = groups.iter().map(u32::to_string).collect();
        c.arg(format!("--groups={}", g.join(",")));
    }
    let o = c
        .args(["bash", "-c"])
        .arg(format!("set -uo pipefail\ncd {}\n{script}", shq(cwd)))
        .current_dir("/")
        .env("LC_ALL", "C")
        .env("HOME", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .expect("spawn setpriv");
    assert!(
        o.status.success(),
        "script as {uid}:{gid} failed:\n{script}\n{}",
        show(&o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A path quoted for bash.
fn shq(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// Asserts two listings are equal, showing the lines that differ.
fn assert_same(what: &str, local: &str, mount: &str) {
    if local == mount {
        return;
    }
    let a: Vec<&str> = local.lines().collect();
    let b: Vec<&str> = mount.lines().collect();
    let sa: BTreeSet<&str> = a.iter().copied().collect();
    let sb: BTreeSet<&str> = b.iter().copied().collect();
    let mut msg = format!(
        "{what}: the mount differs from the local directory ({} vs {} lines)\n",
        a.len(),
        b.len()
    );
    for l in a.iter().filter(|l| !sb.contains(*l)).take(30) {
        msg += &format!("  only local: {l}\n");
    }
    for l in b.iter().filter(|l| !sa.contains(*l)).take(30) {
        msg += &format!("  only mount: {l}\n");
    }
    if sa == sb {
        msg += "  (same lines, different order)\n";
    }
    panic!("{msg}");
}

// ---------------------------------------------------------------------------------------
// Small libc wrappers.

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

fn sys_open(p: &Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let c = cstr(p);
    // SAFETY: a valid C string; the descriptor returned is owned by the OwnedFd.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, mode) })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn renameat2(a: &Path, b: &Path, flags: u32) -> io::Result<()> {
    let (ca, cb) = (cstr(a), cstr(b));
    // SAFETY: valid C strings.
    cvt(unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            flags,
        )
    })
    .map(drop)
}

fn fallocate(f: &fs::File, mode: i32, off: i64, len: i64) -> io::Result<()> {
    // SAFETY: a valid descriptor.
    cvt(unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) }).map(drop)
}

fn ts(sec: i64, nsec: i64) -> libc::timespec {
    libc::timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    }
}

fn utimensat(p: &Path, atime: libc::timespec, mtime: libc::timespec, flags: i32) -> io::Result<()> {
    let c = cstr(p);
    let t = [atime, mtime];
    // SAFETY: a valid C string and two timespecs.
    cvt(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), t.as_ptr(), flags) }).map(drop)
}

fn setxattr(p: &Path, name: &str, value: &[u8], flags: i32, nofollow: bool) -> io::Result<()> {
    let (c, n) = (cstr(p), CString::new(name).unwrap());
    let f = if nofollow {
        libc::lsetxattr
    } else {
        libc::setxattr
    };
    // SAFETY: valid C strings and a buffer of the given length.
    cvt(unsafe {
        f(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    })
    .map(drop)
}

/// getxattr with a buffer of `size` bytes (0 asks for the length).
fn getxattr_sized(p: &Path, name: &str, size: usize) -> io::Result<(usize, Vec<u8>)> {
    let (c, n) = (cstr(p), CString::new(name).unwrap());
    let mut buf = vec![0u8; size];
    // SAFETY: valid C strings and a buffer of `size` bytes.
    let r =
        cvt_size(unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), size) })?;
    buf.truncate(r.min(size));
    Ok((r, buf))
}

fn getxattr(p: &Path, name: &str) -> io::Result<Vec<u8>> {
    getxattr_sized(p, name, 1 << 16).map(|(_, v)| v)
}

/// The attribute names of `p` (symlinks not followed), sorted.
fn listxattr(p: &Path) -> io::Result<Vec<String>> {
    let c = cstr(p);
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: a valid C string and a buffer of its length.
    let n = cvt_size(unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    let mut names: Vec<String> = buf[..n]
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    names.sort();
    Ok(names)
}

fn removexattr(p: &Path, name: &str) -> io::Result<()> {
    let (c, n) = (cstr(p), CString::new(name).unwrap());
    // SAFETY: valid C strings.
    cvt(unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) }).map(drop)
}

fn mknod(p: &Path, mode: u32, dev: u64) -> io::Result<()> {
    let c = cstr(p);
    // SAFETY: a valid C string.
    cvt(unsafe { libc::mknod(c.as_ptr(), mode, dev) }).map(drop)
}

/// The mode as `stat -c %a` asks for it: statx with only STATX_MODE, which a FUSE kernel
/// answers from its cache unless it knows the mode may have changed.
fn statx_mode(p: &Path) -> io::Result<u32> {
    let c = cstr(p);
    // SAFETY: a valid C string and an out-parameter of the right type.
    let mut sx: libc::statx = unsafe { std::mem::zeroed() };
    cvt(unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), 0, libc::STATX_MODE, &mut sx) })?;
    Ok(u32::from(sx.stx_mode) & 0o7777)
}

fn chown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid))
}

fn chmod(p: &Path, mode: u32) -> io::Result<()> {
    fs::set_permissions(p, fs::Permissions::from_mode(mode))
}

fn truncate(p: &Path, len: i64) -> io::Result<()> {
    let c = cstr(p);
    // SAFETY: a valid C string.
    cvt(unsafe { libc::truncate(c.as_ptr(), len) }).map(drop)
}

/// Runs `f` on a thread whose file-system identity is `uid`/`gid` with `groups`: setfsuid
/// drops the file-system capabilities of root for that thread only, so the kernel and the
/// mount check permissions as for that user (FUSE sends the thread's fsuid, fsgid, and the
/// groups the daemon reads from /proc/<tid>/status).
fn as_user<T: Send>(uid: u32, gid: u32, groups: &[u32], f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: raw per-thread credential syscalls (the glibc wrappers of setgroups
            // would change every thread of the process).
            unsafe {
                assert_eq!(
                    libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()),
                    0,
                    "setgroups"
                );
                libc::syscall(libc::SYS_setfsgid, gid);
                libc::syscall(libc::SYS_setfsuid, uid);
                // setfsuid(-1) changes nothing and returns the current value.
                assert_eq!(libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32, uid);
            }
            f()
        })
        .join()
        .expect("thread as another user")
    })
}

// ---------------------------------------------------------------------------------------
// Outcome logs.

fn errname(code: i32) -> String {
    if code == 0 {
        "OK".to_string()
    } else {
        common::errno_name(code)
    }
}

const OK: i32 = 0;

/// `base/rel`, kept as given (a trailing slash matters); `base` itself for "".
fn at(base: &Path, rel: &str) -> PathBuf {
    if rel.is_empty() {
        base.to_path_buf()
    } else {
        PathBuf::from(format!("{}/{rel}", base.display()))
    }
}

/// The outcomes of a sequence of calls under `base`, with the expected ones.
struct Probe {
    base: PathBuf,
    log: Vec<String>,
    bad: Vec<String>,
}

impl Probe {
    fn new(base: &Path) -> Probe {
        Probe {
            base: base.to_path_buf(),
            log: Vec::new(),
            bad: Vec::new(),
        }
    }

    fn p(&self, rel: &str) -> PathBuf {
        at(&self.base, rel)
    }

    /// Records the outcome of a call, which should be `want` (OK or an errno).
    fn expect<T>(&mut self, what: &str, r: io::Result<T>, want: i32) -> Option<T> {
        let got = match &r {
            Ok(_) => OK,
            Err(e) => e.raw_os_error().unwrap_or(-1),
        };
        self.log.push(format!("{what}: {}", errname(got)));
        if got != want {
            self.bad.push(format!(
                "{what}: got {} ({}), want {}",
                errname(got),
                r.as_ref().err().map(|e| e.to_string()).unwrap_or_default(),
                errname(want)
            ));
        }
        r.ok()
    }

    /// Records that `what` holds.
    fn check(&mut self, what: &str, ok: bool) {
        self.log.push(format!("{what}: {ok}"));
        if !ok {
            self.bad.push(format!("{what}: does not hold"));
        }
    }

    /// Records a value that must only be the same on both sides.
    fn note(&mut self, what: &str, v: impl Debug) {
        self.log.push(format!("{what} = {v:?}"));
    }

    fn nlink(&self, rel: &str) -> u64 {
        fs::symlink_metadata(self.p(rel)).map_or(0, |m| m.nlink())
    }

    fn ino(&self, rel: &str) -> u64 {
        fs::symlink_metadata(self.p(rel)).map_or(0, |m| m.ino())
    }

    fn read(&self, rel: &str) -> Vec<u8> {
        fs::read(self.p(rel)).unwrap_or_else(|e| format!("<{e}>").into_bytes())
    }
}

/// Runs `steps` under `local` and under `mount`, then checks both logs.
fn compare_probes(what: &str, local: &Path, mount: &Path, steps: impl Fn(&mut Probe)) {
    let mut l = Probe::new(local);
    steps(&mut l);
    let mut m = Probe::new(mount);
    steps(&mut m);
    eprintln!("{what}, the mount's log:\n{}", m.log.join("\n"));
    assert!(
        l.bad.is_empty(),
        "{what}: the local directory does not behave as this test expects (a test bug):\n{}",
        l.bad.join("\n")
    );
    assert!(
        m.bad.is_empty(),
        "{what}: the mount breaks POSIX rules:\n{}",
        m.bad.join("\n")
    );
    assert_same(what, &l.log.join("\n"), &m.log.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Trees: a generated source tree and a full listing of one.

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A tree with what archivers and copiers must keep: contents of many sizes, nested
/// directories, odd names, modes with setuid/setgid/sticky bits, other owners, hard links
/// (within and across directories), relative, absolute and dangling symlinks, user
/// xattrs, a fifo and a device node, plus a copy of /usr/include/linux when present.
/// Special files are named `special-*` (diff cannot compare them).
fn make_tree(root: &Path) {
    let mut rng = common::Rng::new(42);
    fs::create_dir_all(root).unwrap();
    let w = |rel: &str, data: &[u8]| fs::write(root.join(rel), data).unwrap();
    w("small.txt", b"hello, kochab\n");
    w("empty", b"");
    w("page", &rng.bytes(4096));
    w("page-plus-one", &rng.bytes(4097));
    w("big.bin", &rng.bytes((1 << 20) + 3));
    w("name with spaces", b"spaces\n");
    w(
        "\u{fc}n\u{ef}c\u{f6}d\u{e9}-\u{540d}\u{524d}",
        b"utf-8 name\n",
    );
    w(&"L".repeat(255), b"longest name\n");
    w(".hidden", b"dot file\n");
    for (name, mode) in [
        ("mode600", 0o600),
        ("mode755", 0o755),
        ("mode444", 0o444),
        ("mode000", 0o000),
    ] {
        w(name, name.as_bytes());
        chmod(&root.join(name), mode).unwrap();
    }
    let mut deep = root.to_path_buf();
    for i in 0..12 {
        deep.push(format!("level{i}"));
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("deep.txt"), b"deep\n").unwrap();
    // Many entries in one directory (more than one readdir page of the mount).
    fs::create_dir(root.join("wide")).unwrap();
    for i in 0..700 {
        fs::write(root.join(format!("wide/f{i:04}")), rng.bytes_below(300)).unwrap();
    }
    fs::create_dir(root.join("links")).unwrap();
    w("links/hard1", b"one inode, three names\n");
    fs::hard_link(root.join("links/hard1"), root.join("links/hard2")).unwrap();
    fs::hard_link(root.join("links/hard1"), root.join("level0/hard3")).unwrap();
    std::os::unix::fs::symlink("../small.txt", root.join("links/rel")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", root.join("links/abs")).unwrap();
    std::os::unix::fs::symlink("does/not/exist", root.join("links/dangling")).unwrap();
    std::os::unix::fs::symlink("../level0/level1", root.join("links/to-dir")).unwrap();
    std::os::unix::fs::symlink("x".repeat(200), root.join("links/long-target")).unwrap();
    fs::create_dir(root.join("owners")).unwrap();
    w("owners/user1000", b"a\n");
    chown(&root.join("owners/user1000"), 1000, 1000).unwrap();
    w("owners/user1001-group2000", b"b\n");
    chown(&root.join("owners/user1001-group2000"), 1001, 2000).unwrap();
    std::os::unix::fs::symlink("user1000", root.join("owners/link-of-1001")).unwrap();
    chown(&root.join("owners/link-of-1001"), 1001, 1001).unwrap();
    chown(&root.join("owners"), 1000, 2000).unwrap();
    // Modes after owners: chown clears setuid/setgid.
    w("owners/setuid", b"#!/bin/sh\n");
    chmod(&root.join("owners/setuid"), 0o4755).unwrap();
    w("owners/setgid", b"#!/bin/sh\n");
    chmod(&root.join("owners/setgid"), 0o2755).unwrap();
    for (d, mode) in [
        ("sticky", 0o1777),
        ("setgid-dir", 0o2775),
        ("readonly-dir", 0o555),
    ] {
        fs::create_dir(root.join(d)).unwrap();
        fs::write(root.join(d).join("inside"), d.as_bytes()).unwrap();
        chmod(&root.join(d), mode).unwrap();
    }
    fs::create_dir(root.join("empty-dir")).unwrap();
    setxattr(&root.join("small.txt"), "user.comment", b"a note", 0, false).unwrap();
    setxattr(
        &root.join("level0"),
        "user.dir",
        b"on a directory",
        0,
        false,
    )
    .unwrap();
    setxattr(
        &root.join("big.bin"),
        "user.binary",
        &[0, 1, 2, 255],
        0,
        false,
    )
    .unwrap();
    mknod(&root.join("special-fifo"), libc::S_IFIFO | 0o640, 0).unwrap();
    mknod(
        &root.join("special-null"),
        libc::S_IFCHR | 0o666,
        libc::makedev(1, 3),
    )
    .unwrap();
    if Path::new("/usr/include/linux").is_dir() {
        sh(
            root,
            "cp -a /usr/include/linux include-linux && chown -R 0:0 include-linux",
        );
    }
}

/// One line per entry under `root` (sorted by path): type, mode, owner, link count,
/// size, content hash, symlink target, device, user xattrs, the name its hard-link group
/// is known by, and (with `times`) the modification time in nanoseconds.
fn snapshot(root: &Path, times: bool) -> String {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, fs::Metadata, PathBuf)>) {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            let p = dir.join(&n);
            let r = format!("{rel}/{}", n.to_string_lossy());
            let md = fs::symlink_metadata(&p).unwrap();
            let is_dir = md.is_dir();
            out.push((r.clone(), md, p.clone()));
            if is_dir {
                walk(&p, &r, out);
            }
        }
    }
    let mut entries = vec![(
        ".".to_string(),
        fs::symlink_metadata(root).unwrap(),
        root.to_path_buf(),
    )];
    walk(root, ".", &mut entries);
    let mut group: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for (r, md, _) in &entries {
        if !md.is_dir() && md.nlink() > 1 {
            let e = group
                .entry((md.dev(), md.ino()))
                .or_insert_with(|| r.clone());
            if r < e {
                *e = r.clone();
            }
        }
    }
    let mut out = String::new();
    for (r, md, p) in &entries {
        let ft = md.file_type();
        let t = if ft.is_dir() {
            'd'
        } else if ft.is_symlink() {
            'l'
        } else if ft.is_fifo() {
            'p'
        } else if ft.is_socket() {
            's'
        } else if ft.is_char_device() {
            'c'
        } else if ft.is_block_device() {
            'b'
        } else {
            'f'
        };
        out += &format!(
            "{r} {t} {:o} {}:{} n={}",
            md.mode() & 0o7777,
            md.uid(),
            md.gid(),
            md.nlink()
        );
        if t != 'd' {
            out += &format!(" size={}", md.size());
        }
        if t == 'f' {
            out += &format!(" data={:016x}", fnv(&fs::read(p).unwrap()));
        }
        if t == 'l' {
            out += &format!(" -> {}", fs::read_link(p).unwrap().display());
        }
        if t == 'c' || t == 'b' {
            out += &format!(" rdev={:x}", md.rdev());
        }
        if t == 'f' || t == 'd' {
            for name in listxattr(p).unwrap_or_default() {
                if name.starts_with("user.") {
                    let v = getxattr(p, &name).unwrap_or_default();
                    out += &format!(" {name}={}", String::from_utf8_lossy(&v).escape_debug());
                }
            }
        }
        if let Some(first) = group.get(&(md.dev(), md.ino()))
            && first != r
        {
            out += &format!(" link-of={first}");
        }
        if times {
            out += &format!(" mtime={}.{:09}", md.mtime(), md.mtime_nsec());
        }
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------------
// tar, diff, find, du, ls.

/// `find`, `ls -lR` and `du` output with what legitimately differs masked: directory sizes
/// (ext4 grows directories in blocks) and disk usage (allocation is the file system's own).
fn listings(dir: &Path) -> String {
    sh(
        dir,
        r#"
echo '# find'
find . \( -type d -printf '%y %M %n %U %G - %T@ %P\n' \) -o \
       \( -printf '%y %M %n %U %G %s %T@ %P -> %l\n' \) | sort
echo '# ls -lR'
ls -lRn --time-style=+%s.%N | awk '$1 == "total" { next } /^d/ { $5 = "-" } { print }'
echo '# du: apparent sizes of non-directories, inode counts'
find . ! -type d -print0 | du -l --apparent-size -b --files0-from=- | sort -k2
du --inodes -a -l | sort -k2
"#,
    )
}

#[test]
fn tar_extracts_the_same_tree_and_find_ls_du_diff_agree() {
    let b = Bench::new();
    let src = b.scratch("src");
    make_tree(&src);
    let tarball = b.tmp.path().join("tree.tar");
    sh(
        b.tmp.path(),
        &format!(
            "tar --format=posix --xattrs --xattrs-include='user.*' -cf {} -C {} .",
            shq(&tarball),
            shq(&src)
        ),
    );
    let mut snaps = Vec::new();
    let mut lists = Vec::new();
    for (side, base) in b.sides() {
        let x = base.join("x");
        fs::create_dir(&x).unwrap();
        sh(
            &base,
            &format!(
                "tar --xattrs --xattrs-include='user.*' -xpf {} -C x",
                shq(&tarball)
            ),
        );
        // tar's own comparison: contents, modes, owners, mtimes, link targets.
        let d = sh(
            &base,
            &format!("tar --compare -f {} -C x || true", shq(&tarball)),
        );
        assert!(
            d.is_empty(),
            "{side}: tar --compare found differences:\n{d}"
        );
        snaps.push(snapshot(&x, true));
        lists.push(listings(&x));
    }
    assert_same("tree extracted by tar", &snaps[0], &snaps[1]);
    assert_same("find/ls/du of the extracted tree", &lists[0], &lists[1]);
    // diff -r across the two sides (special files cannot be compared by diff).
    let (l, m) = (b.local().join("x"), b.mnt().join("x"));
    sh(
        b.tmp.path(),
        &format!(
            "diff -r --no-dereference -x 'special-*' {} {}",
            shq(&l),
            shq(&m)
        ),
    );
    // diff notices a change made through the mount.
    fs::write(m.join("level0/hard3"), b"changed\n").unwrap();
    let o = command(
        b.tmp.path(),
        &format!(
            "diff -r --no-dereference -x 'special-*' {} {}",
            shq(&l),
            shq(&m)
        ),
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // One inode with three names: all three differ now.
    for name in ["links/hard1", "links/hard2", "level0/hard3"] {
        assert!(out.contains(name), "diff misses {name}:\n{out}");
    }
    assert_eq!(
        fs::read(m.join("links/hard2")).unwrap(),
        b"changed\n",
        "hard links share their data"
    );
    // An archive made from the mount extracts to the same tree.
    let back = b.scratch("back");
    sh(
        b.tmp.path(),
        &format!(
            "tar --format=posix --xattrs --xattrs-include='user.*' -cf - -C {} . \
             | tar --xattrs --xattrs-include='user.*' -xpf - -C {}",
            shq(&m),
            shq(&back)
        ),
    );
    assert_same(
        "tree archived from the mount",
        &snapshot(&m, true),
        &snapshot(&back, true),
    );
}

// ---------------------------------------------------------------------------------------
// cp -a and rsync.

#[test]
fn cp_a_and_rsync_keep_everything_and_a_second_rsync_does_nothing() {
    let b = Bench::new();
    let src = b.scratch("src");
    make_tree(&src);
    let want = snapshot(&src, true);
    let m = b.mnt();
    // cp -a onto the mount, and from the mount to the mount.
    sh(&m, &format!("cp -a {} cp1", shq(&src)));
    assert_same("cp -a to the mount", &want, &snapshot(&m.join("cp1"), true));
    sh(&m, "cp -a cp1 cp2");
    assert_same(
        "cp -a within the mount",
        &want,
        &snapshot(&m.join("cp2"), true),
    );

    // rsync, the same steps on both sides.
    let mut outs = Vec::new();
    for (side, base) in b.sides() {
        let rs = format!("rsync -aHX --numeric-ids -i {}/ rs/", shq(&src));
        let first = sh(&base, &rs);
        assert!(!first.is_empty(), "{side}: the first rsync copies");
        assert_same(
            &format!("rsync -aHX to {side}"),
            &want,
            &snapshot(&base.join("rs"), true),
        );
        let second = sh(&base, &rs);
        assert!(
            second.is_empty(),
            "{side}: a second rsync found something to do:\n{second}"
        );
        // Checksums too, without changing anything.
        let sums = sh(&base, &format!("{rs} -c --dry-run"));
        assert!(
            sums.is_empty(),
            "{side}: rsync -c finds differences:\n{sums}"
        );
        // One changed file in the copy is found and fixed, nothing else is touched.
        fs::write(base.join("rs/level0/level1/level2/level3/x"), b"new").unwrap();
        fs::write(base.join("rs/small.txt"), b"hello, kochab?\n").unwrap();
        let third = sh(&base, &format!("{rs} --delete"));
        let mut lines: Vec<&str> = third.lines().collect();
        lines.sort();
        outs.push(lines.join("\n"));
        assert_same(
            &format!("rsync --delete to {side}"),
            &want,
            &snapshot(&base.join("rs"), true),
        );
        // --inplace rewrites files in place.
        fs::write(base.join("rs/big.bin"), b"short").unwrap();
        sh(&base, &format!("{rs} --inplace --no-whole-file"));
        assert_same(
            &format!("rsync --inplace to {side}"),
            &want,
            &snapshot(&base.join("rs"), true),
        );
    }
    assert_same("rsync's report of a changed copy", &outs[0], &outs[1]);
    assert!(outs[1].contains("small.txt"), "{}", outs[1]);
    assert!(outs[1].contains("*deleting"), "{}", outs[1]);
    // And from the mount back to the local disk.
    let back = b.scratch("back");
    sh(
        b.tmp.path(),
        &format!(
            "rsync -aHX --numeric-ids {}/ {}/",
            shq(&m.join("rs")),
            shq(&back)
        ),
    );
    assert_same("rsync from the mount", &want, &snapshot(&back, true));
}

// ---------------------------------------------------------------------------------------
// git.

#[test]
fn git_commits_logs_and_fsck_on_the_mount() {
    let b = Bench::new();
    // A fixed copy of real source files (the checkout may change while this runs).
    let srcs = b.scratch("srcs");
    let meta = Path::new(env!("CARGO_MANIFEST_DIR")).join("../meta/src");
    let mut n = 0;
    for e in fs::read_dir(&meta).unwrap() {
        let p = e.unwrap().path();
        if p.extension() == Some(OsStr::new("rs")) {
            fs::copy(&p, srcs.join(p.file_name().unwrap())).unwrap();
            n += 1;
        }
    }
    assert!(n >= 5, "found only {n} source files in {}", meta.display());
    let home = b.scratch("home");
    let script = format!(
        r#"
export HOME={home} GIT_CONFIG_NOSYSTEM=1
export GIT_AUTHOR_NAME=Kochab GIT_AUTHOR_EMAIL=k@example.com
export GIT_COMMITTER_NAME=Kochab GIT_COMMITTER_EMAIL=k@example.com
export GIT_AUTHOR_DATE='2024-01-02T03:04:05Z' GIT_COMMITTER_DATE='2024-01-02T03:04:05Z'
git init -q -b main repo
cd repo
mkdir -p src/deeper
cp {srcs}/*.rs src/
printf 'all:\n\ttrue\n' > Makefile
git add -A
git commit -q -m 'first: the sources'
export GIT_AUTHOR_DATE='2024-01-03T03:04:05Z' GIT_COMMITTER_DATE='2024-01-03T03:04:05Z'
first=$(ls src/*.rs | head -1)
second=$(ls src/*.rs | tail -1)
echo '// changed' >> "$first"
git mv "$second" src/deeper/moved.rs
echo 'new file' > src/deeper/new.txt
chmod +x Makefile
git add -A
git commit -q -m 'second: edit, move, add, chmod'
echo '# log'; git log --format='%H %s'
echo '# oneline'; git log --oneline | wc -l
echo '# status'; git status --porcelain
echo '# fsck'; git fsck --full --strict 2>&1
echo '# show'; git show --stat --format=%s HEAD
echo '# diff'; echo 'uncommitted' >> Makefile; git diff --stat; git status --porcelain
git checkout -q -- Makefile; git status --porcelain
echo '# branch'; git checkout -q -b side HEAD~1; ls src | wc -l; git checkout -q main
echo '# gc'; git gc -q; git fsck --full --strict 2>&1; git count-objects -v | grep -E '^(count|in-pack|packs)'
echo '# clone'; cd ..; git clone -q repo clone; cd clone; git log --format='%H %s'; git status --porcelain
git ls-files -s | sed -n 1,5p
"#,
        home = shq(&home),
        srcs = shq(&srcs)
    );
    let local = sh(&b.local(), &script);
    let mount = sh(&b.mnt(), &script);
    assert_same("git on the mount", &local, &mount);
    let log: Vec<&str> = mount
        .split("# log\n")
        .nth(1)
        .unwrap()
        .lines()
        .take(2)
        .collect();
    assert!(
        log[0].ends_with("second: edit, move, add, chmod"),
        "{mount}"
    );
    assert!(log[1].ends_with("first: the sources"), "{mount}");
    assert!(
        mount.contains("# oneline\n2\n# status\n# fsck\n# show"),
        "two commits, a clean tree and a quiet fsck:\n{mount}"
    );
}

// ---------------------------------------------------------------------------------------
// make.

const MAKEFILE: &str = "CC = cc\nCFLAGS = -O0 -Wall -Werror\n\
prog: main.o util.o calc.o\n\t$(CC) -o $@ $^\n\
%.o: %.c common.h\n\t$(CC) $(CFLAGS) -c -o $@ $<\n\
clean:\n\trm -f prog *.o\n.PHONY: clean\n";

fn write_c_project(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    let files = [
        ("Makefile", MAKEFILE),
        (
            "common.h",
            "const char *greeting(void);\nlong sum_to(long n);\n",
        ),
        (
            "main.c",
            "#include <stdio.h>\n#include \"common.h\"\n\
             int main(void) { printf(\"%s sum=%ld\\n\", greeting(), sum_to(100)); return 0; }\n",
        ),
        (
            "util.c",
            "#include \"common.h\"\nconst char *greeting(void) { return \"hello from kochab\"; }\n",
        ),
        (
            "calc.c",
            "#include \"common.h\"\n\
             long sum_to(long n) { long s = 0; for (long i = 1; i <= n; i++) s += i; return s; }\n",
        ),
    ];
    for (name, text) in files {
        fs::write(dir.join(name), text).unwrap();
    }
}

#[test]
fn make_builds_runs_and_rebuilds_only_what_changed() {
    let b = Bench::new();
    let script = r#"
echo '# build'; make 2>&1
echo '# run'; ./prog
echo '# again'; make 2>&1
echo '# question'; make -q && echo up-to-date
echo '# touch util.c'; touch util.c; make 2>&1
echo '# edit calc.c'; sed -i 's/i <= n/i < n/' calc.c; make 2>&1; ./prog
echo '# touch common.h'; touch common.h; make 2>&1
echo '# again after the header'; make 2>&1
echo '# parallel'; make clean >/dev/null; make -j2 >/dev/null 2>&1; ./prog; make 2>&1
echo '# files'; ls -1 | sort; stat -c '%n %A' prog
"#;
    let mut outs = Vec::new();
    for (_, base) in b.sides() {
        write_c_project(&base.join("proj"));
        outs.push(sh(&base.join("proj"), script));
    }
    assert_same("make on the mount", &outs[0], &outs[1]);
    let out = &outs[1];
    let section = |name: &str| -> Vec<String> {
        out.split(&format!("# {name}\n"))
            .nth(1)
            .unwrap_or("")
            .lines()
            .take_while(|l| !l.starts_with("# "))
            .map(str::to_string)
            .collect()
    };
    let build = section("build");
    assert_eq!(build.len(), 4, "three compiles and a link:\n{out}");
    assert_eq!(section("run"), ["hello from kochab sum=5050"], "{out}");
    assert_eq!(section("again"), ["make: 'prog' is up to date."], "{out}");
    assert_eq!(section("question"), ["up-to-date"], "{out}");
    let touched = section("touch util.c");
    assert_eq!(touched.len(), 2, "only util.o and the link:\n{out}");
    assert!(touched[0].contains("util.c"), "{out}");
    let edited = section("edit calc.c");
    assert!(edited[0].contains("calc.c"), "{out}");
    assert_eq!(
        edited.last().unwrap(),
        "hello from kochab sum=4950",
        "{out}"
    );
    assert_eq!(section("touch common.h").len(), 4, "{out}");
}

// ---------------------------------------------------------------------------------------
// sqlite3.

fn sqlite(dir: &Path, db: &str, sql: &str) -> String {
    let mut child = Command::new("sqlite3")
        .arg("-batch")
        .arg("-bail")
        .arg(db)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sqlite3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(sql.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "sqlite3 {db} in {} failed:\n{}",
        dir.display(),
        show(&o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn sqlite_creates_and_queries_a_database() {
    let b = Bench::new();
    let mut sql = String::from(
        "create table t(id integer primary key, name text not null, v real);\nbegin;\n",
    );
    for i in 1..=1000 {
        sql += &format!("insert into t(name, v) values('row{i}', {i} * 1.5);\n");
    }
    sql += "commit;\n\
        select count(*), sum(v), min(name), max(id) from t;\n\
        create index t_name on t(name);\n\
        select id from t where name = 'row500';\n\
        update t set v = -v where id % 7 = 0;\n\
        delete from t where id % 3 = 0;\n\
        select count(*), sum(v) from t;\n\
        vacuum;\n\
        pragma integrity_check;\n\
        select count(*) from t where name like 'row9%';\n";
    let mut outs = Vec::new();
    for (_, base) in b.sides() {
        outs.push(sqlite(&base, "test.db", &sql));
        // A new process opens what the first left.
        outs.push(sqlite(
            &base,
            "test.db",
            "select count(*), sum(v) from t; pragma integrity_check;\n",
        ));
        let rest: Vec<String> = fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(rest, ["test.db"], "no journal is left behind");
    }
    assert_same("sqlite3 on the mount", &outs[0], &outs[2]);
    assert_same("sqlite3 reopening on the mount", &outs[1], &outs[3]);
    assert!(
        outs[2].starts_with("1000|750750.0|row1|1000\n500\n"),
        "{}",
        outs[2]
    );
    assert!(outs[2].contains("\nok\n"), "{}", outs[2]);
}

/// `n` transactions of `who`, each inserting a row and counting `who`'s rows.
fn sqlite_writer(dir: PathBuf, who: &'static str, n: u32) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut sql = String::from(".timeout 60000\n");
        for i in 1..=n {
            sql += &format!(
                "begin immediate;\ninsert into t(who, n) values('{who}', {i});\n\
                 select count(*) from t where who = '{who}';\ncommit;\n"
            );
        }
        sqlite(&dir, "shared.db", &sql)
    })
}

fn counts_to(n: u32) -> String {
    (1..=n).map(|i| format!("{i}\n")).collect()
}

/// Two sqlite3 processes write the same database at once (their transactions wait for each
/// other's locks), then processes on a second mount and on the first take turns.
#[test]
fn sqlite_concurrent_writers_and_a_second_mount() {
    let b = Bench::new();
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    sqlite(
        &b.mnt(),
        "shared.db",
        "create table t(id integer primary key, who text, n int);\n",
    );
    let a = sqlite_writer(b.mnt(), "a", 100);
    let c = sqlite_writer(b.mnt(), "b", 100);
    assert_eq!(a.join().unwrap(), counts_to(100), "writer a lost rows");
    assert_eq!(c.join().unwrap(), counts_to(100), "writer b lost rows");
    // Close-to-open: each new process sees what the last one on the other mount wrote.
    for (round, dir) in [other.mnt.clone(), b.mnt(), other.mnt.clone()]
        .into_iter()
        .enumerate()
    {
        let out = sqlite(
            &dir,
            "shared.db",
            &format!(
                "insert into t(who, n) values('turn', {round});\n\
                 select who, count(*), sum(n) from t group by who; pragma integrity_check;\n"
            ),
        );
        let turns = round + 1;
        let sum: usize = (0..=round).sum();
        assert_eq!(
            out,
            format!("a|100|5050\nb|100|5050\nturn|{turns}|{sum}\nok\n"),
            "round {round} on {}",
            dir.display()
        );
    }
}

/// Writers on two mounts at once must not lose committed transactions: a POSIX lock taken
/// through one mount drops that mount's cached pages of the file (as NFS does), so sqlite
/// never reads a stale change counter after the other mount's commit.
#[test]
fn sqlite_writers_on_two_mounts_at_once() {
    let b = Bench::new();
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    sqlite(
        &b.mnt(),
        "shared.db",
        "create table t(id integer primary key, who text, n int);\n",
    );
    let a = sqlite_writer(b.mnt(), "a", 100);
    let c = sqlite_writer(other.mnt.clone(), "b", 100);
    assert_eq!(a.join().unwrap(), counts_to(100), "writer a lost rows");
    assert_eq!(c.join().unwrap(), counts_to(100), "writer b lost rows");
    for dir in [b.mnt(), other.mnt.clone()] {
        let out = sqlite(
            &dir,
            "shared.db",
            "select who, count(*), sum(n) from t group by who; pragma integrity_check;\n",
        );
        assert_eq!(out, "a|100|5050\nb|100|5050\nok\n", "{}", dir.display());
    }
}

/// After a write through mount A, a process on mount B that already has the file open and
/// cached sees the new bytes once it holds a POSIX lock on it.
#[test]
fn a_lock_drops_pages_another_mount_changed() {
    let b = Bench::new();
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    fs::write(b.mnt().join("f"), vec![b'A'; 8192]).unwrap();
    let reader = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(other.mnt.join("f"))
        .unwrap();
    assert_eq!(pread(&reader, 0, 4), b"AAAA");
    let writer = fs::OpenOptions::new()
        .write(true)
        .open(b.mnt().join("f"))
        .unwrap();
    std::os::unix::fs::FileExt::write_at(&writer, b"BBBB", 0).unwrap();
    drop(writer);
    let lock = libc::flock {
        l_type: libc::F_WRLCK as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: F_SETLKW with a valid descriptor and an initialized struct flock.
    assert_eq!(
        unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_SETLKW, &lock) },
        0
    );
    assert_eq!(
        pread(&reader, 0, 4),
        b"BBBB",
        "the lock holder reads what the other mount wrote"
    );
}

/// A name another mount removed or replaced is found again at once, although this mount's
/// kernel still caches the old entry (entry_ttl): open, open(O_CREAT), stat, chmod and
/// truncate act on what the name is now.
#[test]
fn names_removed_or_replaced_on_another_mount_are_found_again() {
    let b = Bench::new();
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    let (a, o) = (b.mnt(), other.mnt.clone());
    // Removed on A, created again through B's cached entry.
    fs::write(a.join("journal"), b"one").unwrap();
    assert_eq!(fs::read(o.join("journal")).unwrap(), b"one");
    fs::remove_file(a.join("journal")).unwrap();
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(o.join("journal"))
        .expect("open(O_CREAT) of a name the other mount removed creates it");
    f.write_all(b"two").unwrap();
    drop(f);
    assert_eq!(fs::read(a.join("journal")).unwrap(), b"two");
    // Replaced on A by a rename (the atomic-save pattern of editors, rsync, git).
    fs::write(a.join("config"), b"old").unwrap();
    assert_eq!(fs::read(o.join("config")).unwrap(), b"old");
    let before = fs::metadata(o.join("config")).unwrap().ino();
    fs::write(a.join("config.tmp"), b"brand new").unwrap();
    fs::rename(a.join("config.tmp"), a.join("config")).unwrap();
    assert_eq!(
        fs::read(o.join("config")).expect("open of a replaced name"),
        b"brand new"
    );
    let md = fs::metadata(o.join("config")).expect("stat of a replaced name");
    assert_ne!(md.ino(), before);
    assert_eq!(md.len(), 9);
    fs::write(a.join("config.tmp"), b"third").unwrap();
    fs::rename(a.join("config.tmp"), a.join("config")).unwrap();
    chmod(&o.join("config"), 0o600).expect("chmod of a replaced name");
    assert_eq!(
        fs::metadata(a.join("config")).unwrap().mode() & 0o777,
        0o600
    );
    fs::write(a.join("config.tmp"), b"fourth").unwrap();
    fs::rename(a.join("config.tmp"), a.join("config")).unwrap();
    truncate(&o.join("config"), 2).expect("truncate of a replaced name");
    assert_eq!(fs::read(a.join("config")).unwrap(), b"fo");
    // Removed on A: once B's cached attributes expire (attr_ttl, 1 s), B's stat says
    // ENOENT, not ESTALE.
    fs::remove_file(a.join("config")).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(
        fs::metadata(o.join("config")).unwrap_err().raw_os_error(),
        Some(libc::ENOENT)
    );
}

// ---------------------------------------------------------------------------------------
// Links, fifos, sockets, mv.

#[test]
fn links_fifos_sockets_and_mv_behave_as_locally() {
    let b = Bench::new();
    let script = r#"
mkdir -p a/b c
echo data > a/f
ln a/f a/g; ln a/f c/h
echo '# hard links'; stat -c '%n %h %s' a/f a/g c/h
[ "$(stat -c %i a/f)" = "$(stat -c %i c/h)" ] && echo same-inode
ls -li a | awk 'NR > 1 { print $1 == prev ? "same" : "new"; prev = $1 }' | tail -1
rm a/g; stat -c '%n %h' a/f c/h
echo '# symlinks'
ln -s f a/rel; ln -s ../a/f c/up; ln -s nowhere a/dangling; ln -s /proc/self/cwd/a/f a/abs
ln -s b a/to-dir; ln -s loop2 a/loop1; ln -s loop1 a/loop2
readlink a/rel c/up a/dangling; cat a/rel c/up a/abs
ls a/to-dir/ | wc -l; (cd a/to-dir && cd .. && echo "back in $(basename "$PWD")")
[ -L a/dangling ] && [ ! -e a/dangling ] && echo dangling-ok
{ cat a/loop1 2>&1 || true; } | sed 's/.*: //'
stat -c '%n %F %s' a/rel a/dangling a/to-dir
ln -sf f a/dangling; cat a/dangling
echo '# realpath'; realpath --relative-to=. c/up a/to-dir
echo '# mv file across dirs'; mv a/f c/moved; stat -c '%n %h' c/moved c/h; { cat c/up 2>&1 || true; } | sed 's/.*: //'
echo '# mv dir across dirs'; stat -c '%n %h' a c; mv a/b c/b; stat -c '%n %h' a c c/b
[ "$(stat -c %i c/b/..)" = "$(stat -c %i c)" ] && echo dotdot-is-new-parent
echo '# mv over file'; echo one > c/x; echo two > c/y; mv c/x c/y; cat c/y; ls c
echo '# mv dir over empty dir'; mkdir c/e1 c/e2; touch c/e1/inside; mv -T c/e1 c/e2; ls c/e2; ls c | grep -c e1 || true
echo '# mv dir into itself'; { mv c/e2 c/e2/sub 2>&1 || true; } | sed 's/.*: //'
echo '# fifo'
mkfifo -m 640 pipe; stat -c '%n %F %a %s' pipe
timeout 20 cat pipe > fifo.out & timeout 20 bash -c 'seq 1 20000 > pipe'; wait
seq 1 20000 | cmp - fifo.out && echo fifo-data-ok
echo '# tree'
find . \( -type d -printf '%y %M %n %P\n' \) -o -printf '%y %M %n %s %P -> %l\n' | sort
"#;
    let mut outs = Vec::new();
    for (_, base) in b.sides() {
        outs.push(sh(&base, script));
    }
    assert_same("links, fifos and mv on the mount", &outs[0], &outs[1]);
    for want in [
        "a/f 3 5\na/g 3 5\nc/h 3 5\nsame-inode\nsame\na/f 2\nc/h 2\n",
        "f\n../a/f\nnowhere\ndata\ndata\ndata\n",
        "dangling-ok\nToo many levels of symbolic links\n",
        "dotdot-is-new-parent",
        "fifo-data-ok",
    ] {
        assert!(outs[1].contains(want), "missing {want:?} in:\n{}", outs[1]);
    }

    // Link counts, inode numbers and sockets from Rust.
    let m = b.mnt();
    let md = |p: &str| fs::symlink_metadata(m.join(p)).unwrap();
    assert_eq!(md("c/moved").ino(), md("c/h").ino());
    assert_eq!(md("c/moved").nlink(), 2);
    assert_eq!(md("c").nlink(), 2 + 2, "c has the subdirectories b and e2");
    assert_eq!(md("a").nlink(), 2);
    // a/dangling points at f, which mv took away.
    assert_eq!(
        fs::metadata(m.join("a/dangling"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENOENT)
    );
    assert!(md("a/dangling").file_type().is_symlink());
    assert_eq!(
        fs::metadata(m.join("a/loop1")).unwrap_err().raw_os_error(),
        Some(libc::ELOOP)
    );
    let sock = m.join("sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    assert!(md("sock").file_type().is_socket());
    let mut client = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let (mut server, _) = listener.accept().unwrap();
    client.write_all(b"over a socket on the mount").unwrap();
    drop(client);
    let mut got = String::new();
    server.read_to_string(&mut got).unwrap();
    assert_eq!(got, "over a socket on the mount");
    fs::remove_file(&sock).unwrap();
    // A fifo opened from Rust: non-blocking reader first, then a writer.
    let pipe = m.join("pipe");
    let r = sys_open(&pipe, libc::O_RDONLY | libc::O_NONBLOCK, 0).unwrap();
    let mut w = fs::OpenOptions::new().write(true).open(&pipe).unwrap();
    w.write_all(b"through the fifo").unwrap();
    drop(w);
    let mut rf = fs::File::from(r);
    let mut got = Vec::new();
    rf.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"through the fifo");
    assert_eq!(
        md("pipe").size(),
        0,
        "a fifo's data never reaches the file system"
    );
    // Device nodes are made and kept, but a default mount is nodev: they do not open.
    mknod(&m.join("null"), libc::S_IFCHR | 0o666, libc::makedev(1, 3)).unwrap();
    let e = fs::write(m.join("null"), b"discarded").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
    assert_eq!(md("null").rdev(), libc::makedev(1, 3));
    assert_eq!(md("null").size(), 0);
}

// ---------------------------------------------------------------------------------------
// Permissions and ownership as other users (setpriv).

/// A bash function `expect WANT CMD...` that runs CMD and prints whether it failed the way
/// WANT says (ok, EACCES, EPERM, ENOENT), judged by the error text of coreutils.
const EXPECT_FN: &str = r#"
expect() {
  local want=$1; shift
  local out got
  if out=$("$@" 2>&1); then got=ok
  else
    case $out in
      *"Permission denied"*) got=EACCES ;;
      *"Operation not permitted"*) got=EPERM ;;
      *"No such file"*) got=ENOENT ;;
      *) got="other($out)" ;;
    esac
  fi
  if [ "$got" = "$want" ]; then echo "ok $*"; else echo "FAIL $*: want $want, got $got"; fi
}
"#;

#[test]
fn permissions_and_ownership_as_other_users() {
    let b = Bench::new();
    let setup = r#"
umask 022
mkdir rootdir; echo secret > rootdir/secret; chmod 600 rootdir/secret
echo public > rootdir/public
echo r > rootfile; echo w > rootfile666; chmod 666 rootfile666
mkdir a_home; chown 1000:1000 a_home
mkdir b_home; chown 1001:1001 b_home; chmod 700 b_home
mkdir shared; chmod 1777 shared
mkdir sgid; chown 0:2000 sgid; chmod 2775 sgid
"#;
    // User A: 1000:1000, no other groups.
    let protected =
        fs::read_to_string("/proc/sys/fs/protected_hardlinks").is_ok_and(|s| s.trim() == "1");
    let user_a = format!(
        "{EXPECT_FN}\numask 022\nPROTECTED={}\n{}",
        if protected { "EPERM" } else { "ok" },
        r##"
expect EACCES touch rootdir/new
expect EACCES cat rootdir/secret
expect ok cat rootdir/public
expect ok ls rootdir
expect EACCES ls b_home
expect EACCES rm -f rootfile
expect EACCES mkdir rootdir/d
expect EACCES bash -c 'echo x >> rootfile'
expect ok bash -c 'echo x >> rootfile666'
expect EPERM chmod 777 rootfile
expect EPERM chown 1000 rootfile
expect EPERM chgrp 1000 rootfile
expect EPERM touch -d @0 rootfile666
expect ok touch rootfile666
expect EACCES touch rootfile
expect EACCES truncate -s 0 rootfile
expect ok touch a_home/mine
expect ok chmod 600 a_home/mine
expect ok chgrp 1000 a_home/mine
expect EPERM chown 1001 a_home/mine
expect EPERM chgrp 2000 a_home/mine
expect ok bash -c 'echo data > a_home/mine'
expect ok chmod 444 a_home/mine
expect EACCES bash -c 'echo more >> a_home/mine'
expect ok bash -c 'printf "#!/bin/sh\necho ran\n" > a_home/script'
expect EACCES a_home/script
expect ok chmod 755 a_home/script
expect ok a_home/script
expect ok bash -c 'umask 027; touch a_home/um_f; mkdir a_home/um_d'
expect ok bash -c 'umask 077; echo x > a_home/um_g; mkdir a_home/um_e'
expect ok bash -c 'umask 000; mkdir a_home/um_0; touch a_home/um_0/f'
expect ok touch shared/a_file
expect ok mkdir shared/a_dir
expect ok chmod 666 shared/a_file
expect EACCES touch sgid/a_file
expect ok mv a_home/um_f a_home/um_f2
expect EACCES mv a_home/um_f2 rootdir/
expect ok ln -s /nowhere a_home/sym
expect $PROTECTED ln rootfile a_home/hardlink-of-root
"##
    );
    // User B: 1001:1001, also in group 2000.
    let user_b = format!(
        "{EXPECT_FN}\numask 022\n{}",
        r#"
expect EPERM rm -f shared/a_file
expect EPERM mv shared/a_file shared/b_took_it
expect EPERM rmdir shared/a_dir
expect ok truncate -c -s 1 shared/a_file
expect ok touch shared/b_file
expect ok mv shared/b_file shared/b_file2
expect ok rm shared/b_file2
expect ok touch sgid/b_file
expect ok mkdir sgid/b_dir
expect ok mkdir sgid/b_dir/deeper
expect ok chgrp 1001 sgid/b_file
expect ok chgrp 2000 sgid/b_file
expect EACCES touch a_home/x
expect ok cat a_home/mine
expect EPERM chmod 644 a_home/mine
expect ok ls b_home
expect ok touch b_home/own
"#
    );
    let listing = r#"
find . -mindepth 1 -printf '%M %U %G %n %P\n' | sort
"#;
    let mut outs = Vec::new();
    for (side, base) in b.sides() {
        let base = base.join("perm");
        fs::create_dir(&base).unwrap();
        sh(&base, setup);
        let a = sh_as(1000, 1000, &[], &base, &user_a);
        let bb = sh_as(1001, 1001, &[2000], &base, &user_b);
        // Root: may delete in the sticky directory, may write a 0444 file, may not run a
        // file without any execute bit.
        let root = sh(
            &base,
            &format!(
                "{EXPECT_FN}\n{}",
                r#"
expect ok bash -c 'echo root >> a_home/mine'
chmod 644 a_home/script
expect EACCES a_home/script
expect ok rm shared/a_file
expect ok touch -d @0 rootfile666
"#
            ),
        );
        let all = format!(
            "# A\n{a}# B\n{bb}# root\n{root}# tree\n{}",
            sh(&base, listing)
        );
        assert!(!all.contains("FAIL"), "{side}:\n{all}");
        outs.push(all);
    }
    assert_same("permissions on the mount", &outs[0], &outs[1]);
    let tree = outs[1].split("# tree\n").nth(1).unwrap();
    for want in [
        "-rw-r----- 1000 1000 1 a_home/um_f2",
        "drwxr-x--- 1000 1000 2 a_home/um_d",
        "-rw------- 1000 1000 1 a_home/um_g",
        "drwx------ 1000 1000 2 a_home/um_e",
        "drwxrwxrwx 1000 1000 2 a_home/um_0",
        "-rw-rw-rw- 1000 1000 1 a_home/um_0/f",
        "-rw-r--r-- 1001 2000 1 sgid/b_file",
        "drwxr-sr-x 1001 2000 3 sgid/b_dir",
        "drwxr-sr-x 1001 2000 2 sgid/b_dir/deeper",
        "drwxrwxrwt 0 0 3 shared",
        "drwxr-xr-x 1000 1000 2 shared/a_dir",
    ] {
        assert!(tree.contains(want), "missing {want:?}:\n{tree}");
    }
}

// ---------------------------------------------------------------------------------------
// POSIX rules of each call, in-process.

fn errno_steps(pr: &mut Probe) {
    use libc::{
        EEXIST, EINVAL, EISDIR, ELOOP, ENAMETOOLONG, ENOENT, ENOTDIR, ENOTEMPTY, EPERM, O_CREAT,
        O_DIRECTORY, O_EXCL, O_NOFOLLOW, O_PATH, O_RDONLY, O_RDWR, O_WRONLY, RENAME_EXCHANGE,
        RENAME_NOREPLACE,
    };
    let base = pr.base.clone();
    let p = |r: &str| at(&base, r);
    // ENOENT, EEXIST, ENOTDIR, EISDIR.
    pr.expect("mkdir d", fs::create_dir(p("d")), OK);
    pr.expect("mkdir d again", fs::create_dir(p("d")), EEXIST);
    pr.expect("write f", fs::write(p("f"), b"hello"), OK);
    pr.expect("mkdir over file f", fs::create_dir(p("f")), EEXIST);
    pr.expect(
        "O_CREAT|O_EXCL on f",
        sys_open(&p("f"), O_CREAT | O_EXCL | O_WRONLY, 0o644),
        EEXIST,
    );
    pr.expect(
        "O_CREAT|O_EXCL on d",
        sys_open(&p("d"), O_CREAT | O_EXCL | O_RDONLY, 0o644),
        EEXIST,
    );
    pr.expect(
        "O_CREAT|O_EXCL on new",
        sys_open(&p("new"), O_CREAT | O_EXCL | O_WRONLY, 0o644),
        OK,
    );
    pr.expect(
        "O_CREAT on d",
        sys_open(&p("d"), O_CREAT | O_WRONLY, 0o644),
        EISDIR,
    );
    pr.expect("open missing", sys_open(&p("missing"), O_RDONLY, 0), ENOENT);
    pr.expect(
        "create in missing dir",
        sys_open(&p("missing/x"), O_CREAT | O_WRONLY, 0o644),
        ENOENT,
    );
    pr.expect("stat f/x", fs::metadata(p("f/x")), ENOTDIR);
    pr.expect("open f/", sys_open(&p("f/"), O_RDONLY, 0), ENOTDIR);
    pr.expect("mkdir f/x", fs::create_dir(p("f/x")), ENOTDIR);
    pr.expect(
        "O_DIRECTORY on f",
        sys_open(&p("f"), O_RDONLY | O_DIRECTORY, 0),
        ENOTDIR,
    );
    pr.expect("open d O_RDONLY", sys_open(&p("d"), O_RDONLY, 0), OK);
    pr.expect("open d O_WRONLY", sys_open(&p("d"), O_WRONLY, 0), EISDIR);
    pr.expect("open d O_RDWR", sys_open(&p("d"), O_RDWR, 0), EISDIR);
    pr.expect("unlink d", fs::remove_file(p("d")), EISDIR);
    pr.expect("rmdir f", fs::remove_dir(p("f")), ENOTDIR);
    pr.expect("truncate d", truncate(&p("d"), 0), EISDIR);
    pr.expect("unlink missing", fs::remove_file(p("missing")), ENOENT);
    pr.expect("rmdir missing", fs::remove_dir(p("missing")), ENOENT);
    pr.expect("rename missing", fs::rename(p("missing"), p("x")), ENOENT);
    pr.expect("readlink f", fs::read_link(p("f")), EINVAL);
    std::os::unix::fs::symlink("f", p("lnk")).unwrap();
    let lnk = cstr(&p("lnk"));
    pr.expect(
        "fchmodat(AT_SYMLINK_NOFOLLOW) of a symlink",
        // SAFETY: a valid C string.
        cvt(unsafe {
            libc::fchmodat(
                libc::AT_FDCWD,
                lnk.as_ptr(),
                0o600,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        }),
        libc::EOPNOTSUPP,
    );
    // SAFETY: a valid C string.
    let x_ok = |path: &Path| cvt(unsafe { libc::access(cstr(path).as_ptr(), libc::X_OK) });
    pr.expect(
        "access(X_OK) of a 0644 file as root",
        x_ok(&p("f")),
        libc::EACCES,
    );
    pr.expect("access(X_OK) of a directory as root", x_ok(&p("d")), OK);
    // ENOTEMPTY, EINVAL, EISDIR/ENOTDIR of rename.
    pr.expect("mkdir d/sub", fs::create_dir(p("d/sub")), OK);
    pr.expect("write d/sub/x", fs::write(p("d/sub/x"), b"x"), OK);
    pr.expect("rmdir d (not empty)", fs::remove_dir(p("d")), ENOTEMPTY);
    pr.expect("rmdir d/.", fs::remove_dir(p("d/.")), EINVAL);
    pr.expect("rmdir d/..", fs::remove_dir(p("d/..")), ENOTEMPTY);
    pr.expect(
        "rename d into d/sub",
        fs::rename(p("d"), p("d/sub/inner")),
        EINVAL,
    );
    pr.expect("rename d into d", fs::rename(p("d"), p("d/self")), EINVAL);
    pr.expect("mkdir e", fs::create_dir(p("e")), OK);
    pr.expect(
        "rename e over d (not empty)",
        fs::rename(p("e"), p("d")),
        ENOTEMPTY,
    );
    pr.expect(
        "rename d/sub over e (empty)",
        fs::rename(p("d/sub"), p("e")),
        OK,
    );
    pr.check("e now holds x", p("e/x").exists() && !p("d/sub").exists());
    pr.expect(
        "rename f over d (a dir)",
        fs::rename(p("f"), p("d")),
        EISDIR,
    );
    pr.expect(
        "rename d over f (a file)",
        fs::rename(p("d"), p("f")),
        ENOTDIR,
    );
    pr.expect("rename f to itself", fs::rename(p("f"), p("f")), OK);
    pr.expect("link d", fs::hard_link(p("d"), p("dl")), EPERM);
    pr.expect("link f over new", fs::hard_link(p("f"), p("new")), EEXIST);
    pr.expect(
        "symlink over f",
        std::os::unix::fs::symlink("x", p("f")),
        EEXIST,
    );
    // Not EXDEV: one mount is one file system, across directories too.
    pr.expect("rename f to d/f", fs::rename(p("f"), p("d/f")), OK);
    pr.expect("rename d/f back", fs::rename(p("d/f"), p("f")), OK);
    // ENAMETOOLONG.
    let n255 = "n".repeat(255);
    let n256 = "n".repeat(256);
    pr.expect("create 255-byte name", fs::write(p(&n255), b""), OK);
    pr.expect(
        "create 256-byte name",
        fs::write(p(&n256), b""),
        ENAMETOOLONG,
    );
    pr.expect("stat 256-byte name", fs::metadata(p(&n256)), ENAMETOOLONG);
    pr.expect(
        "mkdir 256-byte name",
        fs::create_dir(p(&n256)),
        ENAMETOOLONG,
    );
    pr.expect(
        "rename to 256-byte name",
        fs::rename(p(&n255), p(&n256)),
        ENAMETOOLONG,
    );
    pr.expect(
        "symlink to 256-byte name",
        std::os::unix::fs::symlink("t", p(&n256)),
        ENAMETOOLONG,
    );
    pr.expect(
        "symlink with a 4095-byte target",
        std::os::unix::fs::symlink("t".repeat(4095), p("longlink")),
        OK,
    );
    pr.note(
        "its target's length",
        fs::read_link(p("longlink"))
            .map(|t| t.as_os_str().len())
            .ok(),
    );
    pr.expect(
        "symlink with a 4096-byte target",
        std::os::unix::fs::symlink("t".repeat(4096), p("toolong")),
        ENAMETOOLONG,
    );
    // Symlinks: loops, O_NOFOLLOW, dangling targets.
    pr.expect(
        "symlink loop1",
        std::os::unix::fs::symlink("loop2", p("loop1")),
        OK,
    );
    pr.expect(
        "symlink loop2",
        std::os::unix::fs::symlink("loop1", p("loop2")),
        OK,
    );
    pr.expect("open loop1", sys_open(&p("loop1"), O_RDONLY, 0), ELOOP);
    pr.expect(
        "symlink sl -> f",
        std::os::unix::fs::symlink("f", p("sl")),
        OK,
    );
    pr.expect(
        "O_NOFOLLOW on sl",
        sys_open(&p("sl"), O_RDONLY | O_NOFOLLOW, 0),
        ELOOP,
    );
    pr.expect(
        "O_PATH|O_NOFOLLOW on sl",
        sys_open(&p("sl"), O_PATH | O_NOFOLLOW, 0),
        OK,
    );
    pr.expect(
        "symlink dangling -> made",
        std::os::unix::fs::symlink("made", p("dangling")),
        OK,
    );
    pr.expect("stat dangling", fs::metadata(p("dangling")), ENOENT);
    pr.expect("lstat dangling", fs::symlink_metadata(p("dangling")), OK);
    pr.expect(
        "O_CREAT|O_EXCL via dangling",
        sys_open(&p("dangling"), O_CREAT | O_EXCL | O_WRONLY, 0o644),
        EEXIST,
    );
    pr.expect(
        "O_CREAT via dangling creates its target",
        sys_open(&p("dangling"), O_CREAT | O_WRONLY, 0o600),
        OK,
    );
    pr.check("made exists", p("made").is_file());
    pr.note(
        "made's mode",
        fs::metadata(p("made")).map(|m| m.mode() & 0o7777).ok(),
    );
    // Link counts through link, unlink and rename.
    pr.expect("write a", fs::write(p("a"), b"A"), OK);
    pr.note("nlink a", pr.nlink("a"));
    pr.expect("link a b", fs::hard_link(p("a"), p("b")), OK);
    pr.expect("link a d/c", fs::hard_link(p("a"), p("d/c")), OK);
    pr.note(
        "nlink a, b, d/c",
        (pr.nlink("a"), pr.nlink("b"), pr.nlink("d/c")),
    );
    pr.check(
        "a, b, d/c are one inode",
        pr.ino("a") == pr.ino("b") && pr.ino("a") == pr.ino("d/c"),
    );
    pr.expect("unlink b", fs::remove_file(p("b")), OK);
    pr.note("nlink a after unlink b", pr.nlink("a"));
    pr.expect(
        "rename d/c over a (same inode)",
        fs::rename(p("d/c"), p("a")),
        OK,
    );
    pr.check(
        "both names stay",
        p("a").exists() && p("d/c").exists() && pr.nlink("a") == 2,
    );
    pr.expect("write v", fs::write(p("v"), b"victim"), OK);
    pr.expect("link v v2", fs::hard_link(p("v"), p("v2")), OK);
    let a_ino = pr.ino("a");
    pr.expect("rename a over v", fs::rename(p("a"), p("v")), OK);
    pr.check("v is a's inode", pr.ino("v") == a_ino);
    pr.note(
        "v's data",
        String::from_utf8_lossy(&pr.read("v")).to_string(),
    );
    pr.note("nlink v2 (the replaced inode)", pr.nlink("v2"));
    pr.note("nlink v", pr.nlink("v"));
    pr.check("a is gone", !p("a").exists());
    // Directory link counts.
    pr.note("nlink base", pr.nlink(""));
    pr.expect("mkdir p1", fs::create_dir(p("p1")), OK);
    pr.expect("mkdir p2", fs::create_dir(p("p2")), OK);
    pr.expect("mkdir p1/m", fs::create_dir(p("p1/m")), OK);
    pr.note(
        "nlink base, p1, p2",
        (pr.nlink(""), pr.nlink("p1"), pr.nlink("p2")),
    );
    pr.expect("rename p1/m p2/m", fs::rename(p("p1/m"), p("p2/m")), OK);
    pr.note(
        "nlink p1, p2, p2/m",
        (pr.nlink("p1"), pr.nlink("p2"), pr.nlink("p2/m")),
    );
    pr.check("p2/m/.. is p2", pr.ino("p2/m/..") == pr.ino("p2"));
    pr.expect("rmdir p2/m", fs::remove_dir(p("p2/m")), OK);
    pr.note("nlink p2 after rmdir", pr.nlink("p2"));
    // renameat2 flags.
    pr.expect("write r1", fs::write(p("r1"), b"r1"), OK);
    pr.expect("write r2", fs::write(p("r2"), b"r2"), OK);
    pr.expect(
        "RENAME_NOREPLACE over r2",
        renameat2(&p("r1"), &p("r2"), RENAME_NOREPLACE),
        EEXIST,
    );
    pr.expect(
        "RENAME_NOREPLACE to r3",
        renameat2(&p("r1"), &p("r3"), RENAME_NOREPLACE),
        OK,
    );
    pr.expect(
        "RENAME_EXCHANGE r3 and r2",
        renameat2(&p("r3"), &p("r2"), RENAME_EXCHANGE),
        OK,
    );
    pr.note("r2, r3", (pr.read("r2"), pr.read("r3")));
    pr.expect(
        "RENAME_EXCHANGE r2 and dir p2",
        renameat2(&p("r2"), &p("p2"), RENAME_EXCHANGE),
        OK,
    );
    pr.check(
        "r2 is a directory, p2 a file",
        p("r2").is_dir() && p("p2").is_file(),
    );
    pr.expect(
        "RENAME_EXCHANGE with a missing name",
        renameat2(&p("r3"), &p("nothing"), RENAME_EXCHANGE),
        ENOENT,
    );
    pr.expect(
        "RENAME_EXCHANGE|RENAME_NOREPLACE",
        renameat2(&p("r3"), &p("p2"), RENAME_EXCHANGE | RENAME_NOREPLACE),
        EINVAL,
    );
    pr.expect(
        "RENAME_EXCHANGE of a dir and a file in another dir",
        renameat2(&p("d"), &p("e/x"), RENAME_EXCHANGE),
        OK,
    );
    pr.check("d and e/x swapped", p("e/x").is_dir() && p("d").is_file());
    pr.note("nlink e/x, e", (pr.nlink("e/x"), pr.nlink("e")));
    pr.expect("mkdir q/r", fs::create_dir_all(p("q/r")), OK);
    pr.expect(
        "RENAME_EXCHANGE of a dir with its own subdir",
        renameat2(&p("q"), &p("q/r"), RENAME_EXCHANGE),
        EINVAL,
    );
    pr.expect(
        "RENAME_EXCHANGE of a subdir with its ancestor",
        renameat2(&p("q/r"), &p("q"), RENAME_EXCHANGE),
        EINVAL,
    );
}

/// EACCES and EPERM: root sets up, other users try.
fn permission_steps(pr: &mut Probe) {
    use libc::{EACCES, ENODATA, EPERM, O_CREAT, O_RDONLY, O_WRONLY, UTIME_NOW};
    let base = pr.base.clone();
    let p = |r: &str| at(&base, r);
    fs::create_dir(p("rootonly")).unwrap();
    fs::write(p("rootonly/secret"), b"s").unwrap();
    chmod(&p("rootonly/secret"), 0o600).unwrap();
    fs::write(p("pub"), b"p").unwrap();
    fs::write(p("pub666"), b"p").unwrap();
    chmod(&p("pub666"), 0o666).unwrap();
    fs::create_dir(p("sticky")).unwrap();
    chmod(&p("sticky"), 0o1777).unwrap();
    fs::create_dir(p("mine")).unwrap();
    chown(&p("mine"), 1000, 1000).unwrap();
    // Setuid/setgid files others may write: writes and truncations by anyone without
    // CAP_FSETID kill S_ISUID, and S_ISGID when group-executable.
    for (name, mode) in [
        ("kill-wronly", 0o4777),
        ("kill-rdwr", 0o6777),
        ("kill-truncate", 0o6777),
        ("kill-ftruncate", 0o4777),
        ("kill-root-writes", 0o4777),
    ] {
        fs::write(p(name), b"#!/bin/sh\n").unwrap();
        chmod(&p(name), mode).unwrap();
    }
    let protected =
        fs::read_to_string("/proc/sys/fs/protected_hardlinks").is_ok_and(|s| s.trim() == "1");
    let (log, bad) = as_user(1000, 1000, &[], || {
        let mut pr = Probe::new(&base);
        pr.expect(
            "A opens rootonly/secret",
            sys_open(&p("rootonly/secret"), O_RDONLY, 0),
            EACCES,
        );
        pr.expect(
            "A creates in rootonly",
            sys_open(&p("rootonly/new"), O_CREAT | O_WRONLY, 0o644),
            EACCES,
        );
        pr.expect(
            "A mkdir in rootonly",
            fs::create_dir(p("rootonly/d")),
            EACCES,
        );
        pr.expect("A unlinks pub", fs::remove_file(p("pub")), EACCES);
        pr.expect(
            "A opens pub for writing",
            sys_open(&p("pub"), O_WRONLY, 0),
            EACCES,
        );
        pr.expect("A truncates pub", truncate(&p("pub"), 0), EACCES);
        pr.expect("A chmods pub", chmod(&p("pub"), 0o777), EPERM);
        pr.expect("A chowns pub to A", chown(&p("pub"), 1000, 1000), EPERM);
        pr.expect(
            "A sets explicit times of pub666",
            utimensat(&p("pub666"), ts(1, 0), ts(1, 0), 0),
            EPERM,
        );
        let now = ts(0, UTIME_NOW);
        pr.expect(
            "A touches pub666 (writable)",
            utimensat(&p("pub666"), now, now, 0),
            OK,
        );
        pr.expect(
            "A touches pub (not writable)",
            utimensat(&p("pub"), now, now, 0),
            EACCES,
        );
        pr.expect(
            "A sets a user xattr on pub",
            setxattr(&p("pub"), "user.x", b"1", 0, false),
            EACCES,
        );
        pr.expect(
            "A reads a missing user xattr of pub",
            getxattr(&p("pub"), "user.x"),
            ENODATA,
        );
        pr.expect("A creates mine/f", fs::write(p("mine/f"), b"f"), OK);
        pr.expect("A chmods mine/f", chmod(&p("mine/f"), 0o600), OK);
        pr.expect(
            "A gives mine/f away",
            chown(&p("mine/f"), 1001, 1000),
            EPERM,
        );
        pr.expect(
            "A sets mine/f's group to one A is not in",
            chown(&p("mine/f"), 1000, 2000),
            EPERM,
        );
        pr.expect("A creates sticky/a", fs::write(p("sticky/a"), b"a"), OK);
        pr.expect(
            "A hard-links pub (neither owner nor writer)",
            fs::hard_link(p("pub"), p("mine/pub-link")),
            if protected { EPERM } else { OK },
        );
        pr.expect(
            "A renames mine/f into rootonly",
            fs::rename(p("mine/f"), p("rootonly/f")),
            EACCES,
        );
        (pr.log, pr.bad)
    });
    pr.log.extend(log);
    pr.bad.extend(bad);
    let (log, bad) = as_user(1001, 1001, &[2000], || {
        let mut pr = Probe::new(&base);
        pr.expect(
            "B unlinks A's sticky/a",
            fs::remove_file(p("sticky/a")),
            EPERM,
        );
        pr.expect(
            "B renames A's sticky/a",
            fs::rename(p("sticky/a"), p("sticky/b")),
            EPERM,
        );
        pr.expect(
            "B replaces A's sticky/a",
            {
                fs::write(p("sticky/b"), b"b").unwrap();
                fs::rename(p("sticky/b"), p("sticky/a"))
            },
            EPERM,
        );
        pr.expect(
            "B unlinks its own sticky/b",
            fs::remove_file(p("sticky/b")),
            OK,
        );
        pr.expect(
            "B opens A's mine/f (0600)",
            sys_open(&p("mine/f"), O_RDONLY, 0),
            EACCES,
        );
        pr.expect("B chmods A's mine/f", chmod(&p("mine/f"), 0o644), EPERM);
        pr.expect("B creates in A's mine", fs::write(p("mine/b"), b""), EACCES);
        let open = |name: &str, o: &mut fs::OpenOptions| o.open(p(name));
        let w = open("kill-wronly", fs::OpenOptions::new().append(true));
        pr.expect(
            "B writes kill-wronly",
            w.and_then(|mut f| f.write_all(b"x")),
            OK,
        );
        let w = open("kill-rdwr", fs::OpenOptions::new().read(true).write(true));
        pr.expect(
            "B writes kill-rdwr",
            w.and_then(|mut f| f.write_all(b"x")),
            OK,
        );
        pr.expect(
            "B truncates kill-truncate",
            truncate(&p("kill-truncate"), 1),
            OK,
        );
        let w = open("kill-ftruncate", fs::OpenOptions::new().write(true));
        pr.expect(
            "B ftruncates kill-ftruncate",
            w.and_then(|f| f.set_len(2)),
            OK,
        );
        for name in [
            "kill-wronly",
            "kill-rdwr",
            "kill-truncate",
            "kill-ftruncate",
        ] {
            pr.note(
                &format!("mode of {name} at once"),
                statx_mode(&p(name)).ok(),
            );
        }
        (pr.log, pr.bad)
    });
    pr.log.extend(log);
    pr.bad.extend(bad);
    pr.expect("root unlinks sticky/a", fs::remove_file(p("sticky/a")), OK);
    pr.expect(
        "root opens secret",
        sys_open(&p("rootonly/secret"), O_RDONLY, 0),
        OK,
    );
    pr.expect("root chowns mine/f", chown(&p("mine/f"), 1001, 1001), OK);
    let w = fs::OpenOptions::new()
        .write(true)
        .open(p("kill-root-writes"));
    pr.expect(
        "root writes kill-root-writes",
        w.and_then(|mut f| f.write_all(b"x")),
        OK,
    );
    pr.note(
        "mode of kill-root-writes",
        statx_mode(&p("kill-root-writes")).ok(),
    );
    pr.note(
        "mode of kill-wronly later",
        statx_mode(&p("kill-wronly")).ok(),
    );
}

#[test]
fn posix_errno_link_count_and_rename_rules_match_ext4() {
    let b = Bench::new();
    let (l, m) = (b.local(), b.mnt());
    for d in ["errno", "perm"] {
        fs::create_dir(l.join(d)).unwrap();
        fs::create_dir(m.join(d)).unwrap();
    }
    compare_probes(
        "errno rules",
        &l.join("errno"),
        &m.join("errno"),
        errno_steps,
    );
    compare_probes(
        "EACCES/EPERM rules",
        &l.join("perm"),
        &m.join("perm"),
        permission_steps,
    );
    // Between file systems it is EXDEV: the mount and the local disk, two mounts.
    fs::write(m.join("x"), b"x").unwrap();
    let e = fs::rename(m.join("x"), l.join("x")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    let e = fs::rename(m.join("x"), other.mnt.join("y")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
    let e = fs::hard_link(m.join("x"), other.mnt.join("y")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
}

// ---------------------------------------------------------------------------------------
// Data calls.

fn pread(f: &fs::File, off: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let n = std::os::unix::fs::FileExt::read_at(f, &mut buf, off).unwrap();
    buf.truncate(n);
    buf
}

fn data_steps(pr: &mut Probe) {
    use libc::{
        EBADF, EINVAL, EOPNOTSUPP, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE,
        MAP_FAILED, MAP_SHARED, MS_SYNC, O_RDONLY, O_TRUNC, O_WRONLY, PROT_READ, PROT_WRITE,
    };
    use std::os::unix::fs::FileExt;
    let base = pr.base.clone();
    let p = |r: &str| at(&base, r);
    let rw = |path: &Path| {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    };
    // O_APPEND: every write lands at the end, whatever the offset.
    fs::write(p("log"), b"abc").unwrap();
    let mut a1 = fs::OpenOptions::new().append(true).open(p("log")).unwrap();
    let mut a2 = fs::OpenOptions::new().append(true).open(p("log")).unwrap();
    a1.write_all(b"1").unwrap();
    a2.write_all(b"22").unwrap();
    a1.write_all(b"333").unwrap();
    pr.expect("pwrite at 0 on O_APPEND", a2.write_at(b"4", 0), OK);
    drop((a1, a2));
    pr.note(
        "appended",
        String::from_utf8_lossy(&pr.read("log")).to_string(),
    );
    // O_TRUNC.
    let f = sys_open(&p("log"), O_WRONLY | O_TRUNC, 0);
    pr.expect("open O_TRUNC", f, OK);
    pr.note("size after O_TRUNC", fs::metadata(p("log")).unwrap().len());
    pr.expect(
        "O_RDONLY|O_TRUNC of an empty file",
        sys_open(&p("log"), O_RDONLY | O_TRUNC, 0),
        OK,
    );
    // pwrite and pread at offsets, holes, EOF.
    let f = rw(&{
        fs::write(p("data"), b"0123456789").unwrap();
        p("data")
    });
    pr.expect("pwrite at 5000", f.write_at(b"XY", 5000), OK);
    pr.note("size", f.metadata().unwrap().len());
    pr.note("pread 4999..5003", pread(&f, 4999, 4));
    pr.note("pread in the hole", pread(&f, 10, 8));
    pr.note("pread at EOF", pread(&f, 5002, 8));
    pr.note("pread past EOF", pread(&f, 9000, 8));
    pr.note("pread across the start", pread(&f, 0, 12));
    pr.expect("pwrite at 3", f.write_at(b"abc", 3), OK);
    pr.note("pread 0..10", pread(&f, 0, 10));
    // A write past a chunk-sized hole.
    pr.expect("pwrite at 9 MiB", f.write_at(b"far", 9 << 20), OK);
    pr.note("size", f.metadata().unwrap().len());
    pr.check(
        "the hole reads as zeros",
        pread(&f, 6000, 1 << 20).iter().all(|&b| b == 0),
    );
    // ftruncate down and up: the old bytes do not come back.
    pr.expect("ftruncate to 4", f.set_len(4), OK);
    pr.expect("ftruncate to 5000", f.set_len(5000), OK);
    pr.note("after truncate down and up", pread(&f, 0, 8));
    pr.check(
        "the rest is zeros",
        pread(&f, 4, 6000).iter().all(|&b| b == 0) && pread(&f, 4, 6000).len() == 4996,
    );
    pr.expect("truncate(2) to 100", truncate(&p("data"), 100), OK);
    pr.note("size", fs::metadata(p("data")).unwrap().len());
    pr.expect("truncate(2) to -1", truncate(&p("data"), -1), EINVAL);
    // lseek.
    let mut g = rw(&p("data"));
    pr.note(
        "SEEK_END",
        io::Seek::seek(&mut g, io::SeekFrom::End(-10)).unwrap(),
    );
    pr.expect("write at the seek position", g.write_all(b"END"), OK);
    pr.note("tail", pread(&g, 88, 12));
    drop(g);
    // fallocate: mode 0 extends, KEEP_SIZE does not, PUNCH_HOLE and ZERO_RANGE zero.
    fs::write(p("falloc"), vec![b'x'; 10000]).unwrap();
    let h = rw(&p("falloc"));
    pr.expect("fallocate 0..64K", fallocate(&h, 0, 0, 65536), OK);
    pr.note("size", h.metadata().unwrap().len());
    pr.check(
        "data kept, the extension zero",
        pread(&h, 0, 10000).iter().all(|&b| b == b'x')
            && pread(&h, 10000, 60000).iter().all(|&b| b == 0),
    );
    pr.expect(
        "fallocate KEEP_SIZE past the end",
        fallocate(&h, FALLOC_FL_KEEP_SIZE, 60000, 100000),
        OK,
    );
    pr.note("size", h.metadata().unwrap().len());
    pr.expect(
        "PUNCH_HOLE|KEEP_SIZE 100..200",
        fallocate(&h, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 100, 100),
        OK,
    );
    pr.note("around the hole", pread(&h, 98, 104));
    pr.note("size", h.metadata().unwrap().len());
    pr.expect(
        "PUNCH_HOLE without KEEP_SIZE",
        fallocate(&h, FALLOC_FL_PUNCH_HOLE, 0, 10),
        EOPNOTSUPP,
    );
    pr.expect(
        "ZERO_RANGE 1000..1010",
        fallocate(&h, FALLOC_FL_ZERO_RANGE, 1000, 10),
        OK,
    );
    pr.note("around the zeroed range", pread(&h, 998, 14));
    pr.expect(
        "ZERO_RANGE past the end",
        fallocate(&h, FALLOC_FL_ZERO_RANGE, 65000, 2000),
        OK,
    );
    pr.note("size", h.metadata().unwrap().len());
    pr.expect("fallocate of 0 bytes", fallocate(&h, 0, 0, 0), EINVAL);
    pr.expect(
        "fallocate at a negative offset",
        fallocate(&h, 0, -1, 10),
        EINVAL,
    );
    let ro = fs::File::open(p("falloc")).unwrap();
    pr.expect(
        "fallocate on a read-only fd",
        fallocate(&ro, 0, 0, 10),
        EBADF,
    );
    // Access modes of descriptors.
    let mut buf = [0u8; 4];
    pr.expect("write on O_RDONLY", (&ro).write(b"x"), EBADF);
    let wo = fs::OpenOptions::new()
        .write(true)
        .open(p("falloc"))
        .unwrap();
    pr.expect("read on O_WRONLY", (&wo).read(&mut buf), EBADF);
    pr.expect("fsync", h.sync_all(), OK);
    pr.expect("fdatasync", h.sync_data(), OK);
    pr.expect("fsync of a read-only fd", ro.sync_all(), OK);
    // A shared writable mapping reaches the file.
    fs::write(p("mapped"), vec![b'.'; 8192]).unwrap();
    let mf = rw(&p("mapped"));
    // SAFETY: a fresh mapping of an open file, written within its length, then unmapped.
    unsafe {
        let ptr = libc::mmap(
            std::ptr::null_mut(),
            8192,
            PROT_READ | PROT_WRITE,
            MAP_SHARED,
            mf.as_raw_fd(),
            0,
        );
        assert_ne!(ptr, MAP_FAILED);
        std::ptr::copy_nonoverlapping(b"mapped!".as_ptr(), ptr.cast::<u8>().add(4096), 7);
        pr.expect("msync", cvt(libc::msync(ptr, 8192, MS_SYNC)), OK);
        libc::munmap(ptr, 8192);
    }
    drop(mf);
    pr.note(
        "read after mmap",
        pread(&fs::File::open(p("mapped")).unwrap(), 4094, 10),
    );
}

#[test]
fn data_calls_match_ext4() {
    let b = Bench::new();
    compare_probes("data calls", &b.local(), &b.mnt(), data_steps);
}

// ---------------------------------------------------------------------------------------
// Extended attributes and statfs.

fn xattr_steps(pr: &mut Probe) {
    use libc::{XATTR_CREATE, XATTR_REPLACE};
    let base = pr.base.clone();
    let p = |r: &str| at(&base, r);
    fs::write(p("f"), b"f").unwrap();
    fs::create_dir(p("d")).unwrap();
    std::os::unix::fs::symlink("f", p("l")).unwrap();
    let f = p("f");
    pr.expect("set user.a", setxattr(&f, "user.a", b"1", 0, false), OK);
    pr.expect(
        "XATTR_CREATE user.a",
        setxattr(&f, "user.a", b"2", XATTR_CREATE, false),
        libc::EEXIST,
    );
    pr.expect(
        "XATTR_REPLACE user.b",
        setxattr(&f, "user.b", b"2", XATTR_REPLACE, false),
        libc::ENODATA,
    );
    pr.expect(
        "XATTR_REPLACE user.a",
        setxattr(&f, "user.a", b"22", XATTR_REPLACE, false),
        OK,
    );
    pr.expect(
        "XATTR_CREATE user.b",
        setxattr(&f, "user.b", b"", XATTR_CREATE, false),
        OK,
    );
    pr.expect(
        "XATTR_CREATE|XATTR_REPLACE",
        setxattr(&f, "user.c", b"", XATTR_CREATE | XATTR_REPLACE, false),
        libc::ENODATA,
    );
    let _ = removexattr(&f, "user.c");
    pr.note("get user.a", getxattr(&f, "user.a").ok());
    pr.note("get user.b (empty)", getxattr(&f, "user.b").ok());
    pr.note(
        "size of user.a",
        getxattr_sized(&f, "user.a", 0).ok().map(|x| x.0),
    );
    pr.expect(
        "get user.a into 1 byte",
        getxattr_sized(&f, "user.a", 1),
        libc::ERANGE,
    );
    pr.expect(
        "get user.missing",
        getxattr(&f, "user.missing"),
        libc::ENODATA,
    );
    pr.note("list", listxattr(&f).ok());
    pr.expect("remove user.a", removexattr(&f, "user.a"), OK);
    pr.expect(
        "remove user.a again",
        removexattr(&f, "user.a"),
        libc::ENODATA,
    );
    pr.note("list after remove", listxattr(&f).ok());
    // (ext4 keeps values in one block unless it has ea_inode: no 64 KiB values there.)
    let big = vec![7u8; 2000];
    pr.expect(
        "2000-byte value",
        setxattr(&f, "user.big", &big, 0, false),
        OK,
    );
    pr.check(
        "2000-byte value back",
        getxattr(&f, "user.big").ok() == Some(big),
    );
    pr.expect(
        "value over 64 KiB",
        setxattr(&f, "user.huge", &vec![0; 65537], 0, false),
        libc::E2BIG,
    );
    pr.expect(
        "255-byte name",
        setxattr(&f, &format!("user.{}", "n".repeat(250)), b"", 0, false),
        OK,
    );
    pr.expect(
        "256-byte name",
        setxattr(&f, &format!("user.{}", "n".repeat(251)), b"", 0, false),
        libc::ERANGE,
    );
    pr.expect(
        "unknown namespace",
        setxattr(&f, "other.x", b"", 0, false),
        libc::EOPNOTSUPP,
    );
    pr.expect(
        "trusted.x as root",
        setxattr(&f, "trusted.x", b"t", 0, false),
        OK,
    );
    pr.note("trusted.x", getxattr(&f, "trusted.x").ok());
    pr.expect(
        "user.d on a directory",
        setxattr(&p("d"), "user.d", b"dir", 0, false),
        OK,
    );
    pr.note("list d", listxattr(&p("d")).ok());
    pr.expect(
        "user.l on a symlink itself",
        setxattr(&p("l"), "user.l", b"", 0, true),
        libc::EPERM,
    );
    pr.expect(
        "user.l through a symlink",
        setxattr(&p("l"), "user.l", b"x", 0, false),
        OK,
    );
    pr.note("list f", listxattr(&f).ok());
    // Attributes survive a rename and a hard link shares them.
    fs::rename(&f, p("g")).unwrap();
    fs::hard_link(p("g"), p("h")).unwrap();
    pr.note("user.l via h", getxattr(&p("h"), "user.l").ok());
}

#[test]
fn xattrs_and_statfs_match_ext4() {
    let b = Bench::new();
    compare_probes("xattrs", &b.local(), &b.mnt(), xattr_steps);
    let m = b.mnt();
    assert_eq!(statfs_type(&m), Some(FUSE_SUPER_MAGIC));
    let c = cstr(&m);
    // SAFETY: a valid C string and an out-parameter of the right type.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    assert_eq!(s.f_namemax, 255);
    assert!(s.f_bsize > 0 && s.f_frsize > 0);
    assert!(
        s.f_files > 0 && s.f_ffree <= s.f_files,
        "{} {}",
        s.f_files,
        s.f_ffree
    );
    assert!(s.f_bavail <= s.f_bfree && s.f_bfree <= s.f_blocks);
    // Creating files uses up inodes.
    let before = s.f_ffree;
    for i in 0..10 {
        fs::write(m.join(format!("n{i}")), b"").unwrap();
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    assert_eq!(
        before - s.f_ffree,
        10,
        "free inodes go down by the files made"
    );
    let df = sh(
        &m,
        "df -P . | tail -1; df -i . | tail -1; stat -f -c '%l %S' .",
    );
    // The mount's source is the cluster's address.
    assert!(df.contains(&b.c.server.addr.to_string()), "{df}");
    assert!(df.ends_with("255 4096\n"), "{df}");
}

// ---------------------------------------------------------------------------------------
// Timestamps.

/// (atime, mtime, ctime) of `p`, not following symlinks, in nanoseconds.
fn times(p: &Path) -> [i128; 3] {
    let m = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
    [
        ns(m.atime(), m.atime_nsec()),
        ns(m.mtime(), m.mtime_nsec()),
        ns(m.ctime(), m.ctime_nsec()),
    ]
}

/// Runs `op` and records which of atime, mtime and ctime changed for each of `watch`.
fn timed(pr: &mut Probe, what: &str, watch: &[&str], op: impl FnOnce(&Probe)) {
    // "old>new" watches an inode that the operation moves.
    let before: Vec<_> = watch
        .iter()
        .map(|w| times(&pr.p(w.split('>').next().unwrap())))
        .collect();
    // Longer than the coarse clock ticks of ext4 timestamps.
    std::thread::sleep(Duration::from_millis(15));
    op(pr);
    let mut changed = Vec::new();
    for (w, b) in watch.iter().zip(before) {
        let a = times(&pr.p(w.split('>').next_back().unwrap()));
        let flags: String = ["a", "m", "c"]
            .iter()
            .zip(a.iter().zip(b.iter()))
            .map(|(n, (x, y))| if x != y { *n } else { "-" })
            .collect();
        changed.push(format!("{}={flags}", if w.is_empty() { "." } else { w }));
    }
    pr.log.push(format!("{what}: {}", changed.join(" ")));
}

fn time_steps(pr: &mut Probe) {
    let f = |pr: &Probe, r: &str| pr.p(r);
    fs::create_dir(pr.p("d")).unwrap();
    timed(pr, "create d/f", &["d"], |pr| {
        fs::write(f(pr, "d/f"), b"").unwrap()
    });
    let t = times(&pr.p("d/f"));
    pr.check("a new file's times are equal", t[0] == t[1] && t[1] == t[2]);
    timed(pr, "write", &["d/f", "d"], |pr| {
        fs::OpenOptions::new()
            .write(true)
            .open(f(pr, "d/f"))
            .unwrap()
            .write_all(b"data")
            .unwrap()
    });
    timed(pr, "write of nothing", &["d/f"], |pr| {
        let n = fs::OpenOptions::new()
            .write(true)
            .open(f(pr, "d/f"))
            .unwrap()
            .write(b"")
            .unwrap();
        assert_eq!(n, 0);
    });
    timed(pr, "open for writing, no write", &["d/f"], |pr| {
        drop(
            fs::OpenOptions::new()
                .write(true)
                .open(f(pr, "d/f"))
                .unwrap(),
        )
    });
    timed(pr, "truncate up", &["d/f"], |pr| {
        truncate(&f(pr, "d/f"), 100).unwrap()
    });
    timed(pr, "truncate to the same size", &["d/f"], |pr| {
        truncate(&f(pr, "d/f"), 100).unwrap()
    });
    timed(pr, "ftruncate down", &["d/f"], |pr| {
        fs::OpenOptions::new()
            .write(true)
            .open(f(pr, "d/f"))
            .unwrap()
            .set_len(10)
            .unwrap()
    });
    timed(pr, "open O_TRUNC", &["d/f", "d"], |pr| {
        drop(
            fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(f(pr, "d/f"))
                .unwrap(),
        )
    });
    timed(pr, "open O_TRUNC of an empty file", &["d/f"], |pr| {
        drop(
            fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(f(pr, "d/f"))
                .unwrap(),
        )
    });
    timed(pr, "chmod", &["d/f", "d"], |pr| {
        chmod(&f(pr, "d/f"), 0o640).unwrap()
    });
    timed(pr, "chown", &["d/f"], |pr| {
        chown(&f(pr, "d/f"), 1000, 1000).unwrap()
    });
    timed(pr, "setxattr", &["d/f"], |pr| {
        setxattr(&f(pr, "d/f"), "user.t", b"1", 0, false).unwrap()
    });
    timed(pr, "removexattr", &["d/f"], |pr| {
        removexattr(&f(pr, "d/f"), "user.t").unwrap()
    });
    let now = ts(0, libc::UTIME_NOW);
    let omit = ts(0, libc::UTIME_OMIT);
    timed(pr, "utimensat NOW NOW", &["d/f"], |pr| {
        utimensat(&f(pr, "d/f"), now, now, 0).unwrap()
    });
    timed(pr, "utimensat NOW OMIT", &["d/f"], |pr| {
        utimensat(&f(pr, "d/f"), now, omit, 0).unwrap()
    });
    timed(pr, "utimensat OMIT NOW", &["d/f"], |pr| {
        utimensat(&f(pr, "d/f"), omit, now, 0).unwrap()
    });
    timed(pr, "utimensat OMIT OMIT", &["d/f"], |pr| {
        utimensat(&f(pr, "d/f"), omit, omit, 0).unwrap()
    });
    timed(pr, "utimensat explicit", &["d/f"], |pr| {
        utimensat(
            &f(pr, "d/f"),
            ts(1_000_000_000, 123),
            ts(1_500_000_000, 456_789),
            0,
        )
        .unwrap()
    });
    let t = times(&pr.p("d/f"));
    pr.note("explicit atime, mtime", (t[0], t[1]));
    timed(pr, "utimensat before 1970", &["d/f"], |pr| {
        utimensat(&f(pr, "d/f"), ts(-1, 5), ts(-86_400 * 365, 0), 0).unwrap()
    });
    let t = times(&pr.p("d/f"));
    pr.note("negative atime, mtime", (t[0], t[1]));
    std::os::unix::fs::symlink("f", pr.p("d/l")).unwrap();
    timed(pr, "utimensat of a symlink itself", &["d/l", "d/f"], |pr| {
        utimensat(&f(pr, "d/l"), ts(7, 0), ts(8, 0), libc::AT_SYMLINK_NOFOLLOW).unwrap()
    });
    let t = times(&pr.p("d/l"));
    pr.note("symlink atime, mtime", (t[0], t[1]));
    timed(pr, "link", &["d/f", "d"], |pr| {
        fs::hard_link(f(pr, "d/f"), f(pr, "d/g")).unwrap()
    });
    timed(pr, "unlink one name", &["d/f", "d"], |pr| {
        fs::remove_file(f(pr, "d/g")).unwrap()
    });
    fs::create_dir(pr.p("e")).unwrap();
    timed(pr, "rename within d", &["d/f>d/f2", "d"], |pr| {
        fs::rename(f(pr, "d/f"), f(pr, "d/f2")).unwrap()
    });
    timed(pr, "rename across dirs", &["d/f2>e/f", "d", "e"], |pr| {
        fs::rename(f(pr, "d/f2"), f(pr, "e/f")).unwrap()
    });
    fs::write(pr.p("e/victim"), b"v").unwrap();
    fs::hard_link(pr.p("e/victim"), pr.p("d/victim-link")).unwrap();
    timed(
        pr,
        "rename over a file",
        &["e/f>e/victim", "d/victim-link", "e"],
        |pr| fs::rename(f(pr, "e/f"), f(pr, "e/victim")).unwrap(),
    );
    timed(pr, "mkdir", &["d"], |pr| {
        fs::create_dir(f(pr, "d/sub")).unwrap()
    });
    timed(
        pr,
        "rename a dir across dirs",
        &["d/sub>e/sub", "d", "e"],
        |pr| fs::rename(f(pr, "d/sub"), f(pr, "e/sub")).unwrap(),
    );
    timed(pr, "rmdir", &["e"], |pr| {
        fs::remove_dir(f(pr, "e/sub")).unwrap()
    });
    timed(pr, "symlink", &["d"], |pr| {
        std::os::unix::fs::symlink("target", f(pr, "d/s")).unwrap()
    });
    timed(pr, "mkfifo", &["d"], |pr| {
        mknod(&f(pr, "d/p"), libc::S_IFIFO | 0o644, 0).unwrap()
    });
    timed(pr, "stat", &["e/victim", "e"], |pr| {
        fs::metadata(f(pr, "e/victim")).unwrap();
    });
    fs::write(pr.p("e/falloc"), b"x").unwrap();
    timed(pr, "fallocate extending", &["e/falloc"], |pr| {
        fallocate(
            &fs::OpenOptions::new()
                .write(true)
                .open(f(pr, "e/falloc"))
                .unwrap(),
            0,
            0,
            8192,
        )
        .unwrap()
    });
    timed(pr, "fallocate PUNCH_HOLE", &["e/falloc"], |pr| {
        fallocate(
            &fs::OpenOptions::new()
                .write(true)
                .open(f(pr, "e/falloc"))
                .unwrap(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            4096,
        )
        .unwrap()
    });
    timed(pr, "unlink last name", &["e"], |pr| {
        fs::remove_file(f(pr, "e/victim")).unwrap()
    });
}

#[test]
fn timestamps_change_as_on_ext4() {
    let b = Bench::new();
    compare_probes("timestamps", &b.local(), &b.mnt(), time_steps);
}

/// Reading a file updates its atime under relatime rules, as ext4 does: the first read
/// after a change (and after a day), not every read.
#[test]
fn reads_update_atime_as_relatime() {
    let b = Bench::new();
    compare_probes("atime of reads", &b.local(), &b.mnt(), |pr| {
        fs::create_dir(pr.p("d")).unwrap();
        fs::write(pr.p("d/f"), b"data").unwrap();
        timed(pr, "read", &["d/f"], |pr| {
            fs::read(pr.p("d/f")).unwrap();
        });
        timed(pr, "second read", &["d/f"], |pr| {
            fs::read(pr.p("d/f")).unwrap();
        });
        let t = times(&pr.p("d/f"));
        pr.check("atime after mtime after a read", t[0] > t[1]);
    });
}

/// KNOWN GAP: readdir does not update a directory's atime on the mount (reads of files do).
#[test]
#[ignore = "KNOWN GAP: readdir does not update a directory's atime on the mount"]
fn readdir_updates_atime_as_relatime() {
    let b = Bench::new();
    compare_probes("atime of readdir", &b.local(), &b.mnt(), |pr| {
        fs::create_dir(pr.p("d")).unwrap();
        fs::write(pr.p("d/f"), b"data").unwrap();
        timed(pr, "readdir", &["d"], |pr| {
            fs::read_dir(pr.p("d")).unwrap().for_each(drop);
        });
    });
}

/// A write by someone outside the file's group drops S_ISGID of a setgid file without group
/// execute, as ext4 (setattr_should_drop_sgid) does, and the mount shows it at once.
#[test]
fn a_write_by_a_non_member_drops_setgid_without_group_execute() {
    let b = Bench::new();
    compare_probes("setgid kill", &b.local(), &b.mnt(), |pr| {
        let p = pr.p("sgid-no-gx");
        fs::write(&p, b"x").unwrap();
        chmod(&p, 0o2767).unwrap();
        let base = pr.base.clone();
        let (log, bad) = as_user(1001, 1001, &[], || {
            let mut pr = Probe::new(&base);
            let w = fs::OpenOptions::new().append(true).open(pr.p("sgid-no-gx"));
            pr.expect(
                "a non-member appends",
                w.and_then(|mut f| f.write_all(b"y")),
                OK,
            );
            (pr.log, pr.bad)
        });
        pr.log.extend(log);
        pr.bad.extend(bad);
        pr.note("mode", statx_mode(&p).ok());
        std::thread::sleep(Duration::from_millis(1100));
        pr.note("mode after attr_ttl", statx_mode(&p).ok());
    });
}

/// KNOWN GAP: st_blocks counts holes as allocated (the servers derive it from the size), so
/// `du` of a sparse file shows its full length where ext4 shows what is written, and
/// copiers that look for holes by st_blocks (cp --sparse=auto, tar -S) see none.
#[test]
#[ignore = "KNOWN GAP: st_blocks of a sparse file counts its holes"]
fn sparse_files_report_only_written_blocks() {
    let b = Bench::new();
    let mut outs = Vec::new();
    for (_, base) in b.sides() {
        outs.push(sh(
            &base,
            "truncate -s 64M sparse; printf x | dd of=sparse bs=1 seek=32M conv=notrunc \
             status=none; du -k sparse; stat -c '%s %b' sparse",
        ));
    }
    assert_same("a sparse file's blocks", &outs[0], &outs[1]);
}

/// Inode ids are reused (a directory's file allocator restarts when it becomes empty), but
/// only after a quarantine longer than a mount caches names, so a name removed on another
/// mount never reaches a newer file that got the same id. Here mount B must not read the
/// data of a newer file through the name `x` that mount A removed: neither of `y`, made
/// within the quarantine (so with another id), nor of `z`, made after it with `x`'s id.
#[test]
fn a_removed_name_never_reaches_a_newer_file_with_its_id() {
    let b = Bench::new();
    let other = b.c.mount_again(&b.tmp.path().join("mnt2"));
    let (a, o) = (b.mnt().join("d"), other.mnt.join("d"));
    let x_on_b_is_gone = |after: &str| match fs::read(o.join("x")) {
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "x after {after}"),
        Ok(data) => panic!(
            "read x, removed on the other mount, got {:?} after {after}",
            String::from_utf8_lossy(&data)
        ),
    };
    fs::create_dir(&a).unwrap();
    fs::write(a.join("x"), b"the file x").unwrap();
    assert_eq!(fs::read(o.join("x")).unwrap(), b"the file x");
    let old = fs::metadata(a.join("x")).unwrap().ino();
    fs::remove_file(a.join("x")).unwrap();
    fs::write(a.join("y"), b"the file y").unwrap();
    let y = fs::metadata(a.join("y")).unwrap().ino();
    assert_ne!(y, old, "x's id was handed out again within its quarantine");
    x_on_b_is_gone("y was made");
    // Past the quarantine, with the directory empty again, its allocator restarts: the
    // next file gets x's id.
    fs::remove_file(a.join("y")).unwrap();
    let quarantine = Duration::from_nanos(kochab_meta::engine::QUARANTINE_NS.unsigned_abs());
    std::thread::sleep(quarantine + Duration::from_secs(1));
    fs::write(a.join("z"), b"the file z").unwrap();
    assert_eq!(
        fs::metadata(a.join("z")).unwrap().ino(),
        old,
        "x's id is reused once its quarantine is over"
    );
    x_on_b_is_gone("z got its id");
}
