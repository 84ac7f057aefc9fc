//! The FUSE mount, end to end: data, two mounts, locks across mounts, a cluster that goes
//! away and comes back, open-unlinked files, and fsync'ed data surviving SIGKILL.

mod common;

use common::{Cluster, ServerProc};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, Instant};

#[test]
fn data_round_trips_and_sparse_files_read_zeros() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("f");
    let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
    fs::write(&p, &data).unwrap();
    assert_eq!(fs::read(&p).unwrap(), data);
    // A hole in the middle of a chunk and past the end of another.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(b"tail", (20 << 20) + 5).unwrap();
    drop(f);
    let back = fs::read(&p).unwrap();
    assert_eq!(back.len(), (20 << 20) + 9);
    assert!(
        back[9 << 20..(20 << 20) + 5].iter().all(|&b| b == 0),
        "the hole reads as zeros"
    );
    // Truncate down, then up: the old bytes do not come back.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(10).unwrap();
    f.set_len(5 << 20).unwrap();
    drop(f);
    let back = fs::read(&p).unwrap();
    assert_eq!(&back[..10], &data[..10]);
    assert!(back[10..].iter().all(|&b| b == 0));
    // A file is no terminal (isatty, which Python asks at every open): ENOTTY, as ext4.
    let f = fs::File::open(&p).unwrap();
    let mut tio = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: TCGETS writes at most one termios into the buffer given.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::TCGETS,
            tio.as_mut_ptr(),
        )
    };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
}

#[test]
fn two_mounts_see_each_other_close_to_open() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let other = c.mount_again(&tmp.path().join("mnt2"));
    fs::write(c.mnt.join("shared"), b"version one").unwrap();
    assert_eq!(fs::read(other.mnt.join("shared")).unwrap(), b"version one");
    fs::write(other.mnt.join("shared"), b"version two, longer").unwrap();
    assert_eq!(
        fs::read(c.mnt.join("shared")).unwrap(),
        b"version two, longer"
    );
    // A new name made on one mount is found at once on the other (no negative caching).
    assert!(fs::metadata(other.mnt.join("later")).is_err());
    fs::write(c.mnt.join("later"), b"x").unwrap();
    assert!(fs::metadata(other.mnt.join("later")).is_ok());
}

fn fcntl_lock(f: &fs::File, typ: i32, start: i64, len: i64) -> i32 {
    let fd = std::os::fd::AsRawFd::as_raw_fd(f);
    if common::fcntl_lock(fd, libc::F_SETLK, typ, start, len) == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }
}

#[test]
fn locks_are_enforced_across_mounts_and_released_when_a_client_dies() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &["--session-grace", "1"]);
    fs::write(c.mnt.join("db"), b"0123456789").unwrap();
    let mut other = c.mount_again(&tmp.path().join("mnt2"));
    let a = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(c.mnt.join("db"))
        .unwrap();
    let b = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(other.mnt.join("db"))
        .unwrap();
    assert_eq!(fcntl_lock(&a, libc::F_WRLCK, 0, 5), 0);
    assert_eq!(
        fcntl_lock(&b, libc::F_WRLCK, 3, 1),
        libc::EAGAIN,
        "byte 3 is locked on the other mount"
    );
    assert_eq!(
        fcntl_lock(&b, libc::F_WRLCK, 5, 5),
        0,
        "bytes 5..10 are free"
    );
    assert_eq!(fcntl_lock(&a, libc::F_RDLCK, 6, 1), libc::EAGAIN);
    // flock, whole file, across mounts (flock and fcntl locks never conflict: see
    // fuse_conformance.rs).
    fs::write(c.mnt.join("flocked"), b"").unwrap();
    let fa = fs::File::open(c.mnt.join("flocked")).unwrap();
    let fb = fs::File::open(other.mnt.join("flocked")).unwrap();
    // SAFETY: flock on valid descriptors.
    unsafe {
        assert_eq!(
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&fa),
                libc::LOCK_EX | libc::LOCK_NB
            ),
            0
        );
        assert_eq!(
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&fb),
                libc::LOCK_EX | libc::LOCK_NB
            ),
            -1
        );
    }
    // The second mount dies: its locks go after the grace period.
    drop(fb);
    drop(b);
    other.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    let a2 = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(c.mnt.join("db"))
        .unwrap();
    loop {
        // Another owner (a second open file description of this process keeps the same
        // POSIX owner, so ask for bytes the dead mount held).
        if fcntl_lock(&a2, libc::F_WRLCK, 5, 5) == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "locks of a dead client were never released"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn unlinked_open_files_live_until_closed_and_their_data_is_reclaimed() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let p = c.mnt.join("tmpfile");
    let mut f = fs::OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.write_all(&vec![7u8; 5 << 20]).unwrap();
    fs::remove_file(&p).unwrap();
    assert!(fs::metadata(&p).is_err());
    f.write_all(b"more").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(back.len(), (5 << 20) + 4);
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    let chunks = || walk_count(&c.server.data.join("store/data"));
    assert!(chunks() >= 2);
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    while chunks() > 0 {
        assert!(
            Instant::now() < deadline,
            "data of a closed, unlinked file was not reclaimed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn walk_count(dir: &std::path::Path) -> usize {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    rd.filter_map(Result::ok)
        .map(|e| {
            if e.path().is_dir() {
                walk_count(&e.path())
            } else {
                1
            }
        })
        .sum()
}

/// How long the tests' mounts that must give up keep retrying (`-o retry=`).
const SHORT_RETRY_SECS: u64 = 2;

#[test]
fn fsynced_data_survives_sigkill_of_every_process_and_a_dead_cluster_is_eio_after_the_retry_limit()
{
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("data");
    let server = ServerProc::start(&data_dir, &[]);
    let addr = server.addr;
    let mnt = tmp.path().join("m");
    let retry = format!("retry={SHORT_RETRY_SECS}");
    let mut mount =
        common::MountProc::start_with(addr, &data_dir.join("cluster.key"), &mnt, &["-o", &retry]);
    let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
    {
        let mut f = fs::File::create(mnt.join("durable")).unwrap();
        f.write_all(&payload).unwrap();
        f.sync_all().unwrap();
    }
    let mut server = server;
    server.kill9();
    // The mount waits for its cluster as long as `retry=` says, then answers EIO (never
    // ENOENT, which would be a live cluster's answer, nor a hang).
    let t = Instant::now();
    let err = fs::metadata(mnt.join("durable-missing")).unwrap_err();
    let waited = t.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        waited >= Duration::from_secs(SHORT_RETRY_SECS),
        "gave up after {waited:?}, before its retry limit"
    );
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
    mount.kill9();
    // Everything restarts; the data is there, byte for byte.
    let port = addr.port().to_string();
    let server = ServerProc::start_on(&data_dir, &port, &[]);
    let mount = common::MountProc::start(server.addr, &data_dir.join("cluster.key"), &mnt);
    assert_eq!(fs::read(mount.mnt.join("durable")).unwrap(), payload);
}

/// A server restart is only a delay: a write made while the cluster is down waits (it
/// neither fails nor returns early) and completes once the server is back, and a file
/// opened before the restart stays usable.
#[test]
fn a_write_while_the_cluster_is_down_waits_and_completes_when_it_comes_back() {
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("data");
    let mut server = ServerProc::start(&data_dir, &[]);
    let addr = server.addr;
    let mount =
        common::MountProc::start(addr, &data_dir.join("cluster.key"), &tmp.path().join("m"));
    fs::write(mount.mnt.join("a"), b"1").unwrap();
    let mut open = fs::File::open(mount.mnt.join("a")).unwrap();
    server.stop();
    let b = mount.mnt.join("b");
    let writer = std::thread::spawn(move || fs::write(b, b"2"));
    // Long enough for the writer to have failed had the mount given up (a dead server's
    // connection is refused at once).
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !writer.is_finished(),
        "the write returned while the cluster was down: {:?}",
        writer.join()
    );
    let _server = ServerProc::start_on(&data_dir, &addr.port().to_string(), &[]);
    writer
        .join()
        .expect("writer thread")
        .expect("the write completes once the server is back");
    assert_eq!(fs::read(mount.mnt.join("b")).unwrap(), b"2");
    assert_eq!(fs::read(mount.mnt.join("a")).unwrap(), b"1");
    // A file opened before the restart is still usable (the handle is reopened).
    let mut s = String::new();
    open.read_to_string(&mut s).unwrap();
    assert_eq!(s, "1");
}

