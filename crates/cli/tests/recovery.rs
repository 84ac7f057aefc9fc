//! Restart and recovery of a real server process: clean restarts, a torn or corrupt journal
//! tail (detected, reported, cut, never replayed), and the shell commands on the way.

mod common;

use common::{ServerProc, kochab_bin, runtime};
use kochab_proto::{Credentials, FileKind};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The journal segment holding the newest records.
fn newest_segment(data: &Path) -> PathBuf {
    let dir = common::newest_journal_dir(data);
    let mut segs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("journal dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segs.sort();
    segs.pop().expect("a segment")
}

/// Offsets of the start and end of the last record in a segment, found with the journal's
/// own reader.
fn last_record(bytes: &[u8]) -> (usize, usize) {
    use kochab_journal::record::{Scan, scan};
    let (first, _) = match kochab_journal::segment::decode_header(bytes) {
        kochab_journal::segment::Header::Valid { first_lsn, .. } => (first_lsn, ()),
        other => panic!("segment header: {other:?}"),
    };
    let mut off = kochab_journal::segment::SEGMENT_DATA_START as usize;
    let mut lsn = first;
    let mut last = (off, off);
    while let Scan::Record { len, .. } = scan(&bytes[off..], lsn) {
        last = (off, off + len);
        off += len;
        lsn += 1;
    }
    last
}

fn names(server: &ServerProc, dir: &str) -> Vec<String> {
    runtime().block_on(async {
        let c = server.client(1).await;
        let cred = Credentials::root();
        let d = c.resolve(&cred, dir, true).await.expect("resolve");
        let mut v: Vec<String> = c
            .readdir_all(&cred, d.id, false)
            .await
            .expect("readdir")
            .into_iter()
            .map(|e| String::from_utf8(e.name).unwrap())
            .collect();
        v.sort();
        v
    })
}

fn create_files(server: &ServerProc, dir: &str, n: usize) {
    runtime().block_on(async {
        let c = server.client(1).await;
        let cred = Credentials::root();
        let d = match c
            .mkdir(
                &cred,
                c.root(),
                dir.trim_start_matches('/').as_bytes(),
                0o755,
            )
            .await
        {
            Ok(a) => a,
            Err(_) => c.resolve(&cred, dir, true).await.expect("dir"),
        };
        for i in 0..n {
            c.create(&cred, d.id, format!("f{i:04}").as_bytes(), 0o644)
                .await
                .expect("create");
        }
    });
}

#[test]
fn torn_journal_tail_is_cut_and_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let mut server = ServerProc::start(&data, &["--checkpoint-records", "1000000"]);
    create_files(&server, "/t", 50);
    server.kill9();

    // Tear the last record, as a write interrupted by a crash would.
    let seg = newest_segment(&data);
    let mut bytes = std::fs::read(&seg).unwrap();
    let (start, end) = last_record(&bytes);
    bytes[(start + end) / 2] ^= 0x5a;
    std::fs::write(&seg, &bytes).unwrap();

    let mut server = ServerProc::start(&data, &[]);
    let log = server.log_text();
    assert!(
        log.contains("cut a torn journal tail"),
        "the cut is reported:\n{log}"
    );
    let got = names(&server, "/t");
    assert_eq!(
        got.len(),
        49,
        "everything before the torn record is there, the torn one is not"
    );
    assert_eq!(got.last().map(String::as_str), Some("f0048"));
    let problems = runtime().block_on(async { server.client(1).await.fsck().await.unwrap() });
    assert!(problems.is_empty(), "{problems:?}");

    // New work continues after the cut, and a second restart is clean.
    create_files(&server, "/t", 0);
    runtime().block_on(async {
        let c = server.client(1).await;
        let d = c.resolve(&Credentials::root(), "/t", true).await.unwrap();
        c.create(&Credentials::root(), d.id, b"after", 0o644)
            .await
            .unwrap();
    });
    server.kill9();
    let before = server.log_text().matches("cut a torn journal tail").count();
    let server = ServerProc::start(&data, &[]);
    assert_eq!(
        server.log_text().matches("cut a torn journal tail").count(),
        before,
        "no second cut"
    );
    let got = names(&server, "/t");
    assert_eq!(got.len(), 50);
    assert!(got.contains(&"after".to_string()));
}

#[test]
fn garbage_after_the_last_record_is_cut_without_losing_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let mut server = ServerProc::start(&data, &["--checkpoint-records", "1000000"]);
    create_files(&server, "/g", 20);
    server.kill9();
    let seg = newest_segment(&data);
    let mut bytes = std::fs::read(&seg).unwrap();
    let (_, end) = last_record(&bytes);
    // Half a header of a record that never finished.
    for (i, b) in [0x33u8, 0, 0, 0, 0xde, 0xad, 0xbe].iter().enumerate() {
        bytes[end + i] = *b;
    }
    std::fs::write(&seg, &bytes).unwrap();
    let server = ServerProc::start(&data, &[]);
    assert!(server.log_text().contains("cut a torn journal tail"));
    assert_eq!(names(&server, "/g").len(), 20);
}

