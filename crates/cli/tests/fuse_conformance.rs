//! What xfstests found through the mount, checked without xfstests: a mount process never
//! unmounts a mount it did not make; flock, POSIX and OFD locks behave as on Linux (kept
//! apart, released at the right close, a waiting lock ended by a signal); a completed
//! direct write is what every later read sees.
//!
//! Lock steps run on a local directory first (ext4 on the CI machines, the reference) and
//! then on the mount, so a wrong expectation fails on the local side.

mod common;

use common::{Cluster, MountProc, errno_name, force_unmount, is_mounted};
use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn open_rw(p: &Path) -> fs::File {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(p)
        .unwrap()
}

fn errno_of(r: libc::c_int) -> String {
    if r == 0 {
        "ok".into()
    } else {
        errno_name(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// fcntl(fd, cmd, {typ, whole file}): "ok" or the errno's name.
fn fcntl_lock(fd: RawFd, cmd: i32, typ: i32) -> String {
    errno_of(common::fcntl_lock(fd, cmd, typ, 0, 0))
}

fn flock(fd: RawFd, op: i32) -> String {
    // SAFETY: flock(2) on a valid descriptor.
    errno_of(unsafe { libc::flock(fd, op) })
}

/// Runs `steps` on a local directory and on the mount; both must give `want`.
fn on_both(c: &Cluster, tmp: &Path, want: &[&str], steps: impl Fn(&Path) -> Vec<String>) {
    let local = tmp.join("local");
    fs::create_dir_all(&local).unwrap();
    assert_eq!(steps(&local), want, "local (reference) side");
    assert_eq!(steps(&c.mnt), want, "mount");
}

// ---------------------------------------------------------------------------------------
// Defect 1: a mount process unmounts only the mount it made.

/// The old mount is unmounted lazily while a file on it stays open, so its process lives
/// on; a new mount is made at the same path; then the file is closed, the old connection
/// ends and its process exits. The new mount must still be there (fuser 0.18 unmounted the
/// path on the way out, removing the new mount, and the next writer wrote into the local
/// directory underneath).
#[test]
fn an_exiting_mount_process_leaves_a_new_mount_at_its_path_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let dir = tmp.path().join("shared-path");
    let key = c.server.data.join("cluster.key");
    let mut old = MountProc::start(c.server.addr, &key, &dir);
    let held = fs::File::create(dir.join("held")).unwrap();
    assert!(
        Command::new("umount")
            .arg("-l")
            .arg(&dir)
            .status()
            .unwrap()
            .success()
    );
    assert!(!is_mounted(&dir));
    let new = MountProc::start(c.server.addr, &key, &dir);
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(20);
    while matches!(old.child.try_wait(), Ok(None)) {
        assert!(
            Instant::now() < deadline,
            "the old mount process did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Give a wrong unmount every chance to happen.
    std::thread::sleep(Duration::from_millis(500));
    assert!(is_mounted(&dir), "the new mount was removed");
    fs::write(dir.join("after"), b"on the cluster").unwrap();
    assert_eq!(
        fs::read(c.mnt.join("after")).unwrap(),
        b"on the cluster",
        "the write reached the cluster, not the directory under the mount"
    );
    drop(new);
    force_unmount(&dir);
    let _ = old.child.wait();
}

// ---------------------------------------------------------------------------------------
// Defect 2: locks.

/// An OFD lock belongs to its open file description: a dup'ed descriptor keeps it, the
/// last close ends it.
#[test]
fn ofd_locks_end_with_the_last_close_of_their_description() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    on_both(&c, tmp.path(), &["ok", "EAGAIN", "EAGAIN", "ok"], |dir| {
        let p = dir.join("ofd");
        let a = open_rw(&p);
        let b = open_rw(&p);
        let mut out = vec![fcntl_lock(a.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK)];
        let a2 = a.try_clone().unwrap();
        out.push(fcntl_lock(b.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK));
        drop(a);
        out.push(fcntl_lock(b.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK));
        drop(a2);
        // The kernel sends FUSE's RELEASE of the last close in the background, after
        // close(2) has returned, so on a busy machine the servers may see this attempt
        // first: the lock must be free once the release arrives (within the bound), never
        // leaked. A blocking F_OFD_SETLKW just waits for it. (A known difference from a
        // local file system, in docs/ARCHITECTURE.md.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let last = loop {
            let r = fcntl_lock(b.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK);
            if r != "EAGAIN" || std::time::Instant::now() > deadline {
                break r;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        out.push(last);
        out
    });
}

/// A POSIX lock belongs to the process: closing any descriptor of the file ends it (seen
/// from an OFD lock of the same process, which conflicts with it as another owner).
#[test]
fn posix_locks_end_when_their_process_closes_any_descriptor_of_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    on_both(&c, tmp.path(), &["ok", "EAGAIN", "ok"], |dir| {
        let p = dir.join("posix");
        let a = open_rw(&p);
        let other = fs::File::open(&p).unwrap();
        let ofd = open_rw(&p);
        let mut out = vec![fcntl_lock(a.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK)];
        out.push(fcntl_lock(
            ofd.as_raw_fd(),
            libc::F_OFD_SETLK,
            libc::F_RDLCK,
        ));
        drop(other);
        out.push(fcntl_lock(
            ofd.as_raw_fd(),
            libc::F_OFD_SETLK,
            libc::F_RDLCK,
        ));
        out
    });
}

/// flock and fcntl locks are independent on Linux: an exclusive flock and a whole-file
/// fcntl write lock coexist, and each still conflicts within its own kind.
#[test]
fn flock_and_fcntl_locks_do_not_conflict() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let other = c.mount_again(&tmp.path().join("mnt2"));
    on_both(
        &c,
        tmp.path(),
        &["ok", "ok", "ok", "EAGAIN", "EAGAIN"],
        |dir| {
            let p = dir.join("both");
            let a = open_rw(&p);
            let b = open_rw(&p);
            let c2 = open_rw(&p);
            let d = open_rw(&p);
            vec![
                flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB),
                fcntl_lock(b.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK),
                fcntl_lock(c2.as_raw_fd(), libc::F_OFD_SETLK, libc::F_UNLCK),
                fcntl_lock(c2.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK),
                flock(d.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB),
            ]
        },
    );
    // Across mounts too: the flock taken on the first mount still holds on the second.
    let a = open_rw(&c.mnt.join("x"));
    let b = open_rw(&other.mnt.join("x"));
    assert_eq!(flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), "ok");
    assert_eq!(
        fcntl_lock(b.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK),
        "ok"
    );
    assert_eq!(
        flock(b.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB),
        "EAGAIN"
    );
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// Forks a child that waits for an OFD write lock on `path` (F_OFD_SETLKW) and writes the
/// errno it ended with (0: granted) into a pipe. SIGUSR1 has a handler without SA_RESTART,
/// so an interrupted wait returns EINTR. The child only makes async-signal-safe calls, and
/// first closes every descriptor it inherited (they share open file descriptions with
/// this process, whose last close would then never come).
fn fork_waiter(path: &Path) -> (libc::pid_t, OwnedFd) {
    let cpath = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into a two-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child calls only async-signal-safe functions and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: async-signal-safe calls on valid arguments, in the forked child.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore_signal as *const () as usize;
            libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
            let out = 3;
            libc::dup2(fds[1], out);
            libc::syscall(libc::SYS_close_range, out + 1, u32::MAX, 0);
            let fd = libc::open(cpath.as_ptr(), libc::O_RDWR);
            let fl = libc::flock {
                l_type: libc::F_WRLCK as i16,
                l_whence: libc::SEEK_SET as i16,
                l_start: 0,
                l_len: 0,
                l_pid: 0,
            };
            let r = libc::fcntl(fd, libc::F_OFD_SETLKW, &fl);
            let err: i32 = if r == 0 { 0 } else { *libc::__errno_location() };
            libc::write(out, (&err as *const i32).cast(), 4);
            libc::_exit(0);
        }
    }
    // SAFETY: both ends are ours; the parent keeps the read end.
    unsafe {
        libc::close(fds[1]);
        (pid, OwnedFd::from_raw_fd(fds[0]))
    }
}

