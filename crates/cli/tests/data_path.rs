//! The data path at its limits, through real servers and the mount: offsets up to the
//! largest file size (no chunk aliasing), deleting a huge sparse file (cost proportional to
//! the data that exists; shutdown and restart never wait for it), and a full store
//! (ENOSPC, not EIO; fallocate reserves real space and refuses what statfs says is not
//! there).

mod common;

use common::{Cluster, ServerProc, errno_name, metric};
use kochab_proto::{Credentials, Errno, FILE_BYTES_MAX};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Files (not folders) under `dir`, recursively.
fn files_under(dir: &Path) -> usize {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    rd.filter_map(Result::ok)
        .map(|e| {
            if e.path().is_dir() {
                files_under(&e.path())
            } else {
                1
            }
        })
        .sum()
}

/// Entries of the shard folders under `data/` (a file's chunk 0, the folder of its other
/// chunks): none once every file's data is gone.
fn shard_entries(data: &Path) -> usize {
    let Ok(rd) = fs::read_dir(data) else { return 0 };
    rd.filter_map(Result::ok)
        .filter_map(|shard| fs::read_dir(shard.path()).ok())
        .map(|rd| rd.count())
        .sum()
}

fn chunk_dir(c: &Cluster) -> PathBuf {
    c.server.data.join("store/data")
}

/// `pread` of exactly `len` bytes (the mount may return them in pieces).
fn read_at(f: &fs::File, len: usize, offset: u64) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    f.read_exact_at(&mut buf, offset).expect("pread");
    buf
}

fn errno_of(e: &std::io::Error) -> String {
    errno_name(e.raw_os_error().unwrap_or(0))
}

/// SIGTERM, then waits at most `limit` for the process to exit; true if it did.
fn stops_within(server: &mut ServerProc, limit: Duration) -> bool {
    // SAFETY: kill(2) of a child we spawned and still own.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if !server.alive() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn a_write_at_2_pow_54_does_not_alias_the_start_of_the_file() {
    // The reproduction of the finding: chunk numbers were cut to 32 bits, so byte 2^54 + 10
    // was stored at byte 10 of chunk 0.
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let f = fs::OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(true)
        .open(c.mnt.join("f"))
        .unwrap();
    f.write_all_at(b"HELLO", (1 << 54) + 10).unwrap();
    assert_eq!(read_at(&f, 16, 0), vec![0u8; 16], "bytes 0..16 are a hole");
    assert_eq!(read_at(&f, 5, (1 << 54) + 10), b"HELLO");
}

