//! An OFD lock ends with the last close of its open file description, also when the next
//! lock request comes from another CPU, through another FUSE ring queue than the close's
//! RELEASE.
//!
//! This test is alone in its binary on purpose. While any thread of a process forks (a
//! test that spawns a server, a mount or `kill`), the child holds a copy of every open
//! descriptor of the process until it calls exec, so a description closed meanwhile lives
//! on, with its OFD lock, until that exec: POSIX semantics, not the mount's. Local ext4
//! shows it just as much (`bench/ofd_close_fork.py`, these rounds beside two threads
//! running `/bin/true`: 3,072 EAGAINs in 3,000 rounds on ext4, 0 without the spawning
//! threads). In `fuse_uring.rs`, beside tests that start servers, this test failed about
//! one run in four with CPU hogs; its rounds here run with no other test in the process.

mod common;

use common::{Cluster, ofd_lock, pin_to_cpu};
use std::fs;
use std::sync::mpsc;
use std::time::Duration;

/// The kernel sends the RELEASE of a last close in the background, to the queue of the CPU
/// that closed, and close(2) returns before the mount has it; a lock request sent after
/// that from another CPU reaches the mount through another queue and could overtake it,
/// and then still see the closed description's OFD lock (xfstests generic/478 failed so
/// on 4 of 4 runs). A lock request waits until every queue has taken what the kernel
/// handed it (`uring::settled`). Runs over /dev/fuse too where the kernel has no rings.
#[test]
fn a_lock_request_from_another_cpu_never_overtakes_the_close_that_released_an_ofd_lock() {
    const ROUNDS: usize = 200;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let path = c.mnt.join("locked");
    fs::write(&path, b"x").unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        pin_to_cpu(usize::from(cpus > 1));
        for round in 0..ROUNDS {
            // Opened first, as a program that locks after a signal would have it.
            let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
            let (closed_tx, closed_rx) = mpsc::channel();
            let setter = path.clone();
            std::thread::spawn(move || {
                pin_to_cpu(0);
                let f = fs::OpenOptions::new().write(true).open(&setter).unwrap();
                ofd_lock(&f, libc::F_WRLCK, false).unwrap();
                // The last close ends the lock.
                drop(f);
                closed_tx.send(()).unwrap();
            });
            closed_rx.recv().unwrap();
            if let Err(e) = ofd_lock(&f, libc::F_WRLCK, false) {
                let _ = done_tx.send(Err(format!("round {round}: {e}")));
                return;
            }
        }
        let _ = done_tx.send(Ok(()));
    });
    let r = done_rx.recv_timeout(Duration::from_secs(120));
    assert_eq!(
        r,
        Ok(Ok(())),
        "a lock saw a closed description's OFD lock; log:\n{}",
        c.server.log_text()
    );
}