/// Waits up to `limit` for the waiter's errno.
fn waiter_result(pipe: &OwnedFd, limit: Duration) -> Option<i32> {
    let mut pfd = libc::pollfd {
        fd: pipe.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one valid descriptor.
    let n = unsafe { libc::poll(&mut pfd, 1, limit.as_millis() as i32) };
    if n != 1 {
        return None;
    }
    let mut err = 0i32;
    // SAFETY: reads at most 4 bytes into an i32.
    let got = unsafe { libc::read(pipe.as_raw_fd(), (&mut err as *mut i32).cast(), 4) };
    (got == 4).then_some(err)
}

/// Waits up to `limit` for the child to end; its wait status.
fn reap(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A waiting OFD lock ends with EINTR when its process gets a signal, and a SIGKILL kills
/// the process promptly (fuser 0.18 answered the kernel's FUSE_INTERRUPT with ENOSYS, so
/// the wait ignored both until the lock was free).
#[test]
fn a_waiting_lock_is_interrupted_by_a_signal_and_killed_by_sigkill() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("contended");
    let holder = open_rw(&p);
    assert_eq!(
        fcntl_lock(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK),
        "ok"
    );
    let prompt = Duration::from_secs(5);

    let (pid, pipe) = fork_waiter(&p);
    assert_eq!(
        waiter_result(&pipe, Duration::from_millis(300)),
        None,
        "the waiter waits"
    );
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid, libc::SIGUSR1) };
    let interrupted = waiter_result(&pipe, prompt);
    let (pid2, pipe2) = fork_waiter(&p);
    assert_eq!(waiter_result(&pipe2, Duration::from_millis(300)), None);
    // SAFETY: as above.
    unsafe { libc::kill(pid2, libc::SIGKILL) };
    let killed = reap(pid2, prompt);
    // Whatever happened, free the lock so no child is left behind.
    drop(holder);
    let _ = reap(pid, prompt);
    let _ = reap(pid2, prompt);
    assert_eq!(
        interrupted,
        Some(libc::EINTR),
        "SIGUSR1 ends the wait with EINTR"
    );
    let status = killed.expect("SIGKILL did not end the waiting process");
    assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL);
    drop(pipe2);
    // A lock freed while someone waits is granted to the waiter.
    let holder = open_rw(&p);
    assert_eq!(
        fcntl_lock(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK),
        "ok"
    );
    let (pid3, pipe3) = fork_waiter(&p);
    assert_eq!(waiter_result(&pipe3, Duration::from_millis(200)), None);
    drop(holder);
    assert_eq!(waiter_result(&pipe3, prompt), Some(0));
    assert!(reap(pid3, prompt).is_some());
}