/// Write-behind: 4 KiB writes are gathered in the mount, yet this mount's readers see
/// them at once (stat, a second descriptor, a directory listing), a rewrite at an earlier
/// offset lands in order, and another mount sees everything after the writer's close.
#[test]
fn small_writes_held_in_the_mount_are_seen_by_every_reader_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let other = c.mount_again(&tmp.path().join("mnt2"));
    let path = c.mnt.join("gathered");
    let data: Vec<u8> = (0..(3 << 20) + 1000u32)
        .map(|i| (i * 13 + 7) as u8)
        .collect();
    let mut f = fs::File::create(&path).unwrap();
    for piece in data.chunks(4096) {
        f.write_all(piece).unwrap();
    }
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        data.len() as u64,
        "stat"
    );
    let listed = fs::read_dir(&c.mnt)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name() == "gathered")
        .expect("listed");
    assert_eq!(
        listed.metadata().unwrap().len(),
        data.len() as u64,
        "listing"
    );
    let mut expect = data.clone();
    {
        let mut r = fs::File::open(&path).unwrap();
        let mut back = Vec::new();
        r.read_to_end(&mut back).unwrap();
        assert!(back == expect, "a second descriptor reads what was written");
    }
    // More sequential writes, then a rewrite of the start: both land, in order.
    for piece in data[..100_000].chunks(4096) {
        f.write_all(piece).unwrap();
        expect.extend_from_slice(piece);
    }
    f.seek(SeekFrom::Start(10)).unwrap();
    f.write_all(b"rewritten").unwrap();
    expect[10..19].copy_from_slice(b"rewritten");
    drop(f);
    assert!(fs::read(&path).unwrap() == expect, "this mount after close");
    assert!(
        fs::read(other.mnt.join("gathered")).unwrap() == expect,
        "another mount after close"
    );
}

/// A write held in the mount that cannot reach the servers within the retry limit is
/// reported by close(2).
#[test]
fn a_held_write_that_fails_is_reported_at_close() {
    use std::os::fd::IntoRawFd;
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("data");
    let mut server = ServerProc::start(&data_dir, &[]);
    let mnt = tmp.path().join("m");
    let retry = format!("retry={SHORT_RETRY_SECS}");
    let _mount = common::MountProc::start_with(
        server.addr,
        &data_dir.join("cluster.key"),
        &mnt,
        &["-o", &retry],
    );
    let mut f = fs::File::create(mnt.join("lost")).unwrap();
    for _ in 0..16 {
        f.write_all(&[7u8; 4096]).unwrap();
    }
    server.kill9();
    let fd = f.into_raw_fd();
    // SAFETY: closing the descriptor this test owns (taken from the File above).
    let rc = unsafe { libc::close(fd) };
    let err = std::io::Error::last_os_error();
    assert_eq!(rc, -1, "close reported nothing");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}