#[test]
fn a_huge_sparse_file_is_deleted_at_the_cost_of_its_data_and_shutdown_does_not_wait() {
    // xfstests generic/525 and 564: deleting such a file made the servers unlink every
    // possible chunk name, for hours, and SIGTERM waited for it.
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(tmp.path(), &["--metrics-port", "0"]);
    let p = c.mnt.join("sparse");
    let far: [(u64, &[u8]); 3] = [
        (1 << 40, b"at 2^40"),
        ((1 << 54) + 10, b"HELLO"),
        (FILE_BYTES_MAX - 16, b"the last 16 byte"),
    ];
    {
        let f = fs::OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        for (off, bytes) in far {
            f.write_all_at(bytes, off).unwrap();
        }
        assert_eq!(f.metadata().unwrap().size(), FILE_BYTES_MAX);
        for (off, bytes) in far {
            assert_eq!(read_at(&f, bytes.len(), off), bytes, "at {off}");
            assert_eq!(read_at(&f, 8, off - 8), vec![0u8; 8], "hole before {off}");
        }
        assert_eq!(read_at(&f, 16, 0), vec![0u8; 16]);
        assert_eq!(files_under(&chunk_dir(&c)), 3, "one chunk object per write");
        // Truncate into the middle of the first write, then grow again: the cut bytes
        // are gone, and so are the chunks past the cut.
        f.set_len((1 << 40) + 2).unwrap();
        assert_eq!(files_under(&chunk_dir(&c)), 1);
        f.set_len((1 << 54) + 100).unwrap();
        assert_eq!(read_at(&f, 4, (1 << 40) - 2), b"\0\0at");
        assert_eq!(read_at(&f, 8, (1 << 40) + 2), vec![0u8; 8]);
        assert_eq!(read_at(&f, 5, (1 << 54) + 10), vec![0u8; 5]);
        f.write_all_at(b"again", FILE_BYTES_MAX - 5).unwrap();
    }
    // Past the largest file size the server refuses a native client's write and
    // truncation (through the mount the kernel refuses them first).
    common::runtime().block_on(async {
        let client = c.server.client(1).await;
        let cred = Credentials::root();
        let (attr, h) = client
            .create_open(&cred, client.root(), b"limits", 0o644, 2)
            .await
            .unwrap();
        let e = client
            .write(&cred, h, FILE_BYTES_MAX, b"x".to_vec())
            .await
            .unwrap_err();
        assert_eq!(e.errno, Errno::EFBIG);
        let e = client
            .write(&cred, h, FILE_BYTES_MAX - 1, b"xy".to_vec())
            .await
            .unwrap_err();
        assert_eq!(e.errno, Errno::EFBIG);
        let set = kochab_proto::SetAttrs {
            size: Some(FILE_BYTES_MAX + 1),
            ..Default::default()
        };
        let e = client.setattr(&cred, attr.id, set).await.unwrap_err();
        assert_eq!(e.errno, Errno::EFBIG);
        let e = client
            .fallocate(&cred, h, FILE_BYTES_MAX, 1, 0)
            .await
            .unwrap_err();
        assert_eq!(e.errno, Errno::EFBIG);
        client.close(&cred, h).await.unwrap();
        client
            .unlink(&cred, client.root(), b"limits")
            .await
            .unwrap();
    });
    fs::remove_file(&p).unwrap();
    // SIGTERM at once, the reclaim of the deleted file just queued: the stop must not wait
    // for it (it is resumed after a restart).
    assert!(
        stops_within(&mut c.server, Duration::from_secs(15)),
        "the server did not stop within 15 s of SIGTERM"
    );
    // The restarted server finishes what was left.
    let mut again = ServerProc::start(&c.server.data, &["--metrics-port", "0"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let pending = "kochab_data_reclaims_pending";
    while files_under(&chunk_dir(&c)) > 0
        || shard_entries(&chunk_dir(&c)) > 0
        || metric(&again, pending) != Some(0.0)
    {
        assert!(
            Instant::now() < deadline,
            "the data of a deleted sparse file was not reclaimed within 10 s of a restart"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    again.kill9();
}

/// A size-limited tmpfs mounted for one test, unmounted (lazily, so a process that still
/// has it open cannot keep it) when dropped.
struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    /// `None` (the test is skipped) unless running as root, which mounting needs.
    fn mount(dir: &Path, bytes: u64) -> Option<SmallFs> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a small tmpfs needs root");
            return None;
        }
        fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={bytes},mode=0700"))
            .arg("tmpfs")
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount -t tmpfs {}", dir.display());
        Some(SmallFs {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

fn free_bytes(mnt: &Path) -> u64 {
    let c = std::ffi::CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid path and a properly sized out-buffer.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

fn fallocate(f: &fs::File, mode: i32, offset: u64, len: u64) -> Result<(), String> {
    // SAFETY: fallocate on a valid descriptor.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, len as i64) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno_of(&std::io::Error::last_os_error()))
    }
}

/// Writes 1 MiB pieces at the end of `f` until a write fails (at most `max_mib`); returns
/// the failure's errno name.
fn fill(f: &fs::File, max_mib: u64) -> String {
    let piece = vec![0x5Au8; 1 << 20];
    for i in 0..max_mib {
        if let Err(e) = f.write_all_at(&piece, i << 20) {
            return errno_of(&e);
        }
    }
    panic!("{max_mib} MiB fit into a store that should be full");
}

#[test]
fn a_full_store_is_enospc_and_fallocate_reserves_what_statfs_reports() {
    const STORE_BYTES: u64 = 64 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let Some(_small) = SmallFs::mount(&tmp.path().join("data"), STORE_BYTES) else {
        return;
    };
    // Small journal segments: the journal must not be what fills the store.
    let c = Cluster::start(tmp.path(), &["--segment-bytes", "1048576"]);
    let free = free_bytes(&c.mnt);
    assert!(
        free > 32 << 20 && free <= STORE_BYTES,
        "statfs shows the store's free space: {free}"
    );
    let open = |name: &str| {
        fs::OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(true)
            .open(c.mnt.join(name))
            .unwrap()
    };
    // Nearly all that statfs reports can be reserved; deleting the file gives it back.
    let c_file = open("almost all");
    assert_eq!(fallocate(&c_file, 0, 0, free - (4 << 20)), Ok(()));
    assert!(
        free_bytes(&c.mnt) < 8 << 20,
        "statfs counts the reservation"
    );
    drop(c_file);
    fs::remove_file(c.mnt.join("almost all")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while free_bytes(&c.mnt) < free - (1 << 20) {
        assert!(Instant::now() < deadline, "the space did not come back");
        std::thread::sleep(Duration::from_millis(50));
    }
    // More than statfs reports: refused, and nothing changes.
    let a = open("reserved");
    assert_eq!(fallocate(&a, 0, 0, free + (8 << 20)), Err("ENOSPC".into()));
    assert_eq!(a.metadata().unwrap().size(), 0);
    // Past the largest file size: EFBIG.
    assert_eq!(fallocate(&a, 0, FILE_BYTES_MAX - 1, 2), Err("EFBIG".into()));
    // A reservation is real: once the store is full, the reserved range can still be
    // written.
    assert_eq!(fallocate(&a, 0, 0, 16 << 20), Ok(()));
    assert_eq!(a.metadata().unwrap().size(), 16 << 20);
    let b = open("filler");
    assert_eq!(
        fill(&b, STORE_BYTES >> 20),
        "ENOSPC",
        "a full store is ENOSPC"
    );
    let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 253) as u8).collect();
    a.write_all_at(&data, 0)
        .expect("writing into reserved space must not fail");
    assert!(read_at(&a, 16 << 20, 0) == data);
    // The native client sees ENOSPC too.
    let rt = common::runtime();
    rt.block_on(async {
        let client = c.server.client(1).await;
        let cred = Credentials::root();
        let (_, h) = client
            .create_open(&cred, client.root(), b"native", 0o644, 2)
            .await
            .unwrap();
        let mut got = None;
        for i in 0..(STORE_BYTES >> 20) {
            if let Err(e) = client.write(&cred, h, i << 20, vec![1u8; 1 << 20]).await {
                got = Some(e.errno);
                break;
            }
        }
        assert_eq!(got, Some(Errno::ENOSPC));
        client.close(&cred, h).await.unwrap();
    });
    // Punching a hole gives space back (only chunks that exist are touched).
    let before = free_bytes(&c.mnt);
    assert_eq!(
        fallocate(
            &a,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            FILE_BYTES_MAX / 2
        ),
        Ok(())
    );
    assert!(free_bytes(&c.mnt) >= before + (15 << 20));
    assert_eq!(read_at(&a, 8, 4 << 20), vec![0u8; 8]);
    assert_eq!(a.metadata().unwrap().size(), 16 << 20);
}

/// An append (`WRITE_AT_END`) lands at the end as the server finds it, whatever the client
/// thought the end was, and a retry with the same sequence number is answered from the
/// handle's last append instead of appending twice.
#[test]
fn an_append_is_placed_by_the_server_and_runs_once_per_sequence_number() {
    use kochab_proto::{Op, Reply, Request, WRITE_AT_END};
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let admin = kochab_proto::auth::ClientKey::admin(server.key);
    common::runtime().block_on(async {
        let conn =
            kochab_client::conn::Conn::connect(server.addr, &admin, 4243, Duration::from_secs(5))
                .await
                .unwrap();
        let call = |seq: u64, op: Op| {
            let req = Request {
                seq,
                ..Request::plain(&Credentials::root(), op)
            };
            let conn = conn.clone();
            async move { conn.call(&req).await.expect("reply").without_dirs() }
        };
        let create = Op::Create {
            parent: conn.root,
            name: b"log".to_vec(),
            mode: 0o644,
            flags: 0o2 | 0o2000, // O_RDWR | O_APPEND
            handle: 9,
        };
        assert!(matches!(call(1, create).await, Reply::Entry(_)));
        let size = |r: Reply| match r {
            Reply::Attr(a) => a.size,
            other => panic!("{other:?}"),
        };
        let append = |data: &[u8]| Op::Write {
            handle: 9,
            offset: WRITE_AT_END,
            data: data.to_vec(),
        };
        assert_eq!(size(call(2, append(b"one\n")).await), 4);
        assert_eq!(
            size(call(2, append(b"one\n")).await),
            4,
            "a retry appends nothing"
        );
        assert_eq!(size(call(3, append(b"two\n")).await), 8);
        // A plain write still goes where it says.
        let at = Op::Write {
            handle: 9,
            offset: 0,
            data: b"ONE".to_vec(),
        };
        assert_eq!(size(call(0, at).await), 8);
        let read = Op::Read {
            handle: 9,
            offset: 0,
            len: 64,
            atime: Default::default(),
        };
        match call(0, read).await {
            Reply::Bytes(b) | Reply::ReadAtime(b) => assert_eq!(b, b"ONE\ntwo\n"),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn a_small_write_to_a_file_kept_open_reaches_the_servers_without_fsync_or_close() {
    // Write-behind holds small writes in the mount; a writer that keeps its file open and
    // writes a line now and then (a log) must not keep them there for ever: a crash of the
    // mount would lose them all. Watched on the server's disk, which calls nobody back.
    let tmp = tempfile::tempdir().unwrap();
    let c = Cluster::start(tmp.path(), &[]);
    let mut f = fs::File::create(c.mnt.join("log")).unwrap();
    std::io::Write::write_all(&mut f, b"one line\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while files_under(&chunk_dir(&c)) == 0 {
        assert!(
            Instant::now() < deadline,
            "the line is still held in the mount after 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(f);
    assert_eq!(fs::read(c.mnt.join("log")).unwrap(), b"one line\n");
}