// ---------------------------------------------------------------------------------------
// Defect 3: a completed write is what every later read sees.

const IOCB_CMD_PWRITE: u16 = 1;

/// The kernel's struct iocb (linux/aio_abi.h, little-endian layout).
#[repr(C)]
#[derive(Default)]
struct Iocb {
    aio_data: u64,
    aio_key: u32,
    aio_rw_flags: i32,
    aio_lio_opcode: u16,
    aio_reqprio: i16,
    aio_fildes: u32,
    aio_buf: u64,
    aio_nbytes: u64,
    aio_offset: i64,
    aio_reserved2: u64,
    aio_flags: u32,
    aio_resfd: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

/// One asynchronous O_DIRECT write through Linux AIO (io_submit), waited for.
fn aio_write(ctx: u64, fd: RawFd, buf: &[u8], offset: i64) -> i64 {
    let mut cb = Iocb {
        aio_lio_opcode: IOCB_CMD_PWRITE,
        aio_fildes: fd as u32,
        aio_buf: buf.as_ptr() as u64,
        aio_nbytes: buf.len() as u64,
        aio_offset: offset,
        ..Iocb::default()
    };
    let mut list = [&mut cb as *mut Iocb];
    // SAFETY: io_submit with a live context and one initialized iocb whose buffer outlives
    // the wait below.
    let n = unsafe { libc::syscall(libc::SYS_io_submit, ctx, 1i64, list.as_mut_ptr()) };
    assert_eq!(n, 1, "io_submit: {}", std::io::Error::last_os_error());
    let mut ev = [IoEvent::default()];
    // SAFETY: waits for the one event into a one-element array.
    let got = unsafe {
        libc::syscall(
            libc::SYS_io_getevents,
            ctx,
            1i64,
            1i64,
            ev.as_mut_ptr(),
            std::ptr::null_mut::<libc::timespec>(),
        )
    };
    assert_eq!(got, 1);
    ev[0].res
}

/// A page-aligned buffer for O_DIRECT.
struct Aligned(Vec<u8>, usize);

impl Aligned {
    fn new(len: usize, byte: u8) -> Aligned {
        let mut v = vec![byte; len + 4096];
        let skip = v.as_ptr().align_offset(4096);
        v[skip..skip + len].fill(byte);
        Aligned(v, skip)
    }
    fn bytes(&self, len: usize) -> &[u8] {
        &self.0[self.1..self.1 + len]
    }
}

/// Readers that keep the file's pages cached (as generic/451 does) while asynchronous
/// direct writes land: once a write completed, a buffered read on another descriptor of
/// the same mount returns its bytes, never the old ones from the page cache.
#[test]
fn a_completed_direct_write_is_seen_by_buffered_reads() {
    const LEN: usize = 16 << 10;
    const ROUNDS: u8 = 200;
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("dio");
    fs::write(&p, vec![0u8; 4 * LEN]).unwrap();
    let direct = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            let f = fs::File::open(&p).unwrap();
            let mut buf = vec![0u8; LEN];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = f.read_at(&mut buf, 0);
            }
        })
    };
    let mut ctx = 0u64;
    // SAFETY: io_setup into a u64 context.
    assert_eq!(
        unsafe { libc::syscall(libc::SYS_io_setup, 8i64, &mut ctx as *mut u64) },
        0
    );
    let check = fs::File::open(&p).unwrap();
    let mut stale = Vec::new();
    for round in 1..=ROUNDS {
        let buf = Aligned::new(LEN, round);
        assert_eq!(
            aio_write(ctx, direct.as_raw_fd(), buf.bytes(LEN), 0),
            LEN as i64
        );
        let mut back = vec![0u8; LEN];
        check.read_exact_at(&mut back, 0).unwrap();
        if back.iter().any(|&b| b != round) {
            stale.push((round, back[0]));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    // SAFETY: destroys the context made above.
    unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
    assert!(
        stale.is_empty(),
        "rounds whose completed write was not read back (round, first byte read): {stale:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Directory offsets (generic/257, 637, 676).

/// Reads a directory with readdir/telldir; returns (position after each entry, its name).
fn tell_all(dir: &Path) -> Vec<(i64, String)> {
    let c = CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: opendir/readdir/telldir/closedir on a stream used by this thread only.
    unsafe {
        let d = libc::opendir(c.as_ptr());
        assert!(!d.is_null());
        let mut out = Vec::new();
        loop {
            let e = libc::readdir(d);
            if e.is_null() {
                break;
            }
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                .to_string_lossy()
                .into_owned();
            out.push((libc::telldir(d), name));
        }
        libc::closedir(d);
        out
    }
}

/// The entry seekdir(pos) then readdir gives, or None at the end (or on a failed seek).
fn name_at(dir: &Path, pos: i64) -> Option<String> {
    let c = CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: as in `tell_all`.
    unsafe {
        let d = libc::opendir(c.as_ptr());
        assert!(!d.is_null());
        libc::seekdir(d, pos);
        let e = libc::readdir(d);
        let name = (!e.is_null()).then(|| {
            std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                .to_string_lossy()
                .into_owned()
        });
        libc::closedir(d);
        name
    }
}

/// Every telldir position is a positive offset that seekdir returns to, in any order and
/// after other entries were added and removed (readdir cookies were 64-bit hashes, 40%
/// of them negative as loff_t, which the kernel refuses: "Unexpected EOF").
#[test]
fn telldir_positions_are_valid_and_stable_offsets() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let dir = c.mnt.join("d");
    fs::create_dir(&dir).unwrap();
    for i in 0..200 {
        fs::write(dir.join(format!("f{i}")), b"").unwrap();
    }
    let all = tell_all(&dir);
    assert_eq!(all.len(), 202, "200 names, . and ..");
    assert!(
        all.iter().all(|&(pos, _)| pos > 0),
        "positions are positive"
    );
    // Other names come and go; the positions of the ones left stay good.
    for i in 0..200 {
        if i % 3 == 0 {
            fs::remove_file(dir.join(format!("f{i}"))).unwrap();
        }
        fs::write(dir.join(format!("g{i}")), b"").unwrap();
    }
    let still: std::collections::HashSet<String> =
        tell_all(&dir).into_iter().map(|(_, n)| n).collect();
    let mut checked = 0;
    for w in all.windows(2).rev() {
        let (pos, next) = (w[0].0, &w[1].1);
        if still.contains(next) {
            // The entry after `pos` may now be a new name sorted in between; it is never
            // a skip past `next` nor the end.
            let got = name_at(&dir, pos).expect("seekdir to a telldir position read nothing");
            assert!(
                got == *next || !all.iter().any(|(_, n)| *n == got),
                "after {pos}: {got}, expected {next} or a new name"
            );
            checked += 1;
        }
    }
    assert!(checked > 100);
}

// ---------------------------------------------------------------------------------------
// Execute-only programs.

/// A program whose mode gives the caller x but not r runs (execve needs execute
/// permission only; the server used to ask for read permission too: exit status 126).
#[test]
fn execute_only_programs_run() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let truth = ["/usr/bin/true", "/bin/true"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("true(1)");
    let nobody = 65534;
    // (mode, owner, group): the caller is the owner, in the group, or someone else.
    for (mode, uid, gid) in [(0o100, nobody, 0), (0o010, 0, nobody), (0o001, 0, 0)] {
        let p = c.mnt.join(format!("prog{mode:03o}"));
        fs::copy(truth, &p).unwrap();
        std::os::unix::fs::chown(&p, Some(uid), Some(gid)).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        let ran = Command::new(&p).uid(nobody).gid(nobody).status();
        assert!(
            matches!(ran, Ok(s) if s.success()),
            "mode {mode:03o}: {ran:?}"
        );
        // Reading it is still refused.
        let read = Command::new("cat")
            .arg(&p)
            .uid(nobody)
            .gid(nobody)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!read.success(), "mode {mode:03o} is not readable");
    }
}

// ---------------------------------------------------------------------------------------
// File handles (generic/426, 467, 477, 756, 777).

/// name_to_handle_at: (handle bytes, handle type).
fn handle_of(p: &Path) -> (Vec<u8>, i32) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    // struct file_handle { u32 handle_bytes; i32 handle_type; u8 f_handle[128] }.
    let mut buf = [0u8; 8 + 128];
    buf[..4].copy_from_slice(&128u32.to_ne_bytes());
    let mut mount_id = 0i32;
    // SAFETY: name_to_handle_at with a buffer of the size it was told.
    let r = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id as *mut i32,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at: {}",
        std::io::Error::last_os_error()
    );
    let len = u32::from_ne_bytes(buf[..4].try_into().unwrap()) as usize;
    let typ = i32::from_ne_bytes(buf[4..8].try_into().unwrap());
    (buf[8..8 + len].to_vec(), typ)
}

