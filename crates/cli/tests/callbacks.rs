//! Coherent caching between mounts (docs/ARCHITECTURE.md, "Coherent caching between
//! mounts"): two mounts of one server, real processes. Each mount's kernel caches names,
//! absences and attributes for the servers' lease (5 s); a change on one mount is seen on
//! the other at once, with no sleep in between, because the server calls the other mount
//! back before it acknowledges the change.

mod common;

use common::{MountProc, ServerProc, two_mounts};
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

fn exists(p: &std::path::Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

fn cpath(p: &std::path::Path) -> std::ffi::CString {
    std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path")
}

/// The value of extended attribute `name` of `p` (`None`: it has none).
fn xattr(p: &std::path::Path, name: &str) -> Option<Vec<u8>> {
    let (path, name) = (cpath(p), std::ffi::CString::new(name).expect("name"));
    let mut buf = vec![0u8; 256];
    // SAFETY: valid C strings and a buffer of the length given.
    let n = unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 256) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.raw_os_error(), Some(libc::ENODATA), "getxattr: {e}");
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

fn set_xattr(p: &std::path::Path, name: &str, value: &[u8]) {
    let (path, name) = (cpath(p), std::ffi::CString::new(name).expect("name"));
    // SAFETY: valid C strings and a value of the length given.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

#[test]
fn two_mounts_see_each_others_changes_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_server, a, b) = two_mounts(tmp.path(), false);
    fs::create_dir(a.mnt.join("d")).expect("mkdir on a");
    let (da, db) = (a.mnt.join("d"), b.mnt.join("d"));
    for round in 0..20 {
        let name = format!("f{round}");
        let (fa, fb) = (da.join(&name), db.join(&name));
        // An absence b has looked up (twice: the second is answered by its kernel).
        assert!(!exists(&fb) && !exists(&fb), "round {round}: {name} before");
        fs::write(&fa, b"one").expect("create on a");
        assert_eq!(
            fs::read(&fb).expect("read on b"),
            b"one",
            "round {round}: create"
        );
        // Appends on a: b sees the new size and bytes.
        let mut f = fs::OpenOptions::new().append(true).open(&fa).expect("open");
        f.write_all(b"two").expect("append");
        drop(f);
        assert_eq!(
            fs::metadata(&fb).expect("stat").len(),
            6,
            "round {round}: size"
        );
        assert_eq!(
            fs::read(&fb).expect("read"),
            b"onetwo",
            "round {round}: data"
        );
        // Mode changes.
        fs::set_permissions(&fa, fs::Permissions::from_mode(0o600)).expect("chmod");
        let mode = fs::metadata(&fb).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "round {round}: chmod");
        // Renames: the old name is gone on b and the new one there.
        let moved = format!("g{round}");
        fs::rename(&fa, da.join(&moved)).expect("rename on a");
        assert!(!exists(&fb), "round {round}: old name after rename");
        assert_eq!(fs::read(db.join(&moved)).expect("new name"), b"onetwo");
        // Unlinks.
        fs::remove_file(da.join(&moved)).expect("unlink on a");
        assert!(!exists(&db.join(&moved)), "round {round}: unlink");
        // And the other way round: b creates, a (which looked the name up) sees it.
        let back = format!("h{round}");
        assert!(!exists(&da.join(&back)));
        fs::write(db.join(&back), b"b").expect("create on b");
        assert_eq!(fs::read(da.join(&back)).expect("read on a"), b"b");
        fs::remove_file(db.join(&back)).expect("unlink on b");
        assert!(!exists(&da.join(&back)), "round {round}: unlink from b");
    }
    // A directory a made: a knows all its names and answers lookups of absent ones itself
    // (its `complete` directories), yet a name b adds, moves or removes there is seen on a
    // at once.
    for round in 0..10 {
        let (ea, eb) = (da.join(format!("e{round}")), db.join(format!("e{round}")));
        fs::create_dir(&ea).expect("mkdir on a");
        fs::write(ea.join("mine"), b"a").expect("create on a");
        assert!(!exists(&ea.join("theirs")) && !exists(&ea.join("theirs")));
        fs::write(eb.join("theirs"), b"b").expect("create on b");
        assert_eq!(
            fs::read(ea.join("theirs")).expect("read on a"),
            b"b",
            "round {round}: create in a's directory"
        );
        assert!(!exists(&ea.join("moved")));
        fs::rename(eb.join("theirs"), eb.join("moved")).expect("rename on b");
        assert!(!exists(&ea.join("theirs")), "round {round}: renamed away");
        assert!(exists(&ea.join("moved")), "round {round}: renamed here");
        fs::remove_file(eb.join("mine")).expect("unlink on b");
        assert!(!exists(&ea.join("mine")), "round {round}: unlink");
        fs::write(ea.join("mine"), b"again").expect("create on a again");
        assert_eq!(fs::read(eb.join("mine")).expect("read on b"), b"again");
    }
    // A file a created has no security.capability, which a answers itself (the kernel asks
    // before every chown and every write), until b gives it one.
    let cap = da.join("cap");
    fs::write(&cap, b"x").expect("create on a");
    assert_eq!(xattr(&cap, "security.capability"), None);
    // VFS_CAP_REVISION_2, CAP_NET_BIND_SERVICE permitted.
    let v2: [u8; 20] = [0, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    set_xattr(&db.join("cap"), "security.capability", &v2);
    assert_eq!(
        xattr(&cap, "security.capability").as_deref(),
        Some(&v2[..]),
        "a capability set on b"
    );
    // Directories too: a new one, its removal.
    fs::create_dir(da.join("sub")).expect("mkdir");
    assert!(fs::metadata(db.join("sub")).expect("stat").is_dir());
    fs::remove_dir(da.join("sub")).expect("rmdir");
    assert!(!exists(&db.join("sub")));
    drop((a, b));
}

