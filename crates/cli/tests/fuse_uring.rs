//! FUSE over io_uring (the default; `KOCHAB_FUSE_URING=0` turns it off): a mount takes the
//! kernel's per-CPU request queues when the kernel offers them
//! (`/sys/module/fuse/parameters/enable_uring`, which scripts/setup.sh sets), and keeps
//! /dev/fuse when it does not or is told so. This test checks which one a mount used and
//! runs the same mixed workload over both. (Every other FUSE test runs over the rings
//! where the kernel offers them, and over /dev/fuse with `KOCHAB_FUSE_URING=0` in the
//! test's environment: scripts/test.sh runs the conformance and differential suites a
//! second time so.)

mod common;

use common::{Cluster, ServerProc, force_unmount, is_mounted, ofd_lock, pin_to_cpu};
use std::fs;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const ANNOUNCED: &str = "FUSE requests arrive through io_uring";

fn kernel_offers_uring() -> bool {
    fs::read_to_string("/sys/module/fuse/parameters/enable_uring").is_ok_and(|s| s.trim() == "Y")
}

/// Small requests, and replies and writes as large as a ring entry's payload (1 MiB).
fn workload(mnt: &Path) {
    let dir = mnt.join("d");
    fs::create_dir(&dir).unwrap();
    for i in 0..300 {
        fs::write(dir.join(format!("f{i}")), format!("file {i}")).unwrap();
    }
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 300);
    assert_eq!(fs::read(dir.join("f123")).unwrap(), b"file 123");
    fs::rename(dir.join("f1"), dir.join("renamed")).unwrap();
    assert!(fs::metadata(dir.join("f1")).is_err());

    let big: Vec<u8> = (0..(3u32 << 20) + 4321).map(|i| (i % 253) as u8).collect();
    let mut f = fs::File::create(mnt.join("big")).unwrap();
    for chunk in big.chunks(1 << 20) {
        f.write_all(chunk).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(
        fs::metadata(mnt.join("big")).unwrap().size(),
        big.len() as u64
    );
    let mut back = Vec::new();
    fs::File::open(mnt.join("big"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == big, "the big file reads back as written");

    // A POSIX lock taken and released (the lock and its release on close are requests of
    // their own).
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(mnt.join("big"))
        .unwrap();
    let r = common::fcntl_lock(f.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK, 0, 10);
    assert_eq!(r, 0, "lock: {}", std::io::Error::last_os_error());
    drop(f);

    for i in 0..300 {
        let p = if i == 1 {
            dir.join("renamed")
        } else {
            dir.join(format!("f{i}"))
        };
        fs::remove_file(p).unwrap();
    }
    fs::remove_dir(&dir).unwrap();
    fs::remove_file(mnt.join("big")).unwrap();
    assert!(fs::metadata(&dir).is_err());
}

#[test]
fn the_mount_takes_io_uring_when_the_kernel_offers_it_and_dev_fuse_otherwise_or_when_told() {
    for (env, ring_expected) in [(Some("1"), kernel_offers_uring()), (Some("0"), false)] {
        let tmp = tempfile::tempdir().unwrap();
        let mnt = tmp.path().join("mnt");
        fs::create_dir_all(&mnt).unwrap();
        let envs: Vec<(&str, &str)> = env.map(|v| ("KOCHAB_FUSE_URING", v)).into_iter().collect();
        let mut server = ServerProc::start_env(
            &tmp.path().join("data"),
            "0",
            &["--mount", mnt.to_str().unwrap()],
            &envs,
        );
        assert!(is_mounted(&mnt), "log:\n{}", server.log_text());
        workload(&mnt);
        let log = server.log_text();
        assert_eq!(
            log.contains(ANNOUNCED),
            ring_expected,
            "KOCHAB_FUSE_URING={env:?}, kernel offers io_uring: {}; log:\n{log}",
            kernel_offers_uring()
        );
        assert_eq!(
            server.stop(),
            Some(0),
            "a clean exit; log:\n{}",
            server.log_text()
        );
        assert!(!is_mounted(&mnt));
        force_unmount(&mnt);
    }
}

/// Threads of this process blocked in fcntl(2) (syscall 72 on x86-64, 25 on arm64).
fn threads_in_fcntl() -> usize {
    let nr = if cfg!(target_arch = "aarch64") {
        "25"
    } else {
        "72"
    };
    fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| fs::read_to_string(t.ok()?.path().join("syscall")).ok())
        .filter(|s| s.split_whitespace().next() == Some(nr))
        .count()
}

/// A blocked lock request holds its ring entry until the lock is granted. More waiters on
/// one CPU than a queue's first entries (64) must not leave that CPU's other requests, the
/// holder's unlock among them, waiting behind them in the kernel for ever: the queue
/// registers more entries while its requests hold most of them.
#[test]
fn more_lock_waiters_on_one_cpu_than_ring_entries_do_not_stall_it() {
    const WAITERS: usize = 150;
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let path = c.mnt.join("locked");
    let (done_tx, done_rx) = mpsc::channel();
    let mnt = c.mnt.clone();
    // The holder runs in a thread of its own, so that a stall fails the test, not hangs it.
    std::thread::spawn(move || {
        pin_to_cpu(0);
        let holder = fs::File::create(&path).unwrap();
        ofd_lock(&holder, libc::F_WRLCK, false).unwrap();
        let waiters: Vec<_> = (0..WAITERS)
            .map(|_| {
                let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
                std::thread::spawn(move || {
                    pin_to_cpu(0);
                    ofd_lock(&f, libc::F_WRLCK, true).unwrap();
                    ofd_lock(&f, libc::F_UNLCK, false).unwrap();
                })
            })
            .collect();
        // Every waiter is in the kernel with its request (state, not time: bounded).
        let deadline = Instant::now() + Duration::from_secs(60);
        while threads_in_fcntl() < WAITERS {
            assert!(Instant::now() < deadline, "waiters never blocked");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Requests of the same CPU still get through: a create, then the unlock.
        fs::write(mnt.join("beside"), b"served").unwrap();
        ofd_lock(&holder, libc::F_UNLCK, false).unwrap();
        for w in waiters {
            w.join().unwrap();
        }
        done_tx.send(()).unwrap();
    });
    assert!(
        done_rx.recv_timeout(Duration::from_secs(120)).is_ok(),
        "requests on CPU 0 stalled behind {WAITERS} blocked lock requests; log:\n{}",
        c.server.log_text()
    );
    assert_eq!(fs::read(c.mnt.join("beside")).unwrap(), b"served");
}