/// open_by_handle_at on the mount at `mnt`: the descriptor or the errno's name.
fn open_by_handle(mnt: &Path, h: &(Vec<u8>, i32), flags: i32) -> Result<OwnedFd, String> {
    let m = fs::File::open(mnt).unwrap();
    let mut buf = Vec::with_capacity(8 + h.0.len());
    buf.extend_from_slice(&(h.0.len() as u32).to_ne_bytes());
    buf.extend_from_slice(&h.1.to_ne_bytes());
    buf.extend_from_slice(&h.0);
    // SAFETY: open_by_handle_at with a complete struct file_handle.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            m.as_raw_fd(),
            buf.as_ptr(),
            flags,
        )
    };
    if fd < 0 {
        Err(errno_name(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        ))
    } else {
        // SAFETY: a new descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }
}

/// A file handle made on one mount opens the file on another mount, whose kernel has never
/// seen the inode (it looks up "." and ".." by id); a handle of a removed file is ESTALE.
#[test]
fn file_handles_open_files_and_directories_on_any_mount() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let other = c.mount_again(&tmp.path().join("mnt2"));
    fs::create_dir_all(c.mnt.join("a/b")).unwrap();
    fs::write(c.mnt.join("a/b/f"), b"by handle").unwrap();
    let file = handle_of(&c.mnt.join("a/b/f"));
    let dir = handle_of(&c.mnt.join("a/b"));
    let fd = open_by_handle(&other.mnt, &file, libc::O_RDONLY).expect("open the file");
    let mut back = String::new();
    std::io::Read::read_to_string(&mut fs::File::from(fd), &mut back).unwrap();
    assert_eq!(back, "by handle");
    let fd = open_by_handle(&other.mnt, &dir, libc::O_RDONLY | libc::O_DIRECTORY)
        .expect("open the directory");
    // The directory is connected to the tree: its path resolves through "..".
    let link = fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert!(link.ends_with("a/b"), "{}", link.display());
    fs::remove_file(c.mnt.join("a/b/f")).unwrap();
    let third = c.mount_again(&tmp.path().join("mnt3"));
    assert_eq!(
        open_by_handle(&third.mnt, &file, libc::O_RDONLY).err(),
        Some("ESTALE".to_string())
    );
}