#[test]
fn a_mount_caches_names_and_absences_for_longer_than_a_second() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = ServerProc::start(&data, &[]);
    let key = data.join("cluster.key");
    let m = MountProc::start(server.addr, &key, &tmp.path().join("m"));
    fs::write(m.mnt.join("here"), b"x").expect("create");
    assert!(exists(&m.mnt.join("here")));
    assert!(!exists(&m.mnt.join("absent")));
    // With the server stopped, only the kernel's cache can answer. The looks run on a
    // thread, so that one the kernel sends to the server waits for SIGCONT instead of
    // hanging the test.
    let pid = server.child.id().to_string();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill");
    };
    signal("-STOP");
    std::thread::sleep(Duration::from_millis(1500));
    let mnt = m.mnt.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send((exists(&mnt.join("here")), !exists(&mnt.join("absent"))));
    });
    let cached = rx.recv_timeout(Duration::from_secs(2));
    signal("-CONT");
    let (here, absent) = cached.unwrap_or((false, false));
    assert!(here, "a name looked up 1.5 s ago was not cached");
    assert!(absent, "an absence looked up 1.5 s ago was not cached");
    server.stop();
}

/// Two mounts creating in one directory at once. Each create waits at the server for the
/// other mount's callback answer, and the kernel's invalidation of a name takes its
/// directory's lock, which the kernel holds for that mount's own create there: when every
/// named entry was invalidated by name, the two deadlocked until the answer's bound (200 ms
/// a create, 5 creates/s a mount). A mount now drops only names its kernel may hold, and
/// those under a lock of its own by making every cached entry stale (no lock). Names one
/// side looked up and the other then created are still seen at once: b looks each up
/// (caching its absence), a creates it, b must see it, while both create other files there.
#[test]
fn two_mounts_create_in_one_directory_without_waiting_on_each_other() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_server, a, b) = two_mounts(tmp.path(), true);
    let logs = [tmp.path().join("a.log"), tmp.path().join("b.log")];
    fs::create_dir(a.mnt.join("shared")).expect("mkdir on a");
    let dirs = [a.mnt.join("shared"), b.mnt.join("shared")];
    const ROUNDS: usize = 200;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let busy = std::sync::atomic::AtomicUsize::new(0);
    let (looked, to_a) = std::sync::mpsc::channel::<usize>();
    let (made, to_b) = std::sync::mpsc::channel::<usize>();
    std::thread::scope(|s| {
        for (side, dir) in dirs.iter().enumerate() {
            let (stop, busy) = (&stop, &busy);
            s.spawn(move || {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    fs::write(dir.join(format!("busy-{side}-{i}")), b"").expect("create");
                    i += 1;
                }
                busy.fetch_add(i, std::sync::atomic::Ordering::Relaxed);
            });
        }
        let da = &dirs[0];
        s.spawn(move || {
            while let Ok(i) = to_a.recv() {
                fs::write(da.join(format!("n{i}")), b"").expect("create on a");
                made.send(i).expect("send");
            }
        });
        // Stops the busy threads however this thread leaves (a failed assertion too).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        let db = &dirs[1];
        for i in 0..ROUNDS {
            let name = db.join(format!("n{i}"));
            assert!(!exists(&name), "n{i} before a made it");
            looked.send(i).expect("send");
            assert_eq!(to_b.recv().expect("made"), i);
            assert!(exists(&name), "n{i}, made on a, not seen on b");
        }
        drop(looked);
    });
    let total = ROUNDS + busy.load(std::sync::atomic::Ordering::Relaxed);
    for dir in &dirs {
        let n = fs::read_dir(dir).expect("list").count();
        assert_eq!(n, total, "{} lists all files", dir.display());
    }
    drop((a, b));
    for log in &logs {
        let text = fs::read_to_string(log).unwrap_or_default();
        assert!(
            !text.contains("callback answered before") && !text.contains("cannot make cached"),
            "{}: {text}",
            log.display()
        );
    }
}

