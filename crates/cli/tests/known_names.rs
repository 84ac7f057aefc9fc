//! Lookups a mount answers itself (docs/ARCHITECTURE.md, "Complete directories"): a file
//! the mount made, in a directory it made, is looked up without the server once the kernel
//! asks again, and stays exact. In a file of its own: dropping the kernel's entries is for
//! the whole machine, and the tests of one file run at once (one of `callbacks.rs` needs
//! the kernel's cache to answer while its server is stopped, and failed beside this one).

mod common;

use common::two_mounts;
use std::fs;
use std::io::Write;
use std::time::Duration;

fn exists(p: &std::path::Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

/// Drops the kernel's unused entries and inodes (the machine's, but only unused ones): its
/// next look at a name of this mount is a lookup the mount must answer.
fn drop_kernel_entries() {
    fs::write("/proc/sys/vm/drop_caches", b"2").expect("drop_caches");
}

/// A file this mount made, in a directory it made (complete: every name known, under a
/// lease), is looked up without the server when the kernel asks again (its entry timed
/// out; here, dropped), with what the kernel last saw of it. Whatever may have changed it
/// (a write of this mount, another mount's change) goes to the server again.
#[test]
fn lookups_of_files_a_mount_made_are_answered_by_the_mount_and_stay_exact() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut server, a, b) = two_mounts(tmp.path(), false);
    let d = a.mnt.join("d");
    fs::create_dir(&d).expect("mkdir on a");
    for name in ["made", "written", "appended", "unlinked", "renamed"] {
        fs::File::create(d.join(name)).expect("create on a");
    }
    // No O_TRUNC (an open that truncates drops what the mount keeps too).
    fs::OpenOptions::new()
        .write(true)
        .open(d.join("written"))
        .and_then(|mut f| f.write_all(b"abc"))
        .expect("write on a");
    let ino =
        |p: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).expect("stat"));
    let made_ino = ino(&d.join("made"));
    // The directory stays held by a descriptor: dropped entries are its names only.
    let dir = fs::File::open(&d).expect("open d");
    let via_dir = |name: &str| {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&dir);
        std::path::PathBuf::from(format!("/proc/self/fd/{fd}/{name}"))
    };

    drop_kernel_entries();
    let pid = server.child.id() as libc::pid_t;
    // SAFETY: a plain syscall on our own child's pid.
    let signal = |sig| assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill");
    signal(libc::SIGSTOP);
    // On a thread: a lookup sent to the stopped server must fail the test, not hang it.
    let (tx, rx) = std::sync::mpsc::channel();
    let made = via_dir("made");
    std::thread::spawn(move || {
        let _ = tx.send(fs::metadata(&made).map(|m| (m.len(), ino(&made))).ok());
    });
    let seen = rx.recv_timeout(Duration::from_secs(3));
    signal(libc::SIGCONT);
    let seen = seen.expect("the lookup of a file the mount made went to the server");
    assert_eq!(seen, Some((0, made_ino)));
    assert_eq!(
        fs::metadata(via_dir("written")).expect("stat").len(),
        3,
        "a file this mount wrote shows its size"
    );

    // The other mount's changes: called back, so the mount asks the server again.
    fs::OpenOptions::new()
        .append(true)
        .open(b.mnt.join("d/appended"))
        .and_then(|mut f| f.write_all(b"12345"))
        .expect("append on b");
    fs::remove_file(b.mnt.join("d/unlinked")).expect("unlink on b");
    fs::rename(b.mnt.join("d/renamed"), b.mnt.join("d/moved")).expect("rename on b");
    drop_kernel_entries();
    assert_eq!(fs::metadata(via_dir("appended")).expect("stat").len(), 5);
    assert!(!exists(&via_dir("unlinked")));
    assert!(!exists(&via_dir("renamed")));
    assert!(exists(&via_dir("moved")));
    assert_eq!(ino(&via_dir("made")), made_ino);
    server.stop();
}