// ---------------------------------------------------------------------------------------
// Open objects live until their last close (generic/035).

fn nlink_of(fd: &impl AsRawFd) -> Result<u64, String> {
    // SAFETY: fstat into a zeroed struct stat.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) == 0 {
            Ok(st.st_nlink)
        } else {
            Err(errno_name(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            ))
        }
    }
}

/// A directory that is open when it is renamed over or removed still answers fstat, with
/// nlink 0, as does a file (the directory used to vanish: ESTALE).
#[test]
fn open_directories_and_files_outlive_their_names() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let sides: Vec<_> = [tmp.path().join("local"), c.mnt.clone()]
        .iter()
        .map(|base| {
            fs::create_dir_all(base.join("d1")).unwrap();
            fs::create_dir_all(base.join("d2")).unwrap();
            fs::create_dir_all(base.join("d3")).unwrap();
            fs::write(base.join("f1"), b"1").unwrap();
            fs::write(base.join("f2"), b"2").unwrap();
            let d2 = fs::File::open(base.join("d2")).unwrap();
            let d3 = fs::File::open(base.join("d3")).unwrap();
            let f2 = fs::File::open(base.join("f2")).unwrap();
            fs::rename(base.join("d1"), base.join("d2")).unwrap();
            fs::remove_dir(base.join("d3")).unwrap();
            fs::rename(base.join("f1"), base.join("f2")).unwrap();
            // Past the mount's attribute cache, so the servers are asked.
            std::thread::sleep(Duration::from_millis(1100));
            let out = vec![nlink_of(&d2), nlink_of(&d3), nlink_of(&f2)];
            // Nothing can be made in a removed directory.
            let made = fs::write(format!("/proc/self/fd/{}/x", d3.as_raw_fd()), b"")
                .map_err(|e| errno_name(e.raw_os_error().unwrap_or(0)));
            (out, made)
        })
        .collect();
    let (want, got) = (&sides[0], &sides[1]);
    assert_eq!(want.0, vec![Ok(0), Ok(0), Ok(0)], "local reference");
    assert_eq!(got.0, want.0, "mount");
    assert_eq!(got.1, want.1, "creating in a removed directory");
}