/// O_APPEND from two mounts at once: each append lands at the end as the server finds it,
/// so none overwrites another (the kernel of each mount puts it at the end as it knows
/// it, which the other mount may have moved: 103 of 200 lines survived before).
#[test]
fn appends_from_two_mounts_at_once_all_survive() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_server, a, b) = two_mounts(tmp.path(), false);
    fs::write(a.mnt.join("log"), b"").expect("create");
    const LINES: usize = 150;
    std::thread::scope(|s| {
        for (side, mnt) in [(&"a", &a.mnt), (&"b", &b.mnt)] {
            for t in 0..2 {
                let path = mnt.join("log");
                s.spawn(move || {
                    // Read and write, as a log that is also read (the page cache in use).
                    let mut f = fs::OpenOptions::new()
                        .read(true)
                        .append(true)
                        .open(&path)
                        .expect("open");
                    for i in 0..LINES {
                        f.write_all(format!("{side}{t} {i}\n").as_bytes())
                            .expect("append");
                    }
                });
            }
        }
    });
    for mnt in [&a.mnt, &b.mnt] {
        let text = fs::read_to_string(mnt.join("log")).expect("read");
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort_unstable();
        let mut want: Vec<String> = ["a", "b"]
            .iter()
            .flat_map(|side| {
                (0..2).flat_map(move |t| (0..LINES).map(move |i| format!("{side}{t} {i}")))
            })
            .collect();
        want.sort_unstable();
        assert_eq!(lines.len(), want.len(), "lines on {}", mnt.display());
        assert_eq!(lines, want, "lines on {}", mnt.display());
    }
}

