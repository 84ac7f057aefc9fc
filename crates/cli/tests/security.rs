//! Issue 7's trust-model and connection findings, each against real `kochab up` processes
//! on loopback: client keys with root squash and id ranges (`kochab key add|list|revoke`),
//! revocation of a live connection, mutual authentication (a server without the key is
//! refused), sessions bound to the key (another key holder cannot use a client's handles),
//! the small pre-authentication frame limit, reply backpressure, the metrics endpoint's
//! 404/405, client key file modes, and a default mount's nosuid,nodev.

mod common;

use common::{Cluster, ServerProc, kochab_bin, metric, runtime};
use kochab_client::conn::Conn;
use kochab_client::{Client, ClientConfig};
use kochab_proto::auth::{ClientKey, client_key_from_text};
use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, encode_frame, parse_header};
use kochab_proto::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const O_RDWR: u32 = 2;

/// Runs a `kochab` command to completion: exit code, stdout, stderr.
fn kochab(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(kochab_bin());
    cmd.args(args).env_remove("KOCHAB_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run kochab");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kochab key add` with the admin key: the new key file.
fn key_add(server: &ServerProc, dir: &Path, name: &str, extra: &[&str]) -> (PathBuf, ClientKey) {
    let out = dir.join(name);
    let addr = server.addr.to_string();
    let admin = server.data.join("cluster.key");
    let mut args = vec![
        "key",
        "--cluster",
        &addr,
        "--key-file",
        admin.to_str().unwrap(),
        "add",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = kochab(&args, &[]);
    assert_eq!(code, Some(0), "key add: {stdout} {stderr}");
    let key = client_key_from_text(&std::fs::read_to_string(&out).unwrap()).expect("key file");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "a new key file is private");
    (out, key)
}

async fn client_with(server: &ServerProc, key: ClientKey) -> FsResult<Client> {
    let mut cfg = ClientConfig::new(server.addr, key);
    cfg.attempts = 1;
    cfg.request_timeout = Duration::from_secs(10);
    Client::connect(cfg).await
}

fn errno_of<T>(r: FsResult<T>) -> Errno {
    match r {
        Ok(_) => panic!("must fail"),
        Err(e) => e.errno,
    }
}

#[test]
fn a_root_squashed_key_cannot_act_as_root_nor_make_a_setuid_root_file() {
    // The old server took uid/gid as the client sent them: any key holder was root.
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let (_, squashed) = key_add(&server, tmp.path(), "k1", &["--squash", "root"]);
    runtime().block_on(async {
        let admin = server.client(1).await;
        let root = Credentials::root();
        let rootdir = admin.root();
        // A root-only file, made with the admin key.
        let secret = admin
            .create(&root, rootdir, b"secret", 0o600)
            .await
            .expect("admin create");
        let (_, h) = admin.open(&root, secret.id, O_RDWR).await.unwrap();
        admin
            .write(&root, h, 0, b"root only".to_vec())
            .await
            .unwrap();
        admin.close(&root, h).await.unwrap();

        let c = client_with(&server, squashed)
            .await
            .expect("squashed key connects");
        // uid 0 is mapped to nobody: the 0600 root file is out of reach.
        assert_eq!(
            errno_of(c.open(&root, secret.id, O_RDWR).await),
            Errno::EACCES
        );
        // What it creates as "root" belongs to nobody.
        let dir = admin
            .mkdir(&root, rootdir, b"pub", 0o777)
            .await
            .expect("mkdir");
        let f = c
            .create(&root, dir.id, b"suid", 0o4755)
            .await
            .expect("create in a world-writable directory");
        assert_eq!((f.uid, f.gid), (NOBODY, NOBODY));
        // It cannot give its file to root, nor make a root file setuid.
        let chown = SetAttrs {
            uid: Some(0),
            ..Default::default()
        };
        assert_eq!(errno_of(c.setattr(&root, f.id, chown).await), Errno::EPERM);
        let chmod = SetAttrs {
            mode: Some(0o4755),
            ..Default::default()
        };
        assert_eq!(
            errno_of(c.setattr(&root, secret.id, chmod).await),
            Errno::EPERM
        );
        let a = admin.getattr(&root, f.id).await.unwrap();
        assert_ne!(a.uid, 0, "no setuid-root file exists");
        // Key administration is the admin key's alone.
        assert_eq!(
            errno_of(c.key_add(KeyPolicy::TRUSTED, "escalate").await),
            Errno::EPERM
        );
        assert_eq!(errno_of(c.key_list().await), Errno::EPERM);
    });
}

#[test]
fn an_all_squashed_key_and_id_ranges() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let (_, all) = key_add(&server, tmp.path(), "all", &["--squash", "all"]);
    let (_, ranged) = key_add(
        &server,
        tmp.path(),
        "ranged",
        &[
            "--squash",
            "none",
            "--uids",
            "1000-1999",
            "--gids",
            "1000-1999",
        ],
    );
    runtime().block_on(async {
        let admin = server.client(1).await;
        let root = Credentials::root();
        let pubdir = admin
            .mkdir(&root, admin.root(), b"pub", 0o777)
            .await
            .unwrap();

        let c = client_with(&server, all).await.unwrap();
        let f = c
            .create(&Credentials::user(1234, 1234), pubdir.id, b"a", 0o644)
            .await
            .unwrap();
        assert_eq!((f.uid, f.gid), (NOBODY, NOBODY), "every request is nobody");

        let c = client_with(&server, ranged).await.unwrap();
        let f = c
            .create(&Credentials::user(1500, 1500), pubdir.id, b"b", 0o644)
            .await
            .expect("inside the range");
        assert_eq!((f.uid, f.gid), (1500, 1500));
        for cred in [
            Credentials::user(2000, 1500),
            Credentials::user(0, 1500),
            Credentials::user(1500, 0),
        ] {
            assert_eq!(
                errno_of(c.getattr(&cred, pubdir.id).await),
                Errno::EPERM,
                "{cred:?} is outside the key's ranges"
            );
        }
        // A supplementary group outside the range is dropped, not honoured: group 0's
        // 0070 directory stays closed.
        let g0 = admin
            .mkdir(&root, admin.root(), b"g0", 0o070)
            .await
            .unwrap();
        let mut cred = Credentials::user(1500, 1500);
        cred.groups = vec![0];
        assert_eq!(
            errno_of(c.readdir_page(&cred, g0.id, 0, 10, false).await),
            Errno::EACCES
        );
    });
}

#[test]
fn by_id_a_key_holder_sees_attributes_and_what_file_modes_allow_past_a_0700_directory() {
    // What docs/SECURITY.md says ids reveal ("Inode ids are not secret"): requests by id
    // are checked against the inode named, not the directories above it, and a
    // directory's files take consecutive ids. Nothing here changed since 77a0d33; the
    // document did (it claimed ids came from a keyed policy).
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let (_, anonymous) = key_add(&server, tmp.path(), "k1", &["--squash", "all"]);
    runtime().block_on(async {
        let admin = server.client(1).await;
        let root = Credentials::root();
        let alice = Credentials::user(1000, 1000);
        let home = admin.mkdir(&root, admin.root(), b"alice", 0o700).await;
        let home = home.unwrap().id;
        let chown = SetAttrs {
            uid: Some(1000),
            gid: Some(1000),
            ..Default::default()
        };
        admin.setattr(&root, home, chown).await.unwrap();
        let mut files = Vec::new();
        for (name, mode) in [(&b"secret"[..], 0o600), (b"notes", 0o644)] {
            let f = admin.create(&alice, home, name, mode).await.unwrap();
            let (_, h) = admin.open(&alice, f.id, O_RDWR).await.unwrap();
            admin.write(&alice, h, 0, name.to_vec()).await.unwrap();
            admin.close(&alice, h).await.unwrap();
            files.push(f.id);
        }
        let [secret, notes] = files[..] else {
            unreachable!()
        };
        assert_eq!(
            notes,
            secret + 1,
            "a directory's files take consecutive ids"
        );

        // The weakest key: every request as the anonymous user, no groups.
        let c = client_with(&server, anonymous).await.expect("connects");
        let nobody = Credentials::user(NOBODY, NOBODY);
        assert_eq!(
            errno_of(c.lookup(&nobody, home, b"notes").await),
            Errno::EACCES,
            "names need search permission on the directory"
        );
        // By id: the attributes of what is inside, with no check at all...
        let a = c.getattr(&nobody, secret).await.expect("getattr by id");
        assert_eq!((a.mode & 0o7777, a.uid, a.size), (0o600, 1000, 6));
        // ...and the contents of a file whose own mode lets others read it.
        assert_eq!(
            errno_of(c.open(&nobody, secret, 0).await),
            Errno::EACCES,
            "the file's own mode holds"
        );
        let (_, h) = c.open(&nobody, secret + 1, 0).await.expect("open by id");
        assert_eq!(c.read(&nobody, h, 0, 100).await.unwrap(), b"notes");
        c.close(&nobody, h).await.unwrap();
    });
}

#[test]
fn a_revoked_key_is_refused_and_its_live_connection_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let (_, k) = key_add(&server, tmp.path(), "k", &[]);
    runtime().block_on(async {
        let conn = Conn::connect(server.addr, &k, 42, Duration::from_secs(5))
            .await
            .expect("connect");
        let req = Request {
            cred: Credentials::user(1000, 1000),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: Op::GetAttr { id: conn.root },
        };
        assert!(matches!(conn.call(&req).await, Ok(Reply::Attr(_))));

        let addr = server.addr.to_string();
        let admin = server.data.join("cluster.key");
        let (code, out, err) = kochab(
            &[
                "key",
                "--cluster",
                &addr,
                "--key-file",
                admin.to_str().unwrap(),
                "revoke",
                &k.id.to_string(),
            ],
            &[],
        );
        assert_eq!(code, Some(0), "{out} {err}");
        // The live connection is closed at once (a Goodbye with EACCES).
        for _ in 0..100 {
            if !conn.is_alive() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!conn.is_alive(), "the revoked key's connection is closed");
        assert!(conn.call(&req).await.is_err());
        // New connections are refused.
        assert_eq!(errno_of(client_with(&server, k).await), Errno::EACCES);
        let (code, out, _) = kochab(
            &[
                "key",
                "--cluster",
                &addr,
                "--key-file",
                admin.to_str().unwrap(),
                "list",
            ],
            &[],
        );
        assert_eq!(code, Some(0));
        assert!(out.contains("revoked"), "{out}");
    });
    // Durable: still revoked after a restart.
    let mut server = server;
    assert_eq!(server.stop(), Some(0));
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let err = runtime().block_on(client_with(&server, k));
    assert_eq!(errno_of(err), Errno::EACCES);
}

#[test]
fn another_key_holder_cannot_use_a_clients_handles() {
    // The reported attack: a second key holder presenting the first client's id shared
    // its session, and read and overwrote a 0600 root file through its handle.
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let (_, other) = key_add(&server, tmp.path(), "other", &["--squash", "none"]);
    let admin = ClientKey::admin(server.key);
    runtime().block_on(async {
        let t = Duration::from_secs(5);
        let call = |conn: std::sync::Arc<Conn>, op: Op| async move {
            let req = Request {
                cred: Credentials::root(),
                seq: 0,
                seq_floor: 0,
                map_version: 0,
                mode: Default::default(),
                op,
            };
            conn.call(&req).await.expect("reply")
        };
        let a = Conn::connect(server.addr, &admin, 4242, t).await.unwrap();
        let create = Op::Create {
            parent: a.root,
            name: b"secret".to_vec(),
            mode: 0o600,
            flags: O_RDWR,
            handle: 77,
        };
        assert!(matches!(
            call(a.clone(), create).await.without_dirs(),
            Reply::Entry(_)
        ));
        let write = |data: &[u8]| Op::Write {
            handle: 77,
            offset: 0,
            data: data.to_vec(),
        };
        assert!(!matches!(
            call(a.clone(), write(b"root only")).await,
            Reply::Error(_)
        ));

        let b = Conn::connect(server.addr, &other, 4242, t).await.unwrap();
        assert_ne!(a.session, b.session, "another key, another session");
        let read = Op::Read {
            handle: 77,
            offset: 0,
            len: 64,
            atime: AtimeRule::Never,
        };
        for op in [read.clone(), write(b"overwritten")] {
            match call(b.clone(), op).await {
                Reply::Error(e) => assert_eq!(e.errno, Errno::EBADF),
                other => panic!("the other key used the handle: {other:?}"),
            }
        }
        // The owner reconnecting with its own key resumes its session.
        let a2 = Conn::connect(server.addr, &admin, 4242, t).await.unwrap();
        assert_eq!(a2.session, a.session);
        match call(a2, read).await {
            Reply::Bytes(b) | Reply::ReadAtime(b) => assert_eq!(b, b"root only"),
            other => panic!("{other:?}"),
        }
    });
}

/// A one-connection fake server that answers the handshake without knowing the key.
#[test]
fn a_server_that_cannot_prove_the_key_is_refused() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut out = Vec::new();
        let ch = Challenge {
            version: PROTOCOL_VERSION,
            nonce: [5; 32],
        };
        encode_frame(&mut out, FrameKind::Challenge, 0, &ch).unwrap();
        s.write_all(&out).unwrap();
        let _ = read_frame(&mut s);
        out.clear();
        let w = Welcome {
            server_id: 1,
            root: 1,
            max_frame_bytes: 1 << 20,
            session: 1,
            mac: [0; 32],
            incarnation: 1,
            durable_lsn: 0,
            lease_ms: 0,
        };
        encode_frame(&mut out, FrameKind::Welcome, 0, &w).unwrap();
        let _ = s.write_all(&out);
        std::thread::sleep(Duration::from_millis(500));
    });
    let err = runtime().block_on(async {
        let mut cfg = ClientConfig::new(addr, [3u8; 32]);
        cfg.attempts = 1;
        Client::connect(cfg).await.err().expect("refused")
    });
    assert_eq!(err.errno, Errno::EACCES, "{err}");
    assert!(err.message.contains("did not prove"), "{err}");
    let _ = fake.join();
}

fn read_frame(s: &mut TcpStream) -> Option<(FrameKind, Vec<u8>)> {
    let mut buf = Vec::new();
    loop {
        if let Some(h) = parse_header(&buf).ok()? {
            return Some((h.kind, buf[FRAME_HEADER_BYTES..h.total_len].to_vec()));
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn before_authentication_only_small_frames_are_read() {
    // The old server accepted (and buffered) an 8 MiB frame from anyone.
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let (kind, _) = read_frame(&mut s).expect("challenge");
    assert_eq!(kind, FrameKind::Challenge);
    let mut head = ((64u32 << 10) + 9).to_le_bytes().to_vec();
    head.push(FrameKind::Auth as u8);
    head.extend_from_slice(&[0; 8]);
    s.write_all(&head).unwrap();
    let (kind, payload) = read_frame(&mut s).expect("goodbye");
    assert_eq!(kind, FrameKind::Goodbye);
    let e: FsError = decode_payload(&payload).unwrap();
    assert_eq!(e.errno, Errno::EPROTO);
    assert!(read_frame(&mut s).is_none(), "closed");
}

#[test]
fn unread_readdirplus_replies_do_not_grow_the_server() {
    // 2,000 pipelined readdirplus requests of a 1,000-entry directory, replies unread:
    // the old server made every reply (hundreds of MiB) and held them all.
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let rt = runtime();
    let (dir, rss_before) = rt.block_on(async {
        let c = server.client(1).await;
        let root = Credentials::root();
        let d = c.mkdir(&root, c.root(), b"big", 0o755).await.unwrap();
        for i in 0..1000 {
            let name = format!("entry-with-a-longish-name-{i:05}");
            c.mknod(&root, d.id, name.as_bytes(), 0o100644, 0, true)
                .await
                .unwrap();
        }
        (d.id, c.status().await.unwrap().rss_bytes)
    });
    let mut s = TcpStream::connect(server.addr).unwrap();
    let (_, payload) = read_frame(&mut s).expect("challenge");
    let ch: Challenge = decode_payload(&payload).unwrap();
    let mut out = Vec::new();
    let (auth, _) = Auth::prove(&ClientKey::admin(server.key), ch.nonce, [1; 32], 9);
    encode_frame(&mut out, FrameKind::Auth, 0, &auth).unwrap();
    s.write_all(&out).unwrap();
    assert_eq!(read_frame(&mut s).expect("welcome").0, FrameKind::Welcome);
    out.clear();
    for i in 0..2000 {
        let req = Request {
            cred: Credentials::root(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: Op::Readdir {
                id: dir,
                cookie: 0,
                max_entries: 1000,
                plus: true,
            },
        };
        encode_frame(&mut out, FrameKind::Request, i + 1, &req).unwrap();
    }
    // The server stops reading once its reply backlog is full: write from a thread.
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let _ = w.write_all(&out);
    });
    std::thread::sleep(Duration::from_secs(3));
    let rss_after = rt.block_on(async { server.client(1).await.status().await.unwrap().rss_bytes });
    let grown = rss_after.saturating_sub(rss_before);
    assert!(
        grown < 120 << 20,
        "the server grew by {} MiB with replies nobody reads",
        grown >> 20
    );
    drop(s);
}

#[test]
fn the_metrics_endpoint_serves_get_metrics_only() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &["--metrics-port", "0"]);
    let log = server.log_text();
    let url = log
        .lines()
        .find_map(|l| l.strip_prefix("kochab: metrics at http://"))
        .expect("metrics address in the log");
    let addr = url.trim_end_matches("/metrics").trim().to_string();
    let status = |req: &str| {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.split_whitespace().nth(1).unwrap_or("").to_string()
    };
    assert_eq!(status("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), "200");
    assert_eq!(status("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "404");
    assert_eq!(status("GET /admin HTTP/1.1\r\nHost: x\r\n\r\n"), "404");
    assert_eq!(status("POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), "405");
}

#[test]
fn a_key_file_others_can_read_is_refused_and_the_key_never_in_argv() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let open = tmp.path().join("open.key");
    std::fs::copy(server.data.join("cluster.key"), &open).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let addr = server.addr.to_string();
    let (code, _, err) = kochab(
        &[
            "status",
            "--cluster",
            &addr,
            "--key-file",
            open.to_str().unwrap(),
        ],
        &[],
    );
    assert_ne!(code, Some(0));
    assert!(err.contains("mode 644"), "{err}");
    // --key is no option any more; KOCHAB_KEY in the environment works.
    let hex = std::fs::read_to_string(server.data.join("cluster.key")).unwrap();
    let (code, _, _) = kochab(&["status", "--cluster", &addr, "--key", hex.trim()], &[]);
    assert_ne!(code, Some(0), "--key on the command line is refused");
    let (code, out, err) = kochab(
        &["status", "--cluster", &addr, "--key-file", "/nonexistent"],
        &[("KOCHAB_KEY", hex.trim())],
    );
    assert_eq!(code, Some(0), "{out} {err}");
}

#[test]
fn kochab_up_leaves_an_existing_data_directory_mode_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o750)).unwrap();
    let mut server = ServerProc::start(&data, &[]);
    assert_eq!(server.stop(), Some(0));
    let mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o750);
}

#[test]
fn a_default_mount_is_nosuid_and_nodev() {
    // The old mount honoured setuid bits and device nodes: a key holder's setuid-root
    // binary ran as root for any local user.
    let tmp = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster = Cluster::start(tmp.path(), &[]);
    let mnt = &cluster.mnt;
    let canon = std::fs::canonicalize(mnt).unwrap();
    let line = std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .find(|l| l.split_whitespace().nth(1) == canon.to_str())
        .map(str::to_string)
        .expect("mount line");
    let opts = line.split_whitespace().nth(3).unwrap_or("").to_string();
    assert!(opts.split(',').any(|o| o == "nosuid"), "{line}");
    assert!(opts.split(',').any(|o| o == "nodev"), "{line}");

    // A device node (the one of /dev/zero) cannot be opened.
    let node = mnt.join("zero");
    let c = std::ffi::CString::new(node.to_str().unwrap()).unwrap();
    // SAFETY: mknod with a valid C string.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 5)) };
    assert_eq!(r, 0, "mknod: {}", std::io::Error::last_os_error());
    let e = std::fs::File::open(&node).expect_err("nodev");
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");

    // A setuid-root copy of id(1) runs with the caller's ids.
    let id = mnt.join("id");
    std::fs::copy("/usr/bin/id", &id).unwrap();
    std::fs::set_permissions(&id, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--",
        ])
        .arg(&id)
        .arg("-u")
        .output()
        .expect("setpriv");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "65534");
}

/// Runs openssl; panics with its output if it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A certificate authority and a server certificate for 127.0.0.1 signed by it.
fn make_certs(dir: &Path, name: &str) {
    make_certs_for(dir, name, "IP:127.0.0.1");
}

/// A certificate authority `NAME-ca.pem` and a server certificate `server.pem` (key
/// `server.key`) signed by it, whose only subject-alternative name is `san`.
fn make_certs_for(dir: &Path, name: &str, san: &str) {
    let ca_key = format!("{name}-ca.key");
    let ca = format!("{name}-ca.pem");
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            &ca_key,
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &ca_key,
            "-subj",
            "/CN=kochab test CA",
            "-days",
            "2",
            "-out",
            &ca,
        ],
    );
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "server.key",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            "server.key",
            "-subj",
            "/CN=kochab test server",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.pem",
        ],
    );
}

#[test]
fn tls_round_trip_on_loopback() {
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    make_certs(&certs, "good");
    let cert = certs.join("server.pem");
    let key = certs.join("server.key");
    let server = ServerProc::start(
        &tmp.path().join("data"),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    runtime().block_on(async {
        let tls =
            kochab_client::tls::TlsClient::from_ca_file(&certs.join("good-ca.pem")).expect("CA");
        let mut cfg = ClientConfig::new(server.addr, server.key);
        cfg.tls = Some(tls);
        let c = Client::connect(cfg).await.expect("TLS connect");
        let root = Credentials::root();
        let f = c.create(&root, c.root(), b"over-tls", 0o644).await.unwrap();
        let (_, h) = c.open(&root, f.id, O_RDWR).await.unwrap();
        let data = vec![7u8; 300_000];
        c.write(&root, h, 0, data.clone()).await.unwrap();
        assert_eq!(c.read(&root, h, 0, 300_000).await.unwrap(), data);
        c.close(&root, h).await.unwrap();

        // Without TLS, or trusting another authority, nothing is served.
        let mut plain = ClientConfig::new(server.addr, server.key);
        plain.attempts = 1;
        plain.connect_timeout = Duration::from_secs(2);
        assert!(Client::connect(plain).await.is_err());
        let other = tmp.path().join("other");
        std::fs::create_dir(&other).unwrap();
        make_certs(&other, "other");
        let mut wrong = ClientConfig::new(server.addr, server.key);
        wrong.attempts = 1;
        wrong.tls =
            Some(kochab_client::tls::TlsClient::from_ca_file(&other.join("other-ca.pem")).unwrap());
        assert_eq!(errno_of(Client::connect(wrong).await), Errno::EACCES);
    });
}

#[test]
fn tls_checks_the_certificate_against_the_host_name_given() {
    // Issue 29, item 6: on 77a0d33 the client resolved `localhost` first and then checked
    // the certificate against 127.0.0.1, so a certificate for DNS:localhost was refused.
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    make_certs_for(&certs, "good", "DNS:localhost");
    let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
    let server = ServerProc::start(
        &tmp.path().join("data"),
        &[
            "--host",
            "localhost",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let port = server.addr.port();
    let admin = server.data.join("cluster.key");
    let ca = certs.join("good-ca.pem");
    let status = |cluster: &str| {
        kochab(
            &[
                "status",
                "--cluster",
                cluster,
                "--key-file",
                admin.to_str().unwrap(),
                "--tls-ca",
                ca.to_str().unwrap(),
            ],
            &[],
        )
    };
    let (code, out, err) = status(&format!("localhost:{port}"));
    assert_eq!(
        code,
        Some(0),
        "kochab status over TLS to localhost: {out} {err}"
    );
    // The address is not what the certificate names: refused.
    let numeric = server.addr.to_string();
    let (code, out, err) = status(&numeric);
    assert_ne!(code, Some(0), "{out}");
    assert!(err.contains("TLS handshake failed"), "{err}");
    // The library keeps the name given too.
    runtime().block_on(async {
        let spec = format!("localhost:{port}");
        let mut cfg = ClientConfig::named(&spec, server.key).unwrap();
        cfg.tls = Some(kochab_client::tls::TlsClient::from_ca_file(&ca).unwrap());
        let c = Client::connect(cfg).await.expect("TLS to localhost");
        c.getattr(&Credentials::root(), c.root()).await.unwrap();
    });
}

/// A connection made by hand: the handshake, then frames as they come. It answers no
/// callback unless told to (a holder of leases that misbehaves).
struct RawConn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl RawConn {
    /// Authenticates with the cluster key as client `client_id`, asking for leases.
    fn open(server: &ServerProc, client_id: u64) -> RawConn {
        let s = TcpStream::connect(server.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut c = RawConn { s, buf: Vec::new() };
        let (kind, _, payload) = c.next().expect("challenge");
        assert_eq!(kind, FrameKind::Challenge);
        let ch: Challenge = decode_payload(&payload).unwrap();
        let key = ClientKey::admin(server.key);
        let (mut auth, _) = Auth::prove(&key, ch.nonce, [client_id as u8; 32], client_id);
        auth.leases = true;
        c.send(FrameKind::Auth, 0, &auth);
        let (kind, _, payload) = c.next().expect("welcome");
        assert_eq!(kind, FrameKind::Welcome);
        let w: Welcome = decode_payload(&payload).unwrap();
        assert!(w.lease_ms > 0, "leases granted");
        c
    }

    fn send<T: serde::Serialize>(&self, kind: FrameKind, id: u64, msg: &T) {
        let mut out = Vec::new();
        encode_frame(&mut out, kind, id, msg).unwrap();
        (&self.s).write_all(&out).unwrap();
    }

    /// The next frame: its kind, request id and payload (`None`: closed).
    fn next(&mut self) -> Option<(FrameKind, u64, Vec<u8>)> {
        loop {
            if let Some(h) = parse_header(&self.buf).ok()? {
                let payload = self.buf[FRAME_HEADER_BYTES..h.total_len].to_vec();
                self.buf.drain(..h.total_len);
                return Some((h.kind, h.request_id, payload));
            }
            let mut chunk = [0u8; 4096];
            let n = self.s.read(&mut chunk).ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[test]
fn a_lease_holder_that_never_answers_costs_others_one_deadline_once() {
    // Issue 29, item 5. A client may look names up in a directory (search permission is
    // all it takes), so it holds a lease on the directory's names, which it renews four
    // times a second; it never answers a callback. On 77a0d33 each create of another
    // client in that directory waited for the lease to run out (about 5 s), create after
    // create; and any connection could answer any callback (ids are a counter).
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &["--metrics-port", "0"]);
    let rt = runtime();
    let root = Credentials::root();
    let (victim, dir) = rt.block_on(async {
        let c = server.client(1).await;
        let d = c.mkdir(&root, c.root(), b"shared", 0o755).await.unwrap();
        (c, d.id)
    });
    let mut holder = RawConn::open(&server, 1001);
    let writer = RawConn {
        s: holder.s.try_clone().unwrap(),
        buf: Vec::new(),
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let renewer = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut id = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let op = Op::Lookup {
                    parent: dir,
                    name: b"absent".to_vec(),
                };
                let req = Request::plain(&Credentials::root(), op);
                writer.send(FrameKind::Request, id, &req);
                id += 1;
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    });
    // Its callbacks' ids, as it sees them; and its first reply (a lease is held).
    let (seen_tx, seen) = std::sync::mpsc::channel::<Option<u64>>();
    let reader = std::thread::spawn(move || {
        while let Some((kind, id, _)) = holder.next() {
            match kind {
                FrameKind::Callback => {
                    let _ = seen_tx.send(Some(id));
                }
                FrameKind::Reply | FrameKind::Unsafe => {
                    let _ = seen_tx.send(None);
                }
                _ => {}
            }
        }
    });
    assert_eq!(seen.recv_timeout(Duration::from_secs(10)), Ok(None));
    // Another session answers the holder's callback as soon as it is sent.
    let spoofer = RawConn::open(&server, 2002);
    let spoof = std::thread::spawn(move || {
        loop {
            match seen.recv_timeout(Duration::from_secs(30)) {
                Ok(Some(id)) => {
                    spoofer.send(FrameKind::CallbackDone, id, &());
                    return true;
                }
                Ok(None) => {}
                Err(_) => return false,
            }
        }
    });

    let mut took = Vec::new();
    rt.block_on(async {
        for i in 0..5 {
            let started = std::time::Instant::now();
            let name = format!("f{i}");
            victim
                .create(&root, dir, name.as_bytes(), 0o644)
                .await
                .unwrap();
            took.push(started.elapsed());
        }
    });
    let total: Duration = took.iter().sum();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    renewer.join().unwrap();
    assert!(spoof.join().unwrap(), "the holder was called back");
    let metric = |name: &str| metric(&server, name);
    let missed = metric("kochab_callbacks_missed_total");
    let defaults = metric("kochab_callback_defaults_total");
    drop(reader);
    // The first create waited for the holder's deadline (the other session's answer did
    // not count); the holder then lost its lease, and the other creates waited for nobody.
    let lease = Duration::from_secs(5);
    let waited = took.iter().filter(|t| **t > lease / 2).count();
    assert_eq!(
        (missed, defaults, waited),
        (Some(1.0), Some(1.0), 1),
        "callbacks missed, holders in default, creates that waited (each took {took:?})"
    );
    assert!(
        total < lease * 3 / 2,
        "five creates took {total:?} (each {took:?})"
    );
}