/// A directory open on one mount outlives its removal by another mount: its open reaches
/// the server, although the mount holds it back a moment (so that a walk's open and close
/// of each directory, `dir_opens` in the fuse crate, need no request at all).
#[test]
fn an_open_directory_outlives_its_removal_by_another_mount() {
    let tmp = tempfile::tempdir().unwrap();
    let (_server, a, b) = common::two_mounts(tmp.path(), false);
    fs::create_dir_all(a.mnt.join("d/sub")).unwrap();
    fs::write(a.mnt.join("d/f"), b"x").unwrap();
    // Walks on both mounts, which open, list and close directories at once.
    for m in [&a.mnt, &b.mnt] {
        let names = fs::read_dir(m.join("d")).unwrap().count();
        assert_eq!(names, 2);
    }
    let d = fs::File::open(a.mnt.join("d")).unwrap();
    // Well past the hold (a millisecond), with nothing else asked of the mount meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    fs::remove_file(b.mnt.join("d/f")).unwrap();
    fs::remove_dir(b.mnt.join("d/sub")).unwrap();
    fs::remove_dir(b.mnt.join("d")).unwrap();
    assert_eq!(nlink_of(&d), Ok(0), "fstat of the removed directory");
    let listed = fs::read_dir(format!("/proc/self/fd/{}", d.as_raw_fd()))
        .map(|r| r.count())
        .map_err(|e| errno_name(e.raw_os_error().unwrap_or(0)));
    assert_eq!(listed, Ok(0), "listing of the removed directory");
    drop(d);
    assert!(!a.mnt.join("d").exists());
}