#[test]
fn clean_restart_recovers_everything_from_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let mut server = ServerProc::start(&data, &["--checkpoint-records", "500"]);
    create_files(&server, "/c", 2000);
    let addr = server.addr.to_string();
    let key = data.join("cluster.key");
    let fs = |args: &[&str]| {
        let out = Command::new(kochab_bin())
            .args(["fs", "--cluster", &addr, "--key-file"])
            .arg(&key)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kochab fs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    fs(&["mkdir", "-p", "/c/sub/deeper"]);
    fs(&["mv", "/c/f0001", "/c/sub/deeper/moved"]);
    fs(&["ln", "-s", "/c/sub", "/c/link"]);
    fs(&["ln", "/c/f0002", "/c/hard"]);
    fs(&["rm", "/c/f0003"]);
    assert_eq!(fs(&["readlink", "/c/link"]).trim(), "/c/sub");
    assert!(
        fs(&["ls", "/c/link/deeper"]).contains("moved"),
        "symlinks resolve"
    );
    let stat: serde_json::Value = serde_json::from_str(&fs(&["stat", "/c/hard"])).unwrap();
    assert_eq!(stat["nlink"], 2);
    assert_eq!(server.stop(), Some(0), "SIGTERM shuts down cleanly");

    let server = ServerProc::start(&data, &[]);
    let log = server.log_text();
    let last_start = log.rsplit("recovered").next().unwrap_or("");
    assert!(
        last_start.contains(" 0 journal records replayed"),
        "a clean shutdown leaves nothing to replay:\n{log}"
    );
    let got = names(&server, "/c");
    assert_eq!(got.len(), 2000 - 2 + 3, "{:?}", &got[..5]);
    let ls = Command::new(kochab_bin())
        .args(["fs", "--cluster", &server.addr.to_string(), "--key-file"])
        .arg(&key)
        .args(["ls", "-l", "/c/sub/deeper"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ls.stdout);
    let line = out
        .lines()
        .find(|l| l.ends_with(" moved"))
        .unwrap_or_else(|| panic!("no entry 'moved' in:\n{out}"));
    // As ls -l: mode, links, owner, group, size, "Mon DD HH:MM", name.
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 9, "{line}");
    assert!(f[5].len() == 3 && f[7].contains(':'), "{line}");
    let status = Command::new(kochab_bin())
        .args([
            "status",
            "--json",
            "--cluster",
            &server.addr.to_string(),
            "--key-file",
        ])
        .arg(&key)
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status json");
    assert!(status["inodes"].as_u64().unwrap() >= 2003);
    assert!(
        status["tables"].as_array().unwrap().len() >= 4,
        "a server hosts many tables"
    );
    let fsck = Command::new(kochab_bin())
        .args(["fsck", "--cluster", &server.addr.to_string(), "--key-file"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let kind = runtime().block_on(async {
        let c = server.client(1).await;
        c.resolve(&Credentials::root(), "/c/link", false)
            .await
            .unwrap()
            .kind()
    });
    assert_eq!(kind, Some(FileKind::Symlink));
}

#[test]
fn metrics_are_served_in_prometheus_text_format() {
    use std::io::{Read, Write};
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let log = tmp.path().join("log");
    let mut child = Command::new(kochab_bin())
        .args(["up", "--data"])
        .arg(&data)
        .args(["--port", "0", "--metrics-port", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let maddr = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if let Some(rest) = text.split("metrics at http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("no metrics address logged within 60 s:\n{text}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut s = std::net::TcpStream::connect(&maddr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    for name in [
        "kochab_operations_total",
        "kochab_operation_latency_seconds_bucket",
        "kochab_journal_fsync_seconds",
        "kochab_journal_records_per_fsync",
        "kochab_checkpoint_seconds",
        "kochab_table_inodes",
        "kochab_memory_rss_bytes",
    ] {
        assert!(body.contains(name), "{name} missing from:\n{body}");
    }
}

#[test]
fn logs_written_to_a_file_carry_no_colour_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let mut server = ServerProc::start(&data, &[]);
    assert_eq!(server.stop(), Some(0));
    let log = server.log_text();
    assert!(log.contains("INFO"), "no log lines at all:\n{log}");
    assert!(!log.contains('\x1b'), "escape codes in a log file:\n{log}");
}