/// A mount holds small writes back (write-behind); another mount must still see the exact
/// size and bytes at once, and its truncations and appends land after what was held back.
#[test]
fn another_mount_sees_writes_held_back_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_server, a, b) = two_mounts(tmp.path(), true);
    let (fa, fb) = (a.mnt.join("f"), b.mnt.join("f"));
    fs::write(&fa, b"").expect("create on a");
    // b caches the empty file's attributes (a lease) before a opens it for writing.
    assert_eq!(fs::metadata(&fb).expect("stat on b").len(), 0);
    let mut w = fs::OpenOptions::new()
        .write(true)
        .open(&fa)
        .expect("open on a");
    let mut want = Vec::new();
    for round in 0..100u32 {
        let chunk = vec![b'a' + (round % 26) as u8; 1 + (round as usize * 37) % 5000];
        w.write_all(&chunk).expect("write on a");
        want.extend_from_slice(&chunk);
        assert_eq!(
            fs::metadata(&fb).expect("stat on b").len(),
            want.len() as u64,
            "round {round}: size on b while a holds the file open"
        );
        if round % 10 == 0 {
            assert!(
                fs::read(&fb).expect("read on b") == want,
                "round {round}: bytes"
            );
        }
    }
    // A truncation on b lands after a's writes, held back or not.
    w.write_all(&[b'z'; 3000]).expect("write on a");
    fs::OpenOptions::new()
        .write(true)
        .open(&fb)
        .and_then(|f| f.set_len(10))
        .expect("truncate on b");
    drop(w);
    assert_eq!(fs::read(&fa).expect("read on a"), &want[..10]);
    // So does an append on b: after a's bytes, not under them.
    let mut w = fs::OpenOptions::new()
        .write(true)
        .open(&fa)
        .expect("open on a");
    w.write_all(&[b'x'; 1000]).expect("write on a");
    let mut app = fs::OpenOptions::new()
        .append(true)
        .open(&fb)
        .expect("open on b");
    app.write_all(b"tail").expect("append on b");
    drop((w, app));
    let mut expect = vec![b'x'; 1000];
    expect.extend_from_slice(b"tail");
    assert!(
        fs::read(&fb).expect("read on b") == expect,
        "append after held bytes"
    );
    // open(O_CREAT | O_TRUNC) of the name on b, which b never looked up (its kernel
    // looks it up, then opens with O_TRUNC), truncates after a's held bytes.
    let mut w = fs::File::create(a.mnt.join("g")).expect("create on a");
    w.write_all(&[b'y'; 2000]).expect("write on a");
    fs::write(b.mnt.join("g"), b"new").expect("create over it on b");
    drop(w);
    assert_eq!(fs::read(a.mnt.join("g")).expect("read on a"), b"new");
    for log in ["a.log", "b.log"] {
        let text = fs::read_to_string(tmp.path().join(log)).expect("log");
        assert!(!text.contains("callback answered before"), "{log}: {text}");
    }
}

/// A writer's mount that stops answering (SIGSTOP) holds a request of a reader on another
/// mount up for about a lease (5 s), not for good: the reader then sees what the servers
/// have, and once the writer resumes and closes, everything.
#[test]
fn a_writer_that_stops_answering_does_not_hang_readers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_server, a, b) = two_mounts(tmp.path(), false);
    let (fa, fb) = (a.mnt.join("f"), b.mnt.join("f"));
    let mut w = fs::File::create(&fa).expect("create on a");
    w.write_all(&[b'a'; 1000]).expect("write on a");
    // kill(2), not kill(1): a child process would close its copy of `w` at exec, which
    // waits for the stopped mount (FLUSH).
    let pid = a.child.id() as libc::pid_t;
    // SAFETY: a plain syscall on our own child's pid.
    let signal = |sig| assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill");
    signal(libc::SIGSTOP);
    // The stat runs on a thread: a hang must fail the test, not stop it.
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = fb.clone();
    std::thread::spawn(move || {
        let _ = tx.send(fs::metadata(&reader).map_or(u64::MAX, |m| m.len()));
    });
    // A lease (5 s); generous for a slow host.
    let seen = rx.recv_timeout(Duration::from_secs(30));
    signal(libc::SIGCONT);
    let size = seen.expect("a stat on b hung behind a stopped writer");
    assert!(size <= 1000, "size {size}");
    drop(w);
    assert_eq!(fs::metadata(&fb).expect("stat on b").len(), 1000);
}