// ---------------------------------------------------------------------------------------
// Shared mappings of O_DIRECT files (generic/091, 263).

/// A file opened with O_DIRECT can be mapped shared, and the mapping and direct I/O see
/// each other's writes (mmap used to fail with ENODEV).
#[test]
fn o_direct_files_map_shared_coherently() {
    const LEN: usize = 8192;
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("mapped");
    fs::write(&p, vec![b'a'; LEN]).unwrap();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .unwrap();
    // SAFETY: a shared mapping of LEN bytes of an open file, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping is LEN bytes long and lives until munmap.
    let bytes = unsafe { std::slice::from_raw_parts_mut(map.cast::<u8>(), LEN) };
    assert_eq!(bytes[0], b'a');
    // A direct write is seen through the mapping...
    let buf = Aligned::new(4096, b'b');
    assert_eq!(f.write_at(buf.bytes(4096), 0).unwrap(), 4096);
    assert_eq!((bytes[0], bytes[4095], bytes[4096]), (b'b', b'b', b'a'));
    // ... and a write through the mapping by a direct read, once synced.
    bytes[4096..].fill(b'c');
    // SAFETY: msync of the live mapping.
    assert_eq!(unsafe { libc::msync(map, LEN, libc::MS_SYNC) }, 0);
    let mut back = Aligned::new(4096, 0);
    let n = f.read_at(&mut back.0[back.1..back.1 + 4096], 4096).unwrap();
    assert_eq!(n, 4096);
    assert!(back.bytes(4096).iter().all(|&b| b == b'c'));
    // SAFETY: unmaps the mapping made above.
    unsafe { libc::munmap(map, LEN) };
}

/// Writeback of the dirty pages of a shared mapping of an O_DIRECT handle goes out
/// through that direct handle; the mount must not try to drop those pages before it
/// answers (the kernel waits for that answer to end their writeback: msync hung, as
/// generic/095's fio did).
#[test]
fn mapped_writeback_through_a_direct_handle_completes() {
    const LEN: usize = 8192;
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("wb");
    fs::write(&p, vec![b'a'; LEN]).unwrap();
    // Another handle of the file is open, so direct writes drop cached pages.
    let _reader = fs::File::open(&p).unwrap();
    let cached = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .unwrap();
    // SAFETY: a shared mapping of LEN bytes of an open file, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            cached.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    // SAFETY: the mapping is LEN bytes long.
    unsafe { std::slice::from_raw_parts_mut(map.cast::<u8>(), LEN).fill(b'z') };
    let addr = map as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: msync of the live mapping.
        let r = unsafe { libc::msync(addr as *mut libc::c_void, LEN, libc::MS_SYNC) };
        let _ = tx.send(r);
    });
    let synced = rx.recv_timeout(Duration::from_secs(20));
    if synced.is_err() {
        // Deadlocked in the kernel: end the FUSE connection, or nothing could exit.
        abort_connection(&c.mnt);
    }
    assert_eq!(synced, Ok(0), "msync did not complete");
    // SAFETY: unmaps the mapping made above.
    unsafe { libc::munmap(map, LEN) };
    assert!(fs::read(&p).unwrap().iter().all(|&b| b == b'z'));
}

/// Aborts the FUSE connection of the mount at `mnt` (fusectl), so that processes stuck on
/// it end and the test can report instead of hanging.
fn abort_connection(mnt: &Path) {
    let conns = Path::new("/sys/fs/fuse/connections");
    if fs::read_dir(conns).map_or(true, |mut d| d.next().is_none()) {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "none"])
            .arg(conns)
            .status();
    }
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let target = mnt.to_string_lossy();
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f.len() > 4
            && f[4] == target
            && let Some((_, minor)) = f[2].split_once(':')
        {
            let _ = fs::write(conns.join(minor).join("abort"), b"1");
        }
    }
}
